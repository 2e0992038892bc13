//! Compute steps: the joint graph cut into per-group segments, in execution order, with
//! activation checkpointing's recompute segments inserted, and the activation memory of
//! each from liveness.
//!
//! The execution order is the joint graph's node order (forward, then backward), except that
//! a checkpointed block's forward nodes run again just before its first backward node. A
//! segment is a maximal run of that order whose nodes belong to one group and one phase.
//!
//! Activation memory is exact for an executor that holds every value from the node that
//! makes it to its last reader: parameters are not activations (they live in the groups'
//! unsharded buffers), nor are final parameter gradients (they live in the unsharded
//! gradient buffers). A backward node of a checkpointed block reads the recomputed copy of
//! that block's forward values, so the originals die at their last forward use. Attention's
//! backward holds no `[b, h, s, t]` value: flash attention under PyTorch, a blockwise
//! kernel in shardplan's executor ([`ExecOrder::blockwise_attention`]).

use crate::group::{scope_groups, FsdpGroup, GroupId};
use crate::stream::Stream;
use serde::{Deserialize, Serialize};
use shardplan_frontends::{ActivationCheckpointing, SavedMatmuls};
use shardplan_ir::{IdVec, JointGraph, ModuleKind, NodeId, Op, ParamId, ScopeId};
use std::ops::Range;

shardplan_ir::entity! {
    /// A compute segment (printed `s4`).
    pub struct StepId("s");
}

/// Which pass a segment belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Forward,
    /// Activation checkpointing: a block's forward run again inside the backward pass.
    Recompute,
    Backward,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Recompute => "recompute",
            Phase::Backward => "backward",
        }
    }
}

/// One segment of the joint graph run as a single compute instruction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Step {
    pub id: StepId,
    pub phase: Phase,
    /// The group its nodes belong to.
    pub group: GroupId,
    /// The modules it runs, as the user's model names them.
    pub label: String,
    /// Joint-graph node ids, as runs of consecutive ids, in execution order.
    pub nodes: Vec<Range<u32>>,
    /// Groups whose unsharded parameters it reads.
    pub reads: Vec<GroupId>,
    /// Groups whose parameter gradients it produces.
    pub grads: Vec<GroupId>,
    /// The parameters whose final gradients it makes, in id order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grad_params: Vec<ParamId>,
    /// Most activation bytes held while it runs.
    pub act_peak: u64,
    /// Activation bytes held when it ends.
    pub act_end: u64,
    /// The tensor-parallel collectives among its ops, in order (empty without tensor
    /// parallelism).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tensor_ops: Vec<TensorOp>,
    /// The plan stream that runs it: the compute stream, or, for one expert-group
    /// collective (shardplan's runtime), the all-to-all stream.
    #[serde(default = "compute_stream", skip_serializing_if = "on_compute")]
    pub stream: Stream,
    /// The all-to-all steps whose values it is the first compute step to touch (it reads
    /// their output, or is the last reader of one of their operands): the compute stream
    /// waits for them just before it, and runs the steps between concurrently with them.
    /// The operands an all-to-all step is the last reader of die here, not there.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waits_for: Vec<StepId>,
}

/// An all-to-all step the compute stream has not waited for yet (see `Step::waits_for`).
struct Pending {
    step: StepId,
    /// Its value's slot and its operands' slots.
    out: usize,
    operands: smallvec::SmallVec<[usize; 2]>,
    /// Operands it is the last reader of: (slot, value number, bytes), freed at the join.
    dying: Vec<(usize, u32, u64)>,
}

fn compute_stream() -> Stream {
    Stream::Compute
}

fn on_compute(s: &Stream) -> bool {
    *s == Stream::Compute
}

/// A tensor-parallel collective inside a compute step: it runs on the compute stream,
/// between the ops that make its input and read its output.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorOp {
    pub node: NodeId,
    /// The op's name (`tp_all_gather`, `tp_reduce_scatter`, `tp_all_reduce`,
    /// `vocab_cross_entropy` ...).
    pub op: String,
    /// Bytes of the full buffer the collective moves (the gathered output, the reduced
    /// input; a vocabulary-parallel loss's row statistics).
    pub bytes: u64,
    /// Its start within the step and its duration, seconds, by the cost model.
    pub at_s: f64,
    pub dur_s: f64,
}

/// Segments `joint` for `groups` and the checkpointing policy.
pub fn steps(joint: &JointGraph, groups: &[FsdpGroup], ac: ActivationCheckpointing) -> Vec<Step> {
    steps_and_events(joint, groups, ac, false).0
}

/// What a step does to activation memory, in order: each value it makes and each value it
/// frees (after the last reader, as the executor frees them), for the allocator model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ActEvents {
    /// Every step's events, step after step.
    pub events: Vec<ActEvent>,
    /// `events[starts[s] .. starts[s + 1]]` are step `s`'s.
    pub starts: Vec<u32>,
    /// Values the events name (`ActEvent::value` is below this).
    pub values: u32,
}

impl ActEvents {
    /// Records `e`, when `on` (a walk for the peak alone records none).
    fn push(&mut self, on: bool, e: ActEvent) {
        if on {
            self.events.push(e);
        }
    }

    /// The events of step `s` (none for a step out of range).
    pub fn of(&self, s: StepId) -> &[ActEvent] {
        let (a, b) = (self.starts.get(s.index()), self.starts.get(s.index() + 1));
        match (a, b) {
            (Some(&a), Some(&b)) => self.events.get(a as usize..b as usize).unwrap_or(&[]),
            _ => &[],
        }
    }
}

