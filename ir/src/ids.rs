//! Typed ids: u32 newtypes that print short (`n12`, `p3`, `s2`) and index side tables.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub u32);

        impl $name {
            /// The id as an index into its side table.
            pub fn index(self) -> usize {
                self.0 as usize
            }

            pub(crate) fn from_index(index: usize) -> Self {
                Self(u32::try_from(index).expect(concat!(stringify!($name), " space exhausted")))
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

typed_id!(
    /// A node of the graph; every node produces exactly one value, so this is also a value id.
    NodeId,
    "n"
);
typed_id!(
    /// A trainable parameter (an entry of the graph's parameter table).
    ParamId,
    "p"
);
typed_id!(
    /// A module scope (`layers.3.attention`).
    ScopeId,
    "s"
);
