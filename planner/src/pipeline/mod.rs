//! Pipeline parallelism planned ahead: each pipeline rank's program in
//! torch.distributed.pipelining's vocabulary, built from the schedule's own rules and
//! lowered as PyTorch lowers it.
//!
//! - `action`: the vocabulary and its text form ([`Action`], [`Op`], [`OpKind`]);
//! - `compute`: each schedule's compute-only program per rank ([`compute_order`]);
//! - `lower`: FSDP's unshard/reshard, gradient reduction, sends, receives and waits.

mod action;
mod compute;
mod lower;
mod plan;
pub mod print;
mod split;
mod timeline;

pub use action::{Action, ActionParseError, Op, OpKind};
pub use compute::{check, compute_order, placement, Placement, RankOrder, ScheduleError, Shape};
pub use lower::{lower, Deadlock, StageMap, MAX_ACTIVE_STAGES};
pub use plan::{plan_pipeline, PipelinePlan, StagePlan};
pub use shardplan_frontends::PipelineSchedule;
pub use split::{split_stages, stages_per_rank, top_level_modules};
pub use timeline::{simulate, Span, StageTimes, Stuck, Timeline};

/// A schedule at one size: its placement, every rank's compute-only program and that
/// program lowered with communication.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineProgram {
    pub schedule: PipelineSchedule,
    pub shape: Shape,
    pub placement: Placement,
    pub compute: Vec<RankOrder>,
    pub lowered: Vec<Vec<Action>>,
}

/// Why a schedule could not be built or lowered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error(transparent)]
    Deadlock(#[from] Deadlock),
}

/// Every rank's compute-only order in torch's CSV format: a row a rank, a cell an action,
/// an empty cell an idle slot (what `_load_csv(format="compute_only")` reads).
pub fn compute_csv(rows: &[RankOrder]) -> String {
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .map(|a| a.as_ref().map(ToString::to_string).unwrap_or_default())
            .collect();
        out.push_str(&cells.join(","));
        out.push_str("\r\n");
    }
    out
}

impl PipelineProgram {
    /// `schedule` at `shape`, built and lowered.
    pub fn build(schedule: PipelineSchedule, shape: Shape) -> Result<PipelineProgram, PipelineError> {
        let compute = compute_order(schedule, shape)?;
        let placement = placement(schedule);
        let rank_of = |stage| placement.rank_of(stage, shape.ranks);
        let map = StageMap {
            stages: shape.stages(),
            rank_of: &rank_of,
        };
        let lowered = lower(&compute, shape.microbatches, &map)?;
        Ok(PipelineProgram {
            schedule,
            shape,
            placement,
            compute,
            lowered,
        })
    }
}
