package cuda

import (
	"fmt"
	"unsafe"

	"distill/compute"
)

// FP8 weights (compute's package doc, "FP8 weights"): W8A8 on the FP8
// tensor cores. A weight is its E4M3 codes (n, k) and, after them, its n
// per-channel scales, in one allocation. MatMul quantizes x's rows
// (k_fp8_quant_rows: codes and a scale per row) and multiplies the codes
// in a cuBLASLt GEMM with CUDA_R_8F_E4M3 operands and fp32 accumulation
// (CUBLAS_COMPUTE_32F); each sum is then multiplied by its row's and its
// channel's scales (and the bias added), and a BF16 out rounded once.
//
// Where the scales multiply:
//   - by default (Options.FP8Scale "" or "outer"), on cuBLASLt 12.9 and
//     later: in the GEMM's epilogue, through "outer vector" scale modes
//     (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F on both operands: a
//     vector of fp32 scales per operand, D[r][c] = Σ · xs[r] · ws[c]),
//     D written in out's type. No fp32 copy of the sums exists and no
//     pass follows; the scratch is the rows' codes and scales.
//   - with Options.FP8Scale "epilogue", and before 12.9, where an FP8
//     GEMM takes one scalar scale per operand
//     (CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER), and the per-row ×
//     per-channel product is an outer product of two vectors: the GEMM
//     writes fp32 sums to a scratch and k_fp8_scale scales them into out,
//     one pass over the sums, in slabs of fp8SlabRows rows. A biased
//     Linear (Qwen2's q/k/v) takes this path either way: the bias is
//     added before out's one rounding. A cuBLASLt that refuses the outer
//     vectors at a shape's plan falls back to it, logged once.
//
// The two paths multiply the same fp32 sums by the same two scales; where
// cuBLASLt rounds the two products is its own, so they may differ in an
// fp32 ulp before out's rounding.
//
// cuBLASLt's documented requirements for FP8 (cublasLtMatmul, "FP8"): A
// transposed and B not ("TN": cuBLASLt's A is the weight (k, n)
// column-major used transposed, B the activations (k, m): the forward's
// x·wᵀ is exactly that, see plan), CUBLAS_COMPUTE_32F with a CUDA_R_32F
// scale type, and 16-byte aligned operands and leading dimensions: k (the
// codes' row length, both operands' leading dimension) and n (D's, in
// fp32) multiples of 16, which WeightFP8 checks at load. The GEMM's
// FAST_ACCUM attribute stays at its default, off: cuBLASLt then promotes
// the tensor cores' partial sums to fp32 registers as it goes, where the
// fast mode would keep Hopper's narrower accumulator for the whole k.
// Options.FP8FastAccum turns it on (TransformerEngine's forward GEMMs run
// so), for measuring what it gains and costs in fidelity on a device.
// FP8 tensor cores need compute capability 8.9 (Ada) or 9.0 (Hopper).

// dataE4M3 is CUDA_R_8F_E4M3 (library_types.h).
const dataE4M3 = 28

// fp8SlabRows bounds the rows of one FP8 GEMM: its scratch is at most
// fp8SlabRows·(k + 4 + 4n) bytes (the rows' codes, scales and fp32 sums),
// fp8SlabRows·(k + 4) with the outer-vector scales.
const fp8SlabRows = 2048

var _ compute.FP8Weights = (*Backend)(nil)

// fp8ScaleOffset is where an FP8 weight of n elements keeps its scales:
// after the codes, at a 256-byte boundary.
func fp8ScaleOffset(n int) uint64 { return (uint64(n) + 255) &^ 255 }

// WeightFP8 implements compute.FP8Weights.
func (b *Backend) WeightFP8(q *compute.FP8Matrix) (compute.Tensor, error) {
	defer b.enter()()
	if cc := b.info.Major*10 + b.info.Minor; cc < 89 {
		return nil, fmt.Errorf("cuda: FP8 weights need FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper); %s is sm_%d%d: load bf16 weights", b.info.Name, b.info.Major, b.info.Minor)
	}
	if q.Rows < 0 || q.Cols < 0 || len(q.Codes) != q.Rows*q.Cols || len(q.Scales) != q.Rows {
		return nil, fmt.Errorf("cuda: FP8 weight (%d, %d) with %d codes and %d scales", q.Rows, q.Cols, len(q.Codes), len(q.Scales))
	}
	if q.Rows%16 != 0 || q.Cols%16 != 0 {
		return nil, fmt.Errorf("cuda: FP8 weight of shape (%d, %d): cuBLASLt's FP8 GEMM needs both dimensions multiples of 16 (16-byte aligned rows); load bf16 weights", q.Rows, q.Cols)
	}
	n := q.Rows * q.Cols
	off := fp8ScaleOffset(n)
	t := &tensor{b: b, dt: compute.F8E4M3, n: n, weight: true}
	t.p = b.alloc(int64(off) + 4*int64(q.Rows))
	b.keep(t.p)
	if n > 0 {
		b.upload(t.p, unsafe.Pointer(&q.Codes[0]), int64(n))
		b.upload(t.p+off, unsafe.Pointer(&q.Scales[0]), 4*int64(q.Rows))
	}
	return t, nil
}

