package serve

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	"distill/data"
	"distill/internal/teacherdial"
	pb "distill/proto/distill/v1"
	"google.golang.org/protobuf/proto"
)

func dialTeacher(t testing.TB, addr, token string) (pb.TeacherClient, *grpc.ClientConn) {
	t.Helper()
	conn, err := teacherdial.Dial(addr, teacherdial.Options{Token: token})
	if err != nil {
		t.Fatal(err)
	}
	return pb.NewTeacherClient(conn), conn
}

// scoreOnce sends one request on a fresh stream and returns the error.
func scoreOnce(cl pb.TeacherClient, r *pb.ScoreRequest) error {
	st, err := cl.Score(context.Background())
	if err != nil {
		return err
	}
	if err := st.Send(r); err != nil {
		return err
	}
	_, err = st.Recv()
	return err
}

func wantCode(t *testing.T, what string, err error, code codes.Code, sub string) {
	t.Helper()
	if status.Code(err) != code || !strings.Contains(status.Convert(err).Message(), sub) {
		t.Errorf("%s: got %v, want %s containing %q", what, err, code, sub)
	}
}

func TestBadRequests(t *testing.T) {
	mdir := tinyModel(t)
	tmp := t.TempDir()
	path, _ := writeIDsDataset(t, tmp, 10, 10, 512, 2)
	d := startDaemon(t, Config{Model: mdir, Cache: t.TempDir(), TokenBudget: 100, DataRoots: []string{tmp}})
	cl, conn := dialTeacher(t, d.Addr(), "")
	defer conn.Close()

	wantCode(t, "id out of range", scoreOnce(cl, &pb.ScoreRequest{Id: 7, Tokens: []int32{1, 512}}), codes.InvalidArgument, "sample id 7 position 1: token id 512 out of range [0, 512)")
	wantCode(t, "negative id", scoreOnce(cl, &pb.ScoreRequest{Tokens: []int32{-1}}), codes.InvalidArgument, "token id -1 out of range")
	wantCode(t, "empty", scoreOnce(cl, &pb.ScoreRequest{Id: 3}), codes.InvalidArgument, "sample id 3 is empty")
	wantCode(t, "over-long", scoreOnce(cl, &pb.ScoreRequest{Tokens: make([]int32, 101)}), codes.InvalidArgument, "101 tokens, more than the daemon's limit 100")
	wantCode(t, "k = 0", scoreOnce(cl, &pb.ScoreRequest{Tokens: []int32{1}, K: proto.Int32(0)}), codes.InvalidArgument, "k=0 out of range: want 1..512 (leave k unset for the default")
	wantCode(t, "k < 0", scoreOnce(cl, &pb.ScoreRequest{Tokens: []int32{1}, K: proto.Int32(-1)}), codes.InvalidArgument, "k=-1 out of range: want 1..512")
	wantCode(t, "k > vocab", scoreOnce(cl, &pb.ScoreRequest{Tokens: []int32{1}, K: proto.Int32(513)}), codes.InvalidArgument, "k=513 out of range")
	wantCode(t, "temperature", scoreOnce(cl, &pb.ScoreRequest{Tokens: []int32{1}, Temperature: -2}), codes.InvalidArgument, "temperature -2")

	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	fill := func(r *pb.FillRequest) error {
		st, err := cl.Fill(context.Background(), r)
		if err != nil {
			return err
		}
		for {
			if _, err := st.Recv(); err != nil {
				if isEOF(err) {
					return nil
				}
				return err
			}
		}
	}
	missing := filepath.Join(tmp, "nope.jsonl")
	wantCode(t, "unknown dataset", fill(&pb.FillRequest{Dataset: &pb.Dataset{Sources: []*pb.DataSource{{Path: missing}}, Pretokenized: true}, Start: 0, End: 1}),
		codes.NotFound, missing+" does not exist on the daemon's machine")
	wantCode(t, "range beyond", fill(&pb.FillRequest{Dataset: ds, Start: 5, End: 11}), codes.OutOfRange, "range [5, 11) goes beyond the dataset's 10 samples")
	wantCode(t, "empty range", fill(&pb.FillRequest{Dataset: ds, Start: 5, End: 5}), codes.InvalidArgument, "range [5, 5)")
	wantCode(t, "fill k = 0", fill(&pb.FillRequest{Dataset: ds, Start: 0, End: 1, K: proto.Int32(0)}), codes.InvalidArgument, "k=0")
	wantCode(t, "fill k", fill(&pb.FillRequest{Dataset: ds, Start: 0, End: 1, K: proto.Int32(600)}), codes.InvalidArgument, "k=600")
	wantCode(t, "no sources", fill(&pb.FillRequest{Dataset: &pb.Dataset{}, Start: 0, End: 1}), codes.InvalidArgument, "no sources")
	wantCode(t, "encoding", fill(&pb.FillRequest{Dataset: ds, Start: 0, End: 1, Encoding: "zip"}), codes.InvalidArgument, `encoding "zip"`)
	wantCode(t, "no tokenizer", fill(&pb.FillRequest{Dataset: &pb.Dataset{Sources: ds.Sources}, Start: 0, End: 1}), codes.FailedPrecondition, "no tokenizer")
	wantCode(t, "fingerprint", fill(&pb.FillRequest{Dataset: ds, Start: 0, End: 1, ExpectDatasetFingerprint: "abc"}), codes.FailedPrecondition, "the client expects abc")
	wantCode(t, "draws beyond max_draws", fill(&pb.FillRequest{Dataset: ds, Start: 0, End: 1, Targets: "sampled", Samples: 65}), codes.InvalidArgument,
		"samples 65: this daemon plans its device memory for at most 64 draws per position (teacherd --max-draws or config max_draws sets it)")

	// A fill with another k than the cache holds: the field is named.
	if err := fill(&pb.FillRequest{Dataset: ds, Start: 0, End: 2, K: proto.Int32(4)}); err != nil {
		t.Fatal(err)
	}
	wantCode(t, "cache mismatch", fill(&pb.FillRequest{Dataset: ds, Start: 2, End: 4, K: proto.Int32(5)}), codes.FailedPrecondition, "field k differs")

	// A daemon of its own: a failed fill still binds its cache directory
	// to the dataset it was asked for.
	d3 := startDaemon(t, Config{Model: mdir, Cache: t.TempDir(), DataRoots: []string{tmp}})
	cl3, conn3 := dialTeacher(t, d3.Addr(), "")
	defer conn3.Close()
	fill3 := func(r *pb.FillRequest) error {
		st, err := cl3.Fill(context.Background(), r)
		if err != nil {
			return err
		}
		_, err = st.Recv()
		return err
	}
	// Out-of-vocab ids in a pre-tokenized file name the file and line.
	bad := filepath.Join(tmp, "bad.jsonl")
	os.WriteFile(bad, []byte("{\"input_ids\": [1, 2]}\n{\"input_ids\": [3, 9999]}\n"), 0o644)
	wantCode(t, "bad ids in data", fill3(&pb.FillRequest{Dataset: &pb.Dataset{Sources: []*pb.DataSource{{Path: bad}}, Pretokenized: true}, Start: 0, End: 2}),
		codes.InvalidArgument, "bad.jsonl:2")

	// Without a cache directory Fill is refused.
	d2 := startDaemon(t, Config{Model: mdir, DataRoots: []string{tmp}})
	cl2, conn2 := dialTeacher(t, d2.Addr(), "")
	defer conn2.Close()
	st, _ := cl2.Fill(context.Background(), &pb.FillRequest{Dataset: ds, Start: 0, End: 1})
	_, err := st.Recv()
	wantCode(t, "no cache", err, codes.FailedPrecondition, "--cache DIR")
}

