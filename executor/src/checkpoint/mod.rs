//! Distributed checkpoints: every rank saves its own shards, any mesh loads any checkpoint,
//! and a checkpoint is visible only once it is complete.
//!
//! Layout: `DIR/step-00000010/rank-00003.safetensors` (one per rank of replica 0; replicas
//! hold the same shards) and `metadata.json`, written last by an atomic rename: a folder
//! without it is an interrupted save and is ignored. Each rank file holds, per parameter,
//! the dim-0 rows the rank owns (unpadded, f32), and the same rows of each optimizer state.
//! The metadata records the model, the mesh, the step, the data position, every tensor's
//! global shape and which file holds which rows, with a CRC32 per block of rows, so a
//! loading rank reads (and checks) only the byte ranges it needs.

mod convert;
mod dcp;
mod hf;
mod meta;
mod names;
mod pipeline;
mod read;

pub use convert::{convert, Format};
pub use dcp::dcp_key;
pub use hf::{export, read_weights, ExportDType};
pub use meta::{read_metadata, Block, FileMeta, Metadata, Piece, TensorMeta, CHECKPOINT_FORMAT};
pub use names::{torchtitan_name, CheckpointNames};

use crate::runtime::optim::state_names;
use crate::train::sharded::ShardedTrainer;
use crate::ExecError;
use candle_core::{Device, Tensor};
pub(crate) use read::read_rows;
use shardplan_models::ModelConfig;
use shardplan_planner::chunk_rows;
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Rows per checksummed block aim at this many bytes.
const BLOCK_BYTES: u64 = 1 << 20;

/// Where a save can be interrupted (for the crash tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveStage {
    /// After rank file `n` (counting from 0) is complete.
    AfterRankFile(usize),
    /// Every rank file is written; the metadata is not.
    BeforeMetadata,
}

pub(crate) fn io(path: &Path, what: &str, e: std::io::Error) -> ExecError {
    ExecError::Checkpoint(format!("{}: {what}: {e}", path.display()))
}

pub(crate) fn fsync_dir(dir: &Path) -> Result<(), ExecError> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| io(dir, "fsync", e))
}

pub(crate) fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(step_dir_name(step))
}

/// The folder name of step `step` in shardplan's format (DCP's is torchtitan's `step-N`).
pub(crate) fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// An f32 tensor's elements, to be written as little-endian bytes (safetensors' layout).
pub(crate) fn host_f32(t: &Tensor) -> Result<Vec<f32>, ExecError> {
    let mut v = t.flatten_all()?.to_vec1::<f32>()?;
    if cfg!(target_endian = "big") {
        v.iter_mut().for_each(|x| *x = f32::from_bits(x.to_bits().swap_bytes()));
    }
    Ok(v)
}

fn blocks(bytes: &[u8], row_bytes: u64) -> Vec<Block> {
    let rows_per = (BLOCK_BYTES / row_bytes.max(1)).max(1);
    let total_rows = bytes.len() as u64 / row_bytes.max(1);
    let mut out = Vec::new();
    let mut r = 0;
    while r < total_rows {
        let n = rows_per.min(total_rows - r);
        let a = (r * row_bytes) as usize;
        let b = ((r + n) * row_bytes) as usize;
        out.push(Block {
            rows: n,
            crc32: crc32fast::hash(&bytes[a..b]),
        });
        r += n;
    }
    out
}

/// Whether `dir` is a complete checkpoint: shardplan's (`metadata.json`) or DCP's
/// (`.metadata`), each written last.
pub fn complete(dir: &Path) -> bool {
    dir.join("metadata.json").is_file() || shardplan_dcp::is_checkpoint(dir)
}

/// Complete checkpoints (step, folder), by step, ascending.
pub type Complete = Vec<(u64, PathBuf)>;

/// A rank file and the tensor pieces it holds, by tensor name.
pub(crate) type Written = (FileMeta, Vec<(String, Piece)>);

