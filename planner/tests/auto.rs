//! Auto-planning: the pruned search finds the brute-force optimum, its winner verifies and
//! fits, its emitted spec reproduces it, and more budget or more ranks never hurt.

mod common;

use common::parallel;
use shardplan_frontends::spec_yaml;
use shardplan_frontends::{parse_parallel_spec, ParallelConfig, Source};
use shardplan_ir::{differentiate, JointGraph};
use shardplan_models::{preset, trace, TraceOptions};
use shardplan_planner::allocator::stream_peaks;
use shardplan_planner::auto::{grid, model_spaces, search, search_model, AutoResult, Fixed};
use shardplan_planner::bounds::BoundCache;
use shardplan_planner::{plan, verify, Plan, PlanCache};

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

fn spec(shard: u64, per_rank: u64) -> ParallelConfig {
    parallel(&format!(
        "mesh: {{shard: {shard}}}\ngpus_per_node: 4\nmixed_precision: {{param: bf16, reduce: f32}}\nbatch: {{per_rank: {per_rank}, seq_len: 64}}\n"
    ))
}

fn run(j: &JointGraph, c: &ParallelConfig, budget: u64, prune: bool) -> Option<AutoResult> {
    search(j, c, Fixed::default(), budget, prune).unwrap().ok()
}

/// Budgets spread over the candidates' device totals (from the exhaustive search).
fn budgets(j: &JointGraph, c: &ParallelConfig) -> Vec<u64> {
    let all = run(j, c, u64::MAX, false).unwrap();
    let mut devices: Vec<u64> = all.candidates.iter().map(|c| c.device).collect();
    devices.sort_unstable();
    (0..8).map(|i| devices[i * (devices.len() - 1) / 7]).collect()
}

#[test]
fn pruned_search_finds_the_brute_force_optimum() {
    for model in ["tiny-llama", "tiny-gpt2"] {
        let c = spec(8, 2);
        let j = joint(model, &c);
        for b in budgets(&j, &c) {
            let (pruned, full) = (run(&j, &c, b, true), run(&j, &c, b, false));
            match (pruned, full) {
                (Some(p), Some(f)) => {
                    let (pw, fw) = (&p.candidates[0], &f.candidates[0]);
                    assert_eq!(
                        (pw.step_s, pw.peak, pw.device),
                        (fw.step_s, fw.peak, fw.device),
                        "{model} budget {b}: {:?} vs {:?}",
                        pw.knobs,
                        fw.knobs
                    );
                    assert!(p.evaluated <= f.evaluated);
                }
                (None, None) => {}
                (p, f) => panic!(
                    "{model} budget {b}: pruned found {}, exhaustive found {}",
                    p.is_some(),
                    f.is_some()
                ),
            }
        }
    }
}

/// Every candidate of the grid, planned in full (`plan`: the allocator replayed, the plan
/// verified), with its index.
fn every_plan(j: &JointGraph, c: &ParallelConfig) -> Vec<(usize, Plan)> {
    grid(j, c, Fixed::default())
        .into_iter()
        .enumerate()
        .map(|(i, (_, config))| (i, plan(j, &config).unwrap()))
        .collect()
}

/// The winner by definition among `(offload, plan)` candidates in search order: the index
/// of the least (step time, device total, index) among those without offload that fit, or
/// among those with it when none does.
fn fastest_fitting(cands: &[(bool, &Plan)], budget: u64) -> Option<usize> {
    let fitting = |offload: bool| {
        (0..cands.len())
            .filter(|&i| cands[i].0 == offload && cands[i].1.memory.device_total <= budget)
            .min_by(|&i, &k| {
                let (a, b) = (cands[i].1, cands[k].1);
                a.estimate
                    .step_s
                    .total_cmp(&b.estimate.step_s)
                    .then(a.memory.device_total.cmp(&b.memory.device_total))
                    .then(i.cmp(&k))
            })
    };
    fitting(false).or_else(|| fitting(true))
}

