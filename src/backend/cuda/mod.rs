//! CUDA backend: kernels written in CubeCL, compiled by us (CubeCL's code generator + NVRTC, cached
//! on disk: `compile`) and launched by us (`launch`) on the caller's stream with the caller's
//! device pointers (`device_io`). One backend per device, created lazily; creation failures,
//! including CubeCL's panics when the driver is missing, become `Error::BackendUnavailable`.
//! Supported: forward for f16/bf16 (tensor-core flash kernel; the exact row-wise kernel when v
//! holds a NaN or Inf, chosen on the device: `nonfinite`) and f32 (plain row-wise kernel),
//! head dims of [`head_dims_of`]. Backward (dQ, dK, dV): see `backward`. Block-sparse key sets: `sparse`,
//! `sparse_bwd` (f16/bf16). Every call, of every key set, enters through the `Backend` methods
//! (`device_io`), which dispatch on the spec's key set.

pub mod backward;
mod bench;
mod card;
mod compile;
mod device_io;
mod driver;
mod forward;
mod head_pad;
mod kernel_dump;
mod kvcache;
mod launch;
mod nonfinite;
mod plan;
mod plans;
mod rewrite;
mod sparse;
mod sparse_bwd;
mod sparse_int8;
mod status;
mod target;
mod word_copy;
mod zigzag;

pub use backward::BwdPtrs;
pub use compile::cache_dir;
pub use bench::{bench, bench_backward, BenchPart};
pub use device_io::{memory_probe_min_free, set_memory_probe};
pub use forward::FwdPtrs;
pub use kvcache::KvAppend;
pub use crate::config::{fwd_options, set_fwd_options, FwdOptions};
pub use plan::{forward_workspace_bytes, FwdPlan};
pub(crate) use plan::Plan;
pub use status::status;
pub use target::Target;
pub use zigzag::ZigzagCopy;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, OnceLock};

use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::*;

use crate::backend::{ForwardOutput, Pass};
use crate::backend::status::{BackendStatus, DeviceInfo};
use crate::dtype::HostView;
use crate::error::{Error, Result};
use crate::kernels::flash_fwd::{BLOCK_M, BLOCK_N, COMB_WORDS, NONE, SLICE_WORDS, WORK_WORDS};
use crate::kernels::rows::WIN_NONE;
use crate::spec::{AttnSpec, KeySet};

/// head_dims with a CUDA forward kernel (the mma.sync tile kernel at every one, the Hopper kernel
/// at 64 and 128; the row-wise f32 kernel at every one: each is a multiple of 32).
pub const SUPPORTED_HEAD_DIMS: [usize; 6] = [32, 64, 96, 128, 192, 256];
/// head_dims with a CUDA backward kernel on every GPU: the mma.sync dK/dV kernel keeps a cube's dK
/// and dV (128 keys x head_dim each) in registers, which above 128 do not fit.
pub const BACKWARD_HEAD_DIMS: [usize; 4] = [32, 64, 96, 128];
/// head_dims with a CUDA backward kernel where the GPU has wgmma (sm_90: `flash_bwd_sm90_split`,
/// dV and dK in different warpgroups; deterministic calls take the dQ pass):
/// [`BACKWARD_HEAD_DIMS`] and these ([`CudaBackend::check_target`]).
pub const HOPPER_BACKWARD_HEAD_DIMS: [usize; 6] = [32, 64, 96, 128, 192, 256];
/// head_dims of the block-sparse kernels (forward and backward): their tile shapes and register
/// budgets are set for these two.
pub const SPARSE_HEAD_DIMS: [usize; 2] = [64, 128];

/// The head_dims the CUDA kernels of `pass` serve on some GPU (those of a backward above 128 only
/// on sm_90: [`CudaBackend::check_target`]).
pub fn head_dims_of(pass: Pass) -> &'static [usize] {
    match pass {
        Pass::Forward => &SUPPORTED_HEAD_DIMS,
        Pass::Backward { .. } => &HOPPER_BACKWARD_HEAD_DIMS,
    }
}

