package train

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"sort"
	"strings"
	"testing"

	"distill/compute"
	"distill/compute/device"
	"distill/model"
	"distill/train/internal/ref"
	"distill/train/loss"
	"distill/train/optim"
)

func tinyConfig(arch model.Arch, tied bool) *model.Config {
	c := &model.Config{Arch: arch, VocabSize: 97, Hidden: 32, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 8,
		Intermediate: 48, MaxPositions: 128, RMSNormEps: 1e-6, RopeTheta: 10000, TieEmbeddings: tied}
	switch arch {
	case model.ArchQwen2:
		c.AttentionBias = true
	case model.ArchQwen3:
		c.QKNorm = true
	}
	return c
}

// testBatch packs three samples (lengths 9, 1, 11) with a partial loss mask
// and a teacher top-k drawn from random full-vocabulary distributions.
// calibrateQAD turns s's NVFP4 QAD on and calibrates it on rows, as a
// run's first step does (a forward of each row, then FinishCalibration).
func calibrateQAD(t testing.TB, s *Student, opt *loss.Options, rows ...*Batch) {
	t.Helper()
	if err := s.EnableQAD(); err != nil {
		t.Fatal(err)
	}
	for _, b := range rows {
		if _, err := s.Forward(b, opt); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.FinishCalibration(); err != nil {
		t.Fatal(err)
	}
}

func testBatch(seed int64, V, K int) *Batch {
	rng := rand.New(rand.NewSource(seed))
	starts := []int32{0, 9, 10, 21}
	N := int(starts[3])
	b := &Batch{Tokens: make([]int32, N), Starts: starts, Mask: make([]uint8, N), K: K,
		TopIDs: make([]int32, N*K), TopLP: make([]float32, N*K)}
	for t := 0; t < N; t++ {
		b.Tokens[t] = int32(rng.Intn(V))
		if t%4 != 1 {
			b.Mask[t] = 1
		}
		lg := make([]float64, V)
		ord := make([]int, V)
		for v := range lg {
			lg[v] = rng.NormFloat64() * 2
			ord[v] = v
		}
		sort.Slice(ord, func(a, c int) bool { return lg[ord[a]] > lg[ord[c]] })
		var z float64
		for _, v := range lg {
			z += math.Exp(v - lg[ord[0]])
		}
		for j := 0; j < K; j++ {
			b.TopIDs[t*K+j] = int32(ord[j])
			b.TopLP[t*K+j] = float32(lg[ord[j]] - lg[ord[0]] - math.Log(z))
		}
	}
	return b
}

// tinyMoEConfig is a Qwen3-MoE of three layers: with sparseStep 1 layers 0
// and 2 are sparse (layer 1 is in mlp_only_layers), with sparseStep 2
// only layer 1 is. The load-balancing loss is on, with a large
// coefficient so that its gradient is visible.
func tinyMoEConfig(tied bool, sparseStep int) *model.Config {
	c := tinyConfig(model.ArchQwen3, tied)
	c.Arch, c.Layers = model.ArchQwen3MoE, 3
	c.NumExperts, c.ExpertsPerTok, c.MoEIntermediate, c.DecoderSparseStep = 4, 2, 16, sparseStep
	c.NormTopKProb = sparseStep == 1
	if sparseStep == 1 {
		c.MLPOnlyLayers = []int{1}
	}
	c.OutputRouterLogits, c.RouterAuxLossCoef = true, 0.3
	return c
}

func spec(c *model.Config) ref.ModelSpec {
	sp := ref.ModelSpec{V: c.VocabSize, C: c.Hidden, Layers: c.Layers, H: c.Heads, KV: c.KVHeads, D: c.HeadDim,
		I: c.Intermediate, Eps: float64(c.RMSNormEps), QKNorm: c.QKNorm, Tied: c.TieEmbeddings, InvFreq: c.InvFreq(),
		E: c.NumExperts, TopK: c.ExpertsPerTok, MoEI: c.MoEIntermediate, NormTopK: c.NormTopKProb}
	if c.OutputRouterLogits {
		sp.AuxCoef = c.RouterAuxLossCoef
	}
	return sp
}

// TestStudentGradients: the whole model's loss matches the float64
// reference model (package ref, written independently from the HF
// formulas) at 1e-5 relative, and every parameter tensor's gradient matches
// central finite differences of that reference (h = 1e-4 relative to the
// O(0.02..1) weights, 16 sampled elements per tensor plus the largest
// gradient) at |got-want| <= 2e-5 + 1e-2·|want| — fp32 through two layers.
func TestStudentGradients(t *testing.T) {
	cases := []struct {
		arch model.Arch
		tied bool
		opt  loss.Options
		cfg  *model.Config // nil: tinyConfig(arch, tied)
	}{
		{model.ArchQwen3MoE, false, loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.5}, tinyMoEConfig(false, 1)},
		{model.ArchQwen3MoE, true, loss.Options{KD: loss.FwdKL, Tail: loss.Renormalize, Temperature: 1, KDWeight: 1}, tinyMoEConfig(true, 2)},
		{model.ArchLlama, true, loss.Options{KD: loss.FwdKL, Tail: loss.Renormalize, Temperature: 1, KDWeight: 1, SFTWeight: 0.5}, nil},
		{model.ArchLlama, false, loss.Options{KD: loss.RevKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1}, nil},
		{model.ArchQwen2, false, loss.Options{KD: loss.JSD, Beta: 0.5, Tail: loss.Renormalize, Temperature: 2, ScaleT2: true, KDWeight: 1, SFTWeight: 0.2}, nil},
		{model.ArchQwen3, true, loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 1}, nil},
		{model.ArchQwen3, false, loss.Options{KD: loss.FwdKL, Tail: loss.Zero, Temperature: 1, KDWeight: 1}, nil},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%s/tied=%v/%s", c.arch, c.tied, c.opt.KD), func(t *testing.T) {
			cfg := c.cfg
			if cfg == nil {
				cfg = tinyConfig(c.arch, c.tied)
			}
			s, err := NewStudent(cfg)
			if err != nil {
				t.Fatal(err)
			}
			w := model.Init(cfg, model.InitOptions{Seed: 3, Std: 0.2, Perturb: true})
			if err := s.Load(w); err != nil {
				t.Fatal(err)
			}
			b := testBatch(4, cfg.VocabSize, 6)
			s.ZeroGrad()
			st, err := s.ForwardBackward(b, &c.opt, 0)
			if err != nil {
				t.Fatal(err)
			}
			p := map[string][]float64{}
			for name, v := range w {
				p[name] = ref.F64(v)
			}
			ro := ref.KDOpts{Kind: string(c.opt.KD), Beta: c.opt.Beta, Tail: string(c.opt.Tail), T: c.opt.Temperature, Tc: 1,
				ScaleT2: c.opt.ScaleT2, KDWeight: c.opt.KDWeight, SFTW: c.opt.SFTWeight}
			f := func() float64 {
				return ref.ModelLoss(spec(cfg), p, b.Tokens, b.Starts, b.Mask, b.K, b.TopIDs, b.TopLP, ro)
			}
			if want := f(); math.Abs(st.Loss-want) > 1e-5*math.Abs(want) {
				t.Fatalf("loss %.10g, reference %.10g", st.Loss, want)
			}
			ev, err := s.Forward(b, &c.opt)
			if err != nil || math.Abs(ev.Loss-st.Loss) > 1e-6*math.Abs(st.Loss) {
				t.Fatalf("Forward %v %v vs ForwardBackward %v", ev, err, st)
			}
			rng := rand.New(rand.NewSource(9))
			for _, ts := range s.Tensors {
				g := s.Grads[ts.Off : ts.Off+ts.N]
				idx := []int{0}
				for i := range g {
					if math.Abs(float64(g[i])) > math.Abs(float64(g[idx[0]])) {
						idx[0] = i
					}
				}
				for n := 0; n < 16; n++ {
					idx = append(idx, rng.Intn(ts.N))
				}
				fd := ref.Grad(f, p[ts.Name], idx, 1e-4)
				for n, i := range idx {
					if d := math.Abs(float64(g[i]) - fd[n]); d > 2e-5+1e-2*math.Abs(fd[n]) {
						t.Errorf("%s[%d]: grad %.6g, finite differences %.6g", ts.Name, i, g[i], fd[n])
					}
				}
			}
		})
	}
}

