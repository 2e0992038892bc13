//! A run that cannot fit is refused before it allocates. On the CPU the host is the
//! device: every rank this host runs (the threads of this process, times the processes of
//! the job on this host) holds the plan's per-rank memory, and together they must fit in
//! the memory the host has available (`host::available_memory`: MemAvailable, or a
//! cgroup's limit where that leaves less). `SHARDPLAN_HOST_MEMORY=SIZE` (`16GiB`, bytes)
//! replaces the detected figure, for a share of a machine or for tests.
//!
//! On a GPU the plan's device pool (its allocated peak) of every rank on the device (all
//! of them as threads of one process, or the one rank of an NCCL process) must fit in what
//! the driver says is free once the CUDA context is up (`cuMemGetInfo`;
//! `SHARDPLAN_DEVICE_MEMORY=SIZE` replaces it), and offloaded state in the host's memory.
//! Both are checked before any weight is made.
//!
//! A refusal names the shortfall and the single spec changes that fit, each planned
//! (`planner::alternatives::plan_alternatives`), as `shardplan plan --memory-budget` does.

use crate::fmt::bytes;
use crate::CliError;
use candle_core::Device;
use shardplan_frontends::{ParallelConfig, SpecError};
use shardplan_models::ModelConfig;
use shardplan_planner::Plan;
use std::path::Path;

/// The variable that replaces the detected host memory.
pub const HOST_MEMORY_VAR: &str = "SHARDPLAN_HOST_MEMORY";
/// The variable that replaces the device's free memory.
pub const DEVICE_MEMORY_VAR: &str = "SHARDPLAN_DEVICE_MEMORY";

/// Bytes one rank of `plan` holds on the host when the host is the device: the device
/// pool's allocated peak plus the host pool's (CPU offload).
pub fn rank_bytes(plan: &Plan) -> u64 {
    plan.memory.peak.saturating_add(plan.memory.host.total())
}

/// Processes of this job on this host, as the launcher says (Open MPI's mpirun, torchrun
/// and `shardplan launch`, srun with a fixed count per node); 1 when none says.
fn processes_on_host() -> u64 {
    [
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "LOCAL_WORLD_SIZE",
        "SLURM_NTASKS_PER_NODE",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok()?.trim().parse::<u64>().ok())
    .filter(|&n| n > 0)
    .unwrap_or(1)
}

/// A size from `var` when it is set (`None` when it is not).
fn override_from(var: &str) -> Result<Option<(u64, String)>, CliError> {
    match std::env::var(var) {
        Ok(v) => {
            let n = crate::plan::parse_size(&v).map_err(|e| CliError::Usage(format!("{var}: {e}")))?;
            Ok(Some((n, format!("{var}={v}"))))
        }
        Err(_) => Ok(None),
    }
}

/// The host memory a run may use and where that figure comes from; `None` when it cannot
/// be known (then nothing is refused).
fn host_budget() -> Result<Option<(u64, String)>, CliError> {
    if let Some(o) = override_from(HOST_MEMORY_VAR)? {
        return Ok(Some(o));
    }
    Ok(shardplan_executor::host::available_memory().map(|m| (m.bytes, m.source)))
}

/// The device memory a run may use on `device` and where that figure comes from.
fn device_budget(device: &Device, name: &str) -> Result<Option<(u64, String)>, CliError> {
    if let Some(o) = override_from(DEVICE_MEMORY_VAR)? {
        return Ok(Some(o));
    }
    let free = shardplan_executor::runtime::device::free_memory(device)
        .map_err(|e| CliError::Usage(format!("--device {name}: {e}")))?;
    Ok(free.map(|(free, total)| {
        (
            free,
            format!("free of {} on {name}, as cuMemGetInfo says", bytes(total)),
        )
    }))
}

