//! Generated models and parallel specs for the property tests.

use proptest::prelude::*;
use shardplan_models::{LlamaConfig, ModelConfig};

pub fn llama(vocab: u64, dim: u64, layers: u64, heads: u64, kv: u64, ffn: u64, tie: bool) -> ModelConfig {
    ModelConfig::Llama(LlamaConfig {
        name: "gen".into(),
        vocab_size: vocab,
        dim,
        n_layers: layers,
        n_heads: heads,
        n_kv_heads: kv,
        head_dim: None,
        ffn_dim: ffn,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: Default::default(),
        activation: None,
        tie_embeddings: tie,
        qkv_bias: false,
        qk_norm: false,
        moe: None,
        max_seq_len: 64,
    })
}

#[derive(Debug, Clone)]
pub struct Policy {
    pub reshard: &'static str,
    pub prefetch: (u32, u32),
    pub ac: &'static str,
    pub accum: u64,
    pub sync: &'static str,
    pub offload: bool,
    pub bf16: bool,
    pub wrap: &'static str,
    pub bucket: Option<u64>,
}

pub fn policy() -> impl Strategy<Value = Policy> {
    (
        prop::sample::select(vec!["true", "false", "2"]),
        (0u32..3, 0u32..3),
        prop::sample::select(vec!["none", "full", "{every: 2}"]),
        1u64..4,
        prop::sample::select(vec!["every_micro_batch", "final_micro_batch"]),
        any::<bool>(),
        any::<bool>(),
        prop::sample::select(vec!["[block]", "[attention, mlp]", "[block, attention]"]),
        prop::option::of(1u64..3),
    )
        .prop_map(
            |(reshard, prefetch, ac, accum, sync, offload, bf16, wrap, bucket)| Policy {
                reshard,
                prefetch,
                ac,
                accum,
                sync,
                offload,
                bf16,
                wrap,
                bucket,
            },
        )
}

pub fn spec(replicate: u64, shard: u64, p: &Policy) -> String {
    let reshard = if p.reshard == "2" && !shard.is_multiple_of(2) {
        "true"
    } else {
        p.reshard
    };
    format!(
        "mesh: {{replicate: {replicate}, shard: {shard}}}\ngpus_per_node: {}\nwrap: {}\n{}reshard_after_forward: {reshard}\n\
         prefetch: {{forward: {}, backward: {}}}\nactivation_checkpointing: {}\n\
         batch: {{per_rank: 1, seq_len: 8, grad_accum: {}, grad_sync: {}}}\noffload: {}\n\
         mixed_precision: {{param: {}, reduce: f32}}\n",
        (replicate * shard).min(8),
        p.wrap,
        p.bucket.map(|b| format!("bucket_mib: {b}\n")).unwrap_or_default(),
        p.prefetch.0,
        p.prefetch.1,
        p.ac,
        p.accum,
        p.sync,
        if p.offload { "cpu" } else { "none" },
        if p.bf16 { "bf16" } else { "f32" },
    )
}

pub fn model() -> impl Strategy<Value = ModelConfig> {
    // Every dim-0 size is a multiple of 8, so no shard size up to 8 pads.
    (1u64..5, 1u64..4, 1u64..3, 1u64..4, 1u64..4, any::<bool>()).prop_map(|(v, d, layers, h, f, tie)| {
        let heads = 2 * h;
        llama(8 * v * 4, 8 * heads * d, layers, heads, heads / 2, 16 * f * d, tie)
    })
}
