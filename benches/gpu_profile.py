#!/usr/bin/env python3
"""Measures the constants of shardplan's per-op cost model on one GPU.

The planner times every op of a training step from a hardware profile
(planner/src/cost.rs, frontends/src/hardware.rs; the book's docs/src/cost-model.md).
This script measures the profile's efficiency constants with PyTorch on the GPU at hand,
under the planner's own definitions, so that the numbers can be pasted into a parallel
spec:

  python3 benches/gpu_profile.py --out profile.json             # CUDA, about a minute
  python3 benches/gpu_profile.py --device cpu --quick            # smoke test, tiny sizes

Sections (--sections picks a subset):

  matmul     bf16 GEMMs: an 8192^3 square one, and Llama's linear layers (tokens M in
             {4096, 16384} x (K, N) in {(4096, 4096), (4096, 11008), (11008, 4096),
             (4096, 14336), (8192, 8192), (8192, 28672)}) as forward (M x N out, K
             reduced), input gradient (M x K out, N reduced) and weight gradient (N x K
             out, M reduced). Each gives TFLOP/s, the fraction of --peak-tflops, and that
             fraction divided by the planner's tile fill (cost.rs `tile_fill`: the output
             cut into matmul_tile_m x matmul_tile_n tiles run in waves of sm_count, a
             partial wave or edge tile costing a whole one): the planner's
             `matmul_efficiency`. The profile's value is the one that makes the planner's
             summed time over all the Llama shapes equal the measured sum, scaled down by
             the sustained run's slowdown (below) when there is one.
  sustained  the square GEMM back to back for --sustain-seconds: TFLOP/s per window,
             first against last (power and clock limits that a short median hides).
  attention  torch.nn.functional.scaled_dot_product_attention forced to the flash backend
             (CUDA), bf16, 32 heads of 128, batch x seq = 16384 tokens, seq in {2048, 8192},
             causal and not, forward and backward. FLOPs as the planner counts them:
             4 b h s t d forward; backward 2.5x that plus 10 per score (the five parts of
             cost.rs, two of which touch the probabilities); a causal mask keeps the
             fraction of 128 x 128 blocks cost.rs `kept` gives. The profile's values are
             the time-weighted fits over the causal runs (what Llama trains with).
  memory     a large copy (y.copy_(x)) and an elementwise add (torch.add(x, y, out=z)),
             bf16, at 1 GiB per tensor and at one [16384, 4096] activation (128 MiB): bytes
             read + written over time, as a fraction of --hbm-gbps. `memory_efficiency`
             is the add on the activation (the size and kind of an eager training op).
  launch     10,000 `x.add_(1)` on a one-element tensor, synchronised once at the end:
             the per-op cost of eager PyTorch (`kernel_launch_us`); an allocating
             `torch.mul` on a small tensor beside it.
  eager      the memory-bound pieces the planner counts with its eager_traffic table, as
             torchtitan writes them, at Llama 7B shapes (16384 tokens x 4096, 32 heads):
             RMSNorm (x.float(), pow, mean, rsqrt, mul, type_as, * weight) forward and
             backward, the view_as_complex rotary embedding forward and backward, and
             cross-entropy on logits.float() (32,000 classes) forward and backward; each
             against the planner's prediction from the graph nodes it times for it
             (bytes x eager_traffic factor / (hbm_gbps x memory_efficiency), at least
             kernels x kernel_launch_us), with the built-in constants and with the ones
             measured here.
  overlap    with two or more GPUs: two processes (NCCL), a 8192^3 GEMM alone and while
             all-gathers of --overlap-mib run on NCCL's stream: `overlap_slowdown`, and the
             all-gather's bus bandwidth against the profile's NVLink rate
             (`collective_efficiency`, from two GPUs only). With one GPU it is skipped
             (a one-rank group moves nothing); --overlap on runs it anyway, on the CPU
             with gloo, to test the plumbing.

Timing: CUDA events around every iteration (on the CPU, perf_counter), --warmup
iterations first, the median of --iters. Output: a text table on stdout, a JSON report
(--out FILE, rewritten after every section with "complete": false until the end, so a run
cut short keeps what it measured), and a `hardware:` line for a parallel spec with the
measured constants rounded to 2 decimals. Progress goes to stderr.

Peaks: --peak-tflops and --hbm-gbps, by default looked up by torch.cuda.get_device_name()
(H100 SXM 989 / 3,350, H100 PCIe 756 / 2,000, H100 NVL 835 / 3,900, H200 989 / 4,800,
A100 80GB 312 / 2,039, A100 40GB 312 / 1,555, B200 2,250 / 8,000; the dense bf16 peaks
and HBM rates of the data sheets, as the built-in profiles use). An unknown GPU needs
both flags. On the CPU the peaks are nominal and every efficiency is meaningless.

Exit: 0 done; 1 a section failed (the others are still reported); 2 bad arguments, or
--device cuda without a usable CUDA device.
"""

import argparse
import datetime
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # pragma: no cover - environment problem
    print(f"gpu_profile: error: cannot import torch ({e})", file=sys.stderr)
    sys.exit(2)

SECTIONS = ["matmul", "sustained", "attention", "memory", "launch", "eager", "overlap"]

# The built-in profiles of frontends/src/hardware.rs: the figures this script measures
# against or compares with (bf16 TFLOP/s, HBM GB/s, SMs, cuBLAS tile, matmul efficiency,
# attention forward / backward efficiency, NVLink GB/s). memory_efficiency 0.85 and
# kernel_launch_us 5 unless a profile says otherwise (memory=, launch=); collective_efficiency
# 0.80 and overlap_slowdown nccl_channels / (sm_count - nccl_channels) with 16 channels are
# the same for all.
BUILTINS = {
    "h100-sxm": dict(bf16=989.0, hbm=3350.0, sms=132, tile=(128, 256), matmul=0.70, attn=(0.35, 0.30), nvlink=450.0),
    "h100-sxm-96gb": dict(bf16=989.0, hbm=3350.0, sms=132, tile=(128, 256), matmul=0.70, attn=(0.35, 0.30), nvlink=450.0),
    # The H200's built-ins are this script's own measurements there (hardware.rs H200_MEASURED).
    "h200": dict(bf16=989.0, hbm=4800.0, sms=132, tile=(128, 256), matmul=0.63, attn=(0.34, 0.29), nvlink=450.0, memory=0.79, launch=9.3),
    "a100-40gb": dict(bf16=312.0, hbm=1555.0, sms=108, tile=(128, 128), matmul=0.80, attn=(0.70, 0.60), nvlink=300.0),
    "a100-80gb": dict(bf16=312.0, hbm=2039.0, sms=108, tile=(128, 128), matmul=0.80, attn=(0.70, 0.60), nvlink=300.0),
    "b200": dict(bf16=2250.0, hbm=8000.0, sms=148, tile=(128, 256), matmul=0.70, attn=(0.35, 0.30), nvlink=900.0),
}
MEMORY_EFFICIENCY = 0.85
KERNEL_LAUNCH_US = 5.0
COLLECTIVE_EFFICIENCY = 0.80
NCCL_CHANNELS = 16.0
ATTENTION_BLOCK = 128

