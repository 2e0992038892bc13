//! `shardplan train`'s checkpoints in torch.distributed.checkpoint's format (DCP), laid
//! out as torchtitan lays its own: `step-N/` with `.metadata` and one
//! `__{rank}_0.distcp` a writing rank; each parameter at the top level under its
//! Hugging Face name; AdamW's moments as `optimizer.state.<name>.{exp_avg,exp_avg_sq}`
//! with the step count as `optimizer.state.<name>.step` (torch's flattened optimizer
//! state dict), the hyperparameters as `optimizer.param_groups.<name>.<field>`;
//! `train_state.step`, `lr_scheduler.last_epoch`, and what torch has no key for under
//! `dataloader.position` (micro-batches consumed) and `shardplan.*` (the model spec and
//! seed, so a resume checks it continues the same model).
//!
//! Each rank writes the rows of every tensor it owns (its dim-0 shard) as one chunk at
//! their offset, so a load on any mesh reads the rows it needs from the chunks that hold
//! them; tensor- and expert-parallel runs write whole tensors' rows per shard rank, as in
//! shardplan's own format.

use super::names::{meta_row, rotary_rows, torchtitan_name, CheckpointNames};
use super::{prepare_step_dir, rank_buffers, rank_entries, Entry, Loaded, TensorSource};
use crate::runtime::optim::state_names;
use crate::train::sharded::ShardedTrainer;
use crate::ExecError;
use shardplan_dcp::pickle::Value;
use shardplan_dcp::{Checkpoint, Chunk, DType, DataFile, Metadata, StorageInfo, TensorData, TensorEntry};
use shardplan_frontends::Optimizer;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The DCP key of a checkpoint tensor: a parameter keeps its name; an optimizer state
/// `optim.<state>.<name>` becomes `optimizer.state.<name>.<torch's state name>`.
pub fn dcp_key(name: &str) -> String {
    for (prefix, field) in [
        ("optim.exp_avg.", "exp_avg"),
        ("optim.exp_avg_sq.", "exp_avg_sq"),
        ("optim.momentum.", "momentum_buffer"),
    ] {
        if let Some(param) = name.strip_prefix(prefix) {
            return format!("optimizer.state.{param}.{field}");
        }
    }
    name.to_string()
}

/// The checkpoint tensor name of DCP key `key` (the inverse of [`dcp_key`]); `None` for
/// what is not a parameter or optimizer state (AdamW's step counts, values).
pub(crate) fn shardplan_name(key: &str) -> Option<String> {
    if let Some(rest) = key.strip_prefix("optimizer.state.") {
        for (suffix, state) in [
            (".exp_avg_sq", "optim.exp_avg_sq"),
            (".exp_avg", "optim.exp_avg"),
            (".momentum_buffer", "optim.momentum"),
        ] {
            if let Some(param) = rest.strip_suffix(suffix) {
                return Some(format!("{state}.{param}"));
            }
        }
        return None;
    }
    let values = [
        "optimizer.",
        "train_state.",
        "lr_scheduler.",
        "dataloader.",
        "shardplan.",
    ];
    (!values.iter().any(|v| key.starts_with(v))).then(|| key.to_string())
}

/// AdamW's step count of parameter `name` as torch keeps it (a 0-d f32 tensor), with its
/// DCP key and chunk.
pub(crate) fn dcp_step_tensor(name: &str, steps: u64) -> (String, Chunk, TensorData) {
    let data = TensorData {
        dtype: DType::F32,
        shape: vec![],
        bytes: (steps as f32).to_le_bytes().to_vec(),
    };
    (format!("optimizer.state.{name}.step"), Chunk::whole(&[]), data)
}

/// Each key's path in the nested state dict torchtitan flattens (`planner_data`): a
/// parameter is a key of its own, the rest sit under their first segment.
pub(crate) fn path_of(key: &str) -> Vec<String> {
    match key.split_once('.') {
        Some((top @ ("optimizer" | "train_state" | "lr_scheduler" | "dataloader" | "shardplan"), rest)) => {
            vec![top.to_string(), rest.to_string()]
        }
        _ => vec![key.to_string()],
    }
}

fn dcp_err(e: shardplan_dcp::DcpError) -> ExecError {
    ExecError::Checkpoint(e.to_string())
}

/// One saved chunk as the writing processes report it to the one writing `.metadata`.
type Record = (String, Chunk, StorageInfo);

