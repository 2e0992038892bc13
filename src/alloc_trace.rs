//! `shardplan plan --alloc-trace FILE`: a recorded run's allocator requests (the exported
//! program's `--alloc-trace`) replayed through the planner's model of PyTorch's caching
//! allocator, beside the plan's own requests replayed the same way, under both allocator
//! settings. Where the run's replay and the plan's differ, the plan's sequence of requests
//! is not the run's; where a GPU run's replay differs from what the run reserved, the
//! model's rules are not the allocator's.

use crate::fmt::bytes;
use serde::Serialize;
use shardplan_frontends::{AllocatorConfig, ParallelConfig, SpecError};
use shardplan_ir::JointGraph;
use shardplan_planner::allocator::{read_alloc_trace, replay, replay_requests, RecordedTrace, Replay};
use shardplan_planner::{steps_and_events, Plan, Runner};
use std::fmt::Write as _;
use std::path::Path;

/// The largest trace read (a 1.1B model's three steps write about 20 MB).
pub const MAX_TRACE_BYTES: u64 = 4 << 30;

/// Reads and checks the trace at `path`.
pub fn read(path: &Path) -> Result<RecordedTrace, SpecError> {
    let help = "write it with the exported program: `python train.py --alloc-trace FILE`";
    let refuse = |msg: String| SpecError::file(path, msg).help(help);
    let meta = std::fs::metadata(path).map_err(|e| refuse(format!("cannot read it: {e}")))?;
    if meta.is_dir() {
        return Err(refuse("is a directory, not an allocation trace".into()));
    }
    if meta.len() > MAX_TRACE_BYTES {
        return Err(refuse(format!(
            "is {} bytes, more than the {MAX_TRACE_BYTES} an allocation trace may have",
            meta.len()
        )));
    }
    let raw = std::fs::read(path).map_err(|e| refuse(format!("cannot read it: {e}")))?;
    let text = String::from_utf8(raw).map_err(|e| {
        refuse(format!(
            "is not UTF-8 text (byte {}): not an allocation trace",
            e.utf8_error().valid_up_to()
        ))
    })?;
    read_alloc_trace(path, &text)
}

/// The plan's requests replayed under `settings` (the plan's own steps, remade from the
/// graph it was planned for).
fn plan_replay(plan: &Plan, joint: &JointGraph, config: &ParallelConfig, settings: AllocatorConfig) -> Replay {
    let groups: Vec<_> = plan.groups.iter().map(|g| g.group.clone()).collect();
    let (_, acts) = steps_and_events(joint, &groups, config.activation_checkpointing, Runner::of(config));
    replay(&plan.programs[0], &plan.buffers, &acts, settings)
}

/// What one replay reached.
#[derive(Serialize)]
pub struct Peaks {
    pub allocated_peak: u64,
    pub reserved: u64,
    /// Each stream's own peak of requested bytes, by stream slot (the CPU trace's slots are
    /// the planner's streams: 0 default, 1 all-gather, 2 reduce-scatter).
    pub stream_requested_peaks: Vec<u64>,
}

impl Peaks {
    fn of(r: &Replay) -> Self {
        let used = r
            .stream_requested_peaks
            .iter()
            .rposition(|&b| b > 0)
            .map_or(0, |s| s + 1);
        Peaks {
            allocated_peak: r.allocated_peak,
            reserved: r.reserved,
            stream_requested_peaks: r.stream_requested_peaks[..used].to_vec(),
        }
    }
}

/// The run's requests and the plan's, under one allocator setting.
#[derive(Serialize)]
pub struct UnderSetting {
    pub expandable_segments: bool,
    /// Whether this is the plan's own setting (`allocator` in its spec).
    pub planned: bool,
    pub run: Peaks,
    pub plan: Peaks,
}

/// `--alloc-trace`'s answer (`--format json` writes it as is).
#[derive(Serialize)]
pub struct Comparison {
    pub device: String,
    pub requests: usize,
    pub settings: Vec<UnderSetting>,
    /// What a GPU run measured: allocated and reserved peaks, and its allocator setting.
    pub measured_allocated: Option<u64>,
    pub measured_reserved: Option<u64>,
    pub measured_expandable_segments: Option<bool>,
}

/// The comparison: for each allocator setting (the plan's first), the peaks of the run's
/// requests and of the plan's.
pub fn compare(plan: &Plan, joint: &JointGraph, config: &ParallelConfig, trace: &RecordedTrace) -> Comparison {
    let ours = plan.policy.allocator;
    let other = AllocatorConfig {
        expandable_segments: !ours.expandable_segments,
    };
    let settings = [(ours, true), (other, false)]
        .into_iter()
        .map(|(s, planned)| UnderSetting {
            expandable_segments: s.expandable_segments,
            planned,
            run: Peaks::of(&replay_requests(&trace.requests, s)),
            plan: Peaks::of(&plan_replay(plan, joint, config, s)),
        })
        .collect();
    Comparison {
        device: trace.device.clone(),
        requests: trace.requests.len(),
        settings,
        measured_allocated: trace.max_allocated,
        measured_reserved: trace.max_reserved,
        measured_expandable_segments: trace.expandable_segments,
    }
}

fn setting_name(expandable: bool) -> &'static str {
    if expandable {
        "expandable segments"
    } else {
        "cudaMalloc segments"
    }
}

fn streams(p: &[u64]) -> String {
    p.iter().map(|&b| bytes(b)).collect::<Vec<_>>().join(" / ")
}

/// The comparison as text.
pub fn text(c: &Comparison, file: &Path) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "the allocator model on a recorded run ({}: {} trace, {} requests) and on the plan:",
        file.display(),
        c.device,
        c.requests
    );
    let _ = writeln!(
        o,
        "  {:<30} {:>14} {:>12} {:>11}  peak requested by stream",
        "", "allocated peak", "reserved", "run / plan"
    );
    for s in &c.settings {
        let which = if s.planned { "the plan's" } else { "the other" };
        let _ = writeln!(
            o,
            "  {} ({which} allocator setting):",
            setting_name(s.expandable_segments)
        );
        let ratio = s.run.reserved as f64 / s.plan.reserved.max(1) as f64;
        for (name, p, r) in [
            ("the run's requests", &s.run, format!("{ratio:.3}x")),
            ("the plan's requests", &s.plan, String::new()),
        ] {
            let _ = writeln!(
                o,
                "    {name:<28} {:>14} {:>12} {r:>11}  {}",
                bytes(p.allocated_peak),
                bytes(p.reserved),
                streams(&p.stream_requested_peaks)
            );
        }
    }
    if let (Some(a), Some(r)) = (c.measured_allocated, c.measured_reserved) {
        let setting = c
            .measured_expandable_segments
            .map_or("allocator setting not recorded", setting_name);
        let _ = writeln!(
            o,
            "  measured by the run ({setting}): allocated peak {}, reserved {}",
            bytes(a),
            bytes(r)
        );
    }
    if c.device == "cpu" {
        let _ = writeln!(
            o,
            "  (a CPU trace: the requests a GPU run makes too, on the streams FSDP2 makes them on; streams 0 default, 1 all-gather, 2 reduce-scatter)"
        );
    }
    o
}
