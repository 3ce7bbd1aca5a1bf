#!/usr/bin/env bash
# The GPU suite of compute/cuda (issues 15 and 16), in one command on a GPU
# machine.
#
# The GPU machine has no Go toolchain, so the test binaries are built here
# first:
#
#   bash scripts/gpu-suite.sh build
#
# which builds the test binaries of compute/cuda (cuda.test), of the
# --device chooser, compute/device (device.test), and of the student's
# trainer, train/trainer (trainer.test: training on the GPU end to end),
# of train (train.test) and of the decoder, model/decoder (decoder.test),
# and the student command (student, for the cli step, with a tiny teacher
# cache for it, cli-cache, written by scripts/gpu/clifixture), stripped,
# with the shared libraries they need beyond glibc (OpenBLAS and its
# Fortran runtime, for the CPU oracle), and packs them into
# .gpu/bundle.tar.gz (git-ignored; the device tool carries at most 64 MiB,
# which the unpacked files exceed). `run` unpacks it on the GPU machine.
# Then, through the device tool:
#
#   run(command="bash scripts/gpu-suite.sh run", carry=[".gpu"])          the teacher (issue 15)
#   run(command="bash scripts/gpu-suite.sh run train", carry=[".gpu"])    the student (issue 16)
#   run(command="bash scripts/gpu-suite.sh run attn-issue", carry=[".gpu"], timeout_s=420)
#                                                                         cuDNN attention
#
# `run attn-issue` is one device call of about 3 minutes (SUITE_BUDGET
# defaults to 360 s for it): env, test, attn, goldens, train-test,
# train-resume, train-bench, train-peer: what cuDNN fused attention needs
# checked (its conformance, the goldens through it, its speed against
# PyTorch's, a training step's speed and bit-exact resumes with it), with
# the training benchmark and its peer on qwen3-0.6b only unless
# DISTILL_BENCH_SHAPES says otherwise (1.7B does not fit an H100's 80 GB).
# Expected on an H100/H200, with kernels compiled once (~10 s, in test):
# env 5 s, test 30-40 s, attn 40-60 s, goldens 15-20 s, train-test 10 s,
# train-resume 5 s, train-bench 20-30 s, train-peer 15-20 s.
#
# (one call each; the tracked files, checkpoints and goldens included,
# travel with the working tree). Every step writes its log to $OUT
# (./gpu-out when $OUT is unset); a step's failure does not stop the
# others; the last lines printed are the summary ($OUT/summary.txt). Steps,
# each under its own time limit, in order:
#
#   env        nvidia-smi, the CUDA libraries found, Python package versions
#   test       the conformance tests against the real GPU (DISTILL_CUDA_TEST=gpu):
#              every forward kernel vs compute/cpu on ragged shapes, cuDNN's
#              attention (TestCudnn*), the contract's suite
#              (computetest.Run: forward and training, vs float64 formulas
#              and finite differences), the kernels compiled by the device's
#              NVRTC (sm_90a on Hopper)
#   device     the --device chooser on the real GPU: cuda and auto open it
#              for the teacher; training: cuda opens it, auto keeps the CPU
#   goldens    HF transformers BF16 goldens (scripts/gpu/hf_goldens.py, with
#              HF BF16's own agreement with the fp32 goldens), then the golden
#              checkpoints through package infer on the GPU: against the fp32
#              goldens, held to HF BF16's agreement less a slack
#              (TestForwardGoldens), and against HF's (TestForwardHFGoldens)
#   attn       attention alone, ours against PyTorch's on the same GPU:
#              BenchmarkAttention (cuDNN deterministic and non-deterministic
#              backward, the own mma kernels; forward, forward + backward;
#              4 x 4096 and 32 x 512 tokens, 32/8 heads, head_dim 128,
#              causal), scripts/gpu/sdpa_bench.py (torch SDPA's cuDNN and
#              flash backends, bf16, GQA), and the table of TFLOP/s and
#              ratios (scripts/gpu/attn_table.py) in attn.log
#   memcheck   compute-sanitizer --tool memcheck on the conformance tests
#   bench      GEMM, LM-head and Qwen3-0.6B/1.7B/8B forward benchmarks
#              (tokens/s, TFLOP/s, MFU, device memory) and a kernel profile
#              per forward (attention's benchmark is the attn step's), and
#              RMSNorm's backward with dw fused into the row kernels against
#              the column sums (DISTILL_CUDA_RMSNORM_DW=colsum): us/call
#   fp8        FP8 teacher weights (issue 29; needs FP8 tensor cores, sm_89
#              or sm_90): the FP8 tests on the GPU (fp8-test: cuBLASLt's E4M3
#              GEMM and the scaling epilogue against the CPU's FP8 MatMul,
#              k_fp8_quant_rows bit for bit, FP8 MoE experts, the golden
#              checkpoints' FP8 teacher against the CPU's, the scratch
#              bounds), then BenchmarkForwardFP8 (fp8-bench): the
#              Qwen3-8B-shaped teacher's forward with BF16 and with FP8
#              weights in turn on the same GPU, 16k tokens of workload b:
#              bf16_tokens/s, fp8_tokens/s, fp8_speedup and each one's
#              weights in GiB (DISTILL_BENCH_SHAPES picks other shapes)
#   moe        the experts' grouped GEMMs (issue 23): TestMoEGrouped* on the
#              GPU (the default kernels, gate and up fused with the SwiGLU
#              and the tokens read in place, give the earlier kernels' bits,
#              DISTILL_CUDA_MOE_GEMM=v1, and agree with per-expert cuBLASLt),
#              then BenchmarkMoE: one Qwen3-30B-A3B-shaped layer (16384
#              tokens, 128 experts of 768, top-8), the teacher's forward and
#              the student's forward + backward, default against v1 in the
#              same run (ms a call, TFLOP/s over the experts' GEMMs), the
#              forward with FP8 experts (k_moe_gemm_fp8: E4M3 mma.sync on
#              the device's grouping, issue 29; grouped=1 when it ran), and a
#              LoRA student's step on the default kernels (train-lora: the
#              base frozen, every expert adapted at rank 16, issue 28;
#              TestMoELoRA* first hold the adapters' grouped kernels to the
#              CPU and their launches to a count independent of E), and
#              the layer's load-balancing statistics and gradient that a
#              training step records for each MoE layer and row
#              (routing-stats: k_moe_stats, k_moe_aux_grad); with
#              DISTILL_BENCH_SHAPES=qwen3-30b-a3b the bench step times the
#              whole forward against the peer step's HF
#   peer       HF transformers on the same workloads (scripts/gpu/hf_bench.py)
#   racecheck  compute-sanitizer --tool racecheck on this package's attention
#              kernels (DISTILL_RACECHECK=1: smaller cases; cuDNN's, closed
#              source, are not raced), the LM head, the reductions
#   pipe       a pipelined teacher (issue 29) on the one GPU: two stages
#              sharing GPU 0 (two backends, a stream each) give the one-stage
#              forward's top-k bit for bit on the golden checkpoints
#              (TestPipelineGoldens), then BenchmarkPipelineOneGPU: the
#              Qwen3-0.6B-shaped forward (DISTILL_BENCH_SHAPES) as one
#              stage, as two stages in one micro-batch (the hand-off's
#              cost alone) and in the default micro-batches, then four such
#              batches: one stage, two stages draining after each batch,
#              two stages with the batches back to back (two in flight, as
#              teacherd runs them): tokens/s, overhead_% against one stage,
#              exactness, cross_batch_starts ($OUT/pipeline-bench.jsonl);
#              about two minutes
#   nccl       the collectives (issue 25) through the real NCCL, PyTorch's
#              wheel's libnccl.so.2 (site-packages/nvidia/nccl/lib) unless
#              DISTILL_LIBNCCL names one: a group of one runs every operation
#              on the GPU's stream between kernels (TestNCCLSingleRank), the
#              misuse panics, the join timeout; the groups of 2 and 3 rank
#              processes (TestNCCLRanks) share the one GPU, which NCCL
#              refuses ("Duplicate GPU detected", ncclInvalidUsage): those
#              tests skip, quoting NCCL's refusal in nccl.log
#
# and the student's (`run train` runs these, within the same budget):
#
#   train-test      the training kernels vs compute/cpu (ragged attention
#                   backward, loss head, NVFP4 bit for bit, MoE forward and
#                   backward, a frozen MoE backward's dx, the experts' LoRA
#                   adapters on the host's grouping (the suite's MoELoRA
#                   runs the device's), deterministic reductions: twice the
#                   same bits),
#                   the loss head's pass-2 coefficients computed on the GPU
#                   against train/loss's host math bit for bit
#                   (TestLossCoefDevice), uploads through the pinned
#                   staging ring as it wraps and grows (TestStagingRing),
#                   the MoE load-balancing loss's routing statistics and
#                   gradient computed on the GPU with no host wait, the
#                   host's bits (TestMoERoutingWaits), the deferred zeros'
#                   consumers (TestDeferredZero*: a zeroed gradient
#                   written, not memset and added to) and the contract's
#                   suite
#   train-memcheck  compute-sanitizer --tool memcheck on the training kernels
#   train-curve     tiny qwen3 and qwen2 students, 50 steps on the GPU and on
#                   the CPU from the same weights and cache: the GPU's loss
#                   curve within 1% of the CPU's at every step; both curves
#                   to $OUT/curve-qwen3.jsonl and curve-qwen2.jsonl
#   train-qad       students (Qwen3, Qwen3-MoE) trained with NVFP4 QAD on the
#                   GPU export NVFP4 weights that decode to the GPU's
#                   fake-quantized ones bit for bit; LoRA students on the
#                   GPU (TestCUDALoRA*: BF16 base, gradients and dropout
#                   masks against the CPU's); the backward's BF16
#                   gradients train bit for bit as F32 ones rounded by a
#                   pass (TestCUDAGradsInBF16); a step's conversion and
#                   copy passes are cuDNN attention's widenings only
#                   (TestCUDAStepConversions); the deferred zeros train
#                   as a memset for every Zero, and save the memsets
#                   counted (TestCUDADeferredZeros)
#   train-resume    on the GPU: a run stopped after a checkpoint and resumed,
#                   and a run SIGKILLed mid-training and resumed, repeat the
#                   uninterrupted run's losses bit for bit; the GPU's
#                   checkpoint resumes on the CPU; a tiny Qwen3-MoE student
#                   follows the CPU's loss curve within 1% and resumes bit
#                   for bit (TestCUDAMoEStudent), and so do LoRA students
#                   on a Qwen3-MoE base, attention and every expert adapted
#                   (TestCUDALoRAMoE); a training step waits for the GPU
#                   once (the norm: TestCUDAHostWaits, each step's waits
#                   printed)
#   train-bench     training steps of Qwen3-0.6B- and 1.7B-shaped students,
#                   rows of 8192 tokens, vocab 151936, k = 64, with and
#                   without NVFP4 QAD: tokens/s, MFU, device memory
#                   ($OUT/train-bench.jsonl) and the top kernels of one step
#                   ($OUT/profile-train-*.txt: its first line the GPU's
#                   idle ms and the step's host waits, then each wait's
#                   kind and call site; its last line counts the BF16
#                   rounding passes, k_f32_to_bf16*)
#   loss-coef       the loss head's training call at the 0.6B shape with
#                   pass 2's coefficients on the host, then on the device
#                   (issue 23): ms a call and the GPU's idle ms inside it
#   train-zero      the sharded student's step (ZeRO 2 and 3) on a real NCCL
#                   group of one rank against the unsharded step in the same
#                   run (overhead_%), device memory against the plan; the
#                   BF16 gathers bit for bit the fp32 gathers'; a one-rank
#                   job (its own process) at ZeRO 0 to 3 against the
#                   one-process run
#   train-peer      PyTorch on the same step (scripts/gpu/hf_train_bench.py:
#                   HF transformers, sdpa, bf16 autocast, fused AdamW,
#                   DistillKit's sparse top-k KL on full logits) at the
#                   largest batch that fits, with its peak memory
#   cli             the student command itself on the GPU, where the steps
#                   above run test binaries (scripts/gpu/student_cli.sh): a
#                   tiny random-init student with NVFP4 QAD, train.device
#                   cuda, on the bundle's cli-cache: student train
#                   --nproc-per-node 1 --max-steps 3; an endless run sent
#                   SIGTERM after step 2 (stopped by SIGTERM, a checkpoint,
#                   exit 0); the printed resume command plus --max-steps;
#                   student export --format bf16 and nvfp4; student eval:
#                   each checked for its exit status and its files ("ok:"
#                   or "FAIL:" lines in cli.log); about 20 s expected,
#                   most of it the kernels' first compile. (One GPU:
#                   --nproc-per-node 1 runs no launcher and no rank setup;
#                   a data-parallel job needs a GPU a rank, see the nccl
#                   step.)
#
# A device command may run 10 minutes: the suite keeps to SUITE_BUDGET
# seconds (default 560) in all, giving each step what is left up to its own
# limit and skipping the steps that no longer fit; the summary lists them.
# `run STEP...` runs only those steps, in the order given: a second call
# such as `run racecheck peer` picks up what the first one skipped; `all`
# is every step, `train` the student's, `attn-issue` the one above.
# Knobs: SUITE_BUDGET, DISTILL_GPU_SUITE_EMU (below), DISTILL_BENCH_TOKENS (batch tokens, default 16384),
# SDPA_ITERS (timed iterations of each attention case, both sides, default 10),
# DISTILL_BENCH_SHAPES (e.g. qwen3-0.6b,qwen3-8b), DISTILL_PEAK_TFLOPS,
# DISTILL_TRAIN_ROWS (8192-token rows a training step, default 1).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

