//! `metadata.json`: what a checkpoint holds and where, read back and checked.

use super::io;
use crate::ExecError;
use serde::{Deserialize, Serialize};
use shardplan_models::ModelConfig;
use std::path::Path;

/// Format version of `metadata.json`.
pub const CHECKPOINT_FORMAT: u32 = 1;

/// A block of rows and its checksum.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Block {
    pub rows: u64,
    pub crc32: u32,
}

/// Rows `start..end` of a tensor, stored under `key` in `file`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Piece {
    pub file: String,
    pub key: String,
    pub start: u64,
    pub end: u64,
    pub blocks: Vec<Block>,
}

/// One logical tensor of the checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorMeta {
    pub name: String,
    pub shape: Vec<u64>,
    pub dtype: String,
    pub pieces: Vec<Piece>,
}

/// A file of the checkpoint and its size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileMeta {
    pub name: String,
    pub bytes: u64,
}

/// `metadata.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    pub format: u32,
    pub step: u64,
    pub model: ModelConfig,
    pub replicate: u64,
    pub shard: u64,
    pub optimizer: String,
    pub optimizer_steps: u64,
    /// Global micro-batches consumed by the data stream.
    pub data_position: u64,
    pub seed: u64,
    pub tensors: Vec<TensorMeta>,
    pub files: Vec<FileMeta>,
}

/// Reads and checks `metadata.json` of a step folder.
pub fn read_metadata(dir: &Path) -> Result<Metadata, ExecError> {
    let path = dir.join("metadata.json");
    let text = std::fs::read_to_string(&path).map_err(|e| io(&path, "cannot read", e))?;
    let m: Metadata = serde_json::from_str(&text)
        .map_err(|e| ExecError::Checkpoint(format!("{}:{}:{}: {e}", path.display(), e.line(), e.column())))?;
    if m.format != CHECKPOINT_FORMAT {
        return Err(ExecError::Checkpoint(format!(
            "{}: checkpoint format {} (this shardplan reads {CHECKPOINT_FORMAT})",
            path.display(),
            m.format
        )));
    }
    for f in &m.files {
        let p = dir.join(&f.name);
        let len = std::fs::metadata(&p)
            .map_err(|_| ExecError::Checkpoint(format!("{}: missing shard file (the metadata lists it)", p.display())))?
            .len();
        if len != f.bytes {
            return Err(ExecError::Checkpoint(format!(
                "{}: {len} bytes, the checkpoint wrote {}: the file is truncated or was replaced",
                p.display(),
                f.bytes
            )));
        }
    }
    Ok(m)
}
