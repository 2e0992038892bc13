//! The planner: everything FSDP2 decides at run time, decided ahead of time.
//!
//! [`plan`] reads as the pipeline: group → layout → steps → schedule → simulate → estimate
//! → verify, each pass a free function in its own module.
//! Architecture invariant: the planner holds no tensors.

pub mod allocator;
pub mod alternatives;
pub mod arena;
pub mod auto;
pub mod bounds;
mod cost;
mod error;
pub mod group;
pub mod layout;
pub mod mesh;
pub mod plan;
pub mod prefetch;
pub mod print;
pub mod rederive;
pub mod schedule;
pub mod simulate;
pub mod steps;
pub mod stream;
pub mod trace;
pub mod verify;

pub use cost::{forks, intra_node, ring_seconds, OpModel, PARALLEL_MIN_ELEMS};
pub use error::PlanError;
pub use group::{group, scope_groups, FsdpGroup, GroupId, WrapPolicy};
pub use layout::{chunk_rows, layout, GroupLayout, ParamLayout};
pub use mesh::{Coords, Mesh};
pub use plan::*;
pub use steps::{ActEvent, ActEvents, ExecOrder, Phase, Step, StepId};
pub use verify::{verify, VerifyError};

use shardplan_frontends::{ParallelConfig, Reshard};
use shardplan_ir::{DType, JointGraph, ParamId};

/// The routing bound of an expert-parallel graph, from its first dispatch.
/// The routing of a graph with token dropping, from its first `moe_drop`: (experts, the
/// assignments each keeps, a rank's assignments per MoE layer).
fn dropping(g: &shardplan_ir::Graph) -> Option<(u64, u64, u64)> {
    g.nodes().find_map(|(_, n)| match n.op {
        shardplan_ir::Op::MoeDrop { experts, capacity } => {
            let a = n.ty.shape.dims().iter().product::<u64>();
            Some((experts, capacity, a))
        }
        _ => None,
    })
}

/// The routing bound of an expert-parallel graph, from its first dispatch, and its token
/// dropping.
fn expert_routing(g: &shardplan_ir::Graph, config: &ParallelConfig) -> Option<ExpertRouting> {
    let drop = dropping(g);
    let capacity_factor = drop.and(config.moe.capacity_factor);
    let per_expert = drop.map(|(_, c, _)| c);
    if g.expert_degree() <= 1 {
        let (experts, _, assignments) = drop?;
        return Some(ExpertRouting {
            experts,
            per_rank: experts,
            capacity: config.moe.capacity,
            rows: assignments,
            even_rows: assignments,
            even: None,
            capacity_factor,
            per_expert,
        });
    }
    g.nodes().find_map(|(_, n)| match n.op {
        shardplan_ir::Op::MoeDispatch { degree, experts, rows } => Some(ExpertRouting {
            experts,
            per_rank: experts / degree.max(1),
            capacity: config.moe.capacity,
            rows,
            even_rows: g.node(n.inputs[0]).ty.shape.dims().first().copied().unwrap_or(0),
            even: None,
            capacity_factor,
            per_expert,
        }),
        _ => None,
    })
}

/// Plans one optimizer step of `joint` (traced at the per-rank micro-batch shape, in the
/// mixed-precision param dtype) for `config`, and verifies the result.
pub fn plan(joint: &JointGraph, config: &ParallelConfig) -> Result<Plan, PlanError> {
    plan_with(joint, config, &mut PlanCache::default(), true)
}

/// The forward program of `joint` for `config`, for measuring a loss without training:
/// `micro_batches` micro-batches, each gathering and running the forward steps of [`plan`]
/// (same groups, layouts, prefetch and resharding), with no backward, gradient reduction,
/// norm or optimizer step. Verified like every plan.
pub fn plan_forward(joint: &JointGraph, config: &ParallelConfig, micro_batches: u64) -> Result<Plan, PlanError> {
    Ok(passes(
        joint,
        config,
        &mut PlanCache::default(),
        true,
        false,
        Some(micro_batches.max(1)),
        false,
    )?
    .0)
}

