//! The streams of one rank, named by the plan's instructions and by the steps that run on
//! them (a module of its own so that `steps` and `plan` both use it without importing
//! each other).

use serde::{Deserialize, Serialize};

/// The streams of one rank. Collectives of each kind have their own, as FSDP2 does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    Compute,
    AllGather,
    ReduceScatter,
    AllReduce,
    /// Host <-> device copies (CPU offload).
    Copy,
    /// Work on the CPU (the optimizer step under CPU offload).
    Host,
    /// The expert group's collectives (the routing table's all-gather, the tokens'
    /// dispatch and combine), each a step of its own between the compute steps that make
    /// its input and read its output (shardplan's runtime; under `runtime: fsdp2` they run
    /// inside compute steps, as torchtitan does).
    AllToAll,
}

impl Stream {
    pub const ALL: [Stream; 7] = [
        Stream::Compute,
        Stream::AllGather,
        Stream::ReduceScatter,
        Stream::AllReduce,
        Stream::Copy,
        Stream::Host,
        Stream::AllToAll,
    ];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Stream::Compute => "compute",
            Stream::AllGather => "all-gather",
            Stream::ReduceScatter => "reduce-scatter",
            Stream::AllReduce => "all-reduce",
            Stream::Copy => "copy",
            Stream::Host => "host",
            Stream::AllToAll => "all-to-all",
        }
    }
}