/// The CUDA backend of one device: compiled kernels, cached launch plans, and a stream of its own
/// for calls on host buffers.
pub struct CudaBackend {
    /// CubeCL's client: the generated kernel structs read the device properties from it.
    client: ComputeClient<CudaRuntime>,
    /// The device's primary context (the one torch uses too), as an address.
    ctx: usize,
    /// What the kernels may use on this device (decided once, here).
    pub(crate) target: Target,
    pub(crate) kernels: compile::Kernels,
    fwd_plans: plans::PlanCache<Plan>,
    bwd_plans: plans::PlanCache<backward::BwdPlan>,
    sparse_plans: plans::PlanCache<sparse::SparsePlan>,
    sparse_bwd_plans: plans::PlanCache<sparse_bwd::SparseBwdPlan>,
    stream: driver::Stream,
    /// Serializes calls on host buffers (they share `stream`).
    host_lock: Mutex<()>,
}

/// One backend per device index, created on first use.
static SHARED: [OnceLock<std::result::Result<CudaBackend, String>>; crate::backend::MAX_DEVICES] =
    [const { OnceLock::new() }; crate::backend::MAX_DEVICES];

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Runs `f`, turning a panic into an error message (CubeCL panics on many setup failures).
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = catch_unwind(AssertUnwindSafe(f));
    std::panic::set_hook(prev);
    r.map_err(|p| format!("{what}: {}", panic_message(p)))
}

fn driver_check() -> std::result::Result<i32, String> {
    if !driver::driver_lib_present() {
        return Err("the CUDA driver library (libcuda) was not found".into());
    }
    let r = guarded("CUDA driver", || -> std::result::Result<i32, String> {
        cudarc::driver::result::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
        cudarc::driver::result::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))
    })??;
    if r <= 0 {
        return Err("the CUDA driver reports no device".into());
    }
    Ok(r)
}

fn unavailable(reason: impl Into<String>) -> Error {
    Error::BackendUnavailable { backend: "cuda", reason: reason.into() }
}

