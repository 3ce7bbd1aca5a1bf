#!/usr/bin/python3
"""PyTorch CPU peer of BenchmarkTeacherForward: the same checkpoint, the same
4096 tokens (B samples of T tokens, batched: torch's best case, no padding),
the same work: forward, log_softmax over the full vocabulary, top-k.
Prints tokens/s, peak RSS, and torch's GFLOP/s on a plain 1024^3 fp32 matmul
(a BLAS sanity check: without libopenblas0-pthread torch falls back to a
reference BLAS at ~6 GFLOP/s and any ratio is meaningless).

usage: /usr/bin/python3 torch_bench.py CKPT_DIR B T K ITERS"""
import json
import os
import resource
import sys
import time

import numpy as np
import torch

import hf_reference as ref

torch.set_grad_enabled(False)
# Debian's torch may start with 1 intra-op thread: use every core, as we do.
torch.set_num_threads(os.cpu_count())
d, B, T, K, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

a = torch.randn(1024, 1024)
b = torch.randn(1024, 1024)
a @ b
t0 = time.perf_counter()
for _ in range(10):
    a @ b
mm = 10 * 2 * 1024**3 / (time.perf_counter() - t0) / 1e9

cfg = json.load(open(f"{d}/config.json"))
W = ref.load_safetensors(f"{d}/model.safetensors")
ids = torch.from_numpy(np.random.RandomState(0).randint(0, cfg["vocab_size"], size=(B, T)))


def step():
    logits = ref.forward(cfg, W, ids)
    lp = torch.log_softmax(logits, dim=-1)
    return torch.topk(lp, K, dim=-1)


step()  # warm up
t0 = time.perf_counter()
for _ in range(iters):
    step()
dt = (time.perf_counter() - t0) / iters
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "matmul_gflops": round(mm, 1),
                  "tokens_per_s": round(B * T / dt, 1), "peak_rss_mb": round(rss)}))
