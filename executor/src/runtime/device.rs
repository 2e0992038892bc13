//! The device a run computes on: `cpu`, or `cuda` / `cuda:N` in builds with the `cuda`
//! feature (candle's CUDA backend). Without the feature, asking for CUDA is an error that
//! says how to get a CUDA build.

use crate::ExecError;
use candle_core::Device;

/// What `--device` accepts.
pub const DEVICES: &str = "`cpu`, `cuda` or `cuda:N`";

/// Opens the device named by `spec`.
pub fn open(spec: &str) -> Result<Device, ExecError> {
    let spec = spec.trim();
    if spec == "cpu" {
        return Ok(Device::Cpu);
    }
    let ordinal = match spec.strip_prefix("cuda") {
        Some("") => 0,
        Some(rest) => rest
            .strip_prefix(':')
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| ExecError::Unsupported(format!("unknown device `{spec}`: use {DEVICES}")))?,
        None => {
            return Err(ExecError::Unsupported(format!(
                "unknown device `{spec}`: use {DEVICES}"
            )))
        }
    };
    cuda(ordinal)
}

/// Makes `device`'s CUDA context current on the calling thread; nothing on the CPU.
///
/// Every thread that may hold or drop a CUDA tensor calls this first: cudarc makes the
/// context current before most driver calls but not when it frees a slice, so a thread
/// whose first CUDA action is dropping a tensor fails the free with
/// CUDA_ERROR_INVALID_CONTEXT (seen on an H100: step 2 of a 1x1 run failed that way).
pub fn bind_thread(device: &Device) -> Result<(), ExecError> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        d.cuda_stream().context().bind_to_thread().map_err(|e| {
            ExecError::Candle(candle_core::Error::Msg(format!(
                "cannot make the CUDA context current on this thread: {e:?}"
            )))
        })?;
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    Ok(())
}

/// GPU memory as the device reports it, over one measurement window (a training step).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeviceMemory {
    /// Most bytes held in allocations at once (the stream-ordered allocator's high-water
    /// mark of memory in use: what `torch.cuda.max_memory_allocated` reports in PyTorch).
    pub allocated_peak: u64,
    /// Most bytes the allocator held from the driver at once, in use or cached (its
    /// reserved high-water mark: `max_memory_reserved`).
    pub reserved_peak: u64,
    /// Bytes in use on the whole device at the window's end (`cuMemGetInfo`: total minus
    /// free, so the CUDA context, cuBLAS and NCCL buffers, and any other process too).
    pub in_use: u64,
    /// The device's memory.
    pub total: u64,
}

/// Starts a measurement window on `device`: resets the allocator's high-water marks.
/// Nothing on the CPU.
pub fn reset_peaks(device: &Device) -> Result<(), ExecError> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return cuda_memory::reset(d);
    }
    let _ = device;
    Ok(())
}

/// The window's figures on `device` since `reset_peaks`; `None` on the CPU.
pub fn measure(device: &Device) -> Result<Option<DeviceMemory>, ExecError> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return cuda_memory::measure(d).map(Some);
    }
    let _ = device;
    Ok(None)
}

/// Memory a new run may still take on `device` and its total, as the driver reports them
/// now (`cuMemGetInfo`: what the CUDA context, other processes and earlier runs hold is
/// already gone from the first figure); `None` on the CPU, whose budget is the host's.
pub fn free_memory(device: &Device) -> Result<Option<(u64, u64)>, ExecError> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return cuda_memory::free(d).map(Some);
    }
    let _ = device;
    Ok(None)
}

#[cfg(feature = "cuda")]
mod cuda_memory {
    //! The device's default memory pool (cudarc allocates through `cuMemAllocAsync`, which
    //! draws from it) and `cuMemGetInfo`.
    use super::DeviceMemory;
    use crate::ExecError;
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::cuda_backend::CudaDevice;

    fn fail(what: &str, e: impl std::fmt::Debug) -> ExecError {
        ExecError::Internal(format!("measuring device memory: {what}: {e:?}"))
    }

    fn pool(d: &CudaDevice) -> Result<sys::CUmemoryPool, ExecError> {
        let ctx = d.cuda_stream().context().clone();
        ctx.bind_to_thread().map_err(|e| fail("binding the context", e))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: a valid device of a live context; `pool` is written by the call.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
            .result()
            .map_err(|e| fail("cuDeviceGetDefaultMemPool", e))?;
        Ok(pool)
    }

    const HIGH: [sys::CUmemPool_attribute; 2] = [
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
    ];

