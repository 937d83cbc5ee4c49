//! CUDA backend: CubeCL kernels launched on the CubeCL CUDA runtime.
//!
//! One process-wide client (created lazily; creation failures, including CubeCL's panics when the
//! driver, NVRTC or the CUDA headers are missing, become `Error::BackendUnavailable`).
//! Supported: forward for f16/bf16 (tensor-core flash kernel) and f32 (plain row-wise kernel),
//! head_dim 64 and 128. Backward (dQ, dK, dV): see `backward`.

pub mod backward;
pub mod bench;
mod device_io;
pub use device_io::{DeviceBackward, DeviceForward};
mod options;
mod plan;
mod probe;
mod status;

pub use options::{fwd_options, set_fwd_options, FwdOptions};
pub(crate) use options::use_ldmatrix;
pub use plan::{forward_workspace_bytes, FwdPlan};
pub(crate) use plan::{table_bytes, upload_table, Plan, PlanDev};
pub use probe::{memory_probe_peak, set_memory_probe};
pub(crate) use probe::memory_probe;
pub use status::status;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::*;
use cubecl::server::Handle;
use half::{bf16, f16};

use crate::backend::{Backend, BackendKind, BackwardInputs, ForwardOutput, Gradients};
use crate::device::{BackendStatus, DeviceInfo};
use crate::dtype::{DType, HostData, HostView};
use crate::error::{Error, Result};
use crate::kernels::flash_fwd::{self, BLOCK_M, BLOCK_N, COMB_WORDS, LOAD_VEC, NONE, PLANES, SLICE_WORDS, WORK_WORDS};
use crate::kernels::rowwise_fwd::{self, ROWS_PER_CUBE};
use crate::spec::AttnSpec;

/// head_dims with a CUDA kernel.
pub const SUPPORTED_HEAD_DIMS: [usize; 2] = [64, 128];

/// The CUDA backend: a CubeCL client on one device.
pub struct CudaBackend {
    client: ComputeClient<CudaRuntime>,
    /// The device's primary context (the one CubeCL and torch use), as an address, for the
    /// device-to-device copies of [`device_io`].
    ctx: usize,
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
    // SAFETY: only probes whether the shared library can be opened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
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
            let ctx = unsafe {
                let dev = cudarc::driver::result::device::get(index as i32).map_err(|e| format!("cuDeviceGet: {e:?}"))?;
                cudarc::driver::result::primary_ctx::retain(dev).map_err(|e| format!("cuDevicePrimaryCtxRetain: {e:?}"))?
            };
            Ok(CudaBackend { client, ctx: ctx as usize })
        });
        match r {
            Ok(b) => Ok(b),
            Err(e) if e.starts_with("no CUDA device") => Err(crate::error::invalid("device", e.clone())),
            Err(e) => Err(unavailable(e.clone())),
        }
    }

    /// The CubeCL client (for benchmarks and tests that keep data on the device).
    pub fn client(&self) -> &ComputeClient<CudaRuntime> {
        &self.client
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
        self.forward_impl(spec, q, k, v, Some(poison))
    }

    fn forward_impl(
        &self,
        spec: &AttnSpec,
        q: HostView,
        k: HostView,
        v: HostView,
        poison: Option<f32>,
    ) -> Result<ForwardOutput> {
        crate::backend::check_buffers(spec, q, k, v)?;
        check_supported(spec)?;
        let d = &spec.dims;
        if d.total_q == 0 || d.heads_q == 0 {
            return Ok(ForwardOutput { out: HostData::from_f32(spec.dtype, &[]), lse: Vec::new() });
        }
        let client = &self.client;
        let esize = spec.dtype.size();
        let upload = |h: HostView| -> Handle {
            if h.is_empty() {
                client.empty(esize)
            } else {
                client.create_from_slice(h.as_bytes())
            }
        };
        let run = guarded("CubeCL launch", || -> Result<ForwardOutput> {
            let qh = upload(q);
            let kh = upload(k);
            let vh = upload(v);
            let (out_h, lse_h) = match poison {
                Some(p) => {
                    let out = HostData::from_f32(spec.dtype, &vec![p; d.q_len()]);
                    let lse = vec![p; d.lse_len()];
                    (
                        client.create_from_slice(out.view().as_bytes()),
                        client.create_from_slice(bytemuck::cast_slice(&lse)),
                    )
                }
                None => (client.empty(d.q_len() * esize), client.empty(d.lse_len() * 4)),
            };
            plan_and_launch_forward(client, spec, [&qh, &kh, &vh], &out_h, &lse_h)?;
            let ob = client
                .read_one(out_h)
                .map_err(|e| Error::Device(format!("forward kernel failed: {e:?}")))?;
            let lb = client
                .read_one(lse_h)
                .map_err(|e| Error::Device(format!("forward kernel failed: {e:?}")))?;
            let out = HostData::from_bytes(spec.dtype, &ob);
            let lse: Vec<f32> = bytemuck::pod_collect_to_vec(&lb);
            Ok(ForwardOutput { out, lse })
        });
        match run {
            Ok(r) => r,
            Err(msg) => Err(Error::Device(msg)),
        }
    }
}

