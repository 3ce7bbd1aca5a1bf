// The backward kernels of the layers (but attention's, attention_bwd.cu):
// every one ACCUMULATES (+=) into its gradients, as compute.Backend says,
// except RoPE's, which rotates in place. Those with an acc flag start each
// sum from 0 instead of the gradient's value when it is 0: the host's
// deferred zeros (zeros.go), where the gradient was zeroed for this call
// (the same bits: the sum's first term is added to 0 either way). Reductions over rows (RMSNorm's
// dw, a bias's gradient) are deterministic: each block sums a fixed chunk
// of rows per column into a float64 partial, and one more kernel adds the
// chunks in index order. The embedding's backward adds the rows of dout
// into the table in token order, one thread per column. No atomics.

// --- Vector access, for the 8- and 4-wide variants below (the host checks
// their alignment and sizes; the scalar kernels stay the fallback): ld8
// and st8 are prelude.cuh's.

// ld4 reads elements 4c..4c+3 of p: one 8-byte load (BF16) or one
// 16-byte load (F32); p 16-byte aligned.
DK_DEV void ld4(float v[4], const void *p, int bf, i64 c) {
	if (bf) {
		dk_u2 q = ((const dk_u2 *)p)[c];
		v[0] = bf2f((u16)(q.lo & 0xffff)), v[1] = bf2f((u16)(q.lo >> 16));
		v[2] = bf2f((u16)(q.hi & 0xffff)), v[3] = bf2f((u16)(q.hi >> 16));
	} else {
		dk_f4 a = ((const dk_f4 *)p)[c];
		v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
	}
}

// fresh returns v as a value the compiler cannot trace to where it came
// from. A vector kernel that keeps an operand in a register for a second
// pass gives it to fresh there, so that the second pass's products are
// computed anew, as in the scalar kernels, which reload their operands:
// whether NVRTC fuses a product into an add (FMA contraction, on by
// default) depends on the product's other uses, and a product shared with
// the first pass could round differently.
#ifdef DISTILL_EMU
DK_DEV float fresh(float v) { return v; }
#else
DK_DEV float fresh(float v) {
	asm volatile("" : "+f"(v));
	return v;
}
#endif

// SwiGLU: du += dout·silu(g), dg += dout·u·σ(g)·(1 + g·(1-σ(g))), as
// compute/cpu's k_swiglu_bwd: swiglu_bwd1 is one element, the scalar and
// the 8-wide kernel's.
DK_DEV void swiglu_bwd1(float &dg, float &du, float d, float gv, float uv) {
	float sg = 1.0f / (1.0f + expf(-gv));
	du += d * gv * sg;
	dg += d * uv * sg * (1.0f + gv * (1.0f - sg));
}

// g and u are BF16 (their flag set) or F32; so are dg and du (the
// gradients a GEMM's backward reads next: a BF16 one gets the fp32 sum of
// its old value and the term, rounded once, so a zeroed BF16 dg holds the
// rounding of the value an F32 dg would hold). acc 0: dg and du are not
// read, each sum starts from 0.
DK_KERNEL void k_swiglu_bwd(void *__restrict__ dg, int dg_bf, void *__restrict__ du, int du_bf, const float *__restrict__ dout,
                            const void *__restrict__ g, int g_bf, const void *__restrict__ u, int u_bf, i64 n, int acc) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
		float a = acc ? ld_act(dg, dg_bf, i) : 0.0f, b = acc ? ld_act(du, du_bf, i) : 0.0f;
		swiglu_bwd1(a, b, dout[i], ld_act(g, g_bf, i), ld_act(u, u_bf, i));
		st_act(dg, dg_bf, i, a);
		st_act(du, du_bf, i, b);
	}
}

