package cpu

import (
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"distill/compute"
	"distill/compute/computetest"
)

// sampleRun is one LMHeadSample call's outputs.
type sampleRun struct {
	ids, drawn []int32
	lps, tail  []float32
}

func runLMHeadSample(be *Backend, x, w []float32, u []float64, tokens, hidden, vocab, k, n int, head bool) sampleRun {
	ids, lps := be.New(compute.I32, tokens*k), be.New(compute.F32, tokens*k)
	drawn, tail := be.New(compute.I32, tokens*n), be.New(compute.F32, tokens)
	pu := make([]int32, 2*len(u))
	compute.PackUniforms(pu, u)
	be.LMHeadSample(ids, lps, drawn, tail, be.FromF32(x), be.FromF32(w), be.FromI32(pu), tokens, hidden, vocab, k, n, head)
	return sampleRun{ids: slices.Clone(i32(ids)), drawn: slices.Clone(i32(drawn)), lps: slices.Clone(f32(lps)), tail: slices.Clone(f32(tail))}
}

// TestLMHeadSampleGroupsThreads: the draws, tail masses and top-k do not
// depend on the worker count or on how the rows are grouped (several
// groups forced by a small lmSampleRows: the pass, the head blocks and
// the draw blocks each group's own), bit for bit; and they are the
// float64 inverse CDF's of the fp32 logits up to CDFTol at a shape of
// many tiles (10000 ids: 5 tiles of 2048, 157 blocks) and 700 rows, with
// the top-k's blocks from the logits the pass carries and without them.
func TestLMHeadSampleGroupsThreads(t *testing.T) {
	r := rand.New(rand.NewPCG(31, 32))
	tokens, hidden, vocab, n := 700, 16, 10000, 40
	x, w := make([]float32, tokens*hidden), make([]float32, vocab*hidden)
	for i := range x {
		x[i] = float32(r.NormFloat64())
	}
	for i := range w {
		w[i] = float32(r.NormFloat64() * 0.6)
	}
	u := make([]float64, tokens*n)
	for i := range u {
		u[i] = float64(r.Uint64()>>11) / (1 << 53)
	}
	for t0 := 0; t0 < tokens; t0++ {
		slices.Sort(u[t0*n : (t0+1)*n])
	}
	defer func(f func(int) int) { lmSampleRows = f }(lmSampleRows)
	for _, c := range []struct {
		k    int
		head bool
	}{{0, false}, {6, true}} {
		var base sampleRun
		for i, cfg := range []struct{ threads, group int }{{1, 0}, {3, 0}, {2, 256}, {5, 512}} {
			lmSampleRows = func(threads int) int {
				if cfg.group > 0 {
					return cfg.group
				}
				return lmRows * max(4, threads)
			}
			got := runLMHeadSample(New(cfg.threads), x, w, u, tokens, hidden, vocab, c.k, n, c.head)
			if i == 0 {
				base = got
				continue
			}
			if !slices.Equal(got.drawn, base.drawn) || !slices.Equal(got.ids, base.ids) ||
				!slices.Equal(got.lps, base.lps) || !slices.Equal(got.tail, base.tail) {
				t.Fatalf("k %d head %v: threads %d, groups of %d rows: not the outputs of one worker and one group", c.k, c.head, cfg.threads, cfg.group)
			}
		}
		runs := []sampleRun{base}
		if c.head {
			// The top-k's blocks without the logits the pass carries
			// (k > lmPayloadK): their sums less the top-k's exps, or
			// computed again.
			defer func(v int) { lmPayloadK = v }(lmPayloadK)
			lmPayloadK = 0
			runs = append(runs, runLMHeadSample(New(2), x, w, u, tokens, hidden, vocab, c.k, n, c.head))
			lmPayloadK = 256
		}
		for ri, base := range runs {
			// Against the float64 reference from the fp32 operands.
			diff := 0
			for ti := 0; ti < tokens; ti += 7 {
				logit := make([]float64, vocab)
				mx := math.Inf(-1)
				for j := range logit {
					var s float64
					for q := 0; q < hidden; q++ {
						s += float64(x[ti*hidden+q]) * float64(w[j*hidden+q])
					}
					logit[j], mx = s, math.Max(mx, s)
				}
				var sum float64
				for _, l := range logit {
					sum += math.Exp(l - mx)
				}
				p := make([]float64, vocab)
				for j, l := range logit {
					p[j] = math.Exp(l-mx) / sum
				}
				var hd []int32
				if c.head {
					hd = base.ids[ti*c.k : (ti+1)*c.k]
				}
				ur := u[ti*n : (ti+1)*n]
				want, mass := computetest.InverseCDF(p, hd, ur)
				if d := math.Abs(float64(base.tail[ti]) - mass); d > 1e-5*mass {
					t.Fatalf("k %d: token %d: tail mass %v, want %v", c.k, ti, base.tail[ti], mass)
				}
				for d := range ur {
					if why := computetest.CheckDraw(p, hd, ur[d], base.drawn[ti*n+d], want[d], computetest.FP32.CDFTol); why != "" {
						t.Fatalf("k %d: token %d draw %d: %s", c.k, ti, d, why)
					}
					if base.drawn[ti*n+d] != want[d] {
						diff++
					}
				}
			}
			t.Logf("k %d head %v run %d: %d draws differ from the float64 reference (within CDFTol of a step)", c.k, c.head, ri, diff)
		}
	}
}

