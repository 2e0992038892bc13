//! `shardplan calibrate`: a hardware profile of this machine's CPU, measured with the
//! executor's own kernels, for planning `shardplan train`'s CPU runs.
//!
//! With `--ranks N`, N threads run every measurement at once, as N ranks of a mesh share
//! the machine, and the profile is one rank's share. Measured:
//! - `kernel_launch_us`: an add of 8 elements, through the same dispatch as every graph op;
//! - `f32_tflops` and `matmul_tile_m`: a 640-wide linear layer (the executor's `gemm`
//!   path) at 32 to 512 tokens, fitted to the cost model's row tiles ([`fit_tiles`]), so
//!   `matmul_efficiency` is 1 (`matmul_tile_n` and `sm_count` 1);
//! - `parallel_launch_us`: an RMSNorm of 64 rows of 64 (one task per row on the thread
//!   pool, its work under a microsecond) less `kernel_launch_us`;
//! - `copy_gbps`: concatenating two 8 MiB tensors (one thread), bytes written per second;
//! - `step_overhead_us`: starting and joining a step's threads (one per rank, one per stream
//!   of each rank);
//! - `hbm_gbps`: an add of two 16 MiB vectors (bytes read and written per second), so
//!   `memory_efficiency` is 1;
//! - `attention_fwd_efficiency` / `_bwd_`: the fused attention kernels on
//!   `[2, 128, 4, 64]` with a causal mask, FLOPs counted as the planner counts them (the
//!   blocks a causal mask keeps, in the executor's 64-row blocks), against `f32_tflops`;
//! - `intra_node_gbps` and `intra_node_latency_us`: the Local backend's all-gather among
//!   the N threads, of 4 MiB and of 4 bytes (not measured for one rank).
//!
//! `kernels: fused` (one kernel per graph op, each op's overhead added to its work).

use crate::CliError;
use candle_core::{Device, Tensor};
use shardplan_executor::comm::{Abort, Collectives};
use shardplan_executor::cpu::kernels::{apply, Ctx};
use shardplan_frontends::{HardwareProfile, KernelMode};
use shardplan_ir::{DType, Op, TensorType, WeightLayout};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct CalibrateArgs {
    /// Ranks that will share this machine: this many threads run every measurement at once,
    /// and the profile is one rank's share (the mesh's world size when all ranks run here).
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// Seconds each measurement runs for.
    #[arg(long, default_value_t = 0.3)]
    pub seconds: f64,
    /// Write the profile here as well: a parallel spec's `hardware:` line.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

/// One op to time, with its inputs made once.
struct Bench {
    op: Op,
    ins: Vec<Tensor>,
    out: TensorType,
}

impl Bench {
    fn new(op: Op, shapes: &[&[u64]]) -> Result<Self, CliError> {
        let types: Vec<TensorType> = shapes.iter().map(|s| TensorType::new(DType::F32, s.to_vec())).collect();
        let refs: Vec<&TensorType> = types.iter().collect();
        let out = op
            .infer(&refs)
            .map_err(|e| anyhow::anyhow!("calibration op {}: {e}", op.name()))?;
        let ins = shapes
            .iter()
            .map(|s| {
                let dims: Vec<usize> = s.iter().map(|&d| d as usize).collect();
                Tensor::randn(0f32, 0.5, dims.as_slice(), &Device::Cpu)
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("calibration inputs: {e}"))?;
        Ok(Bench { op, ins, out })
    }

    fn run(&self, ctx: &Ctx) -> Result<Tensor, CliError> {
        let refs: Vec<&Tensor> = self.ins.iter().collect();
        apply(ctx, &self.op, &refs, &self.out).map_err(|e| CliError::Other(anyhow::anyhow!("{}: {e}", self.op.name())))
    }
}

/// Runs `f(r)` for `r` in `0..ranks` on a thread each, at once; the mean of what they
/// return.
fn on_threads(ranks: usize, f: &(dyn Fn(usize) -> Result<f64, CliError> + Sync)) -> Result<f64, CliError> {
    let results: Vec<Result<f64, CliError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks).map(|r| s.spawn(move || f(r))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(CliError::Other(anyhow::anyhow!("a calibration thread failed"))))
            })
            .collect()
    });
    let times = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(times.iter().sum::<f64>() / times.len() as f64)
}

