//! The dQ pass on Hopper (sm_90a): `flash_bwd::flash_bwd_dq`'s work (one cube per query tile of
//! [`BWD_BM`] rows and q head, its key tiles of [`BWD_BN`] keys, S and dP recomputed, dQ written
//! once: deterministic) with wgmma instead of `mma.sync`. One cube is one warpgroup: Q and dO of
//! its 64 rows sit in 128-byte-swizzled shared memory, K and V tiles arrive by tensor-map copies
//! into two swizzled stages (a tile past its segment's end by `cp.async`, rows clamped), and per
//! key tile
//!
//! 1. S = Q K^T and dP = dO V^T: `head_dim / 16` wgmma m64n64k16 each, both operands in shared
//!    memory; P = 2^(S scale log2 e - lse log2 e) while dP runs;
//! 2. dS = P (dP - delta) in registers, zero where the key is masked (not P: dP of a masked key may
//!    be non-finite);
//! 3. dQ += dS K: 4 wgmma m64 x head_dim x k16, dS the register A operand (the accumulator layout
//!    of step 1 packed to pairs), K the MN-major B operand read in place (the forward's P V).
//!
//! v may be narrower than q and k (`head_dim_v`, DeepSeek's MLA 192 / 128): dO and V are then v's
//! width and dP = dO V^T runs over `head_dim_v`.
//!
//! The same card, work list, grid and key tiles as `flash_bwd_dq`; two or three cubes an SM hide
//! each other's softmax and waits (96 KiB of shared memory a cube at head_dim 128, 48 at 64).

use cubecl::prelude::barrier::{copy_async, Barrier};
use cubecl::prelude::*;

use super::cards::DqCard;
use super::flash_bwd::{dq_item, dq_next_tile, dq_row, dq_tile};
use super::flash_bwd_sm90::key_by_row_steps;
use super::flash_fwd::LIST_SMEM;
use super::flash_fwd_sm90::pv_steps;
use super::kv_tiles::issue_tile_boxes;
use super::math::fast_exp2;
use super::rows::kv_row;
use super::sm90::{fence_proxy_async, pack_a_pairs, store_pair, swizzle_128b, wgmma_commit, wgmma_fence, wgmma_wait};
use super::staging::{commit_stage, stage_rows, wait_stage};
use super::tiles::{BWD_BM, BWD_BN};

/// Threads per cube: one warpgroup.
pub const DQ_SM90_THREADS: usize = 128;
const _: () = assert!(BWD_BM == 64 && BWD_BN == 64);

/// Window keys `kb..kb + BWD_BN` of K and V into stage `stage & 1` (element `base` of each buffer),
/// for the barrier of that stage: a full tile by tensor-map copies (unit 0 raises the expected
/// bytes), a tile past the segment's end by `cp.async` from every unit with its rows clamped to the
/// segment's last key (their scores are masked). The caller commits. V's rows and stage (element
/// `base_v`) at `head_dim_v`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_stage<E: Float, NV: Size>(
    args: &DqCard<E, NV>,
    k_smem: &mut SharedMemory<E>,
    v_smem: &mut SharedMemory<E>,
    bar0: &Barrier,
    bar1: &Barrier,
    stage: u32,
    kb: u32,
    k_len: u32,
    k_start: u32,
    head_kv: u32,
    #[comptime] head_dim: usize,
    #[comptime] head_dim_v: usize,
    #[comptime] paged: bool,
) {
    let base = ((stage & 1u32) as usize) * comptime!(BWD_BN * head_dim);
    let base_v = ((stage & 1u32) as usize) * comptime!(BWD_BN * head_dim_v);
    if kb + BWD_BN as u32 <= k_len {
        // a tile lies in one page (`issue_kv_tile`)
        let y = kv_row(k_start + kb, &args.blocks, paged);
        if (stage & 1u32) == 0 {
            issue_tile_boxes(&args.k_map, k_smem, bar0, base, y, y, head_kv, BWD_BN, head_dim, true);
            issue_tile_boxes(&args.v_map, v_smem, bar0, base_v, y, y, head_kv, BWD_BN, head_dim_v, true);
        } else {
            issue_tile_boxes(&args.k_map, k_smem, bar1, base, y, y, head_kv, BWD_BN, head_dim, true);
            issue_tile_boxes(&args.v_map, v_smem, bar1, base_v, y, y, head_kv, BWD_BN, head_dim_v, true);
        }
    } else {
        kv_rows_async(&args.k_s, k_smem, base, kb, k_len, k_start, args.heads_kv, head_kv, &args.blocks, head_dim, paged);
        kv_rows_async(&args.v_s, v_smem, base_v, kb, k_len, k_start, args.heads_kv, head_kv, &args.blocks, head_dim_v, paged);
    }
}

