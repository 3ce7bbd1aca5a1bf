package decoder

import (
	"fmt"

	"distill/compute"
	"distill/model"
)

// Recompute is how much of a layer's forward the backward re-runs
// instead of keeping its activations (Megatron-LM's activation
// recomputation), set by SetRecompute:
//
//   - RecomputeNone keeps every activation the backward reads;
//   - RecomputeSelective keeps everything but a dense MLP's gate, up,
//     h = silu(gate)·up (and under QAD its quantized h): the backward
//     re-runs the gate and up GEMMs and SwiGLU from the kept ln2, in one
//     set of buffers all layers share. Attention's probabilities are
//     never kept (the kernels recompute them from the log-sum-exp); an
//     MoE block's routing and expert activations are kept;
//   - RecomputeFull keeps only each layer's input (the residual stream
//     between layers) and re-runs the whole layer's forward, the
//     attention included, before its backward, in one set of buffers all
//     layers share; the MoE routing statistics are recorded during the
//     forward (compute.MoERouting).
//
// A recompute runs the same kernels on the same inputs as the forward, so
// the recomputed tensors are the forward's bit for bit on a deterministic
// backend, and the gradients do not depend on the mode.
type Recompute string

// The recompute modes.
const (
	RecomputeNone      Recompute = "none"
	RecomputeSelective Recompute = "selective"
	RecomputeFull      Recompute = "full"
)

// RecomputeModes lists the modes from the least recomputation to the most.
var RecomputeModes = []Recompute{RecomputeNone, RecomputeSelective, RecomputeFull}

// ParseRecompute checks a mode's name ("" is none).
func ParseRecompute(s string) (Recompute, error) {
	if s == "" {
		return RecomputeNone, nil
	}
	for _, r := range RecomputeModes {
		if string(r) == s {
			return r, nil
		}
	}
	return "", fmt.Errorf("%w: recompute %q: want none, selective or full", ErrInvalid, s)
}

// SetRecompute sets the recompute mode of the next TrainForward.
func (m *Model) SetRecompute(r Recompute) error {
	r, err := ParseRecompute(string(r))
	if err != nil {
		return err
	}
	if r != m.recompute {
		m.recompute = r
		m.train.arenaN = -1
	}
	return nil
}

// RecomputeMode returns the recompute mode (RecomputeNone by default).
func (m *Model) RecomputeMode() Recompute {
	if m.recompute == "" {
		return RecomputeNone
	}
	return m.recompute
}

// trainState is the activation arena of the last training batch and the
// batch itself (kept for the backward).
type trainState struct {
	// arena (F32: the residual stream, statistics, gradients), aarena (the
	// backend's activation dtype when it is not F32, else nil: everything
	// is in arena) and iarena (I32: the MoE routing).
	arena, aarena, iarena compute.Tensor
	arenaN                int // tokens the arena is laid out for; -1: re-carve
	acts                  trainActs
	b                     *batch
	// dprob (numExperts) is the load-balancing loss's gradient w.r.t. the
	// router probabilities (SetRouterAux); nil: no aux loss.
	dprob compute.Tensor
	auxOn bool
	// routing holds the MoE layers' routing statistics of the last
	// TrainForward, recorded by each MoE layer as its forward ends (under
	// full recompute the layers share their routing buffers), where the
	// backend keeps them: the aux loss's gradient is computed there, and
	// the host reads them later (RoutingLater). nil: a dense model, or no
	// TrainForward yet.
	routing compute.MoERouting
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
	// receives the LM head's gradient w.r.t. lnf (HiddenGrad). dgate, dup,
	// dqpre, dkpre and (without attention biases) dv are in the
	// backend's gradient dtype (compute.GradDType): only GEMMs' backwards
	// read them; so is datt (without o_proj adapters), which only
	// attention's backward reads. dqpre and dkpre are the q/k
	// projections' douts where those are not dq and dk: the q/k norms'
	// input gradients, or without norms (or biases) dq's and dk's BF16
	// copies (RoPEBackwardCopy's; nil with F32 gradients). dresg, when that dtype is not F32, is the BF16 copy of
	// dres that the norms' backwards write for o_proj's and down_proj's.
	dres, dln, dq, dk, dv, datt, dqpre, dkpre, dgate, dup, dh compute.Tensor
	dresg                                                     compute.Tensor
}

