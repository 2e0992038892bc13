//! The traced mixture-of-experts feed-forward against Hugging Face's algorithm written out
//! token by token (Qwen2-MoE's sparse block: softmax over all experts, the top k, their
//! scores renormalised, each chosen expert's SwiGLU scaled by its score and summed, plus the
//! shared expert scaled by the sigmoid of its gate), in f64 from the same weights.

use candle_core::{Device, Tensor};
use shardplan_executor::cpu::kernels::Ctx;
use shardplan_executor::runtime::interp::Interpreter;
use shardplan_ir::{DType, NodeId, Op};
use shardplan_models::{trace, ModelConfig, TraceOptions};
use std::collections::HashMap;

fn tiny_moe(norm: bool) -> ModelConfig {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models/tiny-moe.yaml");
    let ModelConfig::Llama(mut c) = shardplan_frontends::load_model(&path).unwrap().config else {
        unreachable!()
    };
    c.moe.as_mut().unwrap().norm_topk_prob = norm;
    ModelConfig::Llama(c)
}

/// splitmix64.
struct Rng(u64);
impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Row-major `w [out, in]` times `x [in]`.
fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks(x.len())
        .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

fn swiglu(gate: &[f64], up: &[f64], down: &[f64], x: &[f64]) -> Vec<f64> {
    let (g, u) = (matvec(gate, x), matvec(up, x));
    let h: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
    matvec(down, &h)
}

fn check(norm: bool) {
    let model = tiny_moe(norm);
    let ModelConfig::Llama(c) = &model else { unreachable!() };
    let m = c.moe.unwrap();
    let (batch, seq) = (2u64, 8u64);
    let g = trace(
        &model,
        TraceOptions {
            batch,
            seq_len: Some(seq),
            dtype: DType::F32,
            ..TraceOptions::default()
        },
    )
    .unwrap();
    let param = |name: &str| g.params().find(|(_, p)| &*p.name == name).unwrap().1.node;
    let layer = "model.layers.1.mlp";
    // The router's input: the flattened normalised hidden states; the block's output: the
    // feed-forward's last node.
    let router = g.users(param(&format!("{layer}.gate.weight")))[0];
    let x = g.node(router).inputs[0];
    let (ffn_out, _) = g
        .nodes()
        .filter(|(_, n)| g.scope(n.scope).path == "layers.1.feed_forward")
        .last()
        .unwrap();
    assert!(matches!(g.node(ffn_out).op, Op::Reshape { .. }));

    let mut rng = Rng(7);
    let mut values: HashMap<NodeId, Tensor> = HashMap::new();
    for (id, n) in g.nodes() {
        let dims: Vec<usize> = n.ty.shape.dims().iter().map(|&d| d as usize).collect();
        let numel: usize = dims.iter().product();
        let t = match &n.op {
            Op::Input { .. } => Tensor::from_vec(
                (0..numel)
                    .map(|_| (rng.uniform() * c.vocab_size as f64) as u32)
                    .collect::<Vec<_>>(),
                dims.as_slice(),
                &Device::Cpu,
            ),
            Op::Param { .. } => Tensor::from_vec(
                (0..numel).map(|_| (rng.uniform() - 0.5) as f32).collect::<Vec<_>>(),
                dims.as_slice(),
                &Device::Cpu,
            ),
            _ => continue,
        };
        values.insert(id, t.unwrap());
    }
    let keep = [x, ffn_out];
    let out = Interpreter::new(g.clone(), &keep)
        .run(&Ctx::new(Device::Cpu), &keep, &mut |id| Ok(values[&id].clone()))
        .unwrap();
    let host = |t: &Tensor| -> Vec<f64> {
        t.to_dtype(candle_core::DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let w = |name: &str| host(&values[&param(&format!("{layer}.{name}.weight"))]);
    let (xs, got) = (host(&out.kept[0]), host(&out.kept[1]));
    let (d, e, k) = (c.dim as usize, m.experts as usize, m.top_k as usize);
    let gate = w("gate");
    let shared = (
        w("shared_expert.gate_proj"),
        w("shared_expert.up_proj"),
        w("shared_expert.down_proj"),
    );
    let shared_gate = w("shared_expert_gate");
    let experts: Vec<_> = (0..e)
        .map(|i| {
            (
                w(&format!("experts.{i}.gate_proj")),
                w(&format!("experts.{i}.up_proj")),
                w(&format!("experts.{i}.down_proj")),
            )
        })
        .collect();
    let mut worst = 0f64;
    for (t, x) in xs.chunks(d).enumerate() {
        let logits = matvec(&gate, x);
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = logits.iter().map(|l| (l - max).exp()).sum();
        let p: Vec<f64> = logits.iter().map(|l| (l - max).exp() / z).collect();
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        let chosen = &order[..k];
        let sum: f64 = if norm { chosen.iter().map(|&i| p[i]).sum() } else { 1.0 };
        let mut y = vec![0.0f64; d];
        for &i in chosen {
            let (g1, u, dn) = &experts[i];
            for (y, v) in y.iter_mut().zip(swiglu(g1, u, dn, x)) {
                *y += p[i] / sum * v;
            }
        }
        let s = swiglu(&shared.0, &shared.1, &shared.2, x);
        let sg = 1.0 / (1.0 + (-matvec(&shared_gate, x)[0]).exp());
        for (y, v) in y.iter_mut().zip(s) {
            *y += sg * v;
        }
        let row = &got[t * d..(t + 1) * d];
        let num: f64 = row.iter().zip(&y).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
        let den: f64 = y.iter().map(|b| b * b).sum::<f64>().sqrt();
        worst = worst.max(num / den);
    }
    assert!(worst < 1e-5, "norm_topk_prob {norm}: worst token {worst:e}");
}

#[test]
fn traced_moe_block_equals_the_token_by_token_algorithm() {
    check(true);
    check(false);
}
