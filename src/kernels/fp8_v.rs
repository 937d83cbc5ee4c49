//! FP8 e4m3 V for the Hopper forward's FP8 P.V (SageAttention2 style, `sparse::Int8Qk::pv_fp8`):
//! V quantised per (sequence, kv head, channel) and written transposed, the K-major B operand
//! FP8 MMAs need (`kernels::sm90::wgmma_rs_e4m3`).
//!
//! Three launches, on the caller's stream, into its workspace:
//! 1. `chunk_stats::chunk_stats` (maxima): max |v| per (64-key chunk, sequence, kv head, channel);
//! 2. [`fp8_v_scales`]: per (sequence, kv head, channel) `scale = amax / 448` and
//!    `inv = 448 / amax` ((1, 0) when amax is 0 or 448 / amax overflows);
//! 3. [`fp8_v_quantize`]: `e4m3(v * inv)` (round to nearest even, saturating), transposed.
//!
//! V^T layout: one row of bytes per (kv head, channel), `row_words` u32 words long; sequence `b`'s
//! keys start at byte [`col_base`] of every row (its first key rounded up to 16 bytes, plus
//! [`VT_GAP`] per earlier sequence, so that each sequence has room for its keys rounded up to 64),
//! keys past a sequence's end up to the next multiple of 64 are written as zeros. Inside each
//! group of 16 keys, key `r` sits at byte [`slot_of_key`]`(r)`: the order in which
//! `sm90::pack_p_e4m3` hands P's columns to the MMA, so P.V needs no shuffle.

use cubecl::prelude::*;

use super::math::channel8;
use super::sm90::e4m3x4;
use crate::fp8::E4M3_MAX as FP8_MAX;

/// Keys per quantisation cube: the key tile of the Hopper kernel with FP8 P.V (the 64-byte rows
/// of its V^T tiles).
pub const VT_CHUNK: usize = crate::sparse::TILE_KEYS;
const _: () = assert!(VT_CHUNK == super::chunk_stats::CHUNK);
/// Bytes of V^T row reserved per sequence beyond its keys (`col_base`).
pub const VT_GAP: usize = 80;
/// Units of a quantisation cube.
pub const VT_THREADS: usize = 128;

/// Byte (inside a group of 16 keys) where key `r` of the group sits in a V^T row: A column
/// `4 t + i` of a k32 step holds key `8 (i / 2) + 2 t + i % 2` (`sm90::pack_p_e4m3`).
pub const fn slot_of_key(r: usize) -> usize {
    let t = (r % 8) / 2;
    let i = 2 * ((r / 8) % 2) + r % 2;
    4 * t + i
}

/// First byte of sequence `b` (its keys from `k_start`) in a V^T row.
pub const fn col_base(k_start: usize, b: usize) -> usize {
    k_start.div_ceil(16) * 16 + VT_GAP * b
}

/// Bytes of a V^T row for `total_k` keys in `batch` sequences (a multiple of 16).
pub const fn vt_row_bytes(total_k: usize, batch: usize) -> usize {
    (total_k + VT_GAP * batch).div_ceil(16) * 16
}

/// `col_base` in a kernel.
#[cube]
pub fn vt_col_base(k_start: u32, b: u32) -> u32 {
    ((k_start + 15u32) / 16u32) * 16u32 + comptime!(VT_GAP as u32) * b
}

/// The scales from the chunk maxima: cube (sequence, kv head), one unit per channel;
/// `sc[i]` = amax / 448 (1 when amax is 0) and `sc[n + i]` = 448 / amax (0 when amax is 0),
/// `i = (b * heads_kv + h) * head_dim + ch`.
#[cube(launch_unchecked)]
pub fn fp8_v_scales(part: &Array<f32>, sc: &mut Array<f32>, segs: &Array<u32>, heads_kv: u32, chunks: u32, n: u32, #[comptime] head_dim: usize) {
    let b = CUBE_POS_X as usize;
    let h = CUBE_POS_Y as usize;
    let ch = UNIT_POS as usize;
    if ch < head_dim {
        let k_len = segs[b * 4 + 3];
        let nc = (k_len + VT_CHUNK as u32 - 1) / VT_CHUNK as u32;
        let mut m = 0.0f32;
        for c in 0..nc {
            m = max(m, part[((b * chunks as usize + c as usize) * heads_kv as usize + h) * head_dim + ch]);
        }
        // (1, 0) where amax is 0 or so small that 448 / amax overflows (the CPU's rule)
        let mut scale = 1.0f32;
        let mut inv = 0.0f32;
        let i = FP8_MAX / m;
        if m > 0.0f32 && i <= f32::MAX {
            scale = m / FP8_MAX;
            inv = i;
        }
        let i = (b * heads_kv as usize + h) * head_dim + ch;
        sc[i] = scale;
        sc[n as usize + i] = inv;
    }
}

