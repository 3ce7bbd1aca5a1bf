package serve

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	pb "distill/proto/distill/v1"
)

// proc is a daemon in a child process (this test binary, see TestMain).
type proc struct {
	cmd  *exec.Cmd
	addr string
	log  *strings.Builder
}

func spawnDaemon(t *testing.T, mdir, cacheDir, listen string, delay time.Duration) *proc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	addrFile := filepath.Join(t.TempDir(), "addr")
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), "SERVE_TEST_DAEMON=1", "SERVE_TEST_MODEL="+mdir, "SERVE_TEST_CACHE="+cacheDir,
		"SERVE_TEST_LISTEN="+listen, "SERVE_TEST_ADDRFILE="+addrFile, "SERVE_TEST_DELAY="+delay.String(), "SERVE_TEST_BUDGET=200",
		"SERVE_TEST_DATA_ROOT="+os.TempDir())
	var log strings.Builder
	cmd.Stderr = &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, log: &log}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	for i := 0; i < 600; i++ {
		if b, err := os.ReadFile(addrFile); err == nil {
			p.addr = string(b)
			return p
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("daemon did not start: %s", log.String())
	return nil
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
	// Slow forwards (150 ms) make "mid-chunk" a wide target: a chunk of 8
	// samples is 1-2 forwards, its commit a few ms at the end.
	a := spawnDaemon(t, mdir, dA, "127.0.0.1:0", 150*time.Millisecond)
	b := spawnDaemon(t, mdir, dB, "127.0.0.1:0", 150*time.Millisecond)
	wa, _ := Dial(a.addr, DialOptions{})
	wb, _ := Dial(b.addr, DialOptions{})
	defer wa.Close()
	defer wb.Close()
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	killed := make(chan struct{})
	var once sync.Once
	plan := FillPlan{Dataset: ds, ChunkSamples: 8, K: 4, Encoding: "lossless", PerWorker: 1, RetryFor: time.Second,
		onChunk: func(w Worker, r *pb.FillResponse) {
			if w != wa || r.GetSkipped() {
				return
			}
			// A just reported a chunk; 100 ms later it is into its next
			// one (tokenizing, then the first 150 ms forward), far from
			// that chunk's commit.
			once.Do(func() {
				go func() {
					time.Sleep(100 * time.Millisecond)
					a.cmd.Process.Signal(syscall.SIGKILL)
					a.cmd.Wait()
					close(killed)
				}()
			})
		}}
	sum, err := RunFill(context.Background(), []Worker{wa, wb}, plan)
	if err != nil {
		t.Fatalf("fill with a killed daemon: %v\nA's log:\n%s", err, a.log)
	}
	select {
	case <-killed:
	default:
		t.Fatal("daemon A was not killed during the fill")
	}
	if sum.Retries == 0 {
		t.Errorf("no chunk was retried after the kill: %+v", sum)
	}
	// Restart A on the same directory (and address); re-run: nothing to do.
	a2 := spawnDaemon(t, mdir, dA, a.addr, 0)
	wa2, _ := Dial(a2.addr, DialOptions{})
	defer wa2.Close()
	plan.onChunk = nil
	sum, err = RunFill(context.Background(), []Worker{wa2, wb}, plan)
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

// TestSIGTERMDrains sends SIGTERM to a daemon in the middle of a fill: it
// exits 0, and its cache holds only whole chunks (verify passes).
func TestSIGTERMDrains(t *testing.T) {
	mdir := tinyModel(t)
	tmp := t.TempDir()
	path, samples := writeIDsDataset(t, tmp, 32, 24, 512, 6)
	dA := t.TempDir()
	a := spawnDaemon(t, mdir, dA, "127.0.0.1:0", 100*time.Millisecond)
	wa, _ := Dial(a.addr, DialOptions{})
	defer wa.Close()
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	once := false
	plan := FillPlan{Dataset: ds, ChunkSamples: 4, K: 4, Encoding: "lossless", PerWorker: 1, RetryFor: 500 * time.Millisecond,
		onChunk: func(w Worker, r *pb.FillResponse) {
			if !once {
				once = true
				go func() { time.Sleep(50 * time.Millisecond); a.cmd.Process.Signal(syscall.SIGTERM) }()
			}
		}}
	_, err := RunFill(context.Background(), []Worker{wa}, plan)
	if err == nil || !strings.Contains(err.Error(), "re-run the same command to resume") {
		t.Fatalf("fill against a stopping daemon: %v", err)
	}
	if err := a.cmd.Wait(); err != nil {
		t.Fatalf("daemon exit after SIGTERM: %v\n%s", err, a.log)
	}
	if !strings.Contains(a.log.String(), "drained") && !strings.Contains(a.log.String(), "drain timeout") {
		t.Errorf("no drain in the log:\n%s", a.log)
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
