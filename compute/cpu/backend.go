// Package cpu is the reference backend of package compute: fp32 everywhere,
// OpenBLAS SGEMM for matrix products, C loops (kernels.c) for the
// elementwise and reduction work, and goroutines splitting both across the
// backend's worker count (New(threads)). It runs the conformance suite
// (compute/computetest) with FP32 tolerances; every other backend is held
// to the same float64 formulas.
//
// Weights given in BF16 are widened to F32 at upload, so the CPU path holds
// weights at 4 bytes a parameter; activations are bounded by the token budget
// of each call (see package infer). Tensors are host memory: the backend
// implements compute.Host, and a view is a sub-slice of its parent.
package cpu

/*
#include "kernels.h"
*/
import "C"

import (
	"fmt"
	"math"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"distill/compute"
)

// tensor is the CPU Tensor: a host slice (a view shares its parent's).
type tensor struct {
	dt  compute.DType
	f32 []float32
	i32 []int32
}

func (t *tensor) DType() compute.DType { return t.dt }
func (t *tensor) Len() int {
	if t.dt == compute.I32 {
		return len(t.i32)
	}
	return len(t.f32)
}

// Backend is the CPU backend; safe for concurrent use. Kernel scratch
// (attention scores, LM-head tiles, MoE rows) is reused across calls from a
// free list, so a forward's memory is its activations plus one set of
// scratch, not one per layer.
type Backend struct {
	threads int
	mu      sync.Mutex
	free    [][]float32
}

// New returns a CPU backend whose kernels split their work over threads
// goroutines (0 or less: one per core). Results are deterministic for a
// given thread count.
func New(threads int) *Backend {
	initBLAS()
	if threads <= 0 {
		threads = runtime.NumCPU()
	}
	return &Backend{threads: threads}
}

// Threads is the backend's worker count.
func (b *Backend) Threads() int { return b.threads }

// scratch returns a zeroed-or-dirty buffer of n floats from the free list
// (the smallest that fits, if it is at most twice as large: a small
// request must not take the loss head's 64 MiB tile, which the next
// request for a tile would then allocate again), or a new one.
func (b *Backend) scratch(n int) []float32 {
	b.mu.Lock()
	defer b.mu.Unlock()
	best := -1
	for i, f := range b.free {
		if cap(f) >= n && cap(f) <= 2*n && (best < 0 || cap(f) < cap(b.free[best])) {
			best = i
		}
	}
	if best < 0 {
		return make([]float32, n)
	}
	f := b.free[best]
	b.free = append(b.free[:best], b.free[best+1:]...)
	return f[:n]
}

// release returns buffers to the free list.
func (b *Backend) release(bufs ...[]float32) {
	b.mu.Lock()
	b.free = append(b.free, bufs...)
	b.mu.Unlock()
}

var (
	_ compute.Backend         = (*Backend)(nil)
	_ compute.Host            = (*Backend)(nil)
	_ compute.ScratchReporter = (*Backend)(nil)
)

// Name implements compute.Backend.
func (*Backend) Name() string { return "cpu" }

// ActDType implements compute.Backend: the reference keeps activations in
// F32 (its kernels refuse BF16 activation operands).
func (*Backend) ActDType() compute.DType { return compute.F32 }

func cput(t compute.Tensor) *tensor {
	ct, ok := t.(*tensor)
	if !ok {
		panic(fmt.Sprintf("cpu: tensor of another backend (%T)", t))
	}
	return ct
}

func f32(t compute.Tensor) []float32 {
	if t == nil {
		return nil
	}
	ct := cput(t)
	if ct.dt != compute.F32 {
		panic(fmt.Sprintf("cpu: want an f32 tensor, got %v", ct.dt))
	}
	return ct.f32
}

func i32(t compute.Tensor) []int32 {
	ct := cput(t)
	if ct.dt != compute.I32 {
		panic(fmt.Sprintf("cpu: want an i32 tensor, got %v", ct.dt))
	}
	return ct.i32
}

// F32 exposes the host slice of a CPU F32 tensor (tests).
func F32(t compute.Tensor) []float32 { return f32(t) }

// HostF32 implements compute.Host.
func (*Backend) HostF32(t compute.Tensor) []float32 { return f32(t) }