// TestStudentTrains: a few AdamW steps on one batch lower the loss, with
// and without NVFP4 QAD, and the QAD export reproduces the fake-quantized
// weights.
func TestStudentTrains(t *testing.T) {
	for _, qad := range []bool{false, true} {
		cfg := tinyConfig(model.ArchQwen3, false)
		s, _ := NewStudent(cfg)
		if err := s.Load(model.Init(cfg, model.InitOptions{Seed: 1})); err != nil {
			t.Fatal(err)
		}
		b := testBatch(2, cfg.VocabSize, 8)
		opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.1}
		if qad {
			if err := s.EnableQAD(); err != nil {
				t.Fatal(err)
			}
			if _, err := s.ForwardBackward(b, &opt, 0); err == nil {
				t.Fatal("ForwardBackward during calibration: want an error")
			}
			if _, err := s.Forward(b, &opt); err != nil {
				t.Fatal(err)
			}
			if err := s.FinishCalibration(); err != nil {
				t.Fatal(err)
			}
		}
		ad, _ := optim.NewAdamW(optim.AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, WeightDecay: 0.01}, s.Groups())
		var first, last float64
		for step := 0; step < 15; step++ {
			s.ZeroGrad()
			st, err := s.ForwardBackward(b, &opt, 0)
			if err != nil {
				t.Fatal(err)
			}
			if step == 0 {
				first = st.Loss
			}
			last = st.Loss
			optim.ClipGradNorm(s.Groups(), 1)
			ad.Step(3e-3)
		}
		if !(last < first*0.8) {
			t.Fatalf("qad=%v: loss %g -> %g after 15 steps, want a clear decrease", qad, first, last)
		}
		if qad {
			packed, in, err := s.ExportNVFP4()
			if err != nil {
				t.Fatal(err)
			}
			s.Model.QuantizeWeights()
			l := &s.Model.Blocks[1].MLP.Down
			d := packed[l.Name].Dequantize()
			wfq, err := s.host(l.Wfq)
			if err != nil {
				t.Fatal(err)
			}
			for i := range d {
				if d[i] != wfq[i] {
					t.Fatalf("%s[%d]: export %g, fake quant %g", l.Name, i, d[i], wfq[i])
				}
			}
			if in[l.Name] != s.Model.Blocks[1].InDown.Amax/2688 {
				t.Fatalf("input_scale %g", in[l.Name])
			}
		}
	}
}

