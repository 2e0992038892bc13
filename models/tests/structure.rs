//! What the builders promise beyond parameter counts: HF names, scopes, dtypes, shapes
//! from the trace options, and clear errors for shapes the model cannot take.

use shardplan_ir::{DType, ModuleKind, Op};
use shardplan_models::{preset, trace, ModelConfig, TraceError, TraceOptions};

#[test]
fn llama_parameter_names_match_hf_checkpoints() {
    let g = trace(&preset("tiny-llama").unwrap(), TraceOptions::default()).unwrap();
    let names: Vec<&str> = g.params().map(|(_, p)| &*p.name).collect();
    for expected in [
        "model.embed_tokens.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ] {
        assert!(names.contains(&expected), "{expected} missing from {names:?}");
    }
    // GQA: k_proj is [n_kv_heads * head_dim, dim] = [2 * 16, 64].
    let k = g
        .params()
        .find(|(_, p)| &*p.name == "model.layers.0.self_attn.k_proj.weight")
        .unwrap()
        .1;
    assert_eq!(k.ty.shape.dims(), &[32, 64]);
    assert_eq!(g.scope(k.scope).path, "layers.0.attention");
    assert_eq!(g.scope(k.scope).kind, ModuleKind::Attention);
}

#[test]
fn gpt2_names_and_tied_head() {
    let g = trace(
        &preset("gpt2").unwrap(),
        TraceOptions {
            seq_len: Some(16),
            ..TraceOptions::default()
        },
    )
    .unwrap();
    let c_attn = g
        .params()
        .find(|(_, p)| &*p.name == "transformer.h.3.attn.c_attn.weight")
        .unwrap()
        .1;
    assert_eq!(c_attn.ty.shape.dims(), &[768, 2304], "Conv1D stores [in, out]");
    assert!(
        g.params().all(|(_, p)| &*p.name != "lm_head.weight"),
        "GPT-2's head is tied"
    );
    let wte = g
        .params()
        .find(|(_, p)| &*p.name == "transformer.wte.weight")
        .unwrap()
        .1
        .node;
    assert_eq!(
        g.users(wte).len(),
        2,
        "the token table feeds the embedding and the head"
    );
}

#[test]
fn qwen2_has_qkv_biases_and_ties() {
    let g = trace(
        &preset("qwen2-0.5b").unwrap(),
        TraceOptions {
            seq_len: Some(4),
            ..TraceOptions::default()
        },
    )
    .unwrap();
    let names: Vec<&str> = g.params().map(|(_, p)| &*p.name).collect();
    assert!(names.contains(&"model.layers.0.self_attn.q_proj.bias"));
    assert!(!names.contains(&"model.layers.0.self_attn.o_proj.bias"));
    assert!(!names.contains(&"lm_head.weight"));
}

#[test]
fn qwen3_normalises_each_head_before_rotary() {
    let g = trace(&preset("tiny-qwen3").unwrap(), TraceOptions::default()).unwrap();
    for name in ["q_norm", "k_norm"] {
        let (id, p) = g
            .params()
            .find(|(_, p)| *p.name == *format!("model.layers.1.self_attn.{name}.weight"))
            .unwrap_or_else(|| panic!("{name} missing"));
        // head_dim 32 is set apart from dim / n_heads = 16.
        assert_eq!(p.ty.shape.dims(), &[32]);
        assert_eq!(g.scope(p.scope).path, format!("layers.1.attention.{name}"));
        assert_eq!(g.scope(p.scope).kind, ModuleKind::Norm);
        // The norm reads [b, s, heads, head_dim] and feeds rotary.
        let param_node = g.param(id).node;
        let (norm, node) = g
            .nodes()
            .find(|(_, n)| matches!(n.op, Op::RmsNorm { .. }) && n.inputs.contains(&param_node))
            .unwrap();
        let heads = if name == "q_norm" { 4 } else { 2 };
        assert_eq!(node.ty.shape.dims(), &[1, 128, heads, 32]);
        assert!(
            g.nodes()
                .any(|(_, n)| matches!(n.op, Op::Rope { .. }) && n.inputs.as_slice() == [norm]),
            "{name} does not feed rope"
        );
    }
    // q_proj is [n_heads * head_dim, dim] = [128, 64].
    let q = g
        .params()
        .find(|(_, p)| &*p.name == "model.layers.0.self_attn.q_proj.weight")
        .unwrap()
        .1;
    assert_eq!(q.ty.shape.dims(), &[128, 64]);
    // Without qk_norm the Llama builder makes no such weights.
    let llama = trace(&preset("tiny-llama").unwrap(), TraceOptions::default()).unwrap();
    assert!(!llama
        .params()
        .any(|(_, p)| p.name.contains("_norm.weight") && p.name.contains("self_attn")));
}

