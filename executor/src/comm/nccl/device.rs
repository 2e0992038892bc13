//! The GPU part of the NCCL backend (feature `cuda`): a CUDA stream per collective plan
//! stream, an NCCL communicator per (process group, stream), and each collective enqueued on
//! its stream without the host waiting (`Collectives::enqueues`: the rank launches them in
//! issue order); the host waits once, at the step's end (`flush`), under the collective
//! timeout. Everything it decides comes
//! from the plain, CPU-tested parts of `comm::nccl`.

use super::{comm_specs, comm_streams, exchange_ids, offsets, wait_done, IdGroup, ID_BYTES};
use crate::comm::Comms;
use crate::comm::{all_gather_bytes, Abort, Collectives, Placement, Reduce};
use crate::ExecError;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::cudarc::nccl::result::NcclError;
use candle_core::cuda_backend::cudarc::nccl::{group_end, group_start, Comm as NcclComm, Id, ReduceOp};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Shape, Storage, Tensor};
use shardplan_planner::{Comm, Plan};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Tag of the start-up id exchange on the process world (its between-step tags count up
/// from 1; these sit far above them).
pub const ID_TAG: u64 = u64::MAX - 16;

/// An NCCL communicator, usable from whichever stream thread holds the lock.
pub(crate) struct Shared(pub(crate) NcclComm);
// SAFETY: an NCCL communicator may be used from any host thread as long as calls on it do
// not overlap; every use goes through the `Mutex` in `NcclGroup`.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// One rank's handle on one NCCL communicator.
pub struct NcclGroup {
    /// `None` once torn down after a failure (dropping it aborts the communicator).
    comm: Mutex<Option<Shared>>,
    stream: Arc<CudaStream>,
    /// For buffers a collective needs without an input (the barrier's).
    device: CudaDevice,
    size: usize,
    index: usize,
    name: String,
    abort: Arc<Abort>,
}

pub(crate) fn nccl_err(name: &str, what: &str, e: impl std::fmt::Debug) -> ExecError {
    ExecError::Aborted(format!("{name}: {what}: NCCL error {e:?}"))
}

pub(crate) fn cuda_err(what: &str, e: impl std::fmt::Debug) -> ExecError {
    ExecError::Internal(format!("{what}: CUDA error {e:?}"))
}

/// Runs `$body` with `$T` the Rust type of `$dtype` (the dtypes the plan's buffers and the
/// pipeline's activations use).
macro_rules! by_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            other => Err(ExecError::Unsupported(format!("NCCL transfers of {other:?} tensors"))),
        }
    };
}
pub(crate) use by_dtype;

#[derive(Clone, Copy)]
enum Kind {
    AllGather,
    ReduceScatter(Reduce),
    AllReduce(Reduce),
    Broadcast,
}

fn op(r: Reduce) -> ReduceOp {
    match r {
        Reduce::Sum => ReduceOp::Sum,
        Reduce::Avg => ReduceOp::Avg,
    }
}

impl NcclGroup {
    /// Waits for the work issued on this group's stream so far; tears the communicator
    /// down when it fails or times out (the world is aborted by then).
    fn finish(&self, what: &str, tag: u64) -> Result<(), ExecError> {
        let ev = self
            .stream
            .record_event(None)
            .map_err(|e| cuda_err("recording a collective's completion", e))?;
        let r = wait_done(
            &mut || ev.try_is_complete().map_err(|e| format!("CUDA error {e:?}")),
            &self.abort,
            &|| format!("{}: {what} {}", self.name, tag & 0xffff_ffff),
        );
        if r.is_err() {
            // ncclCommAbort: frees a peer-less collective from the stream.
            drop(self.comm.lock().unwrap_or_else(|e| e.into_inner()).take());
        }
        r
    }

