//! What plans of one graph share, and the threads that make it.
//!
//! Plans of one graph that differ only in mesh, resharding, prefetch or offload have the
//! same groups (by wrap policy), compute steps, activation events and step durations (by
//! groups and checkpointing), execution order (by checkpointing and runner), node times
//! (by hardware and compute dtype) and model FLOPs. A [`PlanCache`] keeps each once; the
//! auto search plans hundreds of variants with one.
//!
//! [`PlanCache::grouped_steps`] is the pipeline's group → layout → steps: the execution
//! order and every node's time, which do not depend on the groups, are made on threads of
//! their own while the groups are made.

use std::sync::Arc;
use std::thread::{Scope, ScopedJoinHandle};

use shardplan_frontends::{ActivationCheckpointing, Compile, HardwareProfile, ParallelConfig, Runtime};
use shardplan_ir::{DType, JointGraph, NodeId, ParamId};

use crate::cost::{self, NodeTimes};
use crate::group::{group, FsdpGroup, WrapPolicy};
use crate::layout::Names;
use crate::lower::{wrap_policy, Lowered};
use crate::plan::{Breakdown, PlannedGroup};
use crate::steps::{self, ActEvents, ExecOrder, Runner, Step};
use crate::PlanError;

/// What the compute steps of one graph depend on: the groups' parameters, the
/// checkpointing policy, the hardware, the compute dtype and the runtime.
#[derive(Clone)]
struct StepsKey {
    groups: Vec<Vec<ParamId>>,
    checkpointing: ActivationCheckpointing,
    hardware: HardwareProfile,
    param: DType,
    runtime: Runtime,
    compile: Compile,
}

impl StepsKey {
    /// Whether `fsdp` under `config` has this key (compared in place: a search looks it up
    /// for every candidate).
    fn is(&self, fsdp: &[FsdpGroup], config: &ParallelConfig) -> bool {
        self.checkpointing == config.activation_checkpointing
            && self.param == config.mixed_precision.param
            && self.runtime == config.runtime
            && self.compile == config.compile
            && self.groups.len() == fsdp.len()
            && self.groups.iter().zip(fsdp).all(|(a, f)| *a == f.params)
            && self.hardware == config.hardware
    }
}

/// The compute steps of one set of groups, their activation events and durations.
pub struct CachedSteps {
    pub(crate) steps: Vec<Step>,
    pub(crate) acts: ActEvents,
    pub(crate) step_s: Vec<f64>,
    pub(crate) step_parts: Vec<Breakdown>,
}

/// What does not change between plans of one graph (see the module doc).
#[derive(Clone, Default)]
pub struct PlanCache {
    /// By the wrap policy, as printed (every field [`group`] reads besides the graph).
    groups: std::collections::HashMap<String, Arc<Vec<FsdpGroup>>>,
    /// A few keys per search (groupings times checkpointing policies), looked up by `==`.
    steps: Vec<(StepsKey, Arc<CachedSteps>)>,
    /// The execution order by checkpointing policy and runner (it does not depend on the
    /// groups).
    exec: Vec<(ActivationCheckpointing, Runner, Arc<ExecOrder>)>,
    /// Every node's times, by hardware and compute dtype (one entry per search).
    node_times: Vec<(HardwareProfile, DType, Compile, Arc<NodeTimes>)>,
    model_flops: Option<f64>,
}

/// Work for [`PlanCache::steps_begun`] begun on threads of a scope ([`PlanCache::begin`]).
struct Begun<'scope> {
    exec: Option<ScopedJoinHandle<'scope, ExecOrder>>,
    times: Option<ScopedJoinHandle<'scope, (NodeTimes, Option<f64>)>>,
}

/// The forward and backward FLOPs of one micro-batch: every forward node's.
fn model_flops(joint: &JointGraph) -> f64 {
    (0..joint.forward_len)
        .map(|i| {
            let c = joint.graph.node_cost(NodeId(i as u32));
            c.fwd_flops as f64 + c.bwd_flops as f64
        })
        .sum()
}

/// The forward FLOPs of one micro-batch (a forward-only program's work).
pub(crate) fn forward_flops(joint: &JointGraph) -> f64 {
    (0..joint.forward_len)
        .map(|i| joint.graph.node_cost(NodeId(i as u32)).fwd_flops as f64)
        .sum()
}