fn encode(records: &[Record]) -> Vec<u8> {
    let v: Vec<serde_json::Value> = records
        .iter()
        .map(|(k, c, i)| serde_json::json!([k, c.offsets, c.sizes, i.file, i.offset, i.length, i.transforms]))
        .collect();
    serde_json::to_vec(&v).unwrap_or_default()
}

fn decode(bytes: &[u8]) -> Result<Vec<Record>, ExecError> {
    type Raw = (String, Vec<usize>, Vec<usize>, String, u64, u64, Vec<String>);
    let raw: Vec<Raw> = serde_json::from_slice(bytes)
        .map_err(|e| ExecError::Internal(format!("checkpoint chunks from another process: {e}")))?;
    Ok(raw
        .into_iter()
        .map(|(k, offsets, sizes, file, offset, length, transforms)| {
            let info = StorageInfo {
                file,
                offset,
                length,
                transforms,
            };
            (k, Chunk { offsets, sizes }, info)
        })
        .collect())
}

impl ShardedTrainer {
    /// Saves a DCP checkpoint of the current step under `root` (`step-N/`); returns its
    /// folder.
    pub fn save_dcp(&mut self, root: &Path) -> Result<PathBuf, ExecError> {
        let step = self.step;
        let prepared = prepare_step_dir(root, &format!("step-{step}"), self.is_leader());
        let dir = root.join(format!("step-{step}"));
        if !self.all_ok(prepared.is_ok())? {
            prepared?;
            return Err(ExecError::Checkpoint(format!(
                "{}: another process could not prepare the save",
                dir.display()
            )));
        }
        let written = self.write_dcp_files(&dir);
        if !self.all_ok(written.is_ok())? {
            written?;
            return Err(ExecError::Checkpoint(format!(
                "{}: another process failed to write its data file; no .metadata written, the folder is not loadable",
                dir.display()
            )));
        }
        let mut records = Vec::new();
        for bytes in self.gather_bytes(encode(&written?))? {
            records.extend(decode(&bytes)?);
        }
        let meta = match self.is_leader() {
            true => self.write_dcp_metadata(&dir, records),
            false => Ok(()),
        };
        if !self.all_ok(meta.is_ok())? {
            meta?;
            return Err(ExecError::Checkpoint(format!(
                "{}: the leader could not write .metadata; the folder is not loadable",
                dir.display()
            )));
        }
        Ok(dir)
    }

    /// This process's data files: one a writing rank (replica 0), or under tensor or
    /// expert parallelism one a shard rank, all from this process; the leader's first
    /// also holds the values. Returns where every chunk and value went.
    fn write_dcp_files(&self, dir: &Path) -> Result<Vec<Record>, ExecError> {
        std::fs::create_dir_all(dir).map_err(|e| super::io(dir, "cannot create", e))?;
        let plan = &self.shared.plan;
        let mesh = plan.mesh;
        let by_file: Vec<(usize, Vec<Entry>)> = if mesh.tensor() > 1 || mesh.expert() > 1 {
            if self.processes.is_some() {
                return Err(ExecError::Unsupported(format!(
                    "{}: a tensor- or expert-parallel run's checkpoint is put together by one process holding every rank; run it as threads (`--backend local`) to save",
                    dir.display()
                )));
            }
            self.whole_rows()?.into_iter().enumerate().collect()
        } else {
            let names = self.param_names();
            let states = state_names(&self.config.optimizer);
            self.ranks
                .iter()
                .filter(|r| mesh.coords(r.rank).replicate == 0)
                .map(|r| {
                    let groups = rank_buffers(r, states.len());
                    Ok((r.rank as usize, rank_entries(plan, r.rank, &names, states, &groups)?))
                })
                .collect::<Result<_, ExecError>>()?
        };
        let mut records = Vec::new();
        for (i, (file, entries)) in by_file.into_iter().enumerate() {
            let mut f = DataFile::create(dir, file, false).map_err(dcp_err)?;
            let mut chunks = Vec::new();
            for (name, rows, vals, dims) in entries {
                let mut offsets = vec![0; dims.len()];
                offsets[0] = rows.start as usize;
                let chunk = Chunk {
                    offsets,
                    sizes: dims.clone(),
                };
                let bytes = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
                let data = TensorData {
                    dtype: DType::F32,
                    shape: dims,
                    bytes,
                };
                let key = dcp_key(&name);
                f.tensor(&key, &chunk, &data).map_err(dcp_err)?;
                chunks.push((key, chunk));
            }
            if i == 0 && self.is_leader() {
                for (key, chunk, data) in self.step_tensors() {
                    f.tensor(&key, &chunk, &data).map_err(dcp_err)?;
                    chunks.push((key, chunk));
                }
                for (key, v) in self.dcp_values()? {
                    f.value(&key, &v).map_err(dcp_err)?;
                }
            }
            let mut placed: HashMap<(String, Option<Vec<usize>>), StorageInfo> =
                f.finish().map_err(dcp_err)?.into_iter().collect();
            for (key, chunk) in chunks {
                if let Some(info) = placed.remove(&(key.clone(), Some(chunk.offsets.clone()))) {
                    records.push((key, chunk, info));
                }
            }
            // What is left are the values (no chunk).
            for ((key, _), info) in placed {
                records.push((key, Chunk::whole(&[]), info));
            }
        }
        Ok(records)
    }

