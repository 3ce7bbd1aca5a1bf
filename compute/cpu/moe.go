package cpu

/*
#include "kernels.h"
*/
import "C"

import (
	"fmt"
	"math"

	"distill/compute"
)

// The Qwen3-MoE sparse block, forward and backward, ScatterMoE-style: the
// router picks K experts per token, the T·K (token, slot) pairs are sorted
// by expert (a counting sort, stable in token order), and each expert runs
// its SwiGLU MLP as three GEMMs over its contiguous rows; outputs are
// scattered back to their tokens weighted by the routing weights. No loop
// runs over tokens with a per-token GEMM.

// moeRoute is the routing of one batch: T tokens, E experts, top-k K.
type moeRoute struct {
	probs []float32 // (T,E) softmax of the router logits
	sel   []int32   // (T,K) chosen experts, descending probability
	wts   []float32 // (T,K) routing weights
	order []int32   // (T·K) pair t·K+j of each grouped row
	off   []int32   // (E+1) first grouped row of each expert
}

// route fills r from x (T,H): logits = x·routerᵀ, an fp32 softmax, the
// top-k (ties: lower expert index, like torch.topk on CPU), optional
// renormalization, and the grouping of the pairs by expert.
func (be *Backend) route(r *moeRoute, x []float32, m *compute.MoEWeights, T int) {
	E, K, H := m.NumExperts, m.TopK, m.Hidden
	be.sgemm(false, true, T, E, H, 1, x, H, f32(m.Router), H, 0, r.probs, E)
	be.rows(T, 4*E*(K+4), func(_, lo, hi int) {
		for t := lo; t < hi; t++ {
			p := r.probs[t*E : (t+1)*E]
			mx := p[0]
			for _, v := range p {
				mx = max(mx, v)
			}
			var sum float32
			for e, v := range p {
				p[e] = float32(math.Exp(float64(v - mx)))
				sum += p[e]
			}
			for e := range p {
				p[e] /= sum
			}
			sel, w := r.sel[t*K:(t+1)*K], r.wts[t*K:(t+1)*K]
			var ks float32
			for j := range sel {
				best := -1
				for e, v := range p {
					if taken(sel[:j], e) {
						continue
					}
					if best < 0 || v > p[best] {
						best = e
					}
				}
				sel[j], w[j] = int32(best), p[best]
				ks += p[best]
			}
			if m.NormTopK {
				for j := range w {
					w[j] /= ks
				}
			}
		}
	})
	clear(r.off)
	for _, e := range r.sel[:T*K] {
		r.off[e+1]++
	}
	for e := 0; e < E; e++ {
		r.off[e+1] += r.off[e]
	}
	next := make([]int32, E)
	copy(next, r.off[:E])
	for p, e := range r.sel[:T*K] {
		r.order[next[e]] = int32(p)
		next[e]++
	}
}

func taken(sel []int32, e int) bool {
	for _, s := range sel {
		if int(s) == e {
			return true
		}
	}
	return false
}

// fakeQuantRows NVFP4-fake-quantizes x (rows,cols) in place with the
// per-tensor amax (FakeQuantNVFP4's definition, row by row).
func (be *Backend) fakeQuantRows(x []float32, rows, cols int, amax float32) {
	g := compute.NVFP4GlobalScale(amax)
	bs := compute.NVFP4BlockSize
	be.rows(rows, cols*4, func(_, lo, hi int) {
		for r := lo; r < hi; r++ {
			for b0 := 0; b0 < cols; b0 += bs {
				e := min(b0+bs, cols)
				compute.NVFP4FakeQuantBlock(x[r*cols+b0:r*cols+e], x[r*cols+b0:r*cols+e], g)
			}
		}
	})
}

// gather copies the x rows of grouped rows [lo,hi) into xg (hi-lo, H),
// fake-quantized when amax > 0.
func (be *Backend) gather(xg, x []float32, order []int32, lo, hi, K, H int, amax float32) {
	be.rows(hi-lo, H, func(_, i0, i1 int) {
		for i := i0; i < i1; i++ {
			t := int(order[lo+i]) / K
			copy(xg[i*H:(i+1)*H], x[t*H:(t+1)*H])
		}
	})
	if amax > 0 {
		be.fakeQuantRows(xg, hi-lo, H, amax)
	}
}

