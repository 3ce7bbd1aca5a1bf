// Packed variable-length causal attention with GQA, flash-style: each block
// owns a tile of queries of one sample and one head, walks that sample's
// keys in tiles with an online softmax, and never holds a score matrix, so
// memory is linear in tokens.
//
// q (tokens, nHead, hd), k and v (tokens, nKV, hd), out (tokens, nHead, hd),
// all F32; samples are the token ranges [starts[s], starts[s+1]); query
// head h reads kv head h / (nHead/nKV). lse (tokens, nHead), when not null,
// receives each query row's log-sum-exp of its scaled scores.
//
// Blocks map to query tiles through tile_start (nSeq+1), the exclusive
// prefix sum of ceil(len_s / BQ) written by k_attn_plan: block b of the grid
// serves sample s with tile_start[s] <= b < tile_start[s+1], queries from
// (b - tile_start[s])·BQ. The grid is the host's upper bound
// (tokens + nSeq·(BQ-1)) / BQ; blocks past the last tile return at once.

// k_attn_plan: one block. tile_start[s] = sum over s' < s of
// ceil(len_s' / bq), tile_start[nSeq] = the number of tiles.
DK_KERNEL void k_attn_plan(i32 *__restrict__ tile_start, const i32 *__restrict__ starts, int nseq, int bq) {
	__shared__ i32 sc[1024];
	__shared__ i32 carry;
	if (threadIdx.x == 0) carry = 0;
	__syncthreads();
	for (int base = 0; base < nseq; base += blockDim.x) {
		int s = base + threadIdx.x;
		i32 c = 0;
		if (s < nseq) {
			i32 len = starts[s + 1] - starts[s];
			c = (len + bq - 1) / bq;
		}
		sc[threadIdx.x] = c;
		__syncthreads();
		// Inclusive scan (Hillis-Steele) over the block's counts.
		for (int off = 1; off < (int)blockDim.x; off <<= 1) {
			i32 add = threadIdx.x >= (unsigned)off ? sc[threadIdx.x - off] : 0;
			__syncthreads();
			sc[threadIdx.x] += add;
			__syncthreads();
		}
		if (s < nseq) tile_start[s] = carry + sc[threadIdx.x] - c;
		__syncthreads();
		if (threadIdx.x == blockDim.x - 1) carry += sc[threadIdx.x];
		__syncthreads();
	}
	if (threadIdx.x == 0) tile_start[nseq] = carry;
}

// tile_of finds the sample s and first query q0 (within the sample) of
// block b, or returns false when b is past the last tile.
DK_DEV bool tile_of(const i32 *tile_start, int nseq, int b, int bq, int *s, int *q0) {
	if (b >= tile_start[nseq]) return false;
	int lo = 0, hi = nseq - 1; // the last s with tile_start[s] <= b
	while (lo < hi) {
		int mid = (lo + hi + 1) / 2;
		if (tile_start[mid] <= b) lo = mid;
		else hi = mid - 1;
	}
	*s = lo;
	*q0 = (b - tile_start[lo]) * bq;
	return true;
}

// --- The reference kernel: fp32 throughout, any head_dim <= 256.
// 4 warps a block, BQ = 16 queries a block; each warp takes every 4th query
// of the tile and walks its keys 32 at a time: lane j scores key j0+j, the
// warp updates the running max m, sum l and output o (lane holds dims
// lane, lane+32, ...).

#define SIMT_BQ 16
#define SIMT_MAXD 256

DK_KERNEL __launch_bounds__(128) void k_attn_simt(float *__restrict__ out, float *__restrict__ lse, const float *__restrict__ q,
                                                  const float *__restrict__ k, const float *__restrict__ v,
                                                  const i32 *__restrict__ starts, const i32 *__restrict__ tile_start, int nseq,
                                                  int nhead, int nkv, int hd, float scale) {
	__shared__ float qs[4][SIMT_MAXD];
	int s, q0;
	if (!tile_of(tile_start, nseq, blockIdx.x, SIMT_BQ, &s, &q0)) return;
	int h = blockIdx.y, g = h / (nhead / nkv);
	int warp = threadIdx.x / DK_WARP, lane = threadIdx.x % DK_WARP;
	i64 a = starts[s];
	int L = starts[s + 1] - starts[s];
	i64 ldq = (i64)nhead * hd, ldk = (i64)nkv * hd;
	const float *kb = k + a * ldk + (i64)g * hd;
	const float *vb = v + a * ldk + (i64)g * hd;
	for (int qi = q0 + warp; qi < imin(q0 + SIMT_BQ, L); qi += 4) {
		const float *qr = q + (a + qi) * ldq + (i64)h * hd;
		for (int d = lane; d < hd; d += DK_WARP) qs[warp][d] = qr[d];
		__syncwarp();
		float m = -DK_INF, l = 0;
		float o[SIMT_MAXD / DK_WARP];
		for (int r = 0; r < SIMT_MAXD / DK_WARP; r++) o[r] = 0;
		for (int j0 = 0; j0 <= qi; j0 += DK_WARP) {
			int j = j0 + lane;
			float sc = -DK_INF;
			if (j <= qi) {
				const float *kr = kb + (i64)j * ldk;
				float dot = 0;
				for (int d = 0; d < hd; d++) dot += qs[warp][d] * kr[d];
				sc = dot * scale;
			}
			float mn = fmaxf(m, warp_max(sc)); // finite: key j0 <= qi is always valid
			float p = j <= qi ? expf(sc - mn) : 0.0f;
			float corr = expf(m - mn);
			l = l * corr + warp_sum(p);
			for (int r = 0; r < SIMT_MAXD / DK_WARP; r++) o[r] *= corr;
			int nj = imin(DK_WARP, qi - j0 + 1);
			for (int jj = 0; jj < nj; jj++) {
				float pj = __shfl_sync(DK_FULL, p, jj);
				const float *vr = vb + (i64)(j0 + jj) * ldk;
				for (int r = 0; r < SIMT_MAXD / DK_WARP; r++) {
					int d = lane + r * DK_WARP;
					if (d < hd) o[r] += pj * vr[d];
				}
			}
			m = mn;
		}
		float *orow = out + (a + qi) * ldq + (i64)h * hd;
		float inv = 1.0f / l;
		for (int r = 0; r < SIMT_MAXD / DK_WARP; r++) {
			int d = lane + r * DK_WARP;
			if (d < hd) orow[d] = o[r] * inv;
		}
		if (lse && lane == 0) lse[(a + qi) * nhead + h] = m + logf(l);
		__syncwarp();
	}
}

