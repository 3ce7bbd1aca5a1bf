package cuda

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"distill/compute"
	"distill/infer"
)

// The FP8 weights' tests (fp8.go): the device's quantization against
// compute's host definition bit for bit, MatMul and MoE against the CPU
// backend's FP8 within fp32 accumulation order, the teacher's forward of
// the golden checkpoints. TestFP8 in the GPU suite's pattern runs them
// all on the GPU (FP8 tensor cores: Ada or Hopper).

// quantRowsOnDevice runs k_fp8_quant_rows over x (rows, cols) and returns
// the codes and scales.
func quantRowsOnDevice(b *Backend, x compute.Tensor, rows, cols int) ([]uint8, []float32) {
	codes, scales := make([]uint8, rows*cols), make([]float32, rows)
	func() {
		defer b.enter()()
		xt := b.ten(x, "x")
		dc, ds := b.alloc(int64(rows*cols)), b.alloc(int64(rows)*4)
		b.launchKernel(launch{kernel: "k_fp8_quant_rows", grid: [3]int{rows, 1, 1}, block: 256}, dptr(dc), dptr(ds), dptr(xt.p), bf16Flag(xt), int32(cols))
		b.download(unsafe.Pointer(&codes[0]), dc, int64(rows*cols))
		b.download(unsafe.Pointer(&scales[0]), ds, int64(rows)*4)
		b.free(dc)
		b.free(ds)
	}()
	return codes, scales
}

// TestFP8QuantRows holds k_fp8_quant_rows to compute.FP8QuantizeRow bit
// for bit (codes and scales): a row of amax 448 (scale 1) holding every
// E4M3 value, every midpoint between neighbours (ties to even), a ulp
// either side of each, values beyond 448 after scaling cannot occur, so
// saturation is the amax's own code; random rows of random amax
// (subnormal codes included); an all-zero row (scale 1); a row with a NaN
// (every code NaN, as Go's max propagates it); F32 and BF16 inputs.
func TestFP8QuantRows(t *testing.T) {
	b := testBackend(t)
	var special []float32
	for c := 0; c < 0x7f; c++ {
		v := compute.E4M3Value(uint8(c))
		special = append(special, v, -v)
		if c+1 < 0x7f {
			mid := (v + compute.E4M3Value(uint8(c+1))) / 2
			special = append(special, mid, -mid, math.Nextafter32(mid, 0), math.Nextafter32(mid, 1000))
		}
	}
	cols := len(special)
	r := rand.New(rand.NewPCG(29, 1))
	rows := [][]float32{special}
	for i := 0; i < 5; i++ {
		row := make([]float32, cols)
		sc := math.Pow(2, float64(r.IntN(40)-20))
		for j := range row {
			row[j] = float32(r.NormFloat64() * sc * math.Pow(2, float64(r.IntN(12)-6)))
		}
		rows = append(rows, row)
	}
	rows = append(rows, make([]float32, cols))
	nanRow := make([]float32, cols)
	copy(nanRow, special)
	nanRow[7] = float32(math.NaN())
	rows = append(rows, nanRow)
	var x []float32
	for _, row := range rows {
		x = append(x, row...)
	}
	for _, bf := range []bool{false, true} {
		xs := x
		var xt compute.Tensor
		if bf {
			xs, _ = roundBF16(x)
			xt = b.New(compute.BF16, len(x))
			b.WriteF32(xt, xs)
		} else {
			xt = b.FromF32(x)
		}
		codes, scales := quantRowsOnDevice(b, xt, len(rows), cols)
		want := make([]uint8, cols)
		for i := range rows {
			s := compute.FP8QuantizeRow(want, xs[i*cols:(i+1)*cols])
			if math.Float32bits(s) != math.Float32bits(scales[i]) && !(s != s && scales[i] != scales[i]) {
				t.Fatalf("bf16 %v row %d: scale %v, host %v", bf, i, scales[i], s)
			}
			for j, c := range want {
				if got := codes[i*cols+j]; got != c {
					t.Fatalf("bf16 %v row %d col %d (%v): code %#02x, host %#02x", bf, i, j, xs[i*cols+j], got, c)
				}
			}
		}
	}
}

