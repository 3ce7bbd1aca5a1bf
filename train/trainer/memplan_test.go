package trainer

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"distill/compute/cuda"
	"distill/compute/cuda/cudaemu"
	"distill/model"
	"distill/model/decoder"
	"distill/train"
)

// recomputeRuns trains the tiny config under each recompute mode, 12
// steps straight and 6 + a resume from the checkpoint of step 4, and
// checks that each mode's resume repeats its uninterrupted run bit for bit
// and that the modes' losses and gradient norms are the same bits (a
// recompute runs the same kernels on the same inputs as the forward).
func recomputeRuns(t *testing.T, over ...string) {
	b := testCache(t)
	over = append(over, "eval.every=0")
	var first *Result
	for _, mode := range decoder.RecomputeModes {
		o := append(over, "train.recompute="+string(mode))
		full, err := Run(tinyConfig(t, b, filepath.Join(t.TempDir(), "full"), o...), Options{Log: io.Discard})
		if err != nil {
			t.Fatal(err)
		}
		runDir := filepath.Join(t.TempDir(), "resumed")
		if _, err := Run(tinyConfig(t, b, runDir, o...), Options{Log: io.Discard, StopAfter: 6}); err != nil {
			t.Fatal(err)
		}
		if st := readState(t, checkpointDir(runDir, 4)); st["recompute"] != string(mode) {
			t.Fatalf("%s: the checkpoint records recompute %v", mode, st["recompute"])
		}
		rest, err := Run(tinyConfig(t, b, runDir, o...), Options{Log: io.Discard})
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasSuffix(rest.Resumed, "step-00000004") || len(rest.Steps) != 8 {
			t.Fatalf("%s: resumed from %q, ran %d steps", mode, rest.Resumed, len(rest.Steps))
		}
		for i, s := range rest.Steps {
			w := full.Steps[4+i]
			if s.Loss != w.Loss || s.GradNorm != w.GradNorm {
				t.Fatalf("recompute %s: step %d after resume: loss %.17g |g| %.17g, uninterrupted %.17g %.17g", mode, s.Step, s.Loss, s.GradNorm, w.Loss, w.GradNorm)
			}
		}
		if first == nil {
			first = full
			continue
		}
		for i, s := range full.Steps {
			w := first.Steps[i]
			if s.Loss != w.Loss || s.GradNorm != w.GradNorm {
				t.Fatalf("recompute %s: step %d: loss %.17g |g| %.17g, recompute none %.17g %.17g", mode, s.Step, s.Loss, s.GradNorm, w.Loss, w.GradNorm)
			}
		}
	}
	t.Logf("recompute none, selective and full: the same losses and gradient norms bit for bit over %d steps (loss %.6f -> %.6f); each resumes bit for bit",
		len(first.Steps), first.Steps[0].Loss, first.Steps[len(first.Steps)-1].Loss)
}

// TestRecomputeResume: on the CPU, every recompute mode resumes bit for
// bit, and the three modes train the same bits.
func TestRecomputeResume(t *testing.T) { recomputeRuns(t, "train.device=cpu") }

// TestCUDARecomputeResume: the same on the CUDA backend (the emulator
// here).
func TestCUDARecomputeResume(t *testing.T) {
	useCUDA(t)
	recomputeRuns(t, "train.device=cuda")
}

// TestRecomputeConfig: train.recompute defaults to auto, and a bad value
// is an error naming the key and the choices.
func TestRecomputeConfig(t *testing.T) {
	if d := Defaults(); d.Train.Recompute != "auto" {
		t.Errorf("default train.recompute %q, want auto", d.Train.Recompute)
	}
	b := testCache(t)
	cfg := tinyConfig(t, b, t.TempDir())
	cfg.Train.Recompute = "some"
	err := cfg.Validate()
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "train.recompute") || !strings.Contains(err.Error(), "selective") {
		t.Fatalf("train.recompute some: %v", err)
	}
}

