// prelude.cuh: what every kernel file starts with. NVRTC compiles each .cu
// file of this directory with this prelude in front of it, and nothing else:
// no CUDA header is included (Debian's NVRTC 11.8 ships none, and the
// toolkit's may not be installed where the binary runs). So the fixed-width
// types, the BF16 conversions and the tensor-core mma are our own.
//
// The same sources also build as C++ on the host, with DISTILL_EMU defined
// and testdata/emu/emu.h included first: a CPU emulator runs the kernels
// with one fiber per CUDA thread, so their logic is tested on machines with
// no GPU. Code that differs between the two (inline PTX, warp collectives)
// lives only in this prelude, behind DISTILL_EMU.

#ifndef DISTILL_EMU
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;
#define DK_DEV static __device__ __forceinline__
#define DK_KERNEL extern "C" __global__
#define DK_REGISTER(name)
// DK_DYN_SMEM declares name as a T* to the block's dynamic shared memory.
#define DK_DYN_SMEM(T, name)                                  \
	extern __shared__ __align__(16) unsigned char dk_smem_[]; \
	T *name = reinterpret_cast<T *>(dk_smem_)
#define DK_INF __int_as_float(0x7f800000)
#endif

// DK_CHECK(ok, what) states an invariant of a kernel's own logic, one
// that its results do not show when it breaks (a bound that only keeps it
// fast, or shared memory in range): the emulator fails the launch, naming
// what; on a GPU it compiles to nothing.
#ifdef DISTILL_EMU
#define DK_CHECK(ok, what) emu_kernel_check((ok), (what))
#else
#define DK_CHECK(ok, what)
#endif

#define DK_WARP 32
#define DK_FULL 0xffffffffu

DK_DEV int imin(int a, int b) { return a < b ? a : b; }

// swiglu1 is silu(g)·u with silu(g) = g / (1 + exp(-g)), as compute/cpu:
// k_swiglu's and the MoE GEMM's fused epilogue's one definition.
DK_DEV float swiglu1(float g, float u) { return g / (1.0f + expf(-g)) * u; }
DK_DEV int imax(int a, int b) { return a > b ? a : b; }
DK_DEV i64 lmin(i64 a, i64 b) { return a < b ? a : b; }

// --- BF16: the high half of a float32.

// bf2f widens a bfloat16 exactly.
DK_DEV float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }

// f2bf rounds to the nearest bfloat16, ties to even, as torch does; NaN
// stays a quiet NaN. Same bits as compute.F32ToBF16 on the host.
DK_DEV u16 f2bf(float f) {
	u32 b = __float_as_uint(f);
	if ((b & 0x7fffffffu) > 0x7f800000u) return (u16)((b >> 16) | 0x40u);
	b += 0x7fffu + ((b >> 16) & 1u);
	return (u16)(b >> 16);
}

