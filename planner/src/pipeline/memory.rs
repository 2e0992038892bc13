//! Memory of every pipeline rank, walked through its lowered program.
//!
//! Each stage's own FSDP plan (one micro-batch's forward, backward and optimizer step on
//! the stage's ranks) gives what a stage holds: its sharded parameters, gradients and
//! optimizer state all step; what one micro-batch keeps from its forward to its backward;
//! the most one micro-batch's compute holds at once; the collectives' buffers. The
//! pipeline decides the rest, action by action, as torchtitan runs FSDP under a
//! pipeline (parameters unsharded from a stage's UNSHARD to its RESHARD; gradients kept
//! unsharded across micro-batches and reduced once, at REDUCE_GRAD):
//! - the activations of every micro-batch in flight on the rank (forward done, last
//!   backward not yet), and of a zero-bubble schedule's micro-batches between I and W;
//! - the stage's whole parameters while unsharded;
//! - its whole gradients (in the reduce dtype) from its first backward to its reduction;
//! - the receive buffers posted and not yet consumed.

use super::{Action, OpKind};
use crate::Plan;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// What one stage holds, from its FSDP plan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageMemory {
    /// Sharded parameters, sharded gradients and optimizer state: held all step.
    pub state: u64,
    /// The stage's parameters unsharded (this tensor rank's slices), in the param dtype.
    pub params_unsharded: u64,
    /// Its gradients unsharded, in the reduce dtype.
    pub grads_unsharded: u64,
    /// Activations one micro-batch keeps from its forward to its backward.
    pub saved: u64,
    /// The most activation bytes one micro-batch's compute holds at once (its saved ones
    /// included).
    pub working: u64,
    /// The largest all-gather and reduce-scatter buffers at once.
    pub comm: u64,
}

impl StageMemory {
    /// The stage's figures from `plan`, its FSDP plan of one micro-batch;
    /// `params`: its parameter elements (this tensor rank's); `param_bytes` and
    /// `reduce_bytes`: bytes per element of the param and reduce dtypes.
    pub fn of_plan(plan: &Plan, params: u64, param_bytes: u64, reduce_bytes: u64) -> StageMemory {
        let max = &plan.memory.max_by_category;
        let forward_end = plan
            .steps
            .iter()
            .rfind(|s| s.phase == crate::Phase::Forward)
            .map_or(0, |s| s.act_end);
        StageMemory {
            state: max.sharded_params + max.sharded_grads + max.optimizer_state,
            params_unsharded: params.saturating_mul(param_bytes),
            grads_unsharded: params.saturating_mul(reduce_bytes),
            saved: forward_end,
            working: plan
                .steps
                .iter()
                .map(|s| s.act_peak)
                .max()
                .unwrap_or(0)
                .max(forward_end),
            comm: max.comm_buffers,
        }
    }
}

/// One pipeline rank's memory at its peak, by part.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankMemory {
    pub rank: u32,
    /// Device bytes at the peak (the parts' sum).
    pub peak: u64,
    /// The action (its index in the rank's lowered program) at which the peak is reached.
    pub at: usize,
    /// Sharded parameters, gradients and optimizer state of the rank's stages.
    pub state: u64,
    pub params_unsharded: u64,
    pub grads_unsharded: u64,
    /// Activations of the micro-batches in flight (the running one's working set included).
    pub activations: u64,
    /// Micro-batches in flight at the peak, over the rank's stages.
    pub in_flight: u32,
    /// Receive buffers posted and not yet consumed.
    pub receives: u64,
    /// Collective buffers of the running stage.
    pub comm: u64,
}

/// Walks every rank's lowered program (`lowered[rank]`), `rank_of_stage[s]` placing the
/// stages and `stages[s]` their figures; `boundary` is the bytes of one activation (or its
/// gradient) crossing between stages.
pub fn rank_memory(
    lowered: &[Vec<Action>],
    rank_of_stage: &[u32],
    stages: &[StageMemory],
    boundary: u64,
) -> Vec<RankMemory> {
    lowered
        .iter()
        .enumerate()
        .map(|(rank, program)| walk(rank as u32, program, rank_of_stage, stages, boundary))
        .collect()
}

/// What a rank holds as it walks its program.
#[derive(Default)]
struct Held {
    /// (stage, micro-batch) whose forward ran and whose last backward has not.
    in_flight: HashSet<(u32, u32)>,
    unsharded: HashSet<u32>,
    grads: HashSet<u32>,
    receives: HashSet<(u32, u32, bool)>,
}

