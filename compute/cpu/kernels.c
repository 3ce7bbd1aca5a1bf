#include "kernels.h"
#include <math.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define V4 __attribute__((target("arch=x86-64-v4")))
#else
#define CLONES
#define V4
#endif

// fexp: exp for float32 to about 1 ulp: x = n ln2 + r, |r| <= ln2/2 (+ rounding), degree-7
// Taylor for e^r (truncation < 6e-9), times 2^n by exponent bits. Inputs are
// clamped to [-87, 88], so exp(-inf) gives ~1.6e-38, not 0: callers that need
// exact zeros (masked attention) write them.
static inline float fexp(float x) {
	x = x < -87.0f ? -87.0f : x;
	x = x > 88.0f ? 88.0f : x;
	// n = round(x/ln2) by the 1.5·2^23 trick: pure arithmetic, so it
	// vectorizes (floorf is a libc call unless -ffast-math).
	float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
	float r = x - n * 0.693145751953125f;
	r = r - n * 1.42860682030941723212e-6f;
	float p = 1.0f / 5040.0f;
	p = p * r + 1.0f / 720.0f;
	p = p * r + 1.0f / 120.0f;
	p = p * r + 1.0f / 24.0f;
	p = p * r + 1.0f / 6.0f;
	p = p * r + 0.5f;
	p = p * r + 1.0f;
	p = p * r + 1.0f;
	union { int32_t i; float f; } s = {.i = ((int32_t)n + 127) << 23};
	return p * s.f;
}

CLONES void k_expf(float *out, const float *x, long n) {
	for (long i = 0; i < n; i++) out[i] = fexp(x[i]);
}

// out (rows,dim) = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps), in fp32
// like HF's LlamaRMSNorm (hidden_states.to(float32); variance =
// pow(2).mean(-1)); the mean of squares is accumulated in double (as
// torch's fp32 reduction, it keeps its digits over long rows) and rounded
// to fp32. rstd (rows) receives the statistics, or is NULL.
CLONES void k_rmsnorm(float *out, float *rstd, const float *x, const float *w, long rows, long dim, float eps) {
	for (long r = 0; r < rows; r++) {
		const float *xr = x + r * dim;
		float *o = out + r * dim;
		double ss = 0;
#pragma omp simd reduction(+ : ss)
		for (long i = 0; i < dim; i++) ss += (double)xr[i] * (double)xr[i];
		float ms = (float)(ss / (double)dim);
		float rs = (float)(1.0 / sqrt((double)(ms + eps)));
		if (rstd) rstd[r] = rs;
		for (long i = 0; i < dim; i++) o[i] = (xr[i] * rs) * w[i];
	}
}

// k_rmsnorm_bwd: dout, x (rows,dim), w (dim), rstd (rows) -> dx (rows,dim)
// +=, dw_acc (dim, double) +=. With xh = x*rstd:
// dw += dout*xh; dx += rstd*(dout*w - xh*mean(dout*w*xh)).
CLONES void k_rmsnorm_bwd(float *dx, double *dw_acc, const float *dout, const float *x, const float *w,
                          const float *rstd, long rows, long dim) {
	for (long r = 0; r < rows; r++) {
		const float *xr = x + r * dim, *d = dout + r * dim;
		float *dxr = dx + r * dim;
		float rs = rstd[r];
		double dot = 0;
#pragma omp simd reduction(+ : dot)
		for (long i = 0; i < dim; i++) {
			float xh = xr[i] * rs;
			dot += (double)(d[i] * w[i] * xh);
			dw_acc[i] += (double)(d[i] * xh);
		}
		float m = (float)(dot / (double)dim);
		for (long i = 0; i < dim; i++) dxr[i] += rs * (d[i] * w[i] - xr[i] * rs * m);
	}
}

// out = silu(g) * u, silu(g) = g / (1 + exp(-g)).
CLONES void k_swiglu(float *out, const float *g, const float *u, long n) {
	for (long i = 0; i < n; i++) {
		float gv = g[i];
		out[i] = gv / (1.0f + fexp(-gv)) * u[i];
	}
}

CLONES void k_add(float *a, const float *b, long n) {
	for (long i = 0; i < n; i++) a[i] += b[i];
}

// Row-wise causal softmax in place on s (rows, ld): row i keeps its first
// first_len+i entries, softmaxed in fp32; the entries after them up to ld
// become 0. lse (row i at lse[i*lse_stride]) receives the log-sum-exp of
// the kept entries, or is NULL.
CLONES void k_softmax_causal(float *s, long rows, long ld, long first_len, float *lse, long lse_stride) {
	for (long r = 0; r < rows; r++) {
		float *row = s + r * ld;
		long n = first_len + r;
		if (n > ld) n = ld;
		float m = -INFINITY;
#pragma omp simd reduction(max : m)
		for (long i = 0; i < n; i++) m = row[i] > m ? row[i] : m;
		float sum = 0;
#pragma omp simd reduction(+ : sum)
		for (long i = 0; i < n; i++) {
			float e = fexp(row[i] - m);
			row[i] = e;
			sum += e;
		}
		float inv = 1.0f / sum;
		for (long i = 0; i < n; i++) row[i] *= inv;
		for (long i = n; i < ld; i++) row[i] = 0;
		if (lse) lse[r * lse_stride] = m + (float)log((double)sum);
	}
}

// k_softmax_recompute turns scores s (rows, ld) into the probabilities of
// k_softmax_causal from its saved lse: p = exp(s - lse) on the first
// first_len+i entries of row i, 0 after.
CLONES void k_softmax_recompute(float *s, long rows, long ld, long first_len, const float *lse, long lse_stride) {
	for (long r = 0; r < rows; r++) {
		float *row = s + r * ld;
		long n = first_len + r;
		if (n > ld) n = ld;
		float l = lse[r * lse_stride];
		for (long i = 0; i < n; i++) row[i] = fexp(row[i] - l);
		for (long i = n; i < ld; i++) row[i] = 0;
	}
}

