#!/usr/bin/env bash
# Times one training step of examples/models/llama-10m.yaml (batch 4 x 256 per rank, f32,
# AdamW, clipping) on a 1x4 mesh, run two ways on this machine: 4 ranks as threads of one
# process (--backend local) and 4 MPI processes (mpirun -np 4 --oversubscribe, --backend
# mpi). Prints the median step_seconds of steps 2..STEPS of each and their ratio, and checks
# that the two logs' losses are equal (the MPI backend's results equal Local's bit for bit).
#
#   STEPS=10 benches/mpi_step.sh        (STEPS >= 2; default 10)
#
# Needs Open MPI (mpirun) and a build with --features mpi; honours CARGO_TARGET_DIR, and
# MPIRUN for another launcher command.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-10}
if ! [[ "$STEPS" =~ ^[0-9]+$ ]] || ((STEPS < 2)); then
  echo "STEPS=$STEPS: give a whole number >= 2 (step 1 is not timed)" >&2
  exit 2
fi
MPIRUN=${MPIRUN:-mpirun}
MODEL=examples/models/llama-10m.yaml
PARALLEL=examples/parallel/cpu-1x4-b4-s256.yaml
TARGET=${CARGO_TARGET_DIR:-target}
if ! command -v "$MPIRUN" >/dev/null; then
  echo "skipped: $MPIRUN not found (install Open MPI: libopenmpi-dev openmpi-bin)"
  exit 0
fi
if [[ $(id -u) == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
cargo build -q --release --features mpi --bin shardplan
BIN=$TARGET/release/shardplan

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# The log is appended to, so each run gets a fresh file.
"$BIN" train --backend local --model "$MODEL" --parallel "$PARALLEL" --steps "$STEPS" \
  --log "$dir/threads.jsonl" >"$dir/threads.out" 2>&1 || { cat "$dir/threads.out" >&2; exit 1; }
"$MPIRUN" -np 4 --oversubscribe "$BIN" train --backend mpi --model "$MODEL" --parallel "$PARALLEL" \
  --steps "$STEPS" --log "$dir/mpi.jsonl" >"$dir/mpi.out" 2>&1 || { cat "$dir/mpi.out" >&2; exit 1; }

python3 - "$dir/threads.jsonl" "$dir/mpi.jsonl" "$STEPS" "$(nproc)" <<'PYEOF'
import json, statistics, sys
threads_log, mpi_log, steps, cores = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def read(path):
    rows = [json.loads(l) for l in open(path)]
    assert len(rows) == steps, f"{path}: {len(rows)} steps logged, {steps} expected"
    return rows
t, m = read(threads_log), read(mpi_log)
# Steps 2..N: step 1 pays one-off allocation and table building.
def steady(rows):
    s = [r["step_seconds"] for r in rows[1:]]
    return statistics.median(s), min(s), max(s)
(st, t_lo, t_hi), (sm, m_lo, m_hi) = steady(t), steady(m)
print(f"llama-10m, batch 4 x 256 per rank, f32, AdamW + clipping, mesh 1x4, {cores} cores, median of steps 2..{steps}")
print(f"4 threads (--backend local):     {st * 1e3:8.1f} ms/step (min {t_lo * 1e3:.1f}, max {t_hi * 1e3:.1f})")
print(f"4 MPI processes (--backend mpi): {sm * 1e3:8.1f} ms/step (min {m_lo * 1e3:.1f}, max {m_hi * 1e3:.1f})")
print(f"ratio MPI / threads: {sm / st:.2f}x")
# json.loads of serde's shortest round-trip f32 text: equal floats iff equal f32 bits.
bad = [(a["step"], a["loss"], b["loss"]) for a, b in zip(t, m) if a["loss"] != b["loss"]]
if bad:
    for s, a, b in bad:
        print(f"step {s}: loss {a} (threads) != {b} (MPI)")
    sys.exit(1)
print(f"losses equal at all {steps} steps (first {t[0]['loss']}, last {t[-1]['loss']})")
PYEOF
