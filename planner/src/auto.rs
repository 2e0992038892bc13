//! Auto-planning: search the knobs the user left open for the fastest plan that fits a
//! per-rank memory budget.
//!
//! The space: mesh split (replicate x shard of the fixed world, the shard axis a divisor or
//! a multiple of `gpus_per_node`), bucketing of consecutive blocks (1, 2 or 4 per group),
//! `reshard_after_forward` (true, the node size, false), forward and backward prefetch
//! (1 or 2 each), activation checkpointing (full, every 2nd block, selective by op, none),
//! and CPU offload
//! only when nothing else fits. Every candidate is a full plan (groups, schedule,
//! simulation), so the objective is the cost model's step time; ties go to lower memory.
//! Candidates share the compute steps of equal groups and checkpointing; the winner is
//! planned again from scratch and verified.
//!
//! A candidate fits when its device total (the caching allocator's reserved peak, the CUDA
//! context, NCCL's buffers) is within the budget. Fragmentation makes the reserved peak
//! no monotone function of a knob, but the allocated peak is, and no plan needs less than
//! its allocated peak plus the CUDA context; the pruning rules cut on that bound (each
//! sound because allocated memory is monotone in the knob, other knobs equal):
//! - checkpointing is tried from most to least saving (full; every 2 and selective, which
//!   are not ordered against each other; none); once no candidate of a level is within the
//!   bound, the levels that keep more are skipped (none after either middle level,
//!   everything after full);
//! - resharding is tried from most to least freeing (true, node size, false); once no
//!   candidate of one is within the bound, the rest are skipped;
//! - prefetch is tried from (1, 1) upward; if (1, 1) is not within the bound, deeper ones
//!   are skipped.
//!
//! A test compares the pruned search with exhaustive enumeration on small models.

use crate::plan::Plan;
use crate::{plan, plan_passes, simulate, PlanCache, PlanError};
use serde::{Deserialize, Serialize};
use shardplan_frontends::{
    ActivationCheckpointing, HardwareProfile, MeshShape, Offload, Origin, ParallelConfig, Prefetch, Reshard,
};
use shardplan_ir::{JointGraph, ModuleKind};

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
}

/// Nothing fits the budget.
#[derive(Clone, Debug)]
pub struct NoFit {
    /// The lowest-memory candidate found.
    pub best: Candidate,
    pub budget: u64,
}

fn reshard_name(r: Reshard) -> String {
    match r {
        Reshard::AfterForward => "true".into(),
        Reshard::Keep => "false".into(),
        Reshard::ToGroupOf(n) => n.to_string(),
    }
}

