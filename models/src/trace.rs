//! Entry point of tracing: a validated config and the batch shape in, an IR graph out.

use crate::tracer::{ContextOptions, ExpertOptions, TensorOptions, Tracer};
use crate::{gpt2, llama, mlp, ConfigError, Float8Options, ModelConfig};
use shardplan_ir::{ContextBalance, DType, Graph, IrError};
use thiserror::Error;

/// The concrete shape a graph is traced for (a plan is for one shape).
#[derive(Clone, Debug, PartialEq)]
pub struct TraceOptions {
    /// Sequences per micro-batch on one rank.
    pub batch: u64,
    /// Tokens per sequence; `None` takes [`ModelConfig::default_seq_len`].
    pub seq_len: Option<u64>,
    /// Dtype of parameters and activations in the traced compute (the loss is f32).
    pub dtype: DType,
    /// Tensor parallelism: with `degree > 1` the graph is one tensor rank's program.
    pub tensor: TensorOptions,
    /// Expert parallelism: with `degree > 1` the graph is one expert rank's program.
    pub expert: ExpertOptions,
    /// Context parallelism: with `degree > 1` the graph is one context rank's program,
    /// `seq_len / degree` rows of each sequence.
    pub context: ContextOptions,
    /// Float8 linears (torchao's `convert_to_float8_training`), chosen after tracing.
    pub float8: Option<Float8Options>,
}

