package cuda

import (
	"fmt"
	"unsafe"

	"distill/compute"
)

// The training half of compute.Backend: the layers' backward kernels, the
// fused LM-head loss, AdamW, the gradient norm and NVFP4 fake quantization.
// Each mirrors compute/cpu's method of the same name (the oracle of the
// tests) and, like the forward kernels, enqueues work without waiting,
// except the methods that return host values (SumSquares, AbsMax,
// LossHeadForward, LossValues.Read), which synchronize once.
//
// Precision (mixed, as Megatron-LM trains): the GEMMs (MatMul's backward,
// the loss head's logits and gradients) take BF16 operands: BF16
// activations and gradients as they are (their producers rounded them
// once), F32 ones rounded when they are read, the master weights rounded
// once per step (their shadows, shadow.go), and accumulate
// in fp32 into fp32 outputs; everything else is fp32, with
// float64 sums where compute/cpu has them. Parameters, their gradients and
// the AdamW moments are fp32 tensors of the caller: the decoder does not
// know about the BF16 copies.
//
// Determinism: no reduction uses atomics. Sums over rows (RMSNorm's dw,
// a bias's gradient), the gradient's sum of squares, absmax, the loss
// head's per-row statistics and the embedding's scatter-add run in an order
// fixed by the shapes alone, so a run repeats bit for bit on one GPU (the
// resume test). cuBLASLt's GEMMs are deterministic for a fixed algorithm,
// which a plan fixes per shape.

// reduceGrid is the grid of a two-stage reduction over n elements: at most
// 1024 blocks of 256 threads (RED_BLOCKS, RED_THREADS in optim.cu), a
// function of n only, so the summation order is too.
func reduceGrid(n int) int { return max(1, min((n+255)/256, 1024)) }

// colChunk is the row chunk of k_colsum_part: a function of rows only.
func colChunk(rows int) int { return max(64, (rows+255)/256) }

// rmsDWGroup is the rows a block of the fused RMSNorm backward
// (k_rmsnorm_bwd_*8_dw, perBlock rows at a time) takes: at least 16, so
// that its partials (8 bytes a column, written, then read by the finish)
// are small beside what its rows move (10 to 14 bytes a column a row:
// dout, x, dx), and at least rows/256, so that there are at most 256
// blocks (and partial rows, as colSum has at most 256 chunks), rounded up
// to a whole number of perBlock. At 8192 rows: 32 rows, 256 blocks. A
// function of rows and dim alone (perBlock is dim's), as is every sum's
// order.
func rmsDWGroup(rows, perBlock int) int {
	g := max(16, (rows+255)/256)
	return (g + perBlock - 1) / perBlock * perBlock
}

// AdamW implements compute.Backend: one fp32 torch.optim.AdamW update of
// p with gradient g and moments m, v, in place.
func (b *Backend) AdamW(pT, gT, mT, vT compute.Tensor, n int, s compute.AdamWStep) {
	defer b.enter()()
	p, g, m, v := b.ten(pT, "AdamW p"), b.ten(gT, "AdamW g"), b.ten(mT, "AdamW m"), b.ten(vT, "AdamW v")
	for _, x := range []struct {
		t    *tensor
		what string
	}{{p, "AdamW p"}, {g, "AdamW g"}, {m, "AdamW m"}, {v, "AdamW v"}} {
		need(x.t, x.what, n, compute.F32)
	}
	b.wrote(m, v)
	pb := b.adamwShadow(p, n)
	b.ew("k_adamw", int64(n), dptr(p.p), dptr(g.p), dptr(m.p), dptr(v.p), int64(n), s.Beta1, s.Beta2, s.Eps, s.StepSize, s.BC2Sqrt, s.Decay, dptr(pb))
}

// adamwShadow records that an AdamW update writes parameter p (n) and
// returns its BF16 shadow for the update to write too (0: none yet).
func (b *Backend) adamwShadow(p *tensor, n int) uint64 {
	if b.shadow.off {
		b.wrote(p)
		return 0
	}
	// p is a parameter: watched from now on, and its shadow (made by the
	// first GEMM that reads it) written in the same pass.
	r := b.register(p.p, n)
	b.shadow.wseq++
	r.ver = b.shadow.wseq
	if r.bf == 0 {
		return 0
	}
	r.bfVer = r.ver
	return r.bf
}

// SumSquares implements compute.Backend: Σ x² in float64, deterministic
// (fixed grid, fixed trees). It synchronizes.
func (b *Backend) SumSquares(xT compute.Tensor, n int) float64 {
	defer b.enter()()
	x := b.ten(xT, "SumSquares x")
	need(x, "SumSquares x", n, compute.F32)
	if n == 0 {
		b.sync()
		return 0
	}
	nb := reduceGrid(n)
	part := b.alloc(int64(nb+1) * 8)
	b.launchKernel(launch{kernel: "k_sumsq_part", grid: [3]int{nb, 1, 1}, block: 256}, dptr(part+8), dptr(x.p), int64(n))
	b.launchKernel(launch{kernel: "k_sum_finish", grid: [3]int{1, 1, 1}, block: 256}, dptr(part), dptr(part+8), int32(nb))
	var out float64
	b.download(unsafe.Pointer(&out), part, 8)
	b.free(part)
	return out
}

// Scale implements compute.Backend: x *= c.
func (b *Backend) Scale(xT compute.Tensor, n int, c float32) {
	defer b.enter()()
	b.wroteT(xT)
	x := b.ten(xT, "Scale x")
	need(x, "Scale x", n, compute.F32)
	b.ew("k_scale", int64(n), dptr(x.p), int64(n), c)
}

// AbsMax implements compute.Backend: max |x|, NaN when x holds one. It
// synchronizes.
func (b *Backend) AbsMax(xT compute.Tensor, n int) float32 {
	defer b.enter()()
	x := b.ten(xT, "AbsMax x")
	need(x, "AbsMax x", n, act...)
	if n == 0 {
		b.sync()
		return 0
	}
	nb := reduceGrid(n)
	part := b.alloc(int64(nb+1) * 4)
	b.launchKernel(launch{kernel: "k_absmax_part", grid: [3]int{nb, 1, 1}, block: 256}, dptr(part+4), dptr(x.p), bf16Flag(x), int64(n))
	b.launchKernel(launch{kernel: "k_max_finish", grid: [3]int{1, 1, 1}, block: 256}, dptr(part), dptr(part+4), int32(nb))
	var out float32
	b.download(unsafe.Pointer(&out), part, 4)
	b.free(part)
	return out
}

