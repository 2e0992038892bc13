//! The planner: everything FSDP2 decides at run time, decided ahead of time.
//!
//! [`plan`] reads as the pipeline: lower → group → layout → steps → schedule → simulate →
//! estimate → verify, each pass a free function in its own module (`lower`, `group`,
//! `layout`, `steps` through [`PlanCache`], [`schedule`] with [`prefetch`], `simulate`,
//! `verify`). [`plan_forward`] and the auto search's candidates are built from the same
//! passes.
//! Architecture invariant: the crate's public API is what the executor, the CLI and the
//! tests name: the pipeline's entry points, the Plan's types, and the report modules
//! (`print`, `trace`, `auto`, `alternatives`, `rederive`).
//! Architecture invariant: the planner holds no tensors.

pub mod allocator;
pub mod alternatives;
pub mod arena;
pub mod auto;
pub mod bounds;
mod cache;
mod compiled;
mod cost;
mod error;
mod group;
mod hooks;
mod layout;
mod lower;
mod mesh;
pub mod pipeline;
mod plan;
pub mod prefetch;
pub mod print;
pub mod rederive;
pub mod schedule;
mod simulate;
mod steps;
mod stream;
#[cfg(test)]
mod testing;
pub mod trace;
mod verify;

pub(crate) use cache::CachedSteps;
pub use cache::PlanCache;
pub use cost::{forks, OpModel, PARALLEL_MIN_ELEMS};
pub use error::PlanError;
pub use group::{group, GroupId, WrapPolicy};
pub use layout::{chunk_rows, GroupLayout};
pub use mesh::{Coords, Mesh};
pub use plan::{
    Access, Breakdown, BufId, Buffer, ByCategory, Category, Comm, EventId, Float8Report, Fsdp2Hooks, HookModel,
    HookRefusal, Instr, Issued, OptimizerKind, Plan, PlanSource, Policy, Pool, Program, RankSpan, ReduceOp,
    RuntimePrediction, WorkKind, PLAN_VERSION,
};
pub use steps::{steps_and_events, ExecOrder, Phase, Runner, Step, StepId, ValueSlot};
pub use stream::Stream;
pub use verify::{verify, VerifyError};

// The passes name each other's types through the crate root.
pub(crate) use group::FsdpGroup;
pub(crate) use plan::*;
pub(crate) use steps::ActEvents;

use std::sync::Arc;

use shardplan_frontends::{KernelMode, ParallelConfig, Runtime};
use shardplan_ir::JointGraph;

use cache::joined;
use layout::Names;
use lower::{lower, Lowered};
use simulate::Setting;

/// Plans one optimizer step of `joint` (traced at the per-rank micro-batch shape, in the
/// mixed-precision param dtype) for `config`, and verifies the result.
pub fn plan(joint: &JointGraph, config: &ParallelConfig) -> Result<Plan, PlanError> {
    Ok(plan_in(joint, config, &mut PlanCache::default())?.0)
}

