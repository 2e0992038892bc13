//! Schedules whose V stages a rank loop over the ranks (rank r runs r, r + P, ...):
//! LoopedBFS, Interleaved 1F1B (Narayanan et al. 2021, with torch's flexible rounds) and
//! Interleaved zero-bubble (ZB1P, Qi et al. 2023).

use super::{RankOrder, Shape};
use crate::pipeline::action::{Op, OpKind};
use std::collections::{HashMap, HashSet};

fn idle(order: &mut RankOrder, slots: i64) {
    order.extend((0..slots.max(0)).map(|_| None));
}

/// LoopedBFS: each local stage's forwards for every micro-batch, breadth first, then the
/// backwards in reverse.
pub(super) fn looped_bfs(shape: Shape) -> Vec<RankOrder> {
    let (p, m) = (shape.ranks, shape.microbatches);
    (0..p)
        .map(|rank| {
            let stages: Vec<u32> = (0..shape.stages_per_rank).map(|v| rank + v * p).collect();
            let mut order = RankOrder::new();
            idle(&mut order, rank.into());
            for &stage in &stages {
                order.extend((0..m).map(|mb| Some(Op::new(stage, OpKind::Forward, mb).into())));
            }
            idle(&mut order, 2 * (i64::from(p) - 1 - i64::from(rank)));
            for &stage in stages.iter().rev() {
                order.extend((0..m).rev().map(|mb| Some(Op::new(stage, OpKind::Backward, mb).into())));
            }
            order
        })
        .collect()
}

/// The interleaved schedules' phases on one rank: `warmup` forwards, then a forward and a
/// backward per op while forwards remain, then the backwards left; micro-batches advance
/// in rounds of `per_round` on one local stage before moving to the next.
struct Interleaving {
    rank: u32,
    shape: Shape,
    per_round: u32,
    warmup: u32,
}

impl Interleaving {
    /// torch's rounds: max(1, M / P) of M / rounds micro-batches; `factor` is 2 for
    /// Interleaved 1F1B and 1 for zero-bubble (the warm-up's extra forwards per later rank).
    fn new(rank: u32, shape: Shape, factor: u32) -> Interleaving {
        let rounds = (shape.microbatches / shape.ranks).max(1);
        let per_round = shape.microbatches / rounds;
        let warmup = ((shape.stages_per_rank - 1) * per_round + factor * (shape.ranks - 1 - rank))
            .min(shape.microbatches * shape.stages_per_rank);
        Interleaving {
            rank,
            shape,
            per_round,
            warmup,
        }
    }

    fn forward_stage(&self, op: u32) -> u32 {
        let local = (op / self.per_round) % self.shape.stages_per_rank;
        local * self.shape.ranks + self.rank
    }

    fn backward_stage(&self, op: u32) -> u32 {
        let v = self.shape.stages_per_rank;
        let local = v - 1 - ((op - self.warmup) / self.per_round) % v;
        local * self.shape.ranks + self.rank
    }

    /// The rank's order (torch's `_get_1f1b_rank_ops`). With `zero_bubble`, backwards are
    /// input halves (I) and each weight half (W) follows once `rank` backwards have run,
    /// oldest first; without, the cool-down leaves an idle slot before each backward.
    fn rank_order(&self, zero_bubble: bool) -> RankOrder {
        let (p, rank) = (i64::from(self.shape.ranks), i64::from(self.rank));
        let v = i64::from(self.shape.stages_per_rank);
        let ops = self.shape.microbatches * self.shape.stages_per_rank;
        let backward_kind = if zero_bubble {
            OpKind::BackwardInput
        } else {
            OpKind::Backward
        };
        let after_warmup = if zero_bubble {
            p - rank - 1
        } else {
            v * p + 2 * (p - 1 - rank) - (i64::from(self.warmup) + rank)
        };
        let mut order = RankOrder::new();
        idle(&mut order, rank);
        let mut counts: HashMap<(u32, OpKind), u32> = HashMap::new();
        let mut next = |stage: u32, kind: OpKind| {
            let mb = counts.entry((stage, kind)).or_insert(0);
            *mb += 1;
            Some(Op::new(stage, kind, *mb - 1).into())
        };
        let mut backward_ops = Vec::new();
        let mut weights_done = 0;
        for op in 0..ops + self.warmup {
            if op < ops {
                order.push(next(self.forward_stage(op), OpKind::Forward));
            }
            if op + 1 == self.warmup {
                idle(&mut order, after_warmup);
            }
            if op < self.warmup {
                continue;
            }
            if op >= ops && !zero_bubble {
                order.push(None);
            }
            order.push(next(self.backward_stage(op), backward_kind));
            backward_ops.push(op);
            if zero_bubble && op - self.warmup >= self.rank {
                order.push(next(
                    self.backward_stage(backward_ops[weights_done]),
                    OpKind::BackwardWeight,
                ));
                weights_done += 1;
            }
        }
        while zero_bubble && weights_done < backward_ops.len() {
            order.push(next(
                self.backward_stage(backward_ops[weights_done]),
                OpKind::BackwardWeight,
            ));
            weights_done += 1;
        }
        order
    }
}

/// Interleaved 1F1B.
pub(super) fn interleaved_1f1b(shape: Shape) -> Vec<RankOrder> {
    (0..shape.ranks)
        .map(|rank| Interleaving::new(rank, shape, 2).rank_order(false))
        .collect()
}

/// Interleaved zero-bubble: the interleaved order with split backwards, then idle slots
/// wherever a forward would run before its input exists.
pub(super) fn interleaved_zero_bubble(shape: Shape) -> Vec<RankOrder> {
    let orders = (0..shape.ranks)
        .map(|rank| Interleaving::new(rank, shape, 1).rank_order(true))
        .collect();
    with_bubbles(orders, shape.stages())
}

/// Steps all ranks in lock-step, one slot each, and idles a rank whose next forward's
/// input (or whose next full backward's output gradient) was not made in an earlier step
/// (torch's `_add_bubbles_to_actions`).
fn with_bubbles(orders: Vec<RankOrder>, stages: u32) -> Vec<RankOrder> {
    let mut seen: HashSet<Op> = HashSet::new();
    let mut next = vec![0usize; orders.len()];
    let mut out: Vec<RankOrder> = vec![RankOrder::new(); orders.len()];
    loop {
        let mut made = Vec::new();
        let mut any = false;
        for (rank, order) in orders.iter().enumerate() {
            let Some(slot) = order.get(next[rank]) else {
                continue;
            };
            any = true;
            let op = slot.as_ref().and_then(|a| a.op());
            match op {
                Some(op) if needs_bubble(op, stages, &seen) => out[rank].push(None),
                _ => {
                    out[rank].push(slot.clone());
                    made.extend(op);
                    next[rank] += 1;
                }
            }
        }
        seen.extend(made);
        if !any {
            return out;
        }
    }
}

fn needs_bubble(op: Op, stages: u32, seen: &HashSet<Op>) -> bool {
    match op.kind {
        OpKind::Forward => {
            op.stage != 0
                && !seen.contains(&Op {
                    stage: op.stage - 1,
                    ..op
                })
        }
        OpKind::Backward if op.stage == stages - 1 => !seen.contains(&op.with_kind(OpKind::Forward)),
        OpKind::Backward => !seen.contains(&Op {
            stage: op.stage + 1,
            ..op
        }),
        _ => false,
    }
}
