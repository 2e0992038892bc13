//! Seeded, structured mutation of every input file shardplan reads: plan JSON, YAML model
//! and parallel specs, HF config.json, checkpoint metadata and rank files, safetensors
//! weights, token files. Each case must end in a clean error naming the file (and a field,
//! line or byte offset) or in a run equal to the original; never a panic, a hang, an
//! "internal error" or a silently different result.
//!
//! `SHARDPLAN_FUZZ_CASES=N` runs N cases of every kind (CI runs the defaults of `cases`);
//! `SHARDPLAN_FUZZ_SEED=S` changes the seed (printed on failure); `scripts/fuzz.sh` runs
//! thousands.

mod common;

use serde_json::Value;
use shardplan_executor::{ExecError, ShardedTrainer};
use shardplan_frontends::{load_model, load_parallel, parse_parallel_spec, trace_options, Source};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

// ---- the harness ----

/// splitmix64: small, seedable, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

fn seed() -> u64 {
    std::env::var("SHARDPLAN_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_5eed)
}

/// Cases of one kind: `SHARDPLAN_FUZZ_CASES`, else the CI default.
fn cases(default: usize) -> usize {
    std::env::var("SHARDPLAN_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Runs `f` on its own thread: a panic or a run past `limit` fails the test naming the case.
fn guarded<T: Send + 'static>(case: &str, limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let r = f();
        let _ = tx.send(());
        r
    });
    match rx.recv_timeout(limit) {
        Ok(()) => h
            .join()
            .unwrap_or_else(|_| panic!("{case}: panicked (seed {})", seed())),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{case}: panicked (seed {})", seed()),
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{case}: still running after {limit:?} (seed {})", seed()),
    }
}

/// A refusal must name the file and where in it: a field path (in backticks), a
/// `line:column`, or a byte offset; and it must not call itself an internal error.
/// The binary on a fuzzed input ran (exit 0) or refused it (exit 2, with an error naming
/// `file` where one is given), and never panicked.
fn assert_ran_or_refused(case: &str, o: &std::process::Output, file: Option<&str>) {
    let err = common::stderr(o);
    assert!(
        matches!(o.status.code(), Some(0) | Some(2)),
        "{case}: exit {:?}: {err}",
        o.status.code()
    );
    if let (Some(2), Some(file)) = (o.status.code(), file) {
        assert_located(case, &err, file);
    }
}

fn assert_located(case: &str, msg: &str, file: &str) {
    assert!(msg.contains(file), "{case}: the error does not name {file}: {msg}");
    let located = msg.contains('`')
        || msg.contains("byte")
        || msg.contains("offset")
        || msg.contains("line")
        || msg.contains("is empty")
        || msg.contains(" holds ")
        || msg
            .split(':')
            .any(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()));
    assert!(located, "{case}: the error names no field, line or offset: {msg}");
    assert!(
        !msg.contains("internal error") && !msg.contains("panicked"),
        "{case}: {msg}"
    );
}

const NUMBERS: [&str; 12] = [
    "0",
    "-1",
    "1",
    "2147483648",
    "9007199254740992",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "1e308",
    "-1e308",
    "0.5",
    "-0.0",
];

// ---- JSON mutation ----

#[derive(Clone, Debug)]
enum Seg {
    Key(String),
    Index(usize),
}

fn paths(v: &Value, at: &mut Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
    out.push(at.clone());
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                at.push(Seg::Key(k.clone()));
                paths(x, at, out);
                at.pop();
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                at.push(Seg::Index(i));
                paths(x, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

fn get<'a>(v: &'a Value, path: &[Seg]) -> Option<&'a Value> {
    path.iter().try_fold(v, |cur, s| match s {
        Seg::Key(k) => cur.get(k.as_str()),
        Seg::Index(i) => cur.get(*i),
    })
}

fn get_mut<'a>(v: &'a mut Value, path: &[Seg]) -> &'a mut Value {
    path.iter().fold(v, |cur, s| match s {
        Seg::Key(k) => &mut cur[k.as_str()],
        Seg::Index(i) => &mut cur[*i],
    })
}

