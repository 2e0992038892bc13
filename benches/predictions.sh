#!/usr/bin/env bash
# Every published FSDP2 run (planner/tests/fixtures/anchors.md, the project's ANCHORS.md) and
# every run measured on an H200 (planner/tests/h200_runs.rs), planned as it ran and printed
# predicted against measured: one table, dated, with the commit it was planned at.
#
#   benches/predictions.sh            # a Markdown table on stdout
#
# The rows and their specs are the tests' own (`cargo test -p shardplan-planner --test anchors
# --test float8_anchors --test h200_runs`), which also hold each row to its tolerance; this prints what they plan.
# Ratios are predicted / measured (1.000 inside a published range). The 96 GB H100 rows are
# planned at both ends of their GPU's known peak (835 and 989 TFLOP/s).
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests print every row before they assert; a row outside its tolerance still prints,
# and the tests' verdict is said after the table.
out=$(cargo test -q --no-fail-fast -p shardplan-planner --test anchors --test float8_anchors --test h200_runs -- --nocapture --test-threads 1 2>&1) \
  && verdict="every row within the tests' tolerances" \
  || verdict="FAILED: $(printf '%s\n' "$out" | grep -E -A3 'panicked at' | grep -v 'panicked at' | head -n 6 | tr '\n' ' ')"
rows=$(printf '%s\n' "$out" | sed -n 's/^[.]*row: //p')
echo "Predicted against measured, $(date -u +%Y-%m-%d), shardplan $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo
echo "| run | figure | predicted | measured | predicted / measured |"
echo "|---|---|---:|---:|---:|"
echo "$rows" | awk -F' \\| ' '{ printf "| %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5 }'
echo
echo "$verdict"
[ "${verdict#FAILED}" = "$verdict" ]
