//! The warp-specialised Hopper dK / dV kernel at head_dim 192 (v at 192, or 128: DeepSeek's MLA):
//! the query rows are the MMAs' M side, three consumer warpgroups split the cube's keys for S / dP
//! and the head_dim columns for dK / dV / dQ.
//!
//! `flash_bwd_ws` keeps dK and dV of its warpgroup's 64 keys x head_dim in registers: 192 f32 a
//! thread at head_dim 192, more than a thread has beside S^T and dP^T. `flash_bwd_sm90_split`
//! (the kernel this one replaces for these calls) gives dV to one warpgroup and dK to the other, so
//! the second waits for the first's P^T at two cube barriers a tile with nothing else to run (ncu:
//! a quarter of the issue slots busy).
//!
//! Here one cube = [`WS_COLS_BN`] = 96 keys, 512 threads. Warpgroup 0 is the producer
//! (`setmaxnreg` down): warp 0 issues every query tile (Q, dO, lse, delta) into two stages, as
//! `flash_bwd_ws`'s; where the fused dQ goes through a tile ([`ws_cols_dq_tile`]: v at 128), warp 1
//! adds each stored dQ tile into the head-major f32 accumulator by one bulk reduce-add. Warpgroups
//! 1-3 are the consumers; consumer `c`, per query tile of 64 rows:
//! 1. S = Q K_c^T and dP = dO V_c^T over its 32 keys (`m64n32`, shared operands, both K-major);
//! 2. P = 2^(S scale log2 e - lse log2 e) (masked where its block is not wholly visible),
//!    dS = P (dP - delta): the rows are the accumulator's, so each thread reads lse and delta of
//!    two rows;
//! 3. after a named barrier (every consumer's MMAs of the last tile have read P^T / dS^T) stores
//!    its keys' P and dS key-major ([key][row], 128-byte swizzle) and meets the others at a second;
//! 4. dQ[:, 64 c ..] = dS K (`m64n64`, A = dS MN-major, B = K MN-major), dV^T[64 c ..] += dO^T P
//!    (for `c` < head_dim_v / 64) and dK^T[64 c ..] += Q^T dS (`m64n96`, A = dO^T / Q^T MN-major
//!    from the query stage, B = P^T / dS^T K-major): each consumer holds 64 columns of dK and dV
//!    for all 96 keys (48 + 48 f32 a thread);
//! 5. dQ out while dK / dV run: its 64 columns into the f32 tile (one buffer: 48 KiB) once the dQ
//!    warp has read the last, or, at v 192 (the tile does not fit beside two query stages), added
//!    to the token-major accumulator by float2 atomics; the stage is released when its MMAs are
//!    done.
//!
//! Shared memory (`tiles::ws_cols_smem`): at v 128 K 36, V 24, Q 2 x 24, dO 2 x 16, P^T 12, dS^T 12,
//! dQ 48 KiB (212 KiB); at v 192 K 36, V 36, Q 2 x 24, dO 2 x 24, P^T 12, dS^T 12 (192 KiB).
//!
//! The host plan (96-key tiles, `backward::key_tile`), card (`cards::DkdvCard`), work list, segment
//! walk (dense, varlen, GQA, grouped windows) and query-tile copies are those of `flash_bwd_ws`; no
//! block-sparse or paged variant (block-sparse calls serve head dims up to 128; paged ones at 192
//! run `flash_bwd_sm90_split`). At head_dim 256 two consumer warpgroups of 128 columns over 64-key
//! cubes measured level with `flash_bwd_sm90_split` (docs/measured-and-lost.md).

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::bwd_walk::{first_q_tile, key_item, next_q_tile};
use super::cards::DkdvCard;
use super::flash_bwd_sm90::tile_full;
use super::flash_bwd_ws::{produce, store_dq, walk};
use super::flash_fwd_ws::release;
use super::grid::cube_item_slot;
use super::math::{fast_exp2, LOG2E};
use super::sm90::{
    fence_proxy_async, named_barrier, setmaxnreg, swizzle_128b, wgmma_commit, wgmma_fence, wgmma_ss, wgmma_wait, SW_COLS,
    SW_ROW,
};
use super::bulk_reduce::add_dq_row64;
use super::staging::{stage_rows, wait_stage};
use super::tiles::{ws_cols_dq_tile, BWD_BM, WS_COLS_BN};

