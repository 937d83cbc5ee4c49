//! CUDA backward: host side of the kernels in `kernels::flash_bwd`.
//!
//! Launch order: delta = rowsum(dO * O) (f32), then dK/dV (one cube per (key tile, kv head),
//! looping over every segment that overlaps the tile and over the query heads of the kv head),
//! then dQ, one of two ways:
//! - `deterministic = true`: a separate dQ pass (one cube per (query tile, query head), looping
//!   over the key tiles its rows see, S and dP recomputed). Every pass owns its outputs outright:
//!   no atomics, a fixed summation order, bitwise identical run to run.
//! - fused (f16/bf16, `deterministic = false` with `CUBEATTN_BWD_DQ=atomic`, see [`DqPath`]):
//!   the dK/dV kernel also forms dQ += dS K per (query tile, key tile) and adds it into an f32
//!   accumulator with atomics (FlashAttention-2's way); a small kernel then writes dq = scale *
//!   acc in the dtype. The summation order of dQ then varies run to run (last-bit differences).
//!   Not the default: with the Q/dO pipeline the separate pass measured faster on every shape.
//!
//! f16/bf16 run on tensor cores (mma.sync, f32 accumulation); f32 runs on plain kernels (always
//! deterministic). head_dim 64 and 128; anything else is `Error::Unsupported`.
//!
//! Workspace on the device besides the inputs and the three gradients: delta (f32 per query row
//! and head), the small segment / work tables, and on the atomic path the f32 dQ accumulator
//! (`total_q * heads_q * head_dim * 4` bytes).

use std::time::Instant;

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;
use half::{bf16, f16};

use super::bench::{random_f32, sync};
use super::{buf, table, check_supported, guarded, launch_forward, use_ldmatrix, CudaBackend, Plan};
use crate::backend::{BackwardInputs, Gradients};
use crate::dtype::{DType, HostData, HostView};
use crate::error::{Error, Result};
use crate::kernels::flash_bwd::{
    self, BWD_BM, BWD_BN, BWD_LOAD_VEC, BWD_PLANES, DELTA_PLANES, F32_ROWS_PER_CUBE,
};
use crate::spec::AttnSpec;

/// Host-side tables of one backward call.
pub(crate) struct BwdPlan {
    /// (q_start, q_len, k_start, k_len) per segment.
    segs: Vec<u32>,
    /// dQ work list: (segment, first row of a `BWD_BM`-row tile), most keys first.
    q_work: Vec<u32>,
    /// dK/dV work list: key-tile indices, most (query row, key) pairs first.
    k_work: Vec<u32>,
    /// CSR over key tiles: segments whose key window overlaps tile t are
    /// `tile_segs[tile_off[t]..tile_off[t+1]]`, ascending.
    tile_off: Vec<u32>,
    tile_segs: Vec<u32>,
    /// Segment of every query row, u32::MAX when none (f32 path only).
    row_seg: Vec<u32>,
}

impl BwdPlan {
    pub(crate) fn new(spec: &AttnSpec) -> BwdPlan {
        let d = &spec.dims;
        let mut segs = Vec::with_capacity(spec.segments.len() * 4);
        let mut q_items: Vec<(u64, u32, u32)> = Vec::new();
        for (i, s) in spec.segments.iter().enumerate() {
            segs.extend_from_slice(&[s.q_start as u32, s.q_len as u32, s.k_start as u32, s.k_len as u32]);
            let mut t = 0;
            while t < s.q_len {
                let last = (t + BWD_BM).min(s.q_len) - 1;
                q_items.push((s.visible_len(last, spec.causal) as u64 + 1, i as u32, t as u32));
                t += BWD_BM;
            }
        }
        q_items.sort_by_key(|x| std::cmp::Reverse(x.0));
        let q_work = q_items.iter().flat_map(|&(_, s, t)| [s, t]).collect();

        let n_tiles = d.total_k.div_ceil(BWD_BN);
        let mut per_tile: Vec<Vec<u32>> = vec![Vec::new(); n_tiles];
        let mut cost = vec![0u64; n_tiles];
        for (i, s) in spec.segments.iter().enumerate() {
            if s.q_len == 0 || s.k_len == 0 {
                continue;
            }
            let (a, b) = (s.k_start / BWD_BN, (s.k_start + s.k_len).div_ceil(BWD_BN));
            for (t, list) in per_tile.iter_mut().enumerate().take(b).skip(a) {
                // rows that see the first key of the overlap, times the keys in it (upper bound)
                let first = (t * BWD_BN).max(s.k_start) - s.k_start;
                let r_min = if spec.causal { (first + s.q_len).saturating_sub(s.k_len) } else { 0 };
                if r_min >= s.q_len {
                    continue;
                }
                list.push(i as u32);
                cost[t] += (s.q_len - r_min) as u64 * BWD_BN as u64;
            }
        }
        let mut tile_off = Vec::with_capacity(n_tiles + 1);
        let mut tile_segs = Vec::new();
        tile_off.push(0u32);
        for l in &per_tile {
            tile_segs.extend_from_slice(l);
            tile_off.push(tile_segs.len() as u32);
        }
        let mut order: Vec<u32> = (0..n_tiles as u32).collect();
        order.sort_by(|&a, &b| cost[b as usize].cmp(&cost[a as usize]));

        let row_seg = if spec.dtype == DType::F32 {
            let mut rs = vec![u32::MAX; d.total_q];
            for (i, s) in spec.segments.iter().enumerate() {
                for r in &mut rs[s.q_start..s.q_start + s.q_len] {
                    *r = i as u32;
                }
            }
            rs
        } else {
            Vec::new()
        };
        BwdPlan { segs, q_work, k_work: order, tile_off, tile_segs, row_seg }
    }

