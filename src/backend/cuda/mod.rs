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
use crate::kernels::flash_fwd::{self, BLOCK_M, BLOCK_N, COMB_WORDS, LOAD_VEC, NONE, PLANES, SLICE_WORDS, WORK_WORDS};
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

/// Device workspace of a forward call besides q, k, v, out and lse: the plan tables and, on the
/// tensor-core path, the split-K partial buffers. Host-only arithmetic (no GPU needed); the VRAM
/// estimate uses it so that it follows the plan the launch really makes.
pub fn forward_workspace_bytes(spec: &AttnSpec) -> u64 {
    let plan = Plan::new(spec);
    let mut bytes = plan.table_bytes();
    if plan.fwd.n_work() > 0 {
        bytes += plan.split_rows(spec.dims.heads_q) as u64 * (spec.dims.head_dim as u64 + 1) * 4;
    }
    bytes
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

/// Uploads a u32 table; an empty one becomes a single zero word (kernels take no empty
/// buffers). Returns the handle and the length the kernels see.
pub(crate) fn upload_table(client: &ComputeClient<CudaRuntime>, v: &[u32]) -> (Handle, usize) {
    if v.is_empty() {
        (client.create_from_slice(bytemuck::cast_slice(&[0u32])), 1)
    } else {
        (client.create_from_slice(bytemuck::cast_slice(v)), v.len())
    }
}

/// Device bytes [`upload_table`] takes for these tables.
pub(crate) fn table_bytes(tables: &[&Vec<u32>]) -> u64 {
    tables.iter().map(|v| 4 * v.len().max(1) as u64).sum()
}

/// Host-side launch plan: segment table and per-cube work list.
pub(crate) struct Plan {
    /// (q_start, q_len, k_start, k_len) per segment.
    pub segs: Vec<u32>,
    /// (segment, tile start) per cube, most expensive first (tensor-core path).
    pub work: Vec<u32>,
    /// Segment of every query row, u32::MAX when none (row-wise f32 path).
    pub row_seg: Vec<u32>,
    /// Packed-row work list of the tensor-core forward kernel (empty for f32).
    pub fwd: FwdPlan,
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
        let fwd = if spec.dtype == DType::F32 { FwdPlan::default() } else { FwdPlan::new(spec, &fwd_options()) };
        Plan { segs, work, row_seg, fwd }
    }

    #[allow(dead_code)]
    pub fn n_work(&self) -> usize {
        self.work.len() / 2
    }

    /// Rows of the split-K partial buffers of the tensor-core forward (`part_o` holds
    /// rows x head_dim f32, `part_lse` rows f32).
    pub(crate) fn split_rows(&self, heads_q: usize) -> usize {
        let y = (heads_q as u32 / self.fwd.hp.max(1)).max(1) as usize;
        (self.fwd.n_slots as usize * y * BLOCK_M).max(1)
    }

    /// Device bytes of the tables [`Plan::upload`] creates.
    pub(crate) fn table_bytes(&self) -> u64 {
        table_bytes(&[&self.segs, &self.work, &self.row_seg, &self.fwd.work, &self.fwd.slices, &self.fwd.comb])
    }

    pub fn upload(&self, client: &ComputeClient<CudaRuntime>) -> PlanDev {
        let up = |v: &[u32]| upload_table(client, v);
        PlanDev {
            segs: up(&self.segs),
            work: up(&self.work),
            row_seg: up(&self.row_seg),
            fwd_work: up(&self.fwd.work),
            fwd_slices: up(&self.fwd.slices),
            fwd_comb: up(&self.fwd.comb),
        }
    }
}

pub(crate) struct PlanDev {
    pub segs: (Handle, usize),
    #[allow(dead_code)]
    pub work: (Handle, usize),
    pub row_seg: (Handle, usize),
    pub fwd_work: (Handle, usize),
    pub fwd_slices: (Handle, usize),
    pub fwd_comb: (Handle, usize),
}

