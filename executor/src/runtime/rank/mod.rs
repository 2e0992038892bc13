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
pub use tables::ProgramTables;

mod compute;
mod instrs;
mod norm;
mod streams;
mod tables;
use crate::comm::{tensor_bytes, Abort, Reduce};

use crate::clock::{Clock, Mark, Origin};
use crate::cpu::fused;
use crate::cpu::kernels::{apply, cdtype, Ctx};
use crate::runtime::optim::OptState;
use crate::ExecError;
use candle_core::{DType as CDType, Tensor};
use compute::Compute;
use norm::GradScale;
use shardplan_ir::{IdVec, JointGraph, NodeId, Op};
use shardplan_planner::{
    chunk_rows, BufId, ByCategory, Category, Comm, ExecOrder, GroupLayout, Instr, Plan, Pool, ReduceOp, Stream,
    ValueSlot,
};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
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
    /// The level of `pool`'s bytes: the host's (CPU offload) or the device's.
    fn level(&mut self, pool: Pool) -> &mut ByCategory {
        if pool == Pool::Host {
            &mut self.host
        } else {
            &mut self.device
        }
    }

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
    tables: &'a ProgramTables,
    rank: u64,
    /// The step's number in the run: the high half of its collectives' tags.
    step_no: u64,
    comms: &'a Comms,
    abort: &'a Abort,
    device: candle_core::Device,
    bufs: Vec<Mutex<Slot>>,
    events: Vec<Event>,
    /// The next alloc/free allowed to run (`ProgramTables::mem_seq`).
    mem_turn: Turn,
    /// The next collective allowed to launch (`ProgramTables::launch_seq`), when
    /// collectives launch in issue order (`ordered`).
    launch_turn: Turn,
    ordered: bool,
    memory: Mutex<Memory>,
    opt: Mutex<&'a mut Vec<OptState>>,
    batches: &'a [HashMap<String, Tensor>],
    lr: f64,
    out: Mutex<RankStepOut>,
    /// The reduced sum of squares of the gradients when it lives on a GPU, read after the
    /// step (the one host wait of a step).
    norm: Mutex<Option<Tensor>>,
    /// Each micro-batch's loss when it lives on a GPU (and its node), read after the step.
    device_losses: Mutex<Vec<(Tensor, NodeId)>>,
    timing: Timing,
    a2a: Exchange,
}

/// A turn counter: the sequence number allowed to go next.
#[derive(Default)]
struct Turn {
    next: Mutex<usize>,
    cv: Condvar,
}

/// Start and end of each instruction (written by the stream that runs it). With device
/// timing: the step's origin on the compute stream, the compute stream's clock, each
/// instruction's marks on its stream (resolved into `times` after the step) and the
/// compute nodes' marks (into `node_seconds`).
struct Timing {
    times: Vec<Mutex<[f64; 2]>>,
    origin: Option<Origin>,
    clock: Clock,
    marks: Vec<Mutex<Option<(Mark, Mark)>>>,
    node_marks: Mutex<Vec<(NodeId, Mark, Mark)>>,
}

impl Timing {
    /// Nothing measured yet for `n` instructions; device timing when `shared` asks for it
    /// and `device` is a GPU (one origin on the compute stream, every mark measured from it).
    fn new(shared: &Shared, device: &candle_core::Device, n: usize) -> Result<Self, ExecError> {
        let device_clock = Clock::of_device(device);
        let origin = if shared.device_clock && device_clock.is_device() {
            Some(Origin::new(&device_clock)?)
        } else {
            None
        };
        Ok(Timing {
            times: (0..n).map(|_| Mutex::new([0.0; 2])).collect(),
            clock: if origin.is_some() { device_clock } else { Clock::Host },
            origin,
            marks: (0..n).map(|_| Mutex::new(None)).collect(),
            node_marks: Mutex::new(Vec::new()),
        })
    }
}

/// What the all-to-all stream and the compute stream hand each other.
struct Exchange {
    /// The expert group or the context group the all-to-all stream's steps run over.
    expert: Option<std::sync::Arc<crate::cpu::expert::ExpertGroup>>,
    context: Option<std::sync::Arc<crate::cpu::context::ContextGroup>>,
    /// Operands handed to all-to-all steps, by issue index (`None`: an earlier all-to-all
    /// step's output, in `kept`).
    mailbox: Mutex<HashMap<usize, Vec<Option<Tensor>>>>,
    /// All-to-all steps' outputs that later all-to-all steps read, by value slot and
    /// micro-batch, until the last of them (`ProgramTables::a2a_last`) has run.
    kept: Mutex<HashMap<(ValueSlot, u32), Tensor>>,
    /// All-to-all steps' outputs, by step and micro-batch, until the compute step that
    /// waits for them takes them.
    outbox: Mutex<HashMap<(u32, u32), Tensor>>,
}

