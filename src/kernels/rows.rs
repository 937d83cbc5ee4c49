//! Which keys a query row sees, on the device: the kernels' mirror of `AttnSpec::row_keys`
//! (causal bound, then flash-attn's sliding window, both bottom-right aligned); and where a key
//! lies in a paged K,V (`kv_row`, the mirror of `AttnSpec::kv_row`).
//!
//! Every kernel takes a row's keys from here: the host passes two `u32` bounds (see
//! `backend::cuda::window_bounds`), `win_l` keys left of the row's diagonal and `win_r` right of
//! it (0 with causal), [`WIN_NONE`] for an unbounded side; a plain causal or full call is the
//! special case of those bounds. All arithmetic is `i32`: lengths and bounds stay below 2^30, so no sum here
//! can overflow.

use cubecl::prelude::*;

use crate::format::KV_PAGE;

/// The bound of an unbounded window side: wider than any sequence, small enough for `i32` sums.
pub const WIN_NONE: u32 = 1 << 30;

/// Keys `[lo, hi)` (relative to the segment's key start) that row `r` of a segment with `q_len`
/// queries and `k_len` keys sees; `lo == hi` when none.
#[cube]
pub fn row_keys(q_len: u32, k_len: u32, r: u32, win_l: u32, win_r: u32) -> (u32, u32) {
    let diag = k_len as i32 - q_len as i32 + r as i32;
    let hi = max(min(k_len as i32, diag + win_r as i32 + 1i32), 0i32);
    let lo = min(max(diag - win_l as i32, 0i32), hi);
    (lo as u32, hi as u32)
}

/// Rows `[r0, r1)` of a segment that see key `kw` (relative to the segment's key start, inside
/// `[0, k_len)`); `r0 >= r1` when none.
#[cube]
pub fn key_rows(q_len: u32, k_len: u32, kw: i32, win_l: u32, win_r: u32) -> (i32, i32) {
    let shift = k_len as i32 - q_len as i32;
    let r0 = max(kw - shift - win_r as i32, 0i32);
    let r1 = min(kw - shift + win_l as i32 + 1i32, q_len as i32);
    (r0, r1)
}

/// Row of k / v (and dk / dv) holding logical key `j`: with `paged`, block `j / KV_PAGE` of the
/// key axis is stored at block `pages[j / KV_PAGE]` (`AttnSpec::kv_pages`); else row `j`. A tile
/// that starts at `j` and stays inside one block (the host guarantees it: key ranges start at
/// block multiples, tiles are at most KV_PAGE keys) is contiguous from this row.
#[cube]
pub fn kv_row(j: u32, pages: &Array<u32>, #[comptime] paged: bool) -> u32 {
    let mut row = j;
    if paged {
        row = pages[(j / KV_PAGE as u32) as usize] * KV_PAGE as u32 + j % KV_PAGE as u32;
    }
    row
}
