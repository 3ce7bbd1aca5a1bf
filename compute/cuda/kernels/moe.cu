// Qwen3-MoE on the device: routing, grouping the (token, expert) pairs by
// expert, the experts' grouped GEMMs, the weighted combine, and the
// training backward's own kernels.
//
// Forward: k_moe_route picks each token's top-k experts and counts the
// rows of every expert; k_moe_scan turns the counts into the grouping's
// offsets on the device (or, for shapes the grouped GEMM cannot take, the
// host reads them and runs cuBLASLt per expert); k_moe_order lists each
// expert's pairs in token order (stable, deterministic). The grouped GEMMs
// read each grouped row's token in place through that order (k_moe_gather
// copies them only for the _v1 kernels and the host's grouping; the
// experts' LoRA adapters, moelora.cu, read them in place too); gate and
// up run as one GEMM with the SwiGLU in its epilogue where nothing else
// needs them (k_moe_gemm_glu); k_moe_combine sums each token's expert
// outputs with its routing weights.
//
// Backward (MoEBackward): k_moe_wgrad (dL/d routing weight of every pair),
// k_moe_dy (each grouped row's gradient, weighted, BF16 for the GEMMs),
// k_moe_route_bwd (through the renormalization and the softmax into the
// router logits), k_moe_swiglu_bwd (the experts' activations) and k_moe_dx
// (each token's K grouped input gradients added to dx in a fixed order).
// No floating-point atomics anywhere: every sum has one order; the only
// atomic is k_moe_route's integer row count, exact in any order.

#define MOE_MAXE_PER_LANE 16 // E <= 512

// k_moe_route: one warp per token. logits (tokens, E) F32 ->
// sel (tokens, K) I32 experts in routing order, wts (tokens, K) F32,
// probs (tokens, E) F32 the softmax (when not null, for the backward);
// counts (E) += rows per expert (zeroed by the caller). As
// Qwen3MoeSparseMoeBlock and compute/cpu: p = softmax(logits) in fp32,
// top-K by p (ties: lower expert), weights p or p / sum of the K chosen.
DK_KERNEL void k_moe_route(const float *__restrict__ logits, i64 tokens, int E, int K, int norm, i32 *__restrict__ sel,
                           float *__restrict__ wts, i32 *__restrict__ counts, float *__restrict__ probs) {
	i64 t = (i64)blockIdx.x * (blockDim.x / DK_WARP) + threadIdx.x / DK_WARP;
	if (t >= tokens) return; // whole warps leave
	int lane = threadIdx.x % DK_WARP;
	const float *lr = logits + t * E;
	float p[MOE_MAXE_PER_LANE];
	float mx = -DK_INF;
	for (int r = 0; r < MOE_MAXE_PER_LANE; r++) {
		int e = lane + r * DK_WARP;
		p[r] = e < E ? lr[e] : -DK_INF;
		mx = fmaxf(mx, p[r]);
	}
	mx = warp_max(mx);
	float sum = 0;
	for (int r = 0; r < MOE_MAXE_PER_LANE; r++) {
		p[r] = expf(p[r] - mx); // -inf -> 0 past E
		sum += p[r];
	}
	sum = warp_sum(sum);
	for (int r = 0; r < MOE_MAXE_PER_LANE; r++) {
		p[r] /= sum;
		int e = lane + r * DK_WARP;
		if (probs && e < E) probs[t * E + e] = p[r];
	}
	float ks = 0, chosen_p = 0;
	int chosen_e = 0;
	for (int j = 0; j < K; j++) {
		// This lane's best unchosen expert, then the warp's.
		float bp = -1;
		int be = 0x7fffffff;
		for (int r = 0; r < MOE_MAXE_PER_LANE; r++) {
			int e = lane + r * DK_WARP;
			if (e < E && p[r] >= 0 && (p[r] > bp || (p[r] == bp && e < be))) {
				bp = p[r];
				be = e;
			}
		}
		for (int m = 16; m > 0; m >>= 1) {
			float op = __shfl_xor_sync(DK_FULL, bp, m);
			int oe = __shfl_xor_sync(DK_FULL, be, m);
			if (op > bp || (op == bp && oe < be)) {
				bp = op;
				be = oe;
			}
		}
		for (int r = 0; r < MOE_MAXE_PER_LANE; r++) // chosen: out of the running
			if (lane + r * DK_WARP == be) p[r] = -1;
		ks += bp;
		if (lane == j) {
			chosen_p = bp;
			chosen_e = be;
		}
	}
	if (lane < K) {
		sel[t * K + lane] = chosen_e;
		wts[t * K + lane] = norm ? chosen_p / ks : chosen_p;
		atomicAdd(&counts[chosen_e], 1);
	}
}

// k_moe_order: block e (of E) lists expert e's grouped rows, stable: the
// pairs p = t*K+j with sel[p] = e in ascending p (so ascending token),
// as compute/cpu's counting sort. order (pairs) receives, at grouped row
// offsets[e] + rank, the pair p, and rowpos (pairs) its inverse. The
// pairs go through shared memory a chunk at a time, read coalesced; in a
// chunk each thread owns MOE_ORDER_PER consecutive pairs: it counts its
// matches, a block scan of the counts (warp shuffles, then the warps'
// totals) gives each thread's first rank, and it writes its matches. No
// atomics: the layout is a function of sel alone. (Before, each thread
// read a contiguous 1/256 of all the pairs straight from memory, a warp's
// loads 32 lines apart: 0.18 ms a call for 131072 pairs on the H200.)
#define MOE_ORDER_THREADS 256
#define MOE_ORDER_PER 16
#define MOE_ORDER_CHUNK (MOE_ORDER_THREADS * MOE_ORDER_PER)
DK_DEV int moe_order_slot(int i) { return i + i / DK_WARP; } // padded: a thread's run of 16 hits 16 banks, its warp all 32
DK_KERNEL __launch_bounds__(MOE_ORDER_THREADS) void k_moe_order(const i32 *__restrict__ sel, const i32 *__restrict__ offsets, i64 pairs,
                                                                 i32 *__restrict__ order, i32 *__restrict__ rowpos) {
	__shared__ i32 cs[MOE_ORDER_CHUNK + MOE_ORDER_CHUNK / DK_WARP];
	__shared__ i32 wsum[MOE_ORDER_THREADS / DK_WARP];
	int e = blockIdx.x, tid = threadIdx.x, lane = tid % DK_WARP, warp = tid / DK_WARP;
	i32 run = offsets[e]; // the grouped row of the chunk's first match
	for (i64 c0 = 0; c0 < pairs; c0 += MOE_ORDER_CHUNK) {
		i64 n = lmin(MOE_ORDER_CHUNK, pairs - c0);
		for (int i = tid; i < MOE_ORDER_CHUNK; i += MOE_ORDER_THREADS) cs[moe_order_slot(i)] = i < n ? sel[c0 + i] : -1;
		__syncthreads();
		int first = tid * MOE_ORDER_PER, cnt = 0;
		for (int j = 0; j < MOE_ORDER_PER; j++) cnt += cs[moe_order_slot(first + j)] == e;
		int incl = cnt; // the warp's inclusive scan
		for (int d = 1; d < DK_WARP; d <<= 1) {
			int v = __shfl_sync(DK_FULL, incl, lane >= d ? lane - d : lane);
			if (lane >= d) incl += v;
		}
		if (lane == DK_WARP - 1) wsum[warp] = incl;
		__syncthreads();
		int before = incl - cnt, total = 0;
		for (int w = 0; w < MOE_ORDER_THREADS / DK_WARP; w++) {
			if (w < warp) before += wsum[w];
			total += wsum[w];
		}
		i32 pos = run + before;
		for (int j = 0; j < MOE_ORDER_PER; j++)
			if (cs[moe_order_slot(first + j)] == e) {
				i64 p = c0 + first + j;
				order[pos] = (i32)p;
				rowpos[p] = pos;
				pos++;
			}
		run += total;
		__syncthreads(); // every thread done with cs and wsum before the next chunk
	}
}

