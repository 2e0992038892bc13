#!/usr/bin/env python3
"""Per-rank memory of PyTorch FSDP2 (measured) beside shardplan's plan, category by category.

  python3 benches/fsdp2_memory.py [--shardplan target/release/shardplan] [--out DIR]

Runs a small Llama (benches/fsdp2_step.py's model: shardplan's `llama` family) under
PyTorch FSDP2 on the CPU with gloo and 4 ranks (torch.multiprocessing), one process group
per setting, and tracks rank 0 with FSDPMemTracker
(torch.distributed._tools.fsdp2_mem_tracker). Per setting: one warm-up step (so AdamW's
state exists), then one tracked step (forward, backward, gradient clipping, AdamW,
zero_grad). Recorded: the peak of the tracked step and FSDPMemTracker's categories at that
peak, the largest value each category reaches during the step, and where the peak
happens. Then it writes the matching shardplan specs (model.yaml and one parallel spec per
setting), runs `shardplan plan --format json` on each and prints, per setting, a table of
categories: FSDP2 at its peak, shardplan at its peak (`memory.at_peak`), the ratio
shardplan / FSDP2, and both per-category maxima (`memory.max_by_category`).

Settings: `plain` (one fully_shard per block + root, reshard_after_forward=True),
`no-reshard` (reshard_after_forward=False), `full-ac` (plain, with every block wrapped in
torch.utils.checkpoint, non-reentrant, as torchtitan's full activation checkpointing),
`bf16` (plain with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32)). Each is
planned three ways: shardplan's executor (`kernels: fused`), the PyTorch eager model on
shardplan's schedule (`kernels: eager`) and the model of FSDP2's own run (`runtime: fsdp2`,
`prefetch: {forward: 0, backward: 1}` as FSDP2's defaults), each against the measured peak.
Model: dim 256, 4 layers, 4 heads, ffn 688, vocab 8192, untied head (7.36M parameters);
batch 2 x 256 per rank, f32 parameters and reduction, AdamW (lr 3e-4, betas 0.9/0.95,
eps 1e-8, weight decay 0.1), gradient clipping at 1.0.

Category mapping (FSDP2 -> shardplan):
  Sharded Param + Buffer            -> sharded params
  Unsharded Param                   -> unsharded params
  Sharded Grad                      -> sharded grads
  Unsharded Grad                    -> unsharded grads
  OptState                          -> optimizer state
  Activation + Temp + Inputs        -> activations (shardplan counts saved activations,
                                       their gradients and the batch in one category)
  All Gather + Reduce Scatter       -> all-gather/reduce-scatter buffers

Output (--out DIR, default fsdp2-memory/): fsdp2-<setting>.json (the tracker's numbers),
model.yaml, parallel-<setting>.yaml, plan-<setting>.json, and summary.json (the tables).
Exits 0 with a message when torch (or FSDPMemTracker) cannot be imported.
"""

import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SETTINGS = {
    # name: (reshard_after_forward, activation checkpointing, parameter dtype)
    "plain": (True, "none", "f32"),
    "no-reshard": (False, "none", "f32"),
    "full-ac": (True, "full", "f32"),
    "bf16": (True, "none", "bf16"),
}

# The plans made per setting: shardplan's executor (fused kernels), the planner's PyTorch
# eager model on shardplan's schedule, and its model of FSDP2's own run (`runtime: fsdp2`).
VARIANTS = ("fused", "eager", "fsdp2")

