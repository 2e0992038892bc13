//! The estimate's step by kind of work: its parts come from the cost model's own per-op
//! figures and add up to the compute stream's time, and with the waits and the step's fixed
//! overhead to the step.

mod common;

use common::{joint_of, parallel};
use shardplan_ir::{JointGraph, NodeId};
use shardplan_models::preset;
use shardplan_planner::{plan, Breakdown, Instr, OpModel, Plan, Stream, WorkKind};

/// The joint graph and plan of `model` under `yaml`.
fn planned(model: &str, yaml: &str) -> (JointGraph, Plan) {
    let config = parallel(yaml);
    let joint = joint_of(&preset(model).unwrap(), &config);
    let p = plan(&joint, &config).unwrap_or_else(|e| panic!("{e}"));
    (joint, p)
}

/// Specs that exercise every part: eager and fused kernels, collectives beside compute,
/// gradient accumulation, CPU offload, recomputation, HSDP, a profile with a fixed step cost.
const SPECS: &[(&str, &str)] = &[
    ("tiny-llama", "mesh: {shard: 4}\ngpus_per_node: 4\nhardware: h100-sxm\nbatch: {per_rank: 2, seq_len: 64}\n"),
    (
        "tiny-llama",
        "mesh: {replicate: 2, shard: 2}\ngpus_per_node: 2\nhardware: a100-80gb\nactivation_checkpointing: full\nbatch: {per_rank: 1, seq_len: 32, grad_accum: 3}\n",
    ),
    (
        "tiny-llama",
        "mesh: {shard: 2}\ngpus_per_node: 2\nhardware: {base: h100-sxm, kernels: fused, step_overhead_us: 40, copy_gbps: 10, parallel_launch_us: 3}\nbatch: {per_rank: 2, seq_len: 32}\n",
    ),
    ("tiny-llama", "mesh: {shard: 4}\ngpus_per_node: 4\noffload: cpu\nbatch: {per_rank: 1, seq_len: 32}\n"),
    ("tiny-gpt2", "mesh: {shard: 4}\ngpus_per_node: 4\nactivation_checkpointing: selective\nbatch: {per_rank: 2, seq_len: 16}\n"),
];

#[test]
fn parts_sum_to_the_compute_time_and_the_step() {
    for (model, yaml) in SPECS {
        let (_, p) = planned(model, yaml);
        let e = &p.estimate;
        let parts = e.breakdown.total();
        assert!(
            (parts - e.compute_s).abs() <= 1e-9 * e.compute_s,
            "{model} {yaml}: parts {parts} s, compute {} s",
            e.compute_s
        );
        let whole = parts + e.exposed_comm_s + e.step_overhead_s;
        assert!(
            (whole - e.step_s).abs() <= 1e-9 * e.step_s,
            "{model} {yaml}: parts, waits and overhead {whole} s, step {} s",
            e.step_s
        );
        for k in WorkKind::ALL {
            assert!(e.breakdown.get(k) >= -1e-12, "{model} {yaml}: {} is negative", k.name());
        }
        assert!(e.breakdown.matmul_s > 0.0, "{model} {yaml}: no matmul time");
    }
}

/// Every compute step's kinds are the sums of `OpModel::parts` over its nodes, counted once
/// per time the program runs the step.
#[test]
fn op_kinds_are_the_cost_models_own_figures() {
    for (model, yaml) in SPECS {
        let (joint, p) = planned(model, yaml);
        let m = OpModel::new(&joint.graph, &p.hardware, p.policy.mixed_precision.param);
        let mut want = Breakdown::default();
        for issued in &p.programs[0].instrs {
            if let (Stream::Compute, Instr::Compute { step, .. }) = (issued.stream, &issued.instr) {
                for i in p.step(*step).nodes.iter().flat_map(|r| r.clone()) {
                    let (kind, work, launch) = m.parts(NodeId(i));
                    assert!(
                        (work + launch - m.seconds(NodeId(i))).abs() <= 1e-12,
                        "node {i}: parts do not add up to its seconds"
                    );
                    want.add(kind, work);
                    want.add(WorkKind::Launch, launch);
                }
            }
        }
        // Kinds the steps' ops make (the rest come from copies, the optimizer and overlap).
        for k in [
            WorkKind::Matmul,
            WorkKind::Attention,
            WorkKind::Norm,
            WorkKind::Elementwise,
            WorkKind::Rotary,
            WorkKind::Embedding,
            WorkKind::CrossEntropy,
            WorkKind::Layout,
            WorkKind::Launch,
        ] {
            let (got, w) = (p.estimate.breakdown.get(k), want.get(k));
            assert!(
                (got - w).abs() <= 1e-9 * w.max(1e-12),
                "{model} {yaml}: {} {got} s, the cost model's ops {w} s",
                k.name()
            );
        }
        // Under CPU offload the optimizer runs on the host, beside the compute stream.
        let on_device = !yaml.contains("offload: cpu");
        assert_eq!(
            p.estimate.breakdown.optimizer_s > 0.0,
            on_device,
            "{model} {yaml}: optimizer {} s",
            p.estimate.breakdown.optimizer_s
        );
    }
}

/// Kernels shorter than their launches show as launch time under eager PyTorch, and every
/// launch does under shardplan's executor.
#[test]
fn launches_are_their_own_kind() {
    let eager = "mesh: {shard: 1}\ngpus_per_node: 1\nhardware: h100-sxm\nbatch: {per_rank: 1, seq_len: 8}\n";
    let (_, p) = planned("tiny-llama", eager);
    assert!(
        p.estimate.breakdown.launch_s > 0.0,
        "a tiny model's kernels are launch-bound"
    );
    let long = "mesh: {shard: 1}\ngpus_per_node: 1\nhardware: {base: h100-sxm, kernel_launch_us: 0}\nbatch: {per_rank: 1, seq_len: 8}\n";
    let (_, q) = planned("tiny-llama", long);
    assert_eq!(q.estimate.breakdown.launch_s, 0.0, "no launch cost, no launch time");
    assert!(q.estimate.compute_s < p.estimate.compute_s);
}
