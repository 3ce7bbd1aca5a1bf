package serve

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"distill/internal/teacherdial"
	"distill/model"
	pb "distill/proto/distill/v1"
)

// proc is a daemon in a child process (this test binary, see TestMain and
// daemonMain). It speaks on stdout: its address, "held N" when it waits
// in its hold-th forward, "stopping" when SIGTERM reached it; a line on
// its stdin releases the hold.
type proc struct {
	cmd      *exec.Cmd
	addr     string
	log      *syncBuf
	stdin    io.WriteCloser
	held     chan struct{} // closed at "held"
	stopping chan struct{} // closed at "stopping"
	exited   chan struct{} // closed when stdout ends: the child is gone
	waitOnce sync.Once
	waitErr  error
}

// syncBuf is the child's stderr: exec copies into it from its own
// goroutine while a failing test may read it.
type syncBuf struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// spawnDaemon starts a daemon on cacheDir and returns once it listens.
// hold > 0 makes its hold-th forward pass wait for p.release. env adds
// VAR=value settings (SERVE_TEST_DEVICE, SERVE_TEST_DEVICES,
// SERVE_TEST_MICRO_BATCHES: the daemon's device, GPUs, micro-batches).
func spawnDaemon(t *testing.T, mdir, cacheDir, listen string, hold int, env ...string) *proc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), "SERVE_TEST_DAEMON=1", "SERVE_TEST_MODEL="+mdir, "SERVE_TEST_CACHE="+cacheDir,
		"SERVE_TEST_LISTEN="+listen, fmt.Sprintf("SERVE_TEST_HOLD=%d", hold), "SERVE_TEST_BUDGET=200",
		"SERVE_TEST_DATA_ROOT="+os.TempDir())
	cmd.Env = append(cmd.Env, env...)
	p := &proc{cmd: cmd, log: &syncBuf{}, held: make(chan struct{}), stopping: make(chan struct{}), exited: make(chan struct{})}
	cmd.Stderr = p.log
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if p.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill() // an error only says it is gone already
		p.wait()
	})
	addr := make(chan string, 1)
	go func() {
		defer close(p.exited)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			switch l := sc.Text(); {
			case strings.HasPrefix(l, "addr "):
				addr <- strings.TrimPrefix(l, "addr ")
			case strings.HasPrefix(l, "held "):
				close(p.held)
			case l == "stopping":
				close(p.stopping)
			}
		}
	}()
	// No deadline: the daemon either prints its address or exits (its
	// stdout closes); one that hangs is go test's -timeout to catch.
	select {
	case p.addr = <-addr:
		return p
	case <-p.exited:
		p.wait()
		t.Fatalf("daemon did not start: %s", p.log)
		return nil
	}
}

// wait reaps the child once its stdout has been read to the end.
func (p *proc) wait() error {
	<-p.exited
	p.waitOnce.Do(func() { p.waitErr = p.cmd.Wait() })
	return p.waitErr
}

// await waits for ch (one of p's events) and fails if the child exits
// first.
func (p *proc) await(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-p.exited:
		err := p.wait()
		t.Fatalf("the daemon exited (%v) before %s:\n%s", err, what, p.log)
	}
}

// release lets a held forward go on.
func (p *proc) release(t *testing.T) {
	t.Helper()
	if _, err := fmt.Fprintln(p.stdin); err != nil {
		t.Fatalf("releasing the daemon: %v", err)
	}
}

type fillResult struct {
	sum *FillSummary
	err error
}

// startFill runs RunFill in the background.
func startFill(workers []Worker, plan FillPlan) <-chan fillResult {
	done := make(chan fillResult, 1)
	go func() {
		sum, err := RunFill(context.Background(), workers, plan)
		done <- fillResult{sum, err}
	}()
	return done
}