/// A value made (`bytes > 0`) or freed (`bytes == 0`). Values are numbered densely in the
/// order they are first made, so a replay's table of live values stays small and local.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActEvent {
    pub value: u32,
    pub bytes: u64,
}

/// [`steps`], and the activation events of each step. Attention's backward holds no
/// `[b, h, s, t]` probabilities either way (flash attention under PyTorch, see
/// [`ExecOrder::flash_attention`]; shardplan's blockwise kernel otherwise, see
/// [`ExecOrder::blockwise_attention`]). With `flash_attention` (PyTorch eager's memory:
/// `kernels: eager`) the cross-entropy's backward holds one more tensor the size of the
/// logits while it runs (eager's `log_softmax` + `nll_loss`).
pub fn steps_and_events(
    joint: &JointGraph,
    groups: &[FsdpGroup],
    ac: ActivationCheckpointing,
    flash_attention: bool,
) -> (Vec<Step>, ActEvents) {
    let kernels = if flash_attention {
        Kernels::Eager
    } else {
        Kernels::Fused
    };
    steps_and_events_for(joint, groups, ac, kernels)
}

/// Frees `bytes` of activation value `value` (`u32::MAX`: never numbered) from `live`,
/// recording the free among `acts`' events.
fn release(live: &mut u64, acts: &mut ActEvents, detail: bool, value: u32, bytes: u64) {
    *live = live.saturating_sub(bytes);
    if bytes > 0 && value != u32::MAX {
        acts.push(detail, ActEvent { value, bytes: 0 });
    }
}

/// What a rank's compute holds beside the graph's own values, by what runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// shardplan's executor (`kernels: fused`): every graph value as a tensor, except the
    /// attention backward's `[b, h, s, t]` placeholders (its blockwise kernel, see
    /// [`ExecOrder::blockwise_attention`]) and a cross-entropy gradient written over its
    /// logits ([`ExecOrder::in_place_cross_entropy`]), nothing more.
    Fused,
    /// PyTorch eager (`kernels: eager`): flash attention, eager cross-entropy, and what
    /// autograd saves beyond the graph's values (see [`Kernels::saved_bytes`]): the model
    /// written as PyTorch ops, as the exported program and FSDP2 run it.
    Eager,
    /// PyTorch eager under autograd, as FSDP2 runs a plan (`runtime: fsdp2`): `Eager`, plus
    /// what the training loop holds that the graph does not name: token ids are int64
    /// tensors, and the loss the loop keeps lives through backward.
    Autograd,
}

impl Kernels {
    /// The kernels a parallel spec's run uses.
    pub fn of(config: &shardplan_frontends::ParallelConfig) -> Self {
        match (config.runtime, config.hardware.kernels) {
            (shardplan_frontends::Runtime::Fsdp2, _) => Kernels::Autograd,
            (_, shardplan_frontends::KernelMode::Eager) => Kernels::Eager,
            (_, shardplan_frontends::KernelMode::Fused) => Kernels::Fused,
        }
    }

    /// Bytes PyTorch's autograd saves for forward node `id` beyond the graph's values, as
    /// the exported program writes the op (`kernels: eager` and `runtime: fsdp2`; 0 for
    /// shardplan's own kernels and for ops that save only graph values). Saved until the
    /// backward of the op that saved them; an op of a recomputed (checkpointed) block
    /// saves them only in its recompute.
    pub fn saved_bytes(self, g: &shardplan_ir::Graph, id: NodeId) -> u64 {
        if self == Kernels::Fused {
            return 0;
        }
        let node = g.node(id);
        let shape = &node.ty.shape;
        let numel = shape.numel().unwrap_or(0);
        let last = shape.dims().last().copied().unwrap_or(1).max(1);
        let rows = numel / last;
        match node.op {
            // `x * rsqrt(mean(x^2) + eps)` in f32, then `* weight`: the `rsqrt` (f32, one per
            // row) and the normalised rows (4 bytes per element; in bf16 the f32 copy of the
            // input and the normalised rows in bf16 instead of the input, 4 bytes either way).
            Op::RmsNorm { .. } => rows.saturating_add(numel).saturating_mul(4),
            // `F.layer_norm` (`native_layer_norm`): its mean and reciprocal standard deviation,
            // one f32 each per row.
            Op::LayerNorm { .. } => rows.saturating_mul(8),
            // `scaled_dot_product_attention`'s logsumexp: one f32 per (batch, query position,
            // head).
            Op::Attention { .. } => rows.saturating_mul(4),
            _ => 0,
        }
    }
}

/// Whether the last entry of a step's comma-separated label is `label` (the common case,
/// checked before the whole list).
fn last_label_is(labels: &str, label: &str) -> bool {
    labels
        .strip_suffix(label)
        .is_some_and(|head| head.is_empty() || head.ends_with(", "))
}

/// [`steps_and_events`] for the compute `kernels` runs.
pub fn steps_and_events_for(
    joint: &JointGraph,
    groups: &[FsdpGroup],
    ac: ActivationCheckpointing,
    kernels: Kernels,
) -> (Vec<Step>, ActEvents) {
    steps_and_events_in(joint, groups, &ExecOrder::for_kernels(joint, ac, kernels), kernels)
}

/// [`steps_and_events_for`] in an execution order already made by
/// [`ExecOrder::for_kernels`] for the same graph, checkpointing and `kernels` (it does not
/// depend on the groups, so a search makes one per policy).
pub fn steps_and_events_in(
    joint: &JointGraph,
    groups: &[FsdpGroup],
    exec: &ExecOrder,
    kernels: Kernels,
) -> (Vec<Step>, ActEvents) {
    walk(joint, groups, exec, kernels, true)
}

