//! `shardplan checkpoint`: what can be done with a checkpoint besides resuming it.

use crate::CliError;
use clap::Subcommand;
use shardplan_executor::checkpoint::ExportDType;
use shardplan_executor::ExecError;
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
pub enum CheckpointCommand {
    /// Write a checkpoint's parameters as one safetensors file with Hugging Face names.
    Export {
        /// A checkpoint folder (`step-N`), or the folder holding them (the newest is used).
        dir: PathBuf,
        /// The safetensors file to write.
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
        /// Element type of the file (HF models are usually published in bf16).
        #[arg(long, value_enum, default_value_t = Dtype::F32)]
        dtype: Dtype,
    },
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

pub fn run(cmd: &CheckpointCommand) -> Result<(), CliError> {
    match cmd {
        CheckpointCommand::Export { dir, out, dtype } => {
            let (step, warnings) = shardplan_executor::checkpoint::resolve(dir).map_err(usage)?;
            for w in warnings {
                eprintln!("warning: {w}");
            }
            let dtype = match dtype {
                Dtype::F32 => ExportDType::F32,
                Dtype::Bf16 => ExportDType::Bf16,
                Dtype::F16 => ExportDType::F16,
            };
            let n = shardplan_executor::checkpoint::export(&step, out, dtype).map_err(usage)?;
            crate::emit(&format!(
                "wrote {n} tensors from {} to {}\n",
                step.display(),
                out.display()
            ))
        }
    }
}

fn usage(e: ExecError) -> CliError {
    match e {
        ExecError::Checkpoint(m) => CliError::Usage(m),
        other => CliError::Other(anyhow::Error::new(other)),
    }
}
