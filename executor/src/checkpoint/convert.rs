//! `shardplan checkpoint convert`: a checkpoint from shardplan's format, DCP or Hugging
//! Face safetensors (parameters only) into shardplan's format, DCP, or Hugging Face safetensors (parameters only, in shards of at
//! most 5 GB with `model.safetensors.index.json`, as `save_pretrained` writes them).
//!
//! The source is read one whole tensor at a time (every check a resume makes is made);
//! the output is written as one process would write it: one rank file or data file, then
//! its metadata last.

use super::dcp::{dcp_key, shardplan_name, write_whole_dcp};
use super::meta::{read_metadata, FileMeta, Metadata, TensorMeta, CHECKPOINT_FORMAT};
use super::{io, read_rows, resolve, write_entries, write_metadata_file, ExportDType};
use crate::ExecError;
use shardplan_dcp::pickle::Value;
use shardplan_dcp::Checkpoint;
use shardplan_models::ModelConfig;
use std::collections::HashMap;
use std::path::Path;

/// What a checkpoint is converted into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Shardplan,
    Dcp,
    HuggingFace,
}

/// The most bytes one Hugging Face shard holds (`save_pretrained`'s default, 5 GB).
const HF_SHARD_BYTES: u64 = 5_000_000_000;

/// A source checkpoint: its tensors by shardplan's names with their dims, what it records
/// of the run, and how to read each tensor whole.
struct Source {
    tensors: Vec<(String, Vec<u64>)>,
    step: u64,
    optimizer: String,
    optimizer_steps: u64,
    data_position: u64,
    seed: u64,
    model: Option<ModelConfig>,
    read: ReadWhole,
}

/// Reads tensor `name` (of dims `dims`) whole, as f32.
type ReadWhole = Box<super::dcp::ReadTensor<'static>>;

fn open(path: &Path) -> Result<Source, ExecError> {
    if !super::is_checkpoint(path) && !shardplan_dcp::is_checkpoint(path) {
        return open_hf(path);
    }
    let (dir, _) = resolve(path)?;
    if shardplan_dcp::is_checkpoint(&dir) {
        return open_dcp(&dir);
    }
    let meta = read_metadata(&dir)?;
    let tensors = meta.tensors.iter().map(|t| (t.name.clone(), t.shape.clone())).collect();
    let by_name: HashMap<String, TensorMeta> = meta.tensors.iter().map(|t| (t.name.clone(), t.clone())).collect();
    let mut headers = HashMap::new();
    Ok(Source {
        tensors,
        step: meta.step,
        optimizer: meta.optimizer.clone(),
        optimizer_steps: meta.optimizer_steps,
        data_position: meta.data_position,
        seed: meta.seed,
        model: Some(meta.model.clone()),
        read: Box::new(move |name, shape| {
            let t = &by_name[name];
            read_rows(&dir, t, 0..shape.first().copied().unwrap_or(1), &mut headers)
        }),
    })
}

/// Hugging Face weights: parameters only, a run not yet started.
fn open_hf(path: &Path) -> Result<Source, ExecError> {
    let tensors = super::hf::hf_tensors(path)?;
    let path = path.to_path_buf();
    Ok(Source {
        tensors,
        step: 0,
        optimizer: "none".into(),
        optimizer_steps: 0,
        data_position: 0,
        seed: 0,
        model: None,
        read: Box::new(move |name, dims| {
            let t = super::read_weights(&path, &[(name.to_string(), dims.to_vec())])?;
            let t = t
                .get(name)
                .ok_or_else(|| ExecError::Checkpoint(format!("{}: no tensor `{name}`", path.display())))?;
            Ok(t.flatten_all()?.to_vec1::<f32>()?)
        }),
    })
}

