//! dK / dV and the fused dQ on Hopper (sm_90a) above head_dim 128 (192, 256): the warpgroups split
//! the products, not the keys.
//!
//! `flash_bwd_sm90` keeps dK and dV of its warpgroup's 64 keys in registers (head_dim f32 a thread:
//! 256 at d256, more than a thread has). Here one cube owns [`SPLIT_BN`] = 64 keys (one wgmma row
//! block) and its two warpgroups divide the work of every query tile of 64 rows:
//! - warpgroup 0: S^T = K Q^T, P^T = 2^(S^T scale log2 e - lse log2 e) (masked), dV += P^T dO;
//! - warpgroup 1: dP^T = V dO^T, dS^T = P^T (dP^T - delta) with P^T read from shared memory (f32,
//!   one value a thread, in the accumulator layout both warpgroups share), dK += dS^T Q;
//! - both: dQ += dS K in 64-column parts (warpgroup w takes parts w, w + 2, ...), A = dS^T stored
//!   key-major to shared memory, B = K; each part's 64 x 64 f32 added to the accumulator by float2
//!   atomics (the bulk reductions' row tile does not fit: K, V, two stages of Q / dO, P^T and dS^T
//!   take 216 KiB at d256).
//!
//! So each warpgroup holds head_dim / 2 f32 of dV or dK (128 at d256), the 32 of S^T or dP^T, and
//! during dQ 32 more. Two cube barriers per tile: P^T stored, and dS^T stored (by then every read
//! of the tile's Q / dO stage, lse / delta and P^T has ended, so the next tile's copies may be
//! issued and warpgroup 0 may start its S^T while warpgroup 1 finishes its dQ part).
//!
//! v may be narrower than q and k (`head_dim_v`, DeepSeek's MLA 192 / 128): V, dO and dV are then
//! v's width (dP^T = V dO^T over `head_dim_v`, dV's N `head_dim_v`), S^T, dK and dQ q's.
//!
//! The walk, the work list (64-key tiles), the K / V staging, the query-tile copies and P^T
//! (`p_transposed`) are those of `flash_bwd_sm90` (same card: `cards::DkdvCard`); dense and paged
//! K / V, no block-sparse variant (the block-sparse kernels serve head_dim 64 and 128).

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::bwd_walk::{key_item, seg_walk};
use super::cards::DkdvCard;
use super::bulk_reduce::add_dq_row64;
use super::flash_bwd_sm90::{issue_q_tile, key_by_dim_steps, key_by_row_steps, lse_ahead, p_transposed, store_ds_transposed, SM90_BWD_THREADS};
use super::grid::cube_item_slot;
use super::rows::kv_row;
use super::sm90::{fence_proxy_async, pack_a_pairs, wgmma_commit, wgmma_fence, wgmma_ss, wgmma_wait, SW_COLS,
    SW_ROW};
use super::staging::{stage_rows, wait_stage};
use super::tiles::{BWD_BM, SPLIT_BN};

const BN: usize = SPLIT_BN;
const BM: usize = BWD_BM;
/// Threads of one warpgroup.
const WG: usize = 128;
const _: () = assert!(BN == 64 && BM == 64 && SM90_BWD_THREADS == 2 * WG);

