package cpu

/*
#include "kernels.h"
*/
import "C"

import (
	"sort"

	"distill/compute"
)

// attnBlock is the query-block size of the attention forward: scores are
// held for attnBlock queries x sample length at a time per worker. Samples
// longer than attnLongLen use half that height, so a worker's scores stay
// within 2 MiB however long a training row is.
const (
	attnBlock   = 128
	attnLongLen = 4096
)

// attnFwdBlock is the forward's query-block height for samples of at most
// maxLen tokens.
func attnFwdBlock(maxLen int) int {
	if maxLen > attnLongLen {
		return attnBlock / 2
	}
	return attnBlock
}

// attnBwdBlock is the query-block size of the attention backward, which
// holds two such blocks (probabilities and their gradient) per worker.
const attnBwdBlock = 64

// AttentionScratchBytes implements compute.ScratchReporter: what Attention
// allocates beside its output for samples of at most maxLen tokens.
func (be *Backend) AttentionScratchBytes(maxLen int) int64 {
	return int64(be.threads) * 4 * int64(attnFwdBlock(maxLen)) * int64(maxLen)
}

// Attention implements compute.Backend. Work items are (sample, head, query
// block); each computes S = Q·Kᵀ·scale over the keys up to the block's last
// query, a causal fp32 softmax (saving each row's log-sum-exp when lse is
// given), and O = P·V, with single-threaded GEMMs running concurrently on
// all cores.
func (be *Backend) Attention(out, lse, q, k, v, starts compute.Tensor, nSeq, maxLen, tokens, nHead, nKV, hd int, scale float32) {
	o, qs, ks, vs, st, ls := f32(out), f32(q), f32(k), f32(v), i32(starts), f32(lse)
	blk := attnFwdBlock(maxLen)
	type item struct{ s, h, q0 int }
	var items []item
	for s := 0; s < nSeq; s++ {
		L := int(st[s+1] - st[s])
		for h := 0; h < nHead; h++ {
			for q0 := 0; q0 < L; q0 += blk {
				items = append(items, item{s, h, q0})
			}
		}
	}
	// Longest first: balances the tail of the queue.
	sort.SliceStable(items, func(i, j int) bool { return items[i].q0 > items[j].q0 })
	scratch := make([][]float32, be.threads)
	defer func() {
		for _, sc := range scratch {
			if sc != nil {
				be.release(sc)
			}
		}
	}()
	group := nHead / nKV
	ldq, ldk := nHead*hd, nKV*hd
	be.workQueue(len(items), func(w, i int) {
		it := items[i]
		a := int(st[it.s])
		L := int(st[it.s+1]) - a
		q1 := min(it.q0+blk, L)
		nq, nk := q1-it.q0, q1
		if scratch[w] == nil {
			scratch[w] = be.scratch(blk * maxLen)
		}
		sc := scratch[w][:nq*nk]
		g := it.h / group
		qp := qs[(a+it.q0)*ldq+it.h*hd:]
		kp := ks[a*ldk+g*hd:]
		vp := vs[a*ldk+g*hd:]
		Sgemm(false, true, nq, nk, hd, scale, qp, ldq, kp, ldk, 0, sc, nk)
		var lp *C.float
		if ls != nil {
			lp = fp(ls[(a+it.q0)*nHead+it.h:])
		}
		C.k_softmax_causal(fp(sc), C.long(nq), C.long(nk), C.long(it.q0+1), lp, C.long(nHead))
		Sgemm(false, false, nq, hd, nk, 1, sc, nk, vp, ldk, 0, o[(a+it.q0)*ldq+it.h*hd:], ldq)
	})
}

// AttentionBackward implements compute.Backend. With P recomputed from lse,
// dP = dout·vᵀ and dS = P∘(dP - rowsum(P∘dP)): dv += Pᵀ·dout,
// dq += scale·dS·k, dk += scale·dSᵀ·q. One work item per (sample, kv
// head), so no two workers write the same rows of dq, dk or dv.
func (be *Backend) AttentionBackward(dq, dk, dv, dout, q, k, v, _, lse, starts compute.Tensor, nSeq, maxLen, tokens, nHead, nKV, hd int, scale float32) {
	dqs, dks, dvs, dos := f32(dq), f32(dk), f32(dv), f32(dout)
	qs, ks, vs, ls, st := f32(q), f32(k), f32(v), f32(lse), i32(starts)
	type scr struct{ P, dP []float32 }
	scratch := make([]scr, be.threads)
	defer func() {
		for _, sc := range scratch {
			if sc.P != nil {
				be.release(sc.P, sc.dP)
			}
		}
	}()
	group := nHead / nKV
	ldq, ldk := nHead*hd, nKV*hd
	be.workQueue(nSeq*nKV, func(w, n int) {
		s, kh := n/nKV, n%nKV
		a, L := int(st[s]), int(st[s+1]-st[s])
		if scratch[w].P == nil {
			scratch[w] = scr{be.scratch(attnBwdBlock * maxLen), be.scratch(attnBwdBlock * maxLen)}
		}
		kb, vb := ks[a*ldk+kh*hd:], vs[a*ldk+kh*hd:]
		dkb, dvb := dks[a*ldk+kh*hd:], dvs[a*ldk+kh*hd:]
		for h := kh * group; h < (kh+1)*group; h++ {
			for i0 := 0; i0 < L; i0 += attnBwdBlock {
				i1 := min(i0+attnBwdBlock, L)
				bq := i1 - i0
				P, dP := scratch[w].P[:bq*i1], scratch[w].dP[:bq*i1]
				off := (a+i0)*ldq + h*hd
				qb, dob, dqb := qs[off:], dos[off:], dqs[off:]
				Sgemm(false, true, bq, i1, hd, scale, qb, ldq, kb, ldk, 0, P, i1)
				C.k_softmax_recompute(fp(P), C.long(bq), C.long(i1), C.long(i0+1), fp(ls[(a+i0)*nHead+h:]), C.long(nHead))
				// dv[0:i1] += Pᵀ · dout_blk
				Sgemm(true, false, i1, hd, bq, 1, P, i1, dob, ldq, 1, dvb, ldk)
				// dP (bq, i1) = dout_blk · v[0:i1]ᵀ, then dS in place
				Sgemm(false, true, bq, i1, hd, 1, dob, ldq, vb, ldk, 0, dP, i1)
				C.k_softmax_bwd(fp(dP), fp(P), C.long(bq), C.long(i1), C.long(i0+1))
				// dq_blk += scale · dS · k[0:i1]; dk[0:i1] += scale · dSᵀ · q_blk
				Sgemm(false, false, bq, hd, i1, scale, dP, i1, kb, ldk, 1, dqb, ldq)
				Sgemm(true, false, i1, hd, bq, scale, dP, i1, qb, ldq, 1, dkb, ldk)
			}
		}
	})
}
