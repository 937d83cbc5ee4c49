//! INT8 Q K^T of the block-sparse forward (SageAttention style): the quantisation kernels and the
//! int8 parts of `flash_fwd::flash_fwd_mma2` with `int8 = true`.
//!
//! Quantisation (before the forward, on the same stream, into the caller's workspace):
//! 1. `chunk_stats::chunk_stats` (sums) + `int8_k_mean` (with K smoothing): the mean of K over each sequence's keys
//!    per (sequence, kv head, channel), f32, summed in a fixed order (64-key chunks, then the
//!    chunks in order): the same result every run.
//! 2. `int8_quantize`, once for Q and once for K: one cube per (block of rows, sequence, head).
//!    Pass 1 writes each row's max |x - mean| (and, for Q with smoothing, the LSE correction
//!    `softmax_scale * q . mean`); pass 2 takes the max over the row's scale group
//!    ([`crate::sparse::GroupRule`]: chunk, period, width inside the block), `scale = amax / 127`
//!    and writes `rint((x - mean) * (127 / amax))` clamped to [-127, 127] as int8 (round half to
//!    even; the CPU backend does the same f32 operations) and the row's scale.
//!
//! Int8 rows in global and shared memory (`flash_fwd_mma2`; the Hopper kernel takes them in channel
//! order, `natural`): `head_dim` bytes per (token, head), in 32-byte k-steps
//! whose 4-byte words are reordered `[0, 4, 1, 5, 2, 6, 3, 7]`, so that the two words thread
//! `t` of an `mma.m16n8k32` fragment needs from a row in one k-step (channels `4t..4t+4` and
//! `16+4t..16+4t+4`) are adjacent: one 8-byte shared load per row and k-step. In shared memory a
//! row is followed by [`PAD8`] bytes (rows 32 words apart modulo 8 banks' worth: the 16 lanes of a
//! half-warp read 4 rows x 4 words x 2 without a bank conflict). The arrays are typed as the
//! input's f16/bf16 (`E`): the forward only moves their bytes (cp.async 16 bytes = 8 `E`).

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::barrier::copy_async;
use cubecl::prelude::*;


/// Keys per partial sum of the K mean (`chunk_stats`).
pub const MEAN_CHUNK: usize = super::chunk_stats::CHUNK;
/// Units of a quantisation cube (4 warps; a row is `head_dim / 8` units).
pub const QUANT_THREADS: usize = 128;
/// Channels per unit of a quantisation cube (one 16-byte vector of `x`).
pub const QUANT_VEC: usize = 8;
/// Padding after each int8 row in shared memory, in `E` elements (32 bytes).
pub const PAD8: usize = 16;
/// `E` elements per 16-byte copy.
const VEC: usize = 8;
/// 1.5 * 2^23: `f32` bits `0x4B40_0000 + i` are `MAGIC + i` for |i| < 2^22.
pub const MAGIC: f32 = 12_582_912.0;
const MAGIC_BITS: i32 = 0x4B40_0000;

/// Shared-memory row stride (in `E`) of an int8 row of `head_dim` bytes.
pub fn stride8(head_dim: usize) -> usize {
    head_dim / 2 + PAD8
}

/// The K mean per (sequence, kv head, channel) from the chunk sums, in chunk order: cube
/// (sequence, kv head), one unit per channel; 0 for a sequence without keys.
#[cube(launch_unchecked)]
pub fn int8_k_mean(sums: &Array<f32>, mean: &mut Array<f32>, segs: &Array<u32>, heads_kv: u32, chunks: u32, #[comptime] head_dim: usize) {
    let b = CUBE_POS_X as usize;
    let h = CUBE_POS_Y as usize;
    let ch = UNIT_POS as usize;
    if ch < head_dim {
        let k_len = segs[b * 4 + 3];
        let n = (k_len + MEAN_CHUNK as u32 - 1) / MEAN_CHUNK as u32;
        let mut acc = 0.0f32;
        for c in 0..n {
            acc += sums[((b * chunks as usize + c as usize) * heads_kv as usize + h) * head_dim + ch];
        }
        let mut m = 0.0f32;
        if k_len > 0 {
            m = acc / f32::cast_from(k_len);
        }
        mean[(b * heads_kv as usize + h) * head_dim + ch] = m;
    }
}