/// What the compute steps of one graph depend on: the groups' parameters, the
/// checkpointing policy, the hardware, the compute dtype and the runtime.
#[derive(Clone)]
struct StepsKey {
    groups: Vec<Vec<ParamId>>,
    checkpointing: shardplan_frontends::ActivationCheckpointing,
    hardware: shardplan_frontends::HardwareProfile,
    param: shardplan_ir::DType,
    runtime: shardplan_frontends::Runtime,
}

impl StepsKey {
    /// Whether `fsdp` under `config` has this key (compared in place: a search looks it up
    /// for every candidate).
    fn is(&self, fsdp: &[FsdpGroup], config: &ParallelConfig) -> bool {
        self.checkpointing == config.activation_checkpointing
            && self.param == config.mixed_precision.param
            && self.runtime == config.runtime
            && self.groups.len() == fsdp.len()
            && self.groups.iter().zip(fsdp).all(|(a, f)| *a == f.params)
            && self.hardware == config.hardware
    }
}

/// The steps of one key, their activation events and durations.
pub(crate) struct CachedSteps {
    pub(crate) steps: Vec<Step>,
    pub(crate) acts: ActEvents,
    pub(crate) step_s: Vec<f64>,
    step_parts: Vec<crate::plan::Breakdown>,
}

/// What does not change between plans of one graph that differ only in mesh, resharding,
/// prefetch or offload: the groups (by wrap policy), the compute steps, their activation
/// events and their durations (by groups and checkpointing policy), and the model FLOPs.
/// The auto search plans hundreds of variants with one.
#[derive(Clone, Default)]
pub struct PlanCache {
    /// By the wrap policy, as printed (every field [`group`] reads besides the graph).
    groups: std::collections::HashMap<String, std::sync::Arc<Vec<FsdpGroup>>>,
    /// A few keys per search (groupings times checkpointing policies), looked up by `==`.
    steps: Vec<(StepsKey, std::sync::Arc<CachedSteps>)>,
    /// The execution order by checkpointing policy and kernels (it does not depend on the
    /// groups).
    exec: Vec<(
        shardplan_frontends::ActivationCheckpointing,
        steps::Kernels,
        std::sync::Arc<steps::ExecOrder>,
    )>,
    /// Every node's times, by hardware and compute dtype (one entry per search).
    node_times: Vec<(
        shardplan_frontends::HardwareProfile,
        shardplan_ir::DType,
        std::sync::Arc<cost::NodeTimes>,
    )>,
    forward_flops: Option<f64>,
}

/// Work for [`PlanCache::steps_for`] begun on threads of a scope ([`PlanCache::begin`]).
pub(crate) struct Begun<'scope> {
    exec: Option<std::thread::ScopedJoinHandle<'scope, steps::ExecOrder>>,
    times: Option<std::thread::ScopedJoinHandle<'scope, (cost::NodeTimes, Option<f64>)>>,
}

/// The forward and backward FLOPs of one micro-batch: every forward node's.
fn model_flops(joint: &JointGraph) -> f64 {
    (0..joint.forward_len)
        .map(|i| {
            let c = joint.graph.node_cost(shardplan_ir::NodeId(i as u32));
            c.fwd_flops as f64 + c.bwd_flops as f64
        })
        .sum()
}

impl PlanCache {
    /// [`group`] of `g` under `policy`: made once per policy (a failure is not kept).
    pub(crate) fn groups_for(
        &mut self,
        g: &shardplan_ir::Graph,
        policy: &WrapPolicy,
    ) -> Result<std::sync::Arc<Vec<FsdpGroup>>, PlanError> {
        let key = format!("{policy:?}");
        if let Some(x) = self.groups.get(&key) {
            return Ok(x.clone());
        }
        let x = std::sync::Arc::new(group(g, policy)?);
        self.groups.insert(key, x.clone());
        Ok(x)
    }

