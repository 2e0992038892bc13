//! shardplan's IR: tensor types, a closed set of ops with shape inference, a graph of op
//! applications with module scopes and HF parameter names, FLOP/byte costs and printers.
//!
//! Architecture invariant: the IR knows nothing of devices, sharding or collectives.

pub mod autodiff;
mod context;
mod cost;
mod dot;
mod dtype;
mod error;
mod float8;
mod graph;
mod ids;
mod op;
mod print;
mod scope;
mod shape;
pub mod stats;

pub use autodiff::{differentiate, differentiate_stage, differentiate_with, DiffOptions, JointGraph, StageJoint};
pub use context::{ContextBalance, ContextLayout, ContextRotate};
pub use cost::{elementwise_flops, Cost};
pub use dot::to_dot;
pub use dtype::DType;
pub use error::IrError;
pub use float8::{Float8Cast, Float8Format, Float8Granularity, Float8LinearCasts, Float8Recipe};
pub use graph::{ExpertSplit, Graph, Node, Operands, Param, TensorSplit};
#[doc(hidden)]
pub use ids::__private;
pub use ids::{Entity, IdVec, IdVecIter, NodeId, ParamId, ScopeId};
pub use op::{NormWrt, Op, RopeScaling, RouterScore, TpGrad, WeightLayout};
pub use print::to_text;
pub use scope::{ModuleKind, Scope};
pub use shape::{Shape, TensorType};