// pack_bf16x2 rounds lo and hi to bfloat16 and packs them into one register,
// lo in the low half: the operand layout of mma's .bf16x2 registers.
DK_DEV u32 pack_bf16x2(float lo, float hi) {
#ifdef DISTILL_EMU
	return (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
#else
	u32 r;
	asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
	return r;
#endif
}

// load_w reads element i of a weight vector stored as BF16 (bf16 != 0) or
// F32: norm weights and biases come either way (checkpoint or host upload).
DK_DEV float load_w(const void *w, int bf16, i64 i) {
	return bf16 ? bf2f(((const u16 *)w)[i]) : ((const float *)w)[i];
}

// ld_act and st_act read and write element i of an activation stored in
// BF16 (bf16 != 0) or F32 (compute's activation dtype): the math is fp32,
// and a BF16 store rounds once.
DK_DEV float ld_act(const void *p, int bf16, i64 i) { return load_w(p, bf16, i); }
DK_DEV void st_act(void *p, int bf16, i64 i, float v) {
	if (bf16) ((u16 *)p)[i] = f2bf(v);
	else ((float *)p)[i] = v;
}
// act_ptr is the address of element off of such an activation.
DK_DEV void *act_ptr(void *p, int bf16, i64 off) { return bf16 ? (void *)((u16 *)p + off) : (void *)((float *)p + off); }
DK_DEV const void *act_ptr(const void *p, int bf16, i64 off) {
	return bf16 ? (const void *)((const u16 *)p + off) : (const void *)((const float *)p + off);
}

// nanmax is max that propagates NaN (as Go's max and torch.amax).
DK_DEV float nanmax(float a, float b) { return (a != a || b != b) ? (a != a ? a : b) : (a > b ? a : b); }

// --- E4M3: NVFP4's block scales (optim.cu) and FP8 weights' codes (fp8.cu).

// e4m3 rounds a >= 0 (or NaN) to the nearest E4M3FN value, ties to even,
// saturating at 448: the quantum is 2^(floor(log2 a) - 3), at least 2^-9
// (subnormals). Scaling by a power of two is exact, so rintf (ties to even)
// on a·2^-q gives compute.E4M3's float64 result.
DK_DEV float e4m3(float a) {
	if (a != a || a == 0) return a;
	int e = (int)((__float_as_uint(a) >> 23) & 0xff) - 127; // floor(log2 a) for normal a
	int q = e - 3;
	if (q < -9) q = -9;
	float down = __uint_as_float((u32)(127 - q) << 23); // 2^-q
	float up = __uint_as_float((u32)(127 + q) << 23);   // 2^q
	float r = rintf(a * down) * up;
	return r < 448.0f ? r : 448.0f;
}

// --- Dropout masks (elementwise.cu's k_dropout, moelora.cu).

// philox4x32 is Philox4x32-10 on c with key (k0, k1), in place: the
// counter-based generator of the dropout masks, compute.Philox4x32 (whose
// test holds it to Random123's known answers) step for step. The 32x32
// products are 64-bit, their high and low words Philox's mulhilo.
DK_DEV void philox4x32(u32 c[4], u32 k0, u32 k1) {
	for (int r = 0; r < 10; r++) {
		if (r > 0) {
			k0 += 0x9E3779B9u;
			k1 += 0xBB67AE85u;
		}
		u64 p0 = (u64)0xD2511F53u * c[0], p1 = (u64)0xCD9E8D57u * c[2];
		u32 n0 = (u32)(p1 >> 32) ^ c[1] ^ k0, n2 = (u32)(p0 >> 32) ^ c[3] ^ k1;
		c[0] = n0;
		c[1] = (u32)p1;
		c[2] = n2;
		c[3] = (u32)p0;
	}
}

// The dropout mask of compute.DropoutMask: element (r, c) of a (rows,
// cols) activation is kept when word c%4 of Philox({c/4, t, row, step},
// key) is >= thr, t the row's token: r, or over an MoE expert's grouped
// rows (its LoRA adapters' input; compute's MoEWeights.Drop) order[r]/K.
// One thread per four columns of a row: one Philox call (dropout_words).
DK_DEV void dropout_words(u32 w[4], i64 r, int g, const int *__restrict__ order, int K, int row, int step, int k0, int k1) {
	w[0] = (u32)g;
	w[1] = order ? (u32)(order[r] / K) : (u32)r;
	w[2] = (u32)row;
	w[3] = (u32)step;
	philox4x32(w, (u32)k0, (u32)k1);
}

// --- Warp reductions (all 32 lanes take part).

DK_DEV float warp_sum(float v) {
	for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(DK_FULL, v, m);
	return v;
}
DK_DEV double warp_sum_d(double v) {
	for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(DK_FULL, v, m);
	return v;
}
DK_DEV float warp_max(float v) {
	for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(DK_FULL, v, m));
	return v;
}

