// RMSNorm (also the per-head q/k norm: rows = tokens·heads, dim = head_dim)
// and rotary embeddings.

// rms_row normalizes one row with the nt threads of a warp (nt = 32) or a
// block (nt = blockDim.x), tid in [0, nt): the sum of squares is
// accumulated in float64 and its mean rounded to fp32; then
// rstd = 1/sqrt(mean + eps) and out = (x·rstd)·w in fp32, as HF's
// LlamaRMSNorm and compute/cpu. red (32 doubles of shared memory) is used
// only when nt > 32. x and out are BF16 or F32 (x_bf, out_bf). out may
// alias x (same dtype): each element is read and written by the same
// thread.
//
// With add set, x is F32 and the row is the residual connection's first
// (x += add, the sum written back) before it is normed: each element is
// read, summed and written by the thread that later reads it again.
DK_DEV void rms_row(void *out, int out_bf, float *rstd_out, const void *x, int x_bf, const float *add, const void *w, int w_bf16, int dim,
                    float eps, int tid, int nt, double *red) {
	double ss = 0;
	for (int i = tid; i < dim; i += nt) {
		float v;
		if (add) {
			v = ((const float *)x)[i] + add[i];
			((float *)x)[i] = v;
		} else v = ld_act(x, x_bf, i);
		ss += (double)v * (double)v;
	}
	ss = warp_sum_d(ss);
	if (nt > DK_WARP) {
		int warp = tid / DK_WARP, lane = tid % DK_WARP, nw = nt / DK_WARP;
		if (lane == 0) red[warp] = ss;
		__syncthreads();
		ss = 0;
		for (int i = 0; i < nw; i++) ss += red[i];
	}
	float mean = (float)(ss / dim);
	float rs = 1.0f / sqrtf(mean + eps);
	for (int i = tid; i < dim; i += nt) st_act(out, out_bf, i, (ld_act(x, x_bf, i) * rs) * load_w(w, w_bf16, i));
	if (rstd_out && tid == 0) *rstd_out = rs;
}

// --- 8-wide variants, for BF16 or F32 rows whose dim is a multiple of 8
// and whose tensors are 16-byte aligned (the host checks: ops.go,
// rmsnormVecLaunch, RMSNormRoPE). A thread loads its elements with one
// 16-byte access per 8 BF16 (two per 8 F32), keeps them in registers
// between the sum of squares and the output (the scalar kernels read x
// twice), and writes 16 bytes at a time. Each output element keeps the
// scalar kernels' fp32 formula and single rounding; only the float64 sum
// of squares is added in another (still fixed) order, and it is rounded to
// an fp32 mean.

// rms_row8 is rms_row for one row with a group of `lanes` threads (sub
// this thread's index in it): a warp's aligned group (red null) or the
// whole block (red: 32 doubles of shared memory, lanes = blockDim.x).
// ok is false for the lanes of a warp's last group past the rows: they
// take part in the shuffles only. The add path as rms_row's: x (F32) +=
// add, the sum written back and normed from registers.
DK_DEV void rms_row8(void *out, int out_bf, float *rstd_out, const void *x, int x_bf, const float *add, const void *w, int w_bf16, int dim,
                     float eps, int sub, int lanes, bool ok, double *red) {
	int nc = dim / 8;
	float v[RV_K][8];
	double ss = 0;
#pragma unroll
	for (int k = 0; k < RV_K; k++) {
		int c = sub + k * lanes;
		if (!ok || c >= nc) continue;
		if (add) {
			float a[8];
			ld8(v[k], x, 0, c);
			ld8(a, add, 0, c);
#pragma unroll
			for (int j = 0; j < 8; j++) v[k][j] = v[k][j] + a[j];
			st8((void *)x, 0, c, v[k]);
		} else ld8(v[k], x, x_bf, c);
#pragma unroll
		for (int j = 0; j < 8; j++) ss += (double)v[k][j] * (double)v[k][j];
	}
	ss = row_sum_d(ss, sub, lanes, red);
	float mean = (float)(ss / dim);
	float rs = 1.0f / sqrtf(mean + eps);
#pragma unroll
	for (int k = 0; k < RV_K; k++) {
		int c = sub + k * lanes;
		if (!ok || c >= nc) continue;
		float wv[8], o[8];
		ld8(wv, w, w_bf16, c);
#pragma unroll
		for (int j = 0; j < 8; j++) o[j] = (v[k][j] * rs) * wv[j];
		st8(out, out_bf, c, o);
	}
	if (rstd_out && ok && sub == 0) *rstd_out = rs;
}

