package model

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestSafetensorsRoundTripAndDTypes(t *testing.T) {
	dir := t.TempDir()
	v := []float32{1, -2.5, 3.140625, 1e-3, 65504, float32(math.Copysign(0, -1))} // Go constants have no -0
	f16 := make([]byte, 2*len(v))                                                 // IEEE half encodings of v, by hand
	for i, h := range []uint16{0x3c00, 0xc100, 0x4248, 0x1419, 0x7bff, 0x8000} {
		binary.LittleEndian.PutUint16(f16[2*i:], h)
	}
	ts := []Tensor{F32Tensor("a", []int{2, 3}, v), BF16Tensor("b", []int{6}, v), {Name: "c", DType: "F16", Shape: []int{3, 2}, Data: f16}}
	if err := WriteSafetensors(filepath.Join(dir, "model.safetensors"), ts, map[string]string{"format": "pt"}); err != nil {
		t.Fatal(err)
	}
	w, err := OpenWeights(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	a, _ := w.F32("a")
	for i := range v {
		if a[i] != v[i] {
			t.Fatalf("F32 a[%d] = %v, want %v", i, a[i], v[i])
		}
	}
	b, _ := w.F32("b")                                                           // BF16 of these values: exact except 1e-3 and 65504
	for i, want := range []float32{1, -2.5, 3.140625, 0.00099945068, 65536, 0} { // 1e-3 = 0x3A83126F rounds down to 0x3A83
		if b[i] != want {
			t.Fatalf("BF16 b[%d] = %v, want %v", i, b[i], want)
		}
	}
	c, _ := w.F32("c")
	for i, want := range []float32{1, -2.5, 3.140625, 0.0010004044, 65504, 0} {
		if c[i] != want || math.Signbit(float64(c[i])) != math.Signbit(float64(v[i])) {
			t.Fatalf("F16 c[%d] = %v, want %v", i, c[i], want)
		}
	}
	if info, _ := w.Info("c"); info.DType != "F16" || len(info.Shape) != 2 || info.Shape[0] != 3 {
		t.Fatalf("info %+v", info)
	}
}

// TestShardedCheckpoint splits a checkpoint over two files with an index
// and checks it loads the same tensors, and that index inconsistencies are
// errors naming the tensor.
func TestShardedCheckpoint(t *testing.T) {
	cfg, _ := Preset(ArchQwen3)
	vals := Init(cfg, InitOptions{Seed: 3, Perturb: true})
	dir := t.TempDir()
	specs := cfg.Tensors()
	wm := map[string]string{}
	var s1, s2 []Tensor
	for i, s := range specs {
		tn := BF16Tensor(s.Name, s.Shape, vals[s.Name])
		if i%2 == 0 {
			s1, wm[s.Name] = append(s1, tn), "model-00001-of-00002.safetensors"
		} else {
			s2, wm[s.Name] = append(s2, tn), "model-00002-of-00002.safetensors"
		}
	}
	WriteSafetensors(filepath.Join(dir, "model-00001-of-00002.safetensors"), s1, nil)
	WriteSafetensors(filepath.Join(dir, "model-00002-of-00002.safetensors"), s2, nil)
	idx, _ := json.Marshal(map[string]any{"metadata": map[string]any{}, "weight_map": wm})
	os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), idx, 0o644)
	w, err := OpenWeights(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Check(cfg); err != nil {
		t.Fatal(err)
	}
	for _, s := range specs {
		got, err := w.BF16(s.Name)
		if err != nil {
			t.Fatal(err)
		}
		want := BF16Tensor(s.Name, s.Shape, vals[s.Name]).Data
		for i := range got {
			if got[i] != binary.LittleEndian.Uint16(want[2*i:]) {
				t.Fatalf("%s[%d] differs", s.Name, i)
			}
		}
	}
	w.Close()
	// The index names a tensor that its shard lacks.
	wm["model.extra.weight"] = "model-00001-of-00002.safetensors"
	idx, _ = json.Marshal(map[string]any{"weight_map": wm})
	os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), idx, 0o644)
	if _, err := OpenWeights(dir); err == nil || !strings.Contains(err.Error(), "model.extra.weight") {
		t.Fatalf("err = %v, want it to name model.extra.weight", err)
	}
	// A shard the index names is missing.
	delete(wm, "model.extra.weight")
	idx, _ = json.Marshal(map[string]any{"weight_map": wm})
	os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), idx, 0o644)
	os.Remove(filepath.Join(dir, "model-00002-of-00002.safetensors"))
	if _, err := OpenWeights(dir); err == nil || !strings.Contains(err.Error(), "model-00002-of-00002.safetensors") {
		t.Fatalf("err = %v, want it to name the missing shard", err)
	}
}