// k_moe_gather: xg (rows, H) BF16 = the row of x (tokens, H) F32 of each
// grouped row's token, order[i] / K. One thread per element.
DK_KERNEL void k_moe_gather(u16 *__restrict__ xg, const float *__restrict__ x, const i32 *__restrict__ order, i64 rows, int K, int H) {
	i64 total = rows * (i64)H;
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
		i64 r = i / H;
		int c = (int)(i - r * H);
		xg[i] = f2bf(x[(i64)(order[r] / K) * H + c]);
	}
}

// moe_slots_by_expert writes into order the slots 0..K-1 of one token,
// sorted by their expert id sel[slot] (insertion sort: K is small), the
// order in which compute/cpu adds the experts' contributions.
DK_DEV void moe_slots_by_expert(i32 *order, const i32 *sel, int K) {
	for (int j = 0; j < K; j++) order[j] = j;
	for (int a = 1; a < K; a++)
		for (int b = a; b > 0 && sel[order[b]] < sel[order[b - 1]]; b--) {
			i32 tmp = order[b];
			order[b] = order[b - 1];
			order[b - 1] = tmp;
		}
}

// k_moe_combine: out (tokens, H) = sum over the token's K experts, in
// ascending expert order (the CPU's summation order), of wts · y[rowpos]
// with y (rows, H) the experts' down projections. One block per token;
// its slots' rows and weights read once into shared memory. With H a
// multiple of 4 (and y and out 16-byte aligned: the host says, vec4) a
// thread sums 4 columns with 16-byte loads: the same sum per element.
DK_KERNEL void k_moe_combine(float *__restrict__ out, const float *__restrict__ y, const i32 *__restrict__ sel,
                             const float *__restrict__ wts, const i32 *__restrict__ rowpos, int K, int H, int vec4) {
	__shared__ i32 order[64];
	__shared__ i64 row[64];
	__shared__ float wt[64];
	i64 t = blockIdx.x;
	if (threadIdx.x == 0) moe_slots_by_expert(order, sel + t * K, K);
	__syncthreads();
	if ((int)threadIdx.x < K) {
		i64 pair = t * K + order[threadIdx.x];
		row[threadIdx.x] = (i64)rowpos[pair] * H;
		wt[threadIdx.x] = wts[pair];
	}
	__syncthreads();
	if (vec4) {
		for (int c = 4 * threadIdx.x; c < H; c += 4 * blockDim.x) {
			dk_f4 acc = {0, 0, 0, 0};
			for (int j = 0; j < K; j++) {
				dk_f4 v = *(const dk_f4 *)(y + row[j] + c);
				float w = wt[j];
				acc.x += v.x * w;
				acc.y += v.y * w;
				acc.z += v.z * w;
				acc.w += v.w * w;
			}
			*(dk_f4 *)(out + t * (i64)H + c) = acc;
		}
		return;
	}
	for (int c = threadIdx.x; c < H; c += blockDim.x) {
		float acc = 0;
		for (int j = 0; j < K; j++) acc += y[row[j] + c] * wt[j];
		out[t * (i64)H + c] = acc;
	}
}

// --- The backward (MoEBackward), in grouped order: row i of the T·K
// grouped rows is pair p = order[i] = t*K + j, expert sel[p].

// k_moe_wgrad: one warp per grouped row i: a[p] = dout[t]·y[i], the
// gradient of the pair's routing weight, summed in float64 (as the CPU).
// y (rows, H) the experts' outputs, dout (tokens, H).
DK_KERNEL void k_moe_wgrad(float *__restrict__ a, const float *__restrict__ y, const float *__restrict__ dout, const i32 *__restrict__ order,
                           i64 rows, int K, int H) {
	i64 i = (i64)blockIdx.x * (blockDim.x / DK_WARP) + threadIdx.x / DK_WARP;
	if (i >= rows) return; // whole warps leave
	int lane = threadIdx.x % DK_WARP;
	i32 p = order[i];
	const float *yr = y + i * H, *dr = dout + (i64)(p / K) * H;
	double acc = 0;
	for (int c = lane; c < H; c += DK_WARP) acc += (double)yr[c] * (double)dr[c];
	acc = warp_sum_d(acc);
	if (lane == 0) a[p] = (float)acc;
}

// k_moe_dy: dy (rows, H) BF16 = wts[p]·dout[t] for grouped row i (pair
// p = order[i]): the gradient of each expert's output, rounded for the
// down projection's backward GEMMs. One thread per element.
DK_KERNEL void k_moe_dy(u16 *__restrict__ dy, const float *__restrict__ dout, const float *__restrict__ wts, const i32 *__restrict__ order,
                        i64 rows, int K, int H) {
	i64 total = rows * (i64)H;
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
		i64 r = i / H;
		int c = (int)(i - r * H);
		i32 p = order[r];
		dy[i] = f2bf(dout[(i64)(p / K) * H + c] * wts[p]);
	}
}

