package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"distill/cache"
	"distill/compute/cuda/cudaemu"
	"distill/model"
	pb "distill/proto/distill/v1"
	"distill/serve"
)

// TestMain runs teacherd itself when TEACHERD_TEST_MAIN=1, so that tests
// can start it as a real process (flags, signals, exit status).
func TestMain(m *testing.M) {
	if os.Getenv("TEACHERD_TEST_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// daemonProc is a teacherd process and its stderr.
type daemonProc struct {
	cmd    *exec.Cmd
	addr   string
	stderr bytes.Buffer
	done   chan struct{} // closed when stderr is at EOF
}

// startDaemon starts `teacherd ARGS --listen 127.0.0.1:0 --metrics off`
// (this test binary) and waits until it serves.
func startDaemon(t *testing.T, args ...string) *daemonProc {
	t.Helper()
	d := &daemonProc{done: make(chan struct{})}
	d.cmd = exec.Command(os.Args[0], append(args, "--listen", "127.0.0.1:0", "--metrics", "off")...)
	d.cmd.Env = append(os.Environ(), "TEACHERD_TEST_MAIN=1")
	r, err := d.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.cmd.Process.Kill() })
	serving := make(chan string, 1)
	go func() {
		defer close(d.done)
		re := regexp.MustCompile(`\bserving\b.*"addr": "([^"]+)"`)
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			d.stderr.WriteString(sc.Text() + "\n")
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				serving <- m[1]
			}
		}
	}()
	select {
	case d.addr = <-serving:
	case <-d.done:
		d.cmd.Wait()
		t.Fatalf("teacherd %v ended before serving:\n%s", args, d.stderr.String())
	case <-time.After(2 * time.Minute):
		t.Fatalf("teacherd %v does not serve:\n%s", args, d.stderr.String())
	}
	return d
}

// stop sends SIGTERM and returns the exit status.
func (d *daemonProc) stop(t *testing.T) int {
	t.Helper()
	d.cmd.Process.Signal(syscall.SIGTERM)
	<-d.done
	d.cmd.Wait()
	return d.cmd.ProcessState.ExitCode()
}