impl CudaBackend {
    /// The process-wide backend of device 0, created on first use.
    pub fn shared() -> Result<&'static CudaBackend> {
        Self::on(0)
    }

    /// The process-wide backend of CUDA device `index`, created on first use. An index the driver
    /// does not have is `Error::InvalidArgument` naming `device`.
    pub fn on(index: usize) -> Result<&'static CudaBackend> {
        let slot = SHARED.get(index).ok_or_else(|| {
            crate::error::invalid("device", format!("CUDA device index {index} is out of range"))
        })?;
        let r = slot.get_or_init(|| {
            let count = driver_check()?;
            if index >= count as usize {
                return Err(format!("no CUDA device {index}: the driver reports {count}"));
            }
            let client = guarded("CubeCL CUDA runtime", || CudaRuntime::client(&CudaDevice::new(index)))?;
            // SAFETY: `index` is below the driver's device count (checked above).
            let (ctx, target) = unsafe {
                use cudarc::driver::result as drv;
                let dev = drv::device::get(index as i32).map_err(|e| format!("cuDeviceGet: {e:?}"))?;
                let ctx = drv::primary_ctx::retain(dev).map_err(|e| format!("cuDevicePrimaryCtxRetain: {e:?}"))?;
                (ctx as usize, Target::of_device(dev))
            };
            driver::bind(ctx).map_err(|e| e.to_string())?;
            let stream = driver::Stream::new().map_err(|e| e.to_string())?;
            Ok(CudaBackend {
                client,
                ctx,
                target,
                kernels: compile::Kernels::new(ctx, target),
                fwd_plans: plans::PlanCache::new(ctx),
                bwd_plans: plans::PlanCache::new(ctx),
                sparse_plans: plans::PlanCache::new(ctx),
                sparse_bwd_plans: plans::PlanCache::new(ctx),
                stream,
                host_lock: Mutex::new(()),
            })
        });
        match r {
            Ok(b) => Ok(b),
            Err(e) if e.starts_with("no CUDA device") => Err(crate::error::invalid("device", e.clone())),
            Err(e) => Err(unavailable(e.clone())),
        }
    }

    /// What the kernels may use on this device ([`Target`]).
    pub fn target(&self) -> Target {
        self.target
    }

    /// Err(Unsupported) for what no kernel serves on this GPU though one does elsewhere: a backward
    /// above head_dim 128 needs the Hopper kernel (`backward::SPLIT_BWD_HEAD_DIMS`: wgmma, f16/bf16, the
    /// Hopper switch on).
    pub fn check_target(&self, spec: &AttnSpec, pass: Pass) -> Result<()> {
        let hd = spec.dims.head_dim;
        if matches!(pass, Pass::Backward { .. }) && backward::SPLIT_BWD_HEAD_DIMS.contains(&hd) && !forward::sm90_forward(self, spec) {
            return Err(Error::Unsupported {
                backend: "cuda",
                msg: format!(
                    "head_dim {hd} backward needs the Hopper kernel (sm_90 with wgmma, float16 / bfloat16; here: sm_{}{}{}, {}{}); use the CPU backend",
                    self.target.major,
                    self.target.minor,
                    if self.target.portable { " portable" } else { "" },
                    spec.dtype.name(),
                    if crate::config::fwd_options().sm90 { "" } else { ", CUBEATTN_CUDA_SM90=0" }
                ),
            });
        }
        if let Some(s) = spec.block_sparse() {
            if s.int8.is_some_and(|o| o.pv_fp8) && !matches!(sparse::SparseFrame::of(self, s), sparse::SparseFrame::Sm90 { .. }) {
                return Err(Error::Unsupported {
                    backend: "cuda",
                    msg: format!(
                        "pv_precision=\"fp8\" (FP8 P.V) runs on the Hopper kernel only: sm_90 with wgmma, float16 / bfloat16, head_dim 128, query blocks of 128 packed rows (q_block x the heads packed per index row a multiple of 128), k_block a multiple of 64 (here: sm_{}{}, head_dim {hd}, q_block {}, k_block {}); use the CPU backend",
                        self.target.major, self.target.minor, s.q_block, s.k_block
                    ),
                });
            }
        }
        Ok(())
    }

    /// [`check_supported`] and [`Self::check_target`]: whether this GPU runs `pass` of `spec` (a
    /// head_dim without a kernel of its own: whether it runs the padded spec, `head_pad`).
    pub fn check(&self, spec: &AttnSpec, pass: Pass) -> Result<()> {
        self.check_padded(spec, pass).map(drop)
    }

    /// [`Self::check`], returning the padded spec the kernels run where they run one (`head_pad`):
    /// the one place a call's padding is decided.
    pub(crate) fn check_padded(&self, spec: &AttnSpec, pass: Pass) -> Result<Option<AttnSpec>> {
        let exact = |s: &AttnSpec| {
            check_kernel_spec(s, pass)?;
            self.check_target(s, pass)
        };
        match head_pad::padded(spec, pass, head_pad::wgmma_padding(Some(self), spec)) {
            Some(ps) => head_pad::check_as(spec, &ps, exact).map(|()| Some(ps)),
            None => exact(spec).map(|()| None),
        }
    }

    /// The CubeCL client (code generation reads the device properties from it).
    pub(crate) fn client(&self) -> &ComputeClient<CudaRuntime> {
        &self.client
    }

    /// (free, total) device memory as the driver reports it.
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        driver::bind(self.ctx)?;
        driver::mem_info()
    }

    /// Kernels compiled with NVRTC by this process (the others came from the disk cache).
    pub fn kernels_compiled(&self) -> usize {
        self.kernels.compiled_count()
    }

    /// Launch plans cached (forward, backward).
    pub fn plans_cached(&self) -> (usize, usize) {
        (self.fwd_plans.len(), self.bwd_plans.len())
    }

    /// Forward pass that first fills `out` and `lse` with `poison` (tests use NaN to prove that
    /// every element is written by the kernels).
    pub fn forward_poisoned(
        &self,
        spec: &AttnSpec,
        q: HostView,
        k: HostView,
        v: HostView,
        poison: f32,
    ) -> Result<ForwardOutput> {
        self.forward_host(spec, q, k, v, Some(poison))
    }
}

/// Each row's key range as the kernels take it (`kernels::rows`): key bounds left and right of
/// the row's diagonal, the causal bound included (right 0 with causal, [`WIN_NONE`] for an
/// unbounded side), and whether a sliding window is set (the dK/dV and dQ kernels then compile
/// their per-element window masks).
pub(crate) fn window_bounds(spec: &AttnSpec) -> (u32, u32, bool) {
    let side = |x: Option<usize>| x.map_or(WIN_NONE, |v| v.min(WIN_NONE as usize) as u32);
    let right = if spec.causal { 0 } else { side(spec.window.right) };
    (side(spec.window.left), right, !spec.window.is_none())
}

