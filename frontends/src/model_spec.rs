//! The YAML model spec: a serde type mirroring the file, converted into a validated
//! [`ModelConfig`].

use crate::yaml::{self, pos};
use crate::{Origin, Pos, Source, SpecError};
use serde::Deserialize;
use serde_saphyr::Spanned;
use shardplan_models::{Gpt2Config, LlamaConfig, MlpConfig, ModelConfig, MoeConfig, MoeNames, Router};

/// Model families a spec may name.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// Llama 2/3, Mistral, Qwen2 (set `qkv_bias: true`), Qwen3 (set `qk_norm: true`).
    Llama,
    Gpt2,
    Mlp,
}

/// A model spec file as written (see examples/models/ for documented examples).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpecFile {
    /// Display name; defaults to the file name.
    pub name: Option<String>,
    pub family: Spanned<Family>,
    /// Vocabulary size (llama, gpt2).
    pub vocab_size: Option<Spanned<u64>>,
    /// Hidden size of the residual stream (all families).
    pub dim: Option<Spanned<u64>>,
    /// Number of blocks (all families).
    pub n_layers: Option<Spanned<u64>>,
    /// Attention heads (llama, gpt2).
    pub n_heads: Option<Spanned<u64>>,
    /// Key/value heads for grouped-query attention (llama; default n_heads).
    pub n_kv_heads: Option<Spanned<u64>>,
    /// Per-head width (llama; default dim / n_heads).
    pub head_dim: Option<Spanned<u64>>,
    /// Feed-forward hidden size (llama: required; gpt2, mlp: default 4 x dim).
    pub ffn_dim: Option<Spanned<u64>>,
    /// Normalisation epsilon (llama, gpt2; default 1e-5).
    pub norm_eps: Option<Spanned<f64>>,
    /// Rotary base (llama; default 10000).
    pub rope_theta: Option<Spanned<f64>>,
    /// Output head shares the token embedding (llama; default false; gpt2 always ties).
    pub tie_embeddings: Option<Spanned<bool>>,
    /// Bias on q/k/v projections (llama; true for Qwen2; default false).
    pub qkv_bias: Option<Spanned<bool>>,
    /// RMSNorm over each head's queries and keys before rotary (llama; true for Qwen3;
    /// default false).
    pub qk_norm: Option<Spanned<bool>>,
    /// Context length (llama: default 4096; gpt2: learned positions, default 1024).
    pub max_seq_len: Option<Spanned<u64>>,
    /// Output classes (mlp).
    pub n_classes: Option<Spanned<u64>>,
    /// MLP activation (llama: default silu; gpt2: default gelu_tanh): silu, gelu (exact),
    /// gelu_tanh, relu.
    pub activation: Option<Spanned<shardplan_models::Activation>>,
    /// RoPE frequency scaling (llama), Hugging Face's `rope_scaling` as a mapping:
    /// `{rope_type: linear, factor}`, `{rope_type: llama3, factor, low_freq_factor,
    /// high_freq_factor, original_max_position_embeddings}` or `{rope_type: yarn, factor,
    /// original_max_position_embeddings, beta_fast, beta_slow, attention_factor, truncate}`.
    pub rope_scaling: Option<Spanned<shardplan_ir::RopeScaling>>,
    /// Mixture-of-experts feed-forward (llama): see [`MoeSpecFile`].
    pub moe: Option<Spanned<MoeSpecFile>>,
}

/// `moe:` of a llama spec, as written: Mixtral is `{experts: 8, top_k: 2, expert_ffn_dim:
/// 14336}`; Qwen2-MoE adds `shared_experts: 1, shared_expert_ffn_dim: 20480,
/// shared_expert_gate: true`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeSpecFile {
    /// Routed experts per MoE layer (required).
    pub experts: Spanned<u64>,
    /// Experts each token is sent to (required).
    pub top_k: Spanned<u64>,
    /// Hidden width of one routed expert (default: the model's ffn_dim).
    pub expert_ffn_dim: Option<Spanned<u64>>,
    /// Shared experts every token passes through (default 0).
    pub shared_experts: Option<Spanned<u64>>,
    /// Hidden width of the shared experts together (required with shared_experts).
    pub shared_expert_ffn_dim: Option<Spanned<u64>>,
    /// Scale the shared experts' output by a per-token sigmoid gate (Qwen2-MoE; default false).
    pub shared_expert_gate: Option<Spanned<bool>>,
    /// softmax_topk (default) or sigmoid_topk.
    pub router: Option<Spanned<Router>>,
    /// Divide the chosen experts' scores by their sum (default true, as Mixtral).
    pub norm_topk_prob: Option<Spanned<bool>>,
    /// Weight of the load-balancing loss added to the cross-entropy (default 0: none).
    pub aux_loss_coef: Option<Spanned<f64>>,
    /// Every N-th layer has experts (default 1: all).
    pub every: Option<Spanned<u64>>,
    /// The first D layers keep the dense MLP (default 0).
    pub first_dense: Option<Spanned<u64>>,
    /// Hugging Face parameter names: qwen (default; `mlp.experts.E.gate_proj`) or mixtral
    /// (`block_sparse_moe.experts.E.w1`).
    pub hf_names: Option<Spanned<MoeNames>>,
}

