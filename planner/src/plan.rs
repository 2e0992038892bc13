//! The Plan: the contract between planner and executor, as plain serde data.
//!
//! A rank runs a [`Program`]: one list of instructions in host issue order, each tagged with
//! the stream it runs on. The per-stream lists are that list filtered by stream; events
//! order streams against each other, and every wait names an event recorded earlier in issue
//! order. Buffers have explicit `alloc` / `free` instructions; compute and collectives name
//! the buffers they read and write, so the verifier can prove the schedule safe and the
//! executor never decides anything.

use crate::group::{FsdpGroup, GroupId};
use crate::layout::GroupLayout;
use crate::mesh::Mesh;
use crate::steps::{Step, StepId};
pub(crate) use crate::stream::Stream;
use serde::{Deserialize, Serialize};
use shardplan_frontends::{
    ActivationCheckpointing, AdamwImplementation, AllocatorConfig, GradSync, HardwareProfile, MixedPrecision, Offload,
    Prefetch, Reshard, Runtime, TensorParallel,
};
use shardplan_ir::{DType, ParamId};
use std::fmt;

/// Format version of [`Plan`]; bumped on every incompatible change (3: the all-to-all
/// stream, and expert-group collectives as steps of their own; 4: the policy holds each
/// decision once, in the spec's vocabulary: `reshard_after_forward` per group only, no
/// master dtype, explicit prefetch lists as maps of groups; FSDP2's hook model,
/// `fsdp2_hooks`).
pub const PLAN_VERSION: u32 = 4;

shardplan_ir::entity! {
    /// A buffer (printed `b7`).
    pub struct BufId("b");
}
shardplan_ir::entity! {
    /// An event between streams (printed `e3`).
    pub struct EventId("e");
}

/// The process group a collective runs on, relative to the issuing rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Comm {
    /// The rank's shard group (same replicate index).
    Shard,
    /// The rank's replicate group (same shard index): HSDP's gradient all-reduce.
    Replicate,
    /// The `n` consecutive ranks of its shard group that hold a post-forward shard.
    Reshard(u64),
    /// The rank's tensor-parallel group (same replicate and shard index): the gradient
    /// norm's sum over the parameters split across it. (Activation collectives run inside
    /// compute steps, as graph ops.)
    Tensor,
    /// The rank's expert-parallel group: the tokens' all-to-all (graph ops, each a step of
    /// its own on the all-to-all stream; inside compute steps under `runtime: fsdp2`).
    Expert,
    /// The ranks of its shard group that hold the same routed experts: FSDP's group for
    /// them.
    ExpertShard,
    /// The rank's context-parallel group (the ranks holding the other rows of its
    /// sequences): ring attention's keys and values (graph ops inside compute steps).
    Context,
}

impl Comm {
    /// Ranks in the group.
    pub fn size(self, mesh: &Mesh) -> u64 {
        match self {
            Comm::Shard => mesh.shard(),
            Comm::Replicate => mesh.replicate(),
            Comm::Reshard(n) => n,
            Comm::Tensor => mesh.tensor(),
            Comm::Expert => mesh.expert(),
            Comm::ExpertShard => mesh.expert_shard(),
            Comm::Context => mesh.context(),
        }
    }

    /// The members of `rank`'s group.
    pub fn members(self, mesh: &Mesh, rank: u64) -> Vec<u64> {
        match self {
            Comm::Shard => mesh.shard_group(rank),
            Comm::Replicate => mesh.replicate_group(rank),
            Comm::Reshard(n) => mesh.reshard_group(rank, n),
            Comm::Tensor => mesh.tensor_group(rank),
            Comm::Expert => mesh.expert_group(rank),
            Comm::Context => mesh.context_group(rank),
            Comm::ExpertShard => mesh.expert_shard_group(rank),
        }
    }
}

impl fmt::Display for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Comm::Shard => write!(f, "shard"),
            Comm::Replicate => write!(f, "replicate"),
            Comm::Reshard(n) => write!(f, "reshard{n}"),
            Comm::Tensor => write!(f, "tensor"),
            Comm::Expert => write!(f, "expert"),
            Comm::Context => write!(f, "context"),
            Comm::ExpertShard => write!(f, "expert-shard"),
        }
    }
}

/// Memory categories, as the issue of FSDP memory is usually told.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    ShardedParams,
    UnshardedParams,
    ShardedGrads,
    UnshardedGrads,
    OptimizerState,
    Activations,
    CommBuffers,
}

