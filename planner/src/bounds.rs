//! Lower bounds on a plan's step time and device memory, from what the auto search can
//! compute without scheduling it: its groups, their layouts on the shard axis, and the
//! compute steps of its groups and checkpointing (which [`PlanCache`] shares between
//! candidates). The search skips a candidate whose bounds already rule it out, so every
//! bound here must hold for the plan [`crate::plan`] would make; why each does is said
//! where it is computed, and `planner/tests/auto.rs` checks them against full plans of
//! every candidate of its grid.

use crate::cost::{link, ring_seconds};
use crate::group::FsdpGroup;
use crate::layout::layout;
use crate::lower::wrap_policy;
use crate::mesh::Mesh;
use crate::plan::Comm;
use crate::steps::Phase;
use crate::{PlanCache, PlanError};
use shardplan_frontends::{ActivationCheckpointing, Offload, ParallelConfig, Reshard};
use shardplan_ir::JointGraph;
use std::collections::hash_map::Entry;
use std::collections::HashMap;

/// What no plan of a config can beat.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bounds {
    /// Seconds: at most the plan's `estimate.step_s`.
    pub step_s: f64,
    /// Bytes: at most the plan's `memory.device_total` (and its allocated peak plus the
    /// CUDA context and NCCL's buffers).
    pub device: u64,
}

/// Relative slack taken off the time bound: it sums the same per-step seconds as the
/// timeline, but not necessarily in the same order, and float addition is not associative.
const SLACK: f64 = 1e-9;

/// Per grouping: the groups and what bounds read of them.
struct Grouping {
    groups: Vec<FsdpGroup>,
    /// Elements of each group's parameters.
    numel: Vec<u64>,
    /// Per shard-axis size: elements of each group's flat shard (padded).
    shard_numel: HashMap<u64, Vec<u64>>,
}

/// Per grouping and checkpointing: what the compute steps give.
struct StepFacts {
    /// Seconds of every compute step once (one micro-batch).
    compute_s: f64,
    /// Groups the first step reads.
    first_reads: Vec<usize>,
    /// Groups whose gradients the last step makes.
    last_grads: Vec<usize>,
    /// The first step that is not a forward one.
    first_backward: Option<usize>,
    /// Groups some step reads.
    read: Vec<bool>,
    /// Groups read by a backward (or recompute) step.
    read_in_backward: Vec<bool>,
    /// Groups whose gradients some step makes.
    has_grads: Vec<bool>,
    /// Per step: its activation peak.
    act_peak: Vec<u64>,
    /// Per step: the groups it reads.
    reads: Vec<Vec<usize>>,
    /// Per step: its activation bytes when it ends, and the elements of the gradients it
    /// makes.
    ends: Vec<(u64, u64)>,
    /// Per group: the last step that makes its gradients, and how many elements it has.
    last_grad: Vec<Option<usize>>,
    /// Per group: the first and last step that reads it, and its first backward reader.
    first_read: Vec<Option<usize>>,
    last_read: Vec<Option<usize>>,
    first_backward_read: Vec<Option<usize>>,
}

/// Bucketing and checkpointing: what the steps of a search's candidates depend on.
type FactsKey = (Option<u64>, ActivationCheckpointing);

/// Held at one point of backward: (elements in the parameter dtype, bytes, elements in the
/// reduce dtype).
type Held = (u64, u64, u64);

/// Memoised bounds for the candidates of one search (one graph; configs that differ only in
/// the knobs the search varies): the groupings, layouts and step facts are computed once
/// per distinct input.
#[derive(Default)]
pub struct BoundCache {
    /// The budget the bounds are for, if any (see [`BoundCache::with_budget`]).
    budget: Option<u64>,
    /// Per checkpointing policy: the most activation bytes of any compute step, which is
    /// the same for every grouping (see [`BoundCache::bounds`]).
    act_floor: HashMap<ActivationCheckpointing, u64>,
    groupings: HashMap<Option<u64>, Grouping>,
    facts: HashMap<FactsKey, StepFacts>,
    /// Per step facts and resharding (0: free, 1: keep, n: post-forward shard of n): most
    /// bytes held in backward (see `held_while_running`).
    held: HashMap<(FactsKey, u64, u32, u32), Vec<Held>>,
    /// Time bounds: the candidates that differ only in prefetch (or in a resharding that
    /// gathers as often) share one.
    times: HashMap<TimeKey, f64>,
}