/// Threads per cube: a producer warpgroup and three consumer warpgroups.
pub const BWD_WS_COLS_THREADS: usize = 512;
/// q's and k's head_dim.
const HD: usize = 192;
const BN: usize = WS_COLS_BN;
const BM: usize = BWD_BM;
/// Keys of S / dP per consumer warpgroup.
const WG_KEYS: usize = 32;
/// Consumer warpgroups: one per 64 columns of head_dim.
const CONSUMERS: usize = 3;
const _: () = assert!(BN == CONSUMERS * WG_KEYS && HD == CONSUMERS * SW_COLS && BM == 64);
/// The loading warp's lanes (a `full` phase's copy arrivals).
const LOADERS: usize = 32;
/// Consumer threads (the `empty` and `dq_full` arrivals, the named barriers' count).
const CONSUMER_THREADS: u32 = 384;
/// Units that stage K and V (a multiple of a warpgroup dividing 96 rows x 24 or 16 vectors).
const STAGERS: usize = 384;
/// Named barriers: P^T / dS^T free (every consumer's MMAs of the last tile done), then stored.
const FREE_BARRIER: u32 = 1;
const READY_BARRIER: u32 = 2;
/// Registers a thread after the moves: 24 x 128 + 160 x 384 of the SM's 64 K (`flash_bwd_ws`'s spare 1 K).
const PRODUCER_REGS: u32 = 24;
const CONSUMER_REGS: u32 = 160;

/// `acc (m64 x n) = A B^T` over `k_dim` columns: A the 64 rows of the swizzled tile at element
/// `a0` of `a` (64 rows a chunk), B the `n` rows at element `b0` of the swizzled tile `b`
/// (`b_rows` rows a chunk), both K-major: S = Q K_c^T, dP = dO V_c^T. The caller fences before
/// and commits after.
#[cube]
#[allow(clippy::too_many_arguments)]
fn rows_by_keys<E: Float>(
    acc: &mut Array<f32>,
    a: &SharedMemory<E>,
    a0: usize,
    b: &SharedMemory<E>,
    b0: usize,
    #[comptime] b_rows: usize,
    #[comptime] n: usize,
    #[comptime] k_dim: usize,
) {
    #[unroll]
    for kk in 0..comptime!(k_dim / 16) {
        let chunk = comptime!(kk / 4);
        let within = comptime!((kk % 4) * 16);
        let a_off = a0 + comptime!(chunk * BM * SW_COLS + within);
        let b_off = b0 + comptime!(chunk * b_rows * SW_COLS + within);
        wgmma_ss::<E>(acc, a, a_off as u32, b, b_off as u32, 0usize, n, false, 0u32, false, 0u32, comptime!(kk > 0));
    }
}

/// `acc (m64 x 96 keys) += A^T B` over the tile's 64 rows: A^T the 64 columns at element `a0` of
/// the query stage (Q or dO: 64 rows of a chunk, MN-major), B the key-major `[key][row]` tile `b`
/// (P^T or dS^T, K-major): dV^T += dO^T P, dK^T += Q^T dS. The caller fences before and commits
/// after.
#[cube]
fn cols_by_keys<E: Float>(acc: &mut Array<f32>, a: &SharedMemory<E>, a0: usize, b: &SharedMemory<E>) {
    #[unroll]
    for ks in 0..comptime!(BM / 16) {
        let a_off = a0 + comptime!(ks * 16 * SW_COLS);
        let b_off = comptime!(ks * 16);
        wgmma_ss::<E>(acc, a, a_off as u32, b, b_off as u32, 0usize, BN, true, comptime!((BM * SW_ROW) as u32), false, 0u32, true);
    }
}