build() {
  set -e
  local stage=.gpu/stage
  rm -rf .gpu && mkdir -p "$stage/lib"
  go test -c -ldflags='-s -w' -o "$stage/cuda.test" ./compute/cuda
  go test -c -ldflags='-s -w' -o "$stage/device.test" ./compute/device
  go test -c -ldflags='-s -w' -o "$stage/trainer.test" ./train/trainer
  go test -c -ldflags='-s -w' -o "$stage/train.test" ./train
  go test -c -ldflags='-s -w' -o "$stage/decoder.test" ./model/decoder
  # The cli step's student command and the tiny cache it trains on.
  go build -ldflags='-s -w' -o "$stage/student" ./cmd/student
  go run ./scripts/gpu/clifixture cache "$stage/cli-cache"
  # Libraries beyond glibc and libgcc that the binaries link (OpenBLAS ...).
  ldd "$stage"/*.test "$stage/student" | awk '/=> \// {print $3}' | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libgcc_s.so*|ld-linux*) ;;
      *) cp -L "$lib" "$stage/lib/" ;;
    esac
  done
  du -sh "$stage"
  tar -C "$stage" -czf .gpu/bundle.tar.gz .
  rm -rf "$stage"
  du -sh .gpu/bundle.tar.gz
  local size
  size=$(stat -c %s .gpu/bundle.tar.gz)
  if [ "$size" -gt $((60 << 20)) ]; then
    echo "gpu-suite: .gpu/bundle.tar.gz is $((size >> 20)) MiB; the device tool carries at most 64 MiB" >&2
    exit 1
  fi
  echo "now: run(command=\"bash scripts/gpu-suite.sh run\", carry=[\".gpu\"])  (or: run train, run attn-issue)"
}

OUT=${OUT:-$root/gpu-out}
BIN=${DISTILL_GPU_BIN:-/tmp/distill-gpu-bin} # where run unpacks .gpu/bundle.tar.gz
export LD_LIBRARY_PATH="$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export DISTILL_REQUIRE_NVRTC=1
# DISTILL_GPU_SUITE_EMU=1 dry-runs the suite without a GPU: the tests run
# on the CPU emulator of CUDA (they need g++ and this source tree), the
# training benchmark on a tiny shape; the GPU-only steps fail or skip.
if [ "${DISTILL_GPU_SUITE_EMU:-}" = 1 ]; then
  export DISTILL_TRAIN_BENCH_DRYRUN=1
else
  export DISTILL_CUDA_TEST=gpu
fi
export DISTILL_KERNEL_CACHE=${DISTILL_KERNEL_CACHE:-/tmp/distill-kernel-cache}
T="$BIN/cuda.test"
TT="$BIN/trainer.test"
PY=${PYTHON:-python3}

# first_file prints the first existing file among the globs.
first_file() {
  for g in "$@"; do
    for f in $g; do
      [ -e "$f" ] && { echo "$f"; return 0; }
    done
  done
  return 1
}

# libs points DISTILL_LIBNVRTC/DISTILL_LIBCUBLASLT at the newest NVRTC and
# cuBLASLt on the machine (the toolkit's, else the pip wheels'), and puts
# their directories on LD_LIBRARY_PATH (NVRTC loads its builtins library by
# name). The driver, libcuda.so.1, is found by the dynamic linker.
libs() {
  local site
  site=$($PY -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)
  local nv lt
  nv=$(first_file /usr/local/cuda/lib64/libnvrtc.so.1[0-9] /usr/local/cuda/targets/*/lib/libnvrtc.so.1[0-9] \
       /usr/local/cuda-*/lib64/libnvrtc.so.1[0-9] $(for s in $site; do echo "$s/nvidia/*/lib/libnvrtc.so.1[0-9]"; done))
  lt=$(first_file /usr/local/cuda/lib64/libcublasLt.so.1[0-9] /usr/local/cuda/targets/*/lib/libcublasLt.so.1[0-9] \
       /usr/local/cuda-*/lib64/libcublasLt.so.1[0-9] $(for s in $site; do echo "$s/nvidia/*/lib/libcublasLt.so.1[0-9]"; done))
  [ -n "$nv" ] && export DISTILL_LIBNVRTC=$nv LD_LIBRARY_PATH="$(dirname "$nv"):$LD_LIBRARY_PATH"
  [ -n "$lt" ] && export DISTILL_LIBCUBLASLT=$lt LD_LIBRARY_PATH="$(dirname "$lt"):$LD_LIBRARY_PATH"
  # NCCL 2 (collectives): the system's, else the pip wheel's (PyTorch's).
  local nccl
  if [ -z "${DISTILL_LIBNCCL:-}" ]; then
    nccl=$(first_file /usr/lib/x86_64-linux-gnu/libnccl.so.2 /usr/local/cuda/lib64/libnccl.so.2 \
         $(for s in $site; do echo "$s/nvidia/nccl/lib/libnccl.so.2"; done))
    [ -n "$nccl" ] && export DISTILL_LIBNCCL=$nccl
  fi
  # cuDNN 9 (attention): the system's, else the pip wheel's (PyTorch's).
  # Its sub-libraries (libcudnn_engines_*.so.9 ...) are opened by name, so
  # its directory goes on LD_LIBRARY_PATH too.
  local dnn
  if [ -z "${DISTILL_LIBCUDNN:-}" ]; then
    dnn=$(first_file /usr/local/cuda/lib64/libcudnn.so.9 /usr/lib/x86_64-linux-gnu/libcudnn.so.9 \
         /usr/local/cuda-*/lib64/libcudnn.so.9 $(for s in $site; do echo "$s/nvidia/cudnn/lib/libcudnn.so.9 $s/nvidia/*/lib/libcudnn.so.9"; done))
    [ -n "$dnn" ] && export DISTILL_LIBCUDNN=$dnn LD_LIBRARY_PATH="$(dirname "$dnn"):$LD_LIBRARY_PATH"
  fi
}

