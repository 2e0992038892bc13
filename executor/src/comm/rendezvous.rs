//! The TCP rendezvous through which rank 0 hands every other rank a small payload (the
//! NCCL unique id) in a torchrun-style launch. Every connection and read has a deadline: a
//! rank that cannot reach rank 0 fails with the address and the time it waited, never hangs.

use super::env::DistEnv;
use crate::ExecError;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

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
