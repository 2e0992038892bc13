//! The `Local` backend: N ranks as threads of one process.
//!
//! Every result is computed by one thread from all contributions taken in rank order, so
//! sums do not depend on which rank arrives first.

use super::{Abort, Collectives, Reduce, Wake};
use crate::ExecError;
use candle_core::Tensor;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What a collective does (Local and TCP assemble every member's contribution the same way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    AllGather,
    ReduceScatter(Reduce),
    AllReduce(Reduce),
    Broadcast,
    Barrier,
}

/// One collective being assembled.
struct Entry {
    inputs: Vec<Option<(Kind, Option<Tensor>)>>,
    outputs: Vec<Option<Tensor>>,
    done: bool,
    taken: usize,
}

struct State {
    /// Collectives in flight, by tag.
    entries: HashMap<u64, Entry>,
}

struct Shared {
    size: usize,
    state: Mutex<State>,
    cv: Condvar,
}

impl Wake for Shared {
    fn wake(&self) {
        let _guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.cv.notify_all();
    }
}

/// One rank's handle on a Local process group.
pub struct LocalGroup {
    shared: Arc<Shared>,
    index: usize,
    abort: Arc<Abort>,
    /// Printed in errors (`shard group of ranks 0-3`).
    name: String,
}

/// Creates the handles of one group of `size` ranks (index i for member i).
pub fn local_group(size: usize, name: &str, abort: &Arc<Abort>) -> Vec<LocalGroup> {
    let shared = Arc::new(Shared {
        size,
        state: Mutex::new(State {
            entries: HashMap::new(),
        }),
        cv: Condvar::new(),
    });
    abort.watch(shared.clone());
    (0..size)
        .map(|index| LocalGroup {
            shared: shared.clone(),
            index,
            abort: abort.clone(),
            name: name.to_string(),
        })
        .collect()
}

/// Every member's result from every member's input (in member order).
pub(crate) fn combine(kind: Kind, inputs: Vec<Option<Tensor>>) -> Result<Vec<Tensor>, ExecError> {
    let n = inputs.len();
    let ins: Vec<Tensor> = inputs
        .into_iter()
        .map(|t| t.expect("every data collective has inputs"))
        .collect();
    let reduce = |op: Reduce| super::rank_order_sum(ins.iter().cloned().map(Ok), n, op);
    Ok(match kind {
        Kind::AllGather => {
            let all = Tensor::cat(&ins, 0)?;
            vec![all; n]
        }
        Kind::ReduceScatter(op) => {
            let r = reduce(op)?;
            let chunk = r.dim(0)? / n;
            (0..n)
                .map(|i| r.narrow(0, i * chunk, chunk))
                .collect::<Result<_, _>>()?
        }
        Kind::AllReduce(op) => vec![reduce(op)?; n],
        Kind::Broadcast => vec![ins[0].clone(); n],
        Kind::Barrier => unreachable!("barriers carry no data"),
    })
}

impl LocalGroup {
    fn check_abort(&self) -> Result<(), ExecError> {
        match self.abort.reason() {
            Some(r) => Err(ExecError::Aborted(r)),
            None => Ok(()),
        }
    }

    fn run(&self, tag: u64, kind: Kind, input: Option<&Tensor>) -> Result<Option<Tensor>, ExecError> {
        let s = &self.shared;
        let deadline = Instant::now() + self.abort.timeout();
        let mut st = s.state.lock().unwrap_or_else(|e| e.into_inner());
        let size = s.size;
        let entry = st.entries.entry(tag).or_insert_with(|| Entry {
            inputs: vec![None; size],
            outputs: vec![None; size],
            done: false,
            taken: 0,
        });
        if entry.inputs[self.index].is_some() || entry.done {
            return Err(ExecError::Internal(format!(
                "{}: collective {tag} issued twice by member {}",
                self.name, self.index
            )));
        }
        entry.inputs[self.index] = Some((kind, input.cloned()));
        if entry.inputs.iter().all(Option::is_some) {
            let taken: Vec<(Kind, Option<Tensor>)> = entry
                .inputs
                .iter_mut()
                .map(|x| x.take().expect("all arrived"))
                .collect();
            if let Some((i, (k, _))) = taken.iter().enumerate().find(|(_, (k, _))| *k != kind) {
                let msg = format!(
                    "{}: collective {tag}: member {} issued {k:?} while member {} issued {kind:?}: the ranks' schedules disagree",
                    self.name, i, self.index
                );
                drop(st);
                self.abort.abort(msg.clone());
                return Err(ExecError::Aborted(msg));
            }
            if kind != Kind::Barrier {
                let outs = combine(kind, taken.into_iter().map(|(_, t)| t).collect())?;
                entry.outputs = outs.into_iter().map(Some).collect();
            }
            entry.done = true;
            s.cv.notify_all();
        } else {
            while !st.entries.get(&tag).is_some_and(|e| e.done) {
                st = self.wait(st, deadline, kind, tag)?;
            }
        }
        let entry = st
            .entries
            .get_mut(&tag)
            .expect("the entry lives until every member took its result");
        let out = entry.outputs[self.index].take();
        entry.taken += 1;
        if entry.taken == size {
            st.entries.remove(&tag);
        }
        Ok(out)
    }