impl Category {
    pub const ALL: [Category; 7] = [
        Category::ShardedParams,
        Category::UnshardedParams,
        Category::ShardedGrads,
        Category::UnshardedGrads,
        Category::OptimizerState,
        Category::Activations,
        Category::CommBuffers,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Category::ShardedParams => "sharded params",
            Category::UnshardedParams => "unsharded params",
            Category::ShardedGrads => "sharded grads",
            Category::UnshardedGrads => "unsharded grads",
            Category::OptimizerState => "optimizer state",
            Category::Activations => "activations",
            Category::CommBuffers => "all-gather/reduce-scatter buffers",
        }
    }
}

/// Device memory or host (CPU) memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pool {
    Device,
    Host,
}

/// A buffer one rank allocates. Sizes are per rank and include padding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Buffer {
    pub id: BufId,
    /// `g3.unsharded.fwd.mb0`-style name for printing.
    pub name: String,
    pub category: Category,
    pub group: Option<GroupId>,
    pub dtype: DType,
    pub numel: u64,
    pub pool: Pool,
    /// Lives across steps: allocated before the first instruction, never freed (sharded
    /// parameters, optimizer state). Its contents are written before the step and read after.
    pub persistent: bool,
    /// A gradient piece (category unsharded grads): the parameters whose full, unpadded
    /// gradients it holds one after another, in this order — those of its group that one
    /// compute step makes. Empty for every other buffer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub params: Vec<ParamId>,
}

impl Buffer {
    pub fn bytes(&self) -> u64 {
        self.numel.saturating_mul(self.dtype.size_bytes())
    }
}

/// How a reduction combines ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the group size.
    Avg,
    /// Sum divided by `ranks`: the routed experts' gradients, which sum the tokens of
    /// every rank of the expert group already, reduced over the ranks holding the same
    /// experts but averaged over the whole shard axis (torchtitan's gradient divide
    /// factor for expert FSDP).
    AvgOver(u64),
}

/// The buffers a compute step reads or writes: one or two groups' as a rule, held inline
/// (a search builds hundreds of schedules of thousands of steps). Serialised as a list.
pub(crate) type Bufs = smallvec::SmallVec<[BufId; 2]>;

/// One instruction. Each kind is one small function in the executor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Instr {
    /// Run a segment of the joint graph on micro-batch `micro`: reads the unsharded
    /// parameters in `reads`, accumulates the parameter gradients it makes into `writes`
    /// (one gradient piece per group of the step's `grads`, in that order).
    Compute {
        step: StepId,
        micro: u32,
        reads: Bufs,
        writes: Bufs,
    },
    Alloc {
        buf: BufId,
    },
    Free {
        buf: BufId,
    },
    /// Mark this point of the stream.
    Record {
        event: EventId,
    },
    /// Block the stream until the event's point is passed.
    Wait {
        event: EventId,
    },
    /// All-gather `src` (cast to `dst`'s dtype) over `comm` into `dst` (the group's flat
    /// unsharded buffer). The input is copied into this rank's slice of `dst`, as FSDP2's
    /// copy-in does, so it takes no buffer of its own.
    AllGather {
        group: GroupId,
        comm: Comm,
        src: BufId,
        dst: BufId,
    },
    /// Lay the gradient pieces `srcs` out in `dst` (cast to its dtype): the group's
    /// all-gather layout, rank-major padded shards, padding and missing parameters zero.
    /// The reduce-scatter's input, made on the compute stream so the pieces can be freed
    /// right after it (FSDP2's reduce-scatter copy-in).
    PackGrads {
        group: GroupId,
        srcs: Vec<BufId>,
        dst: BufId,
    },
    /// Reduce-scatter `src` (a packed gradient buffer) over `comm` and add this rank's
    /// shard into `dst`.
    ReduceScatter {
        group: GroupId,
        comm: Comm,
        op: ReduceOp,
        src: BufId,
        dst: BufId,
    },
    /// All-reduce `buf` in place over `comm`.
    AllReduce {
        group: Option<GroupId>,
        comm: Comm,
        op: ReduceOp,
        buf: BufId,
    },
    /// Copy `src` into `dst` (host <-> device, or a dtype cast); `accumulate` adds instead
    /// of overwriting.
    Copy {
        src: BufId,
        dst: BufId,
        accumulate: bool,
    },
    /// After a group's last forward read (`reshard_after_forward: N`): this rank's slice of
    /// the gathered parameters `src` among `ranks` consecutive shard ranks, into `dst`,
    /// which backward's all-gather over those ranks reads.
    PostForwardSlice {
        src: BufId,
        dst: BufId,
        ranks: u64,
    },
    /// Sum of squares of the sharded gradients in `grads` into `dst` (a partial norm).
    GradNorm {
        grads: Vec<BufId>,
        dst: BufId,
    },
    /// Optimizer step of one group on its shards: clip by `norm` (if any), update `params`
    /// and `state` from `grads`.
    OptimizerStep {
        group: GroupId,
        params: BufId,
        state: Option<BufId>,
        grads: BufId,
        norm: Option<BufId>,
    },
}