# shardplan category -> FSDPMemTracker categories (their `_FSDPRefType` values).
CATEGORIES = [
    ("sharded_params", "sharded params", ["Sharded Param", "Buffer"]),
    ("unsharded_params", "unsharded params", ["Unsharded Param"]),
    ("sharded_grads", "sharded grads", ["Sharded Grad"]),
    ("unsharded_grads", "unsharded grads", ["Unsharded Grad"]),
    ("optimizer_state", "optimizer state", ["OptState"]),
    ("activations", "activations", ["Activation", "Temp", "Inputs"]),
    ("comm_buffers", "all-gather/reduce-scatter", ["All Gather", "Reduce Scatter"]),
]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="FSDP2 (FSDPMemTracker, CPU/gloo) per-rank memory beside shardplan's plan.",
    )
    ap.add_argument("--shardplan", default=os.path.join(ROOT, "target", "release", "shardplan"),
                    help="shardplan binary (default: target/release/shardplan)")
    ap.add_argument("--out", default="fsdp2-memory", help="output directory")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of "
                    + ", ".join(SETTINGS))
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--port", type=int, default=29541)
    ap.add_argument("--skip-train", action="store_true",
                    help="do not run shardplan's executor on the same run")
    ap.add_argument("--skip-fsdp2", action="store_true",
                    help="reuse the fsdp2-<setting>.json files already in --out")
    a = ap.parse_args(argv)
    a.settings = [s.strip() for s in a.settings.split(",") if s.strip()]
    for s in a.settings:
        if s not in SETTINGS:
            ap.error(f"unknown setting {s!r} (known: {', '.join(SETTINGS)})")
    return a


def step_args(a):
    """benches/fsdp2_step.py's argument namespace for the model and batch."""
    import fsdp2_step

    return fsdp2_step.parse_args([
        "--device", "cpu", "--dim", str(a.dim), "--layers", str(a.layers),
        "--heads", str(a.heads), "--ffn", str(a.ffn), "--vocab", str(a.vocab),
        "--seq", str(a.seq), "--batch", str(a.batch), "--param-dtype", "f32",
        "--reduce-dtype", "f32", "--lr", "3e-4", "--weight-decay", "0.1", "--grad-clip", "1.0",
    ])


# ---------------------------------------------------------------- FSDP2 under FSDPMemTracker


def tracker_class():
    """FSDPMemTracker that also keeps each category's maximum, the peak of every phase of the
    step and the op at which the peak happens (a class made on demand: torch is imported
    only where it runs)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class Tracker(FSDPMemTracker):
        phase = "start"
        last_op = None

        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.cat_max = {}
            self.phase_peak = {}
            self.where = None
            self.phase_start = {}
            self.group_max = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.last_op = str(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state):
            old = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            for dev, snap in self._curr_mem_snap.items():
                named = {getattr(k, "value", k): v for k, v in snap.items()}
                for name, v in named.items():
                    self.cat_max[name] = max(self.cat_max.get(name, 0), v)
                for key, _, theirs in CATEGORIES:
                    v = sum(named.get(c, 0) for c in theirs)
                    self.group_max[key] = max(self.group_max.get(key, 0), v)
                tot = snap["Total"]
                pp = self.phase_peak.get(self.phase)
                if pp is None or tot > pp["total"]:
                    self.phase_peak[self.phase] = {
                        "total": tot,
                        "categories": {getattr(k, "value", k): v for k, v in snap.items()},
                        "op": self.last_op,
                    }
                if self._peak_mem.get(dev, 0) != old.get(dev, 0):
                    self.where = {
                        "phase": self.phase,
                        "op": self.last_op,
                        "modules": sorted(self._mod_tracker.parents - {"Global"}),
                        "fsdp_state": self._fsdp_state.name,
                        "live": self.live_storages(),
                    }

        def live_storages(self):
            """Live tracked storages as {category: {bytes: count}}."""
            out = {}
            for winfo, _ in list(self._WINFO.values()):
                if winfo.mem_consumed:
                    by = out.setdefault(winfo.reftype.value, {})
                    by[winfo.mem_consumed] = by.get(winfo.mem_consumed, 0) + 1
            return {k: dict(sorted(v.items(), reverse=True)) for k, v in out.items()}

        def set_phase(self, p):
            self.phase = p
            self.phase_start[p] = {
                getattr(k, "value", k): v
                for snap in self._curr_mem_snap.values() for k, v in snap.items()
            }

    return Tracker


def tracker_report(tracker):
    """What a tracked step measured on this rank: the peak, the categories at it, each
    category's maximum, where the peak happened and the peak of every phase."""
    peak = tracker.get_tracker_snapshot("peak")
    (dev_snap,) = peak.values()
    return {
        "peak": dev_snap["Total"],
        "at_peak": {getattr(k, "value", k): v for k, v in dev_snap.items() if k != "Total"},
        "max_by_category": {k: v for k, v in tracker.cat_max.items() if k != "Total"},
        # The maximum over the step of each shardplan category's FSDP2 sum.
        "max_by_shardplan_category": tracker.group_max,
        "peak_where": tracker.where,
        "phase_peaks": tracker.phase_peak,
        "phase_start": tracker.phase_start,
        "modules": module_snapshots(tracker),
    }