// TestKillDaemonMidFill kills -9 one of two daemons while it computes a
// chunk: the fill finishes on the other, the restarted daemon finds its
// cache intact, a re-run has nothing left to do, and the two directories
// hold every sample exactly once, equal to the in-process forward.
func TestKillDaemonMidFill(t *testing.T) {
	mdir := tinyModel(t)
	tmp := t.TempDir()
	path, samples := writeIDsDataset(t, tmp, 64, 24, 512, 5)
	dA, dB := t.TempDir(), t.TempDir()
	// B holds in its first forward, so A alone works the queue until it
	// holds in its second: by then A has committed and reported a chunk
	// (its next Fill starts only after that report) and is inside another
	// one whose commit has not begun. The kill lands there, whatever the
	// speed of the machine.
	a := spawnDaemon(t, mdir, dA, "127.0.0.1:0", 2)
	b := spawnDaemon(t, mdir, dB, "127.0.0.1:0", 1)
	wa, _ := Dial(a.addr, DialOptions{})
	wb, _ := Dial(b.addr, DialOptions{})
	defer wa.Close()
	defer wb.Close()
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	var reportedA atomic.Int64
	plan := FillPlan{Dataset: ds, ChunkSamples: 8, K: 4, Encoding: "lossless", PerWorker: 1, RetryFor: time.Second,
		onChunk: func(w Worker, r *pb.FillResponse) {
			if w == wa && !r.GetSkipped() {
				reportedA.Add(1)
			}
		}}
	done := startFill([]Worker{wa, wb}, plan)
	select {
	case <-a.held:
	case r := <-done:
		t.Fatalf("the fill ended (%v) before daemon A held in its second forward\nA's log:\n%s", r.err, a.log)
	}
	if n := reportedA.Load(); n == 0 {
		t.Fatal("daemon A holds in its second forward but reported no chunk")
	}
	a.cmd.Process.Signal(syscall.SIGKILL)
	if err := a.wait(); err == nil {
		t.Fatal("daemon A exited cleanly; it should have been killed")
	}
	b.release(t)
	r := <-done
	if r.err != nil {
		t.Fatalf("fill with a killed daemon: %v\nB's log:\n%s", r.err, b.log)
	}
	if r.sum.Retries == 0 {
		t.Errorf("no chunk was retried after the kill: %+v", r.sum)
	}
	// Restart A on the same directory (and address); re-run: nothing to do.
	a2 := spawnDaemon(t, mdir, dA, a.addr, 0)
	wa2, _ := Dial(a2.addr, DialOptions{})
	defer wa2.Close()
	plan.onChunk = nil
	sum, err := RunFill(context.Background(), []Worker{wa2, wb}, plan)
	if err != nil || sum.Chunks != 0 {
		t.Fatalf("re-run after restart: %+v %v", sum, err)
	}
	core, err := NewCore(CoreOptions{ModelDir: mdir})
	if err != nil {
		t.Fatal(err)
	}
	defer core.Close()
	checkAgainstForward(t, core.Model(), samples, 4, 200, dA, dB)
}

// TestSIGTERMDrains sends SIGTERM to a daemon in the middle of a fill,
// while it is inside a chunk: it finishes that chunk (the drain), exits 0,
// and its cache holds only whole chunks (verify passes).
func TestSIGTERMDrains(t *testing.T) {
	mdir := tinyModel(t)
	tmp := t.TempDir()
	path, samples := writeIDsDataset(t, tmp, 32, 24, 512, 6)
	dA := t.TempDir()
	// Held in its second forward: a chunk is committed, another in flight.
	a := spawnDaemon(t, mdir, dA, "127.0.0.1:0", 2)
	wa, _ := Dial(a.addr, DialOptions{})
	defer wa.Close()
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	var reported atomic.Int64
	plan := FillPlan{Dataset: ds, ChunkSamples: 4, K: 4, Encoding: "lossless", PerWorker: 1, RetryFor: 500 * time.Millisecond,
		onChunk: func(w Worker, r *pb.FillResponse) {
			if !r.GetSkipped() {
				reported.Add(1)
			}
		}}
	done := startFill([]Worker{wa}, plan)
	select {
	case <-a.held:
	case r := <-done:
		t.Fatalf("the fill ended (%v) before the daemon held in its second forward\n%s", r.err, a.log)
	}
	held := reported.Load()
	a.cmd.Process.Signal(syscall.SIGTERM)
	a.await(t, a.stopping, "it reported SIGTERM")
	a.release(t) // the chunk in flight goes on, inside the drain
	r := <-done
	if r.err == nil || !strings.Contains(r.err.Error(), "re-run the same command to resume") {
		t.Fatalf("fill against a stopping daemon: %v", r.err)
	}
	if err := a.wait(); err != nil {
		t.Fatalf("daemon exit after SIGTERM: %v\n%s", err, a.log)
	}
	if !strings.Contains(a.log.String(), "drained") {
		t.Errorf("no drain in the log:\n%s", a.log)
	}
	if n := reported.Load(); n != held+1 {
		t.Errorf("%d chunks reported before SIGTERM, %d after the drain: the chunk in flight was not finished", held, n)
	}
	// Whatever was committed is whole and right; the rest is missing.
	core, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: dA, TokenBudget: 200})
	if err != nil {
		t.Fatal(err)
	}
	lw := Local(core)
	defer lw.Close()
	plan.onChunk = nil
	if _, err := RunFill(context.Background(), []Worker{lw}, plan); err != nil {
		t.Fatal(err)
	}
	checkAgainstForward(t, core.Model(), samples, 4, 200, dA)
}