/// Seconds per call of `f`, run for about `secs` by each of `ranks` threads at once (after
/// a warm-up call); the mean over the threads.
fn per_call(ranks: usize, secs: f64, f: &(dyn Fn(usize) -> Result<(), CliError> + Sync)) -> Result<f64, CliError> {
    let barrier = Barrier::new(ranks);
    on_threads(ranks, &|r| {
        f(r)?;
        barrier.wait();
        let start = Instant::now();
        let mut calls = 0u64;
        while calls < 3 || start.elapsed() < Duration::from_secs_f64(secs) {
            f(r)?;
            calls += 1;
        }
        Ok(start.elapsed().as_secs_f64() / calls as f64)
    })
}

/// Times `bench` on `ranks` threads: seconds per call.
fn time_op(ranks: usize, secs: f64, bench: &Bench) -> Result<f64, CliError> {
    // A `Ctx` caches rotary tables behind a RefCell: each call makes its own (an empty
    // map, no allocation), as none of these ops uses the cache.
    per_call(ranks, secs, &|_| bench.run(&Ctx::new(Device::Cpu)).map(drop))
}

/// The fraction of an `s x s` causal score matrix the executor's attention computes
/// (the planner's count, blocks of 64 rows).
fn kept(s: u64, block: u64) -> f64 {
    let nb = s.div_ceil(block) as f64;
    (nb + 1.0) / (2.0 * nb)
}

/// What calibration measured, in seconds, FLOP/s and GB/s, before it becomes a profile.
struct Figures {
    /// An op's cost beyond its work (an add of 8 elements), seconds.
    kernel_launch: f64,
    /// Starting an op on the thread pool, beyond `kernel_launch`, seconds.
    parallel_launch: f64,
    tflops: f64,
    tile_m: f64,
    /// Memory bandwidth, GB/s.
    hbm_gbps: f64,
    /// One thread copying, GB/s.
    copy_gbps: f64,
    /// Starting and joining a step's threads, seconds.
    step_overhead: f64,
    attention_fwd_efficiency: f64,
    attention_bwd_efficiency: f64,
    /// The ranks' all-gather: GB/s and latency in microseconds.
    link_gbps: f64,
    link_us: f64,
}

pub fn measure(args: &CalibrateArgs) -> Result<HardwareProfile, CliError> {
    let ranks = args.ranks;
    if ranks == 0 || ranks > 4096 {
        return Err(CliError::Usage(format!("--ranks {ranks}: give 1 to 4096")));
    }
    if !(args.seconds.is_finite() && args.seconds > 0.0 && args.seconds <= 60.0) {
        return Err(CliError::Usage(format!(
            "--seconds {}: give more than 0 and at most 60",
            args.seconds
        )));
    }
    let secs = args.seconds;
    // As `train` runs: freed memory is kept for reuse, not returned to the system and
    // faulted in again by the next op.
    shardplan_executor::host::retain_freed_memory();
    // What one op costs beyond its work: an add of 8 elements through the same dispatch
    // as every graph op.
    let launch = time_op(ranks, secs, &Bench::new(Op::Add, &[&[8], &[8]])?)?;
    let (tflops, tile_m) = matmul_rate(ranks, secs, launch)?;
    let gbps = memory_bandwidth(ranks, secs, launch)?;
    // Starting an op on the thread pool: an RMSNorm of 64 rows of 64 (one task per row, the
    // row-parallel kernels' way; its own work, 32 KiB moved, is under a microsecond).
    let t_par = time_op(
        ranks,
        secs,
        &Bench::new(Op::RmsNorm { eps: 1e-5 }, &[&[64, 64], &[64]])?,
    )?;
    let parallel_launch = (t_par - launch).max(0.0);
    let copy_gbps = copy_rate(ranks, secs)?;
    let step_overhead = step_threads(ranks, secs)?;
    // The attention kernels run on the pool.
    let launch = launch + parallel_launch;
    let (fwd_eff, bwd_eff) = attention_efficiency(ranks, secs, launch, tflops)?;
    let (link_gbps, link_us) = if ranks > 1 {
        all_gather_link(ranks)?
    } else {
        (gbps, 1.0)
    };
    Ok(profile(
        ranks,
        &Figures {
            kernel_launch: launch - parallel_launch,
            parallel_launch,
            tflops,
            tile_m,
            hbm_gbps: gbps,
            copy_gbps,
            step_overhead,
            attention_fwd_efficiency: fwd_eff,
            attention_bwd_efficiency: bwd_eff,
            link_gbps,
            link_us,
        },
    ))
}

