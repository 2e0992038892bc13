//! torch.save archives: the zip that holds one saved value, its pickle (`data.pkl`) and
//! the bytes of every storage the pickle names (`data/<key>`). A DCP item is one.
//!
//! Read: the zip's directory (the `zip` crate), then each stored entry's bytes are sliced
//! out of the item as they lie, after checking they lie inside it; compressed entries
//! are refused (torch writes none). Written as torch writes them: every entry stored,
//! its data on a 64-byte boundary, `version` present (torch.load requires it).

use crate::dtype::DType;
use crate::error::{DcpError, Result};
use crate::pickle::{self, Construct, Global, Value};
use std::collections::HashMap;
use std::io::{Cursor, Write};

/// A tensor's elements, row-major and contiguous, little-endian.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorData {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl TensorData {
    /// Elements (1 for a 0-d tensor).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// What a torch.save archive holds: its pickle and each storage's bytes by key.
pub struct Archive<'a> {
    pub pickle: Value,
    storages: HashMap<String, &'a [u8]>,
}

/// The globals a torch.save pickle in a checkpoint may name: the tensor rebuild, its
/// storages and dtypes, the containers torch uses, and the byte containers of older
/// torchtitan values (`bytes` in protocol 2 is `_codecs.encode`; `io.BytesIO`).
pub fn archive_globals(g: &Global) -> bool {
    match g.module.as_str() {
        "torch" => {
            g.name == "Size"
                || DType::from_storage_class(&g.name).is_some()
                || DType::from_torch_name(&g.name).is_some()
        }
        "torch._utils" => g.name == "_rebuild_tensor_v2",
        "collections" => g.name == "OrderedDict",
        "_codecs" => g.name == "encode",
        "_io" => g.name == "BytesIO",
        _ => false,
    }
}

/// Reads the archive `bytes` (one DCP item).
pub fn read_archive(bytes: &[u8]) -> Result<Archive<'_>> {
    let bad = |w: String| DcpError::invalid(format!("not a torch.save archive: {w}"));
    let mut zip = zip::ZipArchive::new(Cursor::new(bytes)).map_err(|e| bad(e.to_string()))?;
    let mut entries: HashMap<String, &[u8]> = HashMap::new();
    for i in 0..zip.len() {
        let f = zip.by_index_raw(i).map_err(|e| bad(e.to_string()))?;
        let name = f.name().map_err(|e| bad(e.to_string()))?.to_string();
        if f.is_dir() {
            continue;
        }
        if f.compression() != zip::CompressionMethod::Stored || f.compressed_size() != f.size() {
            return Err(bad(format!("entry `{name}` is compressed (torch stores every entry)")));
        }
        let start = f
            .data_start()
            .ok_or_else(|| bad(format!("entry `{name}` has no data offset")))?;
        let end = start
            .checked_add(f.size())
            .filter(|&e| e <= bytes.len() as u64)
            .ok_or_else(|| bad(format!("entry `{name}` ends past the item ({} bytes)", bytes.len())))?;
        let data = &bytes[start as usize..end as usize];
        // torch records each entry's CRC in the directory (and does not check it on load);
        // checked here, a flipped byte is refused rather than read as another value.
        if crc32fast::hash(data) != f.crc32() {
            return Err(bad(format!("entry `{name}` does not match its CRC-32")));
        }
        entries.insert(name, data);
    }
    let pkl = entries
        .keys()
        .find(|k| k.ends_with("data.pkl") && k.matches('/').count() <= 1)
        .cloned()
        .ok_or_else(|| bad("no `data.pkl`".into()))?;
    let prefix = pkl.trim_end_matches("data.pkl").to_string();
    if !entries.contains_key(&format!("{prefix}version")) {
        return Err(bad(format!("no `{prefix}version` entry")));
    }
    let pickle =
        pickle::read(entries[&pkl], &archive_globals).map_err(|e| DcpError::invalid(format!("its `data.pkl`: {e}")))?;
    let data_dir = format!("{prefix}data/");
    let storages = entries
        .into_iter()
        .filter_map(|(k, v)| k.strip_prefix(&data_dir).map(|key| (key.to_string(), v)))
        .collect();
    Ok(Archive { pickle, storages })
}

impl Archive<'_> {
    /// The tensor the pickle rebuilds (`torch._utils._rebuild_tensor_v2`), its elements
    /// gathered by its size, stride and storage offset.
    pub fn tensor(&self) -> Result<TensorData> {
        let bad = |w: &str| DcpError::invalid(format!("the item's tensor: {w}"));
        let Value::Object { class, args, .. } = &self.pickle else {
            return Err(bad(&format!("the item holds {}, not a tensor", self.pickle.kind())));
        };
        if class.name != "_rebuild_tensor_v2" || args.len() < 4 {
            return Err(bad(&format!("the item holds a `{class}` call, not a tensor")));
        }
        let (dtype, key, numel) =
            storage_of(&args[0]).ok_or_else(|| bad("its storage is not ('storage', class, key, location, numel)"))?;
        let storage = self
            .storages
            .get(&key)
            .ok_or_else(|| bad(&format!("its storage `data/{key}` is not in the archive")))?;
        let need = numel
            .checked_mul(dtype.size())
            .ok_or_else(|| bad("a storage too large"))?;
        if storage.len() < need {
            return Err(bad(&format!(
                "its storage holds {} bytes, {numel} elements of {dtype} need {need}",
                storage.len()
            )));
        }
        let offset = int(&args[1]).ok_or_else(|| bad("its storage offset is not a non-negative int"))?;
        let shape = ints(&args[2]).ok_or_else(|| bad("its size is not a tuple of non-negative ints"))?;
        let stride = ints(&args[3]).ok_or_else(|| bad("its stride is not a tuple of non-negative ints"))?;
        if stride.len() != shape.len() {
            return Err(bad("its size and stride differ in length"));
        }
        let bytes = gather(&storage[..need], dtype.size(), offset, &shape, &stride)
            .ok_or_else(|| bad("its size and stride reach past its storage"))?;
        Ok(TensorData { dtype, shape, bytes })
    }
}

