//! A pipeline mesh over NCCL (feature `cuda`), one GPU rank per process: its shard,
//! replicate, tensor and world communicators, each on a CUDA stream of its own, and its
//! pipeline link (a communicator per directed pair of ring neighbours, `comm::nccl::p2p`).
//! The unique ids are exchanged over the process world, as for every NCCL run.

use super::groups::{nccl_openings, NcclOpening, OpeningKind};
use super::{GroupMembers, PipelineEnds, PipelinePlacement};
use crate::comm::all_gather_bytes;
use crate::comm::nccl::device::{new_id, open_group, ID_TAG};
use crate::comm::nccl::p2p::device::{NcclLink, PairEnd};
use crate::comm::nccl::{exchange_ids, ID_BYTES};
use crate::comm::{Abort, Collectives};
use crate::ExecError;
use candle_core::cuda_backend::CudaDevice;
use candle_core::Device;
use shardplan_frontends::MeshShape;
use std::sync::Arc;

/// This process's rank `rank` of a pipeline `mesh` on the GPU `device`, with its groups
/// over NCCL; the ids are exchanged over `processes` (the process world; `None`: a world
/// of one process).
pub fn place_pipeline(
    mesh: &MeshShape,
    rank: u64,
    device: &Device,
    processes: Option<Box<dyn Collectives>>,
    abort: Arc<Abort>,
) -> Result<PipelinePlacement, ExecError> {
    let Device::Cuda(dev) = device else {
        return Err(ExecError::Unsupported(
            "--backend nccl runs each rank on a GPU: give --device cuda".into(),
        ));
    };
    let started = processes.as_ref().map_or(1, |p| p.size() as u64);
    if started != mesh.world() {
        return Err(ExecError::Unsupported(format!(
            "the mesh has {} ranks (pipeline {} x replicate {} x shard {} x tensor {}), but {started} process(es) were started: start one per GPU",
            mesh.world(),
            mesh.pipeline,
            mesh.replicate,
            mesh.shard,
            mesh.tensor
        )));
    }
    let openings = nccl_openings(mesh, rank);
    let ids = exchange_ids(rank, &openings, &mut new_id, &|mine| match processes.as_ref() {
        Some(p) => all_gather_bytes(p.as_ref(), ID_TAG, &mine),
        None => Ok(vec![mine]),
    })?;
    let link = GroupMembers::of(mesh, rank as usize).link;
    let link_index = |r: u64| link.iter().position(|&m| m == r).unwrap_or(0);
    let mut ends = Ends::default();
    for (o, id) in openings.into_iter().zip(ids) {
        ends.open(o, id, dev, &abort, rank, &link_index)?;
    }
    let p2p = NcclLink::start(
        link_index(rank),
        link.len(),
        ends.out,
        ends.incoming,
        dev,
        abort.clone(),
    );
    let world = ends
        .world
        .ok_or_else(|| ExecError::Internal("the pipeline placement opened no world".into()))?;
    Ok(PipelinePlacement {
        ranks: vec![(
            rank as usize,
            PipelineEnds {
                p2p: Box::new(p2p),
                shard: ends.shard,
                replicate: ends.replicate,
                tensor: ends.tensor,
                world,
            },
        )],
        abort,
    })
}

/// What the openings made so far.
#[derive(Default)]
struct Ends {
    shard: Option<Box<dyn Collectives>>,
    replicate: Option<Box<dyn Collectives>>,
    tensor: Option<Box<dyn Collectives>>,
    world: Option<Box<dyn Collectives>>,
    out: Vec<PairEnd>,
    incoming: Vec<PairEnd>,
}

impl Ends {
    /// Joins `o` with its id: a group on a CUDA stream of its own, or one end of a pair.
    fn open(
        &mut self,
        o: NcclOpening,
        id: [u8; ID_BYTES],
        dev: &CudaDevice,
        abort: &Arc<Abort>,
        rank: u64,
        link_index: &dyn Fn(u64) -> usize,
    ) -> Result<(), ExecError> {
        if let OpeningKind::Pair(from, to) = o.kind {
            let sending = from == rank;
            let peer = link_index(if sending { to } else { from });
            let end = PairEnd::join(o.name, sending, peer, id, dev, abort, rank)?;
            match sending {
                true => self.out.push(end),
                false => self.incoming.push(end),
            }
            return Ok(());
        }
        let stream = dev
            .cuda_stream()
            .context()
            .new_stream()
            .map_err(|e| ExecError::Internal(format!("creating a collective stream: CUDA error {e:?}")))?;
        let size = o.members.len();
        let group: Box<dyn Collectives> = Box::new(open_group(o.name, o.index, size, id, stream, dev, abort, rank)?);
        let slot = match o.kind {
            OpeningKind::Shard => &mut self.shard,
            OpeningKind::Replicate => &mut self.replicate,
            OpeningKind::Tensor => &mut self.tensor,
            _ => &mut self.world,
        };
        *slot = Some(group);
        Ok(())
    }
}
