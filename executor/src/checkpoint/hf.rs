//! Hugging Face safetensors in and out: `init_from` (pretrained weights into a run, each
//! rank reading only its rows), `read_weights` (whole tensors from a checkpoint or HF
//! files, for generation) and `export` (a checkpoint's parameters as one HF file).

use super::meta::dtype_size;
use super::read::{read_header, read_range, read_rows, to_f32, Header};
use super::{io, is_checkpoint, local_rows, read_metadata, resolve, whole_dims, TensorSource};
use crate::train::sharded::ShardedTrainer;
use crate::ExecError;
use candle_core::{Device, Tensor};
use shardplan_planner::chunk_rows;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

impl ShardedTrainer {
    /// Starts from pretrained weights in Hugging Face safetensors: one file, or a folder
    /// holding `model.safetensors` or shards listed by `model.safetensors.index.json`.
    /// Each rank reads only its rows; the optimizer starts fresh.
    pub fn init_from(&mut self, path: &Path) -> Result<(), ExecError> {
        if shardplan_dcp::is_checkpoint(path) {
            return self.init_from_dcp(path);
        }
        let mut source = SafetensorsSource::open(path)?;
        let names = self.param_names();
        let plan = &self.shared.plan;
        let mesh = plan.mesh;
        let g = &self.shared.joint.graph;
        let mut loaded = Vec::new();
        for rank in self.local_ranks() {
            let coords = mesh.coords(rank);
            let mut params = Vec::new();
            for grp in &plan.groups {
                let l = &grp.layout;
                let mut flat = vec![0f32; l.shard_numel as usize];
                for pl in &l.params {
                    let name = &names[self.whole.id(pl.param, mesh.expert_index(rank))];
                    let param = g.param(pl.param);
                    source.check_shape(name, &whole_dims(param))?;
                    let shard = mesh.shard_rank(rank, &grp.group);
                    let rows = chunk_rows(pl.dims.first().copied().unwrap_or(1), l.shard, shard);
                    if rows.is_empty() {
                        continue;
                    }
                    let vals = local_rows(param, coords.tensor, rows, &mut |r| source.rows(name, r))?;
                    let at = pl.shard_offset as usize;
                    flat[at..at + vals.len()].copy_from_slice(&vals);
                }
                params.push(Tensor::from_vec(flat, l.shard_numel as usize, &Device::Cpu)?);
            }
            loaded.push(params);
        }
        for (r, params) in self.ranks.iter_mut().zip(loaded) {
            r.params = params;
        }
        let device = self.device().clone();
        self.to_device(&device)
    }
}

/// Hugging Face safetensors as a [`TensorSource`]: one file, or a folder with
/// `model.safetensors` or shards listed by its index; each tensor's header checked once
/// against the model's shape, its rows read on demand.
pub(crate) struct SafetensorsSource {
    path: PathBuf,
    files: HashMap<String, PathBuf>,
    headers: HashMap<PathBuf, Header>,
}

impl SafetensorsSource {
    pub(crate) fn open(path: &Path) -> Result<Self, ExecError> {
        Ok(SafetensorsSource {
            path: path.to_path_buf(),
            files: hf_files(path)?,
            headers: HashMap::new(),
        })
    }

    /// The file holding `name`, its dtype, shape and byte range (the header read once).
    fn entry(&mut self, name: &str) -> Result<(PathBuf, String, Vec<u64>, u64, u64), ExecError> {
        let file = self
            .files
            .get(name)
            .or_else(|| self.files.get("*"))
            .cloned()
            .ok_or_else(|| {
                ExecError::Checkpoint(format!(
                    "{}: no tensor `{name}` (the index lists no file for it)",
                    self.path.display()
                ))
            })?;
        if !self.headers.contains_key(&file) {
            self.headers.insert(file.clone(), read_header(&file)?);
        }
        let (dtype, shape, begin, end) = self.headers[&file]
            .tensors
            .get(name)
            .cloned()
            .ok_or_else(|| ExecError::Checkpoint(format!("{}: no tensor `{name}`", file.display())))?;
        Ok((file, dtype, shape, begin, end))
    }
}

impl TensorSource for SafetensorsSource {
    fn check_shape(&mut self, name: &str, want: &[u64]) -> Result<(), ExecError> {
        let (file, dtype, shape, begin, end) = self.entry(name)?;
        if shape != want {
            return Err(ExecError::Checkpoint(format!(
                "{}: tensor `{name}` has shape {shape:?}, the model needs {want:?}",
                file.display(),
            )));
        }
        let size = dtype_size(&dtype).ok_or_else(|| {
            ExecError::Checkpoint(format!(
                "{}: tensor `{name}` is {dtype}; use F32, BF16 or F16",
                file.display()
            ))
        })?;
        let need = want
            .iter()
            .try_fold(size, |acc, &d| acc.checked_mul(d))
            .unwrap_or(u64::MAX);
        if need != end - begin {
            return Err(ExecError::Checkpoint(format!(
                "{}: tensor `{name}` holds {} bytes; shape {shape:?} of {dtype} needs {need}",
                file.display(),
                end - begin
            )));
        }
        Ok(())
    }

