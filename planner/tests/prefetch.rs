//! `prefetch: auto`: all-gathers moved off the peak, never at the cost of the step.

mod common;

use common::gen::{llama, model, policy, spec};
use common::plan_model;
use proptest::prelude::*;
use shardplan_planner::prefetch::STEP_TOLERANCE;
use shardplan_planner::{Instr, Phase};

/// The same spec with the depths' order made peak-aware.
fn peak_aware(yaml: &str) -> String {
    let i = yaml.find("prefetch: {").expect("the spec names its prefetch");
    let j = i + yaml[i..].find('}').unwrap();
    format!("{}, peak_aware: true{}", &yaml[..j], &yaml[j..])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// On any model, mesh and policy, the peak-aware order has no higher peak and no longer
    /// simulated step than FSDP2's order at the same depths (both plans verify).
    #[test]
    fn peak_aware_order_is_never_worse_than_the_depths_order(
        m in model(),
        replicate in 1u64..3,
        shard in prop::sample::select(vec![1u64, 2, 4]),
        p in policy(),
    ) {
        let base_yaml = spec(replicate, shard, &p);
        let base = plan_model(&m, &base_yaml);
        let auto = plan_model(&m, &peak_aware(&base_yaml));
        prop_assert!(base.prefetch_moves.is_empty());
        prop_assert!(
            auto.memory.peak <= base.memory.peak,
            "peak {} > {}", auto.memory.peak, base.memory.peak
        );
        prop_assert!(
            auto.estimate.step_s <= base.estimate.step_s * (1.0 + STEP_TOLERANCE),
            "step {} > {}", auto.estimate.step_s, base.estimate.step_s
        );
        // Each move lowers the peak, and the last one's peak is the plan's.
        for m in &auto.prefetch_moves {
            prop_assert!(m.peak_after < m.peak_before);
            prop_assert!(m.from < m.to && m.to <= m.need);
        }
        if let Some(last) = auto.prefetch_moves.last() {
            prop_assert_eq!(last.peak_after, auto.memory.peak);
            prop_assert_eq!(auto.prefetch_moves[0].peak_before, base.memory.peak);
        }
        // Moving gathers changes no work: the same collectives and compute steps, in the
        // same order per stream kind of work.
        let work = |plan: &shardplan_planner::Plan| -> Vec<String> {
            plan.programs[0].instrs.iter().filter_map(|i| match &i.instr {
                Instr::AllGather { group, .. } => Some(format!("all-gather {group}")),
                Instr::ReduceScatter { group, .. } => Some(format!("reduce-scatter {group}")),
                Instr::AllReduce { group, .. } => Some(format!("all-reduce {group:?}")),
                Instr::Compute { step, micro, .. } => Some(format!("compute {step} {micro}")),
                _ => None,
            }).collect::<Vec<_>>()
        };
        let (mut a, mut b) = (work(&base), work(&auto));
        a.sort();
        b.sort();
        prop_assert_eq!(a, b);
    }
}

/// A wide vocabulary puts the peak in the loss backward, where FSDP2's order already holds
/// the last block's backward gather. `prefetch: auto` (the default) issues it with the next
/// step instead, which saves that block's unsharded parameters at the peak and costs no time.
#[test]
fn last_blocks_backward_gather_leaves_the_loss_backward_peak() {
    let mut m = llama(32768, 256, 4, 4, 2, 512, false);
    if let shardplan_models::ModelConfig::Llama(c) = &mut m {
        c.max_seq_len = 2048;
    }
    let base_yaml = "mesh: {shard: 8}\ngpus_per_node: 8\nprefetch: {forward: 1, backward: 1}\n\
                     mixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 1, seq_len: 2048}\n";
    let auto_yaml = base_yaml.replace("prefetch: {forward: 1, backward: 1}\n", "");
    let base = plan_model(&m, base_yaml);
    let auto = plan_model(&m, &auto_yaml);
    assert!(auto.policy.prefetch.peak_aware, "auto is the default");
    let peak_step = |p: &shardplan_planner::Plan| match p.programs[0].instrs[p.memory.peak_instr as usize].instr {
        Instr::Compute { step, .. } => p.step(step).clone(),
        ref other => panic!("the peak is not a compute step: {other:?}"),
    };
    let s = peak_step(&base);
    assert_eq!(s.phase, Phase::Backward);
    assert!(s.label.contains("loss"), "{}", s.label);
    let mv = auto.prefetch_moves.first().expect("a gather moved");
    let block = &auto.groups[mv.group.index()];
    assert_eq!(block.group.module, "layers.3");
    assert_eq!(auto.step(mv.from).label, s.label);
    // It saved the block's unsharded bf16 parameters, exactly.
    let saved = base.memory.peak - auto.memory.peak;
    assert!(saved >= block.layout.shard_numel * 8 * 2, "saved {saved}");
    assert!(auto.estimate.step_s <= base.estimate.step_s * (1.0 + STEP_TOLERANCE));
    let text = shardplan_planner::print::text(&auto, 0);
    assert!(text.contains("prefetch auto moved"), "{text}");
    assert!(text.contains("layers.3"), "{text}");
}
