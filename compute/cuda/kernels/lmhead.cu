// The streaming LM-head top-k. cuBLASLt writes the logits of a slab of rows
// against a tile of the vocabulary; k_lm_fold then folds each row's tile
// into that row's running log-sum-exp (rmax, rsum: lse = rmax + log(rsum))
// and running top-k, so [tokens x vocab] logits never exist. The running
// top-k lives in the outputs themselves, sorted: values in logprobs
// (tokens, k) and ids in ids (tokens, k); cnt (tokens) says how many are
// filled. k_lm_finish turns the values into log-probs.
//
// Order: by descending logit, ties by ascending id, as compute/cpu. A
// (value, id) pair is one 64-bit key, larger is better: the float's bits
// made order-preserving in the high word, ~id in the low word.

#define LM_TILE 4096 // vocab columns a fold covers (= 16 per thread)
#define LM_THREADS 256

DK_DEV u64 lm_key(float v, i32 id) {
	u32 u = __float_as_uint(v);
	u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
	return ((u64)u << 32) | (u64)(0xffffffffu - (u32)id);
}
DK_DEV float lm_val(u64 key) {
	u32 u = (u32)(key >> 32);
	return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}
DK_DEV i32 lm_id(u64 key) { return (i32)(0xffffffffu - (u32)key); }

DK_KERNEL void k_lm_init(float *rmax, double *rsum, i32 *cnt, i64 rows) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < rows; i += (i64)gridDim.x * blockDim.x) {
		rmax[i] = -DK_INF;
		rsum[i] = 0;
		cnt[i] = 0;
	}
}

// block_reduce combines one float per thread of a LM_THREADS block (max when
// domax, else sum); every thread gets the result. red: 8 floats.
DK_DEV float block_reduce(float v, bool domax, float *red) {
	v = domax ? warp_max(v) : warp_sum(v);
	int w = threadIdx.x / DK_WARP;
	__syncthreads(); // red's previous readers are done
	if (threadIdx.x % DK_WARP == 0) red[w] = v;
	__syncthreads();
	float r = red[0];
	for (int i = 1; i < LM_THREADS / DK_WARP; i++) r = domax ? fmaxf(r, red[i]) : r + red[i];
	return r;
}

// k_lm_fold: block b folds row row0+b, whose logits for vocab ids
// [col0, col0+nc) are tile[b*ld .. b*ld+nc), nc <= LM_TILE. Dynamic shared
// memory: LM_TILE + k keys (8 bytes each).
DK_KERNEL __launch_bounds__(LM_THREADS) void k_lm_fold(const float *__restrict__ tile, i64 ld, int nc, int col0, i64 row0,
                                                       float *__restrict__ rmax, double *__restrict__ rsum, i32 *__restrict__ cnt,
                                                       float *__restrict__ topv, i32 *__restrict__ topi, int k) {
	DK_DYN_SMEM(u64, cand);
	u64 *merged = cand + LM_TILE;
	__shared__ float red[LM_THREADS / DK_WARP];
	__shared__ int ncand;
	i64 row = row0 + blockIdx.x;
	const float *lg = tile + (i64)blockIdx.x * ld;
	float vals[LM_TILE / LM_THREADS];
	float tmax = -DK_INF;
	for (int i = 0; i < LM_TILE / LM_THREADS; i++) {
		int c = threadIdx.x + i * LM_THREADS;
		vals[i] = c < nc ? lg[c] : -DK_INF;
		tmax = fmaxf(tmax, vals[i]);
	}
	tmax = block_reduce(tmax, true, red);
	float ts = 0;
	for (int i = 0; i < LM_TILE / LM_THREADS; i++) ts += expf(vals[i] - tmax); // -inf -> 0
	ts = block_reduce(ts, false, red);
	if (threadIdx.x == 0) {
		double rm = rmax[row], rs = rsum[row];
		if (tmax > rm) {
			rsum[row] = rs * exp(rm - (double)tmax) + ts;
			rmax[row] = tmax;
		} else {
			rsum[row] = rs + (double)ts * exp((double)tmax - rm);
		}
		ncand = 0;
	}
	int n = cnt[row];
	float *tv = topv + row * k;
	i32 *ti = topi + row * k;
	u64 thr = n == k ? lm_key(tv[k - 1], ti[k - 1]) : 0;
	__syncthreads();
	// Candidates: what beats the current k-th best (everything while the
	// list is not full). A logit equal to the k-th best has a higher id, so
	// it never enters, as on the CPU.
	for (int i = 0; i < LM_TILE / LM_THREADS; i++) {
		int c = threadIdx.x + i * LM_THREADS;
		if (c < nc) {
			u64 key = lm_key(vals[i], col0 + c);
			if (key > thr) cand[atomicAdd(&ncand, 1)] = key;
		}
	}
	__syncthreads();
	int nct = ncand;
	if (nct == 0) return; // the common case once the list has filled
	// Bitonic sort of cand[0, p) descending, padded with the smallest key.
	int p = 1;
	while (p < nct) p <<= 1;
	for (int i = nct + threadIdx.x; i < p; i += LM_THREADS) cand[i] = 0;
	__syncthreads();
	for (int size = 2; size <= p; size <<= 1) {
		for (int stride = size / 2; stride > 0; stride >>= 1) {
			for (int i = threadIdx.x; i < p; i += LM_THREADS) {
				int j = i ^ stride;
				if (j > i) {
					bool desc = (i & size) == 0;
					u64 x = cand[i], y = cand[j];
					if (desc ? x < y : x > y) {
						cand[i] = y;
						cand[j] = x;
					}
				}
			}
			__syncthreads();
		}
	}
	// Merge the list (n, descending) with the best m candidates (descending)
	// into the best nn: output o takes the co-rank split (i from the list,
	// o-i from the candidates) found by binary search; keys are distinct.
	int m = imin(nct, k);
	int nn = imin(n + m, k);
	for (int o = threadIdx.x; o < nn; o += LM_THREADS) {
		int lo = imax(0, o - m), hi = imin(o, n);
		while (lo < hi) { // the least i with list[i] < cand[o-1-i] (or i = hi)
			int i = (lo + hi) / 2;
			if (lm_key(tv[i], ti[i]) > cand[o - 1 - i]) lo = i + 1;
			else hi = i;
		}
		int i = lo, j = o - lo;
		u64 kl = i < n ? lm_key(tv[i], ti[i]) : 0;
		u64 kc = j < m ? cand[j] : 0;
		merged[o] = kl > kc ? kl : kc;
	}
	__syncthreads();
	for (int o = threadIdx.x; o < nn; o += LM_THREADS) {
		tv[o] = lm_val(merged[o]);
		ti[o] = lm_id(merged[o]);
	}
	if (threadIdx.x == 0) cnt[row] = nn;
}

// k_lm_finish: topv (rows, k) logits -> log-probs, v - (rmax + log(rsum)),
// in float64 and then rounded, as compute/cpu.
DK_KERNEL void k_lm_finish(float *topv, const float *__restrict__ rmax, const double *__restrict__ rsum, i64 rows, int k) {
	i64 total = rows * (i64)k;
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
		i64 r = i / k;
		double lse = (double)rmax[r] + log(rsum[r]);
		topv[i] = (float)((double)topv[i] - lse);
	}
}

DK_REGISTER(k_lm_init)
DK_REGISTER(k_lm_fold)
DK_REGISTER(k_lm_finish)
