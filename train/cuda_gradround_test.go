package train

import (
	"math"
	"os"
	"strings"
	"testing"

	"distill/compute"
	"distill/compute/cuda"
	"distill/compute/cuda/cudaemu"
	"distill/model"
	"distill/model/decoder"
)

// TestCUDAGradsInBF16: the CUDA backend's gradients in BF16 where only a
// GEMM's or attention's backward reads them (SwiGLU's dgate and dup, the
// q/k norms' input gradients, attention's dout and dv, the residual
// stream's gradient copied by the norms' backward and q's and k's by
// RoPE's; compute.ActGrads) train the same student bit for bit
// as F32 gradients rounded by MatMulBackward's own pass
// (Options.F32Grads): every gradient of the first step, and the losses
// and weights of the steps after it, for Qwen3 (q/k norms), Qwen2 (q/k/v
// biases: their douts stay F32), Llama (RoPE's backward writes q's and
// k's BF16 douts), Llama with attention biases (o_proj's too), a
// Qwen3-MoE student with a dense layer between MoE ones, each
// recompute mode, QAD, and LoRA students (with dropout). The profile of
// the first step counts the rounding passes the producers saved: 7 a
// dense Qwen3 layer (down, gate, up, o, q, k, v), 4 a Qwen2 layer (the
// biased q, k, v's douts are rounded by their column sums' pass either
// way), 7 a Llama layer (q's and k's douts written by RoPEBackwardCopy),
// 3 a Llama layer with attention biases; and attention's dout, which
// o_proj's backward writes in BF16, once per attention call (2 a layer
// here: testBatch's samples run in two groups, attnGroups).
func TestCUDAGradsInBF16(t *testing.T) {
	cudaemu.Use(t)
	// One kernel cache for the test's 20 backends (the GPU suite's, where
	// it sets one): NVRTC compiles the kernels once, not per backend.
	cache := os.Getenv("DISTILL_KERNEL_CACHE")
	if cache == "" {
		cache = t.TempDir()
	}
	llama := tinyConfig(model.ArchLlama, false)
	llama.AttentionBias = true
	type tcase struct {
		name string
		stepCase
		saved int // the rounding passes a step saves (0: only more than none)
	}
	cases := []tcase{
		{"qwen3", stepCase{tinyConfig(model.ArchQwen3, false), decoder.RecomputeNone, false, -1}, 2 * (7 + 2)},
		{"qwen3 selective", stepCase{tinyConfig(model.ArchQwen3, true), decoder.RecomputeSelective, false, -1}, 2 * (7 + 2)},
		{"qwen3 full", stepCase{tinyConfig(model.ArchQwen3, false), decoder.RecomputeFull, false, -1}, 2 * (7 + 2)},
		{"qwen3 qad", stepCase{tinyConfig(model.ArchQwen3, false), decoder.RecomputeNone, true, -1}, 2 * (7 + 2)},
		{"qwen2", stepCase{tinyConfig(model.ArchQwen2, true), decoder.RecomputeNone, false, -1}, 2 * (4 + 2)},
		{"llama", stepCase{tinyConfig(model.ArchLlama, false), decoder.RecomputeNone, false, -1}, 2 * (7 + 2)},
		{"llama attention bias", stepCase{llama, decoder.RecomputeSelective, false, -1}, 2 * (3 + 2)},
		{"qwen3_moe", stepCase{tinyMoEConfig(false, 1), decoder.RecomputeNone, false, -1}, 0},
		{"qwen3_moe full", stepCase{tinyMoEConfig(false, 1), decoder.RecomputeFull, false, -1}, 0},
		{"qwen3 lora", stepCase{tinyConfig(model.ArchQwen3, false), decoder.RecomputeNone, false, 0}, 0},
		{"qwen3 lora dropout full", stepCase{tinyConfig(model.ArchQwen3, false), decoder.RecomputeFull, false, 0.3}, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			type result struct {
				grads  []float32
				losses []float64
				w      map[string][]float32
				conv   int // k_f32_to_bf16 calls of the first step
			}
			train := func(f32 bool) result {
				be, err := cuda.Open(cuda.Options{KernelCache: cache, F32Grads: f32})
				if err != nil {
					t.Fatal(err)
				}
				defer be.Close()
				if want := map[bool]compute.DType{false: compute.BF16, true: compute.F32}[f32]; compute.GradDType(be) != want {
					t.Fatalf("F32Grads %v: GradDType %v, want %v", f32, compute.GradDType(be), want)
				}
				rg := c.rig(t, be)
				defer rg.s.Free()
				var r result
				for step := 0; step < 3; step++ {
					if step == 0 {
						be.SetProfile(true)
					}
					st := rg.forwardBackward(t, step)
					if step == 0 {
						for _, e := range be.Profile() {
							if strings.HasPrefix(e.Name, "k_f32_to_bf16") {
								r.conv += e.Calls
							}
						}
						be.SetProfile(false)
						r.grads = make([]float32, rg.s.grads.Len())
						be.ReadF32(rg.s.grads, r.grads)
					}
					r.losses = append(r.losses, st.Loss)
					rg.update()
				}
				r.w = rg.s.Weights()
				return r
			}
			bf, f32 := train(false), train(true)
			for i := range f32.grads {
				if math.Float32bits(bf.grads[i]) != math.Float32bits(f32.grads[i]) {
					t.Fatalf("step 1: gradient %d = %v with BF16 gradients, %v with F32 ones", i, bf.grads[i], f32.grads[i])
				}
			}
			for i := range f32.losses {
				if math.Float64bits(bf.losses[i]) != math.Float64bits(f32.losses[i]) {
					t.Fatalf("step %d: loss %.17g with BF16 gradients, %.17g with F32 ones", i+1, bf.losses[i], f32.losses[i])
				}
			}
			for name, w := range f32.w {
				for j := range w {
					if math.Float32bits(w[j]) != math.Float32bits(bf.w[name][j]) {
						t.Fatalf("%s[%d] = %v with BF16 gradients, %v with F32 ones", name, j, bf.w[name][j], w[j])
					}
				}
			}
			t.Logf("%d gradients and losses %v the same bits; first step: %d roundings (F32 gradients %d)",
				len(f32.grads), bf.losses, bf.conv, f32.conv)
			switch {
			case c.saved > 0 && f32.conv-bf.conv != c.saved:
				t.Errorf("the step rounded %d times, %d with F32 gradients: want %d fewer", bf.conv, f32.conv, c.saved)
			case bf.conv >= f32.conv:
				t.Errorf("BF16 gradients saved no rounding: %d, F32 gradients %d", bf.conv, f32.conv)
			}
		})
	}
}
