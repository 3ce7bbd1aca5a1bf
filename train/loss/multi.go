package loss

import (
	"fmt"
	"math"
	"slices"

	"distill/compute"
)

// runMulti is run for several teachers (Targets.Teachers) with a KD term:
// pass 1 gathers z at the union U of the teachers' ids (padded to the
// widest row's union with further distinct ids, as the kernels take a
// fixed K), each teacher's divergence is computed from those values under
// the tail mode, and their weighted sum's coefficients go to pass 2. See
// Multi-teacher KD in the package doc.
func (h *Head) runMulti(x, w, dx, dw compute.Tensor, tg *Targets, opt *Options, normalizer float64) (Stats, error) {
	N, V := len(tg.Tokens), h.V
	if x.Len() < N*h.C {
		return Stats{}, fmt.Errorf("%w: hidden states have %d values, want tokens %d x hidden %d", ErrInvalid, x.Len(), N, h.C)
	}
	if err := tg.Check(V); err != nil {
		return Stats{}, err
	}
	nT := len(tg.Teachers)
	offs := make([]int, nT+1) // teacher i's ranks are columns offs[i]..offs[i+1] of pos
	var wsum float64
	maxK := 0
	for i, te := range tg.Teachers {
		if te.K <= 0 || te.K > V {
			return Stats{}, fmt.Errorf("%w: teacher %d: k = %d: want 1 <= k <= vocab %d", ErrInvalid, i, te.K, V)
		}
		if len(te.TopIDs) != N*te.K || len(te.TopLP) != N*te.K {
			return Stats{}, fmt.Errorf("%w: teacher %d: top-k has %d ids and %d log-probs, want tokens %d x k %d", ErrInvalid, i, len(te.TopIDs), len(te.TopLP), N, te.K)
		}
		if !(te.Weight >= 0) || math.IsInf(te.Weight, 0) {
			return Stats{}, fmt.Errorf("%w: teacher %d: weight %g: want a finite value >= 0", ErrInvalid, i, te.Weight)
		}
		wsum += te.Weight
		offs[i+1] = offs[i] + te.K
		maxK = max(maxK, te.K)
	}
	if wsum == 0 {
		return Stats{}, fmt.Errorf("%w: every teacher's weight is 0 with kd_weight %g: nothing to distill from; give a teacher a weight > 0, or set kd_weight 0", ErrInvalid, opt.KDWeight)
	}
	KS := offs[nT]
	h.countRows(tg)
	M := len(h.rows)
	if M == 0 {
		return Stats{}, nil
	}
	// Pass A: validate every teacher row of a counted position and build
	// its union (first-seen order) into uni[r*KS : r*KS+ulen[r]].
	h.stamp, h.ustamp, h.slot = growI(h.stamp, V), growI(h.ustamp, V), growI(h.slot, V)
	clear(h.stamp)
	clear(h.ustamp)
	gen := int32(0)
	uni, ulen := make([]int32, M*KS), make([]int, M)
	Ku := 0
	for r, t := range h.rows {
		gen++
		ug := gen
		u := uni[r*KS : r*KS]
		for i, te := range tg.Teachers {
			gen++
			K := te.K
			for j := 0; j < K; j++ {
				id, lp := te.TopIDs[int(t)*K+j], te.TopLP[int(t)*K+j]
				if id < 0 || int(id) >= V {
					return Stats{}, fmt.Errorf("%w: teacher %d: top-k at token %d, rank %d: id %d outside the vocabulary [0,%d)", ErrInvalid, i, t, j, id, V)
				}
				if h.stamp[id] == gen {
					return Stats{}, fmt.Errorf("%w: teacher %d: top-k at token %d lists id %d twice", ErrInvalid, i, t, id)
				}
				h.stamp[id] = gen
				if !(lp <= 1e-3) || math.IsInf(float64(lp), 0) {
					return Stats{}, fmt.Errorf("%w: teacher %d: log-prob at token %d, rank %d is %g: want a finite log-probability <= 0", ErrInvalid, i, t, j, lp)
				}
				if h.ustamp[id] != ug {
					h.ustamp[id] = ug
					u = append(u, id)
				}
			}
		}
		ulen[r] = len(u)
		Ku = max(Ku, len(u))
	}
	// Pass B: pad each union to Ku with the lowest ids outside it, sort
	// it ascending (the kernels' order), and map every teacher rank to its
	// union column.
	ids := make([]int32, M*Ku)
	pos := make([]int32, M*KS)
	for r, t := range h.rows {
		gen++
		row := ids[r*Ku : (r+1)*Ku]
		n := copy(row, uni[r*KS:r*KS+ulen[r]])
		for _, id := range row[:n] {
			h.ustamp[id] = gen
		}
		for cand := int32(0); n < Ku; cand++ {
			if h.ustamp[cand] != gen {
				row[n] = cand
				n++
			}
		}
		slices.Sort(row)
		for c, id := range row {
			h.slot[id] = int32(c)
		}
		for i, te := range tg.Teachers {
			K := te.K
			p := pos[r*KS+offs[i] : r*KS+offs[i+1]]
			for j := range p {
				p[j] = h.slot[te.TopIDs[int(t)*K+j]]
			}
		}
	}
	be := h.Backend
	lh := &compute.LossHead{X: x, W: w, Rows: be.FromI32(h.rows), Labels: be.FromI32(h.labs),
		M: M, C: h.C, V: V, K: Ku, InvT: float32(1 / opt.Temperature), TileCols: h.TileCols, TopIDs: be.FromI32(ids)}
	uploads := []compute.Tensor{lh.Rows, lh.Labels, lh.TopIDs}
	defer func() {
		for _, t := range uploads {
			be.Free(t)
		}
	}()
	ps := be.LossHeadForward(lh)

	wkd := opt.KDWeight
	if opt.ScaleT2 {
		wkd *= opt.Temperature * opt.Temperature
	}
	norm := float64(M)
	if normalizer > 0 {
		norm = normalizer
	}
	cf := wkd / norm * float64(float32(1/opt.Temperature))
	lseT32, lse132, aT, cK := make([]float32, M), make([]float32, M), make([]float32, M), make([]float32, M*Ku)
	tc, invT := opt.teacherT(), float64(float32(1/opt.Temperature))
	lq, lp, hh := make([]float64, maxK+1), make([]float64, maxK+1), make([]float64, maxK+1)
	zK := make([]float64, maxK)
	q, g := make([]float64, Ku), make([]float64, Ku)
	member := make([]int32, Ku) // member[c] == mg: column c is in the current teacher's set
	mg := int32(0)
	kdT, agree := make([]float64, nT), make([]int, nT)
	var kd, ce float64
	var undecided []int32 // counted positions whose student argmax needs the whole vocabulary
	var undecidedR []int
	for r := 0; r < M; r++ {
		lseT, lse1 := ps.LseT[r], ps.Lse1[r]
		lseT32[r], lse132[r] = float32(lseT), float32(lse1)
		ce += lse1 - float64(ps.ZLab[r])
		t := int(h.rows[r])
		zr := ps.ZK[r*Ku : (r+1)*Ku]
		for c := range q {
			q[c] = math.Exp(float64(zr[c])*invT - lseT)
			g[c] = 0
		}
		tailU := ps.Tail[r]
		a, kdr := 0.0, 0.0 // this position's Σ_t w_t·D_t, added to kd once
		// (so identical teachers at 0.5/0.5 give the single teacher's kd exactly)
		for i, te := range tg.Teachers {
			K, wt := te.K, te.Weight
			p := pos[r*KS+offs[i] : r*KS+offs[i+1]]
			mg++
			for j, c := range p {
				member[c] = mg
				zK[j] = float64(zr[c])
			}
			n := teacherDists(opt, lp, lq, zK[:K], te.TopLP[t*K:(t+1)*K], tc, invT, lseT)
			qTail := 0.0
			if opt.Tail == Bucket {
				// This teacher's tail: the mass outside the union plus
				// the union columns outside its set, added term by term
				// (never 1 - Σ_K q), so it keeps its digits.
				qTail = tailU
				for c := range q {
					if member[c] != mg {
						qTail += q[c]
					}
				}
				lq[K] = math.Log(math.Max(qTail, tailFloor))
			}
			D := divergence(opt, lp[:n], lq[:n], hh[:n])
			kdT[i] += D
			kdr += wt * D
			H := 0.0
			for _, v := range hh[:n] {
				H += v
			}
			for j, c := range p {
				g[c] += wt * (hh[j] - math.Exp(lq[j])*H)
			}
			// Columns outside this teacher's set get its coefficient of
			// q_v (package doc, Gradient), as does every id outside U.
			out := -H
			switch {
			case opt.Tail == Renormalize:
				out = 0
			case opt.Tail == Bucket && qTail > tailFloor:
				out += hh[K] / qTail
			}
			if out != 0 {
				for c := range q {
					if member[c] != mg {
						g[c] += wt * out * q[c]
					}
				}
				a += wt * out
			}
		}
		kd += kdr
		for c := range g {
			cK[r*Ku+c] = float32(cf * g[c])
		}
		aT[r] = float32(math.Max(-1e30, math.Min(1e30, cf*a)))

		// Top-1 agreement. The student's argmax over U (ties: lowest id)
		// is its argmax over the vocabulary when its probability exceeds
		// the whole mass outside U; a teacher's top-1 is in U, so if
		// none of them is U's argmax, all disagree either way.
		best := 0
		for c := 1; c < Ku; c++ {
			if zr[c] > zr[best] {
				best = c
			}
		}
		bid := ids[r*Ku+best]
		some := false
		for _, te := range tg.Teachers {
			some = some || te.TopIDs[t*te.K] == bid
		}
		switch {
		case !some:
		case q[best] > 1.001*tailU:
			for i, te := range tg.Teachers {
				if te.TopIDs[t*te.K] == bid {
					agree[i]++
				}
			}
		default:
			undecided = append(undecided, int32(t))
			undecidedR = append(undecidedR, r)
		}
	}
	h.topkRows = len(undecided)
	if len(undecided) > 0 {
		am := h.argmax(x, w, undecided)
		for k, r := range undecidedR {
			t := int(h.rows[r])
			for i, te := range tg.Teachers {
				if te.TopIDs[t*te.K] == am[k] {
					agree[i]++
				}
			}
		}
	}
	st := Stats{KD: kd / float64(M), CE: ce / float64(M), Tokens: M, Teachers: make([]TeacherStats, nT)}
	for i := range st.Teachers {
		st.Teachers[i] = TeacherStats{KD: kdT[i] / float64(M), Top1: float64(agree[i]) / float64(M)}
	}
	st.Loss = wkd*st.KD + opt.SFTWeight*st.CE
	if dx == nil {
		return st, nil
	}
	coef := &compute.LossCoef{LseT: be.FromF32(lseT32), Lse1: be.FromF32(lse132), A: be.FromF32(aT),
		WSFT: float32(opt.SFTWeight / norm), CK: be.FromF32(cK)}
	uploads = append(uploads, coef.LseT, coef.Lse1, coef.A, coef.CK)
	be.LossHeadBackward(lh, coef, dx, dw)
	return st, nil
}

// argmax returns the student's most likely next token (ties: lowest id)
// at the given rows of x (N,C): the rows are gathered (Embed over x as a
// table) and the LM head's streaming top-1 runs on them alone.
func (h *Head) argmax(x, w compute.Tensor, rows []int32) []int32 {
	be, n := h.Backend, len(rows)
	rt := be.FromI32(rows)
	xs := be.New(compute.F32, n*h.C)
	ids, lps := be.New(compute.I32, n), be.New(compute.F32, n)
	defer func() {
		for _, t := range []compute.Tensor{rt, xs, ids, lps} {
			be.Free(t)
		}
	}()
	be.Embed(xs, x, rt, n, h.C)
	be.LMHeadTopK(ids, lps, xs, w, n, h.C, h.V, 1)
	out := make([]int32, n)
	be.ReadI32(ids, out)
	return out
}