/// Checkpointing levels by the activation memory they keep: a level keeps at least as much
/// as every level of a lower rank (every 2nd block and selective are not ordered).
fn ac_memory_rank(a: ActivationCheckpointing) -> u8 {
    match a {
        ActivationCheckpointing::Full => 0,
        ActivationCheckpointing::Every(_) | ActivationCheckpointing::Selective(_) => 1,
        ActivationCheckpointing::None => 2,
    }
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

/// Searches the open knobs of `base` for the fastest plan within `budget` bytes per rank.
/// `prune` applies the module's pruning rules (tests turn it off to compare).
pub fn search(
    joint: &JointGraph,
    base: &ParallelConfig,
    fixed: Fixed,
    budget: u64,
    prune: bool,
) -> Result<Result<AutoResult, NoFit>, PlanError> {
    let world = base.mesh.world();
    let gpn = base.gpus_per_node;
    let splits: Vec<MeshShape> = if fixed.mesh_split {
        vec![base.mesh]
    } else {
        (1..=world)
            .filter(|s| world.is_multiple_of(*s) && (s.is_multiple_of(gpn) || gpn.is_multiple_of(*s)))
            .map(|shard| MeshShape {
                replicate: world / shard,
                shard,
            })
            .collect()
    };
    let has_blocks = joint.graph.scopes().any(|(_, s)| s.kind == ModuleKind::Block);
    // (blocks per group, bucket_mib); 0 blocks: as the spec says.
    let bucket_options: Vec<(u64, Option<u64>)> =
        if fixed.bucketing || !has_blocks || !base.wrap.contains(&ModuleKind::Block) {
            vec![(0, base.bucket_mib)]
        } else {
            let bb = block_bytes(joint, base.mixed_precision.param);
            vec![
                (1, None),
                (2, Some((2 * bb).div_ceil(1 << 20))),
                (4, Some((4 * bb).div_ceil(1 << 20))),
            ]
        };
    let ac_options: Vec<ActivationCheckpointing> = if fixed.checkpointing || !has_blocks {
        vec![base.activation_checkpointing]
    } else {
        vec![
            ActivationCheckpointing::Full,
            ActivationCheckpointing::Every(2),
            ActivationCheckpointing::Selective(shardplan_frontends::SavePolicy::TORCHTITAN),
            ActivationCheckpointing::None,
        ]
    };
    let prefetch_options: Vec<(u32, u32)> = if fixed.prefetch {
        vec![(base.prefetch.forward, base.prefetch.backward)]
    } else {
        vec![(1, 1), (1, 2), (2, 1), (2, 2)]
    };
    let offloads: Vec<Offload> = if fixed.offload {
        vec![base.offload]
    } else {
        vec![Offload::None, Offload::Cpu]
    };

    let mut cache = PlanCache::default();
    let mut candidates: Vec<(Candidate, ParallelConfig)> = Vec::new();
    let (mut evaluated, mut pruned) = (0usize, 0usize);
    for &offload in &offloads {
        if offload == Offload::Cpu && candidates.iter().any(|c| c.0.fits) {
            break; // offload only when nothing else fits
        }
        for &mesh in &splits {
            let reshard_options: Vec<Reshard> = if fixed.reshard {
                vec![base.reshard_after_forward]
            } else {
                let mut v = vec![Reshard::AfterForward];
                if gpn > 1 && gpn < mesh.shard && mesh.shard.is_multiple_of(gpn) {
                    v.push(Reshard::ToGroupOf(gpn));
                }
                v.push(Reshard::Keep);
                v
            };
            for &(blocks, bucket) in &bucket_options {
                'reshard: for (ri, &reshard) in reshard_options.iter().enumerate() {
                    let mut any_within_this_reshard = false;
                    // The memory rank of the lightest checkpointing level none of whose
                    // candidates was within the bound.
                    let mut failed_rank: Option<u8> = None;
                    for &ac in &ac_options {
                        if prune && failed_rank.is_some_and(|f| ac_memory_rank(ac) > f) {
                            pruned += prefetch_options.len();
                            continue;
                        }
                        let mut any_within_this_ac = false;
                        for (pi, &(pf, pb)) in prefetch_options.iter().enumerate() {
                            let mut c = base.clone();
                            c.mesh = mesh;
                            c.bucket_mib = bucket;
                            c.reshard_after_forward = reshard;
                            c.activation_checkpointing = ac;
                            c.prefetch = Prefetch {
                                forward: pf,
                                backward: pb,
                                ..base.prefetch.clone()
                            };
                            c.offload = offload;
                            let (mut p, steps) = plan_passes(joint, &c, &mut cache, false, false)?;
                            evaluated += 1;
                            // The allocator replay costs more than the rest of a candidate;
                            // it runs only where the bound leaves the fit open.
                            let lower = p.memory.peak.saturating_add(p.memory.overhead.total());
                            let device_exact = lower <= budget;
                            if device_exact {
                                p.memory = replayed(&p, &steps.acts);
                            }
                            let device = if device_exact { p.memory.device_total } else { lower };
                            let fits = device_exact && device <= budget;
                            // No plan with more memory of this knob fits either.
                            let beyond = p.memory.peak.saturating_add(p.memory.overhead.cuda_context) > budget;
                            candidates.push((
                                Candidate {
                                    knobs: Knobs {
                                        replicate: mesh.replicate,
                                        shard: mesh.shard,
                                        blocks_per_group: blocks,
                                        reshard_after_forward: reshard_name(reshard),
                                        prefetch_forward: pf,
                                        prefetch_backward: pb,
                                        activation_checkpointing: ac_name(ac),
                                        offload: offload == Offload::Cpu,
                                    },
                                    step_s: p.estimate.step_s,
                                    mfu: p.estimate.mfu,
                                    exposed_comm_s: p.estimate.exposed_comm_s,
                                    peak: p.memory.peak,
                                    device,
                                    device_exact,
                                    fits,
                                },
                                c,
                            ));
                            any_within_this_ac |= !beyond;
                            if prune && beyond && pi == 0 {
                                pruned += prefetch_options.len() - 1;
                                break;
                            }
                        }
                        any_within_this_reshard |= any_within_this_ac;
                        if !any_within_this_ac {
                            let r = ac_memory_rank(ac);
                            failed_rank = Some(failed_rank.map_or(r, |f| f.min(r)));
                        }
                    }
                    if prune && !any_within_this_reshard {
                        let left = reshard_options.len() - ri - 1;
                        pruned += left * ac_options.len() * prefetch_options.len();
                        break 'reshard;
                    }
                }
            }
        }
    }
    // Best first: fitting before not, then faster, then smaller; stable for equal keys.
    candidates.sort_by(|a, b| {
        (!a.0.fits)
            .cmp(&!b.0.fits)
            .then(a.0.step_s.total_cmp(&b.0.step_s))
            .then(a.0.device.cmp(&b.0.device))
    });
    match candidates.first() {
        Some((c, config)) if c.fits => {
            let config = config.clone();
            let winner = plan(joint, &config)?;
            Ok(Ok(AutoResult {
                winner,
                config,
                candidates: candidates.into_iter().map(|c| c.0).collect(),
                evaluated,
                pruned,
            }))
        }
        _ => {
            // The least device memory of any candidate: replay the one with the least bound
            // until the least is exact (a bound never exceeds its candidate's total).
            loop {
                let (i, least) = candidates
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, c)| c.0.device)
                    .ok_or_else(|| PlanError::Graph("the search space is empty".into()))?;
                if least.0.device_exact {
                    return Ok(Err(NoFit {
                        best: least.0.clone(),
                        budget,
                    }));
                }
                let (p, steps) = plan_passes(joint, &candidates[i].1, &mut cache, false, false)?;
                let m = replayed(&p, &steps.acts);
                let c = &mut candidates[i].0;
                (c.device, c.device_exact) = (m.device_total, true);
            }
        }
    }
}

