//! `shardplan plan --compare FILE`: the plan's predictions beside what a run measured.
//!
//! FILE is a `shardplan train --log` file (JSON lines, one per step), or one JSON object from
//! any framework: `tokens_per_second` (all ranks together; or `tokens_per_second_per_gpu`),
//! `step_seconds`, `peak_allocated` and `peak_reserved` (bytes per rank). The output of
//! `benches/fsdp2_step.py` reads as it is (`memory.peak_allocated_bytes`, ...), or a
//! `shardplan train --profile` file, whose totals by instruction kind print beside the
//! plan's predicted durations of the same kinds. Every file is untrusted: it is read with a
//! size bound, and a value that is not a finite, non-negative number is refused naming the
//! file, the line and the field.

use crate::fmt::bytes;
use shardplan_executor::train::profile::{self, Kind, Profile};
use shardplan_frontends::{Pos, SpecError};
use shardplan_planner::Plan;
use std::fmt::Write as _;
use std::path::Path;

/// The largest file `--compare` reads (a log of a million steps is far smaller).
pub const MAX_COMPARE_BYTES: u64 = 256 << 20;

/// What a run measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Measured {
    /// What the figures are ("train log, 20 steps, median after the first").
    pub what: String,
    /// Tokens per second, all ranks together.
    pub tokens_per_second: Option<f64>,
    pub step_seconds: Option<f64>,
    /// Most bytes allocated on one rank, and where the figure comes from.
    pub peak_allocated: Option<(u64, &'static str)>,
    /// Most bytes the allocator reserved on one rank.
    pub peak_reserved: Option<u64>,
    /// A `train --profile` file: time per step by instruction kind and by op.
    pub profile: Option<Profile>,
}

fn refuse(path: &Path, line: Option<u64>, field: &str, msg: String) -> SpecError {
    let mut e = SpecError::file(path, msg).help(
        "give a `shardplan train --log` file, or a JSON object with tokens_per_second, step_seconds, peak_allocated and peak_reserved (bytes)",
    );
    if let Some(l) = line {
        e = e.at(Some(Pos { line: l, column: 1 }));
    }
    if !field.is_empty() {
        e = e.field(field);
    }
    e
}

/// A finite, non-negative number at `field` of `v` (`a.b` walks objects), if present.
fn number(path: &Path, line: Option<u64>, v: &serde_json::Value, field: &str) -> Result<Option<f64>, SpecError> {
    let mut cur = v;
    for key in field.split('.') {
        match cur.get(key) {
            Some(x) => cur = x,
            None => return Ok(None),
        }
    }
    if cur.is_null() {
        return Ok(None);
    }
    match cur.as_f64() {
        Some(x) if x.is_finite() && x >= 0.0 => Ok(Some(x)),
        _ => Err(refuse(
            path,
            line,
            field,
            format!("`{field}` is {cur}, not a finite non-negative number"),
        )),
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    (!v.is_empty()).then(|| v[v.len() / 2])
}

/// Bytes as an integer (refusing what no memory holds: above 2^53).
fn byte_count(path: &Path, line: Option<u64>, field: &str, x: f64) -> Result<u64, SpecError> {
    if x > 9.007_199_254_740_992e15 {
        return Err(refuse(
            path,
            line,
            field,
            format!("`{field}` is {x} bytes, more than any device holds"),
        ));
    }
    Ok(x.round() as u64)
}

/// Reads `path` (a train log or one JSON object).
pub fn read(path: &Path) -> Result<Measured, SpecError> {
    let meta = std::fs::metadata(path).map_err(|e| refuse(path, None, "", format!("cannot read it: {e}")))?;
    if meta.is_dir() {
        return Err(refuse(path, None, "", "is a directory, not a metrics file".into()));
    }
    if meta.len() > MAX_COMPARE_BYTES {
        return Err(refuse(
            path,
            None,
            "",
            format!(
                "is {} bytes, more than the {MAX_COMPARE_BYTES} a metrics file may have",
                meta.len()
            ),
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| refuse(path, None, "", format!("cannot read it: {e}")))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        refuse(
            path,
            None,
            "",
            format!(
                "is not UTF-8 text (byte {}): not a metrics file",
                e.utf8_error().valid_up_to()
            ),
        )
    })?;
    // A profile is one (pretty-printed) object; its own reader places any error in it.
    if text.contains(&format!("\"{}\"", profile::FORMAT)) {
        let p = profile::read(path, &text)?;
        return Ok(Measured {
            what: format!(
                "train profile, mean of {} rank(s), steps {}-{}",
                p.ranks.len(),
                p.steps.first,
                p.steps.last
            ),
            step_seconds: Some(p.mean.step_seconds.0),
            profile: Some(p),
            ..Measured::default()
        });
    }
    // One JSON value for the whole file, or JSON lines.
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
        if v.is_object() && v.get("step").is_none() {
            return one_object(path, &v);
        }
    }
    log_lines(path, &text)
}

