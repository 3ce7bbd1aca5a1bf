// emu.h: the host side of the kernels' dialect, for the CPU emulator. Each
// kernel file is compiled as C++ with this header first and DISTILL_EMU
// defined; emu.cpp runs the kernels, one fiber per CUDA thread, and also
// stands in for libcuda, libnvrtc and libcublasLt (and emu_cudnn.cpp for
// libcudnn's graph API), so the backend's Go code runs unchanged against it
// (see emu_test.go).
#pragma once
#define DISTILL_EMU 1
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

typedef uint16_t u16;
typedef uint32_t u32;
typedef int32_t i32;
typedef uint64_t u64;
typedef int64_t i64;

struct emu_dim3 {
	unsigned x, y, z;
};
extern emu_dim3 threadIdx, blockIdx, blockDim, gridDim;

// Barriers: the block's, and the calling thread's warp's.
void __syncthreads();
void __syncwarp();
// emu_warp_exchange publishes this lane's bytes and returns lane src's (the
// warp-collective core of the shuffles).
void emu_warp_exchange(const void *mine, void *theirs, size_t n, int src);
void *emu_dyn_smem();
// emu_range_ok reports whether the n bytes at device address p lie inside
// one live allocation that the calling thread's current device may reach
// (its own, or a peer's that granted it access); if not, it says why in
// why (the cuDNN and NCCL stand-ins check every device buffer with it).
bool emu_range_ok(u64 p, size_t n, char *why, size_t whylen);
// The emulator is safe for use by several host threads (the driver is):
// every entry point holds one recursive lock for its whole call (kernels
// run one launch at a time), except NCCL's, whose ranks wait for each
// other and take it only around their own checks. EmuGuard holds it for
// a scope.
void emu_lock();
void emu_unlock();
struct EmuGuard {
	EmuGuard() { emu_lock(); }
	~EmuGuard() { emu_unlock(); }
	EmuGuard(const EmuGuard &) = delete;
	EmuGuard &operator=(const EmuGuard &) = delete;
};
// emu_kernel_check fails the launch, naming what, when ok is false: the
// kernels' DK_CHECK (prelude.cuh).
void emu_kernel_check(bool ok, const char *what);
void emu_mma_bf16_16816(float d[4], const u32 a[4], const u32 b[2]);
void emu_mma_e4m3_16832(float d[4], const u32 a[4], const u32 b[2]);
// cp.async (prelude.cuh: cp_async16, cp_async4): n bytes from global src
// to dynamic shared dst, zeros when !valid, copied at once but counted as
// pending in the thread's open group until a wait(n) has retired every
// group of the thread but the n newest (commit closes the open group).
// ldmatrix (ldsm_x4, ldsm_x4_t): a warp collective loading n 8x8 BF16
// matrices, each lane giving one row's address; a row still pending from a
// cp.async is a fault.
void emu_cp_async(void *dst, const void *src, int n, bool valid);
void emu_cp_async_commit();
void emu_cp_async_wait(int n);
void emu_ldmatrix(u32 *r, int n, const void *row, bool trans);

template <class T> T __shfl_xor_sync(unsigned, T v, int m) {
	T r;
	emu_warp_exchange(&v, &r, sizeof(T), (int)((threadIdx.x % 32) ^ (unsigned)m));
	return r;
}
template <class T> T __shfl_sync(unsigned, T v, int src) {
	T r;
	emu_warp_exchange(&v, &r, sizeof(T), src & 31);
	return r;
}

// Fibers switch only at barriers, so plain read-modify-writes are atomic.
static inline int atomicAdd(int *p, int v) {
	int o = *p;
	*p = o + v;
	return o;
}
static inline float atomicAdd(float *p, float v) {
	float o = *p;
	*p = o + v;
	return o;
}

static inline float __uint_as_float(u32 u) {
	float f;
	memcpy(&f, &u, 4);
	return f;
}
static inline u32 __float_as_uint(float f) {
	u32 u;
	memcpy(&u, &f, 4);
	return u;
}
static inline float __int_as_float(int i) { return __uint_as_float((u32)i); }
static inline int __float_as_int(float f) { return (int)__float_as_uint(f); }

// The double-precision intrinsics, each rounded once: the emulator is
// built for baseline x86-64 (no -march), which has no FMA instruction, so
// the compiler cannot contract a product into a following sum; __fma_rn
// is the C library's correctly rounded fma.
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
static inline float __double2float_rn(double d) { return (float)d; }
static inline long long __double_as_longlong(double d) {
	long long u;
	memcpy(&u, &d, 8);
	return u;
}
static inline double __longlong_as_double(long long u) {
	double d;
	memcpy(&d, &u, 8);
	return d;
}
using std::isinf;
using std::isnan;
using std::rint;
using std::signbit;

// emu_f2bf rounds to the nearest bfloat16, ties to even, NaN kept a quiet
// NaN: the kernels' f2bf, for the library stand-ins (cuBLASLt's BF16 D,
// cuDNN's BF16 tensors).
static inline u16 emu_f2bf(float f) {
	u32 b = __float_as_uint(f);
	if ((b & 0x7fffffffu) > 0x7f800000u) return (u16)((b >> 16) | 0x40u);
	return (u16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

#define DK_DEV static inline
#define DK_KERNEL static
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define DK_DYN_SMEM(T, name) T *name = reinterpret_cast<T *>(emu_dyn_smem())
#define DK_INF INFINITY

// Kernel registration: the trampoline unpacks cuLaunchKernel's void**
// parameters with the kernel's own parameter types.
typedef void (*emu_tramp)(void *fn, void **params);
// sizes are the parameters' sizes; ro[i] is 1 for a pointer to const (a
// buffer the kernel only reads: the stream-order checks, emu.cpp, treat
// every other pointer as read and written).
int emu_register(const char *name, void *fn, emu_tramp tramp, const int *sizes, const int *ro, int n);
template <class T> struct emu_ro {
	static const int value = 0;
};
template <class T> struct emu_ro<const T *> {
	static const int value = 1;
};
// emu_stream_access records that an operation on stream s (a CUstream;
// NULL: the current context's) reads (write false) or writes the
// allocation holding device address p, for the stream-order checks (see
// emu.cpp); false, with why, when nothing orders it after a conflicting
// access on another stream. The NCCL stand-in calls it for its buffers.
bool emu_stream_access(void *s, u64 p, bool write, const char *what, char *why, size_t whylen);

template <class... A, size_t... I> static void emu_call(void (*f)(A...), void **p, std::index_sequence<I...>) {
	f(*reinterpret_cast<A *>(p[I])...);
}
template <class... A> static void emu_tramp_for(void *fn, void **p) {
	emu_call(reinterpret_cast<void (*)(A...)>(fn), p, std::index_sequence_for<A...>{});
}
template <class... A> static int emu_register_fn(const char *name, void (*f)(A...)) {
	static const int sizes[sizeof...(A) + 1] = {(int)sizeof(A)..., 0};
	static const int ro[sizeof...(A) + 1] = {emu_ro<A>::value..., 0};
	return emu_register(name, reinterpret_cast<void *>(f), &emu_tramp_for<A...>, sizes, ro, (int)sizeof...(A));
}
#define DK_REGISTER(name) __attribute__((used)) static int emu_reg_##name = emu_register_fn(#name, name);

#define mma_bf16_16816 emu_mma_bf16_16816
#define mma_e4m3_16832 emu_mma_e4m3_16832
