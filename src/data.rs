//! `shardplan data prepare`: text files and JSON lines into the flat token files the
//! trainer reads (nanoGPT's layout: little-endian u16 or u32 ids, one stream of documents,
//! each followed by the end-of-document token).
//!
//! Documents are tokenized in parallel with a Hugging Face `tokenizer.json`; the stream's
//! last `--val-fraction` of tokens becomes `val.bin`, the rest `train.bin`; `manifest.json`
//! records the tokenizer's SHA-256, the counts and the throughput. Every input is untrusted:
//! a file that is not UTF-8, a JSON line that does not parse or lacks the field, and a
//! tokenizer that does not load are refused naming the file (and line or byte).

use crate::CliError;
use anyhow::Context;
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use shardplan_frontends::{Pos, SpecError};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Subcommand, Debug)]
pub enum DataCommand {
    /// Tokenize text files and JSON lines into train.bin / val.bin for `data: {tokens: ...}`.
    Prepare(PrepareArgs),
}

#[derive(Args, Debug)]
pub struct PrepareArgs {
    /// A Hugging Face tokenizer.json.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: PathBuf,
    /// Folder for train.bin, val.bin and manifest.json (created).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// The field of each JSON-lines object that holds a document's text. Inputs ending in
    /// .jsonl or .ndjson are JSON lines, one document per object; any other input is one
    /// document.
    #[arg(long, value_name = "NAME", default_value = "text")]
    pub field: String,
    /// Share of the token stream (its end) kept for validation.
    #[arg(long, value_name = "F", default_value_t = 0.01)]
    pub val_fraction: f64,
    /// The token that ends each document (default: the tokenizer's `<|endoftext|>`, `</s>`
    /// or `<eos>`, whichever it has).
    #[arg(long, value_name = "TOKEN")]
    pub eos: Option<String>,
    /// Text files or JSON-lines files.
    #[arg(required = true, value_name = "INPUT")]
    pub inputs: Vec<PathBuf>,
}

pub fn run(cmd: &DataCommand) -> Result<(), CliError> {
    match cmd {
        DataCommand::Prepare(a) => prepare(a),
    }
}

fn refuse(path: &Path, msg: impl Into<String>, help: &str) -> CliError {
    CliError::Input(SpecError::file(path, msg).help(help.to_string()))
}

/// The documents of one input.
fn documents(path: &Path, field: &str) -> Result<Vec<String>, CliError> {
    let bytes = std::fs::read(path).map_err(|e| {
        refuse(
            path,
            format!("cannot read it: {e}"),
            "give a readable text or JSON-lines file",
        )
    })?;
    let text = String::from_utf8(bytes).map_err(|e| {
        CliError::Input(
            SpecError::file(
                path,
                format!(
                    "is not UTF-8 text (invalid byte at offset {})",
                    e.utf8_error().valid_up_to()
                ),
            )
            .help("convert it to UTF-8 first (iconv -t UTF-8)"),
        )
    })?;
    let jsonl = path.extension().is_some_and(|e| e == "jsonl" || e == "ndjson");
    if !jsonl {
        return Ok(vec![text]);
    }
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = Some(Pos {
            line: i as u64 + 1,
            column: 1,
        });
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            CliError::Input(
                SpecError::file(path, format!("line {} is not JSON: {e}", i + 1))
                    .at(at)
                    .help("a JSON-lines file holds one JSON object per line"),
            )
        })?;
        match v.get(field) {
            Some(serde_json::Value::String(s)) => out.push(s.clone()),
            Some(other) => {
                return Err(CliError::Input(
                    SpecError::file(
                        path,
                        format!("line {}: `{field}` is {}, not a string", i + 1, kind(other)),
                    )
                    .at(at)
                    .field(field)
                    .help("--field names the string field that holds each document's text"),
                ))
            }
            None => {
                return Err(CliError::Input(
                    SpecError::file(path, format!("line {} has no `{field}` field", i + 1))
                        .at(at)
                        .field(field)
                        .help("name the text field with --field"),
                ))
            }
        }
    }
    Ok(out)
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// What `prepare` wrote, as `manifest.json` records it.
#[derive(serde::Serialize)]
struct Manifest {
    tokenizer: String,
    tokenizer_sha256: String,
    vocab_size: usize,
    dtype: &'static str,
    eos: Option<(String, u32)>,
    inputs: Vec<String>,
    documents: usize,
    train_tokens: u64,
    val_tokens: u64,
    seconds: f64,
    tokens_per_second: f64,
}

