//! Shard layout: every parameter split along dim 0 over the shard axis with torch.chunk
//! semantics, padded to equal per-rank size, and packed into one flat buffer per group
//! (FSDP2's all-gather input / output layout).
//!
//! torch.chunk: with `c = ceil(dim0 / shard)`, rank `i` holds rows `[i*c, min((i+1)*c, dim0))`
//! — trailing ranks may hold short or empty shards. Every rank's shard is padded to `c` rows,
//! so an all-gather of equal-size buffers reassembles the parameter plus padding.

use crate::group::FsdpGroup;
use serde::{Deserialize, Serialize};
use shardplan_ir::{DType, Graph, ParamId};
use std::ops::Range;

/// Rows of dim 0 that shard `rank` of `shard` holds (torch.chunk; may be empty).
pub fn chunk_rows(dim0: u64, shard: u64, rank: u64) -> Range<u64> {
    let c = dim0.div_ceil(shard.max(1));
    let start = (rank * c).min(dim0);
    start..((rank + 1) * c).min(dim0)
}

/// How one parameter is sharded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamLayout {
    pub param: ParamId,
    pub dims: Vec<u64>,
    /// Elements per dim-0 row (product of the other dims; 1 for a vector).
    pub row_elems: u64,
    /// Padded rows per rank: `ceil(dim0 / shard)`.
    pub chunk_rows: u64,
    /// Offset, in elements, of this parameter's padded shard within a rank's flat shard.
    pub shard_offset: u64,
}

impl ParamLayout {
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Padded elements per rank.
    pub fn shard_numel(&self) -> u64 {
        self.chunk_rows * self.row_elems
    }

    /// Elements rank `rank` really holds (the rest of its shard is padding).
    pub fn valid_numel(&self, shard: u64, rank: u64) -> u64 {
        let r = chunk_rows(self.dims.first().copied().unwrap_or(1), shard, rank);
        (r.end - r.start) * self.row_elems
    }
}

/// The flat shard of one group on every rank of a shard group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupLayout {
    pub shard: u64,
    pub params: Vec<ParamLayout>,
    /// Elements of one rank's flat shard (padded, the all-gather input size).
    pub shard_numel: u64,
    /// Elements of the parameters themselves.
    pub numel: u64,
}

impl GroupLayout {
    /// Elements of the all-gather output: `shard x shard_numel` (parameters plus padding).
    pub(crate) fn gathered_numel(&self) -> u64 {
        self.shard_numel * self.shard
    }

    /// Padding elements summed over the shard group.
    pub fn padding(&self) -> u64 {
        self.gathered_numel() - self.numel
    }

    /// Bytes of one rank's shard in `dtype`.
    pub fn shard_bytes(&self, dtype: DType) -> u64 {
        self.shard_numel * dtype.size_bytes()
    }

    /// Bytes of the unsharded (gathered, padded) buffer in `dtype`.
    pub(crate) fn gathered_bytes(&self, dtype: DType) -> u64 {
        self.gathered_numel() * dtype.size_bytes()
    }

    /// Offset, in elements of the gathered buffer, where rank `rank`'s rows of parameter
    /// `i` start (the copy-out source).
    pub fn gathered_offset(&self, i: usize, rank: u64) -> u64 {
        rank * self.shard_numel + self.params[i].shard_offset
    }
}

/// The layout of `group` over `shard` ranks.
pub fn layout(g: &Graph, group: &FsdpGroup, shard: u64) -> GroupLayout {
    let mut offset = 0u64;
    let mut numel = 0u64;
    let params = group
        .params
        .iter()
        .map(|&p| {
            let dims = g.param(p).ty.shape.dims().to_vec();
            let dim0 = dims.first().copied().unwrap_or(1);
            let row_elems = dims.iter().skip(1).product::<u64>();
            let chunk_rows = dim0.div_ceil(shard.max(1));
            let l = ParamLayout {
                param: p,
                dims,
                row_elems,
                chunk_rows,
                shard_offset: offset,
            };
            offset += l.shard_numel();
            numel += l.numel();
            l
        })
        .collect();
    GroupLayout {
        shard,
        params,
        shard_numel: offset,
        numel,
    }
}

/// Whether a plan keeps its parameters' and buffers' names: a plan that is printed, run
/// or exported does; a candidate of the auto search, read for its figures only, leaves
/// them out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Names {
    Kept,
    Left,
}

impl Names {
    pub(crate) fn kept(self) -> bool {
        self == Names::Kept
    }
}
