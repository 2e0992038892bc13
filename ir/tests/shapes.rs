//! Shape inference: one passing and one failing case per op; failures must name the op,
//! the scope and the operand shapes.

use shardplan_ir::{DType, Graph, IrError, ModuleKind, Op, Shape, TensorType, WeightLayout};

const F: DType = DType::F32;

/// Applies `op` to fresh inputs of the given types inside scope `layers.3.attention`.
fn apply(op: Op, operands: &[(DType, &[u64])]) -> Result<TensorType, IrError> {
    let mut g = Graph::new("t");
    let block = g.add_scope(g.root(), "layers.3", ModuleKind::Block);
    let scope = g.add_scope(block, "attention", ModuleKind::Attention);
    let ins: Vec<_> = operands
        .iter()
        .enumerate()
        .map(|(i, (d, dims))| {
            g.add_input(&format!("x{i}"), TensorType::new(*d, dims.to_vec()), scope)
                .unwrap()
        })
        .collect();
    let id = g.add_node(op, &ins, scope)?;
    Ok(g.node(id).ty.clone())
}

fn ok(op: Op, operands: &[(DType, &[u64])]) -> String {
    apply(op, operands).unwrap().to_string()
}

/// The error message, checked to name op, scope and every operand type.
fn err(op: Op, operands: &[(DType, &[u64])]) -> String {
    let name = op.name();
    let e = apply(op, operands).unwrap_err().to_string();
    assert!(e.contains(&format!("`{name}`")), "op missing in: {e}");
    assert!(e.contains("layers.3.attention"), "scope missing in: {e}");
    for (d, dims) in operands {
        let ty = TensorType::new(*d, dims.to_vec()).to_string();
        assert!(e.contains(&ty), "operand {ty} missing in: {e}");
    }
    e
}

#[test]
fn embedding() {
    assert_eq!(
        ok(Op::Embedding, &[(F, &[100, 16]), (DType::U32, &[2, 8])]),
        "f32[2,8,16]"
    );
    let e = err(Op::Embedding, &[(F, &[100, 16]), (F, &[2, 8])]);
    assert!(e.contains("ids must be an integer tensor"), "{e}");
    let e = err(Op::Embedding, &[(F, &[100]), (DType::I64, &[2, 8])]);
    assert!(e.contains("table must be [vocab, dim]"), "{e}");
}

#[test]
fn linear() {
    let out_in = Op::Linear {
        bias: false,
        layout: WeightLayout::OutIn,
        float8: None,
    };
    let in_out_bias = Op::Linear {
        bias: true,
        layout: WeightLayout::InOut,
        float8: None,
    };
    assert_eq!(ok(out_in.clone(), &[(F, &[2, 8, 64]), (F, &[32, 64])]), "f32[2,8,32]");
    assert_eq!(
        ok(in_out_bias.clone(), &[(F, &[2, 8, 64]), (F, &[64, 192]), (F, &[192])]),
        "f32[2,8,192]"
    );
    let e = err(out_in, &[(F, &[2, 8, 64]), (F, &[32, 48])]);
    assert!(
        e.contains("input features 64") && e.contains("input features 48"),
        "{e}"
    );
    let e = err(in_out_bias, &[(F, &[2, 8, 64]), (F, &[64, 192]), (F, &[64])]);
    assert!(e.contains("bias must be [192]"), "{e}");
}

#[test]
fn matmul() {
    assert_eq!(ok(Op::MatMul, &[(F, &[4, 1, 8, 16]), (F, &[3, 16, 5])]), "f32[4,3,8,5]");
    let e = err(Op::MatMul, &[(F, &[8, 16]), (F, &[17, 5])]);
    assert!(e.contains("inner dims differ"), "{e}");
    let e = err(Op::MatMul, &[(F, &[2, 8, 16]), (F, &[3, 16, 5])]);
    assert!(e.contains("do not broadcast"), "{e}");
}

#[test]
fn add_and_mul_broadcast() {
    assert_eq!(ok(Op::Add, &[(F, &[2, 8, 64]), (F, &[8, 64])]), "f32[2,8,64]");
    assert_eq!(ok(Op::Mul, &[(F, &[2, 1, 64]), (F, &[1, 8, 1])]), "f32[2,8,64]");
    let e = err(Op::Add, &[(F, &[2, 8, 64]), (F, &[7, 64])]);
    assert!(e.contains("[2,8,64] and [7,64] do not broadcast"), "{e}");
    let e = err(Op::Mul, &[(F, &[4]), (DType::BF16, &[4])]);
    assert!(e.contains("dtypes differ (f32 vs bf16)"), "{e}");
}

