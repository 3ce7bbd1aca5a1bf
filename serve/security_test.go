package serve

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"distill/compute"
	"distill/compute/device"
	"distill/internal/teacherdial"
	pb "distill/proto/distill/v1"
)

// passwd is content no client may see back through an error.
const passwd = "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"

// fillErr runs one Fill to its end and returns its error.
func fillOnce(cl pb.TeacherClient, r *pb.FillRequest) error {
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

func describeOnce(cl pb.TeacherClient, path, format string) error {
	_, err := cl.DescribeDataset(context.Background(), &pb.DescribeDatasetRequest{Dataset: &pb.Dataset{
		Sources: []*pb.DataSource{{Path: path, Format: format}}, Pretokenized: true}})
	return err
}

// TestDataRootsConfineDatasets: a client names files on the daemon's
// machine, so only files under --data-root are readable; symlinks and
// ".." are resolved before the check, and a refusal does not tell a file
// outside the roots from a missing one. No roots: no file at all. The
// in-process teacher (cachectl fill --model, the user's own process)
// stays unconfined.
func TestDataRootsConfineDatasets(t *testing.T) {
	mdir := tinyModel(t)
	root, outside := t.TempDir(), t.TempDir()
	ok, _ := writeIDsDataset(t, root, 5, 8, 512, 1)
	secret := filepath.Join(outside, "passwd.csv")
	os.WriteFile(secret, []byte(passwd), 0o644)
	inOutside, _ := writeIDsDataset(t, outside, 5, 8, 512, 2) // a valid dataset, but outside
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Symlink(secret, filepath.Join(root, "escape.csv")))
	must(os.Symlink(outside, filepath.Join(root, "outdir")))
	must(os.Symlink(ok, filepath.Join(root, "alias.jsonl")))
	must(os.Symlink(filepath.Join(outside, "nope.jsonl"), filepath.Join(root, "dangling.jsonl")))
	must(os.Mkdir(filepath.Join(root, "sub"), 0o755))

	d := startDaemon(t, Config{Model: mdir, Cache: t.TempDir(), DataRoots: []string{root}})
	cl, conn := dialTeacher(t, d.Addr(), "")
	defer conn.Close()

	for _, p := range []string{ok, filepath.Join(root, "alias.jsonl"), filepath.Join(root, "sub", "..", "data.jsonl")} {
		if err := describeOnce(cl, p, ""); err != nil {
			t.Errorf("%s (under the root): %v", p, err)
		}
	}
	if err := fillOnce(cl, &pb.FillRequest{Dataset: &pb.Dataset{Sources: []*pb.DataSource{{Path: ok}}, Pretokenized: true}, Start: 0, End: 5, K: ptr(int32(4))}); err != nil {
		t.Errorf("fill under the root: %v", err)
	}

	denied := []string{
		secret,                             // outside, exists
		filepath.Join(outside, "nope.csv"), // outside, missing
		inOutside,                          // outside, a valid dataset
		filepath.Join(root, "..", filepath.Base(outside), "passwd.csv"), // ".." out of the root
		filepath.Join(root, "escape.csv"),                               // a symlink out of the root
		filepath.Join(root, "outdir", "passwd.csv"),                     // through a symlinked directory
		filepath.Join(root, "outdir", "nope.csv"),                       // missing, through a symlinked directory
		filepath.Join(root, "dangling.jsonl"),                           // a symlink to a missing file outside
		"/etc/passwd",
	}
	msgOf := func(err error, p string) string {
		return strings.ReplaceAll(status.Convert(err).Message(), p, "PATH")
	}
	var first string
	for _, p := range denied {
		for name, err := range map[string]error{
			"describe": describeOnce(cl, p, "csv"),
			"fill":     fillOnce(cl, &pb.FillRequest{Dataset: &pb.Dataset{Sources: []*pb.DataSource{{Path: p, Format: "csv"}}, Pretokenized: true}, Start: 0, End: 1}),
		} {
			if status.Code(err) != codes.PermissionDenied {
				t.Errorf("%s %s: got %v, want PermissionDenied", name, p, err)
				continue
			}
			m := msgOf(err, p)
			if strings.Contains(m, "root:x") || strings.Contains(m, "samples") {
				t.Errorf("%s %s: the refusal shows content: %s", name, p, m)
			}
			if first == "" {
				first = m
			} else if m != first {
				t.Errorf("%s %s: refusals differ, so they tell files apart:\n%s\n%s", name, p, m, first)
			}
		}
	}
	t.Logf("refusal: %s", first)
	if !strings.Contains(first, "--data-root") || !strings.Contains(first, root) {
		t.Errorf("the refusal does not say how to fix it: %s", first)
	}
	wantCode(t, "relative path", describeOnce(cl, "../../etc/shadow", ""), codes.InvalidArgument, "is relative: give the absolute path")
	wantCode(t, "missing under the root", describeOnce(cl, filepath.Join(root, "sub", "nope.jsonl"), ""), codes.NotFound, "does not exist on the daemon's machine")
	wantCode(t, "a directory", describeOnce(cl, filepath.Join(root, "sub"), "jsonl"), codes.InvalidArgument, "not a regular file")

	// Without --data-root every path is refused, and the message says why.
	d0 := startDaemon(t, Config{Model: mdir, Cache: t.TempDir()})
	cl0, conn0 := dialTeacher(t, d0.Addr(), "")
	defer conn0.Close()
	wantCode(t, "no roots", describeOnce(cl0, ok, ""), codes.PermissionDenied, "started without --data-root")

	// The in-process teacher reads what its user names.
	c, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: t.TempDir()})
	must(err)
	w := Local(c)
	defer w.Close()
	if r, err := w.Describe(context.Background(), &pb.Dataset{Sources: []*pb.DataSource{{Path: inOutside}}, Pretokenized: true}); err != nil || r.GetSamples() != 5 {
		t.Errorf("in-process teacher on a path outside any root: %v, %v", r, err)
	}
}