/// `dq (m64 x 64) = dS K[:, cols]` over the cube's 96 keys: A = dS from the key-major tile
/// (MN-major), B = the 64 columns of K at element `k0` (MN-major). The caller fences before and
/// commits after.
#[cube]
fn rows_by_cols<E: Float>(dq: &mut Array<f32>, ds_smem: &SharedMemory<E>, k_smem: &SharedMemory<E>, k0: usize) {
    #[unroll]
    for ks in 0..comptime!(BN / 16) {
        let off = comptime!(ks * 16 * SW_COLS);
        wgmma_ss::<E>(
            dq, ds_smem, off as u32, k_smem, (k0 + off) as u32, 0usize, SW_COLS, true, comptime!((BN * SW_ROW) as u32), true,
            comptime!((BN * SW_ROW) as u32), comptime!(ks > 0),
        );
    }
}

/// dS = P (dP - delta) in place of `dp` (this thread's 16 values of the `m64n32` accumulators;
/// `s` holds P, `d0` / `d1` delta of its two rows). `masked` (a block P may have masked): P = 0
/// keeps dS = 0 even where dP - delta is not finite (as `flash_bwd_sm90::ds_transposed`).
#[cube]
fn ds_rows(dp: &mut Array<f32>, s: &Array<f32>, d0: f32, d1: f32, #[comptime] masked: bool) {
    #[unroll]
    for nb in 0..comptime!(WG_KEYS / 8) {
        #[unroll]
        for hh in 0..2usize {
            #[unroll]
            for e2 in 0..2usize {
                let i = nb * 4 + hh * 2 + e2;
                let dl = if comptime!(hh == 0) { d0 } else { d1 };
                if comptime!(masked) {
                    dp[i] = select(s[i] == 0.0f32, 0.0f32, s[i] * (dp[i] - dl));
                } else {
                    dp[i] = s[i] * (dp[i] - dl);
                }
            }
        }
    }
}

/// This thread's 16 values of an `m64n32` accumulator (rows `row_a`, `row_a + 8` of the tile,
/// keys `8 nb + col_a (+ 1)` of consumer `cw`'s 32) stored to the key-major `[key][row]` tile
/// (128-byte swizzle, [`BN`] key rows) in the element type.
#[cube]
fn store_key_major<E: Float>(smem: &mut SharedMemory<E>, x: &Array<f32>, row_a: usize, col_a: usize, cw: usize) {
    // rows row_a (+ 8): their 16-byte unit's first row, and the row inside it
    let unit_row = row_a - row_a % 8;
    let r_in = row_a % 8;
    #[unroll]
    for nb in 0..comptime!(WG_KEYS / 8) {
        #[unroll]
        for e2 in 0..2usize {
            let key = cw * WG_KEYS + nb * 8 + col_a + e2;
            #[unroll]
            for hh in 0..2usize {
                let at = swizzle_128b(key, unit_row + hh * 8, BN) + r_in;
                smem[at] = E::cast_from(x[nb * 4 + hh * 2 + e2]);
            }
        }
    }
}

