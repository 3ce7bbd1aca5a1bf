package train

import (
	"math"
	"os"
	"testing"

	"distill/compute/cuda"
	"distill/compute/cuda/cudaemu"
	"distill/model"
	"distill/model/decoder"
)

// TestCUDADeferredZeros: the CUDA backend's deferred zeros (compute/cuda
// zeros.go: a zeroed gradient that the next call writes in whole is never
// memset, and that call writes it instead of adding to it) train the same
// student as a memset for every Zero (Options.EagerZeros): every gradient
// of the first step, the losses of three steps and the weights after them
// are the same values (the same bits but for the sign of a zero, which a
// GEMM with beta 0 may leave negative), for Qwen3 (q/k norms), Qwen2
// (biases: F32 q/k/v gradients), Llama, a Qwen3-MoE student (its experts'
// backward is not a consumer: those zeros are flushed), each recompute
// mode, QAD and a LoRA student with dropout. The third step's profile
// counts the memsets each saves: per dense layer, the MLP's dh, dgate,
// dup and dln, attention's datt, dq, dk and dv, the q/k norms' dqpre and
// dkpre (Qwen3) and the second dln: 11 a Qwen3 layer, 9 a Qwen2 or Llama
// layer, 7 (the attention's) a MoE layer; and the residual gradient's at
// the top of the backward. A consumer that stopped taking its zero, or a
// new memset between a Zero and its consumer, fails the count; one that
// wrote where it should add fails the values.
func TestCUDADeferredZeros(t *testing.T) {
	cudaemu.Use(t)
	cache := os.Getenv("DISTILL_KERNEL_CACHE")
	if cache == "" {
		cache = t.TempDir()
	}
	type tcase struct {
		name string
		stepCase
		perLayer []int // memsets saved per layer, in layer order
	}
	moe := tinyMoEConfig(false, 1)
	moeLayers := make([]int, moe.Layers)
	for i := range moeLayers {
		moeLayers[i] = 11
		if moe.IsMoE(i) {
			moeLayers[i] = 7
		}
	}
	rep := func(n, layers int) []int {
		r := make([]int, layers)
		for i := range r {
			r[i] = n
		}
		return r
	}
	q3, q2, ll := tinyConfig(model.ArchQwen3, false), tinyConfig(model.ArchQwen2, true), tinyConfig(model.ArchLlama, false)
	cases := []tcase{
		{"qwen3", stepCase{q3, decoder.RecomputeNone, false, -1}, rep(11, q3.Layers)},
		{"qwen3 full", stepCase{q3, decoder.RecomputeFull, false, -1}, rep(11, q3.Layers)},
		{"qwen3 selective qad", stepCase{q3, decoder.RecomputeSelective, true, -1}, rep(11, q3.Layers)},
		{"qwen2", stepCase{q2, decoder.RecomputeNone, false, -1}, rep(9, q2.Layers)},
		{"llama", stepCase{ll, decoder.RecomputeNone, false, -1}, rep(9, ll.Layers)},
		{"qwen3_moe", stepCase{moe, decoder.RecomputeNone, false, -1}, moeLayers},
		{"qwen3 lora dropout", stepCase{q3, decoder.RecomputeNone, false, 0.3}, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			type result struct {
				grads   []float32
				losses  []float64
				w       map[string][]float32
				memsets int // the third step's
			}
			train := func(eager bool) result {
				be, err := cuda.Open(cuda.Options{KernelCache: cache, EagerZeros: eager})
				if err != nil {
					t.Fatal(err)
				}
				defer be.Close()
				rg := c.rig(t, be)
				defer rg.s.Free()
				var r result
				for step := 0; step < 3; step++ {
					be.SetProfile(step == 2)
					st := rg.forwardBackward(t, step)
					if step == 0 {
						r.grads = make([]float32, rg.s.grads.Len())
						be.ReadF32(rg.s.grads, r.grads)
					}
					if step == 2 {
						for _, e := range be.Profile() {
							if e.Name == "memset" {
								r.memsets = e.Calls
							}
						}
						be.SetProfile(false)
					}
					r.losses = append(r.losses, st.Loss)
					rg.update()
				}
				r.w = rg.s.Weights()
				return r
			}
			lazy, eager := train(false), train(true)
			same := func(a, b float32) bool { return math.Float32bits(a) == math.Float32bits(b) || a == 0 && b == 0 }
			for i := range eager.grads {
				if !same(lazy.grads[i], eager.grads[i]) {
					t.Fatalf("step 1: gradient %d = %v with deferred zeros, %v with memsets", i, lazy.grads[i], eager.grads[i])
				}
			}
			for i := range eager.losses {
				if math.Float64bits(lazy.losses[i]) != math.Float64bits(eager.losses[i]) {
					t.Fatalf("step %d: loss %.17g with deferred zeros, %.17g with memsets", i+1, lazy.losses[i], eager.losses[i])
				}
			}
			for name, w := range eager.w {
				for j := range w {
					if !same(lazy.w[name][j], w[j]) {
						t.Fatalf("%s[%d] = %v with deferred zeros, %v with memsets", name, j, lazy.w[name][j], w[j])
					}
				}
			}
			saved := eager.memsets - lazy.memsets
			t.Logf("%d gradients, losses %v: the same values; the third step's memsets %d, %d with memsets for every Zero", len(eager.grads), lazy.losses, lazy.memsets, eager.memsets)
			if c.perLayer == nil {
				if saved <= 0 {
					t.Errorf("deferred zeros saved no memset: %d, %d eager", lazy.memsets, eager.memsets)
				}
				return
			}
			want := 1 // dres, at the top of the backward
			for _, n := range c.perLayer {
				want += n
			}
			if saved != want {
				t.Errorf("deferred zeros saved %d memsets of %d (%d left), want %d", saved, eager.memsets, lazy.memsets, want)
			}
		})
	}
}
