#!/usr/bin/python3
"""Independent reference for the teacher forward: a PyTorch re-implementation
of HF transformers' modeling files (LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, Qwen3MoeForCausalLM; transformers 4.5x semantics), run on
each sample ALONE (no packing), in fp32 on the CPU.

It reads a checkpoint directory written by `student init` (config.json +
model.safetensors, parsed here by hand: no safetensors package needed), runs
a fixed set of samples, and writes golden.json beside the checkpoint with the
top-K ids and log-probs (log_softmax over the full vocabulary) of every
position. The Go tests compare against it.

Run with Debian's python3-torch:  /usr/bin/python3 hf_reference.py DIR [DIR...]
Regenerate everything:            bash infer/testdata/make_goldens.sh
"""
import json
import math
import struct
import sys

import numpy as np
import torch

torch.set_grad_enabled(False)
K = 16


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    hdr = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, e in hdr.items():
        if name == "__metadata__":
            continue
        b, en = e["data_offsets"]
        raw = data[base + b : base + en]
        if e["dtype"] == "BF16":
            a = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            t = torch.from_numpy(a.view(np.float32).copy())
        elif e["dtype"] == "F32":
            t = torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy())
        else:
            raise SystemExit(f"{path}: tensor {name}: dtype {e['dtype']} not handled")
        out[name] = t.reshape(e["shape"])
    return out


class RMSNorm:  # LlamaRMSNorm / Qwen2RMSNorm / Qwen3RMSNorm
    def __init__(self, w, eps):
        self.w, self.eps = w, eps

    def __call__(self, x):
        x = x.to(torch.float32)
        var = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.eps)
        return self.w * x


def inv_freq(cfg):
    # ROPE_INIT_FUNCTIONS["default"] and ["llama3"].
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg["model_type"] == "qwen2":
        dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    base = cfg.get("rope_theta", 10000.0)
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.get("rope_scaling")
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        low_wav, high_wav = old / low, old / high
        wav = 2 * math.pi / inv
        inv_l = torch.where(wav > low_wav, inv / factor, inv)
        smooth = (old / wav - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wav < high_wav) * ~(wav > low_wav)
        inv = torch.where(medium, smoothed, inv_l)
    return inv, dim


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def linear(x, W, name):
    y = x @ W[name + ".weight"].T
    if name + ".bias" in W:
        y = y + W[name + ".bias"]
    return y


def forward(cfg, W, ids):
    """ids: one sample (list) or a batch of equal-length samples (B,T)."""
    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids[None]
    B, T = ids.shape
    H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    eps = cfg["rms_norm_eps"]
    inv, hd = inv_freq(cfg)
    pos = torch.arange(T)[None, :]
    freqs = (inv[None, :, None].float() @ pos[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # (1,1,T,hd)
    mask = torch.full((T, T), float("-inf")).triu(1)
    x = W["model.embed_tokens.weight"][ids]  # (B,T,H)
    qk_norm = cfg["model_type"] in ("qwen3", "qwen3_moe")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        res = x
        h = RMSNorm(W[p + "input_layernorm.weight"], eps)(x)
        q = linear(h, W, p + "self_attn.q_proj").view(B, T, nh, hd)
        k = linear(h, W, p + "self_attn.k_proj").view(B, T, nkv, hd)
        v = linear(h, W, p + "self_attn.v_proj").view(B, T, nkv, hd)
        if qk_norm:
            q = RMSNorm(W[p + "self_attn.q_norm.weight"], eps)(q)
            k = RMSNorm(W[p + "self_attn.k_norm.weight"], eps)(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = nh // nkv  # repeat_kv
        k = k[:, :, None].expand(B, nkv, rep, T, hd).reshape(B, nh, T, hd)
        v = v[:, :, None].expand(B, nkv, rep, T, hd).reshape(B, nh, T, hd)
        a = q @ k.transpose(2, 3) * hd**-0.5 + mask
        a = torch.softmax(a, dim=-1, dtype=torch.float32)
        o = (a @ v).transpose(1, 2).reshape(B, T, nh * hd)
        x = res + linear(o, W, p + "self_attn.o_proj")
        res = x
        h = RMSNorm(W[p + "post_attention_layernorm.weight"], eps)(x)
        if p + "mlp.gate.weight" in W:
            x = res + moe_block(cfg, W, p + "mlp.", h.reshape(B * T, H)).view(B, T, H)
        else:
            g = linear(h, W, p + "mlp.gate_proj")
            x = res + linear(torch.nn.functional.silu(g) * linear(h, W, p + "mlp.up_proj"), W, p + "mlp.down_proj")
    x = RMSNorm(W["model.norm.weight"], eps)(x)
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    logits = (x @ head.T).float()  # (B, T, vocab)
    return logits[0] if B == 1 else logits


def moe_block(cfg, W, p, h):  # Qwen3MoeSparseMoeBlock.forward
    E, topk = cfg["num_experts"], cfg["num_experts_per_tok"]
    logits = h @ W[p + "gate.weight"].T
    rw = torch.softmax(logits, dim=1, dtype=torch.float)
    rw, sel = torch.topk(rw, topk, dim=-1)
    if cfg["norm_topk_prob"]:
        rw = rw / rw.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(h)
    emask = torch.nn.functional.one_hot(sel, num_classes=E).permute(2, 1, 0)
    for e in range(E):
        idx, top_x = torch.where(emask[e])
        cur = h[top_x]
        ep = f"{p}experts.{e}."
        y = linear(torch.nn.functional.silu(linear(cur, W, ep + "gate_proj")) * linear(cur, W, ep + "up_proj"), W, ep + "down_proj")
        out.index_add_(0, top_x, y * rw[top_x, idx, None])
    return out


def samples_for(vocab, seed):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, vocab, size=n).tolist() for n in (1, 7, 33, 130)]


def main(dirs):
    for d in dirs:
        cfg = json.load(open(f"{d}/config.json"))
        W = load_safetensors(f"{d}/model.safetensors")
        samples = samples_for(cfg["vocab_size"], 1234)
        runs = []
        for temp in (1.0, 0.7):
            ids_out, lp_out = [], []
            for s in samples:
                logits = forward(cfg, W, s) / temp
                lp = torch.log_softmax(logits, dim=-1)
                v, i = torch.topk(lp, K, dim=-1)
                ids_out.append(i.tolist())
                lp_out.append(v.tolist())
            runs.append({"temperature": temp, "topk_ids": ids_out, "topk_logprobs": lp_out})
        with open(f"{d}/golden.json", "w") as f:
            json.dump({"generator": "infer/testdata/hf_reference.py", "torch": torch.__version__,
                       "k": K, "samples": samples, "runs": runs}, f)
        print(f"{d}: {sum(map(len, samples))} positions, torch {torch.__version__}")


if __name__ == "__main__":
    main(sys.argv[1:])
