//! What each knob does to the schedule, counted instruction by instruction.

mod common;

use common::{plan_model, plan_preset};
use shardplan_models::{LlamaConfig, ModelConfig};

/// A Llama with 4 blocks, big enough that compute hides communication on H100 numbers.
fn four_blocks() -> ModelConfig {
    ModelConfig::Llama(LlamaConfig {
        name: "four".into(),
        vocab_size: 512,
        dim: 1024,
        n_layers: 4,
        n_heads: 8,
        n_kv_heads: 8,
        head_dim: None,
        ffn_dim: 2048,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: Default::default(),
        activation: None,
        tie_embeddings: false,
        qkv_bias: false,
        qk_norm: false,
        moe: None,
        max_seq_len: 2048,
    })
}
use shardplan_planner::{Comm, Instr, Plan, Stream};

fn spec(extra: &str) -> String {
    let batch = if extra.contains("batch:") {
        ""
    } else {
        "batch: {per_rank: 1, seq_len: 8}\n"
    };
    format!("gpus_per_node: 4\nmixed_precision: {{param: bf16, reduce: f32}}\n{batch}{extra}")
}

fn count(plan: &Plan, f: impl Fn(&Instr) -> bool) -> usize {
    plan.programs[0].instrs.iter().filter(|i| f(&i.instr)).count()
}

/// Issue index of the all-gather of group `g` (the `nth` one) and of the first compute
/// step that reads group `reader`.
fn all_gather_at(plan: &Plan, g: u32, nth: usize) -> usize {
    plan.programs[0]
        .instrs
        .iter()
        .enumerate()
        .filter(|(_, i)| matches!(i.instr, Instr::AllGather { group, .. } if group.0 == g))
        .nth(nth)
        .unwrap()
        .0
}

fn compute_of(plan: &Plan, label: &str, phase: &str) -> usize {
    plan.programs[0]
        .instrs
        .iter()
        .position(|i| match &i.instr {
            Instr::Compute { step, .. } => {
                let s = plan.step(*step);
                s.label == label && s.phase.name() == phase
            }
            _ => false,
        })
        .unwrap()
}

#[test]
fn prefetch_depth_moves_the_all_gather_ahead_of_its_use() {
    let none = plan_model(
        &four_blocks(),
        &spec("mesh: {shard: 4}\nprefetch: {forward: 0, backward: 0}\nbatch: {per_rank: 1, seq_len: 2048}\n"),
    );
    let one = plan_model(
        &four_blocks(),
        &spec("mesh: {shard: 4}\nbatch: {per_rank: 1, seq_len: 2048}\n"),
    );
    // Depth 0: layers.1 is gathered after layers.0's forward was issued; depth 1: before.
    assert!(all_gather_at(&none, 1, 0) > compute_of(&none, "layers.0", "forward"));
    assert!(all_gather_at(&one, 1, 0) < compute_of(&one, "layers.0", "forward"));
    assert!(
        none.estimate.exposed_comm_s > 2.0 * one.estimate.exposed_comm_s,
        "{} vs {}",
        none.estimate.exposed_comm_s,
        one.estimate.exposed_comm_s
    );
    // Gathering ahead holds two blocks at once.
    assert!(none.memory.max_by_category.unsharded_params < one.memory.max_by_category.unsharded_params);
}

#[test]
fn explicit_prefetch_overrides_the_depth() {
    let plan = plan_preset(
        "tiny-llama",
        &spec("mesh: {shard: 4}\nprefetch: {forward: 0, backward: 0, explicit: {forward: {layers.0: [layers.1]}}}\n"),
    );
    assert!(all_gather_at(&plan, 1, 0) < compute_of(&plan, "layers.0", "forward"));
    // Backward has no explicit list: depth 0 there.
    assert!(all_gather_at(&plan, 0, 1) > compute_of(&plan, "layers.1", "backward"));
}

#[test]
fn reshard_false_gathers_once_and_true_twice() {
    let keep = plan_preset("tiny-llama", &spec("mesh: {shard: 4}\nreshard_after_forward: false\n"));
    let free = plan_preset("tiny-llama", &spec("mesh: {shard: 4}\n"));
    let ags = |p: &Plan| count(p, |i| matches!(i, Instr::AllGather { .. }));
    assert_eq!(ags(&keep), 3);
    assert_eq!(
        ags(&free),
        5,
        "the root keeps its parameters; blocks gather again for backward"
    );
    assert!(keep.memory.max_by_category.unsharded_params >= free.memory.max_by_category.unsharded_params);
}

#[test]
fn int_reshard_gathers_backward_over_the_smaller_group() {
    let plan = plan_preset("tiny-llama", &spec("mesh: {shard: 4}\nreshard_after_forward: 2\n"));
    let over = |c: Comm| count(&plan, |i| matches!(i, Instr::AllGather { comm, .. } if *comm == c));
    assert_eq!(over(Comm::Shard), 3);
    assert_eq!(over(Comm::Reshard(2)), 2);
}

