//! Context parallelism's ops: the keys and values of a whole sequence gathered from every
//! rank of a context group, and their gradients summed back to the ranks that hold them.
//!
//! Each rank holds its rows of every sequence (`ContextLayout`): its own chunk, or under
//! head-tail balancing a head and a tail chunk. A gather returns the whole sequence in
//! position order, so the attention's mask is a query's position against a key's index.
//! `allgather` moves every rank's rows in one all-gather (and the gradients in one
//! reduce-scatter); `alltoall` passes blocks around the ring, `degree - 1` steps each
//! sending the block in hand to the next rank (torch's rotation, on the backend's
//! all-to-all). Gradients are summed in f32 whatever the compute dtype. Like the tensor
//! group's, the collectives are tagged by a per-rank counter; under shardplan's runtime
//! they run on the all-to-all stream's thread while the compute stream reads the rank's
//! index, so the group is shared between threads.

use crate::comm::{Collectives, Reduce};
use crate::ExecError;
use candle_core::{DType as CDType, Tensor};
use shardplan_ir::{ContextLayout, ContextRotate};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

type Result<T> = std::result::Result<T, ExecError>;

/// One rank's handle on its context group, with the tag of its next collective.
pub struct ContextGroup {
    comm: Arc<dyn Collectives>,
    next: AtomicU64,
}

impl ContextGroup {
    pub fn new(comm: Arc<dyn Collectives>) -> Self {
        ContextGroup {
            comm,
            next: AtomicU64::new(0),
        }
    }

    /// This rank's index in the group: which rows of each sequence it holds.
    pub fn index(&self) -> usize {
        self.comm.index()
    }

    /// `n` consecutive tags.
    fn tags(&self, n: u64) -> u64 {
        self.next.fetch_add(n, Ordering::Relaxed)
    }

    /// Waits, under the collective timeout, for the group's collectives that were only
    /// enqueued (NCCL); nothing to do on a blocking backend.
    pub fn flush(&self) -> Result<()> {
        if self.comm.enqueues() {
            self.comm.flush()
        } else {
            Ok(())
        }
    }

    fn check(&self, layout: &ContextLayout) -> Result<()> {
        if self.comm.size() as u64 == layout.degree {
            Ok(())
        } else {
            Err(ExecError::Internal(format!(
                "a context-parallel op of degree {} ran on a context group of {} ranks",
                layout.degree,
                self.comm.size()
            )))
        }
    }

    /// Every rank's rows (`x [b, n, ..]`, dim 1) as the whole sequence in position order,
    /// `[b, n * degree, ..]`.
    pub fn all_gather(&self, x: &Tensor, layout: &ContextLayout, rotate: ContextRotate) -> Result<Tensor> {
        self.check(layout)?;
        let blocks = match rotate {
            ContextRotate::AllGather => self.gather_blocks(x)?,
            ContextRotate::AllToAll => self.ring_blocks(x)?,
        };
        in_position_order(&blocks, layout)
    }

    /// The sum over the group of `g` (a whole sequence in position order, `[b, n * degree,
    /// ..]`), this rank's rows `[b, n, ..]`, in `g`'s dtype (summed in f32).
    pub fn reduce_scatter(&self, g: &Tensor, layout: &ContextLayout, rotate: ContextRotate) -> Result<Tensor> {
        self.check(layout)?;
        let dtype = g.dtype();
        let wide = if dtype == CDType::F64 { CDType::F64 } else { CDType::F32 };
        let blocks = rank_blocks(&g.to_dtype(wide)?, layout)?;
        let mine = match rotate {
            ContextRotate::AllGather => self.reduce_blocks(&blocks)?,
            ContextRotate::AllToAll => self.ring_reduce(&blocks)?,
        };
        Ok(mine.to_dtype(dtype)?)
    }

    /// Every rank's `x` by one all-gather, in rank order.
    fn gather_blocks(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let front = x.transpose(0, 1)?.contiguous()?;
        let all = self.comm.all_gather(self.tags(1), &front.flatten_all()?)?;
        let mut dims = front.dims().to_vec();
        let n = dims[0];
        dims[0] *= self.comm.size();
        let all = all.reshape(dims)?;
        (0..self.comm.size())
            .map(|r| Ok(all.narrow(0, r * n, n)?.transpose(0, 1)?.contiguous()?))
            .collect()
    }

    /// Every rank's `x` around the ring, in rank order: at each step every rank passes the
    /// block it received last (its own first) to the next rank.
    fn ring_blocks(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let size = self.comm.size();
        let me = self.index();
        let mut blocks: Vec<Option<Tensor>> = vec![None; size];
        let mut held = x.contiguous()?;
        blocks[me] = Some(held.clone());
        for step in 1..size {
            held = self.shift(&held)?;
            blocks[(me + size - step) % size] = Some(held.clone());
        }
        blocks
            .into_iter()
            .map(|b| b.ok_or_else(|| ExecError::Internal("a context ring left a block unfilled".into())))
            .collect()
    }

