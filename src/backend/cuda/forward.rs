//! CUDA forward: host side of the kernels in `kernels::flash_fwd` and `kernels::rowwise_fwd`.
//!
//! Launch order on the caller's stream (f16/bf16): the non-finite-v flag (zeroed, then
//! `v_nonfinite`: [`super::nonfinite`]), the zero fill of rows no segment covers (when there are
//! any), the tensor-core kernel over the cached work list, the split-K combine (when the plan split
//! long tiles), then the exact row-wise kernel. The flag picks on the device which of the two paths
//! writes the outputs: the tensor-core kernels return at once when v holds a NaN or Inf, the exact
//! kernel when it does not. f32 inputs run the plain row-wise kernel (exact already).
//!
//! Workspace (caller-provided device memory, [`fwd_workspace`]): the flag (one u32), the split-K
//! partial outputs (f32 rows x head_dim) and their LSE. The plan tables live in the backend's plan
//! cache.

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cudarc::driver::sys;
use half::{bf16, f16};

use super::card::FwdArgs;
use super::compile::{codegen, codegen_exp2, settings, KernelKey, Source, A};
use super::driver::tile_map_2d;
use super::launch::{launch, Args, MapArg};
use super::nonfinite::{launch_dense_exact, launch_flag, DenseExact, FLAG_BYTES};
use super::plans::{table_names, PlanKind, TableSet};
use super::{fwd_options, window_bounds, CudaBackend, Plan};
use crate::dtype::DType;
use crate::error::{invalid, Result};
use crate::kernels::flash_fwd::{self, BLOCK_M};
use crate::kernels::flash_fwd_decode;
use crate::kernels::flash_fwd_sm90::{self, SM90_THREADS};
use crate::kernels::flash_fwd_ws::{self, WS_THREADS};
use crate::kernels::kv_tiles::{box_rows, kv_map_box};
use crate::kernels::sm90::SW_COLS;
use crate::kernels::math::LOG2E;
use crate::spec::Window;
use crate::kernels::rowwise_fwd::{self, ROWS_PER_CUBE};
use crate::spec::AttnSpec;

/// Device addresses of one forward call: q, k, v in; out, lse out; the workspace.
#[derive(Debug, Clone, Copy)]
pub struct FwdPtrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub out: u64,
    pub lse: u64,
    pub workspace: u64,
}

impl FwdPtrs {
    /// `Err` naming the first buffer whose address the kernels cannot read: they copy 16-byte
    /// words of q, k, v (cp.async) and write out the same way. A contiguous view at an odd
    /// element offset would otherwise fault on the device and take the context with it.
    pub(crate) fn check_aligned(&self) -> Result<()> {
        aligned(&[("q", self.q), ("k", self.k), ("v", self.v), ("out", self.out), ("lse", self.lse), ("workspace", self.workspace)])
    }
}

