// Package decoder is the Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder, defined
// once over compute.Backend for both sides of distillation:
//
//   - the teacher (package infer) calls TopK: a forward over a packed batch
//     whose activations are reused layer to layer, ending in the streaming
//     LM-head top-k; or, for a teacher larger than one GPU, a Pipeline of
//     stages (NewStage), each a range of layers on a backend of its own,
//     through which micro-batches flow;
//   - the student (package train) calls TrainForward, which saves every
//     activation the backward needs in one arena of views, then the fused
//     loss head, then Backward, which accumulates every parameter gradient.
//
// Architecture differences are fields that are nil or set, not copied
// models: Qwen2's q/k/v biases (and Llama's attention_bias on o_proj too)
// are Linear.B, Qwen3's per-head q/k norms are Attention.QNorm/KNorm, and a
// block holds either a dense MLP or a Qwen3-MoE sparse block (router,
// top-k experts; trained through the backend's MoEForward/MoEBackward,
// with HF's load-balancing loss, see RouterStats). Semantics are
// those of HF transformers' modeling files: RMSNorm in fp32, RoPE
// rotate-half with per-sample positions, GQA, causal attention inside each
// sample of a packed batch, SiLU-gated MLP.
//
// One block forward (blockForward) serves both uses: inference hands every
// layer the same few buffers, training hands each layer its own views of
// the activation arena, where the statistics (RMSNorm rstd, attention
// log-sum-exp) are kept for the backward.
//
// NVFP4 quantization-aware training (EnableQAD): every Linear's weight and
// input is fake-quantized in the training forward, the MoE experts'
// included (not the LM head, not the embeddings, not the MoE routers, as
// Model-Optimizer does), with amax calibrated and then frozen (see
// Quantizer); an MoE block's experts share one input quantizer for
// gate/up and one for down.
// The backward is straight-through: it uses the quantized tensors as what
// the forward multiplied, and their gradients as the originals'.
package decoder

import (
	"errors"
	"fmt"
	"math"
	"sync"

	"distill/compute"
	"distill/model"
)

// ErrInvalid is wrapped by errors about unsupported models, bad batches
// and quantizer states.
var ErrInvalid = errors.New("decoder: invalid input")

// Param is one parameter tensor and its gradient (nil when not training).
type Param struct {
	W, DW compute.Tensor
}

// Linear is a torch.nn.Linear: W (Out,In), optional B (Out), their
// gradients, and under QAD the weight quantizer and the fake-quantized
// weight the forward multiplies by.
type Linear struct {
	Name    string // HF prefix, e.g. "model.layers.0.self_attn.q_proj"
	W, B    compute.Tensor
	DW, DB  compute.Tensor
	Out, In int
	WQ      Quantizer
	Wfq     compute.Tensor // fake-quantized W (QAD, once calibrated), else nil
	// LoRA, when set, is a low-rank adapter beside W (a LoRA student,
	// whose W is frozen: DW and DB nil); see AttachLoRA.
	LoRA *compute.LoRA
}

// weight is what the forward multiplies by: the fake-quantized copy under
// QAD, the weight otherwise.
func (l *Linear) weight() compute.Tensor {
	if l.Wfq != nil {
		return l.Wfq
	}
	return l.W
}

// Attention is one self-attention block; QNorm/KNorm are nil except for
// Qwen3.
type Attention struct {
	Q, K, V, O   Linear
	QNorm, KNorm *Param
}

// MLP is the SiLU-gated feed-forward block.
type MLP struct{ Gate, Up, Down Linear }

// Block is one decoder layer: exactly one of MLP and MoE is set. An MoE
// block's router and experts are also Linears (Router, Experts: their
// gradients, QAD quantizers and names); MoE holds their weights in the
// form the backend's MoE kernels take.
type Block struct {
	InNorm, PostNorm Param
	Attn             Attention
	MLP              *MLP
	MoE              *compute.MoEWeights
	Router           *Linear // mlp.gate (numExperts, hidden): never quantized
	Experts          []MLP   // mlp.experts.E.{gate,up,down}_proj
	// Input quantizers (QAD): q/k/v share one input, as do gate/up; their
	// calibrated amax would be identical, so one quantizer serves each.
	InQKV, InO, InGateUp, InDown Quantizer
}

