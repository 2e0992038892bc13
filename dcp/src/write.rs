//! Writing a DCP checkpoint folder as torch's FileSystemWriter does: each process's items
//! one after another in its data file (`__{rank}_0.distcp`), then, once every process's
//! file is complete, one `.metadata` naming where each item lies, written to a temporary
//! name and renamed: a folder without `.metadata` is an interrupted save.

use crate::archive::{write_tensor, write_value, TensorData};
use crate::error::{DcpError, Result};
use crate::metadata::{Chunk, Metadata, StorageInfo, StorageKey};
use crate::pickle::Value;
use crate::read::METADATA_FILE;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

fn io(path: &Path, what: &str, e: std::io::Error) -> DcpError {
    DcpError::Io {
        path: path.to_path_buf(),
        what: what.into(),
        source: e,
    }
}

/// One process's data file being written.
pub struct DataFile {
    path: PathBuf,
    name: String,
    out: BufWriter<File>,
    /// Bytes written so far: where the next item starts.
    at: u64,
    compress: bool,
    records: Vec<(StorageKey, StorageInfo)>,
}

/// The data file name of process `rank`.
pub fn data_file_name(rank: usize) -> String {
    format!("__{rank}_0.distcp")
}

impl DataFile {
    /// Starts `dir/__{rank}_0.distcp`; with `compress`, each item is one zstd frame
    /// (DCP's `stream.zstd/1`).
    pub fn create(dir: &Path, rank: usize, compress: bool) -> Result<DataFile> {
        let name = data_file_name(rank);
        let path = dir.join(&name);
        let f = File::create(&path).map_err(|e| io(&path, "cannot create the checkpoint's data file", e))?;
        Ok(DataFile {
            path,
            name,
            out: BufWriter::new(f),
            at: 0,
            compress,
            records: Vec::new(),
        })
    }

    fn append(&mut self, key: StorageKey, archive: Vec<u8>) -> Result<()> {
        let (bytes, transforms) = match self.compress {
            true => (
                ruzstd::encoding::compress_to_vec(archive.as_slice(), ruzstd::encoding::CompressionLevel::Fastest),
                vec!["stream.zstd/1".to_string()],
            ),
            false => (archive, Vec::new()),
        };
        self.out
            .write_all(&bytes)
            .map_err(|e| io(&self.path, "cannot write", e))?;
        let info = StorageInfo {
            file: self.name.clone(),
            offset: self.at,
            length: bytes.len() as u64,
            transforms,
        };
        self.at += bytes.len() as u64;
        self.records.push((key, info));
        Ok(())
    }

    /// Appends `t`, the block `chunk` of the tensor saved under `key`.
    pub fn tensor(&mut self, key: &str, chunk: &Chunk, t: &TensorData) -> Result<()> {
        if t.shape != chunk.sizes {
            return Err(DcpError::invalid(format!(
                "key `{key}`: a {:?} block saved as the chunk of {:?}",
                t.shape, chunk.sizes
            )));
        }
        self.append((key.to_string(), Some(chunk.offsets.clone())), write_tensor(t)?)
    }

    /// Appends the value saved under `key`.
    pub fn value(&mut self, key: &str, v: &Value) -> Result<()> {
        self.append((key.to_string(), None), write_value(v)?)
    }

    /// Flushes and syncs the file; returns where each item went.
    pub fn finish(mut self) -> Result<Vec<(StorageKey, StorageInfo)>> {
        self.out.flush().map_err(|e| io(&self.path, "cannot write", e))?;
        self.out
            .get_ref()
            .sync_all()
            .map_err(|e| io(&self.path, "cannot sync", e))?;
        Ok(self.records)
    }
}

/// Writes `metadata` as `dir/.metadata` (through a temporary file, synced, then renamed):
/// the step is complete once it returns. The metadata is checked first.
pub fn write_metadata(dir: &Path, metadata: &Metadata) -> Result<()> {
    let bytes = metadata.write().map_err(|e| e.within(&dir.display().to_string()))?;
    let tmp = dir.join(".metadata.tmp");
    let path = dir.join(METADATA_FILE);
    let mut f = File::create(&tmp).map_err(|e| io(&tmp, "cannot create", e))?;
    f.write_all(&bytes).map_err(|e| io(&tmp, "cannot write", e))?;
    f.sync_all().map_err(|e| io(&tmp, "cannot sync", e))?;
    std::fs::rename(&tmp, &path).map_err(|e| io(&path, "cannot rename the metadata into place", e))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(dir, "cannot sync the folder", e))
}