/// `Err` naming the first of `bufs` whose device address is not 16-byte aligned.
pub(crate) fn aligned(bufs: &[(&'static str, u64)]) -> Result<()> {
    match bufs.iter().find(|(_, p)| !p.is_multiple_of(16)) {
        Some(&(name, p)) => Err(invalid(name, format!("device address {p:#x} is not 16-byte aligned (the kernels copy 16-byte words)"))),
        None => Ok(()),
    }
}

/// Byte offsets of the workspace parts, each 256-byte aligned.
pub(crate) fn layout(parts: &[usize]) -> (Vec<usize>, usize) {
    let mut offs = Vec::with_capacity(parts.len());
    let mut at = 0usize;
    for &p in parts {
        offs.push(at);
        at += p.max(1).next_multiple_of(256);
    }
    (offs, at)
}

/// Bytes of the split-K partial outputs (rows of out's head_dim) and LSE of a plan (both at least
/// one element).
fn partial_bytes(spec: &AttnSpec, plan: &Plan) -> [usize; 2] {
    let rows = plan.split_rows(spec.dims.heads_q);
    [rows * spec.dims.head_dim_v * 4, rows * 4]
}

/// The workspace parts of an f16/bf16 forward: the non-finite-v flag, then the split-K partial
/// outputs and LSE (empty without split tiles).
fn workspace_parts(spec: &AttnSpec, plan: &Plan) -> [usize; 3] {
    let [po, pl] = if plan.fwd.n_slots == 0 { [0, 0] } else { partial_bytes(spec, plan) };
    [flag_part_bytes(spec, plan), po, pl]
}

/// Whether the decode kernel runs `plan`: `tile_rows` packs tiles of at most `FEW_ROWS` rows only
/// where it serves the call.
fn decode_tiles(plan: &Plan) -> bool {
    plan.fwd.rows <= FEW_ROWS
}

/// Counters of the decode kernel's split-K merge in its own launch (`flash_fwd_decode`'s
/// `arrivals`, u32 words after the flag, zeroed with it): one per partial slot and head slot where
/// the plan's tiles are the decode kernel's and some are split; else none.
fn arrival_words(spec: &AttnSpec, plan: &Plan) -> usize {
    let fp = &plan.fwd;
    if !decode_tiles(plan) || fp.n_slots == 0 {
        return 0;
    }
    (spec.dims.heads_q as u32 / fp.hp.max(1)).max(1) as usize * fp.n_slots as usize
}

/// Bytes of the workspace's first part, zeroed before every forward launch (by the flag's memset,
/// or by `kv_append`): the non-finite-v flag and the decode kernel's counters after it.
pub(crate) fn flag_part_bytes(spec: &AttnSpec, plan: &Plan) -> usize {
    FLAG_BYTES + 4 * arrival_words(spec, plan)
}

/// Workspace bytes a forward call of `spec` takes with this plan (f32: none).
pub(crate) fn fwd_workspace(spec: &AttnSpec, plan: &Plan) -> usize {
    if spec.dtype == DType::F32 {
        return 0;
    }
    let parts = workspace_parts(spec, plan);
    if parts[1] == 0 {
        return layout(&parts[..1]).1;
    }
    layout(&parts).1
}

/// Plan-cache options word of the forward (the switches that change the plan).
pub(crate) fn plan_opts() -> u64 {
    let o = fwd_options();
    (o.pack_heads as u64) | (o.split as u64) << 1 | (o.split_waves as u64) << 8 | (o.block_n as u64) << 32
}

fn is_f16(dt: DType) -> bool {
    dt == DType::F16
}

/// The tensor-core forward kernel (`flash_fwd::flash_fwd_mma2`) for one set of comptime choices:
/// `mt` m16 blocks per plane, `bn` keys per tile, `block_m` rows per cube, dense or sparse key
/// iteration (`cuda::sparse`), exact or INT8 Q K^T (`cuda::sparse_int8`, sparse only), K,V read
/// through a page table (`paged`, dense only: `AttnSpec::kv_pages()`). f16 or bf16.
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_fwd_kernel(
    be: &CudaBackend,
    dt: DType,
    hd: usize,
    mt: usize,
    bn: usize,
    block_m: usize,
    sparse: bool,
    int8: bool,
    paged: bool,
    v_single: bool,
) -> Result<super::compile::Func> {
    // full key tiles by tensor maps on sm_90+ (the pointers are 16-byte aligned:
    // `FwdPtrs::check_aligned`)
    let tma = kv_tma(be, hd);
    let key = KernelKey::new(
        "flash_fwd_mma2",
        dt,
        &[hd as u32, mt as u32, bn as u32, block_m as u32, sparse as u32, int8 as u32, paged as u32, v_single as u32, tma as u32],
    );
    be.kernels.get(&key, || fwd_source(be.client(), dt, hd, mt, bn, block_m, sparse, int8, paged, v_single, tma))
}

/// Whether the forward's and the dQ pass's K/V tiles come by tensor maps: sm_90+ and a
/// [`kv_map_box`] row (its width does not depend on the tile's keys) within the copy engine's
/// 256-element box (head_dim 256 and its padding are not: those tiles come by `cp.async`).
pub(crate) fn kv_tma(be: &CudaBackend, head_dim: usize) -> bool {
    let (box_cols, _) = kv_map_box(head_dim, flash_fwd::BLOCK_N);
    be.target.tma && box_cols <= 256
}

/// The tensor maps of K (not read by the INT8 variant: zeroed) and V over their buffers `k`, `v`
/// for the forward kernel (and the dQ pass) with `block_n`-key tiles (`kv_tiles::kv_map_box`
/// boxes; zeroed, never read, below sm_90 and where [`kv_tma`] is false).
pub(crate) fn kv_maps(be: &CudaBackend, spec: &AttnSpec, k: u64, v: u64, block_n: usize, int8: bool) -> Result<[MapArg; 2]> {
    let d = &spec.dims;
    let cols = d.heads_kv * d.head_dim;
    let rows = d.kv_len() / cols.max(1);
    let (bc, br) = kv_map_box(d.head_dim, block_n);
    let zero = sys::CUtensorMap { opaque: [0; 16] };
    let map = |ptr, on: bool| -> Result<sys::CUtensorMap> {
        if on { tile_map_2d(spec.dtype, ptr, cols, rows, cols * spec.dtype.size(), bc, br, false) } else { Ok(zero) }
    };
    let tma = kv_tma(be, d.head_dim);
    Ok([MapArg { map: map(k, tma && !int8)?, ptr: k, rows, cols }, MapArg { map: map(v, tma)?, ptr: v, rows, cols }])
}

/// Rows a tile (query rows x packed heads, the longest segment's) up to which the Hopper forward
/// checks v for a NaN or Inf itself (`check_v`) instead of the flag pass over all of v: a decode
/// step's tiles (4 rows at 32 / 8 heads) are memory-bound, and the pass read v once more (20 of
/// 106 us at B=8, Sk=4K on an H200, h200-2026-11-28-21348d0).
pub(crate) const FEW_ROWS: usize = 32;

/// Head dims of the Hopper forward: whole 64-column chunks of the 128-byte swizzle (one cube per
/// SM above 128: `FwdOptions::sm90_tile_for`).
pub(crate) const SM90_FWD_HEAD_DIMS: [usize; 4] = [64, 128, 192, 256];

/// Whether the forward of `spec` runs the Hopper kernel (`flash_fwd_sm90`): a GPU with wgmma (sm_90,
/// not the portable build: `Target::wgmma`), f16/bf16, a head_dim of [`SM90_FWD_HEAD_DIMS`], the
/// switch on.
pub(crate) fn sm90_forward(be: &CudaBackend, spec: &AttnSpec) -> bool {
    fwd_options().sm90 && be.target.wgmma && spec.dtype != DType::F32 && SM90_FWD_HEAD_DIMS.contains(&spec.dims.head_dim)
}

/// Whether the forward of `spec`, q and k at head_dim `hd` (the spec's or a padded one's), runs v at
/// its own head_dim (`Dims::head_dim_v`, narrower: DeepSeek's MLA 192 / 128) on `flash_fwd_ws`
/// rather than padded to `hd` (`head_pad`), on a GPU with wgmma: f16 / bf16, dense keys (not
/// block-sparse, not paged), `hd` one of the frame's (128, 192, 256), v a whole number of 64-column
/// chunks, and more than `FEW_ROWS` packed rows in a sequence (decode-sized calls run the decode
/// and V-checking kernels, at one head_dim).
pub(crate) fn value_dim_native(spec: &AttnSpec, hd: usize) -> bool {
    let o = fwd_options();
    o.sm90 && o.sm90_ws && matches!(hd, 128 | 192 | 256) && narrower_v_chunks(spec, hd) && max_seg_rows(spec) > FEW_ROWS
}

/// What every Hopper kernel that runs v at its own head_dim asks of a call, q and k at `hd`: f16 /
/// bf16, dense keys (not block-sparse, not paged), v a whole number of 64-column chunks narrower
/// than `hd` (this and `backward::value_dim_native`; `head_pad::value_dim_native` picks by pass).
pub(crate) fn narrower_v_chunks(spec: &AttnSpec, hd: usize) -> bool {
    let hv = spec.dims.head_dim_v;
    spec.dtype != DType::F32
        && spec.block_sparse().is_none()
        && spec.kv_pages().is_none()
        && hv.is_multiple_of(64)
        && hv > 0
        && hv < hd
}

/// The refusal of a kernel that does not run v at its own head_dim for a call whose v has head_dim
/// `hv`, q `hd`; `kernels`: those that do (the `value_dim_native` checks send only calls of theirs).
pub(crate) fn mixed_dims(hd: usize, hv: usize, kernels: &str) -> crate::error::Error {
    crate::error::Error::Unsupported {
        backend: "cuda",
        msg: format!("v's head_dim {hv} differs from q's {hd}: only {kernels} runs both"),
    }
}

/// Which kernels run v at its own head_dim in the forward ([`mixed_dims`]).
const FWD_MIXED: &str = "the warp-specialised Hopper forward";

/// Packed rows (query rows x the heads packed with them) of the longest segment of `spec`: what
/// the plan records as `FwdPlan::max_seg_rows`, known before a plan is built.
pub(crate) fn max_seg_rows(spec: &AttnSpec) -> usize {
    let d = &spec.dims;
    let hp = if fwd_options().pack_heads && d.heads_kv > 0 { d.group_size().max(1) } else { 1 };
    spec.segments.iter().map(|s| s.q_len).max().unwrap_or(0) * hp
}

/// Packed query rows of a forward tile of `spec` on `be`: where the decode kernel serves the call
/// (sm_90, f16 / bf16, head_dim 64 or 128, dense or paged K / V, at most `FEW_ROWS` rows of one
/// sequence in a tile; `FwdOptions::sm90_decode`) its N, the rows rounded up to 8; else `BLOCK_M`.
pub(crate) fn tile_rows(be: &CudaBackend, spec: &AttnSpec) -> usize {
    let o = fwd_options();
    let d = &spec.dims;
    let rows = max_seg_rows(spec);
    let decode = o.sm90_decode
        && sm90_forward(be, spec)
        && (d.head_dim == 64 || d.head_dim == 128)
        && spec.block_sparse().is_none()
        && rows <= FEW_ROWS;
    if decode {
        // the decode kernel's N (its MMAs take the keys as M): the rows rounded up to 8
        rows.max(1).next_multiple_of(8)
    } else {
        BLOCK_M
    }
}

/// The Hopper forward's frame and keys per tile for a call at `head_dim`, returned as `(block_n,
/// ws)`. The warp-specialised frame (`flash_fwd_ws`, `FwdOptions::sm90_ws`) at head_dim 128 and
/// above for 16-bit calls without the V check: 128-key tiles at 128 (Q plus two K and two V stages
/// 160 KiB), 64 above (144 / 192 KiB at d192 / d256); H200, kernel time, same processes as cuDNN
/// (bench/results/h200-2026-11-29-c306ce9, -96d7a78): d128 non-causal 8K 1.72-1.77 ms vs
/// 1.85-1.87 for `flash_fwd_sm90`, d192 1.26 vs 1.51, d256 1.56 vs 1.80, d256 causal 16K 3.02-3.04
/// vs 3.76-3.95. It lost at d64 (causal 8K 0.709 vs 0.618: two `flash_fwd_sm90` cubes per SM with
/// 128-key tiles) and for the INT8 / FP8 variants at their 64-key tiles (8K non-causal 10.2 / 10.5
/// vs 8.4 / 8.2 ms), so those and the V-checking calls keep `flash_fwd_sm90` with
/// `FwdOptions::sm90_tile_for`'s tile. `k_block` (block-sparse): the frame whose tile divides it.
/// `uncut`: no row's key range is cut inside the keys the call reads (non-causal, no window, K / V
/// not paged, dense): at head_dim 128 these take `FwdOptions::ws_bn` keys a tile (160: Q plus two K
/// and two V stages 192 KiB; FlashAttention-3's 176 spilled and lost, 192 keys ask 237 KiB with the
/// shared-memory layout's padding, bench/results/h200-2026-11-29-7d0f5e9). `hv`: v's head_dim
/// ([`value_dim_native`]): at head_dim 192 with v at most 128 wide the frame takes
/// `FwdOptions::ws_bn_v` keys a tile (128: Q plus two K and two V stages 208 KiB; S and O take
/// the registers of a d128 tile).
pub(crate) fn sm90_frame(hd: usize, hv: usize, int8: bool, check_v: bool, k_block: Option<usize>, uncut: bool) -> (usize, bool) {
    let opts = fwd_options();
    let ws_bn = if hd == 192 && hv <= 128 {
        opts.ws_bn_v as usize
    } else if hd > 128 {
        64
    } else if hd == 128 && uncut {
        opts.ws_bn as usize
    } else {
        128
    };
    if opts.sm90_ws && hd >= 128 && !int8 && !check_v && k_block.is_none_or(|kb| kb.is_multiple_of(ws_bn)) {
        (ws_bn, true)
    } else {
        (opts.sm90_tile_for(hd).0, false)
    }
}

/// The Hopper forward kernel for one set of comptime choices (`sm90_frame`: `flash_fwd_ws` or
/// `flash_fwd_sm90`), its keys per tile, and whether it is `flash_fwd_ws`. `hv`: v's head_dim (`hd` but where
/// [`value_dim_native`] holds); `int8`: INT8 Q K^T (block-sparse, `cuda::sparse_int8`); `fp8_pv`:
/// with it, FP8 P.V (`kernels::fp8_v`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_fwd_sm90_kernel(
    be: &CudaBackend,
    dt: DType,
    hd: usize,
    hv: usize,
    sparse: bool,
    paged: bool,
    check_v: bool,
    int8: bool,
    fp8_pv: bool,
    k_block: Option<usize>,
    uncut: bool,
) -> Result<(super::compile::Func, usize, bool)> {
    let (bn, ws) = sm90_frame(hd, hv, int8, check_v, k_block, uncut);
    if ws {
        let key = KernelKey::new("flash_fwd_ws", dt, &[hd as u32, hv as u32, bn as u32, sparse as u32, paged as u32]);
        let f = be.kernels.get(&key, || fwd_ws_source(be.client(), dt, hd, hv, bn, sparse, paged))?;
        return Ok((f, bn, true));
    }
    if hv != hd {
        return Err(mixed_dims(hd, hv, FWD_MIXED));
    }
    let cubes = fwd_options().sm90_tile_for(hd).1;
    let key = KernelKey::new(
        "flash_fwd_sm90",
        dt,
        &[hd as u32, bn as u32, sparse as u32, paged as u32, cubes, check_v as u32, int8 as u32, fp8_pv as u32],
    );
    let f = be.kernels.get(&key, || fwd_sm90_source(be.client(), dt, hd, bn, sparse, paged, cubes, check_v, int8, fp8_pv))?;
    Ok((f, bn, false))
}

/// CUDA source of the warp-specialised Hopper forward (`flash_fwd_ws`) at head_dim `hd`, v's `hv`:
/// the `kernels::sm90` markers lowered, one cube per SM declared (`__launch_bounds__(384, 1)`,
/// which `setmaxnreg` needs), barrier waits as plain `try_wait` loops.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fwd_ws_source(client: &ComputeClient<CudaRuntime>, dt: DType, hd: usize, hv: usize, bn: usize, sparse: bool, paged: bool) -> Result<Source> {
    macro_rules! k {
        ($t:ty) => {
            codegen_exp2(flash_fwd_ws::flash_fwd_ws::FlashFwdWs::<$t, CudaRuntime>::new(
                settings(WS_THREADS as u32),
                client.clone(),
                FwdArgs::compilation(),
                hd,
                hv,
                bn,
                sparse,
                paged,
            ), true)
        };
    }
    let mut src = if is_f16(dt) { k!(f16) } else { k!(bf16) }?;
    src.cuda = super::rewrite::sm90::lower_bounded(&src.entry, &src.cuda, 1)?;
    Ok(src)
}

