//! INT8 Q K^T of the block-sparse forward (SageAttention style): the quantisation kernels and the
//! int8 parts of `flash_fwd::flash_fwd_mma2` with `int8 = true`.
//!
//! Quantisation (before the forward, on the same stream, into the caller's workspace):
//! 1. `chunk_stats::chunk_stats` (sums) + `int8_k_mean` (with K smoothing): the mean of K over each sequence's keys
//!    per (sequence, kv head, channel), f32, summed in a fixed order (64-key chunks, then the
//!    chunks in order): the same result every run.
//! 2. `int8_quantize`, once for Q and once for K: one cube per (block of rows, sequence, head),
//!    each row read once into registers. Each row's max |x - mean| (and, for Q with smoothing,
//!    the LSE correction `softmax_scale * q . mean`), the max over the row's scale group
//!    ([`crate::sparse::GroupRule`]: chunk, period, width inside the block) in shared memory,
//!    `scale = amax / 127`, then `rint((x - mean) * (127 / amax))` clamped to [-127, 127] as int8
//!    (round half to even; the CPU backend does the same f32 operations) and the row's scale.
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

use super::math::channel8;

/// Keys per partial sum of the K mean (`chunk_stats`).
pub const MEAN_CHUNK: usize = super::chunk_stats::CHUNK;
/// Units of a quantisation cube (8 warps; a row is `head_dim / 8` units).
pub const QUANT_THREADS: usize = 256;
/// Rows of a quantisation cube's tile (held in registers: `int8_quantize`), blocks above 64 rows.
pub const QUANT_ROWS: usize = 128;
/// Quantisation cubes per SM the launch bound asks for: 64 registers a unit, where every variant
/// compiles without spills and with all of a unit's loads before its first shuffle (ptxas's own
/// choice for 256 units is 64, up to 80 for some variants: three cubes).
pub const QUANT_CUBES_PER_SM: u32 = 4;
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
/// `xq` (u32 words, see the module doc) and the row scales to `scale` (`[h * total + t]` for Q,
/// `[t * heads + h]` for K). Groups: [`crate::sparse::GroupRule`] `(chunk, period, width)` on the
/// row's offset inside the block, as compile-time constants (the rules are fixed per granularity;
/// runtime divisions made the pass instruction-bound), `chunk` 0 for the whole block; otherwise
/// powers of two with `width <= period <= chunk <= rows`. `natural`: the int8 words in channel
/// order (the Hopper kernel's wgmma operands), else reordered for `mma.sync` (module docs).
///
/// Each row is read from global memory once. The cube ([`QUANT_THREADS`] units) takes the block
/// in tiles of `rows` rows ([`quant_rows`]); a row is `head_dim / 8` adjacent units, each with one
/// 16-byte vector (8 channels), and a unit keeps the vectors of its `rows * head_dim / (8 *
/// QUANT_THREADS)` rows of the tile (d128, 128 rows: 8 rows, 32 words) in registers from its
/// loads to its int8 words. All of a unit's loads are issued back to back before the first
/// reduction: 8 loads of 16 bytes in flight per unit, 128 KB per SM at four cubes, well above
/// what DRAM's latency needs. Rows past the block or the sequence load the block's last row (no
/// predicated loads or branches per row), count as 0 in the maxima and are not stored. A row's
/// maximum is a shuffle reduction among its units; the group maxima meet in shared memory (1 KB),
/// and a group's `amax / 127` and `127 / amax` are divided once per row, by unit `o` for row `o`
/// of the tile (once per unit for a whole block), not by each of the row's units:
/// - `chunk` 0 (one scale for the block): each unit's max over its rows, a plane's max, the planes'
///   in shared memory. A block of more tiles than one also takes the max over the tiles after the
///   first, read in a pass before (those rows are read twice; `rows` is 128 from 65-row blocks on,
///   so blocks of up to 128 rows are read once);
/// - otherwise the row maxima in shared memory, then unit `o` takes the max over the rows whose
///   offsets differ from `o` only in the bits the group leaves free ([`free_bits`]: below `width`,
///   from `period` up to `chunk`): shuffles across lanes for the bits below 32, the other planes'
///   rows in shared memory for the bits above. A tile holds whole chunks (`rows` a multiple of
///   `chunk`, tiles counted from the block's start), so tiles are independent.
///
/// `bf16`: `E` is bf16, whose channels are taken by their bits (one shift or mask each; CubeCL's
/// conversion extracts the half first). The source gets a launch bound of
/// [`QUANT_CUBES_PER_SM`] cubes.
///
/// Rounding: `clamp(v * inv, -127, 127) + MAGIC` rounds to the nearest integer, ties to even, in
/// the f32 add (|v * inv| <= 127 < 2^22), and the low byte of its bits is the int8 value: the CPU's
/// `rint` then clamp, without a conversion.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn int8_quantize<E: Float, NX: Size>(
    x: &Array<Vector<u32, NX>>,
    mean: &Array<f32>,
    xq: &mut Array<u32>,
    scale: &mut Array<f32>,
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
    #[comptime] rows: usize,
    #[comptime] bf16: bool,
) {
    let b = CUBE_POS_Y as usize;
    let h = CUBE_POS_Z;
    // units per row (8 channels each), rows per step, steps per tile
    let tpr = comptime!(head_dim / QUANT_VEC) as u32;
    let step = comptime!(QUANT_THREADS * QUANT_VEC / head_dim);
    let steps = comptime!(rows / (QUANT_THREADS * QUANT_VEC / head_dim));
    // the offset bits inside a chunk that a group leaves free (chunk > 0)
    let free = comptime!(free_bits(chunk, period, width));
    let sub = UNIT_POS % tpr;
    let rsub = UNIT_POS / tpr;
    let off = if is_k { 2usize } else { 0usize };
    let start = segs[b * 4 + off];
    let len = segs[b * 4 + off + 1];
    let r0 = CUBE_POS_X * block;
    if r0 >= len {
        terminate!();
    }
    let r1 = min(r0 + block, len);
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
    // vectors of `x` and words of `xq` per token; this unit's vector and words in a token's head
    let xt = heads * tpr;
    let xu = h * tpr + sub;
    let qt = heads * comptime!(head_dim / 4) as u32;
    let qu = h * comptime!(head_dim / 4) as u32;
    // word q of k-step q / 8 goes to position 2 (q % 4) + (q % 8) / 4 of its k-step
    let q = sub * 2u32;
    let mut p0 = (q / 8u32) * 8u32 + (q % 4u32) * 2u32 + (q % 8u32) / 4u32;
    let mut p1 = ((q + 1u32) / 8u32) * 8u32 + ((q + 1u32) % 4u32) * 2u32 + ((q + 1u32) % 8u32) / 4u32;
    if natural {
        p0 = q;
        p1 = q + 1u32;
    }
    // words of `xq` from one step's rows to the next's
    let qs = qt * step as u32;
    // the block's last token: what rows past its end load
    let last = start + r1 - 1u32;
    // the tile's row maxima (then the group maxima to be combined across planes), each row's
    // `127 / amax` of its group, the planes' maxima (chunk 0)
    let mut gmax = SharedMemory::<f32>::new(rows);
    let mut ginv = SharedMemory::<f32>::new(rows);
    let mut red = SharedMemory::<f32>::new(comptime!(QUANT_THREADS / 32));
    // this unit's vectors of the tile: row `rsub + s * step` of the tile in `w[s]`
    let mut w = Array::<Vector<u32, NX>>::new(steps);
    // chunk 0: the max over the tiles after the first (their rows read once more here)
    let mut pre = 0.0f32;
    if comptime!(chunk == 0) {
        let mut t0 = r0 + rows as u32;
        while t0 < r1 {
            #[unroll]
            for s in 0..steps {
                let tok = min(start + t0 + rsub + (s * step) as u32, last);
                w[s] = x[(tok * xt + xu) as usize];
            }
            #[unroll]
            for s in 0..steps {
                let vec = w[s];
                let mut mx = 0.0f32;
                #[unroll]
                for e in 0..8usize {
                    let mut v = channel::<E, NX>(&vec, e, bf16);
                    if smooth && is_k {
                        v -= mv[e];
                    }
                    mx = max(mx, f32::abs(v));
                }
                if t0 + rsub + (s * step) as u32 >= r1 {
                    mx = 0.0f32;
                }
                pre = max(pre, mx);
            }
            t0 += rows as u32;
        }
    }
    // chunk 0: the block's scale and its inverse, from the first tile on
    let mut bsc = 1.0f32;
    let mut binv = 0.0f32;
    let mut t0 = r0;
    while t0 < r1 {
        #[unroll]
        for s in 0..steps {
            let tok = min(start + t0 + rsub + (s * step) as u32, last);
            w[s] = x[(tok * xt + xu) as usize];
        }
        // per row max |x - mean| and (Q) the LSE correction: this unit's part of each row, then
        // the rows' reductions together, after which the unit holds row `rsub + sr * step`
        let mut umax = pre;
        let mut mxs = Array::<f32>::new(steps);
        let mut dots = Array::<f32>::new(steps);
        #[unroll]
        for s in 0..steps {
            let vec = w[s];
            let mut mx = 0.0f32;
            let mut dot = 0.0f32;
            #[unroll]
            for e in 0..8usize {
                let mut v = channel::<E, NX>(&vec, e, bf16);
                if smooth {
                    if is_k {
                        v -= mv[e];
                    } else {
                        dot += v * mv[e];
                    }
                }
                mx = max(mx, f32::abs(v));
            }
            if t0 + rsub + (s * step) as u32 >= r1 {
                mx = 0.0f32;
            }
            mxs[s] = mx;
            dots[s] = dot;
        }
        // (`per` units of the row hold it; the first one stores it)
        let per = comptime!((head_dim / QUANT_VEC / steps) as u32);
        let sr = sub / per;
        let lead = sub == sr * per;
        let ro = rsub + sr * step as u32;
        if comptime!(chunk > 0) {
            let m = rows_reduce(&mut mxs, steps, tpr, false);
            if lead {
                gmax[ro as usize] = m;
            }
        } else {
            #[unroll]
            for s in 0..steps {
                umax = max(umax, mxs[s]);
            }
        }
        if !is_k {
            let mut sh = 0.0f32;
            if smooth {
                sh = softmax_scale * rows_reduce(&mut dots, steps, tpr, true);
            }
            if lead && t0 + ro < r1 {
                shift[(h * total + start + t0 + ro) as usize] = sh;
            }
        }
        // the group maxima: `sc` and `inv` of row UNIT_POS of the tile (chunk > 0)
        let mut sc = 1.0f32;
        let mut inv = 0.0f32;
        if comptime!(chunk == 0) {
            if t0 == r0 {
                umax = max(umax, plane_shuffle_xor(umax, 16u32));
                umax = max(umax, plane_shuffle_xor(umax, 8u32));
                umax = max(umax, plane_shuffle_xor(umax, 4u32));
                umax = max(umax, plane_shuffle_xor(umax, 2u32));
                umax = max(umax, plane_shuffle_xor(umax, 1u32));
                if UNIT_POS_PLANE == 0 {
                    red[(UNIT_POS / 32u32) as usize] = umax;
                }
                sync_cube();
                let mut g = red[0usize];
                #[unroll]
                for i in 1..comptime!(QUANT_THREADS / 32) {
                    g = max(g, red[i]);
                }
                if g > 0.0f32 {
                    bsc = g / 127.0f32;
                    binv = 127.0f32 / g;
                }
            }
            sc = bsc;
        } else {
            sync_cube();
            // unit o: row o's group over the free bits below 32 (its plane's lanes)
            let mut m = 0.0f32;
            if UNIT_POS < rows as u32 {
                m = gmax[UNIT_POS as usize];
                if comptime!(free & 1 != 0) {
                    m = max(m, plane_shuffle_xor(m, 1u32));
                }
                if comptime!(free & 2 != 0) {
                    m = max(m, plane_shuffle_xor(m, 2u32));
                }
                if comptime!(free & 4 != 0) {
                    m = max(m, plane_shuffle_xor(m, 4u32));
                }
                if comptime!(free & 8 != 0) {
                    m = max(m, plane_shuffle_xor(m, 8u32));
                }
                if comptime!(free & 16 != 0) {
                    m = max(m, plane_shuffle_xor(m, 16u32));
                }
            }
            // and over the free bits from 32 on (the rows of other planes)
            if comptime!(free >= 32) {
                if UNIT_POS < rows as u32 {
                    gmax[UNIT_POS as usize] = m;
                }
                sync_cube();
                if UNIT_POS < rows as u32 {
                    if comptime!(free & 32 != 0) {
                        m = max(m, gmax[(UNIT_POS ^ 32u32) as usize]);
                    }
                    if comptime!(free & 64 != 0) {
                        m = max(m, gmax[(UNIT_POS ^ 64u32) as usize]);
                    }
                    if comptime!(free & 96 == 96) {
                        m = max(m, gmax[(UNIT_POS ^ 96u32) as usize]);
                    }
                }
            }
            if m > 0.0f32 {
                sc = m / 127.0f32;
                inv = 127.0f32 / m;
            }
            if UNIT_POS < rows as u32 {
                ginv[UNIT_POS as usize] = inv;
            }
            sync_cube();
        }
        // row UNIT_POS's scale
        if UNIT_POS < rows as u32 && t0 + UNIT_POS < r1 {
            let tok = start + t0 + UNIT_POS;
            if is_k {
                scale[(tok * heads + h) as usize] = sc;
            } else {
                scale[(h * total + tok) as usize] = sc;
            }
        }
        // the int8 words: this unit's two words of the tile's row `rsub`
        let qa = (start + t0 + rsub) * qt + qu + p0;
        let qb = (start + t0 + rsub) * qt + qu + p1;
        #[unroll]
        for s in 0..steps {
            let o = rsub + (s * step) as u32;
            let vec = w[s];
            inv = binv;
            if comptime!(chunk > 0) {
                inv = ginv[o as usize];
            }
            let mut words = Array::<u32>::new(2usize);
            #[unroll]
            for wi in 0..2usize {
                let mut packed = 0u32;
                #[unroll]
                for e in 0..4usize {
                    let mut v = channel::<E, NX>(&vec, wi * 4 + e, bf16);
                    if smooth && is_k {
                        v -= mv[wi * 4 + e];
                    }
                    let t = max(min(v * inv, 127.0f32), -127.0f32) + MAGIC;
                    packed |= (u32::reinterpret(t) & 0xFFu32) << (8 * e as u32);
                }
                words[wi] = packed;
            }
            if t0 + o < r1 {
                xq[(qa + qs * s as u32) as usize] = words[0usize];
                xq[(qb + qs * s as u32) as usize] = words[1usize];
            }
        }
        t0 += rows as u32;
        // the next tile reuses the shared arrays
        if t0 < r1 {
            sync_cube();
        }
    }
}

