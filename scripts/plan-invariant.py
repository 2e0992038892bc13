#!/usr/bin/env python3
"""Plans every example model with every example parallel spec and records what each prints.

    scripts/plan-invariant.py record DIR [--bin target/debug/shardplan]
    scripts/plan-invariant.py compare DIR [--bin ...]

`record` writes, for each pair, the exit code, the text plan and the figures of
`--format json` (peak, allocated/reserved, communication, predicted step) into DIR.
`compare` plans again and lists every pair whose exit code, text or figures differ from
DIR's; it exits 1 if any does. A refactor of the planner must leave all of them equal.
"""

import argparse
import concurrent.futures
import hashlib
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def pairs():
    models = sorted((ROOT / "examples/models").iterdir())
    specs = sorted((ROOT / "examples/parallel").glob("*.yaml"))
    return [(m, s) for m in models for s in specs]


def figures(plan):
    """The figures a user reads off a plan, whatever shape its JSON has."""
    mem, est = plan.get("memory", {}), plan.get("estimate", {})
    keep = {}
    for k in ("peak", "active_peak", "reserved_peak", "device_total", "by_category"):
        if k in mem:
            keep["memory." + k] = mem[k]
    for k, v in est.items():
        keep["estimate." + k] = v
    own = plan.get("shardplan_executor")
    if own is not None:
        keep["shardplan_executor"] = own
    return keep


def run(binary, model, spec):
    args = [binary, "plan", "--model", str(model), "--parallel", str(spec)]
    text = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    out = {"code": text.returncode, "text": text.stdout, "stderr": text.stderr}
    if text.returncode == 0:
        js = subprocess.run(args + ["--format", "json"], capture_output=True, text=True, cwd=ROOT)
        out["json_sha256"] = hashlib.sha256(js.stdout.encode()).hexdigest()
        out["figures"] = figures(json.loads(js.stdout)) if js.returncode == 0 else None
    return out


def key(model, spec):
    return f"{model.name}__{spec.stem}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["record", "compare"])
    ap.add_argument("dir", type=pathlib.Path)
    ap.add_argument("--bin", default=str(ROOT / "target/debug/shardplan"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    todo = pairs()
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        results = dict(zip((key(m, s) for m, s in todo), pool.map(lambda p: run(a.bin, *p), todo)))
    planned = sum(r["code"] == 0 for r in results.values())
    if a.mode == "record":
        for k, r in results.items():
            (a.dir / f"{k}.json").write_text(json.dumps(r, indent=1, sort_keys=True))
        print(f"{len(results)} pairs, {planned} planned: recorded in {a.dir}")
        return 0
    differ = []
    for k, r in results.items():
        path = a.dir / f"{k}.json"
        if not path.exists():
            differ.append(f"{k}: not recorded")
            continue
        old = json.loads(path.read_text())
        for field in ("code", "text", "stderr", "figures"):
            if old.get(field) != r.get(field):
                differ.append(f"{k}: {field} differs")
    for line in differ:
        print(line)
    print(f"{len(results)} pairs, {planned} planned, {len(differ)} differences")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