/// Err(Unsupported) for what no CUDA kernel serves.
pub fn check_supported(spec: &AttnSpec) -> Result<()> {
    let hd = spec.dims.head_dim;
    if !SUPPORTED_HEAD_DIMS.contains(&hd) {
        return Err(Error::Unsupported {
            backend: "cuda",
            msg: format!("head_dim {hd} has no CUDA kernel (supported: 64, 128); use the CPU backend"),
        });
    }
    let d = &spec.dims;
    let big = (d.total_q.max(d.total_k) as u64) * (d.heads_q.max(d.heads_kv) as u64);
    if big >= (1u64 << 31) / 256 {
        return Err(Error::Unsupported {
            backend: "cuda",
            msg: format!("tensors too large for 32-bit row indexing ({} rows x {} heads)", d.total_q.max(d.total_k), d.heads_q),
        });
    }
    Ok(())
}

fn buf(h: &Handle, len: usize) -> ArrayArg<CudaRuntime> {
    // SAFETY: every handle passed here was allocated with at least `len` elements.
    unsafe { ArrayArg::from_raw_parts(h.clone(), len) }
}

/// A device table uploaded with [`upload_table`] (handle, element count) as a kernel argument.
fn table(h: &(Handle, usize)) -> ArrayArg<CudaRuntime> {
    buf(&h.0, h.1)
}

/// Builds the launch plan of `spec`, uploads its tables and launches the forward kernels.
fn plan_and_launch_forward(
    client: &ComputeClient<CudaRuntime>,
    spec: &AttnSpec,
    [q, k, v]: [&Handle; 3],
    out: &Handle,
    lse: &Handle,
) -> Result<()> {
    let plan = Plan::new(spec);
    let dev = plan.upload(client);
    launch_forward(client, spec, &plan, &dev, q, k, v, out, lse)
}

