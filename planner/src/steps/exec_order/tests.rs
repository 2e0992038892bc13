//! shardplan's executor's kernels (`kernels: fused`) as the plan's memory sees them:
//! attention's backward blockwise, with no `[b, h, s, t]` value in memory
//! (`ExecOrder::blockwise_attention`), and the cross-entropy's backward over its logits
//! (`ExecOrder::in_place_cross_entropy`).

use super::{ExecOrder, ValueSlot};
use crate::testing::{joint_of, parallel};
use shardplan_ir::Op;
use shardplan_models::preset;

#[test]
fn every_attention_backward_runs_blockwise_holding_no_scores() {
    for model in ["tiny-llama", "tiny-gpt2"] {
        for ac in ["none", "full", "selective", "{every: 2}"] {
            let config = parallel(&format!(
                "mesh: {{shard: 2}}\nbatch: {{per_rank: 2, seq_len: 32}}\nactivation_checkpointing: {ac}\n"
            ));
            let joint = joint_of(&preset(model).unwrap(), &config);
            let g = &joint.graph;
            let mut exec = ExecOrder::in_graph_order(&joint, config.activation_checkpointing);
            let materialised = exec.last_use.clone();
            exec.blockwise_attention(g);
            let what = format!("{model}, checkpointing {ac}");
            let attentions = g.nodes().filter(|(_, n)| matches!(n.op, Op::Attention { .. })).count();
            assert!(attentions > 0);
            assert_eq!(exec.blockwise.len(), attentions, "{what}");
            let pos_of = |id| exec.order.iter().position(|&(n, copy)| n == id && !copy).unwrap();
            for (id, node) in g.nodes() {
                let scores = matches!(node.op, Op::AttnProbs { .. } | Op::AttnGradScores);
                assert_eq!(exec.placeholder(id), scores, "{what}: {id}");
                if scores {
                    assert_eq!(exec.value_bytes(g, id), 0, "{what}: {id}");
                }
            }
            for b in &exec.blockwise {
                let outputs: Vec<_> = b.outputs().collect();
                assert_eq!(outputs.len(), 3, "{what}: dq, dk and dv");
                let last = outputs.iter().map(|&o| pos_of(o)).max().unwrap();
                // The operands live to the last gradient node, read through the placeholders.
                for x in b.operands {
                    let slot = ValueSlot::of(x, exec.reads_copy(outputs[0], false, x));
                    assert!(exec.last_use[slot] >= last, "{what}: {x} dies before {last}");
                    assert!(exec.last_use[slot] >= materialised[slot], "{what}: {x} dies earlier");
                    assert!(exec.extra_reads(g, outputs[0]).contains(&x));
                }
                // Nothing else is read through; the placeholders read nothing more.
                assert!(exec.extra_reads(g, b.probs).is_empty());
            }
            // Every other value dies where it did.
            let operands: Vec<ValueSlot> = exec
                .blockwise
                .iter()
                .flat_map(|b| b.operands)
                .flat_map(|x| [ValueSlot::of(x, false), ValueSlot::of(x, true)])
                .collect();
            for ((slot, &now), &before) in exec.last_use.iter().zip(materialised.values()) {
                if !operands.contains(&slot) {
                    assert_eq!(now, before, "{what}: slot {slot}");
                }
            }
        }
    }
}

#[test]
fn the_cross_entropy_backward_writes_over_its_logits_where_nothing_shares_them() {
    for model in ["tiny-llama", "tiny-gpt2"] {
        for extra in [
            "",
            "mixed_precision: {param: bf16, reduce: f32}\n",
            "activation_checkpointing: full\n",
        ] {
            let config = parallel(&format!(
                "mesh: {{shard: 2}}\nbatch: {{per_rank: 2, seq_len: 32}}\n{extra}"
            ));
            let joint = joint_of(&preset(model).unwrap(), &config);
            let g = &joint.graph;
            let mut exec = ExecOrder::in_graph_order(&joint, config.activation_checkpointing);
            exec.shardplan_kernels(g);
            let what = format!("{model} {extra:?}");
            let mut seen = 0;
            for (id, node) in g.nodes() {
                match exec.in_place(id) {
                    Some(x) => {
                        seen += 1;
                        assert!(matches!(node.op, Op::CrossEntropyGrad), "{what}: {id}");
                        assert_eq!(x, node.inputs[0]);
                        assert_eq!(g.node(x).ty, node.ty);
                        // The logits die here.
                        let pos = exec.order.iter().position(|&(n, c)| n == id && !c).unwrap();
                        assert_eq!(exec.last_use[ValueSlot::of(x, false)], pos, "{what}");
                    }
                    None => assert!(!matches!(node.op, Op::CrossEntropyGrad), "{what}: {id} not in place"),
                }
            }
            assert_eq!(seen, 1, "{what}");
        }
    }
    // A cross-entropy whose logits are read again later is not overwritten.
    let config = parallel("mesh: {shard: 2}\nbatch: {per_rank: 2, seq_len: 32}\n");
    let joint = joint_of(&preset("tiny-llama").unwrap(), &config);
    let mut exec = ExecOrder::in_graph_order(&joint, config.activation_checkpointing);
    let ce = joint
        .graph
        .nodes()
        .find(|(_, n)| matches!(n.op, Op::CrossEntropyGrad))
        .map(|(id, _)| id)
        .unwrap();
    let x = joint.graph.node(ce).inputs[0];
    exec.last_use[ValueSlot::of(x, false)] = exec.order.len() - 1;
    exec.in_place_cross_entropy(&joint.graph);
    assert_eq!(exec.in_place(ce), None);
}

