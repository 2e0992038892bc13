//! Hugging Face `config.json` import for LlamaForCausalLM, MistralForCausalLM,
//! Qwen2ForCausalLM, Qwen3ForCausalLM, the mixtures of experts MixtralForCausalLM,
//! Qwen2MoeForCausalLM and Qwen3MoeForCausalLM, and GPT2LMHeadModel.
//!
//! Every key of the file is accounted for ([`field_rule`]): honoured, checked against
//! the value shardplan implements (a value that would change the math and is not
//! implemented is refused, naming the key), or ignored because it cannot change what is
//! trained (token ids, generation settings, dtype...; each with its reason). A key in none
//! of those lists is refused: shardplan cannot tell whether it changes the model.

use crate::model_spec::file_stem;
use crate::{did_you_mean, Origin, Source, SpecError};
use serde::Deserialize;
use shardplan_models::{Gpt2Config, LlamaConfig, ModelConfig, MoeConfig, MoeNames, Router};

type JsonMap = serde_json::Map<String, serde_json::Value>;

/// The architectures shardplan imports.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "GPT2LMHeadModel",
];

/// The subset of config.json shardplan reads, named as in the file.
#[derive(Debug, Default, Deserialize)]
pub struct HfConfig {
    pub architectures: Option<Vec<String>>,
    pub model_type: Option<String>,
    #[serde(rename = "_name_or_path")]
    pub name_or_path: Option<String>,
    pub vocab_size: Option<u64>,
    // Llama family.
    pub hidden_size: Option<u64>,
    pub num_hidden_layers: Option<u64>,
    pub num_attention_heads: Option<u64>,
    pub num_key_value_heads: Option<u64>,
    pub head_dim: Option<u64>,
    pub intermediate_size: Option<u64>,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub tie_word_embeddings: Option<bool>,
    pub max_position_embeddings: Option<u64>,
    pub attention_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    pub hidden_act: Option<String>,
    pub activation_function: Option<String>,
    pub sliding_window: Option<u64>,
    pub use_sliding_window: Option<bool>,
    /// transformers 5: `full_attention` or `sliding_attention` per layer.
    pub layer_types: Option<Vec<String>>,
    // Mixtures of experts.
    pub num_local_experts: Option<u64>,
    pub num_experts: Option<u64>,
    pub num_experts_per_tok: Option<u64>,
    pub moe_intermediate_size: Option<u64>,
    pub shared_expert_intermediate_size: Option<u64>,
    pub decoder_sparse_step: Option<u64>,
    pub mlp_only_layers: Option<Vec<u64>>,
    pub norm_topk_prob: Option<bool>,
    pub output_router_logits: Option<bool>,
    pub router_aux_loss_coef: Option<f64>,
    pub qkv_bias: Option<bool>,
    // GPT-2.
    pub n_embd: Option<u64>,
    pub n_layer: Option<u64>,
    pub n_head: Option<u64>,
    pub n_inner: Option<u64>,
    pub n_positions: Option<u64>,
    pub layer_norm_epsilon: Option<f64>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Mixtral,
    Qwen2Moe,
    Qwen3Moe,
    Gpt2,
}

impl Arch {
    fn is_moe(self) -> bool {
        matches!(self, Arch::Mixtral | Arch::Qwen2Moe | Arch::Qwen3Moe)
    }
}

/// The config.json key a model-config field comes from, per family.
fn hf_key(arch: Arch, field: &str) -> &str {
    match (arch, field) {
        (Arch::Gpt2, "dim") => "n_embd",
        (Arch::Gpt2, "n_layers") => "n_layer",
        (Arch::Gpt2, "n_heads") => "n_head",
        (Arch::Gpt2, "ffn_dim") => "n_inner",
        (Arch::Gpt2, "max_seq_len") => "n_positions",
        (Arch::Gpt2, "norm_eps") => "layer_norm_epsilon",
        (_, "dim") => "hidden_size",
        (_, "n_layers") => "num_hidden_layers",
        (_, "n_heads") => "num_attention_heads",
        (_, "n_kv_heads") => "num_key_value_heads",
        (_, "ffn_dim") => "intermediate_size",
        (_, "norm_eps") => "rms_norm_eps",
        (_, "max_seq_len") => "max_position_embeddings",
        (_, other) => other,
    }
}

