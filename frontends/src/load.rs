//! Entry points: a path (or preset name) in, a validated config and its origin out.

use crate::{
    did_you_mean, parse_hf_config, parse_model_spec, parse_parallel_spec, Origin, ParallelConfig, Source, SpecError,
};
use shardplan_models::{preset, ModelConfig, TraceError, TraceOptions, PRESET_NAMES};
use std::path::Path;

/// A model config and where it came from.
#[derive(Clone, Debug)]
pub struct LoadedModel {
    pub config: ModelConfig,
    pub origin: Origin,
}

/// Loads a model from a YAML spec, a Hugging Face config.json (by extension, or by a
/// leading `{`), or, when no such file exists, a preset name (`llama3-8b`).
pub fn load_model(path: &Path) -> Result<LoadedModel, SpecError> {
    if !path.exists() {
        if let Some(config) = path.to_str().and_then(preset) {
            return Ok(LoadedModel {
                config,
                origin: Origin::new(path),
            });
        }
        let name = path.to_string_lossy();
        if path.extension().is_none() {
            let help = match did_you_mean(&name, PRESET_NAMES.iter().copied()) {
                Some(m) => format!("did you mean the preset `{m}`?"),
                None => format!("pass a spec file, or a preset: {}", PRESET_NAMES.join(", ")),
            };
            return Err(SpecError::file(path, "is neither a file nor a preset name").help(help));
        }
    }
    let src = Source::read(path)?;
    let is_json = match path.extension().and_then(|e| e.to_str()) {
        Some("json") => true,
        Some("yaml" | "yml") => false,
        _ => src.text.trim_start().starts_with('{'),
    };
    let (config, origin) = if is_json {
        parse_hf_config(&src)?
    } else {
        parse_model_spec(&src)?
    };
    Ok(LoadedModel { config, origin })
}

/// A parallel spec and where it came from.
#[derive(Clone, Debug)]
pub struct LoadedParallel {
    pub config: ParallelConfig,
    pub origin: Origin,
}

/// Loads and validates a parallel spec.
pub fn load_parallel(path: &Path) -> Result<LoadedParallel, SpecError> {
    let src = Source::read(path)?;
    let (config, origin) = parse_parallel_spec(&src)?;
    Ok(LoadedParallel { config, origin })
}

/// The shape to trace `model` at: batch and sequence from the parallel spec (if any),
/// dtype from its mixed-precision policy.
pub fn trace_options(parallel: Option<&LoadedParallel>) -> TraceOptions {
    match parallel {
        None => TraceOptions::default(),
        Some(p) => p.config.trace_options(),
    }
}

/// Turns a tracing failure into an error located in the spec that caused it.
pub fn trace_error(err: TraceError, model: &LoadedModel, parallel: Option<&LoadedParallel>) -> SpecError {
    match err {
        TraceError::Config(e) => model.origin.error(e.field, e.message, e.help),
        TraceError::Shape { field, message, help } => match parallel {
            Some(p) => p.origin.error(field, message, help),
            None => model.origin.error("max_seq_len", message, help),
        },
        TraceError::Ir(e) => {
            SpecError::file(&model.origin.file, e.to_string()).help("use smaller sizes in the model or the batch")
        }
    }
}
