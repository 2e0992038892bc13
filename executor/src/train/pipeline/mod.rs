//! Pipeline-parallel training on threads: each rank of the mesh (pipeline x replicate x
//! shard) runs its pipeline rank's lowered program (torch.distributed.pipelining's
//! actions) over its stages' graphs, receiving its input activation from the previous
//! stage's rank and its output gradient from the next.
//!
//! A stage keeps a micro-batch's forward values until that micro-batch's backward (B, or
//! its W after an I) and sums its parameters' gradients over the step's micro-batches,
//! scaled by 1 / M as torch's schedules scale them. With FSDP inside the stages
//! (`shard.rs`), UNSHARD gathers a stage's parameters, which stay whole across
//! micro-batches, and REDUCE_GRAD averages its gradients over the data-parallel ranks
//! once; each rank steps the optimizer on its chunks. The gradient norm and the loss are
//! summed over the world. So a step equals one rank's step over the same global batch.
//! Tensor parallelism runs inside the stages; expert parallelism is not run here yet:
//! such a spec is refused.

mod groups;
#[cfg(feature = "cuda")]
pub mod nccl;
mod rank;
mod shard;
mod threads;

pub(crate) use rank::Rank;
pub(crate) use shard::Shard;

pub use groups::{nccl_openings, GroupMembers, NcclOpening, OpeningKind};
pub use threads::place_threads;

use crate::comm::p2p::PointToPoint;
use crate::comm::{Abort, Collectives};
use crate::cpu::kernels::Ctx;
use crate::cpu::tensor::TensorGroup;
use crate::runtime::optim::{base_lr, lr_at};
use crate::train::data::{rank_rows, DataSource};
use crate::train::trainer::data_source;
use crate::ExecError;
use candle_core::{Device, Tensor};
use rank::{Stage, StepRun};
use shardplan_frontends::{MeshShape, ParallelConfig};
use shardplan_models::{trace, ModelConfig};
use shardplan_planner::pipeline::{stage_graphs, PipelinePlan};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// What one pipeline step did, as written to the metrics log.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PipelineMetrics {
    pub step: u64,
    /// Mean loss over the global batch.
    pub loss: f32,
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    pub tokens: u64,
    pub step_seconds: f64,
    pub tokens_per_second: f64,
}

/// Where a rank sits in the mesh: pipeline outermost, then replicate, shard and tensor.
#[derive(Clone, Copy, Debug)]
pub struct Coord {
    pub pipeline: usize,
    pub replicate: usize,
    pub shard: usize,
    pub tensor: usize,
}

impl Coord {
    /// The coordinates of rank `index` of `mesh`.
    pub fn of(index: usize, mesh: &MeshShape) -> Coord {
        let (r, s, t) = (mesh.replicate as usize, mesh.shard as usize, mesh.tensor as usize);
        Coord {
            pipeline: index / (r * s * t),
            replicate: index / (s * t) % r,
            shard: index / t % s,
            tensor: index % t,
        }
    }

    /// The rank at these coordinates of `mesh`.
    pub fn index(&self, mesh: &MeshShape) -> usize {
        let (r, s, t) = (mesh.replicate as usize, mesh.shard as usize, mesh.tensor as usize);
        ((self.pipeline * r + self.replicate) * s + self.shard) * t + self.tensor
    }
}

/// One rank's ends of a pipeline mesh's groups: its pipeline link, its shard, replicate
/// and tensor groups (none of one member), and the world.
pub struct PipelineEnds {
    pub p2p: Box<dyn PointToPoint>,
    pub shard: Option<Box<dyn Collectives>>,
    pub replicate: Option<Box<dyn Collectives>>,
    pub tensor: Option<Box<dyn Collectives>>,
    pub world: Box<dyn Collectives>,
}

/// The ranks of a pipeline mesh this process runs, by mesh index, with their ends.
pub struct PipelinePlacement {
    pub ranks: Vec<(usize, PipelineEnds)>,
    pub abort: Arc<Abort>,
}