// fp8Weight quantizes w (n,k) and uploads it to be.
func fp8Weight(t *testing.T, be compute.Backend, w []float32, n, k int) compute.Tensor {
	t.Helper()
	q, err := compute.QuantizeFP8(w, n, k)
	if err != nil {
		t.Fatal(err)
	}
	wt, err := be.(compute.FP8Weights).WeightFP8(q)
	if err != nil {
		t.Fatal(err)
	}
	return wt
}

// TestMatMulFP8Conformance: the FP8 MatMul (cuBLASLt's E4M3 GEMM and the
// scaling epilogue) against the CPU's FP8 MatMul on the same inputs, which
// quantize to the same codes: on the emulator they differ by the fp32
// accumulation's order and where the scales multiply, bounded by
// 4e-6·Σ|terms| (k ≤ 512 fp32 sums of exact products) beside the F32 out;
// on a GPU by the FP8 tensor cores' narrower accumulation (see the bound);
// a BF16 out adds its rounding. Several slabs (m > fp8SlabRows), biases, F32 and BF16 x and
// out. It also checks that FP8 ran: the result is farther from the BF16
// weights' MatMul than the tolerance.
//
// Both places the scales multiply run each case (fp8.go): cuBLASLt's
// outer-vector epilogue (the default, where cuBLASLt is 12.9 or later;
// the emulator's is) and k_fp8_scale over fp32 sums (Options.FP8Scale
// "epilogue"), each held to the CPU; on the emulator they are the
// same bits, and the outer vectors' profile has no k_fp8_scale for a
// Linear without a bias.
func TestMatMulFP8Conformance(t *testing.T) {
	outer, ep := testBackendWith(t, Options{Profile: true}), testBackendWith(t, Options{Profile: true, FP8Scale: "epilogue"})
	if !onGPU() && !outer.fp8OuterVec {
		t.Fatal("the emulator's cuBLASLt (99.0) should take the outer-vector scales")
	}
	if !outer.fp8OuterVec {
		t.Logf("cuBLASLt %d: no outer-vector scales (12.9 and later have them); both sides run the epilogue", outer.lt.version)
	}
	r := rand.New(rand.NewPCG(8, 29))
	cases := []struct {
		m, n, k        int
		bias, xbf, obf bool
	}{
		{37, 48, 64, false, false, false},
		{37, 48, 64, true, true, true},
		{5, 16, 512, true, false, true},
		{fp8SlabRows + 45, 32, 32, true, true, false},
		{37, 144, 208, false, false, false}, // k and n not powers of two (an MoE expert's)
		{113, 208, 144, false, false, false},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("m%d_n%d_k%d_bias%v_xbf%v_obf%v", c.m, c.n, c.k, c.bias, c.xbf, c.obf), func(t *testing.T) {
			x, w := randF32(r, c.m*c.k), randF32(r, c.n*c.k)
			for i := range x { // rows of different magnitudes: per-row scales
				x[i] *= float32(math.Pow(2, float64(i/c.k%9-4)))
			}
			if c.xbf {
				x, _ = roundBF16(x)
			}
			var bias []float32
			if c.bias {
				bias = randF32(r, c.n)
			}
			run := func(be compute.Backend, fp8 bool) []float32 {
				var xt, bt compute.Tensor
				xt = be.FromF32(x)
				if c.xbf && be.ActDType() == compute.BF16 {
					xt = be.New(compute.BF16, len(x))
					be.WriteF32(xt, x)
				}
				if bias != nil {
					bt = be.FromF32(bias)
				}
				var wt compute.Tensor
				if fp8 {
					wt = fp8Weight(t, be, w, c.n, c.k)
				} else {
					_, h := roundBF16(w)
					var err error
					if wt, err = be.Weight(h); err != nil {
						t.Fatal(err)
					}
				}
				dt := compute.F32
				if c.obf && be.ActDType() == compute.BF16 {
					dt = compute.BF16
				}
				out := be.New(dt, c.m*c.n)
				be.MatMul(out, xt, wt, bt, c.m, c.n, c.k)
				return readF32(be, out, c.m*c.n)
			}
			want := run(oracle, true)
			outer.Profile() // reset
			got := run(outer, true)
			scales := profileCalls(outer)["k_fp8_scale"]
			switch byEpilogue := c.bias || !outer.fp8OuterVec; {
			case !byEpilogue && scales != 0:
				t.Fatalf("outer-vector scales: %d k_fp8_scale launches, want none", scales)
			case byEpilogue && scales == 0:
				t.Fatal("the epilogue path (a bias, or no outer vectors) launched no k_fp8_scale")
			}
			gotEp := run(ep, true)
			if profileCalls(ep)["k_fp8_scale"] == 0 {
				t.Fatal(`the default FP8 scaling launched no k_fp8_scale`)
			}
			if !onGPU() {
				same(t, "fp8 matmul, outer-vector scales vs the epilogue", got, gotEp)
			}
			be := outer
			var sumAbs float64 // Σ|x||w| over a row's terms, the largest
			for i := 0; i < c.m; i++ {
				var rowMax float32
				for _, v := range x[i*c.k : (i+1)*c.k] {
					rowMax = max(rowMax, float32(math.Abs(float64(v))))
				}
				for j := 0; j < c.n; j++ {
					var s float64
					for q := 0; q < c.k; q++ {
						s += math.Abs(float64(x[i*c.k+q]) * float64(w[j*c.k+q]))
					}
					sumAbs = max(sumAbs, s)
				}
			}
			atol, rtol := 4e-6*sumAbs, 1e-6
			if onGPU() {
				// Hopper's FP8 tensor cores add a step's products at a
				// narrower precision than fp32 (aligned to the largest,
				// about 13 bits kept below it), even with cuBLASLt's
				// FAST_ACCUM off: the H200 (2026-11-27) differed from the
				// CPU's exact sums by up to 1.1e-4·Σ|terms| (m37 n48 k64)
				// and 4.7e-5·Σ|terms| (k32). 2^-11·Σ|terms| bounds that
				// with a margin and stays far below what FP8's rounding of
				// x moves (the check against the BF16 weights below).
				atol = sumAbs / 2048
			}
			if c.obf {
				rtol = 1.0 / 256 // one BF16 rounding of the result
			}
			closeTo(t, "fp8 matmul vs cpu", got, want, atol, rtol)
			closeTo(t, "fp8 matmul (epilogue) vs cpu", gotEp, want, atol, rtol)
			bf := run(be, false)
			var moved float64
			for i := range bf {
				moved = max(moved, math.Abs(float64(got[i]-bf[i]))-(atol+rtol*math.Abs(float64(bf[i]))))
			}
			if moved <= 0 {
				t.Fatal("the FP8 MatMul is within the tolerance of the BF16 weights' MatMul everywhere: FP8 did not run")
			}
		})
	}
}