// TestLMHeadSampleBadInput: what LMHeadSample refuses, by panicking with
// the reason (a caller's bug: package infer validates draws first).
func TestLMHeadSampleBadInput(t *testing.T) {
	be := New(1)
	x, w := be.FromF32([]float32{1}), be.FromF32([]float32{1, 2, 3})
	for _, c := range []struct {
		k, n int
		head bool
		want string
	}{
		{0, 0, false, "0 draws per token"},
		{0, 2, true, "head needs k >= 1"},
		{4, 2, false, "top-k 4 of a vocabulary of 3"},
	} {
		func() {
			defer func() {
				if r := recover(); r == nil || !contains(r, c.want) {
					t.Errorf("k %d n %d head %v: panic %v, want one naming %q", c.k, c.n, c.head, r, c.want)
				}
			}()
			ids, lps := be.New(compute.I32, 4), be.New(compute.F32, 4)
			dr, tl, u := be.New(compute.I32, 4), be.New(compute.F32, 1), be.New(compute.I32, 8)
			be.LMHeadSample(ids, lps, dr, tl, x, w, u, 1, 1, 3, c.k, c.n, c.head)
		}()
	}
}

func contains(r any, sub string) bool {
	s, ok := r.(string)
	return ok && strings.Contains(s, sub)
}

// TestByBlock: byBlock's counting sort gives what a stable sort by block
// gives (the order blockLogits hands pairs to its callers in), and the
// runs' starts, on random pairs with repeated blocks and empty ones.
func TestByBlock(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, c := range []struct{ n, nblk int }{{0, 5}, {1, 1}, {50, 3}, {2000, 157}, {3000, 5000}} {
		pairs := make([]blockPair, c.n)
		for i := range pairs {
			pairs[i] = blockPair{row: int32(r.IntN(100)), blk: int32(r.IntN(c.nblk)), d0: int32(i), d1: int32(i + 1)}
		}
		want := slices.Clone(pairs)
		slices.SortStableFunc(want, func(a, b blockPair) int { return int(a.blk) - int(b.blk) })
		got, starts := byBlock(slices.Clone(pairs), c.nblk)
		if !slices.Equal(got, want) {
			t.Fatalf("%d pairs over %d blocks: not the stable sort by block", c.n, c.nblk)
		}
		var ws []int
		for i := range want {
			if i == 0 || want[i].blk != want[i-1].blk {
				ws = append(ws, i)
			}
		}
		if ws = append(ws, len(want)); !slices.Equal(starts, ws) {
			t.Fatalf("%d pairs over %d blocks: starts %v, want %v", c.n, c.nblk, starts, ws)
		}
	}
}

