//! `shardplan generate`: text from a trained model on one CPU rank — a shardplan
//! checkpoint (its metadata records the model) or Hugging Face safetensors (with the
//! `config.json` beside them) — with a KV cache, greedy or nucleus sampling.

use crate::CliError;
use clap::Args;
use shardplan_executor::infer::{param_shapes, sample::Sampling, Model};
use shardplan_executor::ExecError;
use shardplan_frontends::{load_model, SpecError};
use shardplan_models::ModelConfig;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// The weights: a checkpoint folder (`--checkpoint-dir`, or one `step-N` in it), a
    /// Hugging Face model folder (config.json and model.safetensors or an index), or a
    /// safetensors file (`checkpoint export`'s; the model comes from --model or a
    /// config.json beside it).
    #[arg(long, value_name = "PATH")]
    pub from: PathBuf,
    /// The Hugging Face tokenizer.json that turns the prompt into ids and back.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: PathBuf,
    /// The text to continue.
    #[arg(long, value_name = "TEXT")]
    pub prompt: String,
    /// Most tokens to add (fewer when the model's positions run out or it ends the text).
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub max_new_tokens: u64,
    /// 0: greedy (always the most likely token); higher: more varied.
    #[arg(long, value_name = "T", default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample among the most likely tokens holding this much probability (nucleus).
    #[arg(long, value_name = "P", default_value_t = 0.95)]
    pub top_p: f64,
    /// Seed of the sampling draws (the same seed repeats a generation).
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// The model (YAML spec, config.json or preset), when --from does not record it.
    #[arg(long, value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// Keep going after the tokenizer's end-of-text token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Also write the prompt's ids and the logits at every prompt position to this JSON
    /// file (`{"tokens": [...], "logits": [[...], ...]}`, f32 as computed), to hold them
    /// against another framework's.
    #[arg(long, value_name = "FILE")]
    pub logits: Option<PathBuf>,
}

fn refuse(path: &Path, msg: impl Into<String>, help: impl Into<String>) -> CliError {
    CliError::Input(SpecError::file(path, msg).help(help.into()))
}

/// The model of `from`: `--model`, a checkpoint's metadata, or the config.json of the HF
/// folder (or beside the file).
fn model_config(a: &GenerateArgs) -> Result<ModelConfig, CliError> {
    if let Some(m) = &a.model {
        return Ok(load_model(m)?.config);
    }
    if shardplan_executor::checkpoint::is_checkpoint(&a.from) {
        let (dir, warnings) = shardplan_executor::checkpoint::resolve(&a.from).map_err(exec)?;
        for w in warnings {
            eprintln!("warning: {w}");
        }
        return Ok(shardplan_executor::checkpoint::read_metadata(&dir).map_err(exec)?.model);
    }
    if !a.from.exists() {
        return Err(refuse(
            &a.from,
            "no such file or folder",
            "give a checkpoint folder, a Hugging Face model folder or a safetensors file",
        ));
    }
    let folder = if a.from.is_dir() {
        a.from.clone()
    } else {
        a.from.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    };
    let config = folder.join("config.json");
    if !config.is_file() {
        return Err(refuse(
            &config,
            "no such file: the model of the weights is unknown",
            "put the model's config.json there, or name the model with --model (a YAML spec, config.json or preset)",
        ));
    }
    Ok(load_model(&config)?.config)
}

fn exec(e: ExecError) -> CliError {
    match e {
        ExecError::Checkpoint(m) | ExecError::Data(m) | ExecError::Unsupported(m) => CliError::Usage(m),
        ExecError::Trace(t) => CliError::Usage(t.to_string()),
        other => CliError::Other(anyhow::Error::new(other)),
    }
}

pub fn run(a: &GenerateArgs) -> Result<(), CliError> {
    check_sampling(a)?;
    let tok = load_tokenizer(&a.tokenizer)?;
    let config = model_config(a)?;
    let shapes = param_shapes(&config).map_err(exec)?;
    check_vocab(a, &config, &tok)?;
    let started = std::time::Instant::now();
    let weights = shardplan_executor::checkpoint::read_weights(&a.from, &shapes).map_err(exec)?;
    let model = Model::new(config, weights).map_err(exec)?;
    let loaded = started.elapsed().as_secs_f64();
    let prompt = encode_prompt(a, &tok, &model)?;
    let stop: Vec<u32> = if a.ignore_eos {
        Vec::new()
    } else {
        ["<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"]
            .iter()
            .filter_map(|t| tok.token_to_id(t))
            .collect()
    };
    if let Some(path) = &a.logits {
        write_logits(path, &model, &prompt)?;
    }
    let sampling = Sampling {
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed,
    };
    crate::emit(&a.prompt)?;
    let start = std::time::Instant::now();
    let out = stream(&model, &tok, &prompt, &sampling, &stop)?;
    let secs = start.elapsed().as_secs_f64();
    crate::emit("\n")?;
    eprintln!(
        "{} prompt tokens, {} new tokens in {:.2} s ({:.1} tokens/s; weights loaded in {:.2} s)",
        prompt.len(),
        out.len(),
        secs,
        out.len() as f64 / secs.max(1e-9),
        loaded
    );
    Ok(())
}

