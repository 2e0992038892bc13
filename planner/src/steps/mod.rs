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

mod exec_order;
mod walk;

pub use exec_order::{ExecOrder, ValueSlot};

use crate::group::{FsdpGroup, GroupId};
use crate::stream::Stream;
use serde::{Deserialize, Serialize};
use shardplan_frontends::ActivationCheckpointing;
use shardplan_ir::{JointGraph, NodeId, Op, ParamId};
use std::ops::Range;
use walk::walk;

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

fn compute_stream() -> Stream {
    Stream::Compute
}

fn on_compute(s: &Stream) -> bool {
    *s == Stream::Compute
}

/// A tensor-, expert- or context-parallel collective inside a compute step: it runs on the compute
/// stream, between the ops that make its input and read its output.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorOp {
    pub node: NodeId,
    /// Which collective (serialised as the op's name).
    pub op: StepCollective,
    /// Bytes of the full buffer the collective moves (the gathered output, the reduced
    /// input; a vocabulary-parallel loss's row statistics).
    pub bytes: u64,
    /// Its start within the step and its duration, seconds, by the cost model.
    pub at_s: f64,
    pub dur_s: f64,
}

/// The collectives a compute step's ops run over the tensor group (tensor parallelism) or
/// the expert group (expert parallelism), as the plan declares them on the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepCollective {
    TpAllGather,
    TpReduceScatter,
    TpAllReduce,
    VocabCrossEntropy,
    VocabCrossEntropyGrad,
    MoeGatherIds,
    MoeDispatch,
    MoeCombine,
    CpAllGather,
    CpReduceScatter,
}

impl StepCollective {
    /// The collective `op` runs, if it runs one (`Op::is_tensor_collective`,
    /// `Op::is_expert_collective`).
    pub fn of(op: &Op) -> Option<Self> {
        Some(match op {
            Op::TpAllGather { .. } => StepCollective::TpAllGather,
            Op::TpReduceScatter { .. } => StepCollective::TpReduceScatter,
            Op::TpAllReduce { .. } => StepCollective::TpAllReduce,
            Op::VocabCrossEntropy { .. } => StepCollective::VocabCrossEntropy,
            Op::VocabCrossEntropyGrad { .. } => StepCollective::VocabCrossEntropyGrad,
            Op::MoeGatherIds { .. } => StepCollective::MoeGatherIds,
            Op::MoeDispatch { .. } => StepCollective::MoeDispatch,
            Op::MoeCombine { .. } => StepCollective::MoeCombine,
            Op::CpAllGather { .. } => StepCollective::CpAllGather,
            Op::CpReduceScatter { .. } => StepCollective::CpReduceScatter,
            _ => return None,
        })
    }

    /// The op's name.
    pub fn name(self) -> &'static str {
        match self {
            StepCollective::TpAllGather => "tp_all_gather",
            StepCollective::TpReduceScatter => "tp_reduce_scatter",
            StepCollective::TpAllReduce => "tp_all_reduce",
            StepCollective::VocabCrossEntropy => "vocab_cross_entropy",
            StepCollective::VocabCrossEntropyGrad => "vocab_cross_entropy_grad",
            StepCollective::MoeGatherIds => "moe_gather_ids",
            StepCollective::MoeDispatch => "moe_dispatch",
            StepCollective::MoeCombine => "moe_combine",
            StepCollective::CpAllGather => "cp_all_gather",
            StepCollective::CpReduceScatter => "cp_reduce_scatter",
        }
    }

    /// The group it runs over: `tensor`, `expert` or `context`.
    pub fn axis(self) -> &'static str {
        if self.is_expert() {
            "expert"
        } else if self.is_context() {
            "context"
        } else {
            "tensor"
        }
    }

    /// Whether it runs over the context group.
    pub fn is_context(self) -> bool {
        matches!(self, StepCollective::CpAllGather | StepCollective::CpReduceScatter)
    }

    /// Whether it runs over the expert group (else the tensor group).
    pub fn is_expert(self) -> bool {
        matches!(
            self,
            StepCollective::MoeGatherIds | StepCollective::MoeDispatch | StepCollective::MoeCombine
        )
    }
}