// --- Tensor cores: D = A·B + D for a 16x16 (row) by 16x8 (col) BF16
// product with FP32 accumulators (mma.sync.m16n8k16, sm_80+). Fragments,
// with g = lane/4 and t = lane%4 (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type"):
//   a[0] = A[g][2t..2t+1]    a[1] = A[g+8][2t..2t+1]
//   a[2] = A[g][2t+8..+9]    a[3] = A[g+8][2t+8..+9]
//   b[0] = B[2t..2t+1][g]    b[1] = B[2t+8..2t+9][g]
//   d[0..1] = D[g][2t..2t+1] d[2..3] = D[g+8][2t..2t+1]
// each .bf16x2 register holding the lower column (or row, for B) in its low
// half.
#ifndef DISTILL_EMU
DK_DEV void mma_bf16_16816(float d[4], const u32 a[4], const u32 b[2]) {
	asm volatile(
	    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
	    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
	    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// --- FP8 tensor cores: D = A·B + D for a 16x32 (row) by 32x8 (col) E4M3
// product with FP32 accumulators (mma.sync.m16n8k32 .e4m3, sm_89+), the
// fragments four codes a register (PTX ISA, "Matrix Fragments for
// mma.m16n8k32"), with g = lane/4 and t = lane%4:
//   a[0] = A[g][4t..4t+3]      a[1] = A[g+8][4t..4t+3]
//   a[2] = A[g][16+4t..+3]     a[3] = A[g+8][16+4t..+3]
//   b[0] = B[4t..4t+3][g]      b[1] = B[16+4t..+3][g]
// the lowest k in the lowest byte: the bytes ldmatrix gives for a tile of
// 16 rows (or 8 columns of B stored as rows) of 32 codes, read as 16 BF16.
// Below sm_89 there is no such instruction, nor in PTX before ISA 8.4
// (NVRTC 12.4): the kernel traps there, and the host never launches it
// (Backend.mmaE4M3; FP8 weights are refused below sm_89 anyway).
#ifndef DISTILL_EMU
DK_DEV void mma_e4m3_16832(float d[4], const u32 a[4], const u32 b[2]) {
#if __CUDA_ARCH__ >= 890 && (__CUDACC_VER_MAJOR__ > 12 || __CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4)
	asm volatile(
	    "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
	    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
	    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
	__trap();
#endif
}
#endif

// --- Shared-memory tiles for the tensor cores (sm_80+): asynchronous
// copies from global memory and ldmatrix. A shared address is the block's
// dynamic shared memory base (DK_DYN_SMEM's pointer) and a byte offset, so
// that the GPU converts the base to a shared-window address once (smem_u32,
// hoisted out of every loop) and the offsets stay integer arithmetic.
//
// cp_async16 copies 16 bytes (8 BF16) from global src to shared base+off
// without passing through registers (cp.async.cg: cached in L2 only), or
// writes 16 zero bytes when valid is false (src, which must still be a
// valid address, is then not read); cp_async4 copies 4 bytes (cp.async.ca:
// .cg takes only 16) the same way. Both addresses are aligned to the size.
// The copies of a thread are grouped by cp_async_commit; cp_async_wait<N>
// returns when at most the N newest of the thread's groups are still in
// flight. A wait makes the thread's own copies visible to itself only: a
// __syncthreads must follow before other threads read them.
//
// ldsm_x4 loads four 8x8 BF16 matrices from shared memory, a warp
// collective (all 32 lanes, converged): lane l gives the address of row
// l%8 of matrix l/8 (16 bytes, 16-byte aligned), and register i of lane
// (g = lane/4, t = lane%4) receives row g, columns 2t..2t+1 of matrix i.
// ldsm_x4_t is its transposing form (.trans): register i receives column g,
// rows 2t..2t+1 of matrix i. These are the mma fragments above: see
// attention.cu's ldsm_a, ldsm_b2 and ldsm_bt2.
//
// fast_exp2 is 2^x, flushing subnormal results to zero (ex2.approx.ftz: one
// MUFU instruction; relative error about 2^-22).
#ifdef DISTILL_EMU
// The emulator (testdata/emu) copies at once but faults an ldmatrix of
// bytes whose copy its thread has not yet waited for.
DK_DEV void cp_async16(void *base, u32 off, const void *src, bool valid) { emu_cp_async((char *)base + off, src, 16, valid); }
DK_DEV void cp_async4(void *base, u32 off, const void *src, bool valid) { emu_cp_async((char *)base + off, src, 4, valid); }
DK_DEV void cp_async_commit() { emu_cp_async_commit(); }
template <int N> DK_DEV void cp_async_wait() { emu_cp_async_wait(N); }
DK_DEV void ldsm_x4(u32 r[4], const void *base, u32 off) { emu_ldmatrix(r, 4, (const char *)base + off, false); }
DK_DEV void ldsm_x4_t(u32 r[4], const void *base, u32 off) { emu_ldmatrix(r, 4, (const char *)base + off, true); }
DK_DEV float fast_exp2(float x) { return exp2f(x); }
#else
// smem_u32 is the shared-window address of a generic pointer to shared
// memory (cvta.to.shared; the CUDA headers' __cvta_generic_to_shared is not
// available here).
DK_DEV u32 smem_u32(const void *p) {
	u32 r;
	asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
	return r;
}
DK_DEV void cp_async16(void *base, u32 off, const void *src, bool valid) {
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(base) + off), "l"(src), "r"(valid ? 16 : 0)
	             : "memory");
}
DK_DEV void cp_async4(void *base, u32 off, const void *src, bool valid) {
	asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(base) + off), "l"(src), "r"(valid ? 4 : 0)
	             : "memory");
}
DK_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> DK_DEV void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
DK_DEV void ldsm_x4(u32 r[4], const void *base, u32 off) {
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
	             : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
	             : "r"(smem_u32(base) + off));
}
DK_DEV void ldsm_x4_t(u32 r[4], const void *base, u32 off) {
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
	             : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
	             : "r"(smem_u32(base) + off));
}
DK_DEV float fast_exp2(float x) {
	float r;
	asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
	return r;
}
#endif