# cost.rs `eager_traffic`: (kernels, multiple of the fused op's bytes) under `kernels: eager`.
EAGER_TRAFFIC = {
    "rms_norm": (7.0, 38.0 / 4.0),
    "rms_norm_grad": (8.0, 58.0 / 6.0),  # with respect to the input
    "rms_norm_grad_weight": (2.0, 2.0),
    "rope": (3.0, 5.0),
    "rope_grad": (3.0, 5.0),
    "cross_entropy": (2.0, 2.0),
    "cross_entropy_grad": (2.0, 2.0),
    "cast": (1.0, 1.0),
}


def log(msg):
    print(f"gpu_profile: {msg}", file=sys.stderr, flush=True)


def die(msg):
    print(f"gpu_profile: error: {msg}", file=sys.stderr)
    sys.exit(2)


# --- the planner's formulas ----------------------------------------------------------------


def tile_fill(m, n, batch, tile_m, tile_n, sms):
    """cost.rs `OpModel::tile_fill`: the fraction of tile slots an m x n output fills."""
    tm, tn, sms = max(tile_m, 1.0), max(tile_n, 1.0), max(sms, 1.0)
    tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
    waves = max(math.ceil(tiles / sms), 1.0)
    return min(max(batch * m * n / (waves * sms * tm * tn), 1e-6), 1.0)


def kept(s, t, causal, block=ATTENTION_BLOCK):
    """cost.rs `OpModel::kept`: the fraction of an s x t score matrix's blocks flash attention
    computes (query blocks aligned to the end of the keys, each up to its diagonal)."""
    if not causal or s == 0 or t == 0:
        return 1.0
    b = max(block, 1)
    nq, nk = math.ceil(s / b), math.ceil(t / b)
    offset = nk - nq
    total = sum(min(max(i + 1 + offset, 0), nk) for i in range(nq))
    return total / (nq * nk)


def node_seconds(bytes_, kernels, factor, bw, launch, flops=0.0, peak=1.0):
    """cost.rs, a memory-bound op: bytes x factor at bw, at least kernels launches."""
    return max(bytes_ * factor / bw, flops / peak, kernels * launch)


# --- device and reference peaks ------------------------------------------------------------


def lookup(name, total_gib):
    """(builtin base, bf16 TFLOP/s, HBM GB/s, note) for a CUDA device name, or None."""
    n = name.upper()
    if "GH200" in n:
        # Grace Hopper: an H100-class GPU with 96 GB of HBM3 (4,000 GB/s) or 144 GB of HBM3e (4,900).
        hbm = 4900.0 if total_gib > 100 else 4000.0
        return "h200", 989.0, hbm, f"GH200: 989 TFLOP/s, {hbm:,.0f} GB/s (no built-in profile; base h200 with its HBM rate overridden)"
    if "H200" in n:
        return "h200", 989.0, 4800.0, None
    if "H100" in n or "H800" in n:
        if "PCIE" in n:
            return "h100-sxm", 756.0, 2000.0, "H100 PCIe: 756 TFLOP/s, 2,000 GB/s (no built-in profile; base h100-sxm with its peaks overridden)"
        if "NVL" in n:
            return "h100-sxm", 835.0, 3900.0, "H100 NVL: 835 TFLOP/s, 3,900 GB/s (no built-in profile; base h100-sxm with its peaks overridden)"
        base = "h100-sxm-96gb" if total_gib > 85 else "h100-sxm"
        return base, 989.0, 3350.0, None
    if "A100" in n:
        if total_gib > 50:
            return "a100-80gb", 312.0, 2039.0, None
        return "a100-40gb", 312.0, 1555.0, None
    if "B200" in n:
        return "b200", 2250.0, 8000.0, None
    return None


def describe_device(args):
    """The device, its reference peaks and the profile it is compared with."""
    info = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name(0)
        total_gib = props.total_memory / 2**30
        info.update(
            kind="cuda",
            name=name,
            memory_gib=round(total_gib, 2),
            sm_count=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            device_count=torch.cuda.device_count(),
            cudnn=torch.backends.cudnn.version(),
        )
        found = lookup(name, total_gib)
        base = args.base or (found[0] if found else None)
        # An unknown GPU takes its peaks from --base when one is given.
        given = BUILTINS[args.base] if args.base else {}
        peak = args.peak_tflops or (found[1] if found else given.get("bf16"))
        hbm = args.hbm_gbps or (found[2] if found else given.get("hbm"))
        note = found[3] if found else (None if not args.base else f"unknown GPU: the peaks of --base {args.base} unless given")
        if peak is None or hbm is None:
            die(f"unknown GPU `{name}`: pass --peak-tflops (dense bf16) and --hbm-gbps, or --base (the built-in profile whose peaks to use)")
        base = base or "h100-sxm"
        sms = args.sm_count or props.multi_processor_count
    else:
        info.update(kind="cpu", name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
        base = args.base or "h100-sxm"
        peak = args.peak_tflops or 1.0
        hbm = args.hbm_gbps or 20.0
        sms = args.sm_count or max(torch.get_num_threads(), 1)
        note = "CPU: nominal peaks (1 TFLOP/s, 20 GB/s unless given); a smoke test, every efficiency is meaningless"
    b = BUILTINS[base]
    tile = (args.tile_m or b["tile"][0], args.tile_n or b["tile"][1])
    ref = {
        "base": base,
        "bf16_tflops": peak,
        "hbm_gbps": hbm,
        "sm_count": sms,
        "matmul_tile_m": tile[0],
        "matmul_tile_n": tile[1],
        "intra_node_gbps": b["nvlink"],
        "note": note,
        "builtin": {
            "bf16_tflops": b["bf16"],
            "hbm_gbps": b["hbm"],
            "sm_count": b["sms"],
            "matmul_efficiency": b["matmul"],
            "attention_fwd_efficiency": b["attn"][0],
            "attention_bwd_efficiency": b["attn"][1],
            "memory_efficiency": b.get("memory", MEMORY_EFFICIENCY),
            "kernel_launch_us": b.get("launch", KERNEL_LAUNCH_US),
            "collective_efficiency": COLLECTIVE_EFFICIENCY,
            "overlap_slowdown": NCCL_CHANNELS / (b["sms"] - NCCL_CHANNELS),
        },
    }
    return info, ref


# --- timing --------------------------------------------------------------------------------


class Timer:
    def __init__(self, device):
        self.cuda = device == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, fn, warmup, iters):
        """Seconds per call: median, min, max over `iters` calls after `warmup` ones."""
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        if self.cuda:
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
            for s, e in ev:
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) / 1e3 for s, e in ev]
        else:
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "iters": iters}

    def block(self, fn, n):
        """Seconds per call of `n` calls issued back to back, synchronised once."""
        self.sync()
        if self.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            s.record()
            for _ in range(n):
                fn()
            e.record()
            torch.cuda.synchronize()
            host = time.perf_counter() - t0
            return s.elapsed_time(e) / 1e3 / n, host / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = time.perf_counter() - t0
        return host / n, host / n


def free_memory():
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# --- sizes ---------------------------------------------------------------------------------


