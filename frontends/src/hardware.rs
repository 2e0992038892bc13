//! Hardware profiles: every constant the cost model uses, by name or by numbers.

use serde::{Deserialize, Serialize};

/// What one accelerator and its links can do. Bandwidths are per GPU, one direction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareProfile {
    pub name: String,
    /// Dense bf16/f16 tensor-core peak, TFLOP/s.
    pub bf16_tflops: f64,
    /// Dense f32 peak without TF32 (PyTorch's default for matmuls), TFLOP/s.
    pub f32_tflops: f64,
    /// Device memory, GiB, as the driver reports it.
    pub hbm_gib: f64,
    /// Device memory bandwidth, GB/s.
    pub hbm_gbps: f64,
    /// NVLink/NVSwitch bandwidth within a node, GB/s per direction.
    pub intra_node_gbps: f64,
    /// Network bandwidth between nodes, GB/s per GPU per direction.
    pub inter_node_gbps: f64,
    /// Latency of one step of a ring collective within a node, microseconds.
    pub intra_node_latency_us: f64,
    /// Latency of one step of a ring collective across nodes, microseconds.
    pub inter_node_latency_us: f64,
    /// Fraction of peak FLOP/s that large matmuls reach in practice.
    pub compute_efficiency: f64,
    /// Host <-> device copy bandwidth (PCIe), GB/s per GPU per direction (CPU offload).
    pub host_link_gbps: f64,
    /// Host memory bandwidth available to one GPU's share of the CPU, GB/s (the optimizer
    /// step runs on the CPU under CPU offload, and is bound by it).
    pub host_mem_gbps: f64,
    /// Device memory one process's CUDA context holds outside the caching allocator (driver
    /// state and the loaded kernels of the CUDA libraries), MiB. Default [`CUDA_CONTEXT_MIB`].
    #[serde(default = "default_cuda_context_mib")]
    pub cuda_context_mib: f64,
    /// Channels (rings) NCCL opens per communicator, as `NCCL_DEBUG=INFO` reports them.
    /// Default [`NCCL_CHANNELS`].
    #[serde(default = "default_nccl_channels")]
    pub nccl_channels: f64,
    /// Device memory NCCL holds per channel of a communicator, MiB: the buffers of one ring
    /// connection for its three protocols. Default [`NCCL_CHANNEL_MIB`].
    #[serde(default = "default_nccl_channel_mib")]
    pub nccl_channel_mib: f64,
}

/// PyTorch's CUDA context with its kernels loaded eagerly: 666,632,192 bytes
/// (pytorch/pytorch#86509, the pull request that made lazy loading PyTorch's default, where
/// the same process took 287,047,680 bytes lazily). Lazy loading (CUDA's default since 12.2)
/// starts lower and grows with every kernel a training step loads; the eager figure is the
/// bound the planner uses.
pub const CUDA_CONTEXT_MIB: f64 = 666_632_192.0 / (1 << 20) as f64;

/// Ring channels NCCL opened per communicator on 8-GPU Hopper nodes in published
/// `NCCL_DEBUG=INFO` logs ("16 coll channels" on H800, NVIDIA/nccl#892; "Channel 00/16" on
/// H100 nodes, NVIDIA/nccl#1453). NCCL picks the count from the topology; set
/// `nccl_channels` to what it reports on yours.
pub const NCCL_CHANNELS: f64 = 16.0;

/// NCCL's default buffer of the Simple protocol per connection (`NCCL_BUFFSIZE`, 4 MiB).
pub const NCCL_BUFFSIZE: u64 = 1 << 22;
/// NCCL's default LL buffer per connection (`NCCL_LL_BUFFSIZE`: 8 lines per thread x 512
/// threads x 8 steps x 16-byte lines = 512 KiB).
pub const NCCL_LL_BUFFSIZE: u64 = 8 * 512 * 8 * 16;
/// NCCL's default LL128 buffer per connection (`NCCL_LL128_BUFFSIZE`: 120 elements per
/// thread x 640 threads x 8 steps x 8 bytes = 4.6875 MiB).
pub const NCCL_LL128_BUFFSIZE: u64 = 120 * 640 * 8 * 8;

/// Per channel a rank holds the buffers of one ring connection: it receives from its
/// predecessor and sends to its successor, and each connection's buffers (all three
/// protocols) live once, split between its two ends. 9.1875 MiB.
pub const NCCL_CHANNEL_MIB: f64 = (NCCL_BUFFSIZE + NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE) as f64 / (1 << 20) as f64;