// --- The tensor-core kernel: head_dim HD in {64, 128}, BQ = 64 queries a
// block (4 warps x 16 rows), BK = 64 keys a step. Q·Kᵀ and P·V run on
// mma.sync m16n8k16 with BF16 operands and FP32 accumulators (FlashAttention
// 2's register layout: the S accumulators of two 8-key tiles are the A
// fragment of P for 16 keys). Q stays in registers as A fragments, read
// straight from global memory; K and V tiles are rounded to BF16 into
// shared memory, V transposed so that its B fragments are 32-bit loads.
// Rows are padded by 8 BF16 (16 bytes) against bank conflicts.

#define MMA_BQ 64
#define MMA_BK 64

template <int HD>
DK_DEV void attn_mma(float *__restrict__ out, float *__restrict__ lse, const float *__restrict__ q, const float *__restrict__ k,
                     const float *__restrict__ v, const i32 *__restrict__ starts, const i32 *__restrict__ tile_start, int nseq,
                     int nhead, int nkv, float scale) {
	__shared__ __align__(16) u16 ks[MMA_BK][HD + 8];
	__shared__ __align__(16) u16 vt[HD][MMA_BK + 8];
	int s, q0;
	if (!tile_of(tile_start, nseq, blockIdx.x, MMA_BQ, &s, &q0)) return;
	int h = blockIdx.y, kvh = h / (nhead / nkv);
	int warp = threadIdx.x / DK_WARP, lane = threadIdx.x % DK_WARP;
	int gr = lane / 4, tq = lane % 4; // the fragment's group (row) and thread-in-group
	i64 a = starts[s];
	int L = starts[s + 1] - starts[s];
	i64 ldq = (i64)nhead * HD, ldk = (i64)nkv * HD;
	const float *kb = k + a * ldk + (i64)kvh * HD;
	const float *vb = v + a * ldk + (i64)kvh * HD;

	// This thread's two query rows (local to the sample). Rows past the
	// sample's end are computed as if they were its last row, and not
	// stored, so every row has at least one visible key.
	int r0 = q0 + warp * 16 + gr, r1 = r0 + 8;
	int c0 = imin(r0, L - 1), c1 = imin(r1, L - 1);

	u32 qa[HD / 16][4];
	{
		const float *q0p = q + (a + c0) * ldq + (i64)h * HD;
		const float *q1p = q + (a + c1) * ldq + (i64)h * HD;
		for (int kk = 0; kk < HD / 16; kk++) {
			int d = kk * 16 + 2 * tq;
			qa[kk][0] = pack_bf16x2(q0p[d], q0p[d + 1]);
			qa[kk][1] = pack_bf16x2(q1p[d], q1p[d + 1]);
			qa[kk][2] = pack_bf16x2(q0p[d + 8], q0p[d + 9]);
			qa[kk][3] = pack_bf16x2(q1p[d + 8], q1p[d + 9]);
		}
	}
	float oacc[HD / 8][4];
	for (int nb = 0; nb < HD / 8; nb++)
		for (int e = 0; e < 4; e++) oacc[nb][e] = 0;
	float m0 = -DK_INF, m1 = -DK_INF, l0 = 0, l1 = 0; // l: this thread's partial sums

	int nk = imin(q0 + MMA_BQ, L); // keys any row of the tile can see
	int wlast = imin(q0 + warp * 16 + 15, L - 1); // the warp's last visible row
	for (int k0 = 0; k0 < nk; k0 += MMA_BK) {
		__syncthreads(); // the previous tile's readers are done
		for (int idx = threadIdx.x; idx < MMA_BK * HD; idx += blockDim.x) {
			int r = idx / HD, c = idx - r * HD;
			float kv = 0, vv = 0;
			if (k0 + r < nk) {
				kv = kb[(i64)(k0 + r) * ldk + c];
				vv = vb[(i64)(k0 + r) * ldk + c];
			}
			ks[r][c] = f2bf(kv);
			vt[c][r] = f2bf(vv);
		}
		__syncthreads();
		if (k0 > wlast) continue; // every key of the tile is in this warp's future

		float sacc[MMA_BK / 8][4];
		for (int nt = 0; nt < MMA_BK / 8; nt++) {
			for (int e = 0; e < 4; e++) sacc[nt][e] = 0;
			for (int kk = 0; kk < HD / 16; kk++) {
				u32 b[2];
				b[0] = *(const u32 *)&ks[nt * 8 + gr][kk * 16 + 2 * tq];
				b[1] = *(const u32 *)&ks[nt * 8 + gr][kk * 16 + 2 * tq + 8];
				mma_bf16_16816(sacc[nt], qa[kk], b);
			}
		}
		// Scale, mask (causal and the sample's end), row max.
		float mx0 = -DK_INF, mx1 = -DK_INF;
		for (int nt = 0; nt < MMA_BK / 8; nt++) {
			for (int e = 0; e < 4; e++) {
				int key = k0 + nt * 8 + 2 * tq + (e & 1);
				int row = e < 2 ? c0 : c1;
				float sv = key <= row ? sacc[nt][e] * scale : -DK_INF;
				sacc[nt][e] = sv;
				if (e < 2) mx0 = fmaxf(mx0, sv);
				else mx1 = fmaxf(mx1, sv);
			}
		}
		for (int msk = 1; msk < 4; msk <<= 1) {
			mx0 = fmaxf(mx0, __shfl_xor_sync(DK_FULL, mx0, msk));
			mx1 = fmaxf(mx1, __shfl_xor_sync(DK_FULL, mx1, msk));
		}
		float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
		float cr0 = expf(m0 - mn0), cr1 = expf(m1 - mn1);
		m0 = mn0;
		m1 = mn1;
		l0 *= cr0;
		l1 *= cr1;
		for (int nb = 0; nb < HD / 8; nb++) {
			oacc[nb][0] *= cr0;
			oacc[nb][1] *= cr0;
			oacc[nb][2] *= cr1;
			oacc[nb][3] *= cr1;
		}
		for (int nt = 0; nt < MMA_BK / 8; nt++) {
			for (int e = 0; e < 4; e++) {
				float p = expf(sacc[nt][e] - (e < 2 ? mn0 : mn1));
				sacc[nt][e] = p;
				if (e < 2) l0 += p;
				else l1 += p;
			}
		}
		// O += P·V, 16 keys at a time.
		for (int kk = 0; kk < MMA_BK / 16; kk++) {
			u32 pa[4];
			pa[0] = pack_bf16x2(sacc[2 * kk][0], sacc[2 * kk][1]);
			pa[1] = pack_bf16x2(sacc[2 * kk][2], sacc[2 * kk][3]);
			pa[2] = pack_bf16x2(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]);
			pa[3] = pack_bf16x2(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3]);
			for (int nb = 0; nb < HD / 8; nb++) {
				u32 b[2];
				b[0] = *(const u32 *)&vt[nb * 8 + gr][kk * 16 + 2 * tq];
				b[1] = *(const u32 *)&vt[nb * 8 + gr][kk * 16 + 2 * tq + 8];
				mma_bf16_16816(oacc[nb], pa, b);
			}
		}
	}
	for (int msk = 1; msk < 4; msk <<= 1) {
		l0 += __shfl_xor_sync(DK_FULL, l0, msk);
		l1 += __shfl_xor_sync(DK_FULL, l1, msk);
	}
	float i0 = 1.0f / l0, i1 = 1.0f / l1;
	float *o0 = out + (a + r0) * ldq + (i64)h * HD;
	float *o1 = out + (a + r1) * ldq + (i64)h * HD;
	for (int nb = 0; nb < HD / 8; nb++) {
		int d = nb * 8 + 2 * tq;
		if (r0 < L) {
			o0[d] = oacc[nb][0] * i0;
			o0[d + 1] = oacc[nb][1] * i0;
		}
		if (r1 < L) {
			o1[d] = oacc[nb][2] * i1;
			o1[d + 1] = oacc[nb][3] * i1;
		}
	}
	if (lse && tq == 0) {
		if (r0 < L) lse[(a + r0) * nhead + h] = m0 + logf(l0);
		if (r1 < L) lse[(a + r1) * nhead + h] = m1 + logf(l1);
	}
}

