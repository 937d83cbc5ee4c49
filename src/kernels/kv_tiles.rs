//! The K / V tile producers of the attention kernels: `cp.async` copies into padded rows
//! (forward, dQ pass), tensor-map copies into padded rows (forward and dQ pass on sm_90+) or into
//! 128-byte-swizzled tiles (the wgmma forward), and where a paged tile's rows are
//! ([`tile_rows`]). The dK / dV kernels stage their key tile once with `staging::stage_rows`.

use cubecl::prelude::barrier::{copy_async, Barrier};
use cubecl::prelude::*;

use super::int8_qk::copy_k_tile8;
use super::rows::kv_row;
use super::sm90::SW_COLS;
use super::staging::{commit_copies, issue_row_pair};
use super::tiles::{BWD_BN, BWD_PLANES, LOAD_VEC, SMEM_PAD};
use crate::format::KV_PAGE;

/// Issues the `cp.async` copies of keys `[n0, n1)` of kv head `head_kv` into a padded K or V tile
/// of `block_n` rows from shared row `row0` (rows past the range repeat key `n1 - 1`: they are
/// masked); the caller commits them to its barrier. Where a row's vectors divide the units, unit
/// `u` copies the 16 bytes at column `u % vecs_per_row` of rows `u / vecs_per_row + i *
/// rows_per_pass`: its row and column are
/// computed once, each copy adds one clamp, one multiply-add and a constant shared offset (the
/// per-copy division of `u + i * threads` cost ~2x the instructions; docs/forward.md). At
/// head_dim 64 a full tile (every tile but a range's last) skips the clamps: one global offset
/// plus a constant per pass, measured 2% faster there and 1-5% slower at d128 (docs/forward.md).
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_kv_tile<E: Float>(
    src: &Array<E>,
    smem: &mut SharedMemory<E>,
    row0: usize,
    n0: u32,
    n1: u32,
    n0b: u32,
    krow: usize,
    head_kv: u32,
    #[comptime] threads: usize,
    #[comptime] block_n: usize,
    #[comptime] head_dim: usize,
    #[comptime] paged: bool,
) {
    let stride = comptime!(head_dim + SMEM_PAD);
    let vecs_per_row = comptime!(head_dim / LOAD_VEC);
    // a paged tile longer than a page: its rows from KV_PAGE on start at n0b (`tile_rows`)
    let split = comptime!(paged && block_n > KV_PAGE);
    if comptime!(!threads.is_multiple_of(vecs_per_row) || !block_n.is_multiple_of((threads / vecs_per_row).max(1))) {
        // a row's vectors do not divide the units (head_dim 96 and 192): unit u copies vectors
        // u + i * threads of the tile, its row and column divided out per copy
        let total = comptime!(block_n * vecs_per_row);
        #[unroll]
        for it in 0..comptime!(total.div_ceil(threads)) {
            let idx = UNIT_POS as usize + it * threads;
            if idx < total {
                let r = idx / vecs_per_row;
                let col = (idx % vecs_per_row) * LOAD_VEC;
                let mut key = min(n0 + r as u32, n1 - 1);
                if comptime!(split) {
                    if r >= KV_PAGE {
                        key = n0b + min(r as u32, n1 - n0 - 1u32) - KV_PAGE as u32;
                    }
                }
                let g = key as usize * krow + head_kv as usize * head_dim + col;
                let base = (row0 + r) * stride + col;
                copy_async(&src.slice(g, g + LOAD_VEC), &mut smem.slice_mut(base, base + LOAD_VEC), comptime!(LOAD_VEC as u32));
            }
        }
    } else {
        let rows_per_pass = comptime!(threads / vecs_per_row);
        let r = UNIT_POS as usize / vecs_per_row;
        let col = (UNIT_POS as usize % vecs_per_row) * LOAD_VEC;
        let g_col = head_kv as usize * head_dim + col;
        let s0 = (row0 + r) * stride + col;
        if comptime!(head_dim <= 64) && n1 - n0 == block_n as u32 {
            let g0 = (n0 as usize + r) * krow + g_col;
            #[unroll]
            for it in 0..comptime!(block_n / rows_per_pass) {
                let mut g = g0 + it * rows_per_pass * krow;
                if comptime!(split && it * rows_per_pass >= KV_PAGE) {
                    g = (n0b as usize + r + comptime!(it * rows_per_pass - KV_PAGE)) * krow + g_col;
                }
                let base = s0 + comptime!(it * rows_per_pass * stride);
                copy_async(&src.slice(g, g + LOAD_VEC), &mut smem.slice_mut(base, base + LOAD_VEC), comptime!(LOAD_VEC as u32));
            }
        } else {
            #[unroll]
            for it in 0..comptime!(block_n / rows_per_pass) {
                let mut key = min(n0 + (r + it * rows_per_pass) as u32, n1 - 1);
                if comptime!(split && it * rows_per_pass >= KV_PAGE) {
                    // n0b is n0 + KV_PAGE when the tile ends inside its first page
                    key = n0b + min((r + it * rows_per_pass) as u32, n1 - n0 - 1u32) - KV_PAGE as u32;
                }
                let g = key as usize * krow + g_col;
                let base = s0 + comptime!(it * rows_per_pass * stride);
                copy_async(&src.slice(g, g + LOAD_VEC), &mut smem.slice_mut(base, base + LOAD_VEC), comptime!(LOAD_VEC as u32));
            }
        }
    }
}

