//! Communication: the `Collectives` trait every backend implements, per process group and
//! stream, the world's `Abort`, and the backends: `local` (ranks as threads of one
//! process), `mpi` (one process per rank over Open MPI, feature `mpi`), `nccl` (one process
//! per GPU; its device part needs feature `cuda`), plus the launcher environment (`env`).
//!
//! Multi-process runs also need a way for the processes to agree outside the plan's
//! collectives (NCCL ids at start-up, step figures between steps): the MPI world under
//! mpirun, the TCP world (`tcp`) under torchrun or `shardplan launch`.
//!
//! A backend moves real data between ranks' tensors; the rank runtime never knows which
//! backend it talks to. Every wait has a timeout, and any rank can abort the world:
//! waiters then return the abort's message instead of hanging.

pub mod env;
pub mod local;
pub mod nccl;
pub mod p2p;
pub mod tcp;

use crate::ExecError;
use candle_core::Tensor;
use shardplan_planner::{Comm, Stream};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The sum of `parts` (one per group member, in member order) in that order and in their
/// dtype, as NCCL keeps it; divided by the member count for `Avg`. Every backend reduces
/// through this one function, or (MPI, on its receive buffer) through the same operations
/// element by element, so their results agree bit for bit.
pub fn rank_order_sum(
    mut parts: impl Iterator<Item = Result<Tensor, ExecError>>,
    n: usize,
    op: Reduce,
) -> Result<Tensor, ExecError> {
    let mut acc = parts
        .next()
        .ok_or_else(|| ExecError::Internal("a reduction of no contributions".into()))??;
    for t in parts {
        acc = (acc + t?)?;
    }
    Ok(match op {
        Reduce::Avg if n > 1 => (acc / n as f64)?,
        Reduce::Sum | Reduce::Avg => acc,
    })
}

/// Something a world abort must wake (a backend's condition variable).
pub trait Wake: Send + Sync {
    fn wake(&self);
}

/// How contributions combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    /// Sum divided by the group size.
    Avg,
}

/// What every all-to-all needs of its parts: one per member of the group, each 1-D and of
/// one dtype, and one expected length from each member.
pub fn check_parts(parts: &[Tensor], lens: &[usize], members: usize) -> Result<(), ExecError> {
    if parts.len() != members || lens.len() != members {
        return Err(ExecError::Internal(format!(
            "an all-to-all of {} parts and {} expected lengths over {members} members",
            parts.len(),
            lens.len()
        )));
    }
    let dtype = parts.first().map(Tensor::dtype);
    match parts.iter().find(|p| Some(p.dtype()) != dtype || p.rank() != 1) {
        None => Ok(()),
        Some(p) => Err(ExecError::Internal(format!(
            "an all-to-all part of {:?} {:?}, not 1-D {:?}",
            p.dtype(),
            p.dims(),
            dtype
        ))),
    }
}

/// What a backend that learns the lengths it receives checks against the caller's: a
/// member that sent another length routed from another table (a bug, never the data).
pub(crate) fn check_received(got: &[Tensor], lens: &[usize]) -> Result<(), ExecError> {
    match got.iter().zip(lens).position(|(t, &l)| t.elem_count() != l) {
        None => Ok(()),
        Some(q) => Err(ExecError::Internal(format!(
            "an all-to-all: member {q} sent {} elements where this member expected {}: the members' routing disagrees",
            got[q].elem_count(),
            lens[q]
        ))),
    }
}

