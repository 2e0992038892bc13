//! Named model sizes: tiny ones for tests, and public architectures with their published
//! config.json numbers.

use crate::{Gpt2Config, LlamaConfig, MlpConfig, ModelConfig};

/// Every preset name, in a stable order.
pub const PRESET_NAMES: &[&str] = &[
    "tiny-llama",
    "tiny-gpt2",
    "tiny-mlp",
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "mistral-7b",
    "qwen2-0.5b",
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
];

#[allow(clippy::too_many_arguments)]
fn llama(
    name: &str,
    vocab: u64,
    dim: u64,
    layers: u64,
    heads: u64,
    kv: u64,
    ffn: u64,
    theta: f64,
    max_seq: u64,
) -> LlamaConfig {
    LlamaConfig {
        name: name.to_string(),
        vocab_size: vocab,
        dim,
        n_layers: layers,
        n_heads: heads,
        n_kv_heads: kv,
        head_dim: None,
        ffn_dim: ffn,
        norm_eps: 1e-5,
        rope_theta: theta,
        rope_scaling: Default::default(),
        activation: None,
        tie_embeddings: false,
        qkv_bias: false,
        max_seq_len: max_seq,
    }
}

fn gpt2(name: &str, dim: u64, layers: u64, heads: u64) -> Gpt2Config {
    Gpt2Config {
        name: name.to_string(),
        vocab_size: 50257,
        dim,
        n_layers: layers,
        n_heads: heads,
        ffn_dim: 4 * dim,
        max_seq_len: 1024,
        norm_eps: 1e-5,
        activation: None,
    }
}

/// The preset called `name`, if there is one.
pub fn preset(name: &str) -> Option<ModelConfig> {
    Some(match name {
        "tiny-llama" => ModelConfig::Llama(llama(name, 256, 64, 2, 4, 2, 128, 10000.0, 128)),
        "tiny-gpt2" => ModelConfig::Gpt2(Gpt2Config {
            vocab_size: 256,
            ffn_dim: 256,
            max_seq_len: 128,
            ..gpt2(name, 64, 2, 4)
        }),
        "tiny-mlp" => ModelConfig::Mlp(MlpConfig {
            name: name.to_string(),
            dim: 32,
            ffn_dim: 64,
            n_layers: 2,
            n_classes: 10,
        }),
        "llama2-7b" => ModelConfig::Llama(llama(name, 32000, 4096, 32, 32, 32, 11008, 10000.0, 4096)),
        "llama2-13b" => ModelConfig::Llama(llama(name, 32000, 5120, 40, 40, 40, 13824, 10000.0, 4096)),
        "llama2-70b" => ModelConfig::Llama(llama(name, 32000, 8192, 80, 64, 8, 28672, 10000.0, 4096)),
        "llama3-8b" => ModelConfig::Llama(llama(name, 128256, 4096, 32, 32, 8, 14336, 500000.0, 8192)),
        "llama3-70b" => ModelConfig::Llama(llama(name, 128256, 8192, 80, 64, 8, 28672, 500000.0, 8192)),
        "llama3-405b" => ModelConfig::Llama(llama(name, 128256, 16384, 126, 128, 8, 53248, 500000.0, 8192)),
        "mistral-7b" => ModelConfig::Llama(llama(name, 32000, 4096, 32, 32, 8, 14336, 10000.0, 32768)),
        "qwen2-0.5b" => ModelConfig::Llama(LlamaConfig {
            norm_eps: 1e-6,
            tie_embeddings: true,
            qkv_bias: true,
            ..llama(name, 151936, 896, 24, 14, 2, 4864, 1000000.0, 32768)
        }),
        "gpt2" => ModelConfig::Gpt2(gpt2(name, 768, 12, 12)),
        "gpt2-medium" => ModelConfig::Gpt2(gpt2(name, 1024, 24, 16)),
        "gpt2-large" => ModelConfig::Gpt2(gpt2(name, 1280, 36, 20)),
        "gpt2-xl" => ModelConfig::Gpt2(gpt2(name, 1600, 48, 25)),
        _ => return None,
    })
}
