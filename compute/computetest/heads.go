package computetest

import (
	"math"
	"math/rand/v2"
	"sort"
	"testing"

	"distill/compute"
)

func (s *suite) moe(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(21, 22))
	tokens, H, I, E, K := 50, 16, 24, 6, 2
	for _, norm := range []bool{false, true} {
		x := randn(r, tokens*H, 1)
		router := randn(r, E*H, 1)
		mw := &compute.MoEWeights{Router: be.FromF32(router), NumExperts: E, TopK: K, Hidden: H, Inter: I, NormTopK: norm}
		var gs, us, ds [][]float32
		for e := 0; e < E; e++ {
			g, u, d := randn(r, I*H, 1), randn(r, I*H, 1), randn(r, H*I, 1)
			gs, us, ds = append(gs, g), append(us, u), append(ds, d)
			mw.Gate = append(mw.Gate, be.FromF32(g))
			mw.Up = append(mw.Up, be.FromF32(u))
			mw.Down = append(mw.Down, be.FromF32(d))
		}
		out := s.garbage(tokens * H)
		be.MoE(out, be.FromF32(x), mw, tokens)
		// The experts multiply x, their weights and their activations as
		// the backend does (BF16GEMM); the router sees x as it is.
		xe := s.gemmIn(x)
		for e := 0; e < E; e++ {
			gs[e], us[e], ds[e] = s.gemmIn(gs[e]), s.gemmIn(us[e]), s.gemmIn(ds[e])
		}
		want := make([]float64, tokens*H)
		for ti := 0; ti < tokens; ti++ {
			xr, xer := x[ti*H:(ti+1)*H], xe[ti*H:(ti+1)*H]
			p := make([]float64, E)
			var sum float64
			for e := 0; e < E; e++ {
				var l float64
				for j := 0; j < H; j++ {
					l += float64(xr[j]) * float64(router[e*H+j])
				}
				p[e] = math.Exp(l)
				sum += p[e]
			}
			idx := []int{0, 1, 2, 3, 4, 5}
			sort.SliceStable(idx, func(a, b int) bool { return p[idx[a]] > p[idx[b]] })
			ks := 0.0
			for _, e := range idx[:K] {
				ks += p[e] / sum
			}
			for _, e := range idx[:K] {
				wgt := p[e] / sum
				if norm {
					wgt /= ks
				}
				act := make([]float64, I)
				for i := 0; i < I; i++ {
					var g, u float64
					for j := 0; j < H; j++ {
						g += float64(xer[j]) * float64(gs[e][i*H+j])
						u += float64(xer[j]) * float64(us[e][i*H+j])
					}
					act[i] = g / (1 + math.Exp(-g)) * u
					if s.tol.BF16GEMM {
						act[i] = float64(compute.BF16ToF32(compute.F32ToBF16(float32(act[i]))))
					}
				}
				for j := 0; j < H; j++ {
					var y float64
					for i := 0; i < I; i++ {
						y += act[i] * float64(ds[e][j*I+i])
					}
					want[ti*H+j] += wgt * y
				}
			}
		}
		closeTo(t, "moe", s.read(out, tokens*H), want, s.tol.MoEAtol, s.tol.MoERtol)
	}
}