// Linears lists the block's quantizable Linear layers in a fixed order:
// q, k, v, o, then gate, up, down of the MLP, or of every expert in
// expert order. The MoE router is not one of them (NVFP4 QAD leaves it in
// full precision, as Model-Optimizer does).
func (b *Block) Linears() []*Linear {
	ls := []*Linear{&b.Attn.Q, &b.Attn.K, &b.Attn.V, &b.Attn.O}
	if b.MLP != nil {
		ls = append(ls, &b.MLP.Gate, &b.MLP.Up, &b.MLP.Down)
	}
	for e := range b.Experts {
		x := &b.Experts[e]
		ls = append(ls, &x.Gate, &x.Up, &x.Down)
	}
	return ls
}

// moeGrads is an MoE block's gradients in the MoE kernels' layout; nil
// for a frozen block (a LoRA student's base, bound with no gradients):
// MoEBackward then computes dx alone.
func (b *Block) moeGrads() *compute.MoEWeights {
	if b.Router.DW == nil {
		return nil
	}
	g := *b.MoE
	g.Router, g.Gate, g.Up, g.Down = b.Router.DW, nil, nil, nil
	for e := range b.Experts {
		x := &b.Experts[e]
		g.Gate, g.Up, g.Down = append(g.Gate, x.Gate.DW), append(g.Up, x.Up.DW), append(g.Down, x.Down.DW)
	}
	return &g
}

// moeWeights is what an MoE block's training forward multiplies by: under
// QAD (calibrated) the experts' fake-quantized weights and the input
// quantizers' amax, else the weights; the experts' adapters' dropout
// keyed for the current batch (a LoRA student's).
func (m *Model) moeWeights(b *Block) *compute.MoEWeights {
	m.moeDrop(b)
	if !m.qad || m.calibrating {
		return b.MoE
	}
	w := *b.MoE
	w.Gate, w.Up, w.Down = nil, nil, nil
	for e := range b.Experts {
		x := &b.Experts[e]
		w.Gate, w.Up, w.Down = append(w.Gate, x.Gate.weight()), append(w.Up, x.Up.weight()), append(w.Down, x.Down.weight())
	}
	w.InAmax, w.HAmax = b.InGateUp.Amax, b.InDown.Amax
	return &w
}

// Model is a decoder bound to its tensors on one backend.
type Model struct {
	Cfg    *model.Config
	Embed  Param // (vocab, hidden)
	Blocks []Block
	Norm   Param // final norm (hidden)
	Head   Param // (vocab, hidden); the Embed tensors when tied

	be compute.Backend
	// qad: Linears are fake-quantized; calibrating: their amax are being
	// observed (quantization off meanwhile, as ModelOpt calibrates).
	qad, calibrating bool
	// observing: the block Linears' input amax are being calibrated
	// without QAD (CalibrateInputs); inputsFrozen: they are frozen.
	observing, inputsFrozen bool
	qadArena                compute.Tensor
	recompute               Recompute // "" is RecomputeNone
	// planOAdapters: TrainActivationBytesLoRA's model, whose o_proj
	// layers carry adapters (it has no blocks to look at).
	planOAdapters bool
	train         trainState
	// res, when set, holds the blocks' weights and takes their gradients
	// (Residency); qslot[s] is the block whose fake-quantized weights
	// slot s holds (-1: none) when the blocks share slots.
	res   Residency
	qslot []int
	// lora: the adapters' scratch (AttachLoRA).
	lora loraState
	// rope: the RoPE table of positions 0..n-1, computed once and copied
	// per sample (upload).
	rope ropeRows
	// A pipeline stage (NewStage) holds layers [first, end) only (Blocks
	// keeps every index; the others are empty), the embedding when first
	// is 0, the final norm and LM head when end is the last, and nextIn,
	// a copy of layer end's input norm weight, otherwise. New's model is
	// the whole: first 0, end the layers.
	first, end int
	nextIn     compute.Tensor
}

