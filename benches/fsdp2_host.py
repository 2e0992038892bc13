#!/usr/bin/env python3
"""Measures `fsdp2_unit_host_us`: PyTorch FSDP2's host time per FSDP unit and step.

The planner charges an eager FSDP2 step (`runtime: fsdp2`) its kernels, each at least
`kernel_launch_us`, plus `fsdp2_unit_host_us` per FSDP unit (the book's cost-model page,
docs/src/cost-model.md). The built-in value is fitted to four measured H200 runs; this
script measures it on its own. It runs benches/fsdp2_step.py's model (one fully_shard per
block and the root, foreach AdamW, clipping) at a size whose kernels take next to nothing,
at two depths, so that the step's growth per block is host time; the planner, given the same
model at the same two depths with `fsdp2_unit_host_us: 0`, says what of that growth it
already charges (the block's launches). The difference is the constant:

  python3 benches/fsdp2_host.py --device cuda --shardplan target/release/shardplan \\
      --hardware h200 --out host.json
  python3 benches/fsdp2_host.py --device cuda --compile --shardplan target/release/shardplan \\
      --hardware h200 --out host-compiled.json   # fsdp2_compiled_unit_host_us
  python3 benches/fsdp2_host.py --device cpu --layers 2 4 --steps 2 --shardplan BIN  # smoke test

Output: a JSON report (stdout and --out) with every step time, the measured seconds per
block, the planner's, and `fsdp2_unit_host_us`; a `hardware:` line on stderr. On the CPU
every figure is the CPU's, meaningless for a GPU profile: it tests the plumbing.

Exit: 0 done; 1 a run or the planner failed; 2 bad arguments.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# The shape: small enough that every kernel is launch-bound on a GPU.
SHAPE = dict(dim=64, heads=4, ffn=128, vocab=256, seq=16, batch=1)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="FSDP2's host time per FSDP unit (fsdp2_unit_host_us).")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--layers", type=int, nargs=2, default=[4, 20], metavar=("FEW", "MANY"),
                    help="the two depths (default 4 20)")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per depth")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--shardplan", default=None, help="a shardplan binary: also derive the constant")
    ap.add_argument("--hardware", default="h200", help="the built-in profile to plan with (default h200)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile each block, as torchtitan's compile option: the host time of a "
                         "compiled unit (`fsdp2_compiled_unit_host_us`)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    few, many = a.layers
    if not (0 < few < many):
        ap.error("--layers: two depths, the first smaller and above 0")
    if a.steps < 1 or a.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0")
    return a


def measure(fsdp2_step, a, layers, dev, rank, world):
    s = SHAPE
    args = fsdp2_step.parse_args([
        "--device", a.device, "--dim", str(s["dim"]), "--layers", str(layers), "--heads", str(s["heads"]),
        "--ffn", str(s["ffn"]), "--vocab", str(s["vocab"]), "--seq", str(s["seq"]),
        "--batch", str(s["batch"]), "--steps", str(a.steps), "--warmup", str(a.warmup),
    ] + (["--compile"] if a.compile else []))
    r = fsdp2_step.run(args, dev, rank, world)
    return r["step_seconds"], r["step_seconds_median"]


def constant(a):
    """The profile field this run measures."""
    return "fsdp2_compiled_unit_host_us" if a.compile else "fsdp2_unit_host_us"


def planned(a, layers):
    """The planner's step seconds for the same model and batch, without FSDP2's host time."""
    s = SHAPE
    with tempfile.TemporaryDirectory() as d:
        model = os.path.join(d, "model.yaml")
        spec = os.path.join(d, "parallel.yaml")
        with open(model, "w") as f:
            f.write(f"family: llama\nvocab_size: {s['vocab']}\ndim: {s['dim']}\nn_layers: {layers}\n"
                    f"n_heads: {s['heads']}\nffn_dim: {s['ffn']}\nmax_seq_len: {s['seq']}\ntie_embeddings: false\n")
        with open(spec, "w") as f:
            f.write(
                "mesh: {replicate: 1, shard: 1}\ngpus_per_node: 1\n"
                f"hardware: {{base: {a.hardware}, {constant(a)}: 0}}\nruntime: fsdp2\nwrap: [block]\n"
                + ("compile: {model: true}\n" if a.compile else "")
                + "reshard_after_forward: true\nmixed_precision: {param: bf16, reduce: f32}\n"
                f"batch: {{per_rank: {s['batch']}, seq_len: {s['seq']}, grad_accum: 1}}\n"
                "optimizer: {adamw: {lr: 3.0e-4, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.1, "
                "implementation: foreach}}\ngrad_clip: 1.0\n"
            )
        out = subprocess.run([a.shardplan, "plan", "--model", model, "--parallel", spec, "--format", "json"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"shardplan plan failed ({out.returncode}): {out.stderr.strip()}")
        return json.loads(out.stdout)["estimate"]["step_s"]


def main(argv=None):
    a = parse_args(argv)
    try:
        import torch
        import torch.distributed as dist
        import fsdp2_step
    except ImportError as e:
        print(f"fsdp2_host: error: cannot import torch ({e})", file=sys.stderr)
        return 2
    if a.device == "cpu":
        torch.set_num_threads(1)
    dev, rank, world = fsdp2_step.start_process_group(a.device)
    few, many = a.layers
    try:
        times = {}
        for layers in (few, many):
            print(f"fsdp2_host: {layers} blocks, {a.warmup} + {a.steps} steps", file=sys.stderr, flush=True)
            times[layers] = measure(fsdp2_step, a, layers, dev, rank, world)
    finally:
        dist.destroy_process_group()
    per_block = (times[many][1] - times[few][1]) / (many - few)
    report = {
        "benchmark": "fsdp2_host",
        "torch": torch.__version__,
        "device": a.device,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "shape": SHAPE,
        "depths": [few, many],
        "step_seconds": {str(k): v[0] for k, v in times.items()},
        "step_seconds_median": {str(k): v[1] for k, v in times.items()},
        "measured_seconds_per_block": per_block,
        "compiled": a.compile,
        "how": "the median step's growth per block between the two depths, one fully_shard per block",
    }
    if a.shardplan:
        try:
            p_few, p_many = planned(a, few), planned(a, many)
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            print(f"fsdp2_host: error: {e}", file=sys.stderr)
            return 1
        planner_block = (p_many - p_few) / (many - few)
        unit = max(per_block - planner_block, 0.0) * 1e6
        report.update(
            hardware=a.hardware,
            planned_step_seconds={str(few): p_few, str(many): p_many},
            planner_seconds_per_block=planner_block,
            **{constant(a): unit},
        )
        print(f"hardware: {{base: {a.hardware}, {constant(a)}: {unit:.0f}}}", file=sys.stderr)
    fsdp2_step.write_report(report, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
