package computetest

import (
	"math"
	"math/rand/v2"
	"testing"

	"distill/compute"
)

// loraLinear checks compute.LoRA, a LoRA adapter composed of the
// contract's kernels, with the frozen base Linear it rides on (MatMul,
// and MatMulBackward with a nil dw), without dropout and with PEFT's
// lora_dropout on the adapter's input (Dropout, DropoutBackward, p 0.3,
// the mask fixed):
//
//	y = x·Wᵀ + s·(drop(x)·Aᵀ)·Bᵀ,  L = Σ R·y,  drop(x) = mask·x/(1-p)
//
// against the float64 formula and, on an fp32 backend, central finite
// differences of L w.r.t. x, A and B (drop is linear in x for a fixed
// mask, so the differences of x see its backward). A BF16GEMM backend rounds every
// GEMM operand (x, W, A, B, the rank-sized x·Aᵀ, dout and its products)
// and its BF16 output twice (the base GEMM, then the add): its results
// are held norm-wise, |got - want| <= 2^-6·max|want| per tensor.
func (s *suite) loraLinear(t *testing.T) {
	t.Run("NoDropout", func(t *testing.T) { s.loraCase(t, 0) })
	t.Run("Dropout", func(t *testing.T) { s.loraCase(t, 0.3) })
}

