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
#define LM_BLOCK 64                 // = compute.SampleBlock
#define LM_BPT (LM_TILE / LM_BLOCK) // blocks a fold tile

// lm_term is an id's term of its block's sum (LMHeadSample), from
// d = logit - tile max: exp(d), or 0 more than 87 nats below (the range of
// a float32 exp, as on the CPU).
DK_DEV float lm_term(float d) { return d >= -87.0f ? expf(d) : 0.0f; }

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

// lm_sort_desc sorts keys[0, n) descending (a bitonic sort over the
// block's threads), padding keys[n, p) with 0, the smallest key, p the
// power of two at or above n. Every thread of the block must call it.
DK_DEV void lm_sort_desc(u64 *keys, int n) {
	int p = 1;
	while (p < n) p <<= 1;
	for (int i = n + threadIdx.x; i < p; i += LM_THREADS) keys[i] = 0;
	__syncthreads();
	for (int size = 2; size <= p; size <<= 1) {
		for (int stride = size / 2; stride > 0; stride >>= 1) {
			for (int i = threadIdx.x; i < p; i += LM_THREADS) {
				int j = i ^ stride;
				if (j > i) {
					bool desc = (i & size) == 0;
					u64 x = keys[i], y = keys[j];
					if (desc ? x < y : x > y) {
						keys[i] = y;
						keys[j] = x;
					}
				}
			}
			__syncthreads();
		}
	}
}

