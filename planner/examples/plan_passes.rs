//! Time of each planning pass on llama3-405b (HSDP 2048x8), or on the model and parallel
//! spec given, for tuning the planner:
//! `cargo run --release -p shardplan-planner --example plan_passes [MODEL PARALLEL [N]]`
//! (paths from the repository root). With N, it plans N times and prints nothing else: a
//! whole-process timer (two builds side by side) then compares the planner alone.

use shardplan_frontends::{load_model, load_parallel, trace_options};
use shardplan_ir::differentiate_with;
use shardplan_models::trace;
use std::path::Path;
use std::time::Instant;

fn time(label: &str, n: u32, mut f: impl FnMut()) {
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    println!("{label}: {:.3} ms", t.elapsed().as_secs_f64() * 1e3 / f64::from(n));
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (model, parallel, repeat) = match args.as_slice() {
        [m, p] => (m.as_str(), p.as_str(), None),
        [m, p, n] => (
            m.as_str(),
            p.as_str(),
            Some(n.parse::<u32>().expect("N: a count of plans")),
        ),
        _ => (
            "examples/models/llama3-405b.yaml",
            "examples/parallel/hsdp-2048x8.yaml",
            None,
        ),
    };
    let m = load_model(Path::new(model)).expect("model");
    let p = load_parallel(Path::new(parallel)).expect("spec");
    let g = trace(&m.config, trace_options(Some(&p))).expect("trace");
    let joint = differentiate_with(&g, p.config.diff_options()).expect("autodiff");
    let plan = shardplan_planner::plan(&joint, &p.config).expect("plan");
    if let Some(n) = repeat {
        for _ in 1..n {
            std::hint::black_box(shardplan_planner::plan(&joint, &p.config).expect("plan"));
        }
        return;
    }
    let groups: Vec<_> = plan.groups.iter().map(|g| g.group.clone()).collect();
    let policy = shardplan_planner::WrapPolicy::kinds(&p.config.wrap);
    time("plan (all passes)", 20, || {
        shardplan_planner::plan(&joint, &p.config).expect("plan");
    });
    time("group", 20, || {
        shardplan_planner::group(&joint.graph, &policy).expect("group");
    });
    let runner = shardplan_planner::Runner::of(&p.config);
    time("steps", 20, || {
        shardplan_planner::steps_and_events(&joint, &groups, p.config.activation_checkpointing, runner);
    });
    let (_, acts) = shardplan_planner::steps_and_events(&joint, &groups, p.config.activation_checkpointing, runner);
    let mut replay = shardplan_planner::allocator::replay(&plan.programs[0], &plan.buffers, &acts, p.config.allocator);
    for (label, settings) in [
        (
            "caching-allocator replay, expandable segments",
            shardplan_frontends::AllocatorConfig::TORCHTITAN,
        ),
        (
            "caching-allocator replay, cudaMalloc segments",
            shardplan_frontends::AllocatorConfig::CUDA_MALLOC,
        ),
    ] {
        time(label, 20, || {
            replay = shardplan_planner::allocator::replay(&plan.programs[0], &plan.buffers, &acts, settings);
        });
    }
    time("arena", 20, || {
        shardplan_planner::arena::report(&plan).expect("arena");
    });
    time("arena layout", 20, || {
        shardplan_planner::arena::layout(&plan, 0).expect("arena");
    });
    let a = shardplan_planner::arena::layout(&plan, 0).expect("arena");
    time("arena check", 20, || {
        shardplan_planner::arena::check(&plan, 0, &a).expect("arena");
    });
    time("verify", 20, || shardplan_planner::verify(&plan, None).expect("verify"));
    println!(
        "{} nodes, {} steps, {} instructions, {} buffers, {} activation events x {} replayed steps",
        joint.graph.node_count(),
        plan.steps.len(),
        plan.programs[0].instrs.len(),
        plan.buffers.len(),
        acts.events.len(),
        replay.steps
    );
}