/// Matmul rate and how it falls with fewer tokens: a 640-wide linear layer at 32 to 512
/// tokens (less `launch` each), fitted to the cost model's tiles (rows of `tile_m`, a
/// partly filled tile costing a full one). Returns (TFLOP/s, tile_m).
fn matmul_rate(ranks: usize, secs: f64, launch: f64) -> Result<(f64, f64), CliError> {
    let width = 640u64;
    let mut rates = Vec::new();
    for m in [32u64, 64, 128, 256, 512] {
        let linear = Bench::new(
            Op::Linear {
                bias: false,
                layout: WeightLayout::OutIn,
                float8: None,
            },
            &[&[m, width], &[width, width]],
        )?;
        let t = time_op(ranks, secs, &linear)? - launch;
        rates.push((m as f64, 2.0 * (m * width * width) as f64 / t.max(1e-9)));
    }
    Ok(fit_tiles(&rates))
}

/// Memory bandwidth in GB/s: an add of two 4 Mi-element vectors (past the per-core caches,
/// the size of a small model's parameter and optimizer tensors) reads 32 MiB and writes 16.
fn memory_bandwidth(ranks: usize, secs: f64, launch: f64) -> Result<f64, CliError> {
    let len = 1u64 << 22;
    let t_add = time_op(ranks, secs, &Bench::new(Op::Add, &[&[len], &[len]])?)?;
    Ok((12 * len) as f64 / (t_add - launch).max(t_add * 0.5) / 1e9)
}

/// One thread copying, in GB/s: the concatenation that lays gradients out flat (and
/// parameters out of an all-gather), 16 MiB written.
fn copy_rate(ranks: usize, secs: f64) -> Result<f64, CliError> {
    let half =
        Tensor::randn(0f32, 1.0, 1usize << 21, &Device::Cpu).map_err(|e| anyhow::anyhow!("calibration buffer: {e}"))?;
    let t = per_call(ranks, secs, &|_| {
        Tensor::cat(&[&half, &half], 0)
            .map(drop)
            .map_err(|e| CliError::Other(anyhow::anyhow!("cat: {e}")))
    })?;
    Ok((8u64 << 20) as f64 / t / 1e9)
}

/// A step's threads, in seconds: each rank's thread starting one per stream of its
/// program, joined.
fn step_threads(ranks: usize, secs: f64) -> Result<f64, CliError> {
    per_call(1, secs, &|_| {
        std::thread::scope(|s| {
            for _ in 0..ranks {
                s.spawn(|| {
                    std::thread::scope(|s2| {
                        for _ in 0..shardplan_planner::Stream::ALL.len() {
                            s2.spawn(|| ());
                        }
                    })
                });
            }
        });
        Ok(())
    })
}