// k_lm_fold: block b folds row row0+b, whose logits for vocab ids
// [col0, col0+nc) are tile[b*ld .. b*ld+nc), nc <= LM_TILE. Dynamic shared
// memory: LM_TILE + k keys (8 bytes each). With bsum set (LMHeadSample), it
// also keeps the slab row b's sums of its LM_BLOCK-id blocks (bsum, nblk a
// row, from block col0/LM_BLOCK: each id's term lm_term(logit - tile max)
// in fp32, the sums in double), the tile max and the blocks' total (btmax,
// btsum, ntile a row, at col0/LM_TILE), from the exps the log-sum-exp
// takes (a kernel of its own read the tile a second time).
DK_KERNEL __launch_bounds__(LM_THREADS) void k_lm_fold(const float *__restrict__ tile, i64 ld, int nc, int col0, i64 row0,
                                                       float *__restrict__ rmax, double *__restrict__ rsum, i32 *__restrict__ cnt,
                                                       float *__restrict__ topv, i32 *__restrict__ topi, int k,
                                                       double *__restrict__ bsum, float *__restrict__ btmax,
                                                       double *__restrict__ btsum, int nblk, int ntile) {
	DK_DYN_SMEM(u64, cand);
	u64 *merged = cand + LM_TILE;
	__shared__ float red[LM_THREADS / DK_WARP];
	__shared__ double half[LM_TILE / DK_WARP];
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
	int lane = threadIdx.x % DK_WARP, w = threadIdx.x / DK_WARP;
	for (int i = 0; i < LM_TILE / LM_THREADS; i++) {
		float d = vals[i] - tmax, e = expf(d); // -inf -> 0
		ts += e;
		if (bsum) {
			double s = warp_sum_d(d >= -87.0f ? e : 0.0f); // lm_term(d); columns i*LM_THREADS + w*32 .. +31
			if (lane == 0) half[i * (LM_THREADS / DK_WARP) + w] = s;
		}
	}
	if (bsum) {
		__syncthreads();
		int nb = (nc + LM_BLOCK - 1) / LM_BLOCK;
		double *bs = bsum + (i64)blockIdx.x * nblk + col0 / LM_BLOCK;
		for (int j = threadIdx.x; j < nb; j += LM_THREADS) bs[j] = half[2 * j] + half[2 * j + 1];
		__syncthreads();
		if (threadIdx.x == 0) {
			double t = 0;
			for (int j = 0; j < nb; j++) t += bs[j];
			btmax[(i64)blockIdx.x * ntile + col0 / LM_TILE] = tmax;
			btsum[(i64)blockIdx.x * ntile + col0 / LM_TILE] = t;
		}
	}
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
	if (k == 0) return; // LMHeadSample's sampled kind: the log-sum-exp only
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
	lm_sort_desc(cand, nct); // (bitonic, padded with the smallest key)
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

// --- k_lm_fold_gemm: k_lm_fold over a whole GEMM tile in one launch.
//
// The same sums and the same top-k as k_lm_fold called once per LM_TILE
// columns, bit for bit: each LM_TILE-column piece has the same tile max,
// the same fp32 sum in the same order and the same float64 merge into the
// row's log-sum-exp, and the top-k is the exact top-k of the keys. What
// changes is the cost of a piece:
//   - the row's state (rmax, rsum, cnt and the top-k list) is read once
//     a launch and written once (the list in shared memory, rmax and rsum
//     in thread 0's registers), not once a piece;
//   - the next piece's logits are loaded while this one is reduced;
//   - the reductions take one barrier each (their buffers alternate) and
//     the candidates are counted inside the sum's;
//   - where more than k logits beat the k-th best (a row's first piece:
//     all of them), a radix select over the 64-bit keys finds the piece's
//     best k instead of k_lm_fold's bitonic sort of all of them (78
//     barriers for 4096 keys);
//   - up to LM_RANKMAX candidates enter the list by rank (each key's place
//     is its rank in the list plus its rank among the candidates), with no
//     sort and no search in global memory.
// Shared memory: LM_TILE + k keys, as k_lm_fold; k <= LM_TILE/2 (the
// merge writes into the candidates' last k slots).

#define LM_PER (LM_TILE / LM_THREADS) // logits a thread holds of a piece
#define LM_RANKMAX 256                // candidates merged by rank; more are sorted first

DK_DEV int warp_sum_i(int v) {
	for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(DK_FULL, v, m);
	return v;
}

// lm_load reads a row's logits [base, base+LM_TILE) of its nc into v
// (-inf past nc), thread t's LM_PER at t, t+LM_THREADS, ...
DK_DEV void lm_load(float *v, const float *__restrict__ lg, int base, int nc) {
	for (int i = 0; i < LM_PER; i++) {
		int c = base + (int)threadIdx.x + i * LM_THREADS;
		v[i] = c < nc ? lg[c] : -DK_INF;
	}
}

// Two blocks an SM: at 172 registers (NVRTC 11.8, sm_90) it ran one, 8
// warps for a latency-bound fold; at 128 ptxas spills about 20 bytes.
DK_KERNEL __launch_bounds__(LM_THREADS, 2) void k_lm_fold_gemm(const float *__restrict__ tile, i64 ld, int nc, int col0, i64 row0,
                                                            float *__restrict__ rmax, double *__restrict__ rsum, i32 *__restrict__ cnt,
                                                            float *__restrict__ topv, i32 *__restrict__ topi, int k,
                                                            double *__restrict__ bsum, float *__restrict__ btmax,
                                                            double *__restrict__ btsum, int nblk, int ntile) {
	DK_DYN_SMEM(u64, cand);     // a piece's candidates; the merge's output in the last k
	u64 *list = cand + LM_TILE; // the row's best n keys, descending
	u64 *out = cand + (LM_TILE - k);
	__shared__ float redm[LM_THREADS / DK_WARP], reds[LM_THREADS / DK_WARP];
	__shared__ int redc[LM_THREADS / DK_WARP];
	__shared__ double half[LM_TILE / DK_WARP];
	__shared__ int hist[256]; // the radix select's bins (LM_THREADS = 256: one a thread)
	__shared__ int ncand, selb, sela, sfull;
	i64 row = row0 + blockIdx.x;
	const float *lg = tile + (i64)blockIdx.x * ld;
	int lane = threadIdx.x % DK_WARP, w = threadIdx.x / DK_WARP;
	float rm = 0; // thread 0's: the row's running max and sum
	double rs = 0;
	if (threadIdx.x == 0) {
		rm = rmax[row];
		rs = rsum[row];
		ncand = 0;
	}
	int n = 0; // the list's length (uniform)
	u64 thr = 0; // a key must beat it to enter: the k-th best (0 while the list is not full)
	bool changed = false;
	float *tv = topv + row * k;
	i32 *ti = topi + row * k;
	if (k > 0) {
		n = cnt[row];
		for (int i = threadIdx.x; i < n; i += LM_THREADS) list[i] = lm_key(tv[i], ti[i]);
		__syncthreads();
		if (n == k) thr = list[k - 1];
	}
	float vals[LM_PER], nxt[LM_PER];
	lm_load(vals, lg, 0, nc);
	for (int t0 = 0; t0 < nc; t0 += LM_TILE) {
		int ns = imin(LM_TILE, nc - t0);
		if (t0 + LM_TILE < nc) lm_load(nxt, lg, t0 + LM_TILE, nc);
		float tmax = -DK_INF;
		for (int i = 0; i < LM_PER; i++) tmax = fmaxf(tmax, vals[i]);
		tmax = warp_max(tmax);
		if (lane == 0) redm[w] = tmax;
		__syncthreads();
		tmax = redm[0];
		for (int i = 1; i < LM_THREADS / DK_WARP; i++) tmax = fmaxf(tmax, redm[i]);
		float ts = 0;
		int mine = 0; // this thread's keys that beat thr
		for (int i = 0; i < LM_PER; i++) {
			int c = threadIdx.x + i * LM_THREADS;
			float d = vals[i] - tmax, e = expf(d); // -inf -> 0
			ts += e;
			if (bsum) {
				double s = warp_sum_d(d >= -87.0f ? e : 0.0f); // lm_term(d), as k_lm_fold
				if (lane == 0) half[i * (LM_THREADS / DK_WARP) + w] = s;
			}
			if (k > 0 && c < ns && lm_key(vals[i], col0 + t0 + c) > thr) mine++;
		}
		if (bsum) { // as k_lm_fold, for the piece at col0 + t0
			__syncthreads();
			int nb = (ns + LM_BLOCK - 1) / LM_BLOCK;
			double *bs = bsum + (i64)blockIdx.x * nblk + (col0 + t0) / LM_BLOCK;
			for (int j = threadIdx.x; j < nb; j += LM_THREADS) bs[j] = half[2 * j] + half[2 * j + 1];
			__syncthreads();
			if (threadIdx.x == 0) {
				double t = 0;
				for (int j = 0; j < nb; j++) t += bs[j];
				btmax[(i64)blockIdx.x * ntile + (col0 + t0) / LM_TILE] = tmax;
				btsum[(i64)blockIdx.x * ntile + (col0 + t0) / LM_TILE] = t;
			}
		}
		ts = warp_sum(ts);
		int cw = warp_sum_i(mine);
		if (lane == 0) {
			reds[w] = ts;
			redc[w] = cw;
		}
		__syncthreads();
		ts = reds[0];
		int nct = redc[0];
		for (int i = 1; i < LM_THREADS / DK_WARP; i++) {
			ts = ts + reds[i];
			nct += redc[i];
		}
		if (threadIdx.x == 0) { // k_lm_fold's merge, on the registers
			double drm = rm;
			if (tmax > drm) {
				rs = rs * exp(drm - (double)tmax) + ts;
				rm = tmax;
			} else {
				rs = rs + (double)ts * exp((double)tmax - drm);
			}
		}
		if (nct > 0) { // (uniform)
			// More than k candidates: only the piece's best k of them can
			// enter. Select them by the keys' bytes from the top: sel, on
			// the bytes smask covers, is the least prefix that still
			// qualifies (a key qualifies when (key & smask) >= sel).
			u64 sel = 0, smask = 0;
			if (nct > k) {
				int need = k;
				for (int shift = 56; shift >= 0; shift -= 8) {
					hist[threadIdx.x] = 0;
					__syncthreads();
					for (int i = 0; i < LM_PER; i++) {
						int c = threadIdx.x + i * LM_THREADS;
						u64 key = lm_key(vals[i], col0 + t0 + c);
						if (c < ns && key > thr && (key & smask) == sel) atomicAdd(&hist[(int)((key >> shift) & 255u)], 1);
					}
					__syncthreads();
					if (w == 0) { // lane l holds bins 255-8l .. 248-8l, descending
						int s = 0;
						for (int j = 0; j < 8; j++) s += hist[255 - 8 * lane - j];
						int inc = s;
						for (int o = 1; o < DK_WARP; o <<= 1) {
							int v = __shfl_sync(DK_FULL, inc, lane >= o ? lane - o : lane);
							if (lane >= o) inc += v;
						}
						int a = inc - s;
						if (a < need && need <= inc) { // the bin holding the need-th key
							for (int j = 0; j < 8; j++) {
								int b = 255 - 8 * lane - j, h = hist[b];
								if (a + h >= need) {
									selb = b;
									sela = a;
									sfull = a + h == need;
									break;
								}
								a += h;
							}
						}
					}
					__syncthreads();
					need -= sela;
					sel |= (u64)selb << shift;
					smask |= (u64)255u << shift;
					if (sfull) break; // every key of that bin is in
				}
			}
			for (int i = 0; i < LM_PER; i++) {
				int c = threadIdx.x + i * LM_THREADS;
				u64 key = lm_key(vals[i], col0 + t0 + c);
				if (c < ns && key > thr && (key & smask) >= sel) cand[atomicAdd(&ncand, 1)] = key;
			}
			__syncthreads();
			int m = ncand;
			DK_CHECK(m == imin(nct, k), "k_lm_fold_gemm: the candidates are not the best min(count, k)");
			if (m <= LM_RANKMAX) {
				// A key's place: the keys above it in the list and among
				// the candidates (keys are distinct).
				for (int o = threadIdx.x; o < n + m; o += LM_THREADS) {
					u64 key;
					int pos;
					if (o < n) {
						key = list[o];
						pos = o;
					} else {
						key = cand[o - n];
						int lo = 0, hi = n;
						while (lo < hi) {
							int mid = (lo + hi) / 2;
							if (list[mid] > key) lo = mid + 1;
							else hi = mid;
						}
						pos = lo;
					}
					for (int j = 0; j < m; j++) pos += cand[j] > key;
					if (pos < k) out[pos] = key;
				}
			} else {
				// Sort the candidates (padded with 0 up to a power of two,
				// p <= LM_TILE - k) and merge by co-rank, as k_lm_fold.
				lm_sort_desc(cand, m);
				int nn = imin(n + m, k);
				for (int o = threadIdx.x; o < nn; o += LM_THREADS) {
					int lo = imax(0, o - m), hi = imin(o, n);
					while (lo < hi) {
						int i = (lo + hi) / 2;
						if (list[i] > cand[o - 1 - i]) lo = i + 1;
						else hi = i;
					}
					int i = lo, j = o - lo;
					u64 kl = i < n ? list[i] : 0;
					u64 kc = j < m ? cand[j] : 0;
					out[o] = kl > kc ? kl : kc;
				}
			}
			__syncthreads();
			n = imin(n + m, k);
			for (int o = threadIdx.x; o < n; o += LM_THREADS) list[o] = out[o];
			if (threadIdx.x == 0) ncand = 0;
			__syncthreads();
			if (n == k) thr = list[k - 1];
			changed = true;
		}
		if (t0 + LM_TILE < nc)
			for (int i = 0; i < LM_PER; i++) vals[i] = nxt[i];
	}
	if (threadIdx.x == 0) {
		rmax[row] = rm;
		rsum[row] = rs;
	}
	if (changed) {
		for (int o = threadIdx.x; o < n; o += LM_THREADS) {
			tv[o] = lm_val(list[o]);
			ti[o] = lm_id(list[o]);
		}
		if (threadIdx.x == 0) cnt[row] = n;
	}
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

// --- LMHeadSample: the draws in the same pass over the vocabulary.
//
// Each fold (k_lm_fold, given bsum) keeps, per row of the slab, the fold tile's
// max (tmax), the sums of exp(logit - tile max) over its blocks of
// LM_BLOCK ids (bsum: each id's term in fp32, an id more than 87 nats below
// the tile max counting 0, as on the CPU; the sums in double) and their
// total (tsum, double). After the slab's last tile, k_lm_sample draws each
// row's samples: the top-k's blocks' mass outside it (their sums less the
// top-k ids' own terms, recomputed bit for bit from the top-k's logits,
// which are the GEMM's, where those hold at most half of the block; a
// block they dominate multiplied again, as on the CPU: a difference would
// lose the other ids' mass to rounding), the row's mass to draw from, each threshold located among the tiles' and
// then the blocks' cumulative sums, and each block that holds a threshold
// multiplied again (its LM_BLOCK logits, dot products of the BF16
// operands the GEMM multiplied, fp32 accumulation) and walked in double,
// ids ascending. Multiplying every top-k block again (up to k blocks of
// 64 weight rows a token) made a head+sampled pass 5.7x the top-k pass
// on an H200.


// lm_in_head reports whether id v is one of the row's k top-k ids.
DK_DEV bool lm_in_head(const i32 *ti, int k, i32 v) {
	for (int j = 0; j < k; j++)
		if (ti[j] == v) return true;
	return false;
}

// lm_block_logits: the block's threads compute z[j] = x·w[v0+j] for the
// nz <= LM_BLOCK ids of a block, four threads a logit (fp32, the same
// order for every row and call), into shared z. The block's weight rows
// pass through shared memory (stage) LM_CHUNK columns at a time, read in
// 16-byte pieces when hidden % 8 == 0 (the rows then 16-byte aligned):
// reading them in place, the four threads of a logit took 8 bytes of a
// row each step. Each thread still adds columns part, part+4, ... in
// order: the same sums. Every thread of the block must call it.
#define LM_CHUNK 256
#define LM_STAGE_LD (LM_CHUNK + 8) // a row's stride: 16-byte pieces, rows a few banks apart
DK_DEV void lm_block_logits(float *z, u16 *stage, const u16 *__restrict__ xr, const u16 *__restrict__ wb, int hidden, i32 v0, int nz) {
	int j = threadIdx.x / 4, part = threadIdx.x % 4;
	float acc = 0;
	for (int c0 = 0; c0 < hidden; c0 += LM_CHUNK) {
		int cw = hidden - c0 < LM_CHUNK ? hidden - c0 : LM_CHUNK;
		__syncthreads(); // the last chunk is read
		if (hidden % 8 == 0) {
			int pr = cw / 8; // 16-byte pieces a row
			for (int i = threadIdx.x; i < nz * pr; i += LM_THREADS) {
				int r = i / pr, q = (i - r * pr) * 8;
				*(dk_u4 *)(stage + r * LM_STAGE_LD + q) = *(const dk_u4 *)(wb + (i64)(v0 + r) * hidden + c0 + q);
			}
		} else {
			for (int i = threadIdx.x; i < nz * cw; i += LM_THREADS) {
				int r = i / cw, q = i - r * cw;
				stage[r * LM_STAGE_LD + q] = wb[(i64)(v0 + r) * hidden + c0 + q];
			}
		}
		__syncthreads();
		if (j < nz)
			for (int q = part; q < cw; q += 4) acc += bf2f(xr[c0 + q]) * bf2f(stage[j * LM_STAGE_LD + q]);
	}
	acc += __shfl_xor_sync(DK_FULL, acc, 1);
	acc += __shfl_xor_sync(DK_FULL, acc, 2);
	if (part == 0 && j < LM_BLOCK) z[j] = acc;
}

// k_lm_sample: block b draws row row0+b's n samples (see above). xb: the
// slab's BF16 rows (nr, hidden), wb the BF16 weights (vocab, hidden); rmax,
// rsum, topi, u, drawn, tail indexed by the global row; bsum, tmax, tsum,
// blk and thr by the slab's row (blk, thr: n a row, scratch).
DK_KERNEL __launch_bounds__(LM_THREADS) void k_lm_sample(const u16 *__restrict__ xb, const u16 *__restrict__ wb, int hidden, int vocab,
                                                         const float *__restrict__ rmax, const double *__restrict__ rsum, i64 row0,
                                                         double *__restrict__ bsum, const float *__restrict__ tmax, double *__restrict__ tsum,
                                                         int nblk, int ntile, const float *__restrict__ topv, const i32 *__restrict__ topi, int k, int head,
                                                         const i32 *__restrict__ u, int n, i32 *__restrict__ blk, double *__restrict__ thr,
                                                         i32 *__restrict__ drawn, float *__restrict__ tail) {
	__shared__ float z[LM_BLOCK];
	__shared__ double e[LM_BLOCK];
	__shared__ double smass;
	__shared__ __align__(16) u16 stage[LM_BLOCK * LM_STAGE_LD];
	i64 sr = blockIdx.x, row = row0 + sr;
	const u16 *xr = xb + sr * hidden;
	double *bs = bsum + sr * nblk;
	const float *tm = tmax + sr * ntile;
	double *ts = tsum + sr * ntile;
	i32 *bl = blk + sr * n;
	double *th = thr + sr * n;
	i32 *dr = drawn + row * n;
	const i32 *ti = topi + row * k;
	const float *tv = topv + row * k;
	double mx = rmax[row];
	int nh = head ? k : 0;
	// The top-k's blocks: their mass outside it, relative to the tile max.
	// Where the top-k ids hold at most half of a block's sum, the sum less
	// their own terms (recomputed bit for bit: the fold keeps the GEMM's
	// logits, the same tile max; in double the difference keeps its
	// relative accuracy); a block they dominate (a peaked softmax's) is
	// multiplied again and its ids outside the top-k summed exactly, in
	// double, as compute/cpu does. The loop and its branches are uniform
	// across the block's threads (ti, tv and bs are shared).
	for (int h = 0; h < nh; h++) {
		i32 b = ti[h] / LM_BLOCK;
		bool seen = false;
		for (int g = 0; g < h; g++) seen = seen || ti[g] / LM_BLOCK == b;
		if (seen) continue;
		const float t = tm[b / LM_BPT];
		double in = 0; // the top-k's terms in block b, in rank order
		for (int g = h; g < nh; g++)
			if (ti[g] / LM_BLOCK == b) in += (double)lm_term(tv[g] - t);
		double sum = bs[b];
		if (in <= 0.5 * sum) {
			__syncthreads(); // every thread has read bs[b]
			if (threadIdx.x == 0) bs[b] = sum - in > 0 ? sum - in : 0;
			__syncthreads();
			continue;
		}
		i32 v0 = b * LM_BLOCK;
		int nz = vocab - v0 < LM_BLOCK ? vocab - v0 : LM_BLOCK;
		lm_block_logits(z, stage, xr, wb, hidden, v0, nz);
		__syncthreads();
		if (threadIdx.x < nz)
			e[threadIdx.x] = lm_in_head(ti, nh, v0 + threadIdx.x) ? 0.0 : exp((double)z[threadIdx.x] - (double)t);
		__syncthreads();
		if (threadIdx.x == 0) {
			double c = 0;
			for (int j = 0; j < nz; j++) c += e[j];
			bs[b] = c;
		}
		__syncthreads();
	}
	if (threadIdx.x == 0) {
		for (int h = 0; h < nh; h++) { // their tiles' totals again
			int t = ti[h] / LM_TILE;
			bool seen = false;
			for (int g = 0; g < h; g++) seen = seen || ti[g] / LM_TILE == t;
			if (seen) continue;
			double s = 0;
			int end = (t + 1) * LM_BPT < nblk ? (t + 1) * LM_BPT : nblk;
			for (int j = t * LM_BPT; j < end; j++) s += bs[j];
			ts[t] = s;
		}
		double mass = 0;
		for (int t = 0; t < ntile; t++) mass += ts[t] * exp((double)tm[t] - mx);
		smass = mass;
		tail[row] = (float)(mass / rsum[row]);
		if (mass > 0) {
			// Locate each threshold (as compute/cpu's k_draw_locate).
			int lt = ntile - 1;
			while (lt > 0 && !(ts[lt] > 0)) lt--;
			int t = 0, j = 0;
			double cum = 0, sc = exp((double)tm[0] - mx), T = ts[0] * sc, cj = 0;
			for (int d = 0; d < n; d++) {
				const i32 *ud = u + (row * n + d) * 2;
				double x = (double)((u64)(u32)ud[0] | (u64)(u32)ud[1] << 32) * (1.0 / 9007199254740992.0) * mass;
				while (t < ntile && cum + T <= x) {
					cum += T;
					t++;
					j = t * LM_BPT, cj = 0;
					if (t < ntile) sc = exp((double)tm[t] - mx), T = ts[t] * sc;
				}
				int tt = t == ntile ? lt : t;
				int end = (tt + 1) * LM_BPT < nblk ? (tt + 1) * LM_BPT : nblk;
				bool found = false;
				if (t < ntile) {
					double xl = x - cum;
					while (j < end && cj + bs[j] * sc <= xl) cj += bs[j++] * sc;
					if (j < end) {
						bl[d] = j;
						th[d] = xl - cj;
						found = true;
					}
				}
				if (!found) { // rounding: the last block with mass, its last id with mass
					int lb = end - 1;
					while (lb > tt * LM_BPT && !(bs[lb] > 0)) lb--;
					bl[d] = lb;
					th[d] = DK_INF;
				}
			}
		}
	}
	__syncthreads();
	if (!(smass > 0)) {
		for (int d = threadIdx.x; d < n; d += LM_THREADS) dr[d] = -1; // nothing outside the head
		return;
	}
	// Walk each block that holds thresholds.
	for (int d0 = 0; d0 < n;) {
		i32 b = bl[d0];
		int d1 = d0 + 1;
		while (d1 < n && bl[d1] == b) d1++;
		i32 v0 = b * LM_BLOCK;
		int nz = vocab - v0 < LM_BLOCK ? vocab - v0 : LM_BLOCK;
		lm_block_logits(z, stage, xr, wb, hidden, v0, nz);
		__syncthreads();
		if (threadIdx.x < nz) {
			i32 v = v0 + threadIdx.x;
			e[threadIdx.x] = lm_in_head(ti, nh, v) ? -1.0 : exp((double)z[threadIdx.x] - mx);
		}
		__syncthreads();
		if (threadIdx.x == 0) {
			double c = 0;
			int d = d0;
			i32 last = -1, lastout = -1;
			for (int j = 0; j < nz && d < d1; j++) {
				if (e[j] < 0) continue; // a top-k id
				lastout = v0 + j;
				if (e[j] == 0) continue;
				c += e[j];
				last = v0 + j;
				while (d < d1 && c > th[d]) dr[d++] = v0 + j;
			}
			if (last < 0) last = lastout;
			while (d < d1) dr[d++] = last;
		}
		__syncthreads();
		d0 = d1;
	}
}

DK_REGISTER(k_lm_init)
DK_REGISTER(k_lm_fold)
DK_REGISTER(k_lm_fold_gemm)
DK_REGISTER(k_lm_finish)
DK_REGISTER(k_lm_sample)