/// The most activation bytes of any step [`steps_and_events_in`] makes: the same walk,
/// without the steps' labels, reads and activation events. It is the same for every
/// grouping (the running level follows the execution order; groups only cut it into
/// steps).
pub fn activation_peak_in(joint: &JointGraph, groups: &[FsdpGroup], exec: &ExecOrder, kernels: Kernels) -> u64 {
    let (steps, _) = walk(joint, groups, exec, kernels, false);
    steps.iter().map(|s| s.act_peak).max().unwrap_or(0)
}

/// [`steps_and_events_in`]; with `detail` false, its steps without labels, reads, gradients
/// or nodes, and no activation events.
fn walk(
    joint: &JointGraph,
    groups: &[FsdpGroup],
    exec: &ExecOrder,
    kernels: Kernels,
    detail: bool,
) -> (Vec<Step>, ActEvents) {
    // PyTorch eager's cross-entropy (see below).
    let eager_cross_entropy = kernels != Kernels::Fused;
    let g = &joint.graph;
    let n = g.node_count();
    let group_of_scope = scope_groups(g, groups);

    let mut group_of_param: IdVec<ParamId, GroupId> = IdVec::from_elem(GroupId::new(0), g.params().len());
    for grp in groups {
        for &p in &grp.params {
            group_of_param[p] = grp.id;
        }
    }
    let mut grad_group: IdVec<NodeId, Option<GroupId>> = IdVec::from_elem(None, n);
    let mut grad_param: IdVec<NodeId, Option<ParamId>> = IdVec::from_elem(None, n);
    for (p, _) in g.params() {
        if let Some(grad) = joint.grad(p) {
            grad_group[grad] = Some(group_of_param[p]);
            grad_param[grad] = Some(p);
        }
    }
    let order = &exec.order;
    // Autograd's saved tensors beyond the graph's values: freed after the last backward
    // node of the forward node that saved them.
    let mut last_grad_pos: IdVec<NodeId, usize> = IdVec::new();
    if kernels != Kernels::Fused {
        last_grad_pos = IdVec::from_elem(usize::MAX, joint.forward_len);
        for (pos, &(id, copy)) in order.iter().enumerate() {
            if copy || id.index() < joint.forward_len {
                continue;
            }
            if let Some(f) = g.node(id).grad_of {
                if let Some(slot) = last_grad_pos.get_mut(f) {
                    *slot = pos;
                }
            }
        }
    }
    // (free position, value, bytes) of the saved tensors held now.
    let mut saved_live: Vec<(usize, u32, u64)> = Vec::new();
    // The least free position in `saved_live`.
    let mut next_due = usize::MAX;
    let param_of_node = &exec.param_of_node;
    let bytes = |id: NodeId| {
        let b = exec.value_bytes(g, id);
        let node = g.node(id);
        // PyTorch holds token ids as int64, twice shardplan's u32.
        if kernels == Kernels::Autograd
            && matches!(node.op, Op::Input { .. })
            && node.ty.dtype == shardplan_ir::DType::U32
        {
            b.saturating_mul(2)
        } else {
            b
        }
    };

    let label_of = |grp: GroupId, id: NodeId| -> &str {
        let group = &groups[grp.index()];
        if group.is_root() {
            g.scope(g.top_level(g.node(id).scope)).display_path()
        } else {
            &group.module
        }
    };

    let mut out: Vec<Step> = Vec::new();
    let mut acts = ActEvents {
        events: Vec::with_capacity(order.len() * 2),
        starts: Vec::new(),
        values: 0,
    };
    // `ExecOrder::slot` -> dense value number.
    let mut value_of: Vec<u32> = vec![u32::MAX; n * 2];
    let mut live: u64 = 0;
    let mut freed: Vec<usize> = Vec::new();
    let mut pending: Vec<Pending> = Vec::new();
    for (pos, &(id, copy)) in order.iter().enumerate() {
        let node = g.node(id);
        let phase = if copy {
            Phase::Recompute
        } else if id.index() >= joint.forward_len {
            Phase::Backward
        } else {
            Phase::Forward
        };
        let grp = group_of_scope[node.scope];
        // A step also ends just before it first makes a gradient of a group when the work
        // before has held more than it holds now: the gradient piece is then allocated
        // after that peak, not beside it (the loss backward: the logits and their gradient
        // both live until the cross-entropy's backward ends, before the output projection
        // makes its weight's gradient). Under autograd (`runtime: fsdp2`) every parameter's
        // gradient is its own tensor, made by the op that computes it while the step's
        // activations die around it, so the step ends before each one on those terms.
        let first_grad = match (copy, grad_group[id], out.last()) {
            (false, Some(gg), Some(s)) => (kernels == Kernels::Autograd || !s.grads.contains(&gg)) && s.act_peak > live,
            _ => false,
        };
        // Under shardplan's runtime each expert-group collective is a step of its own, run
        // on the all-to-all stream (`runtime: fsdp2` runs them inline, as torchtitan does).
        let stream = if kernels != Kernels::Autograd && g.expert_overlap() && node.op.is_expert_collective() {
            Stream::AllToAll
        } else {
            Stream::Compute
        };
        // The pending all-to-alls this node is the first to touch: a compute step starts
        // here, after the compute stream waits for them.
        let mut joined: Vec<Pending> = Vec::new();
        if stream == Stream::Compute && !pending.is_empty() {
            let touches = |p: &Pending| {
                node.inputs
                    .iter()
                    .chain(exec.extra_reads(g, id))
                    .filter(|x| param_of_node[x.index()].is_none())
                    .map(|&x| exec.read_slot(id, copy, x))
                    .any(|s| s == p.out || (p.operands.contains(&s) && exec.last_use[s] == pos))
            };
            let mut k = 0;
            while k < pending.len() {
                if touches(&pending[k]) {
                    joined.push(pending.remove(k));
                } else {
                    k += 1;
                }
            }
        }
        let start_new = match out.last() {
            Some(s) => {
                s.phase != phase
                    || s.group != grp
                    || first_grad
                    || stream == Stream::AllToAll
                    || s.stream != stream
                    || !joined.is_empty()
            }
            None => true,
        };
        if start_new {
            acts.starts.push(acts.events.len() as u32);
            out.push(Step {
                id: StepId::new(out.len()),
                phase,
                group: grp,
                label: String::new(),
                nodes: Vec::new(),
                reads: Vec::new(),
                grads: Vec::new(),
                grad_params: Vec::new(),
                act_peak: live,
                act_end: live,
                tensor_ops: Vec::new(),
                stream,
                waits_for: Vec::new(),
            });
        }
        if !joined.is_empty() {
            // The joined all-to-alls' dying operands go first, as the executor frees them
            // once the compute stream has waited.
            for p in &joined {
                for &(_, value, b) in &p.dying {
                    release(&mut live, &mut acts, detail, value, b);
                }
            }
            let step = out.last_mut().expect("a step was just pushed");
            step.waits_for = joined.iter().map(|p| p.step).collect();
            step.act_peak = live;
            step.act_end = live;
        }
        let step = out.last_mut().expect("a step was just pushed");
        if detail && !node.op.is_leaf() {
            let label = label_of(grp, id);
            if step.label.is_empty() {
                step.label.push_str(label);
            } else if !last_label_is(&step.label, label) && !step.label.split(", ").any(|l| l == label) {
                step.label.push_str(", ");
                step.label.push_str(label);
            }
        }
        match step.nodes.last_mut() {
            Some(r) if r.end == id.0 => r.end += 1,
            _ if !detail => {}
            _ => step.nodes.push(id.0..id.0 + 1),
        }
        for &input in node.inputs.iter().filter(|_| detail) {
            if let Some(p) = param_of_node[input.index()] {
                let pg = group_of_param[ParamId(p)];
                if !step.reads.contains(&pg) {
                    step.reads.push(pg);
                }
            }
        }
        if let Some(gg) = grad_group[id] {
            if !step.grads.contains(&gg) {
                step.grads.push(gg);
            }
        }
        if let (false, Some(p)) = (copy, grad_param[id]) {
            step.grad_params.push(p);
        }
        let own = ExecOrder::slot(id, copy);
        // An in-place op's input is gone before its value is made.
        let mut overwritten = None;
        if let Some(x) = exec.in_place(id) {
            let s = exec.read_slot(id, copy, x);
            release(&mut live, &mut acts, detail, value_of[s], bytes(x));
            overwritten = Some(s);
        }
        let made = bytes(id);
        live = live.saturating_add(made);
        step.act_peak = step.act_peak.max(live);
        if made > 0 {
            if value_of[own] == u32::MAX {
                value_of[own] = acts.values;
                acts.values += 1;
            }
            acts.push(
                detail,
                ActEvent {
                    value: value_of[own],
                    bytes: made,
                },
            );
        }
        if eager_cross_entropy && matches!(node.op, Op::CrossEntropyGrad | Op::VocabCrossEntropyGrad { .. }) {
            // PyTorch eager's cross-entropy is `log_softmax` then `nll_loss`: its backward
            // makes the log-probabilities' gradient (as large as the logits) before the
            // logits' gradient, beside it.
            let extra = g.node(node.inputs[0]).ty.bytes().unwrap_or(u64::MAX);
            step.act_peak = step.act_peak.max(live.saturating_add(extra));
            acts.push(
                detail,
                ActEvent {
                    value: acts.values,
                    bytes: extra,
                },
            );
            acts.push(
                detail,
                ActEvent {
                    value: acts.values,
                    bytes: 0,
                },
            );
            acts.values += 1;
        }
        let extra = if id.index() >= joint.forward_len {
            0
        } else if kernels == Kernels::Autograd && id == joint.loss && !copy {
            // The loss a training loop keeps (`loss = model(...)`) lives through backward.
            g.node(id).ty.bytes().unwrap_or(0)
        } else {
            kernels.saved_bytes(g, id)
        };
        if extra > 0 {
            // Made with the op; kept until its backward unless the block recomputes it.
            live = live.saturating_add(extra);
            step.act_peak = step.act_peak.max(live);
            let value = acts.values;
            acts.values += 1;
            acts.push(detail, ActEvent { value, bytes: extra });
            let kept = copy || !exec.recomputed(id);
            let until = if id == joint.loss {
                order.len() - 1
            } else {
                last_grad_pos.get(id).copied().unwrap_or(usize::MAX)
            };
            if kept && until != usize::MAX && until > pos {
                saved_live.push((until, value, extra));
                next_due = next_due.min(until);
            } else {
                live = live.saturating_sub(extra);
                acts.push(detail, ActEvent { value, bytes: 0 });
            }
        }
        // (Scanned only where one is due: a long model saves hundreds at once.)
        if next_due == pos {
            let mut i = 0;
            while i < saved_live.len() {
                if saved_live[i].0 == pos {
                    let (_, value, b) = saved_live.swap_remove(i);
                    live = live.saturating_sub(b);
                    acts.push(detail, ActEvent { value, bytes: 0 });
                } else {
                    i += 1;
                }
            }
            next_due = saved_live.iter().map(|e| e.0).min().unwrap_or(usize::MAX);
        }
        freed.clear();
        let mut waiting = (stream == Stream::AllToAll).then(|| Pending {
            step: step.id,
            out: own,
            operands: smallvec::SmallVec::new(),
            dying: Vec::new(),
        });
        for &input in node.inputs.iter().chain(exec.extra_reads(g, id)) {
            if param_of_node[input.index()].is_some() {
                continue;
            }
            let s = exec.read_slot(id, copy, input);
            if let Some(p) = waiting.as_mut() {
                p.operands.push(s);
            }
            if exec.last_use[s] == pos && !freed.contains(&s) && overwritten != Some(s) {
                freed.push(s);
                match waiting.as_mut() {
                    // An all-to-all's operands live until the compute stream waits for it.
                    Some(p) => p.dying.push((s, value_of[s], bytes(input))),
                    None => release(&mut live, &mut acts, detail, value_of[s], bytes(input)),
                }
            }
        }
        pending.extend(waiting);
        if exec.last_use[own] == usize::MAX {
            live = live.saturating_sub(made);
            if made > 0 {
                acts.push(
                    detail,
                    ActEvent {
                        value: value_of[own],
                        bytes: 0,
                    },
                );
            }
        }
        step.act_end = live;
    }
    // (Every all-to-all has a compute step after it that reads its value; one that had
    // not would keep its operands to the end.)
    for p in pending {
        for (_, value, b) in p.dying {
            release(&mut live, &mut acts, detail, value, b);
        }
    }
    acts.starts.push(acts.events.len() as u32);
    for s in &mut out {
        s.reads.sort_unstable();
        s.grads.sort_unstable();
        s.grad_params.sort_unstable();
    }
    (out, acts)
}

