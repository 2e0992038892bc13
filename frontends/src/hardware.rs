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
    /// Dense float8 (e4m3/e5m2) tensor-core peak, TFLOP/s; 0 where the device has none
    /// (before Ada and Hopper, SM89), which refuses `float8`.
    #[serde(default)]
    pub fp8_tflops: f64,
    /// Dense MXFP8 (block-scaled float8) tensor-core peak, TFLOP/s; 0 where the device has
    /// no MX tensor cores (before Blackwell), which refuses `mxfp8`.
    #[serde(default)]
    pub mxfp8_tflops: f64,
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
    /// Fraction of peak FLOP/s that a large, well-shaped matmul reaches (cuBLAS on big
    /// GEMMs); smaller shapes lose more to tile and wave quantisation on `sm_count` SMs.
    /// Spec files may still call it `compute_efficiency`.
    #[serde(alias = "compute_efficiency")]
    pub matmul_efficiency: f64,
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
    /// Streaming multiprocessors (GPU) or cores (CPU): the units a matmul's output tiles are
    /// spread over in waves.
    #[serde(default = "default_sm_count")]
    pub sm_count: f64,
    /// Output tile of one matmul thread block: rows (cuBLAS's large tiles) ...
    #[serde(default = "default_tile_m")]
    pub matmul_tile_m: f64,
    /// ... and columns.
    #[serde(default = "default_tile_n")]
    pub matmul_tile_n: f64,
    /// Fraction of peak that flash attention's forward reaches on the blocks it computes
    /// (a causal mask skips the blocks above the diagonal).
    #[serde(default = "default_attention_fwd")]
    pub attention_fwd_efficiency: f64,
    /// The same for flash attention's backward (which recomputes the probabilities).
    #[serde(default = "default_attention_bwd")]
    pub attention_bwd_efficiency: f64,
    /// Query and key block of flash attention: the unit a causal mask skips.
    #[serde(default = "default_attention_block")]
    pub attention_block: f64,
    /// Fraction of `hbm_gbps` that memory-bound kernels (elementwise, norms, reductions,
    /// copies, the optimizer step) reach.
    #[serde(default = "default_memory_efficiency")]
    pub memory_efficiency: f64,
    /// The least time one kernel takes, microseconds: launch and dispatch in eager mode.
    #[serde(default = "default_kernel_launch_us")]
    pub kernel_launch_us: f64,
    /// Fraction of the link rate that NCCL's collectives reach as bus bandwidth on large
    /// messages.
    #[serde(default = "default_collective_efficiency")]
    pub collective_efficiency: f64,
    /// Extra compute time while a collective runs beside it: NCCL's kernels hold
    /// `nccl_channels` SMs, so compute runs on the rest,
    /// `nccl_channels / (sm_count - nccl_channels)` slower.
    #[serde(default = "default_overlap_slowdown")]
    pub overlap_slowdown: f64,
    /// What starting an op on the executor's thread pool costs beyond `kernel_launch_us`,
    /// microseconds: waking the pool's sleeping threads (`kernels: fused` on a CPU; 0 where
    /// not measured). `shardplan calibrate` measures it.
    #[serde(default)]
    pub parallel_launch_us: f64,
    /// GB/s at which one thread of the executor copies memory (bytes written): the gradient
    /// copy into a group's flat buffer and the parameter copy out of an all-gather output,
    /// both on the compute stream (`kernels: fused`; 0 where not measured: not modelled).
    #[serde(default)]
    pub copy_gbps: f64,
    /// Microseconds every training step costs beyond its instructions: starting and joining
    /// the rank and stream threads, making the batch (`kernels: fused`; 0 where not measured).
    #[serde(default)]
    pub step_overhead_us: f64,
    /// Host time PyTorch FSDP2 spends per FSDP unit and training step outside its kernels'
    /// launches, microseconds: its pre- and post-forward and backward hooks in Python and
    /// the unit's autograd bookkeeping, which an eager step at a small batch waits for
    /// (`runtime: fsdp2` only). Default [`FSDP2_UNIT_HOST_US`].
    #[serde(default = "default_fsdp2_unit_host_us")]
    pub fsdp2_unit_host_us: f64,
    /// The same for an FSDP unit whose block is compiled (`compile.model`): its ops are one
    /// compiled graph forward and one backward, not an autograd node and a dispatch each.
    /// Default [`FSDP2_COMPILED_UNIT_HOST_US`].
    #[serde(default = "default_fsdp2_compiled_unit_host_us")]
    pub fsdp2_compiled_unit_host_us: f64,
    /// How the framework being planned runs memory-bound ops: `eager` (PyTorch eager, as
    /// FSDP2 and torchtitan run: an RMSNorm or a rotary embedding is several kernels
    /// through f32 temporaries) or `fused` (one kernel per graph op, as shardplan's
    /// executor runs them).
    #[serde(default)]
    pub kernels: KernelMode,
}