/// What a time bound reads of the searched knobs: the step facts, the mesh (replicate,
/// shard, tensor), CPU offload, and [`frees_after_forward`].
type TimeKey = (FactsKey, (u64, u64, u64), bool, bool);

impl BoundCache {
    /// A cache for a search that only asks whether candidates fit `budget` bytes: where the
    /// activations alone rule a candidate out, its bounds are that memory floor and a zero
    /// time (both still lower bounds), and its grouping's steps are never built.
    pub fn with_budget(budget: u64) -> BoundCache {
        BoundCache {
            budget: Some(budget),
            ..BoundCache::default()
        }
    }

    /// Lower bounds on the plan of `joint` for `config` (steps shared through `cache`).
    pub fn bounds(
        &mut self,
        joint: &JointGraph,
        config: &ParallelConfig,
        cache: &mut PlanCache,
    ) -> Result<Bounds, PlanError> {
        // A cache serves one search: its configs differ only in the searched knobs, of which
        // bucketing and checkpointing change groups and steps.
        let gkey = config.bucket_mib;
        let grouping = match self.groupings.entry(gkey) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(Grouping::of(joint, config, cache)?),
        };
        if let Some(budget) = self.budget {
            let floor = activation_floor(&mut self.act_floor, joint, config, cache, &grouping.groups);
            let device = floor.saturating_add(config.hardware.cuda_context_bytes());
            if device > budget {
                return Ok(Bounds { step_s: 0.0, device });
            }
        }
        grouping.lay_out(joint, config.mesh.fsdp_shard());
        let fkey = (gkey, config.activation_checkpointing);
        if let Entry::Vacant(slot) = self.facts.entry(fkey) {
            slot.insert(StepFacts::of(joint, config, cache, &grouping.groups));
        }
        let grouping = &self.groupings[&gkey];
        let facts = &self.facts[&fkey];
        let (mode, depths) = (reshard_mode(config), prefetch_depths(config));
        let held = self
            .held
            .entry((fkey, mode, depths.0, depths.1))
            .or_insert_with(|| held_while_running(grouping, facts, mode, depths));
        let device = device_bound(config, grouping, facts, held);
        let m = config.mesh;
        let tkey = (
            fkey,
            (m.replicate, m.shard, m.tensor),
            config.offload == Offload::Cpu,
            frees_after_forward(config),
        );
        let step_s = *self
            .times
            .entry(tkey)
            .or_insert_with(|| time_bound(config, grouping, facts));
        Ok(Bounds { step_s, device })
    }
}

/// The most activation bytes of any compute step under `config`'s checkpointing policy,
/// computed once per policy into `floors` (from any grouping's `groups`).
///
/// Activations rise and fall with the execution order, which the checkpointing policy
/// fixes and the grouping does not change: the step builder's running level
/// (`steps::steps_and_events`) moves the same way whatever the groups, and a grouping
/// only decides where steps are cut. So the most activation bytes of any step (`act_max`)
/// is the same for every grouping of a policy, and every plan holds at least that plus the
/// CUDA context while its largest step runs. Over the budget, no candidate of the policy
/// fits, and its other groupings' steps are not built.
fn activation_floor(
    floors: &mut HashMap<ActivationCheckpointing, u64>,
    joint: &JointGraph,
    config: &ParallelConfig,
    cache: &mut PlanCache,
    groups: &[FsdpGroup],
) -> u64 {
    *floors.entry(config.activation_checkpointing).or_insert_with(|| {
        let exec = cache.exec_for(joint, config);
        let runner = crate::steps::Runner::of(config);
        crate::steps::activation_peak_in(joint, groups, &exec, runner)
    })
}

impl Grouping {
    /// The groups `config`'s wrap policy makes of `joint` (through `cache`), and their
    /// elements; no layout yet.
    fn of(joint: &JointGraph, config: &ParallelConfig, cache: &mut PlanCache) -> Result<Grouping, PlanError> {
        let groups = cache.groups_for(&joint.graph, &wrap_policy(config))?.to_vec();
        let numel = groups
            .iter()
            .map(|f| {
                f.params
                    .iter()
                    .map(|&p| joint.graph.param(p).ty.numel().unwrap_or(0))
                    .sum()
            })
            .collect();
        Ok(Grouping {
            groups,
            numel,
            shard_numel: HashMap::new(),
        })
    }