// k_moe_route_bwd: one warp per token t: from a (tokens, K), the routing
// weights' gradients, to dl (tokens, E) = dL/d logits (=). Through the
// renormalization (norm: w_j = p_j / ks, ks = Σ_K p):
// dp[sel_j] += (a_j - Σ_i a_i·w_i) / ks, else dp[sel_j] += a_j; dprob (E)
// or null adds to every token's dp; then the softmax: dl = p·(dp - Σ p·dp).
// float64 throughout, as compute/cpu; ks and Σ a·w in slot order.
DK_KERNEL void k_moe_route_bwd(float *__restrict__ dl, const float *__restrict__ probs, const i32 *__restrict__ sel, const float *__restrict__ wts,
                               const float *__restrict__ a, const float *__restrict__ dprob, i64 tokens, int E, int K, int norm) {
	i64 t = (i64)blockIdx.x * (blockDim.x / DK_WARP) + threadIdx.x / DK_WARP;
	if (t >= tokens) return; // whole warps leave
	int lane = threadIdx.x % DK_WARP;
	const float *p = probs + t * E, *w = wts + t * K, *at = a + t * K;
	const i32 *sl = sel + t * K;
	double ks = 0, aw = 0;
	if (norm)
		for (int j = 0; j < K; j++) {
			ks += (double)p[sl[j]];
			aw += (double)at[j] * (double)w[j];
		}
	double dp[MOE_MAXE_PER_LANE];
	double pd = 0;
	for (int r = 0; r < MOE_MAXE_PER_LANE; r++) {
		int e = lane + r * DK_WARP;
		dp[r] = 0;
		if (e >= E) continue;
		if (dprob) dp[r] = (double)dprob[e];
		for (int j = 0; j < K; j++)
			if (sl[j] == e) dp[r] += norm ? ((double)at[j] - aw) / ks : (double)at[j];
		pd += (double)p[e] * dp[r];
	}
	pd = warp_sum_d(pd);
	for (int r = 0; r < MOE_MAXE_PER_LANE; r++) {
		int e = lane + r * DK_WARP;
		if (e < E) dl[t * E + e] = (float)((double)p[e] * (dp[r] - pd));
	}
}

// k_moe_swiglu_bwd: dg, du (n) BF16 = the gradients of silu(g)·u given
// dh (n) (=, rounded for the gate/up backward GEMMs): du = dh·silu(g),
// dg = dh·u·σ(g)·(1 + g·(1-σ(g))), as k_swiglu_bwd.
DK_KERNEL void k_moe_swiglu_bwd(u16 *__restrict__ dg, u16 *__restrict__ du, const float *__restrict__ dh, const float *__restrict__ g,
                                const float *__restrict__ u, i64 n) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
		float gv = g[i], d = dh[i];
		float sg = 1.0f / (1.0f + expf(-gv));
		du[i] = f2bf(d * gv * sg);
		dg[i] = f2bf(d * u[i] * sg * (1.0f + gv * (1.0f - sg)));
	}
}

// k_moe_rowpos: rowpos (rows) = the inverse of the permutation order
// (rows): rowpos[order[i]] = i.
DK_KERNEL void k_moe_rowpos(i32 *__restrict__ rowpos, const i32 *__restrict__ order, i64 rows) {
	for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < rows; i += (i64)gridDim.x * blockDim.x) rowpos[order[i]] = (i32)i;
}

// k_moe_dx: dx (tokens, H) += the grouped input gradients dxg (rows, H)
// of each token's K pairs (rowpos: pair -> grouped row), one rounding per
// pair in ascending expert order (compute/cpu adds the experts one by one
// in that order). One block per token; no atomics.
DK_KERNEL void k_moe_dx(float *__restrict__ dx, const float *__restrict__ dxg, const i32 *__restrict__ sel, const i32 *__restrict__ rowpos,
                        int K, int H) {
	__shared__ i32 order[64];
	i64 t = blockIdx.x;
	if (threadIdx.x == 0) moe_slots_by_expert(order, sel + t * K, K);
	__syncthreads();
	for (int c = threadIdx.x; c < H; c += blockDim.x) {
		float v = dx[t * (i64)H + c];
		for (int j = 0; j < K; j++) v += dxg[(i64)rowpos[t * K + order[j]] * H + c];
		dx[t * (i64)H + c] = v;
	}
}

// --- The load-balancing loss's statistics (compute.MoERouting), kept on
// the device: no host read inside a training step.
//
// k_moe_stats: one thread per expert e (blocks of MOE_STATS_THREADS):
// counts[e] = offsets[e+1] - offsets[e], the (token, slot) choices of e,
// and sums[e] = Σ_t probs[t,e] (probs (tokens, E) F32) in float64, t
// ascending, one add at a time: the order the host's sum has, so the
// same bits (the sum is a chain of dependent adds; the loads ahead of it
// are independent and coalesced across the experts).
#define MOE_STATS_THREADS 128
DK_KERNEL void k_moe_stats(const float *__restrict__ probs, const i32 *__restrict__ offsets, i64 tokens, int E,
                           double *__restrict__ sums, i32 *__restrict__ counts) {
	int e = blockIdx.x * blockDim.x + threadIdx.x;
	if (e >= E) return;
	const float *p = probs + e;
	double s = 0;
#pragma unroll 8
	for (i64 t = 0; t < tokens; t++) s += (double)p[t * E];
	sums[e] = s;
	counts[e] = offsets[e + 1] - offsets[e];
}

// k_moe_aux_grad: dprob (E) F32 = compute.MoEAuxGrad(coef, Σ_l counts[l],
// layers, tokens): coef·E·c/n/n, n = layers·tokens, left to right in
// float64 (no adds: nothing to contract into an FMA), rounded once to
// fp32, bit for bit the host's. counts (layers, E); one thread per expert.
DK_KERNEL void k_moe_aux_grad(float *__restrict__ dprob, const i32 *__restrict__ counts, int layers, int E, i64 tokens, double coef) {
	int e = blockIdx.x * blockDim.x + threadIdx.x;
	if (e >= E) return;
	i64 c = 0;
	for (int l = 0; l < layers; l++) c += counts[(i64)l * E + e];
	double n = (double)((i64)layers * tokens);
	dprob[e] = (float)(coef * (double)E * (double)c / n / n);
}

