#!/usr/bin/env bash
# Teacher forward on the CPU, side by side with PyTorch (Debian python3-torch
# with libopenblas0-pthread) on the same ~48M Qwen3-shaped checkpoint and the
# same 4096 tokens (8 x 512), k=64. Prints both and the ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
ck=${DISTILL_BENCH_CKPT:-$PWD/.cache/bench-qwen3-48m}
iters=${ITERS:-3}
out=$(DISTILL_BENCH_CKPT=$ck go test ./infer/ -run '^$' -bench TeacherForward -benchtime ${iters}x 2>/dev/null | grep '^Benchmark\|^ *[0-9]')
go_tps=$(echo "$out" | grep -o '[0-9.]* tokens/s' | cut -d' ' -f1)
go_rss=$(echo "$out" | grep -o '[0-9.]* peakRSS_MB' | cut -d' ' -f1)
py=$(cd infer/testdata && /usr/bin/python3 torch_bench.py "$ck" 8 512 64 "$iters")
echo "go:    $go_tps tokens/s, peak RSS $go_rss MB"
echo "torch: $py"
python3 - "$go_tps" "$py" <<'PY'
import json, sys
g = float(sys.argv[1]); t = json.loads(sys.argv[2])
print(f"ratio go/torch: {g / t['tokens_per_s']:.2f}x   (torch {t['torch']}, {t['threads']} threads, plain 1024^3 matmul {t['matmul_gflops']} GFLOP/s)")
PY
