//! Where a training step's time goes, by op kind: `cargo run --release -p
//! shardplan-executor --example profile_step -- MODEL.yaml PARALLEL.yaml`.

mod common;

use shardplan_frontends::{load_model, load_parallel, trace_options};
use shardplan_ir::differentiate;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

fn main() {
    shardplan_executor::host::retain_freed_memory();
    let args: Vec<String> = std::env::args().collect();
    let model = load_model(Path::new(args.get(1).map_or("examples/models/llama-10m.yaml", |s| s))).unwrap();
    let par = load_parallel(Path::new(
        args.get(2).map_or("examples/parallel/cpu-b4-s256.yaml", |s| s),
    ))
    .unwrap();
    let g = shardplan_models::trace(&model.config, trace_options(Some(&par))).unwrap();
    let joint = differentiate(&g).unwrap();
    let step = common::TimedStep::new(&joint);
    let mut times = vec![Duration::ZERO; joint.graph.node_count()];
    for _ in 0..3 {
        step.run(&mut times);
    }
    let mut by_op: BTreeMap<&str, (Duration, u64)> = BTreeMap::new();
    for (id, n) in joint.graph.nodes() {
        let e = by_op.entry(n.op.name()).or_default();
        e.0 += times[id.index()] / 3;
        e.1 += joint.graph.node_cost(id).fwd_flops;
    }
    let total: Duration = by_op.values().map(|v| v.0).sum();
    let mut rows: Vec<_> = by_op.into_iter().collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1 .0));
    println!("{:<20} {:>10} {:>6} {:>10}", "op", "ms/step", "share", "GFLOP/s");
    for (op, (t, flops)) in rows {
        let gf = if t.as_secs_f64() > 0.0 {
            flops as f64 / t.as_secs_f64() / 1e9
        } else {
            0.0
        };
        println!(
            "{op:<20} {:>10.1} {:>5.1}% {gf:>10.1}",
            t.as_secs_f64() * 1e3,
            100.0 * t.as_secs_f64() / total.as_secs_f64()
        );
    }
    println!("total {:.1} ms", total.as_secs_f64() * 1e3);
    if std::env::var_os("NODES").is_some() {
        let mut nodes: Vec<_> = joint
            .graph
            .nodes()
            .map(|(id, n)| (times[id.index()] / 3, id, n))
            .collect();
        nodes.sort_by_key(|r| std::cmp::Reverse(r.0));
        for (t, id, n) in nodes.into_iter().take(25) {
            let ins: Vec<String> = n.inputs.iter().map(|i| joint.graph.node(*i).ty.to_string()).collect();
            let gf = joint.graph.node_cost(id).fwd_flops as f64 / t.as_secs_f64() / 1e9;
            println!(
                "{:>7.2} ms {:>6.1} GFLOP/s {id} {} {} <- {}",
                t.as_secs_f64() * 1e3,
                gf,
                n.op.name(),
                n.op.attrs(),
                ins.join(", ")
            );
        }
    }
}
