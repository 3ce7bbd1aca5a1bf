package cpu

// #include "kernels.h"
import "C"

import (
	"fmt"
	"slices"
	"unsafe"

	"distill/compute"
)

// LMHeadSample implements compute.Backend. The rows go in groups of up to
// lmSampleRows(); for each group:
//
//  1. the pass over the vocabulary tiles of LMHeadTopK (the same SGEMMs
//     and fold, so the top-k is LMHeadTopK's bit for bit) also keeps, per
//     row and tile, the tile's max, the sums of exp(z - tile max) over
//     its blocks of compute.SampleBlock ids (fp32 sums of the exps the
//     fold computes anyway; on x86-64-v4, 16 blocks at a time in the
//     order the loop's v4 clone summed in, k_lse_topk's block_sums_v4)
//     and their total (double);
//  2. under head, the blocks holding top-k ids have their mass outside
//     the top-k summed exactly in double (from their logits, which the
//     top-k's entries carried through the pass), and their tiles'
//     totals summed again;
//  3. each row's mass Σ_t total_t·exp(max_t - row max) is its tail mass
//     (over the log-sum-exp's sum), and its thresholds u·mass are located
//     among the tiles' and then the blocks' cumulative sums
//     (k_draw_locate); steps 2 and 3 are one phase on the workers, a row
//     at a time;
//  4. the (row, block) pairs that hold a threshold are grouped by block,
//     their logits computed again (k_block_logits, the block's weights
//     read once for all its rows, the worker's next block asked for
//     ahead), and k_draw_walks walks the block's pairs (one cgo call a
//     block) in double, ids ascending, to their thresholds, the terms
//     exp(z - row max) 8 at a time by dexp8 (an own vectorized double
//     exp, within 1 ulp of math.Exp) as far as each walk goes, the head's
//     ids a bit mask whose terms count 0 (fast_walk: an add, a compare and
//     a branch an id).
//
// Beside LMHeadTopK's pass, this multiplies again at most (k + n) blocks
// of 64 ids a row: with k 8 and n 50 about 2.4% of a 151936-id head, far
// fewer where the draws share blocks (a peaked softmax). With the block's
// weights prefetched, that is the arithmetic (BenchmarkBlockLogits: about
// 0.8 G multiply-adds a call of 1024 rows, 22 CPU-ms). What a head+sampled
// fill spends beyond a topk one is, by profile (the quick start's trained
// teacher, hidden 128, whose LM head is most of its forward;
// docs/sampled-targets.md): the blocks multiplied again with their
// weights' transposition (about 0.9% of a topk fill's CPU time), the
// walks and the block sums (0.5% each), locating (0.4%), the head blocks'
// masses (0.2%); the whole fill about 3-5% (docs/sampled-targets.md).
// Against the LM head of a Qwen3-0.6B-shaped teacher (hidden 1024) the
// same costs are within the runs' spread. The outputs
// do not depend on the worker count or on the grouping (each logit of a
// block is computed again by the same code, whichever rows share the
// block). Scratch beside the pass's, per row of a group: the block sums
// and tile statistics (4·⌈V/64⌉ + 12·⌈V/2048⌉ bytes; the block sums, and
// under head the top-k's blocks (256·k bytes), from the backend's free
// list) and n thresholds (8·n bytes).
func (be *Backend) LMHeadSample(ids, logprobs, drawn, tail, x, w, u compute.Tensor, tokens, hidden, vocab, k, n int, head bool) {
	idOut, lpOut, dOut, tOut, us := i32(ids), f32(logprobs), i32(drawn), f32(tail), i32(u)
	xs, ws := f32(x), f32(w)
	switch {
	case n < 1:
		panic(fmt.Sprintf("cpu: LMHeadSample with %d draws per token", n))
	case head && k < 1:
		panic("cpu: LMHeadSample: head needs k >= 1")
	case k < 0 || k > vocab:
		panic(fmt.Sprintf("cpu: LMHeadSample top-k %d of a vocabulary of %d", k, vocab))
	case len(idOut) < tokens*k || len(lpOut) < tokens*k || len(dOut) < tokens*n || len(tOut) < tokens ||
		len(us) < 2*tokens*n || len(xs) < tokens*hidden || len(ws) < vocab*hidden:
		panic("cpu: LMHeadSample: a tensor is smaller than its shape")
	}
	const B = compute.SampleBlock
	G := lmSampleRows(be.threads)
	nblk, ntile := (vocab+B-1)/B, (vocab+lmTile-1)/lmTile
	g := min(G, tokens)
	// The block sums (39 MB for 4096 rows of a 151936-id head) and the
	// top-k's blocks come from the free list, dirty: the pass writes every
	// block sum of a group's rows and every top-k entry's block before
	// they are read. (Allocated per call, their zeroing and first-touch
	// page faults cost about 0.5% of a head+sampled call's CPU time.)
	blk := &lmBlocks{rmax: make([]float32, g), rsum: make([]float64, g), bsum: be.scratch(g * nblk),
		tmax: make([]float32, g*ntile), tsum: make([]float64, g*ntile), nblk: nblk, ntile: ntile, topz: make([]float32, g*k)}
	defer be.release(blk.bsum)
	if head && k <= lmPayloadK {
		blk.topb = be.scratch(g * k * B)
		defer be.release(blk.topb)
	}
	thr := make([]float64, g*n)
	for g0 := 0; g0 < tokens; g0 += G {
		nr := min(G, tokens-g0)
		var top []int32
		if k > 0 {
			top = idOut[g0*k : (g0+nr)*k]
		}
		be.lmHead(top, lpOut[g0*k:(g0+nr)*k], xs[g0*hidden:(g0+nr)*hidden], ws, nr, hidden, vocab, k, blk)
		be.sampleGroup(blk, top, dOut[g0*n:(g0+nr)*n], tOut[g0:g0+nr], us[2*g0*n:2*(g0+nr)*n], thr,
			xs[g0*hidden:(g0+nr)*hidden], ws, nr, hidden, vocab, k, n, head)
	}
}