// fp8Scales is the address of an FP8 weight's per-channel scales.
func fp8Scales(w *tensor) uint64 { return w.p + fp8ScaleOffset(w.n) }

// matMulFP8 is MatMul with an FP8 w (n,k): slabs of at most fp8SlabRows
// rows, each quantized, multiplied and scaled (see the file's comment).
func (b *Backend) matMulFP8(out, x, w, bias *tensor, m, n, k int) {
	if w.n != n*k {
		panic(fmt.Sprintf("cuda: MatMul FP8 w has %d elements, the call multiplies (%d, %d): an FP8 weight's scales are per row of exactly its shape", w.n, n, k))
	}
	R := min(m, fp8SlabRows)
	outer := b.fp8OuterVec && bias == nil
	codes, xs := b.alloc(int64(R)*int64(k)), b.alloc(int64(R)*4)
	var acc uint64
	if !outer {
		acc = b.alloc(int64(R) * int64(n) * 4)
	}
	var bp dptr
	var bbf int32
	if bias != nil {
		bp, bbf = weightArg(bias)
	}
	outT := dataF32
	if out.dt == compute.BF16 {
		outT = dataBF16
	}
	xsz, osz := uint64(elemSize(x.dt)), uint64(elemSize(out.dt))
	for r0 := 0; r0 < m; r0 += R {
		nr := min(R, m-r0)
		b.launchKernel(launch{kernel: "k_fp8_quant_rows", grid: [3]int{nr, 1, 1}, block: 256},
			dptr(codes), dptr(xs), dptr(x.p+uint64(r0)*uint64(k)*xsz), bf16Flag(x), int32(k))
		o := out.p + uint64(r0)*uint64(n)*osz
		if outer && b.gemmOuterVec(o, outT, codes, w.p, xs, fp8Scales(w), nr, n, k) {
			continue
		}
		if acc == 0 { // the outer vectors refused at this shape: the epilogue from here on
			outer = false
			acc = b.alloc(int64(R) * int64(n) * 4)
		}
		b.gemmFP8Sums(acc, codes, w.p, nr, n, k)
		b.ew("k_fp8_scale", int64(nr)*int64(n), dptr(o), bf16Flag(out), dptr(acc), dptr(xs), dptr(fp8Scales(w)),
			bp, bbf, int64(nr), int32(n))
	}
	b.free(codes)
	b.free(xs)
	if acc != 0 {
		b.free(acc)
	}
}

// gemmFP8Sums enqueues acc (m,n) F32 = codes (m,k) · w (n,k)ᵀ, the FP8
// GEMM's unscaled sums (k_fp8_scale's input), with FAST_ACCUM as
// Options.FP8FastAccum says.
func (b *Backend) gemmFP8Sums(acc, codes, w uint64, m, n, k int) {
	b.gemmRun(gemmShape{m: m, n: n, k: k, in: dataE4M3, out: dataF32, tb: true, fastAccum: b.fp8FastAccum,
		align: [4]int{alignOf(w), alignOf(codes), alignOf(acc), alignOf(acc)}}, acc, acc, codes, w, 0)
}