/// Quantises the rows of one block (`block` rows of sequence `CUBE_POS_Y`, head `CUBE_POS_Z`)
/// of Q (`is_k = false`, `segs` words 0/1) or K (`is_k = true`, words 2/3). `x` is token-major
/// `[total, heads, head_dim]`, read as 16-byte vectors (`NX` = 4 words: 8 channels); `mean`
/// `[batch, heads_kv, head_dim]` is subtracted from K with `smooth` and dotted with Q rows (kv
/// head `h / group`) into `shift[h * total + t]` (times `softmax_scale`). Writes the int8 rows to
/// `xq` (u32 words, see the module doc), the row scales to `scale` (`[h * total + t]` for Q,
/// `[t * heads + h]` for K) and uses `amax` (`heads * total` f32) as scratch. Groups:
/// [`crate::sparse::GroupRule`] `(chunk, period, width)` on the row's offset inside the block, as
/// compile-time constants (the rules are fixed per granularity; runtime divisions made the pass
/// instruction-bound), `chunk` 0 for the whole block. `natural`: the int8 words in channel order
/// (the Hopper kernel's wgmma operands), else reordered for `mma.sync` (module docs).
///
/// A row is `head_dim / 8` units, each with one 16-byte vector (8 channels); a cube steps over
/// `QUANT_THREADS * 8 / head_dim` rows at a time, every unit of a plane in every step (the
/// reductions are shuffles among a row's units). Rounding: `clamp(v * inv, -127, 127) + MAGIC`
/// rounds to the nearest integer, ties to even, in the f32 add (|v * inv| <= 127 < 2^22), and the
/// low byte of its bits is the int8 value: the CPU's `rint` then clamp, without a conversion.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn int8_quantize<E: Float, NX: Size>(
    x: &Array<Vector<u32, NX>>,
    mean: &Array<f32>,
    xq: &mut Array<u32>,
    scale: &mut Array<f32>,
    amax: &mut Array<f32>,
    shift: &mut Array<f32>,
    segs: &Array<u32>,
    heads: u32,
    total: u32,
    group: u32,
    block: u32,
    softmax_scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] is_k: bool,
    #[comptime] smooth: bool,
    #[comptime] natural: bool,
    #[comptime] chunk: usize,
    #[comptime] period: usize,
    #[comptime] width: usize,
) {
    let b = CUBE_POS_Y as usize;
    let h = CUBE_POS_Z;
    // units per row (8 channels each) and rows per step
    let tpr = comptime!(head_dim / QUANT_VEC) as u32;
    let step = comptime!(QUANT_THREADS * QUANT_VEC / head_dim) as u32;
    let sub = UNIT_POS % tpr;
    let rsub = UNIT_POS / tpr;
    let off = if is_k { 2usize } else { 0usize };
    let start = segs[b * 4 + off];
    let len = segs[b * 4 + off + 1];
    let r0 = CUBE_POS_X * block;
    let kvh = (h / group) as usize;
    let mbase = (b * (heads / group) as usize + kvh) * head_dim + (sub * QUANT_VEC as u32) as usize;
    // this unit's 8 channels of the mean (zeros without smoothing)
    let mut mv = Array::<f32>::new(8usize);
    #[unroll]
    for e in 0..8usize {
        mv[e] = 0.0f32;
        if smooth {
            mv[e] = mean[mbase + e];
        }
    }
    let mut xv = Array::<f32>::new(8usize);
    if r0 < len {
        let r1 = min(r0 + block, len);
        // pass 1: per row max |x - mean| and (Q, smooth) the LSE correction
        let mut rb = r0;
        while rb < r1 {
            let r = rb + rsub;
            let valid = r < r1;
            let mut mx = 0.0f32;
            let mut dot = 0.0f32;
            if valid {
                load_row8::<E, NX>(x, ((start + r) * heads + h) * tpr + sub, &mut xv);
                #[unroll]
                for e in 0..8usize {
                    let mut v = xv[e];
                    if smooth {
                        if is_k {
                            v -= mv[e];
                        } else {
                            dot += v * mv[e];
                        }
                    }
                    mx = max(mx, f32::abs(v));
                }
            }
            mx = row_max(mx, tpr);
            if smooth && !is_k {
                dot = row_sum(dot, tpr);
            }
            if valid && sub == 0 {
                let i = (h * total + start + r) as usize;
                amax[i] = mx;
                if !is_k {
                    let mut s = 0.0f32;
                    if smooth {
                        s = softmax_scale * dot;
                    }
                    shift[i] = s;
                }
            }
            rb += step;
        }
    }
    sync_cube();
    if r0 < len {
        let r1 = min(r0 + block, len);
        let blen = r1 - r0;
        let mut rb = r0;
        while rb < r1 {
            let r = rb + rsub;
            let valid = r < r1;
            // the group's max over its rows: chunk `o / chunk`, class `(o % chunk % period) / width`
            // (the whole block when `chunk` is 0)
            let o = r - r0;
            let mut cs = 0u32;
            let mut class = 0u32;
            let mut glen = blen;
            if comptime!(chunk > 0) {
                cs = o - o % comptime!(chunk as u32);
                class = ((o - cs) % comptime!(period as u32)) / comptime!(width as u32);
                glen = comptime!(chunk as u32);
            }
            let mut g = 0.0f32;
            if valid {
                let gbase = (h * total + start + r0 + cs) as usize;
                let mut i = sub;
                while i < glen {
                    let mut same = true;
                    if comptime!(chunk > 0) {
                        same = (i % comptime!(period as u32)) / comptime!(width as u32) == class;
                    }
                    if cs + i < blen && same {
                        g = max(g, amax[gbase + i as usize]);
                    }
                    i += tpr;
                }
            }
            g = row_max(g, tpr);
            if valid {
                let mut sc = 1.0f32;
                let mut inv = 0.0f32;
                if g > 0.0f32 {
                    sc = g / 127.0f32;
                    inv = 127.0f32 / g;
                }
                let tok = start + r;
                load_row8::<E, NX>(x, (tok * heads + h) * tpr + sub, &mut xv);
                let mut words = Array::<u32>::new(2usize);
                #[unroll]
                for w in 0..2usize {
                    let mut packed = 0u32;
                    #[unroll]
                    for e in 0..4usize {
                        let mut v = xv[w * 4 + e];
                        if smooth && is_k {
                            v -= mv[w * 4 + e];
                        }
                        let t = max(min(v * inv, 127.0f32), -127.0f32) + MAGIC;
                        packed |= (u32::reinterpret(t) & 0xFFu32) << (8 * e as u32);
                    }
                    words[w] = packed;
                }
                let row = (tok * heads + h) as usize * comptime!(head_dim / 4);
                #[unroll]
                for w in 0..2usize {
                    // word q of k-step q / 8 goes to position 2 (q % 4) + (q % 8) / 4 of its k-step
                    let q = sub * 2u32 + w as u32;
                    let mut pos = (q / 8u32) * 8u32 + (q % 4u32) * 2u32 + (q % 8u32) / 4u32;
                    if natural {
                        pos = q;
                    }
                    xq[row + pos as usize] = words[w];
                }
                if sub == 0 {
                    if is_k {
                        scale[(tok * heads + h) as usize] = sc;
                    } else {
                        scale[(h * total + tok) as usize] = sc;
                    }
                }
            }
            rb += step;
        }
    }
}

