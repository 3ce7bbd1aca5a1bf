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
	if err := h.checkBatch(x, tg); err != nil {
		return Stats{}, err
	}
	offs, maxK, err := checkTeachers(tg.Teachers, len(tg.Tokens), h.V, opt)
	if err != nil {
		return Stats{}, err
	}
	topts, err := teacherOptions(tg.Teachers, opt)
	if err != nil {
		return Stats{}, err
	}
	h.countRows(tg)
	M := len(h.rows)
	if M == 0 {
		return Stats{}, nil
	}
	KS := offs[len(tg.Teachers)]
	uni, ulen, Ku, gen, err := h.unions(tg, topts, KS)
	if err != nil {
		return Stats{}, err
	}
	ids, pos := h.unionColumns(tg, offs, uni, ulen, Ku, gen)
	call := h.newCall(x, w, dx, opt, ids, Ku)
	defer call.free()
	ps := call.be.LossHeadForward(call.lh)

	wkd, norm := opt.weights(M, normalizer)
	mp := newMultiPass(h, tg, opt, topts, &ps, ids, pos, offs, Ku, maxK)
	cf := wkd / norm * mp.m.invT
	co := newCoefs(M, Ku)
	var kd, ce float64
	for r := 0; r < M; r++ {
		ce += co.keepLse(&ps, r)
		kd += mp.position(r, cf, co)
		mp.top1(r)
	}
	h.topkRows = len(mp.undecided)
	if len(mp.undecided) > 0 {
		am := h.argmax(x, w, mp.undecided)
		for k, r := range mp.undecidedR {
			mp.agreeWith(int(h.rows[r]), am[k])
		}
	}
	st := Stats{KD: kd / float64(M), CE: ce / float64(M), Tokens: M, Teachers: make([]TeacherStats, len(tg.Teachers))}
	for i := range st.Teachers {
		st.Teachers[i] = TeacherStats{KD: mp.kdT[i] / float64(M), Top1: float64(mp.agree[i]) / float64(M)}
	}
	st.Loss = wkd*st.KD + opt.SFTWeight*st.CE
	if dx == nil {
		return st, nil
	}
	call.backward(co, float32(opt.SFTWeight/norm), dx, dw)
	return st, nil
}

// checkTeachers checks every teacher's k, top-k sizes for N tokens and
// weight, and that some weight is > 0. Teacher i's ranks are the columns
// offs[i]..offs[i+1] of a position's rank-to-union map; maxK is the
// widest k.
func checkTeachers(teachers []Teacher, N, V int, opt *Options) (offs []int, maxK int, err error) {
	offs = make([]int, len(teachers)+1)
	var wsum float64
	for i, te := range teachers {
		if te.K <= 0 || te.K > V {
			return nil, 0, fmt.Errorf("%w: teacher %d: k = %d: want 1 <= k <= vocab %d", ErrInvalid, i, te.K, V)
		}
		if len(te.TopIDs) != N*te.K || len(te.TopLP) != N*te.K {
			return nil, 0, fmt.Errorf("%w: teacher %d: top-k has %d ids and %d log-probs, want tokens %d x k %d", ErrInvalid, i, len(te.TopIDs), len(te.TopLP), N, te.K)
		}
		if !(te.Weight >= 0) || math.IsInf(te.Weight, 0) {
			return nil, 0, fmt.Errorf("%w: teacher %d: weight %g: want a finite value >= 0", ErrInvalid, i, te.Weight)
		}
		wsum += te.Weight
		offs[i+1] = offs[i] + te.K
		maxK = max(maxK, te.K)
	}
	if wsum == 0 {
		return nil, 0, fmt.Errorf("%w: every teacher's weight is 0 with kd_weight %g: nothing to distill from; give a teacher a weight > 0, or set kd_weight 0", ErrInvalid, opt.KDWeight)
	}
	return offs, maxK, nil
}