    /// The execution order of `joint` under `config`'s checkpointing and kernels: made once
    /// per policy.
    pub(crate) fn exec_for(&mut self, joint: &JointGraph, config: &ParallelConfig) -> std::sync::Arc<steps::ExecOrder> {
        let kernels = steps::Kernels::of(config);
        let ac = config.activation_checkpointing;
        match self.cached_exec(config) {
            Some(e) => e,
            None => {
                let e = std::sync::Arc::new(steps::ExecOrder::for_kernels(joint, ac, kernels));
                self.exec.push((ac, kernels, e.clone()));
                e
            }
        }
    }

    /// The execution order kept for `config`'s checkpointing and kernels.
    fn cached_exec(&self, config: &ParallelConfig) -> Option<std::sync::Arc<steps::ExecOrder>> {
        let kernels = steps::Kernels::of(config);
        let ac = config.activation_checkpointing;
        self.exec
            .iter()
            .find(|(a, k, _)| *a == ac && *k == kernels)
            .map(|(_, _, e)| e.clone())
    }

    /// The node times kept for `config`'s hardware and compute dtype.
    fn cached_times(&self, config: &ParallelConfig) -> Option<std::sync::Arc<cost::NodeTimes>> {
        let param = config.mixed_precision.param;
        self.node_times
            .iter()
            .find(|(h, d, _)| *h == config.hardware && *d == param)
            .map(|(_, _, t)| t.clone())
    }

    /// Begins on threads of `scope` what [`PlanCache::steps_for`] needs besides the groups
    /// and the cache lacks: the execution order, and every node's time with the model
    /// FLOPs (they depend on the graph, the checkpointing, the kernels and the hardware, not
    /// on the groups), so that they are made while the caller makes the groups.
    pub(crate) fn begin<'scope, 'env>(
        &self,
        scope: &'scope std::thread::Scope<'scope, 'env>,
        joint: &'env JointGraph,
        config: &'env ParallelConfig,
    ) -> Begun<'scope> {
        let kernels = steps::Kernels::of(config);
        let ac = config.activation_checkpointing;
        let param = config.mixed_precision.param;
        let exec = self
            .cached_exec(config)
            .is_none()
            .then(|| scope.spawn(move || steps::ExecOrder::for_kernels(joint, ac, kernels)));
        let flops = self.forward_flops.is_none();
        let times = self.cached_times(config).is_none().then(|| {
            scope.spawn(move || {
                let times = cost::NodeTimes::new(&joint.graph, &config.hardware, param);
                (times, flops.then(|| model_flops(joint)))
            })
        });
        Begun { exec, times }
    }

    /// Keeps node times (and the model FLOPs) made by [`PlanCache::begin`]'s thread.
    fn keep_times(
        &mut self,
        config: &ParallelConfig,
        (times, flops): (cost::NodeTimes, Option<f64>),
    ) -> std::sync::Arc<cost::NodeTimes> {
        let times = std::sync::Arc::new(times);
        self.node_times
            .push((config.hardware.clone(), config.mixed_precision.param, times.clone()));
        if self.forward_flops.is_none() {
            self.forward_flops = flops;
        }
        times
    }

    /// The compute steps of `fsdp` under `config`'s checkpointing, with their activation
    /// events and durations: made once per groups, checkpointing and hardware.
    pub(crate) fn steps_for(
        &mut self,
        joint: &JointGraph,
        config: &ParallelConfig,
        fsdp: &[FsdpGroup],
    ) -> std::sync::Arc<CachedSteps> {
        std::thread::scope(|scope| {
            let begun = self.begin(scope, joint, config);
            self.steps_begun(joint, config, fsdp, begun)
        })
    }

    /// [`PlanCache::steps_for`] with what [`PlanCache::begin`] began: the execution order
    /// is awaited before the steps are cut, the node times after.
    pub(crate) fn steps_begun(
        &mut self,
        joint: &JointGraph,
        config: &ParallelConfig,
        fsdp: &[FsdpGroup],
        begun: Begun,
    ) -> std::sync::Arc<CachedSteps> {
        let param = config.mixed_precision.param;
        let kernels = steps::Kernels::of(config);
        if let Some(h) = begun.exec {
            let exec = std::sync::Arc::new(joined(h));
            self.exec.push((config.activation_checkpointing, kernels, exec));
        }
        if let Some((_, x)) = self.steps.iter().find(|(k, _)| k.is(fsdp, config)) {
            let x = x.clone();
            if let Some(h) = begun.times {
                self.keep_times(config, joined(h));
            }
            return x;
        }
        let key = StepsKey {
            groups: fsdp.iter().map(|f| f.params.clone()).collect(),
            checkpointing: config.activation_checkpointing,
            hardware: config.hardware.clone(),
            param,
            runtime: config.runtime,
        };
        let exec = self.exec_for(joint, config);
        let (mut steps, acts) = steps::steps_and_events_in(joint, fsdp, &exec, kernels);
        let times = match (begun.times, self.cached_times(config)) {
            (Some(h), _) => self.keep_times(config, joined(h)),
            (None, Some(t)) => t,
            (None, None) => self.keep_times(
                config,
                (
                    cost::NodeTimes::new(&joint.graph, &config.hardware, param),
                    Some(model_flops(joint)),
                ),
            ),
        };
        let unit_host_s = if config.runtime.is_shardplan() {
            0.0
        } else {
            config.hardware.fsdp2_unit_host_us * 1e-6
        };
        let (step_s, step_parts) = cost::step_costs(&times, &steps, unit_host_s);
        cost::annotate_tensor_ops(&joint.graph, &times, &mut steps);
        let x = std::sync::Arc::new(CachedSteps {
            steps,
            acts,
            step_s,
            step_parts,
        });
        self.steps.push((key, x.clone()));
        x
    }
}