/// The 8 channels of 16-byte vector `i` of `x` (f16 / bf16 pairs in 4 words) as f32.
#[cube]
fn load_row8<E: Float, NX: Size>(x: &Array<Vector<u32, NX>>, i: u32, out: &mut Array<f32>) {
    let vec = x[i as usize];
    #[unroll]
    for w in 0..4usize {
        let pair = Vector::<E, Const<2>>::reinterpret(vec[w]);
        out[2 * w] = f32::cast_from(pair[0]);
        out[2 * w + 1] = f32::cast_from(pair[1]);
    }
}

/// Max over the `units` (4, 8, 16 or 32) adjacent lanes of a row.
#[cube]
fn row_max(x: f32, #[comptime] units: u32) -> f32 {
    let mut m = x;
    if comptime!(units >= 32) {
        m = max(m, plane_shuffle_xor(m, 16u32));
    }
    if comptime!(units >= 16) {
        m = max(m, plane_shuffle_xor(m, 8u32));
    }
    if comptime!(units >= 8) {
        m = max(m, plane_shuffle_xor(m, 4u32));
    }
    m = max(m, plane_shuffle_xor(m, 2u32));
    max(m, plane_shuffle_xor(m, 1u32))
}

/// Sum over the `units` adjacent lanes of a row (as [`row_max`]).
#[cube]
fn row_sum(x: f32, #[comptime] units: u32) -> f32 {
    let mut m = x;
    if comptime!(units >= 32) {
        m += plane_shuffle_xor(m, 16u32);
    }
    if comptime!(units >= 16) {
        m += plane_shuffle_xor(m, 8u32);
    }
    if comptime!(units >= 8) {
        m += plane_shuffle_xor(m, 4u32);
    }
    m += plane_shuffle_xor(m, 2u32);
    m + plane_shuffle_xor(m, 1u32)
}