// ropeRows caches cos and sin (n, half) of positions 0..n-1, as ropeTable
// computes them: a packed batch's table is each sample's prefix of it.
// Computing the angles' cos and sin per batch (a million of each for 8192
// tokens of head_dim 128) kept a GPU waiting on the host at the start of
// every forward. Safe for concurrent use; a returned slice is never
// written again (growing allocates new ones).
//
// For forwards (TopK, the pipeline's stages), the rows also live on the
// model's backend (dcos, dsin: dn rows), where a batch's table is
// gathered by position (gather): building the batch's
// table on the host and uploading it (8 MB for 16384 tokens of head_dim
// 128) took most of the 3.7 ms before a Qwen3-8B forward's first launch
// on the H200 (2026-11-27).
type ropeRows struct {
	mu         sync.Mutex
	cos, sin   []float32
	n          int
	dcos, dsin compute.Tensor
	dn         int
}

// upTo returns the cached rows of at least positions 0..n-1.
func (r *ropeRows) upTo(n int, invFreq []float32) (cos, sin []float32) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.upToLocked(n, invFreq)
}

func (r *ropeRows) upToLocked(n int, invFreq []float32) (cos, sin []float32) {
	if r.n < n {
		m, half := max(n, 2*r.n), len(invFreq)
		r.cos, r.sin, r.n = make([]float32, m*half), make([]float32, m*half), m
		ropeTable(r.cos, r.sin, []int32{0, int32(m)}, invFreq)
	}
	return r.cos, r.sin
}

// gather writes cos and sin (n, half) of the positions pos (n) I32 on be,
// samples of at most maxLen tokens: rows of the table on be (the host
// rows of at least maxLen positions, uploaded when they grow), read by
// Embed, a copy: ropeTable's values bit for bit. The lock is held until
// the reads are issued, so that a table is freed (on the backend's
// stream, after them) only once no batch can still issue one.
func (r *ropeRows) gather(be compute.Backend, cos, sin, pos compute.Tensor, n, maxLen int, invFreq []float32) {
	r.mu.Lock()
	defer r.mu.Unlock()
	half := len(invFreq)
	if r.dn < maxLen {
		hc, hs := r.upToLocked(maxLen, invFreq)
		freeAll(be, r.dcos, r.dsin)
		r.dcos, r.dsin, r.dn = nil, nil, 0
		r.dcos = be.FromF32(hc)
		r.dsin = be.FromF32(hs)
		r.dn = len(hc) / half
	}
	be.Embed(cos, r.dcos, pos, n, half)
	be.Embed(sin, r.dsin, pos, n, half)
}

// free releases the rows on be.
func (r *ropeRows) free(be compute.Backend) {
	r.mu.Lock()
	defer r.mu.Unlock()
	freeAll(be, r.dcos, r.dsin)
	r.dcos, r.dsin, r.dn = nil, nil, 0
}

// Backend returns the backend the model runs on.
func (m *Model) Backend() compute.Backend { return m.be }

// Binder returns the tensor named name (an HF name of cfg.Tensors()) and,
// for training, its gradient (nil otherwise).
type Binder func(name string) (w, grad compute.Tensor, err error)

// New builds the decoder of cfg from the tensors bind returns. Every
// tensor of cfg.Tensors() is asked for once; the errors name the tensors.
func New(cfg *model.Config, be compute.Backend, bind Binder) (*Model, error) {
	return NewStage(cfg, be, bind, 0, cfg.Layers)
}

