//! Validated model configurations: what the builders trace. Frontends convert specs into
//! these; presets build them directly. [`ModelConfig::validate`] is the one validation.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Most layers a model may have: far beyond any real model, small enough to trace.
pub const MAX_LAYERS: u64 = 10_000;

/// A configuration value that cannot describe a model.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("`{field}`: {message}")]
pub struct ConfigError {
    /// The spec field at fault (model spec names: `n_kv_heads`).
    pub field: &'static str,
    pub message: String,
    /// How to fix it.
    pub help: String,
}

impl ConfigError {
    fn new(field: &'static str, message: impl Into<String>, help: impl Into<String>) -> Self {
        ConfigError {
            field,
            message: message.into(),
            help: help.into(),
        }
    }
}

/// The Llama family: Llama 1/2/3, Mistral and Qwen2 differ only in these numbers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    pub name: String,
    pub vocab_size: u64,
    pub dim: u64,
    pub n_layers: u64,
    pub n_heads: u64,
    pub n_kv_heads: u64,
    /// Per-head width; `None` means `dim / n_heads`.
    pub head_dim: Option<u64>,
    pub ffn_dim: u64,
    pub norm_eps: f64,
    pub rope_theta: f64,
    /// RoPE frequency scaling (Llama 3.1's `llama3`, `linear`).
    #[serde(default)]
    pub rope_scaling: shardplan_ir::RopeScaling,
    /// The MLP's gate activation (`None`: silu, SwiGLU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation: Option<Activation>,
    pub tie_embeddings: bool,
    /// Bias on q/k/v projections (Qwen2).
    pub qkv_bias: bool,
    /// RMSNorm over each head's queries and keys, before rotary (Qwen3's `q_norm` and
    /// `k_norm`, weights of `head_dim`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qk_norm: bool,
    pub max_seq_len: u64,
    /// Mixture-of-experts feed-forward on some layers (Mixtral, Qwen2-MoE, Qwen3-MoE);
    /// `None`: every layer has the dense SwiGLU MLP of `ffn_dim`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
}

/// How a router turns its logits into expert scores before the top-k choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Router {
    /// Softmax over the experts, then the `top_k` largest (Mixtral, Qwen2-MoE, Qwen3-MoE).
    SoftmaxTopk,
    /// A sigmoid per expert, then the `top_k` largest (DeepSeek-V3's scoring).
    SigmoidTopk,
}

/// Which Hugging Face module names an MoE layer's parameters take.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MoeNames {
    /// Qwen2-MoE / Qwen3-MoE: `mlp.gate`, `mlp.experts.E.{gate,up,down}_proj`,
    /// `mlp.shared_expert.*`, `mlp.shared_expert_gate`.
    #[default]
    Qwen,
    /// Mixtral: `block_sparse_moe.gate`, `block_sparse_moe.experts.E.{w1,w3,w2}`.
    Mixtral,
}

impl MoeNames {
    pub fn name(self) -> &'static str {
        match self {
            MoeNames::Qwen => "qwen",
            MoeNames::Mixtral => "mixtral",
        }
    }
}

impl Router {
    pub fn name(self) -> &'static str {
        match self {
            Router::SoftmaxTopk => "softmax_topk",
            Router::SigmoidTopk => "sigmoid_topk",
        }
    }
}

/// A mixture-of-experts feed-forward: each token's router picks `top_k` of `experts`
/// SwiGLU experts of width `expert_ffn_dim` and sums their outputs weighted by its scores;
/// `shared_experts` more (of `shared_expert_ffn_dim` together) see every token.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Routed experts per MoE layer.
    pub experts: u64,
    /// Experts each token is sent to.
    pub top_k: u64,
    /// Hidden width of one routed expert.
    pub expert_ffn_dim: u64,
    /// Shared experts every token passes through (0: none). They are traced as one
    /// SwiGLU MLP of `shared_expert_ffn_dim`, as Hugging Face's Qwen2-MoE holds them.
    pub shared_experts: u64,
    /// Hidden width of the shared experts together (0 without them).
    pub shared_expert_ffn_dim: u64,
    /// The shared experts' output is scaled per token by `sigmoid(x . w)` (Qwen2-MoE's
    /// `shared_expert_gate`).
    pub shared_expert_gate: bool,
    pub router: Router,
    /// The chosen experts' scores are divided by their sum (Mixtral always; Qwen3-MoE's
    /// `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Weight of the load-balancing loss (Switch / Hugging Face's `router_aux_loss_coef`)
    /// added to the cross-entropy; 0: none.
    pub aux_loss_coef: f64,
    /// Every `every`-th layer is an MoE layer (Hugging Face's `decoder_sparse_step`):
    /// layer `i` (from 0) when `(i + 1) % every == 0`.
    pub every: u64,
    /// The first `first_dense` layers keep the dense MLP of `ffn_dim` (DeepSeek's
    /// `first_k_dense_replace`; Qwen's `mlp_only_layers` when they lead).
    pub first_dense: u64,
    /// Layers that keep the dense MLP wherever they sit (Qwen's `mlp_only_layers` that do
    /// not lead), besides the first `first_dense`.
    #[serde(default, skip_serializing_if = "LayerSet::is_empty")]
    pub dense_layers: LayerSet,
    /// The parameters' Hugging Face names (Qwen's or Mixtral's modules).
    #[serde(default)]
    pub hf_names: MoeNames,
}

