//! The step's end: the gradient norm (partial sums all-reduced over the shard group, and
//! the tensor group) and each group's optimizer step on its shards, on the device or
//! (offload) on the host.

use super::builder::Builder;
use super::Lowering;
use crate::group::GroupId;
use crate::plan::{BufId, Category, Comm, EventId, Instr, ReduceOp, Stream};
use shardplan_ir::DType;

/// Issues the gradient norm and the optimizer steps once every group's gradients are done.
pub(super) fn optimizer_step(b: &mut Builder, lowering: &mut impl Lowering) {
    let opt = b.optimizer_stream();
    let finals: Vec<(GroupId, BufId, EventId)> = b
        .groups
        .iter()
        .filter_map(|grp| b.grads_done[grp.group.id].map(|(buf, e)| (grp.group.id, buf, e)))
        .collect();
    for &(_, _, e) in &finals {
        b.emit(opt, Instr::Wait { event: e });
    }
    let grads: Vec<BufId> = finals.iter().map(|f| f.1).collect();
    let norm = b.policy.grad_clip.map(|_| grad_norm(b, opt, grads));
    // Temporaries the step holds are freed when it ends.
    let groups: Vec<GroupId> = finals.iter().map(|f| f.0).collect();
    let temporaries = lowering.optimizer_temporaries(b, &groups);
    for &(g, grads, _) in &finals {
        b.emit(
            opt,
            Instr::OptimizerStep {
                group: g,
                params: b.sharded[g],
                state: b.optim[g],
                grads,
                norm,
            },
        );
        b.emit(opt, Instr::Free { buf: grads });
    }
    for buf in temporaries {
        b.emit(opt, Instr::Free { buf });
    }
    if let Some(n) = norm {
        b.emit(opt, Instr::Free { buf: n });
    }
}

/// The gradient norm of `grads` on stream `opt`: each rank's partial sum all-reduced over
/// the shard group (and the tensor group), waited for on `opt`.
fn grad_norm(b: &mut Builder, opt: Stream, grads: Vec<BufId>) -> BufId {
    // f64: the clipping factor must not depend on how the sum was split.
    let id = b.shared_buf("grad_norm", Category::CommBuffers, DType::F64, 1);
    b.emit(opt, Instr::Alloc { buf: id });
    b.emit(opt, Instr::GradNorm { grads, dst: id });
    let partial = b.record(opt);
    b.emit(Stream::AllReduce, Instr::Wait { event: partial });
    b.emit(
        Stream::AllReduce,
        Instr::AllReduce {
            group: None,
            comm: Comm::Shard,
            op: ReduceOp::Sum,
            buf: id,
        },
    );
    if b.mesh.tensor() > 1 {
        // Each rank's partial sum counts the parameters split over its tensor group
        // whole and the ones every tensor rank holds once per rank (divided by the
        // group's size), so summed over the group each counts once.
        b.emit(
            Stream::AllReduce,
            Instr::AllReduce {
                group: None,
                comm: Comm::Tensor,
                op: ReduceOp::Sum,
                buf: id,
            },
        );
    }
    let reduced = b.record(Stream::AllReduce);
    b.emit(opt, Instr::Wait { event: reduced });
    id
}
