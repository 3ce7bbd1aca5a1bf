package cuda

import (
	"fmt"

	"distill/compute"
)

// The kernels of compute.Backend. Each mirrors compute/cpu's method of the
// same name (the oracle in the tests) and enqueues work on the stream
// without waiting for it; shapes are checked against the tensors first, so
// a caller's mistake panics with what is wrong instead of reading or
// writing past a buffer on the device.

func boolArg(v bool) int32 {
	if v {
		return 1
	}
	return 0
}

// weightArg is a weight-like vector operand (norm weight, bias, table) as
// the kernels take it: the address and whether it is BF16.
func weightArg(t *tensor) (dptr, int32) { return dptr(t.p), bf16Flag(t) }

// bf16Flag is the kernels' dtype flag of an operand that may be BF16 or
// F32 (a weight vector, or an activation: compute's "(act)" operands).
func bf16Flag(t *tensor) int32 { return boolArg(t.dt == compute.BF16) }

// act are the dtypes an activation operand may have.
var act = []compute.DType{compute.F32, compute.BF16}

func (b *Backend) ew(kernel string, n int64, args ...any) {
	b.launchKernel(launch{kernel: kernel, grid: elementwiseGrid(n), block: ewThreads}, args...)
}

// convert runs one of the conversion kernels k_f32_to_bf16, k_bf16_to_f32
// and k_add_bf16 over n elements, four at a time (the _x4 variant) when n
// and both addresses allow 16-byte F32 and 8-byte BF16 accesses.
func (b *Backend) convert(kernel string, dst, src uint64, n int64) {
	if n%4 == 0 && dst%16 == 0 && src%16 == 0 {
		b.ew(kernel+"_x4", n/4, dptr(dst), dptr(src), n/4)
		return
	}
	b.ew(kernel, n, dptr(dst), dptr(src), n)
}

// bf16Operand returns a BF16 copy of a GEMM operand t (n elements): t
// itself when BF16; for an F32 weight, a copy made once and kept; for a
// trained parameter, its shadow (current, or made now); for other F32
// tensors a scratch copy the caller frees (scratch != 0).
func (b *Backend) bf16Operand(t *tensor, n int) (p uint64, scratch uint64) {
	switch {
	case t.dt == compute.BF16:
		return t.p, 0
	case t.weight:
		c, ok := b.bf16Of[t]
		if !ok {
			c = b.newTensor(compute.BF16, t.n)
			b.convert("k_f32_to_bf16", c.p, t.p, int64(t.n))
			b.bf16Of[t] = c
		}
		return c.p, 0
	}
	if p := b.shadowOf(t, n); p != 0 {
		return p, 0 // a parameter's BF16 shadow (shadow.go)
	}
	s := b.alloc(int64(n) * 2)
	b.convert("k_f32_to_bf16", s, t.p, int64(n))
	return s, s
}

// gemm enqueues out (m,n) F32 = x (m,k) · w (n,k)ᵀ with x and w of cuBLASLt
// type in, through a plan cached per shape and alignment.
func (b *Backend) gemm(out, x, w uint64, m, n, k int, in int) {
	b.gemmEx(out, x, w, m, n, k, false, true, in, 0)
}

// gemmEx enqueues out (m,n) F32 = op(a) (m,k) · op(b) (k,n) + beta·out,
// row-major, with op(a) = aᵀ when ta (a stored (k,m)) and op(b) = bᵀ when
// tb (b stored (n,k)); a and b of cuBLASLt type in. beta = 1 accumulates
// (the backward's += rule). k = 0 leaves beta·out.
func (b *Backend) gemmEx(out, a, bm uint64, m, n, k int, ta, tb bool, in int, beta float32) {
	b.gemmTo(out, dataF32, a, bm, m, n, k, ta, tb, in, beta)
}

// gemmTo is gemmEx with out of cuBLASLt type outT (dataF32, or dataBF16
// with beta = 0).
func (b *Backend) gemmTo(out uint64, outT int, a, bm uint64, m, n, k int, ta, tb bool, in int, beta float32) {
	if m == 0 || n == 0 {
		return
	}
	if k == 0 {
		if beta == 0 {
			b.memset0(out, int64(m)*int64(n)*int64(typeBytes(outT)))
		}
		return
	}
	b.gemmC(out, out, outT, a, bm, m, n, k, ta, tb, in, beta)
}

// gemmC is gemmTo's GEMM (k > 0) with C apart from D: out = op(a)·op(b)
// + beta·c, c of out's type and shape.
func (b *Backend) gemmC(out, c uint64, outT int, a, bm uint64, m, n, k int, ta, tb bool, in int, beta float32) {
	b.gemmRun(gemmShape{m: m, n: n, k: k, in: in, out: outT, ta: ta, tb: tb, align: [4]int{alignOf(bm), alignOf(a), alignOf(c), alignOf(out)}},
		out, c, a, bm, beta)
}

