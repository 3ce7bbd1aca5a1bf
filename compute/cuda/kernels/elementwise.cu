// Elementwise kernels: dtype conversion, SwiGLU, residual add, bias, dropout, the
// embedding gather. All are grid-stride loops over a flat index; the host
// picks the grid (geometry.go: elementwiseGrid).

// out (n) BF16 = round(in (n) F32): the activations a cuBLASLt GEMM reads.
DK_KERNEL void k_f32_to_bf16(u16 *__restrict__ out, const float *__restrict__ in, i64 n) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) out[i] = f2bf(in[i]);
}

// The same four at a time, for buffers the host found 16-byte (F32) and
// 8-byte (BF16) aligned, n4 = n/4 groups: one 16-byte load and one 8-byte
// store per group, the conversion passes' memory bandwidth instead of a
// scalar access per element (dk_f4, dk_u2: prelude.cuh).
DK_KERNEL void k_f32_to_bf16_x4(dk_u2 *__restrict__ out, const dk_f4 *__restrict__ in, i64 n4) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (i64)gridDim.x * blockDim.x) {
		dk_f4 v = in[i];
		dk_u2 r;
		r.lo = (u32)f2bf(v.x) | ((u32)f2bf(v.y) << 16);
		r.hi = (u32)f2bf(v.z) | ((u32)f2bf(v.w) << 16);
		out[i] = r;
	}
}



DK_KERNEL void k_bf16_to_f32_x4(dk_f4 *__restrict__ out, const dk_u2 *__restrict__ in, i64 n4) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (i64)gridDim.x * blockDim.x) {
		dk_u2 v = in[i];
		dk_f4 r;
		r.x = bf2f((u16)(v.lo & 0xffff));
		r.y = bf2f((u16)(v.lo >> 16));
		r.z = bf2f((u16)(v.hi & 0xffff));
		r.w = bf2f((u16)(v.hi >> 16));
		out[i] = r;
	}
}

// a (4·n4) F32 += b (4·n4) BF16, four at a time (alignment as above).
DK_KERNEL void k_add_bf16_x4(dk_f4 *__restrict__ a, const dk_u2 *__restrict__ b, i64 n4) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (i64)gridDim.x * blockDim.x) {
		dk_u2 v = b[i];
		dk_f4 r = a[i];
		r.x += bf2f((u16)(v.lo & 0xffff));
		r.y += bf2f((u16)(v.lo >> 16));
		r.z += bf2f((u16)(v.hi & 0xffff));
		r.w += bf2f((u16)(v.hi >> 16));
		a[i] = r;
	}
}

// out (n) F32 = in (n) BF16, exactly.
DK_KERNEL void k_bf16_to_f32(float *__restrict__ out, const u16 *__restrict__ in, i64 n) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) out[i] = bf2f(in[i]);
}

// out (n) = silu(gate)·up, each BF16 (its flag set) or F32. out may alias
// gate (of the same dtype): each element is read before it is written.
DK_KERNEL void k_swiglu(void *out, int out_bf, const void *gate, int gate_bf, const void *__restrict__ up, int up_bf, i64 n) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
		st_act(out, out_bf, i, swiglu1(ld_act(gate, gate_bf, i), ld_act(up, up_bf, i)));
}

// k_swiglu eight elements at a time, for n = 8·n8 and out, gate and up
// 16-byte aligned (the host checks): one 16-byte access per tensor and
// group when it is BF16, two when F32, instead of a 2- or 4-byte access per
// element with its dtype branch. Each element's math is swiglu1, as in
// k_swiglu, so the bits are the same. out may alias gate (same dtype): a
// group is read whole before it is written.
DK_KERNEL void k_swiglu_x8(void *out, int out_bf, const void *gate, int gate_bf, const void *__restrict__ up, int up_bf, i64 n8) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (i64)gridDim.x * blockDim.x) {
		float g[8], u[8], o[8];
		ld8(g, gate, gate_bf, i);
		ld8(u, up, up_bf, i);
#pragma unroll
		for (int j = 0; j < 8; j++) o[j] = swiglu1(g[j], u[j]);
		st8(out, out_bf, i, o);
	}
}

// a (n) += b (n).
DK_KERNEL void k_add(float *a, const float *b, i64 n) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) a[i] += b[i];
}

// a (n) BF16 += b (n) F32, rounded once: a LoRA adapter's term into its
// Linear's BF16 output.
DK_KERNEL void k_add_to_act(u16 *a, const float *__restrict__ b, i64 n) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) a[i] = f2bf(bf2f(a[i]) + b[i]);
}

// a (n) F32 += b (n) BF16: cuDNN's attention gradients into the contract's.
DK_KERNEL void k_add_bf16(float *__restrict__ a, const u16 *__restrict__ b, i64 n) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) a[i] += bf2f(b[i]);
}

// a (n) BF16 += b (n) BF16, the fp32 sum rounded once: cuDNN's BF16
// attention gradient into a BF16 gradient (dv, which only v_proj's
// backward GEMM reads); a zeroed a gets b itself.
DK_KERNEL void k_add_bf16_act(u16 *__restrict__ a, const u16 *__restrict__ b, i64 n) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) a[i] = f2bf(bf2f(a[i]) + bf2f(b[i]));
}

