//! A CPU run that cannot fit is refused before it allocates. On the CPU the host is the
//! device: every rank this host runs (the threads of this process, times the processes of
//! the job on this host) holds the plan's per-rank memory, and together they must fit in
//! the memory the host has available (`cpu::host::available_memory`: MemAvailable, or a
//! cgroup's limit where that leaves less). `SHARDPLAN_HOST_MEMORY=SIZE` (`16GiB`, bytes)
//! replaces the detected figure, for a share of a machine or for tests.
//!
//! A refusal names the shortfall and the single spec changes that fit, each planned
//! (`planner::alternatives::plan_alternatives`), as `shardplan plan --memory-budget` does.

use crate::fmt::bytes;
use crate::CliError;
use shardplan_frontends::{ParallelConfig, SpecError};
use shardplan_models::ModelConfig;
use shardplan_planner::Plan;
use std::path::Path;

/// The variable that replaces the detected host memory.
pub const HOST_MEMORY_VAR: &str = "SHARDPLAN_HOST_MEMORY";

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

/// The host memory a run may use and where that figure comes from; `None` when it cannot
/// be known (then nothing is refused).
fn host_budget() -> Result<Option<(u64, String)>, CliError> {
    if let Ok(v) = std::env::var(HOST_MEMORY_VAR) {
        let n = crate::plan::parse_size(&v).map_err(|e| CliError::Usage(format!("{HOST_MEMORY_VAR}: {e}")))?;
        return Ok(Some((n, format!("{HOST_MEMORY_VAR}={v}"))));
    }
    Ok(shardplan_executor::cpu::host::available_memory().map(|m| (m.bytes, m.source)))
}

/// What a CPU run of `plan` needs against what the host has.
struct Need {
    ranks: u64,
    per_rank: u64,
    total: u64,
}

fn need(plan: &Plan, ranks: u64) -> Need {
    let per_rank = rank_bytes(plan);
    Need {
        ranks,
        per_rank,
        total: per_rank.saturating_mul(ranks),
    }
}

/// Refuses a CPU run of `plan` whose ranks on this host need more memory than it has;
/// `ranks_here` is how many ranks this process runs. `model` and `config` (the spec the
/// plan was made from, as the executor runs it) give the alternatives; `file` is the
/// parallel spec or plan file the error points at.
pub fn check(
    plan: &Plan,
    ranks_here: usize,
    model: &ModelConfig,
    config: &ParallelConfig,
    file: &Path,
) -> Result<(), CliError> {
    let Some((budget, source)) = host_budget()? else {
        return Ok(());
    };
    let all_here = ranks_here as u64 == plan.mesh.world();
    let processes = processes_on_host();
    let ranks_on_host = |p: &Plan| {
        if all_here {
            p.mesh.world()
        } else {
            ranks_here as u64 * processes
        }
    };
    let n = need(plan, ranks_on_host(plan));
    if n.total <= budget {
        return Ok(());
    }
    let who = if all_here {
        format!("{} rank(s) as threads of this process", n.ranks)
    } else {
        format!("{} process(es) of one rank on this host", n.ranks)
    };
    let message = format!(
        "the plan needs {} of host memory ({who} x {} per rank: allocated peak {}{}), {} more than the {} available ({source}); on the CPU the host is the device, and this run would be killed when memory runs out",
        bytes(n.total),
        bytes(n.per_rank),
        bytes(plan.memory.peak),
        if plan.memory.host.total() > 0 {
            format!(" + offloaded {}", bytes(plan.memory.host.total()))
        } else {
            String::new()
        },
        bytes(n.total - budget),
        bytes(budget),
    );
    // Single changes, planned; those that fit, in the order tried (the least disruptive
    // first), else the closest.
    let tried: Vec<(String, u64)> = shardplan_planner::alternatives::plan_alternatives(config)
        .into_iter()
        .filter_map(|a| {
            let graph = shardplan_models::trace(model, a.config.trace_options()).ok()?;
            let joint = shardplan_ir::differentiate_with(&graph, a.config.diff_options()).ok()?;
            let p = shardplan_planner::plan(&joint, &a.config).ok()?;
            Some((a.change, need(&p, ranks_on_host(&p)).total))
        })
        .collect();
    let fits: Vec<String> = tried
        .iter()
        .filter(|t| t.1 <= budget)
        .map(|(c, b)| format!("`{c}` ({})", bytes(*b)))
        .collect();
    let more = if all_here {
        "run the ranks as processes on several hosts (mpirun, --backend mpi)"
    } else {
        "place fewer processes on each host"
    };
    let help = if let Some(first) = fits.first() {
        format!(
            "the nearest change that fits is {first}{}; or {more}. {HOST_MEMORY_VAR}=SIZE overrides the detected memory",
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
