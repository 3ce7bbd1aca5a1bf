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
        except Exception:
            failed += 1
            print(f"{name}: FAILED")
            traceback.print_exc()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
