package infer

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/compute"
	"distill/compute/device"
	"distill/model"
)

// fp8Fidelity is one architecture's FP8 teacher against its BF16 teacher
// and the fp32 goldens, at temperature 1 over the golden prompts: top-1
// agreement (positions whose most likely id is the same) and max |Δ
// log-prob| rank by rank over the top-k (as TestGoldensHFSemantics
// measures the BF16 teacher against the goldens).
type fp8Fidelity struct {
	arch                 string
	positions            int
	top1BF16, top1Golden float64 // fractions
	maxBF16, maxGolden   float64
}

// measureFP8 loads dir's checkpoint both ways on the CPU and compares.
func measureFP8(t *testing.T, dir string) fp8Fidelity {
	t.Helper()
	var g golden
	b, err := os.ReadFile(filepath.Join(dir, "golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	run := g.Runs[0]
	if run.Temperature != 1 {
		t.Fatalf("%s: the first golden run is at T=%v, want 1", dir, run.Temperature)
	}
	be := device.CPU(0)
	ref, err := Load(dir, be)
	if err != nil {
		t.Fatal(err)
	}
	fp8, err := LoadWith(dir, be, LoadOptions{Weights: WeightsFP8})
	if err != nil {
		t.Fatal(err)
	}
	opt := Options{K: g.K}
	rr, err := ref.TopK(g.Samples, opt)
	if err != nil {
		t.Fatal(err)
	}
	rq, err := fp8.TopK(g.Samples, opt)
	if err != nil {
		t.Fatal(err)
	}
	f := fp8Fidelity{arch: filepath.Base(dir)}
	var agreeB, agreeG int
	for s := range g.Samples {
		for p := range g.Samples[s] {
			q, r := rq[s].LogProbs[p*g.K:(p+1)*g.K], rr[s].LogProbs[p*g.K:(p+1)*g.K]
			qi, ri := rq[s].IDs[p*g.K:(p+1)*g.K], rr[s].IDs[p*g.K:(p+1)*g.K]
			f.positions++
			if qi[0] == ri[0] {
				agreeB++
			}
			if qi[0] == run.IDs[s][p][0] {
				agreeG++
			}
			for j := 0; j < g.K; j++ {
				f.maxBF16 = max(f.maxBF16, math.Abs(float64(q[j]-r[j])))
				f.maxGolden = max(f.maxGolden, math.Abs(float64(q[j])-run.LogProbs[s][p][j]))
			}
		}
	}
	f.top1BF16, f.top1Golden = float64(agreeB)/float64(f.positions), float64(agreeG)/float64(f.positions)
	return f
}

// fp8Bounds hold each architecture's FP8 fidelity to what
// TestFP8Fidelity measured on the CPU (the table in the README), with a
// margin: the log-prob bound at 1.5x the measured max |Δ|, the top-1
// bound 0.05 below the measured agreement. The measurement is
// deterministic on a given machine; the margin covers other CPUs' fp32
// summation orders (OpenBLAS kernels), far smaller than FP8's error.
var fp8Bounds = map[string]struct{ maxDelta, minTop1 float64 }{
	"llama":      {0.41, 0.76}, // measured 0.270, 81.9%
	"llama-bias": {0.39, 0.78}, // 0.254, 83.6%
	"qwen2":      {0.27, 0.79}, // 0.175, 84.2%
	"qwen3":      {0.46, 0.68}, // 0.301, 73.7%
	"qwen3_moe":  {0.45, 0.68}, // 0.300, 73.7%
}

// TestFP8Fidelity measures the FP8 teacher (E4M3 weights per output
// channel, activations per token) against the BF16 teacher and the fp32
// goldens over every golden architecture's prompts, and holds it to
// fp8Bounds. It fails if the FP8 path is skipped: FP8 must move the
// log-probs by more than the fp32 goldens' tolerance somewhere (a no-op
// quantization would leave Δ at 0).
func TestFP8Fidelity(t *testing.T) {
	dirs, _ := filepath.Glob("testdata/golden/*")
	if len(dirs) < 5 {
		t.Fatalf("found %d golden checkpoints, want 5", len(dirs))
	}
	var table strings.Builder
	fmt.Fprintf(&table, "| architecture | positions | top-1 agreement vs BF16 | vs fp32 golden | max |Δ log-prob| vs BF16 | vs fp32 golden |\n|---|---|---|---|---|---|\n")
	for _, dir := range dirs {
		f := measureFP8(t, dir)
		fmt.Fprintf(&table, "| %s | %d | %.1f%% | %.1f%% | %.3g | %.3g |\n", f.arch, f.positions, 100*f.top1BF16, 100*f.top1Golden, f.maxBF16, f.maxGolden)
		if !(f.maxBF16 > 10*goldenTol) {
			t.Errorf("%s: FP8 moved the log-probs by at most %.3g from BF16: the FP8 path did not run (want > %g)", f.arch, f.maxBF16, 10*goldenTol)
		}
		b, ok := fp8Bounds[f.arch]
		if !ok {
			t.Errorf("%s: no FP8 bound", f.arch)
			continue
		}
		if f.maxBF16 > b.maxDelta || f.maxGolden > b.maxDelta {
			t.Errorf("%s: FP8 max |Δ log-prob| %.3g vs BF16, %.3g vs golden: bound %.3g", f.arch, f.maxBF16, f.maxGolden, b.maxDelta)
		}
		if f.top1BF16 < b.minTop1 || f.top1Golden < b.minTop1 {
			t.Errorf("%s: FP8 top-1 agreement %.3f vs BF16, %.3f vs golden: bound %.3f", f.arch, f.top1BF16, f.top1Golden, b.minTop1)
		}
	}
	t.Logf("FP8 teacher fidelity (CPU, T=1, k=16, the golden prompts):\n%s", table.String())
}

// TestFP8Load: --weights fp8 stores exactly the decoder layers' Linear
// weights in FP8 (not the embedding, norms, router or head), changes the
// fingerprint (and bf16's is the checkpoint's as before), and refuses an
// unknown format and an FP8-quantized checkpoint naming its layout.
func TestFP8Load(t *testing.T) {
	be := device.CPU(0)
	dir := "testdata/golden/qwen3_moe"
	ref, err := Load(dir, be)
	if err != nil {
		t.Fatal(err)
	}
	m, err := LoadWith(dir, be, LoadOptions{Weights: WeightsFP8})
	if err != nil {
		t.Fatal(err)
	}
	bf, err := LoadWith(dir, be, LoadOptions{Weights: WeightsBF16})
	if err != nil {
		t.Fatal(err)
	}
	if m.Fingerprint() == ref.Fingerprint() || bf.Fingerprint() != ref.Fingerprint() {
		t.Errorf("fingerprints: fp8 %s, bf16 %s, default %s: want fp8 different, bf16 the default's", m.Fingerprint()[:12], bf.Fingerprint()[:12], ref.Fingerprint()[:12])
	}
	d := m.d
	if d.Embed.W.DType() != compute.F32 || d.Head.W.DType() != compute.F32 || d.Norm.W.DType() != compute.F32 {
		t.Errorf("embedding %v, head %v, norm %v: want them unquantized", d.Embed.W.DType(), d.Head.W.DType(), d.Norm.W.DType())
	}
	fp8 := 0
	for i := range d.Blocks {
		b := &d.Blocks[i]
		for _, l := range b.Linears() {
			if l.W.DType() != compute.F8E4M3 {
				t.Errorf("%s: %v, want f8e4m3", l.Name, l.W.DType())
			}
			fp8++
		}
		if b.Router != nil && b.Router.W.DType() != compute.F32 {
			t.Errorf("%s: %v, want the router unquantized", b.Router.Name, b.Router.W.DType())
		}
		if b.InNorm.W.DType() != compute.F32 {
			t.Errorf("layer %d input norm quantized", i)
		}
	}
	if want := 3*4 + 2*3*8 + 3; fp8 != want { // qwen3_moe: 3 layers' q/k/v/o, 2 MoE layers' 8 experts' gate/up/down, 1 dense MLP
		t.Errorf("%d FP8 Linears, want %d", fp8, want)
	}

	if _, err := LoadWith(dir, be, LoadOptions{Weights: "int4"}); !errors.Is(err, ErrInput) || !strings.Contains(err.Error(), `weights "int4": want bf16 or fp8`) {
		t.Errorf("weights int4: err = %v", err)
	}

	// An FP8 checkpoint (ModelOpt / compressed-tensors: F8_E4M3 weight and
	// weight_scale beside it) is refused naming the layout.
	w, err := model.OpenWeights("testdata/golden/qwen3")
	if err != nil {
		t.Fatal(err)
	}
	var ts []model.Tensor
	for _, n := range w.Names() {
		raw, info, err := w.Raw(n)
		if err != nil {
			t.Fatal(err)
		}
		if n == "model.layers.0.self_attn.q_proj.weight" {
			ts = append(ts, model.Tensor{Name: n, DType: "F8_E4M3", Shape: info.Shape, Data: make([]byte, info.Numel())},
				model.F32Tensor("model.layers.0.self_attn.q_proj.weight_scale", []int{1}, []float32{1}))
			continue
		}
		ts = append(ts, model.Tensor{Name: n, DType: info.DType, Shape: info.Shape, Data: raw})
	}
	defer w.Close() // ts holds its mapped bytes
	q := t.TempDir()
	cfg, _ := os.ReadFile("testdata/golden/qwen3/config.json")
	os.WriteFile(filepath.Join(q, "config.json"), cfg, 0o644)
	if err := model.WriteSafetensors(filepath.Join(q, "model.safetensors"), ts, nil); err != nil {
		t.Fatal(err)
	}
	for _, o := range []LoadOptions{{}, {Weights: WeightsFP8}} {
		_, err = LoadWith(q, be, o)
		if !errors.Is(err, model.ErrSafetensors) || !strings.Contains(err.Error(), "FP8-quantized checkpoint") || !strings.Contains(err.Error(), "ModelOpt FP8") || !strings.Contains(err.Error(), "--weights fp8") {
			t.Errorf("FP8 checkpoint, weights %q: err = %v", o.Weights, err)
		}
	}
}
