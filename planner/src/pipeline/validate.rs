//! A custom compute-only schedule (one read from torch's CSV with [`read_csv`]) checked
//! before anything runs it, as torch's `_validate_schedule` checks one and more, each error
//! naming the rank and slot at fault:
//!
//! - one row a pipeline rank, every action compute (F, B, I, W, OVERLAP_F_B), every stage
//!   and micro-batch index in range (torch fails with a `KeyError` on a stage out of range
//!   and does not check micro-batches);
//! - each stage on exactly one rank, every stage on some rank and every rank running some
//!   stage; the stage-to-rank map this implies is returned, as torch returns it;
//! - per stage and micro-batch: one F; then one B, or one I and after it one W (torch
//!   counts distinct micro-batches, so it lets a repeated action or a micro-batch with both
//!   a B and an I pass);
//! - no deadlock: the schedule is lowered with the implied map ([`lower`]), and a rank that
//!   waits forever is named with the slot it is stuck at and the action it waits for.
//!
//! [`read_csv`]: super::read_csv

use super::action::{Action, Op, OpKind};
use super::compute::RankOrder;
use super::csv::cell_name;
use super::lower::{lower, Deadlock, StageMap};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

/// A custom compute-only schedule that passed [`validate_custom`]: its size, where its
/// stages live, and its programs, compute-only and lowered.
#[derive(Clone, Debug, PartialEq)]
pub struct CustomSchedule {
    pub ranks: u32,
    pub stages: u32,
    pub microbatches: u32,
    /// `rank_of_stage[stage]`: the rank that runs the stage (torch's
    /// `stage_index_to_group_rank`).
    pub rank_of_stage: Vec<u32>,
    /// Each rank's compute-only program, as given.
    pub compute: Vec<RankOrder>,
    /// That program lowered with FSDP, gradient reduction and communication, as
    /// `_PipelineScheduleRuntime` lowers a loaded CSV.
    pub lowered: Vec<Vec<Action>>,
}

impl CustomSchedule {
    /// The stages `rank` runs, ascending.
    pub fn stages_of(&self, rank: u32) -> Vec<u32> {
        (0u32..)
            .zip(&self.rank_of_stage)
            .filter(|(_, &r)| r == rank)
            .map(|(stage, _)| stage)
            .collect()
    }
}

/// One slot of one rank's program; in a CSV file, row `rank + 1` and column `slot + 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slot {
    pub rank: u32,
    pub slot: usize,
}

impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cell = cell_name(self.rank, self.slot);
        write!(f, "rank {}, slot {} (cell {cell})", self.rank, self.slot)
    }
}

/// A rank the lowering cannot take further: where it is stuck, and the actions whose
/// output it waits for that have not run (each with its place in the schedule).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StuckRank {
    pub at: Slot,
    pub action: Action,
    pub waits_for: Vec<(Op, Slot)>,
}

impl fmt::Display for StuckRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: `{}` waits for", self.at, self.action)?;
        for (i, (op, at)) in self.waits_for.iter().enumerate() {
            let sep = if i == 0 { "" } else { " and" };
            write!(f, "{sep} `{op}` (rank {}, slot {}, not run yet)", at.rank, at.slot)?;
        }
        Ok(())
    }
}

