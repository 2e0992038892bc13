//! `plan --auto` of a pipeline spec: the fastest pipeline that fits the memory budget,
//! over the knobs the spec leaves open.
//!
//! The space: the split of the pipeline and shard axes (P x S fixed, replicate and tensor
//! kept, the global batch kept: `batch.per_rank` follows the data-parallel ranks), the
//! schedule, the stages a rank (V: 1 for GPipe and 1F1B, 2 for the V schedules, 2 to 4 for
//! the looped ones), the micro-batches (M among P, 2P, 4P, 8P and the whole batch, where
//! they divide it), and activation checkpointing (none or full). A knob the spec writes
//! stays as written. The stages of one split, micro-batch and checkpointing are cut and
//! planned once and shared by every schedule over them; a schedule torch refuses at a size
//! is left out. The objective is the pipeline's step time; ties go to lower memory.

use super::plan::{assemble, plan_stages, program_and_split, PipelinePlan, Stages};
use crate::PlanError;
use shardplan_frontends::{ActivationCheckpointing, Origin, ParallelConfig, PipelineSchedule};
use shardplan_models::{trace, ModelConfig};
use std::collections::HashMap;

/// Which pipeline knobs the spec writes (they stay as written).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PipelineFixed {
    pub schedule: bool,
    pub microbatches: bool,
    pub stages_per_rank: bool,
    pub checkpointing: bool,
}

impl PipelineFixed {
    /// The knobs `origin` records as written; the stages a rank are fixed by
    /// `stages_per_rank`, `layers_per_stage`, `modules_per_stage` or `csv`.
    pub fn from_origin(origin: &Origin) -> PipelineFixed {
        PipelineFixed {
            schedule: origin.has("pipeline.schedule") || origin.has("pipeline.csv"),
            microbatches: origin.has("pipeline.microbatches"),
            stages_per_rank: ["stages_per_rank", "layers_per_stage", "modules_per_stage", "csv"]
                .iter()
                .any(|f| origin.has(&format!("pipeline.{f}"))),
            checkpointing: origin.has("activation_checkpointing"),
        }
    }
}

/// One evaluated pipeline.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineCandidate {
    pub pipeline: u64,
    pub shard: u64,
    pub schedule: PipelineSchedule,
    pub stages_per_rank: u32,
    pub microbatches: u32,
    pub checkpointing: ActivationCheckpointing,
    pub step_s: f64,
    pub bubble: f64,
    /// The largest rank's device bytes (allocated peak, CUDA context, NCCL buffers).
    pub device: u64,
    pub fits: bool,
}

/// The outcome of a pipeline search.
#[derive(Clone, Debug)]
pub struct PipelineAuto {
    pub winner: PipelinePlan,
    pub config: ParallelConfig,
    /// Every evaluated candidate, the fitting ones first, each part fastest first.
    pub candidates: Vec<PipelineCandidate>,
    /// Sizes left out because torch refuses the schedule there (or the split fails).
    pub refused: usize,
}