    /// AdamW's step count per parameter, as torch keeps it: a 0-d f32 tensor.
    fn step_tensors(&self) -> Vec<(String, Chunk, TensorData)> {
        if !matches!(self.config.optimizer, Optimizer::AdamW { .. }) {
            return Vec::new();
        }
        let steps = self.ranks[0].opt.first().map_or(0, |o| o.steps);
        self.whole_tensors()
            .into_iter()
            .filter(|(name, _)| !name.starts_with("optim."))
            .map(|(name, _)| dcp_step_tensor(&name, steps))
            .collect()
    }

    /// The values a checkpoint holds besides its tensors.
    fn dcp_values(&self) -> Result<Vec<(String, Value)>, ExecError> {
        let params: Vec<String> = self
            .whole_tensors()
            .into_iter()
            .filter(|(n, _)| !n.starts_with("optim."))
            .map(|(n, _)| n)
            .collect();
        let run = RunState {
            step: self.step,
            optimizer_steps: 0,
            position: Some(self.data[0].position()),
        };
        run_values(&run, &self.model, &self.config, &params)
    }

    /// `.metadata` from every process's records: each tensor with its chunks, each value.
    fn write_dcp_metadata(&self, dir: &Path, records: Vec<Record>) -> Result<(), ExecError> {
        let mut chunks: HashMap<String, Vec<Chunk>> = HashMap::new();
        let mut storage = HashMap::new();
        let mut values = Vec::new();
        let tensors: std::collections::HashSet<String> = self
            .whole_tensors()
            .into_iter()
            .map(|(n, _)| dcp_key(&n))
            .chain(self.step_tensors().into_iter().map(|(k, _, _)| k))
            .collect();
        for (key, chunk, info) in records {
            if tensors.contains(&key) {
                storage.insert((key.clone(), Some(chunk.offsets.clone())), info);
                chunks.entry(key).or_default().push(chunk);
            } else {
                storage.insert((key.clone(), None), info);
                values.push(key);
            }
        }
        let mut entries = Vec::new();
        let whole = self.whole_tensors().into_iter().map(|(n, d)| (dcp_key(&n), d));
        let steps = self.step_tensors().into_iter().map(|(k, _, _)| (k, vec![]));
        for (key, dims) in whole.chain(steps) {
            let mut cs = chunks.remove(&key).unwrap_or_default();
            cs.sort_by(|a, b| a.offsets.cmp(&b.offsets));
            let entry = TensorEntry {
                dtype: DType::F32,
                size: dims.iter().map(|&d| d as usize).collect(),
                chunks: cs,
            };
            entries.push((key, shardplan_dcp::Entry::Tensor(entry)));
        }
        values.sort();
        entries.extend(values.into_iter().map(|k| (k, shardplan_dcp::Entry::Bytes)));
        let paths = entries.iter().map(|(k, _)| (k.clone(), path_of(k))).collect();
        let md = Metadata {
            entries,
            storage,
            paths,
        };
        shardplan_dcp::write_metadata(dir, &md).map_err(|e| {
            ExecError::Internal(format!(
                "{}: the checkpoint's own metadata fails its check: {e}; no .metadata written",
                dir.display()
            ))
        })
    }

