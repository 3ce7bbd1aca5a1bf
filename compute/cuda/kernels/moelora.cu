// The LoRA adapters on an MoE block's experts (compute.MoEWeights.Adapters;
// the host side is moe_lora.go), over the grouped rows on the device's own
// grouping: no expert's row count reaches the host, and each product is
// one launch for every expert of a projection, however many there are.
//
// Per adapter, over its expert's grouped rows (compute.LoRA's terms, PEFT's
// semantics; fp32 math on the fp32 adapters and the BF16 rows widened, so
// that a term carries no rounding beyond its inputs'):
//
//	forward   t  = Scale·drop(x)·Aᵀ     (rows, r)    k_moelora_rows_nt16
//	          out += t·Bᵀ               (rows, out)  k_moelora_rows_nt64
//	backward  t  again, then
//	          DB += doutᵀ·t             (out, r)     k_moelora_wgrad_64x16
//	          dt = Scale·dout·B         (rows, r)    k_moelora_rows_nn16
//	          DA += dtᵀ·drop(x)         (r, in)      k_moelora_wgrad_16x64
//	          dx += drop'(dt·A)         (rows, in)   k_moelora_rows_nn64
//
// The experts' adapters come from a table of MLR_WORDS u64 words an expert
// (the host's moeLoRA.table): A, B, DA, DB (A 0: the expert has no
// adapter on this projection, its rows are skipped and its gradients left
// alone), the scale and the rank, the dropout's key, threshold and scale.
// The dropout is applied where an operand is staged (drop(x) as the tiles
// of x are loaded, drop' in dx's epilogue), with the expert's own key and
// each grouped row's token (order[row] / topk): the masks of k_dropout
// over the same rows (compute.MoEWeights.Drop), with no masked copy of x.
//
// Determinism: every output element is one thread's sum in a fixed order
// (ascending k; for DA and DB ascending grouped rows of the expert, a
// block owning its tile of one expert's gradient). No atomics.

#define MLR_BM 64 // the rows of a row tile (k_moelora_tiles)
#define MLR_THREADS 256
#define MLR_BK 32   // a sum's step: k (the row kernels) or rows (the gradients)
#define MLR_WORDS 8 // u64 words of an expert's entry in the table

// mlr_ad is an expert's entry of the table: w[0..3] = A (r, in), B (out,
// r), DA, DB (F32; A null: no adapter); word 4 the scale's bits | rank <<
// 32; word 5 the dropout key k0 | k1 << 32; word 6 the threshold | the
// dropout's scale's bits << 32; word 7 nonzero when the adapter drops out.
struct mlr_ad {
	float *w[4];
	float scale, dscale;
	u32 k0, k1, thr;
	int rank, drop;
};

DK_DEV mlr_ad mlr_get(const u64 *tab, int e) {
	const u64 *p = tab + (i64)e * MLR_WORDS;
	mlr_ad a;
	for (int i = 0; i < 4; i++) a.w[i] = (float *)p[i];
	a.scale = __uint_as_float((u32)p[4]);
	a.rank = (int)(p[4] >> 32);
	a.k0 = (u32)p[5];
	a.k1 = (u32)(p[5] >> 32);
	a.thr = (u32)p[6];
	a.dscale = __uint_as_float((u32)(p[6] >> 32));
	a.drop = p[7] != 0;
	return a;
}

// mlr_drop is where the masks are: each grouped row's pair (order), the
// top-k, and the training row's place (MoEDrop's Row and Step).
struct mlr_drop {
	const i32 *order;
	int topk, row, step;
};

// k_moelora_tiles: tile_start (E+1) = each expert's first row tile of
// MLR_BM rows over the grouping offsets (E+1). One thread, in expert
// order: exact.
DK_KERNEL void k_moelora_tiles(const i32 *__restrict__ offsets, int E, i32 *__restrict__ tile_start) {
	if (threadIdx.x != 0 || blockIdx.x != 0) return;
	i32 t = 0;
	for (int e = 0; e < E; e++) {
		tile_start[e] = t;
		t += (offsets[e + 1] - offsets[e] + MLR_BM - 1) / MLR_BM;
	}
	tile_start[E] = t;
}

// An operand's format (the kernels' abf, bbf): F32 (0) or BF16 (MLR_BF16),
// and MLR_TOK when it holds the token rows, grouped row r reading row
// order[r] / topk (the forward's x, read in place as the base's grouped
// GEMMs read it: no gathered copy).
#define MLR_BF16 1
#define MLR_TOK 2