/// One memory the ranks of a run draw from: what each rank needs of it, how many ranks
/// share it, and how a refusal words it.
pub struct Pool<'a> {
    /// `host memory`, `memory on cuda:0`.
    pub what: String,
    pub budget: u64,
    /// Where `budget` comes from.
    pub source: String,
    /// Bytes one rank of a plan needs of it.
    pub per_rank: &'a dyn Fn(&Plan) -> u64,
    /// How many ranks of a plan share it, and how to say so.
    pub ranks: &'a dyn Fn(&Plan) -> (u64, String),
    /// What one rank's figure is made of.
    pub breakdown: &'a dyn Fn(&Plan) -> String,
    /// What runs out otherwise.
    pub consequence: &'a str,
    /// The change beyond the spec: more hosts, more GPUs.
    pub more: &'a str,
    /// The variable that overrides `budget`.
    pub var: &'a str,
}

/// What a run of `plan` needs of one pool.
struct Need {
    per_rank: u64,
    total: u64,
    who: String,
}

fn need(pool: &Pool, plan: &Plan) -> Need {
    let per_rank = (pool.per_rank)(plan);
    let (ranks, who) = (pool.ranks)(plan);
    Need {
        per_rank,
        total: per_rank.saturating_mul(ranks),
        who,
    }
}

/// A CPU rank's bytes: the device pool's allocated peak and what is offloaded.
fn host_breakdown(plan: &Plan) -> String {
    let mut parts = vec![format!("allocated peak {}", bytes(plan.memory.peak))];
    if plan.memory.host.total() > 0 {
        parts.push(format!("offloaded {}", bytes(plan.memory.host.total())));
    }
    parts.join(" + ")
}

/// Bytes one rank of `plan` needs on its GPU once the CUDA context is up (the free memory
/// it is checked against is measured after that): what the allocator reserves at the
/// peak (at least the allocated peak), plus NCCL's buffers where `nccl`.
pub fn gpu_rank_bytes(plan: &Plan, nccl: bool) -> u64 {
    let m = &plan.memory;
    m.reserved_peak
        .max(m.peak)
        .saturating_add(if nccl { m.overhead.nccl } else { 0 })
}

fn gpu_breakdown(plan: &Plan, nccl: bool) -> String {
    let m = &plan.memory;
    let mut s = format!(
        "reserved peak {} for an allocated peak of {}",
        bytes(m.reserved_peak.max(m.peak)),
        bytes(m.peak)
    );
    if nccl && m.overhead.nccl > 0 {
        s += &format!(" + NCCL buffers {}", bytes(m.overhead.nccl));
    }
    s
}

/// Refuses `plan` when its ranks need more of `pool` than it has. `model` and `config`
/// (the spec the plan was made from, as the executor runs it) give the alternatives;
/// `file` is the parallel spec or plan file the error points at.
pub fn refuse_over(
    pool: &Pool,
    plan: &Plan,
    model: &ModelConfig,
    config: &ParallelConfig,
    file: &Path,
) -> Result<(), CliError> {
    let n = need(pool, plan);
    if n.total <= pool.budget {
        return Ok(());
    }
    let message = format!(
        "the plan needs {} of {} ({} x {} per rank: {}), {} more than the {} available ({}); {}",
        bytes(n.total),
        pool.what,
        n.who,
        bytes(n.per_rank),
        (pool.breakdown)(plan),
        bytes(n.total - pool.budget),
        bytes(pool.budget),
        pool.source,
        pool.consequence,
    );
    // Single changes, planned; those that fit, in the order tried (the least disruptive
    // first), else the closest.
    let tried: Vec<(String, u64)> = shardplan_planner::alternatives::plan_alternatives(config)
        .into_iter()
        .filter_map(|a| {
            let graph = shardplan_models::trace(model, a.config.trace_options()).ok()?;
            let joint = shardplan_ir::differentiate_with(&graph, a.config.diff_options()).ok()?;
            let p = shardplan_planner::plan(&joint, &a.config).ok()?;
            Some((a.change, need(pool, &p).total))
        })
        .collect();
    let fits: Vec<String> = tried
        .iter()
        .filter(|t| t.1 <= pool.budget)
        .map(|(c, b)| format!("`{c}` ({})", bytes(*b)))
        .collect();
    let more = pool.more;
    let var = pool.var;
    let help = if let Some(first) = fits.first() {
        format!(
            "the nearest change that fits is {first}{}; or {more}. {var}=SIZE overrides the detected memory",
            if fits.len() > 1 {
                format!("; these fit too: {}", fits[1..].join("; "))
            } else {
                String::new()
            }
        )
    } else {
        match tried.iter().min_by_key(|t| t.1) {
            Some((c, b)) => format!(
                "no single change fits; the closest is `{c}` at {}: combine changes, use a smaller model, or {more}",
                bytes(*b)
            ),
            None => format!("use a smaller model, a shorter sequence or a smaller batch, or {more}"),
        }
    };
    Err(CliError::Input(SpecError::file(file, message).help(help)))
}

