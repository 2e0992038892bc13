//! Decoding with the KV cache (`infer::Model`) against the training forward and against
//! transformers itself, on the fixtures of `scripts/hf-fixtures.py` (tests/fixtures/hf).
//!
//! - the full-sequence logits equal the training graph's forward (reference interpreter)
//!   and transformers' logits;
//! - decoding one token at a time through the cache gives the same logits at every
//!   position as the full sequence;
//! - greedy generation gives exactly the tokens transformers' `generate` chose.

mod hf_fixtures;

use candle_core::{DType, Device, Tensor};
use hf_fixtures::{config, dir, VARIANTS};
use shardplan_executor::checkpoint::read_weights;
use shardplan_executor::cpu::kernels::Ctx;
use shardplan_executor::infer::{param_shapes, sample::Sampling, KvCache, Model};
use shardplan_executor::runtime::interp::Interpreter;
use shardplan_ir::Op;
use shardplan_models::{trace, TraceOptions};
use std::collections::HashMap;

fn model(variant: &str) -> Model {
    let c = config(variant);
    let w = read_weights(&dir(variant), &param_shapes(&c).unwrap()).unwrap_or_else(|e| panic!("{variant}: {e}"));
    Model::new(c, w).unwrap_or_else(|e| panic!("{variant}: {e}"))
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let n = |t: &Tensor| {
        t.to_dtype(DType::F64)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
            .sqrt()
    };
    n(&(a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap()) / n(b).max(1e-30)
}

/// The first row of the fixture's batch.
fn first_row(variant: &str) -> Vec<u32> {
    let data = candle_core::safetensors::load(dir(variant).join("data.safetensors"), &Device::Cpu).unwrap();
    let row: Vec<i64> = data["tokens"].get(0).unwrap().to_vec1().unwrap();
    row.into_iter().map(|x| x as u32).collect()
}

/// Logits of the training graph's forward pass (batch 1) over `tokens`.
fn training_logits(variant: &str, tokens: &[u32]) -> Tensor {
    let c = config(variant);
    let g = trace(
        &c,
        TraceOptions {
            batch: 1,
            seq_len: Some(tokens.len() as u64),
            dtype: shardplan_ir::DType::F32,
            ..Default::default()
        },
    )
    .unwrap();
    let (loss, _) = g.nodes().find(|(_, n)| matches!(n.op, Op::CrossEntropy)).unwrap();
    let logits = g.node(loss).inputs[0];
    let weights = candle_core::safetensors::load(dir(variant).join("model.safetensors"), &Device::Cpu).unwrap();
    let names: HashMap<_, _> = g.params().map(|(_, p)| (p.node, p.name.clone())).collect();
    let out = Interpreter::new(g.clone(), &[logits])
        .run(&Ctx::new(Device::Cpu), &[logits], &mut |id| {
            if let Some(n) = names.get(&id) {
                return Ok(weights[&**n].clone());
            }
            Ok(match &g.node(id).op {
                Op::Input { name } if name == "tokens" => {
                    Tensor::from_vec(tokens.to_vec(), (1, tokens.len()), &Device::Cpu)?
                }
                _ => Tensor::zeros(tokens.len(), DType::U32, &Device::Cpu)?,
            })
        })
        .unwrap();
    out.kept[0].reshape((tokens.len(), ())).unwrap()
}

#[test]
fn full_sequence_logits_match_the_training_forward_and_transformers() {
    for variant in VARIANTS {
        let m = model(variant);
        let tokens = first_row(variant);
        let ours = m.forward(&tokens, &mut KvCache::default()).unwrap();
        let train = training_logits(variant, &tokens);
        let e = rel(&ours, &train);
        let expected = candle_core::safetensors::load(dir(variant).join("expected.safetensors"), &Device::Cpu).unwrap();
        let hf = expected["logits"].get(0).unwrap();
        let h = rel(&ours, &hf);
        eprintln!("{variant}: logits vs training forward {e:.1e}, vs transformers {h:.1e}");
        assert!(e < 1e-5, "{variant}: logits differ from the training forward by {e:e}");
        assert!(h < 1e-5, "{variant}: logits differ from transformers' by {h:e}");
    }
}

/// Qwen3's per-head q/k norms in the cached decoder: its logits equal the training
/// graph's forward on random weights, for the whole sequence and one token at a time.
#[test]
fn qwen3_decoding_matches_the_training_forward() {
    let c = shardplan_models::preset("tiny-qwen3").unwrap();
    let shapes = param_shapes(&c).unwrap();
    assert!(shapes
        .iter()
        .any(|(n, s)| n == "model.layers.1.self_attn.k_norm.weight" && s == &[32]));
    let weights: HashMap<String, Tensor> = shapes
        .iter()
        .map(|(n, s)| {
            let dims: Vec<usize> = s.iter().map(|&d| d as usize).collect();
            // Norm weights away from 1, so a skipped norm shows.
            let t = if n.ends_with("norm.weight") {
                Tensor::rand(0.5f32, 1.5, dims.as_slice(), &Device::Cpu).unwrap()
            } else {
                Tensor::randn(0f32, 0.1, dims.as_slice(), &Device::Cpu).unwrap()
            };
            (n.clone(), t)
        })
        .collect();
    let tokens: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 256).collect();
    let g = trace(
        &c,
        TraceOptions {
            batch: 1,
            seq_len: Some(tokens.len() as u64),
            ..Default::default()
        },
    )
    .unwrap();
    let (loss, _) = g.nodes().find(|(_, n)| matches!(n.op, Op::CrossEntropy)).unwrap();
    let logits = g.node(loss).inputs[0];
    let names: HashMap<_, _> = g.params().map(|(_, p)| (p.node, p.name.clone())).collect();
    let out = Interpreter::new(g.clone(), &[logits])
        .run(&Ctx::new(Device::Cpu), &[logits], &mut |id| {
            if let Some(n) = names.get(&id) {
                return Ok(weights[&**n].clone());
            }
            Ok(match &g.node(id).op {
                Op::Input { name } if name == "tokens" => {
                    Tensor::from_vec(tokens.clone(), (1, tokens.len()), &Device::Cpu)?
                }
                _ => Tensor::zeros(tokens.len(), DType::U32, &Device::Cpu)?,
            })
        })
        .unwrap();
    let train = out.kept[0].reshape((tokens.len(), ())).unwrap();
    let m = Model::new(c, weights).unwrap();
    let full = m.forward(&tokens, &mut KvCache::default()).unwrap();
    let e = rel(&full, &train);
    assert!(e < 1e-5, "qwen3 decoder differs from the training forward by {e:e}");
    let mut cache = KvCache::default();
    let mut rows = vec![m.forward(&tokens[..5], &mut cache).unwrap()];
    for &t in &tokens[5..] {
        rows.push(m.forward(&[t], &mut cache).unwrap());
    }
    let e = rel(&Tensor::cat(&rows, 0).unwrap(), &train);
    assert!(
        e < 1e-5,
        "qwen3 cached decoding differs from the training forward by {e:e}"
    );
}

