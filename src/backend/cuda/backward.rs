//! CUDA backward: host side of the kernels in `kernels::flash_bwd_sm90` (dK/dV on sm_90 by wgmma,
//! [`sm90_backward`]), `kernels::flash_bwd_wide` (dK/dV by mma.sync, dense and block-sparse; both
//! take the same plan and arguments), `kernels::flash_bwd` (dQ pass, delta) and
//! `kernels::rowwise_bwd` (f32).
//!
//! Launch order: delta = rowsum(dO * O) (f32), then dK/dV (one cube per (128-key tile, kv head),
//! looping over every segment that overlaps the tile and over the query heads of the kv head),
//! then dQ, one of two ways:
//! - `deterministic = true`: a separate dQ pass (one cube per (query tile, query head), looping
//!   over the key tiles its rows see, S and dP recomputed). Every pass owns its outputs outright:
//!   no atomics, a fixed summation order, bitwise identical run to run.
//! - fused (f16/bf16, `deterministic = false`, the default, see [`DqPath`]): the dK/dV kernel also
//!   forms dQ += dS K per (query tile, key tile) and adds it into an f32 accumulator, with float2
//!   atomics (FlashAttention-2's way) or, at d128 on sm_90+, with bulk reductions: of whole rows
//!   ([`kernels::bulk_reduce`](crate::kernels::bulk_reduce)), or in `flash_bwd_ws` one of a whole
//!   tile into a head-major accumulator ([`launch_dkdv_wide`] says which); a small kernel then
//!   writes dq = scale * acc in the dtype ([`launch_dq_convert`]). The
//!   summation order of dQ then varies run to run (last-bit differences). Five matmuls per (row,
//!   key) pair instead of seven: faster on every measured shape (1.17-1.25x fwd+bwd with the
//!   128-key kernel on an H100; docs/backward.md).
//!
//! f16/bf16 run on tensor cores (mma.sync or wgmma, f32 accumulation); f32 runs on plain kernels
//! (always deterministic). Above head_dim 128 only the Hopper kernels: `flash_bwd_ws_cols` (192 /
//! 128 (DeepSeek's MLA) and 192 / 192, 96-key cubes, [`ws_cols_backward`]), else
//! `flash_bwd_sm90_split` (64-key cubes); the head dims each pass serves: `super::head_dims_of`,
//! `CudaBackend::check_target`.
//!
//! Workspace (caller-provided device memory, [`bwd_workspace`]): delta (f32 per query row and
//! head) and on the atomic path the f32 dQ accumulator (`total_q * heads_q * head_dim * 4`
//! bytes). The segment / work tables live in the backend's plan cache.

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cudarc::driver::{result as drv, sys};
use half::{bf16, f16};

use super::card::{DkdvArgs, DqArgs};
use super::compile::{codegen, codegen_exp2, settings, Func, KernelKey, Source, A};
use super::driver::{err, tile_map_2d};
use super::forward::{aligned, kv_maps, kv_maps_sw128, layout};
use super::launch::{grid_2d, launch, Args, MapArg};
use super::plans::{table_names, Cached, PlanKind, TableSet};
use super::{window_bounds, CudaBackend};
use crate::backend::{BackwardInputs, Gradients};
use crate::dtype::{DType, HostView};
use crate::error::Result;
use crate::kernels::bulk_reduce::dq_tile_stride;
use crate::kernels::flash_bwd;
use crate::kernels::flash_bwd_dq_sm90::{self, DQ_SM90_THREADS};
use crate::kernels::tiles::{BWD_BM, BWD_BN, BWD_LOAD_VEC, BWD_PLANES, CONVERT_VEC, DELTA_PLANES, PAD, SPLIT_BN, WIDE_BN, WIDE_PLANES};
use crate::kernels::tiles::{ws_cols_dq_tile, WS_COLS_BN};
use crate::kernels::flash_bwd_sm90::{self, SM90_BWD_THREADS};
use crate::kernels::flash_bwd_ws::{self, BWD_WS_THREADS};
use crate::kernels::flash_bwd_ws_cols::{self, BWD_WS_COLS_THREADS};
use crate::kernels::flash_bwd_sm90_split;
use crate::kernels::flash_bwd_wide;
use crate::kernels::sm90::SW_COLS;
use crate::kernels::rowwise_bwd::{self, F32_ROWS_PER_CUBE};
use crate::kernels::math::LOG2E;
use crate::spec::AttnSpec;

/// Host-side tables of one backward call.
pub(crate) struct BwdPlan {
    /// (q_start, q_len, k_start, k_len) per segment.
    segs: Vec<u32>,
    /// dQ work list: (segment, first row of a `BWD_BM`-row tile), most keys first (tiles of
    /// close cost sequence by sequence, as [`key_tiles`]).
    pub(crate) q_work: Vec<u32>,
    /// dK/dV work list: key-tile indices, most (query row, key) pairs first. Key tiles are
    /// [`key_tile`] keys: [`WIDE_BN`] or [`SPLIT_BN`] for the tensor-core kernels, [`BWD_BN`] for
    /// the f32 row-wise one.
    pub(crate) k_work: Vec<u32>,
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
                // keys the tile's rows see: from the first row's first to the last row's last
                let keys = spec.row_keys(s, last).1.saturating_sub(spec.row_keys(s, t).0);
                q_items.push((keys as u64 + 1, i as u32, t as u32));
                t += BWD_BM;
            }
        }
        // most keys first (`plan::order_by_cost`): the dQ pass's cubes are tiles x q heads, heads
        // fastest, and a wave's tiles of a head span that many times BWD_BM keys of a causal sequence
        let seq_waves = crate::config::get().fwd.seq_waves;
        let span = (super::plan::sm_count().div_ceil(d.heads_q.max(1)) * BWD_BM) as u64;
        super::plan::order_by_cost(&mut q_items, seq_waves, span, |x| x.0, |x| x.1);
        let q_work = q_items.iter().flat_map(|&(_, s, t)| [s, t]).collect();
        let (k_work, tile_off, tile_segs) = key_tiles(spec, key_tile(spec), seq_waves);

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
        BwdPlan { segs, q_work, k_work, tile_off, tile_segs, row_seg }
    }

    /// The tables [`launch_backward`] reads (the page table of `spec`'s paged K,V; empty without
    /// one).
    pub(crate) fn tables(&self, spec: &AttnSpec) -> TableSet<BwdTable> {
        TableSet::new()
            .with(BwdTable::Segs, self.segs.clone())
            .with(BwdTable::QWork, self.q_work.clone())
            .with(BwdTable::KWork, self.k_work.clone())
            .with(BwdTable::TileOff, self.tile_off.clone())
            .with(BwdTable::TileSegs, self.tile_segs.clone())
            .with(BwdTable::RowSeg, self.row_seg.clone())
            .with(BwdTable::Pages, spec.kv_pages().unwrap_or_default().to_vec())
    }
}

/// Keys per dK/dV tile of a backward of `spec`: the row-wise kernel's [`BWD_BN`]-key tiles for
/// f32; for f16 / bf16 the 128-key tensor-core kernels up to head_dim 128, above it the Hopper
/// kernels' [`WS_COLS_BN`] ([`ws_cols_backward`]) or [`SPLIT_BN`].
fn key_tile(spec: &AttnSpec) -> usize {
    if spec.dtype == DType::F32 {
        BWD_BN
    } else if ws_cols_backward(spec) {
        WS_COLS_BN
    } else if SPLIT_BWD_HEAD_DIMS.contains(&spec.dims.head_dim) {
        SPLIT_BN
    } else {
        WIDE_BN
    }
}

