//! One rank running one optimizer step of a Plan: a worker thread per stream, each running
//! its stream's instructions in order, synchronised only by the Plan's events.
//!
//! - `alloc` / `free` are sequenced in issue order across the rank's streams (an allocation
//!   waits until every earlier-issued free has happened), so the bytes held follow the
//!   plan's memory levels exactly; they are measured from the tensors themselves.
//! - Unsharded parameters are views into the flat all-gather output; gradients are written
//!   into the flat unsharded-gradient buffer in the same (padded, rank-major) layout, which
//!   the reduce-scatter reduces.
//! - The compute stream runs each step's nodes in the planner's execution order and frees a
//!   value after its last reader (`ExecOrder`), recompute copies included. Attention's
//!   backward runs blockwise (`ExecOrder::blockwise_attention`): its `[b, h, s, t]` values
//!   are empty placeholders, and its first gradient node makes all of its gradients.

pub use crate::comm::Comms;

mod compute;
mod norm;
use crate::comm::{tensor_bytes, Abort, Reduce};

use crate::clock::{Clock, Mark, Origin};
use crate::cpu::fused;
use crate::cpu::kernels::{apply, cdtype, Ctx};
use crate::runtime::optim::OptState;
use crate::ExecError;
use candle_core::{DType as CDType, Tensor};
use compute::{flatten, Compute};
use norm::GradScale;
use shardplan_ir::{JointGraph, NodeId, Op};
use shardplan_planner::{
    chunk_rows, BufId, ByCategory, Category, Comm, ExecOrder, GroupLayout, Instr, Plan, Pool, ReduceOp, Stream,
};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// What every rank shares, read-only.
pub struct Shared {
    pub plan: Plan,
    pub joint: JointGraph,
    pub exec: ExecOrder,
    /// Position in `exec.order` where each step starts.
    pub step_start: Vec<usize>,
    pub clip: Option<f64>,
    /// Failures injected by tests.
    pub faults: Vec<Injected>,
    /// Launch collectives in issue order even on blocking backends (tests of the order an
    /// enqueueing backend gets; see `Collectives::enqueues`).
    pub ordered_launch: bool,
    /// Time every node the compute stream runs (`RankStepOut::node_seconds`); off, the
    /// node loop reads no clock.
    pub profile: bool,
    /// shardplan's own CUDA kernels for attention's backward, the gradient norm and AdamW
    /// (`--kernels native`, [`crate::gpu`]); the ranks' kernel contexts say the same.
    pub native: bool,
    /// Time instructions (and, with `profile`, nodes) by CUDA events on the streams their
    /// work is issued to, not by the host's clock (`crate::clock`): a GPU run's `--profile`
    /// and `--trace`. No effect on the CPU, whose work the host clock times.
    pub device_clock: bool,
}

/// A failure a test injects at one instruction of one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The rank stops making progress (a hung or dead process).
    Stall,
    /// The instruction fails.
    Fail,
    /// The instruction fails as a CUDA allocation that finds the device full does (the
    /// driver's error, as cudarc words it): the out-of-memory path without a full GPU.
    OutOfMemory,
}

/// `fault` at instruction `instr` of `rank`'s program, at step `step` of the run
/// (counting from 1, as the log does) or, `None`, at every step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Injected {
    pub rank: u64,
    pub instr: usize,
    pub fault: Fault,
    pub step: Option<u64>,
}

/// The driver's out-of-memory error as cudarc prints it, for [`Fault::OutOfMemory`].
#[derive(Debug)]
struct InjectedOutOfMemory;

impl std::fmt::Display for InjectedOutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\") (injected)")
    }
}

impl std::error::Error for InjectedOutOfMemory {}

/// What a run that ran out of device memory is told beside the error: what the plan
/// predicted, why the prediction and the device can part, that no checkpoint was touched,
/// and what leaves more room.
pub fn out_of_memory_advice(plan: &Plan) -> String {
    use shardplan_planner::print::bytes;
    let m = &plan.memory;
    format!(
        "  the GPU ran out of memory. The plan puts each rank's device memory at {} (the caching allocator's reserved peak {} + {} for the CUDA context and NCCL), checked against the device's free memory at start: something outside the plan took the rest (another process on the GPU, more ranks on it than planned), or the executor holds more than the plan predicts (`--profile`, then `plan --compare`, sets the measured peaks beside the plan's).\n  \
         Every rank stopped; checkpoints already written are complete (continue with --resume DIR).\n  \
         To leave more room: lower batch.per_rank (raise grad_accum to keep the global batch), set activation_checkpointing: full, or find what fits with `shardplan plan --memory-budget`.",
        bytes(m.device_total),
        bytes(m.reserved_peak),
        bytes(m.overhead.total()),
    )
}

