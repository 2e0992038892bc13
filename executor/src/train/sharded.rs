//! Sharded training: the ranks this process runs (every rank of the mesh as threads with
//! Local collectives, or one rank per process with MPI or NCCL) each run the Plan,
//! holding only their own shards.
//!
//! The global batch of each micro-batch is the same whatever the mesh (`per_rank x world`
//! sequences from one data stream); rank `r` takes rows `r * per_rank ..`. Each rank
//! initialises only its own rows of each parameter, from the counter-based initialiser, so
//! the model equals the single-rank one bit for bit without any rank building it whole.

use crate::comm::{Abort, Collectives, Placement};
use crate::cpu::context::ContextGroup;
use crate::cpu::expert::{ExpertGroup, RoutingLoad};
use crate::cpu::kernels::Ctx;
use crate::cpu::tensor::{whole_from_slices, TensorGroup};
use crate::init::init_slice_elements;
use crate::runtime::optim::{base_lr, lr_at, OptState};
use crate::runtime::rank::{run_step, ProgramTables, RankState, Shared};
pub use crate::runtime::rank::{Fault, Injected};
use crate::train::data::{mesh_rows, DataSource};
use crate::train::eval::{step_starts, Validation};
use crate::train::trainer::data_source;
use crate::ExecError;
use candle_core::{DType, Device, Tensor};
use serde::Serialize;
use shardplan_frontends::ParallelConfig;
use shardplan_ir::{differentiate_with, JointGraph};
use shardplan_models::{trace, ModelConfig};
use shardplan_planner::{chunk_rows, plan, ByCategory, Category, Coords, ExecOrder, Instr, Plan, Pool, Runner, Stream};
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
    /// Time rank 0's compute stream spent waiting on other streams (measured exposed
    /// communication), seconds.
    pub exposed_seconds: f64,
    /// Some process asked to stop (Ctrl-C): every rank stops after this step.
    pub stop: bool,
    /// The validation loss after this step, on the steps that evaluate (every
    /// `data.eval_every` steps and the last).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f32>,
    /// Each rank's GPU memory as the device reports it over the step (its process's
    /// device: ranks sharing one GPU as threads report the same figures); `None` on the CPU.
    pub measured_device: Vec<Option<crate::runtime::device::DeviceMemory>>,
    /// Under expert parallelism: the step's heaviest routing over every expert group (the
    /// most rows one rank received in one MoE layer, beside the even split), which
    /// `moe.capacity` bounds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routing: Option<RoutingLoad>,
}

/// One rank's rows of each micro-batch of a step, by input name.
type RankMicroBatches = Vec<HashMap<String, Tensor>>;

/// Each local rank's [`RankMicroBatches`].
type RankBatches = Vec<RankMicroBatches>;

/// How a checkpoint names the model's parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CheckpointNames {
    /// Hugging Face's (what shardplan writes).
    #[default]
    HuggingFace,
    /// torchtitan's for its Llama 3, wq and wk in Meta's rotary layout.
    Torchtitan,
}

/// A model, its Plan, and every rank's shards.
pub struct ShardedTrainer {
    pub(crate) shared: Shared,
    /// What each step reads from the plan alone, built once.
    tables: ProgramTables,
    pub(crate) ranks: Vec<RankState>,
    pub(crate) data: Vec<Box<dyn DataSource>>,
    /// The validation forward and data, when the spec's data has a `val` file.
    validation: Option<Validation>,
    abort: std::sync::Arc<Abort>,
    /// One member per process, when ranks run in several processes.
    pub(crate) processes: Option<Box<dyn Collectives>>,
    backend: &'static str,
    /// Set by Ctrl-C; read between steps and agreed on by every process.
    stop_flag: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// Collective tags of the between-step exchanges.
    sync_tag: u64,
    /// The compute stream's waits (their measured time is exposed communication).
    compute_waits: Vec<usize>,
    /// Per step, per local rank: the measured instruction times (when tracing).
    pub(crate) times: Option<Vec<Vec<Vec<[f64; 2]>>>>,
    /// Per local rank, instruction and op times summed over the steps (`--profile`).
    pub(crate) profile: Option<crate::train::profile::Recorder>,
    pub(crate) config: ParallelConfig,
    pub(crate) model: ModelConfig,
    total_steps: u64,
    pub(crate) step: u64,
    /// Where the ranks compute (all on one device: Local ranks are threads).
    device: Device,
    /// Where each parameter of the plan's graph sits in the whole model.
    pub(crate) whole: WholeParams,
    /// How the DCP checkpoints this run reads name the parameters.
    pub(crate) checkpoint_names: CheckpointNames,
}

/// Where the parameters of a rank's graph sit in the whole model. Under expert parallelism
/// a rank's graph holds only its own experts, named and numbered as expert rank 0's; the
/// whole model (traced without it) numbers every expert's parameters, and initial values,
/// checkpoints and exports follow the whole model's numbers and names.
pub(crate) struct WholeParams {
    /// The whole model's parameter names, in its order.
    pub names: Vec<String>,
    /// `ids[p][r]`: the whole model's number of the graph's parameter `p` on expert rank
    /// `r` (one entry for a parameter every expert rank holds).
    pub ids: Vec<Vec<usize>>,
}

