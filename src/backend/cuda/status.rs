//! Device listing and whether the CubeCL CUDA runtime starts (never panics).

use super::*;

/// Devices as the driver reports them, and whether the CubeCL runtime starts. Never panics.
pub fn status() -> BackendStatus {
    let n = match driver_check() {
        Ok(n) => n,
        Err(reason) => {
            return BackendStatus { cuda_compiled: true, cuda_available: false, reason, devices: Vec::new() };
        }
    };
    let backend = CudaBackend::shared();
    let cubecl_ok = backend.is_ok();
    let listed = guarded("CUDA device query", || {
        use cudarc::driver::result as drv;
        use cudarc::driver::sys::CUdevice_attribute as A;
        let mut devs = Vec::new();
        for i in 0..n {
            let Ok(dev) = drv::device::get(i) else { continue };
            let name = drv::device::get_name(dev).unwrap_or_else(|_| "unknown".into());
            let attr = |a| unsafe { drv::device::get_attribute(dev, a) }.unwrap_or(0);
            let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) as u32;
            let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) as u32;
            let sms = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) as u32;
            let total = unsafe { drv::device::total_mem(dev) }.unwrap_or(0) as u64;
            // Free memory needs a current context: retain the primary one briefly.
            let free = unsafe {
                match drv::primary_ctx::retain(dev) {
                    Ok(ctx) => {
                        let f = drv::ctx::set_current(ctx).ok().and_then(|_| drv::mem_get_info().ok()).map(|(f, _)| f as u64);
                        let _ = drv::primary_ctx::release(dev);
                        f.unwrap_or(0)
                    }
                    Err(_) => 0,
                }
            };
            devs.push(DeviceInfo {
                index: i as usize,
                name,
                compute_capability: (major, minor),
                total_memory: total,
                free_memory: free,
                sm_count: sms,
                cubecl_ok: cubecl_ok && i == 0,
            });
        }
        devs
    });
    match (listed, backend) {
        (Ok(devices), Ok(_)) => BackendStatus {
            cuda_compiled: true,
            cuda_available: true,
            reason: format!("CubeCL CUDA runtime started on device 0 ({} device(s) found)", devices.len()),
            devices,
        },
        (Ok(devices), Err(e)) => BackendStatus {
            cuda_compiled: true,
            cuda_available: false,
            reason: format!("{n} CUDA device(s) found but the CubeCL runtime did not start: {e}"),
            devices,
        },
        (Err(msg), _) => BackendStatus { cuda_compiled: true, cuda_available: false, reason: msg, devices: Vec::new() },
    }
}