    pub(crate) fn upload(&self, client: &ComputeClient<CudaRuntime>) -> BwdPlanDev {
        let up = |v: &[u32]| super::upload_table(client, v);
        BwdPlanDev {
            segs: up(&self.segs),
            q_work: up(&self.q_work),
            k_work: up(&self.k_work),
            tile_off: up(&self.tile_off),
            tile_segs: up(&self.tile_segs),
            row_seg: up(&self.row_seg),
            n_q_work: self.q_work.len() / 2,
            n_k_work: self.k_work.len(),
        }
    }
}

pub(crate) struct BwdPlanDev {
    segs: (Handle, usize),
    q_work: (Handle, usize),
    k_work: (Handle, usize),
    tile_off: (Handle, usize),
    tile_segs: (Handle, usize),
    row_seg: (Handle, usize),
    n_q_work: usize,
    n_k_work: usize,
}

/// A 2-D grid (x fastest) of at least `cubes` cubes.
fn grid_2d(cubes: usize) -> CubeCount {
    let cubes = cubes.max(1);
    if cubes <= 65535 {
        CubeCount::Static(cubes as u32, 1, 1)
    } else {
        let y = cubes.div_ceil(65535);
        CubeCount::Static(cubes.div_ceil(y) as u32, y as u32, 1)
    }
}

/// Device buffers of one backward call.
pub(crate) struct BwdBuffers {
    pub q: Handle,
    pub k: Handle,
    pub v: Handle,
    pub out: Handle,
    pub dout: Handle,
    pub lse: Handle,
    pub delta: Handle,
    pub dq: Handle,
    pub dk: Handle,
    pub dv: Handle,
    /// f32 dQ accumulator (`q_len()` floats), present on the atomic (non-deterministic) path.
    pub dq_acc: Option<Handle>,
}

/// Vector width of the dQ atomics (float2 `atomicAdd`, sm_90); `CUBEATTN_BWD_ATOMIC_VEC=1` falls
/// back to scalar atomics.
fn atomic_vec() -> usize {
    match std::env::var("CUBEATTN_BWD_ATOMIC_VEC").ok().as_deref() {
        Some("1") => 1,
        _ => 2,
    }
}

/// Whether the tensor-core backward kernels double-buffer their streamed tiles with `cp.async`
/// (Q / dO in the dK/dV kernel, K / V in the dQ pass). `CUBEATTN_BWD_PIPE=1|0` overrides the
/// default ([`BWD_PIPE_DEFAULT`]).
pub fn bwd_pipe() -> bool {
    match std::env::var("CUBEATTN_BWD_PIPE").ok().as_deref() {
        Some("1") => true,
        Some("0") => false,
        _ => BWD_PIPE_DEFAULT,
    }
}

/// Default of [`bwd_pipe`]: on since it passed every backward test and measured faster on an
/// H200 (8K causal d128 backward 9.11 -> 8.18 ms, 16K 32.0 -> 28.3 ms, deterministic path).
pub const BWD_PIPE_DEFAULT: bool = true;

