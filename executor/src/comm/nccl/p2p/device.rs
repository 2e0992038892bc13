//! The GPU part of the NCCL pipeline link (feature `cuda`): a communicator per directed
//! pair of neighbours, sends on a CUDA stream of their own that the host waits for, and a
//! receiving thread per incoming pair (see the parent module for why).

use super::{Header, HEADER_WORDS};
use crate::comm::nccl::device::{by_dtype, cuda_err, join_comm, nccl_err, Shared};
use crate::comm::nccl::ID_BYTES;
use crate::comm::p2p::{Mailbox, PointToPoint};
use crate::comm::Abort;
use crate::ExecError;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Shape, Storage, Tensor};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One end of a directed pair's communicator: this process sends on it (member 0) or
/// receives on it (member 1).
pub struct PairEnd {
    comm: Shared,
    stream: Arc<CudaStream>,
    /// The peer's index in the link.
    peer: usize,
    name: String,
}

impl PairEnd {
    /// Joins the communicator of the pair `name` with unique id `id`: as its sender
    /// (`sending`) or its receiver; `peer` is the other end's index in the link.
    #[allow(clippy::too_many_arguments)]
    pub fn join(
        name: String,
        sending: bool,
        peer: usize,
        id: [u8; ID_BYTES],
        dev: &CudaDevice,
        abort: &Abort,
        rank: u64,
    ) -> Result<PairEnd, ExecError> {
        let stream = dev
            .cuda_stream()
            .context()
            .new_stream()
            .map_err(|e| cuda_err("creating a pipeline link stream", e))?;
        let comm = join_comm(&name, usize::from(!sending), 2, id, stream.clone(), abort, rank)?;
        Ok(PairEnd {
            comm: Shared(comm),
            stream,
            peer,
            name,
        })
    }

    /// Waits, polling, until the work issued on this end's stream so far is done: the
    /// world's abort and `give_up` (the link closing) end the wait, and so does
    /// `timeout` when given.
    fn wait(
        &self,
        what: &str,
        abort: &Abort,
        give_up: &dyn Fn() -> bool,
        timeout: Option<Duration>,
    ) -> Result<(), ExecError> {
        let ev = self
            .stream
            .record_event(None)
            .map_err(|e| cuda_err("recording a pipeline transfer's completion", e))?;
        let start = Instant::now();
        loop {
            match ev.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(ExecError::Aborted(format!("{}: {what}: CUDA error {e:?}", self.name))),
            }
            if let Some(r) = abort.reason() {
                return Err(ExecError::Aborted(r));
            }
            if give_up() {
                return Err(ExecError::Aborted(format!("{}: closed during {what}", self.name)));
            }
            if timeout.is_some_and(|t| start.elapsed() > t) {
                let msg = format!(
                    "{}: {what} did not finish within {:.1} s (the collective timeout): is the peer's receiving thread alive?",
                    self.name,
                    start.elapsed().as_secs_f64()
                );
                abort.abort(msg.clone());
                return Err(ExecError::Aborted(msg));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Sends `header`, then (unless it is the stop) `t`'s elements, and waits until both
    /// have left (the peer's receiving thread takes them at once).
    fn send(&self, header: &Header, t: Option<&Tensor>, abort: &Abort) -> Result<(), ExecError> {
        let words = self
            .stream
            .clone_htod(&header.encode()?)
            .map_err(|e| cuda_err("copying a pipeline message header to the GPU", e))?;
        self.comm
            .0
            .send(&words, 1)
            .map_err(|e| nccl_err(&self.name, "send", e))?;
        if let Some(t) = t {
            let t = t.contiguous()?;
            let (storage, layout) = t.storage_and_layout();
            let Storage::Cuda(cs) = &*storage else {
                return Err(ExecError::Internal(format!(
                    "{}: sending a tensor that is not on the GPU",
                    self.name
                )));
            };
            // The tensor may come from a kernel just launched on the compute stream.
            self.stream
                .join(&cs.device().cuda_stream())
                .map_err(|e| cuda_err("ordering a pipeline send after its tensor", e))?;
            let (off, n) = (layout.start_offset(), t.elem_count());
            by_dtype!(t.dtype(), T => {
                let src = cs.as_cuda_slice::<T>()?.slice(off..off + n);
                self.comm.0.send(&src, 1).map_err(|e| nccl_err(&self.name, "send", e))
            })?;
        }
        self.wait("a send", abort, &|| false, Some(abort.timeout()))
    }

    /// Receives the next message's header, or `None` once the link closes or the world
    /// aborts.
    fn recv_header(&self, abort: &Abort, closing: &AtomicBool) -> Result<Option<Header>, ExecError> {
        // SAFETY: the receive writes every word before the host reads them.
        let mut words = unsafe { self.stream.alloc::<u64>(HEADER_WORDS) }
            .map_err(|e| cuda_err("allocating a pipeline message header", e))?;
        self.comm
            .0
            .recv(&mut words, 0)
            .map_err(|e| nccl_err(&self.name, "receive", e))?;
        match self.wait(
            "waiting for a message",
            abort,
            &|| closing.load(Ordering::Relaxed),
            None,
        ) {
            Ok(()) => {}
            Err(_) if closing.load(Ordering::Relaxed) || abort.reason().is_some() => return Ok(None),
            Err(e) => return Err(e),
        }
        let host = self
            .stream
            .clone_dtoh(&words)
            .map_err(|e| cuda_err("copying a pipeline message header to the host", e))?;
        let words: [u64; HEADER_WORDS] = host
            .try_into()
            .map_err(|_| ExecError::Internal(format!("{}: a header of the wrong length", self.name)))?;
        let header = Header::decode(&words, &self.name)?;
        Ok((header.tag != super::STOP_TAG).then_some(header))
    }

    /// Receives the elements `header` announces into a tensor on `dev`.
    fn recv_tensor(&self, header: &Header, dev: &CudaDevice, abort: &Abort) -> Result<Tensor, ExecError> {
        let n = header.elems();
        let storage = by_dtype!(header.dtype, T => {
            // SAFETY: the receive writes every element before anything reads them.
            let mut out = unsafe { dev.alloc::<T>(n.max(1)) }?;
            self.comm
                .0
                .recv(&mut out.slice_mut(0..n), 0)
                .map_err(|e| nccl_err(&self.name, "receive", e))?;
            Ok(Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev.clone())))
        })?;
        self.wait("a receive", abort, &|| false, Some(abort.timeout()))?;
        let t = Tensor::from_storage(storage, Shape::from(n.max(1)), BackpropOp::none(), false);
        Ok(t.narrow(0, 0, n)?.reshape(header.dims.as_slice())?)
    }
}

