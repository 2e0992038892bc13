//! What a thread-pool split costs after a serial gap: a 64 x 64 RMSNorm (one pool task per
//! row, under a microsecond of work each) timed after the calling thread spun for 0 to
//! 2,000 us, median and 90th percentile of 400 calls. `calibrate`'s `parallel_launch_us` is
//! the no-gap case; after long gaps rayon's workers are asleep and the split pays their
//! wake-up. `cargo run --release -p shardplan-executor --example pool_wake`
use shardplan_executor::cpu::kernels::{apply, Ctx};
use shardplan_ir::{DType, Op, TensorType};
use std::time::{Duration, Instant};
fn main() {
    let dev = candle_core::Device::Cpu;
    let ctx = Ctx::new(dev.clone());
    let x = candle_core::Tensor::randn(0f32, 1.0, (64usize, 64usize), &dev).unwrap();
    let w = candle_core::Tensor::randn(0f32, 1.0, 64usize, &dev).unwrap();
    let out = TensorType::new(DType::F32, vec![64, 64]);
    let op = Op::RmsNorm { eps: 1e-5 };
    for gap_us in [0u64, 5, 10, 20, 50, 100, 200, 500, 2000] {
        let mut ts = Vec::new();
        for _ in 0..400 {
            let s = Instant::now();
            while s.elapsed() < Duration::from_micros(gap_us) {}
            let t = Instant::now();
            let r = apply(&ctx, &op, &[&x, &w], &out).unwrap();
            ts.push(t.elapsed().as_secs_f64() * 1e6);
            drop(r);
        }
        ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!(
            "gap {gap_us:5} us: median {:.1} us, p90 {:.1}",
            ts[ts.len() / 2],
            ts[ts.len() * 9 / 10]
        );
    }
}
