// cudnn_sdpa.c builds cuDNN's fused attention (flash, forward and backward)
// for packed variable-length causal GQA, as operation graphs of cuDNN 9's
// backend API, and executes them. cudnn.go owns the plans and calls this.
//
// The graphs are the ones cuDNN's own frontend lowers its SDPA node to (the
// "composite" implementation that cuDNN's runtime fuses into one flash
// kernel): a matmul, the scale, the padding and causal masks, the softmax
// and a second matmul forward; the recomputed probabilities, dV, dP, dS, dK
// and dQ backward. The layout is THD: every [b, h, s, d] tensor of the
// samples is a ragged tensor over the packed token rows, with per-sample
// element offsets (the starts scaled by heads·head_dim) and per-sample
// lengths as the matmuls' M/N/K overrides, so no sample is padded in
// memory. Shapes in the comments: B samples (a bucket: the unused ones have
// length 0), H query heads, HK kv heads, S the longest sample (a bucket), D
// head_dim, T the packed tokens.
//
// A call whose B samples all have S tokens (k->fixed: B and S exact, T =
// B·S) gets the graph PyTorch's SDPA builds for a batch without padding:
// the same tensors as plain strided BSHD ones (sample b at row b·S), with
// no ragged offsets, no per-sample lengths and no padding mask, which
// leaves cuDNN free to pick its engines for regular tensors.
#include <stdio.h>
#include <string.h>

#include "cudnn_sdpa.h"

typedef int (*fn_create)(int, cudnnBackendDescriptor_t *);
typedef int (*fn_destroy)(cudnnBackendDescriptor_t);
typedef int (*fn_set)(cudnnBackendDescriptor_t, int, int, int64_t, const void *);
typedef int (*fn_get)(cudnnBackendDescriptor_t, int, int, int64_t, int64_t *, void *);
typedef int (*fn_finalize)(cudnnBackendDescriptor_t);
typedef int (*fn_execute)(cudnnHandle_t, cudnnBackendDescriptor_t, cudnnBackendDescriptor_t);
typedef const char *(*fn_errstr)(int);
typedef void (*fn_lasterr)(char *, size_t);

// builder carries one graph build: every descriptor it made (the plan
// keeps them until it is destroyed), and the first failure.
typedef struct {
	const distill_cudnn_api *api;
	cudnnHandle_t handle;
	distill_sdpa_plan *p;
	int64_t uid;   // the next virtual tensor's uid
	int version;   // cudnnGetVersion
	char *err;
	int errlen;
	int failed;
} builder;

// fail records the first failure: what was being done, cuDNN's status and
// its last error string.
static void fail(builder *b, const char *what, int st) {
	if (b->failed) return;
	b->failed = 1;
	char last[512] = "";
	if (b->api->getLastErrorString) ((fn_lasterr)b->api->getLastErrorString)(last, sizeof last);
	const char *s = b->api->getErrorString ? ((fn_errstr)b->api->getErrorString)(st) : "";
	snprintf(b->err, b->errlen, "%s: status %d (%s)%s%s", what, st, s ? s : "", last[0] ? ": " : "", last);
}

static cudnnBackendDescriptor_t mk(builder *b, int type, const char *what) {
	if (b->failed) return NULL;
	if (b->p->ndesc >= DISTILL_SDPA_MAX_DESC) {
		snprintf(b->err, b->errlen, "%s: more than %d descriptors", what, DISTILL_SDPA_MAX_DESC);
		b->failed = 1;
		return NULL;
	}
	cudnnBackendDescriptor_t d = NULL;
	int st = ((fn_create)b->api->createDesc)(type, &d);
	if (st != DK_CUDNN_STATUS_SUCCESS) {
		fail(b, what, st);
		return NULL;
	}
	b->p->desc[b->p->ndesc++] = d;
	return d;
}

static void set(builder *b, cudnnBackendDescriptor_t d, int name, int type, int64_t n, const void *v, const char *what) {
	if (b->failed) return;
	int st = ((fn_set)b->api->setAttr)(d, name, type, n, v);
	if (st != DK_CUDNN_STATUS_SUCCESS) {
		char w[160];
		snprintf(w, sizeof w, "%s: set attribute %d", what, name);
		fail(b, w, st);
	}
}

static void fin(builder *b, cudnnBackendDescriptor_t d, const char *what) {
	if (b->failed) return;
	int st = ((fn_finalize)b->api->finalize)(d);
	if (st != DK_CUDNN_STATUS_SUCCESS) {
		char w[160];
		snprintf(w, sizeof w, "%s: finalize", what);
		fail(b, w, st);
	}
}

static void setDesc(builder *b, cudnnBackendDescriptor_t d, int name, cudnnBackendDescriptor_t v, const char *what) {
	set(b, d, name, DK_CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v, what);
}