/// CUDA source of [`flash_fwd_sm90_kernel`]: the `kernels::sm90` markers lowered, and `cubes` cubes
/// per SM declared (`__launch_bounds__(256, cubes)`: up to 255 or 128 registers a thread);
/// `check_v`: the kernel checks its V tiles for a NaN or Inf and sets the flag itself; `int8`: Q K^T
/// from int8 rows; `fp8_pv`: P.V in FP8. The INT8 / FP8 variants wait on their barriers with a plain
/// `try_wait` loop (`codegen_exp2`'s `spin`: -2 to -5% on `bench sage`, H200,
/// bench/results/h200-2026-11-30-sage-spin); the 16-bit ones keep libcu++'s wait.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fwd_sm90_source(
    client: &ComputeClient<CudaRuntime>,
    dt: DType,
    hd: usize,
    bn: usize,
    sparse: bool,
    paged: bool,
    cubes: u32,
    check_v: bool,
    int8: bool,
    fp8_pv: bool,
) -> Result<Source> {
    macro_rules! k {
        ($t:ty) => {
            codegen_exp2(flash_fwd_sm90::flash_fwd_sm90::FlashFwdSm90::<$t, CudaRuntime>::new(
                settings(SM90_THREADS as u32),
                client.clone(),
                FwdArgs::compilation(),
                hd,
                bn,
                sparse,
                paged,
                check_v,
                int8,
                fp8_pv,
            ), int8)
        };
    }
    let mut src = if is_f16(dt) { k!(f16) } else { k!(bf16) }?;
    src.cuda = super::rewrite::sm90::lower_bounded(&src.entry, &src.cuda, cubes)?;
    Ok(src)
}

