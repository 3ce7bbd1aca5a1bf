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
