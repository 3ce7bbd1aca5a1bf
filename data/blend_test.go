package data

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"
)

func TestPermutationIsBijection(t *testing.T) {
	for _, n := range []uint64{1, 2, 3, 7, 64, 100, 1000, 1025, 4097} {
		for _, key := range []uint64{0, 1, 0xdeadbeef} {
			p := newPermutation(n, key)
			seen := make([]bool, n)
			fixed := 0
			for x := uint64(0); x < n; x++ {
				y := p.apply(x)
				if y >= n || seen[y] {
					t.Fatalf("n=%d key=%d: %d -> %d is not a bijection", n, key, x, y)
				}
				seen[y] = true
				if y == x {
					fixed++
				}
			}
			// A shuffle that leaves most elements in place is no shuffle.
			if n >= 100 && fixed > int(n)/10 {
				t.Errorf("n=%d key=%d: %d fixed points", n, key, fixed)
			}
		}
	}
	a, b := newPermutation(1000, 1), newPermutation(1000, 2)
	same := 0
	for x := uint64(0); x < 1000; x++ {
		if a.apply(x) == b.apply(x) {
			same++
		}
	}
	if same > 50 {
		t.Errorf("keys 1 and 2 agree on %d of 1000 positions", same)
	}
}

// TestOrder: the exported Order is a bijection of [0, n) that differs
// between seeds (the trainer's per-epoch dataset order).
func TestOrder(t *testing.T) {
	for _, n := range []int64{1, 5, 96, 1000} {
		o := NewOrder(n, 7)
		seen := make([]bool, n)
		for i := int64(0); i < n; i++ {
			j := o.At(i)
			if j < 0 || j >= n || seen[j] {
				t.Fatalf("n=%d: %d -> %d is not a bijection", n, i, j)
			}
			seen[j] = true
		}
	}
	a, b := NewOrder(1000, 1), NewOrder(1000, 2)
	same := 0
	for i := int64(0); i < 1000; i++ {
		if a.At(i) == b.At(i) {
			same++
		}
	}
	if same > 50 {
		t.Errorf("seeds 1 and 2 agree on %d of 1000 positions", same)
	}
}

func TestQuantizeWeights(t *testing.T) {
	for _, tc := range []struct {
		w    []float64
		want []int64
	}{
		{[]float64{0.3, 0.7}, []int64{3, 7}},
		{[]float64{1, 1}, []int64{1, 1}},
		{[]float64{2, 4, 6}, []int64{1, 2, 3}},
		{[]float64{0.125, 0.875}, []int64{1, 7}},
	} {
		got, err := quantizeWeights(tc.w)
		if err != nil || fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("quantize %v = %v, %v; want %v", tc.w, got, err, tc.want)
		}
	}
	// 1/3 : 2/3 is not a decimal ratio: shares of 65536, within 1/65536.
	got, _ := quantizeWeights([]float64{1.0 / 3, 2.0 / 3})
	if r := float64(got[0]) / float64(got[0]+got[1]); math.Abs(r-1.0/3) > 1.0/65536 {
		t.Errorf("1/3 quantized to %v (%v)", got, r)
	}
	for _, bad := range [][]float64{{0, 1}, {-1}, {math.NaN()}, {math.Inf(1)}} {
		if _, err := quantizeWeights(bad); err == nil {
			t.Errorf("weights %v accepted", bad)
		}
	}
}

// TestBlendProportions checks against float64 targets: after every prefix of
// i samples, source d has within one sample of w_d * i (plus i/65536 where
// weights are quantized), and each source's
// stream is consumed in order without gaps.
func TestBlendProportions(t *testing.T) {
	for _, w := range [][]float64{{0.3, 0.7}, {1, 1, 1}, {5, 1, 0.5}, {1.0 / 3, 2.0 / 3}} {
		b, err := newBlend(w)
		if err != nil {
			t.Fatal(err)
		}
		var sum float64
		for _, x := range w {
			sum += x
		}
		count := make([]int64, len(w))
		for i := int64(0); i < 3*int64(len(b.pattern))+7 && i < 300000; i++ {
			d, j := b.locate(i)
			if j != count[d] {
				t.Fatalf("w=%v sample %d: source %d position %d, want %d", w, i, d, j, count[d])
			}
			count[d]++
			for k := range w {
				if diff := float64(count[k]) - w[k]/sum*float64(i+1); math.Abs(diff) > 1+float64(i+1)/65536 {
					t.Fatalf("w=%v after %d samples source %d has %d (target %.2f)", w, i+1, k, count[k], w[k]/sum*float64(i+1))
				}
			}
		}
	}
}

