package cache

import (
	"math"
	"testing"

	"distill/cache/cachetest"
)

const qwenVocab = 151936

type genChunk struct {
	m       Manifest
	samples []Sample
	lq      [][]float64
	lqTail  [][]float64
}

func makeChunk(t testing.TB, enc Encoding, idOrder string, V, K, n, T int, seed uint64) genChunk {
	t.Helper()
	g := cachetest.New(V, K, idOrder, seed)
	gc := genChunk{m: Manifest{FormatVersion: FormatVersion, TeacherFingerprint: "t", TokenizerFingerprint: "tok",
		DatasetFingerprint: "d", VocabSize: V, K: K, Temperature: 1, Samples: int64(n), Encoding: enc}}
	for i := 0; i < n; i++ {
		gs := g.Sample(T)
		s := Sample{Index: int64(i), Tokens: gs.Tokens, Mask: gs.Mask, TopKIDs: gs.TopKIDs, TopKLogProbs: gs.TopKLogProbs}
		lq, lqt := gs.LQ, gs.LQTail
		if err := validateSample(&gc.m, &s); err != nil {
			t.Fatal(err)
		}
		gc.samples = append(gc.samples, s)
		gc.lq = append(gc.lq, lq)
		gc.lqTail = append(gc.lqTail, lqt)
	}
	return gc
}

func roundTrip(t testing.TB, gc genChunk) ([]byte, []Sample) {
	t.Helper()
	r := Range{0, int64(len(gc.samples))}
	data, err := encodeChunk(&gc.m, r, gc.samples)
	if err != nil {
		t.Fatal(err)
	}
	c, err := decodeChunk(data, &gc.m, ChunkInfo{Range: r, File: "test"})
	if err != nil {
		t.Fatal(err)
	}
	out := make([]Sample, len(gc.samples))
	for i := range out {
		if err := c.sample(i, &out[i]); err != nil {
			t.Fatal(err)
		}
	}
	return data, out
}

// kdLoss is the forward KL with a tail bucket, in float64, averaged over
// masked positions: sum_K p (log p - log q) + p_tail log(p_tail / q_tail).
func kdLoss(gc genChunk, lps func(i int) []float32) (mean float64, perPos []float64) {
	K := gc.m.K
	var sum float64
	var n int
	for i, s := range gc.samples {
		lp := lps(i)
		for t := range s.Tokens {
			if s.Mask[t] == 0 {
				continue
			}
			kl, pm := 0.0, 0.0
			for j := 0; j < K; j++ {
				p := math.Exp(float64(lp[t*K+j]))
				pm += p
				kl += p * (float64(lp[t*K+j]) - gc.lq[i][t*K+j])
			}
			if pt := 1 - pm; pt > 1e-12 {
				kl += pt * (math.Log(pt) - gc.lqTail[i][t])
			}
			sum += kl
			n++
			perPos = append(perPos, kl)
		}
	}
	return sum / float64(n), perPos
}

func TestLosslessRoundTrip(t *testing.T) {
	gc := makeChunk(t, EncodingLossless, "random", 5000, 16, 6, 40, 1)
	gc.samples[2].TopKLogProbs[16*3+15] = float32(math.Inf(-1)) // bit-exact even for -inf
	_, out := roundTrip(t, gc)
	for i, s := range gc.samples {
		o := out[i]
		if o.Index != s.Index || len(o.Tokens) != len(s.Tokens) {
			t.Fatalf("sample %d: index/len mismatch", i)
		}
		for e := range s.TopKIDs {
			if o.TopKIDs[e] != s.TopKIDs[e] || math.Float32bits(o.TopKLogProbs[e]) != math.Float32bits(s.TopKLogProbs[e]) {
				t.Fatalf("sample %d entry %d: got (%d, %v), want (%d, %v)", i, e, o.TopKIDs[e], o.TopKLogProbs[e], s.TopKIDs[e], s.TopKLogProbs[e])
			}
		}
		for p := range s.Tokens {
			if o.Tokens[p] != s.Tokens[p] || o.Mask[p] != s.Mask[p] {
				t.Fatalf("sample %d position %d: tokens/mask mismatch", i, p)
			}
		}
	}
}

// TestCompactErrorBound checks the documented bound of the compact
// encoding against the float64 difference for every entry: 1/8192 nat for
// the top-1 and 1/128 nat for the others (plus float32 rounding of the
// decoded value), ids exact.
func TestCompactErrorBound(t *testing.T) {
	gc := makeChunk(t, EncodingCompact, "bpe", 20000, 32, 8, 64, 2)
	_, out := roundTrip(t, gc)
	K := gc.m.K
	worst := [2]float64{}
	for i, s := range gc.samples {
		for e := range s.TopKIDs {
			if out[i].TopKIDs[e] != s.TopKIDs[e] {
				t.Fatalf("sample %d entry %d: id %d, want %d", i, e, out[i].TopKIDs[e], s.TopKIDs[e])
			}
			want, got := float64(s.TopKLogProbs[e]), float64(out[i].TopKLogProbs[e])
			bound := 1.0 / 128
			slot := 1
			if e%K == 0 {
				bound, slot = 1.0/8192, 0
			}
			d := math.Abs(got - want)
			worst[slot] = max(worst[slot], d)
			if d > bound+math.Abs(want)*1e-7 {
				t.Fatalf("sample %d position %d slot %d: decoded %v, want %v: error %g > bound %g", i, e/K, e%K, got, want, d, bound)
			}
			if e%K > 0 && got > float64(out[i].TopKLogProbs[e-1]) {
				t.Fatalf("sample %d entry %d: decoded log-probs not sorted", i, e)
			}
		}
	}
	t.Logf("max |error|: top-1 %.2e nat, others %.2e nat", worst[0], worst[1])
	// The bounds are tight: a coarser step would fail this test.
	if worst[1] < 1.0/256 {
		t.Errorf("max error of slots >= 1 is %g, far below the 1/128 step: is the data degenerate?", worst[1])
	}
}