/// Searches `base`'s open pipeline knobs for `model` within `budget` device bytes a rank.
pub fn search_pipeline(
    model: &ModelConfig,
    base: &ParallelConfig,
    fixed: PipelineFixed,
    budget: u64,
) -> Result<PipelineAuto, PlanError> {
    let pipeline = base.pipeline.as_ref().ok_or_else(|| PlanError::Pipeline {
        field: "pipeline",
        message: "the spec has no pipeline to search".into(),
        fix: "add a pipeline section, or search without one".into(),
    })?;
    let mut found: Vec<(PipelineCandidate, ParallelConfig)> = Vec::new();
    let mut refused = 0;
    for c in split_options(base) {
        for ac in checkpointing_options(base, fixed) {
            for m in microbatch_options(&c, pipeline.microbatches, fixed) {
                let mut config = c.clone();
                config.activation_checkpointing = ac;
                if let Some(p) = config.pipeline.as_mut() {
                    p.microbatches = m;
                }
                let forward = trace(model, config.trace_options()).map_err(|e| PlanError::Graph(e.to_string()))?;
                let mut stages: HashMap<Vec<Vec<String>>, Stages> = HashMap::new();
                for (schedule, v) in schedule_options(pipeline.schedule, pipeline.stages_per_rank, fixed) {
                    let mut candidate = config.clone();
                    if let Some(p) = candidate.pipeline.as_mut() {
                        p.schedule = schedule;
                        p.stages_per_rank = v.or(p.stages_per_rank);
                    }
                    let Ok((program, modules)) = program_and_split(&forward, &candidate, None) else {
                        refused += 1;
                        continue;
                    };
                    let planned = match stages.get(&modules) {
                        Some(s) => s.clone(),
                        None => {
                            let s = plan_stages(&forward, &candidate, modules.clone())?;
                            stages.insert(modules, s.clone());
                            s
                        }
                    };
                    let plan = assemble(program, &planned, &candidate)?;
                    found.push((describe(&plan, &candidate, budget), candidate));
                }
            }
        }
    }
    found.sort_by(|(a, _), (b, _)| {
        b.fits
            .cmp(&a.fits)
            .then(a.step_s.total_cmp(&b.step_s))
            .then(a.device.cmp(&b.device))
    });
    let Some((best, config)) = found.first().cloned() else {
        return Err(PlanError::Pipeline {
            field: "pipeline",
            message: "torch refuses every pipeline in the search space at this size".into(),
            fix: "give more micro-batches (a larger batch.per_rank), or fewer pipeline ranks".into(),
        });
    };
    if !best.fits {
        let smallest = found.iter().map(|(c, _)| c.device).min().unwrap_or(best.device);
        return Err(PlanError::Pipeline {
            field: "pipeline",
            message: format!(
                "no pipeline of the search fits {} a rank: the smallest needs {}",
                crate::print::bytes(budget),
                crate::print::bytes(smallest)
            ),
            fix: "add ranks, checkpoint activations, or plan with a larger --memory-budget".into(),
        });
    }
    let forward = trace(model, config.trace_options()).map_err(|e| PlanError::Graph(e.to_string()))?;
    let winner = super::plan_pipeline(&forward, &config, None)?;
    Ok(PipelineAuto {
        winner,
        config,
        candidates: found.into_iter().map(|(c, _)| c).collect(),
        refused,
    })
}

/// The candidate's figures from its plan.
fn describe(plan: &PipelinePlan, config: &ParallelConfig, budget: u64) -> PipelineCandidate {
    let device = plan.largest_rank().map_or(0, |(_, device)| device);
    let p = &plan.program.shape;
    PipelineCandidate {
        pipeline: config.mesh.pipeline,
        shard: config.mesh.shard,
        schedule: config
            .pipeline
            .as_ref()
            .map_or(PipelineSchedule::OneFOneB, |p| p.schedule),
        stages_per_rank: p.stages_per_rank,
        microbatches: p.microbatches,
        checkpointing: config.activation_checkpointing,
        step_s: plan.step_s,
        bubble: plan.timeline.bubble(),
        device,
        fits: device <= budget,
    }
}

/// The pipeline x shard splits of `base`'s P x S, the global batch kept (each
/// data-parallel rank's `per_rank` follows the shard axis; a split it does not divide is
/// left out). P is at least 2.
fn split_options(base: &ParallelConfig) -> Vec<ParallelConfig> {
    let ps = base.mesh.pipeline * base.mesh.shard;
    let global = base.batch.per_rank * base.mesh.data_parallel();
    (2..=ps)
        .filter(|p| ps.is_multiple_of(*p))
        .filter_map(|p| {
            let mut c = base.clone();
            c.mesh.pipeline = p;
            c.mesh.shard = ps / p;
            let data = c.mesh.data_parallel();
            global.is_multiple_of(data).then(|| {
                c.batch.per_rank = global / data;
                c
            })
        })
        .collect()
}

fn checkpointing_options(base: &ParallelConfig, fixed: PipelineFixed) -> Vec<ActivationCheckpointing> {
    if fixed.checkpointing {
        vec![base.activation_checkpointing]
    } else {
        vec![ActivationCheckpointing::None, ActivationCheckpointing::Full]
    }
}

/// M among P, 2P, 4P, 8P and the whole batch, where it divides `batch.per_rank`.
fn microbatch_options(c: &ParallelConfig, written: u64, fixed: PipelineFixed) -> Vec<u64> {
    let per_rank = c.batch.per_rank;
    if fixed.microbatches {
        return if per_rank.is_multiple_of(written) {
            vec![written]
        } else {
            Vec::new()
        };
    }
    let p = c.mesh.pipeline;
    let mut ms: Vec<u64> = [p, 2 * p, 4 * p, 8 * p, per_rank]
        .into_iter()
        .filter(|&m| m >= 1 && m <= per_rank && per_rank.is_multiple_of(m))
        .collect();
    ms.sort_unstable();
    ms.dedup();
    ms
}

