// Hand-declared pieces of NCCL 2's C API (nccl.h): the types, enum values
// and prototypes of the entry points this package calls, with NCCL's
// numeric values (stable across NCCL 2.x). No NCCL header is included;
// libnccl.so.2 is opened with dlopen (nccl.go) and each call_nccl*
// wrapper casts the pointer dlsym found to its prototype. The CPU
// emulator (testdata/emu/emu_nccl.cpp) exports the same entry points.
#ifndef DISTILL_NCCL_CAPI_H
#define DISTILL_NCCL_CAPI_H

#include <stddef.h>

typedef int ncclResult_t;
typedef void *ncclComm_t;
typedef void *distill_nccl_stream; // cudaStream_t, the driver's CUstream

// ncclUniqueId: 128 opaque bytes (NCCL_UNIQUE_ID_BYTES), passed by value
// to ncclCommInitRank.
typedef struct {
	char internal[128];
} ncclUniqueId;

// ncclResult_t
enum {
	DK_ncclSuccess = 0,
	DK_ncclUnhandledCudaError = 1,
	DK_ncclSystemError = 2,
	DK_ncclInternalError = 3,
	DK_ncclInvalidArgument = 4,
	DK_ncclInvalidUsage = 5,
	DK_ncclRemoteError = 6,
	DK_ncclInProgress = 7,
};

// ncclDataType_t and ncclRedOp_t: the ones this package uses.
enum {
	DK_ncclFloat32 = 7,
	DK_ncclBfloat16 = 9, // NCCL 2.10 and later
	DK_ncclSum = 0,
};

static inline ncclResult_t call_ncclGetVersion(void *f, int *v) { return ((ncclResult_t(*)(int *))f)(v); }
static inline ncclResult_t call_ncclGetUniqueId(void *f, ncclUniqueId *id) { return ((ncclResult_t(*)(ncclUniqueId *))f)(id); }
static inline ncclResult_t call_ncclCommInitRank(void *f, ncclComm_t *comm, int nranks, const ncclUniqueId *id, int rank) {
	return ((ncclResult_t(*)(ncclComm_t *, int, ncclUniqueId, int))f)(comm, nranks, *id, rank);
}
static inline ncclResult_t call_ncclCommDestroy(void *f, ncclComm_t comm) { return ((ncclResult_t(*)(ncclComm_t))f)(comm); }
static inline ncclResult_t call_ncclCommAbort(void *f, ncclComm_t comm) { return ((ncclResult_t(*)(ncclComm_t))f)(comm); }
static inline const char *call_ncclGetErrorString(void *f, ncclResult_t r) { return ((const char *(*)(ncclResult_t))f)(r); }
static inline const char *call_ncclGetLastError(void *f, ncclComm_t comm) { return ((const char *(*)(ncclComm_t))f)(comm); }
static inline ncclResult_t call_ncclCommGetAsyncError(void *f, ncclComm_t comm, ncclResult_t *err) {
	return ((ncclResult_t(*)(ncclComm_t, ncclResult_t *))f)(comm, err);
}
static inline ncclResult_t call_ncclAllReduce(void *f, unsigned long long send, unsigned long long recv, size_t count, int dtype, int op,
                                              ncclComm_t comm, distill_nccl_stream s) {
	return ((ncclResult_t(*)(const void *, void *, size_t, int, int, ncclComm_t, distill_nccl_stream))f)(
	    (const void *)send, (void *)recv, count, dtype, op, comm, s);
}
static inline ncclResult_t call_ncclReduceScatter(void *f, unsigned long long send, unsigned long long recv, size_t recvcount, int dtype,
                                                  int op, ncclComm_t comm, distill_nccl_stream s) {
	return ((ncclResult_t(*)(const void *, void *, size_t, int, int, ncclComm_t, distill_nccl_stream))f)(
	    (const void *)send, (void *)recv, recvcount, dtype, op, comm, s);
}
static inline ncclResult_t call_ncclAllGather(void *f, unsigned long long send, unsigned long long recv, size_t sendcount, int dtype,
                                              ncclComm_t comm, distill_nccl_stream s) {
	return ((ncclResult_t(*)(const void *, void *, size_t, int, ncclComm_t, distill_nccl_stream))f)((const void *)send, (void *)recv,
	                                                                                                sendcount, dtype, comm, s);
}
static inline ncclResult_t call_ncclBroadcast(void *f, unsigned long long send, unsigned long long recv, size_t count, int dtype, int root,
                                              ncclComm_t comm, distill_nccl_stream s) {
	return ((ncclResult_t(*)(const void *, void *, size_t, int, int, ncclComm_t, distill_nccl_stream))f)(
	    (const void *)send, (void *)recv, count, dtype, root, comm, s);
}
static inline ncclResult_t call_ncclGroupStart(void *f) { return ((ncclResult_t(*)(void))f)(); }
static inline ncclResult_t call_ncclGroupEnd(void *f) { return ((ncclResult_t(*)(void))f)(); }

#endif
