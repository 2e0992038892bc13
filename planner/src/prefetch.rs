//! Peak-aware issue points (`prefetch: auto`, the default).
//!
//! FSDP2 issues a group's all-gather from a hook a fixed number of groups ahead
//! (`prefetch` depths), whatever the memory is doing at that moment. At the loss backward,
//! for instance, it gathers the last block while the logits' gradient is still alive, so
//! the step's peak holds both. A compile-ahead planner sees the peak coming: starting from
//! the depths' order ([`schedule::gates`]), it moves an all-gather that is in flight or
//! held unread across the peak to the step after the peak, and keeps the move when the
//! simulated peak falls and the simulated step is no longer than the depths' order's. It
//! repeats at the new peak until no gather there can move.
//!
//! Moves only ever issue a gather later, never after the step that needs it, so the loop
//! ends (after at most the number of gathers times the number of steps moves, in practice a
//! few) and the result is never worse than FSDP2's order on either measure. Allocations and
//! frees other than the gathers' own stay where the schedule puts them: at first write and
//! right after the last read, which is already as late and as early as they can be.

use crate::cache::CachedSteps;
use crate::layout::Names;
use crate::lower::Lowered;
use crate::mesh::Mesh;
use crate::plan::{Instr, PlannedGroup, Policy, PrefetchMove};
use crate::schedule::{gates, schedule_gated, Gate, Schedule};
use crate::simulate::{memory, timeline, Simulated};
use crate::steps::{Step, StepId};
use crate::PlanError;
use shardplan_frontends::HardwareProfile;

/// Relative slack on "no longer": moving work between steps re-associates float sums, and a
/// move that changes the step time by one rounding step is not a slower step.
pub const STEP_TOLERANCE: f64 = 1e-9;

/// What one rank's schedule is built and simulated from.
pub(crate) struct Ctx<'a> {
    pub steps: &'a [Step],
    pub groups: &'a [PlannedGroup],
    pub policy: &'a Policy,
    pub mesh: &'a Mesh,
    pub hw: &'a HardwareProfile,
    pub step_s: &'a [f64],
    /// Whether the schedules name their buffers ([`schedule_gated`]).
    pub named: bool,
}

/// One rank's schedule as the schedule pass places it.
pub(crate) struct Placed {
    pub schedule: Schedule,
    /// The all-gathers `prefetch: auto` issued later than the depths put them.
    pub moves: Vec<PrefetchMove>,
    /// The chosen schedule's simulation, where choosing it simulated it.
    pub simulated: Option<Simulated>,
}

/// The schedule pass: the schedule of one rank (every rank runs the same program: shards
/// are padded) over `steps`, its all-gathers issued at the prefetch depths' and explicit
/// lists' [`gates`], then under `prefetch: auto` moved off the peak ([`peak_aware`]).
pub(crate) fn schedule_plan(
    steps: &[Step],
    groups: &[PlannedGroup],
    lowered: &Lowered,
    compute: &CachedSteps,
    hw: &HardwareProfile,
    names: Names,
) -> Result<Placed, PlanError> {
    let policy = &lowered.policy;
    let gates = gates(steps, groups, policy);
    let schedule = schedule_gated(steps, groups, policy, &lowered.mesh, &gates, names.kept());
    // The memory passes add sizes up without checks: bound their total first.
    crate::simulate::rank_bytes_fit(&schedule.buffers, &compute.acts)?;
    if !policy.prefetch.peak_aware {
        return Ok(Placed {
            schedule,
            moves: Vec::new(),
            simulated: None,
        });
    }
    let ctx = Ctx {
        steps,
        groups,
        policy,
        mesh: &lowered.mesh,
        hw,
        step_s: &compute.step_s,
        named: names.kept(),
    };
    let (schedule, moves, simulated) = peak_aware(&ctx, gates, schedule);
    Ok(Placed {
        schedule,
        moves,
        simulated: Some(simulated),
    })
}