/// A set of layer indices below [`LayerSet::MAX`], kept as bits so the config stays
/// `Copy`; written as the list of its indices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "Vec<u64>", try_from = "Vec<u64>")]
pub struct LayerSet([u64; 4]);

impl LayerSet {
    /// Layers a set can hold: 0 to 255.
    pub const MAX: u64 = 256;

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|&w| w == 0)
    }

    pub fn contains(&self, i: u64) -> bool {
        i < Self::MAX && self.0[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    /// Its layers, ascending.
    pub fn layers(&self) -> Vec<u64> {
        (0..Self::MAX).filter(|&i| self.contains(i)).collect()
    }
}

impl From<LayerSet> for Vec<u64> {
    fn from(s: LayerSet) -> Vec<u64> {
        s.layers()
    }
}

impl TryFrom<Vec<u64>> for LayerSet {
    type Error = String;

    fn try_from(layers: Vec<u64>) -> Result<LayerSet, String> {
        let mut s = LayerSet::default();
        for i in layers {
            if i >= Self::MAX {
                return Err(format!("layer {i}: at most {} layers are listed", Self::MAX));
            }
            s.0[(i / 64) as usize] |= 1 << (i % 64);
        }
        Ok(s)
    }
}

impl MoeConfig {
    /// Whether layer `i` (from 0) has the MoE feed-forward.
    pub fn is_moe_layer(&self, i: u64) -> bool {
        i >= self.first_dense && self.every > 0 && (i + 1).is_multiple_of(self.every) && !self.dense_layers.contains(i)
    }

    /// How many of `n_layers` layers have experts: the `i + 1` in `first_dense + 1..=n_layers`
    /// that `every` divides, but for `dense_layers`.
    pub fn layers_of(&self, n_layers: u64) -> u64 {
        if self.every == 0 || self.first_dense >= n_layers {
            return 0;
        }
        let layers = self.dense_layers.layers();
        let listed = layers.iter().filter(|&&i| i < n_layers && self.is_moe_layer_by_rule(i));
        n_layers / self.every - self.first_dense / self.every - listed.count() as u64
    }

    /// Whether `first_dense` and `every` alone give layer `i` experts.
    fn is_moe_layer_by_rule(&self, i: u64) -> bool {
        i >= self.first_dense && self.every > 0 && (i + 1).is_multiple_of(self.every)
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl LlamaConfig {
    pub fn head_dim(&self) -> u64 {
        self.head_dim.unwrap_or(self.dim / self.n_heads.max(1))
    }

    /// Layers with the MoE feed-forward.
    pub fn moe_layers(&self) -> u64 {
        self.moe.as_ref().map_or(0, |m| m.layers_of(self.n_layers))
    }

    /// Parameters of one layer: `(total, active per token)`, or `None` on overflow. The
    /// active count takes `top_k` routed experts and every shared one.
    fn layer_params(&self, moe_layer: bool) -> Option<(u64, u64)> {
        let hd = self.head_dim();
        let (q, kv) = (self.n_heads.checked_mul(hd)?, self.n_kv_heads.checked_mul(hd)?);
        let bias = if self.qkv_bias {
            checked_sum(&[&[q], &[kv], &[kv]])?
        } else {
            0
        };
        let qk_norm = if self.qk_norm { hd.checked_mul(2)? } else { 0 };
        let attn = checked_sum(&[
            &[self.dim, q],
            &[self.dim, kv],
            &[self.dim, kv],
            &[q, self.dim],
            &[2, self.dim],
            &[bias],
            &[qk_norm],
        ])?;
        let m = match (&self.moe, moe_layer) {
            (Some(m), true) => m,
            _ => {
                let n = checked_sum(&[&[attn], &[3, self.dim, self.ffn_dim]])?;
                return Some((n, n));
            }
        };
        let expert = checked_sum(&[&[3, self.dim, m.expert_ffn_dim]])?;
        let shared = checked_sum(&[
            &[3, self.dim, m.shared_expert_ffn_dim],
            &[if m.shared_expert_gate { self.dim } else { 0 }],
        ])?;
        let router = self.dim.checked_mul(m.experts)?;
        let total = checked_sum(&[&[attn], &[router], &[shared], &[m.experts, expert]])?;
        let active = checked_sum(&[&[attn], &[router], &[shared], &[m.top_k, expert]])?;
        Some((total, active))
    }

    /// `(total, active per token)` parameters, or `None` on overflow.
    pub fn param_counts(&self) -> Option<(u64, u64)> {
        let moe = self.moe_layers();
        let dense = self.n_layers - moe;
        let (dt, da) = self.layer_params(false)?;
        let (mt, ma) = if moe > 0 { self.layer_params(true)? } else { (0, 0) };
        let head = if self.tie_embeddings { 0 } else { 1 };
        let rest = checked_sum(&[&[1 + head, self.vocab_size, self.dim], &[self.dim]])?;
        Some((
            checked_sum(&[&[dt, dense], &[mt, moe], &[rest]])?,
            checked_sum(&[&[da, dense], &[ma, moe], &[rest]])?,
        ))
    }
}

/// GPT-2: learned positions, layer norm, gelu, biases everywhere, tied output head.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gpt2Config {
    pub name: String,
    pub vocab_size: u64,
    pub dim: u64,
    pub n_layers: u64,
    pub n_heads: u64,
    pub ffn_dim: u64,
    /// Length of the learned position table; also the longest sequence.
    pub max_seq_len: u64,
    pub norm_eps: f64,
    /// The MLP's activation (`None`: gelu, tanh approximation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation: Option<Activation>,
}

/// An MLP activation, as Hugging Face configs name them (`hidden_act`,
/// `activation_function`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    Silu,
    /// Exact gelu (`gelu`).
    Gelu,
    /// The tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    Relu,
}

impl Activation {
    /// The activation a Hugging Face config names, if shardplan implements it.
    pub fn from_hf(name: &str) -> Option<Activation> {
        Some(match name {
            "silu" | "swish" => Activation::Silu,
            "gelu" => Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluTanh,
            "relu" => Activation::Relu,
            _ => return None,
        })
    }

    /// The IR op that computes it.
    pub fn op(self) -> shardplan_ir::Op {
        match self {
            Activation::Silu => shardplan_ir::Op::Silu,
            Activation::Gelu => shardplan_ir::Op::GeluErf,
            Activation::GeluTanh => shardplan_ir::Op::Gelu,
            Activation::Relu => shardplan_ir::Op::Relu,
        }
    }
}

/// A small residual MLP classifier over feature vectors, for tests and demos.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MlpConfig {
    pub name: String,
    /// Width of the input features and of the residual stream.
    pub dim: u64,
    pub ffn_dim: u64,
    pub n_layers: u64,
    pub n_classes: u64,
}