// k_swiglu_bwd eight elements at a time (n = 8·n8, every tensor 16-byte
// aligned): 16-byte accesses instead of an element's 2 or 4 bytes.
DK_KERNEL void k_swiglu_bwd_x8(void *__restrict__ dg, int dg_bf, void *__restrict__ du, int du_bf, const float *__restrict__ dout,
                               const void *__restrict__ g, int g_bf, const void *__restrict__ u, int u_bf, i64 n8, int acc) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (i64)gridDim.x * blockDim.x) {
		float a[8], b[8], d[8], gv[8], uv[8];
		ld8(d, dout, 0, i);
		ld8(gv, g, g_bf, i);
		ld8(uv, u, u_bf, i);
		if (acc) {
			ld8(a, dg, dg_bf, i);
			ld8(b, du, du_bf, i);
		} else {
#pragma unroll
			for (int j = 0; j < 8; j++) a[j] = b[j] = 0.0f;
		}
#pragma unroll
		for (int j = 0; j < 8; j++) swiglu_bwd1(a[j], b[j], d[j], gv[j], uv[j]);
		st8(dg, dg_bf, i, a);
		st8(du, du_bf, i, b);
	}
}

// RoPE's backward: the rotation by -angle, in place on dx (tokens, heads,
// hd): dx[i], dx[i+hd/2] = dx[i]·c + dx[i+hd/2]·s, dx[i+hd/2]·c - dx[i]·s;
// with copy set, also the BF16 rounding of each new value into copy (the
// same layout: the q/k projections' dout where no norm or bias follows).
// The geometry of k_rope_table.
DK_KERNEL void k_rope_table_bwd(float *x, const float *__restrict__ cosv, const float *__restrict__ sinv, i64 tokens, int heads, int hd,
                                u16 *__restrict__ copy) {
	i64 t = blockIdx.x;
	int half = hd / 2;
	const float *ct = cosv + t * half, *st = sinv + t * half;
	float *xt = x + t * (i64)heads * hd;
	for (int j = threadIdx.x; j < heads * half; j += blockDim.x) {
		int h = j / half, i = j - h * half;
		float *v = xt + (i64)h * hd;
		float a = v[i], b = v[i + half], c = ct[i], s = st[i];
		float lo = a * c + b * s, hi = b * c - a * s;
		v[i] = lo;
		v[i + half] = hi;
		if (copy) {
			u16 *cv = copy + t * (i64)heads * hd + (i64)h * hd;
			cv[i] = f2bf(lo);
			cv[i + half] = f2bf(hi);
		}
	}
}

// RMSNorm's backward, dx part, one warp per row (nt = 32) or one block per
// row (nt = blockDim.x): with xh = x·rstd,
// dx += rstd·(dout·w - xh·mean(dout·w·xh)), the mean's sum in float64.
// x (the row's start) is BF16 (x_bf) or F32; so is dx (dx_bf: a BF16 dx
// gets the fp32 sum rounded once). dxc, when not null, receives the BF16
// rounding of each new dx value beside it (the residual stream's
// gradient, kept in F32, and its copy for a GEMM's backward). acc 0: dx
// is not read, each element's sum starts from 0.
// rms_bwd_dot1 is one element's term of the mean's sum, dout·w·xh;
// rms_bwd1 one element's dx with the mean m: the scalar and the 8-wide
// kernels' formulas.
DK_DEV float rms_bwd_dot1(float d, float wv, float xv, float rs) {
	float xh = xv * rs;
	return d * wv * xh;
}
DK_DEV float rms_bwd1(float dx, float d, float wv, float xv, float rs, float m) { return dx + rs * (d * wv - xv * rs * m); }

DK_DEV void rms_bwd_row(void *dx, int dx_bf, u16 *dxc, const float *d, const void *x, int x_bf, const void *w, int w_bf16, float rs,
                        int dim, int tid, int nt, double *red, int acc) {
	double dot = 0;
	for (int i = tid; i < dim; i += nt) dot += (double)rms_bwd_dot1(d[i], load_w(w, w_bf16, i), ld_act(x, x_bf, i), rs);
	dot = warp_sum_d(dot);
	if (nt > DK_WARP) {
		int warp = tid / DK_WARP, lane = tid % DK_WARP, nw = nt / DK_WARP;
		if (lane == 0) red[warp] = dot;
		__syncthreads();
		dot = 0;
		for (int i = 0; i < nw; i++) dot += red[i];
	}
	float m = (float)(dot / dim);
	for (int i = tid; i < dim; i += nt) {
		float v = rms_bwd1(acc ? ld_act(dx, dx_bf, i) : 0.0f, d[i], load_w(w, w_bf16, i), ld_act(x, x_bf, i), rs, m);
		st_act(dx, dx_bf, i, v);
		if (dxc) dxc[i] = f2bf(v);
	}
}

