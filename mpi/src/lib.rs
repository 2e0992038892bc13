//! The MPI backend: one process per rank, started by `mpirun` or `srun`, over Open MPI.
//!
//! - `MPI_THREAD_MULTIPLE` is required: every stream of a rank is a thread that calls MPI.
//! - Every (process group, stream) pair of the plan gets its own communicator, split from
//!   the world and duplicated per stream, so an all-gather never queues behind a
//!   reduce-scatter on another stream.
//! - Data moves as it lies: a tensor's elements are sent from its own storage, typed (f32
//!   as `MPI_FLOAT`, 16-bit floats as `u16`), and received straight into the vector that
//!   becomes the result tensor; no byte-wise conversion, no staging copy.
//! - An all-gather is `MPI_Allgather`. A reduce-scatter is `MPI_Alltoall` of chunks into a
//!   receive buffer each communicator keeps between calls, then a sum in rank order on the
//!   receiving rank; an all-reduce is that reduce-scatter followed by an all-gather.
//!   `MPI_Reduce_scatter_block` is not used: its summation order is the library's choice,
//!   and results must equal the Local backend's bit for bit (it sums in rank order too);
//!   16-bit data then needs no MPI reduction type either. The receive buffer is host
//!   memory the plan does not count: per communicator, its largest reduce-scatter input.
//! - An all-to-all (expert parallelism's dispatch and combine) is one `MPI_Alltoallv` of
//!   the parts, each member receiving the lengths the routing table says: each element
//!   crosses once, and no counts are exchanged.
//! - MPI collectives cannot time out, so a watchdog thread does: when a collective has
//!   waited longer than the timeout, or a local stream failed, it prints why and calls
//!   `MPI_Abort`, which makes the launcher stop every rank.
//!
//! The crate is empty without its `mpi` feature (see its Cargo.toml); [`Mpi`] is the
//! training engine over it.
#![cfg(feature = "mpi")]

mod engine;
mod pipeline;

pub use engine::{process_world, Mpi};
pub use pipeline::place_pipeline;

use candle_core::{DType, Device, Storage, Tensor, WithDType};
use mpi::collective::CommunicatorCollectives;
use mpi::datatype::Equivalence;
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::Threading;
use shardplan_executor::comm::{channels, check_parts, rank_order_sum, Abort, Collectives, Comms, Placement, Reduce};
use shardplan_executor::ExecError;
use std::ffi::{c_int, c_void};
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
    /// Processes of this job on this node, this one included.
    pub on_node: u64,
    /// Threads of this process's kernel pool (its share of the node's cores).
    pub threads: u64,
}