// gemmRun enqueues the GEMM of shape s (its plan made on first use): out
// = x·w (as s says) + beta·c, timed under the calling method's label.
func (b *Backend) gemmRun(s gemmShape, out, c, x, w uint64, beta float32) {
	p, err := b.gemmPlan(s)
	b.must(err)
	defer b.timed("cublasLt GEMM (" + b.label + ")")()
	b.must(b.lt.runC(b.ltH, p, out, c, x, w, b.ws, beta, b.stream))
}

// MatMulResidual implements compute.ResidualMatMul: out = x·wᵀ + res in
// one GEMM, res as cuBLASLt's C with beta 1 (the epilogue adds it to
// the fp32 product, one rounding, as MatMul into F32 and then Add). The
// residual connection after o_proj and down_proj then costs the GEMM a
// read of res, and the norm that follows reads only the sum: AddRMSNorm
// read the GEMM's output and res and wrote the sum back (56 bytes an
// element of hidden, against 24 now, and 4 more for the GEMM's write: on
// a Qwen3-8B forward of 16384 tokens 16.2 ms, 3.6%, on the H200,
// 2026-11-27). FP8 weights, and Options.ResidualAdd "separate", decline.
func (b *Backend) MatMulResidual(outT, xT, wT, resT compute.Tensor, m, n, k int) bool {
	defer b.enter()()
	out, x, w, res := b.ten(outT, "MatMulResidual out"), b.ten(xT, "MatMulResidual x"), b.ten(wT, "MatMulResidual w"), b.ten(resT, "MatMulResidual res")
	if b.sepResidual || w.dt == compute.F8E4M3 {
		return false
	}
	b.wroteT(outT)
	b.label = "MatMul"
	need(out, "MatMulResidual out", m*n, compute.F32)
	need(res, "MatMulResidual res", m*n, compute.F32)
	need(x, "MatMulResidual x", m*k, act...)
	need(w, "MatMulResidual w", n*k, compute.F32, compute.BF16)
	switch {
	case m == 0 || n == 0:
	case k == 0:
		b.copyD(out.p, res.p, int64(m)*int64(n)*4)
	default:
		xp, xs := b.bf16Operand(x, m*k)
		wp, ws := b.bf16Operand(w, n*k)
		b.gemmC(out.p, res.p, dataF32, xp, wp, m, n, k, false, true, dataBF16, 1)
		b.free(xs)
		b.free(ws)
	}
	return true
}

// gemmPlan is the backend's cuBLASLt plan of shape s, made on first use.
func (b *Backend) gemmPlan(s gemmShape) (*gemmPlan, error) {
	if p, ok := b.plans[s]; ok {
		return p, nil
	}
	if len(b.plans) >= 1024 { // shapes vary with the batch: bound the cache
		for _, q := range b.plans {
			b.lt.destroyPlan(q)
		}
		clear(b.plans)
	}
	p, err := b.lt.plan(b.ltH, s)
	if err != nil {
		return nil, err
	}
	b.plans[s] = p
	return p, nil
}

// MatMul implements compute.Backend: out (m,n) = x (m,k)·w (n,k)ᵀ + bias,
// BF16 operands (x rounded unless BF16, w as stored) with fp32
// accumulation; a BF16 out is rounded once, after the bias (which then
// goes through an F32 scratch: Qwen2's q/k/v). An FP8 w (WeightFP8) runs
// W8A8 on the FP8 tensor cores (fp8.go).
func (b *Backend) MatMul(outT, xT, wT, biasT compute.Tensor, m, n, k int) {
	defer b.enter()()
	b.wroteT(outT)
	b.label = "MatMul"
	out, x, w := b.ten(outT, "MatMul out"), b.ten(xT, "MatMul x"), b.ten(wT, "MatMul w")
	need(out, "MatMul out", m*n, act...)
	need(x, "MatMul x", m*k, act...)
	need(w, "MatMul w", n*k, compute.F32, compute.BF16, compute.F8E4M3)
	var bias *tensor
	if biasT != nil {
		bias = b.ten(biasT, "MatMul bias")
		need(bias, "MatMul bias", n, compute.F32, compute.BF16)
	}
	if m == 0 || n == 0 {
		return
	}
	if w.dt == compute.F8E4M3 {
		b.matMulFP8(out, x, w, bias, m, n, k) // fp8.go
		return
	}
	// acc is the fp32 result: out itself, or for a BF16 out with a bias
	// (or k = 0) a scratch rounded into out at the end.
	acc, accScratch := out.p, uint64(0)
	if out.dt == compute.BF16 && (bias != nil || k == 0) {
		accScratch = b.alloc(int64(m) * int64(n) * 4)
		acc = accScratch
	}
	if k == 0 {
		b.memset0(acc, int64(m)*int64(n)*4)
	} else {
		xp, xs := b.bf16Operand(x, m*k)
		wp, ws := b.bf16Operand(w, n*k)
		accT := dataF32
		if acc == out.p && out.dt == compute.BF16 {
			accT = dataBF16 // rounded once by cuBLASLt's epilogue
		}
		b.gemmTo(acc, accT, xp, wp, m, n, k, false, true, dataBF16, 0)
		b.free(xs)
		b.free(ws)
	}
	switch {
	case bias != nil:
		bp, bf := weightArg(bias)
		b.ew("k_add_bias", int64(m)*int64(n), dptr(out.p), bf16Flag(out), dptr(acc), bp, bf, int64(m), int32(n))
	case accScratch != 0:
		b.convert("k_f32_to_bf16", out.p, acc, int64(m)*int64(n))
	}
	b.free(accScratch)
}