#[test]
fn a_checkpointed_block_reads_its_recompute_instead_of_recomputing_twice() {
    use shardplan_ir::{differentiate_with, DiffOptions};
    let config =
        parallel("mesh: {shard: 2}\nbatch: {per_rank: 2, seq_len: 32}\nactivation_checkpointing: {every: 2}\n");
    let m = preset("tiny-llama").unwrap();
    let g = shardplan_models::trace(&m, config.trace_options()).unwrap();
    let joint = differentiate_with(
        &g,
        DiffOptions {
            recompute_pointwise: true,
            ..DiffOptions::default()
        },
    )
    .unwrap();
    let exec = ExecOrder::in_graph_order(&joint, config.activation_checkpointing);
    let in_order = |id| exec.order.iter().any(|&(n, _)| n == id);
    let (mut skipped, mut run) = (0, 0);
    for (i, of) in joint.recompute_of.iter().enumerate() {
        let Some(f) = *of else { continue };
        let c = shardplan_ir::NodeId::new(i);
        if exec.recomputed(f) {
            // The block's recompute makes f again: the copy does not run, and its readers
            // read that recomputed value.
            skipped += 1;
            assert!(!in_order(c), "{c} runs beside the recompute of {f}");
            assert_eq!(exec.read_slot(c, false, c), ValueSlot::of(f, true));
        } else {
            run += 1;
            assert!(in_order(c), "{c} (a copy of {f} outside a checkpointed block) must run");
        }
    }
    // Every second block is checkpointed: both kinds occur.
    assert!(skipped > 0 && run > 0, "skipped {skipped}, run {run}");
}

/// Under shardplan's runtime the context ring's gathers come as soon as their operands
/// exist, with the queries' work after them, and in backward the queries' gradient path
/// runs before the work that reads the reduced key and value gradients; the order stays
/// topological and every node runs once.
#[test]
fn the_ring_overlaps_the_work_that_does_not_need_it() {
    use crate::Runner;
    for ac in ["none", "full"] {
        let config = parallel(&format!(
            "mesh: {{shard: 1, context: 2}}\ngpus_per_node: 2\nbatch: {{per_rank: 2, seq_len: 16}}\nactivation_checkpointing: {ac}\n"
        ));
        let joint = joint_of(&preset("tiny-llama").unwrap(), &config);
        let g = &joint.graph;
        let plain = ExecOrder::in_graph_order(&joint, config.activation_checkpointing);
        let exec = ExecOrder::new(&joint, config.activation_checkpointing, Runner::Shardplan);
        let mut a = plain.order.clone();
        let mut b = exec.order.clone();
        a.sort();
        b.sort();
        assert_eq!(a, b, "{ac}: the same nodes");
        assert_ne!(plain.order, exec.order, "{ac}: nothing moved");
        let mut done = std::collections::HashSet::new();
        for &(id, copy) in &exec.order {
            for &x in &g.node(id).inputs {
                let ran = done.contains(&(x, copy)) || done.contains(&(x, false)) || g.node(x).op.is_leaf();
                assert!(ran || exec.param_of(x).is_some(), "{ac}: {id} before its operand {x}");
            }
            done.insert((id, copy));
        }
        // Forward: a rope (the queries') runs after the first gather of its attention.
        let pos = |want: &dyn Fn(&Op) -> bool, copy: bool| {
            exec.order
                .iter()
                .position(|&(id, c)| c == copy && id.index() < joint.forward_len && want(&g.node(id).op))
                .unwrap()
        };
        let first_gather = pos(&|op| matches!(op, Op::CpAllGather { .. }), false);
        let ropes: Vec<usize> = exec
            .order
            .iter()
            .enumerate()
            .filter(|(_, &(id, c))| !c && matches!(g.node(id).op, Op::Rope { .. }))
            .map(|(i, _)| i)
            .collect();
        assert!(ropes[1] > first_gather, "{ac}: the queries' rope before the gather");
        // Backward: the queries' rotary gradient before the first work on a reduced gradient.
        let bwd = |want: &dyn Fn(&Op) -> bool| {
            exec.order
                .iter()
                .position(|&(id, _)| id.index() >= joint.forward_len && want(&g.node(id).op))
                .unwrap()
        };
        let first_rs = bwd(&|op| matches!(op, Op::CpReduceScatter { .. }));
        let readers_of_rs = exec.order[first_rs..]
            .iter()
            .position(|&(id, _)| {
                g.node(id)
                    .inputs
                    .iter()
                    .any(|x| matches!(g.node(*x).op, Op::CpReduceScatter { .. }))
            })
            .unwrap()
            + first_rs;
        let rope_grad = bwd(&|op| matches!(op, Op::RopeGrad { .. }));
        assert!(
            rope_grad > first_rs && rope_grad < readers_of_rs,
            "{ac}: {first_rs} {rope_grad} {readers_of_rs}"
        );
    }
}
