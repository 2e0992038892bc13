//! Sharding overhead: one training step of the 11.0M-parameter Llama at batch 4 x 256 per
//! rank, on a 1x1 and on a 1x4 mesh of Local ranks (threads). Four ranks share the
//! machine's cores, so the figure is CPU time (user + system, from getrusage) per step, not
//! wall time. Target: 1x4 costs at most 1.3 x (4 x 1x1).

use criterion::{criterion_group, criterion_main, Criterion};
use shardplan_executor::ShardedTrainer;
use shardplan_frontends::{load_model, load_parallel};
use std::path::Path;
use std::time::Duration;

/// User + system CPU time of this process so far.
fn cpu_time() -> Duration {
    // SAFETY: getrusage only writes the struct we pass.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn sharded_step(c: &mut Criterion) {
    shardplan_executor::host::retain_freed_memory();
    let model = load_model(Path::new("examples/models/llama-10m.yaml")).expect("model spec");
    let mut group = c.benchmark_group("sharded_step_cpu_time");
    group.sample_size(10).measurement_time(Duration::from_secs(30));
    for (label, spec) in [
        ("1x1 b4 s256 f32", "examples/parallel/cpu-b4-s256.yaml"),
        ("1x4 b4 s256 f32", "examples/parallel/cpu-1x4-b4-s256.yaml"),
    ] {
        let parallel = load_parallel(Path::new(spec)).expect("parallel spec");
        let mut trainer = ShardedTrainer::new(&model.config, &parallel.config, 1_000_000).expect("trainer");
        trainer.step().expect("warm-up step");
        group.bench_function(label, |b| {
            b.iter_custom(|iters| {
                let start = cpu_time();
                for _ in 0..iters {
                    trainer.step().expect("step");
                }
                cpu_time() - start
            })
        });
    }
    group.finish();
}

criterion_group!(benches, sharded_step);
criterion_main!(benches);