func ptr[T any](v T) *T { return &v }

// TestClientErrorsShowNoFileContent: a dataset whose records are not what
// the daemon expects gets a code, a location and a reason, but no text of
// the file (the CSV case answered "its non-null keys: root:x:0:0:..."); the
// detail is in the daemon's log under the request id the message gives.
// The in-process teacher, the user's own process, keeps the detail.
func TestClientErrorsShowNoFileContent(t *testing.T) {
	mdir := tinyModel(t)
	root := t.TempDir()
	csvPath := filepath.Join(root, "users.csv")
	os.WriteFile(csvPath, []byte(passwd), 0o644)
	dup := filepath.Join(root, "dup.csv")
	os.WriteFile(dup, []byte("root:x:0,root:x:0\n1,2\n"), 0o644)
	core, logs := observer.New(zap.InfoLevel)
	cfg := Config{Model: mdir, Cache: t.TempDir(), DataRoots: []string{root}, Listen: "127.0.0.1:0", Metrics: "off"}
	d, err := Start(cfg, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Shutdown(context.Background())
	cl, conn := dialTeacher(t, d.Addr(), "")
	defer conn.Close()

	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: csvPath}}, Pretokenized: true}
	err = fillOnce(cl, &pb.FillRequest{Dataset: ds, Start: 0, End: 1})
	checkRedacted(t, "bad record", err, codes.InvalidArgument, logs, "users.csv:2")
	err = describeOnce(cl, dup, "")
	checkRedacted(t, "bad CSV header", err, codes.InvalidArgument, logs, "dataset source cannot be opened")

	c, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	w := Local(c)
	defer w.Close()
	err = w.Fill(context.Background(), &pb.FillRequest{Dataset: ds, Start: 0, End: 1}, func(*pb.FillResponse) error { return nil })
	if !strings.Contains(status.Convert(err).Message(), "root:x:0") {
		t.Errorf("the in-process teacher lost the detail: %v", err)
	}
}

