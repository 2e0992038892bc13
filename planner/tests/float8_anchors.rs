//! The published Float8 and async-TP runs of `fixtures/anchors.md` (its "Float8 and async
//! tensor parallelism" table: torchtitan with torchao), each planned as it ran
//! (`runtime: fsdp2`, compiled, bf16 parameters, f32 reduction) on the 96 GB H100 at the
//! NVL end of its known bf16 peak (`H100_96GB_500W_TFLOPS`), and held to what was measured:
//! - Llama 3 8B on FSDP 8 (F1-F6, two dates of the same setup): each Float8 row's speed
//!   over its date's bf16 row within 10% of the published ratio (the figure ANCHORS.md says
//!   to hold), and every row's reserved memory within 10%;
//! - Llama 3.1 70B on FSDP 32 x TP 8 (F7-F10): the rows without async TP within 10% on
//!   tokens/s. Async TP's overlap is not costed yet: F8 and F10 are printed, not held, and
//!   the Float8-over-bf16 ratio under TP is an open gap with the bound that holds today.

mod common;

use common::plan_preset;
use shardplan_frontends::H100_96GB_500W_TFLOPS;
use shardplan_planner::Plan;

const ANCHORS: &str = include_str!("fixtures/anchors.md");
const GIB: f64 = (1u64 << 30) as f64;
const TOLERANCE: f64 = 0.10;

/// F9 / F7 (Float8 tensorwise over bf16 under TP 8) predicted against published: Float8's
/// TP-side savings beyond the GEMMs and the sequence-parallel all-gathers in float8 (the
/// reduce-scatters in bf16, torchao's Float8 TP styles) are not all modelled.
const OPEN_TP_RATIO_GAP: f64 = 0.85;

struct Row {
    id: String,
    preset: &'static str,
    mesh: String,
    gpus: u64,
    batch: u64,
    seq: u64,
    ac: &'static str,
    float8: &'static str,
    /// The table's precision and async-TP cells, for the printed rows.
    label: String,
    async_tp: bool,
    tokens: f64,
    reserved_gib: Option<f64>,
}

fn number(s: &str) -> f64 {
    s.trim()
        .replace(',', "")
        .parse()
        .unwrap_or_else(|_| panic!("not a number: {s:?}"))
}

/// The rows of the Float8 table (`| F1 | ... | source |`).
fn rows() -> Vec<Row> {
    ANCHORS
        .lines()
        .filter_map(|line| {
            let c: Vec<&str> = line.split('|').map(str::trim).collect();
            // | id | model | GPUs | hardware | mesh | batch x seq | AC | precision | async TP | tokens/s/GPU | memory | source |
            if c.len() != 14 || !c[1].starts_with('F') || !c[1][1..].chars().all(|d| d.is_ascii_digit()) {
                return None;
            }
            let preset = match c[2] {
                "Llama 3 8B" => "llama3-8b",
                "Llama 3.1 70B" => "llama3-70b",
                m => panic!("row {}: no preset for {m}", c[1]),
            };
            let mesh = match c[5] {
                "FSDP 8" => "{shard: 8}".to_string(),
                "FSDP 32 x TP 8" => "{shard: 32, tensor: 8}".to_string(),
                m => panic!("row {}: mesh {m}", c[1]),
            };
            let (batch, seq) = c[6].split_once(" x ").expect("batch x seq");
            let float8 = match c[8] {
                "bf16" => "",
                "float8 rowwise" => "float8: {recipe: rowwise}\n",
                "float8 tensorwise" => "float8: {recipe: tensorwise}\n",
                "float8 tensorwise + AG" => {
                    "float8: {recipe: tensorwise, fsdp_float8_all_gather: true, precompute_scale: true}\n"
                }
                p => panic!("row {}: precision {p}", c[1]),
            };
            Some(Row {
                id: c[1].to_string(),
                preset,
                mesh,
                gpus: number(c[3].split('(').next().unwrap()) as u64,
                batch: number(batch) as u64,
                seq: number(seq) as u64,
                ac: match c[7] {
                    "op-SAC" => "selective",
                    "full" => "full",
                    a => panic!("row {}: AC {a}", c[1]),
                },
                float8,
                label: format!("{}{}", c[8], if c[9] == "yes" { ", async TP" } else { "" }),
                async_tp: c[9] == "yes",
                tokens: number(c[10]),
                reserved_gib: c[11].strip_suffix(" GiB").map(number),
            })
        })
        .collect()
}