// k_softmax_bwd turns dp (rows, ld), the gradient w.r.t. the probabilities
// p of k_softmax_causal, into the gradient w.r.t. the scores in place:
// ds = p*(dp - sum(p*dp)) on the kept entries, 0 after.
CLONES void k_softmax_bwd(float *dp, const float *p, long rows, long ld, long first_len) {
	for (long r = 0; r < rows; r++) {
		float *d = dp + r * ld;
		const float *pr = p + r * ld;
		long n = first_len + r;
		if (n > ld) n = ld;
		float dot = 0;
#pragma omp simd reduction(+ : dot)
		for (long i = 0; i < n; i++) dot += pr[i] * d[i];
		for (long i = 0; i < n; i++) d[i] = pr[i] * (d[i] - dot);
		for (long i = n; i < ld; i++) d[i] = 0;
	}
}

// worse orders heap entries: lower value, then (on ties) higher id, is worse.
static inline int worse(float va, int32_t ia, float vb, int32_t ib) {
	return va < vb || (va == vb && ia > ib);
}

// The heap's sifts move hs (the entries' payload slots, LMHeadSample) with
// the entries when it is not NULL.
static void sift_down(float *hv, int32_t *hi, int32_t *hs, int n, int i) {
	for (;;) {
		int l = 2 * i + 1, r = l + 1, m = i;
		if (l < n && worse(hv[l], hi[l], hv[m], hi[m])) m = l;
		if (r < n && worse(hv[r], hi[r], hv[m], hi[m])) m = r;
		if (m == i) return;
		float tv = hv[i]; hv[i] = hv[m]; hv[m] = tv;
		int32_t ti = hi[i]; hi[i] = hi[m]; hi[m] = ti;
		if (hs) { ti = hs[i]; hs[i] = hs[m]; hs[m] = ti; }
		i = m;
	}
}

static void sift_up(float *hv, int32_t *hi, int32_t *hs, int i) {
	while (i > 0) {
		int p = (i - 1) / 2;
		if (!worse(hv[i], hi[i], hv[p], hi[p])) return;
		float tv = hv[i]; hv[i] = hv[p]; hv[p] = tv;
		int32_t ti = hi[i]; hi[i] = hi[p]; hi[p] = ti;
		if (hs) { ti = hs[i]; hs[i] = hs[p]; hs[p] = ti; }
		i = p;
	}
}

// block_copy writes the nb logits of the block of tile column i (row's
// columns from i - i%nb, fewer at the tile's end, zeros after) to dst.
static void block_copy(float *dst, const float *row, long i, long ncols, long nb) {
	long b0 = i - i % nb;
	if (b0 + nb <= ncols) {
		memcpy(dst, row + b0, nb * sizeof(float));
		return;
	}
	for (long j = 0; j < nb; j++) dst[j] = b0 + j < ncols ? row[b0 + j] : 0.0f;
}

// fexp_fold is the fold's term for d = logit - tile max: fexp(d) where d
// >= -87, bit for bit (fexp's operations, so the same FMA contractions in
// each clone), and 0 below (-Inf and NaN too), written so that every
// clone vectorizes it. The fold's loop had `d >= -87 ? fexp(d) : 0`: GCC
// computes the exp only in the branch taken, which it vectorizes only
// with AVX-512's masked arithmetic (a lane not taken must not trap), so
// the v3 and baseline clones ran it an element at a time; and a select
// of the exp or 0 after it, on the same condition, GCC turns back into
// that branch. Here nothing is conditional: the argument is clamped on
// its bits (d <= 0 where it is kept, m being the max: the sign bit set,
// so +0 gives -0, whose exp is the same 1; then, as an unsigned compare,
// no more negative than -87, which NaN and -Inf are not), and the zero
// comes from the scale: 2^n's bits masked to +0 where d < -87, so that
// p·(+0) = +0 (p is about 1).
static inline __attribute__((always_inline)) float fexp_fold(float d) {
	union { float f; uint32_t u; } b = {.f = d};
	uint32_t xb = b.u | 0x80000000u;
	xb = xb < 0xC2AE0000u ? xb : 0xC2AE0000u; // -87.0f
	union { uint32_t u; float f; } c = {.u = xb};
	float x = c.f;
	float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
	float r = x - n * 0.693145751953125f;
	r = r - n * 1.42860682030941723212e-6f;
	float p = 1.0f / 5040.0f;
	p = p * r + 1.0f / 720.0f;
	p = p * r + 1.0f / 120.0f;
	p = p * r + 1.0f / 24.0f;
	p = p * r + 1.0f / 6.0f;
	p = p * r + 0.5f;
	p = p * r + 1.0f;
	p = p * r + 1.0f;
	int32_t keep = -(int32_t)(d >= -87.0f);
	union { int32_t i; float f; } s = {.i = (((int32_t)n + 127) << 23) & keep};
	return p * s.f;
}

// tile_max_sum returns the max of row[0..n) and sum(exp(row - max)),
// leaving each exp(row[i] - max) in e[i] (0 below -87) (LMHeadSample's block sums read
// them; LMHeadTopK passes the same scratch, so both compute the sum by the
// same code, bit for bit). Two passes: the max, then the exps, stored and
// summed as they are computed. The sum is the same `omp simd reduction`
// as tile_max_sum_ref's third pass, in each clone's order (lanes of the
// clone's vector width, the remainder into lane 0, then the lanes in
// order), so the bits are tile_max_sum_ref's (TestTileMaxSum).
CLONES static void tile_max_sum(const float *row, long n, float *mx, float *sm, float *e) {
	float m = -INFINITY;
#pragma omp simd reduction(max : m)
	for (long i = 0; i < n; i++) m = row[i] > m ? row[i] : m;
	float s = 0;
#pragma omp simd reduction(+ : s)
	for (long i = 0; i < n; i++) {
		float v = fexp_fold(row[i] - m);
		e[i] = v;
		s += v;
	}
	*mx = m;
	*sm = s;
}

