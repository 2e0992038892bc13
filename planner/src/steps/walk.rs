//! The walk that cuts the execution order into steps and follows activation memory: node
//! after node, it decides where a step starts, what the step reads and makes gradients
//! of, and which values are made and freed (as the executor frees them: after the last
//! reader), with what PyTorch's kernels hold beside them.

use super::{ActEvent, ActEvents, ExecOrder, Phase, Runner, Step, StepId, ValueSlot};
use crate::group::{scope_groups, FsdpGroup, GroupId};
use crate::stream::Stream;
use shardplan_ir::{Graph, IdVec, JointGraph, NodeId, Op, ParamId, ScopeId};

/// The steps of `exec` for `groups` and their activation events; with `detail` false,
/// steps without labels, reads, gradients or nodes, and no activation events.
pub(super) fn walk(
    joint: &JointGraph,
    groups: &[FsdpGroup],
    exec: &ExecOrder,
    runner: Runner,
    detail: bool,
) -> (Vec<Step>, ActEvents) {
    let mut w = Walker::new(Tables::new(joint, groups, exec, runner), detail);
    for (pos, &(id, copy)) in exec.order().iter().enumerate() {
        w.node(pos, id, copy);
    }
    w.finish()
}

/// What the walk looks up for every node, made once.
struct Tables<'a> {
    joint: &'a JointGraph,
    g: &'a Graph,
    groups: &'a [FsdpGroup],
    exec: &'a ExecOrder,
    runner: Runner,
    group_of_scope: IdVec<ScopeId, GroupId>,
    group_of_param: IdVec<ParamId, GroupId>,
    /// Per node that is a parameter's final gradient: its group and parameter.
    grad_group: IdVec<NodeId, Option<GroupId>>,
    grad_param: IdVec<NodeId, Option<ParamId>>,
    /// Per forward node, the position of the last backward node of its gradient (where
    /// autograd frees what it saved), `usize::MAX` for none; empty under `kernels: fused`.
    last_grad_pos: IdVec<NodeId, usize>,
}

impl<'a> Tables<'a> {
    fn new(joint: &'a JointGraph, groups: &'a [FsdpGroup], exec: &'a ExecOrder, runner: Runner) -> Self {
        let g = &joint.graph;
        let n = g.node_count();
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
        Tables {
            joint,
            g,
            groups,
            exec,
            runner,
            group_of_scope: scope_groups(g, groups),
            group_of_param,
            grad_group,
            grad_param,
            last_grad_pos: last_grad_positions(joint, exec, runner),
        }
    }

    /// Bytes value `id` holds; PyTorch holds token ids as int64, twice shardplan's u32.
    #[inline]
    fn bytes(&self, id: NodeId) -> u64 {
        let b = self.exec.value_bytes(self.g, id);
        let node = self.g.node(id);
        if self.runner.is_fsdp2() && matches!(node.op, Op::Input { .. }) && node.ty.dtype == shardplan_ir::DType::U32 {
            b.saturating_mul(2)
        } else {
            b
        }
    }

    /// The module a step of group `grp` names for node `id`: the group's, or for the root
    /// group the node's top-level module.
    fn label_of(&self, grp: GroupId, id: NodeId) -> &'a str {
        let group = &self.groups[grp.index()];
        if group.is_root() {
            self.g.scope(self.g.top_level(self.g.node(id).scope)).display_path()
        } else {
            &group.module
        }
    }

    /// Under shardplan's runtime each expert-group and context-group collective is a step
    /// of its own, run on the all-to-all stream beside the compute stream's work that does
    /// not need it (`runtime: fsdp2` runs them inline, as torchtitan does).
    fn stream_of(&self, id: NodeId) -> Stream {
        let op = &self.g.node(id).op;
        let own = (self.g.expert_overlap() && op.is_expert_collective()) || op.is_context_collective();
        if !self.runner.is_fsdp2() && own {
            Stream::AllToAll
        } else {
            Stream::Compute
        }
    }

    /// The value slots node `id` (a copy or not) reads: its inputs and extra reads that
    /// are not parameters.
    fn read_slots(&self, id: NodeId, copy: bool) -> impl Iterator<Item = (NodeId, ValueSlot)> + '_ {
        let node = self.g.node(id);
        node.inputs
            .iter()
            .chain(self.exec.extra_reads(self.g, id))
            .filter(|&&x| self.exec.param_of(x).is_none())
            .map(move |&x| (x, self.exec.read_slot(id, copy, x)))
    }
}

