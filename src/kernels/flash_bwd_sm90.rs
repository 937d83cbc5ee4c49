//! dK / dV (and with the comptime `fuse_dq`, dQ into the f32 accumulator) on Hopper (sm_90a):
//! warpgroup MMAs (`kernels::sm90`) over 128-byte-swizzled shared tiles.
//!
//! The work list, segments, query-tile walk (dense, varlen, GQA, grouped windows, paged K/V,
//! block-sparse through the transposed index), the lse / delta copies and the fused dQ's bulk
//! reductions are those of `flash_bwd_wide` (same host plan, same card: `cards::DkdvCard`): only the
//! mainloop differs. One cube = 128 keys = two warpgroups of 64 keys (256 threads), K and V staged
//! once (swizzled), dK and dV (64 keys x head_dim per warpgroup) in registers for the cube's life.
//! Per query tile of 64 rows (Q, dO by tensor-map copies into two swizzled stages, lse / delta by
//! `cp.async`), each warpgroup:
//! 1. S^T = K Q^T and dP^T = V dO^T: `head_dim / 16` MMAs m64 x 64 x k16 each,
//!    both operands K-major in shared memory (the keys are the M side, so that the transposed
//!    products come out in the layout of the next step's A operand);
//! 2. P^T = 2^(S^T scale log2 e - lse log2 e), dS^T = P^T (dP^T - delta), masked only where the
//!    warpgroup's 64 x 64 block is not fully visible; packed to f16/bf16 pairs in registers;
//! 3. dV += P^T dO and dK += dS^T Q: 4 MMAs m64 x head_dim x k16 each, A from those registers,
//!    B (dO, Q: rows x head_dim) the MN-major operand read in place;
//! 4. (`fuse_dq`) dS^T stored key-major to shared memory; after the cube's barrier each warpgroup
//!    forms half of dQ's columns, dQ = dS K (8 MMAs m64 x head_dim / 2 x k16, A = dS^T MN-major,
//!    B = K MN-major), stores them to the f32 row tile, and after a second barrier the copy engine
//!    adds the tile's rows into the accumulator (`bulk_reduce`).
//!
//! The next query tile is issued (one thread, tensor maps; a tile past the segment's end by
//! `cp.async`, rows clamped) at the top of a tile into the stage the previous tile used, after the
//! barrier that ended it.

use cubecl::prelude::barrier::{copy_async, Barrier};
use cubecl::prelude::*;

use super::cards::DkdvCard;
use super::bulk_reduce::{dq_row_dst, dq_rows_read, dq_tile_stride, issue_dq_row, put_dq_pair};
use super::bwd_walk::{key_item, seg_walk, sparse_q_tile};
use super::grid::cube_item_slot;
use super::math::{fast_exp2, LOG2E};
use super::rows::kv_row;
use super::sm90::{fence_proxy_async, pack_a_pairs, swizzle_128b, wgmma_commit, wgmma_fence, wgmma_rs, wgmma_ss, wgmma_wait,
    SW_COLS, SW_ROW};
use super::tiles::{BWD_BM, WIDE_BN};
use super::staging::{commit_stage, issue_lse_delta, stage_rows, wait_stage};

/// Threads per cube: two warpgroups.
pub const SM90_BWD_THREADS: usize = 256;
/// Keys per warpgroup.
const WG_KEYS: usize = 64;
const BN: usize = WIDE_BN;
const BM: usize = BWD_BM;
const _: () = assert!(BN == 2 * WG_KEYS && BM == 64);