/// What a scoped thread returned; its panic goes on in the caller's thread.
pub(crate) fn joined<T>(h: ScopedJoinHandle<'_, T>) -> T {
    h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

impl PlanCache {
    /// group → layout → steps: the groups of `config`'s wrap policy laid out on the
    /// lowered mesh, and their compute steps. While the groups are made, the execution
    /// order and every node's time are made on threads of their own where the cache lacks
    /// them.
    pub(crate) fn grouped_steps(
        &mut self,
        joint: &JointGraph,
        config: &ParallelConfig,
        lowered: &Lowered,
        names: Names,
    ) -> Result<(Vec<PlannedGroup>, Arc<CachedSteps>), PlanError> {
        std::thread::scope(|scope| {
            let begun = self.begin(scope, joint, config);
            let units = self.groups_for(&joint.graph, &wrap_policy(config))?;
            let (mesh, reshard) = (&lowered.mesh, lowered.reshard);
            let groups = (units.iter().cloned())
                .map(|grp| PlannedGroup::laid_out(&joint.graph, grp, mesh, reshard, names))
                .collect();
            let steps = self.steps_begun(joint, config, &units, begun);
            Ok((groups, steps))
        })
    }

    /// The model FLOPs of one micro-batch, forward and backward: made once.
    pub(crate) fn model_flops(&mut self, joint: &JointGraph) -> f64 {
        *self.model_flops.get_or_insert_with(|| model_flops(joint))
    }

    /// [`group`] of `g` under `policy`: made once per policy (a failure is not kept).
    pub(crate) fn groups_for(
        &mut self,
        g: &shardplan_ir::Graph,
        policy: &WrapPolicy,
    ) -> Result<Arc<Vec<FsdpGroup>>, PlanError> {
        let key = format!("{policy:?}");
        if let Some(x) = self.groups.get(&key) {
            return Ok(x.clone());
        }
        let x = Arc::new(group(g, policy)?);
        self.groups.insert(key, x.clone());
        Ok(x)
    }

    /// The execution order of `joint` under `config`'s checkpointing and runner: made once
    /// per policy.
    pub(crate) fn exec_for(&mut self, joint: &JointGraph, config: &ParallelConfig) -> Arc<ExecOrder> {
        let runner = Runner::of(config);
        let ac = config.activation_checkpointing;
        match self.cached_exec(config) {
            Some(e) => e,
            None => {
                let e = Arc::new(ExecOrder::new(joint, ac, runner));
                self.exec.push((ac, runner, e.clone()));
                e
            }
        }
    }

    /// The execution order kept for `config`'s checkpointing and runner.
    fn cached_exec(&self, config: &ParallelConfig) -> Option<Arc<ExecOrder>> {
        let runner = Runner::of(config);
        let ac = config.activation_checkpointing;
        self.exec
            .iter()
            .find(|(a, k, _)| *a == ac && *k == runner)
            .map(|(_, _, e)| e.clone())
    }

    /// The node times kept for `config`'s hardware, compute dtype and compilation.
    fn cached_times(&self, config: &ParallelConfig) -> Option<Arc<NodeTimes>> {
        let param = config.mixed_precision.param;
        self.node_times
            .iter()
            .find(|(h, d, c, _)| *h == config.hardware && *d == param && *c == config.compile)
            .map(|(_, _, _, t)| t.clone())
    }

    /// Begins on threads of `scope` what [`PlanCache::steps_begun`] needs besides the
    /// groups and the cache lacks: the execution order, and every node's time with the
    /// model FLOPs (they depend on the graph, the checkpointing, the kernels and the
    /// hardware, not on the groups).
    fn begin<'scope, 'env>(
        &self,
        scope: &'scope Scope<'scope, 'env>,
        joint: &'env JointGraph,
        config: &'env ParallelConfig,
    ) -> Begun<'scope> {
        let runner = Runner::of(config);
        let ac = config.activation_checkpointing;
        let param = config.mixed_precision.param;
        let exec = self
            .cached_exec(config)
            .is_none()
            .then(|| scope.spawn(move || ExecOrder::new(joint, ac, runner)));
        let flops = self.model_flops.is_none();
        let times = self.cached_times(config).is_none().then(|| {
            scope.spawn(move || {
                let times = NodeTimes::new(&joint.graph, &config.hardware, param, config.compile);
                (times, flops.then(|| model_flops(joint)))
            })
        });
        Begun { exec, times }
    }

    /// Keeps node times (and the model FLOPs) made by [`PlanCache::begin`]'s thread.
    fn keep_times(&mut self, config: &ParallelConfig, (times, flops): (NodeTimes, Option<f64>)) -> Arc<NodeTimes> {
        let times = Arc::new(times);
        self.node_times.push((
            config.hardware.clone(),
            config.mixed_precision.param,
            config.compile,
            times.clone(),
        ));
        if self.model_flops.is_none() {
            self.model_flops = flops;
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
    ) -> Arc<CachedSteps> {
        std::thread::scope(|scope| {
            let begun = self.begin(scope, joint, config);
            self.steps_begun(joint, config, fsdp, begun)
        })
    }

    /// [`PlanCache::steps_for`] with what [`PlanCache::begin`] began: the execution order
    /// is awaited before the steps are cut, the node times after.
    fn steps_begun(
        &mut self,
        joint: &JointGraph,
        config: &ParallelConfig,
        fsdp: &[FsdpGroup],
        begun: Begun,
    ) -> Arc<CachedSteps> {
        let param = config.mixed_precision.param;
        let runner = Runner::of(config);
        if let Some(h) = begun.exec {
            let exec = Arc::new(joined(h));
            self.exec.push((config.activation_checkpointing, runner, exec));
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
            compile: config.compile,
        };
        let exec = self.exec_for(joint, config);
        let (mut steps, acts) = steps::steps_and_events_in(joint, fsdp, &exec, runner);
        let times = match (begun.times, self.cached_times(config)) {
            (Some(h), _) => self.keep_times(config, joined(h)),
            (None, Some(t)) => t,
            (None, None) => self.keep_times(
                config,
                (
                    NodeTimes::new(&joint.graph, &config.hardware, param, config.compile),
                    Some(model_flops(joint)),
                ),
            ),
        };
        let unit_host_s = cost::unit_host_seconds(&joint.graph, fsdp, config);
        let (step_s, step_parts) = cost::step_costs(&times, &steps, &unit_host_s);
        cost::annotate_tensor_ops(&joint.graph, &times, &mut steps);
        let x = Arc::new(CachedSteps {
            steps,
            acts,
            step_s,
            step_parts,
        });
        self.steps.push((key, x.clone()));
        x
    }
}
