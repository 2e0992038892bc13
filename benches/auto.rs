//! Auto-planning speed: the whole `--auto` search (bounds for every candidate, the ones that
//! could win planned and simulated, the winner verified) for llama3-70b on 64 ranks,
//! llama3-405b on 2,048 H200s, and llama3-405b on 16,384 H100s (1 x 8192 tokens per rank,
//! bf16), the mesh split, bucketing, resharding, prefetch, checkpointing and the allocator
//! replay all searched. Targets: the 16,384-rank search < 100 ms; the exhaustive search of
//! the 2,048-rank case (every candidate planned) for the raw rate. The candidates evaluated
//! are printed once per case.
//!
//! The `-tp` cases are `plan --auto` itself (`search_model`): the tensor-parallel degree
//! searched too, the model traced and differentiated at each degree inside the timed
//! region, all degrees in one branch and bound.

use criterion::{criterion_group, criterion_main, Criterion};
use shardplan_frontends::{load_model, load_parallel, trace_options};
use shardplan_ir::differentiate;
use shardplan_models::trace;
use shardplan_planner::auto::{default_budget, search, search_model, AutoResult, Fixed, NoFit};
use std::path::Path;

fn auto(c: &mut Criterion) {
    let mut group = c.benchmark_group("auto");
    group.sample_size(10);
    for (label, model, spec) in [
        ("llama3-70b-64-ranks", "llama3-70b.yaml", "auto-64.yaml"),
        ("llama3-405b-2048-ranks", "llama3-405b.yaml", "auto-2048.yaml"),
        ("llama3-405b-16384-ranks", "llama3-405b.yaml", "auto-16384.yaml"),
    ] {
        let m = load_model(&Path::new("examples/models").join(model)).expect("model");
        let p = load_parallel(&Path::new("examples/parallel").join(spec)).expect("spec");
        let joint = differentiate(&trace(&m.config, trace_options(Some(&p))).expect("trace")).expect("autodiff");
        let budget = default_budget(&p.config.hardware);
        let fixed = Fixed::default();
        // The search's speed is measured whether or not a candidate fits the device.
        report(
            label,
            budget,
            search(&joint, &p.config, fixed, budget, true).expect("search"),
        );
        group.bench_function(label, |b| {
            b.iter(|| search(&joint, &p.config, fixed, budget, true).expect("search").is_ok())
        });
        if label != "llama3-70b-64-ranks" {
            let tp = format!("{label}-tp");
            report(
                &tp,
                budget,
                search_model(&m.config, &p.config, fixed, budget, true).expect("search"),
            );
            group.bench_function(&tp, |b| {
                b.iter(|| {
                    search_model(&m.config, &p.config, fixed, budget, true)
                        .expect("search")
                        .is_ok()
                })
            });
        }
        if label == "llama3-405b-2048-ranks" {
            // Without pruning: every candidate of the space costed (the raw rate).
            if let Ok(all) = search(&joint, &p.config, fixed, budget, false).expect("search") {
                eprintln!("{label}, exhaustive: {} candidates", all.evaluated);
            }
            group.bench_function(format!("{label}-exhaustive"), |b| {
                b.iter(|| search(&joint, &p.config, fixed, budget, false).expect("search").is_ok())
            });
        }
    }
    group.finish();
}

fn report(label: &str, budget: u64, found: Result<AutoResult, NoFit>) {
    match found {
        Ok(r) => eprintln!(
            "{label}: {} candidates evaluated, {} pruned; winner {:?}, {:?} s a step, device total {} B of {budget}",
            r.evaluated, r.pruned, r.candidates[0].knobs, r.candidates[0].step_s, r.winner.memory.device_total
        ),
        Err(no) => eprintln!(
            "{label}: no candidate fits {budget} B of device memory; the smallest needs {} B ({:?}, {:?} s a step)",
            no.best.device, no.best.knobs, no.best.step_s
        ),
    }
}

criterion_group!(benches, auto);
criterion_main!(benches);
