//! The pipeline of a run planned from its spec and graph: the stages, where they run,
//! each rank's program, and that program against the clock with every stage's compute
//! time from the cost model.

use super::cut::{stage_graphs, StageGraph};
use super::memory::{rank_memory, RankMemory, StageMemory};
use super::split::{split_stages, stages_per_rank};
use super::timeline::{simulate, StageTimes, Timeline};
use super::{check, CustomSchedule, PipelineProgram, Shape};
use crate::cost::OpModel;
use crate::{Plan, PlanError};
use shardplan_frontends::{ParallelConfig, Pipeline};
use shardplan_ir::{Graph, JointGraph, ModuleKind, NodeId};
use std::collections::HashSet;
use std::sync::Arc;

/// One stage: its modules, the pipeline rank that runs it, its parameters, times and
/// memory, and its own FSDP plan.
#[derive(Clone, Debug, PartialEq)]
pub struct StagePlan {
    pub modules: Vec<String>,
    pub rank: u32,
    /// Parameters of this tensor rank's slice of the stage.
    pub params: u64,
    pub times: StageTimes,
    pub memory: StageMemory,
    /// The FSDP program of one micro-batch on the stage's ranks (shared by stages alike).
    pub fsdp: Arc<Plan>,
}

/// A run's pipeline: stages, program, timeline, each rank's memory, and the seconds one
/// activation (or its gradient) takes between adjacent stages' ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelinePlan {
    pub stages: Vec<StagePlan>,
    pub program: PipelineProgram,
    pub timeline: Timeline,
    /// Every pipeline rank's memory at its peak, by rank.
    pub memory: Vec<RankMemory>,
    /// The whole step: the pipeline's program, then each rank's optimizer step over its
    /// stages (the slowest rank's end), and the executor's start of a step.
    pub step_s: f64,
    pub p2p_s: f64,
    /// Bytes one micro-batch's activations crossing a stage boundary take.
    pub boundary_bytes: u64,
}

impl PipelinePlan {
    /// The rank with the largest peak and its device bytes: that peak plus the CUDA context
    /// and NCCL buffers of its stages' FSDP plan. `None` without ranks.
    pub fn largest_rank(&self) -> Option<(&RankMemory, u64)> {
        let top = self.memory.iter().max_by_key(|r| r.peak)?;
        let overhead = self
            .stages
            .iter()
            .find(|s| s.rank == top.rank)
            .map_or(0, |s| s.fsdp.memory.overhead.total());
        Some((top, top.peak + overhead))
    }
}

/// Plans `config`'s pipeline over `forward`, the model's forward graph traced at one
/// micro-batch: `config.pipeline` must be set; `custom` is the validated schedule of its
/// `pipeline.csv`, where written.
pub fn plan_pipeline(
    forward: &Graph,
    config: &ParallelConfig,
    custom: Option<CustomSchedule>,
) -> Result<PipelinePlan, PlanError> {
    let (program, modules) = program_and_split(forward, config, custom)?;
    let stages = plan_stages(forward, config, modules)?;
    assemble(program, &stages, config)
}

/// `config`'s schedule built at its size (or `custom`) and the model's top-level modules of
/// `forward` split into its stages.
pub(crate) fn program_and_split(
    forward: &Graph,
    config: &ParallelConfig,
    custom: Option<CustomSchedule>,
) -> Result<(PipelineProgram, Vec<Vec<String>>), PlanError> {
    let pipeline = config.pipeline.as_ref().ok_or_else(|| PlanError::Pipeline {
        field: "mesh.pipeline",
        message: "the spec has no pipeline axis".into(),
        fix: "set mesh.pipeline to 2 or more".into(),
    })?;
    let ranks = config.mesh.pipeline;
    let top_level = super::top_level_modules(forward);
    let blocks = top_level.iter().filter(|(_, k)| *k == ModuleKind::Block).count() as u64;
    let program = match custom {
        Some(custom) => PipelineProgram::custom(custom),
        None => {
            let v = stages_per_rank(
                &pipeline.split,
                pipeline.stages_per_rank,
                pipeline.schedule,
                ranks,
                blocks,
            )?;
            let shape = shape(pipeline, ranks, v)?;
            PipelineProgram::build(pipeline.schedule, shape).map_err(|e| PlanError::Bug(e.to_string()))?
        }
    };
    let modules = split_stages(&top_level, &pipeline.split, u64::from(program.stages()))?;
    if modules.len() != program.stages() as usize {
        return Err(PlanError::Pipeline {
            field: "pipeline.csv",
            message: format!(
                "the schedule runs {} stages, but the module lists make {}",
                program.stages(),
                modules.len()
            ),
            fix: "list as many stages in modules_per_stage as the schedule runs".into(),
        });
    }
    Ok((program, modules))
}

