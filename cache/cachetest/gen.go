// Package cachetest generates synthetic but realistic teacher top-k
// distributions for the cache's tests and benchmarks, and the matching
// student log-probs for KD-loss checks.
//
// The generator (documented because the cache's size figures depend on it):
//
//   - Token frequency ranks follow Zipf's law: the base logit of the token
//     of frequency rank r (0-based) is -Alpha*ln(r+1), Alpha = 1.1.
//   - Rank -> token id: with IDOrder "bpe" a token's id is correlated with
//     its rank as in BPE vocabularies (ids are sorted by ln(1+rank) plus
//     Gaussian noise of sd 1.5, so frequent tokens have smallish ids but
//     not in order); with "random" the map is a uniform permutation (the
//     worst case for id compression).
//   - Each position adds context: 1 to 4 context tokens of log-uniform
//     rank get logit boosts drawn from U(4,14), U(2,8), ... (the first is
//     the strongest), which makes the distributions peaked (top-1
//     probability mostly 0.3-0.99) as a trained LM's are; every one of
//     the Exact most frequent tokens gets Gaussian noise of sd 1.5.
//   - The log-sum-exp over the vocabulary is exact over the Exact most
//     frequent tokens and the boosted ones, plus the expectation
//     sum exp(b_r + sd^2/2) over the remaining tail (those tokens cannot
//     reach the top-k at these settings).
//   - The student's logits are the teacher's plus independent noise of sd
//     1.0 with the boosts scaled by 0.7: a decent but imperfect student,
//     forward KL of roughly 0.1-1 nat per position.
package cachetest

import (
	"math"
	"math/rand/v2"
	"sort"
)

// Gen generates positions; it is not safe for concurrent use.
type Gen struct {
	// V and K are the vocabulary size and the top-k.
	V, K int
	// Exact is how many of the most frequent tokens get explicit noisy
	// logits (the rest enter only the log-sum-exp); lower is faster.
	Exact int
	// Alpha is the Zipf exponent of the base logits.
	Alpha   float64
	idOf    []int32 // rank -> token id
	base    []float64
	tailLSE float64 // log of the expected tail mass (teacher), ranks >= Exact
	tailQ   float64 // same for the student
	rng     *rand.Rand
	zt, zs  []float64
	idx     []int32
}

// New returns a generator for vocab v and top-k k. idOrder is "bpe" or
// "random" (see the package doc).
func New(v, k int, idOrder string, seed uint64) *Gen {
	g := &Gen{V: v, K: k, Exact: min(16384, v), Alpha: 1.1}
	rng := rand.New(rand.NewPCG(seed, 1))
	keys := make([]float64, v)
	ids := make([]int32, v)
	for i := range keys {
		ids[i] = int32(i)
		if idOrder == "random" {
			keys[i] = rng.Float64()
		} else {
			keys[i] = math.Log1p(float64(i)) + 1.5*rng.NormFloat64()
		}
	}
	sort.Slice(ids, func(a, b int) bool { return keys[ids[a]] < keys[ids[b]] })
	g.idOf = ids
	g.base = make([]float64, v)
	for r := range g.base {
		g.base[r] = -g.Alpha * math.Log(float64(r+1))
	}
	var tt, tq float64
	for r := g.Exact; r < v; r++ {
		tt += math.Exp(g.base[r] + 1.5*1.5/2)
		tq += math.Exp(g.base[r] + (1.5*1.5+1)/2)
	}
	g.tailLSE, g.tailQ = math.Log(tt), math.Log(tq)
	if g.Exact == v {
		g.tailLSE, g.tailQ = math.Inf(-1), math.Inf(-1)
	}
	g.rng = rand.New(rand.NewPCG(seed, 2))
	g.zt, g.zs = make([]float64, g.Exact), make([]float64, g.Exact)
	g.idx = make([]int32, g.Exact)
	return g
}

func logAdd(a, b float64) float64 {
	if a < b {
		a, b = b, a
	}
	if math.IsInf(b, -1) {
		return a
	}
	return a + math.Log1p(math.Exp(b-a))
}

