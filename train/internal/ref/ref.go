// Package ref is the float64 oracle for the student's numerics tests: naive
// loops written directly from the formulas (HF modeling files, the loss
// package doc), sharing no code with the fp32 kernels they check, plus central
// finite differences. It is slow by design and only imported by tests.
package ref

import (
	"fmt"
	"math"

	cref "distill/compute/ref"
)

// The layer oracles are compute/ref's, shared with the backends'
// conformance suite; F64 and Grad are re-exported for the tests here.
var (
	F64  = cref.F64
	Grad = cref.Grad
)

// KDOpts mirror loss.Options with plain types, so that this oracle does
// not import the package it checks.
type KDOpts struct {
	Kind           string // fwd_kl, rev_kl, jsd
	Beta           float64
	Tail           string // bucket, renormalize, zero
	T, Tc          float64
	ScaleT2        bool
	KDWeight, SFTW float64
}

// KDLoss computes the mean KD+SFT loss of package loss from the full logits
// z = x·Wᵀ held in float64: every position t with t+1 in its sample and
// mask[t+1] = 1, student probabilities q over the whole vocabulary, and
// per tail mode:
//   - bucket: teacher p_K plus a tail bucket 1 - Σ_K p, student q_K plus
//     1 - Σ_K q (a different formula from the fp32 code's direct tail sum);
//   - renormalize: teacher p̃ = p_K^(Tc/T) / Σ_K p_K^(Tc/T) (tempered from
//     capture temperature Tc to T), student q_K / Σ_K q (from the
//     full-vocabulary q, where the fp32 code uses softmax_K(z_K/T));
//   - zero: teacher p̃, student q_K as it is (not summing to 1; the
//     teacher's 0 outside K contributes nothing to fwd_kl).
//
// Returns the total, the mean divergence and the mean CE.
func KDLoss(x, W []float64, C, V int, tokens, starts []int32, mask []uint8, K int, ids []int32, lps []float32, o KDOpts) (total, kd, ce float64) {
	count := 0
	for s := 0; s+1 < len(starts); s++ {
		for t := int(starts[s]); t+1 < int(starts[s+1]); t++ {
			if mask[t+1] == 0 {
				continue
			}
			count++
			z := make([]float64, V)
			for v := 0; v < V; v++ {
				for i := 0; i < C; i++ {
					z[v] += x[t*C+i] * W[v*C+i]
				}
			}
			lse := func(f float64) float64 { return cref.LogSumExp(z, f) }
			ce += lse(1) - z[tokens[t+1]]
			if K == 0 {
				continue
			}
			lT := lse(1 / o.T)
			var p, q []float64
			var qs, ps float64
			for j := 0; j < K; j++ {
				q = append(q, math.Exp(z[ids[t*K+j]]/o.T-lT))
				qs += q[j]
				p = append(p, math.Exp(float64(lps[t*K+j])))
				ps += p[j]
			}
			switch o.Tail {
			case "renormalize", "zero":
				var zs float64
				for j := range p {
					p[j] = math.Pow(p[j], o.Tc/o.T)
					zs += p[j]
				}
				for j := range p {
					p[j] /= zs
				}
				if o.Tail == "renormalize" {
					for j := range q {
						q[j] /= qs
					}
				}
			case "bucket":
				p = append(p, math.Max(1-ps, 1e-30))
				q = append(q, math.Max(1-qs, 1e-30))
			default:
				panic("ref: unknown tail " + o.Tail)
			}
			kl := func(a, b []float64) float64 {
				var s float64
				for e := range a {
					if a[e] > 0 {
						s += a[e] * math.Log(a[e]/b[e])
					}
				}
				return s
			}
			switch {
			case o.Kind == "fwd_kl" || (o.Kind == "jsd" && o.Beta == 0):
				kd += kl(p, q)
			case o.Kind == "rev_kl" || (o.Kind == "jsd" && o.Beta == 1):
				kd += kl(q, p)
			default:
				m := make([]float64, len(p))
				for e := range p {
					m[e] = o.Beta*p[e] + (1-o.Beta)*q[e]
				}
				kd += o.Beta*kl(p, m) + (1-o.Beta)*kl(q, m)
			}
		}
	}
	if count == 0 {
		return 0, 0, 0
	}
	kd /= float64(count)
	ce /= float64(count)
	w := o.KDWeight
	if o.ScaleT2 {
		w *= o.T * o.T
	}
	return w*kd + o.SFTW*ce, kd, ce
}

