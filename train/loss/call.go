package loss

import (
	"math"

	"distill/compute"
)

// This file holds what the single-teacher path (run) and the
// multi-teacher path (runMulti) share: one call's tensors on the backend,
// pass 2's coefficients, and the per-position math of one teacher's KD
// term. The two paths differ only in how a position's teacher ids become
// the kernels' K columns and how teachers are summed.

// headCall is one call of the loss-head kernels: pass 1's inputs, pass 2's
// coefficients once they are uploaded; free releases them all.
type headCall struct {
	be      compute.Backend
	lh      *compute.LossHead
	uploads []compute.Tensor
}

// newCall uploads the counted positions (h.rows, h.labs) and, with K > 0,
// their K ascending ids per position. A training call's (dx set: pass 2
// follows pass 1) lets the backend keep the logits between the passes
// when h.KeepLogits.
func (h *Head) newCall(x, w, dx compute.Tensor, opt *Options, ids []int32, K int) *headCall {
	be, M := h.Backend, len(h.rows)
	lh := &compute.LossHead{X: x, W: w, Rows: be.FromI32(h.rows), Labels: be.FromI32(h.labs),
		M: M, C: h.C, V: h.V, K: K, InvT: float32(1 / opt.Temperature), TileCols: h.TileCols, Keep: h.KeepLogits && dx != nil}
	c := &headCall{be: be, lh: lh, uploads: []compute.Tensor{lh.Rows, lh.Labels}}
	if K > 0 {
		lh.TopIDs = be.FromI32(ids)
		c.uploads = append(c.uploads, lh.TopIDs)
	}
	return c
}

func (c *headCall) free() {
	for _, t := range c.uploads {
		c.be.Free(t)
	}
}

// backward runs pass 2 with the coefficients co and an SFT weight wsft
// per position, adding the gradient to dx and dw.
func (c *headCall) backward(co *coefs, wsft float32, dx, dw compute.Tensor) {
	be := c.be
	coef := &compute.LossCoef{LseT: be.FromF32(co.lseT), Lse1: be.FromF32(co.lse1), A: be.FromF32(co.a), WSFT: wsft}
	c.uploads = append(c.uploads, coef.LseT, coef.Lse1, coef.A)
	if c.lh.K > 0 {
		coef.CK = be.FromF32(co.cK)
		c.uploads = append(c.uploads, coef.CK)
	}
	be.LossHeadBackward(c.lh, coef, dx, dw)
}

// coefs are pass 2's coefficients on the host (compute.LossCoef) for M
// positions of K columns.
type coefs struct {
	lseT, lse1, a, cK []float32
}

func newCoefs(M, K int) *coefs {
	return &coefs{lseT: make([]float32, M), lse1: make([]float32, M), a: make([]float32, M), cK: make([]float32, M*K)}
}

// keepLse keeps position r's log-sum-exps for pass 2 and returns its
// cross-entropy on the label.
func (co *coefs) keepLse(ps *compute.LossStats, r int) float64 {
	lseT, lse1 := ps.LseT[r], ps.Lse1[r]
	co.lseT[r], co.lse1[r] = float32(lseT), float32(lse1)
	return lse1 - float64(ps.ZLab[r])
}

// clampCoef is a coefficient of q_v as fp32, within ±1e30 (a tail
// coefficient h_tail/q_tail can overflow it).
func clampCoef(v float64) float32 {
	return float32(math.Max(-1e30, math.Min(1e30, v)))
}

// weights returns the KD term's weight (times T² with ScaleT2) and the
// divisor of the means in the gradient: the M counted positions, or the
// normalizer of gradient accumulation.
func (o *Options) weights(M int, normalizer float64) (wkd, norm float64) {
	wkd = o.KDWeight
	if o.ScaleT2 {
		wkd *= o.Temperature * o.Temperature
	}
	norm = float64(M)
	if normalizer > 0 {
		norm = normalizer
	}
	return wkd, norm
}

// kdMath is one teacher's KD term at one position, in float64: its
// buffers are sized for the widest teacher and reused across positions
// and teachers.
type kdMath struct {
	opt *Options
	// tc is the teacher's capture temperature, invT the fp32 1/T the
	// backend scales the logits by.
	tc, invT   float64
	lp, lq, hh []float64 // (K+1) the teacher's and student's log-probs, h_e = ∂D/∂lq_e
	// zK (K) are the student's logits at the teacher's ids, in its rank
	// order: the caller fills them before term.
	zK []float64
}

func newKDMath(opt *Options, maxK int) *kdMath {
	return &kdMath{opt: opt, tc: opt.teacherT(), invT: float64(float32(1 / opt.Temperature)),
		lp: make([]float64, maxK+1), lq: make([]float64, maxK+1), hh: make([]float64, maxK+1), zK: make([]float64, maxK)}
}

// term is the teacher's divergence D at a position from m.zK, its
// log-probs topLP (K of them), the student's tempered log-sum-exp lseT
// and, under tail bucket, the student's mass qTail outside the teacher's
// ids. It leaves h_e in m.hh and returns H = Σ_e h_e and out, the
// coefficient of q_v on every v outside the teacher's ids (package doc,
// Gradient): -H, plus h_tail/q_tail under bucket, and none under
// renormalize.
func (m *kdMath) term(topLP []float32, lseT, qTail float64) (D, H, out float64) {
	opt, K := m.opt, len(topLP)
	n := teacherDists(opt, m.lp, m.lq, m.zK[:K], topLP, m.tc, m.invT, lseT)
	bucket := opt.Tail == Bucket && !opt.sparse()
	if bucket {
		m.lq[K] = compute.Log(math.Max(qTail, tailFloor))
	}
	D = divergence(opt, m.lp[:n], m.lq[:n], m.hh[:n])
	for _, v := range m.hh[:n] {
		H += v
	}
	out = -H
	switch {
	case opt.Tail == Renormalize:
		out = 0
	case bucket && qTail > tailFloor:
		out += m.hh[K] / qTail
	}
	return D, H, out
}

// coefK is the gradient on the tempered logit at the teacher's rank j,
// before weights: h_j - q_j·H.
func (m *kdMath) coefK(j int, H float64) float64 {
	return m.hh[j] - float64(compute.Exp(m.lq[j])*H)
}
