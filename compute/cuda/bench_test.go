package cuda

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

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

// The attention benchmark's cases: the shapes, 16384 packed tokens
// each (samples of equal length, causal), 32 query heads, 8 kv heads,
// head_dim 128 (Qwen3-8B's attention), on each implementation the backend
// can run, forward alone and forward + backward.
var (
	attnBenchShapes = []struct{ samples, seq int }{{4, 4096}, {32, 512}, {1, 8192}} // 1x8192: a training step's row
	attnBenchImpls  = []struct {
		name, attention string // sub-benchmark name, Options.Attention
		nondet          bool   // cuDNN's non-deterministic backward
		ragged          bool   // Options.AttnRaggedOnly: the ragged graph for these fixed-length batches too
		f32IO           bool   // F32 tensors in and out (the contract's), not the activation dtype's
	}{{"cudnn", "cudnn", false, false, false}, {"cudnn-ragged", "cudnn", false, true, false}, {"cudnn-nondet", "cudnn", true, false, false},
		{"cudnn-f32io", "cudnn", false, false, true}, {"mma", "mma", false, false, false}}
)

const attnBenchHeads, attnBenchKV, attnBenchHD = 32, 8, 128

// attnFwdFLOPs is the forward's FLOP count by the convention of the other
// benchmarks and of FlashAttention's: QKᵀ and PV, 2 FLOPs a multiply-add,
// over the causal half (l(l+1)/2 query-key pairs of a sample of l tokens).
// The backward counts 2.5 times the forward (5 matmuls to the forward's
// 2), so forward + backward is 3.5 times it, as FlashAttention and
// PyTorch count it; scripts/gpu/sdpa_bench.py counts the same.
func attnFwdFLOPs(lens []int, heads, hd int) float64 {
	var f float64
	for _, l := range lens {
		f += 4 * float64(hd*heads) * float64(l) * float64(l+1) / 2
	}
	return f
}

// withEnv sets the environment variable key to value (unsets it for "")
// and returns the function that restores it.
func withEnv(key, value string) func() {
	old, had := os.LookupEnv(key)
	if value == "" {
		os.Unsetenv(key)
	} else {
		os.Setenv(key, value)
	}
	return func() {
		if had {
			os.Setenv(key, old)
		} else {
			os.Unsetenv(key)
		}
	}
}

// benchLog keeps a backend's log lines (Options.Logf) for the reasons of
// skipped cases.
type benchLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *benchLog) logf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf(format, args...))
}

// about returns the last line that mentions any of subs, "" if none.
func (l *benchLog) about(subs ...string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i := len(l.lines) - 1; i >= 0; i-- {
		for _, s := range subs {
			if strings.Contains(l.lines[i], s) {
				return l.lines[i]
			}
		}
	}
	return ""
}

// cudnnCalls is how many times cuDNN's forward and backward graphs have
// run on be (zero without cuDNN): a shape cuDNN refuses runs on the own
// kernels, which the benchmark must not report as cuDNN's.
func cudnnCalls(be *Backend) [2]int {
	if be.dnn == nil {
		return [2]int{}
	}
	return be.dnn.calls
}

// openAttnBench opens a backend whose attention runs attention ("cudnn",
// "mma"), with cuDNN's non-deterministic backward if nondet, or says why
// it cannot: cuDNN not loadable (Open's error), or a backend that runs
// something else than asked.
func openAttnBench(b *testing.B, attention string, nondet, ragged bool, log *benchLog) (*Backend, string, error) {
	// $DISTILL_CUDNN_NONDETERMINISTIC would turn the deterministic case's
	// backward non-deterministic too, and $DISTILL_CUDNN_RAGGED every case
	// ragged: unset around Open, which reads them.
	restore := withEnv("DISTILL_CUDNN_NONDETERMINISTIC", "")
	restoreRagged := withEnv("DISTILL_CUDNN_RAGGED", "")
	be, err := Open(Options{KernelCache: kernelCacheForTests(b), Attention: attention, AttnNondeterministic: nondet, AttnRaggedOnly: ragged, Logf: log.logf})
	restoreRagged()
	restore()
	if err != nil {
		return nil, "", err
	}
	impl := be.AttentionImpl()
	if attention == "cudnn" {
		why := ""
		switch {
		case be.dnn == nil || !strings.HasPrefix(impl, "cudnn"):
			why = "cuDNN is not loaded"
		case nondet != strings.Contains(impl, "non-deterministic"):
			why = fmt.Sprintf("its backward is not the one asked for (non-deterministic: %v)", nondet)
		}
		if why != "" {
			be.Close()
			return nil, "", fmt.Errorf("Options.Attention %q opened, but attention runs %s: %s", attention, impl, why)
		}
	}
	return be, impl, nil
}

