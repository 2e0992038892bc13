//! Single-rank training on the reference interpreter: the ground truth sharded runs are
//! compared with.

use crate::cpu::kernels::{cdtype, Ctx};
use crate::init::init_elements;
use crate::runtime::interp::{all_finite, Interpreter};
use crate::runtime::optim::{base_lr, lr_at, OptState};
use crate::train::data::{DataSource, SyntheticFeatures, SyntheticTokens, TokenFile};
use crate::ExecError;
use candle_core::{DType as CDType, Device, Tensor};
use serde::Serialize;
use shardplan_frontends::{DataSource as DataSpec, ParallelConfig};
use shardplan_ir::{differentiate, DType, JointGraph, NodeId, Op};
use shardplan_models::{trace, ModelConfig};
use std::collections::HashMap;
use std::time::Instant;

/// What one optimizer step did, as written to the metrics log.
#[derive(Clone, Debug, Serialize)]
pub struct StepMetrics {
    /// 1-based step number.
    pub step: u64,
    /// Mean loss over the step's micro-batches.
    pub loss: f32,
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    pub tokens: u64,
    pub step_seconds: f64,
    pub tokens_per_second: f64,
    /// Largest number of bytes the interpreter's value table held during the step
    /// (activations, gradients and the parameter copies it was fed).
    pub peak_value_bytes: u64,
    /// Bytes of f32 master weights and of optimizer state.
    pub master_bytes: u64,
    pub optimizer_bytes: u64,
}

/// A model, its joint graph and everything a single-rank training run holds.
pub struct Trainer {
    interp: Interpreter,
    joint: JointGraph,
    ctx: Ctx,
    /// f32 master weights, by parameter id.
    master: Vec<Tensor>,
    opt: OptState,
    data: Box<dyn DataSource>,
    config: ParallelConfig,
    param_dtype: DType,
    /// Input nodes by name (`tokens`, `targets`, `features`).
    inputs: HashMap<String, NodeId>,
    keep: Vec<NodeId>,
    total_steps: u64,
    step: u64,
}