DK_REGISTER(k_moe_route)
DK_REGISTER(k_moe_order)
DK_REGISTER(k_moe_gather)
DK_REGISTER(k_moe_combine)
DK_REGISTER(k_moe_wgrad)
DK_REGISTER(k_moe_dy)
DK_REGISTER(k_moe_route_bwd)
DK_REGISTER(k_moe_swiglu_bwd)
DK_REGISTER(k_moe_rowpos)
DK_REGISTER(k_moe_dx)
DK_REGISTER(k_moe_stats)
DK_REGISTER(k_moe_aux_grad)

// --- The experts' GEMMs on the device's own grouping, with no host round
// trip (the routing's counts never leave the GPU).
//
// k_moe_scan turns the experts' row counts into the grouping's offsets
// (E+1, exclusive) and each expert's first row tile of MOE_BM rows
// (tile_start, E+1): one thread, in expert order, so both are exact.
#define MOE_BM 128
#define MOE_BN 128
#define MOE_GEMM_THREADS 256
// The grouped GEMMs (k_moe_gemm*, k_moe_wgrad_gemm) step through their
// sums MOE_BK at a time in MOE_STAGES shared buffers: three 64-wide steps
// in flight cover the global memory's latency, which two 32-wide ones (the
// _v1 kernels, DISTILL_CUDA_MOE_GEMM=v1; MOE_V1_BK, MOE_WG_BK) did not.
#define MOE_BK 64
#define MOE_STAGES 3
#define MOE_V1_BK 32
#define MOE_WG_BK 32

DK_KERNEL void k_moe_scan(const i32 *__restrict__ counts, int E, i32 *__restrict__ offsets, i32 *__restrict__ tile_start) {
	if (threadIdx.x != 0) return;
	i32 o = 0, t = 0;
	for (int e = 0; e < E; e++) {
		offsets[e] = o;
		tile_start[e] = t;
		o += counts[e];
		t += (counts[e] + MOE_BM - 1) / MOE_BM;
	}
	offsets[E] = o;
	tile_start[E] = t;
}

// k_moe_tiles is k_moe_scan's tile_start from saved offsets (E+1): the
// backward's grouping, as the forward left it.
DK_KERNEL void k_moe_tiles(const i32 *__restrict__ offsets, int E, i32 *__restrict__ tile_start) {
	if (threadIdx.x != 0) return;
	i32 t = 0;
	for (int e = 0; e < E; e++) {
		tile_start[e] = t;
		t += (offsets[e + 1] - offsets[e] + MOE_BM - 1) / MOE_BM;
	}
	tile_start[E] = t;
}

// moe_gemm: for every expert e, out[r] (N, F32) = a[r] (K, BF16) · W_e
// over the grouped rows r of e (offsets[e] <= r < offsets[e+1]), W_e =
// w[e] BF16 row-major: (N, K) with out = a·W_eᵀ when !NN (the forward's
// projections, as b.gemm per expert), (K, N) with out = a·W_e when NN (the
// backward's dh and dx); ACC adds to out instead of overwriting it. With
// order non-null, grouped row r reads a's row order[r] / topk (a holds
// the token rows: the forward's gate and up read the tokens in place
// instead of a gathered copy).
//
// GLU (the forward's gate and up at once, !NN): w holds the experts' gate
// weights and w2 their up weights, both (N, K); out is act (rows, N) BF16
// = silu(a·Gateᵀ)·(a·Upᵀ) (swiglu1 of the two fp32 sums, rounded once),
// and neither product is stored. A block's tile is MOE_BN/2 columns of
// both: its W tile interleaves 16 gate rows and the same 16 up rows per
// warp column, so each thread's accumulators hold a gate and its up.
//
// Grid: an upper bound of the row tiles (rows/MOE_BM + E; a block past
// tile_start[E] leaves) times the column tiles, flat with the column
// tiles fastest (moe_block; the _v1 kernels: x over the row tiles, y
// over the column tiles). A block of 8 warps
// computes MOE_BM x MOE_BN, each warp 64 rows x 32 columns (4 x 4 mma
// tiles), over K in BK steps, S of them staged (cp.async) ahead of the
// tensor cores. Rows past the expert's, columns past N and K past its end
// load as zeros and are not stored; K and N must be multiples of 8
// (16-byte copies), the host checks. Each output element is one thread's
// sum in ascending k: the same bits for any BK, S or GLU, deterministic.
#define MOE_LDN (MOE_BN + 8) // an NN W tile's row stride (BF16)

// moe_block is a grouped GEMM block's row tile t and column tile c (of
// ncol). A flat grid (gridDim.y 1, the default kernels) runs a row
// tile's column tiles next to each other, so a tile of A rows is read
// from memory once while its ncol blocks run. With the row tiles in the
// grid's fastest dimension, every column tile read all the A rows again:
// for a Qwen3-30B-A3B layer of 16384 tokens, down read its 201 MB of act
// rows 16 times, and gate and up their 537 MB of token rows 12 times
// (through an L2 of 50 MB, against the tokens' 64 MB). The _v1 kernels
// keep the 2-D grid (row tiles in x, column tiles in y) for an A/B on a
// device. Either way each element's sum is the same.
DK_DEV void moe_block(int ncol, int *t, int *c) {
	if (gridDim.y > 1) {
		*t = blockIdx.x;
		*c = blockIdx.y;
	} else {
		*t = blockIdx.x / ncol;
		*c = blockIdx.x % ncol;
	}
}

// moe_pipeline runs the grouped GEMMs' main loop over steps tile steps in
// S buffers: load(s) stages step s's tiles into buffer s % S with
// cp.async and commits them, mma(s) multiplies a staged step. The first
// S-1 steps load ahead; each iteration waits for its own step's copies,
// then (every warp being past the barrier, done with step s-1's buffer)
// refills that buffer with step s+S-1. Empty groups keep the count of
// groups in flight uniform at the end.
template <int S, class Load, class Mma> DK_DEV void moe_pipeline(int steps, Load load, Mma mma) {
	for (int s = 0; s < S - 1; s++) {
		if (s < steps) load(s);
		else cp_async_commit();
	}
	for (int s = 0; s < steps; s++) {
		cp_async_wait<S - 2>();
		__syncthreads();
		if (s + S - 1 < steps) load(s + S - 1);
		else cp_async_commit();
		mma(s);
	}
}