// Embed implements compute.Backend.
func (b *Backend) Embed(outT, tableT, idsT compute.Tensor, n, dim int) {
	defer b.enter()()
	b.wroteT(outT)
	out, table, ids := b.ten(outT, "Embed out"), b.ten(tableT, "Embed table"), b.ten(idsT, "Embed ids")
	need(out, "Embed out", n*dim, compute.F32)
	need(table, "Embed table", dim, compute.F32, compute.BF16)
	need(ids, "Embed ids", n, compute.I32)
	tp, tb := weightArg(table)
	b.ew("k_embed", int64(n)*int64(dim), dptr(out.p), tp, tb, dptr(ids.p), int64(n), int32(dim))
}

// rmsVecK is the most chunks of 8 elements a thread of the 8-wide RMSNorm
// kernels holds in registers (RV_K in norm_rope.cu and backward.cu).
const rmsVecK = 4

// rmsnormVecLaunch is the launch of the 8-wide RMSNorm kernels
// (k_rmsnorm_warp8, k_rmsnorm_block8; their backward twins take the same)
// and their last argument, the threads per row, for rows of dim elements
// whose tensors start at ptrs; ok is false where only rmsnormLaunch's
// scalar kernels apply: dim not a multiple of 8, above 8·rmsVecK·256, or a
// tensor not 16-byte aligned. The split follows rmsnormLaunch's: up to
// dim 1024 a group of lanes (C/rmsVecK rounded up to a power of two, C =
// dim/8 chunks) per row inside a warp, so a short row (a head's 128) takes
// 4 lanes and a warp 8 rows instead of leaving lanes idle; above, one
// 256-thread block per row.
func rmsnormVecLaunch(rows, dim int, ptrs ...uint64) (l launch, lanes int32, ok bool) {
	if dim <= 0 || dim%8 != 0 || dim/8 > rmsVecK*ewThreads {
		return launch{}, 0, false
	}
	for _, p := range ptrs {
		if !aligned16(p) {
			return launch{}, 0, false
		}
	}
	c := dim / 8
	if c > rmsVecK*32 {
		return launch{kernel: "k_rmsnorm_block8", grid: [3]int{rows, 1, 1}, block: ewThreads}, ewThreads, true
	}
	g := 1
	for g*rmsVecK < c {
		g *= 2
	}
	perBlock := ewThreads / g
	return launch{kernel: "k_rmsnorm_warp8", grid: [3]int{(rows + perBlock - 1) / perBlock, 1, 1}, block: ewThreads}, int32(g), true
}

// RMSNorm implements compute.Backend. out may alias x; rstd (rows), when
// not nil, receives each row's 1/rms for the backward.
func (b *Backend) RMSNorm(outT, rstdT, xT, wT compute.Tensor, rows, dim int, eps float32) {
	defer b.enter()()
	b.wroteT(outT, rstdT)
	out, x, w := b.ten(outT, "RMSNorm out"), b.ten(xT, "RMSNorm x"), b.ten(wT, "RMSNorm w")
	need(out, "RMSNorm out", rows*dim, act...)
	need(x, "RMSNorm x", rows*dim, act...)
	need(w, "RMSNorm w", dim, compute.F32, compute.BF16)
	rp := b.stats(rstdT, "RMSNorm rstd", rows)
	wp, wb := weightArg(w)
	if l, lanes, ok := rmsnormVecLaunch(rows, dim, out.p, x.p, w.p); ok {
		b.launchKernel(l, dptr(out.p), bf16Flag(out), rp, dptr(x.p), bf16Flag(x), dptr(0), wp, wb, int64(rows), int32(dim), eps, lanes)
		return
	}
	b.launchKernel(rmsnormLaunch(rows, dim), dptr(out.p), bf16Flag(out), rp, dptr(x.p), bf16Flag(x), dptr(0), wp, wb, int64(rows), int32(dim), eps)
}

// stats is an optional F32 statistics output of n elements (RMSNorm's
// rstd): its address, or 0 for nil.
func (b *Backend) stats(t compute.Tensor, what string, n int) dptr {
	if t == nil {
		return 0
	}
	r := b.ten(t, what)
	need(r, what, n, compute.F32)
	return dptr(r.p)
}