impl HfConfig {
    fn arch(&self, src: &Source) -> Result<Arch, SpecError> {
        let from_name = |a: &str| match a {
            "LlamaForCausalLM" => Some(Arch::Llama),
            "MistralForCausalLM" => Some(Arch::Mistral),
            "Qwen2ForCausalLM" => Some(Arch::Qwen2),
            "Qwen3ForCausalLM" => Some(Arch::Qwen3),
            "MixtralForCausalLM" => Some(Arch::Mixtral),
            "Qwen2MoeForCausalLM" => Some(Arch::Qwen2Moe),
            "Qwen3MoeForCausalLM" => Some(Arch::Qwen3Moe),
            "GPT2LMHeadModel" => Some(Arch::Gpt2),
            _ => None,
        };
        let supported = SUPPORTED_ARCHITECTURES.join(", ");
        if let Some(first) = self.architectures.as_ref().and_then(|a| a.first()) {
            return from_name(first).ok_or_else(|| {
                let mut help = format!("shardplan imports {supported}");
                if let Some(m) = did_you_mean(first, SUPPORTED_ARCHITECTURES.iter().copied()) {
                    help = format!("did you mean `{m}`? {help}");
                }
                SpecError::file(&src.path, format!("unsupported architecture `{first}`"))
                    .at(src.json_key_pos("architectures"))
                    .field("architectures")
                    .help(help)
            });
        }
        match self.model_type.as_deref() {
            Some("llama") => Ok(Arch::Llama),
            Some("mistral") => Ok(Arch::Mistral),
            Some("qwen2") => Ok(Arch::Qwen2),
            Some("qwen3") => Ok(Arch::Qwen3),
            Some("mixtral") => Ok(Arch::Mixtral),
            Some("qwen2_moe") => Ok(Arch::Qwen2Moe),
            Some("qwen3_moe") => Ok(Arch::Qwen3Moe),
            Some("gpt2") => Ok(Arch::Gpt2),
            Some(other) => Err(SpecError::file(&src.path, format!("unsupported model_type `{other}`"))
                .at(src.json_key_pos("model_type"))
                .field("model_type")
                .help(format!("shardplan imports {supported}"))),
            None => Err(
                SpecError::file(&src.path, "has neither `architectures` nor `model_type`").help(format!(
                    "is this a Hugging Face config.json? shardplan imports {supported}"
                )),
            ),
        }
    }

    /// Validates and converts into the internal config; `map` is the same file as a JSON
    /// object (for the keys read from nested objects).
    pub fn into_config(self, src: &Source, map: &JsonMap) -> Result<(ModelConfig, Origin), SpecError> {
        let arch = self.arch(src)?;
        let name = self
            .name_or_path
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| file_stem(src));
        let rope_theta = rope_theta(src, map, self.rope_theta)?;
        let mut config = match arch {
            Arch::Gpt2 => self.gpt2_config(src, name)?,
            _ => self.llama_config(src, map, arch, name, rope_theta)?,
        };
        let window_caps = self.cap_to_sliding_window(src, arch, &mut config)?;
        validate(src, arch, &config)?;
        Ok((config, origin(src, arch, window_caps)))
    }

    /// A GPT-2 config: `n_inner` 4 x `n_embd`, 1024 positions and an epsilon of 1e-5
    /// unless written.
    fn gpt2_config(&self, src: &Source, name: String) -> Result<ModelConfig, SpecError> {
        let need = |v: Option<u64>, field: &str| required(src, Arch::Gpt2, v, field);
        let dim = need(self.n_embd, "dim")?;
        Ok(ModelConfig::Gpt2(Gpt2Config {
            name,
            vocab_size: need(self.vocab_size, "vocab_size")?,
            dim,
            n_layers: need(self.n_layer, "n_layers")?,
            n_heads: need(self.n_head, "n_heads")?,
            ffn_dim: self.n_inner.unwrap_or(dim.saturating_mul(4)),
            max_seq_len: self.n_positions.unwrap_or(1024),
            norm_eps: self.layer_norm_epsilon.unwrap_or(1e-5),
            activation: activation(&self.activation_function),
        }))
    }

    /// A config of the Llama family (Llama, Mistral, Qwen2/3 and their mixtures of
    /// experts), with transformers' defaults for the keys a file may leave out; the
    /// biases shardplan does not model are refused.
    fn llama_config(
        &self,
        src: &Source,
        map: &JsonMap,
        arch: Arch,
        name: String,
        rope_theta: Option<f64>,
    ) -> Result<ModelConfig, SpecError> {
        let need = |v: Option<u64>, field: &str| required(src, arch, v, field);
        if self.attention_bias == Some(true) {
            return Err(unsupported_bias(
                src,
                "attention_bias",
                "a bias on o_proj as well as q/k/v",
            ));
        }
        if self.mlp_bias == Some(true) {
            return Err(unsupported_bias(src, "mlp_bias", "biases in the MLP"));
        }
        let n_heads = need(self.num_attention_heads, "n_heads")?;
        // transformers' Qwen3Config sets head_dim to 128 when the file has none;
        // the other families derive it from hidden_size / num_attention_heads.
        let head_dim = match arch {
            Arch::Qwen3 => Some(self.head_dim.unwrap_or(128)),
            _ => self.head_dim,
        };
        let moe = if arch.is_moe() {
            Some(self.moe_config(src, arch)?)
        } else {
            None
        };
        Ok(ModelConfig::Llama(LlamaConfig {
            name,
            vocab_size: need(self.vocab_size, "vocab_size")?,
            dim: need(self.hidden_size, "dim")?,
            n_layers: need(self.num_hidden_layers, "n_layers")?,
            n_heads,
            n_kv_heads: self.num_key_value_heads.unwrap_or(n_heads),
            head_dim,
            ffn_dim: need(self.intermediate_size, "ffn_dim")?,
            norm_eps: self.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: rope_theta.unwrap_or(10000.0),
            rope_scaling: rope_scaling(src, map)?,
            activation: activation(&self.hidden_act),
            tie_embeddings: self.tie_word_embeddings.unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2 || (arch == Arch::Qwen2Moe && self.qkv_bias != Some(false)),
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe),
            moe,
            max_seq_len: self.max_position_embeddings.unwrap_or(4096),
        }))
    }

    /// The sliding window the family applies: Mistral's, Llama's and Mixtral's whenever
    /// written, the Qwen families' only when turned on.
    fn sliding_window(&self, arch: Arch) -> Option<u64> {
        let sliding_layers = self
            .layer_types
            .as_ref()
            .is_some_and(|t| t.iter().any(|l| l == "sliding_attention"));
        match arch {
            Arch::Mistral | Arch::Llama => self.sliding_window,
            Arch::Mixtral => self.sliding_window,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe | Arch::Qwen3Moe
                if self.use_sliding_window == Some(true) || sliding_layers =>
            {
                self.sliding_window
            }
            _ => None,
        }
    }

    /// Caps the trained sequence length at the sliding window; true when it did.
    fn cap_to_sliding_window(&self, src: &Source, arch: Arch, config: &mut ModelConfig) -> Result<bool, SpecError> {
        // A sliding window longer than every trained sequence is the causal mask itself;
        // shardplan has no banded mask, so the window bounds the sequences it trains.
        let (Some(w), ModelConfig::Llama(c)) = (self.sliding_window(arch), config) else {
            return Ok(false);
        };
        if w == 0 {
            return Err(SpecError::file(&src.path, "`sliding_window` is 0")
                .at(src.json_key_pos("sliding_window"))
                .field("sliding_window")
                .help("a sliding window holds at least one token; use null for none"));
        }
        if w < c.max_seq_len {
            c.max_seq_len = w;
            return Ok(true);
        }
        Ok(false)
    }
}

