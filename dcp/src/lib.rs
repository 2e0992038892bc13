//! PyTorch Distributed Checkpoint (DCP) folders, read and written without Python.
//!
//! Every file here comes from outside and is untrusted: nothing read is ever run, every
//! length and offset is checked against the file before it is used, and each refusal
//! names what is wrong.

pub mod archive;
pub mod dtype;
pub mod error;
pub mod metadata;
pub mod pickle;
pub mod read;
pub mod write;

pub use archive::TensorData;
pub use dtype::DType;
pub use error::{DcpError, Result};
pub use metadata::{Chunk, Entry, Metadata, StorageInfo, TensorEntry};
pub use read::{is_checkpoint, Checkpoint, METADATA_FILE};
pub use write::{data_file_name, write_metadata, DataFile};