// gemmOuterVec enqueues out (m,n) of type outT = (codes (m,k) · w (n,k)ᵀ)
// scaled by xs (m) per row and ws (n) per column in cuBLASLt's epilogue,
// and reports whether it did: a cuBLASLt that refuses the outer vectors
// at this shape (no algorithm, or the matmul's status) turns them off for the backend (logged),
// and the caller scales in k_fp8_scale.
func (b *Backend) gemmOuterVec(out uint64, outT int, codes, w, xs, ws uint64, m, n, k int) bool {
	p, err := b.gemmPlan(gemmShape{m: m, n: n, k: k, in: dataE4M3, out: outT, tb: true, outerVec: true, fastAccum: b.fp8FastAccum,
		align: [4]int{alignOf(w), alignOf(codes), alignOf(out), alignOf(out)}})
	if err == nil {
		done := b.timed("cublasLt GEMM (" + b.label + ")")
		err = b.lt.runScaled(b.ltH, p, out, codes, w, xs, ws, b.ws, b.stream) // a refusal here enqueues nothing
		done()
	}
	if err != nil {
		b.fp8OuterVec = false
		b.logf("cuda: cuBLASLt %d refused FP8 outer-vector scales (m=%d n=%d k=%d): %v; FP8 GEMMs scale their fp32 sums in a pass of their own from here on", b.lt.version, m, n, k, err)
		return false
	}
	return true
}

// moeFP8 reports whether mw's experts are FP8 weights: all or none (a mix
// is a caller's bug).
func (b *Backend) moeFP8(mw *compute.MoEWeights, what string) bool {
	n := 0
	for e := range mw.Gate {
		for _, t := range []compute.Tensor{mw.Gate[e], mw.Up[e], mw.Down[e]} {
			if b.ten(t, what+" expert").dt == compute.F8E4M3 {
				n++
			}
		}
	}
	if n != 0 && n != 3*len(mw.Gate) {
		panic(fmt.Sprintf("cuda: %s with %d of its %d expert weights in FP8: want all or none", what, n, 3*len(mw.Gate)))
	}
	return n > 0
}

// moeExpertsFP8 runs an MoE block's FP8 experts over the grouped rows
// (the host's grouping, plan): x's token rows quantized once and gathered
// into the experts' order, gate and up as one FP8 GEMM per expert scaled
// in place (fp32), h = silu(gate)·up in fp32 over gate, quantized per
// row, and down into y (fp32), as compute/cpu's moeForward computes them.
func (b *Backend) moeExpertsFP8(gate, up, y uint64, x *tensor, order uint64, mw *compute.MoEWeights, plan moePlan, T, K, H, I int, what string) {
	P := T * K
	tc, ts := b.alloc(int64(T)*int64(H)), b.alloc(int64(T)*4)
	b.launchKernel(launch{kernel: "k_fp8_quant_rows", grid: [3]int{T, 1, 1}, block: 256}, dptr(tc), dptr(ts), dptr(x.p), bf16Flag(x), int32(H))
	codes, xs := b.alloc(int64(P)*int64(max(H, I))), b.alloc(int64(P)*4)
	b.ew("k_fp8_gather", int64(P)*int64(H), dptr(codes), dptr(xs), dptr(tc), dptr(ts), dptr(order), int64(P), int32(K), int32(H))
	b.free(tc)
	b.free(ts)
	expert := func(ws []compute.Tensor, e int, name string, out uint64, n, k int) {
		off, cnt := uint64(plan.offsets[e]), int(plan.offsets[e+1]-plan.offsets[e])
		if cnt == 0 {
			return
		}
		w := b.ten(ws[e], fmt.Sprintf("%s expert %d %s", what, e, name))
		need(w, fmt.Sprintf("%s expert %d %s", what, e, name), n*k, compute.F8E4M3)
		o := out + off*uint64(n)*4
		b.gemmTo(o, dataF32, codes+off*uint64(k), w.p, cnt, n, k, false, true, dataE4M3, 0)
		b.ew("k_fp8_scale", int64(cnt)*int64(n), dptr(o), int32(0), dptr(o), dptr(xs+off*4), dptr(fp8Scales(w)), dptr(0), int32(0), int64(cnt), int32(n))
	}
	for e := range mw.Gate {
		expert(mw.Gate, e, "gate", gate, I, H)
		expert(mw.Up, e, "up", up, I, H)
	}
	n := int64(P) * int64(I)
	b.ew("k_swiglu", n, dptr(gate), int32(0), dptr(gate), int32(0), dptr(up), int32(0), n) // h over gate
	b.launchKernel(launch{kernel: "k_fp8_quant_rows", grid: [3]int{P, 1, 1}, block: 256}, dptr(codes), dptr(xs), dptr(gate), int32(0), int32(I))
	for e := range mw.Down {
		expert(mw.Down, e, "down", y, H, I)
	}
	b.free(codes)
	b.free(xs)
}