// moe_store writes (ACC: adds) a warp's 64 x 32 accumulators, at rows wm
// and columns wn of a tile whose origin is o (F32, row stride ld), keeping
// to the tile's first rows rows and cols columns (mma's accumulator
// layout: row g, columns 2t and 2t+1, and row g+8).
template <bool ACC>
DK_DEV void moe_store(float *o, i64 ld, int rows, int cols, const float acc[4][4][4], int wm, int wn, int lane) {
	int g = lane / 4, tq = lane % 4;
	for (int i = 0; i < 4; i++) {
		for (int j = 0; j < 4; j++) {
			int c = wn + 8 * j + 2 * tq;
			for (int h = 0; h < 2; h++) {
				int r = wm + 16 * i + g + 8 * h;
				if (r >= rows) continue;
				float *row = o + (i64)r * ld;
				for (int q = 0; q < 2; q++) {
					if (c + q >= cols) continue;
					float v = acc[i][j][2 * h + q];
					row[c + q] = ACC ? row[c + q] + v : v;
				}
			}
		}
	}
}

// moe_store_glu writes act = swiglu1(gate, up) as BF16 pairs from a GLU
// warp's accumulators: acc[i][j] (j < 2) are gate's columns c0 + 8j +
// 2t.., acc[i][j+2] up's same columns (o: the tile's origin in act, row
// stride ld; rows and cols as moe_store's).
DK_DEV void moe_store_glu(u16 *o, i64 ld, int rows, int cols, const float acc[4][4][4], int wm, int c0, int lane) {
	int g = lane / 4, tq = lane % 4;
	for (int i = 0; i < 4; i++) {
		for (int j = 0; j < 2; j++) {
			int c = c0 + 8 * j + 2 * tq; // even, and cols is a multiple of 8: c+1 < cols with c
			if (c >= cols) continue;
			for (int h = 0; h < 2; h++) {
				int r = wm + 16 * i + g + 8 * h;
				if (r >= rows) continue;
				const float *gt = acc[i][j], *up = acc[i][j + 2];
				*(u32 *)(o + (i64)r * ld + c) = pack_bf16x2(swiglu1(gt[2 * h], up[2 * h]), swiglu1(gt[2 * h + 1], up[2 * h + 1]));
			}
		}
	}
}

// moe_mma adds a warp's 4x4 tiles of products af·bf into acc.
DK_DEV void moe_mma(float acc[4][4][4], const u32 af[4][4], const u32 bf[4][2]) {
	for (int i = 0; i < 4; i++)
		for (int j = 0; j < 4; j++) mma_bf16_16816(acc[i][j], af[i], bf[j]);
}

template <int BK, int S, bool NN, bool ACC, bool GLU>
DK_DEV void moe_gemm(u16 *sm, void *__restrict__ out, const u16 *__restrict__ a, const i32 *__restrict__ order, int topk,
                     const u64 *__restrict__ w, const u64 *__restrict__ w2, const i32 *__restrict__ offsets,
                     const i32 *__restrict__ tile_start, int E, int N, int K) {
	// LD: a K-major tile's row stride (BF16, padded against bank
	// conflicts); CH: its 16-byte chunks a row; RSTEP, AR, BR: the rows a
	// thread copies, RSTEP apart, of the A and the (!NN) W tile.
	constexpr int LD = BK + 8, CH = BK / 8;
	constexpr int tileA = MOE_BM * LD, tileB = NN ? BK * MOE_LDN : MOE_BN * LD, stage = tileA + tileB; // halfs
	constexpr int RSTEP = MOE_GEMM_THREADS / CH, AR = MOE_BM / RSTEP, BR = MOE_BN / RSTEP;
	const int bn = GLU ? MOE_BN / 2 : MOE_BN; // the block's output columns
	int t, ct;
	moe_block((N + bn - 1) / bn, &t, &ct);
	int e = moe_tile_expert(tile_start, E, t); // the expert whose tiles hold t
	if (e < 0) return;
	i32 row0 = offsets[e] + (t - tile_start[e]) * MOE_BM;
	int rows = offsets[e + 1] - row0;
	if (rows > MOE_BM) rows = MOE_BM;
	int n0 = ct * bn;
	int ncols = N - n0 < bn ? N - n0 : bn;
	int tid = threadIdx.x, lane = tid % DK_WARP, warp = tid / DK_WARP;
	int wm = (warp / 4) * 64, wn = (warp % 4) * 32; // the warp's rows and columns in the tile

	// The rows this thread copies (tid / CH + RSTEP·j, at column chunk
	// (tid % CH)·8 of each step): A's source rows (through order when the
	// tokens are read in place), W's rows (GLU: gate's and up's
	// interleaved). A row out of range copies zeros from a valid address.
	int r0 = tid / CH, c8 = (tid % CH) * 8;
	const u16 *arow[AR];
	bool aok[AR];
	for (int j = 0; j < AR; j++) {
		int r = r0 + RSTEP * j;
		aok[j] = r < rows;
		i64 src = aok[j] ? (order ? (i64)(order[row0 + r] / topk) : (i64)(row0 + r)) : 0;
		arow[j] = a + src * K;
	}
	const u16 *brow[NN ? 1 : BR];
	bool bok[NN ? 1 : BR];
	if (!NN) {
		for (int j = 0; j < BR; j++) {
			int r = r0 + RSTEP * j, c = r; // the tile row's column of out
			const u16 *W = (const u16 *)w[e];
			if (GLU) { // rows 32v..32v+15: gate's columns 16v..16v+15; 32v+16..32v+31: up's
				c = 16 * (r / 32) + (r % 16);
				if (r % 32 >= 16) W = (const u16 *)w2[e];
			}
			bok[j] = c < ncols;
			brow[j] = W + (bok[j] ? (i64)(n0 + c) * K : 0);
		}
	}
	const u16 *Wnn = (const u16 *)w[e] + n0; // NN: W_e (K, N) from column n0

	auto load = [&](int s) {
		int buf = (s % S) * stage, k0 = s * BK;
		bool kok = k0 + c8 < K;
		for (int j = 0; j < AR; j++) {
			bool ok = aok[j] && kok;
			cp_async16(sm, 2 * (buf + (r0 + RSTEP * j) * LD + c8), ok ? arow[j] + k0 + c8 : a, ok);
		}
		if (NN) { // BK rows of k, MOE_BN columns of n
			for (int i = tid; i < BK * (MOE_BN / 8); i += MOE_GEMM_THREADS) {
				int r = i / (MOE_BN / 8), c = (i % (MOE_BN / 8)) * 8;
				bool ok = k0 + r < K && c < ncols;
				cp_async16(sm, 2 * (buf + tileA + r * MOE_LDN + c), ok ? Wnn + (i64)(k0 + r) * N + c : Wnn, ok);
			}
		} else { // MOE_BN rows of n, BK columns of k
			for (int j = 0; j < BR; j++) {
				bool ok = bok[j] && kok;
				cp_async16(sm, 2 * (buf + tileA + (r0 + RSTEP * j) * LD + c8), ok ? brow[j] + k0 + c8 : brow[j], ok);
			}
		}
		cp_async_commit();
	};

	float acc[4][4][4] = {};
	moe_pipeline<S>((K + BK - 1) / BK, load, [&](int s) {
		int buf = (s % S) * stage;
		for (int kk = 0; kk < BK; kk += 16) {
			u32 af[4][4], bf[4][2];
			for (int i = 0; i < 4; i++) ldsm_a(af[i], sm, buf, LD, wm + 16 * i, kk, lane);
			for (int j = 0; j < 4; j += 2) {
				if (NN) ldsm_bt2(bf[j], bf[j + 1], sm, buf + tileA, MOE_LDN, wn + 8 * j, kk, lane);
				else ldsm_b2(bf[j], bf[j + 1], sm, buf + tileA, LD, wn + 8 * j, kk, lane);
			}
			moe_mma(acc, af, bf);
		}
	});

	if (GLU) moe_store_glu((u16 *)out + (i64)row0 * N + n0, N, rows, ncols, acc, wm, 16 * (warp % 4), lane);
	else moe_store<ACC>((float *)out + (i64)row0 * N + n0, N, rows, ncols, acc, wm, wn, lane);
}

