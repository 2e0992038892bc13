//! The TCP world: collectives between the processes of a torchrun-style launch (torchrun,
//! `shardplan launch`, or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and
//! MASTER_PORT), over a star of TCP connections rooted at rank 0.
//!
//! It carries what the processes agree on outside the plan's collectives: the NCCL unique
//! ids at start-up, and between steps the step figures, a stop request and checkpoint
//! completion. Rank 0 gathers every contribution, combines them exactly as the Local
//! backend does (rank order), and sends each process its result. Messages are small.
//!
//! Everything read from a socket is untrusted: a peer that is not a shardplan rank of this
//! run (wrong magic, version, world size, a rank out of range or seen twice) is turned
//! away, a frame whose sizes do not add up or exceed [`MAX_FRAME`] is refused, and every
//! read and write has a deadline, so a dead or silent peer is an error naming it, not a
//! hang.

use super::env::DistEnv;
use super::local::{combine, Kind};
use super::{Abort, Collectives, Reduce};
use crate::ExecError;
use candle_core::{DType, Device, Tensor};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The largest payload one frame may carry (1 GiB): far above what the processes exchange.
pub const MAX_FRAME: u64 = 1 << 30;
const HELLO: [u8; 4] = *b"SPHL";
const WELCOME: [u8; 4] = *b"SPOK";
const FRAME: [u8; 4] = *b"SPTW";
const VERSION: u32 = 1;
/// How often a blocked read looks at the world's abort flag.
const POLL: Duration = Duration::from_millis(100);

enum Links {
    /// Rank 0: one stream per other rank, index r - 1 for rank r.
    Hub(Vec<TcpStream>),
    /// Every other rank: its stream to rank 0.
    Spoke(TcpStream),
}

/// This process's handle on the TCP world.
pub struct TcpWorld {
    rank: u64,
    size: u64,
    links: Mutex<Links>,
    abort: Arc<Abort>,
}

fn err(rank: u64, what: impl std::fmt::Display) -> ExecError {
    ExecError::Aborted(format!("rank {rank}: {what}"))
}

/// Reads exactly `buf.len()` bytes, looking at `abort` between polls, until `deadline`.
fn read_full(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    abort: &Abort,
    from: &dyn Fn() -> String,
) -> Result<(), String> {
    let mut got = 0;
    while got < buf.len() {
        if let Some(r) = abort.reason() {
            return Err(r);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "{} sent nothing for {:.1} s (the collective timeout)",
                from(),
                abort.timeout().as_secs_f64()
            ));
        }
        s.set_read_timeout(Some(left.min(POLL))).ok();
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(format!("{} closed the connection (its process ended?)", from())),
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(format!("reading from {}: {e}", from())),
        }
    }
    Ok(())
}

fn dtype_code(d: DType) -> Option<u8> {
    Some(match d {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::BF16 => 2,
        DType::F16 => 3,
        DType::U8 => 4,
        DType::U32 => 5,
        DType::I64 => 6,
        _ => return None,
    })
}

fn code_dtype(c: u8) -> Option<DType> {
    Some(match c {
        0 => DType::F32,
        1 => DType::F64,
        2 => DType::BF16,
        3 => DType::F16,
        4 => DType::U8,
        5 => DType::U32,
        6 => DType::I64,
        _ => return None,
    })
}

fn kind_code(k: Kind) -> [u8; 2] {
    let op = |r: Reduce| match r {
        Reduce::Sum => 0,
        Reduce::Avg => 1,
    };
    match k {
        Kind::AllGather => [0, 0],
        Kind::ReduceScatter(r) => [1, op(r)],
        Kind::AllReduce(r) => [2, op(r)],
        Kind::Broadcast => [3, 0],
        Kind::Barrier => [4, 0],
    }
}

fn code_kind(c: [u8; 2]) -> Option<Kind> {
    let op = match c[1] {
        0 => Reduce::Sum,
        1 => Reduce::Avg,
        _ => return None,
    };
    Some(match c[0] {
        0 => Kind::AllGather,
        1 => Kind::ReduceScatter(op),
        2 => Kind::AllReduce(op),
        3 => Kind::Broadcast,
        4 => Kind::Barrier,
        _ => return None,
    })
}

/// One contribution or result on the wire: header (magic, tag, kind, dtype, element count,
/// byte count), then the tensor's little-endian bytes (a 1-D tensor; none for a barrier).
struct Frame {
    tag: u64,
    kind: Kind,
    data: Option<Tensor>,
}