// FakeQuantNVFP4 implements compute.Backend: bit for bit compute's scalar
// NVFP4 definitions (k_fakequant_nvfp4), the per-tensor scale computed
// here as compute.NVFP4GlobalScale does. dst may alias src.
func (b *Backend) FakeQuantNVFP4(dstT, srcT compute.Tensor, rows, cols int, amax float32) {
	defer b.enter()()
	dst, src := b.ten(dstT, "FakeQuantNVFP4 dst"), b.ten(srcT, "FakeQuantNVFP4 src")
	need(dst, "FakeQuantNVFP4 dst", rows*cols, act...)
	need(src, "FakeQuantNVFP4 src", rows*cols, act...)
	if dst.p == src.p && dst.dt != src.dt {
		panic("cuda: FakeQuantNVFP4 dst aliases src with another dtype")
	}
	nb := int64(rows) * int64((cols+15)/16)
	d, fresh := b.fakeQuantRegion(dst, src, rows, cols, amax)
	if fresh {
		return // dst already holds this quantization of src's current values
	}
	var db uint64
	if d != nil && d.bf != 0 {
		db = d.bf
	}
	if cols%16 == 0 { // whole blocks: a thread an element (k_fakequant_nvfp4_lanes)
		n := int64(rows) * int64(cols)
		b.ew("k_fakequant_nvfp4_lanes", n, dptr(dst.p), bf16Flag(dst), dptr(src.p), bf16Flag(src), n, compute.NVFP4GlobalScale(amax), dptr(db))
	} else {
		b.ew("k_fakequant_nvfp4", nb, dptr(dst.p), bf16Flag(dst), dptr(src.p), bf16Flag(src), int64(rows), int32(cols), compute.NVFP4GlobalScale(amax), dptr(db))
	}
	if db != 0 {
		d.bfVer = d.ver
	}
}

// MatMulBackward implements compute.Backend: dx (m,k) += dout·w ("NN"),
// dw (n,k) += doutᵀ·x ("NT"), both cuBLASLt GEMMs with BF16 operands
// (dout, x and w read in place when BF16, else rounded as read)
// accumulating in fp32 (beta = 1) into the fp32 gradients, or into a BF16
// dx (attention's dout: C and D BF16, the fp32 sum rounded once by the
// epilogue); dbias (n) += the column sums of an F32 dout in float64,
// deterministic, whose pass also writes the GEMMs' BF16 rounding of dout
// (no rounding pass of its own).
func (b *Backend) MatMulBackward(dxT, dwT, dbiasT, doutT, xT, wT compute.Tensor, m, n, k int) {
	defer b.enterKeep()()
	b.wroteT(dxT, dwT, dbiasT)
	b.label = "MatMulBackward"
	dout, w := b.ten(doutT, "MatMulBackward dout"), b.ten(wT, "MatMulBackward w")
	need(dout, "MatMulBackward dout", m*n, act...)
	need(w, "MatMulBackward w", n*k, compute.F32, compute.BF16)
	if dbiasT != nil && dout.dt != compute.F32 {
		panic("cuda: MatMulBackward with a BF16 dout and a dbias: the bias's column sums read the F32 gradient; pass dout in F32 where a bias trains")
	}
	// dw nil: a frozen weight (a LoRA student's base); x is not read.
	var dw, x, dx, db *tensor
	if dwT != nil {
		dw, x = b.ten(dwT, "MatMulBackward dw"), b.ten(xT, "MatMulBackward x")
		need(dw, "MatMulBackward dw", n*k, compute.F32)
		need(x, "MatMulBackward x", m*k, compute.F32, compute.BF16)
	}
	if dxT != nil {
		dx = b.ten(dxT, "MatMulBackward dx")
		need(dx, "MatMulBackward dx", m*k, act...)
	}
	if dbiasT != nil {
		db = b.ten(dbiasT, "MatMulBackward dbias")
		need(db, "MatMulBackward dbias", n, compute.F32)
	}
	if m == 0 || n == 0 || k == 0 {
		return
	}
	// A zeroed dx (zeros.go) is written by the GEMM (beta 0), not read.
	beta := float32(1)
	if dx != nil && b.takeZero(dx.p, int64(m)*int64(k)*int64(elemSize(dx.dt))) {
		beta = 0
	}
	b.flushZerosOver(dx, dw, db, dout, x, w)
	var dp, ds uint64
	if db != nil {
		// The bias's column sums read dout once and write its rounding for
		// the GEMMs in the same pass: the bits bf16Operand's pass makes.
		ds = b.alloc(int64(m) * int64(n) * 2)
		dp = ds
		b.colSum(db.p, dout.p, 0, 0, 0, m, n, ds)
	} else {
		dp, ds = b.bf16Operand(dout, m*n)
	}
	defer b.free(ds)
	if dx != nil {
		wp, ws := b.bf16Operand(w, n*k)
		switch {
		case dx.dt != compute.BF16:
			b.gemmTo(dx.p, dataF32, dp, wp, m, k, n, false, false, dataBF16, beta)
		case beta == 0:
			b.gemmTo(dx.p, dataBF16, dp, wp, m, k, n, false, false, dataBF16, 0)
		default:
			// cuBLASLt's BF16 C and D round the product to BF16 before
			// adding beta·C (the H200, 2026-11-27 and -28: dx[23] =
			// -0.35546875 = round(round(-1.3474) + 0.98828), not the
			// fp32 sum's rounding -0.359375), so a BF16 dx that
			// accumulates goes through fp32: widen, add, round once.
			// The trainer's BF16 dx (attention's dout) starts zeroed and
			// takes the branch above.
			cnt := int64(m) * int64(k)
			acc := b.alloc(cnt * 4)
			b.convert("k_bf16_to_f32", acc, dx.p, cnt)
			b.gemmTo(acc, dataF32, dp, wp, m, k, n, false, false, dataBF16, 1)
			b.convert("k_f32_to_bf16", dx.p, acc, cnt)
			b.free(acc)
		}
		b.free(ws)
	}
	if dw != nil {
		xp, xs := b.bf16Operand(x, m*k)
		b.gemmEx(dw.p, dp, xp, n, k, m, true, false, dataBF16, 1)
		b.free(xs)
	}
}