fn one_object(path: &Path, v: &serde_json::Value) -> Result<Measured, SpecError> {
    let tps =
        match number(path, None, v, "tokens_per_second")? {
            Some(x) => Some(x),
            None => match (
                number(path, None, v, "tokens_per_second_per_gpu")?,
                number(path, None, v, "gpus")?,
            ) {
                (Some(x), Some(g)) => Some(x * g),
                (Some(_), None) => return Err(refuse(
                    path,
                    None,
                    "gpus",
                    "`tokens_per_second_per_gpu` needs `gpus` (how many ranks ran) to compare with the plan's total"
                        .into(),
                )),
                _ => None,
            },
        };
    let step = match number(path, None, v, "step_seconds")? {
        Some(x) => Some(x),
        None => number(path, None, v, "step_seconds_median")?,
    };
    let mut alloc = None;
    for field in ["peak_allocated", "peak_allocated_bytes", "memory.peak_allocated_bytes"] {
        if let Some(x) = number(path, None, v, field)? {
            alloc = Some((byte_count(path, None, field, x)?, "as reported"));
            break;
        }
    }
    let mut reserved = None;
    for field in ["peak_reserved", "peak_reserved_bytes", "memory.peak_reserved_bytes"] {
        if let Some(x) = number(path, None, v, field)? {
            reserved = Some(byte_count(path, None, field, x)?);
            break;
        }
    }
    if tps.is_none() && step.is_none() && alloc.is_none() && reserved.is_none() {
        return Err(refuse(
            path,
            None,
            "",
            "holds none of tokens_per_second, step_seconds, peak_allocated, peak_reserved".into(),
        ));
    }
    Ok(Measured {
        what: "one JSON object".into(),
        tokens_per_second: tps,
        step_seconds: step,
        peak_allocated: alloc,
        peak_reserved: reserved,
        profile: None,
    })
}

fn log_lines(path: &Path, text: &str) -> Result<Measured, SpecError> {
    let (mut tps, mut step) = (Vec::new(), Vec::new());
    let (mut own_peak, mut dev_alloc, mut dev_reserved) = (None::<u64>, None::<u64>, None::<u64>);
    // Another framework's log (`export fsdp2`'s train.py): top-level peaks per step.
    let (mut logged_alloc, mut logged_reserved) = (None::<u64>, None::<u64>);
    let mut rows = 0u64;
    for (i, line) in text.lines().enumerate() {
        let n = Some(i as u64 + 1);
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            refuse(
                path,
                n,
                "",
                format!("line {} is not JSON ({e}): not a `shardplan train --log` file", i + 1),
            )
        })?;
        if !v.is_object() || v.get("step").is_none() {
            return Err(refuse(
                path,
                n,
                "",
                format!("line {} is not a step of a train log", i + 1),
            ));
        }
        rows += 1;
        if let Some(x) = number(path, n, &v, "tokens_per_second")? {
            tps.push((rows, x));
        }
        if let Some(x) = number(path, n, &v, "step_seconds")? {
            step.push((rows, x));
        }
        if let Some(peaks) = v.get("measured_peak").and_then(|p| p.as_array()) {
            for (r, p) in peaks.iter().enumerate() {
                let field = format!("measured_peak[{r}]");
                let x = match p.as_f64() {
                    Some(x) if x.is_finite() && x >= 0.0 => byte_count(path, n, &field, x)?,
                    _ => return Err(refuse(path, n, &field, format!("`{field}` is {p}, not a byte count"))),
                };
                own_peak = Some(own_peak.map_or(x, |m| m.max(x)));
            }
        }
        for (key, slot) in [
            ("peak_allocated", &mut logged_alloc),
            ("peak_reserved", &mut logged_reserved),
        ] {
            if let Some(x) = number(path, n, &v, key)? {
                let x = byte_count(path, n, key, x)?;
                *slot = Some(slot.map_or(x, |m: u64| m.max(x)));
            }
        }
        if let Some(devs) = v.get("measured_device").and_then(|p| p.as_array()) {
            for (r, d) in devs.iter().enumerate() {
                if d.is_null() {
                    continue;
                }
                for (key, slot) in [("allocated_peak", &mut dev_alloc), ("reserved_peak", &mut dev_reserved)] {
                    let field = format!("measured_device[{r}].{key}");
                    if let Some(x) = number(path, n, d, key)? {
                        let x = byte_count(path, n, &field, x)?;
                        *slot = Some(slot.map_or(x, |m: u64| m.max(x)));
                    }
                }
            }
        }
    }
    if rows == 0 {
        return Err(refuse(path, None, "", "is empty: no steps to compare".into()));
    }
    // The first step pays for warm-up: the medians leave it out when there are more.
    let steady = |v: Vec<(u64, f64)>| {
        median(
            v.into_iter()
                .filter(|&(r, _)| rows == 1 || r > 1)
                .map(|(_, x)| x)
                .collect(),
        )
    };
    let alloc = match (dev_alloc, own_peak, logged_alloc) {
        (Some(d), _, _) => Some((d, "CUDA allocator")),
        (None, Some(o), _) => Some((o, "executor's own accounting")),
        (None, None, Some(l)) => Some((l, "the log's peak_allocated")),
        _ => None,
    };
    let dev_reserved = dev_reserved.or(logged_reserved);
    Ok(Measured {
        what: format!(
            "train log, {rows} step{}{}",
            if rows == 1 { "" } else { "s" },
            if rows > 1 { ", median after the first" } else { "" }
        ),
        tokens_per_second: steady(tps),
        step_seconds: steady(step),
        peak_allocated: alloc,
        peak_reserved: dev_reserved,
        profile: None,
    })
}