/// The dK/dV work list over `bn`-key tiles of the shared key axis: (tile indices, most (query row,
/// key) pairs first; CSR offsets; segments overlapping each tile, ascending). `seq_waves`: tiles
/// of close cost go sequence by sequence (their first segment's; `plan::order_by_cost`): the cubes
/// are tiles x kv heads, and a wave's tiles of a kv head each cost `bn * bn` less than the last in
/// a causal sequence.
fn key_tiles(spec: &AttnSpec, bn: usize, seq_waves: bool) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let n_tiles = spec.dims.total_k.div_ceil(bn);
    let mut per_tile: Vec<Vec<u32>> = vec![Vec::new(); n_tiles];
    let mut cost = vec![0u64; n_tiles];
    for (i, s) in spec.segments.iter().enumerate() {
        if s.q_len == 0 || s.k_len == 0 {
            continue;
        }
        let (a, b) = (s.k_start / bn, (s.k_start + s.k_len).div_ceil(bn));
        for (t, list) in per_tile.iter_mut().enumerate().take(b).skip(a) {
            // rows that see a key of the overlap, times the keys in it (upper bound)
            let first = (t * bn).max(s.k_start) - s.k_start;
            let end = ((t + 1) * bn).min(s.k_start + s.k_len) - s.k_start;
            let (r0, r1) = spec.rows_seeing(s, first, end);
            if r0 >= r1 {
                continue;
            }
            list.push(i as u32);
            cost[t] += (r1 - r0) as u64 * bn as u64;
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
    let span = (super::plan::sm_count().div_ceil(spec.dims.heads_kv.max(1)) * bn * bn) as u64;
    // a tile's first segment (none: after every sequence)
    let seq = |&t: &u32| {
        let (a, b) = (tile_off[t as usize], tile_off[t as usize + 1]);
        if a < b { tile_segs[a as usize] } else { u32::MAX }
    };
    super::plan::order_by_cost(&mut order, seq_waves, span, |&t| cost[t as usize], seq);
    (order, tile_off, tile_segs)
}

table_names! {
    /// The tables of a cached backward plan ([`BwdPlan::tables`]).
    pub(crate) enum BwdTable { Segs, QWork, KWork, TileOff, TileSegs, RowSeg, Pages }
}

impl PlanKind for BwdPlan {
    type Table = BwdTable;
}

/// Device addresses of one backward call: q, k, v, out, lse, dout in; dq, dk, dv out; workspace.
#[derive(Debug, Clone, Copy)]
pub struct BwdPtrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub out: u64,
    pub lse: u64,
    pub dout: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub workspace: u64,
}

impl BwdPtrs {
    /// `Err` naming the first buffer whose address the kernels cannot read or write
    /// (`forward::aligned`).
    pub(crate) fn check_aligned(&self) -> Result<()> {
        aligned(&[
            ("q", self.q),
            ("k", self.k),
            ("v", self.v),
            ("out", self.out),
            ("lse", self.lse),
            ("dout", self.dout),
            ("dq", self.dq),
            ("dk", self.dk),
            ("dv", self.dv),
            ("workspace", self.workspace),
        ])
    }
}

/// Workspace parts of a backward call: delta (f32 per row and head) and, on the fused path, the
/// f32 dQ accumulator.
fn workspace_parts(spec: &AttnSpec, mode: DqMode) -> [usize; 2] {
    let d = &spec.dims;
    let acc = if mode == DqMode::Pass { 0 } else { d.q_len() * 4 };
    [d.lse_len() * 4, acc]
}

/// Workspace bytes of a backward call of `spec` on dQ path `mode`.
pub(crate) fn bwd_workspace(spec: &AttnSpec, mode: DqMode) -> usize {
    layout(&workspace_parts(spec, mode)).1
}

/// Device addresses of the workspace parts at `base`: (delta, f32 dQ accumulator; the latter only
/// meaningful on the fused path).
pub(crate) fn workspace_ptrs(spec: &AttnSpec, mode: DqMode, base: u64) -> (u64, u64) {
    let (offs, _) = layout(&workspace_parts(spec, mode));
    (base + offs[0] as u64, base + offs[1] as u64)
}

/// Vector width of the dQ atomics: float2 `atomicAdd` on sm_90+ (where it exists), scalar below.
fn atomic_vec(be: &CudaBackend) -> usize {
    if be.target.float2_atomics { 2 } else { 1 }
}

/// How the backward forms dQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DqPath {
    /// The fused atomic path for `deterministic = false` calls (with the 128-key dK/dV kernel it
    /// measured faster than the pass on every shape, docs/backward.md) except dense d64 calls on
    /// sm_90, where the pass is faster ([`dq_mode`]); the pass for deterministic ones;
    /// `CUBEATTN_BWD_DQ=pass` / `atomic` forces the pass / the fused dQ for non-deterministic
    /// calls (`crate::config`).
    Auto,
    /// The separate deterministic dQ pass.
    Pass,
    /// dQ fused into the dK/dV kernel with f32 atomics (f16/bf16; f32 inputs always use the
    /// row-wise kernels).
    Atomic,
}

/// How one backward call forms dQ ([`dq_mode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DqMode {
    /// The separate dQ pass (deterministic).
    Pass,
    /// Fused into the dK/dV kernel, added to the f32 accumulator in whatever order the cubes
    /// reach it.
    Fused,
}

/// Device workspace of a backward call besides the caller's tensors: delta and, on the fused dQ
/// path, the f32 dQ accumulator; the plan tables are counted by [`backward_plan_bytes`].
pub fn backward_workspace_bytes(spec: &AttnSpec, deterministic: bool) -> u64 {
    if let Some(ps) = super::head_pad::padded(spec, crate::backend::Pass::Backward { deterministic }, super::head_pad::wgmma_padding(None, spec)) {
        // the padded copies around the padded spec's own workspace
        let inner = super::head_pad::bwd_inner(None, &ps, deterministic, DqPath::Auto);
        return super::head_pad::bwd_workspace_padded(spec, &ps, inner) as u64;
    }
    bwd_workspace(spec, dq_mode(None, spec, deterministic, DqPath::Auto)) as u64
}

/// Device bytes of the cached plan tables of a backward call of `spec`.
pub fn backward_plan_bytes(spec: &AttnSpec) -> u64 {
    BwdPlan::new(spec).tables(spec).bytes()
}

/// How the backward of `spec` forms dQ on `path` (`be`: the GPU; `None` counts it a Hopper GPU,
/// for the VRAM estimate): f32 and deterministic calls by the pass (on sm_90 at head_dim 64, 128, 192, 256
/// the wgmma pass, [`dq_sm90`]); the others fused, except where the pass is faster
/// ([`pass_is_faster`]).
pub(crate) fn dq_mode(be: Option<&CudaBackend>, spec: &AttnSpec, deterministic: bool, path: DqPath) -> DqMode {
    if spec.dtype == DType::F32 {
        return DqMode::Pass;
    }
    match path {
        DqPath::Pass => DqMode::Pass,
        DqPath::Atomic => DqMode::Fused,
        DqPath::Auto if deterministic => DqMode::Pass,
        DqPath::Auto if crate::config::get().bwd_dq_atomic => DqMode::Fused,
        DqPath::Auto if crate::config::get().bwd_dq_pass || pass_is_faster(be, spec) => DqMode::Pass,
        DqPath::Auto => DqMode::Fused,
    }
}