// arenaSizes are the element counts of the training arenas: F32, the
// activation dtype's (0 when it is F32: those live in the F32 arena) and
// I32.
type arenaSizes struct{ f32, act, i32 int }

// bytes is their total size with activations of type act.
func (z arenaSizes) bytes(act compute.DType) int64 {
	return 4*int64(z.f32) + int64(act.Size())*int64(z.act) + 4*int64(z.i32)
}

// actAlign is the alignment, in elements, of each view of a BF16
// activation arena: 128 bytes, so that cuDNN and the tensor-core kernels'
// 16-byte loads read the views in place.
const actAlign = 64

// gradAlign is that of a BF16 gradient view: 256 bytes, the alignment of
// the scratch copy a backend would otherwise round the gradient into, so
// that a GEMM library that picks its algorithm by its operands' alignment
// (cuBLASLt) picks the same one for the view.
const gradAlign = 128

// carve lays out the activations of an N-token batch in arena (F32),
// aarena (the activation dtype act, when it is not F32) and iarena (I32,
// the MoE routing), or only counts them when arena is nil. Sizes and
// views come from this one function so they cannot drift apart. What a
// layer keeps and what one shared set of buffers holds depends on the
// recompute mode; which tensors are activations (act) is the contract's
// rule (compute's package doc): the inputs of GEMMs, attention and the
// elementwise kernels; the residual stream, statistics, gradients and an
// MoE block's input stay F32, but the gradients only a GEMM's backward
// reads, which are in gact (the backend's GradDType: act or F32).
func (m *Model) carve(a *trainActs, N int, act, gact compute.DType, arena, aarena, iarena compute.Tensor) arenaSizes {
	cfg := m.Cfg
	C, H, KV, D, I := cfg.Hidden, cfg.Heads, cfg.KVHeads, cfg.HeadDim, cfg.Intermediate
	var z arenaSizes
	take := func(n int) compute.Tensor {
		z.f32 += n
		if arena == nil {
			return nil
		}
		return m.be.View(arena, z.f32-n, n)
	}
	// aligned takes views of the activation-dtype arena at multiples of
	// align elements.
	aligned := func(align int) func(int) compute.Tensor {
		return func(n int) compute.Tensor {
			at := (z.act + align - 1) / align * align
			z.act = at + n
			if arena == nil {
				return nil
			}
			return m.be.View(aarena, at, n)
		}
	}
	// take16 is take at a 16-byte boundary: the attention statistics, which
	// a library reads in place only when aligned (cuDNN's; else it copies
	// them, both ways).
	take16 := func(n int) compute.Tensor {
		z.f32 = (z.f32 + 3) / 4 * 4
		return take(n)
	}
	atake := take
	if act != compute.F32 {
		atake = aligned(actAlign)
	}
	gtake := take
	if gact != compute.F32 {
		if gact != act {
			panic(fmt.Sprintf("decoder: gradients in %v with activations in %v: want the activation dtype or f32", gact, act))
		}
		gtake = aligned(gradAlign)
	}
	itake := func(n int) compute.Tensor {
		z.i32 += n
		if arena == nil {
			return nil
		}
		return m.be.View(iarena, z.i32-n, n)
	}
	// attn takes a layer's attention half: ln1 to xmid, and ln2 (and
	// under QAD the quantized inputs of q/k/v, o and a dense gate/up).
	// ln2 feeds an MoE block when moe (then in F32: its router is fp32).
	attn := func(l *blockActs, dense, moe bool) {
		l.ln1, l.rstd1 = atake(N*C), take(N)
		if cfg.QKNorm {
			l.qpre, l.qrstd, l.kpre, l.krstd = atake(N*H*D), take(N*H), atake(N*KV*D), take(N*KV)
		}
		l.q, l.k, l.v, l.att, l.lse = atake(N*H*D), atake(N*KV*D), atake(N*KV*D), atake(N*H*D), take16(N*H)
		if !cfg.QKNorm {
			l.qpre, l.kpre = l.q, l.k
		}
		l.xmid, l.rstd2 = take(N*C), take(N)
		if moe {
			l.ln2 = take(N * C)
		} else {
			l.ln2 = atake(N * C)
		}
		l.ln1q, l.attq, l.ln2q = l.ln1, l.att, l.ln2
		if m.qad {
			l.ln1q, l.attq = atake(N*C), atake(N*H*D)
			if dense {
				l.ln2q = atake(N * C)
			}
		}
	}
	// mlp takes a dense MLP's gate, up, h (and under QAD hq).
	mlp := func(l *blockActs) {
		l.gate, l.up, l.h = atake(N*I), atake(N*I), atake(N*I)
		l.hq = l.h
		if m.qad {
			l.hq = atake(N * I)
		}
	}
	// The experts quantize their inputs inside the MoE kernels.
	moe := func(l *blockActs) {
		E, K, IM := cfg.NumExperts, cfg.ExpertsPerTok, cfg.MoEIntermediate
		nf, ni := compute.MoESavedSizes(N, E, K, C, IM)
		fa, ia := take(nf), itake(ni)
		if arena != nil {
			l.moe = compute.NewMoESaved(m.be, fa, ia, N, E, K, C, IM)
		}
	}
	anyDense, anyMoE := false, false
	for i := 0; i < cfg.Layers; i++ {
		if cfg.IsMoE(i) {
			anyMoE = true
		} else {
			anyDense = true
		}
	}
	mode := m.RecomputeMode()
	a.cos, a.sin = take(N*D/2), take(N*D/2)
	a.x0 = take(N * C)
	// shared: the buffers every layer uses in turn (selective: a dense
	// MLP's gate/up/h; full: all but the layer's input and output).
	var shared blockActs
	switch {
	case mode == RecomputeSelective && anyDense:
		mlp(&shared)
	case mode == RecomputeFull && cfg.Layers > 0:
		attn(&shared, anyDense, anyMoE)
		if anyDense {
			mlp(&shared)
		}
		if anyMoE {
			moe(&shared)
		}
	}
	a.layers = make([]blockActs, cfg.Layers)
	for i := range a.layers {
		l := &a.layers[i]
		dense := !cfg.IsMoE(i)
		if mode == RecomputeFull {
			*l = shared
			if dense {
				l.moe = nil
			}
		} else {
			attn(l, dense, !dense)
			switch {
			case !dense:
				moe(l)
			case mode == RecomputeSelective:
				l.gate, l.up, l.h, l.hq = shared.gate, shared.up, shared.h, shared.hq
			default:
				mlp(l)
			}
		}
		l.xin = a.x0
		if i > 0 {
			l.xin = a.layers[i-1].out
		}
		l.out = take(N * C)
	}
	a.xL = a.x0
	if cfg.Layers > 0 {
		a.xL = a.layers[cfg.Layers-1].out
	}
	a.lnf, a.rstdf = atake(N*C), take(N)
	m.carveGrads(a, N, gact != compute.F32, take, gtake)
	return z
}