def worker(rank, a, setting, path):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import fsdp2_step
    from fsdp2_step import MixedPrecisionPolicy, fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(rank),
                      WORLD_SIZE=str(a.ranks), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=a.ranks)
    try:
        reshard, ac, dtype = SETTINGS[setting]
        s = step_args(a)
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (a.ranks,))
        model = fsdp2_step.Llama(s)
        fsdp2_step.init_weights(model, 0)
        model.rope_tables(s, torch.device("cpu"))
        if ac == "full":
            # torchtitan's full activation checkpointing: every block in a non-reentrant
            # checkpoint wrapper, applied before fully_shard.
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl, checkpoint_wrapper)

            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(
                    block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False)
        param_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.1)

        g = torch.Generator().manual_seed(0)
        perm = torch.randperm(s.vocab, generator=g)
        starts = torch.Generator().manual_seed(1 + rank)

        def batch():
            toks = fsdp2_step.follow_permutation(
                perm, torch.randint(0, s.vocab, (s.batch,), generator=starts), s.seq)
            return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()

        def step(tracker=None):
            def phase(p):
                if tracker is not None:
                    tracker.set_phase(p)

            tokens, targets = batch()
            if tracker is not None:
                tracker.track_inputs((tokens, targets))
            phase("forward")
            loss = model(tokens, targets)
            phase("backward")
            loss.backward()
            phase("clip")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            phase("optimizer")
            opt.step()
            phase("zero_grad")
            opt.zero_grad(set_to_none=True)
            return loss.item()

        warm_loss = step()  # AdamW's state exists from here on
        tracker = tracker_class()(model, opt)
        with tracker:
            loss = step(tracker)
        if rank == 0:
            report = {
                "setting": setting,
                "torch": torch.__version__,
                "world": a.ranks,
                "reshard_after_forward": reshard,
                "activation_checkpointing": ac,
                "param_dtype": dtype,
                "params": sum(p.numel() for p in model.parameters()),
                "losses": [warm_loss, loss],
                **tracker_report(tracker),
            }
            with open(path, "w") as f:
                json.dump(report, f, indent=2)
                f.write("\n")
    finally:
        dist.destroy_process_group()


def module_snapshots(tracker):
    """FSDPMemTracker's per-module snapshots: {fqn: {state: [{category: bytes}, ...]}}."""
    out = {}
    for stats in tracker.memory_tracking.values():
        states = out.setdefault(stats.mod_fqn, {})
        for state, snaps in stats.snapshots.items():
            states[state.value] = [
                {getattr(k, "value", k): v for d in snap.values() for k, v in d.items()}
                for snap in snaps
            ]
    return out


def run_fsdp2(a, setting, path):
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(a, setting, path), nprocs=a.ranks, join=True)
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------- shardplan