/// What the stages of one split hold, whatever the schedule: the modules, parameters,
/// times, memory figures and FSDP plan of each, and the activation crossing a boundary.
#[derive(Clone, Debug)]
pub(crate) struct Stages {
    pub(crate) modules: Vec<Vec<String>>,
    params: Vec<u64>,
    times: Vec<StageTimes>,
    memory: Vec<StageMemory>,
    fsdp: Vec<Arc<Plan>>,
    /// Each stage's optimizer step (with its gradient norm share), once a step.
    optimizer: Vec<f64>,
    boundary_bytes: u64,
}

/// The stages `modules` of `forward` (traced at one micro-batch), each cut, differentiated
/// and planned on its own.
pub(crate) fn plan_stages(
    forward: &Graph,
    config: &ParallelConfig,
    modules: Vec<Vec<String>>,
) -> Result<Stages, PlanError> {
    let graphs = stage_graphs(forward, &modules, config.diff_options())?;
    // The largest activation crossing a boundary (every stage sends what the next reads).
    let boundary_bytes = graphs
        .iter()
        .filter_map(|g| g.input.map(|input| g.joint.graph.node(input).ty.bytes().unwrap_or(0)))
        .max()
        .unwrap_or(0);
    let fsdp = stage_fsdp_plans(&graphs, config)?;
    let times = graphs
        .iter()
        .zip(&fsdp)
        .map(|(g, plan)| stage_times(&g.joint, plan, config))
        .collect();
    let params: Vec<u64> = graphs
        .iter()
        .map(|g| g.joint.graph.params().map(|(_, p)| p.ty.numel().unwrap_or(0)).sum())
        .collect();
    let memory = fsdp
        .iter()
        .zip(&params)
        .map(|(plan, &params)| {
            StageMemory::of_plan(
                plan,
                params,
                config.mixed_precision.param.size_bytes(),
                config.mixed_precision.reduce.size_bytes(),
            )
        })
        .collect();
    let optimizer = fsdp.iter().map(|p| once_a_step(p).optimizer).collect();
    Ok(Stages {
        modules,
        params,
        times,
        memory,
        fsdp,
        optimizer,
        boundary_bytes,
    })
}

/// `program` run over `stages`: its timeline and every rank's memory.
pub(crate) fn assemble(
    program: PipelineProgram,
    stages: &Stages,
    config: &ParallelConfig,
) -> Result<PipelinePlan, PlanError> {
    let p2p_s = p2p_seconds(config, stages.boundary_bytes);
    let timeline = simulate(&program.lowered, &stages.times, p2p_s).map_err(|e| PlanError::Bug(e.to_string()))?;
    let memory = rank_memory(
        &program.lowered,
        &program.rank_of_stage,
        &stages.memory,
        stages.boundary_bytes,
    );
    let plans = (0..stages.modules.len())
        .map(|s| StagePlan {
            rank: program.rank_of_stage[s],
            params: stages.params[s],
            modules: stages.modules[s].clone(),
            times: stages.times[s],
            memory: stages.memory[s],
            fsdp: stages.fsdp[s].clone(),
        })
        .collect();
    let step_s = timeline
        .ends
        .iter()
        .enumerate()
        .map(|(rank, end)| {
            let optimizer: f64 = (0..stages.modules.len())
                .filter(|&s| program.rank_of_stage[s] as usize == rank)
                .map(|s| stages.optimizer[s])
                .sum();
            end + optimizer
        })
        .fold(0.0, f64::max)
        + config.hardware.step_overhead_us * 1e-6;
    Ok(PipelinePlan {
        stages: plans,
        program,
        timeline,
        memory,
        step_s,
        p2p_s,
        boundary_bytes: stages.boundary_bytes,
    })
}