/// Why a custom schedule cannot run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleFileError {
    #[error(
        "a pipeline needs at least one rank and one micro-batch, not {ranks} ranks and {microbatches} micro-batches"
    )]
    Empty { ranks: u32, microbatches: u32 },
    #[error("the schedule has {rows} rows, but the pipeline has {ranks} ranks: write one row a rank, rank 0 first (a blank line is a rank too)")]
    Ranks { rows: usize, ranks: u32 },
    #[error("the schedule has no compute action")]
    NoCompute,
    #[error("{at}: `{action}` is not compute; a compute-only schedule holds F, B, I, W and OVERLAP_F_B, and the communication and FSDP actions are added when it is lowered")]
    NotCompute { at: Slot, action: Action },
    #[error("{at}: `{action}` names stage {stage}, but the pipeline has {stages} stages (0 to {})", stages.saturating_sub(1))]
    StageOutOfRange {
        at: Slot,
        action: Action,
        stage: u32,
        stages: u32,
    },
    #[error("{at}: `{action}` names micro-batch {microbatch}, but the step has {microbatches} micro-batches (0 to {})", microbatches.saturating_sub(1))]
    MicrobatchOutOfRange {
        at: Slot,
        action: Action,
        microbatch: u32,
        microbatches: u32,
    },
    #[error("{at}: stage {stage} runs on rank {}, but it already runs on rank {} (slot {}); a stage lives on exactly one rank", at.rank, first.rank, first.slot)]
    StageOnTwoRanks { at: Slot, stage: u32, first: Slot },
    #[error("stage {stage} runs on no rank: the {stages} stages 0 to {} must each be on one", stages.saturating_sub(1))]
    StageOnNoRank { stage: u32, stages: u32 },
    #[error("rank {rank} runs no stage: every pipeline rank must run at least one")]
    IdleRank { rank: u32 },
    #[error("{at}: `{op}` already ran at slot {first}; each micro-batch runs each action of a stage once")]
    Repeated { at: Slot, op: Op, first: usize },
    #[error("{at}: `{op}` runs before `{needs}`, {}", match needs_at { Some(s) => format!("which comes later at slot {s}"), None => "which the rank never runs".into() })]
    TooEarly {
        at: Slot,
        op: Op,
        needs: Op,
        needs_at: Option<usize>,
    },
    #[error("{at}: `{op}` and `{other}` (slot {other_slot}) are both backwards of micro-batch {}; a backward is one B, or one I then one W", op.microbatch.unwrap_or_default())]
    TwoBackwards {
        at: Slot,
        op: Op,
        other: Op,
        other_slot: usize,
    },
    #[error("rank {rank} never runs `{op}`: stage {} needs the forward of each of the step's micro-batches", op.stage)]
    MissingForward { rank: u32, op: Op },
    #[error("rank {rank} never runs the backward of stage {stage}, micro-batch {microbatch}: write `{stage}B{microbatch}`, or `{stage}I{microbatch}` then `{stage}W{microbatch}`")]
    MissingBackward { rank: u32, stage: u32, microbatch: u32 },
    #[error("{at}: `{input}` has no `{weight}` after it; the weight half of a split backward must run too")]
    MissingWeight { at: Slot, input: Op, weight: Op },
    #[error("the schedule deadlocks: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Deadlock(Vec<StuckRank>),
}

impl ScheduleFileError {
    /// The slot the error names first, if it names one.
    pub fn slot(&self) -> Option<Slot> {
        use ScheduleFileError::*;
        match self {
            NotCompute { at, .. }
            | StageOutOfRange { at, .. }
            | MicrobatchOutOfRange { at, .. }
            | StageOnTwoRanks { at, .. }
            | Repeated { at, .. }
            | TooEarly { at, .. }
            | TwoBackwards { at, .. }
            | MissingWeight { at, .. } => Some(*at),
            Deadlock(stuck) => stuck.first().map(|s| s.at),
            _ => None,
        }
    }

    /// The rank the error names first, if it names one.
    pub fn rank(&self) -> Option<u32> {
        match self {
            ScheduleFileError::IdleRank { rank }
            | ScheduleFileError::MissingForward { rank, .. }
            | ScheduleFileError::MissingBackward { rank, .. } => Some(*rank),
            other => other.slot().map(|s| s.rank),
        }
    }
}

