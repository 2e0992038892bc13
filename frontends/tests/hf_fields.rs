//! Every key of a Hugging Face config.json is accounted for: honoured, checked against what
//! shardplan implements, or ignored for a stated reason; a key or value that would change
//! the math and is not implemented is refused, naming it.

use shardplan_frontends::{parse_hf_config, Source};
use shardplan_models::ModelConfig;

const LLAMA: &str = r#""architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
  "max_position_embeddings": 512"#;
const MISTRAL: &str = r#""architectures": ["MistralForCausalLM"], "vocab_size": 256, "hidden_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
  "max_position_embeddings": 512"#;
const QWEN2: &str = r#""architectures": ["Qwen2ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
  "max_position_embeddings": 512"#;
const QWEN3: &str = r#""architectures": ["Qwen3ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
  "max_position_embeddings": 512"#;
const GPT2: &str = r#""architectures": ["GPT2LMHeadModel"], "vocab_size": 256, "n_embd": 64, "n_layer": 2,
  "n_head": 4, "n_positions": 128"#;

fn parse(base: &str, extra: &str) -> Result<ModelConfig, String> {
    let text = if extra.is_empty() {
        format!("{{{base}}}")
    } else {
        format!("{{{base},\n  {extra}}}")
    };
    parse_hf_config(&Source::from_text("config.json", text))
        .map(|(c, _)| c)
        .map_err(|e| e.to_string())
}

fn llama(c: ModelConfig) -> shardplan_models::LlamaConfig {
    match c {
        ModelConfig::Llama(l) => l,
        other => panic!("{other:?}"),
    }
}