/// `cp.async` copies of the int8 keys `[n0, n1)` of kv head `head_kv` into a padded tile of
/// `block_n` rows from shared row `row0` (rows past the range repeat key `n1 - 1`: they are
/// masked).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn copy_k_tile8<E: Float>(
    src: &Array<E>,
    smem: &mut SharedMemory<E>,
    row0: usize,
    n0: u32,
    n1: u32,
    heads_kv: u32,
    head_kv: u32,
    #[comptime] threads: usize,
    #[comptime] block_n: usize,
    #[comptime] head_dim: usize,
) {
    let stride = comptime!(stride8(head_dim));
    let row_e = comptime!(head_dim / 2);
    let vecs = comptime!(head_dim / 2 / VEC);
    #[unroll]
    for it in 0..comptime!(block_n * (head_dim / 2 / VEC) / threads) {
        let idx = UNIT_POS as usize + it * threads;
        let r = idx / vecs;
        let c = idx % vecs;
        let key = min(n0 + r as u32, n1 - 1);
        let g = (key * heads_kv + head_kv) as usize * row_e + c * VEC;
        let base = (row0 + r) * stride + c * VEC;
        copy_async(&src.slice(g, g + VEC), &mut smem.slice_mut(base, base + VEC), comptime!(VEC as u32));
    }
}

/// The two words (k-step `ks`) of thread `t`'s fragment in int8 row `row` of a shared tile.
#[cube]
fn frag_words<E: Float>(smem: &SharedMemory<E>, row: usize, ks: usize, t: usize, #[comptime] head_dim: usize) -> Vector<u32, Const<2>> {
    let stride = comptime!(stride8(head_dim));
    let start = row * stride + ks * 16 + t * 4;
    let v = smem.slice(start, start + 4).into_vectorized().with_vector_size::<Const<4>>()[0];
    Vector::<u32, Const<2>>::reinterpret(v)
}