// AddRMSNorm implements compute.Backend: the RMSNorm kernels with the
// residual add folded into their first pass over the row (one read of a
// and b, one write of the sum, instead of Add's pass and the norm's).
func (b *Backend) AddRMSNorm(outT, rstdT, aT, bT, wT compute.Tensor, rows, dim int, eps float32) {
	defer b.enter()()
	b.wroteT(outT, rstdT, aT)
	out, a, c, w := b.ten(outT, "AddRMSNorm out"), b.ten(aT, "AddRMSNorm a"), b.ten(bT, "AddRMSNorm b"), b.ten(wT, "AddRMSNorm w")
	need(out, "AddRMSNorm out", rows*dim, act...)
	need(a, "AddRMSNorm a", rows*dim, compute.F32)
	need(c, "AddRMSNorm b", rows*dim, compute.F32)
	need(w, "AddRMSNorm w", dim, compute.F32, compute.BF16)
	if out.p == a.p || out.p == c.p {
		panic("cuda: AddRMSNorm out aliases a or b")
	}
	rp := b.stats(rstdT, "AddRMSNorm rstd", rows)
	wp, wb := weightArg(w)
	if l, lanes, ok := rmsnormVecLaunch(rows, dim, out.p, a.p, c.p, w.p); ok {
		b.launchKernel(l, dptr(out.p), bf16Flag(out), rp, dptr(a.p), int32(0), dptr(c.p), wp, wb, int64(rows), int32(dim), eps, lanes)
		return
	}
	b.launchKernel(rmsnormLaunch(rows, dim), dptr(out.p), bf16Flag(out), rp, dptr(a.p), int32(0), dptr(c.p), wp, wb, int64(rows), int32(dim), eps)
}

// RoPE implements compute.Backend: x (tokens, heads, headDim) rotated in
// place by the angles whose cos and sin (tokens, headDim/2) the caller
// tabulated.
func (b *Backend) RoPE(xT, cosT, sinT compute.Tensor, tokens, heads, headDim int) {
	defer b.enter()()
	b.wroteT(xT)
	x, cs, sn := b.ten(xT, "RoPE x"), b.ten(cosT, "RoPE cos"), b.ten(sinT, "RoPE sin")
	need(x, "RoPE x", tokens*heads*headDim, act...)
	need(cs, "RoPE cos", tokens*(headDim/2), compute.F32)
	need(sn, "RoPE sin", tokens*(headDim/2), compute.F32)
	l, err := ropeLaunch(tokens, heads, headDim)
	b.must(err)
	b.launchKernel(l, dptr(x.p), bf16Flag(x), dptr(cs.p), dptr(sn.p), int64(tokens), int32(heads), int32(headDim))
}

// RMSNormRoPE implements compute.Backend: one warp per (token, head) row
// (k_rmsnorm_rope), the norm's statistics then the rotation of the normed
// row, with no trip through memory between them.
func (b *Backend) RMSNormRoPE(outT, rstdT, xT, wT, cosT, sinT compute.Tensor, tokens, heads, headDim int, eps float32) {
	defer b.enter()()
	b.wroteT(outT, rstdT)
	out, x, w := b.ten(outT, "RMSNormRoPE out"), b.ten(xT, "RMSNormRoPE x"), b.ten(wT, "RMSNormRoPE w")
	cs, sn := b.ten(cosT, "RMSNormRoPE cos"), b.ten(sinT, "RMSNormRoPE sin")
	rows := tokens * heads
	need(out, "RMSNormRoPE out", rows*headDim, act...)
	need(x, "RMSNormRoPE x", rows*headDim, act...)
	need(w, "RMSNormRoPE w", headDim, compute.F32, compute.BF16)
	need(cs, "RMSNormRoPE cos", tokens*(headDim/2), compute.F32)
	need(sn, "RMSNormRoPE sin", tokens*(headDim/2), compute.F32)
	if out.p == x.p && out.dt != x.dt {
		panic("cuda: RMSNormRoPE out aliases x with another dtype")
	}
	if headDim%2 != 0 || headDim < 2 {
		panic(fmt.Sprintf("cuda: RMSNormRoPE head_dim %d: want an even head_dim >= 2", headDim))
	}
	rp := b.stats(rstdT, "RMSNormRoPE rstd", rows)
	if rows == 0 {
		return
	}
	wp, wb := weightArg(w)
	if nc := headDim / 16; headDim%16 == 0 && nc <= 32 && aligned16(out.p) && aligned16(x.p) && aligned16(w.p) && aligned16(cs.p) && aligned16(sn.p) {
		// 16-byte accesses (k_rmsnorm_rope8): nc chunks of 8 per half row,
		// a group of lanes (nc rounded up to a power of two) per row.
		lanes := 1
		for lanes < nc {
			lanes *= 2
		}
		perBlock := 256 / lanes
		b.launchKernel(launch{kernel: "k_rmsnorm_rope8", grid: [3]int{(rows + perBlock - 1) / perBlock, 1, 1}, block: 256},
			dptr(out.p), bf16Flag(out), rp, dptr(x.p), bf16Flag(x), wp, wb, dptr(cs.p), dptr(sn.p), int64(rows), int32(heads), int32(headDim), eps,
			int32(lanes))
		return
	}
	b.launchKernel(launch{kernel: "k_rmsnorm_rope", grid: [3]int{(rows + 7) / 8, 1, 1}, block: 256},
		dptr(out.p), bf16Flag(out), rp, dptr(x.p), bf16Flag(x), wp, wb, dptr(cs.p), dptr(sn.p), int64(rows), int32(heads), int32(headDim), eps)
}

