//! The transposed block index of block-sparse attention, built on the GPU for the backward's
//! dK/dV pass: per (sequence, key block, index head) the query blocks that list the key block,
//! ascending. Three launches over one cell per (sequence b, key block kb, index head y), cell id
//! `(b * k_blocks + kb) * heads + y` (the index heads of one key block side by side, so that the
//! lists of a GQA group's q heads are one contiguous range):
//! 1. [`sparse_transpose`] with `fill = false`: `t_off[cell]` = the number of query blocks of the
//!    cell (one unit per cell scans the query blocks of its sequence in order and binary-searches
//!    each one's ascending key-block list);
//! 2. [`exclusive_scan`] (one cube): `t_off` becomes the exclusive prefix sum, `t_off[n] = total`;
//! 3. [`sparse_transpose`] with `fill = true`: the same scan writes the entries from `t_off[cell]`.
//!
//! No atomics: every list comes out in ascending query-block order, so the dK/dV summation order
//! (and the result, bit for bit) is fixed. With `causal`, a query block whose last row sees no key
//! of the key block (entirely above the diagonal) is left out; query blocks past a sequence's end
//! are never listed. Entries are `query block | y << SPARSE_QB_BITS`.

use cubecl::prelude::*;

use super::tiles::SPARSE_QB_BITS;

/// Units per cube of [`sparse_transpose`] (one cell each).
pub const TRANSPOSE_THREADS: usize = 256;
/// Units of the single cube of [`exclusive_scan`].
pub const SCAN_THREADS: usize = 256;

/// Counts (`fill = false`) or writes (`fill = true`) the transposed lists; see the module docs.
/// `row_off` / `blocks`: the validated index in compressed form (row `(b * heads + y) * q_blocks
/// + qb` keeps `blocks[row_off[row]..row_off[row + 1]]`, ascending); `segs`: (q_start, q_len,
/// k_start, k_len) per sequence. 2-D grid (x fastest) of [`TRANSPOSE_THREADS`]-unit cubes.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn sparse_transpose(
    row_off: &Array<u32>,
    blocks: &Array<u32>,
    segs: &Array<u32>,
    t_off: &mut Array<u32>,
    t_list: &mut Array<u32>,
    heads: u32,
    q_blocks: u32,
    k_blocks: u32,
    q_block: u32,
    k_block: u32,
    n_cells: u32,
    #[comptime] causal: bool,
    #[comptime] fill: bool,
) {
    let c = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * TRANSPOSE_THREADS as u32 + UNIT_POS;
    if c < n_cells {
        let y = c % heads;
        let t = c / heads;
        let kb = t % k_blocks;
        let b = t / k_blocks;
        let q_len = segs[(b * 4 + 1) as usize];
        let k_len = segs[(b * 4 + 3) as usize];
        let k0 = kb * k_block;
        let mut n = 0u32;
        let mut at = 0u32;
        if fill {
            at = t_off[c as usize];
        }
        if k0 < k_len {
            let nqb = (q_len + q_block - 1) / q_block;
            for qb in 0..nqb {
                let mut seen = true;
                if causal {
                    // the block's last row sees window keys j <= k_len - q_len + row
                    let last = min(qb * q_block + q_block, q_len) - 1;
                    seen = k_len as i32 - q_len as i32 + last as i32 >= k0 as i32;
                }
                if seen {
                    let row = ((b * heads + y) * q_blocks + qb) as usize;
                    let end = row_off[row + 1];
                    let mut lo = row_off[row];
                    let mut hi = end;
                    while lo < hi {
                        let mid = (lo + hi) / 2u32;
                        if blocks[mid as usize] < kb {
                            lo = mid + 1u32;
                        } else {
                            hi = mid;
                        }
                    }
                    if lo < end {
                        if blocks[lo as usize] == kb {
                            if fill {
                                t_list[(at + n) as usize] = qb | (y << SPARSE_QB_BITS);
                            }
                            n += 1u32;
                        }
                    }
                }
            }
        }
        if !fill {
            t_off[c as usize] = n;
        }
    }
}

/// In place: `x[0..n]` (counts) becomes its exclusive prefix sum and `x[n]` the total. One cube
/// of [`SCAN_THREADS`] units: each sums a contiguous chunk, unit 0 scans the chunk sums, each
/// unit rewrites its chunk.
#[cube(launch_unchecked)]
pub fn exclusive_scan(x: &mut Array<u32>, n: u32) {
    let mut part = SharedMemory::<u32>::new(SCAN_THREADS);
    let u = UNIT_POS;
    let chunk = (n + SCAN_THREADS as u32 - 1u32) / SCAN_THREADS as u32;
    let a = min(u * chunk, n);
    let b = min(a + chunk, n);
    let mut sum = 0u32;
    for i in a..b {
        sum += x[i as usize];
    }
    part[u as usize] = sum;
    sync_cube();
    if u == 0u32 {
        let mut run = 0u32;
        for i in 0..SCAN_THREADS as u32 {
            let v = part[i as usize];
            part[i as usize] = run;
            run += v;
        }
        x[n as usize] = run;
    }
    sync_cube();
    let mut run = part[u as usize];
    for i in a..b {
        let v = x[i as usize];
        x[i as usize] = run;
        run += v;
    }
}
