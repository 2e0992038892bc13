//! A checkpoint written here reads back as written, and loads in torch's `dcp.load`
//! (the CI venv's torch; SHARDPLAN_TORCH_PYTHON) with every element equal.

use shardplan_dcp::pickle::Value;
use shardplan_dcp::{write_metadata, Checkpoint, Chunk, DType, DataFile, Entry, Metadata, TensorData, TensorEntry};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

/// A tensor whose elements are their row-major index, in `dtype`.
fn index(dtype: DType, shape: &[usize]) -> TensorData {
    let n: usize = shape.iter().product();
    let bytes = (0..n)
        .flat_map(|i| match dtype {
            DType::F32 => (i as f32).to_le_bytes().to_vec(),
            DType::BF16 => ((i as f32).to_bits() >> 16).to_le_bytes()[..2].to_vec(),
            DType::I64 => (i as i64).to_le_bytes().to_vec(),
            _ => unimplemented!("the dtypes of this test"),
        })
        .collect();
    TensorData {
        dtype,
        shape: shape.to_vec(),
        bytes,
    }
}

/// The block `c` of `t` (2-d).
fn block(t: &TensorData, c: &Chunk) -> TensorData {
    let e = t.dtype.size();
    let cols = t.shape[1];
    let mut bytes = Vec::new();
    for r in c.offsets[0]..c.offsets[0] + c.sizes[0] {
        let start = (r * cols + c.offsets[1]) * e;
        bytes.extend_from_slice(&t.bytes[start..start + c.sizes[1] * e]);
    }
    TensorData {
        dtype: t.dtype,
        shape: c.sizes.clone(),
        bytes,
    }
}

fn chunk(offsets: [usize; 2], sizes: [usize; 2]) -> Chunk {
    Chunk {
        offsets: offsets.to_vec(),
        sizes: sizes.to_vec(),
    }
}

/// Writes the test's checkpoint into `dir` as two processes would (rank 1's file
/// compressed when `compress`): `w` split by rows, `c` by columns, a 0-d `s`, an int64
/// `i`, and three values.
fn write(dir: &Path, compress: bool) {
    let w = index(DType::F32, &[5, 3]);
    let c = index(DType::BF16, &[2, 4]);
    let mut files = [
        DataFile::create(dir, 0, false).unwrap(),
        DataFile::create(dir, 1, compress).unwrap(),
    ];
    let w_chunks = [chunk([0, 0], [3, 3]), chunk([3, 0], [2, 3])];
    let c_chunks = [chunk([0, 0], [2, 2]), chunk([0, 2], [2, 2])];
    for (rank, f) in files.iter_mut().enumerate() {
        f.tensor("w", &w_chunks[rank], &block(&w, &w_chunks[rank])).unwrap();
        f.tensor("c", &c_chunks[rank], &block(&c, &c_chunks[rank])).unwrap();
    }
    let f = &mut files[1];
    f.tensor("s", &Chunk::whole(&[]), &index(DType::F32, &[])).unwrap();
    f.tensor("i", &Chunk::whole(&[3]), &index(DType::I64, &[3])).unwrap();
    f.value("train_state.step", &Value::Int(3)).unwrap();
    f.value("optimizer.param_groups.w.lr", &Value::Float(1e-3)).unwrap();
    f.value(
        "optimizer.param_groups.w.betas",
        &Value::Tuple(vec![Value::Float(0.9), Value::Float(0.95)]),
    )
    .unwrap();
    let storage = files.into_iter().flat_map(|f| f.finish().unwrap()).collect();
    let tensor = |dtype, size: &[usize], chunks: Vec<Chunk>| {
        Entry::Tensor(TensorEntry {
            dtype,
            size: size.to_vec(),
            chunks,
        })
    };
    let entries = vec![
        ("w".to_string(), tensor(DType::F32, &[5, 3], w_chunks.to_vec())),
        ("c".to_string(), tensor(DType::BF16, &[2, 4], c_chunks.to_vec())),
        ("s".to_string(), tensor(DType::F32, &[], vec![Chunk::whole(&[])])),
        ("i".to_string(), tensor(DType::I64, &[3], vec![Chunk::whole(&[3])])),
        ("train_state.step".to_string(), Entry::Bytes),
        ("optimizer.param_groups.w.lr".to_string(), Entry::Bytes),
        ("optimizer.param_groups.w.betas".to_string(), Entry::Bytes),
    ];
    let paths: HashMap<String, Vec<String>> = [
        ("train_state.step", vec!["train_state", "step"]),
        ("optimizer.param_groups.w.lr", vec!["optimizer", "param_groups.w.lr"]),
        (
            "optimizer.param_groups.w.betas",
            vec!["optimizer", "param_groups.w.betas"],
        ),
    ]
    .into_iter()
    .map(|(k, p)| (k.to_string(), p.into_iter().map(String::from).collect()))
    .collect();
    write_metadata(
        dir,
        &Metadata {
            entries,
            storage,
            paths,
        },
    )
    .unwrap();
}

