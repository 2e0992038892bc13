//! Frontends: the YAML model spec, Hugging Face config.json import and the YAML parallel
//! spec, each a serde type mirroring the file and converted once into a validated config;
//! every error names the file, line:column, field and the fix.

mod either;
mod error;
pub mod hardware;
mod hf_config;
mod load;
mod model_spec;
mod origin;
mod parallel;
mod source;
mod yaml;

pub use error::{did_you_mean, Pos, SpecError, SpecErrorDetails};
pub use hardware::{
    builtin as builtin_hardware, HardwareProfile, KernelMode, CUDA_CONTEXT_MIB, FSDP2_COMPILED_UNIT_HOST_US,
    FSDP2_UNIT_HOST_US, H100_96GB_500W_TFLOPS, H200_MEASURED, HARDWARE_NAMES, NCCL_BUFFSIZE, NCCL_CHANNELS,
    NCCL_CHANNEL_MIB, NCCL_LL128_BUFFSIZE, NCCL_LL_BUFFSIZE,
};
pub use hf_config::{field_table as hf_field_table, parse_hf_config, FieldRule, HfConfig, SUPPORTED_ARCHITECTURES};
pub use load::{load_model, load_parallel, trace_error, trace_options, LoadedModel, LoadedParallel};
pub use model_spec::{parse_model_spec, Family, ModelSpecFile};
pub use origin::Origin;
pub use parallel::{
    parse_parallel_spec, spec_yaml, ActivationCheckpointing, AdamwImplementation, AllocatorConfig, Batch, Compile,
    ContextParallel, DataSource, Eval, Float8, GradSync, LrSchedule, MeshShape, MixedPrecision, MoeParallel, Mxfp8,
    Mxfp8Recipe, Offload, Optimizer, ParallelConfig, Pipeline, PipelineSchedule, Prefetch, Reshard, Runtime,
    SavePolicy, SavedMatmuls, StageSplit, TensorParallel, TokenDType, DEFAULT_MOE_CAPACITY, MAX_EVAL_BATCHES,
    MAX_WORLD,
};
pub use source::{Source, MAX_SPEC_BYTES};
