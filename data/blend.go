package data

import (
	"math"
	"math/bits"
	"sort"

	"distill/internal/errkind"
)

// permutation is a seeded pseudo-random bijection of [0, n), evaluated in
// O(1) time and memory: a 4-round Feistel network over the smallest even
// number of bits covering n, cycle-walking values that land outside [0, n).
// Only integer operations are used, so it is identical on every platform.
type permutation struct {
	n    uint64
	half uint   // bits per Feistel half
	key  uint64 // round-key seed
}

func newPermutation(n uint64, key uint64) permutation {
	b := uint(bits.Len64(n - 1))
	if n <= 1 {
		b = 0
	}
	b = (b + 1) / 2
	if b == 0 {
		b = 1
	}
	return permutation{n: n, half: b, key: key}
}

// splitmix64 is the SplitMix64 finalizer, the round function.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

func (p permutation) apply(x uint64) uint64 {
	if p.n <= 1 {
		return x
	}
	mask := uint64(1)<<p.half - 1
	for {
		l, r := x>>p.half, x&mask
		for round := uint64(0); round < 4; round++ {
			l, r = r, l^(splitmix64(p.key^(round<<56)^r)&mask)
		}
		x = l<<p.half | r
		if x < p.n {
			return x
		}
	}
}

// blend interleaves weighted sources deterministically, like Megatron-LM's
// BlendedDataset: weights are quantized to integer shares W_d with period
// S = sum(W_d); every period of S samples holds exactly W_d samples of
// source d, placed by the greedy rule "next slot goes to the source furthest
// behind its target share" (ties to the lower source). So every prefix of
// the index is within one sample per source of the exact proportions, and
// sample i is located in O(1) from the period pattern.
type blend struct {
	shares  []int64
	pattern []uint16 // pattern[o] = source of slot o of a period
	rank    []int64  // rank[o] = how many earlier slots of the period are the same source
}

// maxBlendSources bounds the number of sources of a blend (pattern entries
// are uint16).
const maxBlendSources = 1 << 16

// blendPeriodLimit bounds the period S; weights that are not simple ratios
// are quantized to shares of 1<<16.
const blendPeriodLimit = 1 << 20

// quantizeWeights turns positive weights into integer shares. Weights that
// are integers after scaling by 1, 10, ..., 10^6 (1:2:3, 0.3/0.7, 0.125)
// are used exactly; others are rounded to shares of 65536 (each at least 1).
// The shares are divided by their gcd, so 0.5/0.5 gives period 2.
func quantizeWeights(w []float64) ([]int64, error) {
	var sum float64
	for i, x := range w {
		if !(x > 0) || math.IsInf(x, 0) {
			return nil, errkind.Errorf(ErrOptions, "source %d: weight %v must be a positive finite number", i, x)
		}
		sum += x
	}
	shares := make([]int64, len(w))
	exact := false
	for scale := 1.0; scale <= 1e6 && !exact; scale *= 10 {
		var total float64
		exact = true
		for i, x := range w {
			s := x * scale
			if math.Abs(s-math.Round(s)) > 1e-9*math.Max(1, s) {
				exact = false
				break
			}
			shares[i] = int64(math.Round(s))
			total += math.Round(s)
		}
		if exact && total > blendPeriodLimit {
			exact = false
			break
		}
	}
	if !exact {
		for i, x := range w {
			shares[i] = max(1, int64(math.Round(x/sum*(1<<16))))
		}
	}
	g := shares[0]
	for _, s := range shares[1:] {
		for b := s; b != 0; {
			g, b = b, g%b
		}
	}
	for i := range shares {
		shares[i] /= g
	}
	return shares, nil
}

func newBlend(weights []float64) (*blend, error) {
	if len(weights) > maxBlendSources {
		return nil, errkind.Errorf(ErrOptions, "%d sources, at most %d", len(weights), maxBlendSources)
	}
	shares, err := quantizeWeights(weights)
	if err != nil {
		return nil, err
	}
	var period int64
	for _, s := range shares {
		period += s
	}
	b := &blend{shares: shares, pattern: make([]uint16, period), rank: make([]int64, period)}
	count := make([]int64, len(shares))
	for o := int64(0); o < period; o++ {
		// error_d = W_d*(o+1)/S - count_d, compared without division.
		best, bestErr := 0, int64(math.MinInt64)
		for d, s := range shares {
			if e := s*(o+1) - period*count[d]; e > bestErr {
				best, bestErr = d, e
			}
		}
		b.pattern[o] = uint16(best)
		b.rank[o] = count[best]
		count[best]++
	}
	return b, nil
}

// locate returns the source of sample i and how many earlier samples came
// from that source (its position in the source's stream).
func (b *blend) locate(i int64) (int, int64) {
	period := int64(len(b.pattern))
	p, o := i/period, i%period
	d := b.pattern[o]
	return int(d), p*b.shares[d] + b.rank[o]
}

// concat maps sample i of concatenated sources to (source, position in the
// source's stream). Past the total, the concatenation repeats (epochs).
type concat struct{ starts []int64 } // starts[d] = first sample of source d; starts[len] = total

func (c concat) locate(i int64) (int, int64) {
	total := c.starts[len(c.starts)-1]
	epoch, r := i/total, i%total
	d := sort.Search(len(c.starts)-1, func(k int) bool { return c.starts[k+1] > r })
	return d, epoch*(c.starts[d+1]-c.starts[d]) + r - c.starts[d]
}

// Order is a seeded pseudo-random permutation of [0, n), evaluated in O(1)
// time and memory: the keyed Feistel permutation that Options.Shuffle uses.
// The student trainer visits a dataset's index in a new Order every epoch
// without materializing it.
type Order struct{ p permutation }

// NewOrder returns the permutation of [0, n) that seed selects.
func NewOrder(n int64, seed uint64) Order {
	return Order{newPermutation(uint64(max(n, 0)), splitmix64(seed^0x6f72646572))}
}

// At returns the i-th element of the order, for 0 <= i < n.
func (o Order) At(i int64) int64 { return int64(o.p.apply(uint64(i))) }
