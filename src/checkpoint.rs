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
    /// Convert a checkpoint (shardplan's or DCP's) into shardplan's format, DCP
    /// (torchtitan's layout), or Hugging Face safetensors shards with
    /// model.safetensors.index.json (parameters only).
    Convert {
        /// A checkpoint folder (`step-N`), or the folder holding them (the newest is used).
        src: PathBuf,
        /// The format to write.
        #[arg(long, value_enum)]
        to: Target,
        /// The folder to write (a new or empty one): a step folder, or the Hugging Face files.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Element type of Hugging Face files (checkpoints keep f32).
        #[arg(long, value_enum, default_value_t = Dtype::F32)]
        dtype: Dtype,
    },
}

/// What `checkpoint convert` writes.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Target {
    /// shardplan's own format (`metadata.json` and a safetensors rank file).
    Shardplan,
    /// torch.distributed.checkpoint (`.metadata` and `__0_0.distcp`).
    Dcp,
    /// Hugging Face safetensors shards and model.safetensors.index.json.
    Hf,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

pub fn run(cmd: &CheckpointCommand) -> Result<(), CliError> {
    match cmd {
        CheckpointCommand::Convert { src, to, out, dtype } => convert(src, *to, out, *dtype),
        CheckpointCommand::Export { dir, out, dtype } => {
            let (step, warnings) = shardplan_executor::checkpoint::resolve(dir).map_err(usage)?;
            for w in warnings {
                eprintln!("warning: {w}");
            }
            let n = shardplan_executor::checkpoint::export(&step, out, export_dtype(*dtype)).map_err(usage)?;
            crate::emit(&format!(
                "wrote {n} tensors from {} to {}\n",
                step.display(),
                out.display()
            ))
        }
    }
}

fn export_dtype(d: Dtype) -> ExportDType {
    match d {
        Dtype::F32 => ExportDType::F32,
        Dtype::Bf16 => ExportDType::Bf16,
        Dtype::F16 => ExportDType::F16,
    }
}

/// `checkpoint convert`, with a progress bar over the tensors.
fn convert(src: &std::path::Path, to: Target, out: &std::path::Path, dtype: Dtype) -> Result<(), CliError> {
    use shardplan_executor::checkpoint::Format;
    let format = match to {
        Target::Shardplan => Format::Shardplan,
        Target::Dcp => Format::Dcp,
        Target::Hf => Format::HuggingFace,
    };
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} tensors")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(format!("converting {}", src.display()));
    let mut progress = |done: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    let n =
        shardplan_executor::checkpoint::convert(src, format, out, export_dtype(dtype), &mut progress).map_err(usage)?;
    bar.finish_and_clear();
    crate::emit(&format!(
        "wrote {n} tensors from {} to {} ({to:?})\n",
        src.display(),
        out.display()
    ))
}

fn usage(e: ExecError) -> CliError {
    match e {
        ExecError::Checkpoint(m) => CliError::Usage(m),
        other => CliError::Other(anyhow::Error::new(other)),
    }
}
