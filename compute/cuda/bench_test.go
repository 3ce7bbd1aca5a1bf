package cuda

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"distill/compute"
	"distill/model"
	"distill/model/decoder"
)

// Benchmarks need a GPU (DISTILL_CUDA_TEST=gpu, as scripts/gpu-suite.sh
// sets); they report TFLOP/s, tokens/s and MFU against the device's dense
// BF16 peak (DISTILL_PEAK_TFLOPS overrides the table below).

func benchBackend(b *testing.B, profile bool) *Backend {
	b.Helper()
	if !onGPU() {
		b.Skip("benchmarks need a GPU: set DISTILL_CUDA_TEST=gpu (scripts/gpu-suite.sh)")
	}
	be, err := Open(Options{KernelCache: kernelCacheForTests(b), Profile: profile})
	if err != nil {
		b.Fatalf("opening the GPU backend: %v", err)
	}
	b.Cleanup(func() { be.Close() })
	return be
}

// peakTFLOPS is the dense BF16 tensor-core peak of the device, 0 if unknown.
func peakTFLOPS(info DeviceInfo) float64 {
	if v, err := strconv.ParseFloat(os.Getenv("DISTILL_PEAK_TFLOPS"), 64); err == nil {
		return v
	}
	n := strings.ToUpper(info.Name)
	switch {
	case strings.Contains(n, "H100") && strings.Contains(n, "PCIE"):
		return 756
	case strings.Contains(n, "H100"), strings.Contains(n, "H200"), strings.Contains(n, "H800"):
		return 989.4
	case strings.Contains(n, "A100"):
		return 312
	case strings.Contains(n, "L40S"):
		return 362
	}
	return 0
}

func (be *Backend) wait() {
	defer be.enter()()
	be.sync()
}

// randBF16 is n BF16 values uniform in ±sqrt(3)·std.
func randBF16(r *rand.Rand, n int, std float64) []uint16 {
	h := make([]uint16, n)
	a := std * math.Sqrt(3)
	for i := range h {
		h[i] = compute.F32ToBF16(float32((r.Float64()*2 - 1) * a))
	}
	return h
}

func BenchmarkGEMM(b *testing.B) {
	be := benchBackend(b, false)
	r := rand.New(rand.NewPCG(1, 1))
	for _, s := range [][3]int{{16384, 4096, 4096}, {16384, 12288, 4096}, {16384, 4096, 12288}, {8192, 8192, 8192}, {16384, 1024, 1024}} {
		m, n, k := s[0], s[1], s[2]
		w, _ := be.Weight(randBF16(r, n*k, 0.02))
		xb, _ := be.Weight(randBF16(r, m*k, 1))
		x := be.New(compute.F32, m*k)
		out := be.New(compute.F32, m*n)
		flops := 2 * float64(m) * float64(n) * float64(k)
		b.Run(fmt.Sprintf("cublasLt_bf16_%dx%dx%d", m, n, k), func(b *testing.B) {
			be.MatMul(out, xb, w, nil, m, n, k) // plan and warm up
			be.wait()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				be.MatMul(out, xb, w, nil, m, n, k)
			}
			be.wait()
			b.ReportMetric(flops*float64(b.N)/b.Elapsed().Seconds()/1e12, "TFLOP/s")
		})
		b.Run(fmt.Sprintf("MatMul_f32x_%dx%dx%d", m, n, k), func(b *testing.B) {
			be.MatMul(out, x, w, nil, m, n, k)
			be.wait()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				be.MatMul(out, x, w, nil, m, n, k)
			}
			be.wait()
			b.ReportMetric(flops*float64(b.N)/b.Elapsed().Seconds()/1e12, "TFLOP/s")
		})
		for _, t := range []compute.Tensor{w, xb, x, out} {
			be.Free(t)
		}
	}
}

