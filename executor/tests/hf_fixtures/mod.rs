//! The Hugging Face fixtures of `tests/fixtures/hf/` (written by `scripts/hf-fixtures.py`):
//! every variant and its parsed config, shared by the parity and generation tests.

use shardplan_frontends::{parse_hf_config, Source};
use shardplan_models::ModelConfig;
use std::path::{Path, PathBuf};

pub const VARIANTS: [&str; 18] = [
    "llama",
    "llama-head-dim",
    "llama-rope-llama3",
    "llama-rope-linear",
    "llama-rope-yarn",
    "llama-gelu",
    "llama-gelu-tanh",
    "llama-relu",
    "gpt2-gelu",
    "mistral",
    "mistral-window",
    "qwen2",
    "qwen2-tied",
    "qwen3",
    "gpt2",
    // Mixtures of experts: 4 routed experts, 2 per token.
    "mixtral",
    "qwen2-moe",
    "qwen3-moe",
];

/// The folder of one variant.
pub fn dir(variant: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf")
        .join(variant)
}

/// The variant's config.json, parsed as shardplan reads it.
pub fn config(variant: &str) -> ModelConfig {
    let p = dir(variant).join("config.json");
    let text = std::fs::read_to_string(&p).unwrap();
    parse_hf_config(&Source::from_text(p, text))
        .unwrap_or_else(|e| panic!("{variant}: {e}"))
        .0
}
