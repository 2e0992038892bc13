//! One rank's step of a pipeline: its lowered program, op by op, then the optimizer.

use super::shard::Shard;
use crate::comm::p2p::PointToPoint;
use crate::comm::{Collectives, Reduce};
use crate::cpu::fused;
use crate::cpu::kernels::{cdtype, Ctx};
use crate::runtime::interp::Interpreter;
use crate::runtime::optim::OptState;
use crate::ExecError;
use candle_core::{DType as CDType, Device, Tensor};
use shardplan_frontends::ParallelConfig;
use shardplan_ir::{NodeId, Op};
use shardplan_planner::pipeline::{Action, OpKind, StageGraph};
use std::collections::HashMap;
use std::sync::Arc;

/// One stage as a rank runs it.
pub(crate) struct Stage {
    pub(crate) index: usize,
    pub(crate) graph: StageGraph,
    pub(crate) interp: Interpreter,
    pub(crate) input_half: Vec<NodeId>,
    pub(crate) weight_half: Vec<NodeId>,
    /// This rank's f32 chunk of each of the stage's parameters, and their optimizer state.
    pub(crate) chunks: Vec<Shard>,
    pub(crate) opt: OptState,
}

impl Stage {
    /// Stage `index` of graph `g` on shard rank `shard.0` of `shard.1`: its chunks
    /// initialised from `model`, the whole model's graph, as one rank initialises it.
    pub(crate) fn init(
        index: usize,
        g: &StageGraph,
        model: &shardplan_ir::Graph,
        config: &ParallelConfig,
        shard: (usize, usize),
        tensor_rank: u64,
        device: &Device,
    ) -> Result<Stage, ExecError> {
        let chunks = g
            .params
            .iter()
            .map(|&param| Shard::init(model, param, config.seed, shard, tensor_rank, device))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Stage {
            index,
            input_half: g.input_half(),
            weight_half: g.weight_half(),
            interp: Interpreter::new(g.joint.graph.clone(), &[]),
            opt: OptState::new(config.optimizer, chunks.len()),
            chunks,
            graph: g.clone(),
        })
    }
}

/// Each group's next collective tag (a group's members issue its collectives in one
/// order).
#[derive(Default)]
pub(crate) struct Tags {
    shard: u64,
    replicate: u64,
    world: u64,
}

fn next(tag: &mut u64) -> u64 {
    *tag += 1;
    *tag
}

/// One rank: its stages and its ends of the mesh's groups.
pub(crate) struct Rank {
    pub(crate) stages: Vec<Stage>,
    pub(crate) program: Vec<Action>,
    pub(crate) pipeline: usize,
    pub(crate) tensor_rank: usize,
    /// Its data-parallel index (replicate x shard), whose rows of the batch it reads.
    pub(crate) data_rank: usize,
    pub(crate) p2p: Box<dyn PointToPoint>,
    pub(crate) shard: Option<Box<dyn Collectives>>,
    pub(crate) replicate: Option<Box<dyn Collectives>>,
    /// The tensor group its kernels' context runs the tensor-parallel ops on.
    pub(crate) tensor: Option<Arc<dyn Collectives>>,
    pub(crate) world: Box<dyn Collectives>,
    pub(crate) tags: Tags,
    /// The rank's kernels' context (each thread its own).
    pub(crate) ctx: Ctx,
}

/// A micro-batch in flight on one stage: its values, from forward to the last backward.
type Values = Vec<Option<Tensor>>;

/// What a rank holds during a step.
#[derive(Default)]
struct RankState {
    /// Whole parameters of the stages unsharded, by stage.
    unsharded: HashMap<usize, Vec<Tensor>>,
    /// Values of the micro-batches in flight, by (stage, micro-batch).
    values: HashMap<(usize, usize), Values>,
    /// Activations and input gradients made and not yet sent, by (stage, micro-batch,
    /// gradient).
    outgoing: HashMap<(usize, usize, bool), Tensor>,
    /// Whole f32 parameter gradients summed over micro-batches, by stage.
    grads: HashMap<usize, Vec<Option<Tensor>>>,
    /// This rank's chunks of the reduced gradients, by stage.
    reduced: HashMap<usize, Vec<Tensor>>,
    /// Losses of the last stage's micro-batches, summed.
    loss: f64,
}

