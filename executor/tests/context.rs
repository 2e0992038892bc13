//! Context parallelism: training with each sequence split over a context group equals
//! single-rank training on whole sequences, step for step, on threads (the MPI twin is in
//! the root crate's `tests/mpi.rs`).

use candle_core::Tensor;
use shardplan_executor::{ShardedTrainer, Trainer};
use shardplan_frontends::{parse_parallel_spec, ParallelConfig, Source};
use shardplan_models::{preset, LlamaConfig, ModelConfig};

fn config(yaml: &str) -> ParallelConfig {
    parse_parallel_spec(&Source::from_text("test.yaml", yaml))
        .unwrap_or_else(|e| panic!("{e}"))
        .0
}

const COMMON: &str = "optimizer: {adamw: {lr: 3.0e-3, betas: [0.9, 0.95], weight_decay: 0.1}}\ngrad_clip: 1.0\nlr_schedule: {warmup_steps: 2}\n";

/// `|a - b| / |b|` (Frobenius norms).
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let norm = |t: &Tensor| t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt() as f64;
    norm(&(a - b).unwrap()) / norm(b).max(1e-12)
}

/// tiny-llama with 4 key/value heads, so its heads split over 2 tensor ranks too.
fn llama() -> ModelConfig {
    let ModelConfig::Llama(c) = preset("tiny-llama").unwrap() else {
        unreachable!()
    };
    ModelConfig::Llama(LlamaConfig { n_kv_heads: 4, ..c })
}

/// Runs 20 steps on a `shard x context x tensor` mesh with `cp` as the spec's
/// `context_parallel` and on one rank with the same global batch; the largest relative
/// differences of loss and final weights.
fn compare((shard, context, tensor): (u64, u64, u64), cp: &str, extra: &str) -> (f64, f64) {
    let steps = 20;
    let world = shard * context * tensor;
    let per_rank = 2;
    let batch = |per: u64| format!("batch: {{per_rank: {per}, seq_len: 16}}\n");
    let sharded = config(&format!(
        "mesh: {{shard: {shard}, context: {context}, tensor: {tensor}}}\ngpus_per_node: {world}\ncontext_parallel: {cp}\n{COMMON}{extra}{}",
        batch(per_rank)
    ));
    let single = config(&format!(
        "mesh: {{shard: 1}}\ngpus_per_node: 1\n{COMMON}{}",
        batch(per_rank * shard)
    ));
    let m = llama();
    let mut a = ShardedTrainer::new(&m, &sharded, steps).unwrap_or_else(|e| panic!("{e}"));
    let mut b = Trainer::new(&m, &single, steps, candle_core::Device::Cpu).unwrap();
    let mut worst_loss = 0f64;
    for step in 0..steps {
        let x = a.step().unwrap_or_else(|e| panic!("step {step}: {e}"));
        let y = b.step().unwrap();
        assert!(x.loss.is_finite());
        worst_loss = worst_loss.max(((x.loss - y.loss).abs() / y.loss.abs().max(1e-6)) as f64);
    }
    let full = a.full_params().unwrap();
    let worst_w = full.iter().zip(b.master()).map(|(p, q)| rel(p, q)).fold(0f64, f64::max);
    (worst_loss, worst_w)
}

/// The loss within 1e-5 of one rank's at every step; the weights within 1e-4 after 20
/// steps (AdamW turns rounding in near-zero gradients into full steps, as in `parity.rs`).
const TOLERANCES: (f64, f64) = (1e-5, 1e-4);

fn check(mesh: (u64, u64, u64), cp: &str, extra: &str) {
    let (l, w) = compare(mesh, cp, extra);
    eprintln!("{mesh:?} {cp} {extra:?}: loss {l:.2e} weights {w:.2e}");
    assert!(
        l < TOLERANCES.0 && w < TOLERANCES.1,
        "{mesh:?} {cp} {extra}: loss {l:e}, weights {w:e}"
    );
}

const METHODS: [&str; 4] = [
    "{rotate: allgather, load_balance: head_tail}",
    "{rotate: alltoall, load_balance: head_tail}",
    "{rotate: allgather, load_balance: none}",
    "{rotate: alltoall, load_balance: none}",
];

#[test]
fn context_parallel_equals_one_rank() {
    for mesh in [(1, 2, 1), (1, 4, 1)] {
        for cp in METHODS {
            check(mesh, cp, "");
        }
    }
}

#[test]
fn context_parallel_with_fsdp_and_tensor_parallel() {
    for mesh in [(2, 2, 1), (1, 2, 2)] {
        for cp in METHODS {
            check(mesh, cp, "");
        }
    }
}

#[test]
fn context_parallel_under_checkpointing_and_accumulation() {
    check((2, 2, 1), METHODS[0], "activation_checkpointing: full\n");
    check((1, 2, 1), METHODS[1], "activation_checkpointing: selective\n");
    check(
        (1, 2, 2),
        METHODS[0],
        "mixed_precision: {param: f32, reduce: f32}\nprefetch: {forward: 2, backward: 2}\n",
    );
}