var requestIDRe = regexp.MustCompile(`request id ([0-9a-f]{12})`)

// checkRedacted checks that err has the code, contains want, carries a
// request id and no text of passwd, and that the log has the detail
// under that id.
func checkRedacted(t *testing.T, what string, err error, code codes.Code, logs *observer.ObservedLogs, want string) {
	t.Helper()
	msg := status.Convert(err).Message()
	t.Logf("%s: %s", what, msg)
	if status.Code(err) != code || !strings.Contains(msg, want) {
		t.Errorf("%s: got %v, want %s containing %q", what, err, code, want)
	}
	if strings.Contains(msg, "root:x") {
		t.Errorf("%s: the client sees the file's content: %s", what, msg)
	}
	m := requestIDRe.FindStringSubmatch(msg)
	if m == nil {
		t.Errorf("%s: no request id in %q", what, msg)
		return
	}
	for _, e := range logs.FilterField(zap.String("request_id", m[1])).All() {
		for _, f := range e.Context {
			if f.Key == "error" && strings.Contains(f.Interface.(error).Error(), "root:x:0") {
				return
			}
		}
	}
	t.Errorf("%s: the log has no detail under request id %s: %v", what, m[1], logs.All())
}

// TestKernelPanicIsInternalAndDaemonLives: a panic in a kernel's worker
// goroutine used to end teacherd (batcher.forward's recover covers only
// its own goroutine). Now the request fails with Internal, whose message
// carries a request id and not the panic (the log has it), and the daemon
// serves the next request.
func TestKernelPanicIsInternalAndDaemonLives(t *testing.T) {
	mdir := tinyModel(t)
	core, logs := observer.New(zap.InfoLevel)
	d, err := Start(Config{Model: mdir, Listen: "127.0.0.1:0", Metrics: "off"}, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Shutdown(context.Background())
	b := d.Core().b
	real := b.fwd
	// Set before any work is submitted: submit's lock orders it before the
	// batcher's read.
	b.fwd = func(s [][]int32, k int, temp float32) ([]int32, []float32) {
		if len(s[0]) == 3 {
			// A kernel bug: an embedding row past the table, hit in a
			// worker goroutine of the CPU backend.
			be := device.CPU(4)
			be.Embed(be.New(compute.F32, 1<<16), be.New(compute.F32, 16), be.FromI32(make([]int32, 1<<12-1)), 1<<12, 16)
		}
		return real(s, k, temp)
	}
	cl, conn := dialTeacher(t, d.Addr(), "")
	defer conn.Close()
	err = scoreOnce(cl, &pb.ScoreRequest{Tokens: []int32{1, 2, 3}})
	msg := status.Convert(err).Message()
	if status.Code(err) != codes.Internal || strings.Contains(msg, "index out of range") || strings.Contains(msg, "goroutine") || !requestIDRe.MatchString(msg) {
		t.Fatalf("a panicking forward: got %v, want Internal with a request id and no detail", err)
	}
	id := requestIDRe.FindStringSubmatch(msg)[1]
	if n := logs.FilterField(zap.String("request_id", id)).FilterMessage("internal error").Len(); n != 1 {
		t.Errorf("%d internal-error log entries under request id %s, want 1: %v", n, id, logs.All())
	}
	if logs.FilterMessageSnippet("forward pass panicked").Len() == 0 {
		t.Errorf("the panic is not logged")
	}
	if err := scoreOnce(cl, &pb.ScoreRequest{Tokens: []int32{1, 2, 3, 4}}); err != nil {
		t.Fatalf("the daemon did not serve after the panic: %v", err)
	}
}

// TestListenBeyondLoopbackNeedsAuth: a daemon reachable from other
// machines without a token or TLS refuses to start unless --insecure; on
// loopback (the default) it starts. Refused calls are counted in /metrics.
func TestListenBeyondLoopbackNeedsAuth(t *testing.T) {
	mdir := tinyModel(t)
	_, err := Start(Config{Model: mdir, Listen: "0.0.0.0:0", Metrics: "off"}, nil)
	if err == nil || !strings.Contains(err.Error(), "--insecure") || !strings.Contains(err.Error(), "--token-file") {
		t.Fatalf("0.0.0.0 without auth: %v", err)
	}
	_, err = Start(Config{Model: mdir, Listen: ":0", Metrics: "off"}, nil)
	if err == nil || !strings.Contains(err.Error(), "reachable from other machines") {
		t.Fatalf(":0 (every interface) without auth: %v", err)
	}
	tf := filepath.Join(t.TempDir(), "token")
	os.WriteFile(tf, []byte("s3cret\n"), 0o600)
	for name, cfg := range map[string]Config{
		"insecure":   {Insecure: true},
		"token":      {TokenFile: tf},
		"loopback":   {Listen: "127.0.0.1:0"},
		"loopback 6": {Listen: "[::1]:0"},
	} {
		cfg.Model, cfg.Metrics = mdir, "off"
		if cfg.Listen == "" {
			cfg.Listen = "0.0.0.0:0"
		}
		d, err := Start(cfg, nil)
		if err != nil {
			if name == "loopback 6" && strings.Contains(err.Error(), "listen") {
				t.Logf("no IPv6 loopback here: %v", err)
				continue
			}
			t.Errorf("%s: %v", name, err)
			continue
		}
		d.Shutdown(context.Background())
	}
}

// TestAuthFailuresCounted: calls refused for a missing or wrong token are
// counted in /metrics.
func TestAuthFailuresCounted(t *testing.T) {
	mdir := tinyModel(t)
	tf := filepath.Join(t.TempDir(), "token")
	os.WriteFile(tf, []byte("s3cret\n"), 0o600)
	d := startDaemon(t, Config{Model: mdir, TokenFile: tf})
	for _, tok := range []string{"", "wrong", "s3cret"} {
		cl, conn := dialTeacher(t, d.Addr(), tok)
		cl.Info(context.Background(), &pb.InfoRequest{})
		scoreOnce(cl, &pb.ScoreRequest{Tokens: []int32{1}})
		conn.Close()
	}
	resp, err := http.Get("http://" + d.MetricsAddr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), "teacherd_auth_failures_total 4") {
		t.Errorf("/metrics does not count 4 refused calls:\n%s", grepLines(string(body), "auth"))
	}
}

