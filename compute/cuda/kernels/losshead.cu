// The fused LM-head loss (compute.LossHead): cuBLASLt writes the logits of
// the M counted rows against one vocabulary tile (M x n, F32); these
// kernels fold a tile into each row's statistics (pass 1) or turn it into
// dL/dz (pass 2), one block per row. [M x V] logits never exist.
//
// A row's teacher ids (K, ascending, distinct) are staged in shared memory
// with a bit mask of the tile's columns that are one of them, so
// the tail Σ_{v∉K} exp(z_v/T - lse) is summed directly over the columns
// outside K (never 1 - Σ_K), as compute/cpu does. Per-row sums are float64,
// reduced in a fixed tree order: deterministic, no atomics.

#define LOSS_THREADS 256

// The tile kernels read a row's logits LOSS_UNROLL columns a thread at a
// time (columns c, c + LOSS_THREADS, ...: each thread's columns and the
// order it takes them in are those of a plain loop, so every sum keeps its
// bits), all of the group's loads issued before the first is used: a load
// at a time, each waited for, left them far below the memory's bandwidth
// (5.84 ms for 5.1 GB of logits in an H200's Qwen3-0.6B training step,
// about 1.5 ms at the bandwidth).
#define LOSS_UNROLL 8

// each_col calls f(z[c], c) for this thread's columns c of a row of n
// logits, in increasing c, LOSS_UNROLL loads issued at a time.
template <class F> DK_DEV void each_col(const float *__restrict__ z, int n, F f) {
	int c = threadIdx.x;
	for (; c + (LOSS_UNROLL - 1) * LOSS_THREADS < n; c += LOSS_UNROLL * LOSS_THREADS) {
		float v[LOSS_UNROLL];
#pragma unroll
		for (int j = 0; j < LOSS_UNROLL; j++) v[j] = z[c + j * LOSS_THREADS];
#pragma unroll
		for (int j = 0; j < LOSS_UNROLL; j++) f(v[j], c + j * LOSS_THREADS);
	}
	for (; c < n; c += LOSS_THREADS) f(z[c], c);
}

// in_topk returns j with ids[j] = v, or -1 (ids ascending, K of them).
DK_DEV int in_topk(const i32 *ids, int K, i32 v) {
	int lo = 0, hi = K;
	while (lo < hi) {
		int mid = (lo + hi) / 2;
		if (ids[mid] < v) lo = mid + 1;
		else hi = mid;
	}
	return (lo < K && ids[lo] == v) ? lo : -1;
}

// tile_mask writes mask ((n+31)/32 words) with bit c set when vocabulary
// id v0 + c is one of the row's K teacher ids (sid, ascending, distinct):
// a thread a word, the word's ids located by one binary search. A column
// then asks one shared load whether it is a teacher id, where a search of
// K ids per column cost about half the tile kernels' instructions. The
// caller synchronizes before and after (sid's writes; mask's).
DK_DEV void tile_mask(u32 *mask, const i32 *sid, int K, int v0, int n) {
	int words = (n + 31) / 32;
	for (int w = threadIdx.x; w < words; w += LOSS_THREADS) {
		i32 lo_v = v0 + 32 * w;
		int lo = 0, hi = K; // the first id >= lo_v
		while (lo < hi) {
			int mid = (lo + hi) / 2;
			if (sid[mid] < lo_v) lo = mid + 1;
			else hi = mid;
		}
		u32 m = 0;
		for (int j = lo; j < K && sid[j] - lo_v < 32; j++) m |= 1u << (sid[j] - lo_v);
		mask[w] = m;
	}
}

// in_mask reports whether column c's bit is set (tile_mask).
DK_DEV bool in_mask(const u32 *mask, int c) { return (mask[c >> 5] >> (c & 31)) & 1u; }

