//! Row-wise forward (no tensor cores): one plane (warp) per (query row, query head), each lane
//! holding `head_dim / 32` dimensions of q and of the output; only the keys the row sees are
//! visited, one at a time, with an online softmax in f32. Accurate to f32 rounding and exact about
//! masking (a key a row cannot see is never read for it), not meant for speed.
//!
//! Three kernels: [`rowwise_fwd_f32`] (the f32 forward), and the exact kernels of the f16/bf16
//! forward for calls whose v holds a NaN or Inf ([`rowwise_fwd_exact`], dense and grouped, and
//! [`rowwise_sparse_fwd_exact`], block-sparse): inputs read in their dtype and converted to f32,
//! outputs written in it, run only when the flag of `nonfinite::v_nonfinite` is set.

use cubecl::prelude::*;

use super::flash_fwd::{SLICE_WORDS, WORK_WORDS};
use super::rows::{kv_row, row_keys};

/// Query rows per cube (one plane each).
pub const ROWS_PER_CUBE: usize = 4;
/// Most cubes of an exact kernel's launch (grid-stride over its rows), so that a call whose
/// flag is clear pays for one small wave of cubes that read the flag and return.
pub const EXACT_CUBES: usize = 1024;

/// Online softmax of one (row, head) plane over the absolute keys `[j0, j1)` of kv head
/// `head_kv`: `qv` this lane's scaled q dimensions, `o` its output accumulator; returns the new
/// running maximum and sum. `paged`: K,V rows through the page table `pages` (`rows::kv_row`).
/// `head_dim_v`: v's head_dim (and `o`'s, `head_dim_v / 32` a lane).
#[allow(clippy::too_many_arguments)]
#[cube]
fn visit_keys<E: Float>(
    k: &Array<E>,
    v: &Array<E>,
    qv: &Array<f32>,
    o: &mut Array<f32>,
    m0: f32,
    l0: f32,
    j0: u32,
    j1: u32,
    heads_kv: u32,
    head_kv: u32,
    inf: f32,
    pages: &Array<u32>,
    #[comptime] head_dim: usize,
    #[comptime] head_dim_v: usize,
    #[comptime] paged: bool,
) -> (f32, f32) {
    let per_lane = comptime!(head_dim / 32);
    let per_lane_v = comptime!(head_dim_v / 32);
    let lane = UNIT_POS_PLANE as usize;
    let mut m = m0;
    let mut l = l0;
    for j in j0..j1 {
        let kv = kv_row(j, pages, paged) * heads_kv + head_kv;
        let kbase = kv as usize * head_dim;
        let vbase = kv as usize * head_dim_v;
        let mut part = 0.0f32;
        #[unroll]
        for i in 0..per_lane {
            part += qv[i] * f32::cast_from(k[kbase + i * 32 + lane]);
        }
        let sc = plane_sum(part);
        let m_new = max(m, sc);
        // Every score so far -inf (e.g. an Inf in k): weight 0, not exp(-inf + inf) = NaN.
        let mut use_m = m_new;
        if m_new == -inf {
            use_m = 0.0f32;
        }
        let alpha = f32::exp(m - use_m);
        let p = f32::exp(sc - use_m);
        l = l * alpha + p;
        #[unroll]
        for i in 0..per_lane_v {
            o[i] = o[i] * alpha + p * f32::cast_from(v[vbase + i * 32 + lane]);
        }
        m = m_new;
    }
    (m, l)
}

/// Loads this lane's scaled q dimensions of `(row, head)` into `qv` and zeroes `o` (v's
/// `head_dim_v / 32` a lane).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_row<E: Float>(
    q: &Array<E>,
    qv: &mut Array<f32>,
    o: &mut Array<f32>,
    row: u32,
    head: u32,
    heads_q: u32,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] head_dim_v: usize,
) {
    let per_lane = comptime!(head_dim / 32);
    let lane = UNIT_POS_PLANE as usize;
    let qbase = (row * heads_q + head) as usize * head_dim;
    #[unroll]
    for i in 0..per_lane {
        qv[i] = f32::cast_from(q[qbase + i * 32 + lane]) * scale;
    }
    #[unroll]
    for i in 0..comptime!(head_dim_v / 32) {
        o[i] = 0.0f32;
    }
}