// moeExpertsFP8Grouped is moeExpertsFP8 on the device's grouping g, with no
// host wait and a launch a projection however many experts: x's token rows
// quantized once and read in place through the order, gate and up with the
// SwiGLU in one launch (k_moe_gemm_fp8_glu: h in fp32, each product scaled
// by its row's and channel's scales first, as k_fp8_scale), h quantized per
// row, and down into y (k_moe_gemm_fp8). The same arithmetic per element
// as the per-expert path; the sums' order is the tensor cores' (m16n8k32
// steps in ascending k) instead of cuBLASLt's.
func (b *Backend) moeExpertsFP8Grouped(y uint64, x *tensor, order uint64, mw *compute.MoEWeights, g moeGroups, T, K, H, I int, what string) {
	P := T * K
	ops := &moeOperands{devScratch: devScratch{b: b}, what: what}
	defer ops.release()
	arrays := func(ws []compute.Tensor, name string, n int) (codes, scales uint64) {
		c, s := make([]uint64, len(ws)), make([]uint64, len(ws))
		for e, t := range ws {
			w := b.ten(t, fmt.Sprintf("%s expert %d %s", what, e, name))
			need(w, fmt.Sprintf("%s expert %d %s", what, e, name), n, compute.F8E4M3)
			c[e], s[e] = w.p, fp8Scales(w)
		}
		return ops.array(c), ops.array(s)
	}
	gc, gs := arrays(mw.Gate, "gate", I*H)
	uc, us := arrays(mw.Up, "up", I*H)
	dc, ds := arrays(mw.Down, "down", H*I)
	tc, ts := b.alloc(int64(T)*int64(H)), b.alloc(int64(T)*4)
	b.launchKernel(launch{kernel: "k_fp8_quant_rows", grid: [3]int{T, 1, 1}, block: 256}, dptr(tc), dptr(ts), dptr(x.p), bf16Flag(x), int32(H))
	h := b.alloc(int64(P) * int64(I) * 4)
	b.launchKernel(launch{kernel: "k_moe_gemm_fp8_glu", grid: moeFlatGrid(g, I, moeBN/2), block: 256, smem: moeFP8Smem},
		dptr(h), dptr(tc), dptr(ts), dptr(order), int32(K), dptr(gc), dptr(gs), dptr(uc), dptr(us), dptr(g.offsets), dptr(g.tileStart), int32(g.E), int32(I), int32(H))
	b.free(tc)
	b.free(ts)
	codes, xs := b.alloc(int64(P)*int64(I)), b.alloc(int64(P)*4)
	b.launchKernel(launch{kernel: "k_fp8_quant_rows", grid: [3]int{P, 1, 1}, block: 256}, dptr(codes), dptr(xs), dptr(h), int32(0), int32(I))
	b.free(h)
	b.launchKernel(launch{kernel: "k_moe_gemm_fp8", grid: moeFlatGrid(g, H, moeBN), block: 256, smem: moeFP8Smem},
		dptr(y), dptr(codes), dptr(xs), dptr(0), int32(1), dptr(dc), dptr(ds), dptr(g.offsets), dptr(g.tileStart), int32(g.E), int32(H), int32(I))
	b.free(codes)
	b.free(xs)
}

// mmaE4M3 reports whether the kernels can multiply E4M3 codes on the tensor
// cores (mma.sync m16n8k32 .e4m3): an sm_89 or newer GPU, kernels compiled
// by NVRTC 12.4 or newer (PTX ISA 8.4). Otherwise an FP8 MoE runs its
// experts through cuBLASLt, one expert at a time (moeExpertsFP8), on the
// emulator only: on a GPU that path disagreed with the CPU (the H200,
// 2026-11-27, TestMoEFP8Grouped) and moeForward refuses it.
func (b *Backend) mmaE4M3() bool {
	if testOldNVRTC {
		return false
	}
	return b.info.Major*10+b.info.Minor >= 89 && (b.nv.major > 12 || b.nv.major == 12 && b.nv.minor >= 4)
}

// testOldNVRTC makes mmaE4M3 false, as an NVRTC older than 12.4 does.
var testOldNVRTC bool

// moeFP8Smem is k_moe_gemm_fp8's shared memory (moe.cu: MOE_STAGES stages
// of an A and a W tile of 128 rows of MOE_F8_BK+16 bytes).
const moeFP8Smem = moeStages * 2 * moeBM * (64 + 16)