/// Tuning switches of the tensor-core forward (defaults from the environment:
/// `CUBEATTN_CUDA_LDMATRIX`, `CUBEATTN_CUDA_PIPE`, `CUBEATTN_CUDA_PACK_HEADS`, `CUBEATTN_CUDA_SPLIT`,
/// each `0` to turn off). Tests and benchmarks switch them with [`set_fwd_options`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FwdOptions {
    /// Fragment loads through `ldmatrix` (else per-element shared-memory reads).
    pub ldmatrix: bool,
    /// `cp.async` K/V copies overlapped with the matrix work (else synchronous loads).
    pub pipeline: bool,
    /// The q heads of one kv head share a tile (rows = (query, head) pairs).
    pub pack_heads: bool,
    /// Split long tiles over several cubes when the launch has too few cubes to fill the GPU.
    pub split: bool,
    /// Split target: about this many cubes per multiprocessor (`CUBEATTN_CUDA_SPLIT_WAVES`, 2:
    /// measured best of 2/4/8/16 on the shared-prefix shape).
    pub split_waves: u32,
    /// Kernel v5 (`flash_fwd_mma2`: Q in shared memory, `plane_rows` rows per plane) instead of
    /// v4 (`flash_fwd_mma`: 8 planes x 16 rows, Q fragments in registers). Needs `ldmatrix` and
    /// `pipeline`; otherwise v4 runs (`CUBEATTN_CUDA_V5`).
    pub v5: bool,
    /// v5 rows per plane: 32 (4 planes, 128 threads) or 16 (8 planes) (`CUBEATTN_CUDA_PLANE_ROWS`).
    pub plane_rows: u32,
    /// v5 keys per shared-memory tile: 64 or 32 (`CUBEATTN_CUDA_BLOCK_N`).
    pub block_n: u32,
}

static FWD_OPTS: std::sync::Mutex<Option<FwdOptions>> = std::sync::Mutex::new(None);

fn env_on(name: &str) -> bool {
    std::env::var(name).map(|v| v != "0").unwrap_or(true)
}

/// Kernel v5 is the default: 1.28-1.30x over v4 on the dense causal Llama3-8B shapes (H200,
/// bench/NOTES.md).
const V5_DEFAULT: bool = true;

fn env_u32(name: &str, allowed: &[u32], default: u32) -> u32 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).filter(|w| allowed.contains(w)).unwrap_or(default)
}

impl FwdOptions {
    /// The defaults without environment overrides.
    pub fn defaults() -> FwdOptions {
        FwdOptions { ldmatrix: true, pipeline: true, pack_heads: true, split: true, split_waves: 2, v5: V5_DEFAULT, plane_rows: 32, block_n: 64 }
    }
}

/// The forward switches in force.
pub fn fwd_options() -> FwdOptions {
    let mut g = FWD_OPTS.lock().unwrap_or_else(|e| e.into_inner());
    *g.get_or_insert_with(|| FwdOptions {
        ldmatrix: env_on("CUBEATTN_CUDA_LDMATRIX"),
        pipeline: env_on("CUBEATTN_CUDA_PIPE"),
        pack_heads: env_on("CUBEATTN_CUDA_PACK_HEADS"),
        split: env_on("CUBEATTN_CUDA_SPLIT"),
        split_waves: std::env::var("CUBEATTN_CUDA_SPLIT_WAVES").ok().and_then(|v| v.parse().ok()).filter(|&w| w > 0).unwrap_or(2),
        v5: std::env::var("CUBEATTN_CUDA_V5").map(|v| v != "0").unwrap_or(V5_DEFAULT),
        plane_rows: env_u32("CUBEATTN_CUDA_PLANE_ROWS", &[16, 32], 32),
        block_n: env_u32("CUBEATTN_CUDA_BLOCK_N", &[32, 64], 64),
    })
}

/// Replaces the forward switches (process-wide; for tests and benchmarks).
pub fn set_fwd_options(o: FwdOptions) {
    *FWD_OPTS.lock().unwrap_or_else(|e| e.into_inner()) = Some(o);
}