fn show(path: &[Seg]) -> String {
    let mut s = String::new();
    for p in path {
        match p {
            Seg::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            Seg::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

/// One structured mutation of `v`; returns what it did. `focus` prefixes are chosen half of
/// the time (the fields a kind's readers trust most).
fn mutate_json(v: &mut Value, rng: &mut Rng, focus: &[&str]) -> String {
    let mut all = Vec::new();
    paths(v, &mut Vec::new(), &mut all);
    let focused: Vec<&Vec<Seg>> = all
        .iter()
        .filter(|p| focus.iter().any(|f| show(p).starts_with(f)))
        .collect();
    let path = if !focused.is_empty() && rng.below(2) == 0 {
        (*rng.pick(&focused)).clone()
    } else {
        rng.pick(&all).clone()
    };
    let name = show(&path);
    match rng.below(9) {
        0 if !path.is_empty() => {
            let (last, parent) = path.split_last().unwrap();
            match (get_mut(v, parent), last) {
                (Value::Object(m), Seg::Key(k)) => {
                    m.remove(k);
                }
                (Value::Array(a), Seg::Index(i)) => {
                    a.remove(*i);
                }
                _ => {}
            }
            format!("delete `{name}`")
        }
        1 | 2 => {
            let n = *rng.pick(&NUMBERS);
            *get_mut(v, &path) = serde_json::from_str(n).unwrap();
            format!("`{name}` = {n}")
        }
        3 => {
            let x = rng
                .pick(&[
                    Value::from("x"),
                    Value::Bool(true),
                    Value::Null,
                    Value::Array(vec![]),
                    serde_json::json!({}),
                ])
                .clone();
            *get_mut(v, &path) = x.clone();
            format!("`{name}` = {x}")
        }
        4 => {
            *get_mut(v, &path) = Value::from("z".repeat(100_000));
            format!("`{name}` = a 100 kB string")
        }
        5..=7 => {
            // A list entry swapped with, or duplicated over, another.
            let lists: Vec<&Vec<Seg>> = all
                .iter()
                .filter(|p| matches!(get(v, p), Some(Value::Array(a)) if a.len() >= 2))
                .collect();
            if lists.is_empty() {
                return "nothing".into();
            }
            let list = (*rng.pick(&lists)).clone();
            let a = get_mut(v, &list).as_array_mut().unwrap();
            let (i, j) = (rng.below(a.len()), rng.below(a.len()));
            if rng.below(2) == 0 {
                a.swap(i, j);
                format!("swap `{}[{i}]` and [{j}]", show(&list))
            } else {
                a[j] = a[i].clone();
                format!("copy `{}[{i}]` over [{j}]", show(&list))
            }
        }
        _ => {
            if let Value::Number(n) = get_mut(v, &path) {
                let x = n.as_f64().unwrap_or(0.0);
                let y = if rng.below(2) == 0 { x + 1.0 } else { x * 2.0 };
                let new = if n.is_f64() {
                    Value::from(y)
                } else {
                    Value::from(y as u64)
                };
                *get_mut(v, &path) = new.clone();
                format!("`{name}` = {new}")
            } else {
                "nothing".into()
            }
        }
    }
}

/// One mutation of a file's text: NaN or Infinity for a number, a truncation, a flipped
/// byte.
fn mutate_text(text: &str, rng: &mut Rng) -> (String, String) {
    let b = text.as_bytes();
    match rng.below(3) {
        0 => {
            let digits: Vec<usize> = (0..b.len())
                .filter(|&i| b[i].is_ascii_digit() && (i == 0 || !b[i - 1].is_ascii_alphanumeric()))
                .collect();
            if digits.is_empty() {
                return (text.to_string(), "nothing".into());
            }
            let i = *rng.pick(&digits);
            let end = (i..b.len())
                .find(|&k| !(b[k].is_ascii_digit() || b[k] == b'.'))
                .unwrap_or(b.len());
            let w = *rng.pick(&["NaN", "Infinity", "-Infinity", ".nan", ".inf"]);
            (format!("{}{w}{}", &text[..i], &text[end..]), format!("{w} at byte {i}"))
        }
        1 => {
            let n = rng.below(b.len());
            (
                String::from_utf8_lossy(&b[..n]).into_owned(),
                format!("truncated to {n} bytes"),
            )
        }
        _ => {
            let mut v = b.to_vec();
            let i = rng.below(v.len());
            v[i] ^= 1 << rng.below(8);
            (
                String::from_utf8_lossy(&v).into_owned(),
                format!("bit flipped at byte {i}"),
            )
        }
    }
}

fn scratch() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

// ---- plan JSON ----

fn plan_text(parallel: &str) -> String {
    let o = common::shardplan_ok(&[
        "plan",
        "--model",
        "tiny-llama",
        "--parallel",
        parallel,
        "--format",
        "json",
    ]);
    common::stdout(&o)
}

#[test]
fn fuzz_plan_json() {
    let text = plan_text("examples/parallel/fsdp-1x4-cpu.yaml");
    let original: Value = serde_json::from_str(&text).unwrap();
    let dir = scratch();
    let file = dir.path().join("fuzzed-plan.json");
    let base = shardplan_planner::rederive::read_plan(&file, &text).unwrap().plan;
    let mut rng = Rng(seed());
    let n = cases(1000);
    let mut spawned = 0;
    let mut accepted_edits = Vec::new();
    let mut spec_edits = 0;
    for k in 0..n {
        let (mutated, what) = if rng.below(6) == 0 {
            mutate_text(&text, &mut rng)
        } else {
            let mut v = original.clone();
            let what = mutate_json(
                &mut v,
                &mut rng,
                &["programs", "groups", "buffers", "source", "events", "ranks", "mesh"],
            );
            (v.to_string(), what)
        };
        let case = format!("plan case {k}: {what}");
        let (f, t, c) = (file.clone(), mutated.clone(), case.clone());
        let r = guarded(&case, Duration::from_secs(60), move || {
            shardplan_planner::rederive::read_plan(&f, &t)
                .map(|p| p.plan)
                .map_err(|e| e.to_string())
        });
        match r {
            Err(msg) => assert_located(&c, &msg, "fuzzed-plan.json"),
            Ok(p) if p == base => {}
            // The recorded specs are the plan's input: an edit there that derives the same
            // plan (a learning rate, the seed) is a different spec, run as written.
            Ok(p) if p.source != base.source => spec_edits += 1,
            Ok(p) => accepted_edits.push((case.clone(), p)),
        }
        // The binary on a sample: the CLI glue around the same checks.
        if k % 20 == 0 {
            spawned += 1;
            std::fs::write(&file, &mutated).unwrap();
            let o = common::shardplan(&["train", "--plan", file.to_str().unwrap(), "--steps", "1"]);
            assert_ran_or_refused(&case, &o, Some("fuzzed-plan.json"));
        }
    }
    // An accepted edit of the schedule trains exactly as the original plan.
    if !accepted_edits.is_empty() {
        let orig = dir.path().join("orig.json");
        std::fs::write(&orig, &text).unwrap();
        let losses = |plan: &Path, log: &Path| {
            common::shardplan_ok(&[
                "train",
                "--plan",
                plan.to_str().unwrap(),
                "--steps",
                "2",
                "--log",
                log.to_str().unwrap(),
            ]);
            common::json_lines(log)
                .iter()
                .map(|l| l["loss"].clone())
                .collect::<Vec<_>>()
        };
        let want = losses(&orig, &dir.path().join("orig.jsonl"));
        for (i, (case, p)) in accepted_edits.iter().take(3).enumerate() {
            let f = dir.path().join(format!("edit{i}.json"));
            std::fs::write(&f, serde_json::to_string(p).unwrap()).unwrap();
            assert_eq!(losses(&f, &dir.path().join(format!("edit{i}.jsonl"))), want, "{case}");
        }
    }
    eprintln!(
        "plan JSON: {n} cases, {spawned} through the binary, {} accepted schedule edits, {spec_edits} edits of the recorded specs",
        accepted_edits.len()
    );
}

// ---- YAML specs and HF config.json ----

/// One mutation of YAML text: a scalar token replaced, a line deleted, duplicated or swapped.
fn mutate_yaml(text: &str, rng: &mut Rng) -> (String, String) {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    match rng.below(5) {
        0 | 1 => {
            // A token after `: `, `[`, `{` or `, `.
            let mut spots = Vec::new();
            for (li, l) in lines.iter().enumerate() {
                let b = l.as_bytes();
                for i in 0..b.len() {
                    let start = i == 0 || matches!(b[i - 1], b' ' | b'[' | b'{');
                    if start && i > 0 && (b[i].is_ascii_alphanumeric() || b[i] == b'-') {
                        let prev = l[..i].trim_end();
                        if prev.ends_with(':') || prev.ends_with('[') || prev.ends_with('{') || prev.ends_with(',') {
                            spots.push((li, i));
                        }
                    }
                }
            }
            if spots.is_empty() {
                return (text.into(), "nothing".into());
            }
            let (li, i) = *rng.pick(&spots);
            let l = &lines[li];
            let end = l[i..].find([',', '}', ']', ' ', '#']).map_or(l.len(), |e| i + e);
            let num = NUMBERS[rng.below(NUMBERS.len())].to_string();
            let w = rng
                .pick(&[
                    num,
                    ".nan".into(),
                    ".inf".into(),
                    "-.inf".into(),
                    "z".repeat(100_000),
                    "[]".into(),
                    "{}".into(),
                    "null".into(),
                    "true".into(),
                    "x".into(),
                ])
                .clone();
            let shown = if w.len() > 20 {
                "a 100 kB word".into()
            } else {
                w.clone()
            };
            let what = format!("line {}: `{}` = {shown}", li + 1, &l[i..end]);
            lines[li] = format!("{}{w}{}", &l[..i], &l[end..]);
            (lines.join("\n"), what)
        }
        2 => {
            let i = rng.below(lines.len());
            let l = lines.remove(i);
            (lines.join("\n"), format!("line {} deleted: {l}", i + 1))
        }
        3 => {
            let i = rng.below(lines.len());
            let l = lines[i].clone();
            lines.insert(i, l.clone());
            (lines.join("\n"), format!("line {} duplicated: {l}", i + 1))
        }
        _ => {
            let (i, j) = (rng.below(lines.len()), rng.below(lines.len()));
            lines.swap(i, j);
            (lines.join("\n"), format!("lines {} and {} swapped", i + 1, j + 1))
        }
    }
}

/// Loads model and parallel spec files as `shardplan plan` does and plans them; returns
/// the error text, or `None` when the plan was made.
fn load_and_plan(model: PathBuf, parallel: PathBuf) -> Option<String> {
    let m = match load_model(&model) {
        Ok(m) => m,
        Err(e) => return Some(e.to_string()),
    };
    let p = match load_parallel(&parallel) {
        Ok(p) => p,
        Err(e) => return Some(e.to_string()),
    };
    let g = match shardplan_models::trace(&m.config, trace_options(Some(&p))) {
        Ok(g) => g,
        Err(e) => return Some(shardplan_frontends::trace_error(e, &m, Some(&p)).to_string()),
    };
    let joint = match shardplan_ir::differentiate(&g) {
        Ok(j) => j,
        Err(e) => return Some(format!("{}: `model`: {e}", model.display())),
    };
    match shardplan_planner::plan(&joint, &p.config) {
        Ok(_) => None,
        Err(e) => Some(p.origin.error(e.field(), e.to_string(), e.help()).to_string()),
    }
}

fn fuzz_spec(kind: &str, originals: &[&str], other: &str, default: usize, json: bool) {
    let dir = scratch();
    let mut rng = Rng(seed() ^ kind.len() as u64);
    let n = cases(default);
    for k in 0..n {
        let orig = *rng.pick(originals);
        let text = std::fs::read_to_string(orig).unwrap();
        let (mutated, what) = if json && rng.below(4) != 0 {
            let mut v: Value = serde_json::from_str(&text).unwrap();
            let what = mutate_json(&mut v, &mut rng, &[]);
            (v.to_string(), what)
        } else if json {
            mutate_text(&text, &mut rng)
        } else {
            mutate_yaml(&text, &mut rng)
        };
        let name = if json {
            "config.json".to_string()
        } else {
            format!("fuzzed-{kind}.yaml")
        };
        let file = dir.path().join(&name);
        std::fs::write(&file, &mutated).unwrap();
        let case = format!("{kind} case {k} of {orig}: {what}");
        let (model, parallel) = if kind.starts_with("parallel") {
            (PathBuf::from(other), file.clone())
        } else {
            (file.clone(), PathBuf::from(other))
        };
        if let Some(msg) = guarded(&case, Duration::from_secs(60), move || load_and_plan(model, parallel)) {
            // A planning error about the (valid) other file may name that one.
            let named = if msg.contains(&name) { name.as_str() } else { other };
            assert_located(&case, &msg, named);
        }
        if k % 25 == 0 {
            let (m, p) = if kind.starts_with("parallel") {
                (other.to_string(), file.display().to_string())
            } else {
                (file.display().to_string(), other.to_string())
            };
            let o = common::shardplan(&["plan", "--model", &m, "--parallel", &p]);
            assert_ran_or_refused(&case, &o, None);
        }
    }
    eprintln!("{kind}: {n} cases");
}

#[test]
fn fuzz_model_yaml() {
    fuzz_spec(
        "model",
        &[
            "examples/models/tiny-llama.yaml",
            "examples/models/tiny-qwen3.yaml",
            "examples/models/tiny-moe.yaml",
            "examples/models/tiny-gpt2.yaml",
            "examples/models/mlp.yaml",
            "examples/models/llama3-8b.yaml",
        ],
        "examples/parallel/cpu-1.yaml",
        1000,
        false,
    );
}

#[test]
fn fuzz_parallel_yaml() {
    fuzz_spec(
        "parallel",
        &[
            "examples/parallel/fsdp-1x4-cpu.yaml",
            "examples/parallel/fsdp-8.yaml",
            "examples/parallel/hsdp-2x8.yaml",
            "examples/parallel/fsdp-64x8.yaml",
            "examples/parallel/fsdp2-8.yaml",
            "examples/parallel/fsdp-8-cudamalloc.yaml",
            "examples/parallel/fsdp-tp-2x2-cpu.yaml",
        ],
        "tiny-llama",
        1000,
        false,
    );
}

/// Tensor parallelism's fields: a mesh whose shard axis is left to `world`, and
/// `tensor_parallel` with `async` (which needs `compile` under `runtime: fsdp2`).
#[test]
fn fuzz_tensor_parallel_yaml() {
    let dir = scratch();
    let seed = dir.path().join("tp-async.yaml");
    std::fs::write(
        &seed,
        "mesh: {tensor: 2}\nworld: 4\ngpus_per_node: 4\nruntime: fsdp2\ncompile: true\n\
         tensor_parallel: {sequence_parallel: true, loss_parallel: true, async: true}\n\
         batch: {per_rank: 2, seq_len: 16}\n",
    )
    .unwrap();
    fuzz_spec("parallel-tp", &[seed.to_str().unwrap()], "tiny-llama", 300, false);
}

/// The low-precision linears' fields: `float8:` (recipe, filter, the float8 all-gather and
/// precomputed scales), `mxfp8:` on a Blackwell profile, and the hardware's float8 peaks.
#[test]
fn fuzz_float8_yaml() {
    let dir = scratch();
    let float8 = dir.path().join("float8.yaml");
    std::fs::write(
        &float8,
        "mesh: {shard: 4}\ngpus_per_node: 4\nhardware: {base: h100-sxm, fp8_tflops: 1979, mxfp8_tflops: 0}\n\
         float8: {recipe: tensorwise, filter_fqns: [lm_head, auto_filter_small_kn], fsdp_float8_all_gather: true, \
         precompute_scale: true}\nbatch: {per_rank: 2, seq_len: 16}\n",
    )
    .unwrap();
    let mxfp8 = dir.path().join("mxfp8.yaml");
    std::fs::write(
        &mxfp8,
        "mesh: {shard: 4}\ngpus_per_node: 4\nhardware: b200\nmxfp8: {recipe: mxfp8_cublas_rceil, filter_fqns: [lm_head]}\n\
         batch: {per_rank: 2, seq_len: 16}\n",
    )
    .unwrap();
    fuzz_spec(
        "parallel-float8",
        &[float8.to_str().unwrap(), mxfp8.to_str().unwrap()],
        "tiny-llama",
        300,
        false,
    );
}

/// Context parallelism's fields (`mesh.context`, `context_parallel:`).
#[test]
fn fuzz_context_yaml() {
    fuzz_spec(
        "parallel-cp",
        &["examples/parallel/context-2x2-cpu.yaml"],
        "tiny-llama",
        300,
        false,
    );
}

/// Pipeline parallelism's fields (`mesh.pipeline`, `pipeline:`).
#[test]
fn fuzz_pipeline_yaml() {
    fuzz_spec(
        "parallel-pp",
        &["examples/parallel/pp-4-1f1b-cpu.yaml"],
        "tiny-llama",
        300,
        false,
    );
}

/// A custom pipeline schedule (`pipeline.csv`), mutated, through `shardplan plan`: a
/// report or an error naming the file, never a panic.
#[test]
fn fuzz_pipeline_csv() {
    let good = "0F0,0F1,,0B0,0B1\r\n,1F0,1F1,1B0,1B1\r\n";
    let dir = scratch();
    let spec = dir.path().join("pp.yaml");
    std::fs::write(
        &spec,
        "mesh: {pipeline: 2, shard: 1}\nbatch: {per_rank: 4, seq_len: 64}\npipeline: {microbatches: 2, csv: s.csv}\n",
    )
    .unwrap();
    let mut rng = Rng(seed() ^ 0x9e37);
    for i in 0..cases(100) {
        let (text, how) = mutate_text(good, &mut rng);
        std::fs::write(dir.path().join("s.csv"), &text).unwrap();
        let o = common::shardplan(&["plan", "--model", "tiny-llama", "--parallel", spec.to_str().unwrap()]);
        let err = common::stderr(&o);
        assert!(
            matches!(o.status.code(), Some(0 | 2)),
            "case {i} ({how}): {text:?}\n{err}"
        );
        if o.status.code() == Some(2) {
            assert!(
                err.contains("s.csv"),
                "case {i} ({how}): the error names no file:\n{err}"
            );
        }
    }
}

/// Expert parallelism's fields (`mesh.expert`, `moe.capacity`, `moe.capacity_factor`) with
/// a mixture of experts.
#[test]
fn fuzz_expert_parallel_yaml() {
    fuzz_spec(
        "parallel-ep",
        &[
            "examples/parallel/ep-1x4-cpu.yaml",
            "examples/parallel/ep-1x4-drop-cpu.yaml",
        ],
        "examples/models/tiny-moe.yaml",
        300,
        false,
    );
}

#[test]
fn fuzz_hf_config() {
    fuzz_spec(
        "config.json",
        &[
            "examples/models/llama3-8b.config.json",
            "examples/models/gpt2.config.json",
            "examples/models/mistral-7b.config.json",
            "examples/models/qwen2-0.5b.config.json",
            "examples/models/qwen3-8b.config.json",
            "examples/models/mixtral-8x7b.config.json",
            "examples/models/qwen2-57b-a14b.config.json",
            "examples/models/qwen3-30b-a3b.config.json",
        ],
        "examples/parallel/cpu-1.yaml",
        1000,
        true,
    );
}

// ---- checkpoints, safetensors, token files ----

fn config(yaml: &str) -> shardplan_frontends::ParallelConfig {
    parse_parallel_spec(&Source::from_text("fuzz.yaml", yaml))
        .unwrap_or_else(|e| panic!("{e}"))
        .0
}

const MESH_1X2: &str = "mesh: {shard: 2}\ngpus_per_node: 2\nbatch: {per_rank: 2, seq_len: 16}\n";

fn params_bits(t: &ShardedTrainer) -> Vec<Vec<u32>> {
    t.full_params()
        .unwrap()
        .iter()
        .map(|x| {
            x.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|f| f.to_bits())
                .collect()
        })
        .collect()
}

/// A checkpoint of one step of tiny-llama on 1x2: (root, step folder).
fn checkpoint(dir: &Path) -> PathBuf {
    let model = shardplan_models::preset("tiny-llama").unwrap();
    let mut t = ShardedTrainer::new(&model, &config(MESH_1X2), 4).unwrap();
    t.step().unwrap();
    t.save(&dir.join("ckpt")).unwrap()
}

/// One byte-level mutation of a safetensors file: truncation, a flipped bit, a header size,
/// or a structured edit of its JSON header.
fn mutate_safetensors(bytes: &[u8], rng: &mut Rng) -> (Vec<u8>, String) {
    let hlen = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    match rng.below(5) {
        0 => {
            let n = rng.below(bytes.len());
            (bytes[..n].to_vec(), format!("truncated to {n} bytes"))
        }
        1 => {
            let mut v = bytes.to_vec();
            // Half the flips in the header, half anywhere.
            let i = if rng.below(2) == 0 {
                rng.below(8 + hlen)
            } else {
                rng.below(v.len())
            };
            v[i] ^= 1 << rng.below(8);
            (v, format!("bit flipped at byte {i}"))
        }
        2 => {
            let mut v = bytes.to_vec();
            let n = *rng.pick(&[0u64, 1, 7, hlen as u64 - 1, hlen as u64 + 1, 1 << 31, 1 << 53, u64::MAX]);
            v[..8].copy_from_slice(&n.to_le_bytes());
            (v, format!("header size = {n}"))
        }
        _ => {
            let mut h: Value = serde_json::from_slice(&bytes[8..8 + hlen]).unwrap();
            let what = mutate_json(&mut h, rng, &[]);
            let hs = h.to_string().into_bytes();
            let mut v = (hs.len() as u64).to_le_bytes().to_vec();
            v.extend_from_slice(&hs);
            v.extend_from_slice(&bytes[8 + hlen..]);
            (v, format!("header: {what}"))
        }
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn fuzz_checkpoints() {
    let dir = scratch();
    let step = checkpoint(dir.path());
    let model = shardplan_models::preset("tiny-llama").unwrap();
    let mut t = ShardedTrainer::new(&model, &config(MESH_1X2), 4).unwrap();
    t.load(&step).unwrap();
    let want = params_bits(&t);
    let files: Vec<String> = std::fs::read_dir(&step)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut rng = Rng(seed() ^ 0xc4e0);
    let n = cases(600);
    let mut t = Some(t);
    for k in 0..n {
        let case_dir = dir.path().join(format!("case{k}"));
        copy_dir(&step, &case_dir);
        let name = rng.pick(&files).clone();
        let path = case_dir.join(&name);
        let bytes = std::fs::read(&path).unwrap();
        let (mutated, what) = if name == "metadata.json" {
            let text = String::from_utf8(bytes).unwrap();
            if rng.below(5) == 0 {
                let (t, w) = mutate_text(&text, &mut rng);
                (t.into_bytes(), w)
            } else {
                let mut v: Value = serde_json::from_str(&text).unwrap();
                let w = mutate_json(&mut v, &mut rng, &["tensors", "files"]);
                (v.to_string().into_bytes(), w)
            }
        } else {
            mutate_safetensors(&bytes, &mut rng)
        };
        std::fs::write(&path, &mutated).unwrap();
        let case = format!("checkpoint case {k}: {name}: {what}");
        let mut trainer = t.take().unwrap();
        let (c, d) = (case.clone(), case_dir.clone());
        let (trainer, r) = guarded(&case, Duration::from_secs(60), move || {
            let r = trainer.load(&d).map(|_| ());
            (trainer, r)
        });
        match r {
            Err(ExecError::Checkpoint(msg)) => {
                let named = files
                    .iter()
                    .find(|f| msg.contains(f.as_str()))
                    .cloned()
                    .unwrap_or_default();
                assert!(!named.is_empty(), "{c}: the error names no checkpoint file: {msg}");
                assert_located(&c, &msg, &named);
            }
            Err(e) => panic!("{c}: not a checkpoint error: {e}"),
            Ok(()) => assert_eq!(params_bits(&trainer), want, "{c}: loaded different weights"),
        }
        t = Some(trainer);
        std::fs::remove_dir_all(&case_dir).unwrap();
    }
    eprintln!("checkpoint metadata and rank files: {n} cases");
}

#[test]
fn fuzz_safetensors_weights() {
    let dir = scratch();
    let step = checkpoint(dir.path());
    let good = dir.path().join("model.safetensors");
    shardplan_executor::checkpoint::export(&step, &good, shardplan_executor::checkpoint::ExportDType::F32).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let model = shardplan_models::preset("tiny-llama").unwrap();
    let mut t = Some(ShardedTrainer::new(&model, &config(MESH_1X2), 4).unwrap());
    let mut rng = Rng(seed() ^ 0x5afe);
    let n = cases(1000);
    for k in 0..n {
        let (mutated, what) = mutate_safetensors(&bytes, &mut rng);
        let file = dir.path().join("fuzzed.safetensors");
        std::fs::write(&file, &mutated).unwrap();
        let case = format!("safetensors case {k}: {what}");
        let trainer = t.take().unwrap();
        let (trainer, r) = guarded(&case, Duration::from_secs(60), move || {
            let mut trainer = trainer;
            let r = trainer.init_from(&file);
            (trainer, r)
        });
        match r {
            // A flipped bit in the data is a different (valid) weight: safetensors has no
            // checksums. Everything else must be refused naming the file.
            Ok(()) => {}
            Err(ExecError::Checkpoint(msg)) => assert_located(&case, &msg, "fuzzed.safetensors"),
            Err(e) => panic!("{case}: not a checkpoint error: {e}"),
        }
        t = Some(trainer);
    }
    eprintln!("safetensors weights: {n} cases");
}

#[test]
fn fuzz_token_files() {
    let dir = scratch();
    let model = shardplan_models::preset("tiny-llama").unwrap();
    let vocab = match &model {
        shardplan_models::ModelConfig::Llama(c) => c.vocab_size,
        _ => unreachable!(),
    };
    let good: Vec<u16> = (0..3000u32).map(|i| ((i * 7 + i / 13) % vocab as u32) as u16).collect();
    let mut rng = Rng(seed() ^ 0x70c);
    let n = cases(150);
    for k in 0..n {
        let mut bytes: Vec<u8> = good.iter().flat_map(|t| t.to_le_bytes()).collect();
        let dtype = if rng.below(4) == 0 { "u32" } else { "u16" };
        let what = match rng.below(4) {
            0 => {
                let n = rng.below(bytes.len());
                bytes.truncate(n);
                format!("truncated to {n} bytes")
            }
            1 => {
                bytes.truncate(bytes.len() - 1 - 2 * rng.below(100));
                format!("odd length {}", bytes.len())
            }
            2 => {
                let i = rng.below(120);
                let v = *rng.pick(&[vocab as u16, vocab as u16 + 1, u16::MAX]);
                bytes[2 * i..2 * i + 2].copy_from_slice(&v.to_le_bytes());
                format!("token {i} = {v}")
            }
            _ => {
                bytes.clear();
                "empty".into()
            }
        };
        let file = dir.path().join("fuzzed-tokens.bin");
        std::fs::write(&file, &bytes).unwrap();
        let case = format!("token file case {k} ({dtype}): {what}");
        let yaml = format!(
            "mesh: {{shard: 1}}\ngpus_per_node: 1\nbatch: {{per_rank: 2, seq_len: 16}}\ndata: {{tokens: {:?}, dtype: {dtype}}}\n",
            file.display().to_string()
        );
        let (c, model) = (case.clone(), model.clone());
        let r = guarded(&case, Duration::from_secs(60), move || {
            let mut t = ShardedTrainer::new(&model, &config(&yaml), 3)?;
            for _ in 0..3 {
                t.step()?;
            }
            Ok::<_, ExecError>(())
        });
        match r {
            Ok(()) => {}
            Err(ExecError::Data(msg)) => assert_located(&c, &msg, "fuzzed-tokens.bin"),
            Err(e) => panic!("{c}: not a data error: {e}"),
        }
    }
    eprintln!("token files: {n} cases");
}

// ---- profiles (`train --profile`, read by `plan --compare`) ----

#[test]
fn fuzz_profiles() {
    use shardplan_executor::train::profile;
    let dir = scratch();
    let spec = dir.path().join("p.yaml");
    std::fs::write(&spec, MESH_1X2).unwrap();
    let good = dir.path().join("good-profile.json");
    common::shardplan_ok(&[
        "train",
        "--model",
        "tiny-llama",
        "--parallel",
        spec.to_str().unwrap(),
        "--steps",
        "2",
        "--profile",
        good.to_str().unwrap(),
    ]);
    let text = std::fs::read_to_string(&good).unwrap();
    let original: Value = serde_json::from_str(&text).unwrap();
    let file = dir.path().join("fuzzed-profile.json");
    let mut rng = Rng(seed() ^ 0x960f);
    let n = cases(1000);
    let (mut accepted, mut spawned) = (0, 0);
    for k in 0..n {
        let (mutated, what) = if rng.below(6) == 0 {
            mutate_text(&text, &mut rng)
        } else {
            let mut v = original.clone();
            let what = mutate_json(&mut v, &mut rng, &["mean", "ranks", "steps", "mesh"]);
            // Pretty, as train writes it, so errors have lines to name.
            (serde_json::to_string_pretty(&v).unwrap(), what)
        };
        let case = format!("profile case {k}: {what}");
        let (f, t, c) = (file.clone(), mutated.clone(), case.clone());
        let r = guarded(&case, Duration::from_secs(60), move || {
            profile::read(&f, &t)
                .map(|p| profile::summary(&p, &f))
                .map_err(|e| e.to_string())
        });
        match r {
            Err(msg) => assert_located(&c, &msg, "fuzzed-profile.json"),
            Ok(_) => accepted += 1,
        }
        // The binary on a sample: `plan --compare` reads it (or, with its format
        // changed, as another metrics file) and prints or refuses.
        if k % 25 == 0 {
            spawned += 1;
            std::fs::write(&file, &mutated).unwrap();
            plan_reads(&case, &spec, "--compare", &file, "fuzzed-profile.json");
        }
    }
    eprintln!("profiles: {n} cases, {accepted} accepted, {spawned} through the binary");
}

/// `shardplan plan --model tiny-llama --parallel SPEC FLAG FILE` on a fuzzed file: it plans
/// (exit 0) or refuses with an error that names the file (exit 2), and never panics.
fn plan_reads(case: &str, spec: &Path, flag: &str, file: &Path, name: &str) {
    let o = common::shardplan(&[
        "plan",
        "--model",
        "tiny-llama",
        "--parallel",
        spec.to_str().unwrap(),
        flag,
        file.to_str().unwrap(),
    ]);
    assert_ran_or_refused(case, &o, Some(name));
}

// ---- allocation traces (an exported program's `--alloc-trace`, read by `plan --alloc-trace`) ----

/// A trace as the exported program writes one: the header, then allocations on three
/// streams and frees, some of addresses reused.
fn sample_alloc_trace(rng: &mut Rng) -> String {
    let mut out = String::from(
        "{\"shardplan_alloc_trace\": 1, \"device\": \"cuda\", \"max_allocated\": 4096, \"max_reserved\": 20971520, \"expandable_segments\": true}\n",
    );
    let mut live: Vec<u64> = Vec::new();
    for _ in 0..200 {
        if !live.is_empty() && rng.below(3) == 0 {
            let a = live.swap_remove(rng.below(live.len()));
            out.push_str(&format!("{{\"free\": {a}}}\n"));
        } else {
            let a = 4096 * (1 + rng.below(64) as u64);
            let bytes = 1u64 << rng.below(26);
            out.push_str(&format!(
                "{{\"alloc\": {a}, \"bytes\": {bytes}, \"stream\": {}}}\n",
                [7u64, 94_000_000_000, 3][rng.below(3)]
            ));
            live.push(a);
        }
    }
    out
}

#[test]
fn fuzz_alloc_traces() {
    use shardplan_frontends::AllocatorConfig;
    use shardplan_planner::allocator::{read_alloc_trace, replay_requests};
    let dir = scratch();
    let spec = dir.path().join("p.yaml");
    std::fs::write(&spec, format!("{MESH_1X2}runtime: fsdp2\n")).unwrap();
    let file = dir.path().join("fuzzed-trace.jsonl");
    let mut rng = Rng(seed() ^ 0xa11c);
    let n = cases(1000);
    let (mut accepted, mut spawned) = (0, 0);
    for k in 0..n {
        let text = sample_alloc_trace(&mut rng);
        let (mutated, what) = if rng.below(3) == 0 {
            mutate_text(&text, &mut rng)
        } else {
            // One line's JSON mutated, the rest as written.
            let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
            let i = rng.below(lines.len());
            let mut v: Value = serde_json::from_str(&lines[i]).unwrap();
            let what = mutate_json(&mut v, &mut rng, &[]);
            lines[i] = serde_json::to_string(&v).unwrap();
            (lines.join("\n"), format!("line {}: {what}", i + 1))
        };
        let case = format!("alloc trace case {k}: {what}");
        let (f, t) = (file.clone(), mutated.clone());
        let r = guarded(&case, Duration::from_secs(60), move || {
            read_alloc_trace(&f, &t).map_err(|e| e.to_string()).map(|trace| {
                for expandable_segments in [false, true] {
                    replay_requests(&trace.requests, AllocatorConfig { expandable_segments });
                }
            })
        });
        match r {
            Err(msg) => assert_located(&case, &msg, "fuzzed-trace.jsonl"),
            Ok(()) => accepted += 1,
        }
        if k % 50 == 0 {
            spawned += 1;
            std::fs::write(&file, &mutated).unwrap();
            plan_reads(&case, &spec, "--alloc-trace", &file, "fuzzed-trace.jsonl");
        }
    }
    eprintln!("alloc traces: {n} cases, {accepted} accepted, {spawned} through the binary");
}

// ---- DCP checkpoints ----

/// Every tensor and value of a DCP checkpoint, read through `shardplan_dcp`.
fn read_dcp(dir: &Path) -> Result<Vec<String>, String> {
    let c = shardplan_dcp::Checkpoint::open(dir).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for (key, entry) in &c.metadata.entries {
        let read = match entry {
            shardplan_dcp::Entry::Tensor(_) => c.tensor(key).map(|t| format!("{key} {:?} {:?}", t.shape, t.bytes)),
            shardplan_dcp::Entry::Bytes => c.value(key).map(|v| format!("{key} {v:?}")),
        };
        out.push(read.map_err(|e| e.to_string())?);
    }
    Ok(out)
}

/// One mutation of a `.metadata` pickle: a flipped bit, a truncation, a length or int
/// made huge, a global renamed, or garbage spliced in.
fn mutate_pickle(bytes: &[u8], rng: &mut Rng) -> (Vec<u8>, String) {
    let mut v = bytes.to_vec();
    match rng.below(5) {
        0 => {
            let i = rng.below(v.len());
            v[i] ^= 1 << rng.below(8);
            (v, format!("bit flipped at byte {i}"))
        }
        1 => {
            let n = rng.below(v.len());
            v.truncate(n);
            (v, format!("truncated to {n} bytes"))
        }
        2 => {
            // The length byte after a SHORT_BINUNICODE or BININT1, or an int's bytes.
            let at: Vec<usize> = (0..v.len() - 1)
                .filter(|&i| matches!(v[i], 0x8c | b'K' | b'M' | b'J'))
                .collect();
            let i = *rng.pick(&at) + 1;
            let b = *rng.pick(&[0u8, 1, 0x7f, 0x80, 0xff]);
            v[i] = b;
            (v, format!("the operand at byte {i} = {b}"))
        }
        3 => {
            let text = String::from_utf8_lossy(bytes).into_owned();
            let from = *rng.pick(&[
                "Size",
                "float32",
                "_StorageInfo",
                "MetadataIndex",
                "__0_0.distcp",
                "offsets",
            ]);
            let to = *rng.pick(&["system", "eval", "Sizf", "../../x", "float3"]);
            match text.find(from) {
                Some(i) if from.len() == to.len() || rng.below(2) == 0 => {
                    let n = from.len().min(to.len());
                    v[i..i + n].copy_from_slice(&to.as_bytes()[..n]);
                    (v, format!("`{from}` at byte {i} overwritten with `{to}`"))
                }
                _ => (v, "unchanged".into()),
            }
        }
        _ => {
            let i = rng.below(v.len());
            let junk: Vec<u8> = (0..1 + rng.below(16)).map(|_| rng.next() as u8).collect();
            v.splice(i..i, junk.iter().copied());
            (v, format!("{} bytes spliced in at byte {i}", junk.len()))
        }
    }
}

/// The torch-made two-rank checkpoint, and one written by shardplan_dcp with zstd items.
fn dcp_originals(scratch: &Path) -> Vec<PathBuf> {
    let torch = Path::new("dcp/tests/fixtures/two-ranks/step-1");
    let zstd = Path::new("dcp/tests/fixtures/zstd/step-1");
    let mut out = Vec::new();
    for (i, d) in [torch, zstd].iter().enumerate() {
        let to = scratch.join(format!("original{i}"));
        copy_dir(d, &to);
        out.push(to);
    }
    out
}

#[test]
fn fuzz_dcp_checkpoints() {
    let dir = scratch();
    let originals = dcp_originals(dir.path());
    let wants: Vec<Vec<String>> = originals.iter().map(|d| read_dcp(d).unwrap()).collect();
    let mut rng = Rng(seed() ^ 0xdc9);
    let n = cases(60);
    for k in 0..n {
        let which = rng.below(originals.len());
        let case_dir = dir.path().join(format!("case{k}"));
        copy_dir(&originals[which], &case_dir);
        let files: Vec<String> = std::fs::read_dir(&case_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        let name = rng.pick(&files).clone();
        let path = case_dir.join(&name);
        let bytes = std::fs::read(&path).unwrap();
        let (mutated, what) = if name == ".metadata" {
            mutate_pickle(&bytes, &mut rng)
        } else if rng.below(3) == 0 {
            let n = rng.below(bytes.len());
            (bytes[..n].to_vec(), format!("truncated to {n} bytes"))
        } else {
            let mut v = bytes.clone();
            let i = rng.below(v.len());
            v[i] ^= 1 << rng.below(8);
            (v, format!("bit flipped at byte {i}"))
        };
        std::fs::write(&path, &mutated).unwrap();
        let case = format!("dcp case {k}: {name}: {what}");
        let d = case_dir.clone();
        match guarded(&case, Duration::from_secs(30), move || read_dcp(&d)) {
            Err(msg) => assert_located(&case, &msg, &case_dir.display().to_string()),
            // A changed `.metadata` may still describe a readable checkpoint; a changed
            // data file is read as it was or refused (every entry's CRC is checked).
            Ok(got) => assert!(
                name == ".metadata" || got == wants[which],
                "{case}: read different data"
            ),
        }
        std::fs::remove_dir_all(&case_dir).unwrap();
    }
    eprintln!("DCP metadata and data files: {n} cases");
}

#[test]
fn dcp_bombs_and_escapes_are_refused() {
    use shardplan_dcp::{write_metadata, Chunk, DType, DataFile, Entry, Metadata, TensorData, TensorEntry};
    let dir = scratch();
    let ckpt = dir.path().join("bomb");
    std::fs::create_dir_all(&ckpt).unwrap();
    // A 2x2 tensor whose item is a zstd frame of 64 MiB of zeros.
    let mut f = DataFile::create(&ckpt, 0, true).unwrap();
    let t = TensorData {
        dtype: DType::F32,
        shape: vec![2, 2],
        bytes: vec![0; 16],
    };
    f.tensor("w", &Chunk::whole(&[2, 2]), &t).unwrap();
    let mut storage: std::collections::HashMap<_, _> = f.finish().unwrap().into_iter().collect();
    let bomb = vec![0u8; 64 << 20];
    let frame = ruzstd_frame(&bomb);
    std::fs::write(ckpt.join("__0_0.distcp"), &frame).unwrap();
    for info in storage.values_mut() {
        info.length = frame.len() as u64;
    }
    let entry = Entry::Tensor(TensorEntry {
        dtype: DType::F32,
        size: vec![2, 2],
        chunks: vec![Chunk::whole(&[2, 2])],
    });
    let md = Metadata {
        entries: vec![("w".into(), entry)],
        storage,
        paths: Default::default(),
    };
    write_metadata(&ckpt, &md).unwrap();
    let e = read_dcp(&ckpt).unwrap_err();
    assert!(e.contains("compression bomb") && e.contains("key `w`"), "{e}");
    // A data file outside the folder.
    let mut md = md;
    for info in md.storage.values_mut() {
        info.file = "../outside.distcp".into();
    }
    let e = write_metadata(&ckpt, &md).unwrap_err().to_string();
    assert!(e.contains("not a file of the checkpoint's folder"), "{e}");
}

/// `bytes` as one zstd frame.
fn ruzstd_frame(bytes: &[u8]) -> Vec<u8> {
    let dir = scratch();
    let mut f = shardplan_dcp::DataFile::create(dir.path(), 9, true).unwrap();
    f.value("x", &shardplan_dcp::pickle::Value::Bytes(bytes.to_vec()))
        .unwrap();
    let info = f.finish().unwrap().remove(0).1;
    let file = std::fs::read(dir.path().join(&info.file)).unwrap();
    file[info.offset as usize..(info.offset + info.length) as usize].to_vec()
}
