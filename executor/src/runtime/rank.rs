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
use crate::comm::{tensor_bytes, Abort, Reduce};

use crate::clock::{Clock, Mark, Origin};
use crate::cpu::fused;
use crate::cpu::kernels::{apply, cdtype, Ctx};
use crate::runtime::optim::OptState;
use crate::ExecError;
use candle_core::{DType as CDType, Tensor};
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
    /// Failures injected by tests: (rank, instruction, what).
    pub faults: Vec<(u64, usize, Fault)>,
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
}

impl Memory {
    fn observe(&mut self) {
        let mut level = self.device;
        level.activations = self.activations;
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
    fn launch<T>(&self, i: usize, f: impl FnOnce() -> Result<T, ExecError>) -> Result<T, ExecError> {
        if !self.ordered {
            return f();
        }
        let q = self.launch_seq[i];
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

/// The rows of `layout`'s parameter `i` that shard rank `s` holds, as (offset in its flat
/// shard, elements).
fn valid(layout: &GroupLayout, i: usize, s: u64) -> (usize, usize) {
    let p = &layout.params[i];
    let r = chunk_rows(p.dims.first().copied().unwrap_or(1), layout.shard, s);
    (p.shard_offset as usize, ((r.end - r.start) * p.row_elems) as usize)
}

/// The full parameters of a group from its flat all-gather output.
fn unflatten(layout: &GroupLayout, gathered: &Tensor) -> Result<Vec<Tensor>, ExecError> {
    let mut out = Vec::with_capacity(layout.params.len());
    for (i, p) in layout.params.iter().enumerate() {
        let mut pieces = Vec::new();
        for s in 0..layout.shard {
            let (off, n) = valid(layout, i, s);
            if n > 0 {
                pieces.push(gathered.narrow(0, s as usize * layout.shard_numel as usize + off, n)?);
            }
        }
        let dims: Vec<usize> = p.dims.iter().map(|&d| d as usize).collect();
        out.push(Tensor::cat(&pieces, 0)?.reshape(dims.as_slice())?);
    }
    Ok(out)
}

/// Gradients (full shapes, by position in the layout; `None` = zero) laid out as a flat
/// all-gather-shaped buffer: rank-major padded shards.
fn flatten(
    layout: &GroupLayout,
    grads: &[Option<Tensor>],
    dtype: CDType,
    device: &candle_core::Device,
) -> Result<Tensor, ExecError> {
    let mut pieces = Vec::new();
    let flat: Vec<Option<Tensor>> = grads
        .iter()
        .map(|g| g.as_ref().map(|g| g.flatten_all()).transpose())
        .collect::<Result<_, _>>()?;
    for s in 0..layout.shard {
        for (i, p) in layout.params.iter().enumerate() {
            let rows = chunk_rows(p.dims.first().copied().unwrap_or(1), layout.shard, s);
            let n = ((rows.end - rows.start) * p.row_elems) as usize;
            let pad = p.shard_numel() as usize - n;
            match &flat[i] {
                Some(g) if n > 0 => pieces.push(g.narrow(0, (rows.start * p.row_elems) as usize, n)?.to_dtype(dtype)?),
                _ if n > 0 => pieces.push(Tensor::zeros(n, dtype, device)?),
                _ => {}
            }
            if pad > 0 {
                pieces.push(Tensor::zeros(pad, dtype, device)?);
            }
        }
    }
    Ok(Tensor::cat(&pieces, 0)?)
}

/// The compute stream's own state: activations and parameter views.
struct Compute<'c> {
    ctx: &'c mut Ctx,
    values: Vec<Option<Tensor>>,
    /// Gradients a blockwise attention backward made before their own nodes run (see
    /// `ExecOrder::blockwise_attention`); counted in `live` from when they are made.
    early: HashMap<NodeId, Tensor>,
    live: u64,
    micro: Option<u32>,
    params: HashMap<BufId, Vec<Tensor>>,
}

impl StepCtx<'_> {
    /// The first gradient node `id` of a blockwise attention backward: computes all of its
    /// gradients, keeps the others in `c.early` (counted in `c.live` now) and returns `id`'s.
    fn blockwise_attention(&self, c: &mut Compute, id: NodeId, copy: bool) -> Result<Tensor, ExecError> {
        let sh = self.shared;
        let g = &sh.joint.graph;
        let b = sh
            .exec
            .blockwise_group(id)
            .ok_or_else(|| ExecError::Internal(format!("{id} is not part of a blockwise attention")))?;
        let mut ops = Vec::with_capacity(4);
        for x in b.operands {
            let slot = sh.exec.read_slot(id, copy, x);
            ops.push(
                c.values[slot]
                    .clone()
                    .ok_or_else(|| ExecError::Internal(format!("{id} reads {x} after it was freed")))?,
            );
        }
        let outs = [b.dq, b.dk, b.dv];
        let made = if sh.native && crate::gpu::attention_applies(&ops[0], &ops[1], &ops[2]) {
            // cuDNN's backward reads the forward's output and log-sum-exp; the plan keeps
            // neither, so the forward runs again here (a fifth of the backward's time on an
            // H200 at the 1.1B shape) and one plan serves every device.
            let (o, lse) = crate::gpu::attention(&ops[0], &ops[1], &ops[2], b.causal)?;
            let grads = crate::gpu::attention_backward(&ops[0], &ops[1], &ops[2], &o, &ops[3], &lse, b.causal)?;
            let mut made: [Option<Tensor>; 3] = grads.map(Some);
            for (m, o) in made.iter_mut().zip(outs) {
                if o.is_none() {
                    *m = None;
                }
            }
            made
        } else {
            crate::cpu::kernels::attention_backward_blockwise(
                &ops[0],
                &ops[1],
                &ops[2],
                &ops[3],
                b.causal,
                outs.map(|o| o.is_some()),
            )?
        };
        let mut own = None;
        for (node, t) in outs.into_iter().zip(made) {
            let (Some(node), Some(t)) = (node, t) else { continue };
            if node == id {
                own = Some(t);
            } else {
                c.live += sh.exec.value_bytes(g, node);
                c.early.insert(node, t);
            }
        }
        own.ok_or_else(|| ExecError::Internal(format!("{id} is not an output of its blockwise attention")))
    }

    /// Whether node `id` runs in place over its first input
    /// (`ExecOrder::in_place_cross_entropy`): where the fused CPU kernel takes it; other
    /// devices and dtypes make the gradient beside the logits.
    fn overwritable(&self, c: &Compute, id: NodeId, copy: bool) -> bool {
        let sh = self.shared;
        let Some(x) = sh.exec.in_place(id) else { return false };
        let node = sh.joint.graph.node(id);
        let slot = sh.exec.read_slot(id, copy, x);
        matches!(node.op, Op::CrossEntropyGrad)
            && node.inputs.len() == 3
            && node.inputs[0] == x
            && c.values[slot]
                .as_ref()
                .is_some_and(|t| fused::applies(&[t]) && t.is_contiguous())
    }

    fn compute(
        &self,
        c: &mut Compute,
        step: usize,
        micro: u32,
        reads: &[BufId],
        writes: &[BufId],
    ) -> Result<(), ExecError> {
        let sh = self.shared;
        let plan = &sh.plan;
        let g = &sh.joint.graph;
        let s = plan
            .steps
            .get(step)
            .ok_or_else(|| ExecError::Internal(format!("no step s{step}")))?;
        if c.micro != Some(micro) {
            c.values.iter_mut().for_each(|v| *v = None);
            c.early.clear();
            c.live = 0;
            c.micro = Some(micro);
        }
        // Parameter views of the groups this step reads.
        let mut param_of: HashMap<u32, Tensor> = HashMap::new();
        for (k, &b) in reads.iter().enumerate() {
            let group = s.reads[k];
            let views = match c.params.entry(b) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(unflatten(&plan.groups[group.index()].layout, &self.get(b)?)?)
                }
            };
            for (i, p) in plan.groups[group.index()].group.params.iter().enumerate() {
                param_of.insert(p.0, views[i].clone());
            }
        }
        let batch = &self.batches[micro as usize];
        let mut grads: HashMap<u32, Tensor> = HashMap::new();
        let copy = s.phase == shardplan_planner::Phase::Recompute;
        let mut pos = sh.step_start[step];
        let mut node_seconds = Vec::new();
        let mut node_marks = Vec::new();
        let on_device = self.origin.is_some();
        for r in &s.nodes {
            for i in r.clone() {
                let started = (sh.profile && !on_device).then(Instant::now);
                let mark = if sh.profile && on_device {
                    Some(self.clock.mark()?)
                } else {
                    None
                };
                let id = NodeId(i);
                let node = g.node(id);
                // Bytes already in `live` for this value (made early by a blockwise attention).
                let mut counted = false;
                let value = match &node.op {
                    Op::Input { name } => batch
                        .get(name)
                        .cloned()
                        .ok_or_else(|| ExecError::Internal(format!("no data for input `{name}`")))?,
                    _ if sh.exec.placeholder(id) => Tensor::zeros(0, cdtype(node.ty.dtype), &c.ctx.device)?,
                    _ if self.overwritable(c, id, copy) => {
                        // The cross-entropy's gradient over its logits, which die here.
                        let x = node.inputs[0];
                        let slot = sh.exec.read_slot(id, copy, x);
                        let logits = c.values[slot]
                            .take()
                            .ok_or_else(|| ExecError::Internal(format!("{id} reads {x} after it was freed")))?;
                        c.live -= sh.exec.value_bytes(g, x);
                        let mut rest = Vec::with_capacity(2);
                        for &input in &node.inputs[1..] {
                            let slot = sh.exec.read_slot(id, copy, input);
                            rest.push(c.values[slot].clone().ok_or_else(|| {
                                ExecError::Internal(format!("{id} reads {input} after it was freed"))
                            })?);
                        }
                        fused::cross_entropy_grad_in_place(&logits, &rest[0], &rest[1])?;
                        logits
                    }
                    _ if sh.exec.blockwise_group(id).is_some() => {
                        if let Some(t) = c.early.remove(&id) {
                            counted = true;
                            t
                        } else {
                            self.blockwise_attention(c, id, copy)?
                        }
                    }
                    _ => {
                        let mut ins = Vec::with_capacity(node.inputs.len());
                        for &input in &node.inputs {
                            let t = match sh.exec.param_of_node[input.index()] {
                                Some(p) => param_of.get(&p).cloned().ok_or_else(|| {
                                    ExecError::Internal(format!(
                                        "{id} reads parameter p{p}, not gathered for this step"
                                    ))
                                })?,
                                None => {
                                    let slot = sh.exec.read_slot(id, copy, input);
                                    c.values[slot].clone().ok_or_else(|| {
                                        ExecError::Internal(format!("{id} reads {input} after it was freed"))
                                    })?
                                }
                            };
                            ins.push(t);
                        }
                        let refs: Vec<&Tensor> = ins.iter().collect();
                        apply(c.ctx, &node.op, &refs, &node.ty)?
                    }
                };
                if !copy && id == sh.joint.loss && !value.device().is_cpu() {
                    // Read after the step, not here: reading a GPU value waits for the device.
                    lock(&self.device_losses).push((value.clone(), id));
                } else if !copy && id == sh.joint.loss {
                    let loss = value.to_dtype(CDType::F32)?.to_scalar::<f32>()?;
                    if !loss.is_finite() {
                        return Err(ExecError::NonFinite {
                            step: 0,
                            loss,
                            module: g.scope(node.scope).display_path().to_string(),
                            node: id.to_string(),
                            op: node.op.name().to_string(),
                        });
                    }
                    lock(&self.out).losses.push(loss);
                }
                if !copy && sh.exec.is_param_grad[id.index()] {
                    if let Some(p) = sh.joint.param_grads.iter().position(|x| *x == Some(id)) {
                        grads.insert(p as u32, value.clone());
                    }
                }
                if !counted {
                    c.live += sh.exec.value_bytes(g, id);
                }
                c.values[ExecOrder::slot(id, copy)] = Some(value);
                {
                    let mut m = lock(&self.memory);
                    m.activations = c.live;
                    m.observe();
                }
                for &input in node.inputs.iter().chain(sh.exec.extra_reads(g, id)) {
                    if sh.exec.param_of_node[input.index()].is_some() {
                        continue;
                    }
                    let slot = sh.exec.read_slot(id, copy, input);
                    if sh.exec.last_use[slot] == pos && c.values[slot].take().is_some() {
                        c.live -= sh.exec.value_bytes(g, input);
                    }
                }
                let own = ExecOrder::slot(id, copy);
                if sh.exec.last_use[own] == usize::MAX && c.values[own].take().is_some() {
                    c.live -= sh.exec.value_bytes(g, id);
                }
                pos += 1;
                if let Some(t) = started {
                    node_seconds.push((id, t.elapsed().as_secs_f64()));
                }
                if let Some(m) = mark {
                    node_marks.push((id, m, self.clock.mark()?));
                }
            }
        }
        if sh.profile {
            lock(&self.out).node_seconds.extend(node_seconds);
            lock(&self.node_marks).extend(node_marks);
        }
        lock(&self.memory).activations = c.live;
        // The gradients into their pieces: each piece's parameters, whole, one after another.
        for &b in writes {
            let buf = plan.buffer(b);
            let dtype = cdtype(buf.dtype);
            let mut parts = Vec::with_capacity(buf.params.len());
            for p in &buf.params {
                let t = grads.remove(&p.0).ok_or_else(|| {
                    ExecError::Internal(format!(
                        "step s{step} made no gradient for {p}, which {} holds",
                        buf.name
                    ))
                })?;
                parts.push(t.flatten_all()?.to_dtype(dtype)?);
            }
            let update = Tensor::cat(&parts, 0)?;
            if update.elem_count() as u64 != buf.numel {
                return Err(ExecError::Internal(format!(
                    "{} holds {} elements, its gradients {}",
                    buf.name,
                    buf.numel,
                    update.elem_count()
                )));
            }
            self.accumulate(b, update)?;
        }
        Ok(())
    }

    fn execute(&self, i: usize, c: &mut Option<Compute>) -> Result<(), ExecError> {
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
                if let Some(c) = c.as_mut() {
                    c.params.remove(buf);
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
            Instr::Record { event } => self.record(event.index()),
            Instr::Wait { event } => self.wait(event.index())?,
            Instr::Compute {
                step,
                micro,
                reads,
                writes,
            } => {
                let c = c
                    .as_mut()
                    .ok_or_else(|| ExecError::Internal("compute outside the compute stream".into()))?;
                self.compute(c, step.index(), *micro, reads, writes)?;
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
                self.accumulate(*dst, part)?;
            }
            Instr::AllReduce { comm, op, buf, .. } => {
                let t = self.get(*buf)?;
                let c = self.comms.get(*comm, issued.stream)?;
                let r = self.launch(i, || c.all_reduce(self.tags[i], &t, reduce(*op)))?;
                self.set(*buf, r)?;
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

/// The factor an optimizer step multiplies its gradients by: averaging over micro-batches
/// times the clipping factor. On the CPU it is a number; on a GPU it stays a one-element
/// device tensor, so the host never waits for the norm inside a step.
enum GradScale {
    Host(f64),
    Device(Tensor),
}

impl StepCtx<'_> {
    /// The sum of squares of `grads`, times `scale` squared, as a one-element f64 tensor on
    /// the buffers' device. On the host it is summed in f64 as it goes (the fused kernel
    /// for f32); on a GPU every tensor is reduced there and nothing is read back.
    fn sum_squares(&self, grads: &[BufId], scale: f64) -> Result<Tensor, ExecError> {
        if self.shared.native {
            let mut parts = Vec::new();
            for g in grads {
                let t = self.get(*g)?;
                parts.extend(self.norm_parts(*g, &t)?);
            }
            if !parts.is_empty()
                && parts
                    .iter()
                    .all(|(t, _)| t.device().is_cuda() && t.dtype() == CDType::F32)
            {
                // One launch over every shard of the rank (per 48 tensors), nothing read back.
                return crate::gpu::sum_squares(&parts, scale);
            }
        }
        let mut host = 0f64;
        let mut device: Option<Tensor> = None;
        for g in grads {
            let t = self.get(*g)?;
            for (part, weight) in self.norm_parts(*g, &t)? {
                if part.device().is_cpu() {
                    let sq = if fused::applies(&[&part]) {
                        fused::sum_squares(&part)?
                    } else {
                        part.sqr()?.sum_all()?.to_dtype(CDType::F64)?.to_scalar::<f64>()?
                    };
                    host += sq * weight;
                } else {
                    let sq = (part.sqr()?.sum_all()?.to_dtype(CDType::F64)?.reshape(1)? * weight)?;
                    device = Some(match device {
                        Some(acc) => (acc + sq)?,
                        None => sq,
                    });
                }
            }
        }
        Ok(match device {
            // `(sq * scale) * scale`, as the host computes it.
            Some(d) => ((d + host)?.affine(scale, 0.0)?).affine(scale, 0.0)?,
            None => Tensor::new(&[host * scale * scale], &candle_core::Device::Cpu)?.to_device(&self.device)?,
        })
    }

    /// The pieces of gradient shard `buf` and the weight of each one's sum of squares in
    /// this rank's share of the norm: the whole buffer at 1 without tensor parallelism;
    /// with it, each parameter's rows, a parameter every tensor rank holds whole at
    /// `1 / tensor` (the plan sums the shares over the tensor group).
    fn norm_parts(&self, buf: BufId, t: &Tensor) -> Result<Vec<(Tensor, f64)>, ExecError> {
        let plan = &self.shared.plan;
        let degree = plan.mesh.tensor();
        let group = plan.buffer(buf).group;
        let (true, Some(group)) = (degree > 1, group) else {
            return Ok(vec![(t.clone(), 1.0)]);
        };
        let g = &self.shared.joint.graph;
        let layout = &plan.groups[group.index()].layout;
        let mut parts = Vec::with_capacity(layout.params.len());
        for pl in &layout.params {
            let len = (pl.chunk_rows * pl.row_elems) as usize;
            let weight = if g.param(pl.param).tensor.is_some() {
                1.0
            } else {
                1.0 / degree as f64
            };
            parts.push((t.narrow(0, pl.shard_offset as usize, len)?, weight));
        }
        Ok(parts)
    }

    /// The gradient factor from the reduced sum of squares `sq`: `accum` times the clipping
    /// factor `clip / (norm + 1e-6)` when the norm exceeds the clip. A host tensor is read
    /// here (and a non-finite norm refused before any update); a device tensor is kept
    /// there and read once, after the step (`run_step`).
    fn clip_scale(&self, sq: &Tensor, accum: f64) -> Result<GradScale, ExecError> {
        if !sq.device().is_cpu() {
            *lock(&self.norm) = Some(sq.clone());
            let total = sq.to_dtype(CDType::F64)?.flatten_all()?.sqrt()?;
            let Some(clip) = self.shared.clip else {
                return Ok(GradScale::Device(Tensor::full(accum, 1, sq.device())?));
            };
            let clip_t = Tensor::full(clip, 1, sq.device())?;
            let factor = (&clip_t / (&total + 1e-6)?)?;
            let factor = total
                .gt(&clip_t)?
                .where_cond(&factor, &Tensor::ones(1, CDType::F64, sq.device())?)?;
            // `accum * factor`, in the host's order.
            return Ok(GradScale::Device(factor.affine(accum, 0.0)?));
        }
        let sq = sq.to_dtype(CDType::F64)?.flatten_all()?.to_vec1::<f64>()?[0];
        let total = sq.sqrt();
        lock(&self.out).grad_norm = Some(total);
        if !total.is_finite() {
            return Err(ExecError::Internal(format!("the global gradient norm is {total}")));
        }
        let mut scale = accum;
        if let Some(clip) = self.shared.clip {
            if total > clip {
                scale *= clip / (total + 1e-6);
            }
        }
        Ok(GradScale::Host(scale))
    }
}

fn reduce(op: ReduceOp) -> Reduce {
    match op {
        ReduceOp::Sum => Reduce::Sum,
        ReduceOp::Avg => Reduce::Avg,
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
        norm: Mutex::new(None),
        device_losses: Mutex::new(Vec::new()),
    };
    let n_values = shared.joint.graph.node_count() * 2;
    let result: Result<(), ExecError> = std::thread::scope(|scope| {
        let mut handles = Vec::new();
        let mut compute_ctx = Some(ctx);
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
            let mine = if stream == Stream::Compute {
                compute_ctx.take()
            } else {
                None
            };
            // The CUDA stream this plan stream's work is issued to: the compute stream's,
            // or that of the communicators its collectives run on (one per plan stream).
            let clock = match (&cx.origin, stream) {
                (None, _) => None,
                (Some(_), Stream::Compute) => Some(cx.clock.clone()),
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
                let mut compute = mine.map(|ctx| Compute {
                    ctx,
                    values: vec![None; n_values],
                    early: HashMap::new(),
                    live: 0,
                    micro: None,
                    params: HashMap::new(),
                });
                for i in list {
                    if let Some(r) = cx.abort.reason() {
                        return Err(ExecError::Aborted(r));
                    }
                    let fault = cx
                        .shared
                        .faults
                        .iter()
                        .find(|f| f.0 == cx.rank && f.1 == i)
                        .map(|f| f.2);
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
                        None => cx.execute(i, &mut compute),
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
                            cx.abort
                                .abort(format!("rank {}: instruction #{i} `{what}` failed: {e}", cx.rank));
                        }
                        return Err(e);
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
