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

DK_REGISTER(k_rmsnorm_warp)
DK_REGISTER(k_rmsnorm_rope)
DK_REGISTER(k_rmsnorm_block)
DK_REGISTER(k_rope_table)