/// Channel `e` (0..8) of a 16-byte vector of eight f16 / bf16 channels as f32 ([`channel8`]);
/// a bf16 channel by its bits (the high half of an f32: one shift or mask, where the conversion
/// takes the half out first).
#[cube]
fn channel<E: Float, NX: Size>(v: &Vector<u32, NX>, #[comptime] e: usize, #[comptime] bf16: bool) -> f32 {
    if comptime!(bf16) {
        let w = v[e / 2];
        if comptime!(e.is_multiple_of(2)) { f32::reinterpret(w << 16u32) } else { f32::reinterpret(w & 0xFFFF_0000u32) }
    } else {
        channel8::<E, NX>(v, e)
    }
}

/// Rows of a quantisation tile for blocks of `block` rows: 64 up to 64-row blocks (fewer
/// registers, more cubes per SM), else [`QUANT_ROWS`].
pub fn quant_rows(block: usize) -> usize {
    if block <= 64 { 64 } else { QUANT_ROWS }
}

/// The offset bits (below `chunk`) in which rows of one group of the rule `(chunk, period,
/// width)` may differ: those below `width` and those from `period` on (powers of two); 0 for
/// `chunk` 0.
pub fn free_bits(chunk: usize, period: usize, width: usize) -> usize {
    if chunk == 0 {
        return 0;
    }
    (chunk - 1) & !((period - 1) & !(width - 1))
}

