package cache

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"strings"
	"testing"

	"distill/cache/cachetest"
)

// sampledManifest is testManifest for a sampled kind with N draws (k tK
// for head+sampled).
func sampledManifest(samples int64, enc Encoding, kind Targets, N int) Manifest {
	m := testManifest(samples, enc)
	m.Targets, m.Draws = kind, N
	if kind == TargetsSampled {
		m.K = 0
	}
	return m
}

// sampledSample builds sample i of m's kind from cachetest's distributions
// and reference draws (keyed as the fill keys them).
func sampledSample(m *Manifest, i int64) Sample {
	T := 2 + int(i%5)
	s := Sample{Index: i, Tokens: make([]int32, T), Mask: make([]uint8, T), DrawN: make([]int32, T)}
	key := DrawKey(m.DatasetFingerprint)
	for t := 0; t < T; t++ {
		p := cachetest.Dist(m.VocabSize, uint64(i)*1000+uint64(t))
		s.Tokens[t], s.Mask[t] = int32((int(i)*31+t*7)%m.VocabSize), uint8(t%3/2)
		var head []int32
		if m.K > 0 {
			ids, lps := cachetest.Head(p, m.K)
			head = ids
			s.TopKIDs, s.TopKLogProbs = append(s.TopKIDs, ids...), append(s.TopKLogProbs, lps...)
		}
		drawn, tail := cachetest.Draws(p, head, m.Draws, func(d int) float64 { return DrawUniform(key, i, t, d) })
		n0 := len(s.DrawIDs)
		s.DrawIDs, s.DrawCounts = Tally(drawn, s.DrawIDs, s.DrawCounts)
		s.DrawN[t] = int32(len(s.DrawIDs) - n0)
		if m.Kind() == TargetsHeadSampled {
			s.TailMass = append(s.TailMass, float32(tail))
		}
	}
	return s
}

func fillSampled(t testing.TB, c *Cache, m *Manifest, a, b int64) []Sample {
	t.Helper()
	w, err := c.BeginChunk(a, b)
	if err != nil {
		t.Fatal(err)
	}
	var out []Sample
	for i := a; i < b; i++ {
		s := sampledSample(m, i)
		if err := w.Add(s); err != nil {
			t.Fatal(err)
		}
		out = append(out, s)
	}
	if err := w.Commit(); err != nil {
		t.Fatal(err)
	}
	return out
}

func sameDraws(t testing.TB, got, want Sample) {
	t.Helper()
	eq := func(name string, a, b []int32) {
		if len(a) != len(b) {
			t.Fatalf("sample %d: %s has %d entries, want %d", want.Index, name, len(a), len(b))
		}
		for e := range a {
			if a[e] != b[e] {
				t.Fatalf("sample %d: %s[%d] = %d, want %d", want.Index, name, e, a[e], b[e])
			}
		}
	}
	eq("draw_n", got.DrawN, want.DrawN)
	eq("draw ids", got.DrawIDs, want.DrawIDs)
	eq("draw counts", got.DrawCounts, want.DrawCounts)
	if len(got.TailMass) != len(want.TailMass) {
		t.Fatalf("sample %d: %d tail masses, want %d", want.Index, len(got.TailMass), len(want.TailMass))
	}
	for e := range got.TailMass {
		if math.Float32bits(got.TailMass[e]) != math.Float32bits(want.TailMass[e]) {
			t.Fatalf("sample %d: tail mass %d = %v, want %v", want.Index, e, got.TailMass[e], want.TailMass[e])
		}
	}
}