/// Refuses a temperature, top-p or token count that cannot sample.
fn check_sampling(a: &GenerateArgs) -> Result<(), CliError> {
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        return Err(CliError::Usage(format!(
            "--temperature {}: give 0 (greedy) or a positive number, such as 0.8",
            a.temperature
        )));
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        return Err(CliError::Usage(format!(
            "--top-p {}: give a probability in (0, 1], such as 0.95",
            a.top_p
        )));
    }
    if a.max_new_tokens == 0 {
        return Err(CliError::Usage("--max-new-tokens 0: give at least 1".into()));
    }
    Ok(())
}

/// The Hugging Face tokenizer.json at `path`.
fn load_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer, CliError> {
    let raw = std::fs::read(path).map_err(|e| {
        refuse(
            path,
            format!("cannot read it: {e}"),
            "give the Hugging Face tokenizer.json the model was trained with",
        )
    })?;
    tokenizers::Tokenizer::from_bytes(&raw).map_err(|e| {
        refuse(
            path,
            format!("is not a tokenizer.json this build can load: {e}"),
            "give the tokenizer.json of a Hugging Face model (saved by `tokenizers` or transformers)",
        )
    })
}

/// Refuses a tokenizer with more tokens than the model's vocabulary: it was made for
/// another model.
fn check_vocab(a: &GenerateArgs, config: &ModelConfig, tok: &tokenizers::Tokenizer) -> Result<(), CliError> {
    let vocab = match config {
        ModelConfig::Llama(c) => c.vocab_size,
        ModelConfig::Gpt2(c) => c.vocab_size,
        ModelConfig::Mlp(_) => 0,
    };
    let tok_vocab = tok.get_vocab_size(true) as u64;
    if tok_vocab > vocab {
        return Err(refuse(
            &a.tokenizer,
            format!(
                "the tokenizer has {tok_vocab} tokens, more than the model's vocab_size of {vocab}: it was made for another model"
            ),
            "give the tokenizer the model was trained with (the one `shardplan data prepare` used)",
        ));
    }
    Ok(())
}

/// The prompt's ids, refused when empty or too long for the model's positions; a note
/// when the positions left cut the generation short.
fn encode_prompt(a: &GenerateArgs, tok: &tokenizers::Tokenizer, model: &Model) -> Result<Vec<u32>, CliError> {
    let prompt: Vec<u32> = tok
        .encode(a.prompt.as_str(), false)
        .map_err(|e| CliError::Usage(format!("--prompt: the tokenizer cannot encode it: {e}")))?
        .get_ids()
        .to_vec();
    if prompt.is_empty() {
        return Err(CliError::Usage(
            "--prompt: the text has no tokens; give some text to continue".into(),
        ));
    }
    let positions = model.max_positions();
    if prompt.len() as u64 >= positions {
        return Err(CliError::Usage(format!(
            "--prompt: {} tokens leave no room in the model's {positions} positions (max_position_embeddings); shorten it",
            prompt.len()
        )));
    }
    if prompt.len() as u64 + a.max_new_tokens > positions {
        eprintln!(
            "note: the model takes {positions} positions; generating at most {} tokens after the {}-token prompt",
            positions - prompt.len() as u64,
            prompt.len()
        );
    }
    Ok(prompt)
}

/// Writes the prompt's ids and the logits at every prompt position as JSON (`--logits`).
fn write_logits(path: &Path, model: &Model, prompt: &[u32]) -> Result<(), CliError> {
    let mut cache = shardplan_executor::infer::KvCache::default();
    let logits = model.forward(prompt, &mut cache).map_err(exec)?;
    let rows: Vec<Vec<f32>> = logits
        .to_vec2::<f32>()
        .map_err(|e| CliError::Other(anyhow::anyhow!("logits: {e}")))?;
    let json = serde_json::json!({"tokens": prompt, "logits": rows});
    std::fs::write(path, json.to_string())
        .map_err(|e| CliError::Usage(format!("--logits {}: cannot write it: {e}", path.display())))
}

/// Generates after `prompt`, printing the text as it grows; the new tokens.
fn stream(
    model: &Model,
    tok: &tokenizers::Tokenizer,
    prompt: &[u32],
    sampling: &Sampling,
    stop: &[u32],
) -> Result<Vec<u32>, CliError> {
    // Stream the text as it grows: decode everything so far and print what is new, holding
    // back a trailing replacement character (a byte-level token may end inside a character
    // that the next token completes).
    let mut ids = Vec::new();
    let mut shown = 0usize;
    let print_new = |text: &str, shown: &mut usize| {
        if text.len() > *shown && text.is_char_boundary(*shown) {
            let mut o = std::io::stdout().lock();
            let _ = o.write_all(&text.as_bytes()[*shown..]).and_then(|()| o.flush());
            *shown = text.len();
        }
    };
    let out = model
        .generate(prompt, sampling, stop, &mut |t| {
            ids.push(t);
            if let Ok(text) = tok.decode(&ids, true) {
                print_new(text.trim_end_matches('\u{FFFD}'), &mut shown);
            }
            Ok(())
        })
        .map_err(exec)?;
    if let Ok(text) = tok.decode(&out, true) {
        print_new(&text, &mut shown);
    }
    Ok(out)
}
