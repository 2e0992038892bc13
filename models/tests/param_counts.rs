//! Parameter counts equal the published figures of the public models (as reported by
//! `sum(p.numel() for p in model.parameters())` in Hugging Face transformers), both from
//! the closed-form count and from the traced graph.

use shardplan_ir::stats::param_counts;
use shardplan_models::{preset, trace, TraceOptions, PRESET_NAMES};

fn traced_total(name: &str) -> u64 {
    let cfg = preset(name).unwrap();
    let g = trace(
        &cfg,
        TraceOptions {
            seq_len: Some(8),
            ..TraceOptions::default()
        },
    )
    .unwrap();
    param_counts(&g).total
}

#[test]
fn published_counts() {
    let expected: &[(&str, u64)] = &[
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
        ("llama3-405b", 405_853_388_800),
        ("llama2-7b", 6_738_415_616),
        ("llama2-13b", 13_015_864_320),
        ("llama2-70b", 68_976_648_192),
        ("mistral-7b", 7_241_732_096),
        ("qwen2-0.5b", 494_032_768),
        // Qwen/Qwen3-8B: 36 x (q 4096x4096, k/v 4096x1024 each, o, 3 x 4096x12288 MLP,
        // 2 x 4096 norms, 2 x 128 q/k norms) + 2 x 151936x4096 (untied) + 4096.
        ("qwen3-8b", 8_190_735_360),
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
    ];
    for &(name, n) in expected {
        assert_eq!(preset(name).unwrap().param_count(), Some(n), "closed form of {name}");
        assert_eq!(traced_total(name), n, "traced graph of {name}");
    }
}

/// Mixtures of experts: the total, and the parameters one token passes through (its
/// `top_k` routed experts, the shared ones, the router, attention, embeddings).
///
/// - Mixtral-8x7B: 32 x (attention 41,943,040 + norms 8,192 + router 8 x 4096 + 8 experts
///   x 3 x 4096 x 14336) + 2 x 32000 x 4096 + 4096 = 46,702,792,704; active with 2
///   experts: 12,879,925,248.
/// - Qwen2-57B-A14B: 28 x (attention with q/k/v biases 29,364,736 + norms 7,168 + router
///   64 x 3584 + shared expert 3 x 3584 x 20480 + its gate 3584 + 64 x 3 x 3584 x 2560)
///   + 2 x 151936 x 3584 + 3584 = 57,408,658,944; active with 8: 14,249,270,784.
/// - Qwen3-30B-A3B: 48 x (attention 18,874,368 + norms 4,096 + q/k norms 256 + router
///   128 x 2048 + 128 x 3 x 2048 x 768) + 2 x 151936 x 2048 + 2048 = 30,532,122,624;
///   active with 8: 3,353,032,704.
/// - Qwen3-235B-A22B: 94 x (attention 71,303,168 + norms 8,192 + q/k norms 256 + router
///   128 x 4096 + 128 x 3 x 4096 x 1536) + 2 x 151936 x 4096 + 4096 = 235,093,634,560;
///   active with 8: 22,190,763,520.
#[test]
fn published_moe_counts_total_and_active() {
    for (name, total, active) in [
        ("mixtral-8x7b", 46_702_792_704u64, 12_879_925_248u64),
        ("qwen2-57b-a14b", 57_408_658_944, 14_249_270_784),
        ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),
        ("qwen3-235b-a22b", 235_093_634_560, 22_190_763_520),
    ] {
        let c = preset(name).unwrap();
        assert!(c.is_moe(), "{name}");
        assert_eq!(c.param_count(), Some(total), "total of {name}");
        assert_eq!(c.active_param_count(), Some(active), "active of {name}");
    }
    // A dense model's every parameter is active.
    let c = preset("qwen3-8b").unwrap();
    assert!(!c.is_moe());
    assert_eq!(c.active_param_count(), c.param_count());
}

/// Which layers have experts: `every` and `first_dense` as Hugging Face's
/// `decoder_sparse_step` and leading `mlp_only_layers`.
#[test]
fn moe_layers_follow_every_and_first_dense() {
    let shardplan_models::ModelConfig::Llama(mut c) = preset("mixtral-8x7b").unwrap() else {
        unreachable!()
    };
    let dense = |c: &shardplan_models::LlamaConfig| {
        shardplan_models::ModelConfig::Llama(shardplan_models::LlamaConfig { moe: None, ..c.clone() })
            .param_count()
            .unwrap()
    };
    let all = dense(&c);
    let per_layer_dense = 3 * 4096 * 14336u64;
    let per_layer_moe = 8 * 3 * 4096 * 14336u64 + 8 * 4096;
    for (every, first_dense, moe_layers) in [(1, 0, 32), (2, 0, 16), (1, 3, 29), (2, 3, 15), (4, 4, 7), (3, 0, 10)] {
        let m = c.moe.as_mut().unwrap();
        m.every = every;
        m.first_dense = first_dense;
        let expected: Vec<u64> = (0..32).filter(|i| *i >= first_dense && (i + 1) % every == 0).collect();
        assert_eq!(expected.len() as u64, moe_layers);
        assert_eq!(c.moe_layers(), moe_layers, "every {every} first_dense {first_dense}");
        let got = shardplan_models::ModelConfig::Llama(c.clone()).param_count().unwrap();
        assert_eq!(got, all - moe_layers * per_layer_dense + moe_layers * per_layer_moe);
    }
}

#[test]
fn closed_form_matches_trace_for_every_preset() {
    // Mixtures of experts included: every routed expert's, router's and shared expert's
    // weights are parameters of the traced graph.
    for name in PRESET_NAMES.iter() {
        assert_eq!(preset(name).unwrap().param_count(), Some(traced_total(name)), "{name}");
    }
}

/// The traced parameters of a mixture of experts follow `every` / `first_dense` and the
/// shared expert and its gate, count for count with the closed form.
#[test]
fn traced_moe_counts_follow_every_first_dense_and_shared_experts() {
    let shardplan_models::ModelConfig::Llama(base) = preset("qwen2-57b-a14b").unwrap() else {
        unreachable!()
    };
    let small = shardplan_models::LlamaConfig {
        vocab_size: 64,
        dim: 16,
        n_layers: 6,
        n_heads: 4,
        n_kv_heads: 2,
        ffn_dim: 24,
        ..base
    };
    for (every, first_dense, shared, gate) in [(1, 0, 1, true), (2, 0, 1, false), (1, 2, 0, false), (3, 1, 2, true)] {
        let mut c = small.clone();
        let m = c.moe.as_mut().unwrap();
        (m.experts, m.top_k, m.expert_ffn_dim) = (4, 2, 8);
        (m.every, m.first_dense, m.shared_experts) = (every, first_dense, shared);
        m.shared_expert_ffn_dim = if shared > 0 { 12 } else { 0 };
        m.shared_expert_gate = gate && shared > 0;
        let cfg = shardplan_models::ModelConfig::Llama(c);
        let g = trace(
            &cfg,
            TraceOptions {
                seq_len: Some(8),
                ..TraceOptions::default()
            },
        )
        .unwrap();
        assert_eq!(
            cfg.param_count(),
            Some(param_counts(&g).total),
            "every {every} first_dense {first_dense} shared {shared} gate {gate}"
        );
    }
}
