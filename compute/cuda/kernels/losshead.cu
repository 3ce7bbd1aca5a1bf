// The fused LM-head loss (compute.LossHead): cuBLASLt writes the logits of
// the M counted rows against one vocabulary tile (M x n, F32); these
// kernels fold a tile into each row's statistics (pass 1) or turn it into
// dL/dz (pass 2), one block per row. [M x V] logits never exist.
//
// A row's teacher ids (K, ascending, distinct) are staged in shared memory
// and each column finds out by binary search whether it is one of them, so
// the tail Σ_{v∉K} exp(z_v/T - lse) is summed directly over the columns
// outside K (never 1 - Σ_K), as compute/cpu does. Per-row sums are float64,
// reduced in a fixed tree order: deterministic, no atomics.

#define LOSS_THREADS 256

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

// k_loss_fwd_tile: block r folds row r's logits for vocab ids [v0, v0+n),
// tile[r·n .. r·n+n), into st, and gathers z at its teacher ids (zk, (M,K))
// and at its label (zlab). Dynamic shared memory: K ids.
DK_KERNEL __launch_bounds__(LOSS_THREADS) void k_loss_fwd_tile(const float *__restrict__ tile, int n, int v0, float invT, int sepce,
                                                               const i32 *__restrict__ ids, int K, const i32 *__restrict__ labels,
                                                               double *__restrict__ st, i64 M, float *__restrict__ zk,
                                                               float *__restrict__ zlab) {
	DK_DYN_SMEM(i32, sid);
	__shared__ double red[3 * LOSS_THREADS];
	__shared__ float redf[LOSS_THREADS];
	i64 r = blockIdx.x;
	const float *z = tile + r * n;
	for (int j = threadIdx.x; j < K; j += LOSS_THREADS) sid[j] = ids[r * K + j];
	float mx = -DK_INF;
	for (int c = threadIdx.x; c < n; c += LOSS_THREADS) mx = fmaxf(mx, z[c]);
	mx = block_max_f(mx, redf); // also the barrier after sid's writes
	double mT = st[r], m = mT > (double)(mx * invT) ? mT : (double)(mx * invT);
	double m1 = st[3 * M + r], mm = m1 > (double)mx ? m1 : (double)mx;
	float mf = (float)m, mmf = (float)mm;
	double tail = 0, topk = 0, s1 = 0;
	for (int c = threadIdx.x; c < n; c += LOSS_THREADS) {
		float zv = z[c];
		double e = (double)expf(zv * invT - mf);
		if (K > 0 && in_topk(sid, K, v0 + c) >= 0) topk += e;
		else tail += e;
		if (sepce) s1 += (double)expf(zv - mmf);
	}
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

// k_loss_bwd_tile: block r turns row r's logits of vocab ids [v0, v0+n)
// into dL/dz (compute.LossCoef), rounded to BF16 for the GEMMs that follow:
//   v ∉ K: a·q_v (+ wsft·p_v), v = ids[j]: ck[j] (+ wsft·p_v), minus wsft at
//   the label; q_v = exp(z·invT - lseT), p_v = exp(z - lse1) (= q_v when
//   the CE shares the temperature: sepce = 0).
// Dynamic shared memory: K ids.
DK_KERNEL __launch_bounds__(LOSS_THREADS) void k_loss_bwd_tile(u16 *__restrict__ dz, const float *__restrict__ tile, int n, int v0,
                                                               float invT, int sepce, const float *__restrict__ lseT,
                                                               const float *__restrict__ lse1, const float *__restrict__ acoef,
                                                               const float *__restrict__ ck, const i32 *__restrict__ ids, int K,
                                                               const i32 *__restrict__ labels, float wsft) {
	DK_DYN_SMEM(i32, sid);
	i64 r = blockIdx.x;
	for (int j = threadIdx.x; j < K; j += LOSS_THREADS) sid[j] = ids[r * K + j];
	__syncthreads();
	const float *z = tile + r * n;
	u16 *o = dz + r * n;
	float lt = lseT[r], l1 = lse1[r], a = acoef[r];
	i32 lab = labels[r];
	for (int c = threadIdx.x; c < n; c += LOSS_THREADS) {
		float zv = z[c];
		int j = K > 0 ? in_topk(sid, K, v0 + c) : -1;
		float g;
		if (j >= 0) {
			g = ck[r * K + j];
			if (wsft != 0) g += sepce ? wsft * expf(zv - l1) : wsft * expf(zv * invT - lt);
		} else if (sepce) {
			g = wsft * expf(zv - l1);
			if (a != 0) g += a * expf(zv * invT - lt);
		} else {
			g = (a + wsft) * expf(zv * invT - lt);
		}
		if (v0 + c == lab) g -= wsft;
		o[c] = f2bf(g);
	}
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

DK_REGISTER(k_loss_init)
DK_REGISTER(k_loss_fwd_tile)
DK_REGISTER(k_loss_fwd_finish)
DK_REGISTER(k_loss_bwd_tile)
DK_REGISTER(k_gather_rows_bf16)
DK_REGISTER(k_scatter_add_rows)