// Position fills ids (K), teacher log-probs lp (K) sorted descending, and
// the student's log-probs lq at those ids plus its tail log-mass.
func (g *Gen) Position(ids []int32, lp []float32, lq []float64) (lqTail float64) {
	rng := g.rng
	for r := 0; r < g.Exact; r++ {
		n1, n2 := rng.NormFloat64(), rng.NormFloat64()
		g.zt[r] = g.base[r] + 1.5*n1
		g.zs[r] = g.zt[r] + n2
	}
	type boost struct {
		r int
		b float64
	}
	var boosts []boost
	nb := 1 + rng.IntN(4)
	hi := 14.0
	for i := 0; i < nb; i++ {
		r := int(math.Exp(rng.Float64()*math.Log(float64(g.V)))) - 1
		if r >= g.Exact {
			r = rng.IntN(g.Exact) // keep boosted tokens in the exact set
		}
		b := hi/3.5 + rng.Float64()*(hi-hi/3.5)
		hi /= 1.75
		boosts = append(boosts, boost{r, b})
	}
	for _, bo := range boosts {
		g.zt[bo.r] += bo.b
		g.zs[bo.r] += 0.7 * bo.b
	}
	lseT, lseS := g.tailLSE, g.tailQ
	mt, ms := math.Inf(-1), math.Inf(-1)
	for r := 0; r < g.Exact; r++ {
		mt, ms = max(mt, g.zt[r]), max(ms, g.zs[r])
	}
	var st, ss float64
	for r := 0; r < g.Exact; r++ {
		st += math.Exp(g.zt[r] - mt)
		ss += math.Exp(g.zs[r] - ms)
	}
	lseT = logAdd(lseT, mt+math.Log(st))
	lseS = logAdd(lseS, ms+math.Log(ss))
	top := g.topK()
	qsum := 0.0
	for j := 0; j < g.K; j++ {
		r := top[j]
		ids[j] = g.idOf[r]
		lp[j] = float32(g.zt[r] - lseT)
		lq[j] = g.zs[r] - lseS
		qsum += math.Exp(lq[j])
	}
	for j := 1; j < g.K; j++ { // float32 rounding must not break the order
		lp[j] = min(lp[j], lp[j-1])
	}
	return math.Log(max(1-qsum, 1e-300))
}

// topK returns the ranks of the K largest teacher logits, descending,
// using a size-K min-heap (most candidates fail the first comparison).
func (g *Gen) topK() []int32 {
	K, z := g.K, g.zt
	h := g.idx[:0]
	less := func(a, b int32) bool { return z[a] < z[b] }
	down := func(i int) {
		for {
			l := 2*i + 1
			if l >= len(h) {
				return
			}
			if r := l + 1; r < len(h) && less(h[r], h[l]) {
				l = r
			}
			if !less(h[l], h[i]) {
				return
			}
			h[i], h[l] = h[l], h[i]
			i = l
		}
	}
	for r := int32(0); int(r) < g.Exact; r++ {
		if len(h) < K {
			h = append(h, r)
			for i := len(h) - 1; i > 0; {
				p := (i - 1) / 2
				if !less(h[i], h[p]) {
					break
				}
				h[i], h[p] = h[p], h[i]
				i = p
			}
			continue
		}
		if z[r] > z[h[0]] {
			h[0] = r
			down(0)
		}
	}
	sort.Slice(h, func(a, b int) bool { return z[h[a]] > z[h[b]] })
	return h
}

// Sample is a generated sample: the fields of a cache.Sample (this package
// does not import cache so that cache's own tests can use it) plus the
// student's log-probs at the teacher's top-k ids, (T, K), and the
// student's log tail mass, (T).
type Sample struct {
	Tokens       []int32   // (T) token ids; each next token is drawn from the teacher
	Mask         []uint8   // (T) 0 for the first 30% (the "prompt"), then 1
	TopKIDs      []int32   // (T, K) teacher top-k ids
	TopKLogProbs []float32 // (T, K) teacher log-probs over the full vocab
	LQ           []float64 // (T, K) student log-probs at TopKIDs
	LQTail       []float64 // (T) student log of the mass outside TopKIDs
}

// Sample generates a sample of T positions.
func (g *Gen) Sample(T int) Sample {
	K := g.K
	s := Sample{Tokens: make([]int32, T), Mask: make([]uint8, T),
		TopKIDs: make([]int32, T*K), TopKLogProbs: make([]float32, T*K)}
	lq, lqTail := make([]float64, T*K), make([]float64, T)
	s.LQ, s.LQTail = lq, lqTail
	prompt := T * 3 / 10
	s.Tokens[0] = g.idOf[g.rng.IntN(100)]
	for t := 0; t < T; t++ {
		lqTail[t] = g.Position(s.TopKIDs[t*K:(t+1)*K], s.TopKLogProbs[t*K:(t+1)*K], lq[t*K:(t+1)*K])
		if t >= prompt {
			s.Mask[t] = 1
		}
		if t+1 < T { // next token sampled from the teacher's top-k
			u := g.rng.Float64() * 0.999
			j, acc := 0, 0.0
			for ; j < K-1; j++ {
				acc += math.Exp(float64(s.TopKLogProbs[t*K+j]))
				if acc > u {
					break
				}
			}
			s.Tokens[t+1] = s.TopKIDs[t*K+j]
		}
	}
	return s
}
