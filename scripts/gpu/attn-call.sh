#!/usr/bin/env bash
# One device call for the cuDNN attention work (issue 22): the GPU suite's
# steps that answer it, on the newest cuDNN on the machine (the PyTorch
# wheel's, the one its SDPA peer runs on), then the cuDNN tests again on the
# system's cuDNN (an older 9.x), with cuDNN's own error log. Every log goes
# into one tarball under $OUT (the device tool returns at most 8 files);
# the summary is printed last.
#
#   bash scripts/gpu-suite.sh build
#   run(command="bash scripts/gpu/attn-call.sh [STEP...]", carry=[".gpu"], timeout_s=480)
#
# STEP... defaults to: env test attn goldens train-test train-resume train-bench
# (training shapes: DISTILL_BENCH_SHAPES, default qwen3-0.6b); any of the
# suite's steps may be named, e.g. cli (the student command itself on the
# GPU: train, SIGTERM and resume, export, eval). Then, when
# set: FORWARD_BENCH=1 runs the suite's bench and peer steps (the teacher's
# forward against HF transformers; FORWARD_SHAPES picks the shapes,
# FORWARD_STEPS=bench leaves out the peer),
# FP8=1 runs the suite's fp8 step (FP8 teacher weights, issue 29: the FP8
# tests on the GPU and BenchmarkForwardFP8, FP8 against BF16 tokens/s at
# the Qwen3-8B shape unless FP8_SHAPES says otherwise; FP8_BUDGET seconds,
# default 200),
# EXTRA_TESTS=PATTERN runs the matching tests of the cuda, train and
# trainer test binaries on the GPU (EXTRA_BUDGET seconds each, default 60:
# TestKernelsCompile alone took 57 s on the H200's host), EXTRA_BENCH=PATTERN the matching
# benchmarks of the cuda test binary (3 iterations, EXTRA_BENCH_BUDGET
# seconds, default 90), MEMCHECK_TESTS=PATTERN the matching
# tests of the cuda test binary under compute-sanitizer memcheck, SANITIZE=1 runs the
# attention tests (own kernels and cuDNN) under compute-sanitizer memcheck
# and the own kernels' under racecheck, ACT_COMPARE=1 runs the training
# benchmark again (and with FORWARD_BENCH=1 the forward one) with fp32
# activations (DISTILL_CUDA_ACT=f32): the BF16 activations' effect, side by
# side on the same device (ACT_BUDGET seconds, default 150; ACT_SHAPES the
# training shapes, default DISTILL_BENCH_SHAPES; ACT_FWD=0 leaves out the
# forward's).
set -uo pipefail
cd "$(dirname "$0")/../.."
final=${OUT:-$PWD/gpu-out}
work=$(mktemp -d)
mkdir -p "$final"
PY=${PYTHON:-python3}
site=$($PY -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)
wheel=""
for s in $site; do
  for f in "$s"/nvidia/cudnn/lib/libcudnn.so.9 "$s"/nvidia/*/lib/libcudnn.so.9; do
    [ -e "$f" ] && { wheel=$f; break 2; }
  done
done
system=$(ldconfig -p 2>/dev/null | awk '/libcudnn.so.9 / {print $NF; exit}')
{
  echo "wheel cuDNN: ${wheel:-none}"; echo "system cuDNN: ${system:-none}"
  ls -la "$(dirname "${wheel:-/nonexistent}")" 2>&1 | head -20
} >"$work/cudnn-libs.txt"
if [ -n "$wheel" ]; then
  export DISTILL_LIBCUDNN=$wheel
  # The wheel's other CUDA libraries (cuBLAS, NVRTC) beside it.
  for d in $(dirname "$wheel") $(for s in $site; do ls -d "$s"/nvidia/*/lib 2>/dev/null; done); do
    LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
  done
  export LD_LIBRARY_PATH
