// The backward kernels of the layers (but attention's, attention_bwd.cu):
// every one ACCUMULATES (+=) into its gradients, as compute.Backend says,
// except RoPE's, which rotates in place. Reductions over rows (RMSNorm's
// dw, a bias's gradient) are deterministic: each block sums a fixed chunk
// of rows per column into a float64 partial, and one more kernel adds the
// chunks in index order. The embedding's backward adds the rows of dout
// into the table in token order, one thread per column. No atomics.

// SwiGLU: du += dout·silu(g), dg += dout·u·σ(g)·(1 + g·(1-σ(g))), as
// compute/cpu's k_swiglu_bwd. g and u are BF16 (their flag set) or F32.
DK_KERNEL void k_swiglu_bwd(float *__restrict__ dg, float *__restrict__ du, const float *__restrict__ dout, const void *__restrict__ g,
                            int g_bf, const void *__restrict__ u, int u_bf, i64 n) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
		float gv = ld_act(g, g_bf, i), d = dout[i];
		float sg = 1.0f / (1.0f + expf(-gv));
		du[i] += d * gv * sg;
		dg[i] += d * ld_act(u, u_bf, i) * sg * (1.0f + gv * (1.0f - sg));
	}
}

// RoPE's backward: the rotation by -angle, in place on dx (tokens, heads,
// hd): dx[i], dx[i+hd/2] = dx[i]·c + dx[i+hd/2]·s, dx[i+hd/2]·c - dx[i]·s.
// The geometry of k_rope_table.
DK_KERNEL void k_rope_table_bwd(float *x, const float *__restrict__ cosv, const float *__restrict__ sinv, i64 tokens, int heads, int hd) {
	i64 t = blockIdx.x;
	int half = hd / 2;
	const float *ct = cosv + t * half, *st = sinv + t * half;
	float *xt = x + t * (i64)heads * hd;
	for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
		int h = j / half, i = j - h * half;
		float *v = xt + (i64)h * hd;
		float a = v[i], b = v[i + half], c = ct[i], s = st[i];
		v[i] = a * c + b * s;
		v[i + half] = b * c - a * s;
	}
}

// RMSNorm's backward, dx part, one warp per row (nt = 32) or one block per
// row (nt = blockDim.x): with xh = x·rstd,
// dx += rstd·(dout·w - xh·mean(dout·w·xh)), the mean's sum in float64.
// x (the row's start) is BF16 (x_bf) or F32.
DK_DEV void rms_bwd_row(float *dx, const float *d, const void *x, int x_bf, const void *w, int w_bf16, float rs, int dim, int tid,
                        int nt, double *red) {
	double dot = 0;
	for (int i = tid; i < dim; i += nt) {
		float xh = ld_act(x, x_bf, i) * rs;
		dot += (double)(d[i] * load_w(w, w_bf16, i) * xh);
	}
	dot = warp_sum_d(dot);
	if (nt > DK_WARP) {
		int warp = tid / DK_WARP, lane = tid % DK_WARP, nw = nt / DK_WARP;
		if (lane == 0) red[warp] = dot;
		__syncthreads();
		dot = 0;
		for (int i = 0; i < nw; i++) dot += red[i];
	}
	float m = (float)(dot / dim);
	for (int i = tid; i < dim; i += nt) dx[i] += rs * (d[i] * load_w(w, w_bf16, i) - ld_act(x, x_bf, i) * rs * m);
}

DK_KERNEL void k_rmsnorm_bwd_warp(float *dx, const float *dout, const void *x, int x_bf, const void *w, int w_bf16, const float *rstd,
                                  i64 rows, int dim) {
	i64 row = (i64)blockIdx.x * (blockDim.x / DK_WARP) + threadIdx.x / DK_WARP;
	if (row >= rows) return; // a whole warp leaves together
	rms_bwd_row(dx + row * dim, dout + row * dim, act_ptr(x, x_bf, row * dim), x_bf, w, w_bf16, rstd[row], dim, threadIdx.x % DK_WARP,
	            DK_WARP, 0);
}

DK_KERNEL void k_rmsnorm_bwd_block(float *dx, const float *dout, const void *x, int x_bf, const void *w, int w_bf16, const float *rstd,
                                   i64 rows, int dim) {
	__shared__ double red[32];
	i64 row = blockIdx.x;
	rms_bwd_row(dx + row * dim, dout + row * dim, act_ptr(x, x_bf, row * dim), x_bf, w, w_bf16, rstd[row], dim, threadIdx.x, blockDim.x,
	            red);
}

// k_colsum_part: block (bx, by) sums, for the columns bx·blockDim.x + tid,
// rows [by·chunk, (by+1)·chunk) of src (rows, cols) into part (gridDim.y,
// cols), float64, in row order. With x and rstd set it sums
// src·x·rstd[row] (RMSNorm's dw: dout·xh; x BF16 when x_bf), else src (a
// bias's gradient).
DK_KERNEL void k_colsum_part(double *__restrict__ part, const float *__restrict__ src, const void *__restrict__ x, int x_bf,
                             const float *__restrict__ rstd, i64 rows, int cols, int chunk) {
	int c = blockIdx.x * blockDim.x + threadIdx.x;
	if (c >= cols) return;
	i64 r0 = (i64)blockIdx.y * chunk, r1 = lmin(r0 + chunk, rows);
	double s = 0;
	for (i64 r = r0; r < r1; r++) {
		float v = src[r * cols + c];
		if (x) v = v * (ld_act(x, x_bf, r * cols + c) * rstd[r]);
		s += (double)v;
	}
	part[(i64)blockIdx.y * cols + c] = s;
}

// k_colsum_finish: dst (cols) += Σ over the np chunks of part, in order.
DK_KERNEL void k_colsum_finish(float *__restrict__ dst, const double *__restrict__ part, int np, int cols) {
	for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
		double s = 0;
		for (int p = 0; p < np; p++) s += part[(i64)p * cols + c];
		dst[c] += (float)s;
	}
}

// k_embed_bwd: dtable (vocab, dim) += the rows of dout (n, dim) at ids.
// One thread per column walks the tokens in order, so repeated ids add up
// in a fixed order without atomics.
DK_KERNEL void k_embed_bwd(float *dtable, const float *__restrict__ dout, const i32 *__restrict__ ids, i64 n, int dim) {
	int c = blockIdx.x * blockDim.x + threadIdx.x;
	if (c >= dim) return;
	for (i64 t = 0; t < n; t++) dtable[(i64)ids[t] * dim + c] += dout[t * dim + c];
}

DK_REGISTER(k_swiglu_bwd)
DK_REGISTER(k_rope_table_bwd)
DK_REGISTER(k_rmsnorm_bwd_warp)
DK_REGISTER(k_rmsnorm_bwd_block)
DK_REGISTER(k_colsum_part)
DK_REGISTER(k_colsum_finish)
DK_REGISTER(k_embed_bwd)
