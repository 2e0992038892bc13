//! Every rank of a pipeline mesh as a thread of this process: its groups in memory (the
//! Local collectives and mailboxes).

use super::{Coord, PipelineEnds, PipelinePlacement};
use crate::comm::local::{local_group, LocalGroup};
use crate::comm::p2p::{local_p2p, LocalP2p};
use crate::comm::{Abort, Collectives};
use shardplan_frontends::MeshShape;
use std::sync::Arc;

/// Every rank of `mesh` (pipeline x replicate x shard x tensor) with Local groups.
pub fn place_threads(mesh: &MeshShape) -> PipelinePlacement {
    let abort = Arc::new(Abort::default());
    let mut groups = Groups::new(mesh, &abort);
    let world = (mesh.pipeline * mesh.stage_world()) as usize;
    let ranks = (0..world)
        .map(|index| (index, groups.take(Coord::of(index, mesh))))
        .collect();
    PipelinePlacement { ranks, abort }
}

/// The groups of a P x R x S x T mesh of threads, handed out rank by rank: a pipeline
/// link per (replicate, shard, tensor), a shard group per (pipeline, replicate, tensor), a
/// replicate group per (pipeline, shard, tensor), a tensor group per (pipeline,
/// replicate, shard), and the world. Each group's handles are taken in member order.
struct Groups {
    mesh: (usize, usize, usize, usize),
    links: Vec<std::vec::IntoIter<LocalP2p>>,
    shard: Vec<std::vec::IntoIter<LocalGroup>>,
    replicate: Vec<std::vec::IntoIter<LocalGroup>>,
    tensor: Vec<std::vec::IntoIter<LocalGroup>>,
    world: std::vec::IntoIter<LocalGroup>,
}

impl Groups {
    fn new(mesh: &MeshShape, abort: &Arc<Abort>) -> Groups {
        let (p, r, s, t) = (
            mesh.pipeline as usize,
            mesh.replicate as usize,
            mesh.shard as usize,
            mesh.tensor as usize,
        );
        let groups = |count: usize, size: usize, name: &str| -> Vec<std::vec::IntoIter<LocalGroup>> {
            (0..count).map(|_| local_group(size, name, abort).into_iter()).collect()
        };
        Groups {
            mesh: (p, r, s, t),
            links: (0..r * s * t)
                .map(|_| local_p2p(p, "pipeline group", abort).into_iter())
                .collect(),
            shard: groups(p * r * t, s, "shard group"),
            replicate: groups(p * s * t, r, "replicate group"),
            tensor: groups(p * r * s, t, "tensor group"),
            world: local_group(p * r * s * t, "world", abort).into_iter(),
        }
    }

    /// The ends of the rank at `c`; ranks are taken in mesh order, so each group's next
    /// handle is this rank's.
    fn take(&mut self, c: Coord) -> PipelineEnds {
        fn next<T>(it: &mut std::vec::IntoIter<T>) -> T {
            it.next().expect("ranks are taken in mesh order, each once")
        }
        let (_, r, s, t) = self.mesh;
        let boxed = |g: LocalGroup| Box::new(g) as Box<dyn Collectives>;
        let link = next(&mut self.links[(c.replicate * s + c.shard) * t + c.tensor]);
        let shard = next(&mut self.shard[(c.pipeline * r + c.replicate) * t + c.tensor]);
        let replicate = next(&mut self.replicate[(c.pipeline * s + c.shard) * t + c.tensor]);
        let tensor = next(&mut self.tensor[(c.pipeline * r + c.replicate) * s + c.shard]);
        PipelineEnds {
            p2p: Box::new(link),
            shard: (s > 1).then(|| boxed(shard)),
            replicate: (r > 1).then(|| boxed(replicate)),
            tensor: (t > 1).then(|| boxed(tensor)),
            world: boxed(next(&mut self.world)),
        }
    }
}
