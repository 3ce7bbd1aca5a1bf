// Package train is the student side of distillation: the Student model
// (Llama, Qwen2, Qwen3 dense) with explicit forward and backward over a
// packed batch, fp32 master weights, the fused KD+SFT loss (train/loss),
// AdamW (train/optim) and optional NVFP4 quantization-aware distillation
// (train/nvfp4). The layer kernels live in train/nn; the package doc there
// states the += convention of every backward.
//
// Memory: parameters and their gradients are two arenas laid out in the
// order of model.Config.Tensors() (HF names), and the activations of a
// batch are carved out of one arena by carveActs, the single function that
// computes both the sizes and the views.
package train

import (
	"errors"
	"fmt"

	"distill/model"
	"distill/train/loss"
	"distill/train/nvfp4"
	"distill/train/optim"
)

// ErrInvalid is wrapped by errors about unsupported configs, bad weights
// and bad batches.
var ErrInvalid = errors.New("train: invalid input")

// Tensor is one parameter: its HF name, shape and place in the arenas.
type Tensor struct {
	Name   string
	Shape  []int
	Off, N int
	Decay  bool // weight decay applies (not norms, not biases)
}

// Linear is one projection: weight (Out,In) and optional bias (Out), their
// gradients, and under QAD its weight quantizer and the fake-quantized
// weight used by the forward.
type Linear struct {
	Name         string
	In, Out      int
	W, B, DW, DB []float32
	WQ           nvfp4.Quantizer
	Wfq          []float32 // fake-quantized W (QAD), else nil
}

// Layer is one decoder block. QNorm/KNorm are nil unless the config has
// q/k norms (Qwen3); biases are nil unless it has attention biases.
type Layer struct {
	InNorm, PostNorm, DInNorm, DPostNorm []float32
	QNorm, KNorm, DQNorm, DKNorm         []float32
	Q, K, V, O, Gate, Up, Down           Linear
	// Input quantizers (QAD): q/k/v share one input, as do gate/up; their
	// calibrated amax would be identical, so one quantizer serves each.
	InQKV, InO, InGateUp, InDown nvfp4.Quantizer
}

// Student is a dense decoder-only model being trained.
type Student struct {
	Cfg     *model.Config
	Tensors []Tensor
	Params  []float32 // fp32 master weights
	Grads   []float32 // same layout as Params

	Embed, DEmbed, FinalNorm, DFinalNorm, Head, DHead []float32
	Layers                                            []Layer

	// QAD is true once EnableQAD ran: Linear weights and inputs are fake
	// quantized (lm_head and embeddings excluded).
	QAD         bool
	calibrating bool
	qadArena    []float32

	invFreq []float32
	head    *loss.Head
	acts    acts
	arena   []float32
	arenaN  int
}

// NewStudent allocates a model of cfg with zero parameters (Load or
// InitFrom fills them). Only dense Llama, Qwen2 and Qwen3 are supported.
func NewStudent(cfg *model.Config) (*Student, error) {
	switch cfg.Arch {
	case model.ArchLlama, model.ArchQwen2, model.ArchQwen3:
	default:
		return nil, fmt.Errorf("%w: student architecture %q: want llama, qwen2 or qwen3 (dense)", ErrInvalid, cfg.Arch)
	}
	if cfg.NumExperts > 0 {
		return nil, fmt.Errorf("%w: student with %d experts: MoE students are not supported", ErrInvalid, cfg.NumExperts)
	}
	if cfg.Heads <= 0 || cfg.KVHeads <= 0 || cfg.Heads%cfg.KVHeads != 0 || cfg.HeadDim <= 0 || cfg.HeadDim%2 != 0 {
		return nil, fmt.Errorf("%w: heads %d, kv heads %d, head_dim %d: want heads a multiple of kv heads and an even head_dim", ErrInvalid, cfg.Heads, cfg.KVHeads, cfg.HeadDim)
	}
	s := &Student{Cfg: cfg, invFreq: cfg.InvFreq()}
	off := 0
	for _, ts := range cfg.Tensors() {
		n := 1
		for _, d := range ts.Shape {
			n *= d
		}
		s.Tensors = append(s.Tensors, Tensor{Name: ts.Name, Shape: ts.Shape, Off: off, N: n, Decay: !ts.Norm && !ts.Bias})
		off += n
	}
	s.Params = make([]float32, off)
	s.Grads = make([]float32, off)
	view := func(name string) ([]float32, []float32) {
		for _, t := range s.Tensors {
			if t.Name == name {
				return s.Params[t.Off : t.Off+t.N : t.Off+t.N], s.Grads[t.Off : t.Off+t.N : t.Off+t.N]
			}
		}
		return nil, nil
	}
	s.Embed, s.DEmbed = view("model.embed_tokens.weight")
	s.FinalNorm, s.DFinalNorm = view("model.norm.weight")
	if cfg.TieEmbeddings {
		s.Head, s.DHead = s.Embed, s.DEmbed
	} else {
		s.Head, s.DHead = view("lm_head.weight")
	}
	C, q, kv, I := cfg.Hidden, cfg.Heads*cfg.HeadDim, cfg.KVHeads*cfg.HeadDim, cfg.Intermediate
	lin := func(p, name string, in, out int) Linear {
		l := Linear{Name: p + name, In: in, Out: out}
		l.W, l.DW = view(p + name + ".weight")
		l.B, l.DB = view(p + name + ".bias")
		return l
	}
	for i := 0; i < cfg.Layers; i++ {
		p := fmt.Sprintf("model.layers.%d.", i)
		var L Layer
		L.InNorm, L.DInNorm = view(p + "input_layernorm.weight")
		L.PostNorm, L.DPostNorm = view(p + "post_attention_layernorm.weight")
		L.QNorm, L.DQNorm = view(p + "self_attn.q_norm.weight")
		L.KNorm, L.DKNorm = view(p + "self_attn.k_norm.weight")
		L.Q = lin(p, "self_attn.q_proj", C, q)
		L.K = lin(p, "self_attn.k_proj", C, kv)
		L.V = lin(p, "self_attn.v_proj", C, kv)
		L.O = lin(p, "self_attn.o_proj", q, C)
		L.Gate = lin(p, "mlp.gate_proj", C, I)
		L.Up = lin(p, "mlp.up_proj", C, I)
		L.Down = lin(p, "mlp.down_proj", I, C)
		s.Layers = append(s.Layers, L)
	}
	s.head = &loss.Head{V: cfg.VocabSize, C: C}
	return s, nil
}