/// A process group as one rank sees it. `tag` is the collective's position in this
/// group's issue order: every member calls it with the same tag (Local matches the
/// contributions by it, so collectives issued from different streams cannot pair up
/// wrongly; NCCL orders by issue).
pub trait Collectives: Send + Sync {
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// This rank's index in the group.
    fn index(&self) -> usize;
    /// Concatenates every rank's `input` (equal sizes) in group order.
    fn all_gather(&self, tag: u64, input: &Tensor) -> Result<Tensor, ExecError>;
    /// Reduces every rank's `input` (its length a multiple of the group size) and returns
    /// this rank's chunk of the result; computed in `input`'s dtype.
    fn reduce_scatter(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError>;
    /// Reduces every rank's `input` and returns the result to all.
    fn all_reduce(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError>;
    /// Group member 0's `input`, to all.
    fn broadcast(&self, tag: u64, input: &Tensor) -> Result<Tensor, ExecError>;
    /// Returns when every member has arrived.
    fn barrier(&self, tag: u64) -> Result<(), ExecError>;
    /// Sends `parts[i]` (1-D, one dtype, any lengths) to member `i` and returns what each
    /// member sent this one, in member order; `lens[i]` is the length member `i` sends this
    /// one, which the caller knows (expert parallelism's routing table is every member's),
    /// so a backend needs no count exchange. A collective taking two tags, `tag` and
    /// `tag + 1`. This default moves every member's parts to every member through two
    /// all-gathers (the lengths, then the parts padded to the longest): correct on every
    /// backend, `size` times the traffic of a real all-to-all.
    fn all_to_all(&self, tag: u64, parts: &[Tensor], lens: &[usize]) -> Result<Vec<Tensor>, ExecError> {
        let n = self.size();
        check_parts(parts, lens, n)?;
        let first = parts
            .first()
            .ok_or_else(|| ExecError::Internal("an all-to-all over no members".into()))?;
        let (dtype, device) = (first.dtype(), first.device().clone());
        let sent: Vec<f64> = parts.iter().map(|p| p.elem_count() as f64).collect();
        let all_lens = self
            .all_gather(tag, &Tensor::from_vec(sent, n, &device)?)?
            .to_vec1::<f64>()?;
        let width = all_lens.iter().fold(0f64, |a, &b| a.max(b)) as usize;
        if width == 0 {
            let got: Vec<Tensor> = (0..n)
                .map(|_| Tensor::zeros(0, dtype, &device))
                .collect::<Result<_, _>>()?;
            check_received(&got, lens)?;
            return Ok(got);
        }
        let padded: Vec<Tensor> = parts
            .iter()
            .map(|p| {
                let short = width - p.elem_count();
                if short == 0 {
                    Ok(p.clone())
                } else {
                    Tensor::cat(&[p.clone(), Tensor::zeros(short, dtype, &device)?], 0)
                }
            })
            .collect::<Result<_, _>>()?;
        let all = self.all_gather(tag.wrapping_add(1), &Tensor::cat(&padded, 0)?)?;
        let me = self.index();
        let got = (0..n)
            .map(|q| {
                let len = all_lens[q * n + me] as usize;
                Ok(all.narrow(0, (q * n + me) * width, len)?)
            })
            .collect::<Result<Vec<_>, ExecError>>()?;
        check_received(&got, lens)?;
        Ok(got)
    }
    /// Whether a call only enqueues its collective, which completes later on the device
    /// (NCCL). A rank then launches the collectives of all its communicators in one order,
    /// the plan's issue order, the same on every rank (`runtime::rank`), as NCCL requires of
    /// communicators whose work may run concurrently. Blocking backends (Local, MPI, TCP)
    /// complete each call before returning and need no such order.
    fn enqueues(&self) -> bool {
        false
    }
    /// Waits until everything enqueued so far has completed, under the collective timeout;
    /// a failed or hung enqueued collective is reported here (at the end of a step).
    fn flush(&self) -> Result<(), ExecError> {
        Ok(())
    }
    /// Where this group's work is timed: the host for a backend that does the work in the
    /// call, the CUDA stream it enqueues on for one that `enqueues`.
    fn clock(&self) -> crate::clock::Clock {
        crate::clock::Clock::Host
    }
}

/// The communicators of one rank: one per (process group, stream) its program issues
/// collectives on, so collectives of different streams never queue behind one another.
#[derive(Default)]
pub struct Comms {
    by: HashMap<(Comm, Stream), Box<dyn Collectives>>,
    /// The tensor group the compute stream's tensor-parallel ops run over (a
    /// communicator of its own, apart from the plan's instructions'); `None` without
    /// tensor parallelism.
    pub tensor: Option<Box<dyn Collectives>>,
    /// The expert group the compute stream's expert-parallel ops (the tokens' all-to-all)
    /// run over; `None` without expert parallelism.
    pub expert: Option<Box<dyn Collectives>>,
    /// The context group the compute stream's context-parallel ops (ring attention's keys
    /// and values) run over; `None` without context parallelism.
    pub context: Option<Box<dyn Collectives>>,
}

impl Comms {
    /// Adds the communicator of process group `c` used by stream `s`.
    pub fn insert(&mut self, c: Comm, s: Stream, handle: Box<dyn Collectives>) {
        self.by.insert((c, s), handle);
    }

    pub fn get(&self, c: Comm, s: Stream) -> Result<&dyn Collectives, ExecError> {
        self.by
            .get(&(c, s))
            .map(|b| b.as_ref())
            .ok_or_else(|| ExecError::Internal(format!("no communicator for the {c:?} group on the {s:?} stream")))
    }
}

/// Why the world stopped (the first failure any rank reported), and how long any wait may
/// take before it is a failure.
pub struct Abort {
    reason: Mutex<Option<String>>,
    watchers: Mutex<Vec<Arc<dyn Wake>>>,
    timeout_ms: std::sync::atomic::AtomicU64,
}

impl Default for Abort {
    fn default() -> Self {
        Abort {
            reason: Mutex::new(None),
            watchers: Mutex::new(Vec::new()),
            timeout_ms: std::sync::atomic::AtomicU64::new(300_000),
        }
    }
}

impl Abort {
    /// How long a collective or an event may wait.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(std::sync::atomic::Ordering::Relaxed))
    }

    pub fn set_timeout(&self, t: Duration) {
        self.timeout_ms.store(
            t.as_millis().min(u128::from(u64::MAX)) as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Records `reason` (the first one wins) and wakes every waiting rank.
    pub fn abort(&self, reason: String) {
        {
            let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
            if r.is_none() {
                *r = Some(reason);
            }
        }
        let watchers: Vec<Arc<dyn Wake>> = self.watchers.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for w in watchers {
            w.wake();
        }
    }

    /// Registers something to wake when the world aborts (a backend's waiting ranks).
    pub fn watch(&self, w: Arc<dyn Wake>) {
        self.watchers.lock().unwrap_or_else(|e| e.into_inner()).push(w);
    }

    /// The reason, if the world was aborted.
    pub fn reason(&self) -> Option<String> {
        self.reason.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Every member's `mine`, in member order (variable lengths; a collective taking two
/// tags, `tag` and `tag + 1`).
pub fn all_gather_bytes(c: &dyn Collectives, tag: u64, mine: &[u8]) -> Result<Vec<Vec<u8>>, ExecError> {
    let cpu = candle_core::Device::Cpu;
    let lens = c
        .all_gather(tag, &Tensor::new(&[mine.len() as f64], &cpu)?)?
        .to_vec1::<f64>()?;
    let width = lens.iter().fold(1f64, |a, &b| a.max(b)) as usize;
    let mut padded = mine.to_vec();
    padded.resize(width, 0);
    let all = c
        .all_gather(tag.wrapping_add(1), &Tensor::from_vec(padded, width, &cpu)?)?
        .to_vec1::<u8>()?;
    lens.iter()
        .enumerate()
        .map(|(i, &n)| {
            all.get(i * width..i * width + n as usize)
                .map(<[u8]>::to_vec)
                .ok_or_else(|| ExecError::Internal(format!("member {i} sent {n} bytes in a {width}-byte slot")))
        })
        .collect()
}

/// Bytes of a tensor.
pub fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// The (process group, stream) pairs on which a plan's program issues collectives, in a
/// fixed order (every rank creates its communicators in this order: MPI and NCCL need the
/// same order everywhere).
pub fn channels(plan: &shardplan_planner::Plan) -> Vec<(shardplan_planner::Comm, shardplan_planner::Stream)> {
    // The planner counts the same communicators for NCCL's memory (`Program::communicators`).
    let mut out: Vec<_> = plan.programs.iter().flat_map(|p| p.communicators()).collect();
    out.sort();
    out.dedup();
    out
}

/// The ranks this process runs, their communicators, and how processes talk to each other.
pub struct Placement {
    /// Every rank this process runs, in rank order, with its communicators.
    pub ranks: Vec<(u64, Comms)>,
    /// One member per process, for what the processes agree on between steps (metrics, a
    /// stop request, checkpoint completion); `None` when this process runs every rank.
    pub processes: Option<Box<dyn Collectives>>,
    /// Stops every local rank (and, through the backend, the world) on the first failure.
    pub abort: Arc<Abort>,
    /// The backend's name, as `--backend` spells it.
    pub backend: &'static str,
}
