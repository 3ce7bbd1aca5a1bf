package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"distill/compute"
)

// TestWeightShadows: the BF16 shadows of parameters (shadow.go) change no
// bit. The same sequence of calls runs on a backend with shadows and on
// one with Options.PerUseCasts: GEMMs before the first AdamW, after it
// (the shadow made by the first GEMM), after a fused AdamW (written by
// k_adamw), after every other write path into a parameter (WriteF32 of
// the view and of the whole arena, Zero, Copy, Scale, Add, an in-place
// FakeQuantNVFP4, a kernel's output), and under QAD (the fake-quantized
// copy's shadow, the refresh skipped only while nothing changed, the
// amax changed, the copy overwritten); every GEMM's output must be the
// same bits on both. The profile counts what the shadows save: no
// rounding of a parameter once it has one, and one fake quantization per
// AdamW step.
func TestWeightShadows(t *testing.T) {
	if !onGPU() {
		useEmu(t)
	}
	open := func(perUse bool) *Backend {
		b, err := Open(Options{KernelCache: kernelCacheForTests(t), PerUseCasts: perUse, Profile: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Close() })
		return b
	}
	on, off := open(false), open(true)
	type stage struct {
		name string
		out  []float32
		prof map[string]int
	}
	run := func(be *Backend) []stage {
		const m, n, k = 5, 24, 32 // k a multiple of 16: the NVFP4 rows
		r := rand.New(rand.NewPCG(7, 8))
		var stages []stage
		arena := be.FromF32(randF32(r, 2*n*k+n))
		w1, w2, norm := be.View(arena, 0, n*k), be.View(arena, n*k, n*k), be.View(arena, 2*n*k, n)
		params := []compute.Tensor{w1, w2, norm}
		var grads, ms, vs []compute.Tensor
		for _, p := range params {
			grads = append(grads, be.FromF32(randF32(r, p.Len())))
			ms = append(ms, be.New(compute.F32, p.Len()))
			vs = append(vs, be.New(compute.F32, p.Len()))
		}
		x := be.FromF32(randF32(r, m*k))
		dout := be.FromF32(randF32(r, m*n))
		out, dx, dw := be.New(compute.F32, m*n), be.New(compute.F32, m*k), be.New(compute.F32, n*k)
		wfq := be.New(compute.F32, n*k)
		step := 0
		adam := func() {
			step++
			st := compute.AdamWStep{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, StepSize: 1e-2, BC2Sqrt: 0.5, Decay: 0.99}
			for i, p := range params {
				be.AdamW(p, grads[i], ms[i], vs[i], p.Len(), st)
			}
		}
		// gemms runs a layer's GEMMs on w and records their outputs and
		// the profile's call counts.
		gemms := func(name string, w compute.Tensor) {
			be.Profile() // reset
			be.MatMul(out, x, w, nil, m, n, k)
			be.Zero(dx)
			be.Zero(dw)
			be.MatMulBackward(dx, dw, nil, dout, x, w, m, n, k)
			var o []float32
			for _, tt := range []compute.Tensor{out, dx, dw} {
				o = append(o, readF32(be, tt, tt.Len())...)
			}
			calls := map[string]int{}
			for _, e := range be.Profile() {
				calls[strings.TrimSuffix(e.Name, "_x4")] += e.Calls
			}
			stages = append(stages, stage{name, o, calls})
		}
		gemms("before AdamW", w1)
		adam()
		gemms("after the first AdamW", w1)
		gemms("again", w1)
		adam()
		gemms("after a fused AdamW", w1)
		be.WriteF32(w1, randF32(r, n*k))
		gemms("after WriteF32", w1)
		be.Zero(w1)
		gemms("after Zero", w1)
		be.Copy(w1, w2)
		gemms("after Copy", w1)
		be.Scale(w1, n*k, 0.75)
		gemms("after Scale", w1)
		be.Add(w1, w2, n*k)
		gemms("after Add", w1)
		be.FakeQuantNVFP4(w1, w1, n, k, 3)
		gemms("after an in-place FakeQuantNVFP4", w1)
		be.MatMul(be.View(arena, 0, m*n), x, w2, nil, m, n, k)
		gemms("after a MatMul into it", w1)
		adam()
		be.WriteF32(arena, randF32(r, 2*n*k+n))
		gemms("after WriteF32 of the arena", w1)
		gemms("w2 after WriteF32 of the arena", w2)
		adam()
		// QAD: the decoder quantizes every weight before every forward.
		for i, amax := range []float32{4, 4, 4, 2, 2, 2} {
			if i == 2 {
				adam()
			}
			if i == 5 {
				be.Zero(wfq)
			}
			be.Profile()
			be.FakeQuantNVFP4(wfq, w1, n, k, amax)
			fq := 0
			for _, e := range be.Profile() {
				if e.Name == "k_fakequant_nvfp4" || e.Name == "k_fakequant_nvfp4_lanes" { // cols % 16: either kernel
					fq += e.Calls
				}
			}
			gemms(fmt.Sprintf("QAD %d", i), wfq)
			stages[len(stages)-1].prof["k_fakequant_nvfp4"] = fq
		}
		// Freed and allocated again: nothing of the old shadows survives.
		be.Free(arena)
		arena = be.FromF32(randF32(r, 2*n*k+n))
		gemms("a new arena", be.View(arena, 0, n*k))
		return stages
	}
	a, b := run(on), run(off)
	// What the shadows must save, per stage: the roundings of the weight
	// (forward and backward's dx) where its shadow is current, one where
	// the forward makes it; and the fake quantizations that would repeat
	// one (QAD 1 and 4: nothing changed since; QAD 2 follows an AdamW,
	// QAD 3 changes the amax, QAD 5 follows a write to the copy).
	saves := map[string][2]int{ // stage: {roundings saved, fake quantizations saved}
		"again": {2, 0}, "after a fused AdamW": {2, 0},
		"QAD 0": {1, 0}, "QAD 1": {2, 1}, "QAD 2": {2, 0}, "QAD 3": {2, 0}, "QAD 4": {2, 1}, "QAD 5": {2, 0},
		"after the first AdamW": {1, 0}, "after WriteF32": {1, 0}, "after Zero": {1, 0}, "after Copy": {1, 0}, "after Scale": {1, 0},
		"after Add": {1, 0}, "after an in-place FakeQuantNVFP4": {1, 0}, "after a MatMul into it": {1, 0},
		"after WriteF32 of the arena": {1, 0}, "w2 after WriteF32 of the arena": {1, 0},
	}
	for i := range a {
		for j := range a[i].out {
			if math.Float32bits(a[i].out[j]) != math.Float32bits(b[i].out[j]) {
				t.Fatalf("%s: element %d is %v with shadows, %v rounding per use", a[i].name, j, a[i].out[j], b[i].out[j])
			}
		}
		conv := func(s stage) int { return s.prof["k_f32_to_bf16"] }
		want := saves[a[i].name]
		t.Logf("%-34s roundings %d (per use %d), fake quantizations %d (%d)", a[i].name, conv(a[i]), conv(b[i]),
			a[i].prof["k_fakequant_nvfp4"], b[i].prof["k_fakequant_nvfp4"])
		if got := conv(b[i]) - conv(a[i]); got != want[0] {
			t.Errorf("%s: %d roundings with shadows, %d per use: want %d saved", a[i].name, conv(a[i]), conv(b[i]), want[0])
		}
		if got := b[i].prof["k_fakequant_nvfp4"] - a[i].prof["k_fakequant_nvfp4"]; got != want[1] {
			t.Errorf("%s: %d fake quantizations saved, want %d", a[i].name, got, want[1])
		}
	}
	if off.ShadowBytes() != 0 || on.ShadowBytes() == 0 {
		t.Errorf("ShadowBytes: %d with shadows, %d per use", on.ShadowBytes(), off.ShadowBytes())
	}
}
