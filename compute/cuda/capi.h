// Hand-declared prototypes of the few CUDA driver, NVRTC and cuBLASLt entry
// points this package calls. No CUDA header is included anywhere: the types
// below are ABI-compatible stand-ins (handles are pointers, enums are ints),
// and every function is reached through a pointer that dl.go found with
// dlsym. Each call_* wrapper casts the pointer to the prototype and calls it;
// cgo cannot call a C function pointer directly.
#ifndef DISTILL_CUDA_CAPI_H
#define DISTILL_CUDA_CAPI_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUmemoryPool;

typedef int nvrtcResult;
typedef void *nvrtcProgram;

typedef int cublasStatus_t;
typedef void *cublasLtHandle_t;
typedef void *cublasLtMatmulDesc_t;
typedef void *cublasLtMatrixLayout_t;
typedef void *cublasLtMatmulPreference_t;

// cublasLtMatmulHeuristicResult_t: a 64-byte algo, the workspace it needs,
// its status, its wave count and reserved words (96 bytes).
typedef struct {
	uint64_t algo[8];
	size_t workspaceSize;
	int state;
	float wavesCount;
	int reserved[4];
} distill_heuristic;

// --- dlopen / dlsym.
static inline void *distill_dlopen(const char *path) { return dlopen(path, RTLD_NOW | RTLD_LOCAL); }
static inline const char *distill_dlerror(void) { return dlerror(); }
static inline void *distill_dlsym(void *h, const char *name) { return dlsym(h, name); }
static inline int distill_dlclose(void *h) { return dlclose(h); }