#[test]
fn norms() {
    assert_eq!(
        ok(Op::RmsNorm { eps: 1e-5 }, &[(F, &[2, 8, 64]), (F, &[64])]),
        "f32[2,8,64]"
    );
    assert_eq!(
        ok(Op::LayerNorm { eps: 1e-5 }, &[(F, &[2, 8, 64]), (F, &[64]), (F, &[64])]),
        "f32[2,8,64]"
    );
    let e = err(Op::RmsNorm { eps: 1e-5 }, &[(F, &[2, 8, 64]), (F, &[32])]);
    assert!(e.contains("weight must be [64]"), "{e}");
    let e = err(Op::LayerNorm { eps: 1e-5 }, &[(F, &[2, 8, 64]), (F, &[64]), (F, &[63])]);
    assert!(e.contains("bias must be [64]"), "{e}");
}

#[test]
fn rope() {
    assert_eq!(
        ok(
            Op::Rope {
                theta: 1e4,
                scaling: Default::default(),
                context: None
            },
            &[(F, &[2, 8, 4, 16])]
        ),
        "f32[2,8,4,16]"
    );
    let e = err(
        Op::Rope {
            theta: 1e4,
            scaling: Default::default(),
            context: None,
        },
        &[(F, &[2, 8, 4, 15])],
    );
    assert!(e.contains("head_dim 15 must be even"), "{e}");
    let e = err(
        Op::Rope {
            theta: 1e4,
            scaling: Default::default(),
            context: None,
        },
        &[(F, &[8, 4, 16])],
    );
    assert!(e.contains("[batch, seq, heads, head_dim]"), "{e}");
}

#[test]
fn attention_with_grouped_query_heads() {
    let att = Op::Attention {
        causal: true,
        context: None,
    };
    assert_eq!(
        ok(
            att.clone(),
            &[(F, &[2, 8, 8, 16]), (F, &[2, 8, 2, 16]), (F, &[2, 8, 2, 16])]
        ),
        "f32[2,8,8,16]"
    );
    let e = err(
        att.clone(),
        &[(F, &[2, 8, 8, 16]), (F, &[2, 8, 3, 16]), (F, &[2, 8, 3, 16])],
    );
    assert!(
        e.contains("query heads 8 are not a multiple of key/value heads 3"),
        "{e}"
    );
    let e = err(att, &[(F, &[2, 8, 8, 16]), (F, &[2, 8, 2, 16]), (F, &[2, 8, 2, 8])]);
    assert!(e.contains("same shape"), "{e}");
}

#[test]
fn activations_and_softmax() {
    assert_eq!(ok(Op::Silu, &[(DType::BF16, &[3, 5])]), "bf16[3,5]");
    assert_eq!(ok(Op::Gelu, &[(F, &[3, 5])]), "f32[3,5]");
    assert_eq!(ok(Op::Softmax { dim: 1 }, &[(F, &[3, 5])]), "f32[3,5]");
    let e = err(Op::Silu, &[(DType::U32, &[3])]);
    assert!(e.contains("must be a float tensor"), "{e}");
    let e = err(Op::Softmax { dim: 2 }, &[(F, &[3, 5])]);
    assert!(e.contains("dim 2 is out of range"), "{e}");
}

#[test]
fn cross_entropy() {
    assert_eq!(ok(Op::CrossEntropy, &[(F, &[16, 100]), (DType::U32, &[16])]), "f32[]");
    assert_eq!(
        ok(Op::CrossEntropy, &[(DType::BF16, &[16, 100]), (DType::I64, &[16])]),
        "f32[]"
    );
    let e = err(Op::CrossEntropy, &[(F, &[16, 100]), (DType::U32, &[15])]);
    assert!(e.contains("logits must be [n, vocab] and targets [n]"), "{e}");
}