// New implements compute.Backend. BF16 tensors are stored widened.
func (*Backend) New(dt compute.DType, n int) compute.Tensor {
	switch dt {
	case compute.I32:
		return &tensor{dt: dt, i32: make([]int32, n)}
	default:
		return &tensor{dt: compute.F32, f32: make([]float32, n)}
	}
}

// FromF32 implements compute.Backend.
func (*Backend) FromF32(src []float32) compute.Tensor {
	return &tensor{dt: compute.F32, f32: append([]float32(nil), src...)}
}

// FromI32 implements compute.Backend.
func (*Backend) FromI32(src []int32) compute.Tensor {
	return &tensor{dt: compute.I32, i32: append([]int32(nil), src...)}
}

// Weight implements compute.Backend: BF16 is widened to F32.
func (*Backend) Weight(src any) (compute.Tensor, error) {
	switch s := src.(type) {
	case []float32:
		return &tensor{dt: compute.F32, f32: s}, nil
	case []uint16:
		out := make([]float32, len(s))
		compute.WidenBF16(out, s)
		return &tensor{dt: compute.F32, f32: out}, nil
	}
	return nil, fmt.Errorf("cpu: weight of type %T; want []float32 or []uint16 (bf16)", src)
}

// View implements compute.Backend.
func (*Backend) View(t compute.Tensor, off, n int) compute.Tensor {
	ct := cput(t)
	if ct.dt == compute.I32 {
		return &tensor{dt: ct.dt, i32: ct.i32[off : off+n : off+n]}
	}
	return &tensor{dt: ct.dt, f32: ct.f32[off : off+n : off+n]}
}

// Zero implements compute.Backend.
func (b *Backend) Zero(t compute.Tensor) {
	ct := cput(t)
	if ct.dt == compute.I32 {
		clear(ct.i32)
		return
	}
	x := ct.f32
	b.parallel((len(x)+1<<16-1)>>16, func(lo, hi int) {
		clear(x[lo<<16 : min(hi<<16, len(x))])
	})
}

// Copy implements compute.Backend.
func (*Backend) Copy(dst, src compute.Tensor) {
	d, s := cput(dst), cput(src)
	if d.dt != s.dt {
		panic(fmt.Sprintf("cpu: copy of %v into %v", s.dt, d.dt))
	}
	if s.dt == compute.I32 {
		copy(d.i32[:len(s.i32)], s.i32)
		return
	}
	copy(d.f32[:len(s.f32)], s.f32)
}

// WriteF32 implements compute.Backend.
func (*Backend) WriteF32(t compute.Tensor, src []float32) { copy(f32(t)[:len(src)], src) }

// ReadF32 implements compute.Backend.
func (*Backend) ReadF32(t compute.Tensor, dst []float32) { copy(dst, f32(t)) }

// ReadI32 implements compute.Backend.
func (*Backend) ReadI32(t compute.Tensor, dst []int32) { copy(dst, i32(t)) }

// Free implements compute.Backend.
func (*Backend) Free(t compute.Tensor) {
	if ct, ok := t.(*tensor); ok {
		ct.f32, ct.i32 = nil, nil
	}
}

// parallel runs fn over [0,n) split into the backend's threads contiguous
// ranges. A panic in fn reaches the caller as a *WorkerPanic (see group).
func (b *Backend) parallel(n int, fn func(lo, hi int)) {
	b.rows(n, 1<<14, func(_, lo, hi int) { fn(lo, hi) })
}

// rows runs fn over [0,n) split into at most b.threads contiguous ranges,
// inline when n·costPerRow is too small to pay for goroutines. The worker
// index w (below b.threads) lets callers keep per-worker partial sums,
// summed afterwards in worker order so results are deterministic for a
// given thread count. A panic in fn reaches the caller as a *WorkerPanic.
func (b *Backend) rows(n, costPerRow int, fn func(w, lo, hi int)) {
	t := min(b.threads, n)
	if t <= 1 || n*costPerRow < 1<<14 {
		if n > 0 {
			fn(0, 0, n)
		}
		return
	}
	var g group
	for w := 0; w < t; w++ {
		lo, hi := n*w/t, n*(w+1)/t
		g.Go(func() { fn(w, lo, hi) })
	}
	g.Wait()
}