    fn wait<'a>(
        &self,
        st: std::sync::MutexGuard<'a, State>,
        deadline: Instant,
        kind: Kind,
        tag: u64,
    ) -> Result<std::sync::MutexGuard<'a, State>, ExecError> {
        self.check_abort()?;
        let now = Instant::now();
        if now >= deadline {
            let arrived: Vec<usize> = st.entries.get(&tag).map_or(Vec::new(), |e| {
                e.inputs
                    .iter()
                    .enumerate()
                    .filter(|(_, x)| x.is_some())
                    .map(|(i, _)| i)
                    .collect()
            });
            let msg = format!(
                "{}: {kind:?} {tag} timed out after {:.1} s (members arrived: {arrived:?} of {})",
                self.name,
                self.abort.timeout().as_secs_f64(),
                self.shared.size
            );
            drop(st);
            self.abort.abort(msg.clone());
            return Err(ExecError::Aborted(msg));
        }
        let (st, _) = self
            .shared
            .cv
            .wait_timeout(st, (deadline - now).min(Duration::from_millis(200)))
            .unwrap_or_else(|e| e.into_inner());
        self.check_abort()?;
        Ok(st)
    }
}

impl Collectives for LocalGroup {
    fn size(&self) -> usize {
        self.shared.size
    }

    fn index(&self) -> usize {
        self.index
    }

    fn all_gather(&self, tag: u64, input: &Tensor) -> Result<Tensor, ExecError> {
        self.run(tag, Kind::AllGather, Some(input))?
            .ok_or_else(|| ExecError::Internal("all-gather without a result".into()))
    }

    fn reduce_scatter(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        if input.dim(0)? % self.size() != 0 {
            return Err(ExecError::Internal(format!(
                "{}: reduce-scatter of {} elements over {} ranks",
                self.name,
                input.dim(0)?,
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

/// Builds the Local groups of `groups_of` (for each rank, the members of its group) under
/// the name `kind`; returns a map from rank to its handle.
pub fn local_groups(
    world: u64,
    kind: &str,
    members_of: impl Fn(u64) -> Vec<u64>,
    abort: &Arc<Abort>,
) -> HashMap<u64, LocalGroup> {
    let mut out = HashMap::new();
    for rank in 0..world {
        if out.contains_key(&rank) {
            continue;
        }
        let members = members_of(rank);
        let name = format!("{kind} group of ranks {members:?}");
        for (m, h) in members.iter().zip(local_group(members.len(), &name, abort)) {
            out.insert(*m, h);
        }
    }
    out
}

/// Every rank of `plan`'s mesh as a thread of this process, with a Local communicator per
/// (process group, stream).
pub fn place(plan: &shardplan_planner::Plan) -> super::Placement {
    let mesh = plan.mesh;
    let world = mesh.world();
    let abort = Arc::new(Abort::default());
    let mut comms: Vec<crate::comm::Comms> = (0..world).map(|_| Default::default()).collect();
    for (c, s) in super::channels(plan) {
        let kind = format!("{c:?} ({s:?} stream)").to_lowercase();
        let mut handles = local_groups(world, &kind, |r| c.members(&mesh, r), &abort);
        for (rank, comm) in comms.iter_mut().enumerate() {
            if let Some(h) = handles.remove(&(rank as u64)) {
                comm.insert(c, s, Box::new(h));
            }
        }
    }
    if mesh.tensor() > 1 {
        let mut handles = local_groups(world, "tensor (compute stream)", |r| mesh.tensor_group(r), &abort);
        for (rank, comm) in comms.iter_mut().enumerate() {
            if let Some(h) = handles.remove(&(rank as u64)) {
                comm.tensor = Some(Box::new(h));
            }
        }
    }
    if mesh.expert() > 1 {
        let mut handles = local_groups(world, "expert (compute stream)", |r| mesh.expert_group(r), &abort);
        for (rank, comm) in comms.iter_mut().enumerate() {
            if let Some(h) = handles.remove(&(rank as u64)) {
                comm.expert = Some(Box::new(h));
            }
        }
    }
    super::Placement {
        ranks: (0..world).zip(comms).collect(),
        processes: None,
        abort,
        backend: "local",
    }
}