// Attention implements compute.Backend. lse (tokens, nHead), when not
// nil, receives each query row's log-sum-exp of its scaled scores.
// It runs on cuDNN's fused flash attention where the backend uses it
// (cudnn.go), else on this package's kernels.
func (b *Backend) Attention(outT, lseT, qT, kT, vT, startsT compute.Tensor, nSeq, maxLen, tokens, nHead, nKV, hd int, scale float32) {
	defer b.enter()()
	b.wroteT(outT, lseT)
	b.label = "Attention"
	a := b.attnArgs(outT, lseT, qT, kT, vT, startsT, nSeq, tokens, nHead, nKV, hd)
	if b.useCudnn(tokens, nSeq, maxLen, nHead, nKV, hd) && b.cudnnAttention(a, nSeq, maxLen, tokens, nHead, nKV, hd, scale) {
		return
	}
	b.attention(b.ownAttn(), a, nSeq, tokens, nHead, nKV, hd, scale)
}

// attnArgs are Attention's tensors, unwrapped and checked; lse may be nil.
type attnArgs struct{ out, lse, q, k, v, st *tensor }

func (b *Backend) attnArgs(outT, lseT, qT, kT, vT, startsT compute.Tensor, nSeq, tokens, nHead, nKV, hd int) attnArgs {
	a := attnArgs{out: b.ten(outT, "Attention out"), q: b.ten(qT, "Attention q"), k: b.ten(kT, "Attention k"), v: b.ten(vT, "Attention v"),
		st: b.ten(startsT, "Attention starts")}
	need(a.out, "Attention out", tokens*nHead*hd, act...)
	need(a.q, "Attention q", tokens*nHead*hd, act...)
	need(a.k, "Attention k", tokens*nKV*hd, act...)
	need(a.v, "Attention v", tokens*nKV*hd, act...)
	need(a.st, "Attention starts", nSeq+1, compute.I32)
	if lseT != nil {
		a.lse = b.ten(lseT, "Attention lse")
		need(a.lse, "Attention lse", tokens*nHead, compute.F32)
	}
	return a
}

// attention runs the own kernels.
func (b *Backend) attention(mode attnMode, a attnArgs, nSeq, tokens, nHead, nKV, hd int, scale float32) {
	out, q, k, v, st := a.out, a.q, a.k, a.v, a.st
	var lp dptr
	if a.lse != nil {
		lp = dptr(a.lse.p)
	}
	if tokens == 0 {
		return
	}
	plan, attn, err := attentionLaunch(mode, tokens, nSeq, nHead, nKV, hd)
	b.must(err)
	tiles := b.alloc(int64(nSeq+1) * 4)
	bq := int32(simtBQ)
	if attn.kernel != "k_attn_simt" {
		bq = mmaBQ
	}
	b.launchKernel(plan, dptr(tiles), dptr(st.p), int32(nSeq), bq)
	nq, nk := tokens*nHead*hd, tokens*nKV*hd
	op, finish := b.f32Out(out, nq) // the kernels write F32
	var ins [3]uint64
	if attn.kernel == "k_attn_simt" {
		var qp, kp, vp uint64
		qp, ins[0] = b.f32In(q, nq)
		kp, ins[1] = b.f32In(k, nk)
		vp, ins[2] = b.f32In(v, nk)
		b.launchKernel(attn, dptr(op), lp, dptr(qp), dptr(kp), dptr(vp), dptr(st.p), dptr(tiles),
			int32(nSeq), int32(nHead), int32(nKV), int32(hd), scale)
	} else {
		// The tensor-core kernel reads BF16 operands: F32 ones rounded once
		// per call (the kernel's blocks then share them).
		var qb, kb, vb uint64
		qb, ins[0] = b.bf16In(q, nq)
		kb, ins[1] = b.bf16In(k, nk)
		vb, ins[2] = b.bf16In(v, nk)
		b.launchKernel(attn, dptr(op), lp, dptr(qb), dptr(kb), dptr(vb), dptr(st.p), dptr(tiles),
			int32(nSeq), int32(nHead), int32(nKV), scale)
	}
	finish()
	for _, c := range ins {
		b.free(c)
	}
	b.free(tiles)
}

