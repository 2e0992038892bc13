//! FSDP2's hook model of a program: which module's pre-forward and pre-backward hooks
//! issue which groups' all-gathers ([`Fsdp2Hooks`], what `export fsdp2` writes as
//! `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`), read from where
//! the program issues each all-gather, so that a hand-edited issue order is honoured.
//!
//! Every all-gather waits (through events) for some point of the compute stream; the
//! compute step issued next is where FSDP2 must issue it. A gather at the first step of its
//! own group in a pass is the group's own unshard (its module's pre-forward or pre-backward
//! hook); one at the first step of another group is in that group's explicit prefetch list;
//! anywhere else no hook can issue it, and the program is refused ([`HookRefusal`]), as it
//! is when micro-batches or ranks prefetch differently (FSDP2's lists are set once).

use crate::plan::{Access, Fsdp2Hooks, HookModel, HookRefusal, Instr, Plan, Program, Stream};
use crate::schedule::hook_group;
use crate::steps::Phase;
use crate::{GroupId, StepId};
use std::collections::BTreeMap;

/// The prefetch lists of a program: `(micro, pass, trigger group) -> groups`, a pass
/// being 0 for forward and 1 for backward (recompute included).
type Lists = BTreeMap<(u32, usize, usize), Vec<usize>>;

/// FSDP2's hooks for `plan`'s programs, or why none issue them. `planned`: for an edited
/// program, the programs planned for its source and their event count; each
/// reduce-scatter, all-reduce and copy must wait where the planned program has it, since
/// FSDP2's post-backward hooks issue those and nothing moves them.
pub(crate) fn fsdp2_hooks(plan: &Plan, planned: Option<(&[Program], u32)>) -> HookModel {
    match derive(plan, planned) {
        Ok(h) => HookModel::Hooks(h),
        Err(r) => HookModel::Refused(r),
    }
}

/// [`fsdp2_hooks`] as a result: the reductions checked first, then each program's gathers
/// in issue order, then the micro-batches' and the ranks' lists against each other.
fn derive(plan: &Plan, planned: Option<(&[Program], u32)>) -> Result<Fsdp2Hooks, HookRefusal> {
    if let Some((programs, events)) = planned {
        for (pi, prog) in plan.programs.iter().enumerate() {
            let Some(mine) = programs.get(pi) else { continue };
            if other_gates(prog, plan.events) != other_gates(mine, events) {
                return Err(HookRefusal::Moved { program: pi });
            }
        }
    }
    let hook = hook_groups(plan);
    let hooks = step_hooks(plan, &hook);
    let mut lists: Option<Lists> = None;
    for (pi, prog) in plan.programs.iter().enumerate() {
        let l = program_lists(plan, prog, pi, &hook, &hooks)?;
        // Every micro-batch must prefetch alike (the lists are set once).
        let per_micro: Vec<Lists> = (0..plan.policy.grad_accum as u32)
            .map(|m| {
                l.iter()
                    .filter(|((mi, _, _), _)| *mi == m)
                    .map(|(&(_, p, t), v)| ((0, p, t), v.clone()))
                    .collect()
            })
            .collect();
        if per_micro.windows(2).any(|w| w[0] != w[1]) {
            return Err(HookRefusal::MicroBatches { program: pi });
        }
        let l = per_micro.into_iter().next().unwrap_or_default();
        match &lists {
            None => lists = Some(l),
            Some(prev) if *prev != l => return Err(HookRefusal::Ranks { program: pi }),
            Some(_) => {}
        }
    }
    Ok(hooks_of(plan, &lists.unwrap_or_default(), &hooks))
}

/// The lists as FSDP2 is told them: per pass by trigger group; then, since FSDP2
/// prefetches the next module in backward by itself when a module has no list, every group
/// whose pre-backward fires and that prefetches nothing listing itself (a no-op), so that
/// nothing is gathered earlier than planned.
fn hooks_of(plan: &Plan, lists: &Lists, hooks: &[Vec<usize>]) -> Fsdp2Hooks {
    let ids = |v: &[usize]| v.iter().map(|&k| GroupId::new(k)).collect::<Vec<_>>();
    let mut out = Fsdp2Hooks::default();
    for ((_, p, t), v) in lists {
        let entry = (GroupId::new(*t), ids(v));
        if *p == 0 {
            out.forward.push(entry);
        } else {
            out.backward.push(entry);
        }
    }
    for k in 0..plan.groups.len() {
        if !lists.contains_key(&(0, 1, k))
            && plan
                .steps
                .iter()
                .enumerate()
                .any(|(st, s)| s.phase != Phase::Forward && hooks[st].contains(&k))
        {
            out.backward.push((GroupId::new(k), vec![GroupId::new(k)]));
        }
    }
    out
}