// colSum adds to dst (cols) the column sums of src (rows, cols), or of
// src·x·rstd[row] when x is set (RMSNorm's dw; x BF16 when xbf), in
// float64: chunks of rows in parallel (k_colsum_part), then the chunks in
// order (k_colsum_finish). A nonzero copy (rows, cols) BF16 gets the
// rounding of src in the same pass (a biased Linear's dout for its GEMMs).
func (b *Backend) colSum(dst, src, x uint64, xbf int32, rstd uint64, rows, cols int, copy uint64) {
	chunk := colChunk(rows)
	np := (rows + chunk - 1) / chunk
	part := b.alloc(int64(np) * int64(cols) * 8)
	l := launch{kernel: "k_colsum_part", grid: [3]int{(cols + 255) / 256, np, 1}, block: 256}
	if cols%4 == 0 && aligned16(src) && aligned16(x) && copy%8 == 0 {
		// Four columns a thread, 16-byte loads, 8 rows in flight a column.
		l = launch{kernel: "k_colsum_part4", grid: [3]int{(cols + 127) / 128, np, 1}, block: 256}
	}
	b.launchKernel(l, dptr(part), dptr(src), dptr(x), xbf, dptr(rstd), int64(rows), int32(cols), int32(chunk), dptr(copy))
	b.ew("k_colsum_finish", int64(cols), dptr(dst), dptr(part), int32(np), int32(cols))
	b.free(part)
}

// EmbedBackward implements compute.Backend: dtable += the rows of dout at
// ids, in token order (deterministic, no atomics): k_embed_links chains
// each id's tokens, k_embed_bwd walks each chain from its first token.
func (b *Backend) EmbedBackward(dtableT, doutT, idsT compute.Tensor, n, dim int) {
	defer b.enter()()
	b.wroteT(dtableT)
	dt, dout, ids := b.ten(dtableT, "EmbedBackward dtable"), b.ten(doutT, "EmbedBackward dout"), b.ten(idsT, "EmbedBackward ids")
	need(dt, "EmbedBackward dtable", dim, compute.F32)
	need(dout, "EmbedBackward dout", n*dim, compute.F32)
	need(ids, "EmbedBackward ids", n, compute.I32)
	if n == 0 || dim == 0 {
		return
	}
	// Each id's tokens chained (next, first), then a block a token: an
	// id's first token walks its chain, its threads across the columns.
	links := b.alloc(int64(n) * 8)
	next, first := links, links+uint64(n)*4
	b.ew("k_embed_links", int64(n), dptr(next), dptr(first), dptr(ids.p), int64(n))
	b.launchKernel(launch{kernel: "k_embed_bwd", grid: [3]int{min(n, 1<<20), 1, 1}, block: min(256, (dim+31)/32*32)},
		dptr(dt.p), dptr(dout.p), dptr(ids.p), dptr(next), dptr(first), int64(n), int32(dim))
	b.free(links)
}

// RMSNormBackward implements compute.Backend: dx += per row (the forward's
// geometry; a BF16 dx gets each sum rounded once), dw += Σ_rows
// dout·x·rstd (deterministic column sums).
func (b *Backend) RMSNormBackward(dxT, dwT, doutT, xT, wT, rstdT compute.Tensor, rows, dim int) {
	defer b.enterKeep()()
	b.rmsNormBackward("RMSNormBackward", dxT, nil, dwT, doutT, xT, wT, rstdT, rows, dim)
}

// GradDType implements compute.ActGrads: the activation dtype, or F32
// under Options.F32Grads.
func (b *Backend) GradDType() compute.DType {
	if b.f32Grads {
		return compute.F32
	}
	return b.act
}

// RMSNormBackwardCopy implements compute.ActGrads: RMSNormBackward's
// kernels with an F32 dx, each new dx value also rounded into dxc in the
// same pass (k_rmsnorm_bwd_*'s dxc): the residual stream's gradient and
// the BF16 operand the next MatMulBackward reads, with no pass between.
func (b *Backend) RMSNormBackwardCopy(dxT, dxcT, dwT, doutT, xT, wT, rstdT compute.Tensor, rows, dim int) {
	defer b.enterKeep()()
	b.rmsNormBackward("RMSNormBackwardCopy", dxT, dxcT, dwT, doutT, xT, wT, rstdT, rows, dim)
}

func (b *Backend) rmsNormBackward(what string, dxT, dxcT, dwT, doutT, xT, wT, rstdT compute.Tensor, rows, dim int) {
	b.wroteT(dxT, dwT, dxcT)
	dx, dw, dout := b.ten(dxT, what+" dx"), b.ten(dwT, what+" dw"), b.ten(doutT, what+" dout")
	x, w, rstd := b.ten(xT, what+" x"), b.ten(wT, what+" w"), b.ten(rstdT, what+" rstd")
	var dxc *tensor
	if dxcT != nil {
		dxc = b.ten(dxcT, what+" dxc")
		need(dxc, what+" dxc", rows*dim, compute.BF16)
		need(dx, what+" dx", rows*dim, compute.F32)
	} else {
		need(dx, what+" dx", rows*dim, act...)
	}
	need(dw, what+" dw", dim, compute.F32)
	need(dout, what+" dout", rows*dim, compute.F32)
	need(x, what+" x", rows*dim, act...)
	need(w, what+" w", dim, compute.F32, compute.BF16)
	need(rstd, what+" rstd", rows, compute.F32)
	if dx.p == dout.p || dxc != nil && (dxc.p == dx.p || dxc.p == dout.p) {
		panic("cuda: " + what + ": dx, dxc and dout must not alias")
	}
	if rows == 0 || dim == 0 {
		return
	}
	// A zeroed dx (zeros.go) is written, not read (the kernels' acc flag).
	acc := accArg(b.takeZero(dx.p, int64(rows)*int64(dim)*int64(elemSize(dx.dt))))
	b.flushZerosOver(dx, dxc, dw, dout, x, w, rstd)
	wp, wb := weightArg(w)
	cp := ptrOf(dxc)
	ptrs := []uint64{dx.p, dout.p, x.p, w.p}
	if dxc != nil {
		ptrs = append(ptrs, dxc.p)
	}
	if l, lanes, ok := rmsnormVecLaunch(rows, dim, ptrs...); ok && !b.rmsColsum {
		// dw's terms summed in the row kernel, from the dout and x it
		// holds: float64 partials per group of rows, then the groups in
		// order (backward.cu: rms_bwd_group8).
		perBlock := ewThreads / int(lanes)
		group := rmsDWGroup(rows, perBlock)
		np := (rows + group - 1) / group
		ku := (dim/8 + int(lanes) - 1) / int(lanes)
		part := b.alloc(int64(np) * int64(dim) * 8)
		l.kernel = map[string]string{"k_rmsnorm_warp8": "k_rmsnorm_bwd_warp8_dw", "k_rmsnorm_block8": "k_rmsnorm_bwd_block8_dw"}[l.kernel]
		l.grid, l.smem = [3]int{np, 1, 1}, 8*ku*ewThreads*8
		b.launchKernel(l, dptr(dx.p), bf16Flag(dx), cp, dptr(dout.p), dptr(x.p), bf16Flag(x), wp, wb, dptr(rstd.p), int64(rows), int32(dim), lanes, acc,
			dptr(part), int32(group))
		b.launchKernel(launch{kernel: "k_rmsnorm_dw_finish", grid: [3]int{(dim + 31) / 32, 1, 1}, block: 256}, dptr(dw.p), dptr(part), int32(np), int32(dim))
		b.free(part)
		return
	} else if ok {
		l.kernel = map[string]string{"k_rmsnorm_warp8": "k_rmsnorm_bwd_warp8", "k_rmsnorm_block8": "k_rmsnorm_bwd_block8"}[l.kernel]
		b.launchKernel(l, dptr(dx.p), bf16Flag(dx), cp, dptr(dout.p), dptr(x.p), bf16Flag(x), wp, wb, dptr(rstd.p), int64(rows), int32(dim), lanes, acc)
	} else {
		l := rmsnormLaunch(rows, dim)
		l.kernel = map[string]string{"k_rmsnorm_warp": "k_rmsnorm_bwd_warp", "k_rmsnorm_block": "k_rmsnorm_bwd_block"}[l.kernel]
		b.launchKernel(l, dptr(dx.p), bf16Flag(dx), cp, dptr(dout.p), dptr(x.p), bf16Flag(x), wp, wb, dptr(rstd.p), int64(rows), int32(dim), acc)
	}
	b.colSum(dw.p, dout.p, x.p, bf16Flag(x), rstd.p, rows, dim, 0)
}

