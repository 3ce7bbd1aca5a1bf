package decoder

import (
	"distill/compute"
)

// trainState is the activation arena of the last training batch and the
// batch itself (kept for the backward).
type trainState struct {
	arena, iarena compute.Tensor // F32 and I32 (MoE routing) activations
	arenaN        int            // tokens the arena is laid out for; -1: re-carve
	acts          trainActs
	b             *batch
	// dprob (numExperts) is the load-balancing loss's gradient w.r.t. the
	// router probabilities (SetRouterAux); nil: no aux loss.
	dprob compute.Tensor
	auxOn bool
}

// trainActs are the views of one batch's activation arena.
type trainActs struct {
	cos, sin compute.Tensor // (N, D/2)
	x0       compute.Tensor // (N,C) token embeddings
	layers   []blockActs
	xL       compute.Tensor // (N,C) residual after the last block
	lnf      compute.Tensor // (N,C) final norm output: the LM head's input
	rstdf    compute.Tensor // (N)
	// One layer's gradient scratch, reused layer after layer; dln also
	// receives the LM head's gradient w.r.t. lnf (HiddenGrad).
	dres, dln, dq, dk, dv, datt, dqpre, dkpre, dgate, dup, dh compute.Tensor
}

// carve lays out the activations of an N-token batch in arena (F32) and
// iarena (I32, the MoE routing), or only counts them when arena is nil;
// it returns their sizes in elements. Sizes and views come from this one
// function so they cannot drift apart.
func (m *Model) carve(a *trainActs, N int, arena, iarena compute.Tensor) (int, int) {
	cfg := m.Cfg
	C, H, KV, D, I := cfg.Hidden, cfg.Heads, cfg.KVHeads, cfg.HeadDim, cfg.Intermediate
	off, ioff := 0, 0
	take := func(n int) compute.Tensor {
		off += n
		if arena == nil {
			return nil
		}
		return m.be.View(arena, off-n, n)
	}
	itake := func(n int) compute.Tensor {
		ioff += n
		if arena == nil {
			return nil
		}
		return m.be.View(iarena, ioff-n, n)
	}
	a.cos, a.sin = take(N*D/2), take(N*D/2)
	a.x0 = take(N * C)
	a.layers = make([]blockActs, cfg.Layers)
	for i := range a.layers {
		l := &a.layers[i]
		l.xin = a.x0
		if i > 0 {
			l.xin = a.layers[i-1].out
		}
		l.ln1, l.rstd1 = take(N*C), take(N)
		if cfg.QKNorm {
			l.qpre, l.qrstd, l.kpre, l.krstd = take(N*H*D), take(N*H), take(N*KV*D), take(N*KV)
		}
		l.q, l.k, l.v, l.att, l.lse = take(N*H*D), take(N*KV*D), take(N*KV*D), take(N*H*D), take(N*H)
		if !cfg.QKNorm {
			l.qpre, l.kpre = l.q, l.k
		}
		l.xmid, l.ln2, l.rstd2 = take(N*C), take(N*C), take(N)
		l.ln1q, l.attq, l.ln2q = l.ln1, l.att, l.ln2
		if m.qad {
			l.ln1q, l.attq = take(N*C), take(N*H*D)
		}
		if cfg.IsMoE(i) {
			// The experts quantize their inputs inside the MoE kernels.
			E, K, IM := cfg.NumExperts, cfg.ExpertsPerTok, cfg.MoEIntermediate
			nf, ni := compute.MoESavedSizes(N, E, K, C, IM)
			fa, ia := take(nf), itake(ni)
			if arena != nil {
				l.moe = compute.NewMoESaved(m.be, fa, ia, N, E, K, C, IM)
			}
		} else {
			l.gate, l.up, l.h = take(N*I), take(N*I), take(N*I)
			l.hq = l.h
			if m.qad {
				l.ln2q, l.hq = take(N*C), take(N*I)
			}
		}
		l.out = take(N * C)
	}
	a.xL = a.x0
	if cfg.Layers > 0 {
		a.xL = a.layers[cfg.Layers-1].out
	}
	a.lnf, a.rstdf = take(N*C), take(N)
	a.dres, a.dln = take(N*C), take(N*C)
	a.dq, a.dk, a.dv, a.datt = take(N*H*D), take(N*KV*D), take(N*KV*D), take(N*H*D)
	if cfg.QKNorm {
		a.dqpre, a.dkpre = take(N*H*D), take(N*KV*D)
	}
	a.dgate, a.dup, a.dh = take(N*I), take(N*I), take(N*I)
	return off, ioff
}

// TrainActivationFloats is the size of the training activation arenas for
// an N-token batch, in 4-byte elements (F32 and the MoE routing's I32).
func (m *Model) TrainActivationFloats(N int) int {
	var a trainActs
	f, i := m.carve(&a, N, nil, nil)
	return f + i
}

