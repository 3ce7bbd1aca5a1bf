#!/usr/bin/env python3
"""Goldens from HF transformers itself, in BF16 on the GPU.

For each checkpoint directory written by `student init` (the ones under
infer/testdata/golden), load it with transformers' AutoModelForCausalLM in
bfloat16 with sdpa attention on cuda, run the samples of its golden.json
one at a time (no packing, no padding), and write OUT/<name>.json in the
same schema as golden.json: the top-K ids and log-probs (log_softmax over
the full vocabulary of logits/T, computed in fp32 from HF's BF16 logits)
of every position, for every temperature of golden.json.

compute/cuda's TestForwardHFGoldens compares the CUDA and CPU teachers with
these (scripts/gpu-suite.sh runs both). Commit the files it writes under
infer/testdata/hf-bf16/ once they look right.

It also writes OUT/<name>.vs-fp32.json: HF's BF16 forward against the fp32
goldens themselves, per temperature, counted exactly as compute/cuda's
forward_test.go counts ours (agreement.add, near-tie 0.05): positions whose
top-1 agrees, ids that agree at ranks where the golden has no near-tie, and
the |delta log-prob| at equal ranks (max, sum, count). TestForwardGoldens
holds the CUDA teacher to HF BF16's figures (less a stated slack) when
DISTILL_HF_GOLDENS points here.

usage: hf_goldens.py OUT CKPT_DIR [CKPT_DIR...]
"""
import json
import os
import sys
import traceback

import torch
import transformers
from transformers import AutoModelForCausalLM


def load(d):
    try:
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="sdpa")
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        m = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    return m.to("cuda").eval()


TIE = 0.05  # forward_test.go's near-tie: golden log-probs closer than this


def agreement(got_ids, got_lps, want_ids, want_lps, tie=TIE):
    """forward_test.go's agreement over one run: lists [sample][position][rank]."""
    a = {"positions": 0, "top1": 0, "ranks": 0, "ids_agree": 0, "entries": 0, "max_delta": 0.0, "sum_delta": 0.0}
    for gi_s, gl_s, wi_s, wl_s in zip(got_ids, got_lps, want_ids, want_lps, strict=True):
        for gi, gl, wi, wl in zip(gi_s, gl_s, wi_s, wl_s, strict=True):
            k = len(wi)
            a["positions"] += 1
            if gi[0] == wi[0]:
                a["top1"] += 1
            for j in range(k):
                d = abs(gl[j] - wl[j])
                a["max_delta"] = max(a["max_delta"], d)
                a["sum_delta"] += d
                a["entries"] += 1
                near = (j > 0 and wl[j - 1] - wl[j] < tie) or (j + 1 < k and wl[j] - wl[j + 1] < tie)
                if near:
                    continue
                a["ranks"] += 1
                if gi[j] == wi[j]:
                    a["ids_agree"] += 1
    a["mean_delta"] = a["sum_delta"] / max(1, a["entries"])
    return a


def describe(a):
    """The figures as forward_test.go's agreement.String prints them."""
    return (f"top-1 agreement {a['top1']}/{a['positions']} ({100 * a['top1'] / a['positions']:.2f}%), "
            f"top-k ids outside near-ties {a['ids_agree']}/{a['ranks']} ({100 * a['ids_agree'] / max(a['ranks'], 1):.2f}%), "
            f"max |Δ log-prob| {a['max_delta']:.3g}, mean {a['mean_delta']:.3g}")


def main():
    out, dirs = sys.argv[1], sys.argv[2:]
    os.makedirs(out, exist_ok=True)
    torch.set_grad_enabled(False)
    failed = 0
    for d in dirs:
        name = os.path.basename(os.path.normpath(d))
        try:
            g = json.load(open(os.path.join(d, "golden.json")))
            k = g["k"]
            model = load(d)
            runs = []
            for run in g["runs"]:
                t = run["temperature"]
                ids_all, lps_all = [], []
                for s in g["samples"]:
                    x = torch.tensor([s], device="cuda")
                    logits = model(input_ids=x).logits[0].float() / t
                    v, i = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
                    ids_all.append(i.tolist())
                    lps_all.append(v.tolist())
                runs.append({"temperature": t, "topk_ids": ids_all, "topk_logprobs": lps_all})
            src = f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, bfloat16, sdpa"
            json.dump({"k": k, "samples": g["samples"], "runs": runs, "source": src}, open(os.path.join(out, name + ".json"), "w"))
            print(f"{name}: {len(g['samples'])} samples x {len(runs)} temperatures ({src})")
            vs = []
            for run, gold in zip(runs, g["runs"], strict=True):
                a = agreement(run["topk_ids"], run["topk_logprobs"], gold["topk_ids"], gold["topk_logprobs"])
                a["temperature"] = gold["temperature"]
                vs.append(a)
                print(f"{name} T={gold['temperature']:g}: HF BF16 vs fp32 goldens: {describe(a)}")
            json.dump({"source": src, "tie": TIE, "runs": vs}, open(os.path.join(out, name + ".vs-fp32.json"), "w"), indent=1)
        except Exception:
            failed += 1
            print(f"{name}: FAILED")
            traceback.print_exc()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
