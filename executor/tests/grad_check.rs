//! Every op's gradient against central finite differences, in f64, on random shapes
//! (broadcasting and grouped-query attention included).
//!
//! Loss: `sum(op(params...) * r)` for a fixed random `r`, so every output element weighs
//! in. Tolerance: |analytic - numeric| <= 1e-6 * max(1, |analytic|, |numeric|), with
//! step 1e-6 (central differences in f64 are accurate to ~1e-9 here).

use candle_core::{Device, Tensor};
use proptest::prelude::*;
use shardplan_executor::{cdtype, Ctx, Interpreter};
use shardplan_ir::{differentiate, DType, Graph, ModuleKind, NodeId, Op, RouterScore, Shape, TensorType, WeightLayout};
use std::collections::HashMap;

const F: DType = DType::F64;

/// A test graph under construction: parameters (differentiated) and integer inputs.
struct Case {
    g: Graph,
    ints: HashMap<NodeId, (Vec<u64>, u32)>,
    seed: u64,
}

impl Case {
    fn new(seed: u64) -> Self {
        Case {
            g: Graph::new("check"),
            ints: HashMap::new(),
            seed,
        }
    }
    fn param(&mut self, dims: &[u64]) -> NodeId {
        let scope = self.g.add_scope(self.g.root(), "m", ModuleKind::Block);
        let name = format!("p{}", self.g.params().len());
        self.g.add_param(&name, TensorType::new(F, dims), scope).unwrap()
    }
    fn ints(&mut self, dims: &[u64], below: u32) -> NodeId {
        let root = self.g.root();
        let id = self
            .g
            .add_input(
                &format!("ids{}", self.ints.len()),
                TensorType::new(DType::U32, dims),
                root,
            )
            .unwrap();
        self.ints.insert(id, (dims.to_vec(), below));
        id
    }
    fn op(&mut self, op: Op, ins: &[NodeId]) -> NodeId {
        let root = self.g.root();
        self.g.add_node(op, ins, root).unwrap()
    }

    /// Adds the weighted-sum loss over `out` and compares gradients with finite differences
    /// (f64 throughout: tolerance 1e-6).
    fn check(self, out: NodeId) {
        self.check_with(out, 1e-6, 1e-6)
    }

    /// As [`Case::check`], with a finite-difference step and relative tolerance of choice.
    fn check_with(mut self, out: NodeId, eps: f64, rel_tol: f64) {
        let root = self.g.root();
        let out_ty = self.g.node(out).ty.clone();
        let out = if out_ty.dtype == F {
            out
        } else {
            self.g.add_node(Op::Cast { dtype: F }, &[out], root).unwrap()
        };
        let r = self
            .g
            .add_input("r", TensorType::new(F, out_ty.shape.clone()), root)
            .unwrap();
        let weighted = self.g.add_node(Op::Mul, &[out, r], root).unwrap();
        let loss = self.g.add_node(Op::Sum, &[weighted], root).unwrap();
        self.g.add_output(loss);

        let dev = Device::Cpu;
        let ctx = Ctx::new(dev.clone());
        let mut rng = Rng(self.seed);
        let mut values: HashMap<NodeId, Tensor> = HashMap::new();
        for (id, n) in self.g.nodes() {
            let dims: Vec<usize> = n.ty.shape.dims().iter().map(|&d| d as usize).collect();
            let numel: usize = dims.iter().product();
            let t = match (&n.op, self.ints.get(&id)) {
                (Op::Input { .. }, Some((_, below))) => Tensor::from_vec(
                    (0..numel)
                        .map(|_| (rng.next() % *below as u64) as u32)
                        .collect::<Vec<_>>(),
                    dims.as_slice(),
                    &dev,
                )
                .unwrap(),
                (Op::Input { .. } | Op::Param { .. }, None) => Tensor::from_vec(
                    (0..numel).map(|_| rng.uniform() * 2.0 - 1.0).collect::<Vec<f64>>(),
                    dims.as_slice(),
                    &dev,
                )
                .unwrap(),
                _ => continue,
            };
            values.insert(id, t.to_dtype(cdtype(n.ty.dtype)).unwrap());
        }

        let joint = differentiate(&self.g).unwrap();
        let params: Vec<_> = self
            .g
            .params()
            .map(|(p, param)| (param.node, joint.grad(p).unwrap()))
            .collect();
        let mut keep = vec![joint.loss];
        keep.extend(params.iter().map(|(_, gr)| *gr));
        let run = Interpreter::new(joint.graph.clone(), &keep)
            .run(&ctx, &keep, &mut |id| Ok(values[&id].clone()))
            .unwrap();

        let fwd = Interpreter::new(self.g.clone(), &[loss]);
        let loss_at = |values: &HashMap<NodeId, Tensor>| -> f64 {
            fwd.run(&ctx, &[loss], &mut |id| Ok(values[&id].clone())).unwrap().kept[0]
                .to_scalar::<f64>()
                .unwrap()
        };
        for (k, (node, _)) in params.iter().enumerate() {
            let analytic: Vec<f64> = run.kept[k + 1].flatten_all().unwrap().to_vec1().unwrap();
            let base: Vec<f64> = values[node].flatten_all().unwrap().to_vec1().unwrap();
            let dims = values[node].dims().to_vec();
            for i in 0..base.len() {
                let at = |delta: f64| {
                    let mut v = base.clone();
                    v[i] += delta;
                    let mut vals = values.clone();
                    vals.insert(*node, Tensor::from_vec(v, dims.as_slice(), &dev).unwrap());
                    loss_at(&vals)
                };
                let numeric = (at(eps) - at(-eps)) / (2.0 * eps);
                let a = analytic[i];
                let tol = rel_tol * 1f64.max(a.abs()).max(numeric.abs());
                assert!(
                    (a - numeric).abs() <= tol,
                    "param {k} element {i}: analytic {a} vs numeric {numeric}\n{}",
                    shardplan_ir::to_text(&joint.graph)
                );
            }
        }
    }
}

