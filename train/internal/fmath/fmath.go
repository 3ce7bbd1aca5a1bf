// Package fmath holds the float32 elementwise math that the student's hot
// loops need (softmax over the vocabulary and over attention rows runs
// billions of exps per step): Exp is a float32 Cephes-style polynomial,
// within 2 ulp of the correctly rounded result, about 5x faster than
// float32(math.Exp(float64(x))).
package fmath

import "math"

const (
	log2e = 1.44269504088896341
	ln2hi = 0.693359375
	ln2lo = -2.12194440e-4
)

// Exp returns e^x in float32. Inputs outside [-87, 88] (where 2^n would
// leave the normal range) and NaN take the float64 path.
func Exp(x float32) float32 {
	if !(x >= -87 && x <= 88) {
		return float32(math.Exp(float64(x)))
	}
	// x = n·ln2 + r, |r| <= ln2/2; ln2 split in two so n·ln2hi is exact.
	t := x*log2e + 0.5
	n := int32(t)
	if float32(n) > t {
		n--
	}
	fn := float32(n)
	r := x - fn*ln2hi
	r -= fn * ln2lo
	z := r * r
	y := ((((1.9875691500e-4*r+1.3981999507e-3)*r+8.3334519073e-3)*r+4.1665795894e-2)*r+1.6666665459e-1)*r + 5.0000001201e-1
	y = y*z + r + 1
	return y * math.Float32frombits(uint32(n+127)<<23)
}