func (s *suite) lmHeadTopK(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(23, 24))
	tokens, hidden, vocab := 300, 24, 5000 // vocab not a multiple of the tile
	x, w := randn(r, tokens*hidden, 1), randn(r, vocab*hidden, 1)
	xt, x := s.actIn(x)
	wt := be.FromF32(w)
	x, w = s.gemmIn(x), s.gemmIn(w) // the logits' operands as the backend multiplies them
	for _, k := range []int{1, 7, 64, vocab} {
		ids, lps := be.New(compute.I32, tokens*k), s.garbage(tokens*k)
		be.LMHeadTopK(ids, lps, xt, wt, tokens, hidden, vocab, k)
		gotID := make([]int32, tokens*k)
		be.ReadI32(ids, gotID)
		gotLP := s.read(lps, tokens*k)
		for ti := 0; ti < tokens; ti++ {
			logit := make([]float64, vocab)
			mx := math.Inf(-1)
			for j := 0; j < vocab; j++ {
				var sm float64
				for p := 0; p < hidden; p++ {
					sm += float64(x[ti*hidden+p]) * float64(w[j*hidden+p])
				}
				logit[j] = sm
				mx = math.Max(mx, sm)
			}
			var sum float64
			for _, l := range logit {
				sum += math.Exp(l - mx)
			}
			lse := mx + math.Log(sum)
			order := make([]int, vocab)
			for i := range order {
				order[i] = i
			}
			sort.SliceStable(order, func(a, b int) bool { return logit[order[a]] > logit[order[b]] })
			for j := 0; j < k; j++ {
				g := int(gotID[ti*k+j])
				want := logit[order[j]] - lse
				if d := math.Abs(float64(gotLP[ti*k+j]) - want); d > s.tol.LogProbAtol {
					t.Fatalf("k=%d token %d rank %d: logprob %v want %v", k, ti, j, gotLP[ti*k+j], want)
				}
				// Ids may differ only where the float64 logits are within
				// rounding of each other.
				if g != order[j] && math.Abs(logit[g]-logit[order[j]]) > s.tol.TieGap {
					t.Fatalf("k=%d token %d rank %d: id %d (logit %v), want %d (logit %v)", k, ti, j, g, logit[g], order[j], logit[order[j]])
				}
				// Distinct logits may round to one log-prob, so only the
				// values' order is checked here (ties: lmHeadTopKTies).
				if j > 0 && gotLP[ti*k+j-1] < gotLP[ti*k+j] {
					t.Fatalf("k=%d token %d: not sorted at rank %d", k, ti, j)
				}
			}
		}
	}
}

// lmHeadTopKTies: with hidden=1 and x=1 the logits are exactly w, so ties
// are exact, across tiles too: the lower id must come first.
func (s *suite) lmHeadTopKTies(t *testing.T) {
	be := s.be
	vocab, k := 5000, 20
	w := make([]float32, vocab)
	for j := range w {
		w[j] = float32(j % 7)
	}
	ids, lps := be.New(compute.I32, k), be.New(compute.F32, k)
	be.LMHeadTopK(ids, lps, be.FromF32([]float32{1}), be.FromF32(w), 1, 1, vocab, k)
	got := make([]int32, k)
	be.ReadI32(ids, got)
	for j := 0; j < k; j++ {
		if want := int32(6 + 7*j); got[j] != want {
			t.Fatalf("rank %d: id %d, want %d (all ties: ascending ids)", j, got[j], want)
		}
	}
	var sum float64
	for j := 0; j < vocab; j++ {
		sum += math.Exp(float64(j % 7))
	}
	if lp := s.read(lps, 1)[0]; math.Abs(float64(lp)-(6-math.Log(sum))) > 1e-5 {
		t.Fatalf("logprob %v, want %v", lp, 6-math.Log(sum))
	}
}