/// splitmix64: a small, seedable generator for test data.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn dims() -> impl Strategy<Value = (u64, u64, u64)> {
    (1u64..4, 1u64..5, 1u64..6)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn linear_both_layouts_with_bias((b, s, n) in dims(), out in 1u64..5, seed in any::<u64>()) {
        for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
            let mut c = Case::new(seed);
            let x = c.param(&[b, s, n]);
            let w = c.param(&if layout == WeightLayout::OutIn { [out, n] } else { [n, out] });
            let bias = c.param(&[out]);
            let y = c.op(Op::Linear { bias: true, layout, float8: None }, &[x, w, bias]);
            c.check(y);
        }
    }

    #[test]
    fn matmul_with_batch_broadcast((m, k, n) in dims(), batch in 1u64..3, seed in any::<u64>()) {
        let mut c = Case::new(seed);
        let a = c.param(&[batch, 2, m, k]);
        let b = c.param(&[2, k, n]);
        let y = c.op(Op::MatMul, &[a, b]);
        c.check(y);
    }

    #[test]
    fn add_and_mul_broadcast((a, b, d) in dims(), seed in any::<u64>()) {
        for op in [Op::Add, Op::Mul] {
            let mut c = Case::new(seed);
            let x = c.param(&[a, b, d]);
            let y = c.param(&[1, b, 1]);
            let z = c.op(op.clone(), &[x, y]);
            c.check(z);
        }
    }

    #[test]
    fn norms((a, b, d) in dims(), seed in any::<u64>()) {
        let mut c = Case::new(seed);
        let (x, w) = (c.param(&[a, b, d + 1]), c.param(&[d + 1]));
        let y = c.op(Op::RmsNorm { eps: 1e-5 }, &[x, w]);
        c.check(y);
        let mut c = Case::new(seed);
        let (x, w, bias) = (c.param(&[a, b, d + 1]), c.param(&[d + 1]), c.param(&[d + 1]));
        let y = c.op(Op::LayerNorm { eps: 1e-5 }, &[x, w, bias]);
        c.check(y);
    }

    #[test]
    fn rope(b in 1u64..3, s in 1u64..6, h in 1u64..3, half in 1u64..4, seed in any::<u64>()) {
        let mut c = Case::new(seed);
        let x = c.param(&[b, s, h, 2 * half]);
        let y = c.op(Op::Rope {
                theta: 10000.0,
                scaling: Default::default(),
                context: None,
            }, &[x]);
        c.check(y);
    }

    #[test]
    fn attention_grouped_query(b in 1u64..3, s in 1u64..5, kv in 1u64..3, group in 1u64..4, d in 1u64..4, causal in any::<bool>(), seed in any::<u64>()) {
        let mut c = Case::new(seed);
        let q = c.param(&[b, s, kv * group, d]);
        let k = c.param(&[b, s, kv, d]);
        let v = c.param(&[b, s, kv, d]);
        let y = c.op(Op::Attention { causal, context: None }, &[q, k, v]);
        c.check(y);
    }

    #[test]
    fn activations_and_softmax((a, b, d) in dims(), seed in any::<u64>()) {
        for op in [Op::Silu, Op::Gelu, Op::GeluErf, Op::Sigmoid, Op::Softmax { dim: 2 }, Op::Softmax { dim: 0 }] {
            let mut c = Case::new(seed);
            let x = c.param(&[a, b, d]);
            let y = c.op(op, &[x]);
            c.check(y);
        }
    }

    #[test]
    fn cross_entropy(n in 1u64..6, v in 2u64..7, seed in any::<u64>()) {
        let mut c = Case::new(seed);
        let logits = c.param(&[n, v]);
        let t = c.ints(&[n], v as u32);
        let y = c.op(Op::CrossEntropy, &[logits, t]);
        c.check(y);
    }

    #[test]
    fn embedding_with_repeated_ids(v in 1u64..5, d in 1u64..4, (b, s, _) in dims(), seed in any::<u64>()) {
        let mut c = Case::new(seed);
        let table = c.param(&[v, d]);
        let ids = c.ints(&[b, s], v as u32);
        let y = c.op(Op::Embedding, &[table, ids]);
        c.check(y);
    }

    #[test]
    fn views_and_casts((a, b, d) in dims(), seed in any::<u64>()) {
        let mut c = Case::new(seed);
        let x = c.param(&[a, b, d]);
        let r = c.op(Op::Reshape { shape: Shape::new([b, a * d]) }, &[x]);
        let t = c.op(Op::Transpose { dim0: 0, dim1: 1 }, &[r]);
        let y = c.param(&[a * d, 2]);
        let cat = c.op(Op::Concat { dim: 1 }, &[t, y]);
        let n = c.op(Op::Narrow { dim: 1, start: 1, len: b }, &[cat]);
        let s = c.op(Op::Sum, &[n]);
        c.check(s);
    }

    /// A round trip through f32 loses precision, so this one uses a larger step and an
    /// f32-sized tolerance.
    #[test]
    fn cast_through_f32((a, b, d) in dims(), seed in any::<u64>()) {
        let mut c = Case::new(seed);
        let x = c.param(&[a, b, d]);
        let down = c.op(Op::Cast { dtype: DType::F32 }, &[x]);
        let y = c.op(Op::Silu, &[down]);
        c.check_with(y, 1e-3, 1e-4);
    }

    /// A whole routed feed-forward: router, top-k, weights (both scores, renormalised or
    /// not), permutation to expert order, the grouped SwiGLU experts and the weighted
    /// combine back. The selection is piecewise constant, so the step stays far below the
    /// gap between random scores. With `capacity` each expert keeps that many assignments
    /// and the dropped ones leave the expert path (token dropping).
    #[test]
    fn moe_routed_experts(t in 1u64..6, d in 1u64..4, f in 1u64..4, (e, k) in (2u64..5).prop_flat_map(|e| (Just(e), 1..=e)), sigmoid in any::<bool>(), norm in any::<bool>(), capacity in proptest::option::of(1u64..4), seed in any::<u64>()) {
        let score = if sigmoid { RouterScore::Sigmoid } else { RouterScore::Softmax };
        let mut c = Case::new(seed);
        let x = c.param(&[t, d]);
        let router = c.param(&[e, d]);
        let linear = Op::Linear { bias: false, layout: WeightLayout::OutIn, float8: None };
        let logits = c.op(linear, &[x, router]);
        let top = c.op(Op::MoeTopK { k, score }, &[logits]);
        let w = c.op(Op::MoeRouterWeights { score, norm }, &[logits, top]);
        let ids = match capacity {
            Some(capacity) => c.op(Op::MoeDrop { experts: e, capacity }, &[top]),
            None => top,
        };
        let xs = c.op(Op::MoePermute, &[x, ids]);
        let grouped = |c: &mut Case, x, dims: [u64; 2]| {
            let mut ins = vec![x, ids];
            ins.extend((0..e).map(|_| c.param(&dims)));
            c.op(Op::GroupedLinear { layout: WeightLayout::OutIn }, &ins)
        };
        let gate = grouped(&mut c, xs, [f, d]);
        let up = grouped(&mut c, xs, [f, d]);
        let act = c.op(Op::Silu, &[gate]);
        let h = c.op(Op::Mul, &[act, up]);
        let y = grouped(&mut c, h, [d, f]);
        let w3 = c.op(Op::Reshape { shape: Shape::new([t, k, 1]) }, &[w]);
        let wp = c.op(Op::MoePermute, &[w3, ids]);
        let weighted = c.op(Op::Mul, &[y, wp]);
        let out = c.op(Op::MoeUnpermute { sum: true }, &[weighted, ids]);
        c.check(out);
    }

    /// The per-slot unpermute and the permute of per-slot rows, inverse to each other (any
    /// ids, repeated experts included).
    #[test]
    fn moe_unpermute_per_slot(t in 1u64..6, d in 1u64..4, e in 2u64..5, seed in any::<u64>()) {
        let mut c = Case::new(seed);
        let ids = c.ints(&[t, 2], e as u32);
        let y = c.param(&[t * 2, d]);
        let back = c.op(Op::MoeUnpermute { sum: false }, &[y, ids]);
        let again = c.op(Op::MoePermute, &[back, ids]);
        let s = c.op(Op::Silu, &[again]);
        c.check(s);
    }

    /// The load-balancing loss over two layers' logits.
    #[test]
    fn moe_aux_loss(t in 1u64..6, (e, k) in (2u64..6).prop_flat_map(|e| (Just(e), 1..=e)), seed in any::<u64>()) {
        let mut c = Case::new(seed);
        let a = c.param(&[t, e]);
        let b = c.param(&[t, e]);
        let y = c.op(Op::MoeAuxLoss { top_k: k, coef: 0.25 }, &[a, b]);
        c.check(y);
    }
}
