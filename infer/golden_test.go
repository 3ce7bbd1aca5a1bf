package infer

import (
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/compute/device"
	"distill/model"
)

// Goldens come from infer/testdata/hf_reference.py: a PyTorch
// re-implementation of HF transformers' modeling files, run in fp32 on each
// sample alone (make_goldens.sh regenerates them). Here the same samples run
// packed into one batch. Tolerance: max |Δ log-prob| <= 1e-4 at every rank;
// ids equal except where two candidates are within 2e-4 of each other
// (near-ties that fp32 rounding may order either way).
const goldenTol = 1e-4

type golden struct {
	K       int       `json:"k"`
	Samples [][]int32 `json:"samples"`
	Runs    []struct {
		Temperature float32       `json:"temperature"`
		IDs         [][][]int32   `json:"topk_ids"`
		LogProbs    [][][]float64 `json:"topk_logprobs"`
	} `json:"runs"`
}

func TestGoldensHFSemantics(t *testing.T) {
	dirs, _ := filepath.Glob("testdata/golden/*")
	if len(dirs) < 5 {
		t.Fatalf("found %d golden checkpoints under testdata/golden, want 5 (run infer/testdata/make_goldens.sh)", len(dirs))
	}
	be := device.CPU(0)
	for _, dir := range dirs {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			var g golden
			b, err := os.ReadFile(filepath.Join(dir, "golden.json"))
			if err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(b, &g); err != nil {
				t.Fatal(err)
			}
			m, err := Load(dir, be)
			if err != nil {
				t.Fatal(err)
			}
			for _, run := range g.Runs {
				res, err := m.TopK(g.Samples, Options{K: g.K, Temperature: run.Temperature})
				if err != nil {
					t.Fatal(err)
				}
				var maxErr float64
				for s := range g.Samples {
					for p := range g.Samples[s] {
						wantID, wantLP := run.IDs[s][p], run.LogProbs[s][p]
						got := res[s].LogProbs[p*g.K : (p+1)*g.K]
						gotID := res[s].IDs[p*g.K : (p+1)*g.K]
						for j := 0; j < g.K; j++ {
							d := math.Abs(float64(got[j]) - wantLP[j])
							maxErr = max(maxErr, d)
							if d > goldenTol {
								t.Fatalf("T=%v sample %d pos %d rank %d: log-prob %v, golden %v (|Δ|=%.2g > %g)", run.Temperature, s, p, j, got[j], wantLP[j], d, goldenTol)
							}
							if gotID[j] != wantID[j] && !nearTie(wantLP, j) {
								t.Fatalf("T=%v sample %d pos %d rank %d: id %d, golden %d (not a near-tie)", run.Temperature, s, p, j, gotID[j], wantID[j])
							}
						}
					}
				}
				t.Logf("T=%v: max |Δ log-prob| = %.2e over %d positions x k=%d", run.Temperature, maxErr, len(res[0].IDs)/g.K+len(res[1].IDs)/g.K+len(res[2].IDs)/g.K+len(res[3].IDs)/g.K, g.K)
			}
		})
	}
}

// nearTie reports whether rank j's golden value is within 2e-4 of a
// neighbour's, so the two ids may swap under fp32 rounding.
func nearTie(lp []float64, j int) bool {
	return (j > 0 && lp[j-1]-lp[j] < 2e-4) || (j+1 < len(lp) && lp[j]-lp[j+1] < 2e-4)
}

// TestPackingInvariance: a packed batch, and batches split by a small token
// budget, give each sample's outputs alone (bit-for-bit: per-sample work is
// the same arithmetic in the same order).
func TestPackingInvariance(t *testing.T) {
	be := device.CPU(0)
	for _, arch := range []string{"qwen3", "qwen3_moe", "llama"} {
		m, err := Load(filepath.Join("testdata/golden", arch), be)
		if err != nil {
			t.Fatal(err)
		}
		samples := [][]int32{{5}, {1, 2, 3, 4, 5, 6, 7, 8, 9}, make([]int32, 300), {999, 0, 999}}
		for i := range samples[2] {
			samples[2][i] = int32((i * 37) % 1000)
		}
		const k = 8
		alone := make([]Result, len(samples))
		for i, s := range samples {
			r, err := m.TopK([][]int32{s}, Options{K: k})
			if err != nil {
				t.Fatal(err)
			}
			alone[i] = r[0]
		}
		for _, budget := range []int{8192, 310} {
			packed, err := m.TopK(samples, Options{K: k, TokenBudget: budget})
			if err != nil {
				t.Fatal(err)
			}
			for i := range samples {
				for j := range alone[i].IDs {
					// MoE routes each token alone, and GEMM row slabs may
					// split differently by batch size: allow fp32 noise.
					if packed[i].IDs[j] != alone[i].IDs[j] && !nearTie64(alone[i].LogProbs, j, k) {
						t.Fatalf("%s budget %d: sample %d entry %d: packed id %d, alone %d", arch, budget, i, j, packed[i].IDs[j], alone[i].IDs[j])
					}
					if d := math.Abs(float64(packed[i].LogProbs[j] - alone[i].LogProbs[j])); d > 1e-5 {
						t.Fatalf("%s budget %d: sample %d entry %d: packed %v, alone %v", arch, budget, i, j, packed[i].LogProbs[j], alone[i].LogProbs[j])
					}
				}
			}
		}
	}
}

func nearTie64(lp []float32, j, k int) bool {
	r := j % k
	return (r > 0 && lp[j-1]-lp[j] < 1e-5) || (r+1 < k && lp[j]-lp[j+1] < 1e-5)
}