#[test]
fn math_changing_values_shardplan_does_not_implement_are_refused_by_key() {
    let cases: &[(&str, &str, &[&str])] = &[
        (
            LLAMA,
            r#""rope_scaling": {"rope_type": "longrope", "factor": 4.0}"#,
            &["rope_scaling", "RoPE scaling `longrope` is not implemented"],
        ),
        (
            LLAMA,
            r#""rope_scaling": {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}"#,
            &["partial rotary embedding is not implemented"],
        ),
        (
            LLAMA,
            r#""rope_scaling": {"type": "dynamic", "factor": 2.0}"#,
            &["`dynamic`"],
        ),
        (
            LLAMA,
            r#""rope_parameters": {"rope_type": "longrope", "rope_theta": 500000.0}"#,
            &["rope_parameters", "`longrope`"],
        ),
        (
            LLAMA,
            r#""rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}"#,
            &["`rope_scaling.high_freq_factor` is missing"],
        ),
        (
            LLAMA,
            r#""rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}"#,
            &["must be above low_freq_factor"],
        ),
        (
            LLAMA,
            r#""rope_scaling": {"rope_type": "linear", "factor": -2.0}"#,
            &["`rope_scaling.factor` is -2"],
        ),
        (
            LLAMA,
            r#""rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_parameters": {"rope_type": "linear", "factor": 4.0}"#,
            &["give different RoPE scalings"],
        ),
        (
            LLAMA,
            r#""rope_scaling": {"rope_type": "warp"}"#,
            &["unknown RoPE type `warp`"],
        ),
        (
            LLAMA,
            r#""hidden_act": "mish""#,
            &[
                "hidden_act",
                "an activation shardplan does not implement",
                "silu, gelu, gelu_new",
            ],
        ),
        (MISTRAL, r#""hidden_act": "quick_gelu""#, &["hidden_act"]),
        (LLAMA, r#""attention_bias": true"#, &["attention_bias"]),
        (LLAMA, r#""mlp_bias": true"#, &["mlp_bias"]),
        (GPT2, r#""activation_function": "tanh""#, &["activation_function"]),
        (GPT2, r#""activation_function": 3"#, &["activation_function"]),
        (
            GPT2,
            r#""scale_attn_by_inverse_layer_idx": true"#,
            &["scale_attn_by_inverse_layer_idx"],
        ),
        (GPT2, r#""scale_attn_weights": false"#, &["scale_attn_weights"]),
        (
            GPT2,
            r#""tie_word_embeddings": false"#,
            &["tie_word_embeddings", "its own weights"],
        ),
        (GPT2, r#""add_cross_attention": true"#, &["cross-attention"]),
        (
            LLAMA,
            r#""quantization_config": {"quant_method": "gptq"}"#,
            &["unknown LlamaForCausalLM config key `quantization_config`"],
        ),
        (
            QWEN2,
            r#""use_sliding_window": "yes""#,
            &["use_sliding_window", "expected a boolean"],
        ),
        (MISTRAL, r#""sliding_window": 0"#, &["`sliding_window` is 0"]),
        (MISTRAL, r#""sliding_window": -4"#, &["sliding_window", "expected u64"]),
        (
            LLAMA,
            r#""rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}"#,
            &["`rope_theta` is 10000 but `rope_parameters.rope_theta` is 500000"],
        ),
        (
            LLAMA,
            r#""rope_parameters": {"rope_type": "default", "rope_theta": "big"}"#,
            &["not a positive number"],
        ),
    ];
    for (base, extra, want) in cases {
        let e = parse(base, extra).expect_err(extra);
        assert!(e.contains("config.json"), "{extra}: {e}");
        for w in *want {
            assert!(e.contains(w), "{extra}: {e}");
        }
    }
}

#[test]
fn what_shardplan_implements_or_cannot_change_the_math_is_accepted() {
    for (base, extra) in [
        (
            LLAMA,
            r#""hidden_act": "silu", "rope_scaling": null, "attention_bias": false, "mlp_bias": false"#,
        ),
        (
            LLAMA,
            r#""rope_scaling": {"rope_type": "default"}, "torch_dtype": "bfloat16", "bos_token_id": 1"#,
        ),
        (
            LLAMA,
            r#""attention_dropout": 0.1, "initializer_range": 0.02, "use_cache": true, "pretraining_tp": 1"#,
        ),
        (
            LLAMA,
            r#""transformers_version": "4.57.0", "_attn_implementation": "sdpa", "id2label": {"0": "a"}"#,
        ),
        (
            GPT2,
            r#""activation_function": "gelu_new", "attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1"#,
        ),
        (
            GPT2,
            r#""activation_function": "gelu_pytorch_tanh", "scale_attn_weights": true, "n_ctx": 128"#,
        ),
        (
            GPT2,
            r#""scale_attn_by_inverse_layer_idx": false, "reorder_and_upcast_attn": true, "summary_type": "cls_index""#,
        ),
        (
            QWEN2,
            r#""use_sliding_window": false, "sliding_window": 32, "max_window_layers": 1"#,
        ),
    ] {
        parse(base, extra).unwrap_or_else(|e| panic!("{extra}: {e}"));
    }
}

#[test]
fn qwen3_has_per_head_qk_norms_and_head_dim_128_unless_given() {
    let c = llama(parse(QWEN3, "").unwrap());
    assert!(c.qk_norm && !c.qkv_bias);
    // transformers' Qwen3Config default, not hidden_size / num_attention_heads = 16.
    assert_eq!(c.head_dim, Some(128));
    assert_eq!(c.norm_eps, 1e-6);
    let c = llama(parse(QWEN3, r#""head_dim": 32, "rms_norm_eps": 1e-5"#).unwrap());
    assert_eq!((c.head_dim, c.norm_eps), (Some(32), 1e-5));
    // The model_type alone names it too.
    let by_type = QWEN3.replace(r#""architectures": ["Qwen3ForCausalLM"]"#, r#""model_type": "qwen3""#);
    assert!(llama(parse(&by_type, "").unwrap()).qk_norm);
    // Only Qwen3 normalises queries and keys.
    assert!(!llama(parse(QWEN2, "").unwrap()).qk_norm);
    assert!(!llama(parse(LLAMA, r#""head_dim": 32"#).unwrap()).qk_norm);
    // Qwen3's window applies only with use_sliding_window, as Qwen2's.
    let c = llama(parse(QWEN3, r#""use_sliding_window": false, "sliding_window": 64"#).unwrap());
    assert_eq!(c.max_seq_len, 512);
    let c = llama(parse(QWEN3, r#""use_sliding_window": true, "sliding_window": 64"#).unwrap());
    assert_eq!(c.max_seq_len, 64);
    // Its attention bias covers o_proj as well: refused as Llama's is.
    let e = parse(QWEN3, r#""attention_bias": true"#).unwrap_err();
    assert!(e.contains("attention_bias"), "{e}");
    let e = parse(QWEN3, r#""head_dim": 0"#).unwrap_err();
    assert!(e.contains("head_dim"), "{e}");
}

const QWEN3_MOE: &str = r#""architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "hidden_size": 64,
  "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
  "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32"#;

#[test]
fn moe_keys_map_onto_the_moe_feed_forward() {
    use shardplan_models::Router;
    let c = llama(parse(QWEN3_MOE, "").unwrap());
    let m = c.moe.unwrap();
    assert!(c.qk_norm && !c.qkv_bias);
    assert_eq!((m.experts, m.top_k, m.expert_ffn_dim), (8, 2, 32));
    assert_eq!((m.shared_experts, m.shared_expert_gate), (0, false));
    assert_eq!((m.router, m.every, m.first_dense), (Router::SoftmaxTopk, 1, 0));
    // transformers' defaults: no renormalisation, and no aux loss unless the router's
    // logits are output (then router_aux_loss_coef, default 0.001).
    assert!(!m.norm_topk_prob);
    assert_eq!(m.aux_loss_coef, 0.0);
    let m = llama(parse(QWEN3_MOE, r#""output_router_logits": true"#).unwrap())
        .moe
        .unwrap();
    assert_eq!(m.aux_loss_coef, 0.001);
    let m = llama(
        parse(
            QWEN3_MOE,
            r#""output_router_logits": true, "router_aux_loss_coef": 0.02, "norm_topk_prob": true"#,
        )
        .unwrap(),
    )
    .moe
    .unwrap();
    assert_eq!(m.aux_loss_coef, 0.02);
    assert!(m.norm_topk_prob);
    let m = llama(parse(QWEN3_MOE, r#""decoder_sparse_step": 2, "mlp_only_layers": [0, 1]"#).unwrap())
        .moe
        .unwrap();
    assert_eq!((m.every, m.first_dense, m.layers_of(4)), (2, 2, 1));
    // Dense layers anywhere (Qwen3-MoE's mlp_only_layers): a leading run and the rest.
    let six = QWEN3_MOE.replace(r#""num_hidden_layers": 4"#, r#""num_hidden_layers": 6"#);
    let m = llama(parse(&six, r#""mlp_only_layers": [4, 0, 2]"#).unwrap())
        .moe
        .unwrap();
    assert_eq!((m.first_dense, m.dense_layers.layers()), (1, vec![2, 4]));
    let moe: Vec<u64> = (0..6).filter(|&i| m.is_moe_layer(i)).collect();
    assert_eq!((moe, m.layers_of(6)), (vec![1, 3, 5], 3));
    // Qwen2-MoE: q/k/v biases unless qkv_bias is false, one gated shared expert.
    let qwen2 = QWEN3_MOE.replace("Qwen3Moe", "Qwen2Moe");
    let c = llama(parse(&qwen2, r#""shared_expert_intermediate_size": 96"#).unwrap());
    let m = c.moe.unwrap();
    assert!(c.qkv_bias && !c.qk_norm);
    assert_eq!(
        (m.shared_experts, m.shared_expert_ffn_dim, m.shared_expert_gate),
        (1, 96, true)
    );
    let c = llama(parse(&qwen2, r#""shared_expert_intermediate_size": 96, "qkv_bias": false"#).unwrap());
    assert!(!c.qkv_bias);
    // Mixtral: experts as wide as intermediate_size, scores always renormalised, a
    // sliding window as Mistral's.
    let mixtral = r#""architectures": ["MixtralForCausalLM"], "vocab_size": 256, "hidden_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
  "max_position_embeddings": 512, "num_local_experts": 4, "num_experts_per_tok": 2"#;
    let c = llama(parse(mixtral, r#""sliding_window": 64, "router_jitter_noise": 0.0"#).unwrap());
    let m = c.moe.unwrap();
    assert_eq!((m.experts, m.expert_ffn_dim, m.norm_topk_prob), (4, 128, true));
    assert_eq!(c.max_seq_len, 64);
    // The dense families have no experts.
    assert!(llama(parse(QWEN3, "").unwrap()).moe.is_none());
}

#[test]
fn llama3_and_linear_rope_scaling_are_read_from_either_layout() {
    use shardplan_models::RopeScaling;
    let c = llama(
        parse(
            LLAMA,
            r#""rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}"#,
        )
        .unwrap(),
    );
    assert_eq!(
        c.rope_scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        }
    );
    let c = llama(
        parse(
            LLAMA,
            r#""rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}"#,
        )
        .unwrap(),
    );
    assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 2.0 });
    let c = llama(parse(LLAMA, r#""rope_scaling": {"type": "linear", "factor": 4.0}"#).unwrap());
    assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 4.0 });
    assert_eq!(llama(parse(LLAMA, "").unwrap()).rope_scaling, RopeScaling::Default);
}

#[test]
fn every_implemented_activation_is_honoured() {
    use shardplan_models::Activation;
    for (name, want) in [
        ("silu", Activation::Silu),
        ("gelu", Activation::Gelu),
        ("gelu_new", Activation::GeluTanh),
        ("gelu_pytorch_tanh", Activation::GeluTanh),
        ("relu", Activation::Relu),
    ] {
        let c = llama(parse(LLAMA, &format!("\"hidden_act\": \"{name}\"")).unwrap());
        assert_eq!(c.activation, Some(want), "{name}");
        match parse(GPT2, &format!("\"activation_function\": \"{name}\"")).unwrap() {
            ModelConfig::Gpt2(g) => assert_eq!(g.activation, Some(want), "{name}"),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn rope_theta_is_read_from_either_layout() {
    let c = llama(
        parse(
            LLAMA,
            r#""rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}"#,
        )
        .unwrap(),
    );
    assert_eq!(
        c.rope_theta, 500000.0,
        "transformers 5 keeps rope_theta in rope_parameters"
    );
    let c = llama(parse(LLAMA, r#""rope_theta": 250000.0"#).unwrap());
    assert_eq!(c.rope_theta, 250000.0);
    let c = llama(parse(LLAMA, "").unwrap());
    assert_eq!(c.rope_theta, 10000.0);
}

#[test]
fn a_sliding_window_bounds_the_sequences_trained() {
    // Within the window, the banded mask is the causal mask: the window caps the context.
    let c = llama(parse(MISTRAL, r#""sliding_window": 128"#).unwrap());
    assert_eq!(c.max_seq_len, 128);
    let c = llama(parse(MISTRAL, r#""sliding_window": 4096"#).unwrap());
    assert_eq!(c.max_seq_len, 512, "a window longer than the context changes nothing");
    let c = llama(parse(MISTRAL, r#""sliding_window": null"#).unwrap());
    assert_eq!(c.max_seq_len, 512);
    // Qwen2 applies its window only when use_sliding_window is true.
    let c = llama(parse(QWEN2, r#""use_sliding_window": false, "sliding_window": 64"#).unwrap());
    assert_eq!(c.max_seq_len, 512);
    let c = llama(parse(QWEN2, r#""use_sliding_window": true, "sliding_window": 64"#).unwrap());
    assert_eq!(c.max_seq_len, 64);
}

#[test]
fn every_bundled_config_parses_and_the_table_covers_every_key_it_holds() {
    for f in [
        "gpt2",
        "llama3-8b",
        "mistral-7b",
        "qwen2-0.5b",
        "qwen3-8b",
        "mixtral-8x7b",
        "qwen2-57b-a14b",
        "qwen3-30b-a3b",
    ] {
        let path = format!("{}/../examples/models/{f}.config.json", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap();
        parse_hf_config(&Source::from_text(&path, text.clone())).unwrap_or_else(|e| panic!("{f}: {e}"));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let arch = v["architectures"][0].as_str().unwrap();
        let table = shardplan_frontends::hf_field_table(arch);
        for key in v.as_object().unwrap().keys() {
            assert!(table.iter().any(|(k, _)| k == key), "{f}: {key} is not in the table");
        }
    }
}