// mlr_load stages an R x C tile of the matrix src (format fm, row stride
// ld) into shared dst: the grouped rows r0 + i (i < nr, others zeros) and
// columns c0 + j (c0 + j < ncol, others zeros) at dst[i·sr + j·sc] (the
// strides let a tile land transposed). With ad not null, element
// (row, col) is dropped out under the expert's mask, the token
// d.order[row] / d.topk: kept values times the dropout's scale (one fp32
// product, as k_dropout), others 0. A thread takes four columns of a row
// (c0 a multiple of 4): one Philox call for the four.
template <int R, int C>
DK_DEV void mlr_load(float *dst, int sr, int sc, const void *src, int fm, i64 ld, i64 r0, int nr, int c0, int ncol, const mlr_ad *ad,
                     const mlr_drop &d) {
	int bf = fm & MLR_BF16;
	for (int i = threadIdx.x; i < R * (C / 4); i += MLR_THREADS) {
		int r = i / (C / 4), j0 = (i % (C / 4)) * 4, c = c0 + j0;
		bool ok = r < nr;
		u32 w[4] = {0, 0, 0, 0};
		if (ad && ok && c < ncol) dropout_words(w, r0 + r, c / 4, d.order, d.topk, d.row, d.step, (int)ad->k0, (int)ad->k1);
		i64 src_row = ok ? ((fm & MLR_TOK) ? (i64)(d.order[r0 + r] / d.topk) : r0 + r) : 0;
		for (int j = 0; j < 4; j++) {
			float v = 0;
			if (ok && c + j < ncol) {
				i64 at = src_row * ld + c + j;
				v = bf ? bf2f(((const u16 *)src)[at]) : ((const float *)src)[at];
				if (ad) v = w[j] >= ad->thr ? __fmul_rn(v, ad->dscale) : 0.0f;
			}
			dst[r * sr + (j0 + j) * sc] = v;
		}
	}
}

// mlr_rows: for every expert e with an adapter and each of its grouped
// rows r, out[r, n] (row stride ldo; += when acc) = s·Σ_k a'[r, k]·W[n, k]
// (!NN: W (N, K)) or ·W[k, n] (NN: W (K, N)), W = word wi of e's entry
// (A or B), s = e's Scale when scaled, else 1; a (rows, lda) of format
// abf (mlr_load's), a' = drop(a) under e's mask when drop_a; drop_o: the result is
// dropped out (kept ones times the dropout's scale, dropped ones add
// nothing), e's mask over (r, n). rk: 1, K is e's rank; 2, N is (the
// host's K or N is the largest rank). A block computes MLR_BM rows of one
// expert (blockIdx.x: a row tile, the grid an upper bound of them) by TN
// columns (blockIdx.y), 16 x 16 threads of MLR_BM/16 rows and TN/16
// consecutive columns each, summing over k in MLR_BK steps staged in
// shared memory: As (MLR_BM x MLR_BK+1), Ws (MLR_BK x TN+1).
template <int TN, bool NN>
DK_DEV void mlr_rows(float *As, float *Ws, float *__restrict__ out, i64 ldo, const void *__restrict__ a, int abf, i64 lda,
                     const u64 *__restrict__ tab, int wi, int N, int K, int rk, int scaled, int drop_a, int drop_o, int acc,
                     const i32 *__restrict__ offsets, const i32 *__restrict__ tile_start, int E, mlr_drop d) {
	constexpr int RM = MLR_BM / 16, RN = TN / 16, LA = MLR_BK + 1, LW = TN + 1;
	int e = moe_tile_expert(tile_start, E, blockIdx.x);
	if (e < 0) return;
	mlr_ad ad = mlr_get(tab, e);
	if (!ad.w[0]) return; // no adapter: the expert's rows are left alone
	if (rk == 1) K = ad.rank;
	if (rk == 2) N = ad.rank;
	int n0 = blockIdx.y * TN;
	if (n0 >= N) return;
	i32 row0 = offsets[e] + (blockIdx.x - tile_start[e]) * MLR_BM;
	int rows = offsets[e + 1] - row0;
	if (rows > MLR_BM) rows = MLR_BM;
	const float *W = ad.w[wi];
	const mlr_ad *da = drop_a && ad.drop ? &ad : 0;
	int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
	float accv[RM][RN];
	for (int i = 0; i < RM; i++)
		for (int j = 0; j < RN; j++) accv[i][j] = 0;
	for (int k0 = 0; k0 < K; k0 += MLR_BK) {
		mlr_load<MLR_BM, MLR_BK>(As, LA, 1, a, abf, lda, row0, rows, k0, K, da, d);
		if (NN) mlr_load<MLR_BK, TN>(Ws, LW, 1, W, 0, N, k0, K - k0, n0, N, 0, d); // W's rows k, columns n
		else mlr_load<TN, MLR_BK>(Ws, 1, LW, W, 0, K, n0, N - n0, k0, K, 0, d);  // W's rows n, columns k: transposed
		__syncthreads();
		for (int kk = 0; kk < MLR_BK; kk++) {
			float wv[RN];
			for (int j = 0; j < RN; j++) wv[j] = Ws[kk * LW + tx * RN + j];
			for (int i = 0; i < RM; i++) {
				float av = As[(ty * RM + i) * LA + kk];
				for (int j = 0; j < RN; j++) accv[i][j] += av * wv[j];
			}
		}
		__syncthreads();
	}
	float s = scaled ? ad.scale : 1.0f;
	for (int i = 0; i < RM; i++) {
		int r = ty * RM + i;
		if (r >= rows) continue;
		i64 row = row0 + r;
		int g = -1;
		u32 w[4];
		for (int j = 0; j < RN; j++) {
			int n = n0 + tx * RN + j;
			if (n >= N) continue;
			float v = accv[i][j] * s;
			if (drop_o && ad.drop) {
				if (n / 4 != g) {
					g = n / 4;
					dropout_words(w, row, g, d.order, d.topk, d.row, d.step, (int)ad.k0, (int)ad.k1);
				}
				if (w[n % 4] < ad.thr) continue; // dropped: adds nothing
				v = __fmul_rn(v, ad.dscale);
			}
			float *o = out + row * ldo + n;
			*o = acc ? *o + v : v;
		}
	}
}

