// emu.cpp: a CPU stand-in for the CUDA driver, NVRTC and cuBLASLt, exported
// under their real names, for the tests of package compute/cuda on machines
// without a GPU. It runs the kernels (compiled for the host from the same
// .cu files, see emu.h) one block at a time, one fiber per CUDA thread:
// a fiber runs until it reaches a barrier (__syncthreads, __syncwarp, a
// shuffle, an mma), so the kernels' use of barriers, shared memory and warp
// collectives is exercised as written. It checks what it can: launch
// limits, dynamic shared memory against the opted-in size, parameter sizes
// against the kernel's signature, copies against allocations, barriers
// that not every thread reaches. The cuBLASLt stand-in computes the GEMM
// its descriptors describe, column-major as cuBLASLt defines it. The cuDNN
// stand-in (an interpreter of backend operation graphs) is emu_cudnn.cpp.
//
// Devices: DISTILL_EMU_DEVICES (default 1, at most 16) emulated GPUs, each
// with its own memory (DISTILL_EMU_DEVICE_MEM bytes, or
// DISTILL_EMU_DEVICE_MEM_<ordinal> for one of them; default 16 GiB), its
// primary context, its default pool and its streams. A host thread's
// current context (cuCtxSetCurrent) picks the device that allocations,
// cuMemGetInfo and launches use, and a stream belongs to the device whose
// context was current when it was made: a launch on another device's
// stream fails, as on a GPU. Every allocation belongs to its device: a
// kernel parameter, a copy, a GEMM operand or a cuDNN or NCCL buffer on
// another device is an error unless that device granted access (pool
// memory: cuMemPoolSetAccess; cuMemAlloc's: cuCtxEnablePeerAccess), which
// needs cuDeviceCanAccessPeer (yes between distinct devices, unless
// DISTILL_EMU_PEER=0: then no pair may, and copies between devices must go
// through host memory). cuMemcpyPeerAsync copies between devices and is
// held to the same rule (stricter than the driver, which would stage an
// unreachable copy through the host itself: the emulator makes a missing
// grant visible). cuMemAllocHost gives pinned host memory (plain memory
// here). Streams: every operation runs when it is enqueued, and the order
// the program asks for between streams (events, host synchronization) is
// checked instead ("stream order" below).
#include "emu.h"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <sys/mman.h>
#include <vector>

static std::recursive_mutex g_mu;
void emu_lock() { g_mu.lock(); }
void emu_unlock() { g_mu.unlock(); }
#define EMU_LOCK EmuGuard emu_guard_

typedef int CUresult;
typedef void *CUfunction;

// ---------------------------------------------------------------- errors

static thread_local std::string g_err; // the calling thread's last failure, in words
static CUresult fail(CUresult code, const std::string &msg) {
	g_err = msg;
	fprintf(stderr, "emu: %s\n", msg.c_str());
	return code;
}
enum {
	E_INVALID_VALUE = 1,
	E_OUT_OF_MEMORY = 2,
	E_INVALID_DEVICE = 101,
	E_INVALID_IMAGE = 200,
	E_PEER_UNSUPPORTED = 217,
	E_INVALID_HANDLE = 400,
	E_NOT_FOUND = 500,
	E_ILLEGAL_ADDRESS = 700,
	E_PEER_ALREADY_ENABLED = 704,
	E_LAUNCH_OUT_OF_RESOURCES = 701,
	E_LAUNCH_FAILED = 719,
};

// ---------------------------------------------------------------- kernels

struct Kernel {
	std::string name;
	void *fn;
	emu_tramp tramp;
	std::vector<int> sizes;
	std::vector<int> ro; // a pointer to const: read only
	int maxDynSmem = 48 << 10;
};
static std::map<std::string, Kernel> &registry() {
	static std::map<std::string, Kernel> r;
	return r;
}
int emu_register(const char *name, void *fn, emu_tramp tramp, const int *sizes, const int *ro, int n) {
	Kernel k;
	k.name = name;
	k.fn = fn;
	k.tramp = tramp;
	k.sizes.assign(sizes, sizes + n);
	k.ro.assign(ro, ro + n);
	registry()[name] = k;
	return 0;
}

// ---------------------------------------------------------------- fibers

emu_dim3 threadIdx, blockIdx, blockDim, gridDim;

enum State { READY, AT_BLOCK, AT_WARP, DONE };
struct Fiber {
	void *sp = nullptr; // saved stack pointer
	char *stack = nullptr;
	State state = READY;
	unsigned tid = 0;
};
static const size_t kStack = 256 << 10;
static std::vector<Fiber> g_fib;
static void *g_sched_sp;
static int g_cur;
static Kernel *g_kernel;
static void **g_params;
static std::vector<unsigned char> g_dyn;
static std::string g_fault; // a kernel-side error found during the block

// emu_switch saves the callee-saved registers and the stack pointer in
// *save, then resumes the context whose stack pointer is next.
extern "C" void emu_switch(void **save, void *next);
asm(R"(
.pushsection .text
.globl emu_switch
.type emu_switch,@function
emu_switch:
	pushq %rbp
	pushq %rbx
	pushq %r12
	pushq %r13
	pushq %r14
	pushq %r15
	movq %rsp, (%rdi)
	movq %rsi, %rsp
	popq %r15
	popq %r14
	popq %r13
	popq %r12
	popq %rbx
	popq %rbp
	ret
.size emu_switch,.-emu_switch
.popsection
)");

static void set_thread(unsigned tid) {
	threadIdx.x = tid % blockDim.x;
	threadIdx.y = (tid / blockDim.x) % blockDim.y;
	threadIdx.z = tid / (blockDim.x * blockDim.y);
}

[[noreturn]] static void fiber_main() {
	g_kernel->tramp(g_kernel->fn, g_params);
	g_fib[g_cur].state = DONE;
	emu_switch(&g_fib[g_cur].sp, g_sched_sp);
	abort(); // never resumed
}

static void fiber_init(Fiber &f, unsigned tid) {
	if (!f.stack) {
		// A guard page below the stack turns an overflow into a fault.
		char *m = (char *)mmap(nullptr, kStack + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (m == MAP_FAILED) abort();
		mprotect(m, 4096, PROT_NONE);
		f.stack = m + 4096;
	}
	uintptr_t top = ((uintptr_t)(f.stack + kStack)) & ~(uintptr_t)15;
	void **sp = (void **)top;
	*--sp = nullptr;              // fiber_main's "return address": never used
	*--sp = (void *)&fiber_main; // where emu_switch's ret goes
	for (int i = 0; i < 6; i++) *--sp = nullptr; // rbp rbx r12..r15
	f.sp = sp;
	f.state = READY;
	f.tid = tid;
}

static void block_yield(State s) {
	Fiber &f = g_fib[g_cur];
	f.state = s;
	emu_switch(&f.sp, g_sched_sp);
	set_thread(g_fib[g_cur].tid);
}

void __syncthreads() { block_yield(AT_BLOCK); }
void __syncwarp() { block_yield(AT_WARP); }

// Warp exchange: publish, barrier, read, barrier (so that no lane
// overwrites its slot before every lane has read it).
static u64 g_slots[32][32][16];
void emu_warp_exchange(const void *mine, void *theirs, size_t n, int src) {
	unsigned tid = g_fib[g_cur].tid, w = tid / 32, lane = tid % 32;
	memcpy(g_slots[w][lane], mine, n);
	__syncwarp();
	memcpy(theirs, g_slots[w][src], n);
	__syncwarp();
}

void *emu_dyn_smem() { return g_dyn.data(); }

static float bf(u32 reg, int hi) { return __uint_as_float((hi ? reg >> 16 : reg & 0xffffu) << 16); }

// mma_emulate is a warp's mma.sync.m16n8kK row.col with fp32 accumulators
// from the PTX ISA's fragment layouts (see prelude.cuh): K/2 elements of a
// row of A (or a column of B) in a lane's register pair, el(reg, i) the
// register's i-th element (BF16: K 16, two a register; E4M3: K 32, four).
// Every lane publishes its fragments, then computes its own four outputs
// from the whole warp's, the products added in k order.
template <int K, class El> static void mma_emulate(float d[4], const u32 a[4], const u32 b[2], El el) {
	constexpr int half = K / 2, per = K / 8; // k of a register pair; elements a register
	unsigned tid = g_fib[g_cur].tid, w = tid / 32, lane = tid % 32;
	u32 *mine = (u32 *)g_slots[w][lane];
	for (int i = 0; i < 4; i++) mine[i] = a[i];
	mine[4] = b[0];
	mine[5] = b[1];
	__syncwarp();
	int g = lane / 4, t = lane % 4;
	float out[4];
	for (int e = 0; e < 4; e++) {
		int r = e < 2 ? g : g + 8, c = 2 * t + (e & 1);
		float acc = d[e];
		for (int kk = 0; kk < K; kk++) {
			// A[r][kk]: lane (r%8)*4 + (kk%half)/per, register (r>=8) + 2*(kk>=half).
			const u32 *la = (const u32 *)g_slots[w][(r % 8) * 4 + (kk % half) / per];
			float av = el(la[(r >= 8 ? 1 : 0) + (kk >= half ? 2 : 0)], kk % per);
			// B[kk][c]: lane c*4 + (kk%half)/per, register 4 + (kk>=half).
			const u32 *lb = (const u32 *)g_slots[w][c * 4 + (kk % half) / per];
			float bv = el(lb[4 + (kk >= half ? 1 : 0)], kk % per);
			acc = fmaf(av, bv, acc);
		}
		out[e] = acc;
	}
	__syncwarp();
	for (int e = 0; e < 4; e++) d[e] = out[e];
}

// mma.sync.m16n8k16 row.col f32.bf16.bf16.f32.
void emu_mma_bf16_16816(float d[4], const u32 a[4], const u32 b[2]) {
	mma_emulate<16>(d, a, b, [](u32 reg, int i) { return bf(reg, i); });
}

// e4m3 is the value of an E4M3FN code: sign, 4 exponent bits (bias 7), 3
// mantissa bits; exponent 0 subnormal; 0x7f and 0xff NaN (no infinities).
static float e4m3(unsigned c) {
	unsigned e = (c >> 3) & 15, m = c & 7;
	float v = (c & 0x7f) == 0x7f ? NAN : e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), (int)e - 10);
	return c & 0x80 ? -v : v;
}

