//! The MPI backend: one process per rank, started by `mpirun` or `srun`, over Open MPI.
//!
//! - `MPI_THREAD_MULTIPLE` is required: every stream of a rank is a thread that calls MPI.
//! - Every (process group, stream) pair of the plan gets its own communicator, split from
//!   the world and duplicated per stream, so an all-gather never queues behind a
//!   reduce-scatter on another stream.
//! - Results equal the Local backend's bit for bit: a reduce-scatter is an all-to-all of
//!   chunks followed by a sum in rank order on the receiving rank (the Local backend sums
//!   in rank order too), an all-reduce is that reduce-scatter followed by an all-gather.
//!   Sums never depend on MPI's own reduction order, and 16-bit data needs no MPI
//!   reduction type.
//! - MPI collectives cannot time out, so a watchdog thread does: when a collective has
//!   waited longer than the timeout, or a local stream failed, it prints why and calls
//!   `MPI_Abort`, which makes the launcher stop every rank.

use super::{Abort, Collectives, Placement, Reduce};
use crate::runtime::rank::Comms;
use crate::ExecError;
use candle_core::{DType, Device, Tensor};
use mpi::collective::CommunicatorCollectives;
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::Threading;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A communicator that may be shared between threads. Sound because the library runs
/// with `MPI_THREAD_MULTIPLE` (checked by `MpiWorld::init`, which alone makes these) and each
/// communicator is used by one thread at a time: one per (group, stream), called only by
/// that stream's thread; the processes' communicator only by the main thread.
struct SharedComm(SimpleCommunicator);
unsafe impl Send for SharedComm {}
unsafe impl Sync for SharedComm {}

/// MPI, initialised for this process. Keep it alive for the whole run: dropping it
/// finalises MPI.
pub struct MpiWorld {
    // Dropped last (fields drop in order): MPI_Finalize after every communicator is freed.
    world: Arc<SharedComm>,
    _universe: mpi::environment::Universe,
    pub rank: u64,
    pub size: u64,
}

impl MpiWorld {
    /// Initialises MPI with `MPI_THREAD_MULTIPLE`; refuses a library that cannot provide it.
    pub fn init() -> Result<MpiWorld, ExecError> {
        let (universe, level) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| ExecError::Unsupported("MPI was already initialised in this process".into()))?;
        if level != Threading::Multiple {
            return Err(ExecError::Unsupported(format!(
                "this MPI library gives thread level {level:?}; shardplan's MPI backend needs MPI_THREAD_MULTIPLE (every stream of a rank is a thread): use Open MPI >= 4 built with threads"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as u64, world.size() as u64);
        Ok(MpiWorld {
            world: Arc::new(SharedComm(world)),
            _universe: universe,
            rank,
            size,
        })
    }

    /// Stops every process of the job (the launcher reports which rank called it).
    pub fn abort(&self, code: i32) -> ! {
        self.world.0.abort(code)
    }
}

/// Collectives in flight on this process, watched for timeouts.
struct Watchdog {
    /// (what, since when) of every blocking MPI call now running.
    in_flight: Mutex<Vec<(u64, String, Instant)>>,
    next: std::sync::atomic::AtomicU64,
}

struct InFlight<'a> {
    dog: &'a Watchdog,
    id: u64,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.dog
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|x| x.0 != self.id);
    }
}

impl Watchdog {
    fn enter(&self, what: String) -> InFlight<'_> {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((id, what, Instant::now()));
        InFlight { dog: self, id }
    }

    /// Checks every 50 ms; aborts the job on a timed-out collective or a local failure.
    fn spawn(self: &Arc<Self>, world: Arc<SharedComm>, abort: Arc<Abort>, rank: u64) {
        let dog = self.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(50));
            let why = if let Some(r) = abort.reason() {
                Some(r)
            } else {
                let limit = abort.timeout();
                let list = dog.in_flight.lock().unwrap_or_else(|e| e.into_inner());
                list.iter().find(|x| x.2.elapsed() > limit).map(|x| {
                    format!(
                        "rank {rank}: {} timed out after {:.1} s: another rank stopped, died or diverged",
                        x.1,
                        limit.as_secs_f64()
                    )
                })
            };
            if let Some(why) = why {
                eprintln!("error: {why}");
                eprintln!("error: rank {rank} stops the job (MPI_Abort)");
                world.0.abort(1);
            }
        });
    }
}

/// One rank's handle on one MPI communicator (a process group, for one stream).
pub struct MpiGroup {
    comm: SharedComm,
    size: usize,
    index: usize,
    name: String,
    dog: Arc<Watchdog>,
}