// The row kernels: nt16 (t = Scale·drop(x)·Aᵀ: N the rank), nt64
// (out += t·Bᵀ), nn16 (dt = Scale·dout·B), nn64 (dx += drop'(dt·A)).
// Grid: (row tiles' upper bound: rows/MLR_BM + E, ceil(N/TN)).
DK_KERNEL __launch_bounds__(MLR_THREADS) void k_moelora_rows_nt16(float *out, i64 ldo, const void *a, int abf, i64 lda, const u64 *tab,
	    int wi, int N, int K, int rk, int scaled, int drop_a, int drop_o, int acc, const i32 *offsets, const i32 *tile_start, int E,
	    const i32 *order, int topk, int drow, int dstep) {
	__shared__ float As[MLR_BM * (MLR_BK + 1)], Ws[MLR_BK * (16 + 1)];
	mlr_drop d = {order, topk, drow, dstep};
	mlr_rows<16, false>(As, Ws, out, ldo, a, abf, lda, tab, wi, N, K, rk, scaled, drop_a, drop_o, acc, offsets, tile_start, E, d);
}
DK_KERNEL __launch_bounds__(MLR_THREADS) void k_moelora_rows_nt64(float *out, i64 ldo, const void *a, int abf, i64 lda, const u64 *tab,
	    int wi, int N, int K, int rk, int scaled, int drop_a, int drop_o, int acc, const i32 *offsets, const i32 *tile_start, int E,
	    const i32 *order, int topk, int drow, int dstep) {
	__shared__ float As[MLR_BM * (MLR_BK + 1)], Ws[MLR_BK * (64 + 1)];
	mlr_drop d = {order, topk, drow, dstep};
	mlr_rows<64, false>(As, Ws, out, ldo, a, abf, lda, tab, wi, N, K, rk, scaled, drop_a, drop_o, acc, offsets, tile_start, E, d);
}
DK_KERNEL __launch_bounds__(MLR_THREADS) void k_moelora_rows_nn16(float *out, i64 ldo, const void *a, int abf, i64 lda, const u64 *tab,
	    int wi, int N, int K, int rk, int scaled, int drop_a, int drop_o, int acc, const i32 *offsets, const i32 *tile_start, int E,
	    const i32 *order, int topk, int drow, int dstep) {
	__shared__ float As[MLR_BM * (MLR_BK + 1)], Ws[MLR_BK * (16 + 1)];
	mlr_drop d = {order, topk, drow, dstep};
	mlr_rows<16, true>(As, Ws, out, ldo, a, abf, lda, tab, wi, N, K, rk, scaled, drop_a, drop_o, acc, offsets, tile_start, E, d);
}
DK_KERNEL __launch_bounds__(MLR_THREADS) void k_moelora_rows_nn64(float *out, i64 ldo, const void *a, int abf, i64 lda, const u64 *tab,
	    int wi, int N, int K, int rk, int scaled, int drop_a, int drop_o, int acc, const i32 *offsets, const i32 *tile_start, int E,
	    const i32 *order, int topk, int drow, int dstep) {
	__shared__ float As[MLR_BM * (MLR_BK + 1)], Ws[MLR_BK * (64 + 1)];
	mlr_drop d = {order, topk, drow, dstep};
	mlr_rows<64, true>(As, Ws, out, ldo, a, abf, lda, tab, wi, N, K, rk, scaled, drop_a, drop_o, acc, offsets, tile_start, E, d);
}

