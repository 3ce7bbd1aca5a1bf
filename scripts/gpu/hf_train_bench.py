#!/usr/bin/env python3
"""The PyTorch peer of train/trainer's BenchmarkCUDATrainStep, on the same GPU
in the same run: one KD training step of a Qwen3-0.6B- or 1.7B-shaped
student as people train one today with HF transformers:

  - Qwen3ForCausalLM, random weights, fp32 master weights, sdpa attention,
    torch.autocast(bfloat16) for the forward and backward;
  - the loss as DistillKit computes its sparse top-k distillation: the full
    [tokens x vocab] student logits, log_softmax over the vocabulary, gathered
    at the teacher's k = 64 ids, forward KL against the teacher's top-k
    probabilities (the mass outside the top-k counts as zero), plus 0.1 x CE
    on the labels;
  - gradient clipping at 1.0 and torch.optim.AdamW(fused=True).

Rows of 8192 tokens, vocab 151936, the largest batch of rows that fits
(tried from 8 rows down). One JSON line per shape: tokens/s, MFU with the
Go benchmark's FLOP count (6 x params + causal attention, x3 for the
backward), peak memory, or the out-of-memory it met.

usage: hf_train_bench.py [SHAPE_NAME...]   (qwen3-0.6b, qwen3-1.7b)
"""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPES = {  # name: hidden, layers, heads, kv heads, head_dim, intermediate
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144),
}
T, V, K = 8192, 151936, 64


def peak_tflops():
    if os.environ.get("DISTILL_PEAK_TFLOPS"):
        return float(os.environ["DISTILL_PEAK_TFLOPS"])
    n = torch.cuda.get_device_name().upper()
    if "H100" in n and "PCIE" in n:
        return 756.0
    if any(x in n for x in ("H100", "H200", "H800")):
        return 989.4
    if "A100" in n:
        return 312.0
    return 0.0


def build(shape):
    h, layers, heads, kv, hd, inter = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=V, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=hd, intermediate_size=inter, tie_word_embeddings=True,
                      max_position_embeddings=40960)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg)  # fp32 master weights
    model.train()
    return model, cfg


def batch(rows):
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, V, (rows, T), device="cuda", generator=g)
    labels = torch.randint(0, V, (rows, T), device="cuda", generator=g)
    # K teacher ids a position (random; repeats do not change the cost),
    # with decreasing log-probs.
    top_ids = torch.randint(0, V, (rows, T, K), device="cuda", generator=g)
    top_lp = (-2 - 0.1 * torch.arange(K, device="cuda", dtype=torch.float32)).expand(rows, T, K).contiguous()
    return ids, labels, top_ids, top_lp


def step(model, opt, ids, labels, top_ids, top_lp):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits  # [rows, T, V]
    lq = F.log_softmax(logits.float(), dim=-1)
    p = top_lp.exp()
    kd = (p * (top_lp - lq.gather(-1, top_ids))).sum(-1).mean()
    ce = F.nll_loss(lq.view(-1, V), labels.view(-1))
    loss = kd + 0.1 * ce
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def main():
    shapes = sys.argv[1:] or list(SHAPES)
    peak = peak_tflops()
    for shape in shapes:
        model, cfg = build(shape)
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        result = None
        for rows in (8, 4, 2, 1):
            try:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                data = batch(rows)
                step(model, opt, *data)  # warm up
                torch.cuda.synchronize()
                n = 2
                t0 = time.perf_counter()
                for _ in range(n):
                    loss = step(model, opt, *data)
                torch.cuda.synchronize()
                sec = (time.perf_counter() - t0) / n
                tokens = rows * T
                attn = 3 * 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * T * (T + 1) / 2 * rows
                flops = 6 * params * tokens + attn
                result = {"peer": "pytorch", "shape": shape, "rows": rows, "row_tokens": T, "vocab": V, "k": K, "params": params,
                          "tokens_per_s": tokens / sec, "step_s": sec, "tflops": flops / sec / 1e12,
                          "mfu_pct": 100 * flops / sec / 1e12 / peak if peak else None,
                          "peak_mem_GiB": torch.cuda.max_memory_allocated() / 2**30, "loss": float(loss),
                          "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
                break
            except torch.OutOfMemoryError:
                opt.zero_grad(set_to_none=True)
                data = None
                continue
        print(json.dumps(result or {"peer": "pytorch", "shape": shape, "error": "out of memory even at one 8192-token row",
                                    "peak_mem_GiB": torch.cuda.max_memory_allocated() / 2**30}), flush=True)
        del model, opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
