//! Global -> shared memory staging of the backward kernels' tiles: plain vector copies and the
//! `cp.async` issue of the query (Q, dO, lse, delta) and key (K, V) tiles; the mbarrier commit /
//! wait of the two-stage pipelines (forward and backward).

use cubecl::prelude::*;
use cubecl::prelude::barrier::{copy_async, Barrier};

use super::tiles::{BWD_BM, BWD_LOAD_VEC, PAD};
use super::rows::kv_row;
use super::sm90::swizzle_128b;

/// Copies `rows` x head_dim elements (rows from `row_at`, zero for `None` rows) into shared memory.
/// Row `r` of the tile is global row `base_row + r` when `r + first < limit`; `paged`: the row
/// holding key `base_row + r` of a paged K,V (`rows::kv_row` with `pages`). `threads` units copy.
/// The tile's rows are `head_dim + PAD` elements apart, or (`sw128`) 128-byte swizzled
/// (`sm90::swizzle_128b`, `rows` rows per 64-column chunk: the wgmma kernels' operand layout).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_rows<E: Float, NV: Size>(
    src: &Array<Vector<E, NV>>,
    smem: &mut SharedMemory<E>,
    first: u32,
    limit: u32,
    base_row: u32,
    heads: u32,
    head: u32,
    pages: &Array<u32>,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] threads: usize,
    #[comptime] paged: bool,
    #[comptime] sw128: bool,
) {
    let vpr = comptime!(head_dim / BWD_LOAD_VEC);
    let stride = comptime!(head_dim + PAD);
    let loads = comptime!(rows * (head_dim / BWD_LOAD_VEC) / threads);
    #[unroll]
    for it in 0..loads {
        let idx = UNIT_POS as usize + it * threads;
        let r = idx / vpr;
        let c = idx % vpr;
        let mut val = Vector::<E, NV>::new(E::from_int(0));
        if first + (r as u32) < limit {
            let g = (kv_row(base_row + r as u32, pages, paged) * heads + head) as usize * vpr + c;
            val = src[g];
        }
        let base = if sw128 { swizzle_128b(r, c * BWD_LOAD_VEC, rows) } else { r * stride + c * BWD_LOAD_VEC };
        #[unroll]
        for e in 0..BWD_LOAD_VEC {
            smem[base + e] = val[e];
        }
    }
}

/// `cp.async` copy of a query tile of Q and dO (rows `r0..r0+BWD_BM` of the segment, clamped to
/// its last row: rows past `q_len` are masked by the caller) into rows `boff..boff+BWD_BM` of
/// `q_smem` / `do_smem`, and lse (natural log, as stored) and delta of the same rows into
/// `lse_smem` / `dl_smem[boff..]` (4-byte copies: no thread waits on a global load here), by
/// `threads` units (at least `BWD_BM`). The caller commits the copies to a barrier.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn issue_q_tile<E: Float>(
    q_s: &Array<E>,
    do_s: &Array<E>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    q_smem: &mut SharedMemory<E>,
    do_smem: &mut SharedMemory<E>,
    lse_smem: &mut SharedMemory<f32>,
    dl_smem: &mut SharedMemory<f32>,
    boff: usize,
    r0: u32,
    q_len: u32,
    q_start: u32,
    h: u32,
    heads_q: u32,
    total_q: u32,
    #[comptime] head_dim: usize,
    #[comptime] threads: usize,
) {
    issue_row_pair::<E>(q_s, do_s, q_smem, do_smem, boff, r0, q_len, q_start, h, heads_q, BWD_BM, head_dim, threads);
    issue_lse_delta(lse, delta, lse_smem, dl_smem, boff, r0, q_len, q_start, h, total_q, UNIT_POS, threads, BWD_BM);
}

/// The lse and delta part of [`issue_q_tile`]: `cp.async` copies of rows `r0..r0 + rows` (clamped
/// to the segment's last row) into `lse_smem` / `dl_smem[boff..]` by the kernel's `threads` units
/// (`tid`: this one; rows `tid`, `tid + threads`, .. below `rows`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn issue_lse_delta(
    lse: &Array<f32>,
    delta: &Array<f32>,
    lse_smem: &mut SharedMemory<f32>,
    dl_smem: &mut SharedMemory<f32>,
    boff: usize,
    r0: u32,
    q_len: u32,
    q_start: u32,
    h: u32,
    total_q: u32,
    tid: u32,
    #[comptime] threads: usize,
    #[comptime] rows: usize,
) {
    let iters = comptime!(rows.div_ceil(threads));
    #[unroll]
    for it in 0..iters {
        let r = tid + comptime!((it * threads) as u32);
        // units past the tile's rows copy nothing (none when `threads` divides `rows`)
        if comptime!(iters * threads == rows) || r < rows as u32 {
            let row = min(r0 + r, q_len - 1);
            let li = (h * total_q + q_start + row) as usize;
            let u = boff + r as usize;
            copy_async(&lse.slice(li, li + 1), &mut lse_smem.slice_mut(u, u + 1), 1u32);
            copy_async(&delta.slice(li, li + 1), &mut dl_smem.slice_mut(u, u + 1), 1u32);
        }
    }
}

