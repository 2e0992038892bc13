//! Pipeline parallelism planned ahead: each pipeline rank's program in
//! torch.distributed.pipelining's vocabulary, built from the schedule's own rules and
//! lowered as PyTorch lowers it.
//!
//! - `action`: the vocabulary and its text form ([`Action`], [`Op`], [`OpKind`]);
//! - `auto`: `plan --auto` over the pipeline's knobs ([`search_pipeline`]);
//! - `compute`: each schedule's compute-only program per rank ([`compute_order`]);
//! - `cut`: the model's graph cut into one differentiated graph per stage ([`StageGraph`]);
//! - `lower`: FSDP's unshard/reshard, gradient reduction, sends, receives and waits;
//! - `csv`: schedules as torch's CSV files ([`read_csv`], [`write_csv`]);
//! - `validate`: a custom compute-only schedule checked before it runs ([`validate_custom`]);
//! - `json`: the plan as JSON and as a Chrome / Perfetto trace;
//! - `memory`: every pipeline rank's memory walked through its program ([`RankMemory`]);
//! - `split`, `plan`, `timeline`, `print`: a run's stages, its program against the clock,
//!   and the report.

mod action;
mod auto;
mod compute;
mod csv;
mod cut;
mod json;
mod lower;
mod memory;
mod plan;
pub mod print;
mod split;
mod timeline;
mod validate;

pub use self::csv::{
    cell_name, read_csv, read_lowered_csv, write_csv, write_lowered_csv, CellAt, CellError, CsvError, MAX_CELLS,
    MAX_CSV_BYTES, MAX_RANKS,
};
pub use action::{Action, ActionParseError, Op, OpKind};
pub use auto::{search_pipeline, PipelineAuto, PipelineCandidate, PipelineFixed};
pub use compute::{check, compute_order, placement, Placement, RankOrder, ScheduleError, Shape};
pub use cut::{cut_stages, stage_graphs, StageGraph};
pub use json::{chrome_trace, to_json, PIPELINE_PLAN_VERSION};
pub use lower::{lower, Deadlock, StageMap, MAX_ACTIVE_STAGES};
pub use memory::{rank_memory, RankMemory, StageMemory};
pub use plan::{plan_pipeline, PipelinePlan, StagePlan};
pub use shardplan_frontends::PipelineSchedule;
pub use split::{split_stages, stages_per_rank, top_level_modules};
pub use timeline::{simulate, Span, StageTimes, Stuck, Timeline};
pub use validate::{validate_custom, validate_custom_stages, CustomSchedule, ScheduleFileError, Slot, StuckRank};

/// A schedule at one size: its placement, every rank's compute-only program and that
/// program lowered with communication.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineProgram {
    /// The named schedule, or `None` for a custom one read from a CSV file.
    pub schedule: Option<PipelineSchedule>,
    pub shape: Shape,
    /// `rank_of_stage[stage]`: the pipeline rank that runs each stage.
    pub rank_of_stage: Vec<u32>,
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
            schedule: Some(schedule),
            shape,
            rank_of_stage: (0..shape.stages()).map(rank_of).collect(),
            compute,
            lowered,
        })
    }

    /// A custom schedule, validated, as a program; its stages a rank are the most any
    /// rank runs.
    pub fn custom(schedule: CustomSchedule) -> PipelineProgram {
        let stages_per_rank = (0..schedule.ranks)
            .map(|r| schedule.stages_of(r).len() as u32)
            .max()
            .unwrap_or(1);
        PipelineProgram {
            schedule: None,
            shape: Shape {
                ranks: schedule.ranks,
                stages_per_rank,
                microbatches: schedule.microbatches,
            },
            rank_of_stage: schedule.rank_of_stage,
            compute: schedule.compute,
            lowered: schedule.lowered,
        }
    }

    /// The stages `rank` runs, ascending.
    pub fn stages_of(&self, rank: u32) -> Vec<u32> {
        (0..self.stages())
            .filter(|&s| self.rank_of_stage[s as usize] == rank)
            .collect()
    }

    /// The number of stages.
    pub fn stages(&self) -> u32 {
        self.rank_of_stage.len() as u32
    }
}