// The kernels: the forward's projections (order non-null: a holds the
// token rows), gate and up with the SwiGLU (_glu, BF16 act), the
// backward's NN products (_nn; _nn_acc adds); _v1: the earlier 32-wide
// steps in two buffers, for an A/B on a device. The host's moeGEMMSmem
// gives each one's shared memory. The default kernels ask for two blocks
// an SM (at most 128 registers: TestKernelsCompile): at 130 and 134
// registers k_moe_gemm and k_moe_gemm_glu ran one block, 8 warps, an SM.
DK_KERNEL __launch_bounds__(MOE_GEMM_THREADS, 2) void k_moe_gemm(void *out, const u16 *a, const i32 *order, int topk, const u64 *w, const u64 *w2,
                                                          const i32 *offsets, const i32 *tile_start, int E, int N, int K) {
	DK_DYN_SMEM(u16, sm); // here, not in the template: one declaration per kernel
	moe_gemm<MOE_BK, MOE_STAGES, false, false, false>(sm, out, a, order, topk, w, w2, offsets, tile_start, E, N, K);
}
DK_KERNEL __launch_bounds__(MOE_GEMM_THREADS, 2) void k_moe_gemm_glu(void *out, const u16 *a, const i32 *order, int topk, const u64 *w, const u64 *w2,
                                                          const i32 *offsets, const i32 *tile_start, int E, int N, int K) {
	DK_DYN_SMEM(u16, sm); // here, not in the template: one declaration per kernel
	moe_gemm<MOE_BK, MOE_STAGES, false, false, true>(sm, out, a, order, topk, w, w2, offsets, tile_start, E, N, K);
}
DK_KERNEL __launch_bounds__(MOE_GEMM_THREADS, 2) void k_moe_gemm_nn(void *out, const u16 *a, const i32 *order, int topk, const u64 *w, const u64 *w2,
                                                          const i32 *offsets, const i32 *tile_start, int E, int N, int K) {
	DK_DYN_SMEM(u16, sm); // here, not in the template: one declaration per kernel
	moe_gemm<MOE_BK, MOE_STAGES, true, false, false>(sm, out, a, order, topk, w, w2, offsets, tile_start, E, N, K);
}
DK_KERNEL __launch_bounds__(MOE_GEMM_THREADS, 2) void k_moe_gemm_nn_acc(void *out, const u16 *a, const i32 *order, int topk, const u64 *w, const u64 *w2,
                                                          const i32 *offsets, const i32 *tile_start, int E, int N, int K) {
	DK_DYN_SMEM(u16, sm); // here, not in the template: one declaration per kernel
	moe_gemm<MOE_BK, MOE_STAGES, true, true, false>(sm, out, a, order, topk, w, w2, offsets, tile_start, E, N, K);
}
DK_KERNEL __launch_bounds__(MOE_GEMM_THREADS) void k_moe_gemm_v1(void *out, const u16 *a, const i32 *order, int topk, const u64 *w, const u64 *w2,
                                                          const i32 *offsets, const i32 *tile_start, int E, int N, int K) {
	DK_DYN_SMEM(u16, sm); // here, not in the template: one declaration per kernel
	moe_gemm<MOE_V1_BK, 2, false, false, false>(sm, out, a, order, topk, w, w2, offsets, tile_start, E, N, K);
}
DK_KERNEL __launch_bounds__(MOE_GEMM_THREADS) void k_moe_gemm_nn_v1(void *out, const u16 *a, const i32 *order, int topk, const u64 *w, const u64 *w2,
                                                          const i32 *offsets, const i32 *tile_start, int E, int N, int K) {
	DK_DYN_SMEM(u16, sm); // here, not in the template: one declaration per kernel
	moe_gemm<MOE_V1_BK, 2, true, false, false>(sm, out, a, order, topk, w, w2, offsets, tile_start, E, N, K);
}
DK_KERNEL __launch_bounds__(MOE_GEMM_THREADS) void k_moe_gemm_nn_acc_v1(void *out, const u16 *a, const i32 *order, int topk, const u64 *w, const u64 *w2,
                                                          const i32 *offsets, const i32 *tile_start, int E, int N, int K) {
	DK_DYN_SMEM(u16, sm); // here, not in the template: one declaration per kernel
	moe_gemm<MOE_V1_BK, 2, true, true, false>(sm, out, a, order, topk, w, w2, offsets, tile_start, E, N, K);
}

// moe_gemm_fp8: an FP8 teacher's experts (compute's "FP8 weights"): for
// every expert e, out[r] (N, F32) = (a[r]·W_eᵀ)·as[r]·ws_e[c], the sum of
// the E4M3 codes' products scaled by the row's and then the channel's
// scale, as k_fp8_scale multiplies cuBLASLt's sums; a (rows, K) codes with
// scales as (rows), or with order the token rows' (T, K) and (T) that
// grouped row r reads at order[r] / topk; w[e] (N, K) codes, ws[e] (N)
// scales. GLU: w, ws are gate's and w2, ws2 up's, and out is h (rows, N)
// F32 = swiglu1 of the two scaled products (the FP8 path keeps h in fp32
// for its per-row quantization). Tiles as moe_gemm's, K in MOE_F8_BK-code
// steps (two m16n8k32 each) staged MOE_STAGES ahead; the fragments through
// ldmatrix, reading 32 codes as 16 BF16 (prelude.cuh). K and N multiples
// of 16 (16-byte copies; WeightFP8 requires it). Needs sm_89.
#define MOE_F8_BK 64
#define MOE_F8_LD (MOE_F8_BK + 16) // a tile's row stride in bytes, padded against bank conflicts