/// Checks the compute-only schedule `rows` (one row a rank, `None` an idle slot) for a
/// pipeline of `ranks` ranks and `microbatches` micro-batches, whose stage count is the
/// largest stage index plus one; returns it with its stage map and lowered program.
pub fn validate_custom(
    rows: &[Vec<Option<Action>>],
    ranks: u32,
    microbatches: u32,
) -> Result<CustomSchedule, ScheduleFileError> {
    let largest = rows
        .iter()
        .flatten()
        .flatten()
        .flat_map(Action::ops)
        .map(|op| op.stage)
        .max()
        .ok_or(ScheduleFileError::NoCompute);
    check_size(rows, ranks, microbatches)?;
    validate_custom_stages(rows, ranks, largest?.saturating_add(1), microbatches)
}

/// [`validate_custom`] for a pipeline whose stage count is known (as torch knows it from
/// its stage objects): a stage index at or past `stages` is refused.
pub fn validate_custom_stages(
    rows: &[Vec<Option<Action>>],
    ranks: u32,
    stages: u32,
    microbatches: u32,
) -> Result<CustomSchedule, ScheduleFileError> {
    check_size(rows, ranks, microbatches)?;
    let index = index_ops(rows, stages, microbatches)?;
    let rank_of_stage = stage_map(&index.stage_at, ranks, stages)?;
    check_order(rows, &index.op_at)?;
    check_complete(&index.op_at, &rank_of_stage, microbatches)?;
    let rank_of = |stage: u32| rank_of_stage.get(stage as usize).copied().unwrap_or(0);
    let map = StageMap {
        stages,
        rank_of: &rank_of,
    };
    let lowered = lower(rows, microbatches, &map).map_err(|d| deadlock(d, &index.op_at, stages))?;
    Ok(CustomSchedule {
        ranks,
        stages,
        microbatches,
        rank_of_stage,
        compute: rows.to_vec(),
        lowered,
    })
}

/// Refuses an empty pipeline, and a row count other than the rank count.
fn check_size(rows: &[Vec<Option<Action>>], ranks: u32, microbatches: u32) -> Result<(), ScheduleFileError> {
    if ranks == 0 || microbatches == 0 {
        return Err(ScheduleFileError::Empty { ranks, microbatches });
    }
    if rows.len() != ranks as usize {
        return Err(ScheduleFileError::Ranks {
            rows: rows.len(),
            ranks,
        });
    }
    Ok(())
}

/// Where each compute op and each stage first appears.
struct Index {
    /// Every op's slot; each appears once (a repeat is refused).
    op_at: HashMap<Op, Slot>,
    /// Each stage's first slot, by stage.
    stage_at: BTreeMap<u32, Slot>,
}

/// Every op of `rows` with its slot, refusing a non-compute action, an index out of range,
/// a stage on two ranks and a repeated op, the first in rank then slot order.
fn index_ops(rows: &[Vec<Option<Action>>], stages: u32, microbatches: u32) -> Result<Index, ScheduleFileError> {
    let mut index = Index {
        op_at: HashMap::new(),
        stage_at: BTreeMap::new(),
    };
    for (rank, row) in (0u32..).zip(rows) {
        for (slot, action) in row.iter().enumerate() {
            let Some(action) = action else { continue };
            let at = Slot { rank, slot };
            if !action.is_compute() {
                let action = action.clone();
                return Err(ScheduleFileError::NotCompute { at, action });
            }
            for &op in action.ops() {
                check_range(at, action, op, stages, microbatches)?;
                let first = *index.stage_at.entry(op.stage).or_insert(at);
                if first.rank != rank {
                    return Err(ScheduleFileError::StageOnTwoRanks {
                        at,
                        stage: op.stage,
                        first,
                    });
                }
                if let Some(first) = index.op_at.insert(op, at) {
                    let first = first.slot;
                    return Err(ScheduleFileError::Repeated { at, op, first });
                }
            }
        }
    }
    Ok(index)
}