/// How an instruction touches a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

impl Instr {
    /// The buffers it reads and writes, reads first.
    pub fn accesses(&self) -> Vec<(BufId, Access)> {
        use Access::*;
        match self {
            Instr::Compute { reads, writes, .. } => reads
                .iter()
                .map(|&b| (b, Read))
                .chain(writes.iter().map(|&b| (b, Write)))
                .collect(),
            Instr::Alloc { .. } | Instr::Free { .. } | Instr::Record { .. } | Instr::Wait { .. } => Vec::new(),
            Instr::AllGather { src, dst, .. } | Instr::ReduceScatter { src, dst, .. } => {
                vec![(*src, Read), (*dst, Write)]
            }
            Instr::PackGrads { srcs, dst, .. } => srcs
                .iter()
                .map(|&b| (b, Read))
                .chain(std::iter::once((*dst, Write)))
                .collect(),
            Instr::AllReduce { buf, .. } => vec![(*buf, Read), (*buf, Write)],
            Instr::Copy { src, dst, .. } | Instr::PostForwardSlice { src, dst, .. } => {
                vec![(*src, Read), (*dst, Write)]
            }
            Instr::GradNorm { grads, dst } => grads
                .iter()
                .map(|&b| (b, Read))
                .chain(std::iter::once((*dst, Write)))
                .collect(),
            Instr::OptimizerStep {
                params,
                state,
                grads,
                norm,
                ..
            } => {
                let mut v = vec![(*grads, Read), (*params, Read)];
                v.extend(norm.map(|n| (n, Read)));
                v.extend(state.map(|s| (s, Read)));
                v.push((*params, Write));
                v.extend(state.map(|s| (s, Write)));
                v
            }
        }
    }

    /// True for instructions that talk to other ranks.
    pub fn collective(&self) -> Option<(Comm, &'static str, Option<GroupId>)> {
        match self {
            Instr::AllGather { comm, group, .. } => Some((*comm, "all-gather", Some(*group))),
            Instr::ReduceScatter { comm, group, .. } => Some((*comm, "reduce-scatter", Some(*group))),
            Instr::AllReduce { comm, group, .. } => Some((*comm, "all-reduce", *group)),
            _ => None,
        }
    }
}

/// An instruction in issue order, with its stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Issued {
    pub stream: Stream,
    #[serde(flatten)]
    pub instr: Instr,
}

/// What one rank runs per optimizer step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Program {
    pub instrs: Vec<Issued>,
}

impl Program {
    /// The (process group, stream) pairs it issues collectives on, sorted: a communicator
    /// each, as the executor's NCCL backend makes them.
    pub fn communicators(&self) -> Vec<(Comm, Stream)> {
        let mut out: Vec<(Comm, Stream)> = self
            .instrs
            .iter()
            .filter_map(|x| x.instr.collective().map(|(c, _, _)| (c, x.stream)))
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// Ranks `first .. first + count` run `programs[program]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankSpan {
    pub first: u64,
    pub count: u64,
    pub program: u32,
}

/// A group, its layout and where its state lives.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannedGroup {
    #[serde(flatten)]
    pub group: FsdpGroup,
    /// HF names of its parameters, in `group.params` order.
    pub param_names: Vec<std::sync::Arc<str>>,
    pub layout: GroupLayout,
    /// What happens to its unsharded parameters after forward: the spec's
    /// `reshard_after_forward` as it applies to the group (the root keeps them).
    pub reshard: Reshard,
}

impl PlannedGroup {
    /// The layout pass for one group: `grp` laid out over its shard group of `mesh`, with
    /// the plan's resharding `reshard` as it applies to the group.
    pub(crate) fn laid_out(
        g: &shardplan_ir::Graph,
        grp: FsdpGroup,
        mesh: &Mesh,
        reshard: Reshard,
        names: crate::layout::Names,
    ) -> Self {
        let layout = crate::layout::layout(g, &grp, mesh.shard_of(&grp));
        let reshard = match reshard {
            _ if grp.is_root() => Reshard::Keep,
            // A slice of the shard group is not a slice of the expert-shard group: the
            // routed experts are freed after forward instead.
            Reshard::ToGroupOf(_) if grp.experts => Reshard::AfterForward,
            r => r,
        };
        PlannedGroup {
            param_names: if names.kept() {
                grp.params.iter().map(|&p| g.param(p).name.clone()).collect()
            } else {
                Vec::new()
            },
            group: grp,
            layout,
            reshard,
        }
    }
}