/// Whether the dQ pass is the faster path for a non-deterministic call too (`be` `None`: assumed
/// a Hopper GPU), dense f16/bf16 calls on sm_90 at head_dim 192 / 256 with the wgmma pass
/// ([`dq_sm90`]): the split kernel without dQ plus the pass took 14-18% less than the split kernel
/// with the fused dQ, causal 4K / 8K and non-causal 8K (H200, torch path,
/// bench/results/h200-2026-11-29-dq-sm90-d256); not on `flash_bwd_ws_cols` ([`ws_cols_backward`]):
/// at 192 / 128 its fused dQ by the tile took 0.74-0.75x the split kernel plus the pass at 8K
/// (bench/results/h200-2026-12-02-ws192), at 192 / 192 by atomics 0.96-1.02x the time of the
/// kernel without dQ plus the pass (bench/results/h200-2026-12-03-ws-cols).
/// At head_dim 64 the pass was the default until the
/// fused dQ ran on `flash_bwd_ws` with 128-row tiles ([`ws_rows`]): against the ws kernel without
/// dQ plus the pass, fwd+bwd kernel time -6% at 16K causal and not, -2.5% non-causal 8K, the same
/// causal 8K, +2-3% causal 4K (H200, bench/results/h200-2026-11-30-fused-d64).
fn pass_is_faster(be: Option<&CudaBackend>, spec: &AttnSpec) -> bool {
    let hd = spec.dims.head_dim;
    if ws_cols_backward(spec) {
        return false;
    }
    let dense_sm90 = spec.block_sparse().is_none() && be.is_none_or(|be| super::forward::sm90_forward(be, spec));
    dense_sm90 && SPLIT_BWD_HEAD_DIMS.contains(&hd) && be.is_none_or(|be| dq_sm90(be, spec.dtype, hd))
}

/// The refusal of a backward kernel other than the split one and the wgmma dQ pass for a call whose
/// v has head_dim `hv`, q `hd` (`value_dim_native` sends only those calls here).
fn mixed_dims(hd: usize, hv: usize) -> crate::error::Error {
    super::forward::mixed_dims(hd, hv, "the Hopper backward above head_dim 128")
}

/// Runs `$e` with the type alias `$k` bound to the element type of `$dt`.
macro_rules! by_dtype {
    ($dt:expr, $k:ident, $($e:tt)*) => {
        match $dt {
            DType::F16 => { type $k = f16; $($e)* }
            DType::BF16 => { type $k = bf16; $($e)* }
            DType::F32 => { type $k = f32; $($e)* }
        }
    };
}

/// Enqueues delta = rowsum(dO * O) (f32 `[heads_q, total_q]` at `delta`; out and dout at v's
/// head_dim).
pub(crate) fn launch_delta(be: &CudaBackend, spec: &AttnSpec, p: &BwdPtrs, delta: u64, stream: sys::CUstream) -> Result<()> {
    let d = &spec.dims;
    let (hd, dt) = (d.head_dim_v, spec.dtype);
    let f = be.kernels.get(&KernelKey::new("bwd_delta", dt, &[hd as u32]), || {
        by_dtype!(dt, T, codegen(flash_bwd::bwd_delta::BwdDelta::<T, CudaRuntime>::new(
            settings(32 * DELTA_PLANES as u32), be.client().clone(), A, A, A, (), (), hd)))
    })?;
    let mut a = Args::new();
    a.array(p.out, d.out_len()).array(p.dout, d.out_len()).array(delta, d.lse_len()).u32(d.heads_q as u32).u32(d.total_q as u32);
    launch(&f, grid_2d((d.total_q * d.heads_q).div_ceil(DELTA_PLANES)), &mut a, stream)
}

/// Enqueues a zero fill of `n` elements of type `dt` at `ptr` (zero is all-zero bytes in every
/// dtype: `cuMemsetD8Async`, at copy bandwidth).
pub(crate) fn launch_fill_zero(dt: DType, ptr: u64, n: usize, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the callers pass a device buffer of this context holding `n` elements of `dt`,
    // ordered on `stream` before the kernels that accumulate into it.
    unsafe { drv::memset_d8_async(ptr, 0, n * dt.size(), stream) }.map_err(|e| err("cuMemsetD8Async", e))
}

/// Tables of one `flash_bwd_dkdv_wide` launch: work list, tile_off, tile_segs, segs (dense), and
/// the transposed block index (offsets, entries) of the block-sparse variant; a table a variant
/// does not read takes any valid address.
pub(crate) struct DkdvTables {
    pub work: (u64, usize),
    pub tile_off: (u64, usize),
    pub tile_segs: (u64, usize),
    pub segs: (u64, usize),
    pub tq_off: (u64, usize),
    pub tq_list: (u64, usize),
}

/// How the fused dQ of a dK/dV launch reaches the f32 accumulator: by bulk reductions of whole
/// rows (`kernels::bulk_reduce`: sm_90+, head_dim 128, the accumulator 16-byte aligned; the tile
/// adds 34 KB to the kernel's 171 KB) or by float2 atomics from every thread. At d64 the bulk
/// path measured 8% slower fwd+bwd (64 operations of 256 B per tile of half d128's work;
/// docs/measured-and-lost.md), so d64 keeps the atomics.
fn bulk_dq(be: &CudaBackend, hd: usize, acc: u64) -> bool {
    hd == 128 && be.target.bulk_reduce && acc.is_multiple_of(16)
}

/// Stages of the dK/dV kernel's query tile: 2 (the next tile loads during this one's products)
/// where that kernel's shared memory fits the GPU's per-block limit, else 1 (no copy overlaps
/// the products; e.g. an A100, 163 KiB, at d128: 137 against 206 KiB). `CUBEATTN_BWD_Q_STAGES=1`
/// forces one stage (tests of that variant on any GPU).
fn q_stages(be: &CudaBackend, hd: usize, fused: bool, bulk: bool) -> usize {
    let limit = be.target.smem_limit as usize;
    let forced = crate::config::get().bwd_one_q_stage;
    if forced || (limit > 0 && dkdv_smem(hd, fused, bulk, 2) > limit) {
        1
    } else {
        2
    }
}

/// Shared memory (bytes, f16/bf16) of the dK/dV kernel with `qs` query-tile stages, as it lays out
/// its buffers (`flash_bwd_wide`), plus 1 KiB for barriers and alignment.
pub(crate) fn dkdv_smem(hd: usize, fused: bool, bulk: bool, qs: usize) -> usize {
    let row = (hd + PAD) * 2;
    let ps = flash_bwd_wide::p_stages_for(hd, fused, qs);
    let bulk_tile = if fused && bulk { BWD_BM * dq_tile_stride(hd) * 4 } else { 0 };
    2 * WIDE_BN * row + qs * BWD_BM * (2 * row + 8) + 2 * ps * BWD_BM * (WIDE_BN + PAD) * 2 + bulk_tile + 1024
}

/// The dK/dV kernel (`flash_bwd_wide::flash_bwd_dkdv_wide`, f16/bf16; causal and windows are
/// runtime bounds there), dense or block-sparse; `bulk`: fused dQ by bulk reductions; `qvec`:
/// floats per dQ atomic ([`atomic_vec`]); `tma`: query tiles by tensor maps (sm_90+); `qs`: query
/// tile stages ([`q_stages`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn dkdv_wide_kernel(
    be: &CudaBackend,
    dt: DType,
    hd: usize,
    fused: bool,
    bulk: bool,
    qvec: usize,
    sparse: bool,
    paged: bool,
    tma: bool,
    qs: usize,
) -> Result<Func> {
    let key = KernelKey::new(
        "flash_bwd_dkdv_wide",
        dt,
        &[hd as u32, fused as u32, bulk as u32, qvec as u32, sparse as u32, paged as u32, tma as u32, qs as u32],
    );
    be.kernels.get(&key, || dkdv_wide_source(be.client(), dt, hd, fused, bulk, qvec, sparse, paged, tma, qs))
}