// RoPEBackward implements compute.Backend: dx rotated by -angle in place.
func (b *Backend) RoPEBackward(dxT, cosT, sinT compute.Tensor, tokens, heads, headDim int) {
	defer b.enter()()
	b.ropeBackward("RoPEBackward", dxT, nil, cosT, sinT, tokens, heads, headDim)
}

// RoPEBackwardCopy implements compute.ActGrads: RoPEBackward whose kernel
// also writes the BF16 rounding of each rotated element into dxc.
func (b *Backend) RoPEBackwardCopy(dxT, dxcT, cosT, sinT compute.Tensor, tokens, heads, headDim int) {
	defer b.enter()()
	b.ropeBackward("RoPEBackwardCopy", dxT, dxcT, cosT, sinT, tokens, heads, headDim)
}

func (b *Backend) ropeBackward(what string, dxT, dxcT, cosT, sinT compute.Tensor, tokens, heads, headDim int) {
	b.wroteT(dxT, dxcT)
	x, cs, sn := b.ten(dxT, what+" dx"), b.ten(cosT, what+" cos"), b.ten(sinT, what+" sin")
	n := tokens * heads * headDim
	need(x, what+" dx", n, compute.F32)
	need(cs, what+" cos", tokens*(headDim/2), compute.F32)
	need(sn, what+" sin", tokens*(headDim/2), compute.F32)
	var cp uint64
	if dxcT != nil {
		c := b.ten(dxcT, what+" dxc")
		need(c, what+" dxc", n, compute.BF16)
		if c.p < x.p+uint64(n)*4 && x.p < c.p+uint64(n)*2 {
			panic(fmt.Sprintf("cuda: %s: dxc overlaps dx; pass a separate BF16 tensor", what))
		}
		cp = c.p
	}
	l, err := ropeLaunch(tokens, heads, headDim)
	b.must(err)
	l.kernel = "k_rope_table_bwd"
	b.launchKernel(l, dptr(x.p), dptr(cs.p), dptr(sn.p), int64(tokens), int32(heads), int32(headDim), dptr(cp))
}

// SwiGLUBackward implements compute.Backend: fp32 math; a BF16 dgate or
// dup gets each sum rounded once.
func (b *Backend) SwiGLUBackward(dgT, duT, doutT, gT, uT compute.Tensor, n int) {
	defer b.enterKeep()()
	b.wroteT(dgT, duT)
	dg, du, dout := b.ten(dgT, "SwiGLUBackward dgate"), b.ten(duT, "SwiGLUBackward dup"), b.ten(doutT, "SwiGLUBackward dout")
	g, u := b.ten(gT, "SwiGLUBackward gate"), b.ten(uT, "SwiGLUBackward up")
	need(g, "SwiGLUBackward gate", n, act...)
	need(u, "SwiGLUBackward up", n, act...)
	need(dg, "SwiGLUBackward dgate", n, act...)
	need(du, "SwiGLUBackward dup", n, act...)
	need(dout, "SwiGLUBackward dout", n, compute.F32)
	// Zeroed dgate and dup (zeros.go) are written, not read: the kernels'
	// acc flag, one for both (either one not zeroed: both flushed).
	acc := accArg(b.takeZeros(zeroRange{dg.p, int64(n) * int64(elemSize(dg.dt))}, zeroRange{du.p, int64(n) * int64(elemSize(du.dt))}))
	b.flushZerosOver(dg, du, dout, g, u)
	if n%8 == 0 && aligned16(dg.p) && aligned16(du.p) && aligned16(dout.p) && aligned16(g.p) && aligned16(u.p) {
		b.ew("k_swiglu_bwd_x8", int64(n/8), dptr(dg.p), bf16Flag(dg), dptr(du.p), bf16Flag(du), dptr(dout.p), dptr(g.p), bf16Flag(g),
			dptr(u.p), bf16Flag(u), int64(n/8), acc)
		return
	}
	b.ew("k_swiglu_bwd", int64(n), dptr(dg.p), bf16Flag(dg), dptr(du.p), bf16Flag(du), dptr(dout.p), dptr(g.p), bf16Flag(g), dptr(u.p),
		bf16Flag(u), int64(n), acc)
}

