//! Lowering, the pipeline's first pass: the parallel spec and the traced graph turned into
//! what every later pass plans with: the mesh, the policy and the expert routing.
//!
//! Every normalisation of the spec happens here, once, with its error: the mesh's axes
//! against the world, `reshard_after_forward` against the shard axis, options that only
//! one runtime or only a tensor axis reads. The explicit prefetch lists name modules,
//! which only the groups resolve: [`Lowered::resolve_prefetch`] does that once they are
//! made.

use std::collections::BTreeMap;

use shardplan_frontends::{ParallelConfig, Prefetch, Reshard};
use shardplan_ir::{Graph, Op};

use crate::group::{FsdpGroup, GroupId, WrapPolicy};
use crate::mesh::Mesh;
use crate::plan::{ExpertRouting, OptimizerKind, PlannedGroup, Policy};
use crate::PlanError;

/// The spec as the planner plans it.
pub(crate) struct Lowered {
    pub mesh: Mesh,
    pub policy: Policy,
    /// `reshard_after_forward` on this mesh's shard axis ([`lower_reshard`]); each group
    /// records how it applies to it ([`PlannedGroup::reshard`]).
    pub reshard: Reshard,
    /// The routing of a graph with expert parallelism or token dropping.
    pub experts: Option<ExpertRouting>,
}

/// Lowers `config` for `g` (traced at the per-rank micro-batch shape).
pub(crate) fn lower(g: &Graph, config: &ParallelConfig) -> Result<Lowered, PlanError> {
    if config.mesh.pipeline > 1 {
        return Err(PlanError::Pipeline {
            field: "mesh.pipeline",
            message: "the FSDP program inside each pipeline stage is not planned yet: shardplan plans the pipeline's schedule, its timeline and its bubble (`shardplan plan`), not yet each stage's memory, its FSDP schedule or a pipeline run".into(),
            fix: "see the schedule with `shardplan plan` (or `--format pp-csv`); to plan memory or to train, set mesh.pipeline to 1".into(),
        });
    }
    if config.mxfp8.is_some() {
        return Err(PlanError::NotPlanned {
            field: "mxfp8",
            message: "MXFP8 linears are checked but not planned yet: their block-scaled casts (one e8m0 scale per 32 values) and GEMMs are not in the cost model, so a plan would show them as bf16".into(),
            fix: "plan the run with `float8` (rowwise is the nearest recipe), or without `mxfp8`".into(),
        });
    }
    let mesh = Mesh::with_tensor(
        config.mesh.replicate,
        config.mesh.shard * config.mesh.context,
        config.mesh.tensor,
        config.mesh.world(),
        config.gpus_per_node,
    )?
    .with_expert(config.mesh.expert)?
    .with_context(config.mesh.context)?;
    let policy = Policy {
        wrap: config.wrap.iter().map(|k| k.name().to_string()).collect(),
        wrap_modules: config.wrap_modules.clone(),
        bucket_mib: config.bucket_mib,
        prefetch: Prefetch {
            forward: config.prefetch.forward,
            backward: config.prefetch.backward,
            explicit_forward: BTreeMap::new(),
            explicit_backward: BTreeMap::new(),
            // FSDP2 issues its gathers from its hooks; only shardplan's executor runs a
            // program whose gathers the planner places freely.
            peak_aware: config.prefetch.peak_aware && config.runtime.is_shardplan(),
        },
        mixed_precision: config.mixed_precision,
        offload: config.offload,
        activation_checkpointing: config.activation_checkpointing,
        batch_per_rank: config.batch.per_rank,
        // A context-parallel graph holds `1 / context` of each sequence.
        seq_len: g
            .inputs()
            .first()
            .and_then(|&i| g.node(i).ty.shape.dims().get(1).copied())
            .unwrap_or(1)
            * g.context_degree(),
        grad_accum: config.batch.grad_accum,
        grad_sync: config.batch.grad_sync,
        optimizer_state_per_param: config.optimizer.state_per_param(),
        optimizer: OptimizerKind::of(&config.optimizer),
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
        context_parallel: if mesh.context() > 1 {
            config.context_parallel
        } else {
            Default::default()
        },
        runtime: config.runtime,
        allocator: config.allocator,
    };
    let reshard = lower_reshard(config.reshard_after_forward, mesh.shard())?;
    Ok(Lowered {
        mesh,
        policy,
        reshard,
        experts: expert_routing(g, config),
    })
}

impl Lowered {
    /// The forward program of `micro_batches` micro-batches: no gradient to clip.
    pub(crate) fn forward_only(mut self, micro_batches: u64) -> Lowered {
        self.policy.grad_accum = micro_batches.max(1);
        self.policy.grad_clip = None;
        self
    }

    /// Resolves the spec's explicit prefetch lists (`{module: [modules]}`) to `groups`.
    pub(crate) fn resolve_prefetch(
        &mut self,
        g: &Graph,
        groups: &[PlannedGroup],
        config: &ParallelConfig,
    ) -> Result<(), PlanError> {
        let fsdp: Vec<&FsdpGroup> = groups.iter().map(|p| &p.group).collect();
        self.policy.prefetch.explicit_forward = explicit_prefetch(g, &fsdp, &config.prefetch.explicit_forward)?;
        self.policy.prefetch.explicit_backward = explicit_prefetch(g, &fsdp, &config.prefetch.explicit_backward)?;
        Ok(())
    }
}

/// `reshard_after_forward` on a shard axis of `shard` ranks, in its one form: keeping a
/// slice of the shard group that the shard axis divides into, where 1/shard is the
/// sharded state itself (`true`) and 1/1 is `false`.
pub(crate) fn lower_reshard(reshard: Reshard, shard: u64) -> Result<Reshard, PlanError> {
    Ok(match reshard {
        Reshard::ToGroupOf(n) if n == 0 || !shard.is_multiple_of(n) => {
            return Err(PlanError::ReshardDoesNotDivide { n, shard })
        }
        Reshard::ToGroupOf(n) if n == shard => Reshard::AfterForward,
        Reshard::ToGroupOf(1) => Reshard::Keep,
        r => r,
    })
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

/// The routing of a graph with token dropping, from its first `moe_drop`: (experts, the
/// assignments each keeps, a rank's assignments per MoE layer).
fn dropping(g: &Graph) -> Option<(u64, u64, u64)> {
    g.nodes().find_map(|(_, n)| match n.op {
        Op::MoeDrop { experts, capacity } => {
            let a = n.ty.shape.dims().iter().product::<u64>();
            Some((experts, capacity, a))
        }
        _ => None,
    })
}

/// The routing bound of an expert-parallel graph, from its first dispatch, and its token
/// dropping.
fn expert_routing(g: &Graph, config: &ParallelConfig) -> Option<ExpertRouting> {
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
        Op::MoeDispatch { degree, experts, rows } => Some(ExpertRouting {
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

/// Resolves `{module: [modules]}` explicit prefetch lists to groups; every name must be a
/// wrapped module (the unit of a group). Two modules of one group prefetch what both list.
fn explicit_prefetch(
    g: &Graph,
    groups: &[&FsdpGroup],
    lists: &BTreeMap<String, Vec<String>>,
) -> Result<BTreeMap<GroupId, Vec<GroupId>>, PlanError> {
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
    let mut out: BTreeMap<GroupId, Vec<GroupId>> = BTreeMap::new();
    for (k, vs) in lists {
        let targets = vs.iter().map(|v| find(v)).collect::<Result<Vec<_>, _>>()?;
        out.entry(find(k)?).or_default().extend(targets);
    }
    Ok(out)
}
