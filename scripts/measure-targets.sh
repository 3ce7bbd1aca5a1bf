#!/usr/bin/env bash
# The bias of each kind of sparse teacher target (issue 27's measurement,
# docs/sampled-targets.md, "The bias"): fills caches of every kind from
# the quick start's trained teacher over its held-out samples, then measures, at each
# counted position, the angle between the gradient the loss takes on the
# student's logits from each cache and the exact full-vocabulary KD
# gradient (examples/quickstart/targetbias), for the quick start's KD +
# SFT student and its SFT-only student.
# Needs the quick start's outputs: run scripts/quickstart.sh first (QS_OUT,
# default out/quickstart). TB_RANGE (default 0:200, the held-out samples)
# picks the samples; outputs go to $QS_OUT/targets.
set -euo pipefail
cd "$(dirname "$0")/.."
Q=${QS_OUT:-out/quickstart}
R=${TB_RANGE:-0:200}
O=$Q/targets
for f in "$Q/teacher/config.json" "$Q/student-kd/config.yaml" "$Q/student-sft/config.yaml" "$Q/data/distill.jsonl"; do
  [ -e "$f" ] || { echo "measure-targets: $f is missing: run scripts/quickstart.sh first (QS_OUT=$Q)" >&2; exit 1; }
done
mkdir -p bin "$O"
go build -o bin/ ./cmd/cachectl ./cmd/student ./examples/quickstart/targetbias
fill() {
  local name=$1; shift
  bin/cachectl fill --model "$Q/teacher" --tokenizer "$Q/tokenizer" --data "$Q/data/distill.jsonl" \
    --template-var enable_thinking=false --cache "$O/$name" --start "${R%%:*}" --end "${R##*:}" --chunk 256 "$@" > "$O/$name.log" 2>&1
  tail -n 2 "$O/$name.log" | head -n 1
}
caches=()
for spec in "topk8 --k 8" "topk16 --k 16" "topk64 --k 64" "sampled16 --targets sampled --samples 16" \
  "sampled50 --targets sampled --samples 50" "head4+sampled16 --targets head+sampled --k 4 --samples 16" \
  "head8+sampled50 --targets head+sampled --k 8 --samples 50"; do
  set -- $spec
  name=$1; shift
  echo "== fill $name: $*"
  fill "$name" "$@"
  caches+=(--cache "$name=$O/$name")
done
# The students' last checkpoints (HF directories).
last() { ls -d "$1"/checkpoints/step-* | sort | tail -n 1; }
for s in kd sft; do
  echo "== the $s student"
  bin/targetbias --teacher "$Q/teacher" --student "$(last "$Q/student-$s")" --range "$R" "${caches[@]}" | tee "$O/bias-$s.md"
done
