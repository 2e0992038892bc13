//! The commands the docs show run as shown.
//!
//! Every line of a ```` ```sh ```` block in `README.md` and `docs/src/*.md` that starts with
//! `shardplan ` or `cargo run -- ` (a line ending in `\` joined with the next) is run with
//! the built binary and must exit 0; a failure names the page and line. A block with a
//! comment line `# not run: <reason>`, or a command line carrying that comment, is left
//! out: GPUs, MPI, NCCL, torch, long runs, the network.
//!
//! The commands of one page run in order (a later one may read what an earlier one
//! wrote, as a reader would run them) through `sh`, from a fresh temporary folder that
//! stands for the repository root: every top-level entry of the repository (but `target`
//! and `.git`) is linked into it, so the commands read the repository's files as written
//! and whatever they write stays in the temporary folder. Pages run side by side.

#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Longest a single command may run before it counts as failed (the docs mark longer
/// runs `# not run: long`).
const COMMAND_LIMIT: Duration = Duration::from_secs(45);

/// What marks a block or a command as left out, followed by the reason.
const NOT_RUN: &str = "# not run:";

/// One command of a page.
#[derive(Debug)]
struct DocCommand {
    /// The page, relative to the repository root.
    page: String,
    /// Its first line on the page, from 1.
    line: usize,
    /// The command as written, continuation lines joined.
    text: String,
}

/// What a page holds: the commands to run and the ones marked not run (page, line, reason).
#[derive(Debug, Default)]
struct PageCommands {
    run: Vec<DocCommand>,
    not_run: Vec<(String, usize, String)>,
}

/// The commands of one Markdown page.
fn commands_of(page: &str, text: &str) -> PageCommands {
    let mut out = PageCommands::default();
    let lines: Vec<&str> = text.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let fence = lines[i].trim_start();
        if !fence.starts_with("```") {
            i += 1;
            continue;
        }
        let info = fence.trim_start_matches('`').trim();
        // The block's lines, with their numbers (from 1), up to the closing fence.
        let mut block = Vec::new();
        let mut j = i + 1;
        while j < lines.len() && !lines[j].trim_start().starts_with("```") {
            block.push((j + 1, lines[j]));
            j += 1;
        }
        i = j + 1;
        if !matches!(info, "sh" | "bash") {
            continue;
        }
        let block_reason = block
            .iter()
            .find_map(|(_, l)| l.trim_start().strip_prefix(NOT_RUN).map(|r| r.trim().to_string()));
        let mut k = 0;
        while k < block.len() {
            let (line, first) = block[k];
            let mut text = first.trim().to_string();
            while text.ends_with('\\') && k + 1 < block.len() {
                text.pop();
                k += 1;
                text = format!("{} {}", text.trim_end(), block[k].1.trim());
            }
            k += 1;
            if !(text.starts_with("shardplan ") || text.starts_with("cargo run -- ")) {
                continue;
            }
            let reason = block_reason.clone().or_else(|| {
                text.find(NOT_RUN)
                    .map(|at| text[at + NOT_RUN.len()..].trim().to_string())
            });
            match reason {
                Some(r) => out.not_run.push((page.to_string(), line, r)),
                None => out.run.push(DocCommand {
                    page: page.to_string(),
                    line,
                    text,
                }),
            }
        }
    }
    out
}

/// The repository root.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every page of the book, relative to the root, in name order.
fn pages() -> Vec<String> {
    let mut pages: Vec<String> = std::fs::read_dir(root().join("docs/src"))
        .expect("docs/src")
        .map(|e| e.expect("docs/src entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| format!("docs/src/{}", p.file_name().unwrap().to_string_lossy()))
        .collect();
    pages.sort();
    pages.insert(0, "README.md".to_string());
    pages
}

/// A temporary folder standing for the repository root: its top-level entries linked in.
fn workdir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("docs-commands")
        .tempdir()
        .expect("temp dir");
    for entry in std::fs::read_dir(root()).expect("repository root") {
        let entry = entry.expect("root entry");
        let name = entry.file_name();
        if name == "target" || name == ".git" {
            continue;
        }
        std::os::unix::fs::symlink(entry.path(), dir.path().join(&name)).expect("link a root entry");
    }
    dir
}

/// Quotes `s` for `sh`.
fn quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// `cmd` as `sh` runs it: the binary in place of `shardplan` or `cargo run --`.
fn shell_line(cmd: &str, bin: &Path) -> String {
    let rest = cmd
        .strip_prefix("cargo run -- ")
        .or_else(|| cmd.strip_prefix("shardplan "))
        .expect("a shardplan command");
    format!("exec {} {rest}", quoted(&bin.to_string_lossy()))
}

/// Runs one command in `dir`; on failure, what went wrong.
fn run(cmd: &DocCommand, dir: &Path, n: usize) -> Result<Duration, String> {
    let bin = Path::new(env!("CARGO_BIN_EXE_shardplan"));
    let out_path = dir.join(format!(".docs-command-{n}.out"));
    let out = std::fs::File::create(&out_path).expect("output file");
    let err = out.try_clone().expect("output file");
    let start = Instant::now();
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(shell_line(&cmd.text, bin))
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("cannot start sh: {e}"))?;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for a command") {
            break Some(status);
        }
        if start.elapsed() > COMMAND_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let elapsed = start.elapsed();
    let output = std::fs::read_to_string(&out_path).unwrap_or_default();
    let tail: Vec<&str> = output.lines().rev().take(15).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    match status {
        Some(s) if s.success() => Ok(elapsed),
        Some(s) => Err(format!("exited with {s}; its output ends:\n{}", tail.join("\n"))),
        None => Err(format!(
            "still running after {} s (mark a long run `# not run: long`); its output ends:\n{}",
            COMMAND_LIMIT.as_secs(),
            tail.join("\n")
        )),
    }
}