/// [`fastest_fitting`] of every candidate of the grid (`plans` as [`every_plan`] gives them).
fn brute_force<'a>(
    j: &JointGraph,
    c: &ParallelConfig,
    plans: &'a [(usize, Plan)],
    budget: u64,
) -> Option<&'a (usize, Plan)> {
    let g = grid(j, c, Fixed::default());
    let cands: Vec<(bool, &Plan)> = plans.iter().map(|(i, p)| (g[*i].0.offload, p)).collect();
    fastest_fitting(&cands, budget).map(|k| &plans[k])
}

#[test]
fn the_search_finds_the_brute_force_winner_and_its_bounds_hold() {
    for model in ["tiny-llama", "tiny-gpt2"] {
        let c = spec(8, 2);
        let j = joint(model, &c);
        let points = grid(&j, &c, Fixed::default());
        let plans = every_plan(&j, &c);
        // The bounds the search prunes on hold for every candidate.
        let (mut bounds, mut cache) = (BoundCache::default(), PlanCache::default());
        for ((knobs, config), (_, p)) in points.iter().zip(&plans) {
            let b = bounds.bounds(&j, config, &mut cache).unwrap();
            let m = &p.memory;
            assert!(
                b.step_s <= p.estimate.step_s,
                "{model} {knobs:?}: time bound {} > {}",
                b.step_s,
                p.estimate.step_s
            );
            assert!(
                b.device <= m.device_total,
                "{model} {knobs:?}: memory bound {} > {}",
                b.device,
                m.device_total
            );
            assert!(
                b.device <= m.peak + m.overhead.total(),
                "{model} {knobs:?}: memory bound {} above the allocated peak plus overheads",
                b.device
            );
            let streams = stream_peaks(&p.programs[0], &p.buffers, &p.steps);
            assert!(
                streams <= m.reserved_peak,
                "{model} {knobs:?}: stream peaks {streams} > reserved {}",
                m.reserved_peak
            );
        }
        // A deeper prefetch never lowers the allocated peak, other knobs equal.
        for (i, (k, _)) in points.iter().enumerate() {
            for (o, _) in &points[i.saturating_sub(3)..i] {
                let same = shardplan_planner::auto::Knobs {
                    prefetch_forward: k.prefetch_forward,
                    prefetch_backward: k.prefetch_backward,
                    ..o.clone()
                } == *k;
                if same && o.prefetch_forward <= k.prefetch_forward && o.prefetch_backward <= k.prefetch_backward {
                    let at = |x: &shardplan_planner::auto::Knobs| {
                        plans[points.iter().position(|(y, _)| y == x).unwrap()].1.memory.peak
                    };
                    assert!(at(o) <= at(k), "{model}: {k:?} peaks below {o:?}");
                }
            }
        }
        // The most activation bytes of any step depends on the checkpointing alone, not on
        // the grouping (the search's memory floor per policy rests on it), and more than
        // one grouping is compared.
        let mut act_max: std::collections::HashMap<String, (u64, Vec<u64>)> = Default::default();
        for ((knobs, _), (_, p)) in points.iter().zip(&plans) {
            let most = p.steps.iter().map(|s| s.act_peak).max().unwrap();
            let seen = act_max
                .entry(knobs.activation_checkpointing.clone())
                .or_insert((most, Vec::new()));
            assert_eq!(
                seen.0, most,
                "{model} {knobs:?}: most activation bytes differ between groupings"
            );
            if !seen.1.contains(&knobs.blocks_per_group) {
                seen.1.push(knobs.blocks_per_group);
            }
        }
        assert!(act_max.values().all(|(_, groupings)| groupings.len() > 1), "{model}");
        // Budgets at every distinct device total (each one just fits a candidate), and
        // between them.
        let mut totals: Vec<u64> = plans.iter().map(|(_, p)| p.memory.device_total).collect();
        totals.sort_unstable();
        totals.dedup();
        // Bounds for a budget hold too (where the activations alone exceed it, they are
        // that floor and a zero time), and such a floor exceeds the budget; some are.
        let mut floored = 0;
        let ctx = c.hardware.cuda_context_bytes();
        let low = [totals[0] / 2, ctx + 1];
        for &b in totals.iter().step_by(totals.len().div_ceil(8).max(1)).chain(&low) {
            let (mut bounds, mut cache) = (BoundCache::with_budget(b), PlanCache::default());
            for ((knobs, config), (_, p)) in points.iter().zip(&plans) {
                let x = bounds.bounds(&j, config, &mut cache).unwrap();
                assert!(x.step_s <= p.estimate.step_s, "{model} {knobs:?} budget {b}");
                assert!(x.device <= p.memory.device_total, "{model} {knobs:?} budget {b}");
                if x.step_s == 0.0 {
                    assert!(x.device > b, "{model} {knobs:?} budget {b}");
                    let most = p.steps.iter().map(|s| s.act_peak).max().unwrap();
                    assert_eq!(
                        x.device,
                        most + ctx,
                        "{model} {knobs:?}: the floor is not the activations'"
                    );
                    floored += 1;
                }
            }
        }
        assert!(floored > 0, "{model}: no candidate's activations exceed a budget");
        let step = totals.len().div_ceil(24).max(1);
        let budgets: Vec<u64> = totals
            .iter()
            .step_by(step)
            .flat_map(|&t| [t - 1, t])
            .chain([totals[0] / 2, u64::MAX])
            .collect();
        for b in budgets {
            let fast = run(&j, &c, b, true);
            match (brute_force(&j, &c, &plans, b), fast) {
                (Some((i, p)), Some(r)) => {
                    let w = &r.candidates[0];
                    assert_eq!(w.knobs, points[*i].0, "{model} budget {b}");
                    assert_eq!(
                        (w.step_s, w.peak, w.device),
                        (p.estimate.step_s, p.memory.peak, p.memory.device_total),
                        "{model} budget {b}"
                    );
                    assert_eq!(r.winner.estimate.step_s, p.estimate.step_s);
                    assert!(
                        r.evaluated < plans.len() || b == u64::MAX,
                        "{model} budget {b}: nothing pruned"
                    );
                }
                (None, None) => {}
                (bf, fast) => panic!(
                    "{model} budget {b}: brute force found {}, the search {}",
                    bf.is_some(),
                    fast.is_some()
                ),
            }
        }
    }
}