DK_KERNEL void k_rmsnorm_bwd_warp(void *dx, int dx_bf, u16 *dxc, const float *dout, const void *x, int x_bf, const void *w, int w_bf16,
                                  const float *rstd, i64 rows, int dim, int acc) {
	i64 row = (i64)blockIdx.x * (blockDim.x / DK_WARP) + threadIdx.x / DK_WARP;
	if (row >= rows) return; // a whole warp leaves together
	rms_bwd_row(act_ptr(dx, dx_bf, row * dim), dx_bf, dxc ? dxc + row * dim : dxc, dout + row * dim, act_ptr(x, x_bf, row * dim), x_bf, w,
	            w_bf16, rstd[row], dim, threadIdx.x % DK_WARP, DK_WARP, 0, acc);
}

DK_KERNEL void k_rmsnorm_bwd_block(void *dx, int dx_bf, u16 *dxc, const float *dout, const void *x, int x_bf, const void *w, int w_bf16,
                                   const float *rstd, i64 rows, int dim, int acc) {
	__shared__ double red[32];
	i64 row = blockIdx.x;
	rms_bwd_row(act_ptr(dx, dx_bf, row * dim), dx_bf, dxc ? dxc + row * dim : dxc, dout + row * dim, act_ptr(x, x_bf, row * dim), x_bf, w,
	            w_bf16, rstd[row], dim, threadIdx.x, blockDim.x, red, acc);
}

// rms_bwd_row8 is rms_bwd_row with 16-byte accesses (dim a multiple of 8,
// 16-byte aligned rows), for a group of `lanes` threads: a warp's aligned
// group (red null; ok false for lanes past the rows, which take part in
// the shuffles only) or the block (red, lanes = blockDim.x). dout and x
// stay in registers between the two passes; the dot's float64 sum is added
// in another fixed order, each element's math is rms_bwd_dot1 and
// rms_bwd1 as in rms_bwd_row. With dw set (the fused kernels below), the
// first pass also adds each element's term of RMSNorm's dw, k_colsum_part's
// dout·(x·rstd) in fp32, into the thread's float64 sums: element j of
// chunk k at dw[(8k + j)·dws].
DK_DEV void rms_bwd_row8(void *dx, int dx_bf, u16 *dxc, const float *d, const void *x, int x_bf, const void *w, int w_bf16, float rs,
                         int dim, int sub, int lanes, bool ok, double *red, int acc, double *dw = 0, int dws = 0) {
	int nc = dim / 8;
	float dv[RV_K][8], xv[RV_K][8];
	double dot = 0;
#pragma unroll
	for (int k = 0; k < RV_K; k++) {
		int c = sub + k * lanes;
		if (!ok || c >= nc) continue;
		float wv[8];
		ld8(dv[k], d, 0, c);
		ld8(xv[k], x, x_bf, c);
		ld8(wv, w, w_bf16, c);
#pragma unroll
		for (int j = 0; j < 8; j++) dot += (double)rms_bwd_dot1(dv[k][j], wv[j], xv[k][j], rs);
		if (dw) {
#pragma unroll
			for (int j = 0; j < 8; j++) dw[(8 * k + j) * dws] += (double)(dv[k][j] * (xv[k][j] * rs));
		}
	}
	dot = row_sum_d(dot, sub, lanes, red);
	float m = (float)(dot / dim);
#pragma unroll
	for (int k = 0; k < RV_K; k++) {
		int c = sub + k * lanes;
		if (!ok || c >= nc) continue;
		float wv[8], o[8];
		ld8(wv, w, w_bf16, c);
		if (acc) {
			ld8(o, dx, dx_bf, c);
		} else {
#pragma unroll
			for (int j = 0; j < 8; j++) o[j] = 0.0f;
		}
#pragma unroll
		for (int j = 0; j < 8; j++) o[j] = rms_bwd1(o[j], fresh(dv[k][j]), wv[j], fresh(xv[k][j]), rs, m);
		st8(dx, dx_bf, c, o);
		if (dxc) st8(dxc, 1, c, o);
	}
}

