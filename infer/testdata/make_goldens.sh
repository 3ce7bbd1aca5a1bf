#!/usr/bin/env bash
# Regenerates the golden checkpoints and the reference outputs the infer
# tests compare against. Needs Debian's python3-torch (/usr/bin/python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
go build -o bin/student ./cmd/student
G=infer/testdata/golden
rm -rf "$G"; mkdir -p "$G"
# --std 0.1 and --perturb: peaked distributions, non-trivial norms and biases.
common="--perturb --std 0.1 --dtype BF16"
bin/student init --arch llama --seed 11 $common --out $G/llama            # llama3 rope scaling, untied
bin/student init --arch llama --seed 12 $common --attention-bias true --tie true --out $G/llama-bias  # q/k/v/o biases, tied
bin/student init --arch qwen2 --seed 13 $common --out $G/qwen2            # q/k/v biases, tied
bin/student init --arch qwen3 --seed 14 $common --out $G/qwen3            # q/k norm, head_dim != hidden/heads
bin/student init --arch qwen3_moe --seed 15 $common --out $G/qwen3_moe    # 8 experts top-2, norm_topk, layer 1 dense
/usr/bin/python3 infer/testdata/hf_reference.py $G/*