/// Complete checkpoints under `root` and the folders of interrupted saves.
pub fn list(root: &Path) -> Result<(Complete, Vec<PathBuf>), ExecError> {
    let mut done = Vec::new();
    let mut partial = Vec::new();
    let entries = std::fs::read_dir(root).map_err(|e| io(root, "cannot list the checkpoint folder", e))?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(step) = name.strip_prefix("step-").and_then(|s| s.parse::<u64>().ok()) else {
            continue;
        };
        if complete(&e.path()) {
            done.push((step, e.path()));
        } else {
            partial.push(e.path());
        }
    }
    done.sort();
    partial.sort();
    Ok((done, partial))
}

/// The checkpoint to load from `path`: a step folder itself, or the newest complete one
/// under a checkpoint root. Returns warnings about interrupted saves it skipped.
pub fn resolve(path: &Path) -> Result<(PathBuf, Vec<String>), ExecError> {
    if complete(path) {
        return Ok((path.to_path_buf(), Vec::new()));
    }
    if !path.is_dir() {
        return Err(ExecError::Checkpoint(format!(
            "{}: no such checkpoint folder",
            path.display()
        )));
    }
    let (done, partial) = list(path)?;
    let warnings = partial
        .iter()
        .map(|p| {
            format!(
                "ignoring {}: an interrupted save (no metadata.json or .metadata)",
                p.display()
            )
        })
        .collect();
    match done.last() {
        Some((_, p)) => Ok((p.clone(), warnings)),
        None => Err(ExecError::Checkpoint(format!(
            "{}: no complete checkpoint (a `step-N` folder with metadata.json, or DCP's .metadata){}",
            path.display(),
            if partial.is_empty() {
                ""
            } else {
                "; only interrupted saves"
            }
        ))),
    }
}

impl ShardedTrainer {
    /// HF names of the parameters, by parameter id.
    /// Every parameter's Hugging Face name, in parameter order (as `full_params`).
    pub fn param_names(&self) -> Vec<String> {
        self.whole.names.clone()
    }

    /// Saves a checkpoint of the current step under `root` (see the module doc); returns
    /// its folder. `hook` is called at each stage and may stop the save there (tests).
    pub fn save_with_hook(&mut self, root: &Path, hook: &dyn Fn(SaveStage) -> bool) -> Result<PathBuf, ExecError> {
        let dir = step_dir(root, self.step);
        // The leader clears an interrupted save of this step; nobody writes until it has.
        let prepared = prepare_step_dir(root, &step_dir_name(self.step), self.is_leader());
        if !self.all_ok(prepared.is_ok())? {
            prepared?;
            return Err(ExecError::Checkpoint(format!(
                "{}: another process could not prepare the save",
                dir.display()
            )));
        }
        let written = self.write_rank_files(&dir, hook);
        if !self.all_ok(written.is_ok())? {
            written?;
            return Err(ExecError::Checkpoint(format!(
                "{}: another process failed to write its rank file; no metadata written, the folder is not loadable",
                dir.display()
            )));
        }
        // Every writer's pieces, to the leader (and everyone: the exchange is symmetric).
        let mine = serde_json::to_vec(&written?).map_err(|e| ExecError::Internal(e.to_string()))?;
        let mut results: Vec<Written> = Vec::new();
        for bytes in self.gather_bytes(mine)? {
            let part: Vec<Written> = serde_json::from_slice(&bytes)
                .map_err(|e| ExecError::Internal(format!("checkpoint pieces from another process: {e}")))?;
            results.extend(part);
        }
        results.sort_by(|a, b| a.0.name.cmp(&b.0.name));
        let meta = if self.is_leader() {
            if hook(SaveStage::BeforeMetadata) {
                self.write_metadata(&dir, root, results)
            } else {
                Err(ExecError::Checkpoint(format!(
                    "{}: save stopped before the metadata",
                    dir.display()
                )))
            }
        } else {
            Ok(())
        };
        if !self.all_ok(meta.is_ok())? {
            meta?;
            return Err(ExecError::Checkpoint(format!(
                "{}: the leader could not write the metadata; the folder is not loadable",
                dir.display()
            )));
        }
        Ok(dir)
    }