// k_block_logits computes blocks of 64 ids: compute.SampleBlock must be 64.
var (
	_ [compute.SampleBlock - 64]struct{}
	_ [64 - compute.SampleBlock]struct{}
)

// byBlock returns pairs grouped by block, ascending, each block's pairs in
// their order in pairs (what a stable sort by block gives), and the start
// of each block's run, then len(pairs). A counting sort: a flat softmax
// gives about n pairs a row, 51200 for 1024 rows at n 50, which a
// comparison sort (slices.SortStableFunc, insertion sorts and in-place
// merges) spent about 1% of a sampled fill's CPU time on.
func byBlock(pairs []blockPair, nblk int) ([]blockPair, []int) {
	at := make([]int32, nblk+1) // pairs of blocks below b, then the next slot of b
	for _, p := range pairs {
		at[p.blk+1]++
	}
	var starts []int
	for b := 0; b < nblk; b++ {
		if at[b+1] > 0 {
			starts = append(starts, int(at[b]))
		}
		at[b+1] += at[b]
	}
	out := make([]blockPair, len(pairs))
	for _, p := range pairs {
		out[at[p.blk]] = p
		at[p.blk]++
	}
	return out, append(starts, len(pairs))
}

// blockSumsV4 writes to bs (⌈len(e)/64⌉) the sums of e over its blocks of
// 64 as the pass sums them on a CPU that runs the x86-64-v4 clones
// (block_sums_v4), and reports false, writing nothing, on one that does
// not (the pass's loop sums in the compiler's order there).
func blockSumsV4(bs, e []float32) bool {
	if len(bs) < (len(e)+63)/64 {
		panic("cpu: blockSumsV4: bs is shorter than e's blocks")
	}
	return len(e) == 0 || C.k_block_sums_v4(fp(bs), fp(e), C.long(len(e))) != 0
}