const HEADER: usize = 4 + 8 + 2 + 1 + 8 + 8;

fn encode(f: &Frame) -> Result<Vec<u8>, ExecError> {
    let mut out = Vec::with_capacity(HEADER);
    out.extend_from_slice(&FRAME);
    out.extend_from_slice(&f.tag.to_le_bytes());
    out.extend_from_slice(&kind_code(f.kind));
    match &f.data {
        None => {
            out.push(255);
            out.extend_from_slice(&0u64.to_le_bytes());
            out.extend_from_slice(&0u64.to_le_bytes());
        }
        Some(t) => {
            let code = dtype_code(t.dtype())
                .ok_or_else(|| ExecError::Internal(format!("the TCP world carries no {:?} tensors", t.dtype())))?;
            let t = t.flatten_all()?.to_device(&Device::Cpu)?;
            let mut bytes = Vec::with_capacity(t.elem_count() * t.dtype().size_in_bytes());
            t.write_bytes(&mut bytes)?;
            out.push(code);
            out.extend_from_slice(&(t.elem_count() as u64).to_le_bytes());
            out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            out.extend_from_slice(&bytes);
        }
    }
    Ok(out)
}

/// Reads one frame; a malformed one is an error describing what was wrong.
fn read_frame(s: &mut TcpStream, deadline: Instant, abort: &Abort, from: &dyn Fn() -> String) -> Result<Frame, String> {
    let mut h = [0u8; HEADER];
    read_full(s, &mut h, deadline, abort, from)?;
    if h[..4] != FRAME {
        return Err(format!("{} sent bytes that are not a shardplan frame", from()));
    }
    let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
    let tag = u64_at(4);
    let kind = code_kind([h[12], h[13]]).ok_or_else(|| format!("{} sent an unknown collective kind", from()))?;
    let (code, count, nbytes) = (h[14], u64_at(15), u64_at(23));
    if code == 255 {
        if count != 0 || nbytes != 0 || kind != Kind::Barrier {
            return Err(format!("{} sent a data-less frame that is not a barrier", from()));
        }
        return Ok(Frame { tag, kind, data: None });
    }
    let dtype = code_dtype(code).ok_or_else(|| format!("{} sent an unknown dtype code {code}", from()))?;
    if nbytes > MAX_FRAME || count.checked_mul(dtype.size_in_bytes() as u64) != Some(nbytes) {
        return Err(format!(
            "{} sent a frame of {count} {dtype:?} elements in {nbytes} bytes (at most {MAX_FRAME} bytes, sizes must agree)",
            from()
        ));
    }
    let mut bytes = vec![0u8; nbytes as usize];
    read_full(s, &mut bytes, deadline, abort, from)?;
    let t = Tensor::from_raw_buffer(&bytes, dtype, &[count as usize], &Device::Cpu)
        .map_err(|e| format!("{} sent an unreadable tensor: {e}", from()))?;
    Ok(Frame {
        tag,
        kind,
        data: Some(t),
    })
}

fn write_all(s: &mut TcpStream, bytes: &[u8], timeout: Duration, to: &dyn Fn() -> String) -> Result<(), String> {
    s.set_write_timeout(Some(timeout)).ok();
    s.write_all(bytes).map_err(|e| format!("sending to {}: {e}", to()))
}