func TestAuthHealthInfoAndDevice(t *testing.T) {
	mdir := tinyModel(t)
	tf := filepath.Join(t.TempDir(), "token")
	os.WriteFile(tf, []byte("s3cret\n"), 0o600)
	d := startDaemon(t, Config{Model: mdir, TokenFile: tf})
	cl, conn := dialTeacher(t, d.Addr(), "")
	defer conn.Close()
	_, err := cl.Info(context.Background(), &pb.InfoRequest{})
	wantCode(t, "no token", err, codes.Unauthenticated, "bearer token")
	// Health stays open (probes carry no token) and says SERVING.
	h, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{Service: "distill.v1.Teacher"})
	if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health: %v %v", h, err)
	}
	cl2, conn2 := dialTeacher(t, d.Addr(), "wrong")
	defer conn2.Close()
	_, err = cl2.Info(context.Background(), &pb.InfoRequest{})
	wantCode(t, "wrong token", err, codes.Unauthenticated, "bearer token")
	cl3, conn3 := dialTeacher(t, d.Addr(), "s3cret")
	defer conn3.Close()
	info, err := cl3.Info(context.Background(), &pb.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.GetVocabSize() != 512 || info.GetArchitecture() != "qwen3" || info.GetDevice() != "cpu" || info.GetKMax() != 512 ||
		info.GetMaxPositions() != 256 || len(info.GetTeacherFingerprint()) != 64 {
		t.Errorf("info %v", info)
	}

	// --device cuda where there is no driver (forced: the driver's library
	// is a missing file): the daemon does not start, and says what is
	// missing. A bad name is refused before listening.
	t.Setenv("DISTILL_LIBCUDA", filepath.Join(t.TempDir(), "libcuda.so.1"))
	_, err = Start(Config{Model: mdir, Device: "cuda", Listen: "127.0.0.1:0", Metrics: "off"}, nil)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "DISTILL_LIBCUDA") || !strings.Contains(err.Error(), "--device cuda") {
		t.Errorf("--device cuda without a driver: %v", err)
	}
	_, err = Start(Config{Model: mdir, Device: "tpu", Listen: "127.0.0.1:0", Metrics: "off"}, nil)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "want auto, cpu or cuda") {
		t.Errorf("--device tpu: %v", err)
	}
}