static void setI64(builder *b, cudnnBackendDescriptor_t d, int name, int64_t v, const char *what) {
	set(b, d, name, DK_CUDNN_TYPE_INT64, 1, &v, what);
}

static void setType(builder *b, cudnnBackendDescriptor_t d, int name, int v, const char *what) {
	set(b, d, name, DK_CUDNN_TYPE_DATA_TYPE, 1, &v, what);
}

static void setBool(builder *b, cudnnBackendDescriptor_t d, int name, int v, const char *what) {
	_Bool x = v != 0;
	set(b, d, name, DK_CUDNN_TYPE_BOOLEAN, 1, &x, what);
}

// tensor makes a 4-D tensor descriptor. uid 0 takes the next virtual uid.
static cudnnBackendDescriptor_t tensor(builder *b, const char *what, int dt, int64_t d0, int64_t d1, int64_t d2, int64_t d3,
                                       int64_t s0, int64_t s1, int64_t s2, int64_t s3, int64_t uid, int virt, int byval,
                                       cudnnBackendDescriptor_t ragged) {
	cudnnBackendDescriptor_t t = mk(b, DK_CUDNN_BACKEND_TENSOR_DESCRIPTOR, what);
	int64_t dim[4] = {d0, d1, d2, d3}, str[4] = {s0, s1, s2, s3};
	if (uid == 0) uid = b->uid++;
	setType(b, t, DK_CUDNN_ATTR_TENSOR_DATA_TYPE, dt, what);
	set(b, t, DK_CUDNN_ATTR_TENSOR_DIMENSIONS, DK_CUDNN_TYPE_INT64, 4, dim, what);
	set(b, t, DK_CUDNN_ATTR_TENSOR_STRIDES, DK_CUDNN_TYPE_INT64, 4, str, what);
	setI64(b, t, DK_CUDNN_ATTR_TENSOR_UNIQUE_ID, uid, what);
	setI64(b, t, DK_CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16, what);
	setBool(b, t, DK_CUDNN_ATTR_TENSOR_IS_VIRTUAL, virt, what);
	if (byval) setBool(b, t, DK_CUDNN_ATTR_TENSOR_IS_BY_VALUE, 1, what);
	if (ragged) setDesc(b, t, DK_CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, ragged, what);
	fin(b, t, what);
	return t;
}

// scalar is a by-value fp32 [1,1,1,1] tensor (its value is in the variant
// pack, as a host pointer).
static cudnnBackendDescriptor_t scalar(builder *b, const char *what, int64_t uid) {
	return tensor(b, what, DK_CUDNN_DATA_FLOAT, 1, 1, 1, 1, 1, 1, 1, 1, uid, 0, 1, NULL);
}

// virt4 is a virtual [d0,d1,d2,d3] tensor, packed row-major.
static cudnnBackendDescriptor_t virt4(builder *b, const char *what, int dt, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
	return tensor(b, what, dt, d0, d1, d2, d3, d1 * d2 * d3, d2 * d3, d3, 1, 0, 1, 0, NULL);
}

// op appends an operation to the graph's list.
static void op(builder *b, cudnnBackendDescriptor_t o, cudnnBackendDescriptor_t *ops, int *nops) {
	if (b->failed) return;
	if (*nops >= DISTILL_SDPA_MAX_OPS) {
		snprintf(b->err, b->errlen, "more than %d operations", DISTILL_SDPA_MAX_OPS);
		b->failed = 1;
		return;
	}
	ops[(*nops)++] = o;
}

// pw adds a pointwise operation y = mode(x, bb, t); bb and t may be NULL;
// axis < 0 leaves the axis unset (it is GEN_INDEX's).
static void pw(builder *b, const char *what, int mode, int prec, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t bb,
               cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, int64_t axis, cudnnBackendDescriptor_t *ops, int *nops) {
	cudnnBackendDescriptor_t d = mk(b, DK_CUDNN_BACKEND_POINTWISE_DESCRIPTOR, what);
	set(b, d, DK_CUDNN_ATTR_POINTWISE_MODE, DK_CUDNN_TYPE_POINTWISE_MODE, 1, &mode, what);
	setType(b, d, DK_CUDNN_ATTR_POINTWISE_MATH_PREC, prec, what);
	if (axis >= 0) setI64(b, d, DK_CUDNN_ATTR_POINTWISE_AXIS, axis, what);
	fin(b, d, what);
	cudnnBackendDescriptor_t o = mk(b, DK_CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, what);
	setDesc(b, o, DK_CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, d, what);
	setDesc(b, o, DK_CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, what);
	if (bb) setDesc(b, o, DK_CUDNN_ATTR_OPERATION_POINTWISE_BDESC, bb, what);
	if (t) setDesc(b, o, DK_CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t, what);
	setDesc(b, o, DK_CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, what);
	fin(b, o, what);
	op(b, o, ops, nops);
}

