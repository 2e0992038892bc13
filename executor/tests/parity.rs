//! Parity: sharded training over any mesh equals single-rank training, step for step.

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

/// Runs `steps` steps of `model` on `mesh` (with `extra` spec lines) and on one rank with
/// the same global batch; returns the largest relative differences of loss and weights.
fn compare(model: &str, replicate: u64, shard: u64, extra: &str, steps: u64) -> (f64, f64) {
    compare_mesh(&preset(model).unwrap(), (replicate, shard, 1), extra, steps)
}

/// As [`compare`] on a replicate x shard x tensor mesh; a tensor group shares its
/// data-parallel rank's sequences.
fn compare_mesh(m: &ModelConfig, (replicate, shard, tensor): (u64, u64, u64), extra: &str, steps: u64) -> (f64, f64) {
    compare_expert_mesh(m, (replicate, shard, tensor, 1), extra, steps)
}

/// As [`compare_mesh`] with an expert axis of `expert` ranks inside the shard axis.
fn compare_expert_mesh(
    m: &ModelConfig,
    (replicate, shard, tensor, expert): (u64, u64, u64, u64),
    extra: &str,
    steps: u64,
) -> (f64, f64) {
    let world = replicate * shard * tensor;
    let data_world = replicate * shard;
    let per_rank = 2;
    let batch_line = |per: u64| {
        if extra.contains("batch:") {
            extra.replace("PER", &per.to_string())
        } else {
            format!("batch: {{per_rank: {per}, seq_len: 16}}\n{extra}")
        }
    };
    let sharded = config(&format!(
        "mesh: {{replicate: {replicate}, shard: {shard}, tensor: {tensor}, expert: {expert}}}\ngpus_per_node: {world}\n{COMMON}{}",
        batch_line(per_rank)
    ));
    // The reference takes only what changes the math: batch shape and precision.
    let numeric: String = batch_line(per_rank * data_world)
        .lines()
        .filter(|l| l.starts_with("batch:") || l.starts_with("mixed_precision:"))
        .map(|l| format!("{l}\n"))
        .collect();
    let single = config(&format!("mesh: {{shard: 1}}\ngpus_per_node: 1\n{COMMON}{numeric}"));
    let mut a = ShardedTrainer::new(m, &sharded, steps).unwrap_or_else(|e| panic!("{e}"));
    let mut b = Trainer::new(m, &single, steps, candle_core::Device::Cpu).unwrap();
    let mut worst_loss = 0f64;
    for step in 0..steps {
        let x = a.step().unwrap_or_else(|e| panic!("step {step}: {e}"));
        let y = b.step().unwrap();
        let rel = ((x.loss - y.loss).abs() / y.loss.abs().max(1e-6)) as f64;
        worst_loss = worst_loss.max(rel);
        assert!(x.loss.is_finite());
    }
    let full = a.full_params().unwrap();
    let mut worst_w = 0f64;
    let g = shardplan_models::trace(m, shardplan_models::TraceOptions::default()).unwrap();
    for ((p, q), (_, param)) in full.iter().zip(b.master()).zip(g.params()) {
        // GPT-2's key bias has an identically zero true gradient (softmax ignores a constant
        // added to every score of a row); AdamW turns its rounding noise into +-lr steps
        // whose signs depend on summation order, so only its query and value thirds compare.
        let (p, q) = if param.name.ends_with("attn.c_attn.bias") {
            let d = q.dim(0).unwrap() / 3;
            (
                Tensor::cat(&[p.narrow(0, 0, d).unwrap(), p.narrow(0, 2 * d, d).unwrap()], 0).unwrap(),
                Tensor::cat(&[q.narrow(0, 0, d).unwrap(), q.narrow(0, 2 * d, d).unwrap()], 0).unwrap(),
            )
        } else {
            (p.clone(), q.clone())
        };
        let r = rel(&p, &q);
        worst_w = worst_w.max(r);
    }
    (worst_loss, worst_w)
}

