//! The single-stage schedules: rank r runs stage r.
//!
//! Each is the order torch *runs* (`_step_microbatches`), without idle slots: torch's own
//! `pipeline_order` of these classes drops its idle slots when it adds the gradient
//! reduction, and `Schedule1F1B`'s is wrong on the last rank in torch 2.15 (it counts
//! forwards from micro-batch 1).

use super::{RankOrder, Shape};
use crate::pipeline::action::{Op, OpKind};

/// GPipe: every forward, then every backward.
pub(super) fn gpipe(shape: Shape) -> Vec<RankOrder> {
    (0..shape.ranks)
        .map(|rank| {
            let forwards = (0..shape.microbatches).map(|mb| Op::new(rank, OpKind::Forward, mb));
            let backwards = (0..shape.microbatches).map(|mb| Op::new(rank, OpKind::Backward, mb));
            forwards.chain(backwards).map(|op| Some(op.into())).collect()
        })
        .collect()
}

/// 1F1B: stage s runs min(M, P - s) forwards, then a backward and a forward in turn while
/// forwards remain, then the remaining backwards.
pub(super) fn one_f_one_b(shape: Shape) -> Vec<RankOrder> {
    let m = shape.microbatches;
    (0..shape.ranks)
        .map(|rank| {
            let warmup = m.min(shape.ranks - rank);
            let mut order: RankOrder = Vec::new();
            let mut push = |kind, mb| order.push(Some(Op::new(rank, kind, mb).into()));
            for mb in 0..warmup {
                push(OpKind::Forward, mb);
            }
            for (b, f) in (0..m).zip(warmup..m) {
                push(OpKind::Backward, b);
                push(OpKind::Forward, f);
            }
            for b in m - warmup..m {
                push(OpKind::Backward, b);
            }
            order
        })
        .collect()
}