/// The order a rank runs the joint graph's nodes in, and when each value dies: shared by
/// the planner's activation model and the executor, so both free at the same points.
pub struct ExecOrder {
    /// `(node, recomputed copy?)` in execution order; parameters are not executed.
    pub order: Vec<(NodeId, bool)>,
    /// The parameter a `param` node yields.
    pub param_of_node: Vec<Option<u32>>,
    /// True for the nodes that are final parameter gradients.
    pub is_param_grad: Vec<bool>,
    /// Position in `order` of the last reader of each value (`slot(node, copy)`);
    /// `usize::MAX` for values nothing reads.
    pub last_use: Vec<usize>,
    /// The checkpointed block each node belongs to, if any.
    ckpt: IdVec<NodeId, Option<ScopeId>>,
    /// Forward nodes of checkpointed blocks whose outputs are kept (selective
    /// checkpointing), so nothing recomputes them.
    saved: IdVec<NodeId, bool>,
    forward_len: usize,
    /// Attention's backward runs as one flash-attention kernel (PyTorch's
    /// `scaled_dot_product_attention`): the probabilities and their gradient, the
    /// `[b, h, s, t]` values the graph names, live only in its on-chip tiles, so they hold
    /// no memory. Set by [`ExecOrder::blockwise_attention`] for shardplan's executor too.
    pub flash_attention: bool,
    /// Attention backwards shardplan's executor runs blockwise (see
    /// [`ExecOrder::blockwise_attention`]); empty otherwise.
    pub blockwise: Vec<BlockwiseAttention>,
    /// Index into `blockwise` of each node that is part of one: its probabilities, their
    /// gradient and its outputs.
    blockwise_of: Vec<Option<u32>>,
    /// Per node: the input whose memory it writes its value into (see
    /// [`ExecOrder::in_place_cross_entropy`]); empty when none does.
    in_place: Vec<Option<NodeId>>,
    /// Per node: a backward recomputation of a forward node
    /// ([`JointGraph::recompute_of`]) that a checkpointed block's recompute already makes:
    /// it does not run, and its readers read that recomputed copy.
    alias: Vec<Option<NodeId>>,
}