// BenchmarkAttention times attention on the shapes (4 x 4096 and
// 32 x 512 packed tokens, 32 query heads, 8 kv heads, head_dim 128,
// causal) for each implementation: cuDNN's fused flash attention with its
// deterministic backward (cudnn) and its faster non-deterministic one
// (cudnn-nondet), and this package's tensor-core kernels (mma); forward
// alone (no log-sum-exp, the teacher's forward) and forward (with the
// log-sum-exp) + backward (AttentionBackward, the training step's). An
// implementation that cannot run here (cuDNN not loadable) is skipped with
// the reason, never timed. It reports TFLOP/s (attnFwdFLOPs; x 3.5 for
// forward + backward) and the pool's high-water mark over the case (its
// inputs and outputs included; a workspace allocated outside the pool is
// not counted). Its tensors are the training step's and the teacher's:
// q, k, v, out, dout and dv in the backend's activation dtype (BF16), dq
// and dk F32; cudnn-f32io passes F32 for all of them (the contract allows
// it; the earlier runs' tables), which adds the widening and rounding
// passes to cuDNN's time. With DISTILL_BENCH_OUT set it appends one JSON line per
// case, skipped ones included, to attn-bench.jsonl there (the suite's
// attn step sets it beside scripts/gpu/sdpa_bench.py's PyTorch figures:
// scripts/gpu/attn_table.py).
func BenchmarkAttention(b *testing.B) {
	if !onGPU() {
		b.Skip("benchmarks need a GPU: set DISTILL_CUDA_TEST=gpu (scripts/gpu-suite.sh)")
	}
	outDir := os.Getenv("DISTILL_BENCH_OUT")
	const H, KV, HD = attnBenchHeads, attnBenchKV, attnBenchHD
	scale := float32(1 / math.Sqrt(HD))
	r := rand.New(rand.NewPCG(2, 2))
	type shape struct {
		name  string
		c     *attnCase
		dout  []float32
		flops float64 // the forward's
	}
	var shapes []shape
	for _, s := range attnBenchShapes {
		lens := make([]int, s.samples)
		for i := range lens {
			lens[i] = s.seq
		}
		c := newAttnCase(r, lens, H, KV, HD)
		shapes = append(shapes, shape{fmt.Sprintf("%dx%d", s.samples, s.seq), c, randF32(r, c.tokens*H*HD), attnFwdFLOPs(lens, H, HD)})
	}
	record := func(rec map[string]any) {
		if outDir == "" {
			return
		}
		line, err := json.Marshal(rec)
		if err != nil {
			b.Fatal(err)
		}
		f, err := os.OpenFile(filepath.Join(outDir, "attn-bench.jsonl"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err == nil {
			fmt.Fprintf(f, "%s\n", line)
			f.Close()
		}
	}
	for _, im := range attnBenchImpls {
		log := &benchLog{}
		be, implName, openErr := openAttnBench(b, im.attention, im.nondet, im.ragged, log)
		if openErr == nil {
			b.Logf("%s: Options{Attention: %q, AttnNondeterministic: %v, AttnRaggedOnly: %v}: attention runs %q", im.name, im.attention, im.nondet, im.ragged, implName)
		}
		for _, sh := range shapes {
			for _, dir := range []string{"fwd", "fwd+bwd"} {
				name := fmt.Sprintf("%s/%s/%s_h%d_kv%d_hd%d", im.name, dir, sh.name, H, KV, HD)
				key := map[string]any{"impl": im.name, "dir": dir, "shape": sh.name, "samples": len(sh.c.lens), "seq_len": sh.c.maxLen,
					"tokens": sh.c.tokens, "heads": H, "kv_heads": KV, "head_dim": HD, "causal": true, "io": "f32"}
				b.Run(name, func(b *testing.B) {
					if openErr != nil {
						key["skipped"] = openErr.Error()
						record(key)
						b.Skipf("%s: %v", im.name, openErr)
					}
					c := sh.c
					be.ResetPeakMemory()
					act := compute.F32
					if !im.f32IO {
						act = be.ActDType()
					}
					key["io"] = act.String()
					in := func(x []float32) compute.Tensor {
						t := be.New(act, len(x))
						be.WriteF32(t, x)
						return t
					}
					q, k, v := in(c.q), in(c.k), in(c.v)
					st := be.FromI32(c.starts)
					out := be.New(act, c.tokens*H*HD)
					ts := []compute.Tensor{q, k, v, st, out}
					flops := sh.flops
					iter := func() { be.Attention(out, nil, q, k, v, st, len(c.lens), c.maxLen, c.tokens, H, KV, HD, scale) }
					if dir == "fwd+bwd" {
						lse := be.New(compute.F32, c.tokens*H)
						dout := in(sh.dout)
						dq, dk, dv := be.New(compute.F32, len(c.q)), be.New(compute.F32, len(c.k)), be.New(act, len(c.v))
						be.Zero(dq)
						be.Zero(dk)
						be.Zero(dv)
						ts = append(ts, lse, dout, dq, dk, dv)
						flops *= 3.5
						iter = func() {
							be.Attention(out, lse, q, k, v, st, len(c.lens), c.maxLen, c.tokens, H, KV, HD, scale)
							be.AttentionBackward(dq, dk, dv, dout, q, k, v, out, lse, st, len(c.lens), c.maxLen, c.tokens, H, KV, HD, scale)
						}
					}
					calls := cudnnCalls(be)
					// Warm up (plans, the pool, cuDNN's graphs). A failure here
					// (the backend panics) fails this case, not the cases after it.
					if msg := func() (msg string) {
						defer func() {
							if p := recover(); p != nil {
								msg = fmt.Sprint(p)
							}
						}()
						iter()
						be.wait()
						return ""
					}(); msg != "" {
						key["error"] = msg
						record(key)
						b.Fatalf("%s %s %s: %s", im.name, dir, sh.name, msg)
					}
					if im.attention == "cudnn" {
						// A shape cuDNN refuses runs on the own kernels: not cuDNN's figure.
						after := cudnnCalls(be)
						if after[0] == calls[0] || (dir == "fwd+bwd" && after[1] == calls[1]) {
							for _, t := range ts {
								be.Free(t)
							}
							why := fmt.Sprintf("cuDNN did not run this case (forward calls %d -> %d, backward %d -> %d; log: %q)",
								calls[0], after[0], calls[1], after[1], log.about("refus", "cuDNN", "cudnn"))
							key["skipped"] = why
							record(key)
							b.Skip(why)
						}
					}
					b.ResetTimer()
					for i := 0; i < b.N; i++ {
						iter()
					}
					be.wait()
					b.StopTimer()
					sec := b.Elapsed().Seconds() / float64(b.N)
					devmem := float64(be.PeakMemory()) / (1 << 30)
					b.ReportMetric(flops/sec/1e12, "TFLOP/s")
					b.ReportMetric(devmem, "devmem_GiB")
					for _, t := range ts {
						be.Free(t)
					}
					// One line per run: the testing package runs a benchmark
					// once with b.N = 1 first; the table keeps each case's last.
					key["impl_name"], key["iterations"], key["ms"] = implName, b.N, 1e3*sec
					key["tflops"], key["flops"], key["devmem_GiB"], key["gpu"] = flops/sec/1e12, flops, devmem, be.Info().Name
					record(key)
				})
			}
		}
		if be != nil {
			be.Close()
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
			// The same calls folding a GEMM tile a launch
			// (k_lm_fold_gemm, Options.LMFold "gemm"), untimed by the
			// benchmark's clock: its A/B in one run.
			b.StopTimer()
			be.lmFoldGEMM = true
			be.LMHeadTopK(ids, lps, x, w, tokens, hidden, vocab, k)
			be.wait()
			t0 := time.Now()
			for i := 0; i < b.N; i++ {
				be.LMHeadTopK(ids, lps, x, w, tokens, hidden, vocab, k)
			}
			be.wait()
			st := time.Since(t0).Seconds()
			be.lmFoldGEMM = false
			b.ReportMetric(float64(tokens*b.N)/st, "gemm_fold_tokens/s")
			b.ReportMetric(s/st, "gemm_fold_speedup")
		})
		// The sampled targets' pass (issue 27): n = 16 draws a token
		// beside the top-k (head+sampled) and alone (sampled, k 0), on
		// the same x and w: its cost against the top-k pass above.
		const n = 16
		uf := make([]float64, tokens*n)
		for t := 0; t < tokens; t++ {
			for d := 0; d < n; d++ {
				uf[t*n+d] = float64(r.Uint64()>>11) / (1 << 53)
			}
			slices.Sort(uf[t*n : (t+1)*n])
		}
		pu := make([]int32, 2*len(uf))
		compute.PackUniforms(pu, uf)
		u := be.FromI32(pu)
		drawn, tail := be.New(compute.I32, tokens*n), be.New(compute.F32, tokens)
		for _, c := range []struct {
			name string
			k    int
			head bool
		}{{"sample-head", k, true}, {"sample", 0, false}} {
			b.Run(fmt.Sprintf("%s_tokens%d_hidden%d_vocab%d_k%d_n%d", c.name, tokens, hidden, vocab, c.k, n), func(b *testing.B) {
				be.LMHeadSample(ids, lps, drawn, tail, x, w, u, tokens, hidden, vocab, c.k, n, c.head)
				be.wait()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					be.LMHeadSample(ids, lps, drawn, tail, x, w, u, tokens, hidden, vocab, c.k, n, c.head)
				}
				be.wait()
				s := b.Elapsed().Seconds()
				b.ReportMetric(2*float64(tokens)*float64(hidden)*float64(vocab)*float64(b.N)/s/1e12, "TFLOP/s")
				b.ReportMetric(float64(tokens*b.N)/s, "tokens/s")
			})
		}
		for _, t := range []compute.Tensor{w, x, ids, lps, u, drawn, tail} {
			be.Free(t)
		}
	}
}

