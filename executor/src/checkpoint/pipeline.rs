//! Checkpoints of a pipeline run in shardplan's checkpoint format (this module's):
//! whole tensors' rows in rank files and `metadata.json` written last, so a pipeline
//! checkpoint loads on any pipeline degree, any FSDP, HSDP or tensor-parallel mesh inside
//! the stages, and into a run without a pipeline; and any shardplan checkpoint loads here.
//!
//! A save puts every parameter and optimizer state back together from the ranks' chunks
//! (every rank runs in this process) and writes shard `s`'s rows of each to rank file `s`,
//! as the same mesh without its pipeline writes them. A load reads, for each rank, the
//! rows of its chunks (its tensor rank's slice of them) and nothing else.

use super::dcp::{read_run_state, run_values, write_whole_dcp, DcpSource, RunState};
use super::names::CheckpointNames;
use super::{
    host_f32, io, local_rows, model_mismatch, prepare_step_dir, read_metadata, resolve, whole_dims, write_entries,
    write_metadata_file, Metadata, Piece, TensorMeta, Written, CHECKPOINT_FORMAT,
};
use super::{ShardplanSource, TensorSource};
use crate::runtime::optim::state_names;
use crate::train::pipeline::{PipelineTrainer, Rank, Shard};
use crate::ExecError;
use candle_core::{Device, Tensor};
use shardplan_ir::ParamId;
use shardplan_planner::{chunk_rows, OptimizerKind};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

impl PipelineTrainer {
    /// Saves a checkpoint of the current step under `root`; returns its folder.
    pub fn save(&mut self, root: &Path) -> Result<PathBuf, ExecError> {
        let world = (self.config.mesh.pipeline * self.config.mesh.stage_world()) as usize;
        if self.ranks.len() != world {
            return Err(ExecError::Unsupported(format!(
                "{}: a pipeline checkpoint is put together by one process holding every rank; train with --backend local to save, or leave out --checkpoint-dir",
                root.display()
            )));
        }
        let dir = prepare_step_dir(root, &super::step_dir_name(self.step), true)?;
        std::fs::create_dir_all(&dir).map_err(|e| io(&dir, "cannot create", e))?;
        let whole = self.whole_tensors()?;
        let shards = self.config.mesh.shard;
        let mut written: Vec<Written> = Vec::with_capacity(shards as usize);
        for s in 0..shards {
            let mut entries = Vec::new();
            for (name, t) in &whole {
                let rows = chunk_rows(t.dims().first().copied().unwrap_or(1) as u64, shards, s);
                if rows.is_empty() {
                    continue;
                }
                let part = t.narrow(0, rows.start as usize, (rows.end - rows.start) as usize)?;
                entries.push((name.clone(), rows, host_f32(&part)?, part.dims().to_vec()));
            }
            written.push(write_entries(&dir, &format!("rank-{s:05}.safetensors"), entries)?);
        }
        let meta = self.metadata(&whole, written);
        write_metadata_file(&dir, root, &meta)?;
        Ok(dir)
    }

    /// Every parameter and optimizer state whole, by name (`exp_avg.<name>` and so on), in
    /// the model's parameter order.
    fn whole_tensors(&self) -> Result<Vec<(String, Tensor)>, ExecError> {
        let states = state_names(&self.config.optimizer);
        let tensor = self.config.mesh.tensor as usize;
        let mut by_param: Vec<Option<Vec<(String, Tensor)>>> = vec![None; self.params];
        for pipeline in 0..self.config.mesh.pipeline as usize {
            let ranks = self.replica_ranks(pipeline);
            let Some(lead) = ranks.first() else { continue };
            for (k, stage) in lead.stages.iter().enumerate() {
                for (i, &param) in stage.graph.params.iter().enumerate() {
                    let name = stage.graph.joint.graph.param(ParamId::new(i)).name.to_string();
                    // The chunks of the master (`None`) or of optimizer state `s`, by tensor
                    // rank then shard rank, put together.
                    let whole = |state: Option<usize>| -> Result<Tensor, ExecError> {
                        let mut chunks: Vec<Vec<Shard>> = vec![Vec::new(); tensor];
                        for r in &ranks {
                            let chunk = &r.stages[k].chunks[i];
                            let t =
                                match state {
                                    None => chunk.master.clone(),
                                    Some(s) => r.stages[k].opt.state(s, i).cloned().ok_or_else(|| {
                                        ExecError::Internal(format!("no optimizer state for {name} yet"))
                                    })?,
                                };
                            chunks[r.tensor_rank].push(chunk.with_master(t));
                        }
                        let refs: Vec<Vec<&Shard>> = chunks.iter().map(|c| c.iter().collect()).collect();
                        Shard::whole(&refs)
                    };
                    let mut all = vec![(name.clone(), whole(None)?)];
                    for (s, prefix) in states.iter().enumerate() {
                        all.push((format!("{prefix}.{name}"), whole(Some(s))?));
                    }
                    by_param[param.index()] = Some(all);
                }
            }
        }
        Ok(by_param.into_iter().flatten().flatten().collect())
    }