#[test]
fn reshape_transpose_narrow_concat_cast() {
    assert_eq!(
        ok(
            Op::Reshape {
                shape: Shape::new([16, 64])
            },
            &[(F, &[2, 8, 64])]
        ),
        "f32[16,64]"
    );
    let e = err(
        Op::Reshape {
            shape: Shape::new([15, 64]),
        },
        &[(F, &[2, 8, 64])],
    );
    assert!(e.contains("1024 elements") && e.contains("960 elements"), "{e}");

    assert_eq!(
        ok(Op::Transpose { dim0: 0, dim1: 2 }, &[(F, &[2, 8, 64])]),
        "f32[64,8,2]"
    );
    let e = err(Op::Transpose { dim0: 0, dim1: 3 }, &[(F, &[2, 8, 64])]);
    assert!(e.contains("dim 3 is out of range"), "{e}");

    assert_eq!(
        ok(
            Op::Narrow {
                dim: 2,
                start: 64,
                len: 64
            },
            &[(F, &[2, 8, 192])]
        ),
        "f32[2,8,64]"
    );
    let e = err(
        Op::Narrow {
            dim: 2,
            start: 160,
            len: 64,
        },
        &[(F, &[2, 8, 192])],
    );
    assert!(e.contains("outside dim 2 of size 192"), "{e}");

    assert_eq!(
        ok(Op::Concat { dim: 1 }, &[(F, &[2, 3]), (F, &[2, 5]), (F, &[2, 1])]),
        "f32[2,9]"
    );
    let e = err(Op::Concat { dim: 1 }, &[(F, &[2, 3]), (F, &[3, 5])]);
    assert!(e.contains("differ outside concat dim 1"), "{e}");

    assert_eq!(ok(Op::Cast { dtype: DType::BF16 }, &[(F, &[2, 3])]), "bf16[2,3]");
    let e = err(Op::Cast { dtype: DType::BF16 }, &[(F, &[2, 3]), (F, &[2, 3])]);
    assert!(e.contains("expects 1 operand(s), got 2"), "{e}");
}

#[test]
fn overflowing_sizes_are_errors_not_panics() {
    let mut g = Graph::new("t");
    let root = g.root();
    let e = g
        .add_param("w", TensorType::new(F, [u64::MAX / 2, 3]), root)
        .unwrap_err();
    assert!(matches!(e, IrError::Overflow { .. }), "{e}");
    assert!(e.to_string().contains("overflow u64"), "{e}");
    // A result that overflows: [2^31, 2^31] @ [2^31, 2^31] -> 2^62 elements of 4 bytes.
    let big = 1u64 << 31;
    let a = g.add_input("a", TensorType::new(F, [big, 1]), root).unwrap();
    let b = g.add_input("b", TensorType::new(F, [1, big]), root).unwrap();
    let e = g.add_node(Op::MatMul, &[a, b], root).unwrap_err();
    assert!(matches!(e, IrError::Overflow { .. }), "{e}");
}

#[test]
fn duplicate_params_and_unknown_operands_are_rejected() {
    let mut g = Graph::new("t");
    let root = g.root();
    g.add_param("w", TensorType::new(F, [2]), root).unwrap();
    assert_eq!(
        g.add_param("w", TensorType::new(F, [2]), root).unwrap_err(),
        IrError::DuplicateParam("w".into())
    );
    let e = g.add_node(Op::Silu, &[shardplan_ir::NodeId(7)], root).unwrap_err();
    assert!(e.to_string().contains("n7"), "{e}");
}

#[test]
fn costs_follow_the_documented_conventions() {
    let mut g = Graph::new("t");
    let root = g.root();
    let x = g.add_input("x", TensorType::new(F, [2, 8, 64]), root).unwrap();
    let w = g.add_param("w", TensorType::new(F, [32, 64]), root).unwrap();
    let y = g
        .add_node(
            Op::Linear {
                bias: false,
                layout: WeightLayout::OutIn,
                float8: None,
            },
            &[x, w],
            root,
        )
        .unwrap();
    let c = g.node_cost(y);
    assert_eq!(c.fwd_flops, 2 * 16 * 64 * 32);
    assert_eq!(c.bwd_flops, 2 * c.fwd_flops);
    assert_eq!(c.fwd_bytes, (16 * 64 + 32 * 64 + 16 * 32) * 4);
    let q = g.add_input("q", TensorType::new(F, [2, 8, 4, 16]), root).unwrap();
    let kv = g.add_input("kv", TensorType::new(F, [2, 8, 2, 16]), root).unwrap();
    let a = g
        .add_node(
            Op::Attention {
                causal: true,
                context: None,
            },
            &[q, kv, kv],
            root,
        )
        .unwrap();
    assert_eq!(g.node_cost(a).fwd_flops, 4 * 2 * 4 * 8 * 8 * 16);
}

