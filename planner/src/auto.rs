//! Auto-planning: search the knobs the user left open for the fastest plan that fits a
//! per-rank memory budget.
//!
//! The space ([`grid`]): mesh split (replicate x shard of the fixed world, the shard axis a
//! divisor or a multiple of `gpus_per_node`), bucketing of consecutive blocks (1, 2 or 4 per
//! group), `reshard_after_forward` (true, the node size, false), forward and backward
//! prefetch (1 or 2 each), activation checkpointing (full, every 2nd block, selective by
//! op, none), and CPU offload only when nothing else fits. A candidate is a full plan
//! (groups, schedule, simulation), so the objective is the cost model's step time; ties go
//! to lower device memory, then to the earlier candidate. Candidates share the compute
//! steps of equal groups and checkpointing; the winner is planned again from scratch and
//! verified.
//!
//! A candidate fits when its device total (the caching allocator's reserved peak, the CUDA
//! context, NCCL's buffers) is within the budget. The search plans only candidates that
//! could win ([`search`]): lower bounds on step time and device memory
//! ([`crate::bounds`]) rule the others out unplanned, and the allocator replay runs only
//! for planned candidates that could still fit and win. A test enumerates every candidate
//! of a grid with full plans and compares winners and scores.

use crate::{Plan, PlanError};
use serde::{Deserialize, Serialize};
use shardplan_frontends::{
    ActivationCheckpointing, HardwareProfile, MeshShape, Offload, Origin, ParallelConfig, Prefetch, Reshard,
};
use shardplan_ir::{JointGraph, ModuleKind};

mod branch;
mod context;

/// The default per-rank budget on `hw`: all its device memory. A candidate fits when its
/// device total does (the caching allocator's reserved peak, the CUDA context and NCCL's
/// buffers), so no share is held back for them.
pub fn default_budget(hw: &HardwareProfile) -> u64 {
    hw.hbm_bytes()
}

/// Which knobs the user set (they stay as the spec says).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fixed {
    pub mesh_split: bool,
    pub bucketing: bool,
    pub reshard: bool,
    pub prefetch: bool,
    pub checkpointing: bool,
    pub offload: bool,
    /// The tensor-parallel degree (`mesh.tensor`); only [`search_model`] searches it.
    pub tensor: bool,
    /// The expert-parallel degree (`mesh.expert`); only [`search_model`] searches it, and
    /// only for a model with routed experts.
    pub expert: bool,
    /// The context-parallel degree (`mesh.context`); only [`search_model`] searches it, and
    /// only for long sequences ([`context_degrees`]).
    pub context: bool,
    /// The Float8 recipe (`float8.recipe`); a spec that writes `float8:` without a recipe
    /// leaves it to the search ([`float8_options`]), which tries bf16 too. Without
    /// `float8:` nothing is searched: Float8 changes the numerics, so only a user asks.
    pub float8: bool,
}

impl Fixed {
    /// The knobs a parallel spec fixes: those whose fields it writes (`origin` records
    /// where each field was written). Bucketing is fixed by `bucket_mib` or `wrap_modules`,
    /// the mesh split by `mesh.replicate` (`mesh.shard` alone leaves the split open).
    pub fn from_origin(origin: &Origin) -> Fixed {
        Fixed {
            mesh_split: origin.has("mesh.replicate"),
            bucketing: origin.has("bucket_mib") || origin.has("wrap_modules"),
            reshard: origin.has("reshard_after_forward"),
            prefetch: origin.has("prefetch"),
            checkpointing: origin.has("activation_checkpointing"),
            offload: origin.has("offload"),
            tensor: origin.has("mesh.tensor"),
            expert: origin.has("mesh.expert"),
            context: origin.has("mesh.context"),
            float8: origin.has("float8.recipe"),
        }
    }
}

