// cudnn_sdpa.h: the fused attention graphs of cudnn_sdpa.c (see there).
#ifndef DISTILL_CUDNN_SDPA_H
#define DISTILL_CUDNN_SDPA_H

#include "cudnn_capi.h"

#define DISTILL_SDPA_MAX_DESC 320
#define DISTILL_SDPA_MAX_OPS 48

// The uids of the tensors the caller supplies at execution (the variant
// pack); the graphs' virtual tensors are numbered from 100.
enum {
	DISTILL_SDPA_UID_Q = 1,
	DISTILL_SDPA_UID_K = 2,
	DISTILL_SDPA_UID_V = 3,
	DISTILL_SDPA_UID_O = 4,
	DISTILL_SDPA_UID_STATS = 5,
	DISTILL_SDPA_UID_SCALE = 6,
	DISTILL_SDPA_UID_SEQ_Q = 7,
	DISTILL_SDPA_UID_SEQ_KV = 8,
	DISTILL_SDPA_UID_OFF_Q = 9,
	DISTILL_SDPA_UID_OFF_KV = 10,
	DISTILL_SDPA_UID_OFF_STATS = 11,
	DISTILL_SDPA_UID_NEG_INF_PAD = 12,
	DISTILL_SDPA_UID_NEG_INF_CAUSAL = 13,
	DISTILL_SDPA_UID_ONE = 14,
	DISTILL_SDPA_UID_DO = 15,
	DISTILL_SDPA_UID_DQ = 16,
	DISTILL_SDPA_UID_DK = 17,
	DISTILL_SDPA_UID_DV = 18,
	DISTILL_SDPA_UID_SOFTMAX_SUM = 19,
	DISTILL_SDPA_UID_DQ_ACCUM = 20,
};

// distill_sdpa_key is what a plan is built for.
typedef struct {
	int bwd;                    // 0: forward; 1: backward
	int det;                    // backward: the deterministic graph (dq written directly)
	int dense_ws;               // backward: the workspace tensors [B,H,S,·] instead of ragged over the tokens
	int fixed;                  // every sample has S tokens: BSHD tensors, no ragged offsets, lengths or padding mask
	int64_t b, h, hkv, s, d;    // samples (bucket), query heads, kv heads, longest sample (bucket), head_dim
} distill_sdpa_key;

typedef struct {
	cudnnBackendDescriptor_t plan; // the execution plan
	int64_t workspace;             // the engine's workspace bytes
	int64_t engine;                // the engine's global index
	int nondet;                    // the engine carries the NONDETERMINISTIC note
	int ndesc;
	cudnnBackendDescriptor_t desc[DISTILL_SDPA_MAX_DESC];
} distill_sdpa_plan;

int distill_sdpa_build(const distill_cudnn_api *api, cudnnHandle_t handle, const distill_sdpa_key *k, distill_sdpa_plan *p, char *err,
                       int errlen);
int distill_sdpa_execute(const distill_cudnn_api *api, cudnnHandle_t handle, distill_sdpa_plan *p, int n, const int64_t *uids,
                         void *const *ptrs, uint64_t workspace, char *err, int errlen);
void distill_sdpa_destroy(const distill_cudnn_api *api, distill_sdpa_plan *p);

// call_* wrappers for the few entry points Go calls directly.
static inline size_t call_cudnnGetVersion(void *f) { return ((size_t(*)(void))f)(); }
static inline int call_cudnnCreate(void *f, cudnnHandle_t *h) { return ((int (*)(cudnnHandle_t *))f)(h); }
static inline int call_cudnnDestroy(void *f, cudnnHandle_t h) { return ((int (*)(cudnnHandle_t))f)(h); }
static inline int call_cudnnSetStream(void *f, cudnnHandle_t h, void *s) { return ((int (*)(cudnnHandle_t, void *))f)(h, s); }
static inline const char *call_cudnnGetErrorString(void *f, int s) { return ((const char *(*)(int))f)(s); }

#endif
