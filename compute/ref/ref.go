// Package ref holds float64 oracles for the kernels of the compute contract:
// naive loops written directly from the formulas (HF modeling files), sharing
// no code with the kernels they check, plus central finite differences. The
// conformance suite (package compute/computetest) and the model-level tests
// use them. Slow by design; imported only by tests and test helpers.
package ref

import "math"

// F64 widens a float32 slice.
func F64(x []float32) []float64 {
	y := make([]float64, len(x))
	for i, v := range x {
		y[i] = float64(v)
	}
	return y
}

// Embedding: wte (V,C), ids (N) -> (N,C).
func Embedding(wte []float64, ids []int32, C int) []float64 {
	out := make([]float64, len(ids)*C)
	for t, id := range ids {
		copy(out[t*C:], wte[int(id)*C:int(id+1)*C])
	}
	return out
}

// RMSNorm: x (N,C), w (C) -> x / sqrt(mean(x²)+eps) * w.
func RMSNorm(x, w []float64, C int, eps float64) []float64 {
	out := make([]float64, len(x))
	for t := 0; t < len(x)/C; t++ {
		var ss float64
		for i := 0; i < C; i++ {
			ss += x[t*C+i] * x[t*C+i]
		}
		r := 1 / math.Sqrt(ss/float64(C)+eps)
		for i := 0; i < C; i++ {
			out[t*C+i] = x[t*C+i] * r * w[i]
		}
	}
	return out
}

// Linear: x (N,C), w (OC,C), b (OC) or nil -> (N,OC).
func Linear(x, w, b []float64, C, OC int) []float64 {
	N := len(x) / C
	out := make([]float64, N*OC)
	for t := 0; t < N; t++ {
		for o := 0; o < OC; o++ {
			var s float64
			if b != nil {
				s = b[o]
			}
			for i := 0; i < C; i++ {
				s += x[t*C+i] * w[o*C+i]
			}
			out[t*OC+o] = s
		}
	}
	return out
}

// Rope rotates x (N,H,D), rotate-half, angle = float32(pos·invFreq[i])
// (HF computes the product in fp32), cos/sin in float64.
func Rope(x []float64, pos []int32, invFreq []float32, H, D int) []float64 {
	out := append([]float64(nil), x...)
	half := D / 2
	for t := range pos {
		for h := 0; h < H; h++ {
			for i := 0; i < half; i++ {
				a := float64(float32(pos[t]) * invFreq[i])
				c, s := math.Cos(a), math.Sin(a)
				o := (t*H + h) * D
				x1, x2 := x[o+i], x[o+i+half]
				out[o+i] = x1*c - x2*s
				out[o+i+half] = x2*c + x1*s
			}
		}
	}
	return out
}

// Attention: q (N,H,D), k,v (N,KV,D), samples [starts[s], starts[s+1]),
// causal inside each sample -> (N,H,D).
func Attention(q, k, v []float64, starts []int32, H, KV, D int, scale float64) []float64 {
	N := len(q) / (H * D)
	out := make([]float64, N*H*D)
	for s := 0; s+1 < len(starts); s++ {
		st, en := int(starts[s]), int(starts[s+1])
		for i := st; i < en; i++ {
			for h := 0; h < H; h++ {
				kh := h / (H / KV)
				sc := make([]float64, i-st+1)
				m := math.Inf(-1)
				for j := st; j <= i; j++ {
					var d float64
					for x := 0; x < D; x++ {
						d += q[(i*H+h)*D+x] * k[(j*KV+kh)*D+x]
					}
					sc[j-st] = d * scale
					m = math.Max(m, sc[j-st])
				}
				var z float64
				for j := range sc {
					sc[j] = math.Exp(sc[j] - m)
					z += sc[j]
				}
				for j := st; j <= i; j++ {
					for x := 0; x < D; x++ {
						out[(i*H+h)*D+x] += sc[j-st] / z * v[(j*KV+kh)*D+x]
					}
				}
			}
		}
	}
	return out
}

// SwiGLU: silu(g)·u.
func SwiGLU(g, u []float64) []float64 {
	out := make([]float64, len(g))
	for i := range g {
		out[i] = g[i] / (1 + math.Exp(-g[i])) * u[i]
	}
	return out
}

// Dot is Σ a·b, used to turn a tensor output into a scalar loss with random
// weights so that every output element is checked by the gradient.
func Dot(a, b []float64) float64 {
	var s float64
	for i := range a {
		s += a[i] * b[i]
	}
	return s
}

// Grad returns the central finite-difference gradient of f with respect to
// the elements idx of x (all of x when idx is nil), step h. f must read x.
func Grad(f func() float64, x []float64, idx []int, h float64) []float64 {
	if idx == nil {
		idx = make([]int, len(x))
		for i := range idx {
			idx[i] = i
		}
	}
	g := make([]float64, len(idx))
	for n, i := range idx {
		old := x[i]
		x[i] = old + h
		fp := f()
		x[i] = old - h
		fm := f()
		x[i] = old
		g[n] = (fp - fm) / (2 * h)
	}
	return g
}