/// Rows of one tensor-map box of a K or V tile of `block_n` keys: at most a page, so that no box
/// crosses one; a tile that is not a whole number of pages (the Hopper forward's 144- and 160-key tiles,
/// never paged: `backend::cuda::forward::sm90_frame`) is one box.
pub const fn box_rows(block_n: usize) -> usize {
    if block_n < KV_PAGE || !block_n.is_multiple_of(KV_PAGE) { block_n } else { KV_PAGE }
}

/// Box (columns, rows) of the tensor-map copies of a `block_n`-key tile (sm_90+): `head_dim +
/// SMEM_PAD` columns of the `[rows, heads_kv * head_dim]` view of K or V, so that the dense box
/// lands as the padded rows of the cp.async path (the extra columns, the next head's elements or
/// zeros past the row's end, are never read), and `min(block_n, KV_PAGE)` rows: a tile is
/// `block_n / rows` boxes, none across a page when paged.
pub const fn kv_map_box(head_dim: usize, block_n: usize) -> (u32, u32) {
    ((head_dim + SMEM_PAD) as u32, box_rows(block_n) as u32)
}

/// Keys `[n0, n1)` of `src` (K or V) into shared rows `row0..row0 + block_n` of `smem`: with `tma`
/// and a full tile, [`kv_map_box`] tensor-map copies issued by unit 0 on `bar` (its expected
/// bytes raised first); else `cp.async` by every unit ([`copy_kv_tile`]). The caller commits.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_kv_tile<E: Float>(
    map: &TensorMap<E, Tiled>,
    src: &Array<E>,
    smem: &mut SharedMemory<E>,
    bar: &Barrier,
    row0: usize,
    n0: u32,
    n1: u32,
    n0b: u32,
    krow: usize,
    head_kv: u32,
    #[comptime] threads: usize,
    #[comptime] block_n: usize,
    #[comptime] head_dim: usize,
    #[comptime] paged: bool,
    #[comptime] tma: bool,
) {
    // (`tma` alone decides at compile time: without it no tensor-map code is generated, which
    // GPUs below sm_90 could not compile)
    let mut by_map = false;
    if comptime!(tma) {
        by_map = n1 - n0 == block_n as u32;
    }
    if by_map {
        if comptime!(tma) {
            issue_tile_boxes(map, smem, bar, row0 * comptime!(head_dim + SMEM_PAD), n0, n0b, head_kv, block_n, head_dim, false);
        }
    } else {
        copy_kv_tile(src, smem, row0, n0, n1, n0b, krow, head_kv, threads, block_n, head_dim, paged);
    }
}

/// Issues the copies of keys `[n0, n1)` of K (int8 rows with `int8`) and V (`with_v`) into shared
/// rows `row0..row0 + block_n` of their buffers and commits K's to `bar_k` (with the copies this
/// unit issued since its last commit: the Q tile for the first tile), V's to `bar_v`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn issue_kv_tiles<E: Float>(
    k_map: &TensorMap<E, Tiled>,
    v_map: &TensorMap<E, Tiled>,
    k_s: &Array<E>,
    v_s: &Array<E>,
    k_smem: &mut SharedMemory<E>,
    v_smem: &mut SharedMemory<E>,
    bar_k: &Barrier,
    bar_v: &Barrier,
    row0: usize,
    n0: u32,
    n1: u32,
    n0b: u32,
    krow: usize,
    heads_kv: u32,
    head_kv: u32,
    #[comptime] threads: usize,
    #[comptime] block_n: usize,
    #[comptime] head_dim: usize,
    #[comptime] int8: bool,
    #[comptime] with_v: bool,
    #[comptime] paged: bool,
    #[comptime] tma: bool,
) {
    if int8 {
        copy_k_tile8(k_s, k_smem, row0, n0, n1, heads_kv, head_kv, threads, block_n, head_dim);
    } else {
        load_kv_tile(k_map, k_s, k_smem, bar_k, row0, n0, n1, n0b, krow, head_kv, threads, block_n, head_dim, paged, tma);
    }
    commit_copies(bar_k);
    if with_v {
        load_kv_tile(v_map, v_s, v_smem, bar_v, row0, n0, n1, n0b, krow, head_kv, threads, block_n, head_dim, paged, tma);
        commit_copies(bar_v);
    }
}

