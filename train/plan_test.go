package train

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"distill/compute"
	"distill/compute/computetest"
	"distill/compute/cuda"
	"distill/compute/cuda/cudaemu"
	"distill/model"
	"distill/model/decoder"
	"distill/train/loss"
	"distill/train/optim"
)

// planBatch is one packed row of T tokens (samples of 200 tokens and the
// rest), every position counted, with K distinct teacher ids a position.
func planBatch(T, V, K int) *Batch {
	r := rand.New(rand.NewPCG(3, 4))
	b := &Batch{Tokens: make([]int32, T), Mask: make([]uint8, T), K: K, TopIDs: make([]int32, T*K), TopLP: make([]float32, T*K)}
	for s := 0; s < T; s += 200 {
		b.Starts = append(b.Starts, int32(s))
	}
	b.Starts = append(b.Starts, int32(T))
	for t := 0; t < T; t++ {
		b.Tokens[t], b.Mask[t] = int32(r.IntN(V)), 1
		for j, id := range r.Perm(V)[:K] {
			b.TopIDs[t*K+j], b.TopLP[t*K+j] = int32(id), float32(-2-0.1*float64(j))
		}
	}
	return b
}

// TestTrainPlanDeviceBytes: the training memory plan against the device
// memory the CUDA backend (the emulator here, the GPU under
// DISTILL_CUDA_TEST=gpu) takes, measured by the pool's high-water mark
// (PeakMemory) over two optimizer steps of a fresh student, with and
// without NVFP4 QAD, under every recompute mode: the plan bounds the
// measurement and is at most twice it, for the whole step and for each
// dominant term: the run-long state (parameters, gradients, moments,
// QAD's weights), what stays allocated between steps (the activation
// arena and the BF16 weight copies), and the largest kernel scratch above
// that. Also sharded students' layouts (ZeRO stages 2 and 3, over a
// group of one: the same buffers as any group, each part whole), with
// and without Sharding.Overlap (whose collectives run on the backend's
// second stream: the emulator checks their order against the compute).
func TestTrainPlanDeviceBytes(t *testing.T) {
	cudaemu.Use(t)
	be, err := cuda.Open(cuda.Options{KernelCache: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	cfg := &model.Config{Arch: model.ArchQwen3, VocabSize: 512, Hidden: 64, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
		Intermediate: 128, MaxPositions: 1024, RMSNormEps: 1e-6, RopeTheta: 10000, QKNorm: true, TieEmbeddings: true}
	const T, K = 256, 8
	b := planBatch(T, cfg.VocabSize, K)
	// cuDNN's workspace for a row's attention, as the trainer plans it: one
	// sample of the row's tokens (its plans are bucketed by the samples'
	// count and longest length; the decoder cuts planBatch's two samples,
	// of 200 and 56 tokens, into one call each, within that bucket).
	ws := be.AttentionWorkspaceBytes(1, T, cfg.Heads, cfg.KVHeads, cfg.HeadDim)
	t.Logf("attention workspace (%s) for 1 sample of %d tokens: %d bytes", be.AttentionImpl(), T, ws)
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
	used := func() int64 { be.ResetPeakMemory(); return be.PeakMemory() }
	within := func(what string, got, plan int64) {
		t.Helper()
		t.Logf("  %-34s measured %9d bytes, plan %9d (%.2fx)", what, got, plan, float64(plan)/float64(got))
		if got > plan || plan > 2*got {
			t.Errorf("%s: measured %d bytes, planned %d: want measured <= plan <= 2·measured", what, got, plan)
		}
	}
	type planCase struct {
		qad     bool
		mode    decoder.Recompute
		stage   int // 2, 3: sharded over a group of one (its layout and buffers)
		overlap bool
	}
	var cases []planCase
	for _, qad := range []bool{false, true} {
		for _, mode := range decoder.RecomputeModes {
			cases = append(cases, planCase{qad, mode, 0, false})
		}
		for _, stage := range []int{2, 3} {
			for _, ov := range []bool{false, true} {
				cases = append(cases, planCase{qad, decoder.RecomputeNone, stage, ov}, planCase{qad, decoder.RecomputeFull, stage, ov})
			}
		}
	}
	for _, c := range cases {
		qad, mode := c.qad, c.mode
		{
			t.Run(fmt.Sprintf("qad=%v/%s/zero%d/overlap=%v", qad, mode, c.stage, c.overlap), func(t *testing.T) {
				base := used()
				var s *Student
				var err error
				if c.stage > 0 {
					s, err = NewShardedStudentOn(cfg, be, Sharding{C: computetest.NewHostGroup(1).Rank(0, be), Stage: c.stage, Overlap: c.overlap, FP32Gathers: qad})
				} else {
					s, err = NewStudentOn(cfg, be)
				}
				if err != nil {
					t.Fatal(err)
				}
				defer s.Free()
				if err := s.Load(model.Init(cfg, model.InitOptions{Seed: 1})); err != nil {
					t.Fatal(err)
				}
				ad, err := optim.NewAdamW(optim.AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.01}, s.Groups())
				if err != nil {
					t.Fatal(err)
				}
				defer ad.Free()
				if err := s.Model.SetRecompute(mode); err != nil {
					t.Fatal(err)
				}
				if qad {
					if err := s.EnableQAD(); err != nil {
						t.Fatal(err)
					}
					if _, err := s.Forward(b, &opt); err != nil {
						t.Fatal(err)
					}
					if err := s.FinishCalibration(); err != nil {
						t.Fatal(err)
					}
				}
				be.ResetPeakMemory()
				for step := 0; step < 2; step++ {
					s.ZeroGrad()
					if _, err := s.ForwardBackward(b, &opt, 0); err != nil {
						t.Fatal(err)
					}
					if c.stage > 0 {
						s.AllReduceGrads(nil)
					}
					optim.ClipGradNorm(ad.Groups, 1)
					ad.Step(1e-3)
					s.AfterStep()
				}
				peak := be.PeakMemory() - base
				after := used() - base
				p := PlanMemory(PlanShape{Model: cfg, RowTokens: T, K: K, QAD: qad, Recompute: mode, Activations: be.ActDType(), AttnWorkspace: ws, Ranks: 1, ZeRO: c.stage, Overlap: c.overlap})
				run := p.Term(TermParams) + p.Term(TermGrads) + p.Term(TermMoments) + p.Term(TermQAD)
				var scratch int64
				for _, x := range p.Terms {
					if x.Scratch {
						scratch = max(scratch, x.Bytes)
					}
				}
				// What stays between steps beside the run-long state: the
				// arena, the weights' BF16 copies (where the backend keeps
				// them) and the last batch's tokens and starts.
				kept := after - run
				t.Logf("qad %v, recompute %s, %d tokens: peak %d bytes beside the backend's own", qad, mode, T, peak)
				within("the whole step", peak, p.Total())
				within("activations, batch and weight copies", kept, p.Term(TermActivations)+p.Term(TermBatch)+p.Term(TermShadows))
				within("the largest kernel scratch", peak-after, scratch)
				if run > after {
					t.Errorf("the run-long terms alone (%d bytes) exceed what stays allocated (%d)", run, after)
				}
			})
		}
	}
}

// TestCUDAOutOfMemoryIsAnError: on a device too small (the emulator,
// shrunk), allocating the student, its moments, its fake-quantized
// weights or a row's activations is an error wrapping
// compute.ErrOutOfMemory, never a panic; and once the device has room
// again the same student trains (a failed arena leaves nothing freed
// behind).
func TestCUDAOutOfMemoryIsAnError(t *testing.T) {
	cudaemu.Use(t)
	if cudaemu.OnGPU() {
		t.Skip("shrinks the emulator's device")
	}
	be, err := cuda.Open(cuda.Options{KernelCache: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	cfg := tinyConfig(model.ArchQwen3, true)
	free, total := be.MemInfo()
	shrink := func(room int64) { t.Setenv("DISTILL_EMU_DEVICE_MEM", fmt.Sprint(total-free+room)) }
	isOOM := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, compute.ErrOutOfMemory) {
			t.Fatalf("%s on a full device: %v, want an error wrapping compute.ErrOutOfMemory", what, err)
		}
		t.Logf("%s: %v", what, err)
	}
	shrink(1 << 10)
	_, err = NewStudentOn(cfg, be)
	isOOM("NewStudentOn", err)
	t.Setenv("DISTILL_EMU_DEVICE_MEM", "")
	s, err := NewStudentOn(cfg, be)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Free()
	if err := s.Load(model.Init(cfg, model.InitOptions{Seed: 1})); err != nil {
		t.Fatal(err)
	}
	free, total = be.MemInfo()
	shrink(1 << 10)
	_, err = optim.NewAdamW(optim.AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8}, s.Groups())
	isOOM("NewAdamW", err)
	t.Setenv("DISTILL_EMU_DEVICE_MEM", "")
	ad, err := optim.NewAdamW(optim.AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8}, s.Groups())
	if err != nil {
		t.Fatal(err)
	}
	defer ad.Free()
	b := testBatch(2, cfg.VocabSize, 8)
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
	free, total = be.MemInfo()
	shrink(1 << 10)
	_, err = s.ForwardBackward(b, &opt, 0)
	isOOM("ForwardBackward", err)
	_, err = s.Forward(b, &opt)
	isOOM("Forward", err)
	if err := s.EnableQAD(); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DISTILL_EMU_DEVICE_MEM", "")
	if _, err := s.Forward(b, &opt); err != nil {
		t.Fatal(err)
	}
	free, total = be.MemInfo()
	shrink(1 << 10)
	isOOM("FinishCalibration", s.FinishCalibration())
	t.Setenv("DISTILL_EMU_DEVICE_MEM", "")
	// With room again: calibrate, then steps train.
	if err := s.EnableQAD(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Forward(b, &opt); err != nil {
		t.Fatal(err)
	}
	if err := s.FinishCalibration(); err != nil {
		t.Fatal(err)
	}
	for step := 0; step < 2; step++ {
		s.ZeroGrad()
		if _, err := s.ForwardBackward(b, &opt, 0); err != nil {
			t.Fatalf("step %d with room on the device: %v", step, err)
		}
		ad.Step(1e-3)
	}
}