// mma.sync.m16n8k32 row.col f32.e4m3.e4m3.f32: the products are exact in
// fp32.
void emu_mma_e4m3_16832(float d[4], const u32 a[4], const u32 b[2]) {
	mma_emulate<32>(d, a, b, [](u32 reg, int i) { return e4m3((reg >> (8 * i)) & 0xff); });
}

// ---------------------------------------------------------------- cp.async, ldmatrix

static bool in_alloc(u64 p, size_t n);

// kernel_fault records a kernel's bad access (the first of the block; the
// access itself is skipped); the launch fails when the block ends.
static void kernel_fault(const std::string &msg) {
	if (g_fault.empty()) g_fault = msg;
}

void emu_kernel_check(bool ok, const char *what) {
	if (!ok) kernel_fault(std::string("kernel invariant broken: ") + what);
}

static bool in_dyn_smem(const void *p, size_t n) {
	const unsigned char *b = g_dyn.data(), *q = (const unsigned char *)p;
	return g_dyn.size() >= 16 && q >= b && q + n <= b + (g_dyn.size() - 16);
}

// cp.async copies land at once (fibers switch only at barriers and warp
// collectives, so no other thread can tell, and a copy into a buffer that
// a slower warp still reads, a missing barrier, corrupts it as on the
// GPU). What the GPU leaves undefined until the issuing thread's wait, the
// emulator checks instead: every 4-byte granule of shared memory counts the
// copies into it not yet waited for, and ldmatrix faults on a row with any.
// Each thread keeps its copies by group, open first, for its waits.
struct CpCopy {
	u32 granule, n; // shared memory granules [granule, granule+n)
};
struct CpQueue {
	std::vector<CpCopy> open;
	std::vector<std::vector<CpCopy>> groups;
};
static std::vector<CpQueue> g_cp;     // by thread of the running block
static std::vector<u16> g_cp_pending; // by granule of the dynamic shared memory

void emu_cp_async(void *dst, const void *src, int n, bool valid) {
	unsigned tid = g_fib[g_cur].tid;
	char buf[200];
	if (((uintptr_t)dst | (uintptr_t)src) % (uintptr_t)n != 0) {
		snprintf(buf, sizeof buf, "thread %u: cp.async of %d bytes from %p to %p: misaligned", tid, n, src, dst);
		return kernel_fault(buf);
	}
	if (!in_dyn_smem(dst, n)) {
		snprintf(buf, sizeof buf, "thread %u: cp.async of %d bytes to %p: not inside the block's dynamic shared memory", tid, n, dst);
		return kernel_fault(buf);
	}
	if (valid && !in_alloc((u64)src, n)) {
		snprintf(buf, sizeof buf, "thread %u: cp.async of %d bytes from %p: not inside one allocation", tid, n, src);
		return kernel_fault(buf);
	}
	if (valid) memcpy(dst, src, n);
	else memset(dst, 0, n);
	u32 g = (u32)(((unsigned char *)dst - g_dyn.data()) / 4);
	for (int i = 0; i < n / 4; i++) g_cp_pending[g + i]++;
	g_cp[tid].open.push_back({g, (u32)n / 4});
}

void emu_cp_async_commit() {
	CpQueue &q = g_cp[g_fib[g_cur].tid];
	q.groups.push_back(std::move(q.open));
	q.open.clear();
}

void emu_cp_async_wait(int n) {
	CpQueue &q = g_cp[g_fib[g_cur].tid];
	size_t done = q.groups.size() > (size_t)n ? q.groups.size() - (size_t)n : 0;
	for (size_t i = 0; i < done; i++)
		for (const CpCopy &c : q.groups[i])
			for (u32 k = 0; k < c.n; k++) g_cp_pending[c.granule + k]--;
	q.groups.erase(q.groups.begin(), q.groups.begin() + done);
}

// cp_async_reset prepares the bookkeeping for a block of nt threads.
static void cp_async_reset(unsigned nt) {
	g_cp.assign(nt, CpQueue{});
	g_cp_pending.assign(g_dyn.size() / 4, 0);
}

// cp_async_pending: a copy that its thread never waited for (an error: the
// kernel cannot have used it correctly), or "".
static std::string cp_async_pending() {
	for (size_t t = 0; t < g_cp.size(); t++) {
		size_t n = g_cp[t].open.size();
		for (auto &g : g_cp[t].groups) n += g.size();
		if (n) return "thread " + std::to_string(t) + " exited with " + std::to_string(n) + " cp.async copies it never waited for";
	}
	return "";
}

// ldmatrix.m8n8.b16 (.x1/.x2/.x4, .trans): lane l < 8n gives the address
// of row l%8 of matrix l/8; register i of lane (g, t) is row g, columns
// 2t..2t+1 of matrix i, or with trans column g, rows 2t..2t+1 (the low
// half the lower column or row).
void emu_ldmatrix(u32 *r, int n, const void *row, bool trans) {
	unsigned tid = g_fib[g_cur].tid, w = tid / 32, lane = tid % 32;
	const u16 *mine = (const u16 *)row;
	if ((int)lane < 8 * n) {
		const char *bad = nullptr;
		if ((uintptr_t)row % 16 != 0) bad = "not 16-byte aligned";
		else if (!in_dyn_smem(row, 16)) bad = "not inside the block's dynamic shared memory";
		else {
			size_t g = ((const unsigned char *)row - g_dyn.data()) / 4;
			for (size_t i = g; i < g + 4 && i < g_cp_pending.size(); i++)
				if (g_cp_pending[i]) bad = "copied there by a cp.async not yet waited for";
		}
		if (bad) {
			char buf[200];
			snprintf(buf, sizeof buf, "thread %u: ldmatrix row address %p: %s", tid, row, bad);
			kernel_fault(buf);
			mine = nullptr;
		}
	}
	memcpy(g_slots[w][lane], &mine, sizeof mine);
	__syncwarp();
	int g = lane / 4, t = lane % 4;
	for (int i = 0; i < n; i++) {
		const u16 *lo, *hi;
		int clo, chi;
		if (trans) {
			memcpy(&lo, g_slots[w][8 * i + 2 * t], sizeof lo);
			memcpy(&hi, g_slots[w][8 * i + 2 * t + 1], sizeof hi);
			clo = chi = g;
		} else {
			memcpy(&lo, g_slots[w][8 * i + g], sizeof lo);
			hi = lo;
			clo = 2 * t;
			chi = 2 * t + 1;
		}
		r[i] = lo && hi ? (u32)lo[clo] | (u32)hi[chi] << 16 : 0xffffffffu;
	}
	__syncwarp();
}

static std::string state_name(State s) {
	switch (s) {
	case READY: return "running";
	case AT_BLOCK: return "at __syncthreads";
	case AT_WARP: return "at a warp collective";
	case DONE: return "exited";
	}
	return "?";
}

