//! Reading safetensors files: headers, byte ranges, and a tensor's rows from the
//! checksummed blocks of a checkpoint.

use super::io;
use super::meta::{dtype_size, TensorMeta};
use crate::ExecError;
use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// A safetensors file's header: each tensor's dtype, shape and absolute data range.
pub(crate) struct Header {
    pub(super) tensors: HashMap<String, (String, Vec<u64>, u64, u64)>,
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
    let json: serde_json::Value = serde_json::from_slice(&h).map_err(|e| {
        ExecError::Checkpoint(format!(
            "{}: bad safetensors header (the JSON at bytes 8..{}): {e}",
            path.display(),
            8 + n
        ))
    })?;
    let entries = json.as_object().ok_or_else(|| {
        ExecError::Checkpoint(format!(
            "{}: bad safetensors header (bytes 8..{}): not a JSON object",
            path.display(),
            8 + n
        ))
    })?;
    // The header is untrusted: every field is checked, offsets in checked arithmetic.
    let data = 8 + n;
    let mut tensors = HashMap::new();
    for (k, v) in entries {
        if k == "__metadata__" {
            continue;
        }
        let bad = |what: String| {
            ExecError::Checkpoint(format!(
                "{}: bad safetensors header: tensor `{k}`: {what}",
                path.display()
            ))
        };
        let dtype = v["dtype"]
            .as_str()
            .ok_or_else(|| bad(format!("`dtype` is {}, not a string", v["dtype"])))?
            .to_string();
        let shape = v["shape"]
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| bad(format!("`shape` is {}, not a list of sizes", v["shape"])))?;
        let off = &v["data_offsets"];
        let range = match off.as_array().map(Vec::as_slice) {
            Some([a, b]) => a.as_u64().zip(b.as_u64()),
            _ => None,
        }
        .and_then(|(a, b)| data.checked_add(a).zip(data.checked_add(b)))
        .filter(|&(a, b)| a <= b && b <= len)
        .ok_or_else(|| {
            bad(format!(
                "`data_offsets` {off} is not a range inside the file's {len} bytes"
            ))
        })?;
        tensors.insert(k.clone(), (dtype, shape, range.0, range.1));
    }
    Ok(Header { tensors })
}

/// Reads `len` bytes of `path` from `start`; a range past the end of the file is refused
/// before anything is allocated.
pub(super) fn read_range(path: &Path, start: u64, len: u64, what: &str) -> Result<Vec<u8>, ExecError> {
    let mut f = File::open(path).map_err(|e| io(path, "cannot open", e))?;
    let size = f.metadata().map_err(|e| io(path, "cannot stat", e))?.len();
    let truncated = || {
        ExecError::Checkpoint(format!(
            "{}: truncated: `{what}` runs past the end of the file",
            path.display()
        ))
    };
    if start.checked_add(len).is_none_or(|end| end > size) {
        return Err(truncated());
    }
    f.seek(SeekFrom::Start(start)).map_err(|e| io(path, "seek", e))?;
    let mut buf = vec![0u8; len as usize];
    f.read_exact(&mut buf).map_err(|_| truncated())?;
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

/// Rows `want` of tensor `t` from a checkpoint, as f32, reading only the blocks that
/// overlap them and checking their checksums.
///
/// `t` comes from [`super::read_metadata`], which bounds its sizes by the files on disk, so
/// the arithmetic on them here cannot overflow; the rank files' headers are checked here.
pub(crate) fn read_rows(
    dir: &Path,
    t: &TensorMeta,
    want: std::ops::Range<u64>,
    headers: &mut HashMap<String, Header>,
) -> Result<Vec<f32>, ExecError> {
    if want.end > t.shape.first().copied().unwrap_or(1) {
        return Err(ExecError::Internal(format!(
            "rows {want:?} of `{}`, shape {:?}",
            t.name, t.shape
        )));
    }
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
        // The piece's rows, each shaped as the tensor's (a scalar is stored as one row).
        let want_shape: Vec<u64> = std::iter::once(p.end - p.start)
            .chain(t.shape.iter().skip(1).copied())
            .collect();
        if shape != want_shape || end - begin != (p.end - p.start) * row_bytes {
            return Err(ExecError::Checkpoint(format!(
                "{}: tensor `{}` has shape {shape:?} and {} bytes, the checkpoint says {want_shape:?}, {} bytes",
                path.display(),
                p.key,
                end - begin,
                (p.end - p.start) * row_bytes
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
