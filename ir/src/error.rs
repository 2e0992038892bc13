//! Errors raised while building a graph.

use thiserror::Error;

/// Something wrong with a graph under construction.
#[derive(Debug, Error, PartialEq)]
pub enum IrError {
    /// An op's operands have shapes or dtypes it cannot take.
    #[error("shape error in `{op}` at `{scope}` with operands ({operands}): {reason}")]
    Shape {
        op: &'static str,
        scope: String,
        /// The operand types, comma separated (`f32[2,8,64], f32[48,32]`).
        operands: String,
        reason: String,
    },
    /// A tensor whose size in bytes does not fit in u64.
    #[error("`{what}` at `{scope}` is too large: {ty} bytes overflow u64; use smaller sizes")]
    Overflow { what: String, scope: String, ty: String },
    /// Two parameters with the same name.
    #[error("parameter `{0}` is defined twice")]
    DuplicateParam(String),
    /// A graph that cannot be differentiated.
    #[error("cannot differentiate: {0}")]
    Autodiff(String),
    /// An operand id that is not (yet) a node of the graph.
    #[error("operand {operand} of `{op}` at `{scope}` is not a node of this graph")]
    UnknownOperand {
        op: &'static str,
        scope: String,
        operand: String,
    },
}