#[test]
fn trace_options_set_shapes_and_dtype() {
    let opts = TraceOptions {
        batch: 3,
        seq_len: Some(5),
        dtype: DType::BF16,
        ..Default::default()
    };
    let g = trace(&preset("tiny-llama").unwrap(), opts).unwrap();
    assert_eq!(g.node(g.inputs()[0]).ty.to_string(), "u32[3,5]");
    assert!(g.params().all(|(_, p)| p.ty.dtype == DType::BF16));
    let loss = g.node(g.outputs()[0]);
    assert_eq!(loss.ty.to_string(), "f32[]");
    assert!(matches!(loss.op, Op::CrossEntropy));
    // The default sequence is the model's context, capped at 8192.
    let g = trace(&preset("llama3-8b").unwrap(), TraceOptions::default()).unwrap();
    assert_eq!(g.node(g.inputs()[0]).ty.to_string(), "u32[1,8192]");
}

#[test]
fn bad_shapes_are_errors() {
    let gpt2 = preset("tiny-gpt2").unwrap();
    let e = trace(
        &gpt2,
        TraceOptions {
            seq_len: Some(129),
            ..TraceOptions::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            TraceError::Shape {
                field: "batch.seq_len",
                ..
            }
        ),
        "{e}"
    );
    let e = trace(
        &gpt2,
        TraceOptions {
            dtype: DType::U32,
            ..TraceOptions::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("float dtype"), "{e}");
    let e = trace(
        &gpt2,
        TraceOptions {
            batch: 0,
            ..TraceOptions::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            TraceError::Shape {
                field: "batch.per_rank",
                ..
            }
        ),
        "{e}"
    );
    // Activations too large for u64 bytes: caught by the IR, not a panic.
    let ModelConfig::Llama(mut c) = preset("tiny-llama").unwrap() else {
        unreachable!()
    };
    c.max_seq_len = u64::MAX;
    let e = trace(
        &ModelConfig::Llama(c),
        TraceOptions {
            batch: u64::MAX / 4,
            seq_len: Some(u64::MAX / 4),
            ..TraceOptions::default()
        },
    )
    .unwrap_err();
    assert!(matches!(e, TraceError::Ir(_)), "{e}");
}

#[test]
fn validation_names_the_field() {
    let ModelConfig::Llama(base) = preset("tiny-llama").unwrap() else {
        unreachable!()
    };
    type Mutation = Box<dyn Fn(&mut shardplan_models::LlamaConfig)>;
    let cases: Vec<(Mutation, &str, &str)> = vec![
        (Box::new(|c| c.dim = 0), "dim", "at least 1"),
        (Box::new(|c| c.n_heads = 5), "n_heads", "does not divide dim"),
        (Box::new(|c| c.n_kv_heads = 3), "n_kv_heads", "does not divide n_heads"),
        (Box::new(|c| c.n_layers = 1_000_000), "n_layers", "more than"),
        (Box::new(|c| c.norm_eps = f64::NAN), "norm_eps", "finite"),
        (Box::new(|c| c.vocab_size = u64::MAX / 2), "vocab_size", "overflow u64"),
        (Box::new(|c| c.head_dim = Some(7)), "head_dim", "even"),
    ];
    for (mutate, field, text) in cases {
        let mut c = base.clone();
        mutate(&mut c);
        let e = ModelConfig::Llama(c).validate().unwrap_err();
        assert_eq!(e.field, field, "{e}");
        assert!(e.message.contains(text), "{e}");
    }
}

fn seq8() -> TraceOptions {
    TraceOptions {
        seq_len: Some(8),
        ..TraceOptions::default()
    }
}

/// A small copy of an MoE preset: its names, router and shared experts, tiny widths.
fn tiny_moe(name: &str, aux_loss_coef: f64) -> ModelConfig {
    let ModelConfig::Llama(c) = preset(name).unwrap() else {
        unreachable!()
    };
    let mut c = shardplan_models::LlamaConfig {
        vocab_size: 64,
        dim: 16,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: None,
        ffn_dim: 24,
        ..c
    };
    let m = c.moe.as_mut().unwrap();
    (m.experts, m.top_k, m.expert_ffn_dim, m.aux_loss_coef) = (4, 2, 8, aux_loss_coef);
    if m.shared_experts > 0 {
        m.shared_expert_ffn_dim = 12;
    }
    ModelConfig::Llama(c)
}

#[test]
fn moe_parameter_names_match_hf_checkpoints() {
    for (name, expected) in [
        (
            "mixtral-8x7b",
            &[
                "model.layers.1.block_sparse_moe.gate.weight",
                "model.layers.1.block_sparse_moe.experts.0.w1.weight",
                "model.layers.1.block_sparse_moe.experts.3.w2.weight",
                "model.layers.1.block_sparse_moe.experts.2.w3.weight",
            ][..],
        ),
        (
            "qwen2-57b-a14b",
            &[
                "model.layers.0.mlp.gate.weight",
                "model.layers.0.mlp.experts.3.gate_proj.weight",
                "model.layers.0.mlp.experts.0.up_proj.weight",
                "model.layers.0.mlp.experts.1.down_proj.weight",
                "model.layers.0.mlp.shared_expert.gate_proj.weight",
                "model.layers.0.mlp.shared_expert.up_proj.weight",
                "model.layers.0.mlp.shared_expert.down_proj.weight",
                "model.layers.0.mlp.shared_expert_gate.weight",
            ][..],
        ),
        (
            "qwen3-30b-a3b",
            &[
                "model.layers.1.mlp.gate.weight",
                "model.layers.1.mlp.experts.3.down_proj.weight",
                "model.layers.1.self_attn.q_norm.weight",
            ][..],
        ),
    ] {
        let g = trace(&tiny_moe(name, 0.0), seq8()).unwrap();
        let names: Vec<&str> = g.params().map(|(_, p)| &*p.name).collect();
        for e in expected {
            assert!(names.contains(e), "{name}: {e} missing from {names:?}");
        }
        assert!(!names.iter().any(|n| n.contains(".mlp.gate_proj")), "{name}: {names:?}");
        let shape = |n: &str| {
            g.params()
                .find(|(_, p)| &*p.name == n)
                .unwrap()
                .1
                .ty
                .shape
                .dims()
                .to_vec()
        };
        assert_eq!(shape(expected[0]), [4, 16], "{name}: the router is [experts, dim]");
        // Without the load-balancing loss the loss is the cross-entropy alone.
        let loss = g.node(g.outputs()[0]);
        assert_eq!(loss.op, Op::CrossEntropy, "{name}");
    }
}

#[test]
fn moe_aux_loss_adds_into_the_loss_over_every_moe_layer() {
    let g = trace(&tiny_moe("qwen3-30b-a3b", 0.001), seq8()).unwrap();
    let loss = g.node(g.outputs()[0]);
    assert_eq!(loss.op, Op::Add);
    let aux = g.node(loss.inputs[1]);
    assert_eq!(aux.op, Op::MoeAuxLoss { top_k: 2, coef: 0.001 });
    assert_eq!(aux.inputs.len(), 2, "one logits operand per MoE layer");
    for &l in &aux.inputs {
        assert_eq!(g.node(l).ty.to_string(), "f32[8,4]");
    }
}

fn tp(degree: u64, sequence_parallel: bool) -> TraceOptions {
    TraceOptions {
        tensor: shardplan_models::TensorOptions {
            degree,
            sequence_parallel,
            ..Default::default()
        },
        ..seq8()
    }
}

#[test]
fn moe_under_tensor_parallelism_splits_every_expert_as_the_dense_feed_forward() {
    for name in ["mixtral-8x7b", "qwen2-57b-a14b", "qwen3-30b-a3b"] {
        let m = tiny_moe(name, 0.001);
        let whole = m.param_count().unwrap();
        for sp in [true, false] {
            let g = trace(&m, tp(2, sp)).unwrap_or_else(|e| panic!("{name}: {e}"));
            // Every tensor rank's slices together are the whole model.
            let total: u64 = g.params().map(|(_, p)| p.whole_numel()).sum();
            assert_eq!(total, whole, "{name} sp {sp}");
            for (_, p) in g.params() {
                let dims = p.ty.shape.dims();
                let split = p.tensor.map(|s| (s.dim, s.degree));
                if p.name.contains(".experts.") || p.name.contains(".shared_expert.") {
                    // Gate and up by hidden unit (rows), down by hidden unit (columns).
                    let want = if p.name.contains("down_proj") || p.name.ends_with(".w2.weight") {
                        (1, dims[1])
                    } else {
                        (0, dims[0])
                    };
                    assert_eq!(split, Some((want.0, 2)), "{name}: {}", p.name);
                } else if p.name.ends_with(".gate.weight") || p.name.ends_with("shared_expert_gate.weight") {
                    assert_eq!(
                        split, None,
                        "{name}: the router and the shared gate are whole: {}",
                        p.name
                    );
                }
            }
            // The router's logits are every token's on every rank (gathered under sequence
            // parallelism), so the routing is the same on each.
            let loss = g.node(g.outputs()[0]);
            let aux = g.node(loss.inputs[1]);
            for &l in &aux.inputs {
                assert_eq!(g.node(l).ty.to_string(), "f32[8,4]", "{name} sp {sp}");
            }
        }
    }
}

#[test]
fn moe_under_tensor_parallelism_needs_expert_widths_that_split() {
    // tiny_moe's expert width 8 does not split over 3.
    let mut m = tiny_moe("qwen3-30b-a3b", 0.0);
    let ModelConfig::Llama(c) = &mut m else { unreachable!() };
    (c.n_heads, c.n_kv_heads, c.head_dim) = (6, 3, Some(4));
    let e = trace(&m, tp(3, false)).unwrap_err();
    let TraceError::Shape { field, message, .. } = e else {
        panic!("{e:?}")
    };
    assert_eq!(field, "mesh.tensor");
    assert!(message.contains("expert_ffn_dim of 8"), "{message}");
}