// benchShape is a Qwen3-shaped decoder for the forward benchmark; with
// Experts set, a Qwen3-MoE one (every layer's MLP Experts experts of width
// MoEInter, TopK a token, normalized top-k weights).
type benchShape struct {
	Name                                      string
	Vocab, Hidden, Layers, Heads, KVHeads, HD int
	Inter                                     int
	Tied                                      bool
	Experts, TopK, MoEInter                   int  `json:",omitempty"`
	OptIn                                     bool `json:",omitempty"` // run only when DISTILL_BENCH_SHAPES names it
}

var benchShapes = []benchShape{
	{Name: "qwen3-0.6b", Vocab: 151936, Hidden: 1024, Layers: 28, Heads: 16, KVHeads: 8, HD: 128, Inter: 3072, Tied: true},
	{Name: "qwen3-1.7b", Vocab: 151936, Hidden: 2048, Layers: 28, Heads: 16, KVHeads: 8, HD: 128, Inter: 6144, Tied: true},
	{Name: "qwen3-8b", Vocab: 151936, Hidden: 4096, Layers: 36, Heads: 32, KVHeads: 8, HD: 128, Inter: 12288},
	// 61 GB of BF16 weights: only where named.
	{Name: "qwen3-30b-a3b", Vocab: 151936, Hidden: 2048, Layers: 48, Heads: 32, KVHeads: 4, HD: 128, Inter: 6144,
		Experts: 128, TopK: 8, MoEInter: 768, OptIn: true},
}