// k_rmsnorm_warp8: k_rmsnorm_warp's rows (dim <= 8·RV_K·32) by groups of
// `lanes` lanes, 32/lanes rows a warp, (blockDim.x/32)·(32/lanes) rows a
// block.
DK_KERNEL void k_rmsnorm_warp8(void *out, int out_bf, float *rstd, const void *x, int x_bf, const float *add, const void *w, int w_bf16,
                               i64 rows, int dim, float eps, int lanes) {
	int lane = threadIdx.x % DK_WARP;
	i64 row0 = ((i64)blockIdx.x * (blockDim.x / DK_WARP) + threadIdx.x / DK_WARP) * (DK_WARP / lanes);
	if (row0 >= rows) return; // a whole warp leaves together
	i64 row = row0 + lane / lanes;
	bool ok = row < rows;
	if (!ok) row = row0; // an address in range; nothing is read or written
	rms_row8(act_ptr(out, out_bf, row * dim), out_bf, rstd ? rstd + row : 0, act_ptr(x, x_bf, row * dim), x_bf, add ? add + row * dim : 0,
	         w, w_bf16, dim, eps, lane % lanes, lanes, ok, 0);
}

// k_rmsnorm_block8: one block per row (blockDim.x a multiple of 32, dim <=
// 8·RV_K·blockDim.x); lanes is blockDim.x.
DK_KERNEL void k_rmsnorm_block8(void *out, int out_bf, float *rstd, const void *x, int x_bf, const float *add, const void *w, int w_bf16,
                                i64 rows, int dim, float eps, int lanes) {
	__shared__ double red[32];
	i64 row = blockIdx.x;
	rms_row8(act_ptr(out, out_bf, row * dim), out_bf, rstd ? rstd + row : 0, act_ptr(x, x_bf, row * dim), x_bf, add ? add + row * dim : 0,
	         w, w_bf16, dim, eps, threadIdx.x, lanes, true, red);
}

// One warp per row, blockDim.x/32 rows per block: for dim <= 1024 (head
// norms, small models). rstd (rows) receives 1/rms, or is null.
// add (rows, dim) F32, when not null: x (F32) += add first (AddRMSNorm).
DK_KERNEL void k_rmsnorm_warp(void *out, int out_bf, float *rstd, const void *x, int x_bf, const float *add, const void *w, int w_bf16,
                              i64 rows, int dim, float eps) {
	i64 row = (i64)blockIdx.x * (blockDim.x / DK_WARP) + threadIdx.x / DK_WARP;
	if (row >= rows) return; // a whole warp leaves together: no block barrier follows
	rms_row(act_ptr(out, out_bf, row * dim), out_bf, rstd ? rstd + row : 0, act_ptr(x, x_bf, row * dim), x_bf, add ? add + row * dim : 0,
	        w, w_bf16, dim, eps, threadIdx.x % DK_WARP, DK_WARP, 0);
}

// One block per row (blockDim.x a multiple of 32, at most 1024).
DK_KERNEL void k_rmsnorm_block(void *out, int out_bf, float *rstd, const void *x, int x_bf, const float *add, const void *w, int w_bf16,
                               i64 rows, int dim, float eps) {
	__shared__ double red[32];
	i64 row = blockIdx.x;
	rms_row(act_ptr(out, out_bf, row * dim), out_bf, rstd ? rstd + row : 0, act_ptr(x, x_bf, row * dim), x_bf, add ? add + row * dim : 0,
	        w, w_bf16, dim, eps, threadIdx.x, blockDim.x, red);
}

// RoPE, rotate-half, in place on x (tokens, heads, hd), with the angles'
// cos and sin given per token, cos/sin (tokens, hd/2), as the decoder
// tabulates them (float64 cos and sin of the fp32 angle pos·inv_freq):
//   x[i], x[i+hd/2] = x[i]·c - x[i+hd/2]·s, x[i+hd/2]·c + x[i]·s.
// One block per token; its threads stride over the heads·hd/2 pairs. x is
// BF16 (x_bf) or F32.
DK_KERNEL void k_rope_table(void *x, int x_bf, const float *__restrict__ cosv, const float *__restrict__ sinv, i64 tokens, int heads,
                            int hd) {
	i64 t = blockIdx.x;
	int half = hd / 2;
	const float *ct = cosv + t * half, *st = sinv + t * half;
	i64 xt = t * (i64)heads * hd;
	for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
		int h = j / half, i = j - h * half;
		i64 v = xt + (i64)h * hd;
		float a = ld_act(x, x_bf, v + i), b = ld_act(x, x_bf, v + i + half), c = ct[i], s = st[i];
		st_act(x, x_bf, v + i, a * c - b * s);
		st_act(x, x_bf, v + i + half, b * c + a * s);
	}
}

