//! What goes wrong reading or writing a checkpoint.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum DcpError {
    /// A file's content is not what a DCP checkpoint holds: what is wrong, where.
    #[error("{0}")]
    Invalid(String),
    /// A file could not be read or written.
    #[error("{}: {what}: {source}", path.display())]
    Io {
        path: PathBuf,
        what: String,
        source: std::io::Error,
    },
}

impl DcpError {
    pub fn invalid(what: impl Into<String>) -> DcpError {
        DcpError::Invalid(what.into())
    }

    /// The same error, said to be about `context` (a file, an item).
    pub fn within(self, context: &str) -> DcpError {
        match self {
            DcpError::Invalid(w) => DcpError::Invalid(format!("{context}: {w}")),
            io => io,
        }
    }
}

pub type Result<T> = std::result::Result<T, DcpError>;