/// Per instruction of `prog`: the number of compute-stream instructions (records and waits
/// aside) issued before the point of the compute stream it waits for, through events and
/// its stream's order (`None`: it waits for none).
fn compute_gates(prog: &Program, events: u32) -> Vec<Option<usize>> {
    let idx = |s: Stream| Stream::ALL.iter().position(|&x| x == s).unwrap_or(0);
    let mut stream_gate: Vec<Option<usize>> = vec![None; Stream::ALL.len()];
    let mut event_gate: Vec<Option<usize>> = vec![None; events as usize];
    let mut computed = 0usize;
    let mut out = Vec::with_capacity(prog.instrs.len());
    for x in &prog.instrs {
        let s = idx(x.stream);
        // Records and waits are the schedule's choices: positions count the work only.
        let work = x.stream == Stream::Compute && !matches!(x.instr, Instr::Record { .. } | Instr::Wait { .. });
        if x.stream == Stream::Compute {
            stream_gate[s] = Some(computed);
        }
        match &x.instr {
            Instr::Record { event } => {
                if let Some(slot) = event_gate.get_mut(event.index()) {
                    *slot = stream_gate[s];
                }
            }
            Instr::Wait { event } => {
                let e = event_gate.get(event.index()).copied().flatten();
                stream_gate[s] = stream_gate[s].max(e);
            }
            _ => {}
        }
        out.push(stream_gate[s]);
        if work {
            computed += 1;
        }
    }
    out
}

/// The non-gather instructions' compute gates per stream, for comparing two programs that
/// issue the same instructions on every stream.
fn other_gates(prog: &Program, events: u32) -> Vec<(Stream, Option<usize>)> {
    let gates = compute_gates(prog, events);
    prog.instrs
        .iter()
        .zip(gates)
        .filter(|(x, _)| {
            x.stream != Stream::Compute
                && !matches!(
                    x.instr,
                    Instr::AllGather { .. } | Instr::Record { .. } | Instr::Wait { .. }
                )
                && x.stream != Stream::AllGather
        })
        .map(|(x, g)| (x.stream, g))
        .collect()
}

/// Per group `k`, the group whose module's hooks fire where a step of `k` starts
/// ([`hook_group`]).
fn hook_groups(plan: &Plan) -> Vec<usize> {
    (0..plan.groups.len())
        .map(|k| hook_group(&plan.groups, GroupId::new(k)).index())
        .collect()
}

/// Per step, the groups whose modules' pre-hooks may fire where it starts: its own group's
/// (the block's for a step under a unit of routed experts, by `hook_groups`) and every
/// group it reads (a unit of routed experts fires where its parameters are first read in
/// the pass).
fn step_hooks(plan: &Plan, hook: &[usize]) -> Vec<Vec<usize>> {
    plan.steps
        .iter()
        .map(|s| {
            let mut out = vec![hook[s.group.index()]];
            for r in &s.reads {
                if !out.contains(&r.index()) {
                    out.push(r.index());
                }
            }
            out
        })
        .collect()
}

/// The pass a step belongs to for FSDP2's hooks: forward, or backward (recompute included).
fn pass(p: Phase) -> usize {
    usize::from(p != Phase::Forward)
}

/// A program's compute-stream work in order, `(issue index, step, micro)`; FSDP2's copy-out
/// and other compute work that is no step has step `usize::MAX`.
type Computes = Vec<(usize, usize, u32)>;

fn computes(prog: &Program) -> Computes {
    prog.instrs
        .iter()
        .enumerate()
        .filter(|(_, x)| x.stream == Stream::Compute && !matches!(x.instr, Instr::Record { .. } | Instr::Wait { .. }))
        .map(|(i, x)| match &x.instr {
            Instr::Compute { step, micro, .. } => (i, step.index(), *micro),
            _ => (i, usize::MAX, u32::MAX),
        })
        .collect()
}

/// The first step of each `(micro, pass, group)`: where FSDP2's pre-hooks fire.
fn first_steps(plan: &Plan, computes: &Computes, hooks: &[Vec<usize>]) -> BTreeMap<(u32, usize, usize), usize> {
    let mut first = BTreeMap::new();
    for &(_, st, micro) in computes {
        if let Some(s) = plan.steps.get(st) {
            for &k in &hooks[st] {
                first.entry((micro, pass(s.phase), k)).or_insert(st);
            }
        }
    }
    first
}