/// f32 tolerances: every step's loss relative to the reference's, and each final weight
/// tensor relative to the reference's (Frobenius). A 1x1 mesh is bitwise identical; on
/// larger meshes gradients are summed in another order (per-rank partial sums, then the
/// reduce-scatter), which moves them by ~1e-7 relative. The loss stays within 1e-5; the
/// weights drift further because AdamW divides each update by the gradient's own running
/// magnitude, so an element whose gradient is near zero takes a full `lr` step whose sign
/// follows rounding: after 20 steps the drift is up to 2e-5 (measured), hence 1e-4.
const F32: (f64, f64) = (1e-5, 1e-4);
/// bf16 parameters with f32 reduction: bf16 keeps 8 bits of mantissa (one ulp is 2^-7 =
/// 7.8e-3 relative), and each rank rounds its own partial gradients to bf16 where the
/// reference rounds the whole batch's once; measured: losses within 2e-4, f32 master
/// weights within 3.2e-2 after 20 steps.
const BF16: (f64, f64) = (1e-2, 5e-2);

fn check(model: &str, replicate: u64, shard: u64, extra: &str, (tl, tw): (f64, f64)) {
    let (l, w) = compare(model, replicate, shard, extra, 20);
    eprintln!(
        "{model} {replicate}x{shard} {:?}: loss {l:.2e} weights {w:.2e}",
        extra.trim()
    );
    assert!(
        l < tl && w < tw,
        "{model} {replicate}x{shard} {extra}: loss {l:e}, weights {w:e} (tolerances {tl:e}, {tw:e})"
    );
}

#[test]
fn llama_on_every_mesh() {
    for (r, s) in [(1, 1), (1, 2), (1, 4), (2, 2), (1, 8), (1, 3)] {
        check("tiny-llama", r, s, "", F32);
    }
}

#[test]
fn gpt2_on_every_mesh() {
    for (r, s) in [(1, 1), (1, 2), (1, 4), (2, 2), (1, 8), (1, 3)] {
        check("tiny-gpt2", r, s, "", F32);
    }
}

#[test]
fn qwen3_on_every_mesh() {
    // Per-head q/k norms: their weights' gradients sum over every head of every rank.
    for (r, s) in [(1, 1), (1, 2), (1, 4), (2, 2), (1, 3)] {
        check("tiny-qwen3", r, s, "", F32);
    }
    check("tiny-qwen3", 1, 4, "activation_checkpointing: selective\n", F32);
    check(
        "tiny-qwen3",
        1,
        4,
        "mixed_precision: {param: bf16, reduce: f32}\n",
        BF16,
    );
    // Under tensor parallelism each rank normalises its own heads with the whole weight,
    // whose gradient is summed over the tensor group, with or without sequence parallelism.
    let qwen3 = preset("tiny-qwen3").unwrap();
    check_mesh(&qwen3, (1, 2, 2), "", F32);
    check_mesh(&qwen3, (2, 1, 2), "tensor_parallel: {sequence_parallel: false}\n", F32);
}

#[test]
fn llama_under_every_knob() {
    for extra in [
        "reshard_after_forward: false\n",
        "reshard_after_forward: 2\n",
        "prefetch: {forward: 2, backward: 2}\n",
        "batch: {per_rank: PER, seq_len: 16, grad_accum: 4}\n",
        "batch: {per_rank: PER, seq_len: 16, grad_accum: 4, grad_sync: final_micro_batch}\n",
        "activation_checkpointing: full\n",
        "activation_checkpointing: {every: 2}\n",
        "offload: cpu\n",
        "wrap: [attention, mlp]\nbucket_mib: 1\n",
    ] {
        check("tiny-llama", 1, 4, extra, F32);
    }
    check(
        "tiny-llama",
        2,
        2,
        "batch: {per_rank: PER, seq_len: 16, grad_accum: 4}\n",
        F32,
    );
}

