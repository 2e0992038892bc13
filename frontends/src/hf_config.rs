//! Hugging Face `config.json` import for LlamaForCausalLM, MistralForCausalLM,
//! Qwen2ForCausalLM and GPT2LMHeadModel.
//!
//! Keys shardplan does not model (dtype, token ids, rope_scaling, sliding_window...) are
//! ignored: HF configs carry dozens of them and none changes a tensor shape.

use crate::model_spec::file_stem;
use crate::{did_you_mean, Origin, Source, SpecError};
use serde::Deserialize;
use shardplan_models::{Gpt2Config, LlamaConfig, ModelConfig};

/// The architectures shardplan imports.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
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
    Gpt2,
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

    /// Validates and converts into the internal config.
    pub fn into_config(self, src: &Source) -> Result<(ModelConfig, Origin), SpecError> {
        let arch = self.arch(src)?;
        let need = |v: Option<u64>, field: &str| -> Result<u64, SpecError> {
            let key = hf_key(arch, field);
            v.ok_or_else(|| {
                SpecError::file(&src.path, format!("missing `{key}`"))
                    .field(key)
                    .help(format!(
                        "add \"{key}\": <integer> (see the model's config.json on the Hub)"
                    ))
            })
        };
        let name = self
            .name_or_path
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| file_stem(src));
        let unsupported = |key: &str, what: &str| {
            SpecError::file(&src.path, format!("`{key}: true` ({what}) is not supported"))
                .at(src.json_key_pos(key))
                .field(key)
                .help("shardplan models Llama/Mistral/Qwen2 without that bias")
        };
        let config = match arch {
            Arch::Gpt2 => {
                let dim = need(self.n_embd, "dim")?;
                ModelConfig::Gpt2(Gpt2Config {
                    name,
                    vocab_size: need(self.vocab_size, "vocab_size")?,
                    dim,
                    n_layers: need(self.n_layer, "n_layers")?,
                    n_heads: need(self.n_head, "n_heads")?,
                    ffn_dim: self.n_inner.unwrap_or(dim.saturating_mul(4)),
                    max_seq_len: self.n_positions.unwrap_or(1024),
                    norm_eps: self.layer_norm_epsilon.unwrap_or(1e-5),
                })
            }
            _ => {
                if self.attention_bias == Some(true) {
                    return Err(unsupported("attention_bias", "a bias on o_proj as well as q/k/v"));
                }
                if self.mlp_bias == Some(true) {
                    return Err(unsupported("mlp_bias", "biases in the MLP"));
                }
                let n_heads = need(self.num_attention_heads, "n_heads")?;
                ModelConfig::Llama(LlamaConfig {
                    name,
                    vocab_size: need(self.vocab_size, "vocab_size")?,
                    dim: need(self.hidden_size, "dim")?,
                    n_layers: need(self.num_hidden_layers, "n_layers")?,
                    n_heads,
                    n_kv_heads: self.num_key_value_heads.unwrap_or(n_heads),
                    head_dim: self.head_dim,
                    ffn_dim: need(self.intermediate_size, "ffn_dim")?,
                    norm_eps: self.rms_norm_eps.unwrap_or(1e-6),
                    rope_theta: self.rope_theta.unwrap_or(10000.0),
                    tie_embeddings: self.tie_word_embeddings.unwrap_or(false),
                    qkv_bias: arch == Arch::Qwen2,
                    max_seq_len: self.max_position_embeddings.unwrap_or(4096),
                })
            }
        };
        let mut origin = Origin::new(&src.path);
        config.validate().map_err(|e| {
            let key = hf_key(arch, e.field);
            SpecError::file(&src.path, e.message.clone())
                .at(src.json_key_pos(key))
                .field(key)
                .help(e.help.clone())
        })?;
        for field in [
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_dim",
            "max_seq_len",
        ] {
            if let Some(p) = src.json_key_pos(hf_key(arch, field)) {
                origin.insert(field, p);
            }
        }
        Ok((config, origin))
    }
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
    value.into_config(src)
}
