//! Model builders: trace Llama (2/3, Mistral, Qwen2), GPT-2 and a small MLP into the IR,
//! with Hugging Face parameter names, plus size presets.
//!
//! Architecture invariant: builders only call the IR's graph API; they hold no tensors.

mod config;
pub mod float8;
mod gpt2;
mod llama;
mod mlp;
mod presets;
mod trace;
mod tracer;

pub use config::{
    Activation, ConfigError, Gpt2Config, LayerSet, LlamaConfig, MlpConfig, ModelConfig, MoeConfig, MoeNames, Router,
    MAX_LAYERS,
};
pub use float8::{Float8Linears, Float8Options};
pub use presets::{preset, PRESET_NAMES};
pub use shardplan_ir::RopeScaling;
pub use trace::{trace, TraceError, TraceOptions};
pub use tracer::{ContextOptions, ExpertOptions, TensorOptions};
