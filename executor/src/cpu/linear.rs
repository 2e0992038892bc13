//! The dense matrix products of linear layers: the layer (`x W^T` or `x W`) and its
//! weight gradient, through the fused f32 `gemm` kernel where it applies and candle's
//! matmul otherwise. The op kernels and the expert layers (`moe.rs`) both run them.

use crate::cpu::fused;
use crate::ExecError;
use candle_core::{Tensor, D};
use shardplan_ir::WeightLayout;

type Result<T> = std::result::Result<T, ExecError>;

/// `[..., in] -> [rows, in]`.
pub(crate) fn rows(x: &Tensor) -> Result<Tensor> {
    let last = x.dim(D::Minus1)?;
    Ok(x.reshape(((), last))?)
}

pub(crate) fn linear(x: &Tensor, w: &Tensor, layout: WeightLayout, out: &[usize]) -> Result<Tensor> {
    let x2 = rows(&x.contiguous()?)?;
    if fused::applies(&[&x2, w]) {
        let w = fused::Operand {
            data: w,
            transposed: layout == WeightLayout::OutIn,
        };
        let x2 = fused::Operand {
            data: &x2,
            transposed: false,
        };
        return Ok(fused::matmul(x2, w)?.reshape(out)?);
    }
    let y = match layout {
        WeightLayout::OutIn => x2.matmul(&w.t()?)?,
        WeightLayout::InOut => x2.matmul(w)?,
    };
    Ok(y.reshape(out)?)
}

pub(crate) fn weight_grad(x: &Tensor, g: &Tensor, layout: WeightLayout) -> Result<Tensor> {
    let (x2, g2) = (rows(&x.contiguous()?)?, rows(&g.contiguous()?)?);
    if fused::applies(&[&x2, &g2]) {
        let op = |t, transposed| fused::Operand { data: t, transposed };
        return match layout {
            // dW [out, in] = g^T x; dW [in, out] = x^T g.
            WeightLayout::OutIn => fused::matmul(op(&g2, true), op(&x2, false)),
            WeightLayout::InOut => fused::matmul(op(&x2, true), op(&g2, false)),
        };
    }
    Ok(match layout {
        WeightLayout::OutIn => g2.t()?.matmul(&x2)?,
        WeightLayout::InOut => x2.t()?.matmul(&g2)?,
    })
}
