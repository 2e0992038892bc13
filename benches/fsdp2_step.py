#!/usr/bin/env python3
"""Training-step benchmark of a Llama-style model under PyTorch FSDP2 (`fully_shard`).

The reference that scripts/gpu-check.sh compares `shardplan train` with: the same model
shape, batch, optimizer and sharding policy as a shardplan spec, so tokens/s and peak
memory can be set side by side.

  python3 benches/fsdp2_step.py --device cuda --dim 2048 --layers 16 --heads 32 \
      --kv-heads 8 --ffn 8192 --vocab 32000 --seq 2048 --batch 2 --steps 8 --out fsdp2.json
  torchrun --nproc-per-node 8 benches/fsdp2_step.py ...          # one process per GPU

Model: token embedding, `--layers` blocks (RMSNorm, rotate-half rotary embedding,
grouped-query attention through F.scaled_dot_product_attention(is_causal=True), SwiGLU
MLP), final RMSNorm, untied output head, cross-entropy in f32 — shardplan's `llama`
family. Sharding: one fully_shard per block, then one on the root (embedding, final norm
and head), as shardplan's `wrap: [block]`. Parameters are kept in f32 (master weights and
AdamW state f32, as in shardplan); --param-dtype picks the compute dtype the all-gather
casts to, --reduce-dtype the gradient reduce-scatter dtype. AdamW (lr 3e-4, betas
0.9/0.95, eps 1e-8, weight decay 0.1), gradient clipping at global norm 1.0, no
learning-rate schedule. Data: synthetic next-token prediction over a fixed random
permutation of the vocabulary (token i+1 = perm[token i]), fresh starting tokens each
step, the global batch split across ranks.

Without torchrun (no RANK in the environment) it starts a one-process group itself:
gloo on the CPU, NCCL on CUDA, at MASTER_ADDR:MASTER_PORT (default 127.0.0.1:29533).

Output: a JSON object (stdout, and --out FILE): median tokens/s over the measured steps
(global: all ranks), step seconds, peak memory (CUDA: torch.cuda.max_memory_allocated and
max_memory_reserved over the training steps; CPU: the process's peak RSS), the loss of
every step, the parameter count, and the configuration.
"""