    pub(super) fn reset(d: &CudaDevice) -> Result<(), ExecError> {
        let pool = pool(d)?;
        for attr in HIGH {
            let mut zero: u64 = 0;
            // SAFETY: the high-water attributes take a cuuint64_t, and 0 is the only value
            // they accept (a reset).
            unsafe { sys::cuMemPoolSetAttribute(pool, attr, (&mut zero as *mut u64).cast()) }
                .result()
                .map_err(|e| fail("cuMemPoolSetAttribute", e))?;
        }
        Ok(())
    }

    /// Makes the default pool keep what it reserved: its release threshold is 0 by default,
    /// so every synchronisation handed freed memory back to the driver and the next step
    /// mapped it again. PyTorch's caching allocator keeps its segments; so does this.
    pub(super) fn keep_reserved(d: &CudaDevice) -> Result<(), ExecError> {
        let pool = pool(d)?;
        let mut threshold: u64 = u64::MAX;
        // SAFETY: the release threshold is a cuuint64_t read from `threshold`.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        }
        .result()
        .map_err(|e| fail("cuMemPoolSetAttribute(release threshold)", e))
    }

    pub(super) fn free(d: &CudaDevice) -> Result<(u64, u64), ExecError> {
        let ctx = d.cuda_stream().context().clone();
        let (free, total) = ctx.mem_get_info().map_err(|e| fail("cuMemGetInfo", e))?;
        Ok((free.min(total) as u64, total as u64))
    }

    pub(super) fn measure(d: &CudaDevice) -> Result<DeviceMemory, ExecError> {
        let pool = pool(d)?;
        let mut high = [0u64; 2];
        for (attr, out) in HIGH.into_iter().zip(high.iter_mut()) {
            // SAFETY: both attributes are cuuint64_t values written into `out`.
            unsafe { sys::cuMemPoolGetAttribute(pool, attr, (out as *mut u64).cast()) }
                .result()
                .map_err(|e| fail("cuMemPoolGetAttribute", e))?;
        }
        let (free, total) = d
            .cuda_stream()
            .context()
            .mem_get_info()
            .map_err(|e| fail("cuMemGetInfo", e))?;
        Ok(DeviceMemory {
            allocated_peak: high[0],
            reserved_peak: high[1],
            in_use: (total - free.min(total)) as u64,
            total: total as u64,
        })
    }
}

#[cfg(feature = "cuda")]
fn cuda(ordinal: usize) -> Result<Device, ExecError> {
    // One stream for every thread. `Device::new_cuda` gives each calling thread its own
    // per-thread default stream and nothing orders those streams, so a rank's compute
    // thread could read a buffer its all-gather thread's kernels are still writing. On one
    // shared stream, device order is launch order, which the plan's record/wait orders.
    let device = Device::new_cuda_with_stream(ordinal).map_err(|e| {
        // candle appends a backtrace when RUST_BACKTRACE is set; the first line is the cause.
        let cause = e.to_string();
        let cause = cause.lines().next().unwrap_or_default().to_string();
        ExecError::Unsupported(format!(
            "cannot open CUDA device {ordinal}: {cause} (is there an NVIDIA GPU and driver here?)"
        ))
    })?;
    if let Device::Cuda(d) = &device {
        cuda_memory::keep_reserved(d)?;
    }
    Ok(device)
}

#[cfg(not(feature = "cuda"))]
fn cuda(ordinal: usize) -> Result<Device, ExecError> {
    Err(ExecError::Unsupported(format!(
        "device `cuda:{ordinal}`: this shardplan was built without CUDA support; build one with \
         `scripts/build-cuda.sh` (see docs/src/gpu.md) or use `--device cpu`"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(matches!(open("cpu"), Ok(Device::Cpu)));
        for bad in ["gpu", "cuda:x", "cuda:", "cuda0", ""] {
            let e = open(bad).unwrap_err().to_string();
            assert!(e.contains("unknown device") && e.contains("cuda:N"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_cpu_has_no_device_memory_to_measure() {
        reset_peaks(&Device::Cpu).unwrap();
        assert_eq!(measure(&Device::Cpu).unwrap(), None);
        assert_eq!(free_memory(&Device::Cpu).unwrap(), None);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_build_it() {
        for spec in ["cuda", "cuda:1"] {
            let e = open(spec).unwrap_err().to_string();
            assert!(
                e.contains("built without CUDA support") && e.contains("scripts/build-cuda.sh"),
                "{e}"
            );
        }
    }
}