// k_rmsnorm_rope: the q/k norm and RoPE in one pass (RMSNormRoPE), one
// warp per (token, head) row of x (tokens·heads, hd): rms_row's statistics
// and out = rope((x·rstd)·w) with the token's angles, k_rope_table's
// rotation, each output rounded once. x and out are BF16 or F32; out may
// alias x: every lane has read its share of the row before the shuffles of
// the sum, and each rotated pair is read and written by one lane.
DK_KERNEL void k_rmsnorm_rope(void *out, int out_bf, float *rstd, const void *x, int x_bf, const void *w, int w_bf16,
                              const float *__restrict__ cosv, const float *__restrict__ sinv, i64 rows, int heads, int hd, float eps) {
	i64 row = (i64)blockIdx.x * (blockDim.x / DK_WARP) + threadIdx.x / DK_WARP;
	if (row >= rows) return; // a whole warp leaves together
	int lane = threadIdx.x % DK_WARP, half = hd / 2;
	const void *xr = act_ptr(x, x_bf, row * hd);
	void *orow = act_ptr(out, out_bf, row * hd);
	double ss = 0;
	for (int i = lane; i < hd; i += DK_WARP) {
		float v = ld_act(xr, x_bf, i);
		ss += (double)v * (double)v;
	}
	ss = warp_sum_d(ss);
	float mean = (float)(ss / hd);
	float rs = 1.0f / sqrtf(mean + eps);
	i64 t = row / heads;
	const float *ct = cosv + t * half, *st = sinv + t * half;
	for (int i = lane; i < half; i += DK_WARP) {
		float a = (ld_act(xr, x_bf, i) * rs) * load_w(w, w_bf16, i);
		float b = (ld_act(xr, x_bf, i + half) * rs) * load_w(w, w_bf16, i + half);
		float c = ct[i], s = st[i];
		st_act(orow, out_bf, i, a * c - b * s);
		st_act(orow, out_bf, i + half, b * c + a * s);
	}
	if (rstd && lane == 0) rstd[row] = rs;
}

// k_rmsnorm_rope8: k_rmsnorm_rope for hd = 16·nc (nc <= 32 chunks of 8
// per half row) and 16-byte aligned x, out, w, cos and sin: a group of
// `lanes` = nc rounded up to a power of two lanes per row, 32/lanes rows a
// warp; lane sub < nc of a group holds chunk sub of each half, so the
// pairs it rotates (i, i + hd/2) are its own. Same per-element formulas
// as k_rmsnorm_rope; out may alias x (a lane reads its chunks before the
// shuffles of the sum and writes them after).
DK_KERNEL void k_rmsnorm_rope8(void *out, int out_bf, float *rstd, const void *x, int x_bf, const void *w, int w_bf16,
                               const float *__restrict__ cosv, const float *__restrict__ sinv, i64 rows, int heads, int hd, float eps,
                               int lanes) {
	int lane = threadIdx.x % DK_WARP, sub = lane % lanes, half = hd / 2, nc = half / 8;
	i64 row0 = ((i64)blockIdx.x * (blockDim.x / DK_WARP) + threadIdx.x / DK_WARP) * (DK_WARP / lanes);
	if (row0 >= rows) return; // a whole warp leaves together
	i64 row = row0 + lane / lanes;
	bool ok = row < rows && sub < nc;
	float a[8], b[8];
	double ss = 0;
	if (ok) {
		const void *xr = act_ptr(x, x_bf, row * hd);
		ld8(a, xr, x_bf, sub);
		ld8(b, xr, x_bf, nc + sub);
#pragma unroll
		for (int j = 0; j < 8; j++) ss += (double)a[j] * (double)a[j];
#pragma unroll
		for (int j = 0; j < 8; j++) ss += (double)b[j] * (double)b[j];
	}
	ss = group_sum_d(ss, lanes);
	float mean = (float)(ss / hd);
	float rs = 1.0f / sqrtf(mean + eps);
	if (!ok) return; // past the shuffles: nothing collective follows
	i64 t = row / heads;
	float wa[8], wb[8], c[8], s[8], lo[8], hi[8];
	ld8(wa, w, w_bf16, sub);
	ld8(wb, w, w_bf16, nc + sub);
	ld8(c, cosv + t * half, 0, sub);
	ld8(s, sinv + t * half, 0, sub);
#pragma unroll
	for (int j = 0; j < 8; j++) {
		float av = (a[j] * rs) * wa[j];
		float bv = (b[j] * rs) * wb[j];
		lo[j] = av * c[j] - bv * s[j];
		hi[j] = bv * c[j] + av * s[j];
	}
	void *orow = act_ptr(out, out_bf, row * hd);
	st8(orow, out_bf, sub, lo);
	st8(orow, out_bf, nc + sub, hi);
	if (rstd && sub == 0) rstd[row] = rs;
}

DK_REGISTER(k_rmsnorm_warp)
DK_REGISTER(k_rmsnorm_warp8)
DK_REGISTER(k_rmsnorm_block8)
DK_REGISTER(k_rmsnorm_rope8)
DK_REGISTER(k_rmsnorm_rope)
DK_REGISTER(k_rmsnorm_block)
DK_REGISTER(k_rope_table)
