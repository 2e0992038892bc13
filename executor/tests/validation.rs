//! Validation (`data: {val, eval_every, eval_batches}`): the loss measured by the
//! planner's forward program equals an independent forward pass of the reference
//! interpreter on the assembled weights, is the same on every mesh, and leaves training
//! exactly as it was without it.

use candle_core::{Device, Tensor};
use shardplan_executor::cpu::kernels::Ctx;
use shardplan_executor::runtime::interp::Interpreter;
use shardplan_executor::train::data::{DataSource, TokenFile};
use shardplan_executor::ShardedTrainer;
use shardplan_frontends::{parse_parallel_spec, ParallelConfig, Source, TokenDType};
use shardplan_ir::Op;
use shardplan_models::{preset, trace, ModelConfig, TraceOptions};
use std::collections::HashMap;
use std::path::Path;

const GLOBAL: u64 = 8;
const SEQ: u64 = 16;

/// `n` u16 token ids below 256 from a small linear congruential sequence (a learnable,
/// repeating text stand-in).
fn write_tokens(path: &Path, n: usize, salt: u32) {
    let mut x = 12345u32 ^ salt;
    let mut bytes = Vec::with_capacity(2 * n);
    for i in 0..n {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
        let t = if i % 3 == 0 {
            (x >> 16) % 256
        } else {
            (i as u32 * 7) % 256
        };
        bytes.extend_from_slice(&(t as u16).to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap();
}

fn files() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_tokens(&dir.path().join("train.bin"), 4000, 1);
    write_tokens(&dir.path().join("val.bin"), 1000, 2);
    dir
}

fn spec(dir: &Path, replicate: u64, shard: u64, eval: bool, extra: &str) -> ParallelConfig {
    let world = replicate * shard;
    let eval = if eval {
        ", val: val.bin, eval_every: 2, eval_batches: 3"
    } else {
        ""
    };
    let yaml = format!(
        "mesh: {{replicate: {replicate}, shard: {shard}}}\ngpus_per_node: {world}\n\
         batch: {{per_rank: {}, seq_len: {SEQ}}}\n\
         optimizer: {{adamw: {{lr: 3.0e-3, betas: [0.9, 0.95], weight_decay: 0.1}}}}\n\
         data: {{tokens: train.bin, dtype: u16{eval}}}\n{extra}",
        GLOBAL / world
    );
    parse_parallel_spec(&Source::from_text(dir.join("p.yaml"), yaml))
        .unwrap_or_else(|e| panic!("{e}"))
        .0
}

/// Runs `steps` steps; returns each step's (loss, val_loss) and the final weights.
fn run(model: &ModelConfig, cfg: &ParallelConfig, steps: u64) -> (Vec<(f32, Option<f32>)>, Vec<Tensor>) {
    let mut t = ShardedTrainer::new(model, cfg, steps).unwrap_or_else(|e| panic!("{e}"));
    let out = (0..steps)
        .map(|_| {
            let m = t.step().unwrap_or_else(|e| panic!("{e}"));
            (m.loss, m.val_loss)
        })
        .collect();
    (out, t.full_params().unwrap())
}

fn rel(a: f32, b: f32) -> f64 {
    ((a - b).abs() / b.abs().max(1e-12)) as f64
}

#[test]
fn validation_loss_is_the_same_on_every_mesh_and_leaves_training_unchanged() {
    let dir = files();
    for name in ["tiny-llama", "tiny-gpt2"] {
        let model = preset(name).unwrap();
        let (reference, _) = run(&model, &spec(dir.path(), 1, 1, true, ""), 5);
        // Steps 2 and 4 (every 2) and the last, 5.
        let evaluated: Vec<u64> = (1..=5u64).filter(|&s| reference[s as usize - 1].1.is_some()).collect();
        assert_eq!(evaluated, [2, 4, 5], "{name}");
        // Training moves the model: the validation loss moves with it.
        assert_ne!(reference[1].1, reference[3].1, "{name}");
        for (r, s, extra) in [
            (1, 4, ""),
            (2, 2, ""),
            (1, 4, "activation_checkpointing: full\nreshard_after_forward: false\n"),
            (1, 4, "reshard_after_forward: 2\nprefetch: {forward: 2, backward: 1}\n"),
        ] {
            let with = spec(dir.path(), r, s, true, extra);
            let (a, wa) = run(&model, &with, 5);
            let (b, wb) = run(&model, &spec(dir.path(), r, s, false, extra), 5);
            for (step, ((la, va), (lb, vb))) in a.iter().zip(&b).enumerate() {
                // Evaluating changes nothing that training reads: bit-identical losses.
                assert_eq!(la.to_bits(), lb.to_bits(), "{name} {r}x{s} {extra}: step {}", step + 1);
                assert!(vb.is_none());
                let want = reference[step].1;
                match (va, want) {
                    (Some(x), Some(w)) => {
                        let e = rel(*x, w);
                        eprintln!(
                            "{name} {r}x{s} {extra:?} step {}: val loss {x} vs 1x1 {w}: {e:.1e}",
                            step + 1
                        );
                        assert!(e < 1e-5, "{name} {r}x{s} {extra}: val loss {x} vs 1x1's {w} ({e:e})");
                    }
                    (None, None) => {}
                    other => panic!("{name} {r}x{s}: evaluated on different steps: {other:?}"),
                }
            }
            for (x, y) in wa.iter().zip(&wb) {
                let d = (x - y)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert_eq!(
                    d, 0.0,
                    "{name} {r}x{s}: weights after training with and without validation"
                );
            }
        }
    }
}

#[test]
fn validation_loss_equals_a_reference_forward_pass() {
    let dir = files();
    let model = preset("tiny-llama").unwrap();
    let cfg = spec(dir.path(), 1, 4, true, "");
    let mut t = ShardedTrainer::new(&model, &cfg, 10).unwrap();
    t.step().unwrap();
    let ours = t.evaluate().unwrap();
    // Evaluating twice gives the same figure (same batches, unchanged weights).
    assert_eq!(ours.to_bits(), t.evaluate().unwrap().to_bits());
    let weights = t.full_params().unwrap();
    let g = trace(
        &model,
        TraceOptions {
            batch: GLOBAL,
            seq_len: Some(SEQ),
            dtype: shardplan_ir::DType::F32,
            ..Default::default()
        },
    )
    .unwrap();
    let loss = g
        .nodes()
        .find(|(_, n)| matches!(n.op, Op::CrossEntropy))
        .map(|(id, _)| id)
        .unwrap();
    let params: HashMap<_, _> = g.params().map(|(id, p)| (p.node, id)).collect();
    let interp = Interpreter::new(g.clone(), &[loss]);
    let mut val = TokenFile::open(
        &dir.path().join("val.bin"),
        TokenDType::U16,
        256,
        GLOBAL as usize,
        SEQ as usize,
        cfg.seed,
    )
    .unwrap();
    let mut sum = 0f64;
    for _ in 0..3 {
        let batch: HashMap<String, Tensor> = val.next_batch(&Device::Cpu).unwrap().inputs.into_iter().collect();
        let out = interp
            .run(&Ctx::new(Device::Cpu), &[loss], &mut |id| {
                if let Some(p) = params.get(&id) {
                    return Ok(weights[p.index()].clone());
                }
                match &g.node(id).op {
                    Op::Input { name } => Ok(batch[name].clone()),
                    other => panic!("unexpected input {other:?}"),
                }
            })
            .unwrap();
        sum += f64::from(out.kept[0].to_scalar::<f32>().unwrap());
    }
    let want = (sum / 3.0) as f32;
    let e = rel(ours, want);
    eprintln!("validation loss {ours} vs reference forward {want}: {e:.1e}");
    assert!(
        e < 1e-5,
        "validation loss {ours} vs the reference forward's {want} ({e:e})"
    );
}

#[test]
fn a_bad_validation_file_is_refused_naming_it() {
    let dir = files();
    std::fs::write(dir.path().join("val.bin"), [1u8, 2, 3]).unwrap();
    let model = preset("tiny-llama").unwrap();
    let e = ShardedTrainer::new(&model, &spec(dir.path(), 1, 2, true, ""), 4)
        .err()
        .expect("an odd-sized val file is refused")
        .to_string();
    assert!(e.contains("val.bin") && e.contains("whole number of u16 tokens"), "{e}");
    std::fs::remove_file(dir.path().join("val.bin")).unwrap();
    let e = ShardedTrainer::new(&model, &spec(dir.path(), 1, 2, true, ""), 4)
        .err()
        .expect("a missing val file is refused")
        .to_string();
    assert!(e.contains("val.bin") && e.contains("cannot open"), "{e}");
}