/// The wrap policy `config` groups by.
pub(crate) fn wrap_policy(config: &ParallelConfig) -> WrapPolicy {
    WrapPolicy {
        kinds: config.wrap.clone(),
        modules: config.wrap_modules.clone(),
        bucket_bytes: config.bucket_mib.map(|m| m.saturating_mul(1 << 20)),
        bucket_dtype: config.mixed_precision.param,
    }
}

/// [`plan`] with a cache; `verify_plan: false` skips the verifier (the auto search verifies
/// its winner only).
pub fn plan_with(
    joint: &JointGraph,
    config: &ParallelConfig,
    cache: &mut PlanCache,
    verify_plan: bool,
) -> Result<Plan, PlanError> {
    Ok(plan_passes(joint, config, cache, verify_plan, true)?.0)
}

/// The passes of [`plan_with`]. `replay: false` leaves the caching-allocator replay out
/// (`memory.active_peak`, `reserved_peak` and `device_total` stay 0; the overhead is set),
/// for a caller that first checks a cheaper bound: the steps' activation events come back
/// to run it later with [`simulate::device_memory`].
pub(crate) fn plan_passes(
    joint: &JointGraph,
    config: &ParallelConfig,
    cache: &mut PlanCache,
    verify_plan: bool,
    replay: bool,
) -> Result<(Plan, std::sync::Arc<CachedSteps>), PlanError> {
    passes(joint, config, cache, verify_plan, replay, None, false)
}

/// The memory report of [`plan`], without what only a plan to run needs (the verifier,
/// the arena, the other runtime's prediction, the steps' and buffers' names): what a
/// second plan of the same spec at another routing split is read for.
pub fn plan_memory(joint: &JointGraph, config: &ParallelConfig) -> Result<MemoryReport, PlanError> {
    Ok(
        passes(joint, config, &mut PlanCache::default(), false, true, None, true)?
            .0
            .memory,
    )
}