    /// Writes the rank files of this process's ranks in replica 0, in parallel.
    fn write_rank_files(&self, dir: &Path, hook: &dyn Fn(SaveStage) -> bool) -> Result<Vec<Written>, ExecError> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, "cannot create", e))?;
        let plan = &self.shared.plan;
        let mesh = plan.mesh;
        if mesh.tensor() > 1 || mesh.expert() > 1 {
            return self.write_whole_rows(dir, hook);
        }
        let names = self.param_names();
        let states = state_names(&self.config.optimizer);
        let writers: Vec<&crate::runtime::rank::RankState> = self
            .ranks
            .iter()
            .filter(|r| mesh.coords(r.rank).replicate == 0)
            .collect();
        let results: Vec<Result<Written, ExecError>> = std::thread::scope(|s| {
            let handles: Vec<_> = writers
                .iter()
                .map(|state| {
                    let names = &names;
                    let rank = state.rank;
                    let groups = rank_buffers(state, states.len());
                    let device = state.ctx.device.clone();
                    s.spawn(move || {
                        // The thread drops device tensors: their context must be current.
                        crate::runtime::device::bind_thread(&device)?;
                        write_rank(plan, dir, rank, names, states, &groups)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(ExecError::Internal("a checkpoint writer panicked".into())))
                })
                .collect()
        });
        let mut out = Vec::new();
        for (i, r) in results.into_iter().enumerate() {
            out.push(r?);
            if !hook(SaveStage::AfterRankFile(i)) {
                return Err(ExecError::Checkpoint(format!(
                    "{}: save stopped after rank file {i}",
                    dir.display()
                )));
            }
        }
        Ok(out)
    }

    /// With tensor or expert parallelism: every parameter and optimizer state put back together
    /// (all ranks run in this process), then written as the same mesh without a tensor axis
    /// writes it (rank file `s` holds shard `s`'s rows of each whole tensor), so the
    /// checkpoint loads on any mesh.
    fn write_whole_rows(&self, dir: &Path, hook: &dyn Fn(SaveStage) -> bool) -> Result<Vec<Written>, ExecError> {
        if self.processes.is_some() {
            return Err(ExecError::Unsupported(format!(
                "{}: a tensor- or expert-parallel run's checkpoint is put together by one process holding every rank; run it as threads (`--backend local`) to save, or leave out --checkpoint-dir",
                dir.display()
            )));
        }
        let shards = self.shared.plan.mesh.shard();
        let mut out = Vec::with_capacity(shards as usize);
        for (s, entries) in self.whole_rows()?.into_iter().enumerate() {
            out.push(write_entries(dir, &format!("rank-{s:05}.safetensors"), entries)?);
            if !hook(SaveStage::AfterRankFile(s)) {
                return Err(ExecError::Checkpoint(format!(
                    "{}: save stopped after rank file {s}",
                    dir.display()
                )));
            }
        }
        Ok(out)
    }

    /// Every parameter and optimizer state put back together, cut into the rows each
    /// shard rank of the same mesh without a tensor axis owns: one list of entries a shard.
    pub(crate) fn whole_rows(&self) -> Result<Vec<Vec<Entry>>, ExecError> {
        let plan = &self.shared.plan;
        let shards = plan.mesh.shard();
        let names = self.param_names();
        let states = state_names(&self.config.optimizer);
        let mut whole: Vec<(String, Tensor)> = Vec::new();
        for (p, t) in self.full_params()?.into_iter().enumerate() {
            whole.push((names[p].clone(), t));
        }
        for (k, prefix) in states.iter().enumerate() {
            let ts = self.assemble(|r, gi| r.opt[gi].state(k, 0).cloned())?;
            for (p, t) in ts.into_iter().enumerate() {
                whole.push((format!("{prefix}.{}", names[p]), t));
            }
        }
        let mut out = Vec::with_capacity(shards as usize);
        for s in 0..shards {
            let mut entries = Vec::new();
            for (name, t) in &whole {
                let dims: Vec<u64> = t.dims().iter().map(|&d| d as u64).collect();
                let rows = chunk_rows(dims.first().copied().unwrap_or(1), shards, s);
                if rows.is_empty() {
                    continue;
                }
                let part = t.narrow(0, rows.start as usize, (rows.end - rows.start) as usize)?;
                entries.push((name.clone(), rows, host_f32(&part)?, part.dims().to_vec()));
            }
            out.push(entries);
        }
        Ok(out)
    }

    /// `metadata.json` from every writer's pieces, renamed into place last.
    fn write_metadata(&self, dir: &Path, root: &Path, results: Vec<Written>) -> Result<(), ExecError> {
        let plan = &self.shared.plan;
        let mesh = plan.mesh;
        let optimizer = plan.policy.optimizer.name().to_string();
        let mut files = Vec::new();
        let mut pieces: HashMap<String, Vec<Piece>> = HashMap::new();
        for (f, ps) in results {
            files.push(f);
            for (name, p) in ps {
                pieces.entry(name).or_default().push(p);
            }
        }
        let mut tensors = Vec::new();
        for (name, shape) in self.whole_tensors() {
            let mut ps = pieces.remove(&name).unwrap_or_default();
            ps.sort_by_key(|x| x.start);
            tensors.push(TensorMeta {
                name,
                shape,
                dtype: "F32".into(),
                pieces: ps,
            });
        }
        let meta = Metadata {
            format: CHECKPOINT_FORMAT,
            step: self.step,
            model: self.model.clone(),
            replicate: mesh.replicate(),
            shard: mesh.shard(),
            optimizer,
            optimizer_steps: self.ranks[0].opt.first().map_or(0, |o| o.steps),
            data_position: self.data[0].position(),
            seed: self.config.seed,
            tensors,
            files,
        };
        write_metadata_file(dir, root, &meta)
    }

    /// Every tensor a checkpoint holds, by name, with its whole dims: each parameter in
    /// the whole model's order (a rank's experts once per expert rank), followed by its
    /// optimizer states.
    pub(crate) fn whole_tensors(&self) -> Vec<(String, Vec<u64>)> {
        let mesh = self.shared.plan.mesh;
        let names = self.param_names();
        let states = state_names(&self.config.optimizer);
        let g = &self.shared.joint.graph;
        let mut whole: Vec<(usize, Vec<u64>)> = g
            .params()
            .flat_map(|(p, param)| {
                let ranks = if param.expert.is_some() { mesh.expert() } else { 1 };
                (0..ranks).map(move |r| (self.whole.id(p, r), whole_dims(param)))
            })
            .collect();
        whole.sort_by_key(|w| w.0);
        let mut out = Vec::new();
        for (p, shape) in whole {
            for prefix in std::iter::once("").chain(states.iter().copied()) {
                let name = match prefix {
                    "" => names[p].clone(),
                    _ => format!("{prefix}.{}", names[p]),
                };
                out.push((name, shape.clone()));
            }
        }
        out
    }

    /// Saves a checkpoint of the current step under `root`.
    pub fn save(&mut self, root: &Path) -> Result<PathBuf, ExecError> {
        self.save_with_hook(root, &|_| true)
    }

    /// Keeps the newest `keep` complete checkpoints under `root` and removes the rest, and
    /// any interrupted save.
    pub fn prune(root: &Path, keep: usize) -> Result<(), ExecError> {
        let (done, partial) = list(root)?;
        let drop = done.len().saturating_sub(keep.max(1));
        for (_, p) in done.iter().take(drop) {
            std::fs::remove_dir_all(p).map_err(|e| io(p, "removing an old checkpoint", e))?;
        }
        for p in partial {
            std::fs::remove_dir_all(&p).map_err(|e| io(&p, "removing an interrupted save", e))?;
        }
        Ok(())
    }

    /// Every local rank's parameter and optimizer-state buffers read from `source` (the
    /// states `absent` marks are left at zero).
    pub(crate) fn read_local(&self, source: &mut dyn TensorSource, absent: &[bool]) -> Result<Loaded, ExecError> {
        let plan = &self.shared.plan;
        let mesh = plan.mesh;
        let g = &self.shared.joint.graph;
        let names = self.param_names();
        let states = state_names(&self.config.optimizer);
        let mut loaded: Vec<(Vec<Tensor>, Vec<Vec<Tensor>>)> = Vec::new();
        for rank in self.local_ranks() {
            let coords = mesh.coords(rank);
            let mut params = Vec::new();
            let mut st: Vec<Vec<Tensor>> = vec![Vec::new(); states.len()];
            for grp in &plan.groups {
                let l = &grp.layout;
                let mut flats = vec![vec![0f32; l.shard_numel as usize]; 1 + states.len()];
                for pl in &l.params {
                    let shard = mesh.shard_rank(rank, &grp.group);
                    let rows = chunk_rows(pl.dims.first().copied().unwrap_or(1), l.shard, shard);
                    if rows.is_empty() {
                        continue;
                    }
                    let whole_name = &names[self.whole.id(pl.param, mesh.expert_index(rank))];
                    for (k, prefix) in std::iter::once("").chain(states.iter().copied()).enumerate() {
                        if k > 0 && absent[k - 1] {
                            continue;
                        }
                        let name = if prefix.is_empty() {
                            whole_name.clone()
                        } else {
                            format!("{prefix}.{whole_name}")
                        };
                        let param = g.param(pl.param);
                        source.check_shape(&name, &whole_dims(param))?;
                        let vals = local_rows(param, coords.tensor, rows.clone(), &mut |r| source.rows(&name, r))?;
                        let at = pl.shard_offset as usize;
                        flats[k][at..at + vals.len()].copy_from_slice(&vals);
                    }
                }
                let mut it = flats.into_iter();
                let p = it.next().expect("params first");
                params.push(Tensor::from_vec(p, l.shard_numel as usize, &Device::Cpu)?);
                for (k, f) in it.enumerate() {
                    st[k].push(Tensor::from_vec(f, l.shard_numel as usize, &Device::Cpu)?);
                }
            }
            loaded.push((params, st));
        }
        Ok(loaded)
    }

    /// Loads the checkpoint at `path` (a step folder, or the newest complete one under a
    /// root) into this trainer's mesh, whatever mesh wrote it. Returns warnings.
    pub fn load(&mut self, path: &Path) -> Result<Vec<String>, ExecError> {
        let (dir, mut warnings) = resolve(path)?;
        if shardplan_dcp::is_checkpoint(&dir) {
            let mut more = self.load_dcp(&dir)?;
            warnings.append(&mut more);
            return Ok(warnings);
        }
        let meta = read_metadata(&dir)?;
        if let Some(e) = model_mismatch(&dir, &meta.model, &self.model) {
            return Err(e);
        }
        if meta.optimizer != self.shared.plan.policy.optimizer.name() {
            return Err(ExecError::Checkpoint(format!(
                "{}: holds {} optimizer state; this run uses {}",
                dir.display(),
                meta.optimizer,
                self.shared.plan.policy.optimizer
            )));
        }
        let by_name: HashMap<&str, &TensorMeta> = meta.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        let states = state_names(&self.config.optimizer);
        // SGD keeps momentum buffers only when momentum is not 0, so the two runs may differ
        // in them. Buffers the checkpoint lacks start at zero (the first step is then plain
        // SGD, as PyTorch does for a missing buffer); buffers this run keeps none of are not
        // read. Any other state missing is a damaged checkpoint, refused below.
        let held = |prefix: &str| {
            meta.tensors
                .iter()
                .any(|t| t.name.strip_prefix(prefix).is_some_and(|rest| rest.starts_with('.')))
        };
        let absent: Vec<bool> = states.iter().map(|&s| s == "optim.momentum" && !held(s)).collect();
        if absent.iter().any(|&a| a) {
            warnings.push(format!(
                "{}: saved with SGD momentum 0, so it holds no momentum buffers; this run's buffers start at zero",
                dir.display()
            ));
        }
        if held("optim.momentum") && !states.contains(&"optim.momentum") {
            warnings.push(format!(
                "{}: its SGD momentum buffers are not used: this run's momentum is 0",
                dir.display()
            ));
        }
        let mut source = ShardplanSource {
            dir: &dir,
            by_name,
            headers: HashMap::new(),
        };
        // Read everything first: a failure leaves the trainer as it was.
        let loaded = self.read_local(&mut source, &absent)?;
        for (r, (params, st)) in self.ranks.iter_mut().zip(loaded) {
            r.params = params;
            for (gi, o) in r.opt.iter_mut().enumerate() {
                o.steps = meta.optimizer_steps;
                for (k, s) in st.iter().enumerate() {
                    o.set_state(k, 0, s[gi].clone());
                }
            }
        }
        for d in &mut self.data {
            d.seek(meta.data_position);
        }
        self.step = meta.step;
        // Read on the CPU; placed where the run computes.
        let device = self.device().clone();
        self.to_device(&device)?;
        Ok(warnings)
    }
}