func TestBadInputs(t *testing.T) {
	be := device.CPU(0)
	m, err := Load("testdata/golden/qwen3", be)
	if err != nil {
		t.Fatal(err)
	}
	long := make([]int32, m.Cfg.MaxPositions+1)
	for _, c := range []struct {
		name    string
		samples [][]int32
		opt     Options
		want    string
	}{
		{"id >= vocab", [][]int32{{1, 1000}}, Options{K: 4}, "token id 1000 out of range [0,1000)"},
		{"negative id", [][]int32{{-1}}, Options{K: 4}, "token id -1 out of range"},
		{"empty sample", [][]int32{{1}, {}}, Options{K: 4}, "sample 1 is empty"},
		{"no samples", nil, Options{K: 4}, "no samples"},
		{"too long", [][]int32{long}, Options{K: 4, TokenBudget: 1 << 20}, "more than max_position_embeddings 2048"},
		{"over budget", [][]int32{make([]int32, 20)}, Options{K: 4, TokenBudget: 10}, "more than the token budget 10"},
		{"k=0", [][]int32{{1}}, Options{K: 0}, "k=0 out of range: want 1..1000"},
		{"k>vocab", [][]int32{{1}}, Options{K: 1001}, "k=1001 out of range"},
		{"temperature<0", [][]int32{{1}}, Options{K: 1, Temperature: -1}, "temperature -1 must be > 0"},
	} {
		_, err := m.TopK(c.samples, c.opt)
		if !errors.Is(err, ErrInput) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want ErrInput containing %q", c.name, err, c.want)
		}
	}
	// k = vocab works and returns every id once, log-probs summing to 1.
	r, err := m.TopK([][]int32{{3, 4}}, Options{K: 1000})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int32]bool{}
	var sum float64
	for j := 0; j < 1000; j++ {
		seen[r[0].IDs[j]] = true
		sum += math.Exp(float64(r[0].LogProbs[j]))
	}
	if len(seen) != 1000 || math.Abs(sum-1) > 1e-4 {
		t.Fatalf("k=vocab: %d distinct ids, probabilities sum to %v", len(seen), sum)
	}
}

// TestBadCheckpoints: every broken checkpoint is an error naming the file or
// tensor, never a crash or a silent zero.
func TestBadCheckpoints(t *testing.T) {
	be := device.CPU(0)
	src := "testdata/golden/qwen3"
	cfgJSON, _ := os.ReadFile(filepath.Join(src, "config.json"))
	weights, _ := os.ReadFile(filepath.Join(src, "model.safetensors"))
	edit := func(js string, fn func(map[string]any)) string {
		var m map[string]any
		json.Unmarshal([]byte(js), &m)
		fn(m)
		b, _ := json.Marshal(m)
		return string(b)
	}
	for _, c := range []struct {
		name    string
		config  string
		weights []byte
		want    string
	}{
		{"unknown arch", edit(string(cfgJSON), func(m map[string]any) { m["model_type"] = "gpt2"; m["architectures"] = []string{"GPT2LMHeadModel"} }), weights, `unsupported model_type "gpt2"`},
		{"heads vs kv heads", edit(string(cfgJSON), func(m map[string]any) { m["num_key_value_heads"] = 3 }), weights, "not a multiple of num_key_value_heads 3"},
		{"odd head_dim", edit(string(cfgJSON), func(m map[string]any) { m["head_dim"] = 31 }), weights, "head_dim 31 must be positive and even"},
		{"unsupported rope", edit(string(cfgJSON), func(m map[string]any) { m["rope_scaling"] = map[string]any{"rope_type": "yarn", "factor": 4} }), weights, `rope_type "yarn" is not supported`},
		{"wrong act", edit(string(cfgJSON), func(m map[string]any) { m["hidden_act"] = "gelu" }), weights, `hidden_act "gelu"`},
		{"missing field", edit(string(cfgJSON), func(m map[string]any) { delete(m, "hidden_size") }), weights, "missing hidden_size"},
		{"shape mismatch", edit(string(cfgJSON), func(m map[string]any) { m["intermediate_size"] = 64 }), weights, "model.layers.0.mlp.gate_proj.weight has shape [128 64], config.json implies [64 64]"},
		{"missing tensor (untied head expected)", edit(string(cfgJSON), func(m map[string]any) { m["num_hidden_layers"] = 3 }), weights, "missing tensor model.layers.2.input_layernorm.weight"},
		{"extra tensor", edit(string(cfgJSON), func(m map[string]any) { m["num_hidden_layers"] = 1 }), weights, "unexpected tensor model.layers.1."},
		{"truncated", string(cfgJSON), weights[:len(weights)-100], "overrun the"},
		{"header overruns", string(cfgJSON), append([]byte{0xff, 0xff, 0xff, 0, 0, 0, 0, 0}, weights[8:]...), "header length"},
		{"tiny file", string(cfgJSON), weights[:5], "too short"},
		{"garbage header", string(cfgJSON), append(append([]byte{}, weights[:8]...), make([]byte, len(weights)-8)...), "header is not valid JSON"},
		{"config not json", "{", weights, "not valid JSON"},
	} {
		dir := t.TempDir()
		os.WriteFile(filepath.Join(dir, "config.json"), []byte(c.config), 0o644)
		os.WriteFile(filepath.Join(dir, "model.safetensors"), c.weights, 0o644)
		_, err := Load(dir, be)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want it to contain %q", c.name, err, c.want)
		}
		if err != nil && !errors.Is(err, model.ErrConfig) && !errors.Is(err, model.ErrSafetensors) {
			t.Errorf("%s: err %v is neither model.ErrConfig nor model.ErrSafetensors", c.name, err)
		}
	}
}
