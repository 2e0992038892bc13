//! The YAML parallel spec (mesh, wrap policy, resharding, prefetch, precision, offload,
//! checkpointing, batch, optimizer, hardware), validated into a [`ParallelConfig`].
//!
//! - `file`: the spec file's types, as written (spans kept);
//! - `config`: the validated [`ParallelConfig`] and its parts;
//! - `float8`: the Float8 and MXFP8 linears;
//! - `convert`: file to config, every check, [`parse_parallel_spec`];
//! - `write`: config back to spec YAML ([`spec_yaml`]).

mod config;
mod convert;
mod file;
mod float8;
mod write;

pub use config::*;
pub use convert::parse_parallel_spec;
pub use float8::{Float8, Float8Recipe, Mxfp8, Mxfp8Recipe, AUTO_FILTER};
pub use write::spec_yaml;

/// Most ranks a mesh may have (2^20): beyond any cluster, small enough to plan.
pub const MAX_WORLD: u64 = 1 << 20;
