package compute

import (
	"fmt"
	"math"
)

// The uniforms of LMHeadSample travel as I32 pairs, so that the contract
// needs no float64 tensors and loses no bit: a uniform u in [0, 1) that is
// a multiple of 2^-53 (package cache's DrawUniform draws such) is the
// integer m = u·2^53 < 2^53, stored as its low 32 bits and its high 21
// bits.

// PackUniforms writes u as LMHeadSample's (len(u), 2) I32 pairs into dst
// (2·len(u)). It panics on a u outside [0, 1) or not a multiple of 2^-53.
func PackUniforms(dst []int32, u []float64) {
	for i, x := range u {
		m := x * (1 << 53)
		if !(x >= 0 && x < 1) || m != math.Floor(m) {
			panic(fmt.Sprintf("compute: uniform %d is %v: want a multiple of 2^-53 in [0, 1)", i, x))
		}
		v := uint64(m)
		dst[2*i], dst[2*i+1] = int32(uint32(v)), int32(uint32(v>>32))
	}
}

// Uniform is the uniform of the pair (lo, hi) that PackUniforms wrote.
func Uniform(lo, hi int32) float64 {
	return float64(uint64(uint32(lo))|uint64(uint32(hi))<<32) * (1.0 / (1 << 53))
}

// SampleBlock is the width of the vocabulary blocks in which LMHeadSample's
// backends keep the softmax's partial sums in the pass over the tiles: a
// draw multiplies again the one block its uniform lands in.
const SampleBlock = 64