    /// The sum of every rank's `blocks[index]` by one reduce-scatter.
    fn reduce_blocks(&self, blocks: &[Tensor]) -> Result<Tensor> {
        let fronts: Vec<Tensor> = blocks
            .iter()
            .map(|b| Ok(b.transpose(0, 1)?.contiguous()?))
            .collect::<Result<_>>()?;
        let dims = fronts[0].dims().to_vec();
        let flat: Vec<Tensor> = fronts.iter().map(|f| Ok(f.flatten_all()?)).collect::<Result<_>>()?;
        let part = self
            .comm
            .reduce_scatter(self.tags(1), &Tensor::cat(&flat, 0)?, Reduce::Sum)?;
        Ok(part.reshape(dims)?.transpose(0, 1)?.contiguous()?)
    }

    /// The sum of every rank's `blocks[index]` around the ring: each rank starts the
    /// partial sum of the block of the rank before it and, at each step, adds its own part
    /// of the block it receives; after `size - 1` steps it holds its own block's sum.
    fn ring_reduce(&self, blocks: &[Tensor]) -> Result<Tensor> {
        let size = self.comm.size();
        let me = self.index();
        let mut acc = blocks[(me + size - 1) % size].contiguous()?;
        for step in 1..size {
            let got = self.shift(&acc)?;
            acc = (got + &blocks[(me + 2 * size - 1 - step) % size])?;
        }
        Ok(acc)
    }

    /// `x` sent to the next rank of the ring; what the previous rank sent, shaped as `x`.
    fn shift(&self, x: &Tensor) -> Result<Tensor> {
        let size = self.comm.size();
        let me = self.index();
        let (next, prev) = ((me + 1) % size, (me + size - 1) % size);
        let flat = x.flatten_all()?;
        let empty = Tensor::zeros(0, x.dtype(), x.device())?;
        let parts: Vec<Tensor> = (0..size)
            .map(|i| if i == next { flat.clone() } else { empty.clone() })
            .collect();
        let lens: Vec<usize> = (0..size).map(|i| if i == prev { x.elem_count() } else { 0 }).collect();
        let got = self.comm.all_to_all(self.tags(2), &parts, &lens)?;
        Ok(got[prev].reshape(x.dims())?)
    }
}

/// Rank-order blocks (each rank's rows of dim 1) as the whole sequence in position order.
fn in_position_order(blocks: &[Tensor], layout: &ContextLayout) -> Result<Tensor> {
    let chunks = layout.balance.chunks(layout.degree) as usize;
    let per_rank = chunks / layout.degree as usize;
    let len = blocks[0].dim(1)? / per_rank;
    let mut pieces: Vec<Option<Tensor>> = vec![None; chunks];
    for (rank, block) in blocks.iter().enumerate() {
        for (piece, chunk) in layout.chunks_of(rank as u64).into_iter().enumerate() {
            pieces[chunk as usize] = Some(block.narrow(1, piece * len, len)?);
        }
    }
    let pieces: Vec<Tensor> = pieces
        .into_iter()
        .map(|p| p.ok_or_else(|| ExecError::Internal("a context layout left a chunk unheld".into())))
        .collect::<Result<_>>()?;
    Ok(Tensor::cat(&pieces, 1)?.contiguous()?)
}

/// A whole sequence in position order (dim 1) as each rank's rows, in rank order.
fn rank_blocks(whole: &Tensor, layout: &ContextLayout) -> Result<Vec<Tensor>> {
    let chunks = layout.balance.chunks(layout.degree) as usize;
    let len = whole.dim(1)? / chunks;
    (0..layout.degree)
        .map(|rank| {
            let pieces: Vec<Tensor> = layout
                .chunks_of(rank)
                .into_iter()
                .map(|c| whole.narrow(1, c as usize * len, len))
                .collect::<std::result::Result<_, _>>()?;
            Ok(Tensor::cat(&pieces, 1)?.contiguous()?)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::local::on_group;
    use candle_core::Device;
    use shardplan_ir::ContextBalance;

    /// Rank `r`'s rows of a `[1, 8, 1]` sequence holding its positions, and the gather
    /// and reduction of every rotate method and balance against the layout.
    #[test]
    fn rings_and_gathers_agree_with_the_layout() {
        for balance in [ContextBalance::HeadTail, ContextBalance::None] {
            for rotate in [ContextRotate::AllGather, ContextRotate::AllToAll] {
                let layout = ContextLayout { degree: 4, balance };
                let outs = on_group(4, |comm, r| {
                    let g = ContextGroup::new(Arc::new(comm));
                    let pos: Vec<f32> = layout.positions(r as u64, 2).into_iter().map(|p| p as f32).collect();
                    let x = Tensor::from_vec(pos, (1, 2, 1), &Device::Cpu).unwrap();
                    let whole = g.all_gather(&x, &layout, rotate).unwrap();
                    let ones = Tensor::arange(0f32, 8.0, &Device::Cpu)
                        .unwrap()
                        .reshape((1, 8, 1))
                        .unwrap();
                    let back = g.reduce_scatter(&ones, &layout, rotate).unwrap();
                    (
                        whole.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        back.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    )
                });
                for (r, (whole, back)) in outs.iter().enumerate() {
                    assert_eq!(
                        *whole,
                        (0..8).map(|p| p as f32).collect::<Vec<_>>(),
                        "{balance:?} {rotate:?}"
                    );
                    let want: Vec<f32> = layout
                        .positions(r as u64, 2)
                        .into_iter()
                        .map(|p| 4.0 * p as f32)
                        .collect();
                    assert_eq!(*back, want, "{balance:?} {rotate:?} rank {r}");
                }
            }
        }
    }
}
