// Package cuda is the GPU backend of package compute, for NVIDIA GPUs of
// compute capability 8.0 and newer: the teacher's forward, with BF16
// weights on the device and fp32 accumulation, and the student's training
// step, in BF16 mixed precision.
//
// # What it implements, and what has been verified
//
// The whole compute.Backend contract: the memory methods, every forward
// kernel with the statistics the backward needs (RMSNorm's rstd,
// Attention's log-sum-exp, what MoEForward saves), every backward kernel
// (the Qwen3-MoE block's included, so MoE students train here), the fused
// LM-head loss (both passes), AdamW, the gradient's sum of squares,
// scaling, absmax and NVFP4 fake quantization.
//
// Every kernel is compiled by NVRTC for sm_80 and sm_90 in CI
// (TestKernelsCompile) and passes the contract's whole conformance suite
// (computetest.Run) and this package's tests against compute/cpu on the
// CPU emulator (below). Both halves passed scripts/gpu-suite.sh on an
// H200 (2026-11-26: conformance, memcheck, goldens, loss curves within
// 0.3% of the CPU's, bit-exact resume and QAD export), so compute/device's
// --device auto runs the teacher and trains the student here when a GPU
// is present.
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
// cuDNN (libcudnn.so.9, 9.10 or newer; DISTILL_LIBCUDNN names the file) is
// optional: it runs attention when Options.Attention is "auto" (the
// default) or "cudnn". Its fused flash attention is driven through cuDNN's
// C backend (graph) API with hand-declared enums (cudnn_capi.h):
// cudnn_sdpa.c builds the graphs cuDNN's frontend lowers its SDPA node to
// (matmul, scale, padding and causal masks, softmax with its statistics,
// matmul; and the backward's recomputed P, dV, dP, dS, dK, dQ), in the THD
// layout: q, k, v, out and their gradients are ragged tensors over the
// packed rows (per-sample element offsets from the batch's starts,
// k_sdpa_meta), the samples' lengths are the matmuls' M/N/K overrides, and
// the softmax statistics are the contract's lse, (tokens, heads) fp32.
// Plans are built once per bucket of (samples, longest sample), each
// rounded up to a power of two (a bucket's unused samples are empty), and
// kept for the process; each build is logged once with its time. A call
// whose samples all have one length (tokens = samples · longest: one
// sample, or equal windows, as the training benchmarks' rows and a
// teacher's equal-length batches are) gets a plan of its exact shape
// through the graph PyTorch's SDPA builds for an unpadded batch: the same
// tensors as plain strided BSHD ones, with no ragged offsets, lengths or
// padding mask ("fixed lengths" in the plan's log line), so that cuDNN
// picks its engines for regular tensors; where cuDNN refuses that graph,
// the call goes through the ragged one. Options.AttnRaggedOnly
// ($DISTILL_CUDNN_RAGGED=1) sends every call through the ragged graph, for
// the GPU suite's side-by-side timing (BenchmarkAttention's cudnn-ragged).
// The H200 run of 2026-11-26 had cuDNN's forward at 0.83x PyTorch's cuDNN
// SDPA on one row of 8192 tokens through the ragged graph; the fixed
// graph is untimed. Q, K, V,
// O and dO are read in place when they are BF16 16-byte aligned (the
// decoder's are: dO is o_proj's BF16 dx), else rounded or moved once per
// call; the BF16 output is written in place or widened, and the gradients
// are widened into the contract's F32 tensors (+= for the gradients; dV
// added in BF16 where the decoder's dv is BF16). 9.10 is the minimum: older versions need a second padding
// mask in the backward graph and another fill value for masked scores.
// Without cuDNN (absent, older, or Options.Attention "mma"/"simt"), or for
// a shape it refuses (head_dim not a multiple of 8 or above 256, offsets
// beyond int32, no engine), attention runs on this package's kernels, with
// one log line naming the library or the refusal and the expected
// slowdown; "cudnn" makes a missing cuDNN an error of Open instead.
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
// allocations cost no synchronization. Host data goes up through a ring
// of pinned staging buffers (staging.go; up to 16 MiB a copy, larger
// ones from Go's memory; the ring grows to at most 64 MiB of pinned host
// memory a backend: many copies between two synchronizations, as when
// loading weights, grow it there), from which a copy never makes the
// host wait, as a copy from pageable memory may; a quarter of the ring is
// written again only after the event recorded after its copies, or once
// the host has synchronized since (the emulator checks it). The host
// waits only in ReadF32 and ReadI32 (once per batch for the top-k), the
// reductions that return a value (SumSquares, SumSquaresEach, AbsMax)
// and LossValues.Read (below): MoE groups and multiplies its
// experts' rows on the device, forward and backward (below), except for
// shapes the grouped kernels cannot take, where it reads the per-expert
// row counts to size a cuBLASLt GEMM per expert.
//
// Memory planning: the backend implements compute.DeviceMemory. MemInfo
// counts what the pool keeps for reuse as free; ForwardScratchBytes bounds
// a forward's largest kernel scratch (plan.go), which with the decoder's
// activations is infer.Model.DeviceBytes. The teacher checks its token
// budget against it when it starts (infer.Model.CheckDeviceFit, from
// serve.NewCore: teacherd and cachectl fill --model), and refuses a budget
// that does not fit with an error naming the largest that does, rather
// than failing batches with out-of-memory errors later. PeakMemory (the
// pool's USED_MEM_HIGH) measures it: the tests hold the bound to within
// 2x of the measurement for each dominant term (TestForwardDeviceBytes,
// TestForwardScratchBytes), on the emulator and in the GPU suite.
//
// Kernels and precision, against compute/cpu (the oracle of the tests):
//
// Activations are BF16 (compute.Backend.ActDType; Options.Activations
// "f32" or $DISTILL_CUDA_ACT=f32 restores fp32 activations): the decoder
// stores in BF16 what feeds GEMMs, attention and the elementwise kernels,
// and keeps the residual stream, statistics, gradients (but those only a
// GEMM's backward reads: Training, below) and an MoE block's input in
// fp32. Every kernel below takes its activation operands in
// either dtype (a flag per operand), computes in fp32 and rounds each
// element once on store, so a BF16 operand needs no rounding pass before
// a GEMM or attention.
//
//   - MatMul: cuBLASLt, BF16 operands (an F32 x rounded at the GEMM's
//     input, weights as stored), fp32 accumulation; out F32, or BF16
//     rounded by cuBLASLt's epilogue (with a bias: the bias added to the
//     fp32 result first, then one rounding).
//     An FP8 weight (WeightFP8, a teacher's --weights fp8: fp8.go) runs
//     W8A8: x's rows quantized to E4M3 with a scale each
//     (k_fp8_quant_rows, bit for bit compute.FP8QuantizeRow), cuBLASLt's
//     FP8 GEMM ("TN", CUDA_R_8F_E4M3 operands, fp32 accumulation and D;
//     Hopper's FP8 MMA adds a step's products at less than fp32's
//     precision, TestMatMulFP8Conformance's GPU bound),
//     each sum multiplied by its row's and channel's scales by
//     cuBLASLt's epilogue through outer-vector scales, D written in out's
//     type (cuBLASLt 12.9 or later, no bias; the default), or by
//     k_fp8_scale over fp32 sums (Options.FP8Scale "epilogue"); in
//     slabs of 2048 rows. FP8 MoE experts run on the device's
//     grouping like the BF16 ones (k_moe_gemm_fp8_glu: gate and up with
//     the SwiGLU, h in fp32; h quantized per row; k_moe_gemm_fp8: down),
//     the tokens' codes read in place, E4M3 products by mma.sync m16n8k32
//     (sm_89 and NVRTC 12.4 or newer: Backend.mmaE4M3), each sum scaled by
//     its row's and channel's scales as k_fp8_scale does; without them,
//     the host's grouping and one cuBLASLt FP8 GEMM per expert (a sync per
//     MoE layer), on the emulator only: on a GPU that path disagreed with
//     the CPU (the H200, 2026-11-27) and is refused (moeForward).
//   - RMSNorm (and the q/k norm, as RMSNorm over heads): sum of squares in
//     float64, the rest in fp32; rstd saved on request.
//   - RoPE: fp32 math, from the cos/sin table the decoder builds on the host
//     (float64 cos and sin of the fp32 angle pos·inv_freq, llama3 scaling
//     included) and uploads once per batch.
//   - Attention: packed varlen causal GQA, flash-style (online softmax,
//     memory linear in tokens). The own kernels: head_dim 64 and 128 on
//     tensor cores, FlashAttention 2's way (k_attn_mma64/128): BF16 copies
//     of q, k and v made once per call; 128-query tiles on 8 warps (16
//     rows a warp, Q held in registers); K and V in 64-key steps,
//     double-buffered in shared memory by cp.async, fragments by ldmatrix
//     (its transposing form for V); mma.sync m16n8k16 with BF16 Q, K, V
//     and P, fp32 accumulators, the online softmax in registers in base 2;
//     steps wholly after a warp's rows skipped, only the diagonal masked.
//     Other head dims on an fp32 kernel. Both save each query row's
//     log-sum-exp on request (fp32, natural log).
//   - SwiGLU: fp32 math; residual add and embedding: fp32.
//   - MoE (and MoEForward, which keeps what the backward needs): router
//     GEMM in fp32 (a discrete choice: BF16 logits would flip near-ties),
//     softmax and top-k on the device, the (token, slot) pairs grouped by
//     expert in token order (k_moe_order: stable and deterministic, no
//     atomic cursors), the experts' GEMMs in BF16 with fp32 accumulation
//     (under QAD over NVFP4-fake-quantized inputs), a weighted combine in
//     the CPU's summation order. The grouping's offsets and row tiles are
//     scanned on the device (k_moe_scan) and each projection of every
//     expert is one launch of a grouped tensor-core GEMM over the
//     expert-sorted rows (k_moe_gemm: 128x128 tiles on 8 warps, K in
//     64-wide steps staged three ahead by cp.async, ldmatrix, mma.sync; the
//     experts' weight addresses in a device array), sized by an upper bound
//     of the row tiles, so the host never waits for the routing. The gate
//     and up GEMMs read each grouped row's token in place (x rounded to
//     BF16 once, T rows instead of T·K gathered ones), and where nothing
//     keeps gate and up (a teacher's forward, no adapter, no NVFP4
//     quantization of the SwiGLU) they are one launch, k_moe_gemm_glu, whose
//     blocks hold the same columns of both and write silu(gate)·up in BF16:
//     the bits of the unfused path (each sum in ascending k either way).
//     Options.MoEGEMM "v1" runs the earlier kernels (32-wide steps in two
//     buffers, the tokens gathered by k_moe_gather, the SwiGLU a pass of
//     its own) for an A/B on a device; TestMoEGroupedGEMM holds both to the
//     same bits. Shapes the kernels cannot take (hidden or intermediate not
//     a multiple of 8) read the counts to the host and run a cuBLASLt GEMM
//     per expert. A LoRA student's expert adapters (MoEWeights.Adapters)
//     run on the device's grouping whichever path grouped the base's rows
//     (kernels/moelora.cu, moe_lora.go): fp32 kernels on CUDA cores, each
//     product one launch for every expert (a block per 64-row tile of one
//     expert, its adapter's addresses, scale, rank and dropout key from a
//     device table; an expert without an adapter skipped), the dropout
//     drawn per token with each expert's key as x is staged (the token
//     rows read in place through the order, as the base's GEMMs read
//     them): t = Scale·drop(x)·Aᵀ, then out += t·Bᵀ, with no host wait.
//   - LMHeadTopK: the vocabulary in tiles; cuBLASLt writes a tile's
//     logits, k_lm_fold folds them into each row's running log-sum-exp
//     (float64) and running top-k (exact, ties by lower id), a launch an
//     LM_TILE-column piece, sorting each piece's candidates (the first
//     piece's 4096 by a bitonic sort). k_lm_fold_gemm (Options.LMFold
//     "gemm", $DISTILL_CUDA_LM_FOLD=gemm, k up to 2048) folds a whole GEMM
//     tile in one launch, the row's state on chip across its pieces, the
//     next piece loaded while one is reduced, a piece's best k found by a
//     radix select over the 64-bit keys, up to 256 candidates entering
//     the list by rank: the same bits (TestLMFoldGEMM, on the H200 too),
//     but slower there (2026-11-28: BenchmarkLMHead's gemm_fold_speedup
//     0.82 and 0.89 at hidden 1024 and 4096, 0.99 on the Qwen3-8B
//     forward), so it is opt-in.
//   - LMHeadSample: the same pass, each fold also
//     keeping per row the fold tile's max, its 64-id blocks' sums of
//     exp(logit - max) (fp32 terms, float64 sums) and their total; after a
//     slab's last tile, k_lm_sample (a block per row) takes the top-k ids'
//     own terms out of their blocks' sums (multiplying again a block they
//     dominate, as compute/cpu), locates each sorted threshold among
//     the tiles' and blocks' cumulative sums, and computes only the
//     blocks that hold one again (dot products of the GEMM's BF16
//     operands, fp32) to walk them in float64, ids ascending. Slabs are
//     bounded so that the draws' scratch fits the logit tile's budget
//     (planLMHeadSample). Verified on the emulator against the CPU's
//     draws (TestLMHeadSampleConformance) and the suite's float64
//     inverse CDF, and on an H200 at hidden 24 (2026-11-26; head+sampled
//     then 5.7x the top-k pass's time at hidden 1024, when the top-k ids'
//     blocks were multiplied again: not timed since).
//
// Training (train.go, train_moe.go; kernels in optim.cu, backward.cu,
// losshead.cu, the end of attention.cu and of moe.cu). Backward kernels accumulate (+=), as the
// contract says. Mixed precision as Megatron-LM trains: the parameters,
// their gradients and the AdamW moments are the caller's fp32 tensors (the
// decoder sees no BF16 copy); each GEMM reads BF16 roundings of its
// operands and accumulates in fp32 into fp32. The saved activations are
// BF16 already (half the arena); so are the gradients that only a GEMM's
// backward reads (compute.ActGrads): SwiGLUBackward's dgate and dup, the
// q/k norms' dx, AttentionBackward's dv, the BF16 copy of the residual
// stream's gradient that RMSNormBackwardCopy writes beside the F32 one in
// the same kernel, and those of the rotated dq and dk that
// RoPEBackwardCopy writes where no q/k norm or bias reads them (Llama's
// q_proj and k_proj), each the rounding of the fp32 value a rounding
// pass would have read; and attention's dout, o_proj's dx, which
// cuBLASLt writes in BF16 from a zeroed dx (beta 0: the fp32 sum rounded
// once by the epilogue) and attention reads in place (Options.F32Grads
// restores F32 gradients and the passes: train's TestCUDAGradsInBF16
// holds the two to the same bits on the emulator). A BF16 dx that
// accumulates (beta 1) goes through fp32, since cuBLASLt rounds the
// product to BF16 before it adds a BF16 C (the H200, 2026-11-28; the
// emulator's cuBLASLt does the same; TestMatMulBackwardBF16DX passed on
// the H200 with both); the parameters
// are rounded once per
// step (shadow.go): the backend keeps a BF16 shadow of each fp32
// parameter a GEMM reads, which AdamW's kernel writes with the update
// (k_adamw), and which any other write to the parameter makes stale (the
// next GEMM rounds it again, once). Under NVFP4 QAD the fake quantization
// of a parameter writes the BF16 rounding of its result beside the F32
// copy, and is skipped while neither changed (the decoder asks before
// every forward; the weights move once per step). The GEMMs read the same
// bits as rounding per use, which Options.PerUseCasts restores
// (TestWeightShadows, train's TestCUDAWeightShadows: losses and weights
// bit for bit).
//
//   - MatMulBackward: cuBLASLt GEMMs dx += dout·w ("NN") and dw += doutᵀ·x
//     ("NT") with beta = 1, BF16 operands (a BF16 dout read in place, an
//     F32 one rounded by a pass); dx F32, or BF16 (attention's dout: C and
//     D BF16); dbias by column sums (float64) of an F32 dout, whose pass
//     (k_colsum_part4) also writes dout's BF16 rounding for the GEMMs, so
//     a biased Linear (Qwen2's q, k, v) makes no rounding pass. Two
//     Linears that share an input (gate and up; q, k and v) accumulate
//     their dx in the GEMM (beta = 1), in call order: no separate add.
//   - RMSNormBackward: dx per row (the forward's geometry, float64 dot).
//     Where the 8-wide kernels run (dim a multiple of 8 up to 8192, the
//     tensors 16-byte aligned: all 113 calls of the Qwen3-0.6B step
//     profiled on the H200), dw's terms are summed in them too
//     (k_rmsnorm_bwd_warp8_dw, _block8_dw): each block takes a fixed group
//     of rows (rmsDWGroup: a function of the shape), its threads add their
//     elements' terms, from the dout and x they already hold, into float64
//     sums in shared memory, the block writes one partial row, and
//     k_rmsnorm_dw_finish adds the blocks' rows in order. Before,
//     k_colsum_part4 read dout and x a second time (about 100 MB a call at
//     8192x1024): 3.85 ms and its finish 1.19 ms of a Qwen3-0.6B step of
//     8192 tokens on the H200, beside 5.00 ms of the row kernels, 113
//     calls each; the fused kernels are not timed yet. Options.RMSNormDW
//     "colsum" ($DISTILL_CUDA_RMSNORM_DW=colsum) runs the column sums
//     again, for an A/B on a device (BenchmarkRMSNormBackward times both,
//     the GPU suite's bench step): the same terms, in another fixed
//     order. The scalar kernels' shapes always take them: dw by column
//     sums over fixed row chunks, then the chunks in order.
//   - EmbedBackward: each id's tokens chained (k_embed_links: a thread a
//     token finds its id's next token and whether it is the first), then a
//     block a token: an id's first token adds its chain's rows of dout in
//     token order, its threads across the columns (repeated ids add up in
//     a fixed order; bit-identical to the CPU). Before, one thread a
//     column walked all the tokens (3.34 ms of the 0.6B step on the H200;
//     8 tokens a step since, untimed). The links' scan is quadratic in a
//     row's tokens at worst (ids used once); not timed on a GPU either.
//   - RoPEBackward, SwiGLUBackward: fp32, elementwise (RoPEBackwardCopy:
//     the rotated value's BF16 rounding stored beside it).
//   - MoEBackward: the routing weights' gradients dout·Y (float64 sums,
//     k_moe_wgrad), the renormalization and softmax backward per token
//     (float64, k_moe_route_bwd, the load-balancing dprob included), then
//     dx += dlogits·Router and dRouter += dlogitsᵀ·x as fp32 GEMMs (the
//     router is fp32 in the forward); the experts' GEMMs with BF16
//     operands over their grouped rows: dDown += dYᵀ·act (act recomputed
//     from the saved gate and up), dact = dY·Down, SwiGLU's backward
//     (k_moe_swiglu_bwd), dGate, dUp += dᵀ·x_grouped, the grouped dx; each
//     token's K grouped rows are added to dx in ascending expert order
//     (k_moe_dx). Straight-through under QAD. The GEMMs run on the grouping
//     the forward saved, each one launch for all experts: k_moe_gemm_nn
//     (and _acc) for dact and dx, k_moe_wgrad_gemm for the weight
//     gradients (a block per tile of one expert's gradient, summing over
//     its rows in 64-row steps staged three ahead: the tile's only writer,
//     a fixed order; dGate's and dUp's read the tokens in place through
//     the saved order, as the forward did); experts with no rows are
//     untouched. Shapes the kernels cannot take read the saved offsets to
//     the host and run cuBLASLt per expert. The experts' adapters: t
//     recomputed, DB += doutᵀ·t, dt = Scale·dout·B, DA += dtᵀ·drop(x) (a
//     block per tile of one expert's DA or DB summing its rows in order:
//     deterministic, no atomics), dx += drop'(dt·A): five launches a
//     projection for all experts, on the saved grouping.
//   - AttentionBackward: flash-style, the probabilities recomputed from the
//     forward's log-sum-exp. The own kernels: head_dim 64 and 128 on tensor
//     cores (FlashAttention 2's backward with the forward's machinery: q,
//     k, v and dout read in place when BF16, else rounded once per call,
//     cp.async double buffering, ldmatrix, mma.sync with BF16 P and dS,
//     fp32 accumulators): D = dout·out from the BF16 dO the other kernels
//     read (so D = Σ_j P·dP of their dP, as cuDNN computes it) and the
//     forward's output as stored (k_attn_dsum, fp32 math; O recomputed by
//     the forward kernel only where a caller passes none), then
//     k_attn_bwd_dq_mma (a block per 128 queries and head,
//     64-key steps) and k_attn_bwd_dkv_mma (a block per 128 keys and kv
//     head, the group's heads in 64-query steps from the diagonal on).
//     FlashAttention 2 adds dq from the dkv kernel with atomics; here dq
//     has its own kernel, which recomputes S and dP (7 products the size
//     of Q·Kᵀ against its 5). Other head dims on fp32 SIMT kernels
//     (k_attn_bwd_dq, k_attn_bwd_dkv; a BF16 dout widened once per call).
//     Each kernel is the sole writer of its rows: no atomics.
//   - LossHeadForward/Backward: the vocabulary in tiles of the counted rows
//     (M x cols fp32 logits, at most 256 MiB); cuBLASLt writes a tile's
//     logits from BF16 operands; k_loss_fwd_tile folds it into each row's
//     online log-sum-exps (float64), its tail summed directly over v ∉ K
//     (the teacher's ids found by binary search) and the logits at the ids
//     and the label; k_loss_bwd_tile turns a recomputed tile into dL/dz in
//     BF16, and two GEMMs accumulate dx and dW. [M x V] never exists.
//     LossHeadForwardKD (compute.DeviceLossCoef) keeps pass 1's results on
//     the device and k_loss_coef computes pass 2's coefficients from them,
//     one thread per row, in float64 with train/loss's operations in its
//     order (explicit __dmul_rn/__dadd_rn, compute.Exp and compute.Log
//     ported as exp64 and log64): the host's coefficients bit for bit,
//     with no round trip between the passes. Its per-position loss
//     values are copied into a pinned block behind an event as soon as
//     they are computed; LossValues.Read waits for that event only, or
//     not at all once the host has synchronized since.
//   - AdamW (fp32, elementwise; the BF16 shadow of p written in the same
//     pass), Scale; SumSquares and AbsMax as two-stage reductions of a
//     fixed shape (a grid that depends on n only, fixed trees);
//     FakeQuantNVFP4 bit for bit compute/fp4.go's definitions (and the
//     BF16 rounding of its result, for a parameter's quantization).
//
// Host waits in a training step: the trainer's step (train/trainer, and
// BenchmarkCUDATrainStep's) makes the host wait for the GPU once, to read
// the gradient's norm (SumSquaresEach): the clip's coefficient and the
// skip of a non-finite step are the host's decisions (AdamW's step count
// and bias corrections, the logs). The rows' uploads go through the
// staging ring, and their loss values are read after the norm
// (train.Student.ForwardBackwardPending), so the GPU drains once a step,
// not at each row's loss head and upload. An MoE student waits once too:
// each MoE layer records its per-expert counts and probability column
// sums on the device (compute.MoERouting: k_moe_stats, one thread per
// expert summing the tokens in order in float64, the host's bits), the
// load-balancing loss's gradient is computed there from the counts
// (k_moe_aux_grad, compute.MoEAuxGrad's bits), and each row's statistics
// are copied into a pinned block behind an event and read with its loss
// values (the logged aux loss and expert shares); before, each MoE layer
// read its offsets and its (tokens, experts) probabilities to the host, two
// waits a layer and row (4 MB a layer at 8192 tokens and 128 experts).
// k_moe_stats' sums are chains of dependent float64 adds (8192 a layer at
// 8192 tokens, over 128 threads): to be timed by the GPU suite.
// CountHostWaits counts the
// waits by kind and call site; train/trainer's TestCUDAHostWaits holds a
// step to them, and the benchmark prints them beside the GPU's idle time
// (profile-train-*.txt). Options.Pageable ($DISTILL_CUDA_PAGEABLE=1)
// turns the staging off, for comparisons: the same bits. Not yet timed
// on a GPU.
//
// Deferred zeros (zeros.go): Zero records the buffer as pending instead of
// enqueuing a memset; a backward call that writes the whole buffer next
// (MatMulBackward's dx GEMM with beta 0, SwiGLUBackward and RMSNormBackward
// through their kernels' acc flag, cuDNN's attention backward widening dq
// and dk and writing a BF16 dv in place) writes its result instead of
// adding it to zeros, and every other call enqueues the pending memsets
// first. A dense Qwen3 layer's backward had 11 memsets (about 470 MB at
// 0.6B and 8192 tokens) and the first accumulation into each read them
// back; now none (TestCUDADeferredZeros counts them per architecture and
// compares the training with Options.EagerZeros,
// $DISTILL_CUDA_EAGER_ZEROS=1, the memset for every Zero: the same values).
// Not yet timed on a GPU.
//
// Determinism: cuDNN's attention backward runs its deterministic graph
// (dQ written by the dS·K matmul directly, no fp32 accumulator updated with
// atomics) and refuses engines that carry cuDNN's NONDETERMINISTIC note, so
// the promise below holds with cuDNN too; Options.AttnNondeterministic
// ($DISTILL_CUDNN_NONDETERMINISTIC=1) trades it for the faster
// accumulating graph, and the backend's open log line says which runs.
// Elsewhere no floating-point reduction uses atomics (the one atomic,
// k_moe_route's integer count of rows per expert, is exact in any order),
// and every summation order is a function of the shapes and the routing,
// so a run resumed after SIGKILL repeats the uninterrupted run's losses
// bit for bit on the same GPU (cuBLASLt is deterministic for the fixed
// algorithm a plan holds); the emulator checks it (train/trainer:
// TestCUDAResume, TestCUDAResumeAfterSIGKILL, TestCUDAMoEStudent), the
// GPU suite checks it on the GPU.
//
// Performance notes, to be measured by the GPU suite: the BF16 copies of
// F32 activations and gradients are made per GEMM call (those of
// parameters once per step, above; the gradients that only GEMMs and
// attention read are BF16 already, so a dense Qwen3, Qwen2 or Llama
// student's step makes none: train's TestCUDAStepConversions pins the
// conversion and copy passes a step makes on the emulator, by name, to
// what cuDNN's attention backward needs per call: its BF16 dq and dk
// widened into the F32 gradients RoPE's backward rotates, its dv added
// into the decoder's BF16 one or widened into a biased F32 one; the
// profile, Options.Profile, times device-to-device copies and memsets
// beside the kernels); the own tensor-core attention kernels use
// mma.sync, not Hopper's wgmma/TMA, and their backward recomputes S and dP
// for dq.
//
// # Collectives
//
// The backend implements compute.Collectives through NCCL (nccl.go):
// libnccl.so.2 opened with dlopen when a group is first made or joined
// (DISTILL_LIBNCCL names the file; prototypes in nccl_capi.h),
// ncclCommInitRank on the backend's device and context, and the four
// operations (F32, sum; the all-gather also BF16, ncclBfloat16, which
// ZeRO stage 3 gathers the layers' GEMM weights with, and RoundBF16 makes
// their roundings) enqueued on the backend's stream, in issue order
// with the kernels, their writes recorded for the weight shadows.
// JoinCollective gives up after DISTILL_NCCL_TIMEOUT (default 10 minutes)
// with an error naming it; a watchdog polls ncclCommGetAsyncError and
// aborts the communicator on an error, which the next operation panics
// with. Verified on the emulator's NCCL stand-in (testdata/emu/emu_nccl.cpp:
// ranks as processes or threads exchanging through shared memory,
// sums in rank order, every step checking that all ranks issued the same
// call): groups of 1, 2 and 3 ranks, exact and random sums, in-place
// layouts, kernels before and after on the same stream, misuse panics,
// wrong sizes, duplicate ranks, dead peers and timeouts (nccl_test.go).
// Against the real NCCL only the GPU suite's nccl step checks it, with a
// group of one (NCCL refuses two ranks on one GPU); it has not run on a
// GPU yet, and no run on two GPUs has been made.
//
// # Several GPUs, and several backends on one
//
// A Backend runs on one GPU (Options.Device), on a stream of its own; a
// process may open several, on different GPUs or on the same one (a
// stream each), and use them from different goroutines: every call makes
// its backend's context current on its locked OS thread. A pipelined
// teacher (package infer's LoadStages) keeps a stage of the decoder on
// each and moves activations between them with CopyFrom
// (compute.CrossCopier, peer.go): a device-to-device copy between two
// streams of one GPU; peer to peer between GPUs the driver lets reach each
// other (cuDeviceCanAccessPeer; the source's stream-ordered pool grants
// the destination access with cuMemPoolSetAccess, then cuMemcpyPeerAsync);
// else through a pinned host buffer (cuMemAllocHost) in chunks. The path
// is chosen once per pair of backends and logged. DeviceName names the
// GPU in errors ("GPU 1 (NVIDIA H100 80GB HBM3)"). Verified on the
// emulator's several GPUs (below); on a real GPU only two backends on GPU
// 0 have been planned for (the suite's pipe step), not yet run.
//
// # Testing without a GPU
//
// testdata/emu is a CPU stand-in for the three libraries, and for cuDNN's
// backend graph API: it validates the descriptors the backend builds and
// interprets the operation graphs (matmul, pointwise, reduction, reshape,
// ragged tensors and overrides) with a CPU reference. The tests build
// it with g++ from the same kernel sources and point the DISTILL_LIB*
// variables at it, so the backend's Go code, its launches and its kernels
// run against compute/cpu on any linux/amd64 machine: one fiber per CUDA
// thread, switching at barriers, with launch limits, shared-memory sizes,
// parameter sizes and copies checked: the package's own conformance tests
// against compute/cpu, computetest.Run against float64 formulas and finite
// differences, the whole teacher against the golden checkpoints
// (TestForwardGoldens) and split over several emulated GPUs
// (DISTILL_EMU_DEVICES; each with its own memory, contexts, streams and
// pool, every kernel, copy, GEMM and cuDNN call held to its own GPU's
// memory unless peer access was granted: TestPipelineGoldens,
// TestEmuDeviceIsolation), and the student's training step end to end
// (train/trainer: TestCUDALossCurve, TestCUDAResume, TestCUDAMoEStudent).
// With DISTILL_CUDA_TEST=gpu the same
// tests run on a real GPU; scripts/gpu-suite.sh runs them there, with
// compute-sanitizer, HF goldens and the benchmarks.
package cuda
