// Package nn holds the student's layer kernels on the CPU: one forward and
// one backward function per layer, free functions over flat row-major
// float32 slices, with the shapes in a comment on each (llm.c style).
//
// Conventions, stated once for the whole package:
//
//   - Forward kernels overwrite (=) their outputs.
//   - Backward kernels ACCUMULATE (+=) into every gradient they produce, for
//     parameters and inputs alike. A tensor read by two consumers (the
//     residual stream, the shared input of q/k/v) therefore gets the sum of
//     both contributions for free; the caller zeroes the gradient arena with
//     one clear() before a backward pass.
//   - dX is the gradient of the loss with respect to X, same shape as X.
//   - Every matmul goes through compute/cpu's OpenBLAS GEMM; elementwise work
//     is split over cpu.Threads goroutines by rows, and parameter-gradient
//     reductions (RMSNorm weights, biases) are done per worker and summed in
//     a fixed order, so results are deterministic for a given thread count.
//
// Packed batches: N tokens hold several samples back to back. Sample s is
// the token range [starts[s], starts[s+1]); attention never crosses a sample
// boundary, and positions restart at each sample (see Positions).
package nn

import (
	"math"
	"sync"

	"distill/compute/cpu"
)

// minParallelWork is the work (rows x cost per row) below which
// parallelRows runs inline: less does not pay for goroutines.
const minParallelWork = 1 << 14

// parallelRows runs fn over [0,n) split into at most cpu.Threads contiguous
// ranges; it runs inline when the work is too small to pay for goroutines.
// The worker index w lets callers keep per-worker partial sums.
func parallelRows(n, costPerRow int, fn func(w, lo, hi int)) {
	t := cpu.Threads
	if t > n {
		t = n
	}
	if t <= 1 || n*costPerRow < minParallelWork {
		if n > 0 {
			fn(0, 0, n)
		}
		return
	}
	var wg sync.WaitGroup
	for w := 0; w < t; w++ {
		lo, hi := n*w/t, n*(w+1)/t
		wg.Add(1)
		go func(w, lo, hi int) {
			defer wg.Done()
			fn(w, lo, hi)
		}(w, lo, hi)
	}
	wg.Wait()
}

// workers is the number of worker slots parallelRows may use.
func workers() int {
	if cpu.Threads < 1 {
		return 1
	}
	return cpu.Threads
}

// EmbeddingForward: wte (V,C), ids (N) -> out (N,C). ids must be in [0,V);
// the caller validates them (Student.Forward does, naming the token).
func EmbeddingForward(out []float32, ids []int32, wte []float32, N, C int) {
	parallelRows(N, C, func(_, lo, hi int) {
		for t := lo; t < hi; t++ {
			id := int(ids[t])
			copy(out[t*C:(t+1)*C], wte[id*C:(id+1)*C])
		}
	})
}

// EmbeddingBackward: dout (N,C), ids (N) -> dwte (V,C) +=. Serial: two
// tokens with the same id would race, and this is O(N*C), negligible.
func EmbeddingBackward(dwte []float32, dout []float32, ids []int32, N, C int) {
	for t := 0; t < N; t++ {
		id := int(ids[t])
		row, d := dwte[id*C:(id+1)*C], dout[t*C:(t+1)*C]
		for i := range row {
			row[i] += d[i]
		}
	}
}

// RMSNormForward: inp (N,C), weight (C) -> out (N,C); saves rstd (N) for
// backward. As HF LlamaRMSNorm in fp32: out = inp * rsqrt(mean(inp²)+eps) * w.
// The mean of squares is accumulated in float64 so that long rows do not
// lose digits; the result is rounded to fp32 like torch's fp32 reduction.
// out may alias inp.
func RMSNormForward(out, rstd, inp, weight []float32, N, C int, eps float32) {
	parallelRows(N, C, func(_, lo, hi int) {
		for t := lo; t < hi; t++ {
			x := inp[t*C : (t+1)*C]
			var ss float64
			for _, v := range x {
				ss += float64(v) * float64(v)
			}
			r := float32(1 / math.Sqrt(float64(float32(ss/float64(C))+eps)))
			rstd[t] = r
			o := out[t*C : (t+1)*C]
			for i, v := range x {
				o[i] = v * r * weight[i]
			}
		}
	})
}