def parallel_spec(ranks, variant, reshard, ac, dtype, batch, seq):
    """The parallel spec of one run: mesh {shard: ranks}, one FSDP unit per block, AdamW and
    clipping as the FSDP2 runs; `variant` picks what the plan models (see VARIANTS)."""
    if variant == "fsdp2":
        # FSDP2's own run: its buffers and hooks, eager kernels (implied). The measured runs
        # set no explicit forward prefetch: FSDP2's default, depth 0 forward and one group
        # in backward.
        runtime = "hardware: {base: h100-sxm}\nruntime: fsdp2\nprefetch: {forward: 0, backward: 1}\n"
    elif variant == "fused":
        # shardplan's executor runs its own default order: `prefetch: auto`, one group
        # ahead each way, then all-gathers moved off the peak.
        runtime = "hardware: {base: h100-sxm, kernels: fused}\nprefetch: auto\n"
    else:
        runtime = ("hardware: {base: h100-sxm, kernels: eager}\n"
                   "prefetch: {forward: 1, backward: 1}\n")
    return (
        f"mesh: {{replicate: 1, shard: {ranks}}}\n"
        f"gpus_per_node: {ranks}\n"
        "# Memory depends on the profile only through `kernels`: fused = shardplan's own\n"
        "# executor (fused cross-entropy and RMSNorm, attention probabilities made in\n"
        "# backward); eager = the planner's model of PyTorch eager (flash SDPA, eager\n"
        "# cross-entropy) on shardplan's schedule; `runtime: fsdp2` = its model of\n"
        "# FSDP2's own run, to hold against FSDP2's measured peak.\n"
        + runtime
        + "wrap: [block]\n"
        f"reshard_after_forward: {'true' if reshard else 'false'}\n"
        f"mixed_precision: {{param: {dtype}, reduce: f32}}\n"
        f"activation_checkpointing: {ac}\n"
        f"batch: {{per_rank: {batch}, seq_len: {seq}, grad_accum: 1}}\n"
        "optimizer: {adamw: {lr: 3.0e-4, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.1}}\n"
        "grad_clip: 1.0\n")


def write_specs(a, out):
    s = step_args(a)
    model = os.path.join(out, "model.yaml")
    with open(model, "w") as f:
        f.write(
            "# benches/fsdp2_memory.py's model: benches/fsdp2_step.py's Llama at this shape.\n"
            f"name: llama-fsdp2-memory\nfamily: llama\nvocab_size: {s.vocab}\ndim: {s.dim}\n"
            f"n_layers: {s.layers}\nn_heads: {s.heads}\nn_kv_heads: {s.kv_heads}\n"
            f"ffn_dim: {s.ffn}\nnorm_eps: {s.norm_eps}\nrope_theta: {s.rope_theta:g}\n"
            f"max_seq_len: {s.seq}\n")
    parallel = {}
    for setting in a.settings:
        reshard, ac, dtype = SETTINGS[setting]
        for variant in VARIANTS:
            p = os.path.join(out, f"parallel-{setting}{'' if variant == 'fused' else '-' + variant}.yaml")
            with open(p, "w") as f:
                f.write(f"# benches/fsdp2_memory.py, setting {setting}: FSDP2 on {a.ranks} CPU ranks.\n"
                        + parallel_spec(a.ranks, variant, reshard, ac, dtype, s.batch, s.seq))
            parallel[(setting, variant)] = p
    return model, parallel


def run_shardplan(binary, model, parallel, json_path):
    subprocess.run([binary, "plan", "--model", model, "--parallel", parallel, "--format", "json",
                    "--out", json_path], check=True)
    with open(json_path) as f:
        plan = json.load(f)
    text = subprocess.run([binary, "plan", "--model", model, "--parallel", parallel],
                          check=True, capture_output=True, text=True).stdout
    m = re.search(r"peak [^\n]*? at (#\d+ \([^\n]*\))", text)
    plan["_peak_where"] = m.group(1) if m else None
    return plan


def run_train(binary, model, parallel):
    """shardplan's executor on the same run (2 steps, Local ranks): its measured peak."""
    r = subprocess.run([binary, "train", "--model", model, "--parallel", parallel, "--steps", "2"],
                       check=True, capture_output=True, text=True)
    m = re.search(r"peak \(all categories\)\s+([\d.]+ \w+)\s+([\d.]+ \w+)", r.stdout + r.stderr)
    return {"planned": m.group(1), "measured": m.group(2)} if m else None


# ---------------------------------------------------------------- tables


def fmt_bytes(b):
    return f"{b:,}"


def mib(b):
    return f"{b / 2**20:.2f}"


def ratio(ours, theirs):
    if theirs == 0:
        return "-" if ours == 0 else "inf"
    return f"{ours / theirs:.2f}"