/// What a rank keeps between steps.
pub struct RankState {
    pub rank: u64,
    pub comms: Comms,
    /// Flat f32 shard of each group's parameters (padded).
    pub params: Vec<Tensor>,
    pub opt: Vec<OptState>,
    pub ctx: Ctx,
}

/// What one step measured on one rank.
#[derive(Clone, Debug, Default)]
pub struct RankStepOut {
    /// Loss of each micro-batch on this rank's rows.
    pub losses: Vec<f32>,
    /// Global gradient norm (after reduction), when the plan computes it.
    pub grad_norm: Option<f64>,
    /// Most bytes per category held at once (device), activations from the value table.
    pub max_by_category: ByCategory,
    /// Most bytes held at once (device), all categories.
    pub peak: u64,
    /// Most host bytes per category (CPU offload).
    pub host: ByCategory,
    /// Measured start and end of every instruction, in seconds since the Unix epoch (one
    /// clock for every rank of a node, so ranks' timelines line up).
    pub times: Vec<[f64; 2]>,
    /// With `Shared::profile`: each node the compute stream ran and its host time, seconds
    /// (its inputs gathered, its kernel, its frees), in the order run.
    pub node_seconds: Vec<(NodeId, f64)>,
    /// Under expert parallelism: the step's heaviest routing in this rank's expert group.
    pub routing: Option<crate::cpu::expert::RoutingLoad>,
}

/// Seconds since the Unix epoch, as an f64 (microsecond resolution for centuries).
pub use crate::clock::wall_seconds;

struct Event {
    set: Mutex<bool>,
    cv: Condvar,
}

#[derive(Default)]
struct Memory {
    device: ByCategory,
    host: ByCategory,
    max: ByCategory,
    host_max: ByCategory,
    peak: u64,
    activations: u64,
    /// The outputs of all-to-all steps issued and not yet joined by the compute stream
    /// (`Step::waits_for`): counted from their issue, as the plan counts them.
    in_flight: u64,
}

impl Memory {
    fn observe(&mut self) {
        let mut level = self.device;
        level.activations = self.activations + self.in_flight;
        for c in Category::ALL {
            *self.max.slot(c) = self.max.get(c).max(level.get(c));
            *self.host_max.slot(c) = self.host_max.get(c).max(self.host.get(c));
        }
        self.peak = self.peak.max(level.total());
    }
}

/// A buffer's contents. An allocated buffer reads as zeros until it is written, and the
/// zeros are only made if something reads them before writing: most buffers are
/// overwritten whole (gathers, staging copies), and an accumulator's first contribution
/// simply becomes its value.
#[derive(Default)]
enum Slot {
    #[default]
    Free,
    Zero,
    Value(Tensor),
}

/// Bytes of a buffer as the plan sizes it (what its zeros would hold).
fn planned_bytes(b: &shardplan_planner::Buffer) -> u64 {
    b.numel * cdtype(b.dtype).size_in_bytes() as u64
}

