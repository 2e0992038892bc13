//! Pipeline-parallel training on threads: each pipeline rank runs its stages' graphs in the
//! order of its lowered program (torch.distributed.pipelining's actions), receiving its
//! input activation from the previous stage's rank and its output gradient from the next.
//!
//! A stage keeps a micro-batch's forward values until that micro-batch's backward (B, or
//! its W after an I) and sums its parameters' gradients over the step's micro-batches,
//! scaled by 1 / M at the end as torch's schedules scale them, so a step equals one rank's
//! step over the same batch. The optimizer runs per stage; the gradient norm and the loss
//! are summed over the pipeline ranks. FSDP inside a stage (a stage world above 1) is not
//! run here yet: such a spec is refused.

use crate::comm::local::{local_group, LocalGroup};
use crate::comm::p2p::{local_p2p, LocalP2p, PointToPoint};
use crate::comm::{Abort, Collectives, Reduce};
use crate::cpu::kernels::{cdtype, Ctx};
use crate::init::init_elements;
use crate::runtime::interp::Interpreter;
use crate::runtime::optim::{base_lr, lr_at, OptState};
use crate::train::data::DataSource;
use crate::train::trainer::data_source;
use crate::ExecError;
use candle_core::{DType as CDType, Device, Tensor};
use shardplan_frontends::ParallelConfig;
use shardplan_ir::{NodeId, Op};
use shardplan_models::{trace, ModelConfig};
use shardplan_planner::pipeline::{stage_graphs, Action, OpKind, PipelinePlan, StageGraph};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// What one pipeline step did, as written to the metrics log.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PipelineMetrics {
    pub step: u64,
    /// Mean loss over the step's micro-batches.
    pub loss: f32,
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    pub tokens: u64,
    pub step_seconds: f64,
    pub tokens_per_second: f64,
}

/// One stage as a rank runs it.
struct Stage {
    index: usize,
    graph: StageGraph,
    interp: Interpreter,
    input_half: Vec<NodeId>,
    weight_half: Vec<NodeId>,
    /// f32 master weights and optimizer state of the stage's parameters.
    master: Vec<Tensor>,
    opt: OptState,
}

/// One pipeline rank: its stages and its ends of the pipeline's links.
struct Rank {
    stages: Vec<Stage>,
    program: Vec<Action>,
    p2p: LocalP2p,
    group: LocalGroup,
    /// The rank's kernels' context (each thread its own).
    ctx: Ctx,
}

/// A micro-batch in flight on one stage: its values, from forward to the last backward.
type Values = Vec<Option<Tensor>>;

/// Pipeline training over every pipeline rank as a thread of this process.
pub struct PipelineTrainer {
    ranks: Vec<Rank>,
    /// The pipeline rank of each stage.
    rank_of_stage: Vec<usize>,
    microbatches: usize,
    data: Box<dyn DataSource>,
    ctx: Ctx,
    config: ParallelConfig,
    /// Ends every rank's waits when one fails.
    abort: Arc<Abort>,
    /// Parameters of the model, for [`PipelineTrainer::master`].
    params: usize,
    total_steps: u64,
    step: u64,
}

