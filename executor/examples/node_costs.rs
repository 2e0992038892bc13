//! Every node of a training step: its kernel's measured time (the reference interpreter,
//! median of 20 steps) beside the planner's `OpModel` prediction on the spec's hardware, by
//! op kind (`NODES=1` lists every node): `cargo run --release -p shardplan-executor
//! --example node_costs -- MODEL PARALLEL.yaml` (a spec with `calibrate`'s `hardware:` line).
mod common;

use shardplan_frontends::{load_model, load_parallel, trace_options};
use shardplan_ir::differentiate;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

fn main() {
    shardplan_executor::host::retain_freed_memory();
    let args: Vec<String> = std::env::args().collect();
    let model = load_model(Path::new(&args[1])).unwrap();
    let par = load_parallel(Path::new(&args[2])).unwrap();
    let hw = par.config.hardware.clone();
    let mut opts = trace_options(Some(&par));
    if let Some(b) = args.get(3) {
        opts.batch = b.parse().unwrap();
    }
    let g = shardplan_models::trace(&model.config, opts).unwrap();
    let joint = differentiate(&g).unwrap();
    let om = shardplan_planner::OpModel::new(&joint.graph, &hw, shardplan_ir::DType::F32);
    let step = common::TimedStep::new(&joint);
    let reps = 20u32;
    let mut all: Vec<Vec<Duration>> = vec![Vec::new(); joint.graph.node_count()];
    for r in 0..reps + 2 {
        let mut times = vec![Duration::ZERO; joint.graph.node_count()];
        step.run(&mut times);
        if r >= 2 {
            for (i, t) in times.into_iter().enumerate() {
                all[i].push(t);
            }
        }
    }
    let med = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let mut by_op: BTreeMap<String, (f64, f64, u32)> = BTreeMap::new();
    let (mut tm, mut tp) = (0.0, 0.0);
    let verbose = std::env::var_os("NODES").is_some();
    for (id, n) in joint.graph.nodes() {
        let m = med(&mut all[id.index()]).as_secs_f64() * 1e6;
        let p = om.seconds(id) * 1e6;
        let e = by_op.entry(n.op.name().to_string()).or_default();
        e.0 += m;
        e.1 += p;
        e.2 += 1;
        tm += m;
        tp += p;
        if verbose {
            let ins: Vec<String> = n.inputs.iter().map(|i| joint.graph.node(*i).ty.to_string()).collect();
            println!(
                "{:>9.1} {:>9.1} {id} {} {} -> {} <- {}",
                m,
                p,
                n.op.name(),
                n.op.attrs(),
                n.ty,
                ins.join(", ")
            );
        }
    }
    println!("{:<20} {:>5} {:>10} {:>10} {:>6}", "op", "n", "meas us", "pred us", "x");
    for (op, (m, p, c)) in by_op {
        println!("{op:<20} {c:>5} {m:>10.1} {p:>10.1} {:>6.2}", m / p.max(1e-9));
    }
    println!(
        "total meas {tm:.1} us pred {tp:.1} us  nodes {}",
        joint.graph.node_count()
    );
}