status() { echo "$1 $2" >>"$OUT/status.txt"; }

start=$(date +%s)
budget=${SUITE_BUDGET:-560} # attn-issue: 360 unless SUITE_BUDGET is set (below)
deadline=$((start + budget))
last_rc=0 # the last step's rc, or "skipped"

# step NAME LIMIT_S CMD...: runs CMD in $STEP_DIR (default compute/cuda,
# where its tests find their testdata) with a time limit (LIMIT_S, or less
# when the suite's budget is running out), logging to $OUT/NAME.log.
step() {
  local name=$1 limit=$2; shift 2
  local left=$((deadline - $(date +%s) - 10))
  if [ "$left" -lt 30 ]; then
    status "$name" "skipped (suite budget spent: run it in another call)"
    echo "== $name skipped: ${left}s left of the suite's budget" | tee -a "$OUT/steps.txt"
    last_rc=skipped
    return 0
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "== $name ($(date -u +%T), limit ${limit}s): $*" | tee -a "$OUT/steps.txt"
  ( cd "$root/${STEP_DIR:-compute/cuda}" && timeout --signal=INT --kill-after=20 "$limit" "$@" ) >"$OUT/$name.log" 2>&1
  local rc=$?
  last_rc=$rc
  status "$name" "$rc"
  echo "   rc=$rc" | tee -a "$OUT/steps.txt"
  return 0
}