// statsTap passes the batcher's stats on and reports each queue depth it
// is told on depths (dropped when nobody listens).
type statsTap struct {
	batcherStats
	depths chan int
}

func (s statsTap) queued(jobs, tokens int) {
	s.batcherStats.queued(jobs, tokens)
	select {
	case s.depths <- jobs:
	default:
	}
}

// gateDaemon puts a blocking gate in front of every forward of d's batcher
// (see gatedForward) and taps its queue depth; the test's cleanup opens
// the gate before the daemon shuts down.
func gateDaemon(t *testing.T, d *Daemon) (*fakeForward, <-chan int) {
	f := gatedForward()
	depths := make(chan int, 64)
	b := d.Core().b
	b.mu.Lock() // the worker reads fwd and stats after taking b.mu
	real := b.fwd
	b.fwd = func(s [][]int32, k int, temp float32) ([]int32, []float32) {
		f.entered <- s
		<-f.gate
		return real(s, k, temp)
	}
	b.stats = statsTap{b.stats, depths}
	b.mu.Unlock()
	t.Cleanup(f.openGate)
	return f, depths
}

// TestQueueFullIsResourceExhausted: one sample computes (held in its
// forward by a gate), two fill the 2-sample queue, and a Score sample sent
// then is refused at once with ResourceExhausted; the queued ones are
// served when the forward goes on.
func TestQueueFullIsResourceExhausted(t *testing.T) {
	mdir := tinyModel(t)
	d := startDaemon(t, Config{Model: mdir, QueueSamples: 2})
	f, depths := gateDaemon(t, d)
	cl, conn := dialTeacher(t, d.Addr(), "")
	defer conn.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st, err := cl.Score(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&pb.ScoreRequest{Id: 0, Tokens: []int32{1, 2, 3}}); err != nil {
		t.Fatal(err)
	}
	f.inForward()
	for i := 1; i <= 2; i++ {
		if err := st.Send(&pb.ScoreRequest{Id: int64(i), Tokens: []int32{1, 2, 3}}); err != nil {
			t.Fatal(err)
		}
	}
	for n := 0; n != 2; n = <-depths {
	}
	// The queue is full and stays so while the gate is shut.
	st2, err := cl.Score(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st2.Send(&pb.ScoreRequest{Id: 3, Tokens: []int32{1, 2, 3}}); err != nil {
		t.Fatal(err)
	}
	refused := make(chan error, 1)
	go func() { _, err := st2.Recv(); refused <- err }()
	for {
		select {
		case err = <-refused:
			wantCode(t, "full queue", err, codes.ResourceExhausted, "work queue full")
		case n := <-depths:
			if n > 2 {
				t.Fatalf("a 2-sample queue took sample 3: %d queued", n)
			}
			continue
		}
		break
	}
	f.openGate()
	for i := 0; i <= 2; i++ {
		r, err := st.Recv()
		if err != nil || r.GetId() != int64(i) {
			t.Fatalf("queued sample %d after the gate opened: %v, %v", i, r, err)
		}
	}
}

func TestFillRefusesDisagreeingTeachers(t *testing.T) {
	mdir := tinyModel(t)
	// Another checkpoint: same shape, other weights.
	other := t.TempDir()
	for _, f := range []string{"config.json", "model.safetensors"} {
		b, err := os.ReadFile(filepath.Join(mdir, f))
		if err != nil {
			t.Fatal(err)
		}
		if f == "model.safetensors" {
			b[len(b)-1] ^= 1
		}
		os.WriteFile(filepath.Join(other, f), b, 0o644)
	}
	root := t.TempDir()
	path, _ := writeIDsDataset(t, root, 10, 10, 512, 2)
	a := startDaemon(t, Config{Model: mdir, Cache: t.TempDir(), DataRoots: []string{root}})
	b := startDaemon(t, Config{Model: other, Cache: t.TempDir(), DataRoots: []string{root}})
	wa, _ := Dial(a.Addr(), DialOptions{})
	wb, _ := Dial(b.Addr(), DialOptions{})
	defer wa.Close()
	defer wb.Close()
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	_, err := RunFill(context.Background(), []Worker{wa, wb}, FillPlan{Dataset: ds})
	if err == nil || !strings.Contains(err.Error(), "teachers disagree on the teacher fingerprint") || !strings.Contains(err.Error(), b.Addr()) {
		t.Fatalf("different checkpoints: %v", err)
	}
	_, err = RunFill(context.Background(), []Worker{wa}, FillPlan{Dataset: &pb.Dataset{Sources: ds.Sources}, TokenizerFingerprint: "abc"})
	if err == nil || !strings.Contains(err.Error(), "no tokenizer") {
		t.Fatalf("text dataset on a daemon without tokenizer: %v", err)
	}
	// Nothing was written: the refusal came before any work.
	st, _ := wa.Status(context.Background(), &pb.StatusRequest{})
	if st.GetTokensTotal() != 0 {
		t.Errorf("work was done before the refusal: %v", st)
	}
}

func TestMetricsAndReflection(t *testing.T) {
	mdir := tinyModel(t)
	d := startDaemon(t, Config{Model: mdir})
	cl, conn := dialTeacher(t, d.Addr(), "")
	defer conn.Close()
	if err := scoreOnce(cl, &pb.ScoreRequest{Tokens: []int32{1, 2, 3}}); err != nil {
		t.Fatal(err)
	}
	scoreOnce(cl, &pb.ScoreRequest{Tokens: []int32{9999}})
	resp, err := http.Get("http://" + d.MetricsAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{"teacherd_tokens_total 3", "teacherd_batch_fill_ratio_bucket", "teacherd_queue_depth",
		`teacherd_requests_total{code="InvalidArgument",method="Score"} 1`, `teacherd_request_seconds_bucket{method="Score.sample"`} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	// Reflection lists the service, as grpcurl list does.
	rc, err := reflectpb.NewServerReflectionClient(conn).ServerReflectionInfo(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	rc.Send(&reflectpb.ServerReflectionRequest{MessageRequest: &reflectpb.ServerReflectionRequest_ListServices{}})
	r, err := rc.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range r.GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	if !strings.Contains(strings.Join(names, " "), "distill.v1.Teacher") || !strings.Contains(strings.Join(names, " "), "grpc.health.v1.Health") {
		t.Errorf("reflection lists %v", names)
	}
}

// selfSigned writes a certificate for 127.0.0.1 and its key.
func selfSigned(t *testing.T, dir string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "teacherd-test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kb, _ := x509.MarshalECPrivateKey(key)
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600)
	return certFile, keyFile
}

func TestTLSAndConcurrencyLimit(t *testing.T) {
	mdir := tinyModel(t)
	cert, key := selfSigned(t, t.TempDir())
	d := startDaemon(t, Config{Model: mdir, TLSCert: cert, TLSKey: key, MaxConcurrent: 1})
	w, err := Dial(d.Addr(), DialOptions{CAFile: cert})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := w.Info(context.Background()); err != nil {
		t.Fatalf("Info over TLS: %v", err)
	}
	plain, _ := Dial(d.Addr(), DialOptions{})
	defer plain.Close()
	if _, err := plain.Info(context.Background()); status.Code(err) != codes.Unavailable {
		t.Errorf("plaintext to a TLS daemon: %v", err)
	}
	// One open Score stream holds the only slot: the next RPC is refused.
	conn := w.(*remote).conn
	st, err := pb.NewTeacherClient(conn).Score(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	st.Send(&pb.ScoreRequest{Tokens: []int32{1}})
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	_, err = w.Info(context.Background())
	wantCode(t, "over the concurrency limit", err, codes.ResourceExhausted, "too many concurrent requests (limit 1")
	// The interceptor frees the slot before the server sends the stream's
	// status, so once Recv has it the next RPC fits: no waiting.
	st.CloseSend()
	if _, err := st.Recv(); err != io.EOF {
		t.Fatalf("end of the Score stream: %v", err)
	}
	if _, err := w.Info(context.Background()); err != nil {
		t.Errorf("after the stream ended: %v", err)
	}
}

// TestNotServingWhileLoading: before the core is set the health service
// says NOT_SERVING and the Teacher RPCs answer Unavailable.
func TestNotServingWhileLoading(t *testing.T) {
	gs, srv := NewGRPCServer(ServerOptions{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go gs.Serve(lis)
	defer gs.Stop()
	cl, conn := dialTeacher(t, lis.Addr().String(), "")
	defer conn.Close()
	h, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{})
	if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("health while loading: %v %v", h, err)
	}
	_, err = cl.Info(context.Background(), &pb.InfoRequest{})
	wantCode(t, "Info while loading", err, codes.Unavailable, "still loading")
	c, err := NewCore(CoreOptions{ModelDir: tinyModel(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	srv.SetCore(c)
	h, err = healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{})
	if err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health once loaded: %v %v", h, err)
	}
}

// Teachers with different --k-default and a fill without --k: the
// directories would get different k and could not be read as one cache;
// the fill must refuse before any work.
func TestFillRefusesDifferentDefaultK(t *testing.T) {
	mdir := tinyModel(t)
	path, _ := writeIDsDataset(t, t.TempDir(), 8, 10, 512, 3)
	var ws []Worker
	for _, kd := range []int{4, 8} {
		c, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: t.TempDir(), KDefault: kd})
		if err != nil {
			t.Fatal(err)
		}
		w := Local(c)
		defer w.Close()
		ws = append(ws, w)
	}
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	_, err := RunFill(context.Background(), ws, FillPlan{Dataset: ds, ChunkSamples: 2})
	if err == nil || !strings.Contains(err.Error(), "k") {
		t.Fatalf("fill over teachers with k defaults 4 and 8: %v", err)
	}
	for _, w := range ws {
		st, _ := w.Status(context.Background(), &pb.StatusRequest{})
		if st.GetTokensTotal() != 0 {
			t.Errorf("work was done before the refusal")
		}
	}
}

// A fill interrupted by its caller (Ctrl-C in cachectl) says so, not that
// no teacher could take the chunks.
func TestFillInterruptedSaysSo(t *testing.T) {
	mdir := tinyModel(t)
	path, _ := writeIDsDataset(t, t.TempDir(), 12, 10, 512, 4)
	c, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	w := Local(c)
	defer w.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	_, err = RunFill(ctx, []Worker{w}, FillPlan{Dataset: ds, ChunkSamples: 1, PerWorker: 1,
		onChunk: func(Worker, *pb.FillResponse) { cancel() }})
	if err == nil || strings.Contains(err.Error(), "no teacher could take them") || !strings.Contains(err.Error(), "interrupted") {
		t.Fatalf("interrupted fill: %v", err)
	}
	if !errors.Is(err, ErrFill) || !errors.Is(err, context.Canceled) || strings.HasPrefix(err.Error(), "fill") {
		t.Errorf("interrupted fill: %v: want an ErrFill wrapping the context's cause, not prefixed with fill", err)
	}
}

// TestFillErrorsSayFillOnce: RunFill's errors are ErrFill (errors.Is)
// without "fill: " in their text: the command that runs the fill names it
// (it said "cachectl fill: fill: ..."); what they wrap stays visible.
func TestFillErrorsSayFillOnce(t *testing.T) {
	mdir := tinyModel(t)
	dir := t.TempDir()
	path, _ := writeIDsDataset(t, dir, 6, 10, 512, 5)
	c, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	w := Local(c)
	defer w.Close()
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	_, err = RunFill(context.Background(), []Worker{w}, FillPlan{Dataset: ds, End: 100})
	if want := "range [0, 100) goes beyond the dataset's 6 samples: lower --end"; !errors.Is(err, ErrFill) || err.Error() != want {
		t.Errorf("--end past the dataset: %v, want ErrFill %q", err, want)
	}
	// A bad record, in process: the data package's error stays wrapped
	// (cachectl fill adds its --skip-bad hint by it).
	bad := filepath.Join(dir, "bad.jsonl")
	os.WriteFile(bad, []byte("{\"input_ids\": [1, 2, 3]}\n{nope\n"), 0o644)
	ds = &pb.Dataset{Sources: []*pb.DataSource{{Path: bad}}, Pretokenized: true}
	_, err = RunFill(context.Background(), []Worker{w}, FillPlan{Dataset: ds, ChunkSamples: 1})
	if !errors.Is(err, ErrFill) || !errors.Is(err, data.ErrBadRecord) || strings.Contains(err.Error(), "fill: ") {
		t.Errorf("a bad record: %v, want ErrFill wrapping data.ErrBadRecord, without fill in its text", err)
	}
}

// A re-run asking for another k (or temperature, encoding) than the
// complete cache holds must not report success: the cache does not hold
// what was asked for.
func TestFillRerunWithOtherKRefused(t *testing.T) {
	mdir := tinyModel(t)
	path, _ := writeIDsDataset(t, t.TempDir(), 6, 10, 512, 5)
	c, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	w := Local(c)
	defer w.Close()
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	if _, err := RunFill(context.Background(), []Worker{w}, FillPlan{Dataset: ds, ChunkSamples: 3, K: 4}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []FillPlan{{K: 8}, {K: 4, Temperature: 2}, {K: 4, Encoding: "lossless"}} {
		p.Dataset, p.ChunkSamples = ds, 3
		if _, err := RunFill(context.Background(), []Worker{w}, p); err == nil || !strings.Contains(err.Error(), "differs") {
			t.Errorf("re-run with k %d, temperature %v, encoding %q over a complete cache: %v", p.K, p.Temperature, p.Encoding, err)
		}
	}
}

// samePath is a teacher on another machine whose cache directory has the
// same path as another teacher's (--cache /data/cache on every node).
type samePath struct {
	Worker
	name string
}

func (s samePath) Name() string { return s.name }
func (s samePath) Info(ctx context.Context) (*pb.InfoResponse, error) {
	r, err := s.Worker.Info(ctx)
	if r != nil {
		r.CacheDir = "/data/cache"
	}
	return r, err
}

// Two teachers on two machines, each with --cache /data/cache: their
// directories are two caches, and the fill must not take one for the other.
func TestFillTwoMachinesSameCachePath(t *testing.T) {
	mdir := tinyModel(t)
	path, samples := writeIDsDataset(t, t.TempDir(), 40, 10, 512, 6)
	dirs := []string{t.TempDir(), t.TempDir()}
	var ws []Worker
	for i, d := range dirs {
		c, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: d, TokenBudget: 100})
		if err != nil {
			t.Fatal(err)
		}
		w := samePath{Local(c), fmt.Sprintf("node%d:7070", i)}
		defer w.Close()
		ws = append(ws, w)
	}
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	plan := FillPlan{Dataset: ds, ChunkSamples: 4, K: 4, Encoding: "lossless", PerWorker: 1}
	if _, err := RunFill(context.Background(), ws, plan); err != nil {
		t.Fatal(err)
	}
	sum, err := RunFill(context.Background(), ws, plan)
	if err != nil || sum.Chunks != 0 {
		t.Fatalf("re-run: %+v, %v", sum, err)
	}
	checkAgainstForward(t, ws[0].(samePath).Worker.(*local).c.Model(), samples, 4, 100, dirs...)
}

// Two teachers sharing one directory on one machine: every chunk is seen
// through both, which is not a duplicate.
func TestFillSharedDirectoryNoDuplicates(t *testing.T) {
	mdir := tinyModel(t)
	path, samples := writeIDsDataset(t, t.TempDir(), 24, 10, 512, 7)
	dir := t.TempDir()
	var ws []Worker
	for i := 0; i < 2; i++ {
		c, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: dir, TokenBudget: 100})
		if err != nil {
			t.Fatal(err)
		}
		w := samePath{Local(c), fmt.Sprintf("local%d", i)}
		defer w.Close()
		ws = append(ws, w)
	}
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	var out strings.Builder
	plan := FillPlan{Dataset: ds, ChunkSamples: 4, K: 4, Encoding: "lossless", PerWorker: 1, Out: &out}
	if _, err := RunFill(context.Background(), ws, plan); err != nil {
		t.Fatal(err)
	}
	if _, err := RunFill(context.Background(), ws, plan); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out.String(), "died before reporting") {
		t.Errorf("shared directory reported as duplicates:\n%s", out.String())
	}
	checkAgainstForward(t, ws[0].(samePath).Worker.(*local).c.Model(), samples, 4, 100, dir)
}