/// How memory-bound ops run: see [`HardwareProfile::kernels`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelMode {
    #[default]
    Eager,
    Fused,
}

impl KernelMode {
    pub fn name(self) -> &'static str {
        match self {
            KernelMode::Eager => "eager",
            KernelMode::Fused => "fused",
        }
    }
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

fn default_fsdp2_unit_host_us() -> f64 {
    FSDP2_UNIT_HOST_US
}

fn default_fsdp2_compiled_unit_host_us() -> f64 {
    FSDP2_COMPILED_UNIT_HOST_US
}

fn default_sm_count() -> f64 {
    132.0
}

fn default_tile_m() -> f64 {
    128.0
}

fn default_tile_n() -> f64 {
    256.0
}

fn default_attention_fwd() -> f64 {
    FA2_HOPPER.0
}

fn default_attention_bwd() -> f64 {
    FA2_HOPPER.1
}

fn default_attention_block() -> f64 {
    128.0
}

fn default_memory_efficiency() -> f64 {
    MEMORY_EFFICIENCY
}

fn default_kernel_launch_us() -> f64 {
    KERNEL_LAUNCH_US
}

fn default_collective_efficiency() -> f64 {
    COLLECTIVE_EFFICIENCY
}

fn default_overlap_slowdown() -> f64 {
    NCCL_CHANNELS / (132.0 - NCCL_CHANNELS)
}

/// Flash attention 2 (PyTorch's `scaled_dot_product_attention` flash backend) on Ampere:
/// forward and backward as fractions of the A100's 312 TFLOP/s, head dim 128, long
/// sequences (the FlashAttention-2 paper, Dao 2023, figures 4-6: about 70% forward and
/// 60% backward).
pub const FA2_AMPERE: (f64, f64) = (0.70, 0.60);
/// Flash attention 2 on Hopper, which it does not program with Hopper's own instructions
/// (the FlashAttention-3 paper, Shah et al. 2024, figure 5: about 350 of 989 TFLOP/s
/// forward and 300 backward, head dim 128).
pub const FA2_HOPPER: (f64, f64) = (0.35, 0.30);
/// Memory-bound kernels reach about 85-90% of the HBM's rate (device-to-device copy
/// bandwidth in vendors' `bandwidthTest` and STREAM-like kernels); 0.85.
pub const MEMORY_EFFICIENCY: f64 = 0.85;
/// Eager PyTorch issues one op every few microseconds from Python through the dispatcher;
/// an op shorter than that leaves the GPU idle. 5 us.
pub const KERNEL_LAUNCH_US: f64 = 5.0;
/// NCCL's all-gather and reduce-scatter bus bandwidth on large messages over NVLink and
/// InfiniBand is about 80% of the link rate (`nccl-tests` on DGX A100: ~235 of 300 GB/s;
/// on DGX H100: ~360 of 450 GB/s).
pub const COLLECTIVE_EFFICIENCY: f64 = 0.80;

