package train

import (
	"math"
	"strings"
	"testing"

	"distill/compute"
	"distill/compute/cuda"
	"distill/compute/cuda/cudaemu"
	"distill/model"
	"distill/train/loss"
)

// TestCUDALoRA: a LoRA student on the CUDA backend (the CPU emulator of
// CUDA here, the GPU under DISTILL_CUDA_TEST=gpu) holds its base in BF16
// (half the bytes, read by the GEMMs as is), starts at the full
// student's loss, and its adapters' gradients agree with the CPU's
// norm-wise within BF16's rounding of the GEMM operands, and so do the
// Linears' input amax its calibration finds (the merged NVFP4 export's);
// a few AdamW steps lower the loss and leave the base as loaded.
func TestCUDALoRA(t *testing.T) {
	cudaemu.Use(t)
	be, err := cuda.Open(cuda.Options{KernelCache: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	cfg := tinyConfig(model.ArchQwen3, false)
	w := model.Init(cfg, model.InitOptions{Seed: 3, Std: 0.1, Perturb: true})
	lc := LoRAConfig{Rank: 4, Alpha: 8, Targets: allTargets, Init: "kaiming", Seed: 1}
	g, err := NewLoRAStudentOn(cfg, be, mapSource(w), lc)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Free()
	c := newLoRA(t, cfg, w, lc)
	defer c.Free()
	if dt := g.lora.base.DType(); dt != be.ActDType() || dt != compute.BF16 {
		t.Fatalf("base dtype %v, want bf16 (the backend's activations %v)", dt, be.ActDType())
	}
	// B non-zero, the same on both.
	ad := map[string][]float32{}
	for name, v := range c.Weights() {
		v = append([]float32(nil), v...)
		if strings.HasSuffix(name, "lora_B.weight") {
			for i := range v {
				v[i] = float32(math.Sin(float64(i))) * 0.2
			}
		}
		ad[name] = v
	}
	if err := c.Load(ad); err != nil {
		t.Fatal(err)
	}
	if err := g.Load(ad); err != nil {
		t.Fatal(err)
	}
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.5}
	b := testBatch(4, cfg.VocabSize, 6)
	c.ZeroGrad()
	g.ZeroGrad()
	cs, err := c.ForwardBackward(b, &opt, 0)
	if err != nil {
		t.Fatal(err)
	}
	gs, err := g.ForwardBackward(b, &opt, 0)
	if err != nil {
		t.Fatal(err)
	}
	if math.Abs(cs.Loss-gs.Loss) > 2e-2*math.Abs(cs.Loss) {
		t.Fatalf("loss: CUDA %.8g, CPU %.8g", gs.Loss, cs.Loss)
	}
	gg := make([]float32, len(c.Grads))
	be.ReadF32(g.grads, gg)
	for _, ts := range c.Tensors {
		want, got := c.Grads[ts.Off:ts.Off+ts.N], gg[ts.Off:ts.Off+ts.N]
		var d, m float64
		for i := range want {
			d, m = max(d, math.Abs(float64(got[i]-want[i]))), max(m, math.Abs(float64(want[i])))
		}
		if !(d <= 0.05*m) {
			t.Errorf("%s: max |CUDA - CPU| %.3g > 5%% of max |grad| %.3g", ts.Name, d, m)
		}
	}
	// The inputs' amax calibration (for the merged NVFP4 export) reads
	// the CUDA student's BF16 activations: the CPU's amax within 2%.
	for _, s := range []*Student{g, c} {
		if err := s.StartInputCalibration(); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Forward(b, &opt); err != nil {
			t.Fatal(err)
		}
		if err := s.FinishInputCalibration(); err != nil {
			t.Fatal(err)
		}
	}
	ga, ca := g.InputAmax(), c.InputAmax()
	if len(ga) != 4*cfg.Layers || len(ca) != len(ga) {
		t.Fatalf("input amax: CUDA %v, CPU %v", ga, ca)
	}
	for i := range ga {
		if math.Abs(float64(ga[i]-ca[i])) > 0.02*float64(ca[i]) {
			t.Fatalf("input amax %d: CUDA %g, CPU %g", i, ga[i], ca[i])
		}
	}
	ad2 := newTestAdamW(t, g, 1e-2)
	first := gs.Loss
	for i := 0; i < 6; i++ {
		g.ZeroGrad()
		if _, err := g.ForwardBackward(b, &opt, 0); err != nil {
			t.Fatal(err)
		}
		ad2.Step(1e-2)
	}
	last, _ := g.Forward(b, &opt)
	if !(last.Loss < first) {
		t.Fatalf("6 AdamW steps on CUDA: loss %g -> %g", first, last.Loss)
	}
	bw := g.baseWeights()
	for name, v := range bw {
		for i, x := range v {
			if x != compute.BF16ToF32(compute.F32ToBF16(w[name][i])) {
				t.Fatalf("base %s[%d] = %v, want the loaded value in bf16 (%v)", name, i, x, w[name][i])
			}
		}
	}
}

// TestCUDALoRADropout: with lora_dropout 0.3 the CUDA backend (the
// emulator; the GPU under DISTILL_CUDA_TEST=gpu) and the CPU draw the
// same masks in a whole student's forward and backward: at the same
// (step, row) their losses agree within BF16's rounding and their
// adapters' gradients norm-wise within 5%, while another row's masks move
// the gradients by more than that (so the check would see other masks).
func TestCUDALoRADropout(t *testing.T) {
	cudaemu.Use(t)
	be, err := cuda.Open(cuda.Options{KernelCache: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	cfg := tinyConfig(model.ArchQwen3, false)
	w := model.Init(cfg, model.InitOptions{Seed: 3, Std: 0.1, Perturb: true})
	lc := LoRAConfig{Rank: 4, Alpha: 8, Targets: allTargets, Init: "kaiming", Seed: 1, Dropout: 0.3}
	g, err := NewLoRAStudentOn(cfg, be, mapSource(w), lc)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Free()
	c := newLoRA(t, cfg, w, lc)
	defer c.Free()
	ad := map[string][]float32{}
	for name, v := range c.Weights() {
		v = append([]float32(nil), v...)
		if strings.HasSuffix(name, "lora_B.weight") {
			for i := range v {
				v[i] = float32(math.Sin(float64(i))) * 0.2
			}
		}
		ad[name] = v
	}
	if err := c.Load(ad); err != nil {
		t.Fatal(err)
	}
	if err := g.Load(ad); err != nil {
		t.Fatal(err)
	}
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.5}
	b := testBatch(4, cfg.VocabSize, 6)
	run := func(s *Student, step, row int) (float64, []float32) {
		s.ZeroGrad()
		s.SetStepRow(step, row)
		st, err := s.ForwardBackward(b, &opt, 0)
		if err != nil {
			t.Fatal(err)
		}
		gr := make([]float32, s.grads.Len())
		s.be.ReadF32(s.grads, gr)
		return st.Loss, gr
	}
	cl, cg := run(c, 2, 1)
	_, other := run(c, 2, 0)
	gl, gg := run(g, 2, 1)
	if math.Abs(cl-gl) > 2e-2*math.Abs(cl) {
		t.Fatalf("loss: CUDA %.8g, CPU %.8g", gl, cl)
	}
	moved := false
	for _, ts := range c.Tensors {
		want, got, oth := cg[ts.Off:ts.Off+ts.N], gg[ts.Off:ts.Off+ts.N], other[ts.Off:ts.Off+ts.N]
		var d, o, m float64
		for i := range want {
			d, m = max(d, math.Abs(float64(got[i]-want[i]))), max(m, math.Abs(float64(want[i])))
			o = max(o, math.Abs(float64(oth[i]-want[i])))
		}
		if !(d <= 0.05*m) {
			t.Errorf("%s: max |CUDA - CPU| %.3g > 5%% of max |grad| %.3g", ts.Name, d, m)
		}
		moved = moved || o > 0.05*m
	}
	if !moved {
		t.Fatal("another row's masks leave every gradient within 5%: the comparison could not see a wrong mask")
	}
}
