//! YAML parsing with serde-saphyr: resource budgets (alias bombs), duplicate keys refused,
//! and errors turned into [`SpecError`]s with line, column, field path and a did-you-mean.

use crate::{did_you_mean, Pos, Source, SpecError};
use serde::de::DeserializeOwned;
use serde_saphyr::{Budget, DuplicateKeyPolicy, Location, Spanned};

/// Position of a spanned value.
pub fn pos<T>(s: &Spanned<T>) -> Pos {
    loc_pos(&s.referenced)
}

pub(crate) fn loc_pos(l: &Location) -> Pos {
    Pos {
        line: l.line(),
        column: l.column(),
    }
}

/// Budgets sized for spec files (a few hundred nodes): an alias bomb or a huge document
/// stops parsing early with a clear error instead of eating memory.
fn budget() -> Budget {
    let mut b = Budget::default();
    b.max_events = 100_000;
    b.max_aliases = 1_000;
    b.max_anchors = 1_000;
    b.max_nodes = 50_000;
    b.max_depth = 32;
    b.max_total_scalar_bytes = 1024 * 1024;
    b
}

/// Parses `src` as `T`, with every failure a located [`SpecError`].
pub fn parse<T: DeserializeOwned>(src: &Source) -> Result<T, SpecError> {
    let options = serde_saphyr::options! {
        budget: Some(budget()),
        duplicate_keys: DuplicateKeyPolicy::Error,
        with_snippet: false,
    };
    let mut path = String::new();
    let result = serde_saphyr::with_deserializer_from_str_with_options(&src.text, options, |de| {
        let mut track = serde_path_to_error::Track::new();
        let r = T::deserialize(serde_path_to_error::Deserializer::new(de, &mut track));
        if r.is_err() {
            path = track.path().to_string();
        }
        r
    });
    result.map_err(|e| {
        let raw = e.to_string();
        // The message ends with " at line L, column C"; the position is carried separately.
        let message = match raw.rfind(" at line ") {
            Some(i) => raw[..i].to_string(),
            None => raw.clone(),
        };
        let field = clean_path(&path);
        let mut err = SpecError::file(&src.path, describe(&message)).at(e.location().as_ref().map(loc_pos));
        if let Some(f) = field {
            err = err.field(f);
        }
        match help_for(&message) {
            Some(h) => err.help(h),
            None => err,
        }
    })
}

/// serde_path_to_error's path, without the `.value` hops of `Spanned` and the `?` of an
/// unknown position.
fn clean_path(path: &str) -> Option<String> {
    let path = path.replace(".value[", "[");
    let parts: Vec<&str> = path
        .split('.')
        .filter(|p| *p != "value" && *p != "?" && !p.is_empty())
        .collect();
    (!parts.is_empty()).then(|| parts.join("."))
}

fn describe(message: &str) -> String {
    for (raw, nice) in [
        ("invalid u64", "expected a whole number >= 0"),
        ("invalid u32", "expected a whole number >= 0"),
        ("invalid f64", "expected a number"),
        ("invalid floating point", "expected a number"),
        ("invalid bool", "expected true or false"),
        ("unexpected end of input", "the document is empty or cut short"),
        (
            "expected mapping start",
            "expected a mapping of `key: value` lines here",
        ),
    ] {
        if message.starts_with(raw) {
            return format!("{nice} ({message})");
        }
    }
    if message.starts_with("budget breached") {
        return format!("the document is too large or expands too much (YAML alias bomb?): {message}");
    }
    message.to_string()
}

/// Did-you-mean for serde's "unknown field `x`, expected one of a, b" and
/// "unknown variant `x`, expected one of ..." messages.
fn help_for(message: &str) -> Option<String> {
    let (word, rest) = ["unknown field `", "unknown variant `"].iter().find_map(|prefix| {
        let rest = message.strip_prefix(prefix)?;
        let end = rest.find('`')?;
        Some((&rest[..end], &rest[end + 1..]))
    })?;
    let list = rest.split_once("expected ").map(|(_, l)| l)?;
    let list = list.strip_prefix("one of ").unwrap_or(list);
    let candidates: Vec<&str> = list
        .split(", ")
        .map(|c| c.trim_matches(|ch| ch == '`' || ch == ' '))
        .collect();
    match did_you_mean(word, candidates.iter().copied()) {
        Some(best) => Some(format!("did you mean `{best}`?")),
        None => Some(format!("valid here: {}", candidates.join(", "))),
    }
}