// carveGrads takes the backward's gradient buffers (carve's): F32 from
// take, those only a GEMM's backward reads from gtake; dresg, the
// residual gradient's copy in the gradient dtype, only when that is not
// F32 (lowGrads).
func (m *Model) carveGrads(a *trainActs, N int, lowGrads bool, take, gtake func(int) compute.Tensor) {
	cfg := m.Cfg
	C, H, KV, D, I := cfg.Hidden, cfg.Heads, cfg.KVHeads, cfg.HeadDim, cfg.Intermediate
	a.dres, a.dln = take(N*C), take(N*C)
	a.dresg = nil
	if lowGrads {
		a.dresg = gtake(N * C)
	}
	// q, k and v's douts: F32 where their biases train (the column sums
	// read the unrounded gradient); dq and dk always (RoPE's backward
	// rotates them; the q/k norm's backward then writes dqpre, dkpre, or
	// without norms or biases RoPEBackwardCopy their BF16 copies).
	qkv := gtake
	if cfg.AttentionBias {
		qkv = take
	}
	// datt, o_proj's dx, only attention's backward reads (its BF16 dO):
	// in the gradient dtype unless an o_proj adapter adds its own term to
	// it (a second rounding).
	att := gtake
	if m.oProjAdapters() {
		att = take
	}
	a.dq, a.dk, a.dv, a.datt = take(N*H*D), take(N*KV*D), qkv(N*KV*D), att(N*H*D)
	a.dqpre, a.dkpre = nil, nil
	if cfg.QKNorm || lowGrads && !cfg.AttentionBias {
		a.dqpre, a.dkpre = qkv(N*H*D), qkv(N*KV*D)
	}
	a.dgate, a.dup, a.dh = gtake(N*I), gtake(N*I), take(N*I)
}