// k_rmsnorm_bwd_warp8 and k_rmsnorm_bwd_block8: the forward's 8-wide
// geometry (norm_rope.cu: k_rmsnorm_warp8, k_rmsnorm_block8).
DK_KERNEL void k_rmsnorm_bwd_warp8(void *dx, int dx_bf, u16 *dxc, const float *dout, const void *x, int x_bf, const void *w, int w_bf16,
                                   const float *rstd, i64 rows, int dim, int lanes, int acc) {
	int lane = threadIdx.x % DK_WARP;
	i64 row0 = ((i64)blockIdx.x * (blockDim.x / DK_WARP) + threadIdx.x / DK_WARP) * (DK_WARP / lanes);
	if (row0 >= rows) return; // a whole warp leaves together
	i64 row = row0 + lane / lanes;
	bool ok = row < rows;
	if (!ok) row = row0; // an address in range; nothing is read or written
	rms_bwd_row8(act_ptr(dx, dx_bf, row * dim), dx_bf, dxc ? dxc + row * dim : dxc, dout + row * dim, act_ptr(x, x_bf, row * dim), x_bf, w,
	             w_bf16, rstd[row], dim, lane % lanes, lanes, ok, 0, acc);
}

DK_KERNEL void k_rmsnorm_bwd_block8(void *dx, int dx_bf, u16 *dxc, const float *dout, const void *x, int x_bf, const void *w, int w_bf16,
                                    const float *rstd, i64 rows, int dim, int lanes, int acc) {
	__shared__ double red[32];
	i64 row = blockIdx.x;
	rms_bwd_row8(act_ptr(dx, dx_bf, row * dim), dx_bf, dxc ? dxc + row * dim : dxc, dout + row * dim, act_ptr(x, x_bf, row * dim), x_bf, w,
	             w_bf16, rstd[row], dim, threadIdx.x, lanes, true, red, acc);
}

// RMSNorm's backward with dw's column sums fused in (the default; the
// host's Options.RMSNormDW "colsum" runs the kernels above and then
// k_colsum_part4 instead, which reads dout and x a second time). Block b
// takes the rows [b·group, (b+1)·group) (group a function of rows and
// dim: rmsDWGroup in train.go), R = blockDim.x/lanes of them at a time,
// with k_rmsnorm_bwd_warp8's or _block8's row geometry: the thread at
// slot s = tid/lanes, sub = tid%lanes takes the rows r0 + s + R·i, i =
// 0, 1, ... in order, and adds each one's dw terms to float64 sums of its
// own in the dynamic shared memory (acc[(8k + j)·blockDim.x + tid] for
// element j of its chunk k, k < ku = ceil(dim/8 / lanes): a column's sums
// are its R slots', no two threads share one, and a warp's accesses are
// consecutive doubles). Then the block adds, per column, its R slots' sums
// in slot order into part[b] (dim doubles), and k_rmsnorm_dw_finish adds
// the blocks' partials in block order into dw. Every sum's order is fixed
// by rows and dim alone; the terms are k_colsum_part's. The block's red
// alternates between two halves from row to row, so that a row's
// row_sum_d does not overwrite what another thread may still read of the
// previous row's.
DK_DEV void rms_bwd_group8(void *dx, int dx_bf, u16 *dxc, const float *dout, const void *x, int x_bf, const void *w, int w_bf16,
                           const float *rstd, i64 rows, int dim, int lanes, int acc, double *__restrict__ part, int group, double *red) {
	DK_DYN_SMEM(double, sacc);
	int nt = blockDim.x, tid = threadIdx.x, sub = tid % lanes, slot = tid / lanes, R = nt / lanes;
	int nc = dim / 8, ku = (nc + lanes - 1) / lanes;
	for (int k = 0; k < ku; k++)
		for (int j = 0; j < 8; j++) sacc[(8 * k + j) * nt + tid] = 0;
	i64 r0 = (i64)blockIdx.x * group, r1 = lmin(r0 + group, rows);
	int it = 0;
	for (i64 base = r0; base < r1; base += R, it++) {
		i64 row = base + slot;
		bool ok = row < r1;
		if (!ok) row = r0; // an address in range; nothing is read or written
		rms_bwd_row8(act_ptr(dx, dx_bf, row * dim), dx_bf, dxc ? dxc + row * dim : dxc, dout + row * dim, act_ptr(x, x_bf, row * dim), x_bf,
		             w, w_bf16, rstd[row], dim, sub, lanes, ok, red ? red + DK_WARP * (it & 1) : red, acc, sacc + tid, nt);
	}
	__syncthreads();
	for (int col = tid; col < dim; col += nt) {
		int c = col / 8, j = col % 8;
		const double *p = sacc + (8 * (c / lanes) + j) * nt + c % lanes;
		double s = 0;
		for (int q = 0; q < R; q++) s += p[q * lanes];
		part[(i64)blockIdx.x * dim + col] = s;
	}
}