    /// Starts from the parameters of the DCP checkpoint in `dir` (its optimizer state and
    /// step are not read: a new run).
    pub(crate) fn init_from_dcp(&mut self, dir: &Path) -> Result<(), ExecError> {
        let ck = Checkpoint::open(dir).map_err(dcp_err)?;
        let absent = vec![true; state_names(&self.config.optimizer).len()];
        let mut source = DcpSource::new(&ck, self.checkpoint_names, &self.model);
        let loaded = self.read_local(&mut source, &absent)?;
        for (r, (params, _)) in self.ranks.iter_mut().zip(loaded) {
            r.params = params;
        }
        let device = self.device().clone();
        self.to_device(&device)
    }

    /// Loads the DCP checkpoint in `dir` into this trainer's mesh. Returns warnings.
    pub(crate) fn load_dcp(&mut self, dir: &Path) -> Result<Vec<String>, ExecError> {
        let ck = Checkpoint::open(dir).map_err(dcp_err)?;
        let first = self.whole_tensors().into_iter().next().map(|(n, _)| n);
        let (run, mut warnings) = read_run_state(&ck, &self.model, first.as_deref())?;
        // A run with SGD momentum 0 keeps no momentum buffers: they start at zero.
        let lacks = |s: &str| {
            first
                .as_ref()
                .is_some_and(|n| ck.metadata.entry(&dcp_key(&format!("{s}.{n}"))).is_none())
        };
        let absent: Vec<bool> = state_names(&self.config.optimizer)
            .iter()
            .map(|&s| s == "optim.momentum" && lacks(s))
            .collect();
        let mut source = DcpSource::new(&ck, self.checkpoint_names, &self.model);
        let loaded: Loaded = self.read_local(&mut source, &absent)?;
        let position = run.position.unwrap_or_else(|| {
            warnings.push(format!(
                "{}: no `dataloader.position`: the data continues from step {} of this run's batch",
                dir.display(),
                run.step
            ));
            run.step * self.shared.plan.policy.grad_accum
        });
        for (r, (params, st)) in self.ranks.iter_mut().zip(loaded) {
            r.params = params;
            for (gi, o) in r.opt.iter_mut().enumerate() {
                o.steps = run.optimizer_steps;
                for (k, s) in st.iter().enumerate() {
                    o.set_state(k, 0, s[gi].clone());
                }
            }
        }
        for d in &mut self.data {
            d.seek(position);
        }
        self.step = run.step;
        let device = self.device().clone();
        self.to_device(&device)?;
        Ok(warnings)
    }
}

/// Reads a checkpoint tensor whole, as f32, given its name and dims.
pub(crate) type ReadTensor<'a> = dyn FnMut(&str, &[u64]) -> Result<Vec<f32>, ExecError> + 'a;

