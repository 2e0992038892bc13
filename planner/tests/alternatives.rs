//! What would fit: the single changes offered when a spec misses its budget, each changing
//! one knob; re-planned, they report the peaks that planning or searching them gives.

mod common;

use common::parallel;
use shardplan_frontends::{
    parse_parallel_spec, ActivationCheckpointing, GradSync, Offload, ParallelConfig, Reshard, Source,
};
use shardplan_ir::{differentiate, JointGraph};
use shardplan_models::{preset, trace, TraceOptions};
use shardplan_planner::alternatives::{
    plan_alternatives, search_alternatives, try_plan_alternatives, try_search_alternatives, Alternative,
};
use shardplan_planner::auto::{default_budget, search, Fixed};
use shardplan_planner::plan;

/// Every knob open to a change: 2x4 mesh, batch 4 x 2 micro-batches synced once, deep
/// prefetch, no resharding, no checkpointing, no offload.
const OPEN: &str = "mesh: {replicate: 2, shard: 4}\ngpus_per_node: 4\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 4, seq_len: 64, grad_accum: 2, grad_sync: final_micro_batch}\nprefetch: {forward: 2, backward: 2}\nreshard_after_forward: false\n";

/// Every knob but the mesh already at its lowest-memory setting.
const TIGHT: &str = "mesh: {shard: 8}\ngpus_per_node: 8\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 1, seq_len: 64}\nactivation_checkpointing: full\noffload: cpu\n";

fn joint(model: &str, c: &ParallelConfig) -> JointGraph {
    let g = trace(
        &preset(model).unwrap(),
        TraceOptions {
            batch: c.batch.per_rank,
            seq_len: c.batch.seq_len,
            dtype: c.mixed_precision.param,
            ..Default::default()
        },
    )
    .unwrap();
    differentiate(&g).unwrap()
}

fn changes(alts: &[Alternative]) -> Vec<&str> {
    alts.iter().map(|a| a.change.as_str()).collect()
}

#[test]
fn plan_alternatives_each_change_the_knob_they_name() {
    let base = parallel(OPEN);
    let alts = plan_alternatives(&base);
    assert_eq!(
        changes(&alts),
        [
            "activation_checkpointing: full",
            "reshard_after_forward: true",
            "prefetch: {forward: 1, backward: 1}",
            "batch.grad_sync: every_micro_batch",
            "batch: {per_rank: 2, grad_accum: 4} (same global batch)",
            "mesh: {replicate: 2, shard: 8} (twice the ranks)",
            "offload: cpu",
        ]
    );
    let expect: [&dyn Fn(&mut ParallelConfig); 7] = [
        &|c| c.activation_checkpointing = ActivationCheckpointing::Full,
        &|c| c.reshard_after_forward = Reshard::AfterForward,
        &|c| (c.prefetch.forward, c.prefetch.backward) = (1, 1),
        &|c| c.batch.grad_sync = GradSync::EveryMicroBatch,
        &|c| (c.batch.per_rank, c.batch.grad_accum) = (2, 4),
        &|c| c.mesh.shard = 8,
        &|c| c.offload = Offload::Cpu,
    ];
    for (a, f) in alts.iter().zip(expect) {
        let mut want = base.clone();
        f(&mut want);
        assert_eq!(a.config, want, "{}", a.change);
    }
}

#[test]
fn plan_alternatives_leave_out_changes_the_spec_already_has() {
    let base = parallel(TIGHT);
    // Checkpointing, resharding, prefetch, sync and offload are already the lowest; a batch
    // of one cannot be halved.
    assert_eq!(
        changes(&plan_alternatives(&base)),
        ["mesh: {replicate: 1, shard: 16} (twice the ranks)"]
    );
}