// bf16In returns the first n elements of activation t in BF16 at a
// 16-byte aligned address (what cuDNN and the tensor-core kernels'
// 16-byte loads need): t itself when it is, else a scratch copy (rounded
// from F32, or moved) that the caller frees.
func (b *Backend) bf16In(t *tensor, n int) (p, scratch uint64) {
	if t.dt == compute.F32 {
		s := b.bf16Copy(t.p, n)
		return s, s
	}
	if aligned16(t.p) {
		return t.p, 0
	}
	s := b.alloc(int64(n) * 2)
	b.copyD(s, t.p, int64(n)*2)
	return s, s
}

// f32In returns the first n elements of activation t in F32: t itself, or
// a widened scratch copy the caller frees.
func (b *Backend) f32In(t *tensor, n int) (p, scratch uint64) {
	if t.dt == compute.F32 {
		return t.p, 0
	}
	s := b.alloc(int64(n) * 4)
	b.convert("k_bf16_to_f32", s, t.p, int64(n))
	return s, s
}

// f32Out is where a kernel that writes F32 writes activation t's first n
// elements: t itself, or a scratch that finish rounds into t (and frees).
func (b *Backend) f32Out(t *tensor, n int) (p uint64, finish func()) {
	if t.dt == compute.F32 {
		return t.p, func() {}
	}
	s := b.alloc(int64(n) * 4)
	return s, func() {
		b.convert("k_f32_to_bf16", t.p, s, int64(n))
		b.free(s)
	}
}

// SwiGLU implements compute.Backend. out may alias gate.
func (b *Backend) SwiGLU(outT, gateT, upT compute.Tensor, n int) {
	defer b.enter()()
	b.wroteT(outT)
	out, g, u := b.ten(outT, "SwiGLU out"), b.ten(gateT, "SwiGLU gate"), b.ten(upT, "SwiGLU up")
	need(out, "SwiGLU out", n, act...)
	need(g, "SwiGLU gate", n, act...)
	need(u, "SwiGLU up", n, act...)
	if out.p == g.p && out.dt != g.dt {
		panic("cuda: SwiGLU out aliases gate with another dtype")
	}
	if n%8 == 0 && aligned16(out.p) && aligned16(g.p) && aligned16(u.p) {
		// 16-byte accesses (k_swiglu_x8): the same bits, at the memory's pace.
		b.ew("k_swiglu_x8", int64(n/8), dptr(out.p), bf16Flag(out), dptr(g.p), bf16Flag(g), dptr(u.p), bf16Flag(u), int64(n/8))
		return
	}
	b.ew("k_swiglu", int64(n), dptr(out.p), bf16Flag(out), dptr(g.p), bf16Flag(g), dptr(u.p), bf16Flag(u), int64(n))
}

// Add implements compute.Backend.
func (b *Backend) Add(aT, bT compute.Tensor, n int) {
	defer b.enter()()
	b.wroteT(aT)
	a, c := b.ten(aT, "Add a"), b.ten(bT, "Add b")
	need(a, "Add a", n, act...)
	need(c, "Add b", n, compute.F32)
	if a.dt == compute.BF16 { // a LoRA adapter's term into a BF16 output
		b.ew("k_add_to_act", int64(n), dptr(a.p), dptr(c.p), int64(n))
		return
	}
	b.ew("k_add", int64(n), dptr(a.p), dptr(c.p), int64(n))
}

// Dropout implements compute.Backend (k_dropout: one thread per four
// columns of a row).
func (b *Backend) Dropout(outT, xT compute.Tensor, d *compute.DropoutMask, rows, cols int) {
	defer b.enter()()
	b.wroteT(outT)
	out, x := b.ten(outT, "Dropout out"), b.ten(xT, "Dropout x")
	need(out, "Dropout out", rows*cols, act...)
	need(x, "Dropout x", rows*cols, act...)
	k0, k1, row, step, thr := dropoutArgs(d)
	b.ew("k_dropout", int64(rows)*int64((cols+3)/4), dptr(out.p), bf16Flag(out), dptr(x.p), bf16Flag(x), dptr(0), int32(1), int64(rows), int32(cols),
		k0, k1, row, step, thr, d.Scale)
}

// DropoutBackward implements compute.Backend (k_dropout_bwd).
func (b *Backend) DropoutBackward(dxT, doutT compute.Tensor, d *compute.DropoutMask, rows, cols int) {
	defer b.enter()()
	b.wroteT(dxT)
	dx, dout := b.ten(dxT, "DropoutBackward dx"), b.ten(doutT, "DropoutBackward dout")
	need(dx, "DropoutBackward dx", rows*cols, compute.F32)
	need(dout, "DropoutBackward dout", rows*cols, compute.F32)
	k0, k1, row, step, thr := dropoutArgs(d)
	b.ew("k_dropout_bwd", int64(rows)*int64((cols+3)/4), dptr(dx.p), dptr(dout.p), dptr(0), int32(1), int64(rows), int32(cols), k0, k1, row, step, thr, d.Scale)
}

// dropoutArgs are a mask's 32-bit words as the kernels' int parameters
// (the same bits; the kernels read them as u32).
func dropoutArgs(d *compute.DropoutMask) (k0, k1, row, step, thr int32) {
	return int32(d.Key[0]), int32(d.Key[1]), int32(d.Row), int32(d.Step), int32(d.Threshold)
}