// fp8Weights is the weight maker of an FP8 MoE case on be, fresh for each
// run: the router in BF16 (F32 on the oracle), the experts' matrices
// quantized per output channel. c.run asks for the router, then each
// expert's gate, up and down in turn, so every third expert matrix is a
// down_proj (H rows); E, H and I must tell the router from the experts
// and gate from down.
func (c *moeCase) fp8Weights(t *testing.T, be compute.Backend) func([]float32) compute.Tensor {
	t.Helper()
	if c.H == c.I || c.E == c.I {
		t.Fatalf("H %d, I %d, E %d: the weight shapes would be ambiguous", c.H, c.I, c.E)
	}
	n := 0
	return func(s []float32) compute.Tensor {
		if len(s) == c.E*c.H { // the router: not quantized
			if be == compute.Backend(oracle) {
				return oracle.FromF32(s)
			}
			_, h := roundBF16(s)
			w, err := be.Weight(h)
			if err != nil {
				t.Fatal(err)
			}
			return w
		}
		n++
		rows := c.I
		if n%3 == 0 {
			rows = c.H
		}
		return fp8Weight(t, be, s, rows, len(s)/rows)
	}
}

// TestMoEFP8Conformance: an MoE block with FP8 experts against the CPU's:
// the same routing (fp32 router, unquantized), x's token rows and the
// experts' fp32 SwiGLU outputs quantized to the same codes, per-expert
// FP8 GEMMs; the outputs within fp32 accumulation order. (A gate or up
// sum that lands within rounding of an E4M3 tie could quantize h one code
// apart: the tolerance allows a few such codes' worth.)
func TestMoEFP8Conformance(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(29, 13))
	for _, cs := range []struct{ tokens, H, I, E, K int }{{50, 16, 32, 6, 2}, {37, 64, 48, 16, 4}} {
		t.Run(fmt.Sprintf("t%d_H%d_I%d_E%d_K%d", cs.tokens, cs.H, cs.I, cs.E, cs.K), func(t *testing.T) {
			c := newMoECase(r, cs.tokens, cs.H, cs.I, cs.E, cs.K, true)
			want := c.run(oracle, c.fp8Weights(t, oracle))
			got := c.run(be, c.fp8Weights(t, be))
			closeTo(t, "fp8 moe vs cpu", got, want, 2e-3*math.Sqrt(float64(cs.H*cs.I))/4, 1e-3)
		})
	}
}