/// What a load reads for each local rank: its groups' parameter buffers and, per
/// optimizer state, its groups' state buffers.
pub(crate) type Loaded = Vec<(Vec<Tensor>, Vec<Vec<Tensor>>)>;

/// Where a load reads whole tensors' rows from: a checkpoint of one format.
pub(crate) trait TensorSource {
    /// Refuses a tensor the checkpoint lacks or holds in another shape than `want`.
    fn check_shape(&mut self, name: &str, want: &[u64]) -> Result<(), ExecError>;
    /// Rows `rows` of tensor `name`, as f32.
    fn rows(&mut self, name: &str, rows: std::ops::Range<u64>) -> Result<Vec<f32>, ExecError>;
}

/// A shardplan checkpoint's tensors: `metadata.json`'s pieces in the rank files.
pub(crate) struct ShardplanSource<'a> {
    dir: &'a Path,
    by_name: HashMap<&'a str, &'a TensorMeta>,
    headers: HashMap<String, read::Header>,
}

impl<'a> ShardplanSource<'a> {
    pub(crate) fn new(dir: &'a Path, meta: &'a Metadata) -> Self {
        ShardplanSource {
            dir,
            by_name: meta.tensors.iter().map(|t| (t.name.as_str(), t)).collect(),
            headers: HashMap::new(),
        }
    }

