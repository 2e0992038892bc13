//! The `shardplan` command.

mod auto;
mod checkpoint;
mod compare;
mod data;
mod fmt;
mod generate;
mod inspect;
mod launch;
mod plan;
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
    /// Work with checkpoints: export one as a Hugging Face safetensors file.
    #[command(subcommand)]
    Checkpoint(checkpoint::CheckpointCommand),
    /// Train on any mesh: every rank as a thread of this process, or one rank per process under mpirun / srun (MPI); progress bar, JSON-lines metrics, measured trace, Ctrl-C stops after the current step.
    Train(train::TrainArgs),
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect(args) => inspect::run(&args).map(|()| None),
        Command::Plan(args) => plan::run(&args).map(|()| None),
        Command::Train(args) => train::run(&args),
        Command::Checkpoint(cmd) => checkpoint::run(&cmd).map(|()| None),
        Command::Launch(args) => launch::run(&args),
        Command::Data(cmd) => data::run(&cmd).map(|()| None),
        Command::Generate(args) => generate::run(&args).map(|()| None),
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