/// The comparison table: predicted, measured, and measured / predicted.
pub fn table(plan: &Plan, m: &Measured, file: &Path) -> String {
    let mut o = String::new();
    if plan.policy.runtime.is_shardplan() {
        let _ = writeln!(o, "predicted vs measured ({}: {}):", file.display(), m.what);
    } else {
        let _ = writeln!(
            o,
            "predicted for PyTorch FSDP2 (runtime: {}) vs measured ({}: {}):",
            plan.policy.runtime.name(),
            file.display(),
            m.what
        );
    }
    let _ = writeln!(o, "  {:<30} {:>14} {:>14} {:>7}", "", "predicted", "measured", "ratio");
    let ratio = |m: f64, p: f64| if p > 0.0 { format!("{:.2}x", m / p) } else { "-".into() };
    let dur = |s: f64| {
        if s >= 1e-3 {
            format!("{:.1} ms", s * 1e3)
        } else {
            format!("{:.1} us", s * 1e6)
        }
    };
    let e = &plan.estimate;
    let row = |o: &mut String, name: &str, p: String, meas: Option<String>, r: String| {
        let _ = writeln!(
            o,
            "  {:<30} {:>14} {:>14} {:>7}",
            name,
            p,
            meas.unwrap_or_else(|| "-".into()),
            r
        );
    };
    row(
        &mut o,
        "tokens/s (all ranks)",
        format!("{:.0}", e.tokens_per_s),
        m.tokens_per_second.map(|x| format!("{x:.0}")),
        m.tokens_per_second.map_or("-".into(), |x| ratio(x, e.tokens_per_s)),
    );
    row(
        &mut o,
        "step time",
        dur(e.step_s),
        m.step_seconds.map(dur),
        m.step_seconds.map_or("-".into(), |x| ratio(x, e.step_s)),
    );
    // The allocated and reserved peaks' rows against a prediction of both.
    let peaks = |o: &mut String, labels: [&str; 2], peak: u64, reserved: u64| {
        row(
            o,
            labels[0],
            bytes(peak),
            m.peak_allocated.map(|(b, _)| bytes(b)),
            m.peak_allocated
                .map_or("-".into(), |(b, _)| ratio(b as f64, peak as f64)),
        );
        row(
            o,
            labels[1],
            bytes(reserved),
            m.peak_reserved.map(bytes),
            m.peak_reserved.map_or("-".into(), |b| ratio(b as f64, reserved as f64)),
        );
    };
    peaks(
        &mut o,
        ["peak allocated per rank", "peak reserved per rank"],
        plan.memory.peak,
        plan.memory.reserved_peak,
    );
    // Routing is data-dependent: the plan is sized at the bound, and a run's batches land
    // between that and the even split.
    if let Some([even_peak, even_reserved, _]) = plan.experts.as_ref().and_then(|x| x.even) {
        peaks(
            &mut o,
            ["  at the even routing split", "  reserved at the even split"],
            even_peak,
            even_reserved,
        );
        let _ = writeln!(
            o,
            "  (the two peaks above them are at the routing bound, moe.capacity {}x the even split; a run's batches route between the two)",
            plan.experts.as_ref().map_or(1.0, |x| x.capacity)
        );
    }
    if let Some((_, src)) = m.peak_allocated {
        let _ = writeln!(o, "  (measured allocation: {src}; ratio = measured / predicted)");
    }
    if let Some(x) = &plan.shardplan_executor {
        let _ = writeln!(
            o,
            "  (shardplan's executor on the same spec predicts {:.0} tokens/s, {} per step, peak {} allocated / {} reserved; a `shardplan train` run compares with a plan without `runtime: {}`)",
            x.tokens_per_s,
            dur(x.step_s),
            bytes(x.peak),
            bytes(x.reserved_peak),
            plan.policy.runtime.name()
        );
    }
    if let Some(p) = &m.profile {
        by_kind(&mut o, plan, p, &dur, &ratio);
    }
    o
}