/// The explicit prefetch lists program `pi` implies, by micro-batch; `hook` and `hooks` as
/// [`hook_groups`] and [`step_hooks`] give them.
fn program_lists(
    plan: &Plan,
    prog: &Program,
    pi: usize,
    hook: &[usize],
    hooks: &[Vec<usize>],
) -> Result<Lists, HookRefusal> {
    let gates = compute_gates(prog, plan.events);
    let computes = computes(prog);
    let first = first_steps(plan, &computes, hooks);
    let mut lists: Lists = BTreeMap::new();
    for (i, x) in prog.instrs.iter().enumerate() {
        let Instr::AllGather { group, dst, .. } = &x.instr else {
            continue;
        };
        let g = group.index();
        // The compute-stream instruction that reads the gathered buffer first (a step, or
        // FSDP2's copy-out into per-parameter tensors), the step at or after it, and the
        // compute step issued next after the point the gather waits for.
        let after = computes.partition_point(|&(ci, _, _)| ci <= i);
        let read_at = computes[after..]
            .iter()
            .position(|&(ci, _, _)| {
                prog.instrs[ci]
                    .instr
                    .accesses()
                    .iter()
                    .any(|&(b, a)| b == *dst && a == Access::Read)
            })
            .map(|k| after + k);
        let reader = read_at.and_then(|k| computes[k..].iter().find(|c| c.1 != usize::MAX));
        let Some(&(_, rstep, rmicro)) = reader else {
            return Err(HookRefusal::NeverRead {
                program: pi,
                instr: i,
                group: *group,
            });
        };
        let trigger_pos = gates[i].unwrap_or(0);
        let Some(&(_, tstep, tmicro)) = computes[trigger_pos.min(computes.len())..]
            .iter()
            .find(|c| c.1 != usize::MAX)
        else {
            return Err(HookRefusal::Ungated {
                program: pi,
                instr: i,
                group: *group,
            });
        };
        let (ts, rs) = (&plan.steps[tstep], &plan.steps[rstep]);
        if tmicro != rmicro || pass(ts.phase) != pass(rs.phase) {
            return Err(HookRefusal::OtherPass {
                program: pi,
                instr: i,
                group: *group,
                read: StepId::new(rstep),
                at: StepId::new(tstep),
            });
        }
        let fire: Vec<usize> = hooks[tstep]
            .iter()
            .copied()
            .filter(|&k| first.get(&(tmicro, pass(ts.phase), k)) == Some(&tstep))
            .collect();
        let Some(trigger) = trigger(plan, &fire, hook, g) else {
            return Err(HookRefusal::MidModule {
                program: pi,
                instr: i,
                group: *group,
                at: StepId::new(tstep),
                inside: GroupId::new(hook[ts.group.index()]),
            });
        };
        if trigger != g {
            lists.entry((tmicro, pass(ts.phase), trigger)).or_default().push(g);
        }
    }
    Ok(lists)
}

