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

    /// One member per process, for what the processes agree on outside the plan (the NCCL
    /// backend's ids and step figures), watched like every MPI collective: a timeout or a
    /// failure reported to `abort` stops the job.
    pub fn process_group(&self, abort: Arc<Abort>) -> MpiGroup {
        let dog = Arc::new(Watchdog {
            in_flight: Mutex::new(Vec::new()),
            next: Default::default(),
        });
        dog.spawn(self.world.clone(), abort, self.rank);
        MpiGroup {
            comm: SharedComm(self.world.0.duplicate()),
            size: self.size as usize,
            index: self.rank as usize,
            name: "world (between steps)".into(),
            dog,
        }
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

/// A tensor's elements on the host, in an MPI type of the same width (16-bit floats travel
/// as `u16`: MPI only moves them, never adds them).
enum Host {
    F32(Vec<f32>),
    F64(Vec<f64>),
    U16(Vec<u16>),
    U8(Vec<u8>),
    U32(Vec<u32>),
    I64(Vec<i64>),
}

/// Runs `$body` with `$v` bound to the vector inside `$h`, whatever its element type.
macro_rules! with_host {
    ($h:expr, $v:ident => $body:expr) => {
        match $h {
            Host::F32($v) => $body,
            Host::F64($v) => $body,
            Host::U16($v) => $body,
            Host::U8($v) => $body,
            Host::U32($v) => $body,
            Host::I64($v) => $body,
        }
    };
}

/// Maps `$f` (a generic function of a slice) over `$h`, rewrapping its vector result.
macro_rules! map_host {
    ($h:expr, $f:expr) => {
        match $h {
            Host::F32(v) => Host::F32($f(&v[..])),
            Host::F64(v) => Host::F64($f(&v[..])),
            Host::U16(v) => Host::U16($f(&v[..])),
            Host::U8(v) => Host::U8($f(&v[..])),
            Host::U32(v) => Host::U32($f(&v[..])),
            Host::I64(v) => Host::I64($f(&v[..])),
        }
    };
}

impl Host {
    /// The elements of `t` (moved to the CPU if it lives elsewhere), one copy.
    fn of(t: &Tensor) -> Result<Host, ExecError> {
        let t = t.flatten_all()?.to_device(&Device::Cpu)?;
        Ok(match t.dtype() {
            DType::F32 => Host::F32(t.to_vec1::<f32>()?),
            DType::F64 => Host::F64(t.to_vec1::<f64>()?),
            DType::BF16 => Host::U16(t.to_vec1::<half::bf16>()?.iter().map(|x| x.to_bits()).collect()),
            DType::F16 => Host::U16(t.to_vec1::<half::f16>()?.iter().map(|x| x.to_bits()).collect()),
            DType::U8 => Host::U8(t.to_vec1::<u8>()?),
            DType::U32 => Host::U32(t.to_vec1::<u32>()?),
            DType::I64 => Host::I64(t.to_vec1::<i64>()?),
            other => return Err(ExecError::Unsupported(format!("MPI collectives of {other:?} data"))),
        })
    }

    fn len(&self) -> usize {
        with_host!(self, v => v.len())
    }

    /// A 1-D tensor of `dtype` (the dtype `of` read) on `device`, without copying f32 data.
    fn into_tensor(self, dtype: DType, device: &Device) -> Result<Tensor, ExecError> {
        let n = self.len();
        let cpu = &Device::Cpu;
        let t = match (self, dtype) {
            (Host::F32(v), _) => Tensor::from_vec(v, n, cpu)?,
            (Host::F64(v), _) => Tensor::from_vec(v, n, cpu)?,
            (Host::U16(v), DType::BF16) => {
                Tensor::from_vec(v.into_iter().map(half::bf16::from_bits).collect::<Vec<_>>(), n, cpu)?
            }
            (Host::U16(v), _) => Tensor::from_vec(v.into_iter().map(half::f16::from_bits).collect::<Vec<_>>(), n, cpu)?,
            (Host::U8(v), _) => Tensor::from_vec(v, n, cpu)?,
            (Host::U32(v), _) => Tensor::from_vec(v, n, cpu)?,
            (Host::I64(v), _) => Tensor::from_vec(v, n, cpu)?,
        };
        Ok(t.to_device(device)?)
    }
}

/// Refuses a call whose element count does not fit MPI's int counts.
fn check_count(elements: usize, what: &str) -> Result<(), ExecError> {
    if elements > i32::MAX as usize {
        return Err(ExecError::Unsupported(format!(
            "{what} of {elements} elements is larger than one MPI call moves (2^31 - 1); use smaller FSDP units (bucket_mib, wrap)"
        )));
    }
    Ok(())
}

fn all_gather_slice<T: mpi::datatype::Equivalence + Default + Clone>(
    comm: &SimpleCommunicator,
    mine: &[T],
    n: usize,
) -> Vec<T> {
    let mut out = vec![T::default(); mine.len() * n];
    comm.all_gather_into(mine, &mut out[..]);
    out
}

fn all_to_all_slice<T: mpi::datatype::Equivalence + Default + Clone>(comm: &SimpleCommunicator, mine: &[T]) -> Vec<T> {
    let mut out = vec![T::default(); mine.len()];
    comm.all_to_all_into(mine, &mut out[..]);
    out
}

impl MpiGroup {
    fn guard(&self, what: &str, tag: u64) -> InFlight<'_> {
        self.dog.enter(format!("{what} {tag} on the {}", self.name))
    }

    /// Sums the `size` equal rows of `rows` in rank order (as the Local backend does).
    fn sum_rows(&self, rows: Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        let n = self.size;
        super::rank_order_sum((0..n).map(|r| rows.get(r).map_err(Into::into)), n, op)
    }

    /// This rank's chunk of the rank-order sum of every member's `input`.
    fn reduce_chunk(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        let n = self.size;
        let len = input.elem_count();
        let host = Host::of(input)?;
        check_count(host.len(), "a reduce-scatter")?;
        let got = {
            let _g = self.guard("reduce-scatter", tag);
            map_host!(host, |v| all_to_all_slice(&self.comm.0, v))
        };
        // Row r: member r's contribution to this rank's chunk.
        let rows = got.into_tensor(input.dtype(), &Device::Cpu)?.reshape((n, len / n))?;
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
        let host = Host::of(input)?;
        check_count(host.len() * self.size, "an all-gather")?;
        let out = {
            let _g = self.guard("all-gather", tag);
            map_host!(host, |v| all_gather_slice(&self.comm.0, v, self.size))
        };
        out.into_tensor(input.dtype(), input.device())
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
        let mut host = Host::of(input)?;
        check_count(host.len(), "a broadcast")?;
        {
            let _g = self.guard("broadcast", tag);
            use mpi::collective::Root;
            let root = self.comm.0.process_at_rank(0);
            with_host!(&mut host, v => root.broadcast_into(&mut v[..]));
        }
        Ok(host
            .into_tensor(input.dtype(), input.device())?
            .reshape(input.shape())?)
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
            "the plan's mesh is {} ({} ranks), but MPI started {} processes: run `mpirun -np {}`",
            if mesh.tensor() > 1 {
                format!("{}x{}x{}", mesh.replicate(), mesh.shard(), mesh.tensor())
            } else {
                format!("{}x{}", mesh.replicate(), mesh.shard())
            },
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
    // A communicator of `members` split from the world (every member names the group by
    // its lowest rank), for this rank.
    let split = |members: Vec<u64>, what: String| -> Result<MpiGroup, ExecError> {
        let index = members
            .iter()
            .position(|&m| m == rank)
            .ok_or_else(|| ExecError::Internal(format!("rank {rank} is not in its own {what}")))?;
        let color = members.iter().copied().min().unwrap_or(rank);
        let comm = world
            .world
            .0
            .split_by_color_with_key(Color::with_value(color as i32), index as i32)
            .ok_or_else(|| ExecError::Internal(format!("MPI_Comm_split gave rank {rank} no {what} communicator")))?;
        Ok(MpiGroup {
            size: comm.size() as usize,
            comm: SharedComm(comm),
            index,
            name: format!("{what} {members:?}"),
            dog: dog.clone(),
        })
    };
    let mut comms = Comms::default();
    for (c, s) in super::channels(plan) {
        let what = format!("{c:?} group ({s:?} stream)").to_lowercase();
        comms.insert(c, s, Box::new(split(c.members(&mesh, rank), what)?));
    }
    if mesh.tensor() > 1 {
        // The compute stream's tensor-parallel ops: a communicator of their own.
        comms.tensor = Some(Box::new(split(
            mesh.tensor_group(rank),
            "tensor group (compute stream)".into(),
        )?));
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