// TestBlockSumsV4Order: on a CPU that runs the x86-64-v4 clones, the pass's
// block sums (block_sums_v4: 16 blocks at a time through a transposition)
// are each block's sum in the order the loop they replace summed in there,
// bit for bit: 16 lanes, lane l summing e[l], e[16+l], ... over the whole
// chunks of 16, lane 0 then the last len%16 terms, then the lanes 0 to 15
// (float32 sums, as written out below). Tiles whole and cut short, blocks
// whole and partial; exps of a wide spread, some 0, so that another order
// gives other bits.
func TestBlockSumsV4Order(t *testing.T) {
	ref := func(e []float32) float32 {
		var v [16]float32
		c := len(e) - len(e)%16
		for i := 0; i < c; i += 16 {
			for l := range v {
				v[l] += e[i+l]
			}
		}
		for _, x := range e[c:] {
			v[0] += x
		}
		var s float32
		for _, x := range v {
			s += x
		}
		return s
	}
	r := rand.New(rand.NewPCG(41, 42))
	for _, n := range []int{2048, 1024, 1030, 384, 904, 70, 13, 1, 3000, 100, 1100, 2047, 4001, 1023, 120, 125} {
		e := make([]float32, n)
		for i := range e {
			if r.IntN(6) > 0 {
				e[i] = float32(math.Exp(-20 * r.Float64()))
			}
		}
		bs := make([]float32, (n+63)/64)
		if !blockSumsV4(bs, e) {
			t.Skip("this CPU does not run the x86-64-v4 clones: the pass's block sums are its loop's, in the compiler's order")
		}
		for b := range bs {
			want := ref(e[b*64 : min((b+1)*64, n)])
			if math.Float32bits(bs[b]) != math.Float32bits(want) {
				t.Fatalf("%d ids: block %d sums to %g (bits %#x), want %g (%#x) in the lanes' order", n, b, bs[b], math.Float32bits(bs[b]), want, math.Float32bits(want))
			}
		}
	}
}

// TestTileMaxSum: the fold's tile_max_sum (the exps stored and summed in
// one pass) gives the bits of the three passes it replaced (the max, the
// exps, their sum: tile_max_sum_ref), in the clone this CPU runs: the max,
// every exp and the sum, whose order is the `omp simd reduction`'s (the
// clone's lanes, the remainder into lane 0, then the lanes in order).
// Rows of every length class (whole and partial vectors, 1, empty), of
// spreads up to far more than 87 below the max (terms 0), with -Inf, ties
// at the max, logits exactly 87 below it and a float either side, ±0 as
// the max, and rows all -Inf or with a NaN or +Inf. The sums are checked
// to depend on the order (a plain sequential sum of the same exps differs
// in most rows), so that a fold summing in another order fails here.
func TestTileMaxSum(t *testing.T) {
	r := rand.New(rand.NewPCG(61, 62))
	lens := []int{2048, 384, 0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 100, 127, 1023, 1030, 2047, 2049}
	inf := float32(math.Inf(1))
	var rows, orderSensitive int
	for it := 0; it < 3000; it++ {
		n := lens[it%len(lens)]
		if it >= 2*len(lens) && it%3 == 0 {
			n = r.IntN(2100)
		}
		spread := []float64{0.5, 5, 30, 86, 90, 200, 1e4}[it%7]
		base := float32(r.Float64()*40 - 20)
		if it%4 == 0 {
			base = 0 // exactly 87 below is representable
		}
		row := make([]float32, n)
		for i := range row {
			row[i] = base - float32(r.Float64()*spread)
			switch r.IntN(40) {
			case 0:
				row[i] = -inf
			case 1:
				row[i] = base // ties at the max
			case 2:
				row[i] = base - 87
			case 3:
				row[i] = math.Nextafter32(base-87, 0)
			case 4:
				row[i] = math.Nextafter32(base-87, -inf)
			}
		}
		if n > 0 {
			row[r.IntN(n)] = base // the max
			switch it % 29 {
			case 5:
				row[r.IntN(n)] = float32(math.NaN())
			case 6:
				row[r.IntN(n)] = inf
			case 7:
				for i := range row {
					row[i] = -inf
				}
			case 8:
				for i := range row {
					row[i] = float32(math.Copysign(0, float64(r.IntN(2)*2-1)))
				}
			}
		}
		e, eref := make([]float32, n), make([]float32, n)
		m, s := tileMaxSum(false, row, e)
		mref, sref := tileMaxSum(true, row, eref)
		if math.Float32bits(m) != math.Float32bits(mref) || math.Float32bits(s) != math.Float32bits(sref) {
			t.Fatalf("row %d (%d ids, spread %g): max %g sum %g (bits %#x), the three passes give %g and %g (%#x)",
				it, n, spread, m, s, math.Float32bits(s), mref, sref, math.Float32bits(sref))
		}
		for i := range e {
			if math.Float32bits(e[i]) != math.Float32bits(eref[i]) {
				t.Fatalf("row %d (%d ids): exp of id %d (logit %g, max %g) is %g (bits %#x), the three passes give %g (%#x)",
					it, n, i, row[i], m, e[i], math.Float32bits(e[i]), eref[i], math.Float32bits(eref[i]))
			}
		}
		var seq float32
		for _, x := range e {
			seq += x
		}
		if math.Float32bits(seq) != math.Float32bits(s) {
			orderSensitive++
		}
		rows++
	}
	if orderSensitive < rows/4 {
		t.Fatalf("only %d of %d rows' sums depend on the order of the terms: the check above would miss a fold summing in another order", orderSensitive, rows)
	}
}