    fn meta(&self, name: &str) -> Result<&'a TensorMeta, ExecError> {
        self.by_name.get(name).copied().ok_or_else(|| {
            ExecError::Checkpoint(format!(
                "{}: tensor `{name}` is missing",
                self.dir.join("metadata.json").display()
            ))
        })
    }
}

impl TensorSource for ShardplanSource<'_> {
    fn check_shape(&mut self, name: &str, want: &[u64]) -> Result<(), ExecError> {
        let t = self.meta(name)?;
        if t.shape != want {
            return Err(ExecError::Checkpoint(format!(
                "{}: tensor `{name}` has shape {:?}, the model needs {:?}",
                self.dir.join("metadata.json").display(),
                t.shape,
                want
            )));
        }
        Ok(())
    }

    fn rows(&mut self, name: &str, rows: std::ops::Range<u64>) -> Result<Vec<f32>, ExecError> {
        let t = self.meta(name)?;
        read_rows(self.dir, t, rows, &mut self.headers)
    }
}

/// Whether `path` is a shardplan checkpoint: a `step-N` folder with `metadata.json`, or a
/// root holding such folders (complete or not).
pub fn is_checkpoint(path: &Path) -> bool {
    path.join("metadata.json").is_file()
        || (path.is_dir()
            && std::fs::read_dir(path).is_ok_and(|entries| {
                entries
                    .flatten()
                    .any(|e| e.file_name().to_string_lossy().starts_with("step-") && e.path().is_dir())
            }))
}

