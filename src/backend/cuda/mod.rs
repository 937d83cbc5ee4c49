//! CUDA backend: CubeCL kernels launched on the CubeCL CUDA runtime.
//!
//! One process-wide client (created lazily; creation failures, including CubeCL's panics when the
//! driver, NVRTC or the CUDA headers are missing, become `Error::BackendUnavailable`).
//! Supported: forward for f16/bf16 (tensor-core flash kernel) and f32 (plain row-wise kernel),
//! head_dim 64 and 128. Backward (dQ, dK, dV): see `backward`.

pub mod backward;
pub mod bench;

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
use crate::kernels::flash_fwd::{self, BLOCK_M, LOAD_VEC, PLANES};
use crate::kernels::rowwise_fwd::{self, ROWS_PER_CUBE};
use crate::spec::AttnSpec;

/// head_dims with a CUDA kernel.
pub const SUPPORTED_HEAD_DIMS: [usize; 2] = [64, 128];

/// The CUDA backend: a CubeCL client on device 0.
pub struct CudaBackend {
    client: ComputeClient<CudaRuntime>,
}

static SHARED: OnceLock<std::result::Result<CudaBackend, String>> = OnceLock::new();

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
    /// The process-wide backend (device 0), created on first use.
    pub fn shared() -> Result<&'static CudaBackend> {
        let r = SHARED.get_or_init(|| {
            driver_check()?;
            let client = guarded("CubeCL CUDA runtime", || CudaRuntime::client(&CudaDevice::new(0)))?;
            Ok(CudaBackend { client })
        });
        r.as_ref().map_err(|e| unavailable(e.clone()))
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
            let plan = Plan::new(spec);
            let dev = plan.upload(client);
            launch_forward(client, spec, &plan, &dev, &qh, &kh, &vh, &out_h, &lse_h)?;
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

/// Host-side launch plan: segment table and per-cube work list.
pub(crate) struct Plan {
    /// (q_start, q_len, k_start, k_len) per segment.
    pub segs: Vec<u32>,
    /// (segment, tile start) per cube, most expensive first (tensor-core path).
    pub work: Vec<u32>,
    /// Segment of every query row, u32::MAX when none (row-wise f32 path).
    pub row_seg: Vec<u32>,
}

impl Plan {
    pub fn new(spec: &AttnSpec) -> Plan {
        let mut segs = Vec::with_capacity(spec.segments.len() * 4);
        let mut items: Vec<(u64, u32, u32)> = Vec::new();
        for (i, s) in spec.segments.iter().enumerate() {
            segs.extend_from_slice(&[s.q_start as u32, s.q_len as u32, s.k_start as u32, s.k_len as u32]);
            let mut t = 0;
            while t < s.q_len {
                let last = (t + BLOCK_M).min(s.q_len) - 1;
                let cost = s.visible_len(last, spec.causal) as u64 + 1;
                items.push((cost, i as u32, t as u32));
                t += BLOCK_M;
            }
        }
        // Longest first so the tail of the grid is short work; stable for determinism.
        items.sort_by(|a, b| b.0.cmp(&a.0));
        let work = items.iter().flat_map(|&(_, s, t)| [s, t]).collect();
        let row_seg = if spec.dtype == DType::F32 {
            let mut rs = vec![u32::MAX; spec.dims.total_q];
            for (i, s) in spec.segments.iter().enumerate() {
                for r in &mut rs[s.q_start..s.q_start + s.q_len] {
                    *r = i as u32;
                }
            }
            rs
        } else {
            Vec::new()
        };
        Plan { segs, work, row_seg }
    }

    pub fn n_work(&self) -> usize {
        self.work.len() / 2
    }

    pub fn upload(&self, client: &ComputeClient<CudaRuntime>) -> PlanDev {
        let up = |v: &[u32]| -> (Handle, usize) {
            if v.is_empty() {
                (client.create_from_slice(bytemuck::cast_slice(&[0u32])), 1)
            } else {
                (client.create_from_slice(bytemuck::cast_slice(v)), v.len())
            }
        };
        PlanDev { segs: up(&self.segs), work: up(&self.work), row_seg: up(&self.row_seg) }
    }
}

pub(crate) struct PlanDev {
    pub segs: (Handle, usize),
    pub work: (Handle, usize),
    pub row_seg: (Handle, usize),
}

fn buf(h: &Handle, len: usize) -> ArrayArg<CudaRuntime> {
    // SAFETY: every handle passed here was allocated with at least `len` elements.
    unsafe { ArrayArg::from_raw_parts(h.clone(), len) }
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
            {
                rowwise_fwd::rowwise_fwd_f32::launch::<CudaRuntime>(
                    client,
                    CubeCount::Static(cubes, d.heads_q as u32, 1),
                    CubeDim::new_1d(32 * ROWS_PER_CUBE as u32),
                    buf(q, ql),
                    buf(k, kl),
                    buf(v, kl),
                    buf(out, ql),
                    buf(lse, d.lse_len()),
                    buf(&dev.row_seg.0, dev.row_seg.1),
                    buf(&dev.segs.0, dev.segs.1),
                    spec.scale,
                    d.heads_q as u32,
                    d.heads_kv as u32,
                    d.total_q as u32,
                    f32::INFINITY,
                    hd,
                    spec.causal,
                )
            };
        }
        DType::F16 | DType::BF16 => {
            if spec.uncovered_rows() > 0 {
                let n = ql.max(d.lse_len());
                let cubes = n.div_ceil(256) as u32;
                let (cx, cy) = if cubes > 65535 { (65535, cubes.div_ceil(65535)) } else { (cubes, 1) };
                let _ = (cx, cy);
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
            let n_work = plan.n_work() as u32;
            if n_work == 0 {
                return Ok(());
            }
                        let count = CubeCount::Static(n_work, d.heads_q as u32, 1);
            let dim = CubeDim::new_1d(32 * PLANES as u32);
            macro_rules! go {
                ($t:ty) => {
                    {
                        flash_fwd::flash_fwd_mma::launch::<$t, CudaRuntime>(
                            client,
                            count,
                            dim,
                            LOAD_VEC,
                            buf(q, ql / LOAD_VEC),
                            buf(k, (kl / LOAD_VEC).max(1)),
                            buf(v, (kl / LOAD_VEC).max(1)),
                            buf(out, ql),
                            buf(lse, d.lse_len()),
                            buf(&dev.work.0, dev.work.1),
                            buf(&dev.segs.0, dev.segs.1),
                            spec.scale,
                            d.heads_q as u32,
                            d.heads_kv as u32,
                            d.total_q as u32,
                            f32::INFINITY,
                            hd,
                            spec.causal,
                            use_ldmatrix(),
                        )
                    }
                };
            }
            match spec.dtype {
                DType::F16 => go!(f16),
                _ => go!(bf16),
            }
        }
    }
    Ok(())
}

/// Fragment loads through `ldmatrix` (default) or through per-element shared-memory reads
/// (`CUBEATTN_CUDA_LDMATRIX=0`, kept as a cross-check of the register layouts).
fn use_ldmatrix() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| std::env::var("CUBEATTN_CUDA_LDMATRIX").map(|v| v != "0").unwrap_or(true))
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