/// One attention backward as shardplan's executor runs it under
/// [`ExecOrder::blockwise_attention`]: the probabilities and their gradient are
/// placeholders, and the first of its outputs in order computes all of them in blocks of
/// query rows from the forward operands and the output gradient.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockwiseAttention {
    /// The `attn_probs` node (a placeholder).
    pub probs: NodeId,
    /// The `attn_grad_scores` node (a placeholder), when q or k needs a gradient.
    pub scores: Option<NodeId>,
    /// q, k, v and the output gradient, the values the blockwise kernel reads.
    pub operands: [NodeId; 4],
    /// The forward operands and the output gradient.
    pub q: NodeId,
    pub k: NodeId,
    pub v: NodeId,
    pub dy: NodeId,
    pub causal: bool,
    /// The gradient nodes, where the graph has them.
    pub dq: Option<NodeId>,
    pub dk: Option<NodeId>,
    pub dv: Option<NodeId>,
}

impl BlockwiseAttention {
    /// The gradient nodes the graph has, in node order; the first computes them all.
    pub fn outputs(&self) -> impl Iterator<Item = NodeId> {
        let mut out = [self.dv, self.dq, self.dk];
        out.sort_unstable();
        out.into_iter().flatten()
    }
}

impl ExecOrder {
    /// The execution order of `joint` under the checkpointing policy `ac`: node order,
    /// except that a checkpointed block's forward runs again just before its first
    /// backward node.
    /// The order `kernels` runs `joint` in under checkpointing `ac`: shardplan's executor's
    /// blockwise attention and in-place cross-entropy under `kernels: fused`, flash
    /// attention otherwise.
    pub fn for_kernels(joint: &JointGraph, ac: ActivationCheckpointing, kernels: Kernels) -> Self {
        let mut exec = ExecOrder::new(joint, ac);
        if kernels == Kernels::Fused {
            exec.shardplan_kernels(&joint.graph);
        } else {
            exec.flash_attention = true;
        }
        exec
    }

