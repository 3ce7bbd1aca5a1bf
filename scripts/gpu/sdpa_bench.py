#!/usr/bin/env python3
"""The PyTorch peer of compute/cuda's BenchmarkAttention, on the same GPU in
the same suite call (scripts/gpu-suite.sh's attn step).

torch.nn.functional.scaled_dot_product_attention in bfloat16, causal, with
32 query heads, 8 kv heads (GQA) and head_dim 128, on the Go benchmark's
shapes: 4 samples of 4096 and 32 of 512 (16384 tokens), and one of 8192 (a
training step's row; its backward's parallelism is the heads and one
sequence's blocks only) (dense [B, H, S, D]
batches: the samples have equal lengths, so no padding), through each of
two backends forced with torch.nn.attention.sdpa_kernel:

  cudnn   SDPBackend.CUDNN_ATTENTION (cuDNN's fused flash attention)
  flash   SDPBackend.FLASH_ATTENTION (PyTorch's FlashAttention-2)

forward alone (inference: no input requires grad, so no log-sum-exp is
kept) and forward + backward (torch.autograd.grad of the output against a
random upstream gradient: dq, dk, dv). GQA by enable_gqa=True; where a
backend refuses it, K and V are expanded to the query heads with
repeat_interleave once, outside the timed region (the kernel then runs as
MHA: no less work by the FLOP count below, which counts query heads), and
the case says so ("gqa").

Timing: CUDA events around each iteration, after warm-up iterations; the
median of the iterations. FLOPs by the Go benchmark's convention
(compute/cuda attnFwdFLOPs): 4 * D * H * l(l+1)/2 per sample for the
forward (QK^T and PV over the causal half), 3.5 times that for forward +
backward (the backward 2.5 times the forward, as FlashAttention and PyTorch
count it). The peak memory is torch.cuda.max_memory_allocated over the case
(its inputs included).

Writes the results as JSON to OUT_JSON and prints one line per case.

usage: sdpa_bench.py OUT_JSON [ITERS [WARMUP]]   (defaults 10 and 3)
"""
import json
import statistics
import sys
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(4, 4096), (32, 512), (1, 8192)]  # (samples, tokens each): 16384 tokens; one row of 8192 (a training step's)
H, KV, D = 32, 8, 128
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
DIRS = ("fwd", "fwd+bwd")


def fwd_flops(b, s):
    return b * 4.0 * D * H * s * (s + 1) / 2


def inputs(b, s, grad):
    g = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda h: torch.randn(b, h, s, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = mk(H), mk(KV), mk(KV)
    dout = mk(H) if grad else None
    return q, k, v, dout


def make_step(direction, q, k, v, dout, gqa):
    """The timed call; gqa: True for enable_gqa, False when k, v have H heads."""
    kw = {"is_causal": True}
    if gqa:
        kw["enable_gqa"] = True
    if direction == "fwd":
        def step():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, **kw)
    else:
        def step():
            o = F.scaled_dot_product_attention(q, k, v, **kw)
            return torch.autograd.grad(o, (q, k, v), dout)
    return step


def median_ms(step, iters, warmup):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        step()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def run_case(name, backend, direction, b, s, iters, warmup):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    grad = direction == "fwd+bwd"
    q, k, v, dout = inputs(b, s, grad)
    gqa = "enable_gqa"
    with sdpa_kernel([backend]):
        try:
            for t in (q, k, v):
                t.requires_grad_(grad)
            step = make_step(direction, q, k, v, dout, True)
            step()  # does this backend take GQA as it is?
        except RuntimeError as e:
            why = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            print(f"{name} {direction} {b}x{s}: failed with enable_gqa ({why}); again with K and V repeat_interleave'd to {H} heads", flush=True)
            gqa = "repeat_interleave (outside the timed region)"
            k = k.detach().repeat_interleave(H // KV, dim=1)
            v = v.detach().repeat_interleave(H // KV, dim=1)
            k.requires_grad_(grad)
            v.requires_grad_(grad)
            step = make_step(direction, q, k, v, dout, False)
        ms = median_ms(step, iters, warmup)
    flops = fwd_flops(b, s) * (3.5 if grad else 1.0)
    return {"backend": name, "dir": direction, "shape": f"{b}x{s}", "samples": b, "seq_len": s, "tokens": b * s,
            "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "flops": flops,
            "peak_mem_GiB": torch.cuda.max_memory_allocated() / 2**30, "gqa": gqa}


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    warmup = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "gpu": torch.cuda.get_device_name(), "dtype": "bfloat16", "causal": True, "heads": H, "kv_heads": KV,
            "head_dim": D, "iters": iters, "warmup": warmup, "statistic": "median",
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
    print(json.dumps(meta), flush=True)
    results, failed = [], 0
    for name, backend in BACKENDS.items():
        for b, s in SHAPES:
            for direction in DIRS:
                try:
                    r = run_case(name, backend, direction, b, s, iters, warmup)
                except Exception as e:  # a backend that cannot run the case: say why, time nothing
                    failed += 1
                    traceback.print_exc()
                    r = {"backend": name, "dir": direction, "shape": f"{b}x{s}", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
                results.append(r)
                print(json.dumps(r), flush=True)
    with open(out, "w") as f:
        json.dump(dict(meta, results=results), f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
