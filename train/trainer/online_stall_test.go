package trainer

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"distill/cache"
	"distill/internal/stall"
	"distill/internal/teacherdial"
	pb "distill/proto/distill/v1"
)

// hangingTeacher is a Teacher service in front of a daemon that passes
// Score answers through until its hang-th, then sends nothing more, as a
// daemon whose forward pass hangs: gRPC (keepalive pings), Info and
// Status still answer, and Status shows no forward completing.
type hangingTeacher struct {
	pb.UnimplementedTeacherServer
	cl   pb.TeacherClient
	hang int64
	n    atomic.Int64
	once sync.Once
	hung chan struct{} // closed when the hang begins
}

func (h *hangingTeacher) Info(ctx context.Context, r *pb.InfoRequest) (*pb.InfoResponse, error) {
	return h.cl.Info(ctx, r)
}

func (h *hangingTeacher) Status(context.Context, *pb.StatusRequest) (*pb.StatusResponse, error) {
	return &pb.StatusResponse{ForwardsTotal: 42, UptimeSeconds: 1000}, nil // frozen
}

func (h *hangingTeacher) Score(st grpc.BidiStreamingServer[pb.ScoreRequest, pb.ScoreResponse]) error {
	ctx := st.Context()
	up, err := h.cl.Score(ctx)
	if err != nil {
		return err
	}
	go func() {
		for {
			r, err := st.Recv()
			if err != nil {
				up.CloseSend()
				return
			}
			if up.Send(r) != nil {
				return
			}
		}
	}()
	for {
		m, err := up.Recv()
		if err != nil {
			return err
		}
		if m.GetProgress() == nil && h.n.Add(1) > h.hang {
			h.once.Do(func() { close(h.hung) })
			<-ctx.Done() // hung: until the client gives up on the stream
			return ctx.Err()
		}
		if err := st.Send(m); err != nil {
			return err
		}
	}
}

// startHanging serves a hangingTeacher in front of addr on loopback.
func startHanging(t *testing.T, addr string, hang int64) (*hangingTeacher, string) {
	conn, err := teacherdial.Dial(addr, teacherdial.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	h := &hangingTeacher{cl: pb.NewTeacherClient(conn), hang: hang, hung: make(chan struct{})}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	pb.RegisterTeacherServer(gs, h)
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)
	return h, lis.Addr().String()
}

// TestOnlineStallCheckpointsAndExits: the only teacher's forward hangs
// after its 9th answer while its gRPC layer still answers: the stall
// watchdog cancels its stream after distill.stall_timeout, the replica
// counts as lost (its Status shows no forward completing, so it is not
// taken back), and past teacher_timeout the run checkpoints and ends
// with ErrTeachers naming the stall, as on a lost daemon
// (TestOnlineTimeoutCheckpointsAndResumes). The watchdog's clock is the
// test's, moved past the timeout once the hang has begun: answers slow
// on a loaded machine are no stall.
func TestOnlineStallCheckpointsAndExits(t *testing.T) {
	fastRetry(t)
	f := newOnlineFixture(t, 40)
	a := startTeacherd(t, f.teacher, f.tokDir, "", "")
	h, addr := startHanging(t, a.addr(), 9)
	clk := stall.NewManualClock()
	testStallClock = clk
	testInfoTimeout = time.Minute
	defer func() { testStallClock, testInfoTimeout = nil, 0 }()
	go func() {
		<-h.hung
		clk.Advance(time.Minute)
	}()
	cfg := onlineConfig(t, f.tokDir, f.file, filepath.Join(t.TempDir(), "run"), "", []string{addr}, "distill.teacher_timeout=50ms", "distill.stall_timeout=1m")
	var log bytes.Buffer
	res, err := Run(cfg, Options{Log: &log})
	if !errors.Is(err, ErrTeachers) || !strings.Contains(err.Error(), "stalled") || !strings.Contains(err.Error(), "distill.stall_timeout") ||
		!strings.Contains(err.Error(), "rerun the same command to resume") {
		t.Fatalf("want ErrTeachers naming the stall and distill.stall_timeout, got %v\n%s", err, log.String())
	}
	if want := "teacher " + addr + " stalled: no result and no progress for sample "; !strings.Contains(log.String(), want) {
		t.Errorf("the log does not say the stall (%q):\n%s", want, log.String())
	}
	if ck, _ := LatestCheckpoint(cfg.RunDir); res.Step > 0 && ck != checkpointDir(cfg.RunDir, res.Step) {
		t.Fatalf("step %d finished but the newest checkpoint is %q: %v", res.Step, ck, err)
	}
}