// sum3 reduces three doubles over the block in a fixed tree; thread 0 gets
// them. red: 3·LOSS_THREADS doubles.
DK_DEV void sum3(double *a, double *b, double *c, double *red) {
	int t = threadIdx.x;
	red[t] = *a;
	red[LOSS_THREADS + t] = *b;
	red[2 * LOSS_THREADS + t] = *c;
	__syncthreads();
	for (int s = LOSS_THREADS / 2; s > 0; s >>= 1) {
		if (t < s) {
			red[t] += red[t + s];
			red[LOSS_THREADS + t] += red[LOSS_THREADS + t + s];
			red[2 * LOSS_THREADS + t] += red[2 * LOSS_THREADS + t + s];
		}
		__syncthreads();
	}
	*a = red[0];
	*b = red[LOSS_THREADS];
	*c = red[2 * LOSS_THREADS];
}

DK_DEV float block_max_f(float v, float *red) {
	red[threadIdx.x] = v;
	__syncthreads();
	for (int s = LOSS_THREADS / 2; s > 0; s >>= 1) {
		if ((int)threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
		__syncthreads();
	}
	float r = red[0];
	__syncthreads(); // red is reused
	return r;
}

// k_loss_init: the running statistics of M rows: st (5, M) doubles, the
// maxima mT and m1 at -inf, the sums sT, sTail, s1 at 0.
DK_KERNEL void k_loss_init(double *st, i64 M) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < M; i += (i64)gridDim.x * blockDim.x) {
		st[i] = -DK_INF;         // mT: running max of z·invT
		st[M + i] = 0;           // sT: Σ exp(z·invT - mT)
		st[2 * M + i] = 0;       // sTail: the same over v ∉ K
		st[3 * M + i] = -DK_INF; // m1: running max of z (CE, when invT != 1)
		st[4 * M + i] = 0;       // s1
	}
}

// loss_fwd_term adds column zv's terms to a row's sums: exp(z·invT - mf)
// to topk (a teacher id) or tail, and exp(z - mmf) to s1 (sepce).
DK_DEV void loss_fwd_term(float zv, bool teacher, float invT, float mf, float mmf, int sepce, double &tail, double &topk, double &s1) {
	double e = (double)expf(zv * invT - mf);
	if (teacher) topk += e;
	else tail += e;
	if (sepce) s1 += (double)expf(zv - mmf);
}

// k_loss_fwd_tile: block r folds row r's logits for vocab ids [v0, v0+n),
// tile[r·n .. r·n+n), into st, and gathers z at its teacher ids (zk, (M,K))
// and at its label (zlab). Dynamic shared memory: K ids, then the tile's
// teacher-id mask ((n+31)/32 words, tile_mask).
DK_KERNEL __launch_bounds__(LOSS_THREADS) void k_loss_fwd_tile(const float *__restrict__ tile, int n, int v0, float invT, int sepce,
                                                               const i32 *__restrict__ ids, int K, const i32 *__restrict__ labels,
                                                               double *__restrict__ st, i64 M, float *__restrict__ zk,
                                                               float *__restrict__ zlab) {
	DK_DYN_SMEM(i32, sid);
	u32 *mask = (u32 *)(sid + K);
	__shared__ double red[3 * LOSS_THREADS];
	__shared__ float redf[LOSS_THREADS];
	i64 r = blockIdx.x;
	const float *z = tile + r * n;
	for (int j = threadIdx.x; j < K; j += LOSS_THREADS) sid[j] = ids[r * K + j];
	__syncthreads();
	tile_mask(mask, sid, K, v0, n);
	float mx = -DK_INF;
	each_col(z, n, [&](float zv, int) { mx = fmaxf(mx, zv); });
	mx = block_max_f(mx, redf); // also the barrier after mask's writes
	double mT = st[r], m = mT > (double)(mx * invT) ? mT : (double)(mx * invT);
	double m1 = st[3 * M + r], mm = m1 > (double)mx ? m1 : (double)mx;
	float mf = (float)m, mmf = (float)mm;
	double tail = 0, topk = 0, s1 = 0;
	each_col(z, n, [&](float zv, int c) { loss_fwd_term(zv, in_mask(mask, c), invT, mf, mmf, sepce, tail, topk, s1); });
	sum3(&tail, &topk, &s1, red);
	if (threadIdx.x == 0) {
		double sT = st[M + r], sTail = st[2 * M + r];
		if (m > mT && sT > 0) {
			double f = exp(mT - m);
			sT *= f;
			sTail *= f;
		}
		st[r] = m;
		st[M + r] = sT + tail + topk;
		st[2 * M + r] = sTail + tail;
		if (sepce) {
			double S1 = st[4 * M + r];
			if (mm > m1 && S1 > 0) S1 *= exp(m1 - mm);
			st[3 * M + r] = mm;
			st[4 * M + r] = S1 + s1;
		}
		i32 lab = labels[r];
		if (lab >= v0 && lab < v0 + n) zlab[r] = z[lab - v0];
	}
	for (int j = threadIdx.x; j < K; j += LOSS_THREADS) {
		i32 v = sid[j];
		if (v >= v0 && v < v0 + n) zk[r * K + j] = z[v - v0];
	}
}