/// [`plan_passes`] without verifying or replaying, for the auto search, which reads of a
/// candidate's plan its estimate, memory, program and buffers: the plan's `steps` and its
/// groups' `param_names` are left empty (its steps are the returned [`CachedSteps`]'),
/// which spares copying them for every candidate.
pub(crate) fn plan_candidate(
    joint: &JointGraph,
    config: &ParallelConfig,
    cache: &mut PlanCache,
) -> Result<(Plan, std::sync::Arc<CachedSteps>), PlanError> {
    passes(joint, config, cache, false, false, None, true)
}

/// The pipeline; `forward_only: Some(m)` plans `m` forward-only micro-batches
/// ([`plan_forward`]); `lean` leaves the plan's steps, parameter names and buffer names out
/// ([`plan_candidate`]).
fn passes(
    joint: &JointGraph,
    config: &ParallelConfig,
    cache: &mut PlanCache,
    verify_plan: bool,
    replay: bool,
    forward_only: Option<u64>,
    lean: bool,
) -> Result<(Plan, std::sync::Arc<CachedSteps>), PlanError> {
    let g = &joint.graph;
    let mesh = Mesh::with_tensor(
        config.mesh.replicate,
        config.mesh.shard,
        config.mesh.tensor,
        config.mesh.world(),
        config.gpus_per_node,
    )?
    .with_expert(config.mesh.expert)?;
    let reshard = match config.reshard_after_forward {
        Reshard::AfterForward => GroupReshard::Free,
        Reshard::Keep => GroupReshard::Keep,
        Reshard::ToGroupOf(n) if n == 0 || !mesh.shard().is_multiple_of(n) => {
            return Err(PlanError::ReshardDoesNotDivide { n, shard: mesh.shard() })
        }
        // Keeping a 1/shard slice is the sharded state itself; keeping 1/1 is `false`.
        Reshard::ToGroupOf(n) if n == mesh.shard() => GroupReshard::Free,
        Reshard::ToGroupOf(1) => GroupReshard::Keep,
        Reshard::ToGroupOf(n) => GroupReshard::ToGroupOf(n),
    };
    let policy = Policy {
        wrap: config.wrap.iter().map(|k| k.name().to_string()).collect(),
        wrap_modules: config.wrap_modules.clone(),
        bucket_mib: config.bucket_mib,
        reshard_after_forward: reshard,
        prefetch: PrefetchDepth {
            forward: config.prefetch.forward,
            backward: config.prefetch.backward,
            explicit_forward: Vec::new(),
            explicit_backward: Vec::new(),
            // FSDP2 issues its gathers from its hooks; only shardplan's executor runs a
            // program whose gathers the planner places freely.
            peak_aware: config.prefetch.peak_aware && config.runtime.is_shardplan(),
        },
        mixed_precision: config.mixed_precision.into(),
        offload: config.offload,
        activation_checkpointing: config.activation_checkpointing.into(),
        batch_per_rank: config.batch.per_rank,
        seq_len: g
            .inputs()
            .first()
            .and_then(|&i| g.node(i).ty.shape.dims().get(1).copied())
            .unwrap_or(1),
        grad_accum: config.batch.grad_accum,
        grad_sync: config.batch.grad_sync,
        optimizer_state_per_param: config.optimizer.state_per_param(),
        optimizer: match config.optimizer {
            shardplan_frontends::Optimizer::AdamW { .. } => "adamw".into(),
            shardplan_frontends::Optimizer::Sgd { .. } => "sgd".into(),
        },
        // Only PyTorch's run has a choice of AdamW; shardplan's executor has its own.
        adamw_implementation: if config.runtime.is_shardplan() {
            Default::default()
        } else {
            config.adamw_implementation
        },
        grad_clip: config.grad_clip,
        tensor_parallel: if mesh.tensor() > 1 {
            config.tensor_parallel
        } else {
            Default::default()
        },
        runtime: config.runtime,
        allocator: config.allocator,
    };
    let mut policy = policy;
    if let Some(m) = forward_only {
        policy.grad_accum = m;
        policy.grad_clip = None;
    }

    // 1. Groups and their layouts, and 2. the compute steps with activation memory; while
    // the groups are made, the execution order and every node's time, which do not depend
    // on them, are made on threads of their own where the cache lacks them.
    let (groups, fsdp, cached) = std::thread::scope(|scope| {
        let begun = cache.begin(scope, joint, config);
        let groups = planned_groups(g, cache, config, &mesh, reshard, lean)?;
        let fsdp: Vec<FsdpGroup> = groups.iter().map(|p| p.group.clone()).collect();
        let cached = cache.steps_begun(joint, config, &fsdp, begun);
        Ok::<_, PlanError>((groups, fsdp, cached))
    })?;
    policy.prefetch.explicit_forward = explicit_prefetch(g, &fsdp, &config.prefetch.explicit_forward)?;
    policy.prefetch.explicit_backward = explicit_prefetch(g, &fsdp, &config.prefetch.explicit_backward)?;
    let mut own_steps = if lean { Vec::new() } else { cached.steps.clone() };
    if forward_only.is_some() {
        // The forward steps come first in execution order; the rest are backward (and
        // recompute) steps, which a forward program leaves out.
        let n = own_steps.iter().take_while(|s| s.phase == Phase::Forward).count();
        if own_steps[n..].iter().any(|s| s.phase == Phase::Forward) {
            return Err(PlanError::Bug("a forward step follows a backward one".into()));
        }
        own_steps.truncate(n);
    }
    let steps: &[Step] = if lean { &cached.steps } else { &own_steps };

    // 3. The schedule of one rank (every rank runs the same program: shards are padded),
    // its all-gathers placed for the peak under `prefetch: auto`.
    let gates = schedule::gates(steps, &groups, &policy);
    let sched = schedule::schedule_gated(steps, &groups, &policy, &mesh, &gates, !lean);

    // The memory passes add sizes up without checks: bound their total first.
    rank_bytes_fit(&sched.buffers, &cached.acts)?;
    let (sched, prefetch_moves, simulated) = if policy.prefetch.peak_aware {
        let ctx = prefetch::Ctx {
            steps,
            groups: &groups,
            policy: &policy,
            mesh: &mesh,
            hw: &config.hardware,
            step_s: &cached.step_s,
            named: !lean,
        };
        let (sched, moves, sim) = prefetch::peak_aware(&ctx, gates, sched);
        (sched, moves, Some(sim))
    } else {
        (sched, Vec::new(), None)
    };

    // 4. Timeline, memory, estimate.
    let forward_flops: f64 = if forward_only.is_some() {
        (0..joint.forward_len)
            .map(|i| g.node_cost(shardplan_ir::NodeId(i as u32)).fwd_flops as f64)
            .sum::<f64>()
    } else {
        *cache.forward_flops.get_or_insert_with(|| model_flops(joint))
    };
    let mut plan = Plan {
        version: PLAN_VERSION,
        source: None,
        model: g.name().to_string(),
        params: g.params().map(|(_, p)| p.whole_numel()).sum(),
        mesh,
        hardware: config.hardware.clone(),
        policy,
        groups,
        steps: own_steps,
        buffers: sched.buffers,
        events: sched.events,
        programs: vec![sched.program],
        ranks: vec![RankSpan {
            first: 0,
            count: mesh.world(),
            program: 0,
        }],
        // Filled in below, beside the arena and the proof, which do not read them.
        timing: Timing::default(),
        memory: MemoryReport::default(),
        estimate: Estimate::default(),
        shardplan_executor: None,
        experts: expert_routing(g, config),
        prefetch_moves,
    };
    // A lean plan is read for its figures only: no arena, no second runtime's prediction.
    let arena_wanted = config.runtime.is_shardplan() && forward_only.is_none() && replay && !lean;
    let steps: &[Step] = if lean { &cached.steps } else { &plan.steps };
    // 4. Timeline, memory, estimate; beside them, each on a thread of its own, the caching
    // allocator's replay of the training step's activation events, the arena's layout and
    // proof (4b) and the verifier's proof (5), none of which reads the timing.
    let device_replay = replay && forward_only.is_none();
    let ((timing, memory, estimate), arena, proof) = std::thread::scope(|scope| {
        let shared = &plan;
        let acts = &cached.acts;
        let replayed = device_replay.then(|| {
            scope.spawn(move || allocator::replay(&shared.programs[0], &shared.buffers, acts, shared.policy.allocator))
        });
        let arena = arena_wanted.then(|| scope.spawn(move || arena::report(shared)));
        let proof = verify_plan.then(|| scope.spawn(move || verify(shared, None)));
        let (timing, mut memory, estimate) = simulate_program(
            &shared.programs[0],
            &shared.buffers,
            shared.events,
            steps,
            &cached,
            &mesh,
            config,
            &shared.policy,
            forward_flops,
            false,
            simulated,
        );
        if let Some(r) = replayed {
            memory = simulate::with_replay(memory, &joined(r), &shared.programs[0], &mesh, &config.hardware);
        }
        (
            (timing, memory, estimate),
            arena.map(joined),
            proof.map_or(Ok(()), joined),
        )
    });
    plan.timing = timing;
    plan.memory = memory;
    plan.estimate = estimate;
    if let Some(arena) = arena {
        plan.memory.arena = Some(arena.map_err(|e| PlanError::Bug(e.to_string()))?);
    }
    if !config.runtime.is_shardplan() && forward_only.is_none() && replay && !lean {
        // The same spec as shardplan's executor runs it (its own schedule, one kernel per
        // op), so the two predictions can be read side by side.
        let mut own = config.clone();
        own.runtime = shardplan_frontends::Runtime::Shardplan;
        own.hardware.kernels = shardplan_frontends::KernelMode::Fused;
        let (p, _) = passes(joint, &own, cache, verify_plan, true, None, false)?;
        plan.shardplan_executor = Some(RuntimePrediction::of(&p));
    }
    // 5. Proof. A failure here is a planner bug, reported with the offending instruction.
    proof.map_err(|e| PlanError::Bug(e.to_string()))?;
    Ok((plan, cached))
}