// arenaBytes is what the training arenas hold now, in bytes.
func (m *Model) arenaBytes() int64 {
	var b int64
	for _, t := range []compute.Tensor{m.train.arena, m.train.aarena, m.train.iarena} {
		if t != nil {
			b += int64(t.DType().Size()) * int64(t.Len())
		}
	}
	return b
}

// TrainActivationBytes is what TrainForward's activation arenas take for
// an N-token batch of a model of cfg under recompute mode r, with NVFP4
// QAD on or off and activations of type act (the backend's ActDType; the
// gradients GEMMs read in it too, its GradDType by default); no backend
// needed (memory planning).
func TrainActivationBytes(cfg *model.Config, N int, r Recompute, qad bool, act compute.DType) int64 {
	return TrainActivationBytesLoRA(cfg, N, r, qad, act, false)
}

// TrainActivationBytesLoRA is TrainActivationBytes for a model whose
// o_proj layers carry LoRA adapters when oAdapters (AttachLoRA): their
// attention output's gradient stays F32 (carveGrads).
func TrainActivationBytesLoRA(cfg *model.Config, N int, r Recompute, qad bool, act compute.DType, oAdapters bool) int64 {
	m := &Model{Cfg: cfg, qad: qad, recompute: r, planOAdapters: oAdapters}
	var a trainActs
	return m.carve(&a, N, act, act, nil, nil, nil).bytes(act)
}

// oProjAdapters is whether an o_proj layer carries a LoRA adapter.
func (m *Model) oProjAdapters() bool {
	if m.planOAdapters {
		return true
	}
	for i := range m.Blocks {
		if m.Blocks[i].Attn.O.LoRA != nil {
			return true
		}
	}
	return false
}

// gradDType is the dtype of the gradients only GEMMs' backwards read:
// the backend's GradDType where it also copies the residual stream's
// gradient (compute.ActGrads), else F32.
func (m *Model) gradDType() compute.DType {
	if _, ok := m.be.(compute.ActGrads); !ok {
		return compute.F32
	}
	return compute.GradDType(m.be)
}

// prepare sizes the activation arena for N tokens (growing it only when
// a batch is larger than any before) and carves its views.
func (m *Model) prepare(N int) {
	st := &m.train
	if N == st.arenaN && st.arena != nil {
		return
	}
	var a trainActs
	act, gact := m.be.ActDType(), m.gradDType()
	z := m.carve(&a, N, act, gact, nil, nil, nil)
	// A failed allocation (a device backend's out-of-memory panic) leaves
	// no freed arena behind: the next call allocates anew.
	st.arenaN = -1
	m.grow(&st.arena, compute.F32, z.f32)
	m.grow(&st.aarena, act, z.act)
	m.grow(&st.iarena, compute.I32, z.i32)
	m.carve(&st.acts, N, act, gact, st.arena, st.aarena, st.iarena)
	st.arenaN = N
}

// grow makes *t a tensor of at least n elements of type dt (n > 0; F32
// always, so that arena is never nil after prepare), replacing a smaller
// one.
func (m *Model) grow(t *compute.Tensor, dt compute.DType, n int) {
	if n == 0 && dt != compute.F32 || *t != nil && (*t).Len() >= n {
		return
	}
	if *t != nil {
		m.be.Free(*t)
		*t = nil
	}
	*t = m.be.New(dt, n)
}

