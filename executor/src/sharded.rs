//! Sharded training: every rank of a Plan's mesh runs the Plan with Local collectives
//! (ranks as threads of this process), holding only its own shards.
//!
//! The global batch of each micro-batch is the same whatever the mesh (`per_rank x world`
//! sequences from one data stream); rank `r` takes rows `r * per_rank ..`. Each rank
//! initialises only its own rows of each parameter, from the counter-based initialiser, so
//! the model equals the single-rank one bit for bit without any rank building it whole.

use crate::collectives::{local_groups, Abort};
use crate::data::DataSource;
use crate::init::init_elements;
use crate::kernels::Ctx;
use crate::optim::{base_lr, lr_at, OptState};
pub use crate::rank::Fault;
use crate::rank::{run_step, Comms, RankState, Shared};
use crate::train::data_source;
use crate::ExecError;
use candle_core::{Device, Tensor};
use serde::Serialize;
use shardplan_frontends::ParallelConfig;
use shardplan_ir::{differentiate, JointGraph};
use shardplan_models::{trace, ModelConfig, TraceOptions};
use shardplan_planner::{chunk_rows, plan, ByCategory, Category, ExecOrder, GroupReshard, Plan, Pool};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What one sharded optimizer step did.
#[derive(Clone, Debug, Serialize)]
pub struct ShardedMetrics {
    pub step: u64,
    /// Mean loss over every rank and micro-batch: the global batch's loss.
    pub loss: f32,
    /// Rank 0's own loss (its rows only).
    pub rank0_loss: f32,
    pub lr: f64,
    /// Global gradient norm before clipping (0 when the plan does not clip).
    pub grad_norm: f32,
    pub tokens: u64,
    pub step_seconds: f64,
    pub tokens_per_second: f64,
    /// Measured most bytes per category on each rank (device), and the planned figures.
    pub measured: Vec<ByCategory>,
    pub measured_peak: Vec<u64>,
    pub measured_host: Vec<ByCategory>,
    pub planned: ByCategory,
    pub planned_peak: u64,
}

/// A model, its Plan, and every rank's shards.
pub struct ShardedTrainer {
    pub(crate) shared: Shared,
    pub(crate) ranks: Vec<RankState>,
    pub(crate) data: Vec<Box<dyn DataSource>>,
    abort: std::sync::Arc<Abort>,
    pub(crate) config: ParallelConfig,
    pub(crate) model: ModelConfig,
    total_steps: u64,
    pub(crate) step: u64,
    /// Where the ranks compute (all on one device: Local ranks are threads).
    device: Device,
}

/// The per-rank trace options of `config`.
pub fn trace_options(config: &ParallelConfig) -> TraceOptions {
    TraceOptions {
        batch: config.batch.per_rank,
        seq_len: config.batch.seq_len,
        dtype: config.mixed_precision.param,
    }
}

impl ShardedTrainer {
    /// Traces and differentiates `model`, plans it for `config`, and initialises every rank.
    pub fn new(model: &ModelConfig, config: &ParallelConfig, total_steps: u64) -> Result<Self, ExecError> {
        let graph = trace(model, trace_options(config))?;
        let joint = differentiate(&graph).map_err(|e| ExecError::Internal(e.to_string()))?;
        let p = plan(&joint, config).map_err(|e| ExecError::Unsupported(e.to_string()))?;
        Self::from_plan(model, config, p, joint, total_steps)
    }