/// CUDA source of the decode forward (`flash_fwd_decode`) for tiles of `rows` rows (a multiple
/// of 8, at most `FEW_ROWS`): the `kernels::sm90` markers lowered, two one-warpgroup cubes per SM
/// declared (`__launch_bounds__(128, 2)`).
pub(crate) fn fwd_decode_source(client: &ComputeClient<CudaRuntime>, dt: DType, hd: usize, paged: bool, rows: usize) -> Result<Source> {
    macro_rules! k {
        ($t:ty) => {
            codegen_exp2(flash_fwd_decode::flash_fwd_decode::FlashFwdDecode::<$t, CudaRuntime>::new(
                settings(flash_fwd_decode::DECODE_THREADS as u32),
                client.clone(),
                FwdArgs::compilation(),
                A,
                A,
                hd,
                paged,
                rows,
            ), false)
        };
    }
    let mut src = if is_f16(dt) { k!(f16) } else { k!(bf16) }?;
    src.cuda = super::rewrite::sm90::lower_bounded(&src.entry, &src.cuda, 2)?;
    Ok(src)
}

/// A 128-byte-swizzled tensor map of the Hopper forward over `rows` rows of `cols` elements at
/// `ptr`: 64-column x `box_rows(block_n)`-row boxes.
fn map_sw128(spec: &AttnSpec, ptr: u64, cols: usize, rows: usize, block_n: usize) -> Result<MapArg> {
    let map = tile_map_2d(spec.dtype, ptr, cols, rows, cols * spec.dtype.size(), SW_COLS as u32, box_rows(block_n) as u32, true)?;
    Ok(MapArg { map, ptr, rows, cols })
}