/// `cp.async` copies of window keys `kb..kb + BWD_BN` of kv head `head_kv` (`width` columns a head;
/// rows clamped to the segment's last key, `k_len - 1`; through the page table `pages` when
/// `paged`) into the swizzled stage at element `base` of `smem`, by every unit.
#[cube]
#[allow(clippy::too_many_arguments)]
fn kv_rows_async<E: Float>(
    src: &Array<E>,
    smem: &mut SharedMemory<E>,
    base: usize,
    kb: u32,
    k_len: u32,
    k_start: u32,
    heads_kv: u32,
    head_kv: u32,
    pages: &Array<u32>,
    #[comptime] width: usize,
    #[comptime] paged: bool,
) {
    let vecs = comptime!(width / 8);
    #[unroll]
    for it in 0..comptime!(BWD_BN * (width / 8) / DQ_SM90_THREADS) {
        let idx = UNIT_POS as usize + it * DQ_SM90_THREADS;
        let r = idx / vecs;
        let c = (idx % vecs) * 8;
        let key = min(kb + r as u32, k_len - 1u32);
        let g = (kv_row(k_start + key, pages, paged) * heads_kv + head_kv) as usize * width + c;
        let s = base + swizzle_128b(r, c, BWD_BN);
        copy_async(&src.slice(g, g + 8), &mut smem.slice_mut(s, s + 8), comptime!(8u32));
    }
}

/// dS = P (dP - delta) in place of P (`s`) for the lane's two rows, `rows` = (delta, key limit,
/// window start) of rows a and b; `masked`: zero where the key (`key0` + the lane's column) is at
/// or past the row's limit or, with `window`, before its start.
#[cube]
fn ds_tile(s: &mut Array<f32>, dp: &Array<f32>, rows: (f32, f32, i32, i32, i32, i32), key0: u32, #[comptime] window: bool,
    #[comptime] masked: bool) {
    let (dl_a, dl_b, la, lb, lo_a, lo_b) = rows;
    #[unroll]
    for nb in 0..comptime!(BWD_BN / 8) {
        #[unroll]
        for hh in 0..2usize {
            let dd = if comptime!(hh == 0) { dl_a } else { dl_b };
            let lim = if comptime!(hh == 0) { la } else { lb };
            let lo = if comptime!(hh == 0) { lo_a } else { lo_b };
            #[unroll]
            for e2 in 0..2usize {
                let i = nb * 4 + hh * 2 + e2;
                if comptime!(masked) {
                    let key = key0 as i32 + comptime!((nb * 8 + e2) as i32);
                    let out = key >= lim || (window && key < lo);
                    s[i] = select(out, 0.0f32, s[i] * (dp[i] - dd));
                } else {
                    s[i] = s[i] * (dp[i] - dd);
                }
            }
        }
    }
}

