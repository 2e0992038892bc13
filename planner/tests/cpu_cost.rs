//! The cost-model terms of a calibrated CPU profile (`kernels: fused`): each is applied where
//! the executor pays it, and scales with its profile field.

mod common;

use common::plan_preset;
use shardplan_frontends::{builtin_hardware, KernelMode};
use shardplan_ir::{differentiate, DType, NodeId};
use shardplan_models::{preset, trace, TraceOptions};
use shardplan_planner::{forks, Instr, OpModel, PARALLEL_MIN_ELEMS};

const SPEC: &str = "mixed_precision: {param: f32, reduce: f32}\nbatch: {per_rank: 2, seq_len: 16}\n";

fn spec(mesh: u64, extra: &str) -> String {
    format!(
        "mesh: {{shard: {mesh}}}\ngpus_per_node: {mesh}\n{SPEC}hardware: {{base: h100-sxm, kernels: fused, f32_tflops: 0.1, hbm_gbps: 20, overlap_slowdown: 0, {extra}}}\n"
    )
}

#[test]
fn parallel_launch_is_paid_by_the_ops_the_executor_splits_over_threads() {
    let g = trace(
        &preset("tiny-llama").unwrap(),
        TraceOptions {
            batch: 2,
            seq_len: Some(16),
            dtype: DType::F32,
            ..Default::default()
        },
    )
    .unwrap();
    let joint = differentiate(&g).unwrap();
    let g = &joint.graph;
    let mut hw = builtin_hardware("h100-sxm").unwrap();
    hw.kernels = KernelMode::Fused;
    let base: Vec<f64> = {
        let m = OpModel::new(g, &hw, DType::F32);
        (0..g.node_count() as u32).map(|i| m.seconds(NodeId(i))).collect()
    };
    hw.parallel_launch_us = 25.0;
    let m = OpModel::new(g, &hw, DType::F32);
    let mut split = 0;
    for (id, n) in g.nodes() {
        let extra = m.seconds(id) - base[id.index()];
        if base[id.index()] > 0.0 && forks(&n.op, n.ty.numel()) {
            assert!((extra - 25e-6).abs() < 1e-12, "{id} {}: {extra}", n.op.name());
            split += 1;
        } else {
            assert_eq!(extra, 0.0, "{id} {}", n.op.name());
        }
    }
    // Attention (forward and five backward parts), norms and rotary embeddings of 2 layers.
    assert!(split >= 2 * 6 + 4, "{split}");
    // Elementwise ops split only from the executor's threshold.
    let small = shardplan_ir::Op::Add;
    assert!(!forks(&small, Some(PARALLEL_MIN_ELEMS - 1)));
    assert!(forks(&small, Some(PARALLEL_MIN_ELEMS)));
    // Not a CPU executor: nothing added.
    hw.kernels = KernelMode::Eager;
    let mut hw0 = hw.clone();
    hw0.parallel_launch_us = 0.0;
    let eager = OpModel::new(g, &hw, DType::F32);
    let eager0 = OpModel::new(g, &hw0, DType::F32);
    for (id, _) in g.nodes() {
        assert_eq!(eager.seconds(id), eager0.seconds(id));
    }
}

/// Bytes the compute steps of rank 0 copy: gradients written, and parameters read when
/// they come from several shards.
fn copied_bytes(p: &shardplan_planner::Plan) -> f64 {
    p.programs[0]
        .instrs
        .iter()
        .filter_map(|i| match &i.instr {
            Instr::Compute { reads, writes, .. } => {
                let sum = |bs: &[shardplan_planner::BufId]| bs.iter().map(|b| p.buffer(*b).bytes()).sum::<u64>();
                Some((sum(writes) + if p.mesh.shard() > 1 { sum(reads) } else { 0 }) as f64)
            }
            _ => None,
        })
        .sum()
}

#[test]
fn compute_steps_pay_their_copies_at_copy_gbps() {
    for mesh in [1, 4] {
        let none = plan_preset("tiny-llama", &spec(mesh, "copy_gbps: 0"));
        let bytes = copied_bytes(&none);
        assert!(bytes > 0.0);
        for gbps in [2.0, 8.0] {
            let p = plan_preset("tiny-llama", &spec(mesh, &format!("copy_gbps: {gbps}")));
            let extra = p.estimate.compute_s - none.estimate.compute_s;
            let want = bytes / (gbps * 1e9);
            assert!(
                (extra - want).abs() < 1e-9 * want.max(1.0),
                "1x{mesh} at {gbps}: {extra} vs {want}"
            );
        }
        // With one shard the parameters are views: only gradients are copied.
        if mesh == 1 {
            let grads: u64 = none.programs[0]
                .instrs
                .iter()
                .filter_map(|i| match &i.instr {
                    Instr::Compute { writes, .. } => Some(writes.iter().map(|b| none.buffer(*b).bytes()).sum::<u64>()),
                    _ => None,
                })
                .sum();
            assert_eq!(bytes, grads as f64);
        }
    }
}

#[test]
fn the_step_overhead_is_added_once_per_step() {
    let none = plan_preset("tiny-llama", &spec(1, "step_overhead_us: 0"));
    let some = plan_preset("tiny-llama", &spec(1, "step_overhead_us: 400"));
    let extra = some.estimate.step_s - none.estimate.step_s;
    assert!((extra - 400e-6).abs() < 1e-9, "{extra}");
    // The same compute, summed from times offset by the overhead (rounding only).
    let (a, b) = (some.estimate.compute_s, none.estimate.compute_s);
    assert!((a - b).abs() <= 1e-12 * b, "{a} vs {b}");
}
