//! The device mesh: replicate x shard x tensor, as torchtitan's `DeviceMesh` over
//! `dp_replicate, dp_shard, tp`.
//!
//! Ranks are laid out row-major over (replicate, shard, tensor), so the tensor axis is
//! innermost: a tensor group is `tensor` consecutive ranks (inside one node: the spec
//! checks that `tensor` divides `gpus_per_node`), and without tensor parallelism a shard
//! group is `shard` consecutive ranks, which keeps it inside a node whenever `shard`
//! divides `gpus_per_node`.

use crate::PlanError;
use serde::{Deserialize, Serialize};

/// A replicate x shard mesh placed on nodes of `gpus_per_node` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mesh {
    replicate: u64,
    shard: u64,
    /// Absent from plans without tensor parallelism, which read as before.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    tensor: u64,
    /// Ranks of an expert-parallel group, carved out of the shard axis; absent from plans
    /// without expert parallelism.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    expert: u64,
    /// Ranks of a context-parallel group, the innermost part of the shard axis (which is
    /// then torchtitan's `dp_shard_cp`: FSDP shards over `shard`, the sequences differ over
    /// `shard / context`); absent from plans without context parallelism.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    context: u64,
    gpus_per_node: u64,
}

fn one() -> u64 {
    1
}

fn is_one(v: &u64) -> bool {
    *v == 1
}

/// A rank's position on the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Coords {
    pub replicate: u64,
    pub shard: u64,
    #[serde(default)]
    pub tensor: u64,
}

impl Mesh {
    /// A replicate x shard mesh for `world` ranks; the axes must multiply to it.
    pub fn new(replicate: u64, shard: u64, world: u64, gpus_per_node: u64) -> Result<Self, PlanError> {
        Mesh::with_tensor(replicate, shard, 1, world, gpus_per_node)
    }

    /// A replicate x shard x tensor mesh for `world` ranks; the axes must multiply to it.
    pub(crate) fn with_tensor(
        replicate: u64,
        shard: u64,
        tensor: u64,
        world: u64,
        gpus_per_node: u64,
    ) -> Result<Self, PlanError> {
        if replicate == 0 || shard == 0 || tensor == 0 {
            return Err(PlanError::EmptyAxis {
                replicate,
                shard,
                tensor,
            });
        }
        match replicate.checked_mul(shard).and_then(|p| p.checked_mul(tensor)) {
            Some(p) if p == world => Ok(Mesh {
                replicate,
                shard,
                tensor,
                expert: 1,
                context: 1,
                gpus_per_node: gpus_per_node.max(1),
            }),
            p => Err(PlanError::MeshWorld {
                replicate,
                shard,
                tensor,
                product: p.unwrap_or(u64::MAX),
                world,
            }),
        }
    }

    /// This mesh with an expert axis of `expert` ranks inside the shard axis.
    pub(crate) fn with_expert(self, expert: u64) -> Result<Self, PlanError> {
        if expert == 0 || !self.shard.is_multiple_of(expert) {
            return Err(PlanError::ExpertDoesNotDivide {
                expert,
                shard: self.shard,
            });
        }
        Ok(Mesh { expert, ..self })
    }

    /// This mesh with a context axis of `context` ranks, the innermost part of the shard
    /// axis.
    pub(crate) fn with_context(self, context: u64) -> Result<Self, PlanError> {
        if context == 0 || !self.shard.is_multiple_of(context) {
            return Err(PlanError::ContextDoesNotDivide {
                context,
                shard: self.shard,
            });
        }
        Ok(Mesh { context, ..self })
    }

    /// Ranks of one context-parallel group (1: none).
    pub fn context(&self) -> u64 {
        self.context
    }

    /// `rank`'s index in its context group: which rows of each sequence it holds.
    pub fn context_index(&self, rank: u64) -> u64 {
        self.coords(rank).shard % self.context.max(1)
    }

    /// The context group of `rank`: the `context` consecutive ranks of its shard group
    /// that hold one sequence between them, in context order.
    pub fn context_group(&self, rank: u64) -> Vec<u64> {
        let c = self.coords(rank);
        let n = self.context.max(1);
        let first = c.shard / n * n;
        (first..first + n)
            .map(|s| self.rank(Coords { shard: s, ..c }))
            .collect()
    }

