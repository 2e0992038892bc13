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

#[cfg(feature = "cuda")]
fn cuda(ordinal: usize) -> Result<Device, ExecError> {
    // One stream for every thread. `Device::new_cuda` gives each calling thread its own
    // per-thread default stream and nothing orders those streams, so a rank's compute
    // thread could read a buffer its all-gather thread's kernels are still writing. On one
    // shared stream, device order is launch order, which the plan's record/wait orders.
    Device::new_cuda_with_stream(ordinal).map_err(|e| {
        // candle appends a backtrace when RUST_BACKTRACE is set; the first line is the cause.
        let cause = e.to_string();
        let cause = cause.lines().next().unwrap_or_default().to_string();
        ExecError::Unsupported(format!(
            "cannot open CUDA device {ordinal}: {cause} (is there an NVIDIA GPU and driver here?)"
        ))
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda(ordinal: usize) -> Result<Device, ExecError> {
    Err(ExecError::Unsupported(format!(
        "device `cuda:{ordinal}`: this shardplan was built without CUDA support; build one with \
         `scripts/build-cuda.sh` (see the README's GPU section) or use `--device cpu`"
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