    fn rows(&mut self, name: &str, rows: std::ops::Range<u64>) -> Result<Vec<f32>, ExecError> {
        let (file, dtype, shape, begin, _) = self.entry(name)?;
        let size = dtype_size(&dtype).ok_or_else(|| ExecError::Checkpoint(format!("{name}: dtype {dtype}")))?;
        let row_bytes = shape.iter().skip(1).product::<u64>() * size;
        let bytes = read_range(
            &file,
            begin + rows.start * row_bytes,
            (rows.end - rows.start) * row_bytes,
            name,
        )?;
        to_f32(&bytes, &dtype).ok_or_else(|| ExecError::Checkpoint(format!("{name}: dtype {dtype}")))
    }
}

/// Whole tensors `wanted` (name, shape) as f32, from a shardplan checkpoint (a root or a
/// `step-N` folder: every tensor assembled from the rank files, checksums checked) or from
/// Hugging Face safetensors (one file, or a folder with `model.safetensors` or an index).
/// Errors name the file and the tensor.
pub fn read_weights(path: &Path, wanted: &[(String, Vec<u64>)]) -> Result<HashMap<String, Tensor>, ExecError> {
    let mut out = HashMap::with_capacity(wanted.len());
    if is_checkpoint(path) || shardplan_dcp::is_checkpoint(path) {
        let (dir, _) = resolve(path)?;
        if shardplan_dcp::is_checkpoint(&dir) {
            return read_dcp_weights(&dir, wanted);
        }
        let meta = read_metadata(&dir)?;
        let mut headers = HashMap::new();
        for (name, shape) in wanted {
            let t = meta.tensors.iter().find(|t| &t.name == name).ok_or_else(|| {
                ExecError::Checkpoint(format!("{}: the checkpoint has no tensor `{name}`", dir.display()))
            })?;
            if &t.shape != shape {
                return Err(ExecError::Checkpoint(format!(
                    "{}: tensor `{name}` has shape {:?}, the model needs {shape:?}",
                    dir.display(),
                    t.shape
                )));
            }
            let vals = read_rows(&dir, t, 0..shape.first().copied().unwrap_or(1), &mut headers)?;
            let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
            out.insert(name.clone(), Tensor::from_vec(vals, dims, &Device::Cpu)?);
        }
        return Ok(out);
    }
    let files = hf_files(path)?;
    let mut headers: HashMap<PathBuf, Header> = HashMap::new();
    for (name, shape) in wanted {
        let file = files.get(name).or_else(|| files.get("*")).ok_or_else(|| {
            ExecError::Checkpoint(format!(
                "{}: no tensor `{name}` (the index lists no file for it)",
                path.display()
            ))
        })?;
        if !headers.contains_key(file) {
            headers.insert(file.clone(), read_header(file)?);
        }
        let (dtype, got, begin, end) = headers[file]
            .tensors
            .get(name)
            .cloned()
            .ok_or_else(|| ExecError::Checkpoint(format!("{}: no tensor `{name}`", file.display())))?;
        if &got != shape {
            return Err(ExecError::Checkpoint(format!(
                "{}: tensor `{name}` has shape {got:?}, the model needs {shape:?}",
                file.display()
            )));
        }
        let size = dtype_size(&dtype).ok_or_else(|| {
            ExecError::Checkpoint(format!(
                "{}: tensor `{name}` is {dtype}; use F32, BF16 or F16",
                file.display()
            ))
        })?;
        let numel: u64 = shape.iter().product();
        if end - begin != numel * size {
            return Err(ExecError::Checkpoint(format!(
                "{}: tensor `{name}` holds {} bytes; shape {shape:?} of {dtype} needs {}",
                file.display(),
                end - begin,
                numel * size
            )));
        }
        let bytes = read_range(file, begin, end - begin, name)?;
        let vals = to_f32(&bytes, &dtype).expect("dtype checked above");
        let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        out.insert(name.clone(), Tensor::from_vec(vals, dims, &Device::Cpu)?);
    }
    Ok(out)
}

/// Whole tensors `wanted` from a DCP checkpoint folder (its parameters are under their
/// Hugging Face names), as f32.
fn read_dcp_weights(dir: &Path, wanted: &[(String, Vec<u64>)]) -> Result<HashMap<String, Tensor>, ExecError> {
    let ck = shardplan_dcp::Checkpoint::open(dir).map_err(|e| ExecError::Checkpoint(e.to_string()))?;
    let mut out = HashMap::with_capacity(wanted.len());
    for (name, shape) in wanted {
        let t = ck
            .tensor_entry(name)
            .map_err(|e| ExecError::Checkpoint(e.to_string()))?;
        if t.size.iter().map(|&d| d as u64).ne(shape.iter().copied()) {
            return Err(ExecError::Checkpoint(format!(
                "{}: key `{name}` has size {:?}, the model needs {shape:?}",
                dir.display(),
                t.size
            )));
        }
        let data = ck.tensor(name).map_err(|e| ExecError::Checkpoint(e.to_string()))?;
        let vals = super::dcp::to_f32(&data)?;
        let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        out.insert(name.clone(), Tensor::from_vec(vals, dims, &Device::Cpu)?);
    }
    Ok(out)
}

