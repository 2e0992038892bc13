//! A pipeline mesh over MPI, one rank per process: the shard, replicate, tensor and world
//! communicators split from the world, and the pipeline link, whose sends and receives
//! go through a receiving thread.
//!
//! A pipeline rank's program sends to and receives from its neighbours in an order the
//! other side need not mirror (interleaved stages consume in another order than they are
//! made). So every process runs one thread that receives whatever arrives on the link's
//! communicator into a mailbox keyed by (sender, tag), and a send is a blocking
//! `MPI_Send` that the peer's thread always matches: no send waits on the peer's program.
//! A message is the tensor's dtype, rank and dims, then its elements as they lie.

use crate::{split_group, MpiWorld, SharedComm, Watchdog};
use candle_core::{DType, Device, Tensor};
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::topology::Communicator;
use shardplan_executor::comm::p2p::{Mailbox, PointToPoint};
use shardplan_executor::comm::{Abort, Collectives};
use shardplan_executor::train::pipeline::{GroupMembers, PipelineEnds, PipelinePlacement};
use shardplan_executor::ExecError;
use shardplan_frontends::MeshShape;
use std::sync::{Arc, Mutex};

/// The tag that stops a link's receiving thread (sent by the process to itself).
const STOP: i32 = i32::MAX - 1;

/// This process's rank of a pipeline `mesh` with its ends over MPI. Collective: every
/// process calls it with the same mesh.
pub fn place_pipeline(world: &MpiWorld, mesh: &MeshShape) -> Result<PipelinePlacement, ExecError> {
    let size = mesh.pipeline * mesh.stage_world();
    if world.size != size {
        return Err(ExecError::Unsupported(format!(
            "the mesh has {size} ranks (pipeline {} x replicate {} x shard {} x tensor {}), but MPI started {} processes: run `mpirun -np {size}`",
            mesh.pipeline, mesh.replicate, mesh.shard, mesh.tensor, world.size
        )));
    }
    let abort = Arc::new(Abort::default());
    let dog = Arc::new(Watchdog {
        in_flight: Mutex::new(Vec::new()),
        next: Default::default(),
    });
    dog.spawn(world.world.clone(), abort.clone(), world.rank);
    let g = GroupMembers::of(mesh, world.rank as usize);
    // Every process splits the same five times, in this order.
    let link = split_group(world, &dog, &g.link, "pipeline group".into())?;
    let boxed = |g: crate::MpiGroup| Box::new(g) as Box<dyn Collectives>;
    let shard = boxed(split_group(world, &dog, &g.shard, "shard group".into())?);
    let replicate = boxed(split_group(world, &dog, &g.replicate, "replicate group".into())?);
    let tensor = boxed(split_group(world, &dog, &g.tensor, "tensor group".into())?);
    let all = boxed(split_group(world, &dog, &g.world, "world".into())?);
    let ends = PipelineEnds {
        p2p: Box::new(MpiLink::start(link.comm, link.index, link.size, abort.clone())),
        shard: (mesh.shard > 1).then_some(shard),
        replicate: (mesh.replicate > 1).then_some(replicate),
        tensor: (mesh.tensor > 1).then_some(tensor),
        world: all,
    };
    Ok(PipelinePlacement {
        ranks: vec![(world.rank as usize, ends)],
        abort,
    })
}

/// One process's end of the pipeline link over MPI.
pub struct MpiLink {
    comm: Arc<SharedComm>,
    index: usize,
    size: usize,
    mailbox: Arc<Mailbox>,
    abort: Arc<Abort>,
    receiver: Option<std::thread::JoinHandle<()>>,
}

impl MpiLink {
    /// The link on `comm` (this process is member `index` of `size`), with its receiving
    /// thread started.
    fn start(comm: SharedComm, index: usize, size: usize, abort: Arc<Abort>) -> MpiLink {
        let comm = Arc::new(comm);
        let mailbox = Arc::new(Mailbox::default());
        let receiver = {
            let (comm, mailbox, abort) = (comm.clone(), mailbox.clone(), abort.clone());
            std::thread::spawn(move || receive_loop(&comm, index, &mailbox, &abort))
        };
        MpiLink {
            comm,
            index,
            size,
            mailbox,
            abort,
            receiver: Some(receiver),
        }
    }
}