/// The warp-specialised dK / dV kernel at head_dim 192 (module docs); arguments as
/// `flash_bwd_ws::flash_bwd_ws` (dense, not paged, 96-key tiles; `q_map` / `do_map` with 64-column x
/// 64-row boxes); `head_dim_v`: v's, dO's and dV's head_dim (128 or 192; at 64 the producer spills
/// at 24 registers); `fuse_dq`: dQ into `dq_rows` head-major by the tile where [`ws_cols_dq_tile`]
/// holds, else into `dq_acc` token-major by `qvec`-float atomics.
#[allow(clippy::too_many_arguments, unused_variables, unused_assignments)]
#[cube(launch_unchecked)]
pub fn flash_bwd_ws_cols<E: Float, NV: Size, NQ: Size>(
    args: &mut DkdvCard<E, NV, NQ>,
    #[comptime] head_dim_v: usize,
    #[comptime] fuse_dq: bool,
    #[comptime] qvec: usize,
) {
    let dq_by_tile = comptime!(fuse_dq && ws_cols_dq_tile(head_dim_v));
    let dq_atomic = comptime!(fuse_dq && !dq_by_tile);
    let lane = UNIT_POS_PLANE;
    // warp and warpgroup broadcast from lane 0: uniform, so descriptors stay in uniform registers
    let warp = plane_broadcast(UNIT_POS / 32u32, 0u32);
    let wg = warp / 4u32;

    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(BN * HD), 1024usize);
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(BN * head_dim_v), 1024usize);
    let mut q_smem = SharedMemory::<E>::new_aligned(comptime!(2 * BM * HD), 1024usize);
    let mut do_smem = SharedMemory::<E>::new_aligned(comptime!(2 * BM * head_dim_v), 1024usize);
    // P^T and dS^T key-major: [key][row], one 64-row chunk
    let mut pt_smem = SharedMemory::<E>::new_aligned(comptime!(BN * BM), 1024usize);
    let mut ds_smem = SharedMemory::<E>::new_aligned(comptime!(BN * BM), 1024usize);
    // one dQ tile of 64 rows x 192 f32, chunks swizzled by row (`flash_bwd_ws::put_dq_tile`)
    let mut dq_tile = SharedMemory::<Vector<f32, NQ>>::new_aligned(comptime!(if dq_by_tile { BM * HD / qvec } else { 1usize }), 128usize);
    // each use's destination: first global row, rows, head
    let mut dq_info = SharedMemory::<u32>::new(8usize);
    let mut lse_smem = SharedMemory::<f32>::new(comptime!(2 * BM));
    let mut dl_smem = SharedMemory::<f32>::new(comptime!(2 * BM));
    let full0 = Barrier::shared(comptime!(LOADERS as u32), UNIT_POS == 0);
    let full1 = Barrier::shared(comptime!(LOADERS as u32), UNIT_POS == 0);
    let empty0 = Barrier::shared(CONSUMER_THREADS, UNIT_POS == 0);
    let empty1 = Barrier::shared(CONSUMER_THREADS, UNIT_POS == 0);
    let dq_full0 = Barrier::shared(CONSUMER_THREADS, UNIT_POS == 0);
    let dq_full1 = Barrier::shared(CONSUMER_THREADS, UNIT_POS == 0);
    let dq_empty0 = Barrier::shared(comptime!(LOADERS as u32), UNIT_POS == 0);
    let dq_empty1 = Barrier::shared(comptime!(LOADERS as u32), UNIT_POS == 0);

    let (item, hk) = cube_item_slot(args.heads_kv, args.kv_outer, false);
    let group = args.heads_q / args.heads_kv;
    let ki = key_item(&args.ktiles, &args.tile_off, &args.segs, item, 0u32, args.total_k, false, BN);
    let (key0, key_lim) = (ki.key0, ki.key_lim);

    // K, V staged once (swizzled, 96 rows a chunk; keys past the tensor's zero)
    if UNIT_POS < STAGERS as u32 {
        stage_rows::<E, NV>(&args.k, &mut k_smem, key0, key_lim, key0, args.heads_kv, hk, &args.tq_list, BN, HD, STAGERS, false, true);
        stage_rows::<E, NV>(&args.v, &mut v_smem, key0, key_lim, key0, args.heads_kv, hk, &args.tq_list, BN, head_dim_v, STAGERS,
            false, true);
    }
    // K, V visible to the async proxy (the MMAs), barrier initialisation before any use
    fence_proxy_async();
    sync_cube();

    if wg == 0u32 {
        setmaxnreg(false, PRODUCER_REGS);
        produce::<E, NV, NQ>(
            args, &ki, hk, group, &mut q_smem, &mut do_smem, &mut lse_smem, &mut dl_smem, &full0, &full1, &empty0, &empty1, &dq_tile,
            &dq_info, &dq_full0, &dq_full1, &dq_empty0, &dq_empty1, warp, lane, HD, head_dim_v, false, dq_by_tile, BN, BM, true, 0usize,
        );
        terminate!();
    }

    // ---- consumers: warpgroup cw of keys cw * 32 .. (S, dP) and columns cw * 64 .. (dK, dV, dQ) ----
    setmaxnreg(true, CONSUMER_REGS);
    let cw = (wg - 1u32) as usize;
    let ct = cw as u32 * 128u32 + UNIT_POS % 128u32;
    // this lane's first accumulator row (a row of the query tile for S, dP, dQ; a column of the
    // warpgroup's 64 for dK^T, dV^T), + 8 for the second
    let row_a = ((warp % 4u32) * 16u32 + lane / 4u32) as usize;
    // this lane's first accumulator column pair (a key for S, dP, dK^T, dV^T; a column for dQ)
    let col_a = ((lane % 4u32) * 2u32) as usize;
    // dV's columns are 64 per consumer too: the last ones hold none when v is narrower
    let has_dv = cw < comptime!(head_dim_v / SW_COLS);

    let acc_n = comptime!(BN / 2);
    let mut dk_acc = Array::<f32>::new(acc_n);
    let mut dv_acc = Array::<f32>::new(acc_n);
    #[unroll]
    for i in 0..acc_n {
        dk_acc[i] = 0.0f32;
        dv_acc[i] = 0.0f32;
    }
    let mut s = Array::<f32>::new(comptime!(WG_KEYS / 2));
    let mut dp = Array::<f32>::new(comptime!(WG_KEYS / 2));
    let mut dq = Array::<f32>::new(comptime!(if fuse_dq { SW_COLS / 2 } else { 1usize }));
    // this consumer's 64 columns of K (the dQ product's B) and of the query stages (dK^T's and
    // dV^T's A), as element offsets of their chunk
    let k_cols = cw * comptime!(BN * SW_COLS);
    let stage_cols = cw * comptime!(BM * SW_COLS);
    let key_off = cw * comptime!(WG_KEYS * SW_COLS);

    let mut g = 0u32;
    for si in ki.s_begin..ki.s_end {
        let sw = walk(args, &ki, si, hk, group, false, BN, BM);
        // window-local index of this consumer's first key (may be negative)
        let kw0 = (key0 as i32 + (cw * WG_KEYS) as i32) - sw.k_start as i32;
        let mut qt = first_q_tile(&args.tq_list, &sw, hk, group, args.q_block, false);
        for it in 0..sw.n_it {
            let cur = g;
            let (h, r0, row_end) = (qt.h, qt.r0, qt.row_end);
            wait_stage(&full0, &full1, cur);
            if r0 + BM as u32 > sw.q_len {
                // a tile past the segment's end came by cp.async (generic proxy)
                fence_proxy_async();
            }
            let qb = ((cur & 1u32) as usize) * comptime!(BM * HD);
            let db = ((cur & 1u32) as usize) * comptime!(BM * head_dim_v);
            let lb = ((cur & 1u32) as usize) * BM;

            // ---- 1. S = Q K_c^T, dP = dO V_c^T (64 rows x 32 keys) ----
            wgmma_fence();
            rows_by_keys::<E>(&mut s, &q_smem, qb, &k_smem, key_off, BN, WG_KEYS, HD);
            wgmma_commit();
            rows_by_keys::<E>(&mut dp, &do_smem, db, &v_smem, key_off, BN, WG_KEYS, head_dim_v);
            wgmma_commit();
            let l0 = lse_smem[lb + row_a] * LOG2E;
            let l1 = lse_smem[lb + row_a + 8] * LOG2E;
            let d0 = dl_smem[lb + row_a];
            let d1 = dl_smem[lb + row_a + 8];
            wgmma_wait(1u32);

            // ---- 2. P (while dP is formed), masked unless the block is wholly visible; dS ----
            let rr0 = r0 as i32;
            let full = tile_full(kw0, rr0, row_end, sw.k_hi, sw.shift, args.win_l, args.win_r, WG_KEYS, BM);
            #[unroll]
            for nb in 0..comptime!(WG_KEYS / 8) {
                #[unroll]
                for hh in 0..2usize {
                    #[unroll]
                    for e2 in 0..2usize {
                        let i = nb * 4 + hh * 2 + e2;
                        let l = if comptime!(hh == 0) { l0 } else { l1 };
                        s[i] = fast_exp2(s[i] * args.scale_log2 - l);
                    }
                }
            }
            if !full {
                #[unroll]
                for hh in 0..2usize {
                    let r = rr0 + (row_a + hh * 8) as i32;
                    let dg = r + sw.shift;
                    let lo = max(dg - args.win_l as i32, 0i32);
                    let mut hi = min(dg + args.win_r as i32 + 1i32, sw.k_hi as i32);
                    if r >= row_end as i32 {
                        hi = -1i32;
                    }
                    #[unroll]
                    for nb in 0..comptime!(WG_KEYS / 8) {
                        #[unroll]
                        for e2 in 0..2usize {
                            let kk = kw0 + (nb * 8 + col_a + e2) as i32;
                            let i = nb * 4 + hh * 2 + e2;
                            s[i] = select(kk >= lo && kk < hi, s[i], 0.0f32);
                        }
                    }
                }
            }
            wgmma_wait(0u32);
            // P = 0 (masked) keeps dS = 0 even where dP - delta is not finite
            if full {
                ds_rows(&mut dp, &s, d0, d1, false);
            } else {
                ds_rows(&mut dp, &s, d0, d1, true);
            }

            // ---- 3. P^T, dS^T key-major once every consumer's MMAs of the last tile have read them ----
            named_barrier(FREE_BARRIER, CONSUMER_THREADS);
            store_key_major::<E>(&mut pt_smem, &s, row_a, col_a, cw);
            store_key_major::<E>(&mut ds_smem, &dp, row_a, col_a, cw);
            fence_proxy_async();
            named_barrier(READY_BARRIER, CONSUMER_THREADS);

            // ---- 4. dQ[:, cols] = dS K[:, cols]; dV^T[cols] += dO^T P; dK^T[cols] += Q^T dS ----
            wgmma_fence();
            if fuse_dq {
                rows_by_cols::<E>(&mut dq, &ds_smem, &k_smem, k_cols);
                wgmma_commit();
            }
            if has_dv {
                cols_by_keys::<E>(&mut dv_acc, &do_smem, db + stage_cols, &pt_smem);
            }
            cols_by_keys::<E>(&mut dk_acc, &q_smem, qb + stage_cols, &ds_smem);
            wgmma_commit();
            if dq_by_tile {
                // ---- 5. dQ done (dK / dV may run on): into the tile once the dQ warp has read the last ----
                wgmma_wait(1u32);
                store_dq(
                    &mut dq_tile, &mut dq_info, &dq_empty0, &dq_empty1, &dq_full0, &dq_full1, &dq, cur, sw.q_start + r0, r0, row_end, h,
                    row_a, cw, col_a, ct, cw * SW_COLS, HD, qvec, BM, 0usize, SW_COLS, false,
                );
            }
            if dq_atomic {
                // ---- 5. dQ done (dK / dV may run on): its rows of the segment added by float2 atomics ----
                wgmma_wait(1u32);
                #[unroll]
                for hh in 0..2usize {
                    let rl = r0 + (row_a + hh * 8) as u32;
                    if rl < row_end {
                        let gv = ((((sw.q_start + rl) * args.heads_q + h) as usize) * HD + cw * SW_COLS + col_a) / qvec;
                        add_dq_row64::<NQ>(&args.dq_acc, &dq, gv, true, comptime!(hh * 2), qvec);
                    }
                }
            }
            // dV, dK done: the stage is free
            wgmma_wait(0u32);
            release(&empty0, &empty1, cur, true);
            next_q_tile(&args.tq_list, &sw, &mut qt, hk, group, args.q_tiles_per_block, args.q_block, false, BM);
            g += 1u32;
        }
    }

    // ---- dK (scaled), dV: this consumer's 64 columns of every key below key_lim (zero for keys no
    // segment sees) ----
    let hv = comptime!(head_dim_v as u32);
    #[unroll]
    for nb in 0..comptime!(BN / 8) {
        #[unroll]
        for e2 in 0..2usize {
            let key = key0 + (nb * 8 + col_a + e2) as u32;
            if key < key_lim {
                let row = key * args.heads_kv + hk;
                #[unroll]
                for hh in 0..2usize {
                    let col = (cw * SW_COLS + row_a + hh * 8) as u32;
                    let i = nb * 4 + hh * 2 + e2;
                    args.dk[(row * comptime!(HD as u32) + col) as usize] = E::cast_from(dk_acc[i] * args.scale);
                    if has_dv {
                        args.dv[(row * hv + col) as usize] = E::cast_from(dv_acc[i]);
                    }
                }
            }
        }
    }
}