impl MoeSpecFile {
    /// `(moe.field, position)` of every field written.
    fn positions(&self) -> Vec<(&'static str, Pos)> {
        let mut v = vec![("moe.experts", pos(&self.experts)), ("moe.top_k", pos(&self.top_k))];
        macro_rules! at_opt {
            ($($f:ident),*) => {$( if let Some(s) = &self.$f { v.push((concat!("moe.", stringify!($f)), pos(s))); } )*};
        }
        at_opt!(
            expert_ffn_dim,
            shared_experts,
            shared_expert_ffn_dim,
            shared_expert_gate,
            router,
            norm_topk_prob,
            aux_loss_coef,
            every,
            first_dense,
            hf_names
        );
        v
    }

    /// The config; unwritten fields take their documented defaults.
    fn to_config(&self, ffn_dim: u64) -> MoeConfig {
        let v = |x: &Option<Spanned<u64>>, d: u64| x.as_ref().map_or(d, |s| s.value);
        let b = |x: &Option<Spanned<bool>>, d: bool| x.as_ref().map_or(d, |s| s.value);
        MoeConfig {
            experts: self.experts.value,
            top_k: self.top_k.value,
            expert_ffn_dim: v(&self.expert_ffn_dim, ffn_dim),
            shared_experts: v(&self.shared_experts, 0),
            shared_expert_ffn_dim: v(&self.shared_expert_ffn_dim, 0),
            shared_expert_gate: b(&self.shared_expert_gate, false),
            router: self.router.as_ref().map_or(Router::SoftmaxTopk, |s| s.value),
            norm_topk_prob: b(&self.norm_topk_prob, true),
            aux_loss_coef: self.aux_loss_coef.as_ref().map_or(0.0, |s| s.value),
            every: v(&self.every, 1),
            first_dense: v(&self.first_dense, 0),
            dense_layers: Default::default(),
            hf_names: self.hf_names.as_ref().map_or(MoeNames::Qwen, |s| s.value),
        }
    }
}

/// Which fields each family takes.
fn allowed(family: Family) -> &'static [&'static str] {
    match family {
        Family::Llama => &[
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "ffn_dim",
            "norm_eps",
            "rope_theta",
            "tie_embeddings",
            "qkv_bias",
            "qk_norm",
            "max_seq_len",
            "activation",
            "rope_scaling",
            "moe",
        ],
        Family::Gpt2 => &[
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "ffn_dim",
            "norm_eps",
            "max_seq_len",
            "activation",
        ],
        Family::Mlp => &["dim", "n_layers", "ffn_dim", "n_classes"],
    }
}

impl ModelSpecFile {
    /// `(field, position)` of every field present in the file.
    fn present(&self) -> Vec<(&'static str, Pos)> {
        let mut v = Vec::new();
        macro_rules! add {
            ($($f:ident),*) => {$( if let Some(s) = &self.$f { v.push((stringify!($f), pos(s))); } )*};
        }
        add!(
            vocab_size,
            dim,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim,
            norm_eps,
            rope_theta,
            tie_embeddings,
            qkv_bias,
            qk_norm,
            max_seq_len,
            n_classes,
            activation,
            rope_scaling,
            moe
        );
        v
    }