import argparse
import json
import math
import os
import platform
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:  # PyTorch >= 2.6
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # 2.4 / 2.5
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="PyTorch FSDP2 training-step benchmark of a Llama-style model (JSON report).",
    )
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    ap.add_argument("--head-dim", type=int, default=None, help="default: dim / heads")
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--norm-eps", type=float, default=1e-5)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=8, help="measured steps")
    ap.add_argument("--warmup", type=int, default=2, help="steps run before measuring")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--param-dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="f32")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="global norm; 0: no clipping")
    ap.add_argument("--no-reshard-after-forward", action="store_true",
                    help="keep gathered block parameters from forward to backward")
    ap.add_argument("--adamw", choices=["default", "foreach", "fused"], default="default",
                    help="torch.optim.AdamW's implementation: torch's choice (foreach on CUDA), "
                         "foreach, or fused (torchtitan's default)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile each block (fullgraph) before fully_shard, as torchtitan's "
                         "compile option; the warm-up steps take the compilation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    args = ap.parse_args(argv)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.head_dim is None:
        if args.dim % args.heads:
            ap.error(f"--dim {args.dim} is not a multiple of --heads {args.heads}; give --head-dim")
        args.head_dim = args.dim // args.heads
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.head_dim % 2:
        ap.error("the head dimension must be even (rotary embedding)")
    for name in ["dim", "layers", "heads", "ffn", "vocab", "seq", "batch", "steps"]:
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must be at least 0")
    return args


class RMSNorm(nn.Module):
    """Root-mean-square normalisation computed in f32, scaled by a learned weight."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def rotate(x, cos, sin):
    """Rotary embedding, rotate-half convention; x: [b, heads, s, d], cos/sin: [s, d]."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = a.heads, a.kv_heads, a.head_dim
        self.wq = nn.Linear(a.dim, a.heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.heads * a.head_dim, a.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.kv_heads != self.heads:
            # Each k/v head serves heads / kv_heads query heads.
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, a):
        super().__init__()
        self.gate = nn.Linear(a.dim, a.ffn, bias=False)
        self.up = nn.Linear(a.dim, a.ffn, bias=False)
        self.down = nn.Linear(a.ffn, a.dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)
        self.rope = None  # (cos, sin) in f32, made on first use on the input's device

    def rope_tables(self, a, device):
        i = torch.arange(a.head_dim // 2, dtype=torch.float64, device=device)
        inv_freq = a.rope_theta ** (-2.0 * i / a.head_dim)
        ang = torch.outer(torch.arange(a.seq, dtype=torch.float64, device=device), inv_freq)
        ang = torch.cat((ang, ang), dim=-1)
        self.rope = (ang.cos().float(), ang.sin().float())

    def forward(self, tokens, targets):
        x = self.tok_embeddings(tokens)
        cos, sin = (t.to(x.dtype) for t in self.rope)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def init_weights(model, seed):
    """Normal(0, 0.02) for every matrix, ones for the norms (deterministic in the seed)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def param_count(a):
    kv = a.kv_heads * a.head_dim
    attn = a.dim * a.heads * a.head_dim * 2 + a.dim * kv * 2
    block = attn + 3 * a.dim * a.ffn + 2 * a.dim
    return a.layers * block + 2 * a.vocab * a.dim + a.dim


def flops_per_token(a):
    """Training FLOPs per token, torchtitan/PaLM convention (shardplan inspect's)."""
    non_embedding = param_count(a) - a.vocab * a.dim
    return 6 * non_embedding + 12 * a.layers * a.heads * a.head_dim * a.seq


def start_process_group(device):
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda but torch.cuda.is_available() is false (no GPU or driver?)")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return dev, rank, world


def follow_permutation(perm, starts, seq):
    """[b] starting tokens -> [b, seq + 1] tokens following `perm`, in log2(seq) gathers."""
    # Powers of the permutation: perm^(2^k); position j is start mapped by perm^j.
    b = starts.shape[0]
    pos = torch.arange(seq + 1, device=starts.device)
    out = starts.unsqueeze(1).expand(b, seq + 1).clone()
    power = perm.clone()
    k = 0
    while (1 << k) <= seq:
        bit = ((pos >> k) & 1).bool()
        out[:, bit] = power[out[:, bit]]
        power = power[power]
        k += 1
    return out


def peak_rss_bytes():
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if platform.system() == "Darwin" else r * 1024


def main(argv=None):
    a = parse_args(argv)
    if a.device == "cpu" and (a.threads or "RANK" not in os.environ):
        # Under torchrun, keep its one-thread-per-process default unless --threads says otherwise.
        torch.set_num_threads(a.threads or os.cpu_count() or 1)
    dev, rank, world = start_process_group(a.device)
    try:
        report = run(a, dev, rank, world)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        write_report(report, a.out)


def write_report(report, out):
    """Prints the JSON report, and writes it to `out` too when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")


def run(a, dev, rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(a.seed)
    mesh = init_device_mesh(dev.type, (world,))
    model = Llama(a)
    init_weights(model, a.seed)
    model.to(dev)
    model.rope_tables(a, dev)
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[a.param_dtype], reduce_dtype=DTYPES[a.reduce_dtype])
    reshard = not a.no_reshard_after_forward
    for block in model.layers:
        if a.compile:
            # In place (nn.Module.compile), so the block stays the module FSDP2 wraps.
            block.compile(fullgraph=True)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    # The root keeps its parameters gathered after forward (backward needs them first).
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[a.adamw]
    opt = torch.optim.AdamW(
        model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.weight_decay, **impl
    )
    n_params = sum(p.numel() for p in model.parameters())  # DTensor numel is the global size

    g = torch.Generator(device="cpu").manual_seed(a.seed)
    perm = torch.randperm(a.vocab, generator=g).to(dev)
    starts = torch.Generator(device="cpu").manual_seed(a.seed + 1 + rank)

    def batch():
        s = torch.randint(0, a.vocab, (a.batch,), generator=starts).to(dev)
        toks = follow_permutation(perm, s, a.seq)
        return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def step():
        tokens, targets = batch()
        loss = model(tokens, targets)
        loss.backward()
        if a.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        else:
            norm = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        # The loss over the global batch (every rank's batch has the same size).
        l = loss.detach().clone()
        dist.all_reduce(l, op=dist.ReduceOp.AVG if dev.type == "cuda" else dist.ReduceOp.SUM)
        if dev.type != "cuda":
            l /= world
        gn = None
        if norm is not None:
            gn = norm.full_tensor().item() if hasattr(norm, "full_tensor") else float(norm)
        return l.item(), gn

    if dev.type == "cuda":
        sync()
        after_init = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        after_init = None
    losses, norms, times = [], [], []
    for i in range(a.warmup + a.steps):
        sync()
        t0 = time.perf_counter()
        loss, gn = step()
        sync()
        dt = time.perf_counter() - t0
        losses.append(loss)
        norms.append(gn)
        if i >= a.warmup:
            times.append(dt)
        if not math.isfinite(loss):
            raise SystemExit(f"error: non-finite loss {loss} at step {i + 1}")
    tokens_per_step = a.batch * a.seq * world
    med = statistics.median(times)
    report = {
        "benchmark": "fsdp2_step",
        "framework": "pytorch-fsdp2",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": a.device,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "world": world,
        "model": {
            "dim": a.dim, "layers": a.layers, "heads": a.heads, "kv_heads": a.kv_heads,
            "head_dim": a.head_dim, "ffn": a.ffn, "vocab": a.vocab, "norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta, "tie_embeddings": False,
        },
        "params": n_params,
        "params_formula": param_count(a),
        "flops_per_token": flops_per_token(a),
        "batch_per_rank": a.batch,
        "seq": a.seq,
        "tokens_per_step": tokens_per_step,
        "param_dtype": a.param_dtype,
        "reduce_dtype": a.reduce_dtype,
        "master_dtype": "f32",
        "wrap": "one fully_shard per block + root",
        "reshard_after_forward": not a.no_reshard_after_forward,
        "optimizer": {"adamw": {"lr": a.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": a.weight_decay,
                                "implementation": a.adamw}},
        "compile": "torch.compile per block (fullgraph)" if a.compile else None,
        "grad_clip": a.grad_clip or None,
        "warmup_steps": a.warmup,
        "measured_steps": a.steps,
        "step_seconds": times,
        "step_seconds_median": med,
        "tokens_per_second": tokens_per_step / med,
        "tokens_per_second_mean": tokens_per_step * len(times) / sum(times),
        "tflops_per_second": flops_per_token(a) * tokens_per_step / med / 1e12,
        "losses": losses,
        "grad_norms": norms,
    }
    if dev.type == "cuda":
        report["memory"] = {
            "source": "torch.cuda.max_memory_allocated / max_memory_reserved (training steps)",
            "after_init_allocated_bytes": after_init,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(dev),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(dev),
        }
        report["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
    else:
        report["memory"] = {"source": "peak RSS of the process (getrusage)", "peak_rss_bytes": peak_rss_bytes()}
    return report


if __name__ == "__main__":
    main()