/// Writes `o / l` (out rows of `head_dim_v`, v's head_dim) and the LSE `m + ln(l)` of `(row,
/// head)`; a row that saw no key (l = 0): zeros and LSE `inf`.
#[allow(clippy::too_many_arguments)]
#[cube]
fn write_row<E: Float>(
    out: &mut Array<E>,
    lse: &mut Array<f32>,
    o: &Array<f32>,
    m: f32,
    l: f32,
    row: u32,
    head: u32,
    heads_q: u32,
    total_q: u32,
    inf: f32,
    #[comptime] head_dim_v: usize,
) {
    let per_lane = comptime!(head_dim_v / 32);
    let lane = UNIT_POS_PLANE;
    let obase = (row * heads_q + head) as usize * head_dim_v;
    let mut inv = 0.0f32;
    if l > 0.0f32 {
        inv = 1.0f32 / l;
    }
    #[unroll]
    for i in 0..per_lane {
        out[obase + i * 32 + lane as usize] = E::cast_from(o[i] * inv);
    }
    if lane == 0 {
        let mut val = inf;
        if l != 0.0f32 {
            val = m + f32::ln(l);
        }
        lse[(head * total_q + row) as usize] = val;
    }
}

/// The forward of one (query row, head) of a dense, varlen or grouped call: `row_seg[row]` its
/// segment (u32::MAX when none), `segs` four u32 per segment (q_start, q_len, k_start, k_len).
#[allow(clippy::too_many_arguments)]
#[cube]
fn attend_row<E: Float>(
    q: &Array<E>,
    k: &Array<E>,
    v: &Array<E>,
    out: &mut Array<E>,
    lse: &mut Array<f32>,
    row_seg: &Array<u32>,
    segs: &Array<u32>,
    row: u32,
    head: u32,
    scale: f32,
    heads_q: u32,
    heads_kv: u32,
    total_q: u32,
    inf: f32,
    win_l: u32,
    win_r: u32,
    pages: &Array<u32>,
    #[comptime] head_dim: usize,
    #[comptime] head_dim_v: usize,
    #[comptime] paged: bool,
) {
    let seg = row_seg[row as usize];
    let mut o = Array::<f32>::new(comptime!(head_dim_v / 32));
    let mut qv = Array::<f32>::new(comptime!(head_dim / 32));
    load_row::<E>(q, &mut qv, &mut o, row, head, heads_q, scale, head_dim, head_dim_v);
    let mut m = -inf;
    let mut l = 0.0f32;
    if seg != u32::MAX {
        let q_start = segs[seg as usize * 4];
        let q_len = segs[seg as usize * 4 + 1];
        let k_start = segs[seg as usize * 4 + 2];
        let k_len = segs[seg as usize * 4 + 3];
        let (lo, hi) = row_keys(q_len, k_len, row - q_start, win_l, win_r);
        let head_kv = head / (heads_q / heads_kv);
        let (m1, l1) = visit_keys::<E>(k, v, &qv, &mut o, m, l, k_start + lo, k_start + hi, heads_kv, head_kv, inf, pages, head_dim, head_dim_v,
            paged);
        m = m1;
        l = l1;
    }
    write_row::<E>(out, lse, &o, m, l, row, head, heads_q, total_q, inf, head_dim_v);
}

/// The f32 forward: one cube per `ROWS_PER_CUBE` rows (`CUBE_POS_X`) of one head (`CUBE_POS_Y`).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn rowwise_fwd_f32(
    q: &Array<f32>,
    k: &Array<f32>,
    v: &Array<f32>,
    out: &mut Array<f32>,
    lse: &mut Array<f32>,
    row_seg: &Array<u32>,
    segs: &Array<u32>,
    scale: f32,
    heads_q: u32,
    heads_kv: u32,
    total_q: u32,
    inf: f32,
    win_l: u32,
    win_r: u32,
    pages: &Array<u32>,
    #[comptime] head_dim: usize,
    #[comptime] paged: bool,
) {
    let row = CUBE_POS_X * ROWS_PER_CUBE as u32 + UNIT_POS / 32u32;
    if row < total_q {
        attend_row::<f32>(
            q, k, v, out, lse, row_seg, segs, row, CUBE_POS_Y, scale, heads_q, heads_kv, total_q, inf, win_l, win_r,
            pages, head_dim, head_dim, paged,
        );
    }
}

