//! Attention's backward under shardplan's executor (`kernels: fused`): blockwise, with no
//! `[b, h, s, t]` value in memory (`ExecOrder::blockwise_attention`).

mod common;

use common::{joint_of, parallel};
use shardplan_ir::Op;
use shardplan_models::preset;
use shardplan_planner::ExecOrder;

#[test]
fn every_attention_backward_runs_blockwise_holding_no_scores() {
    for model in ["tiny-llama", "tiny-gpt2"] {
        for ac in ["none", "full", "selective", "{every: 2}"] {
            let config = parallel(&format!(
                "mesh: {{shard: 2}}\nbatch: {{per_rank: 2, seq_len: 32}}\nactivation_checkpointing: {ac}\n"
            ));
            let joint = joint_of(&preset(model).unwrap(), &config);
            let g = &joint.graph;
            let mut exec = ExecOrder::new(&joint, config.activation_checkpointing);
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
                    let slot = ExecOrder::slot(x, exec.reads_copy(outputs[0], false, x));
                    assert!(exec.last_use[slot] >= last, "{what}: {x} dies before {last}");
                    assert!(exec.last_use[slot] >= materialised[slot], "{what}: {x} dies earlier");
                    assert!(exec.extra_reads(g, outputs[0]).contains(&x));
                }
                // Nothing else is read through; the placeholders read nothing more.
                assert!(exec.extra_reads(g, b.probs).is_empty());
            }
            // Every other value dies where it did.
            let operands: Vec<usize> = exec
                .blockwise
                .iter()
                .flat_map(|b| b.operands)
                .flat_map(|x| [ExecOrder::slot(x, false), ExecOrder::slot(x, true)])
                .collect();
            for (slot, (&now, &before)) in exec.last_use.iter().zip(&materialised).enumerate() {
                if !operands.contains(&slot) {
                    assert_eq!(now, before, "{what}: slot {slot}");
                }
            }
        }
    }
}