// moeFP8 reports whether m's experts are FP8 weights (WeightFP8): all of
// them or none (a mix is a caller's bug).
func moeFP8(m *compute.MoEWeights) bool {
	n := 0
	for e := range m.Gate {
		for _, w := range []compute.Tensor{m.Gate[e], m.Up[e], m.Down[e]} {
			if cput(w).dt == compute.F8E4M3 {
				n++
			}
		}
	}
	if n != 0 && n != 3*len(m.Gate) {
		panic(fmt.Sprintf("cpu: MoE with %d of its %d expert weights in FP8: want all or none", n, 3*len(m.Gate)))
	}
	return n > 0
}

// expertWeights returns expert e's gate, up and down weights as the GEMMs
// read them (an FP8 weight's dequantized values).
func expertWeights(m *compute.MoEWeights, e int) (gate, up, down []float32) {
	w := func(t compute.Tensor) []float32 {
		if v := fp8Values(t); v != nil {
			return v
		}
		return f32(t)
	}
	return w(m.Gate[e]), w(m.Up[e]), w(m.Down[e])
}

// MoE implements compute.Backend, as Qwen3MoeSparseMoeBlock (see
// MoEForward); its scratch is the routing and one expert's rows at a time.
func (be *Backend) MoE(out, x compute.Tensor, m *compute.MoEWeights, tokens int) {
	be.moeForward(out, x, m, nil, tokens)
}

// MoEForward implements compute.Backend.
func (be *Backend) MoEForward(out, x compute.Tensor, m *compute.MoEWeights, s *compute.MoESaved, tokens int) {
	be.moeForward(out, x, m, s, tokens)
}

func (be *Backend) moeForward(out, x compute.Tensor, m *compute.MoEWeights, s *compute.MoESaved, T int) {
	o, xs := f32(out), f32(x)
	E, K, H, I := m.NumExperts, m.TopK, m.Hidden, m.Inter
	var r moeRoute
	if s != nil {
		r = moeRoute{probs: f32(s.Probs), sel: i32(s.Sel), wts: f32(s.Wts), order: i32(s.Order), off: i32(s.Offsets)}
	} else {
		r = moeRoute{probs: make([]float32, T*E), sel: make([]int32, T*K), wts: make([]float32, T*K),
			order: make([]int32, T*K), off: make([]int32, E+1)}
	}
	be.route(&r, xs, m, T)
	fp8 := moeFP8(m)
	if fp8 && s != nil {
		panic("cpu: MoEForward (training) with FP8 experts: FP8 weights are a teacher's, forward only (MoE)")
	}
	moeAdaptersCheck(m, fp8)
	maxRows := 0
	for e := 0; e < E; e++ {
		maxRows = max(maxRows, int(r.off[e+1]-r.off[e]))
	}
	clear(o[:T*H])
	xg, h := be.scratch(maxRows*H), be.scratch(maxRows*I)
	defer be.release(xg, h)
	var gate, up, y []float32
	if s == nil {
		gate, up, y = be.scratch(maxRows*I), be.scratch(maxRows*I), be.scratch(maxRows*H)
		defer be.release(gate, up, y)
	}
	for e := 0; e < E; e++ {
		lo, hi := int(r.off[e]), int(r.off[e+1])
		n := hi - lo
		if n == 0 {
			continue
		}
		g, u, ye := gate, up, y
		if s != nil {
			g, u, ye = f32(s.Gate)[lo*I:hi*I], f32(s.Up)[lo*I:hi*I], f32(s.Y)[lo*H:hi*H]
		}
		be.gather(xg, xs, r.order, lo, hi, K, H, m.InAmax)
		gw, uw, dw := expertWeights(m, e)
		if fp8 {
			be.quantRowsFP8(xg[:n*H], xg[:n*H], n, H) // gate_proj and up_proj read the same rows
		}
		be.sgemm(false, true, n, I, H, 1, xg, H, gw, H, 0, g, I)
		be.sgemm(false, true, n, I, H, 1, xg, H, uw, H, 0, u, I)
		ad, lr := adapter(m, e), &moeLoRA{be: be, order: r.order, lo: lo, n: n, K: K}
		if s != nil {
			lr.drop = m.Drop // MoE (inference) never drops
		}
		lr.forward(ad.Gate, g, xg)
		lr.forward(ad.Up, u, xg)
		C.k_swiglu(fp(h), fp(g), fp(u), C.long(n*I))
		if m.HAmax > 0 {
			be.fakeQuantRows(h[:n*I], n, I, m.HAmax)
		}
		if fp8 {
			be.quantRowsFP8(h[:n*I], h[:n*I], n, I)
		}
		be.sgemm(false, true, n, H, I, 1, h, I, dw, I, 0, ye, H)
		lr.forward(ad.Down, ye, h)
		// An expert's rows are distinct tokens: the scatter splits freely.
		be.rows(n, H, func(_, i0, i1 int) {
			for i := i0; i < i1; i++ {
				p := r.order[lo+i]
				w, t := r.wts[p], int(p)/K
				dst := o[t*H : (t+1)*H]
				for j, v := range ye[i*H : (i+1)*H] {
					dst[j] += v * w
				}
			}
		})
	}
}