func BenchmarkAttention(b *testing.B) {
	be := benchBackend(b, false)
	r := rand.New(rand.NewPCG(2, 2))
	for _, L := range []int{4096, 512} {
		lens := make([]int, 16384/L)
		for i := range lens {
			lens[i] = L
		}
		c := newAttnCase(r, lens, 32, 8, 128)
		q, k, v := be.FromF32(c.q), be.FromF32(c.k), be.FromF32(c.v)
		st := be.FromI32(c.starts)
		out := be.New(compute.F32, c.tokens*32*128)
		var flops float64 // QKᵀ and PV over the causal half
		for _, l := range lens {
			flops += 4 * 128 * 32 * float64(l) * float64(l+1) / 2
		}
		for _, mode := range []attnMode{"mma", "simt"} {
			b.Run(fmt.Sprintf("%s_len%d_16k_h32_kv8_hd128", mode, L), func(b *testing.B) {
				be.attn = mode
				defer func() { be.attn = "" }()
				be.Attention(out, nil, q, k, v, st, len(lens), L, c.tokens, 32, 8, 128, 0.088)
				be.wait()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					be.Attention(out, nil, q, k, v, st, len(lens), L, c.tokens, 32, 8, 128, 0.088)
				}
				be.wait()
				b.ReportMetric(flops*float64(b.N)/b.Elapsed().Seconds()/1e12, "TFLOP/s")
			})
		}
		for _, t := range []compute.Tensor{q, k, v, st, out} {
			be.Free(t)
		}
	}
}

func BenchmarkLMHead(b *testing.B) {
	be := benchBackend(b, false)
	r := rand.New(rand.NewPCG(3, 3))
	const tokens, vocab, k = 8192, 151936, 64
	for _, hidden := range []int{1024, 4096} {
		w, _ := be.Weight(randBF16(r, vocab*hidden, 0.02))
		x := be.FromF32(randF32(r, tokens*hidden))
		ids, lps := be.New(compute.I32, tokens*k), be.New(compute.F32, tokens*k)
		b.Run(fmt.Sprintf("tokens%d_hidden%d_vocab%d_k%d", tokens, hidden, vocab, k), func(b *testing.B) {
			be.LMHeadTopK(ids, lps, x, w, tokens, hidden, vocab, k)
			be.wait()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				be.LMHeadTopK(ids, lps, x, w, tokens, hidden, vocab, k)
			}
			be.wait()
			s := b.Elapsed().Seconds()
			b.ReportMetric(2*float64(tokens)*float64(hidden)*float64(vocab)*float64(b.N)/s/1e12, "TFLOP/s")
			b.ReportMetric(float64(tokens*b.N)/s, "tokens/s")
		})
		for _, t := range []compute.Tensor{w, x, ids, lps} {
			be.Free(t)
		}
	}
}

// benchShape is a Qwen3-shaped decoder for the forward benchmark.
type benchShape struct {
	Name                                      string
	Vocab, Hidden, Layers, Heads, KVHeads, HD int
	Inter                                     int
	Tied                                      bool
}

var benchShapes = []benchShape{
	{"qwen3-0.6b", 151936, 1024, 28, 16, 8, 128, 3072, true},
	{"qwen3-1.7b", 151936, 2048, 28, 16, 8, 128, 6144, true},
	{"qwen3-8b", 151936, 4096, 36, 32, 8, 128, 12288, false},
}

// matmulParams counts the parameters that multiply each token: every
// layer's, and the LM head (the embedding lookup costs no FLOPs).
func (s benchShape) matmulParams() float64 {
	hq, hkv := s.Heads*s.HD, s.KVHeads*s.HD
	layer := s.Hidden*hq + 2*s.Hidden*hkv + hq*s.Hidden + 3*s.Hidden*s.Inter + 2*s.Hidden + 2*s.HD
	return float64(s.Layers*layer + s.Vocab*s.Hidden + s.Hidden)
}

// config is s as a Qwen3 model.Config.
func (s benchShape) config() *model.Config {
	return &model.Config{Arch: model.ArchQwen3, VocabSize: s.Vocab, Hidden: s.Hidden, Layers: s.Layers,
		Heads: s.Heads, KVHeads: s.KVHeads, HeadDim: s.HD, Intermediate: s.Inter, MaxPositions: 40960,
		RMSNormEps: 1e-6, RopeTheta: 1e6, TieEmbeddings: s.Tied, QKNorm: true, BOSTokenID: -1, EOSTokenID: -1}
}

// benchModel is the teacher's decoder (package model/decoder, the code
// package infer runs) over random BF16 weights of a shape, and the
// weights it holds on the backend.
type benchModel struct {
	*decoder.Model
	weights []compute.Tensor
}

