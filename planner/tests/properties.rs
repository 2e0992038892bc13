//! Generated models, meshes and policies: every plan verifies, planning is deterministic,
//! the Plan survives JSON, and memory behaves as sharding promises.

mod common;

use common::gen::{llama, model, policy, spec, Policy};
use common::plan_model;
use proptest::prelude::*;
use shardplan_planner::{Category, Instr, Plan};

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// `plan` runs the verifier itself; a rejected plan is an error there. Planning twice
    /// gives byte-identical JSON, and reading the JSON back gives an equal Plan.
    #[test]
    fn plans_verify_deterministically_and_round_trip(
        m in model(),
        replicate in 1u64..3,
        shard in prop::sample::select(vec![1u64, 2, 4]),
        p in policy(),
    ) {
        let yaml = spec(replicate, shard, &p);
        let a = plan_model(&m, &yaml);
        let b = plan_model(&m, &yaml);
        let ja = serde_json::to_string(&a).unwrap();
        prop_assert_eq!(&ja, &serde_json::to_string(&b).unwrap());
        let back: Plan = serde_json::from_str(&ja).unwrap();
        prop_assert!(back == a, "the plan read back from JSON differs");
        shardplan_planner::verify(&back, None).unwrap();
        // Sharded bytes over the group are the model's bytes plus padding.
        for g in &a.groups {
            prop_assert_eq!(g.layout.shard_numel * shard, g.layout.numel + g.layout.padding());
        }
        // Activations are all freed by the end of each micro-batch.
        prop_assert_eq!(a.steps.last().unwrap().act_end, 0);
    }

    /// Doubling the shard axis never raises the per-rank peak (no padding: dim-0 sizes are
    /// multiples of every shard size here).
    #[test]
    fn peak_memory_never_rises_when_the_shard_axis_doubles(
        m in model(),
        shard in prop::sample::select(vec![1u64, 2, 4]),
        p in policy(),
    ) {
        let p = Policy { reshard: if p.reshard == "2" { "true" } else { p.reshard }, ..p };
        let small = plan_model(&m, &spec(1, shard, &p));
        let big = plan_model(&m, &spec(1, shard * 2, &p));
        prop_assert!(
            big.memory.peak <= small.memory.peak,
            "shard {} peak {} > shard {} peak {}", shard * 2, big.memory.peak, shard, small.memory.peak
        );
    }
}

/// FSDP2's accounting of the optimizer step: with f32 sharded parameters and AdamW, the
/// step holds parameters, gradients and two moments: 4 x S x 4 bytes for S sharded elements.
#[test]
fn adam_step_holds_four_f32_copies_of_the_shard() {
    let m = llama(64, 64, 2, 4, 2, 128, false);
    let plan = plan_model(
        &m,
        "mesh: {shard: 4}\ngpus_per_node: 4\nbatch: {per_rank: 1, seq_len: 8}\n",
    );
    let s: u64 = plan.groups.iter().map(|g| g.layout.shard_numel).sum();
    let first_step = plan.programs[0]
        .instrs
        .iter()
        .position(|i| matches!(i.instr, Instr::OptimizerStep { .. }))
        .unwrap();
    let state: u64 = [
        Category::ShardedParams,
        Category::ShardedGrads,
        Category::OptimizerState,
    ]
    .iter()
    .map(|&c| {
        let mut live = plan
            .buffers
            .iter()
            .filter(|b| b.persistent && b.category == c)
            .map(|b| b.bytes())
            .sum::<u64>();
        for i in &plan.programs[0].instrs[..first_step] {
            match i.instr {
                Instr::Alloc { buf } if plan.buffer(buf).category == c => live += plan.buffer(buf).bytes(),
                Instr::Free { buf } if plan.buffer(buf).category == c => live -= plan.buffer(buf).bytes(),
                _ => {}
            }
        }
        live
    })
    .sum();
    assert_eq!(state, 4 * s * 4);
    assert_eq!(plan.memory.max_by_category.optimizer_state, 2 * s * 4);
    assert_eq!(plan.memory.max_by_category.sharded_params, s * 4);
    assert_eq!(plan.memory.max_by_category.sharded_grads, s * 4);
}

/// DeepSpeed ZeRO-3's model-state estimate per GPU is `18 P / N + 4 L` bytes (fp16 params
/// and grads, fp32 master, Adam moments; L the largest layer's parameters). FSDP2 keeps no
/// persistent bf16 shard, so its model state is 16 P / N, and it gathers the working layer,
/// its gradients and a reduce buffer on top. In the no-activation limit the planned peak
/// must lie between the 16 P / N floor and DeepSpeed's estimate.
#[test]
fn model_state_matches_zero3_accounting_in_the_no_activation_limit() {
    let m = llama(64, 256, 32, 4, 4, 512, false);
    let n = 8u64;
    let plan = plan_model(
        &m,
        &format!(
            "mesh: {{shard: {n}}}\ngpus_per_node: 8\nmixed_precision: {{param: bf16, reduce: f32}}\n\
             prefetch: {{forward: 0, backward: 0}}\nbatch: {{per_rank: 1, seq_len: 1}}\n"
        ),
    );
    let p = plan.params;
    let largest = plan.groups.iter().map(|g| g.layout.numel).max().unwrap();
    let model_state = plan.memory.peak - plan.memory.at_peak.activations;
    assert!(
        plan.memory.at_peak.activations * 100 < plan.memory.peak,
        "activations are negligible"
    );
    assert!(model_state >= 16 * p / n, "{model_state} < 16 P / N = {}", 16 * p / n);
    assert!(
        model_state <= 18 * p / n + 4 * largest,
        "{model_state} > 18 P / N + 4 L = {}",
        18 * p / n + 4 * largest
    );
}