/// Refuses a run of `plan` on `device` whose ranks need more memory than the device (and,
/// for offloaded state, the host) has; `ranks_here` is how many ranks this process runs,
/// `device_name` the `--device` given. `model` and `config` (the spec the plan was made
/// from, as the executor runs it) give the alternatives; `file` is the parallel spec or
/// plan file the error points at.
pub fn check(
    plan: &Plan,
    ranks_here: usize,
    device: &Device,
    device_name: &str,
    model: &ModelConfig,
    config: &ParallelConfig,
    file: &Path,
) -> Result<(), CliError> {
    let all_here = ranks_here as u64 == plan.mesh.world();
    let processes = processes_on_host();
    let host_ranks = |p: &Plan| {
        if all_here {
            (
                p.mesh.world(),
                format!("{} rank(s) as threads of this process", p.mesh.world()),
            )
        } else {
            let n = ranks_here as u64 * processes;
            (n, format!("{n} process(es) of one rank on this host"))
        }
    };
    let host_more = if all_here {
        "run the ranks as processes on several hosts (mpirun, --backend mpi)"
    } else {
        "place fewer processes on each host"
    };
    if device.is_cpu() {
        let Some((budget, source)) = host_budget()? else {
            return Ok(());
        };
        let pool = Pool {
            what: "host memory".into(),
            budget,
            source,
            per_rank: &rank_bytes,
            ranks: &host_ranks,
            breakdown: &host_breakdown,
            consequence: "on the CPU the host is the device, and this run would be killed when memory runs out",
            more: host_more,
            var: HOST_MEMORY_VAR,
        };
        return refuse_over(&pool, plan, model, config, file);
    }
    if let Some((budget, source)) = device_budget(device, device_name)? {
        // Every rank of this process shares its one device (threads), or the process is one
        // rank on its own GPU (NCCL).
        let device_ranks = |p: &Plan| {
            if all_here {
                (
                    p.mesh.world(),
                    format!("{} rank(s) as threads on one GPU", p.mesh.world()),
                )
            } else {
                (ranks_here as u64, format!("{ranks_here} rank(s) on this GPU"))
            }
        };
        let pool = Pool {
            what: format!("memory on {device_name}"),
            budget,
            source,
            // One rank per process is the NCCL backend; threads share no NCCL communicator.
            per_rank: &|p: &Plan| gpu_rank_bytes(p, !all_here),
            ranks: &device_ranks,
            breakdown: &|p: &Plan| gpu_breakdown(p, !all_here),
            consequence: "the run would stop with CUDA out of memory",
            more: if all_here {
                "run one rank per GPU (--backend nccl under torchrun or `shardplan launch`)"
            } else {
                "spread the mesh over more GPUs"
            },
            var: DEVICE_MEMORY_VAR,
        };
        refuse_over(&pool, plan, model, config, file)?;
    }
    if plan.memory.host.total() > 0 {
        if let Some((budget, source)) = host_budget()? {
            let pool = Pool {
                what: "host memory for offloaded state".into(),
                budget,
                source,
                per_rank: &|p: &Plan| p.memory.host.total(),
                ranks: &host_ranks,
                breakdown: &|p: &Plan| format!("offloaded {}", bytes(p.memory.host.total())),
                consequence: "the host would run out of memory",
                more: host_more,
                var: HOST_MEMORY_VAR,
            };
            refuse_over(&pool, plan, model, config, file)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(text: &str) -> (ModelConfig, ParallelConfig, Plan) {
        let model = shardplan_models::preset("tiny-llama").unwrap();
        let (config, _) = shardplan_frontends::parse_parallel_spec(&shardplan_frontends::Source {
            path: "parallel.yaml".into(),
            text: text.into(),
        })
        .unwrap();
        let config = shardplan_executor::train::sharded::executor_config(&config);
        let graph = shardplan_models::trace(&model, config.trace_options()).unwrap();
        let joint = shardplan_ir::differentiate_with(&graph, config.diff_options()).unwrap();
        let plan = shardplan_planner::plan(&joint, &config).unwrap();
        (model, config, plan)
    }

    fn gpu<'a>(budget: u64, nccl: &'a dyn Fn(&Plan) -> u64, ranks: &'a dyn Fn(&Plan) -> (u64, String)) -> Pool<'a> {
        Pool {
            what: "memory on cuda:0".into(),
            budget,
            source: "free of 139.8 GiB on cuda:0, as cuMemGetInfo says".into(),
            per_rank: nccl,
            ranks,
            breakdown: &|p: &Plan| gpu_breakdown(p, false),
            consequence: "the run would stop with CUDA out of memory",
            more: "spread the mesh over more GPUs",
            var: DEVICE_MEMORY_VAR,
        }
    }

    fn refused(r: Result<(), CliError>) -> String {
        match r {
            Err(CliError::Input(e)) => format!("{e:?} {e}"),
            other => panic!("not refused as bad input: {}", other.is_ok()),
        }
    }

    /// A GPU's pool counts what the allocator reserves at the peak for every rank on it,
    /// NCCL's buffers only for a process's one rank; the refusal names the device, the
    /// shortfall, and changes judged by the same count.
    #[test]
    fn a_gpu_pool_counts_the_reserved_peak_of_its_ranks() {
        let (model, config, plan) = planned(
            "mesh: {replicate: 1, shard: 2}\ngpus_per_node: 2\nmixed_precision: {param: f32, reduce: f32}\nbatch: {per_rank: 4, seq_len: 64}\nreshard_after_forward: false\n",
        );
        let m = &plan.memory;
        assert!(m.reserved_peak >= m.peak && m.overhead.nccl > 0, "{m:?}");
        assert_eq!(gpu_rank_bytes(&plan, false), m.reserved_peak);
        assert_eq!(gpu_rank_bytes(&plan, true), m.reserved_peak + m.overhead.nccl);
        let per = |p: &Plan| gpu_rank_bytes(p, false);
        let threads = |p: &Plan| {
            (
                p.mesh.world(),
                format!("{} rank(s) as threads on one GPU", p.mesh.world()),
            )
        };
        let file = Path::new("parallel.yaml");
        let need = m.reserved_peak * 2;
        refuse_over(&gpu(need, &per, &threads), &plan, &model, &config, file).unwrap();
        let e = refused(refuse_over(
            &gpu(need - 1, &per, &threads),
            &plan,
            &model,
            &config,
            file,
        ));
        assert!(
            e.contains("of memory on cuda:0 (2 rank(s) as threads on one GPU x")
                && e.contains("reserved peak")
                && e.contains("1 B more than the")
                && e.contains("CUDA out of memory")
                && e.contains("parallel.yaml"),
            "{e}"
        );
        assert!(!e.contains("offloaded"), "{e}");
        // One rank on the GPU: half the need, so the same budget fits.
        let one = |_: &Plan| (1, "1 rank(s) on this GPU".to_string());
        refuse_over(&gpu(need - 1, &per, &one), &plan, &model, &config, file).unwrap();
    }

    /// Offloaded optimizer state is the host's, and a CPU rank counts both.
    #[test]
    fn offloaded_state_is_the_hosts() {
        let (_, _, plan) = planned(
            "mesh: {replicate: 1, shard: 2}\ngpus_per_node: 2\nbatch: {per_rank: 2, seq_len: 32}\noffload: cpu\n",
        );
        let m = &plan.memory;
        assert!(m.host.total() > 0);
        assert_eq!(rank_bytes(&plan), m.peak + m.host.total());
        assert_eq!(
            host_breakdown(&plan),
            format!("allocated peak {} + offloaded {}", bytes(m.peak), bytes(m.host.total()))
        );
        assert!(!gpu_breakdown(&plan, false).contains("offloaded"));
    }
}
