package decoder

import (
	"math"

	"distill/compute"
	"distill/model"
)

// blockActs are the tensors one block's forward reads and writes. Training
// gives every layer its own views of the activation arena; inference gives
// every layer the same buffers, aliased where a value is not needed later
// (see TopK), and nil statistics.
type blockActs struct {
	xin                      compute.Tensor    // (N,C) the block's input, read only
	ln1, rstd1               compute.Tensor    // (N,C), (N)
	ln1q                     compute.Tensor    // QAD: ln1 quantized; else ln1
	qpre, qrstd, kpre, krstd compute.Tensor    // q/k before their norms (Qwen3); else q, nil, k, nil
	q, k, v                  compute.Tensor    // (N,H,D), (N,KV,D), (N,KV,D)
	att, lse                 compute.Tensor    // (N,H,D), (N,H)
	attq                     compute.Tensor    // QAD: att quantized; else att
	xmid                     compute.Tensor    // (N,C) residual after attention
	ln2, rstd2, ln2q         compute.Tensor    // (N,C), (N), (N,C)
	gate, up, h, hq          compute.Tensor    // (N,I); h may alias gate; hq: QAD h quantized
	moe                      *compute.MoESaved // training an MoE block: what MoEBackward needs; else nil
	out                      compute.Tensor    // (N,C) the block's output; may alias xin
}

// blockForward runs one decoder layer:
//
//	xmid = xin + o(attn(rope(norm_q(q(ln1))), rope(norm_k(k(ln1))), v(ln1)))   ln1 = rmsnorm(xin)
//	out  = xmid + down(silu(gate(ln2))·up(ln2))                               ln2 = rmsnorm(xmid)
//
// (or out = xmid + moe(ln2)), saving what a's statistics tensors (and,
// for an MoE block in training, a.moe) ask for. Each residual add is one
// AddRMSNorm with the norm that follows it: xmid's with ln2, out's with
// next (the next block's ln1, or the final norm), so a block's ln1 is the
// previous block's work, and only the first block (normIn) norms its
// input itself.
func (m *Model) blockForward(L *Block, a *blockActs, b *batch, normIn bool, next *nextNorm) {
	m.attnForward(L, a, b, normIn)
	m.mlpForward(L, a, b.n, true, next)
}

// nextNorm is the norm after a block's output: out = rmsnorm(x)·w with
// its statistics rstd (or nil).
type nextNorm struct{ out, rstd, w compute.Tensor }

// attnForward is blockForward's first half: xmid = xin + o(attn(...)),
// and ln2 = rmsnorm(xmid), the MLP's input (the residual add and the norm
// are one AddRMSNorm). normIn: ln1 = rmsnorm(xin) is computed here, not
// left by the previous block.
func (m *Model) attnForward(L *Block, a *blockActs, b *batch, normIn bool) {
	be, c := m.be, m.Cfg
	N, C, H, KV, D := b.n, c.Hidden, c.Heads, c.KVHeads, c.HeadDim
	eps := c.RMSNormEps
	if normIn {
		be.RMSNorm(a.ln1, a.rstd1, a.xin, L.InNorm.W, N, C, eps)
	}
	m.quantInput(&L.InQKV, a.ln1q, a.ln1, N, C)
	at := &L.Attn
	m.linear(&at.Q, a.qpre, a.ln1q, N)
	m.linear(&at.K, a.kpre, a.ln1q, N)
	m.linear(&at.V, a.v, a.ln1q, N)
	if at.QNorm != nil { // the per-head norms and RoPE, fused
		be.RMSNormRoPE(a.q, a.qrstd, a.qpre, at.QNorm.W, b.cos, b.sin, N, H, D, eps)
		be.RMSNormRoPE(a.k, a.krstd, a.kpre, at.KNorm.W, b.cos, b.sin, N, KV, D, eps)
	} else {
		be.RoPE(a.q, b.cos, b.sin, N, H, D)
		be.RoPE(a.k, b.cos, b.sin, N, KV, D)
	}
	be.Attention(a.att, a.lse, a.q, a.k, a.v, b.starts, b.nSeq, b.maxLen, N, H, KV, D, attnScale(D))
	m.quantInput(&L.InO, a.attq, a.att, N, H*D)
	if m.linearResidual(&at.O, a.xmid, a.attq, a.xin, N) {
		be.RMSNorm(a.ln2, a.rstd2, a.xmid, L.PostNorm.W, N, C, eps)
		return
	}
	m.linear(&at.O, a.xmid, a.attq, N)
	be.AddRMSNorm(a.ln2, a.rstd2, a.xmid, a.xin, L.PostNorm.W, N, C, eps)
}