// tile_max_sum_ref is tile_max_sum as three passes (the max, the exps,
// their sum): the fold before the exps and the sum were fused, kept as the
// tests' reference (k_tile_max_sum).
CLONES static void tile_max_sum_ref(const float *row, long n, float *mx, float *sm, float *e) {
	float m = -INFINITY;
#pragma omp simd reduction(max : m)
	for (long i = 0; i < n; i++) m = row[i] > m ? row[i] : m;
	// Below -87 fexp clamps (to ~1.6e-38): 0 there, so that a block of ids
	// that far below the tile's max has no mass (the sum cannot tell).
	for (long i = 0; i < n; i++) {
		float d = row[i] - m;
		e[i] = d >= -87.0f ? fexp(d) : 0.0f;
	}
	float s = 0;
#pragma omp simd reduction(+ : s)
	for (long i = 0; i < n; i++) s += e[i];
	*mx = m;
	*sm = s;
}

// k_tile_max_sum runs tile_max_sum, or with ref tile_max_sum_ref (for tests).
void k_tile_max_sum(const float *row, long n, float *mx, float *sm, float *e, int ref) {
	if (ref)
		tile_max_sum_ref(row, n, mx, sm, e);
	else
		tile_max_sum(row, n, mx, sm, e);
}

// v16f is 16 floats as one GCC vector (split into narrower registers where
// the target has none that wide), loaded from 4-byte aligned memory.
typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));

