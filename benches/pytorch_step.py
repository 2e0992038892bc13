"""One training step of the same Llama, batch and optimizer in PyTorch on the CPU.

Reads examples/models/llama-10m.yaml and examples/parallel/cpu-b4-s256.yaml (flat
`key: value` lines and one-line flow maps), builds the model with plain torch.nn
(RMSNorm, rotate-half RoPE, grouped-query attention through scaled_dot_product_attention,
SiLU MLP, untied head), and prints the mean seconds per step after one warm-up step.
"""

import argparse
import math
import os
import re
import time

import torch
import torch.nn.functional as F
from torch import nn


def flat_yaml(path):
    """`key: value` pairs of a simple YAML file; flow maps `{a: 1, b: 2}` become dicts."""
    out = {}
    for line in open(path):
        line = line.split("#", 1)[0].rstrip()
        if not line or line.startswith(" ") or ":" not in line:
            continue
        key, value = line.split(":", 1)
        value = value.strip()
        if value.startswith("{"):
            out[key] = {k: v for k, v in re.findall(r"(\w+):\s*([^,{}\[\]]+|\[[^\]]*\])", value)}
        else:
            out[key] = value
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, h, kv, hd, f = c["dim"], c["n_heads"], c["n_kv_heads"], c["head_dim"], c["ffn_dim"]
        self.h, self.kv, self.hd = h, kv, hd
        self.attention_norm = RMSNorm(d, c["norm_eps"])
        self.q = nn.Linear(d, h * hd, bias=False)
        self.k = nn.Linear(d, kv * hd, bias=False)
        self.v = nn.Linear(d, kv * hd, bias=False)
        self.o = nn.Linear(h * hd, d, bias=False)
        self.ffn_norm = RMSNorm(d, c["norm_eps"])
        self.gate = nn.Linear(d, f, bias=False)
        self.up = nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        hn = self.attention_norm(x)
        q = rope(self.q(hn).view(b, s, self.h, self.hd).transpose(1, 2), cos, sin)
        k = rope(self.k(hn).view(b, s, self.kv, self.hd).transpose(1, 2), cos, sin)
        v = self.v(hn).view(b, s, self.kv, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, self.h * self.hd))
        hn = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(hn)) * self.up(hn))


class Llama(nn.Module):
    def __init__(self, c, seq):
        super().__init__()
        self.embed = nn.Embedding(c["vocab_size"], c["dim"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["n_layers"]))
        self.norm = RMSNorm(c["dim"], c["norm_eps"])
        self.head = nn.Linear(c["dim"], c["vocab_size"], bias=False)
        hd = c["head_dim"]
        inv = c["rope_theta"] ** (-torch.arange(0, hd // 2, dtype=torch.float64) * 2 / hd)
        ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
        ang = torch.cat([ang, ang], dim=-1).float()
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="examples/models/llama-10m.yaml")
    ap.add_argument("--parallel", default="examples/parallel/cpu-b4-s256.yaml")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    m, p = flat_yaml(args.model), flat_yaml(args.parallel)
    c = {k: int(m[k]) for k in ["vocab_size", "dim", "n_layers", "n_heads", "ffn_dim"]}
    c["n_kv_heads"] = int(m.get("n_kv_heads", c["n_heads"]))
    c["head_dim"] = c["dim"] // c["n_heads"]
    c["norm_eps"] = float(m.get("norm_eps", 1e-5))
    c["rope_theta"] = float(m.get("rope_theta", 10000))
    batch, seq = int(p["batch"]["per_rank"]), int(p["batch"]["seq_len"])
    adamw = dict(re.findall(r"(\w+):\s*([^,{}\[\]]+|\[[^\]]*\])", open(args.parallel).read().split("adamw:", 1)[1].split("}", 1)[0]))
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count())
    model = Llama(c, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=float(adamw["lr"]), betas=tuple(float(b) for b in adamw["betas"].strip("[]").split(",")), weight_decay=float(adamw["weight_decay"]))
    clip = float(p.get("grad_clip", 1.0))
    gen = torch.Generator().manual_seed(0)

    def step():
        tokens = torch.randint(0, c["vocab_size"], (batch, seq), generator=gen)
        targets = torch.randint(0, c["vocab_size"], (batch, seq), generator=gen)
        loss = model(tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        return loss.item()

    step()
    start = time.perf_counter()
    for _ in range(args.steps - 1):
        step()
    print((time.perf_counter() - start) / (args.steps - 1))


if __name__ == "__main__":
    main()
