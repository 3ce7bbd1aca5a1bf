package cpu

import (
	"math"

	"distill/compute"
)

// lossTileBytes is the default budget of the loss head's logits tile
// (M x TileCols fp32): 64 MiB.
const lossTileBytes = 64 << 20

// lossTileCols is the vocabulary tile width of a LossHead call.
func lossTileCols(h *compute.LossHead) int {
	if h.TileCols > 0 {
		return min(h.TileCols, h.V)
	}
	vt := lossTileBytes / (4 * max(h.M, 1))
	vt = max(vt/64*64, 64)
	return min(vt, h.V)
}

// lossGather copies the counted rows of x into xc (M,C).
func (b *Backend) lossGather(h *compute.LossHead) (xc []float32, rows []int32) {
	x, rows := f32(h.X), i32(h.Rows)
	xc = b.scratch(h.M * h.C)
	C := h.C
	b.rows(h.M, C, func(_, lo, hi int) {
		for r := lo; r < hi; r++ {
			copy(xc[r*C:(r+1)*C], x[int(rows[r])*C:])
		}
	})
	return xc, rows
}

// lossTiles walks the vocabulary in tiles of vt columns: one SGEMM gives
// the logits of every counted row for the tile (the tile buffer L, M x n),
// then row runs on the workers for each row r with its logits (ids
// [v0, v1)) and a per-worker scratch zk of K floats; after, when set, runs
// on the caller once the tile's rows are done.
func (b *Backend) lossTiles(h *compute.LossHead, xc, tile []float32, vt, cost int,
	row func(zk []float32, r, v0, v1 int, logits []float32), after func(L []float32, v0, n int)) {
	M, C, w := h.M, h.C, f32(h.W)
	tmp := make([][]float32, b.threads)
	for v0 := 0; v0 < h.V; v0 += vt {
		v1 := min(v0+vt, h.V)
		n := v1 - v0
		L := tile[:M*n]
		b.sgemm(false, true, M, n, C, 1, xc, C, w[v0*C:], C, 0, L, n)
		b.rows(M, n*cost, func(wk, lo, hi int) {
			if tmp[wk] == nil {
				tmp[wk] = make([]float32, h.K)
			}
			for r := lo; r < hi; r++ {
				row(tmp[wk], r, v0, v1, L[r*n:(r+1)*n])
			}
		})
		if after != nil {
			after(L, v0, n)
		}
	}
}

// LossHeadForward implements compute.Backend. Each tile of logits (one
// SGEMM over all counted rows) is folded row by row into an online
// log-sum-exp at 1/T (and at 1 when T != 1) kept in float64; the teacher's
// ids, walked in ascending order with a cursor per row, are gathered and
// then masked out of the tile, so that the tail is summed directly over
// v ∉ K.
func (b *Backend) LossHeadForward(h *compute.LossHead) compute.LossStats {
	M, K := h.M, h.K
	st := compute.LossStats{LseT: make([]float64, M), Lse1: make([]float64, M), Tail: make([]float64, M),
		ZK: make([]float32, M*K), ZLab: make([]float32, M)}
	if M == 0 {
		return st
	}
	labs := i32(h.Labels)
	var ids []int32
	if K > 0 {
		ids = i32(h.TopIDs)
	}
	xc, _ := b.lossGather(h)
	vt := lossTileCols(h)
	tile := b.scratch(M * vt)
	defer b.release(xc, tile)
	invT := h.InvT
	sepCE := invT != 1
	mT, sT, sTail := make([]float64, M), make([]float64, M), make([]float64, M)
	m1, s1 := make([]float64, M), make([]float64, M)
	cur := make([]int32, M)
	for r := range mT {
		mT[r], m1[r] = math.Inf(-1), math.Inf(-1)
	}
	b.lossTiles(h, xc, tile, vt, 3, func(zk []float32, r, v0, v1 int, row []float32) {
		mx := float32(math.Inf(-1))
		for _, z := range row {
			mx = max(mx, z)
		}
		// T-scaled sums: m is the running max of z/T.
		m := max(mT[r], float64(mx*invT))
		if m > mT[r] && sT[r] > 0 {
			f := math.Exp(mT[r] - m)
			sT[r] *= f
			sTail[r] *= f
		}
		mT[r] = m
		mf := float32(m)
		if lab := int(labs[r]); lab >= v0 && lab < v1 {
			st.ZLab[r] = row[lab-v0]
		}
		if sepCE {
			mm := max(m1[r], float64(mx))
			if mm > m1[r] && s1[r] > 0 {
				s1[r] *= math.Exp(m1[r] - mm)
			}
			m1[r] = mm
			s1[r] += sumExp(row, 1, float32(mm))
		}
		nk := 0
		if K > 0 {
			rid := ids[r*K : (r+1)*K]
			c := cur[r]
			for ; c < int32(K) && int(rid[c]) < v1; c++ {
				i := int(rid[c]) - v0
				st.ZK[r*K+int(c)] = row[i]
				zk[nk] = row[i]
				nk++
				row[i] = float32(math.Inf(-1))
			}
			cur[r] = c
		}
		tail := sumExp(row, invT, mf)
		sT[r] += tail + sumExp(zk[:nk], invT, mf)
		sTail[r] += tail
	}, nil)
	for r := 0; r < M; r++ {
		st.LseT[r] = mT[r] + math.Log(sT[r])
		st.Lse1[r] = st.LseT[r]
		if sepCE {
			st.Lse1[r] = m1[r] + math.Log(s1[r])
		}
		st.Tail[r] = sTail[r] / sT[r]
	}
	return st
}

