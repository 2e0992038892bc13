//! Bandwidth of the MPI backend's all-gather and reduce-scatter, through the `Collectives`
//! trait the rank runtime calls, against raw MPI calls on the same bytes and a plain memory
//! copy on one process:
//!
//! ```text
//! cargo build --release --features mpi -p shardplan-executor --example mpi_bandwidth
//! mpirun -np 4 --oversubscribe target/release/examples/mpi_bandwidth [REPS]
//! ```
//!
//! A size S is the full tensor every rank holds: the all-gather's output and the
//! reduce-scatter's input (f32); each rank's shard is S / n. As in nccl-tests, algbw =
//! S / time and busbw = algbw x (n - 1) / n for both collectives; the copy moves S bytes
//! (`copy_from_slice`, rank 0 alone while the other processes sleep) and reports S / time.
//! Each figure is the median over REPS timed repetitions (default 10) after one warm-up; a
//! collective's time is the slowest rank's, measured from a barrier.

use candle_core::{Device, Tensor};
use mpi::collective::{CommunicatorCollectives, SystemOperation};
use mpi::topology::SimpleCommunicator;
use shardplan_executor::comm::Reduce;
use shardplan_frontends::{parse_parallel_spec, Source};
use shardplan_mpi::{place, MpiWorld};
use std::hint::black_box;
use std::time::{Duration, Instant};

const SIZES_MIB: [usize; 3] = [1, 16, 64];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len().is_multiple_of(2) {
        (v[m - 1] + v[m]) / 2.0
    } else {
        v[m]
    }
}

/// Waits for every process without spinning on a core (polls a non-blocking barrier).
fn idle_barrier(world: &SimpleCommunicator) {
    let mut req = world.immediate_barrier();
    loop {
        match req.test() {
            Ok(_) => return,
            Err(r) => {
                req = r;
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// Median over `reps` of the slowest rank's time for `op`, after one warm-up.
fn time_collective(world: &SimpleCommunicator, reps: usize, mut op: impl FnMut()) -> f64 {
    let mut times = Vec::with_capacity(reps);
    for rep in 0..=reps {
        world.barrier();
        let start = Instant::now();
        op();
        let mine = start.elapsed().as_secs_f64();
        let mut slowest = 0f64;
        world.all_reduce_into(&mine, &mut slowest, SystemOperation::max());
        if rep > 0 {
            times.push(slowest);
        }
    }
    median(times)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let reps: usize = std::env::args().nth(1).map_or(Ok(10), |s| s.parse())?;
    // As `shardplan train` does: the allocator keeps freed memory (fewer page faults).
    shardplan_executor::host::retain_freed_memory();
    let world = MpiWorld::init()?;
    let n = world.size as usize;
    let leader = world.rank == 0;

    // `place` builds the backend's communicators from a plan; any plan of a 1xN mesh gives
    // the world-sized group (`processes`) that the runtime uses between steps.
    let (config, _) = parse_parallel_spec(&Source::from_text(
        "mpi_bandwidth.yaml",
        format!("mesh: {{shard: {n}}}\ngpus_per_node: {n}\nbatch: {{per_rank: 2, seq_len: 16}}\n"),
    ))?;
    let model = shardplan_models::preset("tiny-llama").ok_or("no tiny-llama preset")?;
    let graph = shardplan_models::trace(&model, config.trace_options())?;
    let joint = shardplan_ir::differentiate(&graph)?;
    let plan = shardplan_planner::plan(&joint, &config)?;
    let group = place(&world, &plan)?
        .processes
        .ok_or("the MPI placement has no world group")?;
    assert_eq!(group.size(), n);
    let raw = SimpleCommunicator::world();

    if leader {
        println!(
            "{n} MPI processes, {reps} timed repetitions per figure (median), sizes are the full f32 tensor per rank"
        );
        println!();
        println!("| size | operation | median time (ms) | algbw (GB/s) | busbw (GB/s) |");
        println!("|---:|---|---:|---:|---:|");
    }
    let mut tag = 0u64;
    for mib in SIZES_MIB {
        // The full tensor's length, a multiple of the group size.
        let full = (mib << 20) / 4 / n * n;
        let bytes = (full * 4) as f64;
        let row = |what: &str, secs: f64, bus: bool| {
            let algbw = bytes / secs / 1e9;
            let busbw = if bus && n > 1 {
                format!("{:.2}", algbw * (n - 1) as f64 / n as f64)
            } else {
                "-".into()
            };
            println!("| {mib} MiB | {what} | {:.2} | {algbw:.2} | {busbw} |", secs * 1e3);
        };

        // A memory copy of the same bytes on rank 0, the other processes asleep.
        if leader {
            let src: Vec<f32> = (0..full).map(|i| i as f32).collect();
            let mut dst = vec![0f32; full];
            let mut times = Vec::with_capacity(reps);
            for rep in 0..=reps {
                let start = Instant::now();
                dst.copy_from_slice(black_box(&src));
                black_box(&mut dst);
                if rep > 0 {
                    times.push(start.elapsed().as_secs_f64());
                }
            }
            row("memory copy (`copy_from_slice`, 1 process)", median(times), false);
        }
        idle_barrier(&raw);

        let shard_vec: Vec<f32> = (0..full / n).map(|i| (world.rank as usize * full + i) as f32).collect();
        let full_vec: Vec<f32> = (0..full).map(|i| i as f32 + world.rank as f32).collect();
        let shard = Tensor::from_slice(&shard_vec, full / n, &Device::Cpu)?;
        let input = Tensor::from_slice(&full_vec, full, &Device::Cpu)?;

        let mut check = None;
        let t = time_collective(&raw, reps, || {
            tag += 1;
            let out = group.all_gather(tag, &shard).expect("all-gather");
            check = Some(out.dims1().expect("1-D"));
        });
        assert_eq!(check, Some(full));
        if leader {
            row("all-gather (`Collectives`, MpiGroup)", t, true);
        }
        let t = time_collective(&raw, reps, || {
            tag += 1;
            let out = group.reduce_scatter(tag, &input, Reduce::Sum).expect("reduce-scatter");
            check = Some(out.dims1().expect("1-D"));
        });
        assert_eq!(check, Some(full / n));
        if leader {
            row("reduce-scatter (`Collectives`, MpiGroup)", t, true);
        }

        let mut gathered = vec![0f32; full];
        let t = time_collective(&raw, reps, || raw.all_gather_into(&shard_vec[..], &mut gathered[..]));
        if leader {
            row("all-gather (raw `MPI_Allgather`)", t, true);
        }
        let mut reduced = vec![0f32; full / n];
        let t = time_collective(&raw, reps, || {
            raw.reduce_scatter_block_into(&full_vec[..], &mut reduced[..], SystemOperation::sum())
        });
        if leader {
            row("reduce-scatter (raw `MPI_Reduce_scatter_block`)", t, true);
        }
        let mut exchanged = vec![0f32; full];
        let t = time_collective(&raw, reps, || raw.all_to_all_into(&full_vec[..], &mut exchanged[..]));
        if leader {
            row(
                "all-to-all (raw `MPI_Alltoall`, the backend's reduce-scatter transport)",
                t,
                true,
            );
        }
    }
    Ok(())
}
