//! Tracing speed: model config to IR graph. Target: llama3-405b (126 blocks) under 20 ms
//! on a 2-core machine.

use criterion::{criterion_group, criterion_main, Criterion};
use shardplan_models::{preset, trace, TraceOptions};
use std::hint::black_box;

fn tracing(c: &mut Criterion) {
    let mut group = c.benchmark_group("trace");
    for name in ["llama3-8b", "llama3-70b", "llama3-405b", "gpt2-xl"] {
        let config = preset(name).expect("preset");
        group.bench_function(name, |b| {
            b.iter(|| trace(black_box(&config), TraceOptions::default()).expect("trace"))
        });
    }
    group.finish();
}

criterion_group!(benches, tracing);
criterion_main!(benches);
