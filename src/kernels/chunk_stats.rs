//! Per-channel statistics of K or V over 64-key chunks, the first pass of the quantisation
//! launches (`backend::cuda::sparse_int8`): K's column sums (the K mean of INT8 smoothing, summed in
//! chunk order by `int8_qk::int8_k_mean`) and V's column maxima of |v| (the FP8 V scales,
//! `fp8_v::fp8_v_scales`). Fixed chunks, then the chunks in order: the same result every run.

use cubecl::prelude::*;

/// Keys per chunk (`int8_qk::MEAN_CHUNK`, `fp8_v::VT_CHUNK`).
pub const CHUNK: usize = 64;

/// Column sums (`absmax` false) or maxima of |x| (`absmax`) of `x` (token-major `[total, heads_kv,
/// head_dim]`) over 64-key chunks: cube (chunk, sequence, kv head), one unit per channel;
/// `out[((b * chunks + c) * heads_kv + h) * head_dim + ch]` (chunks past a sequence's keys are not
/// written: the second passes read only their own).
#[cube(launch_unchecked)]
pub fn chunk_stats<E: Float>(x: &Array<E>, out: &mut Array<f32>, segs: &Array<u32>, heads_kv: u32, #[comptime] head_dim: usize,
    #[comptime] absmax: bool) {
    let c = CUBE_POS_X;
    let b = CUBE_POS_Y as usize;
    let h = CUBE_POS_Z;
    let ch = UNIT_POS as usize;
    let k_start = segs[b * 4 + 2];
    let k_len = segs[b * 4 + 3];
    let lo = c * CHUNK as u32;
    if lo < k_len && ch < head_dim {
        let hi = min(lo + CHUNK as u32, k_len);
        let mut acc = 0.0f32;
        for j in lo..hi {
            let v = f32::cast_from(x[((k_start + j) * heads_kv + h) as usize * head_dim + ch]);
            if absmax {
                acc = max(acc, f32::abs(v));
            } else {
                acc += v;
            }
        }
        out[((b * CUBE_COUNT_X as usize + c as usize) * heads_kv as usize + h as usize) * head_dim + ch] = acc;
    }
}