#[test]
fn grad_accumulation_reduces_every_micro_batch_or_once() {
    let every = plan_model(
        &four_blocks(),
        &spec("mesh: {replicate: 2, shard: 2}\nbatch: {per_rank: 1, seq_len: 8, grad_accum: 4}\n"),
    );
    let once = plan_model(
        &four_blocks(),
        &spec("mesh: {replicate: 2, shard: 2}\nbatch: {per_rank: 1, seq_len: 8, grad_accum: 4, grad_sync: final_micro_batch}\n"),
    );
    let rs = |p: &Plan| count(p, |i| matches!(i, Instr::ReduceScatter { .. }));
    let ar = |p: &Plan| {
        count(p, |i| {
            matches!(
                i,
                Instr::AllReduce {
                    comm: Comm::Replicate,
                    ..
                }
            )
        })
    };
    assert_eq!((rs(&every), ar(&every)), (20, 5));
    assert_eq!(
        (rs(&once), ar(&once)),
        (5, 5),
        "HSDP all-reduce once per step either way"
    );
    assert!(once.memory.max_by_category.unsharded_grads > every.memory.max_by_category.unsharded_grads);
    assert!(once.estimate.reduce_scatter_bytes * 4 == every.estimate.reduce_scatter_bytes);
}

#[test]
fn offload_moves_state_to_the_host_and_steps_there() {
    let plan = plan_preset("tiny-llama", &spec("mesh: {shard: 4}\noffload: cpu\n"));
    assert_eq!(plan.memory.max_by_category.optimizer_state, 0);
    assert!(plan.memory.host.optimizer_state > 0 && plan.memory.host.sharded_params > 0);
    let on = |s: Stream, f: &dyn Fn(&Instr) -> bool| {
        plan.programs[0]
            .instrs
            .iter()
            .filter(|i| i.stream == s && f(&i.instr))
            .count()
    };
    assert_eq!(on(Stream::Host, &|i| matches!(i, Instr::OptimizerStep { .. })), 3);
    // Host -> device before every gather from the sharded state, device -> host per group.
    assert_eq!(on(Stream::Copy, &|i| matches!(i, Instr::Copy { .. })), 5 + 3);
}

#[test]
fn activation_checkpointing_recomputes_and_saves_memory() {
    let none = plan_preset(
        "tiny-llama",
        &spec("mesh: {shard: 4}\nbatch: {per_rank: 2, seq_len: 32}\n"),
    );
    let full = plan_preset(
        "tiny-llama",
        &spec("mesh: {shard: 4}\nactivation_checkpointing: full\nbatch: {per_rank: 2, seq_len: 32}\n"),
    );
    let every2 = plan_preset(
        "tiny-llama",
        &spec("mesh: {shard: 4}\nactivation_checkpointing: {every: 2}\nbatch: {per_rank: 2, seq_len: 32}\n"),
    );
    let recomputes = |p: &Plan| p.steps.iter().filter(|s| s.phase.name() == "recompute").count();
    assert_eq!((recomputes(&none), recomputes(&every2), recomputes(&full)), (0, 1, 2));
    assert!(full.memory.max_by_category.activations < every2.memory.max_by_category.activations);
    assert!(every2.memory.max_by_category.activations < none.memory.max_by_category.activations);
    assert!(
        full.estimate.compute_s > none.estimate.compute_s,
        "recompute costs time"
    );
}

#[test]
fn selective_checkpointing_sits_between_none_and_full() {
    // llama3-8b, one block's activations of a 1 x 4096 batch: torchtitan's op policy keeps
    // attention and every second matmul output, so it saves less than no checkpointing
    // and recomputes less than full checkpointing.
    let with = |ac: &str| {
        plan_preset(
            "llama3-8b",
            &spec(&format!(
                "mesh: {{shard: 8}}\nbatch: {{per_rank: 1, seq_len: 4096}}\nactivation_checkpointing: {ac}\n"
            )),
        )
    };
    let (none, sel, full) = (with("none"), with("selective"), with("full"));
    let matmuls_all = with("{selective: {save: [attention, matmuls]}}");
    let nothing = with("{selective: {save: []}}");
    let act = |p: &Plan| p.memory.max_by_category.activations;
    assert!(
        act(&full) < act(&sel) && act(&sel) < act(&none),
        "{} {} {}",
        act(&full),
        act(&sel),
        act(&none)
    );
    assert!(act(&sel) < act(&matmuls_all) && act(&matmuls_all) <= act(&none));
    // Saving nothing is full checkpointing by another name.
    assert_eq!(act(&nothing), act(&full));
    assert_eq!(nothing.estimate.compute_s, full.estimate.compute_s);
    let c = |p: &Plan| p.estimate.compute_s;
    assert!(
        c(&none) < c(&sel) && c(&sel) < c(&full),
        "{} {} {}",
        c(&none),
        c(&sel),
        c(&full)
    );
    // The recompute steps hold only what is not saved: fewer nodes than full's.
    let recomputed = |p: &Plan| -> usize {
        p.steps
            .iter()
            .filter(|s| s.phase.name() == "recompute")
            .flat_map(|s| s.nodes.iter().map(|r| r.len()))
            .sum()
    };
    assert!(recomputed(&sel) < recomputed(&full) && recomputed(&sel) > 0);
    assert_eq!(sel.policy.activation_checkpointing.to_string(), "selective");
}