#[test]
fn selective_checkpointing_on_every_mesh() {
    // torchtitan's op policy (attention and odd matmuls saved) on every mesh of the suite.
    for model in ["tiny-llama", "tiny-gpt2"] {
        for (r, s) in [(1, 1), (1, 2), (1, 4), (2, 2), (1, 8), (1, 3)] {
            check(model, r, s, "activation_checkpointing: selective\n", F32);
        }
    }
    // Explicit save lists, down to saving nothing (every block recomputed whole).
    for save in ["[matmuls]", "[attention]", "[attention, matmuls]", "[]"] {
        check(
            "tiny-llama",
            1,
            4,
            &format!("activation_checkpointing: {{selective: {{save: {save}}}}}\n"),
            F32,
        );
    }
}

#[test]
fn bf16_params_with_f32_reduction() {
    check(
        "tiny-llama",
        1,
        4,
        "mixed_precision: {param: bf16, reduce: f32}\n",
        BF16,
    );
    check("tiny-gpt2", 2, 2, "mixed_precision: {param: bf16, reduce: f32}\n", BF16);
}

fn check_mesh(m: &ModelConfig, mesh: (u64, u64, u64), extra: &str, (tl, tw): (f64, f64)) {
    let (l, w) = compare_mesh(m, mesh, extra, 20);
    let (r, s, t) = mesh;
    eprintln!(
        "{} {r}x{s}x{t} {:?}: loss {l:.2e} weights {w:.2e}",
        m.name(),
        extra.trim()
    );
    assert!(
        l < tl && w < tw,
        "{} {r}x{s}x{t} {extra}: loss {l:e}, weights {w:e} (tolerances {tl:e}, {tw:e})",
        m.name()
    );
}

/// tiny-llama with 4 key/value heads (its own 2 do not split over 4 tensor ranks).
fn llama_kv4() -> ModelConfig {
    let ModelConfig::Llama(c) = preset("tiny-llama").unwrap() else {
        unreachable!()
    };
    ModelConfig::Llama(LlamaConfig { n_kv_heads: 4, ..c })
}

const TENSOR_MESHES: [(u64, u64, u64); 5] = [(1, 2, 2), (2, 1, 2), (1, 1, 4), (1, 4, 1), (2, 2, 2)];

#[test]
fn tensor_parallel_on_every_mesh() {
    let gpt2 = preset("tiny-gpt2").unwrap();
    for mesh in TENSOR_MESHES {
        let llama = if mesh.2 == 4 {
            llama_kv4()
        } else {
            preset("tiny-llama").unwrap()
        };
        check_mesh(&llama, mesh, "", F32);
        check_mesh(&gpt2, mesh, "", F32);
    }
}

#[test]
fn tensor_parallel_under_every_option() {
    let llama = preset("tiny-llama").unwrap();
    let gpt2 = preset("tiny-gpt2").unwrap();
    for extra in [
        "tensor_parallel: {sequence_parallel: false}\n",
        "tensor_parallel: {loss_parallel: false}\n",
        "tensor_parallel: {sequence_parallel: false, loss_parallel: false}\n",
        "activation_checkpointing: full\n",
        "activation_checkpointing: selective\n",
        "batch: {per_rank: PER, seq_len: 16, grad_accum: 2}\n",
    ] {
        check_mesh(&llama, (1, 2, 2), extra, F32);
        check_mesh(&gpt2, (2, 1, 2), extra, F32);
    }
    // An int reshard over a shard axis whose members are tensor-degree ranks apart.
    check_mesh(&llama, (1, 4, 2), "reshard_after_forward: 2\n", F32);
    check_mesh(
        &gpt2,
        (1, 2, 2),
        "reshard_after_forward: false\nprefetch: {forward: 2, backward: 2}\n",
        F32,
    );
    check_mesh(&llama, (1, 2, 2), "offload: cpu\n", F32);
    check_mesh(&llama, (1, 2, 2), "mixed_precision: {param: bf16, reduce: f32}\n", BF16);
    check_mesh(&gpt2, (1, 1, 2), "mixed_precision: {param: bf16, reduce: f32}\n", BF16);
}