/// The searched knobs of one candidate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Knobs {
    pub replicate: u64,
    pub shard: u64,
    /// Blocks per FSDP group (1: no bucketing; 0: bucketing as the spec sets it).
    pub blocks_per_group: u64,
    /// `true`, `false` or the int, as the spec writes it.
    pub reshard_after_forward: String,
    pub prefetch_forward: u32,
    pub prefetch_backward: u32,
    /// `none`, `full` or `every N`.
    pub activation_checkpointing: String,
    pub offload: bool,
    /// Ranks of a tensor-parallel group.
    #[serde(default = "one")]
    pub tensor: u64,
    /// Ranks of an expert-parallel group (inside the shard axis).
    #[serde(default = "one")]
    pub expert: u64,
    /// Ranks of a context-parallel group (each holds `1 / context` of every sequence).
    #[serde(default = "one")]
    pub context: u64,
    /// The Float8 recipe (`none`, `tensorwise`, `tensorwise+ag` with the float8 all-gather
    /// and precomputed scales, `rowwise`, `rowwise_with_gw_hp`).
    #[serde(default = "no_float8")]
    pub float8: String,
}

fn one() -> u64 {
    1
}

fn no_float8() -> String {
    "none".into()
}

/// The [`Knobs::float8`] name of a spec's Float8 setting.
pub fn float8_name(f: &Option<shardplan_frontends::Float8>) -> String {
    match f {
        None => no_float8(),
        Some(f) if f.fsdp_float8_all_gather => format!("{}+ag", f.recipe.name()),
        Some(f) => f.recipe.name().to_string(),
    }
}

/// The Float8 settings [`search_model`] tries: the spec's own when it fixes the recipe or
/// has no `float8:`; else bf16 and every recipe with the spec's filter (no
/// `rowwise_with_gw_hp` beside `auto_filter_small_kn`, which torchao refuses).
pub fn float8_options(base: &ParallelConfig, fixed: Fixed) -> Vec<Option<shardplan_frontends::Float8>> {
    use shardplan_frontends::Float8;
    use shardplan_ir::Float8Recipe;
    use shardplan_models::float8::AUTO_FILTER;
    let Some(f) = base.float8.as_ref().filter(|_| !fixed.float8) else {
        return vec![base.float8.clone()];
    };
    let with = |recipe, all_gather| Float8 {
        recipe,
        filter_fqns: f.filter_fqns.clone(),
        fsdp_float8_all_gather: all_gather,
        precompute_scale: all_gather,
    };
    // The float8 all-gather is not among them: its halved bytes and buffers are not in the
    // plan yet, so it would tie with plain tensorwise.
    let mut v = vec![
        None,
        Some(with(Float8Recipe::Tensorwise, false)),
        Some(with(Float8Recipe::Rowwise, false)),
    ];
    if !f.filter_fqns.iter().any(|x| x == AUTO_FILTER) {
        v.push(Some(with(Float8Recipe::RowwiseWithGwHp, false)));
    }
    v
}

impl Knobs {
    /// The mesh as `replicate x shard`, with `cpC` after the shard axis when there is a
    /// context axis and `x tensor` when there is a tensor axis.
    pub fn mesh(&self) -> String {
        let context = if self.context > 1 {
            format!(" cp{}", self.context)
        } else {
            String::new()
        };
        let base = if self.tensor > 1 {
            format!("{}x{}{context}x{}", self.replicate, self.shard, self.tensor)
        } else {
            format!("{}x{}{context}", self.replicate, self.shard)
        };
        if self.expert > 1 {
            format!("{base} ep{}", self.expert)
        } else {
            base
        }
    }
}

/// One evaluated candidate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub knobs: Knobs,
    pub step_s: f64,
    pub mfu: f64,
    pub exposed_comm_s: f64,
    /// Allocated peak (the plan's `memory.peak`).
    pub peak: u64,
    /// Device total (`memory.device_total`): what must fit the budget. When the allocated
    /// peak plus the fixed overheads already exceed the budget, the allocator is not
    /// replayed and this is that lower bound (`device_exact: false`).
    pub device: u64,
    pub device_exact: bool,
    pub fits: bool,
}