    /// Validates and converts into the internal config.
    pub fn into_config(self, src: &Source) -> Result<(ModelConfig, Origin), SpecError> {
        let family = self.family.value;
        let mut origin = Origin::new(&src.path);
        origin.insert("family", pos(&self.family));
        for (field, p) in self.present() {
            origin.insert(field, p);
            if !allowed(family).contains(&field) {
                return Err(origin.error(
                    field,
                    format!("does not apply to family {}", family_name(family)),
                    format!(
                        "remove it; {} takes: {}",
                        family_name(family),
                        allowed(family).join(", ")
                    ),
                ));
            }
        }
        let need = |v: &Option<Spanned<u64>>, field: &str| -> Result<u64, SpecError> {
            v.as_ref().map(|s| s.value).ok_or_else(|| {
                origin.error(
                    "family",
                    format!("family {} needs `{field}`", family_name(family)),
                    format!("add `{field}: <integer>` to the spec"),
                )
            })
        };
        let val = |v: &Option<Spanned<u64>>| v.as_ref().map(|s| s.value);
        let fval = |v: &Option<Spanned<f64>>, d: f64| v.as_ref().map_or(d, |s| s.value);
        let name = self.name.clone().unwrap_or_else(|| file_stem(src));
        let activation = self.activation.as_ref().map(|s| s.value);
        let rope_scaling = match &self.rope_scaling {
            Some(s) => check_rope_scaling(&origin, s.value)?,
            None => Default::default(),
        };
        let config = match family {
            Family::Llama => {
                let n_heads = need(&self.n_heads, "n_heads")?;
                let ffn_dim = need(&self.ffn_dim, "ffn_dim")?;
                let moe = self.moe.as_ref().map(|m| m.value.to_config(ffn_dim));
                ModelConfig::Llama(LlamaConfig {
                    name,
                    vocab_size: need(&self.vocab_size, "vocab_size")?,
                    dim: need(&self.dim, "dim")?,
                    n_layers: need(&self.n_layers, "n_layers")?,
                    n_heads,
                    n_kv_heads: val(&self.n_kv_heads).unwrap_or(n_heads),
                    head_dim: val(&self.head_dim),
                    ffn_dim,
                    norm_eps: fval(&self.norm_eps, 1e-5),
                    rope_theta: fval(&self.rope_theta, 10000.0),
                    rope_scaling,
                    activation,
                    tie_embeddings: self.tie_embeddings.as_ref().is_some_and(|s| s.value),
                    qkv_bias: self.qkv_bias.as_ref().is_some_and(|s| s.value),
                    qk_norm: self.qk_norm.as_ref().is_some_and(|s| s.value),
                    moe,
                    max_seq_len: val(&self.max_seq_len).unwrap_or(4096),
                })
            }
            Family::Gpt2 => {
                let dim = need(&self.dim, "dim")?;
                ModelConfig::Gpt2(Gpt2Config {
                    name,
                    vocab_size: need(&self.vocab_size, "vocab_size")?,
                    dim,
                    n_layers: need(&self.n_layers, "n_layers")?,
                    n_heads: need(&self.n_heads, "n_heads")?,
                    ffn_dim: val(&self.ffn_dim).unwrap_or(dim.saturating_mul(4)),
                    max_seq_len: val(&self.max_seq_len).unwrap_or(1024),
                    norm_eps: fval(&self.norm_eps, 1e-5),
                    activation,
                })
            }
            Family::Mlp => {
                let dim = need(&self.dim, "dim")?;
                ModelConfig::Mlp(MlpConfig {
                    name,
                    dim,
                    ffn_dim: val(&self.ffn_dim).unwrap_or(dim.saturating_mul(4)),
                    n_layers: need(&self.n_layers, "n_layers")?,
                    n_classes: need(&self.n_classes, "n_classes")?,
                })
            }
        };
        if let Some(m) = &self.moe {
            for (field, p) in m.value.positions() {
                origin.insert(field, p);
            }
        }
        config.validate().map_err(|e| {
            // A derived value (head_dim from dim / n_heads) is blamed on a field the user
            // wrote; a defaulted `moe` field on the `moe` mapping.
            let field = if origin.pos(e.field).is_some() {
                e.field
            } else {
                "n_heads"
            };
            origin.error(field, e.message.clone(), e.help.clone())
        })?;
        Ok((config, origin))
    }
}

/// `r` if every number of it is usable: factors, frequencies and the attention factor
/// finite and positive, the original context at least 1, and the llama3 frequency factors
/// in order.
fn check_rope_scaling(origin: &Origin, r: shardplan_ir::RopeScaling) -> Result<shardplan_ir::RopeScaling, SpecError> {
    use shardplan_ir::RopeScaling;
    let bad = |what: &str, v: String| {
        origin.error(
            "rope_scaling",
            format!("`{what}` must be a finite number above 0, got {v}"),
            format!("set rope_scaling.{what} as the model's config.json has it"),
        )
    };
    let pos = |what: &str, v: f64| {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(bad(what, v.to_string()))
        }
    };
    let ctx = |v: u64| {
        if v > 0 {
            Ok(())
        } else {
            Err(bad("original_max_position_embeddings", v.to_string()))
        }
    };
    match r {
        RopeScaling::Default => {}
        RopeScaling::Linear { factor } => pos("factor", factor)?,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            pos("factor", factor)?;
            pos("low_freq_factor", low_freq_factor)?;
            pos("high_freq_factor", high_freq_factor)?;
            ctx(original_max_position_embeddings)?;
            if high_freq_factor <= low_freq_factor {
                return Err(origin.error(
                    "rope_scaling",
                    format!("high_freq_factor ({high_freq_factor}) must be above low_freq_factor ({low_freq_factor})"),
                    "Llama 3.1 uses low_freq_factor: 1, high_freq_factor: 4",
                ));
            }
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            ..
        } => {
            pos("factor", factor)?;
            pos("beta_fast", beta_fast)?;
            pos("beta_slow", beta_slow)?;
            pos("attention_factor", attention_factor)?;
            ctx(original_max_position_embeddings)?;
        }
    }
    Ok(r)
}

fn family_name(f: Family) -> &'static str {
    match f {
        Family::Llama => "llama",
        Family::Gpt2 => "gpt2",
        Family::Mlp => "mlp",
    }
}

pub(crate) fn file_stem(src: &Source) -> String {
    src.path
        .file_stem()
        .map(|s| s.to_string_lossy().trim_end_matches(".config").to_string())
        .unwrap_or_else(|| "model".to_string())
}

/// Parses and validates a YAML model spec.
pub fn parse_model_spec(src: &Source) -> Result<(ModelConfig, Origin), SpecError> {
    let file: ModelSpecFile = yaml::parse(src)?;
    file.into_config(src)
}