// k_rmsnorm_bwd_warp8_dw (lanes <= 32: R = 256/lanes rows at a time, a
// warp's aligned groups of lanes) and k_rmsnorm_bwd_block8_dw (lanes =
// blockDim.x: a row at a time): rms_bwd_group8 in
// k_rmsnorm_bwd_warp8's and _block8's geometry, 256 threads a block. The
// row loop keeps more in registers than the one-row kernels (about 160 a
// thread, NVRTC 11.8, sm_80 and sm_90, against their 90-96): bounded to
// 128 so that two blocks fit on an SM (the warp kernel then spills
// nothing, the block kernel a few dozen bytes).
DK_KERNEL __launch_bounds__(256, 2) void k_rmsnorm_bwd_warp8_dw(void *dx, int dx_bf, u16 *dxc, const float *dout, const void *x, int x_bf, const void *w, int w_bf16,
                                      const float *rstd, i64 rows, int dim, int lanes, int acc, double *__restrict__ part, int group) {
	rms_bwd_group8(dx, dx_bf, dxc, dout, x, x_bf, w, w_bf16, rstd, rows, dim, lanes, acc, part, group, 0);
}

DK_KERNEL __launch_bounds__(256, 2) void k_rmsnorm_bwd_block8_dw(void *dx, int dx_bf, u16 *dxc, const float *dout, const void *x, int x_bf, const void *w, int w_bf16,
                                       const float *rstd, i64 rows, int dim, int lanes, int acc, double *__restrict__ part, int group) {
	__shared__ double red[2 * DK_WARP];
	rms_bwd_group8(dx, dx_bf, dxc, dout, x, x_bf, w, w_bf16, rstd, rows, dim, lanes, acc, part, group, red);
}

// k_rmsnorm_dw_finish: dw (cols) += Σ over the np blocks' partials of
// k_rmsnorm_bwd_*8_dw, 256 threads a block of 32 columns: warp y sums the
// partials y, y + 8, y + 16, ... in order (a warp's loads are 32
// consecutive doubles), then the 8 warps' sums are added in warp order.
// k_colsum_finish's thread a column walks all np partials one after
// another; here 8 are in flight per column. The order is fixed by np.
DK_KERNEL void k_rmsnorm_dw_finish(float *__restrict__ dw, const double *__restrict__ part, int np, int cols) {
	__shared__ double red[8][DK_WARP];
	int lane = threadIdx.x % DK_WARP, wy = threadIdx.x / DK_WARP;
	int c = blockIdx.x * DK_WARP + lane;
	double s = 0;
	if (c < cols) {
#pragma unroll 4
		for (int p = wy; p < np; p += 8) s += part[(i64)p * cols + c];
	}
	red[wy][lane] = s;
	__syncthreads();
	if (wy != 0 || c >= cols) return;
	double t = 0;
	for (int y = 0; y < 8; y++) t += red[y][lane];
	dw[c] += (float)t;
}