// AttentionBackward implements compute.Backend: cuDNN's fused flash
// attention backward where the backend uses it (cudnn.go), else this
// package's kernels (attention.cu), the probabilities recomputed from lse.
// For head_dim 64 and 128 the tensor-core chain (BF16 operands, fp32
// accumulators): D = dout·O from the forward's O (k_attn_dsum), dq
// (k_attn_bwd_dq_mma), then dk and dv (k_attn_bwd_dkv_mma). Other head dims
// (or Options.Attention "simt"): the fp32 kernels, k_attn_bwd_dq (dq, and
// D = Σ p·dp) then k_attn_bwd_dkv. Each kernel is the only writer of its
// rows: no atomics, deterministic.
func (b *Backend) AttentionBackward(dqT, dkT, dvT, doutT, qT, kT, vT, outT, lseT, startsT compute.Tensor, nSeq, maxLen, tokens, nHead, nKV, hd int, scale float32) {
	// cuDNN's path takes zeroed gradients (zeros.go) and flushes the rest;
	// the own kernels add to them, flushed first.
	defer b.enterKeep()()
	b.wroteT(dqT, dkT, dvT)
	b.label = "AttentionBackward"
	a := b.attnBwdArgs(dqT, dkT, dvT, doutT, qT, kT, vT, outT, lseT, startsT, nSeq, tokens, nHead, nKV, hd)
	if m := b.ownAttn(); b.attnBwd == "mma" && (m == "" || m == "auto") && (hd == 64 || hd == 128) { // under cuDNN or auto, the tensor-core chain's head dims
		b.flushZerosOver(a.operands()...)
		b.attentionBackward("mma", a, nSeq, tokens, nHead, nKV, hd, scale)
		return
	}
	if a.out != nil && b.useCudnn(tokens, nSeq, maxLen, nHead, nKV, hd) &&
		b.cudnnAttentionBackward(a, nSeq, maxLen, tokens, nHead, nKV, hd, scale) {
		return
	}
	b.flushZerosOver(a.operands()...)
	b.attentionBackward(b.ownAttn(), a, nSeq, tokens, nHead, nKV, hd, scale)
}

// attnBwdArgs are AttentionBackward's tensors, unwrapped and checked; out
// may be nil (the own tensor-core chain then recomputes it).
type attnBwdArgs struct{ dq, dk, dv, dout, q, k, v, out, lse, st *tensor }

func (a attnBwdArgs) operands() []*tensor {
	return []*tensor{a.dq, a.dk, a.dv, a.dout, a.q, a.k, a.v, a.out, a.lse, a.st}
}

func (b *Backend) attnBwdArgs(dqT, dkT, dvT, doutT, qT, kT, vT, outT, lseT, startsT compute.Tensor, nSeq, tokens, nHead, nKV, hd int) attnBwdArgs {
	t := func(x compute.Tensor, what string, n int, dts ...compute.DType) *tensor {
		r := b.ten(x, "AttentionBackward "+what)
		need(r, "AttentionBackward "+what, n, dts...)
		return r
	}
	nq, nk, f32 := tokens*nHead*hd, tokens*nKV*hd, compute.F32
	a := attnBwdArgs{dq: t(dqT, "dq", nq, f32), dk: t(dkT, "dk", nk, f32), dv: t(dvT, "dv", nk, act...), dout: t(doutT, "dout", nq, act...),
		q: t(qT, "q", nq, act...), k: t(kT, "k", nk, act...), v: t(vT, "v", nk, act...), lse: t(lseT, "lse", tokens*nHead, f32)}
	if outT != nil {
		a.out = t(outT, "out", nq, act...)
	}
	a.st = b.ten(startsT, "AttentionBackward starts")
	need(a.st, "AttentionBackward starts", nSeq+1, compute.I32)
	return a
}

// attentionBackward runs the own kernels.
func (b *Backend) attentionBackward(mode attnMode, a attnBwdArgs, nSeq, tokens, nHead, nKV, hd int, scale float32) {
	dq, dk, dv, dout, q, k, v, out, lse, st := a.dq, a.dk, a.dv, a.dout, a.q, a.k, a.v, a.out, a.lse, a.st
	if tokens == 0 {
		return
	}
	p, err := attentionBackwardLaunch(mode, tokens, nSeq, nHead, nKV, hd)
	b.must(err)
	// The kernels accumulate into F32: a BF16 dv gets an F32 scratch's sum
	// added at the end, rounded once (its zeroed scratch holds what an F32
	// dv would have gained).
	dvp := dv.p
	if dv.dt == compute.BF16 {
		nk := int64(tokens) * int64(nKV) * int64(hd)
		dvp = b.alloc(nk * 4)
		b.memset0(dvp, nk*4)
		defer func() {
			b.ew("k_add_to_act", nk, dptr(dv.p), dptr(dvp), nk)
			b.free(dvp)
		}()
	}
	tiles := b.alloc(int64(nSeq+1) * 4)
	dsum := b.alloc(int64(tokens) * int64(nHead) * 4)
	b.launchKernel(p.plan, dptr(tiles), dptr(st.p), int32(nSeq), int32(p.bq))
	nq, nk := tokens*nHead*hd, tokens*nKV*hd
	var ins [4]uint64 // scratch copies of the inputs
	defer func() {
		for _, c := range ins {
			b.free(c)
		}
	}()
	if !p.mma {
		var qp, kp, vp, dop, dos uint64
		qp, ins[0] = b.f32In(q, nq)
		kp, ins[1] = b.f32In(k, nk)
		vp, ins[2] = b.f32In(v, nk)
		dop, dos = b.f32In(dout, nq) // the fp32 kernels read an F32 dout
		defer b.free(dos)
		b.launchKernel(p.dq, dptr(dq.p), dptr(dsum), dptr(dop), dptr(qp), dptr(kp), dptr(vp), dptr(lse.p), dptr(st.p), dptr(tiles),
			int32(nSeq), int32(nHead), int32(nKV), int32(hd), scale)
		b.launchKernel(p.dkv, dptr(dk.p), dptr(dvp), dptr(dop), dptr(qp), dptr(kp), dptr(vp), dptr(lse.p), dptr(dsum), dptr(st.p), dptr(tiles),
			int32(nSeq), int32(nHead), int32(nKV), int32(hd), scale)
	} else {
		// BF16 operands, F32 ones rounded once per call (a BF16 dout, as
		// the decoder's with BF16 gradients, read in place); D from that
		// BF16 dO and the forward's output as stored, or O recomputed
		// when the caller passed none.
		var qb, kb, vb, db uint64
		qb, ins[0] = b.bf16In(q, nq)
		kb, ins[1] = b.bf16In(k, nk)
		vb, ins[2] = b.bf16In(v, nk)
		db, ins[3] = b.bf16In(dout, nq)
		if out != nil {
			b.launchKernel(p.dsum, dptr(dsum), dptr(db), dptr(out.p), bf16Flag(out), int64(tokens)*int64(nHead), int32(hd))
		} else {
			o := b.alloc(int64(nq) * 4)
			b.launchKernel(p.fwd, dptr(o), dptr(0), dptr(qb), dptr(kb), dptr(vb), dptr(st.p), dptr(tiles),
				int32(nSeq), int32(nHead), int32(nKV), scale)
			b.launchKernel(p.dsum, dptr(dsum), dptr(db), dptr(o), int32(0), int64(tokens)*int64(nHead), int32(hd))
			b.free(o)
		}
		b.launchKernel(p.dq, dptr(dq.p), dptr(db), dptr(qb), dptr(kb), dptr(vb), dptr(lse.p), dptr(dsum), dptr(st.p), dptr(tiles),
			int32(nSeq), int32(nHead), int32(nKV), scale)
		b.launchKernel(p.dkv, dptr(dk.p), dptr(dvp), dptr(db), dptr(qb), dptr(kb), dptr(vb), dptr(lse.p), dptr(dsum), dptr(st.p), dptr(tiles),
			int32(nSeq), int32(nHead), int32(nKV), scale)
	}
	b.free(tiles)
	b.free(dsum)
}