impl WholeParams {
    /// The map for `g`, traced for `model` under `config`.
    fn new(model: &ModelConfig, config: &ParallelConfig, g: &shardplan_ir::Graph) -> Result<Self, ExecError> {
        let degree = g.expert_degree();
        if degree <= 1 {
            return Ok(WholeParams {
                names: g.params().map(|(_, p)| p.name.to_string()).collect(),
                ids: (0..g.params().len()).map(|p| vec![p]).collect(),
            });
        }
        let mut opts = config.trace_options();
        opts.expert = Default::default();
        let whole = trace(model, opts)?;
        let index: HashMap<&str, usize> = whole.params().map(|(id, p)| (&*p.name, id.index())).collect();
        let mut ids = Vec::with_capacity(g.params().len());
        for (_, p) in g.params() {
            let ranks = if p.expert.is_some() { degree } else { 1 };
            let mut row = Vec::with_capacity(ranks as usize);
            for r in 0..ranks {
                let name = p.name_on(r);
                row.push(*index.get(name.as_ref()).ok_or_else(|| {
                    ExecError::Internal(format!("parameter {name} of expert rank {r} is not in the whole model"))
                })?);
            }
            ids.push(row);
        }
        Ok(WholeParams {
            names: whole.params().map(|(_, p)| p.name.to_string()).collect(),
            ids,
        })
    }

    /// The whole model's number of parameter `p` on expert rank `r`.
    pub fn id(&self, p: shardplan_ir::ParamId, r: u64) -> usize {
        let row = &self.ids[p.index()];
        row[(r as usize).min(row.len() - 1)]
    }
}

/// `config` as this executor runs it: one kernel per graph op, attention's backward
/// blockwise and the cross-entropy's in place (`kernels: fused`), its own schedule (`runtime: shardplan`, whatever the
/// spec predicts for), so that the plan's memory and time are this executor's rather than
/// PyTorch eager's or FSDP2's.
pub fn executor_config(config: &ParallelConfig) -> ParallelConfig {
    let mut c = config.clone();
    c.hardware.kernels = shardplan_frontends::KernelMode::Fused;
    c.runtime = shardplan_frontends::Runtime::Shardplan;
    // shardplan's executor runs its own kernels; torch.compile is PyTorch's.
    c.compile = shardplan_frontends::Compile::default();
    c
}

/// Where group `g`'s persistent state of category `c` lives on a run computing on
/// `device`: the CPU for the host pool (CPU offload), `device` otherwise.
fn state_device(plan: &Plan, g: usize, c: Category, device: &Device) -> Device {
    match plan.persistent_buffer(g, c).map_or(Pool::Device, |b| b.pool) {
        Pool::Host => Device::Cpu,
        _ => device.clone(),
    }
}

/// Refuses a plan this executor cannot run: another runtime's, one that fails the
/// verifier, or one with a program per rank.
fn check_runnable(plan: &Plan) -> Result<(), ExecError> {
    if !plan.policy.runtime.is_shardplan() {
        // FSDP2's buffers (flat all-gather outputs, its reduce-scatter state) are a
        // prediction of another framework's run, not this executor's schedule.
        return Err(ExecError::Unsupported(format!(
            "the plan models PyTorch FSDP2's run (runtime: {}); shardplan's executor runs only its own schedule (runtime: shardplan)",
            plan.policy.runtime.name()
        )));
    }
    shardplan_planner::verify(plan, None)
        .map_err(|e| ExecError::Unsupported(format!("the plan is not safe to run: {e}")))?;
    if plan.programs.len() != 1 {
        return Err(ExecError::Unsupported(
            "plans with per-rank programs are not supported by the executor".into(),
        ));
    }
    if plan.float8.is_some() && plan.mesh.tensor() > 1 {
        // torchao's scales of a tensor-parallel weight or activation are the whole
        // tensor's (a reduction over the tensor group); this executor's casts see its slice.
        return Err(ExecError::Unsupported(
            "`float8` under tensor parallelism is planned, not run: its scales reduce over the tensor group, which this executor's Float8 casts do not yet; run Float8 on FSDP or HSDP meshes".into(),
        ));
    }
    Ok(())
}

/// The executor's execution order of `joint` and where each of `plan`'s steps starts in
/// it: the plan's steps must cover it, in order.
fn execution_order(
    plan: &Plan,
    joint: &JointGraph,
    config: &ParallelConfig,
) -> Result<(ExecOrder, Vec<usize>), ExecError> {
    let exec = ExecOrder::new(joint, config.activation_checkpointing, Runner::Shardplan);
    let (step_start, pos) = step_starts(plan, &exec)?;
    if pos != exec.order().len() {
        return Err(ExecError::Unsupported(
            "the plan's steps do not cover this model's graph".into(),
        ));
    }
    Ok((exec, step_start))
}

/// The compute stream's waits whose measured time is exposed communication: all but
/// those on the all-to-all stream (a wait there is the expert group's collective, which
/// the plan's estimate counts apart, not FSDP's communication).
fn compute_waits(plan: &Plan) -> Vec<usize> {
    let instrs = &plan.programs[0].instrs;
    let expert_events: std::collections::HashSet<_> = instrs
        .iter()
        .filter_map(|x| match x.instr {
            Instr::Record { event } if x.stream == Stream::AllToAll => Some(event),
            _ => None,
        })
        .collect();
    instrs
        .iter()
        .enumerate()
        .filter(|(_, x)| {
            x.stream == Stream::Compute && matches!(x.instr, Instr::Wait { event } if !expert_events.contains(&event))
        })
        .map(|(i, _)| i)
        .collect()
}