// TestSampledRoundTrip writes and reads back caches of both sampled kinds
// in both encodings: draws, counts and tail masses come back bit for bit,
// the head as a top-k cache's does, and verify passes.
func TestSampledRoundTrip(t *testing.T) {
	for _, kind := range []Targets{TargetsSampled, TargetsHeadSampled} {
		for _, enc := range []Encoding{EncodingCompact, EncodingLossless} {
			t.Run(fmt.Sprintf("%s/%s", kind, enc), func(t *testing.T) {
				dir := t.TempDir()
				m := sampledManifest(10, enc, kind, 50)
				c, err := Create(dir, m, nil)
				if err != nil {
					t.Fatal(err)
				}
				want := append(fillSampled(t, c, &m, 0, 6), fillSampled(t, c, &m, 6, 10)...)
				c.Close()
				mustCheck(t, dir)
				r, err := OpenReader(dir)
				if err != nil {
					t.Fatal(err)
				}
				got := r.Manifest()
				if got.FormatVersion != FormatVersionSampled || got.Kind() != kind || got.Draws != 50 {
					t.Fatalf("manifest: version %d, targets %s, draws %d", got.FormatVersion, got.Kind(), got.Draws)
				}
				for _, w := range want {
					s, err := r.Get(w.Index)
					if err != nil {
						t.Fatal(err)
					}
					sameDraws(t, s, w)
					if len(s.TopKIDs) != len(w.TopKIDs) {
						t.Fatalf("sample %d: %d head entries, want %d", w.Index, len(s.TopKIDs), len(w.TopKIDs))
					}
					for e := range w.TopKIDs {
						tol := 0.0
						if enc == EncodingCompact {
							tol = 1.0 / 128
						}
						if s.TopKIDs[e] != w.TopKIDs[e] || math.Abs(float64(s.TopKLogProbs[e]-w.TopKLogProbs[e])) > tol {
							t.Fatalf("sample %d head %d: (%d, %v), want (%d, %v)", w.Index, e, s.TopKIDs[e], s.TopKLogProbs[e], w.TopKIDs[e], w.TopKLogProbs[e])
						}
					}
				}
			})
		}
	}
}

// TestTopKManifestUnchanged: a top-k manifest is still version 1 and its
// JSON has no field version 1 did not have, so older builds read it.
func TestTopKManifestUnchanged(t *testing.T) {
	dir := t.TempDir()
	m := testManifest(4, EncodingCompact)
	m.Targets = TargetsTopK
	c, err := Create(dir, m, nil)
	if err != nil {
		t.Fatal(err)
	}
	fillRange(t, c, 0, 4)
	c.Close()
	r, err := OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	got := r.Manifest()
	if got.FormatVersion != 1 {
		t.Fatalf("top-k cache written as format version %d, want 1", got.FormatVersion)
	}
	b, _ := json.Marshal(got)
	if strings.Contains(string(b), "targets") || strings.Contains(string(b), "draws") {
		t.Fatalf("top-k manifest JSON %s has version 2 fields", b)
	}
}

func TestSampledManifestErrors(t *testing.T) {
	cases := []struct {
		name string
		edit func(m *Manifest)
		want string
	}{
		{"no draws", func(m *Manifest) { m.Draws = 0 }, "draws 0 with targets sampled: want 1 to 4096"},
		{"huge draws", func(m *Manifest) { m.Draws = 1 << 20 }, "want 1 to 4096"},
		{"sampled with k", func(m *Manifest) { m.K = 4 }, "a sampled cache has no top-k head"},
		{"draws on topk", func(m *Manifest) { m.Targets, m.K = "", 4 }, "draws belong to targets sampled or head+sampled"},
		{"unknown kind", func(m *Manifest) { m.Targets = "gumbel" }, `targets "gumbel"`},
		{"version 1 sampled", func(m *Manifest) { m.FormatVersion = 1 }, "a sampled cache is format version 2"},
	}
	for _, tc := range cases {
		m := sampledManifest(4, EncodingCompact, TargetsSampled, 16)
		tc.edit(&m)
		_, err := Create(t.TempDir(), m, nil)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want ErrInvalid naming %q", tc.name, err, tc.want)
		}
	}
	// A writer of another kind is refused by a cache with chunks, naming
	// the field.
	dir := t.TempDir()
	m := sampledManifest(4, EncodingCompact, TargetsSampled, 16)
	c, err := Create(dir, m, nil)
	if err != nil {
		t.Fatal(err)
	}
	fillSampled(t, c, &m, 0, 2)
	c.Close()
	m2 := sampledManifest(4, EncodingCompact, TargetsSampled, 32)
	if _, err := Create(dir, m2, nil); !errors.Is(err, ErrManifestMismatch) || !strings.Contains(err.Error(), "field draws differs") {
		t.Fatalf("refill with other draws: %v", err)
	}
}

