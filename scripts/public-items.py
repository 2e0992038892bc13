#!/usr/bin/env python3
"""Counts a crate's public API: the items a user of the crate can name.

    scripts/public-items.py [CRATE_SRC] [--list]

Walks the modules reachable from the crate root through `pub mod`, and counts in each the
`pub` items (functions, types, traits, constants, statics) at the top level and the `pub`
functions of its impl blocks, plus the names the root re-exports from private modules
(`pub use`) with the `pub` methods of the types among them. `pub(crate)` and `pub(super)` do not count.
An approximation by text (no macro expansion), good enough to follow a trend.
"""

import os
import re
import sys

ITEM = re.compile(r"^(\s*)pub (?:const fn|unsafe fn|async fn|fn|struct|enum|trait|type|const|static|union) (\w+)")


def module_file(src, parts):
    base = os.path.join(src, *parts)
    for cand in (base + ".rs", os.path.join(base, "mod.rs")):
        if os.path.isfile(cand):
            return cand
    return None


def strip_tests(text):
    out, skip, depth = [], False, 0
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"\s*#\[cfg\(test\)\]", line):
            # skip the next item (a `mod tests { ... }` block)
            j = i + 1
            depth = 0
            started = False
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                if "{" in lines[j]:
                    started = True
                if started and depth <= 0:
                    break
                j += 1
            i = j + 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def module_files(src, module):
    """`module`'s file and the files of its submodules (`module/**/*.rs`)."""
    path = module_file(src, [module])
    files = [path] if path else []
    folder = os.path.join(src, module)
    for root, _, names in os.walk(folder):
        files.extend(os.path.join(root, n) for n in sorted(names) if n.endswith(".rs"))
    return sorted(set(files))


def methods(src, module, name):
    """The `pub fn`s of the impl blocks of type `name` in `module` and its submodules."""
    out = []
    for path in module_files(src, module):
        inside = False
        for line in strip_tests(open(path).read()).split("\n"):
            if re.match(r"^impl(<[^>]*>)? (\w+ for )?" + re.escape(name) + r"\b", line):
                inside = True
            elif line.startswith("}"):
                inside = False
            elif inside:
                m = re.match(r"^    pub (?:const )?fn (\w+)", line)
                if m:
                    out.append(m.group(1))
    return out


def walk(src, parts, found, is_root):
    path = module_file(src, parts) if parts else os.path.join(src, "lib.rs")
    if not path:
        return
    text = strip_tests(open(path).read())
    for line in text.split("\n"):
        m = ITEM.match(line)
        if m and len(m.group(1)) <= 4:
            found.append(("::".join(parts) or "<root>", m.group(2)))
        m = re.match(r"^pub mod (\w+);", line)
        if m:
            walk(src, parts + [m.group(1)], found, False)
    if is_root:
        # `pub use module::{A, B};` (on one or several lines): each name, and the public
        # methods of each type it names.
        for m in re.finditer(r"^pub use (\w+)::(\{[^}]*\}|[^;]*);", text, flags=re.M):
            names = [n for n in re.findall(r"\w+", m.group(2)) if n not in ("as", "self")]
            for n in names:
                found.append(("<root re-export>", n))
                found.extend(("<root re-export>", f"{n}::{f}") for f in methods(src, m.group(1), n))


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    src = args[0] if args else os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "planner", "src")
    found = []
    walk(src, [], found, True)
    if "--list" in sys.argv:
        for m, n in found:
            print(f"{m}: {n}")
    methods_of_types = sum("::" in n for _, n in found)
    print(
        f"{len(found)} public items in {src} "
        f"({len(found) - methods_of_types} items, {methods_of_types} methods of re-exported types)"
    )


if __name__ == "__main__":
    main()
