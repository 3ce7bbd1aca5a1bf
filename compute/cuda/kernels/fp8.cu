// FP8 weights (compute's package doc, "FP8 weights"): the quantization of
// a GEMM's input rows to E4M3 codes with a scale per row, bit for bit
// compute.FP8QuantizeRow, and the epilogue that turns the FP8 GEMM's fp32
// sums of the codes' products into the output (fp8.go). The GEMM itself is
// cuBLASLt's, on the FP8 tensor cores.

#define FP8_THREADS 256

// fp8_code is the E4M3FN byte of v's rounding (compute.E4M3Byte of
// compute.E4M3(v)): the sign, then from the rounded magnitude r (an E4M3
// value, exact in fp32) its subnormal mantissa r·2^9 below 2^-6, else its
// exponent rebiased from 127 to 7 and its top 3 mantissa bits. NaN is
// 0x7f (with v's sign).
DK_DEV unsigned char fp8_code(float v) {
	u32 s = (__float_as_uint(v) >> 24) & 0x80u;
	float r = e4m3(fabsf(v));
	if (r != r) return (unsigned char)(s | 0x7fu);
	u32 c;
	if (r < 0.015625f) {
		c = (u32)(r * 512.0f);
	} else {
		u32 b = __float_as_uint(r);
		c = ((((b >> 23) & 0xffu) - 120u) << 3) | ((b >> 20) & 7u);
	}
	return (unsigned char)(s | c);
}

// k_fp8_quant_rows: codes (rows, cols), scales (rows) F32 = x (rows, cols)
// (act) quantized per row: t = amax/448 (1 when amax is 0; NaN
// propagates, as Go's max), code = E4M3(x/t), the division correctly
// rounded (NVRTC's default -prec-div). One block of FP8_THREADS per row;
// the row maximum in a fixed tree (exact in any order: a max).
DK_KERNEL __launch_bounds__(FP8_THREADS) void k_fp8_quant_rows(unsigned char *__restrict__ codes, float *__restrict__ scales,
                                                                const void *__restrict__ x, int x_bf, int cols) {
	__shared__ float red[FP8_THREADS];
	i64 r = blockIdx.x;
	float m = 0;
	for (int c = threadIdx.x; c < cols; c += FP8_THREADS) m = nanmax(m, fabsf(ld_act(x, x_bf, r * cols + c)));
	red[threadIdx.x] = m;
	__syncthreads();
	for (int s = FP8_THREADS / 2; s > 0; s >>= 1) {
		if ((int)threadIdx.x < s) red[threadIdx.x] = nanmax(red[threadIdx.x], red[threadIdx.x + s]);
		__syncthreads();
	}
	float amax = red[0];
	float t = amax == 0 ? 1.0f : amax / 448.0f;
	if (threadIdx.x == 0) scales[r] = t;
	for (int c = threadIdx.x; c < cols; c += FP8_THREADS) codes[r * cols + c] = fp8_code(ld_act(x, x_bf, r * cols + c) / t);
}

// k_fp8_gather: codes_g (P, H) and scales_g (P) = the rows of codes (T, H)
// and scales (T) of each grouped row's token (order[p]/K): an MoE's
// experts' input, quantized once per token (the same codes as quantizing
// each gathered row).
DK_KERNEL void k_fp8_gather(unsigned char *__restrict__ codes_g, float *__restrict__ scales_g, const unsigned char *__restrict__ codes,
                            const float *__restrict__ scales, const i32 *__restrict__ order, i64 P, int K, int H) {
	i64 total = P * (i64)H;
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
		i64 p = i / H;
		int c = (int)(i - p * H);
		i64 t = order[p] / K;
		codes_g[i] = codes[t * H + c];
		if (c == 0) scales_g[p] = scales[t];
	}
}

// k_fp8_scale: out (rows, n) = acc (rows, n) F32 · xs[r] · ws[c] (+ bias[c]),
// the products unfused in that order, then the bias; a BF16 out (out_bf)
// rounded once. acc is the FP8 GEMM's sum of the codes' products; xs the
// rows' scales, ws the weight's per-channel scales; bias BF16 (bias_bf) or
// F32, or null. out may be acc (F32): each element is read before it is
// written.
DK_KERNEL void k_fp8_scale(void *out, int out_bf, const float *acc, const float *__restrict__ xs, const float *__restrict__ ws,
                           const void *__restrict__ bias, int bias_bf, i64 rows, int n) {
	i64 total = rows * (i64)n;
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
		i64 r = i / n;
		int c = (int)(i - r * n);
		float v = __fmul_rn(__fmul_rn(acc[i], xs[r]), ws[c]);
		if (bias) v += load_w(bias, bias_bf, c);
		st_act(out, out_bf, i, v);
	}
}

DK_REGISTER(k_fp8_quant_rows)
DK_REGISTER(k_fp8_gather)
DK_REGISTER(k_fp8_scale)