// k_colsum_part: block (bx, by) sums, for the columns bx·blockDim.x + tid,
// rows [by·chunk, (by+1)·chunk) of src (rows, cols) into part (gridDim.y,
// cols), float64, in row order. With x and rstd set it sums
// src·x·rstd[row] (RMSNorm's dw: dout·xh; x BF16 when x_bf), else src (a
// bias's gradient); then, with copy set, it also writes copy (rows, cols)
// BF16 = the rounding of each element of src it reads (the GEMMs of a
// biased Linear's backward read it: no rounding pass of their own). Every
// element is read by one thread, so each is rounded once.
DK_KERNEL void k_colsum_part(double *__restrict__ part, const float *__restrict__ src, const void *__restrict__ x, int x_bf,
                             const float *__restrict__ rstd, i64 rows, int cols, int chunk, u16 *__restrict__ copy) {
	int c = blockIdx.x * blockDim.x + threadIdx.x;
	if (c >= cols) return;
	i64 r0 = (i64)blockIdx.y * chunk, r1 = lmin(r0 + chunk, rows);
	double s = 0;
	for (i64 r = r0; r < r1; r++) {
		float v = src[r * cols + c];
		if (copy) copy[r * cols + c] = f2bf(v);
		if (x) v = v * (ld_act(x, x_bf, r * cols + c) * rstd[r]);
		s += (double)v;
	}
	part[(i64)blockIdx.y * cols + c] = s;
}

// k_colsum_part4: k_colsum_part for cols a multiple of 4 and 16-byte
// aligned src and x (and 8-byte aligned copy), 256 threads a block: lane l
// of warp y sums the four columns 4·(32·bx + l) .. +3 (one 16-byte load
// of src, an 8-byte one of BF16 x, an 8-byte store of copy) over the rows
// r0 + y + 8k of the block's chunk, then the 8 warps' float64 sums are
// added in warp order into part. Each term is k_colsum_part's; the order
// of the sum is another, fixed by the shapes alone (deterministic), and 8
// rows are in flight per column where the scalar kernel walks the chunk
// one row after another.
DK_KERNEL void k_colsum_part4(double *__restrict__ part, const float *__restrict__ src, const void *__restrict__ x, int x_bf,
                              const float *__restrict__ rstd, i64 rows, int cols, int chunk, u16 *__restrict__ copy) {
	__shared__ double red[8][4 * DK_WARP];
	int lane = threadIdx.x % DK_WARP, wy = threadIdx.x / DK_WARP;
	int c4 = blockIdx.x * DK_WARP + lane; // this thread's group of 4 columns
	bool ok = c4 < cols / 4;
	i64 r0 = (i64)blockIdx.y * chunk, r1 = lmin(r0 + chunk, rows);
	double s[4] = {0, 0, 0, 0};
	if (ok) {
#pragma unroll 4
		for (i64 r = r0 + wy; r < r1; r += 8) {
			float v[4];
			ld4(v, src + r * cols, 0, c4);
			if (copy) {
				dk_u2 b;
				b.lo = (u32)f2bf(v[0]) | ((u32)f2bf(v[1]) << 16);
				b.hi = (u32)f2bf(v[2]) | ((u32)f2bf(v[3]) << 16);
				((dk_u2 *)(copy + r * cols))[c4] = b;
			}
			if (x) {
				float xv[4], rr = rstd[r];
				ld4(xv, act_ptr(x, x_bf, r * cols), x_bf, c4);
#pragma unroll
				for (int j = 0; j < 4; j++) v[j] = v[j] * (xv[j] * rr);
			}
#pragma unroll
			for (int j = 0; j < 4; j++) s[j] += (double)v[j];
		}
	}
#pragma unroll
	for (int j = 0; j < 4; j++) red[wy][4 * lane + j] = s[j];
	__syncthreads();
	if (wy != 0 || !ok) return;
#pragma unroll
	for (int j = 0; j < 4; j++) {
		double t = 0;
		for (int y = 0; y < 8; y++) t += red[y][4 * lane + j];
		part[(i64)blockIdx.y * cols + 4 * c4 + j] = t;
	}
}

