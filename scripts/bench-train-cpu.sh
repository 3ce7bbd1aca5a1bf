#!/usr/bin/env bash
# Student training step on the CPU (forward + fused KD loss + backward of a
# 24M-parameter Qwen3-shaped student, 1024 packed tokens, k=64), side by
# side with the same step in PyTorch (Debian python3-torch): prints both,
# the ratio go/torch, and torch's GFLOP/s on a plain 1024^3 matmul for
# scale. ITERS (default 3) steps each. Both use every core (the Go kernels
# split over runtime.NumCPU() workers; torch gets set_num_threads(nproc)).
#
# MOE=1 benchmarks the Qwen3-MoE student instead (every MLP 8 experts,
# top-2, 512 wide, load-balancing loss on: BenchmarkTrainStepMoE against
# bench_torch.py's HF-eager Qwen3MoeSparseMoeBlock).
#
#   scripts/bench-train-cpu.sh
#   MOE=1 scripts/bench-train-cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
iters=${ITERS:-3}
threads=$(nproc)
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "bench-train-cpu: /usr/bin/python3 has no torch; apt-get install python3-torch libopenblas0-pthread" >&2
  exit 1
fi
bench=BenchmarkTrainStep pyarg=
if [ "${MOE:-0}" = 1 ]; then
  bench=BenchmarkTrainStepMoE pyarg=moe
fi
gout=$(go test ./train/ -run '^$' -bench "^${bench}\$" -benchtime ${iters}x 2>&1 | grep "^${bench}-")
go_tps=$(echo "$gout" | grep -o '[0-9.]* tokens/s' | cut -d' ' -f1)
go_gf=$(echo "$gout" | grep -o '[0-9.]* GFLOP/s' | cut -d' ' -f1)
py=$(/usr/bin/python3 train/testdata/bench_torch.py "$threads" $pyarg)
echo "go:    $bench $go_tps tokens/s, $go_gf GFLOP/s ($threads threads)"
echo "torch: $py"
python3 - "$go_tps" "$py" <<'PY'
import re, sys
g = float(sys.argv[1]); t = sys.argv[2]
tps = float(re.search(r"([0-9.]+) tokens/s", t).group(1))
mm = re.search(r"matmul ([0-9.]+) GFLOP/s", t).group(1)
print(f"ratio go/torch: {g / tps:.2f}x tokens/s   (torch plain 1024^3 matmul: {mm} GFLOP/s)")
PY