/// Any model shardplan can trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "family", rename_all = "lowercase")]
pub enum ModelConfig {
    Llama(LlamaConfig),
    Gpt2(Gpt2Config),
    Mlp(MlpConfig),
}

fn positive(field: &'static str, v: u64) -> Result<(), ConfigError> {
    if v == 0 {
        Err(ConfigError::new(
            field,
            "must be at least 1, got 0",
            format!("set `{field}` to a positive integer"),
        ))
    } else {
        Ok(())
    }
}

fn finite_positive(field: &'static str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::new(
            field,
            format!("must be a finite number > 0, got {v}"),
            format!("set `{field}` to a small positive number such as 1.0e-5"),
        ))
    }
}

fn layers(v: u64) -> Result<(), ConfigError> {
    positive("n_layers", v)?;
    if v > MAX_LAYERS {
        return Err(ConfigError::new(
            "n_layers",
            format!("{v} layers is more than the {MAX_LAYERS} shardplan traces"),
            "use a realistic layer count",
        ));
    }
    Ok(())
}

fn divides(field: &'static str, part: u64, whole_name: &str, whole: u64, help: &str) -> Result<(), ConfigError> {
    if !whole.is_multiple_of(part) {
        return Err(ConfigError::new(
            field,
            format!("{field} = {part} does not divide {whole_name} = {whole}"),
            help.to_string(),
        ));
    }
    Ok(())
}