impl MpiWorld {
    /// Initialises MPI with `MPI_THREAD_MULTIPLE`, refusing a library that cannot provide it,
    /// and sizes this process's kernel thread pool to its share of the node's cores
    /// (`host::share_cores`).
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
        // The processes of this job on this node (those that can share memory) split its
        // cores between their kernel thread pools.
        let on_node = world.split_shared(world.rank()).size() as u64;
        let threads = shardplan_executor::host::share_cores(on_node as usize) as u64;
        Ok(MpiWorld {
            world: Arc::new(SharedComm(world)),
            _universe: universe,
            rank,
            size,
            on_node,
            threads,
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
            recv: Mutex::default(),
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
    /// Where a reduce-scatter's all-to-all lands, kept between calls (as large as this
    /// communicator's largest reduce-scatter input so far).
    recv: Mutex<Vec<u64>>,
}

/// An element type the backend moves, and the MPI type of the same width that carries it
/// (16-bit floats travel as `u16`: MPI only moves them, never adds them).
///
/// # Safety
/// `Self` and `Wire` have the same size and alignment and accept the same bit patterns, so a
/// slice of one may be read as a slice of the other.
unsafe trait Elem: WithDType {
    type Wire: Equivalence;
}

// SAFETY: the same type.
unsafe impl Elem for f32 {
    type Wire = f32;
}
// SAFETY: the same type.
unsafe impl Elem for f64 {
    type Wire = f64;
}
// SAFETY: `half::bf16` is `#[repr(transparent)]` over `u16`.
unsafe impl Elem for half::bf16 {
    type Wire = u16;
}
// SAFETY: `half::f16` is `#[repr(transparent)]` over `u16`.
unsafe impl Elem for half::f16 {
    type Wire = u16;
}
// SAFETY: the same type.
unsafe impl Elem for u8 {
    type Wire = u8;
}
// SAFETY: the same type.
unsafe impl Elem for u32 {
    type Wire = u32;
}
// SAFETY: the same type.
unsafe impl Elem for i64 {
    type Wire = i64;
}

/// Runs `$body` with the type `$e` bound to the element type of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $e:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $e = f32;
                $body
            }
            DType::F64 => {
                type $e = f64;
                $body
            }
            DType::BF16 => {
                type $e = half::bf16;
                $body
            }
            DType::F16 => {
                type $e = half::f16;
                $body
            }
            DType::U8 => {
                type $e = u8;
                $body
            }
            DType::U32 => {
                type $e = u32;
                $body
            }
            DType::I64 => {
                type $e = i64;
                $body
            }
            other => Err(ExecError::Unsupported(format!("MPI collectives of {other:?} data"))),
        }
    };
}

/// The MPI datatype that carries `E`.
fn datatype<E: Elem>() -> ffi::MPI_Datatype {
    E::Wire::equivalent_datatype().as_raw()
}

/// An MPI element count, or an error when `elements` is more than one MPI call moves.
fn count(elements: usize, what: &str) -> Result<c_int, ExecError> {
    c_int::try_from(elements).map_err(|_| {
        ExecError::Unsupported(format!(
            "{what} of {elements} elements is larger than one MPI call moves (2^31 - 1); use smaller FSDP units (bucket_mib, wrap)"
        ))
    })
}

/// Runs `f` on the elements of `t` in row-major order, borrowed from its CPU storage: a
/// copy is made only when `t` is not contiguous or not on the CPU.
fn with_elems<E: Elem, R>(t: &Tensor, f: impl FnOnce(&[E]) -> Result<R, ExecError>) -> Result<R, ExecError> {
    let owned;
    let t = if t.device().is_cpu() && t.is_contiguous() {
        t
    } else {
        owned = t.to_device(&Device::Cpu)?.contiguous()?;
        &owned
    };
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(ExecError::Internal("a CPU tensor without CPU storage".into()));
    };
    let elems = layout
        .contiguous_offsets()
        .and_then(|(start, end)| E::cpu_storage_as_slice(cpu).ok()?.get(start..end))
        .ok_or_else(|| ExecError::Internal(format!("the {:?} tensor's elements are not one slice", t.dtype())))?;
    f(elems)
}

/// A new vector of `n` elements that `fill` writes in full, through MPI, before anything
/// reads it: no zeroing pass, no conversion afterwards.
fn filled<E: Elem>(n: usize, fill: impl FnOnce(*mut c_void) -> c_int) -> Result<Vec<E>, ExecError> {
    let mut v = Vec::<E>::with_capacity(n);
    huge_pages(v.as_mut_ptr().cast(), n * std::mem::size_of::<E>());
    checked(fill(v.as_mut_ptr().cast()))?;
    // SAFETY: the MPI call wrote all `n` elements (it returned success), and `E` accepts
    // any bit pattern of its wire type.
    unsafe { v.set_len(n) };
    Ok(v)
}