/// The max (`sum`: the sum) over the `units` adjacent lanes of a row of each of the `n` values
/// `v` of a unit (one per step's row, `n` <= `units`, powers of two), all rows at once: in each
/// of the first log2(n) rounds of the butterfly a lane keeps one half of its values, sends the
/// other to its partner and combines what it receives with what it keeps (one shuffle per value
/// kept, not per value), then the remaining rounds on one value. Returns the result of row
/// `sub / (units / n)` of the unit's `n` (`sub` the unit's lane in its row). Each row's value is
/// combined in the tree of the plain butterfly with masks from `units / 2` down (`x op
/// shuffle_xor(x, mask)` per round), so a sum is that butterfly's to the bit. Clobbers `v`.
#[cube]
fn rows_reduce(v: &mut Array<f32>, #[comptime] n: usize, #[comptime] units: u32, #[comptime] sum: bool) -> f32 {
    if comptime!(n >= 2) {
        rows_round(v, comptime!(n / 2), comptime!(units / 2), sum);
    }
    if comptime!(n >= 4) {
        rows_round(v, comptime!(n / 4), comptime!(units / 4), sum);
    }
    if comptime!(n >= 8) {
        rows_round(v, comptime!(n / 8), comptime!(units / 8), sum);
    }
    let rest = comptime!(units / n as u32);
    let mut m = v[0usize];
    if comptime!(rest > 16) {
        m = combine(m, plane_shuffle_xor(m, 16u32), sum);
    }
    if comptime!(rest > 8) {
        m = combine(m, plane_shuffle_xor(m, 8u32), sum);
    }
    if comptime!(rest > 4) {
        m = combine(m, plane_shuffle_xor(m, 4u32), sum);
    }
    if comptime!(rest > 2) {
        m = combine(m, plane_shuffle_xor(m, 2u32), sum);
    }
    if comptime!(rest > 1) {
        m = combine(m, plane_shuffle_xor(m, 1u32), sum);
    }
    m
}