func (s *suite) fakeQuant(t *testing.T) {
	be := s.be
	fq := func(x []float32, rows int, amax float32) []float32 {
		src, _ := s.actIn(x)
		dst := s.actOut(len(x))
		be.FakeQuantNVFP4(dst, src, rows, len(x)/rows, amax)
		// In place too.
		be.FakeQuantNVFP4(src, src, rows, len(x)/rows, amax)
		a, b := s.read(dst, len(x)), s.read(src, len(x))
		for i := range a {
			if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
				t.Fatalf("in place [%d] = %g, out of place %g", i, b[i], a[i])
			}
		}
		return a
	}
	eq := func(name string, got, want []float32) {
		t.Helper()
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("%s[%d] = %g, want %g (got %v)", name, i, got[i], want[i], got)
			}
		}
	}
	// Blocks worked out by hand with power-of-two global scales, so every
	// intermediate is exact.
	// amax = 2688 -> g = 1. Block max 6 -> sb = 1, s = 1: the E2M1 ties.
	x := []float32{0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6}
	eq("ties", fq(x, 1, 2688), []float32{0, 1, 1, 2, 2, 4, 4, 6, 0, -1, -1, -2, -2, -4, -4, -6})
	// Block max 6.375 -> 6.375/6 = 1.0625 -> E4M3 ties to 1 -> s = 1:
	// the max itself saturates at 6.
	x = []float32{6.375, 1.1, -0.3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	eq("scale tie down", fq(x, 1, 2688), []float32{6, 1, -0.5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	// Block max 7.125 -> 1.1875 -> E4M3 ties up to 1.25 = s:
	// 7.125/1.25 = 5.7 -> 6 -> 7.5; 1.25/1.25 = 1 -> 1.25; 3.125/1.25 = 2.5 -> 2 -> 2.5.
	x = []float32{7.125, 1.25, 3.125, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	eq("scale tie up", fq(x, 1, 2688), []float32{7.5, 1.25, 2.5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	// Stale amax: calibrated at 10.5 (g = 2^-8), the block has grown to 21:
	// 21/(6·2^-8) = 896 -> clamped to 448 -> s = 1.75; 21/1.75 = 12 -> 6 ->
	// 10.5 (clipped at the old amax); 3.5/1.75 = 2 -> 3.5.
	x = []float32{21, 3.5, -14, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	eq("stale amax", fq(x, 1, 10.5), []float32{10.5, 3.5, -10.5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	// All-zero block: scale 0 -> guard -> 1; output zeros (no NaN).
	eq("zero block", fq(make([]float32, 16), 1, 2688), make([]float32, 16))
	// Guard: g = 2^-20, block max 6·2^-20 -> sb = 1 -> s = 2^-20 < 1e-5 ->
	// s = 1 and the whole block rounds to 0, as in ModelOpt.
	x = []float32{6 * 0x1p-20, 3 * 0x1p-20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	eq("guard", fq(x, 1, 2688*0x1p-20), make([]float32, 16))
	// Two blocks per row get independent scales; a 20-column row has a
	// short last block of 4. Two rows: the second row's blocks start at
	// column 0 again.
	x = make([]float32, 40)
	x[0], x[16], x[17] = 6, 0.75, 0.5 // block 2 max 0.75 -> 0.125 -> s = 0.125: 0.75/0.125 = 6, 0.5 -> 4
	x[20], x[36] = 6, 0.75
	want := make([]float32, 40)
	want[0], want[16], want[17], want[20], want[36] = 6, 0.75, 0.5, 6, 0.75
	eq("short block", fq(x, 2, 2688), want)

	// Random rows against the scalar definition, bit for bit.
	r := rand.New(rand.NewPCG(25, 26))
	rows, cols := 64, 80
	w := randn(r, rows*cols, 0.05)
	var amax float32
	for _, v := range w {
		amax = max(amax, float32(math.Abs(float64(v))))
	}
	_, w = s.actIn(w) // what the backend quantizes
	for _, a := range []float32{amax, amax / 3, amax * 5} {
		got := fq(w, rows, a)
		ref := make([]float32, len(w))
		g := compute.NVFP4GlobalScale(a)
		for rr := 0; rr < rows; rr++ {
			for b0 := 0; b0 < cols; b0 += compute.NVFP4BlockSize {
				compute.NVFP4FakeQuantBlock(ref[rr*cols+b0:rr*cols+b0+16], w[rr*cols+b0:rr*cols+b0+16], g)
			}
		}
		if s.act != compute.F32 {
			ref = bf16(ref) // the output's one rounding
		}
		for i := range ref {
			if math.Float32bits(got[i]) != math.Float32bits(ref[i]) {
				t.Fatalf("amax %g: [%d] = %g, want %g", a, i, got[i], ref[i])
			}
		}
	}
}