// run_block runs every thread of the current block to completion. Threads
// run in index order, or in reverse order with DISTILL_EMU_REVERSE=1: a
// missing barrier shows up in one order or the other (a thread reading
// what a later, or an earlier, thread has not written yet).
static bool g_reverse;
static bool run_block(unsigned nthreads) {
	for (unsigned i = 0; i < nthreads; i++) fiber_init(g_fib[i], i);
	unsigned nwarps = nthreads / 32;
	for (;;) {
		bool any = false;
		for (unsigned j = 0; j < nthreads; j++) {
			unsigned i = g_reverse ? nthreads - 1 - j : j;
			if (g_fib[i].state != READY) continue;
			g_cur = (int)i;
			set_thread(g_fib[i].tid);
			emu_switch(&g_sched_sp, g_fib[i].sp);
			any = true;
		}
		// Release warps whose 32 lanes all wait at a warp collective.
		bool released = false;
		unsigned done = 0, atBlock = 0;
		for (unsigned w = 0; w < nwarps; w++) {
			unsigned atWarp = 0, wdone = 0;
			for (unsigned l = 0; l < 32; l++) {
				State s = g_fib[w * 32 + l].state;
				atWarp += s == AT_WARP;
				wdone += s == DONE;
			}
			if (atWarp == 32) {
				for (unsigned l = 0; l < 32; l++) g_fib[w * 32 + l].state = READY;
				released = true;
			} else if (atWarp > 0 && wdone > 0) {
				char buf[200];
				snprintf(buf, sizeof buf, "warp %u: %u lanes wait at a warp collective that %u exited lanes never reach", w, atWarp, wdone);
				g_fault = buf;
				return false;
			}
		}
		for (unsigned i = 0; i < nthreads; i++) {
			done += g_fib[i].state == DONE;
			atBlock += g_fib[i].state == AT_BLOCK;
		}
		if (done == nthreads) return true;
		if (released) continue;
		if (atBlock + done == nthreads) {
			if (done > 0) {
				char buf[200];
				snprintf(buf, sizeof buf, "__syncthreads reached by %u threads while %u have exited (a barrier after an early return)", atBlock, done);
				g_fault = buf;
				return false;
			}
			for (unsigned i = 0; i < nthreads; i++) g_fib[i].state = READY;
			continue;
		}
		if (!any) {
			std::string msg = "deadlock:";
			for (unsigned i = 0; i < nthreads && i < 64; i += 32) {
				char buf[100];
				snprintf(buf, sizeof buf, " thread %u %s;", i, state_name(g_fib[i].state).c_str());
				msg += buf;
			}
			msg += " (threads wait at different barriers)";
			g_fault = msg;
			return false;
		}
	}
}

// ---------------------------------------------------------------- memory

// Devices, contexts and streams.
static const int kMaxDev = 16;
static int emu_ndev() {
	const char *v = getenv("DISTILL_EMU_DEVICES");
	int n = v && *v ? atoi(v) : 1;
	return n < 1 ? 1 : n > kMaxDev ? kMaxDev : n;
}
static bool valid_dev(int d) { return d >= 0 && d < emu_ndev(); }
static int g_ctx[kMaxDev], g_pool[kMaxDev]; // a context's and a pool's handle: the address of its slot
static thread_local int t_dev;              // the device of the calling thread's current context
static int ctx_dev(void *c) { return (int)((int *)c - g_ctx); }
static bool is_ctx(void *c) { return (int *)c >= g_ctx && (int *)c < g_ctx + kMaxDev && valid_dev(ctx_dev(c)); }
struct Stream {
	int dev;
	int id; // its name in the stream-order checks (1, 2, ...)
};
static std::set<Stream *> g_streams;
// stream_dev is the device of stream s (the current context's for the
// NULL stream), or -1 for a handle that is no stream.
static int stream_dev(void *s) {
	if (!s) return t_dev;
	return g_streams.count((Stream *)s) ? ((Stream *)s)->dev : -1;
}
// Peer access: g_ctx_peer[a][o], device a's context may reach device o's
// cuMemAlloc memory (cuCtxEnablePeerAccess); g_pool_access[o][a], device
// o's pool lets device a reach its allocations (cuMemPoolSetAccess).
static bool g_ctx_peer[kMaxDev][kMaxDev], g_pool_access[kMaxDev][kMaxDev];
static bool can_access_peer(int d, int peer) {
	const char *v = getenv("DISTILL_EMU_PEER");
	return valid_dev(d) && valid_dev(peer) && d != peer && !(v && v[0] == '0');
}

struct Alloc {
	size_t n;
	int dev;
	bool pool; // from cuMemAllocAsync (the stream-ordered pool)
};
static std::map<u64, Alloc> g_allocs; // device pointer -> allocation

// find_alloc returns the allocation holding [p, p+n), or null.
static const Alloc *find_alloc(u64 p, size_t n) {
	auto it = g_allocs.upper_bound(p);
	if (it == g_allocs.begin()) return nullptr;
	--it;
	return p >= it->first && p + n <= it->first + it->second.n ? &it->second : nullptr;
}

// reachable reports whether device d may read and write allocation a.
static bool reachable(const Alloc &a, int d) {
	if (a.dev == d) return true;
	return a.pool ? g_pool_access[a.dev][d] : g_ctx_peer[d][a.dev];
}

static int g_launch_dev; // the device of the running kernel

static bool in_alloc(u64 p, size_t n) {
	const Alloc *a = find_alloc(p, n);
	return a && reachable(*a, g_launch_dev);
}

// Device memory accounting, per device, as the stream-ordered pool's
// USED_MEM_CURRENT and USED_MEM_HIGH count it: the bytes of live
// allocations and their high-water mark. A device's size is read at every
// call (DISTILL_EMU_DEVICE_MEM_<d>, else DISTILL_EMU_DEVICE_MEM, else 16
// GiB), so that a test can shrink a device after loading a model; an
// allocation beyond it fails with CUDA_ERROR_OUT_OF_MEMORY, as on a GPU.
static size_t g_used[kMaxDev], g_used_high[kMaxDev];

static size_t emu_device_mem(int d) {
	char name[64];
	snprintf(name, sizeof name, "DISTILL_EMU_DEVICE_MEM_%d", d);
	const char *v = getenv(name);
	if (!v || !*v) v = getenv("DISTILL_EMU_DEVICE_MEM");
	return v && *v ? (size_t)strtoull(v, nullptr, 10) : (size_t)16 << 30;
}

static void forget(u64 p); // stream order: a new or freed allocation has no history

static u64 emu_alloc(size_t n, int d, bool pool) {
	size_t total = emu_device_mem(d);
	if (g_used[d] > total || n > total - g_used[d]) return 0;
	size_t sz = (n + 255) / 256 * 256;
	void *p = aligned_alloc(256, sz ? sz : 256);
	if (!p) return 0;
	memset(p, 0xff, sz); // device memory is not zeroed: poison it
	g_allocs[(u64)p] = Alloc{n, d, pool};
	forget((u64)p);
	g_used[d] += n;
	if (g_used[d] > g_used_high[d]) g_used_high[d] = g_used[d];
	return (u64)p;
}

static CUresult emu_free(u64 p, const char *who) {
	if (!p) return 0;
	auto it = g_allocs.find(p);
	if (it == g_allocs.end()) {
		char buf[120];
		snprintf(buf, sizeof buf, "%s of 0x%llx, which is not an allocation", who, (unsigned long long)p);
		return fail(E_INVALID_VALUE, buf);
	}
	free((void *)p);
	g_used[it->second.dev] -= it->second.n;
	g_allocs.erase(it);
	forget(p);
	return 0;
}

// range_why explains why [p, p+n) is not memory device d may use, or
// returns "" when it is.
static std::string range_why(u64 p, size_t n, int d) {
	char buf[240];
	if (n == 0) return "";
	if (const Alloc *a = find_alloc(p, n)) {
		if (reachable(*a, d)) return "";
		snprintf(buf, sizeof buf, "%zu bytes at 0x%llx are device %d's memory, which device %d may not reach (no peer access granted: %s)", n,
		         (unsigned long long)p, a->dev, d, a->pool ? "cuMemPoolSetAccess" : "cuCtxEnablePeerAccess");
		return buf;
	}
	auto it = g_allocs.upper_bound(p);
	if (it != g_allocs.begin()) {
		--it;
		if (p >= it->first && p < it->first + it->second.n) {
			snprintf(buf, sizeof buf, "%zu bytes at 0x%llx run %llu bytes past the end of the %zu-byte allocation at 0x%llx", n,
			         (unsigned long long)p, (unsigned long long)(p + n - (it->first + it->second.n)), it->second.n,
			         (unsigned long long)it->first);
			return buf;
		}
	}
	snprintf(buf, sizeof buf, "0x%llx (%zu bytes) is not inside any device allocation", (unsigned long long)p, n);
	return buf;
}

bool emu_range_ok(u64 p, size_t n, char *why, size_t whylen) {
	EMU_LOCK;
	std::string w = range_why(p, n, t_dev);
	if (w.empty()) return true;
	snprintf(why, whylen, "%s", w.c_str());
	return false;
}

// check_range fails unless [p, p+n) is memory device d may use.
static CUresult check_range(u64 p, size_t n, const char *who, int d) {
	std::string w = range_why(p, n, d);
	if (w.empty()) return 0;
	return fail(E_INVALID_VALUE, std::string(who) + ": " + w);
}

// check_stream fails unless s is a stream of the current context's device
// (who: the call), and gives its device.
static CUresult check_stream(void *s, const char *who, int *dev) {
	int d = stream_dev(s);
	if (d < 0) return fail(E_INVALID_HANDLE, std::string(who) + ": not a stream");
	if (d != t_dev) {
		char buf[160];
		snprintf(buf, sizeof buf, "%s: a stream of device %d, with device %d's context current", who, d, t_dev);
		return fail(E_INVALID_HANDLE, buf);
	}
	*dev = d;
	return 0;
}

