package compute

import "math"

// NVFP4 fake quantization, following NVIDIA Model-Optimizer
// (modelopt/torch/quantization: triton/fp4_kernel.py fp4_fake_quant_block
// for the training forward, qtensor/nvfp4_tensor.py for export). Every step
// is ModelOpt's, in fp32:
//
//	g   = amax / (6·448)                     per-tensor scale (weight_scale_2, input_scale)
//	b   = max|x| over 16 consecutive elements of a row (the input dimension)
//	sb  = E4M3(min(b / (6·g'), 448))         g' = g, or 1e-12 when g = 0; E4M3 rounds to nearest even
//	s   = sb · g ;  s = 1 if s < 1e-5        (ModelOpt's guard; also covers all-zero blocks)
//	y   = sign(x) · E2M1(|x| / s) · s        E2M1 ∈ {0,.5,1,1.5,2,3,4,6}, nearest, ties to even, saturating at 6
//
// These scalar definitions are shared by every backend's FakeQuantNVFP4
// and by the export packer (package train/nvfp4), so the exported weights
// equal the fake-quantized ones bit for bit.

// NVFP4BlockSize is the number of elements sharing one E4M3 scale.
const NVFP4BlockSize = 16

// E2M1Values are the magnitudes of the 3-bit E2M1 codes 0..7.
var E2M1Values = [8]float32{0, 0.5, 1, 1.5, 2, 3, 4, 6}

// E2M1 rounds a non-negative scaled magnitude to the nearest E2M1 value,
// ties to the even code, saturating at 6; it returns the value and its
// 3-bit code. The thresholds are ModelOpt's (<= at ties that go down,
// < at ties that go up).
func E2M1(a float32) (float32, uint8) {
	switch {
	case a <= 0.25:
		return 0, 0
	case a < 0.75:
		return 0.5, 1
	case a <= 1.25:
		return 1, 2
	case a < 1.75:
		return 1.5, 3
	case a <= 2.5:
		return 2, 4
	case a < 3.5:
		return 3, 5
	case a <= 5:
		return 4, 6
	}
	return 6, 7
}

// E4M3 rounds x to the nearest float8 E4M3FN value, ties to even,
// saturating at ±448 (the satfinite conversion of the GPU kernels; the
// callers here never pass more than 448 anyway). NaN stays NaN.
func E4M3(x float32) float32 {
	if x != x {
		return x
	}
	a := math.Abs(float64(x))
	if a == 0 {
		return x
	}
	_, e := math.Frexp(a) // a = f·2^e, f in [0.5,1): floor(log2 a) = e-1
	q := e - 1 - 3        // quantum 2^(exponent-3) for normals
	if e-1 < -6 {
		q = -9 // subnormals: multiples of 2^-9
	}
	r := math.Ldexp(math.RoundToEven(math.Ldexp(a, -q)), q)
	r = math.Min(r, 448)
	return float32(math.Copysign(r, float64(x)))
}

// E4M3Byte encodes an E4M3 value (as E4M3 returns) in its byte form; NaN
// is 0x7f (with its sign bit).
func E4M3Byte(v float32) uint8 {
	var s uint8
	if math.Signbit(float64(v)) {
		s = 0x80
	}
	a := math.Abs(float64(v))
	if a == 0 {
		return s
	}
	if a != a {
		return s | 0x7f // E4M3FN's NaN
	}
	if a < 1.0/64 {
		return s | uint8(a*512) // subnormal: mantissa·2^-9
	}
	f, e := math.Frexp(a) // a = (2f)·2^(e-1), 2f in [1,2)
	exp := uint8(e - 1 + 7)
	mant := uint8(math.Round((2*f - 1) * 8))
	return s | exp<<3 | mant
}

// E4M3Value decodes an E4M3FN byte.
func E4M3Value(b uint8) float32 {
	exp, mant := int(b>>3)&15, float64(b&7)
	var v float64
	switch {
	case exp == 15 && mant == 7:
		v = math.NaN()
	case exp == 0:
		v = mant / 512
	default:
		v = math.Ldexp(1+mant/8, exp-7)
	}
	if b&0x80 != 0 {
		v = -v
	}
	return float32(v)
}

// NVFP4GlobalScale is amax/(6·448) in fp32, ModelOpt's per-tensor scale.
func NVFP4GlobalScale(amax float32) float32 { return amax / (6 * 448) }

// NVFP4BlockScale returns the effective scale s of a block with max |x| = b
// under global scale g, and the E4M3 value sb it came from.
func NVFP4BlockScale(b, g float32) (s, sb float32) {
	gs := g
	if !(gs > 0) {
		gs = 1e-12
	}
	sb = E4M3(min(b/(6*gs), 448))
	s = sb * g
	if !(s >= 1e-5) {
		s = 1
	}
	return s, sb
}

// NVFP4FakeQuantBlock fake-quantizes one block src (at most 16 elements;
// a short last block of a row is treated as zero-padded, as the Triton
// kernel does) into dst under global scale g. dst may alias src.
func NVFP4FakeQuantBlock(dst, src []float32, g float32) {
	var bm float32
	for _, v := range src {
		bm = max(bm, float32(math.Abs(float64(v))))
	}
	s, _ := NVFP4BlockScale(bm, g)
	for i, v := range src {
		q, _ := E2M1(float32(math.Abs(float64(v))) / s)
		q *= s
		if v >= 0 {
			dst[i] = q
		} else {
			dst[i] = -q
		}
	}
}
