// cudnn_check.cpp: checks the emulator's cuDNN stand-in (emu_cudnn.cpp)
// through its C entry points, as a caller of libcudnn would: graphs built
// with the backend API, executed on emulator device memory, compared with
// double-precision references. TestEmuCUDNN (compute/cuda) builds it with
// g++ against the emulator library and runs it; it prints "ok <name>" per
// check and exits non-zero on the first broken expectation.
#include "../cudnn_abi.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

extern "C" {
size_t cudnnGetVersion(void);
const char *cudnnGetErrorString(int);
void cudnnGetLastErrorString(char *, size_t);
int cudnnCreate(void **);
int cudnnDestroy(void *);
int cudnnSetStream(void *, void *);
int cudnnBackendCreateDescriptor(int, void **);
int cudnnBackendDestroyDescriptor(void *);
int cudnnBackendSetAttribute(void *, int, int, int64_t, const void *);
int cudnnBackendGetAttribute(void *, int, int, int64_t, int64_t *, void *);
int cudnnBackendFinalize(void *);
int cudnnBackendExecute(void *, void *, void *);
int cuMemAlloc_v2(unsigned long long *, size_t);
int cuMemFree_v2(unsigned long long);
}

typedef std::array<int64_t, 4> Dims;

static std::string last_error() {
	char b[4096];
	cudnnGetLastErrorString(b, sizeof b);
	return b;
}