// ---------------------------------------------------------------- stream order
//
// The emulator runs each operation when it is enqueued, so the work of two
// streams happens in the host's issue order, an order a GPU does not keep:
// a program that forgot an event between two streams runs right here and
// races there. So the emulator checks the order the program asks for, as
// a race detector does (vector clocks): every operation on a stream takes
// the next tick of that stream's clock; a stream's clock also holds what
// it has waited for (cuStreamWaitEvent: the clock an event took at
// cuEventRecord) and what the host had waited for when it enqueued the
// operation (cuStreamSynchronize, cuEventSynchronize, cuCtxSynchronize).
// Each allocation remembers its last writer and its readers since; an
// operation that writes an allocation a read or a write on another stream
// touched, or reads one another stream wrote, with no tick of that
// access in its stream's clock, fails with CUDA_ERROR_ILLEGAL_STATE
// naming both operations. So does a cuMemFreeAsync of memory another
// stream may still use. Accesses: a kernel reads a parameter that is a
// pointer to const and reads and writes any other parameter that points
// into an allocation (whole allocations: no finer); copies, memsets,
// cuBLASLt's A, B, C and D, cuDNN's tensors (all as written) and NCCL's
// buffers as they are used; copies to and from pinned host memory
// (cuMemAllocHost) too. Not seen: pointers a kernel reads from device
// memory (the multi-tensor kernels' tables), the host's own reads and
// writes of pinned memory (the backend asks distill_emu_host_access
// before it touches its staging memory: below). The NULL stream is
// one more stream per device here (not the legacy stream's implicit
// synchronization). DISTILL_EMU_RACE=0 turns the checks off.
enum { E_ILLEGAL_STATE = 401 };
typedef std::map<int, u64> VClock;
static void vc_join(VClock &a, const VClock &b) {
	for (auto &kv : b)
		if (a[kv.first] < kv.second) a[kv.first] = kv.second;
}
static u64 vc_get(const VClock &a, int s) {
	auto it = a.find(s);
	return it == a.end() ? 0 : it->second;
}
static int g_next_stream = 1;
static VClock g_host_vc;                // what the host has waited for
static std::map<int, VClock> g_vc;     // a stream's clock, by id
static std::map<int, int> g_stream_of; // a stream id's device
struct Access {
	int sid;
	u64 tick;
	std::string what;
};
struct History {
	bool written = false;
	Access w;
	std::map<int, Access> r; // the latest read of each stream since w
};
static std::map<u64, History> g_hist; // by allocation address
static bool race_checks() {
	const char *v = getenv("DISTILL_EMU_RACE");
	return !(v && v[0] == '0');
}
// sid_of is stream s's id (NULL: the current device's default stream).
static int sid_of(void *s) {
	int id = s ? ((Stream *)s)->id : -1 - t_dev;
	g_stream_of[id] = s ? ((Stream *)s)->dev : t_dev;
	return id;
}
// op_begin starts an operation on stream sid: after what the host had
// waited for, one tick later than the stream's last.
static void op_begin(int sid) {
	VClock &v = g_vc[sid];
	vc_join(v, g_host_vc);
	v[sid]++;
}
static std::string sname(int sid) {
	char buf[64];
	if (sid < 0) snprintf(buf, sizeof buf, "device %d's NULL stream", -1 - sid);
	else snprintf(buf, sizeof buf, "stream %d (device %d)", sid, g_stream_of[sid]);
	return buf;
}
// g_pinned is cuMemAllocHost's memory (address -> bytes): streams'
// copies to and from it are checked as a device allocation's are (what
// the host itself reads or writes there is not seen).
static std::map<u64, size_t> g_pinned;

// holder finds the allocation (device or pinned) that holds p: its
// address and bytes, or false.
static bool holder(u64 p, u64 *base, size_t *n) {
	auto it = g_allocs.upper_bound(p);
	if (it != g_allocs.begin()) {
		--it;
		if (p >= it->first && p < it->first + (it->second.n ? it->second.n : 1)) {
			*base = it->first;
			*n = it->second.n;
			return true;
		}
	}
	auto ht = g_pinned.upper_bound(p);
	if (ht != g_pinned.begin()) {
		--ht;
		if (p >= ht->first && p < ht->first + (ht->second ? ht->second : 1)) {
			*base = ht->first;
			*n = ht->second;
			return true;
		}
	}
	return false;
}

// touch records operation what on stream sid reading or writing the
// allocation (device or pinned host memory) that holds p (if any), or
// says why it races.
static std::string touch(int sid, u64 p, bool write, const std::string &what) {
	if (!race_checks()) return "";
	u64 base;
	size_t bytes;
	if (!holder(p, &base, &bytes)) return "";
	History &h = g_hist[base];
	const VClock &v = g_vc[sid];
	auto unordered = [&](const Access &a) { return a.sid != sid && vc_get(v, a.sid) < a.tick; };
	const Access *other = nullptr;
	const char *did = "";
	if (h.written && unordered(h.w)) other = &h.w, did = "wrote";
	if (!other && write)
		for (auto &kv : h.r)
			if (unordered(kv.second)) {
				other = &kv.second, did = "read";
				break;
			}
	if (other) {
		char buf[200];
		snprintf(buf, sizeof buf, " the %zu-byte %sallocation at 0x%llx, which ", bytes, g_pinned.count(base) ? "pinned host " : "",
		         (unsigned long long)base);
		return "stream-order race: " + what + " on " + sname(sid) + (write ? " writes" : " reads") + buf + other->what + " on " + sname(other->sid) +
		       " " + did + " with nothing ordering the two (record an event after the one and make the other's stream wait for it: cuEventRecord, cuStreamWaitEvent; or synchronize the host between them)";
	}
	Access a{sid, vc_get(v, sid), what};
	if (write) {
		h.written = true;
		h.w = a;
		h.r.clear();
	} else {
		h.r[sid] = a;
	}
	return "";
}
// touch_fail fails with touch's reason, if any.
static CUresult touch_fail(int sid, u64 p, bool write, const std::string &what) {
	std::string w = touch(sid, p, write, what);
	return w.empty() ? 0 : fail(E_ILLEGAL_STATE, w);
}
// forget drops the history of the allocation at p (freed, or new).
static void forget(u64 p) { g_hist.erase(p); }

bool emu_stream_access(void *s, u64 p, bool write, const char *what, char *why, size_t whylen) {
	EMU_LOCK;
	if (s && !g_streams.count((Stream *)s)) return true; // check_stream's to report
	int sid = sid_of(s);
	op_begin(sid);
	std::string w = touch(sid, p, write, what);
	if (w.empty()) return true;
	snprintf(why, whylen, "%s", w.c_str());
	return false;
}

// ---------------------------------------------------------------- driver API

// The dynamic shared memory a block may opt in to: H100's 227 KB, or
// DISTILL_EMU_OPTIN_SMEM bytes (a smaller GPU's: Ada's 101376).
// Read at each call (device queries and opt-ins are rare): a test sets it
// for one backend.
static int optinSmem() {
	const char *e = getenv("DISTILL_EMU_OPTIN_SMEM");
	return e && *e ? atoi(e) : 232448;
}

