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
    pub(crate) fn shard_bytes(&self, dtype: DType) -> u64 {
        self.shard_numel * dtype.size_bytes()
    }

    /// Bytes of the unsharded (gathered, padded) buffer in `dtype`.
    pub(crate) fn gathered_bytes(&self, dtype: DType) -> u64 {
        self.gathered_numel() * dtype.size_bytes()
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

#[cfg(test)]
mod tests {
    //! Layouts pack padded shards back to back and account for every element.

    use super::layout;
    use crate::group::{group, WrapPolicy};
    use crate::testing::tiny;
    use proptest::prelude::*;
    use shardplan_ir::{DType, ModuleKind};

    #[test]
    fn layout_packs_padded_shards_back_to_back() {
        let g = tiny("tiny-llama");
        let groups = group(&g, &WrapPolicy::kinds(&[ModuleKind::Block])).unwrap();
        let root = layout(&g, groups.last().unwrap(), 3);
        // embed [256, 64]: 86 rows per rank (258 padded); norm [64]: 22 (66); head [256, 64]: 86.
        let chunks: Vec<u64> = root.params.iter().map(|p| p.chunk_rows).collect();
        assert_eq!(chunks, [86, 22, 86]);
        assert_eq!(root.params[1].shard_offset, 86 * 64);
        assert_eq!(root.shard_numel, 86 * 64 + 22 + 86 * 64);
        assert_eq!(root.padding(), 3 * root.shard_numel - (2 * 256 * 64 + 64));
        assert_eq!(root.shard_bytes(DType::BF16), root.shard_numel * 2);
        // Rank 2 holds only 84 real rows of the embedding.
        assert_eq!(root.params[0].valid_numel(3, 2), 84 * 64);
    }

    proptest! {
        #[test]
        fn layouts_account_for_every_element(dims in prop::collection::vec((1u64..300, 1u64..5), 1..6), shard in 1u64..17) {
            let mut g = shardplan_ir::Graph::new("p");
            let scope = g.add_scope(g.root(), "layers.0", ModuleKind::Block);
            for (i, (d0, d1)) in dims.iter().enumerate() {
                g.add_param(&format!("w{i}"), shardplan_ir::TensorType::new(DType::F32, [*d0, *d1]), scope).unwrap();
            }
            let groups = group(&g, &WrapPolicy::kinds(&[ModuleKind::Block])).unwrap();
            let l = layout(&g, &groups[0], shard);
            let model: u64 = dims.iter().map(|(a, b)| a * b).sum();
            prop_assert_eq!(l.numel, model);
            // Sharded bytes summed over the shard group = model bytes + padding.
            prop_assert_eq!(l.shard_bytes(DType::F32) * shard, (model + l.padding()) * 4);
            for p in &l.params {
                let valid: u64 = (0..shard).map(|r| p.valid_numel(shard, r)).sum();
                prop_assert_eq!(valid, p.numel());
                prop_assert!(p.shard_numel() >= p.valid_numel(shard, 0));
                // ceil(d0 / shard) * shard - d0 < shard: under one row of padding per rank.
                let padding = p.shard_numel() * shard - p.numel();
                prop_assert!(padding < shard * p.row_elems, "padding {} for dims {:?} over {}", padding, p.dims, shard);
            }
        }
    }
}