// TestHungDaemonMidFill stops one of two daemons (SIGSTOP) while it
// computes a chunk: a hung process, or a machine or network gone without
// closing the connection, sends nothing more, not even a TCP reset. The
// fill must not wait for it for ever: the keepalive pings go unanswered,
// its call fails, its chunk goes to the other daemon, and the fill
// finishes, saying which teacher stopped answering. (It waited for ever,
// at the same progress line.)
func TestHungDaemonMidFill(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: waits for a keepalive ping to go unanswered (at least 10s, gRPC's least interval)")
	}
	kt, kto := teacherdial.KeepaliveTime, teacherdial.KeepaliveTimeout
	teacherdial.KeepaliveTime, teacherdial.KeepaliveTimeout = 10*time.Second, time.Second
	defer func() { teacherdial.KeepaliveTime, teacherdial.KeepaliveTimeout = kt, kto }()
	mdir := tinyModel(t)
	tmp := t.TempDir()
	path, samples := writeIDsDataset(t, tmp, 48, 24, 512, 8)
	dA, dB := t.TempDir(), t.TempDir()
	// As in TestKillDaemonMidFill: B holds in its first forward, A in its
	// second, after it has reported a chunk; A is stopped there.
	a := spawnDaemon(t, mdir, dA, "127.0.0.1:0", 2)
	b := spawnDaemon(t, mdir, dB, "127.0.0.1:0", 1)
	wa, _ := Dial(a.addr, DialOptions{})
	wb, _ := Dial(b.addr, DialOptions{})
	defer wa.Close()
	defer wb.Close()
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	out := &sayWatch{want: "teacher " + a.addr + " failed", seen: make(chan struct{})}
	plan := FillPlan{Dataset: ds, ChunkSamples: 8, K: 4, Encoding: "lossless", PerWorker: 1, RetryFor: time.Minute, LogEvery: time.Hour, Out: out}
	done := startFill([]Worker{wa, wb}, plan)
	select {
	case <-a.held:
	case r := <-done:
		t.Fatalf("the fill ended (%v) before daemon A held in its second forward\nA's log:\n%s", r.err, a.log)
	}
	a.cmd.Process.Signal(syscall.SIGSTOP)
	b.release(t)
	// The fill gives A's chunk to B once A's call has failed. A stays
	// hung; killed once the fill has said so, the fill's last status call
	// to it fails at once instead of running into its own timeout.
	select {
	case <-out.seen:
	case r := <-done:
		t.Fatalf("the fill ended (%v) without saying that A failed:\n%s", r.err, out)
	case <-time.After(2 * time.Minute): // a failure's bound, not a wait: the keepalive fails A's call within 11s
		t.Fatalf("the fill still waits for the stopped daemon A after 2 minutes:\n%s", out)
	}
	a.cmd.Process.Signal(syscall.SIGKILL)
	a.wait()
	r := <-done
	if r.err != nil {
		t.Fatalf("fill with a hung daemon: %v\n%s", r.err, out)
	}
	if !strings.Contains(out.String(), "stopped answering") {
		t.Errorf("the fill's output does not say that A stopped answering:\n%s", out)
	}
	core, err := NewCore(CoreOptions{ModelDir: mdir})
	if err != nil {
		t.Fatal(err)
	}
	defer core.Close()
	checkAgainstForward(t, core.Model(), samples, 4, 200, dA, dB)
}