// workQueue runs fn(w, i) for every i in [0,n) on up to b.threads
// goroutines that pull items from a shared counter (dynamic scheduling, for
// uneven items such as attention blocks); w in [0, b.threads) names the
// goroutine, so fn can keep per-worker scratch. A panic in fn reaches the
// caller as a *WorkerPanic once every worker has stopped.
func (b *Backend) workQueue(n int, fn func(w, i int)) {
	t := max(min(b.threads, n), 1)
	var next atomic.Int64
	var g group
	for w := 0; w < t; w++ {
		g.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				fn(w, i)
			}
		})
	}
	g.Wait()
}

// sgemm is the backend's multi-threaded GEMM.
func (b *Backend) sgemm(transA, transB bool, m, n, k int, alpha float32, a []float32, lda int, bm []float32, ldb int, beta float32, c []float32, ldc int) {
	sgemmPar(b.threads, transA, transB, m, n, k, alpha, a, lda, bm, ldb, beta, c, ldc)
}

func fp(s []float32) *C.float {
	if len(s) == 0 {
		return nil
	}
	return (*C.float)(unsafe.Pointer(&s[0]))
}

// MatMul implements compute.Backend: out (m,n) = x (m,k) · w (n,k)ᵀ + bias.
// An FP8 w (WeightFP8) multiplies x's rows quantized per row, as
// compute's "FP8 weights" defines.
func (b *Backend) MatMul(out, x, w, bias compute.Tensor, m, n, k int) {
	o, xs := f32(out), f32(x)
	ws := fp8Values(w)
	if ws != nil {
		xq := b.scratch(m * k)
		defer b.release(xq)
		b.quantRowsFP8(xq, xs[:m*k], m, k)
		xs = xq
	} else {
		ws = f32(w)
	}
	b.sgemm(false, true, m, n, k, 1, xs, k, ws, k, 0, o, n)
	if bias != nil {
		bs := f32(bias)
		b.parallel(m, func(lo, hi int) {
			for r := lo; r < hi; r++ {
				C.k_add(fp(o[r*n:]), fp(bs), C.long(n))
			}
		})
	}
}

// Embed implements compute.Backend.
func (b *Backend) Embed(out, table, ids compute.Tensor, n, dim int) {
	o, tb, id := f32(out), f32(table), i32(ids)
	b.rows(n, dim, func(_, lo, hi int) {
		for i := lo; i < hi; i++ {
			copy(o[i*dim:(i+1)*dim], tb[int(id[i])*dim:])
		}
	})
}

// RMSNorm implements compute.Backend.
func (b *Backend) RMSNorm(out, rstd, x, w compute.Tensor, rows, dim int, eps float32) {
	o, xs, ws, rs := f32(out), f32(x), f32(w), f32(rstd)
	b.parallel(rows, func(lo, hi int) {
		var rp *C.float
		if rs != nil {
			rp = fp(rs[lo:])
		}
		C.k_rmsnorm(fp(o[lo*dim:]), rp, fp(xs[lo*dim:]), fp(ws), C.long(hi-lo), C.long(dim), C.float(eps))
	})
}

// RoPE implements compute.Backend.
func (b *Backend) RoPE(x, cos, sin compute.Tensor, tokens, heads, headDim int) {
	b.rotate(f32(x), f32(cos), f32(sin), tokens, heads, headDim, 1)
}

// RMSNormRoPE implements compute.Backend: RMSNorm, then RoPE (the
// reference does not fuse them).
func (b *Backend) RMSNormRoPE(out, rstd, x, w, cos, sin compute.Tensor, tokens, heads, headDim int, eps float32) {
	b.RMSNorm(out, rstd, x, w, tokens*heads, headDim, eps)
	b.RoPE(out, cos, sin, tokens, heads, headDim)
}

// RoPEBackward implements compute.Backend: the rotation by -angle.
func (b *Backend) RoPEBackward(dx, cos, sin compute.Tensor, tokens, heads, headDim int) {
	b.rotate(f32(dx), f32(cos), f32(sin), tokens, heads, headDim, -1)
}

