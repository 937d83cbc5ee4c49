//! Backward for f32 inputs (no tensor cores), the counterpart of `rowwise_fwd`: one plane per
//! (query row, head) for dQ and per (key, kv head) for dK, dV; P recomputed from the LSE. With
//! `paged`, K,V are read and dK,dV written at the rows of a paged K,V (`rows::kv_row`).

use cubecl::prelude::*;

use super::tiles::BWD_BN;
use super::rows::{key_rows, kv_row, row_keys};

/// Rows (or keys) per cube of the f32 kernels (one plane each).
pub const F32_ROWS_PER_CUBE: usize = 4;

/// dQ for f32: `row_seg[t]` = segment of query row t (u32::MAX when none: dq = 0).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn rowwise_bwd_dq_f32(
    q: &Array<f32>,
    k: &Array<f32>,
    v: &Array<f32>,
    dout: &Array<f32>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    dq: &mut Array<f32>,
    row_seg: &Array<u32>,
    segs: &Array<u32>,
    scale: f32,
    heads_q: u32,
    heads_kv: u32,
    total_q: u32,
    win_l: u32,
    win_r: u32,
    pages: &Array<u32>,
    #[comptime] head_dim: usize,
    #[comptime] paged: bool,
) {
    let per_lane = comptime!(head_dim / 32);
    let lane = UNIT_POS_PLANE as usize;
    let row = CUBE_POS_X * F32_ROWS_PER_CUBE as u32 + UNIT_POS / 32u32;
    let head = CUBE_POS_Y;
    if row < total_q {
        let seg = row_seg[row as usize];
        let qbase = (row * heads_q + head) as usize * head_dim;
        let mut qv = Array::<f32>::new(per_lane);
        let mut dov = Array::<f32>::new(per_lane);
        let mut acc = Array::<f32>::new(per_lane);
        #[unroll]
        for i in 0..per_lane {
            qv[i] = q[qbase + i * 32 + lane];
            dov[i] = dout[qbase + i * 32 + lane];
            acc[i] = 0.0f32;
        }
        if seg != u32::MAX {
            let q_start = segs[seg as usize * 4];
            let q_len = segs[seg as usize * 4 + 1];
            let k_start = segs[seg as usize * 4 + 2];
            let k_len = segs[seg as usize * 4 + 3];
            let (lo, hi) = row_keys(q_len, k_len, row - q_start, win_l, win_r);
            let head_kv = head / (heads_q / heads_kv);
            let li = (head * total_q + row) as usize;
            let l = lse[li];
            let dd = delta[li];
            for j in lo..hi {
                let kbase = (kv_row(k_start + j, pages, paged) * heads_kv + head_kv) as usize * head_dim;
                let mut ps = 0.0f32;
                let mut pd = 0.0f32;
                #[unroll]
                for i in 0..per_lane {
                    ps += qv[i] * k[kbase + i * 32 + lane];
                    pd += dov[i] * v[kbase + i * 32 + lane];
                }
                let sv = plane_sum(ps);
                let dpv = plane_sum(pd);
                let p = f32::exp(sv * scale - l);
                let ds = p * (dpv - dd);
                #[unroll]
                for i in 0..per_lane {
                    acc[i] += ds * k[kbase + i * 32 + lane];
                }
            }
        }
        #[unroll]
        for i in 0..per_lane {
            dq[qbase + i * 32 + lane] = acc[i] * scale;
        }
    }
}

/// dK, dV for f32: one plane per (key, kv head); segments from the per-key-tile CSR list
/// (tiles of [`BWD_BN`] keys), visited in ascending order.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn rowwise_bwd_dkdv_f32(
    q: &Array<f32>,
    k: &Array<f32>,
    v: &Array<f32>,
    dout: &Array<f32>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    dk: &mut Array<f32>,
    dv: &mut Array<f32>,
    tile_off: &Array<u32>,
    tile_segs: &Array<u32>,
    segs: &Array<u32>,
    scale: f32,
    heads_q: u32,
    heads_kv: u32,
    total_q: u32,
    total_k: u32,
    win_l: u32,
    win_r: u32,
    pages: &Array<u32>,
    #[comptime] head_dim: usize,
    #[comptime] paged: bool,
) {
    let per_lane = comptime!(head_dim / 32);
    let lane = UNIT_POS_PLANE as usize;
    let key = CUBE_POS_X * F32_ROWS_PER_CUBE as u32 + UNIT_POS / 32u32;
    let hk = CUBE_POS_Y;
    if key < total_k {
        let kbase = (kv_row(key, pages, paged) * heads_kv + hk) as usize * head_dim;
        let mut kv = Array::<f32>::new(per_lane);
        let mut vv = Array::<f32>::new(per_lane);
        let mut dka = Array::<f32>::new(per_lane);
        let mut dva = Array::<f32>::new(per_lane);
        #[unroll]
        for i in 0..per_lane {
            kv[i] = k[kbase + i * 32 + lane];
            vv[i] = v[kbase + i * 32 + lane];
            dka[i] = 0.0f32;
            dva[i] = 0.0f32;
        }
        let group = heads_q / heads_kv;
        let kt = (key / BWD_BN as u32) as usize;
        for si in tile_off[kt]..tile_off[kt + 1] {
            let seg = tile_segs[si as usize] as usize;
            let q_start = segs[seg * 4];
            let q_len = segs[seg * 4 + 1];
            let k_start = segs[seg * 4 + 2];
            let k_len = segs[seg * 4 + 3];
            if key >= k_start && key < k_start + k_len {
                let (r_min, r_end) = key_rows(q_len, k_len, (key - k_start) as i32, win_l, win_r);
                for hh in 0..group {
                    let h = hk * group + hh;
                    for r in r_min as u32..max(r_end, r_min) as u32 {
                        let t = q_start + r;
                        let qbase = (t * heads_q + h) as usize * head_dim;
                        let li = (h * total_q + t) as usize;
                        let mut ps = 0.0f32;
                        let mut pd = 0.0f32;
                        #[unroll]
                        for i in 0..per_lane {
                            ps += q[qbase + i * 32 + lane] * kv[i];
                            pd += dout[qbase + i * 32 + lane] * vv[i];
                        }
                        let sv = plane_sum(ps);
                        let dpv = plane_sum(pd);
                        let p = f32::exp(sv * scale - lse[li]);
                        let ds = p * (dpv - delta[li]);
                        #[unroll]
                        for i in 0..per_lane {
                            dva[i] += p * dout[qbase + i * 32 + lane];
                            dka[i] += ds * q[qbase + i * 32 + lane];
                        }
                    }
                }
            }
        }
        #[unroll]
        for i in 0..per_lane {
            dk[kbase + i * 32 + lane] = dka[i] * scale;
            dv[kbase + i * 32 + lane] = dva[i];
        }
    }
}
