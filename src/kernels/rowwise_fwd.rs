//! Plain f32 forward (no tensor cores): one plane (warp) per (query row, query head), each lane
//! holding `head_dim / 32` dimensions of q and of the output; keys are visited one at a time with
//! an online softmax. Accurate to f32 rounding; meant for f32 inputs, not for speed.

use cubecl::prelude::*;

use super::rows::row_keys;

/// Query rows per cube (one plane each).
pub const ROWS_PER_CUBE: usize = 4;

/// `row_seg`: for every query row, the segment that owns it (u32::MAX when none);
/// `segs`: four u32 per segment (q_start, q_len, k_start, k_len).
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
    #[comptime] head_dim: usize,
) {
    let per_lane = comptime!(head_dim / 32);
    let lane = UNIT_POS_PLANE;
    let row = CUBE_POS_X * ROWS_PER_CUBE as u32 + UNIT_POS / 32u32;
    let head = CUBE_POS_Y;
    if row < total_q {
        let seg = row_seg[row as usize];
        let qbase = (row * heads_q + head) as usize * head_dim;
        let mut o = Array::<f32>::new(per_lane);
        let mut qv = Array::<f32>::new(per_lane);
        #[unroll]
        for i in 0..per_lane {
            o[i] = 0.0f32;
            qv[i] = q[qbase + i * 32 + lane as usize] * scale;
        }
        let mut m = -inf;
        let mut l = 0.0f32;
        if seg != u32::MAX {
            let q_start = segs[seg as usize * 4];
            let q_len = segs[seg as usize * 4 + 1];
            let k_start = segs[seg as usize * 4 + 2];
            let k_len = segs[seg as usize * 4 + 3];
            let (lo, hi) = row_keys(q_len, k_len, row - q_start, win_l, win_r);
            let head_kv = head / (heads_q / heads_kv);
            for j in lo..hi {
                let kbase = ((k_start + j) * heads_kv + head_kv) as usize * head_dim;
                let mut part = 0.0f32;
                #[unroll]
                for i in 0..per_lane {
                    part += qv[i] * k[kbase + i * 32 + lane as usize];
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
                for i in 0..per_lane {
                    o[i] = o[i] * alpha + p * v[kbase + i * 32 + lane as usize];
                }
                m = m_new;
            }
        }
        let mut inv = 0.0f32;
        if l > 0.0f32 {
            inv = 1.0f32 / l;
        }
        #[unroll]
        for i in 0..per_lane {
            out[qbase + i * 32 + lane as usize] = o[i] * inv;
        }
        if lane == 0 {
            let mut val = inf;
            if l != 0.0f32 {
                val = m + f32::ln(l);
            }
            lse[(head * total_q + row) as usize] = val;
        }
    }
}