/// `--auto`'s search over the tensor-parallel degrees too (one branch and bound over the
/// union of every degree's grid) finds the brute-force winner of that union, and when
/// nothing fits, the least device total of all.
#[test]
fn the_search_over_tensor_degrees_finds_the_brute_force_winner() {
    for model in ["tiny-llama", "tiny-gpt2"] {
        let m = preset(model).unwrap();
        // NCCL's buffers at a size that does not drown a tiny model's (a tensor group adds
        // a communicator), so that every degree can win at some budget.
        let c = parallel(
            "mesh: {shard: 8}\ngpus_per_node: 4\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 1, seq_len: 128}\nhardware: {base: h100-sxm, nccl_channel_mib: 0.01}\n",
        );
        let spaces = model_spaces(&m, &c, Fixed::default()).unwrap();
        let degrees: Vec<u64> = spaces.iter().map(|(_, s)| s.mesh.tensor).collect();
        assert!(degrees.len() >= 2, "{model}: degrees {degrees:?}");
        // Every candidate of every degree, planned in full, in the search's order.
        let mut all = Vec::new();
        for (j, base) in &spaces {
            for (knobs, config) in grid(j, base, Fixed::default()) {
                all.push((knobs, plan(j, &config).unwrap()));
            }
        }
        let mut totals: Vec<u64> = all.iter().map(|(_, p)| p.memory.device_total).collect();
        totals.sort_unstable();
        totals.dedup();
        let cands: Vec<(bool, &Plan)> = all.iter().map(|(k, p)| (k.offload, p)).collect();
        let brute = |b: u64| fastest_fitting(&cands, b).map(|i| (i, &all[i]));
        // Budgets spread over the device totals, and the first at which each degree wins.
        let step = totals.len().div_ceil(16).max(1);
        let mut budgets: Vec<u64> = totals
            .iter()
            .step_by(step)
            .flat_map(|&t| [t - 1, t])
            .chain([totals[0] / 2, u64::MAX])
            .collect();
        for &d in &degrees {
            budgets.extend(
                totals
                    .iter()
                    .copied()
                    .find(|&t| brute(t).is_some_and(|(_, (k, _))| k.tensor == d)),
            );
        }
        let mut winners = std::collections::BTreeSet::new();
        for b in budgets {
            match (brute(b), search_model(&m, &c, Fixed::default(), b, true).unwrap()) {
                (Some((_, (k, p))), Ok(r)) => {
                    let w = &r.candidates[0];
                    assert_eq!(&w.knobs, k, "{model} budget {b}");
                    assert_eq!(
                        (w.step_s, w.peak, w.device),
                        (p.estimate.step_s, p.memory.peak, p.memory.device_total),
                        "{model} budget {b}"
                    );
                    assert_eq!(r.winner.estimate.step_s, p.estimate.step_s);
                    assert_eq!(r.config.mesh.tensor, k.tensor);
                    winners.insert(k.tensor);
                }
                (None, Err(no)) => {
                    let least = totals[0];
                    assert_eq!(no.best.device, least, "{model} budget {b}: not the least device total");
                    assert!(no.best.device_exact);
                }
                (bf, fast) => panic!(
                    "{model} budget {b}: brute force found {}, the search {}",
                    bf.is_some(),
                    fast.is_ok()
                ),
            }
        }
        // The grid's budgets make more than one degree win, so the union is exercised.
        let least = |d: u64| {
            all.iter()
                .filter(|(k, _)| k.tensor == d)
                .map(|(_, p)| p.memory.device_total)
                .min()
        };
        assert!(
            winners.len() >= 2,
            "{model}: winners only at degrees {winners:?}; least totals {:?}",
            degrees.iter().map(|&d| least(d)).collect::<Vec<_>>()
        );
    }
}

