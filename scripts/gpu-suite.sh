#!/usr/bin/env bash
# The GPU suite of compute/cuda (issue 15), in one command on a GPU machine.
#
# The GPU machine has no Go toolchain, so the test binary is built here first:
#
#   bash scripts/gpu-suite.sh build
#
# which builds the test binaries of compute/cuda (.gpu/cuda.test) and of
# the --device chooser, compute/device (.gpu/device.test), and copies the
# shared libraries they need beyond glibc (OpenBLAS and its Fortran
# runtime, for the CPU oracle) into .gpu/lib. .gpu/ is git-ignored; it is
# about 50 MB (the device tool carries at most 64 MiB). Then, through the
# device tool:
#
#   run(command="bash scripts/gpu-suite.sh run", carry=[".gpu"])
#
# (one call; the tracked files, checkpoints and goldens included, travel
# with the working tree). Every step writes its log to $OUT (./gpu-out when
# $OUT is unset); a step's failure does not stop the others; the last lines
# printed are the summary ($OUT/summary.txt). Steps, each under its own
# time limit, in order:
#
#   env        nvidia-smi, the CUDA libraries found, Python package versions
#   test       the conformance tests against the real GPU (DISTILL_CUDA_TEST=gpu):
#              every forward kernel vs compute/cpu on ragged shapes, the
#              contract's suite (computetest.RunForward: the forward half,
#              vs float64 formulas), the kernels compiled by the device's
#              NVRTC (sm_90a on Hopper), the golden checkpoints through
#              package infer (model/decoder's forward), the training
#              methods' refusal (issue 16)
#   device     the --device chooser on the real GPU: cuda and auto open it
#              for the teacher, training gets the CPU
#   goldens    HF transformers BF16 goldens (scripts/gpu/hf_goldens.py) and
#              the CUDA and CPU teachers compared with them
#   memcheck   compute-sanitizer --tool memcheck on the conformance tests
#   bench      GEMM, attention, LM-head and Qwen3-0.6B/1.7B/8B forward
#              benchmarks (tokens/s, TFLOP/s, MFU, device memory) and a
#              kernel profile per forward
#   peer       HF transformers on the same workloads (scripts/gpu/hf_bench.py)
#   racecheck  compute-sanitizer --tool racecheck on attention and the LM head
#
# A device command may run 10 minutes: the suite keeps to SUITE_BUDGET
# seconds (default 560) in all, giving each step what is left up to its own
# limit and skipping the steps that no longer fit; the summary lists them.
# `run STEP...` runs only those steps, in the order given: a second call
# such as `run racecheck peer` picks up what the first one skipped.
# Knobs: SUITE_BUDGET, DISTILL_BENCH_TOKENS (batch tokens, default 16384),
# DISTILL_BENCH_SHAPES (e.g. qwen3-0.6b,qwen3-8b), DISTILL_PEAK_TFLOPS.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

