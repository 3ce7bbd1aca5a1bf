package train

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"distill/compute/cuda"
	"distill/compute/cuda/cudaemu"
	"distill/model"
	"distill/train/loss"
	"distill/train/optim"
)

// TestCUDAWeightShadows: the CUDA backend's BF16 shadows of the fp32
// master weights (AdamW writes each weight's rounding, the GEMMs read it;
// under QAD the fake-quantized copy's rounding, once per step) train the
// same student bit for bit as rounding every operand per use
// (Options.PerUseCasts): the losses of every step and the weights after
// them, for a dense Qwen3 student (tied and untied LM head) and a
// Qwen3-MoE one, without and with NVFP4 QAD. The profile of the last step
// counts what the shadows save: the weights' roundings, and under QAD the
// weights' fake quantizations repeated by a second forward.
func TestCUDAWeightShadows(t *testing.T) {
	cudaemu.Use(t)
	for _, c := range []struct {
		cfg *model.Config
		qad bool
	}{
		{tinyConfig(model.ArchQwen3, false), false},
		{tinyConfig(model.ArchQwen3, true), true},
		{tinyMoEConfig(false, 1), false},
		{tinyMoEConfig(false, 1), true},
	} {
		name := fmt.Sprintf("%s tied=%v qad=%v", c.cfg.Arch, c.cfg.TieEmbeddings, c.qad)
		t.Run(name, func(t *testing.T) {
			type result struct {
				losses []float64
				w      map[string][]float32
				conv   int // k_f32_to_bf16 calls of the last step
				fq     int // k_fakequant_nvfp4[_lanes] calls of the last step
			}
			train := func(perUse bool) result {
				be, err := cuda.Open(cuda.Options{KernelCache: t.TempDir(), PerUseCasts: perUse})
				if err != nil {
					t.Fatal(err)
				}
				defer be.Close()
				s, err := NewStudentOn(c.cfg, be)
				if err != nil {
					t.Fatal(err)
				}
				if err := s.Load(model.Init(c.cfg, model.InitOptions{Seed: 3})); err != nil {
					t.Fatal(err)
				}
				b := testBatch(4, c.cfg.VocabSize, 8)
				opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
				if c.qad {
					calibrateQAD(t, s, &opt, b)
				}
				ad, _ := optim.NewAdamW(optim.AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.01}, s.Groups())
				var r result
				const steps = 4
				for step := 0; step < steps; step++ {
					if step == steps-1 {
						be.SetProfile(true)
					}
					s.ZeroGrad()
					st, err := s.ForwardBackward(b, &opt, 0)
					if err != nil {
						t.Fatal(err)
					}
					// A second micro-batch's forward: the weights did not move.
					if _, err := s.Forward(b, &opt); err != nil {
						t.Fatal(err)
					}
					r.losses = append(r.losses, st.Loss)
					optim.ClipGradNorm(s.Groups(), 1)
					ad.Step(3e-3)
				}
				for _, e := range be.Profile() {
					switch {
					case strings.HasPrefix(e.Name, "k_f32_to_bf16"):
						r.conv += e.Calls
					case e.Name == "k_fakequant_nvfp4" || e.Name == "k_fakequant_nvfp4_lanes": // the kernel cols % 16 picks
						r.fq += e.Calls
					}
				}
				r.w = s.Weights()
				return r
			}
			sh, pu := train(false), train(true)
			for i := range sh.losses {
				if math.Float64bits(sh.losses[i]) != math.Float64bits(pu.losses[i]) {
					t.Fatalf("step %d: loss %.17g with shadows, %.17g rounding per use", i+1, sh.losses[i], pu.losses[i])
				}
			}
			for name, w := range pu.w {
				for j := range w {
					if math.Float32bits(w[j]) != math.Float32bits(sh.w[name][j]) {
						t.Fatalf("%s[%d] = %v with shadows, %v rounding per use", name, j, sh.w[name][j], w[j])
					}
				}
			}
			t.Logf("losses %v the same bits; last step: %d roundings (per use %d), %d fake quantizations (per use %d)",
				sh.losses, sh.conv, pu.conv, sh.fq, pu.fq)
			if sh.conv >= pu.conv {
				t.Errorf("the shadows saved no rounding: %d, per use %d", sh.conv, pu.conv)
			}
			if c.qad && sh.fq >= pu.fq {
				t.Errorf("under QAD the shadows saved no fake quantization: %d, per use %d", sh.fq, pu.fq)
			}
		})
	}
}