// tileMaxSum runs the fold's tile_max_sum on one row (for tests): its max
// and Σ exp(row - max), leaving the exps in e (len(row)); with ref, the
// three-pass form it replaced (tile_max_sum_ref), whose bits it must give.
func tileMaxSum(ref bool, row, e []float32) (mx, sum float32) {
	if len(e) < len(row) {
		panic("cpu: tileMaxSum: e is shorter than row")
	}
	var m, s C.float
	flag := C.int(0)
	if ref {
		flag = 1
	}
	C.k_tile_max_sum(fp(row), C.long(len(row)), &m, &s, fp(e), flag)
	return float32(m), float32(s)
}

// dexp writes to e (len(z)) exp(float64(z[i]) - mx) as the draws' walks
// and the head blocks' masses compute their terms (k_dexp: dexp8, for
// tests).
func dexp(e []float64, z []float32, mx float64) {
	if len(e) < len(z) {
		panic("cpu: dexp: e is shorter than z")
	}
	if len(z) > 0 {
		C.k_dexp((*C.double)(unsafe.Pointer(&e[0])), fp(z), C.long(len(z)), C.double(mx))
	}
}

// drawWalk places the draws of one (row, block) pair as k_draw_walks does
// (fast_walk), or, plain, by the walk an id at a time it must agree with
// (draw_walk; for tests): z the block's logits of ids v0.., mx the row's
// max, head its top-k ids ascending, thr the thresholds ascending.
func drawWalk(plain bool, out []int32, z []float32, v0 int32, mx float64, head []int32, thr []float64) {
	if len(out) < len(thr) || len(z) == 0 || len(z) > compute.SampleBlock || len(thr) == 0 {
		panic("cpu: drawWalk: bad shapes")
	}
	var hp *C.int32_t
	if len(head) > 0 {
		hp = ip(head)
	}
	zc, nz, nh, nd := fp(z), C.int(len(z)), C.int(len(head)), C.int(len(thr))
	tc, oc := (*C.double)(unsafe.Pointer(&thr[0])), ip(out)
	if plain {
		C.k_draw_walk(zc, nz, C.int32_t(v0), C.double(mx), hp, nh, tc, nd, oc)
	} else {
		C.k_fast_walk(zc, nz, C.int32_t(v0), C.double(mx), hp, nh, tc, nd, oc)
	}
}

// drawLocate runs k_draw_locate on one row (for tests): bs its block
// sums, sc and tsum its tiles' scales and totals (spt blocks a tile), u
// its uniforms as PackUniforms writes them, into blk and thr.
func drawLocate(bs []float32, sc, tsum []float64, spt int, u []int32, mass float64, blk []int32, thr []float64) {
	n := len(blk)
	if len(thr) < n || len(u) < 2*n || len(sc) < len(tsum) || len(tsum) == 0 || n == 0 || len(bs) > len(tsum)*spt {
		panic("cpu: drawLocate: bad shapes")
	}
	C.k_draw_locate(fp(bs), C.long(len(bs)), (*C.double)(unsafe.Pointer(&sc[0])), (*C.double)(unsafe.Pointer(&tsum[0])),
		C.long(len(tsum)), C.long(spt), ip(u), C.int(n), C.double(mass), ip(blk), (*C.double)(unsafe.Pointer(&thr[0])))
}

// lmSampleRows is how many rows LMHeadSample keeps block sums for at once:
// enough slabs to keep every worker busy in the pass, at least 4096. A
// group multiplies again each block its draws land in once, for all its
// rows: under head+sampled's spread draws nearly every block of the
// vocabulary a group, its weights read from memory and transposed, so
// the fewer the groups the less of that (the quick start's teacher,
// hidden 128: the blocks' logits 819 perf samples a fill at 1024 rows, 655
// at 2048, 533 at 4096, beside the draws' total of about 3000), for block
// sums of 4·⌈V/64⌉ bytes a row (39 MB at 4096 rows of a 151936-id head).
// (A variable: tests force several groups on small shapes.)
var lmSampleRows = func(threads int) int { return lmRows * max(16, threads) }