impl Candidate {
    /// Whether it fits `budget`: `None` where the search left that open (a candidate slower
    /// than one that fits is not replayed, and its lower bound is within the budget).
    pub fn fits_budget(&self, budget: u64) -> Option<bool> {
        if self.fits {
            Some(true)
        } else if self.device_exact || self.device > budget {
            Some(false)
        } else {
            None
        }
    }
}

/// The outcome of a search.
#[derive(Clone, Debug)]
pub struct AutoResult {
    pub winner: Plan,
    pub config: ParallelConfig,
    /// Every evaluated candidate, best first (fitting ones before the others).
    pub candidates: Vec<Candidate>,
    /// Plans built and verified; candidates skipped by the pruning rules.
    pub evaluated: usize,
    pub pruned: usize,
    /// Under a context degree the search chose among several: what each other degree gives
    /// on its own (`search_model`); empty otherwise.
    pub context_effects: Vec<String>,
}

/// Nothing fits the budget.
#[derive(Clone, Debug)]
pub struct NoFit {
    /// The lowest-memory candidate found.
    pub best: Candidate,
    pub budget: u64,
}

fn ac_name(a: ActivationCheckpointing) -> String {
    a.to_string()
}

/// Bytes of the largest block's parameters in the param dtype (for bucket sizes).
fn block_bytes(joint: &JointGraph, dtype: shardplan_ir::DType) -> u64 {
    let g = &joint.graph;
    let mut per_block: std::collections::HashMap<shardplan_ir::ScopeId, u64> = std::collections::HashMap::new();
    for (_, p) in g.params() {
        let mut s = Some(p.scope);
        while let Some(x) = s {
            if g.scope(x).kind == ModuleKind::Block {
                *per_block.entry(x).or_default() += p.ty.numel().unwrap_or(0) * dtype.size_bytes();
                break;
            }
            s = g.scope(x).parent;
        }
    }
    per_block.values().copied().max().unwrap_or(0)
}

/// Every candidate of the search space of `base` with the knobs `fixed` kept, in the
/// order the search enumerates them (offload outermost, then mesh split, bucketing,
/// resharding, checkpointing, prefetch): its knobs and its config. Ties between equally
/// fast and equally large candidates go to the earlier one.
pub fn grid(joint: &JointGraph, base: &ParallelConfig, fixed: Fixed) -> Vec<(Knobs, ParallelConfig)> {
    let has_blocks = joint.graph.scopes().any(|(_, s)| s.kind == ModuleKind::Block);
    let splits = mesh_splits(base, fixed);
    let buckets = bucket_options(joint, base, fixed, has_blocks);
    let checkpointing = checkpointing_options(base, fixed, has_blocks);
    let prefetches: Vec<(u32, u32)> = if fixed.prefetch {
        vec![(base.prefetch.forward, base.prefetch.backward)]
    } else {
        vec![(1, 1), (1, 2), (2, 1), (2, 2)]
    };
    let offloads: Vec<Offload> = if fixed.offload {
        vec![base.offload]
    } else {
        vec![Offload::None, Offload::Cpu]
    };
    let mut out = Vec::new();
    for &offload in &offloads {
        for &mesh in &splits {
            let reshards = reshard_options(base, fixed, mesh);
            for &(blocks, bucket) in &buckets {
                for &reshard in &reshards {
                    for &ac in &checkpointing {
                        for &prefetch in &prefetches {
                            let choice = Choice {
                                offload,
                                mesh,
                                blocks,
                                bucket,
                                reshard,
                                ac,
                                prefetch,
                            };
                            out.push(choice.candidate(base));
                        }
                    }
                }
            }
        }
    }
    out
}

/// The mesh splits [`grid`] tries: the data-parallel ranks split between replicate and
/// shard (the shard axis a divisor or a multiple of the node, and a multiple of the expert
/// axis); the tensor axis as given. The spec's own when it fixes the split.
fn mesh_splits(base: &ParallelConfig, fixed: Fixed) -> Vec<MeshShape> {
    if fixed.mesh_split {
        return vec![base.mesh];
    }
    let tensor = base.mesh.tensor;
    let world = base.mesh.data_parallel();
    let gpn = base.gpus_per_node;
    (1..=world)
        .filter(|s| world.is_multiple_of(*s) && (s.is_multiple_of(gpn) || gpn.is_multiple_of(*s)))
        .filter(|shard| shard.is_multiple_of(base.mesh.expert))
        .map(|shard| MeshShape {
            pipeline: 1,
            replicate: world / shard,
            shard,
            context: base.mesh.context,
            tensor,
            expert: base.mesh.expert,
        })
        .collect()
}