/// Each stage's FSDP plan of one micro-batch on its ranks: the spec without its pipeline,
/// one micro-batch a rank. Stages alike in structure (a pipeline's middle stages) share
/// one plan.
///
/// Each stage is wrapped as torchtitan wraps a model part: the spec's wrap policy over the
/// modules the stage has, and the stage's root (a stage of only an embedding, or only the
/// norm and head, is one root unit).
fn stage_fsdp_plans(graphs: &[StageGraph], config: &ParallelConfig) -> Result<Vec<Arc<Plan>>, PlanError> {
    let mut inner = config.clone();
    inner.pipeline = None;
    inner.mesh.pipeline = 1;
    inner.batch.per_rank = config.micro_batch();
    inner.batch.grad_accum = 1;
    let mut made: Vec<(usize, Arc<Plan>)> = Vec::new();
    let mut plans = Vec::with_capacity(graphs.len());
    for (s, g) in graphs.iter().enumerate() {
        let alike = made
            .iter()
            .find(|(t, _)| graphs[*t].joint.graph.same_structure(&g.joint.graph))
            .map(|(_, p)| p.clone());
        let plan = match alike {
            Some(p) => p,
            None => {
                let p = Arc::new(crate::plan(&g.joint, &stage_wrap(&inner, &g.joint.graph))?);
                made.push((s, p.clone()));
                p
            }
        };
        plans.push(plan);
    }
    Ok(plans)
}

/// The schedule's size, refused where torch refuses it.
fn shape(pipeline: &Pipeline, ranks: u64, v: u64) -> Result<Shape, PlanError> {
    let too_big = |field| PlanError::Pipeline {
        field,
        message: "more than 2^32 pipeline ranks, stages or micro-batches".into(),
        fix: "use a realistic pipeline".into(),
    };
    let shape = Shape {
        ranks: u32::try_from(ranks).map_err(|_| too_big("mesh.pipeline"))?,
        stages_per_rank: u32::try_from(v).map_err(|_| too_big("pipeline.stages_per_rank"))?,
        microbatches: u32::try_from(pipeline.microbatches).map_err(|_| too_big("pipeline.microbatches"))?,
    };
    check(pipeline.schedule, shape).map_err(|e| PlanError::Pipeline {
        field: match e {
            super::ScheduleError::SingleStage { .. } | super::ScheduleError::VNeedsTwo { .. } => {
                "pipeline.stages_per_rank"
            }
            _ => "pipeline.microbatches",
        },
        fix: e.fix(),
        message: e.to_string(),
    })?;
    Ok(shape)
}

/// `config` with its wrap policy cut to the module kinds and paths `stage` has.
fn stage_wrap(config: &ParallelConfig, stage: &Graph) -> ParallelConfig {
    let mut c = config.clone();
    c.wrap.retain(|k| stage.scopes().any(|(_, s)| s.kind == *k));
    c.wrap_modules.retain(|m| stage.scopes().any(|(_, s)| s.path == *m));
    c
}