/// `root`'s folder for `step`, ready for a save: made, an interrupted save of that step
/// removed (by the `leader`), a complete one refused (it is never overwritten).
pub(crate) fn prepare_step_dir(root: &Path, name: &str, leader: bool) -> Result<PathBuf, ExecError> {
    let dir = root.join(name);
    std::fs::create_dir_all(root).map_err(|e| io(root, "cannot create the checkpoint folder", e))?;
    if complete(&dir) {
        return Err(ExecError::Checkpoint(format!(
            "{}: a complete checkpoint exists; it is not overwritten",
            dir.display()
        )));
    }
    if leader && dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| io(&dir, "removing an interrupted save", e))?;
    }
    Ok(dir)
}

/// Writes `meta` as `dir/metadata.json` by an atomic rename, once it passes the check a
/// load makes: a metadata.json makes the folder a checkpoint, so never write one a load
/// would refuse (pieces missing or overlapping, sizes that do not add up).
pub(crate) fn write_metadata_file(dir: &Path, root: &Path, meta: &Metadata) -> Result<(), ExecError> {
    meta::check(meta).map_err(|e| {
        ExecError::Internal(format!(
            "{}: the checkpoint's own metadata fails its check: {e}; no metadata written",
            dir.display()
        ))
    })?;
    let tmp = dir.join("metadata.json.tmp");
    let text = serde_json::to_string_pretty(meta).map_err(|e| ExecError::Internal(e.to_string()))?;
    {
        let mut f = File::create(&tmp).map_err(|e| io(&tmp, "cannot create", e))?;
        f.write_all(text.as_bytes()).map_err(|e| io(&tmp, "write", e))?;
        f.sync_all().map_err(|e| io(&tmp, "fsync", e))?;
    }
    std::fs::rename(&tmp, dir.join("metadata.json")).map_err(|e| io(&tmp, "rename", e))?;
    fsync_dir(dir)?;
    fsync_dir(root)?;
    Ok(())
}