def compare(setting, fsdp, plan):
    rows = []
    for key, label, theirs in CATEGORIES:
        f_peak = sum(fsdp["at_peak"].get(c, 0) for c in theirs)
        f_max = fsdp["max_by_shardplan_category"][key]
        rows.append({
            "category": label,
            "fsdp2_categories": theirs,
            "fsdp2_at_peak": f_peak,
            "shardplan_at_peak": plan["memory"]["at_peak"][key],
            "fsdp2_max": f_max,
            "shardplan_max": plan["memory"]["max_by_category"][key],
        })
    # Peak by phase. shardplan: forward = up to the last forward compute step, backward =
    # from there up to the gradient norm (or the first optimizer step) and the allocations
    # just before it, after backward = the rest; FSDP2: model(...), loss.backward(), and
    # clip_grad_norm_ + opt.step() + zero_grad().
    steps = {st["id"]: st["phase"] for st in plan["steps"]}
    instrs = plan["programs"][0]["instrs"]
    fwd_end = max(i for i, ins in enumerate(instrs)
                  if ins["kind"] == "compute" and steps[ins["step"]] == "forward")
    bwd_end = next(i for i, ins in enumerate(instrs) if ins["kind"] in ("grad_norm", "optimizer_step"))
    while instrs[bwd_end - 1]["kind"] == "alloc":
        bwd_end -= 1
    sp_phase = {"forward": 0, "backward": 0, "after backward": 0}
    for e in plan["memory"]["timeline"]:
        ph = "forward" if e["instr"] <= fwd_end else \
            "backward" if e["instr"] < bwd_end else "after backward"
        sp_phase[ph] = max(sp_phase[ph], e["total"])
    fp = {k: v["total"] for k, v in fsdp["phase_peaks"].items()}
    f_phase = {
        "forward": fp.get("forward", 0),
        "backward": fp.get("backward", 0),
        "after backward": max(fp.get(k, 0) for k in ("clip", "optimizer", "zero_grad")),
    }
    return {
        "setting": setting,
        "rows": rows,
        "fsdp2_peak": fsdp["peak"],
        "shardplan_peak": plan["memory"]["peak"],
        "ratio": plan["memory"]["peak"] / fsdp["peak"],
        "fsdp2_peak_where": {k: v for k, v in (fsdp["peak_where"] or {}).items() if k != "live"},
        "shardplan_peak_where": plan["_peak_where"],
        "phase_peaks": {"fsdp2": f_phase, "shardplan": sp_phase},
    }


def print_table(c):
    w = c["fsdp2_peak_where"] or {}
    print(f"\n== {c['setting']}: shardplan peak {mib(c['shardplan_peak'])} MiB / FSDP2 peak "
          f"{mib(c['fsdp2_peak'])} MiB = {c['ratio']:.3f}x")
    print(f"   FSDP2 peak: {w.get('phase')} phase, modules {', '.join(w.get('modules') or []) or '-'}, "
          f"op {w.get('op')}")
    print(f"   shardplan peak: {c['shardplan_peak_where']}")
    pp = c["phase_peaks"]
    print("   peak by phase (MiB), FSDP2 / shardplan: " + ", ".join(
        f"{k} {mib(pp['fsdp2'][k])} / {mib(pp['shardplan'][k])}" for k in pp["fsdp2"]))
    hdr = f"   {'category':<27}{'FSDP2 @peak':>14}{'shardplan @peak':>17}{'ratio':>7}" \
          f"{'FSDP2 max':>14}{'shardplan max':>15}"
    print(hdr)
    for r in c["rows"]:
        fm = fmt_bytes(r["fsdp2_max"])
        print(f"   {r['category']:<27}{fmt_bytes(r['fsdp2_at_peak']):>14}"
              f"{fmt_bytes(r['shardplan_at_peak']):>17}"
              f"{ratio(r['shardplan_at_peak'], r['fsdp2_at_peak']):>7}"
              f"{fm:>14}{fmt_bytes(r['shardplan_max']):>15}")
    print(f"   {'total (peak)':<27}{fmt_bytes(c['fsdp2_peak']):>14}{fmt_bytes(c['shardplan_peak']):>17}"
          f"{c['ratio']:>7.3f}")
    print(f"   planned for PyTorch eager (kernels: eager): {fmt_bytes(c['eager_peak'])} = "
          f"{c['eager_ratio']:.3f}x FSDP2's measured peak")
    print(f"   planned for FSDP2's run (runtime: fsdp2): {fmt_bytes(c['fsdp2_model_peak'])} = "
          f"{c['fsdp2_model_ratio']:.4f}x FSDP2's measured peak")
    print(f"   {'runtime: fsdp2 by category':<27}{'FSDP2 @peak':>14}{'model @peak':>17}{'ratio':>7}"
          f"{'FSDP2 max':>14}{'model max':>15}")
    for r in c["fsdp2_model_rows"]:
        print(f"   {r['category']:<27}{fmt_bytes(r['fsdp2_at_peak']):>14}"
              f"{fmt_bytes(r['shardplan_at_peak']):>17}"
              f"{ratio(r['shardplan_at_peak'], r['fsdp2_at_peak']):>7}"
              f"{fmt_bytes(r['fsdp2_max']):>14}{fmt_bytes(r['shardplan_max']):>15}")
    if c.get("train"):
        print(f"   shardplan train (2 steps): peak planned {c['train']['planned']}, "
              f"measured {c['train']['measured']}")


