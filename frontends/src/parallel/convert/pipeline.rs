//! `mesh.pipeline` and the `pipeline:` section: the schedule, its micro-batches and the
//! stage split, with the rules that need no model (torch's and torchtitan's on stages a
//! rank, the batch's split); the rules that count the model's layers are the planner's.

use super::super::file::{MeshFile, PipelineFile};
use super::*;
use crate::parallel::{Pipeline, PipelineSchedule, StageSplit};
use std::path::Path;

/// The pipeline axis, 1 unless written.
pub(super) fn pipeline_axis(o: &mut Origin, mesh: &MeshFile) -> Result<u64, SpecError> {
    record(o, "mesh.pipeline", &mesh.pipeline);
    at_least_1(o, "mesh.pipeline", mesh.pipeline.as_ref().map_or(1, |s| s.value))
}

/// The pipeline's schedule and stages: `None` without a pipeline axis, torchtitan's
/// defaults (1F1B, micro-batches of one sequence) where the section is absent.
pub(super) fn pipeline(
    o: &mut Origin,
    spec: Option<Spanned<PipelineFile>>,
    ranks: u64,
    per_rank: u64,
    spec_path: &Path,
) -> Result<Option<Pipeline>, SpecError> {
    if let Some(s) = &spec {
        o.insert("pipeline", pos(s));
        if ranks == 1 {
            return Err(o.error(
                "pipeline",
                "a pipeline schedule is written, but the mesh has no pipeline axis",
                "set mesh.pipeline to the number of pipeline ranks (2 or more), or remove `pipeline`",
            ));
        }
    }
    if ranks == 1 {
        return Ok(None);
    }
    let file = spec.map(|s| s.value).unwrap_or_default();
    record(o, "pipeline.schedule", &file.schedule);
    let schedule = file.schedule.as_ref().map_or(PipelineSchedule::OneFOneB, |s| s.value);
    let microbatches = microbatches(o, &file, per_rank)?;
    let stages_per_rank = stages_per_rank(o, &file, schedule)?;
    let split = split(o, &file)?;
    if let (StageSplit::Modules(stages), Some(v)) = (&split, stages_per_rank) {
        check_module_stages(o, stages.len() as u64, ranks, Some(v))?;
    } else if let StageSplit::Modules(stages) = &split {
        check_module_stages(o, stages.len() as u64, ranks, None)?;
    }
    record(o, "pipeline.csv", &file.csv);
    let csv = file.csv.map(|c| {
        let base = spec_path.parent().unwrap_or_else(|| Path::new(""));
        base.join(c.value)
    });
    Ok(Some(Pipeline {
        schedule,
        microbatches,
        stages_per_rank,
        split,
        csv,
    }))
}

/// Micro-batches a step (`batch.per_rank` unless written: micro-batches of one sequence,
/// torchtitan's default), dividing `batch.per_rank`.
fn microbatches(o: &mut Origin, file: &PipelineFile, per_rank: u64) -> Result<u64, SpecError> {
    record(o, "pipeline.microbatches", &file.microbatches);
    let m = at_least_1(
        o,
        "pipeline.microbatches",
        file.microbatches.as_ref().map_or(per_rank, |s| s.value),
    )?;
    if !per_rank.is_multiple_of(m) {
        let field = if o.has("pipeline.microbatches") {
            "pipeline.microbatches"
        } else {
            "batch.per_rank"
        };
        return Err(o.error(
            field,
            format!("batch.per_rank ({per_rank} sequences) does not split into {m} equal micro-batches"),
            format!("set pipeline.microbatches to a divisor of batch.per_rank ({per_rank}), or batch.per_rank to a multiple of {m}"),
        ));
    }
    Ok(m)
}

/// Stages a rank where written: 1 for GPipe and 1F1B, 2 for the V schedules, at least 2
/// for the other multi-stage schedules (torchtitan refuses one).
fn stages_per_rank(o: &mut Origin, file: &PipelineFile, schedule: PipelineSchedule) -> Result<Option<u64>, SpecError> {
    record(o, "pipeline.stages_per_rank", &file.stages_per_rank);
    let Some(v) = &file.stages_per_rank else {
        return Ok(None);
    };
    let v = at_least_1(o, "pipeline.stages_per_rank", v.value)?;
    let rule = match schedule {
        s if s.is_single_stage() && v != 1 => Some("runs one stage a rank"),
        PipelineSchedule::ZBVZeroBubble | PipelineSchedule::DualPipeV if v != 2 => {
            Some("places exactly two stages a rank in a V")
        }
        s if !s.is_single_stage() && v < 2 => Some("is a multi-stage schedule and needs at least two stages a rank"),
        _ => None,
    };
    if let Some(rule) = rule {
        return Err(o.error(
            "pipeline.stages_per_rank",
            format!("{schedule} {rule}, but stages_per_rank is {v}"),
            format!(
                "remove pipeline.stages_per_rank ({schedule}'s default is {}), or pick another schedule",
                schedule.default_stages_per_rank()
            ),
        ));
    }
    Ok(Some(v))
}

/// The stage split: module lists, or torchtitan's layer weighting (not both).
fn split(o: &mut Origin, file: &PipelineFile) -> Result<StageSplit, SpecError> {
    record(o, "pipeline.layers_per_stage", &file.layers_per_stage);
    record(o, "pipeline.first_stage_less_layers", &file.first_stage_less_layers);
    record(o, "pipeline.last_stage_less_layers", &file.last_stage_less_layers);
    record(o, "pipeline.modules_per_stage", &file.modules_per_stage);
    if let Some(modules) = &file.modules_per_stage {
        if o.has("pipeline.layers_per_stage") {
            return Err(o.error(
                "pipeline.modules_per_stage",
                "the stages are given both as module lists and by layers_per_stage",
                "keep one: modules_per_stage names every stage's modules, layers_per_stage lets shardplan split",
            ));
        }
        if let Some(i) = modules.value.iter().position(Vec::is_empty) {
            return Err(o.error(
                "pipeline.modules_per_stage",
                format!("stage {i} has no modules"),
                "give every stage at least one module (`shardplan inspect` lists the model's)",
            ));
        }
        return Ok(StageSplit::Modules(modules.value.clone()));
    }
    let layers_per_stage = file
        .layers_per_stage
        .as_ref()
        .map(|s| at_least_1(o, "pipeline.layers_per_stage", s.value))
        .transpose()?;
    Ok(StageSplit::Layers {
        layers_per_stage,
        first_stage_less_layers: file.first_stage_less_layers.as_ref().map_or(1, |s| s.value),
        last_stage_less_layers: file.last_stage_less_layers.as_ref().map_or(1, |s| s.value),
    })
}

/// Module lists that make whole stages for every rank (and `stages_per_rank` of them a
/// rank, where written).
fn check_module_stages(o: &Origin, stages: u64, ranks: u64, stages_per_rank: Option<u64>) -> Result<(), SpecError> {
    if !stages.is_multiple_of(ranks) {
        return Err(o.error(
            "pipeline.modules_per_stage",
            format!("{stages} stages do not divide over {ranks} pipeline ranks"),
            format!("list a multiple of {ranks} stages"),
        ));
    }
    if let Some(v) = stages_per_rank.filter(|&v| v * ranks != stages) {
        return Err(o.error(
            "pipeline.modules_per_stage",
            format!(
                "{stages} stages over {ranks} pipeline ranks are {} a rank, but stages_per_rank is {v}",
                stages / ranks
            ),
            format!("list {} stages, or remove pipeline.stages_per_rank", v * ranks),
        ));
    }
    Ok(())
}
