// Package cuda is the GPU backend of package compute: the teacher's forward
// on NVIDIA GPUs (compute capability 8.0 and newer), with BF16 weights on
// the device and fp32 accumulation.
//
// # What it implements
//
// The memory methods and every forward kernel of compute.Backend, with the
// statistics the training contract asks of them (RMSNorm's rstd,
// Attention's log-sum-exp): everything the teacher (teacherd, cachectl
// fill and score) runs. The training methods (the backward kernels,
// AdamW, SumSquares, Scale, AbsMax, FakeQuantNVFP4 and the fused loss head)
// have no CUDA kernels yet: each panics with ErrNoTraining,
//
//	cuda: <Method> is not implemented yet (GPU training backend, issue 16); use --device cpu for training
//
// and compute/device never hands this backend to a training run: student
// train --device cuda fails before it starts, and --device auto trains on
// the CPU. In the conformance suite this backend runs
// computetest.RunForward, the forward half.
//
// # Build and load
//
// Building needs cgo and gcc only: no CUDA header, no toolkit. The driver
// (libcuda.so.1), NVRTC (libnvrtc.so.13, .12, .11.2) and cuBLASLt
// (libcublasLt.so.13, .12, .11) are opened with dlopen when Open is called,
// and reached through hand-declared prototypes (capi.h). A missing library
// or symbol is an error naming it; DISTILL_LIBCUDA, DISTILL_LIBNVRTC and
// DISTILL_LIBCUBLASLT name the files outright.
//
// The kernels are the .cu files of kernels/, embedded in the binary and
// compiled by NVRTC for the device's arch (sm_90a on Hopper, sm_XY
// elsewhere) when the backend opens. They include no CUDA header: the
// prelude (kernels/prelude.cuh) has its own fixed-width types, BF16
// conversions and the tensor-core mma in inline PTX, so that Debian's NVRTC
// 11.8 compiles them in CI on machines without a GPU (TestKernelsCompile).
// Compiled kernels are cached on disk (kcache.go), keyed by source, arch,
// NVRTC version and options.
//
// # Execution
//
// Everything is enqueued on one stream. Tensors are device memory from the
// driver's stream-ordered pool (cuMemAllocAsync), so the decoder's per-batch
// allocations cost no synchronization. The host waits only in ReadF32 and
// ReadI32 (once per batch for the top-k), and in MoE, which reads each
// layer's per-expert row counts (E integers) to size the experts' GEMMs.
//
// Kernels and precision, against compute/cpu (the oracle of the tests):
//
//   - MatMul: cuBLASLt, BF16 operands (activations rounded at the GEMM's
//     input, weights as stored), fp32 accumulation and output.
//   - RMSNorm (and the q/k norm, as RMSNorm over heads): sum of squares in
//     float64, the rest in fp32; rstd saved on request.
//   - RoPE: fp32, from the cos/sin table the decoder builds on the host
//     (float64 cos and sin of the fp32 angle pos·inv_freq, llama3 scaling
//     included) and uploads once per batch.
//   - Attention: packed varlen causal GQA, flash-style (online softmax,
//     memory linear in tokens). head_dim 64 and 128 run on tensor cores
//     (mma.sync m16n8k16, BF16 Q, K, V and P, fp32 accumulators); other
//     head dims on an fp32 kernel. Both save each query row's log-sum-exp
//     on request (fp32).
//   - SwiGLU, residual add, embedding: fp32.
//   - MoE: router GEMM in fp32 (a discrete choice: BF16 logits would flip
//     near-ties), softmax and top-k on the device, rows grouped by expert,
//     each expert's GEMMs through cuBLASLt in BF16, a weighted combine in
//     the CPU's summation order.
//   - LMHeadTopK: the vocabulary in tiles; cuBLASLt writes a tile's
//     logits, k_lm_fold folds them into each row's running log-sum-exp
//     (float64) and running top-k (exact, ties by lower id).
//
// # Testing without a GPU
//
// testdata/emu is a CPU stand-in for the three libraries. The tests build
// it with g++ from the same kernel sources and point the DISTILL_LIB*
// variables at it, so the backend's Go code, its launches and its kernels
// run against compute/cpu on any linux/amd64 machine: one fiber per CUDA
// thread, switching at barriers, with launch limits, shared-memory sizes,
// parameter sizes and copies checked: the package's own conformance tests
// against compute/cpu, computetest.RunForward against float64 formulas,
// and the whole teacher against the golden checkpoints (TestForwardGoldens).
// With DISTILL_CUDA_TEST=gpu the same
// tests run on a real GPU; scripts/gpu-suite.sh runs them there, with
// compute-sanitizer, HF goldens and the benchmarks.
package cuda