// k_colsum_finish: dst (cols) += Σ over the np chunks of part, in order.
DK_KERNEL void k_colsum_finish(float *__restrict__ dst, const double *__restrict__ part, int np, int cols) {
	for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
		double s = 0;
		for (int p = 0; p < np; p++) s += part[(i64)p * cols + c];
		dst[c] += (float)s;
	}
}

// The embedding's backward: dtable (vocab, dim) += the rows of dout (n,
// dim) at ids, repeated ids adding up in token order without atomics:
// dtable[v][c] = (((dtable[v][c] + dout[t1][c]) + dout[t2][c]) + ...) over
// v's tokens t1 < t2 < ..., compute/cpu's serial walk bit for bit. A token
// at a time per column (a thread a column walking all n tokens: 3.34 ms of
// a Qwen3-0.6B step on an H200, 8192 tokens) leaves the GPU idle; instead
// each id's tokens are chained (k_embed_links), and each id's first token
// walks its own chain (k_embed_bwd): the same additions in the same
// order, one block a token, the columns across its threads.

// k_embed_links: per token t, next[t] = its id's next token (-1: none)
// and first[t] = 1 when no earlier token has its id. A thread a token
// scanning the ids (n is a batch's tokens: thousands).
DK_KERNEL void k_embed_links(i32 *__restrict__ next, i32 *__restrict__ first, const i32 *__restrict__ ids, i64 n) {
	for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += (i64)gridDim.x * blockDim.x) {
		i32 id = ids[t];
		i32 nx = -1;
		for (i64 u = t + 1; u < n; u++)
			if (ids[u] == id) {
				nx = (i32)u;
				break;
			}
		i32 f = 1;
		for (i64 u = t - 1; u >= 0; u--)
			if (ids[u] == id) {
				f = 0;
				break;
			}
		next[t] = nx;
		first[t] = f;
	}
}

// k_embed_bwd: a block a token t (grid-stride); when t is its id's first,
// thread c adds the rows of the id's chain to dtable[id][c], in order.
DK_KERNEL void k_embed_bwd(float *dtable, const float *__restrict__ dout, const i32 *__restrict__ ids, const i32 *__restrict__ next,
                           const i32 *__restrict__ first, i64 n, int dim) {
	for (i64 t = blockIdx.x; t < n; t += gridDim.x) {
		if (!first[t]) continue; // the whole block: t is the same for all its threads
		float *row = dtable + (i64)ids[t] * dim;
		for (int c = threadIdx.x; c < dim; c += blockDim.x) {
			float acc = row[c];
			for (i64 u = t; u >= 0; u = next[u]) acc += dout[u * dim + c];
			row[c] = acc;
		}
	}
}

DK_REGISTER(k_swiglu_bwd)
DK_REGISTER(k_swiglu_bwd_x8)
DK_REGISTER(k_rmsnorm_bwd_warp8)
DK_REGISTER(k_rmsnorm_bwd_block8)
DK_REGISTER(k_rmsnorm_bwd_warp8_dw)
DK_REGISTER(k_rmsnorm_bwd_block8_dw)
DK_REGISTER(k_rmsnorm_dw_finish)
DK_REGISTER(k_colsum_part4)
DK_REGISTER(k_rope_table_bwd)
DK_REGISTER(k_rmsnorm_bwd_warp)
DK_REGISTER(k_rmsnorm_bwd_block)
DK_REGISTER(k_colsum_part)
DK_REGISTER(k_colsum_finish)
DK_REGISTER(k_embed_links)
DK_REGISTER(k_embed_bwd)
