//! Reading a DCP checkpoint folder: its `.metadata`, then items out of its data files
//! (memory-mapped), decompressed where a transform says so, each a torch.save archive.
//! A tensor is read whole or as any block of it ([`Checkpoint::region`]: the saved chunks
//! that meet the block, copied into place), which is how a load onto another mesh
//! reshards.

use crate::archive::{read_archive, TensorData};
use crate::error::{DcpError, Result};
use crate::metadata::{Chunk, Entry, Metadata, StorageInfo, TensorEntry};
use crate::pickle::Value;
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The `.metadata` of a folder larger than this is refused (a 405B model's is a few MiB).
const MAX_METADATA_BYTES: u64 = 1 << 30;

/// Bytes a value item may decompress to (values are a few hundred bytes).
const MAX_VALUE_BYTES: u64 = 64 << 20;

/// The name of the file that makes a folder a complete DCP checkpoint.
pub const METADATA_FILE: &str = ".metadata";

/// An open checkpoint folder.
pub struct Checkpoint {
    dir: PathBuf,
    pub metadata: Metadata,
    /// The data files mapped so far, by name.
    maps: Mutex<HashMap<String, std::sync::Arc<memmap2::Mmap>>>,
}

fn io(path: &Path, what: &str, e: std::io::Error) -> DcpError {
    DcpError::Io {
        path: path.to_path_buf(),
        what: what.into(),
        source: e,
    }
}

/// True when `dir` holds a DCP checkpoint (its `.metadata`).
pub fn is_checkpoint(dir: &Path) -> bool {
    dir.join(METADATA_FILE).is_file()
}

impl Checkpoint {
    /// Opens the checkpoint in `dir` and checks its metadata.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let path = dir.join(METADATA_FILE);
        let len = std::fs::metadata(&path)
            .map_err(|e| io(&path, "cannot read the checkpoint's metadata", e))?
            .len();
        if len > MAX_METADATA_BYTES {
            return Err(DcpError::invalid(format!(
                "{}: {len} bytes, more than a checkpoint's metadata holds",
                path.display()
            )));
        }
        let bytes = std::fs::read(&path).map_err(|e| io(&path, "cannot read the checkpoint's metadata", e))?;
        let metadata = Metadata::read(&bytes).map_err(|e| e.within(&path.display().to_string()))?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            metadata,
            maps: Mutex::new(HashMap::new()),
        })
    }

    /// The folder it was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn map(&self, file: &str) -> Result<std::sync::Arc<memmap2::Mmap>> {
        let mut maps = self.maps.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = maps.get(file) {
            return Ok(m.clone());
        }
        let path = self.dir.join(file);
        // Said as content errors, so the key that needs the file is named with them.
        let unreadable = |e: std::io::Error| {
            DcpError::invalid(format!(
                "{}: the data file the metadata names cannot be read: {e}",
                path.display()
            ))
        };
        let f = std::fs::File::open(&path).map_err(unreadable)?;
        // SAFETY: the map is read only; a file changed while it is read shows changed
        // bytes, which every read checks as untrusted anyway.
        let m = std::sync::Arc::new(unsafe { memmap2::Mmap::map(&f) }.map_err(unreadable)?);
        maps.insert(file.to_string(), m.clone());
        Ok(m)
    }

    /// The bytes of the item at `info`, its transforms undone, at most `cap` of them.
    fn item(&self, info: &StorageInfo, cap: u64) -> Result<Vec<u8>> {
        let map = self.map(&info.file)?;
        let path = self.dir.join(&info.file);
        let end = info
            .offset
            .checked_add(info.length)
            .filter(|&e| e <= map.len() as u64)
            .ok_or_else(|| {
                DcpError::invalid(format!(
                    "{}: an item at {} of {} bytes reaches past the file's {} bytes",
                    path.display(),
                    info.offset,
                    info.length,
                    map.len()
                ))
            })?;
        let raw = &map[info.offset as usize..end as usize];
        let mut bytes = raw.to_vec();
        for t in info.transforms.iter().rev() {
            bytes = undo(t, &bytes, cap).map_err(|e| e.within(&path.display().to_string()))?;
        }
        Ok(bytes)
    }

    /// The value saved under `key` (a bytes entry).
    pub fn value(&self, key: &str) -> Result<Value> {
        let within = |e: DcpError| e.within(&format!("{}: key `{key}`", self.dir.display()));
        match self.metadata.entry(key) {
            Some(Entry::Bytes) => {}
            Some(Entry::Tensor(_)) => return Err(within(DcpError::invalid("a tensor, not a value"))),
            None => return Err(within(DcpError::invalid("not in the checkpoint"))),
        }
        let info = self.metadata.place(key, None).map_err(within)?;
        let bytes = self.item(info, MAX_VALUE_BYTES).map_err(within)?;
        Ok(read_archive(&bytes).map_err(within)?.pickle)
    }

    /// The tensor entry of `key`.
    pub fn tensor_entry(&self, key: &str) -> Result<&TensorEntry> {
        match self.metadata.entry(key) {
            Some(Entry::Tensor(t)) => Ok(t),
            Some(Entry::Bytes) => Err(DcpError::invalid(format!(
                "{}: key `{key}` holds a value, not a tensor",
                self.dir.display()
            ))),
            None => Err(DcpError::invalid(format!(
                "{}: key `{key}` is not in the checkpoint",
                self.dir.display()
            ))),
        }
    }

    /// The whole tensor saved under `key`.
    pub fn tensor(&self, key: &str) -> Result<TensorData> {
        let size = self.tensor_entry(key)?.size.clone();
        self.region(key, &Chunk::whole(&size))
    }

    /// The block `want` of the tensor saved under `key`, in its saved dtype: each saved
    /// chunk that meets it is read and its part copied into place.
    pub fn region(&self, key: &str, want: &Chunk) -> Result<TensorData> {
        let within = |e: DcpError| e.within(&format!("{}: key `{key}`", self.dir.display()));
        let t = self.tensor_entry(key)?;
        if want.offsets.len() != t.size.len() || Chunk::whole(&t.size).intersect(want).as_ref() != Some(want) {
            return Err(within(DcpError::invalid(format!(
                "asked for the block at {:?} of {:?}, outside its size {:?}",
                want.offsets, want.sizes, t.size
            ))));
        }
        let elem = t.dtype.size();
        let mut out = vec![0u8; want.numel() * elem];
        for c in &t.chunks {
            let Some(part) = c.intersect(want).filter(|p| p.numel() > 0) else {
                continue;
            };
            let info = self.metadata.place(key, Some(&c.offsets)).map_err(within)?;
            let cap = (c.numel() * elem) as u64 + (1 << 20);
            let bytes = self.item(info, cap).map_err(within)?;
            let saved = read_archive(&bytes).and_then(|a| a.tensor()).map_err(within)?;
            if saved.shape != c.sizes || saved.dtype != t.dtype {
                return Err(within(DcpError::invalid(format!(
                    "the chunk at {:?} holds a {:?} {} tensor, the metadata says {:?} {}",
                    c.offsets, saved.shape, saved.dtype, c.sizes, t.dtype
                ))));
            }
            copy_block(&saved.bytes, c, &mut out, want, &part, elem);
        }
        Ok(TensorData {
            dtype: t.dtype,
            shape: want.sizes.clone(),
            bytes: out,
        })
    }
}