/// Writes a DCP checkpoint in `dir` from one process: `tensors` (by checkpoint name, with
/// their dims) each whole, read by `read` in turn (`progress(done, total)` after each),
/// AdamW's step tensors when `adam_steps` is given, and `values`; `.metadata` last.
pub(crate) fn write_whole_dcp(
    dir: &Path,
    tensors: &[(String, Vec<u64>)],
    read: &mut ReadTensor<'_>,
    adam_steps: Option<u64>,
    values: &[(String, Value)],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(), ExecError> {
    let mut f = DataFile::create(dir, 0, false).map_err(dcp_err)?;
    let mut entries = Vec::new();
    for (k, (name, dims)) in tensors.iter().enumerate() {
        let vals = read(name, dims)?;
        let shape: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
        let data = TensorData {
            dtype: DType::F32,
            shape: shape.clone(),
            bytes: vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        let chunk = Chunk::whole(&shape);
        f.tensor(&dcp_key(name), &chunk, &data).map_err(dcp_err)?;
        entries.push((dcp_key(name), shape, chunk));
        progress(k + 1, tensors.len());
    }
    if let Some(steps) = adam_steps {
        for (name, _) in tensors.iter().filter(|(n, _)| !n.starts_with("optim.")) {
            let (key, chunk, data) = dcp_step_tensor(name, steps);
            f.tensor(&key, &chunk, &data).map_err(dcp_err)?;
            entries.push((key, vec![], chunk));
        }
    }
    for (key, v) in values {
        f.value(key, v).map_err(dcp_err)?;
    }
    let storage = f.finish().map_err(dcp_err)?.into_iter().collect();
    let mut md_entries: Vec<(String, shardplan_dcp::Entry)> = entries
        .into_iter()
        .map(|(key, size, chunk)| {
            let t = TensorEntry {
                dtype: DType::F32,
                size,
                chunks: vec![chunk],
            };
            (key, shardplan_dcp::Entry::Tensor(t))
        })
        .collect();
    md_entries.extend(values.iter().map(|(k, _)| (k.clone(), shardplan_dcp::Entry::Bytes)));
    let paths = md_entries.iter().map(|(k, _)| (k.clone(), path_of(k))).collect();
    let md = Metadata {
        entries: md_entries,
        storage,
        paths,
    };
    shardplan_dcp::write_metadata(dir, &md).map_err(dcp_err)
}

/// What a checkpoint records of its run besides the tensors.
pub(crate) struct RunState {
    pub(crate) step: u64,
    pub(crate) optimizer_steps: u64,
    /// Micro-batches consumed (`None`: a checkpoint without `dataloader.position`).
    pub(crate) position: Option<u64>,
}

/// The run values of a checkpoint: its step, data position, model spec and seed, and
/// each parameter's optimizer hyperparameters.
pub(crate) fn run_values(
    run: &RunState,
    model: &shardplan_models::ModelConfig,
    config: &shardplan_frontends::ParallelConfig,
    params: &[String],
) -> Result<Vec<(String, Value)>, ExecError> {
    let spec = serde_json::to_string(model).map_err(|e| ExecError::Internal(e.to_string()))?;
    let int = |v: u64| Value::Int(v as i64);
    let mut out = vec![
        ("train_state.step".to_string(), int(run.step)),
        ("lr_scheduler.last_epoch".to_string(), int(run.step)),
        ("shardplan.model".to_string(), Value::Str(spec)),
        ("shardplan.seed".to_string(), int(config.seed)),
    ];
    if let Some(p) = run.position {
        out.push(("dataloader.position".to_string(), int(p)));
    }
    let groups: Vec<(&str, Value)> = match config.optimizer {
        Optimizer::AdamW {
            lr,
            betas,
            eps,
            weight_decay,
        } => vec![
            ("lr", Value::Float(lr)),
            (
                "betas",
                Value::Tuple(vec![Value::Float(betas[0]), Value::Float(betas[1])]),
            ),
            ("eps", Value::Float(eps)),
            ("weight_decay", Value::Float(weight_decay)),
        ],
        Optimizer::Sgd {
            lr,
            momentum,
            weight_decay,
        } => vec![
            ("lr", Value::Float(lr)),
            ("momentum", Value::Float(momentum)),
            ("weight_decay", Value::Float(weight_decay)),
        ],
    };
    for name in params {
        for (field, v) in &groups {
            out.push((format!("optimizer.param_groups.{name}.{field}"), v.clone()));
        }
    }
    Ok(out)
}

/// A checkpoint's run state, its model checked against `model` (a checkpoint without
/// `shardplan.model` is said to be checked by its tensors only); the optimizer steps are
/// AdamW's count of parameter `first`, else the step. Returns warnings with it.
pub(crate) fn read_run_state(
    ck: &Checkpoint,
    model: &shardplan_models::ModelConfig,
    first: Option<&str>,
) -> Result<(RunState, Vec<String>), ExecError> {
    let dir = ck.dir();
    let mut warnings = Vec::new();
    match ck.value("shardplan.model") {
        Ok(Value::Str(json)) => {
            let written: shardplan_models::ModelConfig = serde_json::from_str(&json).map_err(|e| {
                ExecError::Checkpoint(format!("{}: key `shardplan.model` is not a model spec: {e}", dir.display()))
            })?;
            if let Some(e) = super::model_mismatch(dir, &written, model) {
                return Err(e);
            }
        }
        _ => warnings.push(format!(
            "{}: not written by shardplan (no `shardplan.model`): the model is checked by its tensors' names and shapes only",
            dir.display()
        )),
    }
    let int = |key: &str| match ck.value(key) {
        Ok(Value::Int(i)) if i >= 0 => Some(i as u64),
        _ => None,
    };
    let step = int("train_state.step").ok_or_else(|| {
        ExecError::Checkpoint(format!(
            "{}: key `train_state.step` is missing or not a step count",
            dir.display()
        ))
    })?;
    let optimizer_steps = first
        .and_then(|name| ck.tensor(&format!("optimizer.state.{name}.step")).ok())
        .and_then(|t| to_f32(&t).ok())
        .and_then(|v| v.first().copied())
        .map_or(step, |s| s as u64);
    let run = RunState {
        step,
        optimizer_steps,
        position: int("dataloader.position"),
    };
    Ok((run, warnings))
}

/// A DCP checkpoint's tensors, by shardplan's names (the checkpoint's own under `names`).
pub(crate) struct DcpSource<'a> {
    ck: &'a Checkpoint,
    names: CheckpointNames,
    model: &'a shardplan_models::ModelConfig,
}

impl<'a> DcpSource<'a> {
    pub(crate) fn new(ck: &'a Checkpoint, names: CheckpointNames, model: &'a shardplan_models::ModelConfig) -> Self {
        DcpSource { ck, names, model }
    }

    /// The key of checkpoint tensor `name`, and, when its rows are in Meta's rotary layout,
    /// its heads' row count.
    fn key(&self, name: &str) -> (String, Option<usize>) {
        if self.names == CheckpointNames::HuggingFace {
            return (dcp_key(name), None);
        }
        let (state, param) = match name.strip_prefix("optim.") {
            Some(rest) => match rest.split_once('.') {
                Some((state, param)) => (Some(state), param),
                None => (None, name),
            },
            None => (None, name),
        };
        let rotary = rotary_rows(self.model, param).map(|(_, hd)| hd);
        let tt = torchtitan_name(param).unwrap_or_else(|| param.to_string());
        let renamed = match state {
            Some(s) => format!("optim.{s}.{tt}"),
            None => tt,
        };
        (dcp_key(&renamed), rotary)
    }
}

impl TensorSource for DcpSource<'_> {
    fn check_shape(&mut self, name: &str, want: &[u64]) -> Result<(), ExecError> {
        let (key, _) = self.key(name);
        let t = self.ck.tensor_entry(&key).map_err(dcp_err)?;
        if t.size.iter().map(|&d| d as u64).ne(want.iter().copied()) {
            return Err(ExecError::Checkpoint(format!(
                "{}: key `{key}` has size {:?}, the model needs {want:?}",
                self.ck.dir().display(),
                t.size
            )));
        }
        Ok(())
    }

    fn rows(&mut self, name: &str, rows: std::ops::Range<u64>) -> Result<Vec<f32>, ExecError> {
        let (key, rotary) = self.key(name);
        let t = self.ck.tensor_entry(&key).map_err(dcp_err)?;
        let mut want = Chunk::whole(&t.size);
        if want.offsets.is_empty() {
            return to_f32(&self.ck.tensor(&key).map_err(dcp_err)?);
        }
        let (a, b) = (rows.start as usize, rows.end as usize);
        let Some(hd) = rotary.filter(|&hd| hd >= 2 && hd % 2 == 0) else {
            want.offsets[0] = a;
            want.sizes[0] = b - a;
            return to_f32(&self.ck.region(&key, &want).map_err(dcp_err)?);
        };
        // The whole heads the rows fall in (a permutation stays inside a head), read in
        // Meta's order, then each Hugging Face row taken from where Meta keeps it.
        let (first, last) = (a / hd * hd, b.div_ceil(hd) * hd);
        want.offsets[0] = first;
        want.sizes[0] = last - first;
        let block = to_f32(&self.ck.region(&key, &want).map_err(dcp_err)?)?;
        let width = block.len() / (last - first).max(1);
        let mut out = Vec::with_capacity((b - a) * width);
        for r in a..b {
            let src = meta_row(r, hd) - first;
            out.extend_from_slice(&block[src * width..(src + 1) * width]);
        }
        Ok(out)
    }
}

/// A tensor's elements as f32, converted as torch's `copy_` converts them.
pub(crate) fn to_f32(t: &TensorData) -> Result<Vec<f32>, ExecError> {
    let conv: fn(&[u8]) -> f32 = match t.dtype {
        DType::F32 => |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        DType::BF16 => |b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        DType::F16 => |b| half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
        DType::F64 => |b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as f32,
        other => {
            return Err(ExecError::Checkpoint(format!(
                "a {other} tensor where a floating-point parameter or state belongs"
            )))
        }
    };
    Ok(t.bytes.chunks_exact(t.dtype.size()).map(conv).collect())
}