// k_loss_fwd_finish: out (3, M) = LseT, Lse1, Tail of each row.
DK_KERNEL void k_loss_fwd_finish(double *__restrict__ out, const double *__restrict__ st, i64 M, int sepce) {
	for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < M; r += (i64)gridDim.x * blockDim.x) {
		double lseT = st[r] + log(st[M + r]);
		out[r] = lseT;
		out[M + r] = sepce ? st[3 * M + r] + log(st[4 * M + r]) : lseT;
		out[2 * M + r] = st[2 * M + r] / st[M + r];
	}
}

// loss_bwd_term is column c's dL/dz (k_loss_bwd_tile) from its logit zv;
// ckr: the row's teacher coefficients.
DK_DEV float loss_bwd_term(float zv, int c, const u32 *mask, const i32 *sid, int K, int v0, const float *ckr, float invT, int sepce,
                           float lt, float l1, float a, i32 lab, float wsft) {
	int j = in_mask(mask, c) ? in_topk(sid, K, v0 + c) : -1;
	float g;
	if (j >= 0) {
		g = ckr[j];
		if (wsft != 0) g += sepce ? wsft * expf(zv - l1) : wsft * expf(zv * invT - lt);
	} else if (sepce) {
		g = wsft * expf(zv - l1);
		if (a != 0) g += a * expf(zv * invT - lt);
	} else {
		g = (a + wsft) * expf(zv * invT - lt);
	}
	if (v0 + c == lab) g -= wsft;
	return g;
}

// k_loss_bwd_tile: block r turns row r's logits of vocab ids [v0, v0+n)
// into dL/dz (compute.LossCoef), rounded to BF16 for the GEMMs that follow:
//   v ∉ K: a·q_v (+ wsft·p_v), v = ids[j]: ck[j] (+ wsft·p_v), minus wsft at
//   the label; q_v = exp(z·invT - lseT), p_v = exp(z - lse1) (= q_v when
//   the CE shares the temperature: sepce = 0).
// Dynamic shared memory: K ids, then the tile's teacher-id mask
// (k_loss_fwd_tile's).
DK_KERNEL __launch_bounds__(LOSS_THREADS) void k_loss_bwd_tile(u16 *__restrict__ dz, const float *__restrict__ tile, int n, int v0,
                                                               float invT, int sepce, const float *__restrict__ lseT,
                                                               const float *__restrict__ lse1, const float *__restrict__ acoef,
                                                               const float *__restrict__ ck, const i32 *__restrict__ ids, int K,
                                                               const i32 *__restrict__ labels, float wsft) {
	DK_DYN_SMEM(i32, sid);
	u32 *mask = (u32 *)(sid + K);
	i64 r = blockIdx.x;
	for (int j = threadIdx.x; j < K; j += LOSS_THREADS) sid[j] = ids[r * K + j];
	__syncthreads();
	tile_mask(mask, sid, K, v0, n);
	__syncthreads();
	const float *z = tile + r * n;
	u16 *o = dz + r * n;
	float lt = lseT[r], l1 = lse1[r], a = acoef[r];
	i32 lab = labels[r];
	const float *ckr = ck + r * K;
	each_col(z, n, [&](float zv, int c) { o[c] = f2bf(loss_bwd_term(zv, c, mask, sid, K, v0, ckr, invT, sepce, lt, l1, a, lab, wsft)); });
}

