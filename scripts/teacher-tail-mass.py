#!/usr/bin/env python3
"""Where a teacher's probability mass lies beyond its top-64, at the target
positions of a cache filled with a larger k (issue 27;
docs/sampled-targets.md). Standard library only.

    cachectl fill --model TEACHER --tokenizer TOK --data DATA.jsonl \
        --cache /tmp/c512 --k 512 --start 0 --end 200 ...
    cachectl export --cache /tmp/c512 --out /tmp/c512.jsonl
    cachectl export --cache TRAINING_CACHE --out /tmp/train.jsonl
    python3 scripts/teacher-tail-mass.py /tmp/c512.jsonl /tmp/train.jsonl

The ids "the language uses" are the target tokens (loss_mask 1) of the
second export. A position j's distribution predicts token j+1 and is
counted when that token is a target. Prints the mass outside the top-64,
split into used ids ranked 65..k, unused ids ranked 65..k, and everything
outside the top-k, whose ids the language never uses when every used id
is inside the top-k (also printed).
"""
import json
import math
import sys


def stats(a):
    a = sorted(a)
    n = len(a)
    return "mean %.4f median %.4f p90 %.4f max %.4f" % (sum(a) / n, a[n // 2], a[int(0.9 * n)], a[-1])


def main(big, train):
    used = set()
    for line in open(train):
        r = json.loads(line)
        used.update(t for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    out64, used65, unused65, beyond, missing, k = [], [], [], [], [], 0
    for line in open(big):
        r = json.loads(line)
        m = r["loss_mask"]
        for j, (ids, lps) in enumerate(zip(r["topk_ids"], r["topk_logprobs"])):
            if j + 1 >= len(m) or not m[j + 1]:
                continue
            k = len(ids)
            p = [math.exp(v) for v in lps]
            out64.append(1 - sum(p[:64]))
            used65.append(sum(q for q, i in zip(p[64:], ids[64:]) if i in used))
            unused65.append(sum(q for q, i in zip(p[64:], ids[64:]) if i not in used))
            beyond.append(1 - sum(p))
            missing.append(len(used - set(ids)))
    print("ids the language uses (targets of %s): %d; target positions: %d; k = %d" % (train, len(used), len(out64), k))
    print("mass outside the top-64:              ", stats(out64))
    print("  on used ids ranked 65..%d:         " % k, stats(used65))
    print("  on unused ids ranked 65..%d:       " % k, stats(unused65))
    print("  outside the top-%d:                " % k, stats(beyond))
    print("used ids missing from a position's top-%d:" % k, stats(missing))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
