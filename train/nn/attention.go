package nn

import (
	"math"

	"distill/compute/cpu"
	"distill/train/internal/fmath"
)

// attnBlock is the query-block height: scores are computed for attnBlock
// query rows against all keys up to the block's last row, so scratch is
// attnBlock x (longest sample) per worker and never (sample x sample).
const attnBlock = 64

// maxSample is the longest sample of starts (nSeq+1).
func maxSample(starts []int32) int {
	m := 0
	for s := 0; s+1 < len(starts); s++ {
		if l := int(starts[s+1] - starts[s]); l > m {
			m = l
		}
	}
	return m
}

// AttentionForward: packed causal attention with GQA.
// q (N,H,D), k and v (N,KV,D), starts (nSeq+1) -> out (N,H,D); saves
// lse (N,H), the log-sum-exp of each query row's scaled scores, so that
// backward recomputes the probabilities instead of storing (L,L) per head.
// Query head h reads kv head h/(H/KV). A token attends to itself and the
// earlier tokens of its own sample only. scale is 1/sqrt(D) for HF models.
func AttentionForward(out, lse, q, k, v []float32, starts []int32, H, KV, D int, scale float32) {
	type item struct{ st, l, h, i0 int }
	var items []item
	for s := 0; s+1 < len(starts); s++ {
		st, l := int(starts[s]), int(starts[s+1]-starts[s])
		for h := 0; h < H; h++ {
			for i0 := 0; i0 < l; i0 += attnBlock {
				items = append(items, item{st, l, h, i0})
			}
		}
	}
	L := maxSample(starts)
	scratch := make([][]float32, workers())
	group := H / KV
	qs, ks := H*D, KV*D // row strides
	cpu.WorkQueue(len(items), func(w, n int) {
		it := items[n]
		if scratch[w] == nil {
			scratch[w] = make([]float32, attnBlock*L)
		}
		i1 := min(it.i0+attnBlock, it.l)
		bq, kh := i1-it.i0, it.h/group
		S := scratch[w][:bq*i1]
		qb := q[(it.st+it.i0)*qs+it.h*D:]
		kb := k[it.st*ks+kh*D:]
		vb := v[it.st*ks+kh*D:]
		// S (bq, i1) = scale · q_blk · k[0:i1]ᵀ
		cpu.Sgemm(false, true, bq, i1, D, scale, qb, qs, kb, ks, 0, S, i1)
		for r := 0; r < bq; r++ {
			i := it.i0 + r
			row := S[r*i1 : (r+1)*i1]
			m := float32(math.Inf(-1))
			for j := 0; j <= i; j++ {
				m = max(m, row[j])
			}
			var sum float32
			for j := 0; j <= i; j++ {
				e := fmath.Exp(row[j] - m)
				row[j] = e
				sum += e
			}
			inv := 1 / sum
			for j := 0; j <= i; j++ {
				row[j] *= inv
			}
			for j := i + 1; j < i1; j++ {
				row[j] = 0
			}
			lse[(it.st+i)*H+it.h] = m + float32(math.Log(float64(sum)))
		}
		// out_blk (bq, D) = P · v[0:i1]
		cpu.Sgemm(false, false, bq, D, i1, 1, S, i1, vb, ks, 0, out[(it.st+it.i0)*qs+it.h*D:], qs)
	})
}

// AttentionBackward: dout (N,H,D), q, k, v, lse as in forward ->
// dq (N,H,D) +=, dk (N,KV,D) +=, dv (N,KV,D) +=. With P recomputed from
// lse, dP = dout·vᵀ, dS = P∘(dP - rowsum(P∘dP)):
// dv += Pᵀ·dout, dq += scale·dS·k, dk += scale·dSᵀ·q.
// One work item per (sample, kv head), so no two workers write the same
// rows of dk/dv and dq.
func AttentionBackward(dq, dk, dv, dout, q, k, v, lse []float32, starts []int32, H, KV, D int, scale float32) {
	nSeq := len(starts) - 1
	L := maxSample(starts)
	type scr struct{ P, dP []float32 }
	scratch := make([]scr, workers())
	group := H / KV
	qs, ks := H*D, KV*D
	cpu.WorkQueue(nSeq*KV, func(w, n int) {
		s, kh := n/KV, n%KV
		st, l := int(starts[s]), int(starts[s+1]-starts[s])
		if scratch[w].P == nil {
			scratch[w] = scr{make([]float32, attnBlock*L), make([]float32, attnBlock*L)}
		}
		kb, vb := k[st*ks+kh*D:], v[st*ks+kh*D:]
		dkb, dvb := dk[st*ks+kh*D:], dv[st*ks+kh*D:]
		for h := kh * group; h < (kh+1)*group; h++ {
			for i0 := 0; i0 < l; i0 += attnBlock {
				i1 := min(i0+attnBlock, l)
				bq := i1 - i0
				P, dP := scratch[w].P[:bq*i1], scratch[w].dP[:bq*i1]
				off := (st+i0)*qs + h*D
				qb, dob, dqb := q[off:], dout[off:], dq[off:]
				cpu.Sgemm(false, true, bq, i1, D, scale, qb, qs, kb, ks, 0, P, i1)
				for r := 0; r < bq; r++ {
					i := i0 + r
					row := P[r*i1 : (r+1)*i1]
					m := lse[(st+i)*H+h]
					for j := 0; j <= i; j++ {
						row[j] = fmath.Exp(row[j] - m)
					}
					for j := i + 1; j < i1; j++ {
						row[j] = 0
					}
				}
				// dv[0:i1] += Pᵀ · dout_blk
				cpu.Sgemm(true, false, i1, D, bq, 1, P, i1, dob, qs, 1, dvb, ks)
				// dP (bq, i1) = dout_blk · v[0:i1]ᵀ
				cpu.Sgemm(false, true, bq, i1, D, 1, dob, qs, vb, ks, 0, dP, i1)
				for r := 0; r < bq; r++ {
					i := i0 + r
					p, d := P[r*i1:(r+1)*i1], dP[r*i1:(r+1)*i1]
					var dot float32
					for j := 0; j <= i; j++ {
						dot += p[j] * d[j]
					}
					for j := 0; j <= i; j++ {
						d[j] = p[j] * (d[j] - dot)
					}
					for j := i + 1; j < i1; j++ {
						d[j] = 0
					}
				}
				// dq_blk += scale · dS · k[0:i1]; dk[0:i1] += scale · dSᵀ · q_blk
				cpu.Sgemm(false, false, bq, D, i1, scale, dP, i1, kb, ks, 1, dqb, qs)
				cpu.Sgemm(true, false, i1, D, bq, scale, dP, i1, qb, qs, 1, dkb, ks)
			}
		}
	})
}