// k_gather_rows_bf16: xc (M, C) BF16 = x (N, C) at rows, x BF16 (x_bf:
// copied) or F32 (rounded).
DK_KERNEL void k_gather_rows_bf16(u16 *__restrict__ xc, const void *__restrict__ x, int x_bf, const i32 *__restrict__ rows, i64 M, int C) {
	i64 total = M * (i64)C;
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
		i64 r = i / C;
		xc[i] = f2bf(ld_act(x, x_bf, (i64)rows[r] * C + (i - r * C)));
	}
}

// k_scatter_add_rows: dx (N, C) at rows += dxc (M, C). Rows are distinct,
// so no two threads write one element.
DK_KERNEL void k_scatter_add_rows(float *dx, const float *__restrict__ dxc, const i32 *__restrict__ rows, i64 M, int C) {
	i64 total = M * (i64)C;
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
		i64 r = i / C;
		dx[(i64)rows[r] * C + (i - r * C)] += dxc[i];
	}
}

// --- Pass 2's coefficients on the device (compute.DeviceLossCoef).
//
// exp64 and log64 are compute.Exp and compute.Log (compute/detmath.go),
// operation for operation, their constants as exact hexadecimal literals
// (the Go source's decimal ones, rounded by Go): products and sums as __dmul_rn/__dadd_rn (each
// rounded once: NVRTC would otherwise contract a*b+c into one fma), the
// algorithm's own fused multiply-adds as __fma_rn. k_loss_coef then does
// train/loss's kdMath.term, coefK and clampCoef in their order of
// operations, so that its coefficients are the host's bit for bit.

DK_DEV double exp64(double x) {
	u64 b = (u64)__double_as_longlong(x);
	if ((b & ~(1ull << 63)) >= 0x7FF0000000000000ull) return b == 0xFFF0000000000000ull ? 0.0 : x;
	// The constants: Go's overflow bound 709.782712893384, 1/ln 2, ln 2 in
	// an upper and a lower part, then 1/8!, 1/7!, ..., 1/3!.
	if (x > 0x1.62e42fefa39efp+09) return __longlong_as_double(0x7FF0000000000000ll);
	// k = x/ln 2 rounded to nearest even; outside int32, INT_MIN (x86's
	// CVTSD2SL, which Go's Exp mirrors), which underflows below.
	double rk = rint(__dmul_rn(0x1.71547652b82fep+00, x));
	int k = (rk >= -2147483648.0 && rk <= 2147483647.0) ? (int)rk : (int)0x80000000u;
	double fk = (double)k;
	double r = __fma_rn(-0x1.62e42fefa3p-01, fk, x);
	r = __fma_rn(-0x1.3de6af278ece6p-42, fk, r);
	r = __dmul_rn(r, 0.0625);
	double p = 0x1.a01a01a01a01ap-16;
	p = __fma_rn(p, r, 0x1.a01a01a01a01ap-13);
	p = __fma_rn(p, r, 0x1.6c16c16c16c17p-10);
	p = __fma_rn(p, r, 0x1.1111111111111p-07);
	p = __fma_rn(p, r, 0x1.5555555555555p-05);
	p = __fma_rn(p, r, 0x1.5555555555555p-03);
	p = __fma_rn(p, r, 0.5);
	p = __fma_rn(p, r, 1.0);
	double y = __dmul_rn(r, p);
	y = __dmul_rn(y, __dadd_rn(y, 2.0));
	y = __dmul_rn(y, __dadd_rn(y, 2.0));
	y = __dmul_rn(y, __dadd_rn(y, 2.0));
	y = __fma_rn(y, __dadd_rn(y, 2.0), 1.0);
	int bx = k + 0x3FF;
	if (bx <= 0) {
		if (bx < -52) return 0.0;
		y = __dmul_rn(y, __longlong_as_double((long long)((u64)(bx + 0x3FE) << 52)));
		bx = 1;
	} else if (bx >= 0x7FF) {
		return __longlong_as_double(0x7FF0000000000000ll);
	}
	return __dmul_rn(y, __longlong_as_double((long long)((u64)bx << 52)));
}

