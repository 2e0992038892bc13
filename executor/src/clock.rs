//! Where a stream's time is read. On the CPU an instruction's time is the host's: the
//! stream thread does the work while it runs. On a GPU the host only launches work, so its
//! clock measures launches; the time of the work itself is read from CUDA events recorded
//! on the CUDA stream the work was issued to, before and after it, and resolved once the
//! step has ended (the step's one host wait), without `CUDA_LAUNCH_BLOCKING`.
//!
//! Every event of a step is measured from one origin event recorded on the compute stream
//! when the step starts, so the streams' marks lie on one device timeline, placed at the
//! host's wall time of that origin (the device is idle then: the previous step ended with
//! the host waiting for it).

use crate::ExecError;
use candle_core::Device;

/// A point in a stream's work: the host's wall time (seconds since the Unix epoch), or a
/// CUDA event recorded on the stream.
pub enum Mark {
    Host(f64),
    #[cfg(feature = "cuda")]
    Device(candle_core::cuda_backend::cudarc::driver::CudaEvent),
}

/// The host's wall time, in seconds since the Unix epoch.
pub fn wall_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The clock of one stream: the host's, or a CUDA stream's events.
#[derive(Clone)]
pub enum Clock {
    Host,
    #[cfg(feature = "cuda")]
    Device(std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>),
}

impl Clock {
    /// The compute clock of `device`: candle's stream on a GPU, the host on the CPU.
    pub fn of_device(device: &Device) -> Self {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            return Clock::Device(d.cuda_stream());
        }
        let _ = device;
        Clock::Host
    }

    /// Whether marks are read on the device.
    pub fn is_device(&self) -> bool {
        !matches!(self, Clock::Host)
    }

    /// A mark after the work issued to this clock's stream so far.
    pub fn mark(&self) -> Result<Mark, ExecError> {
        match self {
            Clock::Host => Ok(Mark::Host(wall_seconds())),
            #[cfg(feature = "cuda")]
            Clock::Device(s) => s
                .record_event(Some(
                    candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT,
                ))
                .map(Mark::Device)
                .map_err(|e| ExecError::Internal(format!("recording a timing event: {e:?}"))),
        }
    }
}

/// A step's time origin: a mark on the compute clock and the host's wall time when it was
/// made.
pub struct Origin {
    mark: Mark,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    wall: f64,
}

impl Origin {
    pub fn new(clock: &Clock) -> Result<Self, ExecError> {
        let wall = wall_seconds();
        Ok(Origin {
            mark: clock.mark()?,
            wall,
        })
    }

    /// `m` in seconds since the Unix epoch. A device mark waits for its event, so call this
    /// after the step's work has been waited for.
    pub fn seconds(&self, m: &Mark) -> Result<f64, ExecError> {
        match (m, &self.mark) {
            (Mark::Host(t), _) => Ok(*t),
            #[cfg(feature = "cuda")]
            (Mark::Device(e), Mark::Device(o)) => o
                .elapsed_ms(e)
                .map(|ms| self.wall + f64::from(ms) / 1e3)
                .map_err(|x| ExecError::Internal(format!("reading a timing event: {x:?}"))),
            #[cfg(feature = "cuda")]
            (Mark::Device(_), Mark::Host(_)) => Err(ExecError::Internal(
                "a device timing mark measured against a host origin".into(),
            )),
        }
    }

    /// The seconds between two marks.
    pub fn between(&self, start: &Mark, end: &Mark) -> Result<f64, ExecError> {
        Ok(self.seconds(end)? - self.seconds(start)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpus_clock_is_the_hosts() {
        let c = Clock::of_device(&Device::Cpu);
        assert!(!c.is_device());
        let o = Origin::new(&c).unwrap();
        let a = c.mark().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let b = c.mark().unwrap();
        let (sa, sb) = (o.seconds(&a).unwrap(), o.seconds(&b).unwrap());
        assert!(sa >= o.wall && sb > sa, "{} {sa} {sb}", o.wall);
        assert!(o.between(&a, &b).unwrap() >= 0.004);
    }
}