/// The tensor map of K (`ptr`, rows of `head_dim`) or V (rows of `head_dim_v`) for the Hopper
/// forward ([`map_sw128`]).
pub(crate) fn kv_map_sw128(spec: &AttnSpec, ptr: u64, head_dim: usize, block_n: usize) -> Result<MapArg> {
    let d = &spec.dims;
    let cols = d.heads_kv * head_dim;
    map_sw128(spec, ptr, cols, d.kv_len() / (d.heads_kv * d.head_dim).max(1), block_n)
}

/// The tensor maps of K and V for the Hopper forward (V at v's head_dim).
pub(crate) fn kv_maps_sw128(spec: &AttnSpec, k: u64, v: u64, block_n: usize) -> Result<[MapArg; 2]> {
    let d = &spec.dims;
    Ok([kv_map_sw128(spec, k, d.head_dim, block_n)?, kv_map_sw128(spec, v, d.head_dim_v, block_n)?])
}

/// The tensor map of the int8 K rows `k8` (`head_dim` bytes a row, counted in `E`: `head_dim / 2`
/// columns a head) for the Hopper forward's INT8 variant ([`map_sw128`]: one box column per head
/// at head_dim 128).
pub(crate) fn k8_map_sw128(spec: &AttnSpec, k8: u64, block_n: usize) -> Result<MapArg> {
    let d = &spec.dims;
    map_sw128(spec, k8, d.heads_kv * d.head_dim / 2, d.total_k.max(1), block_n)
}

