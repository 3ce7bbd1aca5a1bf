package cpu

import (
	"math"
	"math/rand/v2"
	"sort"
	"testing"

	"distill/compute"
)

// Each kernel is checked against a direct float64 computation of its
// definition, with |got-want| <= atol + rtol*|want|.

func close32(t *testing.T, what string, got []float32, want []float64, atol, rtol float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: len %d, want %d", what, len(got), len(want))
	}
	for i := range want {
		if d := math.Abs(float64(got[i]) - want[i]); d > atol+rtol*math.Abs(want[i]) || math.IsNaN(float64(got[i])) {
			t.Fatalf("%s[%d] = %v, want %v (|d|=%g)", what, i, got[i], want[i], d)
		}
	}
}

func TestFastExp(t *testing.T) {
	xs := []float32{-87, -50, -10.5, -1, -0.3465, 0, 1e-8, 0.3466, 1, 7.25, 20, 50, 88}
	for i := 0; i < 2000; i++ {
		xs = append(xs, float32(-80+160*float64(i)/2000))
	}
	out := make([]float32, len(xs))
	expInto(out, xs)
	for i, x := range xs {
		want := math.Exp(float64(x))
		if d := math.Abs(float64(out[i])-want) / want; d > 3e-7 {
			t.Fatalf("exp(%v) = %v, want %v (rel %g)", x, out[i], want, d)
		}
	}
}

func TestRMSNormSwiGLUAdd(t *testing.T) {
	be := New()
	r := rand.New(rand.NewPCG(3, 4))
	rows, dim := 37, 129
	x, w := randSlice(r, rows*dim), randSlice(r, dim)
	out := be.New(compute.F32, rows*dim)
	be.RMSNorm(out, be.FromF32(x), be.FromF32(w), rows, dim, 1e-5)
	want := make([]float64, rows*dim)
	for i := 0; i < rows; i++ {
		var ss float64
		for j := 0; j < dim; j++ {
			ss += float64(x[i*dim+j]) * float64(x[i*dim+j])
		}
		rs := 1 / math.Sqrt(ss/float64(dim)+1e-5)
		for j := 0; j < dim; j++ {
			want[i*dim+j] = float64(x[i*dim+j]) * rs * float64(w[j])
		}
	}
	close32(t, "rmsnorm", F32(out), want, 1e-5, 1e-5)

	n := 10007
	g, u := randSlice(r, n), randSlice(r, n)
	for i := 0; i < 20; i++ {
		g[i] = float32(-90 + 9*i) // saturating inputs
	}
	sw := be.New(compute.F32, n)
	be.SwiGLU(sw, be.FromF32(g), be.FromF32(u), n)
	want = make([]float64, n)
	for i := range want {
		gv := float64(g[i])
		want[i] = gv / (1 + math.Exp(-gv)) * float64(u[i])
	}
	close32(t, "swiglu", F32(sw), want, 1e-6, 1e-6)

	a := be.FromF32(g)
	be.Add(a, be.FromF32(u), n)
	for i := range want {
		want[i] = float64(g[i]) + float64(u[i])
	}
	close32(t, "add", F32(a), want, 0, 1e-7)
}

func TestMatMulBiasEmbed(t *testing.T) {
	be := New()
	r := rand.New(rand.NewPCG(5, 6))
	m, n, k := 33, 70, 48
	x, w, b := randSlice(r, m*k), randSlice(r, n*k), randSlice(r, n)
	out := be.New(compute.F32, m*n)
	be.MatMul(out, be.FromF32(x), be.FromF32(w), be.FromF32(b), m, n, k)
	want := make([]float64, m*n)
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			s := float64(b[j])
			for p := 0; p < k; p++ {
				s += float64(x[i*k+p]) * float64(w[j*k+p])
			}
			want[i*n+j] = s
		}
	}
	close32(t, "matmul", F32(out), want, 1e-5, 1e-5)

	ids := []int32{3, 0, 69, 3}
	emb := be.New(compute.F32, len(ids)*k)
	be.Embed(emb, be.FromF32(w), be.FromI32(ids), len(ids), k)
	for i, id := range ids {
		for j := 0; j < k; j++ {
			if F32(emb)[i*k+j] != w[int(id)*k+j] {
				t.Fatalf("embed row %d col %d", i, j)
			}
		}
	}
}

