//! A DCP checkpoint's `.metadata`: every key of the saved state dict (a tensor with its
//! global size and the chunks it was saved in, or a value saved as bytes) and where each
//! chunk or value lies (file, offset, length, transforms).
//!
//! Read from the pickle torch's `pickle.dump` writes (the classes of
//! `torch.distributed.checkpoint`, which only name here), checked once
//! ([`Metadata::check`]): every chunk inside its tensor, no two overlapping, together
//! covering it, each with a place in a file of the folder. Written as torch writes it,
//! so `dcp.load` reads it.

use crate::dtype::DType;
use crate::error::{DcpError, Result};
use crate::pickle::{self, Construct, Global, Value};
use std::collections::HashMap;

/// What one key of the state dict holds.
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    Tensor(TensorEntry),
    /// A value saved as a torch.save archive of its own (an int, a float, a tuple...).
    Bytes,
}

/// A saved tensor: its dtype, global size and the chunks it was saved in.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorEntry {
    pub dtype: DType,
    pub size: Vec<usize>,
    pub chunks: Vec<Chunk>,
}

/// A block of a tensor: where it starts in each dim and how far it reaches.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Chunk {
    pub offsets: Vec<usize>,
    pub sizes: Vec<usize>,
}

impl Chunk {
    /// The whole of a tensor of `size`.
    pub fn whole(size: &[usize]) -> Chunk {
        Chunk {
            offsets: vec![0; size.len()],
            sizes: size.to_vec(),
        }
    }

    pub fn numel(&self) -> usize {
        self.sizes.iter().product()
    }

    /// Where this chunk and `other` meet, if they do.
    pub fn intersect(&self, other: &Chunk) -> Option<Chunk> {
        let mut out = Chunk {
            offsets: Vec::new(),
            sizes: Vec::new(),
        };
        for d in 0..self.offsets.len() {
            let start = self.offsets[d].max(other.offsets[d]);
            let end = (self.offsets[d] + self.sizes[d]).min(other.offsets[d] + other.sizes[d]);
            if end <= start && !(self.sizes[d] == 0 && other.sizes[d] == 0) {
                return None;
            }
            out.offsets.push(start);
            out.sizes.push(end.saturating_sub(start));
        }
        Some(out)
    }
}

/// Where one saved chunk or value lies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageInfo {
    /// A file of the checkpoint's folder.
    pub file: String,
    pub offset: u64,
    pub length: u64,
    /// The transforms applied after torch.save (`stream.zstd/1`), in the order to undo.
    pub transforms: Vec<String>,
}

/// A key and, for a tensor, the chunk's offsets: how `storage` is looked up.
pub type StorageKey = (String, Option<Vec<usize>>);

/// A checkpoint's metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct Metadata {
    /// The state dict's keys, in the order saved.
    pub entries: Vec<(String, Entry)>,
    pub storage: HashMap<StorageKey, StorageInfo>,
    /// Each key's path in the nested state dict it was flattened from (`planner_data`).
    pub paths: HashMap<String, Vec<String>>,
}

/// The transforms this reader undoes.
pub const TRANSFORMS: [&str; 1] = ["stream.zstd/1"];

const MD: &str = "torch.distributed.checkpoint.metadata";

/// The globals a `.metadata` pickle may name.
pub fn metadata_globals(g: &Global) -> bool {
    match g.module.as_str() {
        MD => matches!(
            g.name.as_str(),
            "Metadata"
                | "TensorStorageMetadata"
                | "BytesStorageMetadata"
                | "TensorProperties"
                | "ChunkStorageMetadata"
                | "MetadataIndex"
                | "StorageMeta"
                | "_MEM_FORMAT_ENCODING"
        ),
        "torch.distributed.checkpoint.filesystem" => g.name == "_StorageInfo",
        "torch" => g.name == "Size" || DType::from_torch_name(&g.name).is_some(),
        "torch.serialization" => g.name == "_get_layout",
        "pathlib" | "pathlib._local" => g.name.ends_with("Path"),
        "collections" => g.name == "OrderedDict",
        _ => false,
    }
}

fn bad(what: impl Into<String>) -> DcpError {
    DcpError::invalid(what)
}

/// The state dict of a dataclass object of `class` (NEWOBJ + BUILD).
fn fields<'a>(v: &'a Value, class: &str) -> Result<&'a Value> {
    match v {
        Value::Object {
            class: c,
            state: Some(s),
            ..
        } if c.name == class => Ok(s),
        _ => Err(bad(format!("expected a `{class}`, found {}", v.kind()))),
    }
}

