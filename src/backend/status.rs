//! What the CUDA side can do in this process: the devices the driver reports and whether the
//! CubeCL CUDA runtime starts there. Never panics: without the `cuda` feature, without libcuda or
//! without a GPU the list is empty and [`backend_status`] says why. (`crate::device` is the public
//! path of the same items.)


/// One CUDA device as the driver reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceInfo {
    pub index: usize,
    pub name: String,
    /// (major, minor)
    pub compute_capability: (u32, u32),
    pub total_memory: u64,
    pub free_memory: u64,
    pub sm_count: u32,
    /// Whether a CubeCL CUDA client could be created on this device.
    pub cubecl_ok: bool,
}

/// What the CUDA side can do in this process.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendStatus {
    /// The `cuda` feature was compiled in.
    pub cuda_compiled: bool,
    /// The CUDA backend can run kernels now.
    pub cuda_available: bool,
    /// Human-readable reason, always set.
    pub reason: String,
    pub devices: Vec<DeviceInfo>,
}

/// Lists CUDA devices (empty when none can be seen, for any reason).
pub fn devices() -> Vec<DeviceInfo> {
    backend_status().devices
}

/// The CUDA backend's state and the reason for it.
pub fn backend_status() -> BackendStatus {
    #[cfg(feature = "cuda")]
    {
        super::cuda::status()
    }
    #[cfg(not(feature = "cuda"))]
    {
        BackendStatus {
            cuda_compiled: false,
            cuda_available: false,
            reason: "built without the `cuda` feature: only the CPU backend is present".into(),
            devices: Vec::new(),
        }
    }
}