// Fragments from shared tiles (used by attention.cu and moe.cu).
// ldsm_a loads the A fragment of rows r..r+15, columns c..c+15 of the
// shared tile t (row stride ld): lanes 0-15 address rows r..r+15 at column
// c, lanes 16-31 the same rows at c+8 (matrices a[0..3] as prelude.cuh
// lays them out).
DK_DEV void ldsm_a(u32 a[4], const u16 *sm, int t, int ld, int r, int c, int lane) {
	ldsm_x4(a, sm, 2 * (t + (r + (lane & 15)) * ld + c + (lane >> 4) * 8));
}

// ldsm_b2 loads the B fragments of B[k][n] = t[n][k] (t's rows are the n
// index: K for Q·Kᵀ) for k in c..c+15, n in n0..n0+7 (b0) and n0+8..n0+15
// (b1).
DK_DEV void ldsm_b2(u32 b0[2], u32 b1[2], const u16 *sm, int t, int ld, int n0, int c, int lane) {
	u32 r[4];
	ldsm_x4(r, sm, 2 * (t + (n0 + (lane & 7) + (lane >> 4) * 8) * ld + c + ((lane >> 3) & 1) * 8));
	b0[0] = r[0];
	b0[1] = r[1];
	b1[0] = r[2];
	b1[1] = r[3];
}