template <bool GLU>
DK_DEV void moe_gemm_fp8(unsigned char *sm, float *__restrict__ out, const unsigned char *__restrict__ a, const float *__restrict__ as,
                         const i32 *__restrict__ order, int topk, const u64 *__restrict__ w, const u64 *__restrict__ ws,
                         const u64 *__restrict__ w2, const u64 *__restrict__ ws2, const i32 *__restrict__ offsets,
                         const i32 *__restrict__ tile_start, int E, int N, int K) {
	// CH: a row's 16-byte chunks a step; RSTEP, AR: the rows a thread copies.
	constexpr int CH = MOE_F8_BK / 16, RSTEP = MOE_GEMM_THREADS / CH, AR = MOE_BM / RSTEP;
	constexpr int tile = MOE_BM * MOE_F8_LD, stage = 2 * tile; // bytes: an A and a W tile (MOE_BN == MOE_BM rows)
	const int bn = GLU ? MOE_BN / 2 : MOE_BN;
	int t, ct;
	moe_block((N + bn - 1) / bn, &t, &ct);
	int e = moe_tile_expert(tile_start, E, t); // the expert whose tiles hold t
	if (e < 0) return;
	i32 row0 = offsets[e] + (t - tile_start[e]) * MOE_BM;
	int rows = offsets[e + 1] - row0;
	if (rows > MOE_BM) rows = MOE_BM;
	int n0 = ct * bn;
	int ncols = N - n0 < bn ? N - n0 : bn;
	int tid = threadIdx.x, lane = tid % DK_WARP, warp = tid / DK_WARP;
	int wm = (warp / 4) * 64, wn = (warp % 4) * 32;

	int r0 = tid / CH, c16 = (tid % CH) * 16;
	const unsigned char *arow[AR], *brow[AR];
	bool aok[AR], bok[AR];
	for (int j = 0; j < AR; j++) {
		int r = r0 + RSTEP * j;
		aok[j] = r < rows;
		i64 src = aok[j] ? (order ? (i64)(order[row0 + r] / topk) : (i64)(row0 + r)) : 0;
		arow[j] = a + src * K;
		int c = r; // the W tile row's column of out (GLU: gate's and up's interleaved, as moe_gemm's)
		const unsigned char *W = (const unsigned char *)w[e];
		if (GLU) {
			c = 16 * (r / 32) + (r % 16);
			if (r % 32 >= 16) W = (const unsigned char *)w2[e];
		}
		bok[j] = c < ncols;
		brow[j] = W + (bok[j] ? (i64)(n0 + c) * K : 0);
	}

	auto load = [&](int s) {
		int buf = (s % MOE_STAGES) * stage, k0 = s * MOE_F8_BK;
		bool kok = k0 + c16 < K;
		for (int j = 0; j < AR; j++) {
			int r = r0 + RSTEP * j;
			bool ok = aok[j] && kok;
			cp_async16(sm, buf + r * MOE_F8_LD + c16, ok ? arow[j] + k0 + c16 : a, ok);
			ok = bok[j] && kok;
			cp_async16(sm, buf + tile + r * MOE_F8_LD + c16, ok ? brow[j] + k0 + c16 : brow[j], ok);
		}
		cp_async_commit();
	};

	float acc[4][4][4] = {};
	const u16 *sh = (const u16 *)sm; // the fragments' addresses in BF16 units (prelude.cuh)
	moe_pipeline<MOE_STAGES>((K + MOE_F8_BK - 1) / MOE_F8_BK, load, [&](int s) {
		int buf = (s % MOE_STAGES) * stage / 2; // halfs
		for (int kk = 0; kk < MOE_F8_BK / 2; kk += 16) { // halfs: 32 codes a step
			u32 af[4][4], bf[4][2];
			for (int i = 0; i < 4; i++) ldsm_a(af[i], sh, buf, MOE_F8_LD / 2, wm + 16 * i, kk, lane);
			for (int j = 0; j < 4; j += 2) ldsm_b2(bf[j], bf[j + 1], sh, buf + tile / 2, MOE_F8_LD / 2, wn + 8 * j, kk, lane);
			for (int i = 0; i < 4; i++)
				for (int j = 0; j < 4; j++) mma_e4m3_16832(acc[i][j], af[i], bf[j]);
		}
	});

	// The epilogue: scale (the row's, then the channel's), then store (GLU:
	// h of the scaled gate and up).
	int g = lane / 4, tq = lane % 4;
	const float *sw = (const float *)ws[e], *sw2 = GLU ? (const float *)ws2[e] : sw;
	for (int i = 0; i < 4; i++) {
		for (int h = 0; h < 2; h++) {
			int r = wm + 16 * i + g + 8 * h;
			if (r >= rows) continue;
			float sa = order ? as[order[row0 + r] / topk] : as[row0 + r];
			float *o = out + (i64)(row0 + r) * N + n0;
			for (int j = 0; j < (GLU ? 2 : 4); j++) {
				for (int q = 0; q < 2; q++) {
					int c = GLU ? 16 * (warp % 4) + 8 * j + 2 * tq + q : wn + 8 * j + 2 * tq + q;
					if (c >= ncols) continue;
					float v = __fmul_rn(__fmul_rn(acc[i][j][2 * h + q], sa), sw[n0 + c]);
					if (GLU) v = swiglu1(v, __fmul_rn(__fmul_rn(acc[i][j + 2][2 * h + q], sa), sw2[n0 + c]));
					o[c] = v;
				}
			}
		}
	}
}

