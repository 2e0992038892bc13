//! The device mesh: replicate x shard, as FSDP2's 2-D `DeviceMesh` for HSDP.
//!
//! Ranks are laid out row-major over (replicate, shard), so the shard axis is innermost:
//! a shard group is `shard` consecutive ranks, which on `gpus_per_node`-GPU nodes keeps it
//! inside a node whenever `shard` divides `gpus_per_node`.

use crate::PlanError;
use serde::{Deserialize, Serialize};

/// A replicate x shard mesh placed on nodes of `gpus_per_node` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mesh {
    replicate: u64,
    shard: u64,
    gpus_per_node: u64,
}

/// A rank's position on the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Coords {
    pub replicate: u64,
    pub shard: u64,
}

impl Mesh {
    /// A mesh for `world` ranks; the axes must multiply to it.
    pub fn new(replicate: u64, shard: u64, world: u64, gpus_per_node: u64) -> Result<Self, PlanError> {
        if replicate == 0 || shard == 0 {
            return Err(PlanError::EmptyAxis { replicate, shard });
        }
        match replicate.checked_mul(shard) {
            Some(p) if p == world => Ok(Mesh {
                replicate,
                shard,
                gpus_per_node: gpus_per_node.max(1),
            }),
            p => Err(PlanError::MeshWorld {
                replicate,
                shard,
                product: p.unwrap_or(u64::MAX),
                world,
            }),
        }
    }

    /// The mesh of a validated parallel spec (its world is `replicate x shard` by definition).
    pub fn from_config(c: &shardplan_frontends::ParallelConfig) -> Self {
        Mesh {
            replicate: c.mesh.replicate,
            shard: c.mesh.shard,
            gpus_per_node: c.gpus_per_node,
        }
    }

    pub fn world(&self) -> u64 {
        self.replicate * self.shard
    }

    pub fn replicate(&self) -> u64 {
        self.replicate
    }

    pub fn shard(&self) -> u64 {
        self.shard
    }

    pub fn gpus_per_node(&self) -> u64 {
        self.gpus_per_node
    }

    pub fn coords(&self, rank: u64) -> Coords {
        Coords {
            replicate: rank / self.shard,
            shard: rank % self.shard,
        }
    }

    pub fn rank(&self, c: Coords) -> u64 {
        c.replicate * self.shard + c.shard
    }

    /// The ranks `rank` shards parameters with (same replicate index), in shard order.
    pub fn shard_group(&self, rank: u64) -> Vec<u64> {
        let r = self.coords(rank).replicate;
        (0..self.shard)
            .map(|s| self.rank(Coords { replicate: r, shard: s }))
            .collect()
    }

    /// The ranks holding the same shard as `rank` (same shard index): HSDP's all-reduce group.
    pub fn replicate_group(&self, rank: u64) -> Vec<u64> {
        let s = self.coords(rank).shard;
        (0..self.replicate)
            .map(|r| self.rank(Coords { replicate: r, shard: s }))
            .collect()
    }

    /// For `reshard_after_forward: n`: the `n` consecutive ranks of `rank`'s shard group that
    /// keep the parameters between forward and backward (FSDP2's int reshard).
    pub fn reshard_group(&self, rank: u64, n: u64) -> Vec<u64> {
        let c = self.coords(rank);
        let n = n.clamp(1, self.shard);
        let first = c.shard / n * n;
        (first..first + n)
            .map(|s| {
                self.rank(Coords {
                    replicate: c.replicate,
                    shard: s,
                })
            })
            .collect()
    }

    /// The node a rank runs on.
    pub fn node(&self, rank: u64) -> u64 {
        rank / self.gpus_per_node
    }

    /// True when every member of `group` is on one node (collectives use NVLink, not the network).
    pub fn intra_node(&self, group: &[u64]) -> bool {
        group.windows(2).all(|w| self.node(w[0]) == self.node(w[1]))
    }
}