/// Refuses `op` (of `action`, at `at`) when its stage or micro-batch is out of range.
fn check_range(at: Slot, action: &Action, op: Op, stages: u32, microbatches: u32) -> Result<(), ScheduleFileError> {
    let action = action.clone();
    if op.stage >= stages {
        let stage = op.stage;
        return Err(ScheduleFileError::StageOutOfRange {
            at,
            action,
            stage,
            stages,
        });
    }
    match op.microbatch {
        Some(microbatch) if microbatch >= microbatches => Err(ScheduleFileError::MicrobatchOutOfRange {
            at,
            action,
            microbatch,
            microbatches,
        }),
        _ => Ok(()),
    }
}

/// The rank of every stage `0..stages`, refusing a stage on no rank and a rank with no
/// stage; `stage_at` holds only stages below `stages`.
fn stage_map(stage_at: &BTreeMap<u32, Slot>, ranks: u32, stages: u32) -> Result<Vec<u32>, ScheduleFileError> {
    if stage_at.len() < stages as usize {
        // The keys are distinct and below `stages`: the first gap is the first missing.
        let stage = (0u32..)
            .zip(stage_at.keys())
            .find(|(want, &have)| *want != have)
            .map_or(stage_at.len() as u32, |(want, _)| want);
        return Err(ScheduleFileError::StageOnNoRank { stage, stages });
    }
    let rank_of_stage: Vec<u32> = stage_at.values().map(|at| at.rank).collect();
    let busy: HashSet<u32> = rank_of_stage.iter().copied().collect();
    if let Some(rank) = (0..ranks).find(|r| !busy.contains(r)) {
        return Err(ScheduleFileError::IdleRank { rank });
    }
    Ok(rank_of_stage)
}

/// Each rank's ops in order: a B or I after its F, a W after its I, and never a B and an
/// I (or a B and a W) for one micro-batch.
fn check_order(rows: &[Vec<Option<Action>>], op_at: &HashMap<Op, Slot>) -> Result<(), ScheduleFileError> {
    for (rank, row) in (0u32..).zip(rows) {
        let mut done: HashSet<Op> = HashSet::new();
        for (slot, action) in row.iter().enumerate() {
            for &op in action.iter().flat_map(|a| a.ops()) {
                check_op(Slot { rank, slot }, op, &done, op_at)?;
                done.insert(op);
            }
        }
    }
    Ok(())
}

/// One op of a rank's program against the ops the rank ran before it (`done`).
fn check_op(at: Slot, op: Op, done: &HashSet<Op>, op_at: &HashMap<Op, Slot>) -> Result<(), ScheduleFileError> {
    let other_backward = match op.kind {
        OpKind::Backward => Some(op.with_kind(OpKind::BackwardInput)),
        OpKind::BackwardInput | OpKind::BackwardWeight => Some(op.with_kind(OpKind::Backward)),
        OpKind::Forward => None,
        // Not compute: refused before.
        _ => return Ok(()),
    };
    let conflict = other_backward.and_then(|other| {
        let other_slot = op_at.get(&other)?.slot;
        let twice = done.contains(&other) || op.kind == OpKind::BackwardWeight;
        twice.then_some(ScheduleFileError::TwoBackwards {
            at,
            op,
            other,
            other_slot,
        })
    });
    if let Some(error) = conflict {
        return Err(error);
    }
    let needs = match op.kind {
        OpKind::Backward | OpKind::BackwardInput => op.with_kind(OpKind::Forward),
        OpKind::BackwardWeight => op.with_kind(OpKind::BackwardInput),
        _ => return Ok(()),
    };
    if done.contains(&needs) {
        return Ok(());
    }
    let needs_at = op_at.get(&needs).map(|s| s.slot);
    Err(ScheduleFileError::TooEarly {
        at,
        op,
        needs,
        needs_at,
    })
}