// TestAttnWorkspaceEstimate: the paper plan's cuDNN workspace is within 1%
// of what cuDNN 9.19's deterministic backward asked for on an H200
// (docs/gpu-runs/2026-11-26-h200-bf16: one sample of 8192 tokens, 16/8
// heads of 128, 2112 MiB; TestTrainPlanDeviceBytes' 256 tokens, 4/2 heads
// of 16, 590,592 bytes; the cuDNN test's 16 samples of 1024 with 2/2
// heads of 64 is 16 of the one-sample bucket, 67,116,032 bytes).
func TestAttnWorkspaceEstimate(t *testing.T) {
	for _, c := range []struct {
		T, H, KV, D, samples int64
		measured             int64
	}{
		{8192, 16, 8, 128, 1, 2112 << 20},
		{256, 4, 2, 16, 1, 590592},
		{1024, 2, 2, 64, 16, 67116032},
	} {
		got := c.samples * attnWorkspaceEstimate(c.T, c.H, c.KV, c.D)
		if r := float64(got) / float64(c.measured); r < 0.99 || r > 1.01 {
			t.Errorf("T %d, %d/%d heads of %d, %d samples: estimate %d bytes, measured %d (%.3fx)", c.T, c.H, c.KV, c.D, c.samples, got, c.measured, r)
		}
	}
}