    /// Runs `f` on `input`'s CUDA storage and start offset with this group's stream
    /// ordered after the compute stream's work so far, and returns what `f` makes as a
    /// tensor of `shape`. The input may come from a kernel just launched on the compute
    /// stream (the bf16 cast before an all-gather, the packed reduce-scatter input, shards
    /// the optimizer wrote, an all-to-all's parts), which candle's kernels need not mark
    /// with a write event.
    fn enqueue(
        &self,
        what: &str,
        input: &Tensor,
        shape: Shape,
        f: impl FnOnce(&CudaStorage, usize, &CudaDevice) -> Result<Storage, ExecError>,
    ) -> Result<Tensor, ExecError> {
        if let Some(r) = self.abort.reason() {
            return Err(ExecError::Aborted(r));
        }
        let (storage, layout) = input.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            return Err(ExecError::Internal(format!(
                "{}: {what} of a tensor that is not on the GPU",
                self.name
            )));
        };
        let dev = cs.device().clone();
        self.stream
            .join(&dev.cuda_stream())
            .map_err(|e| cuda_err("ordering a collective after its input", e))?;
        let out = f(cs, layout.start_offset(), &dev)?;
        drop(storage);
        Ok(Tensor::from_storage(out, shape, BackpropOp::none(), false))
    }

    /// Runs `f` on this group's communicator, unless it was torn down after a failure.
    fn with_comm<R>(&self, f: impl FnOnce(&NcclComm) -> Result<R, ExecError>) -> Result<R, ExecError> {
        let guard = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let comm = &guard
            .as_ref()
            .ok_or_else(|| ExecError::Aborted(format!("{}: torn down after an earlier failure", self.name)))?
            .0;
        f(comm)
    }

    /// Enqueues `kind` on this group's stream and returns its output at once; the host
    /// waits only when `wait` is set (the barrier) or at the step's end (`flush`).
    fn run(&self, kind: Kind, tag: u64, input: &Tensor, wait: bool) -> Result<Tensor, ExecError> {
        let input = input.contiguous()?;
        let n = input.elem_count();
        let out_len = match kind {
            Kind::AllGather => n * self.size,
            Kind::ReduceScatter(_) => {
                if !n.is_multiple_of(self.size) {
                    return Err(ExecError::Internal(format!(
                        "{}: reduce-scatter of {n} elements over {} ranks",
                        self.name, self.size
                    )));
                }
                n / self.size
            }
            Kind::AllReduce(_) | Kind::Broadcast => n,
        };
        let what = match kind {
            Kind::AllGather => "all-gather",
            Kind::ReduceScatter(_) => "reduce-scatter",
            Kind::AllReduce(_) => "all-reduce",
            Kind::Broadcast => "broadcast",
        };
        let shape = match kind {
            Kind::AllReduce(_) | Kind::Broadcast => input.shape().clone(),
            _ => out_len.into(),
        };
        self.enqueue(what, &input, shape, |cs, off, dev| {
            by_dtype!(input.dtype(), T => {
                let src = cs.as_cuda_slice::<T>()?.slice(off..off + n);
                // SAFETY: every element is written by the collective before anything reads it.
                let mut out = unsafe { dev.alloc::<T>(out_len) }?;
                self.with_comm(|comm| {
                    match kind {
                        Kind::AllGather => comm.all_gather(&src, &mut out),
                        Kind::ReduceScatter(r) => comm.reduce_scatter(&src, &mut out, &op(r)),
                        Kind::AllReduce(r) => comm.all_reduce(&src, &mut out, &op(r)),
                        Kind::Broadcast => comm.broadcast(Some(&src), &mut out, 0),
                    }
                    .map(|_| ())
                    .map_err(|e| nccl_err(&self.name, what, e))
                })?;
                if wait {
                    self.finish(what, tag)?;
                }
                Ok(Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev.clone())))
            })
        })
    }

    /// `parts[q]` to member `q` and `lens[q]` elements from it, as one NCCL group of
    /// `ncclSend`/`ncclRecv` pairs on this group's stream: each element crosses once, and
    /// the host neither waits nor exchanges counts. The parts are laid one after another
    /// in one send buffer; what arrives lands in one receive buffer, in member order.
    fn exchange(&self, parts: &[Tensor], lens: &[usize]) -> Result<Vec<Tensor>, ExecError> {
        let dtype = parts[0].dtype();
        let sent: Vec<usize> = parts.iter().map(Tensor::elem_count).collect();
        let (send_at, total_sent) = offsets(&sent);
        let (recv_at, total) = offsets(lens);
        let send = Tensor::cat(parts, 0)?.contiguous()?;
        let out = self.enqueue("all-to-all", &send, total.max(1).into(), |cs, off, dev| {
            by_dtype!(dtype, T => {
                let src = cs.as_cuda_slice::<T>()?.slice(off..off + total_sent);
                // SAFETY: every element is received before anything reads it (`lens` sum
                // to `total`, and member q sends this one exactly lens[q]).
                let mut out = unsafe { dev.alloc::<T>(total.max(1)) }?;
                self.with_comm(|comm| {
                    let err = |e: NcclError| nccl_err(&self.name, "all-to-all", e);
                    group_start().map_err(err)?;
                    let mut issued = Ok(());
                    for q in 0..self.size {
                        let peer = q as i32;
                        if sent[q] > 0 && issued.is_ok() {
                            issued = comm.send(&src.slice(send_at[q]..send_at[q] + sent[q]), peer).map(|_| ());
                        }
                        if lens[q] > 0 && issued.is_ok() {
                            issued = comm
                                .recv(&mut out.slice_mut(recv_at[q]..recv_at[q] + lens[q]), peer)
                                .map(|_| ());
                        }
                    }
                    // The group is ended whatever was issued: an open group would swallow
                    // every later NCCL call of this thread.
                    let ended = group_end();
                    issued.map_err(err)?;
                    ended.map_err(err).map(|_| ())
                })?;
                // Inside the group, cudarc marked each view's read and write before NCCL
                // enqueued the kernels (at the group's end): mark both buffers again,
                // after them, so the compute stream's readers of `out` and the next writer
                // of the send buffer wait for the exchange itself.
                drop(src.device_ptr(&self.stream));
                drop(out.device_ptr_mut(&self.stream));
                Ok(Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev.clone())))
            })
        })?;
        lens.iter()
            .zip(&recv_at)
            .map(|(&l, &at)| Ok(out.narrow(0, at, l)?))
            .collect()
    }
}