// LossHeadBackward implements compute.Backend: each recomputed tile becomes
// dL/dz in place (the exp-based bulk with one C loop a row, then the
// teacher's ids and the label corrected), then dxc += dz·W_tile and
// dW_tile += dzᵀ·xc; dxc is added into dx at the counted rows last.
func (b *Backend) LossHeadBackward(h *compute.LossHead, c *compute.LossCoef, dx, dw compute.Tensor) {
	M, C, K := h.M, h.C, h.K
	if M == 0 {
		return
	}
	w, dws, dxs, labs := f32(h.W), f32(dw), f32(dx), i32(h.Labels)
	lseTs, lse1s, as := f32(c.LseT), f32(c.Lse1), f32(c.A)
	var ids []int32
	var cK []float32
	if K > 0 {
		ids, cK = i32(h.TopIDs), f32(c.CK)
	}
	xc, rows := b.lossGather(h)
	dxc := b.scratch(M * C)
	clear(dxc)
	vt := lossTileCols(h)
	tile := b.scratch(M * vt)
	defer b.release(xc, dxc, tile)
	invT, wsft := h.InvT, c.WSFT
	sepCE := invT != 1 && wsft != 0
	cur := make([]int32, M)
	b.lossTiles(h, xc, tile, vt, 4, func(zk []float32, r, v0, v1 int, row []float32) {
		lseT, lse1, a := lseTs[r], lse1s[r], as[r]
		// The teacher's ids' logits, before the row is overwritten.
		var rid []int32
		c0, c1 := cur[r], cur[r]
		if K > 0 {
			rid = ids[r*K : (r+1)*K]
			for ; c1 < int32(K) && int(rid[c1]) < v1; c1++ {
				zk[c1-c0] = row[int(rid[c1])-v0]
			}
			cur[r] = c1
		}
		// The tile's logits become dL/dz: the teacher part a·q_v
		// (corrected on K below) plus the CE part wsft·p_v, which is
		// wsft·q_v when T = 1.
		switch {
		case sepCE && a == 0:
			scaledExp(row, row, 1, lse1, wsft)
		case sepCE:
			expMix(row, row, invT, lseT, a, lse1, wsft)
		default:
			scaledExp(row, row, invT, lseT, a+wsft)
		}
		if c1 > c0 {
			z := zk[:c1-c0]
			if wsft != 0 { // the CE part's p_v on the teacher's ids
				if sepCE {
					scaledExp(z, z, 1, lse1, wsft)
				} else {
					scaledExp(z, z, invT, lseT, wsft)
				}
			} else {
				clear(z)
			}
			for j := c0; j < c1; j++ {
				row[int(rid[j])-v0] = cK[r*K+int(j)] + z[j-c0]
			}
		}
		if lab := int(labs[r]); lab >= v0 && lab < v1 {
			row[lab-v0] -= wsft
		}
	}, func(L []float32, v0, n int) {
		b.sgemm(false, false, M, C, n, 1, L, n, w[v0*C:], C, 1, dxc, C)
		if dws != nil { // nil: a frozen LM head
			b.sgemm(true, false, n, C, M, 1, L, n, xc, C, 1, dws[v0*C:], C)
		}
	})
	// Rows are distinct positions, so the scatter-add cannot race.
	b.rows(M, C, func(_, lo, hi int) {
		for r := lo; r < hi; r++ {
			d, s := dxs[int(rows[r])*C:int(rows[r]+1)*C], dxc[r*C:(r+1)*C]
			for i := range d {
				d[i] += s[i]
			}
		}
	})
}