// routers is the parameters of cfg's MoE routers.
func routers(cfg *model.Config) int64 {
	var n int64
	for _, t := range cfg.Tensors() {
		if isRouter(t.Name) {
			n += int64(t.Shape[0]) * int64(t.Shape[1])
		}
	}
	return n
}

// TestExpertParallelSaving: at ZeRO 0 and 1 what EP over N ranks saves is
// what the plan's run-long terms lose when each rank holds 1/N of the
// experts (the plan of the same student with E/N experts a layer: every
// byte of an expert's weights, gradients, copies and, at stage 0,
// moments, is per expert); a dense student and one process save nothing;
// at stage 3 it is the slots' and gradient buffer's share of the largest
// layer's experts.
func TestExpertParallelSaving(t *testing.T) {
	moe := func(experts int) *model.Config {
		c, err := model.Preset(model.ArchQwen3MoE)
		if err != nil {
			t.Fatal(err)
		}
		c.NumExperts = experts
		return c
	}
	runLong := func(s PlanShape) int64 {
		var b int64
		for _, x := range PlanMemory(s).Terms {
			if !x.PerRow {
				b += x.Bytes
			}
		}
		return b
	}
	const n = 4
	for _, zero := range []int{0, 1} {
		for _, qad := range []bool{false, true} {
			s := PlanShape{Model: moe(8), RowTokens: 64, K: 8, QAD: qad, Ranks: n, ZeRO: zero, Activations: compute.BF16}
			small := s
			small.Model = moe(8 / n)
			// The routers (E x hidden a layer) shrink with E too, but EP
			// keeps them whole on every rank: 18 bytes a parameter at stage
			// 0 (weights, gradients, moments, BF16 copy; never quantized).
			want := runLong(s) - runLong(small) - 18*(routers(s.Model)-routers(small.Model))
			if zero == 1 { // the moments are 1/N already, as EP's would be
				want = runLong(s) - runLong(small) - 10*(routers(s.Model)-routers(small.Model))
				want -= PlanMemory(s).Term(TermMoments) - PlanMemory(small).Term(TermMoments)
			}
			if got := ExpertParallelSaving(s); got != want || got <= 0 {
				t.Errorf("ZeRO %d, QAD %v: EP over %d ranks saves %d, the plan's expert bytes beyond a rank's share %d", zero, qad, n, got, want)
			}
		}
	}
	if got := ExpertParallelSaving(PlanShape{Model: moe(8), Ranks: 1}); got != 0 {
		t.Errorf("one process: EP saves %d", got)
	}
	dense, _ := model.Preset(model.ArchQwen3)
	if got := ExpertParallelSaving(PlanShape{Model: dense, Ranks: n, ZeRO: 3}); got != 0 {
		t.Errorf("a dense student: EP saves %d", got)
	}
	c := moe(8)
	per := int64(c.NumExperts) * 3 * int64(c.Hidden) * int64(c.MoEIntermediate)
	// Two BF16 weight slots (BF16 gathers) and an fp32 gradient buffer.
	if got := ExpertParallelSaving(PlanShape{Model: c, Ranks: n, ZeRO: 3}); got != 8*per {
		t.Errorf("ZeRO 3: EP saves %d, want 8 bytes x %d expert parameters a layer", got, per)
	}
	// With overlap: three weight slots and two gradient buffers.
	if got := ExpertParallelSaving(PlanShape{Model: c, Ranks: n, ZeRO: 3, Overlap: true}); got != 14*per {
		t.Errorf("ZeRO 3 with overlap: EP saves %d, want 14 bytes x %d expert parameters a layer", got, per)
	}
	// Under QAD the slots are fp32 (and EP keeps its own experts'
	// fake-quantized twins: 4 bytes each, 1/N of the layers' experts).
	var experts int64
	for _, t := range c.Tensors() {
		if isExpert(t.Name) {
			experts += int64(t.Shape[0]) * int64(t.Shape[1])
		}
	}
	own := (experts + n - 1) / n
	// ZeRO 2: every expert's whole weights, BF16 (fp32 under QAD), and a
	// layer's whole gradients.
	if got := ExpertParallelSaving(PlanShape{Model: c, Ranks: n, ZeRO: 2}); got != 2*experts+4*per {
		t.Errorf("ZeRO 2: EP saves %d, want 2 x %d expert parameters + 4 x %d a layer", got, experts, per)
	}
	if got := ExpertParallelSaving(PlanShape{Model: c, Ranks: n, ZeRO: 2, QAD: true}); got != 4*experts+4*per+4*(experts-own) {
		t.Errorf("ZeRO 2 under QAD: EP saves %d, want 4 x %d expert parameters + 4 x %d a layer + 4 x %d", got, experts, per, experts-own)
	}
	if got := ExpertParallelSaving(PlanShape{Model: c, Ranks: n, ZeRO: 3, QAD: true}); got != 12*per+4*2*per-4*own {
		t.Errorf("ZeRO 3 under QAD: EP saves %d, want 12 + 8 bytes x %d expert parameters a layer less 4 x %d", got, per, own)
	}
}

