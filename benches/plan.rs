//! Planning speed: group + layout + steps + schedule + simulate + estimate + verify on an
//! already differentiated model. Target: llama3-405b on 16,384 ranks (HSDP 2048 x 8) under
//! 100 ms on a 2-core machine; time linear in layers and independent of the replicate axis
//! (compare `llama3-405b-1x8` with `llama3-405b-2048x8`). `llama3-405b-32x64x8-tp` plans the
//! same 16,384 ranks with tensor parallelism over each node (target: under 10 ms).
//! `qwen3-30b-a3b-64-ep8` plans a mixture of experts (48 MoE layers of 128 experts) on 64
//! H100s with expert parallelism 8 (target: under 10 ms). `llama3.1-8b-131072-fsdp2-cp4`
//! plans Llama 3.1 8B at 131,072 tokens on 8 H100s as FSDP 2 x context parallelism 4
//! (target: under 10 ms).
//!
//! The `pipeline` group plans Llama 3.1 405B on 512 H100s as FSDP 8 x TP 8 x PP 8 (1F1B and
//! Interleaved1F1B, 32 micro-batches) from its traced forward graph: the stage cut and each
//! stage's autodiff, its FSDP plan, the schedule, the timeline and every rank's memory
//! (target: under 20 ms), and the 1F1B plan with Float8 tensorwise linears (target: under
//! 20 ms).

use criterion::{criterion_group, criterion_main, Criterion};
use shardplan_frontends::{load_model, load_parallel, trace_options};
use shardplan_ir::differentiate;
use shardplan_models::trace;
use std::hint::black_box;
use std::path::Path;

fn planning(c: &mut Criterion) {
    let mut group = c.benchmark_group("plan");
    group.sample_size(20);
    for (label, model, parallel) in [
        ("llama3-8b-1x8", "llama3-8b.yaml", "fsdp-8.yaml"),
        ("llama3-70b-8x8", "llama3-70b.yaml", "hsdp-8x8.yaml"),
        ("llama3-405b-1x8", "llama3-405b.yaml", "fsdp-1x8-405b.yaml"),
        ("llama3-405b-2048x8", "llama3-405b.yaml", "hsdp-2048x8.yaml"),
        ("llama3-405b-32x64x8-tp", "llama3-405b.yaml", "hsdp-32x64-tp-8.yaml"),
        ("qwen3-30b-a3b-64-ep8", "qwen3-30b-a3b.config.json", "ep-8-fsdp-64.yaml"),
        (
            "llama3.1-8b-131072-fsdp2-cp4",
            "llama3.1-8b.config.json",
            "long-context-fsdp-2-cp-4.yaml",
        ),
    ] {
        let m = load_model(&Path::new("examples/models").join(model)).expect("model");
        let p = load_parallel(&Path::new("examples/parallel").join(parallel)).expect("parallel");
        let graph = trace(&m.config, trace_options(Some(&p))).expect("trace");
        let joint = shardplan_ir::differentiate_with(&graph, p.config.diff_options()).expect("differentiate");
        group.bench_function(label, |b| {
            b.iter(|| shardplan_planner::plan(black_box(&joint), black_box(&p.config)).expect("plan"))
        });
        if label == "llama3-405b-2048x8" {
            group.bench_function("llama3-405b-2048x8-with-trace-and-autodiff", |b| {
                b.iter(|| {
                    let graph = trace(black_box(&m.config), trace_options(Some(&p))).expect("trace");
                    let joint = differentiate(&graph).expect("differentiate");
                    shardplan_planner::plan(&joint, &p.config).expect("plan")
                })
            });
        }
    }
    group.finish();
}

fn pipeline_planning(c: &mut Criterion) {
    let mut group = c.benchmark_group("pipeline");
    group.sample_size(20);
    for (label, parallel) in [
        ("llama3-405b-pp8-fsdp8-tp8-1f1b", "pp-8-fsdp-8-tp-8-405b.yaml"),
        (
            "llama3-405b-pp8-fsdp8-tp8-interleaved",
            "pp-8-fsdp-8-tp-8-405b-interleaved.yaml",
        ),
        (
            "llama3-405b-pp8-fsdp8-tp8-1f1b-float8",
            "pp-8-fsdp-8-tp-8-405b-float8.yaml",
        ),
    ] {
        let m = load_model(Path::new("examples/models/llama3-405b.yaml")).expect("model");
        let p = load_parallel(&Path::new("examples/parallel").join(parallel)).expect("parallel");
        let graph = trace(&m.config, trace_options(Some(&p))).expect("trace");
        group.bench_function(label, |b| {
            b.iter(|| {
                shardplan_planner::pipeline::plan_pipeline(black_box(&graph), black_box(&p.config), None).expect("plan")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, planning, pipeline_planning);
criterion_main!(benches);