/// The profile's time per step by instruction kind beside the plan's predicted time of the
/// same kinds (each instruction from the previous one's end on its stream to its own end).
fn by_kind(o: &mut String, plan: &Plan, p: &Profile, dur: &dyn Fn(f64) -> String, ratio: &dyn Fn(f64, f64) -> String) {
    let (rep, shard) = (plan.mesh.replicate(), plan.mesh.shard());
    if p.model.0 != plan.model || (p.mesh.replicate, p.mesh.shard) != (rep, shard) {
        let _ = writeln!(
            o,
            "  note: the profile was measured on {} {}x{}, this plan is {} {rep}x{shard}: the kinds below compare different programs",
            p.model.0, p.mesh.replicate, p.mesh.shard, plan.model
        );
    }
    let predicted = profile::predicted(plan);
    let _ = writeln!(
        o,
        "  {:<30} {:>14} {:>14} {:>7}",
        "time per step, by instruction", "predicted", "measured", "ratio"
    );
    let mut counts_differ = Vec::new();
    for k in Kind::ALL {
        let (ps, pn) = predicted[k.index()];
        let row = p.mean.kind(k);
        if pn == 0 && row.is_none() {
            continue;
        }
        let ms = row.map(|r| r.seconds.0);
        if row.map_or(0, |r| r.count) != pn {
            counts_differ.push(format!("{} {} vs {pn}", k.name(), row.map_or(0, |r| r.count)));
        }
        let _ = writeln!(
            o,
            "  {:<30} {:>14} {:>14} {:>7}",
            format!("  {}", k.name()),
            dur(ps),
            ms.map_or("-".into(), dur),
            ms.map_or("-".into(), |x| ratio(x, ps))
        );
    }
    if !counts_differ.is_empty() {
        let _ = writeln!(
            o,
            "  note: instructions per step differ (measured vs planned): {}",
            counts_differ.join(", ")
        );
    }
    let _ = writeln!(
        o,
        "  (waits and alloc/free include the time they wait; streams overlap, so the kinds add up to more than the step)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn an_exported_programs_log_reads_as_it_is() {
        let d = tempfile::tempdir().unwrap();
        let log = "{\"step\": 1, \"loss\": 5.5, \"step_seconds\": 2.0, \"tokens_per_second\": 64.0, \"peak_allocated\": 900, \"peak_reserved\": null}\n\
                   {\"step\": 2, \"loss\": 5.4, \"step_seconds\": 1.0, \"tokens_per_second\": 128.0, \"peak_allocated\": 1000, \"peak_reserved\": null}\n";
        let m = read(&write(d.path(), "fsdp2.jsonl", log)).unwrap();
        assert_eq!(m.tokens_per_second, Some(128.0));
        assert_eq!(m.peak_allocated, Some((1000, "the log's peak_allocated")));
        assert_eq!(m.peak_reserved, None);
        let gpu = "{\"step\": 1, \"step_seconds\": 1.0, \"tokens_per_second\": 1.0, \"peak_allocated\": 5, \"peak_reserved\": 8}\n";
        let m = read(&write(d.path(), "gpu.jsonl", gpu)).unwrap();
        assert_eq!(m.peak_reserved, Some(8));
        let bad = "{\"step\": 1, \"peak_allocated\": -3}\n";
        let e = read(&write(d.path(), "bad.jsonl", bad)).unwrap_err().to_string();
        assert!(e.contains("peak_allocated"), "{e}");
    }

    #[test]
    fn a_train_log_reads_as_medians_after_the_first_step() {
        let d = tempfile::tempdir().unwrap();
        let log = "{\"step\":1,\"tokens_per_second\":10,\"step_seconds\":9.0,\"measured_peak\":[100,120]}\n\
                   {\"step\":2,\"tokens_per_second\":100,\"step_seconds\":1.0,\"measured_peak\":[100,130],\"measured_device\":[{\"allocated_peak\":150,\"reserved_peak\":200,\"in_use\":1,\"total\":2},null]}\n\
                   {\"step\":3,\"tokens_per_second\":110,\"step_seconds\":0.9,\"measured_peak\":[100,120]}\n\
                   {\"step\":4,\"tokens_per_second\":90,\"step_seconds\":1.1,\"measured_peak\":[100,120]}\n";
        let m = read(&write(d.path(), "log.jsonl", log)).unwrap();
        assert_eq!(m.tokens_per_second, Some(100.0));
        assert_eq!(m.step_seconds, Some(1.0));
        assert_eq!(m.peak_allocated, Some((150, "CUDA allocator")));
        assert_eq!(m.peak_reserved, Some(200));
        assert!(m.what.contains("4 steps, median after the first"));
        // Without device figures, the executor's own accounting.
        let m = read(&write(
            d.path(),
            "cpu.jsonl",
            "{\"step\":1,\"tokens_per_second\":5,\"measured_peak\":[7]}\n",
        ))
        .unwrap();
        assert_eq!(
            (m.tokens_per_second, m.peak_allocated),
            (Some(5.0), Some((7, "executor's own accounting")))
        );
    }

    #[test]
    fn one_object_from_any_framework_reads_too() {
        let d = tempfile::tempdir().unwrap();
        let m = read(&write(
            d.path(),
            "fsdp2.json",
            "{\"tokens_per_second\": 24436.1, \"step_seconds_median\": 0.168, \"memory\": {\"peak_allocated_bytes\": 22763000000, \"peak_reserved_bytes\": 29500000000}}",
        ))
        .unwrap();
        assert_eq!(m.tokens_per_second, Some(24436.1));
        assert_eq!(m.step_seconds, Some(0.168));
        assert_eq!(m.peak_allocated, Some((22_763_000_000, "as reported")));
        assert_eq!(m.peak_reserved, Some(29_500_000_000));
        let m = read(&write(
            d.path(),
            "x.json",
            "{\"tokens_per_second_per_gpu\": 100, \"gpus\": 8, \"peak_allocated\": 1e9}",
        ))
        .unwrap();
        assert_eq!(m.tokens_per_second, Some(800.0));
    }

    #[test]
    fn bad_files_are_refused_naming_the_file_line_and_field() {
        let d = tempfile::tempdir().unwrap();
        let cases: &[(&str, &str, &[&str])] = &[
            ("empty.jsonl", "", &["is empty"]),
            (
                "nan.json",
                "{\"tokens_per_second\": -3}",
                &["`tokens_per_second` is -3"],
            ),
            (
                "str.json",
                "{\"peak_allocated\": \"big\"}",
                &["`peak_allocated` is \"big\""],
            ),
            (
                "huge.json",
                "{\"peak_reserved\": 1e300}",
                &["more than any device holds"],
            ),
            ("none.json", "{\"loss\": 3}", &["holds none of"]),
            ("pergpu.json", "{\"tokens_per_second_per_gpu\": 3}", &["needs `gpus`"]),
            (
                "bad.jsonl",
                "{\"step\":1,\"tokens_per_second\":1}\n{\"step\":2,\"tokens_per_second\":1\n",
                &["line 2 is not JSON"],
            ),
            (
                "peak.jsonl",
                "{\"step\":1,\"measured_peak\":[1,\"x\"]}\n",
                &["`measured_peak[1]` is \"x\""],
            ),
            ("other.jsonl", "[1,2]\n[3]\n", &["line 1 is not a step"]),
        ];
        for (name, text, want) in cases {
            let p = write(d.path(), name, text);
            let e = read(&p).unwrap_err().to_string();
            assert!(e.contains(name), "{name}: {e}");
            for w in *want {
                assert!(e.contains(w), "{name}: {e}");
            }
        }
        let e = read(d.path()).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let e = read(&d.path().join("missing.json")).unwrap_err().to_string();
        assert!(e.contains("cannot read it"), "{e}");
        let p = d.path().join("bin.json");
        std::fs::write(&p, [0xff, 0xfe, 0x00]).unwrap();
        assert!(read(&p).unwrap_err().to_string().contains("not UTF-8"));
    }
}