/// How the backward forms dQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DqPath {
    /// The separate (deterministic) pass: with the cp.async Q/dO pipeline it measured faster than
    /// the fused atomic path on every H200 shape (8K causal bwd 8.18 vs 8.99 ms, 8K full 13.88 vs
    /// 14.56 ms). `CUBEATTN_BWD_DQ=atomic` selects the fused path for non-deterministic calls.
    Auto,
    /// The separate deterministic dQ pass.
    Pass,
    /// dQ fused into the dK/dV kernel with f32 atomics (f16/bf16; f32 inputs always use the
    /// row-wise kernels).
    Atomic,
}

/// Device workspace of a backward call besides q, k, v, out, dout, lse, dq, dk and dv: the plan
/// tables, delta (f32 per row and head) and, on the atomic dQ path, the f32 dQ accumulator.
pub fn backward_workspace_bytes(spec: &AttnSpec, deterministic: bool) -> u64 {
    let plan = BwdPlan::new(spec);
    let tables = super::table_bytes(&[&plan.segs, &plan.q_work, &plan.k_work, &plan.tile_off, &plan.tile_segs, &plan.row_seg]);
    let d = &spec.dims;
    let acc = if fused_dq(spec, deterministic, DqPath::Auto) { d.q_len() as u64 * 4 } else { 0 };
    tables + d.lse_len() as u64 * 4 + acc
}

/// Whether the backward of `spec` takes the fused atomic dQ path.
pub(super) fn fused_dq(spec: &AttnSpec, deterministic: bool, path: DqPath) -> bool {
    if spec.dtype == DType::F32 {
        return false;
    }
    match path {
        DqPath::Pass => false,
        DqPath::Atomic => true,
        DqPath::Auto if deterministic => false,
        DqPath::Auto => match std::env::var("CUBEATTN_BWD_DQ").ok().as_deref() {
            // with the Q/dO pipeline the two-pass dQ measured faster on every shape (bench/NOTES.md)
            Some("atomic") => true,
            _ => false,
        },
    }
}

