//! Device detection: which CUDA GPUs exist and whether the CubeCL CUDA runtime starts there
//! (`backend::status`, re-exported here as the public path).

pub use crate::backend::status::{backend_status, devices, BackendStatus, DeviceInfo};