/// (schedule, stages a rank) pairs: `None` leaves V to the split or the schedule's default.
fn schedule_options(
    written: PipelineSchedule,
    v: Option<u64>,
    fixed: PipelineFixed,
) -> Vec<(PipelineSchedule, Option<u64>)> {
    let schedules: Vec<PipelineSchedule> = if fixed.schedule {
        vec![written]
    } else {
        PipelineSchedule::ALL.to_vec()
    };
    let mut out = Vec::new();
    for s in schedules {
        let vs: Vec<Option<u64>> = if fixed.stages_per_rank {
            vec![v]
        } else if s.is_single_stage() {
            vec![Some(1)]
        } else if matches!(s, PipelineSchedule::ZBVZeroBubble | PipelineSchedule::DualPipeV) {
            vec![Some(2)]
        } else {
            vec![Some(2), Some(3), Some(4)]
        };
        out.extend(vs.into_iter().map(|v| (s, v)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardplan_frontends::{parse_parallel_spec, Source};

    fn spec(yaml: &str) -> (ParallelConfig, PipelineFixed) {
        let (config, origin) = parse_parallel_spec(&Source::from_text("p.yaml", yaml)).unwrap();
        (config, PipelineFixed::from_origin(&origin))
    }

    fn llama(layers: u64) -> ModelConfig {
        match shardplan_models::preset("tiny-llama").unwrap() {
            ModelConfig::Llama(mut c) => {
                c.n_layers = layers;
                ModelConfig::Llama(c)
            }
            _ => unreachable!(),
        }
    }

    #[test]
    fn the_winner_is_the_fastest_candidate_that_fits_and_plans_alike() {
        let (base, fixed) = spec("mesh: {pipeline: 2, shard: 2}\ngpus_per_node: 4\nbatch: {per_rank: 8, seq_len: 64}\npipeline: {schedule: 1F1B, microbatches: 4}\n");
        let fixed = PipelineFixed {
            schedule: false,
            microbatches: false,
            ..fixed
        };
        let found = search_pipeline(&llama(6), &base, fixed, u64::MAX).unwrap();
        let best = &found.candidates[0];
        assert!(found.candidates.iter().all(|c| c.step_s >= best.step_s));
        // Several schedules, splits and micro-batch counts were compared.
        let schedules: std::collections::HashSet<_> = found.candidates.iter().map(|c| c.schedule).collect();
        assert!(schedules.len() >= 4, "{schedules:?}");
        assert!(found.candidates.iter().any(|c| c.pipeline == 4));
        // The winner's plan is the plan of its config, and its step the candidate's.
        assert_eq!(found.winner.step_s, best.step_s);
        assert_eq!(found.config.pipeline.as_ref().unwrap().schedule, best.schedule);
        // The global batch is kept: 16 sequences over the data-parallel ranks.
        assert_eq!(found.config.batch.per_rank * found.config.mesh.data_parallel(), 16);
    }

    #[test]
    fn written_knobs_stay_and_a_tight_budget_picks_a_smaller_pipeline() {
        let (base, fixed) = spec("mesh: {pipeline: 2, shard: 2}\ngpus_per_node: 4\nbatch: {per_rank: 8, seq_len: 64}\npipeline: {schedule: 1F1B, microbatches: 4}\n");
        assert!(fixed.schedule && fixed.microbatches && !fixed.checkpointing);
        let all = search_pipeline(&llama(6), &base, fixed, u64::MAX).unwrap();
        assert!(all
            .candidates
            .iter()
            .all(|c| c.schedule == PipelineSchedule::OneFOneB && c.microbatches == 4));
        // Under a budget between the candidates' memories, the winner is the fastest of
        // those within it.
        let mut sizes: Vec<u64> = all.candidates.iter().map(|c| c.device).collect();
        sizes.sort_unstable();
        sizes.dedup();
        assert!(sizes.len() >= 2, "{sizes:?}");
        let budget = sizes[sizes.len() / 2];
        let tight = search_pipeline(&llama(6), &base, fixed, budget).unwrap();
        let fastest_within = all
            .candidates
            .iter()
            .filter(|c| c.device <= budget)
            .map(|c| c.step_s)
            .fold(f64::INFINITY, f64::min);
        assert!(tight.candidates[0].device <= budget);
        assert_eq!(tight.candidates[0].step_s, fastest_within);
        let none = search_pipeline(&llama(6), &base, fixed, 1).unwrap_err().to_string();
        assert!(none.contains("fits"), "{none}");
    }
}