/// The bucketings [`grid`] tries, as (blocks per group, bucket_mib): 1, 2 or 4 blocks per
/// group where blocks are wrapped; else (0 blocks) as the spec says.
fn bucket_options(
    joint: &JointGraph,
    base: &ParallelConfig,
    fixed: Fixed,
    has_blocks: bool,
) -> Vec<(u64, Option<u64>)> {
    if fixed.bucketing || !has_blocks || !base.wrap.contains(&ModuleKind::Block) {
        return vec![(0, base.bucket_mib)];
    }
    let bb = block_bytes(joint, base.mixed_precision.param);
    vec![
        (1, None),
        (2, Some((2 * bb).div_ceil(1 << 20))),
        (4, Some((4 * bb).div_ceil(1 << 20))),
    ]
}

/// The activation checkpointing policies [`grid`] tries where the model has blocks and
/// the spec leaves it open.
fn checkpointing_options(base: &ParallelConfig, fixed: Fixed, has_blocks: bool) -> Vec<ActivationCheckpointing> {
    if fixed.checkpointing || !has_blocks {
        vec![base.activation_checkpointing]
    } else if !base.runtime.is_shardplan() && base.mesh.expert > 1 {
        // FSDP2 cannot run selective checkpointing with an expert axis (the spec parser
        // refuses it).
        vec![
            ActivationCheckpointing::Full,
            ActivationCheckpointing::Every(2),
            ActivationCheckpointing::None,
        ]
    } else {
        vec![
            ActivationCheckpointing::Full,
            ActivationCheckpointing::Every(2),
            ActivationCheckpointing::Selective(shardplan_frontends::SavePolicy::TORCHTITAN),
            ActivationCheckpointing::None,
        ]
    }
}

/// The resharding options [`grid`] tries on `mesh`: `true`, the node size where it
/// divides a larger shard axis, `false`.
fn reshard_options(base: &ParallelConfig, fixed: Fixed, mesh: MeshShape) -> Vec<Reshard> {
    if fixed.reshard {
        return vec![base.reshard_after_forward];
    }
    let gpn = base.gpus_per_node;
    let mut v = vec![Reshard::AfterForward];
    if gpn > 1 && gpn < mesh.shard && mesh.shard.is_multiple_of(gpn) {
        v.push(Reshard::ToGroupOf(gpn));
    }
    v.push(Reshard::Keep);
    v
}

/// One point of [`grid`]: a value for every searched knob.
struct Choice {
    offload: Offload,
    mesh: MeshShape,
    /// Blocks per group and the bucket size that makes them (0 blocks: as the spec says).
    blocks: u64,
    bucket: Option<u64>,
    reshard: Reshard,
    ac: ActivationCheckpointing,
    /// Forward and backward prefetch depths.
    prefetch: (u32, u32),
}

impl Choice {
    /// Its knobs, and `base` with them set.
    fn candidate(&self, base: &ParallelConfig) -> (Knobs, ParallelConfig) {
        let (pf, pb) = self.prefetch;
        let mut c = base.clone();
        c.mesh = self.mesh;
        c.bucket_mib = self.bucket;
        c.reshard_after_forward = self.reshard;
        c.activation_checkpointing = self.ac;
        c.prefetch = Prefetch {
            forward: pf,
            backward: pb,
            ..base.prefetch.clone()
        };
        c.offload = self.offload;
        let knobs = Knobs {
            replicate: self.mesh.replicate,
            shard: self.mesh.shard,
            blocks_per_group: self.blocks,
            reshard_after_forward: self.reshard.to_string(),
            prefetch_forward: pf,
            prefetch_backward: pb,
            activation_checkpointing: ac_name(self.ac),
            offload: self.offload == Offload::Cpu,
            tensor: self.mesh.tensor,
            expert: self.mesh.expert,
            context: self.mesh.context,
            float8: float8_name(&c.float8),
        };
        (knobs, c)
    }
}