#[test]
fn decoding_through_the_cache_gives_the_full_sequence_logits() {
    for variant in VARIANTS {
        let m = model(variant);
        let tokens = first_row(variant);
        let full = m.forward(&tokens, &mut KvCache::default()).unwrap();
        // A prompt of 7, then one token at a time.
        let mut cache = KvCache::default();
        let mut rows = vec![m.forward(&tokens[..7], &mut cache).unwrap()];
        for &t in &tokens[7..] {
            rows.push(m.forward(&[t], &mut cache).unwrap());
        }
        assert_eq!(cache.len(), tokens.len());
        let stepped = Tensor::cat(&rows, 0).unwrap();
        let e = rel(&stepped, &full);
        assert!(
            e < 1e-5,
            "{variant}: cached decoding differs from the full sequence by {e:e}"
        );
    }
}

#[test]
fn greedy_tokens_equal_transformers_generate() {
    for variant in VARIANTS {
        let m = model(variant);
        let g: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir(variant).join("generate.json")).unwrap()).unwrap();
        let n = g["max_new_tokens"].as_u64().unwrap();
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let prompts = g["prompts"].as_array().unwrap();
        assert!(prompts.len() >= 3, "{variant}");
        for (p, want) in prompts.iter().zip(g["outputs"].as_array().unwrap()) {
            let (p, want) = (ids(p), ids(want));
            let mut streamed = Vec::new();
            let got = m
                .generate(&p, &Sampling::greedy(n), &[], &mut |t| {
                    streamed.push(t);
                    Ok(())
                })
                .unwrap();
            assert_eq!(got, want, "{variant}: prompt {p:?}");
            assert_eq!(streamed, want);
        }
    }
}

#[test]
fn bad_inputs_are_refused_naming_what_is_wrong() {
    let m = model("llama");
    let long = vec![1u32; 64];
    let e = m
        .generate(&long, &Sampling::greedy(4), &[], &mut |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("64 tokens") && e.contains("at most 64 positions"), "{e}");
    let e = m.forward(&[128], &mut KvCache::default()).unwrap_err().to_string();
    assert!(e.contains("token id 128") && e.contains("vocabulary of 128"), "{e}");
    // Generation stops at the model's last position.
    let got = m
        .generate(&[1; 60], &Sampling::greedy(10), &[], &mut |_| Ok(()))
        .unwrap();
    assert_eq!(got.len(), 4);
    // Missing and misshapen weights name the tensor.
    let c = config("llama");
    let mut w = read_weights(&dir("llama"), &param_shapes(&c).unwrap()).unwrap();
    w.remove("model.norm.weight");
    let e = Model::new(c.clone(), w).err().unwrap().to_string();
    assert!(e.contains("model.norm.weight"), "{e}");
    let mut shapes = param_shapes(&c).unwrap();
    shapes[0].1 = vec![7, 7];
    let e = read_weights(&dir("llama"), &shapes).unwrap_err().to_string();
    assert!(e.contains("model.safetensors") && e.contains("shape"), "{e}");
}
