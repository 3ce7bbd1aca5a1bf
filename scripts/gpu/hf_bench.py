#!/usr/bin/env python3
"""The HF peer of compute/cuda's BenchmarkForward, on the same GPU in the
same run: transformers' Qwen3ForCausalLM with random weights in bfloat16,
sdpa attention, logits + log_softmax + topk(k), as its users run a teacher.

It reads workloads.json, which BenchmarkForward writes (the shapes, k, and
the sample lengths of workload a, equal 4096-token samples, and b, the
log-normal length mix), so that both sides run the same samples:
  a: padded batches are full (equal lengths);
  b: samples sorted by length into padded batches, as HF users do; the
     padding costs compute but only real tokens count.
Each workload runs at the largest batch (in padded tokens) that fits, from
64k down. One JSON line per (shape, workload) with tokens/s and the peak
memory.

usage: hf_bench.py WORKLOADS_JSON [SHAPE_NAME...]
"""
import json
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def build(s):
    common = dict(vocab_size=s["Vocab"], hidden_size=s["Hidden"], num_hidden_layers=s["Layers"],
                  num_attention_heads=s["Heads"], num_key_value_heads=s["KVHeads"], head_dim=s["HD"],
                  intermediate_size=s["Inter"], tie_word_embeddings=s["Tied"], max_position_embeddings=40960)
    torch.manual_seed(0)
    if s.get("Experts"):
        # Qwen3-MoE (transformers runs its experts with grouped_mm), built
        # in bfloat16 directly: an fp32 30B model would not fit first.
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        cfg = Qwen3MoeConfig(num_experts=s["Experts"], num_experts_per_tok=s["TopK"], moe_intermediate_size=s["MoEInter"],
                             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common)
        cfg._attn_implementation = "sdpa"
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                m = Qwen3MoeForCausalLM(cfg).eval()
        finally:
            torch.set_default_dtype(prev)
        return m
    cfg = Qwen3Config(**common)
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        m = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    return m


def batches(lens, budget):
    """Length-sorted padded batches of at most budget padded tokens."""
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lens[i] > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def run(model, lens, k, budget, vocab):
    g = torch.Generator(device="cuda").manual_seed(1)
    data = [torch.randint(0, vocab, (l,), device="cuda", generator=g) for l in lens]
    bs = batches(lens, budget)
    for b in bs:
        L = max(lens[i] for i in b)
        ids = torch.zeros((len(b), L), dtype=torch.long, device="cuda")
        mask = torch.zeros((len(b), L), dtype=torch.long, device="cuda")
        for r, i in enumerate(b):
            ids[r, : lens[i]] = data[i]
            mask[r, : lens[i]] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits
        lp = torch.log_softmax(logits.float(), dim=-1)
        v, idx = lp.topk(k, dim=-1)
        _ = (v.cpu(), idx.cpu())  # the teacher's result on the host, as ours
        del logits, lp, v, idx


def main():
    w = json.load(open(sys.argv[1]))
    only = set(sys.argv[2:])
    torch.set_grad_enabled(False)
    for s in w["shapes"]:
        if only and s["Name"] not in only or not only and s.get("OptIn"):
            continue
        model = build(s)
        for name in sorted(w["workloads"]):
            lens = w["workloads"][name]
            result = None
            for budget in (65536, 32768, 16384, 8192, 4096):
                try:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    run(model, lens[:2], w["k"], budget, s["Vocab"])  # warm up
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    run(model, lens, w["k"], budget, s["Vocab"])
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    result = {"shape": s["Name"], "workload": name, "samples": len(lens), "tokens": sum(lens),
                              "batch_padded_tokens": budget, "tokens_per_s": sum(lens) / dt,
                              "peak_mem_GiB": torch.cuda.max_memory_allocated() / 2**30, "seconds": dt}
                    break
                except torch.OutOfMemoryError:
                    continue
            print(json.dumps(result or {"shape": s["Name"], "workload": name, "error": "out of memory at every batch size"}), flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
