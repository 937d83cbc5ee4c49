//! The few CUDA driver calls the backend makes itself (through cudarc): device memory, copies,
//! streams, events, capture status. Each returns `Error::Device` naming the call that failed.

use cudarc::driver::{result as drv, sys};

use crate::error::{Error, Result};

pub(crate) fn err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Device(format!("{what}: {e:?}"))
}

/// Whether the CUDA driver library (libcuda) can be loaded. cudarc loads it at run time, on first
/// use, except with `candle-cuda`: candle-core turns on cudarc's `dynamic-linking`, so the program
/// is linked against it and cannot start without it.
pub(crate) fn driver_lib_present() -> bool {
    #[cfg(not(feature = "candle-cuda"))]
    // SAFETY: only probes whether the shared library can be opened.
    return unsafe { cudarc::driver::sys::is_culib_present() };
    #[cfg(feature = "candle-cuda")]
    true
}

/// Whether NVRTC (libnvrtc) can be loaded; linked like the driver with `candle-cuda`.
pub(crate) fn nvrtc_lib_present() -> bool {
    #[cfg(not(feature = "candle-cuda"))]
    // SAFETY: only probes whether the shared library can be opened.
    return unsafe { cudarc::nvrtc::sys::is_culib_present() };
    #[cfg(feature = "candle-cuda")]
    true
}

/// Makes the primary context `ctx` current on this thread.
pub(crate) fn bind(ctx: usize) -> Result<()> {
    // SAFETY: `ctx` was returned by cuDevicePrimaryCtxRetain and is never released.
    unsafe { drv::ctx::set_current(ctx as sys::CUcontext) }.map_err(|e| err("cuCtxSetCurrent", e))
}

/// Device memory owned by the backend (freed on drop with cuMemFree).
pub(crate) struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
}

impl DevBuf {
    /// `bytes` (at least 256) of device memory in the current context. Out of memory is
    /// `Error::OutOfMemory` with the bytes asked for and the bytes free.
    pub fn alloc(bytes: usize) -> Result<DevBuf> {
        let n = bytes.max(256);
        // SAFETY: plain allocation in the current context; the memory is only handed out as an
        // address and freed once in Drop.
        match unsafe { drv::malloc_sync(n) } {
            Ok(ptr) => Ok(DevBuf { ptr, bytes: n }),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                let free = drv::mem_get_info().map(|(f, _)| f as u64).unwrap_or(0);
                Err(Error::OutOfMemory { needed: n as u64, free })
            }
            Err(e) => Err(err("cuMemAlloc", e)),
        }
    }

    /// Copies `bytes` to the start of the buffer, ordered on `stream`.
    pub fn upload(&self, bytes: &[u8], stream: sys::CUstream) -> Result<()> {
        assert!(bytes.len() <= self.bytes);
        if bytes.is_empty() {
            return Ok(());
        }
        // SAFETY: the destination holds at least `bytes.len()` bytes (asserted); the caller keeps
        // `bytes` alive until the stream has run the copy (it synchronizes before returning).
        unsafe { sys::cuMemcpyHtoDAsync_v2(self.ptr, bytes.as_ptr() as *const _, bytes.len(), stream) }
            .result()
            .map_err(|e| err("cuMemcpyHtoDAsync", e))
    }

    /// Copies the start of the buffer into `out`, ordered on `stream` (valid after a sync).
    pub fn download(&self, out: &mut [u8], stream: sys::CUstream) -> Result<()> {
        assert!(out.len() <= self.bytes);
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: the source holds at least `out.len()` bytes (asserted); `out` outlives the copy
        // (the caller synchronizes the stream before reading it).
        unsafe { sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr() as *mut _, self.ptr, out.len(), stream) }
            .result()
            .map_err(|e| err("cuMemcpyDtoHAsync", e))
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemAlloc and is freed once.
        let _ = unsafe { drv::free_sync(self.ptr) };
    }
}

/// A non-blocking stream owned by the backend (host-buffer calls and benchmarks run on it).
pub(crate) struct Stream(pub sys::CUstream);

// SAFETY: a CUstream handle may be used from any thread of the process.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new() -> Result<Stream> {
        drv::stream::create(drv::stream::StreamKind::NonBlocking).map(Stream).map_err(|e| err("cuStreamCreate", e))
    }

    pub fn sync(&self) -> Result<()> {
        // SAFETY: the stream is live until Drop.
        unsafe { drv::stream::synchronize(self.0) }.map_err(|e| err("kernel execution (cuStreamSynchronize)", e))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: destroyed once; pending work completes first (driver semantics).
        let _ = unsafe { drv::stream::destroy(self.0) };
    }
}