    /// Lays every group out over a shard axis of `shard` ranks, once per axis size.
    fn lay_out(&mut self, joint: &JointGraph, shard: u64) {
        if let Entry::Vacant(slot) = self.shard_numel.entry(shard) {
            let sn = self
                .groups
                .iter()
                .map(|f| layout(&joint.graph, f, shard).shard_numel)
                .collect();
            slot.insert(sn);
        }
    }
}

impl StepFacts {
    /// What the compute steps of `groups` under `config`'s checkpointing give (the steps
    /// built, or shared, through `cache`).
    fn of(joint: &JointGraph, config: &ParallelConfig, cache: &mut PlanCache, groups: &[FsdpGroup]) -> StepFacts {
        let cached = cache.steps_for(joint, config, groups);
        let n = groups.len();
        let mut read = vec![false; n];
        let mut read_in_backward = vec![false; n];
        let mut has_grads = vec![false; n];
        let mut act_peak = Vec::with_capacity(cached.steps.len());
        let mut reads = Vec::with_capacity(cached.steps.len());
        let mut first_read = vec![None; n];
        let mut last_read = vec![None; n];
        let mut first_backward_read = vec![None; n];
        let mut ends = Vec::with_capacity(cached.steps.len());
        let mut last_grad = vec![None; n];
        let numel_of = |p: &shardplan_ir::ParamId| joint.graph.param(*p).ty.numel().unwrap_or(0);
        for (i, s) in cached.steps.iter().enumerate() {
            for g in &s.grads {
                last_grad[g.index()] = Some(i);
            }
            ends.push((s.act_end, s.grad_params.iter().map(numel_of).sum::<u64>()));
            for g in &s.reads {
                let g = g.index();
                first_read[g] = first_read[g].or(Some(i));
                last_read[g] = Some(i);
                if s.phase != Phase::Forward {
                    first_backward_read[g] = first_backward_read[g].or(Some(i));
                }
            }
            reads.push(s.reads.iter().map(|g| g.index()).collect());
            for g in &s.reads {
                read[g.index()] = true;
                if s.phase != Phase::Forward {
                    read_in_backward[g.index()] = true;
                }
            }
            for g in &s.grads {
                has_grads[g.index()] = true;
            }
            act_peak.push(s.act_peak);
        }
        StepFacts {
            compute_s: cached.step_s.iter().sum(),
            first_reads: cached
                .steps
                .first()
                .map(|s| s.reads.iter().map(|g| g.index()).collect())
                .unwrap_or_default(),
            read,
            read_in_backward,
            has_grads,
            last_grads: cached
                .steps
                .last()
                .map(|s| s.grads.iter().map(|g| g.index()).collect())
                .unwrap_or_default(),
            first_backward: cached.steps.iter().position(|s| s.phase != Phase::Forward),
            act_peak,
            reads,
            ends,
            last_grad,
            first_read,
            last_read,
            first_backward_read,
        }
    }
}

/// Resharding as [`held_while_running`] reads it: 0 frees after forward (`true`, or a
/// post-forward group as large as the shard axis), 1 keeps, n keeps a shard of n ranks.
fn reshard_mode(config: &ParallelConfig) -> u64 {
    match lowered_reshard(config) {
        Reshard::AfterForward => 0,
        Reshard::Keep => 1,
        Reshard::ToGroupOf(n) => n,
    }
}

/// `reshard_after_forward` as planning lowers it ([`crate::lower::lower_reshard`]); a
/// group that does not divide the shard axis, which planning refuses, is bounded as given.
fn lowered_reshard(config: &ParallelConfig) -> Reshard {
    let r = config.reshard_after_forward;
    crate::lower::lower_reshard(r, config.mesh.fsdp_shard()).unwrap_or(r)
}

/// Prefetch depths (forward, backward) as the schedule applies them to shardplan's runtime
/// (FSDP2 issues prefetches after a step's own gather; explicit lists replace the depth;
/// `prefetch: auto` may issue any gather as late as the step that needs it): 0 where the
/// depth is not what the schedule applies.
fn prefetch_depths(config: &ParallelConfig) -> (u32, u32) {
    let p = &config.prefetch;
    if config.runtime.is_shardplan() && !p.peak_aware && p.explicit_forward.is_empty() && p.explicit_backward.is_empty()
    {
        (p.forward, p.backward)
    } else {
        (0, 0)
    }
}

