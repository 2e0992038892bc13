//! Shapes and tensor types (dtype + shape), with overflow-checked sizes.

use crate::DType;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::fmt;

/// Dims of the shapes a model has (rank 4 and below) are held inline, without an
/// allocation of their own: a large model's joint graph has tens of thousands of values,
/// each made and dropped with its shape.
type Dims = SmallVec<[u64; 4]>;

/// A concrete tensor shape. A plan is made for one shape, so there are no symbolic dims.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Shape(Dims);

impl Shape {
    /// A shape from its dims, outermost first.
    pub fn new(dims: impl Into<Vec<u64>>) -> Self {
        Shape(Dims::from_slice(&dims.into()))
    }

    /// The 0-dimensional shape of a scalar.
    pub fn scalar() -> Self {
        Shape(Dims::new())
    }

    pub fn dims(&self) -> &[u64] {
        &self.0
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Size of the last dim, if any.
    pub fn last(&self) -> Option<u64> {
        self.0.last().copied()
    }

    /// Number of elements, or `None` when it overflows u64.
    pub fn numel(&self) -> Option<u64> {
        self.0.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }

    /// The numpy/torch broadcast of two shapes, or `None` if they do not broadcast.
    pub fn broadcast(&self, other: &Shape) -> Option<Shape> {
        let rank = self.rank().max(other.rank());
        let mut out = Dims::from_elem(0, rank);
        for (i, slot) in out.iter_mut().enumerate() {
            let a = dim_from_right(&self.0, rank - 1 - i);
            let b = dim_from_right(&other.0, rank - 1 - i);
            *slot = match (a, b) {
                (x, y) if x == y => x,
                (1, y) => y,
                (x, 1) => x,
                _ => return None,
            };
        }
        Some(Shape(out))
    }
}

fn dim_from_right(dims: &[u64], from_right: usize) -> u64 {
    if from_right < dims.len() {
        dims[dims.len() - 1 - from_right]
    } else {
        1
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

impl<const N: usize> From<[u64; N]> for Shape {
    fn from(dims: [u64; N]) -> Self {
        Shape(Dims::from_slice(&dims))
    }
}

/// The type of a value: element type and shape (`bf16[1,8192,4096]`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Shape,
}

impl TensorType {
    pub fn new(dtype: DType, shape: impl Into<Shape>) -> Self {
        TensorType {
            dtype,
            shape: shape.into(),
        }
    }

    /// Number of elements, or `None` on u64 overflow.
    pub fn numel(&self) -> Option<u64> {
        self.shape.numel()
    }

    /// Size in bytes, or `None` on u64 overflow.
    pub fn bytes(&self) -> Option<u64> {
        self.numel()?.checked_mul(self.dtype.size_bytes())
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

impl From<Vec<u64>> for Shape {
    fn from(dims: Vec<u64>) -> Self {
        Shape(Dims::from_slice(&dims))
    }
}

impl From<&[u64]> for Shape {
    fn from(dims: &[u64]) -> Self {
        Shape(Dims::from_slice(dims))
    }
}
