//! The NCCL backend: one process per GPU, one NCCL communicator per (process group, plan
//! stream), each collective on the CUDA stream of its plan stream.
//!
//! Everything here but the `device` module is plain code, tested on the CPU:
//! - which communicators a rank joins, with their members and its index in each
//!   ([`comm_specs`]), and which CUDA streams the plan's collective streams become
//!   ([`comm_streams`]);
//! - the unique-id exchange: the lowest rank of each group makes its id, and every
//!   process gathers all of them over the process world (TCP under torchrun /
//!   `shardplan launch`, MPI under mpirun) ([`exchange_ids`]);
//! - waiting for device work with the world's timeout and abort ([`wait_done`]);
//! - where an all-to-all's parts lie in its one send and one receive buffer ([`offsets`]).
//!
//! The `device` module (feature `cuda`) is the thin part that needs a GPU: it creates the
//! streams and communicators and issues each collective.
//!
//! How the device work is ordered. Each collective is issued on its plan stream's CUDA
//! stream and returns once the device has finished it (polled, under the collective
//! timeout), like every other backend's collective: the plan's record/wait then order
//! the rank's host threads exactly as on the CPU, and a buffer freed after a collective
//! returns is no longer in use. Between CUDA streams, cudarc's per-buffer events order the
//! rest: a collective's stream waits for the last write of its input buffer (the cast or
//! copy the compute stream made), and the compute stream waits for the collective's write
//! before it reads the output, without waiting on unrelated work of either stream.

use super::Abort;
use crate::ExecError;
use serde::{Deserialize, Serialize};
use shardplan_planner::{Comm, Plan, Stream};
use std::time::{Duration, Instant};

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// One communicator a rank joins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommSpec {
    pub comm: Comm,
    /// The plan stream whose collectives use it (and whose CUDA stream it is bound to).
    pub stream: Stream,
    /// The group's ranks, in group order (NCCL rank i is `members[i]`).
    pub members: Vec<u64>,
    /// This rank's position in `members`.
    pub index: usize,
}

/// A communicator the start-up id exchange opens: its name, the same on every member and
/// distinct among a rank's communicators (it keys the exchanged ids), and the member that
/// makes its id.
pub trait IdGroup {
    fn name(&self) -> String;
    fn root(&self) -> u64;
}

impl IdGroup for CommSpec {
    /// The group's first member.
    fn root(&self) -> u64 {
        self.members[0]
    }

    /// How errors name it: `shard group [0, 1] (all-gather stream)`.
    fn name(&self) -> String {
        format!("{} group {:?} ({} stream)", self.comm, self.members, self.stream.name())
    }
}

/// The communicators `rank` joins, in the order every rank creates them: the program's
/// (`channels`), then, under expert parallelism, the expert group's, over which the
/// all-to-all stream's steps move the tokens (the compute stream's graph ops under
/// `runtime: fsdp2`; the planner counts it too: `simulate::overhead`), then, under context
/// parallelism, the context group's, for ring attention's exchanges (the all-to-all
/// stream's steps; the compute stream's ops under `runtime: fsdp2`).
pub fn comm_specs(plan: &Plan, rank: u64) -> Result<Vec<CommSpec>, ExecError> {
    let mut channels = super::channels(plan);
    // The expert and context groups' collectives are the all-to-all stream's steps when
    // the plan has that stream (inline on the compute stream under `runtime: fsdp2`).
    let group_stream = if plan
        .programs
        .iter()
        .any(|p| p.instrs.iter().any(|x| x.stream == Stream::AllToAll))
    {
        Stream::AllToAll
    } else {
        Stream::Compute
    };
    if plan.mesh.expert() > 1 {
        channels.push((Comm::Expert, group_stream));
    }
    if plan.mesh.context() > 1 {
        channels.push((Comm::Context, group_stream));
    }
    channels
        .into_iter()
        .map(|(comm, stream)| {
            let members = comm.members(&plan.mesh, rank);
            let index = members
                .iter()
                .position(|&m| m == rank)
                .ok_or_else(|| ExecError::Internal(format!("rank {rank} is not in its own {comm} group")))?;
            Ok(CommSpec {
                comm,
                stream,
                members,
                index,
            })
        })
        .collect()
}

/// Where each of `lens` starts when they are laid one after another, and their total: an
/// all-to-all's parts in its one send buffer and what arrives in its one receive buffer.
pub fn offsets(lens: &[usize]) -> (Vec<usize>, usize) {
    let mut at = 0;
    let starts = lens
        .iter()
        .map(|&l| {
            let s = at;
            at += l;
            s
        })
        .collect();
    (starts, at)
}