// prepare sizes the activation arena for N tokens (growing it only when
// a batch is larger than any before) and carves its views.
func (m *Model) prepare(N int) {
	st := &m.train
	if N == st.arenaN && st.arena != nil {
		return
	}
	var a trainActs
	n, ni := m.carve(&a, N, nil, nil)
	if st.arena == nil || st.arena.Len() < n {
		if st.arena != nil {
			m.be.Free(st.arena)
		}
		st.arena = m.be.New(compute.F32, n)
	}
	if ni > 0 && (st.iarena == nil || st.iarena.Len() < ni) {
		if st.iarena != nil {
			m.be.Free(st.iarena)
		}
		st.iarena = m.be.New(compute.I32, ni)
	}
	m.carve(&st.acts, N, st.arena, st.iarena)
	st.arenaN = N
}

// TrainForward runs the decoder over one packed batch (tokens (N) in the
// vocabulary, sample boundaries starts (nSeq+1), 0 = starts[0] < ... <
// starts[nSeq] = N), saving every activation the backward needs, and
// returns the final normed hidden states (N, hidden), the LM head's input:
// a view valid until the next TrainForward. It turns the load-balancing
// loss off until SetRouterAux.
func (m *Model) TrainForward(tokens, starts []int32) (compute.Tensor, error) {
	N := len(tokens)
	if err := checkStarts(starts, N); err != nil {
		return nil, err
	}
	m.train.auxOn = false
	m.prepare(N)
	st := &m.train
	a := &st.acts
	if st.b != nil {
		m.be.Free(st.b.tokens)
		m.be.Free(st.b.starts)
	}
	st.b = m.upload(tokens, starts, a.cos, a.sin)
	c := m.Cfg
	if m.qad && !m.calibrating {
		m.quantizeWeights()
	}
	m.be.Embed(a.x0, m.Embed.W, st.b.tokens, N, c.Hidden)
	for i := range m.Blocks {
		m.blockForward(&m.Blocks[i], &a.layers[i], st.b)
	}
	m.be.RMSNorm(a.lnf, a.rstdf, a.xL, m.Norm.W, N, c.Hidden, c.RMSNormEps)
	return a.lnf, nil
}

// HiddenGrad is the gradient buffer (N, hidden) of TrainForward's output:
// zero it, let the LM head accumulate into it, then call Backward.
func (m *Model) HiddenGrad() compute.Tensor { return m.train.acts.dln }

// Backward accumulates (+=) the gradient of every parameter from
// HiddenGrad, through the activations of the last TrainForward. Each
// layer's backward mirrors blockForward in reverse.
func (m *Model) Backward() {
	be, c, a, b := m.be, m.Cfg, &m.train.acts, m.train.b
	N, C, H, KV, D := b.n, c.Hidden, c.Heads, c.KVHeads, c.HeadDim
	be.Zero(a.dres)
	be.RMSNormBackward(a.dres, m.Norm.DW, a.dln, a.xL, m.Norm.W, a.rstdf, N, C)
	var dprob compute.Tensor
	if m.train.auxOn {
		dprob = m.train.dprob
	}
	for i := len(m.Blocks) - 1; i >= 0; i-- {
		L, l := &m.Blocks[i], &a.layers[i]
		f, at := L.MLP, &L.Attn
		if L.MoE != nil {
			// out = xmid + moe(ln2): the experts and the router.
			be.Zero(a.dln)
			be.MoEBackward(a.dln, L.moeGrads(), a.dres, l.ln2, m.moeWeights(L), l.moe, dprob, N)
		} else {
			I := f.Gate.Out
			// MLP: out = xmid + down(swiglu(gate(ln2), up(ln2))); dres
			// flows to xmid unchanged (+=).
			be.Zero(a.dh)
			be.MatMulBackward(a.dh, f.Down.DW, nil, a.dres, l.hq, f.Down.weight(), N, C, I)
			be.Zero(a.dgate)
			be.Zero(a.dup)
			be.SwiGLUBackward(a.dgate, a.dup, a.dh, l.gate, l.up, N*I)
			be.Zero(a.dln)
			be.MatMulBackward(a.dln, f.Gate.DW, nil, a.dgate, l.ln2q, f.Gate.weight(), N, I, C)
			be.MatMulBackward(a.dln, f.Up.DW, nil, a.dup, l.ln2q, f.Up.weight(), N, I, C)
		}
		be.RMSNormBackward(a.dres, L.PostNorm.DW, a.dln, l.xmid, L.PostNorm.W, l.rstd2, N, C)
		// Attention: xmid = xin + o(attn(rope(q), rope(k), v)).
		be.Zero(a.datt)
		be.MatMulBackward(a.datt, at.O.DW, at.O.DB, a.dres, l.attq, at.O.weight(), N, C, H*D)
		be.Zero(a.dq)
		be.Zero(a.dk)
		be.Zero(a.dv)
		be.AttentionBackward(a.dq, a.dk, a.dv, a.datt, l.q, l.k, l.v, l.att, l.lse, b.starts, b.nSeq, b.maxLen, N, H, KV, D, attnScale(D))
		be.RoPEBackward(a.dq, b.cos, b.sin, N, H, D)
		be.RoPEBackward(a.dk, b.cos, b.sin, N, KV, D)
		dq, dk := a.dq, a.dk
		if at.QNorm != nil {
			be.Zero(a.dqpre)
			be.Zero(a.dkpre)
			be.RMSNormBackward(a.dqpre, at.QNorm.DW, a.dq, l.qpre, at.QNorm.W, l.qrstd, N*H, D)
			be.RMSNormBackward(a.dkpre, at.KNorm.DW, a.dk, l.kpre, at.KNorm.W, l.krstd, N*KV, D)
			dq, dk = a.dqpre, a.dkpre
		}
		be.Zero(a.dln)
		be.MatMulBackward(a.dln, at.Q.DW, at.Q.DB, dq, l.ln1q, at.Q.weight(), N, H*D, C)
		be.MatMulBackward(a.dln, at.K.DW, at.K.DB, dk, l.ln1q, at.K.weight(), N, KV*D, C)
		be.MatMulBackward(a.dln, at.V.DW, at.V.DB, a.dv, l.ln1q, at.V.weight(), N, KV*D, C)
		be.RMSNormBackward(a.dres, L.InNorm.DW, a.dln, l.xin, L.InNorm.W, l.rstd1, N, C)
	}
	be.EmbedBackward(m.Embed.DW, a.dres, b.tokens, N, C)
}