/// Host time of eager FSDP2 per FSDP unit and step, beyond `kernel_launch_us` per kernel:
/// 2,250 us. Fitted to four PyTorch FSDP2 runs on an H200 (the exported 1.1B at 2 x 2048 and
/// at 4 x 2048 under full and selective checkpointing, and a 3.2B at 1 x 4096; foreach AdamW;
/// docs/src/measured.md, "Held against an H200"; `planner/tests/h200_runs.rs`): with the
/// H200's measured constants the kernels account for 96-272 ms of steps measured at
/// 133-325 ms, and what each row left was 1.4-3.3 ms per unit (2,756, 1,396, 3,306 and 1,557
/// us, once the clip's second pass and FSDP2's casting copy-in were costed); this is their
/// mean. Since one-rank groups skip the all-gather (as FSDP2 does) the rows leave 2,676,
/// 1,242, 3,152 and 1,422 us (mean 2,123); the value is kept, inside that spread, as
/// refitting it to 2,120 moves the anchors and the fused-AdamW row 0.1-1.9% further from
/// their measured speed. The mean of any three fits predicts the fourth's speed within 11%.
/// torch.profiler of the same step agrees that the host sets the pace at this batch: its
/// kernels sum to 78 ms of a 131 ms step. FSDP2's four hooks per unit in Python, its copy-in and copy-out bookkeeping and the
/// autograd recording of the unit's ops are what it stands for. `benches/fsdp2_host.py`
/// (`gpu-check --checks host`) measures it on its own; not yet run on a GPU.
pub const FSDP2_UNIT_HOST_US: f64 = 2250.0;

/// Host time of FSDP2 per compiled FSDP unit and step: [`FSDP2_UNIT_HOST_US`] times the
/// share of it a compiled block keeps, 0.83, measured with `benches/fsdp2_host.py` on a CPU
/// (torch 2.15, one rank, gloo, a block of 64 wide whose kernels take next to nothing; the
/// median step's growth per block from 4 to 20 blocks: 3.66 ms eager, 3.05 ms with each
/// block compiled by `nn.Module.compile(fullgraph=True)`; 2026-12-06). What a compiled
/// block saves is its ops' dispatch and autograd bookkeeping; FSDP2's hooks, its copy-in
/// and copy-out and the optimizer's per-parameter work stay. A CPU's ratio stands in for
/// a GPU host's until `gpu-check --checks host` runs `--compile` on one: 1,870 us.
pub const FSDP2_COMPILED_UNIT_HOST_US: f64 = 1870.0;

/// The cost-model constants `benches/gpu_profile.py` (`gpu-check --checks profile`)
/// measured on one H200 SXM (141 GB; PyTorch 2.11, cuDNN 9.19; 2026-11-26): matmul 0.63 of
/// 989 TFLOP/s over Llama's linear shapes, flash attention 0.34 forward and 0.29 backward,
/// memory-bound kernels 0.79 of 4.8 TB/s, and 9.3 us per eager op (10,000 `x.add_(1)`).
pub const H200_MEASURED: H200Measured = H200Measured {
    matmul: 0.63,
    attention: (0.34, 0.29),
    memory: 0.79,
    launch_us: 9.3,
};

/// See [`H200_MEASURED`].
pub struct H200Measured {
    pub matmul: f64,
    pub attention: (f64, f64),
    pub memory: f64,
    pub launch_us: f64,
}

/// Built-in profile names.
pub const HARDWARE_NAMES: &[&str] = &[
    "h100-sxm",
    "h100-sxm-96gb",
    "h100-96gb-500w",
    "h200",
    "a100-40gb",
    "a100-80gb",
    "b200",
];

/// The dense bf16 peak of `h100-96gb-500w`, TFLOP/s, as far as it is known: at least the
/// H100 NVL's 835 (the same 132-SM die, specified for a 350-400 W card), at most the H100
/// SXM's 989 (specified at 700 W). torchtitan's benchmark notes
/// (`benchmarks/llama3_h100_202412_torchtitan.md`, footnote 2) say the peak of these GPUs
/// lies between the two and that its exact value is not known. The profile takes the
/// lower end; set `bf16_tflops` to try another.
pub const H100_96GB_500W_TFLOPS: (f64, f64) = (835.0, 989.0);

/// One GPU generation's figures that its memory variants share.
struct Arch {
    bf16: f64,
    f32: f64,
    fp8: f64,
    mxfp8: f64,
    nvlink: f64,
    net: f64,
    host: (f64, f64),
    sms: f64,
    tile: [f64; 2],
    matmul: f64,
    attention: (f64, f64),
}