// --- CUDA driver.
static inline CUresult call_cuInit(void *f, unsigned flags) { return ((CUresult(*)(unsigned))f)(flags); }
static inline CUresult call_cuDriverGetVersion(void *f, int *v) { return ((CUresult(*)(int *))f)(v); }
static inline CUresult call_cuDeviceGetCount(void *f, int *n) { return ((CUresult(*)(int *))f)(n); }
static inline CUresult call_cuDeviceGet(void *f, CUdevice *d, int ord) { return ((CUresult(*)(CUdevice *, int))f)(d, ord); }
static inline CUresult call_cuDeviceGetName(void *f, char *name, int len, CUdevice d) {
	return ((CUresult(*)(char *, int, CUdevice))f)(name, len, d);
}
static inline CUresult call_cuDeviceGetAttribute(void *f, int *v, int attr, CUdevice d) {
	return ((CUresult(*)(int *, int, CUdevice))f)(v, attr, d);
}
static inline CUresult call_cuDeviceTotalMem(void *f, size_t *b, CUdevice d) { return ((CUresult(*)(size_t *, CUdevice))f)(b, d); }
static inline CUresult call_cuDevicePrimaryCtxRetain(void *f, CUcontext *c, CUdevice d) {
	return ((CUresult(*)(CUcontext *, CUdevice))f)(c, d);
}
static inline CUresult call_cuDevicePrimaryCtxRelease(void *f, CUdevice d) { return ((CUresult(*)(CUdevice))f)(d); }
static inline CUresult call_cuCtxSetCurrent(void *f, CUcontext c) { return ((CUresult(*)(CUcontext))f)(c); }
static inline CUresult call_cuCtxSynchronize(void *f) { return ((CUresult(*)(void))f)(); }
static inline CUresult call_cuStreamCreate(void *f, CUstream *s, unsigned flags) { return ((CUresult(*)(CUstream *, unsigned))f)(s, flags); }
static inline CUresult call_cuStreamDestroy(void *f, CUstream s) { return ((CUresult(*)(CUstream))f)(s); }
static inline CUresult call_cuStreamSynchronize(void *f, CUstream s) { return ((CUresult(*)(CUstream))f)(s); }
static inline CUresult call_cuMemAlloc(void *f, CUdeviceptr *p, size_t n) { return ((CUresult(*)(CUdeviceptr *, size_t))f)(p, n); }
static inline CUresult call_cuMemFree(void *f, CUdeviceptr p) { return ((CUresult(*)(CUdeviceptr))f)(p); }
static inline CUresult call_cuMemAllocAsync(void *f, CUdeviceptr *p, size_t n, CUstream s) {
	return ((CUresult(*)(CUdeviceptr *, size_t, CUstream))f)(p, n, s);
}
static inline CUresult call_cuMemFreeAsync(void *f, CUdeviceptr p, CUstream s) { return ((CUresult(*)(CUdeviceptr, CUstream))f)(p, s); }
static inline CUresult call_cuDeviceGetDefaultMemPool(void *f, CUmemoryPool *p, CUdevice d) {
	return ((CUresult(*)(CUmemoryPool *, CUdevice))f)(p, d);
}
static inline CUresult call_cuMemPoolSetAttribute(void *f, CUmemoryPool p, int attr, void *v) {
	return ((CUresult(*)(CUmemoryPool, int, void *))f)(p, attr, v);
}
static inline CUresult call_cuMemPoolGetAttribute(void *f, CUmemoryPool p, int attr, void *v) {
	return ((CUresult(*)(CUmemoryPool, int, void *))f)(p, attr, v);
}
static inline CUresult call_cuMemGetInfo(void *f, size_t *free, size_t *total) { return ((CUresult(*)(size_t *, size_t *))f)(free, total); }
static inline CUresult call_cuMemcpyHtoDAsync(void *f, CUdeviceptr dst, const void *src, size_t n, CUstream s) {
	return ((CUresult(*)(CUdeviceptr, const void *, size_t, CUstream))f)(dst, src, n, s);
}
static inline CUresult call_cuMemcpyDtoHAsync(void *f, void *dst, CUdeviceptr src, size_t n, CUstream s) {
	return ((CUresult(*)(void *, CUdeviceptr, size_t, CUstream))f)(dst, src, n, s);
}
static inline CUresult call_cuMemcpyDtoDAsync(void *f, CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
	return ((CUresult(*)(CUdeviceptr, CUdeviceptr, size_t, CUstream))f)(dst, src, n, s);
}
static inline CUresult call_cuMemcpyPeerAsync(void *f, CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx, size_t n, CUstream s) {
	return ((CUresult(*)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream))f)(dst, dctx, src, sctx, n, s);
}
static inline CUresult call_cuDeviceCanAccessPeer(void *f, int *can, CUdevice d, CUdevice peer) {
	return ((CUresult(*)(int *, CUdevice, CUdevice))f)(can, d, peer);
}
static inline CUresult call_cuCtxEnablePeerAccess(void *f, CUcontext peer, unsigned flags) {
	return ((CUresult(*)(CUcontext, unsigned))f)(peer, flags);
}
// CUmemAccessDesc: a CUmemLocation (type, id) and CUmemAccess_flags.
typedef struct {
	int type, id, flags;
} distill_mem_access;
static inline CUresult call_cuMemPoolSetAccess(void *f, CUmemoryPool p, const distill_mem_access *m, size_t count) {
	return ((CUresult(*)(CUmemoryPool, const distill_mem_access *, size_t))f)(p, m, count);
}
static inline CUresult call_cuMemAllocHost(void *f, void **p, size_t n) { return ((CUresult(*)(void **, size_t))f)(p, n); }
static inline CUresult call_cuMemFreeHost(void *f, void *p) { return ((CUresult(*)(void *))f)(p); }
static inline CUresult call_cuMemsetD8Async(void *f, CUdeviceptr dst, unsigned char v, size_t n, CUstream s) {
	return ((CUresult(*)(CUdeviceptr, unsigned char, size_t, CUstream))f)(dst, v, n, s);
}
static inline CUresult call_cuModuleLoadData(void *f, CUmodule *m, const void *image) {
	return ((CUresult(*)(CUmodule *, const void *))f)(m, image);
}
static inline CUresult call_cuModuleUnload(void *f, CUmodule m) { return ((CUresult(*)(CUmodule))f)(m); }
static inline CUresult call_cuModuleGetFunction(void *f, CUfunction *fn, CUmodule m, const char *name) {
	return ((CUresult(*)(CUfunction *, CUmodule, const char *))f)(fn, m, name);
}
static inline CUresult call_cuFuncSetAttribute(void *f, CUfunction fn, int attr, int v) {
	return ((CUresult(*)(CUfunction, int, int))f)(fn, attr, v);
}
static inline CUresult call_cuLaunchKernel(void *f, CUfunction fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                           unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params) {
	return ((CUresult(*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **,
	                     void **))f)(fn, gx, gy, gz, bx, by, bz, shmem, s, params, NULL);
}
static inline CUresult call_cuGetErrorName(void *f, CUresult r, const char **s) { return ((CUresult(*)(CUresult, const char **))f)(r, s); }
static inline CUresult call_cuGetErrorString(void *f, CUresult r, const char **s) {
	return ((CUresult(*)(CUresult, const char **))f)(r, s);
}
static inline CUresult call_cuEventCreate(void *f, CUevent *e, unsigned flags) { return ((CUresult(*)(CUevent *, unsigned))f)(e, flags); }
static inline CUresult call_cuStreamWaitEvent(void *f, CUstream s, CUevent e, unsigned flags) { return ((CUresult(*)(CUstream, CUevent, unsigned))f)(s, e, flags); }
static inline CUresult call_cuEventRecord(void *f, CUevent e, CUstream s) { return ((CUresult(*)(CUevent, CUstream))f)(e, s); }
static inline CUresult call_cuEventSynchronize(void *f, CUevent e) { return ((CUresult(*)(CUevent))f)(e); }
static inline CUresult call_cuEventElapsedTime(void *f, float *ms, CUevent a, CUevent b) {
	return ((CUresult(*)(float *, CUevent, CUevent))f)(ms, a, b);
}
static inline CUresult call_cuEventDestroy(void *f, CUevent e) { return ((CUresult(*)(CUevent))f)(e); }