// MoEBackward implements compute.Backend, mirroring moeForward in reverse:
// the routing weights' gradients (dout·y), the softmax backward into the
// router, then per expert its three GEMMs' backward over its rows, the
// input gradient scattered back to the tokens. dm nil (frozen): the
// weight gradients' GEMMs are skipped.
func (be *Backend) MoEBackward(dx compute.Tensor, dm *compute.MoEWeights, dout, x compute.Tensor, m *compute.MoEWeights, s *compute.MoESaved, dprob compute.Tensor, T int) {
	dxs, d, xs := f32(dx), f32(dout), f32(x)
	E, K, H, I := m.NumExperts, m.TopK, m.Hidden, m.Inter
	moeAdaptersCheck(m, false)
	probs, sel, wts, order, off := f32(s.Probs), i32(s.Sel), f32(s.Wts), i32(s.Order), i32(s.Offsets)
	ys, gs, us := f32(s.Y), f32(s.Gate), f32(s.Up)
	var dp0 []float32
	if dprob != nil {
		dp0 = f32(dprob)[:E]
	}
	// dL/dw for every pair: dout_t · y.
	a := make([]float32, T*K)
	be.rows(T*K, H, func(_, lo, hi int) {
		for i := lo; i < hi; i++ {
			p := order[i]
			t := int(p) / K
			var acc float64
			for j, v := range ys[i*H : (i+1)*H] {
				acc += float64(v) * float64(d[t*H+j])
			}
			a[p] = float32(acc)
		}
	})
	// dL/dlogits through the renormalization and the softmax.
	dl := make([]float32, T*E)
	be.rows(T, 4*E*K, func(_, lo, hi int) {
		dp := make([]float64, E)
		for t := lo; t < hi; t++ {
			for e := range dp {
				dp[e] = 0
				if dp0 != nil {
					dp[e] = float64(dp0[e])
				}
			}
			p := probs[t*E : (t+1)*E]
			sl, w, at := sel[t*K:(t+1)*K], wts[t*K:(t+1)*K], a[t*K:(t+1)*K]
			if m.NormTopK {
				var ks, aw float64
				for j := range sl {
					ks += float64(p[sl[j]])
					aw += float64(at[j]) * float64(w[j])
				}
				for j := range sl {
					dp[sl[j]] += (float64(at[j]) - aw) / ks
				}
			} else {
				for j := range sl {
					dp[sl[j]] += float64(at[j])
				}
			}
			var pd float64
			for e, v := range p {
				pd += float64(v) * dp[e]
			}
			for e, v := range p {
				dl[t*E+e] = float32(float64(v) * (dp[e] - pd))
			}
		}
	})
	be.sgemm(false, false, T, H, E, 1, dl, E, f32(m.Router), H, 1, dxs, H)
	if dm != nil {
		be.sgemm(true, false, E, H, T, 1, dl, E, xs, H, 1, f32(dm.Router), H)
	}

	maxRows := 0
	for e := 0; e < E; e++ {
		maxRows = max(maxRows, int(off[e+1]-off[e]))
	}
	xg, dy, h := be.scratch(maxRows*H), be.scratch(maxRows*H), be.scratch(maxRows*I)
	dh, dg, du := be.scratch(maxRows*I), be.scratch(maxRows*I), be.scratch(maxRows*I)
	dxg := be.scratch(maxRows * H)
	defer be.release(xg, dy, h, dh, dg, du, dxg)
	for e := 0; e < E; e++ {
		lo, hi := int(off[e]), int(off[e+1])
		n := hi - lo
		if n == 0 {
			continue
		}
		g, u := gs[lo*I:hi*I], us[lo*I:hi*I]
		be.rows(n, H, func(_, i0, i1 int) {
			for i := i0; i < i1; i++ {
				p := order[lo+i]
				w, t := wts[p], int(p)/K
				row := dy[i*H : (i+1)*H]
				for j, v := range d[t*H : (t+1)*H] {
					row[j] = v * w
				}
			}
		})
		ad, lr := adapter(m, e), &moeLoRA{be: be, order: order, lo: lo, n: n, K: K, drop: m.Drop}
		if dm != nil || ad.Down != nil { // the down projection's input, recomputed
			C.k_swiglu(fp(h), fp(g), fp(u), C.long(n*I))
			if m.HAmax > 0 {
				be.fakeQuantRows(h[:n*I], n, I, m.HAmax)
			}
		}
		if dm != nil {
			be.sgemm(true, false, H, I, n, 1, dy, H, h, I, 1, f32(dm.Down[e]), I)
		}
		be.sgemm(false, false, n, I, H, 1, dy, H, f32(m.Down[e]), I, 0, dh, I)
		lr.backward(ad.Down, dh, dy, h)
		clear(dg[:n*I])
		clear(du[:n*I])
		C.k_swiglu_bwd(fp(dg), fp(du), fp(dh), fp(g), fp(u), C.long(n*I))
		if dm != nil || ad.Gate != nil || ad.Up != nil {
			be.gather(xg, xs, order, lo, hi, K, H, m.InAmax)
		}
		if dm != nil {
			be.sgemm(true, false, I, H, n, 1, dg, I, xg, H, 1, f32(dm.Gate[e]), H)
			be.sgemm(true, false, I, H, n, 1, du, I, xg, H, 1, f32(dm.Up[e]), H)
		}
		be.sgemm(false, false, n, H, I, 1, dg, I, f32(m.Gate[e]), H, 0, dxg, H)
		be.sgemm(false, false, n, H, I, 1, du, I, f32(m.Up[e]), H, 1, dxg, H)
		lr.backward(ad.Gate, dxg, dg, xg)
		lr.backward(ad.Up, dxg, du, xg)
		be.rows(n, H, func(_, i0, i1 int) {
			for i := i0; i < i1; i++ {
				t := int(order[lo+i]) / K
				C.k_add(fp(dxs[t*H:(t+1)*H]), fp(dxg[i*H:]), C.long(H))
			}
		})
	}
}

