#!/usr/bin/env python3
# @@HEADER@@
#
# Run it with one process per rank:
#   torchrun --nproc-per-node N train.py [--steps K] [--log-file FILE] [--init-from W.safetensors]
#            [--device cpu|cuda] [--track-memory]
# (`--log FILE` works when the script is started without torchrun, whose parser reads `--log`
# as its own `--log-dir`.) gloo on the CPU, NCCL on GPUs. It needs torch (2.6 or later: the public FSDP2 API) and,
# for --init-from, safetensors. One JSON line per step goes to --log-file (and the last one to
# stdout): step, loss, step_seconds, tokens_per_second, peak_allocated, peak_reserved
# (bytes; on a GPU torch.cuda.max_memory_*, on the CPU with --track-memory FSDPMemTracker's
# peak, else null). `shardplan plan --compare FILE` reads that file as it is. A plan with
# context parallelism (CONTEXT) runs on GPUs only (torch's context_parallel attends in CUDA's
# SDPA kernels); on the CPU, --check-context-layout shows how its sequences are split.
#
# Everything the plan decided is written below as literals; the code after them is the same
# for every plan. Editing a literal changes the run, and the run is then no longer the plan.

# @@PLAN@@

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import shutil
import struct
import sys
import time

# The caching allocator the plan was made for, set before torch starts CUDA. A setting
# already in the environment is kept (the run may then hold memory otherwise than planned).
if ALLOCATOR["expandable_segments"] and not ({"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} & set(os.environ)):
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

try:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4 / 2.5
    from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
MASK64 = (1 << 64) - 1


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Train the model of a shardplan plan under PyTorch FSDP2, as planned.")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps (the learning-rate schedule spans them)")
    # `--log-file`: torchrun's own parser takes `--log` for an abbreviation of its `--log-dir`.
    ap.add_argument("--log-file", "--log", dest="log", default=None,
                    help="append one JSON line per step to this file (rank 0)")
    ap.add_argument("--init-from", default=None, help="initial weights: a safetensors file with Hugging Face names")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--track-memory", action="store_true",
                    help="CPU: measure each step's peak (slower; --memory-meter says how)")
    ap.add_argument("--memory-meter", choices=["auto", "tracker", "profiler"], default="auto",
                    help="CPU, with --track-memory: FSDPMemTracker, or the CPU allocator under torch.profiler "
                         "(auto: the profiler when compiled, which FSDPMemTracker cannot measure)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per process (default: torch's)")
    ap.add_argument("--alloc-trace", default=None,
                    help="write rank 0's allocator requests, from the parameters' materialisation to the last "
                         "step, to this file (JSON lines) for `shardplan plan --alloc-trace`")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="save torch.distributed.checkpoint (DCP) checkpoints here (step-N/), at the end and every --checkpoint-every steps")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    ap.add_argument("--keep-latest", type=int, default=3, help="complete checkpoints to keep (older ones are removed)")
    ap.add_argument("--names", choices=["hf", "torchtitan"], default="hf",
                    help="checkpoint parameter names: Hugging Face's (shardplan's), or torchtitan's for its Llama 3 "
                         "(layers.0.attention.wq.weight, wq and wk in its rotary layout)")
    ap.add_argument("--check-context-layout", action="store_true",
                    help="context parallelism: shard the first micro-batch as a step does, print each rank's "
                         "token positions (JSON lines) and run the forward as far as it goes, then stop "
                         "(the CPU stops at the first attention)")
    ap.add_argument("--resume", default=None,
                    help="continue from a DCP checkpoint: a step-N folder, or the newest complete one in this folder "
                         "(this program's or `shardplan train --checkpoint-format dcp`'s, on any mesh)")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error("--steps must be at least 1")
    if a.checkpoint_every < 0 or a.keep_latest < 1:
        ap.error("--checkpoint-every must be at least 0 and --keep-latest at least 1")
    return a


# ---------------------------------------------------------------- shardplan's counter-based generator
# Every initial weight and every batch is a pure function of (seed, stream, index), as in
# `shardplan train`, so both runs see the same numbers on any mesh.

def _signed(x):
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _srl(z, k):
    """Logical right shift of int64 tensors holding uint64 bits."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z):
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic)."""
    z = (z ^ _srl(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _srl(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ _srl(z, 31)


def _mix_int(z):
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(seed, stream, index):
    """Uniforms in (0, 1), float64, for an int64 tensor of indices."""
    base = (_mix_int(_mix_int(seed ^ 0x5851F42D4C957F2D) + stream)) & MASK64
    h = _mix(index + _signed(base))
    return (_srl(h, 11).to(torch.float64) + 0.5) / float(1 << 53)


def normal(seed, stream, index):
    """Standard normals (Box-Muller on each even/odd pair), float64."""
    pair = index & ~1
    u1, u2 = uniform(seed, stream, pair), uniform(seed, stream, pair + 1)
    r = torch.sqrt(-2.0 * torch.log(u1))
    angle = 2.0 * math.pi * u2
    return torch.where((index & 1) == 0, r * torch.cos(angle), r * torch.sin(angle))


# ---------------------------------------------------------------- the model, as shardplan traces it
# Module paths are shardplan's scopes (what `wrap_modules` and the groups name); parameter
# names are Hugging Face's, mapped in hf_names().

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x):
        # Normalised in f32, then scaled in the compute dtype (torchtitan's and HF's order;
        # shardplan's fused kernel rounds once, after the scale: equal in f32).
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


class LayerNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight [in, out], y = x @ W + b."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x):
        y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return y.view(*x.shape[:-1], y.shape[-1])


def activation(name):
    return {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "relu": F.relu,
    }[name]


def attention(q, k, v):
    """Causal attention; q [b, s, h, d], k and v [b, s, kv, d] -> [b, s, h, d]. Under
    context parallelism torch's context_parallel has replaced F.scaled_dot_product_attention
    by its ring attention over the context group (q, k, v this rank's rows); each k/v head
    is then repeated for its query heads, as torchtitan does, since the ring's kernels take
    no `enable_gqa` (the same numbers)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if k.shape[1] != q.shape[1] and CONTEXT is not None:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if k.shape[1] != q.shape[1]:
        # Each k/v head serves heads / kv_heads query heads, read in place (torch >= 2.5).
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


# Under context parallelism, while a step runs: this rank's rows of the whole sequence's
# rotary tables (cos, sin), f64 [local, 1, head_dim], sharded by torch's context_parallel
# with the tokens (the rows' global positions, torchtitan's `freqs_cis` buffer).
CONTEXT_ROPE = [None]


def rope_tables(inv_freq, factor, seq, device="cpu"):
    """cos and sin of every position below `seq`, f64 [seq, 1, head_dim] (rotate-half),
    each in a storage of its own."""
    pos = torch.arange(seq, dtype=torch.float64)
    ang = torch.outer(pos, torch.tensor(inv_freq, dtype=torch.float64))
    ang = torch.cat((ang, ang), dim=-1)
    cos, sin = (ang.cos() * factor), (ang.sin() * factor)
    return cos[:, None, :].to(device).clone(), sin[:, None, :].to(device).clone()


class Rope:
    """Rotary tables (rotate-half), from the plan's inverse frequencies, in f64 then cast."""

    def __init__(self, inv_freq, factor):
        self.inv_freq, self.factor, self.cache = inv_freq, factor, {}

    def tables(self, seq, dtype, device):
        if CONTEXT_ROPE[0] is not None:
            cos, sin = CONTEXT_ROPE[0]
            if cos.shape[0] != seq:
                raise RuntimeError(f"context parallelism: {seq} rows of a sequence, {cos.shape[0]} rotary rows")
            return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)
        key = (seq, dtype, str(device))
        if key not in self.cache:
            cos, sin = rope_tables(self.inv_freq, self.factor, seq)
            self.cache[key] = (cos.to(dtype).to(device), sin.to(dtype).to(device))
        return self.cache[key]

    def apply(self, x):
        """x [b, s, h, d]: x * cos + rotate_half(x) * sin."""
        cos, sin = self.tables(x.shape[1], x.dtype, x.device)
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, m, rope):
        super().__init__()
        hd = m["head_dim"]
        self.heads, self.kv_heads, self.head_dim, self.rope = m["n_heads"], m["n_kv_heads"], hd, rope
        bias = m["qkv_bias"]
        self.q_proj = nn.Linear(m["dim"], m["n_heads"] * hd, bias=bias)
        self.k_proj = nn.Linear(m["dim"], m["n_kv_heads"] * hd, bias=bias)
        self.v_proj = nn.Linear(m["dim"], m["n_kv_heads"] * hd, bias=bias)
        self.o_proj = nn.Linear(m["n_heads"] * hd, m["dim"], bias=False)
        if m["qk_norm"]:
            # Qwen3: each head's queries and keys normalised over head_dim, before rotary.
            self.q_norm = RMSNorm(hd, m["norm_eps"])
            self.k_norm = RMSNorm(hd, m["norm_eps"])
        self.qk_norm = m["qk_norm"]

    def forward(self, x):
        # Under tensor parallelism the projections' outputs hold this rank's heads only
        # (ColwiseParallel's local output), so the head counts are read from the shapes.
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        a = attention(self.rope.apply(q), self.rope.apply(k), v)
        return self.o_proj(a.reshape(b, s, -1))


class LlamaMlp(nn.Module):
    def __init__(self, m, width=None):
        super().__init__()
        width = width or m["ffn_dim"]
        self.gate_proj = nn.Linear(m["dim"], width, bias=False)
        self.up_proj = nn.Linear(m["dim"], width, bias=False)
        self.down_proj = nn.Linear(width, m["dim"], bias=False)
        self.act = activation(m["activation"])

    # Set by apply_tensor_parallel on a mixture of experts' experts: the weights are this
    # tensor rank's slices (DTensors), multiplied as plain tensors, the output partial.
    local_slices = False

    def forward(self, x):
        if self.local_slices:
            gate, up, down = (local(p.weight) for p in (self.gate_proj, self.up_proj, self.down_proj))
            return F.linear(self.act(F.linear(x, gate)) * F.linear(x, up), down)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def local(t):
    """This tensor rank's block of a DTensor `t` as a plain tensor whose gradient reaches
    `t` with its placements; a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def tp_summed(t):
    """`t` itself, its gradient summed over the tensor group (each tensor rank's gradient
    is a partial sum there); `t` itself without tensor parallelism."""
    if TENSOR_MESH[0] is None:
        return t
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(t, TENSOR_MESH[0], [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


# Set while the routed experts run: their matmuls are shardplan's grouped matmuls, which
# selective checkpointing neither counts nor saves (see selective_policy).
IN_EXPERTS = [False]


def top_k(scores, k):
    """Each row's k highest scores' columns, highest first, ties to the lower column."""
    return torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[:, :k]


class Experts(nn.ModuleDict):
    """The routed experts this rank holds, keyed by their number in the whole model (every
    expert without expert parallelism), with a forward so that FSDP2's hooks fire when
    their module is a unit of its own: each expert's SwiGLU on its run of `rows`, which
    are in the experts' order."""

    def forward(self, rows, runs):
        IN_EXPERTS[0] = True
        try:
            return torch.cat([expert(part) for expert, part in zip(self.values(), rows.split(runs))])
        finally:
            IN_EXPERTS[0] = False