fn prepare(a: &PrepareArgs) -> Result<(), CliError> {
    if !(a.val_fraction >= 0.0 && a.val_fraction < 1.0) {
        return Err(CliError::Usage(format!(
            "--val-fraction {}: give a share in [0, 1), such as 0.01",
            a.val_fraction
        )));
    }
    let raw = std::fs::read(&a.tokenizer).map_err(|e| {
        refuse(
            &a.tokenizer,
            format!("cannot read it: {e}"),
            "give a Hugging Face tokenizer.json",
        )
    })?;
    let tok = tokenizers::Tokenizer::from_bytes(&raw).map_err(|e| {
        refuse(
            &a.tokenizer,
            format!("is not a tokenizer.json this build can load: {e}"),
            "give the tokenizer.json of a Hugging Face model (saved by `tokenizers` or transformers)",
        )
    })?;
    let vocab = tok.get_vocab_size(true);
    let dtype = if vocab <= 1 << 16 { "u16" } else { "u32" };
    let eos = match &a.eos {
        Some(t) => Some((
            t.clone(),
            tok.token_to_id(t).ok_or_else(|| {
                refuse(
                    &a.tokenizer,
                    format!("--eos `{t}` is not a token of this tokenizer"),
                    "name a token of its vocabulary, such as <|endoftext|> or </s>",
                )
            })?,
        )),
        None => ["<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"]
            .iter()
            .find_map(|t| tok.token_to_id(t).map(|id| (t.to_string(), id))),
    };
    let start = std::time::Instant::now();
    let mut docs: Vec<(usize, String)> = Vec::new();
    for (k, p) in a.inputs.iter().enumerate() {
        docs.extend(documents(p, &a.field)?.into_iter().map(|d| (k, d)));
    }
    let bar = ProgressBar::new(docs.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} tokenizing [{bar:30}] {pos}/{len} documents {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let encoded: Vec<Result<Vec<u32>, (usize, String)>> = docs
        .par_iter()
        .map(|(k, d)| {
            let r = tok
                .encode(d.as_str(), false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| (*k, e.to_string()));
            bar.inc(1);
            r
        })
        .collect();
    bar.finish_and_clear();
    let mut stream: Vec<u32> = Vec::new();
    for r in encoded {
        let ids = r.map_err(|(k, e)| {
            refuse(
                &a.inputs[k],
                format!("the tokenizer failed on a document: {e}"),
                "check the input's text",
            )
        })?;
        stream.extend(ids);
        if let Some((_, id)) = &eos {
            stream.push(*id);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let n = stream.len() as u64;
    let val = ((n as f64) * a.val_fraction).round() as u64;
    let (train, valid) = stream.split_at((n - val) as usize);
    std::fs::create_dir_all(&a.out).with_context(|| format!("cannot create {}", a.out.display()))?;
    write_tokens(&a.out.join("train.bin"), train, dtype)?;
    write_tokens(&a.out.join("val.bin"), valid, dtype)?;
    let manifest = Manifest {
        tokenizer: a.tokenizer.display().to_string(),
        tokenizer_sha256: Sha256::digest(&raw).iter().map(|b| format!("{b:02x}")).collect(),
        vocab_size: vocab,
        dtype,
        eos,
        inputs: a.inputs.iter().map(|p| p.display().to_string()).collect(),
        documents: docs.len(),
        train_tokens: train.len() as u64,
        val_tokens: valid.len() as u64,
        seconds,
        tokens_per_second: n as f64 / seconds.max(1e-9),
    };
    let text = serde_json::to_string_pretty(&manifest).context("serialising the manifest")? + "\n";
    std::fs::write(a.out.join("manifest.json"), text).context("writing manifest.json")?;
    eprintln!(
        "{} documents, {} tokens ({} train, {} validation) in {:.2} s ({:.0} tokens/s); {}",
        docs.len(),
        n,
        train.len(),
        valid.len(),
        seconds,
        manifest.tokens_per_second,
        a.out.display()
    );
    println!(
        "data: {{tokens: {}, dtype: {dtype}}}",
        a.out.join("train.bin").display()
    );
    Ok(())
}

fn write_tokens(path: &Path, ids: &[u32], dtype: &str) -> Result<(), CliError> {
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?,
    );
    for &id in ids {
        let r = if dtype == "u16" {
            f.write_all(&(id as u16).to_le_bytes())
        } else {
            f.write_all(&id.to_le_bytes())
        };
        r.with_context(|| format!("writing {}", path.display()))?;
    }
    f.flush().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