// TestTokenFileReadAlikeOnBothSides: one token file given to the daemon
// and to its clients (cachectl's --token-file, a training config's
// distill.token_file) is one token, whatever white space surrounds it:
// the daemon trimmed only a line's end (newline, CR, space) and the
// clients all white space, so a token file with a tab at the end or a
// space in front was refused for ever as a wrong token.
func TestTokenFileReadAlikeOnBothSides(t *testing.T) {
	mdir := tinyModel(t)
	for _, content := range []string{"s3cret\n", "s3cret\r\n", "s3cret\t\n", "  s3cret\n", "\ns3cret\n\n"} {
		tf := filepath.Join(t.TempDir(), "token")
		os.WriteFile(tf, []byte(content), 0o600)
		d := startDaemon(t, Config{Model: mdir, TokenFile: tf, Metrics: "off"})
		tok, err := teacherdial.ReadToken(tf, "--token-file")
		if err != nil {
			t.Fatal(err)
		}
		w, err := Dial(d.Addr(), DialOptions{Token: tok})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Info(context.Background()); err != nil {
			t.Errorf("token file %q, read by the client as teacherd reads it: %v", content, err)
		}
		w.Close()
		d.Shutdown(context.Background())
	}
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestCacheFlagIsAFile: --cache naming a regular file fails at startup,
// before the daemon listens, not at the first Fill.
func TestCacheFlagIsAFile(t *testing.T) {
	mdir := tinyModel(t)
	f := filepath.Join(t.TempDir(), "cache")
	os.WriteFile(f, []byte("x"), 0o644)
	d, err := Start(Config{Model: mdir, Cache: f, Listen: "127.0.0.1:0", Metrics: "off"}, nil)
	if err == nil {
		d.Shutdown(context.Background())
		t.Fatal("teacherd --cache FILE started")
	}
	if !strings.Contains(err.Error(), f+" is a file, not a directory") {
		t.Errorf("--cache FILE: %v", err)
	}
	if _, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: filepath.Join(f, "sub")}); err == nil {
		t.Error("cachectl fill --model --cache FILE/sub: no error")
	}
}

