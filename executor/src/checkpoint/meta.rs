//! `metadata.json`: what a checkpoint holds and where, read back and checked.

use super::io;
use crate::ExecError;
use serde::{Deserialize, Serialize};
use shardplan_models::ModelConfig;
use std::collections::HashMap;
use std::path::{Component, Path};

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

/// Steps, optimizer steps and data positions above this are refused: no run reaches 2^40,
/// and counters below it keep their products with batch sizes in u64.
pub(super) const MAX_COUNTER: u64 = 1 << 40;

/// Element size of a tensor dtype a checkpoint (or an export) may hold.
pub(super) fn dtype_size(dtype: &str) -> Option<u64> {
    match dtype {
        "F32" => Some(4),
        "BF16" | "F16" => Some(2),
        _ => None,
    }
}

/// Reads and checks `metadata.json` of a step folder: the fields against each other (see
/// [`check`]) and the files it lists against the disk.
///
/// The metadata is untrusted input. Once it is returned, every row range and byte count it
/// holds is bounded by the sizes of files on disk, so loads may allocate and index by them.
pub fn read_metadata(dir: &Path) -> Result<Metadata, ExecError> {
    let path = dir.join("metadata.json");
    let text = std::fs::read_to_string(&path).map_err(|e| io(&path, "cannot read", e))?;
    let de = &mut serde_json::Deserializer::from_str(&text);
    let m: Metadata = serde_path_to_error::deserialize(de).map_err(|e| {
        let inner = e.inner();
        let msg = inner.to_string();
        // serde_json ends its message with the position, which leads ours instead.
        let msg = msg.rsplit_once(" at line ").map_or(msg.as_str(), |(m, _)| m);
        let field = e.path().to_string();
        let field = if field == "." {
            String::new()
        } else {
            format!("`{field}`: ")
        };
        ExecError::Checkpoint(format!(
            "{}:{}:{}: {field}{msg}; {FIX}",
            path.display(),
            inner.line(),
            inner.column()
        ))
    })?;
    if m.format != CHECKPOINT_FORMAT {
        return Err(ExecError::Checkpoint(format!(
            "{}: `format`: checkpoint format {} (this shardplan reads {CHECKPOINT_FORMAT})",
            path.display(),
            m.format
        )));
    }
    check(&m).map_err(|e| ExecError::Checkpoint(format!("{}: {e}; {FIX}", path.display())))?;
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

/// What to do about metadata that fails its checks.
const FIX: &str = "the metadata was damaged or edited: resume from another `step-N` folder";

/// A field of the metadata that fails a check: its path (`tensors[3].pieces[0].end`) and
/// what is wrong with it.
#[derive(Debug)]
pub(super) struct BadField {
    pub field: String,
    pub problem: String,
}

impl std::fmt::Display for BadField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` {}", self.field, self.problem)
    }
}

fn bad(field: impl Into<String>, problem: String) -> BadField {
    BadField {
        field: field.into(),
        problem,
    }
}

/// Checks the fields of a metadata against each other, in checked arithmetic: counters under
/// [`MAX_COUNTER`]; files named by plain names, each listed once; tensors named once, of a
/// known dtype, whose pieces cover their rows in order without gaps or overlaps, each piece's
/// blocks its rows, and the pieces in each file no more bytes than the file's listed size.
/// The saver runs it too, so it never writes a metadata a load would refuse.
pub(super) fn check(m: &Metadata) -> Result<(), BadField> {
    for (field, v) in [
        ("step", m.step),
        ("optimizer_steps", m.optimizer_steps),
        ("data_position", m.data_position),
    ] {
        if v > MAX_COUNTER {
            return Err(bad(field, format!("is {v}, more than any run reaches ({MAX_COUNTER})")));
        }
    }
    let mut room: HashMap<&str, u64> = HashMap::new();
    for (i, f) in m.files.iter().enumerate() {
        let plain = matches!(
            Path::new(&f.name).components().collect::<Vec<_>>()[..],
            [Component::Normal(n)] if n == f.name.as_str()
        );
        if !plain {
            return Err(bad(
                format!("files[{i}].name"),
                format!("is {:?}, not the name of a file in the checkpoint folder", f.name),
            ));
        }
        if room.insert(&f.name, f.bytes).is_some() {
            return Err(bad(format!("files[{i}].name"), format!("lists `{}` twice", f.name)));
        }
    }
    let mut names = std::collections::HashSet::new();
    for (ti, t) in m.tensors.iter().enumerate() {
        let at = |field: &str| format!("tensors[{ti}].{field}");
        if !names.insert(t.name.as_str()) {
            return Err(bad(at("name"), format!("lists `{}` twice", t.name)));
        }
        let of = format!("(tensor `{}`)", t.name);
        let size = dtype_size(&t.dtype).ok_or_else(|| {
            bad(
                at("dtype"),
                format!("is {:?} {of}; a checkpoint holds F32, BF16 or F16", t.dtype),
            )
        })?;
        let rows = t.shape.first().copied().unwrap_or(1);
        let row_bytes = t
            .shape
            .iter()
            .skip(1)
            .try_fold(size, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                bad(
                    at("shape"),
                    format!("is {:?} {of}: a row's bytes overflow 64 bits", t.shape),
                )
            })?;
        let mut next = 0u64;
        for (pi, p) in t.pieces.iter().enumerate() {
            let at = |field: &str| at(&format!("pieces[{pi}].{field}"));
            let left = room.get_mut(p.file.as_str()).ok_or_else(|| {
                bad(
                    at("file"),
                    format!("is {:?} {of}, a file that `files` does not list", p.file),
                )
            })?;
            if p.start != next {
                return Err(bad(
                    at("start"),
                    format!(
                        "is {} {of}, expected {next}: pieces cover rows 0..{rows} in order, without gaps or overlaps",
                        p.start
                    ),
                ));
            }
            if p.end <= p.start || p.end > rows {
                return Err(bad(
                    at("end"),
                    format!(
                        "is {} {of}: it must be above start {} and at most the {rows} rows of `shape`",
                        p.end, p.start
                    ),
                ));
            }
            let n = p.end - p.start;
            let bytes = n.checked_mul(row_bytes).filter(|&b| b <= *left).ok_or_else(|| {
                bad(
                    at("end"),
                    format!(
                        "is {} {of}: rows {}..{} of {row_bytes} bytes do not fit in the {} bytes `files` lists for `{}` beside its other tensors",
                        p.end, p.start, p.end, room_of(m, &p.file), p.file
                    ),
                )
            })?;
            *left -= bytes;
            let mut covered = 0u64;
            for (bi, b) in p.blocks.iter().enumerate() {
                covered = covered
                    .checked_add(b.rows)
                    .filter(|&c| b.rows > 0 && c <= n)
                    .ok_or_else(|| {
                        bad(
                            at(&format!("blocks[{bi}].rows")),
                            format!(
                                "is {} {of}: blocks hold 1 or more rows, {n} in all for rows {}..{}",
                                b.rows, p.start, p.end
                            ),
                        )
                    })?;
            }
            if covered != n {
                return Err(bad(
                    at("blocks"),
                    format!(
                        "hold {covered} rows {of}, the piece has {n} (rows {}..{})",
                        p.start, p.end
                    ),
                ));
            }
            next = p.end;
        }
        if next != rows {
            return Err(bad(
                at("pieces"),
                format!("cover rows 0..{next} {of}; `shape` {:?} has {rows} rows", t.shape),
            ));
        }
    }
    Ok(())
}

/// The size `files` lists for `file`.
fn room_of(m: &Metadata, file: &str) -> u64 {
    m.files.iter().find(|f| f.name == file).map_or(0, |f| f.bytes)
}