// k_moe_gemm_fp8 (out = the scaled product) and k_moe_gemm_fp8_glu (out =
// h of gate's and up's): moe_gemm_fp8.
DK_KERNEL __launch_bounds__(MOE_GEMM_THREADS) void k_moe_gemm_fp8(float *out, const unsigned char *a, const float *as, const i32 *order, int topk,
                                                                   const u64 *w, const u64 *ws, const i32 *offsets, const i32 *tile_start, int E,
                                                                   int N, int K) {
	DK_DYN_SMEM(unsigned char, sm);
	moe_gemm_fp8<false>(sm, out, a, as, order, topk, w, ws, w, ws, offsets, tile_start, E, N, K);
}
DK_KERNEL __launch_bounds__(MOE_GEMM_THREADS) void k_moe_gemm_fp8_glu(float *out, const unsigned char *a, const float *as, const i32 *order,
                                                                       int topk, const u64 *w, const u64 *ws, const u64 *w2, const u64 *ws2,
                                                                       const i32 *offsets, const i32 *tile_start, int E, int N, int K) {
	DK_DYN_SMEM(unsigned char, sm);
	moe_gemm_fp8<true>(sm, out, a, as, order, topk, w, ws, w2, ws2, offsets, tile_start, E, N, K);
}

// moe_wgrad: the experts' weight gradients, dw[e] (N, K) F32 += a_eᵀ ·
// x_e over each expert's grouped rows, a (rows, N) BF16 and x BF16 (dDown
// += dyᵀ·act, dGate += dgᵀ·x, dUp += duᵀ·x): x the grouped rows (rows, K),
// or with order non-null the token rows, grouped row r reading row
// order[r] / topk (as moe_gemm's A). Grid: (N tiles, K tiles, E), a block
// owning a MOE_BM x MOE_BN tile of one expert's gradient (8 warps of 64 x
// 32) and summing over the expert's rows in BK steps, S of them staged
// ahead (cp.async; aᵀ's fragments through ldmatrix's transposing form).
// The block is its tile's only writer, and the sum runs in ascending rows
// for any BK and S: deterministic, the same bits. N and K multiples of 8.
template <int BK, int S>
DK_DEV void moe_wgrad(u16 *sm, const u64 *__restrict__ dw, const u16 *__restrict__ a, const u16 *__restrict__ x,
                      const i32 *__restrict__ order, int topk, const i32 *__restrict__ offsets, int N, int K) {
	int e = blockIdx.z, n0 = blockIdx.x * MOE_BM, k0 = blockIdx.y * MOE_BN;
	i32 r0 = offsets[e];
	int cnt = offsets[e + 1] - r0;
	if (cnt == 0) return;
	int nrows = N - n0 < MOE_BM ? N - n0 : MOE_BM, kcols = K - k0 < MOE_BN ? K - k0 : MOE_BN;
	const int tile = BK * MOE_LDN; // halfs: BK rows (r) of MOE_BM (n) or MOE_BN (k) columns
	int tid = threadIdx.x, lane = tid % DK_WARP, warp = tid / DK_WARP;
	int wm = (warp / 4) * 64, wn = (warp % 4) * 32;

	auto load = [&](int s) {
		int buf = (s % S) * 2 * tile, rs = s * BK;
		for (int i = tid; i < BK * (MOE_BM / 8); i += MOE_GEMM_THREADS) {
			int r = i / (MOE_BM / 8), c = (i % (MOE_BM / 8)) * 8;
			bool ok = rs + r < cnt && c < nrows;
			cp_async16(sm, 2 * (buf + r * MOE_LDN + c), a + (ok ? (i64)(r0 + rs + r) * N + n0 + c : 0), ok);
		}
		for (int i = tid; i < BK * (MOE_BN / 8); i += MOE_GEMM_THREADS) {
			int r = i / (MOE_BN / 8), c = (i % (MOE_BN / 8)) * 8;
			bool ok = rs + r < cnt && c < kcols;
			i64 src = ok ? (order ? (i64)(order[r0 + rs + r] / topk) : (i64)(r0 + rs + r)) : 0;
			cp_async16(sm, 2 * (buf + tile + r * MOE_LDN + c), x + (ok ? src * K + k0 + c : 0), ok);
		}
		cp_async_commit();
	};

	float acc[4][4][4] = {};
	moe_pipeline<S>((cnt + BK - 1) / BK, load, [&](int s) {
		int buf = (s % S) * 2 * tile;
		for (int kk = 0; kk < BK; kk += 16) {
			u32 af[4][4], bf[4][2];
			// aᵀ's A fragment (rows n, columns r) from the tile stored [r][n].
			for (int i = 0; i < 4; i++)
				ldsm_x4_t(af[i], sm, 2 * (buf + (kk + (lane & 7) + ((lane >> 4) & 1) * 8) * MOE_LDN + wm + 16 * i + ((lane >> 3) & 1) * 8));
			for (int j = 0; j < 4; j += 2) ldsm_bt2(bf[j], bf[j + 1], sm, buf + tile, MOE_LDN, wn + 8 * j, kk, lane);
			moe_mma(acc, af, bf);
		}
	});

	moe_store<true>((float *)dw[e] + (i64)n0 * K + k0, K, nrows, kcols, acc, wm, wn, lane);
}

// k_moe_wgrad_gemm: moe_wgrad in MOE_BK-row steps, MOE_STAGES of them
// staged; _v1 the earlier 32-row steps in two buffers.
DK_KERNEL __launch_bounds__(MOE_GEMM_THREADS, 2) void k_moe_wgrad_gemm(const u64 *dw, const u16 *a, const u16 *x, const i32 *order, int topk,
                                                                     const i32 *offsets, int N, int K) {
	DK_DYN_SMEM(u16, sm);
	moe_wgrad<MOE_BK, MOE_STAGES>(sm, dw, a, x, order, topk, offsets, N, K);
}
DK_KERNEL __launch_bounds__(MOE_GEMM_THREADS) void k_moe_wgrad_gemm_v1(const u64 *dw, const u16 *a, const u16 *x, const i32 *order,
                                                                        int topk, const i32 *offsets, int N, int K) {
	DK_DYN_SMEM(u16, sm);
	moe_wgrad<MOE_WG_BK, 2>(sm, dw, a, x, order, topk, offsets, N, K);
}

DK_REGISTER(k_moe_scan)
DK_REGISTER(k_moe_tiles)
DK_REGISTER(k_moe_gemm)
DK_REGISTER(k_moe_gemm_nn)
DK_REGISTER(k_moe_gemm_nn_acc)
DK_REGISTER(k_moe_gemm_glu)
DK_REGISTER(k_moe_gemm_v1)
DK_REGISTER(k_moe_gemm_nn_v1)
DK_REGISTER(k_moe_gemm_nn_acc_v1)
DK_REGISTER(k_moe_wgrad_gemm_v1)
DK_REGISTER(k_moe_gemm_fp8)
DK_REGISTER(k_moe_gemm_fp8_glu)
DK_REGISTER(k_moe_wgrad_gemm)