impl Exchange {
    /// Nothing handed over yet, on `expert` or `context`.
    fn new(
        expert: Option<std::sync::Arc<crate::cpu::expert::ExpertGroup>>,
        context: Option<std::sync::Arc<crate::cpu::context::ContextGroup>>,
    ) -> Self {
        Exchange {
            expert,
            context,
            mailbox: Mutex::new(HashMap::new()),
            kept: Mutex::new(HashMap::new()),
            outbox: Mutex::new(HashMap::new()),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The value `m` holds, poisoned or not.
fn into_inner<T>(m: Mutex<T>) -> T {
    m.into_inner().unwrap_or_else(|e| e.into_inner())
}

/// A non-finite loss at node `id` of `g`.
fn non_finite(g: &shardplan_ir::Graph, id: NodeId, loss: f32) -> ExecError {
    let node = g.node(id);
    ExecError::NonFinite {
        step: 0,
        loss,
        module: g.scope(node.scope).display_path().to_string(),
        node: id.to_string(),
        op: node.op.name().to_string(),
    }
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

    fn wait_until(&self, deadline: Instant, what: impl Fn() -> String) -> Result<(), ExecError> {
        if let Some(r) = self.abort.reason() {
            return Err(ExecError::Aborted(r));
        }
        if Instant::now() >= deadline {
            return Err(ExecError::Internal(format!(
                "{} timed out after {:.1} s",
                what(),
                self.abort.timeout().as_secs_f64()
            )));
        }
        Ok(())
    }

    /// `m` locked once `ready` holds of it (woken through `cv`), or the failure of a wait
    /// that `what` names: the world stopped, or it took longer than the timeout.
    fn wait_for<'m, T>(
        &self,
        m: &'m Mutex<T>,
        cv: &Condvar,
        ready: impl Fn(&T) -> bool,
        what: impl Fn() -> String,
    ) -> Result<MutexGuard<'m, T>, ExecError> {
        let deadline = Instant::now() + self.abort.timeout();
        let mut guard = lock(m);
        while !ready(&guard) {
            self.wait_until(deadline, &what)?;
            guard = cv
                .wait_timeout(guard, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(guard)
    }

    /// Runs `f` when every earlier-issued alloc/free of this rank has run.
    fn sequenced(&self, i: usize, f: impl FnOnce(&mut Memory)) -> Result<(), ExecError> {
        let q = self.tables.mem_seq[i];
        let t = &self.mem_turn;
        let mut turn = self.wait_for(&t.next, &t.cv, |&n| n == q, || "waiting for an earlier free".into())?;
        f(&mut lock(&self.memory));
        *turn += 1;
        t.cv.notify_all();
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
        let q = self.tables.launch_seq[i];
        if !self.ordered || q == usize::MAX {
            return f();
        }
        let t = &self.launch_turn;
        let turn = self.wait_for(
            &t.next,
            &t.cv,
            |&n| n == q,
            || "waiting for an earlier collective's launch".into(),
        )?;
        drop(turn);
        let r = f();
        *lock(&t.next) += 1;
        t.cv.notify_all();
        r
    }

    /// The tag of collective `i`: the step's number, then its place in its group's order.
    fn tag(&self, i: usize) -> u64 {
        (self.step_no << 32) | self.tables.comm_seq[i]
    }

    fn record(&self, e: usize) {
        let ev = &self.events[e];
        *lock(&ev.set) = true;
        ev.cv.notify_all();
    }

    fn wait(&self, e: usize) -> Result<(), ExecError> {
        let ev = &self.events[e];
        let _set = self.wait_for(&ev.set, &ev.cv, |&set| set, || format!("waiting on e{e}"))?;
        Ok(())
    }
}

/// Runs one step of `shared.plan` on `state`, with the micro-batches of this rank and the
/// plan's tables (built once for `shared.plan` by `ProgramTables::new`).
pub fn run_step(
    shared: &Shared,
    tables: &ProgramTables,
    state: &mut RankState,
    abort: &Abort,
    batches: &[HashMap<String, Tensor>],
    lr: f64,
    step_no: u64,
) -> Result<RankStepOut, ExecError> {
    crate::runtime::device::bind_thread(&state.ctx.device)?;
    let plan = &shared.plan;
    let n_instrs = plan.programs[0].instrs.len();
    if !tables.fits(n_instrs) {
        return Err(ExecError::Internal(
            "the program tables were built for another plan".into(),
        ));
    }
    let ordered = tables.ordered_launch(shared, &state.comms)?;
    let RankState {
        rank,
        comms,
        params,
        opt,
        ctx,
    } = state;
    let (bufs, memory) = persistent_state(plan, tables, params, opt)?;
    let cx = StepCtx {
        shared,
        tables,
        rank: *rank,
        step_no,
        comms,
        abort,
        // The device pool's device; the host pool is the CPU (`pool_device`). On the CPU
        // backend both are host memory, accounted apart all the same.
        device: ctx.device.clone(),
        bufs,
        events: (0..plan.events)
            .map(|_| Event {
                set: Mutex::new(false),
                cv: Condvar::new(),
            })
            .collect(),
        mem_turn: Turn::default(),
        launch_turn: Turn::default(),
        ordered,
        memory: Mutex::new(memory),
        opt: Mutex::new(opt),
        batches,
        lr,
        out: Mutex::new(RankStepOut::default()),
        norm: Mutex::new(None),
        device_losses: Mutex::new(Vec::new()),
        timing: Timing::new(shared, &ctx.device, n_instrs)?,
        a2a: Exchange::new(ctx.expert_group(), ctx.context_group()),
    };
    let compute = Mutex::new(Some(Compute::new(ctx, shared.exec.slots())));
    // Collectives that were only enqueued complete at the step's end.
    let result = cx.run_streams(&compute).and_then(|()| cx.flush_collectives());
    if let Err(e) = result {
        return Err(match abort.reason() {
            Some(r) => ExecError::Aborted(r),
            None => e,
        });
    }
    // The updated shards.
    for (g, p) in params.iter_mut().enumerate() {
        *p = cx.get(tables.sharded_buffer(g)?)?;
    }
    cx.finish()
}

/// The buffers of a step before it runs, every group's sharded parameters in theirs, and
/// the bytes held: the sharded parameters and the optimizer state.
fn persistent_state(
    plan: &Plan,
    tables: &ProgramTables,
    params: &[Tensor],
    opt: &[OptState],
) -> Result<(Vec<Mutex<Slot>>, Memory), ExecError> {
    let bufs: Vec<Mutex<Slot>> = (0..plan.buffers.len()).map(|_| Mutex::new(Slot::Free)).collect();
    let mut memory = Memory::default();
    for (g, p) in params.iter().enumerate() {
        let b = tables.sharded_buffer(g)?;
        *lock(&bufs[b.index()]) = Slot::Value(p.clone());
        *memory.level(plan.buffer(b).pool).slot(Category::ShardedParams) += tensor_bytes(p);
        if let Some(pool) = tables.opt_pool[g] {
            *memory.level(pool).slot(Category::OptimizerState) += opt[g].bytes();
        }
    }
    memory.observe();
    Ok((bufs, memory))
}

impl StepCtx<'_> {
    /// Waits for the collectives that were only enqueued: the step's end is the one place
    /// the host waits for the device (and where their failures surface).
    fn flush_collectives(&self) -> Result<(), ExecError> {
        for &(comm, stream) in &self.tables.communicators {
            self.comms.get(comm, stream)?.flush()?;
        }
        Ok(())
    }

    /// What the step measured, read once it has run: the losses and the gradient norm
    /// left on the device, the memory levels and the instructions' and nodes' times.
    fn finish(self) -> Result<RankStepOut, ExecError> {
        let memory = into_inner(self.memory);
        let mut out = into_inner(self.out);
        for (value, id) in into_inner(self.device_losses) {
            let loss = value.to_dtype(CDType::F32)?.to_scalar::<f32>()?;
            if !loss.is_finite() {
                return Err(non_finite(&self.shared.joint.graph, id, loss));
            }
            out.losses.push(loss);
        }
        if let Some(sq) = into_inner(self.norm) {
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
        self.timing.resolve(&mut out)?;
        Ok(out)
    }
}

impl Timing {
    /// The instructions' times into `out`, and with device timing (the step's work waited
    /// for: every event is complete) the marks resolved into times and node seconds.
    fn resolve(self, out: &mut RankStepOut) -> Result<(), ExecError> {
        out.times = self.times.into_iter().map(into_inner).collect();
        if let Some(origin) = &self.origin {
            for (t, m) in out.times.iter_mut().zip(self.marks) {
                if let Some((a, b)) = into_inner(m) {
                    *t = [origin.seconds(&a)?, origin.seconds(&b)?];
                }
            }
            for (id, a, b) in into_inner(self.node_marks) {
                out.node_seconds.push((id, origin.between(&a, &b)?));
            }
        }
        Ok(())
    }
}
