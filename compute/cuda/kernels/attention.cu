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

// --- The tensor-core kernels, FlashAttention 2's way (Dao, 2023), for
// head_dim HD in {64, 128}; the forward here, the backward at the end of
// the file. What they share:
//
//   - BF16 operands: q, k, v (and the backward's dout) are BF16 copies the
//     host makes once per call (k_f32_to_bf16), same layouts as the F32
//     tensors; nothing is rounded per block. Products run on mma.sync
//     m16n8k16 (BF16 in, fp32 accumulators, prelude.cuh).
//   - 256 threads (8 warps) a block, FA_ROWS = 128 rows a block: query rows
//     (forward, dq) or key rows (dkv), 16 a warp, each warp the m16 of its
//     products, so a row's softmax statistics stay in the registers of the
//     4 lanes that hold it.
//   - Tiles in dynamic shared memory, rows padded to HD+8 BF16 (the 8 row
//     addresses of an ldmatrix phase then fall 16 bytes apart, in distinct
//     bank groups: no conflicts), filled by cp.async (16 bytes a copy, rows
//     past the sample's end zero-filled, not read) and double
//     buffered: the copies of step j+1 are in flight while step j computes,
//     with a barrier after each step before its buffer is refilled.
//   - Fragments from shared memory by ldmatrix (ldsm_a, ldsm_b2, ldsm_bt2);
//     the transposing form serves operands stored the other way round (V
//     in P·V, K in dS·K, Q and dO in the dkv kernel), so no tile is ever
//     transposed. An accumulator pair of 8-column tiles is the A fragment
//     of the next product over those 16 columns (acc_a), as in
//     FlashAttention 2: P and dS never leave the registers.
//   - Causal: tiles wholly in a warp's future are skipped (by the warp; the
//     block's copies go on), and only the tile that holds a warp's diagonal
//     is masked (16 | 64, so there is one a warp).
//   - Softmax in base 2 (ex2 of scores prescaled by scale·log₂e, as
//     FlashAttention); the log-sum-exp is saved in natural log.
//
// Blocks map to tiles through k_attn_plan with tile size FA_ROWS, over a
// grid of (tiles, heads) taken head-fastest (fa_block): the heads of a tile
// run side by side (a GQA group's share K and V in L2), and each sample's
// tiles in the order of decreasing work, which shortens the grid's tail:
// the forward and dq in reverse (a sample's last query tiles see the most
// keys), dkv in order (its first key tiles see the most queries).

#define FA_THREADS 256
#define FA_ROWS 128
#define FA_BK 64 // keys a step of the forward
#define FA_LOG2E 1.4426950408889634f

// A shared tile is named by sm, the block's dynamic shared memory (BF16
// elements), and t, the element offset of its first row (prelude.cuh:
// addresses as a base and an offset).

// fa_load copies rows [0, ROWS) of a global BF16 tile (HD columns, row
// stride ld elements) into the shared tile t (row stride HD+8) with
// cp.async; rows at or past n are zero-filled and not read. All threads of
// the block take part.
template <int ROWS, int HD>
DK_DEV void fa_load(u16 *sm, int t, const u16 *src, i64 ld, int n) {
	constexpr int CH = HD / 8; // 16-byte chunks a row
	for (int i = threadIdx.x; i < ROWS * CH; i += FA_THREADS) {
		int r = i / CH, c = i % CH;
		bool ok = r < n;
		cp_async16(sm, 2 * (t + r * (HD + 8) + c * 8), src + (ok ? r * ld : 0) + c * 8, ok);
	}
}

// fa_load_f32 copies src[i·ld] for i < ROWS into the floats at byte offset
// off of shared memory with cp.async, zeros for i >= n.
template <int ROWS>
DK_DEV void fa_load_f32(u16 *sm, int off, const float *src, i64 ld, int n) {
	for (int i = threadIdx.x; i < ROWS; i += FA_THREADS) cp_async4(sm, off + 4 * i, src + (i < n ? i * ld : 0), i < n);
}