// teacherOptions are each teacher's options: opt with the teacher's
// target kind (Teacher.Targets, else opt's). A sampled teacher beside
// top-k ones takes the sampled kinds' rules (Options.validateSampled).
func teacherOptions(teachers []Teacher, opt *Options) ([]Options, error) {
	out := make([]Options, len(teachers))
	for i, te := range teachers {
		out[i] = *opt
		if te.Targets == "" || te.Targets == opt.Targets {
			continue
		}
		out[i].Targets = te.Targets
		switch te.Targets {
		case TopK:
		case Sampled, HeadSampled:
			if err := out[i].validateSampled(); err != nil {
				return nil, fmt.Errorf("teacher %d: %w", i, err)
			}
		default:
			return nil, fmt.Errorf("%w: teacher %d: targets %q: want topk, sampled or head+sampled", ErrInvalid, i, te.Targets)
		}
	}
	return out, nil
}

// unions checks every teacher row of a counted position and builds the
// union of the position's ids (first-seen order) into
// uni[r*KS : r*KS+ulen[r]]. Ku is the widest union; gen is the last stamp
// used, which unionColumns goes on from.
func (h *Head) unions(tg *Targets, topts []Options, KS int) (uni []int32, ulen []int, Ku int, gen int32, err error) {
	V, M := h.V, len(h.rows)
	h.stamp, h.ustamp, h.slot = growI(h.stamp, V), growI(h.ustamp, V), growI(h.slot, V)
	clear(h.stamp)
	clear(h.ustamp)
	uni, ulen = make([]int32, M*KS), make([]int, M)
	for r, t := range h.rows {
		gen++
		ug := gen
		u := uni[r*KS : r*KS]
		for i, te := range tg.Teachers {
			gen++
			K := te.K
			row := te.TopIDs[int(t)*K : int(t+1)*K]
			if err := h.checkTeacherRow(i, t, row, te.TopLP[int(t)*K:int(t+1)*K], gen, topts[i].sparse()); err != nil {
				return nil, nil, 0, 0, err
			}
			for _, id := range row {
				if h.ustamp[id] != ug {
					h.ustamp[id] = ug
					u = append(u, id)
				}
			}
		}
		ulen[r] = len(u)
		Ku = max(Ku, len(u))
	}
	return uni, ulen, Ku, gen, nil
}

// unionColumns pads each position's union to Ku with the lowest ids
// outside it and sorts it ascending (the kernels' order) into ids (M,Ku),
// and maps every teacher rank to its union column in pos (M,KS).
func (h *Head) unionColumns(tg *Targets, offs []int, uni []int32, ulen []int, Ku int, gen int32) (ids, pos []int32) {
	M, KS := len(h.rows), offs[len(tg.Teachers)]
	ids, pos = make([]int32, M*Ku), make([]int32, M*KS)
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
	return ids, pos
}

// multiPass is the host math of pass 1's results over the union columns:
// each position's teachers' terms, their weighted gradient coefficients,
// and each teacher's divergence and top-1 agreement.
type multiPass struct {
	h    *Head
	tg   *Targets
	opt  *Options
	ps   *compute.LossStats
	ids  []int32 // (M,Ku) the union columns' ids
	pos  []int32 // (M,KS) each teacher rank's union column
	offs []int   // teacher i's ranks are columns offs[i]..offs[i+1] of pos
	Ku   int
	m    *kdMath   // the options' (invT)
	mt   []*kdMath // each teacher's: its own target kind

	q, g   []float64 // (Ku) the position's q_v on the union, its coefficients
	member []int32   // member[c] == mg: column c is in the current teacher's set
	mg     int32

	kdT   []float64 // Σ over positions of each teacher's D_t
	agree []int     // positions where the student's argmax is the teacher's top-1
	// undecided are the counted positions whose student argmax needs the
	// whole vocabulary, and undecidedR their indices among the positions.
	undecided  []int32
	undecidedR []int
}

func newMultiPass(h *Head, tg *Targets, opt *Options, topts []Options, ps *compute.LossStats, ids, pos []int32, offs []int, Ku, maxK int) *multiPass {
	nT := len(tg.Teachers)
	mp := &multiPass{h: h, tg: tg, opt: opt, ps: ps, ids: ids, pos: pos, offs: offs, Ku: Ku, m: newKDMath(opt, maxK),
		q: make([]float64, Ku), g: make([]float64, Ku), member: make([]int32, Ku),
		kdT: make([]float64, nT), agree: make([]int, nT)}
	for i := range topts {
		m := mp.m
		if topts[i].Targets != opt.Targets {
			m = newKDMath(&topts[i], maxK)
		}
		mp.mt = append(mp.mt, m)
	}
	return mp
}