impl Collectives for NcclGroup {
    fn size(&self) -> usize {
        self.size
    }

    fn clock(&self) -> crate::clock::Clock {
        crate::clock::Clock::Device(self.stream.clone())
    }

    fn index(&self) -> usize {
        self.index
    }

    fn all_gather(&self, tag: u64, input: &Tensor) -> Result<Tensor, ExecError> {
        self.run(Kind::AllGather, tag, input, false)
    }

    fn reduce_scatter(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        self.run(Kind::ReduceScatter(op), tag, input, false)
    }

    fn all_reduce(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        self.run(Kind::AllReduce(op), tag, input, false)
    }

    fn broadcast(&self, tag: u64, input: &Tensor) -> Result<Tensor, ExecError> {
        self.run(Kind::Broadcast, tag, input, true)
    }

    fn barrier(&self, tag: u64) -> Result<(), ExecError> {
        let one = Tensor::zeros(1, DType::F32, &Device::Cuda(self.device.clone()))?;
        self.run(Kind::AllReduce(Reduce::Sum), tag, &one, true).map(|_| ())
    }

    fn all_to_all(&self, _tag: u64, parts: &[Tensor], lens: &[usize]) -> Result<Vec<Tensor>, ExecError> {
        crate::comm::check_parts(parts, lens, self.size)?;
        self.exchange(parts, lens)
    }

    fn enqueues(&self) -> bool {
        true
    }

    fn flush(&self) -> Result<(), ExecError> {
        self.finish("the step's collectives", 0)
    }
}

/// Joins NCCL communicator `name` with unique id `id` as member `index` of `size`, its
/// work on `stream`, as rank `rank` (for messages). ncclCommInitRank waits for every
/// member; one that never comes must not hang this one, so the wait has the collective
/// timeout too (at least a minute).
pub fn join_comm(
    name: &str,
    index: usize,
    size: usize,
    id: [u8; ID_BYTES],
    stream: Arc<CudaStream>,
    abort: &Abort,
    rank: u64,
) -> Result<NcclComm, ExecError> {
    let raw: [std::ffi::c_char; ID_BYTES] = id.map(|b| b as std::ffi::c_char);
    super::guard_blocking(
        &format!("rank {rank}: joining the NCCL {name}"),
        abort.timeout().max(Duration::from_secs(60)),
        || NcclComm::from_rank(stream, index, size, Id::uninit(raw)),
    )
    .map_err(|e| nccl_err(name, "ncclCommInitRank", e))
}