/// A schedule with its simulated step time, allocated peak and the instruction at the peak.
struct Scored {
    sched: Schedule,
    step_s: f64,
    peak: u64,
    peak_instr: usize,
    sim: Simulated,
}

fn score(ctx: &Ctx, sched: Schedule) -> Scored {
    let (timing, stall, step_s) = time(ctx, &sched);
    with_memory(ctx, sched, timing, stall, step_s)
}

/// The schedule's timeline, its stalls and its simulated step time.
fn time(ctx: &Ctx, sched: &Schedule) -> (crate::plan::Timing, Vec<f64>, f64) {
    let (timing, stall) = timeline(
        &sched.program,
        &sched.buffers,
        ctx.step_s,
        sched.events,
        ctx.mesh,
        ctx.hw,
        crate::cost::OptimizerTraffic::of(ctx.policy),
    );
    let step_s = timing.end.iter().copied().fold(0.0, f64::max);
    (timing, stall, step_s)
}

/// [`score`] given the schedule's [`time`].
fn with_memory(ctx: &Ctx, sched: Schedule, timing: crate::plan::Timing, stall: Vec<f64>, step_s: f64) -> Scored {
    let mem = memory(&sched.program, &sched.buffers, ctx.steps, &timing);
    Scored {
        step_s,
        peak: mem.peak,
        peak_instr: mem.peak_instr as usize,
        sched,
        sim: Simulated {
            timing,
            stall,
            memory: mem,
        },
    }
}

/// The compute step running at instruction `i`, or the next one to run after it.
fn step_at(sched: &Schedule, i: usize) -> Option<usize> {
    sched.program.instrs.get(i..)?.iter().find_map(|x| match x.instr {
        Instr::Compute { step, .. } => Some(step.index()),
        _ => None,
    })
}

/// `base` (the schedule of `gates`, the depths' order) with its all-gathers moved later
/// where that lowers the peak without lengthening the step, the moves made, and the
/// chosen schedule's simulation.
pub(crate) fn peak_aware(ctx: &Ctx, mut gates: Vec<Gate>, base: Schedule) -> (Schedule, Vec<PrefetchMove>, Simulated) {
    let mut best = score(ctx, base);
    let limit = best.step_s * (1.0 + STEP_TOLERANCE);
    let mut moves = Vec::new();
    // Each accepted move issues one gather at least one step later, and none later than its
    // need: this bounds the loop; the cap only guards against a planner bug.
    let cap = gates.len().saturating_mul(ctx.steps.len()).max(1);
    while moves.len() < cap {
        let Some(at_peak) = step_at(&best.sched, best.peak_instr) else {
            break;
        };
        // Gathers issued at or before the peak's step and first read after it hold their
        // unsharded buffer across the peak. Largest first: they save the most.
        let mut held: Vec<usize> = (0..gates.len())
            .filter(|&i| gates[i].at <= at_peak && at_peak < gates[i].need)
            .collect();
        held.sort_by_key(|&i| std::cmp::Reverse(ctx.groups[gates[i].group.index()].layout.shard_numel));
        let mut moved = false;
        for i in held {
            let mut trial = gates.clone();
            trial[i].at = at_peak + 1;
            let sched = schedule_gated(ctx.steps, ctx.groups, ctx.policy, ctx.mesh, &trial, ctx.named);
            // Most trials that fail lengthen the step: their memory is not simulated.
            let (timing, stall, step_s) = time(ctx, &sched);
            if step_s > limit {
                continue;
            }
            let s = with_memory(ctx, sched, timing, stall, step_s);
            if s.peak < best.peak {
                moves.push(PrefetchMove {
                    group: gates[i].group,
                    need: StepId::new(gates[i].need),
                    from: StepId::new(gates[i].at),
                    to: StepId::new(trial[i].at),
                    peak_before: best.peak,
                    peak_after: s.peak,
                });
                gates = trial;
                best = s;
                moved = true;
                break;
            }
        }
        if !moved {
            break;
        }
    }
    (best.sched, moves, best.sim)
}