/// The integer a model-config `field` needs, or the error naming the family's key for it.
fn required(src: &Source, arch: Arch, v: Option<u64>, field: &str) -> Result<u64, SpecError> {
    v.ok_or_else(|| missing_key(src, hf_key(arch, field)))
}

/// The error for a required config.json `key` the file leaves out.
fn missing_key(src: &Source, key: &str) -> SpecError {
    SpecError::file(&src.path, format!("missing `{key}`"))
        .field(key)
        .help(format!(
            "add \"{key}\": <integer> (see the model's config.json on the Hub)"
        ))
}

/// The error for a bias flag `key` set to true, a bias (`what`) shardplan does not model.
fn unsupported_bias(src: &Source, key: &str, what: &str) -> SpecError {
    SpecError::file(&src.path, format!("`{key}: true` ({what}) is not supported"))
        .at(src.json_key_pos(key))
        .field(key)
        .help("shardplan models Llama/Mistral/Qwen2/Qwen3 without that bias")
}

/// The model config's own checks, their errors placed at the config.json key of the field.
fn validate(src: &Source, arch: Arch, config: &ModelConfig) -> Result<(), SpecError> {
    config.validate().map_err(|e| {
        let key = moe_key(arch, e.field).unwrap_or_else(|| hf_key(arch, e.field));
        SpecError::file(&src.path, e.message.clone())
            .at(src.json_key_pos(key))
            .field(key)
            .help(e.help.clone())
    })
}

/// Where the fields later checks may name were written: each at its config.json key,
/// the experts as a whole at their count, `max_seq_len` at the window that capped it.
fn origin(src: &Source, arch: Arch, window_caps: bool) -> Origin {
    let key_pos = |k: &str| src.json_key_pos(k);
    let mut origin = Origin::new(&src.path);
    for field in [
        "vocab_size",
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "ffn_dim",
        "max_seq_len",
    ] {
        if let Some(p) = key_pos(hf_key(arch, field)) {
            origin.insert(field, p);
        }
    }
    if arch.is_moe() {
        // A refusal of the experts as a whole (`moe`) points at their count.
        if let Some(p) = key_pos("num_experts").or_else(|| key_pos("num_local_experts")) {
            origin.insert("moe", p);
        }
    }
    if window_caps {
        if let Some(p) = key_pos("sliding_window") {
            origin.insert("max_seq_len", p);
        }
    }
    origin
}

/// The config.json key a `moe.` field comes from, for errors.
fn moe_key(arch: Arch, field: &str) -> Option<&'static str> {
    Some(match field {
        "moe.experts" if arch == Arch::Mixtral => "num_local_experts",
        "moe.experts" => "num_experts",
        "moe.top_k" => "num_experts_per_tok",
        "moe.expert_ffn_dim" if arch == Arch::Mixtral => "intermediate_size",
        "moe.expert_ffn_dim" => "moe_intermediate_size",
        "moe.shared_experts" | "moe.shared_expert_ffn_dim" => "shared_expert_intermediate_size",
        "moe.every" => "decoder_sparse_step",
        "moe.first_dense" | "moe.dense_layers" => "mlp_only_layers",
        "moe.aux_loss_coef" => "router_aux_loss_coef",
        _ => return None,
    })
}