    pub fn new(joint: &JointGraph, ac: ActivationCheckpointing) -> Self {
        let g = &joint.graph;
        let n = g.node_count();
        // Checkpointed block of each scope (the nearest block ancestor, if checkpointed).
        let mut block_index = 0u64;
        let mut ckpt_of_scope: IdVec<ScopeId, Option<ScopeId>> = IdVec::with_capacity(g.scopes().len());
        for (id, s) in g.scopes() {
            let inherited = s.parent.and_then(|p| ckpt_of_scope[p]);
            let own = if s.kind == ModuleKind::Block {
                let chosen = match ac {
                    ActivationCheckpointing::None => false,
                    ActivationCheckpointing::Full | ActivationCheckpointing::Selective(_) => true,
                    ActivationCheckpointing::Every(k) => block_index.is_multiple_of(k),
                };
                block_index += 1;
                chosen.then_some(id)
            } else {
                None
            };
            ckpt_of_scope.push(own.or(inherited));
        }
        let ckpt: IdVec<NodeId, Option<ScopeId>> = g.nodes().map(|(_, node)| ckpt_of_scope[node.scope]).collect();
        let mut param_of_node: Vec<Option<u32>> = vec![None; n];
        for (p, param) in g.params() {
            param_of_node[param.node.index()] = Some(p.0);
        }
        // Selective checkpointing: the forward nodes whose outputs a block keeps (they are
        // not recomputed; its recompute and backward read the originals).
        let mut saved: IdVec<NodeId, bool> = IdVec::from_elem(false, n);
        if let ActivationCheckpointing::Selective(policy) = ac {
            let mut matmuls: Vec<(ScopeId, u64)> = Vec::new();
            for j in saved.keys().take(joint.forward_len) {
                let Some(block) = ckpt[j] else { continue };
                saved[j] = match &g.node(j).op {
                    Op::Attention { .. } => policy.attention,
                    Op::Linear { .. } | Op::MatMul => {
                        let count = match matmuls.iter_mut().find(|(b, _)| *b == block) {
                            Some((_, c)) => {
                                *c += 1;
                                *c
                            }
                            None => {
                                matmuls.push((block, 1));
                                1
                            }
                        };
                        match policy.matmuls {
                            SavedMatmuls::None => false,
                            SavedMatmuls::All => true,
                            SavedMatmuls::Odd => count % 2 == 1,
                        }
                    }
                    _ => false,
                };
            }
        }
        // A plain `Vec` (as `param_of_node`): public, and the executor indexes it by `usize`.
        let mut is_param_grad = vec![false; n];
        for grad in joint.param_grads.iter().flatten() {
            is_param_grad[grad.index()] = true;
        }
        // The forward nodes each checkpointed block recomputes, in order.
        let mut block_nodes: Vec<(ScopeId, Vec<NodeId>)> = Vec::new();
        for (j, param) in param_of_node.iter().enumerate().take(joint.forward_len) {
            let f = NodeId::new(j);
            if param.is_some() || g.node(f).op.is_leaf() || saved[f] {
                continue;
            }
            if let Some(block) = ckpt[f] {
                match block_nodes.iter_mut().find(|(b, _)| *b == block) {
                    Some((_, v)) => v.push(f),
                    None => block_nodes.push((block, vec![f])),
                }
            }
        }
        // Backward recomputations of values the block's recompute makes anyway.
        let mut alias: Vec<Option<NodeId>> = vec![None; n];
        for (i, of) in joint.recompute_of.iter().enumerate() {
            if let Some(f) = *of {
                let c = NodeId::new(i);
                if ckpt[f].is_some() && !saved[f] && ckpt[c] == ckpt[f] {
                    alias[i] = Some(f);
                }
            }
        }
        let mut order: Vec<(NodeId, bool)> = Vec::with_capacity(n + n / 2);
        let mut recomputed: Vec<ScopeId> = Vec::new();
        for (i, param) in param_of_node.iter().enumerate() {
            let id = NodeId::new(i);
            if param.is_some() || alias[i].is_some() {
                continue;
            }
            if i >= joint.forward_len {
                if let Some(block) = ckpt[id] {
                    if !recomputed.contains(&block) {
                        recomputed.push(block);
                        if let Some((_, nodes)) = block_nodes.iter().find(|(b, _)| *b == block) {
                            order.extend(nodes.iter().map(|&f| (f, true)));
                        }
                    }
                }
            }
            order.push((id, false));
        }
        let mut exec = ExecOrder {
            order,
            param_of_node,
            is_param_grad,
            last_use: vec![usize::MAX; n * 2],
            ckpt,
            saved,
            forward_len: joint.forward_len,
            flash_attention: false,
            blockwise: Vec::new(),
            blockwise_of: Vec::new(),
            in_place: Vec::new(),
            alias,
        };
        for pos in 0..exec.order.len() {
            let (id, copy) = exec.order[pos];
            for &input in &g.node(id).inputs {
                if exec.param_of_node[input.index()].is_none() {
                    let s = exec.read_slot(id, copy, input);
                    exec.last_use[s] = pos;
                }
            }
        }
        exec
    }

