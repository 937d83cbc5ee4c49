//! The fused backward's dQ tile added to the f32 accumulator by the copy engine (sm_90+):
//! `cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32`, one operation per row of the
//! tile, instead of 16 float2 atomics per thread and tile issued by the planes themselves.
//!
//! CubeCL 0.10 has no bulk reduction. The kernels write it as a `copy_async` from shared to global
//! memory (a direction CubeCL's cp.async never takes), and `backend::cuda::rewrite::bulk_adds`
//! turns exactly those calls into the reduction (any other reversed copy makes that rewrite, or
//! the cp.async wrapper's size check, fail at compile time). The bulk-group commit and waits and
//! the generic-to-async proxy fence are CubeCL's own operations.
//!
//! Protocol (per query tile t, planes = warps):
//! 1. every thread stores its dQ fragment into the row-major tile [`dq_tile_stride`] and fences
//!    (`fence.proxy.async.shared::cta`: its generic stores visible to the copy engine);
//! 2. after the cube-wide barrier that ends the tile, thread `u < rows` issues row `u`
//!    ([`issue_dq_row`], to the address [`dq_row_dst`] computed with the stores);
//! 3. before the next tile's P / dS barrier (after which the tile is written again) the issuing
//!    threads wait until the copy engine has read their rows ([`dq_rows_read`]); at the kernel's
//!    end they wait the same way before the shared memory is released (the additions complete
//!    before the grid does, as a TMA store's writes).

use cubecl::prelude::barrier::copy_async;
use cubecl::prelude::*;
use super::sm90::SW_COLS;

/// f32 per row of the shared dQ tile: head_dim + 8, so that a plane's float2 stores of its
/// accumulator fragments are conflict-free: a half-warp's 16 lanes (4 rows x 4 column pairs) start
/// 8 banks apart per row and cover the 32 banks once (two wavefronts per store, the minimum; with
/// + 4 rows overlapped by half, four), and every row starts 16-byte aligned (the bulk copy's
/// requirement).
pub const fn dq_tile_stride(head_dim: usize) -> usize {
    head_dim + 8
}

/// No row to add (a thread's [`dq_row_dst`] past the tile's rows).
pub const NO_ROW: u32 = u32::MAX;

/// Where thread `UNIT_POS` adds its row of the tile just stored: row `UNIT_POS` of the tile is
/// global row `first_row + UNIT_POS` (rows of `heads` x head_dim f32, head `head`; as an index of
/// `qv`-f32 vectors), or [`NO_ROW`] from `rows` on. One register carries it to the issue.
#[cube]
pub fn dq_row_dst(first_row: u32, rows: u32, head: u32, heads: u32, #[comptime] head_dim: usize, #[comptime] qv: usize) -> u32 {
    let u = UNIT_POS;
    let mut dst = u32::new(NO_ROW as i64);
    if u < rows {
        dst = ((first_row + u) * heads + head) * comptime!((head_dim / qv) as u32);
    }
    dst
}

/// Thread `UNIT_POS` adds row `UNIT_POS` of `tile` (vectors of `qv` f32, row stride
/// [`dq_tile_stride`]) to `acc` at vector `dst` ([`dq_row_dst`]; nothing for [`NO_ROW`]) and
/// commits its bulk group.
#[cube]
pub fn issue_dq_row<NQ: Size>(
    tile: &SharedMemory<Vector<f32, NQ>>,
    acc: &mut Array<Vector<f32, NQ>>,
    dst: u32,
    #[comptime] head_dim: usize,
    #[comptime] qv: usize,
) {
    if dst != NO_ROW {
        add_dq_row::<NQ>(tile, acc, UNIT_POS, dst, head_dim, qv);
        tma_group_commit();
    }
}