impl HfConfig {
    /// The mixture of experts of a Mixtral, Qwen2-MoE or Qwen3-MoE config, as transformers
    /// builds it: softmax routing; Mixtral's experts as wide as `intermediate_size` and its
    /// chosen scores always renormalised; Qwen2-MoE's one shared expert behind a sigmoid
    /// gate; the load-balancing loss only with `output_router_logits`, as transformers adds
    /// it to the loss then.
    fn moe_config(&self, src: &Source, arch: Arch) -> Result<MoeConfig, SpecError> {
        let fail = |key: &str, msg: String, help: &str| {
            SpecError::file(&src.path, msg)
                .at(src.json_key_pos(key))
                .field(key)
                .help(help.to_string())
        };
        let missing = |key: &str| missing_key(src, key);
        // Mixtral names the count num_local_experts, Qwen num_experts; transformers 5 saves
        // Qwen3-MoE configs under Mixtral's name, so either is read for every family.
        let (name, other, own, alias) = match arch {
            Arch::Mixtral => (
                "num_local_experts",
                "num_experts",
                self.num_local_experts,
                self.num_experts,
            ),
            _ => (
                "num_experts",
                "num_local_experts",
                self.num_experts,
                self.num_local_experts,
            ),
        };
        let experts = match (own, alias) {
            (Some(a), Some(b)) if a != b => {
                return Err(fail(
                    other,
                    format!("`{other}` is {b} but `{name}` is {a}"),
                    &format!("keep one of them ({name} is this family's name for it)"),
                ))
            }
            (a, b) => a.or(b).ok_or_else(|| missing(name))?,
        };
        let top_k = self.num_experts_per_tok.ok_or_else(|| missing("num_experts_per_tok"))?;
        let expert_ffn_dim = match arch {
            Arch::Mixtral => self.intermediate_size.ok_or_else(|| missing("intermediate_size"))?,
            _ => self
                .moe_intermediate_size
                .ok_or_else(|| missing("moe_intermediate_size"))?,
        };
        let (shared_experts, shared_expert_ffn_dim) =
            match arch {
                Arch::Qwen2Moe => match self.shared_expert_intermediate_size {
                    Some(0) => return Err(fail(
                        "shared_expert_intermediate_size",
                        "`shared_expert_intermediate_size` is 0: Qwen2-MoE always has a shared expert (and its gate)"
                            .into(),
                        "give the shared expert's width, as the published configs do",
                    )),
                    Some(w) => (1, w),
                    None => return Err(missing("shared_expert_intermediate_size")),
                },
                _ => (0, 0),
            };
        // Qwen's `mlp_only_layers`: a leading run is `first_dense`, any others are listed.
        let (first_dense, dense_layers) = match &self.mlp_only_layers {
            None => (0, Default::default()),
            Some(layers) => {
                if let Some(&l) = layers
                    .iter()
                    .find(|&&l| l >= self.num_hidden_layers.unwrap_or(u64::MAX))
                {
                    return Err(fail(
                        "mlp_only_layers",
                        format!(
                            "`mlp_only_layers` lists layer {l}, past the model's {} layers",
                            self.num_hidden_layers.unwrap_or(0)
                        ),
                        "list layer indices from 0 to num_hidden_layers - 1",
                    ));
                }
                let mut sorted = layers.clone();
                sorted.sort_unstable();
                sorted.dedup();
                let lead = sorted.iter().enumerate().take_while(|(i, &l)| l == *i as u64).count();
                let rest = shardplan_models::LayerSet::try_from(sorted[lead..].to_vec()).map_err(|e| {
                    fail(
                        "mlp_only_layers",
                        format!("`mlp_only_layers`: {e}"),
                        "list fewer layers",
                    )
                })?;
                (lead as u64, rest)
            }
        };
        let aux_loss_coef = if self.output_router_logits == Some(true) {
            self.router_aux_loss_coef.unwrap_or(0.001)
        } else {
            0.0
        };
        Ok(MoeConfig {
            experts,
            top_k,
            expert_ffn_dim,
            shared_experts,
            shared_expert_ffn_dim,
            shared_expert_gate: arch == Arch::Qwen2Moe,
            router: Router::SoftmaxTopk,
            norm_topk_prob: match arch {
                Arch::Mixtral => true,
                _ => self.norm_topk_prob.unwrap_or(false),
            },
            aux_loss_coef,
            every: match arch {
                Arch::Mixtral => 1,
                _ => self.decoder_sparse_step.unwrap_or(1),
            },
            first_dense,
            dense_layers,
            hf_names: match arch {
                Arch::Mixtral => MoeNames::Mixtral,
                _ => MoeNames::Qwen,
            },
        })
    }
}