#[test]
fn the_winner_verifies_fits_and_its_spec_reproduces_it() {
    let c = spec(8, 2);
    let j = joint("tiny-llama", &c);
    for b in budgets(&j, &c).into_iter().skip(1) {
        let Some(r) = run(&j, &c, b, true) else { continue };
        verify(&r.winner, Some(b)).unwrap();
        let yaml = spec_yaml(&r.config);
        let back = parse_parallel_spec(&Source::from_text("emitted.yaml", yaml.clone()))
            .unwrap_or_else(|e| panic!("{e}\n{yaml}"))
            .0;
        assert_eq!(back, r.config, "{yaml}");
        let again = plan(&j, &back).unwrap();
        assert_eq!(
            serde_json::to_string(&again).unwrap(),
            serde_json::to_string(&r.winner).unwrap()
        );
    }
}

#[test]
fn more_budget_never_gives_a_slower_winner() {
    let c = spec(8, 2);
    let j = joint("tiny-llama", &c);
    let mut last: Option<f64> = None;
    for b in budgets(&j, &c) {
        if let Some(r) = run(&j, &c, b, true) {
            let t = r.candidates[0].step_s;
            if let Some(prev) = last {
                assert!(t <= prev, "budget {b}: {t} > {prev}");
            }
            last = Some(t);
        }
    }
    assert!(last.is_some());
}

/// Adding ranks at a fixed global batch: the least memory any plan needs per rank never
/// rises, so a budget met with fewer ranks is met with more. (The fastest plan's own peak
/// may rise: with more ranks a faster, hungrier configuration can start to fit.)
#[test]
fn more_ranks_at_a_fixed_global_batch_never_need_more_memory() {
    let global = 16;
    let mut last: Option<(u64, Option<u64>)> = None;
    for shard in [2u64, 4, 8, 16] {
        let c = spec(shard, global / shard);
        let j = joint("tiny-llama", &c);
        let all = run(&j, &c, u64::MAX, false).unwrap();
        let least = all.candidates.iter().map(|c| c.device).min().unwrap();
        if let Some((prev_least, prev_budget)) = last {
            assert!(
                least <= prev_least,
                "shard {shard}: least device total {least} > {prev_least}"
            );
            if let Some(b) = prev_budget {
                assert!(
                    run(&j, &c, b, true).is_some(),
                    "shard {shard}: the budget {b} met before is not met"
                );
            }
        }
        let winner_at = run(&j, &c, least * 2, true).map(|_| least * 2);
        last = Some((least, winner_at));
    }
}