fn open_dcp(dir: &Path) -> Result<Source, ExecError> {
    let err = |e: shardplan_dcp::DcpError| ExecError::Checkpoint(e.to_string());
    let ck = Checkpoint::open(dir).map_err(err)?;
    let int = |key: &str| match ck.value(key) {
        Ok(Value::Int(i)) if i >= 0 => Some(i as u64),
        _ => None,
    };
    let step = int("train_state.step").unwrap_or(0);
    let model = match ck.value("shardplan.model") {
        Ok(Value::Str(json)) => Some(serde_json::from_str(&json).map_err(|e| {
            ExecError::Checkpoint(format!(
                "{}: key `shardplan.model` is not a model spec: {e}",
                dir.display()
            ))
        })?),
        _ => None,
    };
    let mut tensors = Vec::new();
    let mut adam = false;
    let mut optimizer_steps = None;
    for (key, entry) in &ck.metadata.entries {
        let shardplan_dcp::Entry::Tensor(t) = entry else {
            continue;
        };
        if key.starts_with("optimizer.state.") && key.ends_with(".step") {
            if optimizer_steps.is_none() {
                let s = ck.tensor(key).map_err(err)?;
                optimizer_steps = super::dcp::to_f32(&s)?.first().map(|&v| v as u64);
            }
            continue;
        }
        let Some(name) = shardplan_name(key) else { continue };
        adam |= name.starts_with("optim.exp_avg");
        tensors.push((name, t.size.iter().map(|&d| d as u64).collect()));
    }
    let data_position = int("dataloader.position").unwrap_or(0);
    let seed = int("shardplan.seed").unwrap_or(0);
    Ok(Source {
        tensors,
        step,
        optimizer: if adam { "adamw" } else { "sgd" }.to_string(),
        optimizer_steps: optimizer_steps.unwrap_or(step),
        data_position,
        seed,
        model,
        read: Box::new(move |name, _| super::dcp::to_f32(&ck.tensor(&dcp_key(name)).map_err(err)?)),
    })
}

