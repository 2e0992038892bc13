//! The `shardplan` command.

mod alloc_trace;
mod auto;
mod calibrate;
mod checkpoint;
mod compare;
mod data;
mod export;
mod fmt;
mod generate;
mod inspect;
mod launch;
mod plan;
mod selftest;
mod train;

use clap::{Parser, Subcommand};
use shardplan_frontends::SpecError;
use std::process::ExitCode;

/// Compile-ahead FSDP planner: trace a model, plan its sharded training, run the plan.
#[derive(Parser, Debug)]
#[command(name = "shardplan", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Trace a model and show what shardplan sees: parameters, FLOPs, per-layer table, graph.
    Inspect(inspect::InspectArgs),
    /// Plan sharded training: groups, shard layout, per-stream schedule, memory, step time; verified.
    Plan(plan::PlanArgs),
    /// Start local ranks as torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and run a command in each.
    Launch(launch::LaunchArgs),
    /// Prepare training data: tokenize text into the token files `train` reads.
    #[command(subcommand)]
    Data(data::DataCommand),
    /// Export a plan to run elsewhere: `export fsdp2` writes it as a PyTorch FSDP2 program.
    #[command(subcommand)]
    Export(export::ExportCommand),
    /// Work with checkpoints: export one as a Hugging Face safetensors file.
    #[command(subcommand)]
    Checkpoint(checkpoint::CheckpointCommand),
    /// Measure this machine's CPU with the executor's own kernels: a hardware profile for planning `train`'s CPU runs.
    Calibrate(calibrate::CalibrateArgs),
    /// Train on any mesh: every rank as a thread of this process, or one rank per process under mpirun / srun (MPI); progress bar, JSON-lines metrics, measured trace, Ctrl-C stops after the current step.
    Train(train::TrainArgs),
    /// Check shardplan's CUDA kernels against their CPU twins on random inputs and edge shapes: worst error against tolerance and time per kernel (exit 1 on a miss, 2 without a GPU).
    GpuSelftest(selftest::SelftestArgs),
    /// Continue a prompt with a trained model (a checkpoint or Hugging Face safetensors) on one CPU rank, with a KV cache: greedy or top-p sampling.
    Generate(generate::GenerateArgs),
}

/// A failure of a command: bad user input (exit 2) or anything else (exit 1).
#[derive(Debug)]
pub enum CliError {
    Input(SpecError),
    /// Bad input whose message names its file itself (exit 2).
    Usage(String),
    Other(anyhow::Error),
}

impl From<SpecError> for CliError {
    fn from(e: SpecError) -> Self {
        CliError::Input(e)
    }
}

impl From<anyhow::Error> for CliError {
    fn from(e: anyhow::Error) -> Self {
        CliError::Other(e)
    }
}

/// Writes a command's output to stdout. A reader that went away (`| head`) is not an
/// error, as for other Unix tools.
pub fn emit(text: &str) -> Result<(), CliError> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(CliError::Other(anyhow::Error::new(e).context("writing to stdout")))
        }
        _ => Ok(()),
    }
}

/// A panic is a bug in shardplan, whatever the input: print one line that says so and asks
/// for a report, not a backtrace (unless `RUST_BACKTRACE` asks for one). The process exits
/// with 101, Rust's code for a panic, when the main thread panics; a panic on a rank or
/// stream thread stops the run with an error (exit 1) after the same line.
fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        let at = info
            .location()
            .map_or_else(|| "an unknown place".into(), |l| format!("{}:{}", l.file(), l.line()));
        eprintln!(
            "error: shardplan {} hit an internal error (a bug): {payload} at {at}; please report it on the project's issue tracker with this line and the command you ran (RUST_BACKTRACE=1 adds a backtrace)",
            env!("CARGO_PKG_VERSION")
        );
        if std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
            default(info);
        }
    }));
}

fn main() -> ExitCode {
    install_panic_hook();
    // For the test of the hook only: a panic no input can cause (debug builds).
    if cfg!(debug_assertions) && std::env::var_os("SHARDPLAN_TEST_PANIC").is_some() {
        panic!("SHARDPLAN_TEST_PANIC is set");
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(args) => inspect::run(&args).map(|()| None),
        // `plan --auto` searches; `auto` builds on `plan`'s helpers, so the choice is made here.
        Command::Plan(args) if args.auto => auto::run_args(&args).map(|()| None),
        Command::Plan(args) => plan::run(&args).map(|()| None),
        Command::Train(args) => train::run(&args),
        Command::Checkpoint(cmd) => checkpoint::run(&cmd).map(|()| None),
        Command::Export(cmd) => export::run(&cmd).map(|()| None),
        Command::Launch(args) => launch::run(&args),
        Command::Data(cmd) => data::run(&cmd).map(|()| None),
        Command::Calibrate(args) => calibrate::run(&args).map(|()| None),
        Command::Generate(args) => generate::run(&args).map(|()| None),
        Command::GpuSelftest(args) => selftest::run(&args),
    };
    match result {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(code)) => ExitCode::from(code),
        Err(e) => ExitCode::from(report(&e)),
    }
}

/// Prints `e` and returns its exit code: 2 for bad input or usage, 1 for anything else.
pub fn report(e: &CliError) -> u8 {
    match e {
        CliError::Input(e) => {
            eprintln!("error: {e}");
            2
        }
        CliError::Usage(e) => {
            eprintln!("error: {e}");
            2
        }
        CliError::Other(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}
