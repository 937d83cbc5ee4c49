//! Per-channel statistics of K or V over 64-key chunks, the first pass of the quantisation
//! launches (`backend::cuda::sparse_int8`): K's column sums (the K mean of INT8 smoothing, summed in
//! chunk order by `int8_qk::int8_k_mean`) and V's column maxima of |v| (the FP8 V scales,
//! `fp8_v::fp8_v_scales`). Fixed chunks, then the chunks in order: the same result every run.

use cubecl::prelude::*;

use super::math::channel8;

/// Keys per chunk (`int8_qk::MEAN_CHUNK`, `fp8_v::VT_CHUNK`).
pub const CHUNK: usize = 64;

/// Units of a `chunk_stats` cube.
pub const CHUNK_THREADS: usize = 128;

/// Column sums (`absmax` false) or maxima of |x| (`absmax`) of `x` (token-major `[total, heads_kv,
/// head_dim]`, read as 16-byte vectors of 8 channels: `NX` = 4 words) over 64-key chunks: cube
/// (chunk, sequence, kv head); `out[((b * chunks + c) * heads_kv + h) * head_dim + ch]` (chunks
/// past a sequence's keys are not written: the second passes read only their own). A unit holds
/// 8 channels of every `L`-th key of the chunk (`L = CHUNK_THREADS * 8 / head_dim` key lanes: all
/// its loads in flight at once); the lanes' partials meet in shared memory and are combined in
/// lane order (sums: keys `l, l + L, ..` in order within lane `l`, then the lanes in order: the
/// same result every run). With `absmax` (V's maxima), a NaN or Inf also sets `flag[0]` to 1 (the
/// forward's non-finite-v flag, `nonfinite::v_nonfinite`, zeroed by the host before).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn chunk_stats<E: Float, NX: Size>(
    x: &Array<Vector<u32, NX>>,
    out: &mut Array<f32>,
    flag: &mut Array<u32>,
    segs: &Array<u32>,
    heads_kv: u32,
    #[comptime] head_dim: usize,
    #[comptime] absmax: bool,
) {
    let c = CUBE_POS_X;
    let b = CUBE_POS_Y as usize;
    let h = CUBE_POS_Z;
    let vecs = comptime!(head_dim / 8);
    let lanes = comptime!(CHUNK_THREADS * 8 / head_dim);
    let co = UNIT_POS as usize % vecs;
    let kl = UNIT_POS as usize / vecs;
    let k_start = segs[b * 4 + 2];
    let k_len = segs[b * 4 + 3];
    let lo = c * CHUNK as u32;
    let mut part = SharedMemory::<f32>::new(comptime!(CHUNK_THREADS * 8));
    if lo < k_len {
        let mut acc = Array::<f32>::new(8usize);
        #[unroll]
        for e in 0..8usize {
            acc[e] = 0.0f32;
        }
        let mut bad = false;
        #[unroll]
        for i in 0..comptime!(CHUNK / (CHUNK_THREADS * 8 / head_dim)) {
            let j = lo + (kl + i * lanes) as u32;
            if j < k_len {
                let vec = x[((k_start + j) * heads_kv + h) as usize * vecs + co];
                #[unroll]
                for e in 0..8usize {
                    let v = channel8::<E, NX>(&vec, e);
                    if absmax {
                        acc[e] = max(acc[e], f32::abs(v));
                        bad = bad || !(f32::abs(v) <= f32::MAX);
                    } else {
                        acc[e] += v;
                    }
                }
            }
        }
        if absmax && bad {
            flag[0] = 1u32;
        }
        #[unroll]
        for e in 0..8usize {
            part[kl * head_dim + co * 8 + e] = acc[e];
        }
    }
    sync_cube();
    let ch = UNIT_POS as usize;
    if lo < k_len && ch < head_dim {
        let mut acc = 0.0f32;
        #[unroll]
        for l in 0..lanes {
            let p = part[l * head_dim + ch];
            if absmax {
                acc = max(acc, p);
            } else {
                acc += p;
            }
        }
        out[((b * CUBE_COUNT_X as usize + c as usize) * heads_kv as usize + h as usize) * head_dim + ch] = acc;
    }
}