DK_DEV double log64(double x) {
	u64 b = (u64)__double_as_longlong(x);
	if ((b & ~(1ull << 63)) == 0) return __longlong_as_double((long long)0xFFF0000000000000ull);
	if ((long long)b < 0) return __longlong_as_double(0x7FF8000000000001ll);
	if (b >= 0x7FF0000000000000ull) return x;
	double f1 = __longlong_as_double((long long)((b & ((1ull << 52) - 1)) | 0x3FE0000000000000ull));
	double k = (double)((long long)((b >> 52) & 0x7FF) - 0x3FE);
	// The constants: √2/2, then e_log.c's Lg7 ... Lg1, ln 2 as Ln2Lo and
	// Ln2Hi.
	if (!(0x1.6a09e667f3bcdp-01 < f1)) {
		k = __dsub_rn(k, 1.0);
		f1 = __dmul_rn(f1, 2.0);
	}
	double f = __dsub_rn(f1, 1.0);
	double s = __ddiv_rn(f, __dadd_rn(2.0, f));
	double s2 = __dmul_rn(s, s), s4 = __dmul_rn(s2, s2);
	double t1 = __dmul_rn(s4, 0x1.2f112df3e5244p-03);
	t1 = __dmul_rn(s4, __dadd_rn(0x1.7466496cb03dep-03, t1));
	t1 = __dmul_rn(s4, __dadd_rn(0x1.2492494229359p-02, t1));
	t1 = __dmul_rn(s2, __dadd_rn(0x1.5555555555593p-01, t1));
	double t2 = __dmul_rn(s4, 0x1.39a09d078c69fp-03);
	t2 = __dmul_rn(s4, __dadd_rn(0x1.c71c51d8e78afp-03, t2));
	t2 = __dmul_rn(s4, __dadd_rn(0x1.999999997fa04p-02, t2));
	double R = __dadd_rn(t1, t2);
	double hfsq = __dmul_rn(__dmul_rn(0.5, f), f);
	double u = __dadd_rn(__dmul_rn(s, __dadd_rn(hfsq, R)), __dmul_rn(k, 0x1.a39ef35793c76p-33));
	return __dsub_rn(__dmul_rn(k, 0x1.62e42feep-01), __dsub_rn(__dsub_rn(hfsq, u), f));
}

#define KD_FLOOR 0x1.4484bfeebc2ap-100  // 1e-30: train/loss's tailFloor
#define KD_COEF_MAX 0x1.93e5939a08ceap+99 // 1e30: clampCoef's bound

// max64 is Go's math.Max: +Inf wins over NaN, NaN over the rest, +0 over -0.
DK_DEV double max64(double a, double b) {
	if (isinf(a) && a > 0 || isinf(b) && b > 0) return __longlong_as_double(0x7FF0000000000000ll);
	if (isnan(a) || isnan(b)) return __longlong_as_double(0x7FF8000000000001ll);
	if (a == 0 && b == 0) return signbit(a) ? b : a;
	return a > b ? a : b;
}

// clamp_coef is train/loss's clampCoef: within ±1e30, as fp32.
DK_DEV float clamp_coef(double v) {
	if (!isnan(v)) v = v > KD_COEF_MAX ? KD_COEF_MAX : (v < -KD_COEF_MAX ? -KD_COEF_MAX : v);
	return __double2float_rn(v);
}

// k_exp_log64: out (2, n) = exp64(x), log64(x), for the tests that hold
// them to compute.Exp and compute.Log bit for bit on the device.
DK_KERNEL void k_exp_log64(double *__restrict__ out, const double *__restrict__ x, i64 n) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
		out[i] = exp64(x[i]);
		out[n + i] = log64(x[i]);
	}
}

// The tail modes (compute.LossTail).
#define KD_BUCKET 0
#define KD_RENORMALIZE 1
#define KD_ZERO 2

// kd_lse is train/loss's logSumExp over the K columns of row values v in
// rank order col, each scaled by f: m + log Σ exp(v·f - m), m = max v·f.
DK_DEV double kd_lse(const float *v, const i32 *col, int K, double f) {
	double m = -(double)DK_INF;
	for (int j = 0; j < K; j++) m = max64(m, __dmul_rn((double)v[col[j]], f));
	double s = 0;
	for (int j = 0; j < K; j++) s = __dadd_rn(s, exp64(__dsub_rn(__dmul_rn((double)v[col[j]], f), m)));
	return __dadd_rn(m, log64(s));
}

