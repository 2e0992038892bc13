//! The schedule: one rank's instructions for one optimizer step, in issue order.
//!
//! Per micro-batch, walking the compute steps in order ([`walk`]):
//! - a group is all-gathered before the first step that reads it while it is sharded; the
//!   all-gather is issued when the compute stream starts the step that needs the group
//!   `depth` gathers earlier (FSDP2's prefetch; depth 0 waits for the step itself;
//!   [`gates`]);
//! - after its last forward read a group is freed (`reshard_after_forward: true`), kept
//!   (`false`; the root group always), or sliced to a post-forward shard (`N`); after its
//!   last read it is freed;
//! - after the step that last writes a group's gradients it is reduce-scattered (every
//!   micro-batch, or only the last, by `grad_sync`), all-reduced over replicas once per step
//!   (HSDP), and under CPU offload copied to the host;
//! - at the end: the gradient norm (partial sums all-reduced over the shard group) and the
//!   optimizer step of each group on its shards ([`optimizer`]).
//!
//! Two runtimes hold these decisions in memory differently, each a [`Lowering`]:
//! shardplan's executor ([`own`]) and PyTorch FSDP2's hooks ([`fsdp2`], `runtime:
//! fsdp2`). The walk and the decisions are shared; neither lowering knows the other.

mod builder;
mod fsdp2;
mod gates;
mod optimizer;
mod own;
mod walk;

pub use gates::hook_group;
pub(crate) use gates::{gates, Gate};

use crate::group::GroupId;
use crate::mesh::Mesh;
use crate::plan::{BufId, Buffer, PlannedGroup, Policy, Pool, Program};
use crate::steps::{Phase, Step};
use builder::Builder;
use shardplan_frontends::Runtime;

/// Buffers, event count and program of one rank.
pub(crate) struct Schedule {
    pub buffers: Vec<Buffer>,
    pub events: u32,
    pub program: Program,
}

/// How one runtime holds the schedule's decisions in buffers and instructions.
pub(crate) trait Lowering {
    /// Whether a step's gates that prefetch later steps' groups go out only after the step's
    /// own groups are waited for (FSDP2's pre-hook), where otherwise all go out before it.
    const PREFETCH_AFTER_READS: bool;
    /// Whether a group's unsharded parameters outlive their last read until the step that
    /// finishes its gradients (FSDP2's post-backward reshards it).
    const HOLDS_TO_POST_BACKWARD: bool;

    /// Persistent buffers group `g` (of `params` parameters) keeps beside its sharded
    /// parameters and optimizer state, in `pool`.
    fn group_state(&mut self, _b: &mut Builder, _g: GroupId, _params: u64, _pool: Pool) {}

    /// Whether `g`'s all-gather, a collective over a group of one rank, is not made at all:
    /// the compute stream's first read then gets the sharded parameters themselves.
    fn skips_gather(&self, _b: &Builder, _g: GroupId) -> bool {
        false
    }

    /// The buffer an all-gather of `g` writes (`tag`: its pass and micro-batch).
    fn gather_output(&mut self, b: &mut Builder, g: GroupId, tag: &str) -> BufId;

    /// A copy of `src` the all-gather of `g` reads instead, issued on the all-gather
    /// stream and freed once the collective has it; `None` to read `src`.
    fn gather_input(&mut self, _b: &mut Builder, _g: GroupId, _src: BufId, _tag: &str) -> Option<BufId> {
        None
    }

    /// Where the compute stream first reads `g`'s gathered `flat`, having waited for it:
    /// the buffer the group's steps read.
    fn first_read(&mut self, b: &mut Builder, g: GroupId, flat: BufId, micro: u32, phase: Phase) -> BufId;

    /// After the last forward step.
    fn after_last_forward(&mut self, _b: &mut Builder) {}

    /// Before a group's gradient pieces are packed for its reduce-scatter.
    fn before_pack(&mut self, _b: &mut Builder) {}

    /// The reduce-scatter of `g`'s packed gradients `packed` into its sharded gradients,
    /// and on the last micro-batch ([`Builder::finish_grads`]) what follows it.
    fn reduce_scatter(&mut self, b: &mut Builder, g: GroupId, micro: u32, last_micro: bool, packed: BufId);

    /// At the end of each micro-batch.
    fn end_of_backward(&mut self, _b: &mut Builder) {}

    /// Temporaries the optimizer step of `groups` holds until it ends, allocated before it.
    fn optimizer_temporaries(&mut self, _b: &mut Builder, _groups: &[GroupId]) -> Vec<BufId> {
        Vec::new()
    }
}

/// The schedule of one rank with its all-gathers issued at `gates` (one per gather of a
/// micro-batch, as [`gates`] lists them, with any `at` in `..=need`), lowered for the
/// policy's runtime. `named: false` leaves every buffer's name empty (a schedule that is
/// simulated, never printed).
pub(crate) fn schedule_gated(
    steps: &[Step],
    groups: &[PlannedGroup],
    policy: &Policy,
    mesh: &Mesh,
    gates: &[Gate],
    named: bool,
) -> Schedule {
    let b = Builder::new(groups, policy, mesh, steps.len(), named);
    match policy.runtime {
        Runtime::Shardplan => lower(b, steps, gates, &mut own::Own),
        Runtime::Fsdp2 => lower(b, steps, gates, &mut fsdp2::Fsdp2::default()),
    }
}

/// Every micro-batch's walk and the step's end, held in memory as `lowering` does.
fn lower(mut b: Builder, steps: &[Step], gates: &[Gate], lowering: &mut impl Lowering) -> Schedule {
    b.persistent_state(lowering);
    let walk = walk::Walk::new(steps, b.groups, gates);
    for micro in 0..b.policy.grad_accum as u32 {
        walk.micro_batch(&mut b, lowering, micro);
    }
    b.flush();
    optimizer::optimizer_step(&mut b, lowering);
    b.finish()
}
