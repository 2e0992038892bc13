//! The engines a sharded run's ranks run on, one entry point each: every rank of the mesh
//! as a thread of this process (`Threads`), one CPU rank per process over MPI (`Mpi`,
//! feature `mpi`), one GPU rank per process over NCCL (`Nccl`, feature `cuda`). Each
//! starts what its processes share (the MPI world; NCCL's process world, over which the
//! communicators' unique ids are exchanged) and places a plan's ranks
//! (`Engine::place`); `shardplan train` picks one from its arguments and runs the same
//! training loop on any.

use crate::comm::Placement;
use crate::ExecError;
use candle_core::Device;
use shardplan_planner::Plan;

/// Places a plan's ranks for this process.
pub trait Engine {
    /// The ranks of `plan` this process runs on `device`, with their communicators.
    fn place(&self, plan: &Plan, device: &Device) -> Result<Placement, ExecError>;
}

/// Every rank of the mesh as a thread of this process, collectives in memory.
pub struct Threads;

impl Engine for Threads {
    fn place(&self, plan: &Plan, _device: &Device) -> Result<Placement, ExecError> {
        Ok(crate::comm::local::place(plan))
    }
}

/// One CPU rank per process, collectives over MPI; the process was started by mpirun or
/// srun.
#[cfg(feature = "mpi")]
pub struct Mpi {
    pub world: crate::comm::mpi::MpiWorld,
}

#[cfg(feature = "mpi")]
impl Mpi {
    /// Initialises MPI and checks that the launcher's world is MPI's.
    pub fn start(env: Option<&crate::comm::env::ProcessEnv>) -> Result<Mpi, ExecError> {
        let world = crate::comm::mpi::MpiWorld::init()?;
        if let Some(e) = env {
            if e.world_size != world.size {
                return Err(ExecError::Unsupported(format!(
                    "{} says {} processes, MPI says {}: start the ranks with mpirun or srun, not {}",
                    e.launcher.name(),
                    e.world_size,
                    world.size,
                    e.launcher.name()
                )));
            }
        }
        Ok(Mpi { world })
    }

    /// Stops every process of the job with `code` (a failed rank must not leave the
    /// others waiting on it).
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}

#[cfg(feature = "mpi")]
impl Engine for Mpi {
    fn place(&self, plan: &Plan, _device: &Device) -> Result<Placement, ExecError> {
        crate::comm::mpi::place(&self.world, plan)
    }
}

/// One GPU rank per process, collectives over NCCL on their own CUDA streams. The
/// processes agree on the communicators' unique ids and on step figures over TCP (torchrun,
/// `shardplan launch`) or MPI (mpirun, srun; needs the `mpi` feature too).
#[cfg(feature = "cuda")]
pub struct Nccl {
    rank: u64,
    processes: std::sync::Mutex<Option<Box<dyn crate::comm::Collectives>>>,
    abort: std::sync::Arc<crate::comm::Abort>,
    /// The CUDA device this process runs on: GPU `LOCAL_RANK` unless one was named.
    pub device: String,
    // MPI stays initialised until the run ends (dropping the world finalises it).
    #[cfg(feature = "mpi")]
    _mpi: Option<crate::comm::mpi::MpiWorld>,
}

#[cfg(feature = "cuda")]
impl Nccl {
    /// Joins the process world the launcher started (`env`; none: a single process) with
    /// `timeout` for every collective; `device` is `--device` (`cuda` takes the node's GPU
    /// `LOCAL_RANK`). `who` prefixes messages (`rank R of N: `).
    pub fn start(
        env: Option<&crate::comm::env::ProcessEnv>,
        device: &str,
        timeout: std::time::Duration,
        who: &str,
    ) -> Result<Nccl, ExecError> {
        use crate::comm::{tcp::TcpWorld, Abort, Collectives};
        if !device.starts_with("cuda") {
            return Err(ExecError::Unsupported(format!(
                "{who}--backend nccl runs each rank on a GPU, not on `{device}`: give --device cuda"
            )));
        }
        let device = match (device, env) {
            ("cuda", Some(e)) => format!("cuda:{}", e.local_rank),
            (d, _) => d.to_string(),
        };
        let abort = std::sync::Arc::new(Abort::default());
        abort.set_timeout(timeout);
        #[cfg(feature = "mpi")]
        let mut mpi = None;
        let (rank, processes): (u64, Option<Box<dyn Collectives>>) = match env {
            None => (0, None),
            Some(e) => match (&e.torchrun, e.launcher) {
                (Some(d), _) => (e.rank, Some(Box::new(TcpWorld::connect(d, abort.clone())?))),
                #[cfg(feature = "mpi")]
                (None, _) => {
                    let world: &mut crate::comm::mpi::MpiWorld = mpi.insert(crate::comm::mpi::MpiWorld::init()?);
                    (e.rank, Some(Box::new(world.process_group(abort.clone()))))
                }
                #[cfg(not(feature = "mpi"))]
                (None, launcher) => {
                    return Err(ExecError::Unsupported(format!(
                        "{who}under {}, the NCCL backend agrees on its ids over MPI, and this shardplan was built without it: build with `--features cuda,mpi`, or start the ranks with `shardplan launch` or torchrun",
                        launcher.name()
                    )))
                }
            },
        };
        Ok(Nccl {
            rank,
            processes: std::sync::Mutex::new(processes),
            abort,
            device,
            #[cfg(feature = "mpi")]
            _mpi: mpi,
        })
    }
}

#[cfg(feature = "cuda")]
impl Engine for Nccl {
    /// Places this process's one rank; the process world moves into the placement, so a
    /// run places once.
    fn place(&self, plan: &Plan, device: &Device) -> Result<Placement, ExecError> {
        let procs = self.processes.lock().unwrap_or_else(|e| e.into_inner()).take();
        crate::comm::nccl::device::place(plan, self.rank, device, procs, self.abort.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Threads place every rank of the mesh in this process.
    #[test]
    fn threads_place_every_rank_here() {
        let model = shardplan_models::preset("tiny-llama").unwrap();
        let (config, _) = shardplan_frontends::parse_parallel_spec(&shardplan_frontends::Source {
            path: "p.yaml".into(),
            text: "mesh: {replicate: 1, shard: 4}\ngpus_per_node: 4\nbatch: {per_rank: 1, seq_len: 16}\n".into(),
        })
        .unwrap();
        let config = crate::train::sharded::executor_config(&config);
        let graph = shardplan_models::trace(&model, config.trace_options()).unwrap();
        let joint = shardplan_ir::differentiate_with(&graph, config.diff_options()).unwrap();
        let plan = shardplan_planner::plan(&joint, &config).unwrap();
        let p = Threads.place(&plan, &Device::Cpu).unwrap();
        assert_eq!(p.ranks.iter().map(|r| r.0).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    }
}