// lossTileCols is the vocabulary tile width of a LossHead call: h.TileCols,
// or what keeps the M x cols F32 logits (and their BF16 gradient) within
// lossTileBudget, a multiple of 64 columns.
func lossTileCols(h *compute.LossHead) int {
	if h.TileCols > 0 {
		return min(h.TileCols, h.V)
	}
	vt := lossTileBudget / (4 * max(h.M, 1))
	vt = max(vt/64*64, 64)
	return min(vt, h.V)
}

// lossTileSmem is the tile kernels' shared memory (losshead.cu): a row's
// K teacher ids and the mask of the tile's n columns (a bit each).
func lossTileSmem(K, n int) int { return 4*K + 4*((n+31)/32) }

// lossTileBudget bounds the loss head's logit tile (M x cols fp32).
const lossTileBudget = 256 << 20

// lossCheck unwraps and checks a LossHead's tensors.
func (b *Backend) lossCheck(h *compute.LossHead, what string) (x, w, rows, labels, ids *tensor) {
	if h.M < 0 || h.C < 0 || h.V < 1 || h.K < 0 || h.K > h.V {
		panic(fmt.Sprintf("cuda: %s with M=%d C=%d V=%d K=%d: want M, C >= 0, V >= 1, 0 <= K <= V", what, h.M, h.C, h.V, h.K))
	}
	x, w = b.ten(h.X, what+" X"), b.ten(h.W, what+" W")
	rows, labels = b.ten(h.Rows, what+" Rows"), b.ten(h.Labels, what+" Labels")
	need(x, what+" X", h.C, act...)
	need(w, what+" W", h.V*h.C, compute.F32, compute.BF16)
	need(rows, what+" Rows", h.M, compute.I32)
	need(labels, what+" Labels", h.M, compute.I32)
	if h.K > 0 {
		ids = b.ten(h.TopIDs, what+" TopIDs")
		need(ids, what+" TopIDs", h.M*h.K, compute.I32)
	}
	return
}

func ptrOf(t *tensor) dptr {
	if t == nil {
		return 0
	}
	return dptr(t.p)
}

// LossHeadForward implements compute.Backend: pass 1 (lossPass1), its
// statistics downloaded. It synchronizes once.
func (b *Backend) LossHeadForward(h *compute.LossHead) compute.LossStats {
	defer b.enter()()
	b.label = "LossHeadForward"
	M, K := h.M, h.K
	st := compute.LossStats{LseT: make([]float64, M), Lse1: make([]float64, M), Tail: make([]float64, M),
		ZK: make([]float32, M*K), ZLab: make([]float32, M)}
	p1 := b.lossPass1(h, "LossHeadForward", h.Keep)
	if M == 0 {
		b.sync()
		return st
	}
	host := make([]float64, 3*M)
	b.download(unsafePtr(host), p1.st, int64(3*M)*8)
	copy(st.LseT, host[:M])
	copy(st.Lse1, host[M:2*M])
	copy(st.Tail, host[2*M:])
	if K > 0 {
		b.download(unsafePtr(st.ZK), p1.zk, int64(M*K)*4)
	}
	b.download(unsafePtr(st.ZLab), p1.zlab, int64(M)*4)
	p1.free(b)
	return st
}

// pass1 are pass 1's results on the device: st (3, M) doubles LseT, Lse1,
// Tail, zk (M,K) and zlab (M) F32.
type pass1 struct {
	st, zk, zlab uint64
}

func (p pass1) free(b *Backend) {
	for _, q := range []uint64{p.st, p.zk, p.zlab} {
		b.free(q)
	}
}

// lossPass1 enqueues pass 1: for each vocabulary tile a cuBLASLt GEMM
// (BF16 operands, fp32 logits of the counted rows), folded by
// k_loss_fwd_tile into each row's online log-sum-exps (at 1/T and, when
// T != 1, at 1), its tail over v ∉ K, and the logits at its teacher ids
// and label. M = 0 allocates nothing. With keepW, a BF16 copy of W made
// for this call (keptWeight) is kept for pass 2.
func (b *Backend) lossPass1(h *compute.LossHead, what string, keepW bool) pass1 {
	M, C, V, K := h.M, h.C, h.V, h.K
	x, w, rows, labels, ids := b.lossCheck(h, what)
	b.dropKept()
	if M == 0 {
		return pass1{}
	}
	sepCE := boolArg(h.InvT != 1)
	xc := b.gatherRowsBF16(h, rows)
	wp, ws := b.bf16Operand(w, V*C)
	if ws != 0 && keepW {
		b.keep(ws)
		b.keptW = &keptWeight{h: h, p: w.p, n: V * C, bf: ws}
		ws = 0 // (not freed below)
	}
	vt := lossTileCols(h)
	// The tile, or with h.Keep every tile at once: tile v0 at element
	// M·v0, each M x n as the GEMM writes it (keptLogits).
	var tiles uint64
	if h.Keep && !b.noKeep {
		tiles = b.alloc(int64(M) * int64(V) * 4)
		b.kept = &keptLogits{h: h, x: x.p, w: w.p, m: M, v: V, c: C, vt: vt, buf: tiles}
	} else {
		tiles = b.alloc(int64(M) * int64(vt) * 4)
	}
	state := b.alloc(int64(M) * 5 * 8)
	zk, zlab := b.alloc(int64(M*K)*4), b.alloc(int64(M)*4)
	b.ew("k_loss_init", int64(M), dptr(state), int64(M))
	for v0 := 0; v0 < V; v0 += vt {
		n := min(vt, V-v0)
		tile := tiles
		if b.kept != nil {
			tile = b.kept.tile(v0)
		}
		b.gemm(tile, xc, wp+uint64(v0)*uint64(C)*2, M, n, C, dataBF16)
		b.launchKernel(launch{kernel: "k_loss_fwd_tile", grid: [3]int{M, 1, 1}, block: 256, smem: lossTileSmem(K, n)},
			dptr(tile), int32(n), int32(v0), h.InvT, sepCE, ptrOf(ids), int32(K), dptr(labels.p), dptr(state), int64(M), dptr(zk), dptr(zlab))
	}
	out := b.alloc(int64(M) * 3 * 8)
	b.ew("k_loss_fwd_finish", int64(M), dptr(out), dptr(state), int64(M), sepCE)
	if b.kept != nil {
		tiles = 0 // kept for pass 2
	}
	for _, p := range []uint64{xc, ws, tiles, state} {
		if p != 0 {
			b.free(p)
		}
	}
	return pass1{st: out, zk: zk, zlab: zlab}
}