/// Autograd's saved tensors beyond the graph's values are freed after the last backward
/// node of the forward node that saved them: that position per forward node.
fn last_grad_positions(joint: &JointGraph, exec: &ExecOrder, runner: Runner) -> IdVec<NodeId, usize> {
    let mut last: IdVec<NodeId, usize> = IdVec::new();
    if runner == Runner::Shardplan {
        return last;
    }
    last = IdVec::from_elem(usize::MAX, joint.forward_len);
    for (pos, &(id, copy)) in exec.order().iter().enumerate() {
        if copy || id.index() < joint.forward_len {
            continue;
        }
        if let Some(f) = joint.graph.node(id).grad_of {
            if let Some(slot) = last.get_mut(f) {
                *slot = pos;
            }
        }
    }
    last
}

/// An all-to-all step the compute stream has not waited for yet (see `Step::waits_for`).
struct Pending {
    step: StepId,
    /// Its value's slot and its operands' slots.
    out: ValueSlot,
    operands: smallvec::SmallVec<[ValueSlot; 2]>,
    /// Operands it is the last reader of: (slot, value number, bytes), freed at the join.
    dying: Vec<(ValueSlot, u32, u64)>,
}

/// The walk's running state.
struct Walker<'a> {
    t: Tables<'a>,
    detail: bool,
    out: Vec<Step>,
    acts: ActEvents,
    /// Value slot -> dense value number.
    value_of: IdVec<ValueSlot, u32>,
    /// Activation bytes held now.
    live: u64,
    /// Slots freed at this node (each once).
    freed: Vec<ValueSlot>,
    pending: Vec<Pending>,
    /// (free position, value, bytes) of the saved tensors held now.
    saved_live: Vec<(usize, u32, u64)>,
    /// The least free position in `saved_live`.
    next_due: usize,
}

impl<'a> Walker<'a> {
    fn new(t: Tables<'a>, detail: bool) -> Self {
        let n = t.g.node_count();
        let order = t.exec.order().len();
        Walker {
            t,
            detail,
            out: Vec::new(),
            acts: ActEvents {
                events: Vec::with_capacity(order * 2),
                starts: Vec::new(),
                values: 0,
            },
            value_of: IdVec::from_elem(u32::MAX, n * 2),
            live: 0,
            freed: Vec::new(),
            pending: Vec::new(),
            saved_live: Vec::new(),
            next_due: usize::MAX,
        }
    }

    /// Node `id` (a recomputed copy or not) at position `pos` of the execution order.
    fn node(&mut self, pos: usize, id: NodeId, copy: bool) {
        let phase = if copy {
            Phase::Recompute
        } else if id.index() >= self.t.joint.forward_len {
            Phase::Backward
        } else {
            Phase::Forward
        };
        let grp = self.t.group_of_scope[self.t.g.node(id).scope];
        let stream = self.t.stream_of(id);
        let joined = self.joined(pos, id, copy, stream);
        if self.starts_step(phase, grp, stream, &joined, id, copy) {
            self.push_step(phase, grp, stream);
        }
        if !joined.is_empty() {
            self.join(joined);
        }
        self.record(id, copy, grp);
        let own = ValueSlot::of(id, copy);
        // An in-place op's input is gone before its value is made.
        let overwritten = self.t.exec.in_place(id).map(|x| {
            let s = self.t.exec.read_slot(id, copy, x);
            self.release(self.value_of[s], self.t.bytes(x));
            s
        });
        let made = self.make(id, own);
        self.eager_cross_entropy(id);
        self.saved_by(pos, id, copy);
        if self.next_due == pos {
            self.release_due_saved(pos);
        }
        self.release_inputs(pos, id, copy, stream, overwritten);
        if self.t.exec.last_use(own).is_none() {
            // A value nothing reads dies as it is made.
            self.live = self.live.saturating_sub(made);
            if made > 0 {
                let value = self.value_of[own];
                self.acts.push(self.detail, ActEvent { value, bytes: 0 });
            }
        }
        let live = self.live;
        self.step().act_end = live;
    }