// TestCompactKDLoss: the KD loss from decoded compact values is within
// 0.5% of the loss from the exact float32 values (both in float64).
func TestCompactKDLoss(t *testing.T) {
	gc := makeChunk(t, EncodingCompact, "bpe", qwenVocab, 64, 4, 96, 3)
	_, out := roundTrip(t, gc)
	exact, _ := kdLoss(gc, func(i int) []float32 { return gc.samples[i].TopKLogProbs })
	dec, _ := kdLoss(gc, func(i int) []float32 { return out[i].TopKLogProbs })
	rel := math.Abs(dec-exact) / exact
	t.Logf("KD loss exact %.6f decoded %.6f rel %.2e", exact, dec, rel)
	if rel > 0.005 {
		t.Fatalf("KD loss from compact values off by %.3f%% (> 0.5%%)", 100*rel)
	}
}

// TestEncodingEdges: a chunk with more than 65536 distinct ids (the third
// code plane), K = 1 (no deltas), and compact saturation of -Inf and very
// low log-probs.
func TestEncodingEdges(t *testing.T) {
	const K, T = 64, 1100 // 70400 distinct ids
	m := Manifest{FormatVersion: FormatVersion, TeacherFingerprint: "t", TokenizerFingerprint: "tok", DatasetFingerprint: "d",
		VocabSize: qwenVocab, K: K, Temperature: 1, Samples: 1, Encoding: EncodingCompact}
	s := Sample{Tokens: make([]int32, T), Mask: make([]uint8, T), TopKIDs: make([]int32, T*K), TopKLogProbs: make([]float32, T*K)}
	for e := range s.TopKIDs {
		s.TopKIDs[e] = int32((e * 2) % qwenVocab)
		s.TopKLogProbs[e] = -5 - 0.25*float32(e%K)
	}
	s.TopKLogProbs[K-1] = float32(math.Inf(-1))
	s.TopKLogProbs[2*K-1] = -3000
	for _, enc := range []Encoding{EncodingCompact, EncodingLossless} {
		m.Encoding = enc
		if err := validateSample(&m, &s); err != nil {
			t.Fatal(err)
		}
		_, out := roundTrip(t, genChunk{m: m, samples: []Sample{s}})
		for e := range s.TopKIDs {
			if out[0].TopKIDs[e] != s.TopKIDs[e] {
				t.Fatalf("%s: entry %d: id %d, want %d", enc, e, out[0].TopKIDs[e], s.TopKIDs[e])
			}
		}
		got := out[0].TopKLogProbs
		if enc == EncodingCompact {
			if math.Abs(float64(got[K-2]-s.TopKLogProbs[K-2])) > 1.0/128 || got[K-1] > -1000 || got[2*K-1] > -1000 {
				t.Fatalf("compact saturation: %v %v %v", got[K-2], got[K-1], got[2*K-1])
			}
		} else if !math.IsInf(float64(got[K-1]), -1) || got[2*K-1] != -3000 {
			t.Fatalf("lossless: %v %v", got[K-1], got[2*K-1])
		}
	}
	m.K, m.Encoding = 1, EncodingCompact
	one := Sample{Tokens: []int32{1, 2}, Mask: []uint8{0, 1}, TopKIDs: []int32{7, 9}, TopKLogProbs: []float32{-0.5, -0.25}}
	_, out := roundTrip(t, genChunk{m: m, samples: []Sample{one}})
	if out[0].TopKIDs[1] != 9 || math.Abs(float64(out[0].TopKLogProbs[1]+0.25)) > 1.0/8192 {
		t.Fatalf("K=1: %v %v", out[0].TopKIDs, out[0].TopKLogProbs)
	}
}

// TestCompactSaturatesHugeLogProbs: finite log-probs far below -1000 (a
// teacher masking logits with -1e30 or -FLT_MAX) saturate like -Inf; they
// must not wrap around in the float-to-int conversion and decode as the
// previous entry.
func TestCompactSaturatesHugeLogProbs(t *testing.T) {
	m := Manifest{FormatVersion: FormatVersion, TeacherFingerprint: "t", TokenizerFingerprint: "tok", DatasetFingerprint: "d",
		VocabSize: 16, K: 4, Temperature: 1, Samples: 1, Encoding: EncodingCompact}
	s := Sample{Tokens: []int32{1}, Mask: []uint8{1}, TopKIDs: []int32{3, 5, 7, 9},
		TopKLogProbs: []float32{-0.1, -2.5, -1e30, -math.MaxFloat32}}
	if err := validateSample(&m, &s); err != nil {
		t.Fatal(err)
	}
	_, out := roundTrip(t, genChunk{m: m, samples: []Sample{s}})
	got := out[0].TopKLogProbs
	if math.Abs(float64(got[1]+2.5)) > 1.0/128 || got[2] > -1000 || got[3] > -1000 {
		t.Fatalf("decoded %v, want ~[-0.1 -2.5 <=-1000 <=-1000]", got)
	}
}