/// examples/models/tiny-moe.yaml (a dense first layer, then two MoE layers of 8 experts,
/// top 2, renormalised, a sigmoid-gated shared expert) with load-balancing weight `aux`.
fn tiny_moe(aux: f64) -> ModelConfig {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models/tiny-moe.yaml");
    let ModelConfig::Llama(mut c) = shardplan_frontends::load_model(&path).unwrap().config else {
        unreachable!()
    };
    c.moe.as_mut().unwrap().aux_loss_coef = aux;
    ModelConfig::Llama(c)
}

#[test]
fn moe_on_every_mesh() {
    // Routing is per token, so sharding the batch leaves every token's experts, weights and
    // expert outputs as they are; each expert's weight gradient sums over the ranks' rows.
    let moe = tiny_moe(0.0);
    for mesh in [(1, 1, 1), (1, 2, 1), (1, 4, 1), (2, 2, 1)] {
        check_mesh(&moe, mesh, "", F32);
    }
    // The load-balancing loss is over each forward pass's own tokens (Hugging Face's, per
    // micro-batch): on one rank it is the one-rank run's to the bit.
    check_mesh(&tiny_moe(0.01), (1, 1, 1), "", F32);
}

#[test]
fn moe_expert_parallel() {
    // Each rank computes its own experts over the rows every rank of its expert group
    // routes to them (all-to-all out and back); FSDP shards those experts over the ranks
    // holding the same ones. Every mesh equals one rank step for step.
    let moe = tiny_moe(0.0);
    for mesh in [(1, 2, 1, 2), (1, 4, 1, 2), (1, 4, 1, 4), (2, 2, 1, 2)] {
        let (l, w) = compare_expert_mesh(&moe, mesh, "", 20);
        eprintln!("tiny-moe {mesh:?}: loss {l:.2e} weights {w:.2e}");
        assert!(l < F32.0 && w < F32.1, "tiny-moe {mesh:?}: loss {l:e}, weights {w:e}");
    }
}

/// Losses per step and final whole-model weights of `steps` steps of tiny-moe on a
/// replicate x shard mesh with an expert axis, with `moe` spec lines.
fn run_moe(
    m: &ModelConfig,
    (replicate, shard, expert): (u64, u64, u64),
    moe: &str,
    steps: u64,
) -> (Vec<f32>, Vec<Tensor>) {
    let world = replicate * shard;
    let c = config(&format!(
        "mesh: {{replicate: {replicate}, shard: {shard}, expert: {expert}}}\ngpus_per_node: {world}\n{COMMON}batch: {{per_rank: 2, seq_len: 16}}\n{moe}"
    ));
    let mut t = ShardedTrainer::new(m, &c, steps).unwrap_or_else(|e| panic!("{e}"));
    let losses = (0..steps)
        .map(|s| t.step().unwrap_or_else(|e| panic!("step {s}: {e}")).loss)
        .collect();
    (losses, t.full_params().unwrap())
}

fn worst(a: &(Vec<f32>, Vec<Tensor>), b: &(Vec<f32>, Vec<Tensor>)) -> (f64, f64) {
    let l =
        a.0.iter()
            .zip(&b.0)
            .map(|(x, y)| ((x - y).abs() / y.abs().max(1e-6)) as f64)
            .fold(0.0, f64::max);
    let w = a.1.iter().zip(&b.1).map(|(p, q)| rel(p, q)).fold(0.0, f64::max);
    (l, w)
}