DK_KERNEL __launch_bounds__(128) void k_attn_mma64(float *out, float *lse, const float *q, const float *k, const float *v,
                                                   const i32 *starts, const i32 *tile_start, int nseq, int nhead, int nkv,
                                                   float scale) {
	attn_mma<64>(out, lse, q, k, v, starts, tile_start, nseq, nhead, nkv, scale);
}

DK_KERNEL __launch_bounds__(128) void k_attn_mma128(float *out, float *lse, const float *q, const float *k, const float *v,
                                                    const i32 *starts, const i32 *tile_start, int nseq, int nhead, int nkv,
                                                    float scale) {
	attn_mma<128>(out, lse, q, k, v, starts, tile_start, nseq, nhead, nkv, scale);
}

DK_REGISTER(k_attn_plan)
DK_REGISTER(k_attn_simt)
DK_REGISTER(k_attn_mma64)
DK_REGISTER(k_attn_mma128)

// ======================================================================
// The backward of packed varlen causal GQA attention (attention.cu),
// flash-style: the probabilities are recomputed from the forward's saved
// log-sum-exp, p_ij = exp(scale·q_i·k_j - lse_i), never stored. With
// dp_ij = dout_i·v_j and D_i = Σ_j p_ij·dp_ij:
//
//   dq_i += scale·Σ_j p_ij·(dp_ij - D_i)·k_j
//   dk_j += scale·Σ_i p_ij·(dp_ij - D_i)·q_i     (over the group's heads)
//   dv_j += Σ_i p_ij·dout_i
//
// Two kernels, each the sole writer of the rows it produces, so there are
// no atomics and the sums run in a fixed order (deterministic):
//
//   k_attn_bwd_dq   one warp per query row (a block: 16 rows of one head),
//                   keys walked 32 at a time as in k_attn_simt; one pass
//                   accumulates A = Σ p·dp·k, B = Σ p·k and D, then
//                   dq += scale·(A - D·B), and D is saved for the next kernel;
//   k_attn_bwd_dkv  one warp per key row (a block: 16 keys of one kv head),
//                   the group's heads and the later queries of the sample
//                   walked 32 at a time.
//
// fp32 throughout, head_dim <= 256; blocks map to tiles through k_attn_plan
// (tile_start), the same geometry as the forward's SIMT kernel.