// matmulParams counts the parameters that multiply each token: every
// layer's (a MoE layer's router and its top-k experts), and the LM head
// (the embedding lookup costs no FLOPs).
func (s benchShape) matmulParams() float64 {
	hq, hkv := s.Heads*s.HD, s.KVHeads*s.HD
	mlp := 3 * s.Hidden * s.Inter
	if s.Experts > 0 {
		mlp = s.Experts*s.Hidden + s.TopK*3*s.Hidden*s.MoEInter
	}
	layer := s.Hidden*hq + 2*s.Hidden*hkv + hq*s.Hidden + mlp + 2*s.Hidden + 2*s.HD
	return float64(s.Layers*layer + s.Vocab*s.Hidden + s.Hidden)
}

// config is s as a Qwen3 (or Qwen3-MoE) model.Config.
func (s benchShape) config() *model.Config {
	c := &model.Config{Arch: model.ArchQwen3, VocabSize: s.Vocab, Hidden: s.Hidden, Layers: s.Layers,
		Heads: s.Heads, KVHeads: s.KVHeads, HeadDim: s.HD, Intermediate: s.Inter, MaxPositions: 40960,
		RMSNormEps: 1e-6, RopeTheta: 1e6, TieEmbeddings: s.Tied, QKNorm: true, BOSTokenID: -1, EOSTokenID: -1}
	if s.Experts > 0 {
		c.Arch, c.NumExperts, c.ExpertsPerTok, c.MoEIntermediate = model.ArchQwen3MoE, s.Experts, s.TopK, s.MoEInter
		c.DecoderSparseStep, c.NormTopKProb = 1, true
	}
	return c
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
	return newBenchStage(be, s, 0, s.Layers, false)
}