/// Launches the backward kernels (delta, dK/dV, dQ; plus the zero fill of dQ rows that no
/// segment covers, or of the f32 accumulator on the atomic path, which `b.dq_acc` selects).
/// Needs `total_q > 0` and `total_k > 0`.
pub(crate) fn launch_backward(
    client: &ComputeClient<CudaRuntime>,
    spec: &AttnSpec,
    plan: &BwdPlanDev,
    b: &BwdBuffers,
) -> Result<()> {
    let d = &spec.dims;
    let hd = d.head_dim;
    let (ql, kl, ll) = (d.q_len(), d.kv_len(), d.lse_len());
    let ldsm = use_ldmatrix();
    // SAFETY (every launch below): each index the kernels form is inside its buffer. Rows and keys
    // come from the validated spec through the plan; global loads and stores are guarded by the
    // segment / total bounds, the work lists only hold valid segment ids, tile starts and key
    // tiles, and `tile_off` has one entry per key tile plus one.

    // ---- delta ----
    let rows = d.total_q * d.heads_q;
    let dcount = grid_2d(rows.div_ceil(DELTA_PLANES));
    let ddim = CubeDim::new_1d(32 * DELTA_PLANES as u32);
    macro_rules! delta {
        ($t:ty) => {
            flash_bwd::bwd_delta::launch_unchecked::<$t, CudaRuntime>(
                client,
                dcount,
                ddim,
                buf(&b.out, ql),
                buf(&b.dout, ql),
                buf(&b.delta, ll),
                d.heads_q as u32,
                d.total_q as u32,
                hd,
            )
        };
    }
    unsafe {
        match spec.dtype {
            DType::F16 => delta!(f16),
            DType::BF16 => delta!(bf16),
            DType::F32 => delta!(f32),
        }
    }

    match spec.dtype {
        DType::F32 => unsafe {
            let dim = CubeDim::new_1d(32 * F32_ROWS_PER_CUBE as u32);
            flash_bwd::rowwise_bwd_dkdv_f32::launch_unchecked::<CudaRuntime>(
                client,
                CubeCount::Static(d.total_k.div_ceil(F32_ROWS_PER_CUBE) as u32, d.heads_kv as u32, 1),
                dim,
                buf(&b.q, ql),
                buf(&b.k, kl),
                buf(&b.v, kl),
                buf(&b.dout, ql),
                buf(&b.lse, ll),
                buf(&b.delta, ll),
                buf(&b.dk, kl),
                buf(&b.dv, kl),
                table(&plan.tile_off),
                table(&plan.tile_segs),
                table(&plan.segs),
                spec.scale,
                d.heads_q as u32,
                d.heads_kv as u32,
                d.total_q as u32,
                d.total_k as u32,
                hd,
                spec.causal,
            );
            flash_bwd::rowwise_bwd_dq_f32::launch_unchecked::<CudaRuntime>(
                client,
                CubeCount::Static(d.total_q.div_ceil(F32_ROWS_PER_CUBE) as u32, d.heads_q as u32, 1),
                dim,
                buf(&b.q, ql),
                buf(&b.k, kl),
                buf(&b.v, kl),
                buf(&b.dout, ql),
                buf(&b.lse, ll),
                buf(&b.delta, ll),
                buf(&b.dq, ql),
                table(&plan.row_seg),
                table(&plan.segs),
                spec.scale,
                d.heads_q as u32,
                d.heads_kv as u32,
                d.total_q as u32,
                hd,
                spec.causal,
            );
        }
        DType::F16 | DType::BF16 => {
            let dim = CubeDim::new_1d(32 * BWD_PLANES as u32);
            let (qv, kv) = (ql / BWD_LOAD_VEC, kl / BWD_LOAD_VEC);
            macro_rules! go {
                ($t:ty) => {{
                    let fuse = b.dq_acc.is_some();
                    let pipe = bwd_pipe();
                    let qvec = atomic_vec();
                    let acc_h = b.dq_acc.as_ref().unwrap_or(&b.delta);
                    let acc_len = if fuse { ql / qvec } else { 1 };
                    if fuse {
                        flash_bwd::fill_zero::launch_unchecked::<f32, CudaRuntime>(
                            client,
                            grid_2d(ql.div_ceil(256)),
                            CubeDim::new_1d(256),
                            buf(acc_h, ql),
                        );
                    } else if spec.uncovered_rows() > 0 {
                        flash_bwd::fill_zero::launch_unchecked::<$t, CudaRuntime>(
                            client,
                            grid_2d(ql.div_ceil(256)),
                            CubeDim::new_1d(256),
                            buf(&b.dq, ql),
                        );
                    }
                    if plan.n_k_work > 0 {
                        flash_bwd::flash_bwd_dkdv::launch_unchecked::<$t, CudaRuntime>(
                            client,
                            CubeCount::Static(plan.n_k_work as u32, d.heads_kv as u32, 1),
                            dim,
                            BWD_LOAD_VEC,
                            qvec,
                            buf(&b.q, qv),
                            buf(&b.k, kv),
                            buf(&b.v, kv),
                            buf(&b.dout, qv),
                            buf(&b.lse, ll),
                            buf(&b.delta, ll),
                            buf(&b.dk, kl),
                            buf(&b.dv, kl),
                            buf(acc_h, acc_len),
                            buf(&b.q, ql),
                            buf(&b.dout, ql),
                            table(&plan.k_work),
                            table(&plan.tile_off),
                            table(&plan.tile_segs),
                            table(&plan.segs),
                            spec.scale,
                            d.heads_q as u32,
                            d.heads_kv as u32,
                            d.total_q as u32,
                            d.total_k as u32,
                            hd,
                            spec.causal,
                            ldsm,
                            fuse,
                            qvec,
                            pipe,
                        );
                    }
                    if fuse {
                        flash_bwd::dq_convert::launch_unchecked::<$t, CudaRuntime>(
                            client,
                            grid_2d(ql.div_ceil(256)),
                            CubeDim::new_1d(256),
                            buf(acc_h, ql),
                            buf(&b.dq, ql),
                            spec.scale,
                        );
                    } else if plan.n_q_work > 0 {
                        flash_bwd::flash_bwd_dq::launch_unchecked::<$t, CudaRuntime>(
                            client,
                            CubeCount::Static(plan.n_q_work as u32, d.heads_q as u32, 1),
                            dim,
                            BWD_LOAD_VEC,
                            buf(&b.q, qv),
                            buf(&b.k, kv),
                            buf(&b.v, kv),
                            buf(&b.dout, qv),
                            buf(&b.lse, ll),
                            buf(&b.delta, ll),
                            buf(&b.dq, ql),
                            buf(&b.k, kl),
                            buf(&b.v, kl),
                            table(&plan.q_work),
                            table(&plan.segs),
                            spec.scale,
                            d.heads_q as u32,
                            d.heads_kv as u32,
                            d.total_q as u32,
                            hd,
                            spec.causal,
                            ldsm,
                            pipe,
                        );
                    }
                }};
            }
            unsafe {
                match spec.dtype {
                    DType::F16 => go!(f16),
                    _ => go!(bf16),
                }
            }
        }
    }
    Ok(())
}