// TestDevicesDaemon is the user flow of a teacher split over two GPUs
// (README, "Teachers larger than one GPU"), through the command on two
// emulated GPUs: `teacherd --device cuda --devices 0,1` logs its
// pipeline stages and serves a fill of part of the range; SIGTERM drains
// it and it exits 0; the fill of the whole range through a restarted
// daemon skips what was done and completes it; the cache verifies and
// holds what a one-GPU teacher fills, bit for bit (the promise of the
// pipelined forward). `--weights fp8 --devices 0,1` fills what a one-GPU
// FP8 teacher does, under another teacher fingerprint. (SIGTERM in the
// middle of a pipelined fill is serve's TestSIGTERMDrainsPipelined, which
// holds the fill at a chunk with a hook: a signal sent to the command
// while its fill runs would depend on timing.)
func TestDevicesDaemon(t *testing.T) {
	cudaemu.UseDevices(t, 2, "two GPUs: emulated only")
	mdir := t.TempDir()
	cfg, err := model.Preset(model.ArchQwen3)
	if err != nil {
		t.Fatal(err)
	}
	cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.MaxPositions = 300, 32, 2, 64, 256
	if err := model.WriteCheckpoint(mdir, cfg, model.Init(cfg, model.InitOptions{Seed: 7, Std: 0.5, Perturb: true}), "BF16"); err != nil {
		t.Fatal(err)
	}
	root := t.TempDir()
	path := filepath.Join(root, "ids.jsonl")
	var recs bytes.Buffer
	for i := range 24 {
		ids := make([]int32, 8+i%13)
		for j := range ids {
			ids[j] = int32((i*31 + j*7) % 300)
		}
		js, _ := json.Marshal(map[string]any{"input_ids": ids})
		recs.Write(append(js, '\n'))
	}
	if err := os.WriteFile(path, recs.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	plan := serve.FillPlan{Dataset: &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}, ChunkSamples: 2, K: 4, Encoding: "lossless", RetryFor: time.Second}
	fill := func(addr string, p serve.FillPlan) (*serve.FillSummary, error) {
		w, err := serve.Dial(addr, serve.DialOptions{})
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		return serve.RunFill(context.Background(), []serve.Worker{w}, p)
	}
	daemon := func(cacheDir string, extra ...string) *daemonProc {
		return startDaemon(t, append([]string{"--model", mdir, "--cache", cacheDir, "--data-root", root, "--device", "cuda", "--devices", "0,1"}, extra...)...)
	}

	two := filepath.Join(t.TempDir(), "two")
	d := daemon(two)
	if !strings.Contains(d.stderr.String(), `"holds": "layer 1, norm, LM head"`) {
		t.Errorf("the daemon's log names no pipeline stage holding layer 1 and the head:\n%s", d.stderr.String())
	}
	part := plan
	part.End = 10
	if _, err := fill(d.addr, part); err != nil {
		t.Fatalf("the first part's fill: %v\n%s", err, d.stderr.String())
	}
	if rc := d.stop(t); rc != 0 {
		t.Fatalf("teacherd exit status %d after SIGTERM, want 0:\n%s", rc, d.stderr.String())
	}
	if !strings.Contains(d.stderr.String(), "drained") {
		t.Errorf("no drain in the log:\n%s", d.stderr.String())
	}
	d = daemon(two)
	if sum, err := fill(d.addr, plan); err != nil || sum.Skipped != 5 || sum.Samples != 14 {
		t.Fatalf("the whole range's fill after the first part's: %+v, %v, want 5 chunks skipped, 14 samples computed\n%s", sum, err, d.stderr.String())
	}
	if rc := d.stop(t); rc != 0 {
		t.Fatalf("teacherd exit status %d after SIGTERM, want 0:\n%s", rc, d.stderr.String())
	}
	if rep, err := cache.Check(two, nil); err != nil || !rep.OK() || rep.Samples != 24 {
		t.Fatalf("verify: %+v, %v", rep, err)
	}

	one := filepath.Join(t.TempDir(), "one")
	core, err := serve.NewCore(serve.CoreOptions{ModelDir: mdir, CacheDir: one, Device: "cuda"})
	if err != nil {
		t.Fatal(err)
	}
	lw := serve.Local(core)
	if _, err := serve.RunFill(context.Background(), []serve.Worker{lw}, plan); err != nil {
		t.Fatal(err)
	}
	lw.Close()
	sameSamples(t, one, two)

	plan.End = 8
	fp8 := filepath.Join(t.TempDir(), "fp8")
	d = daemon(fp8, "--weights", "fp8")
	if _, err := fill(d.addr, plan); err != nil {
		t.Fatalf("the FP8 fill: %v\n%s", err, d.stderr.String())
	}
	if rc := d.stop(t); rc != 0 {
		t.Fatalf("teacherd --weights fp8: exit status %d after SIGTERM, want 0:\n%s", rc, d.stderr.String())
	}
	one8 := filepath.Join(t.TempDir(), "one8")
	core, err = serve.NewCore(serve.CoreOptions{ModelDir: mdir, CacheDir: one8, Device: "cuda", Weights: "fp8"})
	if err != nil {
		t.Fatal(err)
	}
	lw = serve.Local(core)
	if _, err := serve.RunFill(context.Background(), []serve.Worker{lw}, plan); err != nil {
		t.Fatal(err)
	}
	lw.Close()
	sameSamples(t, one8, fp8)
	r2, _ := cache.OpenReader(two)
	r8, _ := cache.OpenReader(fp8)
	if r2 == nil || r8 == nil || r2.Manifest().TeacherFingerprint == r8.Manifest().TeacherFingerprint {
		t.Errorf("the FP8 and BF16 teachers' caches have the same teacher fingerprint")
	}
}

// sameSamples fails unless two caches hold the same samples, bit for bit.
func sameSamples(t *testing.T, a, b string) {
	t.Helper()
	ra, err := cache.OpenReader(a)
	if err != nil {
		t.Fatal(err)
	}
	rb, err := cache.OpenReader(b)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, ch := range ra.Chunks() {
		for i := ch.Start; i < ch.End; i++ {
			x, err := ra.Get(i)
			if err != nil {
				t.Fatal(err)
			}
			y, err := rb.Get(i)
			if err != nil {
				t.Fatalf("sample %d: in %s, not in %s: %v", i, a, b, err)
			}
			bits := func(v []float32) []uint32 {
				out := make([]uint32, len(v))
				for j, f := range v {
					out[j] = math.Float32bits(f)
				}
				return out
			}
			if !slices.Equal(x.TopKIDs, y.TopKIDs) || !slices.Equal(bits(x.TopKLogProbs), bits(y.TopKLogProbs)) {
				t.Fatalf("sample %d: %s and %s differ", i, a, b)
			}
			n++
		}
	}
	if n == 0 {
		t.Fatalf("%s holds no sample", a)
	}
}