/// The plan streams that issue collectives, each of which gets its own CUDA stream (the
/// compute stream is candle's; the collectives never run on it).
pub fn comm_streams(specs: &[CommSpec]) -> Vec<Stream> {
    let mut out: Vec<Stream> = specs.iter().map(|s| s.stream).collect();
    out.sort();
    out.dedup();
    out
}

/// One id on the wire: which group it opens, and its bytes (hex).
#[derive(Serialize, Deserialize)]
struct IdEntry {
    group: String,
    root: u64,
    id: String,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; ID_BYTES]> {
    if s.len() != 2 * ID_BYTES || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; ID_BYTES];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// The unique id of each of `specs` (in their order). This process makes the ids of the
/// groups it roots with `make_id`, and `all_gather` (the process world, a collective)
/// brings every process's ids to every process.
pub fn exchange_ids<G: IdGroup>(
    rank: u64,
    specs: &[G],
    make_id: &mut dyn FnMut() -> Result<[u8; ID_BYTES], ExecError>,
    all_gather: &dyn Fn(Vec<u8>) -> Result<Vec<Vec<u8>>, ExecError>,
) -> Result<Vec<[u8; ID_BYTES]>, ExecError> {
    let all = all_gather(my_ids(rank, specs, make_id)?)?;
    pick_ids(rank, specs, &all)
}

/// What this process contributes to the id exchange: the ids of the groups it roots.
fn my_ids<G: IdGroup>(
    rank: u64,
    specs: &[G],
    make_id: &mut dyn FnMut() -> Result<[u8; ID_BYTES], ExecError>,
) -> Result<Vec<u8>, ExecError> {
    let mut mine = Vec::new();
    for s in specs.iter().filter(|s| s.root() == rank) {
        mine.push(IdEntry {
            group: s.name(),
            root: rank,
            id: hex(&make_id()?),
        });
    }
    serde_json::to_vec(&mine).map_err(|e| ExecError::Internal(format!("encoding NCCL ids: {e}")))
}

/// Each of `specs`' ids, from every process's contribution (in process order).
fn pick_ids<G: IdGroup>(rank: u64, specs: &[G], all: &[Vec<u8>]) -> Result<Vec<[u8; ID_BYTES]>, ExecError> {
    let mut table: Vec<(String, u64, [u8; ID_BYTES])> = Vec::new();
    for (from, bytes) in all.iter().enumerate() {
        let entries: Vec<IdEntry> = serde_json::from_slice(bytes).map_err(|e| {
            ExecError::Aborted(format!(
                "rank {rank}: process {from} sent NCCL ids that do not parse ({e}): is every rank the same shardplan build?"
            ))
        })?;
        for e in entries {
            let id = unhex(&e.id).ok_or_else(|| {
                ExecError::Aborted(format!(
                    "rank {rank}: process {from} sent a malformed NCCL id for the {} of rank {}",
                    e.group, e.root
                ))
            })?;
            table.push((e.group, e.root, id));
        }
    }
    specs
        .iter()
        .map(|s| {
            let (name, root) = (s.name(), s.root());
            let found: Vec<_> = table.iter().filter(|(g, r, _)| (g, *r) == (&name, root)).collect();
            match found.as_slice() {
                [(_, _, id)] => Ok(*id),
                [] => Err(ExecError::Aborted(format!(
                    "rank {rank}: no NCCL id arrived for the {} (rank {} makes it): do all ranks run the same plan?",
                    s.name(),
                    s.root()
                ))),
                _ => Err(ExecError::Aborted(format!(
                    "rank {rank}: {} NCCL ids arrived for the {}: do all ranks run the same plan?",
                    found.len(),
                    s.name()
                ))),
            }
        })
        .collect()
}

/// Waits until `done` says the device work is finished: returns its error as the
/// collective's failure, and once the world is aborted or the timeout passes, aborts the
/// world (the caller then tears down its communicator) and returns why.
pub fn wait_done(
    done: &mut dyn FnMut() -> Result<bool, String>,
    abort: &Abort,
    what: &dyn Fn() -> String,
) -> Result<(), ExecError> {
    let start = Instant::now();
    let deadline = start + abort.timeout();
    let mut spins = 0u32;
    loop {
        match done() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => {
                let msg = format!("{}: {e}", what());
                abort.abort(msg.clone());
                return Err(ExecError::Aborted(msg));
            }
        }
        if let Some(r) = abort.reason() {
            return Err(ExecError::Aborted(r));
        }
        if Instant::now() >= deadline {
            let msg = format!(
                "{} did not finish within {:.1} s (the collective timeout): a rank is missing, hung or slower than the timeout",
                what(),
                abort.timeout().as_secs_f64()
            );
            abort.abort(msg.clone());
            return Err(ExecError::Aborted(msg));
        }
        // Short collectives finish in microseconds: spin first, then sleep a little.
        spins += 1;
        if spins < 200 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(if spins < 2000 { 20 } else { 200 }));
        }
    }
}