/// The groups of `config`'s wrap policy with their layouts on `mesh` and their resharding
/// (`lean`: without their parameters' names).
fn planned_groups(
    g: &shardplan_ir::Graph,
    cache: &mut PlanCache,
    config: &ParallelConfig,
    mesh: &Mesh,
    reshard: GroupReshard,
    lean: bool,
) -> Result<Vec<PlannedGroup>, PlanError> {
    Ok(cache
        .groups_for(g, &wrap_policy(config))?
        .iter()
        .cloned()
        .map(|grp| {
            let layout = layout(g, &grp, mesh.shard_of(&grp));
            let reshard = match reshard {
                _ if grp.is_root() => GroupReshard::Keep,
                // A slice of the shard group is not a slice of the expert-shard group: the
                // routed experts are freed after forward instead.
                GroupReshard::ToGroupOf(_) if grp.experts => GroupReshard::Free,
                r => r,
            };
            PlannedGroup {
                param_names: if lean {
                    Vec::new()
                } else {
                    grp.params.iter().map(|&p| g.param(p).name.clone()).collect()
                },
                group: grp,
                layout,
                reshard,
            }
        })
        .collect())
}

/// What a scoped thread returned; its panic goes on in the caller's thread.
fn joined<T>(h: std::thread::ScopedJoinHandle<'_, T>) -> T {
    h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// Most bytes one rank's buffers and activations may add up to (1 EiB, beyond any device):
/// the memory simulation and the allocator model (which replays up to three steps) add
/// sizes and addresses in u64 and stay far from overflow below it.
pub const MAX_RANK_BYTES: u64 = 1 << 60;

/// Refuses a plan whose buffers and activations, summed, exceed [`MAX_RANK_BYTES`].
fn rank_bytes_fit(buffers: &[Buffer], acts: &ActEvents) -> Result<(), PlanError> {
    let total = buffers
        .iter()
        .map(|b| b.numel.checked_mul(b.dtype.size_bytes()))
        .chain(acts.events.iter().map(|e| Some(e.bytes)))
        .try_fold(0u64, |sum, x| sum.checked_add(x?));
    match total {
        Some(t) if t <= MAX_RANK_BYTES => Ok(()),
        _ => Err(PlanError::Graph(format!(
            "one rank's buffers and activations add up to more than {MAX_RANK_BYTES} bytes (1 EiB), the most shardplan plans for"
        ))),
    }
}

/// Pass 4 of [`plan`] on one program: its simulated timeline, memory and estimate.
/// `forward_flops` is the forward+backward model FLOPs of one micro-batch. The plan
/// re-derivation runs it on an edited program too, so those fields follow the file's schedule.
#[allow(clippy::too_many_arguments)]
pub(crate) fn simulate_program(
    program: &Program,
    buffers: &[Buffer],
    events: u32,
    steps: &[Step],
    cached: &CachedSteps,
    mesh: &Mesh,
    config: &ParallelConfig,
    policy: &Policy,
    forward_flops: f64,
    replay: bool,
    simulated: Option<prefetch::Simulated>,
) -> (Timing, MemoryReport, Estimate) {
    // The timeline and memory of this program, unless the caller simulated it already.
    let (timing, stall, mut memory) = match simulated {
        Some(s) => (s.timing, s.stall, s.memory),
        None => {
            let (timing, stall) = simulate::timeline(
                program,
                buffers,
                &cached.step_s,
                events,
                mesh,
                &config.hardware,
                crate::cost::OptimizerTraffic::of(policy),
            );
            let memory = simulate::memory(program, buffers, steps, &timing);
            (timing, stall, memory)
        }
    };
    if replay {
        memory = simulate::device_memory(
            memory,
            program,
            buffers,
            &cached.acts,
            mesh,
            &config.hardware,
            policy.allocator,
        );
    } else {
        memory.overhead = simulate::overhead(program, mesh, &config.hardware);
    }
    let peak_flops = if matches!(policy.mixed_precision.param, DType::F32 | DType::F64) {
        config.hardware.f32_tflops
    } else {
        config.hardware.bf16_tflops
    } * 1e12;
    let tokens = (mesh.data_parallel() * policy.batch_per_rank * policy.seq_len * policy.grad_accum) as f64;
    let estimate = simulate::estimate(
        program,
        buffers,
        &timing,
        &stall,
        &simulate::Costed {
            step_parts: &cached.step_parts,
            mesh,
            hw: &config.hardware,
        },
        forward_flops * policy.grad_accum as f64,
        peak_flops,
        tokens,
    );
    (timing, memory, estimate)
}

/// Resolves `{module: [modules]}` explicit prefetch lists to groups; every name must be a
/// wrapped module (the unit of a group).
fn explicit_prefetch(
    g: &shardplan_ir::Graph,
    groups: &[FsdpGroup],
    lists: &std::collections::BTreeMap<String, Vec<String>>,
) -> Result<Vec<(GroupId, Vec<GroupId>)>, PlanError> {
    let find = |m: &str| -> Result<GroupId, PlanError> {
        groups
            .iter()
            .find(|grp| grp.scopes.iter().any(|&s| g.scope(s).display_path() == m))
            .map(|grp| grp.id)
            .ok_or_else(|| {
                let units: Vec<&str> = groups
                    .iter()
                    .flat_map(|grp| grp.scopes.iter().map(|&s| g.scope(s).display_path()))
                    .collect();
                PlanError::PrefetchModule {
                    module: m.to_string(),
                    suggestion: shardplan_frontends::did_you_mean(m, units.iter().copied()).map(str::to_string),
                }
            })
    };
    lists
        .iter()
        .map(|(k, vs)| Ok((find(k)?, vs.iter().map(|v| find(v)).collect::<Result<Vec<_>, _>>()?)))
        .collect()
}
