// Package infer is the teacher: it loads an HF checkpoint onto a compute
// backend and runs forward passes over packed batches of samples, returning
// each position's top-k next-token ids and log-probs normalized over the full
// vocabulary.
//
// # Packing
//
// Samples of different lengths are concatenated into one token stream; the
// attention of each token sees only earlier tokens of its own sample
// (block-diagonal causal), and positions restart at 0 for every sample, so a
// packed batch gives the outputs each sample would give alone.
//
// # Memory
//
// Beside the weights (fp32 on the CPU: 4 bytes a parameter), a forward over
// n tokens holds fp32 activations of about n·(4H + 2Hq + 2Hkv + 2I + 4k)
// floats (H hidden, Hq = heads·head_dim, Hkv = kv_heads·head_dim, I
// intermediate, k the top-k) plus per-core scratch: attention scores for 128
// queries x the longest sample, and one 256 x 2048 LM-head tile. The
// [tokens x vocab] logits are never held. ActivationBytes gives the exact
// bound (a test holds Forward to it); TopK cuts its input into forward
// passes of at most Options.TokenBudget tokens, which bounds n.
package infer

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sort"

	"distill/compute"
	"distill/model"
)

// ErrInput marks a request the model cannot serve as given (bad ids, empty
// or over-long samples, k out of range); the message says which and why.
var ErrInput = errors.New("infer: invalid input")

// Linear is a torch.nn.Linear: W (out,in), optional B (out).
type Linear struct {
	W, B    compute.Tensor
	Out, In int
}

// Attention is one self-attention block; QNorm/KNorm are nil except Qwen3.
type Attention struct {
	Q, K, V, O   Linear
	QNorm, KNorm compute.Tensor
}

// MLP is the SiLU-gated feed-forward block.
type MLP struct{ Gate, Up, Down Linear }

// Layer is one decoder layer: exactly one of MLP and MoE is set.
type Layer struct {
	InputNorm, PostNorm compute.Tensor
	Attn                Attention
	MLP                 *MLP
	MoE                 *compute.MoEWeights
}

// Model is a loaded teacher.
type Model struct {
	Cfg    *model.Config
	Layers []Layer
	Embed  compute.Tensor // (vocab, hidden)
	Norm   compute.Tensor // (hidden)
	Head   compute.Tensor // (vocab, hidden); Embed when tied

	be          compute.Backend
	invFreq     compute.Tensor
	fingerprint string
}

// Backend returns the backend the model runs on.
func (m *Model) Backend() compute.Backend { return m.be }

// Fingerprint identifies the teacher: sha256 over config.json and every
// safetensors file, hex. Two caches filled by teachers with different
// fingerprints must not be mixed.
func (m *Model) Fingerprint() string { return m.fingerprint }

// Load reads an HF checkpoint directory onto be.
func Load(dir string, be compute.Backend) (*Model, error) {
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		return nil, err
	}
	w, err := model.OpenWeights(dir)
	if err != nil {
		return nil, err
	}
	defer w.Close()
	m, err := New(cfg, w, be)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	m.fingerprint, err = fingerprint(dir)
	if err != nil {
		return nil, err
	}
	return m, nil
}