// TestDexp checks the walks' exp (dexp8) against math.Exp: within 1 ulp of
// it where the result is normal, within one subnormal step below, exactly
// 0 below -745.2 (and for -Inf) and exactly 1 at 0, for arguments over the
// whole range a walk meets (a logit minus the row's max: at most a
// rounding above 0) and the lanes of a partial group of 8.
func TestDexp(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	var xs []float64
	for i := 0; i < 20000; i++ {
		xs = append(xs, -r.Float64()*760)
	}
	for i := 0; i < 2000; i++ {
		xs = append(xs, -r.Float64()*0.01, r.Float64()*1e-6, -708-r.Float64()*40)
	}
	xs = append(xs, 0, -745.1, -745.3, -708.4, -708.39, math.Inf(-1), -1e300, 1e-300, -0.5*math.Ln2, 0.5*math.Ln2)
	// z = 0 and mx = -x: float64(z) - mx is x exactly.
	z := make([]float32, 1)
	e := make([]float64, 1)
	ulps := func(got, want float64) float64 {
		return math.Abs(got-want) / (math.Nextafter(want, math.Inf(1)) - want)
	}
	var worst float64
	for _, x := range xs {
		dexp(e, z, -x)
		want := math.Exp(x)
		switch {
		case x < -745.2 || math.IsInf(x, -1):
			if e[0] != 0 {
				t.Fatalf("exp(%g) = %g, want 0", x, e[0])
			}
		case want < 0x1p-1022:
			if math.Abs(e[0]-want) > 0x1p-1074 {
				t.Fatalf("exp(%g) = %g, want %g (more than a subnormal step)", x, e[0], want)
			}
		default:
			u := ulps(e[0], want)
			worst = math.Max(worst, u)
			if u > 1 {
				t.Fatalf("exp(%g) = %.17g, want %.17g: %.2f ulp", x, e[0], want, u)
			}
		}
	}
	dexp(e, z, 0)
	if e[0] != 1 {
		t.Fatalf("exp(0) = %.17g", e[0])
	}
	// Many at once: each lane as alone (groups of 8 and a partial one).
	zs := make([]float32, 77)
	for i := range zs {
		zs[i] = float32(-r.Float64() * 50)
	}
	es := make([]float64, len(zs))
	dexp(es, zs, 0.25)
	for i, zv := range zs {
		dexp(e, []float32{zv}, 0.25)
		if es[i] != e[0] {
			t.Fatalf("lane %d: %g in a group, %g alone", i, es[i], e[0])
		}
	}
	t.Logf("worst normal result: %.3f ulp from math.Exp over %d arguments", worst, len(xs))
}