build() {
  set -e
  mkdir -p .gpu/lib
  go test -c -o .gpu/cuda.test ./compute/cuda
  go test -c -o .gpu/device.test ./compute/device
  # Libraries beyond glibc and libgcc that the binaries link (OpenBLAS ...).
  # (A rebuild finds the copies already in .gpu/lib, on LD_LIBRARY_PATH.)
  ldd .gpu/cuda.test .gpu/device.test | awk '/=> \// {print $3}' | sort -u | while read -r lib; do
    case "$lib" in "$root"/.gpu/lib/*) continue ;; esac
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libgcc_s.so*|ld-linux*) ;;
      *) cp -L "$lib" .gpu/lib/ ;;
    esac
  done
  du -sh .gpu
  echo "now: run(command=\"bash scripts/gpu-suite.sh run\", carry=[\".gpu\"])"
}

OUT=${OUT:-$root/gpu-out}
export LD_LIBRARY_PATH="$root/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export DISTILL_CUDA_TEST=gpu DISTILL_REQUIRE_NVRTC=1
export DISTILL_KERNEL_CACHE=${DISTILL_KERNEL_CACHE:-/tmp/distill-kernel-cache}
T="$root/.gpu/cuda.test"
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
}

status() { echo "$1 $2" >>"$OUT/status.txt"; }

start=$(date +%s)
deadline=$((start + ${SUITE_BUDGET:-560}))

# step NAME LIMIT_S CMD...: runs CMD in $STEP_DIR (default compute/cuda,
# where its tests find their testdata) with a time limit (LIMIT_S, or less
# when the suite's budget is running out), logging to $OUT/NAME.log.
step() {
  local name=$1 limit=$2; shift 2
  local left=$((deadline - $(date +%s) - 10))
  if [ "$left" -lt 30 ]; then
    status "$name" "skipped (suite budget spent: run it in another call)"
    echo "== $name skipped: ${left}s left of the suite's budget" | tee -a "$OUT/steps.txt"
    return 0
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "== $name ($(date -u +%T), limit ${limit}s): $*" | tee -a "$OUT/steps.txt"
  ( cd "$root/${STEP_DIR:-compute/cuda}" && timeout --signal=INT --kill-after=20 "$limit" "$@" ) >"$OUT/$name.log" 2>&1
  local rc=$?
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
    ldconfig -p 2>/dev/null | grep -E 'libcuda.so|libnvrtc|libcublasLt' | head
    command -v compute-sanitizer nvcc ncu || true
    nvcc --version 2>/dev/null | tail -2
    echo "--- python"
    $PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, torch.cuda.get_device_name())' 2>&1
    echo "--- binary"
    ls -la "$root/.gpu" "$root/.gpu/lib" 2>&1
    ldd "$T" 2>&1
  } >"$OUT/env.log" 2>&1
  status env 0
}

s_test() {
  step test 180 "$T" -test.v -test.count=1 -test.timeout=170s \
    -test.run 'Conformance|Ties|SuiteForward|TrainingNotImplemented|KernelsCompile|NVRTCCompiles|AttnPlanKernel|BenchModel|ForwardGoldens|MemoryOps|Probe|Launch|Plan|Cache|Arch'
}

s_device() {
  STEP_DIR=compute/device step device 60 "$root/.gpu/device.test" -test.v -test.count=1 -test.timeout=50s
}

s_memcheck() {
  if ! command -v compute-sanitizer >/dev/null; then echo "no compute-sanitizer" >"$OUT/memcheck.log"; status memcheck skipped; return; fi
  step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 50 \
    "$T" -test.count=1 -test.timeout=140s -test.run 'Conformance|Ties|SuiteForward|AttnPlanKernel|BenchModel|MemoryOps|ForwardGoldens'
}

s_racecheck() {
  if ! command -v compute-sanitizer >/dev/null; then echo "no compute-sanitizer" >"$OUT/racecheck.log"; status racecheck skipped; return; fi
  step racecheck 150 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 3 --print-limit 50 \
    "$T" -test.count=1 -test.timeout=140s -test.run 'TestAttentionConformance|TestLMHeadTopKTies|TestAttnPlanKernel|TestMoERoutingTies'
}

s_goldens() {
  step hf-goldens 90 $PY "$root/scripts/gpu/hf_goldens.py" "$OUT/hf-goldens" "$root"/infer/testdata/golden/*
  DISTILL_HF_GOLDENS="$OUT/hf-goldens" step goldens 60 "$T" -test.v -test.count=1 -test.run 'ForwardHFGoldens|ForwardGoldens'
}

s_bench() {
  DISTILL_BENCH_OUT="$OUT" step bench 240 "$T" -test.run '^$' -test.bench 'GEMM|Attention|LMHead|Forward' \
    -test.benchtime 3x -test.timeout 235s
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
    for f in test device goldens memcheck racecheck; do
      [ -f "$OUT/$f.log" ] || continue
      echo "-- $f: failures"
      grep -E '^\s*--- FAIL|^FAIL|panic:|ERROR SUMMARY|========= (Invalid|Race|Error)' "$OUT/$f.log" | head -20
    done
    echo "-- agreement with goldens"
    grep -hE 'vs HF BF16|T=[0-9.]+: top-1' "$OUT/goldens.log" 2>/dev/null | sed 's/^ *//' | head -40
    echo "-- device chooser"
    grep -hE 'device auto|--- (PASS|FAIL)' "$OUT/device.log" 2>/dev/null | head -10
    echo "-- largest errors of the conformance tests"
    grep -hE 'max \|Δ\| = .* of the tolerance' "$OUT/test.log" 2>/dev/null |
      sed -E 's/^ *[a-z_]+\.go:[0-9]+: (.*): max \|Δ\| = ([^ ]+) over ([0-9]+) values \(([0-9.]+) of the tolerance (.*)\)$/\4 of tolerance: \1: max |Δ| \2 over \3 values, \5/' |
      sort -rn | head -15
    echo "-- benchmarks"
    grep -E '^Benchmark' "$OUT/bench.log" 2>/dev/null
    echo "-- HF peer"
    cat "$OUT/peer.log" 2>/dev/null | grep '^{'
    echo "-- top kernels"
    cat "$OUT"/profile-*.txt 2>/dev/null | head -80
  } >"$OUT/summary.txt" 2>&1
  cat "$OUT/summary.txt"
}

case "${1:-}" in
  build) build ;;
  run)
    shift
    [ -x "$T" ] || { echo "no $T: run 'bash scripts/gpu-suite.sh build' first and carry .gpu"; exit 2; }
    mkdir -p "$OUT"
    : >"$OUT/status.txt"
    libs
    steps=("$@")
    [ ${#steps[@]} -eq 0 ] && steps=(env test device goldens memcheck bench peer racecheck)
    for s in "${steps[@]}"; do
      case "$s" in
        env|test|device|memcheck|racecheck|goldens|bench|peer) "s_$s" ;;
        *) echo "unknown step $s"; exit 2 ;;
      esac
    done
    summary
    ;;
  *) sed -n '2,40p' "$0"; exit 2 ;;
esac