// mlr_wgrad: for every expert e with an adapter, D (M, N) F32, word wi of
// e's entry (DA or DB; row stride N), += Σ over e's grouped rows r,
// ascending, of a[r, m]·b'[r, n]: a (rows, lda), b (rows, ldb), of
// formats abf and bbf (mlr_load's), b' = drop(b) under e's mask when drop_b. rk: 1, M
// is e's rank; 2, N is. Grid: (ceil(M/TM), ceil(N/TN), E), the host's M
// and N the largest; a block owns a TM x TN tile of one expert's D (its
// only writer), 16 x 16 threads of TM/16 x TN/16 elements, and sums over
// the expert's rows in MLR_BK steps staged in shared memory: At (MLR_BK x
// TM+1), Bt (MLR_BK x TN+1).
template <int TM, int TN>
DK_DEV void mlr_wgrad(float *At, float *Bt, const u64 *__restrict__ tab, int wi, const void *__restrict__ a, int abf, i64 lda, int M,
                      const void *__restrict__ b, int bbf, i64 ldb, int N, int rk, int drop_b, const i32 *__restrict__ offsets, mlr_drop d) {
	constexpr int RM = TM / 16, RN = TN / 16, LA = TM + 1, LB = TN + 1;
	int e = blockIdx.z;
	mlr_ad ad = mlr_get(tab, e);
	if (!ad.w[0]) return;
	if (rk == 1) M = ad.rank;
	if (rk == 2) N = ad.rank;
	int m0 = blockIdx.x * TM, n0 = blockIdx.y * TN;
	i32 r0 = offsets[e];
	int cnt = offsets[e + 1] - r0;
	if (cnt == 0 || m0 >= M || n0 >= N) return;
	const mlr_ad *db = drop_b && ad.drop ? &ad : 0;
	int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
	float accv[RM][RN];
	for (int i = 0; i < RM; i++)
		for (int j = 0; j < RN; j++) accv[i][j] = 0;
	for (int rs = 0; rs < cnt; rs += MLR_BK) {
		mlr_load<MLR_BK, TM>(At, LA, 1, a, abf, lda, r0 + rs, cnt - rs, m0, M, 0, d);
		mlr_load<MLR_BK, TN>(Bt, LB, 1, b, bbf, ldb, r0 + rs, cnt - rs, n0, N, db, d);
		__syncthreads();
		for (int rr = 0; rr < MLR_BK; rr++) {
			float bv[RN];
			for (int j = 0; j < RN; j++) bv[j] = Bt[rr * LB + tx * RN + j];
			for (int i = 0; i < RM; i++) {
				float av = At[rr * LA + ty * RM + i];
				for (int j = 0; j < RN; j++) accv[i][j] += av * bv[j];
			}
		}
		__syncthreads();
	}
	float *D = ad.w[wi];
	for (int i = 0; i < RM; i++) {
		int m = m0 + ty * RM + i;
		if (m >= M) continue;
		for (int j = 0; j < RN; j++) {
			int n = n0 + tx * RN + j;
			if (n < N) D[(i64)m * N + n] += accv[i][j];
		}
	}
}

// The gradient kernels: 64x16 (DB += doutᵀ·t: N the rank), 16x64 (DA +=
// dtᵀ·drop(x): M the rank).
DK_KERNEL __launch_bounds__(MLR_THREADS) void k_moelora_wgrad_64x16(const u64 *tab, int wi, const void *a, int abf, i64 lda, int M,
	    const void *b, int bbf, i64 ldb, int N, int rk, int drop_b, const i32 *offsets, const i32 *order, int topk, int drow, int dstep) {
	__shared__ float At[MLR_BK * (64 + 1)], Bt[MLR_BK * (16 + 1)];
	mlr_drop d = {order, topk, drow, dstep};
	mlr_wgrad<64, 16>(At, Bt, tab, wi, a, abf, lda, M, b, bbf, ldb, N, rk, drop_b, offsets, d);
}
DK_KERNEL __launch_bounds__(MLR_THREADS) void k_moelora_wgrad_16x64(const u64 *tab, int wi, const void *a, int abf, i64 lda, int M,
	    const void *b, int bbf, i64 ldb, int N, int rk, int drop_b, const i32 *offsets, const i32 *order, int topk, int drow, int dstep) {
	__shared__ float At[MLR_BK * (16 + 1)], Bt[MLR_BK * (64 + 1)];
	mlr_drop d = {order, topk, drow, dstep};
	mlr_wgrad<16, 64>(At, Bt, tab, wi, a, abf, lda, M, b, bbf, ldb, N, rk, drop_b, offsets, d);
}

DK_REGISTER(k_moelora_tiles)
DK_REGISTER(k_moelora_rows_nt16)
DK_REGISTER(k_moelora_rows_nt64)
DK_REGISTER(k_moelora_rows_nn16)
DK_REGISTER(k_moelora_rows_nn64)
DK_REGISTER(k_moelora_wgrad_64x16)
DK_REGISTER(k_moelora_wgrad_16x64)