// TestCUDAMemoryPlanCheck: on a device (the emulator, shrunk) with room
// for the tiny run under full recompute but not without it, auto picks
// full and says so; recompute none is refused before step 1 with an
// ErrDeviceMemory naming the mode that fits and the longest row that
// fits without recompute, and a row that long trains under none.
func TestCUDAMemoryPlanCheck(t *testing.T) {
	useCUDA(t)
	if cudaemu.OnGPU() {
		t.Skip("shrinks the emulator's device")
	}
	be, err := cuda.Open(cuda.Options{})
	if err != nil {
		t.Fatal(err)
	}
	free, total := be.MemInfo()
	b := testCache(t)
	over := []string{"train.device=cuda", "eval.every=0", "train.max_steps=3", "data.seq_len=256", "data.global_batch_tokens=256"}
	cfg := tinyConfig(t, b, t.TempDir(), over...)
	mc, err := cfg.Model.Random.ModelConfig()
	if err != nil {
		t.Fatal(err)
	}
	plan := func(r decoder.Recompute) int64 {
		return train.PlanMemory(planShape(cfg, mc, 8, r, be, 1)).Total()
	}
	// The reserve is 256 MiB on a small device: a device with the open
	// backend's own memory, the reserve and halfway between full's plan
	// and selective's.
	room := (plan(decoder.RecomputeFull) + plan(decoder.RecomputeSelective)) / 2
	be.Close()
	t.Setenv("DISTILL_EMU_DEVICE_MEM", fmt.Sprint(total-free+256<<20+room))
	var log bytes.Buffer
	res, err := Run(cfg, Options{Log: &log})
	if err != nil || len(res.Steps) != 3 {
		t.Fatalf("auto on a device with room for full recompute: %v", err)
	}
	if !strings.Contains(log.String(), "memory plan: recompute full (chosen by train.recompute auto)") {
		t.Fatalf("the log does not say auto chose full:\n%s", log.String())
	}
	_, err = Run(tinyConfig(t, b, t.TempDir(), append(over, "train.recompute=none")...), Options{Log: io.Discard})
	if !errors.Is(err, ErrDeviceMemory) || !strings.Contains(err.Error(), "set train.recompute: full") {
		t.Fatalf("recompute none on that device: %v, want ErrDeviceMemory naming recompute full", err)
	}
	t.Logf("%v", err)
	sub := regexp.MustCompile(`the longest row that fits: (\d+) with none`).FindStringSubmatch(err.Error())
	if sub == nil {
		t.Fatalf("the error names no row length that fits: %v", err)
	}
	n, _ := strconv.Atoi(sub[1])
	if n <= 0 || n >= 256 {
		t.Fatalf("the longest row without recompute: %d, want 0 < n < 256", n)
	}
	res, err = Run(tinyConfig(t, b, t.TempDir(), append(over, "train.recompute=none", fmt.Sprintf("data.seq_len=%d", n), "data.truncate=true")...), Options{Log: io.Discard})
	if err != nil || len(res.Steps) != 3 {
		t.Fatalf("rows of %d tokens, the longest said to fit, under none: %v", n, err)
	}
}