fn default_cuda_context_mib() -> f64 {
    CUDA_CONTEXT_MIB
}

fn default_nccl_channels() -> f64 {
    NCCL_CHANNELS
}

fn default_nccl_channel_mib() -> f64 {
    NCCL_CHANNEL_MIB
}

/// Built-in profile names.
pub const HARDWARE_NAMES: &[&str] = &["h100-sxm", "h200", "a100-80gb"];

/// A built-in profile. Figures are the vendor's dense peaks and link rates (SXM parts,
/// 8 per node over NVSwitch, one 400 Gb/s NIC per GPU for Hopper, 200 Gb/s for Ampere);
/// latency and efficiency are typical measured values, not guarantees. Host links are PCIe
/// Gen5 x16 (Hopper) and Gen4 x16 (Ampere) at about 80% of their 64 / 32 GB/s; host memory
/// is one socket's DDR bandwidth (about 300 / 200 GB/s) shared by the 4 GPUs it serves.
pub fn builtin(name: &str) -> Option<HardwareProfile> {
    let p = |bf16: f64, f32: f64, gib: f64, hbm: f64, nvl: f64, net: f64, host: (f64, f64)| HardwareProfile {
        name: name.to_string(),
        bf16_tflops: bf16,
        f32_tflops: f32,
        hbm_gib: gib,
        hbm_gbps: hbm,
        intra_node_gbps: nvl,
        inter_node_gbps: net,
        intra_node_latency_us: 5.0,
        inter_node_latency_us: 15.0,
        compute_efficiency: 0.6,
        host_link_gbps: host.0,
        host_mem_gbps: host.1,
        cuda_context_mib: CUDA_CONTEXT_MIB,
        nccl_channels: NCCL_CHANNELS,
        nccl_channel_mib: NCCL_CHANNEL_MIB,
    };
    Some(match name {
        "h100-sxm" => p(989.0, 67.0, 79.6, 3350.0, 450.0, 50.0, (50.0, 75.0)),
        "h200" => p(989.0, 67.0, 140.4, 4800.0, 450.0, 50.0, (50.0, 75.0)),
        "a100-80gb" => p(312.0, 19.5, 80.0, 2039.0, 300.0, 25.0, (25.0, 50.0)),
        _ => return None,
    })
}

impl HardwareProfile {
    /// `(field name, value)` of every number, for validation and printing.
    pub fn numbers(&self) -> [(&'static str, f64); 14] {
        [
            ("bf16_tflops", self.bf16_tflops),
            ("f32_tflops", self.f32_tflops),
            ("hbm_gib", self.hbm_gib),
            ("hbm_gbps", self.hbm_gbps),
            ("intra_node_gbps", self.intra_node_gbps),
            ("inter_node_gbps", self.inter_node_gbps),
            ("intra_node_latency_us", self.intra_node_latency_us),
            ("inter_node_latency_us", self.inter_node_latency_us),
            ("compute_efficiency", self.compute_efficiency),
            ("host_link_gbps", self.host_link_gbps),
            ("host_mem_gbps", self.host_mem_gbps),
            ("cuda_context_mib", self.cuda_context_mib),
            ("nccl_channels", self.nccl_channels),
            ("nccl_channel_mib", self.nccl_channel_mib),
        ]
    }

    /// The device's memory in bytes (`hbm_gib`).
    pub fn hbm_bytes(&self) -> u64 {
        mib_bytes(self.hbm_gib * 1024.0)
    }

    /// Bytes of device memory a process holds outside the caching allocator before NCCL:
    /// the CUDA context.
    pub fn cuda_context_bytes(&self) -> u64 {
        mib_bytes(self.cuda_context_mib)
    }

    /// Bytes NCCL holds for one communicator of more than one rank.
    pub fn nccl_bytes_per_communicator(&self) -> u64 {
        mib_bytes(self.nccl_channels * self.nccl_channel_mib)
    }
}

/// `mib` MiB in bytes (negative and NaN as 0, saturating).
fn mib_bytes(mib: f64) -> u64 {
    let b = (mib * (1u64 << 20) as f64).round();
    if b.is_nan() || b <= 0.0 {
        0
    } else if b >= u64::MAX as f64 {
        u64::MAX
    } else {
        b as u64
    }
}
