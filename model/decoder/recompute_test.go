package decoder

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"distill/compute"
	"distill/compute/device"
	"distill/model"
)

// TestRecomputeSameGradients: the gradients of one training step (the
// forward's output, every parameter's gradient, the MoE routing
// statistics) are the same bits under every recompute mode, on every
// architecture, with and without NVFP4 QAD: a recompute runs the same
// kernels on the same inputs as the forward. And each mode's arena is
// no larger than the one before it (full: smaller), its size what
// TrainActivationBytes says.
func TestRecomputeSameGradients(t *testing.T) {
	for _, arch := range []model.Arch{model.ArchLlama, model.ArchQwen2, model.ArchQwen3, model.ArchQwen3MoE} {
		for _, qad := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/qad=%v", arch, qad), func(t *testing.T) {
				cfg := tinyConfig(arch)
				if arch == model.ArchQwen3MoE {
					cfg.OutputRouterLogits, cfg.RouterAuxLossCoef = true, 0.01
				}
				tokens := []int32{1, 5, 9, 13, 2, 7, 7, 3, 0, 4, 96, 50, 20, 10, 11, 12, 13, 14, 15, 16, 17}
				starts := []int32{0, 9, 10, int32(len(tokens))}
				var want [][]float32
				var wantRouting RouterStats
				prev := int64(math.MaxInt64)
				for _, mode := range RecomputeModes {
					be := device.CPU(3)
					w := model.Init(cfg, model.InitOptions{Seed: 5, Std: 0.2, Perturb: true})
					var grads []compute.Tensor
					m, err := New(cfg, be, func(name string) (compute.Tensor, compute.Tensor, error) {
						g := be.New(compute.F32, len(w[name]))
						grads = append(grads, g)
						return be.FromF32(w[name]), g, nil
					})
					if err != nil {
						t.Fatal(err)
					}
					if err := m.SetRecompute(mode); err != nil {
						t.Fatal(err)
					}
					if qad {
						if err := m.EnableQAD(); err != nil {
							t.Fatal(err)
						}
						if _, err := m.TrainForward(tokens, starts); err != nil {
							t.Fatal(err)
						}
						if err := m.FinishCalibration(); err != nil {
							t.Fatal(err)
						}
					}
					lnf, err := m.TrainForward(tokens, starts)
					if err != nil {
						t.Fatal(err)
					}
					h := be.(compute.Host)
					got := [][]float32{append([]float32(nil), h.HostF32(lnf)[:len(tokens)*cfg.Hidden]...)}
					rs := m.Routing()
					r := rand.New(rand.NewPCG(7, 8))
					dl := make([]float32, len(tokens)*cfg.Hidden)
					for i := range dl {
						dl[i] = float32(r.NormFloat64())
					}
					be.WriteF32(be.View(m.HiddenGrad(), 0, len(dl)), dl)
					m.SetRouterAux(cfg.RouterAuxLossCoef)
					m.Backward()
					for _, g := range grads {
						got = append(got, append([]float32(nil), h.HostF32(g)...))
					}
					bytes := TrainActivationBytes(cfg, len(tokens), mode, qad, be.ActDType())
					if f := m.arenaBytes(); f != bytes {
						t.Errorf("%s: the arena holds %d bytes, TrainActivationBytes says %d", mode, f, bytes)
					}
					// Selective saves nothing where one dense layer (the MoE
					// model's) has its buffers to itself; full always does.
					if bytes > prev || mode == RecomputeFull && bytes == prev {
						t.Errorf("%s: the arena is %d bytes, the previous mode's %d: want less", mode, bytes, prev)
					}
					prev = bytes
					if want == nil {
						want, wantRouting = got, rs
						continue
					}
					for i := range want {
						for j := range want[i] {
							if math.Float32bits(want[i][j]) != math.Float32bits(got[i][j]) {
								t.Fatalf("%s: tensor %d element %d is %g, %g without recompute: want the same bits", mode, i, j, got[i][j], want[i][j])
							}
						}
					}
					if fmt.Sprint(rs) != fmt.Sprint(wantRouting) {
						t.Errorf("%s: routing %v, without recompute %v", mode, rs, wantRouting)
					}
				}
			})
		}
	}
}

// TestParseRecompute: the modes' names, "" as none, and an error naming
// the choices.
func TestParseRecompute(t *testing.T) {
	for _, s := range []string{"", "none", "selective", "full"} {
		if _, err := ParseRecompute(s); err != nil {
			t.Errorf("%q: %v", s, err)
		}
	}
	if _, err := ParseRecompute("auto"); err == nil {
		t.Error("auto is the trainer's choice, not a decoder mode")
	}
}