/// Whether `stream` is being captured into a CUDA graph.
pub(crate) fn capturing(stream: sys::CUstream) -> Result<bool> {
    // SAFETY: the caller passes a live stream handle (or 0, the legacy default stream).
    let st = unsafe { drv::stream::is_capturing(stream) }.map_err(|e| err("cuStreamIsCapturing", e))?;
    Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// (free, total) bytes of the current context's device, as the driver reports them.
pub(crate) fn mem_info() -> Result<(u64, u64)> {
    drv::mem_get_info().map(|(f, t)| (f as u64, t as u64)).map_err(|e| err("cuMemGetInfo", e))
}

/// GPU time of work on a stream, measured with a pair of events.
pub(crate) struct Timer {
    start: sys::CUevent,
    stop: sys::CUevent,
}

impl Timer {
    pub fn new() -> Result<Timer> {
        let mk = || drv::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| err("cuEventCreate", e));
        Ok(Timer { start: mk()?, stop: mk()? })
    }

    pub fn start(&self, s: sys::CUstream) -> Result<()> {
        // SAFETY: live event and stream.
        unsafe { drv::event::record(self.start, s) }.map_err(|e| err("cuEventRecord", e))
    }

    pub fn stop(&self, s: sys::CUstream) -> Result<()> {
        // SAFETY: live event and stream.
        unsafe { drv::event::record(self.stop, s) }.map_err(|e| err("cuEventRecord", e))
    }

    /// Milliseconds between start and stop (waits for stop).
    pub fn ms(&self) -> Result<f64> {
        // SAFETY: both events were recorded.
        unsafe {
            drv::event::synchronize(self.stop).map_err(|e| err("cuEventSynchronize", e))?;
            drv::event::elapsed(self.start, self.stop).map(|x| x as f64).map_err(|e| err("cuEventElapsedTime", e))
        }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        // SAFETY: destroyed once.
        unsafe {
            let _ = drv::event::destroy(self.start);
            let _ = drv::event::destroy(self.stop);
        }
    }
}

/// A stream-ordered device copy of `host` (`u32` words; one word for an empty slice). The caller
/// keeps `host` alive until the copy has run (until the memory is freed) and frees the memory with
/// `free_async` on a stream ordered after its last use. Out of memory is `Error::OutOfMemory`.
pub(crate) fn upload_u32_async(host: &[u32], stream: sys::CUstream) -> Result<sys::CUdeviceptr> {
    let bytes = host.len().max(1) * 4;
    // SAFETY: stream-ordered allocation and copy on a live stream of the current context; the
    // caller keeps `host` alive until the copy has run.
    unsafe {
        let ptr = drv::malloc_async(stream, bytes).map_err(|e| match e.0 {
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory {
                needed: bytes as u64,
                free: drv::mem_get_info().map(|(f, _)| f as u64).unwrap_or(0),
            },
            _ => err("cuMemAllocAsync", e),
        })?;
        if !host.is_empty() {
            if let Err(e) = sys::cuMemcpyHtoDAsync_v2(ptr, host.as_ptr() as *const _, host.len() * 4, stream).result() {
                let _ = drv::free_async(ptr, stream);
                return Err(err("cuMemcpyHtoDAsync", e));
            }
        }
        Ok(ptr)
    }
}

/// A tensor map of a row-major 2-D tensor of `dt` (f16 / bf16: `rows` rows of `cols` elements,
/// `row_bytes` apart, at `ptr`) whose copies are boxes of `box_rows` rows x `box_cols` columns,
/// laid out densely in shared memory (`sw128`: 128-byte swizzled, the operand layout of the Hopper
/// MMAs, `kernels::sm90`: `box_cols` x 2 bytes must then be 128 and the shared destination
/// 1024-byte aligned); elements past the tensor's edges read as zero. Needs `ptr` and `row_bytes`
/// multiples of 16 and `box_cols` x 2 bytes a multiple of 16 (the driver refuses the rest, as an
/// `Err`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn tile_map_2d(
    dt: crate::dtype::DType,
    ptr: u64,
    cols: usize,
    rows: usize,
    row_bytes: usize,
    box_cols: u32,
    box_rows: u32,
    sw128: bool,
) -> Result<sys::CUtensorMap> {
    use crate::dtype::DType;
    let ty = match dt {
        DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F32 => return Err(Error::Device("tile_map_2d: f32 tensors take no tile map".into())),
    };
    let sw = if sw128 { sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B } else { sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE };
    encode_2d(ty, ptr, cols, rows, row_bytes, box_cols, box_rows, sw)
}

/// A tensor map of a row-major 2-D tensor of bytes (`rows` rows of `cols` bytes, `row_bytes`
/// apart) whose copies are boxes of `box_rows` rows x 64 bytes, 64-byte swizzled in shared memory
/// (the FP8 K-major operand of `kernels::sm90::wgmma_rs_e4m3`; the destination 512-byte aligned).
pub(crate) fn byte_map_2d_sw64(ptr: u64, cols: usize, rows: usize, row_bytes: usize, box_rows: u32) -> Result<sys::CUtensorMap> {
    encode_2d(
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        ptr,
        cols,
        rows,
        row_bytes,
        64,
        box_rows,
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
    )
}

#[allow(clippy::too_many_arguments)]
fn encode_2d(
    ty: sys::CUtensorMapDataType,
    ptr: u64,
    cols: usize,
    rows: usize,
    row_bytes: usize,
    box_cols: u32,
    box_rows: u32,
    swizzle: sys::CUtensorMapSwizzle,
) -> Result<sys::CUtensorMap> {
    let dims = [cols as u64, rows.max(1) as u64];
    let strides = [row_bytes as u64];
    let boxes = [box_cols, box_rows];
    let elem = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every array holds the rank's (2) entries (strides: rank - 1), `map` is written by
    // the call; the address is only recorded in the map (the kernel reads through it).
    unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            ty,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()
        .map_err(|e| err("cuTensorMapEncodeTiled", e))?;
        Ok(map.assume_init())
    }
}