/// `p`'s memory with the caching allocator replayed over its program.
fn replayed(p: &Plan, acts: &crate::ActEvents) -> crate::MemoryReport {
    simulate::device_memory(
        p.memory.clone(),
        &p.programs[0],
        &p.buffers,
        acts,
        &p.mesh,
        &p.hardware,
        p.policy.allocator,
    )
}

/// For the winner, one line per knob: what it bought against the best candidate that
/// differs from it in that knob alone.
pub fn knob_effects(candidates: &[Candidate]) -> Vec<String> {
    let Some(w) = candidates.first() else {
        return Vec::new();
    };
    let k = &w.knobs;
    type Get = fn(&Knobs) -> String;
    let knobs: [(&str, Get); 6] = [
        ("mesh", |k| format!("{}x{}", k.replicate, k.shard)),
        ("blocks per group", |k| k.blocks_per_group.to_string()),
        ("reshard_after_forward", |k| k.reshard_after_forward.clone()),
        ("prefetch", |k| {
            format!("{}/{}", k.prefetch_forward, k.prefetch_backward)
        }),
        ("activation_checkpointing", |k| k.activation_checkpointing.clone()),
        ("offload", |k| if k.offload { "cpu".into() } else { "none".into() }),
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
                if o.fits { "" } else { " (the alternative does not fit)" }
            ));
        }
    }
    out
}