// keptLogits are pass 1's logits of a LossHead whose caller let them be
// kept (compute.LossHead.Keep): every vocabulary tile at once, tile v0's
// M x n logits at element M·v0, written by the GEMM that pass 2 would
// run again. Pass 2 of the same call reads them instead (the same bits:
// the same GEMM into the same shape, 16-byte aligned, so the same
// cuBLASLt plan) and frees them; any other loss-head call frees them
// first (dropKept), so they never outlive the call that made them.
type keptLogits struct {
	h           *compute.LossHead
	x, w        uint64
	m, v, c, vt int
	buf         uint64
}

func (k *keptLogits) tile(v0 int) uint64 { return k.buf + uint64(k.m)*uint64(v0)*4 }

// matches reports whether pass 2 of h reads from the same pass 1.
func (k *keptLogits) matches(h *compute.LossHead, x, w uint64, vt int) bool {
	return k.h == h && k.x == x && k.w == w && k.m == h.M && k.v == h.V && k.c == h.C && k.vt == vt
}

// keptWeight is pass 1's BF16 copy of a LossHead's W where W has no
// shadow (bf16Operand's per-use copy: a sharded student's LM head, its
// whole weights gathered from the ranks' parts, is no parameter AdamW
// updates), kept for pass 2 of the same h instead of rounding W again:
// LossHeadForwardKD's pass 1 (a training step's: LossHeadBackward
// follows) or, with Keep, LossHeadForward's. Pass 2 reads it only while
// nothing wrote W since (wroteRange marks it stale): the same rounding of
// the same values, the same bits. Pass 2 frees it, and so does any other
// loss-head call first (dropKept).
type keptWeight struct {
	h     *compute.LossHead
	p     uint64 // W's address
	n     int    // its elements
	bf    uint64 // the copy
	stale bool
}

// dropKept frees kept logits and a kept copy of W no pass 2 read.
func (b *Backend) dropKept() {
	if b.kept != nil {
		b.free(b.kept.buf)
		b.kept = nil
	}
	if b.keptW != nil {
		b.free(b.keptW.bf)
		b.keptW = nil
	}
}

// LossHeadForwardKD implements compute.DeviceLossCoef: pass 1, then
// k_loss_coef turns its statistics into pass 2's coefficients, one thread
// per counted position, all without a synchronization. The positions'
// loss values are copied into a pinned block right away, behind an
// event (staging.go), and Read waits for that event only, or not at all
// when the host has synchronized since (Options.Pageable: they stay on
// the device until Read downloads them).
func (b *Backend) LossHeadForwardKD(h *compute.LossHead, kd *compute.LossKD, c *compute.LossCoef) compute.LossValues {
	defer b.enter()()
	b.label = "LossHeadForwardKD"
	M, K := h.M, h.K
	if (kd == nil) != (K == 0) {
		panic(fmt.Sprintf("cuda: LossHeadForwardKD with K=%d and kd %v: a KD term needs the teacher's K > 0 columns, CE only K = 0", K, kd != nil))
	}
	lseT, lse1, a := b.ten(c.LseT, "LossCoef LseT"), b.ten(c.Lse1, "LossCoef Lse1"), b.ten(c.A, "LossCoef A")
	need(lseT, "LossCoef LseT", M, compute.F32)
	need(lse1, "LossCoef Lse1", M, compute.F32)
	need(a, "LossCoef A", M, compute.F32)
	var ck, lp, col *tensor
	tail := compute.TailBucket
	var lpScale, scale float64
	if K > 0 {
		ck = b.ten(c.CK, "LossCoef CK")
		need(ck, "LossCoef CK", M*K, compute.F32)
		lp, col = b.ten(kd.LP, "LossKD LP"), b.ten(kd.Col, "LossKD Col")
		need(lp, "LossKD LP", M*K, compute.F32)
		need(col, "LossKD Col", M*K, compute.I32)
		switch kd.Tail {
		case compute.TailBucket, compute.TailRenormalize, compute.TailZero:
		default:
			panic(fmt.Sprintf("cuda: LossHeadForwardKD: tail mode %d: want compute.TailBucket, TailRenormalize or TailZero", kd.Tail))
		}
		tail, lpScale, scale = kd.Tail, kd.LPScale, kd.Scale
	}
	b.wroteT(c.LseT, c.Lse1, c.A, c.CK)
	p1 := b.lossPass1(h, "LossHeadForwardKD", true)
	v := &lossValues{b: b, m: M}
	if M == 0 {
		return v
	}
	v.vals = b.alloc(int64(2*M) * 8)
	b.keep(v.vals) // the caller's (lossValues)
	b.launchKernel(launch{kernel: "k_loss_coef", grid: [3]int{(M + coefThreads - 1) / coefThreads, 1, 1}, block: coefThreads},
		dptr(p1.st), dptr(p1.zk), dptr(p1.zlab), ptrOf(lp), ptrOf(col), int32(K), int32(tail), h.InvT, lpScale, scale,
		dptr(lseT.p), dptr(lse1.p), dptr(a.p), ptrOf(ck), dptr(v.vals), int64(M))
	p1.free(b)
	if !b.pageable && !b.besideOn {
		v.later = b.downloadLater(v.vals, int64(2*v.m)*8)
		b.free(v.vals)
		v.vals = 0
	}
	return v
}

