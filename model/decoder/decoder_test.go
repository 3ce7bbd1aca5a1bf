package decoder

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"strings"
	"testing"

	"distill/compute"
	"distill/compute/device"
	"distill/model"
)

func tinyConfig(arch model.Arch) *model.Config {
	c := &model.Config{Arch: arch, VocabSize: 97, Hidden: 32, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 8,
		Intermediate: 48, MaxPositions: 128, RMSNormEps: 1e-6, RopeTheta: 10000}
	switch arch {
	case model.ArchQwen2:
		c.AttentionBias = true
	case model.ArchQwen3:
		c.QKNorm = true
	case model.ArchQwen3MoE:
		c.QKNorm, c.Layers = true, 3
		c.NumExperts, c.ExpertsPerTok, c.MoEIntermediate, c.DecoderSparseStep = 4, 2, 16, 1
		c.NormTopKProb, c.MLPOnlyLayers = true, []int{1}
	}
	return c
}

// build binds random weights (norms and biases perturbed) with gradients.
func build(t *testing.T, cfg *model.Config, be compute.Backend) *Model {
	w := model.Init(cfg, model.InitOptions{Seed: 5, Std: 0.2, Perturb: true})
	m, err := New(cfg, be, func(name string) (compute.Tensor, compute.Tensor, error) {
		v, ok := w[name]
		if !ok {
			return nil, nil, fmt.Errorf("no %s", name)
		}
		return be.FromF32(v), be.New(compute.F32, len(v)), nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestInferenceMatchesTraining: the teacher's forward (buffers reused and
// aliased layer to layer, streaming top-k) and the student's (one arena of
// saved activations, explicit logits) run the same blocks, so their top-k
// log-probs agree to fp32 rounding, and so do their ids.
func TestInferenceMatchesTraining(t *testing.T) {
	for _, arch := range []model.Arch{model.ArchLlama, model.ArchQwen2, model.ArchQwen3, model.ArchQwen3MoE} {
		t.Run(string(arch), func(t *testing.T) {
			cfg := tinyConfig(arch)
			be := device.CPU(3)
			m := build(t, cfg, be)
			samples := [][]int32{{1, 5, 9, 13, 2, 7, 7, 3, 0}, {4}, {96, 50, 20, 10, 11, 12, 13, 14, 15, 16, 17}}
			var tokens []int32
			starts := []int32{0}
			for _, s := range samples {
				tokens = append(tokens, s...)
				starts = append(starts, int32(len(tokens)))
			}
			const k = 5
			ids, lps := m.TopK(samples, k, 1)
			lnf, err := m.TrainForward(tokens, starts)
			if err != nil {
				t.Fatal(err)
			}
			N, V := len(tokens), cfg.VocabSize
			out := be.New(compute.F32, N*V)
			be.MatMul(out, lnf, m.Head.W, nil, N, V, cfg.Hidden)
			z := be.(compute.Host).HostF32(out)
			for i := 0; i < N; i++ {
				row := z[i*V : (i+1)*V]
				mx := math.Inf(-1)
				for _, v := range row {
					mx = math.Max(mx, float64(v))
				}
				var s float64
				for _, v := range row {
					s += math.Exp(float64(v) - mx)
				}
				lse := mx + math.Log(s)
				ord := make([]int, V)
				for j := range ord {
					ord[j] = j
				}
				sort.SliceStable(ord, func(a, b int) bool { return row[ord[a]] > row[ord[b]] })
				for j := 0; j < k; j++ {
					want := float64(row[ord[j]]) - lse
					if d := math.Abs(float64(lps[i*k+j]) - want); d > 1e-5 {
						t.Fatalf("token %d rank %d: top-k log-prob %g, training logits give %g", i, j, lps[i*k+j], want)
					}
					if g := int(ids[i*k+j]); g != ord[j] && math.Abs(float64(row[g]-row[ord[j]])) > 1e-5 {
						t.Fatalf("token %d rank %d: id %d, training logits rank %d first", i, j, g, ord[j])
					}
				}
			}
		})
	}
}

func TestTrainForwardErrors(t *testing.T) {
	m := build(t, tinyConfig(model.ArchLlama), device.CPU(1))
	if _, err := m.TrainForward([]int32{1, 2, 3}, []int32{0, 2}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("starts ending before the tokens: %v", err)
	}
	if _, err := m.TrainForward([]int32{1, 2, 3}, []int32{0, 2, 2, 3}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("empty sample: %v", err)
	}
	cfg := tinyConfig(model.ArchLlama)
	cfg.HeadDim = 7
	if _, err := New(cfg, device.CPU(1), nil); !errors.Is(err, ErrInvalid) {
		t.Fatalf("odd head_dim: %v", err)
	}
	_, err := New(tinyConfig(model.ArchQwen3), device.CPU(1), func(name string) (compute.Tensor, compute.Tensor, error) {
		return nil, nil, fmt.Errorf("missing %s", name)
	})
	if err == nil || !strings.Contains(err.Error(), "missing model.layers.1.self_attn.k_norm.weight") {
		t.Fatalf("binder errors are joined, naming every tensor: %v", err)
	}
}

func TestQuantizerCalibration(t *testing.T) {
	q := Quantizer{Calibrating: true}
	q.Observe(3)
	q.Observe(2.5)
	if err := q.Freeze("x"); err != nil || q.Amax != 3 {
		t.Fatalf("amax %g err %v, want 3", q.Amax, err)
	}
	q.Observe(100)
	if q.Amax != 3 {
		t.Fatalf("frozen amax moved to %g", q.Amax)
	}
	z := Quantizer{Calibrating: true}
	z.Observe(0)
	if err := z.Freeze("layers.0.mlp.down_proj input"); !errors.Is(err, ErrInvalid) {
		t.Fatalf("zero amax: %v", err)
	}
	n := Quantizer{Calibrating: true}
	n.Observe(2)
	n.Observe(float32(math.NaN()))
	if err := n.Freeze("layers.0.mlp.down_proj input"); !errors.Is(err, ErrInvalid) {
		t.Fatalf("NaN amax: %v", err)
	}
}