// blockPair is a (row, block) pair of LMHeadSample: the block's logits of
// the row are needed, for the draws [d0, d1) of the row (or for the
// block's mass outside the head).
type blockPair struct {
	row, blk int32
	d0, d1   int32
}

// k_draw_walks reads blockPairs as C's struct draw_pair.
var (
	_ [unsafe.Sizeof(blockPair{}) - unsafe.Sizeof(C.struct_draw_pair{})]struct{}
	_ [unsafe.Sizeof(C.struct_draw_pair{}) - unsafe.Sizeof(blockPair{})]struct{}
	_ [unsafe.Offsetof(blockPair{}.d1) - unsafe.Offsetof(C.struct_draw_pair{}.d1)]struct{}
	_ [unsafe.Offsetof(C.struct_draw_pair{}.d1) - unsafe.Offsetof(blockPair{}.d1)]struct{}
)

// sampleGroup runs steps 2-4 of LMHeadSample over the nr rows of one group,
// whose pass left blk; top is the group's top-k (nr, k), drawn (nr, n),
// tail (nr) and u (nr, n, 2) its outputs and uniforms, thr scratch (nr·n).
func (be *Backend) sampleGroup(blk *lmBlocks, top, drawn []int32, tail []float32, u []int32, thr []float64, xs, ws []float32, nr, hidden, vocab, k, n int, head bool) {
	g := &groupSampler{be: be, blk: blk, top: top, drawn: drawn, tail: tail, u: u, thr: thr, xs: xs, ws: ws,
		nr: nr, hidden: hidden, vocab: vocab, k: k, n: n, head: head}
	if head {
		// The top-k ids of each row, ascending.
		g.heads = slices.Clone(top)
		for r := 0; r < nr; r++ {
			slices.Sort(g.heads[r*k : (r+1)*k])
		}
		if blk.topb == nil {
			g.dominatedMasses()
		}
	}
	// 2 and 3, one phase on the workers (each row writes its own sums and
	// pairs): with a head, the row's head blocks' masses and tile totals;
	// then its mass to draw from, its thresholds and their pairs.
	rowPairs := make([][]blockPair, nr)
	B, bpt := compute.SampleBlock, lmTile/compute.SampleBlock
	cost := blk.ntile + n*bpt
	if head {
		cost += k * (B + bpt)
	}
	be.rows(nr, cost, func(_, lo, hi int) {
		bl, sc := make([]int32, n), make([]float64, blk.ntile)
		for r := lo; r < hi; r++ {
			if head {
				if blk.topb != nil {
					g.headMasses(r)
				}
				g.tileSums(r)
			}
			rowPairs[r] = g.locate(r, bl, sc)
		}
	})
	g.walk(slices.Concat(rowPairs...))
}

// groupSampler is one group's state through steps 2-4 of LMHeadSample
// (sampleGroup's arguments; heads, under head, each row's top-k ids
// ascending).
type groupSampler struct {
	be                      *Backend
	blk                     *lmBlocks
	top, heads, drawn, u    []int32
	tail                    []float32
	thr                     []float64
	xs, ws                  []float32
	nr, hidden, vocab, k, n int
	head                    bool
}

// headOf is row r's top-k ids ascending (nil without a head).
func (g *groupSampler) headOf(r int) []int32 {
	if !g.head {
		return nil
	}
	return g.heads[r*g.k : (r+1)*g.k]
}

// headMasses (2, the pass left each top-k id's block logits: no weights
// to read again) writes row r's head blocks' masses outside the top-k,
// relative to their tile's max as the pass left the others, in double
// from those logits.
func (g *groupSampler) headMasses(r int) {
	blk, k := g.blk, g.k
	C.k_head_masses(fp(blk.bsum[r*blk.nblk:]), fp(blk.tmax[r*blk.ntile:]), C.long(lmTile/compute.SampleBlock),
		ip(g.top[r*k:]), C.int(k), fp(blk.topb[r*k*compute.SampleBlock:]), ip(g.headOf(r)), C.long(g.vocab))
}