/// Receives every message of the link into the mailbox until this process's STOP.
fn receive_loop(comm: &SharedComm, me: usize, mailbox: &Mailbox, abort: &Abort) {
    loop {
        let (bytes, status) = comm.0.any_process().matched_probe().matched_receive_vec::<u8>();
        if status.tag() == STOP {
            return;
        }
        match decode(&bytes) {
            Ok(t) => {
                let key = (status.source_rank() as usize, me, status.tag() as u64);
                if let Err(e) = mailbox.put(key, t, "pipeline link") {
                    abort.abort(e.to_string());
                }
            }
            Err(e) => abort.abort(format!(
                "pipeline link: a message from rank {} is malformed: {e}",
                status.source_rank()
            )),
        }
    }
}

impl Drop for MpiLink {
    fn drop(&mut self) {
        // Stop this process's receiving thread: a message to itself under STOP.
        self.comm
            .0
            .process_at_rank(self.index as i32)
            .send_with_tag(&[0u8][..], STOP);
        if let Some(r) = self.receiver.take() {
            let _ = r.join();
        }
    }
}

impl PointToPoint for MpiLink {
    fn size(&self) -> usize {
        self.size
    }

    fn index(&self) -> usize {
        self.index
    }

    fn send(&self, peer: usize, tag: u64, t: &Tensor) -> Result<(), ExecError> {
        if peer >= self.size || peer == self.index {
            return Err(ExecError::Internal(format!(
                "pipeline link: member {} cannot send to member {peer} of {}",
                self.index, self.size
            )));
        }
        let tag = i32::try_from(tag)
            .ok()
            .filter(|&t| t < STOP)
            .ok_or_else(|| ExecError::Unsupported(format!("pipeline link: tag {tag} is past MPI's tags")))?;
        let bytes = encode(t)?;
        self.comm.0.process_at_rank(peer as i32).send_with_tag(&bytes[..], tag);
        Ok(())
    }

    fn recv(&self, peer: usize, tag: u64) -> Result<Tensor, ExecError> {
        self.mailbox.take((peer, self.index, tag), &self.abort, "pipeline link")
    }
}

/// The dtypes a link carries, by their code in a message.
const DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::U32];

/// `t` as a message: dtype code, rank, dims (u64 little-endian), then the elements.
fn encode(t: &Tensor) -> Result<Vec<u8>, ExecError> {
    let code = DTYPES
        .iter()
        .position(|&d| d == t.dtype())
        .ok_or_else(|| ExecError::Unsupported(format!("pipeline link: {:?} tensors are not sent", t.dtype())))?;
    let flat = t.flatten_all()?;
    let mut out = vec![code as u8, t.dims().len() as u8];
    for &d in t.dims() {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    match t.dtype() {
        DType::F32 => flat
            .to_vec1::<f32>()?
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        DType::BF16 => flat
            .to_vec1::<half::bf16>()?
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes())),
        DType::F16 => flat
            .to_vec1::<half::f16>()?
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes())),
        _ => flat
            .to_vec1::<u32>()?
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
    }
    Ok(out)
}

/// The tensor of a message [`encode`] made, on the CPU.
fn decode(bytes: &[u8]) -> Result<Tensor, ExecError> {
    let bad = |why: &str| ExecError::Internal(format!("pipeline message: {why}"));
    let (&code, rest) = bytes.split_first().ok_or_else(|| bad("empty"))?;
    let (&rank, mut rest) = rest.split_first().ok_or_else(|| bad("no rank"))?;
    let dtype = *DTYPES.get(code as usize).ok_or_else(|| bad("unknown dtype"))?;
    let mut dims = Vec::with_capacity(rank as usize);
    for _ in 0..rank {
        let (d, r) = rest.split_at_checked(8).ok_or_else(|| bad("short dims"))?;
        dims.push(u64::from_le_bytes(d.try_into().map_err(|_| bad("dims"))?) as usize);
        rest = r;
    }
    let n: usize = dims.iter().product();
    let width = if matches!(dtype, DType::F32 | DType::U32) { 4 } else { 2 };
    if rest.len() != n * width {
        return Err(bad("length does not match its dims"));
    }
    let cpu = Device::Cpu;
    let t = match dtype {
        DType::F32 => Tensor::from_vec(
            rest.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect::<Vec<_>>(),
            dims,
            &cpu,
        )?,
        DType::BF16 => Tensor::from_vec(
            rest.chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect::<Vec<_>>(),
            dims,
            &cpu,
        )?,
        DType::F16 => Tensor::from_vec(
            rest.chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect::<Vec<_>>(),
            dims,
            &cpu,
        )?,
        _ => Tensor::from_vec(
            rest.chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect::<Vec<_>>(),
            dims,
            &cpu,
        )?,
    };
    Ok(t)
}
