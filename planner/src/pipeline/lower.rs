//! A compute-only schedule lowered as `_PipelineScheduleRuntime` lowers it, pass by pass:
//! FSDP's unshard and reshard of each stage around its compute, one gradient reduction per
//! stage after its last backward, the sends and receives between ranks, and a wait for
//! every send.

use super::action::{Action, Op, OpKind};
use super::compute::RankOrder;
use std::collections::HashSet;

/// How many of a rank's stages FSDP keeps unsharded at once, and how far ahead it
/// all-gathers (torch's `max_active_stages` and `unshard_lookahead: "full"`, both 3).
pub const MAX_ACTIVE_STAGES: usize = 3;

/// A compute-only schedule whose sends cannot all be placed: some rank waits on an input
/// that no rank can make (torch's "Malformed compute schedule").
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the schedule deadlocks: {}", .blocked.iter().map(|(rank, slot, action)| format!("rank {rank} waits at slot {slot} on `{action}`")).collect::<Vec<_>>().join("; "))]
pub struct Deadlock {
    /// Each rank that cannot go on: the rank, the index of its blocked action in the
    /// program this pass was given (FSDP and reduction actions in, idle slots out), and
    /// the action.
    pub blocked: Vec<(u32, usize, Action)>,
}

/// The first distinct stages the actions from `from` on compute, up to `count` (an overlap
/// counts whole even where it passes `count`).
fn next_stages(count: usize, from: &[Option<Action>]) -> Vec<u32> {
    let mut stages = Vec::new();
    for action in from.iter().flatten() {
        for op in action.ops() {
            if !stages.contains(&op.stage) {
                stages.push(op.stage);
            }
        }
        if stages.len() >= count {
            break;
        }
    }
    stages
}

/// FSDP's unshard of the next [`MAX_ACTIVE_STAGES`] stages a rank computes, ahead of their
/// first action, and the reshard of those that leave the window (torch's
/// `_add_unshard_reshard`); idle slots are dropped.
pub fn add_unshard_reshard(compute: &[Option<Action>]) -> Vec<Action> {
    let mut active: Vec<u32> = Vec::new();
    let mut out = Vec::new();
    for (i, slot) in compute.iter().enumerate() {
        let Some(action) = slot else {
            continue;
        };
        let window = next_stages(MAX_ACTIVE_STAGES, &compute[i..]);
        let evict: Vec<u32> = active.iter().copied().filter(|s| !window.contains(s)).collect();
        for stage in evict {
            active.retain(|&s| s != stage);
            out.push(Op::stage_only(stage, OpKind::Reshard).into());
        }
        for &stage in &window {
            if !active.contains(&stage) {
                active.push(stage);
                out.push(Op::stage_only(stage, OpKind::Unshard).into());
            }
        }
        out.push(action.clone());
    }
    out.extend(active.into_iter().map(|s| Op::stage_only(s, OpKind::Reshard).into()));
    out
}

/// A stage's gradient reduction (and its wait) right after the action that completes its
/// `microbatches`-th weight gradient, a B or a W (torch's `_add_reduce_grad`).
pub fn add_reduce_grad(actions: Vec<Action>, microbatches: u32) -> Vec<Action> {
    let mut done: std::collections::HashMap<u32, u32> = Default::default();
    let mut out = Vec::with_capacity(actions.len());
    for action in actions {
        let mut complete = Vec::new();
        for op in action.ops() {
            if matches!(op.kind, OpKind::Backward | OpKind::BackwardWeight) {
                let n = done.entry(op.stage).or_insert(0);
                *n += 1;
                if *n == microbatches {
                    complete.push(op.stage);
                }
            }
        }
        out.push(action);
        for stage in complete {
            out.push(Op::stage_only(stage, OpKind::ReduceGrad).into());
            out.push(Op::stage_only(stage, OpKind::WaitReduceGrad).into());
        }
    }
    out
}

/// Where stages live and how many there are, as the send/receive pass needs them.
pub struct StageMap<'a> {
    pub stages: u32,
    pub rank_of: &'a dyn Fn(u32) -> u32,
}