/// The error for a checkpoint of another model than `model`, naming the first field of
/// the two configs that differs; `None` when they are the same.
pub(crate) fn model_mismatch(dir: &Path, written: &ModelConfig, model: &ModelConfig) -> Option<ExecError> {
    if written == model {
        return None;
    }
    let (a, b) = (
        serde_json::to_value(written).unwrap_or_default(),
        serde_json::to_value(model).unwrap_or_default(),
    );
    let field = match (a.as_object(), b.as_object()) {
        (Some(x), Some(y)) => x
            .keys()
            .chain(y.keys())
            .find(|k| x.get(*k) != y.get(*k))
            .map(|k| {
                format!(
                    " (`model.{k}` is {}, this run's is {})",
                    x.get(k).unwrap_or(&serde_json::Value::Null),
                    y.get(k).unwrap_or(&serde_json::Value::Null)
                )
            })
            .unwrap_or_default(),
        _ => String::new(),
    };
    Some(ExecError::Checkpoint(format!(
        "{}: written for model `{}`, not `{}`: the model specs differ{field}",
        dir.join("metadata.json").display(),
        written.name(),
        model.name(),
    )))
}

/// A rank's flat group buffers: each group's parameters and its optimizer states.
pub(crate) fn rank_buffers(
    state: &crate::runtime::rank::RankState,
    states: usize,
) -> Vec<(Tensor, Vec<Option<Tensor>>)> {
    state
        .params
        .iter()
        .zip(&state.opt)
        .map(|(p, o)| (p.clone(), (0..states).map(|k| o.state(k, 0).cloned()).collect()))
        .collect()
}

/// Writes one rank's file of a checkpoint; returns the file and its pieces.
fn write_rank(
    plan: &shardplan_planner::Plan,
    dir: &Path,
    rank: u64,
    names: &[String],
    states: &[&str],
    groups: &[(Tensor, Vec<Option<Tensor>>)],
) -> Result<Written, ExecError> {
    let entries = rank_entries(plan, rank, names, states, groups)?;
    write_entries(dir, &format!("rank-{rank:05}.safetensors"), entries)
}

/// The rows rank `rank` owns of every whole parameter and optimizer state (by name),
/// from its flat group buffers `groups` (parameters, then each state).
pub(crate) fn rank_entries(
    plan: &shardplan_planner::Plan,
    rank: u64,
    names: &[String],
    states: &[&str],
    groups: &[(Tensor, Vec<Option<Tensor>>)],
) -> Result<Vec<Entry>, ExecError> {
    let mut entries = Vec::new();
    for (gi, grp) in plan.groups.iter().enumerate() {
        let l = &grp.layout;
        let (param, state) = &groups[gi];
        let sources: Vec<(&str, Option<&Tensor>)> = std::iter::once(("", Some(param)))
            .chain(states.iter().zip(state).map(|(&s, t)| (s, t.as_ref())))
            .collect();
        for pl in &l.params {
            let rows = chunk_rows(pl.dims.first().copied().unwrap_or(1), l.shard, rank);
            if rows.is_empty() {
                continue;
            }
            let n = ((rows.end - rows.start) * pl.row_elems) as usize;
            let mut dims: Vec<usize> = pl.dims.iter().map(|&d| d as usize).collect();
            if dims.is_empty() {
                dims.push(1);
            }
            dims[0] = (rows.end - rows.start) as usize;
            for (prefix, t) in &sources {
                let name = if prefix.is_empty() {
                    names[pl.param.index()].clone()
                } else {
                    format!("{prefix}.{}", names[pl.param.index()])
                };
                let t = t.ok_or_else(|| ExecError::Internal(format!("no optimizer state for {name}")))?;
                let vals = host_f32(&t.narrow(0, pl.shard_offset as usize, n)?)?;
                entries.push((name, rows.clone(), vals, dims.clone()));
            }
        }
    }
    Ok(entries)
}

