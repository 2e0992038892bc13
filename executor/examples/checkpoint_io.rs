//! Checkpoint throughput: save and load of a ~100M-parameter Llama (parameters and AdamW
//! state, f32) on 1x4 Local ranks, against this machine's plain sequential write speed of
//! the same number of bytes measured in the same run (write + fsync).
//!
//! `cargo run --release -p shardplan-executor --example checkpoint_io [DIR]`

use shardplan_executor::ShardedTrainer;
use shardplan_frontends::{parse_parallel_spec, Source};
use shardplan_models::{LlamaConfig, ModelConfig};
use std::io::Write;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::env::args()
        .nth(1)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("shardplan-checkpoint-io"));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root)?;
    let model = ModelConfig::Llama(LlamaConfig {
        name: "llama-100m".into(),
        vocab_size: 32000,
        dim: 768,
        n_layers: 12,
        n_heads: 12,
        n_kv_heads: 12,
        head_dim: None,
        ffn_dim: 2048,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: Default::default(),
        activation: None,
        tie_embeddings: false,
        qkv_bias: false,
        qk_norm: false,
        moe: None,
        max_seq_len: 128,
    });
    let spec = "mesh: {shard: 4}\ngpus_per_node: 4\nbatch: {per_rank: 1, seq_len: 8}\n";
    let config = parse_parallel_spec(&Source::from_text("bench.yaml", spec))?.0;
    let t0 = Instant::now();
    let mut trainer = ShardedTrainer::new(&model, &config, 1)?;
    let mut other = ShardedTrainer::new(&model, &config, 1)?;
    println!(
        "params: {}, set up in {:.1} s",
        trainer.plan().params,
        t0.elapsed().as_secs_f64()
    );

    let t = Instant::now();
    let dir = trainer.save(&root)?;
    let save_s = t.elapsed().as_secs_f64();
    let bytes: u64 = std::fs::read_dir(&dir)?
        .map(|e| e.map(|e| e.metadata().map(|m| m.len()).unwrap_or(0)).unwrap_or(0))
        .sum();

    // The machine's plain sequential write of as many bytes, in 4 files written in parallel
    // like the ranks do, each fsync'd.
    let chunk = vec![0x5au8; 8 << 20];
    let t = Instant::now();
    std::thread::scope(|s| {
        for r in 0..4 {
            let root = &root;
            let chunk = &chunk;
            s.spawn(move || {
                let mut f = std::fs::File::create(root.join(format!("plain-{r}.bin"))).expect("create");
                let mut left = bytes / 4;
                while left > 0 {
                    let n = left.min(chunk.len() as u64) as usize;
                    f.write_all(&chunk[..n]).expect("write");
                    left -= n as u64;
                }
                f.sync_all().expect("fsync");
            });
        }
    });
    let plain_s = t.elapsed().as_secs_f64();

    let t = Instant::now();
    other.load(&dir)?;
    let load_s = t.elapsed().as_secs_f64();
    let mb = bytes as f64 / 1e6;
    println!("checkpoint: {mb:.0} MB in {} files", std::fs::read_dir(&dir)?.count());
    println!("plain sequential write: {:.0} MB/s", mb / plain_s);
    println!(
        "save: {save_s:.2} s, {:.0} MB/s ({:.0}% of plain write)",
        mb / save_s,
        100.0 * plain_s / save_s
    );
    println!(
        "load (resharding reader, checksums): {load_s:.2} s, {:.0} MB/s",
        mb / load_s
    );
    std::fs::remove_dir_all(&root)?;
    Ok(())
}