impl TcpWorld {
    /// Joins the world `env` describes: rank 0 listens on MASTER_ADDR:MASTER_PORT and waits
    /// for every other rank, the others connect to it. Gives up after the abort's timeout.
    pub fn connect(env: &DistEnv, abort: Arc<Abort>) -> Result<TcpWorld, ExecError> {
        let timeout = abort.timeout();
        let deadline = Instant::now() + timeout;
        let addr = env.addr()?;
        let rank = env.rank;
        let links = if rank == 0 {
            let listener =
                TcpListener::bind(addr).map_err(|e| err(rank, format!("cannot listen on MASTER_ADDR {addr}: {e}")))?;
            listener
                .set_nonblocking(true)
                .map_err(|e| err(rank, format!("listener: {e}")))?;
            let mut peers: Vec<Option<TcpStream>> = (1..env.world_size).map(|_| None).collect();
            let mut joined = 0;
            while joined + 1 < env.world_size {
                match listener.accept() {
                    Ok((mut s, from)) => {
                        s.set_nonblocking(false).ok();
                        s.set_nodelay(true).ok();
                        // A connection that does not greet like a rank of this run is
                        // dropped; rank 0 goes on waiting for the real ranks.
                        let hello_deadline = (Instant::now() + Duration::from_secs(2)).min(deadline);
                        let mut hello = [0u8; 4 + 4 + 8 + 8];
                        let who = || format!("{from}");
                        if read_full(&mut s, &mut hello, hello_deadline, &abort, &who).is_err() || hello[..4] != HELLO {
                            continue;
                        }
                        let version = u32::from_le_bytes(hello[4..8].try_into().expect("4 bytes"));
                        let peer = u64::from_le_bytes(hello[8..16].try_into().expect("8 bytes"));
                        let world = u64::from_le_bytes(hello[16..24].try_into().expect("8 bytes"));
                        if version != VERSION {
                            return Err(err(rank, format!("{from} runs another shardplan version (protocol {version}, this one {VERSION}): run the same build on every rank")));
                        }
                        if world != env.world_size {
                            return Err(err(
                                rank,
                                format!("rank {peer} at {from} says WORLD_SIZE={world}, this rank says {}: start every rank with the same world size", env.world_size),
                            ));
                        }
                        let slot = peer
                            .checked_sub(1)
                            .and_then(|i| peers.get_mut(i as usize))
                            .ok_or_else(|| {
                                err(
                                    rank,
                                    format!("{from} says it is rank {peer}, outside 1..{}", env.world_size),
                                )
                            })?;
                        if slot.is_some() {
                            return Err(err(rank, format!("two processes say they are rank {peer} (the second from {from}): give each process its own RANK")));
                        }
                        write_all(&mut s, &WELCOME, timeout, &who).map_err(|e| err(rank, e))?;
                        *slot = Some(s);
                        joined += 1;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        if let Some(r) = abort.reason() {
                            return Err(ExecError::Aborted(r));
                        }
                        if Instant::now() >= deadline {
                            let missing: Vec<String> = peers
                                .iter()
                                .enumerate()
                                .filter(|(_, p)| p.is_none())
                                .map(|(i, _)| (i + 1).to_string())
                                .collect();
                            return Err(err(
                                rank,
                                format!(
                                    "only {joined} of {} ranks reached {addr} within {:.0} s (missing ranks {})",
                                    env.world_size - 1,
                                    timeout.as_secs_f64(),
                                    missing.join(", ")
                                ),
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(e) => return Err(err(rank, format!("accepting on {addr}: {e}"))),
                }
            }
            Links::Hub(peers.into_iter().map(|p| p.expect("every slot joined")).collect())
        } else {
            let mut last = String::from("no attempt");
            let s = loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(err(
                        rank,
                        format!(
                            "cannot reach MASTER_ADDR {}:{} within {:.0} s ({last})",
                            env.master_addr,
                            env.master_port,
                            timeout.as_secs_f64()
                        ),
                    ));
                }
                if let Some(r) = abort.reason() {
                    return Err(ExecError::Aborted(r));
                }
                match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(1))) {
                    Ok(mut s) => {
                        s.set_nodelay(true).ok();
                        let mut hello = Vec::with_capacity(24);
                        hello.extend_from_slice(&HELLO);
                        hello.extend_from_slice(&VERSION.to_le_bytes());
                        hello.extend_from_slice(&rank.to_le_bytes());
                        hello.extend_from_slice(&env.world_size.to_le_bytes());
                        let zero = || format!("rank 0 at {addr}");
                        write_all(&mut s, &hello, timeout, &zero).map_err(|e| err(rank, e))?;
                        let mut ok = [0u8; 4];
                        match read_full(&mut s, &mut ok, deadline, &abort, &zero) {
                            Ok(()) if ok == WELCOME => break s,
                            Ok(()) => {
                                return Err(err(
                                    rank,
                                    format!(
                                    "{addr} answered, but not as a shardplan rank 0 (another program on MASTER_PORT?)"
                                ),
                                ))
                            }
                            Err(e) => return Err(err(rank, e)),
                        }
                    }
                    Err(e) => {
                        last = e.to_string();
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            };
            Links::Spoke(s)
        };
        Ok(TcpWorld {
            rank,
            size: env.world_size,
            links: Mutex::new(links),
            abort,
        })
    }

    /// Runs one collective: the contributions meet at rank 0, which sends back results.
    fn run(&self, tag: u64, kind: Kind, input: Option<&Tensor>) -> Result<Option<Tensor>, ExecError> {
        if let Some(r) = self.abort.reason() {
            return Err(ExecError::Aborted(r));
        }
        let timeout = self.abort.timeout();
        let deadline = Instant::now() + timeout;
        let device = input.map_or(Device::Cpu, |t| t.device().clone());
        let mine = Frame {
            tag,
            kind,
            data: input.cloned(),
        };
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let fail = |msg: String| {
            let msg = format!("rank {}: process world: {kind:?} {tag}: {msg}", self.rank);
            self.abort.abort(msg.clone());
            ExecError::Aborted(msg)
        };
        let out = match &mut *links {
            Links::Spoke(s) => {
                let zero = || "rank 0".to_string();
                write_all(s, &encode(&mine)?, timeout, &zero).map_err(fail)?;
                let back = read_frame(s, deadline, &self.abort, &zero).map_err(fail)?;
                if back.tag != tag || back.kind != kind {
                    return Err(fail(format!(
                        "rank 0 answered {:?} {} to {kind:?} {tag}: the processes' schedules disagree",
                        back.kind, back.tag
                    )));
                }
                back.data
            }
            Links::Hub(peers) => {
                let mut inputs = vec![mine
                    .data
                    .map(|t| t.flatten_all().and_then(|t| t.to_device(&Device::Cpu)))
                    .transpose()?];
                for (i, s) in peers.iter_mut().enumerate() {
                    let r = i + 1;
                    let from = || format!("rank {r}");
                    let f = read_frame(s, deadline, &self.abort, &from).map_err(fail)?;
                    if f.tag != tag || f.kind != kind {
                        return Err(fail(format!(
                            "rank {r} issued {:?} {} while rank 0 issued {kind:?} {tag}: the processes' schedules disagree",
                            f.kind, f.tag
                        )));
                    }
                    inputs.push(f.data);
                }
                let outputs = match kind {
                    Kind::Barrier => vec![None; self.size as usize],
                    _ => {
                        if let Some(d) = inputs
                            .iter()
                            .flatten()
                            .map(|t| t.dtype())
                            .find(|&d| Some(d) != inputs[0].as_ref().map(|t| t.dtype()))
                        {
                            return Err(fail(format!(
                                "contributions of different dtypes ({d:?} and {:?})",
                                inputs[0].as_ref().map(|t| t.dtype())
                            )));
                        }
                        combine(kind, inputs)
                            .map_err(|e| fail(format!("combining the contributions: {e}")))?
                            .into_iter()
                            .map(Some)
                            .collect()
                    }
                };
                let mut outputs = outputs.into_iter();
                let own = outputs.next().flatten();
                for (i, (s, data)) in peers.iter_mut().zip(outputs).enumerate() {
                    let to = || format!("rank {}", i + 1);
                    let bytes = encode(&Frame { tag, kind, data })?;
                    write_all(s, &bytes, timeout, &to).map_err(fail)?;
                }
                own
            }
        };
        Ok(match out {
            Some(t) => {
                let t = match (kind, input) {
                    (Kind::AllReduce(_) | Kind::Broadcast, Some(i)) => t.reshape(i.shape())?,
                    _ => t,
                };
                Some(t.to_device(&device)?)
            }
            None => None,
        })
    }
}

impl Collectives for TcpWorld {
    fn size(&self) -> usize {
        self.size as usize
    }

    fn index(&self) -> usize {
        self.rank as usize
    }

    fn all_gather(&self, tag: u64, input: &Tensor) -> Result<Tensor, ExecError> {
        self.run(tag, Kind::AllGather, Some(input))?
            .ok_or_else(|| ExecError::Internal("all-gather without a result".into()))
    }

    fn reduce_scatter(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        if !input.elem_count().is_multiple_of(self.size()) {
            return Err(ExecError::Internal(format!(
                "process world: reduce-scatter of {} elements over {} processes",
                input.elem_count(),
                self.size()
            )));
        }
        self.run(tag, Kind::ReduceScatter(op), Some(input))?
            .ok_or_else(|| ExecError::Internal("reduce-scatter without a result".into()))
    }

    fn all_reduce(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        self.run(tag, Kind::AllReduce(op), Some(input))?
            .ok_or_else(|| ExecError::Internal("all-reduce without a result".into()))
    }

    fn broadcast(&self, tag: u64, input: &Tensor) -> Result<Tensor, ExecError> {
        self.run(tag, Kind::Broadcast, Some(input))?
            .ok_or_else(|| ExecError::Internal("broadcast without a result".into()))
    }

    fn barrier(&self, tag: u64) -> Result<(), ExecError> {
        self.run(tag, Kind::Barrier, None).map(|_| ())
    }
}