/// CUDA source of [`flash_fwd_kernel`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn fwd_source(
    client: &ComputeClient<CudaRuntime>,
    dt: DType,
    hd: usize,
    mt: usize,
    bn: usize,
    block_m: usize,
    sparse: bool,
    int8: bool,
    paged: bool,
    v_single: bool,
    tma: bool,
) -> Result<Source> {
    let threads = (block_m * 2 / mt) as u32;
    macro_rules! k {
        ($t:ty) => {
            codegen_exp2(flash_fwd::flash_fwd_mma2::FlashFwdMma2::<$t, CudaRuntime>::new(
                settings(threads),
                client.clone(),
                FwdArgs::compilation(),
                hd,
                mt,
                bn,
                block_m,
                sparse,
                int8,
                paged,
                v_single,
                tma,
            ), false)
        };
    }
    let mut src = if is_f16(dt) { k!(f16) } else { k!(bf16) }?;
    // d64 cubes of 128 threads: three per SM (168 registers) with 64-key tiles, two (255) with
    // 128-key tiles, whose scores take twice the registers
    if hd == 64 && !int8 && threads == 128 {
        src.cuda = super::rewrite::min_blocks(&src.entry, &src.cuda, if bn == 128 { 2 } else { 3 })?;
    }
    if hd == 64 && !int8 && threads == 64 && v_single {
        src.cuda = super::rewrite::min_blocks(&src.entry, &src.cuda, 5)?;
    }
    if int8 {
        src.cuda = super::rewrite::int8_words(&src.entry, &src.cuda)?;
    }
    Ok(src)
}

/// CUDA source of the split-K combine ([`flash_fwd::combine_parts`]).
pub(crate) fn combine_source(client: &ComputeClient<CudaRuntime>, dt: DType, hd: usize) -> Result<Source> {
    macro_rules! k {
        ($t:ty) => {
            codegen(flash_fwd::combine_parts::CombineParts::<$t, CudaRuntime>::new(
                settings(32 * flash_fwd::PLANES as u32),
                client.clone(),
                A, A, A, A, A, A, A, A, (), (), (), (), (),
                hd,
            ))
        };
    }
    if is_f16(dt) { k!(f16) } else { k!(bf16) }
}

