package cachetest

import (
	"math"
	"math/rand/v2"
	"sort"
)

// Dist is a random next-token distribution over V ids for tests of the
// sampled kinds: Zipf weights 1/(r+1)^1.1 over a random permutation of the
// ids, times a random peak on one of them (so positions differ in their
// entropy), normalized in float64.
func Dist(V int, seed uint64) []float64 {
	rng := rand.New(rand.NewPCG(seed, 0x5a3d))
	perm := rng.Perm(V)
	p := make([]float64, V)
	var s float64
	for r, id := range perm {
		w := 1 / math.Pow(float64(r+1), 1.1)
		if r == 0 {
			w *= 1 + 20*rng.Float64()
		}
		p[id] = w
		s += w
	}
	for i := range p {
		p[i] /= s
	}
	return p
}

// Head is the top-k of p: ids by descending probability (ties: ascending
// id) and their log-probs as float32.
func Head(p []float64, k int) ([]int32, []float32) {
	ids := make([]int32, len(p))
	for i := range ids {
		ids[i] = int32(i)
	}
	sort.SliceStable(ids, func(a, b int) bool { return p[ids[a]] > p[ids[b]] })
	ids = ids[:k]
	lps := make([]float32, k)
	for j, id := range ids {
		lps[j] = float32(math.Log(p[id]))
	}
	return ids, lps
}

// Draws is the reference of the sampled kinds' draws, written from the
// cache package doc: draw d is the smallest id v outside head whose
// cumulative probability (ids ascending, head left out, float64) exceeds
// u(d) times the mass outside head. It returns the drawn ids in draw order
// and that mass.
func Draws(p []float64, head []int32, N int, u func(d int) float64) ([]int32, float64) {
	in := map[int32]bool{}
	for _, id := range head {
		in[id] = true
	}
	var tail float64
	for v, pv := range p {
		if !in[int32(v)] {
			tail += pv
		}
	}
	out := make([]int32, N)
	for d := range out {
		x := u(d) * tail
		var cum float64
		last := int32(-1)
		out[d] = -1
		for v, pv := range p {
			if in[int32(v)] || pv == 0 {
				continue
			}
			last = int32(v)
			cum += pv
			if cum > x {
				out[d] = int32(v)
				break
			}
		}
		if out[d] < 0 {
			out[d] = last // rounding at u near 1: the last id with mass
		}
	}
	return out, tail
}