/// Searches the open knobs of `base` for the fastest plan within `budget` bytes per rank:
/// the least step time among candidates whose device total fits, then the least device
/// total, then the earliest in [`grid`] order. CPU offload is tried only when no candidate
/// without it fits. `prune: false` plans every candidate (tests compare the two).
///
/// The pruned search is a best-first branch and bound over [`grid`] that finds the same
/// winner: every candidate gets [`Bounds`] (lower bounds on its step time and device
/// total, from its groups, layouts and compute steps, no schedule); one whose memory bound
/// exceeds the budget cannot fit and is never planned; the rest are planned in order of
/// their time bound, and once a candidate fits, every candidate whose time bound exceeds
/// its step time is slower than it and is dropped, unplanned. A planned candidate is
/// replayed through the allocator model only if it could still win: its allocated peak
/// plus overheads fits, and it is not slower than the best so far (nor, at equal speed,
/// larger than the best's device total by that bound already).
pub fn search(
    joint: &JointGraph,
    base: &ParallelConfig,
    fixed: Fixed,
    budget: u64,
    prune: bool,
) -> Result<Result<AutoResult, NoFit>, PlanError> {
    search_spaces(&[(joint, base.clone())], fixed, budget, prune)
}

/// [`search`] over the union of several spaces' grids (a traced graph and the spec it is
/// searched from, one per tensor-parallel degree), as one branch and bound: a candidate
/// that fits in one space prunes every space's slower candidates, and offload is tried
/// only when no candidate of any space fits without it. Ties go to the earlier space.
pub(crate) fn search_spaces(
    spaces: &[(&JointGraph, ParallelConfig)],
    fixed: Fixed,
    budget: u64,
    prune: bool,
) -> Result<Result<AutoResult, NoFit>, PlanError> {
    let mut search = branch::Search::new(spaces, fixed, budget, prune)?;
    for offload in [false, true] {
        if search.found() {
            break; // offload only when nothing else fits
        }
        search.pass(offload)?;
    }
    if search.found() {
        search.winner().map(Ok)
    } else {
        search.least_device().map(Err)
    }
}

/// The tensor-parallel degrees `--auto` tries for `base`: 1, 2, 4 and 8 where they divide
/// the node (a tensor group stays on NVLink) and the world; the spec's own when it fixes
/// `mesh.tensor`.
pub(crate) fn tensor_degrees(base: &ParallelConfig, fixed: Fixed) -> Vec<u64> {
    if fixed.tensor {
        return vec![base.mesh.tensor];
    }
    let world = base.mesh.world();
    let replicate = if fixed.mesh_split { base.mesh.replicate } else { 1 };
    [1u64, 2, 4, 8]
        .into_iter()
        .filter(|&t| base.gpus_per_node.is_multiple_of(t) && world.is_multiple_of(t * replicate))
        .collect()
}

/// The expert-parallel degrees `--auto` tries for `model` under `base`: for a mixture of
/// experts, 1 and the powers of two that divide its routed experts and the node (the
/// tokens' all-to-all stays on NVLink, as torchtitan lays it out); the spec's own when it
/// fixes `mesh.expert` or the model has no routed experts.
pub fn expert_degrees(model: &shardplan_models::ModelConfig, base: &ParallelConfig, fixed: Fixed) -> Vec<u64> {
    let experts = match model {
        shardplan_models::ModelConfig::Llama(c) => c.moe.as_ref().map(|m| m.experts),
        _ => None,
    };
    match experts {
        Some(n) if !fixed.expert => std::iter::successors(Some(1u64), |e| e.checked_mul(2))
            .take_while(|&e| e <= base.gpus_per_node && e <= base.mesh.world())
            .filter(|&e| n.is_multiple_of(e))
            .collect(),
        _ => vec![base.mesh.expert],
    }
}