// ldsm_bt2 is ldsm_b2 for B[k][n] = t[k][n] (t's rows are the k index: V
// for P·V), through ldmatrix's transposing form.
DK_DEV void ldsm_bt2(u32 b0[2], u32 b1[2], const u16 *sm, int t, int ld, int n0, int c, int lane) {
	u32 r[4];
	ldsm_x4_t(r, sm, 2 * (t + (c + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8));
	b0[0] = r[0];
	b0[1] = r[1];
	b1[0] = r[2];
	b1[1] = r[3];
}

// --- 16- and 8-byte vector access (the vector kernels; the host checks
// alignment and sizes, the scalar kernels stay the fallback).

// 16 bytes: 8 BF16 or 4 F32; 8 bytes: 4 BF16.
struct __align__(16) dk_u4 {
	u32 x, y, z, w;
};
struct __align__(16) dk_f4 {
	float x, y, z, w;
};
struct __align__(8) dk_u2 {
	u32 lo, hi;
};

// ld8 reads elements 8c..8c+7 of p, BF16 (bf set: one 16-byte load) or
// F32 (two), as fp32; st8 writes them (a BF16 store rounds each once, as
// st_act). p must be 16-byte aligned. BF16 element 2j is the low half of
// word j (little-endian, as an element-wise u16 access sees it).
DK_DEV void ld8(float v[8], const void *p, int bf, i64 c) {
	if (bf) {
		dk_u4 q = ((const dk_u4 *)p)[c];
		u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
		for (int j = 0; j < 4; j++) {
			v[2 * j] = bf2f((u16)(w[j] & 0xffff));
			v[2 * j + 1] = bf2f((u16)(w[j] >> 16));
		}
	} else {
		dk_f4 a = ((const dk_f4 *)p)[2 * c], b = ((const dk_f4 *)p)[2 * c + 1];
		v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
		v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
	}
}
DK_DEV void st8(void *p, int bf, i64 c, const float v[8]) {
	if (bf) {
		dk_u4 q;
		q.x = (u32)f2bf(v[0]) | ((u32)f2bf(v[1]) << 16);
		q.y = (u32)f2bf(v[2]) | ((u32)f2bf(v[3]) << 16);
		q.z = (u32)f2bf(v[4]) | ((u32)f2bf(v[5]) << 16);
		q.w = (u32)f2bf(v[6]) | ((u32)f2bf(v[7]) << 16);
		((dk_u4 *)p)[c] = q;
	} else {
		dk_f4 a, b;
		a.x = v[0], a.y = v[1], a.z = v[2], a.w = v[3];
		b.x = v[4], b.y = v[5], b.z = v[6], b.w = v[7];
		((dk_f4 *)p)[2 * c] = a;
		((dk_f4 *)p)[2 * c + 1] = b;
	}
}

// --- The 8-wide row kernels (RMSNorm forward and backward).

// RV_K is the most chunks of 8 elements a thread of the 8-wide row kernels
// holds (rmsVecK in ops.go): a row of dim = 8·C elements takes a group of
// lanes >= C/RV_K threads, and thread sub of the group holds the chunks
// sub + k·lanes, k < RV_K.
#define RV_K 4

// group_sum_d sums v over an aligned group of `lanes` lanes of the warp (a
// power of two, at most 32; every lane of the warp calls it with the same
// lanes): xor shuffles, so each lane of the group gets the same bits.
DK_DEV double group_sum_d(double v, int lanes) {
	for (int m = lanes >> 1; m > 0; m >>= 1) v += __shfl_xor_sync(DK_FULL, v, m);
	return v;
}

// row_sum_d sums v over a row's group of `lanes` threads, sub this
// thread's index in it: a warp's aligned group by shuffles (red null), or
// a whole block (red: 32 doubles of shared memory) warp by warp, the
// warps' sums added in order. Every thread gets the same bits.
DK_DEV double row_sum_d(double v, int sub, int lanes, double *red) {
	if (!red) return group_sum_d(v, lanes);
	int warp = sub / DK_WARP, lane = sub % DK_WARP, nw = lanes / DK_WARP;
	v = warp_sum_d(v);
	if (lane == 0) red[warp] = v;
	__syncthreads();
	v = 0;
	for (int i = 0; i < nw; i++) v += red[i];
	return v;
}

// moe_tile_expert finds the expert whose row tiles hold tile t of the MoE
// kernels' grid: tile_start[e] <= t < tile_start[e+1] (binary search; -1
// past the last tile).
DK_DEV int moe_tile_expert(const i32 *tile_start, int E, int t) {
	if (t >= tile_start[E]) return -1;
	int lo = 0, hi = E - 1;
	while (lo < hi) {
		int mid = (lo + hi + 1) / 2;
		if (tile_start[mid] <= t) lo = mid;
		else hi = mid - 1;
	}
	return lo;
}