func (s *suite) loraCase(t *testing.T, p float64) {
	be := s.be
	r := rand.New(rand.NewPCG(28, 1))
	m, in, out, rank := 96, 48, 40, 8
	scale := float32(16) / float32(rank) // lora_alpha 16
	x, w := randn(r, m*in, 1), randn(r, out*in, 0.3)
	a, b := randn(r, rank*in, 0.2), randn(r, out*rank, 0.2) // B non-zero: trained, not fresh
	R := randn(r, m*out, 1)
	xt, x := s.actIn(x)
	wt, at, bt := be.FromF32(w), be.FromF32(a), be.FromF32(b)
	da0, db0, dx0 := randn(r, rank*in, 1), randn(r, out*rank, 1), randn(r, m*in, 1)
	l := &compute.LoRA{A: at, B: bt, DA: be.FromF32(da0), DB: be.FromF32(db0), Rank: rank, In: in, Out: out, Scale: scale}
	tS, dtS, uS := be.New(compute.F32, m*rank), be.New(compute.F32, m*rank), be.New(compute.F32, m*out)

	// The adapter's input: x, or its dropout (in the activation dtype, as
	// the decoder keeps it) and the mask's factor of each element.
	d := compute.NewDropoutMask(0x0123_4567_89ab_cdef, 3, 2, p)
	xat, xa, keep := xt, x, make([]float64, m*in)
	for i := range keep {
		keep[i] = 1
	}
	if p > 0 {
		xat = s.actOut(m * in)
		be.Dropout(xat, xt, &d, m, in)
		xa = make([]float32, m*in)
		kept := 0
		for i := range xa {
			if d.Keep(i/in, i%in) {
				xa[i], keep[i] = x[i]*d.Scale, float64(d.Scale)
				kept++
			} else {
				keep[i] = 0
			}
		}
		if s.act != compute.F32 {
			xa = bf16(xa)
		}
		if kept == 0 || kept == m*in {
			t.Fatalf("the mask keeps %d of %d elements at p %g", kept, m*in, p)
		}
	}
	drop := func(xd []float64) []float64 {
		o := make([]float64, len(xd))
		for i := range xd {
			o[i] = xd[i] * keep[i]
		}
		return o
	}

	yt := s.actOut(m * out)
	be.MatMul(yt, xt, wt, nil, m, out, in)
	l.Forward(be, yt, xat, tS, uS, m)
	y := s.read(yt, m*out)

	// The float64 formula, on what a BF16GEMM backend multiplies: x
	// through the base, xa (the adapter's input) through the adapter.
	fwd := func(xd, xad, wd, ad, bd []float64, round bool) []float64 {
		base := linear(xd, wd, nil, in, out)
		tt := linear(xad, ad, nil, in, rank)
		for i := range tt {
			tt[i] *= float64(scale)
			if round {
				tt[i] = float64(compute.BF16ToF32(compute.F32ToBF16(float32(tt[i]))))
			}
		}
		lo := linear(tt, bd, nil, rank, out)
		for i := range base {
			base[i] += lo[i]
		}
		return base
	}
	bf := s.tol.BF16GEMM || s.act != compute.F32
	if bf {
		want := fwd(f64(s.gemmIn(x)), f64(s.gemmIn(xa)), f64(s.gemmIn(w)), f64(s.gemmIn(a)), f64(s.gemmIn(b)), s.tol.BF16GEMM)
		closeNorm(t, "y", y, want, 1.0/64)
	} else {
		s.fwd(t, "y", y, fwd(f64(x), f64(xa), f64(w), f64(a), f64(b), false))
	}
	if s.forwardOnly {
		return
	}

	dxt, Rt := be.FromF32(dx0), be.FromF32(R)
	be.MatMulBackward(dxt, nil, nil, Rt, xt, wt, m, out, in) // the frozen base: no dw
	if p > 0 {
		// The decoder's order: the adapter's dx into a zeroed scratch,
		// then through the dropout's backward into dx.
		dxa := be.New(compute.F32, m*in)
		l.Backward(be, dxa, Rt, xat, tS, dtS, m)
		be.DropoutBackward(dxt, dxa, &d, m, in)
	} else {
		l.Backward(be, dxt, Rt, xt, tS, dtS, m)
	}
	dx, da, db := s.read(dxt, m*in), s.read(l.DA, rank*in), s.read(l.DB, out*rank)

	xd, wd, ad, bd, Rd := f64(x), f64(w), f64(a), f64(b), f64(R)
	f := func() float64 { return dot(fwd(xd, drop(xd), wd, ad, bd, false), Rd) }
	if bf {
		// The analytic gradients in float64 (the finite differences of
		// the unrounded f would measure BF16's rounding, not the code).
		xad := f64(xa)
		tt := linear(xad, ad, nil, in, rank) // (m, r) xa·Aᵀ
		dt := make([]float64, m*rank)        // s·R·B
		for i := 0; i < m; i++ {
			for k := 0; k < rank; k++ {
				var g float64
				for o := 0; o < out; o++ {
					g += Rd[i*out+o] * bd[o*rank+k]
				}
				dt[i*rank+k] = float64(scale) * g
			}
		}
		wantDX, wantDA, wantDB := make([]float64, m*in), make([]float64, rank*in), make([]float64, out*rank)
		for i := 0; i < m; i++ {
			for c := 0; c < in; c++ {
				g := 0.0
				for o := 0; o < out; o++ {
					g += Rd[i*out+o] * wd[o*in+c]
				}
				var ga float64
				for k := 0; k < rank; k++ {
					ga += dt[i*rank+k] * ad[k*in+c]
					wantDA[k*in+c] += dt[i*rank+k] * xad[i*in+c]
				}
				wantDX[i*in+c] = g + keep[i*in+c]*ga
			}
			for o := 0; o < out; o++ {
				for k := 0; k < rank; k++ {
					wantDB[o*rank+k] += Rd[i*out+o] * float64(scale) * tt[i*rank+k]
				}
			}
		}
		closeNorm(t, "dx", sub(dx, dx0), wantDX, 1.0/64)
		closeNorm(t, "dA", sub(da, da0), wantDA, 1.0/64)
		closeNorm(t, "dB", sub(db, db0), wantDB, 1.0/64)
		return
	}
	s.bwdStrided(t, "dx", dx, dx0, f, xd, 13)
	s.bwdStrided(t, "dA", da, da0, f, ad, 7)
	s.bwdStrided(t, "dB", db, db0, f, bd, 3)
}

// sub returns got - init: what a += kernel added.
func sub(got, init []float32) []float32 {
	out := make([]float32, len(got))
	for i := range got {
		out[i] = got[i] - init[i]
	}
	return out
}

// closeNorm checks got against want norm-wise: max |got - want| <=
// rel·max |want|.
func closeNorm(t *testing.T, name string, got []float32, want []float64, rel float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", name, len(got), len(want))
	}
	var d, w float64
	at := 0
	for i := range got {
		if e := math.Abs(float64(got[i]) - want[i]); !(e <= d) {
			d, at = e, i
		}
		w = max(w, math.Abs(want[i]))
	}
	if !(d <= rel*w) {
		t.Fatalf("%s[%d] = %.8g, want %.8g: max |diff| %.3g > %.3g·max|want| (%.3g)", name, at, got[at], want[at], d, rel, w)
	}
}
