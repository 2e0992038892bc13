//! `shardplan launch`: start local ranks the way torchrun does (one process per rank, with
//! RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set), wait for them, and stop
//! the others as soon as one fails.

use crate::CliError;
use anyhow::Context;
use clap::Args;
use std::process::{Child, Command};
use std::time::Duration;

#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Processes (ranks) to start on this node.
    #[arg(long, value_name = "N")]
    pub nproc_per_node: u64,
    /// Nodes in the job (this launcher starts this node's ranks only).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub nnodes: u64,
    /// This node's index among the nodes.
    #[arg(long, value_name = "I", default_value_t = 0)]
    pub node_rank: u64,
    /// Address of the node running rank 0.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port rank 0 listens on for the rendezvous.
    #[arg(long, value_name = "PORT", default_value_t = 29500)]
    pub master_port: u16,
    /// The shardplan command each rank runs (after `--`).
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

fn usage(msg: String) -> CliError {
    CliError::Usage(msg)
}

pub fn run(args: &LaunchArgs) -> Result<Option<u8>, CliError> {
    if args.nproc_per_node == 0 || args.nnodes == 0 {
        return Err(usage("--nproc-per-node and --nnodes must be at least 1".into()));
    }
    if args.node_rank >= args.nnodes {
        return Err(usage(format!(
            "--node-rank {} is not below --nnodes {}",
            args.node_rank, args.nnodes
        )));
    }
    let exe = std::env::current_exe().context("locating the shardplan executable")?;
    let world = args.nproc_per_node * args.nnodes;
    let mut children: Vec<(u64, Child)> = Vec::new();
    for local in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local;
        let child = Command::new(&exe)
            .args(&args.command)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", args.master_port.to_string())
            .spawn()
            .with_context(|| format!("starting rank {rank}"))?;
        children.push((rank, child));
    }
    // Wait; the first failure stops the rest (a rank that died leaves the others blocked).
    let mut failed: Option<(u64, i32)> = None;
    loop {
        let mut running = 0;
        for (rank, child) in &mut children {
            match child.try_wait().context("waiting for a rank")? {
                Some(status) if !status.success() && failed.is_none() => {
                    failed = Some((*rank, status.code().unwrap_or(1)));
                }
                Some(_) => {}
                None => running += 1,
            }
        }
        if failed.is_some() {
            for (_, child) in &mut children {
                let _ = child.kill();
                let _ = child.wait();
            }
            break;
        }
        if running == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    match failed {
        Some((rank, code)) => {
            eprintln!("error: rank {rank} exited with code {code}; stopped the other ranks");
            Ok(Some(u8::try_from(code).unwrap_or(1).max(1)))
        }
        None => Ok(None),
    }
}