/// A built-in profile. Figures are the vendor's dense peaks and link rates (SXM parts,
/// 8 per node over NVSwitch, one NIC per GPU: 200 Gb/s for Ampere, 400 Gb/s for Hopper and
/// Blackwell); `hbm_gib` is what the driver reports. Host links are PCIe Gen4 x16 (Ampere)
/// and Gen5 x16 (Hopper, Blackwell) at about 80% of 32 / 64 GB/s; host memory is one
/// socket's DDR bandwidth (about 200 / 300 GB/s) shared by the 4 GPUs it serves.
///
/// Efficiencies, and where each comes from:
/// - `matmul_efficiency`: what cuBLAS reaches on large bf16 GEMMs: about 250 of 312 TFLOP/s
///   on A100 (0.80), about 700 of 989 on H100 under its power limit (0.70), and about
///   1,600 of 2,250 on B200 (0.70).
/// - `matmul_tile`: cuBLAS's large tiles, 128 x 128 on Ampere and 128 x 256 on Hopper and
///   Blackwell; `sm_count`: 108, 132, 148.
/// - attention: [`FA2_AMPERE`], [`FA2_HOPPER`] (and Hopper's for Blackwell, where PyTorch
///   also runs flash attention 2).
/// - [`MEMORY_EFFICIENCY`], [`KERNEL_LAUNCH_US`], [`COLLECTIVE_EFFICIENCY`] for every GPU;
///   `overlap_slowdown` is `nccl_channels / (sm_count - nccl_channels)`.
pub fn builtin(name: &str) -> Option<HardwareProfile> {
    const AMPERE: Arch = Arch {
        bf16: 312.0,
        f32: 19.5,
        fp8: 0.0,
        mxfp8: 0.0,
        nvlink: 300.0,
        net: 25.0,
        host: (25.0, 50.0),
        sms: 108.0,
        tile: [128.0, 128.0],
        matmul: 0.80,
        attention: FA2_AMPERE,
    };
    const HOPPER: Arch = Arch {
        bf16: 989.0,
        f32: 67.0,
        fp8: 1979.0,
        mxfp8: 0.0,
        nvlink: 450.0,
        net: 50.0,
        host: (50.0, 75.0),
        sms: 132.0,
        tile: [128.0, 256.0],
        matmul: 0.70,
        attention: FA2_HOPPER,
    };
    const BLACKWELL: Arch = Arch {
        bf16: 2250.0,
        f32: 80.0,
        fp8: 4500.0,
        mxfp8: 4500.0,
        nvlink: 900.0,
        net: 50.0,
        host: (50.0, 75.0),
        sms: 148.0,
        tile: [128.0, 256.0],
        matmul: 0.70,
        attention: FA2_HOPPER,
    };
    let p = |a: &Arch, gib: f64, hbm: f64| HardwareProfile {
        name: name.to_string(),
        bf16_tflops: a.bf16,
        f32_tflops: a.f32,
        fp8_tflops: a.fp8,
        mxfp8_tflops: a.mxfp8,
        hbm_gib: gib,
        hbm_gbps: hbm,
        intra_node_gbps: a.nvlink,
        inter_node_gbps: a.net,
        intra_node_latency_us: 5.0,
        inter_node_latency_us: 15.0,
        matmul_efficiency: a.matmul,
        host_link_gbps: a.host.0,
        host_mem_gbps: a.host.1,
        cuda_context_mib: CUDA_CONTEXT_MIB,
        nccl_channels: NCCL_CHANNELS,
        nccl_channel_mib: NCCL_CHANNEL_MIB,
        sm_count: a.sms,
        matmul_tile_m: a.tile[0],
        matmul_tile_n: a.tile[1],
        attention_fwd_efficiency: a.attention.0,
        attention_bwd_efficiency: a.attention.1,
        attention_block: 128.0,
        memory_efficiency: MEMORY_EFFICIENCY,
        kernel_launch_us: KERNEL_LAUNCH_US,
        collective_efficiency: COLLECTIVE_EFFICIENCY,
        overlap_slowdown: NCCL_CHANNELS / (a.sms - NCCL_CHANNELS),
        parallel_launch_us: 0.0,
        copy_gbps: 0.0,
        step_overhead_us: 0.0,
        fsdp2_unit_host_us: FSDP2_UNIT_HOST_US,
        fsdp2_compiled_unit_host_us: FSDP2_COMPILED_UNIT_HOST_US,
        kernels: KernelMode::Eager,
    };
    Some(match name {
        "h100-sxm" => p(&HOPPER, 79.6, 3350.0),
        // 95,830 MiB as the driver reports it.
        "h100-sxm-96gb" => p(&HOPPER, 93.6, 3350.0),
        // The H100s of torchtitan's published H100 runs (Meta's Grand Teton hosts; see
        // `benchmarks/llama3_h100_202412_torchtitan.md`): SXM H100s with 96 GB of HBM2e at
        // 2.4 TB/s, run at a 500 W power limit (700 W is the SXM part's TDP), 8 per host on
        // NVLink, 400 Gb/s RDMA per GPU. Their bf16 peak is not known: it lies within
        // [`H100_96GB_500W_TFLOPS`], and this profile takes the lower end. Its memory size is
        // taken as the 96 GB H100s report it (95,830 MiB), not measured on this part.
        "h100-96gb-500w" => HardwareProfile {
            bf16_tflops: H100_96GB_500W_TFLOPS.0,
            // Float8 runs the tensor cores at twice bf16's rate, as on every Hopper part.
            fp8_tflops: 2.0 * H100_96GB_500W_TFLOPS.0,
            ..p(&HOPPER, 93.6, 2400.0)
        },
        // Hopper's figures with the efficiencies and launch cost measured on an H200.
        "h200" => HardwareProfile {
            matmul_efficiency: H200_MEASURED.matmul,
            attention_fwd_efficiency: H200_MEASURED.attention.0,
            attention_bwd_efficiency: H200_MEASURED.attention.1,
            memory_efficiency: H200_MEASURED.memory,
            kernel_launch_us: H200_MEASURED.launch_us,
            ..p(&HOPPER, 140.4, 4800.0)
        },
        "a100-40gb" => p(&AMPERE, 40.0, 1555.0),
        "a100-80gb" => p(&AMPERE, 80.0, 2039.0),
        // 183,359 MiB as the driver reports it (DGX B200: 180 GB per GPU).
        "b200" => p(&BLACKWELL, 179.1, 8000.0),
        _ => return None,
    })
}

