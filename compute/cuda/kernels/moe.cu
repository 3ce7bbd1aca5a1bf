// Qwen3-MoE on the device: routing, grouping the (token, expert) pairs by
// expert, and the weighted combine. The expert GEMMs themselves are
// cuBLASLt calls over each expert's contiguous rows (backend.go).
//
// Plan: k_moe_route picks each token's top-k experts and counts the rows
// of every expert; the host reads the counts (E ints) and lays the
// experts' rows out back to back (moePlan); k_moe_scatter gathers each
// pair's token row into its expert's segment as BF16; after the GEMMs,
// k_moe_combine sums each token's expert outputs with its routing weights.

#define MOE_MAXE_PER_LANE 16 // E <= 512

// k_moe_route: one warp per token. logits (tokens, E) F32 ->
// sel (tokens, K) I32 experts in routing order, wts (tokens, K) F32;
// counts (E) += rows per expert (zeroed by the caller). As
// Qwen3MoeSparseMoeBlock and compute/cpu: p = softmax(logits) in fp32,
// top-K by p (ties: lower expert), weights p or p / sum of the K chosen.
DK_KERNEL void k_moe_route(const float *__restrict__ logits, i64 tokens, int E, int K, int norm, i32 *__restrict__ sel,
                           float *__restrict__ wts, i32 *__restrict__ counts) {
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
	for (int r = 0; r < MOE_MAXE_PER_LANE; r++) p[r] /= sum;
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

// k_moe_scatter: block b handles pair b = t*K + j: it takes the next row of
// expert sel[b]'s segment (offsets (E) from the host plan, cursor (E)
// zeroed), records it in rowpos (tokens*K), and writes token t's row of x
// (tokens, H) F32 there in xg (rows, H) BF16. Rows within a segment come in
// no particular order; each row's GEMM output does not depend on it.
DK_KERNEL void k_moe_scatter(const i32 *__restrict__ sel, const i32 *__restrict__ offsets, i32 *__restrict__ cursor,
                             i32 *__restrict__ rowpos, const float *__restrict__ x, u16 *__restrict__ xg, int K, int H) {
	__shared__ i32 pos;
	i64 b = blockIdx.x;
	if (threadIdx.x == 0) {
		int e = sel[b];
		pos = offsets[e] + atomicAdd(&cursor[e], 1);
		rowpos[b] = pos;
	}
	__syncthreads();
	const float *xr = x + (b / K) * (i64)H;
	u16 *dst = xg + (i64)pos * H;
	for (int c = threadIdx.x; c < H; c += blockDim.x) dst[c] = f2bf(xr[c]);
}

// k_moe_combine: out (tokens, H) = sum over the token's K experts, in
// ascending expert order (the CPU's summation order), of wts · y[rowpos]
// with y (rows, H) the experts' down projections. One block per token.
DK_KERNEL void k_moe_combine(float *__restrict__ out, const float *__restrict__ y, const i32 *__restrict__ sel,
                             const float *__restrict__ wts, const i32 *__restrict__ rowpos, int K, int H) {
	__shared__ i32 order[64];
	i64 t = blockIdx.x;
	if (threadIdx.x == 0) {
		for (int j = 0; j < K; j++) order[j] = j;
		for (int a = 1; a < K; a++) // insertion sort by expert id; K is small
			for (int b = a; b > 0 && sel[t * K + order[b]] < sel[t * K + order[b - 1]]; b--) {
				i32 tmp = order[b];
				order[b] = order[b - 1];
				order[b - 1] = tmp;
			}
	}
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

DK_REGISTER(k_moe_route)
DK_REGISTER(k_moe_scatter)
DK_REGISTER(k_moe_combine)
