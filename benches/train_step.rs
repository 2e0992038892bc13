//! One training step (forward, backward, clipping, AdamW) of the 11.0M-parameter Llama at
//! batch 4 x 256 tokens on one CPU rank: the reference executor's speed.
//! `benches/compare_pytorch.sh` times the same step in PyTorch. Beside it, the same step of
//! moe-10m (its feed-forward 16 experts of which 4 per token: 11.0M active parameters of
//! 28.7M), which times the routing kernels.

use criterion::{criterion_group, criterion_main, Criterion};
use shardplan_executor::Trainer;
use shardplan_frontends::{load_model, load_parallel};
use std::path::Path;
use std::time::Duration;

fn train_step(c: &mut Criterion) {
    shardplan_executor::host::retain_freed_memory();
    let parallel = load_parallel(Path::new("examples/parallel/cpu-b4-s256.yaml")).expect("parallel spec");
    let mut group = c.benchmark_group("train_step");
    group.sample_size(10).measurement_time(Duration::from_secs(20));
    for name in ["llama-10m", "moe-10m"] {
        let model = load_model(Path::new(&format!("examples/models/{name}.yaml"))).expect("model spec");
        let mut trainer =
            Trainer::new(&model.config, &parallel.config, 1_000_000, candle_core::Device::Cpu).expect("trainer");
        trainer.step().expect("warm-up step");
        group.bench_function(format!("{name} b4 s256 f32"), |b| {
            b.iter(|| trainer.step().expect("step"))
        });
    }
    group.finish();
}

criterion_group!(benches, train_step);
criterion_main!(benches);