/// V^T in FP8 (module docs): cube (64-key chunk, sequence, kv head). The chunk's V rows are staged
/// in shared memory as they are (16-byte vectors of 8 channels, `v` read as `NV` = 4 words; zeros
/// past the sequence's keys; rows one vector longer than `head_dim / 8`, so that the reads below
/// meet at most 2-way bank conflicts). Then a unit takes word `w` (four keys in [`slot_of_key`]
/// order: `2 q`, `2 q + 1`, `8 + 2 q`, `9 + 2 q` of group `w / 4`, `q = w % 4`) of 8 channels'
/// 64-byte row segments: four 16-byte shared reads, eight word stores; 16 consecutive units write
/// one segment of each of the 8 rows (coalesced).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn fp8_v_quantize<E: Float, NV: Size>(
    v: &Array<Vector<u32, NV>>,
    sc: &Array<f32>,
    vt: &mut Array<u32>,
    segs: &Array<u32>,
    heads_kv: u32,
    row_words: u32,
    n: u32,
    #[comptime] head_dim: usize,
) {
    let c = CUBE_POS_X;
    let b = CUBE_POS_Y;
    let h = CUBE_POS_Z;
    let k_start = segs[(b * 4u32 + 2u32) as usize];
    let k_len = segs[(b * 4u32 + 3u32) as usize];
    let lo = c * VT_CHUNK as u32;
    // 16-byte vectors per V row and per shared row
    let vecs = comptime!(head_dim / 8);
    let stride = comptime!(head_dim / 8 + 1);
    let mut tile = SharedMemory::<Vector<u32, NV>>::new(comptime!(VT_CHUNK * (head_dim / 8 + 1)));
    if lo < k_len {
        #[unroll]
        for it in 0..comptime!(VT_CHUNK * head_dim / 8 / VT_THREADS) {
            let idx = UNIT_POS as usize + it * VT_THREADS;
            let key = idx / vecs;
            let co = idx % vecs;
            let j = lo + key as u32;
            let mut x = Vector::<u32, NV>::empty();
            #[unroll]
            for e in 0..4usize {
                x[e] = 0u32;
            }
            if j < k_len {
                x = v[((k_start + j) * heads_kv + h) as usize * vecs + co];
            }
            tile[key * stride + co] = x;
        }
    }
    sync_cube();
    if lo < k_len {
        let col_w = ((vt_col_base(k_start, b) + lo) / 4u32) as usize;
        let mut word = Array::<u32>::new(1usize);
        let w = UNIT_POS as usize % 16;
        let k0 = (w / 4) * 16 + 2 * (w % 4);
        #[unroll]
        for it in 0..comptime!(head_dim / 8 * 16 / VT_THREADS) {
            let co = UNIT_POS as usize / 16 + it * comptime!(VT_THREADS / 16);
            let x0 = tile[k0 * stride + co];
            let x1 = tile[(k0 + 1) * stride + co];
            let x2 = tile[(k0 + 8) * stride + co];
            let x3 = tile[(k0 + 9) * stride + co];
            let ib = n as usize + (b * heads_kv + h) as usize * head_dim + co * 8;
            let ob = (h as usize * head_dim + co * 8) * row_words as usize + col_w + w;
            #[unroll]
            for e in 0..8usize {
                let inv = sc[ib + e];
                let a = channel8::<E, NV>(&x0, e) * inv;
                let p = channel8::<E, NV>(&x1, e) * inv;
                let q = channel8::<E, NV>(&x2, e) * inv;
                let r = channel8::<E, NV>(&x3, e) * inv;
                e4m3x4(&mut word, 0usize, a, p, q, r);
                vt[ob + e * row_words as usize] = word[0];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_a_permutation_matching_the_a_fragment() {
        let mut seen = [false; 16];
        for r in 0..16 {
            let s = slot_of_key(r);
            assert!(!seen[s]);
            seen[s] = true;
            // A column 4 t + i holds key 8 (i / 2) + 2 t + i % 2
            let (t, i) = (s / 4, s % 4);
            assert_eq!(r, 8 * (i / 2) + 2 * t + i % 2);
        }
        // the kernel's word q of a group holds keys 2q, 2q+1, 8+2q, 9+2q at bytes 4q..4q+4
        for q in 0..4 {
            assert_eq!([slot_of_key(2 * q), slot_of_key(2 * q + 1), slot_of_key(8 + 2 * q), slot_of_key(9 + 2 * q)], [4 * q, 4 * q + 1, 4 * q + 2, 4 * q + 3]);
        }
    }

    #[test]
    fn sequences_do_not_overlap_in_a_row() {
        // every sequence's keys rounded up to 64 fit before the next one's base, and in the row
        let lens = [1usize, 63, 64, 65, 0, 200, 15, 16, 17, 129];
        let mut k_start = 0;
        let bases: Vec<(usize, usize)> = lens.iter().enumerate().map(|(b, &l)| {
            let r = (col_base(k_start, b), l);
            k_start += l;
            r
        }).collect();
        let row = vt_row_bytes(k_start, lens.len());
        for (b, &(base, len)) in bases.iter().enumerate() {
            assert_eq!(base % 16, 0);
            let end = base + len.div_ceil(64) * 64;
            assert!(end <= row, "sequence {b}");
            if let Some(&(next, _)) = bases.get(b + 1) {
                assert!(end <= next, "sequence {b}: {end} > {next}");
            }
        }
    }
}