// TestFP8WeightRefusals: shapes cuBLASLt's FP8 GEMM does not take are
// refused at load naming the requirement, and a backward through an FP8
// weight panics naming it.
func TestFP8WeightRefusals(t *testing.T) {
	be := testBackend(t)
	q, _ := compute.QuantizeFP8(make([]float32, 24*32), 24, 32)
	if _, err := be.WeightFP8(q); err == nil || !strings.Contains(err.Error(), "multiples of 16") {
		t.Errorf("(24, 32): err = %v", err)
	}
	w := fp8Weight(t, be, randF32(rand.New(rand.NewPCG(1, 2)), 16*16), 16, 16)
	defer func() {
		if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "f8e4m3") {
			t.Errorf("MatMulBackward through an FP8 weight: panic %v", r)
		}
	}()
	x, d := be.New(compute.F32, 16), be.New(compute.F32, 16)
	be.MatMulBackward(be.New(compute.F32, 16), nil, nil, d, x, w, 1, 16, 16)
}

// TestForwardGoldensFP8 runs the FP8 teacher (infer.LoadWith, weights
// fp8) of every golden checkpoint on this backend and on the CPU, with
// BF16 and fp32 activations. The FP8 GEMMs themselves agree with the
// CPU's closely (TestMatMulFP8Conformance, TestMoEFP8Conformance: fp32
// rounding on the emulator, the FP8 tensor cores' accumulation on a GPU),
// but the rest of the device's forward is not the CPU's fp32: attention
// and the LM head multiply BF16 operands in both activation modes, and
// BF16 activations round every GEMM input. An FP8 quantization turns such
// a small difference into a large one where it moves an element across an
// E4M3 rounding boundary (a share of about δ/2^-3 of the elements for a
// relative difference δ, each then off by a whole E4M3 step, 2^-3
// relative): on these checkpoints the two FP8 teachers differ about ten
// times as much as a BF16 forward differs from fp32 (TestForwardGoldens:
// max |Δ| 0.02-0.03, top-1 97-100%), on the order of what FP8 itself
// costs (the README's table: max |Δ| 0.18-0.30 against BF16). Measured
// on the H200 (2026-11-27): top-1 84-91%, mean |Δ| 0.024-0.032, max |Δ|
// 0.14-0.29, and 0.43 at one position of qwen3_moe with fp32
// activations: the max of 171 positions is one flip's cascade, so the
// bounds hold the mean tightly and the max loosely. A wrong scale or code
// is off by far more than either.
func TestForwardGoldensFP8(t *testing.T) {
	const minTop1, maxMean, maxAbs = 0.78, 0.06, 0.6
	// fastaccum: cuBLASLt's FAST_ACCUM on (Options.FP8FastAccum), held to
	// the same bounds: on a GPU, what the faster accumulation costs (the
	// emulator's sums are the same either way).
	for _, v := range []struct {
		name string
		opt  Options
	}{{"act=bf16", Options{Activations: "bf16"}}, {"act=f32", Options{Activations: "f32"}}, {"act=bf16/fastaccum", Options{Activations: "bf16", FP8FastAccum: true}},
		{"act=bf16/epilogue", Options{Activations: "bf16", FP8Scale: "epilogue"}}} {
		t.Run(v.name, func(t *testing.T) {
			be := testBackendWith(t, v.opt)
			for _, ck := range goldenDirs(t) {
				t.Run(filepath.Base(ck), func(t *testing.T) {
					a := fp8Agreement(t, be, ck)
					t.Logf("%s %s: FP8 %s vs FP8 cpu: %s", filepath.Base(ck), v.name, be.Name(), &a)
					if float64(a.top1) < minTop1*float64(a.positions) || a.sumDelta > maxMean*float64(a.entries) || a.maxDelta > maxAbs {
						t.Errorf("FP8 %s (%s) vs FP8 cpu: %s; want top-1 >= %g%%, mean |Δ| <= %g, max |Δ| <= %g", be.Name(), v.name, &a, 100*minTop1, maxMean, maxAbs)
					}
				})
			}
		})
	}
}