/// Physical rows `(n0, n1, n0b)` of the logical key tile `[t0, t1)`: its first row, the end of
/// its rows as if contiguous (`n0 + t1 - t0`), and where its key `t0 + KV_PAGE` is when the tile
/// is paged and longer than a page (else `n0 + KV_PAGE`, so a copy's row is `n0b + i - KV_PAGE`
/// for tile row i >= KV_PAGE either way).
#[cube]
pub(crate) fn tile_rows(t0: u32, t1: u32, pages: &Array<u32>, #[comptime] paged: bool, #[comptime] block_n: usize) -> (u32, u32, u32) {
    let p0 = kv_row(t0, pages, paged);
    let mut pb = p0 + KV_PAGE as u32;
    if comptime!(paged && block_n > KV_PAGE) {
        if t1 - t0 > KV_PAGE as u32 {
            pb = kv_row(t0 + KV_PAGE as u32, pages, paged);
        }
    }
    (p0, p0 + (t1 - t0), pb)
}


/// Unit 0 raises `bar`'s expected bytes by a K or V tile of `block_n` keys and issues its
/// tensor-map copies (rows from `n0`, from `n0b` past the first page) into the tile at element
/// `base` of `smem`. `sw128` (the wgmma kernels' 128-byte-swizzled tiles): `head_dim / 64` column
/// chunks x `block_n / box_rows` row boxes, chunk `c` at `base + c * block_n * 64`; else the
/// padded rows of the cp.async path: `block_n / rows` boxes of [`kv_map_box`].
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn issue_tile_boxes<E: Float>(
    map: &TensorMap<E, Tiled>,
    smem: &mut SharedMemory<E>,
    bar: &Barrier,
    base: usize,
    n0: u32,
    n0b: u32,
    head_kv: u32,
    #[comptime] block_n: usize,
    #[comptime] head_dim: usize,
    #[comptime] sw128: bool,
) {
    if UNIT_POS == 0 {
        let ts = E::type_size();
        // box columns, column chunks, box rows
        let (cols, chunks, rows) = comptime!(if sw128 {
            (SW_COLS, head_dim / SW_COLS, box_rows(block_n))
        } else {
            let (c, r) = kv_map_box(head_dim, block_n);
            (c as usize, 1usize, r as usize)
        });
        bar.expect_tx(comptime!((block_n * chunks * cols * ts) as u32));
        #[unroll]
        for c in 0..chunks {
            let x = (head_kv * head_dim as u32) as i32 + comptime!((c * cols) as i32);
            #[unroll]
            for b in 0..comptime!(block_n / rows) {
                let mut y = n0 + comptime!(b * rows) as u32;
                if comptime!(b * rows >= KV_PAGE) {
                    y = n0b + comptime!(b * rows - KV_PAGE) as u32;
                }
                let a = base + comptime!(c * block_n * cols + b * rows * cols);
                bar.tma_load_2d(map, &mut smem.slice_mut(a, a + comptime!(rows * cols)), y as i32, x);
            }
        }
    }
}

/// `cp.async` copy of key tile rows `kb..kb+BWD_BN` of K and V (window-local, clamped to the
/// window's last key: keys past `k_len` are masked by the caller) into rows `boff..` of
/// `k_smem` / `v_smem`. `paged`: K,V rows through the page table `pages` (`rows::kv_row`; the
/// tile lies inside one block). The caller commits the copies to a barrier.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn issue_kv_tile<E: Float>(
    k_s: &Array<E>,
    v_s: &Array<E>,
    k_smem: &mut SharedMemory<E>,
    v_smem: &mut SharedMemory<E>,
    boff: usize,
    kb: u32,
    k_len: u32,
    k_start: u32,
    head_kv: u32,
    heads_kv: u32,
    pages: &Array<u32>,
    #[comptime] head_dim: usize,
    #[comptime] paged: bool,
) {
    let mut start = k_start;
    let mut r0 = kb;
    let mut len = k_len;
    if paged {
        start = kv_row(k_start + kb, pages, true);
        r0 = 0u32;
        len = k_len - kb;
    }
    issue_row_pair::<E>(k_s, v_s, k_smem, v_smem, boff, r0, len, start, head_kv, heads_kv, BWD_BN, head_dim, comptime!(BWD_PLANES * 32));
}

