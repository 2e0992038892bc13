//! Collectives: the operations ranks do together, per process group, and the `Local`
//! backend that runs N ranks as threads of one process.
//!
//! Local moves real data between the ranks' tensors. Every result is computed by one
//! thread from all contributions taken in rank order, so sums do not depend on which rank
//! arrives first. Every wait has a timeout, and any rank can abort the world: waiters then
//! return the abort's message instead of hanging.

use crate::ExecError;
use candle_core::{DType, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How contributions combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    /// Sum divided by the group size.
    Avg,
}

/// A process group as one rank sees it.
pub trait Collectives: Send + Sync {
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// This rank's index in the group.
    fn index(&self) -> usize;
    /// Concatenates every rank's `input` (equal sizes) in group order.
    fn all_gather(&self, input: &Tensor) -> Result<Tensor, ExecError>;
    /// Reduces every rank's `input` (its length a multiple of the group size) and returns
    /// this rank's chunk of the result; computed in `input`'s dtype.
    fn reduce_scatter(&self, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError>;
    /// Reduces every rank's `input` and returns the result to all.
    fn all_reduce(&self, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError>;
    /// Group member 0's `input`, to all.
    fn broadcast(&self, input: &Tensor) -> Result<Tensor, ExecError>;
    /// Returns when every member has arrived.
    fn barrier(&self) -> Result<(), ExecError>;
}

/// Why the world stopped: the first failure any rank reported.
#[derive(Default)]
pub struct Abort {
    reason: Mutex<Option<String>>,
    watchers: Mutex<Vec<Arc<Shared>>>,
}

impl Abort {
    /// Records `reason` (the first one wins) and wakes every waiting rank.
    pub fn abort(&self, reason: String) {
        {
            let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
            if r.is_none() {
                *r = Some(reason);
            }
        }
        for w in self.watchers.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _guard = w.state.lock().unwrap_or_else(|e| e.into_inner());
            w.cv.notify_all();
        }
    }

    /// The reason, if the world was aborted.
    pub fn reason(&self) -> Option<String> {
        self.reason.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    AllGather,
    ReduceScatter(Reduce),
    AllReduce(Reduce),
    Broadcast,
    Barrier,
}

struct State {
    /// Incremented each time a collective completes.
    generation: u64,
    /// Contributions of the collective being gathered, by group index.
    inputs: Vec<Option<(Kind, Option<Tensor>)>>,
    /// Results of the last completed collective, by group index, and how many remain.
    outputs: Vec<Option<Tensor>>,
    pending_outputs: usize,
}

struct Shared {
    size: usize,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank's handle on a Local process group.
pub struct LocalGroup {
    shared: Arc<Shared>,
    index: usize,
    timeout: Duration,
    abort: Arc<Abort>,
    /// Printed in errors (`shard group of ranks 0-3`).
    name: String,
}

/// Creates the handles of one group of `size` ranks (index i for member i).
pub fn local_group(size: usize, name: &str, timeout: Duration, abort: &Arc<Abort>) -> Vec<LocalGroup> {
    let shared = Arc::new(Shared {
        size,
        state: Mutex::new(State {
            generation: 0,
            inputs: vec![None; size],
            outputs: vec![None; size],
            pending_outputs: 0,
        }),
        cv: Condvar::new(),
    });
    abort
        .watchers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(shared.clone());
    (0..size)
        .map(|index| LocalGroup {
            shared: shared.clone(),
            index,
            timeout,
            abort: abort.clone(),
            name: name.to_string(),
        })
        .collect()
}

fn combine(kind: Kind, inputs: Vec<Option<Tensor>>) -> Result<Vec<Tensor>, ExecError> {
    let n = inputs.len();
    let ins: Vec<Tensor> = inputs.into_iter().map(|t| t.expect("every data collective has inputs")).collect();
    let reduce = |op: Reduce| -> Result<Tensor, ExecError> {
        // Sum in rank order, in f64 for f32 data would change results across meshes; keep
        // the contributions' dtype, as NCCL does.
        let mut acc = ins[0].clone();
        for t in &ins[1..] {
            acc = (acc + t)?;
        }
        Ok(match op {
            Reduce::Sum => acc,
            Reduce::Avg => (acc / n as f64)?,
        })
    };
    Ok(match kind {
        Kind::AllGather => {
            let all = Tensor::cat(&ins, 0)?;
            vec![all; n]
        }
        Kind::ReduceScatter(op) => {
            let r = reduce(op)?;
            let chunk = r.dim(0)? / n;
            (0..n).map(|i| r.narrow(0, i * chunk, chunk)).collect::<Result<_, _>>()?
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

    fn run(&self, kind: Kind, input: Option<&Tensor>) -> Result<Option<Tensor>, ExecError> {
        let s = &self.shared;
        let deadline = Instant::now() + self.timeout;
        let mut st = s.state.lock().unwrap_or_else(|e| e.into_inner());
        // Wait until the previous collective's results are all taken and our slot is free.
        while st.pending_outputs > 0 || st.inputs[self.index].is_some() {
            st = self.wait(st, deadline, kind)?;
        }
        st.inputs[self.index] = Some((kind, input.cloned()));
        let my_generation = st.generation;
        if st.inputs.iter().all(Option::is_some) {
            let taken: Vec<(Kind, Option<Tensor>)> = st.inputs.iter_mut().map(|x| x.take().expect("all arrived")).collect();
            if let Some((i, (k, _))) = taken.iter().enumerate().find(|(_, (k, _))| *k != kind) {
                let msg = format!(
                    "{}: member {} issued {k:?} while member {} issued {kind:?}: the ranks' schedules disagree",
                    self.name, i, self.index
                );
                self.abort.abort(msg.clone());
                return Err(ExecError::Aborted(msg));
            }
            if kind != Kind::Barrier {
                let outs = combine(kind, taken.into_iter().map(|(_, t)| t).collect())?;
                st.outputs = outs.into_iter().map(Some).collect();
            }
            st.pending_outputs = s.size;
            st.generation += 1;
            s.cv.notify_all();
        } else {
            while st.generation == my_generation {
                st = self.wait(st, deadline, kind)?;
            }
        }
        let out = st.outputs[self.index].take();
        st.pending_outputs -= 1;
        if st.pending_outputs == 0 {
            s.cv.notify_all();
        }
        Ok(out)
    }

    fn wait<'a>(
        &self,
        st: std::sync::MutexGuard<'a, State>,
        deadline: Instant,
        kind: Kind,
    ) -> Result<std::sync::MutexGuard<'a, State>, ExecError> {
        self.check_abort()?;
        let now = Instant::now();
        if now >= deadline {
            let arrived: Vec<usize> = st
                .inputs
                .iter()
                .enumerate()
                .filter(|(_, x)| x.is_some())
                .map(|(i, _)| i)
                .collect();
            let msg = format!(
                "{}: {kind:?} timed out after {:.1} s (members arrived: {arrived:?} of {})",
                self.name,
                self.timeout.as_secs_f64(),
                self.shared.size
            );
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

    fn all_gather(&self, input: &Tensor) -> Result<Tensor, ExecError> {
        self.run(Kind::AllGather, Some(input))?
            .ok_or_else(|| ExecError::Internal("all-gather without a result".into()))
    }

    fn reduce_scatter(&self, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        if input.dim(0)? % self.size() != 0 {
            return Err(ExecError::Internal(format!(
                "{}: reduce-scatter of {} elements over {} ranks",
                self.name,
                input.dim(0)?,
                self.size()
            )));
        }
        self.run(Kind::ReduceScatter(op), Some(input))?
            .ok_or_else(|| ExecError::Internal("reduce-scatter without a result".into()))
    }

    fn all_reduce(&self, input: &Tensor, op: Reduce) -> Result<Tensor, ExecError> {
        self.run(Kind::AllReduce(op), Some(input))?
            .ok_or_else(|| ExecError::Internal("all-reduce without a result".into()))
    }

    fn broadcast(&self, input: &Tensor) -> Result<Tensor, ExecError> {
        self.run(Kind::Broadcast, Some(input))?
            .ok_or_else(|| ExecError::Internal("broadcast without a result".into()))
    }

    fn barrier(&self) -> Result<(), ExecError> {
        self.run(Kind::Barrier, None).map(|_| ())
    }
}

/// Every Local group of a mesh, by (kind name, first member), for each rank.
pub struct LocalWorld {
    pub groups: HashMap<(String, u64), Vec<Option<LocalGroup>>>,
}

/// Builds the Local groups of `groups_of` (for each rank, the members of its group) under
/// the name `kind`; returns a map from rank to its handle.
pub fn local_groups(
    world: u64,
    kind: &str,
    members_of: impl Fn(u64) -> Vec<u64>,
    timeout: Duration,
    abort: &Arc<Abort>,
) -> HashMap<u64, LocalGroup> {
    let mut out = HashMap::new();
    for rank in 0..world {
        if out.contains_key(&rank) {
            continue;
        }
        let members = members_of(rank);
        let name = format!("{kind} group of ranks {members:?}");
        for (m, h) in members.iter().zip(local_group(members.len(), &name, timeout, abort)) {
            out.insert(*m, h);
        }
    }
    out
}

/// Bytes of a tensor.
pub fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// The dtype collectives reduce in when a caller asks for `d`.
pub fn reduce_dtype(d: DType) -> DType {
    d
}
