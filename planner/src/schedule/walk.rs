//! The walk of one micro-batch: for each compute step in order, the all-gathers its gates
//! issue, the waits for the groups it reads, its gradient pieces, the step itself, then
//! what its reads and gradients release (resharding, frees, reductions). Each runtime's
//! [`Lowering`] says how a decision is held in buffers.

use super::builder::Builder;
use super::gates::{uses, Gate, Uses};
use super::Lowering;
use crate::group::GroupId;
use crate::plan::{Bufs, Category, EventId, Instr, PlannedGroup, Pool, Stream};
use crate::steps::{Phase, Step, StepId};
use shardplan_frontends::{GradSync, Reshard};
use shardplan_ir::{IdVec, ParamId};

/// What the walk reads of the steps, the same for every micro-batch.
pub(super) struct Walk<'a> {
    steps: &'a [Step],
    groups: &'a [PlannedGroup],
    uses: Uses,
    /// Steps that make gradients of each group: one gradient piece each.
    writers: IdVec<GroupId, usize>,
    /// The gathers issued when each step starts: (group, pass, need), in the order they
    /// are needed.
    gate_at: Vec<Vec<(GroupId, Phase, usize)>>,
    last_forward: Option<usize>,
}

impl<'a> Walk<'a> {
    pub(crate) fn new(steps: &'a [Step], groups: &'a [PlannedGroup], gates: &[Gate]) -> Self {
        let mut writers: IdVec<GroupId, usize> = IdVec::from_elem(0, groups.len());
        for s in steps {
            for &g in &s.grads {
                writers[g] += 1;
            }
        }
        let mut gate_at: Vec<Vec<(GroupId, Phase, usize)>> = vec![Vec::new(); steps.len()];
        for gate in gates {
            gate_at[gate.at].push((gate.group, gate.phase, gate.need));
        }
        for at in &mut gate_at {
            // Gathers issued at one point go out in the order they are needed.
            at.sort_by_key(|&(_, _, need)| need);
        }
        Walk {
            steps,
            groups,
            uses: uses(steps, groups.len()),
            writers,
            gate_at,
            last_forward: steps.iter().rposition(|s| s.phase == Phase::Forward),
        }
    }

    /// Issues micro-batch `micro` of the step.
    pub(crate) fn micro_batch<L: Lowering>(&self, b: &mut Builder, lowering: &mut L, micro: u32) {
        let policy = b.policy;
        let last_micro = micro + 1 == policy.grad_accum as u32;
        let sync = last_micro || policy.grad_sync == GradSync::EveryMicroBatch;
        // All-to-all steps issued and not yet waited for by the compute stream, with their end.
        let mut pending_a2a: Vec<(StepId, EventId)> = Vec::new();
        for (pos, s) in self.steps.iter().enumerate() {
            // Under FSDP2 a group's own all-gather goes out in its pre-hook, which copies out
            // and only then prefetches the next groups; shardplan issues them all before the
            // step.
            let (now, ahead): (Vec<_>, Vec<_>) = self.gate_at[pos]
                .iter()
                .copied()
                .partition(|&(_, _, need)| !L::PREFETCH_AFTER_READS || need == pos);
            issue(b, lowering, &now, micro);
            let reads = self.reads(b, lowering, s, micro);
            issue(b, lowering, &ahead, micro);
            let writes = self.writes(b, s, pos, micro);
            let run = Instr::Compute {
                step: StepId::new(pos),
                micro,
                reads,
                writes,
            };
            run_step(b, s, pos, run, &mut pending_a2a);
            if !self.split_off(pos) {
                b.flush();
            }
            self.release_reads::<L>(b, s, pos, micro);
            if self.last_forward == Some(pos) {
                lowering.after_last_forward(b);
            }
            if L::HOLDS_TO_POST_BACKWARD {
                self.post_backward(b, s, pos);
            }
            if sync {
                for &g in &s.grads {
                    if self.uses.last_grad[g] == Some(pos) {
                        b.reduce(lowering, g, micro, last_micro);
                    }
                }
            }
        }
        // (An all-to-all no compute step touched is waited for at the micro-batch's end.)
        for (_, event) in pending_a2a {
            b.emit(Stream::Compute, Instr::Wait { event });
        }
        lowering.end_of_backward(b);
    }

    /// The buffers step `s` reads: each group's gathered parameters, waited for on the
    /// compute stream at its first read (where the lowering may copy them out).
    fn reads(&self, b: &mut Builder, lowering: &mut impl Lowering, s: &Step, micro: u32) -> Bufs {
        let mut reads = Bufs::with_capacity(s.reads.len());
        for &g in &s.reads {
            let (mut buf, event, waited) = b.gathered[g].expect("every read group is gathered by its need");
            if !waited {
                b.emit(Stream::Compute, Instr::Wait { event });
                buf = lowering.first_read(b, g, buf, micro, s.phase);
                b.gathered[g] = Some((buf, event, true));
            }
            reads.push(buf);
        }
        reads
    }

    /// The gradient pieces step `s` (at `pos`) writes: one per group it makes gradients
    /// of, allocated before it.
    fn writes(&self, b: &mut Builder, s: &Step, pos: usize, micro: u32) -> Bufs {
        let mut writes = Bufs::with_capacity(s.grads.len());
        for &g in &s.grads {
            let existing = b.pieces[g].iter().find(|(at, _)| *at == pos).map(|(_, buf)| *buf);
            let buf = match existing {
                Some(buf) => buf,
                None => self.gradient_piece(b, s, pos, g, micro),
            };
            writes.push(buf);
        }
        writes
    }