/// What making every local rank's initial state reads, and how far it has got.
struct ShardInit<'a> {
    plan: &'a Plan,
    config: &'a ParallelConfig,
    whole: &'a WholeParams,
    graph: &'a shardplan_ir::Graph,
    device: &'a Device,
    progress: &'a mut dyn FnMut(u64, u64),
    /// (rank, group) shards made so far, of `total`.
    made: u64,
    total: u64,
}

impl ShardInit<'_> {
    /// Rank `rank`'s state on its communicators `comms` (of the `backend` backend): its
    /// kernel context, its parameter shards and their optimizer state.
    fn rank(&mut self, rank: u64, mut comms: crate::comm::Comms, backend: &str) -> Result<RankState, ExecError> {
        let world = self.plan.mesh.world();
        if rank >= world {
            return Err(ExecError::Internal(format!("rank {rank} placed on a world of {world}")));
        }
        let ctx = self.ctx(&mut comms, backend)?;
        let mut params = Vec::with_capacity(self.plan.groups.len());
        let mut opt = Vec::with_capacity(self.plan.groups.len());
        for gi in 0..self.plan.groups.len() {
            let (t, o) = self.group_shard(rank, gi)?;
            params.push(t);
            opt.push(o);
            self.made += 1;
            (self.progress)(self.made, self.total);
        }
        Ok(RankState {
            rank,
            comms,
            params,
            opt,
            ctx,
        })
    }

    /// A rank's kernel context, with the tensor and expert groups its communicators give
    /// (taken from `comms`); refused when the mesh needs one the backend does not make.
    fn ctx(&self, comms: &mut crate::comm::Comms, backend: &str) -> Result<Ctx, ExecError> {
        let mesh = self.plan.mesh;
        let device = self.device;
        let mut ctx = match comms.tensor.take() {
            Some(t) => Ctx::with_tensor_group(device.clone(), TensorGroup::new(std::sync::Arc::from(t))),
            None if mesh.tensor() > 1 => {
                return Err(ExecError::Unsupported(format!(
                    "the {backend} backend does not run tensor parallelism yet (mesh.tensor {}): run it as threads of one process (`--backend local`) or one CPU process per rank under mpirun (`--backend mpi`)",
                    mesh.tensor()
                )))
            }
            None => Ctx::new(device.clone()),
        };
        match comms.context.take() {
            Some(c) => ctx = ctx.with_context_group(ContextGroup::new(std::sync::Arc::from(c))),
            None if mesh.context() > 1 => {
                return Err(ExecError::Unsupported(format!(
                    "the {backend} backend does not run context parallelism yet (mesh.context {}): run it as threads of one process (`--backend local`) or one CPU process per rank under mpirun (`--backend mpi`)",
                    mesh.context()
                )))
            }
            None => {}
        }
        match comms.expert.take() {
            Some(e) => ctx = ctx.with_expert_group(ExpertGroup::new(std::sync::Arc::from(e))),
            None if mesh.expert() > 1 => {
                return Err(ExecError::Unsupported(format!(
                    "the {backend} backend does not run expert parallelism yet (mesh.expert {}): run it as threads of one process (`--backend local`) or one CPU process per rank under mpirun (`--backend mpi`)",
                    mesh.expert()
                )))
            }
            None => {}
        }
        Ok(ctx)
    }

    /// Rank `rank`'s flat shard of group `gi` (its own rows of each parameter, from the
    /// counter-based initialiser) on its pool's device, and the group's optimizer state
    /// made as zeros on its own pool's device.
    fn group_shard(&self, rank: u64, gi: usize) -> Result<(Tensor, OptState), ExecError> {
        let (plan, config, device) = (self.plan, self.config, self.device);
        let mesh = plan.mesh;
        let grp = &plan.groups[gi];
        let l = &grp.layout;
        let (tensor_rank, expert_rank) = (mesh.coords(rank).tensor, mesh.expert_index(rank));
        let mut flat = vec![0f32; l.shard_numel as usize];
        for pl in &l.params {
            let rows = chunk_rows(
                pl.dims.first().copied().unwrap_or(1),
                l.shard,
                mesh.shard_rank(rank, &grp.group),
            );
            let range = rows.start * pl.row_elems..rows.end * pl.row_elems;
            let key = self.whole.id(pl.param, expert_rank) as u64;
            let vals = init_slice_elements(self.graph, pl.param, key, config.seed, range, tensor_rank);
            let at = pl.shard_offset as usize;
            flat[at..at + vals.len()].copy_from_slice(&vals);
        }
        let t = Tensor::from_vec(flat, l.shard_numel as usize, &Device::Cpu)?.to_device(&state_device(
            plan,
            gi,
            Category::ShardedParams,
            device,
        ))?;
        let mut o = OptState::new(config.optimizer, 1);
        // The state is made as zeros like a tensor on its own pool's device.
        let state_at = state_device(plan, gi, Category::OptimizerState, device);
        if state_at.same_device(t.device()) {
            o.materialize(std::slice::from_ref(&t))?;
        } else {
            o.materialize(&[Tensor::zeros(l.shard_numel as usize, DType::F32, &state_at)?])?;
        }
        Ok((t, o))
    }
}

