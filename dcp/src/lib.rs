//! PyTorch Distributed Checkpoint (DCP) folders, read and written without Python.
//!
//! Every file here comes from outside and is untrusted: nothing read is ever run, every
//! length and offset is checked against the file before it is used, and each refusal
//! names what is wrong.

pub mod pickle;