// newBenchModelWeights is newBenchModel, with fp8 the decoder layers'
// Linear weights quantized to FP8 per output channel (infer's --weights
// fp8: the same random BF16 values, then compute.QuantizeFP8).
func newBenchModelWeights(be compute.Backend, s benchShape, fp8 bool) *benchModel {
	return newBenchStage(be, s, 0, s.Layers, fp8)
}

// newBenchStage is newBenchModelWeights's stage of layers [first, end)
// of a pipeline (decoder.NewStage), its weights those the whole model's
// would be.
func newBenchStage(be compute.Backend, s benchShape, first, end int, fp8 bool) *benchModel {
	cfg := s.config()
	r := rand.New(rand.NewPCG(4, 4))
	bufs := map[int][]uint16{}
	specs := map[string]model.TensorSpec{}
	for _, ts := range cfg.Tensors() { // the buffers in one order, whatever a stage asks for
		specs[ts.Name] = ts
		n := 1
		for _, d := range ts.Shape {
			n *= d
		}
		if !ts.Norm && bufs[n] == nil {
			bufs[n] = randBF16(r, n, 0.02)
		}
	}
	bm := &benchModel{}
	quant := map[[2]int]*compute.FP8Matrix{}
	m, err := decoder.NewStage(cfg, be, func(name string) (compute.Tensor, compute.Tensor, error) {
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
		} else {
			h = bufs[n]
		}
		var w compute.Tensor
		var err error
		if fp8 && len(ts.Shape) == 2 && strings.HasPrefix(name, "model.layers.") && strings.HasSuffix(name, "_proj.weight") {
			key := [2]int{ts.Shape[0], ts.Shape[1]} // the layers share h: quantize each shape once
			q := quant[key]
			if q == nil {
				q, err = compute.QuantizeFP8(h, ts.Shape[0], ts.Shape[1])
				quant[key] = q
			}
			if err == nil {
				w, err = be.(compute.FP8Weights).WeightFP8(q)
			}
		} else {
			w, err = be.Weight(h)
		}
		if err == nil {
			bm.weights = append(bm.weights, w)
		}
		return w, nil, err
	}, first, end)
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
// one profiled pass to profile-<shape>-<workload>.txt. It also times the
// same forwards with the residual add as a pass of its own and with the
// LM head folding a GEMM tile a launch (residual_gemm_speedup,
// lm_fold_gemm_speedup: the older path's time over the newer's).
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
		if only != "" && !strings.Contains(only, s.Name) || only == "" && s.OptIn {
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
				// The same forwards with one switch flipped each, untimed
				// by the benchmark's clock: the residual add a pass of its
				// own (Options.ResidualAdd "separate", the old path) and
				// the LM head's fold a GEMM tile a launch (Options.LMFold
				// "gemm", opt-in); a ratio > 1: the newer path (the GEMM's
				// epilogue, k_lm_fold_gemm) is faster.
				for _, ab := range []struct {
					name  string
					flag  *bool
					isNew bool // the flag turns on the newer path
				}{{"residual_gemm", &be.sepResidual, false}, {"lm_fold_gemm", &be.lmFoldGEMM, true}} {
					*ab.flag = true
					m.forward(be, samples, 64)
					be.wait()
					t0 := time.Now()
					for i := 0; i < b.N; i++ {
						m.forward(be, samples, 64)
					}
					be.wait()
					*ab.flag = false
					ratio := time.Since(t0).Seconds() / float64(b.N) / sec
					if ab.isNew {
						ratio = 1 / ratio
					}
					b.ReportMetric(ratio, ab.name+"_speedup")
				}
				if outDir != "" {
					writeForwardProfile(be, filepath.Join(outDir, fmt.Sprintf("profile-%s-%s.txt", s.Name, name)),
						fmt.Sprintf("%s workload %s (%d tokens)", s.Name, name, n), sec, 15, func() { m.forward(be, samples, 64) })
				}
			})
		}
		freeBenchModel(be, m)
	}
}

