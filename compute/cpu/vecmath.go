package cpu

/*
#include "kernels.h"
*/
import "C"

// Vectorized exp-based loops of the loss head's tiles, on the calling
// goroutine. exp is the kernels' float32
// polynomial (about 1 ulp; TestFastExp), inputs clamped to [-87, 88].

// sumExp returns Σ exp(x[i]·scale - shift), accumulated in float64.
func sumExp(x []float32, scale, shift float32) float64 {
	if len(x) == 0 {
		return 0
	}
	return float64(C.k_sumexp(fp(x), C.long(len(x)), C.float(scale), C.float(shift)))
}

// scaledExp sets out[i] = mul·exp(x[i]·scale - shift); out may alias x.
func scaledExp(out, x []float32, scale, shift, mul float32) {
	if len(x) == 0 {
		return
	}
	_ = out[len(x)-1]
	C.k_scaled_exp(fp(out), fp(x), C.long(len(x)), C.float(scale), C.float(shift), C.float(mul))
}

// expMix sets out[i] = a·exp(x[i]·s1 - h1) + b·exp(x[i] - h2); out may
// alias x.
func expMix(out, x []float32, s1, h1, a, h2, b float32) {
	if len(x) == 0 {
		return
	}
	_ = out[len(x)-1]
	C.k_exp_mix(fp(out), fp(x), C.long(len(x)), C.float(s1), C.float(h1), C.float(a), C.float(h2), C.float(b))
}