/// The parallel spec of `c` as YAML (the fields the planner and trainer read), so a run
/// is reproducible without `--auto`.
pub fn spec_yaml(c: &ParallelConfig) -> String {
    let hw = &c.hardware;
    let builtin = shardplan_frontends::HARDWARE_NAMES
        .iter()
        .find(|n| shardplan_frontends::builtin_hardware(n).as_ref() == Some(hw));
    let hardware = match builtin {
        Some(n) => n.to_string(),
        None => {
            let nums: Vec<String> = hw.numbers().iter().map(|(k, v)| format!("{k}: {v:?}")).collect();
            // The name as a quoted scalar (a JSON string is one in YAML): it may hold `:`
            // or `,`.
            let name = serde_json::to_string(&hw.name).unwrap_or_else(|_| "\"custom\"".into());
            format!("{{name: {name}, kernels: {}, {}}}", hw.kernels.name(), nums.join(", "))
        }
    };
    let wrap: Vec<&str> = c.wrap.iter().map(|k| k.name()).collect();
    let reshard = reshard_name(c.reshard_after_forward);
    let ac = match c.activation_checkpointing {
        ActivationCheckpointing::None => "none".to_string(),
        ActivationCheckpointing::Full => "full".to_string(),
        ActivationCheckpointing::Every(n) => format!("{{every: {n}}}"),
        ActivationCheckpointing::Selective(p) if p == shardplan_frontends::SavePolicy::TORCHTITAN => {
            "selective".to_string()
        }
        ActivationCheckpointing::Selective(p) => format!("{{selective: {{save: [{}]}}}}", p.names().join(", ")),
    };
    let optimizer = match c.optimizer {
        shardplan_frontends::Optimizer::AdamW {
            lr,
            betas,
            eps,
            weight_decay,
        } => format!(
            "{{adamw: {{lr: {lr:?}, betas: [{:?}, {:?}], eps: {eps:?}, weight_decay: {weight_decay:?}}}}}",
            betas[0], betas[1]
        ),
        shardplan_frontends::Optimizer::Sgd {
            lr,
            momentum,
            weight_decay,
        } => format!("{{sgd: {{lr: {lr:?}, momentum: {momentum:?}, weight_decay: {weight_decay:?}}}}}"),
    };
    let mut y = String::new();
    y.push_str("# Written by `shardplan plan --auto --emit-spec`.\n");
    y.push_str(&format!(
        "mesh: {{replicate: {}, shard: {}}}\n",
        c.mesh.replicate, c.mesh.shard
    ));
    y.push_str(&format!("gpus_per_node: {}\n", c.gpus_per_node));
    y.push_str(&format!("hardware: {hardware}\n"));
    if !c.runtime.is_shardplan() {
        y.push_str(&format!("runtime: {}\n", c.runtime.name()));
    }
    y.push_str(&format!("wrap: [{}]\n", wrap.join(", ")));
    if !c.wrap_modules.is_empty() {
        y.push_str(&format!("wrap_modules: [{}]\n", c.wrap_modules.join(", ")));
    }
    if let Some(b) = c.bucket_mib {
        y.push_str(&format!("bucket_mib: {b}\n"));
    }
    y.push_str(&format!("reshard_after_forward: {reshard}\n"));
    y.push_str(&format!(
        "prefetch: {{forward: {}, backward: {}}}\n",
        c.prefetch.forward, c.prefetch.backward
    ));
    y.push_str(&format!(
        "mixed_precision: {{param: {}, reduce: {}}}\n",
        c.mixed_precision.param, c.mixed_precision.reduce
    ));
    y.push_str(&format!(
        "offload: {}\n",
        if c.offload == Offload::Cpu { "cpu" } else { "none" }
    ));
    y.push_str(&format!("activation_checkpointing: {ac}\n"));
    let seq = c.batch.seq_len.map(|s| format!(", seq_len: {s}")).unwrap_or_default();
    let sync = match c.batch.grad_sync {
        shardplan_frontends::GradSync::EveryMicroBatch => "every_micro_batch",
        shardplan_frontends::GradSync::FinalMicroBatch => "final_micro_batch",
    };
    y.push_str(&format!(
        "batch: {{per_rank: {}{seq}, grad_accum: {}, grad_sync: {sync}}}\n",
        c.batch.per_rank, c.batch.grad_accum
    ));
    y.push_str(&format!("optimizer: {optimizer}\n"));
    match c.grad_clip {
        Some(g) => y.push_str(&format!("grad_clip: {g:?}\n")),
        None => y.push_str("grad_clip: null\n"),
    }
    y.push_str(&format!("seed: {}\n", c.seed));
    if !c.allocator.is_default() {
        y.push_str(&format!(
            "allocator: {{expandable_segments: {}}}\n",
            c.allocator.expandable_segments
        ));
    }
    y.push_str(&format!(
        "lr_schedule: {{warmup_steps: {}, min_lr_ratio: {:?}}}\n",
        c.lr_schedule.warmup_steps, c.lr_schedule.min_lr_ratio
    ));
    match &c.data {
        shardplan_frontends::DataSource::Synthetic => y.push_str("data: synthetic\n"),
        shardplan_frontends::DataSource::Tokens { path, dtype, eval } => {
            let eval = eval.as_ref().map_or(String::new(), |e| {
                format!(
                    ", val: {:?}, eval_every: {}, eval_batches: {}",
                    e.path.display().to_string(),
                    e.every,
                    e.batches
                )
            });
            y.push_str(&format!(
                "data: {{tokens: {:?}, dtype: {}{eval}}}\n",
                path.display().to_string(),
                match dtype {
                    shardplan_frontends::TokenDType::U16 => "u16",
                    shardplan_frontends::TokenDType::U32 => "u32",
                }
            ))
        }
    }
    y
}
