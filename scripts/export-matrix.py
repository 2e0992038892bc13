#!/usr/bin/env python3
"""Exports every bundled example model with every example parallel spec that plans, and
prints what `shardplan export fsdp2` made of each pair.

    scripts/export-matrix.py [--bin target/debug/shardplan] [--jobs 2] [--json FILE]

A pair whose `shardplan plan` fails (the model does not split over the mesh, its sequence
does not fit, ...) is not a question for the export and is counted apart. Every pair
that plans either exports (its train.py is written and compiles as Python) or is refused
with exit 2 naming a field; the refusals are printed grouped by their reason, with the
pairs each covers, so the docs' list of what PyTorch cannot express is this output.
Exits 1 if an export fails any other way (a panic, another exit code, a program that
does not compile).
"""

import argparse
import concurrent.futures
import json
import pathlib
import py_compile
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def pairs():
    models = sorted((ROOT / "examples/models").iterdir())
    specs = sorted((ROOT / "examples/parallel").glob("*.yaml"))
    return [(m, s) for m in models for s in specs]


def reason(stderr):
    """A refusal's field and its message's first clause, with the file's place left out."""
    first = stderr.strip().splitlines()[0] if stderr.strip() else ""
    m = re.match(r"error: [^ ]*?(?::\d+:\d+)?: `([^`]+)`: (.*)", first)
    if not m:
        return ("?", first)
    field, message = m.groups()
    return (re.sub(r"\[\d+\]", "[N]", field), message.split("; ")[0])


def one(binary, model, spec):
    base = [binary, "plan", "--model", str(model), "--parallel", str(spec)]
    planned = subprocess.run(base, capture_output=True, text=True, cwd=ROOT)
    if planned.returncode != 0:
        return {"outcome": "does not plan", "why": reason(planned.stderr)}
    with tempfile.TemporaryDirectory() as out:
        args = [binary, "export", "fsdp2", "--model", str(model), "--parallel", str(spec), "--out", out]
        p = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
        if p.returncode == 2:
            return {"outcome": "refused", "why": reason(p.stderr)}
        if p.returncode != 0:
            return {"outcome": "failed", "why": ("exit", f"{p.returncode}: {p.stderr.strip()[:300]}")}
        try:
            py_compile.compile(str(pathlib.Path(out) / "train.py"), doraise=True)
        except py_compile.PyCompileError as e:
            return {"outcome": "failed", "why": ("train.py", str(e)[:300])}
    return {"outcome": "exported"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=str(ROOT / "target/debug/shardplan"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write every pair's outcome here")
    a = ap.parse_args(argv)
    todo = pairs()
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        results = list(pool.map(lambda ms: one(a.bin, *ms), todo))
    rows = [{"model": m.name, "spec": s.name, **r} for (m, s), r in zip(todo, results)]
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=1))
    count = {k: sum(r["outcome"] == k for r in rows) for k in ["exported", "refused", "does not plan", "failed"]}
    planned = count["exported"] + count["refused"] + count["failed"]
    print(f"{len(rows)} pairs: {planned} plan, of which {count['exported']} export and {count['refused']} are "
          f"refused ({count['failed']} failed); {count['does not plan']} do not plan")
    groups = {}
    for r in rows:
        if r["outcome"] in ("refused", "failed"):
            groups.setdefault((r["outcome"],) + tuple(r["why"]), []).append(f"{r['model']} x {r['spec']}")
    for (outcome, field, message), which in sorted(groups.items(), key=lambda g: -len(g[1])):
        print(f"\n{outcome} at `{field}` ({len(which)} pairs): {message}")
        for w in which[:6]:
            print(f"  {w}")
        if len(which) > 6:
            print(f"  ... and {len(which) - 6} more")
    print("\nexported, by parallel spec:")
    for s in sorted({r["spec"] for r in rows}):
        ok = [r["model"] for r in rows if r["spec"] == s and r["outcome"] == "exported"]
        print(f"  {s:40} {len(ok):2} models" + (f" ({', '.join(ok[:4])}{', ...' if len(ok) > 4 else ''})" if ok else ""))
    return 1 if count["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