// writeForwardProfile runs forward once with the profile on and writes
// to file its kernels' time and span (what, a forward's name; sec, its
// unprofiled seconds), the host's timeline and the top kernels.
func writeForwardProfile(be *Backend, file, what string, sec float64, top int, forward func()) {
	be.SetProfile(true)
	p0 := time.Now()
	forward()
	p1 := time.Now()
	tl := be.HostTimeline()
	var sb strings.Builder
	var sum float64
	prof := be.Profile()
	span := be.ProfileSpan()
	be.SetProfile(false)
	for _, e := range prof {
		sum += e.Time.Seconds()
	}
	fmt.Fprintf(&sb, "%s: one profiled forward, %.1f ms in kernels over a span of %.1f ms (the GPU idle %.1f ms between them)\n",
		what, 1e3*sum, 1e3*span.Seconds(), 1e3*(span.Seconds()-sum))
	// What the span leaves out: the host's work before the first kernel
	// (the batch's tables and uploads) and after the last (the top-k's
	// download), from the timed passes.
	fmt.Fprintf(&sb, "a forward took %.1f ms unprofiled (the timed passes): %.1f ms of it outside the profiled span\n",
		1e3*sec, 1e3*(sec-span.Seconds()))
	fmt.Fprintln(&sb, tl.Describe("forward", p0, p1))
	for i, e := range prof {
		if i == top {
			break
		}
		fmt.Fprintf(&sb, "%6.1f%% %9.2f ms %6d calls  %s\n", 100*e.Time.Seconds()/sum, 1e3*e.Time.Seconds(), e.Calls, e.Name)
	}
	os.WriteFile(file, []byte(sb.String()), 0o644)
}

