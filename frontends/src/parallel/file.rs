//! The parallel spec file as written: every field optional where the spec allows it, each
//! value with its span, so the conversion can name where a bad value was written.

use super::*;
use crate::either::{BoolOr, BoolOrInt, NameOr};
use serde::Deserialize;
use serde_saphyr::Spanned;
use shardplan_ir::{DType, ModuleKind};
use std::collections::BTreeMap;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ParallelSpecFile {
    pub(super) mesh: Spanned<MeshFile>,
    pub(super) world: Option<Spanned<u64>>,
    pub(super) gpus_per_node: Option<Spanned<u64>>,
    pub(super) hardware: Option<Spanned<NameOr<HardwareFile>>>,
    pub(super) wrap: Option<Spanned<Vec<Spanned<ModuleKind>>>>,
    pub(super) wrap_modules: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) bucket_mib: Option<Spanned<u64>>,
    pub(super) reshard_after_forward: Option<Spanned<BoolOrInt>>,
    pub(super) prefetch: Option<Spanned<NameOr<PrefetchFile>>>,
    pub(super) mixed_precision: Option<Spanned<MixedPrecisionFile>>,
    pub(super) offload: Option<Spanned<Offload>>,
    pub(super) activation_checkpointing: Option<Spanned<NameOr<AcEveryFile>>>,
    pub(super) batch: Option<Spanned<BatchFile>>,
    pub(super) optimizer: Option<Spanned<OptimizerFile>>,
    /// Present-but-null (`grad_clip: null`) must differ from absent (the default clip).
    #[serde(default, deserialize_with = "present")]
    pub(super) grad_clip: Option<Spanned<Option<f64>>>,
    pub(super) seed: Option<Spanned<u64>>,
    pub(super) lr_schedule: Option<Spanned<LrScheduleFile>>,
    pub(super) data: Option<Spanned<NameOr<DataFile>>>,
    pub(super) runtime: Option<Spanned<Runtime>>,
    pub(super) allocator: Option<Spanned<AllocatorFile>>,
    pub(super) compile: Option<Spanned<BoolOr<CompileFile>>>,
    pub(super) tensor_parallel: Option<Spanned<TensorParallelFile>>,
    pub(super) context_parallel: Option<Spanned<ContextParallelFile>>,
    pub(super) moe: Option<Spanned<MoeFile>>,
    pub(super) pipeline: Option<Spanned<PipelineFile>>,
    pub(super) float8: Option<Spanned<Float8File>>,
    pub(super) mxfp8: Option<Spanned<Mxfp8File>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Float8File {
    pub(super) recipe: Option<Spanned<Float8Recipe>>,
    pub(super) filter_fqns: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) fsdp_float8_all_gather: Option<Spanned<bool>>,
    pub(super) precompute_scale: Option<Spanned<bool>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Mxfp8File {
    pub(super) recipe: Option<Spanned<Mxfp8Recipe>>,
    pub(super) filter_fqns: Option<Spanned<Vec<Spanned<String>>>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PipelineFile {
    pub(super) schedule: Option<Spanned<PipelineSchedule>>,
    pub(super) microbatches: Option<Spanned<u64>>,
    pub(super) stages_per_rank: Option<Spanned<u64>>,
    pub(super) layers_per_stage: Option<Spanned<u64>>,
    pub(super) first_stage_less_layers: Option<Spanned<u64>>,
    pub(super) last_stage_less_layers: Option<Spanned<u64>>,
    pub(super) modules_per_stage: Option<Spanned<Vec<Vec<String>>>>,
    pub(super) csv: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MoeFile {
    pub(super) capacity: Option<Spanned<f64>>,
    pub(super) capacity_factor: Option<Spanned<f64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TensorParallelFile {
    pub(super) sequence_parallel: Option<Spanned<bool>>,
    pub(super) loss_parallel: Option<Spanned<bool>>,
    #[serde(rename = "async")]
    pub(super) async_tp: Option<Spanned<bool>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ContextParallelFile {
    pub(super) rotate: Option<Spanned<shardplan_ir::ContextRotate>>,
    pub(super) load_balance: Option<Spanned<shardplan_ir::ContextBalance>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CompileFile {
    pub(super) model: Option<Spanned<bool>>,
    pub(super) loss: Option<Spanned<bool>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AllocatorFile {
    pub(super) expandable_segments: Option<Spanned<bool>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LrScheduleFile {
    pub(super) warmup_steps: Option<Spanned<u64>>,
    pub(super) min_lr_ratio: Option<Spanned<f64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DataFile {
    pub(super) tokens: Spanned<String>,
    pub(super) dtype: Option<Spanned<TokenDType>>,
    pub(super) val: Option<Spanned<String>>,
    pub(super) eval_every: Option<Spanned<u64>>,
    pub(super) eval_batches: Option<Spanned<u64>>,
}

pub(super) fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MeshFile {
    pub(super) pipeline: Option<Spanned<u64>>,
    pub(super) replicate: Option<Spanned<u64>>,
    /// Absent: what `world` leaves once the other axes are taken, or 1 without `world`.
    pub(super) shard: Option<Spanned<u64>>,
    pub(super) context: Option<Spanned<u64>>,
    pub(super) tensor: Option<Spanned<u64>>,
    pub(super) expert: Option<Spanned<u64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct HardwareFile {
    pub(super) base: Option<Spanned<String>>,
    pub(super) name: Option<String>,
    pub(super) bf16_tflops: Option<Spanned<f64>>,
    pub(super) fp8_tflops: Option<Spanned<f64>>,
    pub(super) mxfp8_tflops: Option<Spanned<f64>>,
    pub(super) f32_tflops: Option<Spanned<f64>>,
    pub(super) hbm_gib: Option<Spanned<f64>>,
    pub(super) hbm_gbps: Option<Spanned<f64>>,
    pub(super) intra_node_gbps: Option<Spanned<f64>>,
    pub(super) inter_node_gbps: Option<Spanned<f64>>,
    pub(super) intra_node_latency_us: Option<Spanned<f64>>,
    pub(super) inter_node_latency_us: Option<Spanned<f64>>,
    #[serde(alias = "compute_efficiency")]
    pub(super) matmul_efficiency: Option<Spanned<f64>>,
    pub(super) host_link_gbps: Option<Spanned<f64>>,
    pub(super) host_mem_gbps: Option<Spanned<f64>>,
    pub(super) cuda_context_mib: Option<Spanned<f64>>,
    pub(super) nccl_channels: Option<Spanned<f64>>,
    pub(super) nccl_channel_mib: Option<Spanned<f64>>,
    pub(super) sm_count: Option<Spanned<f64>>,
    pub(super) matmul_tile_m: Option<Spanned<f64>>,
    pub(super) matmul_tile_n: Option<Spanned<f64>>,
    pub(super) attention_fwd_efficiency: Option<Spanned<f64>>,
    pub(super) attention_bwd_efficiency: Option<Spanned<f64>>,
    pub(super) attention_block: Option<Spanned<f64>>,
    pub(super) memory_efficiency: Option<Spanned<f64>>,
    pub(super) kernel_launch_us: Option<Spanned<f64>>,
    pub(super) collective_efficiency: Option<Spanned<f64>>,
    pub(super) overlap_slowdown: Option<Spanned<f64>>,
    pub(super) parallel_launch_us: Option<Spanned<f64>>,
    pub(super) copy_gbps: Option<Spanned<f64>>,
    pub(super) step_overhead_us: Option<Spanned<f64>>,
    pub(super) fsdp2_unit_host_us: Option<Spanned<f64>>,
    pub(super) fsdp2_compiled_unit_host_us: Option<Spanned<f64>>,
    pub(super) kernels: Option<Spanned<crate::hardware::KernelMode>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PrefetchFile {
    pub(super) forward: Option<Spanned<u32>>,
    pub(super) backward: Option<Spanned<u32>>,
    pub(super) explicit: Option<Spanned<ExplicitPrefetchFile>>,
    pub(super) peak_aware: Option<Spanned<bool>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ExplicitPrefetchFile {
    #[serde(default)]
    pub(super) forward: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    pub(super) backward: BTreeMap<String, Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MixedPrecisionFile {
    pub(super) param: Option<Spanned<DType>>,
    pub(super) reduce: Option<Spanned<DType>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AcEveryFile {
    pub(super) every: Option<Spanned<u64>>,
    pub(super) selective: Option<Spanned<AcSelectiveFile>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AcSelectiveFile {
    pub(super) save: Spanned<Vec<Spanned<String>>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct BatchFile {
    pub(super) per_rank: Option<Spanned<u64>>,
    pub(super) seq_len: Option<Spanned<u64>>,
    pub(super) grad_accum: Option<Spanned<u64>>,
    pub(super) grad_sync: Option<Spanned<GradSync>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub(super) enum OptimizerFile {
    Adamw(AdamwFile),
    Sgd(SgdFile),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AdamwFile {
    pub(super) lr: Option<Spanned<f64>>,
    pub(super) betas: Option<Spanned<[f64; 2]>>,
    pub(super) eps: Option<Spanned<f64>>,
    pub(super) weight_decay: Option<Spanned<f64>>,
    pub(super) implementation: Option<Spanned<AdamwImplementation>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SgdFile {
    pub(super) lr: Option<Spanned<f64>>,
    pub(super) momentum: Option<Spanned<f64>>,
    pub(super) weight_decay: Option<Spanned<f64>>,
}