/// Host bytes of `t` (moved to the CPU if it lives elsewhere).
fn host_bytes(t: &Tensor) -> Result<Vec<u8>, ExecError> {
    let t = t.flatten_all()?.to_device(&Device::Cpu)?;
    Ok(match t.dtype() {
        DType::F32 => bytemuck::cast_slice(&t.to_vec1::<f32>()?).to_vec(),
        DType::F64 => bytemuck::cast_slice(&t.to_vec1::<f64>()?).to_vec(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        DType::U8 => t.to_vec1::<u8>()?,
        DType::U32 => bytemuck::cast_slice(&t.to_vec1::<u32>()?).to_vec(),
        DType::I64 => bytemuck::cast_slice(&t.to_vec1::<i64>()?).to_vec(),
        other => return Err(ExecError::Unsupported(format!("MPI collectives of {other:?} data"))),
    })
}

/// A 1-D tensor of `dtype` from host bytes, on `device`.
fn from_bytes(bytes: &[u8], dtype: DType, device: &Device) -> Result<Tensor, ExecError> {
    let n = bytes.len() / dtype.size_in_bytes();
    let t = Tensor::from_raw_buffer(bytes, dtype, &[n], &Device::Cpu)?;
    Ok(t.to_device(device)?)
}

/// The MPI element count of `bytes` bytes moved as `unit`-byte elements; MPI counts are ints.
fn check_count(bytes: usize, what: &str) -> Result<(), ExecError> {
    if bytes / 8 > i32::MAX as usize {
        return Err(ExecError::Unsupported(format!(
            "{what} of {bytes} bytes is larger than one MPI call moves; use smaller FSDP units (bucket_mib, wrap)"
        )));
    }
    Ok(())
}

/// Bytes moved in MPI calls as 8-byte words where possible (larger counts fit an int).
fn all_gather_bytes(comm: &SimpleCommunicator, mine: &[u8], n: usize) -> Vec<u8> {
    let mut out = vec![0u8; mine.len() * n];
    if mine.len().is_multiple_of(8) {
        let send: Vec<u64> = mine
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8")))
            .collect();
        let mut recv = vec![0u64; send.len() * n];
        comm.all_gather_into(&send[..], &mut recv[..]);
        for (o, w) in out.chunks_exact_mut(8).zip(recv) {
            o.copy_from_slice(&w.to_le_bytes());
        }
    } else {
        comm.all_gather_into(mine, &mut out[..]);
    }
    out
}

fn all_to_all_bytes(comm: &SimpleCommunicator, mine: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; mine.len()];
    if mine.len().is_multiple_of(8 * comm.size() as usize) {
        let send: Vec<u64> = mine
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8")))
            .collect();
        let mut recv = vec![0u64; send.len()];
        comm.all_to_all_into(&send[..], &mut recv[..]);
        for (o, w) in out.chunks_exact_mut(8).zip(recv) {
            o.copy_from_slice(&w.to_le_bytes());
        }
    } else {
        comm.all_to_all_into(mine, &mut out[..]);
    }
    out
}

impl MpiGroup {
    fn guard(&self, what: &str, tag: u64) -> InFlight<'_> {
        self.dog.enter(format!("{what} {tag} on the {}", self.name))
    }

    /// Sums the `size` equal rows of `rows` in rank order (as the Local backend does).
    fn sum_rows(&self, rows: Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        let n = self.size;
        let mut acc = rows.get(0)?;
        for r in 1..n {
            acc = (acc + rows.get(r)?)?;
        }
        Ok(match op {
            Reduce::Avg if n > 1 => (acc / n as f64)?,
            Reduce::Sum | Reduce::Avg => acc,
        })
    }

    /// This rank's chunk of the rank-order sum of every member's `input`.
    fn reduce_chunk(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        let n = self.size;
        let len = input.elem_count();
        let bytes = host_bytes(input)?;
        check_count(bytes.len(), "a reduce-scatter")?;
        let got = {
            let _g = self.guard("reduce-scatter", tag);
            all_to_all_bytes(&self.comm.0, &bytes)
        };
        // Row r: member r's contribution to this rank's chunk.
        let rows = from_bytes(&got, input.dtype(), &Device::Cpu)?.reshape((n, len / n))?;
        self.sum_rows(rows, op)?.to_device(input.device()).map_err(Into::into)
    }
}

impl Collectives for MpiGroup {
    fn size(&self) -> usize {
        self.size
    }

