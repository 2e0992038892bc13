#!/usr/bin/env python3
"""A memory matrix: FSDP2's measured peak beside shardplan's plans, over model shapes and
configurations, on 4 CPU ranks.

  python3 benches/fsdp2_memory_matrix.py [--shardplan target/debug/shardplan] [--out DIR]
      [--quick | --shapes a,b] [--configs reshard,no-reshard,full-ac,selective-ac]
      [--skip-fsdp2] [--skip-train]

Per shape (Llama and GPT-2; vocabularies 2k-128k, widths 128-512, 2-8 layers, GQA and not,
tied and untied heads) and configuration (reshard after forward, no reshard, full and
selective activation checkpointing) it writes shardplan's specs, exports the fused spec
with `shardplan export fsdp2` and runs that program's model under PyTorch FSDP2 (gloo,
4 processes, one per rank): the same modules, parameter names, checkpointing (selective:
torchtitan's op policy, attention and every second matmul saved) and groups as every
exported run, with FSDP2's default prefetch. Rank 0 is tracked with FSDPMemTracker over
one step after a warm-up step (benches/fsdp2_memory.py's tracker). Then per cell:

  - `kernels: fused` (shardplan's own executor) planned peak / FSDP2's measured peak;
  - `shardplan train --steps 2` on the fused spec: rank 0's measured peak (the JSON log's
    `measured_peak`), which must equal the plan's;
  - `kernels: eager` (PyTorch eager on shardplan's schedule) planned / measured;
  - `runtime: fsdp2` (the model of FSDP2's own run) planned / measured.

Writes DIR/summary.json (every cell, with the categories at each peak) and DIR/matrix.md
(the tables), prints the table, exits 0 with a message when torch or FSDPMemTracker cannot
be imported. --skip-fsdp2 reuses DIR's measurements (to rerun only the plans, e.g. with
another shardplan binary). Batch 2 x 128 per rank, f32, AdamW, clipping at 1.0.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import fsdp2_memory  # noqa: E402  (the tracker, the specs, the plan reader; no torch at import)

# name: model spec fields. GPT-2's head is always tied to its token embedding.
SHAPES = {
    "llama-v2k-d128-l2": dict(family="llama", vocab_size=2048, dim=128, n_layers=2, n_heads=4,
                              n_kv_heads=4, ffn_dim=352),
    "llama-v8k-d256-l4-gqa": dict(family="llama", vocab_size=8192, dim=256, n_layers=4, n_heads=8,
                                  n_kv_heads=2, ffn_dim=688),
    "llama-v32k-d256-l4-tied": dict(family="llama", vocab_size=32000, dim=256, n_layers=4, n_heads=4,
                                    n_kv_heads=4, ffn_dim=688, tie_embeddings=True),
    "llama-v128k-d128-l2-gqa": dict(family="llama", vocab_size=128256, dim=128, n_layers=2, n_heads=4,
                                    n_kv_heads=1, ffn_dim=352),
    "llama-v16k-d384-l6-gqa-tied": dict(family="llama", vocab_size=16384, dim=384, n_layers=6, n_heads=6,
                                        n_kv_heads=2, ffn_dim=1024, tie_embeddings=True),
    "llama-v4k-d512-l8-gqa": dict(family="llama", vocab_size=4096, dim=512, n_layers=8, n_heads=8,
                                  n_kv_heads=4, ffn_dim=1376),
    "gpt2-v2k-d128-l2": dict(family="gpt2", vocab_size=2048, dim=128, n_layers=2, n_heads=2, ffn_dim=512),
    "gpt2-v50k-d256-l4": dict(family="gpt2", vocab_size=50257, dim=256, n_layers=4, n_heads=4, ffn_dim=1024),
    "gpt2-v4k-d512-l8": dict(family="gpt2", vocab_size=4096, dim=512, n_layers=8, n_heads=8, ffn_dim=2048),
}
QUICK = ["llama-v2k-d128-l2", "gpt2-v2k-d128-l2"]

# name: (reshard_after_forward, activation_checkpointing)
CONFIGS = {
    "reshard": (True, "none"),
    "no-reshard": (False, "none"),
    "full-ac": (True, "full"),
    "selective-ac": (True, "selective"),
}

# What a plan must reach against FSDP2's measured peak (issue 27).
FUSED_TARGET = 0.85
EAGER_BAND = (0.95, 1.05)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shardplan", default=os.path.join(ROOT, "target", "debug", "shardplan"))
    ap.add_argument("--out", default="fsdp2-memory-matrix", help="output directory")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ", ".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="only " + ", ".join(QUICK))
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--port", type=int, default=29571)
    ap.add_argument("--skip-fsdp2", action="store_true", help="reuse the FSDP2 measurements in --out")
    ap.add_argument("--skip-train", action="store_true", help="do not run `shardplan train`")
    a = ap.parse_args(argv)
    a.shapes = QUICK if a.quick else [s for s in a.shapes.split(",") if s]
    a.configs = [c for c in a.configs.split(",") if c]
    for name, known in ((a.shapes, SHAPES), (a.configs, CONFIGS)):
        bad = [x for x in name if x not in known]
        if bad:
            ap.error(f"unknown {bad[0]!r} (known: {', '.join(known)})")
    return a


# ---------------------------------------------------------------- specs and the exported program


def model_yaml(name, shape, seq):
    fields = {"name": name, "norm_eps": 1.0e-5, "rope_theta": 10000, "max_seq_len": seq}
    fields.update(shape)
    if shape["family"] == "gpt2":
        fields.pop("norm_eps")
        fields.pop("rope_theta")
    lines = [f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()]
    return "# benches/fsdp2_memory_matrix.py\n" + "\n".join(lines) + "\n"


def write_cell(a, shape_dir, model, config):
    """The cell's three parallel specs and the exported program of the fused one."""
    reshard, ac = CONFIGS[config]
    d = os.path.join(shape_dir, config)
    os.makedirs(d, exist_ok=True)
    specs = {}
    for variant in fsdp2_memory.VARIANTS:
        specs[variant] = os.path.join(d, f"parallel-{variant}.yaml")
        with open(specs[variant], "w") as f:
            f.write(f"# benches/fsdp2_memory_matrix.py, {config}\n"
                    + fsdp2_memory.parallel_spec(a.ranks, variant, reshard, ac, "f32", a.batch, a.seq))
    subprocess.run([a.shardplan, "export", "fsdp2", "--model", model, "--parallel", specs["fused"],
                    "--out", d], check=True, capture_output=True)
    return d, specs