func TestRoPE(t *testing.T) {
	be := New()
	r := rand.New(rand.NewPCG(7, 8))
	tokens, heads, hd := 9, 3, 8
	x := randSlice(r, tokens*heads*hd)
	pos := []int32{0, 1, 2, 3, 0, 1, 500, 1000, 4095}
	inv := []float32{1, 0.1, 0.01, 0.001}
	xt := be.FromF32(x)
	be.RoPE(xt, be.FromI32(pos), be.FromF32(inv), tokens, heads, hd)
	want := make([]float64, len(x))
	for ti := 0; ti < tokens; ti++ {
		for h := 0; h < heads; h++ {
			base := (ti*heads + h) * hd
			for i := 0; i < hd/2; i++ {
				ang := float64(float32(pos[ti]) * inv[i])
				c, s := math.Cos(ang), math.Sin(ang)
				a, b := float64(x[base+i]), float64(x[base+i+hd/2])
				want[base+i] = a*c - b*s
				want[base+i+hd/2] = b*c + a*s
			}
		}
	}
	close32(t, "rope", F32(xt), want, 1e-6, 1e-6)
}

// naiveAttention computes packed causal GQA attention in float64.
func naiveAttention(q, k, v []float32, starts []int32, nHead, nKV, hd int, scale float64) []float64 {
	tokens := int(starts[len(starts)-1])
	out := make([]float64, tokens*nHead*hd)
	group := nHead / nKV
	for s := 0; s+1 < len(starts); s++ {
		a, b := int(starts[s]), int(starts[s+1])
		for t := a; t < b; t++ {
			for h := 0; h < nHead; h++ {
				g := h / group
				sc := make([]float64, t-a+1)
				mx := math.Inf(-1)
				for u := a; u <= t; u++ {
					var d float64
					for i := 0; i < hd; i++ {
						d += float64(q[(t*nHead+h)*hd+i]) * float64(k[(u*nKV+g)*hd+i])
					}
					sc[u-a] = d * scale
					mx = math.Max(mx, sc[u-a])
				}
				var sum float64
				for i := range sc {
					sc[i] = math.Exp(sc[i] - mx)
					sum += sc[i]
				}
				for u := a; u <= t; u++ {
					p := sc[u-a] / sum
					for i := 0; i < hd; i++ {
						out[(t*nHead+h)*hd+i] += p * float64(v[(u*nKV+g)*hd+i])
					}
				}
			}
		}
	}
	return out
}

func TestAttentionPackedCausal(t *testing.T) {
	be := New()
	r := rand.New(rand.NewPCG(9, 10))
	// Sample lengths straddle the query block (128) and include length 1.
	lens := []int{1, 5, 128, 129, 300, 2}
	starts := []int32{0}
	maxLen := 0
	for _, l := range lens {
		starts = append(starts, starts[len(starts)-1]+int32(l))
		maxLen = max(maxLen, l)
	}
	tokens := int(starts[len(starts)-1])
	nHead, nKV, hd := 4, 2, 16
	q, k, v := randSlice(r, tokens*nHead*hd), randSlice(r, tokens*nKV*hd), randSlice(r, tokens*nKV*hd)
	out := be.New(compute.F32, tokens*nHead*hd)
	scale := 1 / math.Sqrt(float64(hd))
	be.Attention(out, be.FromF32(q), be.FromF32(k), be.FromF32(v), be.FromI32(starts), len(lens), maxLen, tokens, nHead, nKV, hd, float32(scale))
	close32(t, "attention", F32(out), naiveAttention(q, k, v, starts, nHead, nKV, hd, scale), 2e-6, 2e-5)
}