#[test]
fn module_stats_count_params_costs_and_non_view_bytes() {
    let mut g = Graph::new("t");
    let block = g.add_scope(g.root(), "layers.0", ModuleKind::Block);
    let x = g.add_input("x", TensorType::new(F, [4, 8]), g.root()).unwrap();
    let w = g.add_param("layers.0.w", TensorType::new(F, [8, 8]), block).unwrap();
    let y = g
        .add_node(
            Op::Linear {
                bias: false,
                layout: WeightLayout::OutIn,
                float8: None,
            },
            &[x, w],
            block,
        )
        .unwrap();
    g.add_node(
        Op::Reshape {
            shape: Shape::new([32]),
        },
        &[y],
        block,
    )
    .unwrap();
    let rows = shardplan_ir::stats::module_stats(&g);
    let row = rows.iter().find(|r| r.path == "layers.0").unwrap();
    assert_eq!(row.params, 64);
    assert_eq!(row.cost.fwd_flops, 2 * 4 * 8 * 8);
    assert_eq!(row.activation_bytes, 4 * 8 * 4, "the reshape view adds nothing");
    let counts = shardplan_ir::stats::param_counts(&g);
    assert_eq!((counts.total, counts.embedding), (64, 0));
    assert_eq!(counts.by_kind.get(&ModuleKind::Block), Some(&64));
}

const U: DType = DType::U32;

#[test]
fn moe_routing() {
    use shardplan_ir::RouterScore::{Sigmoid, Softmax};
    let top = |k| Op::MoeTopK { k, score: Softmax };
    assert_eq!(ok(top(2), &[(F, &[6, 4])]), "u32[6,2]");
    let e = err(top(5), &[(F, &[6, 4])]);
    assert!(e.contains("k = 5 must be in 1..=4"), "{e}");
    let e = err(top(2), &[(F, &[2, 6, 4])]);
    assert!(e.contains("logits must be [tokens, experts]"), "{e}");

    let weights = Op::MoeRouterWeights {
        score: Sigmoid,
        norm: true,
    };
    assert_eq!(ok(weights.clone(), &[(F, &[6, 4]), (U, &[6, 2])]), "f32[6,2]");
    assert_eq!(ok(weights.clone(), &[(DType::F64, &[6, 4]), (U, &[6, 2])]), "f64[6,2]");
    let e = err(weights.clone(), &[(F, &[6, 4]), (F, &[6, 2])]);
    assert!(e.contains("expert ids must be an integer tensor"), "{e}");
    let e = err(weights, &[(F, &[6, 4]), (U, &[5, 2])]);
    assert!(e.contains("expert ids must be [6, k]"), "{e}");
    let grad = Op::MoeRouterWeightsGrad {
        score: Softmax,
        norm: false,
    };
    assert_eq!(
        ok(grad.clone(), &[(F, &[6, 4]), (U, &[6, 2]), (F, &[6, 2])]),
        "f32[6,4]"
    );
    let e = err(grad, &[(F, &[6, 4]), (U, &[6, 2]), (F, &[6, 3])]);
    assert!(e.contains("gradient must be [6, 2]"), "{e}");
}

#[test]
fn moe_permute_and_unpermute() {
    assert_eq!(ok(Op::MoePermute, &[(F, &[6, 8]), (U, &[6, 2])]), "f32[12,8]");
    assert_eq!(ok(Op::MoePermute, &[(F, &[6, 2, 8]), (U, &[6, 2])]), "f32[12,8]");
    let e = err(Op::MoePermute, &[(F, &[6, 3, 8]), (U, &[6, 2])]);
    assert!(e.contains("input must be [6, dim] or [6, 2, dim]"), "{e}");
    let sum = Op::MoeUnpermute { sum: true };
    let keep = Op::MoeUnpermute { sum: false };
    assert_eq!(ok(sum.clone(), &[(F, &[12, 8]), (U, &[6, 2])]), "f32[6,8]");
    assert_eq!(ok(keep, &[(F, &[12, 8]), (U, &[6, 2])]), "f32[6,2,8]");
    let e = err(sum, &[(F, &[11, 8]), (U, &[6, 2])]);
    assert!(e.contains("one row per assignment"), "{e}");
}

