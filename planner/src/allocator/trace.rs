//! A recorded allocation trace: the requests a PyTorch run made of its allocator, as the
//! exported program's `--alloc-trace` writes them (JSON lines), read into [`Request`]s
//! that [`super::replay_requests`] replays through the same model of the caching
//! allocator the plan's own requests go through. So the model's rules and the plan's
//! sequence of requests are checked apart: a run's trace replayed against what the run
//! reserved, and the plan's requests against the run's.
//!
//! The file is untrusted: every line is checked, and a bad one is an error naming its line
//! and column and what a line may hold.

use super::Request;
use serde::Deserialize;
use shardplan_frontends::{Pos, SpecError};
use std::collections::HashMap;
use std::path::Path;

/// The format version this reads (the header's `shardplan_alloc_trace`).
pub const TRACE_VERSION: u64 = 1;

/// The most streams a trace may name: the allocator model keeps the pools of 8 apart.
pub const MAX_STREAMS: usize = super::STREAMS;

/// The largest request a trace may make (1 PiB: more than any device holds).
pub const MAX_REQUEST_BYTES: u64 = 1 << 50;

/// The most bytes a trace's requests may add up to (1 EiB): so the replay's totals and
/// addresses, which never exceed it by more than a segment per request, cannot overflow.
pub const MAX_TRACE_REQUESTED: u64 = 1 << 60;

/// What a trace says about its run, and its requests with dense ids.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedTrace {
    /// `cuda` or `cpu`.
    pub device: String,
    /// What the run measured (`torch.cuda.max_memory_allocated` / `max_memory_reserved`):
    /// a GPU run's; a CPU run has no caching allocator and records neither.
    pub max_allocated: Option<u64>,
    pub max_reserved: Option<u64>,
    /// Whether the run's allocator had expandable segments on, where it says.
    pub expandable_segments: Option<bool>,
    pub requests: Vec<Request>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    shardplan_alloc_trace: u64,
    device: String,
    max_allocated: Option<u64>,
    max_reserved: Option<u64>,
    expandable_segments: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged, deny_unknown_fields)]
enum Line {
    Alloc { alloc: u64, bytes: u64, stream: u64 },
    Free { free: u64 },
}

const LINE_FORMAT: &str =
    "each line after the header is {\"alloc\": ADDRESS, \"bytes\": N, \"stream\": S} or {\"free\": ADDRESS}; \
write the file with the exported program's --alloc-trace";

fn bad(path: &Path, line: usize, column: usize, message: String) -> SpecError {
    SpecError::file(path, message)
        .at(Some(Pos {
            line: line as u64,
            column: column.max(1) as u64,
        }))
        .help(LINE_FORMAT)
}

/// The slot of `stream`: a number below [`MAX_STREAMS`] keeps its own slot while it is
/// free (the exported program's CPU trace numbers streams as the planner does: 0 the
/// default stream, 1 all-gather, 2 reduce-scatter); any other number takes the highest slot
/// free when it first appears. `None` when all are taken.
fn stream_slot(slots: &mut [Option<u64>; MAX_STREAMS], stream: u64) -> Option<u8> {
    if let Some(s) = slots.iter().position(|&x| x == Some(stream)) {
        return Some(s as u8);
    }
    let own = usize::try_from(stream)
        .ok()
        .filter(|&s| s < MAX_STREAMS && slots[s].is_none());
    let s = own.or_else(|| (0..MAX_STREAMS).rev().find(|&s| slots[s].is_none()))?;
    slots[s] = Some(stream);
    Some(s as u8)
}