/// The knobs a plan was made with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    pub wrap: Vec<String>,
    pub wrap_modules: Vec<String>,
    pub bucket_mib: Option<u64>,
    /// The prefetch depths, and the explicit lists resolved to groups.
    pub prefetch: Prefetch<GroupId>,
    pub mixed_precision: MixedPrecision,
    pub offload: Offload,
    pub activation_checkpointing: ActivationCheckpointing,
    pub batch_per_rank: u64,
    pub seq_len: u64,
    pub grad_accum: u64,
    pub grad_sync: GradSync,
    /// Optimizer state elements (f32) per parameter element.
    pub optimizer_state_per_param: u64,
    pub optimizer: OptimizerKind,
    /// AdamW's implementation in a PyTorch run: under `runtime: fsdp2`, `foreach` holds a
    /// temporary the size of each parameter shard through the optimizer step (`gN.optim.tmp`).
    /// `fused` (and absent from the JSON) under `runtime: shardplan`, and for plans written
    /// before the field, which modelled no temporaries.
    #[serde(default, skip_serializing_if = "AdamwImplementation::is_fused")]
    pub adamw_implementation: AdamwImplementation,
    pub grad_clip: Option<f64>,
    /// Whose run the schedule models: shardplan's executor, or PyTorch FSDP2's buffers and
    /// hooks (`runtime: fsdp2`; see `schedule`). Absent from the JSON for `shardplan`.
    #[serde(default, skip_serializing_if = "Runtime::is_shardplan")]
    pub runtime: Runtime,
    /// The caching allocator's settings the reserved peak was replayed under. A plan file
    /// written before the field existed was replayed without expandable segments.
    #[serde(default = "cuda_malloc")]
    pub allocator: AllocatorConfig,
    /// Tensor parallelism's options, when the mesh has a tensor axis; absent from the JSON
    /// when default.
    #[serde(default, skip_serializing_if = "TensorParallel::is_default")]
    pub tensor_parallel: TensorParallel,
    /// Context parallelism's options, when the mesh has a context axis; absent from the
    /// JSON when default.
    #[serde(default, skip_serializing_if = "shardplan_frontends::ContextParallel::is_default")]
    pub context_parallel: shardplan_frontends::ContextParallel,
}

fn cuda_malloc() -> AllocatorConfig {
    AllocatorConfig::CUDA_MALLOC
}

/// One all-gather the peak-aware prefetch issued later than the depths put it: group
/// `group`'s gather for its read at step `need` now starts with step `to` instead of
/// `from`, which took the step's allocated peak from `peak_before` to `peak_after` bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefetchMove {
    pub group: GroupId,
    pub need: StepId,
    pub from: StepId,
    pub to: StepId,
    pub peak_before: u64,
    pub peak_after: u64,
}

/// FSDP2's hook model of a plan's program: the groups whose all-gathers each group's
/// module issues from its pre-forward and pre-backward hooks
/// (`set_modules_to_forward_prefetch`, `set_modules_to_backward_prefetch`), in the order
/// FSDP2 is told them. A group's own unshard is its hook's and is in no list.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fsdp2Hooks {
    /// Per group whose pre-forward prefetches, by group: the groups it gathers, in issue
    /// order.
    pub forward: Vec<(GroupId, Vec<GroupId>)>,
    /// The same for the pre-backward hooks, then every other group whose pre-backward
    /// fires listing itself alone: a no-op list, without which FSDP2 would prefetch the
    /// next module on its own, earlier than planned.
    pub backward: Vec<(GroupId, Vec<GroupId>)>,
}

/// Whether FSDP2's hooks can issue a plan's program, and with which prefetch lists.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HookModel {
    /// The program is what these hooks issue.
    Hooks(Fsdp2Hooks),
    /// No hooks issue this program: the first reason, in issue order.
    Refused(HookRefusal),
}

/// Why FSDP2's hooks cannot issue a program. `program` and `instr` index `programs` and
/// its `instrs`; `group` is the gathered group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HookRefusal {
    /// An all-gather no compute instruction reads.
    NeverRead {
        program: usize,
        instr: usize,
        group: GroupId,
    },
    /// An all-gather that waits for no compute step.
    Ungated {
        program: usize,
        instr: usize,
        group: GroupId,
    },
    /// An all-gather read at step `read` but issued in another pass or micro-batch, at
    /// step `at`.
    OtherPass {
        program: usize,
        instr: usize,
        group: GroupId,
        read: StepId,
        at: StepId,
    },
    /// An all-gather issued at step `at`, inside the pass of group `inside`'s module but
    /// where none of the hooks fire.
    MidModule {
        program: usize,
        instr: usize,
        group: GroupId,
        at: StepId,
        inside: GroupId,
    },
    /// The micro-batches of the step prefetch differently (FSDP2's lists are set once).
    MicroBatches { program: usize },
    /// Two ranks' programs prefetch differently.
    Ranks { program: usize },
    /// An edited program issues a reduce-scatter, all-reduce or copy at another point than
    /// the planned one, where FSDP2's post-backward hooks issue it.
    Moved { program: usize },
}