/// CUDA source of [`dkdv_wide_kernel`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn dkdv_wide_source(
    client: &ComputeClient<CudaRuntime>,
    dt: DType,
    hd: usize,
    fused: bool,
    bulk: bool,
    qvec: usize,
    sparse: bool,
    paged: bool,
    tma: bool,
    qs: usize,
) -> Result<Source> {
    let src = by_dtype!(dt, T, codegen_exp2(flash_bwd_wide::flash_bwd_dkdv_wide::FlashBwdDkdvWide::<T, CudaRuntime>::new(
        settings(32 * WIDE_PLANES as u32), client.clone(), DkdvArgs::compilation(),
        BWD_LOAD_VEC, qvec, hd, fused, bulk, qvec, sparse, paged, tma, qs), true))?;
    if (fused && bulk) != src.cuda.contains(super::rewrite::BULK_ADD) {
        return Err(crate::error::Error::Device(format!("{}: bulk dQ reductions expected {}, found the opposite", src.entry, fused && bulk)));
    }
    Ok(src)
}

/// The tensor maps of Q and dO over `[total_q, heads_q * head_dim]` with boxes of `(columns,
/// rows, 128-byte swizzle)`: `flash_bwd_wide::q_map_box` padded boxes for the mma.sync kernel,
/// 64 x `BWD_BM` swizzled ones for the Hopper kernel; zeroed (never read) for `None` (no tensor
/// maps below sm_90).
fn q_maps(spec: &AttnSpec, p: &BwdPtrs, boxes: Option<(u32, u32, bool)>) -> Result<[MapArg; 2]> {
    let d = &spec.dims;
    let rows = d.total_q;
    // dO's rows at v's head_dim
    let map = |ptr, cols: usize| -> Result<MapArg> {
        let map = match boxes {
            Some((bc, br, sw128)) => tile_map_2d(spec.dtype, ptr, cols, rows, cols * spec.dtype.size(), bc, br, sw128)?,
            None => sys::CUtensorMap { opaque: [0; 16] },
        };
        Ok(MapArg { map, ptr, rows, cols })
    };
    Ok([map(p.q, d.heads_q * d.head_dim)?, map(p.dout, d.heads_q * d.head_dim_v)?])
}

/// Head dims of the Hopper dK/dV kernel (two warpgroups of 64 keys, dK and dV of 64 keys x
/// head_dim in each warpgroup's registers).
const SM90_BWD_HEAD_DIMS: [usize; 2] = [64, 128];
/// Head dims of the Hopper dK/dV kernel with the products split between its warpgroups
/// (`flash_bwd_sm90_split`: 64 keys a cube, dV in one warpgroup and dK in the other; dQ fused, or
/// by the dQ pass for deterministic calls): with `flash_bwd_ws_cols` ([`ws_cols_backward`]) the
/// backward's only dK/dV kernels there (`CudaBackend::check_target`).
pub(crate) const SPLIT_BWD_HEAD_DIMS: [usize; 2] = [192, 256];

/// Whether the dK/dV kernel of `spec` is the Hopper one (`flash_bwd_sm90`): where the forward is
/// (`forward::sm90_forward`: a GPU with wgmma, f16/bf16, the switch on; `CUBEATTN_CUDA_SM90=0`
/// keeps the mma.sync kernels for both passes), a head_dim of [`SM90_BWD_HEAD_DIMS`], and on the
/// fused path an accumulator the bulk reductions can address (16-byte aligned).
pub(crate) fn sm90_backward(be: &CudaBackend, spec: &AttnSpec, acc: Option<u64>) -> bool {
    super::forward::sm90_forward(be, spec) && SM90_BWD_HEAD_DIMS.contains(&spec.dims.head_dim) && acc.is_none_or(|a| a.is_multiple_of(16) && be.target.bulk_reduce)
}

/// Whether the warp-specialised dK/dV kernel (`flash_bwd_ws`) serves head_dim `hd` (`fused`: with
/// the dQ products): at 128, where fwd+bwd took 1.5-4% less kernel time than with
/// `flash_bwd_sm90` (H200, bench/results/h200-2026-11-29-ws-bwd), and without the fused dQ (the
/// dQ pass's path) at 64 too (2-5% less); with the fused dQ at 64 on dense calls (128-row tiles,
/// [`ws_rows`]; with 64-row tiles the fused d64 kernel was 6-7% slower than `flash_bwd_sm90`,
/// docs/measured-and-lost.md, which keeps the block-sparse fused d64).
/// `CUBEATTN_BWD_SM90_WS=0` turns it off.
fn ws_backward(hd: usize, fused: bool, sparse: bool) -> bool {
    crate::config::get().bwd_sm90_ws && (hd == 128 || (hd == 64 && (!fused || !sparse)))
}

/// Query rows a tile of `flash_bwd_ws` (`ws`): [`flash_bwd_ws::WIDE_BM`] at head_dim 64 on a
/// dense call (a 64-row tile's products are half a d128 tile's while its waits, lse / delta reads
/// and masks stay), else [`BWD_BM`] (the block-sparse walk takes 64-row tiles).
/// `CUBEATTN_BWD_WS_ROWS=64` keeps 64 without the fused dQ.
fn ws_rows(hd: usize, fused: bool, sparse: bool, ws: bool) -> usize {
    if ws && hd == 64 && !sparse && (fused || crate::config::get().bwd_ws_rows != Some(BWD_BM)) {
        flash_bwd_ws::WIDE_BM
    } else {
        BWD_BM
    }
}

/// Comptime choices of the Hopper dK/dV kernel up to head_dim 128: `fused` dQ (by `qvec`-float
/// atomics or bulk reductions), block-`sparse`, `paged` K/V, the warp-specialised frame (`ws`:
/// `flash_bwd_ws::flash_bwd_ws`, else `flash_bwd_sm90::flash_bwd_sm90`) and its query rows a
/// tile (`bm`: [`ws_rows`]; [`BWD_BM`] for `flash_bwd_sm90`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sm90Dkdv {
    pub hd: usize,
    pub fused: bool,
    pub qvec: usize,
    pub sparse: bool,
    pub paged: bool,
    pub ws: bool,
    pub bm: usize,
}

/// The Hopper dK/dV kernel of choices `v` (the ws frame where [`ws_backward`]).
pub(crate) fn dkdv_sm90_kernel(be: &CudaBackend, dt: DType, v: Sm90Dkdv) -> Result<Func> {
    let name = if v.ws { "flash_bwd_ws" } else { "flash_bwd_sm90" };
    let key = KernelKey::new(name, dt, &[v.hd as u32, v.fused as u32, v.qvec as u32, v.sparse as u32, v.paged as u32, v.bm as u32]);
    be.kernels.get(&key, || dkdv_sm90_source(be.client(), dt, v))
}

/// The Hopper dK/dV kernel above head_dim 128 (`flash_bwd_sm90_split`; `hv`: v's head_dim, `hd`
/// but where [`value_dim_native`] holds; `fused`: dQ by `qvec`-float atomics, else none).
#[allow(clippy::too_many_arguments)]
pub(crate) fn dkdv_split_kernel(be: &CudaBackend, dt: DType, hd: usize, hv: usize, fused: bool, qvec: usize, paged: bool) -> Result<Func> {
    let key = KernelKey::new("flash_bwd_sm90_split", dt, &[hd as u32, hv as u32, fused as u32, qvec as u32, paged as u32]);
    be.kernels.get(&key, || dkdv_split_source(be.client(), dt, hd, hv, fused, qvec, paged))
}

/// Whether the dK/dV kernel of `spec` is the column-split warp-specialised one
/// (`flash_bwd_ws_cols`: three consumer warpgroups of 32 keys and 64 columns, 96-key cubes): q
/// and k at 192 with v at 128 (DeepSeek's MLA; at 64 its producer spills 128 bytes at 24
/// registers) or 192; f16 / bf16, dense keys, not paged (paged calls with v narrower run v padded:
/// `head_pad`). A function of the spec alone: the plan's key tiles follow it. Elsewhere above
/// head_dim 128 (256: its two-consumer form measured level, docs/measured-and-lost.md)
/// `flash_bwd_sm90_split`. `CUBEATTN_BWD_SM90_WS=0` turns it off.
pub(crate) fn ws_cols_backward(spec: &AttnSpec) -> bool {
    let d = &spec.dims;
    crate::config::get().bwd_sm90_ws
        && spec.dtype != DType::F32
        && d.head_dim == 192
        && matches!(d.head_dim_v, 128 | 192)
        && spec.block_sparse().is_none()
        && spec.kv_pages().is_none()
}