// RMSNormBackward: dout (N,C), inp (N,C), weight (C), rstd (N) ->
// dinp (N,C) +=, dweight (C) +=. With xhat = inp*rstd:
// dweight = Σ_t dout·xhat; dinp = rstd·(dout·w - xhat·mean(dout·w·xhat)).
// dinp must not alias dout.
func RMSNormBackward(dinp, dweight, dout, inp, weight, rstd []float32, N, C int) {
	nw := workers()
	partial := make([]float64, nw*C)
	parallelRows(N, C, func(w, lo, hi int) {
		dw := partial[w*C : (w+1)*C]
		for t := lo; t < hi; t++ {
			x, d, dx := inp[t*C:(t+1)*C], dout[t*C:(t+1)*C], dinp[t*C:(t+1)*C]
			r := rstd[t]
			var dot float64 // Σ dout·w·xhat
			for i := range x {
				xh := x[i] * r
				dot += float64(d[i] * weight[i] * xh)
				dw[i] += float64(d[i] * xh)
			}
			m := float32(dot / float64(C))
			for i := range x {
				dx[i] += r * (d[i]*weight[i] - x[i]*r*m)
			}
		}
	})
	for w := 0; w < nw; w++ {
		for i := 0; i < C; i++ {
			dweight[i] += float32(partial[w*C+i])
		}
	}
}

// LinearForward: inp (N,C), weight (OC,C), bias (OC) or nil -> out (N,OC)
// = inp·weightᵀ + bias. weight has torch.nn.Linear's layout.
func LinearForward(out, inp, weight, bias []float32, N, C, OC int) {
	if bias != nil {
		parallelRows(N, OC, func(_, lo, hi int) {
			for t := lo; t < hi; t++ {
				copy(out[t*OC:(t+1)*OC], bias)
			}
		})
		cpu.SgemmPar(false, true, N, OC, C, 1, inp, C, weight, C, 1, out, OC)
		return
	}
	cpu.SgemmPar(false, true, N, OC, C, 1, inp, C, weight, C, 0, out, OC)
}

// LinearBackward: dout (N,OC), inp (N,C), weight (OC,C) -> dinp (N,C) +=,
// dweight (OC,C) +=, dbias (OC) += (skipped when dbias is nil, and dinp is
// skipped when nil, e.g. for a layer whose input needs no gradient).
// inp and weight must be exactly what the forward multiplied: with NVFP4
// fake quantization they are the quantized copies (straight-through).
func LinearBackward(dinp, dweight, dbias, dout, inp, weight []float32, N, C, OC int) {
	if dinp != nil {
		cpu.SgemmPar(false, false, N, C, OC, 1, dout, OC, weight, C, 1, dinp, C)
	}
	cpu.SgemmPar(true, false, OC, C, N, 1, dout, OC, inp, C, 1, dweight, C)
	if dbias != nil {
		nw := workers()
		partial := make([]float64, nw*OC)
		parallelRows(N, OC, func(w, lo, hi int) {
			p := partial[w*OC : (w+1)*OC]
			for t := lo; t < hi; t++ {
				for i, v := range dout[t*OC : (t+1)*OC] {
					p[i] += float64(v)
				}
			}
		})
		for w := 0; w < nw; w++ {
			for i := 0; i < OC; i++ {
				dbias[i] += float32(partial[w*OC+i])
			}
		}
	}
}