/// Every tensor of a Hugging Face checkpoint (a safetensors file, or a folder with
/// `model.safetensors` or an index) with its shape, by name.
pub(crate) fn hf_tensors(path: &Path) -> Result<Vec<(String, Vec<u64>)>, ExecError> {
    let mut files: Vec<PathBuf> = hf_files(path)?.into_values().collect();
    files.sort();
    files.dedup();
    let mut out = Vec::new();
    for f in files {
        for (name, (_, shape, _, _)) in read_header(&f)?.tensors {
            out.push((name, shape));
        }
    }
    out.sort();
    Ok(out)
}

/// Which file holds each tensor of a Hugging Face checkpoint (`"*"`: one file holds all).
fn hf_files(path: &Path) -> Result<HashMap<String, PathBuf>, ExecError> {
    let mut out = HashMap::new();
    if path.is_file() {
        out.insert("*".to_string(), path.to_path_buf());
        return Ok(out);
    }
    let index = path.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| io(&index, "cannot read", e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ExecError::Checkpoint(format!("{}:{}:{}: {e}", index.display(), e.line(), e.column())))?;
        let map = v["weight_map"]
            .as_object()
            .ok_or_else(|| ExecError::Checkpoint(format!("{}: no `weight_map` object", index.display())))?;
        for (k, f) in map {
            let f = f.as_str().ok_or_else(|| {
                ExecError::Checkpoint(format!("{}: weight_map.{k} is not a file name", index.display()))
            })?;
            out.insert(k.clone(), path.join(f));
        }
        return Ok(out);
    }
    let single = path.join("model.safetensors");
    if single.is_file() {
        out.insert("*".to_string(), single);
        return Ok(out);
    }
    Err(ExecError::Checkpoint(format!(
        "{}: not a safetensors file, nor a folder with model.safetensors or model.safetensors.index.json",
        path.display()
    )))
}

/// The element type of an exported file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportDType {
    F32,
    Bf16,
    F16,
}

/// Writes the parameters of the checkpoint at `path` as one safetensors file with Hugging
/// Face names, in `dtype` (bf16 and f16 round to nearest even). Returns the number of
/// tensors written.
pub fn export(path: &Path, out: &Path, dtype: ExportDType) -> Result<usize, ExecError> {
    let (dir, _) = resolve(path)?;
    let meta = read_metadata(&dir)?;
    let mut headers = HashMap::new();
    let mut data: Vec<(String, Vec<u8>, Vec<usize>)> = Vec::new();
    for t in meta.tensors.iter().filter(|t| !t.name.starts_with("optim.")) {
        let rows = t.shape.first().copied().unwrap_or(1);
        let vals = read_rows(&dir, t, 0..rows, &mut headers)?;
        data.push((
            t.name.clone(),
            encode(&vals, dtype),
            t.shape.iter().map(|&d| d as usize).collect(),
        ));
    }
    write_safetensors(out, &data, dtype)?;
    Ok(data.len())
}

/// `vals` in `dtype`'s bytes (bf16 and f16 rounded to nearest even).
pub(crate) fn encode(vals: &[f32], dtype: ExportDType) -> Vec<u8> {
    match dtype {
        ExportDType::F32 => vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ExportDType::Bf16 => vals
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect(),
        ExportDType::F16 => vals
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
    }
}

/// Writes `data` (name, bytes in `dtype`, dims) as the safetensors file `out` (through a
/// temporary name).
pub(crate) fn write_safetensors(
    out: &Path,
    data: &[(String, Vec<u8>, Vec<usize>)],
    dtype: ExportDType,
) -> Result<(), ExecError> {
    let st_dtype = match dtype {
        ExportDType::F32 => safetensors::Dtype::F32,
        ExportDType::Bf16 => safetensors::Dtype::BF16,
        ExportDType::F16 => safetensors::Dtype::F16,
    };
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(name, bytes, dims)| {
            safetensors::tensor::TensorView::new(st_dtype, dims.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| ExecError::Internal(format!("{name}: {e}")))
        })
        .collect::<Result<_, _>>()?;
    let mut info = HashMap::new();
    info.insert("format".to_string(), "pt".to_string());
    let tmp = out.with_extension("safetensors.tmp");
    safetensors::serialize_to_file(views, Some(info), &tmp)
        .map_err(|e| ExecError::Checkpoint(format!("{}: {e}", tmp.display())))?;
    std::fs::rename(&tmp, out).map_err(|e| io(out, "rename", e))
}