// dominatedMasses is step 2 for a k above lmPayloadK (the pass carried no
// blocks): where the top-k ids hold at most half of a block's sum, the
// block's sum less their exps (the fold's, of their logits: the same
// terms) keeps its relative accuracy; a block they dominate is computed
// again and summed outside the top-k exactly.
func (g *groupSampler) dominatedMasses() {
	const B = compute.SampleBlock
	blk, k, nblk, nt, bpt := g.blk, g.k, g.blk.nblk, g.blk.ntile, lmTile/B
	var pairs []blockPair
	for r := 0; r < g.nr; r++ {
		h, ids, zs := g.headOf(r), g.top[r*k:(r+1)*k], blk.topz[r*k:(r+1)*k]
		for i := 0; i < len(h); {
			b := h[i] / B
			j := i
			for j < len(h) && h[j]/B == b {
				j++
			}
			i = j
			t := int(b) / bpt
			tm := blk.tmax[r*nt+t]
			var in float64 // the top-k's exps in block b
			for q, v := range ids {
				if v/B == b {
					in += float64(C.k_fexp_sum((*C.float)(&zs[q]), 1, C.float(tm)))
				}
			}
			s := float64(blk.bsum[r*nblk+int(b)])
			if in <= 0.5*s {
				blk.bsum[r*nblk+int(b)] = float32(s - in)
			} else {
				pairs = append(pairs, blockPair{row: int32(r), blk: b})
			}
		}
	}
	g.be.blockLogits(pairs, g.xs, g.ws, g.hidden, g.vocab, func(ps []blockPair, z []float32, nz int) {
		for i, p := range ps {
			r, b := int(p.row), int(p.blk)
			h := g.headOf(r)
			t := b / bpt
			m := float64(C.k_block_mass(fp(z[i*nz:]), C.int(nz), C.int32_t(b*B), C.double(blk.tmax[r*nt+t]), ip(h), C.int(len(h))))
			blk.bsum[r*nblk+b] = float32(m)
		}
	})
}

// tileSums sums again the totals of row r's tiles that hold its head
// blocks (head only).
func (g *groupSampler) tileSums(r int) {
	blk, bpt := g.blk, lmTile/compute.SampleBlock
	nblk := blk.nblk
	last := -1
	for _, v := range g.headOf(r) {
		t := int(v) / lmTile
		if t == last {
			continue
		}
		last = t
		var sum float64
		for _, x := range blk.bsum[r*nblk+t*bpt : r*nblk+min((t+1)*bpt, nblk)] {
			sum += float64(x)
		}
		blk.tsum[r*blk.ntile+t] = sum
	}
}

// locate (3) writes row r's tail mass (over the log-sum-exp's sum),
// locates its thresholds among the tiles' and blocks' cumulative sums
// (bl: n scratch, sc: a tile's scratch) and returns the (row, block)
// pairs that hold them, or marks its draws -1 where nothing is left to
// draw from.
func (g *groupSampler) locate(r int, bl []int32, sc []float64) []blockPair {
	blk, n, nt := g.blk, g.n, g.blk.ntile
	mx := C.double(blk.rmax[r])
	tm, ts := fp(blk.tmax[r*nt:]), (*C.double)(unsafe.Pointer(&blk.tsum[r*nt]))
	scp := (*C.double)(unsafe.Pointer(&sc[0]))
	mass := float64(C.k_tile_mass(tm, ts, C.long(nt), mx, scp))
	g.tail[r] = float32(mass / blk.rsum[r])
	dr, th := g.drawn[r*n:(r+1)*n], g.thr[r*n:(r+1)*n]
	if !(mass > 0) {
		for d := range dr {
			dr[d] = -1 // nothing outside the head to draw from
		}
		return nil
	}
	C.k_draw_locate(fp(blk.bsum[r*blk.nblk:]), C.long(blk.nblk), scp, ts, C.long(nt), C.long(lmTile/compute.SampleBlock),
		ip(g.u[2*r*n:]), C.int(n), C.double(mass), ip(bl), (*C.double)(unsafe.Pointer(&th[0])))
	var ps []blockPair
	for d, b := range bl {
		if len(ps) > 0 && ps[len(ps)-1].blk == b {
			ps[len(ps)-1].d1++
		} else {
			ps = append(ps, blockPair{row: int32(r), blk: b, d0: int32(d), d1: int32(d + 1)})
		}
	}
	return ps
}