#define BWD_BQ 16
#define BWD_MAXD 256

// k_attn_bwd_dq: dq (tokens, nhead, hd) +=; dsum (tokens, nhead) = D.
DK_KERNEL __launch_bounds__(128) void k_attn_bwd_dq(float *__restrict__ dq, float *__restrict__ dsum, const float *__restrict__ dout,
                                                    const float *__restrict__ q, const float *__restrict__ k,
                                                    const float *__restrict__ v, const float *__restrict__ lse,
                                                    const i32 *__restrict__ starts, const i32 *__restrict__ tile_start, int nseq,
                                                    int nhead, int nkv, int hd, float scale) {
	__shared__ float qs[4][BWD_MAXD];
	__shared__ float ds[4][BWD_MAXD];
	int s, q0;
	if (!tile_of(tile_start, nseq, blockIdx.x, BWD_BQ, &s, &q0)) return;
	int h = blockIdx.y, g = h / (nhead / nkv);
	int warp = threadIdx.x / DK_WARP, lane = threadIdx.x % DK_WARP;
	i64 a = starts[s];
	int L = starts[s + 1] - starts[s];
	i64 ldq = (i64)nhead * hd, ldk = (i64)nkv * hd;
	const float *kb = k + a * ldk + (i64)g * hd;
	const float *vb = v + a * ldk + (i64)g * hd;
	for (int qi = q0 + warp; qi < imin(q0 + BWD_BQ, L); qi += 4) {
		i64 row = (a + qi) * ldq + (i64)h * hd;
		for (int d = lane; d < hd; d += DK_WARP) {
			qs[warp][d] = q[row + d];
			ds[warp][d] = dout[row + d];
		}
		__syncwarp();
		float l = lse[(a + qi) * nhead + h];
		float A[BWD_MAXD / DK_WARP], B[BWD_MAXD / DK_WARP];
		for (int r = 0; r < BWD_MAXD / DK_WARP; r++) A[r] = B[r] = 0;
		float D = 0;
		for (int j0 = 0; j0 <= qi; j0 += DK_WARP) {
			int j = j0 + lane;
			float p = 0, pdp = 0;
			if (j <= qi) {
				const float *kr = kb + (i64)j * ldk, *vr = vb + (i64)j * ldk;
				float sc = 0, dp = 0;
				for (int d = 0; d < hd; d++) {
					sc += qs[warp][d] * kr[d];
					dp += ds[warp][d] * vr[d];
				}
				p = expf(sc * scale - l);
				pdp = p * dp;
			}
			D += pdp;
			int nj = imin(DK_WARP, qi - j0 + 1);
			for (int jj = 0; jj < nj; jj++) {
				float pj = __shfl_sync(DK_FULL, p, jj), pdpj = __shfl_sync(DK_FULL, pdp, jj);
				const float *kr = kb + (i64)(j0 + jj) * ldk;
				for (int r = 0; r < BWD_MAXD / DK_WARP; r++) {
					int d = lane + r * DK_WARP;
					if (d < hd) {
						float kv = kr[d];
						A[r] += pdpj * kv;
						B[r] += pj * kv;
					}
				}
			}
		}
		D = warp_sum(D);
		for (int r = 0; r < BWD_MAXD / DK_WARP; r++) {
			int d = lane + r * DK_WARP;
			if (d < hd) dq[row + d] += scale * (A[r] - D * B[r]);
		}
		if (lane == 0) dsum[(a + qi) * nhead + h] = D;
		__syncwarp();
	}
}

