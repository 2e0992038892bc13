//! Tensor parallelism's ops: the activation collectives over a rank's tensor group, and
//! the vocabulary-split embedding and cross-entropy, which reduce over it.
//!
//! Every rank of a tensor group runs the same graph in the same order, so the group's
//! collectives are tagged by a per-rank counter: the n-th collective of one rank meets the
//! n-th of every other. The backends move flat buffers along dim 0, so an op on `dim`
//! moves that dim to the front first.

use crate::comm::{Collectives, Reduce};
use crate::ExecError;
use candle_core::{DType as CDType, Tensor, D};
use shardplan_ir::TensorSplit;
use std::cell::Cell;
use std::sync::Arc;

type Result<T> = std::result::Result<T, ExecError>;

/// One rank's handle on its tensor group, with the tag of its next collective.
pub struct TensorGroup {
    comm: Arc<dyn Collectives>,
    next: Cell<u64>,
}

impl TensorGroup {
    pub fn new(comm: Arc<dyn Collectives>) -> Self {
        TensorGroup {
            comm,
            next: Cell::new(0),
        }
    }

    /// This rank's index in the group.
    pub fn index(&self) -> usize {
        self.comm.index()
    }

    pub fn size(&self) -> usize {
        self.comm.size()
    }

    fn tag(&self) -> u64 {
        let t = self.next.get();
        self.next.set(t + 1);
        t
    }

    fn check(&self, degree: u64) -> Result<()> {
        if self.size() as u64 == degree {
            Ok(())
        } else {
            Err(ExecError::Internal(format!(
                "a tensor-parallel op of degree {degree} ran on a tensor group of {} ranks",
                self.size()
            )))
        }
    }

    /// Every rank's `x` concatenated along `dim`, in rank order.
    pub fn all_gather(&self, x: &Tensor, dim: usize, degree: u64) -> Result<Tensor> {
        self.check(degree)?;
        let front = x.transpose(0, dim)?.contiguous()?;
        let mut dims = front.dims().to_vec();
        let all = self.comm.all_gather(self.tag(), &front.flatten_all()?)?;
        dims[0] *= degree as usize;
        Ok(all.reshape(dims)?.transpose(0, dim)?.contiguous()?)
    }

    /// The sum of every rank's `x`, this rank's chunk of `dim`.
    pub fn reduce_scatter(&self, x: &Tensor, dim: usize, degree: u64) -> Result<Tensor> {
        self.check(degree)?;
        let front = x.transpose(0, dim)?.contiguous()?;
        let mut dims = front.dims().to_vec();
        let part = self
            .comm
            .reduce_scatter(self.tag(), &front.flatten_all()?, Reduce::Sum)?;
        dims[0] /= degree as usize;
        Ok(part.reshape(dims)?.transpose(0, dim)?.contiguous()?)
    }

    /// The sum of every rank's `x`.
    pub fn all_reduce(&self, x: &Tensor, degree: u64) -> Result<Tensor> {
        self.check(degree)?;
        let sum = self.comm.all_reduce(self.tag(), &x.flatten_all()?, Reduce::Sum)?;
        Ok(sum.reshape(x.dims())?)
    }

    /// This rank's chunk of `dim` of a value every rank holds whole.
    pub fn slice(&self, x: &Tensor, dim: usize, degree: u64) -> Result<Tensor> {
        self.check(degree)?;
        let chunk = x.dim(dim)? / degree as usize;
        Ok(x.narrow(dim, self.index() * chunk, chunk)?.contiguous()?)
    }

    /// The first id of the vocabulary rows this rank holds of a table of `rows` local rows.
    fn vocab_start(&self, rows: usize) -> u32 {
        (self.index() * rows) as u32
    }

    /// The rows of `table` (this rank's `[V / degree, D]`) for `ids`, zeros for ids
    /// another rank holds.
    pub fn embedding(&self, table: &Tensor, ids: &Tensor, out: &[usize], degree: u64) -> Result<Tensor> {
        self.check(degree)?;
        let rows = table.dim(0)?;
        let (local, mask) = self.local_ids(ids, rows)?;
        let dim = table.dim(1)?;
        let picked = table.index_select(&local, 0)?;
        let mask = mask.to_dtype(table.dtype())?.reshape((local.dim(0)?, 1))?;
        Ok(picked.broadcast_mul(&mask)?.reshape(with_last(out, dim))?)
    }

    /// The table gradient of [`TensorGroup::embedding`]: the rows of `g` whose ids this
    /// rank holds, summed into its `[rows, D]`.
    pub fn embedding_grad(&self, ids: &Tensor, g: &Tensor, rows: usize, degree: u64) -> Result<Tensor> {
        self.check(degree)?;
        let (local, mask) = self.local_ids(ids, rows)?;
        let d = g.dim(D::Minus1)?;
        let g2 = g.reshape((local.dim(0)?, d))?.to_dtype(wide_dtype(g.dtype()))?;
        let g2 = g2.broadcast_mul(&mask.to_dtype(g2.dtype())?.reshape((local.dim(0)?, 1))?)?;
        let zeros = Tensor::zeros((rows, d), g2.dtype(), g.device())?;
        Ok(zeros.index_add(&local, &g2, 0)?.to_dtype(g.dtype())?)
    }