    /// Runs attention's backward as shardplan's executor does: blockwise, as flash
    /// attention does, with no `[b, h, s, t]` value in memory.
    ///
    /// For each `attn_probs` node whose readers are only `attn_grad_v` and
    /// `attn_grad_scores` (and whose `attn_grad_scores` is read only by `attn_grad_q` and
    /// `attn_grad_k`), the probabilities and their gradient become placeholders that hold
    /// no memory, and the first gradient node in order computes dq, dk and dv together in
    /// blocks of query rows, recomputing each block's probabilities from q and k. So the
    /// gradient nodes read q, k, v and the output gradient, which live until the last of
    /// them (as a flash-attention backward kernel holds its operands until it ends).
    ///
    /// The executor holds dq and dk from the first gradient node on, the plan from their
    /// own nodes; the nodes between make only placeholders and free nothing (every operand
    /// lives to the last gradient node), so both see the same peak.
    pub fn blockwise_attention(&mut self, g: &shardplan_ir::Graph) {
        let n = g.node_count();
        let mut readers: Vec<Vec<NodeId>> = vec![Vec::new(); n];
        for (id, node) in g.nodes() {
            if matches!(
                node.op,
                Op::AttnProbs { .. } | Op::AttnGradScores | Op::AttnGradV { .. } | Op::AttnGradQ | Op::AttnGradK { .. }
            ) {
                for &i in &node.inputs {
                    readers[i.index()].push(id);
                }
            } else {
                for &i in &node.inputs {
                    if matches!(g.node(i).op, Op::AttnProbs { .. } | Op::AttnGradScores) {
                        readers[i.index()].push(id);
                    }
                }
            }
        }
        self.blockwise.clear();
        self.blockwise_of = vec![None; n];
        for (probs, node) in g.nodes() {
            let Op::AttnProbs { causal } = node.op else { continue };
            let (q, k) = (node.inputs[0], node.inputs[1]);
            let mut b = BlockwiseAttention {
                probs,
                scores: None,
                operands: [q; 4],
                q,
                k,
                v: q,
                dy: q,
                causal,
                dq: None,
                dk: None,
                dv: None,
            };
            let (mut dy, mut v, mut ok) = (None, None, true);
            for &r in &readers[probs.index()] {
                let rn = g.node(r);
                match rn.op {
                    Op::AttnGradV { .. } if rn.inputs[0] == probs && b.dv.is_none() => {
                        b.dv = Some(r);
                        ok &= *dy.get_or_insert(rn.inputs[1]) == rn.inputs[1];
                    }
                    Op::AttnGradScores if rn.inputs[0] == probs && b.scores.is_none() => {
                        b.scores = Some(r);
                        ok &= *dy.get_or_insert(rn.inputs[1]) == rn.inputs[1];
                        v = Some(rn.inputs[2]);
                        for &r2 in &readers[r.index()] {
                            let r2n = g.node(r2);
                            match r2n.op {
                                Op::AttnGradQ if r2n.inputs[..] == [r, k] && b.dq.is_none() => b.dq = Some(r2),
                                Op::AttnGradK { .. } if r2n.inputs[..] == [r, q] && b.dk.is_none() => b.dk = Some(r2),
                                _ => ok = false,
                            }
                        }
                    }
                    _ => ok = false,
                }
            }
            // v: the attention's own third operand; `attn_grad_v` alone does not name it.
            let forward = node.grad_of.map(|f| g.node(f));
            let fv = forward
                .filter(|f| matches!(f.op, Op::Attention { .. }) && f.inputs[..2] == [q, k])
                .map(|f| f.inputs[2]);
            match (v, fv) {
                (Some(a), Some(b)) if a != b => ok = false,
                (None, None) => ok = false,
                _ => {}
            }
            let (Some(dy), Some(v)) = (dy, v.or(fv)) else { continue };
            if !ok || (b.dv.is_none() && b.dq.is_none() && b.dk.is_none()) {
                continue;
            }
            b.dy = dy;
            b.v = v;
            b.operands = [q, k, v, dy];
            let index = Some(self.blockwise.len() as u32);
            for x in [Some(b.probs), b.scores, b.dq, b.dk, b.dv].into_iter().flatten() {
                self.blockwise_of[x.index()] = index;
            }
            self.blockwise.push(b);
        }
        self.flash_attention = true;
        // The gradient nodes read the operands through the placeholders.
        for pos in 0..self.order.len() {
            let (id, copy) = self.order[pos];
            let Some(operands) = self.blockwise_group(id).map(|b| b.operands) else {
                continue;
            };
            if matches!(g.node(id).op, Op::AttnProbs { .. } | Op::AttnGradScores) {
                continue;
            }
            for x in operands {
                if self.param_of_node[x.index()].is_none() {
                    let s = self.read_slot(id, copy, x);
                    self.last_use[s] = self.last_use[s].max(pos);
                }
            }
        }
    }

    /// How shardplan's executor runs the graph (`kernels: fused`): attention's backward
    /// blockwise ([`ExecOrder::blockwise_attention`]) and the cross-entropy's backward in
    /// place ([`ExecOrder::in_place_cross_entropy`]).
    pub fn shardplan_kernels(&mut self, g: &shardplan_ir::Graph) {
        self.blockwise_attention(g);
        self.in_place_cross_entropy(g);
    }