/// Every stage runs every micro-batch's F and its backward (a B, or an I and a W).
fn check_complete(
    op_at: &HashMap<Op, Slot>,
    rank_of_stage: &[u32],
    microbatches: u32,
) -> Result<(), ScheduleFileError> {
    for (stage, &rank) in (0u32..).zip(rank_of_stage) {
        // Stops at the first micro-batch missing, so at most one past the ops there are.
        for microbatch in 0..microbatches {
            let op = |kind| Op::new(stage, kind, microbatch);
            if !op_at.contains_key(&op(OpKind::Forward)) {
                let op = op(OpKind::Forward);
                return Err(ScheduleFileError::MissingForward { rank, op });
            }
            if op_at.contains_key(&op(OpKind::Backward)) {
                continue;
            }
            let Some(&at) = op_at.get(&op(OpKind::BackwardInput)) else {
                return Err(ScheduleFileError::MissingBackward {
                    rank,
                    stage,
                    microbatch,
                });
            };
            if !op_at.contains_key(&op(OpKind::BackwardWeight)) {
                let (input, weight) = (op(OpKind::BackwardInput), op(OpKind::BackwardWeight));
                return Err(ScheduleFileError::MissingWeight { at, input, weight });
            }
        }
    }
    Ok(())
}

/// The lowering's deadlock in the schedule's terms: each stuck rank's compute-only slot and
/// the actions, not yet run, whose output it waits for.
fn deadlock(deadlock: Deadlock, op_at: &HashMap<Op, Slot>, stages: u32) -> ScheduleFileError {
    // Every op appears once, so an action's slot is its first op's; the lowering's own index
    // counts the FSDP actions it added and is only the fallback.
    let slot_of = |rank: u32, index: usize, action: &Action| {
        let slot = action
            .ops()
            .first()
            .and_then(|op| op_at.get(op))
            .map_or(index, |at| at.slot);
        Slot { rank, slot }
    };
    let stuck_at: HashMap<u32, usize> = deadlock
        .blocked
        .iter()
        .map(|(rank, index, action)| (*rank, slot_of(*rank, *index, action).slot))
        .collect();
    let not_run = |at: &Slot| stuck_at.get(&at.rank).is_some_and(|&stuck| at.slot >= stuck);
    let stuck = deadlock
        .blocked
        .into_iter()
        .map(|(rank, index, action)| {
            let waits_for = action
                .ops()
                .iter()
                .filter_map(|&op| input_of(op, stages, op_at))
                .filter(|(_, at)| not_run(at))
                .collect();
            let at = slot_of(rank, index, &action);
            StuckRank { at, action, waits_for }
        })
        .collect();
    ScheduleFileError::Deadlock(stuck)
}