/// The MoE fields: sizes positive, `top_k` at most `experts`, shared experts and their
/// width together, some layer left to route, a usable loss weight.
fn validate_moe(m: &MoeConfig, n_layers: u64) -> Result<(), ConfigError> {
    positive("moe.experts", m.experts)?;
    positive("moe.top_k", m.top_k)?;
    positive("moe.expert_ffn_dim", m.expert_ffn_dim)?;
    positive("moe.every", m.every)?;
    if m.top_k > m.experts {
        return Err(ConfigError::new(
            "moe.top_k",
            format!("top_k = {} is more than the {} experts", m.top_k, m.experts),
            "set moe.top_k to at most moe.experts",
        ));
    }
    match (m.shared_experts, m.shared_expert_ffn_dim) {
        (0, 0) => {}
        (0, w) => {
            return Err(ConfigError::new(
                "moe.shared_expert_ffn_dim",
                format!("is {w} but there are no shared experts"),
                "set moe.shared_experts, or remove moe.shared_expert_ffn_dim",
            ))
        }
        (n, 0) => {
            return Err(ConfigError::new(
                "moe.shared_experts",
                format!("{n} shared expert(s) need a width"),
                "set moe.shared_expert_ffn_dim to the shared experts' hidden width (all of them together)",
            ))
        }
        _ => {}
    }
    if m.shared_expert_gate && m.shared_experts == 0 {
        return Err(ConfigError::new(
            "moe.shared_expert_gate",
            "gates shared experts, but there are none",
            "set moe.shared_experts and moe.shared_expert_ffn_dim, or remove moe.shared_expert_gate",
        ));
    }
    if !(m.aux_loss_coef.is_finite() && m.aux_loss_coef >= 0.0) {
        return Err(ConfigError::new(
            "moe.aux_loss_coef",
            format!("must be a finite number >= 0, got {}", m.aux_loss_coef),
            "set moe.aux_loss_coef to 0 (no load-balancing loss) or a small weight such as 0.001",
        ));
    }
    if m.layers_of(n_layers) == 0 {
        return Err(ConfigError::new(
            if m.first_dense > 0 {
                "moe.first_dense"
            } else {
                "moe.every"
            },
            format!(
                "no layer of {n_layers} has experts: first_dense = {}, every = {}, dense_layers = {:?}",
                m.first_dense,
                m.every,
                m.dense_layers.layers()
            ),
            "leave some layer i >= first_dense with (i + 1) a multiple of every, or remove `moe`",
        ));
    }
    Ok(())
}

/// Checked sum of products: the parameter count, or `None` on u64 overflow.
fn checked_sum(terms: &[&[u64]]) -> Option<u64> {
    terms.iter().try_fold(0u64, |acc, t| {
        let p = t.iter().try_fold(1u64, |a, &x| a.checked_mul(x))?;
        acc.checked_add(p)
    })
}

impl ModelConfig {
    pub fn name(&self) -> &str {
        match self {
            ModelConfig::Llama(c) => &c.name,
            ModelConfig::Gpt2(c) => &c.name,
            ModelConfig::Mlp(c) => &c.name,
        }
    }