/// `('storage', torch.XStorage, key, location, numel)` → (dtype, key, numel).
fn storage_of(v: &Value) -> Option<(DType, String, usize)> {
    let Value::PersistentId(pid) = v else { return None };
    let Value::Tuple(t) = pid.as_ref() else { return None };
    match t.as_slice() {
        [Value::Str(kind), Value::Global(class), Value::Str(key), _, numel] if kind == "storage" => {
            Some((DType::from_storage_class(&class.name)?, key.clone(), int(numel)?))
        }
        _ => None,
    }
}

fn int(v: &Value) -> Option<usize> {
    match v {
        Value::Int(i) => usize::try_from(*i).ok(),
        _ => None,
    }
}

fn ints(v: &Value) -> Option<Vec<usize>> {
    match v {
        Value::Tuple(items) => items.iter().map(int).collect(),
        _ => None,
    }
}

/// The elements of a `shape`/`stride` view at `offset` into `storage` (elements of
/// `size` bytes), row-major; `None` when the view reaches past the storage.
fn gather(storage: &[u8], size: usize, offset: usize, shape: &[usize], stride: &[usize]) -> Option<Vec<u8>> {
    let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    if numel == 0 {
        return Some(Vec::new());
    }
    // The furthest element the view reads.
    let last = shape
        .iter()
        .zip(stride)
        .try_fold(offset, |a, (&d, &s)| a.checked_add((d - 1).checked_mul(s)?))?;
    if last.checked_add(1)?.checked_mul(size)? > storage.len() {
        return None;
    }
    let contiguous = {
        let mut want = 1;
        let mut ok = true;
        for (&d, &s) in shape.iter().zip(stride).rev() {
            ok &= d == 1 || s == want;
            want *= d;
        }
        ok
    };
    if contiguous {
        return Some(storage[offset * size..(offset + numel) * size].to_vec());
    }
    let mut out = Vec::with_capacity(numel * size);
    let mut index = vec![0usize; shape.len()];
    for _ in 0..numel {
        let at = offset + index.iter().zip(stride).map(|(i, s)| i * s).sum::<usize>();
        out.extend_from_slice(&storage[at * size..(at + 1) * size]);
        for d in (0..shape.len()).rev() {
            index[d] += 1;
            if index[d] < shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Some(out)
}

/// The pickle torch.save writes for a contiguous tensor on the CPU whose storage is
/// `data/0`.
fn tensor_pickle(t: &TensorData) -> Value {
    let tuple = |xs: &[usize]| Value::Tuple(xs.iter().map(|&x| Value::Int(x as i64)).collect());
    let mut stride = vec![1usize; t.shape.len()];
    for d in (0..t.shape.len().saturating_sub(1)).rev() {
        stride[d] = stride[d + 1] * t.shape[d + 1];
    }
    let storage = Value::PersistentId(Box::new(Value::Tuple(vec![
        Value::str("storage"),
        Value::Global(Global::new("torch", t.dtype.storage_class())),
        Value::str("0"),
        Value::str("cpu"),
        Value::Int(t.numel() as i64),
    ])));
    Value::Object {
        class: Global::new("torch._utils", "_rebuild_tensor_v2"),
        by: Construct::Call,
        args: vec![
            storage,
            Value::Int(0),
            tuple(&t.shape),
            tuple(&stride),
            Value::Bool(false),
            Value::Object {
                class: Global::new("collections", "OrderedDict"),
                by: Construct::Call,
                args: vec![],
                state: None,
            },
        ],
        state: None,
    }
}

/// The archive torch.save writes for `t`.
pub fn write_tensor(t: &TensorData) -> Result<Vec<u8>> {
    if t.bytes.len() != t.numel() * t.dtype.size() {
        return Err(DcpError::invalid(format!(
            "a {:?} {} tensor of {} bytes",
            t.shape,
            t.dtype,
            t.bytes.len()
        )));
    }
    write_archive(&tensor_pickle(t), &[("0", &t.bytes)])
}

/// The archive torch.save writes for a value without tensors (a DCP bytes item).
pub fn write_value(v: &Value) -> Result<Vec<u8>> {
    write_archive(v, &[])
}

/// An archive of `pickle` and `storages` (key, bytes), laid out as torch lays it out.
pub fn write_archive(pickle: &Value, storages: &[(&str, &[u8])]) -> Result<Vec<u8>> {
    let mut zip = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let options = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .with_alignment(64)
        .large_file(storages.iter().any(|(_, b)| b.len() as u64 >= u32::MAX as u64));
    let failed = |e: zip::result::ZipError| DcpError::invalid(format!("writing a torch.save archive: {e}"));
    let mut entry = |name: &str, bytes: &[u8]| -> Result<()> {
        zip.start_file(format!("archive/{name}"), options).map_err(failed)?;
        zip.write_all(bytes).map_err(|e| failed(zip::result::ZipError::Io(e)))
    };
    entry("data.pkl", &pickle::write(pickle))?;
    entry(".format_version", b"1")?;
    entry(".storage_alignment", b"64")?;
    entry("byteorder", b"little")?;
    for (key, bytes) in storages {
        entry(&format!("data/{key}"), bytes)?;
    }
    entry("version", b"3\n")?;
    Ok(zip.finish().map_err(failed)?.into_inner())
}