// fingerprint hashes config.json and the safetensors files of dir.
func fingerprint(dir string) (string, error) {
	h := sha256.New()
	files, _ := filepath.Glob(filepath.Join(dir, "*.safetensors"))
	sort.Strings(files)
	for _, p := range append([]string{filepath.Join(dir, "config.json")}, files...) {
		f, err := os.Open(p)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "%s\x00", filepath.Base(p))
		_, err = io.Copy(h, f)
		f.Close()
		if err != nil {
			return "", fmt.Errorf("infer: hashing %s: %w", p, err)
		}
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// New binds the tensors of w to a model of cfg on be. Missing, extra and
// mis-shaped tensors are errors naming the tensor.
func New(cfg *model.Config, w *model.Weights, be compute.Backend) (*Model, error) {
	if err := w.Check(cfg); err != nil {
		return nil, err
	}
	load := func(name string) (compute.Tensor, error) {
		info, _ := w.Info(name)
		var src any
		var err error
		if info.DType == "BF16" {
			src, err = w.BF16(name)
		} else {
			src, err = w.F32(name)
		}
		if err != nil {
			return nil, err
		}
		t, err := be.Weight(src)
		if err != nil {
			return nil, fmt.Errorf("tensor %s: %w", name, err)
		}
		return t, nil
	}
	var errs []error
	get := func(name string) compute.Tensor {
		t, err := load(name)
		if err != nil {
			errs = append(errs, err)
		}
		return t
	}
	lin := func(prefix string, out, in int, bias bool) Linear {
		l := Linear{W: get(prefix + ".weight"), Out: out, In: in}
		if bias {
			l.B = get(prefix + ".bias")
		}
		return l
	}
	h, q, kv := cfg.Hidden, cfg.Heads*cfg.HeadDim, cfg.KVHeads*cfg.HeadDim
	m := &Model{Cfg: cfg, be: be, Embed: get("model.embed_tokens.weight"), Norm: get("model.norm.weight")}
	m.Head = m.Embed
	if !cfg.TieEmbeddings {
		m.Head = get("lm_head.weight")
	}
	oBias := cfg.AttentionBias && cfg.Arch != model.ArchQwen2
	for i := 0; i < cfg.Layers; i++ {
		p := fmt.Sprintf("model.layers.%d.", i)
		L := Layer{
			InputNorm: get(p + "input_layernorm.weight"),
			PostNorm:  get(p + "post_attention_layernorm.weight"),
			Attn: Attention{
				Q: lin(p+"self_attn.q_proj", q, h, cfg.AttentionBias),
				K: lin(p+"self_attn.k_proj", kv, h, cfg.AttentionBias),
				V: lin(p+"self_attn.v_proj", kv, h, cfg.AttentionBias),
				O: lin(p+"self_attn.o_proj", h, q, oBias),
			},
		}
		if cfg.QKNorm {
			L.Attn.QNorm = get(p + "self_attn.q_norm.weight")
			L.Attn.KNorm = get(p + "self_attn.k_norm.weight")
		}
		if cfg.IsMoE(i) {
			moe := &compute.MoEWeights{Router: get(p + "mlp.gate.weight"), NumExperts: cfg.NumExperts,
				TopK: cfg.ExpertsPerTok, Hidden: h, Inter: cfg.MoEIntermediate, NormTopK: cfg.NormTopKProb}
			for e := 0; e < cfg.NumExperts; e++ {
				ep := fmt.Sprintf("%smlp.experts.%d.", p, e)
				moe.Gate = append(moe.Gate, get(ep+"gate_proj.weight"))
				moe.Up = append(moe.Up, get(ep+"up_proj.weight"))
				moe.Down = append(moe.Down, get(ep+"down_proj.weight"))
			}
			L.MoE = moe
		} else {
			L.MLP = &MLP{
				Gate: lin(p+"mlp.gate_proj", cfg.Intermediate, h, false),
				Up:   lin(p+"mlp.up_proj", cfg.Intermediate, h, false),
				Down: lin(p+"mlp.down_proj", h, cfg.Intermediate, false),
			}
		}
		m.Layers = append(m.Layers, L)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	m.invFreq = be.FromF32(cfg.InvFreq())
	return m, nil
}

// Forward runs the decoder over one packed batch and returns each position's
// top-k: ids (n,k) and log-probs (n,k), n the total tokens. samples must be
// valid (see Validate); temperature scales the logits (1: none).
//
//	tokens (n) -> embed (n,H) -> layers -> norm (n,H) -> LM-head top-k (n,k)
func (m *Model) Forward(samples [][]int32, k int, temperature float32) (ids []int32, logprobs []float32) {
	be, c := m.be, m.Cfg
	n, maxLen := 0, 0
	for _, s := range samples {
		n += len(s)
		maxLen = max(maxLen, len(s))
	}
	flat := make([]int32, 0, n)
	pos := make([]int32, 0, n)
	starts := []int32{0}
	for _, s := range samples {
		flat = append(flat, s...)
		for p := range s {
			pos = append(pos, int32(p))
		}
		starts = append(starts, int32(len(flat)))
	}
	H, Hq, Hkv, hd := c.Hidden, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim, c.HeadDim
	var tmp []compute.Tensor
	alloc := func(dt compute.DType, size int) compute.Tensor {
		t := be.New(dt, size)
		tmp = append(tmp, t)
		return t
	}
	tokT, posT, startT := be.FromI32(flat), be.FromI32(pos), be.FromI32(starts)
	tmp = append(tmp, tokT, posT, startT)
	x := alloc(compute.F32, n*H)
	xn := alloc(compute.F32, n*H)
	q, kk, v := alloc(compute.F32, n*Hq), alloc(compute.F32, n*Hkv), alloc(compute.F32, n*Hkv)
	att := alloc(compute.F32, n*Hq)
	o := alloc(compute.F32, n*H)
	var gate, up compute.Tensor
	if c.Intermediate > 0 {
		gate, up = alloc(compute.F32, n*c.Intermediate), alloc(compute.F32, n*c.Intermediate)
	}
	scale := float32(1 / math.Sqrt(float64(hd)))

	be.Embed(x, m.Embed, tokT, n, H)
	for i := range m.Layers {
		L := &m.Layers[i]
		be.RMSNorm(xn, x, L.InputNorm, n, H, c.RMSNormEps)
		be.MatMul(q, xn, L.Attn.Q.W, L.Attn.Q.B, n, Hq, H)
		be.MatMul(kk, xn, L.Attn.K.W, L.Attn.K.B, n, Hkv, H)
		be.MatMul(v, xn, L.Attn.V.W, L.Attn.V.B, n, Hkv, H)
		if L.Attn.QNorm != nil {
			be.RMSNorm(q, q, L.Attn.QNorm, n*c.Heads, hd, c.RMSNormEps)
			be.RMSNorm(kk, kk, L.Attn.KNorm, n*c.KVHeads, hd, c.RMSNormEps)
		}
		be.RoPE(q, posT, m.invFreq, n, c.Heads, hd)
		be.RoPE(kk, posT, m.invFreq, n, c.KVHeads, hd)
		be.Attention(att, q, kk, v, startT, len(samples), maxLen, n, c.Heads, c.KVHeads, hd, scale)
		be.MatMul(o, att, L.Attn.O.W, L.Attn.O.B, n, H, Hq)
		be.Add(x, o, n*H)
		be.RMSNorm(xn, x, L.PostNorm, n, H, c.RMSNormEps)
		if L.MoE != nil {
			be.MoE(o, xn, L.MoE, n)
		} else {
			I := L.MLP.Gate.Out
			be.MatMul(gate, xn, L.MLP.Gate.W, nil, n, I, H)
			be.MatMul(up, xn, L.MLP.Up.W, nil, n, I, H)
			be.SwiGLU(gate, gate, up, n*I)
			be.MatMul(o, gate, L.MLP.Down.W, nil, n, H, I)
		}
		be.Add(x, o, n*H)
	}
	normW := m.Norm
	if temperature != 1 {
		// logits/T = (x·Wᵀ)/T = (x·(w/T))·Wᵀ: fold 1/T into the final norm
		// weight instead of scaling [n x vocab] logits.
		w := make([]float32, H)
		be.ReadF32(m.Norm, w)
		for j := range w {
			w[j] /= temperature
		}
		normW = be.FromF32(w)
		tmp = append(tmp, normW)
	}
	be.RMSNorm(xn, x, normW, n, H, c.RMSNormEps)
	idT, lpT := alloc(compute.I32, n*k), alloc(compute.F32, n*k)
	be.LMHeadTopK(idT, lpT, xn, m.Head, n, H, c.VocabSize, k)
	ids, logprobs = make([]int32, n*k), make([]float32, n*k)
	be.ReadI32(idT, ids)
	be.ReadF32(lpT, logprobs)
	for _, t := range tmp {
		be.Free(t)
	}
	return ids, logprobs
}
