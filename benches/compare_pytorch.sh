#!/usr/bin/env bash
# Times one training step of examples/models/llama-10m.yaml (batch 4 x 256, f32, AdamW,
# clipping) in shardplan and in PyTorch on this CPU, and prints both and their ratio.
# Skips (exit 0) when `python3 -c "import torch"` fails; set PYTHON to another interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "skipped: PyTorch is not importable by $PY (set PYTHON=/path/to/python with torch)"
  exit 0
fi
STEPS=${STEPS:-6}
MODEL=examples/models/llama-10m.yaml
PARALLEL=examples/parallel/cpu-b4-s256.yaml
cargo build -q --release
log=$(mktemp)
trap 'rm -f "$log"' EXIT
./target/release/shardplan train --model "$MODEL" --parallel "$PARALLEL" --steps "$STEPS" --log "$log" >/dev/null
# Mean over steps 2..N: step 1 pays one-off allocation and table building in both.
ours=$("$PY" -c 'import json,sys; r=[json.loads(l)["step_seconds"] for l in open(sys.argv[1])][1:]; print(sum(r)/len(r))' "$log")
theirs=$("$PY" benches/pytorch_step.py --model "$MODEL" --parallel "$PARALLEL" --steps "$STEPS")
"$PY" - "$ours" "$theirs" <<'PYEOF'
import sys, torch
ours, theirs = float(sys.argv[1]), float(sys.argv[2])
print(f"llama-10m, batch 4 x 256, f32, one CPU rank ({torch.get_num_threads()} threads for PyTorch {torch.__version__})")
print(f"shardplan {ours * 1e3:.1f} ms/step, PyTorch {theirs * 1e3:.1f} ms/step, ratio {ours / theirs:.2f}x (target <= 1.5x)")
PYEOF