/// Issues query tile `g` (head `h`, segment rows `r0..r0 + bm`) into stage `g % 2` of the swizzled
/// Q / dO tiles and of lse / delta, committed to `bar0` (even `g`) or `bar1`: by tensor-map copies
/// (unit `tid` 0; 64-column x `bm`-row boxes) when every row lies inside the segment, else by
/// `cp.async` of the `threads` units with rows clamped to the segment's last (the caller masks
/// them); lse / delta by `cp.async` of those units. `head_dim_v`: dO's head_dim (v's; `head_dim` but
/// for `flash_bwd_sm90_split` with v at its own, DeepSeek's MLA): dO's stage `g % 2` at element
/// `(g % 2) bm head_dim_v`. Where the widths agree Q's and dO's copies of a chunk are issued
/// together from one address computation: the same copies through a helper per tensor made
/// ptxas spill 100-700 bytes in `flash_bwd_ws`, whose producer warp runs this with 24 registers.
/// `rolled`: the `cp.async` copies of a partial tile in a loop rather than unrolled (the producer
/// of `flash_bwd_ws_cols`, whose 24 registers do not hold the unrolled addresses: 96-124 at 32).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn issue_q_tile<E: Float>(
    q_map: &TensorMap<E, Tiled>,
    do_map: &TensorMap<E, Tiled>,
    q_s: &Array<E>,
    do_s: &Array<E>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    q_smem: &mut SharedMemory<E>,
    do_smem: &mut SharedMemory<E>,
    lse_smem: &mut SharedMemory<f32>,
    dl_smem: &mut SharedMemory<f32>,
    bar0: &Barrier,
    bar1: &Barrier,
    g: u32,
    h: u32,
    r0: u32,
    q_len: u32,
    q_start: u32,
    heads_q: u32,
    total_q: u32,
    tid: u32,
    #[comptime] head_dim: usize,
    #[comptime] head_dim_v: usize,
    #[comptime] threads: usize,
    #[comptime] bm: usize,
    #[comptime] rolled: bool,
) {
    let stage = (g & 1u32) as usize;
    let base = stage * comptime!(bm * head_dim);
    let base_v = stage * comptime!(bm * head_dim_v);
    if r0 + bm as u32 <= q_len {
        if tid == 0 {
            let ts = E::type_size();
            let bytes = comptime!((bm * (head_dim + head_dim_v) * ts) as u32);
            let y = (q_start + r0) as i32;
            if stage == 0 {
                bar0.expect_tx(bytes);
            } else {
                bar1.expect_tx(bytes);
            }
            #[unroll]
            for c in 0..comptime!(head_dim / SW_COLS) {
                let x = (h * head_dim as u32) as i32 + comptime!((c * SW_COLS) as i32);
                let a = base + comptime!(c * bm * SW_COLS);
                // (dO's chunk beside Q's where they share the width; else after them)
                if stage == 0 {
                    bar0.tma_load_2d(q_map, &mut q_smem.slice_mut(a, a + comptime!(bm * SW_COLS)), y, x);
                    if comptime!(head_dim_v == head_dim) {
                        bar0.tma_load_2d(do_map, &mut do_smem.slice_mut(a, a + comptime!(bm * SW_COLS)), y, x);
                    }
                } else {
                    bar1.tma_load_2d(q_map, &mut q_smem.slice_mut(a, a + comptime!(bm * SW_COLS)), y, x);
                    if comptime!(head_dim_v == head_dim) {
                        bar1.tma_load_2d(do_map, &mut do_smem.slice_mut(a, a + comptime!(bm * SW_COLS)), y, x);
                    }
                }
            }
            if comptime!(head_dim_v != head_dim) {
                // dO's chunks at v's width
                #[unroll]
                for c in 0..comptime!(head_dim_v / SW_COLS) {
                    let x = (h * head_dim_v as u32) as i32 + comptime!((c * SW_COLS) as i32);
                    let a = base_v + comptime!(c * bm * SW_COLS);
                    if stage == 0 {
                        bar0.tma_load_2d(do_map, &mut do_smem.slice_mut(a, a + comptime!(bm * SW_COLS)), y, x);
                    } else {
                        bar1.tma_load_2d(do_map, &mut do_smem.slice_mut(a, a + comptime!(bm * SW_COLS)), y, x);
                    }
                }
            }
        }
    } else {
        let vecs = comptime!(head_dim / 8);
        #[unroll(!rolled)]
        for it in 0..comptime!(bm * (head_dim / 8) / threads) {
            let idx = tid as usize + it * threads;
            let r = idx / vecs;
            let c = (idx % vecs) * 8;
            let row = min(r0 + r as u32, q_len - 1u32);
            let src = ((q_start + row) * heads_q + h) as usize * head_dim + c;
            let dst = base + swizzle_128b(r, c, bm);
            copy_async(&q_s.slice(src, src + 8), &mut q_smem.slice_mut(dst, dst + 8), 8u32);
            if comptime!(head_dim_v == head_dim) {
                copy_async(&do_s.slice(src, src + 8), &mut do_smem.slice_mut(dst, dst + 8), 8u32);
            }
        }
        if comptime!(head_dim_v != head_dim) {
            let vecs_v = comptime!(head_dim_v / 8);
            #[unroll(!rolled)]
            for it in 0..comptime!(bm * (head_dim_v / 8) / threads) {
                let idx = tid as usize + it * threads;
                let r = idx / vecs_v;
                let c = (idx % vecs_v) * 8;
                let row = min(r0 + r as u32, q_len - 1u32);
                let src = ((q_start + row) * heads_q + h) as usize * head_dim_v + c;
                let dst = base_v + swizzle_128b(r, c, bm);
                copy_async(&do_s.slice(src, src + 8), &mut do_smem.slice_mut(dst, dst + 8), 8u32);
            }
        }
    }
    issue_lse_delta(lse, delta, lse_smem, dl_smem, stage * bm, r0, q_len, q_start, h, total_q, tid, threads, bm);
    commit_stage(bar0, bar1, g);
}