// rotate applies the rotate-half rotation by sign·angle in place.
func (b *Backend) rotate(xs, cs, ss []float32, tokens, heads, headDim int, sign float32) {
	half := headDim / 2
	b.rows(tokens, heads*headDim, func(_, lo, hi int) {
		for t := lo; t < hi; t++ {
			c, s := cs[t*half:(t+1)*half], ss[t*half:(t+1)*half]
			for h := 0; h < heads; h++ {
				v := xs[(t*heads+h)*headDim : (t*heads+h+1)*headDim]
				for i := 0; i < half; i++ {
					si := sign * s[i]
					x1, x2 := v[i], v[i+half]
					v[i] = x1*c[i] - x2*si
					v[i+half] = x2*c[i] + x1*si
				}
			}
		}
	})
}

// SwiGLU implements compute.Backend.
func (b *Backend) SwiGLU(out, gate, up compute.Tensor, n int) {
	o, g, u := f32(out), f32(gate), f32(up)
	b.parallel((n+4095)/4096, func(lo, hi int) {
		a, b := lo*4096, min(hi*4096, n)
		C.k_swiglu(fp(o[a:]), fp(g[a:]), fp(u[a:]), C.long(b-a))
	})
}

// AddRMSNorm implements compute.Backend: Add, then RMSNorm (the reference
// does not fuse them).
func (be *Backend) AddRMSNorm(out, rstd, a, b, w compute.Tensor, rows, dim int, eps float32) {
	be.Add(a, b, rows*dim)
	be.RMSNorm(out, rstd, a, w, rows, dim, eps)
}

// Add implements compute.Backend.
func (be *Backend) Add(a, b compute.Tensor, n int) {
	as, bs := f32(a), f32(b)
	be.parallel((n+4095)/4096, func(lo, hi int) {
		x, y := lo*4096, min(hi*4096, n)
		C.k_add(fp(as[x:]), fp(bs[x:]), C.long(y-x))
	})
}

// lmTile is the vocab tile of the LM head: logits for rows x lmTile are
// held at a time per worker.
const lmTile = 2048

// lmRows is the token slab a worker scores against each vocab tile.
const lmRows = 256

// LMHeadScratchBytes implements compute.ScratchReporter: what LMHeadTopK
// allocates beside its outputs.
func (be *Backend) LMHeadScratchBytes(k int) int64 {
	return int64(be.threads) * (4*lmRows*lmTile + 4*lmTile + lmRows*(4+8+4) + int64(lmRows)*int64(k)*(4+4+8))
}

// LMHeadTopK implements compute.Backend. Each worker takes a slab of up to
// lmRows tokens and walks the vocabulary in lmTile tiles: one SGEMM per tile,
// then k_lse_topk folds the tile into the running log-sum-exp and top-k
// heaps. Scratch, per worker: the tile (lmRows·lmTile floats, 2 MiB), its
// exps (lmTile floats) and the heaps (lmRows·k ids and values):
// LMHeadScratchBytes.
func (be *Backend) LMHeadTopK(ids, logprobs, x, w compute.Tensor, tokens, hidden, vocab, k int) {
	be.lmHead(i32(ids), f32(logprobs), f32(x), f32(w), tokens, hidden, vocab, k, nil)
}

// lmBlocks is what the pass over the tiles leaves for LMHeadSample, per
// row of the call: the running max and sum of the log-sum-exp, the sums of
// exp(logit - tile max) over each block of compute.SampleBlock ids (nblk
// a row, fp32), and each tile's max and the total of its blocks (ntile a
// row).
type lmBlocks struct {
	rmax, bsum, tmax []float32
	rsum, tsum       []float64
	nblk, ntile      int
	// topz (rows, k): the top-k's logits in the order of the ids.
	topz []float32
	// topb (rows, k, SampleBlock), when not nil: the logits of each
	// top-k id's block, which the fold copies as an id enters the top-k.
	topb []float32
}

// lmPayloadK is the largest k whose top-k entries carry their blocks'
// logits through the pass (lmRows·k·256 bytes a worker: 4 MiB at k 64).
// A variable: tests force the other path.
var lmPayloadK = 256