impl ShardedTrainer {
    /// Traces and differentiates `model`, plans it for `config` as this executor runs it
    /// ([`executor_config`]), and initialises every rank.
    pub fn new(model: &ModelConfig, config: &ParallelConfig, total_steps: u64) -> Result<Self, ExecError> {
        let graph = trace(model, config.trace_options())?;
        let run = executor_config(config);
        let joint = differentiate_with(&graph, run.diff_options()).map_err(|e| ExecError::Internal(e.to_string()))?;
        let p = plan(&joint, &run).map_err(|e| ExecError::Unsupported(e.to_string()))?;
        Self::from_plan(model, config, p, joint, total_steps)
    }

    /// Runs `plan` (made for `model` and `config`; verified here again) with every rank of
    /// its mesh as a thread of this process.
    pub fn from_plan(
        model: &ModelConfig,
        config: &ParallelConfig,
        plan: Plan,
        joint: JointGraph,
        total_steps: u64,
    ) -> Result<Self, ExecError> {
        let place = crate::comm::local::place(&plan);
        Self::from_placement(model, config, plan, joint, total_steps, place)
    }

    /// Runs `plan` on the ranks `place` gives this process (a backend built them for this
    /// plan: `comm::local::place`, or one rank per process from the `shardplan-mpi` crate).
    pub fn from_placement(
        model: &ModelConfig,
        config: &ParallelConfig,
        plan: Plan,
        joint: JointGraph,
        total_steps: u64,
        place: Placement,
    ) -> Result<Self, ExecError> {
        Self::from_placement_on(
            model,
            config,
            plan,
            joint,
            total_steps,
            place,
            &Device::Cpu,
            &mut |_, _| {},
        )
    }