/// The column-split warp-specialised dK/dV kernel ([`ws_cols_backward`]; `hv`: v's head_dim;
/// `fused`: dQ by bulk reductions into the head-major accumulator where [`ws_cols_dq_tile`] holds,
/// else by `qvec`-float atomics into the token-major one; else none).
pub(crate) fn dkdv_ws_cols_kernel(be: &CudaBackend, dt: DType, hv: usize, fused: bool, qvec: usize) -> Result<Func> {
    let key = KernelKey::new("flash_bwd_ws_cols", dt, &[hv as u32, fused as u32, qvec as u32]);
    be.kernels.get(&key, || dkdv_ws_cols_source(be.client(), dt, hv, fused, qvec))
}

/// CUDA source of [`dkdv_ws_cols_kernel`]: the `kernels::sm90` markers lowered, one cube per SM.
pub(crate) fn dkdv_ws_cols_source(client: &ComputeClient<CudaRuntime>, dt: DType, hv: usize, fused: bool, qvec: usize) -> Result<Source> {
    let mut src = by_dtype!(dt, T, codegen_exp2(flash_bwd_ws_cols::flash_bwd_ws_cols::FlashBwdWsCols::<T, CudaRuntime>::new(
        settings(BWD_WS_COLS_THREADS as u32), client.clone(), DkdvArgs::compilation(),
        BWD_LOAD_VEC, qvec, hv, fused, qvec), true))?;
    src.cuda = super::rewrite::sm90::lower_bounded(&src.entry, &src.cuda, 1)?;
    Ok(src)
}

/// Whether the backward of `spec`, q and k at head_dim `hd` (the spec's or a padded one's), runs v
/// (and out, dout, dv) at v's own head_dim (`Dims::head_dim_v`, narrower: DeepSeek's MLA 192 /
/// 128) rather than padded to `hd` (`head_pad`), on a GPU with wgmma: `flash_bwd_sm90_split` and
/// the wgmma dQ pass (`hd` 192 or 256, f16 / bf16, dense keys, not paged, the Hopper switches on),
/// v a whole number of 64-column chunks.
pub(crate) fn value_dim_native(spec: &AttnSpec, hd: usize) -> bool {
    crate::config::fwd_options().sm90
        && crate::config::get().bwd_dq_sm90
        && SPLIT_BWD_HEAD_DIMS.contains(&hd)
        && super::forward::narrower_v_chunks(spec, hd)
}

/// CUDA source of [`dkdv_split_kernel`]: the `kernels::sm90` markers lowered, one cube per SM.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dkdv_split_source(
    client: &ComputeClient<CudaRuntime>,
    dt: DType,
    hd: usize,
    hv: usize,
    fused: bool,
    qvec: usize,
    paged: bool,
) -> Result<Source> {
    let mut src = by_dtype!(dt, T, codegen_exp2(flash_bwd_sm90_split::flash_bwd_sm90_split::FlashBwdSm90Split::<T, CudaRuntime>::new(
        settings(SM90_BWD_THREADS as u32), client.clone(), DkdvArgs::compilation(),
        BWD_LOAD_VEC, qvec, hd, hv, fused, qvec, paged), true))?;
    src.cuda = super::rewrite::sm90::lower_bounded(&src.entry, &src.cuda, 1)?;
    Ok(src)
}

/// CUDA source of [`dkdv_sm90_kernel`]: the `kernels::sm90` markers lowered, one cube per SM
/// (`__launch_bounds__(threads, 1)`, which `setmaxnreg` needs).
pub(crate) fn dkdv_sm90_source(client: &ComputeClient<CudaRuntime>, dt: DType, v: Sm90Dkdv) -> Result<Source> {
    let Sm90Dkdv { hd, fused, qvec, sparse, paged, ws, bm } = v;
    let mut src = if ws {
        by_dtype!(dt, T, codegen_exp2(flash_bwd_ws::flash_bwd_ws::FlashBwdWs::<T, CudaRuntime>::new(
            settings(BWD_WS_THREADS as u32), client.clone(), DkdvArgs::compilation(),
            BWD_LOAD_VEC, qvec, hd, fused, qvec, sparse, paged, bm), true))?
    } else {
        by_dtype!(dt, T, codegen_exp2(flash_bwd_sm90::flash_bwd_sm90::FlashBwdSm90::<T, CudaRuntime>::new(
            settings(SM90_BWD_THREADS as u32), client.clone(), DkdvArgs::compilation(),
            BWD_LOAD_VEC, qvec, hd, fused, qvec, sparse, paged), true))?
    };
    // the fused dQ: `flash_bwd_ws` adds whole tiles to the head-major accumulator (`sm90::bulk_add_f32`,
    // lowered below), `flash_bwd_sm90` rows of the row-major one
    let marker = if ws { format!("{}bulk_add\"", crate::kernels::sm90::MARK) } else { super::rewrite::BULK_ADD.to_string() };
    if fused != src.cuda.contains(&marker) {
        return Err(crate::error::Error::Device(format!("{}: bulk dQ reductions expected {fused}, found the opposite", src.entry)));
    }
    src.cuda = super::rewrite::sm90::lower_bounded(&src.entry, &src.cuda, 1)?;
    Ok(src)
}

/// Whether the dense dK/dV cubes, and the dQ pass's (query tile, q head) cubes, go kv head outer
/// (`grid::cube_item_slot`): non-causal calls without a window (their tiles all cost the same). The cubes running at once then share one
/// kv head's query tiles and dQ rows in L2 (ncu, non-causal 32K heads fastest: 310 GB of DRAM
/// traffic, L2 hit rate 42%; cuDNN's 5.4 GB, 98%): 3.4% less fwd+bwd time at 32K
/// (bench/results/h200-2026-11-29-bwd-order); with the one-add dQ also 1.5 / 2.5% less at 8K / 16K
/// and the same at 4K (h200x2-2026-11-29-two-tiles; before, only launches whose key tiles filled a
/// wave took it). Causal calls keep heads fastest (the work list's most expensive tiles of every
/// head first): kv head outer made causal 4K / 8K 29% / 7% slower (the last heads' longest tiles
/// start late), 16K 2% faster, 32K the same. The dQ pass takes the same rule: its causal cubes kv
/// head outer measured level to +2.8% (bench/results/h200-2026-12-03-order-rules). `over`: the
/// launch's override (`CUBEATTN_BWD_ORDER` for the dK/dV cubes, `CUBEATTN_DQ_ORDER` for the dQ
/// pass's). Measured on the Hopper kernels only: the mma.sync kernel (`hopper` false) keeps heads
/// fastest.
fn kv_outer(over: Option<bool>, spec: &AttnSpec, hopper: bool) -> bool {
    over.unwrap_or(super::kv_outer_default(spec, hopper))
}