// scriptStream is a Score stream's client side that answers from a
// script: what a daemon sends, progress messages among the results.
type scriptStream struct {
	grpc.ClientStream
	msgs []*pb.ScoreResponse
}

func (s *scriptStream) Send(*pb.ScoreRequest) error { return nil }
func (s *scriptStream) CloseSend() error            { return nil }
func (s *scriptStream) Header() (metadata.MD, error) {
	return nil, nil
}
func (s *scriptStream) Recv() (*pb.ScoreResponse, error) {
	if len(s.msgs) == 0 {
		return nil, io.EOF
	}
	m := s.msgs[0]
	s.msgs = s.msgs[1:]
	return m, nil
}

// TestReceiveSkipsProgress: the online-KD receive loop takes progress
// messages for what they are, not for answers: each answer still goes
// to its sample, in order, and progress moves nothing.
func TestReceiveSkipsProgress(t *testing.T) {
	p := &teacherPool{name: "t0", k: 2, tg: scoreTargets{kind: cache.TargetsTopK}, log: io.Discard}
	p.cond = sync.NewCond(&p.mu)
	fl := &flight{slots: make(chan struct{}, 4)}
	var jobs []*scoreJob
	for i := range 2 {
		j := &scoreJob{s: &cache.Sample{Index: int64(10 + i), Tokens: []int32{1, 2}}, done: make(chan struct{})}
		jobs = append(jobs, j)
		fl.jobs = append(fl.jobs, j)
		fl.slots <- struct{}{}
	}
	answer := func(id int64) *pb.ScoreResponse {
		return &pb.ScoreResponse{Id: id, K: 2, Ids: []int32{int32(id), 1, 2, 3}, Logprobs: []float32{-1, -2, -1, -2}}
	}
	prog := &pb.ScoreResponse{Progress: &pb.Progress{State: "queued", QueueDepth: 3}}
	st := &scriptStream{msgs: []*pb.ScoreResponse{prog, answer(0), prog, prog, answer(1)}}
	got, err := p.receive(&replica{addr: "h:7070"}, st, fl)
	if !got || !errors.Is(err, io.EOF) {
		t.Fatalf("receive: progress %v, %v; want answers then EOF", got, err)
	}
	for i, j := range jobs {
		select {
		case <-j.done:
		default:
			t.Fatalf("sample %d not answered", j.s.Index)
		}
		if j.s.TopKIDs[0] != int32(i) || len(j.s.TopKIDs) != 4 {
			t.Errorf("sample %d got ids %v, want answer %d's", j.s.Index, j.s.TopKIDs, i)
		}
	}
	if len(fl.jobs) != 0 || p.answered() != 2 {
		t.Errorf("%d jobs left in flight, %d answered; want 0 and 2", len(fl.jobs), p.answered())
	}
}

// TestStallTimeoutConfig: distill.stall_timeout is 10m when absent, 0
// disables it, a negative one is refused naming the key, and it belongs
// to online KD (it needs distill.teachers).
func TestStallTimeoutConfig(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  seq_len: 64\n  dataset:\n    files: [a.jsonl]\ndistill:\n  teachers: [h1:7070]\n"), 0o644)
	for over, want := range map[string]time.Duration{"": stall.DefaultTimeout, "distill.stall_timeout=0": 0, "distill.stall_timeout=90s": 90 * time.Second} {
		var o []string
		if over != "" {
			o = []string{over}
		}
		c, err := LoadConfig(p, o)
		if err != nil {
			t.Fatalf("%q: %v", over, err)
		}
		if got := c.Distill.stallTimeout(); got != want {
			t.Errorf("%q: stall timeout %v, want %v", over, got, want)
		}
	}
	if _, err := LoadConfig(p, []string{"distill.stall_timeout=-1s"}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "distill.stall_timeout") {
		t.Errorf("negative stall_timeout: %v", err)
	}
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  seq_len: 64\n  dataset:\n    files: [a.jsonl]\n"), 0o644)
	if _, err := LoadConfig(p, []string{"distill.stall_timeout=1m"}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "distill.stall_timeout") || !strings.Contains(err.Error(), "needs distill.teachers") {
		t.Errorf("stall_timeout without teachers: %v", err)
	}
}