/// What every rank's step shares.
pub(crate) struct StepRun<'a> {
    pub(crate) rank_of_stage: &'a [usize],
    pub(crate) microbatches: usize,
    /// Micro-batch losses the step's loss averages: M x the data-parallel ranks.
    pub(crate) losses: usize,
    /// Replicas holding each gradient chunk (the norm counts one).
    pub(crate) replicas: f64,
    /// Tensor ranks: a parameter each holds whole counts 1 / tensor on each.
    pub(crate) tensor: f64,
    pub(crate) config: &'a ParallelConfig,
    pub(crate) step: u64,
    pub(crate) lr: f64,
}

/// Tag of the activation crossing boundary `b` (after stage `b`) for micro-batch `m`, or
/// of its gradient.
fn tag(b: usize, m: usize, microbatches: usize, gradient: bool) -> u64 {
    ((b * microbatches + m) * 2 + usize::from(gradient)) as u64
}

impl StepRun<'_> {
    /// One rank's step over its micro-batches `data`: its program, then the optimizer on
    /// its chunks. Returns the step's mean loss and the global gradient norm.
    pub(crate) fn rank_step(&self, rank: &mut Rank, data: &[HashMap<String, Tensor>]) -> Result<(f64, f64), ExecError> {
        let mut state = RankState::default();
        let program = rank.program.clone();
        for action in &program {
            for op in action.ops() {
                let at = rank
                    .stages
                    .iter()
                    .position(|s| s.index == op.stage as usize)
                    .ok_or_else(|| {
                        ExecError::Internal(format!("{action} names a stage rank {} lacks", rank.pipeline))
                    })?;
                self.run_op(rank, at, op.kind, op.microbatch.map(|m| m as usize), data, &mut state)?;
            }
        }
        // What the program left to the end of the step (no REDUCE_GRAD written).
        for at in 0..rank.stages.len() {
            if !state.reduced.contains_key(&rank.stages[at].index) {
                self.reduce(rank, at, &mut state)?;
            }
        }
        let out = self.finish(rank, state)?;
        flush(rank)?;
        Ok(out)
    }

    /// One op of the program on the rank's `at`-th stage, for micro-batch `m` where it
    /// names one.
    fn run_op(
        &self,
        rank: &mut Rank,
        at: usize,
        kind: OpKind,
        m: Option<usize>,
        data: &[HashMap<String, Tensor>],
        state: &mut RankState,
    ) -> Result<(), ExecError> {
        let s = rank.stages[at].index;
        let mb = || m.ok_or_else(|| ExecError::Internal(format!("{} names no micro-batch", kind.name())));
        match kind {
            OpKind::Unshard => self.unshard(rank, at, state)?,
            OpKind::Reshard => {
                state.unsharded.remove(&s);
            }
            OpKind::ReduceGrad => self.reduce(rank, at, state)?,
            OpKind::Forward => {
                self.unshard_if_needed(rank, at, state)?;
                self.forward(rank, at, mb()?, data, state)?;
            }
            OpKind::Backward | OpKind::BackwardInput => {
                self.unshard_if_needed(rank, at, state)?;
                self.backward(rank, at, mb()?, kind == OpKind::Backward, state)?;
            }
            OpKind::BackwardWeight => {
                let stage = &rank.stages[at];
                let m = mb()?;
                let values = state
                    .values
                    .get_mut(&(s, m))
                    .ok_or_else(|| ExecError::Internal(format!("W of stage {s} micro-batch {m} before its I")))?;
                stage
                    .interp
                    .eval_nodes(&rank.ctx, stage.weight_half.clone(), values, &mut |id| {
                        Err(ExecError::Internal(format!("{id} is fed in a weight-gradient pass")))
                    })?;
                accumulate(stage, state, m)?;
            }
            OpKind::SendF => {
                let m = mb()?;
                let t = take_outgoing(state, s, m, false)?;
                rank.p2p
                    .send(self.rank_of_stage[s + 1], tag(s, m, self.microbatches, false), &t)?;
            }
            OpKind::SendB => {
                let m = mb()?;
                let t = take_outgoing(state, s, m, true)?;
                rank.p2p
                    .send(self.rank_of_stage[s - 1], tag(s - 1, m, self.microbatches, true), &t)?;
            }
            // Receives complete where their value is read (the forward or backward that
            // consumes them), as torch waits on its posted receives; sends and the
            // gradient reduction complete in the call.
            OpKind::RecvF | OpKind::RecvB | OpKind::WaitSendF | OpKind::WaitSendB | OpKind::WaitReduceGrad => {}
        }
        Ok(())
    }

    /// Gathers the `at`-th stage's whole parameters (FSDP's unshard).
    fn unshard(&self, rank: &mut Rank, at: usize, state: &mut RankState) -> Result<(), ExecError> {
        let dtype = cdtype(self.config.mixed_precision.param);
        let stage = &rank.stages[at];
        let mut whole = Vec::with_capacity(stage.chunks.len());
        for chunk in &stage.chunks {
            let tag = match rank.shard {
                Some(_) => next(&mut rank.tags.shard),
                None => 0,
            };
            whole.push(chunk.gather(rank.shard.as_deref(), tag, dtype)?);
        }
        state.unsharded.insert(stage.index, whole);
        Ok(())
    }

    fn unshard_if_needed(&self, rank: &mut Rank, at: usize, state: &mut RankState) -> Result<(), ExecError> {
        if state.unsharded.contains_key(&rank.stages[at].index) {
            return Ok(());
        }
        self.unshard(rank, at, state)
    }

    /// Stage `at`'s forward of micro-batch `m`: on the received activation (or the data,
    /// on the first stage); its output waits to be sent, or its loss is summed.
    fn forward(
        &self,
        rank: &mut Rank,
        at: usize,
        m: usize,
        data: &[HashMap<String, Tensor>],
        state: &mut RankState,
    ) -> Result<(), ExecError> {
        let s = rank.stages[at].index;
        let received = match s {
            0 => None,
            _ => Some(self.receive(rank, state, s - 1, m, false)?),
        };
        let stage = &rank.stages[at];
        let g = &stage.graph;
        let params = &state.unsharded[&s];
        let mut values: Values = vec![None; g.joint.graph.node_count()];
        let forward = (0..g.joint.forward_len).map(NodeId::new);
        stage.interp.eval_nodes(&rank.ctx, forward, &mut values, &mut |id| {
            feed(g, params, &data[m], received.as_ref(), None, id)
        })?;
        let out = value(&values, g.output)?;
        if s + 1 == self.rank_of_stage.len() {
            state.loss += f64::from(out.to_dtype(CDType::F32)?.to_scalar::<f32>()?);
        } else {
            state.outgoing.insert((s, m, false), out);
        }
        state.values.insert((s, m), values);
        Ok(())
    }

    /// Stage `at`'s backward of micro-batch `m` (`whole`: B; else its input half, I) on the
    /// gradient the next stage sent; the input gradient waits to be sent.
    fn backward(
        &self,
        rank: &mut Rank,
        at: usize,
        m: usize,
        whole: bool,
        state: &mut RankState,
    ) -> Result<(), ExecError> {
        let s = rank.stages[at].index;
        let grad = match s + 1 == self.rank_of_stage.len() {
            true => None,
            false => Some(self.receive(rank, state, s + 1, m, true)?),
        };
        let stage = &rank.stages[at];
        let g = &stage.graph;
        let params = &state.unsharded[&s];
        let values = state
            .values
            .get_mut(&(s, m))
            .ok_or_else(|| ExecError::Internal(format!("backward of stage {s} micro-batch {m} before its forward")))?;
        let nodes: Vec<NodeId> = match whole {
            true => (g.joint.forward_len..g.joint.graph.node_count())
                .map(NodeId::new)
                .collect(),
            false => stage.input_half.clone(),
        };
        stage.interp.eval_nodes(&rank.ctx, nodes, values, &mut |id| {
            feed(g, params, &HashMap::new(), None, grad.as_ref(), id)
        })?;
        if let Some(dx) = g.input_grad {
            let dx = value(values, dx)?;
            state.outgoing.insert((s, m, true), dx);
        }
        if whole {
            accumulate(stage, state, m)?;
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
        if peer == rank.pipeline {
            return take_outgoing(state, from, m, gradient);
        }
        let boundary = if gradient { from - 1 } else { from };
        rank.p2p.recv(peer, tag(boundary, m, self.microbatches, gradient))
    }

    /// Stage `at`'s gradients summed over the micro-batches, averaged over the
    /// data-parallel ranks into this rank's chunks (FSDP's reduce-scatter, HSDP's
    /// all-reduce); the mean over the micro-batches is taken in `finish`.
    fn reduce(&self, rank: &mut Rank, at: usize, state: &mut RankState) -> Result<(), ExecError> {
        let stage = &rank.stages[at];
        let sums = state.grads.remove(&stage.index).unwrap_or_default();
        let mut reduced = Vec::with_capacity(stage.chunks.len());
        for (k, chunk) in stage.chunks.iter().enumerate() {
            let grad = match sums.get(k).cloned().flatten() {
                Some(g) => g,
                None => chunk.zero_grad()?,
            };
            let shard = match rank.shard.as_deref() {
                Some(g) => Some((g, next(&mut rank.tags.shard))),
                None => None,
            };
            let replicate = match rank.replicate.as_deref() {
                Some(g) => Some((g, next(&mut rank.tags.replicate))),
                None => None,
            };
            reduced.push(chunk.reduce(&grad, shard, replicate)?);
        }
        state.reduced.insert(stage.index, reduced);
        Ok(())
    }

    /// After the program: agree on the global norm and the loss over the world, clip, and
    /// step each stage's optimizer on this rank's chunks.
    fn finish(&self, rank: &mut Rank, mut state: RankState) -> Result<(f64, f64), ExecError> {
        let mut sq = 0f64;
        for stage in &rank.stages {
            let grads = state.reduced.get(&stage.index).map_or(&[][..], |g| g.as_slice());
            for (t, chunk) in grads.iter().zip(&stage.chunks) {
                let weight = if chunk.split.is_some() { 1.0 } else { 1.0 / self.tensor };
                sq += weight * sum_squares(t)?;
            }
        }
        let summed = rank
            .world
            .all_reduce(
                next(&mut rank.tags.world),
                &Tensor::new(&[state.loss, sq], &rank.ctx.device)?,
                Reduce::Sum,
            )?
            .to_vec1::<f64>()?;
        let loss = summed[0] / self.losses as f64;
        // The reduced gradients are sums over the M micro-batches: their mean is 1 / M of
        // them, folded into the norm and the optimizer's gradient scale (no pass of its own).
        let mean = 1.0 / self.microbatches as f64;
        let norm = (summed[1] / self.replicas).sqrt() * mean;
        if !norm.is_finite() {
            return Err(ExecError::Internal(format!(
                "step {}: the gradient norm is not finite (loss {loss})",
                self.step + 1
            )));
        }
        let clip = self
            .config
            .grad_clip
            .filter(|&c| norm > c)
            .map_or(1.0, |c| c / (norm + 1e-6));
        for stage in &mut rank.stages {
            let grads = state
                .reduced
                .remove(&stage.index)
                .ok_or_else(|| ExecError::Internal(format!("stage {}'s gradients were not reduced", stage.index)))?;
            let mut masters: Vec<Tensor> = stage.chunks.iter().map(|c| c.master.clone()).collect();
            stage.opt.step_scaled(&mut masters, &grads, self.lr, mean * clip)?;
            for (c, m) in stage.chunks.iter_mut().zip(masters) {
                c.master = m;
            }
        }
        Ok((loss, norm))
    }
}