/// Asks the kernel to back the fresh allocation at `ptr` with 2 MiB pages where it is
/// large enough to have been mapped afresh (above the 32 MiB mmap threshold that
/// `host::retain_freed_memory` sets): the receive then takes a few hundred page faults
/// instead of hundreds of thousands. Advice only; ignored where the kernel declines.
fn huge_pages(ptr: *mut u8, bytes: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        if bytes < 32 << 20 {
            return;
        }
        let start = (ptr as usize).next_multiple_of(HUGE);
        let end = (ptr as usize + bytes) / HUGE * HUGE;
        if end > start {
            // SAFETY: the range lies inside this process's own allocation; MADV_HUGEPAGE
            // changes how its pages are backed, never their contents.
            unsafe {
                libc::madvise(start as *mut c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
}

/// An MPI return code as a result (the default error handler aborts before returning an
/// error; a library set up otherwise still gets a message).
fn checked(rc: c_int) -> Result<(), ExecError> {
    if rc == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(ExecError::Internal(format!(
            "an MPI collective returned error code {rc}"
        )))
    }
}

/// The rank-order sum of the `n` equal rows of `rows` (row r: member r's contribution),
/// divided by `n` for `Avg`: element for element the operations, in the order and dtype,
/// of [`rank_order_sum`] on those rows (`acc + row`, then candle's `affine(1/n, 0)`),
/// so the bits are the Local backend's.
fn sum_rows<E: Elem>(rows: &[E], n: usize, op: Reduce) -> Vec<E> {
    let m = rows.len() / n;
    let mut out = rows[..m].to_vec();
    // Blocks of the output stay in cache while every row is added to them.
    const BLOCK: usize = 4096;
    for (b, acc) in out.chunks_mut(BLOCK).enumerate() {
        let base = b * BLOCK;
        for r in 1..n {
            let row = &rows[r * m + base..r * m + base + acc.len()];
            for (a, &x) in acc.iter_mut().zip(row) {
                *a += x;
            }
        }
        if op == Reduce::Avg && n > 1 {
            let (mul, add) = (E::from_f64(1.0 / n as f64), E::from_f64(0.0));
            for a in acc.iter_mut() {
                *a = *a * mul + add;
            }
        }
    }
    out
}

impl MpiGroup {
    fn guard(&self, what: &str, tag: u64) -> InFlight<'_> {
        self.dog.enter(format!("{what} {tag} on the {}", self.name))
    }

    /// Every member's `mine`, in member order, by `MPI_Allgather` into a new vector.
    fn gather_elems<E: Elem>(&self, tag: u64, mine: &[E]) -> Result<Vec<E>, ExecError> {
        let each = count(mine.len(), "an all-gather")?;
        count(mine.len() * self.size, "an all-gather")?;
        let _g = self.guard("all-gather", tag);
        filled::<E>(mine.len() * self.size, |out| {
            // SAFETY: `mine` holds `each` elements and `out` room for `each` per member;
            // the communicator is this stream's alone (see `SharedComm`).
            unsafe {
                ffi::MPI_Allgather(
                    mine.as_ptr().cast(),
                    each,
                    datatype::<E>(),
                    out,
                    each,
                    datatype::<E>(),
                    self.comm.0.as_raw(),
                )
            }
        })
    }

    /// This rank's chunk of the rank-order sum of every member's `input` (its length a
    /// multiple of the group size): every member's chunks arrive by `MPI_Alltoall` in this
    /// group's receive buffer, then add up in rank order.
    fn reduce_elems<E: Elem>(&self, tag: u64, input: &[E], op: Reduce) -> Result<Vec<E>, ExecError> {
        let n = self.size;
        let each = count(input.len() / n, "a reduce-scatter")?;
        let mut buf = self.recv.lock().unwrap_or_else(|e| e.into_inner());
        let words = (std::mem::size_of_val(input)).div_ceil(8);
        if buf.len() < words {
            buf.resize(words, 0);
        }
        // SAFETY: the buffer is 8-byte aligned (u64), at least as aligned as any `E`, and
        // holds at least `input.len()` elements of `E`, each valid for any bits.
        let rows = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<E>(), input.len()) };
        {
            let _g = self.guard("reduce-scatter", tag);
            // SAFETY: `input` and `rows` hold `each` elements per member; the communicator
            // is this stream's alone.
            checked(unsafe {
                ffi::MPI_Alltoall(
                    input.as_ptr().cast(),
                    each,
                    datatype::<E>(),
                    rows.as_mut_ptr().cast(),
                    each,
                    datatype::<E>(),
                    self.comm.0.as_raw(),
                )
            })?;
        }
        Ok(sum_rows(rows, n, op))
    }

    fn all_gather_as<E: Elem>(&self, tag: u64, input: &Tensor) -> Result<Tensor, ExecError> {
        let all = with_elems::<E, _>(input, |mine| self.gather_elems(tag, mine))?;
        let n = all.len();
        Ok(Tensor::from_vec(all, n, &Device::Cpu)?.to_device(input.device())?)
    }

    fn reduce_scatter_as<E: Elem>(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        let mine = with_elems::<E, _>(input, |all| self.reduce_elems(tag, all, op))?;
        let n = mine.len();
        Ok(Tensor::from_vec(mine, n, &Device::Cpu)?.to_device(input.device())?)
    }

    /// The reduce-scatter of `input` padded with zeros to a multiple of the group size,
    /// gathered back and cut to `input`'s shape.
    fn all_reduce_as<E: Elem>(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        let n = self.size;
        let len = input.elem_count();
        let mut all = with_elems::<E, _>(input, |elems| {
            let padded_len = len.div_ceil(n) * n;
            let mine = if padded_len == len {
                self.reduce_elems(tag, elems, op)?
            } else {
                let mut padded = Vec::with_capacity(padded_len);
                padded.extend_from_slice(elems);
                padded.resize(padded_len, E::zero());
                self.reduce_elems(tag, &padded, op)?
            };
            self.gather_elems(tag, &mine)
        })?;
        all.truncate(len);
        Ok(Tensor::from_vec(all, input.shape(), &Device::Cpu)?.to_device(input.device())?)
    }

    /// `parts[q]` to member `q` by `MPI_Alltoallv`, receiving `lens[q]` from member `q`
    /// (the caller's routing table says what each member sends, so no counts are
    /// exchanged): every element crosses once.
    fn all_to_all_as<E: Elem>(&self, tag: u64, parts: &[Tensor], lens: &[usize]) -> Result<Vec<Tensor>, ExecError> {
        let sends: Vec<c_int> = parts
            .iter()
            .map(|p| count(p.elem_count(), "an all-to-all"))
            .collect::<Result<_, _>>()?;
        let recvs: Vec<c_int> = lens
            .iter()
            .map(|&l| count(l, "an all-to-all"))
            .collect::<Result<_, _>>()?;
        let displs = |c: &[c_int]| -> Result<Vec<c_int>, ExecError> {
            let mut at = 0usize;
            c.iter()
                .map(|&k| {
                    let d = count(at, "an all-to-all")?;
                    at += k as usize;
                    Ok(d)
                })
                .collect()
        };
        let (sdispls, rdispls) = (displs(&sends)?, displs(&recvs)?);
        let total: usize = recvs.iter().map(|&k| k as usize).sum();
        count(total, "an all-to-all")?;
        let mut send: Vec<E> = Vec::with_capacity(sends.iter().map(|&k| k as usize).sum());
        for p in parts {
            with_elems::<E, _>(p, |e| {
                send.extend_from_slice(e);
                Ok(())
            })?;
        }
        let recv = {
            let _g = self.guard("all-to-all", tag);
            filled::<E>(total, |out| {
                // SAFETY: `send` holds sends[q] elements for member q at sdispls[q], `out`
                // room for recvs[q] at rdispls[q] (what member q sends this one: every
                // member reads the same routing table);
                // the communicator is this stream's alone.
                unsafe {
                    ffi::MPI_Alltoallv(
                        send.as_ptr().cast(),
                        sends.as_ptr(),
                        sdispls.as_ptr(),
                        datatype::<E>(),
                        out,
                        recvs.as_ptr(),
                        rdispls.as_ptr(),
                        datatype::<E>(),
                        self.comm.0.as_raw(),
                    )
                }
            })?
        };
        let device = parts.first().map_or(Device::Cpu, |p| p.device().clone());
        recvs
            .iter()
            .zip(&rdispls)
            .map(|(&k, &d)| {
                let part = recv[d as usize..d as usize + k as usize].to_vec();
                Ok(Tensor::from_vec(part, k as usize, &Device::Cpu)?.to_device(&device)?)
            })
            .collect()
    }

    fn broadcast_as<E: Elem>(&self, tag: u64, input: &Tensor) -> Result<Tensor, ExecError> {
        let out = with_elems::<E, _>(input, |elems| {
            let n = count(elems.len(), "a broadcast")?;
            let mut out = elems.to_vec();
            let _g = self.guard("broadcast", tag);
            // SAFETY: `out` holds `n` elements on every member; the communicator is this
            // stream's alone.
            checked(unsafe { ffi::MPI_Bcast(out.as_mut_ptr().cast(), n, datatype::<E>(), 0, self.comm.0.as_raw()) })?;
            Ok(out)
        })?;
        Ok(Tensor::from_vec(out, input.shape(), &Device::Cpu)?.to_device(input.device())?)
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
        by_dtype!(input.dtype(), E => self.all_gather_as::<E>(tag, input))
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
        by_dtype!(input.dtype(), E => self.reduce_scatter_as::<E>(tag, input, op))
    }

    fn all_reduce(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        if self.size == 1 {
            return rank_order_sum(std::iter::once(Ok(input.clone())), 1, op);
        }
        by_dtype!(input.dtype(), E => self.all_reduce_as::<E>(tag, input, op))
    }

    fn broadcast(&self, tag: u64, input: &Tensor) -> Result<Tensor, ExecError> {
        by_dtype!(input.dtype(), E => self.broadcast_as::<E>(tag, input))
    }

    fn all_to_all(&self, tag: u64, parts: &[Tensor], lens: &[usize]) -> Result<Vec<Tensor>, ExecError> {
        check_parts(parts, lens, self.size)?;
        by_dtype!(parts[0].dtype(), E => self.all_to_all_as::<E>(tag, parts, lens))
    }

    fn barrier(&self, tag: u64) -> Result<(), ExecError> {
        let _g = self.guard("barrier", tag);
        self.comm.0.barrier();
        Ok(())
    }
}