    /// The steps and their events, once every node has been walked.
    fn finish(mut self) -> (Vec<Step>, ActEvents) {
        // (Every all-to-all has a compute step after it that reads its value; one that had
        // not would keep its operands to the end.)
        for p in std::mem::take(&mut self.pending) {
            for (_, value, b) in p.dying {
                self.release(value, b);
            }
        }
        self.acts.starts.push(self.acts.events.len() as u32);
        for s in &mut self.out {
            s.reads.sort_unstable();
            s.grads.sort_unstable();
            s.grad_params.sort_unstable();
        }
        (self.out, self.acts)
    }

    /// The step being made.
    fn step(&mut self) -> &mut Step {
        self.out.last_mut().expect("a step was pushed at the first node")
    }

    /// Raises the step's peak to what is held now.
    fn peak(&mut self, extra: u64) {
        let level = self.live.saturating_add(extra);
        let step = self.step();
        step.act_peak = step.act_peak.max(level);
    }

    /// Frees `bytes` of activation value `value` ([`release`]).
    fn release(&mut self, value: u32, bytes: u64) {
        release(&mut self.live, &mut self.acts, self.detail, value, bytes);
    }

    /// The pending all-to-alls compute node `id` is the first to touch (it reads their
    /// value, or is the last reader of one of their operands), taken off the pending list:
    /// a compute step starts here, after the compute stream waits for them.
    fn joined(&mut self, pos: usize, id: NodeId, copy: bool, stream: Stream) -> Vec<Pending> {
        let mut joined = Vec::new();
        if stream != Stream::Compute || self.pending.is_empty() {
            return joined;
        }
        let slots: smallvec::SmallVec<[ValueSlot; 8]> = self.t.read_slots(id, copy).map(|(_, s)| s).collect();
        let exec = self.t.exec;
        let touches = |p: &Pending| {
            slots
                .iter()
                .any(|&s| s == p.out || (p.operands.contains(&s) && exec.last_use(s) == Some(pos)))
        };
        let mut k = 0;
        while k < self.pending.len() {
            if touches(&self.pending[k]) {
                joined.push(self.pending.remove(k));
            } else {
                k += 1;
            }
        }
        joined
    }

    /// Whether node `id` starts a new step: at a change of pass, group or stream, at each
    /// all-to-all, after pending all-to-alls are joined, and before a group's first
    /// gradient made after a higher peak.
    fn starts_step(
        &self,
        phase: Phase,
        grp: GroupId,
        stream: Stream,
        joined: &[Pending],
        id: NodeId,
        copy: bool,
    ) -> bool {
        let Some(s) = self.out.last() else {
            return true;
        };
        // A step also ends just before it first makes a gradient of a group when the work
        // before has held more than it holds now: the gradient piece is then allocated
        // after that peak, not beside it (the loss backward: the logits and their gradient
        // both live until the cross-entropy's backward ends, before the output projection
        // makes its weight's gradient). Under autograd (`runtime: fsdp2`) every parameter's
        // gradient is its own tensor, made by the op that computes it while the step's
        // activations die around it, so the step ends before each one on those terms.
        let first_grad = match (copy, self.t.grad_group[id]) {
            (false, Some(gg)) => (self.t.runner.is_fsdp2() || !s.grads.contains(&gg)) && s.act_peak > self.live,
            _ => false,
        };
        s.phase != phase
            || s.group != grp
            || first_grad
            || stream == Stream::AllToAll
            || s.stream != stream
            || !joined.is_empty()
    }

    fn push_step(&mut self, phase: Phase, group: GroupId, stream: Stream) {
        self.acts.starts.push(self.acts.events.len() as u32);
        self.out.push(Step {
            id: StepId::new(self.out.len()),
            phase,
            group,
            label: String::new(),
            nodes: Vec::new(),
            reads: Vec::new(),
            grads: Vec::new(),
            grad_params: Vec::new(),
            act_peak: self.live,
            act_end: self.live,
            tensor_ops: Vec::new(),
            stream,
            waits_for: Vec::new(),
        });
    }