/// The Hopper dK / dV kernel above head_dim 128 (head_dim a multiple of 64 up to 256); arguments:
/// the dK / dV card (`cards::DkdvCard`), dense 64-key tiles (`tq_list` the page table when
/// `paged`); with `fuse_dq`, `dq_acc` the fused dQ's f32 accumulator (float2 atomics with `qvec`
/// 2), without it no dQ (the deterministic path's dQ pass forms it); `q_map` / `do_map`
/// 128-byte-swizzled maps with 64-column x 64-row boxes. `head_dim_v`: v's, dO's and dV's head_dim
/// (a multiple of 64, at most `head_dim`).
#[allow(clippy::too_many_arguments, unused_variables, unused_assignments)]
#[cube(launch_unchecked)]
pub fn flash_bwd_sm90_split<E: Float, NV: Size, NQ: Size>(
    args: &mut DkdvCard<E, NV, NQ>,
    #[comptime] head_dim: usize,
    #[comptime] head_dim_v: usize,
    #[comptime] fuse_dq: bool,
    #[comptime] qvec: usize,
    #[comptime] paged: bool,
) {
    let lane = UNIT_POS_PLANE;
    // warp and warpgroup broadcast from lane 0 (uniform registers for the MMA descriptors)
    let warp = plane_broadcast(UNIT_POS / 32u32, 0u32);
    let wg = warp / 4u32;
    // this thread inside its warpgroup: the P^T exchange pairs thread t of one with thread t of the other
    let t = (UNIT_POS % WG as u32) as usize;
    // the first accumulator row of this lane (a key; + 8 for the second) and column pair (a row of
    // the query tile) of an m64 accumulator
    let key_a = ((warp % 4u32) * 16u32 + lane / 4u32) as usize;
    let col_a = ((lane % 4u32) * 2u32) as usize;

    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(BN * head_dim), 1024usize);
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(BN * head_dim_v), 1024usize);
    let mut q_smem = SharedMemory::<E>::new_aligned(comptime!(2 * BM * head_dim), 1024usize);
    let mut do_smem = SharedMemory::<E>::new_aligned(comptime!(2 * BM * head_dim_v), 1024usize);
    // P^T in f32, [value][thread]: warpgroup 0 writes, warpgroup 1 reads its twin's values
    let mut p_smem = SharedMemory::<f32>::new_aligned(comptime!(BN * BM), 16usize);
    // dS^T key-major ([key][row], one 64-column chunk of BN rows), the A operand of dQ = dS K
    let mut ds_smem = SharedMemory::<E>::new_aligned(comptime!(if fuse_dq { BN * BM } else { SW_COLS * 8 }), 1024usize);
    let mut lse_smem = SharedMemory::<f32>::new(comptime!(2 * BM));
    let mut dl_smem = SharedMemory::<f32>::new(comptime!(2 * BM));
    let bar0 = Barrier::shared(comptime!(SM90_BWD_THREADS as u32), UNIT_POS == 0);
    let bar1 = Barrier::shared(comptime!(SM90_BWD_THREADS as u32), UNIT_POS == 0);

    let (item, hk) = cube_item_slot(args.heads_kv, args.kv_outer, false);
    let group = args.heads_q / args.heads_kv;
    let ki = key_item(&args.ktiles, &args.tile_off, &args.segs, item, 0u32, args.total_k, false, BN);
    let (key0, key_lim) = (ki.key0, ki.key_lim);

    stage_rows::<E, NV>(&args.k, &mut k_smem, key0, key_lim, key0, args.heads_kv, hk, &args.tq_list, BN, head_dim,
        SM90_BWD_THREADS, paged, true);
    stage_rows::<E, NV>(&args.v, &mut v_smem, key0, key_lim, key0, args.heads_kv, hk, &args.tq_list, BN, head_dim_v,
        SM90_BWD_THREADS, paged, true);
    // K, V visible to the async proxy (the MMAs), barrier initialisation before the first commit
    fence_proxy_async();
    sync_cube();
    let mut g_tile = 0u32;

    // dV (warpgroup 0: its first head_dim_v / 2) or dK (warpgroup 1) of the cube's 64 keys: 64 x head_dim
    let acc_n = comptime!(head_dim / 2);
    let mut acc = Array::<f32>::new(acc_n);
    #[unroll]
    for i in 0..acc_n {
        acc[i] = 0.0f32;
    }
    // S^T (warpgroup 0) or dP^T, then P^T or dS^T (64 keys x 64 rows)
    let mut x = Array::<f32>::new(comptime!(BM / 2));
    let mut a_regs = Array::<Vector<E, Const<2>>>::new(comptime!(BM / 4));
    // one 64-column part of dQ (64 rows x 64 columns)
    let mut dq = Array::<f32>::new(comptime!(SW_COLS / 2));
    let parts = comptime!(head_dim / SW_COLS);

    for si in ki.s_begin..ki.s_end {
        let sw = seg_walk(
            &args.segs, &args.tile_segs, &args.tq_off, &ki, si, BN as u32, hk, args.heads_kv, group, args.idx_heads,
            args.k_blocks, args.q_tiles_per_block, args.win_l, args.win_r, false, BM,
        );
        let (q_start, q_len, k_start, shift, r_min) = (sw.q_start, sw.q_len, sw.k_start, sw.shift, sw.r_min);
        let (k_hi, n_qt, n_it) = (sw.k_hi, sw.n_qt, sw.n_it);
        // window-local index of the cube's first key (may be negative)
        let kw0 = key0 as i32 - k_start as i32;
        let mut h = hk * group;
        let mut r0 = r_min as u32;
        if n_it > 0 {
            issue_q_tile::<E>(
                &args.q_map, &args.do_map, &args.q_s, &args.do_s, &args.lse, &args.delta, &mut q_smem, &mut do_smem,
                &mut lse_smem, &mut dl_smem, &bar0, &bar1, g_tile, h, r0, q_len, q_start, args.heads_q, args.total_q, UNIT_POS, head_dim, head_dim_v,
                SM90_BWD_THREADS, BM, false,
            );
        }
        let mut hq = 0u32;
        let mut ti = 0u32;
        for it in 0..n_it {
            let cur = g_tile;
            // the next (head, tile) pair, issued into the other stage (its last reader, tile
            // cur - 1, finished before the barrier that ended it)
            ti += 1u32;
            if ti == n_qt {
                ti = 0u32;
                hq += 1u32;
            }
            let h_next = hk * group + hq;
            let r0_next = r_min as u32 + ti * BM as u32;
            g_tile = cur + 1u32;
            if it + 1 < n_it {
                issue_q_tile::<E>(
                    &args.q_map, &args.do_map, &args.q_s, &args.do_s, &args.lse, &args.delta, &mut q_smem, &mut do_smem,
                    &mut lse_smem, &mut dl_smem, &bar0, &bar1, g_tile, h_next, r0_next, q_len, q_start, args.heads_q,
                    args.total_q, UNIT_POS, head_dim, head_dim_v, SM90_BWD_THREADS, BM, false,
                );
            }
            wait_stage(&bar0, &bar1, cur);
            let qb = ((cur & 1u32) as usize) * comptime!(BM * head_dim);
            let db = ((cur & 1u32) as usize) * comptime!(BM * head_dim_v);
            let lb = ((cur & 1u32) as usize) * BM;
            let rr0 = r0 as i32;

            // ---- 1. S^T = K Q^T (warpgroup 0), dP^T = V dO^T (warpgroup 1) ----
            if wg == 0u32 {
                wgmma_fence();
                key_by_row_steps::<E>(&mut x, &k_smem, 0usize, BN, &q_smem, qb, head_dim, BM);
                wgmma_commit();
                let l2 = lse_ahead(&lse_smem, lb, col_a);
                wgmma_wait(0u32);
                // ---- 2a. P^T, masked unless the block is fully visible; to shared memory ----
                p_transposed(
                    &mut x, &l2, &lse_smem, lb, col_a, key_a, 0usize, kw0, rr0, q_len, k_hi, shift, args.win_l, args.win_r, args.scale_log2, BM,
                );
                #[unroll]
                for i in 0..comptime!(BM / 2) {
                    p_smem[i * WG + t] = x[i];
                }
                pack_a_pairs::<E>(&x, &mut a_regs, comptime!(BM / 4));
            } else {
                wgmma_fence();
                key_by_row_steps::<E>(&mut x, &v_smem, 0usize, BN, &do_smem, db, head_dim_v, BM);
                wgmma_commit();
                wgmma_wait(0u32);
            }
            // P^T stored
            sync_cube();

            if wg == 0u32 {
                // ---- 3. dV += P^T dO ----
                wgmma_fence();
                key_by_dim_steps::<E>(&mut acc, &a_regs, &do_smem, db, head_dim_v, BM);
                wgmma_commit();
                wgmma_wait(0u32);
            } else {
                // ---- 2b. dS^T = P^T (dP^T - delta) (P = 0 where masked: dS = 0 even where dP - delta
                // is not finite); key-major to shared memory for dQ ----
                #[unroll]
                for nb in 0..comptime!(BM / 8) {
                    #[unroll]
                    for e2 in 0..2usize {
                        let dl = dl_smem[lb + nb * 8 + col_a + e2];
                        #[unroll]
                        for hh in 0..2usize {
                            let i = nb * 4 + hh * 2 + e2;
                            let p = p_smem[i * WG + t];
                            x[i] = select(p == 0.0f32, 0.0f32, p * (x[i] - dl));
                        }
                    }
                }
                pack_a_pairs::<E>(&x, &mut a_regs, comptime!(BM / 4));
                if fuse_dq {
                    store_ds_transposed::<E>(&mut ds_smem, 0usize, &a_regs, key_a, col_a, BN, BM);
                }
                // ---- 3. dK += dS^T Q ----
                wgmma_fence();
                key_by_dim_steps::<E>(&mut acc, &a_regs, &q_smem, qb, head_dim, BM);
                wgmma_commit();
                wgmma_wait(0u32);
            }
            // dS^T stored (and, without dQ, every read of this tile's stage ended before the next
            // tile's copies into it are issued)
            sync_cube();

            // ---- 4. dQ[:, 64 p ..] += dS K for this warpgroup's parts, float2 atomics ----
            // rows past the segment's end add 0.0 to a row that exists (the tensor's last at most)
            let last = args.total_q - 1u32;
            #[unroll]
            for pi in 0..comptime!(if fuse_dq { parts.div_ceil(2) } else { 0usize }) {
                let part = wg as usize + 2 * pi;
                if part < parts {
                    wgmma_fence();
                    #[unroll]
                    for ks in 0..comptime!(BN / 16) {
                        let a_off = comptime!(ks * 16 * SW_COLS);
                        let b_off = part * comptime!(BN * SW_COLS) + comptime!(ks * 16 * SW_COLS);
                        wgmma_ss::<E>(
                            &mut dq, &ds_smem, a_off as u32, &k_smem, b_off as u32, 0usize, SW_COLS, true,
                            comptime!((BN * SW_ROW) as u32), true, comptime!((BN * SW_ROW) as u32), comptime!(ks > 0),
                        );
                    }
                    wgmma_commit();
                    wgmma_wait(0u32);
                    #[unroll]
                    for hh in 0..2usize {
                        let rl = r0 + (key_a + hh * 8) as u32;
                        let ok = rl < q_len;
                        let gv = (((min(q_start + rl, last)) * args.heads_q + h) as usize * head_dim + part * SW_COLS + col_a) / qvec;
                        add_dq_row64::<NQ>(&args.dq_acc, &dq, gv, ok, comptime!(hh * 2), qvec);
                    }
                }
            }
            // no barrier here: every read of this tile's stage, lse / delta and P^T ended before the
            // dS^T barrier, and warpgroup 1 writes dS^T again only after the next tile's P^T
            // barrier, which warpgroup 0 reaches after its dQ products
            h = h_next;
            r0 = r0_next;
        }
    }

    // ---- dV (warpgroup 0), dK (warpgroup 1): zero for keys no segment sees ----
    #[unroll]
    for nb in 0..comptime!(head_dim / 8) {
        #[unroll]
        for e in 0..4usize {
            let key = key0 + (key_a + (e / 2) * 8) as u32;
            if key < key_lim {
                let col = nb * 8 + col_a + e % 2;
                let row = (kv_row(key, &args.tq_list, paged) * args.heads_kv + hk) as usize;
                if wg == 0u32 {
                    // dV's first head_dim_v columns
                    if comptime!(nb * 8 < head_dim_v) {
                        args.dv[row * head_dim_v + col] = E::cast_from(acc[nb * 4 + e]);
                    }
                } else {
                    args.dk[row * head_dim + col] = E::cast_from(acc[nb * 4 + e] * args.scale);
                }
            }
        }
    }
}