def expert_rank():
    """This rank's place in its expert group: the group is `MESH["expert"]` consecutive
    shards of one replica (ranks of one tensor group share a shard), so the rank's shard
    number modulo the degree."""
    if MESH["expert"] == 1 or not dist.is_initialized():
        return 0
    return dist.get_rank() // MESH.get("tensor", 1) % MESH["expert"]


# The expert group's process group (all-to-all), set by make_mesh under expert parallelism.
EXPERT_GROUP = [None]


def all_to_all(x, send, recv):
    """Rows `x` split by `send` (rows per member of the expert group) exchanged for `recv`
    rows from each member, in member order; backward sends the gradients back."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x.contiguous(), recv, send, EXPERT_GROUP[0])


class MoeFfn(nn.Module):
    """The mixture-of-experts feed-forward as Hugging Face's Mixtral / Qwen2-MoE / Qwen3-MoE
    compute it, without dropping: f32 router scores, each token's top_k experts weighted by
    their scores (divided by their sum with norm_topk_prob), every expert's SwiGLU on the
    rows routed to it, and the shared expert behind its sigmoid gate on every token. Every
    expert runs, on no rows where none came: its gradient is then zeros, never None, so
    every rank reduce-scatters every expert's gradient. The rows are permuted once into
    expert order and each expert reads its run of them in place, as shardplan's grouped
    matmul does.

    Under expert parallelism (torchtitan's): each rank of an expert group of `MESH["expert"]`
    ranks holds a contiguous share of the experts; the rows go to the rank holding their
    expert and come back with all-to-all, in the order shardplan's dispatch uses (by local
    expert, then by the rank they came from).

    Under tensor parallelism (shardplan's layout, torchtitan's expert tensor parallelism):
    every tensor rank routes every token of its group the same way, from the whole input
    (gathered by the block's PrepareModuleInputOutput), and holds a slice of each expert's
    hidden units (and of the shared expert's), so its output is partial, summed by the
    block's output layout. The experts' input and the routing weights are read through
    `tp_summed`, as the shared expert gate's weight is: their gradients meet the partial
    outputs."""

    def __init__(self, m):
        super().__init__()
        moe = m["moe"]
        self.k, self.sigmoid, self.norm = moe["top_k"], moe["router"] == "sigmoid_topk", moe["norm_topk_prob"]
        self.n_experts, self.degree = moe["experts"], MESH["expert"]
        self.gate = nn.Linear(m["dim"], moe["experts"], bias=False)
        local = moe["experts"] // self.degree
        first = expert_rank() * local
        self.experts = Experts({str(e): LlamaMlp(m, moe["expert_ffn_dim"]) for e in range(first, first + local)})
        if moe["shared_expert_ffn_dim"]:
            self.shared_expert = LlamaMlp(m, moe["shared_expert_ffn_dim"])
            if moe["shared_expert_gate"]:
                self.shared_expert_gate = nn.Linear(m["dim"], 1, bias=False)

    def routed(self, rows, counts):
        """`rows` in expert order, `counts` rows per expert (of every expert) -> each row
        through its expert, in the same order."""
        if self.degree == 1:
            return self.experts(rows, counts.tolist())
        d, local = self.degree, self.n_experts // self.degree
        # The activations live on the process group's device (CUDA under NCCL).
        device = rows.device
        # Every member learns how many rows each member sends each of its experts.
        got = torch.empty(counts.shape, dtype=counts.dtype, device=device)
        dist.all_to_all_single(got, counts, group=EXPERT_GROUP[0])
        send = counts.view(d, local).sum(dim=1).tolist()
        table = got.view(d, local)
        recv = table.sum(dim=1).tolist()
        arrived = all_to_all(rows, send, recv)
        # From (source, expert) order to (expert, source) order, and back after the experts.
        expert_of = torch.repeat_interleave(torch.arange(local, device=device).repeat(d), got)
        order = torch.sort(expert_of, stable=True).indices
        out = self.experts(arrived[order], table.sum(dim=0).tolist())
        return all_to_all(out[torch.argsort(order)], recv, send)

    def forward(self, x):
        """x [b, s, dim] -> (y [b, s, dim], the router's f32 logits [b * s, experts])."""
        b, s, d = x.shape
        h = x.reshape(-1, d)
        logits = self.gate(h).float()
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        ids = top_k(scores, self.k)
        w = scores.gather(1, ids)
        if self.norm:
            w = w / w.sum(dim=-1, keepdim=True)
        w = tp_summed(w.to(x.dtype)).reshape(-1)
        h = tp_summed(h)
        # The tokens' rows in expert order (by token, then choice, within an expert), each
        # expert on its run of them, scaled by their weights, put back in token order and
        # summed over each token's choices (a gather and a sum save no rows for backward,
        # where index_add would keep its [tokens x top_k, dim] source).
        picks = ids.reshape(-1)
        order = torch.sort(picks, stable=True).indices
        rows = h[order // self.k]
        out = self.routed(rows, torch.bincount(picks, minlength=self.n_experts))
        scaled = out * w[order, None]
        y = scaled[torch.argsort(order)].view(-1, self.k, d).sum(dim=1)
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(h)
            if hasattr(self, "shared_expert_gate"):
                shared = torch.sigmoid(F.linear(h, tp_summed(self.shared_expert_gate.weight))) * shared
            y = y + shared
        return y.view(b, s, d), logits


def moe_aux_loss(logits, k, coef):
    """The load-balancing loss over every MoE layer's tokens together (Hugging Face's
    load_balancing_loss_func): coef x experts x sum_e (share of the top-k picks) x (mean
    softmax probability), the picks held constant."""
    p = torch.cat(logits, dim=0).softmax(dim=-1)
    picks = top_k(p, k).reshape(-1)
    share = torch.zeros(p.shape[1], dtype=p.dtype, device=p.device).index_add_(
        0, picks, torch.ones_like(picks, dtype=p.dtype)) / p.shape[0]
    return coef * p.shape[1] * (share * p.mean(dim=0)).sum()


def is_moe_layer(m, i):
    moe = m.get("moe")
    return (bool(moe) and i >= moe["first_dense"] and moe["every"] > 0 and (i + 1) % moe["every"] == 0
            and i not in moe.get("dense_layers", []))


# The router logits of each MoE block of the forward pass under way, for the load-balancing
# loss. They leave the block beside its output rather than as a second output: FSDP2 runs a
# module's pre-backward hook once per output that receives a gradient, and the second run
# would issue the block's backward prefetches again (its experts' unit, resharded by then,
# gathered a second time). The logits also steer the block's output (the routing weights),
# so their gradient is never computed before the block's pre-backward has unsharded it.
ROUTER_LOGITS = []


class Block(nn.Module):
    """A transformer block; `checkpoint` (set by apply_checkpointing) recomputes it in backward."""

    checkpoint = None

    def forward(self, x):
        if self.checkpoint is None:
            out = self.body(x)
        else:
            from torch.utils.checkpoint import checkpoint
            out = checkpoint(self.body, x, use_reentrant=False, **self.checkpoint())
        if isinstance(out, tuple):
            out, logits = out
            ROUTER_LOGITS.append(logits)
        return out


class LlamaBlock(Block):
    """Returns x, or (x, the router's logits) with the MoE feed-forward."""

    def __init__(self, m, rope, moe=False):
        super().__init__()
        self.attention_norm = RMSNorm(m["dim"], m["norm_eps"])
        self.attention = LlamaAttention(m, rope)
        self.ffn_norm = RMSNorm(m["dim"], m["norm_eps"])
        self.moe = moe
        self.feed_forward = MoeFfn(m) if moe else LlamaMlp(m)

    def body(self, x):
        x = x + self.attention(self.attention_norm(x))
        if self.moe:
            y, logits = self.feed_forward(self.ffn_norm(x))
            return x + y, logits
        return x + self.feed_forward(self.ffn_norm(x))


class Head(nn.Module):
    """The output projection tied to the token embedding `table` (it holds no weight)."""

    def __init__(self, table):
        super().__init__()
        self.table = [table]  # a list: not a submodule

    def forward(self, x):
        return F.linear(x, self.table[0].weight)


class Loss(nn.Module):
    def forward(self, logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class Llama(nn.Module):
    def __init__(self, m):
        super().__init__()
        rope = Rope(m["rope_inv_freq"], m["rope_attention_factor"])
        self.tok_embeddings = nn.Embedding(m["vocab_size"], m["dim"])
        self.layers = nn.ModuleDict({str(i): LlamaBlock(m, rope, is_moe_layer(m, i)) for i in range(m["n_layers"])})
        self.norm = RMSNorm(m["dim"], m["norm_eps"])
        # An untied head is an nn.Linear, the module torch's ColwiseParallel shards.
        if m["tie_embeddings"]:
            self.output = Head(self.tok_embeddings)
        else:
            self.output = nn.Linear(m["dim"], m["vocab_size"], bias=False)
        self.loss = Loss()
        moe = m.get("moe")
        self.aux = (moe["top_k"], moe["aux_loss_coef"]) if moe and moe["aux_loss_coef"] > 0 else None

    def forward(self, tokens, targets):
        x = settled(self.tok_embeddings(tokens))
        ROUTER_LOGITS.clear()
        for layer in self.layers.values():
            x = layer(x)
        router_logits = ROUTER_LOGITS[:]
        ROUTER_LOGITS.clear()
        loss = self.loss(settled(self.output(self.norm(x))), targets)
        if self.aux is not None and router_logits:
            # Under loss parallelism the cross-entropy is a DTensor (the same on every
            # tensor rank), made whole before the plain load-balancing loss joins it.
            loss = whole_value(loss) + moe_aux_loss(router_logits, *self.aux)
        return loss

    @staticmethod
    def hf_names(m):
        """shardplan module path of each parameter -> its Hugging Face name."""
        names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
        if not m["tie_embeddings"]:
            names["output.weight"] = "lm_head.weight"
        for i in range(m["n_layers"]):
            p, q = f"layers.{i}", f"model.layers.{i}"
            names[f"{p}.attention_norm.weight"] = f"{q}.input_layernorm.weight"
            names[f"{p}.ffn_norm.weight"] = f"{q}.post_attention_layernorm.weight"
            for proj in ["q_proj", "k_proj", "v_proj", "o_proj"]:
                names[f"{p}.attention.{proj}.weight"] = f"{q}.self_attn.{proj}.weight"
            if m["qkv_bias"]:
                for proj in ["q_proj", "k_proj", "v_proj"]:
                    names[f"{p}.attention.{proj}.bias"] = f"{q}.self_attn.{proj}.bias"
            if m["qk_norm"]:
                for norm in ["q_norm", "k_norm"]:
                    names[f"{p}.attention.{norm}.weight"] = f"{q}.self_attn.{norm}.weight"
            if not is_moe_layer(m, i):
                for proj in ["gate_proj", "up_proj", "down_proj"]:
                    names[f"{p}.feed_forward.{proj}.weight"] = f"{q}.mlp.{proj}.weight"
                continue
            moe, f = m["moe"], f"{p}.feed_forward"
            if moe["names"] == "mixtral":
                hf, projs = f"{q}.block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
            else:
                hf, projs = f"{q}.mlp", {x: x for x in ["gate_proj", "up_proj", "down_proj"]}
            names[f"{f}.gate.weight"] = f"{hf}.gate.weight"
            for e in range(moe["experts"]):
                for proj, name in projs.items():
                    names[f"{f}.experts.{e}.{proj}.weight"] = f"{hf}.experts.{e}.{name}.weight"
            if moe["shared_expert_ffn_dim"]:
                for proj in ["gate_proj", "up_proj", "down_proj"]:
                    names[f"{f}.shared_expert.{proj}.weight"] = f"{hf}.shared_expert.{proj}.weight"
                if moe["shared_expert_gate"]:
                    names[f"{f}.shared_expert_gate.weight"] = f"{hf}.shared_expert_gate.weight"
        return names


class Gpt2Attention(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.heads, self.dim = m["n_heads"], m["dim"]
        self.c_attn = Conv1D(m["dim"], 3 * m["dim"])
        self.c_proj = Conv1D(m["dim"], m["dim"])

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads) for t in self.c_attn(x).split(d, dim=2))
        return self.c_proj(attention(q, k, v).reshape(b, s, d))


class Gpt2Mlp(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.c_fc = Conv1D(m["dim"], m["ffn_dim"])
        self.c_proj = Conv1D(m["ffn_dim"], m["dim"])
        self.act = activation(m["activation"])

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class Gpt2Block(Block):
    def __init__(self, m):
        super().__init__()
        self.ln_1 = LayerNorm(m["dim"], m["norm_eps"])
        self.attn = Gpt2Attention(m)
        self.ln_2 = LayerNorm(m["dim"], m["norm_eps"])
        self.mlp = Gpt2Mlp(m)

    def body(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt2(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.wte = nn.Embedding(m["vocab_size"], m["dim"])
        self.wpe = nn.Embedding(m["max_seq_len"], m["dim"])
        self.h = nn.ModuleDict({str(i): Gpt2Block(m) for i in range(m["n_layers"])})
        self.ln_f = LayerNorm(m["dim"], m["norm_eps"])
        self.lm_head = Head(self.wte)
        self.loss = Loss()

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
        for layer in self.h.values():
            x = layer(x)
        return self.loss(self.lm_head(self.ln_f(x)), targets)

    @staticmethod
    def hf_names(m):
        names = {
            "wte.weight": "transformer.wte.weight",
            "wpe.weight": "transformer.wpe.weight",
            "ln_f.weight": "transformer.ln_f.weight",
            "ln_f.bias": "transformer.ln_f.bias",
        }
        for i in range(m["n_layers"]):
            for sub in ["ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]:
                for leaf in ["weight", "bias"]:
                    names[f"h.{i}.{sub}.{leaf}"] = f"transformer.h.{i}.{sub}.{leaf}"
        return names


FAMILIES = {"llama": Llama, "gpt2": Gpt2}


def build_model():
    """The model on the meta device (weights are made after sharding, on each rank's shard)."""
    cls = FAMILIES[MODEL["family"]]
    with torch.device("meta"):
        model = cls(MODEL)
    every = cls.hf_names(MODEL)
    have = dict(model.named_parameters())
    # Under expert parallelism this rank builds its own experts only.
    names = {path: hf for path, hf in every.items() if path in have}
    planned = {name: shape for name, shape, _ in PARAMS}
    if set(names) != set(have) or set(every.values()) != set(planned):
        raise SystemExit("error: the model's parameters differ from the plan's PARAMS (was the program edited?)")
    for path, hf in names.items():
        if list(have[path].shape) != planned[hf]:
            raise SystemExit(f"error: {hf} has shape {list(have[path].shape)}, the plan says {planned[hf]}")
    return model, names


def module_at(model, path):
    return model if path == "<root>" else model.get_submodule(path)


# ---------------------------------------------------------------- the plan's decisions

def selective_policy(save):
    """torch.utils.checkpoint's op policy: keep attention and/or every (or every odd) matmul,
    counted per block in forward order as the plan counts them (the routed experts' grouped
    matmuls are not counted and are recomputed)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    attention_ops = {
        getattr(aten, n).default
        for n in [
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
        ]
        if hasattr(aten, n)
    }
    matmul_ops = {aten.mm.default, aten.addmm.default}

    def contexts():
        counts = {"forward": 0, "recompute": 0}

        def policy(ctx, func, *args, **kwargs):
            if func in attention_ops and "attention" in save:
                return CheckpointPolicy.MUST_SAVE
            if func in matmul_ops and IN_EXPERTS[0]:
                # The routed experts' projections: recomputed, and not in the count.
                return CheckpointPolicy.PREFER_RECOMPUTE
            if func in matmul_ops:
                mode = "recompute" if ctx.is_recompute else "forward"
                counts[mode] += 1
                if "matmuls" in save or ("odd_matmuls" in save and counts[mode] % 2 == 1):
                    return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        # A partial, not a lambda: torch.compile traces a checkpoint's context_fn only so.
        return {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}

    return contexts


def apply_checkpointing(model):
    """Activation checkpointing of the blocks the plan names, before sharding."""
    kind = CHECKPOINTING["kind"]
    if kind == "none":
        return
    make = selective_policy(CHECKPOINTING["save"]) if kind == "selective" else (lambda: {})
    for path in CHECKPOINTING["blocks"]:
        module_at(model, path).checkpoint = make


def apply_float8(model, names, device):
    """torchao's Float8 linears, swapped in as torchtitan's converter does (at build, before
    tensor parallelism, checkpointing, compile and fully_shard): the linears the plan names,
    by Hugging Face module path. On the CPU torchao emulates the float8 matmuls
    (`emulate=True`: each operand cast to float8 and read back, the product in f32)."""
    if FLOAT8 is None:
        return
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise SystemExit(f"error: the plan trains Float8 linears, which need torchao ({e}); pip install torchao")
    hf_modules = set(FLOAT8["linears"])
    paths = {path.removesuffix(".weight") for path, hf in names.items() if hf.removesuffix(".weight") in hf_modules}
    if len(paths) != len(hf_modules):
        raise SystemExit("error: the plan's Float8 linears are not all modules of this model (was the program edited?)")
    if FLOAT8["recipe"] == "tensorwise":
        config = Float8LinearConfig(
            enable_fsdp_float8_all_gather=FLOAT8["fsdp_float8_all_gather"],
            emulate=device.type != "cuda",
        )
    else:
        config = Float8LinearConfig.from_recipe_name(FLOAT8["recipe"])
        config = dataclasses.replace(config, emulate=device.type != "cuda")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn in paths)
    converted = {fqn for fqn, mod in model.named_modules() if type(mod).__name__ == "Float8Linear"}
    if converted != paths:
        raise SystemExit(f"error: torchao converted {sorted(converted ^ paths)} differently from the plan")


def precompute_float8_scales(modules):
    """The Float8 weights' scales for the next step's float8 all-gathers, one all-reduce of
    every amax after the optimizer step (torchao's precompute_float8_dynamic_scale_for_fsdp)."""
    if FLOAT8 is None or not FLOAT8["precompute_scale"]:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for m in modules:
        precompute_float8_dynamic_scale_for_fsdp(m)


def apply_compile(model):
    """torch.compile as torchtitan applies it, after checkpointing and before fully_shard:
    each block compiled on its own (in place, so it stays the module FSDP2 wraps and its
    parameters keep their names; a whole graph, but a block with routed experts, whose
    all-to-all and router logits break it), and the loss function."""
    if (COMPILE["model"] or COMPILE["loss"]) and TENSOR is not None:
        rank_compile_cache()
    if COMPILE["model"] and CHECKPOINTING["kind"] == "selective":
        # The op policy counts matmuls in a dict; under a compiled checkpoint that count is
        # a forward side effect dynamo would replay in backward unless told to skip it.
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    if COMPILE["model"]:
        for block in [m for m in model.modules() if isinstance(m, Block)]:
            block.compile(fullgraph=not getattr(block, "moe", False))
    if COMPILE["loss"]:
        model.loss.compile()


def settled(x):
    """`x` as a compiled module can take it in and pass a gradient back through: an eager
    DTensor collective's output (an AsyncCollectiveTensor: the embedding's or the head's
    under tensor parallelism) copied out, else `x` itself. torch 2.15 drops the gradient of
    a compiled region's AsyncCollectiveTensor input (the embedding's gradient came back
    zero on 4 CPU ranks), and a copy outside the region keeps it."""
    if (COMPILE["model"] or COMPILE["loss"]) and isinstance(x, AsyncCollectiveTensor):
        return x.clone()
    return x


def rank_compile_cache():
    """Inductor's on-disk cache, one directory a rank. A compiled tensor-parallel graph
    names its tensor group's process group, and torch 2.15's cache key leaves the name out:
    a rank of another tensor group that loads the graph stops with "Could not resolve the
    process group registered under the name N" (seen on the second run of 4 CPU ranks)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    base, leaf = cache_dir(), f"rank{dist.get_rank()}"
    if os.path.basename(base) != leaf:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, leaf)


# ---------------------------------------------------------------- tensor parallelism
# torchtitan's Llama plan with DTensor, applied before checkpointing, compile and
# fully_shard: per block the q/k/v and gate/up projections column-wise and the attention
# output and down projections row-wise; with sequence parallelism the norms run on a
# sequence chunk (SequenceParallel), the blocks' inputs all-gathered into attention and the
# feed-forward (PrepareModuleInput) and the row-wise outputs reduce-scattered back; the
# embedding row-wise and the output projection column-wise, split by vocabulary, the
# cross-entropy on the vocabulary-split logits under loss_parallel(). Without sequence
# parallelism the blocks' outputs are all-reduced. A vocabulary the group does not divide
# stays whole on every rank (shardplan's plan): its embedding's output is cut to this rank's
# chunk of the sequence and the head's input gathered.

def tensor_plan():
    """parallelize_module's plan for the whole model: {module path: style}."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   PrepareModuleOutput, RowwiseParallel, SequenceParallel)

    sp, lp, vocab = TENSOR["sequence_parallel"], TENSOR["loss_parallel"], TENSOR["split_vocab"]
    between = Shard(1) if sp else Replicate()
    plan = {}
    if vocab:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
        plan["output"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1) if lp else Replicate(),
                                         use_local_output=not lp)
    elif sp:
        plan["tok_embeddings"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        plan["output"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                            use_local_output=True)
    if sp:
        plan["norm"] = SequenceParallel()
    for i in range(MODEL["n_layers"]):
        p = f"layers.{i}"
        if sp:
            plan[f"{p}.attention_norm"] = SequenceParallel()
            plan[f"{p}.ffn_norm"] = SequenceParallel()
            plan[f"{p}.attention"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
        for proj in ["q_proj", "k_proj", "v_proj"]:
            plan[f"{p}.attention.{proj}"] = ColwiseParallel()
        if MODEL.get("qk_norm"):
            # Qwen3's per-head norms on this rank's heads (torchtitan's: the heads' dim
            # taken as sharded, the weight's gradient summed over the group).
            for norm in ["q_norm", "k_norm"]:
                plan[f"{p}.attention.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan[f"{p}.attention.o_proj"] = RowwiseParallel(output_layouts=between)
        if is_moe_layer(MODEL, i):
            # The whole input in (its gradient whole on every rank, see MoeFfn), the partial
            # output summed out to the layout between blocks; the router logits as they are.
            # The experts' slices are made by shard_expert_slices.
            plan[f"{p}.feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(between,), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Partial(), None), desired_output_layouts=(between, None), use_local_output=True)
            continue
        if sp:
            plan[f"{p}.feed_forward"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
        plan[f"{p}.feed_forward.gate_proj"] = ColwiseParallel()
        plan[f"{p}.feed_forward.up_proj"] = ColwiseParallel()
        plan[f"{p}.feed_forward.down_proj"] = RowwiseParallel(output_layouts=between)
    return plan


def apply_tensor_parallel(model, tp_mesh, device):
    """torchtitan's tensor-parallel plan over the tensor group; under async TP, inductor's
    micro-pipelined TP pass over symmetric memory (CUDA only)."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, tensor_plan())
    for block in model.layers.values():
        if getattr(block, "moe", False):
            shard_expert_slices(block.feed_forward, tp_mesh)
    if not TENSOR["async"]:
        return
    if device.type != "cuda":
        if dist.get_rank() == 0:
            print("note: async tensor parallelism needs CUDA's symmetric memory; on the CPU this program runs "
                  "the same steps without it", file=sys.stderr)
        return
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def shard_expert_slices(moe, tp_mesh):
    """Each routed expert's (and the shared expert's) slice on this tensor rank: the gate and
    up projections' hidden units (Shard(0)), the down projection's inputs (Shard(1)), as
    torchtitan's TensorParallel shards its grouped experts; the router and the shared
    expert's gate stay whole."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mlps = list(moe.experts.values()) + ([moe.shared_expert] if hasattr(moe, "shared_expert") else [])
    for mlp in mlps:
        for linear, dim in ((mlp.gate_proj, 0), (mlp.up_proj, 0), (mlp.down_proj, 1)):
            linear.weight = nn.Parameter(distribute_tensor(linear.weight, tp_mesh, [Shard(dim)]))
        mlp.local_slices = True


def whole_value(t):
    """A plain tensor of `t`: under loss parallelism the loss is a DTensor (the same on
    every tensor rank), made whole."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def loss_context():
    """torch's loss_parallel() around a forward and backward whose cross-entropy reads
    vocabulary-split logits; else nothing."""
    if TENSOR is not None and TENSOR["loss_parallel"] and TENSOR["split_vocab"]:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def make_mesh(device):
    """The data-parallel mesh, and under expert parallelism the routed experts' FSDP mesh:
    the ranks holding the same experts (every `expert`-th shard of a replica), with the
    expert groups' process group for the all-to-all."""
    from torch.distributed.device_mesh import init_device_mesh

    r, s, e, t = MESH["replicate"], MESH["shard"], MESH["expert"], MESH.get("tensor", 1)
    if CONTEXT is not None:
        return make_context_mesh(device, r, s, CONTEXT["degree"], t), None
    if t > 1:
        # One mesh of every axis, tensor innermost (consecutive ranks), sliced into FSDP's
        # data-parallel part and the tensor groups, as torchtitan's init_device_mesh.
        dims, names = ((r, s, t), ("replicate", "shard", "tensor")) if r > 1 else ((s, t), ("shard", "tensor"))
        world = init_device_mesh(device.type, dims, mesh_dim_names=names)
        TENSOR_MESH[0] = world["tensor"]
        dp = world["replicate", "shard"] if r > 1 else world["shard"]
        return dp, (tensor_expert_mesh(world, r, s, e) if e > 1 else None)
    if r > 1:
        mesh = init_device_mesh(device.type, (r, s), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (s,), mesh_dim_names=("shard",))
    if e == 1:
        return mesh, None
    if r > 1:
        ep = init_device_mesh(device.type, (r, s // e, e), mesh_dim_names=("replicate", "expert_shard", "expert"))
        experts = ep["replicate", "expert_shard"]
    else:
        ep = init_device_mesh(device.type, (s // e, e), mesh_dim_names=("expert_shard", "expert"))
        experts = ep["expert_shard"]
    EXPERT_GROUP[0] = ep.get_group("expert")
    return mesh, experts


def tensor_expert_mesh(world, r, s, e):
    """Under expert and tensor parallelism, the routed experts' FSDP mesh out of the same
    root as the tensor groups' (FSDP2 shards a DTensor over a mesh of one root): the shard
    axis unflattened into expert_shard x expert, the expert groups' process group for the
    all-to-all (ranks of one tensor rank)."""
    if not hasattr(world, "_unflatten"):
        raise SystemExit(f"error: expert parallelism under tensor parallelism needs DeviceMesh._unflatten, "
                         f"which torch {torch.__version__} does not have: install a newer torch")
    ep = world._unflatten("shard", (s // e, e), ("expert_shard", "expert"))
    EXPERT_GROUP[0] = ep.get_group("expert")
    return ep["replicate", "expert_shard"] if r > 1 else ep["expert_shard"]


def make_context_mesh(device, r, s, c, t):
    """torchtitan's mesh under context parallelism: replicate x shard x cp (x tensor), the
    context groups the innermost `c` ranks of the shard axis (inside them the tensor groups
    of `t`), and FSDP sharding over shard and cp together (`dp_shard_cp`, the plan's shard
    axis of `s` ranks). Returns FSDP's mesh (replicate x dp_shard_cp, or dp_shard_cp alone)
    and sets CONTEXT_MESH to the cp mesh (and TENSOR_MESH to the tensor groups')."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    tp = ((t,), ("tensor",)) if t > 1 else ((), ())
    if hasattr(DeviceMesh, "_unflatten"):
        # Newer torch: the cp mesh unflattened out of dp_shard_cp, as torchtitan now builds
        # it (slicing a flattened dim out of its root mesh is deprecated there).
        dims, names = ((r, s), ("replicate", "dp_shard_cp")) if r > 1 else ((s,), ("dp_shard_cp",))
        world = init_device_mesh(device.type, dims + tp[0], mesh_dim_names=names + tp[1])
        CONTEXT_MESH[0] = world._unflatten("dp_shard_cp", (s // c, c), ("shard", "cp"))["cp"]
        if t > 1:
            TENSOR_MESH[0] = world["tensor"]
            return world[names]
        return world
    world = init_device_mesh(device.type, (r, s // c, c) + tp[0], mesh_dim_names=("replicate", "shard", "cp") + tp[1])
    world["shard", "cp"]._flatten("dp_shard_cp")
    CONTEXT_MESH[0] = world["cp"]
    if t > 1:
        TENSOR_MESH[0] = world["tensor"]
    return world["replicate", "dp_shard_cp"] if r > 1 else world["dp_shard_cp"]


def fully_shard_policies(device):
    """fully_shard's keyword arguments of the plan: its mixed precision, and CPU offload
    when planned."""
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[MIXED_PRECISION["param"]],
                                            reduce_dtype=DTYPES[MIXED_PRECISION["reduce"]])}
    if OFFLOAD:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return kw


def apply_fully_shard(model, meshes, device):
    """fully_shard per planned group, innermost modules first, the root last. The routed
    experts' groups shard over the ranks holding the same experts (torchtitan's expert
    FSDP); their gradients are averaged over every data-parallel rank by
    `scale_expert_grads`."""
    mesh, expert_mesh = meshes
    kw = fully_shard_policies(device)
    order = sorted(range(len(GROUPS)), key=lambda i: (GROUPS[i]["modules"] == [],
                                                      -max((m.count(".") for m in GROUPS[i]["modules"]), default=0), i))
    for i in order:
        g = GROUPS[i]
        modules = [module_at(model, m) for m in g["modules"]] or [model]
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=expert_mesh if g["experts"] else mesh,
                    reshard_after_forward=g["reshard_after_forward"], **kw)


def set_prefetch(model):
    """The plan's all-gather issue order as FSDP2's explicit prefetch lists."""
    for key, targets in FORWARD_PREFETCH:
        module_at(model, key).set_modules_to_forward_prefetch([module_at(model, t) for t in targets])
    for key, targets in BACKWARD_PREFETCH:
        module_at(model, key).set_modules_to_backward_prefetch([module_at(model, t) for t in targets])


def chunk_of(span, parts, r):
    """torch.chunk's piece `r` of `parts` of the range `span` (start, end), as DTensor's
    Shard and FSDP2 cut a dim: pieces of ceil(len / parts), the last ones short or empty."""
    start, end = span
    size = -(-(end - start) // parts)
    lo = min(start + r * size, end)
    return lo, min(lo + size, end)


def local_region(param):
    """The block of the full parameter this rank holds, as one (start, end) per dim, and
    its local tensor: the tensor group's slice first (Shard(d) of the `tensor` mesh dim),
    then FSDP2's chunk of dim 0 of that slice over the data-parallel dim it shards."""
    mine = local(param)
    spans = [(0, n) for n in param.shape]
    if not hasattr(param, "device_mesh"):
        return spans, mine
    mesh, placements = param.device_mesh, param.placements
    names = mesh.mesh_dim_names or ()
    order = sorted(range(mesh.ndim), key=lambda i: names[i] != "tensor" if i < len(names) else True)
    for i in order:
        dim = getattr(placements[i], "dim", None)
        if placements[i].is_replicate() or placements[i].is_partial() or dim is None:
            continue
        spans[dim] = chunk_of(spans[dim], mesh.size(i), mesh.get_local_rank(i))
    return spans, mine


def region_indices(spans, shape, lo_row, hi_row):
    """Row-major indices in the full parameter of `shape` of the block `spans`, for rows
    lo_row..hi_row of the block (int64, flat)."""
    idx = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(shape))):
        a, b = (spans[d][0] + lo_row, spans[d][0] + hi_row) if d == 0 else spans[d]
        axis = torch.arange(a, b, dtype=torch.int64) * stride
        idx = axis.view([-1] + [1] * (len(shape) - 1 - d)) + idx
        stride *= shape[d]
    return idx.reshape(-1)


def init_weights(model, names, init_from):
    """Each rank writes its own rows: shardplan's initialisation, or a safetensors file's."""
    by_hf = {hf: (shape, init) for hf, shape, init in PARAMS}
    reader = None
    if init_from:
        from safetensors import safe_open

        reader = safe_open(init_from, framework="pt", device="cpu")
        missing = sorted(set(by_hf) - set(reader.keys()))
        if missing:
            raise SystemExit(f"error: {init_from} lacks {len(missing)} parameters, e.g. {missing[0]}")
    with torch.no_grad():
        for path, p in model.named_parameters():
            hf = names[path]
            shape, init = by_hf[hf]
            spans, local = local_region(p)
            if any(end <= start for start, end in spans):
                continue
            if reader is not None:
                t = reader.get_slice(hf)
                if list(t.get_shape()) != shape:
                    raise SystemExit(f"error: {init_from}: {hf} has shape {t.get_shape()}, the model needs {shape}")
                local.copy_(t[tuple(slice(a, b) for a, b in spans)].to(local.dtype))
                continue
            if init[0] == "constant":
                local.fill_(init[1])
                continue
            _, std, stream = init
            rows = spans[0][1] - spans[0][0]
            flat = local.view(rows, -1)
            # Rows in blocks of about 4M elements: the indices are made per block.
            step = max(1, (1 << 22) // max(flat.shape[1], 1))
            for lo in range(0, rows, step):
                hi = min(lo + step, rows)
                idx = region_indices(spans, shape, lo, hi).to(flat.device)
                flat[lo:hi].copy_((std * normal(SEED, stream, idx)).to(torch.float32).view(hi - lo, -1))


# ---------------------------------------------------------------- the batches of `shardplan train`

class Batches:
    """This rank's rows of each global micro-batch (`per_rank x world` rows, split by rank)."""

    def __init__(self, source, rank, world, rows_per_rank, seq, vocab):
        self.source, self.rank, self.world = source, rank, world
        self.per, self.seq, self.vocab = rows_per_rank, seq, vocab
        self.rows = rows_per_rank * world
        self.position = 0
        if source["kind"] == "synthetic":
            self.perm = self.permutation()
        else:
            self.file = open(source["path"], "rb")
            self.width = 2 if source["dtype"] == "u16" else 4
            n = os.fstat(self.file.fileno()).st_size // self.width
            if n <= seq:
                raise SystemExit(f"error: {source['path']} holds {n} tokens; a sequence of {seq} needs {seq + 1}")
            self.starts = n - seq

    def permutation(self):
        v = self.vocab
        u = uniform(SEED, _signed(MASK64), torch.arange(v, dtype=torch.int64)).tolist()
        perm = list(range(v))
        for i in range(v - 1, 0, -1):
            j = min(int(u[i] * (i + 1)), i)
            perm[i], perm[j] = perm[j], perm[i]
        return torch.tensor(perm, dtype=torch.int64)

    def window(self, start):
        self.file.seek(start * self.width)
        raw = self.file.read((self.seq + 1) * self.width)
        ids = struct.unpack(f"<{self.seq + 1}{'H' if self.width == 2 else 'I'}", raw)
        if max(ids) >= self.vocab:
            raise SystemExit(f"error: {self.source['path']}: token id {max(ids)} is outside the vocabulary of {self.vocab}")
        return ids

    def at(self, position):
        """(tokens [per, seq], targets [per, seq]) of this rank at micro-batch `position`."""
        streams = torch.arange(self.per, dtype=torch.int64) + position * self.rows + self.rank * self.per
        if self.source["kind"] == "synthetic":
            u = uniform(SEED, _signed(MASK64 - 1), streams)
            t = (u * self.vocab).to(torch.int64).clamp(max=self.vocab - 1)
            out = [t]
            for _ in range(self.seq):
                t = self.perm[t]
                out.append(t)
            ids = torch.stack(out, dim=1)
        else:
            u = uniform(SEED, _signed(MASK64 - 4), streams).tolist()
            ids = torch.tensor([self.window(min(int(x * self.starts), self.starts - 1)) for x in u], dtype=torch.int64)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def next(self):
        b = self.at(self.position)
        self.position += 1
        return b


# ---------------------------------------------------------------- optimizer and schedule

def make_optimizer(model):
    o = OPTIMIZER
    if o["name"] == "adamw":
        # fused: one kernel over every parameter (torchtitan's default); foreach: list ops,
        # with a temporary the size of the parameters during the step.
        fused = o["implementation"] == "fused"
        return torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                                 weight_decay=o["weight_decay"], fused=fused, foreach=not fused)
    return torch.optim.SGD(model.parameters(), lr=o["lr"], momentum=o["momentum"], weight_decay=o["weight_decay"])


def lr_at(step, total):
    """Linear warmup from 0, then cosine decay to min_lr_ratio * lr at the last step (0-based step)."""
    base, s = OPTIMIZER["lr"], LR_SCHEDULE
    if step < s["warmup_steps"]:
        return base * (step + 1) / s["warmup_steps"]
    span = max(total - s["warmup_steps"] - 1, 1)
    progress = min((step - s["warmup_steps"]) / span, 1.0)
    low = base * s["min_lr_ratio"]
    return low + (base - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------- checkpoints (DCP)
# torch.distributed.checkpoint folders in torchtitan's layout, the keys `shardplan train
# --checkpoint-format dcp` writes and reads: each parameter under its Hugging Face name,
# `optimizer.state.<name>.<state>`, `optimizer.param_groups.<name>.<field>`,
# `train_state.step`, `lr_scheduler.last_epoch`, `dataloader.position` (micro-batches
# consumed) and `shardplan.model` / `shardplan.seed`. Each rank saves and loads its own
# shards (DTensors), so a checkpoint resumes on any mesh, here or in `shardplan train`.

def init_optimizer_state(opt):
    """Each parameter's optimizer state, zero, as torch makes it at its first step: the
    tensors a load then fills."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if st:
                continue
            if isinstance(opt, torch.optim.AdamW):
                on_device = group.get("fused") or group.get("capturable")
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif group["momentum"] != 0:
                st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# torchtitan's names for its Llama 3's parameters, from Hugging Face's.
TORCHTITAN_NAMES = [
    (r"^model\.embed_tokens\.weight$", "tok_embeddings.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^lm_head\.weight$", "output.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.weight$", r"layers.\1.attention.w\2.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.weight$", r"layers.\1.feed_forward.w1.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.weight$", r"layers.\1.feed_forward.w2.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.weight$", r"layers.\1.feed_forward.w3.weight"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", r"layers.\1.attention_norm.weight"),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$", r"layers.\1.ffn_norm.weight"),
]


def torchtitan_name(hf):
    for pattern, name in TORCHTITAN_NAMES:
        if re.match(pattern, hf):
            return re.sub(pattern, name, hf)
    return hf


def rotary_heads(hf):
    """Heads of a query or key projection, whose rows torchtitan keeps in Meta's rotary
    layout (each head's rows as interleaved pairs, where Hugging Face keeps halves)."""
    if MODEL["family"] != "llama":
        return None
    if hf.endswith("self_attn.q_proj.weight"):
        return MODEL["n_heads"]
    if hf.endswith("self_attn.k_proj.weight"):
        return MODEL["n_kv_heads"]
    return None


def to_meta(t, heads):
    hd = t.shape[0] // heads
    return t.reshape(heads, 2, hd // 2, -1).transpose(1, 2).reshape(t.shape)


def from_meta(t, heads):
    hd = t.shape[0] // heads
    return t.reshape(heads, hd // 2, 2, -1).transpose(1, 2).reshape(t.shape)


def checkpoint_state(model, names, opt, batches, step, torchtitan=False):
    """The flat state dict of a checkpoint (tensors are this rank's DTensors), and what a
    load must put back by hand: under torchtitan's names, each query and key projection
    (and its optimizer state) is saved whole in Meta's layout, (key, target, heads)."""
    sd, fixups = {}, []
    fields = ["lr", "betas", "eps", "weight_decay"] if OPTIMIZER["name"] == "adamw" else ["lr", "momentum", "weight_decay"]

    def put(key, hf, v):
        heads = rotary_heads(hf) if torchtitan and torch.is_tensor(v) and v.dim() == 2 else None
        if heads is None:
            sd[key] = v
            return
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        sd[key] = to_meta(full.detach(), heads).contiguous()
        fixups.append((key, v, heads))

    for path, p in model.named_parameters():
        hf = names[path]
        name = torchtitan_name(hf) if torchtitan else hf
        put(name, hf, p)
        for k, v in opt.state.get(p, {}).items():
            put(f"optimizer.state.{name}.{k}", hf, v)
        for f in fields:
            sd[f"optimizer.param_groups.{name}.{f}"] = OPTIMIZER[f] if f != "betas" else tuple(OPTIMIZER[f])
    sd["train_state.step"] = step
    sd["lr_scheduler.last_epoch"] = step
    sd["dataloader.position"] = batches.position
    sd["shardplan.model"] = MODEL_SPEC
    sd["shardplan.seed"] = SEED
    return sd, fixups


def save_checkpoint(a, model, names, opt, batches, step, rank):
    import torch.distributed.checkpoint as dcp

    folder = os.path.join(a.checkpoint_dir, f"step-{step}")
    if os.path.exists(os.path.join(folder, ".metadata")):
        raise SystemExit(f"error: {folder}: a complete checkpoint exists; it is not overwritten")
    sd, _ = checkpoint_state(model, names, opt, batches, step, a.names == "torchtitan")
    dcp.save(sd, checkpoint_id=folder)
    dist.barrier()
    if rank == 0:
        done = sorted(complete_steps(a.checkpoint_dir))
        for s, path in done[:-a.keep_latest]:
            shutil.rmtree(path)


def complete_steps(root):
    """(step, folder) of every complete checkpoint under `root` (a `step-N` folder whose
    `.metadata` DCP wrote last)."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if name.startswith("step-") and name[5:].isdigit() and os.path.isfile(os.path.join(path, ".metadata")):
            out.append((int(name[5:]), path))
    return out


def resume_checkpoint(path, model, names, opt, batches, torchtitan):
    """Loads a checkpoint into this rank's shards; returns the step it was taken after."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isfile(os.path.join(path, ".metadata")):
        done = sorted(complete_steps(path))
        if not done:
            raise SystemExit(f"error: {path}: no complete DCP checkpoint (a step-N folder with .metadata)")
        path = done[-1][1]
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    spec = "shardplan.model"
    init_optimizer_state(opt)
    sd, fixups = checkpoint_state(model, names, opt, batches, 0, torchtitan)
    # Only what this program needs: the hyperparameters come from its own spec.
    sd = {k: v for k, v in sd.items() if not k.startswith("optimizer.param_groups.")}
    if spec not in md:
        del sd[spec], sd["shardplan.seed"]
    missing = sorted(k for k in sd if k not in md)
    if missing:
        raise SystemExit(f"error: {path}: the checkpoint lacks `{missing[0]}` ({len(missing)} keys missing): "
                         "is it of this model and optimizer?")
    dcp.load(sd, checkpoint_id=path)
    with torch.no_grad():
        for key, target, heads in fixups:
            spans, local = local_region(target)
            local.copy_(from_meta(sd[key], heads)[tuple(slice(a, b) for a, b in spans)].to(local.dtype))
    if spec in sd and json.loads(sd[spec]) != json.loads(MODEL_SPEC):
        raise SystemExit(f"error: {path}: written for another model (`shardplan.model` differs from this program's)")
    batches.position = int(sd["dataloader.position"])
    return int(sd["train_state.step"])


# ---------------------------------------------------------------- context parallelism
# torchtitan's, with torch's context_parallel: each rank of a context group of
# CONTEXT["degree"] ranks holds 1/degree of every sequence of its data-parallel rank's
# batch. Every step's forward and backward run inside context_parallel, which shards the
# tokens, the targets and the rotary tables along the sequence (head_tail: cut in
# 2 x degree chunks, context rank r holding chunks r and 2 x degree - 1 - r, torch's
# _HeadTailLoadBalancer; none: chunk r of degree) and replaces F.scaled_dot_product_attention
# by its ring attention (keys and values all-gathered, or passed around the ring with
# "alltoall"). Each rank's loss is the mean over its own tokens; FSDP averages the
# gradients over shard x context.

# The context groups' mesh (set by make_mesh under context parallelism).
CONTEXT_MESH = [None]
# The tensor groups' mesh (set by make_mesh under tensor parallelism).
TENSOR_MESH = [None]

CONTEXT_NEEDS_CUDA = (
    "the plan runs context parallelism, and torch's context_parallel runs attention only in "
    "the CUDA SDPA kernels (flash, memory-efficient, cuDNN): on the CPU, SDPA is "
    "aten._scaled_dot_product_flash_attention_for_cpu, which its dispatcher does not handle "
    "(torch 2.15: \"Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not "
    "have a sharding strategy registered\"). Run it with --device cuda (one GPU a rank), or check "
    "its layout on the CPU with --check-context-layout")


def data_rank(rank, world):
    """(this rank's data-parallel index, data-parallel ranks): the ranks of a context group
    and of a tensor group (together the innermost context x tensor ranks) read the same
    sequences."""
    c = CONTEXT["degree"] if CONTEXT is not None else 1
    c *= MESH.get("tensor", 1)
    return rank // c, world // c


@contextlib.contextmanager
def context_shards(tokens, targets, device, extra=()):
    """Under context parallelism, torch's context_parallel over the context group around a
    micro-batch's forward and backward: `tokens` and `targets` [rows, seq] (and `extra`
    tensors of the same shape) and the whole sequence's rotary tables [seq, 1, head_dim]
    become this rank's rows of them, in place, for the duration (never restored: the step
    reads them no more). Without it, nothing."""
    if CONTEXT is None:
        yield
        return
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    set_rotate_method(CONTEXT["rotate"])
    # context_parallel balances with torch's head-tail balancer exactly when this is set
    # (and the sequence divides by 2 x degree, which the plan checked).
    _cp_options.enable_load_balance = CONTEXT["load_balance"] == "head_tail"
    seq = tokens.shape[1]
    if seq % (2 * CONTEXT["degree"] if _cp_options.enable_load_balance else CONTEXT["degree"]):
        raise SystemExit(f"error: a sequence of {seq} tokens does not split over the context group as planned")
    tables = rope_tables(MODEL["rope_inv_freq"], MODEL["rope_attention_factor"], seq, device)
    buffers = [tokens, targets, *tables, *extra]
    dims = [1, 1, 0, 0] + [1] * len(extra)
    with context_parallel(CONTEXT_MESH[0], buffers=buffers, buffer_seq_dims=dims, no_restore_buffers=set(buffers)):
        CONTEXT_ROPE[0] = tables
        try:
            yield
        finally:
            CONTEXT_ROPE[0] = None


def check_context_layout(model, batches, device, rank, world, fsdp_mesh):
    """--check-context-layout: the first micro-batch sharded by context_parallel as a step
    shards it, then the forward up to where it stops (on the CPU, at the first attention,
    which torch's ring attention cannot run there). One JSON line per rank on stdout: its
    context and data-parallel index, FSDP's mesh, the global positions of its rows, whether
    its tokens, targets and rotary rows are those positions', and how the forward ended.
    Under tensor parallelism, its tensor index too: a tensor group shares its rows."""
    tokens, targets = (t.to(device) for t in batches.at(0))
    whole = (tokens.clone(), targets.clone())
    seq = tokens.shape[1]
    positions = torch.arange(seq, device=device).expand(tokens.shape[0], seq).contiguous()
    cos, sin = rope_tables(MODEL["rope_inv_freq"], MODEL["rope_attention_factor"], seq, device)
    out = {
        "rank": rank,
        "context_rank": CONTEXT_MESH[0].get_local_rank(),
        "tensor_rank": TENSOR_MESH[0].get_local_rank() if TENSOR_MESH[0] is not None else 0,
        "data_rank": data_rank(rank, world)[0],
        "fsdp_mesh": {"names": list(fsdp_mesh.mesh_dim_names), "shape": list(fsdp_mesh.shape)},
    }
    with context_shards(tokens, targets, device, extra=(positions,)):
        pos = positions[0]
        local_cos, local_sin = CONTEXT_ROPE[0]
        out["positions"] = pos.tolist()
        out["rows_alike"] = bool((positions == pos).all())
        out["buffers_match"] = bool(torch.equal(tokens, whole[0][:, pos]) and torch.equal(targets, whole[1][:, pos])
                                    and torch.equal(local_cos, cos[pos]) and torch.equal(local_sin, sin[pos]))
        try:
            loss = model(tokens, targets)
            out["forward"] = f"ok: loss {loss.item()}"
        except NotImplementedError as e:
            import traceback

            # The innermost function of this program the error came through.
            here = [f.name for f in traceback.extract_tb(e.__traceback__) if f.filename == __file__]
            out["forward"] = f"stopped in {here[-1] if here else '?'}: {e}"
    # One write a line: every rank shares the output, and print writes the newline apart.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (json.dumps(out) + "\n").encode())


# ---------------------------------------------------------------- one step

def train_step(model, opt, batches, step, total, device, meter):
    """grad_accum micro-batches, gradient sync as planned, clipping, one optimizer step."""
    accum = BATCH["grad_accum"]
    for group in opt.param_groups:
        group["lr"] = lr_at(step, total)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for micro in range(accum):
        last = micro + 1 == accum
        if accum > 1:
            if BATCH["grad_sync"] == "final_micro_batch":
                model.set_requires_gradient_sync(last)
            elif MESH["replicate"] > 1:
                model.set_requires_all_reduce(last)
        if micro > 0:
            meter.next_micro_batch()
        tokens, targets = (t.to(device) for t in batches.next())
        with context_shards(tokens, targets, device), loss_context():
            loss = model(tokens, targets)
            (loss / accum).backward()
        loss_sum += whole_value(loss).detach().double()
    scale_expert_grads(model)
    if GRAD_CLIP is not None:
        clip_grad_norm(model, GRAD_CLIP, device)
    opt.step()
    opt.zero_grad(set_to_none=True)
    precompute_float8_scales([model])
    # The loss of the global batch: the mean over every rank and micro-batch.
    dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
    return loss_sum.item() / (accum * dist.get_world_size())


def scale_expert_grads(model):
    """An expert's gradient sums the contributions of its whole expert group's tokens, so
    it is averaged over every data-parallel rank, as the dense gradients are; FSDP2 divided
    it by its own mesh (the ranks holding that expert), `expert` times fewer. (torchtitan
    sets the experts' gradient divide factor instead, which runs as NCCL's PREMUL_SUM, a
    reduction gloo does not have.)"""
    if MESH["expert"] == 1:
        return
    for path, p in model.named_parameters():
        if ".experts." in path and p.grad is not None:
            p.grad.mul_(1.0 / MESH["expert"])


def clip_grad_norm(model, clip, device):
    """Scales every gradient by min(1, clip / (global norm + 1e-6)), as torch's
    clip_grad_norm_ does. Under expert parallelism the experts' gradients are sharded over
    another mesh than the rest, which torch's cannot mix: each rank sums the squares of its
    own shards, and the sum over every rank counts each shard once per replica."""
    if MESH["expert"] == 1 and MESH.get("tensor", 1) == 1:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        return
    if MESH["expert"] == 1:
        # Under tensor parallelism the gradients are DTensors over replicate x shard x
        # tensor, or over the data-parallel mesh alone where a module stays whole on every
        # tensor rank (a vocabulary the group does not divide): each mesh's norm is reduced
        # to its whole parameters' (torchtitan's way), and the meshes' norms combined.
        by_mesh = grads_by_mesh(model.parameters())
        norm = squared_norm(by_mesh, device).sqrt()
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    shards = [local(g) for g in grads]
    # On the process group's device (NCCL reduces CUDA tensors only), gradients offloaded or not.
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g, whole in zip(shards, grads):
        # A gradient every tensor rank holds the same of counts once per tensor group.
        copies = 1 if split_over_tensor(whole) else MESH.get("tensor", 1)
        total += g.detach().float().pow(2).sum().to(device) / copies
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    norm = (total / MESH["replicate"]).sqrt()
    coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
    for g in shards:
        g.detach().mul_(coef.to(device=g.device, dtype=g.dtype))


def split_over_tensor(t):
    """Whether the DTensor `t` is sharded over the tensor groups (each tensor rank holds
    its own block)."""
    names = getattr(getattr(t, "device_mesh", None), "mesh_dim_names", None) or ()
    return "tensor" in names and t.placements[names.index("tensor")].is_shard()


def grads_by_mesh(params):
    """The parameters with a gradient, by their gradient's device mesh (None: a plain
    tensor): torch's norm and clip take one mesh at a time."""
    by_mesh = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return by_mesh


def squared_norm(by_mesh, device):
    """The squared global norm of the gradients of `by_mesh`: each mesh's norm reduced to
    its whole parameters' (DTensor's full_tensor), the squares summed, f32 on `device`."""
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares += norm.float().to(device) ** 2
    return squares


def evaluate(model, device, rank, world):
    """The validation loss: the mean over the first `batches` global batches of the val file."""
    ev = DATA["eval"]
    val = Batches({"kind": "tokens", "path": ev["path"], "dtype": DATA["dtype"]}, *data_rank(rank, world),
                  BATCH["per_rank"], BATCH["seq_len"], MODEL["vocab_size"])
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for k in range(ev["batches"]):
            tokens, targets = (t.to(device) for t in val.at(k))
            # Under context parallelism each rank's loss is over its rows, all of the same
            # count: the mean over every rank is the batch's.
            with context_shards(tokens, targets, device), loss_context():
                loss = model(tokens, targets)
            total += whole_value(loss).double()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item() / (ev["batches"] * world)


def state_bytes(model, opt):
    """Bytes of what lives across steps, each storage once: the model's parameters (this
    rank's shards), buffers and gradients, and the optimizer's state (FSDPMemTracker's count
    at a step's start)."""
    storages = {}

    def add(t):
        if isinstance(t, torch.Tensor):
            st = local(t).untyped_storage()
            if st.nbytes() > 0:
                storages[st.data_ptr()] = st.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for buf in model.buffers():
        add(buf)
    for state in opt.state.values():
        for v in state.values():
            add(v)
    return sum(storages.values())


class AllocatorWatch:
    """A step's peak on the CPU from the CPU allocator's own count, as torch.profiler's
    memory profiling keeps it: what lives across steps when the step starts (`state_bytes`)
    plus the most the count rose above its value at the start during the step. Used where
    FSDPMemTracker cannot go: its dispatch mode and torch.compile exclude each other, while
    compiled kernels allocate through the same CPU allocator the profiler counts. The count
    misses frees made on threads the profiler does not watch (gloo's), so it is taken
    afresh from each step's start."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def peak_of(self, fn):
        """`fn()` and the most bytes the CPU allocator held while it ran."""
        from torch._C._profiler import _EventType

        base = state_bytes(self.model, self.opt)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        prof.start()
        out = fn()
        prof.stop()
        events = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                events.append((e.start_time_ns, e.extra_fields.total_allocated, e.extra_fields.alloc_size))
        if not events:
            return out, base
        events.sort()
        start = events[0][1] - events[0][2]
        return out, base + max(total for _, total, _ in events) - start


class AllocTrace:
    """`--alloc-trace`: every request rank 0 makes of its allocator while it runs, written as
    JSON lines that `shardplan plan --alloc-trace` replays through the planner's model of
    PyTorch's caching allocator. A header line, then `{"alloc": ID, "bytes": N, "stream": S}`
    and `{"free": ID}` in order (ID: the address, reused after a free; S: a small number per
    stream). On a GPU, the CUDA allocator's own history (`_record_memory_history`: each
    request, the stream it was made on, and the free as the allocator completes it) and its
    measured peaks; on the CPU, which has no streams, the CPU allocator under torch.profiler,
    each request put on the stream FSDP2 makes it on on a GPU, from the profiler's scopes
    (`FSDP2_STREAM_OF`)."""

    def __init__(self, path, device):
        self.path, self.device = path, device
        if device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=50_000_000, stacks="python")
            torch.cuda.reset_peak_memory_stats(device)
        else:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self.prof.start()

    def finish(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            events = cuda_requests(snap["device_traces"][self.device.index or 0])
            header = {"max_allocated": torch.cuda.max_memory_allocated(self.device),
                      "max_reserved": torch.cuda.max_memory_reserved(self.device),
                      "expandable_segments": "expandable_segments:True" in os.environ.get("PYTORCH_ALLOC_CONF", "")}
        else:
            self.prof.stop()
            events = cpu_requests(self.prof)
            header = {"max_allocated": None, "max_reserved": None, "expandable_segments": None}
        header = {"shardplan_alloc_trace": 1, "device": self.device.type, **header}
        with open(self.path, "w") as f:
            f.write(json.dumps(header) + "\n")
            for e in events:
                f.write(json.dumps(e) + "\n")


def cuda_requests(trace):
    """The CUDA allocator's history as requests: `alloc`, and `free_completed` (when the
    block is back in its pool), streams numbered in the order they first appear."""
    streams = {}
    out = []
    for e in trace:
        if e["action"] == "alloc":
            s = streams.setdefault(e["stream"], len(streams))
            out.append({"alloc": e["addr"], "bytes": e["size"], "stream": s})
        elif e["action"] == "free_completed":
            out.append({"free": e["addr"]})
    return out


# The streams FSDP2 makes its requests on, as this program's CPU trace names them (the
# planner's stream numbers: 0 the default stream, 1 all-gather, 2 reduce-scatter). Under
# `FSDP::all_gather` FSDP2 casts and copies in on its all-gather copy-in stream. Under
# `FSDP::post_backward_reduce` the reduce-scatter input is made on the default stream (the
# first request made directly in that scope), and everything after it on the reduce-scatter
# stream (`foreach_reduce`'s `with device_handle.stream(reduce_scatter_stream)`). At world
# size 1 FSDP2 skips the all-gather and its streams.
DEFAULT_STREAM, ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM = 0, 1, 2

# Requests a CPU run makes that a GPU run does not, left out of its trace: what gloo
# allocates inside a collective (`c10d::*`; NCCL keeps its buffers outside the caching
# allocator), and the workspaces of the CPU kernels that have GPU twins allocating none per
# call, made and freed inside one call (the bf16 matmul's packed operands, CPU flash
# attention's per-thread buffers, the CPU path of FSDP2's mixed-dtype chunk-cat, which on a
# GPU is one kernel writing into the reduce-scatter input).
CPU_ONLY_OPS = ("c10d::",)
CPU_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
               "fsdp::chunk_cat")


def cpu_memory_events(prof):
    """Every allocation and free of the CPU allocator under `prof`, in time order:
    (address, signed bytes, the names of its enclosing scopes innermost first, the
    innermost CPU kernel call it was made in or None)."""
    from torch._C._profiler import _EventType

    found = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag != _EventType.Allocation or e.extra_fields.device.type != "cpu":
            continue
        scopes, kernel, p = [], None, e.parent
        while p is not None:
            scopes.append(p.name)
            if kernel is None and p.name.startswith(CPU_KERNELS):
                kernel = (p.name, p.start_time_ns)
            p = p.parent
        found.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size, scopes, kernel))
    found.sort(key=lambda t: t[0])
    return [f[1:] for f in found]


def gpu_twin(events):
    """The indices of `events` a GPU run makes too: without the CPU-only ops' requests and
    the CPU kernels' workspaces (a block made and freed inside one kernel call)."""
    keep = [True] * len(events)
    made = {}
    for i, (ptr, size, scopes, kernel) in enumerate(events):
        if size > 0:
            made[ptr] = (i, kernel)
            if any(n.startswith(CPU_ONLY_OPS) for n in scopes):
                keep[i] = False
            continue
        j, k = made.pop(ptr, (None, None))
        if j is None or not keep[j]:
            keep[i] = False
        elif kernel is not None and kernel == k:
            keep[i] = keep[j] = False
    return keep


def cpu_requests(prof):
    events = cpu_memory_events(prof)
    keep = gpu_twin(events)
    out = []
    reduce_scope, input_made = None, False
    for (ptr, size, scopes, _), kept in zip(events, keep):
        if not kept:
            continue
        if size < 0:
            out.append({"free": ptr})
            continue
        scope = next((n for n in scopes if n.startswith("FSDP::post_backward_reduce")), None)
        if scope != reduce_scope:
            reduce_scope, input_made = scope, False
        stream = DEFAULT_STREAM
        if any(n.startswith("FSDP::all_gather") and not n.startswith("FSDP::all_gather_copy_out") for n in scopes):
            stream = ALL_GATHER_STREAM
        elif scope is not None:
            if input_made:
                stream = REDUCE_SCATTER_STREAM
            elif len(scopes) >= 2 and scopes[1] == scope:
                input_made = True
        out.append({"alloc": ptr, "bytes": size, "stream": stream})
    return out


def allocator_watch(a, device, model, opt):
    """An AllocatorWatch when this CPU run measures its peak through the profiler
    (`--memory-meter profiler`, or `auto` with anything compiled), else None."""
    compiled = COMPILE["model"] or COMPILE["loss"]
    if device.type != "cpu" or not a.track_memory:
        return None
    if a.memory_meter == "profiler" or (a.memory_meter == "auto" and compiled):
        return AllocatorWatch(model, opt)
    return None


class MemoryMeter:
    """Each step's peak: the CUDA allocator's; on the CPU FSDPMemTracker's, or the CPU
    allocator's as an AllocatorWatch sees it."""

    def __init__(self, model, opt, device, track, watch=None):
        self.device, self.tracker, self.watch = device, None, watch
        if device.type == "cpu" and track and watch is None:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            self.tracker = FSDPMemTracker(model, opt)

    def next_micro_batch(self):
        # FSDPMemTracker takes one forward per module; its peak survives this reset.
        if self.tracker is not None:
            self.tracker.reset_mod_stats()

    def run(self, fn):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            out = fn()
            return out, torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)
        if self.watch is not None:
            out, peak = self.watch.peak_of(fn)
            return out, peak, None
        if self.tracker is None:
            return fn(), None, None
        self.tracker.reset_mod_stats()
        with self.tracker:
            out = fn()
        peak = self.tracker.get_tracker_snapshot("peak")
        return out, max((s.get("Total", 0) for s in peak.values()), default=0), None


def start(device_kind):
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    pipeline, tensor = MESH.get("pipeline", 1), MESH.get("tensor", 1)
    want = pipeline * MESH["replicate"] * MESH["shard"] * tensor
    if world != want:
        raise SystemExit(f"error: the plan's mesh is {pipeline} x {MESH['replicate']} x {MESH['shard']} x {tensor} "
                         f"ranks (pipeline x replicate x shard x tensor); started with {world} "
                         f"(run torchrun --nproc-per-node {want})")
    if device_kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return device, rank, world


def main(argv=None):
    a = parse_args(argv)
    if CONTEXT is not None and a.device != "cuda" and not a.check_context_layout:
        raise SystemExit(f"error: {CONTEXT_NEEDS_CUDA}")
    if a.check_context_layout and CONTEXT is None:
        raise SystemExit("error: --check-context-layout: the plan has no context parallelism")
    if CONTEXT is not None and MODEL["family"] != "llama":
        raise SystemExit("error: context parallelism needs rotary positions (a Llama-family model)")
    if a.threads:
        torch.set_num_threads(a.threads)
    device, rank, world = start(a.device)
    try:
        run(a, device, rank, world)
    finally:
        dist.destroy_process_group()


def run(a, device, rank, world):
    if PIPELINE is not None:
        return run_pipeline(a, device, rank, world)
    model, names = build_model()
    apply_float8(model, names, device)
    meshes = make_mesh(device)
    if TENSOR is not None:
        apply_tensor_parallel(model, TENSOR_MESH[0], device)
    apply_checkpointing(model)
    apply_compile(model)
    apply_fully_shard(model, meshes, device)
    set_prefetch(model)
    trace = AllocTrace(a.alloc_trace, device) if a.alloc_trace and rank == 0 else None
    model.to_empty(device="cpu" if OFFLOAD else device)
    init_weights(model, names, a.init_from)
    opt = make_optimizer(model)
    # Under context parallelism a context group reads one data-parallel rank's rows.
    dp_rank, dp_world = data_rank(rank, world)
    batches = Batches(DATA, dp_rank, dp_world, BATCH["per_rank"], BATCH["seq_len"], MODEL["vocab_size"])
    if a.check_context_layout:
        return check_context_layout(model, batches, device, rank, world, meshes[0])
    watch = allocator_watch(a, device, model, opt)
    if trace is not None and watch is not None:
        raise SystemExit("error: --alloc-trace and the profiler's memory meter both run torch.profiler; "
                         "pass one of them (or --memory-meter tracker)")
    meter = MemoryMeter(model, opt, device, a.track_memory, watch)
    tokens_per_step = BATCH["per_rank"] * BATCH["seq_len"] * dp_world * BATCH["grad_accum"]
    log = open(a.log, "a") if a.log and rank == 0 else None
    first = resume_checkpoint(a.resume, model, names, opt, batches, a.names == "torchtitan") if a.resume else 0
    if first >= a.steps:
        raise SystemExit(f"error: the checkpoint is at step {first}; --steps {a.steps} leaves nothing to do "
                         "(--steps counts the whole run)")
    for step in range(first, a.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        loss, alloc, reserved = meter.run(lambda: train_step(model, opt, batches, step, a.steps, device, meter))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        # On the process group's device: NCCL reduces CUDA tensors only.
        peaks = torch.tensor([alloc or 0, reserved or 0], dtype=torch.float64, device=device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        line = {
            "step": step + 1,
            "loss": loss,
            "step_seconds": seconds,
            "tokens_per_second": tokens_per_step / seconds,
            "peak_allocated": int(peaks[0]) if alloc is not None else None,
            "peak_reserved": int(peaks[1]) if reserved is not None else None,
        }
        ev = DATA.get("eval")
        if ev and ((step + 1) % ev["every"] == 0 or step + 1 == a.steps):
            line["val_loss"] = evaluate(model, device, rank, world)
        if not math.isfinite(loss):
            raise SystemExit(f"error: non-finite loss {loss} at step {step + 1}")
        if rank == 0:
            text = json.dumps(line)
            if log:
                log.write(text + "\n")
                log.flush()
            if step + 1 == a.steps:
                print(text)
            else:
                print(text, file=sys.stderr)
        every = a.checkpoint_every
        if a.checkpoint_dir and (step + 1 == a.steps or (every and (step + 1) % every == 0)):
            save_checkpoint(a, model, names, opt, batches, step + 1, rank)
    if trace is not None:
        trace.finish()


# ---------------------------------------------------------------- pipeline parallelism
# The plan's stages on the ranks it places them, FSDP2 inside each stage as torchtitan
# applies it under a pipeline (each block, then the stage; parameters kept unsharded across
# micro-batches), run by torch.distributed.pipelining: the named schedule's class, or the
# plan's own program from its CSV through _PipelineScheduleRuntime for a custom schedule.

class StageModule(nn.Module):
    """One pipeline stage: the model's modules of PIPELINE["stages"][s] under their own
    paths (so parameter names stay the model's), run in the model's order; the last stage
    returns the logits, and the schedule's loss_fn takes the loss."""

    def __init__(self, model, modules):
        super().__init__()
        self.order = [path for path in modules if path != "loss"]
        for path in self.order:
            head, _, tail = path.partition(".")
            if tail:
                if head not in self._modules:
                    self.add_module(head, nn.ModuleDict())
                self._modules[head][tail] = module_at(model, path)
            else:
                self.add_module(head, module_at(model, path))

    def forward(self, x):
        ROUTER_LOGITS.clear()
        for path in self.order:
            x = settled(module_at(self, path)(x))
        return x


def make_pipeline_mesh(device):
    """The (pipeline, replicate, shard, tensor) mesh, pipeline outermost and the tensor
    groups innermost, and its data-parallel part; sets TENSOR_MESH under tensor
    parallelism."""
    from torch.distributed.device_mesh import init_device_mesh

    p, r, s, t = MESH.get("pipeline", 1), MESH["replicate"], MESH["shard"], MESH.get("tensor", 1)
    dp = ("replicate", "shard") if r > 1 else ("shard",)
    dims = (p,) + ((r, s) if r > 1 else (s,)) + ((t,) if t > 1 else ())
    mesh = init_device_mesh(device.type, dims, mesh_dim_names=("pp",) + dp + (("tensor",) if t > 1 else ()))
    if t > 1:
        TENSOR_MESH[0] = mesh["tensor"]
    return mesh, mesh[dp]


def pipeline_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def build_stages(a, device, mesh, dp):
    """This rank's stage modules, sharded over the data-parallel mesh and initialised."""
    from torch.distributed.pipelining import PipelineStage

    model, names = build_model()
    apply_float8(model, names, device)
    if TENSOR is not None:
        apply_tensor_parallel(model, TENSOR_MESH[0], device)
    apply_checkpointing(model)
    apply_compile(model)
    me = mesh.get_local_rank("pp")
    count = len(PIPELINE["stages"])
    kw = fully_shard_policies(device)
    parts, stages = [], []
    for s in range(count):
        if PIPELINE["rank_of_stage"][s] != me:
            continue
        part = StageModule(model, PIPELINE["stages"][s])
        for path in part.order:
            if isinstance(module_at(part, path), Block):
                fully_shard(module_at(part, path), mesh=dp, reshard_after_forward=False, **kw)
        fully_shard(part, mesh=dp, reshard_after_forward=False, **kw)
        part.to_empty(device="cpu" if OFFLOAD else device)
        init_weights(part, names, a.init_from)
        parts.append(part)
        stages.append(PipelineStage(part, s, count, device, group=mesh.get_group("pp")))
    return parts, stages, names


class StageParameters:
    """This rank's stages as a checkpoint reads a model: every parameter under the model's
    own path (a stage keeps its modules' paths), so a pipeline checkpoint holds each
    parameter under its Hugging Face name, as one without a pipeline does."""

    def __init__(self, parts):
        self.parts = parts

    def named_parameters(self):
        for part in self.parts:
            yield from part.named_parameters()


def make_schedule(stages):
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime, get_schedule_class

    m = PIPELINE["microbatches"]
    if PIPELINE["csv"] is not None:
        sched = _PipelineScheduleRuntime(stages, m, loss_fn=pipeline_loss, scale_grads=True)
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
            f.write(PIPELINE["csv"])
        sched._load_csv(f.name, format="compute_only")
        os.unlink(f.name)
        return sched
    cls = get_schedule_class(PIPELINE["schedule"])
    single = PIPELINE["schedule"] in ("GPipe", "1F1B")
    return cls(stages[0] if single else stages, m, loss_fn=pipeline_loss, scale_grads=True)


def clip_pipeline(parts, mesh, clip, device):
    """torch's clip over every stage of the pipeline: each rank's norm over its stages'
    gradient shards (full over the data-parallel and tensor meshes), squared, summed over
    the pipeline on the process group's device."""
    by_mesh = grads_by_mesh(p for part in parts for p in part.parameters())
    sq = squared_norm(by_mesh, device).to(device=device, dtype=torch.float64)
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=mesh.get_group("pp"))
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, clip, sq.sqrt().float())


def run_pipeline(a, device, rank, world):
    mesh, dp = make_pipeline_mesh(device)
    parts, stages, names = build_stages(a, device, mesh, dp)
    sched = make_schedule(stages)
    opt = make_optimizer(nn.ModuleList(parts))
    # Checkpoints: every rank saves and loads its own stages' shards; the folder holds the
    # whole model under its own names (DCP merges the ranks' plans), so it resumes here, in
    # `shardplan train` (with or without a pipeline) and in the program of another mesh.
    view = StageParameters(parts)
    count = len(PIPELINE["stages"])
    first = any(s.stage_index == 0 for s in stages)
    last = any(s.stage_index == count - 1 for s in stages)
    dp_world, tensor = MESH["replicate"] * MESH["shard"], MESH.get("tensor", 1)
    # A pipeline rank's tensor group (its innermost ranks) reads one data-parallel rank's rows.
    dp_rank = (rank % (dp_world * tensor)) // tensor
    batches = Batches(DATA, dp_rank, dp_world, BATCH["per_rank"], BATCH["seq_len"], MODEL["vocab_size"])
    tokens_per_step = BATCH["per_rank"] * BATCH["seq_len"] * dp_world
    log = open(a.log, "a") if a.log and rank == 0 else None
    first_step = resume_checkpoint(a.resume, view, names, opt, batches, a.names == "torchtitan") if a.resume else 0
    if first_step >= a.steps:
        raise SystemExit(f"error: the checkpoint is at step {first_step}; --steps {a.steps} leaves nothing to do "
                         "(--steps counts the whole run)")
    for step in range(first_step, a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a.steps)
        tokens, targets = (t.to(device) for t in batches.next())
        losses = []
        args = (tokens,) if first else ()
        kwargs = {"target": targets, "losses": losses} if last else {}
        with loss_context():
            sched.step(*args, **kwargs)
        if GRAD_CLIP is not None:
            clip_pipeline(parts, mesh, GRAD_CLIP, device)
        opt.step()
        opt.zero_grad(set_to_none=True)
        precompute_float8_scales(parts)
        total = torch.tensor(sum(float(whole_value(x)) for x in losses), dtype=torch.float64, device=device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        # Every rank of the last stage's tensor groups holds the same losses.
        loss = total.item() / (PIPELINE["microbatches"] * dp_world * tensor)
        seconds = time.perf_counter() - t0
        if not math.isfinite(loss):
            raise SystemExit(f"error: non-finite loss {loss} at step {step + 1}")
        line = {"step": step + 1, "loss": loss, "step_seconds": seconds,
                "tokens_per_second": tokens_per_step / seconds}
        if rank == 0:
            text = json.dumps(line)
            if log:
                log.write(text + "\n")
                log.flush()
            print(text, file=sys.stdout if step + 1 == a.steps else sys.stderr)
        every = a.checkpoint_every
        if a.checkpoint_dir and (step + 1 == a.steps or (every and (step + 1) % every == 0)):
            save_checkpoint(a, view, names, opt, batches, step + 1, rank)


if __name__ == "__main__":
    main()
    # After a finished run, torch's process-group threads may still be joinable when the
    # interpreter tears down, and the C++ runtime then aborts the process ("terminate
    # called without an active exception": gloo on 4 CPU ranks, about one run in five on a
    # loaded 2-core machine). Everything the run writes is flushed by now: leave without
    # that teardown. A failed run raised above and exits as Python does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