// TestConfigRoundTripAndDefaults: JSON() parses back to the same Config for
// every preset, and HF's per-class defaults apply to absent fields.
func TestConfigRoundTripAndDefaults(t *testing.T) {
	for _, a := range []Arch{ArchLlama, ArchQwen2, ArchQwen3, ArchQwen3MoE} {
		c, _ := Preset(a)
		js, err := c.JSON()
		if err != nil {
			t.Fatal(err)
		}
		back, err := ParseConfig(js)
		if err != nil {
			t.Fatalf("%s: %v", a, err)
		}
		b1, _ := json.Marshal(c)
		b2, _ := json.Marshal(back)
		if string(b1) != string(b2) {
			t.Fatalf("%s: round trip\n%s\n%s", a, b1, b2)
		}
	}
	c, err := ParseConfig([]byte(`{"model_type":"qwen3","vocab_size":10,"hidden_size":8,"num_hidden_layers":1,"num_attention_heads":2,"intermediate_size":4,"max_position_embeddings":16}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.HeadDim != 128 || c.KVHeads != 2 || c.RMSNormEps != 1e-6 || c.RopeTheta != 10000 || c.TieEmbeddings || !c.QKNorm {
		t.Fatalf("qwen3 defaults: %+v", c)
	}
	c, _ = ParseConfig([]byte(`{"model_type":"qwen2","vocab_size":10,"hidden_size":8,"num_hidden_layers":1,"num_attention_heads":2,"intermediate_size":4,"max_position_embeddings":16,"head_dim":99}`))
	if c.HeadDim != 4 || !c.AttentionBias {
		t.Fatalf("qwen2 derives head_dim and has q/k/v bias: %+v", c)
	}
	// Qwen3-MoE layer rule: (i+1) % step == 0 and not in mlp_only_layers.
	c, _ = ParseConfig([]byte(`{"model_type":"qwen3_moe","vocab_size":10,"hidden_size":8,"num_hidden_layers":6,"num_attention_heads":2,"intermediate_size":4,"max_position_embeddings":16,"num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":4,"decoder_sparse_step":2,"mlp_only_layers":[3]}`))
	var moe []int
	for i := 0; i < 6; i++ {
		if c.IsMoE(i) {
			moe = append(moe, i)
		}
	}
	if len(moe) != 2 || moe[0] != 1 || moe[1] != 5 {
		t.Fatalf("MoE layers %v, want [1 5]", moe)
	}
}

// TestLlama3InvFreq checks the llama3 rope scaling against values computed
// by hand from transformers' _compute_llama3_parameters (factor 8, low 1,
// high 4, original 8192, theta 500000, head_dim 128): the highest frequency
// is unscaled, the lowest is divided by 8, and a medium one is interpolated.
func TestLlama3InvFreq(t *testing.T) {
	c := &Config{HeadDim: 128, RopeTheta: 500000, RopeScaling: &RopeScaling{Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPos: 8192}}
	inv := c.InvFreq()
	base := func(i int) float64 { return 1 / math.Pow(500000, float64(2*i)/128) }
	if inv[0] != 1 {
		t.Fatalf("inv[0] = %v, want 1 (wavelength 2π < 2048: unscaled)", inv[0])
	}
	if got, want := float64(inv[63]), base(63)/8; math.Abs(got-want)/want > 1e-6 {
		t.Fatalf("inv[63] = %v, want %v (low frequency: /8)", got, want)
	}
	// i=30: wavelength 2π/base(30) lies between 2048 and 8192: medium.
	wav := 2 * math.Pi / base(30)
	if wav < 2048 || wav > 8192 {
		t.Fatalf("test setup: wavelength %v not medium", wav)
	}
	smooth := (8192/wav - 1) / (4 - 1)
	want := (1-smooth)*base(30)/8 + smooth*base(30)
	if got := float64(inv[30]); math.Abs(got-want)/want > 1e-6 {
		t.Fatalf("inv[30] = %v, want %v (medium: interpolated)", got, want)
	}
}

// TestNonFiniteWeightsRefused: a tensor holding NaN or ±Inf, in any stored
// dtype, fails F32 and BF16 with an error naming the tensor and its file;
// finite tensors of the same file load.
func TestNonFiniteWeightsRefused(t *testing.T) {
	dir := t.TempDir()
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	f16 := make([]byte, 8) // 1, 2, +Inf, -Inf as IEEE half
	for i, h := range []uint16{0x3c00, 0x4000, 0x7c00, 0xfc00} {
		binary.LittleEndian.PutUint16(f16[2*i:], h)
	}
	ts := []Tensor{
		F32Tensor("ok", []int{2}, []float32{1, 2}),
		F32Tensor("f32.nan", []int{3}, []float32{1, nan, 2}),
		F32Tensor("f32.inf", []int{2}, []float32{-inf, 2}),
		BF16Tensor("bf16.nan", []int{4}, []float32{0, 0, 0, nan}),
		BF16Tensor("bf16.inf", []int{2}, []float32{inf, 1}),
		{Name: "f16.inf", DType: "F16", Shape: []int{4}, Data: f16},
	}
	if err := WriteSafetensors(filepath.Join(dir, "model.safetensors"), ts, nil); err != nil {
		t.Fatal(err)
	}
	w, err := OpenWeights(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := w.F32("ok"); err != nil {
		t.Fatalf("finite tensor: %v", err)
	}
	if _, err := w.BF16("ok"); err != nil {
		t.Fatalf("finite tensor as BF16: %v", err)
	}
	for _, tc := range []struct{ name, first string }{
		{"f32.nan", "element 1, is NaN"}, {"f32.inf", "element 0, is -Inf"}, {"bf16.nan", "element 3, is NaN"},
		{"bf16.inf", "element 0, is +Inf"}, {"f16.inf", "2 non-finite values of 4 (the first, element 2, is +Inf)"},
	} {
		for get, load := range map[string]func(string) error{
			"F32":  func(n string) error { _, err := w.F32(n); return err },
			"BF16": func(n string) error { _, err := w.BF16(n); return err },
		} {
			err := load(tc.name)
			if !errors.Is(err, ErrNonFinite) || !errors.Is(err, ErrSafetensors) || !strings.Contains(err.Error(), "tensor "+tc.name+" ") ||
				!strings.Contains(err.Error(), "model.safetensors") || !strings.Contains(err.Error(), tc.first) {
				t.Errorf("%s(%s): %v", get, tc.name, err)
			}
		}
	}
}

// TestConfigMissingModelType: a config.json without model_type said
// `unsupported model_type ""`, as if "" were a value someone chose.
func TestConfigMissingModelType(t *testing.T) {
	const sizes = `"vocab_size":10,"hidden_size":8,"num_hidden_layers":1,"num_attention_heads":2,"intermediate_size":4,"max_position_embeddings":16`
	for _, c := range []struct{ json, want string }{
		{`{` + sizes + `}`, `model_type is missing: add the "model_type" key of the model's architecture (supported: llama, qwen2, qwen3, qwen3_moe)`},
		{`{"model_type":"",` + sizes + `}`, `model_type is missing: add the "model_type" key`},
		{`{"architectures":["Qwen2ForCausalLM"],` + sizes + `}`, `model_type is missing (architectures ["Qwen2ForCausalLM"] is model_type qwen2): add "model_type": "qwen2"`},
		{`{"architectures":["GPT2LMHeadModel"],` + sizes + `}`, `model_type is missing: add the "model_type" key of the model's architecture (supported: llama, qwen2, qwen3, qwen3_moe)`},
	} {
		_, err := ParseConfig([]byte(c.json))
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v; want %q", c.json, err, c.want)
		}
	}
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{`+sizes+`}`), 0o644)
	if _, err := LoadConfig(dir); err == nil || !strings.Contains(err.Error(), filepath.Join(dir, "config.json")+": model_type is missing") {
		t.Errorf("LoadConfig: %v; want the config.json's path, then model_type is missing", err)
	}
}