extern "C" {

CUresult cuInit(unsigned) { return 0; }
CUresult cuDriverGetVersion(int *v) {
	*v = 99000;
	return 0;
}
CUresult cuDeviceGetCount(int *n) {
	*n = emu_ndev();
	return 0;
}
CUresult cuDeviceGet(int *d, int ord) {
	if (!valid_dev(ord)) return fail(E_INVALID_DEVICE, "no such device: ordinal " + std::to_string(ord) + " of " + std::to_string(emu_ndev()));
	*d = ord;
	return 0;
}
CUresult cuDeviceGetName(char *name, int len, int) {
	snprintf(name, len, "distill CPU emulator");
	return 0;
}
CUresult cuDeviceGetAttribute(int *v, int attr, int) {
	switch (attr) {
	case 1: *v = 1024; break;       // max threads per block
	case 16: *v = 132; break;       // SMs
	case 38: *v = 50 << 20; break;  // L2
	case 75: *v = 9; break;         // compute capability
	case 76: *v = 0; break;
	case 97: *v = optinSmem(); break;
	default: return fail(E_INVALID_VALUE, "unknown device attribute " + std::to_string(attr));
	}
	return 0;
}
CUresult cuDeviceTotalMem_v2(size_t *b, int d) {
	if (!valid_dev(d)) return fail(E_INVALID_DEVICE, "cuDeviceTotalMem: no device " + std::to_string(d));
	*b = emu_device_mem(d);
	return 0;
}
CUresult cuDevicePrimaryCtxRetain(void **c, int d) {
	if (!valid_dev(d)) return fail(E_INVALID_DEVICE, "cuDevicePrimaryCtxRetain: no device " + std::to_string(d));
	*c = &g_ctx[d];
	return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(int) { return 0; }
CUresult cuCtxSetCurrent(void *c) {
	if (c && !is_ctx(c)) return fail(E_INVALID_VALUE, "cuCtxSetCurrent: not a context");
	t_dev = c ? ctx_dev(c) : 0;
	return 0;
}
CUresult cuCtxSynchronize() {
	EMU_LOCK;
	for (auto &kv : g_vc)
		if (g_stream_of[kv.first] == t_dev) vc_join(g_host_vc, kv.second);
	return 0;
}
CUresult cuStreamCreate(void **s, unsigned) {
	EMU_LOCK;
	Stream *st = new Stream{t_dev, g_next_stream++};
	g_streams.insert(st);
	g_stream_of[st->id] = t_dev;
	*s = st;
	return 0;
}
CUresult cuStreamDestroy_v2(void *s) {
	EMU_LOCK;
	if (!g_streams.erase((Stream *)s)) return fail(E_INVALID_HANDLE, "cuStreamDestroy: not a stream");
	delete (Stream *)s;
	return 0;
}
CUresult cuStreamSynchronize(void *s) {
	EMU_LOCK;
	if (stream_dev(s) < 0) return fail(E_INVALID_HANDLE, "cuStreamSynchronize: not a stream");
	vc_join(g_host_vc, g_vc[sid_of(s)]);
	return 0;
}
CUresult cuMemAlloc_v2(u64 *p, size_t n) {
	EMU_LOCK;
	*p = emu_alloc(n, t_dev, false);
	return *p ? 0 : fail(E_OUT_OF_MEMORY, "out of memory on device " + std::to_string(t_dev));
}
CUresult cuMemFree_v2(u64 p) {
	EMU_LOCK;
	return emu_free(p, "cuMemFree");
}
CUresult cuMemAllocAsync(u64 *p, size_t n, void *s) {
	EMU_LOCK;
	int d;
	if (CUresult r = check_stream(s, "cuMemAllocAsync", &d)) return r;
	*p = emu_alloc(n, d, true);
	return *p ? 0 : fail(E_OUT_OF_MEMORY, "out of memory on device " + std::to_string(d));
}
CUresult cuMemFreeAsync(u64 p, void *s) {
	EMU_LOCK;
	if (stream_dev(s) >= 0 && g_allocs.count(p)) {
		int sid = sid_of(s);
		op_begin(sid);
		if (CUresult r = touch_fail(sid, p, true, "cuMemFreeAsync")) return r;
	}
	return emu_free(p, "cuMemFreeAsync");
}
CUresult cuDeviceGetDefaultMemPool(void **p, int d) {
	if (!valid_dev(d)) return fail(E_INVALID_DEVICE, "cuDeviceGetDefaultMemPool: no device " + std::to_string(d));
	*p = &g_pool[d];
	return 0;
}
static int pool_dev(void *p) {
	int d = (int)((int *)p - g_pool);
	return (int *)p >= g_pool && (int *)p < g_pool + kMaxDev && valid_dev(d) ? d : -1;
}
// The pool's attributes: 4 RELEASE_THRESHOLD (accepted, nothing to
// release), 5 RESERVED_MEM_CURRENT, 7 USED_MEM_CURRENT, 8 USED_MEM_HIGH
// (set to 0: reset to the current use).
CUresult cuMemPoolSetAttribute(void *pool, int attr, void *v) {
	EMU_LOCK;
	int d = pool_dev(pool);
	if (d < 0) return fail(E_INVALID_VALUE, "cuMemPoolSetAttribute: not a pool");
	switch (attr) {
	case 4: return 0;
	case 8:
		if (*(unsigned long long *)v != 0) return fail(E_INVALID_VALUE, "cuMemPoolSetAttribute: USED_MEM_HIGH can only be reset to 0");
		g_used_high[d] = g_used[d];
		return 0;
	}
	return fail(E_INVALID_VALUE, "cuMemPoolSetAttribute: attribute " + std::to_string(attr) + " not emulated");
}
CUresult cuMemPoolGetAttribute(void *pool, int attr, void *v) {
	EMU_LOCK;
	int d = pool_dev(pool);
	if (d < 0) return fail(E_INVALID_VALUE, "cuMemPoolGetAttribute: not a pool");
	switch (attr) {
	case 5: // RESERVED_MEM_CURRENT: the emulator's pool keeps nothing freed
	case 7: *(unsigned long long *)v = g_used[d]; return 0;
	case 8: *(unsigned long long *)v = g_used_high[d]; return 0;
	}
	return fail(E_INVALID_VALUE, "cuMemPoolGetAttribute: attribute " + std::to_string(attr) + " not emulated");
}
// CUmemAccessDesc: a location (type 1: a device; its ordinal) and the
// access flags (0 none, 1 read, 3 read and write).
struct MemAccessDesc {
	int type, id, flags;
};
CUresult cuMemPoolSetAccess(void *pool, const MemAccessDesc *map, size_t count) {
	EMU_LOCK;
	int o = pool_dev(pool);
	if (o < 0) return fail(E_INVALID_VALUE, "cuMemPoolSetAccess: not a pool");
	for (size_t i = 0; i < count; i++) {
		const MemAccessDesc &m = map[i];
		if (m.type != 1 || !valid_dev(m.id) || (m.flags != 0 && m.flags != 1 && m.flags != 3))
			return fail(E_INVALID_VALUE, "cuMemPoolSetAccess: descriptor " + std::to_string(i) + ": want a device location and flags 0, 1 or 3");
		if (m.id == o) {
			if (m.flags != 3) return fail(E_INVALID_VALUE, "cuMemPoolSetAccess: a pool's own device keeps read-write access");
			continue;
		}
		if (!can_access_peer(m.id, o))
			return fail(E_INVALID_DEVICE, "cuMemPoolSetAccess: device " + std::to_string(m.id) + " cannot access device " + std::to_string(o) + "'s memory (cuDeviceCanAccessPeer)");
		g_pool_access[o][m.id] = m.flags != 0;
	}
	return 0;
}
CUresult cuDeviceCanAccessPeer(int *can, int d, int peer) {
	if (!valid_dev(d) || !valid_dev(peer)) return fail(E_INVALID_DEVICE, "cuDeviceCanAccessPeer: no such device");
	*can = can_access_peer(d, peer);
	return 0;
}
CUresult cuCtxEnablePeerAccess(void *peer, unsigned flags) {
	EMU_LOCK;
	if (!is_ctx(peer) || flags != 0) return fail(E_INVALID_VALUE, "cuCtxEnablePeerAccess: not a context, or flags not 0");
	int o = ctx_dev(peer);
	if (!can_access_peer(t_dev, o)) return fail(E_PEER_UNSUPPORTED, "cuCtxEnablePeerAccess: device " + std::to_string(t_dev) + " cannot access device " + std::to_string(o));
	if (g_ctx_peer[t_dev][o]) return fail(E_PEER_ALREADY_ENABLED, "cuCtxEnablePeerAccess: already enabled");
	g_ctx_peer[t_dev][o] = true;
	return 0;
}
CUresult cuMemGetInfo_v2(size_t *f, size_t *t) {
	EMU_LOCK;
	*t = emu_device_mem(t_dev);
	*f = g_used[t_dev] < *t ? *t - g_used[t_dev] : 0;
	return 0;
}
CUresult cuMemAllocHost_v2(void **p, size_t n) {
	EMU_LOCK;
	*p = malloc(n ? n : 1);
	if (!*p) return fail(E_OUT_OF_MEMORY, "cuMemAllocHost: out of host memory");
	g_pinned[(u64)*p] = n;
	forget((u64)*p);
	return 0;
}
CUresult cuMemFreeHost(void *p) {
	EMU_LOCK;
	g_pinned.erase((u64)p);
	forget((u64)p);
	free(p);
	return 0;
}
CUresult cuMemcpyHtoDAsync_v2(u64 dst, const void *src, size_t n, void *s) {
	EMU_LOCK;
	int d;
	if (CUresult r = check_stream(s, "cuMemcpyHtoDAsync", &d)) return r;
	if (CUresult r = check_range(dst, n, "cuMemcpyHtoDAsync", d)) return r;
	int sid = sid_of(s);
	op_begin(sid);
	if (CUresult r = touch_fail(sid, (u64)src, false, "cuMemcpyHtoDAsync")) return r;
	if (CUresult r = touch_fail(sid, dst, true, "cuMemcpyHtoDAsync")) return r;
	memcpy((void *)dst, src, n);
	return 0;
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, u64 src, size_t n, void *s) {
	EMU_LOCK;
	int d;
	if (CUresult r = check_stream(s, "cuMemcpyDtoHAsync", &d)) return r;
	if (CUresult r = check_range(src, n, "cuMemcpyDtoHAsync", d)) return r;
	int sid = sid_of(s);
	op_begin(sid);
	if (CUresult r = touch_fail(sid, src, false, "cuMemcpyDtoHAsync")) return r;
	if (CUresult r = touch_fail(sid, (u64)dst, true, "cuMemcpyDtoHAsync")) return r;
	memcpy(dst, (void *)src, n);
	return 0;
}
CUresult cuMemcpyDtoDAsync_v2(u64 dst, u64 src, size_t n, void *s) {
	EMU_LOCK;
	int d;
	if (CUresult r = check_stream(s, "cuMemcpyDtoDAsync", &d)) return r;
	if (CUresult r = check_range(dst, n, "cuMemcpyDtoDAsync destination", d)) return r;
	if (CUresult r = check_range(src, n, "cuMemcpyDtoDAsync source", d)) return r;
	int sid = sid_of(s);
	op_begin(sid);
	if (CUresult r = touch_fail(sid, src, false, "cuMemcpyDtoDAsync")) return r;
	if (CUresult r = touch_fail(sid, dst, true, "cuMemcpyDtoDAsync")) return r;
	memmove((void *)dst, (void *)src, n);
	return 0;
}
// cuMemcpyPeerAsync copies between two contexts' memory; the emulator
// wants the pair to have peer access one way or the other (see the top).
CUresult cuMemcpyPeerAsync(u64 dst, void *dstCtx, u64 src, void *srcCtx, size_t n, void *s) {
	EMU_LOCK;
	int d;
	if (CUresult r = check_stream(s, "cuMemcpyPeerAsync", &d)) return r;
	if (!is_ctx(dstCtx) || !is_ctx(srcCtx)) return fail(E_INVALID_VALUE, "cuMemcpyPeerAsync: not a context");
	int dd = ctx_dev(dstCtx), sd = ctx_dev(srcCtx);
	if (CUresult r = check_range(dst, n, "cuMemcpyPeerAsync destination (in the destination context)", dd)) return r;
	if (CUresult r = check_range(src, n, "cuMemcpyPeerAsync source (in the source context)", sd)) return r;
	if (dd != sd && !range_why(src, n, dd).empty() && !range_why(dst, n, sd).empty()) {
		char buf[200];
		snprintf(buf, sizeof buf, "cuMemcpyPeerAsync: device %d to device %d without peer access either way (the driver would stage it through the host)", sd, dd);
		return fail(E_INVALID_VALUE, buf);
	}
	int sid = sid_of(s);
	op_begin(sid);
	if (CUresult r = touch_fail(sid, src, false, "cuMemcpyPeerAsync")) return r;
	if (CUresult r = touch_fail(sid, dst, true, "cuMemcpyPeerAsync")) return r;
	memmove((void *)dst, (void *)src, n);
	return 0;
}
CUresult cuMemsetD8Async(u64 dst, unsigned char v, size_t n, void *s) {
	EMU_LOCK;
	int d;
	if (CUresult r = check_stream(s, "cuMemsetD8Async", &d)) return r;
	if (CUresult r = check_range(dst, n, "cuMemsetD8Async", d)) return r;
	int sid = sid_of(s);
	op_begin(sid);
	if (CUresult r = touch_fail(sid, dst, true, "cuMemsetD8Async")) return r;
	memset((void *)dst, v, n);
	return 0;
}

struct Module {
	std::string src;
};
static const char kImageMagic[] = "DISTILL-EMU-CUBIN\n";

CUresult cuModuleLoadData(void **m, const void *image) {
	EMU_LOCK;
	const char *s = (const char *)image;
	if (strncmp(s, kImageMagic, strlen(kImageMagic)) != 0) return fail(E_INVALID_IMAGE, "cuModuleLoadData: not an emulator image");
	*m = new Module{std::string(s + strlen(kImageMagic))};
	return 0;
}
CUresult cuModuleUnload(void *m) {
	EMU_LOCK;
	delete (Module *)m;
	return 0;
}
CUresult cuModuleGetFunction(CUfunction *f, void *m, const char *name) {
	EMU_LOCK;
	Module *mod = (Module *)m;
	auto it = registry().find(name);
	if (it == registry().end() || mod->src.find(std::string("DK_REGISTER(") + name + ")") == std::string::npos)
		return fail(E_NOT_FOUND, std::string("cuModuleGetFunction: no kernel ") + name + " in this module");
	*f = &it->second;
	return 0;
}
CUresult cuFuncSetAttribute(CUfunction f, int attr, int v) {
	EMU_LOCK;
	Kernel *k = (Kernel *)f;
	if (attr != 8) return fail(E_INVALID_VALUE, "cuFuncSetAttribute: attribute " + std::to_string(attr));
	if (v > optinSmem()) return fail(E_INVALID_VALUE, "cuFuncSetAttribute: " + std::to_string(v) + " bytes of shared memory");
	k->maxDynSmem = v;
	return 0;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned smem,
                        void *stream, void **params, void **extra) {
	EMU_LOCK;
	Kernel *k = (Kernel *)f;
	unsigned nt = bx * by * bz;
	char buf[300];
	if (extra) return fail(E_INVALID_VALUE, k->name + ": extra launch options are not emulated");
	int dev;
	if (CUresult r = check_stream(stream, ("cuLaunchKernel(" + k->name + ")").c_str(), &dev)) return r;
	// A pointer parameter into another device's memory that this device
	// may not reach would fault on a GPU.
	for (size_t i = 0; i < k->sizes.size(); i++) {
		if (k->sizes[i] != 8) continue;
		u64 v;
		memcpy(&v, params[i], 8);
		const Alloc *a = find_alloc(v, 1);
		if (a && !reachable(*a, dev)) {
			snprintf(buf, sizeof buf, "%s: parameter %zu (0x%llx) points into device %d's memory, which device %d may not reach (no peer access)",
			         k->name.c_str(), i, (unsigned long long)v, a->dev, dev);
			return fail(E_ILLEGAL_ADDRESS, buf);
		}
	}
	g_launch_dev = dev;
	{
		int sid = sid_of(stream);
		op_begin(sid);
		for (size_t i = 0; i < k->sizes.size(); i++) {
			if (k->sizes[i] != 8) continue;
			u64 v;
			memcpy(&v, params[i], 8);
			if (CUresult r = touch_fail(sid, v, !k->ro[i], k->name + " (parameter " + std::to_string(i) + ")")) return r;
		}
	}
	if (nt == 0 || nt > 1024 || nt % 32 != 0) {
		snprintf(buf, sizeof buf, "%s: block of %u threads: want a multiple of 32, at most 1024", k->name.c_str(), nt);
		return fail(E_INVALID_VALUE, buf);
	}
	if (gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535 || gx > 0x7fffffffu) {
		snprintf(buf, sizeof buf, "%s: grid (%u,%u,%u) out of range", k->name.c_str(), gx, gy, gz);
		return fail(E_INVALID_VALUE, buf);
	}
	if ((int)smem > k->maxDynSmem) {
		snprintf(buf, sizeof buf, "%s: %u bytes of dynamic shared memory, but the kernel allows %d (cuFuncSetAttribute)", k->name.c_str(),
		         smem, k->maxDynSmem);
		return fail(E_LAUNCH_OUT_OF_RESOURCES, buf);
	}
	if (g_fib.size() < nt) g_fib.resize(nt);
	const char *rev = getenv("DISTILL_EMU_REVERSE");
	g_reverse = rev && rev[0] == '1';
	gridDim = {gx, gy, gz};
	blockDim = {bx, by, bz};
	g_kernel = k;
	g_params = params;
	for (unsigned z = 0; z < gz; z++)
		for (unsigned y = 0; y < gy; y++)
			for (unsigned x = 0; x < gx; x++) {
				blockIdx = {x, y, z};
				g_dyn.assign(smem + 16, 0xff); // poisoned: shared memory starts undefined
				g_fault.clear();
				cp_async_reset(nt);
				if (!run_block(nt) || !g_fault.empty() || !(g_fault = cp_async_pending()).empty()) {
					snprintf(buf, sizeof buf, "%s: block (%u,%u,%u): ", k->name.c_str(), x, y, z);
					return fail(E_LAUNCH_FAILED, buf + g_fault);
				}
			}
	return 0;
}

CUresult cuGetErrorName(CUresult r, const char **s) {
	switch (r) {
	case 1: *s = "CUDA_ERROR_INVALID_VALUE"; break;
	case 2: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
	case 101: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
	case 200: *s = "CUDA_ERROR_INVALID_IMAGE"; break;
	case 217: *s = "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"; break;
	case 400: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
	case 401: *s = "CUDA_ERROR_ILLEGAL_STATE"; break;
	case 700: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
	case 704: *s = "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"; break;
	case 500: *s = "CUDA_ERROR_NOT_FOUND"; break;
	case 701: *s = "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"; break;
	case 719: *s = "CUDA_ERROR_LAUNCH_FAILED"; break;
	default: *s = "CUDA_ERROR_UNKNOWN";
	}
	return 0;
}
CUresult cuGetErrorString(CUresult, const char **s) {
	*s = g_err.c_str();
	return 0;
}
// An event holds the clock of its stream when it was recorded (see
// "stream order").
struct Event {
	VClock vc;
};
CUresult cuEventCreate(void **e, unsigned) {
	*e = new Event{};
	return 0;
}
CUresult cuEventRecord(void *e, void *s) {
	EMU_LOCK;
	if (stream_dev(s) < 0) return fail(E_INVALID_HANDLE, "cuEventRecord: not a stream");
	int sid = sid_of(s);
	VClock v = g_vc[sid];
	vc_join(v, g_host_vc);
	((Event *)e)->vc = v;
	return 0;
}
CUresult cuStreamWaitEvent(void *s, void *e, unsigned flags) {
	EMU_LOCK;
	if (stream_dev(s) < 0) return fail(E_INVALID_HANDLE, "cuStreamWaitEvent: not a stream");
	if (flags != 0) return fail(E_INVALID_VALUE, "cuStreamWaitEvent: flags must be 0");
	vc_join(g_vc[sid_of(s)], ((Event *)e)->vc);
	return 0;
}
CUresult cuEventSynchronize(void *e) {
	EMU_LOCK;
	vc_join(g_host_vc, ((Event *)e)->vc);
	return 0;
}
CUresult cuEventElapsedTime(float *ms, void *, void *) {
	*ms = 0;
	return 0;
}
CUresult cuEventDestroy_v2(void *e) {
	delete (Event *)e;
	return 0;
}

// distill_emu_check_params compares a launch's parameter sizes with the
// kernel's C++ signature; nil when they match.
const char *distill_emu_check_params(CUfunction f, const int *sizes, int n) {
	Kernel *k = (Kernel *)f;
	static thread_local std::string msg;
	bool ok = n == (int)k->sizes.size();
	for (int i = 0; ok && i < n; i++) ok = sizes[i] == k->sizes[i];
	if (ok) return nullptr;
	msg = "parameter sizes (";
	for (int i = 0; i < n; i++) msg += (i ? "," : "") + std::to_string(sizes[i]);
	msg += ") do not match the kernel's signature (";
	for (size_t i = 0; i < k->sizes.size(); i++) msg += (i ? "," : "") + std::to_string(k->sizes[i]);
	msg += ")";
	return msg.c_str();
}

// distill_emu_host_access checks the host's own read (write 0) or write
// (write 1) of the pinned allocation (cuMemAllocHost) that holds p, which
// the stream-order checks above do not see: the host must have waited
// (cuStreamSynchronize, cuEventSynchronize, cuCtxSynchronize) for the
// last copy that wrote it, and, to write it, for every copy that read it
// since (the GPU reads an upload's source when the copy runs, not when it
// is issued). Nil when it may; else why not. Memory that is not pinned:
// nil (not seen).
const char *distill_emu_host_access(const void *p, int write) {
	EMU_LOCK;
	static thread_local std::string msg;
	if (!race_checks()) return nullptr;
	u64 base;
	size_t bytes;
	if (!holder((u64)p, &base, &bytes) || !g_pinned.count(base)) return nullptr;
	auto it = g_hist.find(base);
	if (it == g_hist.end()) return nullptr;
	const History &h = it->second;
	const Access *other = nullptr;
	const char *did = "";
	if (h.written && vc_get(g_host_vc, h.w.sid) < h.w.tick) other = &h.w, did = "wrote";
	if (!other && write)
		for (auto &kv : h.r)
			if (vc_get(g_host_vc, kv.second.sid) < kv.second.tick) {
				other = &kv.second, did = "read";
				break;
			}
	if (!other) return nullptr;
	char buf[160];
	snprintf(buf, sizeof buf, " the %zu-byte pinned host allocation at 0x%llx, which ", bytes, (unsigned long long)base);
	msg = std::string("stream-order race: the host ") + (write ? "writes" : "reads") + buf + other->what + " on " + sname(other->sid) + " " + did +
	      " with the host not having waited for it (cuEventSynchronize on an event recorded after it, or cuStreamSynchronize)";
	return msg.c_str();
}

// ---------------------------------------------------------------- NVRTC

struct Program {
	std::string src, name, image;
};
const char *nvrtcGetErrorString(int r) { return r ? "NVRTC_ERROR (emulator)" : "NVRTC_SUCCESS"; }
int nvrtcVersion(int *maj, int *min) {
	*maj = 99;
	*min = 0;
	return 0;
}
int nvrtcCreateProgram(void **p, const char *src, const char *name, int, const char *const *, const char *const *) {
	*p = new Program{src, name ? name : "", ""};
	return 0;
}
int nvrtcDestroyProgram(void **p) {
	delete (Program *)*p;
	*p = nullptr;
	return 0;
}
// The emulator's "cubin" is the source itself: the kernels it can run are
// the ones compiled into it, and cuModuleGetFunction checks that the
// source registers the one asked for.
int nvrtcCompileProgram(void *p, int, const char *const *) {
	Program *pr = (Program *)p;
	pr->image = std::string(kImageMagic) + pr->src;
	return 0;
}
int nvrtcGetProgramLogSize(void *, size_t *n) {
	*n = 1;
	return 0;
}
int nvrtcGetProgramLog(void *, char *buf) {
	buf[0] = 0;
	return 0;
}
int nvrtcGetCUBINSize(void *p, size_t *n) {
	*n = ((Program *)p)->image.size() + 1;
	return 0;
}
int nvrtcGetCUBIN(void *p, char *buf) {
	const std::string &s = ((Program *)p)->image;
	memcpy(buf, s.c_str(), s.size() + 1);
	return 0;
}
int nvrtcGetPTXSize(void *p, size_t *n) { return nvrtcGetCUBINSize(p, n); }
int nvrtcGetPTX(void *p, char *buf) { return nvrtcGetCUBIN(p, buf); }

// ---------------------------------------------------------------- cuBLASLt

struct Desc {
	int compute, scale, transa = 0, transb = 0;
	// The operands' scale modes (0: scalar, the default; 3:
	// CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F) and scale pointers
	// (device addresses; 0: unset).
	int amode = 0, bmode = 0;
	u64 ascale = 0, bscale = 0;
};
struct Layout {
	int type;
	u64 rows, cols;
	i64 ld;
};
struct Pref {
	u64 ws = 0;
};
static int g_lt_dummy;

int cublasLtCreate(void **h) {
	*h = &g_lt_dummy;
	return 0;
}
int cublasLtDestroy(void *) { return 0; }
// cublasLtGetVersion: $DISTILL_EMU_LT_VERSION, for the tests of an older
// cuBLASLt's paths (fp8.go: outer-vector scales from 12.9, 120900).
size_t cublasLtGetVersion() {
	const char *v = getenv("DISTILL_EMU_LT_VERSION");
	return v && *v ? (size_t)strtoull(v, nullptr, 10) : 990000;
}
const char *cublasLtGetStatusString(int s) { return s ? g_err.c_str() : "CUBLAS_STATUS_SUCCESS"; }
int cublasLtMatmulDescCreate(void **d, int compute, int scale) {
	if (compute != 68 || scale != 0) {
		fail(E_INVALID_VALUE, "cublasLtMatmulDescCreate: only CUBLAS_COMPUTE_32F with CUDA_R_32F scale is emulated");
		return 7; // CUBLAS_STATUS_INVALID_VALUE
	}
	*d = new Desc{compute, scale};
	return 0;
}
int cublasLtMatmulDescDestroy(void *d) {
	delete (Desc *)d;
	return 0;
}
int cublasLtMatmulDescSetAttribute(void *d, int attr, const void *buf, size_t n) {
	Desc *ds = (Desc *)d;
	if ((attr == 3 || attr == 4) && n == 4) {
		int v = *(const int *)buf;
		if (v != 0 && v != 1) return 7;
		(attr == 3 ? ds->transa : ds->transb) = v;
		return 0;
	}
	if ((attr == 31 || attr == 32) && n == 4) { // A_SCALE_MODE, B_SCALE_MODE: scalar or outer vector
		int v = *(const int *)buf;
		if (v != 0 && v != 3) {
			fail(E_INVALID_VALUE, "cublasLtMatmulDescSetAttribute: scale mode " + std::to_string(v) + " is not emulated");
			return 7;
		}
		(attr == 31 ? ds->amode : ds->bmode) = v;
		return 0;
	}
	if (attr == 25 && n == 1) { // FAST_ACCUM: the emulator's sums are fp32 either way
		signed char v = *(const signed char *)buf;
		if (v != 0 && v != 1) return 7;
		return 0;
	}
	if ((attr == 17 || attr == 18) && n == 8) { // A_SCALE_POINTER, B_SCALE_POINTER
		(attr == 17 ? ds->ascale : ds->bscale) = *(const u64 *)buf;
		return 0;
	}
	fail(E_INVALID_VALUE, "cublasLtMatmulDescSetAttribute: attribute " + std::to_string(attr) + " is not emulated");
	return 7;
}
int cublasLtMatrixLayoutCreate(void **l, int type, u64 rows, u64 cols, i64 ld) {
	if ((type != 0 && type != 14 && type != 28) || ld < (i64)rows) {
		fail(E_INVALID_VALUE, "cublasLtMatrixLayoutCreate: type " + std::to_string(type) + " rows " + std::to_string(rows) + " ld " +
		                          std::to_string(ld));
		return 7;
	}
	*l = new Layout{type, rows, cols, ld};
	return 0;
}
int cublasLtMatrixLayoutDestroy(void *l) {
	delete (Layout *)l;
	return 0;
}
int cublasLtMatmulPreferenceCreate(void **p) {
	*p = new Pref{};
	return 0;
}
int cublasLtMatmulPreferenceDestroy(void *p) {
	delete (Pref *)p;
	return 0;
}
int cublasLtMatmulPreferenceSetAttribute(void *p, int attr, const void *buf, size_t n) {
	if (attr == 1 && n == 8) ((Pref *)p)->ws = *(const u64 *)buf;
	else if (attr == 3 && n == 4) { // REDUCTION_SCHEME_MASK: the emulator never splits k
		if (*(const u32 *)buf > 7) return 7;
	} else if (attr >= 5 && attr <= 8 && n == 4) {
		u32 a = *(const u32 *)buf;
		if (a == 0 || (a & (a - 1)) != 0) return 7;
	} else return 7;
	return 0;
}
int cublasLtMatmulAlgoGetHeuristic(void *, void *d, void *a, void *b, void *c, void *dd, void *, int req, void *res, int *got) {
	Desc *ds = (Desc *)d;
	Layout *la = (Layout *)a, *lb = (Layout *)b, *lc = (Layout *)c, *ld = (Layout *)dd;
	u64 m = ds->transa ? la->cols : la->rows, k = ds->transa ? la->rows : la->cols;
	u64 kb = ds->transb ? lb->cols : lb->rows, n = ds->transb ? lb->rows : lb->cols;
	if (req < 1 || k != kb || lc->rows != m || lc->cols != n || ld->rows != m || ld->cols != n || la->type != lb->type || lc->type != ld->type ||
	    (lc->type != 0 && lc->type != 14)) {
		fail(E_INVALID_VALUE, "cublasLtMatmulAlgoGetHeuristic: inconsistent shapes or types");
		return 7;
	}
	// FP8 (CUDA_R_8F_E4M3 A and B): cuBLASLt's documented requirements
	// (cublasLtMatmul, FP8): A transposed and B not ("TN"), and 16-byte
	// aligned leading dimensions (of A and B in bytes, of C and D in their
	// type's bytes). A real cuBLASLt answers CUBLAS_STATUS_NOT_SUPPORTED
	// (15) otherwise.
	if (la->type == 28) {
		size_t dsz = ld->type == 14 ? 2 : 4;
		if (ds->transa != 1 || ds->transb != 0 || la->ld % 16 != 0 || lb->ld % 16 != 0 || (ld->ld * dsz) % 16 != 0 || (lc->ld * dsz) % 16 != 0) {
			fail(E_INVALID_VALUE, "cublasLtMatmulAlgoGetHeuristic: FP8 needs the TN layout (transa T, transb N) and 16-byte aligned leading dimensions; got transa " +
			                          std::to_string(ds->transa) + " transb " + std::to_string(ds->transb) + " lda " + std::to_string(la->ld) + " ldb " +
			                          std::to_string(lb->ld) + " ldd " + std::to_string(ld->ld));
			return 15;
		}
	}
	// Outer-vector scales (cuBLASLt 12.9, "Outer Vector Scaling for FP8
	// Data Types"): both operands' modes or neither, FP8 operands, a
	// 16-bit or fp32 D.
	// $DISTILL_EMU_LT_NO_OUTER_VEC=1: a cuBLASLt with no algorithm for them
	// (the backend's fallback, tested).
	const char *nov = getenv("DISTILL_EMU_LT_NO_OUTER_VEC");
	if (ds->amode == 3 && nov && !strcmp(nov, "1")) {
		fail(E_INVALID_VALUE, "cublasLtMatmulAlgoGetHeuristic: no algorithm with outer-vector scales (DISTILL_EMU_LT_NO_OUTER_VEC=1)");
		return 15;
	}
	if (ds->amode != ds->bmode || (ds->amode == 3 && (la->type != 28 || (ld->type != 14 && ld->type != 0)))) {
		fail(E_INVALID_VALUE, "cublasLtMatmulAlgoGetHeuristic: outer-vector scales need both operands' modes, FP8 operands and a BF16 or F32 D");
		return 15;
	}
	memset(res, 0, 96);
	*got = 1;
	return 0;
}

// e4m3_value decodes an E4M3FN byte from the format's definition: 1 sign,
// 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 is subnormal
// (m/8·2^-6); S.1111.111 is NaN.
static float e4m3_value(unsigned char b) {
	int e = (b >> 3) & 15, m = b & 7;
	float v;
	if (e == 15 && m == 7) v = __uint_as_float(0x7fc00000u);
	else if (e == 0) v = ldexpf((float)m, -9);
	else v = ldexpf(1.0f + m / 8.0f, e - 7);
	return (b & 0x80) ? -v : v;
}

static float load_el(const void *p, int type, i64 i) {
	if (type == 14) return __uint_as_float((u32)((const u16 *)p)[i] << 16);
	if (type == 28) return e4m3_value(((const unsigned char *)p)[i]);
	return ((const float *)p)[i];
}

// store_el writes a D element: F32, or BF16 rounded to nearest even (the
// epilogue's one rounding of the fp32 result).
static void store_el(void *p, int type, i64 i, float v) {
	if (type != 14) {
		((float *)p)[i] = v;
		return;
	}
	((u16 *)p)[i] = emu_f2bf(v);
}

// D = alpha·op(A)·op(B) + beta·C, column-major: op(A) (m,k), op(B) (k,n),
// D (m,n), element (i,j) of a stored matrix at i + j·ld. Accumulated in
// fp32 in k order (no more accurate than the GPU's); A and B are F32, BF16
// or E4M3 (the products of two E4M3 values are exact in fp32); C and D
// are both F32 or both BF16. A BF16 D with beta != 0 is rounded twice, as
// cuBLASLt 13.1 does on an H200 (2026-11-27 and -28, TestMatMulBackwardBF16DX):
// alpha·Σ rounded to BF16, then beta·C added in fp32 and rounded again.
int cublasLtMatmul(void *, void *d, const void *alpha, const void *A, void *la_, const void *B, void *lb_, const void *beta, const void *C,
                   void *lc_, void *D, void *ld_, const void *, void *, size_t, void *stream) {
	EMU_LOCK;
	int dev;
	if (check_stream(stream, "cublasLtMatmul", &dev)) return 7; // CUBLAS_STATUS_INVALID_VALUE
	Desc *ds = (Desc *)d;
	Layout *la = (Layout *)la_, *lb = (Layout *)lb_, *lc = (Layout *)lc_, *ld = (Layout *)ld_;
	i64 m = ds->transa ? la->cols : la->rows, k = ds->transa ? la->rows : la->cols, n = ds->transb ? lb->rows : lb->cols;
	size_t esz = la->type == 14 ? 2 : la->type == 28 ? 1 : 4;
	if (check_range((u64)A, (size_t)((la->cols - 1) * la->ld + la->rows) * esz, "cublasLtMatmul A", dev) ||
	    check_range((u64)B, (size_t)((lb->cols - 1) * lb->ld + lb->rows) * esz, "cublasLtMatmul B", dev) ||
	    check_range((u64)D, (size_t)((ld->cols - 1) * ld->ld + ld->rows) * (ld->type == 14 ? 2 : 4), "cublasLtMatmul D", dev))
		return 14; // CUBLAS_STATUS_INTERNAL_ERROR
	float al = *(const float *)alpha, be = *(const float *)beta;
	bool outer = ds->amode == 3;
	if (outer && (!ds->ascale || !ds->bscale || be != 0)) {
		fail(E_INVALID_VALUE, "cublasLtMatmul: outer-vector scales without both scale pointers, or with beta != 0, are not emulated");
		return 7;
	}
	if (outer && (check_range(ds->ascale, (size_t)m * 4, "cublasLtMatmul A scales", dev) || check_range(ds->bscale, (size_t)n * 4, "cublasLtMatmul B scales", dev)))
		return 14;
	{
		int sid = sid_of(stream);
		op_begin(sid);
		if (touch_fail(sid, (u64)A, false, "cublasLtMatmul A")) return 14;
		if (touch_fail(sid, (u64)B, false, "cublasLtMatmul B")) return 14;
		if (outer && (touch_fail(sid, ds->ascale, false, "cublasLtMatmul A scales") || touch_fail(sid, ds->bscale, false, "cublasLtMatmul B scales"))) return 14;
		if (be != 0)
			if (touch_fail(sid, (u64)C, false, "cublasLtMatmul C")) return 14;
		if (touch_fail(sid, (u64)D, true, "cublasLtMatmul D")) return 14;
	}
	if (lc->type != ld->type) {
		fail(E_INVALID_VALUE, "cublasLtMatmul: C and D of different types are not emulated");
		return 7;
	}
	std::vector<float> col(k);
	for (i64 j = 0; j < n; j++) {
		for (i64 p = 0; p < k; p++) col[p] = load_el(B, lb->type, ds->transb ? j + p * lb->ld : p + j * lb->ld);
		for (i64 i = 0; i < m; i++) {
			float acc = 0;
			for (i64 p = 0; p < k; p++) acc = fmaf(load_el(A, la->type, ds->transa ? p + i * la->ld : i + p * la->ld), col[p], acc);
			if (outer) { // D[i][j] = Σ · scaleB[j] · scaleA[i]: the activations' row scale first, as k_fp8_scale
				acc = acc * ((const float *)ds->bscale)[j];
				acc = acc * ((const float *)ds->ascale)[i];
			}
			float prod = al * acc, cv = be != 0 ? load_el(C, lc->type, i + j * lc->ld) : 0;
			if (be != 0 && ld->type == 14) prod = __uint_as_float((u32)emu_f2bf(prod) << 16);
			store_el(D, ld->type, i + j * ld->ld, prod + be * cv);
		}
	}
	return 0;
}

} // extern "C"