def load_program(path, name):
    """An exported train.py as a module (its `main` runs only as a script)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- FSDP2 under FSDPMemTracker


def worker(rank, a, cells, port):
    """One process (rank) of one shape: every configuration in turn, rank 0 tracked."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(a.ranks), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=a.ranks)
    try:
        for i, (config, cell_dir) in enumerate(cells):
            report = measure(load_program(os.path.join(cell_dir, "train.py"), f"exported_{i}"), rank, a.ranks)
            if rank == 0:
                report["config"] = config
                with open(os.path.join(cell_dir, "fsdp2.json"), "w") as f:
                    json.dump(report, f, indent=2)
                    f.write("\n")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(prog, rank, world):
    """The exported program's model, checkpointing and groups under FSDP2; one warm-up step,
    then one tracked step (forward, backward, clipping, AdamW, zero_grad)."""
    import gc

    import torch

    device = torch.device("cpu")
    model, names = prog.build_model()
    prog.apply_checkpointing(model)
    prog.apply_fully_shard(model, prog.make_mesh(device), device)
    # No set_prefetch: FSDP2's default prefetch, which `runtime: fsdp2` models.
    model.to_empty(device=device)
    prog.init_weights(model, names, None)
    opt = prog.make_optimizer(model)
    b = prog.BATCH
    batches = prog.Batches(prog.DATA, rank, world, b["per_rank"], b["seq_len"], prog.MODEL["vocab_size"])

    def step(tracker=None):
        def phase(p):
            if tracker is not None:
                tracker.set_phase(p)

        tokens, targets = batches.next()
        if tracker is not None:
            tracker.track_inputs((tokens, targets))
        phase("forward")
        loss = model(tokens, targets)
        phase("backward")
        loss.backward()
        phase("clip")
        torch.nn.utils.clip_grad_norm_(model.parameters(), prog.GRAD_CLIP)
        phase("optimizer")
        opt.step()
        phase("zero_grad")
        opt.zero_grad(set_to_none=True)
        return loss.item()

    warm = step()  # AdamW's state exists from here on
    tracker = fsdp2_memory.tracker_class()(model, opt)
    with tracker:
        loss = step(tracker)
    report = {"torch": torch.__version__, "world": world,
              "params": sum(p.numel() for p in model.parameters()), "losses": [warm, loss],
              **fsdp2_memory.tracker_report(tracker)}
    del model, opt, tracker
    gc.collect()
    return report