// walk (4) draws, block by block: the blocks of pairs multiplied again
// and each block's pairs walked to their thresholds (k_draw_walks).
func (g *groupSampler) walk(pairs []blockPair) {
	var hp *C.int32_t
	if g.head {
		hp = ip(g.heads)
	}
	g.be.blockLogits(pairs, g.xs, g.ws, g.hidden, g.vocab, func(ps []blockPair, z []float32, nz int) {
		C.k_draw_walks(fp(z), C.long(len(ps)), C.int(nz), (*C.struct_draw_pair)(unsafe.Pointer(&ps[0])), fp(g.blk.rmax),
			hp, C.int(g.k), (*C.double)(unsafe.Pointer(&g.thr[0])), C.int(g.n), ip(g.drawn))
	})
}

// blockLogits multiplies again the blocks of pairs: it groups them by block
// (stably: rows ascending within a block), computes each block's logits for
// the rows that need it with the block's weights read once (k_block_logits:
// every logit summed in the same order, so a draw does not depend on which
// rows share its block), and calls f with each block's pairs and their
// logits (pair i's nz logits at z[i·nz:], the block's ids, fewer in the
// vocabulary's last block), on the workers.
func (be *Backend) blockLogits(pairs []blockPair, xs, ws []float32, hidden, vocab int, f func(ps []blockPair, z []float32, nz int)) {
	const B = compute.SampleBlock
	if len(pairs) == 0 {
		return
	}
	pairs, starts := byBlock(pairs, (vocab+B-1)/B)
	type scratch struct {
		rows  []int32
		z, wt []float32
	}
	scr := make([]scratch, be.threads)
	// The blocks go to the workers in runs of blockRun, so that each
	// call can ask for the weights of the worker's next block.
	nb := len(starts) - 1
	be.workQueue((nb+blockRun-1)/blockRun, func(wk, run int) {
		sc := &scr[wk]
		if sc.wt == nil {
			sc.wt = make([]float32, hidden*B)
		}
		end := min(nb, (run+1)*blockRun)
		for gi := run * blockRun; gi < end; gi++ {
			ps := pairs[starts[gi]:starts[gi+1]]
			m := len(ps)
			if cap(sc.rows) < m {
				sc.rows, sc.z = make([]int32, m), make([]float32, m*B)
			}
			rows, z := sc.rows[:m], sc.z[:m*B]
			for i, p := range ps {
				rows[i] = p.row
			}
			v0 := int(ps[0].blk) * B
			nz := min(B, vocab-v0)
			var next *C.float
			var nextz int
			if gi+1 < end {
				n0 := int(pairs[starts[gi+1]].blk) * B
				next, nextz = fp(ws[n0*hidden:]), min(B, vocab-n0)
			}
			warm := C.int(0)
			if gi > run*blockRun {
				warm = 1
			}
			C.k_block_logits(fp(z), fp(xs), ip(rows), C.long(m), fp(ws[v0*hidden:]), C.long(nz), C.long(hidden), fp(sc.wt),
				next, C.long(nextz), warm)
			f(ps, z[:m*nz], nz)
		}
	})
}

// blockRun is how many consecutive blocks a worker of blockLogits takes
// at once: a few dozen runs a group (about 2400 blocks under a flat
// softmax), so that the workers finish together.
const blockRun = 8