/// Enqueues the dK/dV kernel over `n_work` work items x heads_kv: dense, 128-key tiles of the
/// shared key axis; block-sparse (`sparse` = (q_block, index heads, key blocks per sequence slot,
/// query tiles per query block)), items of at most 128 keys of one key block. `acc`: the f32 dQ
/// accumulator of the fused path. On sm_90 the Hopper kernel ([`sm90_backward`]), else
/// `flash_bwd_dkdv_wide`; both take the dK / dV card ([`DkdvArgs`]). Returns whether the kernel
/// adds to the accumulator head-major (`flash_bwd_ws`: [`launch_dq_convert`]'s `head_major`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_dkdv_wide(
    be: &CudaBackend,
    spec: &AttnSpec,
    p: &BwdPtrs,
    delta: u64,
    acc: Option<u64>,
    t: &DkdvTables,
    sparse: Option<[u32; 4]>,
    n_work: usize,
    stream: sys::CUstream,
) -> Result<bool> {
    let d = &spec.dims;
    let (win_l, win_r, _) = window_bounds(spec);
    let paged = spec.kv_pages().is_some() && sparse.is_none();
    let qvec = atomic_vec(be);
    // `hopper`: a wgmma kernel (the split or the sm90 / ws one), not the mma.sync one
    // `head_major`: the fused dQ's accumulator is `[heads_q, total_q, head_dim]` (`flash_bwd_ws`)
    let mut head_major = false;
    let (f, [q_map, do_map], hopper) = if SPLIT_BWD_HEAD_DIMS.contains(&d.head_dim) {
        // the only kernel above head_dim 128 (`CudaBackend::check_target` refused other GPUs;
        // the block-sparse kernels serve 64 and 128 only)
        if sparse.is_some() || !super::forward::sm90_forward(be, spec) {
            return Err(crate::error::Error::Unsupported {
                backend: "cuda",
                msg: format!("head_dim {} backward: only the Hopper kernel (dense key sets, sm_90)", d.head_dim),
            });
        }
        let f = if ws_cols_backward(spec) {
            head_major = acc.is_some() && ws_cols_dq_tile(d.head_dim_v);
            dkdv_ws_cols_kernel(be, spec.dtype, d.head_dim_v, acc.is_some(), qvec)?
        } else {
            dkdv_split_kernel(be, spec.dtype, d.head_dim, d.head_dim_v, acc.is_some(), qvec, paged)?
        };
        (f, q_maps(spec, p, Some((SW_COLS as u32, BWD_BM as u32, true)))?, true)
    } else if !d.is_uniform() {
        return Err(mixed_dims(d.head_dim, d.head_dim_v));
    } else if sm90_backward(be, spec, acc) {
        let (hd, fused) = (d.head_dim, acc.is_some());
        let ws = ws_backward(hd, fused, sparse.is_some());
        let bm = ws_rows(hd, fused, sparse.is_some(), ws);
        let v = Sm90Dkdv { hd, fused, qvec, sparse: sparse.is_some(), paged, ws, bm };
        head_major = v.ws && fused;
        let f = dkdv_sm90_kernel(be, spec.dtype, v)?;
        (f, q_maps(spec, p, Some((SW_COLS as u32, bm as u32, true)))?, true)
    } else {
        let bulk = acc.is_some_and(|a| bulk_dq(be, d.head_dim, a));
        // full query tiles by tensor maps on sm_90+ (the pointers are 16-byte aligned:
        // `BwdPtrs::check_aligned`)
        let tma = be.target.tma;
        let qs = q_stages(be, d.head_dim, acc.is_some(), bulk);
        let f = dkdv_wide_kernel(be, spec.dtype, d.head_dim, acc.is_some(), bulk, qvec, sparse.is_some(), paged, tma, qs)?;
        let (bc, br) = flash_bwd_wide::q_map_box(d.head_dim);
        (f, q_maps(spec, p, tma.then_some((bc, br, false)))?, false)
    };
    let (ql, kl, ll) = (d.q_len(), d.kv_len(), d.lse_len());
    let (vl, ol) = (d.v_len(), d.out_len());
    // the f32 dQ accumulator of the fused path (as atomics of `qvec` floats and as the bulk
    // reductions' rows); without it any valid address
    let acc = match acc {
        Some(a) => (a, ql / qvec),
        None => (delta, 1),
    };
    let [q_block, idx_heads, k_blocks, q_tiles_per_block] = sparse.unwrap_or([1, d.heads_kv as u32, 1, 1]);
    let args = DkdvArgs {
        q_map,
        do_map,
        k: (p.k, kl / BWD_LOAD_VEC),
        v: (p.v, vl / BWD_LOAD_VEC),
        lse: (p.lse, ll),
        delta: (delta, ll),
        dk: (p.dk, kl),
        dv: (p.dv, vl),
        dq_acc: acc,
        dq_rows: acc,
        q_s: (p.q, ql),
        do_s: (p.dout, ol),
        ktiles: t.work,
        tile_off: t.tile_off,
        tile_segs: t.tile_segs,
        segs: t.segs,
        tq_off: t.tq_off,
        tq_list: t.tq_list,
        scale: spec.scale,
        scale_log2: spec.scale * LOG2E,
        heads_q: d.heads_q as u32,
        heads_kv: d.heads_kv as u32,
        total_q: d.total_q as u32,
        total_k: d.total_k as u32,
        q_block,
        idx_heads,
        k_blocks,
        q_tiles_per_block,
        win_l,
        win_r,
        kv_outer: (sparse.is_none() && kv_outer(crate::config::get().bwd_order, spec, hopper)) as u32,
    };
    launch(&f, ((n_work * d.heads_kv) as u32, 1, 1), &mut args.args(), stream)?;
    Ok(head_major)
}

/// The dQ pass kernel (`flash_bwd::flash_bwd_dq`, f16/bf16) for one set of comptime choices
/// (`tma`: full key tiles by tensor maps, sm_90+).
pub(crate) fn dq_kernel(be: &CudaBackend, dt: DType, hd: usize, sparse: bool, window: bool, paged: bool, tma: bool) -> Result<Func> {
    let key = KernelKey::new("flash_bwd_dq", dt, &[hd as u32, sparse as u32, window as u32, paged as u32, tma as u32]);
    be.kernels.get(&key, || dq_source(be.client(), dt, hd, sparse, window, paged, tma))
}

/// CUDA source of [`dq_kernel`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn dq_source(
    client: &ComputeClient<CudaRuntime>,
    dt: DType,
    hd: usize,
    sparse: bool,
    window: bool,
    paged: bool,
    tma: bool,
) -> Result<Source> {
    by_dtype!(dt, T, codegen_exp2(flash_bwd::flash_bwd_dq::FlashBwdDq::<T, CudaRuntime>::new(
        settings(32 * BWD_PLANES as u32), client.clone(), DqArgs::compilation(),
        BWD_LOAD_VEC, hd, sparse, window, paged, tma), true))
}

/// Whether the dQ pass runs the Hopper kernel (`flash_bwd_dq_sm90`): wgmma and tensor maps
/// (`Target`), f16 / bf16, head_dim 64, 128, 192 or 256, the switch on (`CUBEATTN_BWD_DQ_SM90`).
pub(crate) fn dq_sm90(be: &CudaBackend, dt: DType, hd: usize) -> bool {
    crate::config::get().bwd_dq_sm90 && be.target.wgmma && be.target.tma && dt != DType::F32 && matches!(hd, 64 | 128 | 192 | 256)
}

/// The Hopper dQ pass kernel for one set of comptime choices (`hv`: v's and dO's head_dim).
#[allow(clippy::too_many_arguments)]
pub(crate) fn dq_sm90_kernel(be: &CudaBackend, dt: DType, hd: usize, hv: usize, sparse: bool, window: bool, paged: bool) -> Result<Func> {
    let key = KernelKey::new("flash_bwd_dq_sm90", dt, &[hd as u32, hv as u32, sparse as u32, window as u32, paged as u32]);
    be.kernels.get(&key, || dq_sm90_source(be.client(), dt, hd, hv, sparse, window, paged))
}