/// [`plan`] with `cache` shared with other plans of the same graph; the compute steps come
/// back beside the plan.
pub fn plan_in(
    joint: &JointGraph,
    config: &ParallelConfig,
    cache: &mut PlanCache,
) -> Result<(Plan, Arc<CachedSteps>), PlanError> {
    let g = &joint.graph;
    let mut lowered = lower(g, config)?;
    let (groups, compute) = cache.grouped_steps(joint, config, &lowered, Names::Kept)?;
    lowered.resolve_prefetch(g, &groups, config)?;
    // The plan's own copy of the steps is made before the schedule's trials come and go,
    // so that the memory it takes is not what they leave at the top of the heap.
    let steps = compute.steps.clone();
    let mut placed = prefetch::schedule_plan(&steps, &groups, &lowered, &compute, &config.hardware, Names::Kept)?;
    let done = placed.simulated.take();
    let mut plan = assemble(g, lowered, &config.hardware, groups, steps, placed);
    plan.fsdp2_hooks = Some(hooks::fsdp2_hooks(&plan, None));
    plan.float8 = config.float8.as_ref().map(|f| Float8Report::of(g, f));
    let model_flops = cache.model_flops(joint);
    // simulate → estimate; beside them, each on a thread of its own, the caching
    // allocator's replay, the arena's layout and proof, and the verifier's proof, none of
    // which reads the timing.
    let (sim, estimate, replayed, arena, proof) = std::thread::scope(|scope| {
        let p = &plan;
        let replayed = scope.spawn(|| allocator::replay(&p.programs[0], &p.buffers, &compute.acts, p.policy.allocator));
        let arena = p
            .policy
            .runtime
            .is_shardplan()
            .then(|| scope.spawn(|| arena::report(p)));
        let proof = scope.spawn(|| verify(p, None));
        let s = Setting::of(p, &p.steps, &compute);
        let sim = simulate::simulate(&p.programs[0], &p.buffers, p.events, &s, done);
        let estimate = simulate::estimate_step(&p.programs[0], &p.buffers, &sim, &s, model_flops);
        (sim, estimate, joined(replayed), arena.map(joined), joined(proof))
    });
    let program = &plan.programs[0];
    plan.memory = simulate::with_replay(sim.memory, &replayed, program, &plan.mesh, &plan.hardware);
    plan.timing = sim.timing;
    plan.estimate = estimate;
    // A failure of either proof is a planner bug, reported with the offending instruction.
    plan.memory.arena = arena.transpose().map_err(bug)?;
    proof.map_err(bug)?;
    Ok((plan, compute))
}

/// The forward program of `joint` for `config`, for measuring a loss without training:
/// `micro_batches` micro-batches, each gathering and running the forward steps of [`plan`]
/// (same groups, layouts, prefetch and resharding), with no backward, gradient reduction,
/// norm or optimizer step. Verified like every plan.
pub fn plan_forward(joint: &JointGraph, config: &ParallelConfig, micro_batches: u64) -> Result<Plan, PlanError> {
    let g = &joint.graph;
    let mut lowered = lower(g, config)?.forward_only(micro_batches);
    let (groups, compute) = PlanCache::default().grouped_steps(joint, config, &lowered, Names::Kept)?;
    lowered.resolve_prefetch(g, &groups, config)?;
    let steps = forward_steps(&compute.steps)?;
    let mut placed = prefetch::schedule_plan(&steps, &groups, &lowered, &compute, &config.hardware, Names::Kept)?;
    let done = placed.simulated.take();
    let mut plan = assemble(g, lowered, &config.hardware, groups, steps, placed);
    plan.fsdp2_hooks = Some(hooks::fsdp2_hooks(&plan, None));
    let (sim, estimate) = {
        let s = Setting::of(&plan, &plan.steps, &compute);
        let sim = simulate::simulate(&plan.programs[0], &plan.buffers, plan.events, &s, done);
        let flops = cache::forward_flops(joint);
        let estimate = simulate::estimate_step(&plan.programs[0], &plan.buffers, &sim, &s, flops);
        (sim, estimate)
    };
    (plan.timing, plan.memory, plan.estimate) = (sim.timing, sim.memory, estimate);
    verify(&plan, None).map_err(bug)?;
    Ok(plan)
}

/// The steps of a forward program: the forward steps, which come first in execution
/// order; the rest are backward (and recompute) steps.
fn forward_steps(steps: &[Step]) -> Result<Vec<Step>, PlanError> {
    let n = steps.iter().take_while(|s| s.phase == Phase::Forward).count();
    if steps[n..].iter().any(|s| s.phase == Phase::Forward) {
        return Err(PlanError::Bug("a forward step follows a backward one".into()));
    }
    Ok(steps[..n].to_vec())
}