/// A stage's forward, input-gradient and weight-gradient seconds: the weight half is the
/// nodes that make parameter gradients, the input half the rest of the backward, with the
/// forward its FSDP `plan` recomputes under activation checkpointing (before the input
/// gradient, which reads it).
fn stage_times(joint: &JointGraph, plan: &Plan, config: &ParallelConfig) -> StageTimes {
    let g = &joint.graph;
    let model = OpModel::new(g, &config.hardware, config.mixed_precision.param);
    let weight_grads: HashSet<NodeId> = joint.param_grads.iter().flatten().copied().collect();
    let mut times = StageTimes {
        forward: 0.0,
        backward_input: 0.0,
        backward_weight: 0.0,
        unshard: 0.0,
        reduce: 0.0,
        accumulate: accumulate_seconds(g, config),
    };
    for (id, node) in g.nodes() {
        let t = model.seconds(id);
        let slot = if !node.is_backward() {
            &mut times.forward
        } else if weight_grads.contains(&id) {
            &mut times.backward_weight
        } else {
            &mut times.backward_input
        };
        *slot += t;
    }
    let once = once_a_step(plan);
    times.unshard = once.unshard;
    times.reduce = once.reduce;
    for step in plan.steps.iter().filter(|s| s.phase == crate::Phase::Recompute) {
        for run in &step.nodes {
            for n in run.clone() {
                times.backward_input += model.seconds(NodeId::new(n as usize));
            }
        }
    }
    times
}

/// Seconds to add one micro-batch's gradients into the stage's unsharded sums in the
/// reduce dtype, in place: both read, the sum written, at the device's bandwidth (as
/// `PackGrads` is costed).
fn accumulate_seconds(g: &Graph, config: &ParallelConfig) -> f64 {
    let hw = &config.hardware;
    let elems: u64 = g.params().map(|(_, p)| p.ty.numel().unwrap_or(0)).sum();
    let bytes = 3 * elems * config.mixed_precision.reduce.size_bytes();
    bytes as f64 / (hw.hbm_gbps * 1e9 * hw.memory_efficiency)
}

/// What a stage does once a step whatever its micro-batches, in seconds, from its FSDP
/// plan of one micro-batch: the all-gather of its parameters (the forward's all-gathers,
/// one a group), the gradient reduction (packing, reduce-scatter, HSDP's all-reduce), and
/// the optimizer's step with its share of the gradient norm.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct OnceAStep {
    pub(crate) unshard: f64,
    pub(crate) reduce: f64,
    pub(crate) optimizer: f64,
}

pub(crate) fn once_a_step(plan: &Plan) -> OnceAStep {
    let mut once = OnceAStep::default();
    let Some(program) = plan.programs.first() else {
        return once;
    };
    let first_backward = program
        .instrs
        .iter()
        .position(|i| match &i.instr {
            crate::Instr::Compute { step, .. } => plan
                .steps
                .get(step.index())
                .is_some_and(|s| s.phase != crate::Phase::Forward),
            _ => false,
        })
        .unwrap_or(program.instrs.len());
    for (k, issued) in program.instrs.iter().enumerate() {
        let seconds = plan.timing.end.get(k).copied().unwrap_or(0.0) - plan.timing.start.get(k).copied().unwrap_or(0.0);
        match &issued.instr {
            crate::Instr::AllGather { .. } if k < first_backward => once.unshard += seconds,
            crate::Instr::PackGrads { .. } | crate::Instr::ReduceScatter { .. } | crate::Instr::AllReduce { .. } => {
                once.reduce += seconds
            }
            crate::Instr::GradNorm { .. } | crate::Instr::OptimizerStep { .. } => once.optimizer += seconds,
            _ => {}
        }
    }
    once
}

/// The seconds `bytes` take between two pipeline ranks: across nodes when a stage's ranks
/// fill a node or more (pipeline is the outermost axis), else over NVLink.
fn p2p_seconds(config: &ParallelConfig, bytes: u64) -> f64 {
    let hw = &config.hardware;
    let (gbps, latency_us) = if config.mesh.stage_world() >= config.gpus_per_node {
        (hw.inter_node_gbps, hw.inter_node_latency_us)
    } else {
        (hw.intra_node_gbps, hw.intra_node_latency_us)
    };
    latency_us * 1e-6 + bytes as f64 / (gbps * 1e9)
}