/// Enqueues the forward of `spec` on `stream`. `plan` must be the cached plan of `spec`;
/// `flag_zeroed`: the workspace's non-finite-v flag was zeroed by a launch ahead on `stream`.
pub(crate) fn launch_forward(
    be: &CudaBackend,
    spec: &AttnSpec,
    plan: &super::plans::Cached<Plan>,
    p: &FwdPtrs,
    flag_zeroed: bool,
    stream: sys::CUstream,
) -> Result<()> {
    let d = &spec.dims;
    let (hd, hv) = (d.head_dim, d.head_dim_v);
    let (ql, kl, ll) = (d.q_len(), d.kv_len().max(1), d.lse_len());
    let (vl, ol) = (d.v_len().max(1), d.out_len());
    let t = |i| plan.tables.get(i);
    let client = be.client();
    let dt = spec.dtype;
    let (win_l, win_r, _) = window_bounds(spec);
    let paged = spec.kv_pages().is_some();
    if dt == DType::F32 {
        let key = KernelKey::new("rowwise_fwd_f32", dt, &[hd as u32, paged as u32]);
        let f = be.kernels.get(&key, || {
            codegen(rowwise_fwd::rowwise_fwd_f32::RowwiseFwdF32::<CudaRuntime>::new(
                settings(32 * ROWS_PER_CUBE as u32),
                client.clone(),
                A, A, A, A, A, A, A, (), (), (), (), (), (), (), A,
                hd,
                paged,
            ))
        })?;
        let mut a = Args::new();
        a.array(p.q, ql).array(p.k, kl).array(p.v, kl).array(p.out, ql).array(p.lse, ll);
        a.array(t(FwdTable::RowSeg).0, t(FwdTable::RowSeg).1).array(t(FwdTable::Segs).0, t(FwdTable::Segs).1);
        a.f32(spec.scale).u32(d.heads_q as u32).u32(d.heads_kv as u32).u32(d.total_q as u32).f32(f32::INFINITY);
        a.u32(win_l).u32(win_r).array(t(FwdTable::Pages).0, t(FwdTable::Pages).1);
        let cubes = d.total_q.div_ceil(ROWS_PER_CUBE) as u32;
        return launch(&f, (cubes, d.heads_q as u32, 1), &mut a, stream);
    }

    if spec.uncovered_rows() > 0 {
        let key = KernelKey::new("fill_uncovered", dt, &[]);
        let f = be.kernels.get(&key, || {
            let s = settings(256);
            if is_f16(dt) {
                codegen(flash_fwd::fill_uncovered::FillUncovered::<f16, CudaRuntime>::new(s, client.clone(), A, A, ()))
            } else {
                codegen(flash_fwd::fill_uncovered::FillUncovered::<bf16, CudaRuntime>::new(s, client.clone(), A, A, ()))
            }
        })?;
        let mut a = Args::new();
        a.array(p.out, ol).array(p.lse, ll).f32(f32::INFINITY);
        launch(&f, super::launch::grid_2d(ol.max(ll).div_ceil(256)), &mut a, stream)?;
    }
    let fp = &plan.host.fwd;
    let n_work = fp.n_work() as u32;
    if n_work == 0 {
        return Ok(());
    }
    // the workspace's first part: the flag, set when v holds a NaN or Inf: by a pass over v, or
    // for calls of at most `FEW_ROWS` rows a tile (a decode step: memory-bound, a quarter of the
    // Hopper kernel's 128-row cube or less) by the Hopper kernel over the V tiles it reads
    let flag = p.workspace;
    let sm90 = sm90_forward(be, spec);
    let check_v = sm90 && fp.max_seg_rows <= FEW_ROWS;
    // (`flag_zeroed`: a launch ahead on the stream zeroed it, `kv_append`; then only a scan is left)
    if !(flag_zeroed && check_v) {
        launch_flag(be, dt, p.v, d.v_len(), flag, flag_part_bytes(spec, &plan.host), !check_v, stream)?;
    }
    let exact = DenseExact {
        q: p.q,
        k: p.k,
        v: p.v,
        out: p.out,
        lse: p.lse,
        row_seg: t(FwdTable::RowSeg),
        segs: t(FwdTable::Segs),
        pages: t(FwdTable::Pages),
        flag,
    };
    let opts = fwd_options();
    let y = (d.heads_q as u32 / fp.hp).max(1);
    // above head_dim 128 a plane's 32 rows of O would take 192-256 registers: 16 rows a plane
    let mt = if opts.plane_rows == 16 || hd > 128 { 1usize } else { 2 };
    let bn = opts.block_n_for(hd);
    let parts = workspace_parts(spec, &plan.host);
    let [_, po_bytes, _] = parts;
    let (offs, _) = layout(&parts);
    // without split tiles the partial buffers are never touched: any valid address (the flag's)
    let (part_o, part_lse) = if po_bytes == 0 { (flag, flag) } else { (p.workspace + offs[1] as u64, p.workspace + offs[2] as u64) };
    let n_part = (po_bytes / (4 * hv)).max(1);

    // the plan packed tiles of at most `FEW_ROWS` rows for the decode kernel (`tile_rows`)
    let decode = decode_tiles(&plan.host);
    if hv != hd && (decode || !sm90) {
        // (`value_dim_native` sends only calls of the warp-specialised frame here)
        return Err(mixed_dims(hd, hv, FWD_MIXED));
    }
    // `ws`: the warp-specialised frame, whose causal and window calls go kv head outer too ([`kv_outer`])
    let (f, [k_map, v_map], ws) = if decode {
        let key = KernelKey::new("flash_fwd_decode", dt, &[hd as u32, paged as u32, fp.rows as u32]);
        let f = be.kernels.get(&key, || fwd_decode_source(client, dt, hd, paged, fp.rows))?;
        (f, kv_maps_sw128(spec, p.k, p.v, flash_fwd_decode::DECODE_BN)?, false)
    } else if sm90 {
        // (a paged K / V keeps the tiles that divide its pages)
        let uncut = !spec.causal && spec.window == Window::NONE && !paged;
        let (f, bn, ws) = flash_fwd_sm90_kernel(be, dt, hd, hv, false, paged, check_v, false, false, None, uncut)?;
        (f, kv_maps_sw128(spec, p.k, p.v, bn)?, ws)
    } else {
        (flash_fwd_kernel(be, dt, hd, mt, bn, BLOCK_M, false, false, paged, false)?, kv_maps(be, spec, p.k, p.v, bn, false)?, false)
    };
    let args = FwdArgs {
        k_map,
        v_map,
        q_s: (p.q, ql),
        k_s: (p.k, kl),
        v_s: (p.v, vl),
        out: (p.out, ol),
        lse: (p.lse, ll),
        part_o: (part_o, n_part * hv),
        part_lse: (part_lse, n_part),
        work: t(FwdTable::Work),
        slices: t(FwdTable::Slices),
        segs: t(FwdTable::Segs),
        // no tile list (a sparse table): any valid address; `blocks` carries the page table
        // (read only by the paged variant)
        tile_ref: (t(FwdTable::Segs).0, 1),
        blocks: t(FwdTable::Pages),
        nonfinite: (flag, 1),
        scale_log2: spec.scale * LOG2E,
        heads_q: d.heads_q as u32,
        heads_kv: d.heads_kv as u32,
        total_q: d.total_q as u32,
        hp: fp.hp,
        n_slots: fp.n_slots,
        inf: f32::INFINITY,
        k_block: 0,
        tiles_per_block: 1,
        win_l,
        win_r,
        kv_outer: kv_outer(spec, sm90 && !decode, ws, n_work as usize, (n_work * y) as usize) as u32,
    };
    let mut a = args.args();
    if decode {
        // the split-K counters after the flag (any valid address without a split), and the
        // tiles of the partial slots
        let arrivals = arrival_words(spec, &plan.host);
        let arrivals_at = if arrivals > 0 { flag + FLAG_BYTES as u64 } else { flag };
        a.array(arrivals_at, arrivals.max(1)).array(t(FwdTable::SlotParts).0, t(FwdTable::SlotParts).1);
    }
    launch(&f, (n_work * y, 1, 1), &mut a, stream)?;

    // (the decode kernel merges its split tiles itself)
    if fp.n_comb() > 0 && !decode {
        let key = KernelKey::new("combine_parts", dt, &[hv as u32]);
        let f = be.kernels.get(&key, || combine_source(client, dt, hv))?;
        let mut a = Args::new();
        a.array(p.out, ol).array(p.lse, ll).array(part_o, n_part * hv).array(part_lse, n_part);
        for i in [FwdTable::Comb, FwdTable::Slices, FwdTable::Segs] {
            a.array(t(i).0, t(i).1);
        }
        a.array(flag, 1);
        a.u32(d.heads_q as u32).u32(d.total_q as u32).u32(fp.hp).u32(fp.n_slots).f32(f32::INFINITY);
        launch(&f, (fp.n_comb() as u32, y, 1), &mut a, stream)?;
    }
    launch_dense_exact(be, spec, &exact, (win_l, win_r), stream)
}