s_env() {
  {
    date -u
    nvidia-smi 2>&1 | head -20
    echo "--- libraries"
    echo "DISTILL_LIBNVRTC=${DISTILL_LIBNVRTC:-}"
    echo "DISTILL_LIBCUBLASLT=${DISTILL_LIBCUBLASLT:-}"
    echo "DISTILL_LIBCUDNN=${DISTILL_LIBCUDNN:-}"
    echo "DISTILL_LIBNCCL=${DISTILL_LIBNCCL:-}"
    ldconfig -p 2>/dev/null | grep -E 'libcuda.so|libnvrtc|libcublasLt|libcudnn.so' | head -16
    command -v compute-sanitizer nvcc ncu || true
    nvcc --version 2>/dev/null | tail -2
    echo "--- python"
    $PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "transformers", transformers.__version__, torch.cuda.get_device_name())' 2>&1
    echo "--- cuBLASLt: version and grouped GEMM (CUBLASLT_BATCH_MODE_GROUPED, for MoE experts sized on the device)"
    # The system's and PyTorch's wheel's, which may be newer: the version
    # (cublasLtGetVersion) and whether the grouped layouts exist.
    for lt in "${DISTILL_LIBCUBLASLT:-}" $($PY -c 'import nvidia.cublas, os; d = os.path.join(list(nvidia.cublas.__path__)[0], "lib"); print(" ".join(os.path.join(d, f) for f in os.listdir(d) if f.startswith("libcublasLt.so")))' 2>/dev/null); do
      [ -n "$lt" ] && [ -e "$lt" ] || continue
      $PY - "$lt" <<'PYEOF' 2>&1
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.cublasLtGetVersion.restype = ctypes.c_size_t
print(sys.argv[1], "version", lib.cublasLtGetVersion(), "grouped layouts:", hasattr(lib, "cublasLtGroupedMatrixLayoutCreate"))
PYEOF
    done
    echo "--- binary"
    ls -la "$root/.gpu" "$BIN" "$BIN/lib" 2>&1
    ldd "$T" 2>&1
  } >"$OUT/env.log" 2>&1
  status env 0
}