// ModelSpec is what the reference model needs from model.Config, as plain
// values (this package stays free of the code under test).
type ModelSpec struct {
	V, C, Layers, H, KV, D, I int
	Eps                       float64
	QKNorm, Tied              bool
	InvFreq                   []float32
	// Qwen3-MoE: a layer with mlp.gate.weight is a sparse block of E
	// experts (MoEI wide), top-k TopK; AuxCoef weighs HF's load-balancing
	// loss (0: off).
	E, TopK, MoEI int
	NormTopK      bool
	AuxCoef       float64
}

// ModelLoss runs a Llama/Qwen2/Qwen3/Qwen3-MoE decoder in float64 from
// HF-named tensors (a missing bias or q/k norm is simply absent) and returns
// the KD+SFT loss of KDLoss on its final hidden states, plus AuxCoef times
// HF's load-balancing loss of the MoE layers' router logits.
func ModelLoss(m ModelSpec, p map[string][]float64, tokens, starts []int32, mask []uint8, K int, ids []int32, lps []float32, o KDOpts) float64 {
	N := len(tokens)
	pos := make([]int32, N)
	for s := 0; s+1 < len(starts); s++ {
		for t := starts[s]; t < starts[s+1]; t++ {
			pos[t] = t - starts[s]
		}
	}
	x := cref.Embedding(p["model.embed_tokens.weight"], tokens, m.C)
	var logits [][]float64 // the MoE layers' router logits
	for l := 0; l < m.Layers; l++ {
		pre := fmt.Sprintf("model.layers.%d.", l)
		ln := cref.RMSNorm(x, p[pre+"input_layernorm.weight"], m.C, m.Eps)
		q := cref.Linear(ln, p[pre+"self_attn.q_proj.weight"], p[pre+"self_attn.q_proj.bias"], m.C, m.H*m.D)
		k := cref.Linear(ln, p[pre+"self_attn.k_proj.weight"], p[pre+"self_attn.k_proj.bias"], m.C, m.KV*m.D)
		v := cref.Linear(ln, p[pre+"self_attn.v_proj.weight"], p[pre+"self_attn.v_proj.bias"], m.C, m.KV*m.D)
		if m.QKNorm {
			q = cref.RMSNorm(q, p[pre+"self_attn.q_norm.weight"], m.D, m.Eps)
			k = cref.RMSNorm(k, p[pre+"self_attn.k_norm.weight"], m.D, m.Eps)
		}
		q = cref.Rope(q, pos, m.InvFreq, m.H, m.D)
		k = cref.Rope(k, pos, m.InvFreq, m.KV, m.D)
		a := cref.Attention(q, k, v, starts, m.H, m.KV, m.D, 1/math.Sqrt(float64(m.D)))
		o := cref.Linear(a, p[pre+"self_attn.o_proj.weight"], p[pre+"self_attn.o_proj.bias"], m.H*m.D, m.C)
		for i := range x {
			x[i] += o[i]
		}
		ln = cref.RMSNorm(x, p[pre+"post_attention_layernorm.weight"], m.C, m.Eps)
		if r, ok := p[pre+"mlp.gate.weight"]; ok {
			logits = append(logits, cref.Linear(ln, r, nil, m.C, m.E))
			var gs, us, ds [][]float64
			for e := 0; e < m.E; e++ {
				ep := fmt.Sprintf("%smlp.experts.%d.", pre, e)
				gs, us, ds = append(gs, p[ep+"gate_proj.weight"]), append(us, p[ep+"up_proj.weight"]), append(ds, p[ep+"down_proj.weight"])
			}
			d := cref.MoE(ln, ln, r, gs, us, ds, m.E, m.TopK, m.C, m.MoEI, m.NormTopK)
			for i := range x {
				x[i] += d[i]
			}
			continue
		}
		g := cref.Linear(ln, p[pre+"mlp.gate_proj.weight"], nil, m.C, m.I)
		u := cref.Linear(ln, p[pre+"mlp.up_proj.weight"], nil, m.C, m.I)
		d := cref.Linear(cref.SwiGLU(g, u), p[pre+"mlp.down_proj.weight"], nil, m.I, m.C)
		for i := range x {
			x[i] += d[i]
		}
	}
	x = cref.RMSNorm(x, p["model.norm.weight"], m.C, m.Eps)
	head := p["lm_head.weight"]
	if m.Tied {
		head = p["model.embed_tokens.weight"]
	}
	l, _, _ := KDLoss(x, head, m.C, m.V, tokens, starts, mask, K, ids, lps, o)
	if m.AuxCoef != 0 && len(logits) > 0 {
		l += m.AuxCoef * cref.LoadBalancingLoss(logits, m.E, m.TopK)
	}
	return l
}
