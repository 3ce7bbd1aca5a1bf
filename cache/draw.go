package cache

import (
	"crypto/sha256"
	"encoding/binary"
	"math"
	"slices"
	"sort"
)

// The draws of the sampled kinds are reproducible (package doc, Draws):
// draw d at position t of sample i uses the uniform
// DrawUniform(DrawKey(dataset fingerprint), i, t, d), a pure function of
// its counter, so any node that fills the range draws the same ids wherever
// the teacher's probabilities agree, and no RNG state crosses chunks,
// batches or processes.

// DrawKey is the RNG key of a dataset: the first 8 bytes, little-endian,
// of SHA-256("distill.draws\x00" + fingerprint) (format).
func DrawKey(datasetFingerprint string) uint64 {
	h := sha256.Sum256([]byte("distill.draws\x00" + datasetFingerprint))
	return binary.LittleEndian.Uint64(h[:8])
}

// splitmix64 is SplitMix64's output function (Steele, Lea and Flood 2014)
// on x + golden gamma: a bijection whose outputs pass BigCrush as a
// counter-based generator (format).
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// DrawUniform is the uniform in [0, 1) of draw d at position t of sample
// i (format):
//
//	h = splitmix64(splitmix64(splitmix64(key ^ i) ^ t) ^ d)
//	u = (h >> 11) / 2^53
func DrawUniform(key uint64, sample int64, t, d int) float64 {
	h := splitmix64(key ^ uint64(sample))
	h = splitmix64(h ^ uint64(t))
	h = splitmix64(h ^ uint64(d))
	return float64(h>>11) * (1.0 / (1 << 53))
}

// Tally turns one position's drawn ids into distinct ids and counts in
// the stored order (descending count, ties ascending id), appended to ids
// and counts. drawn is sorted in place (a fill's draws come ascending:
// slices.Sort passes over them once).
func Tally(drawn []int32, ids, counts []int32) ([]int32, []int32) {
	slices.Sort(drawn)
	n0 := len(ids)
	for a := 0; a < len(drawn); {
		b := a
		for b < len(drawn) && drawn[b] == drawn[a] {
			b++
		}
		ids, counts = append(ids, drawn[a]), append(counts, int32(b-a))
		a = b
	}
	pi, pc := ids[n0:], counts[n0:]
	if len(pi) > tallyInsertion {
		sort.Sort(byCount{pi, pc})
		return ids, counts
	}
	// The ids come ascending: an insertion sort by count that moves an
	// entry only past smaller counts keeps ties in id order (a few dozen
	// distinct ids a position, most counts small; sort.Sort's interface
	// calls cost more than the moves).
	for i := 1; i < len(pi); i++ {
		id, c := pi[i], pc[i]
		j := i
		for ; j > 0 && pc[j-1] < c; j-- {
			pi[j], pc[j] = pi[j-1], pc[j-1]
		}
		pi[j], pc[j] = id, c
	}
	return ids, counts
}

// tallyInsertion is the most distinct ids Tally sorts by insertion (its
// moves grow as the square of the count).
const tallyInsertion = 64

type byCount struct{ ids, counts []int32 }

func (s byCount) Len() int { return len(s.ids) }
func (s byCount) Less(a, b int) bool {
	if s.counts[a] != s.counts[b] {
		return s.counts[a] > s.counts[b]
	}
	return s.ids[a] < s.ids[b]
}
func (s byCount) Swap(a, b int) {
	s.ids[a], s.ids[b] = s.ids[b], s.ids[a]
	s.counts[a], s.counts[b] = s.counts[b], s.counts[a]
}

// DenseK is the row width of Dense: k, plus N for the sampled kinds.
func (m *Manifest) DenseK() int { return m.K + m.Draws }

// Dense returns s with its targets as fixed-width rows, the form of the
// top-k rows a trainer packs: TopKIDs and TopKLogProbs (T, DenseK) hold,
// per position, the head (its log-probs as stored), then the drawn ids
// with log r, r = count/N (sampled) or TailMass·count/N (head+sampled),
// then distinct padding ids (the lowest not in the row) at r = 0, log r =
// -Inf. A topk sample is returned as it is.
func Dense(m *Manifest, s Sample) Sample {
	if !m.Sampled() {
		return s
	}
	T, K, W := len(s.Tokens), m.K, m.DenseK()
	ids, lps := make([]int32, T*W), make([]float32, T*W)
	off := 0
	for t := 0; t < T; t++ {
		row, lr := ids[t*W:(t+1)*W], lps[t*W:(t+1)*W]
		copy(row, s.TopKIDs[t*K:(t+1)*K])
		copy(lr, s.TopKLogProbs[t*K:(t+1)*K])
		mass := 1.0
		if s.TailMass != nil {
			mass = float64(s.TailMass[t])
		}
		n := int(s.DrawN[t])
		for j := 0; j < n; j++ {
			row[K+j] = s.DrawIDs[off+j]
			lr[K+j] = float32(math.Log(mass * float64(s.DrawCounts[off+j]) / float64(m.Draws)))
		}
		off += n
		cand := int32(0)
		for j := K + n; j < W; j++ {
			for slices.Contains(row[:j], cand) {
				cand++
			}
			row[j], lr[j] = cand, float32(math.Inf(-1))
			cand++
		}
	}
	s.TopKIDs, s.TopKLogProbs = ids, lps
	return s
}