/// Row `row` of `tile` (vectors of `qv` f32, row stride [`dq_tile_stride`]) added to `acc` at
/// vector `dst` by the copy engine; the caller commits the bulk group.
#[cube]
pub fn add_dq_row<NQ: Size>(
    tile: &SharedMemory<Vector<f32, NQ>>,
    acc: &mut Array<Vector<f32, NQ>>,
    row: u32,
    dst: u32,
    #[comptime] head_dim: usize,
    #[comptime] qv: usize,
) {
    let n = comptime!(head_dim / qv);
    let s0 = row as usize * comptime!(dq_tile_stride(head_dim) / qv);
    let d0 = dst as usize;
    copy_async(&tile.slice(s0, s0 + n), &mut acc.slice_mut(d0, d0 + n), comptime!(head_dim as u32));
}

/// Stores a thread's f32 pair `(x0, x1)` (adjacent dQ columns) at vector `vi` of the dQ tile:
/// one 8-byte vector (`qv` 2) or two scalars at `vi`, `vi + 1` (`qv` 1).
#[cube]
pub fn put_dq_pair<NQ: Size>(tile: &mut SharedMemory<Vector<f32, NQ>>, vi: usize, x0: f32, x1: f32, #[comptime] qv: usize) {
    if qv == 2 {
        let mut val = Vector::<f32, NQ>::empty();
        val[0] = x0;
        val[1] = x1;
        tile[vi] = val;
    } else {
        let mut v0 = Vector::<f32, NQ>::empty();
        v0[0] = x0;
        tile[vi] = v0;
        let mut v1 = Vector::<f32, NQ>::empty();
        v1[0] = x1;
        tile[vi + 1] = v1;
    }
}

/// Adds a thread's f32 pair `(x0, x1)` (adjacent dQ columns) to the f32 accumulator at vector `vi`
/// by atomics: one float2 atomic (`qv` 2) or two scalar ones at `vi`, `vi + 1` (`qv` 1): the fused
/// dQ where no shared tile takes the bulk reductions.
#[cube]
pub fn add_dq_pair<NQ: Size>(acc: &Array<Atomic<Vector<f32, NQ>>>, vi: usize, x0: f32, x1: f32, #[comptime] qv: usize) {
    if qv == 2 {
        let mut val = Vector::<f32, NQ>::empty();
        val[0] = x0;
        val[1] = x1;
        acc[vi].fetch_add(val);
    } else {
        let mut v0 = Vector::<f32, NQ>::empty();
        v0[0] = x0;
        acc[vi].fetch_add(v0);
        let mut v1 = Vector::<f32, NQ>::empty();
        v1[0] = x1;
        acc[vi + 1].fetch_add(v1);
    }
}

/// Adds one row of a thread's `m64n64` dQ fragment to the f32 accumulator by [`add_dq_pair`]: its
/// pairs at `i0 + 4 nb` (`i0` 0: row `row_a` of the accumulator layout, 2: row `row_a + 8`) to
/// the row's 64 columns from vector `gv`; `valid` false adds zeros (a row past the segment whose
/// address stays in the tensor).
#[cube]
pub fn add_dq_row64<NQ: Size>(
    acc: &Array<Atomic<Vector<f32, NQ>>>,
    dq: &Array<f32>,
    gv: usize,
    valid: bool,
    #[comptime] i0: usize,
    #[comptime] qv: usize,
) {
    #[unroll]
    for nb in 0..comptime!(SW_COLS / 8) {
        let i = i0 + nb * 4;
        let x0 = select(valid, dq[i], 0.0f32);
        let x1 = select(valid, dq[i + 1], 0.0f32);
        add_dq_pair::<NQ>(acc, gv + comptime!(nb * 8 / qv), x0, x1, qv);
    }
}

/// The issuing threads (`UNIT_POS < bm`) wait until the copy engine has read their rows of the
/// tile (so that it may be written again after the next barrier).
#[cube]
pub fn dq_rows_read(#[comptime] bm: usize) {
    if UNIT_POS < comptime!(bm as u32) {
        tma_group_wait_read(0u32);
    }
}
