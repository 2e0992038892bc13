//! The members of each group one rank of a pipeline mesh belongs to, as world ranks: what
//! every engine that runs one rank a process (MPI, NCCL) splits or opens; and the NCCL
//! communicators a rank opens, in the order every rank opens them.

use super::Coord;
use crate::comm::nccl::p2p::link_edges;
use crate::comm::nccl::IdGroup;
use shardplan_frontends::MeshShape;

/// A rank's groups, each its members in group order (this rank among them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupMembers {
    /// The ranks of its pipeline link: one per pipeline rank, same replicate, shard and
    /// tensor index.
    pub link: Vec<u64>,
    pub shard: Vec<u64>,
    pub replicate: Vec<u64>,
    pub tensor: Vec<u64>,
    pub world: Vec<u64>,
}

impl GroupMembers {
    /// The groups of world rank `rank` of `mesh`.
    pub fn of(mesh: &MeshShape, rank: usize) -> GroupMembers {
        let me = Coord::of(rank, mesh);
        let members = |vary: &dyn Fn(usize) -> Coord, n: u64| -> Vec<u64> {
            (0..n as usize).map(|i| vary(i).index(mesh) as u64).collect()
        };
        GroupMembers {
            link: members(&|p| Coord { pipeline: p, ..me }, mesh.pipeline),
            shard: members(&|s| Coord { shard: s, ..me }, mesh.shard),
            replicate: members(&|r| Coord { replicate: r, ..me }, mesh.replicate),
            tensor: members(&|t| Coord { tensor: t, ..me }, mesh.tensor),
            world: (0..mesh.world()).collect(),
        }
    }
}

/// One communicator a pipeline rank opens over NCCL.
pub struct NcclOpening {
    pub name: String,
    pub members: Vec<u64>,
    /// This rank's position among them.
    pub index: usize,
    pub kind: OpeningKind,
}

/// Which of a rank's communicators an opening is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpeningKind {
    Shard,
    Replicate,
    Tensor,
    World,
    /// The pair (sender, receiver) of the link.
    Pair(u64, u64),
}

impl IdGroup for NcclOpening {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn root(&self) -> u64 {
        self.members[0]
    }
}

/// Every communicator `rank` of `mesh` opens, in the order every rank opens them: its
/// groups of more than one member, the world, then the link's pairs it is in, in the
/// link's one order.
pub fn nccl_openings(mesh: &MeshShape, rank: u64) -> Vec<NcclOpening> {
    let g = GroupMembers::of(mesh, rank as usize);
    let group = |kind: OpeningKind, what: &str, members: Vec<u64>| NcclOpening {
        name: format!("{what} {members:?}"),
        index: members.iter().position(|&m| m == rank).unwrap_or(0),
        members,
        kind,
    };
    let mut out = Vec::new();
    for (kind, what, members) in [
        (OpeningKind::Shard, "shard group", g.shard),
        (OpeningKind::Replicate, "replicate group", g.replicate),
        (OpeningKind::Tensor, "tensor group", g.tensor),
    ] {
        if members.len() > 1 {
            out.push(group(kind, what, members));
        }
    }
    out.push(group(OpeningKind::World, "world", g.world));
    for (from, to) in link_edges(&g.link).into_iter().filter(|&(a, b)| a == rank || b == rank) {
        out.push(NcclOpening {
            name: format!("pipeline link {from} -> {to}"),
            members: vec![from, to],
            index: usize::from(to == rank),
            kind: OpeningKind::Pair(from, to),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mesh(p: u64, r: u64, s: u64, t: u64) -> MeshShape {
        MeshShape {
            pipeline: p,
            replicate: r,
            shard: s,
            context: 1,
            tensor: t,
            expert: 1,
        }
    }

    /// Every member of a group lists the same members, and each rank is in its own.
    #[test]
    fn members_agree_on_every_group() {
        let m = mesh(2, 2, 2, 2);
        let world = 16;
        for rank in 0..world {
            let g = GroupMembers::of(&m, rank);
            for (name, members) in [
                ("link", &g.link),
                ("shard", &g.shard),
                ("replicate", &g.replicate),
                ("tensor", &g.tensor),
            ] {
                assert!(members.contains(&(rank as u64)), "{name} of {rank}: {members:?}");
                assert_eq!(members.len(), 2);
                for &other in members.iter() {
                    let theirs = GroupMembers::of(&m, other as usize);
                    let same = match name {
                        "link" => &theirs.link,
                        "shard" => &theirs.shard,
                        "replicate" => &theirs.replicate,
                        _ => &theirs.tensor,
                    };
                    assert_eq!(same, members, "{name} group of {rank} and {other}");
                }
            }
            assert_eq!(g.world.len(), world);
        }
        // Pipeline is the outermost axis, tensor the innermost.
        assert_eq!(GroupMembers::of(&m, 0).link, vec![0, 8]);
        assert_eq!(GroupMembers::of(&m, 0).tensor, vec![0, 1]);
        assert_eq!(GroupMembers::of(&m, 5).shard, vec![5, 7]);
        assert_eq!(GroupMembers::of(&m, 5).replicate, vec![1, 5]);
    }

    /// Every member of a communicator opens it under one name, and any two ranks open
    /// the communicators they share in one order: so each opening (which waits for every
    /// member) finds its members at the same one, and the start-up cannot deadlock.
    #[test]
    fn nccl_openings_agree_and_come_in_one_order() {
        for m in [mesh(2, 1, 2, 1), mesh(4, 1, 1, 2), mesh(2, 2, 2, 1), mesh(3, 1, 1, 1)] {
            let all: Vec<Vec<NcclOpening>> = (0..m.world()).map(|r| nccl_openings(&m, r)).collect();
            for (r, mine) in all.iter().enumerate() {
                for o in mine {
                    assert_eq!(o.members[o.index], r as u64, "{}", o.name);
                    for &other in &o.members {
                        let theirs = all[other as usize].iter().find(|t| t.name == o.name);
                        let theirs = theirs.unwrap_or_else(|| panic!("{other} does not open {}", o.name));
                        assert_eq!((&theirs.members, theirs.kind), (&o.members, o.kind));
                    }
                }
                for (q, other) in all.iter().enumerate() {
                    let shared = |list: &[NcclOpening], with: &[NcclOpening]| -> Vec<String> {
                        list.iter()
                            .filter(|o| with.iter().any(|w| w.name == o.name))
                            .map(|o| o.name.clone())
                            .collect()
                    };
                    assert_eq!(shared(mine, other), shared(other, mine), "ranks {r} and {q} of {m:?}");
                }
            }
        }
        // PP 2 x FSDP 2: rank 1 opens its shard group, the world, and the pairs to and
        // from rank 3, its pipeline neighbour.
        let names: Vec<String> = nccl_openings(&mesh(2, 1, 2, 1), 1)
            .into_iter()
            .map(|o| o.name)
            .collect();
        assert_eq!(
            names,
            vec![
                "shard group [0, 1]",
                "world [0, 1, 2, 3]",
                "pipeline link 1 -> 3",
                "pipeline link 3 -> 1"
            ]
        );
    }
}
