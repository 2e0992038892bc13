#!/usr/bin/env python3
"""Import circles between the files of the workspace's crates, and the executor's layers.

    scripts/import-cycles.py [--verbose]

Each `.rs` file under a crate's `src/` is a module (`a/b.rs` and `a/b/mod.rs` are `a::b`,
`lib.rs` / `main.rs` the crate root). A file imports another when its code (comments and
`#[cfg(test)]` modules left out) names a path into it: `crate::a::b::...`, `super::...`,
`self::...`, or a sibling module by its bare name in a `use`. A path is taken to the
longest module it names. A module's children are not imports of it (`mod x;` declares, and
a parent re-exporting a child's items is the usual facade), but a child naming its parent's
items is. The strongly connected components of that graph with more than one file are the
circles; each is printed with one cycle through it.

The executor's top-level modules are also held to their layers (ARCHITECTURE.md): a module
imports only modules of lower layers, never one of its own layer or above. Exit 1 when
there is any circle or any import against the layers.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The executor's layers, lowest first: each top-level module (folder or file) of
# executor/src and the layer it sits in. The crate root (lib.rs) declares and re-exports.
EXECUTOR_LAYERS = [
    ["adamw", "clock", "error", "host", "init"],
    ["comm", "gpu"],
    ["cpu"],
    ["runtime"],
    ["train"],
    ["checkpoint", "infer", "selftest"],
]


def crates():
    """(crate name, src dir) of every crate of the workspace."""
    out = []
    for d in sorted(os.listdir(ROOT)):
        src = os.path.join(ROOT, d, "src")
        if os.path.isfile(os.path.join(ROOT, d, "Cargo.toml")) and os.path.isdir(src):
            out.append((d, src))
    out.append(("shardplan", os.path.join(ROOT, "src")))
    return out


def module_of(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return tuple(rel)


def strip(text):
    """The code of a file: comments, strings' contents and #[cfg(test)] items removed."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def use_paths(code):
    """Every path a `use` names, its braces expanded, and every inline `crate::`/`super::`
    path."""
    paths = []

    def expand(prefix, body):
        parts, depth, cur = [], 0, ""
        for ch in body:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        parts.append(cur)
        for p in parts:
            p = re.sub(r"\s+", "", p)
            if not p:
                continue
            m = re.match(r"^(.*?)::\{(.*)\}$", p)
            if m:
                expand(prefix + [x for x in m.group(1).split("::") if x], m.group(2))
            elif p.startswith("{") and p.endswith("}"):
                expand(prefix, p[1:-1])
            else:
                paths.append(prefix + [x for x in p.split(" as ")[0].split("::") if x])

    for m in re.finditer(r"\buse\s+([^;]+);", code):
        expand([], m.group(1))
    for m in re.finditer(r"\b((?:crate|super|self)(?:::\w+)+)", code):
        paths.append(m.group(1).split("::"))
    return paths


def main():
    verbose = "--verbose" in sys.argv
    edges = {}
    names = {}
    layer = {m: i for i, ms in enumerate(EXECUTOR_LAYERS) for m in ms}
    against = []
    for crate, src in crates():
        files = {}
        for d, _, fs in os.walk(src):
            for f in fs:
                if f.endswith(".rs"):
                    p = os.path.join(d, f)
                    files[module_of(src, p)] = p
        for mod, path in files.items():
            node = (crate, mod)
            names[node] = os.path.relpath(path, ROOT)
            edges.setdefault(node, set())
            # `self` is this module, `super` its parent, a bare name a child of this module.
            here = mod
            for p in use_paths(strip(open(path).read())):
                if p[0] == "crate":
                    target = p[1:]
                elif p[0] in ("super", "self"):
                    base = list(here)
                    while p and p[0] in ("super", "self"):
                        if p[0] == "super":
                            base = base[:-1]
                        p = p[1:]
                    target = base + p
                elif tuple(list(here) + p[:1]) in files:
                    target = list(here) + p
                else:
                    continue
                # The longest module the path names.
                best = None
                for k in range(len(target), -1, -1):
                    if tuple(target[:k]) in files:
                        best = tuple(target[:k])
                        break
                if best is None or best == mod:
                    continue
                # A parent naming its children is declaration and facade, not a dependency.
                if best[: len(mod)] == mod:
                    continue
                edges[node].add((crate, best))
                if crate == "executor" and mod and best and mod[0] != best[0]:
                    a, b = layer.get(mod[0]), layer.get(best[0])
                    if a is None or b is None or b >= a:
                        against.append((names[node], "::".join(best)))
    # Tarjan's strongly connected components.
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    circles = [sorted(c) for c in comps if len(c) > 1]
    for c in sorted(circles):
        members = set(c)
        # One cycle through the component, from its first file (breadth-first back to it).
        start = c[0]
        prev, frontier, seen, cycle = {}, [start], {start}, None
        while frontier and cycle is None:
            nxt = []
            for v in frontier:
                for w in sorted(edges[v] & members):
                    if w == start:
                        cycle = [v]
                        while cycle[-1] != start:
                            cycle.append(prev[cycle[-1]])
                        cycle.reverse()
                        break
                    if w not in seen:
                        seen.add(w)
                        prev[w] = v
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        print(f"circle of {len(c)} files: " + " -> ".join(names[v] for v in cycle + [start]))
        if verbose:
            for v in c:
                print(f"    {names[v]}")
    for src, dst in sorted(set(against)):
        print(f"against the executor's layers: {src} imports crate::{dst}")
    if verbose:
        print(
            f"{len(edges)} files, {sum(len(e) for e in edges.values())} imports, {len(circles)} circle(s), "
            f"{len(set(against))} import(s) against the executor's layers"
        )
    return 1 if circles or against else 0


if __name__ == "__main__":
    sys.exit(main())
