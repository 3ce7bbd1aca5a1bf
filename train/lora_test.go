package train

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
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

var allTargets = []string{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

// mapSource serves a base from a map of tensors.
func mapSource(w map[string][]float32) BaseSource {
	return func(name string) ([]float32, error) {
		v, ok := w[name]
		if !ok {
			return nil, fmt.Errorf("no tensor %s", name)
		}
		return slices.Clone(v), nil
	}
}

func newLoRA(t *testing.T, cfg *model.Config, w map[string][]float32, lc LoRAConfig) *Student {
	t.Helper()
	if lc.Init == "" {
		lc.Init = "kaiming"
	}
	s, err := NewLoRAStudentOn(cfg, cpuBackend(), mapSource(w), lc)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// merged64 is the float64 base with the adapters merged: W + s·B·A.
func merged64(s *Student, base map[string][]float32, ad map[string][]float64) map[string][]float64 {
	p := map[string][]float64{}
	for name, v := range base {
		p[name] = ref.F64(v)
	}
	sc := float64(s.lora.cfg.Scale())
	for lin, ab := range s.lora.adapterOf {
		ta, tb := s.Tensors[ab[0]], s.Tensors[ab[1]]
		A, B := ad[ta.Name], ad[tb.Name]
		r, in, out := ta.Shape[0], ta.Shape[1], tb.Shape[0]
		W := p[lin+".weight"]
		for o := 0; o < out; o++ {
			for i := 0; i < in; i++ {
				var d float64
				for k := 0; k < r; k++ {
					d += B[o*r+k] * A[k*in+i]
				}
				W[o*in+i] += sc * d
			}
		}
	}
	return p
}

// TestLoRAGradients: a LoRA student's loss is the float64 reference
// model's with the adapters merged into its weights (W + (alpha/r)·B·A,
// package ref, independent of the decoder), and the adapters' gradients
// are central finite differences of that reference w.r.t. A and B; with
// every module targeted, biases (Qwen2), q/k norms (Qwen3) and a tied
// head, the frozen base gets no gradient. A Qwen3-MoE student (a dense
// layer among MoE ones, the router's load-balancing loss on) takes
// adapters on its attention, its frozen MoE blocks passing the gradient
// through to the layers below (MoEBackward with no weight gradients),
// and on every expert's gate/up/down_proj (and the dense layer's MLP).
func TestLoRAGradients(t *testing.T) {
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 0.5}
	attn := []string{"q_proj", "k_proj", "v_proj", "o_proj"}
	for _, c := range []struct {
		arch    model.Arch
		tied    bool
		targets []string
	}{
		{model.ArchLlama, true, allTargets},
		{model.ArchQwen2, false, []string{"q_proj", "v_proj"}},
		{model.ArchQwen3, false, allTargets},
		{model.ArchQwen3MoE, false, attn},
		{model.ArchQwen3MoE, false, allTargets},
	} {
		t.Run(fmt.Sprintf("%s/tied=%v/%d", c.arch, c.tied, len(c.targets)), func(t *testing.T) {
			cfg := tinyConfig(c.arch, c.tied)
			if c.arch == model.ArchQwen3MoE {
				cfg = tinyMoEConfig(c.tied, 1)
			}
			w := model.Init(cfg, model.InitOptions{Seed: 3, Std: 0.2, Perturb: true})
			s := newLoRA(t, cfg, w, LoRAConfig{Rank: 4, Alpha: 8, Targets: c.targets, Seed: 5})
			defer s.Free()
			// B is zero at the start: give it values, as training does.
			rng := rand.New(rand.NewSource(7))
			ad := map[string][]float32{}
			ws := s.Weights()
			for _, name := range slices.Sorted(maps.Keys(ws)) { // the draws in a fixed order: the same values every run
				v := slices.Clone(ws[name])
				if strings.HasSuffix(name, "lora_B.weight") {
					for i := range v {
						v[i] = float32(rng.NormFloat64() * 0.2)
					}
				}
				ad[name] = v
			}
			if err := s.Load(ad); err != nil {
				t.Fatal(err)
			}
			b := testBatch(4, cfg.VocabSize, 6)
			s.ZeroGrad()
			st, err := s.ForwardBackward(b, &opt, 0)
			if err != nil {
				t.Fatal(err)
			}
			a64 := map[string][]float64{}
			for name, v := range ad {
				a64[name] = ref.F64(v)
			}
			ro := ref.KDOpts{Kind: string(opt.KD), Tail: string(opt.Tail), T: 1, Tc: 1, KDWeight: 1, SFTW: 0.5}
			f := func() float64 {
				return ref.ModelLoss(spec(cfg), merged64(s, w, a64), b.Tokens, b.Starts, b.Mask, b.K, b.TopIDs, b.TopLP, ro)
			}
			if want := f(); math.Abs(st.Loss-want) > 1e-5*math.Abs(want) {
				t.Fatalf("loss %.10g, reference %.10g", st.Loss, want)
			}
			for _, ts := range s.Tensors {
				g := s.Grads[ts.Off : ts.Off+ts.N]
				idx := []int{0}
				for i := range g {
					if math.Abs(float64(g[i])) > math.Abs(float64(g[idx[0]])) {
						idx[0] = i
					}
				}
				for n := 0; n < 12; n++ {
					idx = append(idx, rng.Intn(ts.N))
				}
				fd := ref.Grad(f, a64[ts.Name], idx, 1e-4)
				for n, i := range idx {
					if d := math.Abs(float64(g[i]) - fd[n]); d > 2e-5+1e-2*math.Abs(fd[n]) {
						t.Errorf("%s[%d]: grad %.6g, finite differences %.6g", ts.Name, i, g[i], fd[n])
					}
				}
			}
		})
	}
}

// TestLoRAStartsAtBase: with B zero a LoRA student computes what the full
// student of the same weights computes, bit for bit (each adapter adds
// exact zeros), A is drawn as PEFT draws it (Kaiming-uniform bound
// 1/sqrt(in); gaussian sd 1/r), and AdamW steps on the adapters lower the
// loss while the base stays as loaded.
func TestLoRAStartsAtBase(t *testing.T) {
	cfg := tinyConfig(model.ArchQwen3, false)
	w := model.Init(cfg, model.InitOptions{Seed: 3, Std: 0.1, Perturb: true})
	full, err := NewStudent(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := full.Load(w); err != nil {
		t.Fatal(err)
	}
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 1}
	b := testBatch(5, cfg.VocabSize, 4)
	want, err := full.Forward(b, &opt)
	if err != nil {
		t.Fatal(err)
	}
	for _, init := range []string{"kaiming", "gaussian"} {
		s := newLoRA(t, cfg, w, LoRAConfig{Rank: 8, Alpha: 16, Targets: allTargets, Init: init, Seed: 1})
		got, err := s.Forward(b, &opt)
		if err != nil {
			t.Fatal(err)
		}
		if got.Loss != want.Loss {
			t.Fatalf("%s: fresh LoRA loss %.10g, the full student's %.10g: want them bit for bit", init, got.Loss, want.Loss)
		}
		for _, ts := range s.Tensors {
			v := s.Params[ts.Off : ts.Off+ts.N]
			var mx, ss float64
			for _, x := range v {
				mx, ss = max(mx, math.Abs(float64(x))), ss+float64(x)*float64(x)
			}
			switch {
			case strings.HasSuffix(ts.Name, "lora_B.weight") && mx != 0:
				t.Fatalf("%s: max |B| %g, want zeros", ts.Name, mx)
			case strings.HasSuffix(ts.Name, "lora_A.weight") && init == "kaiming":
				bound := 1 / math.Sqrt(float64(ts.Shape[1]))
				if mx > bound || mx < 0.8*bound {
					t.Fatalf("%s: max |A| %g, want U(-%g, %g) filled", ts.Name, mx, bound, bound)
				}
			case strings.HasSuffix(ts.Name, "lora_A.weight"):
				sd := math.Sqrt(ss / float64(len(v)))
				if math.Abs(sd-1.0/8) > 0.2/8 {
					t.Fatalf("%s: sd %g, want 1/r = %g", ts.Name, sd, 1.0/8)
				}
			}
		}
		s.Free()
	}
	s := newLoRA(t, cfg, w, LoRAConfig{Rank: 8, Alpha: 16, Targets: allTargets, Seed: 1})
	defer s.Free()
	ad := newTestAdamW(t, s, 1e-2)
	first := 0.0
	for i := 0; i < 8; i++ {
		s.ZeroGrad()
		st, err := s.ForwardBackward(b, &opt, 0)
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = st.Loss
		}
		ad.Step(1e-2)
	}
	last, _ := s.Forward(b, &opt)
	if !(last.Loss < first-0.05) {
		t.Fatalf("8 AdamW steps on the adapters: loss %g -> %g, want it lower", first, last.Loss)
	}
	for name, v := range s.baseWeights() {
		if !slices.Equal(v, w[name]) {
			t.Fatalf("base tensor %s moved", name)
		}
	}
}