/// Converts the checkpoint at `src` (a step folder, or the newest complete one under a
/// root) into `format` at `out` (a step folder; for Hugging Face, a folder of shards);
/// `dtype` is the Hugging Face files' element type. `progress(done, total)` is called
/// after each tensor. Returns the tensors written.
pub fn convert(
    src: &Path,
    format: Format,
    out: &Path,
    dtype: ExportDType,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<usize, ExecError> {
    let mut source = open(src)?;
    if out.exists()
        && std::fs::read_dir(out)
            .map_err(|e| io(out, "cannot list", e))?
            .next()
            .is_some()
    {
        return Err(ExecError::Checkpoint(format!(
            "{}: not empty; converting writes a new folder and overwrites nothing",
            out.display()
        )));
    }
    std::fs::create_dir_all(out).map_err(|e| io(out, "cannot create", e))?;
    match format {
        Format::Dcp => to_dcp(&mut source, out, progress),
        Format::Shardplan => to_shardplan(&mut source, out, progress),
        Format::HuggingFace => to_hf(&mut source, out, dtype, progress),
    }
}

fn to_dcp(s: &mut Source, out: &Path, progress: &mut dyn FnMut(usize, usize)) -> Result<usize, ExecError> {
    let mut values = vec![
        ("train_state.step".to_string(), Value::Int(s.step as i64)),
        ("lr_scheduler.last_epoch".to_string(), Value::Int(s.step as i64)),
        ("dataloader.position".to_string(), Value::Int(s.data_position as i64)),
        ("shardplan.seed".to_string(), Value::Int(s.seed as i64)),
    ];
    if let Some(m) = &s.model {
        let json = serde_json::to_string(m).map_err(|e| ExecError::Internal(e.to_string()))?;
        values.push(("shardplan.model".to_string(), Value::Str(json)));
    }
    let adam_steps = (s.optimizer == "adamw").then_some(s.optimizer_steps);
    let tensors = s.tensors.clone();
    write_whole_dcp(out, &tensors, &mut s.read, adam_steps, &values, progress)?;
    Ok(tensors.len())
}

fn to_shardplan(s: &mut Source, out: &Path, progress: &mut dyn FnMut(usize, usize)) -> Result<usize, ExecError> {
    let model = s.model.clone().ok_or_else(|| {
        ExecError::Checkpoint(
            "the source records no model spec (`shardplan.model`), which shardplan's format needs: torch, torchtitan or Hugging Face wrote it; convert it to `dcp` or `hf`, or use it as it is (`--resume` for a DCP checkpoint, `--init-from` for weights)".into(),
        )
    })?;
    let total = s.tensors.len();
    let tensors = s.tensors.clone();
    let mut entries = Vec::with_capacity(total);
    for (k, (name, dims)) in tensors.iter().enumerate() {
        let vals = (s.read)(name, dims)?;
        let rows = dims.first().copied().unwrap_or(1);
        let mut shape: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
        if shape.is_empty() {
            shape.push(1);
        }
        entries.push((name.clone(), 0..rows, vals, shape));
        progress(k + 1, total);
    }
    let (file, pieces): (FileMeta, Vec<(String, super::Piece)>) =
        write_entries(out, "rank-00000.safetensors", entries)?;
    let mut by_name: HashMap<String, super::Piece> = pieces.into_iter().collect();
    let tensors = tensors
        .into_iter()
        .map(|(name, shape)| TensorMeta {
            pieces: by_name.remove(&name).into_iter().collect(),
            name,
            shape,
            dtype: "F32".into(),
        })
        .collect();
    let meta = Metadata {
        format: CHECKPOINT_FORMAT,
        step: s.step,
        model,
        replicate: 1,
        shard: 1,
        optimizer: s.optimizer.clone(),
        optimizer_steps: s.optimizer_steps,
        data_position: s.data_position,
        seed: s.seed,
        tensors,
        files: vec![file],
    };
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    write_metadata_file(out, parent, &meta)?;
    Ok(total)
}

fn to_hf(
    s: &mut Source,
    out: &Path,
    dtype: ExportDType,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<usize, ExecError> {
    let params: Vec<(String, Vec<u64>)> = s
        .tensors
        .iter()
        .filter(|(n, _)| !n.starts_with("optim."))
        .cloned()
        .collect();
    let elem = match dtype {
        ExportDType::F32 => 4u64,
        _ => 2,
    };
    // Shards in the model's order, each up to HF_SHARD_BYTES (a larger tensor alone).
    let mut shards: Vec<Vec<(String, Vec<u64>)>> = vec![Vec::new()];
    let mut size = 0u64;
    for (name, dims) in params.iter().cloned() {
        let bytes = dims.iter().product::<u64>() * elem;
        if size > 0 && size + bytes > HF_SHARD_BYTES {
            shards.push(Vec::new());
            size = 0;
        }
        size += bytes;
        if let Some(v) = shards.last_mut() {
            v.push((name, dims));
        }
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut total_size = 0u64;
    let mut done = 0;
    for (i, shard) in shards.into_iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        let mut data = Vec::new();
        for (name, dims) in shard {
            let vals = (s.read)(&name, &dims)?;
            let bytes = super::hf::encode(&vals, dtype);
            total_size += bytes.len() as u64;
            weight_map.insert(name.clone(), serde_json::Value::String(file.clone()));
            data.push((name, bytes, dims.iter().map(|&d| d as usize).collect::<Vec<usize>>()));
            done += 1;
            progress(done, params.len());
        }
        super::hf::write_safetensors(&out.join(&file), &data, dtype)?;
    }
    let index = serde_json::json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
    let path = out.join("model.safetensors.index.json");
    let text = serde_json::to_string_pretty(&index).map_err(|e| ExecError::Internal(e.to_string()))?;
    std::fs::write(&path, text).map_err(|e| io(&path, "cannot write", e))?;
    Ok(params.len())
}