/// Whether the dense forward's cubes go kv head outer (`grid::cube_item_slot`) on the Hopper
/// kernels (`hopper`: the wgmma frames, not decode). Heads fastest, the cubes running at once read
/// every kv head's K / V (64 MB at 16K tokens, 8 kv heads, d128: past L2; ncu at 8K: 86% L2 hits
/// and 4x cuDNN's DRAM traffic, bench/results/h200-2026-12-01-fwd-ncu); kv head outer they share
/// one kv head's, as the backward's non-causal dK/dV cubes do (`backward::kv_outer`).
/// - Calls without a causal mask or window: always (`kv_outer_default`).
/// - Causal or window calls on the warp-specialised frame (`ws`, a Hopper frame itself) with at
///   least [`KV_OUTER_WAVES`] waves of `cubes` (over the SM count): causal d128 -2 to -4% at
///   4K-32K, one zigzag rank's grouped call up to -4% at T = 64K
///   (bench/results/h200-2026-12-03-causal-order); window calls -1 to -2.6% at 16K-32K
///   (h200-2026-12-03-order-rules). Below 6 waves the last kv head's longest items start with
///   little work beside them: causal d128 B = 1 at 1K / 2K (1.9 / 3.9 waves) took 14% / 7% more
///   time kv head outer, level at 3K (5.8 waves), -1.5% at B = 4 1K (7.8 waves).
/// - Causal calls without a window on `flash_fwd_sm90` (d64, two cubes an SM) with at least
///   [`SM90_CAUSAL_KV_OUTER_ITEMS`] work items a head slot (`items`): -1.4 to -2.1% at B = 1 32K
///   and B = 2 16K, level at B = 4 8K (256 items each), but +2.5 to +3.9% at 8K-16K with B = 1
///   (64-128 items) and +1.4% at B = 4 2K (h200-2026-12-03-order-rules).
///
/// `CUBEATTN_FWD_ORDER` overrides it.
fn kv_outer(spec: &AttnSpec, hopper: bool, ws: bool, items: usize, cubes: usize) -> bool {
    let masked = if ws {
        cubes >= KV_OUTER_WAVES * super::plan::sm_count()
    } else {
        hopper && spec.causal && spec.window.is_none() && items >= SM90_CAUSAL_KV_OUTER_ITEMS
    };
    crate::config::get().fwd_order.unwrap_or(super::kv_outer_default(spec, hopper) || masked)
}

/// Waves of cubes a causal or window launch of the warp-specialised frame needs to go kv head
/// outer ([`kv_outer`]).
const KV_OUTER_WAVES: usize = 6;

/// Work items a head slot a causal launch of `flash_fwd_sm90` needs to go kv head outer
/// ([`kv_outer`]).
const SM90_CAUSAL_KV_OUTER_ITEMS: usize = 256;

table_names! {
    /// The tables of a cached forward plan ([`fwd_tables`]).
    pub(crate) enum FwdTable { Segs, RowSeg, Work, Slices, Comb, Pages, SlotParts }
}

impl PlanKind for Plan {
    type Table = FwdTable;
}

/// The tables of a forward plan of `spec` (the page table of a paged K,V; empty without one).
pub(crate) fn fwd_tables(spec: &AttnSpec, plan: &Plan) -> TableSet<FwdTable> {
    TableSet::new()
        .with(FwdTable::Segs, plan.segs.clone())
        .with(FwdTable::RowSeg, plan.row_seg.clone())
        .with(FwdTable::Work, plan.fwd.work.clone())
        .with(FwdTable::Slices, plan.fwd.slices.clone())
        .with(FwdTable::Comb, plan.fwd.comb.clone())
        .with(FwdTable::Pages, spec.kv_pages().unwrap_or_default().to_vec())
        .with(FwdTable::SlotParts, plan.fwd.slot_parts())
}

#[cfg(test)]
mod tests {
    use super::aligned;

    #[test]
    fn an_address_off_16_bytes_is_refused_by_name() {
        assert!(aligned(&[("q", 0x7f00_0000_0100), ("workspace", 0)]).is_ok());
        let e = aligned(&[("q", 0x7f00_0000_0100), ("k", 0x7f00_0000_0102)]).unwrap_err().to_string();
        assert!(e.contains("`k`") && e.contains("16-byte"), "{e}");
    }
}