/// CUDA source of [`dq_sm90_kernel`]: the `kernels::sm90` markers lowered, the cubes an SM declared
/// by shared memory: three at head_dim 64 (48 KiB a cube), two at 128 (96 KiB), one at 192 / 256
/// (144 / 192 KiB).
#[allow(clippy::too_many_arguments)]
pub(crate) fn dq_sm90_source(
    client: &ComputeClient<CudaRuntime>,
    dt: DType,
    hd: usize,
    hv: usize,
    sparse: bool,
    window: bool,
    paged: bool,
) -> Result<Source> {
    let mut src = by_dtype!(dt, T, codegen_exp2(flash_bwd_dq_sm90::flash_bwd_dq_sm90::FlashBwdDqSm90::<T, CudaRuntime>::new(
        settings(DQ_SM90_THREADS as u32), client.clone(), DqArgs::compilation(), BWD_LOAD_VEC, hd, hv, sparse, window, paged), true))?;
    src.cuda = super::rewrite::sm90::lower_bounded(&src.entry, &src.cuda, match hd { 0..=64 => 3, 65..=128 => 2, _ => 1 })?;
    Ok(src)
}

/// Enqueues the dQ pass (f16/bf16: `flash_bwd_dq_sm90` where [`dq_sm90`], else `flash_bwd_dq`) over
/// `n_work` work items x heads_q. `tables`:
/// work list, segs, and the block-sparse tile_ref and block ids (any valid address when dense);
/// `sparse`: (index heads, k_block, key tiles per key block) of the block-sparse variant. The
/// kernel takes the dQ card ([`DqArgs`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_dq(
    be: &CudaBackend,
    spec: &AttnSpec,
    p: &BwdPtrs,
    delta: u64,
    tables: [(u64, usize); 4],
    sparse: Option<[u32; 3]>,
    n_work: usize,
    stream: sys::CUstream,
) -> Result<()> {
    let d = &spec.dims;
    let (hd, hv, dt) = (d.head_dim, d.head_dim_v, spec.dtype);
    let (ql, kl, ll) = (d.q_len(), d.kv_len(), d.lse_len());
    let (win_l, win_r, window) = window_bounds(spec);
    let paged = spec.kv_pages().is_some() && sparse.is_none();
    let hopper = dq_sm90(be, dt, hd);
    let (f, [k_map, v_map]) = if hopper {
        (dq_sm90_kernel(be, dt, hd, hv, sparse.is_some(), window, paged)?, kv_maps_sw128(spec, p.k, p.v, BWD_BN)?)
    } else if hv != hd {
        return Err(mixed_dims(hd, hv));
    } else {
        // full key tiles by tensor maps on sm_90+ (`BwdPtrs::check_aligned`)
        let tma = super::forward::kv_tma(be, hd);
        (dq_kernel(be, dt, hd, sparse.is_some(), window, paged, tma)?, kv_maps(be, spec, p.k, p.v, BWD_BN, false)?)
    };
    let qv = ql / BWD_LOAD_VEC;
    let [work, segs, tile_ref, blocks] = tables;
    let [idx_heads, k_block, tiles_per_block] = sparse.unwrap_or([d.heads_q as u32, BWD_BN as u32, 1]);
    let args = DqArgs {
        k_map,
        v_map,
        q: (p.q, qv),
        dout: (p.dout, d.out_len() / BWD_LOAD_VEC),
        lse: (p.lse, ll),
        delta: (delta, ll),
        dq: (p.dq, ql),
        k_s: (p.k, kl),
        v_s: (p.v, d.v_len()),
        work,
        segs,
        tile_ref,
        blocks,
        scale: spec.scale,
        scale_log2: spec.scale * LOG2E,
        heads_q: d.heads_q as u32,
        heads_kv: d.heads_kv as u32,
        total_q: d.total_q as u32,
        idx_heads,
        k_block,
        tiles_per_block,
        win_l,
        win_r,
        // dense non-causal: the cubes running at once share one kv head's K / V in L2
        kv_outer: (sparse.is_none() && kv_outer(crate::config::get().dq_order, spec, hopper)) as u32,
    };
    launch(&f, ((n_work * d.heads_q) as u32, 1, 1), &mut args.args(), stream)
}

/// The fused path's last step: dq = scale * acc (the f32 accumulator at `acc`, row-major as dQ, or
/// `head_major` as `flash_bwd_ws` adds to it) in the dtype.
pub(crate) fn launch_dq_convert(be: &CudaBackend, spec: &AttnSpec, p: &BwdPtrs, acc: u64, head_major: bool, stream: sys::CUstream) -> Result<()> {
    let (dt, d, n) = (spec.dtype, &spec.dims, spec.dims.q_len() / CONVERT_VEC);
    let hd = if head_major { d.head_dim } else { 0 };
    let f = be.kernels.get(&KernelKey::new("dq_convert", dt, &[CONVERT_VEC as u32, hd as u32]), || {
        by_dtype!(dt, T, codegen(flash_bwd::dq_convert::DqConvert::<T, CudaRuntime>::new(
            settings(256), be.client().clone(), A, A, (), (), (), CONVERT_VEC, hd)))
    })?;
    let mut a = Args::new();
    a.array(acc, n).array(p.dq, n).f32(spec.scale).u32(d.heads_q as u32).u32(d.total_q as u32);
    launch(&f, grid_2d(n.div_ceil(256)), &mut a, stream)
}