/// The optimizer a plan steps with; its state per parameter element is
/// [`Policy::optimizer_state_per_param`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    Adamw,
    Sgd,
}

impl OptimizerKind {
    /// The kind of a spec's optimizer.
    pub fn of(o: &shardplan_frontends::Optimizer) -> Self {
        match o {
            shardplan_frontends::Optimizer::AdamW { .. } => OptimizerKind::Adamw,
            shardplan_frontends::Optimizer::Sgd { .. } => OptimizerKind::Sgd,
        }
    }

    /// Its name, as the plan's JSON and checkpoints write it.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::Adamw => "adamw",
            OptimizerKind::Sgd => "sgd",
        }
    }
}

impl fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Per-category bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ByCategory {
    pub sharded_params: u64,
    pub unsharded_params: u64,
    pub sharded_grads: u64,
    pub unsharded_grads: u64,
    pub optimizer_state: u64,
    pub activations: u64,
    pub comm_buffers: u64,
}

impl ByCategory {
    pub fn get(&self, c: Category) -> u64 {
        match c {
            Category::ShardedParams => self.sharded_params,
            Category::UnshardedParams => self.unsharded_params,
            Category::ShardedGrads => self.sharded_grads,
            Category::UnshardedGrads => self.unsharded_grads,
            Category::OptimizerState => self.optimizer_state,
            Category::Activations => self.activations,
            Category::CommBuffers => self.comm_buffers,
        }
    }

    pub fn slot(&mut self, c: Category) -> &mut u64 {
        match c {
            Category::ShardedParams => &mut self.sharded_params,
            Category::UnshardedParams => &mut self.unsharded_params,
            Category::ShardedGrads => &mut self.sharded_grads,
            Category::UnshardedGrads => &mut self.unsharded_grads,
            Category::OptimizerState => &mut self.optimizer_state,
            Category::Activations => &mut self.activations,
            Category::CommBuffers => &mut self.comm_buffers,
        }
    }

    pub fn total(&self) -> u64 {
        Category::ALL.iter().map(|&c| self.get(c)).fold(0, u64::saturating_add)
    }
}

/// One point of the memory timeline (device pool).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemorySample {
    /// Simulated time, seconds from the start of the step.
    pub t: f64,
    /// Instruction (issue index) that changed the level.
    pub instr: u32,
    pub total: u64,
}

/// Simulated memory of one rank (every rank of a plan is alike: shards are padded).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryReport {
    /// Device bytes at the peak, by category.
    pub at_peak: ByCategory,
    pub peak: u64,
    /// Issue index of the instruction at which the peak is reached.
    pub peak_instr: u32,
    /// Highest bytes each category reaches on its own.
    pub max_by_category: ByCategory,
    /// Host bytes (CPU offload), by category, at their peak.
    pub host: ByCategory,
    pub timeline: Vec<MemorySample>,
    /// Peak of the caching allocator's allocated blocks: `peak`'s allocations rounded to
    /// blocks, with the remainders too small to split (PyTorch's `max_memory_allocated`).
    #[serde(default)]
    pub active_peak: u64,
    /// Most bytes PyTorch's caching allocator holds from the device over the step (its
    /// `max_memory_reserved`): `peak`'s allocations and frees replayed through the model of
    /// [`crate::allocator`], fragmentation included.
    #[serde(default)]
    pub reserved_peak: u64,
    /// Device memory a rank's process holds outside the allocator.
    #[serde(default)]
    pub overhead: Overhead,
    /// `reserved_peak` plus the overhead: what must fit in the device's memory.
    #[serde(default)]
    pub device_total: u64,
    /// shardplan's executor's arena: the plan's device buffers at fixed offsets of one
    /// allocation ([`crate::arena`]). Absent for another runtime's plan and for a forward
    /// program.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arena: Option<ArenaReport>,
}

/// The arena summary of a plan ([`crate::arena`]), per rank: program 0's arena, as the
/// memory report is program 0's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArenaReport {
    pub bytes: u64,
    pub peak: u64,
    pub buffers: u64,
    /// Orderings it adds to the plan's events (`Arena::waits`).
    pub waits: u64,
}

/// Device memory outside the caching allocator, per process (one rank).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Overhead {
    /// The CUDA context (the hardware profile's `cuda_context_mib`).
    pub cuda_context: u64,
    /// NCCL's buffers: `communicators` x the profile's channels x bytes per channel.
    pub nccl: u64,
    /// NCCL communicators of more than one rank the process joins: one per (process group,
    /// stream) its program issues collectives on ([`Program::communicators`]).
    pub communicators: u32,
}