/// Pipeline training over every rank of the mesh as a thread of this process.
pub struct PipelineTrainer {
    pub(crate) ranks: Vec<Rank>,
    /// The pipeline rank of each stage.
    pub(crate) rank_of_stage: Vec<usize>,
    pub(crate) microbatches: usize,
    pub(crate) data: Box<dyn DataSource>,
    pub(crate) device: Device,
    pub(crate) config: ParallelConfig,
    /// The model, as checkpoints record it.
    pub(crate) model: ModelConfig,
    /// Ends every rank's waits when one fails.
    pub(crate) abort: Arc<Abort>,
    /// The shard ranks, for [`PipelineTrainer::master`].
    pub(crate) shards: usize,
    /// Parameters of the model, for [`PipelineTrainer::master`].
    pub(crate) params: usize,
    pub(crate) total_steps: u64,
    pub(crate) step: u64,
}

impl PipelineTrainer {
    /// Cuts `model` into `plan`'s stages and initialises every rank's chunks as one rank
    /// initialises the whole model.
    pub fn new(
        model: &ModelConfig,
        config: &ParallelConfig,
        plan: &PipelinePlan,
        total_steps: u64,
        device: Device,
    ) -> Result<Self, ExecError> {
        let placement = place_threads(&config.mesh);
        Self::from_placement(model, config, plan, total_steps, device, placement)
    }

    /// As [`PipelineTrainer::new`], for the ranks `placement` gives this process (one per
    /// process under MPI).
    pub fn from_placement(
        model: &ModelConfig,
        config: &ParallelConfig,
        plan: &PipelinePlan,
        total_steps: u64,
        device: Device,
        placement: PipelinePlacement,
    ) -> Result<Self, ExecError> {
        let pipeline = config
            .pipeline
            .as_ref()
            .ok_or_else(|| ExecError::Internal("a pipeline trainer without a pipeline".into()))?;
        let mesh = config.mesh;
        if mesh.expert != 1 {
            return Err(ExecError::Unsupported(format!(
                "expert parallelism inside pipeline stages (expert {}) is not run yet: the pipeline executor runs FSDP, HSDP and tensor parallelism inside its stages; use mesh {{pipeline: {}, replicate: R, shard: S, tensor: T}}",
                mesh.expert, mesh.pipeline
            )));
        }
        if config.batch.grad_accum != 1 {
            return Err(ExecError::Unsupported(
                "batch.grad_accum with a pipeline: its micro-batches accumulate already; set grad_accum to 1 and raise pipeline.microbatches".into(),
            ));
        }
        let forward = trace(model, config.trace_options())?;
        let modules: Vec<Vec<String>> = plan.stages.iter().map(|s| s.modules.clone()).collect();
        let graphs =
            stage_graphs(&forward, &modules, config.diff_options()).map_err(|e| ExecError::Internal(e.to_string()))?;
        let rank_of_stage: Vec<usize> = plan.program.rank_of_stage.iter().map(|&r| r as usize).collect();
        let s = mesh.shard as usize;
        let mut ranks = Vec::with_capacity(placement.ranks.len());
        for (index, ends) in placement.ranks {
            let coord = Coord::of(index, &mesh);
            let stages = graphs
                .iter()
                .enumerate()
                .filter(|(i, _)| rank_of_stage[*i] == coord.pipeline)
                .map(|(i, g)| Stage::init(i, g, &forward, config, (coord.shard, s), coord.tensor as u64, &device))
                .collect::<Result<Vec<_>, ExecError>>()?;
            let tensor: Option<Arc<dyn Collectives>> = ends.tensor.map(Arc::from);
            let ctx = match &tensor {
                Some(g) => Ctx::with_tensor_group(device.clone(), TensorGroup::new(g.clone())),
                None => Ctx::new(device.clone()),
            };
            ranks.push(Rank {
                stages,
                program: plan.program.lowered[coord.pipeline].clone(),
                pipeline: coord.pipeline,
                tensor_rank: coord.tensor,
                data_rank: coord.replicate * s + coord.shard,
                p2p: ends.p2p,
                shard: ends.shard,
                replicate: ends.replicate,
                tensor,
                world: ends.world,
                tags: Default::default(),
                ctx,
            });
        }
        let first = forward.node(forward.inputs()[0]).ty.shape.dims().to_vec();
        let seq = first.get(1).copied().unwrap_or(1) as usize;
        let rows = (config.batch.per_rank * mesh.data_parallel()) as usize;
        let data = data_source(model, config, rows, seq)?;
        let params = forward.params().len();
        Ok(PipelineTrainer {
            ranks,
            rank_of_stage,
            microbatches: pipeline.microbatches as usize,
            data,
            device,
            config: config.clone(),
            model: model.clone(),
            abort: placement.abort,
            shards: s,
            params,
            total_steps,
            step: 0,
        })
    }