/// Attention, forward and backward parts, as the planner counts their FLOPs, each less
/// `launch` per kernel: their efficiencies against `tflops`.
fn attention_efficiency(ranks: usize, secs: f64, launch: f64, tflops: f64) -> Result<(f64, f64), CliError> {
    let (b, s, h, d) = (2u64, 128u64, 4u64, 64u64);
    let q = [b, s, h, d];
    let p = [b, h, s, s];
    let att = |op: Op, shapes: &[&[u64]]| -> Result<f64, CliError> { time_op(ranks, secs, &Bench::new(op, shapes)?) };
    let part = (2 * b * h * s * s * d) as f64 * kept(s, 64);
    let t_fwd = att(
        Op::Attention {
            causal: true,
            context: None,
        },
        &[&q, &q, &q],
    )? - launch;
    let mut t_bwd = att(
        Op::AttnProbs {
            causal: true,
            context: None,
        },
        &[&q, &q],
    )?;
    t_bwd += att(Op::AttnGradV { kv_heads: h }, &[&p, &q])?;
    t_bwd += att(Op::AttnGradScores, &[&p, &q, &q])?;
    t_bwd += att(Op::AttnGradQ, &[&p, &q])?;
    t_bwd += att(Op::AttnGradK { kv_heads: h }, &[&p, &q])?;
    t_bwd -= 5.0 * launch;
    let peak = tflops * 1e12;
    let fwd_eff = (2.0 * part / t_fwd.max(1e-9) / peak).clamp(0.01, 1.0);
    let bwd_eff = (5.0 * part / t_bwd.max(1e-9) / peak).clamp(0.01, 1.0);
    Ok((fwd_eff, bwd_eff))
}

/// Collectives among the ranks (Local backend: threads of one process): the all-gather's
/// bandwidth in GB/s and latency in microseconds, from 4 MiB and 4-byte all-gathers.
fn all_gather_link(ranks: usize) -> Result<(f64, f64), CliError> {
    let abort = Arc::new(Abort::default());
    let group = shardplan_executor::comm::local::local_group(ranks, "calibrate", &abort);
    let big = Tensor::zeros(1usize << 20, candle_core::DType::F32, &Device::Cpu)
        .map_err(|e| anyhow::anyhow!("calibration buffer: {e}"))?;
    let small = Tensor::zeros(1usize, candle_core::DType::F32, &Device::Cpu)
        .map_err(|e| anyhow::anyhow!("calibration buffer: {e}"))?;
    // Every rank makes the same calls with the same tags: fixed counts, not a time.
    let gather = |t: &Tensor, base: u64, calls: u64| -> Result<f64, CliError> {
        on_threads(ranks, &|r| {
            let call = |n: u64| {
                group[r]
                    .all_gather(base + n, t)
                    .map(drop)
                    .map_err(|e| CliError::Other(anyhow::anyhow!("all-gather: {e}")))
            };
            call(0)?;
            let start = Instant::now();
            for n in 1..=calls {
                call(n)?;
            }
            Ok(start.elapsed().as_secs_f64() / calls as f64)
        })
    };
    let t_small = gather(&small, 0, 2000)?;
    let t_big = gather(&big, 1 << 20, 50)?;
    let hops = (ranks - 1) as f64;
    let alpha = t_small / hops;
    let bytes = (4u64 << 20) as f64 * ranks as f64;
    let bw = bytes / ranks as f64 * hops / (t_big - t_small).max(1e-9);
    Ok((bw / 1e9, alpha * 1e6))
}