    /// Flat local row indices (0 where another rank holds the id) and a 0/1 mask.
    fn local_ids(&self, ids: &Tensor, rows: usize) -> Result<(Tensor, Tensor)> {
        let start = self.vocab_start(rows);
        let end = start + rows as u32;
        let all = ids.flatten_all()?.to_dtype(CDType::U32)?.to_vec1::<u32>()?;
        let local: Vec<u32> = all
            .iter()
            .map(|&i| if (start..end).contains(&i) { i - start } else { 0 })
            .collect();
        let mask: Vec<u8> = all.iter().map(|&i| u8::from((start..end).contains(&i))).collect();
        let n = local.len();
        Ok((
            Tensor::from_vec(local, n, ids.device())?,
            Tensor::from_vec(mask, n, ids.device())?,
        ))
    }

    /// Each row's maximum over the whole vocabulary and `sum(exp(x - max))` over it, and
    /// the target's logit, from this rank's `[n, V / degree]` logits (in f32 or f64).
    fn softmax_stats(&self, x: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (n, rows) = x.dims2()?;
        let local_max = x.max_keepdim(1)?.reshape(n)?;
        let maxes = self
            .comm
            .all_gather(self.tag(), &local_max)?
            .reshape((self.size(), n))?;
        let m = maxes.max_keepdim(0)?.reshape((n, 1))?;
        let sums = x.broadcast_sub(&m)?.exp()?.sum_keepdim(1)?.reshape(n)?;
        let (local, mask) = self.local_ids(targets, rows)?;
        let picked = x.gather(&local.reshape((n, 1))?, 1)?.reshape(n)?;
        let picked = (picked * mask.to_dtype(x.dtype())?)?;
        let both = Tensor::cat(&[&sums, &picked], 0)?;
        let both = self.comm.all_reduce(self.tag(), &both, Reduce::Sum)?;
        Ok((m.reshape(n)?, both.narrow(0, 0, n)?, both.narrow(0, n, n)?))
    }

    /// Mean cross-entropy of vocabulary-split logits: `mean(log S + M - x[target])`.
    pub fn cross_entropy(&self, logits: &Tensor, targets: &Tensor, degree: u64) -> Result<Tensor> {
        self.check(degree)?;
        let x = logits.to_dtype(wide_dtype(logits.dtype()))?;
        let n = x.dim(0)?;
        let (m, s, picked) = self.softmax_stats(&x, targets)?;
        let per_row = ((s.log()? + m)? - picked)?;
        Ok((per_row.sum_all()? * (1.0 / n as f64))?.to_dtype(logits.dtype())?)
    }

    /// `(softmax(x) - onehot(target)) * g / n` on this rank's vocabulary chunk.
    pub fn cross_entropy_grad(&self, logits: &Tensor, targets: &Tensor, g: &Tensor, degree: u64) -> Result<Tensor> {
        self.check(degree)?;
        let x = logits.to_dtype(wide_dtype(logits.dtype()))?;
        let (n, rows) = x.dims2()?;
        let (m, s, _) = self.softmax_stats(&x, targets)?;
        let p = x
            .broadcast_sub(&m.reshape((n, 1))?)?
            .exp()?
            .broadcast_div(&s.reshape((n, 1))?)?;
        let (local, mask) = self.local_ids(targets, rows)?;
        let hit = mask.to_dtype(x.dtype())?.reshape((n, 1))?;
        let onehot = Tensor::zeros((n, rows), x.dtype(), x.device())?.scatter_add(&local.reshape((n, 1))?, &hit, 1)?;
        let scale = g.to_dtype(x.dtype())?.affine(1.0 / n as f64, 0.0)?;
        Ok((p - onehot)?.broadcast_mul(&scale)?.to_dtype(logits.dtype())?)
    }
}

/// Tensor rank `rank`'s slice of a whole parameter (`split` as the graph records it).
pub fn slice_of_whole(whole: &Tensor, split: &TensorSplit, rank: u64) -> Result<Tensor> {
    let parts = split
        .ranges(whole.dim(split.dim)? as u64, rank)
        .into_iter()
        .map(|(start, len)| whole.narrow(split.dim, start as usize, len as usize))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(Tensor::cat(&parts, split.dim)?)
}

/// The whole parameter from every tensor rank's slice, in rank order.
pub fn whole_from_slices(slices: &[Tensor], split: &TensorSplit) -> Result<Tensor> {
    let parts = split.parts.max(1) as usize;
    let mut blocks = Vec::with_capacity(parts * slices.len());
    for p in 0..parts {
        for s in slices {
            let len = s.dim(split.dim)? / parts;
            blocks.push(s.narrow(split.dim, p * len, len)?);
        }
    }
    Ok(Tensor::cat(&blocks, split.dim)?)
}

/// f64 stays f64; everything else is reduced in f32.
fn wide_dtype(d: CDType) -> CDType {
    if d == CDType::F64 {
        CDType::F64
    } else {
        CDType::F32
    }
}

/// `out`'s dims with the last replaced by `d` (a check that the caller's type agrees).
fn with_last(out: &[usize], d: usize) -> Vec<usize> {
    let mut v = out.to_vec();
    if let Some(l) = v.last_mut() {
        *l = d;
    }
    v
}