    /// Steps taken so far.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// The whole f32 master weights, by the model's parameter id (from the first replica's
    /// chunks).
    pub fn master(&self) -> Result<Vec<Tensor>, ExecError> {
        let mut all: Vec<Option<Tensor>> = vec![None; self.params];
        let tensor = self.config.mesh.tensor as usize;
        for pipeline in 0..self.config.mesh.pipeline as usize {
            // The first replica's ranks of this pipeline rank.
            let ranks: Vec<&Rank> = self
                .ranks
                .iter()
                .filter(|r| r.pipeline == pipeline && r.data_rank < self.shards)
                .collect();
            let Some(lead) = ranks.first() else { continue };
            for (k, stage) in lead.stages.iter().enumerate() {
                for (i, &param) in stage.graph.params.iter().enumerate() {
                    let chunks: Vec<Vec<&Shard>> = (0..tensor)
                        .map(|t| {
                            ranks
                                .iter()
                                .filter(|r| r.tensor_rank == t)
                                .map(|r| &r.stages[k].chunks[i])
                                .collect()
                        })
                        .collect();
                    all[param.index()] = Some(Shard::whole(&chunks)?);
                }
            }
        }
        all.into_iter()
            .enumerate()
            .map(|(i, t)| t.ok_or_else(|| ExecError::Internal(format!("parameter {i} is on no stage"))))
            .collect()
    }

    /// One optimizer step: every rank's program over its rows of the global batch.
    pub fn step(&mut self) -> Result<PipelineMetrics, ExecError> {
        let start = Instant::now();
        let batch = self.data.next_batch(&self.device)?;
        let data_world = self.config.mesh.data_parallel() as usize;
        let chunks: Vec<Vec<HashMap<String, Tensor>>> = (0..data_world)
            .map(|d| {
                let rows = rank_rows(batch.inputs.clone(), d, data_world)?;
                split_batch(&rows, self.microbatches)
            })
            .collect::<Result<_, ExecError>>()?;
        let lr = lr_at(
            self.step,
            self.total_steps,
            base_lr(&self.config.optimizer),
            &self.config.lr_schedule,
        );
        let run = StepRun {
            rank_of_stage: &self.rank_of_stage,
            microbatches: self.microbatches,
            losses: self.microbatches * data_world * self.config.mesh.tensor as usize,
            replicas: self.config.mesh.replicate as f64,
            tensor: self.config.mesh.tensor as f64,
            config: &self.config,
            step: self.step,
            lr,
        };
        let results: Vec<Result<(f64, f64), ExecError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .map(|rank| {
                    let (run, abort, chunks) = (&run, &self.abort, &chunks);
                    scope.spawn(move || {
                        let out = run.rank_step(rank, &chunks[rank.data_rank]);
                        if let Err(e) = &out {
                            // The other ranks' waits end with this rank's reason.
                            abort.abort(format!("pipeline rank {}: {e}", rank.pipeline));
                        }
                        out
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(ExecError::Internal("a pipeline rank panicked".into())))
                })
                .collect()
        });
        let mut summary = (0.0, 0.0);
        for r in results {
            summary = r?;
        }
        self.step += 1;
        let secs = start.elapsed().as_secs_f64();
        Ok(PipelineMetrics {
            step: self.step,
            loss: summary.0 as f32,
            lr,
            grad_norm: summary.1 as f32,
            tokens: batch.tokens,
            step_seconds: secs,
            tokens_per_second: batch.tokens as f64 / secs.max(1e-9),
        })
    }
}

/// The batch's inputs cut along their first dimension into `m` micro-batches, as torch's
/// schedules split their arguments.
fn split_batch(inputs: &HashMap<String, Tensor>, m: usize) -> Result<Vec<HashMap<String, Tensor>>, ExecError> {
    let mut chunks = vec![HashMap::new(); m];
    for (name, t) in inputs {
        let rows = t.dim(0)?;
        if rows % m != 0 {
            return Err(ExecError::Internal(format!(
                "input `{name}` has {rows} rows, which do not split into {m} micro-batches"
            )));
        }
        for (i, chunk) in chunks.iter_mut().enumerate() {
            chunk.insert(name.clone(), t.narrow(0, i * rows / m, rows / m)?);
        }
    }
    Ok(chunks)
}