// f32Weight returns an F32 copy of a weight t (made once for weights, a
// scratch copy the caller frees otherwise).
func (b *Backend) f32Operand(t *tensor) (p uint64, scratch uint64) {
	switch {
	case t.dt == compute.F32:
		return t.p, 0
	case t.weight:
		c, ok := b.f32Of[t]
		if !ok {
			c = b.newTensor(compute.F32, t.n)
			b.convert("k_bf16_to_f32", c.p, t.p, int64(t.n))
			b.f32Of[t] = c
		}
		return c.p, 0
	}
	s := b.alloc(int64(t.n) * 4)
	b.convert("k_bf16_to_f32", s, t.p, int64(t.n))
	return s, s
}

// MoE implements compute.Backend: MoEForward's output with its saved
// tensors in scratch (train_moe.go: moeForward).
func (b *Backend) MoE(outT, xT compute.Tensor, mw *compute.MoEWeights, tokens int) {
	defer b.enter()()
	b.wroteT(outT)
	b.label = "MoE"
	b.moeForward(outT, xT, mw, nil, tokens, "MoE")
}

// LMHeadTopK implements compute.Backend (see planLMHead for the tiling and
// lmhead.cu for the fold).
func (b *Backend) LMHeadTopK(idsT, lpT, xT, wT compute.Tensor, tokens, hidden, vocab, k int) {
	defer b.enter()()
	b.wroteT(idsT, lpT)
	b.label = "LMHeadTopK"
	ids, lp, x, w := b.ten(idsT, "LMHeadTopK ids"), b.ten(lpT, "LMHeadTopK logprobs"), b.ten(xT, "LMHeadTopK x"), b.ten(wT, "LMHeadTopK w")
	need(ids, "LMHeadTopK ids", tokens*k, compute.I32)
	need(lp, "LMHeadTopK logprobs", tokens*k, compute.F32)
	need(x, "LMHeadTopK x", tokens*hidden, act...)
	need(w, "LMHeadTopK w", vocab*hidden, compute.F32, compute.BF16)
	if tokens == 0 {
		return
	}
	p, err := planLMHead(tokens, hidden, vocab, k)
	b.must(err)
	b.lmHeadPass(ids, lp, x, w, tokens, hidden, vocab, k, p, nil, nil)
}

// lmBlocks is where k_lm_fold keeps LMHeadSample's block sums (bsum, nblk
// a slab row), tile maxima and totals (tmax, tsum, ntile a slab row).
type lmBlocks struct {
	bsum, tmax, tsum uint64
	nblk, ntile      int
}

// lmHeadPass is the streaming LM head's one pass (LMHeadTopK's, and
// LMHeadSample's with its block sums and hook): x's rows in slabs of
// p.rows, rounded to BF16 unless they are, the vocabulary in GEMMs of
// p.cols columns, each folded tile by tile into the running max, sum and
// top-k (k_lm_fold, a launch an lmTile piece, or with Options.LMFold
// "gemm" and k <= lmTile/2 k_lm_fold_gemm, a launch a GEMM; either keeps
// blk's sums when blk is set),
// slabDone after each slab's last GEMM, and the top-k's log-probs
// normalized at the end (k >= 1).
func (b *Backend) lmHeadPass(ids, lp, x, w *tensor, tokens, hidden, vocab, k int, p lmPlan,
	blk *lmBlocks, slabDone func(xb, wp, rmax, rsum uint64, r0, nr int)) {
	var bl lmBlocks
	if blk != nil {
		bl = *blk
	}
	rmax, rsum, cnt := b.alloc(int64(tokens)*4), b.alloc(int64(tokens)*8), b.alloc(int64(tokens)*4)
	b.ew("k_lm_init", int64(tokens), dptr(rmax), dptr(rsum), dptr(cnt), int64(tokens))
	wp, ws := b.bf16Operand(w, vocab*hidden)
	var xs uint64 // the F32 x's rows, rounded (a BF16 x is read in place)
	if x.dt == compute.F32 {
		xs = b.alloc(int64(p.rows) * int64(hidden) * 2)
	}
	tile := b.alloc(int64(p.rows) * int64(p.cols) * 4)
	for r0 := 0; r0 < tokens; r0 += p.rows {
		nr := min(p.rows, tokens-r0)
		xb := x.p + uint64(r0)*uint64(hidden)*2
		if xs != 0 {
			xb = xs
			b.convert("k_f32_to_bf16", xb, x.p+uint64(r0)*uint64(hidden)*4, int64(nr)*int64(hidden))
		}
		for c0 := 0; c0 < vocab; c0 += p.cols {
			nc := min(p.cols, vocab-c0)
			b.gemm(tile, xb, wp+uint64(c0)*uint64(hidden)*2, nr, nc, hidden, dataBF16)
			if b.lmFoldGEMM && k <= lmTile/2 {
				b.launchKernel(launch{kernel: "k_lm_fold_gemm", grid: [3]int{nr, 1, 1}, block: lmFoldThreads, smem: p.foldSmem},
					dptr(tile), int64(nc), int32(nc), int32(c0), int64(r0),
					dptr(rmax), dptr(rsum), dptr(cnt), dptr(lp.p), dptr(ids.p), int32(k),
					dptr(bl.bsum), dptr(bl.tmax), dptr(bl.tsum), int32(bl.nblk), int32(bl.ntile))
				continue
			}
			for t0 := 0; t0 < nc; t0 += lmTile {
				b.launchKernel(launch{kernel: "k_lm_fold", grid: [3]int{nr, 1, 1}, block: lmFoldThreads, smem: p.foldSmem},
					dptr(tile+uint64(t0)*4), int64(nc), int32(min(lmTile, nc-t0)), int32(c0+t0), int64(r0),
					dptr(rmax), dptr(rsum), dptr(cnt), dptr(lp.p), dptr(ids.p), int32(k),
					dptr(bl.bsum), dptr(bl.tmax), dptr(bl.tsum), int32(bl.nblk), int32(bl.ntile))
			}
		}
		if slabDone != nil {
			slabDone(xb, wp, rmax, rsum, r0, nr)
		}
	}
	if k > 0 {
		b.ew("k_lm_finish", int64(tokens)*int64(k), dptr(lp.p), dptr(rmax), dptr(rsum), int64(tokens), int32(k))
	}
	for _, q := range []uint64{rmax, rsum, cnt, ws, xs, tile} {
		b.free(q)
	}
}

