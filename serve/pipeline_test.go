package serve

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"distill/compute"
	"distill/compute/cuda"
	"distill/compute/cuda/cudaemu"
	"distill/compute/device"
	"distill/infer"
	"distill/model"
	pb "distill/proto/distill/v1"
)

// tinyModel2 is tinyModel with two layers: a teacher two GPUs can split.
func tinyModel2(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	cfg, err := model.Preset(model.ArchQwen3)
	if err != nil {
		t.Fatal(err)
	}
	cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.MaxPositions = 512, 32, 2, 64, 256
	if err := model.WriteCheckpoint(dir, cfg, model.Init(cfg, model.InitOptions{Seed: 7, Std: 0.5, Perturb: true}), "BF16"); err != nil {
		t.Fatal(err)
	}
	return dir
}

// usePipeEmu points the test (and the daemons it spawns) at the CUDA
// emulator with two GPUs.
func usePipeEmu(t *testing.T) {
	t.Helper()
	cudaemu.UseDevices(t, 2, "two GPUs: emulated only")
}

// TestCorePipelined: a core on two emulated GPUs (teacherd --devices 0,1,
// cachectl fill --model --devices 0,1) splits the layers, one a GPU, and
// scores as the one-GPU core does, bit for bit (one micro-batch); its
// memory check names the GPU that is short; --devices with the CPU is an
// error.
func TestCorePipelined(t *testing.T) {
	usePipeEmu(t)
	mdir := tinyModel2(t)
	one, err := NewCore(CoreOptions{ModelDir: mdir, Device: "cuda", TokenBudget: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	two, err := NewCore(CoreOptions{ModelDir: mdir, Device: "cuda", Devices: []int{0, 1}, TokenBudget: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer two.Close()
	st := two.Model().Stages()
	if len(st) != 2 || st[0].What() != "embedding, layer 0" || st[1].What() != "layer 1, norm, LM head" {
		t.Fatalf("stages %+v", st)
	}
	samples := [][]int32{{1, 2, 3, 4, 5, 6, 7, 8}, {300, 12}, {511, 0, 9, 9, 9}}
	want, err := one.Model().TopK(samples, infer.Options{K: 5})
	if err != nil {
		t.Fatal(err)
	}
	got, err := two.Model().TopK(samples, infer.Options{K: 5})
	if err != nil {
		t.Fatal(err)
	}
	for s := range samples {
		if !slices.Equal(got[s].IDs, want[s].IDs) || !slices.Equal(got[s].LogProbs, want[s].LogProbs) {
			t.Errorf("sample %d: two GPUs' top-k differs from one GPU's", s)
		}
	}
	// GPU 1 shrunk to what is in use now plus 300 tokens' worth.
	free, total := two.Model().Backends()[1].(compute.DeviceMemory).MemInfo()
	room := two.Model().StageDeviceBytes(1, 300, 256, DefaultKDefault, 0)
	t.Setenv("DISTILL_EMU_DEVICE_MEM_1", fmt.Sprint(2*(total-free)+256<<20+room))
	_, err = NewCore(CoreOptions{ModelDir: mdir, Device: "cuda", Devices: []int{0, 1}, TokenBudget: 4096, KMax: DefaultKDefault})
	if !errors.Is(err, ErrInvalid) || !errors.Is(err, infer.ErrDeviceMemory) || !strings.Contains(err.Error(), "GPU 1 (distill CPU emulator) (pipeline stage of layer 1, norm, LM head)") {
		t.Errorf("a budget GPU 1 cannot hold: %v", err)
	}
	t.Setenv("DISTILL_EMU_DEVICE_MEM_1", "")
	if _, err := NewCore(CoreOptions{ModelDir: mdir, Device: "cpu", Devices: []int{0, 1}}); !errors.Is(err, ErrConfig) || !errors.Is(err, device.ErrDevice) ||
		!strings.HasPrefix(err.Error(), "--device cpu --devices 0,1: --devices places the teacher's layers on GPUs: use --device cuda (or auto) with it") {
		t.Errorf("--device cpu --devices 0,1: %v", err)
	}
	// The error is a sentence (no "serve: bad configuration: device:
	// unavailable: --devices: GPU 5: cuda: "), its kinds in its chain.
	var nd *cuda.NoDeviceError
	if _, err := NewCore(CoreOptions{ModelDir: mdir, Device: "cuda", Devices: []int{0, 5}}); !errors.Is(err, ErrConfig) || !errors.Is(err, ErrInvalid) || !errors.Is(err, device.ErrDevice) ||
		!errors.As(err, &nd) || nd.Device != 5 || nd.Count != 2 || !strings.HasPrefix(err.Error(), "--devices 0,5: GPU 5 does not exist (") {
		t.Errorf("--devices 0,5 on two GPUs: %v", err)
	}
}

// TestSIGTERMDrainsPipelined is TestSIGTERMDrains for a daemon whose
// teacher spans two emulated GPUs, its forwards cut into micro-batches
// (teacherd --devices 0,1 --micro-batches 3), with a token budget (24)
// that makes the first chunk two forwards or more: the daemon is held as
// it starts the second, the first still in flight in the pipeline (the
// batcher keeps two). SIGTERM then: the chunk in flight finishes through
// the pipeline (the drain: the forward in flight and the one held), the
// daemon exits 0 with only whole chunks committed, and a fill on the same
// cache by a pipelined in-process teacher resumes and completes it, equal
// to that teacher's forward.
func TestSIGTERMDrainsPipelined(t *testing.T) {
	usePipeEmu(t)
	mdir := tinyModel2(t)
	tmp := t.TempDir()
	path, samples := writeIDsDataset(t, tmp, 24, 24, 512, 6)
	const budget = 24
	if n := len(samples[0]) + len(samples[1]) + len(samples[2]) + len(samples[3]); n <= budget {
		t.Fatalf("the first chunk's %d tokens fit one forward of %d: the test needs two", n, budget)
	}
	dA := t.TempDir()
	a := spawnDaemon(t, mdir, dA, "127.0.0.1:0", 2, "SERVE_TEST_DEVICE=cuda", "SERVE_TEST_DEVICES=0,1", "SERVE_TEST_MICRO_BATCHES=3",
		fmt.Sprintf("SERVE_TEST_BUDGET=%d", budget))
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
	a.release(t) // the chunk in flight goes through the pipeline, inside the drain
	r := <-done
	if r.err == nil || !strings.Contains(r.err.Error(), "re-run the same command to resume") {
		t.Fatalf("fill against a stopping daemon: %v", r.err)
	}
	if err := a.wait(); err != nil {
		t.Fatalf("daemon exit after SIGTERM: %v\n%s", err, a.log)
	}
	// The log is read once the daemon has exited: before that, its stderr
	// may still be in the pipe (the daemon listens, and prints its address,
	// while it loads the model).
	if !strings.Contains(a.log.String(), "pipeline stage") {
		t.Errorf("the daemon's log names no pipeline stage:\n%s", a.log)
	}
	if !strings.Contains(a.log.String(), "drained") {
		t.Errorf("no drain in the log:\n%s", a.log)
	}
	if n := reported.Load(); n != held+1 {
		t.Errorf("%d chunks reported before SIGTERM, %d after the drain: the chunk in flight was not finished", held, n)
	}
	core, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: dA, TokenBudget: budget, Device: "cuda", Devices: []int{0, 1}, MicroBatches: 3})
	if err != nil {
		t.Fatal(err)
	}
	lw := Local(core)
	defer lw.Close()
	plan.onChunk = nil
	sum, err := RunFill(context.Background(), []Worker{lw}, plan)
	if err != nil {
		t.Fatal(err)
	}
	if sum.Chunks == 0 || sum.Chunks >= 6 {
		t.Errorf("the resumed fill computed %d chunks of 6: want the ones the daemon had not committed", sum.Chunks)
	}
	checkAgainstForward(t, core.Model(), samples, 4, budget, dA)
	os.RemoveAll(dA)
}