/// Adds micro-batch `m`'s parameter gradients of `stage` to the step's sums and drops
/// its values.
fn accumulate(stage: &Stage, state: &mut RankState, m: usize) -> Result<(), ExecError> {
    let values = state
        .values
        .remove(&(stage.index, m))
        .ok_or_else(|| ExecError::Internal("gradients of a micro-batch not in flight".into()))?;
    let sums = state
        .grads
        .entry(stage.index)
        .or_insert_with(|| vec![None; stage.chunks.len()]);
    for (k, node) in stage.graph.joint.param_grads.iter().enumerate() {
        let Some(node) = node else { continue };
        let g = value(&values, *node)?.to_dtype(CDType::F32)?;
        sums[k] = Some(match sums[k].take() {
            None => g,
            Some(acc) => (acc + g)?,
        });
    }
    Ok(())
}

/// Waits for the rank's collectives that were only enqueued (NCCL's): the step's end,
/// where their failures surface. Blocking backends have none.
fn flush(rank: &Rank) -> Result<(), ExecError> {
    let groups = [
        rank.shard.as_deref(),
        rank.replicate.as_deref(),
        rank.tensor.as_deref(),
        Some(&*rank.world),
    ];
    for g in groups.into_iter().flatten().filter(|g| g.enqueues()) {
        g.flush()?;
    }
    Ok(())
}

/// The sum of `t`'s squared elements in f64: one pass of the fused kernel over an f32 CPU
/// tensor.
fn sum_squares(t: &Tensor) -> Result<f64, ExecError> {
    if fused::applies(&[t]) {
        return fused::sum_squares(t);
    }
    Ok(t.sqr()?.sum_all()?.to_dtype(CDType::F64)?.to_scalar::<f64>()?)
}

fn value(values: &[Option<Tensor>], id: NodeId) -> Result<Tensor, ExecError> {
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