    fn index(&self) -> usize {
        self.index
    }

    fn all_gather(&self, tag: u64, input: &Tensor) -> Result<Tensor, ExecError> {
        let bytes = host_bytes(input)?;
        check_count(bytes.len() * self.size, "an all-gather")?;
        let out = {
            let _g = self.guard("all-gather", tag);
            all_gather_bytes(&self.comm.0, &bytes, self.size)
        };
        from_bytes(&out, input.dtype(), input.device())
    }

    fn reduce_scatter(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        if !input.elem_count().is_multiple_of(self.size) {
            return Err(ExecError::Internal(format!(
                "{}: reduce-scatter of {} elements over {} ranks",
                self.name,
                input.elem_count(),
                self.size
            )));
        }
        self.reduce_chunk(tag, input, op)
    }

    fn all_reduce(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        let n = self.size;
        if n == 1 {
            return self.sum_rows(input.unsqueeze(0)?, op);
        }
        // Padded to a multiple of the group size, reduce-scattered, gathered back.
        let len = input.elem_count();
        let padded_len = len.div_ceil(n) * n;
        let flat = input.flatten_all()?;
        let padded = if padded_len > len {
            Tensor::cat(
                &[flat, Tensor::zeros(padded_len - len, input.dtype(), input.device())?],
                0,
            )?
        } else {
            flat
        };
        let mine = self.reduce_chunk(tag, &padded, op)?;
        let all = self.all_gather(tag, &mine)?;
        Ok(all.narrow(0, 0, len)?.reshape(input.shape())?)
    }

    fn broadcast(&self, tag: u64, input: &Tensor) -> Result<Tensor, ExecError> {
        let mut bytes = host_bytes(input)?;
        check_count(bytes.len(), "a broadcast")?;
        {
            let _g = self.guard("broadcast", tag);
            use mpi::collective::Root;
            self.comm.0.process_at_rank(0).broadcast_into(&mut bytes[..]);
        }
        Ok(from_bytes(&bytes, input.dtype(), input.device())?.reshape(input.shape())?)
    }

    fn barrier(&self, tag: u64) -> Result<(), ExecError> {
        let _g = self.guard("barrier", tag);
        self.comm.0.barrier();
        Ok(())
    }
}

/// This process's rank of `plan`'s mesh, with an MPI communicator per (process group,
/// stream) and one across all processes; starts the watchdog. Collective: every process
/// calls it with the same plan.
pub fn place(world: &MpiWorld, plan: &shardplan_planner::Plan) -> Result<Placement, ExecError> {
    let mesh = plan.mesh;
    if world.size != mesh.world() {
        return Err(ExecError::Unsupported(format!(
            "the plan's mesh is {}x{} ({} ranks), but MPI started {} processes: run `mpirun -np {}`",
            mesh.replicate(),
            mesh.shard(),
            mesh.world(),
            world.size,
            mesh.world()
        )));
    }
    let rank = world.rank;
    let abort = Arc::new(Abort::default());
    let dog = Arc::new(Watchdog {
        in_flight: Mutex::new(Vec::new()),
        next: Default::default(),
    });
    dog.spawn(world.world.clone(), abort.clone(), rank);
    let mut comms = Comms::default();
    for (c, s) in super::channels(plan) {
        let members = c.members(&mesh, rank);
        let index = members
            .iter()
            .position(|&m| m == rank)
            .ok_or_else(|| ExecError::Internal(format!("rank {rank} is not in its own {c:?} group")))?;
        // Every member of a group names it by its lowest rank.
        let color = members.iter().copied().min().unwrap_or(rank);
        let comm = world
            .world
            .0
            .split_by_color_with_key(Color::with_value(color as i32), index as i32)
            .ok_or_else(|| ExecError::Internal(format!("MPI_Comm_split gave rank {rank} no {c:?} communicator")))?;
        let name = format!("{c:?} group {members:?} ({s:?} stream)").to_lowercase();
        comms.insert(
            c,
            s,
            Box::new(MpiGroup {
                size: comm.size() as usize,
                comm: SharedComm(comm),
                index,
                name,
                dog: dog.clone(),
            }),
        );
    }
    let processes = MpiGroup {
        comm: SharedComm(world.world.0.duplicate()),
        size: world.size as usize,
        index: rank as usize,
        name: "world (between steps)".into(),
        dog,
    };
    Ok(Placement {
        ranks: vec![(rank, comms)],
        processes: Some(Box::new(processes)),
        abort,
        backend: "mpi",
    })
}