// mm adds C = A·B with the per-sample M, N and K overrides (any may be NULL).
static void mm(builder *b, const char *what, cudnnBackendDescriptor_t A, cudnnBackendDescriptor_t B, cudnnBackendDescriptor_t C,
               cudnnBackendDescriptor_t m, cudnnBackendDescriptor_t n, cudnnBackendDescriptor_t k, cudnnBackendDescriptor_t *ops,
               int *nops) {
	cudnnBackendDescriptor_t d = mk(b, DK_CUDNN_BACKEND_MATMUL_DESCRIPTOR, what);
	setType(b, d, DK_CUDNN_ATTR_MATMUL_COMP_TYPE, DK_CUDNN_DATA_FLOAT, what);
	fin(b, d, what);
	cudnnBackendDescriptor_t o = mk(b, DK_CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, what);
	setDesc(b, o, DK_CUDNN_ATTR_OPERATION_MATMUL_ADESC, A, what);
	setDesc(b, o, DK_CUDNN_ATTR_OPERATION_MATMUL_BDESC, B, what);
	setDesc(b, o, DK_CUDNN_ATTR_OPERATION_MATMUL_CDESC, C, what);
	setDesc(b, o, DK_CUDNN_ATTR_OPERATION_MATMUL_DESC, d, what);
	if (m) setDesc(b, o, DK_CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, m, what);
	if (n) setDesc(b, o, DK_CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, n, what);
	if (k) setDesc(b, o, DK_CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, k, what);
	fin(b, o, what);
	op(b, o, ops, nops);
}

// red adds y = reduce(x) over the dims where y is smaller.
static void red(builder *b, const char *what, int mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y,
                cudnnBackendDescriptor_t *ops, int *nops) {
	cudnnBackendDescriptor_t d = mk(b, DK_CUDNN_BACKEND_REDUCTION_DESCRIPTOR, what);
	setType(b, d, DK_CUDNN_ATTR_REDUCTION_COMP_TYPE, DK_CUDNN_DATA_FLOAT, what);
	set(b, d, DK_CUDNN_ATTR_REDUCTION_OPERATOR, DK_CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, what);
	if (b->version >= 91100) setBool(b, d, DK_CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, 0, what);
	fin(b, d, what);
	cudnnBackendDescriptor_t o = mk(b, DK_CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, what);
	setDesc(b, o, DK_CUDNN_ATTR_OPERATION_REDUCTION_DESC, d, what);
	setDesc(b, o, DK_CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, what);
	setDesc(b, o, DK_CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, what);
	fin(b, o, what);
	op(b, o, ops, nops);
}

// reshape adds y = x viewed with y's dims and strides (a transpose).
static void reshape(builder *b, const char *what, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y, cudnnBackendDescriptor_t *ops,
                    int *nops) {
	cudnnBackendDescriptor_t o = mk(b, DK_CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, what);
	setDesc(b, o, DK_CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x, what);
	setDesc(b, o, DK_CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y, what);
	fin(b, o, what);
	op(b, o, ops, nops);
}

// padded applies the padding mask (row < seq_q[b] and col < seq_kv[b]) to
// s: masked scores become -inf.
static cudnnBackendDescriptor_t padded(builder *b, cudnnBackendDescriptor_t s, cudnnBackendDescriptor_t seqQ, cudnnBackendDescriptor_t seqKV,
                                       int64_t B, int64_t H, int64_t S, cudnnBackendDescriptor_t *ops, int *nops) {
	const int F = DK_CUDNN_DATA_FLOAT, I = DK_CUDNN_DATA_INT32, L = DK_CUDNN_DATA_BOOLEAN;
	cudnnBackendDescriptor_t col = virt4(b, "padding col", I, B, H, S, S), colOK = virt4(b, "padding col ok", L, B, H, S, S);
	cudnnBackendDescriptor_t row = virt4(b, "padding row", I, B, H, S, S), rowOK = virt4(b, "padding row ok", L, B, H, S, S);
	cudnnBackendDescriptor_t ok = virt4(b, "padding ok", L, B, H, S, S), s1 = virt4(b, "padded scores", F, B, H, S, S);
	pw(b, "padding col", DK_CUDNN_POINTWISE_GEN_INDEX, I, s, NULL, NULL, col, 3, ops, nops);
	pw(b, "padding col ok", DK_CUDNN_POINTWISE_CMP_LT, L, col, seqKV, NULL, colOK, -1, ops, nops);
	pw(b, "padding row", DK_CUDNN_POINTWISE_GEN_INDEX, I, s, NULL, NULL, row, 2, ops, nops);
	pw(b, "padding row ok", DK_CUDNN_POINTWISE_CMP_LT, L, row, seqQ, NULL, rowOK, -1, ops, nops);
	pw(b, "padding ok", DK_CUDNN_POINTWISE_LOGICAL_AND, L, rowOK, colOK, NULL, ok, -1, ops, nops);
	pw(b, "padding select", DK_CUDNN_POINTWISE_BINARY_SELECT, F, s, scalar(b, "-inf (padding)", DISTILL_SDPA_UID_NEG_INF_PAD), ok, s1,
	   -1, ops, nops);
	return s1;
}