// TestLoRAMergedExport: the merged weights are the base plus the scaled
// product bit for bit in fp32 (recomputed here: W + float32(alpha/r) ·
// float32(Σ_k B·A in float64)), the merged model computes what the LoRA
// student computes (a full student loaded with them), and the BF16 export
// holds the merged weights rounded. On a Qwen3-MoE student every
// expert's adapted projection merges as a dense Linear does (W_e +
// (alpha/r)·B_e·A_e), the dense layer's MLP too.
func TestLoRAMergedExport(t *testing.T) {
	t.Run("llama", func(t *testing.T) {
		loraMergedExport(t, tinyConfig(model.ArchLlama, false), []string{"q_proj", "o_proj", "down_proj"}, "model.layers.1.self_attn.q_proj.weight")
	})
	t.Run("qwen3_moe", func(t *testing.T) {
		loraMergedExport(t, tinyMoEConfig(false, 1), []string{"q_proj", "gate_proj", "down_proj"}, "model.layers.2.mlp.experts.3.down_proj.weight")
	})
}

func loraMergedExport(t *testing.T, cfg *model.Config, targets []string, probe string) {
	w := model.Init(cfg, model.InitOptions{Seed: 9, Std: 0.1, Perturb: true})
	s := newLoRA(t, cfg, w, LoRAConfig{Rank: 4, Alpha: 12, Targets: targets, Seed: 2})
	defer s.Free()
	if _, ok := s.Weights()[strings.TrimSuffix(probe, ".weight")+".lora_A.weight"]; !ok {
		t.Fatalf("no adapter on %s", probe)
	}
	rng := rand.New(rand.NewSource(3))
	ad := map[string][]float32{}
	ws := s.Weights()
	for _, name := range slices.Sorted(maps.Keys(ws)) { // the draws in a fixed order
		v := slices.Clone(ws[name])
		for i := range v {
			v[i] = float32(rng.NormFloat64() * 0.3)
		}
		ad[name] = v
	}
	if err := s.Load(ad); err != nil {
		t.Fatal(err)
	}
	got := s.MergedWeights()
	sc := float32(12.0 / 4)
	for name, base := range w {
		lin := strings.TrimSuffix(name, ".weight")
		A, B := ad[lin+".lora_A.weight"], ad[lin+".lora_B.weight"]
		want := slices.Clone(base)
		if A != nil {
			in, out := len(A)/4, len(B)/4 // rank 4
			for o := 0; o < out; o++ {
				for i := 0; i < in; i++ {
					var d float64
					for k := 0; k < 4; k++ {
						d += float64(B[o*4+k]) * float64(A[k*in+i])
					}
					want[o*in+i] = base[o*in+i] + sc*float32(d)
				}
			}
		}
		for i := range want {
			if math.Float32bits(got[name][i]) != math.Float32bits(want[i]) {
				t.Fatalf("%s[%d]: merged %v, want %v bit for bit", name, i, got[name][i], want[i])
			}
		}
	}
	full, err := NewStudent(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := full.Load(got); err != nil {
		t.Fatal(err)
	}
	opt := loss.Options{KD: loss.FwdKL, Tail: loss.Bucket, Temperature: 1, KDWeight: 1, SFTWeight: 1}
	b := testBatch(6, cfg.VocabSize, 4)
	a, _ := s.Forward(b, &opt)
	m, _ := full.Forward(b, &opt)
	if math.Abs(a.Loss-m.Loss) > 1e-5*math.Abs(a.Loss) {
		t.Fatalf("LoRA student loss %.8g, merged model %.8g", a.Loss, m.Loss)
	}
	dir := t.TempDir()
	if err := s.WriteHF(dir, "BF16"); err != nil {
		t.Fatal(err)
	}
	ow, err := model.OpenWeights(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ow.Close()
	v, err := ow.F32(probe)
	if err != nil {
		t.Fatal(err)
	}
	for i, x := range got[probe] {
		if v[i] != compute.BF16ToF32(compute.F32ToBF16(x)) {
			t.Fatalf("bf16 export [%d] = %v, want the merged %v rounded", i, v[i], x)
		}
	}
}

// TestLoRAPEFTFormat reads the adapter files back as PEFT documents them
// (PEFT's checkpoint format: adapter_config.json with peft_type LORA, r,
// lora_alpha, target_modules, ...; adapter_model.safetensors keyed
// base_model.model.<module>.lora_A.weight of shape (r, in_features) and
// lora_B.weight of shape (out_features, r)), parsing the safetensors
// header by hand, and loads them into a fresh student.
func TestLoRAPEFTFormat(t *testing.T) {
	cfg := tinyConfig(model.ArchQwen3, false)
	w := model.Init(cfg, model.InitOptions{Seed: 9, Std: 0.1})
	s := newLoRA(t, cfg, w, LoRAConfig{Rank: 4, Alpha: 16, Targets: []string{"q_proj", "v_proj", "down_proj"}, Seed: 2})
	defer s.Free()
	dir := t.TempDir()
	if err := s.WritePEFT(dir, "Qwen/Qwen3-0.6B"); err != nil {
		t.Fatal(err)
	}
	var c map[string]any
	b, err := os.ReadFile(filepath.Join(dir, "adapter_config.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &c); err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]any{"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4.0, "lora_alpha": 16.0, "lora_dropout": 0.0,
		"bias": "none", "fan_in_fan_out": false, "base_model_name_or_path": "Qwen/Qwen3-0.6B", "use_rslora": false, "use_dora": false} {
		if fmt.Sprint(c[k]) != fmt.Sprint(want) {
			t.Errorf("adapter_config.json %s = %v, want %v", k, c[k], want)
		}
	}
	if fmt.Sprint(c["target_modules"]) != "[q_proj v_proj down_proj]" {
		t.Errorf("target_modules %v", c["target_modules"])
	}
	raw, err := os.ReadFile(filepath.Join(dir, "adapter_model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	n := binary.LittleEndian.Uint64(raw)
	var hdr map[string]json.RawMessage
	if err := json.Unmarshal(raw[8:8+n], &hdr); err != nil {
		t.Fatal(err)
	}
	var names []string
	for k, v := range hdr {
		if k == "__metadata__" {
			continue
		}
		var ti struct {
			DType string `json:"dtype"`
			Shape []int  `json:"shape"`
		}
		json.Unmarshal(v, &ti)
		names = append(names, fmt.Sprintf("%s %s %v", k, ti.DType, ti.Shape))
	}
	sort.Strings(names)
	var want []string
	for l := 0; l < cfg.Layers; l++ {
		p := fmt.Sprintf("base_model.model.model.layers.%d.", l)
		q, kv := cfg.Heads*cfg.HeadDim, cfg.KVHeads*cfg.HeadDim
		want = append(want,
			fmt.Sprintf("%smlp.down_proj.lora_A.weight F32 [4 %d]", p, cfg.Intermediate),
			fmt.Sprintf("%smlp.down_proj.lora_B.weight F32 [%d 4]", p, cfg.Hidden),
			fmt.Sprintf("%sself_attn.q_proj.lora_A.weight F32 [4 %d]", p, cfg.Hidden),
			fmt.Sprintf("%sself_attn.q_proj.lora_B.weight F32 [%d 4]", p, q),
			fmt.Sprintf("%sself_attn.v_proj.lora_A.weight F32 [4 %d]", p, cfg.Hidden),
			fmt.Sprintf("%sself_attn.v_proj.lora_B.weight F32 [%d 4]", p, kv))
	}
	sort.Strings(want)
	if !slices.Equal(names, want) {
		t.Fatalf("adapter_model.safetensors holds\n%s\nwant\n%s", strings.Join(names, "\n"), strings.Join(want, "\n"))
	}
	// Round trip, and a mismatch named.
	s2 := newLoRA(t, cfg, w, LoRAConfig{Rank: 4, Alpha: 16, Targets: []string{"q_proj", "v_proj", "down_proj"}, Seed: 99})
	defer s2.Free()
	if err := s2.LoadAdapters(dir); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(s2.Params, s.Params) {
		t.Fatal("adapters read back differ")
	}
	s3 := newLoRA(t, cfg, w, LoRAConfig{Rank: 8, Alpha: 16, Targets: []string{"q_proj", "v_proj", "down_proj"}})
	defer s3.Free()
	if err := s3.LoadAdapters(dir); err == nil || !strings.Contains(err.Error(), "rank 8") {
		t.Fatalf("rank 8 reading rank 4 adapters: %v", err)
	}
}

// TestLoRAErrors: each bad configuration is refused, naming what is wrong.
func TestLoRAErrors(t *testing.T) {
	cfg := tinyConfig(model.ArchLlama, false)
	for _, c := range []struct {
		lc   LoRAConfig
		cfg  *model.Config
		want string
	}{
		{LoRAConfig{Rank: 0, Alpha: 16, Targets: allTargets, Init: "kaiming"}, cfg, "rank 0"},
		{LoRAConfig{Rank: 8, Alpha: 0, Targets: allTargets, Init: "kaiming"}, cfg, "alpha"},
		{LoRAConfig{Rank: 8, Alpha: 16, Targets: []string{"q_proj", "qkv_proj"}, Init: "kaiming"}, cfg, `"qkv_proj" is not a module`},
		{LoRAConfig{Rank: 8, Alpha: 16, Targets: []string{"q_proj"}, Init: "orthogonal"}, cfg, "init"},
		{LoRAConfig{Rank: 8, Alpha: 16, Targets: []string{"q_proj"}, Init: "kaiming", Dropout: 1}, cfg, "dropout"},
	} {
		_, err := NewLoRAStudentOn(c.cfg, cpuBackend(), mapSource(model.Init(c.cfg, model.InitOptions{Seed: 1})), c.lc)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error naming %q", c.lc, err, c.want)
		}
	}
	if err := (&LoRAConfig{Rank: 8, Alpha: 16, Targets: []string{"gate"}, Init: "kaiming"}).Check(cfg); err == nil || !strings.Contains(err.Error(), "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj") {
		t.Errorf("unknown target: %v, want the modules listed", err)
	}
}

// TestLoRANVFP4Base: under NVFP4 the base's block Linears are held
// fake-quantized (a fused group's amax the max of its members'), the
// rest as loaded, and the hash is of the weights as read.
func TestLoRANVFP4Base(t *testing.T) {
	cfg := tinyConfig(model.ArchLlama, false)
	w := model.Init(cfg, model.InitOptions{Seed: 4, Std: 0.1})
	s := newLoRA(t, cfg, w, LoRAConfig{Rank: 4, Alpha: 8, Targets: []string{"q_proj"}, NVFP4: true})
	defer s.Free()
	plain := newLoRA(t, cfg, w, LoRAConfig{Rank: 4, Alpha: 8, Targets: []string{"q_proj"}})
	defer plain.Free()
	if s.BaseHash() != plain.BaseHash() || len(s.BaseHash()) != 64 {
		t.Fatalf("hashes %s, %s: want the same content hash", s.BaseHash(), plain.BaseHash())
	}
	bw := s.baseWeights()
	amax := func(names ...string) float32 {
		var a float32
		for _, n := range names {
			for _, x := range w[n] {
				a = max(a, float32(math.Abs(float64(x))))
			}
		}
		return a
	}
	p := "model.layers.0."
	qkv := []string{p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"}
	g := compute.NVFP4GlobalScale(amax(qkv...))
	k := w[p+"self_attn.k_proj.weight"]
	want := make([]float32, 16)
	compute.NVFP4FakeQuantBlock(want, k[:16], g)
	if !slices.Equal(bw[p+"self_attn.k_proj.weight"][:16], want) {
		t.Fatalf("k_proj's first block %v, want %v", bw[p+"self_attn.k_proj.weight"][:16], want)
	}
	if !slices.Equal(bw["model.embed_tokens.weight"], w["model.embed_tokens.weight"]) {
		t.Fatal("the embeddings were quantized")
	}
}

func cpuBackend() compute.Backend { return device.CPU(1) }

func newTestAdamW(t *testing.T, s *Student, lr float64) *optim.AdamW {
	t.Helper()
	ad, err := optim.NewAdamW(optim.AdamWConfig{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8}, s.Groups())
	if err != nil {
		t.Fatal(err)
	}
	return ad
}