// position computes counted position r's teachers' terms and writes its
// coefficients, scaled by cf, to co; it returns Σ_t w_t·D_t, which the
// caller adds to the KD sum once (so identical teachers at 0.5/0.5 give
// the single teacher's kd exactly).
func (mp *multiPass) position(r int, cf float64, co *coefs) float64 {
	Ku, KS, t := mp.Ku, mp.offs[len(mp.offs)-1], int(mp.h.rows[r])
	lseT := mp.ps.LseT[r]
	zr := mp.ps.ZK[r*Ku : (r+1)*Ku]
	for c := range mp.q {
		mp.q[c] = compute.Exp(float64(float64(zr[c])*mp.m.invT) - lseT)
		mp.g[c] = 0
	}
	a, kdr := 0.0, 0.0
	for i, te := range mp.tg.Teachers {
		wt := te.Weight
		p := mp.pos[r*KS+mp.offs[i] : r*KS+mp.offs[i+1]]
		m := mp.mt[i]
		D, H, out := mp.teacherTerm(m, te, t, p, zr, lseT, mp.ps.Tail[r])
		mp.kdT[i] += D
		kdr += wt * D
		for j, c := range p {
			mp.g[c] += wt * m.coefK(j, H)
		}
		// Columns outside this teacher's set get its coefficient of
		// q_v (package doc, Gradient), as does every id outside U.
		if out != 0 {
			for c := range mp.q {
				if mp.member[c] != mp.mg {
					mp.g[c] += wt * out * mp.q[c]
				}
			}
			a += wt * out
		}
	}
	for c := range mp.g {
		co.cK[r*Ku+c] = float32(cf * mp.g[c])
	}
	co.a[r] = clampCoef(cf * a)
	return kdr
}

// teacherTerm is teacher te's term at token t (m.term, m its kind's
// math), its ranks being the union columns p of the position's logits
// zr, marked in member. Under bucket, a top-k teacher's tail is the mass
// outside the union, tailU, plus the union columns outside its set, added
// term by term (never 1 - Σ_K q), so it keeps its digits.
func (mp *multiPass) teacherTerm(m *kdMath, te Teacher, t int, p []int32, zr []float32, lseT, tailU float64) (D, H, out float64) {
	mp.mg++
	for j, c := range p {
		mp.member[c] = mp.mg
		m.zK[j] = float64(zr[c])
	}
	qTail := 0.0
	if mp.opt.Tail == Bucket && !m.opt.sparse() {
		qTail = tailU
		for c := range mp.q {
			if mp.member[c] != mp.mg {
				qTail += mp.q[c]
			}
		}
	}
	return m.term(te.TopLP[t*te.K:(t+1)*te.K], lseT, qTail)
}

// top1 counts the teachers whose top-1 is the student's argmax at
// counted position r, after position(r) (it reads the position's q). The
// student's argmax over U (ties: lowest id) is its argmax over the
// vocabulary when its probability exceeds the whole mass outside U; a
// teacher's top-1 is in U, so if none of them is U's argmax, all disagree
// either way. Otherwise the position is left to the LM head's top-1
// (undecided).
func (mp *multiPass) top1(r int) {
	Ku, t := mp.Ku, int(mp.h.rows[r])
	zr := mp.ps.ZK[r*Ku : (r+1)*Ku]
	best := 0
	for c := 1; c < Ku; c++ {
		if zr[c] > zr[best] {
			best = c
		}
	}
	bid := mp.ids[r*Ku+best]
	some := false
	for _, te := range mp.tg.Teachers {
		some = some || te.TopIDs[t*te.K] == bid
	}
	switch {
	case !some:
	case mp.q[best] > 1.001*mp.ps.Tail[r]:
		mp.agreeWith(t, bid)
	default:
		mp.undecided = append(mp.undecided, int32(t))
		mp.undecidedR = append(mp.undecidedR, r)
	}
}

// agreeWith counts the teachers whose top-1 at token t is id.
func (mp *multiPass) agreeWith(t int, id int32) {
	for i, te := range mp.tg.Teachers {
		if te.TopIDs[t*te.K] == id {
			mp.agree[i]++
		}
	}
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