impl std::fmt::Display for StepCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
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
    pub(crate) fn of(&self, s: StepId) -> &[ActEvent] {
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

/// `joint` segmented into steps for `groups` and the checkpointing policy `ac`, and the
/// activation events of each step. Attention's backward holds no
/// `[b, h, s, t]` probabilities either way (flash attention under PyTorch, see
/// [`ExecOrder::flash_attention`]; shardplan's blockwise kernel otherwise, see
/// [`ExecOrder::blockwise_attention`]). Under PyTorch's runners the cross-entropy's
/// backward holds one more tensor the size of the logits while it runs (eager's
/// `log_softmax` + `nll_loss`), and autograd's saved tensors count ([`Runner`]).
pub fn steps_and_events(
    joint: &JointGraph,
    groups: &[FsdpGroup],
    ac: ActivationCheckpointing,
    runner: Runner,
) -> (Vec<Step>, ActEvents) {
    steps_and_events_in(joint, groups, &ExecOrder::new(joint, ac, runner), runner)
}

/// What runs a rank's compute, for what it holds beside the graph's own values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runner {
    /// shardplan's executor (`kernels: fused`): every graph value as a tensor, except the
    /// attention backward's `[b, h, s, t]` placeholders (its blockwise kernel, see
    /// [`ExecOrder::blockwise_attention`]) and a cross-entropy gradient written over its
    /// logits ([`ExecOrder::in_place_cross_entropy`]), nothing more.
    Shardplan,
    /// PyTorch eager (`kernels: eager`): flash attention, eager cross-entropy, and what
    /// autograd saves beyond the graph's values (see [`Runner::saved_bytes`]): the model
    /// written as PyTorch ops, as the exported program and FSDP2 run it.
    Eager,
    /// PyTorch eager under autograd, as FSDP2 runs a plan (`runtime: fsdp2`): `Eager`, plus
    /// what the training loop holds that the graph does not name: token ids are int64
    /// tensors, and the loss the loop keeps lives through backward. With `compile`, the
    /// compiled blocks and loss hold what inductor's kernels and AOTAutograd's partitioner
    /// hold instead ([`crate::compiled`]).
    Fsdp2(shardplan_frontends::Compile),
}

impl Runner {
    /// What runs a parallel spec's compute.
    pub fn of(config: &shardplan_frontends::ParallelConfig) -> Self {
        match (config.runtime, config.hardware.kernels) {
            (shardplan_frontends::Runtime::Fsdp2, _) => Runner::Fsdp2(config.compile),
            (_, shardplan_frontends::KernelMode::Eager) => Runner::Eager,
            (_, shardplan_frontends::KernelMode::Fused) => Runner::Shardplan,
        }
    }

    /// Whether this is FSDP2's run (`runtime: fsdp2`), compiled or not.
    pub fn is_fsdp2(self) -> bool {
        matches!(self, Runner::Fsdp2(_))
    }

    /// What this run compiles (nothing but under `runtime: fsdp2` with `compile`).
    pub fn compile(self) -> shardplan_frontends::Compile {
        match self {
            Runner::Fsdp2(c) => c,
            _ => shardplan_frontends::Compile::default(),
        }
    }

    /// Bytes PyTorch's autograd saves for forward node `id` beyond the graph's values, as
    /// the exported program writes the op (`kernels: eager` and `runtime: fsdp2`; 0 for
    /// shardplan's own kernels and for ops that save only graph values). Saved until the
    /// backward of the op that saved them; an op of a recomputed (checkpointed) block
    /// saves them only in its recompute.
    pub fn saved_bytes(self, g: &shardplan_ir::Graph, id: NodeId) -> u64 {
        if self == Runner::Shardplan {
            return 0;
        }
        let node = g.node(id);
        let shape = &node.ty.shape;
        let numel = shape.numel().unwrap_or(0);
        let last = shape.dims().last().copied().unwrap_or(1).max(1);
        let rows = numel / last;
        let compiled = crate::compiled::compiled_block(g, node.scope, self.compile()).is_some();
        match node.op {
            // A compiled block's partitioner saves the norm's input (a graph value its
            // backward reads) and `rstd`, one f32 per row, and recomputes the rest.
            Op::RmsNorm { .. } | Op::LayerNorm { .. } if compiled => rows.saturating_mul(4),
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

/// [`steps_and_events`] in an execution order already made by
/// [`ExecOrder::new`] for the same graph, checkpointing and `runner` (it does not
/// depend on the groups, so a search makes one per policy).
pub(crate) fn steps_and_events_in(
    joint: &JointGraph,
    groups: &[FsdpGroup],
    exec: &ExecOrder,
    runner: Runner,
) -> (Vec<Step>, ActEvents) {
    walk(joint, groups, exec, runner, true)
}

/// The most activation bytes of any step [`steps_and_events_in`] makes: the same walk,
/// without the steps' labels, reads and activation events. It is the same for every
/// grouping (the running level follows the execution order; groups only cut it into
/// steps).
pub(crate) fn activation_peak_in(joint: &JointGraph, groups: &[FsdpGroup], exec: &ExecOrder, runner: Runner) -> u64 {
    let (steps, _) = walk(joint, groups, exec, runner, false);
    steps.iter().map(|s| s.act_peak).max().unwrap_or(0)
}