impl Overhead {
    pub fn total(&self) -> u64 {
        self.cuda_context.saturating_add(self.nccl)
    }
}

/// Start and end of each instruction in the simulated timeline, seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    pub start: Vec<f64>,
    pub end: Vec<f64>,
}

/// Predicted speed of one optimizer step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    pub step_s: f64,
    /// Time the compute stream spends computing.
    pub compute_s: f64,
    /// Time the compute stream waits on other streams.
    pub exposed_comm_s: f64,
    /// Model FLOPs per step per rank (6N-style, recompute not counted) over peak x time.
    pub mfu: f64,
    pub model_flops_per_rank: f64,
    pub tokens_per_s: f64,
    /// Bytes each rank sends/receives through collectives per step, by kind.
    pub all_gather_bytes: u64,
    pub reduce_scatter_bytes: u64,
    pub all_reduce_bytes: u64,
    pub collectives: u64,
    /// Where `compute_s` goes, by kind of work; its parts sum to `compute_s`, and with
    /// `exposed_comm_s` and `step_overhead_s` to `step_s`.
    #[serde(default)]
    pub breakdown: Breakdown,
    /// Time before the first instruction of a step runs (`step_overhead_us`).
    #[serde(default)]
    pub step_overhead_s: f64,
}

/// The kinds of work the cost model times on the compute stream, in [`Breakdown`]'s order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkKind {
    /// Linear layers, their input and weight gradients, batched matmuls.
    Matmul,
    /// Flash attention, forward and backward.
    Attention,
    /// RMSNorm and LayerNorm, forward and backward.
    Norm,
    /// Adds, multiplies, activations, softmax and their gradients.
    Elementwise,
    /// Rotary embeddings, forward and backward.
    Rotary,
    /// The embedding lookup and its gradient.
    Embedding,
    /// The loss and its gradient.
    CrossEntropy,
    /// Casts, transposes, concatenations, narrows, pads, fills and reductions.
    Layout,
    /// Kernel launches the work does not hide (eager: an op shorter than its launches;
    /// fused: every launch, and the thread pool's start).
    Launch,
    /// FSDP's copies on the compute stream: all-gather copy-out, gradient packing
    /// (reduce-scatter copy-in), the executor's gradient and parameter copies.
    FsdpCopies,
    /// The gradient norm and the optimizer step.
    Optimizer,
    /// Compute slowed by collectives running beside it (`overlap_slowdown`).
    Overlap,
    /// Tensor parallelism's activation collectives, which run on the compute stream
    /// between the ops that need them.
    TensorComm,
    /// Expert parallelism's all-to-all (and routing-table gather), on the compute stream
    /// between the router and the experts and after them.
    ExpertComm,
    /// Context parallelism's ring: keys and values gathered, their gradients reduced.
    ContextComm,
    /// PyTorch FSDP2's host time per FSDP unit that the GPU waits for (`runtime: fsdp2`,
    /// `fsdp2_unit_host_us`): its hooks in Python and its ops' autograd bookkeeping.
    Hooks,
    /// Float8 linears' scaling and casts (torchao's amax, scale and cast of each operand;
    /// one fused kernel each under `compile`).
    Float8Casts,
}

impl WorkKind {
    pub const ALL: [WorkKind; 17] = [
        WorkKind::Matmul,
        WorkKind::Attention,
        WorkKind::Norm,
        WorkKind::Elementwise,
        WorkKind::Rotary,
        WorkKind::Embedding,
        WorkKind::CrossEntropy,
        WorkKind::Layout,
        WorkKind::Launch,
        WorkKind::FsdpCopies,
        WorkKind::Optimizer,
        WorkKind::Overlap,
        WorkKind::TensorComm,
        WorkKind::ExpertComm,
        WorkKind::ContextComm,
        WorkKind::Hooks,
        WorkKind::Float8Casts,
    ];

    pub fn name(self) -> &'static str {
        match self {
            WorkKind::Matmul => "matmul",
            WorkKind::Attention => "attention",
            WorkKind::Norm => "norms",
            WorkKind::Elementwise => "elementwise",
            WorkKind::Rotary => "rotary",
            WorkKind::Embedding => "embedding",
            WorkKind::CrossEntropy => "cross-entropy",
            WorkKind::Layout => "casts/layout",
            WorkKind::Launch => "launch",
            WorkKind::FsdpCopies => "fsdp copies",
            WorkKind::Optimizer => "optimizer",
            WorkKind::Overlap => "overlap slowdown",
            WorkKind::TensorComm => "tensor collectives",
            WorkKind::ExpertComm => "expert all-to-all",
            WorkKind::ContextComm => "context ring",
            WorkKind::Hooks => "fsdp2 host (hooks)",
            WorkKind::Float8Casts => "float8 casts",
        }
    }
}