// linearResidual is linear(l, out, x, N) followed by out += res (the
// residual connection, res F32 (N, l.Out)) in one GEMM, where the backend
// adds in the GEMM's epilogue (compute.ResidualMatMul) and l has neither
// bias nor adapter; false, with nothing done, where it does not.
func (m *Model) linearResidual(l *Linear, out, x, res compute.Tensor, N int) bool {
	rm, ok := m.be.(compute.ResidualMatMul)
	if !ok || l.B != nil || l.LoRA != nil || out.DType() != compute.F32 {
		return false
	}
	return rm.MatMulResidual(out, x, l.weight(), res, N, l.Out, l.In)
}

// mlpForward is blockForward's second half: out = xmid + mlp(ln2) (or
// moe(ln2)), ln2 from attnForward, and next's norm of out when next is
// set. Without down (a full recompute in the backward, which needs the
// MLP's inputs and activations but not its output), a dense block stops
// before the down projection.
func (m *Model) mlpForward(L *Block, a *blockActs, N int, down bool, next *nextNorm) {
	be, c := m.be, m.Cfg
	C := c.Hidden
	if L.MoE != nil && a.moe == nil {
		be.MoE(a.out, a.ln2, L.MoE, N)
	} else if L.MoE != nil {
		be.MoEForward(a.out, a.ln2, m.moeWeights(L), a.moe, N)
		if m.qad && m.calibrating || m.observing {
			m.observeMoE(L, a, N)
		}
	} else {
		f := L.MLP
		m.quantInput(&L.InGateUp, a.ln2q, a.ln2, N, C)
		m.gateUp(L, a, N)
		if !down {
			return
		}
		if m.linearResidual(&f.Down, a.out, a.hq, a.xmid, N) {
			if next != nil {
				be.RMSNorm(next.out, next.rstd, a.out, next.w, N, C, c.RMSNormEps)
			}
			return
		}
		m.linear(&f.Down, a.out, a.hq, N)
	}
	if next != nil {
		be.AddRMSNorm(next.out, next.rstd, a.out, a.xmid, next.w, N, C, c.RMSNormEps)
		return
	}
	be.Add(a.out, a.xmid, N*C)
}

// gateUp computes a dense MLP's gate, up, h = silu(gate)·up and its
// quantized copy hq from ln2q: what a selective recompute re-runs.
func (m *Model) gateUp(L *Block, a *blockActs, N int) {
	be, f := m.be, L.MLP
	I := f.Gate.Out
	m.linear(&f.Gate, a.gate, a.ln2q, N)
	m.linear(&f.Up, a.up, a.ln2q, N)
	be.SwiGLU(a.h, a.gate, a.up, N*I)
	m.quantInput(&L.InDown, a.hq, a.h, N, I)
}

func attnScale(d int) float32 { return float32(1 / math.Sqrt(float64(d))) }