// --- NVRTC.
static inline const char *call_nvrtcGetErrorString(void *f, nvrtcResult r) { return ((const char *(*)(nvrtcResult))f)(r); }
static inline nvrtcResult call_nvrtcVersion(void *f, int *major, int *minor) { return ((nvrtcResult(*)(int *, int *))f)(major, minor); }
static inline nvrtcResult call_nvrtcCreateProgram(void *f, nvrtcProgram *p, const char *src, const char *name) {
	return ((nvrtcResult(*)(nvrtcProgram *, const char *, const char *, int, const char *const *, const char *const *))f)(
	    p, src, name, 0, NULL, NULL);
}
static inline nvrtcResult call_nvrtcDestroyProgram(void *f, nvrtcProgram *p) { return ((nvrtcResult(*)(nvrtcProgram *))f)(p); }
static inline nvrtcResult call_nvrtcCompileProgram(void *f, nvrtcProgram p, int n, const char *const *opts) {
	return ((nvrtcResult(*)(nvrtcProgram, int, const char *const *))f)(p, n, opts);
}
static inline nvrtcResult call_nvrtcGetSize(void *f, nvrtcProgram p, size_t *n) { return ((nvrtcResult(*)(nvrtcProgram, size_t *))f)(p, n); }
static inline nvrtcResult call_nvrtcGetBytes(void *f, nvrtcProgram p, char *buf) { return ((nvrtcResult(*)(nvrtcProgram, char *))f)(p, buf); }