impl StageMap<'_> {
    /// The send this op makes and the receive it puts on its peer, when its peer stage
    /// lives on another rank: a forward's output goes to the next stage, a backward's
    /// (or input half's) input gradient to the previous one.
    fn comms(&self, op: Op) -> Option<(Op, Op)> {
        let rank = (self.rank_of)(op.stage);
        let (peer, send, recv) = match op.kind {
            OpKind::Forward if op.stage + 1 < self.stages => (op.stage + 1, OpKind::SendF, OpKind::RecvF),
            OpKind::Backward | OpKind::BackwardInput if op.stage > 0 => (op.stage - 1, OpKind::SendB, OpKind::RecvB),
            _ => return None,
        };
        ((self.rank_of)(peer) != rank).then(|| {
            (
                op.with_kind(send),
                Op {
                    stage: peer,
                    ..op.with_kind(recv)
                },
            )
        })
    }

    /// Whether `op`'s input is on its rank: received, or made by the adjacent stage there.
    fn ready(&self, op: Op, made: &HashSet<Op>) -> bool {
        match op.kind {
            OpKind::Forward if op.stage > 0 => {
                made.contains(&op.with_kind(OpKind::RecvF))
                    || made.contains(&Op {
                        stage: op.stage - 1,
                        ..op
                    })
            }
            OpKind::Backward | OpKind::BackwardInput if op.stage + 1 < self.stages => {
                let next = Op {
                    stage: op.stage + 1,
                    ..op
                };
                made.contains(&op.with_kind(OpKind::RecvB))
                    || made.contains(&next.with_kind(OpKind::BackwardInput))
                    || made.contains(&next.with_kind(OpKind::Backward))
            }
            _ => true,
        }
    }
}

/// Sends after the compute that makes their data, and each receive on the peer's program
/// when the send is placed; ranks advance in turn, each to its next action whose input is
/// there (torch's `_add_send_recv`). `programs[rank]` must hold no idle slots.
pub fn add_send_recv(programs: Vec<Vec<Action>>, map: &StageMap) -> Result<Vec<Vec<Action>>, Deadlock> {
    let ranks = programs.len();
    let mut out: Vec<Vec<Action>> = vec![Vec::new(); ranks];
    let mut made: Vec<HashSet<Op>> = vec![HashSet::new(); ranks];
    let mut next = vec![0usize; ranks];
    loop {
        let mut progress = false;
        for rank in 0..ranks {
            let Some(action) = programs[rank].get(next[rank]) else {
                continue;
            };
            if !action.ops().iter().all(|&op| map.ready(op, &made[rank])) {
                continue;
            }
            out[rank].push(action.clone());
            for &op in action.ops() {
                made[rank].insert(op);
                if let Some((send, recv)) = map.comms(op) {
                    out[rank].push(send.into());
                    made[rank].insert(send);
                    let peer = (map.rank_of)(recv.stage) as usize;
                    out[peer].push(recv.into());
                    made[peer].insert(recv);
                }
            }
            next[rank] += 1;
            progress = true;
        }
        let blocked: Vec<(u32, usize, Action)> = (0..ranks)
            .filter_map(|r| programs[r].get(next[r]).map(|a| (r as u32, next[r], a.clone())))
            .collect();
        if blocked.is_empty() {
            return Ok(out);
        }
        if !progress {
            return Err(Deadlock { blocked });
        }
    }
}

/// A wait for every send: a forward send's after the local backward of that stage and
/// micro-batch (which proves the peer received it), every other at the program's end
/// (torch's `_add_wait_send`).
pub fn add_wait_send(programs: Vec<Vec<Action>>) -> Vec<Vec<Action>> {
    programs.into_iter().map(add_wait_send_rank).collect()
}

fn add_wait_send_rank(program: Vec<Action>) -> Vec<Action> {
    let mut pending: Vec<Op> = Vec::new();
    let mut out = Vec::with_capacity(program.len() * 2);
    for action in program {
        let ops = action.ops().to_vec();
        out.push(action);
        if let [op] = ops[..] {
            if matches!(op.kind, OpKind::SendF | OpKind::SendB) {
                pending.push(op);
            }
        }
        for op in ops {
            if matches!(op.kind, OpKind::Backward | OpKind::BackwardInput) {
                let send = op.with_kind(OpKind::SendF);
                if let Some(at) = pending.iter().position(|&p| p == send) {
                    pending.remove(at);
                    out.push(op.with_kind(OpKind::WaitSendF).into());
                }
            }
        }
    }
    out.extend(pending.into_iter().map(|send| {
        let wait = if send.kind == OpKind::SendF {
            OpKind::WaitSendF
        } else {
            OpKind::WaitSendB
        };
        Action::from(send.with_kind(wait))
    }));
    out
}

/// Every pass in torch's order: per rank unshard/reshard then gradient reduction, then
/// sends and receives across ranks, then the sends' waits.
pub fn lower(compute: &[RankOrder], microbatches: u32, map: &StageMap) -> Result<Vec<Vec<Action>>, Deadlock> {
    let fsdp: Vec<Vec<Action>> = compute
        .iter()
        .map(|order| add_reduce_grad(add_unshard_reshard(order), microbatches))
        .collect();
    Ok(add_wait_send(add_send_recv(fsdp, map)?))
}
