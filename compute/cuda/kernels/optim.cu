// The optimizer and NVFP4 kernels of training: AdamW, the gradient's sum of
// squares (global norm, NaN check), scaling (clipping), absmax
// (calibration) and NVFP4 fake quantization. Every reduction is
// deterministic: a fixed grid (a function of n only) of per-thread partial
// sums in a grid-stride loop, a fixed-order tree in each block, and one
// block that combines the blocks' partials in index order. No atomics, so
// the same inputs give the same bits on every run (the resume test).

#define RED_THREADS 256
#define RED_BLOCKS 1024 // at most; the host sizes the grid (plan.go: reduceGrid)

// One torch.optim.AdamW update in place, as compute/cpu's k_adamw (see
// compute.AdamWStep): p·decay, then the moments, then the step. pb, when
// not null, receives the BF16 rounding of the updated p (f2bf, the bits
// k_f32_to_bf16 would make of it): the weight's shadow, the operand the
// GEMMs of the next step read (shadow.go). One kernel either way, so the
// fp32 update is the same code with or without the shadow.
DK_DEV void adamw_elem(float *__restrict__ p, const float *__restrict__ g, float *__restrict__ m, float *__restrict__ v, i64 i, float b1,
                       float b2, float eps, float step, float bc2, float decay, u16 *__restrict__ pb) {
	float x = g[i];
	float pi = p[i] * decay;
	float mi = b1 * m[i] + (1 - b1) * x;
	float vi = b2 * v[i] + (1 - b2) * x * x;
	m[i] = mi;
	v[i] = vi;
	float np = pi - step * mi / (sqrtf(vi) / bc2 + eps);
	p[i] = np;
	if (pb) pb[i] = f2bf(np);
}

DK_KERNEL void k_adamw(float *__restrict__ p, const float *__restrict__ g, float *__restrict__ m, float *__restrict__ v, i64 n, float b1,
                       float b2, float eps, float step, float bc2, float decay, u16 *__restrict__ pb) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
		adamw_elem(p, g, m, v, i, b1, b2, eps, step, bc2, decay, pb);
}

// x (n) *= c. One rounding, as the CPU: the results are bit-identical.
DK_KERNEL void k_scale(float *x, i64 n, float c) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) x[i] *= c;
}