// --- cuBLASLt.
static inline cublasStatus_t call_cublasLtCreate(void *f, cublasLtHandle_t *h) { return ((cublasStatus_t(*)(cublasLtHandle_t *))f)(h); }
static inline cublasStatus_t call_cublasLtDestroy(void *f, cublasLtHandle_t h) { return ((cublasStatus_t(*)(cublasLtHandle_t))f)(h); }
static inline size_t call_cublasLtGetVersion(void *f) { return ((size_t(*)(void))f)(); }
static inline const char *call_cublasLtGetStatusString(void *f, cublasStatus_t s) { return ((const char *(*)(cublasStatus_t))f)(s); }
static inline cublasStatus_t call_cublasLtMatmulDescCreate(void *f, cublasLtMatmulDesc_t *d, int compute, int scale) {
	return ((cublasStatus_t(*)(cublasLtMatmulDesc_t *, int, int))f)(d, compute, scale);
}
static inline cublasStatus_t call_cublasLtDestroyDesc(void *f, void *d) { return ((cublasStatus_t(*)(void *))f)(d); }
static inline cublasStatus_t call_cublasLtSetAttribute(void *f, void *d, int attr, const void *buf, size_t n) {
	return ((cublasStatus_t(*)(void *, int, const void *, size_t))f)(d, attr, buf, n);
}
static inline cublasStatus_t call_cublasLtMatrixLayoutCreate(void *f, cublasLtMatrixLayout_t *l, int type, uint64_t rows, uint64_t cols,
                                                             int64_t ld) {
	return ((cublasStatus_t(*)(cublasLtMatrixLayout_t *, int, uint64_t, uint64_t, int64_t))f)(l, type, rows, cols, ld);
}
static inline cublasStatus_t call_cublasLtMatmulPreferenceCreate(void *f, cublasLtMatmulPreference_t *p) {
	return ((cublasStatus_t(*)(cublasLtMatmulPreference_t *))f)(p);
}
static inline cublasStatus_t call_cublasLtMatmulAlgoGetHeuristic(void *f, cublasLtHandle_t h, cublasLtMatmulDesc_t d,
                                                                 cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                                                 cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dd,
                                                                 cublasLtMatmulPreference_t p, int req, distill_heuristic *res,
                                                                 int *got) {
	return ((cublasStatus_t(*)(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
	                           cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatmulPreference_t, int,
	                           distill_heuristic *, int *))f)(h, d, a, b, c, dd, p, req, res, got);
}
static inline cublasStatus_t call_cublasLtMatmul(void *f, cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha, CUdeviceptr A,
                                                 cublasLtMatrixLayout_t la, CUdeviceptr B, cublasLtMatrixLayout_t lb,
                                                 const void *beta, CUdeviceptr C, cublasLtMatrixLayout_t lc, CUdeviceptr D,
                                                 cublasLtMatrixLayout_t ld, const distill_heuristic *algo, CUdeviceptr ws,
                                                 size_t wsSize, CUstream s) {
	return ((cublasStatus_t(*)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void *, const void *, cublasLtMatrixLayout_t,
	                           const void *, cublasLtMatrixLayout_t, const void *, const void *, cublasLtMatrixLayout_t, void *,
	                           cublasLtMatrixLayout_t, const void *, void *, size_t, CUstream))f)(
	    h, d, alpha, (const void *)A, la, (const void *)B, lb, beta, (const void *)C, lc, (void *)D, ld,
	    algo ? (const void *)algo->algo : NULL, (void *)ws, wsSize, s);
}

// --- The CPU emulator's extra hooks (testdata/emu): one checks a launch's
// parameter sizes against the kernel's C++ signature, the other the
// host's own accesses to pinned memory against the copies that use it
// (staging.go). Absent from the real driver.
static inline const char *call_distill_emu_check_params(void *f, CUfunction fn, const int *sizes, int n) {
	return ((const char *(*)(CUfunction, const int *, int))f)(fn, sizes, n);
}
static inline const char *call_distill_emu_host_access(void *f, const void *p, int write) {
	return ((const char *(*)(const void *, int))f)(p, write);
}

#endif
