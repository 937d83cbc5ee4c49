//! Test instrumentation: the peak of device bytes in use inside a launch.

use super::*;

static PROBE_ON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

static PROBE_PEAK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Test instrumentation: while on, the launch functions record the largest number of device
/// bytes in use (CubeCL's count of live allocations, not its cached pool pages) at the points
/// where all of a call's buffers are alive. Off by default: then it costs one atomic load.
pub fn set_memory_probe(on: bool) {
    PROBE_PEAK.store(0, std::sync::atomic::Ordering::SeqCst);
    PROBE_ON.store(on, std::sync::atomic::Ordering::SeqCst);
}

/// The peak recorded since [`set_memory_probe`] switched the probe on.
pub fn memory_probe_peak() -> u64 {
    PROBE_PEAK.load(std::sync::atomic::Ordering::SeqCst)
}

pub(crate) fn memory_probe(client: &ComputeClient<CudaRuntime>) {
    if PROBE_ON.load(std::sync::atomic::Ordering::Relaxed) {
        if let Ok(u) = client.memory_usage() {
            PROBE_PEAK.fetch_max(u.bytes_in_use, std::sync::atomic::Ordering::SeqCst);
        }
    }
}