// TrainForward runs the decoder over one packed batch (tokens (N) in the
// vocabulary, sample boundaries starts (nSeq+1), 0 = starts[0] < ... <
// starts[nSeq] = N), saving every activation the backward needs, and
// returns the final normed hidden states (N, hidden), the LM head's input:
// a view valid until the next TrainForward. It turns the load-balancing
// loss off until SetRouterAux, and applies the LoRA adapters' dropout
// only when SetLoRADropout keyed it.
func (m *Model) TrainForward(tokens, starts []int32) (compute.Tensor, error) {
	m.lora.cur, m.lora.next = m.lora.next, nil // the dropout's key is this batch's only
	N := len(tokens)
	if err := checkStarts(starts, N); err != nil {
		return nil, err
	}
	m.train.auxOn = false
	m.prepare(N)
	st := &m.train
	a := &st.acts
	if st.b != nil {
		st.b.free(m.be)
	}
	st.b = m.upload(tokens, starts, a.cos, a.sin, true)
	c := m.Cfg
	if m.qad && !m.calibrating {
		m.quantizeWeights()
	}
	m.fetchOutside(OutsideEmbed)
	m.be.Embed(a.x0, m.Embed.W, st.b.tokens, N, c.Hidden)
	if n := len(m.moeLayers()); n > 0 && st.routing == nil {
		st.routing = m.be.NewMoERouting(n, c.NumExperts)
	}
	moe := 0 // the MoE layers so far
	// Each block leaves the next one's ln1 (the last, the final norm's
	// output) with its residual add (blockForward).
	for i := range m.Blocks {
		next := &nextNorm{out: a.lnf, rstd: a.rstdf, w: m.Norm.W}
		if i+1 < len(m.Blocks) {
			nl := &a.layers[i+1]
			next = &nextNorm{out: nl.ln1, rstd: nl.rstd1, w: m.Blocks[i+1].InNorm.W}
		}
		m.fetch(i)
		if i+1 < len(m.Blocks) {
			m.fetch(i + 1) // its input norm ends this block (next)
		} else {
			m.fetchOutside(OutsideHead) // the final norm ends the last
		}
		m.prefetch(i + 2) // (Prefetcher: beside this block's forward)
		m.blockForward(&m.Blocks[i], &a.layers[i], st.b, i == 0, next)
		if m.Blocks[i].MoE != nil {
			// Before the next MoE layer overwrites a shared routing.
			st.routing.Record(moe, a.layers[i].moe, N)
			moe++
		}
	}
	if len(m.Blocks) == 0 {
		m.fetchOutside(OutsideHead)
		m.be.RMSNorm(a.lnf, a.rstdf, a.xL, m.Norm.W, N, c.Hidden, c.RMSNormEps)
	}
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
	// The last block's MLP reads dres (its down_proj, through dresg).
	last := len(m.Blocks) > 0 && m.Blocks[len(m.Blocks)-1].MoE == nil
	m.resNormBackward(last, m.dw(m.Norm.DW, C), a.dln, a.xL, m.Norm.W, a.rstdf, N)
	m.outsideGradsDone(OutsideHead)
	var dprob compute.Tensor
	if m.train.auxOn {
		dprob = m.train.dprob
	}
	mode := m.RecomputeMode()
	for i := len(m.Blocks) - 1; i >= 0; i-- {
		m.fetch(i)
		m.prefetch(i - 1) // (Prefetcher: beside this block's backward)
		L, l := &m.Blocks[i], &a.layers[i]
		f, at := L.MLP, &L.Attn
		switch {
		case mode == RecomputeFull:
			// The layer's forward again, from its kept input, into the
			// shared buffers (a dense MLP's output is not needed).
			m.attnForward(L, l, b, true)
			m.mlpForward(L, l, N, false, nil)
		case mode == RecomputeSelective && L.MoE == nil:
			m.gateUp(L, l, N)
		}
		if L.MoE != nil {
			// out = xmid + moe(ln2): the experts and the router.
			be.Zero(a.dln)
			be.MoEBackward(a.dln, L.moeGrads(), a.dres, l.ln2, m.moeWeights(L), l.moe, dprob, N)
		} else {
			I := f.Gate.Out
			// MLP: out = xmid + down(swiglu(gate(ln2), up(ln2))); dres
			// flows to xmid unchanged (+=).
			be.Zero(a.dh)
			m.linearBackward(&f.Down, a.dh, m.resGrad(&f.Down), l.hq, N)
			be.Zero(a.dgate)
			be.Zero(a.dup)
			be.SwiGLUBackward(a.dgate, a.dup, a.dh, l.gate, l.up, N*I)
			be.Zero(a.dln)
			m.linearBackward(&f.Gate, a.dln, a.dgate, l.ln2q, N)
			m.linearBackward(&f.Up, a.dln, a.dup, l.ln2q, N)
		}
		m.resNormBackward(at.O.DB == nil, m.dw(L.PostNorm.DW, C), a.dln, l.xmid, L.PostNorm.W, l.rstd2, N)
		// Attention: xmid = xin + o(attn(rope(q), rope(k), v)).
		be.Zero(a.datt)
		m.linearBackward(&at.O, a.datt, m.resGrad(&at.O), l.attq, N)
		be.Zero(a.dq)
		be.Zero(a.dk)
		be.Zero(a.dv)
		m.attentionBackward(a, l, b)
		dq, dk := a.dq, a.dk
		if at.QNorm == nil && a.dqpre != nil {
			// No norm or bias reads dq and dk after the rotation: it
			// writes the q/k projections' BF16 douts beside them.
			g := be.(compute.ActGrads)
			g.RoPEBackwardCopy(a.dq, a.dqpre, b.cos, b.sin, N, H, D)
			g.RoPEBackwardCopy(a.dk, a.dkpre, b.cos, b.sin, N, KV, D)
			dq, dk = a.dqpre, a.dkpre
		} else {
			be.RoPEBackward(a.dq, b.cos, b.sin, N, H, D)
			be.RoPEBackward(a.dk, b.cos, b.sin, N, KV, D)
		}
		if at.QNorm != nil {
			be.Zero(a.dqpre)
			be.Zero(a.dkpre)
			be.RMSNormBackward(a.dqpre, m.dw(at.QNorm.DW, D), a.dq, l.qpre, at.QNorm.W, l.qrstd, N*H, D)
			be.RMSNormBackward(a.dkpre, m.dw(at.KNorm.DW, D), a.dk, l.kpre, at.KNorm.W, l.krstd, N*KV, D)
			dq, dk = a.dqpre, a.dkpre
		}
		be.Zero(a.dln)
		m.linearBackward(&at.Q, a.dln, dq, l.ln1q, N)
		m.linearBackward(&at.K, a.dln, dk, l.ln1q, N)
		m.linearBackward(&at.V, a.dln, a.dv, l.ln1q, N)
		// The block below reads dres next: a dense one's down_proj through
		// dresg; an MoE block and the embedding read the F32 dres.
		m.resNormBackward(i > 0 && m.Blocks[i-1].MoE == nil, m.dw(L.InNorm.DW, C), a.dln, l.xin, L.InNorm.W, l.rstd1, N)
		m.gradsDone(i)
	}
	if m.Embed.DW != nil { // nil: a frozen base (LoRA)
		be.EmbedBackward(m.Embed.DW, a.dres, b.tokens, N, C)
	}
	m.outsideGradsDone(OutsideEmbed)
}

