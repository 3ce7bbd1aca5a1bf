package cpu

/*
#include "kernels.h"
*/
import "C"

import (
	"math"
	"unsafe"

	"distill/compute"
)

// The backward kernels of the layers, the optimizer and NVFP4 fake
// quantization. Parameter-gradient reductions (RMSNorm weights, biases) are
// done per worker in float64 and summed in worker order, so results are
// deterministic for a given thread count.

// MatMulBackward implements compute.Backend.
func (b *Backend) MatMulBackward(dx, dw, dbias, dout, x, w compute.Tensor, m, n, k int) {
	refuseFP8(w, "MatMulBackward")
	d, xs, ws := f32(dout), f32(x), f32(w)
	if dx != nil {
		b.sgemm(false, false, m, k, n, 1, d, n, ws, k, 1, f32(dx), k)
	}
	if dw != nil {
		b.sgemm(true, false, n, k, m, 1, d, n, xs, k, 1, f32(dw), k)
	}
	if dbias != nil {
		db := f32(dbias)
		part := make([]float64, b.threads*n)
		b.rows(m, n, func(wk, lo, hi int) {
			p := part[wk*n : (wk+1)*n]
			for r := lo; r < hi; r++ {
				for i, v := range d[r*n : (r+1)*n] {
					p[i] += float64(v)
				}
			}
		})
		for wk := 0; wk < b.threads; wk++ {
			for i := 0; i < n; i++ {
				db[i] += float32(part[wk*n+i])
			}
		}
	}
}

// EmbedBackward implements compute.Backend. Serial: two tokens with the
// same id would race, and this is O(n·dim), negligible.
func (*Backend) EmbedBackward(dtable, dout, ids compute.Tensor, n, dim int) {
	dt, d, id := f32(dtable), f32(dout), i32(ids)
	for t := 0; t < n; t++ {
		row := dt[int(id[t])*dim : (int(id[t])+1)*dim]
		C.k_add(fp(row), fp(d[t*dim:]), C.long(dim))
	}
}

// RMSNormBackward implements compute.Backend.
func (b *Backend) RMSNormBackward(dx, dw, dout, x, w, rstd compute.Tensor, rows, dim int) {
	dxs, dws, d, xs, ws, rs := f32(dx), f32(dw), f32(dout), f32(x), f32(w), f32(rstd)
	part := make([]float64, b.threads*dim)
	b.rows(rows, dim, func(wk, lo, hi int) {
		p := part[wk*dim : (wk+1)*dim]
		C.k_rmsnorm_bwd(fp(dxs[lo*dim:]), (*C.double)(unsafe.Pointer(&p[0])), fp(d[lo*dim:]), fp(xs[lo*dim:]),
			fp(ws), fp(rs[lo:]), C.long(hi-lo), C.long(dim))
	})
	for wk := 0; wk < b.threads; wk++ {
		for i := 0; i < dim; i++ {
			dws[i] += float32(part[wk*dim+i])
		}
	}
}

// SwiGLUBackward implements compute.Backend.
func (b *Backend) SwiGLUBackward(dgate, dup, dout, gate, up compute.Tensor, n int) {
	dg, du, d, g, u := f32(dgate), f32(dup), f32(dout), f32(gate), f32(up)
	b.parallel((n+4095)/4096, func(lo, hi int) {
		x, y := lo*4096, min(hi*4096, n)
		C.k_swiglu_bwd(fp(dg[x:]), fp(du[x:]), fp(d[x:]), fp(g[x:]), fp(u[x:]), C.long(y-x))
	})
}

// AdamW implements compute.Backend.
func (b *Backend) AdamW(p, g, m, v compute.Tensor, n int, s compute.AdamWStep) {
	ps, gs, ms, vs := f32(p), f32(g), f32(m), f32(v)
	b.parallel((n+4095)/4096, func(lo, hi int) {
		x, y := lo*4096, min(hi*4096, n)
		C.k_adamw(fp(ps[x:]), fp(gs[x:]), fp(ms[x:]), fp(vs[x:]), C.long(y-x), C.float(s.Beta1), C.float(s.Beta2),
			C.float(s.Eps), C.float(s.StepSize), C.float(s.BC2Sqrt), C.float(s.Decay))
	})
}

// SumSquares implements compute.Backend.
func (b *Backend) SumSquares(x compute.Tensor, n int) float64 {
	xs := f32(x)[:n]
	part := make([]float64, b.threads)
	b.rows(n, 1, func(wk, lo, hi int) {
		if hi > lo {
			part[wk] += float64(C.k_sumsq(fp(xs[lo:]), C.long(hi-lo)))
		}
	})
	var s float64
	for _, v := range part {
		s += v
	}
	return s
}

// Scale implements compute.Backend.
func (b *Backend) Scale(x compute.Tensor, n int, c float32) {
	xs := f32(x)[:n]
	b.parallel((n+4095)/4096, func(lo, hi int) {
		x, y := lo*4096, min(hi*4096, n)
		C.k_scale(fp(xs[x:]), C.long(y-x), C.float(c))
	})
}

// AbsMax implements compute.Backend.
func (b *Backend) AbsMax(x compute.Tensor, n int) float32 {
	xs := f32(x)[:n]
	part := make([]float32, b.threads)
	b.rows(n, 1, func(wk, lo, hi int) {
		if hi > lo {
			part[wk] = float32(C.k_absmax(fp(xs[lo:]), C.long(hi-lo)))
		}
	})
	var m float32
	for _, v := range part {
		m = max(m, v) // NaN propagates
	}
	if math.IsNaN(float64(m)) {
		return float32(math.NaN())
	}
	return m
}

// FakeQuantNVFP4 implements compute.Backend with compute's scalar NVFP4
// definitions, block by block.
func (b *Backend) FakeQuantNVFP4(dst, src compute.Tensor, rows, cols int, amax float32) {
	d, s := f32(dst), f32(src)
	g := compute.NVFP4GlobalScale(amax)
	bs := compute.NVFP4BlockSize
	b.rows(rows, cols*4, func(_, lo, hi int) {
		for r := lo; r < hi; r++ {
			for b0 := 0; b0 < cols; b0 += bs {
				e := min(b0+bs, cols)
				compute.NVFP4FakeQuantBlock(d[r*cols+b0:r*cols+e], s[r*cols+b0:r*cols+e], g)
			}
		}
	})
}