    /// Runs `plan` (made for `model` and `config`; verified here again).
    pub fn from_plan(
        model: &ModelConfig,
        config: &ParallelConfig,
        plan: Plan,
        joint: JointGraph,
        total_steps: u64,
    ) -> Result<Self, ExecError> {
        shardplan_planner::verify(&plan, None)
            .map_err(|e| ExecError::Unsupported(format!("the plan is not safe to run: {e}")))?;
        if plan.programs.len() != 1 {
            return Err(ExecError::Unsupported(
                "plans with per-rank programs are not supported by the executor".into(),
            ));
        }
        let exec = ExecOrder::new(&joint, config.activation_checkpointing);
        // The plan's steps must cover the execution order, in order.
        let mut step_start = Vec::with_capacity(plan.steps.len());
        let mut pos = 0usize;
        for s in &plan.steps {
            step_start.push(pos);
            let copy = s.phase == shardplan_planner::Phase::Recompute;
            for i in s.nodes.iter().flat_map(|r| r.clone()) {
                if exec.order.get(pos) != Some(&(shardplan_ir::NodeId(i), copy)) {
                    return Err(ExecError::Unsupported(format!(
                        "the plan's step {} does not match this model's graph (node n{i}): was it made for another model or batch shape?",
                        s.id
                    )));
                }
                pos += 1;
            }
        }
        if pos != exec.order.len() {
            return Err(ExecError::Unsupported(
                "the plan's steps do not cover this model's graph".into(),
            ));
        }
        let mesh = plan.mesh;
        let world = mesh.world();
        let abort = std::sync::Arc::new(Abort::default());
        let mut shard = local_groups(world, "shard", |r| mesh.shard_group(r), &abort);
        let mut replicate = local_groups(world, "replicate", |r| mesh.replicate_group(r), &abort);
        let reshard_n = plan.groups.iter().find_map(|g| match g.reshard {
            GroupReshard::ToGroupOf(n) => Some(n),
            _ => None,
        });
        let mut reshard = reshard_n.map(|n| local_groups(world, "reshard", |r| mesh.reshard_group(r, n), &abort));
        let g = &joint.graph;
        let first = g.node(g.inputs()[0]).ty.shape.dims().to_vec();
        let (per_rank, seq) = (first[0] as usize, first[1] as usize);
        let mut ranks = Vec::with_capacity(world as usize);
        let mut data = Vec::with_capacity(world as usize);
        for rank in 0..world {
            let coords = mesh.coords(rank);
            let mut params = Vec::with_capacity(plan.groups.len());
            let mut opt = Vec::with_capacity(plan.groups.len());
            for grp in &plan.groups {
                let l = &grp.layout;
                let mut flat = vec![0f32; l.shard_numel as usize];
                for pl in &l.params {
                    let rows = chunk_rows(pl.dims.first().copied().unwrap_or(1), l.shard, coords.shard);
                    let range = rows.start * pl.row_elems..rows.end * pl.row_elems;
                    let vals = init_elements(g, pl.param, config.seed, range);
                    let at = pl.shard_offset as usize;
                    flat[at..at + vals.len()].copy_from_slice(&vals);
                }
                let t = Tensor::from_vec(flat, l.shard_numel as usize, &Device::Cpu)?;
                let mut o = OptState::new(config.optimizer, 1);
                o.materialize(std::slice::from_ref(&t))?;
                params.push(t);
                opt.push(o);
            }
            let take = |m: &mut HashMap<u64, crate::collectives::LocalGroup>| {
                m.remove(&rank)
                    .ok_or_else(|| ExecError::Internal(format!("no group handle for rank {rank}")))
            };
            ranks.push(RankState {
                rank,
                comms: Comms {
                    shard: take(&mut shard)?,
                    replicate: take(&mut replicate)?,
                    reshard: match reshard.as_mut() {
                        Some(m) => Some(take(m)?),
                        None => None,
                    },
                },
                params,
                opt,
                ctx: Ctx::new(Device::Cpu),
            });
            data.push(data_source(model, config, per_rank * world as usize, seq)?);
        }
        Ok(ShardedTrainer {
            shared: Shared {
                plan,
                joint,
                exec,
                step_start,
                clip: config.grad_clip,
                faults: Vec::new(),
            },
            ranks,
            data,
            abort,
            config: config.clone(),
            model: model.clone(),
            total_steps,
            step: 0,
            device: Device::Cpu,
        })
    }

    /// Moves every rank to `device` (one device shared by all ranks, as threads): compute,
    /// device-pool buffers and the batches; host-pool state (CPU offload) stays on the CPU.
    pub fn to_device(&mut self, device: &Device) -> Result<(), ExecError> {
        let plan = &self.shared.plan;
        let pool_of = |g: usize, c: Category| plan.persistent_buffer(g, c).map_or(Pool::Device, |b| b.pool);
        let place = |pool: Pool| {
            if pool == Pool::Host {
                Device::Cpu
            } else {
                device.clone()
            }
        };
        for r in &mut self.ranks {
            for (g, p) in r.params.iter_mut().enumerate() {
                *p = p.to_device(&place(pool_of(g, Category::ShardedParams)))?;
            }
            for (g, o) in r.opt.iter_mut().enumerate() {
                let at = place(pool_of(g, Category::OptimizerState));
                for t in o.m.iter_mut().chain(o.v.iter_mut()).flatten() {
                    *t = t.to_device(&at)?;
                }
            }
            r.ctx = Ctx::new(device.clone());
        }
        self.device = device.clone();
        Ok(())
    }

    /// The device the ranks compute on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// How long a collective or an event may wait before the run fails.
    pub fn set_timeout(&mut self, t: Duration) {
        self.abort.set_timeout(t);
    }

    /// Makes `rank` fail or stall when it reaches instruction `instr` (for tests of the
    /// failure paths).
    pub fn inject_fault(&mut self, rank: u64, instr: usize, fault: Fault) {
        self.shared.faults.push((rank, instr, fault));
    }