# The goldens (TestForwardGoldens) run in the goldens step, after HF's BF16
# figures, which bound them, exist.
s_test() {
  step test 180 "$T" -test.v -test.count=1 -test.timeout=170s \
    -test.run 'Conformance|Ties|TestSuite$|Exact|KernelsCompile|NVRTCCompiles|AttnPlanKernel|BenchModel|MemoryOps|Probe|Launch|Plan|Cache|Arch|DeviceBytes|ScratchBytes|Cudnn'
}

# hf_env runs "$@" with DISTILL_HF_GOLDENS set where the goldens step's HF
# figures exist (TestForwardGoldens then holds the teacher to them).
hf_env() {
  if compgen -G "$OUT/hf-goldens/*.vs-fp32.json" >/dev/null; then
    DISTILL_HF_GOLDENS="$OUT/hf-goldens" "$@"
  else
    "$@"
  fi
}

s_device() {
  STEP_DIR=compute/device step device 60 "$BIN/device.test" -test.v -test.count=1 -test.timeout=50s
}

# The training kernels' tests (train_test.go) and the contract's suite.
train_tests='TestSuite$|AdamWConformance|ReductionsConformance|FakeQuantNVFP4Exact|MatMulBackwardConformance|LayerBackwardConformance|EmbedBackwardOrder|AttentionBackwardConformance|AttentionBackwardBF16DV|AttentionBackwardBF16Dout|MatMulBackwardBF16DX|CudnnAttentionConformance|LossHeadConformance|LossCoefDevice|StagingRing|MoERoutingWaits|MoETrainConformance|MoEFrozenBackward|MoELoRAHostGrouping|DropoutMatchesCPU|DeferredZero|KernelsCompile'

s_train-test() {
  # 150 s: on a fresh machine its TestKernelsCompile compiles every
  # kernel (57 s on the H200, 2026-11-28), when no step before did.
  step train-test 150 "$T" -test.v -test.count=1 -test.timeout=145s -test.run "$train_tests"
}

s_train-memcheck() {
  if ! command -v compute-sanitizer >/dev/null; then echo "no compute-sanitizer" >"$OUT/train-memcheck.log"; status train-memcheck skipped; return; fi
  step train-memcheck 70 compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 50 \
    "$T" -test.count=1 -test.timeout=65s -test.run "${train_tests%|KernelsCompile}"
}

s_train-curve() {
  DISTILL_BENCH_OUT="$OUT" STEP_DIR=train/trainer step train-curve 50 "$TT" -test.v -test.count=1 -test.timeout=45s \
    -test.run 'TestCUDALossCurve|TestTrainingDevice'
}

s_train-qad() {
  STEP_DIR=train step train-qad 45 "$BIN/train.test" -test.v -test.count=1 -test.timeout=40s -test.run 'TestCUDAQADExport|TestCUDALoRA|TestCUDAGradsInBF16|TestCUDAStepConversions|TestCUDADeferredZeros'
}

s_train-resume() {
  STEP_DIR=train/trainer step train-resume 80 "$TT" -test.v -test.count=1 -test.timeout=75s -test.run 'TestCUDAResume|TestCUDAMoEStudent|TestCUDALoRAMoE|TestCUDAHostWaits'
}

# TRAIN_BENCH_FLAGS: more flags for the benchmark binary (e.g.
# "-test.cpuprofile $OUT/train-cpu.pprof -test.benchtime 4x": where the
# host's time goes in the steps).
s_train-bench() {
  DISTILL_BENCH_OUT="$OUT" STEP_DIR=train/trainer step train-bench 170 "$TT" -test.run '^$' -test.bench 'CUDATrainStep$' \
    -test.benchtime 1x -test.timeout 165s ${TRAIN_BENCH_FLAGS:-}
}

# loss-coef: the loss head's training call (0.6B shape) with pass 2's
# coefficients on the host and on the device (issue 23), on the same GPU
# in the same run: ms a call, and the GPU's idle ms inside one profiled
# call (BenchmarkLossHeadCoef: the host round trip the device path removes).
s_loss-coef() {
  step loss-coef 60 "$T" -test.run '^$' -test.bench 'LossHeadCoef' -test.benchtime 5x -test.timeout 55s
}