func TestBlendedDataset(t *testing.T) {
	dir := t.TempDir()
	var a, b strings.Builder
	for i := 0; i < 10; i++ {
		fmt.Fprintf(&a, `{"text":"a%d"}`+"\n", i)
	}
	for i := 0; i < 3; i++ {
		fmt.Fprintf(&b, `{"text":"b%d"}`+"\n", i)
	}
	pa, pb := writeFile(t, dir, "a.jsonl", a.String()), writeFile(t, dir, "b.jsonl", b.String())
	tok := newFakeTok()
	texts := func(opts Options, srcs ...Source) []string {
		d := openFake(t, tok, nil, opts, srcs...)
		var out []string
		for _, s := range all(t, d) {
			out = append(out, tok.decode(s.IDs))
		}
		return out
	}
	// Concatenation: every record once, in file order.
	if got := strings.Join(texts(Options{NoEOS: true}, Source{Path: pa}, Source{Path: pb}), " "); got != "a0 a1 a2 a3 a4 a5 a6 a7 a8 a9 b0 b1 b2" {
		t.Errorf("concat = %s", got)
	}
	// Past the total, the concatenation repeats.
	if got := strings.Join(texts(Options{NoEOS: true, NumSamples: 15}, Source{Path: pa}, Source{Path: pb}), " "); got != "a0 a1 a2 a3 a4 a5 a6 a7 a8 a9 b0 b1 b2 a0 a1" {
		t.Errorf("concat of 15 = %s", got)
	}
	// Shuffled concatenation: every record once, sources mixed.
	mixed := texts(Options{NoEOS: true, Shuffle: true, Seed: 3}, Source{Path: pa}, Source{Path: pb})
	seenAll := map[string]bool{}
	for _, s := range mixed {
		seenAll[s] = true
	}
	if len(seenAll) != 13 || strings.Join(mixed[10:], " ") == "b0 b1 b2" {
		t.Errorf("shuffled concat = %v", mixed)
	}
	// 1:1 blend of 12 samples: b is repeated (4 epochs of 3), a is read in order.
	got := texts(Options{NoEOS: true, NumSamples: 12}, Source{Path: pa, Weight: 1}, Source{Path: pb, Weight: 1})
	if strings.Join(got, " ") != "a0 b0 a1 b1 a2 b2 a3 b0 a4 b1 a5 b2" {
		t.Errorf("blend = %v", got)
	}
	// Shuffled: each epoch of b is a permutation of b0..b2, reproducible by seed.
	sh := func(seed uint64) []string {
		return texts(Options{NoEOS: true, NumSamples: 24, Shuffle: true, Seed: seed}, Source{Path: pa, Weight: 1}, Source{Path: pb, Weight: 1})
	}
	s1, s1again, s2 := sh(1), sh(1), sh(2)
	if strings.Join(s1, " ") != strings.Join(s1again, " ") {
		t.Errorf("same seed, different order")
	}
	if strings.Join(s1, " ") == strings.Join(s2, " ") {
		t.Errorf("seeds 1 and 2 give the same order")
	}
	var bs, as []string
	for _, s := range s1 {
		if s[0] == 'b' {
			bs = append(bs, s)
		} else {
			as = append(as, s)
		}
	}
	for e := 0; e < 4; e++ {
		seen := map[string]bool{}
		for _, s := range bs[3*e : 3*e+3] {
			seen[s] = true
		}
		if len(seen) != 3 {
			t.Errorf("epoch %d of b is not a permutation: %v", e, bs[3*e:3*e+3])
		}
	}
	seen := map[string]bool{}
	for _, s := range as[:10] {
		seen[s] = true
	}
	if len(seen) != 10 || as[0] == "a0" && as[1] == "a1" && as[2] == "a2" {
		t.Errorf("first epoch of a is not a shuffle of a0..a9: %v", as[:10])
	}
}

func TestFingerprintChangesWithTokens(t *testing.T) {
	dir := t.TempDir()
	p := writeFile(t, dir, "f.jsonl", `{"text":"hello"}`+"\n")
	q := writeFile(t, dir, "g.jsonl", `{"text":"hellp"}`+"\n")
	tok := newFakeTok()
	fp := func(tok *fakeTok, opts Options, srcs ...Source) string {
		return openFake(t, tok, nil, opts, srcs...).Fingerprint()
	}
	base := fp(tok, Options{}, Source{Path: p})
	if again := fp(tok, Options{}, Source{Path: p}); again != base {
		t.Fatalf("fingerprint not stable: %s vs %s", base, again)
	}
	other := newFakeTok()
	other.fp = "fake-v2"
	diff := map[string]string{
		"content":       fp(tok, Options{}, Source{Path: q}),
		"tokenizer":     fp(other, Options{}, Source{Path: p}),
		"max-len":       fp(tok, Options{MaxLen: 3}, Source{Path: p}),
		"policy":        fp(tok, Options{MaxLen: 3, Policy: Drop}, Source{Path: p}),
		"no-eos":        fp(tok, Options{NoEOS: true}, Source{Path: p}),
		"shuffle":       fp(tok, Options{Shuffle: true}, Source{Path: p}),
		"seed":          fp(tok, Options{Shuffle: true, Seed: 9}, Source{Path: p}),
		"num-samples":   fp(tok, Options{NumSamples: 5}, Source{Path: p}),
		"columns":       fp(tok, Options{}, Source{Path: p, Columns: ColumnMap{Text: "body"}}),
		"weights":       fp(tok, Options{}, Source{Path: p, Weight: 1}, Source{Path: q, Weight: 2}),
		"weights2":      fp(tok, Options{}, Source{Path: p, Weight: 1}, Source{Path: q, Weight: 3}),
		"template-vars": fp(tok, Options{TemplateVars: map[string]any{"enable_thinking": false}}, Source{Path: p}),
	}
	seen := map[string]string{base: "base"}
	for k, v := range diff {
		if prev, dup := seen[v]; dup {
			t.Errorf("changing %s gives the same fingerprint as %s", k, prev)
		}
		seen[v] = k
	}
}

func TestRangeCancel(t *testing.T) {
	dir := t.TempDir()
	p := writeFile(t, dir, "c.jsonl", strings.Repeat(`{"text":"x"}`+"\n", 100))
	d := openFake(t, newFakeTok(), nil, Options{}, Source{Path: p})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := d.Range(ctx, 0, 100); err != context.Canceled {
		t.Errorf("cancelled range: %v", err)
	}
}