// AttentionLSE: the log-sum-exp of each query row's scaled causal scores of
// Attention, (N,H).
func AttentionLSE(q, k []float64, starts []int32, H, KV, D int, scale float64) []float64 {
	N := len(q) / (H * D)
	out := make([]float64, N*H)
	for s := 0; s+1 < len(starts); s++ {
		st, en := int(starts[s]), int(starts[s+1])
		for i := st; i < en; i++ {
			for h := 0; h < H; h++ {
				kh := h / (H / KV)
				sc := make([]float64, 0, i-st+1)
				m := math.Inf(-1)
				for j := st; j <= i; j++ {
					var d float64
					for x := 0; x < D; x++ {
						d += q[(i*H+h)*D+x] * k[(j*KV+kh)*D+x]
					}
					sc = append(sc, d*scale)
					m = math.Max(m, d*scale)
				}
				var z float64
				for _, v := range sc {
					z += math.Exp(v - m)
				}
				out[i*H+h] = m + math.Log(z)
			}
		}
	}
	return out
}

// LogSumExp is log Σ_v exp(z_v·f), shifted by the maximum.
func LogSumExp(z []float64, f float64) float64 {
	m := math.Inf(-1)
	for _, v := range z {
		m = math.Max(m, v*f)
	}
	var s float64
	for _, v := range z {
		s += math.Exp(v*f - m)
	}
	return m + math.Log(s)
}

// MoEProbs: x (T,H), router (E,H) -> the router's softmax (T,E).
func MoEProbs(x, router []float64, E, H int) []float64 {
	T := len(x) / H
	p := Linear(x, router, nil, H, E)
	for t := 0; t < T; t++ {
		row := p[t*E : (t+1)*E]
		lse := LogSumExp(row, 1)
		for e := range row {
			row[e] = math.Exp(row[e] - lse)
		}
	}
	return p
}

// TopK returns the indices of the k largest values of p, descending (ties:
// lower index first, as torch.topk on CPU).
func TopK(p []float64, k int) []int {
	sel := make([]int, 0, k)
	for len(sel) < k {
		best := -1
		for e, v := range p {
			used := false
			for _, s := range sel {
				used = used || s == e
			}
			if !used && (best < 0 || v > p[best]) {
				best = e
			}
		}
		sel = append(sel, best)
	}
	return sel
}

// MoE is HF's Qwen3MoeSparseMoeBlock: the router reads x (T,H), the experts
// read xe (T,H) (x itself, or its fake-quantized copy under QAD); per token
// the top-k of the router's softmax, renormalized when norm, weight the
// experts' SwiGLU MLPs: gate[e], up[e] (I,H), down[e] (H,I).
func MoE(x, xe, router []float64, gate, up, down [][]float64, E, K, H, I int, norm bool) []float64 {
	return MoERounded(x, xe, router, gate, up, down, E, K, H, I, norm, nil)
}

// MoERounded is MoE with round, when not nil, applied in place to each
// expert's SwiGLU activations before down_proj reads them: a BF16 backend
// rounds them there (its GEMM input), which a test's reference can then
// reproduce.
func MoERounded(x, xe, router []float64, gate, up, down [][]float64, E, K, H, I int, norm bool, round func([]float64)) []float64 {
	T := len(x) / H
	p := MoEProbs(x, router, E, H)
	out := make([]float64, T*H)
	for t := 0; t < T; t++ {
		pt := p[t*E : (t+1)*E]
		sel := TopK(pt, K)
		var ks float64
		for _, e := range sel {
			ks += pt[e]
		}
		xt := xe[t*H : (t+1)*H]
		for _, e := range sel {
			w := pt[e]
			if norm {
				w /= ks
			}
			act := SwiGLU(Linear(xt, gate[e], nil, H, I), Linear(xt, up[e], nil, H, I))
			if round != nil {
				round(act)
			}
			y := Linear(act, down[e], nil, I, H)
			for j := range y {
				out[t*H+j] += w * y[j]
			}
		}
	}
	return out
}

// LoadBalancingLoss is HF's load_balancing_loss_func (Qwen3-MoE) with no
// attention mask, written the way HF writes it: the layers' router logits
// (T,E each) concatenated, softmax, top-k, one-hot (tokens, K, E), then
// tokens_per_expert = mean over tokens (K,E), router_prob_per_expert =
// mean over tokens (E), loss = E · Σ_{k,e} tokens_per_expert ·
// router_prob_per_expert.
func LoadBalancingLoss(logits [][]float64, E, K int) float64 {
	var cat []float64
	for _, l := range logits {
		cat = append(cat, l...)
	}
	n := len(cat) / E
	tpe := make([]float64, K*E)
	ppe := make([]float64, E)
	for t := 0; t < n; t++ {
		row := cat[t*E : (t+1)*E]
		lse := LogSumExp(row, 1)
		p := make([]float64, E)
		for e := range row {
			p[e] = math.Exp(row[e] - lse)
			ppe[e] += p[e] / float64(n)
		}
		for k, e := range TopK(p, K) {
			tpe[k*E+e] += 1 / float64(n)
		}
	}
	var s float64
	for k := 0; k < K; k++ {
		for e := 0; e < E; e++ {
			s += tpe[k*E+e] * ppe[e]
		}
	}
	return s * float64(E)
}