    /// The first replica's ranks of pipeline rank `pipeline`, in mesh order (shard-major,
    /// tensor inside).
    fn replica_ranks(&self, pipeline: usize) -> Vec<&Rank> {
        self.ranks
            .iter()
            .filter(|r| r.pipeline == pipeline && r.data_rank < self.shards)
            .collect()
    }

    fn metadata(&self, whole: &[(String, Tensor)], written: Vec<Written>) -> Metadata {
        let mut files = Vec::new();
        let mut pieces: HashMap<String, Vec<Piece>> = HashMap::new();
        for (f, ps) in written {
            files.push(f);
            for (name, p) in ps {
                pieces.entry(name).or_default().push(p);
            }
        }
        let tensors = whole
            .iter()
            .map(|(name, t)| {
                let mut ps = pieces.remove(name).unwrap_or_default();
                ps.sort_by_key(|x| x.start);
                TensorMeta {
                    name: name.clone(),
                    shape: t.dims().iter().map(|&d| d as u64).collect(),
                    dtype: "F32".into(),
                    pieces: ps,
                }
            })
            .collect();
        let first = self.ranks.first().and_then(|r| r.stages.first());
        Metadata {
            format: CHECKPOINT_FORMAT,
            step: self.step,
            model: self.model.clone(),
            replicate: self.config.mesh.replicate,
            shard: self.config.mesh.shard,
            optimizer: OptimizerKind::of(&self.config.optimizer).name().to_string(),
            optimizer_steps: first.map_or(0, |s| s.opt.steps),
            data_position: self.data.position(),
            seed: self.config.seed,
            tensors,
            files,
        }
    }

    /// Loads the checkpoint at `path` (a step folder, or the newest complete one under a
    /// root), whatever mesh wrote it. Returns warnings.
    pub fn load(&mut self, path: &Path) -> Result<Vec<String>, ExecError> {
        let (dir, mut warnings) = resolve(path)?;
        if shardplan_dcp::is_checkpoint(&dir) {
            let ck = shardplan_dcp::Checkpoint::open(&dir).map_err(|e| ExecError::Checkpoint(e.to_string()))?;
            let first = self
                .ranks
                .first()
                .and_then(|r| r.stages.first())
                .map(|s| s.graph.joint.graph.param(ParamId::new(0)).name.to_string());
            let (run, more) = read_run_state(&ck, &self.model, first.as_deref())?;
            warnings.extend(more);
            let loaded = self.read_stages(
                &mut DcpSource::new(&ck, CheckpointNames::HuggingFace, &self.model),
                true,
            )?;
            let position = run.position.unwrap_or(run.step);
            self.apply(loaded, run.optimizer_steps, position, run.step)?;
            return Ok(warnings);
        }
        let meta = read_metadata(&dir)?;
        if let Some(e) = model_mismatch(&dir, &meta.model, &self.model) {
            return Err(e);
        }
        if meta.optimizer != OptimizerKind::of(&self.config.optimizer).name() {
            return Err(ExecError::Checkpoint(format!(
                "{}: holds {} optimizer state; this run uses {}",
                dir.display(),
                meta.optimizer,
                OptimizerKind::of(&self.config.optimizer).name()
            )));
        }
        // Read everything first: a failure leaves the trainer as it was.
        let loaded = self.read_stages(&mut ShardplanSource::new(&dir, &meta), true)?;
        self.apply(loaded, meta.optimizer_steps, meta.data_position, meta.step)?;
        Ok(warnings)
    }

