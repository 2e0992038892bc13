//! The cost model: how long each instruction takes on a hardware profile.
//!
//! - Compute: per joint-graph node, a roofline — the longer of FLOPs at
//!   `peak x compute_efficiency` (bf16 peak for bf16/f16 compute, f32 peak otherwise) and
//!   bytes at `hbm_gbps`.
//! - Collectives: a ring, alpha-beta. With `n` ranks and `B` bytes in the full buffer, an
//!   all-gather or reduce-scatter takes `(n-1) (alpha + B/n / bw)`, an all-reduce twice that.
//!   A group that fits in one node uses the intra-node bandwidth and latency; one that spans
//!   nodes is bound by the inter-node ones (every ring crosses the network).
//! - Host copies move bytes at `host_link_gbps`; device-to-device copies read and write at
//!   `hbm_gbps`; the gradient norm and the optimizer step stream their operands at
//!   `hbm_gbps`, or at `host_mem_gbps` when they run on the host (CPU offload).
//!
//! Every constant is a field of [`HardwareProfile`]; nothing is hidden here.

use crate::mesh::Mesh;
use crate::plan::{Buffer, Comm, Instr, Pool, Stream};
use crate::steps::Step;
use shardplan_frontends::HardwareProfile;
use shardplan_ir::{DType, Graph, NodeId};

/// Seconds to run each step (segment) once.
pub fn step_seconds(g: &Graph, steps: &[Step], hw: &HardwareProfile, compute_dtype: DType) -> Vec<f64> {
    let peak = if compute_dtype == DType::F32 || compute_dtype == DType::F64 {
        hw.f32_tflops
    } else {
        hw.bf16_tflops
    } * 1e12
        * hw.compute_efficiency;
    let bw = hw.hbm_gbps * 1e9;
    steps
        .iter()
        .map(|s| {
            s.nodes
                .iter()
                .flat_map(|r| r.clone())
                .map(|i| {
                    let c = g.node_cost(NodeId(i));
                    (c.fwd_flops as f64 / peak).max(c.fwd_bytes as f64 / bw)
                })
                .sum()
        })
        .collect()
}

/// True when every instance of `comm` (one per rank) lies within one node.
pub fn intra_node(mesh: &Mesh, comm: Comm) -> bool {
    let g = mesh.gpus_per_node();
    let node = |r: u64| r / g;
    match comm {
        Comm::Shard | Comm::Reshard(_) => {
            let size = match comm {
                Comm::Reshard(n) => n,
                _ => mesh.shard(),
            };
            // Groups start at multiples of `size`; their placement repeats every `g` groups.
            let groups = mesh.world() / size.max(1);
            (0..groups.min(g)).all(|i| node(i * size) == node(i * size + size - 1))
        }
        Comm::Replicate => {
            let last = (mesh.replicate() - 1) * mesh.shard();
            (0..mesh.shard().min(g)).all(|s| node(s) == node(s + last))
        }
    }
}

/// Bandwidth (bytes/s) and per-hop latency (s) of `comm`'s ring.
pub fn link(mesh: &Mesh, comm: Comm, hw: &HardwareProfile) -> (f64, f64) {
    if intra_node(mesh, comm) {
        (hw.intra_node_gbps * 1e9, hw.intra_node_latency_us * 1e-6)
    } else {
        (hw.inter_node_gbps * 1e9, hw.inter_node_latency_us * 1e-6)
    }
}

/// Seconds of a ring collective moving `bytes` (the full buffer) over `n` ranks.
pub fn ring_seconds(n: u64, bytes: u64, (bw, alpha): (f64, f64), all_reduce: bool) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let t = (n - 1) as f64 * (alpha + bytes as f64 / n as f64 / bw);
    if all_reduce {
        2.0 * t
    } else {
        t
    }
}

/// Seconds of one instruction. `step_s` comes from [`step_seconds`].
pub fn instr_seconds(
    instr: &Instr,
    stream: Stream,
    buffers: &[Buffer],
    step_s: &[f64],
    mesh: &Mesh,
    hw: &HardwareProfile,
    state_per_param: u64,
) -> f64 {
    let bytes = |b: crate::plan::BufId| buffers[b.index()].bytes();
    let mem_bw = if stream == Stream::Host {
        hw.host_mem_gbps * 1e9
    } else {
        hw.hbm_gbps * 1e9
    };
    match instr {
        Instr::Compute { step, .. } => step_s[step.index()],
        Instr::Alloc { .. } | Instr::Free { .. } | Instr::Record { .. } | Instr::Wait { .. } => 0.0,
        Instr::AllGather { comm, dst, .. } => ring_seconds(comm.size(mesh), bytes(*dst), link(mesh, *comm, hw), false),
        Instr::ReduceScatter { comm, staging, .. } => {
            ring_seconds(comm.size(mesh), bytes(*staging), link(mesh, *comm, hw), false)
        }
        Instr::AllReduce { comm, buf, .. } => ring_seconds(comm.size(mesh), bytes(*buf), link(mesh, *comm, hw), true),
        Instr::Copy { src, dst, .. } => {
            let (s, d) = (&buffers[src.index()], &buffers[dst.index()]);
            if s.pool != d.pool {
                s.bytes().min(d.bytes()) as f64 / (hw.host_link_gbps * 1e9)
            } else {
                (s.bytes().min(d.bytes()) * 2) as f64 / (hw.hbm_gbps * 1e9)
            }
        }
        Instr::GradNorm { grads, .. } => grads.iter().map(|&b| bytes(b)).sum::<u64>() as f64 / mem_bw,
        Instr::OptimizerStep { grads, params, .. } => {
            // Read and write the params and every state element, read the gradients.
            let p = buffers[params.index()].bytes();
            (bytes(*grads) + 2 * p + 2 * p * state_per_param) as f64 / mem_bw
        }
    }
}

/// Where a buffer lives, for printing.
pub fn pool_name(p: Pool) -> &'static str {
    match p {
        Pool::Device => "device",
        Pool::Host => "host",
    }
}