/// Reads the trace in `text` (read from `path`, which errors name). Addresses become dense
/// ids, one per allocation; a free of an address not live (made before the trace began)
/// is left out; an allocation at a live address frees the block that held it first (the
/// CPU profiler misses frees made on threads it does not watch). Streams take slots as
/// [`stream_slot`] gives them.
pub fn read_alloc_trace(path: &Path, text: &str) -> Result<RecordedTrace, SpecError> {
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
    let Some((at, first)) = lines.next() else {
        return Err(SpecError::file(path, "the file is empty: no allocation trace header").help(LINE_FORMAT));
    };
    let header: Header = serde_json::from_str(first).map_err(|e| {
        bad(
            path,
            at + 1,
            e.column(),
            format!("the header is not a shardplan allocation trace's ({e})"),
        )
    })?;
    if header.shardplan_alloc_trace != TRACE_VERSION {
        return Err(bad(
            path,
            at + 1,
            1,
            format!(
                "format version {} is not the {TRACE_VERSION} this shardplan reads",
                header.shardplan_alloc_trace
            ),
        ));
    }
    let mut live: HashMap<u64, u32> = HashMap::new();
    let mut streams: [Option<u64>; MAX_STREAMS] = [None; MAX_STREAMS];
    let mut requests = Vec::new();
    let mut next = 0u32;
    let mut total = 0u64;
    for (i, text) in lines {
        let line: Line = serde_json::from_str(text)
            .map_err(|e| bad(path, i + 1, e.column(), format!("not an allocation or a free ({e})")))?;
        match line {
            Line::Alloc { alloc, bytes, stream } => {
                let s = stream_slot(&mut streams, stream).ok_or_else(|| {
                    bad(
                        path,
                        i + 1,
                        1,
                        format!("stream {stream} is a 9th stream: the allocator model keeps {MAX_STREAMS} apart"),
                    )
                })?;
                if bytes > MAX_REQUEST_BYTES {
                    return Err(bad(
                        path,
                        i + 1,
                        1,
                        format!("a request of {bytes} bytes: more than the {MAX_REQUEST_BYTES} any device holds"),
                    ));
                }
                total = total.saturating_add(bytes);
                if total > MAX_TRACE_REQUESTED {
                    return Err(bad(
                        path,
                        i + 1,
                        1,
                        format!("the requests add up to more than the {MAX_TRACE_REQUESTED} bytes a trace may request"),
                    ));
                }
                if let Some(old) = live.insert(alloc, next) {
                    requests.push(Request::Free { id: old });
                }
                requests.push(Request::Alloc {
                    id: next,
                    stream: s,
                    bytes,
                });
                next = next
                    .checked_add(1)
                    .ok_or_else(|| bad(path, i + 1, 1, "more than 4,294,967,295 allocations".to_string()))?;
            }
            Line::Free { free } => {
                if let Some(id) = live.remove(&free) {
                    requests.push(Request::Free { id });
                }
            }
        }
    }
    Ok(RecordedTrace {
        device: header.device,
        max_allocated: header.max_allocated,
        max_reserved: header.max_reserved,
        expandable_segments: header.expandable_segments,
        requests,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = r#"{"shardplan_alloc_trace": 1, "device": "cpu", "max_allocated": null, "max_reserved": null, "expandable_segments": null}"#;

    #[test]
    fn addresses_become_ids_and_streams_keep_small_numbers() {
        let text = format!(
            "{HEADER}\n{{\"free\": 7}}\n{{\"alloc\": 100, \"bytes\": 512, \"stream\": 9}}\n\
             {{\"alloc\": 200, \"bytes\": 1024, \"stream\": 4}}\n{{\"free\": 100}}\n\
             {{\"alloc\": 100, \"bytes\": 64, \"stream\": 9}}\n{{\"alloc\": 100, \"bytes\": 32, \"stream\": 4}}\n"
        );
        let t = read_alloc_trace(Path::new("t.jsonl"), &text).unwrap();
        assert_eq!(
            t.requests,
            vec![
                // Stream 9 takes the highest free slot; stream 4 keeps its own.
                Request::Alloc {
                    id: 0,
                    stream: 7,
                    bytes: 512
                },
                Request::Alloc {
                    id: 1,
                    stream: 4,
                    bytes: 1024
                },
                Request::Free { id: 0 },
                Request::Alloc {
                    id: 2,
                    stream: 7,
                    bytes: 64
                },
                // A live address allocated again: its unseen free comes first.
                Request::Free { id: 2 },
                Request::Alloc {
                    id: 3,
                    stream: 4,
                    bytes: 32
                },
            ]
        );
        assert_eq!(t.device, "cpu");
        assert_eq!(t.max_reserved, None);
    }

    #[test]
    fn bad_lines_name_their_line_and_the_format() {
        let cases = [
            ("", "empty"),
            ("{\"device\": \"cpu\"}", "header"),
            (
                r#"{"shardplan_alloc_trace": 2, "device": "cpu", "max_allocated": null, "max_reserved": null, "expandable_segments": null}"#,
                "version 2",
            ),
        ];
        for (text, says) in cases {
            let e = read_alloc_trace(Path::new("t.jsonl"), text).unwrap_err().to_string();
            assert!(e.starts_with("t.jsonl"), "{e}");
            assert!(e.contains(says), "{e}");
        }
        for line in [
            "{\"alloc\": 1}",
            "{\"alloc\": -1, \"bytes\": 2, \"stream\": 0}",
            "[1, 2]",
            "{\"free\": 1, \"x\": 0}",
        ] {
            let e = read_alloc_trace(Path::new("t.jsonl"), &format!("{HEADER}\n\n{line}\n"))
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("t.jsonl:3:"), "{line}: {e}");
            assert!(e.contains("--alloc-trace"), "{e}");
        }
        let huge = format!("{HEADER}\n{{\"alloc\": 1, \"bytes\": {}, \"stream\": 0}}\n", u64::MAX);
        let e = read_alloc_trace(Path::new("t.jsonl"), &huge).unwrap_err().to_string();
        assert!(e.starts_with("t.jsonl:2:") && e.contains("any device holds"), "{e}");
        let many: String = (0..9)
            .map(|s| format!("{{\"alloc\": {s}, \"bytes\": 1, \"stream\": {s}}}\n"))
            .collect();
        let e = read_alloc_trace(Path::new("t.jsonl"), &format!("{HEADER}\n{many}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("9th stream"), "{e}");
    }
}