// TestFastWalk checks the walks k_draw_walks runs (fast_walk: the head as
// a mask, the thresholds tested only where the sum moves) against the
// plain walk an id at a time, draw for draw, over blocks whole and
// partial, with head ids in and out of the block (a block all head),
// terms that underflow to 0 (a block with none left), and thresholds at 0,
// exactly at running sums (ties: the next id with mass), past the
// block's sum (rounding: its last id with mass) and +Inf.
func TestFastWalk(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	const B = compute.SampleBlock
	var cases, ties, past int
	for it := 0; it < 4000; it++ {
		nz := B
		if it%3 == 1 {
			nz = 1 + r.IntN(B)
		}
		v0 := int32(B * r.IntN(1000))
		z := make([]float32, nz)
		spread := []float64{0.5, 5, 60, 900}[it%4] // the last: most terms underflow
		for j := range z {
			z[j] = float32(-r.Float64() * spread)
		}
		mx := 0.0
		if it%17 == 0 {
			mx = 800 // every term 0
		}
		var head []int32
		switch it % 5 {
		case 1, 2:
			for range 1 + r.IntN(8) {
				head = append(head, v0+int32(r.IntN(nz)))
			}
			head = append(head, v0-3, v0+B+5) // outside the block
		case 3:
			for j := range nz {
				if nz < 9 {
					head = append(head, v0+int32(j)) // the whole block
				}
			}
		}
		slices.Sort(head)
		head = slices.Compact(head)
		// The running sums as the walks form them (the head's terms out).
		e := make([]float64, nz)
		dexp(e, z, mx)
		var sums []float64
		c := 0.0
		for j := range nz {
			if !slices.Contains(head, v0+int32(j)) && e[j] != 0 {
				c += e[j]
				sums = append(sums, c)
			}
		}
		nd := 1 + r.IntN(12)
		thr := make([]float64, nd)
		for d := range thr {
			switch x := r.IntN(10); {
			case x == 0:
				thr[d] = 0
			case x <= 2 && len(sums) > 0:
				thr[d] = sums[r.IntN(len(sums))]
				ties++
			case x == 3:
				thr[d] = c * (1 + r.Float64()*0.01)
				past++
			case x == 4:
				thr[d] = math.Inf(1)
			default:
				thr[d] = r.Float64() * c
			}
		}
		slices.Sort(thr)
		want, got := make([]int32, nd), make([]int32, nd)
		drawWalk(true, want, z, v0, mx, head, thr)
		drawWalk(false, got, z, v0, mx, head, thr)
		if !slices.Equal(got, want) {
			t.Fatalf("case %d (nz %d, v0 %d, head %v, thresholds %v): fast walk %v, plain walk %v", it, nz, v0, head, thr, got, want)
		}
		for d, v := range want {
			if v >= 0 && (v < v0 || v >= v0+int32(nz) || slices.Contains(head, v)) {
				t.Fatalf("case %d: draw %d is id %d, outside block [%d, %d) or in the head %v", it, d, v, v0, v0+int32(nz), head)
			}
		}
		cases++
	}
	t.Logf("%d pairs, %d thresholds at a running sum, %d past the block's sum", cases, ties, past)
}

// locateRef is k_draw_locate as one pass over the tiles and their blocks
// (the form it had before it asked for the tiles' block sums ahead): the
// same sums in the same order (float64 conversions keep Go from fusing a
// multiply and an add).
func locateRef(bs []float32, sc, tsum []float64, spt int, u []int32, mass float64, blk []int32, thr []float64) {
	nblk, ntile := len(bs), len(tsum)
	lt := ntile - 1
	for lt > 0 && !(tsum[lt] > 0) {
		lt--
	}
	t, j := 0, 0
	cum, T, cj := 0.0, float64(tsum[0]*sc[0]), 0.0
	for d := range blk {
		x := float64(compute.Uniform(u[2*d], u[2*d+1]) * mass)
		for t < ntile && cum+T <= x {
			cum += T
			t++
			j, cj = t*spt, 0
			if t < ntile {
				T = float64(tsum[t] * sc[t])
			}
		}
		tt := t
		if t == ntile {
			tt = lt
		}
		end := min((tt+1)*spt, nblk)
		if t < ntile {
			xl := x - cum
			for j < end && cj+float64(float64(bs[j])*sc[t]) <= xl {
				cj += float64(float64(bs[j]) * sc[t])
				j++
			}
			if j < end {
				blk[d], thr[d] = int32(j), xl-cj
				continue
			}
		}
		lb := end - 1
		for lb > tt*spt && !(bs[lb] > 0) {
			lb--
		}
		blk[d], thr[d] = int32(lb), math.Inf(1)
	}
}