// sayWatch is a fill's output that closes seen at the first write
// holding want.
type sayWatch struct {
	syncBuf
	want string
	once sync.Once
	seen chan struct{}
}

func (w *sayWatch) Write(p []byte) (int, error) {
	if strings.Contains(string(p), w.want) {
		w.once.Do(func() { close(w.seen) })
	}
	return w.syncBuf.Write(p)
}

// TestRestartedDaemonChecked: a daemon killed in the middle of a fill
// and started again on its address is asked again, before it gets a
// chunk, what it runs and where it writes. Restarted on another cache
// directory, it fills the rest there and the fill ends naming both
// directories, to be read together (the fill failed, "[0, 8) are still
// missing from the caches", with the chunks it had reported in the
// first). Restarted with another checkpoint, it is refused before it
// computes a chunk, naming what changed (it filled the rest with the
// other teacher, and the fill failed the same way).
func TestRestartedDaemonChecked(t *testing.T) {
	mdir := tinyModel(t)
	other := t.TempDir()
	cfg, err := model.Preset(model.ArchQwen3)
	if err != nil {
		t.Fatal(err)
	}
	cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.MaxPositions = 512, 32, 1, 64, 256
	if err := model.WriteCheckpoint(other, cfg, model.Init(cfg, model.InitOptions{Seed: 8, Std: 0.5, Perturb: true}), "BF16"); err != nil {
		t.Fatal(err)
	}
	tmp := t.TempDir()
	path, samples := writeIDsDataset(t, tmp, 32, 24, 512, 9)
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	// fill runs a fill through a daemon on dir that holds in its second
	// forward, after it has reported a chunk; killed there, it is
	// started again on its address with model m2 and directory dir2.
	fill := func(dir, m2, dir2 string) (fillResult, *syncBuf) {
		a := spawnDaemon(t, mdir, dir, "127.0.0.1:0", 2)
		wa, _ := Dial(a.addr, DialOptions{})
		defer wa.Close()
		out := &syncBuf{}
		plan := FillPlan{Dataset: ds, ChunkSamples: 8, K: 4, Encoding: "lossless", PerWorker: 1, RetryFor: time.Minute, LogEvery: time.Hour, Out: out}
		done := startFill([]Worker{wa}, plan)
		select {
		case <-a.held:
		case r := <-done:
			t.Fatalf("the fill ended (%v) before the daemon held in its second forward\n%s", r.err, a.log)
		}
		a.cmd.Process.Signal(syscall.SIGKILL)
		a.wait()
		spawnDaemon(t, m2, dir2, a.addr, 0)
		return <-done, out
	}

	dA, dA2 := t.TempDir(), t.TempDir()
	r, out := fill(dA, mdir, dA2)
	if r.err != nil {
		t.Fatalf("fill with a daemon restarted on another directory: %v\n%s", r.err, out)
	}
	if len(r.sum.Dirs) != 2 || len(r.sum.Dirs[dA]) != 1 || len(r.sum.Dirs[dA2]) != 1 {
		t.Errorf("the summary's directories: %v, want %s and %s", r.sum.Dirs, dA, dA2)
	}
	if !strings.Contains(out.String(), "writes "+dA2+" now (it wrote "+dA+")") || !strings.Contains(out.String(), "read the directories together") {
		t.Errorf("the fill does not say where the restarted daemon writes:\n%s", out)
	}
	core, err := NewCore(CoreOptions{ModelDir: mdir})
	if err != nil {
		t.Fatal(err)
	}
	defer core.Close()
	checkAgainstForward(t, core.Model(), samples, 4, 200, dA, dA2)

	dB, dB2 := t.TempDir(), t.TempDir()
	r, out = fill(dB, other, dB2)
	if r.err == nil || !strings.Contains(r.err.Error(), "came back with another teacher fingerprint (checkpoint)") {
		t.Fatalf("fill with a daemon restarted with another checkpoint: %v, want a refusal naming the checkpoint\n%s", r.err, out)
	}
	if ents, _ := os.ReadDir(filepath.Join(dB2, "chunks")); len(ents) > 0 {
		t.Errorf("the restarted daemon computed %d chunks with another checkpoint", len(ents))
	}
}