def sizes(quick):
    if quick:
        return dict(
            square=256,
            tokens=[64, 128],
            kn=[(64, 64), (64, 172), (172, 64), (64, 224), (128, 128), (128, 448)],
            attn_tokens=512,
            attn_heads=4,
            head_dim=32,
            seqs=[128, 256],
            mem_big=4 << 20,
            mem_act=(512, 512),
            launch_ops=1000,
            eager_tokens=512,
            eager_dim=512,
            eager_heads=4,
            eager_seq=256,
            vocab=1000,
            overlap_n=256,
        )
    return dict(
        square=8192,
        tokens=[4096, 16384],
        kn=[(4096, 4096), (4096, 11008), (11008, 4096), (4096, 14336), (8192, 8192), (8192, 28672)],
        attn_tokens=16384,
        attn_heads=32,
        head_dim=128,
        seqs=[2048, 8192],
        mem_big=1 << 30,
        mem_act=(16384, 4096),
        launch_ops=10000,
        eager_tokens=16384,
        eager_dim=4096,
        eager_heads=32,
        eager_seq=4096,
        vocab=32000,
        overlap_n=8192,
    )


# --- sections ------------------------------------------------------------------------------


def bench_matmul(ctx):
    args, dev, t, ref, sz = ctx["args"], ctx["dev"], ctx["timer"], ctx["ref"], ctx["sizes"]
    dt = torch.bfloat16
    peak = ref["bf16_tflops"] * 1e12
    b = ref["builtin"]
    bw_builtin = ref["hbm_gbps"] * 1e9 * b["memory_efficiency"]
    tm, tn, sms = ref["matmul_tile_m"], ref["matmul_tile_n"], ref["sm_count"]

    def row(kind, m, k, n, out_m, out_n, fn, operands_bytes):
        r = t.run(fn, args.warmup, args.iters)
        flops = 2.0 * m * k * n
        secs = r["median_s"]
        fill = tile_fill(out_m, out_n, 1, tm, tn, sms)
        # The planner's time with the built-in matmul_efficiency, on this peak and tile.
        pred = max(flops / (peak * b["matmul_efficiency"] * fill), operands_bytes / bw_builtin, b["kernel_launch_us"] * 1e-6)
        return {
            "kind": kind,
            "tokens": m if kind != "square" else None,
            "m": m,
            "k": k,
            "n": n,
            "out": [out_m, out_n],
            "flops": flops,
            "median_ms": secs * 1e3,
            "min_ms": r["min_s"] * 1e3,
            "tflops": flops / secs / 1e12,
            "frac_peak": flops / secs / peak,
            "tile_fill": fill,
            "efficiency": flops / secs / peak / fill,
            "predicted_ms_builtin": pred * 1e3,
            "measured_over_predicted": secs / pred,
        }

    out = {"dtype": "bf16", "shapes": []}
    s = sz["square"]
    a = torch.randn(s, s, device=dev, dtype=dt)
    w = torch.randn(s, s, device=dev, dtype=dt)
    log(f"matmul: square {s}^3")
    out["square"] = row("square", s, s, s, s, s, lambda: torch.mm(a, w), 3 * s * s * 2)
    del a, w
    free_memory()
    for m in sz["tokens"]:
        for k, n in sz["kn"]:
            log(f"matmul: M={m} K={k} N={n} (forward, input gradient, weight gradient)")
            x = torch.randn(m, k, device=dev, dtype=dt)
            wt = torch.randn(n, k, device=dev, dtype=dt) / math.sqrt(k)  # nn.Linear's [out, in]
            dy = torch.randn(m, n, device=dev, dtype=dt)
            io = 2 * (m * k + n * k + m * n)
            # Forward: x @ w^T, M x N out (cost.rs: Linear, tiled M x N).
            out["shapes"].append(row("forward", m, k, n, m, n, lambda: F.linear(x, wt), io))
            # Input gradient: dy @ w, M x K out, N reduced (the planner's flipped Linear).
            out["shapes"].append(row("input_grad", m, n, k, m, k, lambda: torch.mm(dy, wt), io))
            # Weight gradient: dy^T @ x, N x K out ([out, in], as the weight), M reduced.
            out["shapes"].append(row("weight_grad", n, m, k, n, k, lambda: torch.mm(dy.t(), x), io))
            out["shapes"][-1]["tokens"] = m
            del x, wt, dy
            free_memory()
    rows = out["shapes"]
    # The efficiency that makes the planner's summed time over the Llama shapes the measured sum.
    ideal = sum(r["flops"] / (peak * r["tile_fill"]) for r in rows)
    measured = sum(r["median_ms"] / 1e3 for r in rows)
    out["fit"] = {
        "matmul_efficiency": ideal / measured,
        "how": "sum over the Llama shapes of flops / (peak x tile_fill), over the summed measured time",
        "by_kind": {},
        "by_tokens": {},
        "predicted_over_measured_builtin": sum(r["predicted_ms_builtin"] for r in rows) / sum(r["median_ms"] for r in rows),
    }
    for key, field in (("by_kind", "kind"), ("by_tokens", "tokens")):
        for v in sorted({r[field] for r in rows}, key=str):
            sel = [r for r in rows if r[field] == v]
            out["fit"][key][str(v)] = sum(r["flops"] / (peak * r["tile_fill"]) for r in sel) / sum(r["median_ms"] / 1e3 for r in sel)
    effs = sorted(r["efficiency"] for r in rows)
    out["fit"]["efficiency_min"], out["fit"]["efficiency_median"], out["fit"]["efficiency_max"] = effs[0], statistics.median(effs), effs[-1]
    return out


def nvml_sample():
    """Clock (MHz), power (W) and temperature (C) through torch.cuda's NVML helpers, where
    pynvml is installed; {} otherwise."""
    s = {}
    for key, fn in (("sm_clock_mhz", "clock_rate"), ("power_w", "power_draw"), ("temperature_c", "temperature")):
        try:
            v = getattr(torch.cuda, fn)()
            s[key] = v / 1000.0 if fn == "power_draw" else v  # power_draw is in mW
        except Exception:
            pass
    return s


