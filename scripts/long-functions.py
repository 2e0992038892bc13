#!/usr/bin/env python3
"""Lists the workspace's functions over a length, longest first, outside tests.

    scripts/long-functions.py [--over 100] [--max-over-150 N]

A function's length is its lines from `fn` to its closing brace (rustfmt's layout). Test
code (files under tests/ or benches/, and `#[cfg(test)]` modules) is left out. With
--max-over-150 N it exits 1 when more than N functions outside the flat per-op tables
(`Op::infer`, `vjp`) are over 150 lines.
"""

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TABLES = {"infer", "vjp"}
FN = re.compile(r"^(\s*)(pub(\([a-z]+\))? )?(const )?(async )?(unsafe )?fn (\w+)")


def functions(path):
    lines = path.read_text().splitlines()
    in_test = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"^\s*#\[cfg\(test\)\]", line):
            in_test = len(line) - len(line.lstrip())
        m = FN.match(line)
        if m and not line.rstrip().endswith(";"):
            indent = m.group(1)
            name = m.group(7)
            j = i
            while j < len(lines) and not (lines[j].startswith(indent + "}") and len(lines[j].rstrip()) == len(indent) + 1):
                j += 1
            if in_test is None:
                yield name, i + 1, j - i + 1
            i += 1
            continue
        if in_test is not None and line.startswith(" " * in_test + "}") and line.strip() == "}" and (len(line) - len(line.lstrip())) == in_test:
            in_test = None
        i += 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--over", type=int, default=100)
    ap.add_argument("--max-over-150", type=int)
    a = ap.parse_args()
    found = []
    for path in sorted(ROOT.glob("**/*.rs")):
        rel = path.relative_to(ROOT)
        parts = rel.parts
        if parts[0] == "target" or "tests" in parts or "benches" in parts or "examples" in parts:
            continue
        for name, line, n in functions(path):
            if n > a.over:
                found.append((n, f"{rel}:{line}", name))
    found.sort(reverse=True)
    for n, where, name in found:
        print(f"{n:5} {where} {name}")
    over150 = [f for f in found if f[0] > 150 and f[2] not in TABLES]
    print(f"{len(found)} functions over {a.over} lines; {len(over150)} over 150 outside the per-op tables")
    if a.max_over_150 is not None and len(over150) > a.max_over_150:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