// BenchmarkForwardFP8: the teacher's forward with FP8 weights (W8A8,
// --weights fp8) against the same shape's BF16 weights, on the same GPU in
// the same run, one forward of each in turn per iteration: workload b
// (log-normal sample lengths, 16k tokens, DISTILL_BENCH_TOKENS), k = 64,
// the Qwen3-8B shape (DISTILL_BENCH_SHAPES picks others). It reports
// each one's tokens/s, FP8's speed-up, and the device memory each
// model's weights took (the pool's growth while it loaded).
// fp8_tokens/s scales the FP8 sums in a pass of their own (k_fp8_scale,
// Options.FP8Scale "epilogue"); where cuBLASLt has outer-vector scales
// (12.9 or later, fp8.go), a third forward per iteration scales them in
// cuBLASLt's epilogue (the default): fp8_outer_tokens/s and
// outer_vs_epilogue, the A/B of the two in the same run, and
// fp8_speedup is the default's. A fourth forward
// runs the FP8 GEMMs with cuBLASLt's FAST_ACCUM on (Options.FP8FastAccum):
// fp8_fastaccum_tokens/s (TestForwardGoldensFP8's act=bf16/fastaccum
// case says what it costs in fidelity).
func BenchmarkForwardFP8(b *testing.B) {
	tokens := 16384
	if v, err := strconv.Atoi(os.Getenv("DISTILL_BENCH_TOKENS")); err == nil {
		tokens = v
	}
	only := os.Getenv("DISTILL_BENCH_SHAPES")
	if only == "" {
		only = "qwen3-8b"
	}
	be := benchBackend(b, false)
	lens := benchWorkloads(tokens)["b"]
	for _, s := range benchShapes {
		if !strings.Contains(only, s.Name) {
			continue
		}
		loaded := func(fp8 bool) (*benchModel, float64) {
			be.wait()
			free0, _ := be.MemInfo()
			m := newBenchModelWeights(be, s, fp8)
			be.wait()
			free1, _ := be.MemInfo()
			return m, float64(free0-free1) / (1 << 30)
		}
		mb, gb := loaded(false)
		mf, gf := loaded(true)
		r := rand.New(rand.NewPCG(6, 6))
		samples := make([][]int32, len(lens))
		n := 0
		for i, l := range lens {
			samples[i] = make([]int32, l)
			for j := range samples[i] {
				samples[i][j] = int32(r.IntN(s.Vocab))
			}
			n += l
		}
		b.Run(fmt.Sprintf("%s/workload_b/%d_samples_%d_tokens", s.Name, len(lens), n), func(b *testing.B) {
			outer := be.lt.version >= ltOuterVecVersion
			ov0, fast0 := be.fp8OuterVec, be.fp8FastAccum
			defer func() { be.fp8OuterVec, be.fp8FastAccum = ov0, fast0 }()
			vectors := func(on bool) { be.fp8OuterVec = on }
			fast := func(on bool) { be.fp8FastAccum = on }
			vectors(false)
			fast(false)
			mb.forward(be, samples, 64) // warm up: plans, pool, weight copies
			mf.forward(be, samples, 64)
			if outer {
				vectors(true)
				mf.forward(be, samples, 64)
				vectors(false)
			}
			fast(true)
			mf.forward(be, samples, 64)
			fast(false)
			var tb, tf, te, ta time.Duration
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				mb.forward(be, samples, 64) // returns with the top-k on the host: synchronized
				t1 := time.Now()
				mf.forward(be, samples, 64)
				t2 := time.Now()
				tb, tf = tb+t1.Sub(t0), tf+t2.Sub(t1)
				if outer {
					vectors(true)
					mf.forward(be, samples, 64)
					vectors(false)
					te += time.Since(t2)
				}
				t3 := time.Now()
				fast(true)
				mf.forward(be, samples, 64)
				fast(false)
				ta += time.Since(t3)
			}
			rb, rf := float64(n*b.N)/tb.Seconds(), float64(n*b.N)/tf.Seconds()
			b.ReportMetric(rb, "bf16_tokens/s")
			b.ReportMetric(rf, "fp8_tokens/s")
			speedup := rf / rb // the default's: the outer vectors where cuBLASLt has them
			if outer {
				speedup = float64(n*b.N) / te.Seconds() / rb
			}
			b.ReportMetric(speedup, "fp8_speedup")
			b.ReportMetric(gb, "bf16_weights_GiB")
			b.ReportMetric(gf, "fp8_weights_GiB")
			b.ReportMetric(float64(n*b.N)/ta.Seconds(), "fp8_fastaccum_tokens/s")
			if outer {
				ro := float64(n*b.N) / te.Seconds()
				b.ReportMetric(ro, "fp8_outer_tokens/s")
				b.ReportMetric(ro/rf, "outer_vs_epilogue")
			} else {
				b.Logf("cuBLASLt %d: no outer-vector scales (12.9 and later) to time", be.lt.version)
			}
			if outDir := os.Getenv("DISTILL_BENCH_OUT"); outDir != "" { // where the time goes, each side
				type side struct {
					name  string
					m     *benchModel
					sec   float64
					outer bool
				}
				sides := []side{{"bf16", mb, tb.Seconds() / float64(b.N), false}, {"fp8", mf, tf.Seconds() / float64(b.N), false}}
				if outer {
					sides = append(sides, side{"fp8-outer", mf, te.Seconds() / float64(b.N), true})
				}
				for _, c := range sides {
					vectors(c.outer)
					writeForwardProfile(be, filepath.Join(outDir, fmt.Sprintf("profile-%s-%s.txt", s.Name, c.name)),
						fmt.Sprintf("%s %s weights, workload b (%d tokens)", s.Name, c.name, n), c.sec, 20, func() { c.m.forward(be, samples, 64) })
					vectors(false)
				}
			}
		})
		freeBenchModel(be, mb)
		freeBenchModel(be, mf)
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
	for _, s := range []benchShape{
		{Name: "tiny", Vocab: 5000, Hidden: 128, Layers: 2, Heads: 4, KVHeads: 2, HD: 64, Inter: 256},
		{Name: "tiny-moe", Vocab: 5000, Hidden: 128, Layers: 2, Heads: 4, KVHeads: 2, HD: 64, Inter: 256, Experts: 16, TopK: 4, MoEInter: 64},
	} {
		t.Run(s.Name, func(t *testing.T) { testBenchModel(t, be, s) })
	}
}

