//! Where each all-gather is issued: the gathers one micro-batch needs, and the points the
//! prefetch depths and explicit lists issue them at (FSDP2's order; under `runtime:
//! fsdp2`, where its hooks fire).

use crate::group::GroupId;
use crate::plan::{PlannedGroup, Policy};
use crate::steps::{Phase, Step};
use shardplan_frontends::Reshard;
use shardplan_ir::IdVec;

/// Where each group is used within one micro-batch.
pub(super) struct Uses {
    pub last_forward: IdVec<GroupId, Option<usize>>,
    pub last: IdVec<GroupId, Option<usize>>,
    pub last_grad: IdVec<GroupId, Option<usize>>,
}

pub(super) fn uses(steps: &[Step], n_groups: usize) -> Uses {
    let mut u = Uses {
        last_forward: IdVec::from_elem(None, n_groups),
        last: IdVec::from_elem(None, n_groups),
        last_grad: IdVec::from_elem(None, n_groups),
    };
    for (pos, s) in steps.iter().enumerate() {
        for &g in &s.reads {
            if s.phase == Phase::Forward {
                u.last_forward[g] = Some(pos);
            }
            u.last[g] = Some(pos);
        }
        for &g in &s.grads {
            u.last_grad[g] = Some(pos);
        }
    }
    u
}

/// Gathers one micro-batch needs, in order: (step position, group).
fn needs(steps: &[Step], groups: &[PlannedGroup], u: &Uses) -> Vec<(usize, GroupId)> {
    let mut gathered: IdVec<GroupId, bool> = IdVec::from_elem(false, groups.len());
    let mut out = Vec::new();
    for (pos, s) in steps.iter().enumerate() {
        for &g in &s.reads {
            if !gathered[g] {
                gathered[g] = true;
                out.push((pos, g));
            }
        }
        for &g in &s.reads {
            if u.last[g] == Some(pos) || (u.last_forward[g] == Some(pos) && groups[g.index()].reshard != Reshard::Keep)
            {
                gathered[g] = false;
            }
        }
    }
    out
}

/// Where one all-gather is issued: when the compute stream starts step `at`, for the first
/// read of `group` at step `need` (`at <= need`), in pass `phase`. Every micro-batch
/// issues its gathers at the same points.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Gate {
    pub group: GroupId,
    pub phase: Phase,
    pub need: usize,
    pub at: usize,
}

/// The all-gathers of one micro-batch at the points the prefetch depths and explicit lists
/// put them (FSDP2's order): a gather is issued when the step needing the gather `depth`
/// gathers earlier starts, or when its trigger group's first step of the pass starts.
pub(crate) fn gates(steps: &[Step], groups: &[PlannedGroup], policy: &Policy) -> Vec<Gate> {
    let u = uses(steps, groups.len());
    let need = needs(steps, groups, &u);
    let first_backward = steps.iter().position(|s| s.phase != Phase::Forward).unwrap_or(0);
    let (fwd, bwd): (Vec<_>, Vec<_>) = need.iter().partition(|(pos, _)| steps[*pos].phase == Phase::Forward);
    let mut out = Vec::with_capacity(need.len());
    for (list, depth, start, explicit) in [
        (
            &fwd,
            policy.prefetch.forward as usize,
            0,
            &policy.prefetch.explicit_forward,
        ),
        (
            &bwd,
            policy.prefetch.backward as usize,
            first_backward,
            &policy.prefetch.explicit_backward,
        ),
    ] {
        for (i, &(pos, g)) in list.iter().enumerate() {
            // An explicit list: gather when the trigger group's first step of this pass starts.
            let trigger = explicit
                .iter()
                .filter(|(_, targets)| targets.contains(&g))
                .filter_map(|(t, _)| {
                    (start..steps.len())
                        .find(|&k| steps[k].group == *t && (steps[k].phase == Phase::Forward) == (start == 0))
                })
                .min();
            let at = match trigger {
                Some(k) => k.min(pos),
                None if i >= depth => hook_fires(steps, groups, list[i - depth], start),
                None => start.min(pos),
            };
            out.push(Gate {
                group: g,
                phase: steps[pos].phase,
                need: pos,
                at,
            });
        }
    }
    out
}

/// The group whose module's hooks fire where a step of group `k` starts under FSDP2: `k`,
/// or for a unit of routed experts the dense unit of the same module ([`crate::group`]
/// gives both the block's scope): a block's steps run under its experts' group, but the
/// block's pre-forward and pre-backward hooks fire first; the experts' own hooks fire
/// inside the step.
pub fn hook_group(groups: &[PlannedGroup], k: GroupId) -> GroupId {
    let grp = &groups[k.index()].group;
    if !grp.experts {
        return k;
    }
    groups
        .iter()
        .find(|o| !o.group.experts && o.group.scopes == grp.scopes)
        .map_or(k, |o| o.group.id)
}

/// Where the group of `(need, group)` prefetches what follows it, on either runtime: where
/// its module's hooks fire under FSDP2, its module's first step of the pass. A block's
/// backward may open with steps that read none of its parameters (under tensor
/// parallelism, the gradient of its output's reduce-scatter gathered back) or with steps
/// under its routed experts' group ([`hook_group`]: Mixtral's block, or the experts'
/// all-to-all backward); a unit of routed experts, whose module runs inside the block's
/// steps, fires at its first read.
fn hook_fires(steps: &[Step], groups: &[PlannedGroup], (need, g): (usize, GroupId), start: usize) -> usize {
    // A unit of routed experts: its hooks fire where its module runs, at its first read.
    if groups[g.index()].group.experts {
        return need;
    }
    let phase = steps[need].phase == Phase::Forward;
    (start..need)
        .rev()
        .take_while(|&k| hook_group(groups, steps[k].group) == g && (steps[k].phase == Phase::Forward) == phase)
        .last()
        .unwrap_or(need)
}