fi
export CUDNN_LOGLEVEL_DBG=1 CUDNN_LOGDEST_DBG="$work/cudnn-errors.log"
# The suite's test binaries and kernel cache (gpu-suite.sh's defaults), and
# the tests' target: the GPU, or the emulator in a dry run
# (DISTILL_GPU_SUITE_EMU=1, examples/gpusuite_test.go).
gpubin=${DISTILL_GPU_BIN:-/tmp/distill-gpu-bin}
kcache=${DISTILL_KERNEL_CACHE:-/tmp/distill-kernel-cache}
target=gpu
[ "${DISTILL_GPU_SUITE_EMU:-}" = 1 ] && target=""
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env test attn goldens train-test train-resume train-bench)
OUT="$work" DISTILL_BENCH_SHAPES=${DISTILL_BENCH_SHAPES:-qwen3-0.6b} SUITE_BUDGET=${SUITE_BUDGET:-300} \
  bash scripts/gpu-suite.sh run "${steps[@]}" >"$work/suite.txt" 2>&1
if [ "${FORWARD_BENCH:-}" = 1 ]; then
  mkdir -p "$work/fwd"
  OUT="$work/fwd" DISTILL_BENCH_SHAPES=${FORWARD_SHAPES:-${DISTILL_BENCH_SHAPES:-}} SUITE_BUDGET=${FORWARD_BUDGET:-120} \
    bash scripts/gpu-suite.sh run ${FORWARD_STEPS:-bench peer} >"$work/fwd/suite.txt" 2>&1
fi
if [ "${FP8:-}" = 1 ]; then
  mkdir -p "$work/fp8"
  OUT="$work/fp8" DISTILL_BENCH_SHAPES=${FP8_SHAPES:-qwen3-8b} SUITE_BUDGET=${FP8_BUDGET:-200} \
    bash scripts/gpu-suite.sh run fp8 >"$work/fp8/suite.txt" 2>&1
  cat "$work/fp8/status.txt" >>"$work/status.txt" 2>/dev/null
fi
if [ "${ACT_COMPARE:-}" = 1 ]; then
  mkdir -p "$work/act-f32" "$work/act-f32/fwd"
  OUT="$work/act-f32" DISTILL_CUDA_ACT=f32 DISTILL_BENCH_SHAPES=${ACT_SHAPES:-${DISTILL_BENCH_SHAPES:-qwen3-0.6b}} SUITE_BUDGET=${ACT_BUDGET:-150} \
    bash scripts/gpu-suite.sh run train-bench >"$work/act-f32/suite.txt" 2>&1
  if [ "${FORWARD_BENCH:-}" = 1 ] && [ "${ACT_FWD:-1}" = 1 ]; then # the forward's shapes, as above
    OUT="$work/act-f32/fwd" DISTILL_CUDA_ACT=f32 DISTILL_BENCH_SHAPES=${FORWARD_SHAPES:-${DISTILL_BENCH_SHAPES:-}} SUITE_BUDGET=${FORWARD_BUDGET:-120} \
      bash scripts/gpu-suite.sh run bench >"$work/act-f32/fwd/suite.txt" 2>&1
  fi