// newBenchModel uploads random BF16 weights of shape s (norm weights one):
// one random host buffer per distinct size, uploaded for every tensor of
// that size (the device holds every layer's own copy, as a real checkpoint
// would).
func newBenchModel(be compute.Backend, s benchShape) *benchModel {
	cfg := s.config()
	r := rand.New(rand.NewPCG(4, 4))
	bufs := map[int][]uint16{}
	specs := map[string]model.TensorSpec{}
	for _, ts := range cfg.Tensors() {
		specs[ts.Name] = ts
	}
	bm := &benchModel{}
	m, err := decoder.New(cfg, be, func(name string) (compute.Tensor, compute.Tensor, error) {
		ts, ok := specs[name]
		if !ok {
			return nil, nil, fmt.Errorf("no tensor %s in the bench shape %s", name, s.Name)
		}
		n := 1
		for _, d := range ts.Shape {
			n *= d
		}
		var h []uint16
		if ts.Norm {
			h = make([]uint16, n)
			for i := range h {
				h[i] = compute.F32ToBF16(1)
			}
		} else if h = bufs[n]; h == nil {
			h = randBF16(r, n, 0.02)
			bufs[n] = h
		}
		w, err := be.Weight(h)
		if err == nil {
			bm.weights = append(bm.weights, w)
		}
		return w, nil, err
	})
	if err != nil {
		panic(err)
	}
	bm.Model = m
	return bm
}

// forward is the teacher's forward over one packed batch (decoder.TopK:
// activations allocated and freed, the RoPE table built and uploaded, the
// top-k copied to the host), temperature 1.
func (m *benchModel) forward(be compute.Backend, samples [][]int32, k int) ([]int32, []float32) {
	return m.TopK(samples, k, 1)
}

// benchWorkloads are the two workloads at about tokens tokens a
// batch: (a) equal 4096-token samples; (b) log-normal lengths clipped to
// [64, 4096] (median 512, as in chat data), packed.
func benchWorkloads(tokens int) map[string][]int {
	w := map[string][]int{}
	for t := 0; t+4096 <= tokens; t += 4096 {
		w["a"] = append(w["a"], 4096)
	}
	r := rand.New(rand.NewPCG(5, 5))
	for t := 0; ; {
		l := int(math.Exp(math.Log(512) + 0.9*r.NormFloat64()))
		l = min(max(l, 64), 4096)
		if t+l > tokens {
			break
		}
		w["b"] = append(w["b"], l)
		t += l
	}
	return w
}

// BenchmarkForward: the teacher's forward over packed batches (16k tokens
// by default, DISTILL_BENCH_TOKENS), k = 64, for Qwen3-0.6B/1.7B/8B-shaped
// random weights. MFU = (2 × matmul params + attention FLOPs) per token ×
// tokens/s / dense BF16 peak. With DISTILL_BENCH_OUT set, the workloads'
// sample lengths are written to workloads.json there (the HF peer,
// scripts/gpu/hf_bench.py, runs the same ones), and the top kernels of
// one profiled pass to profile-<shape>-<workload>.txt.
func BenchmarkForward(b *testing.B) {
	tokens := 16384
	if v, err := strconv.Atoi(os.Getenv("DISTILL_BENCH_TOKENS")); err == nil {
		tokens = v
	}
	wl := benchWorkloads(tokens)
	outDir := os.Getenv("DISTILL_BENCH_OUT")
	if outDir != "" {
		if err := writeWorkloads(outDir, tokens, wl); err != nil {
			b.Fatal(err)
		}
	}
	only := os.Getenv("DISTILL_BENCH_SHAPES") // e.g. "qwen3-0.6b,qwen3-8b"
	be := benchBackend(b, false)
	peak := peakTFLOPS(be.Info())
	for _, s := range benchShapes {
		if only != "" && !strings.Contains(only, s.Name) {
			continue
		}
		m := newBenchModel(be, s)
		for _, name := range []string{"a", "b"} {
			lens := wl[name]
			r := rand.New(rand.NewPCG(6, 6))
			samples := make([][]int32, len(lens))
			n := 0
			var attnFlops float64
			for i, l := range lens {
				samples[i] = make([]int32, l)
				for j := range samples[i] {
					samples[i][j] = int32(r.IntN(s.Vocab))
				}
				n += l
				attnFlops += 4 * float64(s.HD*s.Heads*s.Layers) * float64(l) * float64(l+1) / 2
			}
			flops := 2*s.matmulParams()*float64(n) + attnFlops
			b.Run(fmt.Sprintf("%s/workload_%s/%d_samples_%d_tokens", s.Name, name, len(lens), n), func(b *testing.B) {
				m.forward(be, samples, 64) // warm up: plans, pool
				be.wait()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					m.forward(be, samples, 64)
				}
				b.StopTimer()
				sec := b.Elapsed().Seconds() / float64(b.N)
				b.ReportMetric(float64(n)/sec, "tokens/s")
				b.ReportMetric(flops/sec/1e12, "TFLOP/s")
				if peak > 0 {
					b.ReportMetric(100*flops/sec/1e12/peak, "MFU%")
				}
				b.ReportMetric(float64(be.PeakMemory())/(1<<30), "devmem_GiB") // the pool's high-water mark since Open
				if outDir != "" {
					be.prof = map[string]*ProfileEntry{}
					m.forward(be, samples, 64)
					var sb strings.Builder
					var sum float64
					prof := be.Profile()
					be.prof = nil
					for _, e := range prof {
						sum += e.Time.Seconds()
					}
					fmt.Fprintf(&sb, "%s workload %s (%d tokens): one profiled forward, %.1f ms in kernels\n", s.Name, name, n, 1e3*sum)
					for i, e := range prof {
						if i == 15 {
							break
						}
						fmt.Fprintf(&sb, "%6.1f%% %9.2f ms %6d calls  %s\n", 100*e.Time.Seconds()/sum, 1e3*e.Time.Seconds(), e.Calls, e.Name)
					}
					os.WriteFile(filepath.Join(outDir, fmt.Sprintf("profile-%s-%s.txt", s.Name, name)), []byte(sb.String()), 0o644)
				}
			})
		}
		freeBenchModel(be, m)
	}
}

