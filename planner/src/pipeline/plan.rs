//! The pipeline of a run planned from its spec and graph: the stages, where they run,
//! each rank's program, and that program against the clock with every stage's compute
//! time from the cost model.

use super::split::{split_stages, stages_per_rank};
use super::timeline::{simulate, StageTimes, Timeline};
use super::{check, CustomSchedule, PipelineProgram, Shape};
use crate::cost::OpModel;
use crate::PlanError;
use shardplan_frontends::{ParallelConfig, Pipeline};
use shardplan_ir::{Graph, JointGraph, ModuleKind, NodeId, Op, ScopeId};
use std::collections::{HashMap, HashSet};

/// One stage: its modules, the pipeline rank that runs it, its parameters and times.
#[derive(Clone, Debug, PartialEq)]
pub struct StagePlan {
    pub modules: Vec<String>,
    pub rank: u32,
    /// Parameters of this tensor rank's slice of the stage.
    pub params: u64,
    pub times: StageTimes,
}

/// A run's pipeline: stages, program, timeline, and the seconds one activation (or its
/// gradient) takes between adjacent stages' ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelinePlan {
    pub stages: Vec<StagePlan>,
    pub program: PipelineProgram,
    pub timeline: Timeline,
    pub p2p_s: f64,
    /// Bytes one micro-batch's activations crossing a stage boundary take.
    pub boundary_bytes: u64,
}

/// Plans `config`'s pipeline over `joint` (traced at one micro-batch): `config.pipeline`
/// must be set; `custom` is the validated schedule of its `pipeline.csv`, where written.
pub fn plan_pipeline(
    joint: &JointGraph,
    config: &ParallelConfig,
    custom: Option<CustomSchedule>,
) -> Result<PipelinePlan, PlanError> {
    let pipeline = config.pipeline.as_ref().ok_or_else(|| PlanError::Pipeline {
        field: "mesh.pipeline",
        message: "the spec has no pipeline axis".into(),
        fix: "set mesh.pipeline to 2 or more".into(),
    })?;
    let graph = &joint.graph;
    let ranks = config.mesh.pipeline;
    let top_level = super::top_level_modules(graph);
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
    let stage_of = stage_of_nodes(&joint.graph, &modules);
    let times = stage_times(joint, config, &stage_of, modules.len());
    let boundary_bytes = boundary_bytes(joint, &stage_of);
    let p2p_s = p2p_seconds(config, boundary_bytes);
    let timeline = simulate(&program.lowered, &times, p2p_s).map_err(|e| PlanError::Bug(e.to_string()))?;
    let params = stage_params(joint, &stage_of, modules.len());
    let stages = modules
        .into_iter()
        .enumerate()
        .map(|(s, modules)| StagePlan {
            rank: program.rank_of_stage[s],
            params: params[s],
            modules,
            times: times[s],
        })
        .collect();
    Ok(PipelinePlan {
        stages,
        program,
        timeline,
        p2p_s,
        boundary_bytes,
    })
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

/// Each node's stage (`None` for the model's inputs, which any stage may read): a node
/// goes with its top-level module, a backward node with its forward node.
pub(crate) fn stage_of_nodes(g: &Graph, stages: &[Vec<String>]) -> Vec<Option<usize>> {
    let stage_of_module: HashMap<&str, usize> = stages
        .iter()
        .enumerate()
        .flat_map(|(s, modules)| modules.iter().map(move |m| (m.as_str(), s)))
        .collect();
    let stage_of_scope: HashMap<ScopeId, usize> = g
        .scopes()
        .filter_map(|(id, _)| {
            let top = g.top_level(id);
            let stage = stage_of_module.get(g.scope(top).path.as_str())?;
            (top != g.root()).then_some((id, *stage))
        })
        .collect();
    let mut stage_of: Vec<Option<usize>> = Vec::with_capacity(g.node_count());
    for (_, node) in g.nodes() {
        let stage = match (stage_of_scope.get(&node.scope), &node.op, node.grad_of) {
            (Some(&s), _, _) => Some(s),
            (None, Op::Input { .. }, None) => None,
            (None, _, Some(of)) => stage_of[of.index()],
            // An op at the model's root (GPT-2's sum of token and position embeddings)
            // goes with the latest stage of its operands.
            (None, _, None) => node.inputs.iter().filter_map(|i| stage_of[i.index()]).max(),
        };
        stage_of.push(stage);
    }
    stage_of
}

/// Every stage's forward, input-gradient and weight-gradient seconds: the weight half is
/// the nodes that make parameter gradients, the input half the rest of the backward.
fn stage_times(
    joint: &JointGraph,
    config: &ParallelConfig,
    stage_of: &[Option<usize>],
    stages: usize,
) -> Vec<StageTimes> {
    let g = &joint.graph;
    let model = OpModel::new(g, &config.hardware, config.mixed_precision.param);
    let weight_grads: HashSet<NodeId> = joint.param_grads.iter().flatten().copied().collect();
    let mut times = vec![
        StageTimes {
            forward: 0.0,
            backward_input: 0.0,
            backward_weight: 0.0,
        };
        stages
    ];
    for (id, node) in g.nodes() {
        let Some(s) = stage_of[id.index()] else {
            continue;
        };
        let t = model.seconds(id);
        let slot = if !node.is_backward() {
            &mut times[s].forward
        } else if weight_grads.contains(&id) {
            &mut times[s].backward_weight
        } else {
            &mut times[s].backward_input
        };
        *slot += t;
    }
    times
}

/// Bytes of the forward values one stage's nodes read from an earlier stage (the hidden
/// state, in a transformer).
fn boundary_bytes(joint: &JointGraph, stage_of: &[Option<usize>]) -> u64 {
    let g = &joint.graph;
    let mut crossing: HashSet<NodeId> = HashSet::new();
    for (id, node) in g.nodes().take(joint.forward_len) {
        let Some(s) = stage_of[id.index()] else {
            continue;
        };
        for &input in node.inputs.iter() {
            if stage_of[input.index()].is_some_and(|from| from < s) {
                crossing.insert(input);
            }
        }
    }
    // The largest boundary: every stage sends what its successors read.
    crossing
        .iter()
        .map(|&n| g.node(n).ty.bytes().unwrap_or(0))
        .max()
        .unwrap_or(0)
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

/// Each stage's parameter count (this tensor rank's slices).
fn stage_params(joint: &JointGraph, stage_of: &[Option<usize>], stages: usize) -> Vec<u64> {
    let mut params = vec![0u64; stages];
    for (id, node) in joint.graph.nodes() {
        if let (Some(s), Op::Param { .. }) = (stage_of[id.index()], &node.op) {
            params[s] += node.ty.shape.numel().unwrap_or(0);
        }
    }
    params
}