// k_attn_bwd_dkv: dk, dv (tokens, nkv, hd) +=, from dsum (k_attn_bwd_dq's
// D). blockIdx.y is the kv head.
DK_KERNEL __launch_bounds__(128) void k_attn_bwd_dkv(float *__restrict__ dk, float *__restrict__ dv, const float *__restrict__ dout,
                                                     const float *__restrict__ q, const float *__restrict__ k,
                                                     const float *__restrict__ v, const float *__restrict__ lse,
                                                     const float *__restrict__ dsum, const i32 *__restrict__ starts,
                                                     const i32 *__restrict__ tile_start, int nseq, int nhead, int nkv, int hd,
                                                     float scale) {
	__shared__ float ks[4][BWD_MAXD];
	__shared__ float vs[4][BWD_MAXD];
	int s, k0;
	if (!tile_of(tile_start, nseq, blockIdx.x, BWD_BQ, &s, &k0)) return;
	int g = blockIdx.y, group = nhead / nkv;
	int warp = threadIdx.x / DK_WARP, lane = threadIdx.x % DK_WARP;
	i64 a = starts[s];
	int L = starts[s + 1] - starts[s];
	i64 ldq = (i64)nhead * hd, ldk = (i64)nkv * hd;
	for (int kj = k0 + warp; kj < imin(k0 + BWD_BQ, L); kj += 4) {
		i64 krow = (a + kj) * ldk + (i64)g * hd;
		for (int d = lane; d < hd; d += DK_WARP) {
			ks[warp][d] = k[krow + d];
			vs[warp][d] = v[krow + d];
		}
		__syncwarp();
		float KA[BWD_MAXD / DK_WARP], VA[BWD_MAXD / DK_WARP];
		for (int r = 0; r < BWD_MAXD / DK_WARP; r++) KA[r] = VA[r] = 0;
		for (int h = g * group; h < (g + 1) * group; h++) {
			const float *qb = q + a * ldq + (i64)h * hd, *db = dout + a * ldq + (i64)h * hd;
			for (int i0 = kj; i0 < L; i0 += DK_WARP) {
				int i = i0 + lane;
				float p = 0, dsc = 0;
				if (i < L) {
					const float *qr = qb + (i64)i * ldq, *dr = db + (i64)i * ldq;
					float sc = 0, dp = 0;
					for (int d = 0; d < hd; d++) {
						sc += qr[d] * ks[warp][d];
						dp += dr[d] * vs[warp][d];
					}
					p = expf(sc * scale - lse[(a + i) * nhead + h]);
					dsc = p * (dp - dsum[(a + i) * nhead + h]);
				}
				int ni = imin(DK_WARP, L - i0);
				for (int ii = 0; ii < ni; ii++) {
					float pi = __shfl_sync(DK_FULL, p, ii), dsi = __shfl_sync(DK_FULL, dsc, ii);
					const float *qr = qb + (i64)(i0 + ii) * ldq, *dr = db + (i64)(i0 + ii) * ldq;
					for (int r = 0; r < BWD_MAXD / DK_WARP; r++) {
						int d = lane + r * DK_WARP;
						if (d < hd) {
							VA[r] += pi * dr[d];
							KA[r] += dsi * qr[d];
						}
					}
				}
			}
		}
		for (int r = 0; r < BWD_MAXD / DK_WARP; r++) {
			int d = lane + r * DK_WARP;
			if (d < hd) {
				dk[krow + d] += scale * KA[r];
				dv[krow + d] += VA[r];
			}
		}
		__syncwarp();
	}
}

DK_REGISTER(k_attn_bwd_dq)
DK_REGISTER(k_attn_bwd_dkv)

// ======================================================================
// The tensor-core backward, head_dim HD in {64, 128}: FlashAttention 2's
// backward with BF16 mma.sync operands and fp32 accumulators, and no
// atomics (dq in a pass of its own):
//
//   k_attn_dsum        D_i = dout_i · O_i, with O recomputed by the
//                      forward's tensor-core kernel (the contract passes no
//                      O), one warp per (token, head);
//   k_attn_bwd_dq_mma  a block per (64-query tile, head), 16 queries a
//                      warp: for each 64-key tile, S = Q·Kᵀ and dP = dO·Vᵀ
//                      on tensor cores, P = exp(S·scale - lse),
//                      dS = P∘(dP - D), dq += scale·dS·K;
//   k_attn_bwd_dkv_mma a block per (64-key tile, kv head), 16 keys a warp:
//                      for each of the group's heads and each 64-query tile
//                      at or after the keys, Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ,
//                      dv += Pᵀ·dO, dk += scale·dSᵀ·Q.
//
// Fragments as in attn_mma (prelude.cuh): an accumulator pair of 8-column
// tiles is the A fragment of the next product over those 16 columns. Tiles
// are BF16 in dynamic shared memory, rows padded by 8 against bank
// conflicts; transposed copies serve the B operands whose pairs run along
// the other dimension.

// k_attn_dsum: dsum (rows) = Σ_d dout·o over rows = tokens·nhead rows of hd.
DK_KERNEL void k_attn_dsum(float *__restrict__ dsum, const float *__restrict__ dout, const float *__restrict__ o, i64 rows, int hd) {
	i64 r = (i64)blockIdx.x * (blockDim.x / DK_WARP) + threadIdx.x / DK_WARP;
	if (r >= rows) return; // a whole warp leaves together
	int lane = threadIdx.x % DK_WARP;
	float s = 0;
	for (int d = lane; d < hd; d += DK_WARP) s += dout[r * hd + d] * o[r * hd + d];
	s = warp_sum(s);
	if (lane == 0) dsum[r] = s;
}

// ld_a loads the A fragment of rows r..r+15, columns c..c+15 of a row-major
// BF16 tile with row stride ld.
DK_DEV void ld_a(u32 a[4], const u16 *t, int ld, int r, int c, int gr, int tq) {
	a[0] = *(const u32 *)&t[(r + gr) * ld + c + 2 * tq];
	a[1] = *(const u32 *)&t[(r + gr + 8) * ld + c + 2 * tq];
	a[2] = *(const u32 *)&t[(r + gr) * ld + c + 2 * tq + 8];
	a[3] = *(const u32 *)&t[(r + gr + 8) * ld + c + 2 * tq + 8];
}

// ld_b loads the B fragment of B[k][n] = t[n][k] (t row-major, stride ld)
// for k in c..c+15, n in n0..n0+7.
DK_DEV void ld_b(u32 b[2], const u16 *t, int ld, int n0, int c, int gr, int tq) {
	b[0] = *(const u32 *)&t[(n0 + gr) * ld + c + 2 * tq];
	b[1] = *(const u32 *)&t[(n0 + gr) * ld + c + 2 * tq + 8];
}

