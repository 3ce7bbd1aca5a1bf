#include "kernels.h"
#include <math.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
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

// out (rows,dim) = x / sqrt(mean(x^2) + eps) * w, in fp32 like HF's
// LlamaRMSNorm (hidden_states.to(float32); variance = pow(2).mean(-1)).
CLONES void k_rmsnorm(float *out, const float *x, const float *w, long rows, long dim, float eps) {
	for (long r = 0; r < rows; r++) {
		const float *xr = x + r * dim;
		float *o = out + r * dim;
		float ss = 0;
#pragma omp simd reduction(+ : ss)
		for (long i = 0; i < dim; i++) ss += xr[i] * xr[i];
		float rstd = 1.0f / sqrtf(ss / (float)dim + eps);
		for (long i = 0; i < dim; i++) o[i] = (xr[i] * rstd) * w[i];
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
// become 0.
CLONES void k_softmax_causal(float *s, long rows, long ld, long first_len) {
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
	}
}

// worse orders heap entries: lower value, then (on ties) higher id, is worse.
static inline int worse(float va, int32_t ia, float vb, int32_t ib) {
	return va < vb || (va == vb && ia > ib);
}

static void sift_down(float *hv, int32_t *hi, int n, int i) {
	for (;;) {
		int l = 2 * i + 1, r = l + 1, m = i;
		if (l < n && worse(hv[l], hi[l], hv[m], hi[m])) m = l;
		if (r < n && worse(hv[r], hi[r], hv[m], hi[m])) m = r;
		if (m == i) return;
		float tv = hv[i]; hv[i] = hv[m]; hv[m] = tv;
		int32_t ti = hi[i]; hi[i] = hi[m]; hi[m] = ti;
		i = m;
	}
}

static void sift_up(float *hv, int32_t *hi, int i) {
	while (i > 0) {
		int p = (i - 1) / 2;
		if (!worse(hv[i], hi[i], hv[p], hi[p])) return;
		float tv = hv[i]; hv[i] = hv[p]; hv[p] = tv;
		int32_t ti = hi[i]; hi[i] = hi[p]; hi[p] = ti;
		i = p;
	}
}

// tile_max_sum returns the max of row[0..n) and sum(exp(row - max)).
CLONES static void tile_max_sum(const float *row, long n, float *mx, float *sm) {
	float m = -INFINITY;
#pragma omp simd reduction(max : m)
	for (long i = 0; i < n; i++) m = row[i] > m ? row[i] : m;
	float s = 0;
#pragma omp simd reduction(+ : s)
	for (long i = 0; i < n; i++) s += fexp(row[i] - m);
	*mx = m;
	*sm = s;
}

// k_lse_topk folds a tile of logits (rows, ncols) with row stride ld, for
// vocab ids col0..col0+ncols-1, into each row's running log-sum-exp (rmax,
// rsum: lse = rmax + log(rsum)) and running top-k min-heap (hv/hi: k slots a
// row, hn: fill count a row). Ids arrive in increasing order, so a logit
// equal to the heap's worst never enters: ties keep the lower id.
CLONES void k_lse_topk(const float *logits, long rows, long ncols, long ld, long col0,
                       float *rmax, double *rsum, int k, float *hv, int32_t *hi, int32_t *hn) {
	for (long r = 0; r < rows; r++) {
		const float *row = logits + r * ld;
		float tm, ts;
		tile_max_sum(row, ncols, &tm, &ts);
		if (tm > rmax[r]) {
			rsum[r] = rsum[r] * exp((double)rmax[r] - (double)tm) + ts;
			rmax[r] = tm;
		} else {
			rsum[r] += (double)ts * exp((double)tm - (double)rmax[r]);
		}
		float *v = hv + r * (long)k;
		int32_t *id = hi + r * (long)k;
		int n = hn[r];
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
					sift_up(v, id, n);
					n++;
				} else if (x > v[0]) {
					v[0] = x;
					id[0] = (int32_t)(col0 + i);
					sift_down(v, id, k, 0);
				}
			}
		}
		hn[r] = n;
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