/// The op whose output `op` takes as input, with its slot: a forward takes the previous
/// stage's forward, a backward (or its input half) the next stage's backward or input half.
fn input_of(op: Op, stages: u32, op_at: &HashMap<Op, Slot>) -> Option<(Op, Slot)> {
    let candidates = match op.kind {
        OpKind::Forward if op.stage > 0 => vec![Op {
            stage: op.stage - 1,
            ..op
        }],
        OpKind::Backward | OpKind::BackwardInput if op.stage + 1 < stages => {
            let next = Op {
                stage: op.stage + 1,
                ..op
            };
            vec![next.with_kind(OpKind::Backward), next.with_kind(OpKind::BackwardInput)]
        }
        _ => return None,
    };
    candidates.into_iter().find_map(|c| op_at.get(&c).map(|&at| (c, at)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{read_csv, PipelineProgram, PipelineSchedule, Shape};

    fn rows(text: &str) -> Vec<RankOrder> {
        read_csv(text).unwrap()
    }

    fn op(text: &str) -> Op {
        text.parse::<Action>().unwrap().op().unwrap()
    }

    fn at(rank: u32, slot: usize) -> Slot {
        Slot { rank, slot }
    }

    /// The error for `text` on 2 ranks and 2 micro-batches.
    fn refused(text: &str) -> ScheduleFileError {
        validate_custom(&rows(text), 2, 2).unwrap_err()
    }

    #[test]
    fn built_in_schedules_pass_with_their_placement_and_lowering() {
        for (schedule, v) in [
            (PipelineSchedule::OneFOneB, 1),
            (PipelineSchedule::ZBVZeroBubble, 2),
            (PipelineSchedule::DualPipeV, 2),
        ] {
            let shape = Shape {
                ranks: 4,
                stages_per_rank: v,
                microbatches: 8,
            };
            let program = PipelineProgram::build(schedule, shape).unwrap();
            let custom = validate_custom(&program.compute, 4, 8).unwrap();
            let placed: Vec<u32> = (0..shape.stages()).map(|s| program.rank_of_stage[s as usize]).collect();
            assert_eq!(custom.rank_of_stage, placed, "{schedule}");
            assert_eq!(custom.stages, shape.stages());
            assert_eq!(custom.stages_of(0), program.stages_of(0));
            assert_eq!(custom.lowered, program.lowered, "{schedule}");
        }
    }

    #[test]
    fn a_custom_placement_is_inferred() {
        // Stage 0 on rank 1, stage 1 on rank 0; a split backward on stage 0.
        let custom = validate_custom(&rows("1F0,1F1,1B0,1B1\n0F0,0F1,,0I0,0I1,0W1,0W0\n"), 2, 2).unwrap();
        assert_eq!(custom.rank_of_stage, vec![1, 0]);
        assert_eq!(
            custom.lowered[1][..3]
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["0UNSHARD", "0F0", "0SEND_F0"]
        );
    }

    #[test]
    fn the_size_must_match() {
        let two = "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n";
        assert!(validate_custom(&rows(two), 2, 2).is_ok());
        assert_eq!(
            validate_custom(&rows(two), 3, 2).unwrap_err(),
            ScheduleFileError::Ranks { rows: 2, ranks: 3 }
        );
        assert_eq!(
            validate_custom(&rows(two), 0, 2).unwrap_err(),
            ScheduleFileError::Empty {
                ranks: 0,
                microbatches: 2
            }
        );
        assert_eq!(
            validate_custom(&rows(",\n\n"), 2, 2).unwrap_err(),
            ScheduleFileError::NoCompute
        );
        let err = validate_custom_stages(&rows(two), 2, 1, 2).unwrap_err();
        assert!(
            matches!(
                err,
                ScheduleFileError::StageOutOfRange {
                    stage: 1,
                    stages: 1,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(err.slot(), Some(at(1, 0)));
        let err = validate_custom_stages(&rows(two), 2, 3, 2).unwrap_err();
        assert_eq!(err, ScheduleFileError::StageOnNoRank { stage: 2, stages: 3 });
    }

    #[test]
    fn each_action_is_compute_and_in_range() {
        let err = refused("0F0,0SEND_F0\n1F0\n");
        assert_eq!(err.slot(), Some(at(0, 1)));
        assert!(
            err.to_string()
                .starts_with("rank 0, slot 1 (cell B1): `0SEND_F0` is not compute"),
            "{err}"
        );
        let err = refused("0F0,0F1,0B0,0B1\n1F0,1F2,1B0,1B1\n");
        assert!(
            matches!(err, ScheduleFileError::MicrobatchOutOfRange { microbatch: 2, .. }),
            "{err}"
        );
        assert_eq!(err.slot(), Some(at(1, 1)));
    }

    #[test]
    fn a_stage_runs_on_one_rank_and_every_rank_runs_one() {
        let err = refused("0F0,0F1,0B0,0B1,1F1\n1F0,,1B0,1B1\n");
        assert_eq!(
            err,
            ScheduleFileError::StageOnTwoRanks {
                at: at(1, 0),
                stage: 1,
                first: at(0, 4)
            }
        );
        let err = refused("0F0,0F1,0B0,0B1\n2F0,2F1,2B0,2B1\n");
        assert_eq!(err, ScheduleFileError::StageOnNoRank { stage: 1, stages: 3 });
        let err = validate_custom(&rows("0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n,,\n"), 3, 2).unwrap_err();
        assert_eq!(err, ScheduleFileError::IdleRank { rank: 2 });
    }

    #[test]
    fn each_micro_batch_runs_f_then_one_backward() {
        let cases = [
            ("0F0,0F1,0B0,0B1,0F0\n1F0,1F1,1B0,1B1\n", "0F0 repeated", at(0, 4)),
            ("0F0,0B1,0F1,0B0\n1F0,1F1,1B0,1B1\n", "B before F", at(0, 1)),
            ("0F0,0B0,0B1\n1F0,1F1,1B0,1B1\n", "no F", at(0, 2)),
            ("0F0,0F1,0B0,0I1,0W1\n1F0,1F1,1B0,1B1\n", "ok", at(0, 0)),
            ("0F0,0F1,0B0,0W1,0I1\n1F0,1F1,1B0,1B1\n", "W before I", at(0, 3)),
            ("0F0,0F1,0B0,0I1,0B1\n1F0,1F1,1B0,1B1\n", "B and I", at(0, 4)),
            ("0F0,0F1,0B0,0B1,0W1\n1F0,1F1,1B0,1B1\n", "W after B", at(0, 4)),
            ("0F0,0F1,0B0,0I1\n1F0,1F1,1B0,1B1\n", "no W", at(0, 3)),
        ];
        for (text, what, slot) in cases {
            let result = validate_custom(&rows(text), 2, 2);
            if what == "ok" {
                assert!(result.is_ok(), "{what}: {result:?}");
                continue;
            }
            let err = result.unwrap_err();
            assert_eq!(err.slot(), Some(slot), "{what}: {err}");
        }
        let err = refused("0F0,0B0,0B1\n1F0,1F1,1B0,1B1\n");
        let needs = op("0F1");
        assert_eq!(
            err,
            ScheduleFileError::TooEarly {
                at: at(0, 2),
                op: op("0B1"),
                needs,
                needs_at: None
            }
        );
        assert!(err.to_string().ends_with("which the rank never runs"), "{err}");
        let err = refused("0F0,0B1,0F1,0B0\n1F0,1F1,1B0,1B1\n");
        assert!(
            err.to_string()
                .ends_with("runs before `0F1`, which comes later at slot 2"),
            "{err}"
        );
    }

    #[test]
    fn every_micro_batch_is_there() {
        let err = refused("0F0,0B0\n1F0,1F1,1B0,1B1\n");
        assert_eq!(err, ScheduleFileError::MissingForward { rank: 0, op: op("0F1") });
        assert_eq!(err.rank(), Some(0));
        let err = refused("0F0,0F1,0B0,0B1\n1F0,1F1,1B1\n");
        assert_eq!(
            err,
            ScheduleFileError::MissingBackward {
                rank: 1,
                stage: 1,
                microbatch: 0
            }
        );
    }

    #[test]
    fn a_deadlock_names_each_stuck_rank_and_slot() {
        // Rank 0 waits for 1B0, which rank 1 runs only after 1F1, whose input rank 0 sends
        // after 0B0.
        let err = refused("0F0,,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n");
        let ScheduleFileError::Deadlock(stuck) = &err else {
            panic!("{err}");
        };
        assert_eq!(stuck.len(), 2);
        assert_eq!(
            (stuck[0].at, stuck[0].waits_for.clone()),
            (at(0, 2), vec![(op("1B0"), at(1, 2))])
        );
        assert_eq!(
            (stuck[1].at, stuck[1].waits_for.clone()),
            (at(1, 1), vec![(op("0F1"), at(0, 3))])
        );
        assert_eq!(
            err.to_string(),
            "the schedule deadlocks: rank 0, slot 2 (cell C1): `0B0` waits for `1B0` (rank 1, slot 2, not run yet); \
             rank 1, slot 1 (cell B2): `1F1` waits for `0F1` (rank 0, slot 3, not run yet)"
        );
    }
}