impl Trainer {
    /// Traces, differentiates and initialises `model` for `total_steps` steps on `device`.
    pub fn new(
        model: &ModelConfig,
        config: &ParallelConfig,
        total_steps: u64,
        device: Device,
    ) -> Result<Self, ExecError> {
        let world = config.mesh.world();
        if world != 1 {
            return Err(ExecError::Unsupported(format!(
                "the mesh has {world} ranks (replicate {} x shard {}); training runs on one rank until the sharded executor lands: use mesh {{replicate: 1, shard: 1}}",
                config.mesh.replicate, config.mesh.shard
            )));
        }
        let graph = trace(model, config.trace_options())?;
        let joint = differentiate(&graph).map_err(|e| ExecError::Internal(e.to_string()))?;
        let mut keep = vec![joint.loss];
        for (p, param) in joint.graph.params() {
            keep.push(
                joint
                    .grad(p)
                    .ok_or_else(|| ExecError::Internal(format!("no gradient for {}", param.name)))?,
            );
        }
        let master = joint
            .graph
            .params()
            .map(|(p, param)| {
                let n = param.ty.numel().unwrap_or(0);
                let dims: Vec<usize> = param.ty.shape.dims().iter().map(|&d| d as usize).collect();
                Tensor::from_vec(
                    init_elements(&joint.graph, p, config.seed, 0..n),
                    dims.as_slice(),
                    &device,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let inputs: HashMap<String, NodeId> = joint
            .graph
            .inputs()
            .iter()
            .filter_map(|&id| match &joint.graph.node(id).op {
                Op::Input { name } => Some((name.clone(), id)),
                _ => None,
            })
            .collect();
        let first = joint.graph.node(joint.graph.inputs()[0]).ty.shape.dims().to_vec();
        let (batch, seq) = (first[0] as usize, first[1] as usize);
        let data = data_source(model, config, batch, seq)?;
        let n_params = master.len();
        Ok(Trainer {
            interp: Interpreter::new(joint.graph.clone(), &keep),
            joint,
            ctx: Ctx::new(device),
            master,
            opt: OptState::new(config.optimizer, n_params),
            data,
            param_dtype: config.mixed_precision.param,
            config: config.clone(),
            inputs,
            keep,
            total_steps,
            step: 0,
        })
    }

    /// Steps taken so far.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// The f32 master weights, by parameter id.
    pub fn master(&self) -> &[Tensor] {
        &self.master
    }

    /// The parameters in the compute dtype (a cheap clone when that is f32 already).
    fn cast_params(&self) -> Result<Vec<Tensor>, ExecError> {
        let dt = cdtype(self.param_dtype);
        Ok(self.master.iter().map(|m| m.to_dtype(dt)).collect::<Result<_, _>>()?)
    }

    fn feed(&self, params: &[Tensor], batch: &HashMap<String, Tensor>, id: NodeId) -> Result<Tensor, ExecError> {
        match &self.joint.graph.node(id).op {
            Op::Param { param } => Ok(params[param.index()].clone()),
            Op::Input { name } => batch
                .get(name)
                .cloned()
                .ok_or_else(|| ExecError::Internal(format!("no data for input `{name}`"))),
            op => Err(ExecError::Internal(format!("{id} ({}) is not fed", op.name()))),
        }
    }

    /// `(loss, f32 grads, tokens, peak bytes)` of one micro-batch.
    fn micro_batch(&mut self, params: &[Tensor]) -> Result<(f32, Vec<Tensor>, u64, u64), ExecError> {
        let b = self.data.next_batch(&self.ctx.device)?;
        let batch: HashMap<String, Tensor> = b.inputs.into_iter().collect();
        for name in batch.keys() {
            if !self.inputs.contains_key(name) {
                return Err(ExecError::Internal(format!(
                    "data has `{name}`, the graph has no such input"
                )));
            }
        }
        let keep = self.keep.clone();
        let out = {
            let this = &*self;
            this.interp
                .run(&this.ctx, &keep, &mut |id| this.feed(params, &batch, id))?
        };
        let loss = out.kept[0].to_dtype(CDType::F32)?.to_scalar::<f32>()?;
        if !loss.is_finite() {
            return Err(self.locate_non_finite(loss, params, &batch));
        }
        let grads = out.kept[1..]
            .iter()
            .map(|g| g.to_dtype(CDType::F32))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((loss, grads, b.tokens, out.peak_bytes))
    }

    /// The error for a non-finite loss, naming the module where the first non-finite value
    /// of the forward pass appears.
    fn locate_non_finite(&self, loss: f32, params: &[Tensor], batch: &HashMap<String, Tensor>) -> ExecError {
        let g = &self.joint.graph;
        let found = self
            .interp
            .first_non_finite(&self.ctx, self.joint.forward_len, &mut |id| {
                self.feed(params, batch, id)
            });
        let (module, node, op) = match found {
            Ok(Some(id)) => (
                g.scope(g.node(id).scope).display_path().to_string(),
                id.to_string(),
                g.node(id).op.name().to_string(),
            ),
            Ok(None) => ("<backward pass>".into(), "-".into(), "-".into()),
            Err(e) => (format!("<unknown: {e}>"), "-".into(), "-".into()),
        };
        ExecError::NonFinite {
            step: self.step + 1,
            loss,
            module,
            node,
            op,
        }
    }

    /// One optimizer step over `grad_accum` micro-batches.
    pub fn step(&mut self) -> Result<StepMetrics, ExecError> {
        let start = Instant::now();
        let params = self.cast_params()?;
        let accum = self.config.batch.grad_accum;
        let (mut loss_sum, mut tokens, mut peak) = (0f64, 0u64, 0u64);
        let mut sum: Option<Vec<Tensor>> = None;
        for _ in 0..accum {
            let (loss, grads, t, p) = self.micro_batch(&params)?;
            loss_sum += f64::from(loss);
            tokens += t;
            peak = peak.max(p);
            sum = Some(match sum {
                None => grads,
                Some(acc) => acc
                    .iter()
                    .zip(&grads)
                    .map(|(a, g)| a + g)
                    .collect::<Result<Vec<_>, _>>()?,
            });
        }
        let mut grads = sum.ok_or_else(|| ExecError::Internal("grad_accum is 0".into()))?;
        if accum > 1 {
            grads = grads
                .iter()
                .map(|g| g * (1.0 / accum as f64))
                .collect::<Result<Vec<_>, _>>()?;
        }
        let mut sq = 0f64;
        for g in &grads {
            sq += if crate::cpu::fused::applies(&[g]) {
                crate::cpu::fused::sum_squares(g)?
            } else {
                g.sqr()?.sum_all()?.to_dtype(CDType::F64)?.to_scalar::<f64>()?
            };
        }
        let grad_norm = sq.sqrt();
        if !grad_norm.is_finite() {
            let bad = grads.iter().position(|g| !all_finite(g).unwrap_or(false)).unwrap_or(0);
            let g = &self.joint.graph;
            let param = g.params().nth(bad).map(|(_, p)| p);
            return Err(ExecError::NonFinite {
                step: self.step + 1,
                loss: (loss_sum / accum as f64) as f32,
                module: param.map_or_else(|| "<unknown>".into(), |p| g.scope(p.scope).display_path().to_string()),
                node: param.map_or_else(|| "-".into(), |p| format!("gradient of {}", p.name)),
                op: "backward".into(),
            });
        }
        if let Some(clip) = self.config.grad_clip {
            if grad_norm > clip {
                let scale = clip / (grad_norm + 1e-6);
                grads = grads.iter().map(|g| g * scale).collect::<Result<Vec<_>, _>>()?;
            }
        }
        let lr = lr_at(
            self.step,
            self.total_steps,
            base_lr(&self.config.optimizer),
            &self.config.lr_schedule,
        );
        self.opt.step(&mut self.master, &grads, lr)?;
        self.step += 1;
        let secs = start.elapsed().as_secs_f64();
        Ok(StepMetrics {
            step: self.step,
            loss: (loss_sum / accum as f64) as f32,
            lr,
            grad_norm: grad_norm as f32,
            tokens,
            step_seconds: secs,
            tokens_per_second: tokens as f64 / secs.max(1e-9),
            peak_value_bytes: peak,
            master_bytes: self.master.iter().map(|m| (m.elem_count() * 4) as u64).sum(),
            optimizer_bytes: self.opt.bytes(),
        })
    }
}

/// The data source of `config` for `model`, yielding batches of `batch` sequences of `seq`.
pub fn data_source(
    model: &ModelConfig,
    config: &ParallelConfig,
    batch: usize,
    seq: usize,
) -> Result<Box<dyn DataSource>, ExecError> {
    Ok(match (&config.data, model) {
        (DataSpec::Synthetic, ModelConfig::Mlp(m)) => Box::new(SyntheticFeatures::new(
            m.dim as usize,
            m.n_classes as usize,
            batch,
            seq,
            config.seed,
        )),
        (DataSpec::Synthetic, ModelConfig::Llama(c)) => {
            Box::new(SyntheticTokens::new(c.vocab_size, batch, seq, config.seed))
        }
        (DataSpec::Synthetic, ModelConfig::Gpt2(c)) => {
            Box::new(SyntheticTokens::new(c.vocab_size, batch, seq, config.seed))
        }
        (DataSpec::Tokens { .. }, ModelConfig::Mlp(_)) => {
            return Err(ExecError::Unsupported(
                "token files feed language models; the mlp family trains on `data: synthetic`".into(),
            ))
        }
        (DataSpec::Tokens { path, dtype, .. }, ModelConfig::Llama(c)) => {
            Box::new(TokenFile::open(path, *dtype, c.vocab_size, batch, seq, config.seed)?)
        }
        (DataSpec::Tokens { path, dtype, .. }, ModelConfig::Gpt2(c)) => {
            Box::new(TokenFile::open(path, *dtype, c.vocab_size, batch, seq, config.seed)?)
        }
    })
}
