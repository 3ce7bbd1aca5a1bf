#!/usr/bin/env python3
"""The attention table of scripts/gpu-suite.sh's attn step: compute/cuda's
BenchmarkAttention (attn-bench.jsonl, which it appends to under
DISTILL_BENCH_OUT) beside PyTorch's scaled_dot_product_attention on the same
shapes (scripts/gpu/sdpa_bench.py's JSON), as TFLOP/s with the same FLOP
count, and the ratios ours / torch's cuDNN backend and ours / torch's flash
backend per case (above 1: ours is faster). Standard library only, so it
runs where torch does not (the torch columns then say why they are empty).

A Go benchmark runs each case once with b.N = 1 before its timed run, and
both append a line: the last line of a case wins.

usage: attn_table.py ATTN_BENCH_JSONL SDPA_JSON
"""
import json
import sys


def load_ours(path):
    ours, order = {}, []
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        return ours, order, f"no Go figures ({e})"
    for line in lines:
        if not line.strip():
            continue
        r = json.loads(line)
        key = (r["impl"], r["dir"], r["shape"])
        if key not in ours:
            order.append(key)
        ours[key] = r
    return ours, order, ""


def load_torch(path):
    try:
        d = json.load(open(path))
    except (OSError, ValueError) as e:
        return {}, {}, f"no PyTorch figures ({e})"
    return {(r["backend"], r["dir"], r["shape"]): r for r in d.get("results", [])}, d, ""


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    ours, order, why_ours = load_ours(sys.argv[1])
    torch, meta, why_torch = load_torch(sys.argv[2])
    print("attention: 16384 tokens, 32 query heads, 8 kv heads, head_dim 128, causal; TFLOP/s: "
          "forward 4*D*H*l(l+1)/2 per sample, forward+backward 3.5x that; ratio > 1: ours faster")
    if meta:
        print(f"PyTorch: torch {meta.get('torch')}, cuDNN {meta.get('cudnn')}, {meta.get('gpu')}, bf16, "
              f"median of {meta.get('iters')} after {meta.get('warmup')} warm-up")
    for why in (why_ours, why_torch):
        if why:
            print(why)
    gpu = next((r.get("gpu") for r in ours.values() if r.get("gpu")), None)
    if gpu:
        print(f"ours: {gpu}; tensors in and out as the io column says (bf16: q, k, v, out, dout, dv in BF16, dq and dk fp32, "
              f"the training step's and teacher's; f32: all fp32, the contract's, with the conversions timed), BF16 inside; "
              f"wall time over the benchmark's iterations")
    hdr = f"{'case':<28} {'runs':<40} {'io':>4} {'ours':>8} {'torch-cudnn':>12} {'torch-flash':>12} {'ours/cudnn-torch':>17} {'ours/flash-torch':>17} {'ours GiB':>9}"
    print(hdr)
    print("-" * len(hdr))

    def cell(t):
        if t is None:
            return "-"
        if "error" in t:
            return "error"
        return f"{t['tflops']:.1f}"

    def ratio(o, t):
        if o is None or t is None or "tflops" not in o or "tflops" not in t or not t["tflops"]:
            return "-"
        return f"{o['tflops'] / t['tflops']:.2f}"

    for key in order:
        impl, direction, shape = key
        o = ours[key]
        tc, tf = torch.get(("cudnn", direction, shape)), torch.get(("flash", direction, shape))
        case = f"{impl} {direction} {shape}"
        if "skipped" in o or "error" in o:
            print(f"{case:<28} {'skipped' if 'skipped' in o else 'FAILED'}: {o.get('skipped') or o.get('error')}")
            continue
        print(f"{case:<28} {o.get('impl_name') or impl:<40} {o.get('io', 'f32'):>4} {o['tflops']:>8.1f} {cell(tc):>12} {cell(tf):>12} "
              f"{ratio(o, tc):>17} {ratio(o, tf):>17} {o.get('devmem_GiB', 0):>9.2f}")
    notes = [f"torch {k[0]} {k[1]} {k[2]}: {r['error']}" for k, r in torch.items() if "error" in r]
    notes += [f"torch {k[0]} {k[1]} {k[2]}: GQA by {r['gqa']}" for k, r in torch.items() if r.get("gqa", "enable_gqa") != "enable_gqa"]
    notes += [f"torch {k[0]} {k[1]} {k[2]}: peak {r['peak_mem_GiB']:.2f} GiB" for k, r in torch.items() if "peak_mem_GiB" in r]
    for n in notes:
        print(n)


if __name__ == "__main__":
    main()
