#!/usr/bin/env bash
# From text to a model that writes text, on a laptop CPU, in a few minutes:
#   1. tokenize the repository's own documentation (README.md, ARCHITECTURE.md and the book's
#      pages, docs/src/*.md) with the byte-level BPE tokenizer of tests/fixtures/tokenizer
#      (512 tokens, trained on an earlier version of the README),
#   2. train a 0.9M-parameter Llama on 1x2 ranks (two threads) with a validation loss,
#   3. generate a sample from the checkpoint,
#   4. export it as a Hugging Face folder (model.safetensors + config.json) and generate from
#      that too; with PYTHON=/path/to/python (torch + transformers), transformers loads the
#      folder and its greedy continuation is compared with shardplan's.
#
#   examples/demo.sh                          # builds target/release/shardplan first
#   SHARDPLAN=path/to/shardplan STEPS=300 OUT=/tmp/demo PYTHON=python3 examples/demo.sh
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
STEPS="${STEPS:-300}"
OUT="${OUT:-$root/target/demo}"
if [[ -z "${SHARDPLAN:-}" ]]; then
    (cd "$root" && cargo build --release --quiet)
    SHARDPLAN="$root/target/release/shardplan"
fi
TOKENIZER="$root/tests/fixtures/tokenizer/tokenizer.json"
mkdir -p "$OUT"
rm -rf "$OUT/ckpt" "$OUT/hf" "$OUT/log.jsonl"
start=$(date +%s)

echo "== 1. data prepare"
"$SHARDPLAN" data prepare --tokenizer "$TOKENIZER" --out "$OUT/data" --val-fraction 0.1 \
    "$root/README.md" "$root/ARCHITECTURE.md" "$root"/docs/src/*.md

cat > "$OUT/model.yaml" <<'EOF'
name: demo-llama
family: llama
vocab_size: 512
dim: 128
n_layers: 4
n_heads: 4
n_kv_heads: 2
ffn_dim: 384
max_seq_len: 256
rope_theta: 10000
EOF
cat > "$OUT/parallel.yaml" <<'EOF'
mesh: {replicate: 1, shard: 2}
gpus_per_node: 2
mixed_precision: {param: f32, reduce: f32}
batch: {per_rank: 8, seq_len: 128}
optimizer: {adamw: {lr: 3.0e-3, betas: [0.9, 0.95], weight_decay: 0.1}}
lr_schedule: {warmup_steps: 30, min_lr_ratio: 0.1}
grad_clip: 1.0
data: {tokens: data/train.bin, dtype: u16, val: data/val.bin, eval_every: 50, eval_batches: 8}
EOF

echo "== 2. train $STEPS steps on 1x2 ranks"
"$SHARDPLAN" train --model "$OUT/model.yaml" --parallel "$OUT/parallel.yaml" --steps "$STEPS" \
    --log "$OUT/log.jsonl" --checkpoint-dir "$OUT/ckpt" | head -2

echo "== 3. generate from the checkpoint"
"$SHARDPLAN" generate --from "$OUT/ckpt" --tokenizer "$TOKENIZER" --prompt "The planner" \
    --max-new-tokens 60 --temperature 0.7 --seed 1

echo "== 4. export to a Hugging Face folder and generate from it"
mkdir -p "$OUT/hf"
"$SHARDPLAN" checkpoint export "$OUT/ckpt" --out "$OUT/hf/model.safetensors"
cat > "$OUT/hf/config.json" <<'EOF'
{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 512,
  "hidden_size": 128,
  "intermediate_size": 384,
  "num_hidden_layers": 4,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "max_position_embeddings": 256,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "hidden_act": "silu",
  "tie_word_embeddings": false
}
EOF
ours=$("$SHARDPLAN" generate --from "$OUT/hf" --tokenizer "$TOKENIZER" --prompt "The planner" \
    --max-new-tokens 24 --temperature 0 --ignore-eos --logits "$OUT/logits.json" 2>/dev/null)
echo "$ours"

if [[ -n "${PYTHON:-}" ]]; then
    echo "== transformers loads the export: greedy continuation"
    theirs=$("$PYTHON" - "$OUT/hf" "$TOKENIZER" "$OUT/logits.json" <<'EOF'
import json
import sys

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32).eval()
tok = Tokenizer.from_file(sys.argv[2])
ids = torch.tensor([tok.encode("The planner").ids])
# The logits of the prompt, against shardplan's (`generate --logits`).
ours = json.load(open(sys.argv[3]))
assert ours["tokens"] == ids[0].tolist(), "the two tokenizations differ"
with torch.no_grad():
    logits = model(ids).logits[0].double()
diff = (logits - torch.tensor(ours["logits"], dtype=torch.float64)).abs().max().item()
rel = diff / logits.abs().max().item()
print(f"logits of the {ids.shape[1]} prompt positions: max difference {diff:.3g} ({rel:.3g} of the largest)", file=sys.stderr)
if rel > 1e-5:
    sys.exit("transformers' logits differ from shardplan's")
out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                     do_sample=False, eos_token_id=None, pad_token_id=0)
print("The planner" + tok.decode(out[0, ids.shape[1]:].tolist()))
EOF
)
    echo "$theirs"
    if [[ "$ours" == "$theirs" ]]; then
        echo "transformers' greedy continuation equals shardplan's"
    else
        echo "transformers' greedy continuation differs from shardplan's" >&2
        exit 1
    fi
fi
echo "== done in $(( $(date +%s) - start )) s; metrics in $OUT/log.jsonl"