    /// `llama`, `gpt2` or `mlp`.
    pub fn family(&self) -> &'static str {
        match self {
            ModelConfig::Llama(_) => "llama",
            ModelConfig::Gpt2(_) => "gpt2",
            ModelConfig::Mlp(_) => "mlp",
        }
    }

    /// Longest sequence the model takes (`None`: no limit, the MLP has no sequence).
    pub fn max_seq_len(&self) -> Option<u64> {
        match self {
            ModelConfig::Llama(c) => Some(c.max_seq_len),
            ModelConfig::Gpt2(c) => Some(c.max_seq_len),
            ModelConfig::Mlp(_) => None,
        }
    }

    /// Sequence length traced when the parallel spec gives none: the model's context,
    /// capped at 8192 (long-context configs announce 128K positions but train shorter),
    /// and 1 for the MLP (a row of features is one "token").
    pub fn default_seq_len(&self) -> u64 {
        self.max_seq_len().map_or(1, |m| m.min(8192))
    }

    /// Exact parameter count, or `None` if it overflows u64.
    pub fn param_count(&self) -> Option<u64> {
        match self {
            ModelConfig::Llama(c) => c.param_counts().map(|(total, _)| total),
            ModelConfig::Gpt2(c) => {
                let d = c.dim;
                let layer = checked_sum(&[
                    &[4, d],
                    &[d, 3, d],
                    &[3, d],
                    &[d, d],
                    &[d],
                    &[2, d, c.ffn_dim],
                    &[c.ffn_dim],
                    &[d],
                ])?;
                checked_sum(&[&[layer, c.n_layers], &[c.vocab_size, d], &[c.max_seq_len, d], &[2, d]])
            }
            ModelConfig::Mlp(c) => {
                let layer = checked_sum(&[&[2, c.dim, c.ffn_dim], &[c.ffn_dim], &[c.dim]])?;
                checked_sum(&[&[layer, c.n_layers], &[c.n_classes, c.dim], &[c.n_classes]])
            }
        }
    }

    /// Parameters a token passes through: the total less the routed experts it is not sent
    /// to (equal to the total for a dense model), or `None` on overflow.
    pub fn active_param_count(&self) -> Option<u64> {
        match self {
            ModelConfig::Llama(c) => c.param_counts().map(|(_, active)| active),
            _ => self.param_count(),
        }
    }

    /// True when some layer routes tokens to experts.
    pub fn is_moe(&self) -> bool {
        matches!(self, ModelConfig::Llama(c) if c.moe_layers() > 0)
    }

    /// Checks every number; the error names the field and the fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self {
            ModelConfig::Llama(c) => {
                positive("vocab_size", c.vocab_size)?;
                positive("dim", c.dim)?;
                layers(c.n_layers)?;
                positive("n_heads", c.n_heads)?;
                positive("n_kv_heads", c.n_kv_heads)?;
                positive("ffn_dim", c.ffn_dim)?;
                positive("max_seq_len", c.max_seq_len)?;
                match c.head_dim {
                    Some(hd) => positive("head_dim", hd)?,
                    None => divides(
                        "n_heads",
                        c.n_heads,
                        "dim",
                        c.dim,
                        "choose n_heads dividing dim, or set head_dim explicitly",
                    )?,
                }
                if !c.head_dim().is_multiple_of(2) {
                    return Err(ConfigError::new(
                        "head_dim",
                        format!("rotary embeddings need an even head_dim, got {}", c.head_dim()),
                        "choose dim / n_heads (or head_dim) even",
                    ));
                }
                divides(
                    "n_kv_heads",
                    c.n_kv_heads,
                    "n_heads",
                    c.n_heads,
                    "grouped-query attention needs n_kv_heads dividing n_heads",
                )?;
                finite_positive("norm_eps", c.norm_eps)?;
                finite_positive("rope_theta", c.rope_theta)?;
                if let Some(m) = &c.moe {
                    validate_moe(m, c.n_layers)?;
                }
            }
            ModelConfig::Gpt2(c) => {
                positive("vocab_size", c.vocab_size)?;
                positive("dim", c.dim)?;
                layers(c.n_layers)?;
                positive("n_heads", c.n_heads)?;
                positive("ffn_dim", c.ffn_dim)?;
                positive("max_seq_len", c.max_seq_len)?;
                divides("n_heads", c.n_heads, "dim", c.dim, "choose n_heads dividing dim")?;
                finite_positive("norm_eps", c.norm_eps)?;
            }
            ModelConfig::Mlp(c) => {
                positive("dim", c.dim)?;
                positive("ffn_dim", c.ffn_dim)?;
                layers(c.n_layers)?;
                positive("n_classes", c.n_classes)?;
            }
        }
        // Parameters must be countable, and storable in f32 (4 bytes each), in u64.
        match self.param_count().and_then(|n| n.checked_mul(4)) {
            Some(_) => Ok(()),
            None => Err(ConfigError::new(
                self.largest_field(),
                "the model is too large: its parameter bytes overflow u64",
                "use realistic sizes (dims of at most a few hundred thousand)",
            )),
        }
    }

    /// The size field with the largest value, to blame for an overflow.
    fn largest_field(&self) -> &'static str {
        let fields: Vec<(&'static str, u64)> = match self {
            ModelConfig::Llama(c) => vec![
                ("vocab_size", c.vocab_size),
                ("dim", c.dim),
                ("ffn_dim", c.ffn_dim),
                ("n_heads", c.n_heads),
                ("head_dim", c.head_dim()),
                ("moe.experts", c.moe.map_or(0, |m| m.experts)),
                ("moe.expert_ffn_dim", c.moe.map_or(0, |m| m.expert_ffn_dim)),
                (
                    "moe.shared_expert_ffn_dim",
                    c.moe.map_or(0, |m| m.shared_expert_ffn_dim),
                ),
            ],
            ModelConfig::Gpt2(c) => vec![
                ("vocab_size", c.vocab_size),
                ("dim", c.dim),
                ("ffn_dim", c.ffn_dim),
                ("max_seq_len", c.max_seq_len),
            ],
            ModelConfig::Mlp(c) => vec![("dim", c.dim), ("ffn_dim", c.ffn_dim), ("n_classes", c.n_classes)],
        };
        fields.into_iter().max_by_key(|f| f.1).map_or("dim", |f| f.0)
    }
}