/// Raw scores of one key tile: `s[(m * n_blocks + nb) * 4 + e]` = the exact i32 dot product of
/// int8 Q row and int8 K row (as f32: exact, |dot| < 2^22), in the accumulator layout of the f16
/// path (`mt` m16 blocks from row `prow`, `block_n / 8` n8 blocks). Q rows and K rows (from row
/// `krow0` of `k_smem`) come from the padded int8 tiles.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn scores_int8<E: Float>(
    q_smem: &SharedMemory<E>,
    k_smem: &SharedMemory<E>,
    krow0: usize,
    s: &mut Array<f32>,
    prow: usize,
    #[comptime] mt: usize,
    #[comptime] block_n: usize,
    #[comptime] head_dim: usize,
) {
    let def = MmaDefinition::<i8, i8, i32>::new(16usize, 8usize, 32usize);
    let size!(NA) = def.vector_size(MatrixIdent::A);
    let size!(NB) = def.vector_size(MatrixIdent::B);
    let size!(NC) = def.vector_size(MatrixIdent::Accumulator);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let ec = comptime!(vc * sc);
    let n_blocks = comptime!(block_n / 8);
    let lane = UNIT_POS_PLANE as usize;
    let g = lane / 4;
    let t = lane % 4;
    let mut acc = Array::<i32>::new(comptime!(mt * n_blocks * ec));
    #[unroll]
    for i in 0..comptime!(mt * n_blocks * ec) {
        acc[i] = 0i32;
    }
    #[unroll]
    for ks in 0..comptime!(head_dim / 32) {
        // A: a0 a2 from row g, a1 a3 from row g + 8 of each m16 block
        let mut af = Array::<Vector<i8, NA>>::new(comptime!(mt * 4));
        #[unroll]
        for m in 0..mt {
            let lo = frag_words(q_smem, prow + m * 16 + g, ks, t, head_dim);
            let hi = frag_words(q_smem, prow + m * 16 + 8 + g, ks, t, head_dim);
            af[m * 4] = Vector::<i8, NA>::reinterpret(lo[0]);
            af[m * 4 + 1] = Vector::<i8, NA>::reinterpret(hi[0]);
            af[m * 4 + 2] = Vector::<i8, NA>::reinterpret(lo[1]);
            af[m * 4 + 3] = Vector::<i8, NA>::reinterpret(hi[1]);
        }
        #[unroll]
        for nb in 0..n_blocks {
            let kw = frag_words(k_smem, krow0 + nb * 8 + g, ks, t, head_dim);
            let mut b = Array::<Vector<i8, NB>>::new(2usize);
            b[0] = Vector::<i8, NB>::reinterpret(kw[0]);
            b[1] = Vector::<i8, NB>::reinterpret(kw[1]);
            #[unroll]
            for m in 0..mt {
                let mut a = Array::<Vector<i8, NA>>::new(4usize);
                #[unroll]
                for i in 0..4usize {
                    a[i] = af[m * 4 + i];
                }
                let mut c = Array::<Vector<i32, NC>>::new(vc);
                #[unroll]
                for i in 0..vc {
                    let mut reg = Vector::<i32, NC>::empty();
                    #[unroll]
                    for j in 0..sc {
                        reg[j] = acc[(m * n_blocks + nb) * ec + i * sc + j];
                    }
                    c[i] = reg;
                }
                def.execute_inplace(&a, &b, &mut c);
                #[unroll]
                for i in 0..vc {
                    #[unroll]
                    for j in 0..sc {
                        acc[(m * n_blocks + nb) * ec + i * sc + j] = c[i][j];
                    }
                }
            }
        }
    }
    #[unroll]
    for i in 0..comptime!(mt * n_blocks * ec) {
        s[i] = dot_to_f32(acc[i]);
    }
}

/// An exact i32 dot product of int8 rows (|dot| < 2^22) as f32 without I2F (a quarter-rate
/// instruction): bits `0x4B40_0000 + i` are `1.5 * 2^23 + i`.
#[cube]
pub fn dot_to_f32(x: i32) -> f32 {
    dot_biased(x) - MAGIC
}

/// `MAGIC + x` exactly (|x| < 2^22), one integer add: the Hopper forwards keep the scores biased
/// and take `MAGIC` out in the softmax's per-row constants (`flash_fwd_sm90::softmax_scores`).
#[cube]
pub fn dot_biased(x: i32) -> f32 {
    f32::reinterpret(x + MAGIC_BITS)
}