// LMHeadSample implements compute.Backend: LMHeadTopK's pass (the same
// GEMMs and k_lm_fold, k 0 allowed, the fold also keeping the blocks'
// sums) and k_lm_sample after each slab's last tile (lmhead.cu); see
// planLMHeadSample for the slab's rows and scratch.
func (b *Backend) LMHeadSample(idsT, lpT, drawnT, tailT, xT, wT, uT compute.Tensor, tokens, hidden, vocab, k, n int, head bool) {
	defer b.enter()()
	b.wroteT(idsT, lpT, drawnT, tailT)
	b.label = "LMHeadSample"
	ids, lp := b.ten(idsT, "LMHeadSample ids"), b.ten(lpT, "LMHeadSample logprobs")
	dr, tl := b.ten(drawnT, "LMHeadSample drawn"), b.ten(tailT, "LMHeadSample tail")
	x, w, u := b.ten(xT, "LMHeadSample x"), b.ten(wT, "LMHeadSample w"), b.ten(uT, "LMHeadSample u")
	switch {
	case n < 1:
		panic(fmt.Sprintf("cuda: LMHeadSample with %d draws per token", n))
	case head && k < 1:
		panic("cuda: LMHeadSample: head needs k >= 1")
	}
	need(ids, "LMHeadSample ids", tokens*k, compute.I32)
	need(lp, "LMHeadSample logprobs", tokens*k, compute.F32)
	need(dr, "LMHeadSample drawn", tokens*n, compute.I32)
	need(tl, "LMHeadSample tail", tokens, compute.F32)
	need(x, "LMHeadSample x", tokens*hidden, act...)
	need(w, "LMHeadSample w", vocab*hidden, compute.F32, compute.BF16)
	need(u, "LMHeadSample u", 2*tokens*n, compute.I32)
	if tokens == 0 {
		return
	}
	p, err := planLMHeadSample(tokens, hidden, vocab, k, n)
	b.must(err)
	bsum, tmax := b.alloc(int64(p.rows)*int64(p.nblk)*8), b.alloc(int64(p.rows)*int64(p.ntile)*4)
	tsum := b.alloc(int64(p.rows) * int64(p.ntile) * 8)
	blk, thr := b.alloc(int64(p.rows)*int64(n)*4), b.alloc(int64(p.rows)*int64(n)*8)
	b.lmHeadPass(ids, lp, x, w, tokens, hidden, vocab, k, p.lmPlan,
		&lmBlocks{bsum: bsum, tmax: tmax, tsum: tsum, nblk: p.nblk, ntile: p.ntile},
		func(xb, wp, rmax, rsum uint64, r0, nr int) {
			b.launchKernel(launch{kernel: "k_lm_sample", grid: [3]int{nr, 1, 1}, block: lmFoldThreads},
				dptr(xb), dptr(wp), int32(hidden), int32(vocab), dptr(rmax), dptr(rsum), int64(r0),
				dptr(bsum), dptr(tmax), dptr(tsum), int32(p.nblk), int32(p.ntile), dptr(lp.p), dptr(ids.p), int32(k), boolArg(head),
				dptr(u.p), int32(n), dptr(blk), dptr(thr), dptr(dr.p), dptr(tl.p))
		})
	for _, q := range []uint64{bsum, tmax, tsum, blk, thr} {
		b.free(q)
	}
}