/// Token dropping (`moe.capacity_factor`) keeps each expert's capacity of every rank's own
/// assignments, so expert parallelism, which only moves the kept rows, equals the same mesh
/// without it step for step; a capacity that holds every assignment is dropless routing.
#[test]
fn moe_token_dropping() {
    let moe = tiny_moe(0.0);
    let drop = "moe: {capacity_factor: 1.0}\n";
    let dense = run_moe(&moe, (1, 4, 1), drop, 20);
    for mesh in [(1, 4, 2), (1, 4, 4), (2, 2, 2)] {
        let base = if mesh.0 == 2 {
            run_moe(&moe, (2, 2, 1), drop, 20)
        } else {
            dense.clone()
        };
        let (l, w) = worst(&run_moe(&moe, mesh, drop, 20), &base);
        eprintln!("tiny-moe dropping {mesh:?}: loss {l:.2e} weights {w:.2e}");
        assert!(l < F32.0 && w < F32.1, "dropping {mesh:?}: loss {l:e}, weights {w:e}");
    }
    // Tokens were dropped: the run is not the dropless one (the experts start small, so
    // the first losses differ little; the training curves part).
    let (l, w) = worst(&dense, &run_moe(&moe, (1, 4, 1), "", 20));
    eprintln!("tiny-moe dropping vs dropless: loss {l:.2e} weights {w:.2e}");
    assert!(
        l > 5e-4 && w > 1e-1,
        "capacity factor 1.0 vs dropless: loss {l:e}, weights {w:e}"
    );
    // A capacity of every assignment (8 experts, top 2: factor 4) drops nothing.
    let all = run_moe(&moe, (1, 4, 2), "moe: {capacity_factor: 4.0}\n", 3);
    let free = run_moe(&moe, (1, 4, 2), "", 3);
    let (l, w) = worst(&all, &free);
    assert!(
        l == 0.0 && w == 0.0,
        "capacity factor 4 vs dropless: loss {l:e}, weights {w:e}"
    );
}

/// The load-balancing loss is each rank's own: over a sharded batch it differs from the
/// loss over the whole batch (a product of means is not the mean of products), as it does
/// under data parallelism in Hugging Face and torchtitan; the cross-entropy part stays exact.
#[test]
fn moe_aux_loss_is_per_rank_batch() {
    let (l, _) = compare_mesh(&tiny_moe(0.5), (1, 2, 1), "", 1);
    assert!(
        l > 1e-5,
        "per-rank and whole-batch load-balancing losses agree to {l:e}"
    );
}

/// Expert tensor parallelism (torchtitan's, at the tensor degree): each tensor rank holds a
/// slice of every expert's hidden units and of the shared expert's, routes every token of
/// its group as the others do and sums its partial output with them; the router's
/// gradient, the load-balancing loss's included, is whole on every tensor rank. A tensor
/// group shares its tokens, so the load-balancing loss is the one-rank run's on a 1x1xT
/// mesh; with an expert axis the tokens travel between ranks of the same tensor index.
#[test]
fn moe_tensor_parallel() {
    let moe = tiny_moe(0.0);
    for (mesh, extra) in [
        ((1, 1, 2, 1), ""),
        ((1, 2, 2, 1), ""),
        ((1, 2, 2, 1), "tensor_parallel: {sequence_parallel: false}\n"),
        ((1, 2, 2, 1), "tensor_parallel: {loss_parallel: false}\n"),
        ((1, 2, 2, 1), "activation_checkpointing: full\n"),
        ((1, 2, 2, 2), ""),
        ((2, 2, 2, 2), "tensor_parallel: {sequence_parallel: false}\n"),
    ] {
        let (l, w) = compare_expert_mesh(&moe, mesh, extra, 20);
        eprintln!("tiny-moe {mesh:?} {:?}: loss {l:.2e} weights {w:.2e}", extra.trim());
        assert!(
            l < F32.0 && w < F32.1,
            "tiny-moe {mesh:?} {extra}: loss {l:e}, weights {w:e}"
        );
    }
    for extra in ["", "tensor_parallel: {sequence_parallel: false}\n"] {
        let (l, w) = compare_mesh(&tiny_moe(0.01), (1, 1, 2), extra, 20);
        eprintln!(
            "tiny-moe aux 0.01 1x1x2 {:?}: loss {l:.2e} weights {w:.2e}",
            extra.trim()
        );
        assert!(
            l < F32.0 && w < F32.1,
            "aux loss 1x1x2 {extra}: loss {l:e}, weights {w:e}"
        );
    }
}