/// `acc = A B^T` over `head_dim` for the warpgroup's 64 keys (A: rows `a_row0..` of the swizzled
/// key tile `a`, `a_rows` rows per chunk) against the `b_rows` rows of the query stage at element
/// `b0` of `b` (`b_rows` rows per chunk; the MMA's N): S^T = K Q^T, dP^T = V dO^T. The caller
/// fences before and commits after.
#[cube]
pub fn key_by_row_steps<E: Float>(
    acc: &mut Array<f32>,
    a: &SharedMemory<E>,
    a_row0: usize,
    #[comptime] a_rows: usize,
    b: &SharedMemory<E>,
    b0: usize,
    #[comptime] head_dim: usize,
    #[comptime] b_rows: usize,
) {
    #[unroll]
    for kk in 0..comptime!(head_dim / 16) {
        let chunk = comptime!(kk / 4);
        let within = comptime!((kk % 4) * 16);
        let a_off = a_row0 * SW_COLS + comptime!(chunk * a_rows * SW_COLS + within);
        let b_off = b0 + comptime!(chunk * b_rows * SW_COLS + within);
        wgmma_ss::<E>(acc, a, a_off as u32, b, b_off as u32, 0usize, b_rows, false, 0u32, false, 0u32, comptime!(kk > 0));
    }
}

/// `acc += A B` with A the packed pairs `a_regs` (64 keys x the tile's `bm` rows) and B the query
/// stage at element `b0` of `b` (rows x head_dim, MN-major): dV += P^T dO, dK += dS^T Q. The
/// caller fences before and commits after.
#[cube]
pub fn key_by_dim_steps<E: Float>(
    acc: &mut Array<f32>,
    a_regs: &Array<Vector<E, Const<2>>>,
    b: &SharedMemory<E>,
    b0: usize,
    #[comptime] head_dim: usize,
    #[comptime] bm: usize,
) {
    let lbo = comptime!((bm * SW_ROW) as u32);
    #[unroll]
    for ks in 0..comptime!(bm / 16) {
        let b_off = b0 + comptime!(ks * 16 * SW_COLS);
        wgmma_rs::<E>(acc, a_regs, b, b_off as u32, 0usize, comptime!(4 * ks), head_dim, true, lbo, true);
    }
}

/// lse log2(e) of this lane's rows in the query tile's first [`LSE_AHEAD`] row groups (its
/// accumulator columns `8 nb + col_a + e2` at index `2 nb + e2`), from stage `lb` of `lse_smem`.
/// Read into registers before the caller waits for S: a wait orders shared-memory reads after it,
/// which put the first loads on the softmax's critical path (ncu, d128: 7% of the kernel's stall
/// samples on the first three products with lse); the later groups' loads ([`p_transposed`])
/// overlap the first groups' exps.
#[cube]
pub fn lse_ahead(lse_smem: &SharedMemory<f32>, lb: usize, col_a: usize) -> Array<f32> {
    let mut v = Array::<f32>::new(comptime!(2 * LSE_AHEAD));
    #[unroll]
    for nb in 0..LSE_AHEAD {
        #[unroll]
        for e2 in 0..2usize {
            v[nb * 2 + e2] = lse_smem[lb + nb * 8 + col_a + e2] * LOG2E;
        }
    }
    v
}

/// Row groups of lse a thread reads ahead of the S wait ([`lse_ahead`]; 4 of 8: all 8 held across
/// the wait spilled the d128 kernel's loop state, 17 local loads a tile).
const LSE_AHEAD: usize = 4;