impl HardwareProfile {
    /// `(field name, value)` of every number, for validation and printing.
    pub fn numbers(&self) -> [(&'static str, f64); 31] {
        [
            ("bf16_tflops", self.bf16_tflops),
            ("f32_tflops", self.f32_tflops),
            ("fp8_tflops", self.fp8_tflops),
            ("mxfp8_tflops", self.mxfp8_tflops),
            ("hbm_gib", self.hbm_gib),
            ("hbm_gbps", self.hbm_gbps),
            ("intra_node_gbps", self.intra_node_gbps),
            ("inter_node_gbps", self.inter_node_gbps),
            ("intra_node_latency_us", self.intra_node_latency_us),
            ("inter_node_latency_us", self.inter_node_latency_us),
            ("matmul_efficiency", self.matmul_efficiency),
            ("host_link_gbps", self.host_link_gbps),
            ("host_mem_gbps", self.host_mem_gbps),
            ("cuda_context_mib", self.cuda_context_mib),
            ("nccl_channels", self.nccl_channels),
            ("nccl_channel_mib", self.nccl_channel_mib),
            ("sm_count", self.sm_count),
            ("matmul_tile_m", self.matmul_tile_m),
            ("matmul_tile_n", self.matmul_tile_n),
            ("attention_fwd_efficiency", self.attention_fwd_efficiency),
            ("attention_bwd_efficiency", self.attention_bwd_efficiency),
            ("attention_block", self.attention_block),
            ("memory_efficiency", self.memory_efficiency),
            ("kernel_launch_us", self.kernel_launch_us),
            ("collective_efficiency", self.collective_efficiency),
            ("overlap_slowdown", self.overlap_slowdown),
            ("parallel_launch_us", self.parallel_launch_us),
            ("copy_gbps", self.copy_gbps),
            ("step_overhead_us", self.step_overhead_us),
            ("fsdp2_unit_host_us", self.fsdp2_unit_host_us),
            ("fsdp2_compiled_unit_host_us", self.fsdp2_compiled_unit_host_us),
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