    /// The plan being run.
    pub fn plan(&self) -> &Plan {
        &self.shared.plan
    }

    /// Steps taken so far.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// The abort handle, for tests that make a rank fail.
    pub fn abort_handle(&self) -> std::sync::Arc<Abort> {
        self.abort.clone()
    }

    /// One optimizer step on every rank.
    pub fn step(&mut self) -> Result<ShardedMetrics, ExecError> {
        if let Some(r) = self.abort.reason() {
            return Err(ExecError::Aborted(r));
        }
        let start = Instant::now();
        let accum = self.config.batch.grad_accum as usize;
        let world = self.ranks.len();
        let lr = lr_at(
            self.step,
            self.total_steps,
            base_lr(&self.config.optimizer),
            &self.config.lr_schedule,
        );
        // Each rank's rows of the same global micro-batches.
        let mut batches: Vec<Vec<HashMap<String, Tensor>>> = Vec::with_capacity(world);
        let mut tokens = 0u64;
        for (rank, d) in self.data.iter_mut().enumerate() {
            let mut mine = Vec::with_capacity(accum);
            for _ in 0..accum {
                let b = d.next_batch(&self.device)?;
                if rank == 0 {
                    tokens += b.tokens;
                }
                let rows = b
                    .inputs
                    .into_iter()
                    .map(|(name, t)| {
                        let per = t.dim(0)? / world;
                        Ok((name, t.narrow(0, rank * per, per)?))
                    })
                    .collect::<Result<HashMap<_, _>, ExecError>>()?;
                mine.push(rows);
            }
            batches.push(mine);
        }
        let shared = &self.shared;
        let abort = &self.abort;
        let step_no = self.step;
        let results: Vec<Result<crate::rank::RankStepOut, ExecError>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .zip(&batches)
                .map(|(state, b)| s.spawn(move || run_step(shared, state, abort, b, lr, step_no)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(ExecError::Internal("a rank thread panicked".into())))
                })
                .collect()
        });
        let mut outs = Vec::with_capacity(world);
        for r in results {
            match r {
                Ok(o) => outs.push(o),
                Err(e) => {
                    return Err(match self.abort.reason() {
                        Some(reason) => ExecError::Aborted(reason),
                        None => e,
                    })
                }
            }
        }
        self.step += 1;
        let mut sum = 0f64;
        let mut n = 0usize;
        for o in &outs {
            for &l in &o.losses {
                sum += f64::from(l);
                n += 1;
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let plan = &self.shared.plan;
        Ok(ShardedMetrics {
            step: self.step,
            loss: (sum / n.max(1) as f64) as f32,
            rank0_loss: outs[0].losses.iter().map(|&l| f64::from(l)).sum::<f64>() as f32
                / outs[0].losses.len().max(1) as f32,
            lr,
            grad_norm: outs[0].grad_norm.unwrap_or(0.0) as f32,
            tokens,
            step_seconds: secs,
            tokens_per_second: tokens as f64 / secs.max(1e-9),
            measured: outs.iter().map(|o| o.max_by_category).collect(),
            measured_peak: outs.iter().map(|o| o.peak).collect(),
            measured_host: outs.iter().map(|o| o.host).collect(),
            planned: plan.memory.max_by_category,
            planned_peak: plan.memory.peak,
        })
    }

    /// The full f32 parameters, assembled from the shards of replica 0 (for checks and
    /// export; no rank holds them).
    pub fn full_params(&self) -> Result<Vec<Tensor>, ExecError> {
        let plan = &self.shared.plan;
        let g = &self.shared.joint.graph;
        let mut out: Vec<Option<Tensor>> = vec![None; g.params().len()];
        for (gi, grp) in plan.groups.iter().enumerate() {
            let l = &grp.layout;
            for (i, pl) in l.params.iter().enumerate() {
                let mut pieces = Vec::new();
                for s in 0..l.shard {
                    let rows = chunk_rows(pl.dims.first().copied().unwrap_or(1), l.shard, s);
                    let n = ((rows.end - rows.start) * pl.row_elems) as usize;
                    if n > 0 {
                        pieces.push(self.ranks[s as usize].params[gi].narrow(0, pl.shard_offset as usize, n)?);
                    }
                }
                let dims: Vec<usize> = pl.dims.iter().map(|&d| d as usize).collect();
                let _ = i;
                out[pl.param.index()] = Some(Tensor::cat(&pieces, 0)?.reshape(dims.as_slice())?);
            }
        }
        out.into_iter()
            .enumerate()
            .map(|(i, t)| t.ok_or_else(|| ExecError::Internal(format!("parameter p{i} is in no group"))))
            .collect()
    }
}