    /// [`ShardedTrainer::from_placement`] with the ranks on `device` from the start: each
    /// parameter group's shard is made on the host (on every core) and moved to its pool's
    /// device at once, and the optimizer state is made there as zeros, so the host never
    /// holds more than one group's shard (a 8B model's f32 weights and two moments are
    /// 96 GiB). `progress(done, total)` is called after each (rank, group) shard.
    #[allow(clippy::too_many_arguments)]
    pub fn from_placement_on(
        model: &ModelConfig,
        config: &ParallelConfig,
        plan: Plan,
        joint: JointGraph,
        total_steps: u64,
        place: Placement,
        device: &Device,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self, ExecError> {
        check_runnable(&plan)?;
        let (exec, step_start) = execution_order(&plan, &joint, config)?;
        let Placement {
            ranks: placed,
            processes,
            abort,
            backend,
        } = place;
        let g = &joint.graph;
        let first = g.node(g.inputs()[0]).ty.shape.dims().to_vec();
        // A context-parallel graph holds `1 / context` of each sequence.
        let (per_rank, seq) = (first[0] as usize, first[1] as usize * g.context_degree() as usize);
        // A tensor group shares its sequences: the batch is split over the data-parallel
        // ranks only.
        let rows = per_rank * plan.mesh.data_parallel() as usize;
        let whole = WholeParams::new(model, config, g)?;
        let mut init = ShardInit {
            plan: &plan,
            config,
            whole: &whole,
            graph: g,
            device,
            progress,
            made: 0,
            total: (placed.len() * plan.groups.len()) as u64,
        };
        let mut ranks = Vec::with_capacity(placed.len());
        let mut data = Vec::with_capacity(placed.len());
        for (rank, comms) in placed {
            ranks.push(init.rank(rank, comms, backend)?);
            data.push(data_source(model, config, rows, seq)?);
        }
        let validation = Validation::new(model, config, &joint, &plan, ranks.len(), rows, seq)?;
        let compute_waits = compute_waits(&plan);
        let shared = Shared {
            plan,
            joint,
            exec,
            step_start,
            clip: config.grad_clip,
            faults: Vec::new(),
            ordered_launch: false,
            profile: false,
            native: false,
            device_clock: false,
        };
        Ok(ShardedTrainer {
            tables: ProgramTables::new(&shared)?,
            shared,
            ranks,
            data,
            validation,
            abort,
            processes,
            backend,
            stop_flag: None,
            sync_tag: 0,
            compute_waits,
            times: None,
            profile: None,
            config: config.clone(),
            model: model.clone(),
            total_steps,
            step: 0,
            device: device.clone(),
            whole,
            checkpoint_names: Default::default(),
        })
    }

    /// Moves every rank to `device` (one device shared by all ranks, as threads): compute,
    /// device-pool buffers and the batches; host-pool state (CPU offload) stays on the CPU.
    pub fn to_device(&mut self, device: &Device) -> Result<(), ExecError> {
        let plan = &self.shared.plan;
        for r in &mut self.ranks {
            for (g, p) in r.params.iter_mut().enumerate() {
                *p = p.to_device(&state_device(plan, g, Category::ShardedParams, device))?;
            }
            for (g, o) in r.opt.iter_mut().enumerate() {
                let at = state_device(plan, g, Category::OptimizerState, device);
                for t in o.m.iter_mut().chain(o.v.iter_mut()).flatten() {
                    *t = t.to_device(&at)?;
                }
            }
            r.ctx = std::mem::replace(&mut r.ctx, Ctx::new(device.clone())).to_device(device.clone());
        }
        self.device = device.clone();
        Ok(())
    }

    /// Which kernels the ranks run ([`crate::gpu::Kernels`]): shardplan's own CUDA kernels
    /// need the ranks on a CUDA device (call after [`ShardedTrainer::to_device`]).
    pub fn set_kernels(&mut self, kernels: crate::gpu::Kernels) -> Result<(), ExecError> {
        let native = kernels == crate::gpu::Kernels::Native;
        if native && !self.device.is_cuda() {
            return Err(ExecError::Unsupported(
                "`--kernels native` runs shardplan's CUDA kernels: it needs `--device cuda` (on the CPU the executor's own fused kernels always run)"
                    .into(),
            ));
        }
        self.shared.native = native;
        for r in &mut self.ranks {
            r.ctx.native = native;
        }
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
    /// failure paths), at every step.
    pub fn inject_fault(&mut self, rank: u64, instr: usize, fault: Fault) {
        self.inject_fault_at(rank, instr, fault, None);
    }

    /// [`Self::inject_fault`] at step `step` of the run only (counting from 1), or at
    /// every step.
    pub fn inject_fault_at(&mut self, rank: u64, instr: usize, fault: Fault, step: Option<u64>) {
        self.shared.faults.push(Injected {
            rank,
            instr,
            fault,
            step,
        });
    }

    /// Launches every rank's collectives in issue order, as an enqueueing backend (NCCL)
    /// does, on any backend (for tests of that order).
    pub fn set_ordered_launch(&mut self, on: bool) {
        self.shared.ordered_launch = on;
    }

    /// The plan being run.
    pub fn plan(&self) -> &Plan {
        &self.shared.plan
    }

    /// Reads DCP checkpoints (`load`, `init_from`) under `names`: torchtitan's own for its
    /// Llama 3, or Hugging Face's (the default, what shardplan writes).
    pub fn set_checkpoint_names(&mut self, names: CheckpointNames) {
        self.checkpoint_names = names;
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
        let lr = lr_at(
            self.step,
            self.total_steps,
            base_lr(&self.config.optimizer),
            &self.config.lr_schedule,
        );
        let (batches, tokens) = self.next_batches(accum)?;
        // The device's own figures over this step (GPU runs; nothing on the CPU).
        crate::runtime::device::reset_peaks(&self.device)?;
        let outs = self.run_ranks(&batches, lr)?;
        self.step += 1;
        let local = self.rank_stats(&outs)?;
        if let Some(p) = self.profile.as_mut() {
            p.add(&self.shared, self.step, &outs);
        }
        if let Some(t) = self.times.as_mut() {
            t.push(outs.into_iter().map(|o| o.times).collect());
        }
        let all = self.exchange(local, accum)?;
        let secs = start.elapsed().as_secs_f64();
        let due = self
            .validation
            .as_ref()
            .is_some_and(|v| self.step.is_multiple_of(v.every) || self.step == self.total_steps);
        let val_loss = if due { Some(self.evaluate()?) } else { None };
        Ok(self.metrics(&all, lr, tokens, secs, val_loss))
    }

    /// Each local rank's rows of the step's `accum` global micro-batches, and the tokens
    /// of those micro-batches.
    fn next_batches(&mut self, accum: usize) -> Result<(RankBatches, u64), ExecError> {
        let mesh = self.shared.plan.mesh;
        let layout = self.shared.joint.graph.context_layout();
        let mut batches: RankBatches = Vec::with_capacity(self.ranks.len());
        let mut tokens = 0u64;
        for (k, (d, state)) in self.data.iter_mut().zip(&self.ranks).enumerate() {
            let rank = state.rank;
            let mut mine = Vec::with_capacity(accum);
            for _ in 0..accum {
                let b = d.next_batch(&self.device)?;
                if k == 0 {
                    tokens += b.tokens;
                }
                // The rows of this rank's data-parallel index (its tensor and context
                // group's), and its rows of their sequences.
                mine.push(mesh_rows(b.inputs, &mesh, layout, rank)?);
            }
            batches.push(mine);
        }
        Ok((batches, tokens))
    }

    /// Runs the step on every local rank (a thread each) with its `batches` at learning
    /// rate `lr`; every rank's measurements, or the first failure (the world's stop
    /// reason when there is one).
    fn run_ranks(
        &mut self,
        batches: &[RankMicroBatches],
        lr: f64,
    ) -> Result<Vec<crate::runtime::rank::RankStepOut>, ExecError> {
        let (shared, tables) = (&self.shared, &self.tables);
        let abort = &self.abort;
        let step_no = self.step;
        let results: Vec<Result<crate::runtime::rank::RankStepOut, ExecError>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .zip(batches)
                .map(|(state, b)| s.spawn(move || run_step(shared, tables, state, abort, b, lr, step_no)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(ExecError::Internal("a rank thread panicked".into())))
                })
                .collect()
        });
        let mut outs = Vec::with_capacity(self.ranks.len());
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
        Ok(outs)
    }

    /// Each local rank's figures of the step just run (`outs`), as exchanged between
    /// processes: with whether a stop was asked for and the device's memory figures.
    fn rank_stats(&self, outs: &[crate::runtime::rank::RankStepOut]) -> Result<Vec<RankStats>, ExecError> {
        let stop_here = self
            .stop_flag
            .as_ref()
            .is_some_and(|f| f.load(std::sync::atomic::Ordering::SeqCst));
        let compute_waits = &self.compute_waits;
        let dev = crate::runtime::device::measure(&self.device)?;
        Ok(outs
            .iter()
            .zip(&self.ranks)
            .map(|(o, r)| RankStats {
                rank: r.rank,
                losses: o.losses.clone(),
                grad_norm: o.grad_norm.unwrap_or(0.0),
                peak: o.peak,
                device: o.max_by_category,
                host: o.host,
                exposed: compute_waits.iter().map(|&i| o.times[i][1] - o.times[i][0]).sum(),
                stop: stop_here,
                dev,
                routing: o.routing,
            })
            .collect())
    }

    /// The step's metrics from every rank's figures `all` (in rank order).
    fn metrics(&self, all: &[RankStats], lr: f64, tokens: u64, secs: f64, val_loss: Option<f32>) -> ShardedMetrics {
        let mut sum = 0f64;
        let mut n = 0usize;
        for r in all {
            for &l in &r.losses {
                sum += f64::from(l);
                n += 1;
            }
        }
        let r0 = &all[0];
        let plan = &self.shared.plan;
        ShardedMetrics {
            step: self.step,
            loss: (sum / n.max(1) as f64) as f32,
            rank0_loss: r0.losses.iter().map(|&l| f64::from(l)).sum::<f64>() as f32 / r0.losses.len().max(1) as f32,
            lr,
            grad_norm: r0.grad_norm as f32,
            tokens,
            step_seconds: secs,
            tokens_per_second: tokens as f64 / secs.max(1e-9),
            measured: all.iter().map(|o| o.device).collect(),
            measured_peak: all.iter().map(|o| o.peak).collect(),
            measured_host: all.iter().map(|o| o.host).collect(),
            planned: plan.memory.max_by_category,
            planned_peak: plan.memory.peak,
            exposed_seconds: r0.exposed,
            stop: all.iter().any(|r| r.stop),
            measured_device: all.iter().map(|o| o.dev).collect(),
            routing: all.iter().filter_map(|o| o.routing).reduce(RoutingLoad::max),
            val_loss,
        }
    }

    /// Whether the spec's data has a validation file (`data.val`).
    pub fn has_validation(&self) -> bool {
        self.validation.is_some()
    }

    /// The validation loss of the current weights: the forward program on every rank over
    /// the validation batches, reduced over ranks (and processes). Changes no weight,
    /// optimizer state or training data position. A collective: every process calls it.
    pub fn evaluate(&mut self) -> Result<f32, ExecError> {
        if let Some(r) = self.abort.reason() {
            return Err(ExecError::Aborted(r));
        }
        let world = self.shared.plan.mesh.world() as usize;
        let Some(v) = self.validation.as_mut() else {
            return Err(ExecError::Unsupported(
                "no validation data: add `val: path/to/val.bin` to the parallel spec's `data`".into(),
            ));
        };
        let mesh = self.shared.plan.mesh;
        let layout = self.shared.joint.graph.context_layout();
        let local = v.run(&mut self.ranks, &self.abort, &mesh, layout, &self.device)?;
        let batches = local.first().map_or(0, |l| l.1.len());
        let all = match self.processes.as_ref() {
            None => local,
            Some(procs) => {
                let mut flat = Vec::with_capacity(local.len() * (1 + batches));
                for (rank, losses) in &local {
                    flat.push(*rank as f64);
                    flat.extend(losses.iter().map(|&l| f64::from(l)));
                }
                let t = Tensor::from_vec(flat, local.len() * (1 + batches), &Device::Cpu)?;
                self.sync_tag += 1;
                let got = procs.all_gather(self.sync_tag, &t)?.to_vec1::<f64>()?;
                got.chunks(1 + batches)
                    .map(|c| (c[0] as u64, c[1..].iter().map(|&x| x as f32).collect()))
                    .collect()
            }
        };
        let mut sorted = all;
        sorted.sort_by_key(|r| r.0);
        if sorted.len() != world {
            return Err(ExecError::Internal(format!(
                "validation losses came from {} ranks of {world}",
                sorted.len()
            )));
        }
        // Sum in rank order, batch by batch: the same figure however ranks are placed.
        let (mut sum, mut n) = (0f64, 0usize);
        for (_, losses) in &sorted {
            for &l in losses {
                sum += f64::from(l);
                n += 1;
            }
        }
        Ok((sum / n.max(1) as f64) as f32)
    }

    /// Every rank's step figures, in rank order: this process's own, plus (across
    /// processes) everyone else's.
    fn exchange(&mut self, local: Vec<RankStats>, accum: usize) -> Result<Vec<RankStats>, ExecError> {
        let Some(procs) = self.processes.as_ref() else {
            return Ok(local);
        };
        let width = RankStats::width(accum);
        let mut flat = Vec::with_capacity(width * local.len());
        for r in &local {
            r.encode(accum, &mut flat);
        }
        let t = Tensor::from_vec(flat, width * local.len(), &Device::Cpu)?;
        self.sync_tag += 1;
        let all = procs.all_gather(self.sync_tag, &t)?.to_vec1::<f64>()?;
        let mut out: Vec<RankStats> = all.chunks(width).map(|c| RankStats::decode(c, accum)).collect();
        out.sort_by_key(|r| r.rank);
        Ok(out)
    }

    /// Every process agrees that each has `ok`; returns whether all did (a collective).
    pub(crate) fn all_ok(&mut self, ok: bool) -> Result<bool, ExecError> {
        let Some(procs) = self.processes.as_ref() else {
            return Ok(ok);
        };
        self.sync_tag += 1;
        let t = Tensor::new(&[if ok { 0f64 } else { 1.0 }], &Device::Cpu)?;
        let failed = procs.all_reduce(self.sync_tag, &t, crate::comm::Reduce::Sum)?;
        Ok(failed.to_vec1::<f64>()?[0] == 0.0)
    }

    /// Every process's `mine`, in process order (a collective; just `mine` when this
    /// process runs every rank).
    pub(crate) fn gather_bytes(&mut self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, ExecError> {
        let tag = self.sync_tag + 1;
        self.sync_tag += 2;
        match self.processes.as_ref() {
            None => Ok(vec![mine]),
            Some(procs) => crate::comm::all_gather_bytes(procs.as_ref(), tag, &mine),
        }
    }

    /// Watches `flag` (set by Ctrl-C): after the step during which any process sees it
    /// set, every rank's metrics say `stop`.
    pub fn set_stop_flag(&mut self, flag: std::sync::Arc<std::sync::atomic::AtomicBool>) {
        self.stop_flag = Some(flag);
    }

    /// Records every instruction's measured start and end from now on (`trace`).
    pub fn record_times(&mut self) {
        self.times.get_or_insert_with(Vec::new);
    }

    /// Times every instruction and every compute node from the next step on (`profile`).
    pub fn record_profile(&mut self) {
        self.shared.profile = true;
        if self.profile.is_none() {
            self.profile = Some(crate::train::profile::Recorder::new(
                self.ranks.iter().map(|r| r.rank).collect(),
            ));
        }
    }

    /// The profile of the steps recorded since `record_profile`, every rank's (a
    /// collective: every process calls it and each gets the whole profile); `None` before
    /// any step. `device` names where the ranks computed.
    pub fn profile(&mut self, device: &str) -> Result<Option<crate::train::profile::Profile>, ExecError> {
        let backend = self.backend().to_string();
        let recorder = self.profile.take();
        let out = crate::train::profile::assemble(
            recorder.as_ref(),
            crate::train::profile::About::of(&self.shared.plan),
            device,
            &backend,
            self.shared.device_clock,
            |bytes| self.gather_bytes(bytes),
        );
        self.profile = recorder;
        out
    }

    /// Whether a GPU run's recorded times (`record_times`, `record_profile`) are read from
    /// CUDA events on the streams the work is issued to (`crate::clock`) rather than the
    /// host's clock; the CPU's are the host's either way. Call after the ranks are on their
    /// device.
    pub fn set_device_clock(&mut self, on: bool) {
        self.shared.device_clock = on && self.device.is_cuda();
    }

    /// The global ranks this process runs.
    pub fn local_ranks(&self) -> Vec<u64> {
        self.ranks.iter().map(|r| r.rank).collect()
    }

    /// Whether this process writes what one process writes for the world (logs, traces,
    /// the progress bar): the process running rank 0.
    pub fn is_leader(&self) -> bool {
        self.ranks.first().is_some_and(|r| r.rank == 0)
    }

    /// The communication backend (`local`, `mpi`, `nccl`).
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// Replaces every local rank's data with `make()` (each rank takes its rows of the
    /// global batch the source yields).
    pub fn set_data(&mut self, make: &dyn Fn() -> Box<dyn DataSource>) {
        for d in &mut self.data {
            *d = make();
        }
    }

    /// The full f32 parameters of the whole model, assembled from the shards of replica 0
    /// (for checks and export; no rank holds them): each tensor rank's slice from its shard
    /// group's shards, then, for a parameter split over the tensor group, the whole from
    /// the slices; under expert parallelism every expert rank's experts.
    pub fn full_params(&self) -> Result<Vec<Tensor>, ExecError> {
        self.assemble(|r, gi| Some(r.params[gi].clone()))
    }

    /// Whole f32 tensors, one per parameter of the whole model, from each rank's flat
    /// per-group tensors that `pick` gives (its parameters, or an optimizer state), as
    /// [`ShardedTrainer::full_params`].
    pub(crate) fn assemble(
        &self,
        pick: impl Fn(&crate::runtime::rank::RankState, usize) -> Option<Tensor>,
    ) -> Result<Vec<Tensor>, ExecError> {
        let plan = &self.shared.plan;
        let mesh = plan.mesh;
        let g = &self.shared.joint.graph;
        let mut out: Vec<Option<Tensor>> = vec![None; self.whole.names.len()];
        for (gi, grp) in plan.groups.iter().enumerate() {
            let l = &grp.layout;
            let expert_ranks = if grp.group.experts { mesh.expert() } else { 1 };
            for pl in &l.params {
                let dims: Vec<usize> = pl.dims.iter().map(|&d| d as usize).collect();
                for e in 0..expert_ranks {
                    let mut slices = Vec::with_capacity(mesh.tensor() as usize);
                    for t in 0..mesh.tensor() {
                        let mut pieces = Vec::new();
                        for s in 0..l.shard {
                            let rows = chunk_rows(pl.dims.first().copied().unwrap_or(1), l.shard, s);
                            let n = ((rows.end - rows.start) * pl.row_elems) as usize;
                            if n > 0 {
                                let shard = if grp.group.experts { s * mesh.expert() + e } else { s };
                                let rank = mesh.rank(Coords {
                                    replicate: 0,
                                    shard,
                                    tensor: t,
                                });
                                let state = self.ranks.iter().find(|r| r.rank == rank).ok_or_else(|| {
                                    ExecError::Unsupported(format!(
                                        "full_params needs rank {rank}, which runs in another process"
                                    ))
                                })?;
                                let flat = pick(state, gi).ok_or_else(|| {
                                    ExecError::Internal(format!("rank {rank} holds no such state of group g{gi}"))
                                })?;
                                pieces.push(flat.narrow(0, pl.shard_offset as usize, n)?);
                            }
                        }
                        slices.push(Tensor::cat(&pieces, 0)?.reshape(dims.as_slice())?);
                    }
                    out[self.whole.id(pl.param, e)] = Some(match &g.param(pl.param).tensor {
                        Some(split) => whole_from_slices(&slices, split)?,
                        None => slices.swap_remove(0),
                    });
                }
            }
        }
        out.into_iter()
            .enumerate()
            .map(|(i, t)| {
                t.ok_or_else(|| ExecError::Internal(format!("parameter {} is in no group", self.whole.names[i])))
            })
            .collect()
    }
}