/// Whether a dense launch's cubes go kv head outer by default (`grid::cube_item_slot`): on the
/// Hopper kernels (`hopper`), for calls without a causal mask or window, whose work items all cost
/// the same; the cubes running at once then share one kv head's tensors in L2. The forward
/// (`forward::kv_outer`), the dK/dV kernels and the dQ pass (`backward::kv_outer`) take it, each
/// behind its own override.
pub(crate) fn kv_outer_default(spec: &AttnSpec, hopper: bool) -> bool {
    hopper && !spec.causal && spec.window.is_none()
}

/// Err(Unsupported) for what no CUDA kernel serves on any GPU: `pass` of `spec`, of any key set
/// (the block-sparse conditions: `sparse::check_supported`, `sparse_bwd::check_supported`; what
/// one GPU lacks: [`CudaBackend::check_target`]). A head_dim without a kernel of its own is
/// served when the padded spec is (`head_pad`).
pub fn check_supported(spec: &AttnSpec, pass: Pass) -> Result<()> {
    match head_pad::padded(spec, pass, false) {
        Some(ps) => head_pad::check_as(spec, &ps, |s| check_kernel_spec(s, pass)),
        None => check_kernel_spec(spec, pass),
    }
}

/// [`check_supported`] of a spec the kernels run as it is (its head_dim one of theirs).
fn check_kernel_spec(spec: &AttnSpec, pass: Pass) -> Result<()> {
    spec.check_pass(pass)?;
    let hd = spec.dims.head_dim;
    if !spec.dims.is_uniform() && !head_pad::value_dim_native(spec, pass, hd) {
        // (`head_pad::padded` gives such calls one head_dim wherever a kernel is wide enough, or
        // leaves v's to the Hopper kernels that run it: `head_pad::value_dim_native`)
        return Err(Error::Unsupported {
            backend: "cuda",
            msg: format!("v's head_dim {} differs from q's and k's {hd}, and no CUDA kernel runs both; use the CPU backend", spec.dims.head_dim_v),
        });
    }
    let dims = head_dims_of(pass);
    if !dims.contains(&hd) {
        let what = if matches!(pass, Pass::Forward) { "forward" } else { "backward" };
        return Err(Error::Unsupported {
            backend: "cuda",
            msg: format!("head_dim {hd} has no CUDA {what} kernel (supported: {dims:?}); use the CPU backend"),
        });
    }
    check_size(spec, spec.keys != KeySet::Dense)?;
    match (spec.block_sparse(), pass) {
        (Some(s), Pass::Forward) => sparse::check_supported(s),
        (Some(s), Pass::Backward { .. }) => sparse_bwd::check_supported(s),
        (None, _) => Ok(()),
    }
}

/// Err(Unsupported) when the tensors of `spec` reach the CUDA kernels' indexing bound: elements
/// (rows x heads x head_dim of the largest of q, k, v, their gradients and the f32 dQ
/// accumulator) below 2^31, since their indexes are u32 (`AddressType::U32`) and every product
/// of row, head and column is such an element index. Dense calls were checked on an H200 up to
/// 1.9e9 elements (`tests/python/test_large_gpu.py`); `paged_or_sparse` calls (paged K,V,
/// block-sparse) keep the earlier bound of 2^30.
fn check_size(spec: &AttnSpec, paged_or_sparse: bool) -> Result<()> {
    let d = &spec.dims;
    let (rows, heads, hd) = (d.total_q.max(d.total_k) as u64, d.heads_q.max(d.heads_kv) as u64, d.head_dim as u64);
    let bound: u64 = if paged_or_sparse { 1 << 30 } else { 1 << 31 };
    if rows * heads * hd >= bound {
        return Err(Error::Unsupported {
            backend: "cuda",
            msg: format!("tensors too large for 32-bit indexing ({rows} rows x {heads} heads x head_dim {hd} elements)"),
        });
    }
    Ok(())
}
