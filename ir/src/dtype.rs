//! Element types of tensors.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Element type of a tensor: floats for activations and weights, integers for token ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// Used by gradient checks against finite differences; models train in f32/bf16/f16.
    F64,
    F32,
    BF16,
    F16,
    I64,
    U32,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 6] = [DType::F64, DType::F32, DType::BF16, DType::F16, DType::I64, DType::U32];

    /// Bytes per element.
    pub fn size_bytes(self) -> u64 {
        match self {
            DType::F64 => 8,
            DType::F32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I64 => 8,
        }
    }

    /// True for the floating-point types (the ones weights and activations may have).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::BF16 | DType::F16)
    }

    /// The lowercase name used in specs and printouts (`bf16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
            DType::U32 => "u32",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown dtype `{s}` (expected one of f64, f32, bf16, f16, i64, u32)"))
    }
}
