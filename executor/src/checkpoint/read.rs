//! Reading safetensors files: headers, byte ranges, and a tensor's rows from the
//! checksummed blocks of a checkpoint.

use super::io;
use super::meta::TensorMeta;
use crate::ExecError;
use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// A safetensors file's header: each tensor's dtype, shape and absolute data range.
pub(super) struct Header {
    pub(super) tensors: HashMap<String, (String, Vec<u64>, u64, u64)>,
    pub(super) len: u64,
}

pub(super) fn read_header(path: &Path) -> Result<Header, ExecError> {
    let mut f = File::open(path).map_err(|e| io(path, "cannot open", e))?;
    let len = f.metadata().map_err(|e| io(path, "cannot stat", e))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| ExecError::Checkpoint(format!("{}: truncated: no safetensors header", path.display())))?;
    let n = u64::from_le_bytes(n);
    if n > 100 << 20 || 8 + n > len {
        return Err(ExecError::Checkpoint(format!(
            "{}: truncated or not a safetensors file (header of {n} bytes in a {len}-byte file)",
            path.display()
        )));
    }
    let mut h = vec![0u8; n as usize];
    f.read_exact(&mut h).map_err(|e| io(path, "reading the header", e))?;
    let json: serde_json::Value = serde_json::from_slice(&h)
        .map_err(|e| ExecError::Checkpoint(format!("{}: bad safetensors header: {e}", path.display())))?;
    let mut tensors = HashMap::new();
    for (k, v) in json.as_object().into_iter().flatten() {
        if k == "__metadata__" {
            continue;
        }
        let dtype = v["dtype"].as_str().unwrap_or("?").to_string();
        let shape: Vec<u64> = v["shape"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_u64())
            .collect();
        let off = &v["data_offsets"];
        let (a, b) = (off[0].as_u64().unwrap_or(0), off[1].as_u64().unwrap_or(0));
        tensors.insert(k.clone(), (dtype, shape, 8 + n + a, 8 + n + b));
    }
    Ok(Header { tensors, len })
}

/// Reads bytes `range` of `path`.
pub(super) fn read_range(path: &Path, start: u64, len: u64, what: &str) -> Result<Vec<u8>, ExecError> {
    let mut f = File::open(path).map_err(|e| io(path, "cannot open", e))?;
    f.seek(SeekFrom::Start(start)).map_err(|e| io(path, "seek", e))?;
    let mut buf = vec![0u8; len as usize];
    f.read_exact(&mut buf).map_err(|_| {
        ExecError::Checkpoint(format!(
            "{}: truncated: `{what}` runs past the end of the file",
            path.display()
        ))
    })?;
    Ok(buf)
}

/// Converts little-endian elements of `dtype` to f32.
pub(super) fn to_f32(bytes: &[u8], dtype: &str) -> Option<Vec<f32>> {
    Some(match dtype {
        "F32" => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        "BF16" => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        "F16" => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

pub(super) fn dtype_size(dtype: &str) -> Option<u64> {
    match dtype {
        "F32" => Some(4),
        "BF16" | "F16" => Some(2),
        _ => None,
    }
}

/// Rows `want` of tensor `t` from a checkpoint, as f32, reading only the blocks that
/// overlap them and checking their checksums.
pub(super) fn read_rows(
    dir: &Path,
    t: &TensorMeta,
    want: std::ops::Range<u64>,
    headers: &mut HashMap<String, Header>,
) -> Result<Vec<f32>, ExecError> {
    let row_elems: u64 = t.shape.iter().skip(1).product();
    let mut out = vec![0f32; ((want.end - want.start) * row_elems) as usize];
    let mut covered = 0u64;
    for p in &t.pieces {
        let (s, e) = (p.start.max(want.start), p.end.min(want.end));
        if s >= e {
            continue;
        }
        let path = dir.join(&p.file);
        if !headers.contains_key(&p.file) {
            headers.insert(p.file.clone(), read_header(&path)?);
        }
        let h = &headers[&p.file];
        let (dtype, shape, begin, end) = h.tensors.get(&p.key).cloned().ok_or_else(|| {
            ExecError::Checkpoint(format!(
                "{}: tensor `{}` is missing from the file",
                path.display(),
                p.key
            ))
        })?;
        if dtype != t.dtype {
            return Err(ExecError::Checkpoint(format!(
                "{}: tensor `{}` is {dtype}, the checkpoint says {}",
                path.display(),
                p.key,
                t.dtype
            )));
        }
        let size = dtype_size(&dtype).unwrap_or(4);
        let row_bytes = row_elems * size;
        if shape.first().copied().unwrap_or(1) != p.end - p.start
            || end - begin != (p.end - p.start) * row_bytes
            || end > h.len
        {
            return Err(ExecError::Checkpoint(format!(
                "{}: tensor `{}` has shape {shape:?} and {} bytes, the checkpoint says {} rows of {row_bytes} bytes",
                path.display(),
                p.key,
                end - begin,
                p.end - p.start
            )));
        }
        // The checksummed blocks covering rows s..e of this piece.
        let mut row = p.start;
        for b in &p.blocks {
            let (bs, be) = (row, row + b.rows);
            row = be;
            if be <= s || bs >= e {
                continue;
            }
            let bytes = read_range(&path, begin + (bs - p.start) * row_bytes, b.rows * row_bytes, &p.key)?;
            if crc32fast::hash(&bytes) != b.crc32 {
                return Err(ExecError::Checkpoint(format!(
                    "{}: tensor `{}` rows {bs}..{be} fail their checksum: the file is corrupted",
                    path.display(),
                    p.key
                )));
            }
            let vals = to_f32(&bytes, &dtype)
                .ok_or_else(|| ExecError::Checkpoint(format!("{}: unsupported dtype {dtype}", path.display())))?;
            let (cs, ce) = (s.max(bs), e.min(be));
            let src = ((cs - bs) * row_elems) as usize..((ce - bs) * row_elems) as usize;
            let dst = ((cs - want.start) * row_elems) as usize;
            out[dst..dst + src.len()].copy_from_slice(&vals[src]);
            covered += ce - cs;
        }
    }
    if covered != want.end - want.start {
        return Err(ExecError::Checkpoint(format!(
            "{}: tensor `{}` rows {}..{} are not all in the checkpoint",
            dir.display(),
            t.name,
            want.start,
            want.end
        )));
    }
    Ok(out)
}