// Load copies weights by HF name. A missing, extra or mis-sized tensor is
// an error naming it.
func (s *Student) Load(w map[string][]float32) error {
	for _, t := range s.Tensors {
		v, ok := w[t.Name]
		if !ok {
			return fmt.Errorf("%w: missing tensor %s (shape %v)", ErrInvalid, t.Name, t.Shape)
		}
		if len(v) != t.N {
			return fmt.Errorf("%w: tensor %s has %d values, want shape %v = %d", ErrInvalid, t.Name, len(v), t.Shape, t.N)
		}
		copy(s.Params[t.Off:t.Off+t.N], v)
	}
	if len(w) != len(s.Tensors) {
		known := map[string]bool{}
		for _, t := range s.Tensors {
			known[t.Name] = true
		}
		for name := range w {
			if !known[name] {
				return fmt.Errorf("%w: unexpected tensor %s for a %s student", ErrInvalid, name, s.Cfg.Arch)
			}
		}
	}
	return nil
}

// Groups returns the optimizer's parameter groups, one per tensor, with
// weight decay off for norms and biases.
func (s *Student) Groups() []optim.Group {
	gs := make([]optim.Group, len(s.Tensors))
	for i, t := range s.Tensors {
		gs[i] = optim.Group{Name: t.Name, Params: s.Params[t.Off : t.Off+t.N], Grads: s.Grads[t.Off : t.Off+t.N], Decay: t.Decay}
	}
	return gs
}

// ZeroGrad clears every gradient (one clear over the arena).
func (s *Student) ZeroGrad() { clear(s.Grads) }

// linears lists the Linear layers of layer L in a fixed order.
func (L *Layer) linears() []*Linear {
	return []*Linear{&L.Q, &L.K, &L.V, &L.O, &L.Gate, &L.Up, &L.Down}
}

// acts are the views of one batch's activation arena.
type acts struct {
	cos, sin []float32 // (N, D/2)
	x0       []float32 // (N,C) token embeddings
	layers   []layerActs
	xL       []float32 // (N,C) residual after the last layer
	lnf      []float32 // (N,C)
	rstdf    []float32 // (N)
	// One layer's gradient scratch, reused layer after layer.
	dres, dln, dq, dk, dv, datt, dqpre, dkpre, dgate, dup, dh []float32
}

type layerActs struct {
	xin, ln1, rstd1          []float32
	qpre, qrstd, kpre, krstd []float32 // QKNorm only
	q, k, v, att, lse        []float32
	xmid, ln2, rstd2         []float32
	gate, up, h              []float32
	out                      []float32 // (N,C) the layer's output, the next one's xin
	ln1q, attq, ln2q, hq     []float32 // QAD only (else aliases)
}

// carveActs lays out the activations of an N-token batch in buf, or only
// counts them when buf is nil; it returns the size in floats. Sizes and
// views come from this one function so they cannot drift apart.
func (s *Student) carveActs(a *acts, N int, buf []float32) int {
	cfg := s.Cfg
	C, H, KV, D, I := cfg.Hidden, cfg.Heads, cfg.KVHeads, cfg.HeadDim, cfg.Intermediate
	off := 0
	take := func(n int) []float32 {
		off += n
		if buf == nil {
			return nil
		}
		return buf[off-n : off : off]
	}
	a.cos, a.sin = take(N*D/2), take(N*D/2)
	a.x0 = take(N * C)
	a.layers = make([]layerActs, cfg.Layers)
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
		l.xmid, l.ln2, l.rstd2 = take(N*C), take(N*C), take(N)
		l.gate, l.up, l.h = take(N*I), take(N*I), take(N*I)
		l.ln1q, l.attq, l.ln2q, l.hq = l.ln1, l.att, l.ln2, l.h
		if s.QAD {
			l.ln1q, l.attq, l.ln2q, l.hq = take(N*C), take(N*H*D), take(N*C), take(N*I)
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
	return off
}