func TestLMHeadTopK(t *testing.T) {
	be := New()
	r := rand.New(rand.NewPCG(11, 12))
	tokens, hidden, vocab := 300, 24, 5000 // vocab not a multiple of the tile
	x, w := randSlice(r, tokens*hidden), randSlice(r, vocab*hidden)
	for _, k := range []int{1, 7, 64, vocab} {
		ids, lps := be.New(compute.I32, tokens*k), be.New(compute.F32, tokens*k)
		be.LMHeadTopK(ids, lps, be.FromF32(x), be.FromF32(w), tokens, hidden, vocab, k)
		gotID := make([]int32, tokens*k)
		be.ReadI32(ids, gotID)
		gotLP := F32(lps)
		for ti := 0; ti < tokens; ti++ {
			logit := make([]float64, vocab)
			// float32 logits as the GEMM makes them decide the order; the
			// float64 values are the reference for the log-probs.
			l32 := make([]float32, vocab)
			mx := math.Inf(-1)
			for j := 0; j < vocab; j++ {
				var s float64
				for p := 0; p < hidden; p++ {
					s += float64(x[ti*hidden+p]) * float64(w[j*hidden+p])
				}
				logit[j] = s
				l32[j] = float32(s)
				mx = math.Max(mx, s)
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
				if d := math.Abs(float64(gotLP[ti*k+j]) - want); d > 1e-4 {
					t.Fatalf("k=%d token %d rank %d: logprob %v want %v", k, ti, j, gotLP[ti*k+j], want)
				}
				// Ids may differ only where the float64 logits are within
				// float32 rounding of each other.
				if g != order[j] && math.Abs(logit[g]-logit[order[j]]) > 1e-5 {
					t.Fatalf("k=%d token %d rank %d: id %d (logit %v), want %d (logit %v)", k, ti, j, g, logit[g], order[j], logit[order[j]])
				}
				if j > 0 {
					// Distinct logits may round to one float32 log-prob, so
					// only the values' order is checked here (ties: below).
					if gotLP[ti*k+j-1] < gotLP[ti*k+j] {
						t.Fatalf("k=%d token %d: not sorted at rank %d", k, ti, j)
					}
				}
			}
		}
	}
}

// TestLMHeadTopKTies: with hidden=1 and x=1 the logits are exactly w, so
// ties are exact, across tiles too: the lower id must come first.
func TestLMHeadTopKTies(t *testing.T) {
	be := New()
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
	// lse = log(sum_j e^{j%7}) computed directly.
	var sum float64
	for j := 0; j < vocab; j++ {
		sum += math.Exp(float64(j % 7))
	}
	if d := math.Abs(float64(F32(lps)[0]) - (6 - math.Log(sum))); d > 1e-5 {
		t.Fatalf("logprob %v, want %v", F32(lps)[0], 6-math.Log(sum))
	}
}

func TestMoEMatchesDirect(t *testing.T) {
	be := New()
	r := rand.New(rand.NewPCG(13, 14))
	tokens, H, I, E, K := 50, 16, 24, 6, 2
	for _, norm := range []bool{false, true} {
		x := randSlice(r, tokens*H)
		router := randSlice(r, E*H)
		mw := &compute.MoEWeights{Router: be.FromF32(router), NumExperts: E, TopK: K, Hidden: H, Inter: I, NormTopK: norm}
		var gs, us, ds [][]float32
		for e := 0; e < E; e++ {
			g, u, d := randSlice(r, I*H), randSlice(r, I*H), randSlice(r, H*I)
			gs, us, ds = append(gs, g), append(us, u), append(ds, d)
			mw.Gate = append(mw.Gate, be.FromF32(g))
			mw.Up = append(mw.Up, be.FromF32(u))
			mw.Down = append(mw.Down, be.FromF32(d))
		}
		out := be.New(compute.F32, tokens*H)
		be.MoE(out, be.FromF32(x), mw, tokens)
		want := make([]float64, tokens*H)
		for ti := 0; ti < tokens; ti++ {
			xr := x[ti*H : (ti+1)*H]
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
						g += float64(xr[j]) * float64(gs[e][i*H+j])
						u += float64(xr[j]) * float64(us[e][i*H+j])
					}
					act[i] = g / (1 + math.Exp(-g)) * u
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
		close32(t, "moe", F32(out), want, 1e-4, 1e-4)
	}
}