    /// A new gradient piece of group `g` for the parameters step `s` (at `pos`) makes
    /// gradients of.
    fn gradient_piece(&self, b: &mut Builder, s: &Step, pos: usize, g: GroupId, micro: u32) -> crate::plan::BufId {
        let policy = b.policy;
        let grp = &self.groups[g.index()];
        let params: Vec<ParamId> = grp
            .group
            .params
            .iter()
            .copied()
            .filter(|p| s.grad_params.binary_search(p).is_ok())
            .collect();
        let numel = grp
            .layout
            .params
            .iter()
            .filter(|l| params.contains(&l.param))
            .map(|l| l.numel())
            .sum();
        let several = self.writers[g] > 1;
        let buf = b.buf(
            || {
                let mut tag = String::new();
                if policy.grad_accum > 1 && policy.grad_sync == GradSync::EveryMicroBatch {
                    tag.push_str(&format!("{micro}"));
                }
                if several {
                    tag.push_str(&format!(".{}", StepId::new(pos)));
                }
                format!("{g}.unsharded_grads{tag}")
            },
            Category::UnshardedGrads,
            g,
            policy.mixed_precision.param,
            numel,
            Pool::Device,
        );
        b.buffer_mut(buf).params = params;
        b.emit(Stream::Compute, Instr::Alloc { buf });
        b.pieces[g].push((pos, buf));
        buf
    }

    /// Whether the step at `pos` was split off before its group's gradients (see `steps`):
    /// it is short, and the deferred tails wait for the step after it.
    fn split_off(&self, pos: usize) -> bool {
        let s = &self.steps[pos];
        s.phase == Phase::Backward
            && s.grads.is_empty()
            && self
                .steps
                .get(pos + 1)
                .is_some_and(|n| n.group == s.group && n.phase == s.phase)
    }

    /// After step `s` (at `pos`): each group it read last is freed (unless the lowering
    /// holds it to its post-backward), and each it read last in forward is resharded.
    fn release_reads<L: Lowering>(&self, b: &mut Builder, s: &Step, pos: usize, micro: u32) {
        for &g in &s.reads {
            let (buf, _, _) = b.gathered[g].expect("read groups are gathered");
            if self.uses.last[g] == Some(pos) {
                let held_to_post_backward =
                    L::HOLDS_TO_POST_BACKWARD && self.uses.last_grad[g].is_some_and(|l| l > pos);
                if !held_to_post_backward {
                    b.emit(Stream::Compute, Instr::Free { buf });
                    b.gathered[g] = None;
                }
            } else if self.uses.last_forward[g] == Some(pos) {
                reshard_after_forward(b, g, buf, micro);
            }
        }
    }

    /// FSDP2's post-backward: a group whose gradients step `s` (at `pos`) finishes, read
    /// for the last time before, is freed now.
    fn post_backward(&self, b: &mut Builder, s: &Step, pos: usize) {
        for &g in &s.grads {
            if self.uses.last_grad[g] == Some(pos) && self.uses.last[g].is_some_and(|l| l < pos) {
                if let Some((buf, _, _)) = b.gathered[g].take() {
                    b.emit(Stream::Compute, Instr::Free { buf });
                }
            }
        }
    }
}

/// Issues the all-gathers of `gathers` once the compute stream reaches this point.
fn issue(b: &mut Builder, lowering: &mut impl Lowering, gathers: &[(GroupId, Phase, usize)], micro: u32) {
    if gathers.is_empty() {
        return;
    }
    let gate = b.record(Stream::Compute);
    for &(g, phase, _) in gathers {
        b.gather(lowering, g, gate, micro, phase);
    }
}

/// Issues step `s` (at `pos`) as `run`: on the compute stream after the all-to-alls whose
/// values it is the first to touch, or an expert-group collective on its own stream.
fn run_step(b: &mut Builder, s: &Step, pos: usize, run: Instr, pending_a2a: &mut Vec<(StepId, EventId)>) {
    if s.stream == Stream::Compute {
        for x in &s.waits_for {
            if let Some(k) = pending_a2a.iter().position(|(p, _)| p == x) {
                let (_, event) = pending_a2a.swap_remove(k);
                b.emit(Stream::Compute, Instr::Wait { event });
            }
        }
        b.emit(Stream::Compute, run);
    } else {
        // After the compute steps that make its input; the compute stream goes on until a
        // step touches its values (`Step::waits_for`).
        let ready = b.record(Stream::Compute);
        b.emit(s.stream, Instr::Wait { event: ready });
        b.emit(s.stream, run);
        let done = b.record(s.stream);
        pending_a2a.push((StepId::new(pos), done));
    }
}

/// Group `g`'s gathered `buf` after its last forward read: kept, freed, or sliced to the
/// post-forward shard its next all-gather reads.
fn reshard_after_forward(b: &mut Builder, g: GroupId, buf: crate::plan::BufId, micro: u32) {
    match b.groups[g.index()].reshard {
        Reshard::Keep => {}
        Reshard::AfterForward => {
            b.emit(Stream::Compute, Instr::Free { buf });
            b.gathered[g] = None;
        }
        Reshard::ToGroupOf(k) => {
            let numel = b.gathered_numel(g) / k;
            let tag = b.suffix(micro, "pf");
            let pf = b.buf(
                || format!("{g}.{tag}_shard"),
                Category::UnshardedParams,
                g,
                b.policy.mixed_precision.param,
                numel,
                Pool::Device,
            );
            b.emit(Stream::Compute, Instr::Alloc { buf: pf });
            b.emit(
                Stream::Compute,
                Instr::PostForwardSlice {
                    src: buf,
                    dst: pf,
                    ranks: k,
                },
            );
            b.emit(Stream::Compute, Instr::Free { buf });
            b.gathered[g] = None;
            b.post_forward[g] = Some(pf);
        }
    }
}
