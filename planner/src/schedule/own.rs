//! shardplan's executor's lowering: a group is gathered straight into the buffer its
//! steps read, every all-gather a step's gates issue goes out before the step, and a
//! group's gradients are reduce-scattered into its sharded gradients, the reduction's tail
//! issued one compute step later.

use super::builder::Builder;
use super::Lowering;
use crate::group::GroupId;
use crate::plan::{BufId, Category, Instr, Stream};
use crate::steps::Phase;

pub(crate) struct Own;

impl Lowering for Own {
    const PREFETCH_AFTER_READS: bool = false;
    const HOLDS_TO_POST_BACKWARD: bool = false;

    fn gather_output(&mut self, b: &mut Builder, g: GroupId, tag: &str) -> BufId {
        b.gathered_buf(g, Category::UnshardedParams, || format!("{g}.unsharded.{tag}"))
    }

    fn first_read(&mut self, _b: &mut Builder, _g: GroupId, flat: BufId, _micro: u32, _phase: Phase) -> BufId {
        flat
    }

    fn reduce_scatter(&mut self, b: &mut Builder, g: GroupId, _micro: u32, last_micro: bool, packed: BufId) {
        let acc = b.sharded_grads(g);
        b.reduce_scatter(g, packed, acc);
        // The tail (free, replica all-reduce, host copy) is issued after the next compute
        // step: the allocations that step makes must not wait for this reduction to finish.
        b.deferring = true;
        b.emit(Stream::ReduceScatter, Instr::Free { buf: packed });
        b.end_reduction(g, acc, last_micro);
    }
}
