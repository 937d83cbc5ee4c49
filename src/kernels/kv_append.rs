//! `flash_attn_with_kvcache` with its key counts on the device (a CUDA `cache_seqlens`), so that a
//! decode step needs no host synchronization and can be captured in a CUDA graph.
//!
//! The host plans the call as if every cache row were full (`width` keys); [`kv_append`] then
//! writes each row's true key count into the plan's segment table and appends the new keys, and
//! the forward's few-rows kernels stop at the last key a cube's rows can see. A count the cache
//! cannot hold is refused on the device: nothing is appended to that row and [`poison_rows`] writes
//! NaN over its outputs (the validating path raises for the same values; it needs the host copy).

use cubecl::prelude::*;

/// Units per cube of [`kv_append`] and [`poison_rows`].
pub const APPEND_UNITS: usize = 128;

/// Whether key count `c` (an int32 read as u32: a negative count is above any width) plus `n_new`
/// new keys fits a cache row of `width` keys.
#[cube]
fn count_fits(c: u32, width: u32, n_new: u32) -> bool {
    c <= width - n_new
}

/// Cube (t, b): appends new token `t` of batch row `b` (its k and v rows, `row_words` u32 words
/// each: heads_kv x head_dim 16-bit values) into row `b` of the caches (`width` keys a row) at key
/// `counts[b] + t`; cube (0, b) also sets segment `b`'s key count (`segs[4 b + 3]`) to
/// `counts[b] + n_new`, or to 0 when the count does not fit (nothing is appended then). Cube
/// (0, 0) zeroes `nonfinite`, the forward's non-finite-v flag followed by the decode kernel's
/// split-K counters (its whole length), which the forward launched next would otherwise zero with
/// a memset of its own.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn kv_append(
    k_cache: &mut Array<u32>,
    v_cache: &mut Array<u32>,
    k_new: &Array<u32>,
    v_new: &Array<u32>,
    counts: &Array<u32>,
    segs: &mut Array<u32>,
    nonfinite: &mut Array<u32>,
    width: u32,
    n_new: u32,
    row_words: u32,
) {
    let t = CUBE_POS_X;
    let b = CUBE_POS_Y;
    let c = counts[b as usize];
    let ok = count_fits(c, width, n_new);
    if t == 0u32 && b == 0u32 {
        let mut w = UNIT_POS;
        while w < nonfinite.len() as u32 {
            nonfinite[w as usize] = 0u32;
            w += CUBE_DIM_X;
        }
    }
    if t == 0u32 && UNIT_POS == 0u32 {
        let mut n = 0u32;
        if ok {
            n = c + n_new;
        }
        segs[(b * 4u32 + 3u32) as usize] = n;
    }
    if ok && t < n_new {
        let dst = ((b * width + c + t) * row_words) as usize;
        let src = ((b * n_new + t) * row_words) as usize;
        let mut w = UNIT_POS;
        while w < row_words {
            k_cache[dst + w as usize] = k_new[src + w as usize];
            v_cache[dst + w as usize] = v_new[src + w as usize];
            w += CUBE_DIM_X;
        }
    }
}

/// Cubes (x, b): NaN over the outputs of batch row `b` when [`kv_append`] refused its count: out's
/// `sq` rows of `row_elems` (heads_q x head_dim) values from token `b sq`, and their lse
/// (`[heads_q, total_q]`). Other rows are left as the forward wrote them.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn poison_rows<E: Float>(
    out: &mut Array<E>,
    lse: &mut Array<f32>,
    counts: &Array<u32>,
    width: u32,
    n_new: u32,
    sq: u32,
    heads_q: u32,
    row_elems: u32,
    total_q: u32,
    nan: f32,
) {
    let b = CUBE_POS_Y;
    if count_fits(counts[b as usize], width, n_new) {
        terminate!();
    }
    let stride = CUBE_COUNT_X * CUBE_DIM_X;
    let n = sq * row_elems;
    let mut i = CUBE_POS_X * CUBE_DIM_X + UNIT_POS;
    while i < n {
        out[(b * n + i) as usize] = E::cast_from(nan);
        i += stride;
    }
    let mut j = CUBE_POS_X * CUBE_DIM_X + UNIT_POS;
    while j < sq * heads_q {
        let h = j / sq;
        lse[(h * total_q + b * sq + j % sq) as usize] = nan;
        j += stride;
    }
}