// moeAdaptersCheck refuses adapters the kernels do not take: a count
// other than one per expert, or beside FP8 experts or QAD's quantized
// inputs (a LoRA student's base is neither).
func moeAdaptersCheck(m *compute.MoEWeights, fp8 bool) {
	if m.Adapters == nil {
		return
	}
	switch {
	case len(m.Adapters) != m.NumExperts:
		panic(fmt.Sprintf("cpu: MoE with %d experts has %d adapters: want one MoEAdapter per expert", m.NumExperts, len(m.Adapters)))
	case fp8 || m.InAmax > 0 || m.HAmax > 0:
		panic("cpu: MoE adapters (LoRA) with FP8 experts or QAD's quantized inputs: a LoRA student's base is neither")
	}
	for e, a := range m.Adapters {
		for _, l := range []struct {
			l       *compute.LoRA
			in, out int
		}{{a.Gate, m.Hidden, m.Inter}, {a.Up, m.Hidden, m.Inter}, {a.Down, m.Inter, m.Hidden}} {
			if l.l != nil && (l.l.In != l.in || l.l.Out != l.out || l.l.Rank < 1) {
				panic(fmt.Sprintf("cpu: expert %d's adapter of rank %d, %d -> %d, on a projection %d -> %d", e, l.l.Rank, l.l.In, l.l.Out, l.in, l.out))
			}
		}
	}
}