/// The profile of one of `ranks` ranks on this CPU: the H100 profile's fields with what
/// was measured, `kernels: fused`, and the GPU's own figures neutral.
fn profile(ranks: usize, f: &Figures) -> HardwareProfile {
    let mut hw = shardplan_frontends::builtin_hardware("h100-sxm").expect("built-in profile");
    hw.name = format!("cpu-{ranks}-ranks");
    hw.bf16_tflops = f.tflops;
    hw.f32_tflops = f.tflops;
    // Float8 is emulated in f32 here (torchao's `emulate=True`); no MX emulation.
    hw.fp8_tflops = f.tflops;
    hw.mxfp8_tflops = 0.0;
    hw.hbm_gbps = f.hbm_gbps;
    hw.hbm_gib = host_memory_gib();
    hw.intra_node_gbps = f.link_gbps;
    hw.inter_node_gbps = f.link_gbps;
    hw.intra_node_latency_us = f.link_us;
    hw.inter_node_latency_us = f.link_us;
    hw.matmul_efficiency = 1.0;
    hw.host_link_gbps = f.hbm_gbps;
    hw.host_mem_gbps = f.hbm_gbps;
    hw.cuda_context_mib = 0.0;
    hw.nccl_channels = 0.0;
    hw.sm_count = 1.0;
    hw.matmul_tile_m = f.tile_m;
    hw.matmul_tile_n = 1.0;
    hw.attention_fwd_efficiency = f.attention_fwd_efficiency;
    hw.attention_bwd_efficiency = f.attention_bwd_efficiency;
    hw.attention_block = 64.0;
    hw.memory_efficiency = 1.0;
    hw.kernel_launch_us = f.kernel_launch * 1e6;
    hw.parallel_launch_us = f.parallel_launch * 1e6;
    hw.copy_gbps = f.copy_gbps;
    hw.step_overhead_us = f.step_overhead * 1e6;
    hw.collective_efficiency = 1.0;
    hw.overlap_slowdown = 0.0;
    hw.kernels = KernelMode::Fused;
    hw
}

/// The cost model's matmul rate and row tile from `(tokens, FLOP/s)` measurements: with
/// one tile column and one unit, a linear layer of `m` tokens runs at
/// `peak x m / (ceil(m / tile_m) x tile_m)`. The tile (a multiple of 8 up to 1024) that
/// fits the rates best in log terms, and the peak that goes with it (the geometric mean of
/// rate / fill). Returns (TFLOP/s, tile_m).
pub fn fit_tiles(rates: &[(f64, f64)]) -> (f64, f64) {
    let fill = |m: f64, tm: f64| m / ((m / tm).ceil() * tm);
    let mut best = (f64::INFINITY, 1.0, 1.0);
    for tm in (8..=1024).step_by(8).map(f64::from) {
        let logs: Vec<f64> = rates.iter().map(|&(m, r)| (r / fill(m, tm)).ln()).collect();
        let mean = logs.iter().sum::<f64>() / logs.len().max(1) as f64;
        let err: f64 = logs.iter().map(|l| (l - mean).powi(2)).sum();
        if err < best.0 - 1e-12 {
            best = (err, mean.exp(), tm);
        }
    }
    (best.1 / 1e12, best.2)
}

/// Physical memory in GiB (from /proc/meminfo; 16 when it cannot be read).
fn host_memory_gib() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|k| k.parse::<f64>().ok()))
        })
        .map_or(16.0, |kib| kib / (1u64 << 20) as f64)
}

/// The profile as a parallel spec's `hardware:` line.
pub fn spec_line(hw: &HardwareProfile) -> String {
    let nums: Vec<String> = hw
        .numbers()
        .iter()
        .map(|(k, v)| format!("{k}: {}", round(*v)))
        .collect();
    format!(
        "hardware: {{name: {}, kernels: {}, {}}}\n",
        hw.name,
        hw.kernels.name(),
        nums.join(", ")
    )
}

/// Four significant digits.
fn round(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return "0".into();
    }
    let digits = (3 - v.abs().log10().floor() as i32).max(0) as usize;
    format!("{v:.digits$}")
}

pub fn run(args: &CalibrateArgs) -> Result<(), CliError> {
    let hw = measure(args)?;
    let line = spec_line(&hw);
    if let Some(path) = &args.out {
        std::fs::write(path, &line).map_err(|e| CliError::Usage(format!("{}: cannot write: {e}", path.display())))?;
    }
    crate::emit(&line)
}