// TestDrawLocate checks k_draw_locate (the tiles first, their block sums
// asked for, then the blocks) against the one-pass locating it replaced,
// block for block and threshold bit for bit: rows of several tiles with
// empty tiles and blocks, thresholds many to a tile and a tile each, a
// tile whose total exceeds its blocks' sum and a mass above the tiles'
// (the rounding cases: the last block with mass, threshold +Inf), and
// uniforms at 0 and just below 1.
func TestDrawLocate(t *testing.T) {
	r := rand.New(rand.NewPCG(21, 22))
	const spt = 32
	var rounding, pastTile int
	for it := 0; it < 2000; it++ {
		ntile := 1 + r.IntN(6)
		nblk := ntile*spt - r.IntN(spt) // the last tile partial
		bs := make([]float32, nblk)
		for j := range bs {
			if r.IntN(4) > 0 {
				bs[j] = float32(r.ExpFloat64())
			}
		}
		tsum, sc := make([]float64, ntile), make([]float64, ntile)
		var mass float64
		for tl := range tsum {
			if it%3 == 0 && r.IntN(3) == 0 {
				for j := tl * spt; j < min((tl+1)*spt, nblk); j++ {
					bs[j] = 0 // an empty tile
				}
			}
			for j := tl * spt; j < min((tl+1)*spt, nblk); j++ {
				tsum[tl] += float64(bs[j])
			}
			if it%5 == 1 && r.IntN(2) == 0 {
				tsum[tl] *= 1.3 // more than its blocks hold (rounding, writ large)
			}
			sc[tl] = math.Exp(-r.Float64() * 5)
			mass += float64(tsum[tl] * sc[tl])
		}
		if !(mass > 0) {
			continue
		}
		if it%7 == 2 {
			mass *= 1 + 1e-6 // more than the tiles hold
		}
		n := []int{1, 3, 50, 200}[it%4]
		us := make([]float64, n)
		for d := range us {
			us[d] = float64(r.Uint64()>>11) / (1 << 53)
		}
		us[0] = 0
		if n > 1 {
			us[n-1] = 1 - 0x1p-53
		}
		slices.Sort(us)
		u := make([]int32, 2*n)
		compute.PackUniforms(u, us)
		gb, wb := make([]int32, n), make([]int32, n)
		gt, wt := make([]float64, n), make([]float64, n)
		drawLocate(bs, sc, tsum, spt, u, mass, gb, gt)
		locateRef(bs, sc, tsum, spt, u, mass, wb, wt)
		for d := range gb {
			if gb[d] != wb[d] || math.Float64bits(gt[d]) != math.Float64bits(wt[d]) {
				t.Fatalf("case %d (%d tiles, %d blocks, %d draws): draw %d at block %d threshold %v, want block %d threshold %v", it, ntile, nblk, n, d, gb[d], gt[d], wb[d], wt[d])
			}
			if math.IsInf(wt[d], 1) {
				rounding++
				if int(wb[d]) < len(bs)-spt {
					pastTile++ // not in the last tile: past a tile's blocks
				}
			}
		}
	}
	if rounding == 0 || pastTile == 0 {
		t.Fatalf("%d draws took a rounding path, %d past a tile's blocks: the cases do not cover them", rounding, pastTile)
	}
	t.Logf("%d draws past a tile's blocks or the tiles' sum (%d of them before the last tile)", rounding, pastTile)
}