#[test]
fn grouped_linear_and_its_weight_grad() {
    let op = Op::GroupedLinear {
        layout: WeightLayout::OutIn,
    };
    let w: &[u64] = &[5, 8];
    assert_eq!(
        ok(op.clone(), &[(F, &[12, 8]), (U, &[6, 2]), (F, w), (F, w), (F, w)]),
        "f32[12,5]"
    );
    let flipped = Op::GroupedLinear {
        layout: WeightLayout::InOut,
    };
    assert_eq!(ok(flipped, &[(F, &[12, 5]), (U, &[6, 2]), (F, w), (F, w)]), "f32[12,8]");
    let e = err(op.clone(), &[(F, &[12, 8]), (U, &[6, 2]), (F, w), (F, &[5, 7])]);
    assert!(e.contains("every expert's weight must have the same type"), "{e}");
    let e = err(op.clone(), &[(F, &[12, 7]), (U, &[6, 2]), (F, w)]);
    assert!(e.contains("do not match the weight's input features 8"), "{e}");
    let e = err(op, &[(F, &[12, 8]), (U, &[6, 2])]);
    assert!(e.contains("at least one weight"), "{e}");

    let grad = |expert| Op::GroupedWeightGrad {
        expert,
        experts: 3,
        layout: WeightLayout::OutIn,
    };
    assert_eq!(ok(grad(2), &[(F, &[12, 8]), (F, &[12, 5]), (U, &[6, 2])]), "f32[5,8]");
    let e = err(grad(3), &[(F, &[12, 8]), (F, &[12, 5]), (U, &[6, 2])]);
    assert!(e.contains("expert 3 is out of range (3 experts)"), "{e}");
}

#[test]
fn moe_aux_loss() {
    let op = Op::MoeAuxLoss { top_k: 2, coef: 0.01 };
    assert_eq!(ok(op.clone(), &[(F, &[6, 4]), (F, &[6, 4])]), "f32[]");
    let e = err(op, &[(F, &[6, 4]), (F, &[6, 5])]);
    assert!(e.contains("every layer's logits must be [6, 4]"), "{e}");
    let e = err(Op::MoeAuxLoss { top_k: 5, coef: 0.01 }, &[(F, &[6, 4])]);
    assert!(e.contains("top_k = 5 must be in 1..=4"), "{e}");
    let grad = |layer| Op::MoeAuxLossGrad {
        layer,
        top_k: 2,
        coef: 0.01,
    };
    assert_eq!(ok(grad(1), &[(F, &[]), (F, &[6, 4]), (F, &[6, 4])]), "f32[6,4]");
    let e = err(grad(2), &[(F, &[]), (F, &[6, 4]), (F, &[6, 4])]);
    assert!(e.contains("layer 2 is out of range (2 layers)"), "{e}");
}

/// The grouped matmul costs `2 * T * k * in * out` whatever the routing; its experts' weight
/// gradients together cost as much again, each reading its own share of the rows.
#[test]
fn grouped_linear_costs_the_routed_flops() {
    let mut g = Graph::new("t");
    let root = g.root();
    let x = g.add_param("x", TensorType::new(F, [6, 8]), root).unwrap();
    let ids = g.add_input("ids", TensorType::new(U, [3, 2]), root).unwrap();
    let mut ins = vec![x, ids];
    for e in 0..3 {
        ins.push(g.add_param(&format!("w{e}"), TensorType::new(F, [5, 8]), root).unwrap());
    }
    let y = g
        .add_node(
            Op::GroupedLinear {
                layout: WeightLayout::OutIn,
            },
            &ins,
            root,
        )
        .unwrap();
    let s = g.add_node(Op::Sum, &[y], root).unwrap();
    g.add_output(s);
    let forward = g.node_cost(y);
    assert_eq!((forward.fwd_flops, forward.bwd_flops), (2 * 6 * 8 * 5, 4 * 6 * 8 * 5));
    let joint = shardplan_ir::differentiate(&g).unwrap();
    let grads: Vec<_> = joint
        .graph
        .nodes()
        .filter(|(_, n)| matches!(n.op, Op::GroupedWeightGrad { .. }))
        .map(|(id, _)| joint.graph.node_cost(id))
        .collect();
    assert_eq!(grads.len(), 3);
    assert_eq!(grads.iter().map(|c| c.fwd_flops).sum::<u64>(), forward.fwd_flops);
    // Rows of x [6, 8] and g [6, 5] in thirds, the ids, the [5, 8] gradient.
    assert_eq!(grads[0].fwd_bytes, (2 * 8 + 2 * 5) * 4 + 6 * 4 + 5 * 8 * 4);
}
