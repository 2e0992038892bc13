#!/usr/bin/env bash
# Does the plan predict `shardplan train`'s own step time on this CPU?
#
#   benches/cpu_selfpredict.sh [BINARY]      (default target/release/shardplan)
#
# For tiny-llama and llama-10m on meshes 1x1 (examples/parallel/cpu-1.yaml) and 1x4
# (examples/parallel/fsdp-1x4-cpu.yaml): `shardplan calibrate --ranks R` measures this
# machine with the executor's kernels, the spec gets that hardware profile, `train` runs
# 30 steps with a log, and `plan --compare` prints predicted against measured. Then
# llama-10m as PP 2 x FSDP 2 (examples/parallel/pp-2-fsdp-2-cpu.yaml, 1F1B, 4 ranks as
# threads), whose `train` prints its measured step beside the plan's. Run it on an
# otherwise idle machine: other work on the cores is measured too.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-target/release/shardplan}
[ -x "$B" ] || { echo "no binary at $B: cargo build --release" >&2; exit 2; }
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
for ranks in 1 4; do
  spec=examples/parallel/cpu-1.yaml
  [ "$ranks" = 4 ] && spec=examples/parallel/fsdp-1x4-cpu.yaml
  "$B" calibrate --ranks "$ranks" --out "$T/hw$ranks.txt" > /dev/null
  { grep -v '^hardware:' "$spec"; cat "$T/hw$ranks.txt"; } > "$T/p$ranks.yaml"
  for model in tiny-llama examples/models/llama-10m.yaml; do
    name="$(basename "$model" .yaml) 1x$ranks"
    rm -f "$T/log.jsonl"   # train appends to an existing log
    "$B" train --model "$model" --parallel "$T/p$ranks.yaml" --steps 30 --log "$T/log.jsonl" > /dev/null 2>&1
    echo "== $name"
    "$B" plan --model "$model" --parallel "$T/p$ranks.yaml" --compare "$T/log.jsonl" | grep -E "step time|tokens/s"
  done
done
{ grep -v '^hardware:' examples/parallel/pp-2-fsdp-2-cpu.yaml; cat "$T/hw4.txt"; } > "$T/pp.yaml"
echo "== llama-10m pp2x2"
"$B" train --model examples/models/llama-10m.yaml --parallel "$T/pp.yaml" --steps 30 2> /dev/null | grep -E "^step"