/// Builds the backward plan of `spec`, uploads its tables and launches the backward kernels.
pub(crate) fn plan_and_launch_backward(
    client: &ComputeClient<CudaRuntime>,
    spec: &AttnSpec,
    b: &BwdBuffers,
) -> Result<()> {
    let dev = BwdPlan::new(spec).upload(client);
    launch_backward(client, spec, &dev, b)
}

fn zero_grads(spec: &AttnSpec) -> Gradients {
    let d = &spec.dims;
    Gradients {
        dq: HostData::from_f32(spec.dtype, &vec![0.0; d.q_len()]),
        dk: HostData::from_f32(spec.dtype, &vec![0.0; d.kv_len()]),
        dv: HostData::from_f32(spec.dtype, &vec![0.0; d.kv_len()]),
    }
}

/// The backward pass on host buffers. `poison`: fill dq, dk, dv with this value before the
/// kernels run (tests pass NaN to prove every element is written).
pub(crate) fn backward(
    backend: &CudaBackend,
    spec: &AttnSpec,
    q: HostView,
    k: HostView,
    v: HostView,
    g: BackwardInputs,
    poison: Option<f32>,
) -> Result<Gradients> {
    backward_path(backend, spec, q, k, v, g, poison, DqPath::Auto)
}

/// [`backward`] with an explicit dQ path.
#[allow(clippy::too_many_arguments)]
fn backward_path(
    backend: &CudaBackend,
    spec: &AttnSpec,
    q: HostView,
    k: HostView,
    v: HostView,
    g: BackwardInputs,
    poison: Option<f32>,
    path: DqPath,
) -> Result<Gradients> {
    crate::backend::check_buffers(spec, q, k, v)?;
    crate::backend::check_backward_buffers(spec, &g)?;
    check_supported(spec)?;
    let d = &spec.dims;
    if d.total_q == 0 || d.total_k == 0 {
        // No (query, key) pair: every gradient is zero.
        return Ok(zero_grads(spec));
    }
    let client = backend.client();
    let run = guarded("CubeCL launch", || -> Result<Gradients> {
        let up = |h: HostView| client.create_from_slice(h.as_bytes());
        let filled = |n: usize| match poison {
            Some(p) => client.create_from_slice(HostData::from_f32(spec.dtype, &vec![p; n]).view().as_bytes()),
            None => client.empty(n * spec.dtype.size()),
        };
        let bufs = BwdBuffers {
            q: up(q),
            k: up(k),
            v: up(v),
            out: up(g.out),
            dout: up(g.dout),
            lse: client.create_from_slice(bytemuck::cast_slice(g.lse)),
            delta: client.empty(d.lse_len() * 4),
            dq: filled(d.q_len()),
            dk: filled(d.kv_len()),
            dv: filled(d.kv_len()),
            dq_acc: fused_dq(spec, g.deterministic, path).then(|| client.empty(d.q_len() * 4)),
        };
        plan_and_launch_backward(client, spec, &bufs)?;
        super::memory_probe(client);
        let read = |h: Handle| -> Result<HostData> {
            let bytes = client.read_one(h).map_err(|e| Error::Device(format!("backward kernel failed: {e:?}")))?;
            Ok(HostData::from_bytes(spec.dtype, &bytes))
        };
        Ok(Gradients { dq: read(bufs.dq)?, dk: read(bufs.dk)?, dv: read(bufs.dv)? })
    });
    match run {
        Ok(r) => r,
        Err(msg) => Err(Error::Device(msg)),
    }
}

impl CudaBackend {
    /// Backward pass that first fills dq, dk, dv with `poison` (tests use NaN to prove that every
    /// element is written by the kernels).
    pub fn backward_poisoned(
        &self,
        spec: &AttnSpec,
        q: HostView,
        k: HostView,
        v: HostView,
        grad: BackwardInputs,
        poison: f32,
    ) -> Result<Gradients> {
        backward(self, spec, q, k, v, grad, Some(poison))
    }