/// One step's state on one rank, shared by its stream threads.
struct StepCtx<'a> {
    shared: &'a Shared,
    rank: u64,
    comms: &'a Comms,
    abort: &'a Abort,
    device: candle_core::Device,
    bufs: Vec<Mutex<Slot>>,
    events: Vec<Event>,
    /// Issue-order sequence number of each alloc/free, and the next one allowed to run.
    mem_seq: Vec<usize>,
    /// Issue-order sequence number of each collective, and the next one allowed to launch,
    /// when collectives launch in issue order (`ordered`).
    launch_seq: Vec<usize>,
    launch_turn: Mutex<usize>,
    launch_cv: Condvar,
    ordered: bool,
    /// Each collective's position in its group's issue order (within the run).
    tags: Vec<u64>,
    mem_turn: Mutex<usize>,
    mem_cv: Condvar,
    memory: Mutex<Memory>,
    opt: Mutex<&'a mut Vec<OptState>>,
    batches: &'a [HashMap<String, Tensor>],
    lr: f64,
    out: Mutex<RankStepOut>,
    /// Start and end of each instruction (written by the stream that runs it).
    times: Vec<Mutex<[f64; 2]>>,
    /// With device timing: the step's origin on the compute stream, the compute stream's
    /// clock, each instruction's marks on its stream (resolved into `times` after the step)
    /// and the compute nodes' marks (into `node_seconds`).
    origin: Option<Origin>,
    clock: Clock,
    marks: Vec<Mutex<Option<(Mark, Mark)>>>,
    node_marks: Mutex<Vec<(NodeId, Mark, Mark)>>,
    /// The reduced sum of squares of the gradients when it lives on a GPU, read after the
    /// step (the one host wait of a step).
    norm: Mutex<Option<Tensor>>,
    /// Each micro-batch's loss when it lives on a GPU (and its node), read after the step.
    device_losses: Mutex<Vec<(Tensor, NodeId)>>,
    /// The expert group the all-to-all stream's steps run over.
    expert: Option<std::sync::Arc<crate::cpu::expert::ExpertGroup>>,
    /// Per compute-stream event an all-to-all step waits for before it runs: that step's
    /// issue index. The compute stream hands the step its operands as it records it.
    ready_of: HashMap<usize, usize>,
    /// Operands handed to all-to-all steps, by issue index (`None`: an earlier all-to-all
    /// step's output, in `kept`).
    mailbox: Mutex<HashMap<usize, Vec<Option<Tensor>>>>,
    /// All-to-all steps' outputs that later all-to-all steps read, by value slot and
    /// micro-batch, until the last of them (`a2a_last`) has run.
    kept: Mutex<HashMap<(usize, u32), Tensor>>,
    /// Per value slot and micro-batch: the issue index of the last all-to-all step that
    /// reads it.
    a2a_last: HashMap<(usize, u32), usize>,
    /// All-to-all steps' outputs, by step and micro-batch, until the compute step that
    /// waits for them takes them.
    outbox: Mutex<HashMap<(u32, u32), Tensor>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl StepCtx<'_> {
    fn get(&self, b: BufId) -> Result<Tensor, ExecError> {
        let mut slot = lock(&self.bufs[b.index()]);
        match &*slot {
            Slot::Value(t) => Ok(t.clone()),
            Slot::Zero => {
                let info = self.shared.plan.buffer(b);
                let t = Tensor::zeros(info.numel as usize, cdtype(info.dtype), &self.pool_device(info.pool))?;
                *slot = Slot::Value(t.clone());
                Ok(t)
            }
            Slot::Free => Err(self.not_allocated(b)),
        }
    }

    fn not_allocated(&self, b: BufId) -> ExecError {
        ExecError::Internal(format!("{} ({}) is not allocated", b, self.shared.plan.buffer(b).name))
    }

    /// Where a pool's buffers live: the compute device, or the CPU for the host pool.
    fn pool_device(&self, pool: Pool) -> candle_core::Device {
        match pool {
            Pool::Host => candle_core::Device::Cpu,
            _ => self.device.clone(),
        }
    }

    /// Adds `t` to buffer `b` (which becomes `t` itself while it still reads as zeros).
    fn accumulate(&self, b: BufId, t: Tensor) -> Result<(), ExecError> {
        let current = {
            let slot = lock(&self.bufs[b.index()]);
            match &*slot {
                Slot::Value(acc) => Some(acc.clone()),
                Slot::Zero => None,
                Slot::Free => return Err(self.not_allocated(b)),
            }
        };
        let dtype = cdtype(self.shared.plan.buffer(b).dtype);
        let t = t.to_dtype(dtype)?;
        match current {
            Some(acc) => self.set(b, (acc + t)?),
            None => self.set(b, t),
        }
    }

    fn set(&self, b: BufId, t: Tensor) -> Result<(), ExecError> {
        let want = self.shared.plan.buffer(b).numel as usize;
        if t.elem_count() != want {
            return Err(ExecError::Internal(format!(
                "{} ({}) holds {} elements, the plan says {want}",
                b,
                self.shared.plan.buffer(b).name,
                t.elem_count()
            )));
        }
        *lock(&self.bufs[b.index()]) = Slot::Value(t);
        Ok(())
    }

    fn wait_until(&self, deadline: Instant, what: &str) -> Result<(), ExecError> {
        if let Some(r) = self.abort.reason() {
            return Err(ExecError::Aborted(r));
        }
        if Instant::now() >= deadline {
            return Err(ExecError::Internal(format!(
                "{what} timed out after {:.1} s",
                self.abort.timeout().as_secs_f64()
            )));
        }
        Ok(())
    }

    /// Runs `f` when every earlier-issued alloc/free of this rank has run.
    fn sequenced(&self, i: usize, f: impl FnOnce(&mut Memory)) -> Result<(), ExecError> {
        let q = self.mem_seq[i];
        let deadline = Instant::now() + self.abort.timeout();
        let mut turn = lock(&self.mem_turn);
        while *turn != q {
            self.wait_until(deadline, "waiting for an earlier free")?;
            turn = self
                .mem_cv
                .wait_timeout(turn, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        f(&mut lock(&self.memory));
        *turn += 1;
        self.mem_cv.notify_all();
        Ok(())
    }

    /// Launches collective `i` with `f`: when this rank launches in issue order, only after
    /// every earlier-issued collective of the rank was launched. Every rank runs the same
    /// program, so every rank launches its collectives on all its communicators in the same
    /// order. Deadlock-free even when a launch blocks until the collective completes:
    /// whatever collective `i` waits for (its stream's earlier instructions, the events it
    /// waits on, earlier launches) was issued before it, so by induction over issue order
    /// every earlier collective is launched on every rank.
    /// An instruction without a launch turn (`usize::MAX`: no collective) runs at once.
    fn launch<T>(&self, i: usize, f: impl FnOnce() -> Result<T, ExecError>) -> Result<T, ExecError> {
        let q = self.launch_seq[i];
        if !self.ordered || q == usize::MAX {
            return f();
        }
        let deadline = Instant::now() + self.abort.timeout();
        let mut turn = lock(&self.launch_turn);
        while *turn != q {
            self.wait_until(deadline, "waiting for an earlier collective's launch")?;
            turn = self
                .launch_cv
                .wait_timeout(turn, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(turn);
        let r = f();
        *lock(&self.launch_turn) += 1;
        self.launch_cv.notify_all();
        r
    }

    fn record(&self, e: usize) {
        let ev = &self.events[e];
        *lock(&ev.set) = true;
        ev.cv.notify_all();
    }

    fn wait(&self, e: usize) -> Result<(), ExecError> {
        let ev = &self.events[e];
        let deadline = Instant::now() + self.abort.timeout();
        let mut set = lock(&ev.set);
        while !*set {
            self.wait_until(deadline, &format!("waiting on e{e}"))?;
            set = ev
                .cv
                .wait_timeout(set, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }
}

impl StepCtx<'_> {
    /// Runs instruction `i`. `state` is the compute stream's activations and parameter
    /// views: the compute stream's steps run on it, and so does a step on the all-to-all
    /// stream (an expert-group collective), which the plan orders between two compute steps
    /// (the verifier's activation order), so the two never hold it at once for long.
    fn execute(&self, i: usize, state: &Mutex<Option<Compute>>) -> Result<(), ExecError> {
        let plan = &self.shared.plan;
        let issued = &plan.programs[0].instrs[i];
        match &issued.instr {
            Instr::Alloc { buf } => {
                let b = plan.buffer(*buf);
                let bytes = planned_bytes(b);
                *lock(&self.bufs[buf.index()]) = Slot::Zero;
                self.sequenced(i, |m| {
                    let level = if b.pool == Pool::Host {
                        &mut m.host
                    } else {
                        &mut m.device
                    };
                    *level.slot(b.category) += bytes;
                    m.observe();
                })?;
            }
            Instr::Free { buf } => {
                let b = plan.buffer(*buf);
                let bytes = match std::mem::take(&mut *lock(&self.bufs[buf.index()])) {
                    Slot::Value(t) => tensor_bytes(&t),
                    Slot::Zero => planned_bytes(b),
                    Slot::Free => 0,
                };
                if issued.stream == Stream::Compute {
                    if let Some(c) = lock(state).as_mut() {
                        c.params.remove(buf);
                    }
                }
                self.sequenced(i, |m| {
                    let level = if b.pool == Pool::Host {
                        &mut m.host
                    } else {
                        &mut m.device
                    };
                    *level.slot(b.category) = level.get(b.category).saturating_sub(bytes);
                })?;
            }
            Instr::Record { event } => {
                if let Some(&x) = self.ready_of.get(&event.index()) {
                    self.hand_operands(x, state)?;
                }
                self.record(event.index());
            }
            Instr::Wait { event } => self.wait(event.index())?,
            Instr::Compute {
                step,
                micro,
                reads,
                writes,
            } => {
                if issued.stream == Stream::AllToAll {
                    return self.launch(i, || self.all_to_all(i, step.index(), *micro));
                }
                // The state is taken after the launch turn: a stream holding it never waits
                // for a turn (see `launch`).
                self.launch(i, || {
                    let mut guard = lock(state);
                    let c = guard
                        .as_mut()
                        .ok_or_else(|| ExecError::Internal("no compute state for this step".into()))?;
                    self.compute(c, step.index(), *micro, reads, writes)
                })?;
            }
            Instr::AllGather { comm, src, dst, .. } => {
                let dtype = cdtype(plan.buffer(*dst).dtype);
                let input = self.get(*src)?.to_dtype(dtype)?;
                let c = self.comms.get(*comm, issued.stream)?;
                let out = self.launch(i, || c.all_gather(self.tags[i], &input))?;
                self.set(*dst, out)?;
            }
            Instr::PackGrads { group, srcs, dst } => {
                let layout = &plan.groups[group.index()].layout;
                let mut per_param: Vec<Option<Tensor>> = vec![None; layout.params.len()];
                for &b in srcs {
                    let piece = self.get(b)?;
                    let mut off = 0usize;
                    for p in &plan.buffer(b).params {
                        let i = layout.params.iter().position(|l| l.param == *p).ok_or_else(|| {
                            ExecError::Internal(format!("{p} of {} is not in {group}", plan.buffer(b).name))
                        })?;
                        let n = layout.params[i].numel() as usize;
                        per_param[i] = Some(piece.narrow(0, off, n)?);
                        off += n;
                    }
                }
                let packed = flatten(layout, &per_param, cdtype(plan.buffer(*dst).dtype), &self.device)?;
                self.set(*dst, packed)?;
            }
            Instr::ReduceScatter { comm, op, src, dst, .. } => {
                let input = self.get(*src)?;
                let c = self.comms.get(*comm, issued.stream)?;
                let part = self.launch(i, || c.reduce_scatter(self.tags[i], &input, reduce(*op)))?;
                self.accumulate(*dst, scaled(part, *op)?)?;
            }
            Instr::AllReduce { comm, op, buf, .. } => {
                let t = self.get(*buf)?;
                let c = self.comms.get(*comm, issued.stream)?;
                let r = self.launch(i, || c.all_reduce(self.tags[i], &t, reduce(*op)))?;
                self.set(*buf, scaled(r, *op)?)?;
            }
            Instr::Copy { src, dst, accumulate } => {
                let s = self.get(*src)?;
                let d = plan.buffer(*dst);
                let value = if (d.numel as usize) < s.elem_count() {
                    // A post-forward shard: this rank's slice of its reshard group.
                    let n = d.numel as usize;
                    let k = s.elem_count() / n;
                    let j = plan.mesh.coords(self.rank).shard as usize % k;
                    s.narrow(0, j * n, n)?.copy()?
                } else {
                    s.to_dtype(cdtype(d.dtype))?.copy()?
                };
                // Between pools (CPU offload), the copy is a transfer.
                let value = value.to_device(&self.pool_device(d.pool))?;
                if *accumulate {
                    self.accumulate(*dst, value)?;
                } else {
                    self.set(*dst, value)?;
                }
            }
            Instr::GradNorm { grads, dst } => {
                let scale = 1.0 / plan.policy.grad_accum as f64;
                let norm = self.sum_squares(grads, scale)?;
                self.set(*dst, norm)?;
            }
            Instr::OptimizerStep {
                group,
                params,
                grads,
                norm,
                ..
            } => {
                let accum = 1.0 / plan.policy.grad_accum as f64;
                let scale = match norm {
                    None => GradScale::Host(accum),
                    Some(n) => self.clip_scale(&self.get(*n)?, accum)?,
                };
                let mut g = self.get(*grads)?;
                if self.shared.native {
                    let (host, factor) = match &scale {
                        GradScale::Host(s) => (*s, None),
                        GradScale::Device(s) => (1.0, Some(s)),
                    };
                    let mut p = [self.get(*params)?];
                    if lock(&self.opt)[group.index()].step_native(&mut p, &g, self.lr, host, factor)? {
                        let [p] = p;
                        self.set(*params, p)?;
                        return Ok(());
                    }
                }
                let host_scale = match scale {
                    GradScale::Host(s) => s,
                    GradScale::Device(s) => {
                        g = g.broadcast_mul(&s.to_dtype(g.dtype())?)?;
                        1.0
                    }
                };
                let mut p = [self.get(*params)?];
                lock(&self.opt)[group.index()].step_scaled(&mut p, &[g], self.lr, host_scale)?;
                let [p] = p;
                self.set(*params, p)?;
            }
        }
        Ok(())
    }
}

fn reduce(op: ReduceOp) -> Reduce {
    match op {
        ReduceOp::Sum | ReduceOp::AvgOver(_) => Reduce::Sum,
        ReduceOp::Avg => Reduce::Avg,
    }
}

/// `t` divided as `op` asks after the backend's reduction ([`ReduceOp::AvgOver`]).
fn scaled(t: Tensor, op: ReduceOp) -> Result<Tensor, ExecError> {
    match op {
        ReduceOp::AvgOver(n) if n > 1 => Ok((t / n as f64)?),
        _ => Ok(t),
    }
}

/// Runs one step of `shared.plan` on `state`, with the micro-batches of this rank.
pub fn run_step(
    shared: &Shared,
    state: &mut RankState,
    abort: &Abort,
    batches: &[HashMap<String, Tensor>],
    lr: f64,
    step_no: u64,
) -> Result<RankStepOut, ExecError> {
    crate::runtime::device::bind_thread(&state.ctx.device)?;
    let plan = &shared.plan;
    let program = &plan.programs[0];
    let mut mem_seq = vec![usize::MAX; program.instrs.len()];
    let mut launch_seq = vec![usize::MAX; program.instrs.len()];
    let mut tags = vec![0u64; program.instrs.len()];
    let mut q = 0;
    let mut launches = 0;
    let mut ordered = shared.ordered_launch;
    let mut per_comm: HashMap<Comm, u64> = HashMap::new();
    for (i, x) in program.instrs.iter().enumerate() {
        if matches!(x.instr, Instr::Alloc { .. } | Instr::Free { .. }) {
            mem_seq[i] = q;
            q += 1;
        }
        if let Some((comm, _, _)) = x.instr.collective() {
            let n = per_comm.entry(comm).or_insert(0);
            tags[i] = (step_no << 32) | *n;
            *n += 1;
            launch_seq[i] = launches;
            launches += 1;
            ordered |= state.comms.get(comm, x.stream)?.enqueues();
        }
        // A compute step that runs collectives among its ops (tensor or expert parallelism)
        // takes one launch turn for all of them: no other stream's collective launches
        // between two of them, so their order among the rank's launches is the issue
        // order on every rank.
        if let Instr::Compute { step, .. } = &x.instr {
            if plan.steps.get(step.index()).is_some_and(|s| !s.tensor_ops.is_empty()) {
                launch_seq[i] = launches;
                launches += 1;
            }
        }
    }
    // The compute-stream event each all-to-all step waits for last before it runs.
    let mut ready_of = HashMap::new();
    let mut a2a_last = HashMap::new();
    let mut last_wait = None;
    for (i, x) in program.instrs.iter().enumerate() {
        if let (Stream::AllToAll, Instr::Compute { step, micro, .. }) = (x.stream, &x.instr) {
            if let (Some(s), Some(r)) = (
                plan.steps.get(step.index()),
                plan.steps.get(step.index()).and_then(|s| s.nodes.first()),
            ) {
                let id = NodeId(r.start);
                let copy = s.phase == shardplan_planner::Phase::Recompute;
                for &input in &shared.joint.graph.node(id).inputs {
                    a2a_last.insert((shared.exec.read_slot(id, copy, input), *micro), i);
                }
            }
        }
        match x.instr {
            Instr::Wait { event } if x.stream == Stream::AllToAll => last_wait = Some(event.index()),
            Instr::Compute { .. } if x.stream == Stream::AllToAll => {
                let e = last_wait.take().filter(|&e| {
                    program.instrs[..i].iter().any(|r| {
                        r.stream == Stream::Compute && matches!(r.instr, Instr::Record { event } if event.index() == e)
                    })
                });
                let e = e.ok_or_else(|| {
                    ExecError::Internal(format!(
                        "all-to-all step #{i} does not wait for the compute stream just before it"
                    ))
                })?;
                ready_of.insert(e, i);
            }
            _ => {}
        }
    }
    let RankState {
        rank,
        comms,
        params,
        opt,
        ctx,
    } = state;
    let bufs: Vec<Mutex<Slot>> = (0..plan.buffers.len()).map(|_| Mutex::new(Slot::Free)).collect();
    let mut memory = Memory::default();
    // The persistent buffers of each group: sharded parameters (always) and optimizer state.
    let mut sharded = Vec::with_capacity(plan.groups.len());
    for (g, p) in params.iter().enumerate() {
        let b = plan
            .persistent_buffer(g, Category::ShardedParams)
            .ok_or_else(|| ExecError::Internal(format!("no sharded parameter buffer for g{g}")))?;
        sharded.push(b.id);
        *lock(&bufs[b.id.index()]) = Slot::Value(p.clone());
        let level = if b.pool == Pool::Host {
            &mut memory.host
        } else {
            &mut memory.device
        };
        *level.slot(Category::ShardedParams) += tensor_bytes(p);
        if let Some(ob) = plan.persistent_buffer(g, Category::OptimizerState) {
            let level = if ob.pool == Pool::Host {
                &mut memory.host
            } else {
                &mut memory.device
            };
            *level.slot(Category::OptimizerState) += opt[g].bytes();
        }
    }
    memory.observe();
    // Device timing: one origin on the compute stream, every mark measured from it.
    let device_clock = Clock::of_device(&ctx.device);
    let origin = if shared.device_clock && device_clock.is_device() {
        Some(Origin::new(&device_clock)?)
    } else {
        None
    };
    let cx = StepCtx {
        shared,
        // The device pool's device; the host pool is the CPU (`pool_device`). On the CPU
        // backend both are host memory, accounted apart all the same.
        device: ctx.device.clone(),
        rank: *rank,
        comms,
        abort,
        bufs,
        events: (0..plan.events)
            .map(|_| Event {
                set: Mutex::new(false),
                cv: Condvar::new(),
            })
            .collect(),
        mem_seq,
        launch_seq,
        launch_turn: Mutex::new(0),
        launch_cv: Condvar::new(),
        ordered,
        tags,
        mem_turn: Mutex::new(0),
        mem_cv: Condvar::new(),
        memory: Mutex::new(memory),
        opt: Mutex::new(opt),
        batches,
        lr,
        out: Mutex::new(RankStepOut::default()),
        times: (0..program.instrs.len()).map(|_| Mutex::new([0.0; 2])).collect(),
        clock: if origin.is_some() { device_clock } else { Clock::Host },
        origin,
        marks: (0..program.instrs.len()).map(|_| Mutex::new(None)).collect(),
        node_marks: Mutex::new(Vec::new()),
        expert: ctx.expert_group(),
        ready_of,
        mailbox: Mutex::new(HashMap::new()),
        kept: Mutex::new(HashMap::new()),
        a2a_last,
        outbox: Mutex::new(HashMap::new()),
        norm: Mutex::new(None),
        device_losses: Mutex::new(Vec::new()),
    };
    let n_values = shared.joint.graph.node_count() * 2;
    let state = Mutex::new(Some(Compute {
        ctx,
        values: vec![None; n_values],
        early: HashMap::new(),
        live: 0,
        micro: None,
        params: HashMap::new(),
    }));
    let result: Result<(), ExecError> = std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for stream in Stream::ALL {
            let list: Vec<usize> = program
                .instrs
                .iter()
                .enumerate()
                .filter(|(_, x)| x.stream == stream)
                .map(|(i, _)| i)
                .collect();
            if list.is_empty() {
                continue;
            }
            let cx = &cx;
            let state = &state;
            // The CUDA stream this plan stream's work is issued to: the compute stream's,
            // or that of the communicators its collectives run on (one per plan stream).
            let clock = match (&cx.origin, stream) {
                (None, _) => None,
                (Some(_), Stream::Compute) => Some(cx.clock.clone()),
                (Some(_), Stream::AllToAll) => {
                    Some(cx.comms.expert.as_ref().map_or_else(|| cx.clock.clone(), |e| e.clock()))
                }
                (Some(_), _) => Some(
                    list.iter()
                        .find_map(|&i| program.instrs[i].instr.collective().map(|(c, _, _)| c))
                        .map(|c| cx.comms.get(c, stream).map(|g| g.clock()))
                        .transpose()?
                        .unwrap_or_else(|| cx.clock.clone()),
                ),
            };
            handles.push(scope.spawn(move || -> Result<(), ExecError> {
                crate::runtime::device::bind_thread(&cx.device)?;
                for i in list {
                    if let Some(r) = cx.abort.reason() {
                        return Err(ExecError::Aborted(r));
                    }
                    let fault = cx
                        .shared
                        .faults
                        .iter()
                        .find(|f| f.rank == cx.rank && f.instr == i && f.step.is_none_or(|s| s == step_no + 1))
                        .map(|f| f.fault);
                    let started = wall_seconds();
                    let mark = clock.as_ref().map(|c| c.mark()).transpose()?;
                    let result = match fault {
                        Some(Fault::Stall) => loop {
                            if let Some(r) = cx.abort.reason() {
                                break Err(ExecError::Aborted(r));
                            }
                            std::thread::sleep(Duration::from_millis(10));
                        },
                        Some(Fault::Fail) => Err(ExecError::Internal("injected failure".into())),
                        Some(Fault::OutOfMemory) => Err(ExecError::Candle(candle_core::Error::Cuda(Box::new(
                            InjectedOutOfMemory,
                        )))),
                        None => cx.execute(i, state),
                    };
                    *lock(&cx.times[i]) = [started, wall_seconds()];
                    if let (Some(c), Some(m)) = (&clock, mark) {
                        *lock(&cx.marks[i]) = Some((m, c.mark()?));
                    }
                    if let Err(e) = result {
                        if !matches!(e, ExecError::Aborted(_)) {
                            let what = shardplan_planner::print::describe(
                                &cx.shared.plan,
                                &cx.shared.plan.programs[0].instrs[i],
                            );
                            let advice = if e.is_out_of_memory() {
                                format!("\n{}", out_of_memory_advice(&cx.shared.plan))
                            } else {
                                String::new()
                            };
                            cx.abort.abort(format!(
                                "step {}: rank {}: instruction #{i} `{what}` failed: {e}{advice}",
                                step_no + 1,
                                cx.rank
                            ));
                        }
                        return Err(e);
                    }
                }
                if stream == Stream::Compute {
                    // The all-to-all stream's last step ends before the compute stream's.
                    if let Some(c) = lock(state).as_ref() {
                        c.ctx.flush_expert()?;
                        lock(&cx.out).routing = c.ctx.take_routing_load();
                    }
                }
                Ok(())
            }));
        }
        let mut first = Ok(());
        for h in handles {
            let r = h
                .join()
                .unwrap_or_else(|_| Err(ExecError::Internal("a stream thread panicked".into())));
            if first.is_ok() {
                first = r;
            }
        }
        first
    });
    // Collectives that were only enqueued complete here: the step's end is the one place
    // the host waits for the device (and where their failures surface).
    let result = result.and_then(|()| {
        for (comm, stream) in program.communicators() {
            cx.comms.get(comm, stream)?.flush()?;
        }
        Ok(())
    });
    if let Err(e) = result {
        return Err(match abort.reason() {
            Some(r) => ExecError::Aborted(r),
            None => e,
        });
    }
    // The updated shards.
    for (p, b) in params.iter_mut().zip(&sharded) {
        *p = cx.get(*b)?;
    }
    let norm = cx.norm.into_inner().unwrap_or_else(|e| e.into_inner());
    let device_losses = cx.device_losses.into_inner().unwrap_or_else(|e| e.into_inner());
    let memory = cx.memory.into_inner().unwrap_or_else(|e| e.into_inner());
    let mut out = cx.out.into_inner().unwrap_or_else(|e| e.into_inner());
    for (value, id) in device_losses {
        let loss = value.to_dtype(CDType::F32)?.to_scalar::<f32>()?;
        if !loss.is_finite() {
            let g = &shared.joint.graph;
            let node = g.node(id);
            return Err(ExecError::NonFinite {
                step: 0,
                loss,
                module: g.scope(node.scope).display_path().to_string(),
                node: id.to_string(),
                op: node.op.name().to_string(),
            });
        }
        out.losses.push(loss);
    }
    if let Some(sq) = norm {
        // The step's one read of the device: its gradient norm, for the log. The update
        // has been made by now; a non-finite norm still stops the run here.
        let total = sq.to_dtype(CDType::F64)?.flatten_all()?.to_vec1::<f64>()?[0].sqrt();
        if !total.is_finite() {
            return Err(ExecError::Internal(format!("the global gradient norm is {total}")));
        }
        out.grad_norm = Some(total);
    }
    out.max_by_category = memory.max;
    out.peak = memory.peak;
    out.host = memory.host_max;
    out.times = cx
        .times
        .into_iter()
        .map(|t| t.into_inner().unwrap_or_else(|e| e.into_inner()))
        .collect();
    if let Some(origin) = &cx.origin {
        // The step's work has been waited for: every event is complete.
        for (t, m) in out.times.iter_mut().zip(cx.marks) {
            if let Some((a, b)) = m.into_inner().unwrap_or_else(|e| e.into_inner()) {
                *t = [origin.seconds(&a)?, origin.seconds(&b)?];
            }
        }
        for (id, a, b) in cx.node_marks.into_inner().unwrap_or_else(|e| e.into_inner()) {
            out.node_seconds.push((id, origin.between(&a, &b)?));
        }
    }
    Ok(out)
}