// block_sum_d: the sum of one double per thread of a RED_THREADS block, in a
// fixed tree order; thread 0 gets it. red: RED_THREADS doubles.
DK_DEV double block_sum_d(double v, double *red) {
	red[threadIdx.x] = v;
	__syncthreads();
	for (int s = RED_THREADS / 2; s > 0; s >>= 1) {
		if ((int)threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
		__syncthreads();
	}
	return red[0];
}

DK_DEV float block_max(float v, float *red) {
	red[threadIdx.x] = v;
	__syncthreads();
	for (int s = RED_THREADS / 2; s > 0; s >>= 1) {
		if ((int)threadIdx.x < s) red[threadIdx.x] = nanmax(red[threadIdx.x], red[threadIdx.x + s]);
		__syncthreads();
	}
	return red[0];
}

// k_sumsq_part: part[blockIdx.x] = Σ x² over the block's grid-stride share
// of x (n), in float64. NaN and Inf propagate.
DK_KERNEL __launch_bounds__(RED_THREADS) void k_sumsq_part(double *__restrict__ part, const float *__restrict__ x, i64 n) {
	__shared__ double red[RED_THREADS];
	double s = 0;
	for (i64 i = (i64)blockIdx.x * RED_THREADS + threadIdx.x; i < n; i += (i64)gridDim.x * RED_THREADS) {
		double v = x[i];
		s += v * v;
	}
	s = block_sum_d(s, red);
	if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// k_sum_finish: one block; out[0] = Σ part[0..np) in a fixed tree order.
DK_KERNEL __launch_bounds__(RED_THREADS) void k_sum_finish(double *__restrict__ out, const double *__restrict__ part, int np) {
	__shared__ double red[RED_THREADS];
	double s = 0;
	for (int i = threadIdx.x; i < np; i += RED_THREADS) s += part[i];
	s = block_sum_d(s, red);
	if (threadIdx.x == 0) out[0] = s;
}

// k_absmax_part: part[blockIdx.x] = max |x| over the block's share, NaN if
// the share holds a NaN (a calibration that saw NaN must fail loudly). x
// is BF16 (x_bf) or F32.
DK_KERNEL __launch_bounds__(RED_THREADS) void k_absmax_part(float *__restrict__ part, const void *__restrict__ x, int x_bf, i64 n) {
	__shared__ float red[RED_THREADS];
	float m = 0;
	for (i64 i = (i64)blockIdx.x * RED_THREADS + threadIdx.x; i < n; i += (i64)gridDim.x * RED_THREADS)
		m = nanmax(m, fabsf(ld_act(x, x_bf, i)));
	m = block_max(m, red);
	if (threadIdx.x == 0) part[blockIdx.x] = m;
}

// k_max_finish: one block; out[0] = the NaN-propagating max of part[0..np).
DK_KERNEL __launch_bounds__(RED_THREADS) void k_max_finish(float *__restrict__ out, const float *__restrict__ part, int np) {
	__shared__ float red[RED_THREADS];
	float m = 0;
	for (int i = threadIdx.x; i < np; i += RED_THREADS) m = nanmax(m, part[i]);
	m = block_max(m, red);
	if (threadIdx.x == 0) out[0] = m;
}

// --- NVFP4 fake quantization, bit for bit the scalar definitions of
// compute/fp4.go (ModelOpt's): every operation below is the same fp32
// operation in the same order, with no a·b+c that the compiler could fuse.

// e2m1 rounds a scaled magnitude to {0,.5,1,1.5,2,3,4,6} with ModelOpt's
// thresholds (compute.E2M1).
DK_DEV float e2m1(float a) {
	if (a <= 0.25f) return 0;
	if (a < 0.75f) return 0.5f;
	if (a <= 1.25f) return 1;
	if (a < 1.75f) return 1.5f;
	if (a <= 2.5f) return 2;
	if (a < 3.5f) return 3;
	if (a <= 5) return 4;
	return 6;
}

// nvfp4_scale is a 16-element block's scale from its amax bm and the
// per-tensor g: its E4M3 rounding of bm/(6g), clamped at 448, times g (1
// when that falls below 1e-5), as compute's NVFP4 definitions.
DK_DEV float nvfp4_scale(float bm, float g) {
	float gs = g > 0 ? g : 1e-12f;
	float t = bm / (6.0f * gs);
	if (!(t != t) && !(t < 448.0f)) t = 448.0f; // Go's min(t, 448): NaN stays NaN
	float sc = e4m3(t) * g;
	return sc >= 1e-5f ? sc : 1;
}

// nvfp4_quant is v fake-quantized with its block's scale sc: E2M1 of
// |v|/sc, times sc, with v's sign.
DK_DEV float nvfp4_quant(float v, float sc) {
	float q = e2m1(fabsf(v) / sc) * sc;
	return v >= 0 ? q : -q;
}

// k_fakequant_nvfp4: src, dst (rows, cols); one thread per 16-element block
// of a row (the row's last block may be shorter: zero-padded, as the Triton
// kernel). g is the per-tensor scale amax/(6·448), computed on the host as
// compute.NVFP4GlobalScale does. dst may alias src: a thread reads its
// block before writing it. db, when not null, receives the BF16 rounding
// of dst (f2bf): a fake-quantized weight's shadow, the GEMMs' operand
// (shadow.go). src and dst are BF16 (their flag set: activations) or F32.
DK_KERNEL void k_fakequant_nvfp4(void *dst, int dst_bf, const void *src, int src_bf, i64 rows, int cols, float g, u16 *db) {
	int nb = (cols + 15) / 16;
	i64 total = rows * (i64)nb;
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
		i64 r = i / nb;
		int b0 = (int)(i - r * nb) * 16;
		int len = imin(16, cols - b0);
		i64 at = r * cols + b0;
		float v[16];
		float bm = 0;
		for (int j = 0; j < len; j++) {
			v[j] = ld_act(src, src_bf, at + j);
			bm = nanmax(bm, fabsf(v[j]));
		}
		float sc = nvfp4_scale(bm, g);
		for (int j = 0; j < len; j++) {
			float o = nvfp4_quant(v[j], sc);
			st_act(dst, dst_bf, at + j, o);
			if (db) db[at + j] = f2bf(o);
		}
	}
}

// k_fakequant_nvfp4_lanes is k_fakequant_nvfp4 for cols % 16 == 0 (every
// block whole): a thread per element, a 16-element block on 16 lanes of a
// warp, its amax by shuffles (nanmax: the same value in any order), so
// that a warp reads and writes 32 consecutive elements at a time. The
// thread-per-block kernel read each 64-byte block on one thread, from a
// local array: 25x the bytes' time on the H200 (57 ms a 1.7B QAD step).
// Every element's arithmetic is the same: the same bits. n = rows·cols.
DK_KERNEL void k_fakequant_nvfp4_lanes(void *dst, int dst_bf, const void *src, int src_bf, i64 n, float g, u16 *db) {
	int lane = threadIdx.x % DK_WARP;
	// A warp's lanes hold consecutive elements and leave the loop together
	// (the stride is a multiple of 32): the shuffles see whole blocks.
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i - lane < n; i += (i64)gridDim.x * blockDim.x) {
		float v = i < n ? ld_act(src, src_bf, i) : 0.0f;
		float bm = nanmax(0.0f, fabsf(v));
		for (int o = 8; o > 0; o >>= 1) bm = nanmax(bm, __shfl_xor_sync(DK_FULL, bm, o));
		float sc = nvfp4_scale(bm, g);
		if (i < n) {
			float o = nvfp4_quant(v, sc);
			st_act(dst, dst_bf, i, o);
			if (db) db[i] = f2bf(o);
		}
	}
}