def run_fsdp2(a, cells, port):
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(a, cells, port), nprocs=a.ranks, join=True)


# ---------------------------------------------------------------- shardplan's side


def run_train(binary, model, parallel, log):
    """`shardplan train --steps 2`: rank 0's measured and planned peak (the JSON log)."""
    if os.path.exists(log):
        os.remove(log)
    subprocess.run([binary, "train", "--model", model, "--parallel", parallel, "--steps", "2", "--log", log],
                   check=True, capture_output=True)
    lines = [json.loads(x) for x in open(log) if x.strip()]
    return {"measured": max(x["measured_peak"][0] for x in lines), "planned": lines[-1]["planned_peak"]}


def fsdp2_categories(fsdp):
    """FSDPMemTracker's categories at its peak, summed into shardplan's."""
    return {key: sum(fsdp["at_peak"].get(c, 0) for c in theirs) for key, _, theirs in fsdp2_memory.CATEGORIES}


def cell_result(a, shape, config, model, cell_dir, specs):
    with open(os.path.join(cell_dir, "fsdp2.json")) as f:
        fsdp = json.load(f)
    plans = {v: fsdp2_memory.run_shardplan(a.shardplan, model, specs[v], os.path.join(cell_dir, f"plan-{v}.json"))
             for v in fsdp2_memory.VARIANTS}
    measured = fsdp["peak"]
    r = {
        "shape": shape, "config": config, "params": fsdp["params"],
        "measured_peak": measured,
        "measured_at_peak": fsdp2_categories(fsdp),
        "measured_peak_where": {k: v for k, v in (fsdp["peak_where"] or {}).items() if k != "live"},
    }
    for v, plan in plans.items():
        r[f"{v}_peak"] = plan["memory"]["peak"]
        r[f"{v}_ratio"] = plan["memory"]["peak"] / measured
        r[f"{v}_at_peak"] = plan["memory"]["at_peak"]
        r[f"{v}_peak_where"] = plan["_peak_where"]
    r["train"] = None if a.skip_train else run_train(a.shardplan, model, specs["fused"],
                                                     os.path.join(cell_dir, "train.jsonl"))
    return r


# ---------------------------------------------------------------- tables


def short(b):
    return f"{b / 2**20:.2f}"