// upload puts a packed batch on the backend. The caller frees tokens and
// starts (batch.free); cos and sin go to the given tensors, or to new
// ones. train: a training batch, whose attention backward may run as
// runs of samples (attnGroups; their starts are the batch's too).
func (m *Model) upload(tokens, starts []int32, cos, sin compute.Tensor, train bool) *batch {
	be, c := m.be, m.Cfg
	b := &batch{n: len(tokens), nSeq: len(starts) - 1}
	for s := 0; s+1 < len(starts); s++ {
		b.maxLen = max(b.maxLen, int(starts[s+1]-starts[s]))
	}
	half := c.HeadDim / 2
	made := cos == nil
	var posT compute.Tensor
	defer func() { // a backend's panic (out of memory): free what is made here
		if r := recover(); r != nil {
			if made {
				freeAll(be, b.cos, b.sin)
			}
			freeAll(be, posT)
			b.free(be)
			panic(r)
		}
	}()
	if made { // a forward's: gathered on the backend from the table kept there
		pos := make([]int32, b.n)
		for s := 0; s+1 < len(starts); s++ { // each sample's positions from 0: rows of the table
			for t := starts[s]; t < starts[s+1]; t++ {
				pos[t] = t - starts[s]
			}
		}
		b.cos = be.New(compute.F32, b.n*half)
		b.sin = be.New(compute.F32, b.n*half)
		posT = be.FromI32(pos)
		m.rope.gather(be, b.cos, b.sin, posT, b.n, b.maxLen, c.InvFreq())
		be.Free(posT) // (after the gathers, on a backend with a stream)
		posT = nil
	} else { // a training step's: written into its arena from the host rows
		// (train.PlanMemory counts no table on the backend.)
		hc, hs := make([]float32, b.n*half), make([]float32, b.n*half)
		rc, rs := m.rope.upTo(b.maxLen, c.InvFreq())
		for s := 0; s+1 < len(starts); s++ { // each sample's positions from 0: ropeTable's rows
			lo, hi := int(starts[s])*half, int(starts[s+1])*half
			copy(hc[lo:hi], rc[:hi-lo])
			copy(hs[lo:hi], rs[:hi-lo])
		}
		be.WriteF32(cos, hc)
		be.WriteF32(sin, hs)
		b.cos, b.sin = cos, sin
	}
	b.tokens = be.FromI32(tokens)
	b.starts = be.FromI32(starts)
	var runs [][2]int
	if _, ok := be.(compute.AttentionWorkspaceReporter); train && (ok || attnGroupsAlways) {
		runs = attnGroups(starts) // a library that sizes its workspace by the bucket (cuDNN)
	}
	for _, r := range runs {
		g := attnGroup{tok0: int(starts[r[0]]), n: int(starts[r[1]] - starts[r[0]]), nSeq: r[1] - r[0]}
		rel := make([]int32, g.nSeq+1)
		for i := range rel {
			rel[i] = starts[r[0]+i] - starts[r[0]]
		}
		for i := 0; i < g.nSeq; i++ {
			g.maxLen = max(g.maxLen, int(rel[i+1]-rel[i]))
		}
		b.groups = append(b.groups, g)
		b.groups[len(b.groups)-1].starts = be.FromI32(rel)
	}
	return b
}

// TopK runs the decoder over one packed batch and returns each position's
// top-k: ids (n,k) and log-probs (n,k) normalized over the full vocabulary,
// n the total tokens. samples must be valid (non-empty, ids in the
// vocabulary: package infer validates them); temperature divides the
// logits (1: none).
//
//	tokens (n) -> embed (n,H) -> blocks -> norm (n,H) -> LM-head top-k (n,k)
//
// Activations are reused layer to layer: x and y hold the residual stream
// (a block reads x, writes xmid to y and its output back to x), ln both
// norms' outputs, q/k are normed in place, and the MLP's h overwrites gate.
// x and y are F32; ln, q, k, v, the attention output, gate and up are in
// the backend's activation dtype, except that an MoE block's input (ln2)
// is F32 (its router runs in fp32). Memory beyond the weights is
// ActivationBytes plus the backend's kernel scratch.
func (m *Model) TopK(samples [][]int32, k int, temperature float32) (ids []int32, logprobs []float32) {
	return m.TopKThen(samples, k, temperature, nil)
}

// TopKThen is TopK that also hands fn, when not nil, the LM head's input
// x (n, hidden) in the activation dtype, 1/temperature folded in, with
// the top-k, before x is freed: package infer draws the sampled targets
// from its logits. k 0 skips the top-k.
func (m *Model) TopKThen(samples [][]int32, k int, temperature float32, fn func(x compute.Tensor, n int, ids []int32, logprobs []float32)) (ids []int32, logprobs []float32) {
	p := &Pipeline{Stages: []*Model{m}, MicroBatches: 1}
	p.Forward(samples, temperature, func(last *Model, x compute.Tensor, _, _ int, mb [][]int32) {
		n := 0
		for _, s := range mb {
			n += len(s)
		}
		ids, logprobs = last.lmHeadTopK(x, n, k)
		if fn != nil {
			fn(x, n, ids, logprobs)
		}
	})
	return ids, logprobs
}