// openFilesUnder counts this process's open file descriptors on files in dir.
func openFilesUnder(t *testing.T, dir string) int {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	n := 0
	for _, fd := range fds {
		if p, err := os.Readlink(filepath.Join("/proc/self/fd", fd.Name())); err == nil && strings.HasPrefix(p, dir+string(filepath.Separator)) {
			n++
		}
	}
	return n
}

// TestEvictedDatasetsCloseFiles: the core keeps maxCachedDatasets datasets
// open; one it forgets has its files closed (they used to stay open until
// the process ended).
func TestEvictedDatasetsCloseFiles(t *testing.T) {
	mdir := tinyModel(t)
	c, err := NewCore(CoreOptions{ModelDir: mdir})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	dir, _ := filepath.EvalSymlinks(t.TempDir())
	for i := 0; i < maxCachedDatasets+3; i++ {
		sub := filepath.Join(dir, string(rune('a'+i)))
		os.Mkdir(sub, 0o755)
		p, _ := writeIDsDataset(t, sub, 3, 6, 512, int64(i))
		if _, err := c.DescribeDataset(&pb.Dataset{Sources: []*pb.DataSource{{Path: p}}, Pretokenized: true}); err != nil {
			t.Fatal(err)
		}
	}
	if n := openFilesUnder(t, dir); n != maxCachedDatasets {
		t.Errorf("%d dataset files open after %d datasets, want %d (the evicted ones closed)", n, maxCachedDatasets+3, maxCachedDatasets)
	}
	c.Close()
	if n := openFilesUnder(t, dir); n != 0 {
		t.Errorf("%d dataset files open after Close", n)
	}
}

// TestEvictedDatasetInUseStaysOpen: a dataset evicted while a call (a
// fill) uses it stays open until that call releases it, then closes.
func TestEvictedDatasetInUseStaysOpen(t *testing.T) {
	mdir := tinyModel(t)
	c, err := NewCore(CoreOptions{ModelDir: mdir})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	dir, _ := filepath.EvalSymlinks(t.TempDir())
	spec := func(i int) *pb.Dataset {
		sub := filepath.Join(dir, string(rune('a'+i)))
		os.Mkdir(sub, 0o755)
		p, _ := writeIDsDataset(t, sub, 3, 6, 512, int64(i))
		return &pb.Dataset{Sources: []*pb.DataSource{{Path: p}}, Pretokenized: true}
	}
	spec0 := spec(0)
	held, release, err := c.dataset(spec0)
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= maxCachedDatasets; i++ {
		if _, err := c.DescribeDataset(spec(i)); err != nil {
			t.Fatal(err)
		}
	}
	if _, still := c.datasets[string(mustKey(t, spec0))]; still {
		t.Fatal("test setup: the held dataset was not evicted")
	}
	if n := openFilesUnder(t, filepath.Join(dir, "a")); n != 1 {
		t.Fatalf("the evicted dataset in use has %d open files, want 1", n)
	}
	if _, err := held.Range(context.Background(), 0, 3); err != nil {
		t.Fatalf("reading the evicted dataset in use: %v", err)
	}
	release()
	release() // twice is harmless
	if n := openFilesUnder(t, filepath.Join(dir, "a")); n != 0 {
		t.Errorf("the evicted dataset keeps %d open files after its release", n)
	}
}

func mustKey(t *testing.T, spec *pb.Dataset) []byte {
	t.Helper()
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