/// The row planned as it ran. The 8B rows (February and March 2025) compiled the blocks
/// only: torchtitan's loss compile was off from December 2024 to April 2025 (see
/// `anchors.rs`, `C_ROWS_COMPILE`); the 70B rows (June 2025) compiled both.
fn plan(r: &Row) -> Plan {
    let compile = if r.preset == "llama3-8b" {
        "compile: {model: true, loss: false}\n"
    } else {
        "compile: true\n"
    };
    let async_tp = if r.async_tp {
        "tensor_parallel: {async: true}\n"
    } else {
        ""
    };
    let spec = format!(
        "mesh: {}\ngpus_per_node: 8\nhardware: {{base: h100-96gb-500w, bf16_tflops: {}}}\nruntime: fsdp2\nwrap: [block]\nmixed_precision: {{param: bf16, reduce: f32}}\nactivation_checkpointing: {}\nbatch: {{per_rank: {}, seq_len: {}}}\n{compile}{async_tp}{}",
        r.mesh, H100_96GB_500W_TFLOPS.0, r.ac, r.batch, r.seq, r.float8
    );
    plan_preset(r.preset, &spec)
}

#[test]
fn every_published_float8_row_is_predicted() {
    let rows = rows();
    let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(
        ids,
        ["F1", "F2", "F3", "F4", "F5", "F6", "F7", "F8", "F9", "F10"],
        "rows read"
    );
    let tps: Vec<f64> = rows
        .iter()
        .map(|r| {
            let p = plan(r);
            let t = p.estimate.tokens_per_s / r.gpus as f64;
            let reserved = p.memory.reserved_peak as f64 / GIB;
            eprintln!(
                "{}: {t:.0} tokens/s/GPU (published {:.1}, {:.3}x), reserved {reserved:.2} GiB{}",
                r.id,
                r.tokens,
                t / r.tokens,
                r.reserved_gib
                    .map(|m| format!(" (published {m}, {:.3}x)", reserved / m))
                    .unwrap_or_default()
            );
            let what = format!("{} {} {}", r.id, r.preset, r.label);
            eprintln!(
                "row: {what} | tokens/s/GPU | {t:.0} | {:.1} | {:.3}",
                r.tokens,
                t / r.tokens
            );
            if let Some(m) = r.reserved_gib {
                eprintln!("row: {what} | reserved GiB | {reserved:.2} | {m} | {:.3}", reserved / m);
                assert!(
                    (reserved / m - 1.0).abs() <= TOLERANCE,
                    "{}: reserved {reserved:.2} GiB against {m}",
                    r.id
                );
            }
            t
        })
        .collect();
    let at = |id: &str| rows.iter().position(|r| r.id == id).unwrap();
    let mut failures = Vec::new();
    // The 8B triples: each Float8 row over its date's bf16 row.
    for (bf16, float8) in [("F1", "F2"), ("F1", "F3"), ("F4", "F5"), ("F4", "F6")] {
        let (b, f) = (at(bf16), at(float8));
        let ours = tps[f] / tps[b];
        let theirs = rows[f].tokens / rows[b].tokens;
        eprintln!(
            "{float8} / {bf16}: predicted {ours:.3}, published {theirs:.3} ({:.3}x)",
            ours / theirs
        );
        if (ours / theirs - 1.0).abs() > TOLERANCE {
            failures.push(format!("{float8} / {bf16}: {:.3}x the published ratio", ours / theirs));
        }
    }
    // The 70B rows without async TP, on their own.
    for id in ["F7", "F9"] {
        let i = at(id);
        let ratio = tps[i] / rows[i].tokens;
        if (ratio - 1.0).abs() > TOLERANCE {
            failures.push(format!("{id}: {ratio:.3}x the published tokens/s"));
        }
    }
    let (f7, f9) = (at("F7"), at("F9"));
    let tp_ratio = (tps[f9] / tps[f7]) / (rows[f9].tokens / rows[f7].tokens);
    eprintln!("F9 / F7: {tp_ratio:.3}x the published ratio (open gap, held above {OPEN_TP_RATIO_GAP})");
    if !(OPEN_TP_RATIO_GAP..=1.0 + TOLERANCE).contains(&tp_ratio) {
        failures.push(format!("F9 / F7: {tp_ratio:.3}x the published ratio"));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
