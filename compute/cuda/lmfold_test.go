package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"distill/compute"
)

// TestLMFoldGEMM holds the LM head's fold over a whole GEMM tile
// (k_lm_fold_gemm, the default) to the fold a launch per LM_TILE piece
// (k_lm_fold, Options.LMFold "tiles"), bit for bit: the top-k's ids and
// log-probs, and LMHeadSample's draws and tails (its block sums come
// from the fold). The cases reach each of the new kernel's paths:
//   - random logits, whose later pieces bring a few candidates (merged
//     by rank) after a first piece that brings all of them (the radix
//     select);
//   - logits rising with the id (every piece beats the whole list: a
//     select in every piece);
//   - ties across pieces and GEMM tiles (the keys' id order);
//   - k 300 and 2048 (more candidates than LM_RANKMAX: sorted, then
//     merged by co-rank), and 2049, which folds by pieces either way;
//   - a vocabulary that is not a multiple of the piece, slabs of rows,
//     and GEMM tiles of one piece and of four.
//
// The profile says which kernel ran.
func TestLMFoldGEMM(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	if be.lmFoldGEMM {
		t.Fatal("the backend folds a GEMM tile a launch by default; want k_lm_fold (DISTILL_CUDA_LM_FOLD set?)")
	}
	saveR, saveC := lmMaxRows, lmMaxCols
	defer func() { lmMaxRows, lmMaxCols = saveR, saveC }()
	r := rand.New(rand.NewPCG(61, 62))
	tokens, hidden, vocab := 24, 16, 9001
	if onGPU() {
		tokens = 300
	}
	x := randF32(r, tokens*hidden)
	for i := range x {
		x[i] *= 2
	}
	_, wrand := roundBF16(randF32(r, vocab*hidden))
	// rising: logit = x·w with w[id] = (id/vocab)·(1, ..., 1) on a
	// positive x: a rising logit for each row (up to BF16's steps, which
	// make runs of ties).
	xpos := make([]float32, tokens*hidden)
	for i := range xpos {
		xpos[i] = 0.5 + r.Float32()
	}
	wrise := make([]uint16, vocab*hidden)
	for id := 0; id < vocab; id++ {
		for c := 0; c < hidden; c++ {
			wrise[id*hidden+c] = compute.F32ToBF16(float32(id) / float32(vocab))
		}
	}
	// ties: every logit one of 7 values.
	wtie := make([]uint16, vocab*hidden)
	for id := 0; id < vocab; id++ {
		for c := 0; c < hidden; c++ {
			wtie[id*hidden+c] = compute.F32ToBF16(float32(id%7) / 4)
		}
	}
	kinds := []struct {
		name string
		x    []float32
		w    []uint16
	}{{"random", x, wrand}, {"rising", xpos, wrise}, {"ties", xpos, wtie}}

	type result struct {
		ids []int32
		lps []uint32
		ran []string
	}
	topk := func(xt, w compute.Tensor, k int, tiles bool) result {
		be.lmFoldGEMM = !tiles
		defer func() { be.lmFoldGEMM = false }()
		be.Profile() // reset
		ids, lps := be.New(compute.I32, tokens*k), be.New(compute.F32, tokens*k)
		defer be.Free(ids)
		defer be.Free(lps)
		be.LMHeadTopK(ids, lps, xt, w, tokens, hidden, vocab, k)
		res := result{ids: make([]int32, tokens*k)}
		be.ReadI32(ids, res.ids)
		for _, v := range readF32(be, lps, tokens*k) {
			res.lps = append(res.lps, math.Float32bits(v))
		}
		for _, e := range be.Profile() {
			res.ran = append(res.ran, e.Name)
		}
		return res
	}
	for _, kind := range kinds {
		w, err := be.Weight(kind.w)
		if err != nil {
			t.Fatal(err)
		}
		xt := be.FromF32(kind.x)
		for _, tiling := range [][2]int{{8192, 16384}, {7, 4096}} {
			lmMaxRows, lmMaxCols = tiling[0], tiling[1]
			for _, k := range []int{1, 7, 64, 300, 2048, 2049} {
				what := fmt.Sprintf("%s, rows %d, cols %d, k %d", kind.name, tiling[0], tiling[1], k)
				want, got := topk(xt, w, k, true), topk(xt, w, k, false)
				if !slices.Equal(got.ids, want.ids) {
					t.Fatalf("%s: the top-k ids differ from k_lm_fold's (%d of %d)", what, countDiffI32(got.ids, want.ids), len(got.ids))
				}
				if !slices.Equal(got.lps, want.lps) {
					t.Fatalf("%s: the log-probs differ from k_lm_fold's in their bits", what)
				}
				kernel := "k_lm_fold_gemm"
				if k > lmTile/2 {
					kernel = "k_lm_fold"
				}
				if !slices.Contains(got.ran, kernel) || slices.Contains(want.ran, "k_lm_fold_gemm") {
					t.Fatalf("%s: want %s by default and k_lm_fold by pieces; the kernels were %v and %v", what, kernel, got.ran, want.ran)
				}
			}
		}
		be.Free(xt)
		be.Free(w)
	}

	// LMHeadSample: the fold also keeps the blocks' sums, which the draws
	// read.
	const n = 8
	gw, err := be.Weight(wrand)
	if err != nil {
		t.Fatal(err)
	}
	xt := be.FromF32(x)
	u := make([]float64, tokens*n)
	for i := range u {
		u[i] = float64(r.Uint64()>>11) / (1 << 53)
	}
	for tok := 0; tok < tokens; tok++ {
		slices.Sort(u[tok*n : (tok+1)*n])
	}
	pu := make([]int32, 2*len(u))
	compute.PackUniforms(pu, u)
	ut := be.FromI32(pu)
	sample := func(k int, tiles bool) (ids, drawn []int32, lps, tail []uint32) {
		be.lmFoldGEMM = !tiles
		defer func() { be.lmFoldGEMM = false }()
		idT, lpT := be.New(compute.I32, tokens*k), be.New(compute.F32, tokens*k)
		drT, tlT := be.New(compute.I32, tokens*n), be.New(compute.F32, tokens)
		be.LMHeadSample(idT, lpT, drT, tlT, xt, gw, ut, tokens, hidden, vocab, k, n, k > 0)
		ids, drawn = make([]int32, tokens*k), make([]int32, tokens*n)
		be.ReadI32(idT, ids)
		be.ReadI32(drT, drawn)
		for _, v := range readF32(be, lpT, tokens*k) {
			lps = append(lps, math.Float32bits(v))
		}
		for _, v := range readF32(be, tlT, tokens) {
			tail = append(tail, math.Float32bits(v))
		}
		for _, q := range []compute.Tensor{idT, lpT, drT, tlT} {
			be.Free(q)
		}
		return ids, drawn, lps, tail
	}
	for _, tiling := range [][2]int{{8192, 16384}, {7, 4096}} {
		lmMaxRows, lmMaxCols = tiling[0], tiling[1]
		for _, k := range []int{0, 6} {
			wi, wd, wl, wt := sample(k, true)
			gi, gd, gl, gt := sample(k, false)
			what := fmt.Sprintf("LMHeadSample, rows %d, cols %d, k %d", tiling[0], tiling[1], k)
			if !slices.Equal(gi, wi) || !slices.Equal(gl, wl) {
				t.Fatalf("%s: the top-k differs from k_lm_fold's", what)
			}
			if !slices.Equal(gd, wd) || !slices.Equal(gt, wt) {
				t.Fatalf("%s: the draws or tails differ from k_lm_fold's", what)
			}
		}
	}
}
