//! What the kernels of one device may use, decided once when its backend starts: the one answer
//! to "is this Hopper" that every kernel choice, NVRTC option and shared-memory check asks.
//!
//! The generated sources also hold device-side guards (`#if __CUDA_ARCH__ >= 900 &&
//! !defined(CUBEATTN_PORTABLE)` around `try_wait` and `stmatrix`, `rewrite`): they test the same
//! condition as [`Target::stmatrix`] on the architecture NVRTC compiles for, with
//! `CUBEATTN_PORTABLE` defined exactly when [`Target::portable`] ([`Target::nvrtc_defines`]).

/// The features of one device the kernels are built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// Compute capability.
    pub major: u32,
    pub minor: u32,
    /// Shared memory one block may use (the opt-in limit, bytes; 0: unknown, not checked).
    pub smem_limit: u32,
    /// `CUBEATTN_CUDA_PORTABLE=1` (`crate::config`): every kernel built as for GPUs below sm_90, on
    /// any GPU (how the pre-Hopper code paths are run and tested on a Hopper GPU): none of the
    /// features below.
    pub portable: bool,
    /// Tensor maps and `cp.async.bulk` tile copies (sm_90+).
    pub tma: bool,
    /// `cp.reduce.async.bulk` adds of shared tiles into global memory (`kernels::bulk_reduce`, sm_90+).
    pub bulk_reduce: bool,
    /// float2 `atomicAdd` (sm_90+).
    pub float2_atomics: bool,
    /// `stmatrix` and `mbarrier.try_wait` (sm_90+; the generated sources choose them with their own
    /// `#if`, module docs).
    pub stmatrix: bool,
    /// `wgmma.mma_async` (sm_90a only: Blackwell has no wgmma), so the Hopper forward
    /// (`kernels::flash_fwd_sm90`).
    pub wgmma: bool,
}

impl Target {
    /// The target of a device of compute capability `major.minor` with `smem_limit` bytes of
    /// shared memory per block; `portable`: built as for GPUs below sm_90.
    pub fn new(major: u32, minor: u32, smem_limit: u32, portable: bool) -> Target {
        let sm90 = major >= 9 && !portable;
        Target {
            major,
            minor,
            smem_limit,
            portable,
            tma: sm90,
            bulk_reduce: sm90,
            float2_atomics: sm90,
            stmatrix: sm90,
            wgmma: sm90 && major == 9,
        }
    }

    /// The target of CUDA device `dev` (its attributes; unknown ones as 0) and this process's
    /// `CUBEATTN_CUDA_PORTABLE`.
    ///
    /// # Safety
    /// `dev` must be a device handle of the initialised driver.
    pub(crate) unsafe fn of_device(dev: cudarc::driver::sys::CUdevice) -> Target {
        use cudarc::driver::result::device::get_attribute;
        use cudarc::driver::sys::CUdevice_attribute as A;
        // SAFETY: the caller passes a valid device of the initialised driver.
        let attr = |a| unsafe { get_attribute(dev, a) }.unwrap_or(0).max(0) as u32;
        Target::new(
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            crate::config::get().portable,
        )
    }

    /// The architecture NVRTC compiles for: `sm_90a` from sm_90 on (wgmma and setmaxnreg need
    /// the architecture-specific target; the portable build too, which then leaves them out),
    /// `sm_XY` below.
    pub fn arch(&self) -> String {
        let (major, minor) = (self.major, self.minor);
        if major >= 9 { format!("sm_{major}{minor}a") } else { format!("sm_{major}{minor}") }
    }

    /// The preprocessor definitions the generated sources read: `CUBEATTN_PORTABLE` in the
    /// portable build (the `test_wait` spin and the `stmatrix`-free P / dS stores of the
    /// `rewrite`s). Part of the NVRTC options, so of the disk-cache key.
    pub fn nvrtc_defines(&self) -> Vec<String> {
        if self.portable { vec!["-DCUBEATTN_PORTABLE".into()] } else { Vec::new() }
    }
}

#[cfg(test)]
mod tests {
    use super::Target;

    #[test]
    fn hopper_features_from_sm90_unless_portable() {
        let h100 = Target::new(9, 0, 232_448, false);
        assert!(h100.tma && h100.bulk_reduce && h100.float2_atomics && h100.stmatrix && h100.wgmma);
        assert_eq!((h100.arch(), h100.nvrtc_defines()), ("sm_90a".to_string(), vec![]));
        let a100 = Target::new(8, 0, 166_912, false);
        assert!(!a100.tma && !a100.bulk_reduce && !a100.float2_atomics && !a100.stmatrix && !a100.wgmma);
        assert_eq!(a100.arch(), "sm_80");
        let portable = Target::new(9, 0, 232_448, true);
        assert!(!portable.tma && !portable.bulk_reduce && !portable.float2_atomics && !portable.stmatrix && !portable.wgmma);
        assert_eq!((portable.arch(), portable.nvrtc_defines()), ("sm_90a".to_string(), vec!["-DCUBEATTN_PORTABLE".to_string()]));
        // Blackwell keeps the sm_90 copy engine but has no wgmma: the mma.sync forward
        let b200 = Target::new(10, 0, 232_448, false);
        assert!(b200.tma && b200.bulk_reduce && b200.stmatrix && !b200.wgmma);
        assert_eq!(b200.arch(), "sm_100a");
    }
}
