//! A residual MLP classifier: `x + fc2(gelu(fc1(x)))` per layer, then a linear head.
//! Every row of features (batch x seq of them) is classified on its own.

use crate::tracer::Tracer;
use crate::MlpConfig;
use shardplan_ir::{DType, IrError, ModuleKind, Op, WeightLayout};

pub(crate) fn build(t: &mut Tracer, c: &MlpConfig, batch: u64, seq: u64) -> Result<(), IrError> {
    let x0 = t.input("features", t.dtype, &[batch, seq, c.dim])?;
    let targets = t.input("targets", DType::U32, &[batch * seq])?;
    let root = t.g.root();
    let mut x = x0;
    for i in 0..c.n_layers {
        let block = t.scope(root, &format!("layers.{i}"), ModuleKind::Block);
        let h = t.linear(
            block,
            x,
            &format!("layers.{i}.fc1"),
            [c.ffn_dim, c.dim],
            WeightLayout::OutIn,
            true,
        )?;
        let h = t.op(block, Op::Gelu, &[h])?;
        let h = t.linear(
            block,
            h,
            &format!("layers.{i}.fc2"),
            [c.dim, c.ffn_dim],
            WeightLayout::OutIn,
            true,
        )?;
        x = t.op(block, Op::Add, &[x, h])?;
    }
    let head = t.scope(root, "head", ModuleKind::Head);
    let logits = t.linear(head, x, "head", [c.n_classes, c.dim], WeightLayout::OutIn, true)?;
    t.loss(logits, targets)?;
    Ok(())
}