// Multi-tensor launches (apex's multi_tensor_apply, torch's foreach and
// fused optimizers): one launch works on a list of tensors, described by
// a table on the device of MT_W i64 words a tensor, and each block finds
// its tensor by a binary search over the tensors' first blocks. A
// student's optimizer step was 310 launches of k_adamw (and clipping 620
// of the sum of squares, 310 of k_scale) for a Qwen3-0.6B student, most
// of them on tensors of a few thousand elements, where the GPU waited on
// the host's launches. The per-element arithmetic, and each tensor's
// reduction partition and tree, are those of the single-tensor kernels:
// the same bits.
#define MT_W 8     // i64 words a tensor: see each kernel
#define MT_CHUNK 2048 // elements a block of an elementwise multi-tensor kernel

// mt_find: the tensor of block b, whose first block is tab[t*MT_W + at].
DK_DEV int mt_find(const i64 *__restrict__ tab, int nt, int at, i64 b) {
	int lo = 0, hi = nt - 1;
	while (lo < hi) {
		int mid = (lo + hi + 1) / 2;
		if (tab[(i64)mid * MT_W + at] <= b) lo = mid;
		else hi = mid - 1;
	}
	return lo;
}

// k_adamw_multi: k_adamw over nt tensors; a tensor's row is p, g, m, v,
// pb (its BF16 shadow or 0), n, decays (1: the step's decay applies, 0:
// none), first block. decay is the step's 1 - lr·wd.
DK_KERNEL void k_adamw_multi(const i64 *__restrict__ tab, int nt, float b1, float b2, float eps, float step, float bc2, float decay) {
	int t = mt_find(tab, nt, 7, blockIdx.x);
	const i64 *r = tab + (i64)t * MT_W;
	float *p = (float *)r[0], *m = (float *)r[2], *v = (float *)r[3];
	const float *g = (const float *)r[1];
	u16 *pb = (u16 *)r[4];
	i64 n = r[5];
	float dc = r[6] ? decay : 1.0f;
	i64 end = ((i64)blockIdx.x - r[7] + 1) * MT_CHUNK;
	if (end > n) end = n;
	for (i64 i = ((i64)blockIdx.x - r[7]) * MT_CHUNK + threadIdx.x; i < end; i += blockDim.x)
		adamw_elem(p, g, m, v, i, b1, b2, eps, step, bc2, dc, pb);
}

