//! The Hopper forward of decode-sized calls (at most `forward::FEW_ROWS` rows of one sequence
//! in a tile, e.g. one query row x the GQA group): `flash_fwd_sm90`'s `check_v` mainloop on a
//! cube of one warpgroup (128 threads, a 64-row Q tile: the plan packs 64-row tiles for these
//! calls) with `stages` K / V stages of 64 keys, each with its own mbarrier, at two cubes per SM.
//!
//! Such a call reads K and V once and does few MMAs: its time is the latency of its loads
//! (bench/results/h200-2026-11-30-decode-ncu). `flash_fwd_sm90` runs it on 256-thread cubes whose
//! second warpgroup is idle, with one K and one V tile loading while one is computed. Here tile
//! t + stages is issued into stage t % stages as soon as the cube has finished tile t, so
//! `stages - 1` tiles are loading (`decode_stages`), two cubes per SM. (One 256-thread cube per SM with 5 stages lost: its prologue and epilogue had no
//! other cube to hide under, docs/measured-and-lost.md.)
//!
//! The V check (NaN / Inf sets the call's flag, as `flash_fwd_sm90`'s `check_v`) reads each stage's
//! V tile as 16-byte words and keeps the largest 16-bit magnitude of their halves, tested once at
//! the end.
//!
//! The stage loop is unrolled `stages` times, so each stage's barrier is a compile-time choice.
//! Work list, card, row bounds, paged K / V and the epilogue are `flash_fwd_sm90`'s; split-K
//! partials keep its 128-row slot stride (`combine_parts` reads them unchanged).

use cubecl::prelude::*;
use cubecl::prelude::barrier::Barrier;

use super::cards::FwdCard;
use super::flash_fwd::{fill_rows, rows_key_span, tile_bounds, work_item};
use super::flash_fwd_sm90::{copy_q_tile, lane_rows, pv_steps, score_tile, write_out};
use super::kv_tiles::{issue_tile_boxes, tile_rows};
use super::sm90::{fence_proxy_async, wgmma_commit, wgmma_fence, wgmma_wait};
use super::staging::commit_copies;

/// Keys per tile.
pub const DECODE_BN: usize = 64;
/// Query rows per cube (one warpgroup's wgmma M).
pub const DECODE_BM: usize = 64;
/// Threads per cube: one warpgroup.
pub const DECODE_THREADS: usize = 128;
/// K and V stages at `head_dim`: what two cubes per SM can hold beside their Q tiles. Two cubes
/// need at most 115712 bytes each (228 KiB an SM, 1 KiB reserved a block); CubeCL gives every small
/// buffer (row tables, barriers) a 1 KiB slot, about 9 KiB here, so d128 takes two stages (16 + 64
/// KiB: the one-warpgroup cube alone) and d64 five (8 + 80 KiB). Three at d128 (16 + 96 KiB) would
/// need the small buffers in under 1 KiB (`rewrite::smem_layout`'s tight alignment gets 115776).
pub const fn decode_stages(head_dim: usize) -> usize {
    if head_dim <= 64 {
        5
    } else {
        2
    }
}

/// Waits for the copies of stage `s` (phase parity `parity`).
#[cube]
pub(super) fn wait_stage_n(bars: &Sequence<Shared<Barrier>>, parity: u32, #[comptime] s: usize) {
    bars.index(s).wait_parity(parity);
}

/// Issues K and V of the tile whose rows start at `p0` (`pb`: its second box's first row) into
/// stage `s` on that stage's barrier, and commits this thread's copies to it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn issue_stage<E: Float>(
    args: &FwdCard<E>,
    k_smem: &mut SharedMemory<E>,
    v_smem: &mut SharedMemory<E>,
    bars: &Sequence<Shared<Barrier>>,
    p0: u32,
    pb: u32,
    head_kv: u32,
    #[comptime] s: usize,
    #[comptime] head_dim: usize,
) {
    let base = comptime!(s * DECODE_BN * head_dim);
    let bar = bars.index(s);
    issue_tile_boxes(&args.k_map, k_smem, bar, base, p0, pb, head_kv, DECODE_BN, head_dim, true);
    issue_tile_boxes(&args.v_map, v_smem, bar, base, p0, pb, head_kv, DECODE_BN, head_dim, true);
    commit_copies(bar);
}