# train-zero: the sharded student's step (ZeRO 2 and 3, DISTILL_BENCH_ZERO)
# on a real NCCL group of one rank against the unsharded step in the same
# run (the median of 5 steps each; the "ZeRO overhead" lines: against the
# mean of the unsharded step timed first and last, base_drift_% its
# noise), and its device memory against the plan (issue 25);
# each stage with and without the overlap (zeroN-overlap),
# TestCUDAShardedOverlap: the overlap's bits equal the run without it, and
# TestCUDAShardedBF16Gathers: stage 2's and 3's BF16 gathers (real NCCL's
# in-place ncclBfloat16 all-gather; the GEMMs reading the gathered BF16
# weights, at their offsets' alignment) end with the fp32 gathers' bits, at
# half the bytes; QAD keeps fp32 gathers (TestCUDAShardedQADGathersFP32).
s_train-zero() {
  STEP_DIR=train/trainer step train-zero 200 "$TT" -test.run '^$' -test.bench 'CUDATrainStepZeRO' \
    -test.benchtime 5x -test.timeout 195s
  STEP_DIR=train step train-zero-overlap 60 "$BIN/train.test" -test.v -test.count=1 -test.timeout 55s -test.run 'TestCUDAShardedOverlap'
  STEP_DIR=train step train-zero-bf16 60 "$BIN/train.test" -test.v -test.count=1 -test.timeout 55s -test.run 'TestCUDAShardedBF16Gathers|TestCUDAShardedQADGathersFP32'
  # A one-rank job (a process of its own, NCCL for real) at ZeRO 0 to 3.
  STEP_DIR=train/trainer step train-zero-ranks 90 "$TT" -test.v -test.count=1 -test.timeout 85s -test.run 'TestCUDADataParallelOneRank'
}

s_train-peer() {
  local shapes=()
  [ -n "${DISTILL_BENCH_SHAPES:-}" ] && IFS=, read -r -a shapes <<<"$DISTILL_BENCH_SHAPES"
  step train-peer 100 $PY "$root/scripts/gpu/hf_train_bench.py" "${shapes[@]}"
}

# cli: the student command itself on the GPU (scripts/gpu/student_cli.sh),
# in a fresh directory with its own copy of the bundle's cli-cache. With
# DISTILL_GPU_SUITE_EMU=1 the command's CUDA libraries are the emulator's
# (as cudaemu.Use points a test's at it; clifixture builds it from this
# source tree, which needs go and g++).
s_cli() {
  if [ ! -x "$BIN/student" ] || [ ! -d "$BIN/cli-cache" ]; then
    echo "no $BIN/student or $BIN/cli-cache: $BIN was unpacked from a bundle without them; remove $BIN (or set DISTILL_GPU_BIN to a new directory) and run again" >"$OUT/cli.log"
    status cli 1
    last_rc=1
    return 0
  fi
  if [ "${DISTILL_GPU_SUITE_EMU:-}" = 1 ]; then
    local lib
    if ! lib=$(cd "$root" && go run ./scripts/gpu/clifixture emu-lib 2>"$OUT/cli.log"); then
      status cli 1
      last_rc=1
      return 0
    fi
    local -x DISTILL_LIBCUDA=$lib DISTILL_LIBNVRTC=$lib DISTILL_LIBCUBLASLT=$lib DISTILL_LIBCUDNN=$lib DISTILL_LIBNCCL=$lib
  fi
  local work
  work=$(mktemp -d "${TMPDIR:-/tmp}/distill-cli.XXXXXX") || { status cli 1; last_rc=1; return 0; }
  cp -r "$BIN/cli-cache" "$work/cache"
  STEP_DIR=cmd/student step cli 90 bash "$root/scripts/gpu/student_cli.sh" "$BIN/student" "$work/cache" "$work"
  rm -rf "$work"
}

s_memcheck() {
  if ! command -v compute-sanitizer >/dev/null; then echo "no compute-sanitizer" >"$OUT/memcheck.log"; status memcheck skipped; return; fi
  hf_env step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 50 \
    "$T" -test.count=1 -test.timeout=140s -test.run 'Conformance|Ties|TestSuite$|Exact|AttnPlanKernel|BenchModel|MemoryOps|ForwardGoldens'
}

# DISTILL_RACECHECK=1: the attention tests run smaller cases that still
# reach every one of this package's attention kernels (conformance_test.go,
# underRacecheck); DISTILL_CUDA_ATTN=mma keeps cuDNN (closed source) from
# loading, and -test.skip any cuDNN subtest.
s_racecheck() {
  if ! command -v compute-sanitizer >/dev/null; then echo "no compute-sanitizer" >"$OUT/racecheck.log"; status racecheck skipped; return; fi
  DISTILL_RACECHECK=1 DISTILL_CUDA_ATTN=mma step racecheck 150 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 3 --print-limit 50 \
    "$T" -test.v -test.count=1 -test.timeout=140s -test.skip '/cudnn' \
    -test.run 'TestAttentionConformance|TestLMHeadTopKTies|TestAttnPlanKernel|TestMoERoutingTies|TestAttentionBackwardConformance|TestLossHeadConformance|TestReductionsConformance|TestMoETrainConformance'
}

s_nccl() {
  DISTILL_NCCL_TIMEOUT=${DISTILL_NCCL_TIMEOUT:-60s} step nccl 120 "$T" -test.v -test.count=1 -test.timeout=115s -test.run 'NCCL'
}