/// P^T = 2^(S^T scale log2 e - lse log2 e) in place of S^T (`s`: the m64 x `bm` accumulator of 64
/// keys x the query tile's `bm` rows; lse of stage `lb` of `lse_smem`, its first [`LSE_AHEAD`] row groups
/// times log2 e already in `l2`, [`lse_ahead`]), zero where the
/// block is not fully visible and a key lies outside its row's window or past the segment's keys
/// (`k_hi`), or the row is at or past `row_end`. `key_a - key_base`: this lane's first key among
/// the 64 (window-local index `kw0` of the first); `rr0`: the tile's first row; `col_a`: this
/// lane's first column pair. Returns whether the tile masked nothing ([`tile_full`]), the choice of
/// [`ds_transposed`]'s `masked`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn p_transposed(
    s: &mut Array<f32>,
    l2: &Array<f32>,
    lse_smem: &SharedMemory<f32>,
    lb: usize,
    col_a: usize,
    key_a: usize,
    key_base: usize,
    kw0: i32,
    rr0: i32,
    row_end: u32,
    k_hi: u32,
    shift: i32,
    win_l: u32,
    win_r: u32,
    scale_log2: f32,
    #[comptime] bm: usize,
) -> bool {
    let full = tile_full(kw0, rr0, row_end, k_hi, shift, win_l, win_r, WG_KEYS, bm);
    #[unroll]
    for nb in 0..comptime!(bm / 8) {
        #[unroll]
        for e2 in 0..2usize {
            let l = if comptime!(nb < LSE_AHEAD) { l2[nb * 2 + e2] } else { lse_smem[lb + nb * 8 + col_a + e2] * LOG2E };
            #[unroll]
            for hh in 0..2usize {
                let i = nb * 4 + hh * 2 + e2;
                s[i] = fast_exp2(s[i] * scale_log2 - l);
            }
        }
    }
    if !full {
        #[unroll]
        for nb in 0..comptime!(bm / 8) {
            #[unroll]
            for e2 in 0..2usize {
                let r = rr0 + (nb * 8 + e2) as i32 + col_a as i32;
                let dg = r + shift;
                let lo = max(dg - win_l as i32, 0i32);
                let mut hi = min(dg + win_r as i32 + 1i32, k_hi as i32);
                if r >= row_end as i32 {
                    hi = -1i32;
                }
                #[unroll]
                for hh in 0..2usize {
                    let kk = kw0 + (key_a - key_base + hh * 8) as i32;
                    let i = nb * 4 + hh * 2 + e2;
                    s[i] = select(kk >= lo && kk < hi, s[i], 0.0f32);
                }
            }
        }
    }
    full
}

/// Whether every (row, key) pair of a warpgroup's `keys` keys (64 here; window-local index `kw0`
/// of the first) and the `bm` rows from `rr0` is visible: keys inside the segment (`k_hi`), rows
/// before `row_end`, each key inside each row's window ([`p_transposed`] masks nothing then).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn tile_full(
    kw0: i32,
    rr0: i32,
    row_end: u32,
    k_hi: u32,
    shift: i32,
    win_l: u32,
    win_r: u32,
    #[comptime] keys: usize,
    #[comptime] bm: usize,
) -> bool {
    kw0 >= 0i32
        && kw0 + keys as i32 <= k_hi as i32
        && rr0 + bm as i32 <= row_end as i32
        && kw0 + (keys as i32 - 1i32) <= shift + rr0 + win_r as i32
        && kw0 >= shift + rr0 + (bm as i32 - 1i32) - win_l as i32
}

/// dS^T = P^T (dP^T - delta) in place of `dp` (the m64 x `bm` accumulator of 64 keys x the query
/// tile's `bm` rows; `s` holds P^T, delta of stage `lb` of `dl_smem`, this lane's first column pair
/// `col_a`). `masked` (a tile [`p_transposed`] may have masked, [`tile_full`] false): P = 0 keeps
/// dS = 0 even where dP - delta is not finite, so a key never meets a masked row's non-finite dO.
/// Without it (every pair visible) dS = P (dP - delta) as torch's SDPA math has it (a P that
/// underflows to 0 times a non-finite dP - delta is NaN there too): 2 of the 4 instructions an
/// element.
#[cube]
pub fn ds_transposed(
    dp: &mut Array<f32>,
    s: &Array<f32>,
    dl_smem: &SharedMemory<f32>,
    lb: usize,
    col_a: usize,
    #[comptime] bm: usize,
    #[comptime] masked: bool,
) {
    #[unroll]
    for nb in 0..comptime!(bm / 8) {
        #[unroll]
        for e2 in 0..2usize {
            let dl = dl_smem[lb + nb * 8 + col_a + e2];
            #[unroll]
            for hh in 0..2usize {
                let i = nb * 4 + hh * 2 + e2;
                if comptime!(masked) {
                    dp[i] = select(s[i] == 0.0f32, 0.0f32, s[i] * (dp[i] - dl));
                } else {
                    dp[i] = s[i] * (dp[i] - dl);
                }
            }
        }
    }
}