#[test]
fn search_alternatives_are_ranks_batch_and_offload() {
    let open = search_alternatives(&parallel(OPEN));
    assert_eq!(
        changes(&open),
        [
            "twice the ranks (16 instead of 8)",
            "batch.per_rank 2 with grad_accum 4 (same global batch)",
            "offload: cpu",
        ]
    );
    let base = parallel(OPEN);
    assert_eq!((open[0].config.mesh.replicate, open[0].config.mesh.shard), (2, 8));
    assert_eq!((open[1].config.batch.per_rank, open[1].config.batch.grad_accum), (2, 4));
    assert_eq!(open[2].config.offload, Offload::Cpu);
    for a in &open {
        // Nothing else changes (the other knobs are the search's to pick).
        let mut back = a.config.clone();
        (back.mesh, back.batch, back.offload) = (base.mesh, base.batch, base.offload);
        assert_eq!(back, base, "{}", a.change);
    }
    assert_eq!(
        changes(&search_alternatives(&parallel(TIGHT))),
        ["twice the ranks (16 instead of 8)"]
    );
}

#[test]
fn tried_plan_alternatives_report_their_plans_fitting_first_then_closest() {
    let model = preset("tiny-llama").unwrap();
    let base = parallel(OPEN);
    let alts = plan_alternatives(&base);
    // (change, allocated peak, device total) of each alternative planned on its own.
    let planned: Vec<(String, u64, u64)> = alts
        .iter()
        .map(|a| {
            let m = plan(&joint("tiny-llama", &a.config), &a.config).unwrap().memory;
            (a.change.clone(), m.peak, m.device_total)
        })
        .collect();
    let mut sorted: Vec<u64> = planned.iter().map(|p| p.2).collect();
    sorted.sort_unstable();
    // Below every device total, between two of them, and above all.
    for budget in [sorted[0] - 1, sorted[3], sorted[6]] {
        let tried = try_plan_alternatives(&model, &base, budget);
        assert_eq!(tried.len(), alts.len(), "budget {budget}");
        for t in &tried {
            let want = planned.iter().find(|p| p.0 == t.change).unwrap();
            assert_eq!((t.peak, t.device), (want.1, want.2), "{}", t.change);
            assert_eq!(t.fits, t.device <= budget, "{}", t.change);
        }
        assert!(
            tried
                .windows(2)
                .all(|w| (!w[0].fits, w[0].device) <= (!w[1].fits, w[1].device)),
            "budget {budget}: {tried:?}"
        );
        assert_eq!(
            tried.iter().filter(|t| t.fits).count(),
            sorted.iter().filter(|&&p| p <= budget).count()
        );
    }
}

#[test]
fn tried_search_alternatives_report_what_their_searches_find() {
    let model = preset("tiny-llama").unwrap();
    let (base, origin) = parse_parallel_spec(&Source::from_text("open.yaml", OPEN)).unwrap();
    let fixed = Fixed::from_origin(&origin);
    // The least device memory any alternative's search can reach, and a byte less: the
    // first budget fits some alternative, the second none. (On a model this small the
    // device totals are whole allocator segments plus fixed overheads, so alternatives
    // often tie.)
    let least = search_alternatives(&base)
        .iter()
        .map(
            |a| match search(&joint("tiny-llama", &a.config), &a.config, fixed, 0, true).unwrap() {
                Err(no) => no.best.device,
                Ok(_) => panic!("a zero budget fits"),
            },
        )
        .min()
        .unwrap();
    let mut seen_fit = false;
    let mut seen_miss = false;
    for budget in [least, least - 1] {
        let tried = try_search_alternatives(&model, &base, fixed, budget);
        let alts = search_alternatives(&base);
        assert_eq!(
            changes(&alts),
            tried.iter().map(|t| t.change.as_str()).collect::<Vec<_>>()
        );
        for (a, t) in alts.iter().zip(&tried) {
            let (peak, device, fits) =
                match search(&joint("tiny-llama", &a.config), &a.config, fixed, budget, true).unwrap() {
                    Ok(r) => (r.winner.memory.peak, r.winner.memory.device_total, true),
                    Err(no) => (no.best.peak, no.best.device, false),
                };
            assert_eq!(
                (t.peak, t.device, t.fits),
                (peak, device, fits),
                "budget {budget}: {}",
                t.change
            );
            assert_eq!(t.fits, t.device <= budget, "budget {budget}: {}", t.change);
            seen_fit |= fits;
            seen_miss |= !fits;
        }
    }
    assert!(seen_fit && seen_miss, "the budgets should separate the alternatives");
}