fn field<'a>(v: &'a Value, class: &str, name: &str) -> Result<&'a Value> {
    fields(v, class)?
        .get(name)
        .ok_or_else(|| bad(format!("a `{class}` without its `{name}`")))
}

fn int(v: &Value, what: &str) -> Result<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).map_err(|_| bad(format!("{what} is {i}"))),
        _ => Err(bad(format!("{what} is {}, not an int", v.kind()))),
    }
}

/// A `torch.Size` (or a plain tuple) of non-negative ints.
fn dims(v: &Value, what: &str) -> Result<Vec<usize>> {
    let items = match v {
        Value::Object { class, args, .. } if class.name == "Size" => match args.as_slice() {
            [Value::Tuple(t)] | [Value::List(t)] => t,
            _ => return Err(bad(format!("{what} is a malformed torch.Size"))),
        },
        Value::Tuple(t) => t,
        _ => return Err(bad(format!("{what} is {}, not a torch.Size", v.kind()))),
    };
    items
        .iter()
        .map(|x| {
            let n = int(x, what)?;
            usize::try_from(n).map_err(|_| bad(format!("{what} holds {n}")))
        })
        .collect()
}

fn dtype(properties: &Value) -> Result<DType> {
    // TensorProperties' state is a tuple whose first element is the dtype.
    let first = match properties {
        Value::Object {
            class, state: Some(s), ..
        } if class.name == "TensorProperties" => match s.as_ref() {
            Value::Tuple(t) => t.first(),
            d @ Value::Dict(_) => d.get("dtype"),
            _ => None,
        },
        _ => None,
    };
    match first {
        Some(Value::Global(g)) if g.module == "torch" => {
            DType::from_torch_name(&g.name).ok_or_else(|| bad(format!("a tensor of dtype `{g}`, which is not read")))
        }
        _ => Err(bad("a tensor's properties without a torch dtype")),
    }
}

fn entry(v: &Value) -> Result<Entry> {
    match v {
        Value::Object { class, .. } if class.name == "BytesStorageMetadata" => Ok(Entry::Bytes),
        _ => {
            let c = "TensorStorageMetadata";
            let dtype = dtype(field(v, c, "properties")?)?;
            let size = dims(field(v, c, "size")?, "a tensor's size")?;
            let Value::List(list) = field(v, c, "chunks")? else {
                return Err(bad("a tensor's chunks are not a list"));
            };
            let chunks = list
                .iter()
                .map(|ch| {
                    let c = "ChunkStorageMetadata";
                    Ok(Chunk {
                        offsets: dims(field(ch, c, "offsets")?, "a chunk's offsets")?,
                        sizes: dims(field(ch, c, "sizes")?, "a chunk's sizes")?,
                    })
                })
                .collect::<Result<Vec<Chunk>>>()?;
            Ok(Entry::Tensor(TensorEntry { dtype, size, chunks }))
        }
    }
}

fn storage_key(v: &Value) -> Result<StorageKey> {
    let c = "MetadataIndex";
    let Value::Str(fqn) = field(v, c, "fqn")? else {
        return Err(bad("a storage index whose key is not a string"));
    };
    let offset = match fields(v, c)?.get("offset") {
        None | Some(Value::None) => None,
        Some(o) => Some(dims(o, "a storage index's offset")?),
    };
    Ok((fqn.clone(), offset))
}

fn storage_info(v: &Value) -> Result<StorageInfo> {
    let c = "_StorageInfo";
    let Value::Str(file) = field(v, c, "relative_path")? else {
        return Err(bad("a storage file name that is not a string"));
    };
    let transforms = match fields(v, c)?.get("transform_descriptors") {
        None | Some(Value::None) => Vec::new(),
        Some(Value::List(t)) | Some(Value::Tuple(t)) => t
            .iter()
            .map(|x| match x {
                Value::Str(s) => Ok(s.clone()),
                _ => Err(bad("a transform that is not a string")),
            })
            .collect::<Result<_>>()?,
        Some(other) => return Err(bad(format!("transforms given as {}", other.kind()))),
    };
    Ok(StorageInfo {
        file: file.clone(),
        offset: int(field(v, c, "offset")?, "a storage offset")?,
        length: int(field(v, c, "length")?, "a storage length")?,
        transforms,
    })
}

fn dict<'a>(v: Option<&'a Value>, what: &str) -> Result<&'a [(Value, Value)]> {
    match v {
        Some(Value::Dict(items)) => Ok(items),
        Some(other) => Err(bad(format!("`{what}` is {}, not a dict", other.kind()))),
        None => Err(bad(format!("no `{what}`"))),
    }
}

