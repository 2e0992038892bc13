//! The lowered program of every pipeline rank run against the clock: each action starts
//! when its rank is free and its input is there, so the simulation both proves the
//! program ends (no rank waits on a send or receive that never comes) and gives the step's
//! makespan and bubble.
//!
//! Communication between stages costs `p2p_s` after the send; a stage's unshard (its
//! parameters' all-gather) and gradient reduction take their time on the rank, as the
//! executor runs them; a reshard costs nothing.

use super::action::{Action, Op, OpKind};
use std::collections::HashMap;

/// The seconds one micro-batch's compute of one stage takes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StageTimes {
    pub forward: f64,
    /// The input-gradient half of the backward (I).
    pub backward_input: f64,
    /// The weight-gradient half (W); a full backward (B) takes both halves.
    pub backward_weight: f64,
    /// The all-gather of the stage's parameters (UNSHARD).
    pub unshard: f64,
    /// The reduction of its gradients over the data-parallel ranks (REDUCE_GRAD).
    pub reduce: f64,
    /// Adding one micro-batch's weight gradients to those of the earlier ones (autograd's
    /// in-place accumulation into the unsharded gradients): paid by the B or W of every
    /// micro-batch but the first, whose gradients become the sum.
    pub accumulate: f64,
}

impl StageTimes {
    /// torch's unit costs: F 1, I 1, W 1 (B 2).
    pub const UNIT: StageTimes = StageTimes {
        forward: 1.0,
        backward_input: 1.0,
        backward_weight: 1.0,
        unshard: 0.0,
        reduce: 0.0,
        accumulate: 0.0,
    };

    /// The seconds of `op`, one of this stage's.
    fn of(&self, op: Op) -> f64 {
        let accumulate = match op.microbatch {
            Some(m) if m > 0 => self.accumulate,
            _ => 0.0,
        };
        match op.kind {
            OpKind::Forward => self.forward,
            OpKind::Backward => self.backward_input + self.backward_weight + accumulate,
            OpKind::BackwardInput => self.backward_input,
            OpKind::BackwardWeight => self.backward_weight + accumulate,
            OpKind::Unshard => self.unshard,
            OpKind::ReduceGrad => self.reduce,
            _ => 0.0,
        }
    }
}

/// One compute action as it ran: on which rank, from when to when.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    pub action: Action,
    pub start: f64,
    pub end: f64,
}

/// Every rank's compute spans, in program order, and the step's length.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    pub ranks: Vec<Vec<Span>>,
    /// When each rank's program ends.
    pub ends: Vec<f64>,
    pub makespan: f64,
}

impl Timeline {
    /// The busy time of `rank`'s compute.
    pub fn busy(&self, rank: usize) -> f64 {
        self.ranks[rank].iter().map(|s| s.end - s.start).sum()
    }

    /// The share of rank-time no rank computes: 1 - busy / (ranks x makespan).
    pub fn bubble(&self) -> f64 {
        if self.makespan <= 0.0 {
            return 0.0;
        }
        let busy: f64 = (0..self.ranks.len()).map(|r| self.busy(r)).sum();
        1.0 - busy / (self.ranks.len() as f64 * self.makespan)
    }
}

/// A rank that cannot go on: its index, the position of the blocking action in its
/// lowered program, and the action.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the pipeline program never ends: {}", .0.iter().map(|(rank, at, action)| format!("rank {rank} waits forever at action {at} (`{action}`)")).collect::<Vec<_>>().join("; "))]
pub struct Stuck(pub Vec<(u32, usize, Action)>);

/// Times of the events the program's actions wait on, by op.
#[derive(Default)]
struct Events {
    /// When an op finished on its rank (compute, sends, posted receives).
    done: HashMap<Op, f64>,
}

impl Events {
    fn at(&self, op: Op) -> Option<f64> {
        self.done.get(&op).copied()
    }
}

/// The time the data `op` consumes is on `op`'s rank, or `None` while it is not yet known.
fn input_ready(op: Op, events: &Events, stages: u32, p2p_s: f64) -> Option<f64> {
    match op.kind {
        OpKind::Forward if op.stage > 0 => {
            let received = events.at(op.with_kind(OpKind::RecvF));
            let local = events.at(Op {
                stage: op.stage - 1,
                ..op
            });
            received.or(local)
        }
        OpKind::Backward | OpKind::BackwardInput if op.stage + 1 < stages => {
            let next = Op {
                stage: op.stage + 1,
                ..op
            };
            events
                .at(op.with_kind(OpKind::RecvB))
                .or(events.at(next.with_kind(OpKind::BackwardInput)))
                .or(events.at(next.with_kind(OpKind::Backward)))
        }
        OpKind::BackwardWeight => events.at(op.with_kind(OpKind::BackwardInput)),
        // A receive completes when its send has crossed the link.
        OpKind::RecvF => events
            .at(Op {
                stage: op.stage - 1,
                ..op.with_kind(OpKind::SendF)
            })
            .map(|t| t + p2p_s),
        OpKind::RecvB => events
            .at(Op {
                stage: op.stage + 1,
                ..op.with_kind(OpKind::SendB)
            })
            .map(|t| t + p2p_s),
        // A send's wait returns once the peer has received it.
        OpKind::WaitSendF => events.at(Op {
            stage: op.stage + 1,
            ..op.with_kind(OpKind::RecvF)
        }),
        OpKind::WaitSendB => events.at(Op {
            stage: op.stage - 1,
            ..op.with_kind(OpKind::RecvB)
        }),
        _ => Some(0.0),
    }
}

