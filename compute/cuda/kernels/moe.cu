// Qwen3-MoE on the device: routing, grouping the (token, expert) pairs by
// expert, the weighted combine, and the training backward's own kernels.
// The expert GEMMs themselves are cuBLASLt calls over each expert's
// contiguous rows (ops.go, train_moe.go).
//
// Forward: k_moe_route picks each token's top-k experts and counts the
// rows of every expert; the host reads the counts (E ints) and lays the
// experts' rows out back to back (moePlan); k_moe_order lists each
// expert's pairs in token order (stable, deterministic) and k_moe_gather
// copies their token rows into the grouped BF16 input; after the GEMMs,
// k_moe_combine sums each token's expert outputs with its routing weights.
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
// offsets[e] + rank, the pair p, and rowpos (pairs) its inverse. Each
// thread owns a contiguous segment of the pairs: it counts its matches, a
// serial exclusive scan of the counts gives each thread's first rank, and a
// second pass writes. No atomics: the layout is a function of sel alone.
#define MOE_ORDER_THREADS 256
DK_KERNEL __launch_bounds__(MOE_ORDER_THREADS) void k_moe_order(const i32 *__restrict__ sel, const i32 *__restrict__ offsets, i64 pairs,
                                                                 i32 *__restrict__ order, i32 *__restrict__ rowpos) {
	__shared__ i32 base[MOE_ORDER_THREADS];
	int e = blockIdx.x;
	i64 seg = (pairs + MOE_ORDER_THREADS - 1) / MOE_ORDER_THREADS;
	i64 p0 = lmin((i64)threadIdx.x * seg, pairs), p1 = lmin(p0 + seg, pairs);
	i32 n = 0;
	for (i64 p = p0; p < p1; p++) n += sel[p] == e;
	base[threadIdx.x] = n;
	__syncthreads();
	if (threadIdx.x == 0) {
		i32 run = offsets[e];
		for (int i = 0; i < MOE_ORDER_THREADS; i++) {
			i32 c = base[i];
			base[i] = run;
			run += c;
		}
	}
	__syncthreads();
	i32 pos = base[threadIdx.x];
	for (i64 p = p0; p < p1; p++)
		if (sel[p] == e) {
			order[pos] = (i32)p;
			rowpos[p] = pos;
			pos++;
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
// with y (rows, H) the experts' down projections. One block per token.
DK_KERNEL void k_moe_combine(float *__restrict__ out, const float *__restrict__ y, const i32 *__restrict__ sel,
                             const float *__restrict__ wts, const i32 *__restrict__ rowpos, int K, int H) {
	__shared__ i32 order[64];
	i64 t = blockIdx.x;
	if (threadIdx.x == 0) moe_slots_by_expert(order, sel + t * K, K);
	__syncthreads();
	for (int c = threadIdx.x; c < H; c += blockDim.x) {
		float acc = 0;
		for (int j = 0; j < K; j++) {
			i64 pair = t * K + order[j];
			acc += y[(i64)rowpos[pair] * H + c] * wts[pair];
		}
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