s_goldens() {
  step hf-goldens 90 $PY "$root/scripts/gpu/hf_goldens.py" "$OUT/hf-goldens" "$root"/infer/testdata/golden/*
  DISTILL_HF_GOLDENS="$OUT/hf-goldens" step goldens 60 "$T" -test.v -test.count=1 -test.timeout=55s -test.run 'ForwardHFGoldens|ForwardGoldens'
}

s_pipe() {
  DISTILL_BENCH_OUT="$OUT" step pipe 240 "$T" -test.v -test.count=1 -test.run 'TestPipelineGoldens' \
    -test.bench 'PipelineOneGPU' -test.benchtime 5x -test.timeout 235s
}

# BENCH_FLAGS: more flags for the benchmark binary (e.g. "-test.cpuprofile
# $OUT/fwd-cpu.pprof": where the host's time goes around the forwards; the
# profile files give each forward's time outside the kernels' span).
s_bench() {
  DISTILL_BENCH_OUT="$OUT" step bench 240 "$T" -test.run '^$' -test.bench 'GEMM|LMHead|Forward$|RMSNormBackward' \
    -test.benchtime 3x -test.timeout 235s ${BENCH_FLAGS:-}
}

s_moe() {
  step moe-test 60 "$T" -test.v -test.count=1 -test.timeout 55s -test.run 'TestMoEGrouped|TestMoEFP8Grouped|TestMoEFrozenBackward|TestMoEConformance|TestMoELoRA'
  step moe-bench 150 "$T" -test.run '^$' -test.bench '^BenchmarkMoE$' -test.benchtime 3x -test.timeout 145s
}

# fp8: the FP8 teacher weights' tests on the GPU, then FP8 against BF16
# in the teacher's forward (BenchmarkForwardFP8; the Qwen3-8B shape unless
# DISTILL_BENCH_SHAPES names others), with one profiled forward of each
# (profile-<shape>-bf16.txt, profile-<shape>-fp8.txt).
s_fp8() {
  step fp8-test 100 "$T" -test.v -test.count=1 -test.timeout=95s -test.run 'FP8'
  DISTILL_BENCH_OUT="$OUT" step fp8-bench 150 "$T" -test.run '^$' -test.bench '^BenchmarkForwardFP8$' -test.benchtime 3x -test.timeout 145s
}

# attn: BenchmarkAttention (attn-bench.log, attn-bench.jsonl), PyTorch's
# SDPA on the same shapes (attn-peer.log, sdpa-bench.json), and the table
# of both (attn.log); status attn is the first failing rc of the two.
s_attn() {
  local iters=${SDPA_ITERS:-10} rc=0
  rm -f "$OUT/attn-bench.jsonl" "$OUT/sdpa-bench.json"
  DISTILL_BENCH_OUT="$OUT" step attn-bench 150 "$T" -test.v -test.run '^$' -test.bench '^BenchmarkAttention$' \
    -test.benchtime "${iters}x" -test.timeout 145s
  [ "$last_rc" != 0 ] && rc=$last_rc
  step attn-peer 120 $PY "$root/scripts/gpu/sdpa_bench.py" "$OUT/sdpa-bench.json" "$iters"
  [ "$rc" = 0 ] && [ "$last_rc" != 0 ] && rc=$last_rc
  {
    $PY "$root/scripts/gpu/attn_table.py" "$OUT/attn-bench.jsonl" "$OUT/sdpa-bench.json"
    echo "-- ours (go test -bench), then PyTorch's lines"
    grep -E '^(Benchmark|--- (SKIP|FAIL))|bench_test.go:|panic:' "$OUT/attn-bench.log"
    grep -E '^\{' "$OUT/attn-peer.log"
  } >"$OUT/attn.log" 2>&1
  status attn "$rc"
}

s_peer() {
  if [ ! -f "$OUT/workloads.json" ]; then # the bench step ran in another call
    ( cd "$root/compute/cuda" && DISTILL_BENCH_OUT="$OUT" "$T" -test.run 'TestWriteWorkloads' ) >"$OUT/workloads.log" 2>&1
  fi
  local shapes=()
  [ -n "${DISTILL_BENCH_SHAPES:-}" ] && IFS=, read -r -a shapes <<<"$DISTILL_BENCH_SHAPES"
  step peer 240 $PY "$root/scripts/gpu/hf_bench.py" "$OUT/workloads.json" "${shapes[@]}"
}

summary() {
  {
    echo "== compute/cuda GPU suite, $(date -u)"
    grep -m1 -E 'NVIDIA|H100|H200' "$OUT/env.log" 2>/dev/null
    echo "-- steps (rc 0 = passed; 124 = its time limit; skipped = run it in another call)"
    cat "$OUT/status.txt" 2>/dev/null
    for f in test device goldens attn-bench memcheck racecheck nccl fp8-test pipe train-test train-memcheck train-curve train-qad train-resume train-zero-ranks; do
      [ -f "$OUT/$f.log" ] || continue
      echo "-- $f: failures"
      grep -E '^\s*--- FAIL|^FAIL|panic:|ERROR SUMMARY|========= (Invalid|Race|Error)' "$OUT/$f.log" | head -20
    done
    echo "-- attention implementation (what the backend reports)"
    grep -hE 'attention runs' "$OUT/attn-bench.log" 2>/dev/null | sed 's/^ *//' | sort -u | head -8
    echo "-- agreement with goldens (ours, HF BF16's, the bounds; then ours vs HF's goldens)"
    grep -hE 'vs HF BF16|T=[0-9.]+: (top-1|HF BF16 vs fp32|bounds|no HF BF16)' "$OUT/goldens.log" 2>/dev/null | sed 's/^ *//' | head -80
    echo "-- attention: ours vs PyTorch SDPA (TFLOP/s; ratio > 1: ours faster)"
    cat "$OUT/attn.log" 2>/dev/null | head -60
    echo "-- NCCL (the real library; 2 and 3 ranks on one GPU: NCCL's refusal)"
    grep -hE -- '--- (PASS|FAIL|SKIP): TestNCCL|NCCL refused|Duplicate GPU' "$OUT/nccl.log" 2>/dev/null | sed 's/^ *//' | head -20
    echo "-- pipelined teacher, two stages on one GPU (exactness; tokens/s, overhead against one stage)"
    grep -hE -- '--- (PASS|FAIL): TestPipelineGoldens|^BenchmarkPipelineOneGPU' "$OUT/pipe.log" 2>/dev/null
    cat "$OUT/pipeline-bench.jsonl" 2>/dev/null
    echo "-- device chooser"
    grep -hE 'device auto|--- (PASS|FAIL)' "$OUT/device.log" 2>/dev/null | head -10
    echo "-- largest errors of the conformance tests"
    grep -hE 'max \|Δ\| = .* of the tolerance' "$OUT/test.log" 2>/dev/null |
      sed -E 's/^ *[a-z_]+\.go:[0-9]+: (.*): max \|Δ\| = ([^ ]+) over ([0-9]+) values \(([0-9.]+) of the tolerance (.*)\)$/\4 of tolerance: \1: max |Δ| \2 over \3 values, \5/' |
      sort -rn | head -15
    echo "-- benchmarks"
    grep -E '^Benchmark' "$OUT/bench.log" 2>/dev/null
    echo "-- the experts' grouped GEMMs: default vs v1 (bits, then ms a call and TFLOP/s)"
    grep -hE -- '--- (PASS|FAIL): TestMoE|default vs v1|want' "$OUT/moe-test.log" 2>/dev/null | sed 's/^ *//' | head -12
    grep -hE '^BenchmarkMoE|^--- (FAIL|SKIP)' "$OUT/moe-bench.log" 2>/dev/null
    echo "-- FP8 teacher weights: vs the CPU's FP8, then FP8 against BF16 (tokens/s, speed-up, weights GiB)"
    grep -hE 'fp8 (matmul|moe) vs cpu: max|vs FP8 cpu|FP8 (MatMul|MoE|forward)' "$OUT/fp8-test.log" 2>/dev/null | sed 's/^ *//' | head -30
    grep -hE '^BenchmarkForwardFP8|^--- (FAIL|SKIP)' "$OUT/fp8-bench.log" 2>/dev/null
    echo "-- HF peer"
    cat "$OUT/peer.log" 2>/dev/null | grep '^{'
    echo "-- training: loss curves, GPU vs CPU (worst relative difference)"
    grep -hE 'steps: loss .* worst relative difference' "$OUT/train-curve.log" "$OUT/train-resume.log" 2>/dev/null | sed 's/^ *//'
    echo "-- training: NVFP4 export of a GPU run"
    grep -hE 'bit for bit|--- (PASS|FAIL): TestCUDAQADExport' "$OUT/train-qad.log" 2>/dev/null | sed 's/^ *//'
    echo "-- training: resume exactness"
    grep -hE -- '--- (PASS|FAIL): (TestCUDAResume|TestCUDAMoEStudent|TestCUDALoRAMoE)' "$OUT/train-resume.log" 2>/dev/null
    echo "-- training: one-rank jobs on NCCL at ZeRO 0 to 3"
    grep -hE -- '--- (PASS|FAIL): TestCUDADataParallelOneRank|1 ranks: step' "$OUT/train-zero-ranks.log" 2>/dev/null | sed 's/^ *//'
    echo "-- training benchmark (ours, then the PyTorch peer)"
    grep -hE '^BenchmarkCUDATrainStep|^ZeRO overhead' "$OUT/train-bench.log" "$OUT/train-zero.log" 2>/dev/null
    grep -hE '^BenchmarkLossHeadCoef' "$OUT/loss-coef.log" 2>/dev/null
    cat "$OUT/train-bench.jsonl" 2>/dev/null
    grep '^{' "$OUT/train-peer.log" 2>/dev/null
    echo "-- the student command on the GPU (train, SIGTERM and resume, export, eval)"
    grep -hE '^(ok|FAIL): |^no ' "$OUT/cli.log" 2>/dev/null
    echo "-- top kernels"
    cat "$OUT"/profile-*.txt 2>/dev/null | head -120
  } >"$OUT/summary.txt" 2>&1
  cat "$OUT/summary.txt"
}