// TestSampledBadSamples: every broken invariant of the draws is refused
// by Add, naming it, and the chunk is not written.
func TestSampledBadSamples(t *testing.T) {
	m := sampledManifest(4, EncodingLossless, TargetsHeadSampled, 20)
	good := sampledSample(&m, 1)
	cases := []struct {
		name string
		edit func(s *Sample)
		want string
	}{
		{"counts over", func(s *Sample) { s.DrawCounts[0]++ }, "counts sum to 21, want the draws 20"},
		{"id in head", func(s *Sample) { s.DrawIDs[0] = s.TopKIDs[0] }, "is in the head"},
		{"order", func(s *Sample) {
			n := s.DrawN[0]
			s.DrawIDs[0], s.DrawIDs[n-1] = s.DrawIDs[n-1], s.DrawIDs[0]
			s.DrawCounts[0], s.DrawCounts[n-1] = s.DrawCounts[n-1], s.DrawCounts[0]
		}, "not in the stored order"},
		{"duplicate", func(s *Sample) { s.DrawIDs[1] = s.DrawIDs[0]; s.DrawCounts[1] = s.DrawCounts[0] }, ""},
		{"tail mass", func(s *Sample) { s.TailMass[0] = 1.5 }, "tail mass 1.5 outside [0, 1]"},
		{"no tail", func(s *Sample) { s.TailMass = nil }, "tail mass has 0 entries"},
		{"draw_n", func(s *Sample) { s.DrawN = s.DrawN[1:] }, "draw_n has"},
	}
	for _, tc := range cases {
		dir := t.TempDir()
		c, err := Create(dir, m, nil)
		if err != nil {
			t.Fatal(err)
		}
		w, err := c.BeginChunk(1, 2)
		if err != nil {
			t.Fatal(err)
		}
		s := good
		s.DrawN, s.DrawIDs = append([]int32(nil), good.DrawN...), append([]int32(nil), good.DrawIDs...)
		s.DrawCounts, s.TailMass = append([]int32(nil), good.DrawCounts...), append([]float32(nil), good.TailMass...)
		tc.edit(&s)
		err = w.Add(s)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want ErrInvalid naming %q", tc.name, err, tc.want)
		}
		w.Abort()
		if ch, _ := c.Chunks(); len(ch) != 0 {
			t.Errorf("%s: %d chunks committed", tc.name, len(ch))
		}
		c.Close()
	}
}

// TestTally checks Tally's stored order (descending count, ties ascending
// id) and counts against a stable sort of the distinct ids, for draws in
// any order, on both sides of its insertion-sort bound (a flat
// distribution's many distinct ids, a peaked one's few), appending after
// what ids and counts already hold.
func TestTally(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for it := 0; it < 300; it++ {
		n := []int{1, 7, 50, 200, 1000}[it%5]
		span := []int{3, 40, 5000}[it%3]
		drawn := make([]int32, n)
		for i := range drawn {
			drawn[i] = int32(r.IntN(span)) * 3
		}
		want := map[int32]int32{}
		for _, v := range drawn {
			want[v]++
		}
		type entry struct{ id, count int32 }
		var ref []entry
		for id, c := range want {
			ref = append(ref, entry{id, c})
		}
		sort.Slice(ref, func(a, b int) bool { return ref[a].id < ref[b].id })
		sort.SliceStable(ref, func(a, b int) bool { return ref[a].count > ref[b].count })
		ids, counts := Tally(drawn, []int32{-7}, []int32{9})
		if len(ids) != len(ref)+1 || ids[0] != -7 || counts[0] != 9 {
			t.Fatalf("case %d: %d entries after the one held, want %d (and the held one kept)", it, len(ids)-1, len(ref))
		}
		for i, e := range ref {
			if ids[i+1] != e.id || counts[i+1] != e.count {
				t.Fatalf("case %d (%d draws over %d ids): entry %d is id %d count %d, want id %d count %d", it, n, span, i, ids[i+1], counts[i+1], e.id, e.count)
			}
		}
	}
}