// coefThreads is k_loss_coef's block: one thread per position, and small
// blocks so that a few thousand positions still spread over every SM.
const coefThreads = 64

// lossValues are a LossHeadForwardKD's per-position D and CE on the
// device (vals (2, M) doubles).
type lossValues struct {
	b     *Backend
	m     int
	vals  uint64 // on the device (Options.Pageable), else 0
	later *laterCopy
	read  bool
}

// Read implements compute.LossValues.
func (v *lossValues) Read(d, ce []float64) {
	b := v.b
	defer b.enter()()
	if v.read {
		panic("cuda: LossValues read twice")
	}
	v.read = true
	if len(d) < v.m || len(ce) < v.m {
		panic(fmt.Sprintf("cuda: LossValues.Read into %d and %d values, want %d each", len(d), len(ce), v.m))
	}
	if v.m == 0 {
		return
	}
	if v.later != nil {
		host := unsafe.Slice((*float64)(b.arrived(v.later, "a loss's values")), 2*v.m)
		copy(d, host[:v.m])
		copy(ce, host[v.m:])
		b.putBlock(v.later.host, v.later.size)
		v.later = nil
		return
	}
	host := make([]float64, 2*v.m)
	b.download(unsafePtr(host), v.vals, int64(2*v.m)*8)
	copy(d, host[:v.m])
	copy(ce, host[v.m:])
	b.free(v.vals)
}

// gatherRowsBF16 returns the counted rows of h.X as a BF16 (M,C) scratch
// copy, the GEMMs' operand.
func (b *Backend) gatherRowsBF16(h *compute.LossHead, rows *tensor) uint64 {
	x := b.ten(h.X, "LossHead X")
	xc := b.alloc(int64(h.M) * int64(h.C) * 2)
	b.ew("k_gather_rows_bf16", int64(h.M)*int64(h.C), dptr(xc), dptr(x.p), bf16Flag(x), dptr(rows.p), int64(h.M), int32(h.C))
	return xc
}

// LossHeadBackward implements compute.Backend: each tile's logits are
// recomputed (a GEMM), turned into dL/dz in BF16 by k_loss_bwd_tile, and
// two GEMMs accumulate dxc (M,C) += dz·W_tile and dW_tile += dzᵀ·xc in
// fp32; dxc is added into dx at the counted rows last.
func (b *Backend) LossHeadBackward(h *compute.LossHead, c *compute.LossCoef, dxT, dwT compute.Tensor) {
	defer b.enter()()
	b.label = "LossHeadBackward"
	M, C, V, K := h.M, h.C, h.V, h.K
	x, w, rows, labels, ids := b.lossCheck(h, "LossHeadBackward")
	kept := b.kept
	b.kept = nil
	if kept != nil {
		if !kept.matches(h, x.p, w.p, lossTileCols(h)) {
			b.free(kept.buf)
			kept = nil
		} else {
			defer b.free(kept.buf)
		}
	}
	var wKept uint64 // pass 1's copy of W (keptWeight), freed on return
	if k := b.keptW; k != nil {
		b.keptW = nil
		if k.h == h && k.p == w.p && k.n == V*C && !k.stale {
			wKept = k.bf
		}
		defer b.free(k.bf)
	}
	dx := b.ten(dxT, "LossHeadBackward dx")
	need(dx, "LossHeadBackward dx", C, compute.F32)
	var dw *tensor // nil: a frozen LM head, no weight gradient (and no GEMM for it)
	if dwT != nil {
		b.wroteT(dwT)
		dw = b.ten(dwT, "LossHeadBackward dw")
		need(dw, "LossHeadBackward dw", V*C, compute.F32)
	}
	b.wroteT(dxT)
	if M == 0 {
		return
	}
	lseT, lse1, a := b.ten(c.LseT, "LossCoef LseT"), b.ten(c.Lse1, "LossCoef Lse1"), b.ten(c.A, "LossCoef A")
	need(lseT, "LossCoef LseT", M, compute.F32)
	need(lse1, "LossCoef Lse1", M, compute.F32)
	need(a, "LossCoef A", M, compute.F32)
	var ck *tensor
	if K > 0 {
		ck = b.ten(c.CK, "LossCoef CK")
		need(ck, "LossCoef CK", M*K, compute.F32)
	}
	sepCE := boolArg(h.InvT != 1 && c.WSFT != 0)
	xc := b.gatherRowsBF16(h, rows)
	wp, ws := wKept, uint64(0)
	if wp == 0 {
		wp, ws = b.bf16Operand(w, V*C)
	}
	vt := lossTileCols(h)
	var tile uint64 // the recomputed tile; none with kept logits
	if kept == nil {
		tile = b.alloc(int64(M) * int64(vt) * 4)
	}
	dz := b.alloc(int64(M) * int64(vt) * 2)
	dxc := b.alloc(int64(M) * int64(C) * 4)
	b.memset0(dxc, int64(M)*int64(C)*4)
	for v0 := 0; v0 < V; v0 += vt {
		n := min(vt, V-v0)
		wt := wp + uint64(v0)*uint64(C)*2
		if kept != nil {
			tile = kept.tile(v0)
		} else {
			b.gemm(tile, xc, wt, M, n, C, dataBF16)
		}
		b.launchKernel(launch{kernel: "k_loss_bwd_tile", grid: [3]int{M, 1, 1}, block: 256, smem: lossTileSmem(K, n)},
			dptr(dz), dptr(tile), int32(n), int32(v0), h.InvT, sepCE, dptr(lseT.p), dptr(lse1.p), dptr(a.p), ptrOf(ck), ptrOf(ids), int32(K),
			dptr(labels.p), c.WSFT)
		b.gemmEx(dxc, dz, wt, M, C, n, false, false, dataBF16, 1)
		if dw != nil {
			b.gemmEx(dw.p+uint64(v0)*uint64(C)*4, dz, xc, n, C, M, true, false, dataBF16, 1)
		}
	}
	b.ew("k_scatter_add_rows", int64(M)*int64(C), dptr(dx.p), dptr(dxc), dptr(rows.p), int64(M), int32(C))
	if kept != nil {
		tile = 0 // kept.buf, freed on return
	}
	for _, p := range []uint64{xc, ws, tile, dz, dxc} {
		if p != 0 {
			b.free(p)
		}
	}
}