/// One process's end of a pipeline link over NCCL.
pub struct NcclLink {
    index: usize,
    size: usize,
    /// The pairs this process sends on, by the receiving peer's index.
    out: HashMap<usize, PairEnd>,
    mailbox: Arc<Mailbox>,
    abort: Arc<Abort>,
    closing: Arc<AtomicBool>,
    receivers: Vec<std::thread::JoinHandle<()>>,
}

impl NcclLink {
    /// This process's end, member `index` of a link of `size`: it sends on `out` and
    /// starts a receiving thread on each of `incoming`.
    pub fn start(
        index: usize,
        size: usize,
        out: Vec<PairEnd>,
        incoming: Vec<PairEnd>,
        dev: &CudaDevice,
        abort: Arc<Abort>,
    ) -> NcclLink {
        let mailbox = Arc::new(Mailbox::default());
        abort.watch(mailbox.clone());
        let closing = Arc::new(AtomicBool::new(false));
        let receivers = incoming
            .into_iter()
            .map(|end| {
                let (mailbox, abort, closing, dev) = (mailbox.clone(), abort.clone(), closing.clone(), dev.clone());
                std::thread::spawn(move || receive_loop(&end, index, &dev, &mailbox, &abort, &closing))
            })
            .collect();
        NcclLink {
            index,
            size,
            out: out.into_iter().map(|e| (e.peer, e)).collect(),
            mailbox,
            abort,
            closing,
            receivers,
        }
    }
}

/// Receives every message of one incoming pair into the mailbox until its sender's stop,
/// the link's close or the world's abort; a failure aborts the world.
fn receive_loop(end: &PairEnd, me: usize, dev: &CudaDevice, mailbox: &Mailbox, abort: &Abort, closing: &AtomicBool) {
    let run = || -> Result<(), ExecError> {
        while let Some(header) = end.recv_header(abort, closing)? {
            let t = end.recv_tensor(&header, dev, abort)?;
            mailbox.put((end.peer, me, header.tag), t, "pipeline link")?;
        }
        Ok(())
    };
    if let Err(e) = run() {
        abort.abort(e.to_string());
    }
}

impl PointToPoint for NcclLink {
    fn size(&self) -> usize {
        self.size
    }

    fn index(&self) -> usize {
        self.index
    }

    fn send(&self, peer: usize, tag: u64, t: &Tensor) -> Result<(), ExecError> {
        if let Some(r) = self.abort.reason() {
            return Err(ExecError::Aborted(r));
        }
        let end = self.out.get(&peer).ok_or_else(|| {
            ExecError::Internal(format!(
                "pipeline link: member {} has no pair to member {peer} (only its ring neighbours)",
                self.index
            ))
        })?;
        let header = Header {
            tag,
            dtype: t.dtype(),
            dims: t.dims().to_vec(),
        };
        end.send(&header, Some(t), &self.abort)
    }

    fn recv(&self, peer: usize, tag: u64) -> Result<Tensor, ExecError> {
        self.mailbox.take((peer, self.index, tag), &self.abort, "pipeline link")
    }
}

impl Drop for NcclLink {
    /// Stops the peers' receiving threads (each reads this end's stop), then this end's
    /// own: they end on their senders' stops, or give up once the link is closed.
    fn drop(&mut self) {
        for end in self.out.values() {
            if self.abort.reason().is_none() {
                let _ = end.send(&Header::stop(), None, &self.abort);
            }
        }
        let grace = Instant::now() + Duration::from_secs(10);
        while self.receivers.iter().any(|r| !r.is_finished()) && Instant::now() < grace {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.closing.store(true, Ordering::Relaxed);
        for r in self.receivers.drain(..) {
            let _ = r.join();
        }
    }
}
