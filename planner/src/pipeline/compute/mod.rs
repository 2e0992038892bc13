//! Each rank's compute-only program (F, B, I, W and DualPipeV's overlaps, `None` an idle
//! slot) for the schedules torch.distributed.pipelining builds, from each schedule's own
//! rules, so that it equals the schedule class's `pipeline_order`.
//!
//! - `single`: GPipe and 1F1B, one stage a rank;
//! - `looped`: LoopedBFS, Interleaved 1F1B and Interleaved zero-bubble, stages looped over
//!   the ranks;
//! - `v`: ZBV zero-bubble and DualPipeV, two stages a rank placed in a V.

mod looped;
mod single;
mod v;

use super::action::Action;
pub use shardplan_frontends::PipelineSchedule;

/// One rank's compute-only program: `None` is a slot the schedule leaves idle.
pub type RankOrder = Vec<Option<Action>>;

/// How stages sit on the pipeline ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Rank r holds stages r, r + P, r + 2P, ...
    Loop,
    /// Rank r holds stages r and 2P - 1 - r (ZBV, DualPipeV).
    V,
}

/// The pipeline's size: ranks P, stages per rank V, micro-batches M.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub ranks: u32,
    pub stages_per_rank: u32,
    pub microbatches: u32,
}

impl Shape {
    pub fn stages(&self) -> u32 {
        self.ranks * self.stages_per_rank
    }
}

/// A schedule, size and placement that torch refuses, with torch's reason.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("{schedule} runs one stage a rank, but stages_per_rank is {stages_per_rank}")]
    SingleStage {
        schedule: PipelineSchedule,
        stages_per_rank: u32,
    },
    #[error("{schedule} places two stages a rank in a V, but stages_per_rank is {stages_per_rank}")]
    VNeedsTwo {
        schedule: PipelineSchedule,
        stages_per_rank: u32,
    },
    #[error(
        "{schedule} needs at least as many micro-batches as stages: {microbatches} micro-batches, {stages} stages"
    )]
    TooFewMicrobatches {
        schedule: PipelineSchedule,
        microbatches: u32,
        stages: u32,
    },
    #[error(
        "{schedule} runs micro-batches in rounds of max(1, M / P) = {rounds}, which does not divide M = {microbatches}"
    )]
    Rounds {
        schedule: PipelineSchedule,
        rounds: u32,
        microbatches: u32,
    },
    #[error("a pipeline needs at least one rank, one stage a rank and one micro-batch")]
    Empty,
}

impl ScheduleError {
    /// The fix, in the spec's words.
    pub fn fix(&self) -> String {
        match self {
            ScheduleError::SingleStage { .. } => "set pipeline.stages_per_rank to 1, or pick a multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)".into(),
            ScheduleError::VNeedsTwo { .. } => "set pipeline.stages_per_rank to 2".into(),
            ScheduleError::TooFewMicrobatches { stages, .. } => format!("set pipeline.microbatches to at least {stages}"),
            ScheduleError::Rounds { rounds, microbatches, .. } => {
                let up = microbatches.div_ceil(*rounds) * rounds;
                format!("set pipeline.microbatches to a multiple of {rounds} (e.g. {up})")
            }
            ScheduleError::Empty => "set mesh.pipeline, pipeline.stages_per_rank and pipeline.microbatches to at least 1".into(),
        }
    }
}

/// Where `schedule` places its stages.
pub fn placement(schedule: PipelineSchedule) -> Placement {
    match schedule {
        PipelineSchedule::ZBVZeroBubble | PipelineSchedule::DualPipeV => Placement::V,
        _ => Placement::Loop,
    }
}

impl Placement {
    /// The rank that runs `stage` (torch's `generate_stage_to_rank_mapping`).
    pub fn rank_of(self, stage: u32, ranks: u32) -> u32 {
        match self {
            Placement::Loop => stage % ranks,
            Placement::V => {
                let (lap, at) = (stage / ranks, stage % ranks);
                if lap.is_multiple_of(2) {
                    at
                } else {
                    ranks - 1 - at
                }
            }
        }
    }
}

/// Refuses what torch's schedule classes refuse for `shape`.
pub fn check(schedule: PipelineSchedule, shape: Shape) -> Result<(), ScheduleError> {
    let Shape {
        ranks,
        stages_per_rank,
        microbatches,
    } = shape;
    if ranks == 0 || stages_per_rank == 0 || microbatches == 0 {
        return Err(ScheduleError::Empty);
    }
    use PipelineSchedule::*;
    match schedule {
        GPipe | OneFOneB if stages_per_rank != 1 => {
            return Err(ScheduleError::SingleStage {
                schedule,
                stages_per_rank,
            })
        }
        ZBVZeroBubble | DualPipeV if stages_per_rank != 2 => {
            return Err(ScheduleError::VNeedsTwo {
                schedule,
                stages_per_rank,
            })
        }
        _ => {}
    }
    if matches!(schedule, OneFOneB | DualPipeV) && microbatches < shape.stages() {
        return Err(ScheduleError::TooFewMicrobatches {
            schedule,
            microbatches,
            stages: shape.stages(),
        });
    }
    if matches!(schedule, Interleaved1F1B | InterleavedZeroBubble) {
        let rounds = (microbatches / ranks).max(1);
        if !microbatches.is_multiple_of(rounds) {
            return Err(ScheduleError::Rounds {
                schedule,
                rounds,
                microbatches,
            });
        }
    }
    Ok(())
}

/// Every rank's compute-only program for `schedule` at `shape`, rank 0 first.
pub fn compute_order(schedule: PipelineSchedule, shape: Shape) -> Result<Vec<RankOrder>, ScheduleError> {
    check(schedule, shape)?;
    use PipelineSchedule::*;
    let order = match schedule {
        GPipe => single::gpipe(shape),
        OneFOneB => single::one_f_one_b(shape),
        LoopedBFS => looped::looped_bfs(shape),
        Interleaved1F1B => looped::interleaved_1f1b(shape),
        InterleavedZeroBubble => looped::interleaved_zero_bubble(shape),
        ZBVZeroBubble => v::zbv_zero_bubble(shape),
        DualPipeV => v::dualpipev(shape),
    };
    Ok(order)
}