#define CHECK(call)                                                                                                            \
	do {                                                                                                                       \
		int s_ = (call);                                                                                                       \
		if (s_) {                                                                                                              \
			fprintf(stderr, "%s:%d: %s = %d (%s): %s\n", __FILE__, __LINE__, #call, s_, cudnnGetErrorString(s_), last_error().c_str()); \
			exit(1);                                                                                                           \
		}                                                                                                                      \
	} while (0)
#define EXPECT(cond, ...)                                                                                                      \
	do {                                                                                                                       \
		if (!(cond)) {                                                                                                         \
			fprintf(stderr, "%s:%d: FAIL %s: ", __FILE__, __LINE__, #cond);                                                   \
			fprintf(stderr, __VA_ARGS__);                                                                                      \
			fputc('\n', stderr);                                                                                               \
			exit(1);                                                                                                           \
		}                                                                                                                      \
	} while (0)

// expect_fail checks that status is an error whose message contains want.
static void expect_fail(int status, const char *want, const char *what, int line) {
	std::string msg = last_error();
	if (status == 0 || msg.find(want) == std::string::npos) {
		fprintf(stderr, "cudnn_check.cpp:%d: %s: want a failure mentioning \"%s\", got status %d, last error %s\n", line, what, want, status,
		        msg.c_str());
		exit(1);
	}
	printf("  refused as expected (%s): %s\n", what, msg.c_str());
}
#define EXPECT_FAIL(call, want) expect_fail((call), want, #call, __LINE__)

template <class T> static T *dalloc(size_t n) {
	unsigned long long p;
	if (cuMemAlloc_v2(&p, n * sizeof(T))) {
		fprintf(stderr, "cuMemAlloc failed\n");
		exit(1);
	}
	return (T *)p;
}
static void dfree(void *p) { cuMemFree_v2((unsigned long long)p); }

static uint16_t f2bf(float f) {
	uint32_t u;
	memcpy(&u, &f, 4);
	u += 0x7fffu + ((u >> 16) & 1);
	return (uint16_t)(u >> 16);
}
static float bf2f(uint16_t h) {
	uint32_t u = (uint32_t)h << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

static Dims dense(Dims d) { return {d[1] * d[2] * d[3], d[2] * d[3], d[3], 1}; }
static const int64_t kBig = INT32_MAX; // a ragged tensor's (ignored) batch stride

// ---------------------------------------------------------------- a graph builder

struct Builder {
	void *h = nullptr;
	std::vector<void *> owned;
	int status = 0; // the last finalize's status, when try_ is set
	bool try_ = false;

	Builder() { CHECK(cudnnCreate(&h)); }
	~Builder() {
		for (void *d : owned) cudnnBackendDestroyDescriptor(d);
		cudnnDestroy(h);
	}
	void *mk(int type) {
		void *d;
		CHECK(cudnnBackendCreateDescriptor(type, &d));
		owned.push_back(d);
		return d;
	}
	void set(void *d, int name, int type, int64_t n, const void *v) { CHECK(cudnnBackendSetAttribute(d, name, type, n, v)); }
	void setd(void *d, int name, void *v) { set(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v); }
	void *fin(void *d) {
		int s = cudnnBackendFinalize(d);
		if (try_) status = s;
		else CHECK(s);
		return d;
	}

	void *tensor(int64_t uid, int dt, Dims dims, Dims st, bool virt = false, bool byval = false, void *ragged = nullptr) {
		void *d = mk(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
		int64_t align = 16;
		set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
		set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
		set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, st.data());
		set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
		set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
		if (virt) set(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt);
		if (byval) set(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &byval);
		if (ragged) setd(d, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, ragged);
		return fin(d);
	}
	int64_t next_virtual = 1000;
	void *virt(int dt, Dims dims) { return tensor(next_virtual++, dt, dims, dense(dims), true); }
	void *virt_st(int dt, Dims dims, Dims st, void *ragged = nullptr) { return tensor(next_virtual++, dt, dims, st, true, false, ragged); }
	void *scalar(int64_t uid) { return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true); }

	void *pw(int mode, void *x, void *y, void *b = nullptr, void *t = nullptr, int64_t axis = -1, int prec = CUDNN_DATA_FLOAT) {
		void *p = mk(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
		set(p, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
		set(p, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
		if (axis >= 0) set(p, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
		CHECK(cudnnBackendFinalize(p));
		void *o = mk(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
		setd(o, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, p);
		setd(o, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
		if (b) setd(o, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
		if (t) setd(o, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
		setd(o, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
		float one = 1;
		set(o, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
		return fin(o);
	}
	void *mm(void *a, void *b, void *c, void *mo = nullptr, void *no = nullptr, void *ko = nullptr) {
		void *m = mk(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
		int f = CUDNN_DATA_FLOAT;
		set(m, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f);
		CHECK(cudnnBackendFinalize(m));
		void *o = mk(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
		setd(o, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
		setd(o, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
		setd(o, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
		setd(o, CUDNN_ATTR_OPERATION_MATMUL_DESC, m);
		if (mo) setd(o, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, mo);
		if (no) setd(o, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, no);
		if (ko) setd(o, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, ko);
		return fin(o);
	}
	void *red(int op, void *x, void *y) {
		void *r = mk(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
		int f = CUDNN_DATA_FLOAT;
		bool det = true;
		set(r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &op);
		set(r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f);
		set(r, CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, CUDNN_TYPE_BOOLEAN, 1, &det);
		CHECK(cudnnBackendFinalize(r));
		void *o = mk(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
		setd(o, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
		setd(o, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
		setd(o, CUDNN_ATTR_OPERATION_REDUCTION_DESC, r);
		return fin(o);
	}
	void *reshape(void *x, void *y) {
		void *o = mk(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
		setd(o, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
		setd(o, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
		return fin(o);
	}
	void *graph(std::vector<void *> ops) {
		void *g = mk(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
		set(g, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, (int64_t)ops.size(), ops.data());
		set(g, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
		return fin(g);
	}

	struct Plan {
		void *plan = nullptr;
		int64_t ws = 0, index = -1;
		std::vector<int> notes;
	};
	// plan: heuristics, the first engine config, its engine's notes, a plan.
	Plan plan(void *graph) {
		void *heur = mk(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
		int mode = CUDNN_HEUR_MODE_A;
		setd(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
		set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
		CHECK(cudnnBackendFinalize(heur));
		int64_t n = -1;
		CHECK(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, nullptr));
		EXPECT(n >= 1 && n <= 2, "heuristics offer %lld configs", (long long)n);
		std::vector<void *> cfgs;
		for (int64_t i = 0; i < n; i++) cfgs.push_back(mk(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
		int64_t got = -1;
		CHECK(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &got, cfgs.data()));
		EXPECT(got == n, "got %lld of %lld configs", (long long)got, (long long)n);
		Plan p;
		void *eng = mk(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
		CHECK(cudnnBackendGetAttribute(cfgs[0], CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &got, &eng));
		CHECK(cudnnBackendGetAttribute(eng, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &got, &p.index));
		int notes[10];
		CHECK(cudnnBackendGetAttribute(eng, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE, 10, &got, notes));
		p.notes.assign(notes, notes + got);
		int64_t cws = -1;
		CHECK(cudnnBackendGetAttribute(cfgs[0], CUDNN_ATTR_ENGINECFG_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got, &cws));
		p.plan = mk(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
		setd(p.plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[0]);
		set(p.plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
		CHECK(cudnnBackendFinalize(p.plan));
		CHECK(cudnnBackendGetAttribute(p.plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got, &p.ws));
		EXPECT(p.ws == cws && p.ws > 0, "plan workspace %lld, config's %lld", (long long)p.ws, (long long)cws);
		return p;
	}
	// exec runs plan p with the variant pack (uid, pointer)..., returning
	// cudnnBackendExecute's status (or the pack's finalize status).
	int exec(const Plan &p, const std::vector<std::pair<int64_t, void *>> &pack, void *ws) {
		void *vp = mk(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
		std::vector<int64_t> uids;
		std::vector<void *> ptrs;
		for (auto &e : pack) {
			uids.push_back(e.first);
			ptrs.push_back(e.second);
		}
		set(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, (int64_t)uids.size(), uids.data());
		set(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, (int64_t)ptrs.size(), ptrs.data());
		if (ws) set(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
		if (int s = cudnnBackendFinalize(vp)) return s;
		return cudnnBackendExecute(h, p.plan, vp);
	}
};

static std::mt19937 g_rng(12345);
static float urand() { return std::uniform_real_distribution<float>(-1, 1)(g_rng); }

// ---------------------------------------------------------------- checks

// A batched matmul whose B has fewer heads (grouped like repeat_kv) and is
// stored transposed, against a double reference.
static void check_matmul_broadcast() {
	Builder g;
	const Dims ad = {2, 4, 3, 5}, bd = {2, 2, 5, 6}, cd = {2, 4, 3, 6};
	const Dims bst = {60, 30, 1, 5}; // B[b,h,k,n] at b*60 + h*30 + k + n*5
	void *A = g.tensor(1, CUDNN_DATA_FLOAT, ad, dense(ad)), *B = g.tensor(2, CUDNN_DATA_FLOAT, bd, bst),
	     *C = g.tensor(3, CUDNN_DATA_FLOAT, cd, dense(cd));
	auto plan = g.plan(g.graph({g.mm(A, B, C)}));
	EXPECT(plan.notes.empty(), "a plain matmul has %zu numerical notes", plan.notes.size());
	float *a = dalloc<float>(120), *b = dalloc<float>(120), *c = dalloc<float>(144);
	char *ws = dalloc<char>(plan.ws);
	memset(ws, 0, plan.ws);
	for (int i = 0; i < 120; i++) a[i] = urand(), b[i] = urand();
	CHECK(g.exec(plan, {{1, a}, {2, b}, {3, c}}, ws));
	for (int bi = 0; bi < 2; bi++)
		for (int h = 0; h < 4; h++)
			for (int m = 0; m < 3; m++)
				for (int n = 0; n < 6; n++) {
					double want = 0;
					for (int k = 0; k < 5; k++) want += (double)a[bi * 60 + h * 15 + m * 5 + k] * b[bi * 60 + (h / 2) * 30 + k + n * 5];
					float got = c[bi * 72 + h * 18 + m * 6 + n];
					EXPECT(fabs(got - want) < 1e-5, "C[%d,%d,%d,%d] = %g, want %g", bi, h, m, n, got, want);
				}
	unsigned char poison[16];
	memset(poison, 0xff, sizeof poison);
	EXPECT(!memcmp(ws, poison, 16), "the workspace is not poisoned after execution");
	dfree(a), dfree(b), dfree(c), dfree(ws);
	printf("ok matmul_broadcast_heads\n");
}

// Ragged A and C (packed tokens, a spare token after each sample) with an
// M override: only rows < M of each sample are written; then the writes and
// reads that would cross into the next sample are refused.
static void check_ragged_override() {
	const int B = 3, H = 2, S = 5, K = 4, N = 3;
	const int seq[B] = {2, 5, 3};
	int cum[B + 1] = {0};
	for (int b = 0; b < B; b++) cum[b + 1] = cum[b] + seq[b];
	const int tokens = cum[B] + B; // a spare token after each sample
	const float sentinel = 777;
	for (int variant = 0; variant < 3; variant++) {
		// 0: spare tokens, M = seq: fine. 1: packed C, dense A, M[0] = 3 > the
		// 2 rows C's offsets give sample 0: refused before writing. 2: packed
		// A, M[0] = 3: A's sample 0 holds only 2 rows: refused.
		Builder g;
		int32_t *offa = dalloc<int32_t>(B + 1), *offc = dalloc<int32_t>(B + 1), *mo = dalloc<int32_t>(B);
		for (int b = 0; b <= B; b++) {
			int tok = variant == 0 ? cum[b] + b : cum[b];
			offa[b] = tok * H * K;
			offc[b] = tok * H * N;
		}
		for (int b = 0; b < B; b++) mo[b] = variant == 0 ? seq[b] : b == 0 ? 3 : seq[b];
		void *ra = g.tensor(10, CUDNN_DATA_INT32, {B + 1, 1, 1, 1}, {1, 1, 1, 1});
		void *rc = g.tensor(11, CUDNN_DATA_INT32, {B + 1, 1, 1, 1}, {1, 1, 1, 1});
		void *M = g.tensor(12, CUDNN_DATA_INT32, {B, 1, 1, 1}, {1, 1, 1, 1});
		void *A = variant == 1 ? g.tensor(1, CUDNN_DATA_FLOAT, {B, H, S, K}, dense({B, H, S, K}))
		                       : g.tensor(1, CUDNN_DATA_FLOAT, {B, H, S, K}, {kBig, K, H * K, 1}, false, false, ra);
		void *W = g.tensor(2, CUDNN_DATA_FLOAT, {1, 1, K, N}, dense({1, 1, K, N}));
		void *C = g.tensor(3, CUDNN_DATA_FLOAT, {B, H, S, N}, {kBig, N, H * N, 1}, false, false, rc);
		auto plan = g.plan(g.graph({g.mm(A, W, C, M)}));
		float *a = dalloc<float>(B * H * S * K), *w = dalloc<float>(K * N), *c = dalloc<float>(tokens * H * N);
		char *ws = dalloc<char>(plan.ws);
		for (int i = 0; i < B * H * S * K; i++) a[i] = urand();
		for (int i = 0; i < K * N; i++) w[i] = urand();
		for (int i = 0; i < tokens * H * N; i++) c[i] = sentinel;
		std::vector<std::pair<int64_t, void *>> pack = {{1, a}, {2, w}, {3, c}, {11, offc}, {12, mo}};
		if (variant != 1) pack.push_back({10, offa});
		int s = g.exec(plan, pack, ws);
		if (variant == 1) {
			EXPECT_FAIL(s, "would overwrite the next sample");
			for (int i = 0; i < tokens * H * N; i++) EXPECT(c[i] == sentinel, "C[%d] written by a refused execution", i);
		} else if (variant == 2) {
			EXPECT_FAIL(s, "holds valid data in batch 0 only in rows < 2");
		} else {
			CHECK(s);
			std::vector<bool> written(tokens * H * N, false);
			for (int b = 0; b < B; b++)
				for (int h = 0; h < H; h++)
					for (int t = 0; t < seq[b]; t++)
						for (int n = 0; n < N; n++) {
							double want = 0;
							for (int k = 0; k < K; k++) want += (double)a[offa[b] + h * K + t * H * K + k] * w[k * N + n];
							int at = offc[b] + h * N + t * H * N + n;
							written[at] = true;
							EXPECT(fabs(c[at] - want) < 1e-5, "C[%d,%d,%d,%d] = %g, want %g", b, h, t, n, c[at], want);
						}
			for (int i = 0; i < tokens * H * N; i++)
				if (!written[i]) EXPECT(c[i] == sentinel, "C's element %d (outside every sample's first M rows) was written: %g", i, c[i]);
		}
		dfree(offa), dfree(offc), dfree(mo), dfree(a), dfree(w), dfree(c), dfree(ws);
	}
	printf("ok ragged_override\n");
}

// ---------------------------------------------------------------- attention

struct Attn {
	int B, H, Hkv, S, D;
	bool ragged; // packed tokens, ragged offsets, GEMM overrides and the padding mask
	bool padded; // dense layout with the padding mask (and no overrides): rows past seq_q are fully masked
	std::vector<int> sq, skv;
	std::vector<int> cq, ckv; // cumulative tokens (ragged)
	float scale;
	int64_t tq() const { return ragged ? cq[B] : (int64_t)B * S; }
	int64_t tkv() const { return ragged ? ckv[B] : (int64_t)B * S; }
	// Element offsets of Q-like [B,H,S,D], K/V-like [B,Hkv,S,D] and stats
	// [B,H,S,1] tensors.
	int64_t q_at(int b, int h, int s, int d) const { return ragged ? ((int64_t)cq[b] + s) * H * D + h * D + d : (((int64_t)b * H + h) * S + s) * D + d; }
	int64_t kv_at(int b, int h, int s, int d) const {
		return ragged ? ((int64_t)ckv[b] + s) * Hkv * D + h * D + d : (((int64_t)b * Hkv + h) * S + s) * D + d;
	}
	int64_t st_at(int b, int h, int s) const { return ragged ? ((int64_t)cq[b] + s) * H + h : ((int64_t)b * H + h) * S + s; }
	Dims q_st() const { return ragged ? Dims{kBig, D, (int64_t)H * D, 1} : dense({B, H, S, D}); }
	Dims kv_st() const { return ragged ? Dims{kBig, D, (int64_t)Hkv * D, 1} : dense({B, Hkv, S, D}); }
	Dims kvT_st() const { return ragged ? Dims{kBig, D, 1, (int64_t)Hkv * D} : Dims{(int64_t)Hkv * S * D, (int64_t)S * D, 1, D}; }
	Dims stats_st() const { return ragged ? Dims{(int64_t)S * H, 1, H, 1} : dense({B, H, S, 1}); }
	int rows_q(int b) const { return ragged ? sq[b] : S; } // rows the tensors hold
	int rows_kv(int b) const { return ragged ? skv[b] : S; }
	bool masks() const { return ragged || padded; }
};

enum { U_Q = 1, U_K, U_V, U_O, U_STATS, U_SCALE, U_NEGINF, U_NEGINF2, U_SEQQ, U_SEQKV, U_ROQ, U_ROKV, U_ROST, U_DO, U_DQ, U_DK, U_DV, U_SUM, U_DQACC, U_ONE };

// Device buffers of one attention problem.
struct Bufs {
	uint16_t *q, *k, *v, *o, *dout, *dq, *dk, *dv;
	float *stats, *sum, *dqacc;
	int32_t *seqq, *seqkv, *roq, *rokv, *rost;
	int64_t nq, nkv, nst, tail;
};

static const uint16_t kSentinel = 0x7f80 | 0x55; // a bf16 NaN pattern no computation writes
static const float kSentinelF = 12345.5f;

static Bufs alloc_bufs(const Attn &p) {
	Bufs b;
	b.tail = 64; // sentinel elements after each output
	b.nq = p.tq() * p.H * p.D;
	b.nkv = p.tkv() * p.Hkv * p.D;
	b.nst = p.tq() * p.H;
	if (!p.ragged) b.nst = (int64_t)p.B * p.H * p.S;
	b.q = dalloc<uint16_t>(b.nq), b.k = dalloc<uint16_t>(b.nkv), b.v = dalloc<uint16_t>(b.nkv), b.o = dalloc<uint16_t>(b.nq + b.tail);
	b.dout = dalloc<uint16_t>(b.nq), b.dq = dalloc<uint16_t>(b.nq + b.tail), b.dk = dalloc<uint16_t>(b.nkv + b.tail),
	b.dv = dalloc<uint16_t>(b.nkv + b.tail);
	b.stats = dalloc<float>(b.nst + b.tail);
	b.sum = dalloc<float>((int64_t)p.B * p.H * p.S);
	b.dqacc = dalloc<float>((int64_t)p.B * p.H * p.S * p.D);
	b.seqq = dalloc<int32_t>(p.B), b.seqkv = dalloc<int32_t>(p.B);
	b.roq = dalloc<int32_t>(p.B + 1), b.rokv = dalloc<int32_t>(p.B + 1), b.rost = dalloc<int32_t>(p.B + 1);
	for (int i = 0; i < p.B; i++) b.seqq[i] = p.sq[i], b.seqkv[i] = p.skv[i];
	if (p.ragged)
		for (int i = 0; i <= p.B; i++) b.roq[i] = p.cq[i] * p.H * p.D, b.rokv[i] = p.ckv[i] * p.Hkv * p.D, b.rost[i] = p.cq[i] * p.H;
	for (int64_t i = 0; i < b.nq; i++) b.q[i] = f2bf(urand()), b.dout[i] = f2bf(urand());
	for (int64_t i = 0; i < b.nkv; i++) b.k[i] = f2bf(urand()), b.v[i] = f2bf(urand());
	for (int64_t i = 0; i < b.nq + b.tail; i++) b.o[i] = b.dq[i] = kSentinel;
	for (int64_t i = 0; i < b.nkv + b.tail; i++) b.dk[i] = b.dv[i] = kSentinel;
	for (int64_t i = 0; i < b.nst + b.tail; i++) b.stats[i] = kSentinelF;
	return b;
}

static void free_bufs(Bufs &b) {
	for (void *p : std::initializer_list<void *>{b.q, b.k, b.v, b.o, b.dout, b.dq, b.dk, b.dv, b.stats, b.sum, b.dqacc, b.seqq, b.seqkv,
	                                              b.roq, b.rokv, b.rost})
		dfree(p);
}

static void shuffle_ops(std::vector<void *> &ops) {
	std::mt19937 r(7);
	std::shuffle(ops.begin(), ops.end(), r); // the emulator orders them itself
}

// attn_fwd builds the forward graph cuDNN's SDPA uses (causal mask; with
// ragged tensors also the padding mask and the GEMM overrides), GQA-shaped.
static void *attn_fwd(Builder &g, const Attn &p) {
	const int B = p.B, H = p.H, Hk = p.Hkv, S = p.S, D = p.D;
	void *roq = nullptr, *rokv = nullptr, *rost = nullptr, *seqq = nullptr, *seqkv = nullptr;
	if (p.ragged) {
		roq = g.tensor(U_ROQ, CUDNN_DATA_INT32, {B + 1, 1, 1, 1}, {1, 1, 1, 1});
		rokv = g.tensor(U_ROKV, CUDNN_DATA_INT32, {B + 1, 1, 1, 1}, {1, 1, 1, 1});
		rost = g.tensor(U_ROST, CUDNN_DATA_INT32, {B + 1, 1, 1, 1}, {1, 1, 1, 1});
	}
	if (p.masks()) {
		seqq = g.tensor(U_SEQQ, CUDNN_DATA_INT32, {B, 1, 1, 1}, {1, 1, 1, 1});
		seqkv = g.tensor(U_SEQKV, CUDNN_DATA_INT32, {B, 1, 1, 1}, {1, 1, 1, 1});
	}
	void *mq = p.ragged ? seqq : nullptr, *mkv = p.ragged ? seqkv : nullptr; // the GEMM overrides
	void *Q = g.tensor(U_Q, CUDNN_DATA_BFLOAT16, {B, H, S, D}, p.q_st(), false, false, roq);
	void *KT = g.tensor(U_K, CUDNN_DATA_BFLOAT16, {B, Hk, D, S}, p.kvT_st(), false, false, rokv);
	void *V = g.tensor(U_V, CUDNN_DATA_BFLOAT16, {B, Hk, S, D}, p.kv_st(), false, false, rokv);
	void *O = g.tensor(U_O, CUDNN_DATA_BFLOAT16, {B, H, S, D}, p.q_st(), false, false, roq);
	void *Stats = g.tensor(U_STATS, CUDNN_DATA_FLOAT, {B, H, S, 1}, p.stats_st(), false, false, rost);
	void *scale = g.scalar(U_SCALE), *ninf = p.masks() ? g.scalar(U_NEGINF) : nullptr, *ninf2 = g.scalar(U_NEGINF2);
	const Dims ss = {B, H, S, S}, row = {B, H, S, 1};
	std::vector<void *> ops;
	void *s = g.virt(CUDNN_DATA_FLOAT, ss);
	ops.push_back(g.mm(Q, KT, s, mq, mkv));
	void *ss1 = g.virt(CUDNN_DATA_FLOAT, ss);
	ops.push_back(g.pw(CUDNN_POINTWISE_MUL, s, ss1, scale));
	void *cur = ss1;
	if (p.masks()) {
		void *col = g.virt(CUDNN_DATA_INT32, ss), *row_ = g.virt(CUDNN_DATA_INT32, ss);
		void *colok = g.virt(CUDNN_DATA_BOOLEAN, ss), *rowok = g.virt(CUDNN_DATA_BOOLEAN, ss), *ok = g.virt(CUDNN_DATA_BOOLEAN, ss);
		void *masked = g.virt(CUDNN_DATA_FLOAT, ss);
		ops.push_back(g.pw(CUDNN_POINTWISE_GEN_INDEX, cur, col, nullptr, nullptr, 3, CUDNN_DATA_INT32));
		ops.push_back(g.pw(CUDNN_POINTWISE_CMP_LT, col, colok, seqkv, nullptr, -1, CUDNN_DATA_BOOLEAN));
		ops.push_back(g.pw(CUDNN_POINTWISE_GEN_INDEX, cur, row_, nullptr, nullptr, 2, CUDNN_DATA_INT32));
		ops.push_back(g.pw(CUDNN_POINTWISE_CMP_LT, row_, rowok, seqq, nullptr, -1, CUDNN_DATA_BOOLEAN));
		ops.push_back(g.pw(CUDNN_POINTWISE_LOGICAL_AND, rowok, ok, colok, nullptr, -1, CUDNN_DATA_BOOLEAN));
		ops.push_back(g.pw(CUDNN_POINTWISE_BINARY_SELECT, cur, masked, ninf, ok));
		cur = masked;
	}
	void *ci = g.virt(CUDNN_DATA_INT32, ss), *ri = g.virt(CUDNN_DATA_INT32, ss), *causal = g.virt(CUDNN_DATA_BOOLEAN, ss);
	void *masked = g.virt(CUDNN_DATA_FLOAT, ss);
	ops.push_back(g.pw(CUDNN_POINTWISE_GEN_INDEX, cur, ci, nullptr, nullptr, 3));
	ops.push_back(g.pw(CUDNN_POINTWISE_GEN_INDEX, cur, ri, nullptr, nullptr, 2));
	ops.push_back(g.pw(CUDNN_POINTWISE_CMP_GE, ri, causal, ci, nullptr, -1, CUDNN_DATA_BOOLEAN));
	ops.push_back(g.pw(CUDNN_POINTWISE_BINARY_SELECT, cur, masked, ninf2, causal));
	void *mx = g.virt(CUDNN_DATA_FLOAT, row), *sub = g.virt(CUDNN_DATA_FLOAT, ss), *e = g.virt(CUDNN_DATA_FLOAT, ss);
	void *sum = g.virt(CUDNN_DATA_FLOAT, row), *lg = g.virt(CUDNN_DATA_FLOAT, row), *P = g.virt(CUDNN_DATA_BFLOAT16, ss);
	ops.push_back(g.red(CUDNN_REDUCE_TENSOR_MAX, masked, mx));
	ops.push_back(g.pw(CUDNN_POINTWISE_SUB, masked, sub, mx));
	ops.push_back(g.pw(CUDNN_POINTWISE_EXP, sub, e));
	ops.push_back(g.red(CUDNN_REDUCE_TENSOR_ADD, e, sum));
	ops.push_back(g.pw(CUDNN_POINTWISE_LOG, sum, lg));
	ops.push_back(g.pw(CUDNN_POINTWISE_ADD, mx, Stats, lg));
	ops.push_back(g.pw(CUDNN_POINTWISE_DIV, e, P, sum));
	ops.push_back(g.mm(P, V, O, mq, nullptr, mkv));
	EXPECT(ops.size() == (p.masks() ? 20u : 14u), "forward graph of %zu nodes", ops.size());
	shuffle_ops(ops);
	return g.graph(ops);
}

// attn_bwd builds the backward graph (dQ through a device fp32
// accumulator; dK and dV as per-head virtual products reduced over head
// groups into the Hkv-head outputs).
static void *attn_bwd(Builder &g, const Attn &p) {
	const int B = p.B, H = p.H, Hk = p.Hkv, S = p.S, D = p.D;
	void *roq = nullptr, *rokv = nullptr, *rost = nullptr, *seqq = nullptr, *seqkv = nullptr;
	if (p.ragged) {
		roq = g.tensor(U_ROQ, CUDNN_DATA_INT32, {B + 1, 1, 1, 1}, {1, 1, 1, 1});
		rokv = g.tensor(U_ROKV, CUDNN_DATA_INT32, {B + 1, 1, 1, 1}, {1, 1, 1, 1});
		rost = g.tensor(U_ROST, CUDNN_DATA_INT32, {B + 1, 1, 1, 1}, {1, 1, 1, 1});
	}
	if (p.masks()) {
		seqq = g.tensor(U_SEQQ, CUDNN_DATA_INT32, {B, 1, 1, 1}, {1, 1, 1, 1});
		seqkv = g.tensor(U_SEQKV, CUDNN_DATA_INT32, {B, 1, 1, 1}, {1, 1, 1, 1});
	}
	void *mq = p.ragged ? seqq : nullptr, *mkv = p.ragged ? seqkv : nullptr; // the GEMM overrides
	const Dims qd = {B, H, S, D}, kd = {B, Hk, S, D}, kt = {B, Hk, D, S}, ss = {B, H, S, S}, row = {B, H, S, 1};
	void *Q = g.tensor(U_Q, CUDNN_DATA_BFLOAT16, qd, p.q_st(), false, false, roq);
	void *KT = g.tensor(U_K, CUDNN_DATA_BFLOAT16, kt, p.kvT_st(), false, false, rokv);
	void *VT = g.tensor(U_V, CUDNN_DATA_BFLOAT16, kt, p.kvT_st(), false, false, rokv);
	void *O = g.tensor(U_O, CUDNN_DATA_BFLOAT16, qd, p.q_st(), false, false, roq);
	void *dO = g.tensor(U_DO, CUDNN_DATA_BFLOAT16, qd, p.q_st(), false, false, roq);
	void *Stats = g.tensor(U_STATS, CUDNN_DATA_FLOAT, row, p.stats_st(), false, false, rost);
	void *dQ = g.tensor(U_DQ, CUDNN_DATA_BFLOAT16, qd, p.q_st(), false, false, roq);
	void *dK = g.tensor(U_DK, CUDNN_DATA_BFLOAT16, kd, p.kv_st(), false, false, rokv);
	void *dV = g.tensor(U_DV, CUDNN_DATA_BFLOAT16, kd, p.kv_st(), false, false, rokv);
	void *Sum = g.tensor(U_SUM, CUDNN_DATA_FLOAT, row, dense(row));
	void *dQacc = g.tensor(U_DQACC, CUDNN_DATA_FLOAT, qd, dense(qd));
	void *scale = g.scalar(U_SCALE), *ninf = p.masks() ? g.scalar(U_NEGINF) : nullptr, *ninf2 = g.scalar(U_NEGINF2), *one = g.scalar(U_ONE);
	std::vector<void *> ops;
	void *dP = g.virt(CUDNN_DATA_FLOAT, ss), *s = g.virt(CUDNN_DATA_FLOAT, ss), *doo = g.virt(CUDNN_DATA_FLOAT, qd);
	ops.push_back(g.mm(dO, VT, dP, mq, mkv));
	ops.push_back(g.mm(Q, KT, s, mq, mkv));
	ops.push_back(g.pw(CUDNN_POINTWISE_MUL, dO, doo, O));
	void *Kf = g.virt_st(CUDNN_DATA_FLOAT, kd, p.ragged ? p.kv_st() : dense(kd), rokv); // K, as fp32, through K^T's memory
	ops.push_back(g.reshape(KT, Kf));
	void *s1 = g.virt(CUDNN_DATA_FLOAT, ss);
	ops.push_back(g.pw(CUDNN_POINTWISE_MUL, s, s1, scale));
	void *cur = s1;
	if (p.masks()) {
		void *col = g.virt(CUDNN_DATA_INT32, ss), *row_ = g.virt(CUDNN_DATA_INT32, ss);
		void *colok = g.virt(CUDNN_DATA_BOOLEAN, ss), *rowok = g.virt(CUDNN_DATA_BOOLEAN, ss), *ok = g.virt(CUDNN_DATA_BOOLEAN, ss);
		void *masked = g.virt(CUDNN_DATA_FLOAT, ss);
		ops.push_back(g.pw(CUDNN_POINTWISE_GEN_INDEX, cur, col, nullptr, nullptr, 3, CUDNN_DATA_INT32));
		ops.push_back(g.pw(CUDNN_POINTWISE_CMP_LT, col, colok, seqkv, nullptr, -1, CUDNN_DATA_BOOLEAN));
		ops.push_back(g.pw(CUDNN_POINTWISE_GEN_INDEX, cur, row_, nullptr, nullptr, 2, CUDNN_DATA_INT32));
		ops.push_back(g.pw(CUDNN_POINTWISE_CMP_LT, row_, rowok, seqq, nullptr, -1, CUDNN_DATA_BOOLEAN));
		ops.push_back(g.pw(CUDNN_POINTWISE_LOGICAL_AND, rowok, ok, colok, nullptr, -1, CUDNN_DATA_BOOLEAN));
		ops.push_back(g.pw(CUDNN_POINTWISE_BINARY_SELECT, cur, masked, ninf, ok));
		cur = masked;
	}
	void *lse = g.virt(CUDNN_DATA_FLOAT, ss);
	ops.push_back(g.pw(CUDNN_POINTWISE_SUB, cur, lse, Stats));
	void *ci = g.virt(CUDNN_DATA_FLOAT, ss), *ri = g.virt(CUDNN_DATA_FLOAT, ss), *causal = g.virt(CUDNN_DATA_BOOLEAN, ss);
	void *masked = g.virt(CUDNN_DATA_FLOAT, ss), *P = g.virt(CUDNN_DATA_FLOAT, ss);
	ops.push_back(g.pw(CUDNN_POINTWISE_GEN_INDEX, lse, ci, nullptr, nullptr, 3));
	ops.push_back(g.pw(CUDNN_POINTWISE_GEN_INDEX, lse, ri, nullptr, nullptr, 2));
	ops.push_back(g.pw(CUDNN_POINTWISE_CMP_GE, ri, causal, ci, nullptr, -1, CUDNN_DATA_BOOLEAN));
	ops.push_back(g.pw(CUDNN_POINTWISE_BINARY_SELECT, lse, masked, ninf2, causal));
	ops.push_back(g.pw(CUDNN_POINTWISE_EXP, masked, P));
	const Dims tr = {(int64_t)H * S * S, (int64_t)S * S, 1, S}; // a transposed view of a dense [B,H,S,S]
	void *PT = g.virt_st(CUDNN_DATA_BFLOAT16, ss, tr);
	ops.push_back(g.reshape(P, PT));
	void *dVh = g.virt(CUDNN_DATA_FLOAT, qd);
	ops.push_back(g.mm(PT, dO, dVh, mkv, nullptr, mq));
	ops.push_back(g.red(CUDNN_REDUCE_TENSOR_ADD, dVh, dV));
	void *rs = g.virt(CUDNN_DATA_FLOAT, row);
	ops.push_back(g.red(CUDNN_REDUCE_TENSOR_ADD, doo, rs));
	ops.push_back(g.pw(CUDNN_POINTWISE_MUL, rs, Sum, one));
	void *t39 = g.virt(CUDNN_DATA_FLOAT, ss), *t40 = g.virt(CUDNN_DATA_FLOAT, ss), *dS = g.virt(CUDNN_DATA_FLOAT, ss);
	ops.push_back(g.pw(CUDNN_POINTWISE_SUB, dP, t39, Sum));
	ops.push_back(g.pw(CUDNN_POINTWISE_MUL, t39, t40, P));
	ops.push_back(g.pw(CUDNN_POINTWISE_MUL, t40, dS, scale));
	ops.push_back(g.mm(dS, Kf, dQacc, mq, nullptr, mkv));
	ops.push_back(g.pw(CUDNN_POINTWISE_IDENTITY, dQacc, dQ));
	void *dST = g.virt_st(CUDNN_DATA_BFLOAT16, ss, tr), *dKh = g.virt(CUDNN_DATA_FLOAT, qd);
	ops.push_back(g.reshape(dS, dST));
	ops.push_back(g.mm(dST, Q, dKh, mkv, nullptr, mq));
	ops.push_back(g.red(CUDNN_REDUCE_TENSOR_ADD, dKh, dK));
	EXPECT(ops.size() == (p.masks() ? 30u : 24u), "backward graph of %zu nodes", ops.size());
	shuffle_ops(ops);
	return g.graph(ops);
}

// Double-precision reference: P (rows of the causal, padded softmax), O, stats.
struct Ref {
	std::vector<double> o, stats, dq, dk, dv;
};

static double bq(const Bufs &b, const Attn &p, const uint16_t *t, int bi, int h, int s, int d) { return bf2f(t[p.q_at(bi, h, s, d)]); }
static double bk(const Bufs &b, const Attn &p, const uint16_t *t, int bi, int h, int s, int d) { return bf2f(t[p.kv_at(bi, h, s, d)]); }

static Ref reference(const Attn &p, const Bufs &bu) {
	Ref r;
	r.o.assign(bu.nq, 0), r.stats.assign(bu.nst, 0), r.dq.assign(bu.nq, 0), r.dk.assign(bu.nkv, 0), r.dv.assign(bu.nkv, 0);
	const int G = p.H / p.Hkv;
	for (int b = 0; b < p.B; b++)
		for (int h = 0; h < p.H; h++) {
			int kh = h / G, nq = p.rows_q(b), nk = p.rows_kv(b);
			for (int i = 0; i < nq; i++) {
				std::vector<double> sc(nk), P(nk, 0), dP(nk, 0);
				double m = -INFINITY;
				// Row i attends to keys j <= i (causal), j < seq_kv, if i < seq_q.
				int jn = std::min(std::min(nk, i + 1), i < p.sq[b] ? p.skv[b] : 0);
				for (int j = 0; j < jn; j++) {
					double acc = 0;
					for (int d = 0; d < p.D; d++) acc += bq(bu, p, bu.q, b, h, i, d) * bk(bu, p, bu.k, b, kh, j, d);
					sc[j] = acc * p.scale;
					m = std::max(m, sc[j]);
				}
				double l = 0;
				for (int j = 0; j < jn; j++) l += exp(sc[j] - m);
				r.stats[p.st_at(b, h, i)] = l > 0 ? m + log(l) : -INFINITY;
				for (int j = 0; j < jn; j++) P[j] = exp(sc[j] - m) / l;
				// Backward, with the O the forward wrote (as the caller passes it).
				double Di = 0;
				for (int d = 0; d < p.D; d++) {
					double o = 0;
					for (int j = 0; j < jn; j++) o += P[j] * bk(bu, p, bu.v, b, kh, j, d);
					r.o[p.q_at(b, h, i, d)] = o;
					Di += bq(bu, p, bu.dout, b, h, i, d) * bq(bu, p, bu.o, b, h, i, d);
				}
				for (int j = 0; j < jn; j++) {
					double acc = 0;
					for (int d = 0; d < p.D; d++) acc += bq(bu, p, bu.dout, b, h, i, d) * bk(bu, p, bu.v, b, kh, j, d);
					double dS = P[j] * (acc - Di) * p.scale;
					for (int d = 0; d < p.D; d++) {
						r.dq[p.q_at(b, h, i, d)] += dS * bk(bu, p, bu.k, b, kh, j, d);
						r.dk[p.kv_at(b, kh, j, d)] += dS * bq(bu, p, bu.q, b, h, i, d);
						r.dv[p.kv_at(b, kh, j, d)] += P[j] * bq(bu, p, bu.dout, b, h, i, d);
					}
				}
			}
		}
	return r;
}

// compare checks n bf16 (or float) outputs against the reference within
// tol * max|ref| (+ a floor), and that the tail after them is untouched.
static void compare_bf16(const char *what, const uint16_t *got, const std::vector<double> &want, int64_t tail) {
	double mx = 0, worst = 0;
	for (double w : want) mx = std::max(mx, fabs(w));
	for (size_t i = 0; i < want.size(); i++) {
		double g = bf2f(got[i]);
		EXPECT(std::isfinite(g), "%s[%zu] = %g", what, i, g);
		worst = std::max(worst, fabs(g - want[i]));
	}
	EXPECT(worst <= 0.02 * std::max(mx, 0.1), "%s: max error %g (max |ref| %g)", what, worst, mx);
	for (int64_t i = 0; i < tail; i++) EXPECT(got[want.size() + i] == kSentinel, "%s: element %lld past the end was written", what, (long long)(want.size() + i));
	printf("  %s: max error %.3g (max |ref| %.3g)\n", what, worst, mx);
}

static void check_attention(const char *name, Attn p) {
	if (p.ragged) {
		p.cq.assign(p.B + 1, 0), p.ckv.assign(p.B + 1, 0);
		for (int b = 0; b < p.B; b++) p.cq[b + 1] = p.cq[b] + p.sq[b], p.ckv[b + 1] = p.ckv[b] + p.skv[b];
	} else if (!p.padded)
		p.sq.assign(p.B, p.S), p.skv.assign(p.B, p.S);
	p.scale = 1 / sqrtf((float)p.D);
	Bufs bu = alloc_bufs(p);
	float scale = p.scale, ninf = -INFINITY, one = 1;
	std::vector<std::pair<int64_t, void *>> common = {{U_Q, bu.q},        {U_K, bu.k},           {U_V, bu.v},
	                                                  {U_O, bu.o},        {U_STATS, bu.stats},   {U_SCALE, &scale},
	                                                  {U_NEGINF2, &ninf}};
	if (p.masks())
		for (auto e : std::vector<std::pair<int64_t, void *>>{{U_NEGINF, &ninf}, {U_SEQQ, bu.seqq}, {U_SEQKV, bu.seqkv}}) common.push_back(e);
	if (p.ragged)
		for (auto e : std::vector<std::pair<int64_t, void *>>{{U_ROQ, bu.roq}, {U_ROKV, bu.rokv}, {U_ROST, bu.rost}}) common.push_back(e);
	{
		Builder g;
		auto plan = g.plan(attn_fwd(g, p));
		EXPECT(plan.notes.empty(), "the forward graph has %zu numerical notes", plan.notes.size());
		char *ws = dalloc<char>(plan.ws);
		CHECK(g.exec(plan, common, ws));
		dfree(ws);
	}
	Ref r = reference(p, bu);
	compare_bf16("O", bu.o, r.o, bu.tail);
	double worst = 0;
	for (int64_t i = 0; i < bu.nst; i++) {
		double w = r.stats[i], g = bu.stats[i];
		if (std::isinf(w)) EXPECT(g == w, "Stats[%lld] = %g, want %g", (long long)i, g, w);
		else worst = std::max(worst, fabs(g - w));
	}
	EXPECT(worst < 1e-4, "Stats: max error %g", worst);
	for (int64_t i = 0; i < bu.tail; i++) EXPECT(bu.stats[bu.nst + i] == kSentinelF, "Stats: element %lld past the end was written", (long long)i);
	printf("  Stats: max error %.3g\n", worst);
	{
		Builder g;
		auto plan = g.plan(attn_bwd(g, p));
		EXPECT(plan.notes.size() == 1 && plan.notes[0] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC,
		       "the dQ-accumulator backward graph should carry the NONDETERMINISTIC note (%zu notes)", plan.notes.size());
		char *ws = dalloc<char>(plan.ws);
		auto pack = common;
		for (auto e : std::vector<std::pair<int64_t, void *>>{
		         {U_DO, bu.dout}, {U_DQ, bu.dq}, {U_DK, bu.dk}, {U_DV, bu.dv}, {U_SUM, bu.sum}, {U_DQACC, bu.dqacc}, {U_ONE, &one}})
			pack.push_back(e);
		// O and Stats, the forward's outputs, are the backward's inputs.
		CHECK(g.exec(plan, pack, ws));
		dfree(ws);
	}
	compare_bf16("dQ", bu.dq, r.dq, bu.tail);
	compare_bf16("dK", bu.dk, r.dk, bu.tail);
	compare_bf16("dV", bu.dv, r.dv, bu.tail);
	free_bufs(bu);
	printf("ok %s\n", name);
}

// Data type conversions on output: FLOAT to BFLOAT16 rounds to nearest
// even, comparisons give BOOLEAN, GEN_INDEX gives INT32; a by-value scalar
// and a [b,1,1,1] tensor broadcast.
static void check_conversions() {
	Builder g;
	const Dims d = {2, 1, 1, 4}, one = {1, 1, 1, 1}, per = {2, 1, 1, 1};
	void *X = g.tensor(1, CUDNN_DATA_FLOAT, d, dense(d)), *Yb = g.tensor(2, CUDNN_DATA_BFLOAT16, d, dense(d));
	void *T = g.tensor(3, CUDNN_DATA_BOOLEAN, d, dense(d)), *I = g.tensor(4, CUDNN_DATA_INT32, d, dense(d));
	void *s = g.scalar(5), *L = g.tensor(6, CUDNN_DATA_INT32, per, dense(per));
	void *sc = g.virt(CUDNN_DATA_FLOAT, d), *ix = g.virt(CUDNN_DATA_INT32, d);
	(void)one;
	auto plan = g.plan(g.graph({g.pw(CUDNN_POINTWISE_IDENTITY, X, Yb), g.pw(CUDNN_POINTWISE_MUL, X, sc, s),
	                            g.pw(CUDNN_POINTWISE_CMP_LT, ix, T, L, nullptr, -1, CUDNN_DATA_BOOLEAN),
	                            g.pw(CUDNN_POINTWISE_GEN_INDEX, sc, ix, nullptr, nullptr, 3, CUDNN_DATA_INT32),
	                            g.pw(CUDNN_POINTWISE_ADD, ix, I, L)}));
	float *x = dalloc<float>(8);
	uint16_t *yb = dalloc<uint16_t>(8);
	unsigned char *t = dalloc<unsigned char>(8);
	int32_t *iv = dalloc<int32_t>(8), *len = dalloc<int32_t>(2);
	char *ws = dalloc<char>(plan.ws);
	const float h = 1.0f / 256; // half a bf16 ulp at 1
	const float in[8] = {1 + h, 1 + 3 * h, -(1 + h), 2.5f, 1 + h + h / 64, 0, -0.0f, 3};
	const uint16_t want[8] = {0x3f80, 0x3f82, 0xbf80, 0x4020, 0x3f81, 0, 0x8000, 0x4040};
	memcpy(x, in, sizeof in);
	len[0] = 2, len[1] = 5;
	float two = 2;
	CHECK(g.exec(plan, {{1, x}, {2, yb}, {3, t}, {4, iv}, {5, &two}, {6, len}}, ws));
	for (int i = 0; i < 8; i++) {
		EXPECT(yb[i] == want[i], "bf16(%.9g) = 0x%04x, want 0x%04x", in[i], yb[i], want[i]);
		EXPECT(t[i] == ((i % 4) < len[i / 4]), "T[%d] = %d", i, t[i]);
		EXPECT(iv[i] == i % 4 + len[i / 4], "I[%d] = %d", i, iv[i]);
	}
	dfree(x), dfree(yb), dfree(t), dfree(iv), dfree(len), dfree(ws);
	printf("ok conversions\n");
}

// ---------------------------------------------------------------- refusals

static void check_refusals() {
	// Finalize: malformed tensors.
	{
		Builder g;
		void *d = g.mk(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
		int dt = CUDNN_DATA_FLOAT;
		int64_t dims3[3] = {2, 3, 4}, st3[3] = {12, 4, 1}, uid = 5, al = 16;
		g.set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
		g.set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 3, dims3);
		g.set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 3, st3);
		g.set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
		g.set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &al);
		EXPECT_FAIL(cudnnBackendFinalize(d), "4-D");
		void *e = g.mk(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
		int64_t dims[4] = {1, 2, 3, 4}, st[3] = {24, 12, 4};
		g.set(e, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
		g.set(e, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims);
		g.set(e, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
		g.set(e, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &al);
		EXPECT_FAIL(cudnnBackendFinalize(e), "CUDNN_ATTR_TENSOR_STRIDES is not set");
		g.set(e, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 3, st);
		EXPECT_FAIL(cudnnBackendFinalize(e), "STRIDES has 3 entries but CUDNN_ATTR_TENSOR_DIMENSIONS has 4");
		void *f = g.mk(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
		int64_t st4[4] = {24, 12, 4, 1};
		g.set(f, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
		g.set(f, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims);
		g.set(f, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, st4);
		g.set(f, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &al);
		EXPECT_FAIL(cudnnBackendFinalize(f), "CUDNN_ATTR_TENSOR_UNIQUE_ID is not set");
		EXPECT_FAIL(cudnnBackendSetAttribute(f, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT32, 1, &uid), "takes CUDNN_TYPE_INT64");
	}
	// Finalize: operations and graphs.
	{
		Builder g;
		g.try_ = true;
		const Dims d = {2, 3, 4, 5};
		void *x = g.tensor(1, CUDNN_DATA_FLOAT, d, dense(d)), *bad = g.tensor(2, CUDNN_DATA_FLOAT, {2, 3, 4, 6}, dense({2, 3, 4, 6}));
		void *y = g.tensor(3, CUDNN_DATA_FLOAT, d, dense(d));
		g.pw(CUDNN_POINTWISE_ADD, x, y, bad);
		EXPECT_FAIL(g.status, "do not broadcast");
		void *k = g.tensor(4, CUDNN_DATA_FLOAT, {2, 3, 6, 5}, dense({2, 3, 6, 5}));
		g.mm(x, k, y);
		EXPECT_FAIL(g.status, "do not multiply");
		// Duplicate uids.
		void *dup = g.tensor(1, CUDNN_DATA_FLOAT, d, dense(d));
		void *op = g.pw(CUDNN_POINTWISE_ADD, x, y, dup);
		EXPECT(g.status == 0, "ADD finalize");
		g.graph({op});
		EXPECT_FAIL(g.status, "two different tensor descriptors have uid 1");
		// A virtual operand nothing produces.
		void *v = g.tensor(7, CUDNN_DATA_FLOAT, d, dense(d), true);
		void *op2 = g.pw(CUDNN_POINTWISE_EXP, v, y);
		g.graph({op2});
		EXPECT_FAIL(g.status, "which no operation of the graph produces");
		// A cycle through device tensors.
		void *z = g.tensor(8, CUDNN_DATA_FLOAT, d, dense(d));
		g.graph({g.pw(CUDNN_POINTWISE_EXP, y, z), g.pw(CUDNN_POINTWISE_EXP, z, y)});
		EXPECT_FAIL(g.status, "cycle");
	}
	// Execute: pointers, the pack, the workspace.
	{
		Builder g;
		const Dims ad = {2, 2, 4, 8}, bd = {2, 2, 8, 4}, cd = {2, 2, 4, 4};
		void *A = g.tensor(1, CUDNN_DATA_FLOAT, ad, dense(ad)), *B = g.tensor(2, CUDNN_DATA_FLOAT, bd, dense(bd)),
		     *C = g.tensor(3, CUDNN_DATA_FLOAT, cd, dense(cd));
		auto plan = g.plan(g.graph({g.mm(A, B, C)}));
		float *a = dalloc<float>(128), *small = dalloc<float>(127), *b = dalloc<float>(128), *c = dalloc<float>(64);
		char *ws = dalloc<char>(plan.ws), *ws_small = dalloc<char>(plan.ws - 1);
		for (int i = 0; i < 128; i++) a[i] = b[i] = 1;
		CHECK(g.exec(plan, {{1, a}, {2, b}, {3, c}}, ws));
		EXPECT(c[0] == 8, "C[0] = %g", c[0]);
		EXPECT_FAIL(g.exec(plan, {{1, small}, {2, b}, {3, c}}, ws), "uid 1 FLOAT[2,2,4,8], batch 1");
		EXPECT_FAIL(g.exec(plan, {{1, a}, {3, c}}, ws), "no pointer for uid 2");
		EXPECT_FAIL(g.exec(plan, {{1, a}, {2, b}, {3, c}, {9, c}}, ws), "uid 9");
		EXPECT_FAIL(g.exec(plan, {{1, a}, {2, b}, {3, c}}, nullptr), "CUDNN_ATTR_VARIANT_PACK_WORKSPACE is not set");
		EXPECT_FAIL(g.exec(plan, {{1, a}, {2, b}, {3, c}}, ws_small), "the workspace");
		EXPECT_FAIL(g.exec(plan, {{1, (char *)a + 4}, {2, b}, {3, c}}, ws), "not aligned");
		dfree(a), dfree(small), dfree(b), dfree(c), dfree(ws), dfree(ws_small);
	}
	// The environment's switches.
	{
		Builder g;
		const Dims d = {1, 1, 2, 2};
		void *x = g.tensor(1, CUDNN_DATA_FLOAT, d, dense(d)), *y = g.tensor(2, CUDNN_DATA_FLOAT, d, dense(d));
		void *graph = g.graph({g.pw(CUDNN_POINTWISE_EXP, x, y)});
		setenv("DISTILL_EMU_CUDNN_REFUSE", "1", 1);
		void *heur = g.mk(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
		int mode = CUDNN_HEUR_MODE_A;
		g.setd(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
		g.set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
		CHECK(cudnnBackendFinalize(heur));
		int64_t n = -1;
		CHECK(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, nullptr));
		EXPECT(n == 0, "DISTILL_EMU_CUDNN_REFUSE=1: %lld configs", (long long)n);
		unsetenv("DISTILL_EMU_CUDNN_REFUSE");
		CHECK(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, nullptr));
		EXPECT(n == 2, "%lld configs", (long long)n);
		EXPECT(cudnnGetVersion() == 91900, "version %zu", cudnnGetVersion());
		setenv("DISTILL_EMU_CUDNN_VERSION", "90500", 1);
		EXPECT(cudnnGetVersion() == 90500, "DISTILL_EMU_CUDNN_VERSION=90500: version %zu", cudnnGetVersion());
		unsetenv("DISTILL_EMU_CUDNN_VERSION");
	}
	printf("ok refusals\n");
}

int main() {
	setvbuf(stdout, nullptr, _IONBF, 0); // in order with the emulator's messages on stderr
	check_matmul_broadcast();
	check_ragged_override();
	check_conversions();
	Attn dense_attn{2, 4, 2, 8, 8, false, false, {}, {}, {}, {}, 0};
	check_attention("attention_dense", dense_attn);
	// Dense layout with the padding mask: rows past seq_q, and a sample
	// without keys, are fully masked rows that the graph still computes.
	Attn padded_attn{3, 4, 2, 8, 8, false, true, {3, 8, 5}, {3, 0, 8}, {}, {}, 0};
	check_attention("attention_padded", padded_attn);
	// Ragged, GQA: a sample with no keys at all (every row fully masked).
	Attn ragged_attn{3, 4, 2, 9, 8, true, false, {3, 9, 5}, {3, 0, 7}, {}, {}, 0};
	check_attention("attention_ragged", ragged_attn);
	check_refusals();
	printf("PASS\n");
	return 0;
}