/// Runs `f`, a blocking call with no timeout of its own (ncclCommInitRank waits for every
/// member of the group). If it has not returned after `timeout`, says that `what` did not
/// finish and ends the process (exit 1), so the launcher stops the job instead of every
/// rank waiting forever.
pub fn guard_blocking<T>(what: &str, timeout: Duration, f: impl FnOnce() -> T) -> T {
    let what = what.to_string();
    guard_blocking_with(timeout, f, move || {
        eprintln!(
            "error: {what} did not finish within {:.0} s (a rank is missing or on another plan); stopping",
            timeout.as_secs_f64()
        );
        std::process::exit(1)
    })
}

fn guard_blocking_with<T>(timeout: Duration, f: impl FnOnce() -> T, on_timeout: impl FnOnce() + Send + 'static) -> T {
    let (done, wait) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(timeout) {
            on_timeout();
        }
    });
    let out = f();
    let _ = done.send(());
    out
}

#[cfg(feature = "cuda")]
pub mod device;
pub mod p2p;

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::sync::Arc;

    fn plan(replicate: u64, shard: u64) -> Plan {
        llama_plan(&format!(
            "mesh: {{replicate: {replicate}, shard: {shard}}}\ngpus_per_node: {}\nbatch: {{per_rank: 1, seq_len: 16}}\n",
            replicate * shard
        ))
    }

    /// tiny-llama planned on spec `yaml`.
    fn llama_plan(yaml: &str) -> Plan {
        let cfg = shardplan_frontends::parse_parallel_spec(&shardplan_frontends::Source::from_text("t.yaml", yaml))
            .expect("spec")
            .0;
        let model = shardplan_models::preset("tiny-llama").expect("preset");
        let graph = shardplan_models::trace(&model, cfg.trace_options()).expect("trace");
        let joint = shardplan_ir::differentiate(&graph).expect("differentiate");
        shardplan_planner::plan(&joint, &cfg).expect("plan")
    }

    /// examples/models/tiny-moe.yaml on 1x4 with an expert axis of 2.
    fn expert_plan() -> Plan {
        let yaml = "mesh: {shard: 4, expert: 2}\ngpus_per_node: 4\nbatch: {per_rank: 2, seq_len: 16}\n";
        let cfg = shardplan_frontends::parse_parallel_spec(&shardplan_frontends::Source::from_text("t.yaml", yaml))
            .expect("spec")
            .0;
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models/tiny-moe.yaml");
        let model = shardplan_frontends::load_model(&path).expect("tiny-moe").config;
        let graph = shardplan_models::trace(&model, cfg.trace_options()).expect("trace");
        let joint = shardplan_ir::differentiate(&graph).expect("differentiate");
        shardplan_planner::plan(&joint, &cfg).expect("plan")
    }

    /// Under expert parallelism every rank also joins its expert group's communicator, last,
    /// with the members the mesh gives it; the plan's NCCL memory counts as many
    /// communicators of more than one rank as a rank joins.
    #[test]
    fn an_expert_parallel_rank_joins_its_expert_group() {
        let p = expert_plan();
        let all: Vec<Vec<CommSpec>> = (0..4).map(|r| comm_specs(&p, r).unwrap()).collect();
        for (r, specs) in all.iter().enumerate() {
            let last = specs.last().unwrap();
            assert_eq!((last.comm, last.stream), (Comm::Expert, Stream::AllToAll));
            let want = if r < 2 { vec![0, 1] } else { vec![2, 3] };
            assert_eq!((last.members.clone(), last.index), (want, r % 2), "rank {r}");
            let joined = specs.iter().filter(|s| s.members.len() > 1).count() as u32;
            assert_eq!(joined, p.memory.overhead.communicators, "rank {r}");
        }
        assert!(plan(1, 4).programs[0]
            .communicators()
            .iter()
            .all(|&(c, _)| c != Comm::Expert));
        assert!(comm_specs(&plan(1, 4), 0)
            .unwrap()
            .iter()
            .all(|s| s.comm != Comm::Expert));
    }

    /// Under context parallelism every rank joins its context group's communicator last, on
    /// the compute stream, with the consecutive shard ranks that share its sequences.
    #[test]
    fn a_context_parallel_rank_joins_its_context_group() {
        let p = llama_plan("mesh: {shard: 2, context: 2}\ngpus_per_node: 4\nbatch: {per_rank: 1, seq_len: 16}\n");
        for r in 0..4u64 {
            let specs = comm_specs(&p, r).unwrap();
            let last = specs.last().unwrap();
            assert_eq!((last.comm, last.stream), (Comm::Context, Stream::AllToAll));
            let want = if r < 2 { vec![0, 1] } else { vec![2, 3] };
            assert_eq!((last.members.clone(), last.index), (want, (r % 2) as usize), "rank {r}");
            let joined = specs.iter().filter(|s| s.members.len() > 1).count() as u32;
            assert_eq!(joined, p.memory.overhead.communicators, "rank {r}");
        }
    }

    #[test]
    fn every_member_of_a_group_agrees_on_its_members_and_root() {
        let p = plan(2, 2);
        let all: Vec<Vec<CommSpec>> = (0..4).map(|r| comm_specs(&p, r).unwrap()).collect();
        // The same channels on every rank, in the same order.
        for specs in &all {
            let keys: Vec<_> = specs.iter().map(|s| (s.comm, s.stream)).collect();
            let first: Vec<_> = all[0].iter().map(|s| (s.comm, s.stream)).collect();
            assert_eq!(keys, first);
        }
        assert!(
            all[0].iter().any(|s| s.comm == Comm::Replicate),
            "HSDP has replicate groups"
        );
        for (r, specs) in all.iter().enumerate() {
            for s in specs {
                assert_eq!(s.members[s.index], r as u64);
                for &m in &s.members {
                    let theirs = all[m as usize]
                        .iter()
                        .find(|t| (t.comm, t.stream) == (s.comm, s.stream))
                        .unwrap();
                    assert_eq!(theirs.members, s.members, "{}", s.name());
                }
            }
        }
        // 2x2: the shard groups are {0,1} and {2,3}; the replicate groups {0,2} and {1,3}.
        let shard = all[3].iter().find(|s| s.comm == Comm::Shard).unwrap();
        assert_eq!((shard.members.clone(), shard.index, shard.root()), (vec![2, 3], 1, 2));
        let rep = all[3].iter().find(|s| s.comm == Comm::Replicate).unwrap();
        assert_eq!((rep.members.clone(), rep.index, rep.root()), (vec![1, 3], 1, 1));
        let streams = comm_streams(&all[0]);
        assert!(!streams.contains(&Stream::Compute), "{streams:?}");
        assert!(streams.contains(&Stream::AllGather) && streams.contains(&Stream::ReduceScatter));
    }

    /// Runs the id exchange of every rank of `p` with an in-memory all-gather (after
    /// `tamper` edits what each process sends); ids hold their maker's rank and a counter.
    fn exchange_all(p: &Plan, tamper: impl Fn(usize, Vec<u8>) -> Vec<u8>) -> Vec<Result<Vec<[u8; ID_BYTES]>, String>> {
        let world = p.mesh.world();
        let payloads: Vec<Vec<u8>> = (0..world)
            .map(|r| {
                let n = Cell::new(0u8);
                let mut make = || {
                    n.set(n.get() + 1);
                    let mut id = [0u8; ID_BYTES];
                    id[0] = r as u8;
                    id[1] = n.get();
                    id[127] = 0xab;
                    Ok(id)
                };
                tamper(r as usize, my_ids(r, &comm_specs(p, r).unwrap(), &mut make).unwrap())
            })
            .collect();
        (0..world)
            .map(|r| pick_ids(r, &comm_specs(p, r).unwrap(), &payloads).map_err(|e| e.to_string()))
            .collect()
    }

    /// What rank 0 of `p` sends.
    fn exchange_all_first(p: &Plan) -> Vec<u8> {
        my_ids(0, &comm_specs(p, 0).unwrap(), &mut || Ok([7u8; ID_BYTES])).unwrap()
    }

    #[test]
    fn each_group_gets_the_id_its_first_rank_made() {
        let p = plan(2, 2);
        let got = exchange_all(&p, |_, b| b);
        for (r, ids) in got.iter().enumerate() {
            let ids = ids.as_ref().unwrap();
            let specs = comm_specs(&p, r as u64).unwrap();
            for (s, id) in specs.iter().zip(ids) {
                assert_eq!(id[0] as u64, s.root(), "{}", s.name());
                assert_eq!(id[127], 0xab);
                // Every member holds the same id.
                for &m in &s.members {
                    let theirs = comm_specs(&p, m).unwrap();
                    let k = theirs
                        .iter()
                        .position(|t| (t.comm, t.stream) == (s.comm, s.stream))
                        .unwrap();
                    assert_eq!(got[m as usize].as_ref().unwrap()[k], *id);
                }
            }
            // Distinct groups have distinct ids.
            let mut uniq = ids.clone();
            uniq.sort();
            uniq.dedup();
            assert_eq!(uniq.len(), ids.len());
        }
    }

    #[test]
    fn missing_duplicated_or_garbled_ids_are_refused_with_the_group() {
        let p = plan(1, 2);
        // Rank 0 roots every group of a 1x2 mesh: drop its ids.
        let got = exchange_all(&p, |r, b| if r == 0 { b"[]".to_vec() } else { b });
        let e = got[1].as_ref().unwrap_err();
        assert!(
            e.contains("no NCCL id arrived for the shard group [0, 1]") && e.contains("rank 0 makes it"),
            "{e}"
        );
        let got = exchange_all(&p, |r, b| if r == 0 { b"not json".to_vec() } else { b });
        assert!(got[1]
            .as_ref()
            .unwrap_err()
            .contains("process 0 sent NCCL ids that do not parse"));
        let got = exchange_all(&p, |r, b| {
            if r == 0 {
                String::from_utf8(b)
                    .unwrap()
                    .replacen("\"id\":\"00", "\"id\":\"zz", 1)
                    .into_bytes()
            } else {
                b
            }
        });
        assert!(got[1].as_ref().unwrap_err().contains("malformed NCCL id"));
        // Two processes sending the same group's id.
        let got = exchange_all(&p, |r, b| if r == 1 { exchange_all_first(&p) } else { b });
        assert!(got[0]
            .as_ref()
            .unwrap_err()
            .contains("2 NCCL ids arrived for the shard group"));
    }

    /// The all-to-all's parts and receipts lie back to back, empty ones taking no room.
    #[test]
    fn offsets_lay_parts_back_to_back() {
        assert_eq!(offsets(&[3, 0, 2, 5]), (vec![0, 3, 3, 5], 10));
        assert_eq!(offsets(&[0, 0]), (vec![0, 0], 0));
        assert_eq!(offsets(&[]), (vec![], 0));
    }

    #[test]
    fn a_blocking_call_that_overruns_triggers_the_stop() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let fired = Arc::new(AtomicBool::new(false));
        let f = fired.clone();
        let v = guard_blocking_with(
            Duration::from_millis(50),
            || {
                std::thread::sleep(Duration::from_millis(400));
                7
            },
            move || f.store(true, Ordering::SeqCst),
        );
        assert_eq!(v, 7);
        assert!(fired.load(Ordering::SeqCst));
        let fired = Arc::new(AtomicBool::new(false));
        let f = fired.clone();
        guard_blocking_with(
            Duration::from_millis(200),
            || (),
            move || f.store(true, Ordering::SeqCst),
        );
        std::thread::sleep(Duration::from_millis(400));
        assert!(
            !fired.load(Ordering::SeqCst),
            "a call that returns in time stops nothing"
        );
    }

    #[test]
    fn waiting_returns_on_completion_error_abort_or_timeout() {
        let abort = Arc::new(Abort::default());
        abort.set_timeout(Duration::from_millis(300));
        let mut n = 0;
        wait_done(
            &mut || {
                n += 1;
                Ok(n > 5)
            },
            &abort,
            &|| "all-gather 3".into(),
        )
        .unwrap();
        // A device error fails the collective and stops the world.
        let e = wait_done(&mut || Err("an illegal address".into()), &abort, &|| {
            "all-gather 4".into()
        })
        .unwrap_err();
        assert!(e.to_string().contains("all-gather 4: an illegal address"), "{e}");
        assert!(abort.reason().unwrap().contains("an illegal address"));
        // Once aborted, a wait returns the first reason at once.
        let start = Instant::now();
        let e = wait_done(&mut || Ok(false), &abort, &|| "x".into()).unwrap_err();
        assert!(e.to_string().contains("an illegal address") && start.elapsed() < Duration::from_millis(100));
        // A collective that never finishes times out and aborts the world.
        let fresh = Abort::default();
        fresh.set_timeout(Duration::from_millis(200));
        let start = Instant::now();
        let e = wait_done(&mut || Ok(false), &fresh, &|| {
            "reduce-scatter 7 of the shard group [0, 1]".into()
        })
        .unwrap_err();
        let el = start.elapsed();
        assert!(
            el >= Duration::from_millis(200) && el < Duration::from_secs(5),
            "{el:?}"
        );
        assert!(
            e.to_string()
                .contains("reduce-scatter 7 of the shard group [0, 1] did not finish within 0.2 s"),
            "{e}"
        );
        assert!(fresh.reason().is_some());
    }
}
