#!/usr/bin/env bash
# Builds the book under docs/ with mdBook (into docs/book, git-ignored) and checks it: the
# build must print no warning or error, and every relative link and #anchor of the built
# HTML, of README.md, of ARCHITECTURE.md and of the book's Markdown must resolve
# (scripts/check-links.py; http(s) links are only checked for their syntax, no network).
#
#   scripts/check-docs.sh
#
# mdBook is taken from PATH, else from the cache, else installed into the cache with cargo
# (a few minutes, once per machine): ${SHARDPLAN_CACHE:-$HOME/.cache/shardplan}/mdbook.
# Exits non-zero with the warnings or the broken links listed.
set -euo pipefail
cd "$(dirname "$0")/.."

# 0.5.4 needs rustc 1.88 or later (the workspace's own floor is 1.89).
MDBOOK_VERSION=0.5.4
cache="${SHARDPLAN_CACHE:-$HOME/.cache/shardplan}/mdbook"

if command -v mdbook >/dev/null 2>&1; then
  mdbook=$(command -v mdbook)
elif [ -x "$cache/bin/mdbook" ] && "$cache/bin/mdbook" --version 2>/dev/null | grep -q "v$MDBOOK_VERSION\$"; then
  mdbook="$cache/bin/mdbook"
else
  echo "check-docs: installing mdBook $MDBOOK_VERSION into $cache"
  cargo install mdbook --locked --no-default-features --version "$MDBOOK_VERSION" --root "$cache" --force
  mdbook="$cache/bin/mdbook"
fi
echo "check-docs: $("$mdbook" --version) ($mdbook)"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
rm -rf docs/book
if ! "$mdbook" build docs >"$log" 2>&1; then
  cat "$log"
  echo "check-docs: mdbook build failed"
  exit 1
fi
# mdBook 0.5 logs ` WARN ...` / `ERROR ...`, 0.4 `[WARN] ...`; either is a failure, as is a
# failed include, which only logs.
if grep -Eq '^[[:space:]]*(WARN|ERROR)[[:space:]]|\[(WARN|ERROR)\]|^(warning|error)(:|\[)' "$log"; then
  cat "$log"
  echo "check-docs: mdbook build printed warnings or errors"
  exit 1
fi
echo "check-docs: built docs/book"

python3 scripts/check-links.py docs/book README.md ARCHITECTURE.md docs/src
