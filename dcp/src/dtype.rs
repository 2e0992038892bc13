//! The element types a checkpoint's tensors have, with torch's names for them.

/// A tensor's element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

/// Each dtype: torch's attribute (`torch.float32`) and its legacy storage class
/// (`torch.FloatStorage`), which torch.save's pickles name.
const NAMES: [(DType, &str, &str); 10] = [
    (DType::F64, "float64", "DoubleStorage"),
    (DType::F32, "float32", "FloatStorage"),
    (DType::F16, "float16", "HalfStorage"),
    (DType::BF16, "bfloat16", "BFloat16Storage"),
    (DType::I64, "int64", "LongStorage"),
    (DType::I32, "int32", "IntStorage"),
    (DType::I16, "int16", "ShortStorage"),
    (DType::I8, "int8", "CharStorage"),
    (DType::U8, "uint8", "ByteStorage"),
    (DType::Bool, "bool", "BoolStorage"),
];

impl DType {
    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// torch's name: `float32`.
    pub fn torch_name(self) -> &'static str {
        NAMES.iter().find(|n| n.0 == self).map_or("", |n| n.1)
    }

    /// The storage class torch.save names for it: `FloatStorage`.
    pub fn storage_class(self) -> &'static str {
        NAMES.iter().find(|n| n.0 == self).map_or("", |n| n.2)
    }

    /// The dtype of torch attribute `name` (`float32`); also torch's aliases
    /// (`float`, `half`, `double`, `long`, `int`).
    pub fn from_torch_name(name: &str) -> Option<DType> {
        let name = match name {
            "float" => "float32",
            "double" => "float64",
            "half" => "float16",
            "long" => "int64",
            "int" => "int32",
            "short" => "int16",
            other => other,
        };
        NAMES.iter().find(|n| n.1 == name).map(|n| n.0)
    }

    /// The dtype of storage class `name` (`FloatStorage`).
    pub fn from_storage_class(name: &str) -> Option<DType> {
        NAMES.iter().find(|n| n.2 == name).map(|n| n.0)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "torch.{}", self.torch_name())
    }
}
