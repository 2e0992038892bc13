//! Validation: the loss of the current weights on a validation token file, measured on
//! every rank with the planner's forward program (`planner::plan_forward`): the same
//! groups, all-gathers and frees as the training step's forward, and no backward,
//! gradient reduction or optimizer step, so the weights and the optimizer state are left
//! exactly as they were.
//!
//! Every evaluation takes the same `batches` global batches (the validation file's first
//! `batches` positions of its seeded windows), each split by rank as training batches are;
//! the validation loss is the mean of every rank's loss on every batch, which is the mean
//! over the global batches whatever the mesh.

use crate::runtime::rank::{run_step, ProgramTables, RankState, Shared};
use crate::train::data::{mesh_rows, DataSource, TokenFile};
use crate::ExecError;
use candle_core::{Device, Tensor};
use shardplan_frontends::{DataSource as DataSpec, ParallelConfig};
use shardplan_ir::JointGraph;
use shardplan_models::ModelConfig;
use shardplan_planner::{ExecOrder, Plan, Runner};
use std::collections::HashMap;

/// Collective tags of evaluations start here (training steps count up from 0 below it).
const EVAL_TAGS: u64 = 1 << 31;

/// What a trainer needs to evaluate: the forward program and each local rank's view of
/// the validation file.
pub(crate) struct Validation {
    pub(crate) shared: Shared,
    /// The forward program's tables, built once.
    tables: ProgramTables,
    /// One source per local rank (each yields the global batch; the rank takes its rows).
    data: Vec<Box<dyn DataSource>>,
    pub(crate) every: u64,
    batches: u64,
    runs: u64,
}

/// The positions in `exec.order` where each of `plan`'s steps starts, checking that the
/// steps follow the execution order; returns them and how many entries the steps cover.
pub(crate) fn step_starts(plan: &Plan, exec: &ExecOrder) -> Result<(Vec<usize>, usize), ExecError> {
    let mut starts = Vec::with_capacity(plan.steps.len());
    let mut pos = 0usize;
    for s in &plan.steps {
        starts.push(pos);
        let copy = s.phase == shardplan_planner::Phase::Recompute;
        for i in s.nodes.iter().flat_map(|r| r.clone()) {
            if exec.order().get(pos) != Some(&(shardplan_ir::NodeId(i), copy)) {
                return Err(ExecError::Unsupported(format!(
                    "the plan's step {} does not match this model's graph (node n{i}): was it made for another model or batch shape?",
                    s.id
                )));
            }
            pos += 1;
        }
    }
    Ok((starts, pos))
}

impl Validation {
    /// The validation of `config` (`None` when its data has no `val` file), for `local`
    /// ranks running `train` (whose groups the forward program must share).
    pub(crate) fn new(
        model: &ModelConfig,
        config: &ParallelConfig,
        joint: &JointGraph,
        train: &Plan,
        local: usize,
        rows: usize,
        seq: usize,
    ) -> Result<Option<Validation>, ExecError> {
        let DataSpec::Tokens {
            dtype, eval: Some(e), ..
        } = &config.data
        else {
            return Ok(None);
        };
        let vocab = match model {
            ModelConfig::Llama(c) => c.vocab_size,
            ModelConfig::Gpt2(c) => c.vocab_size,
            ModelConfig::Mlp(_) => {
                return Err(ExecError::Unsupported(
                    "validation files feed language models; the mlp family trains on `data: synthetic`".into(),
                ))
            }
        };
        let mut data: Vec<Box<dyn DataSource>> = Vec::with_capacity(local);
        for _ in 0..local {
            data.push(Box::new(TokenFile::open(
                &e.path,
                *dtype,
                vocab,
                rows,
                seq,
                config.seed,
            )?));
        }
        let plan = shardplan_planner::plan_forward(joint, config, e.batches)
            .map_err(|x| ExecError::Unsupported(format!("planning the validation forward: {x}")))?;
        let same = plan.groups.len() == train.groups.len()
            && plan.groups.iter().zip(&train.groups).all(|(a, b)| a.layout == b.layout);
        if !same {
            return Err(ExecError::Unsupported(
                "the plan's groups differ from what its specs give (was it edited?); validation needs the specs' own groups: re-run `shardplan plan`".into(),
            ));
        }
        let exec = ExecOrder::new(joint, config.activation_checkpointing, Runner::Shardplan);
        let (step_start, _) = step_starts(&plan, &exec)?;
        let shared = Shared {
            plan,
            joint: joint.clone(),
            exec,
            step_start,
            clip: None,
            faults: Vec::new(),
            ordered_launch: false,
            profile: false,
            native: false,
            device_clock: false,
        };
        Ok(Some(Validation {
            tables: ProgramTables::new(&shared)?,
            shared,
            data,
            every: e.every,
            batches: e.batches,
            runs: 0,
        }))
    }

    /// Runs the forward program on `ranks` (this process's) over the validation batches;
    /// returns each local rank's (rank, loss per batch). Each rank takes the rows of its
    /// data-parallel index on `mesh`, and under a context `layout` its rows of their
    /// sequences.
    pub(crate) fn run(
        &mut self,
        ranks: &mut [RankState],
        abort: &crate::comm::Abort,
        mesh: &shardplan_planner::Mesh,
        layout: Option<shardplan_ir::ContextLayout>,
        device: &Device,
    ) -> Result<Vec<(u64, Vec<f32>)>, ExecError> {
        let mut batches: Vec<Vec<HashMap<String, Tensor>>> = Vec::with_capacity(ranks.len());
        for (d, state) in self.data.iter_mut().zip(ranks.iter()) {
            let rank = state.rank;
            d.seek(0);
            let mut mine = Vec::with_capacity(self.batches as usize);
            for _ in 0..self.batches {
                let b = d.next_batch(device)?;
                mine.push(mesh_rows(b.inputs, mesh, layout, rank)?);
            }
            batches.push(mine);
        }
        self.runs += 1;
        let tag_step = EVAL_TAGS + self.runs;
        let (shared, tables) = (&self.shared, &self.tables);
        let results: Vec<Result<(u64, Vec<f32>), ExecError>> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter_mut()
                .zip(&batches)
                .map(|(state, b)| {
                    s.spawn(move || {
                        let out = run_step(shared, tables, state, abort, b, 0.0, tag_step)?;
                        Ok((state.rank, out.losses))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(ExecError::Internal("a rank thread panicked".into())))
                })
                .collect()
        });
        let mut out = Vec::with_capacity(results.len());
        for r in results {
            match r {
                Ok(x) if x.1.len() == self.batches as usize => out.push(x),
                Ok(x) => {
                    return Err(ExecError::Internal(format!(
                        "rank {} measured {} validation losses, not {}",
                        x.0,
                        x.1.len(),
                        self.batches
                    )))
                }
                Err(e) => {
                    return Err(match abort.reason() {
                        Some(reason) => ExecError::Aborted(reason),
                        None => e,
                    })
                }
            }
        }
        Ok(out)
    }
}