/// The RoPE scaling of `rope_scaling` or `rope_parameters` (transformers 5): `default`,
/// `linear` or `llama3`, every field they need present and sane (other types are refused
/// by `check_fields`).
fn rope_scaling(src: &Source, map: &JsonMap) -> Result<shardplan_models::RopeScaling, SpecError> {
    use shardplan_models::RopeScaling;
    let mut found: Option<(&str, RopeScaling)> = None;
    for key in ["rope_scaling", "rope_parameters"] {
        let Some(v) = map.get(key).filter(|v| v.is_object()) else {
            continue;
        };
        let fail = |field: &str, what: String| {
            SpecError::file(&src.path, format!("`{key}.{field}` {what}"))
                .at(src.json_key_pos(key))
                .field(format!("{key}.{field}"))
                .help("write the rope_scaling of the model's published config.json")
        };
        let num = |field: &str| -> Result<f64, SpecError> {
            match v.get(field).and_then(serde_json::Value::as_f64) {
                Some(x) if x.is_finite() && x > 0.0 => Ok(x),
                Some(x) => Err(fail(field, format!("is {x}, not a positive number"))),
                None => Err(fail(field, "is missing or not a number".into())),
            }
        };
        let kind = v
            .get("rope_type")
            .or_else(|| v.get("type"))
            .and_then(serde_json::Value::as_str)
            .unwrap_or("default");
        let s = match kind {
            "linear" => RopeScaling::Linear { factor: num("factor")? },
            "llama3" => {
                let (low, high) = (num("low_freq_factor")?, num("high_freq_factor")?);
                if high <= low {
                    return Err(fail(
                        "high_freq_factor",
                        format!("({high}) must be above low_freq_factor ({low})"),
                    ));
                }
                let orig = num("original_max_position_embeddings")?;
                if orig.fract() != 0.0 || orig > 1e12 {
                    return Err(fail(
                        "original_max_position_embeddings",
                        format!("is {orig}, not a token count"),
                    ));
                }
                RopeScaling::Llama3 {
                    factor: num("factor")?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: orig as u64,
                }
            }
            "yarn" => {
                if let Some(p) = v.get("partial_rotary_factor").and_then(serde_json::Value::as_f64) {
                    if p != 1.0 {
                        return Err(fail(
                            "partial_rotary_factor",
                            format!("is {p}: a partial rotary embedding is not implemented"),
                        ));
                    }
                }
                let opt = |field: &str| -> Result<Option<f64>, SpecError> {
                    match v.get(field) {
                        None | Some(serde_json::Value::Null) => Ok(None),
                        Some(_) => num(field).map(Some),
                    }
                };
                let orig = match opt("original_max_position_embeddings")? {
                    Some(o) if o.fract() == 0.0 && o <= 1e12 => o as u64,
                    Some(o) => {
                        return Err(fail(
                            "original_max_position_embeddings",
                            format!("is {o}, not a token count"),
                        ))
                    }
                    None => map
                        .get("max_position_embeddings")
                        .and_then(serde_json::Value::as_u64)
                        .ok_or_else(|| fail("original_max_position_embeddings", "is missing".into()))?,
                };
                let factor = num("factor")?;
                // YaRN's attention scaling: 0.1 m ln(factor) + 1 (1 for factor <= 1).
                let m = |scale: f64, mscale: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * mscale * scale.ln() + 1.0
                    }
                };
                let attention_factor = match (opt("attention_factor")?, opt("mscale")?, opt("mscale_all_dim")?) {
                    (Some(a), _, _) => a,
                    (None, Some(ms), Some(all)) => m(factor, ms) / m(factor, all),
                    _ => m(factor, 1.0),
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: orig,
                    beta_fast: opt("beta_fast")?.unwrap_or(32.0),
                    beta_slow: opt("beta_slow")?.unwrap_or(1.0),
                    attention_factor,
                    truncate: v.get("truncate").and_then(serde_json::Value::as_bool).unwrap_or(true),
                }
            }
            _ => RopeScaling::Default,
        };
        match found {
            Some((first, f)) if f != s => {
                return Err(
                    SpecError::file(&src.path, format!("`{first}` and `{key}` give different RoPE scalings"))
                        .at(src.json_key_pos(key))
                        .field(key)
                        .help("keep one of them"),
                )
            }
            _ => found = Some((key, s)),
        }
    }
    Ok(found.map_or(RopeScaling::Default, |(_, s)| s))
}

/// The activation a config names (`None`: the family's default; `check_fields` has refused
/// the names shardplan does not implement).
fn activation(name: &Option<String>) -> Option<shardplan_models::Activation> {
    name.as_deref().and_then(shardplan_models::Activation::from_hf)
}

/// The RoPE base, as `rope_theta` or as transformers 5's `rope_parameters.rope_theta`
/// (`written` is the former); two different values are refused.
fn rope_theta(src: &Source, map: &JsonMap, written: Option<f64>) -> Result<Option<f64>, SpecError> {
    Ok(match (written, rope_parameters_theta(src, map)?) {
        (Some(a), Some(b)) if a != b => {
            return Err(SpecError::file(
                &src.path,
                format!("`rope_theta` is {a} but `rope_parameters.rope_theta` is {b}"),
            )
            .at(src.json_key_pos("rope_theta"))
            .field("rope_theta")
            .help("keep one of them, or make them equal"))
        }
        (a, b) => a.or(b),
    })
}

