//! The one error type of the frontends: file, position, field, what is wrong and the fix.

use std::fmt;
use std::path::{Path, PathBuf};

/// A problem with a file the user gave us (boxed, so `Result`s stay small).
#[derive(Debug, Clone, PartialEq)]
pub struct SpecError(Box<SpecErrorDetails>);

/// What a [`SpecError`] says.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecErrorDetails {
    pub file: PathBuf,
    /// 1-based line and column, where the format has them.
    pub line: Option<u64>,
    pub column: Option<u64>,
    /// Dotted field path in the spec (`mesh.shard`).
    pub field: Option<String>,
    pub message: String,
    /// How to fix it.
    pub help: Option<String>,
}

impl SpecError {
    /// An error about the whole file.
    pub fn file(file: &Path, message: impl Into<String>) -> Self {
        SpecError(Box::new(SpecErrorDetails {
            file: file.to_path_buf(),
            line: None,
            column: None,
            field: None,
            message: message.into(),
            help: None,
        }))
    }

    pub fn at(mut self, pos: Option<Pos>) -> Self {
        if let Some(p) = pos {
            self.0.line = Some(p.line);
            self.0.column = Some(p.column);
        }
        self
    }

    pub fn field(mut self, field: impl Into<String>) -> Self {
        self.0.field = Some(field.into());
        self
    }

    pub fn help(mut self, help: impl Into<String>) -> Self {
        self.0.help = Some(help.into());
        self
    }
}

impl std::ops::Deref for SpecError {
    type Target = SpecErrorDetails;

    fn deref(&self) -> &SpecErrorDetails {
        &self.0
    }
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(col) = self.column {
                write!(f, ":{col}")?;
            }
        }
        write!(f, ": ")?;
        if let Some(field) = &self.field {
            write!(f, "`{field}`: ")?;
        }
        write!(f, "{}", self.message)?;
        if let Some(help) = &self.help {
            write!(f, "\n  help: {help}")?;
        }
        Ok(())
    }
}

impl std::error::Error for SpecError {}

/// A 1-based line and column in a source file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Pos {
    pub line: u64,
    pub column: u64,
}

/// The closest of `candidates` to `word`, if one is close enough to be a likely typo.
pub fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .into_iter()
        .map(|c| (strsim::jaro_winkler(word, c), c))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, c)| c)
}