// acc_a turns the accumulators of 8-column tiles 2kk and 2kk+1 into the A
// fragment over those 16 columns, rounded to BF16.
DK_DEV void acc_a(u32 a[4], const float (*acc)[4], int kk) {
	a[0] = pack_bf16x2(acc[2 * kk][0], acc[2 * kk][1]);
	a[1] = pack_bf16x2(acc[2 * kk][2], acc[2 * kk][3]);
	a[2] = pack_bf16x2(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
	a[3] = pack_bf16x2(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// stage copies rows [r0, r0+64) of a (rows of stride ldg, columns
// [0, HD)) into the BF16 tile t (64 x HD+8) and, when tt is set, its
// transpose tt (HD x 72); rows at or past lim are zeros.
template <int HD>
DK_DEV void stage(u16 *t, u16 *tt, const float *g, i64 ldg, int r0, int lim) {
	for (int idx = threadIdx.x; idx < MMA_BQ * HD; idx += blockDim.x) {
		int r = idx / HD, c = idx - r * HD;
		float v = r0 + r < lim ? g[(i64)(r0 + r) * ldg + c] : 0.0f;
		u16 h = f2bf(v);
		t[r * (HD + 8) + c] = h;
		if (tt) tt[c * (MMA_BQ + 8) + r] = h;
	}
}

template <int HD>
DK_DEV void attn_bwd_dq_mma(float *__restrict__ dq, const float *__restrict__ dout, const float *__restrict__ q,
                            const float *__restrict__ k, const float *__restrict__ v, const float *__restrict__ lse,
                            const float *__restrict__ dsum, const i32 *__restrict__ starts, const i32 *__restrict__ tile_start,
                            int nseq, int nhead, int nkv, float scale) {
	DK_DYN_SMEM(u16, ks);              // [64][HD+8]: K, row-major
	u16 *vs = ks + MMA_BK * (HD + 8);  // [64][HD+8]: V
	u16 *kt = vs + MMA_BK * (HD + 8);  // [HD][72]: Kᵀ
	int s, q0;
	if (!tile_of(tile_start, nseq, blockIdx.x, MMA_BQ, &s, &q0)) return;
	int h = blockIdx.y, kvh = h / (nhead / nkv);
	int warp = threadIdx.x / DK_WARP, lane = threadIdx.x % DK_WARP;
	int gr = lane / 4, tq = lane % 4;
	i64 a = starts[s];
	int L = starts[s + 1] - starts[s];
	i64 ldq = (i64)nhead * HD, ldk = (i64)nkv * HD;
	const float *kb = k + a * ldk + (i64)kvh * HD;
	const float *vb = v + a * ldk + (i64)kvh * HD;
	// This thread's two query rows; rows past the sample's end act as its
	// last row and are not stored (as attn_mma).
	int r0 = q0 + warp * 16 + gr, r1 = r0 + 8;
	int c0 = imin(r0, L - 1), c1 = imin(r1, L - 1);
	u32 qa[HD / 16][4], da[HD / 16][4];
	{
		const float *q0p = q + (a + c0) * ldq + (i64)h * HD, *q1p = q + (a + c1) * ldq + (i64)h * HD;
		const float *d0p = dout + (a + c0) * ldq + (i64)h * HD, *d1p = dout + (a + c1) * ldq + (i64)h * HD;
		for (int kk = 0; kk < HD / 16; kk++) {
			int d = kk * 16 + 2 * tq;
			qa[kk][0] = pack_bf16x2(q0p[d], q0p[d + 1]);
			qa[kk][1] = pack_bf16x2(q1p[d], q1p[d + 1]);
			qa[kk][2] = pack_bf16x2(q0p[d + 8], q0p[d + 9]);
			qa[kk][3] = pack_bf16x2(q1p[d + 8], q1p[d + 9]);
			da[kk][0] = pack_bf16x2(d0p[d], d0p[d + 1]);
			da[kk][1] = pack_bf16x2(d1p[d], d1p[d + 1]);
			da[kk][2] = pack_bf16x2(d0p[d + 8], d0p[d + 9]);
			da[kk][3] = pack_bf16x2(d1p[d + 8], d1p[d + 9]);
		}
	}
	float l0 = lse[(a + c0) * nhead + h], l1 = lse[(a + c1) * nhead + h];
	float D0 = dsum[(a + c0) * nhead + h], D1 = dsum[(a + c1) * nhead + h];
	float dacc[HD / 8][4];
	for (int nb = 0; nb < HD / 8; nb++)
		for (int e = 0; e < 4; e++) dacc[nb][e] = 0;
	int nk = imin(q0 + MMA_BQ, L);
	int wlast = imin(q0 + warp * 16 + 15, L - 1);
	for (int k0 = 0; k0 < nk; k0 += MMA_BK) {
		__syncthreads(); // the previous tile's readers are done
		stage<HD>(ks, kt, kb + (i64)k0 * ldk, ldk, 0, nk - k0);
		stage<HD>(vs, 0, vb + (i64)k0 * ldk, ldk, 0, nk - k0);
		__syncthreads();
		if (k0 > wlast) continue; // every key of the tile is in this warp's future
		float sacc[MMA_BK / 8][4], pacc[MMA_BK / 8][4];
		for (int nt = 0; nt < MMA_BK / 8; nt++) {
			for (int e = 0; e < 4; e++) sacc[nt][e] = pacc[nt][e] = 0;
			for (int kk = 0; kk < HD / 16; kk++) {
				u32 b[2];
				ld_b(b, ks, HD + 8, nt * 8, kk * 16, gr, tq);
				mma_bf16_16816(sacc[nt], qa[kk], b);
				ld_b(b, vs, HD + 8, nt * 8, kk * 16, gr, tq);
				mma_bf16_16816(pacc[nt], da[kk], b);
			}
			for (int e = 0; e < 4; e++) {
				int key = k0 + nt * 8 + 2 * tq + (e & 1);
				int row = e < 2 ? c0 : c1;
				float p = key <= row ? expf(sacc[nt][e] * scale - (e < 2 ? l0 : l1)) : 0.0f;
				sacc[nt][e] = p * (pacc[nt][e] - (e < 2 ? D0 : D1)); // dS
			}
		}
		for (int kk = 0; kk < MMA_BK / 16; kk++) {
			u32 pa[4];
			acc_a(pa, sacc, kk);
			for (int nb = 0; nb < HD / 8; nb++) {
				u32 b[2];
				ld_b(b, kt, MMA_BK + 8, nb * 8, kk * 16, gr, tq);
				mma_bf16_16816(dacc[nb], pa, b);
			}
		}
	}
	float *o0 = dq + (a + r0) * ldq + (i64)h * HD, *o1 = dq + (a + r1) * ldq + (i64)h * HD;
	for (int nb = 0; nb < HD / 8; nb++) {
		int d = nb * 8 + 2 * tq;
		if (r0 < L) {
			o0[d] += scale * dacc[nb][0];
			o0[d + 1] += scale * dacc[nb][1];
		}
		if (r1 < L) {
			o1[d] += scale * dacc[nb][2];
			o1[d + 1] += scale * dacc[nb][3];
		}
	}
}

template <int HD>
DK_DEV void attn_bwd_dkv_mma(float *__restrict__ dk, float *__restrict__ dv, const float *__restrict__ dout,
                             const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                             const float *__restrict__ lse, const float *__restrict__ dsum, const i32 *__restrict__ starts,
                             const i32 *__restrict__ tile_start, int nseq, int nhead, int nkv, float scale) {
	DK_DYN_SMEM(u16, ks);                // [64][HD+8]: this block's K rows
	u16 *vs = ks + MMA_BK * (HD + 8);    // [64][HD+8]: its V rows
	u16 *qs = vs + MMA_BK * (HD + 8);    // [64][HD+8]: a query tile's Q
	u16 *dos = qs + MMA_BQ * (HD + 8);   // [64][HD+8]: its dO
	u16 *qt = dos + MMA_BQ * (HD + 8);   // [HD][72]: Qᵀ
	u16 *dot = qt + HD * (MMA_BQ + 8);   // [HD][72]: dOᵀ
	float *ls = (float *)(dot + HD * (MMA_BQ + 8)); // [64]: the tile's lse
	float *Ds = ls + MMA_BQ;                        // [64]: its D
	int s, k0;
	if (!tile_of(tile_start, nseq, blockIdx.x, MMA_BK, &s, &k0)) return;
	int kvh = blockIdx.y, group = nhead / nkv;
	int warp = threadIdx.x / DK_WARP, lane = threadIdx.x % DK_WARP;
	int gr = lane / 4, tq = lane % 4;
	i64 a = starts[s];
	int L = starts[s + 1] - starts[s];
	i64 ldq = (i64)nhead * HD, ldk = (i64)nkv * HD;
	stage<HD>(ks, 0, k + (a + k0) * ldk + (i64)kvh * HD, ldk, 0, L - k0);
	stage<HD>(vs, 0, v + (a + k0) * ldk + (i64)kvh * HD, ldk, 0, L - k0);
	int jA = k0 + warp * 16 + gr, jB = jA + 8; // this thread's two key rows
	float kacc[HD / 8][4], vacc[HD / 8][4];
	for (int nb = 0; nb < HD / 8; nb++)
		for (int e = 0; e < 4; e++) kacc[nb][e] = vacc[nb][e] = 0;
	bool any = k0 + warp * 16 < L; // the warp has a key in the sample
	for (int h = kvh * group; h < (kvh + 1) * group; h++) {
		for (int q0 = k0; q0 < L; q0 += MMA_BQ) {
			__syncthreads(); // the previous tile's readers are done
			stage<HD>(qs, qt, q + (a + q0) * ldq + (i64)h * HD, ldq, 0, L - q0);
			stage<HD>(dos, dot, dout + (a + q0) * ldq + (i64)h * HD, ldq, 0, L - q0);
			for (int i = threadIdx.x; i < MMA_BQ; i += blockDim.x) {
				bool in = q0 + i < L;
				ls[i] = in ? lse[(a + q0 + i) * nhead + h] : 0.0f;
				Ds[i] = in ? dsum[(a + q0 + i) * nhead + h] : 0.0f;
			}
			__syncthreads();
			if (!any || q0 + MMA_BQ - 1 < k0 + warp * 16) continue; // no query of the tile sees these keys
			float sacc[MMA_BQ / 8][4], pacc[MMA_BQ / 8][4];
			for (int nt = 0; nt < MMA_BQ / 8; nt++) {
				for (int e = 0; e < 4; e++) sacc[nt][e] = pacc[nt][e] = 0;
				for (int kk = 0; kk < HD / 16; kk++) {
					u32 ka[4], va[4], b[2];
					ld_a(ka, ks, HD + 8, warp * 16, kk * 16, gr, tq);
					ld_b(b, qs, HD + 8, nt * 8, kk * 16, gr, tq);
					mma_bf16_16816(sacc[nt], ka, b);
					ld_a(va, vs, HD + 8, warp * 16, kk * 16, gr, tq);
					ld_b(b, dos, HD + 8, nt * 8, kk * 16, gr, tq);
					mma_bf16_16816(pacc[nt], va, b);
				}
				for (int e = 0; e < 4; e++) {
					int qi = nt * 8 + 2 * tq + (e & 1); // within the tile
					int key = e < 2 ? jA : jB;
					bool ok = q0 + qi >= key && q0 + qi < L;
					float p = ok ? expf(sacc[nt][e] * scale - ls[qi]) : 0.0f;
					sacc[nt][e] = p;                        // Pᵀ
					pacc[nt][e] = p * (pacc[nt][e] - Ds[qi]); // dSᵀ
				}
			}
			for (int kk = 0; kk < MMA_BQ / 16; kk++) {
				u32 pa[4], sa[4];
				acc_a(pa, sacc, kk);
				acc_a(sa, pacc, kk);
				for (int nb = 0; nb < HD / 8; nb++) {
					u32 b[2];
					ld_b(b, dot, MMA_BQ + 8, nb * 8, kk * 16, gr, tq);
					mma_bf16_16816(vacc[nb], pa, b);
					ld_b(b, qt, MMA_BQ + 8, nb * 8, kk * 16, gr, tq);
					mma_bf16_16816(kacc[nb], sa, b);
				}
			}
		}
	}
	float *kA = dk + (a + jA) * ldk + (i64)kvh * HD, *kB = dk + (a + jB) * ldk + (i64)kvh * HD;
	float *vA = dv + (a + jA) * ldk + (i64)kvh * HD, *vB = dv + (a + jB) * ldk + (i64)kvh * HD;
	for (int nb = 0; nb < HD / 8; nb++) {
		int d = nb * 8 + 2 * tq;
		if (jA < L) {
			kA[d] += scale * kacc[nb][0];
			kA[d + 1] += scale * kacc[nb][1];
			vA[d] += vacc[nb][0];
			vA[d + 1] += vacc[nb][1];
		}
		if (jB < L) {
			kB[d] += scale * kacc[nb][2];
			kB[d + 1] += scale * kacc[nb][3];
			vB[d] += vacc[nb][2];
			vB[d + 1] += vacc[nb][3];
		}
	}
}

DK_KERNEL __launch_bounds__(128) void k_attn_bwd_dq_mma64(float *dq, const float *dout, const float *q, const float *k, const float *v,
                                                          const float *lse, const float *dsum, const i32 *starts, const i32 *tile_start,
                                                          int nseq, int nhead, int nkv, float scale) {
	attn_bwd_dq_mma<64>(dq, dout, q, k, v, lse, dsum, starts, tile_start, nseq, nhead, nkv, scale);
}
DK_KERNEL __launch_bounds__(128) void k_attn_bwd_dq_mma128(float *dq, const float *dout, const float *q, const float *k, const float *v,
                                                           const float *lse, const float *dsum, const i32 *starts,
                                                           const i32 *tile_start, int nseq, int nhead, int nkv, float scale) {
	attn_bwd_dq_mma<128>(dq, dout, q, k, v, lse, dsum, starts, tile_start, nseq, nhead, nkv, scale);
}
DK_KERNEL __launch_bounds__(128) void k_attn_bwd_dkv_mma64(float *dk, float *dv, const float *dout, const float *q, const float *k,
                                                           const float *v, const float *lse, const float *dsum, const i32 *starts,
                                                           const i32 *tile_start, int nseq, int nhead, int nkv, float scale) {
	attn_bwd_dkv_mma<64>(dk, dv, dout, q, k, v, lse, dsum, starts, tile_start, nseq, nhead, nkv, scale);
}
DK_KERNEL __launch_bounds__(128) void k_attn_bwd_dkv_mma128(float *dk, float *dv, const float *dout, const float *q, const float *k,
                                                            const float *v, const float *lse, const float *dsum, const i32 *starts,
                                                            const i32 *tile_start, int nseq, int nhead, int nkv, float scale) {
	attn_bwd_dkv_mma<128>(dk, dv, dout, q, k, v, lse, dsum, starts, tile_start, nseq, nhead, nkv, scale);
}

DK_REGISTER(k_attn_dsum)
DK_REGISTER(k_attn_bwd_dq_mma64)
DK_REGISTER(k_attn_bwd_dq_mma128)
DK_REGISTER(k_attn_bwd_dkv_mma64)
DK_REGISTER(k_attn_bwd_dkv_mma128)

// k_sdpa_meta: cuDNN's per-sample tensors (cudnn.go) for nseq packed
// samples, padded with empty samples to the plan's bucket of nb: four int32
// arrays of stride entries each, the element offsets of q/out rows
// (starts·h·d), of k/v rows (starts·hkv·d), of the stats (starts·h), then
// each sample's length. One block.
DK_KERNEL void k_sdpa_meta(i32 *meta, int stride, const i32 *starts, int nseq, int nb, int h, int hkv, int d) {
	for (int i = threadIdx.x; i <= nb; i += blockDim.x) {
		i32 s = starts[i < nseq ? i : nseq];
		meta[i] = s * h * d;
		meta[stride + i] = s * hkv * d;
		meta[2 * stride + i] = s * h;
		if (i < nb) meta[3 * stride + i] = i < nseq ? starts[i + 1] - s : 0;
	}
}

DK_REGISTER(k_sdpa_meta)