impl Default for TraceOptions {
    fn default() -> Self {
        TraceOptions {
            batch: 1,
            seq_len: None,
            dtype: DType::F32,
            tensor: TensorOptions::default(),
            expert: ExpertOptions::default(),
            context: ContextOptions::default(),
            float8: None,
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
    check_context(config, &opts, seq)?;
    let local = opts.context.local_seq(seq);
    check_tensor(config, &opts.tensor, local)?;
    check_expert(config, &opts.expert)?;
    let mut t = Tracer {
        g: Graph::new(config.name()),
        dtype: opts.dtype,
        tp: opts.tensor,
        ep: opts.expert,
        cp: opts.context,
        aux_loss: None,
    };
    t.g.set_tensor_degree(opts.tensor.degree);
    match config {
        ModelConfig::Llama(c) => llama::build(&mut t, c, opts.batch, local)?,
        ModelConfig::Gpt2(c) => gpt2::build(&mut t, c, opts.batch, local)?,
        ModelConfig::Mlp(c) => mlp::build(&mut t, c, opts.batch, local)?,
    }
    let mut g = t.g;
    g.set_expert_overlap(opts.expert.overlap);
    if let Some(f8) = &opts.float8 {
        crate::float8::convert(&mut g, f8)?;
    }
    Ok(g)
}

/// What a context-parallel degree needs: a Llama-family model without routed experts
/// (rotary positions, which each rank takes at its rows' places), and a sequence that cuts
/// into the layout's chunks, each split again over the tensor group.
fn check_context(config: &ModelConfig, opts: &TraceOptions, seq: u64) -> Result<(), TraceError> {
    let cp = &opts.context;
    if !cp.is_parallel() {
        return Ok(());
    }
    let c = cp.degree;
    let shape = |field: &'static str, message: String, help: String| TraceError::Shape { field, message, help };
    match config {
        ModelConfig::Llama(l) if l.moe.is_none() => {}
        ModelConfig::Llama(_) => {
            return Err(shape(
                "mesh.context",
                format!("context parallelism over {c} ranks is not supported for mixture-of-experts models yet"),
                "set mesh.context to 1 (or leave it out) for this model".into(),
            ))
        }
        _ => {
            return Err(shape(
                "mesh.context",
                format!(
                    "context parallelism needs rotary positions; {} is not a Llama-family model",
                    config.name()
                ),
                "set mesh.context to 1 (or leave it out), or use a Llama, Mistral or Qwen model".into(),
            ))
        }
    }
    let t = opts.tensor.degree.max(1);
    let chunks = cp.balance.chunks(c);
    let unit = chunks * t;
    if !seq.is_multiple_of(unit) {
        let how = match cp.balance {
            ContextBalance::HeadTail => format!("2 x context {c}"),
            ContextBalance::None => format!("context {c}"),
        };
        let how = if t > 1 { format!("{how} x tensor {t}") } else { how };
        return Err(shape(
            "batch.seq_len",
            format!("sequence length {seq} does not divide by {how} = {unit}"),
            format!(
                "set batch.seq_len to a multiple of {unit} (for example {})",
                (seq / unit).max(1) * unit
            ),
        ));
    }
    Ok(())
}

/// What an expert-parallel degree needs of the model (routed experts, as many on every
/// expert rank), and token dropping (routed experts, a positive factor).
fn check_expert(config: &ModelConfig, ep: &ExpertOptions) -> Result<(), TraceError> {
    check_expert_degree(config, ep)?;
    let Some(f) = ep.capacity_factor else {
        return Ok(());
    };
    let field = "moe.capacity_factor";
    if !matches!(config, ModelConfig::Llama(c) if c.moe.is_some()) {
        return Err(TraceError::Shape {
            field,
            message: format!(
                "token dropping needs a model with routed experts; {} has none",
                config.name()
            ),
            help: "remove moe.capacity_factor, or give the model a `moe` section".into(),
        });
    }
    if !(f.is_finite() && f > 0.0) {
        return Err(TraceError::Shape {
            field,
            message: format!("capacity factor {f} keeps no tokens"),
            help: "set moe.capacity_factor above 0 (GShard trains at 2.0, Switch at 1.25; 1.0 is each expert's even share)".into(),
        });
    }
    Ok(())
}

fn check_expert_degree(config: &ModelConfig, ep: &ExpertOptions) -> Result<(), TraceError> {
    let e = ep.degree;
    if e <= 1 {
        return Ok(());
    }
    let shape = |message: String, help: String| TraceError::Shape {
        field: "mesh.expert",
        message,
        help,
    };
    let experts = match config {
        ModelConfig::Llama(c) => c.moe.as_ref().map(|m| m.experts),
        _ => None,
    };
    let Some(experts) = experts else {
        return Err(shape(
            format!(
                "an expert group of {e} ranks needs a model with routed experts; {} has none",
                config.name()
            ),
            "set mesh.expert to 1 (or leave it out), or give the model a `moe` section".into(),
        ));
    };
    if !experts.is_multiple_of(e) {
        return Err(shape(
            format!("the model's {experts} routed experts do not split evenly over {e} expert ranks"),
            format!("set mesh.expert to a divisor of {experts}"),
        ));
    }
    if !(ep.capacity.is_finite() && ep.capacity >= 1.0) {
        return Err(TraceError::Shape {
            field: "moe.capacity",
            message: format!("capacity {} is below the even split (1.0)", ep.capacity),
            help: "set moe.capacity to at least 1.0: the factor over the rows an even routing sends each expert rank"
                .into(),
        });
    }
    Ok(())
}

/// What a tensor-parallel degree needs of the model: every split dimension divisible.
fn check_tensor(config: &ModelConfig, tp: &TensorOptions, seq: u64) -> Result<(), TraceError> {
    let t = tp.degree;
    if t <= 1 {
        return Ok(());
    }
    let shape = |field: &'static str, message: String, help: String| TraceError::Shape { field, message, help };
    let (heads, kv_heads, ffn, vocab) = match config {
        ModelConfig::Llama(c) => {
            if let Some(m) = &c.moe {
                // The experts split as the dense feed-forward does.
                let mut widths = vec![("expert_ffn_dim", "moe.expert_ffn_dim", m.expert_ffn_dim)];
                if m.shared_experts > 0 {
                    widths.push(("shared expert width", "moe.shared_experts", m.shared_expert_ffn_dim));
                }
                for (what, field, w) in widths {
                    if !w.is_multiple_of(t) {
                        return Err(shape(
                            "mesh.tensor",
                            format!("the model's {what} of {w} does not split over {t} tensor ranks (`{field}`)"),
                            format!("set mesh.tensor to a divisor of {w}: each tensor rank holds a slice of every expert, as of the dense feed-forward"),
                        ));
                    }
                }
            }
            // A model whose every layer has experts has no dense feed-forward to split.
            let dense = (0..c.n_layers).any(|i| c.moe.as_ref().is_none_or(|m| !m.is_moe_layer(i)));
            let ffn = if dense { c.ffn_dim } else { t };
            (c.n_heads, c.n_kv_heads, ffn, c.vocab_size)
        }
        ModelConfig::Gpt2(c) => (c.n_heads, c.n_heads, c.ffn_dim, c.vocab_size),
        ModelConfig::Mlp(_) => {
            return Err(shape(
                "mesh.tensor",
                "the mlp family has no tensor-parallel plan".into(),
                "set mesh.tensor to 1 (or leave it out) for mlp models".into(),
            ))
        }
    };
    for (what, n) in [
        ("attention heads", heads),
        ("key/value heads", kv_heads),
        ("feed-forward width", ffn),
    ] {
        if !n.is_multiple_of(t) {
            return Err(shape(
                "mesh.tensor",
                format!("the model's {n} {what} do not split over {t} tensor ranks"),
                format!("set mesh.tensor to a divisor of {n} (heads {heads}, key/value heads {kv_heads}, feed-forward {ffn})"),
            ));
        }
    }
    if tp.loss_parallel && !vocab.is_multiple_of(t) {
        return Err(shape(
            "tensor_parallel.loss_parallel",
            format!("the vocabulary of {vocab} does not split over {t} tensor ranks, which loss parallelism needs"),
            format!("pad vocab_size to a multiple of {t}, or set tensor_parallel.loss_parallel: false (the embedding and output then stay whole on every tensor rank)"),
        ));
    }
    if tp.sequence_parallel && !seq.is_multiple_of(t) {
        return Err(shape(
            "batch.seq_len",
            format!(
                "sequence parallelism splits the {seq} positions over {t} tensor ranks, which does not divide them"
            ),
            format!("set batch.seq_len to a multiple of {t}, or tensor_parallel.sequence_parallel: false"),
        ));
    }
    Ok(())
}