/// [`search`] with the tensor-parallel degree searched too ([`tensor_degrees`]): the model
/// traced as one tensor rank's program at each degree the model divides, each over the
/// same knobs with the data-parallel ranks left and the same tokens per step
/// (`batch.per_rank` counts a data-parallel rank's sequences, which its tensor group
/// shares, so it scales with the degree), all in one branch and bound
/// over every degree's candidates: the fastest fitting candidate of all wins (ties: less device
/// memory, then the smaller degree); offload only when no degree fits without it; nothing
/// fitting, the least device total of all.
pub fn search_model(
    model: &shardplan_models::ModelConfig,
    base: &ParallelConfig,
    fixed: Fixed,
    budget: u64,
    prune: bool,
) -> Result<Result<AutoResult, NoFit>, PlanError> {
    let spaces = model_spaces(model, base, fixed)?;
    let spaces: Vec<(&JointGraph, ParallelConfig)> = spaces.iter().map(|(j, c)| (j, c.clone())).collect();
    let mut found = search_spaces(&spaces, fixed, budget, prune)?;
    if let Ok(r) = found.as_mut() {
        if let Some(w) = r.candidates.first() {
            r.context_effects = context::context_effects(&spaces, fixed, budget, w)?;
        }
    }
    Ok(found)
}

/// The context-parallel degrees `--auto` tries: the spec's own when it fixes
/// `mesh.context`; else, for a Llama-family model without routed experts on sequences of
/// at least [`CONTEXT_MIN_SEQ`] tokens, 1 and the powers of two up to the node that split
/// the sequence (torchtitan trains context parallelism from 32k tokens up); else 1.
pub fn context_degrees(model: &shardplan_models::ModelConfig, base: &ParallelConfig, fixed: Fixed) -> Vec<u64> {
    let dense_llama = matches!(model, shardplan_models::ModelConfig::Llama(c) if c.moe.is_none());
    let seq = base.batch.seq_len.unwrap_or_else(|| model.default_seq_len());
    if fixed.context || !dense_llama || seq < CONTEXT_MIN_SEQ || base.mesh.expert > 1 {
        return vec![base.mesh.context];
    }
    std::iter::successors(Some(1u64), |c| c.checked_mul(2))
        .take_while(|&c| c <= base.gpus_per_node && c <= base.mesh.world())
        .filter(|&c| seq.is_multiple_of(base.context_parallel.load_balance.chunks(c)))
        .collect()
}

/// The shortest sequence `--auto` splits over a context axis.
pub const CONTEXT_MIN_SEQ: u64 = 16_384;

/// The spaces [`search_model`] searches: for each of [`tensor_degrees`] and
/// [`context_degrees`] the model splits over, its graph traced and differentiated at those
/// degrees and the spec with its mesh (the data-parallel ranks left), `batch.per_rank` and
/// `batch.grad_accum` (the same tokens per step).
pub fn model_spaces(
    model: &shardplan_models::ModelConfig,
    base: &ParallelConfig,
    fixed: Fixed,
) -> Result<Vec<(JointGraph, ParallelConfig)>, PlanError> {
    let mut configs: Vec<ParallelConfig> = Vec::new();
    for c in context_degrees(model, base, fixed) {
        for t in tensor_degrees(base, fixed) {
            for e in expert_degrees(model, base, fixed) {
                for f in float8_options(base, fixed) {
                    configs.extend(space_config(base, fixed, (c, t, e)).map(|mut config| {
                        config.float8 = f.clone();
                        config
                    }));
                }
            }
        }
    }
    // Each degree traced and differentiated on a thread of its own.
    let traced: Vec<Result<Option<JointGraph>, PlanError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = configs
            .iter()
            .map(|config| {
                scope.spawn(move || {
                    // A degree the model's heads, widths or vocabulary do not split is not a
                    // candidate.
                    let Ok(g) = shardplan_models::trace(model, config.trace_options()) else {
                        return Ok(None);
                    };
                    shardplan_ir::differentiate_with(&g, config.diff_options())
                        .map(Some)
                        .map_err(|e| PlanError::Graph(e.to_string()))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(PlanError::Bug("a tracing thread panicked".into())))
            })
            .collect()
    });
    let mut spaces: Vec<(JointGraph, ParallelConfig)> = Vec::new();
    for (joint, config) in traced.into_iter().zip(configs) {
        if let Some(joint) = joint? {
            spaces.push((joint, config));
        }
    }
    if spaces.is_empty() {
        return Err(PlanError::Graph(
            "the model splits over no tensor- or expert-parallel degree the node and world allow".into(),
        ));
    }
    Ok(spaces)
}

