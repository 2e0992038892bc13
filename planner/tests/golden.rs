//! Golden snapshots of printed plans for tiny models: a refactor must leave them unchanged;
//! a deliberate change updates them in the same commit, with the reason.

mod common;

use common::plan_preset;
use shardplan_planner::print::text;

const BASE: &str = "gpus_per_node: 4\nmixed_precision: {param: bf16, reduce: f32}\n";

fn golden(name: &str, model: &str, extra: &str) {
    let batch = if extra.contains("batch:") {
        ""
    } else {
        "batch: {per_rank: 2, seq_len: 16}\n"
    };
    let plan = plan_preset(model, &format!("{BASE}{batch}{extra}"));
    insta::assert_snapshot!(name, text(&plan, 1));
}

#[test]
fn fsdp_1x4() {
    golden("fsdp_1x4", "tiny-llama", "mesh: {shard: 4}\n");
}

#[test]
fn hsdp_2x2() {
    golden("hsdp_2x2", "tiny-llama", "mesh: {replicate: 2, shard: 2}\n");
}

#[test]
fn reshard_after_forward_false() {
    golden(
        "reshard_false",
        "tiny-llama",
        "mesh: {shard: 4}\nreshard_after_forward: false\n",
    );
}

#[test]
fn reshard_after_forward_int() {
    golden(
        "reshard_int_2",
        "tiny-llama",
        "mesh: {shard: 4}\nreshard_after_forward: 2\n",
    );
}

#[test]
fn prefetch_2() {
    golden(
        "prefetch_2",
        "tiny-llama",
        "mesh: {shard: 4}\nprefetch: {forward: 2, backward: 2}\n",
    );
}

#[test]
fn grad_accum_4() {
    golden(
        "grad_accum_4",
        "tiny-llama",
        "mesh: {shard: 4}\nbatch: {per_rank: 2, seq_len: 16, grad_accum: 4}\n",
    );
}

#[test]
fn grad_accum_4_final_micro_batch() {
    golden(
        "grad_accum_4_final",
        "tiny-llama",
        "mesh: {replicate: 2, shard: 2}\nbatch: {per_rank: 2, seq_len: 16, grad_accum: 4, grad_sync: final_micro_batch}\n",
    );
}

#[test]
fn cpu_offload() {
    golden("offload_cpu", "tiny-llama", "mesh: {shard: 4}\noffload: cpu\n");
}

#[test]
fn activation_checkpointing_full() {
    golden(
        "ac_full",
        "tiny-llama",
        "mesh: {shard: 4}\nactivation_checkpointing: full\n",
    );
}

#[test]
fn gpt2_fsdp_1x4() {
    golden("gpt2_fsdp_1x4", "tiny-gpt2", "mesh: {shard: 4}\n");
}

#[test]
fn fsdp2_runtime() {
    // PyTorch FSDP2's run of the fsdp_1x4 layout: flat all-gather outputs copied out,
    // all-gather and reduce-scatter state, AdamW step tensors, shardplan's own prediction.
    golden("fsdp2_1x4", "tiny-llama", "mesh: {shard: 4}\nruntime: fsdp2\n");
}