// lmHeadTopK runs the LM head's top-k over x (n rows) and reads it. Its
// outputs are freed on a backend's panic too.
func (m *Model) lmHeadTopK(x compute.Tensor, n, k int) (ids []int32, logprobs []float32) {
	be, c := m.be, m.Cfg
	var idT, lpT compute.Tensor
	defer func() { freeAll(be, idT, lpT) }()
	idT = be.New(compute.I32, n*k)
	lpT = be.New(compute.F32, n*k)
	if k > 0 {
		be.LMHeadTopK(idT, lpT, x, m.Head.W, n, c.Hidden, c.VocabSize, k)
	}
	ids, logprobs = make([]int32, n*k), make([]float32, n*k)
	be.ReadI32(idT, ids)
	be.ReadF32(lpT, logprobs)
	return ids, logprobs
}

// freeAll frees the tensors that are not nil.
func freeAll(be compute.Backend, ts ...compute.Tensor) {
	for _, t := range ts {
		if t != nil {
			be.Free(t)
		}
	}
}

// fwdActs are the buffers of one stage's forward over one batch (see
// TopK): x and ln are what a stage hands the next (handoff), tmp the rest.
type fwdActs struct {
	a     blockActs
	x, ln compute.Tensor
	tmp   []compute.Tensor
}

// allocFwdActs allocates a forward's buffers for n tokens on m's backend
// into f, each recorded as soon as it is made: after a backend's panic
// (out of memory) f.free frees those made before it.
func (m *Model) allocFwdActs(f *fwdActs, n int) {
	be, c := m.be, m.Cfg
	alloc := func(dt compute.DType, size int) compute.Tensor {
		t := be.New(dt, size)
		f.tmp = append(f.tmp, t)
		return t
	}
	C, Hq, Hkv := c.Hidden, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	act := be.ActDType()
	f.x = be.New(compute.F32, n*C)
	f.ln = be.New(act, n*C)
	y := alloc(compute.F32, n*C)
	q, kk, v := alloc(act, n*Hq), alloc(act, n*Hkv), alloc(act, n*Hkv)
	f.a = blockActs{xin: f.x, ln1: f.ln, ln1q: f.ln, qpre: q, q: q, kpre: kk, k: kk, v: v,
		att: alloc(act, n*Hq), xmid: y, ln2: f.ln, ln2q: f.ln, out: f.x}
	f.a.attq = f.a.att
	if c.NumExperts > 0 && act != compute.F32 {
		f.a.ln2 = alloc(compute.F32, n*C)
		f.a.ln2q = f.a.ln2
	}
	if c.Intermediate > 0 {
		f.a.gate, f.a.up = alloc(act, n*c.Intermediate), alloc(act, n*c.Intermediate)
		f.a.h, f.a.hq = f.a.gate, f.a.gate
	}
}

// freeTmp frees the buffers but x and ln.
func (f *fwdActs) freeTmp(be compute.Backend) {
	freeAll(be, f.tmp...)
	f.tmp = nil
}

// free frees every buffer made so far (Free is idempotent).
func (f *fwdActs) free(be compute.Backend) {
	f.freeTmp(be)
	freeAll(be, f.x, f.ln)
}

// handoff is what a stage passes the next for one micro-batch: its
// residual stream x (F32) and the next layer's normed input ln (the
// activation dtype), on the stage's backend, and the mark of the work
// making them (compute.MarkOf: nil on a backend whose calls return with
// their work done): the next stage's copy waits for that on the device,
// not for what the stage issues after it.
type handoff struct {
	be    compute.Backend
	x, ln compute.Tensor
	mark  compute.Mark
}

// free releases a hand-off's tensors and mark on their backend.
func (h *handoff) free() {
	h.be.Free(h.x)
	h.be.Free(h.ln)
	compute.ReleaseMark(h.mark)
	h.mark = nil
}