    /// Starts from pretrained weights: Hugging Face safetensors (one file, or a folder
    /// with `model.safetensors` or an index) or a DCP checkpoint's parameters, each rank
    /// reading only its chunks of its stages; the optimizer starts fresh, at step 0.
    pub fn init_from(&mut self, path: &Path) -> Result<(), ExecError> {
        let loaded = if shardplan_dcp::is_checkpoint(path) {
            let ck = shardplan_dcp::Checkpoint::open(path).map_err(|e| ExecError::Checkpoint(e.to_string()))?;
            self.read_stages(
                &mut DcpSource::new(&ck, CheckpointNames::HuggingFace, &self.model),
                false,
            )?
        } else {
            self.read_stages(&mut super::hf::SafetensorsSource::open(path)?, false)?
        };
        for (rank, by_stage) in self.ranks.iter_mut().zip(loaded) {
            for (stage, by_param) in rank.stages.iter_mut().zip(by_stage) {
                for (i, kinds) in by_param.into_iter().enumerate() {
                    if let Some(m) = kinds.into_iter().next() {
                        stage.chunks[i].master = m.to_device(&self.device)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Every local rank's chunks of every stage's parameters and (`with_states`) optimizer
    /// states, from `source`: by rank, stage, parameter, then the parameter and each state.
    fn read_stages(
        &self,
        source: &mut dyn TensorSource,
        with_states: bool,
    ) -> Result<Vec<Vec<Vec<Vec<Tensor>>>>, ExecError> {
        let states = if with_states {
            state_names(&self.config.optimizer)
        } else {
            &[]
        };
        let shards = self.config.mesh.shard;
        let mut loaded = Vec::with_capacity(self.ranks.len());
        for rank in &self.ranks {
            let shard = (rank.data_rank % self.shards) as u64;
            let mut by_stage = Vec::with_capacity(rank.stages.len());
            for stage in &rank.stages {
                let g = &stage.graph.joint.graph;
                let mut by_param = Vec::with_capacity(stage.chunks.len());
                for (i, chunk) in stage.chunks.iter().enumerate() {
                    let param = g.param(ParamId::new(i));
                    let rows = chunk_rows(param.ty.shape.dims().first().copied().unwrap_or(1), shards, shard);
                    let mut kinds = Vec::with_capacity(1 + states.len());
                    for prefix in std::iter::once("").chain(states.iter().copied()) {
                        let name = match prefix {
                            "" => param.name.to_string(),
                            p => format!("{p}.{}", param.name),
                        };
                        source.check_shape(&name, &whole_dims(param))?;
                        let vals = if rows.is_empty() {
                            Vec::new()
                        } else {
                            local_rows(param, rank.tensor_rank as u64, rows.clone(), &mut |r| {
                                source.rows(&name, r)
                            })?
                        };
                        kinds.push(chunk.padded(vals, &Device::Cpu)?);
                    }
                    by_param.push(kinds);
                }
                by_stage.push(by_param);
            }
            loaded.push(by_stage);
        }
        Ok(loaded)
    }

    /// Puts what `read_stages` read in place, with the optimizer's step count, the data
    /// position and the step.
    fn apply(
        &mut self,
        loaded: Vec<Vec<Vec<Vec<Tensor>>>>,
        optimizer_steps: u64,
        position: u64,
        step: u64,
    ) -> Result<(), ExecError> {
        for (rank, by_stage) in self.ranks.iter_mut().zip(loaded) {
            for (stage, by_param) in rank.stages.iter_mut().zip(by_stage) {
                stage.opt.steps = optimizer_steps;
                for (i, kinds) in by_param.into_iter().enumerate() {
                    let mut it = kinds.into_iter();
                    if let Some(m) = it.next() {
                        stage.chunks[i].master = m.to_device(&self.device)?;
                    }
                    for (k, t) in it.enumerate() {
                        stage.opt.set_state(k, i, t.to_device(&self.device)?);
                    }
                }
            }
        }
        self.data.seek(position);
        self.step = step;
        Ok(())
    }

    /// Saves a DCP checkpoint of the current step under `root` (`step-N/`), every tensor
    /// whole in one data file (put together by this process, as [`PipelineTrainer::save`]).
    pub fn save_dcp(&mut self, root: &Path) -> Result<PathBuf, ExecError> {
        let world = (self.config.mesh.pipeline * self.config.mesh.stage_world()) as usize;
        if self.ranks.len() != world {
            return Err(ExecError::Unsupported(format!(
                "{}: a pipeline checkpoint is put together by one process holding every rank; train with --backend local to save",
                root.display()
            )));
        }
        let dir = prepare_step_dir(root, &format!("step-{}", self.step), true)?;
        std::fs::create_dir_all(&dir).map_err(|e| io(&dir, "cannot create", e))?;
        let whole = self.whole_tensors()?;
        let order: Vec<(String, Vec<u64>)> = whole
            .iter()
            .map(|(n, t)| (n.clone(), t.dims().iter().map(|&d| d as u64).collect()))
            .collect();
        let by_name: HashMap<&str, &Tensor> = whole.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let params: Vec<String> = order
            .iter()
            .map(|(n, _)| n.clone())
            .filter(|n| !n.starts_with("optim."))
            .collect();
        let run = RunState {
            step: self.step,
            optimizer_steps: self
                .ranks
                .first()
                .and_then(|r| r.stages.first())
                .map_or(0, |s| s.opt.steps),
            position: Some(self.data.position()),
        };
        let adamw = matches!(self.config.optimizer, shardplan_frontends::Optimizer::AdamW { .. });
        let values = run_values(&run, &self.model, &self.config, &params)?;
        let mut read = |name: &str, _: &[u64]| host_f32(by_name[name]);
        write_whole_dcp(
            &dir,
            &order,
            &mut read,
            adamw.then_some(run.optimizer_steps),
            &values,
            &mut |_, _| {},
        )?;
        Ok(dir)
    }
}
