//! Training over MPI: the engine that places one rank per process, and the process world
//! the NCCL engine agrees on its ids over under mpirun or srun.

use crate::{place, MpiWorld};
use candle_core::Device;
use shardplan_executor::comm::env::ProcessEnv;
use shardplan_executor::comm::{Abort, Collectives, Placement};
use shardplan_executor::train::engine::{Engine, JoinedProcesses};
use shardplan_executor::train::pipeline::PipelinePlacement;
use shardplan_executor::ExecError;
use shardplan_frontends::MeshShape;
use shardplan_planner::Plan;
use std::sync::Arc;

/// One CPU rank per process, collectives over MPI; the process was started by mpirun or
/// srun.
pub struct Mpi {
    pub world: MpiWorld,
}

impl Mpi {
    /// Initialises MPI and checks that the launcher's world is MPI's.
    pub fn start(env: Option<&ProcessEnv>) -> Result<Mpi, ExecError> {
        let world = MpiWorld::init()?;
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

impl Engine for Mpi {
    fn place(&self, plan: &Plan, _device: &Device) -> Result<Placement, ExecError> {
        place(&self.world, plan)
    }

    fn place_pipeline(&self, mesh: &MeshShape, _device: &Device) -> Result<PipelinePlacement, ExecError> {
        crate::place_pipeline(&self.world, mesh)
    }
}

/// The processes of an mpirun or srun launch as one group over MPI, for what they agree
/// on between steps (the NCCL engine's ids, metrics): MPI initialised, and the world kept
/// alive with the group.
pub fn process_world(abort: Arc<Abort>) -> Result<JoinedProcesses, ExecError> {
    let world = MpiWorld::init()?;
    let group: Box<dyn Collectives> = Box::new(world.process_group(abort));
    Ok(JoinedProcesses {
        group,
        keep: Box::new(world),
    })
}