// NewStage builds the part of cfg's decoder that a pipeline stage holds
// on be (Pipeline): layers [first, end), with the embedding when first is
// 0, with the final norm and the LM head when end is cfg.Layers (a tied
// head: the embedding's tensor, asked for again), and otherwise a copy of
// layer end's input norm weight (the stage's last residual add is fused
// with that norm). bind is asked for those tensors only, each once (the
// norm's copy: again). A stage runs the teacher's forward only: training
// takes the whole model (New).
func NewStage(cfg *model.Config, be compute.Backend, bind Binder, first, end int) (*Model, error) {
	if first < 0 || end > cfg.Layers || first >= end && cfg.Layers > 0 {
		return nil, fmt.Errorf("%w: stage of layers [%d, %d) of %d", ErrInvalid, first, end, cfg.Layers)
	}
	if cfg.Heads <= 0 || cfg.KVHeads <= 0 || cfg.Heads%cfg.KVHeads != 0 || cfg.HeadDim <= 0 || cfg.HeadDim%2 != 0 {
		return nil, fmt.Errorf("%w: heads %d, kv heads %d, head_dim %d: want heads a multiple of kv heads and an even head_dim", ErrInvalid, cfg.Heads, cfg.KVHeads, cfg.HeadDim)
	}
	var errs []error
	param := func(name string) Param {
		w, g, err := bind(name)
		if err != nil {
			errs = append(errs, err)
		}
		return Param{W: w, DW: g}
	}
	lin := func(prefix string, out, in int, bias bool) Linear {
		l := Linear{Name: prefix, Out: out, In: in}
		w := param(prefix + ".weight")
		l.W, l.DW = w.W, w.DW
		if bias {
			b := param(prefix + ".bias")
			l.B, l.DB = b.W, b.DW
		}
		return l
	}
	h, q, kv := cfg.Hidden, cfg.Heads*cfg.HeadDim, cfg.KVHeads*cfg.HeadDim
	m := &Model{Cfg: cfg, be: be, first: first, end: end}
	if first == 0 {
		m.Embed = param("model.embed_tokens.weight")
	}
	oBias := cfg.AttentionBias && cfg.Arch != model.ArchQwen2
	m.Blocks = make([]Block, first, cfg.Layers)
	for i := first; i < end; i++ {
		p := fmt.Sprintf("model.layers.%d.", i)
		b := Block{
			InNorm: param(p + "input_layernorm.weight"),
			Attn: Attention{
				Q: lin(p+"self_attn.q_proj", q, h, cfg.AttentionBias),
				K: lin(p+"self_attn.k_proj", kv, h, cfg.AttentionBias),
				V: lin(p+"self_attn.v_proj", kv, h, cfg.AttentionBias),
				O: lin(p+"self_attn.o_proj", h, q, oBias),
			},
		}
		if cfg.QKNorm {
			qn, kn := param(p+"self_attn.q_norm.weight"), param(p+"self_attn.k_norm.weight")
			b.Attn.QNorm, b.Attn.KNorm = &qn, &kn
		}
		b.PostNorm = param(p + "post_attention_layernorm.weight")
		if cfg.IsMoE(i) {
			router := lin(p+"mlp.gate", cfg.NumExperts, h, false)
			b.Router = &router
			moe := &compute.MoEWeights{Router: router.W, NumExperts: cfg.NumExperts,
				TopK: cfg.ExpertsPerTok, Hidden: h, Inter: cfg.MoEIntermediate, NormTopK: cfg.NormTopKProb}
			for e := 0; e < cfg.NumExperts; e++ {
				ep := fmt.Sprintf("%smlp.experts.%d.", p, e)
				x := MLP{
					Gate: lin(ep+"gate_proj", cfg.MoEIntermediate, h, false),
					Up:   lin(ep+"up_proj", cfg.MoEIntermediate, h, false),
					Down: lin(ep+"down_proj", h, cfg.MoEIntermediate, false),
				}
				b.Experts = append(b.Experts, x)
				moe.Gate, moe.Up, moe.Down = append(moe.Gate, x.Gate.W), append(moe.Up, x.Up.W), append(moe.Down, x.Down.W)
			}
			b.MoE = moe
		} else {
			b.MLP = &MLP{
				Gate: lin(p+"mlp.gate_proj", cfg.Intermediate, h, false),
				Up:   lin(p+"mlp.up_proj", cfg.Intermediate, h, false),
				Down: lin(p+"mlp.down_proj", h, cfg.Intermediate, false),
			}
		}
		m.Blocks = append(m.Blocks, b)
	}
	m.Blocks = m.Blocks[:cfg.Layers]
	switch {
	case end < cfg.Layers:
		m.nextIn = param(fmt.Sprintf("model.layers.%d.input_layernorm.weight", end)).W
	case cfg.TieEmbeddings && first > 0:
		m.Norm, m.Head = param("model.norm.weight"), param("model.embed_tokens.weight")
	default:
		m.Norm = param("model.norm.weight")
		m.Head = m.Embed
		if !cfg.TieEmbeddings {
			m.Head = param("lm_head.weight")
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return m, nil
}

// batch is one packed batch on the backend: token ids, sample starts and
// the RoPE table of every token's position.
type batch struct {
	n, nSeq, maxLen int
	tokens, starts  compute.Tensor // (n), (nSeq+1) I32
	cos, sin        compute.Tensor // (n, headDim/2)
	// groups: the runs of samples the attention backward takes one call
	// each (attnGroups); nil when one call takes the batch.
	groups []attnGroup
}

// attnGroup is a run of a batch's samples: tokens [tok0, tok0+n), nSeq
// samples of at most maxLen tokens, starts (nSeq+1) I32 from 0.
type attnGroup struct {
	tok0, n, nSeq, maxLen int
	starts                compute.Tensor
}

// free releases the batch's device tensors but cos and sin (the
// caller's).
func (b *batch) free(be compute.Backend) {
	freeAll(be, b.tokens, b.starts)
	for _, g := range b.groups {
		freeAll(be, g.starts)
	}
	b.groups = nil
}

// attnGroups splits a packed batch's samples (starts), in order, into runs
// whose attention backward the backend may take in one call: cuDNN plans
// a call for its bucket, powers of two of the samples' count and of the
// longest sample, and its deterministic backward's workspace grows as
// count·longest² (2112 MiB for one sample of 8192 tokens and 16 heads on
// an H200). One long sample packed with many short ones would ask for
// count times that; a run's pow2(count)·pow2(longest)² stays within
// pow2(tokens)·pow2(the batch's longest), at most the bucket of one
// sample as long as the whole batch (what the memory plan counts). Nil
// when the whole batch is one run.
func attnGroups(starts []int32) [][2]int {
	if attnGroupsOff {
		return nil
	}
	longest := 0
	for s := 0; s+1 < len(starts); s++ {
		longest = max(longest, int(starts[s+1]-starts[s]))
	}
	limit := int64(pow2(int(starts[len(starts)-1]))) * int64(pow2(longest))
	cost := func(count, m int) int64 { return int64(pow2(count)) * int64(pow2(m)) * int64(pow2(m)) }
	var runs [][2]int
	for s := 0; s+1 < len(starts); {
		e, m := s+1, int(starts[s+1]-starts[s])
		for e+1 < len(starts) {
			m2 := max(m, int(starts[e+1]-starts[e]))
			if cost(e+1-s, m2) > limit {
				break
			}
			e, m = e+1, m2
		}
		runs = append(runs, [2]int{s, e})
		s = e
	}
	if len(runs) == 1 {
		return nil
	}
	return runs
}

// attnGroupsOff makes attnGroups keep every batch whole: the tests'
// reference. attnGroupsAlways cuts batches on every backend, not only on
// those whose attention reports a workspace (the tests' CPU case).
var attnGroupsOff, attnGroupsAlways bool

// pow2 rounds n up to a power of two (at least 1).
func pow2(n int) int {
	p := 1
	for p < n {
		p *= 2
	}
	return p
}

// ropeTable fills cos and sin (n, half) for the positions of the packed
// samples (restarting at 0 in each sample), with the angle pos·invFreq[i]
// rounded to fp32 first, as HF computes it (an fp32 product of position and
// inverse frequency, then cos/sin of that fp32 value).
func ropeTable(cos, sin []float32, starts []int32, invFreq []float32) {
	half := len(invFreq)
	for s := 0; s+1 < len(starts); s++ {
		for t := starts[s]; t < starts[s+1]; t++ {
			p := float32(t - starts[s])
			for i, f := range invFreq {
				a := float64(p * f)
				cos[int(t)*half+i], sin[int(t)*half+i] = float32(math.Cos(a)), float32(math.Sin(a))
			}
		}
	}
}

// checkStarts validates the packing of n tokens, naming the sample at
// fault.
func checkStarts(starts []int32, n int) error {
	if len(starts) < 2 || starts[0] != 0 || int(starts[len(starts)-1]) != n {
		h := starts
		if len(h) > 8 {
			h = h[:8]
		}
		return fmt.Errorf("%w: sample starts %v must begin at 0 and end at the token count %d", ErrInvalid, h, n)
	}
	for s := 0; s+1 < len(starts); s++ {
		if starts[s+1] <= starts[s] {
			return fmt.Errorf("%w: sample %d is empty or out of order (starts %d, %d)", ErrInvalid, s, starts[s], starts[s+1])
		}
	}
	return nil
}