/// Enqueues the backward of `spec` on `stream` (delta, dK/dV, dQ on path `mode`; plus the zero
/// fill of dQ rows that no segment covers, or of the f32 accumulator on the fused path). `plan`
/// must be the cached plan of `spec`. Needs `total_q > 0` and `total_k > 0`.
pub(crate) fn launch_backward(
    be: &CudaBackend,
    spec: &AttnSpec,
    plan: &Cached<BwdPlan>,
    p: &BwdPtrs,
    mode: DqMode,
    stream: sys::CUstream,
) -> Result<()> {
    let d = &spec.dims;
    let hd = d.head_dim;
    let (ql, kl, ll) = (d.q_len(), d.kv_len(), d.lse_len());
    let dt = spec.dtype;
    let client = be.client();
    let t = |i| plan.tables.get(i);
    let (delta, acc) = workspace_ptrs(spec, mode, p.workspace);
    let fused = mode == DqMode::Fused;
    let (win_l, win_r, _) = window_bounds(spec);

    launch_delta(be, spec, p, delta, stream)?;

    let paged = spec.kv_pages().is_some();
    if dt == DType::F32 {
        let threads = 32 * F32_ROWS_PER_CUBE as u32;
        let f = be.kernels.get(&KernelKey::new("rowwise_bwd_dkdv_f32", dt, &[hd as u32, paged as u32]), || {
            codegen(rowwise_bwd::rowwise_bwd_dkdv_f32::RowwiseBwdDkdvF32::<CudaRuntime>::new(
                settings(threads), client.clone(), A, A, A, A, A, A, A, A, A, A, A, (), (), (), (), (), (), (), A, hd, paged))
        })?;
        let mut a = Args::new();
        a.array(p.q, ql).array(p.k, kl).array(p.v, kl).array(p.dout, ql).array(p.lse, ll).array(delta, ll);
        a.array(p.dk, kl).array(p.dv, kl);
        for i in [BwdTable::TileOff, BwdTable::TileSegs, BwdTable::Segs] {
            a.array(t(i).0, t(i).1);
        }
        a.f32(spec.scale).u32(d.heads_q as u32).u32(d.heads_kv as u32).u32(d.total_q as u32).u32(d.total_k as u32);
        a.u32(win_l).u32(win_r).array(t(BwdTable::Pages).0, t(BwdTable::Pages).1);
        launch(&f, (d.total_k.div_ceil(F32_ROWS_PER_CUBE) as u32, d.heads_kv as u32, 1), &mut a, stream)?;

        let f = be.kernels.get(&KernelKey::new("rowwise_bwd_dq_f32", dt, &[hd as u32, paged as u32]), || {
            codegen(rowwise_bwd::rowwise_bwd_dq_f32::RowwiseBwdDqF32::<CudaRuntime>::new(
                settings(threads), client.clone(), A, A, A, A, A, A, A, A, A, (), (), (), (), (), (), A, hd, paged))
        })?;
        let mut a = Args::new();
        a.array(p.q, ql).array(p.k, kl).array(p.v, kl).array(p.dout, ql).array(p.lse, ll).array(delta, ll);
        a.array(p.dq, ql);
        for i in [BwdTable::RowSeg, BwdTable::Segs] {
            a.array(t(i).0, t(i).1);
        }
        a.f32(spec.scale).u32(d.heads_q as u32).u32(d.heads_kv as u32).u32(d.total_q as u32).u32(win_l).u32(win_r);
        a.array(t(BwdTable::Pages).0, t(BwdTable::Pages).1);
        return launch(&f, (d.total_q.div_ceil(F32_ROWS_PER_CUBE) as u32, d.heads_q as u32, 1), &mut a, stream);
    }

    let n_k_work = plan.host.k_work.len();
    let n_q_work = plan.host.q_work.len() / 2;
    if fused {
        launch_fill_zero(DType::F32, acc, ql, stream)?;
    } else if spec.uncovered_rows() > 0 {
        launch_fill_zero(dt, p.dq, ql, stream)?;
    }
    // the accumulator's layout (all zeros, either way, without a dK/dV launch)
    let mut head_major = false;
    if n_k_work > 0 {
        // the transposed block index is not read by the dense variant: any valid address for
        // `tq_off`; `tq_list` carries the page table (read only by the paged variant)
        let w = DkdvTables {
            work: t(BwdTable::KWork),
            tile_off: t(BwdTable::TileOff),
            tile_segs: t(BwdTable::TileSegs),
            segs: t(BwdTable::Segs),
            tq_off: (t(BwdTable::Segs).0, 1),
            tq_list: t(BwdTable::Pages),
        };
        head_major = launch_dkdv_wide(be, spec, p, delta, fused.then_some(acc), &w, None, n_k_work, stream)?;
    }
    if fused {
        launch_dq_convert(be, spec, p, acc, head_major, stream)?;
    } else if n_q_work > 0 {
        // no tile list: any valid address; `blocks` carries the page table (read only when paged)
        let none = (t(BwdTable::Segs).0, 1);
        launch_dq(be, spec, p, delta, [t(BwdTable::QWork), t(BwdTable::Segs), none, t(BwdTable::Pages)], None, n_q_work, stream)?;
    }
    Ok(())
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
        self.backward_host(spec, q, k, v, grad, Some(poison), DqPath::Auto)
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
        self.backward_host(spec, q, k, v, grad, Some(poison), path)
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
        self.backward_host(spec, q, k, v, grad, None, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::tiles::ws_cols_smem;
    use crate::spec::TensorMeta;

    fn spec(dtype: DType, d: usize, causal: bool) -> AttnSpec {
        let m = |h| TensorMeta::new(&[300, h, d], dtype);
        AttnSpec::varlen(&m(8), &m(2), &m(2), &[0, 100, 300], &[0, 100, 300], 200, 200, None, causal).unwrap()
    }

    /// The dQ path each call takes (no GPU: `be` None counts it a Hopper GPU, as the VRAM estimate
    /// does), and the workspace each path needs.
    #[test]
    fn dq_mode_follows_deterministic_dtype_and_head_dim() {
        let (b128, b64, f32s) = (spec(DType::BF16, 128, true), spec(DType::F16, 64, false), spec(DType::F32, 128, true));
        assert_eq!(dq_mode(None, &b128, true, DqPath::Auto), DqMode::Pass, "deterministic calls take the pass");
        assert_eq!(dq_mode(None, &b64, true, DqPath::Auto), DqMode::Pass, "deterministic d64 takes the pass");
        if !crate::config::get().bwd_dq_pass {
            assert_eq!(dq_mode(None, &b64, false, DqPath::Auto), DqMode::Fused, "d64: the fused dQ on 128-row tiles");
        }
        let b256 = spec(DType::BF16, 256, true);
        if !crate::config::get().bwd_dq_atomic {
            assert_eq!(dq_mode(None, &b256, false, DqPath::Auto), DqMode::Pass, "d256 on sm_90: the pass is faster");
        }
        let b192 = spec(DType::BF16, 192, true);
        if !crate::config::get().bwd_dq_pass && ws_cols_backward(&b192) {
            assert_eq!(dq_mode(None, &b192, false, DqPath::Auto), DqMode::Fused, "192 / 192 on flash_bwd_ws_cols: its fused dQ");
        }
        assert_eq!(dq_mode(None, &b64, false, DqPath::Atomic), DqMode::Fused);
        assert_eq!(dq_mode(None, &f32s, true, DqPath::Auto), DqMode::Pass);
        assert_eq!(dq_mode(None, &f32s, false, DqPath::Atomic), DqMode::Pass, "f32 always takes the pass");
        assert_eq!(dq_mode(None, &b128, true, DqPath::Pass), DqMode::Pass);
        assert_eq!(dq_mode(None, &b128, true, DqPath::Atomic), DqMode::Fused);
        if !crate::config::get().bwd_dq_pass {
            assert_eq!(dq_mode(None, &b128, false, DqPath::Auto), DqMode::Fused);
        }
        let d = &b128.dims;
        let (lse, acc) = (d.lse_len() * 4, d.q_len() * 4);
        assert_eq!(workspace_parts(&b128, DqMode::Pass), [lse, 0]);
        assert_eq!(workspace_parts(&b128, DqMode::Fused), [lse, acc]);
        // the parts do not overlap: the accumulator starts past delta's end
        let (delta, a) = workspace_ptrs(&b128, DqMode::Fused, 0);
        assert!(delta + lse as u64 <= a && a as usize + acc <= bwd_workspace(&b128, DqMode::Fused));
    }

    /// Every head_dim pair `flash_bwd_ws_cols` serves fits an SM's 227 KiB with its dQ path (lse,
    /// delta, dQ destinations and barriers take under 2 KiB beside the tiles), and only v at 128
    /// has room for the dQ tile.
    #[test]
    fn ws_cols_tiles_fit_shared_memory() {
        let m = |h, d| TensorMeta::new(&[300, h, d], DType::BF16);
        let mut served = vec![];
        for (hd, hv) in [(192, 64), (192, 128), (192, 192), (256, 128), (256, 256), (128, 128)] {
            let s = AttnSpec::varlen(&m(8, hd), &m(2, hd), &m(2, hv), &[0, 100, 300], &[0, 100, 300], 200, 200, None, true).unwrap();
            if ws_cols_backward(&s) {
                served.push((hd, hv));
                assert!(ws_cols_smem(hv, ws_cols_dq_tile(hv)) + 2048 <= 227 * 1024, "{hd} / {hv}");
                assert_eq!(key_tile(&s), WS_COLS_BN);
            }
        }
        if crate::config::get().bwd_sm90_ws {
            assert_eq!(served, [(192, 128), (192, 192)]);
        }
        assert!(ws_cols_dq_tile(128) && !ws_cols_dq_tile(192));
    }

    #[test]
    fn ws_query_tiles_are_wide_only_on_dense_d64_calls() {
        let wide = crate::config::get().bwd_ws_rows != Some(BWD_BM);
        assert_eq!(ws_rows(64, false, false, true), if wide { flash_bwd_ws::WIDE_BM } else { BWD_BM });
        // the block-sparse walk, d128 and the non-ws kernel keep 64 rows
        assert_eq!(ws_rows(64, true, false, true), flash_bwd_ws::WIDE_BM);
        assert_eq!(ws_rows(64, false, true, true), BWD_BM);
        assert_eq!(ws_rows(64, true, true, true), BWD_BM);
        assert_eq!(ws_rows(128, false, false, true), BWD_BM);
        assert_eq!(ws_rows(64, false, false, false), BWD_BM);
    }
}