fi
# TRAIN_VARIANTS="name:VAR=value[,VAR=value] ...": the training benchmark
# again under each variant's environment (e.g. nondet:DISTILL_CUDNN_NONDETERMINISTIC=1,
# or f32grads:DISTILL_CUDA_F32_GRADS=1: the backward's F32 gradients and
# their BF16 rounding passes, as before issue 23's BF16 gradients; or
# pageable:DISTILL_CUDA_PAGEABLE=1: uploads from Go's pageable memory and
# the loss values downloaded when read, not staged in pinned memory; or
# eager:DISTILL_CUDA_EAGER_ZEROS=1: a memset for every Zero and the
# backward adding to the zeroed gradients, as before the deferred zeros; or
# ragged:DISTILL_CUDNN_RAGGED=1: cuDNN's attention through the ragged graph
# for the benchmark's one-sample rows too, as before the fixed-length graph;
# or logits:DISTILL_CUDA_RECOMPUTE_LOGITS=1: the loss head's pass 2
# computing its logits again, as before they were kept), on
# DISTILL_BENCH_SHAPES, each into variant-NAME/ (VARIANT_BUDGET seconds
# each, default 60).
# A variant named NAME/STEP runs that suite step instead of train-bench
# (e.g. z3round/train-zero:DISTILL_ZERO3_ROUND_PER_GATHER=1).
for v in ${TRAIN_VARIANTS:-}; do
  name=${v%%:*}
  vstep=train-bench
  case $name in */*) vstep=${name#*/}; name=${name%%/*} ;; esac
  mkdir -p "$work/variant-$name"
  ( IFS=,; for kv in ${v#*:}; do export "$kv"; done
    OUT="$work/variant-$name" SUITE_BUDGET=${VARIANT_BUDGET:-60} bash scripts/gpu-suite.sh run "$vstep" ) >"$work/variant-$name/suite.txt" 2>&1
  echo "variant-$name $(tail -1 "$work/variant-$name/status.txt" 2>/dev/null | awk '{print $NF}')" >>"$work/status.txt"
done
if [ -n "${EXTRA_TESTS:-}" ]; then # a -test.run pattern for cuda.test, then the same for train.test, trainer.test and decoder.test
  for b in cuda:compute/cuda train:train trainer:train/trainer decoder:model/decoder; do
    ( cd "${b#*:}" && DISTILL_CUDA_TEST=$target DISTILL_KERNEL_CACHE=$kcache timeout ${EXTRA_BUDGET:-60} $gpubin/${b%%:*}.test \
        -test.v -test.count=1 -test.run "$EXTRA_TESTS" -test.timeout $(( ${EXTRA_BUDGET:-60} - 5 ))s ) >"$work/extra-${b%%:*}.log" 2>&1
    echo "extra-${b%%:*} rc=$?" >>"$work/status.txt"
  done
fi
if [ -n "${EXTRA_BENCH:-}" ]; then # a -test.bench pattern for cuda.test (3 iterations; EXTRA_BENCH_BUDGET seconds, default 90)
  ( cd compute/cuda && DISTILL_CUDA_TEST=$target DISTILL_KERNEL_CACHE=$kcache DISTILL_BENCH_OUT="$work" timeout ${EXTRA_BENCH_BUDGET:-90} \
      $gpubin/cuda.test -test.run '^$' -test.bench "$EXTRA_BENCH" -test.benchtime 3x -test.timeout $(( ${EXTRA_BENCH_BUDGET:-90} - 5 ))s ) >"$work/extra-bench.log" 2>&1
  echo "extra-bench rc=$?" >>"$work/status.txt"
fi
if [ -n "${MEMCHECK_TESTS:-}" ] && command -v compute-sanitizer >/dev/null; then # a -test.run pattern for cuda.test under memcheck
  ( cd compute/cuda && DISTILL_CUDA_TEST=$target DISTILL_KERNEL_CACHE=$kcache timeout 90 \
      compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 $gpubin/cuda.test -test.v -test.count=1 \
      -test.run "$MEMCHECK_TESTS" -test.timeout 85s ) >"$work/extra-memcheck.log" 2>&1
  echo "extra-memcheck rc=$?" >>"$work/status.txt"
fi
attn_tests='TestAttentionConformance|TestAttentionBackwardConformance|TestAttentionMMASteps|TestCudnnAttentionConformance'
if [ "${SANITIZE:-}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  ( cd compute/cuda && DISTILL_CUDA_TEST=$target DISTILL_RACECHECK=1 DISTILL_KERNEL_CACHE=$kcache timeout 75 \
      compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 $gpubin/cuda.test -test.v -test.count=1 \
      -test.run "$attn_tests" -test.timeout 70s ) >"$work/attn-memcheck.log" 2>&1
  echo "attn-memcheck rc=$?" >>"$work/status.txt"
  ( cd compute/cuda && DISTILL_CUDA_TEST=$target DISTILL_RACECHECK=1 DISTILL_CUDA_ATTN=mma DISTILL_KERNEL_CACHE=$kcache timeout 90 \
      compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 3 --print-limit 20 $gpubin/cuda.test -test.v \
      -test.count=1 -test.run 'TestAttentionConformance|TestAttentionBackwardConformance|TestAttentionMMASteps' -test.skip '/cudnn' \
      -test.timeout 85s ) >"$work/attn-racecheck.log" 2>&1
  echo "attn-racecheck rc=$?" >>"$work/status.txt"
fi
if [ -n "$system" ] && [ "$system" != "$wheel" ] && [ "${SKIP_SYSTEM_CUDNN:-}" != 1 ]; then
  ( cd compute/cuda && DISTILL_LIBCUDNN=$system CUDNN_LOGDEST_DBG="$work/cudnn-errors-system.log" DISTILL_CUDA_TEST=$target \
      DISTILL_KERNEL_CACHE=$kcache timeout 40 $gpubin/cuda.test -test.v -test.count=1 \
      -test.run 'TestCudnn' -test.timeout 35s ) >"$work/cudnn-system.log" 2>&1
  echo "cudnn-system rc=$?" >>"$work/status.txt"
fi
tar -C "$work" -czf "$final/logs.tgz" .
cat "$work/summary.txt" 2>/dev/null | head -150
if [ -f "$work/fwd/summary.txt" ]; then
  echo "== forward benchmarks"; cat "$work/fwd/status.txt"; grep -E '^Benchmark' "$work/fwd/bench.log"; grep -E '^\{' "$work/fwd/peer.log"
fi
if [ -d "$work/fp8" ]; then
  echo "== FP8 teacher weights"
  sed -n '/^-- FP8 teacher weights/,/^-- HF peer/p' "$work/fp8/summary.txt" | grep -v '^-- HF peer'
  grep -E '^\s*--- FAIL|^FAIL|panic:' "$work/fp8/fp8-test.log" 2>/dev/null | head -10
fi
if [ -d "$work/act-f32" ]; then
  echo "== fp32 activations (DISTILL_CUDA_ACT=f32), same device"; cat "$work/act-f32/status.txt" 2>/dev/null
  grep -hE '^Benchmark' "$work/act-f32/train-bench.log" "$work/act-f32/fwd/bench.log" 2>/dev/null
fi
for d in "$work"/variant-*; do
  [ -d "$d" ] && { echo "== ${d##*/}"; grep -hE '^Benchmark|ZeRO overhead' "$d"/train-bench.log "$d"/train-zero.log 2>/dev/null; }