/// The packed dS^T pairs `ds_regs` stored key-major into the swizzled buffer at element `dsb` of
/// `ds_smem` (a 64-column chunk of `key_rows` key rows per 64 of the tile's `bm` rows: the A
/// operand of dQ = dS K; the rows of a pair are adjacent), then fenced for the async proxy.
#[cube]
pub fn store_ds_transposed<E: Float>(
    ds_smem: &mut SharedMemory<E>,
    dsb: usize,
    ds_regs: &Array<Vector<E, Const<2>>>,
    key_a: usize,
    col_a: usize,
    #[comptime] key_rows: usize,
    #[comptime] bm: usize,
) {
    #[unroll]
    for nb in 0..comptime!(bm / 8) {
        #[unroll]
        for hh in 0..2usize {
            let at = dsb + swizzle_128b(key_a + hh * 8, nb * 8, key_rows) + col_a;
            let pr = ds_regs[nb * 2 + hh];
            ds_smem[at] = pr[0];
            ds_smem[at + 1] = pr[1];
        }
    }
    fence_proxy_async();
}

/// `dq = dS K` for 64 rows and `cols` of dQ's columns (`k_dq`: their element offset in the
/// swizzled K tile) from the key-major dS^T whose 64 rows start at element `dsb` of `ds_smem`: 8
/// MMAs m64 x `cols` x k16 (A = dS^T MN-major, B = K MN-major). The caller fences before and
/// commits after.
#[cube]
pub fn dq_steps<E: Float>(
    dq: &mut Array<f32>,
    ds_smem: &SharedMemory<E>,
    dsb: usize,
    k_smem: &SharedMemory<E>,
    k_dq: usize,
    #[comptime] cols: usize,
) {
    #[unroll]
    for ks in 0..comptime!(BN / 16) {
        let a_off = dsb + comptime!(ks * 16 * SW_COLS);
        let b_off = k_dq + comptime!(ks * 16 * SW_COLS);
        wgmma_ss::<E>(
            dq, ds_smem, a_off as u32, k_smem, b_off as u32, 0usize, cols, true,
            comptime!((BN * SW_ROW) as u32), true, comptime!((BN * SW_ROW) as u32), comptime!(ks > 0),
        );
    }
}

/// This thread's dQ accumulator (rows `row_a`, `row_a + 8` of the tile, columns `dq_col0 + 8 nb +
/// col_a (+ 1)`) into the f32 row tile (rows [`dq_tile_stride`] apart, vectors of `qvec`).
#[cube]
pub fn put_dq_rows<NQ: Size>(
    dq_tile: &mut SharedMemory<Vector<f32, NQ>>,
    dq: &Array<f32>,
    row_a: usize,
    dq_col0: usize,
    col_a: usize,
    #[comptime] head_dim: usize,
    #[comptime] qvec: usize,
) {
    let dts = comptime!(dq_tile_stride(head_dim));
    #[unroll]
    for nb in 0..comptime!(head_dim / 16) {
        #[unroll]
        for hh in 0..2usize {
            let i = nb * 4 + hh * 2;
            let at = (row_a + hh * 8) * dts + dq_col0 + nb * 8 + col_a;
            put_dq_pair::<NQ>(dq_tile, at / qvec, dq[i], dq[i + 1], qvec);
        }
    }
}