/// `rope_parameters.rope_theta` (transformers 5's layout), if given.
fn rope_parameters_theta(src: &Source, map: &JsonMap) -> Result<Option<f64>, SpecError> {
    match map.get("rope_parameters").and_then(|r| r.get("rope_theta")) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && x > 0.0 => Ok(Some(x)),
            _ => Err(SpecError::file(
                &src.path,
                format!("`rope_parameters.rope_theta` is {v}, not a positive number"),
            )
            .at(src.json_key_pos("rope_parameters"))
            .field("rope_parameters.rope_theta")
            .help("give the RoPE base as a number, e.g. 500000.0")),
        },
    }
}

/// What shardplan does with one config.json key of an architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldRule {
    /// Read and used.
    Honoured,
    /// Accepted when its value is what shardplan implements, refused otherwise.
    Checked,
    /// Read by no part of shardplan, because it cannot change what is trained; the reason.
    Ignored(&'static str),
}

const GENERATION: &str = "generation or inference setting: no effect on training";
const TOKENS: &str = "a token id: the tokenizer's and the data's business, not the model's math";
const META: &str = "bookkeeping of transformers: no effect on the math";
const DTYPE: &str = "storage dtype of the weights: the parallel spec's mixed_precision decides what is computed";
const DROPOUT: &str =
    "dropout probability: shardplan trains without dropout, as torchtitan does; it is not part of the model's function";
const INIT: &str =
    "initialisation scale: weights come from the checkpoint (--init-from) or shardplan's own initialiser";
const HEADS: &str = "for task heads shardplan does not build (classification, summary)";

/// How `key` of a config.json of `arch` is treated; `None`: an unknown key (refused).
fn field_rule(arch: Arch, key: &str) -> Option<FieldRule> {
    use FieldRule::*;
    let llama = arch != Arch::Gpt2;
    Some(match key {
        "architectures" | "model_type" | "vocab_size" | "_name_or_path" => Honoured,
        "hidden_size"
        | "num_hidden_layers"
        | "num_attention_heads"
        | "num_key_value_heads"
        | "head_dim"
        | "intermediate_size"
        | "rms_norm_eps"
        | "rope_theta"
        | "max_position_embeddings"
        | "tie_word_embeddings"
            if llama =>
        {
            Honoured
        }
        "n_embd" | "n_layer" | "n_head" | "n_inner" | "n_positions" | "layer_norm_epsilon" if !llama => Honoured,
        "hidden_act" | "attention_bias" | "mlp_bias" | "rope_scaling" | "rope_parameters" if llama => Checked,
        "sliding_window" if llama => Checked,
        "use_sliding_window" | "max_window_layers"
            if matches!(arch, Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe | Arch::Qwen3Moe) =>
        {
            Checked
        }
        "num_local_experts"
        | "num_experts"
        | "num_experts_per_tok"
        | "router_aux_loss_coef"
        | "output_router_logits"
            if arch.is_moe() =>
        {
            Honoured
        }
        "router_jitter_noise" if arch == Arch::Mixtral => Checked,
        "moe_intermediate_size" | "decoder_sparse_step" | "mlp_only_layers" | "norm_topk_prob"
            if matches!(arch, Arch::Qwen2Moe | Arch::Qwen3Moe) =>
        {
            Honoured
        }
        "shared_expert_intermediate_size" | "qkv_bias" if arch == Arch::Qwen2Moe => Honoured,
        "layer_types" if llama => Checked,
        "activation_function"
        | "scale_attn_by_inverse_layer_idx"
        | "scale_attn_weights"
        | "tie_word_embeddings"
        | "add_cross_attention"
            if !llama =>
        {
            Checked
        }
        "n_ctx" if !llama => Ignored("legacy alias of n_positions in GPT-2 configs"),
        "reorder_and_upcast_attn" if !llama => {
            Ignored("computes attention scores in f32: shardplan's attention already does")
        }
        "attention_dropout"
        | "attn_pdrop"
        | "resid_pdrop"
        | "embd_pdrop"
        | "summary_first_dropout"
        | "hidden_dropout"
        | "classifier_dropout" => Ignored(DROPOUT),
        "initializer_range" | "initializer_factor" => Ignored(INIT),
        "pretraining_tp" => Ignored("splits matmuls into slices that sum to the same product (rounding only)"),
        "torch_dtype" | "dtype" | "use_bfloat16" => Ignored(DTYPE),
        "bos_token_id"
        | "eos_token_id"
        | "pad_token_id"
        | "sep_token_id"
        | "decoder_start_token_id"
        | "forced_bos_token_id"
        | "forced_eos_token_id"
        | "suppress_tokens"
        | "begin_suppress_tokens" => Ignored(TOKENS),
        "use_cache"
        | "max_length"
        | "min_length"
        | "do_sample"
        | "early_stopping"
        | "num_beams"
        | "num_beam_groups"
        | "diversity_penalty"
        | "temperature"
        | "top_k"
        | "top_p"
        | "typical_p"
        | "repetition_penalty"
        | "length_penalty"
        | "no_repeat_ngram_size"
        | "encoder_no_repeat_ngram_size"
        | "bad_words_ids"
        | "num_return_sequences"
        | "output_scores"
        | "return_dict_in_generate"
        | "remove_invalid_values"
        | "exponential_decay_length_penalty"
        | "task_specific_params" => Ignored(GENERATION),
        "transformers_version"
        | "return_dict"
        | "output_hidden_states"
        | "output_attentions"
        | "torchscript"
        | "tf_legacy_loss"
        | "pruned_heads"
        | "chunk_size_feed_forward"
        | "is_decoder"
        | "is_encoder_decoder"
        | "tie_encoder_decoder"
        | "cross_attention_hidden_size"
        | "finetuning_task"
        | "tokenizer_class"
        | "prefix"
        | "_attn_implementation"
        | "_commit_hash"
        | "attn_implementation"
        | "auto_map" => Ignored(META),
        "id2label"
        | "label2id"
        | "problem_type"
        | "num_labels"
        | "summary_type"
        | "summary_use_proj"
        | "summary_activation"
        | "summary_proj_to_labels" => Ignored(HEADS),
        _ => return None,
    })
}