/// One rank's figures of one step, as exchanged between processes.
#[derive(Clone, Debug)]
struct RankStats {
    rank: u64,
    losses: Vec<f32>,
    grad_norm: f64,
    peak: u64,
    device: ByCategory,
    host: ByCategory,
    exposed: f64,
    stop: bool,
    dev: Option<crate::runtime::device::DeviceMemory>,
    routing: Option<RoutingLoad>,
}

impl RankStats {
    fn width(accum: usize) -> usize {
        // rank, losses, norm, peak, device and host by category, exposed, stop, the
        // device's four figures, the routing's two
        1 + accum + 1 + 1 + 2 * Category::ALL.len() + 1 + 1 + 4 + 2
    }

    // f64 holds every byte count below 2^53 (8 PiB) exactly.
    fn encode(&self, accum: usize, out: &mut Vec<f64>) {
        out.push(self.rank as f64);
        out.extend((0..accum).map(|i| self.losses.get(i).map_or(f64::NAN, |&l| f64::from(l))));
        out.push(self.grad_norm);
        out.push(self.peak as f64);
        out.extend(Category::ALL.iter().map(|&c| self.device.get(c) as f64));
        out.extend(Category::ALL.iter().map(|&c| self.host.get(c) as f64));
        out.push(self.exposed);
        out.push(if self.stop { 1.0 } else { 0.0 });
        match self.dev {
            Some(d) => out.extend([d.allocated_peak, d.reserved_peak, d.in_use, d.total].map(|b| b as f64)),
            None => out.extend([f64::NAN; 4]),
        }
        match self.routing {
            Some(l) => out.extend([l.rows as f64, l.even as f64]),
            None => out.extend([f64::NAN; 2]),
        }
    }