/// Runs `lowered` (every rank's program) with `times[stage]`, each rank in order, until
/// all end or none can go on.
pub fn simulate(lowered: &[Vec<Action>], times: &[StageTimes], p2p_s: f64) -> Result<Timeline, Stuck> {
    let stages = times.len() as u32;
    let mut events = Events::default();
    let mut next = vec![0usize; lowered.len()];
    let mut free = vec![0.0f64; lowered.len()];
    let mut spans: Vec<Vec<Span>> = vec![Vec::new(); lowered.len()];
    loop {
        let mut progress = false;
        for (rank, program) in lowered.iter().enumerate() {
            while let Some(action) = program.get(next[rank]) {
                let ready: Option<Vec<f64>> = action
                    .ops()
                    .iter()
                    .map(|&op| input_ready(op, &events, stages, p2p_s))
                    .collect();
                let Some(ready) = ready else {
                    break;
                };
                let input = ready.into_iter().fold(0.0, f64::max);
                let (start, end, event) = match action.op().map(|op| op.kind) {
                    // A receive is posted at once; its data lands when the send has
                    // crossed, and only the compute that reads it waits.
                    Some(OpKind::RecvF | OpKind::RecvB) => (free[rank], free[rank], input),
                    _ => {
                        let start = input.max(free[rank]);
                        let length: f64 = action.ops().iter().map(|op| times_of(times, *op)).sum();
                        (start, start + length, start + length)
                    }
                };
                for &op in action.ops() {
                    events.done.insert(op, event);
                }
                if action.is_compute() {
                    spans[rank].push(Span {
                        action: action.clone(),
                        start,
                        end,
                    });
                }
                free[rank] = end;
                next[rank] += 1;
                progress = true;
            }
        }
        let stuck: Vec<(u32, usize, Action)> = lowered
            .iter()
            .enumerate()
            .filter_map(|(r, p)| p.get(next[r]).map(|a| (r as u32, next[r], a.clone())))
            .collect();
        if stuck.is_empty() {
            let makespan = free.iter().copied().fold(0.0, f64::max);
            return Ok(Timeline {
                ranks: spans,
                ends: free,
                makespan,
            });
        }
        if !progress {
            return Err(Stuck(stuck));
        }
    }
}

fn times_of(times: &[StageTimes], op: Op) -> f64 {
    times.get(op.stage as usize).map_or(0.0, |t| t.of(op))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{PipelineProgram, PipelineSchedule, Shape};

    fn timeline(schedule: PipelineSchedule, ranks: u32, v: u32, m: u32) -> Timeline {
        let shape = Shape {
            ranks,
            stages_per_rank: v,
            microbatches: m,
        };
        let program = PipelineProgram::build(schedule, shape).unwrap();
        simulate(&program.lowered, &vec![StageTimes::UNIT; shape.stages() as usize], 0.0).unwrap()
    }

    #[test]
    fn gpipe_and_1f1b_bubbles_are_the_textbook_ones() {
        for schedule in [PipelineSchedule::GPipe, PipelineSchedule::OneFOneB] {
            for (p, m) in [(2, 4), (4, 8), (8, 32)] {
                let t = timeline(schedule, p, 1, m);
                let expected = f64::from(p - 1) / f64::from(m + p - 1);
                assert!(
                    (t.bubble() - expected).abs() < 1e-9,
                    "{schedule} P{p} M{m}: {}",
                    t.bubble()
                );
                assert_eq!(t.makespan, f64::from(3 * (m + p - 1)));
            }
        }
    }

    #[test]
    fn interleaving_shrinks_the_bubble() {
        let plain = timeline(PipelineSchedule::OneFOneB, 4, 1, 8).bubble();
        let interleaved = timeline(PipelineSchedule::Interleaved1F1B, 4, 2, 8).bubble();
        let zero_bubble = timeline(PipelineSchedule::ZBVZeroBubble, 4, 2, 8).bubble();
        assert!(interleaved < plain, "{interleaved} vs {plain}");
        assert!(zero_bubble < interleaved, "{zero_bubble} vs {interleaved}");
    }

    #[test]
    fn every_schedule_ends() {
        for schedule in PipelineSchedule::ALL {
            let v = schedule.default_stages_per_rank() as u32;
            for p in [2, 4] {
                let t = timeline(schedule, p, v, 2 * p * v);
                assert!(
                    t.makespan > 0.0 && t.bubble() >= 0.0 && t.bubble() < 1.0,
                    "{schedule} P{p}"
                );
            }
        }
    }

    #[test]
    fn a_receive_without_its_send_is_stuck() {
        let f = |s, mb| Action::from(Op::new(s, OpKind::Forward, mb));
        let lowered = vec![vec![f(0, 0)], vec![Op::new(1, OpKind::RecvF, 0).into(), f(1, 0)]];
        let err = simulate(&lowered, &[StageTimes::UNIT; 2], 0.0).unwrap_err();
        assert_eq!(err.0[0].0, 1);
        assert!(
            err.to_string()
                .contains("rank 1 waits forever at action 0 (`1RECV_F0`)"),
            "{err}"
        );
    }
}