/// The Hopper dQ pass (module docs). Grid and card as `flash_bwd::flash_bwd_dq`; [`DQ_SM90_THREADS`]
/// units; `head_dim` a multiple of 64, `head_dim_v` (v's and dO's) too, at most `head_dim`.
#[allow(clippy::too_many_arguments, unused_assignments)]
#[cube(launch_unchecked)]
pub fn flash_bwd_dq_sm90<E: Float, NV: Size>(
    args: &mut DqCard<E, NV>,
    #[comptime] head_dim: usize,
    #[comptime] head_dim_v: usize,
    #[comptime] sparse: bool,
    #[comptime] window: bool,
    #[comptime] paged: bool,
) {
    let lane = UNIT_POS_PLANE;
    let warp = plane_broadcast(UNIT_POS / 32u32, 0u32);
    let tile_e = comptime!(BWD_BN * head_dim);
    let tile_v = comptime!(BWD_BN * head_dim_v);
    let mut q_smem = SharedMemory::<E>::new_aligned(comptime!(BWD_BM * head_dim), 1024usize);
    let mut do_smem = SharedMemory::<E>::new_aligned(comptime!(BWD_BM * head_dim_v), 1024usize);
    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(2 * tile_e), 1024usize);
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(2 * tile_v), 1024usize);
    let bar0 = Barrier::shared(comptime!(DQ_SM90_THREADS as u32), UNIT_POS == 0);
    let bar1 = Barrier::shared(comptime!(DQ_SM90_THREADS as u32), UNIT_POS == 0);

    let mut list_smem = SharedMemory::<u32>::new(comptime!(if sparse { LIST_SMEM } else { 1usize }));
    let it = dq_item(args, &mut list_smem, sparse);
    let (tile_start, q_start, q_len, k_start, k_len, row_end) = (it.tile_start, it.q_start, it.q_len, it.k_start, it.k_len, it.row_end);
    let (n_tiles, head, head_kv) = (it.n_tiles, it.head, it.head_kv);

    // barrier initialisation and the staged list visible; key tile 0 into stage 0 while Q and dO
    // are staged
    sync_cube();
    if n_tiles > 0 {
        let (f0, _f1) = dq_tile(args, &it, &list_smem, 0u32, sparse);
        load_stage(args, &mut k_smem, &mut v_smem, &bar0, &bar1, 0u32, f0, k_len, k_start, head_kv, head_dim, head_dim_v, paged);
        commit_stage(&bar0, &bar1, 0u32);
    }
    // Q and dO of the tile's rows (zero past the segment's end), swizzled
    stage_rows::<E, NV>(&args.q, &mut q_smem, tile_start, q_len, q_start + tile_start, args.heads_q, head, &args.segs, BWD_BM,
        head_dim, DQ_SM90_THREADS, false, true);
    stage_rows::<E, NV>(&args.dout, &mut do_smem, tile_start, q_len, q_start + tile_start, args.heads_q, head, &args.segs, BWD_BM,
        head_dim_v, DQ_SM90_THREADS, false, true);
    fence_proxy_async();
    sync_cube();

    // this lane's rows (accumulator rows 16 warp + lane / 4 and + 8) and first column pair
    let rl_a = tile_start + warp * 16u32 + lane / 4u32;
    let rl_b = rl_a + 8u32;
    let col_a = (lane % 4u32) * 2u32;
    let ra = dq_row(args, &it, rl_a);
    let rb = dq_row(args, &it, rl_b);
    let (lo_a, lim_a, lse_a, dl_a) = (ra.lo, ra.lim, ra.lse2, ra.dl);
    let (lo_b, lim_b, lse_b, dl_b) = (rb.lo, rb.lim, rb.lse2, rb.dl);

    let dq_n = comptime!(head_dim / 2);
    let mut dq = Array::<f32>::new(dq_n);
    #[unroll]
    for i in 0..dq_n {
        dq[i] = 0.0f32;
    }
    let mut s = Array::<f32>::new(comptime!(BWD_BN / 2));
    let mut dp = Array::<f32>::new(comptime!(BWD_BN / 2));
    let mut ds = Array::<Vector<E, Const<2>>>::new(comptime!(BWD_BN / 4));

    for kt in 0..n_tiles {
        let (kb, kb_end) = dq_tile(args, &it, &list_smem, kt, sparse);
        // every warp has finished tile kt - 1 (its MMAs waited for): its stage takes tile kt + 1
        sync_cube();
        if kt + 1u32 < n_tiles {
            let next = dq_next_tile(args, &it, &list_smem, kt, kb, sparse);
            load_stage(args, &mut k_smem, &mut v_smem, &bar0, &bar1, kt + 1u32, next, k_len, k_start, head_kv, head_dim, head_dim_v,
                paged);
            commit_stage(&bar0, &bar1, kt + 1u32);
        }
        wait_stage(&bar0, &bar1, kt);
        if kb + BWD_BN as u32 > k_len {
            // the tile came by cp.async (generic proxy)
            fence_proxy_async();
        }
        let base = ((kt & 1u32) as usize) * tile_e;
        let base_v = ((kt & 1u32) as usize) * tile_v;

        // ---- 1. S = Q K^T, dP = dO V^T; P while dP runs ----
        wgmma_fence();
        key_by_row_steps::<E>(&mut s, &q_smem, 0usize, BWD_BM, &k_smem, base, head_dim, BWD_BN);
        wgmma_commit();
        key_by_row_steps::<E>(&mut dp, &do_smem, 0usize, BWD_BM, &v_smem, base_v, head_dim_v, BWD_BN);
        wgmma_commit();
        wgmma_wait(1u32);
        #[unroll]
        for nb in 0..comptime!(BWD_BN / 8) {
            #[unroll]
            for hh in 0..2usize {
                let l = if comptime!(hh == 0) { lse_a } else { lse_b };
                #[unroll]
                for e2 in 0..2usize {
                    let i = nb * 4 + hh * 2 + e2;
                    s[i] = fast_exp2(s[i] * args.scale_log2 - l);
                }
            }
        }
        wgmma_wait(0u32);

        // ---- 2. dS = P (dP - delta), zero where masked ----
        let mut la = lim_a;
        let mut lb = lim_b;
        if sparse {
            // a tile cut at its key block's end masks the keys past it too
            la = min(lim_a, kb_end as i32);
            lb = min(lim_b, kb_end as i32);
        }
        let chunk_end = (kb + BWD_BN as u32) as i32;
        let mut needs_mask = chunk_end > la || chunk_end > lb;
        if window {
            needs_mask = needs_mask || (kb as i32) < lo_a || (kb as i32) < lo_b;
        }
        // two copies of the loop: inside one, ptxas if-converted the mask (a compare and a select
        // an element on every tile, ncu: 17% of the pass's instructions)
        let rows = (dl_a, dl_b, la, lb, lo_a, lo_b);
        if needs_mask {
            ds_tile(&mut s, &dp, rows, kb + col_a, window, true);
        } else {
            ds_tile(&mut s, &dp, rows, kb + col_a, window, false);
        }
        pack_a_pairs::<E>(&s, &mut ds, comptime!(BWD_BN / 4));

        // ---- 3. dQ += dS K ----
        wgmma_fence();
        pv_steps::<E>(&mut dq, &ds, &k_smem, base, BWD_BN, head_dim);
        wgmma_commit();
        wgmma_wait(0u32);
    }

    // ---- dQ = scale * acc, rows before the cube's end ----
    #[unroll]
    for nb in 0..comptime!(head_dim / 8) {
        #[unroll]
        for hh in 0..2usize {
            let rl = if comptime!(hh == 0) { rl_a } else { rl_b };
            if rl < row_end {
                let g = ((q_start + rl) * args.heads_q + head) as usize * head_dim + comptime!(nb * 8) + col_a as usize;
                let i = nb * 4 + hh * 2;
                store_pair::<E>(&mut args.dq, g, dq[i] * args.scale, dq[i + 1] * args.scale);
            }
        }
    }
}
