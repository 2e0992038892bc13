#!/usr/bin/env bash
# Runs the input fuzz suite (tests/fuzz_inputs.rs) at scale: thousands of seeded mutations of
# every input kind (plan JSON, YAML model and parallel specs, HF config.json, checkpoint
# metadata and rank files, safetensors weights, token files).
#
#   scripts/fuzz.sh [CASES] [SEED]     # defaults: 3000 cases per kind, a seed from the clock
#
# A debug build, so overflow checks are on. A failure prints the case (kind, number, the
# mutation) and the seed; rerun with that seed to reproduce it.
set -euo pipefail
cd "$(dirname "$0")/.."
cases="${1:-3000}"
seed="${2:-$(date +%s)}"
echo "fuzz: ${cases} cases per kind, seed ${seed}"
SHARDPLAN_FUZZ_CASES="$cases" SHARDPLAN_FUZZ_SEED="$seed" \
    cargo test --test fuzz_inputs -- --nocapture --test-threads "${FUZZ_THREADS:-2}"