/// Undoes transform `t` on `bytes`, refusing output past `cap` bytes.
fn undo(t: &str, bytes: &[u8], cap: u64) -> Result<Vec<u8>> {
    match t {
        "stream.zstd/1" => {
            let decoder = ruzstd::decoding::StreamingDecoder::new(bytes)
                .map_err(|e| DcpError::invalid(format!("a zstd item that does not start as one: {e}")))?;
            let mut out = Vec::new();
            decoder
                .take(cap + 1)
                .read_to_end(&mut out)
                .map_err(|e| DcpError::invalid(format!("a zstd item that does not decompress: {e}")))?;
            if out.len() as u64 > cap {
                return Err(DcpError::invalid(format!(
                    "a zstd item that decompresses past {cap} bytes, more than its tensor holds (a compression bomb?)"
                )));
            }
            Ok(out)
        }
        other => Err(DcpError::invalid(format!("transform `{other}` is not read"))),
    }
}

/// Copies `part` (global coordinates) from `src`, the chunk `from`, into `dst`, the block
/// `to`: row by row along the last dim.
fn copy_block(src: &[u8], from: &Chunk, dst: &mut [u8], to: &Chunk, part: &Chunk, elem: usize) {
    let dims = part.sizes.len();
    if part.numel() == 0 {
        return;
    }
    let strides = |sizes: &[usize]| {
        let mut s = vec![1usize; sizes.len()];
        for d in (0..sizes.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1] * sizes[d + 1];
        }
        s
    };
    let (ss, ds) = (strides(&from.sizes), strides(&to.sizes));
    if dims == 0 {
        dst[..elem].copy_from_slice(&src[..elem]);
        return;
    }
    let row = part.sizes[dims - 1] * elem;
    let rows: usize = part.sizes[..dims - 1].iter().product();
    let mut index = vec![0usize; dims - 1];
    for _ in 0..rows {
        let at = |start: &[usize], strides: &[usize]| -> usize {
            (0..dims)
                .map(|d| {
                    let i = if d + 1 < dims { index[d] } else { 0 };
                    (part.offsets[d] + i - start[d]) * strides[d]
                })
                .sum::<usize>()
                * elem
        };
        let (s, d) = (at(&from.offsets, &ss), at(&to.offsets, &ds));
        dst[d..d + row].copy_from_slice(&src[s..s + row]);
        for k in (0..dims - 1).rev() {
            index[k] += 1;
            if index[k] < part.sizes[k] {
                break;
            }
            index[k] = 0;
        }
    }
}
