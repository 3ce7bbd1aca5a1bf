package train

import (
	"errors"
	"math"
	"math/rand"
	"slices"
	"strings"
	"testing"

	"distill/model"
	"distill/model/decoder"
	"distill/train/loss"
)

// TestLoRADropout: a LoRA student with lora_dropout 0.3 on every module.
//   - Forward (an evaluation) drops nothing: its loss is the same
//     student's without dropout, bit for bit;
//   - ForwardBackward drops: its loss differs from the undropped one, and
//     between two rows of a step, and is the same again for the same
//     (step, row);
//   - the adapters' gradients are central finite differences of
//     ForwardBackward's own loss under the same (step, row) (the mask
//     fixed), which fails if the backward drew other masks than the
//     forward;
//   - the recompute modes give the same gradients bit for bit (a
//     recompute draws the forward's masks);
//   - a ForwardBackward without SetStepRow is refused.
//
// On a Qwen3-MoE student too, every layer sparse and only the experts
// adapted (gate/up/down_proj), so that every drop is the MoE kernels'
// (keyed by MoEWeights.Drop).
func TestLoRADropout(t *testing.T) {
	t.Run("qwen3", func(t *testing.T) { loraDropout(t, tinyConfig(model.ArchQwen3, false), allTargets) })
	moe := tinyMoEConfig(false, 1)
	moe.MLPOnlyLayers = nil
	t.Run("qwen3_moe", func(t *testing.T) { loraDropout(t, moe, []string{"gate_proj", "up_proj", "down_proj"}) })
}

func loraDropout(t *testing.T, cfg *model.Config, targets []string) {
	w := model.Init(cfg, model.InitOptions{Seed: 3, Std: 0.2, Perturb: true})
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.5}
	b := testBatch(4, cfg.VocabSize, 6)
	rng := rand.New(rand.NewSource(7))
	var ad map[string][]float32 // the adapters, B non-zero
	mk := func(p float64) *Student {
		s := newLoRA(t, cfg, w, LoRAConfig{Rank: 4, Alpha: 8, Targets: targets, Seed: 5, Dropout: p})
		if ad == nil { // in the tensors' order: the draws do not depend on a map's
			ad = map[string][]float32{}
			sw := s.Weights()
			for _, ts := range s.Tensors {
				name, v := ts.Name, slices.Clone(sw[ts.Name])
				if strings.HasSuffix(name, "lora_B.weight") {
					for i := range v {
						v[i] = float32(rng.NormFloat64() * 0.3)
					}
				}
				ad[name] = v
			}
		}
		if err := s.Load(ad); err != nil {
			t.Fatal(err)
		}
		return s
	}
	plain, s := mk(0), mk(0.3)
	defer plain.Free()
	defer s.Free()

	ev0, err := plain.Forward(b, &opt)
	if err != nil {
		t.Fatal(err)
	}
	lossAt := func(step, row int) float64 {
		t.Helper()
		s.SetStepRow(step, row)
		s.ZeroGrad()
		st, err := s.ForwardBackward(b, &opt, 0)
		if err != nil {
			t.Fatal(err)
		}
		return st.Loss
	}
	l31 := lossAt(3, 1)
	if ev, err := s.Forward(b, &opt); err != nil || ev.Loss != ev0.Loss {
		t.Fatalf("Forward with dropout 0.3: loss %.10g (%v), without dropout %.10g: an evaluation must not drop", ev.Loss, err, ev0.Loss)
	}
	plain.SetStepRow(3, 1)
	tr0, err := plain.ForwardBackward(b, &opt, 0)
	if err != nil {
		t.Fatal(err)
	}
	if l32 := lossAt(3, 2); l31 == tr0.Loss || l32 == l31 || lossAt(3, 1) != l31 {
		t.Fatalf("training losses: row (3,1) %.10g, (3,2) %.10g, no dropout %.10g: want dropout to change the loss, and the masks to depend on the row only", l31, l32, tr0.Loss)
	}

	// Gradients against finite differences of the loss at (3, 1).
	lossAt(3, 1)
	g := slices.Clone(s.Grads)
	// An MoE student's top-k routing is piecewise constant in the
	// adapters: a smaller step crosses fewer of its switches.
	h := float32(1e-2)
	if cfg.NumExperts > 0 {
		h = 2e-3
	}
	for _, ts := range s.Tensors {
		idx := []int{0}
		for i := ts.Off; i < ts.Off+ts.N; i++ {
			if math.Abs(float64(g[i])) > math.Abs(float64(g[ts.Off+idx[0]])) {
				idx[0] = i - ts.Off
			}
		}
		for n := 0; n < 4; n++ {
			idx = append(idx, rng.Intn(ts.N))
		}
		for _, i := range idx {
			p := &s.Params[ts.Off+i]
			v := *p
			// Richardson's extrapolation of central differences at h and
			// h/2: the h² term cancels, which at this h is a few percent.
			cd := func(h float32) float64 {
				*p = v + h
				up := lossAt(3, 1)
				*p = v - h
				dn := lossAt(3, 1)
				*p = v
				return (up - dn) / float64(2*h)
			}
			fd := (4*cd(h/2) - cd(h)) / 3
			if d := math.Abs(float64(g[ts.Off+i]) - fd); d > 2e-4+2e-2*math.Abs(fd) {
				t.Errorf("%s[%d]: grad %.6g, finite differences %.6g", ts.Name, i, g[ts.Off+i], fd)
			}
		}
	}

	// The recompute modes.
	for _, r := range []decoder.Recompute{decoder.RecomputeSelective, decoder.RecomputeFull} {
		if err := s.Model.SetRecompute(r); err != nil {
			t.Fatal(err)
		}
		if l := lossAt(3, 1); l != l31 || !slices.Equal(s.Grads, g) {
			t.Fatalf("recompute %s: loss %.10g (none: %.10g) or gradients differ", r, l, l31)
		}
	}

	s.ZeroGrad()
	if _, err := s.ForwardBackward(b, &opt, 0); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "SetStepRow") {
		t.Fatalf("ForwardBackward without SetStepRow: %v", err)
	}
}
