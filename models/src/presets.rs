//! Named model sizes: tiny ones for tests, and public architectures with their published
//! config.json numbers.

use crate::{Gpt2Config, LlamaConfig, MlpConfig, ModelConfig, MoeConfig, MoeNames, Router};

/// Every preset name, in a stable order.
pub const PRESET_NAMES: &[&str] = &[
    "tiny-llama",
    "tiny-qwen3",
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
    "qwen3-8b",
    "mixtral-8x7b",
    "qwen2-57b-a14b",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
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
        qk_norm: false,
        moe: None,
        max_seq_len: max_seq,
    }
}

/// Qwen3's attention on a Llama shape: q/k norms, an explicit head_dim, eps 1e-6.
fn qwen3(c: LlamaConfig, head_dim: u64) -> LlamaConfig {
    LlamaConfig {
        head_dim: Some(head_dim),
        norm_eps: 1e-6,
        qk_norm: true,
        ..c
    }
}

/// `experts` routed experts of width `width`, `top_k` per token, softmax routing, on every
/// layer; no shared experts, no load-balancing loss (the published configs train with
/// `output_router_logits: false`).
fn moe(experts: u64, top_k: u64, width: u64, norm_topk_prob: bool) -> MoeConfig {
    MoeConfig {
        experts,
        top_k,
        expert_ffn_dim: width,
        shared_experts: 0,
        shared_expert_ffn_dim: 0,
        shared_expert_gate: false,
        router: Router::SoftmaxTopk,
        norm_topk_prob,
        aux_loss_coef: 0.0,
        every: 1,
        first_dense: 0,
        dense_layers: Default::default(),
        hf_names: MoeNames::Qwen,
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
        // Qwen3's shape in small: per-head q/k norms, head_dim set apart from dim / n_heads.
        "tiny-qwen3" => ModelConfig::Llama(qwen3(llama(name, 256, 64, 2, 4, 2, 128, 1000000.0, 128), 32)),
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
        // Qwen/Qwen3-8B config.json.
        "qwen3-8b" => ModelConfig::Llama(qwen3(
            llama(name, 151936, 4096, 36, 32, 8, 12288, 1000000.0, 40960),
            128,
        )),
        // mistralai/Mixtral-8x7B-v0.1 config.json: 8 experts as wide as intermediate_size,
        // 2 per token, scores renormalised over the two.
        "mixtral-8x7b" => ModelConfig::Llama(LlamaConfig {
            moe: Some(MoeConfig {
                hf_names: MoeNames::Mixtral,
                ..moe(8, 2, 14336, true)
            }),
            ..llama(name, 32000, 4096, 32, 32, 8, 14336, 1000000.0, 32768)
        }),
        // Qwen/Qwen2-57B-A14B config.json: q/k/v biases, 64 experts of 2560, 8 per token
        // without renormalising, one shared expert of 20480 behind a sigmoid gate.
        "qwen2-57b-a14b" => ModelConfig::Llama(LlamaConfig {
            norm_eps: 1e-6,
            qkv_bias: true,
            moe: Some(MoeConfig {
                shared_experts: 1,
                shared_expert_ffn_dim: 20480,
                shared_expert_gate: true,
                ..moe(64, 8, 2560, false)
            }),
            ..llama(name, 151936, 3584, 28, 28, 4, 18944, 1000000.0, 131072)
        }),
        // Qwen/Qwen3-30B-A3B config.json: 128 experts of 768, 8 per token, renormalised.
        "qwen3-30b-a3b" => ModelConfig::Llama(LlamaConfig {
            moe: Some(moe(128, 8, 768, true)),
            ..qwen3(llama(name, 151936, 2048, 48, 32, 4, 6144, 1000000.0, 40960), 128)
        }),
        // Qwen/Qwen3-235B-A22B config.json: 128 experts of 1536, 8 per token, renormalised.
        "qwen3-235b-a22b" => ModelConfig::Llama(LlamaConfig {
            moe: Some(moe(128, 8, 1536, true)),
            ..qwen3(llama(name, 151936, 4096, 94, 64, 4, 12288, 1000000.0, 40960), 128)
        }),
        "gpt2" => ModelConfig::Gpt2(gpt2(name, 768, 12, 12)),
        "gpt2-medium" => ModelConfig::Gpt2(gpt2(name, 1024, 24, 16)),
        "gpt2-large" => ModelConfig::Gpt2(gpt2(name, 1280, 36, 20)),
        "gpt2-xl" => ModelConfig::Gpt2(gpt2(name, 1600, 48, 25)),
        _ => return None,
    })
}
