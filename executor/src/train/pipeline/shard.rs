//! FSDP inside a pipeline stage, as torchtitan runs it under a pipeline: each parameter's
//! dim-0 rows chunked over the shard group as `torch.chunk` cuts them (padded to equal
//! chunks), gathered whole at the stage's UNSHARD and kept across micro-batches,
//! gradients summed whole over the micro-batches and reduced once at its REDUCE_GRAD
//! (reduce-scatter over the shard group, then all-reduce over the replicate group).

use crate::comm::{Collectives, Reduce};
use crate::cpu::tensor::whole_from_slices;
use crate::init::init_slice_elements;
use crate::ExecError;
use candle_core::{DType as CDType, Device, Tensor};
use shardplan_ir::{Graph, ParamId, TensorSplit};

/// This rank's chunk of one parameter.
#[derive(Clone)]
pub(crate) struct Shard {
    /// The whole parameter's dims.
    dims: Vec<usize>,
    /// This rank's f32 chunk: ceil(rows / shards) rows (zeros past the parameter's end).
    pub(crate) master: Tensor,
    /// How the tensor group splits the parameter (`None`: each tensor rank holds it whole).
    pub(crate) split: Option<TensorSplit>,
}

impl Shard {
    /// Shard `index` of `shards` of parameter `p` of `model` (one tensor rank's graph),
    /// on tensor rank `tensor_rank`: initialised as one rank initialises the whole
    /// parameter.
    pub(crate) fn init(
        model: &Graph,
        p: ParamId,
        seed: u64,
        (index, shards): (usize, usize),
        tensor_rank: u64,
        device: &Device,
    ) -> Result<Shard, ExecError> {
        let param = model.param(p);
        let ty = &param.ty;
        let dims: Vec<usize> = ty.shape.dims().iter().map(|&d| d as usize).collect();
        let (first, rest) = match dims.split_first() {
            Some((&first, rest)) => (first, rest.iter().product::<usize>()),
            None => (1, 1),
        };
        let rows = first.div_ceil(shards);
        let start = (index * rows).min(first);
        let end = ((index + 1) * rows).min(first);
        let range = (start * rest) as u64..(end * rest) as u64;
        let mut values = init_slice_elements(model, p, u64::from(p.0), seed, range, tensor_rank);
        values.resize(rows * rest, 0.0);
        let mut shape = vec![rows];
        shape.extend_from_slice(dims.get(1..).unwrap_or(&[]));
        Ok(Shard {
            master: Tensor::from_vec(values, shape.as_slice(), device)?,
            dims,
            split: param.tensor,
        })
    }

    /// Elements of the whole parameter.
    fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// The whole parameter in `dtype`, gathered over `group` (this rank's chunk alone
    /// without one) under `tag`. Chunks travel flat: the backends concatenate elements.
    pub(crate) fn gather(&self, group: Option<&dyn Collectives>, tag: u64, dtype: CDType) -> Result<Tensor, ExecError> {
        let mine = self.master.to_dtype(dtype)?.flatten_all()?;
        let all = match group {
            Some(g) => g.all_gather(tag, &mine)?.flatten_all()?,
            None => mine,
        };
        Ok(all.narrow(0, 0, self.numel())?.reshape(self.dims.as_slice())?)
    }

    /// This rank's chunk of the whole gradient `grad` averaged over the shard group (a
    /// reduce-scatter) and then the replicate group (an all-reduce), flat, then shaped as
    /// the chunk.
    pub(crate) fn reduce(
        &self,
        grad: &Tensor,
        shard: Option<(&dyn Collectives, u64)>,
        replicate: Option<(&dyn Collectives, u64)>,
    ) -> Result<Tensor, ExecError> {
        let shards = shard.map_or(1, |(g, _)| g.size());
        let mut g = grad.flatten_all()?;
        let padded = self.master.elem_count() * shards;
        if padded > self.numel() {
            let zeros = Tensor::zeros(padded - self.numel(), g.dtype(), g.device())?;
            g = Tensor::cat(&[g, zeros], 0)?;
        }
        let mut mine = match shard {
            Some((group, tag)) => group.reduce_scatter(tag, &g, Reduce::Avg)?,
            None => g,
        };
        if let Some((group, tag)) = replicate {
            mine = group.all_reduce(tag, &mine, Reduce::Avg)?;
        }
        Ok(mine.reshape(self.master.dims())?)
    }

    /// This chunk's geometry holding `t` (an optimizer state's chunk) instead.
    pub(crate) fn with_master(&self, t: Tensor) -> Shard {
        Shard {
            dims: self.dims.clone(),
            master: t,
            split: self.split,
        }
    }

    /// A chunk shaped as this one from its rows' `values` (unpadded), zeros after them.
    pub(crate) fn padded(&self, mut values: Vec<f32>, device: &Device) -> Result<Tensor, ExecError> {
        values.resize(self.master.elem_count(), 0.0);
        Ok(Tensor::from_vec(values, self.master.dims(), device)?)
    }

    /// A zero whole gradient (a parameter the loss does not reach).
    pub(crate) fn zero_grad(&self) -> Result<Tensor, ExecError> {
        Ok(Tensor::zeros(self.dims.as_slice(), CDType::F32, self.master.device())?)
    }

    /// The whole f32 parameter from every rank's chunk: `chunks[t][s]` is tensor rank
    /// `t`'s, shard rank `s`'s.
    pub(crate) fn whole(chunks: &[Vec<&Shard>]) -> Result<Tensor, ExecError> {
        let slices = chunks
            .iter()
            .map(|by_shard| {
                let first = by_shard
                    .first()
                    .ok_or_else(|| ExecError::Internal("no chunks".into()))?;
                let all = Tensor::cat(&by_shard.iter().map(|c| c.master.clone()).collect::<Vec<_>>(), 0)?;
                let rows = first.dims.first().copied().unwrap_or(1);
                Ok(all.narrow(0, 0, rows)?.reshape(first.dims.as_slice())?)
            })
            .collect::<Result<Vec<_>, ExecError>>()?;
        let split = chunks.first().and_then(|c| c.first()).and_then(|c| c.split);
        match split {
            Some(split) => Ok(whole_from_slices(&slices, &split)?),
            None => slices
                .into_iter()
                .next()
                .ok_or_else(|| ExecError::Internal("no tensor slices".into())),
        }
    }
}