// Positions fills pos (N) with each token's position inside its sample:
// starts (nSeq+1) gives the sample boundaries, starts[0]=0, starts[nSeq]=N.
func Positions(pos []int32, starts []int32) {
	for s := 0; s+1 < len(starts); s++ {
		for t := starts[s]; t < starts[s+1]; t++ {
			pos[t] = t - starts[s]
		}
	}
}

// RopeTable: pos (N), invFreq (D/2) -> cos, sin (N, D/2), with the angle
// pos·invFreq[i] rounded to fp32 first, as HF computes it (an fp32 product
// of position and inverse frequency, then cos/sin of that fp32 value).
func RopeTable(cos, sin []float32, pos []int32, invFreq []float32, N int) {
	half := len(invFreq)
	parallelRows(N, half*40, func(_, lo, hi int) {
		for t := lo; t < hi; t++ {
			p := float32(pos[t])
			for i, f := range invFreq {
				a := float64(p * f)
				cos[t*half+i] = float32(math.Cos(a))
				sin[t*half+i] = float32(math.Sin(a))
			}
		}
	})
}

// RopeForward rotates x (N, H, D) in place, rotate-half convention (HF
// apply_rotary_pos_emb): for i < D/2, with c, s = cos, sin (N, D/2) at t:
// x[i] <- x[i]·c - x[i+D/2]·s ; x[i+D/2] <- x[i+D/2]·c + x[i]·s.
func RopeForward(x, cos, sin []float32, N, H, D int) {
	half := D / 2
	parallelRows(N, H*D, func(_, lo, hi int) {
		for t := lo; t < hi; t++ {
			c, s := cos[t*half:(t+1)*half], sin[t*half:(t+1)*half]
			for h := 0; h < H; h++ {
				v := x[(t*H+h)*D : (t*H+h+1)*D]
				for i := 0; i < half; i++ {
					a, b := v[i], v[i+half]
					v[i] = a*c[i] - b*s[i]
					v[i+half] = b*c[i] + a*s[i]
				}
			}
		}
	})
}

// RopeBackward turns dout (N, H, D) into dinp in place: the rotation is
// orthogonal, so its backward is the rotation by -angle. It overwrites
// (the one in-place exception to +=): the buffer holds dout on entry and
// dinp on return.
func RopeBackward(dx, cos, sin []float32, N, H, D int) {
	half := D / 2
	parallelRows(N, H*D, func(_, lo, hi int) {
		for t := lo; t < hi; t++ {
			c, s := cos[t*half:(t+1)*half], sin[t*half:(t+1)*half]
			for h := 0; h < H; h++ {
				v := dx[(t*H+h)*D : (t*H+h+1)*D]
				for i := 0; i < half; i++ {
					a, b := v[i], v[i+half]
					v[i] = a*c[i] + b*s[i]
					v[i+half] = b*c[i] - a*s[i]
				}
			}
		}
	})
}

// SwiGLUForward: gate, up (N*I) -> out (N*I) = silu(gate)·up.
func SwiGLUForward(out, gate, up []float32, n int) {
	parallelRows(n, 20, func(_, lo, hi int) {
		cpu.SwiGLUSlice(out[lo:hi], gate[lo:hi], up[lo:hi])
	})
}

// SwiGLUBackward: dout, gate, up (N*I) -> dgate +=, dup +=, with
// silu'(g) = σ(g)·(1 + g·(1-σ(g))).
func SwiGLUBackward(dgate, dup, dout, gate, up []float32, n int) {
	parallelRows(n, 25, func(_, lo, hi int) {
		cpu.SwiGLUBackwardSlice(dgate[lo:hi], dup[lo:hi], dout[lo:hi], gate[lo:hi], up[lo:hi])
	})
}

// Add: a (n) += b (n), the residual connection (its backward is a copy of
// the gradient into both branches, which the += convention gives for free).
func Add(a, b []float32) {
	parallelRows(len(a), 1, func(_, lo, hi int) {
		for i := lo; i < hi; i++ {
			a[i] += b[i]
		}
	})
}