#[test]
fn a_written_checkpoint_reads_back_as_written() {
    for compress in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), compress);
        let c = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(c.tensor("w").unwrap(), index(DType::F32, &[5, 3]));
        assert_eq!(c.tensor("c").unwrap(), index(DType::BF16, &[2, 4]));
        assert_eq!(c.tensor("s").unwrap(), index(DType::F32, &[]));
        assert_eq!(c.tensor("i").unwrap(), index(DType::I64, &[3]));
        assert_eq!(c.value("train_state.step").unwrap(), Value::Int(3));
        assert_eq!(c.value("optimizer.param_groups.w.lr").unwrap(), Value::Float(1e-3));
        assert!(!dir.path().join(".metadata.tmp").exists());
        let transforms = &c.metadata.place("w", Some(&[3, 0])).unwrap().transforms;
        assert_eq!(transforms.is_empty(), !compress);
    }
}

#[test]
fn metadata_that_does_not_cover_its_tensor_is_not_written() {
    let dir = tempfile::tempdir().unwrap();
    let mut f = DataFile::create(dir.path(), 0, false).unwrap();
    let only = chunk([0, 0], [3, 3]);
    f.tensor("w", &only, &block(&index(DType::F32, &[5, 3]), &only))
        .unwrap();
    let storage = f.finish().unwrap().into_iter().collect();
    let entries = vec![(
        "w".to_string(),
        Entry::Tensor(TensorEntry {
            dtype: DType::F32,
            size: vec![5, 3],
            chunks: vec![only],
        }),
    )];
    let e = write_metadata(
        dir.path(),
        &Metadata {
            entries,
            storage,
            paths: HashMap::new(),
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("9 elements of its 15"), "{e}");
    assert!(!dir.path().join(".metadata").exists());
}

/// The Python with torch: SHARDPLAN_TORCH_PYTHON, else `python3` if it has it.
fn torch_python() -> Option<String> {
    let candidates = std::env::var("SHARDPLAN_TORCH_PYTHON")
        .ok()
        .into_iter()
        .chain(["python3".to_string()]);
    candidates.into_iter().find(|py| {
        Command::new(py)
            .args(["-c", "import torch.distributed.checkpoint"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

const LOAD: &str = r#"
import sys, warnings
import torch
import torch.distributed.checkpoint as dcp
warnings.simplefilter("ignore")
idx = lambda *s, dtype=torch.float32: torch.arange(torch.Size(s).numel(), dtype=torch.float32).reshape(s).to(dtype)
sd = {
    "w": torch.full((5, 3), -1.0),
    "c": torch.full((2, 4), -1.0, dtype=torch.bfloat16),
    "s": torch.tensor(-1.0),
    "i": torch.full((3,), -1, dtype=torch.int64),
    "train_state": {"step": None},
    "optimizer": {"param_groups.w.lr": None, "param_groups.w.betas": None},
}
dcp.load(sd, checkpoint_id=sys.argv[1])
want = {"w": idx(5, 3), "c": idx(2, 4, dtype=torch.bfloat16), "s": torch.tensor(0.0), "i": idx(3, dtype=torch.int64)}
for k, v in want.items():
    assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), (k, sd[k], v)
assert sd["train_state"]["step"] == 3, sd["train_state"]
assert sd["optimizer"]["param_groups.w.lr"] == 1e-3
assert sd["optimizer"]["param_groups.w.betas"] == (0.9, 0.95)
# A load onto another sharding: rows 1-3 of w, as a rank of another mesh would ask.
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
md = dcp.FileSystemReader(sys.argv[1]).read_metadata()
assert [c.offsets for c in md.state_dict_metadata["w"].chunks] == [torch.Size([0, 0]), torch.Size([3, 0])]
print("loaded")
"#;

#[test]
fn torch_dcp_load_reads_every_element_bit_equal() {
    let Some(py) = torch_python() else {
        assert!(std::env::var("CI").is_err(), "CI runs this test: its venv has torch");
        eprintln!("skipped: no Python with torch (set SHARDPLAN_TORCH_PYTHON)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), false);
    let o = Command::new(&py).args(["-c", LOAD]).arg(dir.path()).output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success() && out.contains("loaded"), "{out}\n{err}");
}