impl PipelineTrainer {
    /// Cuts `model` into `plan`'s stages and initialises them as one rank would.
    pub fn new(
        model: &ModelConfig,
        config: &ParallelConfig,
        plan: &PipelinePlan,
        total_steps: u64,
        device: Device,
    ) -> Result<Self, ExecError> {
        let pipeline = config
            .pipeline
            .as_ref()
            .ok_or_else(|| ExecError::Internal("a pipeline trainer without a pipeline".into()))?;
        if config.mesh.stage_world() != 1 {
            return Err(ExecError::Unsupported(format!(
                "each pipeline stage has {} ranks (replicate x shard x tensor); the pipeline executor runs one rank a stage for now: use mesh {{pipeline: {}}}",
                config.mesh.stage_world(),
                config.mesh.pipeline
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
        let abort = Arc::new(Abort::default());
        let p = plan.program.lowered.len();
        let mut links = local_p2p(p, "pipeline group", &abort).into_iter();
        let mut groups = local_group(p, "pipeline group", &abort).into_iter();
        let mut ranks: Vec<Rank> = plan
            .program
            .lowered
            .iter()
            .map(|program| {
                Ok(Rank {
                    stages: Vec::new(),
                    program: program.clone(),
                    p2p: links
                        .next()
                        .ok_or_else(|| ExecError::Internal("too few links".into()))?,
                    group: groups
                        .next()
                        .ok_or_else(|| ExecError::Internal("too few groups".into()))?,
                    ctx: Ctx::new(device.clone()),
                })
            })
            .collect::<Result<_, ExecError>>()?;
        let rank_of_stage: Vec<usize> = plan.program.rank_of_stage.iter().map(|&r| r as usize).collect();
        for (index, graph) in graphs.into_iter().enumerate() {
            let master = graph
                .params
                .iter()
                .map(|&p| {
                    let param = forward.param(p);
                    let dims: Vec<usize> = param.ty.shape.dims().iter().map(|&d| d as usize).collect();
                    let n = param.ty.numel().unwrap_or(0);
                    Tensor::from_vec(init_elements(&forward, p, config.seed, 0..n), dims.as_slice(), &device)
                })
                .collect::<Result<Vec<_>, _>>()?;
            let keep: Vec<NodeId> = Vec::new();
            ranks[rank_of_stage[index]].stages.push(Stage {
                index,
                input_half: graph.input_half(),
                weight_half: graph.weight_half(),
                interp: Interpreter::new(graph.joint.graph.clone(), &keep),
                opt: OptState::new(config.optimizer, master.len()),
                master,
                graph,
            });
        }
        let first = forward.node(forward.inputs()[0]).ty.shape.dims().to_vec();
        let seq = first.get(1).copied().unwrap_or(1) as usize;
        let data = data_source(model, config, config.batch.per_rank as usize, seq)?;
        let params = forward.params().len();
        Ok(PipelineTrainer {
            ranks,
            rank_of_stage,
            microbatches: pipeline.microbatches as usize,
            data,
            ctx: Ctx::new(device),
            config: config.clone(),
            abort,
            params,
            total_steps,
            step: 0,
        })
    }

    /// Steps taken so far.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// The f32 master weights, by the model's parameter id.
    pub fn master(&self) -> Vec<Tensor> {
        let mut all: Vec<Option<Tensor>> = vec![None; self.params];
        for stage in self.ranks.iter().flat_map(|r| &r.stages) {
            for (p, m) in stage.graph.params.iter().zip(&stage.master) {
                all[p.index()] = Some(m.clone());
            }
        }
        all.into_iter().flatten().collect()
    }

    /// One optimizer step: every rank's program over the batch's micro-batches.
    pub fn step(&mut self) -> Result<PipelineMetrics, ExecError> {
        let start = Instant::now();
        let batch = self.data.next_batch(&self.ctx.device)?;
        let chunks = split_batch(&batch.inputs, self.microbatches)?;
        let lr = lr_at(
            self.step,
            self.total_steps,
            base_lr(&self.config.optimizer),
            &self.config.lr_schedule,
        );
        let run = StepRun {
            chunks: &chunks,
            rank_of_stage: &self.rank_of_stage,
            microbatches: self.microbatches,
            config: &self.config,
            step: self.step,
            lr,
        };
        let results: Vec<Result<(f64, f64), ExecError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .map(|rank| {
                    let (run, abort) = (&run, &self.abort);
                    scope.spawn(move || {
                        let out = run.rank_step(rank);
                        if let Err(e) = &out {
                            // The other ranks' waits end with this rank's reason.
                            abort.abort(format!("pipeline rank {}: {e}", rank.p2p.index()));
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
            loss: (summary.0 / self.microbatches as f64) as f32,
            lr,
            grad_norm: summary.1 as f32,
            tokens: batch.tokens,
            step_seconds: secs,
            tokens_per_second: batch.tokens as f64 / secs.max(1e-9),
        })
    }
}

/// What every rank's step shares.
struct StepRun<'a> {
    chunks: &'a [HashMap<String, Tensor>],
    rank_of_stage: &'a [usize],
    microbatches: usize,
    config: &'a ParallelConfig,
    step: u64,
    lr: f64,
}

/// Tag of the activation crossing boundary `b` (after stage `b`) for micro-batch `m`, or
/// of its gradient.
fn tag(b: usize, m: usize, microbatches: usize, gradient: bool) -> u64 {
    ((b * microbatches + m) * 2 + usize::from(gradient)) as u64
}

impl StepRun<'_> {
    /// One rank's step: its program, then the optimizer on its stages. Returns the step's
    /// loss summed over micro-batches and the global gradient norm.
    fn rank_step(&self, rank: &mut Rank) -> Result<(f64, f64), ExecError> {
        let mut state = RankState::default();
        let params: Vec<Vec<Tensor>> = rank
            .stages
            .iter()
            .map(|s| {
                s.master
                    .iter()
                    .map(|m| m.to_dtype(cdtype(self.config.mixed_precision.param)))
                    .collect()
            })
            .collect::<Result<_, _>>()?;
        let program = rank.program.clone();
        for action in &program {
            for op in action.ops() {
                let Some(m) = op.microbatch.map(|m| m as usize) else {
                    continue;
                };
                let at = rank
                    .stages
                    .iter()
                    .position(|s| s.index == op.stage as usize)
                    .ok_or_else(|| {
                        ExecError::Internal(format!("{action} names a stage rank {} lacks", rank.p2p.index()))
                    })?;
                self.run_op(rank, at, &params[at], op.kind, m, &mut state)?;
            }
        }
        self.finish(rank, state)
    }

    /// One op of the program on the rank's `at`-th stage for micro-batch `m`.
    fn run_op(
        &self,
        rank: &mut Rank,
        at: usize,
        params: &[Tensor],
        kind: OpKind,
        m: usize,
        state: &mut RankState,
    ) -> Result<(), ExecError> {
        let stage = &rank.stages[at];
        let s = stage.index;
        let last = s + 1 == self.rank_of_stage.len();
        let g = &stage.graph;
        match kind {
            OpKind::Forward => {
                let received = match s {
                    0 => None,
                    _ => Some(self.receive(rank, state, s - 1, m, false)?),
                };
                let mut values: Values = vec![None; g.joint.graph.node_count()];
                let forward = (0..g.joint.forward_len).map(NodeId::new);
                stage.interp.eval_nodes(&rank.ctx, forward, &mut values, &mut |id| {
                    feed(g, params, &self.chunks[m], received.as_ref(), None, id)
                })?;
                let out = take_value(&values, g.output)?;
                if last {
                    state.loss += f64::from(out.to_dtype(CDType::F32)?.to_scalar::<f32>()?);
                } else {
                    state.outgoing.insert((s, m, false), out);
                }
                state.values.insert((s, m), values);
            }
            OpKind::Backward | OpKind::BackwardInput => {
                let grad = match last {
                    true => None,
                    false => Some(self.receive(rank, state, s + 1, m, true)?),
                };
                let values = state.values.get_mut(&(s, m)).ok_or_else(|| {
                    ExecError::Internal(format!("backward of stage {s} micro-batch {m} before its forward"))
                })?;
                let nodes: Vec<NodeId> = match kind {
                    OpKind::Backward => (g.joint.forward_len..g.joint.graph.node_count())
                        .map(NodeId::new)
                        .collect(),
                    _ => stage.input_half.clone(),
                };
                stage.interp.eval_nodes(&rank.ctx, nodes, values, &mut |id| {
                    feed(g, params, &self.chunks[m], None, grad.as_ref(), id)
                })?;
                if let Some(dx) = g.input_grad {
                    state.outgoing.insert((s, m, true), take_value(values, dx)?);
                }
                if kind == OpKind::Backward {
                    self.accumulate(stage, state, m)?;
                }
            }
            OpKind::BackwardWeight => {
                let values = state
                    .values
                    .get_mut(&(s, m))
                    .ok_or_else(|| ExecError::Internal(format!("W of stage {s} micro-batch {m} before its I")))?;
                stage
                    .interp
                    .eval_nodes(&rank.ctx, stage.weight_half.clone(), values, &mut |id| {
                        Err(ExecError::Internal(format!("{id} is fed in a weight-gradient pass")))
                    })?;
                self.accumulate(stage, state, m)?;
            }
            OpKind::SendF => {
                let t = take_outgoing(state, s, m, false)?;
                rank.p2p
                    .send(self.rank_of_stage[s + 1], tag(s, m, self.microbatches, false), &t)?;
            }
            OpKind::SendB => {
                let t = take_outgoing(state, s, m, true)?;
                rank.p2p
                    .send(self.rank_of_stage[s - 1], tag(s - 1, m, self.microbatches, true), &t)?;
            }
            // Receives complete where their value is read (the forward or backward that
            // consumes them), as torch waits on its posted receives; sends complete in the
            // call; with one rank a stage there is nothing to gather, free or reduce.
            OpKind::RecvF
            | OpKind::RecvB
            | OpKind::WaitSendF
            | OpKind::WaitSendB
            | OpKind::Unshard
            | OpKind::Reshard
            | OpKind::ReduceGrad
            | OpKind::WaitReduceGrad => {}
        }
        Ok(())
    }

    /// What stage `from` made for micro-batch `m` (its activation, or with `gradient` its
    /// input gradient) for the stage beside it on this rank: handed over here when `from`
    /// is this rank's too (a V placement's turn), else received from its rank.
    fn receive(
        &self,
        rank: &Rank,
        state: &mut RankState,
        from: usize,
        m: usize,
        gradient: bool,
    ) -> Result<Tensor, ExecError> {
        let peer = self.rank_of_stage[from];
        if peer == rank.p2p.index() {
            return take_outgoing(state, from, m, gradient);
        }
        let boundary = if gradient { from - 1 } else { from };
        rank.p2p.recv(peer, tag(boundary, m, self.microbatches, gradient))
    }

    /// Adds micro-batch `m`'s parameter gradients of `stage` to the step's sums and drops
    /// its values.
    fn accumulate(&self, stage: &Stage, state: &mut RankState, m: usize) -> Result<(), ExecError> {
        let values = state
            .values
            .remove(&(stage.index, m))
            .ok_or_else(|| ExecError::Internal("gradients of a micro-batch not in flight".into()))?;
        let sums = state
            .grads
            .entry(stage.index)
            .or_insert_with(|| vec![None; stage.master.len()]);
        for (k, node) in stage.graph.joint.param_grads.iter().enumerate() {
            let Some(node) = node else { continue };
            let g = take_value(&values, *node)?.to_dtype(CDType::F32)?;
            sums[k] = Some(match sums[k].take() {
                None => g,
                Some(acc) => (acc + g)?,
            });
        }
        Ok(())
    }

    /// After the program: scale the summed gradients by 1 / M, agree on the global norm and
    /// the loss over the pipeline ranks, clip, and step each stage's optimizer.
    fn finish(&self, rank: &mut Rank, mut state: RankState) -> Result<(f64, f64), ExecError> {
        let scale = 1.0 / self.microbatches as f64;
        let mut grads: Vec<Vec<Tensor>> = Vec::with_capacity(rank.stages.len());
        let mut sq = 0f64;
        for stage in &rank.stages {
            let sums = state.grads.remove(&stage.index).unwrap_or_default();
            let g = stage
                .master
                .iter()
                .enumerate()
                .map(|(k, m)| match sums.get(k).cloned().flatten() {
                    Some(g) => Ok((g * scale)?),
                    None => Ok(m.zeros_like()?),
                })
                .collect::<Result<Vec<_>, ExecError>>()?;
            for t in &g {
                sq += t.sqr()?.sum_all()?.to_dtype(CDType::F64)?.to_scalar::<f64>()?;
            }
            grads.push(g);
        }
        let cpu = Device::Cpu;
        let summed = rank
            .group
            .all_reduce(self.step, &Tensor::new(&[state.loss, sq], &cpu)?, Reduce::Sum)?
            .to_vec1::<f64>()?;
        let (loss, norm) = (summed[0], summed[1].sqrt());
        if !norm.is_finite() {
            return Err(ExecError::Internal(format!(
                "step {}: the gradient norm is not finite (loss {})",
                self.step + 1,
                loss / self.microbatches as f64
            )));
        }
        let clip = self.config.grad_clip.filter(|&c| norm > c).map(|c| c / (norm + 1e-6));
        for (stage, g) in rank.stages.iter_mut().zip(grads) {
            let g = match clip {
                Some(c) => g.iter().map(|t| t * c).collect::<Result<Vec<_>, _>>()?,
                None => g,
            };
            stage.opt.step(&mut stage.master, &g, self.lr)?;
        }
        Ok((loss, norm))
    }
}

/// What a rank holds during a step.
#[derive(Default)]
struct RankState {
    /// Values of the micro-batches in flight, by (stage, micro-batch).
    values: HashMap<(usize, usize), Values>,
    /// Activations and input gradients made and not yet sent, by (stage, micro-batch,
    /// gradient).
    outgoing: HashMap<(usize, usize, bool), Tensor>,
    /// Summed f32 parameter gradients, by stage.
    grads: HashMap<usize, Vec<Option<Tensor>>>,
    /// Losses of the last stage's micro-batches, summed.
    loss: f64,
}

fn take_value(values: &[Option<Tensor>], id: NodeId) -> Result<Tensor, ExecError> {
    values[id.index()]
        .clone()
        .ok_or_else(|| ExecError::Internal(format!("{id} was not computed")))
}

fn take_outgoing(state: &mut RankState, s: usize, m: usize, gradient: bool) -> Result<Tensor, ExecError> {
    state.outgoing.remove(&(s, m, gradient)).ok_or_else(|| {
        ExecError::Internal(format!(
            "stage {s} sends micro-batch {m}'s {} before making it",
            if gradient { "input gradient" } else { "activation" }
        ))
    })
}

/// The value of an input or parameter node of a stage's graph.
fn feed(
    g: &StageGraph,
    params: &[Tensor],
    data: &HashMap<String, Tensor>,
    activation: Option<&Tensor>,
    output_grad: Option<&Tensor>,
    id: NodeId,
) -> Result<Tensor, ExecError> {
    let missing = |what: &str| ExecError::Internal(format!("{id}: no {what} to feed"));
    match &g.joint.graph.node(id).op {
        Op::Param { param } => Ok(params[param.index()].clone()),
        _ if Some(id) == g.input => activation.cloned().ok_or_else(|| missing("activation")),
        _ if Some(id) == g.output_grad => output_grad.cloned().ok_or_else(|| missing("output gradient")),
        Op::Input { name } => data.get(name).cloned().ok_or_else(|| missing(name)),
        op => Err(ExecError::Internal(format!("{id} ({}) is not fed", op.name()))),
    }
}

/// The batch's inputs cut along their first dimension into `m` micro-batches, as torch's
/// schedules split their arguments.
fn split_batch(inputs: &[(String, Tensor)], m: usize) -> Result<Vec<HashMap<String, Tensor>>, ExecError> {
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