// block_sum is the sum of e[0..m) in the order the x86-64-v4 clone of
// the block sums' loop in k_lse_topk (`#pragma omp simd reduction(+ : s)`
// over the block) sums in (GCC 12): 16 lanes, lane l summing e[l],
// e[16+l], ... over the whole chunks of 16; lane 0 then adding the last
// m%16 terms in order; then the lanes summed 0 to 15.
static inline __attribute__((always_inline)) float block_sum(const float *e, long m) {
	float v[16] = {0};
	long c = m - m % 16;
	for (long i = 0; i < c; i += 16)
		for (int l = 0; l < 16; l++) v[l] += e[i + l];
	for (long i = c; i < m; i++) v[0] += e[i];
	float s = 0;
	for (int l = 0; l < 16; l++) s += v[l];
	return s;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// transpose16 transposes the 16 x 16 floats of a in place: four stages,
// stage k swapping bit k of the row index with bit k of the column index
// (a two-vector shuffle for each row of each pair of rows 2^k apart).
static inline __attribute__((always_inline)) void transpose16(v16f *a) {
	static const v16i lo[4] = {
		{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
		{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
		{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
		{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
	};
	static const v16i hi[4] = {
		{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31},
		{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
		{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
		{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
	};
	// Unrolled whole, so that the 16 rows stay in registers and each
	// shuffle's rows are known at compile time (as loops, GCC kept a on
	// the stack and computed the row indices: about two thirds of the
	// block sums' time).
#pragma GCC unroll 4
	for (int k = 0; k < 4; k++) {
		int s = 1 << k;
#pragma GCC unroll 16
		for (int r = 0; r < 16; r++) {
			if (r & s) continue;
			v16f x = a[r], y = a[r | s];
			a[r] = __builtin_shuffle(x, y, lo[k]);
			a[r | s] = __builtin_shuffle(x, y, hi[k]);
		}
	}
}

// block_sums_v4 is, on an x86-64-v4 CPU, the block sums of k_lse_topk
// with nb 64, bit for bit as its loop sums them there (block_sum's
// order), faster: that loop summed each block's 16 lanes one after the
// other from the stack, about 2% of a head+sampled LM head's CPU time.
// Here 16 whole blocks at a time: their lanes as 16 vectors (row b: block
// b's lanes), transposed, then added row after row (row l: lane l of the
// 16 blocks), which sums each block's lanes 0 to 15 in order, 16 blocks
// at once. (Only for v4: without 512-bit two-vector shuffles the
// transposition is element by element, slower than the loop; the v3 and
// baseline clones keep the loop and their own orders.)
V4 static void block_sums_v4(float *bs, const float *e, long n) {
	long b = 0;
	for (; b + 16 * 64 <= n; b += 16 * 64) {
		v16f a[16];
		for (int j = 0; j < 16; j++) {
			const v16f *p = (const v16f *)(e + b + j * 64);
			a[j] = ((p[0] + p[1]) + p[2]) + p[3];
		}
		transpose16(a);
		v16f s = a[0];
		for (int l = 1; l < 16; l++) s += a[l];
		*(v16f *)(bs + b / 64) = s;
	}
	for (; b < n; b += 64) bs[b / 64] = block_sum(e + b, b + 64 < n ? 64 : n - b);
}

// block_wt_v4 writes to wt (hidden, 64) the transpose of a block's 64
// weight rows w (64, hidden; row stride hidden), 16 x 16 at a time by
// transpose16 (on an x86-64-v4 CPU; hidden a multiple of 16): the same
// values k_block_logits's element loop writes, with a sixth of its
// instructions (that loop was about a third of the kernel's time at
// about a dozen rows a block). The lines of the tile PF ahead are asked
// for as in that loop.
V4 static void block_wt_v4(float *wt, const float *w, long hidden, long pf) {
	for (long q0 = 0; q0 < hidden; q0 += 16) {
		for (long j0 = 0; j0 < 64; j0 += 16) {
			v16f a[16];
			for (int r = 0; r < 16; r++) {
				const float *wr = w + (j0 + r) * hidden;
				if (q0 + pf < hidden) __builtin_prefetch(wr + q0 + pf, 0, 0);
				a[r] = *(const v16f *)(wr + q0);
			}
			transpose16(a);
			for (int c = 0; c < 16; c++) *(v16f *)(wt + (q0 + c) * 64 + j0) = a[c];
		}
	}
}

// cpu_v4 is whether the CPU supports x86-64-v4, which block_sums_v4
// needs (and the v4 clones: where the two choices disagree, the block
// sums' bits follow cpu_v4's, the outputs are as valid).
static int cpu_v4;
__attribute__((constructor)) static void init_cpu_v4(void) {
	__builtin_cpu_init();
	cpu_v4 = __builtin_cpu_supports("x86-64-v4");
}
#else
static const int cpu_v4 = 0;
static void block_sums_v4(float *bs, const float *e, long n) { (void)bs, (void)e, (void)n; }
static void block_wt_v4(float *wt, const float *w, long hidden, long pf) { (void)wt, (void)w, (void)hidden, (void)pf; }
#endif

// k_block_sums_v4 runs block_sums_v4 (for tests) and returns 1, or returns
// 0 where the CPU does not run the v4 clones (k_lse_topk sums in its loop
// there).
int k_block_sums_v4(float *bs, const float *e, long n) {
	if (!cpu_v4) return 0;
	block_sums_v4(bs, e, n);
	return 1;
}

// k_lse_topk folds a tile of logits (rows, ncols) with row stride ld, for
// vocab ids col0..col0+ncols-1, into each row's running log-sum-exp (rmax,
// rsum: lse = rmax + log(rsum)) and running top-k min-heap (hv/hi: k slots a
// row, hn: fill count a row; k may be 0: no top-k). Ids arrive in increasing
// order, so a logit equal to the heap's worst never enters: ties keep the
// lower id. ebuf: ncols floats of scratch. With bsum (LMHeadSample), it also
// writes row r's sums over the tile's blocks of nb ids, Σ exp(logit - tile
// max) (fp32 sums; an id more than 87 nats below the tile max counts 0: the
// fast exp's range), at bsum[r*ldb + col0/nb + j], the tile max at
// tmax[r*ldt + tile] and the blocks' total (double) at tsum[r*ldt + tile]
// (col0 a multiple of nb); with hz, each top-k entry also carries the nb
// logits of its block (slot hsl[r*k + heap position] of hz's k a row).
CLONES void k_lse_topk(const float *logits, long rows, long ncols, long ld, long col0,
                       float *rmax, double *rsum, int k, float *hv, int32_t *hi, int32_t *hn,
                       float *ebuf, float *bsum, long ldb, long nb, float *tmax, double *tsum, long ldt, long tile,
                       int32_t *hsl, float *hz) {
	for (long r = 0; r < rows; r++) {
		const float *row = logits + r * ld;
		float tm, ts;
		tile_max_sum(row, ncols, &tm, &ts, ebuf);
		if (tm > rmax[r]) {
			rsum[r] = rsum[r] * exp((double)rmax[r] - (double)tm) + ts;
			rmax[r] = tm;
		} else {
			rsum[r] += (double)ts * exp((double)tm - (double)rmax[r]);
		}
		if (bsum) {
			float *bs = bsum + r * ldb + col0 / nb;
			if (cpu_v4 && nb == 64) {
				block_sums_v4(bs, ebuf, ncols);
			} else {
				for (long b = 0, j = 0; b < ncols; b += nb, j++) {
					long end = b + nb < ncols ? b + nb : ncols;
					float s = 0;
#pragma omp simd reduction(+ : s)
					for (long i = b; i < end; i++) s += ebuf[i];
					bs[j] = s;
				}
			}
			double t = 0;
			for (long j = 0; j < (ncols + nb - 1) / nb; j++) t += bs[j];
			tmax[r * ldt + tile] = tm;
			tsum[r * ldt + tile] = t;
		}
		if (k == 0) continue;
		float *v = hv + r * (long)k;
		int32_t *id = hi + r * (long)k;
		int32_t *hs = hz ? hsl + r * (long)k : NULL;
		float *pz = hz ? hz + r * (long)k * nb : NULL;
		int n = hn[r];
		// A full heap takes a logit only above its worst: a tile whose max
		// is not (most tiles, once the heap holds the row's large logits)
		// leaves it as it is, unscanned.
		if (n == k && !(tm > v[0])) continue;
		for (long b = 0; b < ncols; b += 16) {
			long e = b + 16 < ncols ? b + 16 : ncols;
			if (n == k) {
				// Most blocks hold nothing better than the heap's worst:
				// one vector max decides that for 16 logits.
				float bm = -INFINITY;
#pragma omp simd reduction(max : bm)
				for (long i = b; i < e; i++) bm = row[i] > bm ? row[i] : bm;
				if (!(bm > v[0])) continue;
			}
			for (long i = b; i < e; i++) {
				float x = row[i];
				if (n < k) {
					v[n] = x;
					id[n] = (int32_t)(col0 + i);
					if (hs) {
						hs[n] = n;
						block_copy(pz + n * nb, row, i, ncols, nb);
					}
					sift_up(v, id, hs, n);
					n++;
				} else if (x > v[0]) {
					v[0] = x;
					id[0] = (int32_t)(col0 + i);
					if (hs) block_copy(pz + hs[0] * nb, row, i, ncols, nb);
					sift_down(v, id, hs, k, 0);
				}
			}
		}
		hn[r] = n;
	}
}

// v8d is 8 doubles as one GCC vector (split into narrower registers where
// the target has none that wide), v8l its integer twin.
typedef double v8d __attribute__((vector_size(64)));
typedef int64_t v8l __attribute__((vector_size(64)));

// VSEL(m, a, b): a where the mask m is set, else b.
#define VSEL(m, a, b) ((v8d)(((v8l)(a) & (m)) | ((v8l)(b) & ~(m))))

// dexp8 is exp of 8 doubles to about 1 ulp, in plain arithmetic so that it
// vectorizes on every clone (libm's exp is a call an element): x = k ln2 +
// r with k = round(x/ln2) (the 1.5·2^52 trick) and |r| <= ln2/2 (two-part
// ln2), e^r by its Taylor polynomial to r^13 (truncation below 5e-18
// relative), times 2^k as two powers of two (2^k1·2^k2, each normal, so
// that results down to the subnormals round once). Below -745.2 (e^x under
// half the least subnormal) it is 0; the walks' arguments are at most a
// rounding above 0, far inside the top clamp.
static inline __attribute__((always_inline)) void dexp8(double *out, const double *in) {
	v8d x;
	memcpy(&x, in, sizeof x);
	const v8d lo = {-745.2, -745.2, -745.2, -745.2, -745.2, -745.2, -745.2, -745.2};
	const v8d hi = {709.0, 709.0, 709.0, 709.0, 709.0, 709.0, 709.0, 709.0};
	v8l under = x < lo;
	x = VSEL(under, lo, x);
	x = VSEL(x > hi, hi, x);
	v8d n = (x * 1.4426950408889634 + 6755399441055744.0) - 6755399441055744.0;
	v8d r = x - n * 0.693147180369123816490; // fdlibm's ln2_hi (21 low bits 0): n·hi exact
	r = r - n * 1.90821492927058770002e-10;  // ln2 - ln2_hi
	v8d p = r * (1.0 / 6227020800.0) + 1.0 / 479001600.0;
	p = p * r + 1.0 / 39916800.0;
	p = p * r + 1.0 / 3628800.0;
	p = p * r + 1.0 / 362880.0;
	p = p * r + 1.0 / 40320.0;
	p = p * r + 1.0 / 5040.0;
	p = p * r + 1.0 / 720.0;
	p = p * r + 1.0 / 120.0;
	p = p * r + 1.0 / 24.0;
	p = p * r + 1.0 / 6.0;
	p = p * r + 0.5;
	p = p * r + 1.0;
	p = p * r + 1.0;
	v8l k = __builtin_convertvector(n, v8l);
	v8l k1 = k >> 1, k2 = k - k1;
	v8d s1 = (v8d)((k1 + 1023) << 52), s2 = (v8d)((k2 + 1023) << 52);
	p = (p * s1) * s2;
	p = (v8d)((v8l)p & ~under);
	memcpy(out, &p, sizeof p);
}

// v8f is 8 floats as one GCC vector, loaded from 4-byte aligned memory.
typedef float v8f __attribute__((vector_size(32), aligned(4)));

// exp_args8 writes to x the arguments of dexp8 for ids j0..j0+7 of a
// block of nz: (double)z[j] - mx, and -Inf past nz. A whole group is
// converted as one vector: the element loop's 8 scalar stores, read back
// as one vector load, stalled each dexp8 (store forwarding fails), about
// a tenth of the walks' time.
static inline __attribute__((always_inline)) void exp_args8(double *x, const float *z, int j0, int nz, double mx) {
	if (j0 + 8 <= nz) {
		v8f zf;
		memcpy(&zf, z + j0, sizeof zf);
		v8d xv = __builtin_convertvector(zf, v8d) - mx;
		memcpy(x, &xv, sizeof xv);
		return;
	}
	for (int l = 0; l < 8; l++) x[l] = j0 + l < nz ? (double)z[j0 + l] - mx : -INFINITY;
}

// block_exps writes e[j] = exp((double)z[j] - mx) for j < nz (nz <= 64;
// e holds 64, written in 8s) by dexp8: the terms of the walks and of a head block's mass.
static inline __attribute__((always_inline)) void block_exps(double *e, const float *z, int nz, double mx) {
	for (int j0 = 0; j0 < nz; j0 += 8) {
		double x[8];
		exp_args8(x, z, j0, nz, mx);
		dexp8(e + j0, x);
	}
}

// k_dexp (for tests) is block_exps of n values, 64 at a time.
CLONES void k_dexp(double *e, const float *z, long n, double mx) {
	for (long j = 0; j < n; j += 64) block_exps(e + j, z + j, n - j < 64 ? (int)(n - j) : 64, mx);
}

// draw_walk places the draws of one (token, block) pair of LMHeadSample:
// z holds the logits of ids v0..v0+nz-1, mx the token's max logit, head
// its top-k ids ascending (nh of them, left out), thr the nd thresholds
// ascending, relative to the mass before the block. Draw d is the first id
// whose running sum of exp(z - mx) (double, ids ascending) exceeds thr[d];
// one the block's sum does not reach (rounding: the block sums of the pass
// over the tiles use the fast exp) is the block's last id with mass, or
// its last id outside the head when none has any.
//
// This is the plain walk, an id at a time (k_draw_walk, the tests'
// reference); k_draw_walks runs fast_walk, the same draws.
static inline __attribute__((always_inline)) void draw_walk(const float *z, int nz, int32_t v0, double mx,
                                                            const int32_t *head, int nh, const double *thr, int nd,
                                                            int32_t *out) {
	double e[8];
	double c = 0;
	int d = 0, hp = 0;
	int32_t last = -1, lastout = -1;
	for (int j0 = 0; j0 < nz && d < nd; j0 += 8) {
		double x[8];
		exp_args8(x, z, j0, nz, mx);
		dexp8(e, x);
		int je = j0 + 8 < nz ? j0 + 8 : nz;
		for (int j = j0; j < je && d < nd; j++) {
			int32_t v = v0 + j;
			while (hp < nh && head[hp] < v) hp++;
			if (hp < nh && head[hp] == v) continue;
			lastout = v;
			double t = e[j - j0];
			if (t == 0) continue;
			c += t;
			last = v;
			while (d < nd && c > thr[d]) out[d++] = v;
		}
	}
	if (last < 0) last = lastout;
	while (d < nd) out[d++] = last;
}

// fast_walk is draw_walk's draws with less work an id: the head's ids
// in the block as a bit mask, their terms set to 0 (adding +0 leaves the
// running sum as it is, and a sum that does not move cannot pass a
// threshold it had not passed: the first id whose sum exceeds a
// threshold is the same, and holds mass outside the head), so the loop
// an id is an add, a compare and a branch; the last id with mass is
// looked for only when a threshold is not reached (rare: rounding).
// draw_walk's loop tested the head, the zero terms and the thresholds
// at every id, about 60% of the walks' time.
static inline __attribute__((always_inline)) void fast_walk(const float *z, int nz, int32_t v0, double mx,
                                                            const int32_t *head, int nh, const double *thr, int nd,
                                                            int32_t *out) {
	if (nd <= 0) return;
	uint64_t hm = 0;
	for (int i = 0; i < nh; i++)
		if (head[i] >= v0 && head[i] < v0 + nz) hm |= 1ull << (head[i] - v0);
	double c = 0, th = thr[0];
	int d = 0;
	for (int j0 = 0; j0 < nz; j0 += 8) {
		double x[8], e[8];
		exp_args8(x, z, j0, nz, mx);
		dexp8(e, x);
		if (hm >> j0 & 0xff)
			for (int l = 0; l < 8; l++) e[l] = hm >> (j0 + l) & 1 ? 0.0 : e[l];
		int je = j0 + 8 < nz ? 8 : nz - j0;
		for (int l = 0; l < je; l++) {
			c += e[l];
			if (c > th) {
				do out[d++] = v0 + j0 + l;
				while (d < nd && c > thr[d]);
				if (d == nd) return;
				th = thr[d];
			}
		}
	}
	// Not every threshold reached: the block's last id with mass outside
	// the head, else its last id outside the head (draw_walk's last and
	// lastout at the block's end).
	double e[64];
	block_exps(e, z, nz, mx);
	int32_t last = -1, lastout = -1;
	for (int j = nz - 1; j >= 0 && last < 0; j--) {
		if (hm >> j & 1) continue;
		if (lastout < 0) lastout = v0 + j;
		if (e[j] != 0) last = v0 + j;
	}
	if (last < 0) last = lastout;
	while (d < nd) out[d++] = last;
}

// k_draw_walk is draw_walk (for tests).
CLONES void k_draw_walk(const float *z, int nz, int32_t v0, double mx, const int32_t *head, int nh,
                        const double *thr, int nd, int32_t *out) {
	draw_walk(z, nz, v0, mx, head, nh, thr, nd, out);
}

// k_fast_walk is fast_walk (for tests).
CLONES void k_fast_walk(const float *z, int nz, int32_t v0, double mx, const int32_t *head, int nh,
                        const double *thr, int nd, int32_t *out) {
	fast_walk(z, nz, v0, mx, head, nh, thr, nd, out);
}

// k_draw_walks walks the m pairs of one block (LMHeadSample's blockPair,
// all of block blk), pair i's logits at z + i·nz: draws [d0, d1) of row
// r from thr + r·n + d0 into drawn + r·n + d0, with the row's max rmax[r]
// and, with heads, its top-k ids ascending at heads + r·k. One call a
// block: a cgo call a pair cost more than a walk.
CLONES void k_draw_walks(const float *z, long m, int nz, const struct draw_pair *ps, const float *rmax,
                         const int32_t *heads, int k, const double *thr, int n, int32_t *drawn) {
	// A pair's thresholds and draws are its row's (rows apart in a group
	// of thousands: memory, not cache): asked for PF pairs ahead (the load
	// of the first threshold waited on memory for about 40% of the walks'
	// time).
	enum { PF = 4 };
	for (long i = 0; i < m; i++) {
		if (i + PF < m) {
			const struct draw_pair *q = &ps[i + PF];
			__builtin_prefetch(thr + (long)q->row * n + q->d0, 0, 3);
			__builtin_prefetch(drawn + (long)q->row * n + q->d0, 1, 3);
		}
		const struct draw_pair *p = &ps[i];
		long r = p->row;
		fast_walk(z + i * nz, nz, p->blk * 64, (double)rmax[r], heads ? heads + r * k : NULL, heads ? k : 0,
		          thr + r * n + p->d0, p->d1 - p->d0, drawn + r * n + p->d0);
	}
}

// k_tile_mass is Σ_t tsum[t]·exp(tmax[t] - mx), summed as k_draw_locate
// sums the tiles, and leaves each tile's exp(tmax[t] - mx) in sc for
// k_draw_locate (libm's exp, once a tile: locating called it again for
// every tile it passed).
double k_tile_mass(const float *tmax, const double *tsum, long ntile, double mx, double *sc) {
	double m = 0;
	for (long t = 0; t < ntile; t++) {
		sc[t] = exp((double)tmax[t] - mx);
		m += tsum[t] * sc[t];
	}
	return m;
}

// k_draw_locate places a row's n draws among its blocks. The row's pass
// left, per tile of spt blocks, the block sums bs (relative to the tile's
// max, nblk in all) and their total tsum[t]; k_tile_mass left in sc[t]
// the tile's scale exp(tile max - row max) and mass = Σ_t tsum[t]·sc[t]
// > 0, the mass to draw from. With u the uniforms as compute.PackUniforms
// writes them (ascending) and x = u·mass, blk[d] is the first block whose
// cumulative sum (tiles' totals, then the tile's blocks, in double)
// exceeds x and thr[d] is x less the sum before that block. Where rounding
// leaves x above the sum of the tiles, or of the blocks of its tile, the
// draw goes to the last block with mass (of the row, or of the tile) with
// thr +inf: its last id with mass.
void k_draw_locate(const float *bs, long nblk, const double *sc, const double *tsum, long ntile, long spt,
                   const int32_t *u, int n, double mass, int32_t *blk, double *thr) {
	long lt = ntile - 1;
	while (lt > 0 && !(tsum[lt] > 0)) lt--;
	// First each x's tile and x less the sum of the tiles before it (thr
	// holds it meanwhile, blk the tile), the block sums of the tiles the
	// draws land in asked for from memory (a row's block sums were
	// written by the pass long before: a group's are tens of MB); then
	// the blocks, with the same sums as one pass over both.
	long t = 0;
	double cum = 0, T = tsum[0] * sc[0];
	for (int d = 0; d < n; d++) {
		double x = (double)((uint64_t)(uint32_t)u[2 * d] | (uint64_t)(uint32_t)u[2 * d + 1] << 32) * 0x1p-53 * mass;
		long t0 = t;
		while (t < ntile && cum + T <= x) {
			cum += T;
			t++;
			if (t < ntile) T = tsum[t] * sc[t];
		}
		if ((d == 0 || t != t0) && t < ntile)
			for (long j = t * spt; j < (t + 1) * spt && j < nblk; j += 16) __builtin_prefetch(bs + j, 0, 3);
		blk[d] = (int32_t)t;
		thr[d] = x - cum;
	}
	long j = 0, jt = -1; // the block scan's place, in tile jt
	double cj = 0;
	for (int d = 0; d < n; d++) {
		t = blk[d];
		if (t < ntile && t != jt) jt = t, j = t * spt, cj = 0; // a tile's first draw
		long tt = t, end;
		if (t == ntile) tt = lt; // above the sum of the tiles
		end = (tt + 1) * spt < nblk ? (tt + 1) * spt : nblk;
		if (t < ntile) {
			double xl = thr[d];
			while (j < end && cj + bs[j] * sc[t] <= xl) cj += bs[j++] * sc[t];
			if (j < end) {
				blk[d] = (int32_t)j;
				thr[d] = xl - cj;
				continue;
			}
		}
		long lb = end - 1; // above the sum of the tile's blocks
		while (lb > tt * spt && !(bs[lb] > 0)) lb--;
		blk[d] = (int32_t)lb;
		thr[d] = INFINITY;
	}
}

// k_block_logits: z (m, nz) = x (m, hidden; row i at x + rows[i]*hidden) ·
// w (nz, hidden)ᵀ for one block of nz <= 64 ids, w transposed first into
// wt (hidden, 64; scratch) so that four rows at a time accumulate 64 logits
// each as vectors. Every logit is the sum over q in order of x[q]·w[q],
// whatever m and whichever rows (the one-row tail loop does the same per
// logit): LMHeadSample's draws do not depend on which rows share a block.
CLONES void k_block_logits(float *z, const float *x, const int32_t *rows, long m, const float *w, long nz, long hidden,
                           float *wt, const float *next, long nextz, int warm) {
	// In tiles of 16 q: a cache line of each weight row read, 4 KiB of wt
	// written (in L1). The block's weights come from memory (the pass over
	// the tiles read them long ago), a line of each of 64 rows a tile: the
	// hardware prefetchers do not follow 64 streams, and the loads waited
	// for memory one tile after another (half of this kernel's time on a
	// flat softmax). So the lines of the next PF tiles are asked for ahead
	// (a hint: the arithmetic is unchanged), and those of the caller's next
	// block (next, nextz rows) as soon as this block's are read, to arrive
	// while this block's logits are summed: its first PF tiles, or all of
	// it where it is at most 32 KiB (hidden <= 128); warm: this block's
	// were asked for so by the call before.
	enum { PF = 2 };
	if (!warm)
		for (long q0 = 0; q0 < PF * 16 && q0 < hidden; q0 += 16)
			for (long j = 0; j < nz; j++) __builtin_prefetch(w + j * hidden + q0, 0, 0);
	if (cpu_v4 && nz == 64 && hidden % 16 == 0) {
		block_wt_v4(wt, w, hidden, PF * 16);
	} else {
		for (long q0 = 0; q0 < hidden; q0 += 16) {
			long qe = q0 + 16 < hidden ? q0 + 16 : hidden;
			for (long j = 0; j < 64; j++) {
				const float *wr = w + j * hidden;
				if (j < nz && q0 + PF * 16 < hidden) __builtin_prefetch(wr + q0 + PF * 16, 0, 0);
				for (long q = q0; q < qe; q++) wt[q * 64 + j] = j < nz ? wr[q] : 0.0f;
			}
		}
	}
	if (next) {
		long ahead = hidden <= 128 ? hidden : PF * 16;
		for (long q0 = 0; q0 < ahead; q0 += 16)
			for (long j = 0; j < nextz; j++) __builtin_prefetch(next + j * hidden + q0, 0, 0);
	}
	long i = 0;
	for (; i + 4 <= m; i += 4) {
		// The next 4 rows' inputs (scattered over the group: memory) asked
		// for while these 4 are summed.
		for (long a = i + 4; a < i + 8 && a < m; a++)
			for (long q = 0; q < hidden; q += 16) __builtin_prefetch(x + (long)rows[a] * hidden + q, 0, 3);
		const float *x0 = x + (long)rows[i] * hidden, *x1 = x + (long)rows[i + 1] * hidden;
		const float *x2 = x + (long)rows[i + 2] * hidden, *x3 = x + (long)rows[i + 3] * hidden;
		// The 4 x 64 accumulators as 16 vectors of 16 (arrays of 64 were
		// partly kept on the stack: a load and a store around many FMAs);
		// each logit's sum is the same, q ascending from 0.
		v16f a0[4] = {{0}}, a1[4] = {{0}}, a2[4] = {{0}}, a3[4] = {{0}};
		for (long q = 0; q < hidden; q++) {
			const v16f *wr = (const v16f *)(wt + q * 64);
			float b0 = x0[q], b1 = x1[q], b2 = x2[q], b3 = x3[q];
			for (int c = 0; c < 4; c++) {
				v16f wc = wr[c];
				a0[c] += b0 * wc;
				a1[c] += b1 * wc;
				a2[c] += b2 * wc;
				a3[c] += b3 * wc;
			}
		}
		for (long j = 0; j < nz; j++) {
			z[i * nz + j] = a0[j / 16][j % 16];
			z[(i + 1) * nz + j] = a1[j / 16][j % 16];
			z[(i + 2) * nz + j] = a2[j / 16][j % 16];
			z[(i + 3) * nz + j] = a3[j / 16][j % 16];
		}
	}
	for (; i < m; i++) {
		const float *x0 = x + (long)rows[i] * hidden;
		v16f a0[4] = {{0}};
		for (long q = 0; q < hidden; q++) {
			const v16f *wr = (const v16f *)(wt + q * 64);
			float b0 = x0[q];
			for (int c = 0; c < 4; c++) a0[c] += b0 * wr[c];
		}
		for (long j = 0; j < nz; j++) z[i * nz + j] = a0[j / 16][j % 16];
	}
}

// k_fexp_sum is Σ fexp(z[i] - m) in double (0 below -87), each term as
// tile_max_sum computes it: the fold's exps of given logits.
double k_fexp_sum(const float *z, int n, float m) {
	double s = 0;
	for (int i = 0; i < n; i++) {
		float d = z[i] - m;
		s += d >= -87.0f ? (double)fexp(d) : 0.0;
	}
	return s;
}

// k_block_mass is Σ exp(z - mx) in double (dexp8's terms) over the nz
// logits of ids v0.. outside head (nh ids ascending): a head block's exact
// mass.
CLONES double k_block_mass(const float *z, int nz, int32_t v0, double mx, const int32_t *head, int nh) {
	double e[64], c = 0;
	block_exps(e, z, nz, mx);
	int hp = 0;
	for (int j = 0; j < nz; j++) {
		int32_t v = v0 + j;
		while (hp < nh && head[hp] < v) hp++;
		if (hp < nh && head[hp] == v) continue;
		c += e[j];
	}
	return c;
}

// k_head_masses writes a row's head blocks' masses outside its top-k
// (k_block_mass of each block holding a top-k id, once a block) into its
// block sums bs, relative to the block's tile max tmax[t] (spt blocks a
// tile): ids are the row's top-k in heap order, z their blocks' logits
// (64 an id, as the pass carried them), head the same ids ascending. One
// call a row (it was one a block).
CLONES void k_head_masses(float *bs, const float *tmax, long spt, const int32_t *ids, int k, const float *z,
                          const int32_t *head, long vocab) {
	for (int j = 0; j < k; j++) {
		int32_t b = ids[j] / 64;
		int first = 1;
		for (int i = 0; i < j; i++) first &= ids[i] / 64 != b;
		if (!first) continue;
		long v0 = (long)b * 64;
		int nz = vocab - v0 < 64 ? (int)(vocab - v0) : 64;
		bs[b] = (float)k_block_mass(z + (long)j * 64, nz, (int32_t)v0, (double)tmax[b / spt], head, k);
	}
}

// k_sumexp returns sum_i exp(x[i]*scale - shift), accumulated in double.
CLONES double k_sumexp(const float *x, long n, float scale, float shift) {
	double s = 0;
#pragma omp simd reduction(+ : s)
	for (long i = 0; i < n; i++) s += (double)fexp(x[i] * scale - shift);
	return s;
}

// k_scaled_exp: out[i] = mul * exp(x[i]*scale - shift); out may alias x.
CLONES void k_scaled_exp(float *out, const float *x, long n, float scale, float shift, float mul) {
	for (long i = 0; i < n; i++) out[i] = mul * fexp(x[i] * scale - shift);
}

// k_exp_mix: out[i] = a*exp(x[i]*s1 - h1) + b*exp(x[i] - h2); out may alias x.
CLONES void k_exp_mix(float *out, const float *x, long n, float s1, float h1, float a, float h2, float b) {
	for (long i = 0; i < n; i++) {
		float z = x[i];
		out[i] = a * fexp(z * s1 - h1) + b * fexp(z - h2);
	}
}

// k_swiglu_bwd accumulates the gradients of out = silu(g)·u:
// du += dout·silu(g), dg += dout·u·σ(g)·(1 + g·(1-σ(g))).
CLONES void k_swiglu_bwd(float *dg, float *du, const float *dout, const float *g, const float *u, long n) {
	for (long i = 0; i < n; i++) {
		float gv = g[i];
		float sg = 1.0f / (1.0f + fexp(-gv));
		du[i] += dout[i] * gv * sg;
		dg[i] += dout[i] * u[i] * sg * (1.0f + gv * (1.0f - sg));
	}
}

// k_adamw: one torch.optim.AdamW update in place (compute.AdamWStep).
CLONES void k_adamw(float *p, const float *g, float *m, float *v, long n, float b1, float b2, float eps,
                    float step, float bc2, float decay) {
	for (long i = 0; i < n; i++) {
		float x = g[i];
		float pi = p[i] * decay;
		float mi = b1 * m[i] + (1 - b1) * x;
		float vi = b2 * v[i] + (1 - b2) * x * x;
		m[i] = mi;
		v[i] = vi;
		p[i] = pi - step * mi / (sqrtf(vi) / bc2 + eps);
	}
}

// k_sumsq returns sum x[i]^2 accumulated in double.
CLONES double k_sumsq(const float *x, long n) {
	double s = 0;
#pragma omp simd reduction(+ : s)
	for (long i = 0; i < n; i++) s += (double)x[i] * (double)x[i];
	return s;
}

// k_scale: x *= c.
CLONES void k_scale(float *x, long n, float c) {
	for (long i = 0; i < n; i++) x[i] *= c;
}

// k_absmax returns max |x[i]|, or NaN when x holds a NaN (as Go's max and
// torch's amax do), so that a calibration that saw NaN fails loudly.
CLONES float k_absmax(const float *x, long n) {
	float m = 0;
	int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
	for (long i = 0; i < n; i++) {
		float a = fabsf(x[i]);
		nan |= a != a;
		m = a > m ? a : m;
	}
	return nan ? NAN : m;
}
