//! `shardplan gpu-selftest`: every one of shardplan's CUDA kernels against its CPU twin
//! (`shardplan_executor::selftest`), each case's worst error against its tolerance and
//! its time. Exit 0 when all are within tolerance, 1 on a miss, 2 where there is no GPU.

use crate::CliError;
use shardplan_executor::selftest::{self, Native, Twin};
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct SelftestArgs {
    /// The CUDA device to test: `cuda` or `cuda:N`.
    #[arg(long, value_name = "DEVICE", default_value = "cuda")]
    pub device: String,
    /// Only the kernels whose name contains this (e.g. `attention`, `rms_norm`, `adamw`).
    #[arg(long, value_name = "NAME")]
    pub only: Option<String>,
    /// Timed calls per case, after one untimed warm-up call.
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub reps: usize,
    /// Small shapes only (seconds): the cases the CPU test suite checks the twins with.
    #[arg(long)]
    pub quick: bool,
    /// Also write the report as JSON to this file.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
}

pub fn run(args: &SelftestArgs) -> Result<Option<u8>, CliError> {
    let device = match shardplan_executor::runtime::device::open(&args.device) {
        Ok(d) if d.is_cuda() => d,
        Ok(_) => {
            return Err(CliError::Usage(format!(
                "--device `{}`: the GPU self-test runs on a CUDA device (`cuda` or `cuda:N`)",
                args.device
            )))
        }
        Err(e) => {
            eprintln!("gpu-selftest: no GPU to test: {e}");
            return Ok(Some(2));
        }
    };
    let _ = shardplan_executor::runtime::device::bind_thread(&device);
    match shardplan_executor::gpu::cudnn_version() {
        Ok(v) => eprintln!("cuDNN {v} (flash attention)"),
        Err(e) => eprintln!("{e}: the attention cases will fail"),
    }
    let dut = Native::new(device).map_err(|e| CliError::Other(e.into()))?;
    let twin = Twin::default();
    let cases = selftest::cases(!args.quick);
    let mut out = std::io::stdout();
    let report = selftest::run(&cases, &dut, &twin, args.reps, args.only.as_deref(), |r| {
        let verdict = match &r.error {
            Some(e) => format!("ERROR {e}"),
            None if r.pass => "ok".into(),
            None => "MISS".into(),
        };
        let ms = r.ms.map_or("-".into(), |m| format!("{m:.4} ms"));
        let _ = writeln!(
            out,
            "{:<18} {:<34} {:<4} {:<5} worst {:.3e} (tol {:.0e})  {ms}  {verdict}",
            r.kernel, r.case, r.output, r.dtype, r.worst, r.tolerance
        );
        let _ = out.flush();
    });
    if report.results.is_empty() {
        return Err(CliError::Usage(format!(
            "--only `{}` names no kernel of the self-test",
            args.only.as_deref().unwrap_or_default()
        )));
    }
    let missed = report.results.iter().filter(|r| !r.pass).count();
    println!(
        "{} outputs checked against the CPU twins: {} within tolerance, {missed} missed",
        report.results.len(),
        report.results.len() - missed
    );
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| CliError::Other(e.into()))?;
        std::fs::write(path, text)
            .map_err(|e| CliError::Usage(format!("--json {}: cannot write it: {e}", path.display())))?;
    }
    Ok(Some(u8::from(!report.passed())))
}
