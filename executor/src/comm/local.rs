//! The `Local` backend: N ranks as threads of one process.
//!
//! Every result is computed by one thread from all contributions taken in rank order, so
//! sums do not depend on which rank arrives first. An all-to-all moves nothing: each member
//! takes the parts addressed to it, which share their storage with the sender's.

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

/// One all-to-all being assembled: every member's parts, taken by reference (tensors share
/// their storage), so nothing is copied.
struct Exchange {
    parts: Vec<Option<Vec<Tensor>>>,
    taken: usize,
}

struct State {
    /// Collectives in flight, by tag.
    entries: HashMap<u64, Entry>,
    /// All-to-alls in flight, by tag.
    exchanges: HashMap<u64, Exchange>,
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
            exchanges: HashMap::new(),
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

/// The members whose contribution has arrived.
fn present<T>(slots: &[Option<T>]) -> Vec<usize> {
    slots
        .iter()
        .enumerate()
        .filter(|(_, x)| x.is_some())
        .map(|(i, _)| i)
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
        if st.exchanges.contains_key(&tag) {
            drop(st);
            return Err(self.disagree(tag, &format!("{kind:?}")));
        }
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

    /// Aborts the run: member `self.index` issued `what` under a tag another member used for
    /// a different collective.
    fn disagree(&self, tag: u64, what: &str) -> ExecError {
        let msg = format!(
            "{}: collective {tag}: member {} issued {what} while another member issued a different collective: the ranks' schedules disagree",
            self.name, self.index
        );
        self.abort.abort(msg.clone());
        ExecError::Aborted(msg)
    }

    /// Sends `parts[q]` to member `q`: each member leaves its parts and takes, from every
    /// member, the one addressed to it (in member order).
    fn exchange(&self, tag: u64, parts: &[Tensor]) -> Result<Vec<Tensor>, ExecError> {
        let s = &self.shared;
        let deadline = Instant::now() + self.abort.timeout();
        let mut st = s.state.lock().unwrap_or_else(|e| e.into_inner());
        let size = s.size;
        if st.entries.contains_key(&tag) {
            drop(st);
            return Err(self.disagree(tag, "AllToAll"));
        }
        let x = st.exchanges.entry(tag).or_insert_with(|| Exchange {
            parts: vec![None; size],
            taken: 0,
        });
        if x.parts[self.index].is_some() {
            return Err(ExecError::Internal(format!(
                "{}: collective {tag} issued twice by member {}",
                self.name, self.index
            )));
        }
        x.parts[self.index] = Some(parts.to_vec());
        if x.parts.iter().all(Option::is_some) {
            s.cv.notify_all();
        } else {
            while !st
                .exchanges
                .get(&tag)
                .is_some_and(|x| x.parts.iter().all(Option::is_some))
            {
                st = self.wait_for(st, deadline, "AllToAll", tag, |st| {
                    st.exchanges.get(&tag).map_or(Vec::new(), |x| present(&x.parts))
                })?;
            }
        }
        let x = st
            .exchanges
            .get_mut(&tag)
            .expect("the exchange lives until every member took its parts");
        let me = self.index;
        let got = x
            .parts
            .iter()
            .map(|p| p.as_ref().expect("all arrived")[me].clone())
            .collect();
        x.taken += 1;
        if x.taken == size {
            st.exchanges.remove(&tag);
        }
        Ok(got)
    }

    fn wait<'a>(
        &self,
        st: std::sync::MutexGuard<'a, State>,
        deadline: Instant,
        kind: Kind,
        tag: u64,
    ) -> Result<std::sync::MutexGuard<'a, State>, ExecError> {
        self.wait_for(st, deadline, &format!("{kind:?}"), tag, |st| {
            st.entries.get(&tag).map_or(Vec::new(), |e| present(&e.inputs))
        })
    }

    /// Waits for the group's next change, failing at `deadline` (naming the members that
    /// `arrived` reports) or when the run aborts.
    fn wait_for<'a>(
        &self,
        st: std::sync::MutexGuard<'a, State>,
        deadline: Instant,
        what: &str,
        tag: u64,
        arrived: impl Fn(&State) -> Vec<usize>,
    ) -> Result<std::sync::MutexGuard<'a, State>, ExecError> {
        self.check_abort()?;
        let now = Instant::now();
        if now >= deadline {
            let arrived = arrived(&st);
            let msg = format!(
                "{}: {what} {tag} timed out after {:.1} s (members arrived: {arrived:?} of {})",
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

    fn all_to_all(&self, tag: u64, parts: &[Tensor], lens: &[usize]) -> Result<Vec<Tensor>, ExecError> {
        super::check_parts(parts, lens, self.size())?;
        let got = self.exchange(tag, parts)?;
        super::check_received(&got, lens)?;
        Ok(got)
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
    if mesh.context() > 1 {
        let mut handles = local_groups(world, "context (compute stream)", |r| mesh.context_group(r), &abort);
        for (rank, comm) in comms.iter_mut().enumerate() {
            if let Some(h) = handles.remove(&(rank as u64)) {
                comm.context = Some(Box::new(h));
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

/// Runs `f(member, index)` on every member of a Local group of `n` threads; their results
/// in member order (tests of the collectives and of what rides on them).
#[cfg(test)]
pub(crate) fn on_group<T: Send>(n: usize, f: impl Fn(LocalGroup, usize) -> T + Sync) -> Vec<T> {
    let abort = Arc::new(Abort::default());
    let groups = local_group(n, "test", &abort);
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(r, g)| {
                let f = &f;
                s.spawn(move || f(g, r))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The trait's default all-to-all (two all-gathers) over a Local group.
    struct Gathered(LocalGroup);

    impl Collectives for Gathered {
        fn size(&self) -> usize {
            self.0.size()
        }
        fn index(&self) -> usize {
            self.0.index()
        }
        fn all_gather(&self, tag: u64, input: &Tensor) -> Result<Tensor, ExecError> {
            self.0.all_gather(tag, input)
        }
        fn reduce_scatter(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
            self.0.reduce_scatter(tag, input, op)
        }
        fn all_reduce(&self, tag: u64, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
            self.0.all_reduce(tag, input, op)
        }
        fn broadcast(&self, tag: u64, input: &Tensor) -> Result<Tensor, ExecError> {
            self.0.broadcast(tag, input)
        }
        fn barrier(&self, tag: u64) -> Result<(), ExecError> {
            self.0.barrier(tag)
        }
    }

    /// Member `r`'s part for member `q`: `r * 10 + q` repeated `(r + 2 * q) % 4` times (some
    /// empty).
    fn part(r: usize, q: usize) -> Tensor {
        let n = (r + 2 * q) % 4;
        Tensor::from_vec(vec![(r * 10 + q) as f32; n], n, &Device::Cpu).unwrap()
    }

    #[test]
    fn all_to_all_hands_each_member_its_parts_as_the_default_does() {
        let n = 3;
        let run = |gathered: bool| {
            on_group(n, |g, r| {
                let parts: Vec<Tensor> = (0..n).map(|q| part(r, q)).collect();
                let lens: Vec<usize> = (0..n).map(|q| part(q, r).elem_count()).collect();
                let got = if gathered {
                    Gathered(g).all_to_all(0, &parts, &lens)
                } else {
                    g.all_to_all(0, &parts, &lens)
                };
                got.unwrap()
                    .iter()
                    .map(|t| t.to_vec1::<f32>().unwrap())
                    .collect::<Vec<_>>()
            })
        };
        let direct = run(false);
        for (me, got) in direct.iter().enumerate() {
            let want: Vec<Vec<f32>> = (0..n).map(|q| part(q, me).to_vec1().unwrap()).collect();
            assert_eq!(got, &want, "member {me}");
        }
        assert_eq!(direct, run(true));
    }

    /// A member expecting another length than its peer sent (routing from another table)
    /// fails naming the member, on both the exchange and the default.
    #[test]
    fn an_all_to_all_receiving_other_lengths_than_expected_fails() {
        let n = 2;
        for gathered in [false, true] {
            let out = on_group(n, |g, r| {
                let parts: Vec<Tensor> = (0..n).map(|q| part(r, q)).collect();
                let mut lens: Vec<usize> = (0..n).map(|q| part(q, r).elem_count()).collect();
                if r == 1 {
                    lens[0] += 1;
                }
                let got = if gathered {
                    Gathered(g).all_to_all(0, &parts, &lens)
                } else {
                    g.all_to_all(0, &parts, &lens)
                };
                got.map(|_| ()).map_err(|e| e.to_string())
            });
            assert!(out[0].is_ok(), "{:?}", out[0]);
            let e = out[1].as_ref().unwrap_err();
            assert!(e.contains("member 0 sent") && e.contains("routing disagrees"), "{e}");
        }
    }

    #[test]
    fn an_all_to_all_against_another_collective_aborts_naming_it() {
        let out = on_group(2, |g, r| {
            if r == 0 {
                let parts = [part(0, 0), part(0, 1)];
                let lens = [part(0, 0).elem_count(), part(1, 0).elem_count()];
                g.all_to_all(7, &parts, &lens).map(|_| ()).map_err(|e| e.to_string())
            } else {
                // Arrive second, so the all-to-all is already waiting.
                std::thread::sleep(Duration::from_millis(50));
                g.all_gather(7, &part(1, 1)).map(|_| ()).map_err(|e| e.to_string())
            }
        });
        for e in &out {
            let e = e.as_ref().unwrap_err();
            assert!(e.contains("collective 7") && e.contains("schedules disagree"), "{e}");
        }
    }
}