case "${1:-}" in
  build) build ;;
  run)
    shift
    if [ ! -x "$T" ]; then
      [ -f "$root/.gpu/bundle.tar.gz" ] || { echo "no .gpu/bundle.tar.gz: run 'bash scripts/gpu-suite.sh build' first and carry .gpu"; exit 2; }
      mkdir -p "$BIN" && tar -C "$BIN" -xzf "$root/.gpu/bundle.tar.gz" || { echo "cannot unpack .gpu/bundle.tar.gz into $BIN"; exit 2; }
    fi
    mkdir -p "$OUT"
    : >"$OUT/status.txt"
    libs
    steps=()
    for s in "$@"; do
      case "$s" in
        all) steps+=(env test device goldens attn memcheck bench peer racecheck nccl fp8 moe pipe train-test train-memcheck train-curve train-qad train-resume train-bench loss-coef train-zero train-peer cli) ;;
        train) steps+=(env train-test train-curve train-qad train-resume cli train-memcheck train-bench loss-coef train-peer) ;;
        attn-issue)
          steps+=(env test attn goldens train-test train-resume train-bench train-peer)
          [ -z "${SUITE_BUDGET:-}" ] && deadline=$((start + 360))
          export DISTILL_BENCH_SHAPES=${DISTILL_BENCH_SHAPES:-qwen3-0.6b}
          ;;
        *) steps+=("$s") ;;
      esac
    done
    [ ${#steps[@]} -eq 0 ] && steps=(env test device goldens attn memcheck bench peer racecheck)
    for s in "${steps[@]}"; do
      case "$s" in
        env|test|device|memcheck|racecheck|nccl|pipe|goldens|attn|bench|fp8|moe|peer|train-test|train-memcheck|train-curve|train-qad|train-resume|train-bench|loss-coef|train-zero|train-peer|cli) "s_$s" ;;
        *) echo "unknown step $s"; exit 2 ;;
      esac
    done
    summary
    ;;
  *) sed -n '2,110p' "$0"; exit 2 ;;
esac