// The same four at a time (8-byte aligned a and b, n4 = n/4 groups).
DK_KERNEL void k_add_bf16_act_x4(dk_u2 *__restrict__ a, const dk_u2 *__restrict__ b, i64 n4) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (i64)gridDim.x * blockDim.x) {
		dk_u2 x = a[i], y = b[i], r;
		r.lo = (u32)f2bf(bf2f((u16)(x.lo & 0xffff)) + bf2f((u16)(y.lo & 0xffff))) |
		       ((u32)f2bf(bf2f((u16)(x.lo >> 16)) + bf2f((u16)(y.lo >> 16))) << 16);
		r.hi = (u32)f2bf(bf2f((u16)(x.hi & 0xffff)) + bf2f((u16)(y.hi & 0xffff))) |
		       ((u32)f2bf(bf2f((u16)(x.hi >> 16)) + bf2f((u16)(y.hi >> 16))) << 16);
		a[i] = r;
	}
}

// out (rows, n) = in (rows, n) F32 + bias (n), bias BF16 or F32, out BF16
// (rounded once: a GEMM's fp32 result with its bias) or F32 (in may be
// out: each element is read before it is written).
DK_KERNEL void k_add_bias(void *out, int out_bf, const float *in, const void *__restrict__ bias, int bias_bf16, i64 rows, int n) {
	i64 total = rows * (i64)n;
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x)
		st_act(out, out_bf, i, in[i] + load_w(bias, bias_bf16, i % n));
}

// out (n, dim) F32 = table[ids[i]] (vocab, dim), table BF16 or F32. Ids are
// trusted (the caller validated them against the vocabulary).
DK_KERNEL void k_embed(float *__restrict__ out, const void *__restrict__ table, int table_bf16, const i32 *__restrict__ ids, i64 n,
                       int dim) {
	i64 total = n * (i64)dim;
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
		i64 r = i / dim;
		int c = (int)(i - r * dim);
		out[i] = load_w(table, table_bf16, (i64)ids[r] * dim + c);
	}
}

// philox4x32 and dropout_words (the masks) are in prelude.cuh: the MoE
// adapters' kernels (moelora.cu) draw the same masks.

// out (rows, cols) (act) = x·scale where kept, else 0; the product fp32,
// a BF16 out rounded once (compute's Dropout). order: see above (NULL:
// row r is token r).
DK_KERNEL void k_dropout(void *__restrict__ out, int out_bf, const void *__restrict__ x, int x_bf, const int *__restrict__ order, int K,
                         i64 rows, int cols, int k0, int k1, int row, int step, int thr, float scale) {
	int g4 = (cols + 3) / 4;
	i64 total = rows * (i64)g4;
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
		i64 r = i / g4;
		int g = (int)(i - r * g4);
		u32 w[4];
		dropout_words(w, r, g, order, K, row, step, k0, k1);
		for (int j = 0; j < 4 && 4 * g + j < cols; j++) {
			i64 e = r * cols + 4 * g + j;
			st_act(out, out_bf, e, w[j] >= (u32)thr ? __fmul_rn(ld_act(x, x_bf, e), scale) : 0.0f);
		}
	}
}

// dx (rows, cols) F32 += dout·scale where kept (compute's
// DropoutBackward): the product rounded before the sum, as compute/cpu
// (no fused multiply-add), so the two agree bit for bit. order: as
// k_dropout's.
DK_KERNEL void k_dropout_bwd(float *__restrict__ dx, const float *__restrict__ dout, const int *__restrict__ order, int K, i64 rows, int cols,
                             int k0, int k1, int row, int step, int thr, float scale) {
	int g4 = (cols + 3) / 4;
	i64 total = rows * (i64)g4;
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
		i64 r = i / g4;
		int g = (int)(i - r * g4);
		u32 w[4];
		dropout_words(w, r, g, order, K, row, step, k0, k1);
		for (int j = 0; j < 4 && 4 * g + j < cols; j++) {
			i64 e = r * cols + 4 * g + j;
			if (w[j] >= (u32)thr) dx[e] += __fmul_rn(dout[e], scale);
		}
	}
}

DK_REGISTER(k_f32_to_bf16)
DK_REGISTER(k_bf16_to_f32)
DK_REGISTER(k_f32_to_bf16_x4)
DK_REGISTER(k_bf16_to_f32_x4)
DK_REGISTER(k_add_bf16_x4)
DK_REGISTER(k_swiglu)
DK_REGISTER(k_swiglu_x8)
DK_REGISTER(k_add)
DK_REGISTER(k_add_to_act)
DK_REGISTER(k_add_bf16)
DK_REGISTER(k_add_bf16_act)
DK_REGISTER(k_add_bf16_act_x4)
DK_REGISTER(k_add_bias)
DK_REGISTER(k_embed)
DK_REGISTER(k_dropout)
DK_REGISTER(k_dropout_bwd)
