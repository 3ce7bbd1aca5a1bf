package infer

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
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
// unknown format (FP8 checkpoints: TestFP8Checkpoints).
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
	d := m.last().d
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
}

// writeFP8Checkpoint writes golden checkpoint src's config and weights to a
// new directory with every decoder layer's Linear weight stored as an FP8
// checkpoint does (F8_E4M3 and weight_scale), the scales as layout says:
// "channel" (compute.QuantizeFP8's, shape (out, 1), compressed-tensors'),
// "tensor" (one scale, the tensor's amax/448, and an input_scale:
// ModelOpt's), "block" (weight_scale_inv of 16x16 blocks, each its
// amax/448, config.json's quantization_config naming [16, 16]: Qwen's and
// DeepSeek's layout), "block128" (the same with no weight_block_size: 128
// by default), "blockshape" (scales of 16x16 blocks, the config naming
// none: refused), "both" (weight_scale and weight_scale_inv: refused), or
// "noscale" (no weight_scale: refused).
func writeFP8Checkpoint(t *testing.T, src, layout string) string {
	t.Helper()
	w, err := model.OpenWeights(src)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close() // ts holds its mapped bytes until written
	var ts []model.Tensor
	for _, n := range w.Names() {
		raw, info, err := w.Raw(n)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(n, "model.layers.") || !strings.HasSuffix(n, "_proj.weight") {
			ts = append(ts, model.Tensor{Name: n, DType: info.DType, Shape: info.Shape, Data: raw})
			continue
		}
		f, err := w.F32(n)
		if err != nil {
			t.Fatal(err)
		}
		rows, cols := info.Shape[0], info.Shape[1]
		base := strings.TrimSuffix(n, "weight")
		var q *compute.FP8Matrix
		switch layout {
		case "block", "block128", "blockshape", "both":
			b := 16
			if layout == "block128" {
				b = 128
			}
			br, bc := (rows+b-1)/b, (cols+b-1)/b
			q = &compute.FP8Matrix{Codes: make([]uint8, len(f))}
			scales := make([]float32, br*bc)
			for i0 := 0; i0 < br; i0++ {
				for j0 := 0; j0 < bc; j0++ {
					var amax float32
					for i := i0 * b; i < min(rows, (i0+1)*b); i++ {
						for j := j0 * b; j < min(cols, (j0+1)*b); j++ {
							amax = max(amax, float32(math.Abs(float64(f[i*cols+j]))))
						}
					}
					sc := compute.FP8Scale(amax)
					scales[i0*bc+j0] = sc
					for i := i0 * b; i < min(rows, (i0+1)*b); i++ {
						for j := j0 * b; j < min(cols, (j0+1)*b); j++ {
							q.Codes[i*cols+j] = compute.E4M3Byte(compute.E4M3(f[i*cols+j] / sc))
						}
					}
				}
			}
			ts = append(ts, model.F32Tensor(base+"weight_scale_inv", []int{br, bc}, scales))
			if layout == "both" {
				ts = append(ts, model.F32Tensor(base+"weight_scale", []int{}, []float32{1}))
			}
		case "tensor":
			var amax float32
			for _, v := range f {
				amax = max(amax, float32(math.Abs(float64(v))))
			}
			s := compute.FP8Scale(amax)
			q = &compute.FP8Matrix{Codes: make([]uint8, len(f))}
			for i, v := range f {
				q.Codes[i] = compute.E4M3Byte(compute.E4M3(v / s))
			}
			ts = append(ts, model.F32Tensor(base+"weight_scale", []int{}, []float32{s}), model.F32Tensor(base+"input_scale", []int{}, []float32{0.05}))
		default:
			if q, err = compute.QuantizeFP8(f, rows, cols); err != nil {
				t.Fatal(err)
			}
			switch layout {
			case "channel":
				ts = append(ts, model.F32Tensor(base+"weight_scale", []int{rows, 1}, q.Scales))
			}
		}
		ts = append(ts, model.Tensor{Name: n, DType: "F8_E4M3", Shape: info.Shape, Data: q.Codes})
	}
	dir := t.TempDir()
	cfg, _ := os.ReadFile(filepath.Join(src, "config.json"))
	if layout == "block" || layout == "both" {
		var c map[string]any
		if err := json.Unmarshal(cfg, &c); err != nil {
			t.Fatal(err)
		}
		c["quantization_config"] = map[string]any{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": []int{16, 16}}
		cfg, _ = json.Marshal(c)
	}
	os.WriteFile(filepath.Join(dir, "config.json"), cfg, 0o644)
	if err := model.WriteSafetensors(filepath.Join(dir, "model.safetensors"), ts, nil); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestFP8Checkpoints: checkpoints already in FP8 load with --weights fp8:
// per output channel (compressed-tensors), the same codes and scales as
// quantizing the BF16 checkpoint at load, so the same outputs bit for bit;
// per tensor (ModelOpt, its input_scale unused) and block-wise (Qwen's and
// DeepSeek's weight_scale_inv, requantized per channel), within FP8's
// error of BF16. Without --weights fp8, and in the layouts not read
// (block scales of another shape than the config's blocks, two kinds of
// scales, none), they are refused naming what to do.
func TestFP8Checkpoints(t *testing.T) {
	be := device.CPU(0)
	src := "testdata/golden/qwen3_moe"
	samples := [][]int32{{1, 2, 3, 4, 5, 6, 7}, {9, 8, 7, 600, 5}}
	topk := func(m *Model) []Result {
		r, err := m.TopK(samples, Options{K: 8})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	atLoad, err := LoadWith(src, be, LoadOptions{Weights: WeightsFP8})
	if err != nil {
		t.Fatal(err)
	}
	bf16, err := Load(src, be)
	if err != nil {
		t.Fatal(err)
	}
	want, ref := topk(atLoad), topk(bf16)

	ch := writeFP8Checkpoint(t, src, "channel")
	m, err := LoadWith(ch, be, LoadOptions{Weights: WeightsFP8})
	if err != nil {
		t.Fatal(err)
	}
	if m.last().d.Blocks[0].Attn.Q.W.DType() != compute.F8E4M3 || m.Fingerprint() == atLoad.Fingerprint() {
		t.Errorf("per-channel FP8 checkpoint: q_proj %v, fingerprint %.12s (quantized at load: %.12s)", m.last().d.Blocks[0].Attn.Q.W.DType(), m.Fingerprint(), atLoad.Fingerprint())
	}
	for i, r := range topk(m) {
		for j := range r.IDs {
			if r.IDs[j] != want[i].IDs[j] || math.Float32bits(r.LogProbs[j]) != math.Float32bits(want[i].LogProbs[j]) {
				t.Fatalf("per-channel FP8 checkpoint: sample %d entry %d: %d %v, quantized at load %d %v", i, j, r.IDs[j], r.LogProbs[j], want[i].IDs[j], want[i].LogProbs[j])
			}
		}
	}

	m, err = LoadWith(writeFP8Checkpoint(t, src, "tensor"), be, LoadOptions{Weights: WeightsFP8})
	if err != nil {
		t.Fatal(err)
	}
	var dRef, dAtLoad float64
	for i, r := range topk(m) {
		for j := range r.IDs {
			dRef = max(dRef, math.Abs(float64(r.LogProbs[j]-ref[i].LogProbs[j])))
			dAtLoad = max(dAtLoad, math.Abs(float64(r.LogProbs[j]-want[i].LogProbs[j])))
		}
	}
	t.Logf("per-tensor FP8 checkpoint: max |Δ log-prob| %.3g against BF16, %.3g against per-channel", dRef, dAtLoad)
	if dRef > 1 || dRef == 0 || dAtLoad == 0 {
		t.Errorf("per-tensor FP8 checkpoint: max |Δ| %.3g against BF16 (want (0, 1]), %.3g against per-channel (want > 0)", dRef, dAtLoad)
	}

	// Block-wise scales (16x16 blocks named by config.json, and 128x128 by
	// default): dequantized and quantized again per channel, so within
	// FP8's error of BF16, and not the per-channel checkpoint's codes.
	for _, layout := range []string{"block", "block128"} {
		m, err = LoadWith(writeFP8Checkpoint(t, src, layout), be, LoadOptions{Weights: WeightsFP8})
		if err != nil {
			t.Fatalf("%s: %v", layout, err)
		}
		if m.last().d.Blocks[0].Attn.Q.W.DType() != compute.F8E4M3 {
			t.Errorf("%s FP8 checkpoint: q_proj %v, want F8E4M3", layout, m.last().d.Blocks[0].Attn.Q.W.DType())
		}
		dRef, dAtLoad = 0, 0
		for i, r := range topk(m) {
			for j := range r.IDs {
				dRef = max(dRef, math.Abs(float64(r.LogProbs[j]-ref[i].LogProbs[j])))
				dAtLoad = max(dAtLoad, math.Abs(float64(r.LogProbs[j]-want[i].LogProbs[j])))
			}
		}
		t.Logf("%s FP8 checkpoint (requantized per channel at load): max |Δ log-prob| %.3g against BF16, %.3g against per-channel from BF16", layout, dRef, dAtLoad)
		if dRef > 1 || dRef == 0 || dAtLoad == 0 {
			t.Errorf("%s FP8 checkpoint: max |Δ| %.3g against BF16 (want (0, 1]), %.3g against per-channel (want > 0)", layout, dRef, dAtLoad)
		}
	}

	for _, c := range []struct {
		dir  string
		o    LoadOptions
		want string
	}{
		{ch, LoadOptions{}, "holds FP8 weights (F8_E4M3 with weight_scale: compressed-tensors or ModelOpt FP8, or weight_scale_inv: block-wise, Qwen's and DeepSeek's FP8 releases): load it with --weights fp8"},
		{writeFP8Checkpoint(t, src, "block"), LoadOptions{}, "load it with --weights fp8"},
		{writeFP8Checkpoint(t, src, "blockshape"), LoadOptions{Weights: WeightsFP8}, "its weight_scale_inv has shape"},
		{writeFP8Checkpoint(t, src, "both"), LoadOptions{Weights: WeightsFP8}, "both a weight_scale and a weight_scale_inv"},
		{writeFP8Checkpoint(t, src, "noscale"), LoadOptions{Weights: WeightsFP8}, "an FP8 weight without a weight_scale (or block-wise weight_scale_inv) beside it"},
	} {
		if _, err := LoadWith(c.dir, be, c.o); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s (weights %q): err = %v, want it to contain %q", c.dir, c.o.Weights, err, c.want)
		}
	}
}

// TestDequantBlockFP8: a block-scaled FP8 weight's values, worked by hand:
// a (3, 5) matrix in blocks of (2, 3) (partial blocks at the bottom and
// the right), E4M3 codes 0x38 = 1, 0x40 = 2, 0xB8 = -1, 0x3C = 1.5, 0x00 =
// 0, each times its block's scale; a scale that is not positive and finite
// is an error naming its block.
func TestDequantBlockFP8(t *testing.T) {
	codes := []uint8{
		0x38, 0x40, 0xB8, 0x3C, 0x00,
		0x3C, 0x00, 0x38, 0x38, 0x40,
		0x40, 0xB8, 0x3C, 0x00, 0x38,
	}
	scales := []float32{ // blocks (row block, column block): (0,0) (0,1); (1,0) (1,1)
		0.5, 2,
		4, 0.125,
	}
	want := []float32{
		0.5, 1, -0.5, 3, 0,
		0.75, 0, 0.5, 2, 4,
		8, -4, 6, 0, 0.125,
	}
	got, err := dequantBlockFP8(codes, scales, 3, 5, [2]int{2, 3})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("dequantized\n%v\nwant\n%v", got, want)
	}
	scales[3] = 0
	if _, err := dequantBlockFP8(codes, scales, 3, 5, [2]int{2, 3}); err == nil || !strings.Contains(err.Error(), "weight_scale_inv[1][1] = 0") {
		t.Fatalf("a zero scale: err = %v, want it named", err)
	}
	if _, err := dequantBlockFP8(codes, scales[:3], 3, 5, [2]int{2, 3}); err == nil || !strings.Contains(err.Error(), "3 scales") {
		t.Fatalf("too few scales: err = %v", err)
	}
}