// writeWorkloads writes dir/workloads.json for scripts/gpu/hf_bench.py.
func writeWorkloads(dir string, tokens int, wl map[string][]int) error {
	j, err := json.MarshalIndent(map[string]any{"tokens": tokens, "k": 64, "workloads": wl, "shapes": benchShapes}, "", " ")
	if err == nil {
		err = os.WriteFile(filepath.Join(dir, "workloads.json"), j, 0o644)
	}
	return err
}

// TestWriteWorkloads writes the benchmark's workloads to
// $DISTILL_BENCH_OUT/workloads.json without running anything (the GPU
// suite's peer step, when the bench step ran in another call); it checks
// the workloads' sizes either way.
func TestWriteWorkloads(t *testing.T) {
	tokens := 16384
	if v, err := strconv.Atoi(os.Getenv("DISTILL_BENCH_TOKENS")); err == nil {
		tokens = v
	}
	wl := benchWorkloads(tokens)
	for name, lens := range wl {
		n := 0
		for _, l := range lens {
			if l < 64 || l > 4096 {
				t.Fatalf("workload %s: a sample of %d tokens", name, l)
			}
			n += l
		}
		if n > tokens || n < tokens-4096 {
			t.Fatalf("workload %s: %d tokens, want at most %d and within one sample of it", name, n, tokens)
		}
	}
	if dir := os.Getenv("DISTILL_BENCH_OUT"); dir != "" {
		if err := writeWorkloads(dir, tokens, wl); err != nil {
			t.Fatal(err)
		}
	}
}

func freeBenchModel(be compute.Backend, m *benchModel) {
	for _, t := range m.weights {
		be.Free(t)
	}
}

// TestBenchModel runs the benchmark's forward (the decoder on a small
// Qwen3 shape with head_dim 64, so attention takes the tensor-core kernel)
// on the CUDA backend and on the CPU, which must agree as the goldens do:
// the benchmark measures a forward that computes the right thing.
func TestBenchModel(t *testing.T) {
	be := testBackend(t)
	s := benchShape{"tiny", 5000, 128, 2, 4, 2, 64, 256, false}
	r := rand.New(rand.NewPCG(7, 7))
	samples := [][]int32{make([]int32, 70), make([]int32, 5), make([]int32, 130)}
	for _, smp := range samples {
		for j := range smp {
			smp[j] = int32(r.IntN(s.Vocab))
		}
	}
	const k = 8
	gID, gLP := newBenchModel(be, s).forward(be, samples, k)
	cID, cLP := newBenchModel(oracle, s).forward(oracle, samples, k)
	var a agreement
	for p := 0; p < len(gID)/k; p++ {
		want := make([]float64, k)
		for j := range want {
			want[j] = float64(cLP[p*k+j])
		}
		a.add(gID[p*k:(p+1)*k], gLP[p*k:(p+1)*k], cID[p*k:(p+1)*k], want, 0.05)
	}
	t.Logf("bench model vs cpu: %s", &a)
	if float64(a.top1) < 0.95*float64(a.positions) || a.maxDelta > 0.15 {
		t.Errorf("bench model vs cpu: %s", &a)
	}
}
