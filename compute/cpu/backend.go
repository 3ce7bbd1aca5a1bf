// Package cpu is the reference backend of package compute: fp32 everywhere,
// OpenBLAS SGEMM for matrix products, C loops (kernels.c) for the
// elementwise and reduction work, and goroutines splitting both across cores.
//
// Weights given in BF16 are widened to F32 at upload, so the CPU path holds
// weights at 4 bytes a parameter; activations are bounded by the token budget
// of each call (see package infer).
package cpu

/*
#include "kernels.h"
*/
import "C"

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"unsafe"

	"distill/compute"
)

// tensor is the CPU Tensor: a host slice.
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
	mu   sync.Mutex
	free [][]float32
}

// New returns the CPU backend.
func New() *Backend {
	initBLAS()
	return &Backend{}
}

// scratch returns a zeroed-or-dirty buffer of n floats from the free list
// (the smallest that fits), or a new one.
func (b *Backend) scratch(n int) []float32 {
	b.mu.Lock()
	defer b.mu.Unlock()
	best := -1
	for i, f := range b.free {
		if cap(f) >= n && (best < 0 || cap(f) < cap(b.free[best])) {
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

var _ compute.Backend = (*Backend)(nil)

// Name implements compute.Backend.
func (*Backend) Name() string { return "cpu" }

func f32(t compute.Tensor) []float32 {
	if t == nil {
		return nil
	}
	ct, ok := t.(*tensor)
	if !ok {
		panic(fmt.Sprintf("cpu: tensor of another backend (%T)", t))
	}
	if ct.dt != compute.F32 {
		panic(fmt.Sprintf("cpu: want an f32 tensor, got %v", ct.dt))
	}
	return ct.f32
}

func i32(t compute.Tensor) []int32 {
	ct, ok := t.(*tensor)
	if !ok {
		panic(fmt.Sprintf("cpu: tensor of another backend (%T)", t))
	}
	if ct.dt != compute.I32 {
		panic(fmt.Sprintf("cpu: want an i32 tensor, got %v", ct.dt))
	}
	return ct.i32
}

// F32 exposes the host slice of a CPU F32 tensor (tests and callers that
// know they run on the CPU).
func F32(t compute.Tensor) []float32 { return f32(t) }

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

// parallel runs fn over [0,n) split into Threads contiguous ranges. A
// panic in fn reaches the caller as a *WorkerPanic (see group).
func parallel(n int, fn func(lo, hi int)) {
	t := Threads
	if t > n {
		t = n
	}
	if t <= 1 {
		if n > 0 {
			fn(0, n)
		}
		return
	}
	var g group
	for i := 0; i < t; i++ {
		lo, hi := n*i/t, n*(i+1)/t
		g.Go(func() { fn(lo, hi) })
	}
	g.Wait()
}

// WorkQueue runs fn(w, i) for every i in [0,n) on up to Threads goroutines
// that pull items from a shared counter (dynamic scheduling, for uneven
// items such as attention blocks); w in [0, workers) names the goroutine, so
// fn can keep per-worker scratch. A panic in fn reaches the caller as a
// *WorkerPanic once every worker has stopped.
func WorkQueue(n int, fn func(w, i int)) {
	t := max(min(Threads, n), 1)
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

func fp(s []float32) *C.float {
	if len(s) == 0 {
		return nil
	}
	return (*C.float)(unsafe.Pointer(&s[0]))
}

// MatMul implements compute.Backend: out (m,n) = x (m,k) · w (n,k)ᵀ + bias.
func (*Backend) MatMul(out, x, w, bias compute.Tensor, m, n, k int) {
	o, xs, ws := f32(out), f32(x), f32(w)
	SgemmPar(false, true, m, n, k, 1, xs, k, ws, k, 0, o, n)
	if bias != nil {
		b := f32(bias)
		parallel(m, func(lo, hi int) {
			for r := lo; r < hi; r++ {
				C.k_add(fp(o[r*n:]), fp(b), C.long(n))
			}
		})
	}
}

// Embed implements compute.Backend. Ids are trusted: callers validate them
// against the vocabulary before the forward.
func (*Backend) Embed(out, table, ids compute.Tensor, n, dim int) {
	o, tb, id := f32(out), f32(table), i32(ids)
	for i := 0; i < n; i++ {
		copy(o[i*dim:(i+1)*dim], tb[int(id[i])*dim:])
	}
}

// RMSNorm implements compute.Backend.
func (*Backend) RMSNorm(out, x, w compute.Tensor, rows, dim int, eps float32) {
	o, xs, ws := f32(out), f32(x), f32(w)
	parallel(rows, func(lo, hi int) {
		C.k_rmsnorm(fp(o[lo*dim:]), fp(xs[lo*dim:]), fp(ws), C.long(hi-lo), C.long(dim), C.float(eps))
	})
}

// RoPE implements compute.Backend (rotate-half): for i < hd/2,
// x[i], x[i+hd/2] = x[i]·cos - x[i+hd/2]·sin, x[i+hd/2]·cos + x[i]·sin with
// angle = float32(pos)·invFreq[i] in fp32, as HF's rotary embedding.
func (*Backend) RoPE(x, pos, invFreq compute.Tensor, tokens, heads, headDim int) {
	xs, ps, inv := f32(x), i32(pos), f32(invFreq)
	half := headDim / 2
	parallel(tokens, func(lo, hi int) {
		cos := make([]float32, half)
		sin := make([]float32, half)
		for t := lo; t < hi; t++ {
			p := float32(ps[t])
			for i := 0; i < half; i++ {
				a := float64(p * inv[i])
				cos[i], sin[i] = float32(math.Cos(a)), float32(math.Sin(a))
			}
			for h := 0; h < heads; h++ {
				v := xs[(t*heads+h)*headDim : (t*heads+h+1)*headDim]
				for i := 0; i < half; i++ {
					a, b := v[i], v[i+half]
					v[i] = a*cos[i] - b*sin[i]
					v[i+half] = b*cos[i] + a*sin[i]
				}
			}
		}
	})
}

// attnBlock is the query-block size of attention: scores are held for
// attnBlock queries x sample length at a time per worker.
const attnBlock = 128

// Attention implements compute.Backend. Work items are (sample, head, query
// block); each computes S = Q·Kᵀ·scale over the keys up to the block's last
// query, a causal fp32 softmax, and O = P·V, with single-threaded GEMMs
// running concurrently on all cores.
func (be *Backend) Attention(out, q, k, v, starts compute.Tensor, nSeq, maxLen, tokens, nHead, nKV, hd int, scale float32) {
	o, qs, ks, vs, st := f32(out), f32(q), f32(k), f32(v), i32(starts)
	type item struct{ s, h, q0 int }
	var items []item
	for s := 0; s < nSeq; s++ {
		L := int(st[s+1] - st[s])
		for h := 0; h < nHead; h++ {
			for q0 := 0; q0 < L; q0 += attnBlock {
				items = append(items, item{s, h, q0})
			}
		}
	}
	// Longest first: balances the tail of the queue.
	sort.SliceStable(items, func(i, j int) bool { return items[i].q0 > items[j].q0 })
	scratch := make([][]float32, Threads)
	defer func() {
		for _, sc := range scratch {
			if sc != nil {
				be.release(sc)
			}
		}
	}()
	group := nHead / nKV
	ldq, ldk := nHead*hd, nKV*hd
	WorkQueue(len(items), func(w, i int) {
		it := items[i]
		a := int(st[it.s])
		L := int(st[it.s+1]) - a
		q1 := min(it.q0+attnBlock, L)
		nq, nk := q1-it.q0, q1
		if scratch[w] == nil {
			scratch[w] = be.scratch(attnBlock * maxLen)
		}
		sc := scratch[w][:nq*nk]
		g := it.h / group
		qp := qs[(a+it.q0)*ldq+it.h*hd:]
		kp := ks[a*ldk+g*hd:]
		vp := vs[a*ldk+g*hd:]
		Sgemm(false, true, nq, nk, hd, scale, qp, ldq, kp, ldk, 0, sc, nk)
		C.k_softmax_causal(fp(sc), C.long(nq), C.long(nk), C.long(it.q0+1))
		Sgemm(false, false, nq, hd, nk, 1, sc, nk, vp, ldk, 0, o[(a+it.q0)*ldq+it.h*hd:], ldq)
	})
}

// SwiGLU implements compute.Backend.
func (*Backend) SwiGLU(out, gate, up compute.Tensor, n int) {
	o, g, u := f32(out), f32(gate), f32(up)
	parallel((n+4095)/4096, func(lo, hi int) {
		a, b := lo*4096, min(hi*4096, n)
		C.k_swiglu(fp(o[a:]), fp(g[a:]), fp(u[a:]), C.long(b-a))
	})
}

// Add implements compute.Backend.
func (*Backend) Add(a, b compute.Tensor, n int) {
	as, bs := f32(a), f32(b)
	parallel((n+4095)/4096, func(lo, hi int) {
		x, y := lo*4096, min(hi*4096, n)
		C.k_add(fp(as[x:]), fp(bs[x:]), C.long(y-x))
	})
}

// MoE implements compute.Backend, as Qwen3MoeSparseMoeBlock: fp32 softmax
// over router logits, top-k experts per token (ties: lower expert index,
// like torch.topk on CPU), optional renormalization, then for each expert
// in index order the SwiGLU MLP of its tokens, scaled by the routing weight
// and added into out.
func (be *Backend) MoE(out, x compute.Tensor, m *compute.MoEWeights, tokens int) {
	o, xs := f32(out), f32(x)
	E, K, H, I := m.NumExperts, m.TopK, m.Hidden, m.Inter
	logits := make([]float32, tokens*E)
	SgemmPar(false, true, tokens, E, H, 1, xs, H, f32(m.Router), H, 0, logits, E)
	sel := make([]int32, tokens*K)
	wts := make([]float32, tokens*K)
	parallel(tokens, func(lo, hi int) {
		p := make([]float32, E)
		idx := make([]int, E)
		for t := lo; t < hi; t++ {
			row := logits[t*E : (t+1)*E]
			mx := row[0]
			for _, v := range row {
				mx = max(mx, v)
			}
			var sum float32
			for e, v := range row {
				p[e] = float32(math.Exp(float64(v - mx)))
				sum += p[e]
			}
			for e := range p {
				p[e] /= sum
				idx[e] = e
			}
			sort.SliceStable(idx, func(i, j int) bool { return p[idx[i]] > p[idx[j]] })
			var ks float32
			for j := 0; j < K; j++ {
				ks += p[idx[j]]
			}
			for j := 0; j < K; j++ {
				sel[t*K+j] = int32(idx[j])
				w := p[idx[j]]
				if m.NormTopK {
					w /= ks
				}
				wts[t*K+j] = w
			}
		}
	})
	// Group tokens by expert: counts first, so the row lists and the
	// buffers of the busiest expert are allocated once.
	count := make([]int, E)
	for _, e := range sel {
		count[e]++
	}
	rows := make([][]int32, E)
	rw := make([][]float32, E)
	maxRows := 0
	for e := range rows {
		rows[e] = make([]int32, 0, count[e])
		rw[e] = make([]float32, 0, count[e])
		maxRows = max(maxRows, count[e])
	}
	for t := 0; t < tokens; t++ {
		for j := 0; j < K; j++ {
			e := sel[t*K+j]
			rows[e] = append(rows[e], int32(t))
			rw[e] = append(rw[e], wts[t*K+j])
		}
	}
	clear(o[:tokens*H])
	xin, gate, up, y := be.scratch(maxRows*H), be.scratch(maxRows*I), be.scratch(maxRows*I), be.scratch(maxRows*H)
	defer be.release(xin, gate, up, y)
	for e := 0; e < E; e++ {
		n := len(rows[e])
		if n == 0 {
			continue
		}
		for i, t := range rows[e] {
			copy(xin[i*H:(i+1)*H], xs[int(t)*H:])
		}
		SgemmPar(false, true, n, I, H, 1, xin, H, f32(m.Gate[e]), H, 0, gate, I)
		SgemmPar(false, true, n, I, H, 1, xin, H, f32(m.Up[e]), H, 0, up, I)
		C.k_swiglu(fp(gate), fp(gate), fp(up), C.long(n*I))
		SgemmPar(false, true, n, H, I, 1, gate, I, f32(m.Down[e]), I, 0, y, H)
		for i, t := range rows[e] {
			w := rw[e][i]
			dst := o[int(t)*H : (int(t)+1)*H]
			for j, v := range y[i*H : (i+1)*H] {
				dst[j] += v * w
			}
		}
	}
}

// lmTile is the vocab tile of the LM head: logits for rows x lmTile are
// held at a time per worker.
const lmTile = 2048

// lmRows is the token slab a worker scores against each vocab tile.
const lmRows = 256

// LMHeadScratchBytes is what LMHeadTopK allocates beside its outputs.
func LMHeadScratchBytes(k int) int64 {
	return int64(Threads) * (4*lmRows*lmTile + lmRows*(4+8+4) + int64(lmRows)*int64(k)*(4+4+8))
}

// AttentionScratchBytes is what Attention allocates beside its output for
// samples of at most maxLen tokens.
func AttentionScratchBytes(maxLen int) int64 {
	return int64(Threads) * 4 * attnBlock * int64(maxLen)
}

// LMHeadTopK implements compute.Backend. Each worker takes a slab of up to
// lmRows tokens and walks the vocabulary in lmTile tiles: one SGEMM per tile,
// then k_lse_topk folds the tile into the running log-sum-exp and top-k
// heaps. Scratch, per worker: the tile (lmRows·lmTile floats, 2 MiB) and
// the heaps (lmRows·k ids and values): LMHeadScratchBytes.
func (be *Backend) LMHeadTopK(ids, logprobs, x, w compute.Tensor, tokens, hidden, vocab, k int) {
	idOut, lpOut, xs, ws := i32(ids), f32(logprobs), f32(x), f32(w)
	nSlab := (tokens + lmRows - 1) / lmRows
	type scratch struct {
		tile, rmax, hv []float32
		rsum           []float64
		hi, hn         []int32
		ord            []int
	}
	scr := make([]*scratch, Threads)
	defer func() {
		for _, sc := range scr {
			if sc != nil {
				be.release(sc.tile)
			}
		}
	}()
	WorkQueue(nSlab, func(wk, s int) {
		if scr[wk] == nil {
			scr[wk] = &scratch{tile: be.scratch(lmRows * lmTile), rmax: make([]float32, lmRows),
				hv: make([]float32, lmRows*k), rsum: make([]float64, lmRows), hi: make([]int32, lmRows*k),
				hn: make([]int32, lmRows), ord: make([]int, k)}
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
		for c0 := 0; c0 < vocab; c0 += lmTile {
			nc := min(lmTile, vocab-c0)
			Sgemm(false, true, nr, nc, hidden, 1, xs[r0*hidden:], hidden, ws[c0*hidden:], hidden, 0, tile, nc)
			C.k_lse_topk(fp(tile), C.long(nr), C.long(nc), C.long(nc), C.long(c0),
				fp(rmax), (*C.double)(unsafe.Pointer(&rsum[0])), C.int(k),
				fp(hv), (*C.int32_t)(unsafe.Pointer(&hi[0])), (*C.int32_t)(unsafe.Pointer(&hn[0])))
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
		}
	})
}

// expInto writes exp(x) with the kernels' fast exp (tests check its error).
func expInto(out, x []float32) { C.k_expf(fp(out), fp(x), C.long(len(x))) }