/// Multiprocessors of device 0 (132 when unknown), for the split decision.
fn sm_count() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        guarded("CUDA device query", || {
            use cudarc::driver::result as drv;
            use cudarc::driver::sys::CUdevice_attribute as A;
            drv::device::get(0)
                .ok()
                .and_then(|d| unsafe { drv::device::get_attribute(d, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) }.ok())
                .filter(|&n| n > 0)
                .map(|n| n as usize)
        })
        .ok()
        .flatten()
        .unwrap_or(132)
    })
}

/// Work list of the tensor-core forward kernel: tiles of BLOCK_M packed rows built from slices of
/// segments (several segments share a tile when their key ranges overlap), each tile's key range,
/// and the split of long tiles into parts when the launch would not fill the GPU.
#[derive(Debug, Clone, Default)]
pub struct FwdPlan {
    /// SLICE_WORDS u32 per slice: (segment, first packed row, rows).
    pub slices: Vec<u32>,
    /// WORK_WORDS u32 per cube column: (slice offset, slice count, klo, khi, slot or NONE).
    pub work: Vec<u32>,
    /// COMB_WORDS u32 per split tile: (slice offset, slice count, first slot, parts).
    pub comb: Vec<u32>,
    /// Partial slots per CUBE_POS_Y.
    pub n_slots: u32,
    /// Heads packed per row group (1, or the GQA group size).
    pub hp: u32,
    /// Tiles before splitting (for reports).
    pub n_tiles: usize,
}

struct Tile {
    slices: Vec<[u32; 3]>,
    rows: usize,
    lo: u64,
    hi: u64,
}

impl Tile {
    fn len(&self) -> u64 {
        self.hi.saturating_sub(self.lo)
    }
}

impl FwdPlan {
    pub fn new(spec: &AttnSpec, opts: &FwdOptions) -> FwdPlan {
        let d = &spec.dims;
        let hp = if opts.pack_heads && d.heads_kv > 0 { d.group_size().max(1) } else { 1 };
        let bm = BLOCK_M;
        // Full tiles of one segment, and the remainders as packing candidates.
        let mut tiles: Vec<Tile> = Vec::new();
        let mut pieces: Vec<Tile> = Vec::new();
        for (i, s) in spec.segments.iter().enumerate() {
            let rows = s.q_len * hp;
            let range = |p0: usize, n: usize| -> (u64, u64) {
                let last_q = (p0 + n - 1) / hp;
                let hi = s.k_start + s.visible_len(last_q, spec.causal);
                (s.k_start as u64, hi as u64)
            };
            let mut p = 0;
            while p < rows {
                let n = bm.min(rows - p);
                let (lo, hi) = range(p, n);
                let t = Tile { slices: vec![[i as u32, p as u32, n as u32]], rows: n, lo, hi };
                if n == bm {
                    tiles.push(t);
                } else {
                    pieces.push(t);
                }
                p += n;
            }
        }
        // Pack remainders: longest ranges first; a piece joins the open tile when the rows fit and
        // the union of the key ranges is shorter than the two ranges apart (so keys are read once).
        pieces.sort_by(|a, b| b.hi.cmp(&a.hi).then(a.lo.cmp(&b.lo)));
        let mut open: Option<Tile> = None;
        for pc in pieces {
            match open.as_mut() {
                Some(t) if t.rows + pc.rows <= bm && {
                    let (lo, hi) = if t.len() == 0 {
                        (pc.lo, pc.hi)
                    } else if pc.len() == 0 {
                        (t.lo, t.hi)
                    } else {
                        (t.lo.min(pc.lo), t.hi.max(pc.hi))
                    };
                    hi - lo < t.len() + pc.len() || t.len() == 0 || pc.len() == 0
                } =>
                {
                    if t.len() == 0 {
                        t.lo = pc.lo;
                        t.hi = pc.hi;
                    } else if pc.len() > 0 {
                        t.lo = t.lo.min(pc.lo);
                        t.hi = t.hi.max(pc.hi);
                    }
                    t.rows += pc.rows;
                    t.slices.extend(pc.slices);
                }
                _ => {
                    if let Some(t) = open.take() {
                        tiles.push(t);
                    }
                    open = Some(pc);
                }
            }
        }
        if let Some(t) = open.take() {
            tiles.push(t);
        }

        let y = (d.heads_q / hp).max(1);
        let kt = |len: u64| len.div_ceil(BLOCK_N as u64);
        // Split when the launch has fewer cubes than a few per multiprocessor.
        let target = opts.split_waves.max(1) as usize * sm_count();
        let mut chunk = u64::MAX;
        if opts.split && tiles.len() * y < target {
            let total: u64 = tiles.iter().map(|t| kt(t.len())).sum();
            let want = target.div_ceil(y) as u64;
            chunk = total.div_ceil(want).max(8);
        }
        let mut plan = FwdPlan { hp: hp as u32, n_tiles: tiles.len(), ..Default::default() };
        // (cost, work entry)
        let mut items: Vec<(u64, [u32; WORK_WORDS])> = Vec::new();
        for t in &tiles {
            let off = (plan.slices.len() / SLICE_WORDS) as u32;
            for sl in &t.slices {
                plan.slices.extend_from_slice(sl);
            }
            let ns = t.slices.len() as u32;
            let n_kt = kt(t.len());
            if n_kt > chunk {
                let parts = n_kt.div_ceil(chunk);
                let per = n_kt.div_ceil(parts);
                let first = plan.n_slots;
                let mut used = 0u32;
                for i in 0..parts {
                    let a = t.lo + i * per * BLOCK_N as u64;
                    if a >= t.hi {
                        break;
                    }
                    let b = (a + per * BLOCK_N as u64).min(t.hi);
                    items.push((kt(b - a) + 1, [off, ns, a as u32, b as u32, first + used]));
                    used += 1;
                }
                plan.comb.extend_from_slice(&[off, ns, first, used]);
                plan.n_slots += used;
            } else {
                items.push((n_kt + 1, [off, ns, t.lo as u32, t.hi as u32, NONE]));
            }
        }
        // Longest first so the tail of the grid is short work; stable for determinism.
        items.sort_by(|a, b| b.0.cmp(&a.0));
        plan.work = items.iter().flat_map(|(_, w)| *w).collect();
        let _ = COMB_WORDS;
        plan
    }

