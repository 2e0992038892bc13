//! The V-shaped schedules: rank r runs stage r on the way down and stage 2P - 1 - r on the
//! way back, so the last stage shares a rank with the first.
//!
//! - ZBV zero-bubble (Qi et al. 2024): backwards split into input and weight halves;
//! - DualPipeV (DeepSeek-V3's DualPipe cut to one V): one stage's forward overlapped with
//!   the other's backward in steady state.

use super::{RankOrder, Shape};
use crate::pipeline::action::{Action, Op, OpKind};
use std::collections::{HashMap, VecDeque};

/// Per-stage counters of the next micro-batch of each kind.
#[derive(Default)]
struct Counters(HashMap<(u32, OpKind), u32>);

impl Counters {
    fn next(&mut self, stage: u32, kind: OpKind) -> Op {
        let mb = self.0.entry((stage, kind)).or_insert(0);
        *mb += 1;
        Op::new(stage, kind, *mb - 1)
    }

    fn peek(&self, stage: u32, kind: OpKind) -> u32 {
        self.0.get(&(stage, kind)).copied().unwrap_or(0)
    }
}

/// ZBV zero-bubble on one rank, before micro-batches past M are idled: stage r's
/// forwards fill the V's way down, stage 2P-1-r's forward, input and weight halves the
/// way back, then both stages in turn, then the input halves and the weights left.
fn zbv_rank(rank: u32, shape: Shape) -> RankOrder {
    let p = shape.ranks;
    let (down, up) = (rank, 2 * p - 1 - rank);
    let microbatches = (2 * p - 1).max(shape.microbatches);
    let mut order: RankOrder = vec![None; rank as usize];
    let mut c = Counters::default();
    let push = |order: &mut RankOrder, op: Op| order.push(Some(op.into()));
    for _ in 0..2 * (p - rank) - 1 {
        push(&mut order, c.next(down, OpKind::Forward));
    }
    for _ in 0..rank {
        push(&mut order, c.next(up, OpKind::Forward));
        push(&mut order, c.next(down, OpKind::Forward));
    }
    let both_halves = |order: &mut RankOrder, c: &mut Counters, stage| {
        order.push(Some(c.next(stage, OpKind::BackwardInput).into()));
        order.push(Some(c.next(stage, OpKind::BackwardWeight).into()));
    };
    for _ in 0..p - rank {
        push(&mut order, c.next(up, OpKind::Forward));
        both_halves(&mut order, &mut c, up);
    }
    while c.peek(up, OpKind::Forward) < c.peek(down, OpKind::Forward) || c.peek(down, OpKind::Forward) < microbatches {
        if c.peek(down, OpKind::Forward) < microbatches {
            push(&mut order, c.next(down, OpKind::Forward));
        }
        both_halves(&mut order, &mut c, down);
        push(&mut order, c.next(up, OpKind::Forward));
        both_halves(&mut order, &mut c, up);
    }
    for _ in 0..rank {
        push(&mut order, c.next(down, OpKind::BackwardInput));
        push(&mut order, c.next(up, OpKind::BackwardInput));
    }
    for _ in 0..p - rank {
        push(&mut order, c.next(down, OpKind::BackwardInput));
        push(&mut order, c.next(down, OpKind::BackwardWeight));
    }
    for stage in [up, down] {
        while c.peek(stage, OpKind::BackwardWeight) < c.peek(stage, OpKind::BackwardInput) {
            push(&mut order, c.next(stage, OpKind::BackwardWeight));
        }
    }
    order
}

/// ZBV zero-bubble: every rank's order over max(2P - 1, M) micro-batches, the slots of
/// micro-batches past M left idle (torch's way of running fewer).
pub(super) fn zbv_zero_bubble(shape: Shape) -> Vec<RankOrder> {
    (0..shape.ranks)
        .map(|rank| {
            zbv_rank(rank, shape)
                .into_iter()
                .map(|slot| slot.filter(|a| a.ops().iter().all(|op| op.microbatch < Some(shape.microbatches))))
                .collect()
        })
        .collect()
}