    /// [`CudaBackend::backward_poisoned`] on an explicit dQ path (tests cover both paths).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_poisoned_on(
        &self,
        spec: &AttnSpec,
        q: HostView,
        k: HostView,
        v: HostView,
        grad: BackwardInputs,
        poison: f32,
        path: DqPath,
    ) -> Result<Gradients> {
        backward_path(self, spec, q, k, v, grad, Some(poison), path)
    }

    /// The backward on an explicit dQ path (no poisoning).
    pub fn backward_on(
        &self,
        spec: &AttnSpec,
        q: HostView,
        k: HostView,
        v: HostView,
        grad: BackwardInputs,
        path: DqPath,
    ) -> Result<Gradients> {
        backward_path(self, spec, q, k, v, grad, None, path)
    }
}

/// What [`bench_backward_split`] times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchPart {
    /// Forward then backward (the forward's `out` and `lse` feed the backward), like torch's
    /// fwd+bwd timings.
    ForwardBackward,
    /// The backward kernels alone (delta, dK/dV, dQ).
    Backward,
}

/// Times forward + backward together: uploads random q, k, v, dO once (device-resident, never
/// zeros), runs `warmup` untimed iterations, then times `iters` iterations one by one (device
/// sync before and after each, host clock). Each iteration = the forward kernel (writing out and
/// lse) followed by the backward kernels (delta, dK/dV, dQ). Returns milliseconds per iteration.
/// FLOPs to quote: 3.5 x `spec.forward_flops()`.
/// Times the default (non-deterministic) call: [`DqPath::Auto`] with `deterministic = false`.
pub fn bench_backward(spec: &AttnSpec, warmup: usize, iters: usize) -> Result<Vec<f64>> {
    bench_backward_split(spec, warmup, iters, BenchPart::ForwardBackward)
}

/// [`bench_backward`] with the choice of timing forward + backward or the backward alone
/// (then the forward runs once before the timed loop to produce out and lse); default path.
pub fn bench_backward_split(spec: &AttnSpec, warmup: usize, iters: usize, part: BenchPart) -> Result<Vec<f64>> {
    bench_backward_with(spec, warmup, iters, part, DqPath::Auto)
}

/// [`bench_backward_split`] with the choice of dQ path ([`DqPath::Auto`] as a
/// `deterministic = false` call).
pub fn bench_backward_with(
    spec: &AttnSpec,
    warmup: usize,
    iters: usize,
    part: BenchPart,
    path: DqPath,
) -> Result<Vec<f64>> {
    let backend = CudaBackend::shared()?;
    check_supported(spec)?;
    let client = backend.client();
    let d = &spec.dims;
    if d.total_q == 0 || d.total_k == 0 {
        return Err(crate::error::invalid("spec", "benchmark needs at least one query and one key"));
    }
    let r = guarded("CubeCL benchmark", || -> Result<Vec<f64>> {
        let mk = |n: usize, seed: u64| {
            let x = random_f32(n.max(1), seed);
            let h = HostData::from_f32(spec.dtype, &x);
            client.create_from_slice(h.view().as_bytes())
        };
        let esize = spec.dtype.size();
        let bufs = BwdBuffers {
            q: mk(d.q_len(), 11),
            k: mk(d.kv_len(), 12),
            v: mk(d.kv_len(), 13),
            out: client.empty(d.q_len() * esize),
            dout: mk(d.q_len(), 14),
            lse: client.empty(d.lse_len() * 4),
            delta: client.empty(d.lse_len() * 4),
            dq: client.empty(d.q_len() * esize),
            dk: client.empty(d.kv_len() * esize),
            dv: client.empty(d.kv_len() * esize),
            dq_acc: fused_dq(spec, false, path).then(|| client.empty(d.q_len() * 4)),
        };
        let fplan = Plan::new(spec);
        let fdev = fplan.upload(client);
        let bplan = BwdPlan::new(spec);
        let bdev = bplan.upload(client);
        let fwd = || launch_forward(client, spec, &fplan, &fdev, &bufs.q, &bufs.k, &bufs.v, &bufs.out, &bufs.lse);
        let step = || -> Result<()> {
            if part == BenchPart::ForwardBackward {
                fwd()?;
            }
            launch_backward(client, spec, &bdev, &bufs)
        };
        fwd()?;
        for _ in 0..warmup {
            step()?;
        }
        sync(client)?;
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            sync(client)?;
            let t0 = Instant::now();
            step()?;
            sync(client)?;
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        client.read_one(bufs.dq).map_err(|e| Error::Device(format!("backward kernel failed: {e:?}")))?;
        Ok(times)
    });
    match r {
        Ok(r) => r,
        Err(msg) => Err(Error::Device(msg)),
    }
}