func TestStudentErrors(t *testing.T) {
	cfg := tinyConfig(model.ArchLlama, false)
	s, _ := NewStudent(cfg)
	w := model.Init(cfg, model.InitOptions{Seed: 1})
	delete(w, "model.layers.1.mlp.up_proj.weight")
	if err := s.Load(w); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "model.layers.1.mlp.up_proj.weight") {
		t.Fatalf("missing tensor: %v", err)
	}
	w = model.Init(cfg, model.InitOptions{Seed: 1})
	w["model.norm.weight"] = w["model.norm.weight"][:5]
	if err := s.Load(w); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "model.norm.weight") {
		t.Fatalf("short tensor: %v", err)
	}
	w = model.Init(cfg, model.InitOptions{Seed: 1})
	w["model.layers.0.self_attn.q_proj.bias"] = make([]float32, 32)
	if err := s.Load(w); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "unexpected tensor model.layers.0.self_attn.q_proj.bias") {
		t.Fatalf("extra tensor: %v", err)
	}
	b := testBatch(1, cfg.VocabSize, 4)
	b.Tokens[3] = 500
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Renormalize, Temperature: 1, KDWeight: 1}
	if _, err := s.ForwardBackward(b, &opt, 0); !errors.Is(err, loss.ErrInvalid) || !strings.Contains(err.Error(), "token 3") {
		t.Fatalf("bad token: %v", err)
	}
	// MoE students train; NVFP4 needs their experts' width in 16-blocks.
	moe := tinyMoEConfig(false, 1)
	moe.MoEIntermediate = 24
	ms, err := NewStudent(moe)
	if err != nil {
		t.Fatal(err)
	}
	if err := ms.EnableQAD(); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "moe_intermediate_size (24)") {
		t.Fatalf("QAD of experts 24 wide: %v", err)
	}
}

// lacksMoE is a backend that says it cannot train MoE (compute.Partial):
// the mechanism a backend with a missing kernel uses to refuse a student
// before its first step.
type lacksMoE struct{ compute.Backend }

func (lacksMoE) Lacks(feature string) error {
	if feature == compute.FeatureMoETraining {
		return errors.New("no MoE training kernels on this test backend")
	}
	return nil
}

// TestStudentRefusesWhatTheBackendLacks: NewStudentOn asks the backend
// (compute.Lacks) and refuses a Qwen3-MoE student on one that lacks MoE
// training, naming it; dense students build there.
func TestStudentRefusesWhatTheBackendLacks(t *testing.T) {
	be := lacksMoE{device.CPU(1)}
	if _, err := NewStudentOn(tinyMoEConfig(false, 1), be); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "no MoE training kernels") {
		t.Fatalf("a MoE student on a backend that lacks MoE training: %v", err)
	}
	if _, err := NewStudentOn(tinyConfig(model.ArchQwen3, false), be); err != nil {
		t.Fatalf("a dense student on it: %v", err)
	}
}

// host is the host view of a tensor of a student on a host backend.
func (s *Student) host(t compute.Tensor) ([]float32, error) {
	h, ok := s.be.(compute.Host)
	if !ok {
		return nil, fmt.Errorf("backend %s is not host memory", s.be.Name())
	}
	return h.HostF32(t), nil
}