fn walk(rank: u32, program: &[Action], rank_of_stage: &[u32], stages: &[StageMemory], boundary: u64) -> RankMemory {
    let mine: Vec<usize> = (0..stages.len()).filter(|&s| rank_of_stage[s] == rank).collect();
    let state: u64 = mine.iter().map(|&s| stages[s].state).sum();
    let mut held = Held::default();
    let mut best = RankMemory {
        rank,
        state,
        peak: state,
        ..RankMemory::default()
    };
    for (at, action) in program.iter().enumerate() {
        for op in action.ops() {
            let s = op.stage;
            let m = op.microbatch.unwrap_or(0);
            let figures = stages[s as usize];
            let mut working = None;
            match op.kind {
                OpKind::Unshard => {
                    held.unsharded.insert(s);
                }
                OpKind::Reshard => {
                    held.unsharded.remove(&s);
                }
                OpKind::RecvF => {
                    held.receives.insert((s, m, false));
                }
                OpKind::RecvB => {
                    held.receives.insert((s, m, true));
                }
                OpKind::Forward => {
                    held.receives.remove(&(s, m, false));
                    working = Some(figures.working);
                    held.in_flight.insert((s, m));
                }
                OpKind::Backward | OpKind::BackwardInput => {
                    held.receives.remove(&(s, m, true));
                    held.grads.insert(s);
                    working = Some(figures.working);
                }
                OpKind::BackwardWeight => {
                    held.grads.insert(s);
                    working = Some(figures.working);
                }
                OpKind::ReduceGrad => {
                    held.grads.remove(&s);
                }
                OpKind::SendF | OpKind::SendB | OpKind::WaitSendF | OpKind::WaitSendB | OpKind::WaitReduceGrad => {}
            }
            // The running op's micro-batch is counted by its working set, not its saved set.
            if let Some(working) = working {
                let now = level(&held, stages, state, boundary, (s, m), working, figures.comm);
                if now.peak > best.peak {
                    best = RankMemory { rank, at, ..now };
                }
            }
            if matches!(op.kind, OpKind::Backward | OpKind::BackwardWeight) {
                held.in_flight.remove(&(s, m));
            }
        }
    }
    best
}

/// The rank's bytes while op (`running`) runs with `working` activation bytes.
fn level(
    held: &Held,
    stages: &[StageMemory],
    state: u64,
    boundary: u64,
    running: (u32, u32),
    working: u64,
    comm: u64,
) -> RankMemory {
    let saved: u64 = held
        .in_flight
        .iter()
        .filter(|k| **k != running)
        .map(|(s, _)| stages[*s as usize].saved)
        .sum();
    let unsharded: u64 = held
        .unsharded
        .iter()
        .chain(std::iter::once(&running.0))
        .collect::<HashSet<_>>()
        .into_iter()
        .map(|s| stages[*s as usize].params_unsharded)
        .sum();
    let grads: u64 = held.grads.iter().map(|s| stages[*s as usize].grads_unsharded).sum();
    let receives = boundary.saturating_mul(held.receives.len() as u64);
    let activations = saved + working;
    RankMemory {
        rank: 0,
        peak: state + unsharded + grads + activations + receives + comm,
        at: 0,
        state,
        params_unsharded: unsharded,
        grads_unsharded: grads,
        activations,
        in_flight: held.in_flight.len() as u32,
        receives,
        comm,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{PipelineProgram, PipelineSchedule, Shape};

    fn stage() -> StageMemory {
        StageMemory {
            state: 0,
            params_unsharded: 0,
            grads_unsharded: 0,
            saved: 10,
            working: 10,
            comm: 0,
        }
    }

    fn peak_in_flight(schedule: PipelineSchedule, ranks: u32, v: u32, m: u32) -> Vec<u32> {
        let shape = Shape {
            ranks,
            stages_per_rank: v,
            microbatches: m,
        };
        let program = PipelineProgram::build(schedule, shape).unwrap();
        let stages = vec![stage(); (ranks * v) as usize];
        rank_memory(&program.lowered, &program.rank_of_stage, &stages, 0)
            .iter()
            .map(|r| r.in_flight)
            .collect()
    }

    #[test]
    fn gpipe_holds_every_micro_batch_and_1f1b_holds_the_ranks_ahead() {
        // GPipe runs every forward before any backward: all M in flight on every rank.
        assert_eq!(peak_in_flight(PipelineSchedule::GPipe, 4, 1, 8), vec![8; 4]);
        // 1F1B holds P - r micro-batches on rank r (torchtitan's activation memory rule).
        assert_eq!(peak_in_flight(PipelineSchedule::OneFOneB, 4, 1, 8), vec![4, 3, 2, 1]);
    }

    #[test]
    fn unsharded_state_counts_while_a_stage_is_unsharded() {
        let shape = Shape {
            ranks: 2,
            stages_per_rank: 1,
            microbatches: 2,
        };
        let program = PipelineProgram::build(PipelineSchedule::OneFOneB, shape).unwrap();
        let stages = vec![
            StageMemory {
                state: 100,
                params_unsharded: 1000,
                grads_unsharded: 2000,
                saved: 1,
                working: 1,
                comm: 0,
            };
            2
        ];
        let ranks = rank_memory(&program.lowered, &program.rank_of_stage, &stages, 0);
        for r in &ranks {
            assert_eq!(r.state, 100);
            assert_eq!(r.params_unsharded, 1000);
            assert_eq!(r.grads_unsharded, 2000, "rank {}: the peak is in a backward", r.rank);
        }
    }
}
