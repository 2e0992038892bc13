//! Structure of the joint graphs of real models (numerical checks live in the executor).

use shardplan_ir::{differentiate, to_text, Op};
use shardplan_models::{preset, trace, TraceOptions, PRESET_NAMES};

fn traced(name: &str) -> shardplan_ir::Graph {
    trace(
        &preset(name).unwrap(),
        TraceOptions {
            batch: 2,
            seq_len: Some(8),
            ..TraceOptions::default()
        },
    )
    .unwrap()
}

fn joint(name: &str) -> shardplan_ir::JointGraph {
    differentiate(&traced(name)).unwrap()
}

#[test]
fn every_parameter_gets_a_gradient_of_its_own_type() {
    for name in PRESET_NAMES.iter().filter(|n| n.starts_with("tiny")) {
        let j = joint(name);
        for (p, param) in j.graph.params() {
            let grad = j
                .grad(p)
                .unwrap_or_else(|| panic!("{name}: no gradient for {}", param.name));
            assert_eq!(j.graph.node(grad).ty, param.ty, "{name}: {}", param.name);
            assert!(j.graph.node(grad).is_backward());
        }
    }
}

#[test]
fn backward_nodes_record_their_forward_node_and_scope() {
    let j = joint("tiny-llama");
    assert!(j.forward_len < j.graph.node_count());
    for (id, n) in j.graph.nodes() {
        if id.index() < j.forward_len {
            assert!(!n.is_backward(), "{id} is forward");
            continue;
        }
        let of = n.grad_of.unwrap_or_else(|| panic!("{id} has no grad_of"));
        assert!(of.index() < j.forward_len, "{id} differentiates a forward node");
        assert_eq!(
            n.scope,
            j.graph.node(of).scope,
            "{id} lives in its forward node's scope"
        );
    }
    // Attention backward reads q, k and v of the forward pass; no forward node reads a
    // backward one.
    let saved = j.saved_for_backward();
    let attn = j
        .graph
        .nodes()
        .find(|(_, n)| matches!(n.op, Op::Attention { .. }))
        .unwrap();
    for operand in &attn.1.inputs {
        assert!(saved.contains(operand), "attention operand {operand} must be saved");
    }
}

#[test]
fn tied_weights_sum_both_contributions() {
    let j = joint("tiny-gpt2");
    let (wte, _) = j
        .graph
        .params()
        .find(|(_, p)| &*p.name == "transformer.wte.weight")
        .unwrap();
    let grad = j.graph.node(j.grad(wte).unwrap());
    assert!(
        matches!(grad.op, Op::Add),
        "embedding and head gradients are summed: {:?}",
        grad.op
    );
}

#[test]
fn differentiating_twice_is_an_error() {
    let j = joint("tiny-mlp");
    let e = differentiate(&j.graph).unwrap_err();
    assert!(e.to_string().contains("already a backward node"), "{e}");
}

#[test]
fn tiny_mlp_joint_graph() {
    insta::assert_snapshot!(to_text(&joint("tiny-mlp").graph));
}

#[test]
fn recomputing_pointwise_ops_leaves_their_outputs_to_the_forward_pass() {
    use shardplan_ir::{differentiate_with, DiffOptions};
    let pointwise = |op: &Op| {
        matches!(
            op,
            Op::Silu | Op::Gelu | Op::GeluErf | Op::Relu | Op::Mul | Op::RmsNorm { .. } | Op::LayerNorm { .. }
        )
    };
    for name in PRESET_NAMES.iter().filter(|n| n.starts_with("tiny")) {
        let g = traced(name);
        let kept = differentiate(&g).unwrap();
        let j = differentiate_with(
            &g,
            DiffOptions {
                recompute_pointwise: true,
                ..DiffOptions::default()
            },
        )
        .unwrap();
        // Backward reads no pointwise output of the forward pass; eager keeps some.
        let saved = |j: &shardplan_ir::JointGraph| {
            j.saved_for_backward()
                .into_iter()
                .filter(|&v| pointwise(&j.graph.node(v).op))
                .count()
        };
        assert!(saved(&kept) > 0, "{name}");
        assert_eq!(saved(&j), 0, "{name}");
        // Each copy is its forward node's op on the values backward reads, made once.
        // A copy reads only forward values and other copies (a gradient reads a gradient).
        let mut copies = std::collections::HashSet::new();
        let mut copied = Vec::new();
        for (id, n) in j.graph.nodes().skip(j.forward_len) {
            let Some(f) = n.grad_of else { continue };
            let fnode = j.graph.node(f);
            if pointwise(&n.op)
                && fnode.op == n.op
                && fnode.ty == n.ty
                && n.inputs.iter().all(|i| i.index() < j.forward_len || copies.contains(i))
            {
                copies.insert(id);
                copied.push(f);
            }
        }
        let mut unique = copied.clone();
        unique.sort_unstable();
        unique.dedup();
        assert!(!copied.is_empty(), "{name}");
        assert_eq!(copied.len(), unique.len(), "{name}: a value recomputed twice");
        // The forward pass and the parameters' gradients' types are untouched.
        assert_eq!(j.forward_len, kept.forward_len);
        for (p, param) in j.graph.params() {
            assert_eq!(j.graph.node(j.grad(p).unwrap()).ty, param.ty, "{name}");
        }
    }
}