// masked applies the padding mask (the ragged graph's, seqQ set) to s,
// then, after the optional subtraction of stats (the backward's), the
// causal mask (row >= col); masked scores become -inf.
static cudnnBackendDescriptor_t masked(builder *b, cudnnBackendDescriptor_t s, cudnnBackendDescriptor_t seqQ, cudnnBackendDescriptor_t seqKV,
                                       cudnnBackendDescriptor_t stats, int64_t B, int64_t H, int64_t S, cudnnBackendDescriptor_t *ops,
                                       int *nops) {
	const int F = DK_CUDNN_DATA_FLOAT, I = DK_CUDNN_DATA_INT32, L = DK_CUDNN_DATA_BOOLEAN;
	cudnnBackendDescriptor_t s1 = s;
	if (seqQ) s1 = padded(b, s, seqQ, seqKV, B, H, S, ops, nops);
	if (stats) {
		cudnnBackendDescriptor_t s2 = virt4(b, "scores - stats", F, B, H, S, S);
		pw(b, "scores - stats", DK_CUDNN_POINTWISE_SUB, F, s1, stats, NULL, s2, -1, ops, nops);
		s1 = s2;
	}
	cudnnBackendDescriptor_t r = virt4(b, "causal row", I, B, H, S, S), c = virt4(b, "causal col", I, B, H, S, S);
	cudnnBackendDescriptor_t keep = virt4(b, "causal keep", L, B, H, S, S), out = virt4(b, "causal scores", F, B, H, S, S);
	pw(b, "causal col", DK_CUDNN_POINTWISE_GEN_INDEX, F, s1, NULL, NULL, c, 3, ops, nops);
	pw(b, "causal row", DK_CUDNN_POINTWISE_GEN_INDEX, F, s1, NULL, NULL, r, 2, ops, nops);
	pw(b, "causal keep", DK_CUDNN_POINTWISE_CMP_GE, L, r, c, NULL, keep, -1, ops, nops);
	pw(b, "causal select", DK_CUDNN_POINTWISE_BINARY_SELECT, F, s1, scalar(b, "-inf (causal)", DISTILL_SDPA_UID_NEG_INF_CAUSAL), keep, out,
	   -1, ops, nops);
	return out;
}

// kvGrad adds a kv gradient out [B,HK,S,D] = At·X over the samples' M =
// seqKV keys and K = seqQ queries: directly for MHA, else per query head
// into a virtual [B,H,S,D] and summed over each kv head's group.
static void kvGrad(builder *b, const char *what, cudnnBackendDescriptor_t At, cudnnBackendDescriptor_t X, cudnnBackendDescriptor_t out,
                   cudnnBackendDescriptor_t seqKV, cudnnBackendDescriptor_t seqQ, int64_t B, int64_t H, int64_t HK, int64_t S, int64_t D,
                   cudnnBackendDescriptor_t *ops, int *nops) {
	if (H == HK) {
		mm(b, what, At, X, out, seqKV, NULL, seqQ, ops, nops);
		return;
	}
	cudnnBackendDescriptor_t full = virt4(b, "per query head", DK_CUDNN_DATA_BFLOAT16, B, H, S, D);
	mm(b, what, At, X, full, seqKV, NULL, seqQ, ops, nops);
	red(b, "over the group", DK_CUDNN_REDUCE_TENSOR_ADD, full, out, ops, nops);
}