done
# The training step's BF16 rounding passes (each profile's last line), and
# a variant's beside them.
echo "== rounding passes"; grep -H '^rounding passes' "$work"/profile-train-*.txt "$work"/variant-*/profile-train-*.txt 2>/dev/null | sed "s|$work/||"
# The GPU's idle ms and the host waits of one step (each profile's first
# line, and the waits' call sites).
echo "== idle and host waits"; grep -HE 'GPU idle|^host wait:|^host timeline' "$work"/profile-train-*.txt "$work"/variant-*/profile-train-*.txt 2>/dev/null | sed "s|$work/||"
# Where a forward's time outside the GPU's span went (host timeline).
echo "== forward host timeline"; grep -HE 'outside the profiled span|^host timeline' "$work"/fwd/profile-*.txt "$work"/profile-qwen3-*.txt 2>/dev/null | sed "s|$work/||"
echo "== status"; cat "$work/status.txt"
[ -f "$work/extra-bench.log" ] && { echo "== extra benchmarks"; grep -E '^(Benchmark|--- FAIL|FAIL|panic)' "$work/extra-bench.log"; }
for f in attn-memcheck attn-racecheck extra-memcheck extra-cuda extra-train extra-trainer extra-decoder; do
  [ -f "$work/$f.log" ] && { echo "== $f"; grep -E '^(--- |ok|FAIL|panic)|ERROR SUMMARY|RACECHECK SUMMARY|========= (Invalid|Race|Error)' "$work/$f.log" | head -20; }
done
echo "== cuDNN lines"; grep -hE 'cuDNN|cudnn' "$work"/test.log "$work"/cudnn-system.log 2>/dev/null | grep -vE '^\s*cudnn_test.go:[0-9]+: cudnn attention' | head -30
echo "== system cuDNN"; grep -E '^(--- |ok|FAIL|panic)' "$work/cudnn-system.log" 2>/dev/null | head
echo "== cuDNN errors"; head -c 3000 "$work/cudnn-errors.log" 2>/dev/null
# The exit status says whether every step and extra run passed (each
# status line ends in its exit status, "0" or "rc=0").
awk '{ s = $NF; sub(/^rc=/, "", s); if (s != "0") bad = 1 } END { exit bad }' "$work/status.txt"
