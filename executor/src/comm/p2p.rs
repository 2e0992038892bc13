//! Point-to-point transfers between the ranks of a pipeline: a stage's activation to the
//! next stage's rank, its input gradient back. The `PointToPoint` trait, and its `Local`
//! backend (ranks as threads: a mailbox each receiver waits on).

use super::{Abort, Wake};
use crate::ExecError;
use candle_core::Tensor;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Sends and receives between the members of one group, matched by sender, receiver and
/// tag (each transfer's own: no two in flight share one).
pub trait PointToPoint: Send + Sync {
    /// Members of the group.
    fn size(&self) -> usize;
    /// This member's index.
    fn index(&self) -> usize;
    /// Sends `t` to member `peer` under `tag`; returns once `t` is no longer needed here.
    fn send(&self, peer: usize, tag: u64, t: &Tensor) -> Result<(), ExecError>;
    /// Waits for what member `peer` sent this one under `tag`.
    fn recv(&self, peer: usize, tag: u64) -> Result<Tensor, ExecError>;
}

/// What has been sent and not yet received, by (sender, receiver, tag): each backend's
/// receiver waits on it, under the run's timeout and abort.
#[derive(Default)]
pub struct Mailbox {
    waiting: Mutex<HashMap<(usize, usize, u64), Tensor>>,
    arrived: Condvar,
}

impl Wake for Mailbox {
    fn wake(&self) {
        let _guard = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        self.arrived.notify_all();
    }
}

impl Mailbox {
    /// Leaves `t`, sent by `from` to `to` under `tag`; refuses a second one under the same
    /// key (`name` names the group in the error).
    pub fn put(&self, (from, to, tag): (usize, usize, u64), t: Tensor, name: &str) -> Result<(), ExecError> {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if waiting.insert((from, to, tag), t).is_some() {
            return Err(ExecError::Internal(format!(
                "{name}: member {from} sent tag {tag} to member {to} twice"
            )));
        }
        self.arrived.notify_all();
        Ok(())
    }

    /// Waits for what `from` sent `to` under `tag`, up to `abort`'s timeout; a timeout
    /// aborts the run naming the wait.
    pub fn take(&self, (from, to, tag): (usize, usize, u64), abort: &Abort, name: &str) -> Result<Tensor, ExecError> {
        let deadline = Instant::now() + abort.timeout();
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(t) = waiting.remove(&(from, to, tag)) {
                return Ok(t);
            }
            if let Some(r) = abort.reason() {
                return Err(ExecError::Aborted(r));
            }
            let now = Instant::now();
            if now >= deadline {
                let msg = format!(
                    "{name}: member {to} waited {:.1} s for tag {tag} from member {from}",
                    abort.timeout().as_secs_f64()
                );
                drop(waiting);
                abort.abort(msg.clone());
                return Err(ExecError::Aborted(msg));
            }
            waiting = self
                .arrived
                .wait_timeout(waiting, (deadline - now).min(Duration::from_millis(200)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// One member's handle on a Local point-to-point group.
pub struct LocalP2p {
    shared: Arc<Mailbox>,
    size: usize,
    index: usize,
    abort: Arc<Abort>,
    /// Printed in errors (`pipeline group`).
    name: String,
}

/// The handles of one group of `size` members (index i for member i).
pub fn local_p2p(size: usize, name: &str, abort: &Arc<Abort>) -> Vec<LocalP2p> {
    let shared = Arc::new(Mailbox::default());
    abort.watch(shared.clone());
    (0..size)
        .map(|index| LocalP2p {
            shared: shared.clone(),
            size,
            index,
            abort: abort.clone(),
            name: name.to_string(),
        })
        .collect()
}

impl LocalP2p {
    fn check_peer(&self, peer: usize) -> Result<(), ExecError> {
        if peer >= self.size || peer == self.index {
            return Err(ExecError::Internal(format!(
                "{}: member {} cannot exchange with member {peer} of {}",
                self.name, self.index, self.size
            )));
        }
        match self.abort.reason() {
            Some(r) => Err(ExecError::Aborted(r)),
            None => Ok(()),
        }
    }
}

impl PointToPoint for LocalP2p {
    fn size(&self) -> usize {
        self.size
    }

    fn index(&self) -> usize {
        self.index
    }

    fn send(&self, peer: usize, tag: u64, t: &Tensor) -> Result<(), ExecError> {
        self.check_peer(peer)?;
        self.shared.put((self.index, peer, tag), t.clone(), &self.name)
    }

    fn recv(&self, peer: usize, tag: u64) -> Result<Tensor, ExecError> {
        self.check_peer(peer)?;
        self.shared.take((peer, self.index, tag), &self.abort, &self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn a_send_reaches_its_receiver_by_tag_in_any_order() {
        let abort = Arc::new(Abort::default());
        let ends = local_p2p(2, "pipeline group", &abort);
        let a = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        let b = Tensor::new(&[3f32], &Device::Cpu).unwrap();
        ends[0].send(1, 7, &a).unwrap();
        ends[0].send(1, 5, &b).unwrap();
        assert_eq!(ends[1].recv(0, 5).unwrap().to_vec1::<f32>().unwrap(), vec![3.0]);
        assert_eq!(ends[1].recv(0, 7).unwrap().to_vec1::<f32>().unwrap(), vec![1.0, 2.0]);
    }

    #[test]
    fn a_receive_nobody_sends_times_out_and_aborts() {
        let abort = Arc::new(Abort::default());
        abort.set_timeout(Duration::from_millis(50));
        let ends = local_p2p(2, "pipeline group", &abort);
        let err = ends[1].recv(0, 1).unwrap_err().to_string();
        assert!(err.contains("waited") && err.contains("tag 1"), "{err}");
        assert!(abort.reason().is_some());
    }

    #[test]
    fn a_rank_cannot_send_to_itself() {
        let abort = Arc::new(Abort::default());
        let ends = local_p2p(2, "pipeline group", &abort);
        let t = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        assert!(ends[0].send(0, 1, &t).is_err());
        assert!(ends[0].recv(2, 1).is_err());
    }
}