/// The decode forward (see the module doc); arguments as `flash_fwd_sm90`'s `check_v` variant.
#[allow(clippy::too_many_arguments, unused_variables)]
#[cube(launch_unchecked)]
pub fn flash_fwd_decode<E: Float>(args: &mut FwdCard<E>, #[comptime] head_dim: usize, #[comptime] paged: bool) {
    // v holds a NaN or Inf (a cube that saw one): the exact row-wise kernel writes this call
    if args.nonfinite[0] != 0u32 {
        terminate!();
    }
    let threads = comptime!(DECODE_THREADS);
    let block_m = comptime!(DECODE_BM);
    let block_n = comptime!(DECODE_BN);
    let stages = comptime!(decode_stages(head_dim));
    let lane = UNIT_POS_PLANE;
    let warp = plane_broadcast(UNIT_POS / 32u32, 0u32);
    // the first row (inside the tile) of this thread's warp
    let prow = (warp * 16u32) as usize;
    let tile_e = comptime!(block_n * head_dim);

    let mut q_smem = SharedMemory::<E>::new_aligned(comptime!(block_m * head_dim), 1024usize);
    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(stages * tile_e), 1024usize);
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(stages * tile_e), 1024usize);
    let mut row_tok = SharedMemory::<u32>::new(block_m);
    let mut row_head = SharedMemory::<u32>::new(block_m);
    let mut row_lo = SharedMemory::<u32>::new(block_m);
    let mut row_hi = SharedMemory::<u32>::new(block_m);
    let mut bars = Sequence::<Shared<Barrier>>::new();
    #[unroll]
    for _s in 0..stages {
        bars.push(Barrier::shared(comptime!(threads as u32), UNIT_POS == 0));
    }

    let mut list_smem = SharedMemory::<u32>::new(1usize);
    let wi = work_item(&args.work, &args.tile_ref, &args.blocks, &mut list_smem, args.heads_q, args.heads_kv, args.hp,
        args.tiles_per_block, threads, block_n, false);
    let (y, head_base, head_kv) = (wi.y, wi.head_base, wi.head_kv);
    let (slice_off, n_slices, klo, slot) = (wi.slice_off, wi.n_slices, wi.klo, wi.slot);
    let (list, tpb_magic) = (wi.list, wi.tpb_magic);

    fill_rows(
        &args.slices, &args.segs, slice_off, n_slices, args.hp, head_base, klo, wi.khi, &mut row_tok, &mut row_head, &mut row_lo,
        &mut row_hi, args.win_l, args.win_r, threads, block_m,
    );
    sync_cube();
    // the key tiles end at the last key a row sees (`flash_fwd_sm90`'s check_v clamp: the plan of
    // a call whose key counts the device writes covers full cache rows, `kv_append`), and start
    // at the first (that plan has no left window bound); paged tiles keep the plan's start, a
    // page's first key
    let mut red = SharedMemory::<u32>::new(comptime!(2 * block_m / 32));
    let (first, end) = rows_key_span(&row_lo, &row_hi, &mut red, block_m);
    let khi = min(wi.khi, end);
    let mut klo = klo;
    if comptime!(!paged) {
        klo = max(klo, first);
    }
    let mut n_tiles = 0u32;
    if khi > klo {
        n_tiles = (khi - klo + block_n as u32 - 1) / block_n as u32;
    }

    // the Q tile (swizzled, 16-byte cp.async per unit, committed with stage 0; rows without a
    // token copy token 0: their key range is empty), and tiles 0 .. stages - 1 into their stages
    if n_tiles > 0u32 {
        copy_q_tile::<E>(&args.q_s, &mut q_smem, &row_tok, &row_head, args.heads_q, UNIT_POS as usize, head_dim, block_m, threads);
        #[unroll]
        for s in 0..stages {
            if (s as u32) < n_tiles {
                let (n0, n1) = tile_bounds(s as u32, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
                    tpb_magic, block_n, false);
                let (p0, _p1, pb) = tile_rows(n0, n1, &args.blocks, paged, block_n);
                issue_stage(args, &mut k_smem, &mut v_smem, &bars, p0, pb, head_kv, s, head_dim);
            }
        }
    }

    let o_n = comptime!(head_dim / 2);
    let mut o_acc = Array::<f32>::new(o_n);
    #[unroll]
    for i in 0..o_n {
        o_acc[i] = 0.0f32;
    }
    let mut s_acc = Array::<f32>::new(comptime!(block_n / 2));
    let mut s_i = Array::<i32>::new(1usize);
    let mut p = Array::<Vector<E, Const<2>>>::new(comptime!(block_n / 4));
    let mut p8 = Array::<u32>::new(1usize);
    let neg_inf = -args.inf;
    let mut m_r = Array::<f32>::new(2usize);
    let mut l_r = Array::<f32>::new(2usize);
    let (row_a, row_b, rows_lo, rows_hi) = lane_rows(&mut m_r, &mut l_r, &row_lo, &row_hi, prow, lane, klo, khi);
    let rows = (row_a, row_b, rows_lo, rows_hi);
    let q_wg = 0usize;
    let mut alpha = Array::<f32>::new(2usize);
    let q_sl = Array::<f32>::new(2usize);
    let mut sl = Array::<f32>::new(2usize);
    // the largest 16-bit magnitude of V's elements seen, as low and high halves of words (NaN and
    // Inf above every finite value of f16 and bf16 alike)
    let mut v_lo = 0u32;
    let mut v_hi = 0u32;

    let rounds = (n_tiles + comptime!(stages as u32 - 1)) / comptime!(stages as u32);
    for r in 0..rounds {
        #[unroll]
        for s in 0..stages {
            let kt = r * comptime!(stages as u32) + comptime!(s as u32);
            if kt < n_tiles {
                let (t0, t1) = tile_bounds(kt, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block, tpb_magic,
                    block_n, false);
                wait_stage_n(&bars, r & 1u32, s);
                if comptime!(s == 0) {
                    if r == 0u32 {
                        // the Q tile's cp.async writes, visible to the MMAs of every thread
                        fence_proxy_async();
                        sync_cube();
                    }
                }
                let cur = comptime!(s * tile_e);
                score_tile::<E>(args, &mut s_acc, &mut s_i, &q_smem, q_wg, &k_smem, cur, head_kv, (t0, t1), &q_sl, &mut sl, &row_lo,
                    &row_hi, rows, lane, neg_inf, &mut m_r, &mut l_r, &mut alpha, &mut o_acc, &mut p, &mut p8, block_n, head_dim,
                    false, false, block_m);
                // every thread folds its share of V(t) into the maxima, 16 bytes a load (as single
                // elements the check was 43% of a tile's instructions: h200-2026-11-30-decode-wg1-ncu)
                #[unroll]
                for i in 0..comptime!(tile_e / (8 * threads)) {
                    let e0 = cur + (UNIT_POS as usize + i * threads) * 8;
                    let w4 = Vector::<u32, Const<4>>::reinterpret(v_smem.slice(e0, e0 + 8).into_vectorized().with_vector_size::<Const<8>>()[0]);
                    #[unroll]
                    for j in 0..4usize {
                        v_lo = max(v_lo, w4[j] & 0x7FFFu32);
                        v_hi = max(v_hi, w4[j] & 0x7FFF_0000u32);
                    }
                }
                wgmma_fence();
                pv_steps::<E>(&mut o_acc, &p, &v_smem, cur, block_n, head_dim);
                wgmma_commit();
                wgmma_wait(0u32);
                // every warp is done with stage s: it takes tile t + stages
                sync_cube();
                let nt = kt + comptime!(stages as u32);
                if nt < n_tiles {
                    let (n0, n1) = tile_bounds(nt, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
                        tpb_magic, block_n, false);
                    let (p0, _p1, pb) = tile_rows(n0, n1, &args.blocks, paged, block_n);
                    issue_stage(args, &mut k_smem, &mut v_smem, &bars, p0, pb, head_kv, s, head_dim);
                }
            }
        }
    }

    // v held a NaN or Inf where the largest magnitude, as a value of E, is one (x - x is not 0)
    let v_max = f32::cast_from(Vector::<E, Const<2>>::reinterpret(max(v_lo, v_hi >> 16u32))[0]);
    if v_max - v_max != 0.0f32 {
        args.nonfinite[0] = 1u32;
    }
    write_out(args, &o_acc, &m_r, &mut l_r, &row_tok, &mut row_head, prow, row_a, row_b, lane, y, slot, 0u32, head_kv, neg_inf, head_dim,
        false, false);
}
