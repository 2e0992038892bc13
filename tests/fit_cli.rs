//! `shardplan train` on the CPU refuses a plan whose ranks need more memory than the host
//! has, before it allocates, naming the shortfall and the nearest change that fits.
//! `SHARDPLAN_HOST_MEMORY` stands in for the host's available memory.

mod common;

use common::stderr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn train(model: &str, spec: &Path, host_memory: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_shardplan"));
    c.args([
        "train",
        "--model",
        model,
        "--parallel",
        spec.to_str().unwrap(),
        "--steps",
        "1",
    ])
    .env("SHARDPLAN_HOST_MEMORY", host_memory)
    .env_remove("OMPI_COMM_WORLD_LOCAL_SIZE")
    .env_remove("LOCAL_WORLD_SIZE")
    .env_remove("SLURM_NTASKS_PER_NODE");
    c
}

fn spec(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("parallel.yaml");
    std::fs::write(&p, text).unwrap();
    p
}

/// Bytes of a size as `shardplan` prints it (`1.5 GiB`, `812 B`): within a rounding step.
fn size_after<'a>(text: &'a str, before: &str) -> (f64, &'a str) {
    let at = text.find(before).unwrap_or_else(|| panic!("no `{before}` in: {text}")) + before.len();
    let rest = &text[at..];
    let mut words = rest.split_whitespace();
    let (num, unit) = (words.next().unwrap(), words.next().unwrap());
    let unit = unit.trim_end_matches(|c: char| !c.is_ascii_alphabetic());
    let scale = match unit {
        "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0f64.powi(3),
        "TiB" => 1024.0f64.powi(4),
        other => panic!("unit {other} in {text}"),
    };
    (num.parse::<f64>().unwrap() * scale, rest)
}

/// Llama 3 8B on four rank threads needs far more than 23 GiB: refused with exit code 2
/// and the shortfall, inside an address-space limit of 4 GiB that the weights alone (8 GB
/// of f32 per rank) could never be made in. Were anything allocated before the check, the
/// process would die at that limit instead.
#[test]
fn llama3_8b_on_a_23_gib_host_is_refused_before_it_allocates() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(
        dir.path(),
        "mesh: {replicate: 1, shard: 4}\ngpus_per_node: 4\nmixed_precision: {param: f32, reduce: f32}\nbatch: {per_rank: 1, seq_len: 2048}\n",
    );
    let mut c = train("llama3-8b", &s, "23GiB");
    c.stdout(Stdio::null()).stderr(Stdio::piped());
    // SAFETY: setrlimit is async-signal-safe; the closure allocates nothing.
    unsafe {
        c.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 4 << 30,
                rlim_max: 4 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let start = Instant::now();
    let mut child = c.spawn().unwrap();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(300) {
            child.kill().unwrap();
            panic!("still running after 300 s: the run was not refused");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("parallel.yaml"), "the error names the spec: {err}");
    assert!(
        err.contains("of host memory (4 rank(s) as threads of this process x"),
        "{err}"
    );
    assert!(
        err.contains("more than the 23.0 GiB available (SHARDPLAN_HOST_MEMORY=23GiB)"),
        "{err}"
    );
    let (need, _) = size_after(&err, "the plan needs ");
    let (over, _) = size_after(&err, "), ");
    let gib = 1024f64.powi(3);
    assert!(need > 100.0 * gib, "{err}");
    assert!(
        (need - 23.0 * gib - over).abs() < 0.1 * gib,
        "shortfall = need - budget: {err}"
    );
    assert!(err.contains("help:"), "{err}");
}

/// With a budget between the plan's need and its cheapest single change's, the refusal
/// names a change that fits; with less than any change needs, the closest one.
#[test]
fn the_refusal_names_the_nearest_change_that_fits() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(
        dir.path(),
        "mesh: {replicate: 1, shard: 2}\ngpus_per_node: 2\nmixed_precision: {param: f32, reduce: f32}\nbatch: {per_rank: 4, seq_len: 64}\nreshard_after_forward: false\n",
    );
    let o = train("tiny-llama", &s, "1KiB").output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("no single change fits; the closest is `"), "{err}");
    let (need, _) = size_after(&err, "the plan needs ");
    let (closest, _) = size_after(&err, "` at ");
    assert!(closest < 0.9 * need, "some change lowers the need: {err}");

    let budget = ((need + closest) / 2.0) as u64;
    let o = train("tiny-llama", &s, &budget.to_string()).output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("the nearest change that fits is `"), "{err}");
    let (fits, _) = size_after(&err, "` (");
    assert!(fits <= budget as f64 * 1.001, "{err}");

    // Enough memory: the run goes ahead.
    let o = train("tiny-llama", &s, "64GiB").output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn a_host_memory_that_is_not_a_size_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(
        dir.path(),
        "mesh: {replicate: 1, shard: 1}\ngpus_per_node: 1\nbatch: {per_rank: 1, seq_len: 16}\n",
    );
    let o = train("tiny-llama", &s, "lots").output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("SHARDPLAN_HOST_MEMORY: `lots` is not a size"), "{err}");
}
