//! Reading a spec file: existence, size, encoding and emptiness, each with its own message.

use crate::{Pos, SpecError};
use std::path::{Path, PathBuf};

/// Largest spec we read; real specs and HF config.json files are a few KiB.
pub const MAX_SPEC_BYTES: u64 = 4 * 1024 * 1024;

/// A spec file's text and where it came from.
#[derive(Clone, Debug)]
pub struct Source {
    pub path: PathBuf,
    pub text: String,
}

impl Source {
    /// Reads `path`, refusing missing, oversized, binary and empty files.
    pub fn read(path: &Path) -> Result<Source, SpecError> {
        let meta = std::fs::metadata(path).map_err(|e| io_error(path, &e))?;
        if meta.is_dir() {
            return Err(SpecError::file(path, "is a directory, not a spec file")
                .help("pass the path of a .yaml or config.json file"));
        }
        if meta.len() > MAX_SPEC_BYTES {
            return Err(SpecError::file(
                path,
                format!("is {} bytes; a spec is at most {MAX_SPEC_BYTES}", meta.len()),
            )
            .help("pass a model or parallel spec, not a data or weights file"));
        }
        let bytes = std::fs::read(path).map_err(|e| io_error(path, &e))?;
        let text = String::from_utf8(bytes).map_err(|e| {
            let at = e.utf8_error().valid_up_to();
            SpecError::file(path, format!("is not UTF-8 text (invalid byte at offset {at})"))
                .help("pass a YAML spec or a JSON config.json, not a binary file")
        })?;
        let src = Source {
            path: path.to_path_buf(),
            text,
        };
        if src.is_blank() {
            return Err(SpecError::file(path, "is empty").help("write a spec in it; see examples/ for complete ones"));
        }
        Ok(src)
    }

    /// A source from text in memory (tests, presets).
    pub fn from_text(path: impl Into<PathBuf>, text: impl Into<String>) -> Source {
        Source {
            path: path.into(),
            text: text.into(),
        }
    }

    /// True when the text has nothing but whitespace and `#` comments.
    pub fn is_blank(&self) -> bool {
        self.text.lines().all(|l| {
            let t = l.trim();
            t.is_empty() || t.starts_with('#')
        })
    }

    /// 1-based line and column of a byte offset.
    pub fn pos_of_offset(&self, offset: usize) -> Pos {
        let before = &self.text[..offset.min(self.text.len())];
        let line = before.matches('\n').count() as u64 + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) as u64 + 1;
        Pos { line, column }
    }

    /// Position of the JSON key `"key":` (the first one, which is the top-level one in a
    /// flat HF config.json), for errors found after parsing.
    pub fn json_key_pos(&self, key: &str) -> Option<Pos> {
        let quoted = format!("\"{key}\"");
        self.text.match_indices(&quoted).find_map(|(i, _)| {
            let rest = self.text[i + quoted.len()..].trim_start();
            rest.starts_with(':').then(|| self.pos_of_offset(i))
        })
    }
}

fn io_error(path: &Path, e: &std::io::Error) -> SpecError {
    match e.kind() {
        std::io::ErrorKind::NotFound => {
            SpecError::file(path, "no such file").help("check the path; bundled examples are under examples/")
        }
        std::io::ErrorKind::PermissionDenied => {
            SpecError::file(path, "permission denied").help("make the file readable")
        }
        _ => SpecError::file(path, format!("cannot be read: {e}")),
    }
}
