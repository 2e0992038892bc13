//! Entry point of tracing: a validated config and the batch shape in, an IR graph out.

use crate::{gpt2, llama, mlp, ConfigError, ModelConfig};
use shardplan_ir::{DType, Graph, IrError, ModuleKind, NodeId, Op, ScopeId, Shape, TensorType, WeightLayout};
use thiserror::Error;

/// The concrete shape a graph is traced for (a plan is for one shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceOptions {
    /// Sequences per micro-batch on one rank.
    pub batch: u64,
    /// Tokens per sequence; `None` takes [`ModelConfig::default_seq_len`].
    pub seq_len: Option<u64>,
    /// Dtype of parameters and activations in the traced compute (the loss is f32).
    pub dtype: DType,
}

impl Default for TraceOptions {
    fn default() -> Self {
        TraceOptions {
            batch: 1,
            seq_len: None,
            dtype: DType::F32,
        }
    }
}

/// Why a model could not be traced.
#[derive(Debug, Error, PartialEq)]
pub enum TraceError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The batch shape does not fit the model.
    #[error("{message}")]
    Shape {
        /// Parallel-spec field at fault (`batch.seq_len`).
        field: &'static str,
        message: String,
        help: String,
    },
    /// A bug in a builder or an absurd size caught while building.
    #[error(transparent)]
    Ir(#[from] IrError),
}

/// Traces `config` into a forward graph ending in a scalar f32 loss.
pub fn trace(config: &ModelConfig, opts: TraceOptions) -> Result<Graph, TraceError> {
    config.validate()?;
    let seq = opts.seq_len.unwrap_or_else(|| config.default_seq_len());
    if opts.batch == 0 || seq == 0 {
        return Err(TraceError::Shape {
            field: if opts.batch == 0 {
                "batch.per_rank"
            } else {
                "batch.seq_len"
            },
            message: "batch size and sequence length must be at least 1".into(),
            help: "set batch.per_rank and batch.seq_len to positive integers".into(),
        });
    }
    if !opts.dtype.is_float() {
        return Err(TraceError::Shape {
            field: "mixed_precision.param",
            message: format!("models compute in a float dtype, not {}", opts.dtype),
            help: "use f32, bf16 or f16".into(),
        });
    }
    if let Some(max) = config.max_seq_len() {
        if seq > max {
            return Err(TraceError::Shape {
                field: "batch.seq_len",
                message: format!("sequence length {seq} exceeds the model's {max} positions"),
                help: format!("set batch.seq_len to at most {max}"),
            });
        }
    }
    let mut t = Tracer {
        g: Graph::new(config.name()),
        dtype: opts.dtype,
    };
    match config {
        ModelConfig::Llama(c) => llama::build(&mut t, c, opts.batch, seq)?,
        ModelConfig::Gpt2(c) => gpt2::build(&mut t, c, opts.batch, seq)?,
        ModelConfig::Mlp(c) => mlp::build(&mut t, c, opts.batch, seq)?,
    }
    Ok(t.g)
}

/// Small helpers shared by the builders.
pub(crate) struct Tracer {
    pub g: Graph,
    pub dtype: DType,
}

impl Tracer {
    pub fn scope(&mut self, parent: ScopeId, segment: &str, kind: ModuleKind) -> ScopeId {
        self.g.add_scope(parent, segment, kind)
    }

    pub fn param(&mut self, scope: ScopeId, name: &str, dims: &[u64]) -> Result<NodeId, IrError> {
        self.g.add_param(name, TensorType::new(self.dtype, dims), scope)
    }

    pub fn input(&mut self, name: &str, dtype: DType, dims: &[u64]) -> Result<NodeId, IrError> {
        let root = self.g.root();
        self.g.add_input(name, TensorType::new(dtype, dims), root)
    }

    pub fn op(&mut self, scope: ScopeId, op: Op, ins: &[NodeId]) -> Result<NodeId, IrError> {
        self.g.add_node(op, ins, scope)
    }

    /// `x @ w (+ b)`, with the weight named `{prefix}.weight` (and `{prefix}.bias`).
    pub fn linear(
        &mut self,
        scope: ScopeId,
        x: NodeId,
        prefix: &str,
        shape: [u64; 2],
        layout: WeightLayout,
        bias: bool,
    ) -> Result<NodeId, IrError> {
        let w = self.param(scope, &format!("{prefix}.weight"), &shape)?;
        let mut ins = vec![x, w];
        if bias {
            let out = match layout {
                WeightLayout::OutIn => shape[0],
                WeightLayout::InOut => shape[1],
            };
            ins.push(self.param(scope, &format!("{prefix}.bias"), &[out])?);
        }
        self.op(scope, Op::Linear { bias, layout }, &ins)
    }

    pub fn reshape(&mut self, scope: ScopeId, x: NodeId, dims: &[u64]) -> Result<NodeId, IrError> {
        self.op(
            scope,
            Op::Reshape {
                shape: Shape::new(dims),
            },
            &[x],
        )
    }

    /// Flattens logits to `[n, classes]`, casts them to f32 and takes the mean
    /// cross-entropy against the `targets` input; marks the loss as the graph output.
    pub fn loss(&mut self, logits: NodeId, targets: NodeId) -> Result<NodeId, IrError> {
        let root = self.g.root();
        let scope = self.scope(root, "loss", ModuleKind::Loss);
        let ty = self.g.node(logits).ty.clone();
        let classes = ty.shape.last().unwrap_or(1);
        let rows = ty.numel().unwrap_or(0) / classes.max(1);
        let mut flat = self.reshape(scope, logits, &[rows, classes])?;
        if ty.dtype != DType::F32 {
            flat = self.op(scope, Op::Cast { dtype: DType::F32 }, &[flat])?;
        }
        let loss = self.op(scope, Op::CrossEntropy, &[flat, targets])?;
        self.g.add_output(loss);
        Ok(loss)
    }
}