/// A candidate of the auto search: the passes of [`plan`] without the verifier, the
/// allocator's replay (`memory.active_peak`, `reserved_peak` and `device_total` stay 0;
/// the overhead is set) or the arena, read for its estimate, memory, program and buffers.
/// Its `steps` and its groups' `param_names` are left empty (its steps are the returned
/// [`CachedSteps`]'), which spares copying them for every candidate; the replay can run
/// later with [`simulate::device_memory`] on the steps' activation events.
pub(crate) fn plan_candidate(
    joint: &JointGraph,
    config: &ParallelConfig,
    cache: &mut PlanCache,
) -> Result<(Plan, Arc<CachedSteps>), PlanError> {
    let g = &joint.graph;
    let mut lowered = lower(g, config)?;
    let (groups, compute) = cache.grouped_steps(joint, config, &lowered, Names::Left)?;
    lowered.resolve_prefetch(g, &groups, config)?;
    let mut placed = prefetch::schedule_plan(
        &compute.steps,
        &groups,
        &lowered,
        &compute,
        &config.hardware,
        Names::Left,
    )?;
    let done = placed.simulated.take();
    let mut plan = assemble(g, lowered, &config.hardware, groups, Vec::new(), placed);
    let model_flops = cache.model_flops(joint);
    let (sim, estimate) = {
        let s = Setting::of(&plan, &compute.steps, &compute);
        let sim = simulate::simulate(&plan.programs[0], &plan.buffers, plan.events, &s, done);
        let estimate = simulate::estimate_step(&plan.programs[0], &plan.buffers, &sim, &s, model_flops);
        (sim, estimate)
    };
    (plan.timing, plan.memory, plan.estimate) = (sim.timing, sim.memory, estimate);
    Ok((plan, compute))
}

/// The memory report of [`plan`], without what only a plan to run needs (the verifier,
/// the arena, the steps' and buffers' names): what a second plan of the same spec at
/// another routing split is read for.
pub(crate) fn plan_memory(joint: &JointGraph, config: &ParallelConfig) -> Result<MemoryReport, PlanError> {
    let (plan, compute) = plan_candidate(joint, config, &mut PlanCache::default())?;
    let Plan {
        memory,
        programs,
        buffers,
        mesh,
        hardware,
        policy,
        ..
    } = plan;
    let replayed = simulate::device_memory(
        memory,
        &programs[0],
        &buffers,
        &compute.acts,
        &mesh,
        &hardware,
        policy.allocator,
    );
    Ok(replayed)
}

/// For a spec planned for another runtime (`runtime: fsdp2`), what shardplan's own
/// executor would do with it (its own schedule, one kernel per op), for [`Plan`]'s
/// `shardplan_executor`, so that the two predictions are read side by side; `None` for a
/// spec of shardplan's runtime.
pub fn shardplan_executor_prediction(
    joint: &JointGraph,
    config: &ParallelConfig,
    cache: &mut PlanCache,
) -> Result<Option<RuntimePrediction>, PlanError> {
    if config.runtime.is_shardplan() {
        return Ok(None);
    }
    let mut own = config.clone();
    own.runtime = Runtime::Shardplan;
    own.hardware.kernels = KernelMode::Fused;
    Ok(Some(RuntimePrediction::of(&plan_in(joint, &own, cache)?.0)))
}

/// The plan of `lowered` for `g` with one rank's schedule, before it is simulated:
/// `timing`, `memory`, `estimate` and `fsdp2_hooks` are left to fill, and `source` and
/// `shardplan_executor` to the caller who knows them.
fn assemble(
    g: &shardplan_ir::Graph,
    lowered: Lowered,
    hardware: &shardplan_frontends::HardwareProfile,
    groups: Vec<PlannedGroup>,
    steps: Vec<Step>,
    placed: prefetch::Placed,
) -> Plan {
    let Lowered {
        mesh, policy, experts, ..
    } = lowered;
    let schedule = placed.schedule;
    Plan {
        version: PLAN_VERSION,
        source: None,
        model: g.name().to_string(),
        params: g.params().map(|(_, p)| p.whole_numel()).sum(),
        mesh,
        hardware: hardware.clone(),
        policy,
        groups,
        steps,
        buffers: schedule.buffers,
        events: schedule.events,
        programs: vec![schedule.program],
        ranks: vec![RankSpan {
            first: 0,
            count: mesh.world(),
            program: 0,
        }],
        timing: Timing::default(),
        memory: MemoryReport::default(),
        estimate: Estimate::default(),
        shardplan_executor: None,
        experts,
        prefetch_moves: placed.moves,
        fsdp2_hooks: None,
        float8: None,
    }
}

/// A proof that failed on a plan the planner made: a planner bug.
fn bug(e: VerifyError) -> PlanError {
    PlanError::Bug(e.to_string())
}