#[test]
fn a_custom_profile_round_trips_through_the_emitted_spec() {
    // A calibrated CPU profile: fused kernels, and a name YAML would split unquoted.
    let yaml = "mesh: {shard: 2}\ngpus_per_node: 2\nmixed_precision: {param: f32, reduce: f32}\nbatch: {per_rank: 2, seq_len: 16}\nhardware: {base: h100-sxm, name: \"cpu: 2 cores, calibrated\", kernels: fused, f32_tflops: 0.2}\n";
    let c = parse_parallel_spec(&Source::from_text("p.yaml", yaml)).unwrap().0;
    assert_eq!(c.hardware.kernels, shardplan_frontends::KernelMode::Fused);
    let emitted = spec_yaml(&c);
    let back = parse_parallel_spec(&Source::from_text("emitted.yaml", emitted.clone()))
        .unwrap_or_else(|e| panic!("{e}\n{emitted}"))
        .0;
    assert_eq!(back.hardware, c.hardware, "{emitted}");
    assert_eq!(back, c, "{emitted}");
}

#[test]
fn the_emitted_spec_keeps_a_non_default_allocator() {
    let c = spec(8, 2);
    assert!(!spec_yaml(&c).contains("allocator"), "the default is not written");
    let mut off = c.clone();
    off.allocator.expandable_segments = false;
    let yaml = spec_yaml(&off);
    assert!(yaml.contains("allocator: {expandable_segments: false}"), "{yaml}");
    let back = parse_parallel_spec(&Source::from_text("emitted.yaml", yaml.clone()))
        .unwrap_or_else(|e| panic!("{e}\n{yaml}"))
        .0;
    assert_eq!(back, off, "{yaml}");
}

/// `float8:` without a recipe makes the recipe a knob: the search plans bf16 and every
/// recipe, names each candidate's, says what the winner's bought against the best bf16 (or
/// other recipe) candidate, and emits a spec that plans to the winner. Without `float8:`
/// (or with a recipe) nothing about Float8 is searched.
#[test]
fn float8_without_a_recipe_is_searched() {
    let model = preset("llama3-8b").unwrap();
    let base = "mesh: {shard: 8}\ngpus_per_node: 8\nhardware: h100-sxm\nmixed_precision: {param: bf16, reduce: f32}\nbatch: {per_rank: 1, seq_len: 4096}\nactivation_checkpointing: full\n";
    let search_of = |extra: &str| {
        let (c, origin) = parse_parallel_spec(&Source::from_text("p.yaml", format!("{base}{extra}"))).unwrap();
        let fixed = Fixed::from_origin(&origin);
        search_model(&model, &c, fixed, 80 << 30, true).unwrap().ok().unwrap()
    };
    let names = |r: &AutoResult| {
        let mut v: Vec<String> = r.candidates.iter().map(|c| c.knobs.float8.clone()).collect();
        v.sort();
        v.dedup();
        v
    };
    // Every recipe is a space of the search; the pruned candidates keep bf16 and the best.
    let spaces = |extra: &str| {
        let (c, origin) = parse_parallel_spec(&Source::from_text("p.yaml", format!("{base}{extra}"))).unwrap();
        let mut v: Vec<String> = model_spaces(&model, &c, Fixed::from_origin(&origin))
            .unwrap()
            .iter()
            .map(|(_, c)| shardplan_planner::auto::float8_name(&c.float8))
            .collect();
        v.sort();
        v.dedup();
        v
    };
    assert_eq!(
        spaces("float8: {}\n"),
        ["none", "rowwise", "rowwise_with_gw_hp", "tensorwise"]
    );
    assert_eq!(
        spaces("float8: {filter_fqns: [auto_filter_small_kn]}\n"),
        ["none", "rowwise", "tensorwise"]
    );
    let open = search_of("float8: {}\n");
    assert!(names(&open).len() >= 2, "{:?}", names(&open));
    let effects = shardplan_planner::auto::knob_effects(&open.candidates, 80 << 30);
    assert!(effects.iter().any(|e| e.starts_with("float8 ")), "{effects:?}");
    // The winner's spec plans to it.
    let (again, _) = parse_parallel_spec(&Source::from_text("w.yaml", spec_yaml(&open.config))).unwrap();
    assert_eq!(again.float8, open.config.float8);
    assert_eq!(spaces(""), ["none"]);
    assert_eq!(spaces("float8: {recipe: rowwise}\n"), ["rowwise"]);
}