// TestPlanLoRADropout: lora_dropout adds to the adapters' scratch the
// dropout's input (activation dtype) and gradient (fp32), a row's tokens
// times the widest adapted input (down_proj's: the intermediate size),
// and nothing else.
func TestPlanLoRADropout(t *testing.T) {
	cfg := tinyConfig(model.ArchQwen3, false)
	lc := LoRAConfig{Rank: 4, Alpha: 8, Targets: allTargets, Init: "kaiming"}
	shape := PlanShape{Model: cfg, RowTokens: 100, K: 8, Activations: compute.BF16, LoRA: &lc}
	terms := func(p MemoryPlan) map[string]int64 {
		m := map[string]int64{}
		for _, x := range p.Terms {
			m[x.Name] += x.Bytes
		}
		return m
	}
	a := terms(PlanMemory(shape))
	d := lc
	d.Dropout = 0.1
	shape.LoRA = &d
	b := terms(PlanMemory(shape))
	for name, v := range a {
		want := v
		if name == TermLoRAScratch {
			want += int64(100 * cfg.Intermediate * (2 + 4))
		}
		if b[name] != want {
			t.Errorf("%s: %d bytes with dropout, want %d (%d without)", name, b[name], want, v)
		}
	}
}

// TestTrainPlanLoRAMoE: the plan of a LoRA student on a Qwen3-MoE base
// (attention adapters; the experts and routers frozen in the BF16 base
// arena, their backward with no weight gradients) against the device
// memory the CUDA backend takes over two optimizer steps (the pool's
// high-water mark): the plan bounds the measurement and is at most twice
// it, for the whole step and for what stays allocated (the base, the
// adapters and their state, the activation arena); and the run-long
// terms hold no fp32 copy of the base: parameters, gradients and moments
// are the adapters' alone. With adapters on the attention, then on every
// module, every expert's included (their scratch in the MoE term).
func TestTrainPlanLoRAMoE(t *testing.T) {
	cudaemu.Use(t)
	be, err := cuda.Open(cuda.Options{KernelCache: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	cfg := &model.Config{Arch: model.ArchQwen3MoE, VocabSize: 512, Hidden: 64, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16,
		Intermediate: 128, MaxPositions: 1024, RMSNormEps: 1e-6, RopeTheta: 10000, QKNorm: true, TieEmbeddings: true,
		NumExperts: 8, ExpertsPerTok: 2, MoEIntermediate: 96, DecoderSparseStep: 1, NormTopKProb: true,
		OutputRouterLogits: true, RouterAuxLossCoef: 0.01}
	const T, K = 256, 8
	b := planBatch(T, cfg.VocabSize, K)
	ws := be.AttentionWorkspaceBytes(1, T, cfg.Heads, cfg.KVHeads, cfg.HeadDim)
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
	for _, targets := range [][]string{{"q_proj", "k_proj", "v_proj", "o_proj"}, allTargets} {
		lc := LoRAConfig{Rank: 8, Alpha: 16, Targets: targets, Init: "kaiming", Seed: 1}
		t.Run(fmt.Sprintf("%d targets", len(targets)), func(t *testing.T) {
			be.ResetPeakMemory()
			base := be.PeakMemory()
			s, err := NewLoRAStudentOn(cfg, be, mapSource(model.Init(cfg, model.InitOptions{Seed: 1})), lc)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Free()
			ad, err := optim.NewAdamW(optim.AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.01}, s.Groups())
			if err != nil {
				t.Fatal(err)
			}
			defer ad.Free()
			be.ResetPeakMemory()
			for step := 0; step < 2; step++ {
				s.ZeroGrad()
				if _, err := s.ForwardBackward(b, &opt, 0); err != nil {
					t.Fatal(err)
				}
				optim.ClipGradNorm(ad.Groups, 1)
				ad.Step(1e-3)
				s.AfterStep()
			}
			peak := be.PeakMemory() - base
			be.ResetPeakMemory()
			after := be.PeakMemory() - base
			p := PlanMemory(PlanShape{Model: cfg, RowTokens: T, K: K, Activations: be.ActDType(), AttnWorkspace: ws, Ranks: 1, LoRA: &lc})
			within := func(what string, got, plan int64) {
				t.Helper()
				t.Logf("  %-34s measured %9d bytes, plan %9d (%.2fx)", what, got, plan, float64(plan)/float64(got))
				if got > plan || plan > 2*got {
					t.Errorf("%s: measured %d bytes, planned %d: want measured <= plan <= 2·measured", what, got, plan)
				}
			}
			within("the whole step", peak, p.Total())
			var kept int64
			for _, x := range p.Terms {
				if !x.Scratch {
					kept += x.Bytes
				}
			}
			within("what stays between steps", after, kept)
			var adapters int64
			for _, ts := range s.Tensors {
				adapters += int64(ts.N)
			}
			if got := p.Term(TermParams) + p.Term(TermMoments); got != 12*adapters {
				t.Errorf("parameters and moments planned at %d bytes, want 12 bytes for each of the %d adapter elements", got, adapters)
			}
			// The base in BF16, each tensor aligned to 64 elements in its arena.
			var n, pad int64
			for _, ts := range cfg.Tensors() {
				k := int64(1)
				for _, d := range ts.Shape {
					k *= int64(d)
				}
				n, pad = n+k, pad+63
			}
			if got := p.Term(TermLoRABase); got < 2*n || got > 2*(n+pad) {
				t.Errorf("frozen base planned at %d bytes, want its %d elements in BF16 (%d bytes, plus up to 126 of alignment a tensor)", got, n, 2*n)
			}
		})
	}
}