// fp8Agreement compares the FP8 teachers of checkpoint ck on be and on
// the CPU over its golden prompts at T=1.
func fp8Agreement(t *testing.T, be compute.Backend, ck string) agreement {
	var res [2][]infer.Result
	var g goldenFile
	b, err := os.ReadFile(filepath.Join(ck, "golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	for i, side := range []compute.Backend{be, oracle} {
		m, err := infer.LoadWith(ck, side, infer.LoadOptions{Weights: infer.WeightsFP8})
		if err != nil {
			t.Fatal(err)
		}
		if res[i], err = m.TopK(g.Samples, infer.Options{K: g.K}); err != nil {
			t.Fatal(err)
		}
	}
	var a agreement
	for s := range g.Samples {
		for p := range g.Samples[s] {
			want := make([]int32, g.K)
			wlp := make([]float64, g.K)
			for j := 0; j < g.K; j++ {
				want[j], wlp[j] = res[1][s].IDs[p*g.K+j], float64(res[1][s].LogProbs[p*g.K+j])
			}
			a.add(res[0][s].IDs[p*g.K:(p+1)*g.K], res[0][s].LogProbs[p*g.K:(p+1)*g.K], want, wlp, 0.05)
		}
	}
	return a
}

// TestFP8OuterVecFallback (emulator): the outer vectors only when asked
// for; asked for, a cuBLASLt older than 12.9 scales in k_fp8_scale from
// the start, saying so, and one whose heuristic refuses the outer vectors
// falls back at the first FP8 MatMul, says so once, and gives the same
// bits; an unknown Options.FP8Scale is refused, naming it.
func TestFP8OuterVecFallback(t *testing.T) {
	if onGPU() {
		t.Skip("the emulator's cuBLASLt versions and refusals")
	}
	r := rand.New(rand.NewPCG(8, 30))
	const m, n, k = 40, 48, 64
	x, w := randF32(r, m*k), randF32(r, n*k)
	mul := func(be *Backend) []float32 {
		out := be.New(compute.BF16, m*n)
		be.MatMul(out, be.FromF32(x), fp8Weight(t, be, w, n, k), nil, m, n, k)
		return readF32(be, out, m*n)
	}
	if def := testBackendWith(t, Options{}); !def.fp8OuterVec {
		t.Fatal("the default does not take the emulator's cuBLASLt 99.0 outer vectors")
	}
	ref := testBackendWith(t, Options{FP8Scale: "epilogue"})
	if ref.fp8OuterVec {
		t.Fatal("FP8Scale epilogue takes the outer vectors: want k_fp8_scale")
	}
	want := mul(ref)
	open := func(opt Options) (*Backend, *[]string) {
		var logged []string
		opt.KernelCache, opt.Profile = kernelCacheForTests(t), true
		opt.Logf = func(f string, a ...any) { logged = append(logged, fmt.Sprintf(f, a...)) }
		be, err := Open(opt)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { be.Close() })
		return be, &logged
	}

	t.Setenv("DISTILL_EMU_LT_VERSION", "120803")
	old, oldLog := open(Options{FP8Scale: "outer"})
	if old.fp8OuterVec || !strings.Contains(strings.Join(*oldLog, "\n"), "has no outer-vector scales") {
		t.Fatalf("cuBLASLt 12.8.3 asked for outer vectors: fp8OuterVec %v, log %q; want the epilogue, saying so", old.fp8OuterVec, *oldLog)
	}
	same(t, "cuBLASLt 12.8.3 vs the epilogue", mul(old), want)
	if profileCalls(old)["k_fp8_scale"] == 0 {
		t.Fatal("cuBLASLt 12.8.3: no k_fp8_scale launch")
	}

	t.Setenv("DISTILL_EMU_LT_VERSION", "")
	t.Setenv("DISTILL_EMU_LT_NO_OUTER_VEC", "1")
	refusing, logged := open(Options{FP8Scale: "outer"})
	if !refusing.fp8OuterVec {
		t.Fatal("before its first FP8 MatMul a cuBLASLt 99.0 should be taking the outer vectors")
	}
	same(t, "a cuBLASLt refusing outer vectors vs the epilogue", mul(refusing), want)
	same(t, "the second MatMul after the refusal", mul(refusing), want)
	if refusing.fp8OuterVec || profileCalls(refusing)["k_fp8_scale"] != 2 {
		t.Fatalf("after a refusal: fp8OuterVec %v, want false and 2 k_fp8_scale launches", refusing.fp8OuterVec)
	}
	if got := strings.Join(*logged, "\n"); strings.Count(got, "refused FP8 outer-vector scales") != 1 {
		t.Fatalf("log %q: want one line saying cuBLASLt refused the outer-vector scales", got)
	}

	if _, err := Open(Options{KernelCache: kernelCacheForTests(t), FP8Scale: "gemm"}); err == nil || !strings.Contains(err.Error(), `"gemm"`) {
		t.Fatalf("Open with FP8Scale gemm: %v, want an error naming it", err)
	}
}