// A Fill that fails before its first commit (a record with an id outside
// the vocabulary) must not lock the daemon's cache to its dataset: the
// next request, for another dataset, fills (before the fix: "manifest
// mismatch: dataset_fingerprint" until the daemon's cache was deleted).
func TestFailedFillDoesNotLockDaemonCache(t *testing.T) {
	mdir := tinyModel(t)
	tmp := t.TempDir()
	bad := filepath.Join(tmp, "bad.jsonl")
	os.WriteFile(bad, []byte("{\"input_ids\":[1,2,3]}\n{\"input_ids\":[4,9999,6]}\n{\"input_ids\":[7,8,9]}\n"), 0o644)
	good, _ := writeIDsDataset(t, tmp, 6, 10, 512, 6)
	c, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: filepath.Join(tmp, "cache")})
	if err != nil {
		t.Fatal(err)
	}
	w := Local(c)
	defer w.Close()
	plan := func(path string) FillPlan {
		return FillPlan{Dataset: &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}, ChunkSamples: 3, K: 4}
	}
	if _, err := RunFill(context.Background(), []Worker{w}, plan(bad)); err == nil || !strings.Contains(err.Error(), "9999") {
		t.Fatalf("fill of a dataset with a bad id: %v, want an error naming it", err)
	}
	sum, err := RunFill(context.Background(), []Worker{w}, plan(good))
	if err != nil {
		t.Fatalf("fill of another dataset after a fill that committed nothing: %v", err)
	}
	if sum.Samples != 6 {
		t.Fatalf("second fill: %d samples, want 6", sum.Samples)
	}
	if _, err := RunFill(context.Background(), []Worker{w}, plan(bad)); err == nil || !strings.Contains(err.Error(), "dataset_fingerprint") {
		t.Fatalf("a fill of another dataset once chunks are committed: %v, want a manifest mismatch", err)
	}
}
