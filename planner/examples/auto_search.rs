//! The `--auto` search on one model and spec, timed, with its candidates: for tuning the
//! search. `cargo run --release -p shardplan-planner --example auto_search -- MODEL SPEC
//! [exhaustive]` (defaults: llama3-405b on examples/parallel/auto-16384.yaml).

use shardplan_frontends::{load_model, load_parallel, trace_options};
use shardplan_ir::differentiate;
use shardplan_models::trace;
use shardplan_planner::auto::{default_budget, search, Fixed};
use std::path::Path;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model = args.get(1).map_or("examples/models/llama3-405b.yaml", |s| s.as_str());
    let spec = args.get(2).map_or("examples/parallel/auto-16384.yaml", |s| s.as_str());
    let prune = args.get(3).map(|s| s.as_str()) != Some("exhaustive");
    let m = load_model(Path::new(model)).expect("model");
    let p = load_parallel(Path::new(spec)).expect("spec");
    let joint = differentiate(&trace(&m.config, trace_options(Some(&p))).expect("trace")).expect("autodiff");
    let budget = default_budget(&p.config.hardware);
    let t = Instant::now();
    let r = search(&joint, &p.config, Fixed::default(), budget, prune).expect("search");
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    match r {
        Ok(r) => {
            println!(
                "{ms:.1} ms: {} evaluated, {} pruned, {} candidates listed",
                r.evaluated,
                r.pruned,
                r.candidates.len()
            );
            for c in r.candidates.iter().take(40) {
                println!(
                    "{:>9.4} s  peak {:>7.2} GiB  device {:>7.2} GiB{}  fits {}  {:?}",
                    c.step_s,
                    gib(c.peak),
                    gib(c.device),
                    if c.device_exact { "" } else { " (bound)" },
                    c.fits,
                    c.knobs
                );
            }
            let w = &r.winner.memory;
            println!(
                "winner: allocated {:.2} GiB, reserved {:.2} GiB, device total {:.2} GiB of {:.2}",
                gib(w.peak),
                gib(w.reserved_peak),
                gib(w.device_total),
                gib(budget)
            );
        }
        Err(no) => println!(
            "{ms:.1} ms: nothing fits {:.2} GiB; the smallest needs {:.2} GiB: {:?}",
            gib(budget),
            gib(no.best.device),
            no.best.knobs
        ),
    }
}
