//! Multi-process runs: the torchrun environment, and the rendezvous through which rank 0
//! hands every other rank a small payload (the NCCL unique id) over TCP.
//!
//! `torchrun --no-python shardplan train ...`, `srun` with the same variables, and
//! `shardplan launch` all set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
//! Every connection and read has a deadline: a rank that cannot reach rank 0 fails with the
//! address and the time it waited, never hangs.

use crate::ExecError;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

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
        let num = |n: &str| -> Result<u64, ExecError> {
            let v = need(n)?;
            v.trim()
                .parse::<u64>()
                .map_err(|_| ExecError::Unsupported(format!("{n}={v:?} is not a non-negative integer")))
        };
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

    fn addr(&self) -> Result<SocketAddr, ExecError> {
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

fn fail(env: &DistEnv, what: String) -> ExecError {
    ExecError::Aborted(format!("rank {}: {what}", env.rank))
}

/// Rank 0 sends `payload` to every other rank; every rank returns it. Gives up after
/// `timeout` (waiting for peers on rank 0, reaching rank 0 elsewhere).
pub fn rendezvous(env: &DistEnv, payload: &[u8], timeout: Duration) -> Result<Vec<u8>, ExecError> {
    let deadline = Instant::now() + timeout;
    let addr = env.addr()?;
    if env.rank == 0 {
        let listener =
            TcpListener::bind(addr).map_err(|e| fail(env, format!("cannot listen on MASTER_ADDR {addr}: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| fail(env, format!("listener: {e}")))?;
        let mut served = 0;
        while served + 1 < env.world_size {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false)
                        .map_err(|e| fail(env, format!("peer socket: {e}")))?;
                    s.set_write_timeout(Some(timeout)).ok();
                    let len = (payload.len() as u64).to_le_bytes();
                    s.write_all(&len)
                        .and_then(|()| s.write_all(payload))
                        .map_err(|e| fail(env, format!("sending the rendezvous payload: {e}")))?;
                    served += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(fail(
                            env,
                            format!(
                                "only {served} of {} ranks reached {addr} within {:.0} s",
                                env.world_size - 1,
                                timeout.as_secs_f64()
                            ),
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(fail(env, format!("accepting on {addr}: {e}"))),
            }
        }
        return Ok(payload.to_vec());
    }
    let mut last = String::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(fail(
                env,
                format!(
                    "cannot reach MASTER_ADDR {}:{} within {:.0} s ({last})",
                    env.master_addr,
                    env.master_port,
                    timeout.as_secs_f64()
                ),
            ));
        }
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(1))) {
            Ok(mut s) => {
                s.set_read_timeout(Some(left.max(Duration::from_millis(100)))).ok();
                let mut len = [0u8; 8];
                s.read_exact(&mut len)
                    .map_err(|e| fail(env, format!("reading from {addr}: {e}")))?;
                let n = u64::from_le_bytes(len);
                if n > 1 << 20 {
                    return Err(fail(
                        env,
                        format!("{addr} sent a {n}-byte payload: not a shardplan rank 0"),
                    ));
                }
                let mut buf = vec![0u8; n as usize];
                s.read_exact(&mut buf)
                    .map_err(|e| fail(env, format!("reading from {addr}: {e}")))?;
                return Ok(buf);
            }
            Err(e) => {
                last = e.to_string();
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}