#[test]
fn fixed_knobs_are_the_fields_the_spec_writes() {
    let fixed = |yaml: &str| Fixed::from_origin(&parse_parallel_spec(&Source::from_text("f.yaml", yaml)).unwrap().1);
    assert_eq!(fixed("mesh: {shard: 8}\n"), Fixed::default());
    assert_eq!(
        fixed("mesh: {replicate: 1, shard: 8}\nbucket_mib: 64\n"),
        Fixed {
            mesh_split: true,
            bucketing: true,
            ..Fixed::default()
        }
    );
    assert_eq!(
        fixed("mesh: {shard: 8}\nwrap_modules: [layers.0]\nreshard_after_forward: true\nprefetch: {forward: 1}\nactivation_checkpointing: none\noffload: none\n"),
        Fixed {
            mesh_split: false,
            bucketing: true,
            reshard: true,
            prefetch: true,
            checkpointing: true,
            offload: true,
            tensor: false,
            expert: false,
            context: false,
            float8: false,
        }
    );
    // `float8:` without a recipe leaves the recipe to the search; with one, it is fixed.
    assert_eq!(fixed("mesh: {shard: 8}\nfloat8: {}\n"), Fixed::default());
    assert_eq!(
        fixed("mesh: {shard: 8}\nfloat8: {recipe: rowwise}\n"),
        Fixed {
            float8: true,
            ..Fixed::default()
        }
    );
    assert_eq!(
        fixed("mesh: {shard: 4, tensor: 2}\n"),
        Fixed {
            tensor: true,
            ..Fixed::default()
        }
    );
}

#[test]
fn the_default_budget_is_the_device_memory() {
    // Context, NCCL and fragmentation are in each plan's device total, not held back here.
    let c = parallel("mesh: {shard: 8}\nhardware: {base: h100-sxm, hbm_gib: 80}\n");
    assert_eq!(default_budget(&c.hardware), 80 << 30);
}

#[test]
fn auto_tries_expert_degrees_for_a_mixture_of_experts_only() {
    use shardplan_planner::auto::expert_degrees;
    let spec = |yaml: &str| parse_parallel_spec(&Source::from_text("e.yaml", yaml)).unwrap();
    let moe = shardplan_models::preset("qwen3-30b-a3b").unwrap();
    let (c, o) = spec("mesh: {shard: 64}\ngpus_per_node: 8\n");
    // 128 experts: every power of two up to the node.
    assert_eq!(expert_degrees(&moe, &c, Fixed::from_origin(&o)), vec![1, 2, 4, 8]);
    let (c, o) = spec("mesh: {shard: 64, expert: 4}\ngpus_per_node: 8\n");
    assert_eq!(expert_degrees(&moe, &c, Fixed::from_origin(&o)), vec![4]);
    let (c, o) = spec("mesh: {shard: 64}\ngpus_per_node: 8\n");
    let llama = shardplan_models::preset("llama3-8b").unwrap();
    assert_eq!(expert_degrees(&llama, &c, Fixed::from_origin(&o)), vec![1]);
    // Mixtral's 8 experts on nodes of 16: 1 to 8.
    let (c, o) = spec("mesh: {shard: 32}\ngpus_per_node: 16\n");
    let mixtral = shardplan_models::preset("mixtral-8x7b").unwrap();
    assert_eq!(expert_degrees(&mixtral, &c, Fixed::from_origin(&o)), vec![1, 2, 4, 8]);
}
