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
    pub fn numbers(&self) -> [(&'static str, f64); 11] {
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
        ]
    }
}