    /// Runs the cross-entropy's backward in place, as fused cross-entropy kernels do: a
    /// `cross_entropy_grad` whose logits die at it, of its own type, writes the gradient
    /// over them, so the loss backward holds one logits-sized tensor, not two. Only where
    /// nothing else can share the logits' memory: they and every value they view (through
    /// reshapes, transposes, narrows, broadcasts, casts and sums to a shape) die at or
    /// before it, and none of them is a parameter or a fed input.
    pub fn in_place_cross_entropy(&mut self, g: &shardplan_ir::Graph) {
        let n = g.node_count();
        let mut pos_of = vec![usize::MAX; n];
        for (pos, &(id, copy)) in self.order.iter().enumerate() {
            if !copy {
                pos_of[id.index()] = pos;
            }
        }
        self.in_place = vec![None; n];
        for (id, node) in g.nodes() {
            if !matches!(node.op, Op::CrossEntropyGrad) {
                continue;
            }
            let pos = pos_of[id.index()];
            let x = node.inputs[0];
            if pos == usize::MAX || g.node(x).ty != node.ty {
                continue;
            }
            let dies_here = |v: NodeId, read_copy: bool| {
                let lu = self.last_use[Self::slot(v, read_copy)];
                lu == usize::MAX || lu <= pos
            };
            if self.last_use[self.read_slot(id, false, x)] != pos {
                continue;
            }
            let mut v = x;
            let ok = loop {
                let vn = g.node(v);
                if self.param_of_node[v.index()].is_some() || vn.op.is_leaf() {
                    break false;
                }
                if !(dies_here(v, false) && (!self.recomputed(v) || dies_here(v, true))) {
                    break false;
                }
                match vn.op {
                    Op::Reshape { .. }
                    | Op::Transpose { .. }
                    | Op::Narrow { .. }
                    | Op::BroadcastTo { .. }
                    | Op::Cast { .. }
                    | Op::SumTo { .. } => v = vn.inputs[0],
                    _ => break true,
                }
            };
            if ok {
                self.in_place[id.index()] = Some(x);
            }
        }
    }

    /// The input whose memory `id` writes its value into, if any
    /// ([`ExecOrder::in_place_cross_entropy`]).
    pub fn in_place(&self, id: NodeId) -> Option<NodeId> {
        self.in_place.get(id.index()).copied().flatten()
    }

    /// The blockwise attention backward `id` is part of, if any.
    pub fn blockwise_group(&self, id: NodeId) -> Option<&BlockwiseAttention> {
        let i = (*self.blockwise_of.get(id.index())?)?;
        self.blockwise.get(i as usize)
    }

    /// Values `id` reads beyond its graph inputs: a blockwise attention's gradient node
    /// reads q, k, v and the output gradient (through the placeholders); nothing else does.
    /// Frees at a node's position go over its inputs and these.
    pub fn extra_reads(&self, g: &shardplan_ir::Graph, id: NodeId) -> &[NodeId] {
        match self.blockwise_group(id) {
            Some(b) if !matches!(g.node(id).op, Op::AttnProbs { .. } | Op::AttnGradScores) => &b.operands,
            _ => &[],
        }
    }

    /// Whether `id` is a placeholder of a blockwise attention backward (no memory).
    pub fn placeholder(&self, id: NodeId) -> bool {
        self.blockwise_group(id)
            .is_some_and(|b| b.probs == id || b.scores == Some(id))
    }

    /// Whether forward node `id` runs again in its block's recompute (checkpointed and not
    /// saved), so what its original run saves dies with it.
    pub fn recomputed(&self, id: NodeId) -> bool {
        id.index() < self.forward_len && self.ckpt[id].is_some() && !self.saved[id]
    }

    /// Index of a value (a node's original or its recomputed copy).
    pub fn slot(id: NodeId, copy: bool) -> usize {
        id.index() * 2 + usize::from(copy)
    }

    /// The value slot `reader` (itself a copy or not) reads for `input`: its own, its
    /// recomputed copy ([`ExecOrder::reads_copy`]), or, for a backward recomputation the
    /// block's recompute already makes, that copy.
    pub fn read_slot(&self, reader: NodeId, reader_copy: bool, input: NodeId) -> usize {
        match self.alias.get(input.index()).copied().flatten() {
            Some(f) => Self::slot(f, true),
            None => Self::slot(input, self.reads_copy(reader, reader_copy, input)),
        }
    }

    /// Whether `reader` (itself a copy or not) reads the recomputed copy of `input`: inside
    /// a checkpointed block, its recompute and backward read the block's recomputed values.
    pub fn reads_copy(&self, reader: NodeId, reader_copy: bool, input: NodeId) -> bool {
        if self.saved[input] {
            return false;
        }
        match self.ckpt[input] {
            Some(block) if input.index() < self.forward_len => {
                (reader_copy || reader.index() >= self.forward_len) && self.ckpt[reader] == Some(block)
            }
            _ => false,
        }
    }

    /// Bytes a value holds as an activation: 0 for parameters and final parameter
    /// gradients (they live in group buffers), and for a parameter read through `tp_copy`
    /// (the parameter itself).
    pub fn value_bytes(&self, g: &shardplan_ir::Graph, id: NodeId) -> u64 {
        let node = g.node(id);
        if self.param_of_node[id.index()].is_some()
            || self.is_param_grad[id.index()]
            || (matches!(node.op, shardplan_ir::Op::TpCopy { .. })
                && self.param_of_node[node.inputs[0].index()].is_some())
            || (self.flash_attention
                && self.blockwise_of.is_empty()
                && matches!(
                    g.node(id).op,
                    shardplan_ir::Op::AttnProbs { .. } | shardplan_ir::Op::AttnGradScores
                ))
            || self.placeholder(id)
        {
            0
        } else {
            g.node(id).ty.bytes().unwrap_or(u64::MAX)
        }
    }
}