// lmHead is LMHeadTopK over tokens rows of xs (k may be 0), and with blk
// also the block sums of LMHeadSample.
func (be *Backend) lmHead(idOut []int32, lpOut, xs, ws []float32, tokens, hidden, vocab, k int, blk *lmBlocks) {
	nSlab := (tokens + lmRows - 1) / lmRows
	type scratch struct {
		tile, ebuf, rmax, hv, hz []float32
		rsum                     []float64
		hi, hn, hs               []int32
		ord                      []int
	}
	scr := make([]*scratch, be.threads)
	defer func() {
		for _, sc := range scr {
			if sc != nil {
				be.release(sc.tile)
			}
		}
	}()
	be.workQueue(nSlab, func(wk, s int) {
		if scr[wk] == nil {
			scr[wk] = &scratch{tile: be.scratch(lmRows * lmTile), ebuf: make([]float32, lmTile), rmax: make([]float32, lmRows),
				hv: make([]float32, lmRows*k), rsum: make([]float64, lmRows), hi: make([]int32, lmRows*k),
				hn: make([]int32, lmRows), ord: make([]int, k)}
			if blk != nil && blk.topb != nil {
				scr[wk].hs, scr[wk].hz = make([]int32, lmRows*k), make([]float32, lmRows*k*compute.SampleBlock)
			}
		}
		sc := scr[wk]
		r0 := s * lmRows
		nr := min(lmRows, tokens-r0)
		tile, rmax, rsum, hv, hi, hn := sc.tile, sc.rmax[:nr], sc.rsum[:nr], sc.hv, sc.hi, sc.hn[:nr]
		for i := range rmax {
			rmax[i] = float32(math.Inf(-1))
			rsum[i] = 0
			hn[i] = 0
		}
		var bsum, tmax *C.float
		var tsum *C.double
		var ldb, ldt int
		if blk != nil {
			ldb, ldt = blk.nblk, blk.ntile
			bsum, tmax = fp(blk.bsum[r0*ldb:]), fp(blk.tmax[r0*ldt:])
			tsum = (*C.double)(unsafe.Pointer(&blk.tsum[r0*ldt]))
		}
		for c0 := 0; c0 < vocab; c0 += lmTile {
			nc := min(lmTile, vocab-c0)
			Sgemm(false, true, nr, nc, hidden, 1, xs[r0*hidden:], hidden, ws[c0*hidden:], hidden, 0, tile, nc)
			C.k_lse_topk(fp(tile), C.long(nr), C.long(nc), C.long(nc), C.long(c0),
				fp(rmax), (*C.double)(unsafe.Pointer(&rsum[0])), C.int(k),
				fp(hv), ip(hi), ip(hn),
				fp(sc.ebuf), bsum, C.long(ldb), C.long(compute.SampleBlock), tmax, tsum, C.long(ldt), C.long(c0/lmTile),
				ip(sc.hs), fp(sc.hz))
		}
		if blk != nil {
			copy(blk.rmax[r0:], rmax)
			copy(blk.rsum[r0:], rsum)
		}
		if k == 0 {
			return
		}
		for r := 0; r < nr; r++ {
			lse := float64(rmax[r]) + math.Log(rsum[r])
			v, id := hv[r*k:(r+1)*k], hi[r*k:(r+1)*k]
			// Heap -> sorted by descending logit, ascending id on ties.
			ord := sc.ord
			for i := range ord {
				ord[i] = i
			}
			// slices.SortFunc: sort.Slice would allocate per row.
			slices.SortFunc(ord, func(a, b int) int {
				switch {
				case v[a] > v[b] || (v[a] == v[b] && id[a] < id[b]):
					return -1
				case v[b] > v[a] || (v[a] == v[b] && id[b] < id[a]):
					return 1
				}
				return 0
			})
			dst := (r0 + r) * k
			for j, o := range ord {
				idOut[dst+j] = id[o]
				lpOut[dst+j] = float32(float64(v[o]) - lse)
			}
			if blk != nil {
				for j, o := range ord {
					blk.topz[dst+j] = v[o]
				}
				if blk.topb != nil {
					const B = compute.SampleBlock
					for j, o := range ord {
						slot := int(sc.hs[r*k+o])
						copy(blk.topb[(dst+j)*B:(dst+j+1)*B], sc.hz[(r*k+slot)*B:])
					}
				}
			}
		}
	})
}

// ip is the C pointer to s's first element, nil when s is empty.
func ip(s []int32) *C.int32_t {
	if len(s) == 0 {
		return nil
	}
	return (*C.int32_t)(unsafe.Pointer(&s[0]))
}

// expInto writes exp(x) with the kernels' fast exp (tests check its error).
func expInto(out, x []float32) { C.k_expf(fp(out), fp(x), C.long(len(x))) }
