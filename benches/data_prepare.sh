#!/usr/bin/env bash
# Tokenizing throughput: `shardplan data prepare` against Python `tokenizers` (the same
# Rust library behind Python bindings, encode_batch in parallel) on the same documents,
# tokenizer and machine.
#
#   benches/data_prepare.sh [--bin target/release/shardplan] [--python python3] [--copies N]
#
# The corpus: every .rs and .md file of the repository, one document each, repeated N
# times (default 20) into one JSON-lines file. Needs a Python with `tokenizers`.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release/shardplan
PY=${PYTHON:-python3}
COPIES=20
while [ $# -gt 0 ]; do
  case $1 in
    --bin) BIN=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --copies) COPIES=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -x "$BIN" ] || { echo "no binary at $BIN: cargo build --release" >&2; exit 2; }
"$PY" -c "import tokenizers" 2>/dev/null || { echo "$PY has no tokenizers (pip install tokenizers)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
TOK=tests/fixtures/tokenizer/tokenizer.json
"$PY" - "$work/corpus.jsonl" "$COPIES" <<'PY'
import json, pathlib, sys
files = sorted(p for p in pathlib.Path(".").rglob("*") if p.suffix in (".rs", ".md") and "target" not in p.parts)
docs = [p.read_text(errors="replace") for p in files]
with open(sys.argv[1], "w") as f:
    for _ in range(int(sys.argv[2])):
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
PY
echo "corpus: $(wc -l < "$work/corpus.jsonl") documents, $(du -h "$work/corpus.jsonl" | cut -f1)"
"$BIN" data prepare --tokenizer "$TOK" --out "$work/out" --val-fraction 0 "$work/corpus.jsonl" >/dev/null
"$PY" - "$work/out/manifest.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
print(f"shardplan data prepare: {m['train_tokens'] + m['val_tokens']} tokens in {m['seconds']:.2f} s: {m['tokens_per_second']:,.0f} tokens/s (read, tokenize, concatenate)")
PY
"$PY" - "$work/corpus.jsonl" "$TOK" <<'PY'
import json, sys, time
from tokenizers import Tokenizer
t = Tokenizer.from_file(sys.argv[2])
start = time.perf_counter()
docs = [json.loads(l)["text"] for l in open(sys.argv[1])]
enc = t.encode_batch(docs, add_special_tokens=False)
n = sum(len(e.ids) + 1 for e in enc)
s = time.perf_counter() - start
print(f"Python tokenizers encode_batch: {n} tokens in {s:.2f} s: {n / s:,.0f} tokens/s (read, tokenize)")
PY
