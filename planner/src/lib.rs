//! The planner: everything FSDP2 decides at run time, decided ahead of time.
//!
//! Built so far: the mesh, FSDP grouping and the shard layout. The schedule, memory
//! simulation, cost model, verifier and the Plan type come with the planner issue.
//! Architecture invariant: the planner holds no tensors.

mod error;
pub mod group;
pub mod layout;
pub mod mesh;

pub use error::PlanError;
pub use group::{group, FsdpGroup, GroupId};
pub use layout::{chunk_rows, layout, GroupLayout, ParamLayout};
pub use mesh::{Coords, Mesh};