/// dK (scaled) and dV of this lane's keys `key0 + key_a (+ 8)` below `key_lim` from the m64 x
/// head_dim accumulators (zero for keys no segment saw).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn write_dkdv<E: Float, NV: Size, NQ: Size>(
    args: &mut DkdvCard<E, NV, NQ>,
    dk_acc: &Array<f32>,
    dv_acc: &Array<f32>,
    key0: u32,
    key_lim: u32,
    key_a: usize,
    col_a: usize,
    hk: u32,
    #[comptime] head_dim: usize,
    #[comptime] paged: bool,
) {
    #[unroll]
    for nb in 0..comptime!(head_dim / 8) {
        #[unroll]
        for e in 0..4usize {
            let key = key0 + (key_a + (e / 2) * 8) as u32;
            if key < key_lim {
                let col = nb * 8 + col_a + e % 2;
                let gi = (kv_row(key, &args.tq_list, paged) * args.heads_kv + hk) as usize * head_dim + col;
                args.dk[gi] = E::cast_from(dk_acc[nb * 4 + e] * args.scale);
                args.dv[gi] = E::cast_from(dv_acc[nb * 4 + e]);
            }
        }
    }
}

/// The Hopper dK / dV kernel; its arguments are the dK / dV card (`cards::DkdvCard`), as those of
/// `flash_bwd_wide::flash_bwd_dkdv_wide`. `q_map` / `do_map`: 128-byte-swizzled maps with 64-column x 64-row boxes; `dq_acc`
/// is not read (the fused dQ goes through `dq_rows` by bulk reductions).
#[allow(clippy::too_many_arguments, unused_variables, unused_assignments)]
#[cube(launch_unchecked)]
pub fn flash_bwd_sm90<E: Float, NV: Size, NQ: Size>(
    args: &mut DkdvCard<E, NV, NQ>,
    #[comptime] head_dim: usize,
    #[comptime] fuse_dq: bool,
    #[comptime] qvec: usize,
    #[comptime] sparse: bool,
    #[comptime] paged: bool,
) {
    let lane = UNIT_POS_PLANE;
    // the warp and warpgroup index broadcast from lane 0: values the compiler knows are uniform
    // across the warp, so the MMA descriptors built from them stay in uniform registers
    let warp = plane_broadcast(UNIT_POS / 32u32, 0u32);
    let wg = (warp / 4u32) as usize;
    // this lane's first accumulator row (a key of the cube; + 8 for the second)
    let key_a = wg * WG_KEYS + ((warp % 4u32) * 16u32 + lane / 4u32) as usize;
    // this lane's first accumulator column pair (a row of the query tile)
    let col_a = ((lane % 4u32) * 2u32) as usize;

    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(BN * head_dim), 1024usize);
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(BN * head_dim), 1024usize);
    let mut q_smem = SharedMemory::<E>::new_aligned(comptime!(2 * BM * head_dim), 1024usize);
    let mut do_smem = SharedMemory::<E>::new_aligned(comptime!(2 * BM * head_dim), 1024usize);
    // dS^T, key-major ([key][row]: one 64-column chunk of BN rows), the A operand of dQ = dS K
    let mut ds_smem = SharedMemory::<E>::new_aligned(comptime!(if fuse_dq { BN * BM } else { SW_COLS * 8 }), 1024usize);
    let dts = comptime!(dq_tile_stride(head_dim));
    let mut dq_tile = SharedMemory::<Vector<f32,
        NQ>>::new_aligned(comptime!(if fuse_dq { BM * dts / qvec } else { 1usize }), 16usize);
    let mut lse_smem = SharedMemory::<f32>::new(comptime!(2 * BM));
    let mut dl_smem = SharedMemory::<f32>::new(comptime!(2 * BM));
    let bar0 = Barrier::shared(comptime!(SM90_BWD_THREADS as u32), UNIT_POS == 0);
    let bar1 = Barrier::shared(comptime!(SM90_BWD_THREADS as u32), UNIT_POS == 0);

    let (item, hk) = cube_item_slot(args.heads_kv, args.kv_outer, sparse);
    let group = args.heads_q / args.heads_kv;
    let ki = key_item(&args.ktiles, &args.tile_off, &args.segs, item, 0u32, args.total_k, sparse, WIDE_BN);
    let (key0, key_lim) = (ki.key0, ki.key_lim);

    stage_rows::<E, NV>(&args.k, &mut k_smem, key0, key_lim, key0, args.heads_kv, hk, &args.tq_list, BN, head_dim,
        SM90_BWD_THREADS, paged, true);
    stage_rows::<E, NV>(&args.v, &mut v_smem, key0, key_lim, key0, args.heads_kv, hk, &args.tq_list, BN, head_dim,
        SM90_BWD_THREADS, paged, true);
    // K, V visible to the async proxy (the MMAs), barrier initialisation before the first commit
    fence_proxy_async();
    sync_cube();
    let mut g_tile = 0u32;

    let acc_n = comptime!(head_dim / 2);
    let mut dk_acc = Array::<f32>::new(acc_n);
    let mut dv_acc = Array::<f32>::new(acc_n);
    #[unroll]
    for i in 0..acc_n {
        dk_acc[i] = 0.0f32;
        dv_acc[i] = 0.0f32;
    }
    let mut s = Array::<f32>::new(comptime!(BM / 2));
    let mut dp = Array::<f32>::new(comptime!(BM / 2));
    let mut p_regs = Array::<Vector<E, Const<2>>>::new(comptime!(BM / 4));
    let mut ds_regs = Array::<Vector<E, Const<2>>>::new(comptime!(BM / 4));
    let dq_n = comptime!(if fuse_dq { head_dim / 4 } else { 1usize });
    let mut dq = Array::<f32>::new(dq_n);
    // dQ columns of this warpgroup: [dq_col0, dq_col0 + head_dim / 2), as an element offset in K
    let dq_col0 = wg * comptime!(head_dim / 2);
    let k_dq = (dq_col0 / SW_COLS) * comptime!(BN * SW_COLS) + dq_col0 % SW_COLS;

    for si in ki.s_begin..ki.s_end {
        let sw = seg_walk(
            &args.segs, &args.tile_segs, &args.tq_off, &ki, si, BN as u32, hk, args.heads_kv, group, args.idx_heads,
            args.k_blocks, args.q_tiles_per_block, args.win_l, args.win_r, sparse, BM,
        );
        let (q_start, q_len, k_start, shift, r_min) = (sw.q_start, sw.q_len, sw.k_start, sw.shift, sw.r_min);
        let (k_hi, n_qt, n_it, t_lo, t_n, span) = (sw.k_hi, sw.n_qt, sw.n_it, sw.t_lo, sw.t_n, sw.span);
        // window-local index of this warpgroup's first key (may be negative)
        let kw0 = (key0 as i32 + (wg * WG_KEYS) as i32) - k_start as i32;
        // (head, first row, end row) of the (head, tile) pair at counters (hq, ei, ti)
        let mut h = hk * group;
        let mut r0 = r_min as u32;
        let mut row_end = q_len;
        if sparse && n_it > 0 {
            let (ha, ra, re) = sparse_q_tile(&args.tq_list, t_lo, 0u32, 0u32, 0u32, hk * group, span, args.q_block, q_len);
            h = ha;
            r0 = ra;
            row_end = re;
        }
        if n_it > 0 {
            issue_q_tile::<E>(
                &args.q_map, &args.do_map, &args.q_s, &args.do_s, &args.lse, &args.delta, &mut q_smem, &mut do_smem,
                &mut lse_smem, &mut dl_smem, &bar0, &bar1, g_tile, h, r0, q_len, q_start, args.heads_q, args.total_q, UNIT_POS, head_dim, head_dim, SM90_BWD_THREADS, BM, false,
            );
        }
        let mut hq = 0u32;
        let mut ti = 0u32;
        let mut ei = 0u32;
        // the next pair's (head, first row, end row); `h`, `r0`, `row_end` take them at the end of
        // the iteration (a `let` of a mutable variable would name the same variable, not a copy)
        let mut h_next = h;
        let mut r0_next = r0;
        let mut row_end_next = row_end;
        for it in 0..n_it {
            let cur = g_tile;
            // advance to the next pair and issue it into the other stage (its last reader, tile
            // cur - 1, finished before the barrier that ended it)
            if sparse {
                ti += 1u32;
                if ti == args.q_tiles_per_block {
                    ti = 0u32;
                    ei += 1u32;
                    if ei == t_n {
                        ei = 0u32;
                        hq += 1u32;
                    }
                }
                let (ha, ra, re) = sparse_q_tile(&args.tq_list, t_lo, ei, ti, hq, hk * group, span, args.q_block, q_len);
                h_next = ha;
                r0_next = ra;
                row_end_next = re;
            } else {
                ti += 1u32;
                if ti == n_qt {
                    ti = 0u32;
                    hq += 1u32;
                }
                h_next = hk * group + hq;
                r0_next = r_min as u32 + ti * BM as u32;
            }
            g_tile = cur + 1u32;
            if it + 1 < n_it {
                issue_q_tile::<E>(
                    &args.q_map, &args.do_map, &args.q_s, &args.do_s, &args.lse, &args.delta, &mut q_smem, &mut do_smem,
                    &mut lse_smem, &mut dl_smem, &bar0, &bar1, g_tile, h_next, r0_next, q_len, q_start, args.heads_q,
                    args.total_q, UNIT_POS, head_dim, head_dim, SM90_BWD_THREADS, BM, false,
                );
            }
            wait_stage(&bar0, &bar1, cur);
            let qb = ((cur & 1u32) as usize) * comptime!(BM * head_dim);
            let lb = ((cur & 1u32) as usize) * BM;

            // ---- 1. S^T = K Q^T, dP^T = V dO^T (64 keys x 64 rows per warpgroup) ----
            wgmma_fence();
            key_by_row_steps::<E>(&mut s, &k_smem, wg * WG_KEYS, BN, &q_smem, qb, head_dim, BM);
            wgmma_commit();
            key_by_row_steps::<E>(&mut dp, &v_smem, wg * WG_KEYS, BN, &do_smem, qb, head_dim, BM);
            wgmma_commit();
            let l2 = lse_ahead(&lse_smem, lb, col_a);
            wgmma_wait(1u32);

            // ---- 2. P^T (while dP^T is formed), then dS^T; masked unless the block is full ----
            p_transposed(
                &mut s, &l2, &lse_smem, lb, col_a, key_a, wg * WG_KEYS, kw0, r0 as i32, row_end, k_hi, shift, args.win_l, args.win_r,
                args.scale_log2, BM,
            );
            wgmma_wait(0u32);
            ds_transposed(&mut dp, &s, &dl_smem, lb, col_a, BM, true);
            pack_a_pairs::<E>(&s, &mut p_regs, comptime!(BM / 4));
            pack_a_pairs::<E>(&dp, &mut ds_regs, comptime!(BM / 4));
            if fuse_dq {
                // dS^T key-major for dQ
                store_ds_transposed::<E>(&mut ds_smem, 0usize, &ds_regs, key_a, col_a, BN, BM);
            }

            // ---- 3. dV += P^T dO, dK += dS^T Q ----
            wgmma_fence();
            key_by_dim_steps::<E>(&mut dv_acc, &p_regs, &do_smem, qb, head_dim, BM);
            key_by_dim_steps::<E>(&mut dk_acc, &ds_regs, &q_smem, qb, head_dim, BM);
            wgmma_commit();

            if fuse_dq {
                // ---- 4. dQ[:, dq_col0..] = dS K, through the f32 tile, added by the copy engine ----
                // the previous tile's rows have been read from the tile; dS^T complete
                dq_rows_read(BM);
                sync_cube();
                wgmma_fence();
                dq_steps::<E>(&mut dq, &ds_smem, 0usize, &k_smem, k_dq, comptime!(head_dim / 2));
                wgmma_commit();
                wgmma_wait(0u32);
                // rows 16 w + lane / 4 (+ 8) of the tile
                put_dq_rows::<NQ>(&mut dq_tile, &dq, key_a - wg * WG_KEYS, dq_col0, col_a, head_dim, qvec);
                sync_async_proxy_shared();
                let n_rows = select(r0 < row_end, min(row_end - r0, BM as u32), 0u32);
                let dst = dq_row_dst(q_start + r0, n_rows, h, args.heads_q, head_dim, qvec);
                // the tile complete, every warpgroup done with this tile's stage and dS^T
                sync_cube();
                issue_dq_row::<NQ>(&dq_tile, &mut args.dq_rows, dst, head_dim, qvec);
            } else {
                wgmma_wait(0u32);
                // every warpgroup done with this tile's stage
                sync_cube();
            }
            h = h_next;
            r0 = r0_next;
            row_end = row_end_next;
        }
    }

    if fuse_dq {
        dq_rows_read(BM);
    }

    // ---- dK, dV (zero for keys no segment sees; sparse: the item's keys only) ----
    write_dkdv::<E, NV, NQ>(args, &dk_acc, &dv_acc, key0, key_lim, key_a, col_a, hk, head_dim, paged);
}