/// The exact forward of an f16/bf16 dense, varlen or grouped call whose v holds a non-finite
/// element (`nonfinite[0] != 0`; else every cube returns at once). Writes every row of out and
/// lse (rows no segment covers: zeros, lse `inf`). Grid: at most [`EXACT_CUBES`] cubes, each plane
/// striding over the (row, head) pairs. `head_dim_v`: v's and out's head_dim (the call's
/// `Dims::head_dim_v`; `head_dim` where v shares q's).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn rowwise_fwd_exact<E: Float>(
    q: &Array<E>,
    k: &Array<E>,
    v: &Array<E>,
    out: &mut Array<E>,
    lse: &mut Array<f32>,
    row_seg: &Array<u32>,
    segs: &Array<u32>,
    nonfinite: &Array<u32>,
    scale: f32,
    heads_q: u32,
    heads_kv: u32,
    total_q: u32,
    inf: f32,
    win_l: u32,
    win_r: u32,
    pages: &Array<u32>,
    #[comptime] head_dim: usize,
    #[comptime] head_dim_v: usize,
    #[comptime] paged: bool,
) {
    if nonfinite[0] == 0u32 {
        terminate!();
    }
    let pairs = total_q * heads_q;
    let stride = CUBE_COUNT_X * ROWS_PER_CUBE as u32;
    let mut w = CUBE_POS_X * ROWS_PER_CUBE as u32 + UNIT_POS / 32u32;
    while w < pairs {
        let row = w / heads_q;
        let head = w % heads_q;
        attend_row::<E>(q, k, v, out, lse, row_seg, segs, row, head, scale, heads_q, heads_kv, total_q, inf, win_l, win_r, pages, head_dim, head_dim_v,
            paged);
        w += stride;
    }
}

/// The exact forward of an f16/bf16 block-sparse call whose v holds a non-finite element
/// (`nonfinite[0] != 0`; else every cube returns at once), over the tensor-core kernel's sparse
/// plan (`cuda::sparse`): work item `x` = one slice `(segment, first packed row, rows)` of `hp`
/// heads per query row, its key-block list for index head `y` at `tile_ref[(y * n_items + x) * 2]`
/// (offset into `blocks`, key tiles; `tiles_per_block` tiles per block of `k_block` keys). Each
/// packed row visits the keys of its listed blocks that it sees (causal bound). Grid: at most
/// [`EXACT_CUBES`] cubes striding over the (item, y) pairs, four planes over an item's rows.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn rowwise_sparse_fwd_exact<E: Float>(
    q: &Array<E>,
    k: &Array<E>,
    v: &Array<E>,
    out: &mut Array<E>,
    lse: &mut Array<f32>,
    work: &Array<u32>,
    slices: &Array<u32>,
    segs: &Array<u32>,
    tile_ref: &Array<u32>,
    blocks: &Array<u32>,
    nonfinite: &Array<u32>,
    scale: f32,
    heads_q: u32,
    heads_kv: u32,
    total_q: u32,
    hp: u32,
    n_items: u32,
    n_ys: u32,
    inf: f32,
    k_block: u32,
    tiles_per_block: u32,
    win_l: u32,
    win_r: u32,
    #[comptime] head_dim: usize,
) {
    if nonfinite[0] == 0u32 {
        terminate!();
    }
    let per_lane = comptime!(head_dim / 32);
    let plane = UNIT_POS / 32u32;
    let group = heads_q / heads_kv;
    let mut w = CUBE_POS_X;
    while w < n_items * n_ys {
        let x = w % n_items;
        let y = w / n_items;
        let sl = work[(x * WORK_WORDS as u32) as usize] as usize * SLICE_WORDS;
        let seg = slices[sl] as usize;
        let p0 = slices[sl + 1];
        let n = slices[sl + 2];
        let q_start = segs[seg * 4];
        let q_len = segs[seg * 4 + 1];
        let k_start = segs[seg * 4 + 2];
        let k_len = segs[seg * 4 + 3];
        let r = ((y * n_items + x) * 2u32) as usize;
        let list = tile_ref[r];
        let n_blocks = (tile_ref[r + 1] + tiles_per_block - 1) / tiles_per_block;
        let mut p = p0 + plane;
        while p < p0 + n {
            let qr = p / hp;
            let head = y * hp + p % hp;
            let row = q_start + qr;
            let mut o = Array::<f32>::new(per_lane);
            let mut qv = Array::<f32>::new(per_lane);
            load_row::<E>(q, &mut qv, &mut o, row, head, heads_q, scale, head_dim, head_dim);
            let (lo, hi) = row_keys(q_len, k_len, qr, win_l, win_r);
            let mut m = -inf;
            let mut l = 0.0f32;
            for b in 0..n_blocks {
                let kb = blocks[(list + b) as usize];
                let j0 = max(kb * k_block, lo);
                let j1 = min(kb * k_block + k_block, hi);
                if j0 < j1 {
                    let (m1, l1) =
                        visit_keys::<E>(k, v, &qv, &mut o, m, l, k_start + j0, k_start + j1, heads_kv, head / group, inf, blocks, head_dim, head_dim, false);
                    m = m1;
                    l = l1;
                }
            }
            write_row::<E>(out, lse, &o, m, l, row, head, heads_q, total_q, inf, head_dim);
            p += ROWS_PER_CUBE as u32;
        }
        w += CUBE_COUNT_X;
    }
}