/// The table of every key shardplan knows for `arch` (for docs/src/model.md and tests).
pub fn field_table(architecture: &str) -> Vec<(&'static str, FieldRule)> {
    let arch = match architecture {
        "MistralForCausalLM" => Arch::Mistral,
        "Qwen2ForCausalLM" => Arch::Qwen2,
        "Qwen3ForCausalLM" => Arch::Qwen3,
        "MixtralForCausalLM" => Arch::Mixtral,
        "Qwen2MoeForCausalLM" => Arch::Qwen2Moe,
        "Qwen3MoeForCausalLM" => Arch::Qwen3Moe,
        "GPT2LMHeadModel" => Arch::Gpt2,
        _ => Arch::Llama,
    };
    KNOWN_KEYS
        .iter()
        .filter_map(|&k| field_rule(arch, k).map(|r| (k, r)))
        .collect()
}

/// Every key `field_rule` names, for enumeration.
const KNOWN_KEYS: &[&str] = &[
    "architectures",
    "model_type",
    "vocab_size",
    "_name_or_path",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "tie_word_embeddings",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "n_positions",
    "layer_norm_epsilon",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "rope_scaling",
    "rope_parameters",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
    "output_router_logits",
    "router_aux_loss_coef",
    "router_jitter_noise",
    "qkv_bias",
    "activation_function",
    "scale_attn_by_inverse_layer_idx",
    "scale_attn_weights",
    "add_cross_attention",
    "n_ctx",
    "reorder_and_upcast_attn",
    "attention_dropout",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
    "summary_first_dropout",
    "hidden_dropout",
    "classifier_dropout",
    "initializer_range",
    "initializer_factor",
    "pretraining_tp",
    "torch_dtype",
    "dtype",
    "use_bfloat16",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "suppress_tokens",
    "begin_suppress_tokens",
    "use_cache",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "task_specific_params",
    "transformers_version",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "torchscript",
    "tf_legacy_loss",
    "pruned_heads",
    "chunk_size_feed_forward",
    "is_decoder",
    "is_encoder_decoder",
    "tie_encoder_decoder",
    "cross_attention_hidden_size",
    "finetuning_task",
    "tokenizer_class",
    "prefix",
    "_attn_implementation",
    "_commit_hash",
    "attn_implementation",
    "auto_map",
    "id2label",
    "label2id",
    "problem_type",
    "num_labels",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
];