/// The collectives of NCCL communicator `name` (see [`join_comm`]) on `dev`.
#[allow(clippy::too_many_arguments)]
pub fn open_group(
    name: String,
    index: usize,
    size: usize,
    id: [u8; ID_BYTES],
    stream: Arc<CudaStream>,
    dev: &CudaDevice,
    abort: &Arc<Abort>,
    rank: u64,
) -> Result<NcclGroup, ExecError> {
    let comm = join_comm(&name, index, size, id, stream.clone(), abort, rank)?;
    Ok(NcclGroup {
        comm: Mutex::new(Some(Shared(comm))),
        stream,
        device: dev.clone(),
        size,
        index,
        name,
        abort: abort.clone(),
    })
}

/// Makes a unique id for a communicator this process roots.
pub fn new_id() -> Result<[u8; ID_BYTES], ExecError> {
    let id = Id::new().map_err(|e| nccl_err("start-up", "ncclGetUniqueId", e))?;
    Ok(id.internal().map(|c| c as u8))
}

/// This process's one rank of `plan` on the GPU `device`: a CUDA stream per collective
/// plan stream and an NCCL communicator per (process group, stream) (and the expert
/// group's, on a stream of its own, for the compute stream's all-to-all), their unique ids
/// exchanged over `processes` (the process world: TCP or MPI; `None` for a world of one
/// process), which the trainer then keeps for what the processes agree on between steps.
pub fn place(
    plan: &Plan,
    rank: u64,
    device: &Device,
    processes: Option<Box<dyn Collectives>>,
    abort: Arc<Abort>,
) -> Result<Placement, ExecError> {
    let Device::Cuda(dev) = device else {
        return Err(ExecError::Unsupported(
            "--backend nccl runs each rank on a GPU: give --device cuda".into(),
        ));
    };
    let world = plan.mesh.world();
    let started = processes.as_ref().map_or(1, |p| p.size() as u64);
    if started != world {
        return Err(ExecError::Unsupported(format!(
            "the plan's mesh is {}x{} ({world} ranks), but {started} process(es) were started: start {world}, one per GPU (`shardplan launch --nproc-per-node {world} -- shardplan train ...`)",
            plan.mesh.replicate(),
            plan.mesh.shard(),
        )));
    }
    let specs = comm_specs(plan, rank)?;
    let ctx = dev.cuda_stream().context().clone();
    let mut streams = HashMap::new();
    for s in comm_streams(&specs) {
        streams.insert(
            s,
            ctx.new_stream()
                .map_err(|e| cuda_err("creating a collective stream", e))?,
        );
    }
    let ids = exchange_ids(rank, &specs, &mut new_id, &|mine| match processes.as_ref() {
        Some(p) => all_gather_bytes(p.as_ref(), ID_TAG, &mine),
        None => Ok(vec![mine]),
    })?;
    let mut comms = Comms::default();
    for (spec, id) in specs.iter().zip(ids) {
        let stream = streams[&spec.stream].clone();
        let group = Box::new(open_group(
            spec.name(),
            spec.index,
            spec.members.len(),
            id,
            stream,
            dev,
            &abort,
            rank,
        )?);
        match spec.comm {
            // The compute stream's expert-parallel ops (the tokens' all-to-all).
            Comm::Expert => comms.expert = Some(group),
            // The compute stream's context-parallel ops (ring attention's keys and values).
            Comm::Context => comms.context = Some(group),
            _ => comms.insert(spec.comm, spec.stream, group),
        }
    }
    Ok(Placement {
        ranks: vec![(rank, comms)],
        processes,
        abort,
        backend: "nccl",
    })
}