/// What is live, apart from persistent buffers, at points of the program under resharding
/// `mode` (0: free after forward, 1: keep, n: keep a post-forward shard of n ranks) and
/// prefetch `depths` (forward, backward; 0 where the depth is not what the schedule
/// applies): [`Held`] per point.
///
/// While a step runs: its activation peak; the unsharded parameters of every group it reads
/// and of the groups whose gathers are issued ahead of it; the gradient pieces it writes
/// (allocated, in the parameter dtype, before it runs); the reduce-scatter input of every
/// group reduced after the step before it (the group's elements in the reduce dtype: the
/// schedule issues its free, the reduction's tail, after the next compute step, or FSDP2
/// keeps it until the next reduction); every group kept after forward
/// (every group under `false`, the root group always) from its forward gather to its last
/// read; under `n`, every other group's post-forward shard (a `1/n` slice) until backward
/// gathers it again. After the step that last makes a group's gradients, where the group
/// is reduce-scattered: the step's activations at its end, the kept groups and post-forward
/// shards, the step's gradient pieces and the reduce-scatter input they are packed into
/// (the group's elements in the reduce dtype).
fn held_while_running(grouping: &Grouping, facts: &StepFacts, mode: u64, depths: (u32, u32)) -> Vec<Held> {
    let n = grouping.groups.len();
    let steps = facts.reads.len();
    // The schedule's gathers: a group is gathered where it is read and not held, and held
    // until its last read, or its last forward read unless it keeps (the root always keeps;
    // every group under `false`). Per pass, the gather of the i-th is issued before the
    // step of the (i - depth)-th starts, so while the step of the i-th runs, the outputs of
    // the next `depth` gathers of its pass are allocated too.
    let keeps = |g: usize| grouping.groups[g].is_root() || mode == 1;
    let mut last_forward = vec![None; n];
    for (i, r) in facts.reads.iter().enumerate() {
        if facts.first_backward.is_none_or(|b| i < b) {
            for &g in r {
                last_forward[g] = Some(i);
            }
        }
    }
    let mut gathered = vec![false; n];
    let mut need: Vec<(usize, usize)> = Vec::new();
    for (pos, r) in facts.reads.iter().enumerate() {
        for &g in r {
            if !gathered[g] {
                gathered[g] = true;
                need.push((pos, g));
            }
        }
        for &g in r {
            if facts.last_read[g] == Some(pos) || (last_forward[g] == Some(pos) && !keeps(g)) {
                gathered[g] = false;
            }
        }
    }
    let backward = |pos: usize| facts.first_backward.is_some_and(|b| pos >= b);
    let mut ahead: Vec<Vec<usize>> = vec![Vec::new(); steps];
    for pass in [false, true] {
        let list: Vec<(usize, usize)> = need.iter().copied().filter(|&(pos, _)| backward(pos) == pass).collect();
        let depth = if pass { depths.1 } else { depths.0 } as usize;
        for (i, &(pos, _)) in list.iter().enumerate() {
            for &(_, g) in list.iter().skip(i + 1).take(depth) {
                if !facts.reads[pos].contains(&g) && !ahead[pos].contains(&g) {
                    ahead[pos].push(g);
                }
            }
        }
    }
    let kept = |s: usize, skip: &[usize]| -> u64 {
        let mut elems = 0;
        for g in 0..grouping.groups.len() {
            if skip.contains(&g) || facts.first_read[g].is_none_or(|f| f >= s) {
                continue;
            }
            let root = grouping.groups[g].is_root();
            if (root || mode == 1) && facts.last_read[g].is_some_and(|l| l > s) {
                elems += grouping.numel[g];
            } else if !root && mode > 1 && facts.first_backward_read[g].is_some_and(|b| b > s) {
                elems += grouping.numel[g] / mode;
            }
        }
        elems
    };
    let mut out = Vec::new();
    for (s, (reads, early_groups)) in facts.reads.iter().zip(&ahead).enumerate() {
        let read: u64 = reads.iter().map(|&g| grouping.numel[g]).sum();
        let (act_end, made) = facts.ends[s];
        let early: u64 = early_groups.iter().map(|&g| grouping.numel[g]).sum();
        let skip: Vec<usize> = reads.iter().chain(early_groups).copied().collect();
        let reducing: u64 = match s.checked_sub(1) {
            Some(before) => (0..grouping.groups.len())
                .filter(|&g| facts.last_grad[g] == Some(before))
                .map(|g| grouping.numel[g])
                .sum(),
            None => 0,
        };
        out.push((read + kept(s, &skip) + made + early, facts.act_peak[s], reducing));
        for g in (0..grouping.groups.len()).filter(|&g| facts.last_grad[g] == Some(s)) {
            // (elements in the parameter dtype, bytes, elements in the reduce dtype)
            out.push((kept(s, &[g]).saturating_add(made), act_end, grouping.numel[g]));
        }
    }
    out
}