/// Whose hook issues group `g`'s all-gather at a step where the pre-hooks of `fire` fire:
/// the gathered group's own (its unshard), else the outermost one's prefetch list; `None`
/// where none fires. A unit of routed experts gathered where its block's hook fires is
/// prefetched by the block, whose hook fires first, as the plan issues it at the step's
/// start.
fn trigger(plan: &Plan, fire: &[usize], hook: &[usize], g: usize) -> Option<usize> {
    let companion = hook[g];
    if fire.contains(&g) && !(companion != g && fire.contains(&companion)) {
        return Some(g);
    }
    fire.iter()
        .filter(|&&k| !plan.groups[k].group.experts)
        .chain(fire.iter())
        .next()
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EventId, Issued};

    /// Tiny Llama (two blocks and the root) on four ranks, under `extra` (a batch of 2 x 16
    /// unless it gives one).
    fn tiny_plan(extra: &str) -> Plan {
        let batch = if extra.contains("batch:") {
            ""
        } else {
            "batch: {per_rank: 2, seq_len: 16}\n"
        };
        let yaml = format!(
            "mesh: {{shard: 4}}\ngpus_per_node: 4\nmixed_precision: {{param: f32, reduce: f32}}\n{batch}{extra}"
        );
        let src = shardplan_frontends::Source::from_text("test.yaml", yaml);
        let config = shardplan_frontends::parse_parallel_spec(&src).unwrap().0;
        let model = shardplan_models::preset("tiny-llama").unwrap();
        let g = shardplan_models::trace(&model, config.trace_options()).unwrap();
        let joint = shardplan_ir::differentiate(&g).unwrap();
        crate::plan(&joint, &config).unwrap()
    }

    fn lists(l: &[(usize, &[usize])]) -> Vec<(GroupId, Vec<GroupId>)> {
        l.iter()
            .map(|(t, v)| (GroupId::new(*t), v.iter().map(|&k| GroupId::new(k)).collect()))
            .collect()
    }

    /// `block` (issue indices of one stream's instructions, its first a wait) moved to
    /// right after a new record on the compute stream just before instruction `before`,
    /// and waiting for it.
    fn gate_at(plan: &mut Plan, block: std::ops::RangeInclusive<usize>, before: usize) {
        let event = EventId(plan.events);
        plan.events += 1;
        let prog = &mut plan.programs[0];
        let mut moved: Vec<Issued> = prog.instrs.drain(block.clone()).collect();
        assert!(matches!(moved[0].instr, Instr::Wait { .. }));
        moved[0].instr = Instr::Wait { event };
        let at = before - if before > *block.end() { moved.len() } else { 0 };
        let record = Issued {
            stream: Stream::Compute,
            instr: Instr::Record { event },
        };
        prog.instrs.splice(at..at, std::iter::once(record).chain(moved));
    }

    #[test]
    fn gathers_map_to_the_hooks_that_issue_them() {
        let plan = tiny_plan("");
        // Forward: layers.0's pre-forward gathers layers.1, the root's gathers layers.0.
        // Backward: layers.1's gathers layers.0, the root's layers.1; layers.0 prefetches
        // nothing, so it lists itself.
        let want = Fsdp2Hooks {
            forward: lists(&[(0, &[1]), (2, &[0])]),
            backward: lists(&[(1, &[0]), (2, &[1]), (0, &[0])]),
        };
        assert_eq!(plan.fsdp2_hooks, Some(HookModel::Hooks(want)));
    }

    #[test]
    fn a_gather_inside_a_groups_step_sequence_is_refused() {
        let mut plan = tiny_plan("");
        let root = plan.groups.len() - 1;
        // The root's second backward step (`backward output, norm`) is not where any FSDP2
        // hook fires: layers.0's backward gather (wait, alloc, all-gather, record) waits
        // for a record just before it.
        let (second, at) = plan.programs[0]
            .instrs
            .iter()
            .enumerate()
            .filter_map(|(i, x)| match &x.instr {
                Instr::Compute { step, .. }
                    if plan.steps[step.index()].group.index() == root
                        && plan.steps[step.index()].phase != Phase::Forward =>
                {
                    Some((i, *step))
                }
                _ => None,
            })
            .nth(1)
            .unwrap();
        let ag = plan.programs[0]
            .instrs
            .iter()
            .rposition(|x| matches!(x.instr, Instr::AllGather { group, .. } if group.index() == 0))
            .unwrap();
        assert!(ag > second);
        gate_at(&mut plan, ag - 2..=ag + 1, second);
        let instr = plan.programs[0]
            .instrs
            .iter()
            .rposition(|x| matches!(x.instr, Instr::AllGather { group, .. } if group.index() == 0))
            .unwrap();
        assert_eq!(plan.steps[at.index()].label, "output, norm");
        assert_eq!(
            fsdp2_hooks(&plan, None),
            HookModel::Refused(HookRefusal::MidModule {
                program: 0,
                instr,
                group: GroupId::new(0),
                at,
                inside: GroupId::new(root),
            })
        );
    }

    #[test]
    fn a_reduce_scatter_moved_from_its_planned_point_is_refused() {
        let planned = tiny_plan("");
        let mut plan = planned.clone();
        // The first reduce-scatter (wait, alloc, reduce-scatter) waits for the compute
        // stream two steps later than planned.
        let prog = &plan.programs[0].instrs;
        let rs = prog
            .iter()
            .position(|x| matches!(x.instr, Instr::ReduceScatter { .. }))
            .unwrap();
        let later = (rs..prog.len())
            .filter(|&i| matches!(prog[i].instr, Instr::Compute { .. }))
            .nth(1)
            .unwrap();
        gate_at(&mut plan, rs - 2..=rs, later);
        let reference = Some((planned.programs.as_slice(), planned.events));
        assert_eq!(
            fsdp2_hooks(&plan, reference),
            HookModel::Refused(HookRefusal::Moved { program: 0 })
        );
        // The planned program against itself is what it records.
        assert_eq!(Some(fsdp2_hooks(&planned, reference)), planned.fsdp2_hooks);
    }

    #[test]
    fn micro_batches_prefetching_differently_are_refused() {
        let mut plan = tiny_plan("batch: {per_rank: 2, seq_len: 16, grad_accum: 2}\n");
        // The second micro-batch's forward gather of layers.1 waits for the start of
        // tok_embeddings (the root's hook) instead of layers.0's, as in the first.
        let prog = &plan.programs[0].instrs;
        let gathers: Vec<usize> = prog
            .iter()
            .enumerate()
            .filter(|(_, x)| matches!(x.instr, Instr::AllGather { group, .. } if group.index() == 1))
            .map(|(i, _)| i)
            .collect();
        let fwd2 = gathers[2];
        let embed = (0..fwd2)
            .rev()
            .find(|&i| matches!(&prog[i].instr, Instr::Compute { step, micro: 1, .. } if step.index() == 0))
            .unwrap();
        gate_at(&mut plan, fwd2 - 2..=fwd2 + 1, embed);
        assert_eq!(
            fsdp2_hooks(&plan, None),
            HookModel::Refused(HookRefusal::MicroBatches { program: 0 })
        );
    }
}
