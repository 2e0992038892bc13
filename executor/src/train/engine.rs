//! The engines a sharded run's ranks run on, one entry point each: every rank of the mesh
//! as a thread of this process (`Threads`), one CPU rank per process over MPI (`Mpi`, in
//! the `shardplan-mpi` crate), one GPU rank per process over NCCL (`Nccl`, feature
//! `cuda`). Each
//! starts what its processes share (the MPI world; NCCL's process world, over which the
//! communicators' unique ids are exchanged) and places a plan's ranks
//! (`Engine::place`); `shardplan train` picks one from its arguments and runs the same
//! training loop on any.

use crate::comm::Placement;
use crate::train::pipeline::PipelinePlacement;
use crate::ExecError;
use candle_core::Device;
use shardplan_frontends::MeshShape;
use shardplan_planner::Plan;

/// Places a plan's ranks for this process.
pub trait Engine {
    /// The ranks of `plan` this process runs on `device`, with their communicators.
    fn place(&self, plan: &Plan, device: &Device) -> Result<Placement, ExecError>;

    /// The ranks of a pipeline `mesh` this process runs on `device`, with their groups and
    /// links.
    fn place_pipeline(&self, mesh: &MeshShape, device: &Device) -> Result<PipelinePlacement, ExecError> {
        let _ = (mesh, device);
        Err(ExecError::Unsupported(
            "pipeline training runs on threads (--backend local) or over MPI (--backend mpi), not on this backend yet"
                .into(),
        ))
    }
}

/// Every rank of the mesh as a thread of this process, collectives in memory.
pub struct Threads;

impl Engine for Threads {
    fn place(&self, plan: &Plan, _device: &Device) -> Result<Placement, ExecError> {
        Ok(crate::comm::local::place(plan))
    }

    fn place_pipeline(&self, mesh: &MeshShape, _device: &Device) -> Result<PipelinePlacement, ExecError> {
        Ok(crate::train::pipeline::place_threads(mesh))
    }
}

/// The processes of a launch joined as one group (`group`), and what must live as long as
/// it (`keep`: for MPI, its world, finalised when dropped).
pub struct JoinedProcesses {
    pub group: Box<dyn crate::comm::Collectives>,
    pub keep: Box<dyn std::any::Any + Send + Sync>,
}

/// How a launch without torchrun's rendezvous (mpirun, srun) joins its processes: given by
/// the caller that has an MPI backend (the `shardplan-mpi` crate's `process_world`).
pub type JoinProcesses = Box<dyn FnOnce(std::sync::Arc<crate::comm::Abort>) -> Result<JoinedProcesses, ExecError>>;

/// One GPU rank per process, collectives over NCCL on their own CUDA streams. The
/// processes agree on the communicators' unique ids and on step figures over TCP (torchrun,
/// `shardplan launch`) or MPI (mpirun, srun; joined by the caller's [`JoinProcesses`]).
#[cfg(feature = "cuda")]
pub struct Nccl {
    rank: u64,
    processes: std::sync::Mutex<Option<Box<dyn crate::comm::Collectives>>>,
    abort: std::sync::Arc<crate::comm::Abort>,
    /// The CUDA device this process runs on: GPU `LOCAL_RANK` unless one was named.
    pub device: String,
    // What the process group needs alive until the run ends (MPI's world: dropping it
    // finalises MPI).
    _keep: Option<Box<dyn std::any::Any + Send + Sync>>,
}

#[cfg(feature = "cuda")]
impl Nccl {
    /// Joins the process world the launcher started (`env`; none: a single process) with
    /// `timeout` for every collective; `device` is `--device` (`cuda` takes the node's GPU
    /// `LOCAL_RANK`). `who` prefixes messages (`rank R of N: `). Under mpirun or srun the
    /// processes join with `over_mpi` (`None`: a build without MPI, which refuses).
    pub fn start(
        env: Option<&crate::comm::env::ProcessEnv>,
        device: &str,
        timeout: std::time::Duration,
        who: &str,
        over_mpi: Option<JoinProcesses>,
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
        let mut keep = None;
        let (rank, processes): (u64, Option<Box<dyn Collectives>>) = match env {
            None => (0, None),
            Some(e) => match (&e.torchrun, e.launcher, over_mpi) {
                (Some(d), _, _) => (e.rank, Some(Box::new(TcpWorld::connect(d, abort.clone())?))),
                (None, _, Some(join)) => {
                    let joined = join(abort.clone())?;
                    keep = Some(joined.keep);
                    (e.rank, Some(joined.group))
                }
                (None, launcher, None) => {
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
            _keep: keep,
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

    /// Places this process's one pipeline rank, as `place` does a plan's.
    fn place_pipeline(&self, mesh: &MeshShape, device: &Device) -> Result<PipelinePlacement, ExecError> {
        let procs = self.processes.lock().unwrap_or_else(|e| e.into_inner()).take();
        crate::train::pipeline::nccl::place_pipeline(mesh, self.rank, device, procs, self.abort.clone())
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