    pub fn n_work(&self) -> usize {
        self.work.len() / WORK_WORDS
    }

    pub fn n_comb(&self) -> usize {
        self.comb.len() / COMB_WORDS
    }
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
                            buf(&dev.fwd_work.0, dev.fwd_work.1),
                            buf(&dev.fwd_slices.0, dev.fwd_slices.1),
                            buf(&dev.segs.0, dev.segs.1),
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
                            buf(&dev.fwd_work.0, dev.fwd_work.1),
                            buf(&dev.fwd_slices.0, dev.fwd_slices.1),
                            buf(&dev.segs.0, dev.segs.1),
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
                                buf(&dev.fwd_comb.0, dev.fwd_comb.1),
                                buf(&dev.fwd_slices.0, dev.fwd_slices.1),
                                buf(&dev.segs.0, dev.segs.1),
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

/// Fragment loads through `ldmatrix` (default) or through per-element shared-memory reads
/// (`CUBEATTN_CUDA_LDMATRIX=0`, kept as a cross-check of the register layouts).
pub(crate) fn use_ldmatrix() -> bool {
    fwd_options().ldmatrix
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

#[cfg(test)]
mod fwd_plan_tests {
    use super::*;
    use crate::spec::TensorMeta;

    fn grouped(hq: usize, hkv: usize, qr: &[[i32; 2]], kr: &[[i32; 2]], tq: usize, tk: usize, causal: bool) -> AttnSpec {
        AttnSpec::grouped(
            &TensorMeta::new(&[tq, hq, 128], DType::BF16),
            &TensorMeta::new(&[tk, hkv, 128], DType::BF16),
            &TensorMeta::new(&[tk, hkv, 128], DType::BF16),
            qr,
            kr,
            None,
            causal,
        )
        .unwrap()
    }

    /// Every (query, head) of every segment appears in exactly one tile, tiles hold at most
    /// BLOCK_M rows, each row's visible keys lie inside its tile's range, and split parts tile
    /// that range without gaps.
    fn check(spec: &AttnSpec, o: &FwdOptions) -> FwdPlan {
        let p = FwdPlan::new(spec, o);
        let hp = p.hp as usize;
        let d = &spec.dims;
        let mut seen = vec![0u8; d.total_q * hp];
        // (slice offset) -> list of (klo, khi)
        let mut ranges: std::collections::BTreeMap<u32, Vec<(u32, u32, u32)>> = Default::default();
        for w in p.work.chunks(WORK_WORDS) {
            ranges.entry(w[0]).or_default().push((w[2], w[3], w[4]));
            assert!(w[2] <= w[3]);
        }
        for (&off, rs) in &ranges {
            let mut rs = rs.clone();
            rs.sort();
            let (lo, hi) = (rs[0].0, rs.last().unwrap().1);
            for w in rs.windows(2) {
                assert_eq!(w[0].1, w[1].0, "split parts must be contiguous");
            }
            if rs.len() > 1 {
                assert!(rs.iter().all(|r| r.2 != NONE));
            }
            let ns = p.work.chunks(WORK_WORDS).find(|w| w[0] == off).unwrap()[1];
            let mut rows = 0;
            for i in 0..ns {
                let b = ((off + i) as usize) * SLICE_WORDS;
                let (seg, p0, n) = (p.slices[b] as usize, p.slices[b + 1] as usize, p.slices[b + 2] as usize);
                rows += n;
                let s = &spec.segments[seg];
                for pr in p0..p0 + n {
                    let qr = pr / hp;
                    assert!(qr < s.q_len);
                    let idx = (s.q_start + qr) * hp + pr % hp;
                    seen[idx] += 1;
                    let (a, z) = s.key_range(qr, spec.causal);
                    if z > a {
                        assert!(a as u32 >= lo && z as u32 <= hi, "row keys [{a},{z}) outside tile [{lo},{hi})");
                    }
                }
            }
            assert!(rows <= BLOCK_M);
        }
        for s in &spec.segments {
            for r in s.q_start..s.q_start + s.q_len {
                for h in 0..hp {
                    assert_eq!(seen[r * hp + h], 1, "row {r} head {h}");
                }
            }
        }
        p
    }

    fn all_opts() -> Vec<FwdOptions> {
        let mut v = Vec::new();
        for pack_heads in [false, true] {
            for split in [false, true] {
                v.push(FwdOptions { pack_heads, split, split_waves: 4, ..FwdOptions::defaults() });
            }
        }
        v
    }

    #[test]
    fn shared_prefix_groups_share_tiles() {
        let qr: Vec<[i32; 2]> = (0..32).map(|g| [8 * g, 8 * g + 8]).collect();
        let kr: Vec<[i32; 2]> = (0..32).map(|g| [0, 32768 - 256 * g]).collect();
        let spec = grouped(32, 8, &qr, &kr, 256, 32768, false);
        for o in all_opts() {
            let p = check(&spec, &o);
            if o.pack_heads {
                // 8 queries x 4 heads = 32 rows per group: 4 groups per tile.
                assert_eq!(p.n_tiles, 8);
            }
            if o.split {
                assert!(p.n_work() * (32 / p.hp as usize) >= 4 * 132 / 2, "{} items", p.n_work());
            }
        }
    }

    #[test]
    fn zigzag_and_varlen_plans_cover_every_row() {
        let c = 4096;
        let spec = grouped(32, 8, &[[0, c], [c, 2 * c]], &[[0, c], [0, 16 * c]], 2 * c as usize, 16 * c as usize, true);
        for o in all_opts() {
            check(&spec, &o);
        }
        // Many small groups, 1-token and empty groups, uncovered rows, causal and not.
        let qr = [[0, 1], [1, 1], [1, 9], [9, 40], [45, 46], [46, 300], [300, 301]];
        let kr = [[0, 5], [3, 3], [0, 700], [100, 900], [5, 6], [0, 1000], [999, 1000]];
        for causal in [false, true] {
            let spec = grouped(32, 8, &qr, &kr, 310, 1000, causal);
            for o in all_opts() {
                check(&spec, &o);
            }
        }
    }
}