// resNormBackward is an RMSNorm's backward into the residual stream's
// gradient: dres (N, hidden) += the gradient of x through the norm, from
// dout. With gemm (a GEMM's backward reads dres next) and the gradients
// in BF16, the same kernel writes dresg, dres's rounding, beside it.
func (m *Model) resNormBackward(gemm bool, dw, dout, x, w, rstd compute.Tensor, N int) {
	a, C := &m.train.acts, m.Cfg.Hidden
	if gemm && a.dresg != nil {
		m.be.(compute.ActGrads).RMSNormBackwardCopy(a.dres, a.dresg, dw, dout, x, w, rstd, N, C)
		return
	}
	m.be.RMSNormBackward(a.dres, dw, dout, x, w, rstd, N, C)
}

// resGrad is the residual stream's gradient as l, the o or down
// projection, reads it in its backward: dresg, written by the norm
// backward before it, or dres itself when the gradients are F32 or l's
// bias trains (its column sums read the unrounded gradient).
func (m *Model) resGrad(l *Linear) compute.Tensor {
	if a := &m.train.acts; a.dresg != nil && l.DB == nil {
		return a.dresg
	}
	return m.train.acts.dres
}

// attentionBackward is the layer's attention backward (dq, dk, dv from
// datt), one call for the batch or one per run of samples (b.groups,
// attnGroups) on views of the tensors: every sample's attention reads and
// writes only its own tokens' rows, so the runs' calls compute what one
// call would.
func (m *Model) attentionBackward(a *trainActs, l *blockActs, b *batch) {
	be, c := m.be, m.Cfg
	H, KV, D := c.Heads, c.KVHeads, c.HeadDim
	if b.groups == nil {
		be.AttentionBackward(a.dq, a.dk, a.dv, a.datt, l.q, l.k, l.v, l.att, l.lse, b.starts, b.nSeq, b.maxLen, b.n, H, KV, D, attnScale(D))
		return
	}
	for _, g := range b.groups {
		vq := func(t compute.Tensor) compute.Tensor { return be.View(t, g.tok0*H*D, g.n*H*D) }
		vk := func(t compute.Tensor) compute.Tensor { return be.View(t, g.tok0*KV*D, g.n*KV*D) }
		be.AttentionBackward(vq(a.dq), vk(a.dk), vk(a.dv), vq(a.datt), vq(l.q), vk(l.k), vk(l.v), vq(l.att),
			be.View(l.lse, g.tok0*H, g.n*H), g.starts, g.nSeq, g.maxLen, g.n, H, KV, D, attnScale(D))
	}
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
// waits for them); empty for a dense model.
func (m *Model) Routing() RouterStats { return m.RoutingLater().Read() }

// RoutingLater snapshots the routing statistics of the last TrainForward
// without waiting for them: Read them (once) when the host needs them,
// e.g. after the training step's one wait. A later TrainForward does not
// change them.
func (m *Model) RoutingLater() *PendingRouting {
	p := &PendingRouting{rs: RouterStats{Tokens: m.train.b.n, TopK: m.Cfg.ExpertsPerTok}, e: m.Cfg.NumExperts}
	if m.train.routing != nil {
		p.rs.Layers, p.v = m.moeLayers(), m.train.routing.Later()
	}
	return p
}

// moeLayers are the indices of the MoE blocks.
func (m *Model) moeLayers() []int {
	var ls []int
	for i := range m.Blocks {
		if m.Blocks[i].MoE != nil {
			ls = append(ls, i)
		}
	}
	return ls
}

// PendingRouting are routing statistics that may still be on the device
// (RoutingLater).
type PendingRouting struct {
	rs   RouterStats
	e    int
	v    compute.MoERoutingValues // nil: a dense model
	read bool
}

// Read returns the statistics, waiting for the work that computed them
// if it has not finished. Call it once.
func (p *PendingRouting) Read() RouterStats {
	if p.read {
		panic("decoder: PendingRouting read twice")
	}
	p.read = true
	if p.v == nil {
		return p.rs
	}
	L := len(p.rs.Layers)
	p.rs.Counts, p.rs.ProbSums = make([][]int, L), make([][]float64, L)
	for l := range L {
		p.rs.Counts[l], p.rs.ProbSums[l] = make([]int, p.e), make([]float64, p.e)
	}
	p.v.Read(p.rs.Counts, p.rs.ProbSums)
	return p.rs
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

// SetRouterAux adds coef·aux (the load-balancing loss of the last
// TrainForward's routing) to what the next Backward differentiates;
// coef 0 leaves it out. TrainForward resets it. Its gradient
// (compute.MoEAuxGrad) is computed from the statistics where the backend
// keeps them (compute.MoERouting.AuxGrad): on a GPU, no host read.
func (m *Model) SetRouterAux(coef float64) {
	st := &m.train
	st.auxOn = coef != 0 && st.routing != nil
	if !st.auxOn {
		return
	}
	if st.dprob == nil {
		st.dprob = m.be.New(compute.F32, m.Cfg.NumExperts)
	}
	st.routing.AuxGrad(st.dprob, coef, st.b.n)
}

// Free releases the memory the model allocated: the activation arenas,
// the last batch, the aux-loss gradient, the routing statistics, the QAD
// arena of the fake-quantized weights and the RoPE table on the backend
// (the parameters are the caller's). A later TrainForward allocates anew; QAD then needs
// RestoreQAD.
func (m *Model) Free() {
	st := &m.train
	for _, t := range []compute.Tensor{st.arena, st.aarena, st.iarena, st.dprob, m.qadArena} {
		if t != nil {
			m.be.Free(t)
		}
	}
	if st.routing != nil {
		st.routing.Free()
	}
	if st.b != nil {
		st.b.free(m.be)
	}
	m.qadArena = nil
	m.rope.free(m.be)
	m.freeLoRA()
	for i := range m.Blocks {
		for _, l := range m.Blocks[i].Linears() {
			l.Wfq = nil
		}
	}
	*st = trainState{arenaN: -1}
}
