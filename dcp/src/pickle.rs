//! The pickle subset a checkpoint uses: read without running anything ([`read`]) and
//! written ([`write`]), both over plain data ([`Value`]).
//!
//! Written by hand: serde-pickle refuses the class instances a checkpoint's metadata is
//! made of, and candle's reader lacks protocol 4's opcodes (`pickle.dump`'s default) and
//! copies memo entries without bound, which an untrusted file can turn into a memory bomb.

mod read;
mod value;
mod write;

pub use read::{read, PickleError};
pub use value::{Construct, Global, Value};
pub use write::write;

#[cfg(test)]
mod tests;