/// One tensor's rows in a rank file: its name, the whole tensor's rows they are, their f32
/// values, their dims.
pub(crate) type Entry = (String, std::ops::Range<u64>, Vec<f32>, Vec<usize>);

/// Writes rank file `file` holding `entries`; returns the file and its pieces.
pub(crate) fn write_entries(dir: &Path, file: &str, entries: Vec<Entry>) -> Result<Written, ExecError> {
    let file = file.to_string();
    let mut data: Vec<(String, Vec<f32>, Vec<usize>)> = Vec::with_capacity(entries.len());
    let mut pieces = Vec::with_capacity(entries.len());
    for (name, rows, vals, dims) in entries {
        let row_elems: u64 = dims.iter().skip(1).map(|&d| d as u64).product();
        pieces.push((
            name.clone(),
            Piece {
                file: file.clone(),
                key: name.clone(),
                start: rows.start,
                end: rows.end,
                blocks: blocks(bytemuck::cast_slice(&vals), row_elems * 4),
            },
        ));
        data.push((name, vals, dims));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(name, vals, dims)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, dims.clone(), bytemuck::cast_slice(vals))
                .map(|v| (name.clone(), v))
                .map_err(|e| ExecError::Internal(format!("{name}: {e}")))
        })
        .collect::<Result<_, _>>()?;
    let path = dir.join(&file);
    let tmp = dir.join(format!("{file}.tmp"));
    safetensors::serialize_to_file(views, None, &tmp)
        .map_err(|e| ExecError::Checkpoint(format!("{}: {e}", tmp.display())))?;
    File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| io(&tmp, "fsync", e))?;
    std::fs::rename(&tmp, &path).map_err(|e| io(&tmp, "rename", e))?;
    let bytes = std::fs::metadata(&path).map_err(|e| io(&path, "stat", e))?.len();
    Ok((FileMeta { name: file, bytes }, pieces))
}

/// The whole parameter's dims (a tensor-parallel slice's, times its tensor group).
pub(crate) fn whole_dims(param: &shardplan_ir::Param) -> Vec<u64> {
    let local = param.ty.shape.dims();
    match &param.tensor {
        Some(split) => split.whole_dims(local),
        None => local.to_vec(),
    }
}

/// Rows `rows` of tensor rank `tensor_rank`'s slice of `param`, as f32, from `read`, which
/// gives rows of the whole tensor: the same rows without a split; for a split along dim
/// 0 the whole rows each block of them is; along a later dim the whole rows, cut to the
/// rank's columns.
pub(crate) fn local_rows(
    param: &shardplan_ir::Param,
    tensor_rank: u64,
    rows: std::ops::Range<u64>,
    read: &mut dyn FnMut(std::ops::Range<u64>) -> Result<Vec<f32>, ExecError>,
) -> Result<Vec<f32>, ExecError> {
    let Some(split) = param.tensor else {
        return read(rows);
    };
    let local = param.ty.shape.dims();
    let whole = split.whole_dims(local);
    if split.dim == 0 {
        let block = local[0] / split.parts.max(1);
        let mut out = Vec::new();
        for p in 0..split.parts {
            let (lo, hi) = (rows.start.max(p * block), rows.end.min((p + 1) * block));
            if lo >= hi {
                continue;
            }
            let at = p * block * split.degree + tensor_rank * block + (lo - p * block);
            out.extend(read(at..at + (hi - lo))?);
        }
        return Ok(out);
    }
    let vals = read(rows.clone())?;
    let mut dims: Vec<usize> = whole.iter().map(|&d| d as usize).collect();
    dims[0] = (rows.end - rows.start) as usize;
    let t = Tensor::from_vec(vals, dims.as_slice(), &Device::Cpu)?;
    Ok(crate::cpu::tensor::slice_of_whole(&t, &split, tensor_rank)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}
