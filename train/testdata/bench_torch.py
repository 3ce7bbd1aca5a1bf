#!/usr/bin/python3
"""PyTorch counterpart of BenchmarkTrainStep (train/bench_test.go): the same
24M-parameter Qwen3-shaped student (hidden 256, 8 layers, 4 heads / 2 kv
heads of 64, q/k norm, intermediate 1024, vocab 32000, untied), one packed
row of 1024 tokens in 4 samples with block-diagonal causal attention, fwd_kl
KD with a tail bucket at k=64 + 0.1 CE, forward + backward, fp32 on CPU.
It prints tokens/s, the step's GFLOP/s (same count as the Go benchmark), and
torch's GFLOP/s on a plain 1024^3 matmul for scale.

With "moe" (BenchmarkTrainStepMoE): every MLP is a Qwen3-MoE block of 8
experts, top-2, 512 wide, norm_topk_prob, as HF's Qwen3MoeSparseMoeBlock
computes it in eager mode (fp32 router softmax, top-k, then per expert:
gather its tokens, SwiGLU, scale, index_add_ back), plus HF's
load_balancing_loss_func over the layers' router logits times 0.001; the
GFLOP/s count the active parameters.

Run with Debian's torch (not a pyenv python):
    /usr/bin/python3 train/testdata/bench_torch.py [threads] [moe]
"""
import sys, time, torch
import torch.nn.functional as F

torch.manual_seed(0)
threads = int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads()
torch.set_num_threads(threads)
moe = len(sys.argv) > 2 and sys.argv[2] == "moe"
V, C, L, H, KV, D, I, N, K = 32000, 256, 8, 4, 2, 64, 1024, 1024, 64
E, TOPK, MI, AUX = 8, 2, 512, 0.001
starts = [0, 300, 500, 900, 1024]

def p(*s):
    return (torch.randn(*s) * 0.02).requires_grad_()
params = {"emb": p(V, C), "head": p(V, C), "fn": torch.ones(C, requires_grad=True)}
for l in range(L):
    params.update({f"{l}.{n}": p(*s) for n, s in [("q", (H*D, C)), ("k", (KV*D, C)), ("v", (KV*D, C)), ("o", (C, H*D))]})
    if moe:
        params[f"{l}.router"] = p(E, C)
        for e in range(E):
            params.update({f"{l}.{e}.{n}": p(*s) for n, s in [("g", (MI, C)), ("u", (MI, C)), ("d", (C, MI))]})
    else:
        params.update({f"{l}.{n}": p(*s) for n, s in [("g", (I, C)), ("u", (I, C)), ("d", (C, I))]})
    for n, s in [("in", C), ("post", C), ("qn", D), ("kn", D)]:
        params[f"{l}.{n}"] = torch.ones(s, requires_grad=True)

def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

pos = torch.cat([torch.arange(b - a) for a, b in zip(starts, starts[1:])]).float()
inv = 1.0 / (1e6 ** (torch.arange(0, D, 2).float() / D))
ang = pos[:, None] * inv[None]
cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
def rope(x):
    x1, x2 = x[..., :D//2], x[..., D//2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin
seg = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(zip(starts, starts[1:]))])
mask = (seg[:, None] == seg[None]) & torch.ones(N, N, dtype=torch.bool).tril()

tokens = torch.randint(0, V, (N,))
tids = torch.stack([torch.randperm(V)[:K] for _ in range(N)])
tlp = (-2.0 - torch.arange(K).float()).expand(N, K)
valid = (seg[:-1] == seg[1:])

def sparse_moe(h, l, logits_out):
    """HF Qwen3MoeSparseMoeBlock.forward (eager), one layer."""
    router_logits = h @ params[f"{l}.router"].T
    logits_out.append(router_logits)
    rw = F.softmax(router_logits, dim=1, dtype=torch.float)
    rw, sel = torch.topk(rw, TOPK, dim=-1)
    rw = rw / rw.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(h)
    expert_mask = F.one_hot(sel, num_classes=E).permute(2, 1, 0)
    for e in range(E):
        idx, top_x = torch.where(expert_mask[e])
        cur = h[top_x]
        g = lambda n: params[f"{l}.{e}.{n}"]
        y = (F.silu(cur @ g("g").T) * (cur @ g("u").T)) @ g("d").T * rw[top_x, idx, None]
        out.index_add_(0, top_x, y)
    return out

def load_balancing_loss(gate_logits):
    """HF load_balancing_loss_func, no attention mask."""
    cat = torch.cat(gate_logits, dim=0)
    rw = F.softmax(cat, dim=-1)
    _, sel = torch.topk(rw, TOPK, dim=-1)
    expert_mask = F.one_hot(sel, E)
    tokens_per_expert = torch.mean(expert_mask.float(), dim=0)
    router_prob_per_expert = torch.mean(rw, dim=0)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * E

def step():
    x = params["emb"][tokens]
    router_logits = []
    for l in range(L):
        g = lambda n: params[f"{l}.{n}"]
        h = rms(x, g("in"))
        q = rms((h @ g("q").T).view(N, H, D), g("qn"))
        k = rms((h @ g("k").T).view(N, KV, D), g("kn"))
        v = (h @ g("v").T).view(N, KV, D)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        s = torch.einsum("nhd,mhd->hnm", q, k) / D ** 0.5
        a = torch.einsum("hnm,mhd->nhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)
        x = x + a.reshape(N, H * D) @ g("o").T
        h = rms(x, g("post"))
        if moe:
            x = x + sparse_moe(h, l, router_logits)
        else:
            x = x + (F.silu(h @ g("g").T) * (h @ g("u").T)) @ g("d").T
    x = rms(x, params["fn"])[:-1][valid]
    z = x @ params["head"].T                      # (M, V): torch holds the full logits
    lq = z.log_softmax(-1)
    ids, lp = tids[:-1][valid], tlp[:-1][valid]
    lqk = lq.gather(1, ids)
    qtail = (1 - lqk.exp().sum(-1)).clamp_min(1e-30)
    ptail = (1 - lp.exp().sum(-1)).clamp_min(1e-30)
    kd = (lp.exp() * (lp - lqk)).sum(-1) + ptail * (ptail.log() - qtail.log())
    ce = -lq.gather(1, tokens[1:][valid][:, None]).squeeze(1)
    loss = kd.mean() + 0.1 * ce.mean()
    if moe:
        loss = loss + AUX * load_balancing_loss(router_logits)
    loss.backward()
    for t in params.values():
        t.grad = None

nparams = sum(t.numel() for t in params.values())
active = nparams - (L * (E - TOPK) * 3 * C * MI if moe else 0)
flops = 6 * (active - V * C) * N + 2 * V * C * N
att = sum((b - a) ** 2 / 2 for a, b in zip(starts, starts[1:]))
flops += L * 2 * 2 * att * H * D * 3
step()
t0 = time.perf_counter(); n = 3
for _ in range(n):
    step()
sec = (time.perf_counter() - t0) / n
a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
a @ b
t0 = time.perf_counter()
for _ in range(10):
    a @ b
mm = 2 * 1024 ** 3 * 10 / (time.perf_counter() - t0) / 1e9
print(f"torch {torch.__version__} threads={threads} params={nparams/1e6:.2f}M{' (moe 8x512 top-2)' if moe else ''}: {N/sec:.1f} tokens/s, "
      f"{flops/sec/1e9:.2f} GFLOP/s step; plain 1024^3 matmul {mm:.2f} GFLOP/s")