    fn decode(c: &[f64], accum: usize) -> RankStats {
        let k = Category::ALL.len();
        let mut device = ByCategory::default();
        let mut host = ByCategory::default();
        let base = 1 + accum + 2;
        for (i, &cat) in Category::ALL.iter().enumerate() {
            *device.slot(cat) = c[base + i] as u64;
            *host.slot(cat) = c[base + k + i] as u64;
        }
        RankStats {
            rank: c[0] as u64,
            losses: c[1..1 + accum]
                .iter()
                .filter(|x| !x.is_nan())
                .map(|&x| x as f32)
                .collect(),
            grad_norm: c[1 + accum],
            peak: c[2 + accum] as u64,
            device,
            host,
            exposed: c[base + 2 * k],
            stop: c[base + 2 * k + 1] != 0.0,
            dev: {
                let d = &c[base + 2 * k + 2..base + 2 * k + 6];
                (!d[0].is_nan()).then(|| crate::runtime::device::DeviceMemory {
                    allocated_peak: d[0] as u64,
                    reserved_peak: d[1] as u64,
                    in_use: d[2] as u64,
                    total: d[3] as u64,
                })
            },
            routing: {
                let l = &c[base + 2 * k + 6..base + 2 * k + 8];
                (!l[0].is_nan()).then(|| RoutingLoad {
                    rows: l[0] as u64,
                    even: l[1] as u64,
                })
            },
        }
    }
}