// k_scale_multi: k_scale over nt tensors; a row is x, n, first block.
DK_KERNEL void k_scale_multi(const i64 *__restrict__ tab, int nt, float c) {
	int t = mt_find(tab, nt, 2, blockIdx.x);
	const i64 *r = tab + (i64)t * MT_W;
	float *x = (float *)r[0];
	i64 end = ((i64)blockIdx.x - r[2] + 1) * MT_CHUNK;
	if (end > r[1]) end = r[1];
	for (i64 i = ((i64)blockIdx.x - r[2]) * MT_CHUNK + threadIdx.x; i < end; i += blockDim.x) x[i] *= c;
}

// k_copy_multi: dst = src over nt F32 tensors; a row is dst, src, n,
// first block.
DK_KERNEL void k_copy_multi(const i64 *__restrict__ tab, int nt) {
	int t = mt_find(tab, nt, 3, blockIdx.x);
	const i64 *r = tab + (i64)t * MT_W;
	float *d = (float *)r[0];
	const float *x = (const float *)r[1];
	i64 end = ((i64)blockIdx.x - r[3] + 1) * MT_CHUNK;
	if (end > r[2]) end = r[2];
	for (i64 i = ((i64)blockIdx.x - r[3]) * MT_CHUNK + threadIdx.x; i < end; i += blockDim.x) d[i] = x[i];
}

// k_sumsq_multi: k_sumsq_part over nt tensors, each on its own grid of
// nb blocks (reduceGrid(n)) as k_sumsq_part runs it alone; a row is x, n,
// nb, first block (= its partials' offset in part).
DK_KERNEL __launch_bounds__(RED_THREADS) void k_sumsq_multi(double *__restrict__ part, const i64 *__restrict__ tab, int nt) {
	__shared__ double red[RED_THREADS];
	int t = mt_find(tab, nt, 3, blockIdx.x);
	const i64 *r = tab + (i64)t * MT_W;
	const float *x = (const float *)r[0];
	i64 n = r[1], nb = r[2], blk = (i64)blockIdx.x - r[3];
	double s = 0;
	for (i64 i = blk * RED_THREADS + threadIdx.x; i < n; i += nb * RED_THREADS) {
		double v = x[i];
		s += v * v;
	}
	s = block_sum_d(s, red);
	if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// k_sum_finish_multi: k_sum_finish of each tensor's partials, a block a
// tensor (blockIdx.x = t, the row of k_sumsq_multi's table): out[t].
DK_KERNEL __launch_bounds__(RED_THREADS) void k_sum_finish_multi(double *__restrict__ out, const double *__restrict__ part, const i64 *__restrict__ tab) {
	__shared__ double red[RED_THREADS];
	const i64 *r = tab + (i64)blockIdx.x * MT_W;
	const double *pt = part + r[3];
	int np = (int)r[2];
	double s = 0;
	for (int i = threadIdx.x; i < np; i += RED_THREADS) s += pt[i];
	s = block_sum_d(s, red);
	if (threadIdx.x == 0) out[blockIdx.x] = s;
}

DK_REGISTER(k_adamw_multi)
DK_REGISTER(k_scale_multi)
DK_REGISTER(k_copy_multi)
DK_REGISTER(k_sumsq_multi)
DK_REGISTER(k_sum_finish_multi)
DK_REGISTER(k_adamw)
DK_REGISTER(k_scale)
DK_REGISTER(k_sumsq_part)
DK_REGISTER(k_sum_finish)
DK_REGISTER(k_absmax_part)
DK_REGISTER(k_max_finish)
DK_REGISTER(k_fakequant_nvfp4)
DK_REGISTER(k_fakequant_nvfp4_lanes)