// TestCUDAMemoryPlanOverlapHint: a data-parallel run at ZeRO 3 whose
// recompute mode fits the device only without the overlap's buffers (a
// layer's gradients and weights more) is refused with an error that names
// train.overlap_comm: false and what the plan is then; on a device with
// room for the overlap, it fits.
func TestCUDAMemoryPlanOverlapHint(t *testing.T) {
	be, cfg, mc := zero3PlanCase(t)
	s, err := train.NewStudentOn(mc, be)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Free()
	const k, ranks = 8, 2
	off := *cfg
	f := false
	off.Train.OverlapComm = &f
	on := train.PlanMemory(planShape(cfg, mc, k, decoder.RecomputeFull, be, ranks)).Total()
	without := train.PlanMemory(planShape(&off, mc, k, decoder.RecomputeFull, be, ranks)).Total()
	if on <= without {
		t.Fatalf("the overlap plans %d bytes, without it %d: want more", on, without)
	}
	p0 := train.PlanMemory(planShape(cfg, mc, k, decoder.RecomputeNone, be, ranks))
	resident := p0.Term(train.TermParams) + p0.Term(train.TermGrads) + p0.Term(train.TermMoments)
	free, total := be.MemInfo()
	used := total - free
	device := func(budget int64) { // budget = free - reserve + resident, reserve 256 MiB on a small device
		t.Setenv("DISTILL_EMU_DEVICE_MEM", fmt.Sprint(used+256<<20+budget-resident))
	}
	device((on + without) / 2)
	_, err = planRecompute(cfg, s, k, "", ranks, io.Discard)
	if !errors.Is(err, ErrDeviceMemory) || !strings.Contains(err.Error(), "or set train.overlap_comm: false ("+train.HumanBytes(without)) {
		t.Fatalf("recompute full with room only without the overlap: %v, want ErrDeviceMemory naming train.overlap_comm: false and %s", err, train.HumanBytes(without))
	}
	device(on)
	if r, err := planRecompute(cfg, s, k, "", ranks, io.Discard); err != nil || r != decoder.RecomputeFull {
		t.Fatalf("room for the overlap: %v %v", r, err)
	}
}

// zero3PlanCase opens the emulator (its device shrunk by the test later)
// for a tiny ZeRO 3 run under full recompute, rows of 256 tokens: the
// backend (closed when t ends), the run's config and the student's.
func zero3PlanCase(t *testing.T) (*cuda.Backend, *Config, *model.Config) {
	useCUDA(t)
	if cudaemu.OnGPU() {
		t.Skip("shrinks the emulator's device")
	}
	be, err := cuda.Open(cuda.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	cfg := tinyConfig(t, testCache(t), t.TempDir(), "train.device=cuda", "data.seq_len=256", "train.zero=3", "train.recompute=full")
	mc, err := cfg.Model.Random.ModelConfig()
	if err != nil {
		t.Fatal(err)
	}
	return be, cfg, mc
}

// TestCUDAMemoryPlanShardedSlots: a ZeRO 3 student's BF16 weight slots
// (the plan's BF16 weight copies at stage 3) are allocated with the
// student, so the check before step 1 counts them among what is already
// on the device: on a device with room for exactly the plan of full
// recompute, a sharded student fits.
func TestCUDAMemoryPlanShardedSlots(t *testing.T) {
	be, cfg, mc := zero3PlanCase(t)
	id, err := be.NewCollectiveID()
	if err != nil {
		t.Fatal(err)
	}
	c, err := be.JoinCollective(id, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	s, err := train.NewShardedStudentOn(mc, be, train.Sharding{C: c, Stage: 3, Overlap: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Free()
	const k, ranks = 8, 2
	p0 := train.PlanMemory(planShape(cfg, mc, k, decoder.RecomputeNone, be, ranks))
	slots := p0.Term(train.TermShadows)
	if slots == 0 {
		t.Fatal("the stage 3 plan has no BF16 weight slots")
	}
	resident := p0.Term(train.TermParams) + p0.Term(train.TermGrads) + p0.Term(train.TermMoments) + slots
	need := train.PlanMemory(planShape(cfg, mc, k, decoder.RecomputeFull, be, ranks)).Total()
	free, total := be.MemInfo()
	t.Setenv("DISTILL_EMU_DEVICE_MEM", fmt.Sprint(total-free+256<<20+need-resident)) // budget = need (reserve 256 MiB)
	if r, err := planRecompute(cfg, s, k, "", ranks, io.Discard); err != nil || r != decoder.RecomputeFull {
		t.Fatalf("a device with room for the plan of full recompute (its %d bytes of BF16 slots allocated): %v %v", slots, r, err)
	}
}