/// Seconds of the compute stream by [`WorkKind`], from the cost model's per-op figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Breakdown {
    pub matmul_s: f64,
    pub attention_s: f64,
    pub norm_s: f64,
    pub elementwise_s: f64,
    pub rotary_s: f64,
    pub embedding_s: f64,
    pub cross_entropy_s: f64,
    pub layout_s: f64,
    pub launch_s: f64,
    pub fsdp_copies_s: f64,
    pub optimizer_s: f64,
    pub overlap_s: f64,
    /// Absent from the JSON without tensor parallelism.
    #[serde(skip_serializing_if = "is_zero")]
    pub tensor_comm_s: f64,
    /// Absent from the JSON without expert parallelism.
    #[serde(skip_serializing_if = "is_zero")]
    pub expert_comm_s: f64,
    /// Absent from the JSON without context parallelism.
    #[serde(skip_serializing_if = "is_zero")]
    pub context_comm_s: f64,
    /// Absent from the JSON outside `runtime: fsdp2`.
    #[serde(skip_serializing_if = "is_zero")]
    pub hooks_s: f64,
    /// Absent from the JSON without Float8 linears.
    #[serde(skip_serializing_if = "is_zero")]
    pub float8_casts_s: f64,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

impl Breakdown {
    /// The seconds of `kind`.
    pub fn get(&self, kind: WorkKind) -> f64 {
        let mut b = *self;
        *b.slot(kind)
    }

    /// Adds `s` seconds to `kind`.
    pub fn add(&mut self, kind: WorkKind, s: f64) {
        *self.slot(kind) += s;
    }

    /// Adds every part of `other`, `times` over.
    pub(crate) fn add_all(&mut self, other: &Breakdown, times: f64) {
        for k in WorkKind::ALL {
            self.add(k, other.get(k) * times);
        }
    }

    /// The sum of the parts.
    pub fn total(&self) -> f64 {
        WorkKind::ALL.iter().map(|&k| self.get(k)).sum()
    }

    fn slot(&mut self, kind: WorkKind) -> &mut f64 {
        match kind {
            WorkKind::Matmul => &mut self.matmul_s,
            WorkKind::Attention => &mut self.attention_s,
            WorkKind::Norm => &mut self.norm_s,
            WorkKind::Elementwise => &mut self.elementwise_s,
            WorkKind::Rotary => &mut self.rotary_s,
            WorkKind::Embedding => &mut self.embedding_s,
            WorkKind::CrossEntropy => &mut self.cross_entropy_s,
            WorkKind::Layout => &mut self.layout_s,
            WorkKind::Launch => &mut self.launch_s,
            WorkKind::FsdpCopies => &mut self.fsdp_copies_s,
            WorkKind::Optimizer => &mut self.optimizer_s,
            WorkKind::Overlap => &mut self.overlap_s,
            WorkKind::TensorComm => &mut self.tensor_comm_s,
            WorkKind::ExpertComm => &mut self.expert_comm_s,
            WorkKind::ContextComm => &mut self.context_comm_s,
            WorkKind::Hooks => &mut self.hooks_s,
            WorkKind::Float8Casts => &mut self.float8_casts_s,
        }
    }
}

/// The specs a plan was made from, so `shardplan train --plan` can run it alone.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanSource {
    pub model: shardplan_models::ModelConfig,
    pub parallel: shardplan_frontends::ParallelConfig,
}

/// The headline prediction of one runtime's run of a spec: what `shardplan plan` prints
/// for shardplan's own executor beside a `runtime: fsdp2` plan's FSDP2 prediction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RuntimePrediction {
    pub runtime: Runtime,
    pub kernels: shardplan_frontends::KernelMode,
    /// Allocated peak per rank ([`MemoryReport::peak`]).
    pub peak: u64,
    /// The caching allocator's reserved peak per rank.
    pub reserved_peak: u64,
    /// Reserved peak plus the CUDA context and NCCL's buffers.
    pub device_total: u64,
    pub step_s: f64,
    pub tokens_per_s: f64,
}

impl RuntimePrediction {
    /// The headline figures of `plan`.
    pub fn of(plan: &Plan) -> Self {
        RuntimePrediction {
            runtime: plan.policy.runtime,
            kernels: plan.hardware.kernels,
            peak: plan.memory.peak,
            reserved_peak: plan.memory.reserved_peak,
            device_total: plan.memory.device_total,
            step_s: plan.estimate.step_s,
            tokens_per_s: plan.estimate.tokens_per_s,
        }
    }
}

