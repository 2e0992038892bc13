//! The launcher environment of a multi-process run: which rank this process is, of how
//! many, and where rank 0 listens.
//!
//! `torchrun --no-python shardplan train ...`, `srun` with the same variables, and
//! `shardplan launch` all set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.

use crate::ExecError;
use std::net::{SocketAddr, ToSocketAddrs};

/// The torchrun variables of this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: u64,
    pub world_size: u64,
    pub local_rank: u64,
    pub master_addr: String,
    pub master_port: u16,
}

impl DistEnv {
    /// Reads the variables through `get` (the process environment in production).
    /// `Ok(None)` when none is set: a single-process run.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>, ExecError> {
        const NAMES: [&str; 5] = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"];
        if NAMES.iter().all(|n| get(n).is_none()) {
            return Ok(None);
        }
        let need = |n: &str| {
            get(n).ok_or_else(|| {
                ExecError::Unsupported(format!(
                    "{n} is not set, but {} are: a multi-process launch sets all of {} (torchrun, srun or `shardplan launch` do)",
                    NAMES.iter().filter(|m| get(m).is_some()).copied().collect::<Vec<_>>().join(", "),
                    NAMES.join(", ")
                ))
            })
        };
        let num = |n: &str| -> Result<u64, ExecError> { parse_count(n, &need(n)?) };
        let (rank, world_size, local_rank) = (num("RANK")?, num("WORLD_SIZE")?, num("LOCAL_RANK")?);
        if world_size == 0 || rank >= world_size {
            return Err(ExecError::Unsupported(format!(
                "RANK={rank} is not below WORLD_SIZE={world_size}"
            )));
        }
        let port = need("MASTER_PORT")?;
        let master_port = port
            .trim()
            .parse::<u16>()
            .map_err(|_| ExecError::Unsupported(format!("MASTER_PORT={port:?} is not a port number")))?;
        Ok(Some(DistEnv {
            rank,
            world_size,
            local_rank,
            master_addr: need("MASTER_ADDR")?,
            master_port,
        }))
    }

    /// The process environment's variables.
    pub fn from_env() -> Result<Option<DistEnv>, ExecError> {
        Self::from_vars(|n| std::env::var(n).ok())
    }

    pub(crate) fn addr(&self) -> Result<SocketAddr, ExecError> {
        (self.master_addr.as_str(), self.master_port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                ExecError::Unsupported(format!(
                    "MASTER_ADDR {}:{} does not resolve to an address",
                    self.master_addr, self.master_port
                ))
            })
    }
}

/// The value `v` of variable `n` as a count, or an error naming both.
fn parse_count(n: &str, v: &str) -> Result<u64, ExecError> {
    v.trim()
        .parse::<u64>()
        .map_err(|_| ExecError::Unsupported(format!("{n}={v:?} is not a non-negative integer")))
}

/// What started this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun or `shardplan launch` (RANK, WORLD_SIZE, MASTER_ADDR ...).
    Torchrun,
    /// Open MPI's mpirun (OMPI_COMM_WORLD_*, or PMIX_RANK with its size variable).
    Mpirun,
    /// Slurm's srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID).
    Srun,
}

impl Launcher {
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Torchrun => "torchrun / shardplan launch",
            Launcher::Mpirun => "mpirun",
            Launcher::Srun => "srun",
        }
    }
}

/// This process's place in a multi-process run, as its launcher set it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessEnv {
    pub launcher: Launcher,
    pub rank: u64,
    pub world_size: u64,
    pub local_rank: u64,
    /// The torchrun variables, for the TCP rendezvous (torchrun / `shardplan launch`).
    pub torchrun: Option<DistEnv>,
}

impl ProcessEnv {
    /// Reads the launchers' variables through `get`: torchrun's first (they are explicit),
    /// then Open MPI's, then Slurm's. `Ok(None)` when none is set: a single process.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<ProcessEnv>, ExecError> {
        if let Some(d) = DistEnv::from_vars(&get)? {
            return Ok(Some(ProcessEnv {
                launcher: Launcher::Torchrun,
                rank: d.rank,
                world_size: d.world_size,
                local_rank: d.local_rank,
                torchrun: Some(d),
            }));
        }
        let num = |n: &str| -> Result<Option<u64>, ExecError> { get(n).map(|v| parse_count(n, &v)).transpose() };
        let found = |launcher, rank: Option<u64>, size: Option<u64>, local: Option<u64>, names: &str| match (rank, size)
        {
            (Some(rank), Some(world_size)) if rank < world_size => Ok(Some(ProcessEnv {
                launcher,
                rank,
                world_size,
                local_rank: local.unwrap_or(0),
                torchrun: None,
            })),
            (Some(rank), Some(size)) => Err(ExecError::Unsupported(format!(
                "{names}: rank {rank} is not below the world size {size}"
            ))),
            _ => Err(ExecError::Unsupported(format!(
                "{names}: only some of these variables are set; was the process started by its launcher?"
            ))),
        };
        let ompi = (
            num("OMPI_COMM_WORLD_RANK")?.or(num("PMIX_RANK")?),
            num("OMPI_COMM_WORLD_SIZE")?,
            num("OMPI_COMM_WORLD_LOCAL_RANK")?,
        );
        if ompi.0.is_some() || ompi.1.is_some() {
            return found(
                Launcher::Mpirun,
                ompi.0,
                ompi.1,
                ompi.2,
                "OMPI_COMM_WORLD_RANK (or PMIX_RANK) and OMPI_COMM_WORLD_SIZE",
            );
        }
        let slurm = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?, num("SLURM_LOCALID")?);
        if slurm.0.is_some() || slurm.1.is_some() {
            return found(
                Launcher::Srun,
                slurm.0,
                slurm.1,
                slurm.2,
                "SLURM_PROCID and SLURM_NTASKS",
            );
        }
        Ok(None)
    }

    /// The process environment's variables.
    pub fn from_env() -> Result<Option<ProcessEnv>, ExecError> {
        Self::from_vars(|n| std::env::var(n).ok())
    }
}