impl Metadata {
    /// Reads and checks the bytes of a `.metadata` file.
    pub fn read(bytes: &[u8]) -> Result<Metadata> {
        let v = pickle::read(bytes, &metadata_globals).map_err(|e| bad(e.to_string()))?;
        let top = fields(&v, "Metadata")?;
        let mut entries = Vec::new();
        for (i, (k, e)) in dict(top.get("state_dict_metadata"), "state_dict_metadata")?
            .iter()
            .enumerate()
        {
            let Value::Str(key) = k else {
                return Err(bad(format!(
                    "`state_dict_metadata` entry {i}: a key that is not a string"
                )));
            };
            entries.push((key.clone(), entry(e).map_err(|e| e.within(&format!("key `{key}`")))?));
        }
        let mut storage = HashMap::new();
        for (i, (k, s)) in dict(top.get("storage_data"), "storage_data")?.iter().enumerate() {
            let key = storage_key(k).map_err(|e| e.within(&format!("`storage_data` entry {i}")))?;
            let info = storage_info(s).map_err(|e| e.within(&format!("the storage of `{}`", key.0)))?;
            storage.insert(key, info);
        }
        let mut paths = HashMap::new();
        if let Some(Value::Dict(items)) = top.get("planner_data") {
            for (k, p) in items {
                if let (Value::Str(key), Value::Tuple(parts) | Value::List(parts)) = (k, p) {
                    let parts = parts
                        .iter()
                        .map(|x| match x {
                            Value::Str(s) => s.clone(),
                            Value::Int(i) => i.to_string(),
                            _ => String::new(),
                        })
                        .collect();
                    paths.insert(key.clone(), parts);
                }
            }
        }
        let m = Metadata {
            entries,
            storage,
            paths,
        };
        m.check()?;
        Ok(m)
    }

