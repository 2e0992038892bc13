//! Where each field of a validated spec was written, so checks made later (by the CLI or
//! the planner, against the model) still point at the right line.

use crate::{Pos, SpecError};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A spec file and the position of each field in it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Origin {
    pub file: PathBuf,
    spans: BTreeMap<String, Pos>,
}

impl Origin {
    pub fn new(file: &Path) -> Self {
        Origin {
            file: file.to_path_buf(),
            spans: BTreeMap::new(),
        }
    }

    pub fn insert(&mut self, field: &str, pos: Pos) {
        self.spans.insert(field.to_string(), pos);
    }

    pub fn has(&self, field: &str) -> bool {
        self.spans.contains_key(field)
    }

    /// Position of `field`, or of its nearest written parent (`batch` for `batch.seq_len`).
    pub fn pos(&self, field: &str) -> Option<Pos> {
        let mut f = field;
        loop {
            if let Some(p) = self.spans.get(f) {
                return Some(*p);
            }
            f = &f[..f.rfind('.')?];
        }
    }

    /// An error about `field`, placed where it was written (or at its parent).
    pub fn error(&self, field: &str, message: impl Into<String>, help: impl Into<String>) -> SpecError {
        SpecError::file(&self.file, message)
            .at(self.pos(field))
            .field(field)
            .help(help)
    }
}
