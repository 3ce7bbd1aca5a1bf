#!/usr/bin/env bash
# The fill cost of each kind of target (issue 27's "fill throughput cost of
# sampling against top-k", docs/sampled-targets.md): whole `cachectl fill`
# runs of the quick start's trained teacher on the CPU, over the transfer
# set's first FT_END samples (default 2000), one fresh cache per run, the
# kinds one after another in each of FT_ROUNDS rounds (default 3) so that
# all see the same machine. Each run's cost is the process's CPU time
# (user + system, from bash's `time`: steadier than wall time on a shared
# machine); the table gives tokens per CPU-second and each kind's CPU time
# against topk's of the same round.
# Needs the quick start's teacher: run `QS_UNTIL=teacher scripts/quickstart.sh`
# first (QS_OUT, default out/quickstart). FT_MODEL=DIR fills from another
# checkpoint instead (e.g. an untrained one: a flat softmax, where the
# draws spread over the most blocks; the worst case for sampling).
set -euo pipefail
cd "$(dirname "$0")/.."
Q=${QS_OUT:-out/quickstart}
M=${FT_MODEL:-$Q/teacher}
END=${FT_END:-2000}
ROUNDS=${FT_ROUNDS:-3}
for f in "$M/config.json" "$Q/tokenizer/tokenizer.json" "$Q/data/distill.jsonl"; do
  [ -e "$f" ] || { echo "bench-fill-targets: $f is missing: run QS_UNTIL=teacher scripts/quickstart.sh first (QS_OUT=$Q)" >&2; exit 1; }
done
O=$(mktemp -d)
trap 'rm -rf "$O"' EXIT
mkdir -p bin
go build -o bin/ ./cmd/cachectl
kinds=("topk-k16|--k 16" "topk-k8|--k 8" "sampled-N50|--targets sampled --samples 50"
  "head+sampled-k8-N50|--targets head+sampled --k 8 --samples 50")
echo "bench-fill-targets: $M, samples [0, $END), $ROUNDS rounds, $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
declare -A cpu tok
for r in $(seq 1 "$ROUNDS"); do
  for spec in "${kinds[@]}"; do
    name=${spec%%|*}
    rm -rf "$O/cache"
    TIMEFORMAT='%U %S'
    t=$( { time bin/cachectl fill --model "$M" --tokenizer "$Q/tokenizer" --data "$Q/data/distill.jsonl" \
      --template-var enable_thinking=false --cache "$O/cache" --device cpu --end "$END" ${spec#*|} \
      >"$O/log" 2>&1; } 2>&1 )
    c=$(echo "$t" | awk '{printf "%.3f", $1 + $2}')
    n=$(grep -o '[0-9]* tokens,' "$O/log" | tail -n 1 | cut -d' ' -f1)
    cpu[$r,$name]=$c tok[$name]=$n
    echo "round $r $name: $n tokens, $c CPU-s, $(awk -v n="$n" -v c="$c" 'BEGIN {printf "%.0f", n / c}') tokens per CPU-second"
  done
done
echo
echo "| targets | tokens per CPU-second (rounds) | CPU time against topk k 16 (rounds) | mean |"
echo "| --- | --- | --- | --- |"
for spec in "${kinds[@]}"; do
  name=${spec%%|*}
  tps="" rel="" sum=0
  for r in $(seq 1 "$ROUNDS"); do
    tps+="$(awk -v n="${tok[$name]}" -v c="${cpu[$r,$name]}" 'BEGIN {printf "%.0f", n / c}') "
    d=$(awk -v a="${cpu[$r,$name]}" -v b="${cpu[$r,topk-k16]}" 'BEGIN {printf "%+.1f", 100 * (a / b - 1)}')
    rel+="$d% " sum=$(awk -v s="$sum" -v d="$d" 'BEGIN {print s + d}')
  done
  echo "| $name | ${tps% } | ${rel% } | $(awk -v s="$sum" -v r="$ROUNDS" 'BEGIN {printf "%+.1f%%", s / r}') |"
done