    /// `rank`'s data-parallel index: which rows of the global batch it reads (a tensor
    /// group and a context group read the same sequences).
    pub fn data_index(&self, rank: u64) -> u64 {
        let c = self.coords(rank);
        c.replicate * (self.shard / self.context.max(1)) + c.shard / self.context.max(1)
    }

    /// Ranks of one expert-parallel group (1: none).
    pub fn expert(&self) -> u64 {
        self.expert
    }

    /// Ranks that hold the same experts within a replica (`shard / expert`): the group
    /// the routed experts' parameters are sharded over.
    pub(crate) fn expert_shard(&self) -> u64 {
        self.shard / self.expert.max(1)
    }

    /// Ranks a group's parameters are sharded over: the shard axis, or the ranks holding
    /// the same experts for a group of routed experts.
    pub(crate) fn shard_of(&self, group: &crate::FsdpGroup) -> u64 {
        if group.experts {
            self.expert_shard()
        } else {
            self.shard
        }
    }

    /// The process group a group's parameters are gathered and its gradients reduced over.
    pub(crate) fn shard_comm(&self, group: &crate::FsdpGroup) -> crate::Comm {
        if group.experts {
            crate::Comm::ExpertShard
        } else {
            crate::Comm::Shard
        }
    }

    /// `rank`'s place in the group `group`'s parameters are sharded over (its shard of them).
    pub fn shard_rank(&self, rank: u64, group: &crate::FsdpGroup) -> u64 {
        let s = self.coords(rank).shard;
        if group.experts {
            s / self.expert.max(1)
        } else {
            s
        }
    }

    /// `rank`'s index in its expert group: which experts it holds.
    pub fn expert_index(&self, rank: u64) -> u64 {
        self.coords(rank).shard % self.expert.max(1)
    }

    /// The expert group of `rank`: the `expert` consecutive ranks of its shard group that
    /// hold every expert between them (the tokens' all-to-all), in expert order.
    pub fn expert_group(&self, rank: u64) -> Vec<u64> {
        let c = self.coords(rank);
        let e = self.expert.max(1);
        let first = c.shard / e * e;
        (first..first + e)
            .map(|s| self.rank(Coords { shard: s, ..c }))
            .collect()
    }

    /// The ranks of `rank`'s shard group holding its experts (same expert index), in
    /// shard order: FSDP's group for the routed experts.
    pub(crate) fn expert_shard_group(&self, rank: u64) -> Vec<u64> {
        let c = self.coords(rank);
        let e = self.expert.max(1);
        (0..self.shard / e)
            .map(|i| {
                self.rank(Coords {
                    shard: i * e + c.shard % e,
                    ..c
                })
            })
            .collect()
    }

    pub fn world(&self) -> u64 {
        self.replicate * self.shard * self.tensor
    }

    /// Ranks that see different data (`replicate x shard / context`): a tensor group and a
    /// context group share their sequences.
    pub fn data_parallel(&self) -> u64 {
        self.replicate * self.shard / self.context.max(1)
    }

    /// Ranks of one tensor-parallel group (1: none).
    pub fn tensor(&self) -> u64 {
        self.tensor
    }

    pub fn replicate(&self) -> u64 {
        self.replicate
    }

    pub fn shard(&self) -> u64 {
        self.shard
    }

    pub(crate) fn gpus_per_node(&self) -> u64 {
        self.gpus_per_node
    }

    pub fn coords(&self, rank: u64) -> Coords {
        let dp = rank / self.tensor;
        Coords {
            replicate: dp / self.shard,
            shard: dp % self.shard,
            tensor: rank % self.tensor,
        }
    }

    pub fn rank(&self, c: Coords) -> u64 {
        (c.replicate * self.shard + c.shard) * self.tensor + c.tensor
    }

    /// The ranks `rank` shards parameters with (same replicate and tensor index), in shard
    /// order.
    pub(crate) fn shard_group(&self, rank: u64) -> Vec<u64> {
        let c = self.coords(rank);
        (0..self.shard).map(|s| self.rank(Coords { shard: s, ..c })).collect()
    }