// acc_a turns the accumulators of 8-column tiles 2kk and 2kk+1 into the A
// fragment over those 16 columns, rounded to BF16.
DK_DEV void acc_a(u32 a[4], const float (*acc)[4], int kk) {
	a[0] = pack_bf16x2(acc[2 * kk][0], acc[2 * kk][1]);
	a[1] = pack_bf16x2(acc[2 * kk][2], acc[2 * kk][3]);
	a[2] = pack_bf16x2(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
	a[3] = pack_bf16x2(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// quad_max and quad_sum reduce over the 4 lanes that hold a fragment row.
DK_DEV float quad_max(float v) {
	v = fmaxf(v, __shfl_xor_sync(DK_FULL, v, 1));
	return fmaxf(v, __shfl_xor_sync(DK_FULL, v, 2));
}
DK_DEV float quad_sum(float v) {
	v += __shfl_xor_sync(DK_FULL, v, 1);
	return v + __shfl_xor_sync(DK_FULL, v, 2);
}

struct __align__(8) fa_f2 {
	float x, y;
};

// fa_block: this block's tile index (in the order of k_attn_plan, reversed
// when rev) and head, heads fastest over the (tiles, heads) grid.
DK_DEV void fa_block(bool rev, int *tile, int *head) {
	int lin = blockIdx.y * gridDim.x + blockIdx.x, t = lin / gridDim.y;
	*head = lin % gridDim.y;
	*tile = rev ? gridDim.x - 1 - t : t;
}

// The forward: a block per (128-query tile, head), 16 queries a warp, keys
// in steps of FA_BK = 64. Shared memory: two stages of a K and a V tile
// (FA_BK x HD+8 each); the Q tile (128 rows) is staged once in the second
// stage's space, read into registers (A fragments, kept for the whole
// walk), and then overwritten by the prefetch of step 1. Per step and
// warp: S = Q·Kᵀ (16 x 64), the diagonal step masked, the online softmax
// (running max m and partial sums l per row, O rescaled), O += P·V.
// q (tokens, nhead, HD), k and v (tokens, nkv, HD), BF16; out F32.
template <int HD>
DK_DEV void attn_fa_fwd(float *__restrict__ out, float *__restrict__ lse, const u16 *__restrict__ q, const u16 *__restrict__ k,
                        const u16 *__restrict__ v, const i32 *__restrict__ starts, const i32 *__restrict__ tile_start, int nseq,
                        int nhead, int nkv, float scale) {
	constexpr int LD = HD + 8, T = FA_BK * LD; // a K or V tile
	static_assert(FA_ROWS == 2 * FA_BK, "the Q tile is staged in one stage's K and V tiles");
	DK_DYN_SMEM(u16, sm); // stage st: K at sm + 2·st·T, V at sm + (2·st+1)·T
	int s, q0, tile, h;
	fa_block(true, &tile, &h);
	if (!tile_of(tile_start, nseq, tile, FA_ROWS, &s, &q0)) return;
	int kvh = h / (nhead / nkv);
	int warp = threadIdx.x / DK_WARP, lane = threadIdx.x % DK_WARP;
	int gr = lane / 4, tq = lane % 4; // the fragment's row group and thread-in-group
	i64 a = starts[s];
	int L = starts[s + 1] - starts[s];
	i64 ldq = (i64)nhead * HD, ldk = (i64)nkv * HD;
	const u16 *kb = k + a * ldk + (i64)kvh * HD, *vb = v + a * ldk + (i64)kvh * HD;
	int nk = imin(q0 + FA_ROWS, L); // the keys any query of the tile sees
	int steps = (nk + FA_BK - 1) / FA_BK;

	fa_load<FA_ROWS, HD>(sm, 2 * T, q + (a + q0) * ldq + (i64)h * HD, ldq, L - q0);
	fa_load<FA_BK, HD>(sm, 0, kb, ldk, nk);
	fa_load<FA_BK, HD>(sm, T, vb, ldk, nk);
	cp_async_commit();
	cp_async_wait<0>();
	__syncthreads();
	u32 qa[HD / 16][4];
	for (int kk = 0; kk < HD / 16; kk++) ldsm_a(qa[kk], sm, 2 * T, LD, warp * 16, kk * 16, lane);
	__syncthreads(); // Q is in registers: stage 1 may be refilled

	int wq = q0 + warp * 16;          // the warp's first query
	int wlast = imin(wq + 15, L - 1); // its last in the sample
	int r0 = wq + gr, r1 = r0 + 8;    // this thread's two rows
	const float sl2 = scale * FA_LOG2E;
	float o[HD / 8][4];
	for (int nb = 0; nb < HD / 8; nb++)
		for (int e = 0; e < 4; e++) o[nb][e] = 0;
	// m: the rows' running max of the raw scores; l: this thread's partial
	// sums of exp2((s - m)·sl2), reduced over the quad at the end.
	float m0 = -DK_INF, m1 = -DK_INF, l0 = 0, l1 = 0;
	for (int j = 0; j < steps; j++) {
		int k0 = j * FA_BK;
		if (j + 1 < steps) {
			int nx = ((j + 1) & 1) * 2 * T;
			fa_load<FA_BK, HD>(sm, nx, kb + (i64)(k0 + FA_BK) * ldk, ldk, nk - k0 - FA_BK);
			fa_load<FA_BK, HD>(sm, nx + T, vb + (i64)(k0 + FA_BK) * ldk, ldk, nk - k0 - FA_BK);
		}
		cp_async_commit();
		cp_async_wait<1>(); // step j's copies (this thread's) have landed
		__syncthreads();    // and everyone's
		if (wq < L && k0 <= wlast) {
			int ks = (j & 1) * 2 * T, vs = ks + T;
			float sc[FA_BK / 8][4];
			for (int nt = 0; nt < FA_BK / 8; nt++)
				for (int e = 0; e < 4; e++) sc[nt][e] = 0;
			for (int kk = 0; kk < HD / 16; kk++)
				for (int nt = 0; nt < FA_BK / 8; nt += 2) {
					u32 b0[2], b1[2];
					ldsm_b2(b0, b1, sm, ks, LD, nt * 8, kk * 16, lane);
					mma_bf16_16816(sc[nt], qa[kk], b0);
					mma_bf16_16816(sc[nt + 1], qa[kk], b1);
				}
			if (k0 + FA_BK - 1 > wq) // the warp's diagonal: keys after a row (or past the sample's end) are masked
				for (int nt = 0; nt < FA_BK / 8; nt++)
					for (int e = 0; e < 4; e++)
						if (k0 + nt * 8 + 2 * tq + (e & 1) > (e < 2 ? r0 : r1)) sc[nt][e] = -DK_INF;
			float mx0 = m0, mx1 = m1;
			for (int nt = 0; nt < FA_BK / 8; nt++) {
				mx0 = fmaxf(mx0, fmaxf(sc[nt][0], sc[nt][1]));
				mx1 = fmaxf(mx1, fmaxf(sc[nt][2], sc[nt][3]));
			}
			// Finite: every row of an active warp sees key k0 (k0 <= wq).
			mx0 = quad_max(mx0);
			mx1 = quad_max(mx1);
			float ms0 = mx0 * sl2, ms1 = mx1 * sl2;
			float cr0 = fast_exp2(m0 * sl2 - ms0), cr1 = fast_exp2(m1 * sl2 - ms1); // 0 at the first step
			m0 = mx0;
			m1 = mx1;
			l0 *= cr0;
			l1 *= cr1;
			for (int nb = 0; nb < HD / 8; nb++) {
				o[nb][0] *= cr0;
				o[nb][1] *= cr0;
				o[nb][2] *= cr1;
				o[nb][3] *= cr1;
			}
			for (int nt = 0; nt < FA_BK / 8; nt++) {
				sc[nt][0] = fast_exp2(fmaf(sc[nt][0], sl2, -ms0));
				sc[nt][1] = fast_exp2(fmaf(sc[nt][1], sl2, -ms0));
				sc[nt][2] = fast_exp2(fmaf(sc[nt][2], sl2, -ms1));
				sc[nt][3] = fast_exp2(fmaf(sc[nt][3], sl2, -ms1));
				l0 += sc[nt][0] + sc[nt][1];
				l1 += sc[nt][2] + sc[nt][3];
			}
			for (int kk = 0; kk < FA_BK / 16; kk++) { // O += P·V, 16 keys at a time
				u32 pa[4];
				acc_a(pa, sc, kk);
				for (int nb = 0; nb < HD / 8; nb += 2) {
					u32 b0[2], b1[2];
					ldsm_bt2(b0, b1, sm, vs, LD, nb * 8, kk * 16, lane);
					mma_bf16_16816(o[nb], pa, b0);
					mma_bf16_16816(o[nb + 1], pa, b1);
				}
			}
		}
		if (j + 2 < steps) __syncthreads(); // step j+1 refills this stage with step j+2
	}
	if (wq >= L) return;
	l0 = quad_sum(l0);
	l1 = quad_sum(l1);
	float i0 = 1.0f / l0, i1 = 1.0f / l1;
	float *o0 = out + (a + r0) * ldq + (i64)h * HD, *o1 = out + (a + r1) * ldq + (i64)h * HD;
	for (int nb = 0; nb < HD / 8; nb++) {
		int d = nb * 8 + 2 * tq;
		if (r0 < L) *(fa_f2 *)(o0 + d) = fa_f2{o[nb][0] * i0, o[nb][1] * i0};
		if (r1 < L) *(fa_f2 *)(o1 + d) = fa_f2{o[nb][2] * i1, o[nb][3] * i1};
	}
	if (lse && tq == 0) {
		if (r0 < L) lse[(a + r0) * nhead + h] = m0 * scale + logf(l0);
		if (r1 < L) lse[(a + r1) * nhead + h] = m1 * scale + logf(l1);
	}
}

// k_attn_mma64, k_attn_mma128: the forward (FA_THREADS threads; dynamic
// shared memory 4·FA_BK·(HD+8)·2 bytes, plan.go: mmaFwdSmem).
DK_KERNEL __launch_bounds__(FA_THREADS, 2) void k_attn_mma64(float *out, float *lse, const u16 *q, const u16 *k, const u16 *v,
                                                             const i32 *starts, const i32 *tile_start, int nseq, int nhead,
                                                             int nkv, float scale) {
	attn_fa_fwd<64>(out, lse, q, k, v, starts, tile_start, nseq, nhead, nkv, scale);
}

DK_KERNEL __launch_bounds__(FA_THREADS, 1) void k_attn_mma128(float *out, float *lse, const u16 *q, const u16 *k, const u16 *v,
                                                              const i32 *starts, const i32 *tile_start, int nseq, int nhead,
                                                              int nkv, float scale) {
	attn_fa_fwd<128>(out, lse, q, k, v, starts, tile_start, nseq, nhead, nkv, scale);
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
// backward (the shared ground rules are at the forward's tensor-core
// kernels above), without its atomics: dq has a kernel of its own, so each
// kernel is the sole writer of its rows and every sum runs in a fixed order
// (deterministic). With P = exp(scale·Q·Kᵀ - lse) (the forward's lse),
// dP = dO·Vᵀ and dS = P∘(dP - D):
//
//   k_attn_dsum        D_i = dout_i · out_i from the BF16 dO the other two
//                      kernels read (so D is Σ_j P_ij·dP_ij of their dP,
//                      as cuDNN computes it) and the forward's output (the
//                      contract passes it; BF16 or F32), one warp per
//                      (token, head);
//   k_attn_bwd_dq_mma  a block per (128-query tile, head), 16 queries a
//                      warp with Q and dO in registers (A fragments); per
//                      step of BK keys (double-buffered K and V tiles):
//                      S = Q·Kᵀ, dP = dO·Vᵀ, dS, then dq += scale·dS·K;
//   k_attn_bwd_dkv_mma a block per (128-key tile, kv head), 16 keys a warp
//                      with dK and dV accumulated in registers; per step
//                      one BQ-query tile of one of the group's heads, from
//                      the diagonal to the sample's end (double-buffered Q,
//                      dO, lse and D): Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, Pᵀ and dSᵀ,
//                      dV += Pᵀ·dO, dK += scale·dSᵀ·Q.
//
// In the dkv kernel, queries past a sample's end come in as zero rows of Q
// and dO with lse and D zero, so their P is 1 and their dP and dS 0: they
// add nothing, and only the diagonal needs a mask. In dq, such rows are
// computed alike and not stored; keys past the end are zero rows after
// every valid query, masked on the diagonal.

// k_attn_dsum: dsum (rows) = Σ_d dout·o over rows = tokens·nhead rows of hd;
// dout BF16, o BF16 when o_bf.
DK_KERNEL void k_attn_dsum(float *__restrict__ dsum, const u16 *__restrict__ dout, const void *__restrict__ o, int o_bf, i64 rows, int hd) {
	i64 r = (i64)blockIdx.x * (blockDim.x / DK_WARP) + threadIdx.x / DK_WARP;
	if (r >= rows) return; // a whole warp leaves together
	int lane = threadIdx.x % DK_WARP;
	float s = 0;
	for (int d = lane; d < hd; d += DK_WARP) s += bf2f(dout[r * hd + d]) * ld_act(o, o_bf, r * hd + d);
	s = warp_sum(s);
	if (lane == 0) dsum[r] = s;
}

// attn_fa_dq: shared memory Q and dO (128 x HD+8 each), then two stages of
// a K and a V tile (BK x HD+8 each).
template <int HD, int BK>
DK_DEV void attn_fa_dq(float *__restrict__ dq, const u16 *__restrict__ dout, const u16 *__restrict__ q, const u16 *__restrict__ k,
                       const u16 *__restrict__ v, const float *__restrict__ lse, const float *__restrict__ dsum,
                       const i32 *__restrict__ starts, const i32 *__restrict__ tile_start, int nseq, int nhead, int nkv, float scale) {
	constexpr int LD = HD + 8, T = BK * LD;
	static_assert(BK % 16 == 0, "BK: a multiple of 16");
	DK_DYN_SMEM(u16, sm);
	constexpr int qs = 0, dos = FA_ROWS * LD, kv = 2 * FA_ROWS * LD; // stage st: K at kv + 2·st·T, V after it
	int s, q0, tile, h;
	fa_block(true, &tile, &h);
	if (!tile_of(tile_start, nseq, tile, FA_ROWS, &s, &q0)) return;
	int kvh = h / (nhead / nkv);
	int warp = threadIdx.x / DK_WARP, lane = threadIdx.x % DK_WARP;
	int gr = lane / 4, tq = lane % 4;
	i64 a = starts[s];
	int L = starts[s + 1] - starts[s];
	i64 ldq = (i64)nhead * HD, ldk = (i64)nkv * HD;
	const u16 *kb = k + a * ldk + (i64)kvh * HD, *vb = v + a * ldk + (i64)kvh * HD;
	int nk = imin(q0 + FA_ROWS, L);
	int steps = (nk + BK - 1) / BK;

	fa_load<FA_ROWS, HD>(sm, qs, q + (a + q0) * ldq + (i64)h * HD, ldq, L - q0);
	fa_load<FA_ROWS, HD>(sm, dos, dout + (a + q0) * ldq + (i64)h * HD, ldq, L - q0);
	fa_load<BK, HD>(sm, kv, kb, ldk, nk);
	fa_load<BK, HD>(sm, kv + T, vb, ldk, nk);
	cp_async_commit();
	int wq = q0 + warp * 16, wlast = imin(wq + 15, L - 1);
	int r0 = wq + gr, r1 = r0 + 8;
	// The rows' lse in base 2 and D; zeros past the sample's end (not stored).
	float lb0 = r0 < L ? lse[(a + r0) * nhead + h] * FA_LOG2E : 0.0f, lb1 = r1 < L ? lse[(a + r1) * nhead + h] * FA_LOG2E : 0.0f;
	float D0 = r0 < L ? dsum[(a + r0) * nhead + h] : 0.0f, D1 = r1 < L ? dsum[(a + r1) * nhead + h] : 0.0f;
	cp_async_wait<0>();
	__syncthreads();
	u32 qa[HD / 16][4], da[HD / 16][4];
	for (int kk = 0; kk < HD / 16; kk++) {
		ldsm_a(qa[kk], sm, qs, LD, warp * 16, kk * 16, lane);
		ldsm_a(da[kk], sm, dos, LD, warp * 16, kk * 16, lane);
	}
	const float sl2 = scale * FA_LOG2E;
	float acc[HD / 8][4];
	for (int nb = 0; nb < HD / 8; nb++)
		for (int e = 0; e < 4; e++) acc[nb][e] = 0;
	for (int j = 0; j < steps; j++) {
		int k0 = j * BK;
		if (j + 1 < steps) {
			int nx = kv + ((j + 1) & 1) * 2 * T;
			fa_load<BK, HD>(sm, nx, kb + (i64)(k0 + BK) * ldk, ldk, nk - k0 - BK);
			fa_load<BK, HD>(sm, nx + T, vb + (i64)(k0 + BK) * ldk, ldk, nk - k0 - BK);
		}
		cp_async_commit();
		cp_async_wait<1>();
		__syncthreads();
		if (wq < L && k0 <= wlast) {
			int ks = kv + (j & 1) * 2 * T, vs = ks + T;
			float sc[BK / 8][4], dp[BK / 8][4];
			for (int nt = 0; nt < BK / 8; nt++)
				for (int e = 0; e < 4; e++) sc[nt][e] = dp[nt][e] = 0;
			for (int kk = 0; kk < HD / 16; kk++)
				for (int nt = 0; nt < BK / 8; nt += 2) {
					u32 b0[2], b1[2];
					ldsm_b2(b0, b1, sm, ks, LD, nt * 8, kk * 16, lane);
					mma_bf16_16816(sc[nt], qa[kk], b0);
					mma_bf16_16816(sc[nt + 1], qa[kk], b1);
					ldsm_b2(b0, b1, sm, vs, LD, nt * 8, kk * 16, lane);
					mma_bf16_16816(dp[nt], da[kk], b0);
					mma_bf16_16816(dp[nt + 1], da[kk], b1);
				}
			bool diag = k0 + BK - 1 > wq;
			for (int nt = 0; nt < BK / 8; nt++)
				for (int e = 0; e < 4; e++) {
					bool lo = e < 2;
					float p = fast_exp2(fmaf(sc[nt][e], sl2, -(lo ? lb0 : lb1)));
					if (diag && k0 + nt * 8 + 2 * tq + (e & 1) > (lo ? r0 : r1)) p = 0;
					sc[nt][e] = p * (dp[nt][e] - (lo ? D0 : D1)); // dS
				}
			for (int kk = 0; kk < BK / 16; kk++) { // dq += dS·K, 16 keys at a time
				u32 sa[4];
				acc_a(sa, sc, kk);
				for (int nb = 0; nb < HD / 8; nb += 2) {
					u32 b0[2], b1[2];
					ldsm_bt2(b0, b1, sm, ks, LD, nb * 8, kk * 16, lane);
					mma_bf16_16816(acc[nb], sa, b0);
					mma_bf16_16816(acc[nb + 1], sa, b1);
				}
			}
		}
		if (j + 2 < steps) __syncthreads();
	}
	float *o0 = dq + (a + r0) * ldq + (i64)h * HD, *o1 = dq + (a + r1) * ldq + (i64)h * HD;
	for (int nb = 0; nb < HD / 8; nb++) {
		int d = nb * 8 + 2 * tq;
		if (r0 < L) {
			fa_f2 x = *(fa_f2 *)(o0 + d);
			*(fa_f2 *)(o0 + d) = fa_f2{x.x + scale * acc[nb][0], x.y + scale * acc[nb][1]};
		}
		if (r1 < L) {
			fa_f2 x = *(fa_f2 *)(o1 + d);
			*(fa_f2 *)(o1 + d) = fa_f2{x.x + scale * acc[nb][2], x.y + scale * acc[nb][3]};
		}
	}
}

// fa_dkv_load issues the copies of one step of attn_fa_dkv: BQ rows from
// token row on of head h's Q and dO into the tiles at t (BQ x HD+8 each, dO
// after Q), their lse and D into the floats at byte offset f (BQ each, D
// after lse); rows past the sample (n valid) are zeros.
template <int HD, int BQ>
DK_DEV void fa_dkv_load(u16 *sm, int t, int f, const u16 *q, const u16 *dout, const float *lse, const float *dsum, i64 row, int h,
                        int nhead, int n) {
	i64 ldq = (i64)nhead * HD;
	fa_load<BQ, HD>(sm, t, q + row * ldq + (i64)h * HD, ldq, n);
	fa_load<BQ, HD>(sm, t + BQ * (HD + 8), dout + row * ldq + (i64)h * HD, ldq, n);
	fa_load_f32<BQ>(sm, f, lse + row * nhead + h, nhead, n);
	fa_load_f32<BQ>(sm, f + 4 * BQ, dsum + row * nhead + h, nhead, n);
}

// attn_fa_dkv: shared memory K and V (128 x HD+8 each), two stages of a Q
// and a dO tile (BQ x HD+8 each), then two stages of BQ lse and BQ D. The
// steps run over the group's heads, and for each over the query tiles
// from the block's first key to the sample's end.
template <int HD, int BQ>
DK_DEV void attn_fa_dkv(float *__restrict__ dk, float *__restrict__ dv, const u16 *__restrict__ dout, const u16 *__restrict__ q,
                        const u16 *__restrict__ k, const u16 *__restrict__ v, const float *__restrict__ lse,
                        const float *__restrict__ dsum, const i32 *__restrict__ starts, const i32 *__restrict__ tile_start, int nseq,
                        int nhead, int nkv, float scale) {
	constexpr int LD = HD + 8, T = BQ * LD;
	static_assert(BQ % 16 == 0 && FA_ROWS % BQ == 0, "BQ: a multiple of 16 dividing the key tile");
	DK_DYN_SMEM(u16, sm);
	constexpr int ks = 0, vs = FA_ROWS * LD, qd = 2 * FA_ROWS * LD; // stage st: Q at qd + 2·st·T, dO after it
	constexpr int fb = 2 * (qd + 4 * T);                             // bytes; stage st: lse at fb + 8·st·BQ, D after it
	const float *fs = (const float *)(sm + qd + 4 * T);
	int s, k0, tile, kvh;
	fa_block(false, &tile, &kvh);
	if (!tile_of(tile_start, nseq, tile, FA_ROWS, &s, &k0)) return;
	int group = nhead / nkv;
	int warp = threadIdx.x / DK_WARP, lane = threadIdx.x % DK_WARP;
	int gr = lane / 4, tq = lane % 4;
	i64 a = starts[s];
	int L = starts[s + 1] - starts[s];
	i64 ldk = (i64)nkv * HD;
	int tiles = (L - k0 + BQ - 1) / BQ; // query tiles a head, from k0 on (the earlier ones see none of the keys)
	int steps = group * tiles;

	fa_load<FA_ROWS, HD>(sm, ks, k + (a + k0) * ldk + (i64)kvh * HD, ldk, L - k0);
	fa_load<FA_ROWS, HD>(sm, vs, v + (a + k0) * ldk + (i64)kvh * HD, ldk, L - k0);
	fa_dkv_load<HD, BQ>(sm, qd, fb, q, dout, lse, dsum, a + k0, kvh * group, nhead, L - k0);
	cp_async_commit();
	int wk = k0 + warp * 16;    // the warp's first key
	int jA = wk + gr, jB = jA + 8; // this thread's two keys
	const float sl2 = scale * FA_LOG2E;
	float kacc[HD / 8][4], vacc[HD / 8][4];
	for (int nb = 0; nb < HD / 8; nb++)
		for (int e = 0; e < 4; e++) kacc[nb][e] = vacc[nb][e] = 0;
	for (int j = 0; j < steps; j++) {
		int q0 = k0 + (j % tiles) * BQ;
		if (j + 1 < steps) {
			int h1 = kvh * group + (j + 1) / tiles, q1 = k0 + ((j + 1) % tiles) * BQ;
			int st = (j + 1) & 1;
			fa_dkv_load<HD, BQ>(sm, qd + st * 2 * T, fb + st * 8 * BQ, q, dout, lse, dsum, a + q1, h1, nhead, L - q1);
		}
		cp_async_commit();
		cp_async_wait<1>();
		__syncthreads();
		if (wk < L && q0 + BQ - 1 >= wk) { // some query of the tile sees some key of the warp
			int qs = qd + (j & 1) * 2 * T, dos = qs + T;
			const float *ls = fs + (j & 1) * 2 * BQ, *Ds = ls + BQ;
			float sc[BQ / 8][4], dp[BQ / 8][4];
			for (int nt = 0; nt < BQ / 8; nt++)
				for (int e = 0; e < 4; e++) sc[nt][e] = dp[nt][e] = 0;
			for (int kk = 0; kk < HD / 16; kk++) {
				u32 ka[4], va[4];
				ldsm_a(ka, sm, ks, LD, warp * 16, kk * 16, lane);
				ldsm_a(va, sm, vs, LD, warp * 16, kk * 16, lane);
				for (int nt = 0; nt < BQ / 8; nt += 2) {
					u32 b0[2], b1[2];
					ldsm_b2(b0, b1, sm, qs, LD, nt * 8, kk * 16, lane);
					mma_bf16_16816(sc[nt], ka, b0);
					mma_bf16_16816(sc[nt + 1], ka, b1);
					ldsm_b2(b0, b1, sm, dos, LD, nt * 8, kk * 16, lane);
					mma_bf16_16816(dp[nt], va, b0);
					mma_bf16_16816(dp[nt + 1], va, b1);
				}
			}
			bool diag = q0 < wk + 15; // some query of the tile precedes some key of the warp
			for (int nt = 0; nt < BQ / 8; nt++) {
				int c = nt * 8 + 2 * tq; // the columns (queries) c and c+1 of the tile
				fa_f2 lq = *(const fa_f2 *)(ls + c), dq2 = *(const fa_f2 *)(Ds + c);
				for (int e = 0; e < 4; e++) {
					bool odd = e & 1;
					float p = fast_exp2(fmaf(sc[nt][e], sl2, -(odd ? lq.y : lq.x) * FA_LOG2E));
					if (diag && q0 + c + odd < (e < 2 ? jA : jB)) p = 0;
					sc[nt][e] = p;                                   // Pᵀ
					dp[nt][e] = p * (dp[nt][e] - (odd ? dq2.y : dq2.x)); // dSᵀ
				}
			}
			for (int kk = 0; kk < BQ / 16; kk++) { // 16 queries at a time
				u32 pa[4], sa[4];
				acc_a(pa, sc, kk);
				acc_a(sa, dp, kk);
				for (int nb = 0; nb < HD / 8; nb += 2) {
					u32 b0[2], b1[2];
					ldsm_bt2(b0, b1, sm, dos, LD, nb * 8, kk * 16, lane);
					mma_bf16_16816(vacc[nb], pa, b0);
					mma_bf16_16816(vacc[nb + 1], pa, b1);
					ldsm_bt2(b0, b1, sm, qs, LD, nb * 8, kk * 16, lane);
					mma_bf16_16816(kacc[nb], sa, b0);
					mma_bf16_16816(kacc[nb + 1], sa, b1);
				}
			}
		}
		if (j + 2 < steps) __syncthreads();
	}
	float *kA = dk + (a + jA) * ldk + (i64)kvh * HD, *kB = dk + (a + jB) * ldk + (i64)kvh * HD;
	float *vA = dv + (a + jA) * ldk + (i64)kvh * HD, *vB = dv + (a + jB) * ldk + (i64)kvh * HD;
	for (int nb = 0; nb < HD / 8; nb++) {
		int d = nb * 8 + 2 * tq;
		if (jA < L) {
			fa_f2 x = *(fa_f2 *)(kA + d), y = *(fa_f2 *)(vA + d);
			*(fa_f2 *)(kA + d) = fa_f2{x.x + scale * kacc[nb][0], x.y + scale * kacc[nb][1]};
			*(fa_f2 *)(vA + d) = fa_f2{y.x + vacc[nb][0], y.y + vacc[nb][1]};
		}
		if (jB < L) {
			fa_f2 x = *(fa_f2 *)(kB + d), y = *(fa_f2 *)(vB + d);
			*(fa_f2 *)(kB + d) = fa_f2{x.x + scale * kacc[nb][2], x.y + scale * kacc[nb][3]};
			*(fa_f2 *)(vB + d) = fa_f2{y.x + vacc[nb][2], y.y + vacc[nb][3]};
		}
	}
}

// The entry points (FA_THREADS threads; dynamic shared memory as plan.go's
// mmaBwdSmem computes it): BK = 64 keys a step of dq, BQ = 64 queries a
// step of dkv.
#define FA_DQ_BK 64
#define FA_DKV_BQ 64

DK_KERNEL __launch_bounds__(FA_THREADS, 1) void k_attn_bwd_dq_mma64(float *dq, const u16 *dout, const u16 *q, const u16 *k,
                                                                    const u16 *v, const float *lse, const float *dsum,
                                                                    const i32 *starts, const i32 *tile_start, int nseq, int nhead,
                                                                    int nkv, float scale) {
	attn_fa_dq<64, FA_DQ_BK>(dq, dout, q, k, v, lse, dsum, starts, tile_start, nseq, nhead, nkv, scale);
}
DK_KERNEL __launch_bounds__(FA_THREADS, 1) void k_attn_bwd_dq_mma128(float *dq, const u16 *dout, const u16 *q, const u16 *k,
                                                                     const u16 *v, const float *lse, const float *dsum,
                                                                     const i32 *starts, const i32 *tile_start, int nseq, int nhead,
                                                                     int nkv, float scale) {
	attn_fa_dq<128, FA_DQ_BK>(dq, dout, q, k, v, lse, dsum, starts, tile_start, nseq, nhead, nkv, scale);
}
DK_KERNEL __launch_bounds__(FA_THREADS, 1) void k_attn_bwd_dkv_mma64(float *dk, float *dv, const u16 *dout, const u16 *q,
                                                                     const u16 *k, const u16 *v, const float *lse, const float *dsum,
                                                                     const i32 *starts, const i32 *tile_start, int nseq, int nhead,
                                                                     int nkv, float scale) {
	attn_fa_dkv<64, FA_DKV_BQ>(dk, dv, dout, q, k, v, lse, dsum, starts, tile_start, nseq, nhead, nkv, scale);
}
DK_KERNEL __launch_bounds__(FA_THREADS, 1) void k_attn_bwd_dkv_mma128(float *dk, float *dv, const u16 *dout, const u16 *q,
                                                                      const u16 *k, const u16 *v, const float *lse, const float *dsum,
                                                                      const i32 *starts, const i32 *tile_start, int nseq, int nhead,
                                                                      int nkv, float scale) {
	attn_fa_dkv<128, FA_DKV_BQ>(dk, dv, dout, q, k, v, lse, dsum, starts, tile_start, nseq, nhead, nkv, scale);
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