    /// The step waits for the `joined` all-to-alls; their dying operands go first, as the
    /// executor frees them once the compute stream has waited.
    fn join(&mut self, joined: Vec<Pending>) {
        for p in &joined {
            for &(_, value, b) in &p.dying {
                self.release(value, b);
            }
        }
        let live = self.live;
        let step = self.step();
        step.waits_for = joined.iter().map(|p| p.step).collect();
        step.act_peak = live;
        step.act_end = live;
    }

    /// Node `id` joins the step: its module in the label, its id, the groups whose
    /// parameters it reads and whose gradients it makes.
    fn record(&mut self, id: NodeId, copy: bool, grp: GroupId) {
        let detail = self.detail;
        let t = &self.t;
        let node = t.g.node(id);
        let step = self.out.last_mut().expect("a step was pushed at the first node");
        if detail && !node.op.is_leaf() {
            let label = t.label_of(grp, id);
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
            if let Some(p) = t.exec.param_of(input) {
                let pg = t.group_of_param[ParamId(p)];
                if !step.reads.contains(&pg) {
                    step.reads.push(pg);
                }
            }
        }
        if let Some(gg) = t.grad_group[id] {
            if !step.grads.contains(&gg) {
                step.grads.push(gg);
            }
        }
        if let (false, Some(p)) = (copy, t.grad_param[id]) {
            step.grad_params.push(p);
        }
    }

    /// Node `id` makes its value (slot `own`); its bytes.
    fn make(&mut self, id: NodeId, own: ValueSlot) -> u64 {
        let made = self.t.bytes(id);
        self.live = self.live.saturating_add(made);
        self.peak(0);
        if made > 0 {
            if self.value_of[own] == u32::MAX {
                self.value_of[own] = self.acts.values;
                self.acts.values += 1;
            }
            let value = self.value_of[own];
            self.acts.push(self.detail, ActEvent { value, bytes: made });
        }
        made
    }

    /// PyTorch eager's cross-entropy is `log_softmax` then `nll_loss`: its backward makes
    /// the log-probabilities' gradient (as large as the logits) before the logits'
    /// gradient, beside it. A compiled loss computes the logits' gradient in one kernel.
    ///
    /// Under `loss_parallel()` (FSDP2's run) DTensor runs both as Python over the
    /// vocabulary-split logits (`torch.distributed.tensor.parallel.loss`): the forward holds the shifted
    /// logits and their exponentials beside its input, and the backward holds a zeroed
    /// gradient and `zeros + exp(log_probs)` beside the logits' gradient, each as large as
    /// the logits: two transients where eager's one kernel has none or one.
    ///
    /// Compiled, the loss's pointwise work fuses (the forward's reductions around its two
    /// all-reduces write only rows), but loss_parallel's backward scatters into its zeroed
    /// gradient in place: inductor writes that buffer before the fused kernel reads it,
    /// one transient as large as the logits.
    fn eager_cross_entropy(&mut self, id: NodeId) {
        let node = self.t.g.node(id);
        if self.t.runner == Runner::Shardplan {
            return;
        }
        // DTensor's loss_parallel() is what FSDP2's run (`runtime: fsdp2`, the exported
        // program) executes; `kernels: eager` alone keeps eager's one-kernel count.
        let dtensor = self.t.runner.is_fsdp2();
        let compiled = self.t.runner.compile().loss;
        let transients = match node.op {
            Op::VocabCrossEntropyGrad { .. } if dtensor && compiled => 1u32,
            _ if compiled => return,
            Op::CrossEntropyGrad => 1,
            Op::VocabCrossEntropyGrad { .. } if !dtensor => 1,
            Op::VocabCrossEntropy { .. } | Op::VocabCrossEntropyGrad { .. } if dtensor => 2,
            _ => return,
        };
        let extra = self.t.g.node(node.inputs[0]).ty.bytes().unwrap_or(u64::MAX);
        self.peak(extra.saturating_mul(u64::from(transients)));
        let first = self.acts.values;
        for k in 0..transients {
            self.acts.push(
                self.detail,
                ActEvent {
                    value: first + k,
                    bytes: extra,
                },
            );
        }
        for k in 0..transients {
            self.acts.push(
                self.detail,
                ActEvent {
                    value: first + k,
                    bytes: 0,
                },
            );
        }
        self.acts.values += transients;
    }