def matrix_table(results):
    out = ["| shape | config | FSDP2 measured (MiB) | fused planned | fused / FSDP2 | `train` measured "
           "| eager planned | eager / FSDP2 | `runtime: fsdp2` planned | fsdp2 / FSDP2 |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        t = r["train"]
        train = "-" if t is None else (short(t["measured"]) + ("" if t["measured"] == r["fused_peak"]
                                                               else f" (plan {short(t['planned'])})"))
        fused = f"{r['fused_ratio']:.3f}" + ("" if r["fused_ratio"] <= FUSED_TARGET else " ✗")
        lo, hi = EAGER_BAND
        eager = f"{r['eager_ratio']:.3f}" + ("" if lo <= r["eager_ratio"] <= hi else " ✗")
        out.append(f"| {r['shape']} | {r['config']} | {short(r['measured_peak'])} | {short(r['fused_peak'])} | "
                   f"{fused} | {train} | {short(r['eager_peak'])} | {eager} | {short(r['fsdp2_peak'])} | "
                   f"{r['fsdp2_ratio']:.4f} |")
    return "\n".join(out)


def breakdown_table(results, variant, keep):
    """Categories at the peak, FSDP2 against one plan, for the cells `keep` selects."""
    rows = [r for r in results if keep(r)]
    if not rows:
        return ""
    keys = [k for k, _, _ in fsdp2_memory.CATEGORIES]
    labels = {"sharded_params": "sh. params", "unsharded_params": "unsh. params", "sharded_grads": "sh. grads",
              "unsharded_grads": "unsh. grads", "optimizer_state": "opt. state", "activations": "activations",
              "comm_buffers": "AG/RS buffers"}
    out = [f"| shape | config | where (FSDP2 op / {variant} step) | "
           + " | ".join(f"{labels[k]} FSDP2 / {variant}" for k in keys) + " |",
           "| --- | --- | --- | " + " | ".join("---:" for _ in keys) + " |"]
    for r in rows:
        f, p = r["measured_at_peak"], r[f"{variant}_at_peak"]
        where = f"{(r['measured_peak_where'] or {}).get('op')} / {r[f'{variant}_peak_where']}"
        out.append(f"| {r['shape']} | {r['config']} | {where} | "
                   + " | ".join(f"{short(f[k])} / {short(p[k])}" for k in keys) + " |")
    return "\n".join(out)


def markdown(results, torch_version, a):
    lo, hi = EAGER_BAND
    parts = [
        f"Per-rank peak memory, rank 0, MiB (2^20 B). FSDP2: FSDPMemTracker, torch {torch_version}, CPU, gloo, "
        f"{a.ranks} ranks, batch {a.batch} x {a.seq} per rank, f32, AdamW, clipping 1.0. "
        f"✗: fused above {FUSED_TARGET}, or eager outside {lo}-{hi}.",
        "",
        matrix_table(results),
    ]
    miss = breakdown_table(results, "fused", lambda r: r["fused_ratio"] > FUSED_TARGET)
    if miss:
        parts += ["", f"Cells above {FUSED_TARGET}: categories at each peak (MiB), FSDP2 / fused plan.", "", miss]
    off = breakdown_table(results, "eager", lambda r: not lo <= r["eager_ratio"] <= hi)
    if off:
        parts += ["", f"Cells with eager outside {lo}-{hi}: categories at each peak (MiB), FSDP2 / eager plan.",
                  "", off]
    return "\n".join(parts) + "\n"


def main(argv=None):
    a = parse_args(argv)
    missing = fsdp2_memory.tracker_unavailable()
    if missing:
        print(missing)
        return 0
    import torch
    if not os.path.exists(a.shardplan):
        print(f"error: no shardplan binary at {a.shardplan} (cargo build, or --shardplan)", file=sys.stderr)
        return 2
    out = os.path.abspath(a.out)
    results = []
    for i, shape in enumerate(a.shapes):
        shape_dir = os.path.join(out, shape)
        os.makedirs(shape_dir, exist_ok=True)
        model = os.path.join(shape_dir, "model.yaml")
        with open(model, "w") as f:
            f.write(model_yaml(shape, SHAPES[shape], a.seq))
        cells = [(config, *write_cell(a, shape_dir, model, config)) for config in a.configs]
        if not a.skip_fsdp2:
            print(f"FSDP2 {shape}: {', '.join(a.configs)} on {a.ranks} ranks (gloo) ...", file=sys.stderr, flush=True)
            run_fsdp2(a, [(config, d) for config, d, _ in cells], a.port + i)
        for config, d, specs in cells:
            r = cell_result(a, shape, config, model, d, specs)
            results.append(r)
            t = r["train"]
            print(f"{shape:28} {config:13} FSDP2 {short(r['measured_peak']):>8} MiB  fused {r['fused_ratio']:.3f}  "
                  f"eager {r['eager_ratio']:.3f}  fsdp2 {r['fsdp2_ratio']:.4f}  train "
                  + ("-" if t is None else f"{short(t['measured'])} (plan {short(t['planned'])})"), flush=True)
    text = markdown(results, torch.__version__, a)
    with open(os.path.join(out, "matrix.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"torch": torch.__version__, "ranks": a.ranks, "batch": a.batch, "seq": a.seq,
                   "shardplan": os.path.abspath(a.shardplan), "results": results}, f, indent=2)
        f.write("\n")
    print()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