/// Launches the forward kernels (the zero-fill of uncovered rows first when there are any).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_forward(
    client: &ComputeClient<CudaRuntime>,
    spec: &AttnSpec,
    plan: &Plan,
    dev: &PlanDev,
    q: &Handle,
    k: &Handle,
    v: &Handle,
    out: &Handle,
    lse: &Handle,
) -> Result<()> {
    let d = &spec.dims;
    let hd = d.head_dim;
    let (ql, kl) = (d.q_len(), d.kv_len().max(1));
    match spec.dtype {
        DType::F32 => {
            let cubes = d.total_q.div_ceil(ROWS_PER_CUBE) as u32;
            rowwise_fwd::rowwise_fwd_f32::launch::<CudaRuntime>(
                client,
                CubeCount::Static(cubes, d.heads_q as u32, 1),
                CubeDim::new_1d(32 * ROWS_PER_CUBE as u32),
                buf(q, ql),
                buf(k, kl),
                buf(v, kl),
                buf(out, ql),
                buf(lse, d.lse_len()),
                table(&dev.row_seg),
                table(&dev.segs),
                spec.scale,
                d.heads_q as u32,
                d.heads_kv as u32,
                d.total_q as u32,
                f32::INFINITY,
                hd,
                spec.causal,
            );
        }
        DType::F16 | DType::BF16 => {
            if spec.uncovered_rows() > 0 {
                let n = ql.max(d.lse_len());
                let cubes = n.div_ceil(256) as u32;
                match spec.dtype {
                    DType::F16 => {
                        flash_fwd::fill_uncovered::launch::<f16, CudaRuntime>(
                            client,
                            CubeCount::Static(cubes, 1, 1),
                            CubeDim::new_1d(256),
                            buf(out, ql),
                            buf(lse, d.lse_len()),
                            f32::INFINITY,
                        )
                    },
                    _ => {
                        flash_fwd::fill_uncovered::launch::<bf16, CudaRuntime>(
                            client,
                            CubeCount::Static(cubes, 1, 1),
                            CubeDim::new_1d(256),
                            buf(out, ql),
                            buf(lse, d.lse_len()),
                            f32::INFINITY,
                        )
                    },
                }
            }
            let fp = &plan.fwd;
            let n_work = fp.n_work() as u32;
            if n_work == 0 {
                return Ok(());
            }
            let opts = fwd_options();
            let y = (d.heads_q as u32 / fp.hp).max(1);
            let count = CubeCount::Static(n_work, y, 1);
            let dim = CubeDim::new_1d(32 * PLANES as u32);
            let v5 = opts.v5 && opts.ldmatrix && opts.pipeline;
            let mt = if opts.plane_rows == 16 { 1usize } else { 2 };
            let n_part = plan.split_rows(d.heads_q);
            let part_o = client.empty(n_part * hd * 4);
            let part_lse = client.empty(n_part * 4);
            macro_rules! go {
                ($t:ty) => {{
                    // SAFETY: every index the kernels form is inside its buffer: rows and keys come
                    // from the validated spec through the plan (keys clamped to the tile's range).
                    unsafe {
                        if v5 {
                        flash_fwd::flash_fwd_mma2::launch_unchecked::<$t, CudaRuntime>(
                            client,
                            count,
                            CubeDim::new_1d((BLOCK_M * 2 / mt) as u32),
                            buf(q, ql),
                            buf(k, kl),
                            buf(v, kl),
                            buf(out, ql),
                            buf(lse, d.lse_len()),
                            buf(&part_o, n_part * hd),
                            buf(&part_lse, n_part),
                            table(&dev.fwd_work),
                            table(&dev.fwd_slices),
                            table(&dev.segs),
                            spec.scale,
                            d.heads_q as u32,
                            d.heads_kv as u32,
                            d.total_q as u32,
                            fp.hp,
                            fp.n_slots,
                            f32::INFINITY,
                            hd,
                            spec.causal,
                            mt,
                            opts.block_n as usize,
                        );
                        } else {
                        flash_fwd::flash_fwd_mma::launch_unchecked::<$t, CudaRuntime>(
                            client,
                            count,
                            dim,
                            LOAD_VEC,
                            buf(q, ql / LOAD_VEC),
                            buf(k, (kl / LOAD_VEC).max(1)),
                            buf(v, (kl / LOAD_VEC).max(1)),
                            buf(k, kl),
                            buf(v, kl),
                            buf(out, ql),
                            buf(lse, d.lse_len()),
                            buf(&part_o, n_part * hd),
                            buf(&part_lse, n_part),
                            table(&dev.fwd_work),
                            table(&dev.fwd_slices),
                            table(&dev.segs),
                            spec.scale,
                            d.heads_q as u32,
                            d.heads_kv as u32,
                            d.total_q as u32,
                            fp.hp,
                            fp.n_slots,
                            f32::INFINITY,
                            hd,
                            spec.causal,
                            opts.ldmatrix,
                            opts.pipeline,
                        );
                        }
                        if fp.n_comb() > 0 {
                            flash_fwd::combine_parts::launch_unchecked::<$t, CudaRuntime>(
                                client,
                                CubeCount::Static(fp.n_comb() as u32, y, 1),
                                dim,
                                buf(out, ql),
                                buf(lse, d.lse_len()),
                                buf(&part_o, n_part * hd),
                                buf(&part_lse, n_part),
                                table(&dev.fwd_comb),
                                table(&dev.fwd_slices),
                                table(&dev.segs),
                                d.heads_q as u32,
                                d.total_q as u32,
                                fp.hp,
                                fp.n_slots,
                                f32::INFINITY,
                                hd,
                                spec.causal,
                            );
                        }
                    }
                }};
            }
            match spec.dtype {
                DType::F16 => go!(f16),
                _ => go!(bf16),
            }
            // every buffer of the launch (split-K partials included) is alive here
            memory_probe(client);
        }
    }
    memory_probe(client);
    Ok(())
}

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn forward(&self, spec: &AttnSpec, q: HostView, k: HostView, v: HostView) -> Result<ForwardOutput> {
        self.forward_impl(spec, q, k, v, None)
    }

    fn backward(
        &self,
        spec: &AttnSpec,
        q: HostView,
        k: HostView,
        v: HostView,
        grad: BackwardInputs,
    ) -> Result<Gradients> {
        backward::backward(self, spec, q, k, v, grad, None)
    }
}

