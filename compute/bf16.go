package compute

import "math"

// BF16ToF32 widens a bfloat16 (the high half of a float32) exactly.
func BF16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// F32ToBF16 rounds a float32 to the nearest bfloat16, ties to even, as
// torch's .to(torch.bfloat16) does. NaN stays NaN (quiet); ±Inf stays ±Inf.
func F32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN: keep sign, force a quiet payload
		return uint16(b>>16) | 0x40
	}
	// Add 0x7fff plus the lowest kept bit: rounds half to even; overflow of
	// the exponent correctly produces Inf.
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// WidenBF16 converts src to float32 into dst (len(dst) >= len(src)).
func WidenBF16(dst []float32, src []uint16) {
	dst = dst[:len(src)]
	for i, h := range src {
		dst[i] = math.Float32frombits(uint32(h) << 16)
	}
}

// NarrowBF16 rounds src to bfloat16 into dst, ties to even.
func NarrowBF16(dst []uint16, src []float32) {
	dst = dst[:len(src)]
	for i, f := range src {
		dst[i] = F32ToBF16(f)
	}
}

// F16ToF32 widens an IEEE half exactly (subnormals, Inf and NaN included).
func F16ToF32(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exp := uint32(h>>10) & 0x1f
	man := uint32(h) & 0x3ff
	switch {
	case exp == 0 && man == 0:
		return math.Float32frombits(sign)
	case exp == 0: // subnormal: value = man * 2^-24
		f := float32(man) * (1.0 / (1 << 24))
		if sign != 0 {
			f = -f
		}
		return f
	case exp == 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	}
	return math.Float32frombits(sign | (exp+112)<<23 | man<<13)
}