/// `cp.async` copies of rows `r0..r0 + rows` (clamped to row `len - 1`: the caller masks rows
/// past it) of head `h` of two token-major tensors `a` and `b` (`[.., heads, head_dim]`, the rows'
/// tokens from `start`) into rows `boff..` of `a_smem` / `b_smem` (padded rows), by `threads`
/// units.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn issue_row_pair<E: Float>(
    a: &Array<E>,
    b: &Array<E>,
    a_smem: &mut SharedMemory<E>,
    b_smem: &mut SharedMemory<E>,
    boff: usize,
    r0: u32,
    len: u32,
    start: u32,
    h: u32,
    heads: u32,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    #[comptime] threads: usize,
) {
    let vpr = comptime!(head_dim / BWD_LOAD_VEC);
    let stride = comptime!(head_dim + PAD);
    let loads = comptime!(rows * (head_dim / BWD_LOAD_VEC) / threads);
    #[unroll]
    for it in 0..loads {
        let idx = UNIT_POS as usize + it * threads;
        let r = idx / vpr;
        let c = idx % vpr;
        let row = min(r0 + r as u32, len - 1);
        let g = ((start + row) * heads + h) as usize * head_dim + c * BWD_LOAD_VEC;
        let base = (boff + r) * stride + c * BWD_LOAD_VEC;
        copy_async(&a.slice(g, g + BWD_LOAD_VEC), &mut a_smem.slice_mut(base, base + BWD_LOAD_VEC), comptime!(BWD_LOAD_VEC as u32));
        copy_async(&b.slice(g, g + BWD_LOAD_VEC), &mut b_smem.slice_mut(base, base + BWD_LOAD_VEC), comptime!(BWD_LOAD_VEC as u32));
    }
}

/// `cp.async` copies of rows gathered by token into a padded shared tile: tile row `r` is global
/// row `row_tok[r] * heads + row_head[r]` of `row_e` elements (`none` tokens copy row 0: the
/// caller masks them), `stride` elements apart in `smem`, `vec` elements per copy; `n_rows` rows
/// over `threads` units. The caller commits the copies to a barrier. The forward's Q tile (f16 /
/// bf16 rows) and its int8 Q tile (rows of `head_dim` bytes) both use it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn copy_token_rows<E: Float>(
    src: &Array<E>,
    smem: &mut SharedMemory<E>,
    row_tok: &SharedMemory<u32>,
    row_head: &SharedMemory<u32>,
    heads: u32,
    none: u32,
    #[comptime] threads: usize,
    #[comptime] n_rows: usize,
    #[comptime] row_e: usize,
    #[comptime] stride: usize,
    #[comptime] vec: usize,
) {
    let vecs = comptime!(row_e / vec);
    #[unroll]
    for it in 0..comptime!(n_rows * (row_e / vec) / threads) {
        let idx = UNIT_POS as usize + it * threads;
        let r = idx / vecs;
        let c = idx % vecs;
        let mut tok = row_tok[r];
        if tok == none {
            tok = 0u32;
        }
        let g = (tok * heads + row_head[r]) as usize * row_e + c * vec;
        let base = r * stride + c * vec;
        copy_async(&src.slice(g, g + vec), &mut smem.slice_mut(base, base + vec), comptime!(vec as u32));
    }
}

/// Closes this thread's `cp.async` copies issued since the last commit into `bar`'s current phase
/// and arrives (the copies are the thread's arrival: `.noinc`, see `rewrite::mbarriers`).
#[cube]
pub fn commit_copies(bar: &Barrier) {
    bar.commit_copy_async();
    let _t = bar.arrive();
}

/// [`commit_copies`] into `even` when `stage` is even, else into `odd` (a two-stage pipeline).
#[cube]
pub fn commit_stage(even: &Barrier, odd: &Barrier, stage: u32) {
    if (stage & 1u32) == 0 {
        commit_copies(even);
    } else {
        commit_copies(odd);
    }
}

/// Before use `n` of a two-buffer ring (buffer `n % 2`): waits until its use `n - 2` was released
/// (phase `n / 2 - 1` of that buffer's `empty` barrier: parity `(n / 2 + 1) & 1`); the first two
/// uses wait for nothing.
#[cube]
pub fn wait_free(even: &Barrier, odd: &Barrier, n: u32) {
    if n >= 2u32 {
        let parity = ((n >> 1u32) + 1u32) & 1u32;
        if (n & 1u32) == 0u32 {
            even.wait_parity(parity);
        } else {
            odd.wait_parity(parity);
        }
    }
}

/// Waits for the copies of `stage` (`even` when it is even, else `odd`): its `stage / 2`-th use of
/// the barrier, phase parity `(stage >> 1) & 1`.
#[cube]
pub fn wait_stage(even: &Barrier, odd: &Barrier, stage: u32) {
    if (stage & 1u32) == 0 {
        even.wait_parity((stage >> 1u32) & 1u32);
    } else {
        odd.wait_parity((stage >> 1u32) & 1u32);
    }
}