def bench_sustained(ctx):
    args, dev, t, ref, sz = ctx["args"], ctx["dev"], ctx["timer"], ctx["ref"], ctx["sizes"]
    s = sz["square"]
    a = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    w = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    flops = 2.0 * s**3
    per = t.run(lambda: torch.mm(a, w), args.warmup, max(args.iters // 2, 3))["median_s"]
    seconds = args.sustain_seconds
    total = max(int(seconds / per), 4)
    window = max(int(0.5 / per), 1) if seconds >= 2 else max(total // 4, 1)
    log(f"sustained: {s}^3 GEMMs back to back for ~{seconds:g} s, timed in windows of {window}")
    samples = []
    # Issued until the host has spent `seconds` (on CUDA the host runs at most a queue's
    # worth of launches ahead), and at least 4 windows.
    start = time.perf_counter()

    def more(i):
        return i < 4 * window or (time.perf_counter() - start < seconds and i < 100 * total)

    if t.cuda:
        marks = [torch.cuda.Event(enable_timing=True)]
        marks[0].record()
        i = 0
        while more(i):
            torch.mm(a, w)
            i += 1
            if i % window == 0:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                marks.append(e)
                # The queue holds ~1,000 launches, so the host runs about this far ahead.
                if len(marks) % 4 == 0:
                    sample = nvml_sample()
                    if sample:
                        samples.append(sample)
        torch.cuda.synchronize()
        wins = [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(len(marks) - 1)]
    else:
        wins = []
        t0 = time.perf_counter()
        i = 0
        while more(i):
            torch.mm(a, w)
            i += 1
            if i % window == 0:
                t1 = time.perf_counter()
                wins.append(t1 - t0)
                t0 = t1
    tf = [window * flops / x / 1e12 for x in wins]
    if not tf:
        return {"error": "no complete window"}
    first, last = tf[0], statistics.median(tf[-max(len(tf) // 4, 1):])
    out = {
        "gemm": s,
        "window_gemms": window,
        "windows": len(tf),
        "seconds": sum(wins),
        "tflops_per_window": tf,
        "tflops_first": first,
        "tflops_last_quarter": last,
        "tflops_min": min(tf),
        "burst_tflops": flops / per / 1e12,
        # Sustained throughput against the short median just before it (a warm GPU).
        "sustained_over_burst": last / (flops / per / 1e12),
        "frac_peak_sustained": last * 1e12 / (ref["bf16_tflops"] * 1e12),
    }
    if samples:
        out["nvml_samples"] = samples
    return out


def bench_attention(ctx):
    args, dev, t, ref, sz = ctx["args"], ctx["dev"], ctx["timer"], ctx["ref"], ctx["sizes"]
    peak = ref["bf16_tflops"] * 1e12
    dt = torch.bfloat16
    h, d = sz["attn_heads"], sz["head_dim"]
    rows = []
    backend = "flash (forced)" if t.cuda else "default (CPU)"
    ctxmgr = None
    if t.cuda:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            ctxmgr = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # noqa: E731
        except ImportError:  # PyTorch < 2.3
            ctxmgr = lambda: torch.backends.cuda.sdp_kernel(enable_flash=True, enable_math=False, enable_mem_efficient=False)  # noqa: E731
    for s in sz["seqs"]:
        bsz = max(sz["attn_tokens"] // s, 1)
        for causal in (True, False):
            log(f"attention: batch {bsz} x seq {s}, {h} heads of {d}, {'causal' if causal else 'full'}")
            # torchtitan's layout: [b, s, h, d] projections, transposed to [b, h, s, d].
            q, k, v = (torch.randn(bsz, s, h, d, device=dev, dtype=dt).transpose(1, 2).requires_grad_() for _ in range(3))
            dout = torch.randn(bsz, h, s, d, device=dev, dtype=dt)
            fwd_flops = 4.0 * bsz * h * s * s * d
            bwd_flops = 2.5 * fwd_flops + 10.0 * bsz * h * s * s
            frac = kept(s, s, causal)
            r = {"batch": bsz, "seq": s, "heads": h, "head_dim": d, "causal": causal, "kept": frac, "backend": backend,
                 "fwd_flops": fwd_flops, "bwd_flops": bwd_flops}
            try:
                with (ctxmgr() if ctxmgr else _null()):

                    def fwd():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                    rf = t.run(fwd, args.warmup, args.iters)
                    o = fwd()

                    def bwd():
                        return torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)

                    rb = t.run(bwd, args.warmup, args.iters)
                for key, res, fl, eff_key in (("fwd", rf, fwd_flops, "attention_fwd_efficiency"), ("bwd", rb, bwd_flops, "attention_bwd_efficiency")):
                    secs = res["median_s"]
                    r[f"{key}_ms"] = secs * 1e3
                    r[f"{key}_tflops_counted"] = fl / secs / 1e12  # the full score matrix, as MFU counts it
                    r[f"{key}_tflops_computed"] = fl * frac / secs / 1e12
                    r[f"{key}_efficiency"] = fl * frac / secs / peak
                    pred = fl * frac / (peak * ref["builtin"][eff_key])
                    r[f"{key}_predicted_ms_builtin"] = pred * 1e3
                    r[f"{key}_measured_over_predicted"] = secs / pred
                del o
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {e}".strip()[:500]
                log(f"attention: {r['error']}")
            rows.append(r)
            del q, k, v, dout
            free_memory()
    out = {"dtype": "bf16", "rows": rows}
    causal_ok = [r for r in rows if r["causal"] and "error" not in r]
    if causal_ok:
        for key in ("fwd", "bwd"):
            out[f"{key}_fit_causal"] = sum(r[f"{key}_flops"] * r["kept"] for r in causal_ok) / (peak * sum(r[f"{key}_ms"] / 1e3 for r in causal_ok))
    full_ok = [r for r in rows if not r["causal"] and "error" not in r]
    if full_ok:
        for key in ("fwd", "bwd"):
            out[f"{key}_fit_full"] = sum(r[f"{key}_flops"] for r in full_ok) / (peak * sum(r[f"{key}_ms"] / 1e3 for r in full_ok))
    if len(causal_ok) < len([r for r in rows if r["causal"]]) or len(full_ok) < len([r for r in rows if not r["causal"]]):
        out["error"] = "some configurations failed (see rows)"
    return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def bench_memory(ctx):
    args, dev, t, ref, sz = ctx["args"], ctx["dev"], ctx["timer"], ctx["ref"], ctx["sizes"]
    hbm = ref["hbm_gbps"] * 1e9
    rows = []
    big = sz["mem_big"] // 2
    act = sz["mem_act"][0] * sz["mem_act"][1]
    for label, numel in ((f"{big * 2 / 2**20:g} MiB", big), (f"[{sz['mem_act'][0]}, {sz['mem_act'][1]}]", act)):
        x = torch.randn(numel, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        z = torch.empty_like(x)
        nbytes = numel * 2
        for op, fn, moved in (  # noqa: B023 - each lambda runs before x, y, z change
            ("copy", lambda: y.copy_(x), 2 * nbytes),
            ("add", lambda: torch.add(x, y, out=z), 3 * nbytes),
        ):
            log(f"memory: {op} of {label} ({nbytes / 2**20:.0f} MiB per tensor)")
            r = t.run(fn, args.warmup, args.iters)
            secs = r["median_s"]
            rows.append({"op": op, "size": label, "activation": numel == act, "tensor_bytes": nbytes, "bytes_moved": moved, "median_ms": secs * 1e3,
                         "gbps": moved / secs / 1e9, "frac_hbm": moved / secs / hbm})
        del x, y, z
        free_memory()
    pick = next(r for r in rows if r["op"] == "add" and r["activation"])
    return {"dtype": "bf16", "rows": rows, "memory_efficiency": pick["frac_hbm"],
            "how": f"the elementwise add on one activation-sized bf16 tensor ([{sz['mem_act'][0]}, {sz['mem_act'][1]}]): read 2, write 1"}


def bench_launch(ctx):
    args, dev, t, sz = ctx["args"], ctx["dev"], ctx["timer"], ctx["sizes"]
    n = sz["launch_ops"]
    x = torch.zeros(1, device=dev)
    a = torch.randn(64, 64, device=dev)
    b = torch.randn(64, 64, device=dev)
    log(f"launch: {n} x.add_(1) on a one-element tensor, synchronised once")
    for _ in range(min(n, 1000)):  # warm-up: allocator, dispatcher caches, lazy module loading
        x.add_(1)
    reps = []
    for _ in range(3):
        dev_s, host_s = t.block(lambda: x.add_(1), n)
        reps.append((dev_s, host_s))
    dev_s, host_s = min(reps)
    log(f"launch: {n} torch.mul(a, b) on 64 x 64 (allocating)")
    for _ in range(min(n, 1000)):
        torch.mul(a, b)
    mul = min(t.block(lambda: torch.mul(a, b), n) for _ in range(3))
    return {
        "ops": n,
        "kernel_launch_us": dev_s * 1e6,
        "host_us_per_op": host_s * 1e6,
        "repeats_us": [r[0] * 1e6 for r in reps],
        "alloc_mul_us": mul[0] * 1e6,
        "how": "x.add_(1) on a one-element tensor, n back to back, one synchronisation; the best of 3 runs; "
        "device time between events around the loop (the GPU waits on the host when dispatch is slower)",
    }


class RMSNorm(torch.nn.Module):
    """torchtitan's RMSNorm (models/norms.py before nn.RMSNorm): f32 temporaries."""

    def __init__(self, dim, eps=1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


def precompute_freqs_cis(dim, end, theta=10000.0, device=None):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb(x, freqs_cis):
    """torchtitan's apply_rotary_emb for one of q, k: [b, s, h, d] through complex64."""
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    fc = freqs_cis.view(1, x_.shape[1], 1, x_.shape[-1])
    return torch.view_as_real(x_ * fc).flatten(3).type_as(x)


def bench_eager(ctx):
    args, dev, t, ref, sz, meas = ctx["args"], ctx["dev"], ctx["timer"], ctx["ref"], ctx["sizes"], ctx["report"]
    dt = torch.bfloat16
    n, dim, heads, seq = sz["eager_tokens"], sz["eager_dim"], sz["eager_heads"], sz["eager_seq"]
    hd = dim // heads
    vocab = sz["vocab"]
    hbm = ref["hbm_gbps"] * 1e9
    mem_eff = (meas.get("memory") or {}).get("memory_efficiency")
    launch_us = (meas.get("launch") or {}).get("kernel_launch_us")
    rows = []

    def record(name, res, nodes, numel, note=None):
        """nodes: the planner's graph nodes for this piece, (op, bytes its graph counts)."""
        secs = res["median_s"]

        def predict(eff, launch):
            return sum(node_seconds(b, EAGER_TRAFFIC[op][0], EAGER_TRAFFIC[op][1], hbm * eff, launch * 1e-6) for op, b in nodes)

        pred_b = predict(ref["builtin"]["memory_efficiency"], ref["builtin"]["kernel_launch_us"])
        r = {
            "name": name,
            "elements": numel,
            "median_ms": secs * 1e3,
            "min_ms": res["min_s"] * 1e3,
            "planner_nodes": [{"op": op, "fused_bytes": b, "kernels": EAGER_TRAFFIC[op][0], "factor": EAGER_TRAFFIC[op][1]} for op, b in nodes],
            "planner_bytes_per_element": sum(b * EAGER_TRAFFIC[op][1] for op, b in nodes) / numel,
            "predicted_ms_builtin": pred_b * 1e3,
            "measured_over_predicted_builtin": secs / pred_b,
        }
        if mem_eff and launch_us:
            pred_m = predict(mem_eff, launch_us)
            r["predicted_ms_measured"] = pred_m * 1e3
            r["measured_over_predicted_measured"] = secs / pred_m
            # Bytes per element the measured time moves at the measured bandwidth.
            r["effective_bytes_per_element"] = secs * hbm * mem_eff / numel
        if note:
            r["note"] = note
        rows.append(r)

    def fwd_bwd(name_f, name_b, make, inputs, grad_shape, nodes_f, nodes_b, numel, note=None):
        log(f"eager: {name_f} and {name_b}")
        try:
            rf = t.run(make, args.warmup, args.iters)
            out = make()
            dy = torch.randn(grad_shape, device=dev, dtype=out.dtype) if out.dim() else torch.ones((), device=dev, dtype=out.dtype)
            rb = t.run(lambda: torch.autograd.grad(out, inputs, dy, retain_graph=True), args.warmup, args.iters)
            record(name_f, rf, nodes_f, numel, note)
            record(name_b, rb, nodes_b, numel, note)
            del out, dy
        except Exception as e:
            rows.append({"name": name_f, "error": f"{type(e).__name__}: {e}"[:500]})
            log(f"eager: {name_f}: {rows[-1]['error']}")

    e = n * dim
    # RMSNorm: the planner's RmsNorm node (x, w -> y) and its two gradient nodes, wrt the
    # input (x, w, dy -> dx) and wrt the weight (x, w, dy -> dw), each with its eager factor.
    x = torch.randn(n, dim, device=dev, dtype=dt, requires_grad=True)
    norm = RMSNorm(dim, device=dev, dtype=dt)
    fwd_bwd(
        "rms_norm forward", "rms_norm backward", lambda: norm(x), (x, norm.weight), (n, dim),
        [("rms_norm", 2 * e + 2 * dim + 2 * e)],
        [("rms_norm_grad", 6 * e + 2 * dim), ("rms_norm_grad_weight", 4 * e + 2 * dim + 2 * dim)],
        e,
        note="the planner times two gradient nodes (wrt input and wrt weight), each at the eager factor",
    )
    if hasattr(F, "rms_norm"):
        w = norm.weight
        fwd_bwd(
            "F.rms_norm forward (comparison)", "F.rms_norm backward (comparison)",
            lambda: F.rms_norm(x, (dim,), w, 1e-6), (x, w), (n, dim),
            [("rms_norm", 2 * e + 2 * dim + 2 * e)],
            [("rms_norm_grad", 6 * e + 2 * dim), ("rms_norm_grad_weight", 4 * e + 2 * dim + 2 * dim)],
            e,
            note="torch.nn.functional.rms_norm, for comparison: the planner's eager prediction is for torchtitan's module",
        )
    del x, norm
    free_memory()
    # Rotary embedding on one [b, s, h, d] tensor: Rope (x -> y) and RopeGrad (dy -> dx).
    b = max(n // seq, 1)
    xq = torch.randn(b, seq, heads, hd, device=dev, dtype=dt, requires_grad=True)
    fc = precompute_freqs_cis(hd, seq, device=dev)
    ne = xq.numel()
    fwd_bwd(
        "rope forward", "rope backward", lambda: apply_rotary_emb(xq, fc), (xq,), tuple(xq.shape),
        [("rope", 4 * ne)], [("rope_grad", 4 * ne)], ne,
        note=f"one of q, k: [{b}, {seq}, {heads}, {hd}]",
    )
    del xq, fc
    free_memory()
    # Cross-entropy: the planner's graph casts the logits to f32 (a Cast node) and runs
    # CrossEntropy on them; backward CrossEntropyGrad (logits, targets, dy -> f32) and the
    # Cast's gradient (f32 -> bf16).
    logits = torch.randn(n, vocab, device=dev, dtype=dt, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), device=dev)
    ve = n * vocab
    fwd_bwd(
        "cross_entropy forward", "cross_entropy backward",
        lambda: F.cross_entropy(logits.float(), targets), (logits,), (),
        [("cast", 2 * ve + 4 * ve), ("cross_entropy", 4 * ve + 8 * n + 4)],
        [("cross_entropy_grad", 4 * ve + 8 * n + 4 + 4 * ve), ("cast", 4 * ve + 2 * ve)],
        ve,
        note=f"torchtitan's F.cross_entropy(pred.float(), labels), [{n}, {vocab}] bf16 logits",
    )
    del logits, targets
    free_memory()
    out = {"rows": rows, "hbm_gbps": ref["hbm_gbps"], "measured_memory_efficiency": mem_eff, "measured_kernel_launch_us": launch_us}
    if any("error" in r for r in rows):
        out["error"] = "some pieces failed (see rows)"
    return out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overlap_worker(rank, world, port, device, n, ag_mib, iters, outdir):
    """One rank of the overlap measurement (torch.multiprocessing.spawn target)."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        dt = torch.bfloat16
        a = torch.randn(n, n, device=dev, dtype=dt)
        w = torch.randn(n, n, device=dev, dtype=dt)
        numel = max((ag_mib << 20) // 2 // world, 1)
        shard = torch.randn(numel, device=dev, dtype=dt)
        full = torch.empty(numel * world, device=dev, dtype=dt)

        def sync():
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()

        def now():
            if cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                return e
            return time.perf_counter()

        def between(s, e):
            if cuda:
                torch.cuda.synchronize()
                return s.elapsed_time(e) / 1e3
            return e - s

        def gemms(k):
            for _ in range(k):
                torch.mm(a, w)

        def gather():
            dist.all_gather_into_tensor(full, shard)

        # The GEMM alone, in blocks of k.
        gemms(3)
        sync()
        s = now()
        gemms(3)
        one = between(s, now()) / 3
        k = max(int(0.05 / max(one, 1e-6)), 3)
        alone = []
        for _ in range(iters):
            sync()
            s = now()
            gemms(k)
            alone.append(between(s, now()) / k)
        # The all-gather alone.
        for _ in range(3):
            gather()
        ag = []
        for _ in range(iters):
            sync()
            s = now()
            gather()
            ag.append(between(s, now()))
        ag_s = statistics.median(ag)
        # The GEMM while all-gathers run on NCCL's stream, enough of them queued first to
        # cover the GEMMs' window one and a half times.
        # Every rank must issue the same number of collectives: the largest count wins.
        count = torch.tensor([max(math.ceil(1.5 * k * statistics.median(alone) / ag_s), 2)], device=dev)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        count = int(count.item())
        over, covered = [], []
        for _ in range(iters):
            sync()
            s0 = now()
            works = [dist.all_gather_into_tensor(full, shard, async_op=True) for _ in range(count)]
            s = now()
            gemms(k)
            e = now()
            for wk in works:
                wk.wait()
            e2 = now()
            window = between(s, e)
            over.append(window / k)
            # The all-gathers ran past the GEMMs' end (by a tenth of the GEMMs' window at least).
            covered.append(between(e, e2) > 0.1 * window)
        res = {
            "rank": rank,
            "gemm_alone_s": statistics.median(alone),
            "gemm_overlapped_s": statistics.median(over),
            "gemms_per_block": k,
            "allgather_s": ag_s,
            "allgather_bytes": full.numel() * 2,
            "allgathers_queued": count,
            "comm_covered_gemms": all(covered),
        }
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def bench_overlap(ctx):
    args, ref, sz = ctx["args"], ctx["ref"], ctx["sizes"]
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.overlap == "off":
        return {"skipped": "--overlap off"}
    if args.device == "cuda" and gpus < 2:
        return {"skipped": f"{gpus} GPU(s): the overlap measurement needs two (a one-rank NCCL group moves nothing)"}
    if args.device == "cpu" and args.overlap != "on":
        return {"skipped": "CPU: only with --overlap on (gloo, tests the plumbing)"}
    import torch.multiprocessing as mp

    world = 2
    n = sz["overlap_n"]
    ag_mib = args.overlap_mib if not args.quick else 8
    iters = max(args.iters // 2, 3)
    log(f"overlap: {world} processes, {n}^3 GEMM alone and beside {ag_mib} MiB all-gathers")
    with tempfile.TemporaryDirectory(prefix="gpu_profile_overlap.") as d:
        mp.spawn(overlap_worker, args=(world, _free_port(), args.device, n, ag_mib, iters, d), nprocs=world, join=True)
        ranks = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]
    alone = statistics.mean(r["gemm_alone_s"] for r in ranks)
    over = statistics.mean(r["gemm_overlapped_s"] for r in ranks)
    ag_s = max(r["allgather_s"] for r in ranks)
    nbytes = ranks[0]["allgather_bytes"]
    busbw = nbytes * (world - 1) / world / ag_s / 1e9
    out = {
        "world": world,
        "backend": "nccl" if args.device == "cuda" else "gloo",
        "gemm": n,
        "gemm_alone_ms": alone * 1e3,
        "gemm_overlapped_ms": over * 1e3,
        "overlap_slowdown": over / alone - 1.0,
        "allgather_mib": nbytes / 2**20,
        "allgather_ms": ag_s * 1e3,
        "allgather_busbw_gbps": busbw,
        "collective_efficiency": busbw / ref["intra_node_gbps"],
        "comm_covered_gemms": all(r["comm_covered_gemms"] for r in ranks),
        "ranks": ranks,
        "note": "two GPUs of one node: the bus bandwidth of a 2-rank ring, against the profile's NVLink rate; "
        "an 8-rank ring may differ",
    }
    if not out["comm_covered_gemms"]:
        out["warning"] = "the queued all-gathers ended before the GEMMs did: the slowdown is understated"
    return out


# --- report --------------------------------------------------------------------------------


def profile_values(rep, ref):
    """The measured constants under the planner's names, with how each was derived."""
    vals, how = {}, {}
    mm, sus = rep.get("matmul"), rep.get("sustained")
    if mm and "fit" in mm:
        fit = mm["fit"]["matmul_efficiency"]
        ratio = sus.get("sustained_over_burst") if sus and "sustained_over_burst" in sus else None
        if ratio is not None and ratio < 1.0:
            vals["matmul_efficiency"] = fit * ratio
            how["matmul_efficiency"] = f"shape fit {fit:.3f} x sustained/burst {ratio:.3f}"
        else:
            vals["matmul_efficiency"] = fit
            how["matmul_efficiency"] = f"shape fit {fit:.3f}" + ("" if ratio is not None else " (no sustained run)")
    at = rep.get("attention")
    if at:
        for key in ("fwd", "bwd"):
            if f"{key}_fit_causal" in at:
                vals[f"attention_{key}_efficiency"] = at[f"{key}_fit_causal"]
                how[f"attention_{key}_efficiency"] = "time-weighted fit over the causal runs"
    if rep.get("memory") and "memory_efficiency" in rep["memory"]:
        vals["memory_efficiency"] = rep["memory"]["memory_efficiency"]
        how["memory_efficiency"] = rep["memory"]["how"]
    if rep.get("launch") and "kernel_launch_us" in rep["launch"]:
        vals["kernel_launch_us"] = rep["launch"]["kernel_launch_us"]
        how["kernel_launch_us"] = "x.add_(1) back to back"
    ov = rep.get("overlap")
    if ov and "overlap_slowdown" in ov:
        vals["collective_efficiency"] = ov["collective_efficiency"]
        how["collective_efficiency"] = "2-rank all-gather bus bandwidth / intra_node_gbps"
        vals["overlap_slowdown"] = max(ov["overlap_slowdown"], 0.0)
        how["overlap_slowdown"] = "GEMM beside all-gathers / GEMM alone - 1"
    return vals, how


def yaml_line(ref, vals):
    b = ref["builtin"]
    parts = [f"base: {ref['base']}"]
    # Efficiencies are fractions of the peaks measured against: say them when they differ.
    if ref["bf16_tflops"] != b["bf16_tflops"]:
        parts.append(f"bf16_tflops: {ref['bf16_tflops']:g}")
    if ref["hbm_gbps"] != b["hbm_gbps"]:
        parts.append(f"hbm_gbps: {ref['hbm_gbps']:g}")
    if ref["sm_count"] != b["sm_count"]:
        parts.append(f"sm_count: {ref['sm_count']:g}")
    bt = BUILTINS[ref["base"]]["tile"]
    if ref["matmul_tile_m"] != bt[0]:
        parts.append(f"matmul_tile_m: {ref['matmul_tile_m']:g}")
    if ref["matmul_tile_n"] != bt[1]:
        parts.append(f"matmul_tile_n: {ref['matmul_tile_n']:g}")
    for k in ("matmul_efficiency", "attention_fwd_efficiency", "attention_bwd_efficiency", "memory_efficiency",
              "kernel_launch_us", "collective_efficiency", "overlap_slowdown"):
        if k in vals:
            parts.append(f"{k}: {vals[k]:.2f}")
    return "hardware: {" + ", ".join(parts) + "}"


def text_report(rep):
    L = []
    info, ref = rep["device"], rep["reference"]
    L.append(f"device: {info['name']} ({info['kind']}), torch {info['torch']}" + (f", CUDA {info.get('cuda')}, {info.get('sm_count')} SMs, {info.get('memory_gib')} GiB" if info["kind"] == "cuda" else ""))
    L.append(f"against: {ref['bf16_tflops']:g} TFLOP/s bf16, {ref['hbm_gbps']:g} GB/s HBM; tile {ref['matmul_tile_m']:g} x {ref['matmul_tile_n']:g} on {ref['sm_count']:g} SMs; built-in profile {ref['base']}")
    if ref.get("note"):
        L.append(f"note: {ref['note']}")
    mm = rep.get("matmul")
    if mm and "shapes" in mm:
        L.append("")
        L.append("matmul (bf16): efficiency = fraction of peak / tile fill (the planner's matmul_efficiency)")
        L.append(f"  {'kind rows x reduced x cols':<34} {'ms':>9} {'TFLOP/s':>9} {'of peak':>8} {'fill':>6} {'eff':>6} {'meas/pred':>10}")
        for r in [mm["square"]] + mm["shapes"]:
            shape = f"{r['kind']} {r['m']}x{r['k']}x{r['n']}"
            L.append(f"  {shape:<34} {r['median_ms']:9.3f} {r['tflops']:9.1f} {r['frac_peak']:8.3f} {r['tile_fill']:6.3f} {r['efficiency']:6.3f} {r['measured_over_predicted']:10.2f}")
        f = mm["fit"]
        L.append(f"  fit over the Llama shapes: matmul_efficiency {f['matmul_efficiency']:.3f} (by kind: "
                 + ", ".join(f"{k} {v:.3f}" for k, v in f["by_kind"].items()) + "; by tokens: "
                 + ", ".join(f"{k} {v:.3f}" for k, v in f["by_tokens"].items()) + ")")
        L.append(f"  built-in {ref['builtin']['matmul_efficiency']:.2f} predicts {f['predicted_over_measured_builtin']:.2f}x the measured time")
    elif mm:
        L.append(f"matmul: {mm.get('error')}")
    sus = rep.get("sustained")
    if sus and "tflops_first" in sus:
        L.append("")
        L.append(f"sustained {sus['gemm']}^3 GEMM, {sus['seconds']:.1f} s: first window {sus['tflops_first']:.1f} TFLOP/s, last quarter {sus['tflops_last_quarter']:.1f}, "
                 f"min {sus['tflops_min']:.1f}; burst median {sus['burst_tflops']:.1f}; sustained/burst {sus['sustained_over_burst']:.3f}")
        if sus.get("nvml_samples"):
            last = sus["nvml_samples"][-1]
            L.append("  NVML at the end: " + ", ".join(f"{k} {v:g}" for k, v in last.items()))
    elif sus:
        L.append(f"sustained: {sus.get('error') or sus.get('skipped')}")
    at = rep.get("attention")
    if at and "rows" in at:
        L.append("")
        L.append("attention (SDPA, bf16): efficiency = FLOPs on the kept blocks / time / peak")
        L.append(f"  {'b x s, heads x d, mask':<30} {'kept':>5} {'fwd ms':>8} {'fwd eff':>8} {'bwd ms':>8} {'bwd eff':>8}")
        for r in at["rows"]:
            cfg = f"{r['batch']}x{r['seq']}, {r['heads']}x{r['head_dim']}, {'causal' if r['causal'] else 'full'}"
            if "error" in r:
                L.append(f"  {cfg:<30} {r['kept']:5.3f} failed: {r['error'][:80]}")
            else:
                L.append(f"  {cfg:<30} {r['kept']:5.3f} {r['fwd_ms']:8.3f} {r['fwd_efficiency']:8.3f} {r['bwd_ms']:8.3f} {r['bwd_efficiency']:8.3f}")
        if "fwd_fit_causal" in at:
            L.append(f"  causal fit: forward {at['fwd_fit_causal']:.3f}, backward {at['bwd_fit_causal']:.3f} "
                     f"(built-in {ref['builtin']['attention_fwd_efficiency']:.2f} / {ref['builtin']['attention_bwd_efficiency']:.2f})")
    elif at:
        L.append(f"attention: {at.get('error')}")
    me = rep.get("memory")
    if me and "rows" in me:
        L.append("")
        L.append("memory bandwidth (bf16):")
        for r in me["rows"]:
            L.append(f"  {r['op']:<5} {r['size']:<14} {r['median_ms']:9.3f} ms {r['gbps']:9.1f} GB/s  {r['frac_hbm']:.3f} of HBM")
    elif me:
        L.append(f"memory: {me.get('error')}")
    la = rep.get("launch")
    if la and "kernel_launch_us" in la:
        L.append("")
        L.append(f"launch: {la['kernel_launch_us']:.2f} us per x.add_(1) ({la['ops']} back to back; host {la['host_us_per_op']:.2f} us), "
                 f"allocating torch.mul {la['alloc_mul_us']:.2f} us")
    elif la:
        L.append(f"launch: {la.get('error')}")
    ea = rep.get("eager")
    if ea and "rows" in ea:
        L.append("")
        L.append("eager pieces vs the planner (kernels: eager): predicted with built-in / measured constants")
        L.append(f"  {'piece':<34} {'ms':>9} {'pred b-in':>10} {'ratio':>6} {'pred meas':>10} {'ratio':>6} {'B/elem eff':>10} {'model':>6}")
        for r in ea["rows"]:
            if "error" in r:
                L.append(f"  {r['name']:<34} failed: {r['error'][:80]}")
                continue
            pm = f"{r['predicted_ms_measured']:10.3f} {r['measured_over_predicted_measured']:6.2f} {r['effective_bytes_per_element']:10.1f}" if "predicted_ms_measured" in r else f"{'-':>10} {'-':>6} {'-':>10}"
            L.append(f"  {r['name']:<34} {r['median_ms']:9.3f} {r['predicted_ms_builtin']:10.3f} {r['measured_over_predicted_builtin']:6.2f} {pm} {r['planner_bytes_per_element']:6.1f}")
    elif ea:
        L.append(f"eager: {ea.get('error')}")
    ov = rep.get("overlap")
    if ov:
        L.append("")
        if "overlap_slowdown" in ov:
            L.append(f"overlap ({ov['world']} ranks, {ov['backend']}): GEMM {ov['gemm_alone_ms']:.3f} ms alone, {ov['gemm_overlapped_ms']:.3f} ms beside all-gathers: "
                     f"slowdown {ov['overlap_slowdown']:.3f} (built-in {ref['builtin']['overlap_slowdown']:.3f}); all-gather {ov['allgather_mib']:.0f} MiB "
                     f"{ov['allgather_ms']:.3f} ms, bus {ov['allgather_busbw_gbps']:.1f} GB/s = {ov['collective_efficiency']:.3f} of {ref['intra_node_gbps']:g}")
            if ov.get("warning"):
                L.append(f"  warning: {ov['warning']}")
        else:
            L.append(f"overlap: {ov.get('skipped') or ov.get('error')}")
    L.append("")
    L.append("measured constants (built-in in brackets):")
    for k, v in rep["profile"].items():
        L.append(f"  {k:<26} {v:8.3f}  [{ref['builtin'][k]:.2f}]  {rep['profile_how'].get(k, '')}")
    if rep.get("failed"):
        L.append("")
        L.append("failed sections: " + ", ".join(rep["failed"]))
    L.append("")
    if info["kind"] != "cuda":
        L.append("# CPU smoke test: not a GPU profile")
    L.append(rep["yaml"])
    return "\n".join(L)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Measures shardplan's cost-model constants on one GPU (see the module docstring).")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and few iterations (a smoke test, not a profile)")
    ap.add_argument("--out", help="write the JSON report here")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak, TFLOP/s (default: by device name)")
    ap.add_argument("--hbm-gbps", type=float, help="HBM bandwidth, GB/s (default: by device name)")
    ap.add_argument("--base", choices=sorted(BUILTINS), help="the built-in profile to compare with and start the YAML from (default: by device name)")
    ap.add_argument("--sm-count", type=float, help="SMs for the tile fill (default: the device's)")
    ap.add_argument("--tile-m", type=float, help="matmul tile rows (default: the base profile's)")
    ap.add_argument("--tile-n", type=float, help="matmul tile columns (default: the base profile's)")
    ap.add_argument("--warmup", type=int, help="warm-up iterations (default 5; --quick 2)")
    ap.add_argument("--iters", type=int, help="timed iterations, the median is reported (default 20; --quick 5)")
    ap.add_argument("--sustain-seconds", type=float, help="length of the sustained GEMM run (default 20; --quick 1)")
    ap.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                    help="auto: with 2+ GPUs; on: also on the CPU with gloo (plumbing test)")
    ap.add_argument("--overlap-mib", type=int, default=1024, help="all-gather size, MiB (default 1024)")
    ap.add_argument("--threads", type=int, default=1, help="--device cpu: torch threads (default 1: steadier timings on a shared machine)")
    a = ap.parse_args(argv)
    a.warmup = a.warmup if a.warmup is not None else (2 if a.quick else 5)
    a.iters = a.iters if a.iters is not None else (5 if a.quick else 20)
    a.sustain_seconds = a.sustain_seconds if a.sustain_seconds is not None else (1.0 if a.quick else 20.0)
    if a.warmup < 0 or a.iters < 1:
        ap.error("--warmup must be >= 0 and --iters >= 1")
    if a.sustain_seconds < 0 or a.overlap_mib < 1:
        ap.error("--sustain-seconds must be >= 0 and --overlap-mib >= 1")
    for k in ("peak_tflops", "hbm_gbps", "sm_count", "tile_m", "tile_n"):
        v = getattr(a, k)
        if v is not None and not v > 0:
            ap.error(f"--{k.replace('_', '-')} must be positive")
    a.sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = [s for s in a.sections if s not in SECTIONS]
    if bad:
        ap.error(f"--sections: unknown {', '.join(bad)} (known: {', '.join(SECTIONS)})")
    return a


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            die("--device cuda but torch.cuda.is_available() is false (no GPU, no driver, or a CPU-only torch "
                f"{torch.__version__}); run on a GPU machine, or --device cpu --quick for a smoke test")
        try:
            torch.zeros(1, device="cuda")
        except Exception as e:
            die(f"--device cuda but the first CUDA allocation failed: {e}")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(max(args.threads, 1))
    info, ref = describe_device(args)
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    rep = {
        "schema": 1,
        "tool": "benches/gpu_profile.py",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": info,
        "reference": ref,
        "config": {"quick": args.quick, "warmup": args.warmup, "iters": args.iters, "sections": args.sections,
                   "sustain_seconds": args.sustain_seconds, "timing": "CUDA events per iteration, median" if args.device == "cuda" else "perf_counter per iteration, median"},
    }
    ctx = {"args": args, "dev": dev, "timer": Timer(args.device), "ref": ref, "sizes": sizes(args.quick), "report": rep}
    failed = []
    benches = {"matmul": bench_matmul, "sustained": bench_sustained, "attention": bench_attention, "memory": bench_memory,
               "launch": bench_launch, "eager": bench_eager, "overlap": bench_overlap}
    t_start = time.perf_counter()

    def save(complete):
        # Written after every section, so a run cut short keeps what it measured.
        rep["profile"], rep["profile_how"] = profile_values(rep, ref)
        rep["yaml"] = yaml_line(ref, rep["profile"])
        rep["failed"] = failed
        if args.out:
            rep["complete"] = complete
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(rep, f, indent=2)
            os.replace(tmp, args.out)

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    # memory and launch first: eager compares with what they measured.
    for name in ["memory", "launch", "matmul", "sustained", "attention", "eager", "overlap"]:
        if name not in args.sections:
            continue
        t0 = time.perf_counter()
        try:
            with torch.no_grad() if name in ("matmul", "sustained", "memory", "launch") else _null():
                rep[name] = benches[name](ctx)
        except Exception as e:
            rep[name] = {"error": f"{type(e).__name__}: {e}"[:1000], "traceback": traceback.format_exc()[-4000:]}
            log(f"{name}: FAILED: {rep[name]['error']}")
        if isinstance(rep.get(name), dict) and "error" in rep[name]:
            failed.append(name)
        rep[name]["section_seconds"] = round(time.perf_counter() - t0, 3)
        free_memory()
        save(False)
    rep["wall_seconds"] = round(time.perf_counter() - t_start, 3)
    save(False)
    text = text_report(rep)
    rep["text"] = text
    save(True)
    print(text, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