/// This process's communicator of the group `members` split from the world (every member
/// names the group by its lowest rank), watched by `dog`. Collective over the world: every
/// process calls it, in the same order, for the group it belongs to.
fn split_group(world: &MpiWorld, dog: &Arc<Watchdog>, members: &[u64], what: String) -> Result<MpiGroup, ExecError> {
    let rank = world.rank;
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
        recv: Mutex::default(),
    })
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
    let split = |members: Vec<u64>, what: String| split_group(world, &dog, &members, what);
    let mut comms = Comms::default();
    for (c, s) in channels(plan) {
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
    if mesh.expert() > 1 {
        // The expert-parallel ops (the tokens' all-to-all): the all-to-all stream's steps,
        // or the compute stream's under `runtime: fsdp2`.
        comms.expert = Some(Box::new(split(mesh.expert_group(rank), "expert group".into())?));
    }
    if mesh.context() > 1 {
        // Ring attention's keys and values: the compute stream's context-parallel ops.
        comms.context = Some(Box::new(split(mesh.context_group(rank), "context group".into())?));
    }
    let processes = MpiGroup {
        comm: SharedComm(world.world.0.duplicate()),
        size: world.size as usize,
        index: rank as usize,
        name: "world (between steps)".into(),
        dog,
        recv: Mutex::default(),
    };
    Ok(Placement {
        ranks: vec![(rank, comms)],
        processes: Some(Box::new(processes)),
        abort,
        backend: "mpi",
    })
}