/// One DualPipeV rank's order as it is built: backwards of a stage share one micro-batch
/// counter (B and I alike), and the weight halves wait in a queue.
struct DualPipeRank {
    order: RankOrder,
    counters: Counters,
    weights: VecDeque<Op>,
}

impl DualPipeRank {
    fn add(&mut self, stage: u32, kind: OpKind) {
        let op = match kind {
            OpKind::Backward => {
                let op = self
                    .counters
                    .next(stage, OpKind::BackwardInput)
                    .with_kind(OpKind::Backward);
                self.counters.next(stage, OpKind::BackwardWeight);
                op
            }
            OpKind::BackwardInput => {
                let op = self.counters.next(stage, kind);
                self.weights.push_back(op.with_kind(OpKind::BackwardWeight));
                op
            }
            _ => self.counters.next(stage, kind),
        };
        self.order.push(Some(op.into()));
    }

    /// `forward`'s forward and `backward`'s full backward as one overlapped action.
    fn overlap(&mut self, forward: u32, backward: u32) {
        let f = self.counters.next(forward, OpKind::Forward);
        let b = self
            .counters
            .next(backward, OpKind::BackwardInput)
            .with_kind(OpKind::Backward);
        self.counters.next(backward, OpKind::BackwardWeight);
        self.order.push(Some(Action::Overlap(vec![f, b])));
    }

    fn weight_if_pending(&mut self) {
        if let Some(w) = self.weights.pop_front() {
            self.counters.next(w.stage, OpKind::BackwardWeight);
            self.order.push(Some(w.into()));
        }
    }
}

/// DualPipeV: forwards down and up the V, then each step one stage's forward overlapped
/// with the other's backward, then the backwards, the later ones split into input and
/// weight halves to fill the tail.
pub(super) fn dualpipev(shape: Shape) -> Vec<RankOrder> {
    (0..shape.ranks).map(|rank| dualpipev_rank(rank, shape)).collect()
}

fn dualpipev_rank(rank: u32, shape: Shape) -> RankOrder {
    let (p, m) = (shape.ranks, shape.microbatches);
    let (down, up) = (rank, 2 * p - 1 - rank);
    let mut r = DualPipeRank {
        order: RankOrder::new(),
        counters: Counters::default(),
        weights: VecDeque::new(),
    };
    for _ in 0..(p - rank - 1) * 2 {
        r.add(down, OpKind::Forward);
    }
    for _ in 0..=rank {
        r.add(down, OpKind::Forward);
        r.add(up, OpKind::Forward);
    }
    for _ in 0..p - rank - 1 {
        r.add(up, OpKind::BackwardInput);
        r.weight_if_pending();
        r.add(up, OpKind::Forward);
    }
    for i in 0..(m + rank + 1).saturating_sub(2 * p) {
        if i == 0 && rank == p - 1 {
            r.add(down, OpKind::Forward);
            r.add(up, OpKind::Backward);
        } else {
            r.overlap(down, up);
        }
        r.overlap(up, down);
    }
    for _ in 0..p - rank - 1 {
        r.add(up, OpKind::Backward);
        r.overlap(up, down);
    }
    let half = rank.div_ceil(2);
    let mut split = false;
    let backward = |split: bool| if split { OpKind::BackwardInput } else { OpKind::Backward };
    for i in 0..=rank {
        if i == half && rank % 2 == 1 {
            split = true;
        }
        r.add(up, backward(split));
        if i == half && rank.is_multiple_of(2) {
            split = true;
        }
        r.add(down, backward(split));
    }
    for _ in 0..p - rank - 1 {
        r.weight_if_pending();
        r.add(down, backward(split));
    }
    for _ in 0..=rank {
        r.weight_if_pending();
    }
    r.order
}