/// What expert parallelism's data-dependent routing means for a plan: every MoE layer's
/// received rows are bounded by `moe.capacity` over the even split, and the buffers are
/// sized at the bound (a batch that routes more fails at run time, naming the count). With
/// token dropping (`moe.capacity_factor`, with or without expert parallelism) each expert
/// keeps at most `per_expert` of a rank's assignments and every shape is exact.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertRouting {
    /// Routed experts per MoE layer, and those each rank holds.
    pub experts: u64,
    pub per_rank: u64,
    /// `moe.capacity`.
    pub capacity: f64,
    /// Rows one rank's experts receive per MoE layer at most (the bound) and at the even
    /// split (`tokens x top_k` per rank).
    pub rows: u64,
    pub even_rows: u64,
    /// The plan's memory with every layer routed evenly (planned again at capacity 1),
    /// when the caller planned it: allocated peak, reserved peak, device total.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub even: Option<[u64; 3]>,
    /// `moe.capacity_factor`, and the assignments each expert keeps of a rank's per MoE
    /// layer, when tokens are dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_factor: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_expert: Option<u64>,
}

/// A complete plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub version: u32,
    /// The model and parallel specs, when the plan was made from them (the CLI records
    /// them; `plan()` alone does not know the model's config).
    pub source: Option<PlanSource>,
    pub model: String,
    pub params: u64,
    pub mesh: Mesh,
    pub hardware: HardwareProfile,
    pub policy: Policy,
    pub groups: Vec<PlannedGroup>,
    pub steps: Vec<Step>,
    pub buffers: Vec<Buffer>,
    pub events: u32,
    pub programs: Vec<Program>,
    pub ranks: Vec<RankSpan>,
    pub timing: Timing,
    pub memory: MemoryReport,
    pub estimate: Estimate,
    /// For a plan of another runtime (`runtime: fsdp2`): shardplan's own executor's
    /// prediction for the same spec (`kernels: fused`, its own schedule). Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shardplan_executor: Option<RuntimePrediction>,
    /// Expert parallelism's routing bound; absent without an expert axis.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertRouting>,
    /// The all-gathers `prefetch: auto` moved, in the order it moved them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefetch_moves: Vec<PrefetchMove>,
    /// FSDP2's hooks for the program (what `export fsdp2` writes), or why none can issue
    /// it; derived from the program by `hooks.rs`. `None` only in the auto search's
    /// candidates, which are never written.
    pub fsdp2_hooks: Option<HookModel>,
    /// The Float8 linears and those left in high precision; absent without `float8`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub float8: Option<Float8Report>,
}

/// What `float8` made of the model's linear layers (torchao's choice, as the tracer made
/// it): the Float8 ones by Hugging Face module path, and the rest with why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Float8Report {
    pub recipe: shardplan_ir::Float8Recipe,
    pub fsdp_float8_all_gather: bool,
    pub precompute_scale: bool,
    pub linears: Vec<String>,
    /// `(module, reason)`.
    pub high_precision: Vec<(String, String)>,
}

impl Float8Report {
    /// The report of the forward graph `g` under `f`.
    pub fn of(g: &shardplan_ir::Graph, f: &shardplan_frontends::Float8) -> Self {
        let (_, chosen) = shardplan_models::float8::classify(g, &f.options());
        Float8Report {
            recipe: f.recipe,
            fsdp_float8_all_gather: f.fsdp_float8_all_gather,
            precompute_scale: f.precompute_scale,
            linears: chosen.converted,
            high_precision: chosen.skipped.into_iter().map(|s| (s.module, s.reason)).collect(),
        }
    }
}

impl Plan {
    /// `reshard_after_forward` as the plan's groups apply it: a dense group's (the routed
    /// experts free what a dense group keeps a slice of; the root keeps its parameters).
    pub fn reshard_after_forward(&self) -> Reshard {
        let wrapped = || self.groups.iter().filter(|p| !p.group.is_root());
        wrapped()
            .find(|p| !p.group.experts)
            .or_else(|| wrapped().next())
            .map_or(Reshard::Keep, |p| p.reshard)
    }

    /// The program rank `rank` runs.
    pub(crate) fn program_of(&self, rank: u64) -> Option<&Program> {
        self.ranks
            .iter()
            .find(|s| rank >= s.first && rank - s.first < s.count)
            .and_then(|s| self.programs.get(s.program as usize))
    }

    pub fn buffer(&self, b: BufId) -> &Buffer {
        &self.buffers[b.index()]
    }

    /// The persistent buffer of group `g` in category `c` (its sharded parameters, its
    /// optimizer state), if the plan keeps one.
    pub fn persistent_buffer(&self, g: usize, c: Category) -> Option<&Buffer> {
        self.buffers
            .iter()
            .find(|b| b.persistent && b.category == c && b.group.map(|x| x.index()) == Some(g))
    }

    pub fn step(&self, s: StepId) -> &Step {
        &self.steps[s.index()]
    }
}