// stageForward runs m's layers over one packed batch (flat tokens,
// sample starts): the embedding on the first stage, else the previous
// stage's hand-off in (copied to m's backend after the work its mark
// marks, then freed on its own: the caller's on a panic); then layers
// [m.first, m.end). A stage with the head returns its buffers with ln
// holding the final norm's output (normW, the temperature's weight); the
// caller runs the head and frees them. Other stages return the hand-off
// for the next, their other buffers freed, its mark set. A backend's
// panic (out of memory, a failed kernel) frees what this call allocated
// before it is raised again.
func (m *Model) stageForward(flat, starts []int32, in *handoff, normW compute.Tensor) (*fwdActs, *handoff) {
	be, c := m.be, m.Cfg
	n, C := len(flat), c.Hidden
	f := &fwdActs{}
	defer func() {
		if r := recover(); r != nil {
			f.free(be)
			panic(r)
		}
	}()
	b := m.upload(flat, starts, nil, nil, false)
	f.tmp = append(f.tmp, b.tokens, b.starts, b.cos, b.sin)
	m.allocFwdActs(f, n)
	if in == nil {
		be.Embed(f.x, m.Embed.W, b.tokens, n, C)
	} else {
		compute.CopyAcrossAfter(be, f.x, in.be, in.x, in.mark)
		compute.CopyAcrossAfter(be, f.ln, in.be, in.ln, in.mark)
		in.free()
	}
	// Each block leaves the next one's ln1 in ln, the last the final norm's.
	for i := m.first; i < m.end; i++ {
		next := &nextNorm{out: f.ln, w: normW}
		switch {
		case i+1 < m.end:
			next.w = m.Blocks[i+1].InNorm.W
		case m.nextIn != nil:
			next.w = m.nextIn
		}
		m.blockForward(&m.Blocks[i], &f.a, b, i == 0, next)
	}
	if c.Layers == 0 {
		be.RMSNorm(f.ln, nil, f.x, normW, n, C, c.RMSNormEps)
	}
	if m.nextIn == nil {
		return f, nil
	}
	out := &handoff{be: be, x: f.x, ln: f.ln, mark: compute.MarkOf(be)}
	f.freeTmp(be)
	return nil, out
}

// finalNorm is the final norm's weight with 1/temperature folded in:
// logits/T = (x·Wᵀ)/T = (x·(w/T))·Wᵀ, instead of scaling [n x vocab]
// logits. A new tensor the caller frees, or m.Norm.W itself (T = 1).
func (m *Model) finalNorm(temperature float32) (w compute.Tensor, made bool) {
	if temperature == 1 {
		return m.Norm.W, false
	}
	h := make([]float32, m.Cfg.Hidden)
	m.be.ReadF32(m.Norm.W, h)
	for j := range h {
		h[j] /= temperature
	}
	return m.be.FromF32(h), true
}

// ActivationBytes is what TopK holds on the backend for n tokens at top-k
// beside the weights and the kernels' scratch, with activations of the
// backend's dtype: x, y (F32), ln, q, k, v, attention output, gate and up
// (activation dtype; an MoE model's F32 ln2 besides), the top-k ids and
// log-probs, the batch's RoPE table and the rows it is gathered from
// (kept between forwards), the token ids, positions and sample starts
// (at most n+1 samples), and the temperature-scaled norm weight.
func (m *Model) ActivationBytes(n, k int) int64 {
	return ActivationBytesOf(m.Cfg, n, k, m.be.ActDType())
}

// ActivationBytesOf is ActivationBytes of a model of c on a backend whose
// activations are act, with no model or backend (plans on paper).
func ActivationBytesOf(c *model.Config, n, k int, act compute.DType) int64 {
	N := int64(n)
	C, Hq, Hkv, I := int64(c.Hidden), int64(c.Heads*c.HeadDim), int64(c.KVHeads*c.HeadDim), int64(c.Intermediate)
	f := 4 * 2 * N * C
	f += int64(act.Size()) * (N*(C+2*Hq+2*Hkv) + 2*N*I)
	if c.NumExperts > 0 && act != compute.F32 {
		f += 4 * N * C
	}
	f += 4 * 2 * N * int64(k)
	f += 4 * N * int64(c.HeadDim) // cos, sin
	f += 8 * N * int64(c.HeadDim) // the RoPE table on the backend: rows of up to twice the longest sample (ropeRows)
	f += 4 * (N + N + 1 + N)      // tokens, starts, positions
	return f + 4*C
}