// TestBenchModelFP8: BenchmarkForwardFP8's FP8 model runs on this backend
// and agrees with the CPU's FP8 model as TestForwardGoldensFP8's bounds
// say (FP8's boundaries amplify the BF16 attention's differences): the
// benchmark times a forward that computes the right thing.
func TestBenchModelFP8(t *testing.T) {
	be := testBackend(t)
	s := benchShape{Name: "tiny-moe", Vocab: 5000, Hidden: 128, Layers: 2, Heads: 4, KVHeads: 2, HD: 64, Inter: 256, Experts: 16, TopK: 4, MoEInter: 64}
	r := rand.New(rand.NewPCG(7, 7))
	samples := [][]int32{make([]int32, 70), make([]int32, 5), make([]int32, 130)}
	for _, smp := range samples {
		for j := range smp {
			smp[j] = int32(r.IntN(s.Vocab))
		}
	}
	const k = 8
	gID, gLP := newBenchModelWeights(be, s, true).forward(be, samples, k)
	cID, cLP := newBenchModelWeights(oracle, s, true).forward(oracle, samples, k)
	_, bLP := newBenchModelWeights(oracle, s, false).forward(oracle, samples, k)
	var a agreement
	moved := 0.0
	for p := 0; p < len(gID)/k; p++ {
		want := make([]float64, k)
		for j := range want {
			want[j] = float64(cLP[p*k+j])
			moved = max(moved, math.Abs(float64(cLP[p*k+j]-bLP[p*k+j])))
		}
		a.add(gID[p*k:(p+1)*k], gLP[p*k:(p+1)*k], cID[p*k:(p+1)*k], want, 0.05)
	}
	t.Logf("FP8 bench model vs FP8 cpu: %s; FP8 vs BF16 on the cpu: max |Δ| %.3g", &a, moved)
	if float64(a.top1) < 0.78*float64(a.positions) || a.maxDelta > 0.35 || moved == 0 {
		t.Errorf("FP8 bench model vs cpu: %s (FP8 moved the CPU's log-probs by %.3g)", &a, moved)
	}
}

func testBenchModel(t *testing.T, be *Backend, s benchShape) {
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