#[test]
fn every_command_in_the_docs_runs() {
    let mut by_page = Vec::new();
    let mut not_run = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(root().join(&page)).unwrap_or_else(|e| panic!("{page}: {e}"));
        let found = commands_of(&page, &text);
        not_run.extend(found.not_run);
        if !found.run.is_empty() {
            by_page.push(found.run);
        }
    }
    for (page, line, reason) in &not_run {
        assert!(!reason.is_empty(), "{page}:{line}: `{NOT_RUN}` needs a reason after it");
    }
    let count: usize = by_page.iter().map(Vec::len).sum();
    // The README's first command is the project's main one: the parser must find it.
    assert!(
        by_page.iter().flatten().any(|c| c.page == "README.md"
            && c.text
                == "cargo run -- plan --model examples/models/llama3-8b.yaml --parallel examples/parallel/fsdp-8.yaml"),
        "the README's first command was not found"
    );
    assert!(count >= 20, "only {count} commands found in the docs");

    // Pages side by side, a page's commands in order, on as many threads as there are cores.
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(1, 4);
    let queue = std::sync::Mutex::new(by_page.into_iter().collect::<Vec<_>>());
    let failures = std::sync::Mutex::new(Vec::new());
    let ran = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let Some(commands) = queue.lock().unwrap().pop() else {
                    break;
                };
                let dir = workdir();
                for (n, cmd) in commands.iter().enumerate() {
                    match run(cmd, dir.path(), n) {
                        Ok(t) => ran.lock().unwrap().push((t, format!("{}:{}", cmd.page, cmd.line))),
                        Err(why) => failures
                            .lock()
                            .unwrap()
                            .push(format!("{}:{}: `{}` {why}", cmd.page, cmd.line, cmd.text)),
                    }
                }
            });
        }
    });
    let mut ran = ran.into_inner().unwrap();
    ran.sort_by_key(|r| std::cmp::Reverse(r.0));
    let slowest: Vec<String> = ran
        .iter()
        .take(5)
        .map(|(t, at)| format!("{at} {:.1} s", t.as_secs_f64()))
        .collect();
    println!(
        "{} commands ran, {} marked not run; slowest: {}",
        ran.len(),
        not_run.len(),
        slowest.join(", ")
    );
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} of the docs' commands failed:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn commands_are_found_joined_and_left_out_as_marked() {
    let page = "```sh\n\
                shardplan plan --model a \\\n    --parallel b\n\
                cargo run -- inspect --model c   # a comment\n\
                cargo test --workspace\n\
                shardplan train --model d # not run: long\n\
                ```\n\
                \n\
                ```\n\
                shardplan plan --model in-a-plain-block\n\
                ```\n\
                ```sh\n\
                # not run: needs a GPU\n\
                shardplan train --device cuda\n\
                ```\n";
    let found = commands_of("p.md", page);
    let run: Vec<(usize, &str)> = found.run.iter().map(|c| (c.line, c.text.as_str())).collect();
    assert_eq!(
        run,
        [
            (2, "shardplan plan --model a --parallel b"),
            (4, "cargo run -- inspect --model c   # a comment"),
        ]
    );
    let not_run: Vec<(usize, &str)> = found.not_run.iter().map(|(_, l, r)| (*l, r.as_str())).collect();
    assert_eq!(not_run, [(6, "long"), (14, "needs a GPU")]);
    assert_eq!(
        shell_line("cargo run -- plan --model x", Path::new("/b/it's")),
        r"exec '/b/it'\''s' plan --model x"
    );
}