// RouterStats are the routing statistics of the last TrainForward's MoE
// layers, in layer order.
type RouterStats struct {
	Layers   []int       // the MoE layers' indices
	Counts   [][]int     // per MoE layer and expert: (token, slot) choices
	ProbSums [][]float64 // per MoE layer and expert: Σ_t p[t,e]
	Tokens   int         // tokens of the batch (T)
	TopK     int
}

// Routing reads the routing statistics of the last TrainForward (it
// synchronizes); empty for a dense model.
func (m *Model) Routing() RouterStats {
	be, a, c := m.be, &m.train.acts, m.Cfg
	rs := RouterStats{Tokens: m.train.b.n, TopK: c.ExpertsPerTok}
	E, T := c.NumExperts, rs.Tokens
	for i := range m.Blocks {
		if m.Blocks[i].MoE == nil {
			continue
		}
		s := a.layers[i].moe
		off := make([]int32, E+1)
		be.ReadI32(s.Offsets, off)
		p := make([]float32, T*E)
		be.ReadF32(s.Probs, p)
		cnt, ps := make([]int, E), make([]float64, E)
		for e := 0; e < E; e++ {
			cnt[e] = int(off[e+1] - off[e])
		}
		for t := 0; t < T; t++ {
			for e := 0; e < E; e++ {
				ps[e] += float64(p[t*E+e])
			}
		}
		rs.Layers, rs.Counts, rs.ProbSums = append(rs.Layers, i), append(rs.Counts, cnt), append(rs.ProbSums, ps)
	}
	return rs
}

// Totals are the counts summed over the MoE layers.
func (rs RouterStats) Totals() []int {
	if len(rs.Counts) == 0 {
		return nil
	}
	tot := make([]int, len(rs.Counts[0]))
	for _, c := range rs.Counts {
		for e, v := range c {
			tot[e] += v
		}
	}
	return tot
}

// Aux is HF Qwen3-MoE's load-balancing loss (load_balancing_loss_func with
// every token counted) of these statistics: the MoE layers' tokens
// pooled, aux = E·Σ_e f_e·P_e with f_e the share of the (layer, token,
// slot) choices that picked expert e and P_e the mean router probability
// of e over the (layer, token) rows; 0 for a dense model. A perfectly
// balanced router gives K (top-k).
func (rs RouterStats) Aux() float64 {
	if len(rs.Counts) == 0 || rs.Tokens == 0 {
		return 0
	}
	n := float64(len(rs.Counts) * rs.Tokens)
	tot := rs.Totals()
	var s float64
	for e := range tot {
		var p float64
		for _, ps := range rs.ProbSums {
			p += ps[e]
		}
		s += float64(tot[e]) / n * p / n
	}
	return s * float64(len(tot))
}

// SetRouterAux adds coef·aux (the load-balancing loss of rs, the
// statistics of the last TrainForward) to what the next Backward
// differentiates; coef 0 leaves it out. TrainForward resets it.
func (m *Model) SetRouterAux(coef float64, rs RouterStats) {
	m.train.auxOn = coef != 0 && len(rs.Counts) > 0
	if !m.train.auxOn {
		return
	}
	g := compute.MoEAuxGrad(coef, rs.Totals(), len(rs.Counts), rs.Tokens)
	if m.train.dprob == nil {
		m.train.dprob = m.be.New(compute.F32, len(g))
	}
	m.be.WriteF32(m.train.dprob, g)
}
