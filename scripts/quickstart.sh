#!/usr/bin/env bash
# The README's first command: on a fresh Debian 12 machine with Go, install
# the prerequisites, build the binaries, and run the main job on the embedded
# default (CPU, local files): make a tiny teacher checkpoint and print its
# top-k next tokens for a few token ids.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
if ! dpkg -s libopenblas-dev >/dev/null 2>&1 || ! command -v gcc >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas-dev libopenblas0-pthread gcc >/dev/null
fi
mkdir -p bin out
go build -o bin/ ./cmd/...
echo "== student init: a tiny random Qwen3 teacher"
bin/student init --arch qwen3 --layers 2 --hidden 128 --heads 4 --kv-heads 2 --head-dim 32 \
  --intermediate 256 --vocab 2000 --std 0.1 --seed 1 --out out/tiny-qwen3
echo "== cachectl score: its top-5 next tokens at every position of two samples"
bin/cachectl score --model out/tiny-qwen3 --ids "1,2,3,4;42,7" --k 5
