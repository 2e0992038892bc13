//! Checkpoints torch wrote (tests/fixtures/make.py, torch 2.15) read back: every tensor's
//! elements are its row-major index, every value as saved.

use shardplan_dcp::pickle::Value;
use shardplan_dcp::{Checkpoint, Chunk, DType, Entry};
use std::path::Path;

fn open(name: &str) -> Checkpoint {
    Checkpoint::open(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)).unwrap()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn index(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32).collect()
}

fn check_values(c: &Checkpoint) {
    let shapes = [("rows", vec![4, 3]), ("uneven", vec![5, 2]), ("cols", vec![2, 4])];
    for (key, shape) in shapes {
        let t = c.tensor(key).unwrap();
        assert_eq!((t.dtype, &t.shape), (DType::F32, &shape), "{key}");
        assert_eq!(f32s(&t.bytes), index(shape.iter().product()), "{key}");
    }
    let bias = c.tensor("bias").unwrap();
    assert_eq!(bias.dtype, DType::BF16);
    let bf16: Vec<u16> = bias.bytes.chunks(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
    // 0, 1, 2 in bfloat16: the top halves of the f32 bits.
    assert_eq!(bf16, vec![0x0000, 0x3f80, 0x4000]);
    let plain = c.tensor("plain").unwrap();
    assert_eq!(plain.dtype, DType::I64);
    let longs: Vec<i64> = plain
        .bytes
        .chunks(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(longs, vec![0, 1, 2, 3]);
    let scalar = c.tensor("scalar").unwrap();
    assert_eq!((scalar.shape.len(), f32s(&scalar.bytes)), (0, vec![7.0]));
    assert_eq!(c.value("train_state.step").unwrap(), Value::Int(7));
    assert_eq!(c.value("train_state.lr").unwrap(), Value::Float(0.5));
    assert_eq!(
        c.value("betas").unwrap(),
        Value::Tuple(vec![Value::Float(0.9), Value::Float(0.95)])
    );
}

#[test]
fn a_checkpoint_two_torch_ranks_saved_reads_whole() {
    let c = open("two-ranks/step-1");
    // Sharded by rows, evenly and not, and by columns: two chunks each.
    for key in ["rows", "uneven", "cols"] {
        let Some(Entry::Tensor(t)) = c.metadata.entry(key) else {
            panic!("{key}")
        };
        assert_eq!(t.chunks.len(), 2, "{key}");
    }
    check_values(&c);
}

#[test]
fn any_block_of_a_sharded_tensor_reads_from_the_chunks_it_meets() {
    let c = open("two-ranks/step-1");
    // Rows 1 and 2 of `rows` (saved as rows 0-1 and 2-3).
    let t = c
        .region(
            "rows",
            &Chunk {
                offsets: vec![1, 0],
                sizes: vec![2, 3],
            },
        )
        .unwrap();
    assert_eq!(f32s(&t.bytes), vec![3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    // Columns 1-3 of `cols` (saved as columns 0-1 and 2-3).
    let t = c
        .region(
            "cols",
            &Chunk {
                offsets: vec![0, 1],
                sizes: vec![2, 3],
            },
        )
        .unwrap();
    assert_eq!(f32s(&t.bytes), vec![1.0, 2.0, 3.0, 5.0, 6.0, 7.0]);
    let outside = Chunk {
        offsets: vec![3, 0],
        sizes: vec![2, 3],
    };
    let e = c.region("rows", &outside).unwrap_err().to_string();
    assert!(e.contains("outside its size"), "{e}");
    let e = c.tensor("nope").unwrap_err().to_string();
    assert!(e.contains("key `nope` is not in the checkpoint"), "{e}");
}

#[test]
fn a_zstd_compressed_checkpoint_reads_as_the_plain_one() {
    let c = open("zstd/step-1");
    let info = c.metadata.place("rows", Some(&[0, 0])).unwrap();
    assert_eq!(info.transforms, vec!["stream.zstd/1".to_string()]);
    check_values(&c);
}