    /// The ranks holding the same shard as `rank` (same shard and tensor index): HSDP's
    /// all-reduce group.
    pub(crate) fn replicate_group(&self, rank: u64) -> Vec<u64> {
        let c = self.coords(rank);
        (0..self.replicate)
            .map(|r| self.rank(Coords { replicate: r, ..c }))
            .collect()
    }

    /// The ranks that hold the other slices of `rank`'s layers (same replicate and shard
    /// index), in tensor order: the tensor-parallel group.
    pub fn tensor_group(&self, rank: u64) -> Vec<u64> {
        let c = self.coords(rank);
        (0..self.tensor).map(|t| self.rank(Coords { tensor: t, ..c })).collect()
    }

    /// For `reshard_after_forward: n`: the `n` consecutive ranks of `rank`'s shard group that
    /// keep the parameters between forward and backward (FSDP2's int reshard).
    pub(crate) fn reshard_group(&self, rank: u64, n: u64) -> Vec<u64> {
        let c = self.coords(rank);
        let n = n.clamp(1, self.shard);
        let first = c.shard / n * n;
        (first..first + n)
            .map(|s| self.rank(Coords { shard: s, ..c }))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    //! Coordinates, groups and nodes as torchtitan's device mesh lays them out.

    use super::{Coords, Mesh};
    use crate::PlanError;

    /// Whether every member of `group` runs on one node of `m`.
    fn one_node(m: &Mesh, group: &[u64]) -> bool {
        group.iter().all(|r| r / m.gpus_per_node == group[0] / m.gpus_per_node)
    }

    #[test]
    fn mesh_coordinates_groups_and_nodes() {
        assert_eq!(
            Mesh::new(2, 8, 12, 8).unwrap_err().to_string(),
            "mesh replicate 2 x shard 8 = 16 ranks, but the world has 12"
        );
        assert!(matches!(Mesh::new(0, 8, 0, 8), Err(PlanError::EmptyAxis { .. })));
        let m = Mesh::new(2, 8, 16, 8).unwrap();
        for rank in 0..16 {
            assert_eq!(m.rank(m.coords(rank)), rank);
        }
        assert_eq!(
            m.coords(11),
            Coords {
                replicate: 1,
                shard: 3,
                tensor: 0
            }
        );
        assert_eq!(m.shard_group(11), (8..16).collect::<Vec<_>>());
        assert_eq!(m.replicate_group(11), [3, 11]);
        assert_eq!(m.reshard_group(11, 4), [8, 9, 10, 11]);
        assert!(one_node(&m, &m.shard_group(3)), "shard groups stay in a node");
        assert!(!one_node(&m, &m.replicate_group(3)), "replicas span nodes");
        let flat = Mesh::new(1, 16, 16, 8).unwrap();
        assert!(!one_node(&flat, &flat.shard_group(0)));
    }

    #[test]
    fn a_tensor_axis_is_innermost() {
        assert_eq!(
            Mesh::with_tensor(2, 4, 2, 12, 8).unwrap_err().to_string(),
            "mesh replicate 2 x shard 4 x tensor 2 = 16 ranks, but the world has 12"
        );
        assert!(matches!(
            Mesh::with_tensor(1, 4, 0, 0, 8),
            Err(PlanError::EmptyAxis { tensor: 0, .. })
        ));
        // 2 x 4 x 2 on nodes of 8: rank = (r * 4 + s) * 2 + t.
        let m = Mesh::with_tensor(2, 4, 2, 16, 8).unwrap();
        assert_eq!(m.world(), 16);
        assert_eq!(m.data_parallel(), 8);
        for rank in 0..16 {
            assert_eq!(m.rank(m.coords(rank)), rank);
        }
        assert_eq!(
            m.coords(11),
            Coords {
                replicate: 1,
                shard: 1,
                tensor: 1
            }
        );
        assert_eq!(m.tensor_group(11), [10, 11]);
        assert_eq!(m.shard_group(11), [9, 11, 13, 15]);
        assert_eq!(m.replicate_group(11), [3, 11]);
        assert_eq!(m.reshard_group(11, 2), [9, 11]);
        assert!(one_node(&m, &m.tensor_group(3)), "tensor groups stay in a node");
        assert!(one_node(&m, &m.shard_group(3)));
        assert!(!one_node(&m, &m.replicate_group(3)));
    }
}