/// One round of [`rows_reduce`]: lanes with bit `mask` set keep values `half..2 half`, the others
/// `0..half`, into `v[0..half]`.
#[cube]
fn rows_round(v: &mut Array<f32>, #[comptime] half: usize, #[comptime] mask: u32, #[comptime] sum: bool) {
    let upper = (UNIT_POS_PLANE & mask) != 0;
    #[unroll]
    for j in 0..half {
        let keep = select(upper, v[j + half], v[j]);
        let send = select(upper, v[j], v[j + half]);
        v[j] = combine(keep, plane_shuffle_xor(send, mask), sum);
    }
}

/// `a + b` (`sum`) or `max(a, b)`.
#[cube]
fn combine(a: f32, b: f32, #[comptime] sum: bool) -> f32 {
    if comptime!(sum) { a + b } else { max(a, b) }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sparse::QuantGran;

    /// What `int8_quantize` takes from every granularity's rules (the launcher's constants: 0 where
    /// a rule is the whole block): powers of two that fit a tile, and two rows of a tile share a
    /// scale group exactly when their offsets differ only in [`free_bits`].
    #[test]
    fn free_bits_name_the_rows_of_a_group() {
        for gran in [QuantGran::PerBlock, QuantGran::PerWarp, QuantGran::PerThread] {
            for block in [16, 32, 48, 64, 96, 100, 128, 192, 200, 256] {
                for rule in [gran.q_rule(block), gran.k_rule(block)] {
                    if rule.chunk == block && rule.period == block && rule.width == block {
                        continue;
                    }
                    let rows = quant_rows(block);
                    let (c, p, w) = (rule.chunk, rule.period, rule.width);
                    assert!(c.is_power_of_two() && p.is_power_of_two() && w.is_power_of_two() && w <= p && p <= c && c <= rows, "{gran:?} block {block}: {rule:?}");
                    let free = free_bits(c, p, w);
                    for t in (0..block).step_by(rows) {
                        for o in t..(t + rows).min(block) {
                            for q in t..(t + rows).min(block) {
                                assert_eq!(rule.group(o) == rule.group(q), (o ^ q) & !free == 0, "{gran:?} block {block}: rows {o} {q}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn tiles_are_whole_steps() {
        for hd in [64, 128] {
            for block in [1, 64, 65, 128, 1000] {
                let rows = quant_rows(block);
                assert_eq!(rows % (QUANT_THREADS * QUANT_VEC / hd), 0);
                assert!(rows / (QUANT_THREADS * QUANT_VEC / hd) <= hd / QUANT_VEC, "rows_reduce: more rows a unit than units a row");
            }
        }
    }
}