/// What both bounds read of a candidate's precision and mesh: bytes per element of the
/// parameter, reduce and master dtypes, the replicate and shard axes, and each group's
/// flat shard on that shard axis.
struct Sizes<'a> {
    param_b: u64,
    reduce_b: u64,
    master_b: u64,
    replicate: u64,
    shard: u64,
    shard_numel: &'a [u64],
}

impl<'a> Sizes<'a> {
    fn of(config: &ParallelConfig, grouping: &'a Grouping) -> Sizes<'a> {
        let precision = config.mixed_precision;
        let shard = config.mesh.fsdp_shard();
        Sizes {
            param_b: precision.param.size_bytes(),
            reduce_b: precision.reduce.size_bytes(),
            master_b: precision.master().size_bytes(),
            replicate: config.mesh.replicate,
            shard,
            shard_numel: &grouping.shard_numel[&shard],
        }
    }
}

/// The bound on the device total.
fn device_bound(config: &ParallelConfig, grouping: &Grouping, facts: &StepFacts, held: &[Held]) -> u64 {
    let hw = &config.hardware;
    let Sizes {
        param_b,
        reduce_b,
        master_b,
        replicate,
        shard,
        shard_numel,
    } = Sizes::of(config, grouping);

    // Memory. Every group's flat shard of master parameters, and its optimizer state, are
    // persistent device buffers without offload (allocated before the first instruction,
    // never freed). While a compute step runs, the memory model holds its activation peak
    // on top of every live buffer; the unsharded parameters of every group it reads are
    // live then too (the verifier's first invariant: a read comes after the group's
    // all-gather and before its free), at least their elements in the parameter dtype. So
    // with one shard: the schedule gathers over the one-rank shard axis all the same, into
    // an unsharded buffer of its own (with CPU offload, from the shard's device copy). The
    // allocator reserves at least what is requested (its requested peak is the model's
    // peak) and the CUDA context comes on top.
    let persistent = if config.offload == Offload::None {
        let k = config.optimizer.state_per_param();
        shard_numel.iter().sum::<u64>().saturating_mul(master_b * (1 + k))
    } else {
        0
    };
    // Each step's activation peak and reads, with the groups kept after forward, gathered
    // ahead, reduced and the gradient pieces beside them (`held_while_running`: one point
    // per step, and one per reduction).
    let held_most = held
        .iter()
        .map(|&(elems, bytes, reduced)| {
            bytes
                .saturating_add(elems.saturating_mul(param_b))
                .saturating_add(reduced.saturating_mul(reduce_b))
        })
        .max()
        .unwrap_or(0);
    // NCCL's buffers: one set per communicator (a comm and the stream it runs on) of more
    // than one rank that the program uses (`simulate::overhead`). With more than one shard,
    // every group some step reads is all-gathered over the shard axis on the all-gather
    // stream (its first gather is from its own shard, or the copy of it under offload),
    // every group with gradients is reduce-scattered over it on the reduce-scatter stream,
    // and gradient clipping all-reduces the norm's partial sums over it on the all-reduce
    // stream; with replicas, every group with gradients is all-reduced over the replicate
    // axis on the all-reduce stream.
    let any_grads = facts.has_grads.iter().any(|&g| g);
    let communicators = [
        shard > 1 && facts.read.iter().any(|&r| r),
        shard > 1 && any_grads,
        shard > 1 && config.grad_clip.is_some(),
        replicate > 1 && any_grads,
    ]
    .iter()
    .filter(|&&c| c)
    .count() as u64;
    persistent
        .saturating_add(held_most)
        .saturating_add(hw.cuda_context_bytes())
        .saturating_add(hw.nccl_bytes_per_communicator().saturating_mul(communicators))
}

/// The bound on the step time: it reads neither the prefetch depths nor the resharding
/// beyond whether a group is gathered again in backward ([`TimeKey`]).
fn time_bound(config: &ParallelConfig, grouping: &Grouping, facts: &StepFacts) -> f64 {
    let hw = &config.hardware;
    let Sizes {
        param_b,
        reduce_b,
        master_b,
        replicate,
        shard,
        shard_numel,
    } = Sizes::of(config, grouping);
    let micro = config.batch.grad_accum as f64;

    // Time. Each stream runs its instructions one after another, so the step lasts at
    // least as long as any stream is busy: the compute stream runs every compute step once
    // per micro-batch, each at least its step's seconds (overlap only slows it), and
    // cannot start the first before the all-gathers of the groups it reads have ended; the
    // all-gather stream gathers every group at least once, and again in backward when it is
    // freed after forward (`true`, or a post-forward group as large as the shard axis) and
    // read in backward, the root group excepted (it always keeps); the reduce-scatter stream
    // reduces every group with gradients at least once; with replicas, the all-reduce stream
    // all-reduces each group's gradient shard at least once. Collective times are the cost
    // model's ring times of the unpadded bytes (padding only adds), which rise with bytes.
    //
    // The chain at the ends of the step: the first compute step waits for its groups'
    // all-gathers; the last compute step makes the gradients of its groups, which are then
    // reduce-scattered and all-reduced over replicas, one after the other; the stream that
    // runs the optimizer (the host's under offload, else the compute stream) waits for every
    // group's reduced gradients, then runs the gradient norm (reading every gradient shard,
    // its partial sum all-reduced over the shard axis) and every group's optimizer step (its
    // gradient read, parameters and state read and written), in turn.
    let compute = micro * facts.compute_s;
    let mut step_s = compute * (1.0 - SLACK);
    let Ok(mesh) = Mesh::with_tensor(
        replicate,
        shard,
        config.mesh.tensor,
        config.mesh.world(),
        config.gpus_per_node,
    )
    .and_then(|m| m.with_context(config.mesh.context)) else {
        return step_s;
    };
    let shard_link = link(&mesh, Comm::Shard, hw);
    let rep_link = link(&mesh, Comm::Replicate, hw);
    let grad_b = reduce_b.min(master_b);
    let rs = |g: usize| ring_seconds(shard, grouping.numel[g].saturating_mul(reduce_b), shard_link, false);
    let ar = |g: usize| {
        ring_seconds(
            replicate,
            (grouping.numel[g] / shard).saturating_mul(grad_b),
            rep_link,
            true,
        )
    };
    let ag = |g: usize| ring_seconds(shard, grouping.numel[g].saturating_mul(param_b), shard_link, false);
    let first = facts.first_reads.iter().map(|&g| ag(g)).fold(0.0, f64::max);
    let last = facts.last_grads.iter().map(|&g| rs(g) + ar(g)).fold(0.0, f64::max);
    let mem_bw = if config.offload == Offload::Cpu {
        hw.host_mem_gbps * 1e9
    } else {
        hw.hbm_gbps * 1e9 * hw.memory_efficiency
    };
    let k = config.optimizer.state_per_param();
    let with_grads = || (0..grouping.groups.len()).filter(|&g| facts.has_grads[g]);
    let grad_bytes: u64 = with_grads().map(|g| shard_numel[g].saturating_mul(grad_b)).sum();
    let mut tail: f64 = with_grads()
        .map(|g| {
            let p = shard_numel[g].saturating_mul(master_b);
            (shard_numel[g].saturating_mul(grad_b) + 2 * p + 2 * p * k) as f64 / mem_bw
        })
        .sum();
    if config.grad_clip.is_some() {
        tail += grad_bytes as f64 / mem_bw + ring_seconds(shard, 8, shard_link, true);
    }
    step_s = step_s.max((first + compute + last + tail) * (1.0 - SLACK));
    if shard > 1 {
        let frees_after_forward = frees_after_forward(config);
        let n = grouping.groups.len();
        let mut gathers = 0.0;
        let mut scatters = 0.0;
        for g in 0..n {
            if facts.read[g] {
                let again = frees_after_forward && !grouping.groups[g].is_root() && facts.read_in_backward[g];
                gathers += ag(g) * if again { 2.0 } else { 1.0 };
            }
            if facts.has_grads[g] {
                scatters += rs(g);
            }
        }
        step_s = step_s.max(gathers * (1.0 - SLACK)).max(scatters * (1.0 - SLACK));
    }
    if replicate > 1 {
        let reduces: f64 = with_grads().map(ar).sum();
        step_s = step_s.max(reduces * (1.0 - SLACK));
    }
    step_s
}

/// Whether groups freed after forward are gathered again in backward (`true`, or a
/// post-forward group as large as the shard axis).
fn frees_after_forward(config: &ParallelConfig) -> bool {
    lowered_reshard(config) == Reshard::AfterForward
}
