//! One training step (forward, backward, clipping, AdamW) of the 11.0M-parameter Llama at
//! batch 4 x 256 tokens on one CPU rank: the reference executor's speed.
//! `benches/compare_pytorch.sh` times the same step in PyTorch.

use criterion::{criterion_group, criterion_main, Criterion};
use shardplan_executor::Trainer;
use shardplan_frontends::{load_model, load_parallel};
use std::path::Path;
use std::time::Duration;

fn train_step(c: &mut Criterion) {
    shardplan_executor::host::retain_freed_memory();
    let model = load_model(Path::new("examples/models/llama-10m.yaml")).expect("model spec");
    let parallel = load_parallel(Path::new("examples/parallel/cpu-b4-s256.yaml")).expect("parallel spec");
    let mut trainer =
        Trainer::new(&model.config, &parallel.config, 1_000_000, candle_core::Device::Cpu).expect("trainer");
    trainer.step().expect("warm-up step");
    let mut group = c.benchmark_group("train_step");
    group.sample_size(10).measurement_time(Duration::from_secs(20));
    group.bench_function("llama-10m b4 s256 f32", |b| b.iter(|| trainer.step().expect("step")));
    group.finish();
}

criterion_group!(benches, train_step);
criterion_main!(benches);