// plan finalizes the operation graph, asks heuristics mode A for engine
// configurations and keeps the first that finalizes into an execution plan
// (skipping non-deterministic engines when det is set).
static void plan(builder *b, cudnnBackendDescriptor_t *ops, int nops, int det) {
	if (b->failed) return;
	cudnnBackendDescriptor_t g = mk(b, DK_CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
	set(b, g, DK_CUDNN_ATTR_OPERATIONGRAPH_OPS, DK_CUDNN_TYPE_BACKEND_DESCRIPTOR, nops, ops, "operation graph");
	set(b, g, DK_CUDNN_ATTR_OPERATIONGRAPH_HANDLE, DK_CUDNN_TYPE_HANDLE, 1, &b->handle, "operation graph");
	fin(b, g, "operation graph");
	cudnnBackendDescriptor_t h = mk(b, DK_CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
	setDesc(b, h, DK_CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, g, "heuristics");
	int mode = DK_CUDNN_HEUR_MODE_A;
	set(b, h, DK_CUDNN_ATTR_ENGINEHEUR_MODE, DK_CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics");
	fin(b, h, "heuristics");
	if (b->failed) return;
	int64_t n = 0;
	int st = ((fn_get)b->api->getAttr)(h, DK_CUDNN_ATTR_ENGINEHEUR_RESULTS, DK_CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, NULL);
	if (st != DK_CUDNN_STATUS_SUCCESS) {
		fail(b, "heuristics: results count", st);
		return;
	}
	if (n <= 0) {
		snprintf(b->err, b->errlen, "heuristics: cuDNN has no engine for this graph");
		b->failed = 1;
		return;
	}
	if (n > 16) n = 16;
	cudnnBackendDescriptor_t cfg[16];
	for (int64_t i = 0; i < n; i++) cfg[i] = mk(b, DK_CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config");
	if (b->failed) return;
	int64_t got = 0;
	st = ((fn_get)b->api->getAttr)(h, DK_CUDNN_ATTR_ENGINEHEUR_RESULTS, DK_CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &got, cfg);
	if (st != DK_CUDNN_STATUS_SUCCESS) {
		fail(b, "heuristics: results", st);
		return;
	}
	char why[512] = "";
	int wl = 0;
	for (int64_t i = 0; i < got; i++) {
		// The engine: its index and numerical notes.
		cudnnBackendDescriptor_t e = mk(b, DK_CUDNN_BACKEND_ENGINE_DESCRIPTOR, "engine");
		if (b->failed) return;
		int64_t cnt = 0, gi = -1;
		((fn_get)b->api->getAttr)(cfg[i], DK_CUDNN_ATTR_ENGINECFG_ENGINE, DK_CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cnt, &e);
		((fn_get)b->api->getAttr)(e, DK_CUDNN_ATTR_ENGINE_GLOBAL_INDEX, DK_CUDNN_TYPE_INT64, 1, &cnt, &gi);
		int notes[16];
		int64_t nn = 0;
		int nondet = 0;
		if (((fn_get)b->api->getAttr)(e, DK_CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, DK_CUDNN_TYPE_NUMERICAL_NOTE, 16, &nn, notes) ==
		    DK_CUDNN_STATUS_SUCCESS) {
			for (int64_t j = 0; j < nn && j < 16; j++) nondet |= notes[j] == DK_CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
		}
		if (det && nondet) {
			wl += snprintf(why + wl, sizeof why - wl > 0 ? sizeof why - wl : 0, "%sengine %lld: non-deterministic", wl ? "; " : "",
			               (long long)gi);
			continue;
		}
		cudnnBackendDescriptor_t pl = mk(b, DK_CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
		if (b->failed) return;
		st = ((fn_set)b->api->setAttr)(pl, DK_CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, DK_CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg[i]);
		// The plan takes its handle from the graph; cuDNN's frontend sets
		// none here either.
		if (st == DK_CUDNN_STATUS_SUCCESS) st = ((fn_finalize)b->api->finalize)(pl);
		if (st != DK_CUDNN_STATUS_SUCCESS) {
			char last[256] = "";
			if (b->api->getLastErrorString) ((fn_lasterr)b->api->getLastErrorString)(last, sizeof last);
			if (wl < (int)sizeof why - 1)
				wl += snprintf(why + wl, sizeof why - wl, "%sengine %lld: status %d %s", wl ? "; " : "", (long long)gi, st, last);
			continue;
		}
		int64_t ws = 0;
		((fn_get)b->api->getAttr)(pl, DK_CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, DK_CUDNN_TYPE_INT64, 1, &cnt, &ws);
		b->p->plan = pl;
		b->p->workspace = ws;
		b->p->engine = gi;
		b->p->nondet = nondet;
		return;
	}
	snprintf(b->err, b->errlen, "no engine config finalized (%lld offered: %s)", (long long)got, why);
	b->failed = 1;
}

int distill_sdpa_build(const distill_cudnn_api *api, cudnnHandle_t handle, const distill_sdpa_key *k, distill_sdpa_plan *p, char *err,
                       int errlen) {
	memset(p, 0, sizeof *p);
	builder bb = {api, handle, p, 100, (int)((size_t(*)(void))api->getVersion)(), err, errlen, 0};
	builder *b = &bb;
	const int F = DK_CUDNN_DATA_FLOAT, BF = DK_CUDNN_DATA_BFLOAT16, I = DK_CUDNN_DATA_INT32;
	const int64_t B = k->b, H = k->h, HK = k->hkv, S = k->s, D = k->d, X = 2147483647;
	cudnnBackendDescriptor_t ops[DISTILL_SDPA_MAX_OPS];
	int nops = 0;

	// Per-sample lengths [B,1,1,1] and element offsets [B+1,1,1,1]; none
	// when every sample has S tokens (fixed): then the batch strides are
	// the samples' (XQ, XK, XS: S rows of q, of k and v, of the stats).
	cudnnBackendDescriptor_t seqQ = NULL, seqKV = NULL, offQ = NULL, offK = NULL, offS = NULL;
	int64_t XQ = S * H * D, XK = S * HK * D;
	if (!k->fixed) {
		seqQ = tensor(b, "seq_len_q", I, B, 1, 1, 1, 1, 1, 1, 1, DISTILL_SDPA_UID_SEQ_Q, 0, 0, NULL);
		seqKV = tensor(b, "seq_len_kv", I, B, 1, 1, 1, 1, 1, 1, 1, DISTILL_SDPA_UID_SEQ_KV, 0, 0, NULL);
		offQ = tensor(b, "offsets q", I, B + 1, 1, 1, 1, 1, 1, 1, 1, DISTILL_SDPA_UID_OFF_Q, 0, 0, NULL);
		offK = tensor(b, "offsets kv", I, B + 1, 1, 1, 1, 1, 1, 1, 1, DISTILL_SDPA_UID_OFF_KV, 0, 0, NULL);
		offS = tensor(b, "offsets stats", I, B + 1, 1, 1, 1, 1, 1, 1, 1, DISTILL_SDPA_UID_OFF_STATS, 0, 0, NULL);
		XQ = XK = X; // the offsets place each sample
	}
	// q (T,H,D) as [B,H,S,D]; k (T,HK,D) as kᵀ [B,HK,D,S]; v (T,HK,D) as [B,HK,S,D].
	cudnnBackendDescriptor_t Q = tensor(b, "q", BF, B, H, S, D, XQ, D, H * D, 1, DISTILL_SDPA_UID_Q, 0, 0, offQ);
	cudnnBackendDescriptor_t Kt = tensor(b, "kᵀ", BF, B, HK, D, S, XK, D, 1, HK * D, DISTILL_SDPA_UID_K, 0, 0, offK);
	// stats (T,H) as [B,H,S,1].
	cudnnBackendDescriptor_t stats = tensor(b, "stats", F, B, H, S, 1, S * H, 1, H, 1, DISTILL_SDPA_UID_STATS, 0, 0, offS);
	cudnnBackendDescriptor_t scale = scalar(b, "scale", DISTILL_SDPA_UID_SCALE);

	// s = scale·q·kᵀ [B,H,S,S], each sample's M x N corner only.
	cudnnBackendDescriptor_t s0 = virt4(b, "q·kᵀ", F, B, H, S, S), s = virt4(b, "scores", F, B, H, S, S);
	mm(b, "q·kᵀ", Q, Kt, s0, seqQ, seqKV, NULL, ops, &nops);
	pw(b, "scale", DK_CUDNN_POINTWISE_MUL, F, s0, scale, NULL, s, -1, ops, &nops);

	if (!k->bwd) {
		cudnnBackendDescriptor_t V = tensor(b, "v", BF, B, HK, S, D, XK, D, HK * D, 1, DISTILL_SDPA_UID_V, 0, 0, offK);
		cudnnBackendDescriptor_t O = tensor(b, "out", BF, B, H, S, D, XQ, D, H * D, 1, DISTILL_SDPA_UID_O, 0, 0, offQ);
		cudnnBackendDescriptor_t m = masked(b, s, seqQ, seqKV, NULL, B, H, S, ops, &nops);
		// Softmax with its statistics: stats = max + log Σ exp(s - max).
		cudnnBackendDescriptor_t mx = virt4(b, "row max", F, B, H, S, 1), sh = virt4(b, "s - max", F, B, H, S, S);
		cudnnBackendDescriptor_t e = virt4(b, "exp", F, B, H, S, S), z = virt4(b, "row sum", F, B, H, S, 1);
		cudnnBackendDescriptor_t lz = virt4(b, "log sum", F, B, H, S, 1), P = virt4(b, "probabilities", BF, B, H, S, S);
		red(b, "row max", DK_CUDNN_REDUCE_TENSOR_MAX, m, mx, ops, &nops);
		pw(b, "s - max", DK_CUDNN_POINTWISE_SUB, F, m, mx, NULL, sh, -1, ops, &nops);
		pw(b, "exp", DK_CUDNN_POINTWISE_EXP, F, sh, NULL, NULL, e, -1, ops, &nops);
		red(b, "row sum", DK_CUDNN_REDUCE_TENSOR_ADD, e, z, ops, &nops);
		pw(b, "log sum", DK_CUDNN_POINTWISE_LOG, F, z, NULL, NULL, lz, -1, ops, &nops);
		pw(b, "stats", DK_CUDNN_POINTWISE_ADD, F, mx, lz, NULL, stats, -1, ops, &nops);
		pw(b, "probabilities", DK_CUDNN_POINTWISE_DIV, F, e, z, NULL, P, -1, ops, &nops);
		// out = p·v, over each sample's K = seq_kv keys.
		mm(b, "p·v", P, V, O, seqQ, NULL, seqKV, ops, &nops);
		plan(b, ops, nops, 0);
		return b->failed ? -1 : 0;
	}

	// The backward. vᵀ [B,HK,D,S]; out, dout, dq [B,H,S,D]; dk, dv [B,HK,S,D].
	cudnnBackendDescriptor_t Vt = tensor(b, "vᵀ", BF, B, HK, D, S, XK, D, 1, HK * D, DISTILL_SDPA_UID_V, 0, 0, offK);
	cudnnBackendDescriptor_t O = tensor(b, "out", BF, B, H, S, D, XQ, D, H * D, 1, DISTILL_SDPA_UID_O, 0, 0, offQ);
	cudnnBackendDescriptor_t dO = tensor(b, "dout", BF, B, H, S, D, XQ, D, H * D, 1, DISTILL_SDPA_UID_DO, 0, 0, offQ);
	cudnnBackendDescriptor_t dQ = tensor(b, "dq", BF, B, H, S, D, XQ, D, H * D, 1, DISTILL_SDPA_UID_DQ, 0, 0, offQ);
	cudnnBackendDescriptor_t dK = tensor(b, "dk", BF, B, HK, S, D, XK, D, HK * D, 1, DISTILL_SDPA_UID_DK, 0, 0, offK);
	cudnnBackendDescriptor_t dV = tensor(b, "dv", BF, B, HK, S, D, XK, D, HK * D, 1, DISTILL_SDPA_UID_DV, 0, 0, offK);

	// Σ_d dout·out per row (the softmax backward's row term), kept in the
	// workspace: ragged like the stats (T·H floats), so its size follows
	// the tokens, not B·S; dense [B,H,S,1] where cuDNN refuses that.
	cudnnBackendDescriptor_t doo = tensor(b, "dout·out", F, B, H, S, D, H * S * D, S * D, H * D, 1, 0, 1, 0, NULL);
	cudnnBackendDescriptor_t rs = virt4(b, "Σ dout·out", F, B, H, S, 1);
	cudnnBackendDescriptor_t ssum =
	    k->dense_ws ? tensor(b, "softmax sum", F, B, H, S, 1, H * S, S, 1, 1, DISTILL_SDPA_UID_SOFTMAX_SUM, 0, 0, NULL)
	                : tensor(b, "softmax sum", F, B, H, S, 1, S * H, 1, H, 1, DISTILL_SDPA_UID_SOFTMAX_SUM, 0, 0, offS);
	pw(b, "dout·out", DK_CUDNN_POINTWISE_MUL, F, dO, O, NULL, doo, -1, ops, &nops);
	red(b, "Σ dout·out", DK_CUDNN_REDUCE_TENSOR_ADD, doo, rs, ops, &nops);
	pw(b, "softmax sum", DK_CUDNN_POINTWISE_MUL, F, rs, scalar(b, "one", DISTILL_SDPA_UID_ONE), NULL, ssum, -1, ops, &nops);

	// p = exp(s - stats), recomputed; pᵀ in BF16 for dv = pᵀ·dout.
	cudnnBackendDescriptor_t m = masked(b, s, seqQ, seqKV, stats, B, H, S, ops, &nops);
	cudnnBackendDescriptor_t P = virt4(b, "p", F, B, H, S, S);
	cudnnBackendDescriptor_t Pt = tensor(b, "pᵀ", BF, B, H, S, S, H * S * S, S * S, 1, S, 0, 1, 0, NULL);
	pw(b, "p", DK_CUDNN_POINTWISE_EXP, F, m, NULL, NULL, P, -1, ops, &nops);
	reshape(b, "pᵀ", P, Pt, ops, &nops);
	kvGrad(b, "pᵀ·dout", Pt, dO, dV, seqKV, seqQ, B, H, HK, S, D, ops, &nops);

	// ds = scale · p ∘ (dout·vᵀ - Σ dout·out).
	cudnnBackendDescriptor_t dP = virt4(b, "dout·vᵀ", F, B, H, S, S), d1 = virt4(b, "dp - sum", F, B, H, S, S);
	cudnnBackendDescriptor_t d2 = virt4(b, "p∘(dp - sum)", F, B, H, S, S), dS = virt4(b, "ds", F, B, H, S, S);
	cudnnBackendDescriptor_t dSt = tensor(b, "dsᵀ", BF, B, H, S, S, H * S * S, S * S, 1, S, 0, 1, 0, NULL);
	mm(b, "dout·vᵀ", dO, Vt, dP, seqQ, seqKV, NULL, ops, &nops);
	pw(b, "dp - sum", DK_CUDNN_POINTWISE_SUB, F, dP, ssum, NULL, d1, -1, ops, &nops);
	pw(b, "p∘(dp - sum)", DK_CUDNN_POINTWISE_MUL, F, d1, P, NULL, d2, -1, ops, &nops);
	pw(b, "ds", DK_CUDNN_POINTWISE_MUL, F, d2, scale, NULL, dS, -1, ops, &nops);

	// dk = dsᵀ·q.
	reshape(b, "dsᵀ", dS, dSt, ops, &nops);
	kvGrad(b, "dsᵀ·q", dSt, Q, dK, seqKV, seqQ, B, H, HK, S, D, ops, &nops);

	// dq = ds·k. The non-deterministic engines accumulate it in fp32 in the
	// workspace (ragged like dq) with atomics, then convert; the
	// deterministic graph writes dq directly.
	// k [B,HK,S,D], viewed in fp32 as cuDNN's frontend does for ds·k.
	cudnnBackendDescriptor_t Kn = tensor(b, "k", F, B, HK, S, D, XK, D, HK * D, 1, 0, 1, 0, offK);
	reshape(b, "k", Kt, Kn, ops, &nops);
	if (k->det) {
		mm(b, "ds·k", dS, Kn, dQ, seqQ, NULL, seqKV, ops, &nops);
	} else {
		cudnnBackendDescriptor_t acc =
		    k->dense_ws ? tensor(b, "dq accumulator", F, B, H, S, D, H * S * D, S * D, D, 1, DISTILL_SDPA_UID_DQ_ACCUM, 0, 0, NULL)
		                : tensor(b, "dq accumulator", F, B, H, S, D, XQ, D, H * D, 1, DISTILL_SDPA_UID_DQ_ACCUM, 0, 0, offQ);
		mm(b, "ds·k", dS, Kn, acc, seqQ, NULL, seqKV, ops, &nops);
		pw(b, "dq", DK_CUDNN_POINTWISE_IDENTITY, F, acc, NULL, NULL, dQ, -1, ops, &nops);
	}
	plan(b, ops, nops, k->det);
	return b->failed ? -1 : 0;
}

int distill_sdpa_execute(const distill_cudnn_api *api, cudnnHandle_t handle, distill_sdpa_plan *p, int n, const int64_t *uids,
                         void *const *ptrs, uint64_t workspace_addr, char *err, int errlen) {
	void *workspace = (void *)(uintptr_t)workspace_addr;
	cudnnBackendDescriptor_t vp = NULL;
	int st = ((fn_create)api->createDesc)(DK_CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp);
	const char *what = "variant pack";
	if (st == DK_CUDNN_STATUS_SUCCESS)
		st = ((fn_set)api->setAttr)(vp, DK_CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, DK_CUDNN_TYPE_INT64, n, uids);
	if (st == DK_CUDNN_STATUS_SUCCESS)
		st = ((fn_set)api->setAttr)(vp, DK_CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, DK_CUDNN_TYPE_VOID_PTR, n, ptrs);
	if (st == DK_CUDNN_STATUS_SUCCESS)
		st = ((fn_set)api->setAttr)(vp, DK_CUDNN_ATTR_VARIANT_PACK_WORKSPACE, DK_CUDNN_TYPE_VOID_PTR, 1, &workspace);
	if (st == DK_CUDNN_STATUS_SUCCESS) st = ((fn_finalize)api->finalize)(vp);
	if (st == DK_CUDNN_STATUS_SUCCESS) {
		what = "execute";
		st = ((fn_execute)api->execute)(handle, p->plan, vp);
	}
	if (st != DK_CUDNN_STATUS_SUCCESS) {
		char last[512] = "";
		if (api->getLastErrorString) ((fn_lasterr)api->getLastErrorString)(last, sizeof last);
		const char *s = api->getErrorString ? ((fn_errstr)api->getErrorString)(st) : "";
		snprintf(err, errlen, "%s: status %d (%s)%s%s", what, st, s ? s : "", last[0] ? ": " : "", last);
	}
	if (vp) ((fn_destroy)api->destroyDesc)(vp);
	return st;
}

void distill_sdpa_destroy(const distill_cudnn_api *api, distill_sdpa_plan *p) {
	// In reverse: the plan before its config, ops before their tensors.
	for (int i = p->ndesc - 1; i >= 0; i--)
		if (p->desc[i]) ((fn_destroy)api->destroyDesc)(p->desc[i]);
	p->ndesc = 0;
	p->plan = NULL;
}