// TestFP8ScratchBytes: an FP8 MatMul's and an FP8 MoE's scratch, measured
// by the pool's high-water mark, within forwardScratchBytes of the shape
// with FP8 set, and not loose (at most twice), as TestForwardScratchBytes
// holds the BF16 kernels; and the FP8 teacher's whole forward within
// infer's DeviceBytes.
func TestFP8ScratchBytes(t *testing.T) {
	// The sums in fp32 (FP8Scale "epilogue"): what a plan on paper
	// counts, not knowing the device's cuBLASLt.
	be := testBackendWith(t, Options{FP8Scale: "epilogue"})
	r := rand.New(rand.NewPCG(21, 29))
	scratch := func(call func()) int64 {
		be.ResetPeakMemory()
		base := be.PeakMemory()
		call()
		return be.PeakMemory() - base
	}
	check := func(name string, got int64, s compute.ForwardShape) {
		t.Helper()
		bound := forwardScratchBytes(s)
		t.Logf("%s: scratch %d bytes, bound %d", name, got, bound)
		if got > bound || 2*got < bound {
			t.Errorf("%s: the call took %d bytes of scratch; forwardScratchBytes says %d: want scratch <= bound <= 2·scratch", name, got, bound)
		}
	}
	// The up projection's shape (n = intermediate, k = hidden), the
	// largest of this model's Linears, over more rows than a slab, with
	// the sums in fp32 (the slab's fp32 sums are the largest scratch of
	// the shape). The outer-vector scales (the default)
	// keep only the codes, less than the BF16 MatMuls' operand copies the
	// bound also holds: at most the bound.
	m, n, k := fp8SlabRows+100, 4000, 16
	ms := compute.ForwardShape{Tokens: m, MaxLen: 1, K: 1, Hidden: k, Heads: 1, KVHeads: 1, HeadDim: 16, Intermediate: n, Vocab: 16, FP8: true}
	x, out, w := be.FromF32(randF32(r, m*k)), be.New(compute.BF16, m*n), fp8Weight(t, be, randF32(r, n*k), n, k)
	check("MatMul FP8", scratch(func() { be.MatMul(out, x, w, nil, m, n, k) }), ms)
	ov := testBackendWith(t, Options{})
	x, out, w = ov.FromF32(randF32(r, m*k)), ov.New(compute.BF16, m*n), fp8Weight(t, ov, randF32(r, n*k), n, k)
	ov.ResetPeakMemory()
	base := ov.PeakMemory()
	ov.MatMul(out, x, w, nil, m, n, k)
	if got, bound := ov.PeakMemory()-base, ov.ForwardScratchBytes(ms); got > bound {
		t.Errorf("MatMul FP8 (outer vectors): the call took %d bytes of scratch; ForwardScratchBytes says %d", got, bound)
	}

	// Experts of width 1024: their activations (h in F32, 5.2 MB) outgrow
	// the LM head's tile of this shape.
	T, H, I, E, K := 160, 64, 1024, 16, 8
	rw, _ := roundBF16(randF32(r, E*H))
	_, rh := roundBF16(rw)
	router, err := be.Weight(rh)
	if err != nil {
		t.Fatal(err)
	}
	mw := &compute.MoEWeights{Router: router, NumExperts: E, TopK: K, Hidden: H, Inter: I}
	for e := 0; e < E; e++ {
		mw.Gate = append(mw.Gate, fp8Weight(t, be, randF32(r, I*H), I, H))
		mw.Up = append(mw.Up, fp8Weight(t, be, randF32(r, I*H), I, H))
		mw.Down = append(mw.Down, fp8Weight(t, be, randF32(r, H*I), H, I))
	}
	be.MoE(be.New(compute.F32, T*H), be.FromF32(randF32(r, T*H)), mw, T) // the router's F32 copy, kept from the first call
	mx, mout := be.FromF32(randF32(r, T*H)), be.New(compute.F32, T*H)
	check("MoE FP8", scratch(func() { be.MoE(mout, mx, mw, T) }),
		compute.ForwardShape{Tokens: T, MaxLen: T, K: 8, Hidden: H, Heads: 1, KVHeads: 1, HeadDim: 16, Intermediate: 16, Vocab: 64,
			Experts: E, TopK: K, MoEIntermediate: I, FP8: true})

	for _, dir := range goldenDirs(t) {
		md, err := infer.LoadWith(dir, be, infer.LoadOptions{Weights: infer.WeightsFP8})
		if err != nil {
			t.Fatal(err)
		}
		md.Forward([][]int32{{0}}, 1, 1)
		samples := [][]int32{make([]int32, 150), make([]int32, 61)}
		for _, s := range samples {
			for j := range s {
				s[j] = int32(r.IntN(md.Cfg.VocabSize))
			}
		}
		got := scratch(func() { md.Forward(samples, 16, 1) })
		bound := md.DeviceBytes(211, 150, 16, 0)
		t.Logf("%s FP8 forward: peak %d bytes beside the weights, bound %d", filepath.Base(dir), got, bound)
		if got > bound || bound > 2*got {
			t.Errorf("%s FP8 forward: peak %d bytes, DeviceBytes %d: want peak <= bound <= 2·peak", filepath.Base(dir), got, bound)
		}
	}
}