    /// The entry of `key`.
    pub fn entry(&self, key: &str) -> Option<&Entry> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, e)| e)
    }

    /// Refuses metadata a loader could misread: chunks outside their tensor, overlapping
    /// or not covering it, a chunk or value with no place in a file, a file name that
    /// leaves the folder, a transform this reader does not undo.
    pub fn check(&self) -> Result<()> {
        for (key, e) in &self.entries {
            let within = |err: DcpError| err.within(&format!("key `{key}`"));
            match e {
                Entry::Bytes => {
                    self.place(key, None).map_err(within)?;
                }
                Entry::Tensor(t) => {
                    check_chunks(t).map_err(within)?;
                    for c in &t.chunks {
                        self.place(key, Some(&c.offsets)).map_err(within)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Where the value of `key` (or its chunk at `offsets`) lies, checked.
    pub fn place(&self, key: &str, offsets: Option<&[usize]>) -> Result<&StorageInfo> {
        let info = self
            .storage
            .get(&(key.to_string(), offsets.map(<[usize]>::to_vec)))
            .ok_or_else(|| match offsets {
                Some(o) => bad(format!("its chunk at {o:?} is in no file")),
                None => bad("its value is in no file"),
            })?;
        let name_ok =
            !info.file.is_empty() && !info.file.contains(['/', '\\', '\0']) && info.file != "." && info.file != "..";
        if !name_ok {
            return Err(bad(format!(
                "its file `{}` is not a file of the checkpoint's folder",
                info.file
            )));
        }
        if let Some(t) = info.transforms.iter().find(|t| !TRANSFORMS.contains(&t.as_str())) {
            return Err(bad(format!("transform `{t}`, which is not read (only {TRANSFORMS:?})")));
        }
        Ok(info)
    }
}

/// Every chunk of `t` inside it, in its rank; none overlapping; their volume its own.
fn check_chunks(t: &TensorEntry) -> Result<()> {
    let total = t
        .size
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad("a size too large"))?;
    let mut volume = 0usize;
    for (i, c) in t.chunks.iter().enumerate() {
        if c.offsets.len() != t.size.len() || c.sizes.len() != t.size.len() {
            return Err(bad(format!(
                "chunk {i} has {} dims, the tensor {}",
                c.offsets.len(),
                t.size.len()
            )));
        }
        let inside = c
            .offsets
            .iter()
            .zip(&c.sizes)
            .zip(&t.size)
            .all(|((&o, &s), &d)| o.checked_add(s).is_some_and(|e| e <= d));
        if !inside {
            return Err(bad(format!(
                "chunk {i} (at {:?}, of {:?}) reaches past the size {:?}",
                c.offsets, c.sizes, t.size
            )));
        }
        volume += c.numel();
        for (j, other) in t.chunks[..i].iter().enumerate() {
            if c.numel() > 0 && other.numel() > 0 && c.intersect(other).is_some_and(|x| x.numel() > 0) {
                return Err(bad(format!("chunks {j} and {i} overlap")));
            }
        }
    }
    if volume != total {
        return Err(bad(format!("its chunks hold {volume} elements of its {total}")));
    }
    Ok(())
}

fn obj(module: &str, name: &str, by: Construct, args: Vec<Value>, state: Option<Value>) -> Value {
    Value::Object {
        class: Global::new(module, name),
        by,
        args,
        state: state.map(Box::new),
    }
}

fn dataclass(name: &str, fields: Vec<(&str, Value)>) -> Value {
    let state = fields.into_iter().map(|(k, v)| (Value::str(k), v)).collect();
    obj(MD, name, Construct::New, vec![], Some(Value::Dict(state)))
}

fn torch_size(xs: &[usize]) -> Value {
    let t = Value::Tuple(xs.iter().map(|&x| Value::Int(x as i64)).collect());
    obj("torch", "Size", Construct::Call, vec![t], None)
}

/// A tensor's metadata as torch pickles it. Its properties are the five-element state
/// (dtype, layout, requires_grad, memory format, pin_memory) every torch release since
/// DCP's first reads; later ones add the local shard's strides, which no loader uses.
fn tensor_value(t: &TensorEntry) -> Value {
    let properties = obj(
        MD,
        "TensorProperties",
        Construct::New,
        vec![],
        Some(Value::Tuple(vec![
            Value::Global(Global::new("torch", t.dtype.torch_name())),
            obj(
                "torch.serialization",
                "_get_layout",
                Construct::Call,
                vec![Value::str("torch.strided")],
                None,
            ),
            Value::Bool(false),
            obj(MD, "_MEM_FORMAT_ENCODING", Construct::Call, vec![Value::Int(0)], None),
            Value::Bool(false),
        ])),
    );
    let chunks = t
        .chunks
        .iter()
        .map(|c| {
            dataclass(
                "ChunkStorageMetadata",
                vec![("offsets", torch_size(&c.offsets)), ("sizes", torch_size(&c.sizes))],
            )
        })
        .collect();
    dataclass(
        "TensorStorageMetadata",
        vec![
            ("properties", properties),
            ("size", torch_size(&t.size)),
            ("chunks", Value::List(chunks)),
        ],
    )
}

impl Metadata {
    /// The `.metadata` pickle torch writes for this metadata (checked first).
    pub fn write(&self) -> Result<Vec<u8>> {
        self.check()?;
        let entries = self
            .entries
            .iter()
            .map(|(k, e)| {
                let v = match e {
                    Entry::Bytes => obj(MD, "BytesStorageMetadata", Construct::New, vec![], None),
                    Entry::Tensor(t) => tensor_value(t),
                };
                (Value::str(k.clone()), v)
            })
            .collect();
        let planner = self
            .entries
            .iter()
            .map(|(k, _)| {
                let path = self.paths.get(k).cloned().unwrap_or_else(|| vec![k.clone()]);
                (
                    Value::str(k.clone()),
                    Value::Tuple(path.into_iter().map(Value::Str).collect()),
                )
            })
            .collect();
        let mut keys: Vec<&StorageKey> = self.storage.keys().collect();
        keys.sort();
        let storage = keys
            .into_iter()
            .map(|key| {
                let info = &self.storage[key];
                let mut index = vec![("fqn", Value::str(key.0.clone()))];
                match &key.1 {
                    Some(o) => {
                        index.push(("index", Value::Int(0)));
                        index.push(("offset", torch_size(o)));
                    }
                    None => index.push(("index", Value::None)),
                }
                let mut fields = vec![
                    ("relative_path", Value::str(info.file.clone())),
                    ("offset", Value::Int(info.offset as i64)),
                    ("length", Value::Int(info.length as i64)),
                ];
                if !info.transforms.is_empty() {
                    fields.push((
                        "transform_descriptors",
                        Value::List(info.transforms.iter().cloned().map(Value::Str).collect()),
                    ));
                }
                let info = obj(
                    "torch.distributed.checkpoint.filesystem",
                    "_StorageInfo",
                    Construct::New,
                    vec![],
                    Some(Value::Dict(
                        fields.into_iter().map(|(k, v)| (Value::str(k), v)).collect(),
                    )),
                );
                (dataclass("MetadataIndex", index), info)
            })
            .collect();
        let top = dataclass(
            "Metadata",
            vec![
                ("state_dict_metadata", Value::Dict(entries)),
                ("planner_data", Value::Dict(planner)),
                ("storage_data", Value::Dict(storage)),
                ("storage_meta", Value::None),
                ("version", Value::str("1.0.0")),
            ],
        );
        Ok(pickle::write(&top))
    }
}