    /// What PyTorch saves for forward node `id` beyond its value ([`Runner::saved_bytes`];
    /// the loss a training loop keeps under autograd): made with the op and kept until its
    /// backward, unless its block recomputes it.
    fn saved_by(&mut self, pos: usize, id: NodeId, copy: bool) {
        let (joint, runner) = (self.t.joint, self.t.runner);
        let extra = if id.index() >= joint.forward_len {
            0
        } else if runner.is_fsdp2() && id == joint.loss && !copy {
            // The loss a training loop keeps (`loss = model(...)`) lives through backward.
            joint.graph.node(id).ty.bytes().unwrap_or(0)
        } else {
            runner.saved_bytes(&joint.graph, id)
        };
        if extra == 0 {
            return;
        }
        self.live = self.live.saturating_add(extra);
        self.peak(0);
        let value = self.acts.values;
        self.acts.values += 1;
        self.acts.push(self.detail, ActEvent { value, bytes: extra });
        let kept = copy || !self.t.exec.recomputed(id);
        let until = if id == joint.loss {
            self.t.exec.order().len() - 1
        } else {
            self.t.last_grad_pos.get(id).copied().unwrap_or(usize::MAX)
        };
        if kept && until != usize::MAX && until > pos {
            self.saved_live.push((until, value, extra));
            self.next_due = self.next_due.min(until);
        } else {
            self.live = self.live.saturating_sub(extra);
            self.acts.push(self.detail, ActEvent { value, bytes: 0 });
        }
    }

    /// Frees the saved tensors due at `pos` (scanned only where one is due: a long model
    /// saves hundreds at once).
    fn release_due_saved(&mut self, pos: usize) {
        let mut i = 0;
        while i < self.saved_live.len() {
            if self.saved_live[i].0 == pos {
                let (_, value, b) = self.saved_live.swap_remove(i);
                self.live = self.live.saturating_sub(b);
                self.acts.push(self.detail, ActEvent { value, bytes: 0 });
            } else {
                i += 1;
            }
        }
        self.next_due = self.saved_live.iter().map(|e| e.0).min().unwrap_or(usize::MAX);
    }

    /// Frees the values node `id` is the last reader of (except one it wrote over); an
    /// all-to-all keeps its operands until the compute stream waits for it.
    fn release_inputs(&mut self, pos: usize, id: NodeId, copy: bool, stream: Stream, overwritten: Option<ValueSlot>) {
        self.freed.clear();
        let mut waiting = (stream == Stream::AllToAll).then(|| Pending {
            step: self.out.last().expect("a step was pushed at the first node").id,
            out: ValueSlot::of(id, copy),
            operands: smallvec::SmallVec::new(),
            dying: Vec::new(),
        });
        // (The fields are borrowed one by one: this runs for every node.)
        let t = &self.t;
        let node = t.g.node(id);
        for &input in node.inputs.iter().chain(t.exec.extra_reads(t.g, id)) {
            if t.exec.param_of(input).is_some() {
                continue;
            }
            let s = t.exec.read_slot(id, copy, input);
            if let Some(p) = waiting.as_mut() {
                p.operands.push(s);
            }
            if t.exec.last_use(s) == Some(pos) && !self.freed.contains(&s) && overwritten != Some(s) {
                self.freed.push(s);
                let (value, b) = (self.value_of[s], t.bytes(input));
                match waiting.as_mut() {
                    Some(p) => p.dying.push((s, value, b)),
                    None => release(&mut self.live, &mut self.acts, self.detail, value, b),
                }
            }
        }
        self.pending.extend(waiting);
    }
}

/// Frees `bytes` of activation value `value` (`u32::MAX`: never numbered) from `live`,
/// recording the free among `acts`' events.
fn release(live: &mut u64, acts: &mut ActEvents, detail: bool, value: u32, bytes: u64) {
    *live = live.saturating_sub(bytes);
    if bytes > 0 && value != u32::MAX {
        acts.push(detail, ActEvent { value, bytes: 0 });
    }
}

/// Whether the last entry of a step's comma-separated label is `label` (the common case,
/// checked before the whole list).
fn last_label_is(labels: &str, label: &str) -> bool {
    labels
        .strip_suffix(label)
        .is_some_and(|head| head.is_empty() || head.ends_with(", "))
}