// k_loss_coef: one thread per counted position r computes pass 2's
// coefficients (compute.LossKD defines them) from pass 1's statistics st
// (3, M) = LseT, Lse1, Tail, zk (M,K) and zlab (M): lseTo, lse1o, ao (M)
// and cko (M,K), and the position's values vals (2, M) = D, CE. K = 0: CE
// only. A thread walks its row several times rather than keep K doubles.
DK_KERNEL void k_loss_coef(const double *__restrict__ st, const float *__restrict__ zk, const float *__restrict__ zlab,
                           const float *__restrict__ lp, const i32 *__restrict__ col, int K, int tail, float invTf, double lpscale,
                           double scale, float *__restrict__ lseTo, float *__restrict__ lse1o, float *__restrict__ ao,
                           float *__restrict__ cko, double *__restrict__ vals, i64 M) {
	for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < M; r += (i64)gridDim.x * blockDim.x) {
		double lseT = st[r], lse1 = st[M + r], qTail = st[2 * M + r];
		lseTo[r] = __double2float_rn(lseT);
		lse1o[r] = __double2float_rn(lse1);
		vals[M + r] = __dsub_rn(lse1, (double)zlab[r]);
		if (K == 0) {
			ao[r] = 0;
			vals[r] = 0;
			continue;
		}
		const float *z = zk + r * K, *l = lp + r * K;
		const i32 *cl = col + r * K;
		double invT = (double)invTf;
		// The teacher's log-prob at column c is l_c (bucket) or
		// l_c·lpscale - lsp, the student's z_c·invT - lsq.
		double lsp = 0, lsq = lseT, lpT = 0, lqT = 0;
		if (tail == KD_BUCKET) {
			double psum = 0;
			for (int j = 0; j < K; j++) psum = __dadd_rn(psum, exp64((double)l[cl[j]]));
			lpT = log64(max64(__dsub_rn(1.0, psum), KD_FLOOR));
			lqT = log64(max64(qTail, KD_FLOOR));
		} else {
			lsp = kd_lse(l, cl, K, lpscale);
			if (tail == KD_RENORMALIZE) lsq = kd_lse(z, cl, K, invT);
		}
#define KD_P(c) (tail == KD_BUCKET ? (double)l[c] : __dsub_rn(__dmul_rn((double)l[c], lpscale), lsp))
#define KD_Q(c) __dsub_rn(__dmul_rn((double)z[c], invT), lsq)
		double D = 0, H = 0;
		for (int j = 0; j < K; j++) {
			int c = cl[j];
			double pe = KD_P(c), P = exp64(pe);
			if (P > 0) D = __dadd_rn(D, __dmul_rn(P, __dsub_rn(pe, KD_Q(c))));
			H = __dadd_rn(H, -P);
		}
		double out = -H;
		if (tail == KD_BUCKET) {
			double P = exp64(lpT);
			if (P > 0) D = __dadd_rn(D, __dmul_rn(P, __dsub_rn(lpT, lqT)));
			H = __dadd_rn(H, -P);
			out = -H;
			if (qTail > KD_FLOOR) out = __dadd_rn(out, __ddiv_rn(-P, qTail));
		} else if (tail == KD_RENORMALIZE) {
			out = 0;
		}
		ao[r] = clamp_coef(__dmul_rn(scale, out));
		for (int c = 0; c < K; c++) {
			double g = __dsub_rn(-exp64(KD_P(c)), __dmul_rn(exp64(KD_Q(c)), H));
			cko[r * K + c] = __double2float_rn(__dmul_rn(scale, g));
		}
#undef KD_P
#undef KD_Q
		vals[r] = D;
	}
}

DK_REGISTER(k_loss_init)
DK_REGISTER(k_loss_fwd_tile)
DK_REGISTER(k_loss_fwd_finish)
DK_REGISTER(k_loss_bwd_tile)
DK_REGISTER(k_loss_coef)
DK_REGISTER(k_exp_log64)
DK_REGISTER(k_gather_rows_bf16)
DK_REGISTER(k_scatter_add_rows)
