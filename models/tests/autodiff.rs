//! Structure of the joint graphs of real models (numerical checks live in the executor).

use shardplan_ir::{differentiate, to_text, Op};
use shardplan_models::{preset, trace, TraceOptions, PRESET_NAMES};

fn joint(name: &str) -> shardplan_ir::JointGraph {
    let g = trace(
        &preset(name).unwrap(),
        TraceOptions {
            batch: 2,
            seq_len: Some(8),
            ..TraceOptions::default()
        },
    )
    .unwrap();
    differentiate(&g).unwrap()
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
        .find(|(_, p)| p.name == "transformer.wte.weight")
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