/// `base` on a mesh of context degree `c`, tensor degree `t` and expert degree `e` over the
/// same world, with the batch that keeps its tokens per step: a tensor group shares its
/// sequences, so each data-parallel rank takes `t / base t` times the spec's; a context
/// group shares them too, and each rank keeps its micro-batch and accumulates `c / base c`
/// times as many (the smaller micro-batch is what a context axis is for). `None` where the
/// degrees do not divide.
fn space_config(base: &ParallelConfig, fixed: Fixed, (c, t, e): (u64, u64, u64)) -> Option<ParallelConfig> {
    let world = base.mesh.world();
    let replicate = if fixed.mesh_split { base.mesh.replicate } else { 1 };
    if !world.is_multiple_of(replicate * t * c) {
        return None;
    }
    let mut config = base.clone();
    config.mesh = MeshShape {
        pipeline: 1,
        replicate,
        shard: world / (replicate * t * c),
        context: c,
        tensor: t,
        expert: e,
    };
    if !config.mesh.shard.is_multiple_of(e) {
        return None;
    }
    let per_rank = base.batch.per_rank * t;
    let accum = base.batch.grad_accum * c;
    if !per_rank.is_multiple_of(base.mesh.tensor) || !accum.is_multiple_of(base.mesh.context) {
        return None;
    }
    config.batch.per_rank = per_rank / base.mesh.tensor;
    config.batch.grad_accum = accum / base.mesh.context;
    Some(config)
}

/// For the winner, one line per knob: what it bought against the best candidate that
/// differs from it in that knob alone (and whether that one fits `budget`, where known).
pub fn knob_effects(candidates: &[Candidate], budget: u64) -> Vec<String> {
    let Some(w) = candidates.first() else {
        return Vec::new();
    };
    let k = &w.knobs;
    type Get = fn(&Knobs) -> String;
    let knobs: [(&str, Get); 7] = [
        ("mesh", |k| k.mesh()),
        ("blocks per group", |k| k.blocks_per_group.to_string()),
        ("reshard_after_forward", |k| k.reshard_after_forward.clone()),
        ("prefetch", |k| {
            format!("{}/{}", k.prefetch_forward, k.prefetch_backward)
        }),
        ("activation_checkpointing", |k| k.activation_checkpointing.clone()),
        ("offload", |k| if k.offload { "cpu".into() } else { "none".into() }),
        ("float8", |k| k.float8.clone()),
    ];
    let mut out = Vec::new();
    for (i, (name, get)) in knobs.iter().enumerate() {
        let other = candidates.iter().skip(1).find(|c| {
            get(&c.knobs) != get(k)
                && knobs
                    .iter()
                    .enumerate()
                    .all(|(j, (_, g))| j == i || g(&c.knobs) == g(k))
        });
        if let Some(o) = other {
            let dt = (o.step_s - w.step_s) / o.step_s * 100.0;
            let dm = w.peak as f64 - o.peak as f64;
            out.push(format!(
                "{name} {} (vs {}): {:.1}% {} step, {} {} per rank{}",
                get(k),
                get(&o.knobs),
                dt.abs(),
                if dt >= 0.0 { "faster" } else { "slower" },
                crate::print::bytes(dm.abs() as u64),
                if dm >= 0.0 { "more" } else { "less" },
                match o.fits_budget(budget) {
                    Some(true) => "",
                    Some(false) => " (the alternative does not fit)",
                    None => " (the alternative's fit not replayed)",
                }
            ));
        }
    }
    out
}