/// Refuses the keys and values of `map` shardplan does not implement (see `field_rule`).
fn check_fields(src: &Source, arch: Arch, map: &JsonMap) -> Result<(), SpecError> {
    use serde_json::Value;
    let refuse = |key: &str, msg: String, help: &str| {
        SpecError::file(&src.path, msg)
            .at(src.json_key_pos(key))
            .field(key)
            .help(help.to_string())
    };
    let name = match arch {
        Arch::Llama => "LlamaForCausalLM",
        Arch::Mistral => "MistralForCausalLM",
        Arch::Qwen2 => "Qwen2ForCausalLM",
        Arch::Qwen3 => "Qwen3ForCausalLM",
        Arch::Mixtral => "MixtralForCausalLM",
        Arch::Qwen2Moe => "Qwen2MoeForCausalLM",
        Arch::Qwen3Moe => "Qwen3MoeForCausalLM",
        Arch::Gpt2 => "GPT2LMHeadModel",
    };
    let rope_type = |v: &Value| -> Option<String> {
        v.get("rope_type")
            .or_else(|| v.get("type"))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    for (key, v) in map {
        let Some(rule) = field_rule(arch, key) else {
            return Err(refuse(
                key,
                format!("unknown {name} config key `{key}`: shardplan cannot tell whether it changes the model"),
                "if it does not change the math, remove it from a copy of config.json; docs/src/model.md lists every key shardplan reads, checks or ignores",
            ));
        };
        if rule != FieldRule::Checked || v.is_null() {
            continue;
        }
        let bad = |what: &str, help: &str| Err(refuse(key, format!("`{key}`: {v} ({what}) is not implemented"), help));
        match key.as_str() {
            "hidden_act" | "activation_function"
                if v.as_str().and_then(shardplan_models::Activation::from_hf).is_none() =>
            {
                return bad(
                    "an activation shardplan does not implement",
                    "shardplan implements silu, gelu, gelu_new / gelu_pytorch_tanh and relu",
                )
            }
            "rope_scaling" | "rope_parameters" => match rope_type(v).as_deref() {
                None | Some("default") => {}
                Some("llama3" | "linear" | "yarn") => {}
                Some(t @ ("dynamic" | "longrope" | "su" | "ntk")) => {
                    return Err(refuse(
                        key,
                        format!("`{key}`: RoPE scaling `{t}` is not implemented"),
                        "shardplan implements rope_type default, linear, llama3 and yarn; training with another would not be the model you loaded",
                    ))
                }
                Some(t) => {
                    return Err(refuse(
                        key,
                        format!("`{key}`: unknown RoPE type `{t}`"),
                        "shardplan implements rope_type default, linear, llama3 and yarn",
                    ))
                }
            },
            "scale_attn_by_inverse_layer_idx" if v.as_bool() != Some(false) => {
                return bad(
                    "attention scores divided by the layer index",
                    "shardplan scales attention scores by 1/sqrt(head_dim) only",
                )
            }
            "scale_attn_weights" if v.as_bool() != Some(true) => {
                return bad("unscaled attention scores", "shardplan scales attention scores by 1/sqrt(head_dim)")
            }
            "tie_word_embeddings" if arch == Arch::Gpt2 && v.as_bool() != Some(true) => {
                return bad(
                    "a GPT-2 head with its own weights",
                    "shardplan's GPT-2 ties its head to the token embedding, as GPT2LMHeadModel does by default",
                )
            }
            "add_cross_attention" if v.as_bool() != Some(false) => {
                return bad("cross-attention layers", "shardplan builds decoder-only models")
            }
            "attention_bias" | "mlp_bias" | "use_sliding_window" if v.as_bool().is_none() => {
                return Err(refuse(key, format!("`{key}` is {v}, not true or false"), "write true or false"))
            }
            "layer_types"
                if !v.as_array().is_some_and(|a| {
                    a.iter()
                        .all(|l| matches!(l.as_str(), Some("full_attention" | "sliding_attention")))
                }) =>
            {
                return bad(
                    "attention kinds other than full_attention and sliding_attention",
                    "shardplan implements causal attention, and a sliding window as long as the trained sequences",
                )
            }
            "router_jitter_noise" if v.as_f64() != Some(0.0) => {
                return bad(
                    "multiplicative noise on the router's input while training",
                    "shardplan routes without jitter, as the published Mixtral configs do (0.0)",
                )
            }
            "sliding_window" | "max_window_layers" if v.as_u64().is_none() => {
                return Err(refuse(
                    key,
                    format!("`{key}` is {v}, not a token count"),
                    "write a positive integer, or null",
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Parses and validates a Hugging Face config.json.
pub fn parse_hf_config(src: &Source) -> Result<(ModelConfig, Origin), SpecError> {
    let mut de = serde_json::Deserializer::from_str(&src.text);
    let value: HfConfig = serde_path_to_error::deserialize(&mut de)
        .map_err(|e| (e.path().to_string(), e.into_inner()))
        .and_then(|v| de.end().map(|()| v).map_err(|e| (String::new(), e)))
        .map_err(|(field, e)| {
            let what = match e.classify() {
                serde_json::error::Category::Syntax | serde_json::error::Category::Eof => "is not valid JSON",
                _ => "has a value of the wrong type",
            };
            let raw = e.to_string();
            let detail = raw.rfind(" at line ").map_or(raw.as_str(), |i| &raw[..i]);
            let mut err = SpecError::file(&src.path, format!("{what}: {detail}"))
                .at(Some(crate::Pos {
                    line: e.line() as u64,
                    column: e.column() as u64,
                }))
                .help("a config.json is one JSON object of `\"key\": value` pairs, as on the Hugging Face Hub");
            if !field.is_empty() && field != "." && field != "?" {
                err = err.field(field);
            }
            err
        })?;
    let arch = value.arch(src)?;
    // The typed parse above succeeded, so the text is one JSON object.
    let map = match serde_json::from_str::<serde_json::Value>(&src.text) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => JsonMap::new(),
    };
    check_fields(src, arch, &map)?;
    value.into_config(src, &map)
}