def tracker_unavailable():
    """Why this Python cannot run the FSDP2 side (a message), or None when it can."""
    try:
        import torch  # noqa: F401
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: F401
    except Exception as e:  # ImportError, or a torch without FSDP2 / the tracker
        return f"skipped: PyTorch with FSDP2's FSDPMemTracker is not importable by {sys.executable} ({e})"
    return None


def main(argv=None):
    a = parse_args(argv)
    missing = tracker_unavailable()
    if missing:
        print(missing)
        return 0
    sys.path.insert(0, HERE)
    if not os.path.exists(a.shardplan):
        print(f"error: no shardplan binary at {a.shardplan} (cargo build --release, or --shardplan)",
              file=sys.stderr)
        return 2
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    model, parallel = write_specs(a, out)
    results = []
    for setting in a.settings:
        fpath = os.path.join(out, f"fsdp2-{setting}.json")
        if a.skip_fsdp2:
            with open(fpath) as f:
                fsdp = json.load(f)
        else:
            print(f"FSDP2 {setting}: {a.ranks} ranks (gloo) ...", file=sys.stderr, flush=True)
            fsdp = run_fsdp2(a, setting, fpath)
        plan = run_shardplan(a.shardplan, model, parallel[(setting, "fused")],
                             os.path.join(out, f"plan-{setting}.json"))
        eager = run_shardplan(a.shardplan, model, parallel[(setting, "eager")],
                              os.path.join(out, f"plan-{setting}-eager.json"))
        model_run = run_shardplan(a.shardplan, model, parallel[(setting, "fsdp2")],
                                  os.path.join(out, f"plan-{setting}-fsdp2.json"))
        c = compare(setting, fsdp, plan)
        c["eager_peak"] = eager["memory"]["peak"]
        c["eager_ratio"] = eager["memory"]["peak"] / fsdp["peak"]
        m = compare(setting, fsdp, model_run)
        c["fsdp2_model_peak"] = m["shardplan_peak"]
        c["fsdp2_model_ratio"] = m["ratio"]
        c["fsdp2_model_rows"] = m["rows"]
        c["fsdp2_model_phase_peaks"] = m["phase_peaks"]["shardplan"]
        c["fsdp2_model_peak_where"] = m["shardplan_peak_where"]
        c["train"] = None if a.skip_train else run_train(a.shardplan, model, parallel[(setting, "fused")])
        results.append(c)
    s = step_args(a)
    print(f"Per-rank memory, rank 0: FSDP2 measured (FSDPMemTracker, torch {torch.__version__}, CPU, "
          f"gloo, {a.ranks} ranks) vs shardplan planned; Llama dim {s.dim}, {s.layers} layers, "
          f"{s.heads} heads, ffn {s.ffn}, vocab {s.vocab}; batch {s.batch} x {s.seq} per rank; "
          "f32 masters (bf16 setting: bf16 parameters, f32 reduction); AdamW; clip 1.0. Bytes; "
          "ratio = shardplan / FSDP2.")
    for c in results:
        print_table(c)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"torch": torch.__version__, "ranks": a.ranks, "results": results}, f, indent=2)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
