//! The warp-specialised Hopper forward frame (sm_90a): `flash_fwd_sm90`'s mainloop pieces (S = Q
//! K^T and P V by wgmma over 128-byte-swizzled tiles, the masked online softmax, the epilogue) in
//! FlashAttention-3's frame instead of one where every warpgroup issues copies and meets the others
//! at a cube barrier per tile.
//!
//! One cube = 128 packed rows, 384 threads: warpgroup 0 is the producer (`setmaxnreg.dec`; one
//! thread issues the tensor-map copies of K(t) and V(t) into two stages each), warpgroups 1 and 2
//! the consumers (`setmaxnreg.inc`; 64 rows each). Each stage has a `full` mbarrier (the producer's
//! arrival with the tile's bytes; the consumers wait on it) and an `empty` one (one arrival per
//! consumer warpgroup once its MMAs have read the stage; the producer waits on it before reusing
//! the stage), so no cube-wide barrier stands in the tile loop. A consumer overlaps inside its
//! warpgroup: per tile t it issues S(t), then P(t - 1) V(t - 1), waits for S(t) only, masks and
//! exponentiates it while P V runs, then waits for P V and rescales O. Nothing stays in flight
//! across the loop's back edge (ptxas would serialise every wgmma of the loop, docs/backward.md).
//!
//! v may have a head_dim of its own, narrower than q's and k's (`head_dim_v`, DeepSeek's MLA 192 /
//! 128): V's tiles, P V and O are then as wide as v, so a 192 / 128 call pays for 128 columns of
//! P V, not 192, and its narrower V stages leave room for 128-key tiles.
//!
//! The key sets are those of `flash_fwd_sm90` (same card, plan and tile iterator: dense, varlen,
//! GQA packing, grouped, paged, sliding window, block-sparse, split-K partials, LSE); the INT8 /
//! FP8 variants (on this frame with their 64-key tiles they lost: docs/measured-and-lost.md) and
//! the V-checking one (decode-sized calls) stay on `flash_fwd_sm90`.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::cards::FwdCard;
use super::flash_fwd::{fill_rows, tile_bounds, work_item, LIST_SMEM};
use super::flash_fwd_sm90::{copy_q_tile, lane_rows, mask_scores, pv_steps, rescale_o, s_steps, softmax_scores, write_out, SM90_BLOCK_M};
use super::kv_tiles::{issue_tile_boxes, tile_rows};
use super::sm90::{fence_proxy_async, named_barrier, pack_a_pairs, setmaxnreg, wgmma_commit, wgmma_fence, wgmma_wait,
    SW_COLS};
use super::staging::{commit_copies, wait_free, wait_stage};

/// Threads per cube: a producer warpgroup and two consumer warpgroups.
pub const WS_THREADS: usize = 384;
/// Registers a thread after the moves: 24 x 128 + 240 x 256 = 64512 of the SM's 65536 (FA3's split
/// for two consumer warpgroups; the producer's loop needs no more: no spills).
pub(super) const PRODUCER_REGS: u32 = 24;
pub(super) const CONSUMER_REGS: u32 = 240;
/// Consumer warpgroups (the arrivals an `empty` barrier takes per phase).
const CONSUMERS: u32 = 2;

/// The producer's copies of one K or V tile into stage `kt & 1`: waits until the consumers have
/// released the stage's previous use (tile `kt - 2`), raises the `full` barrier's expected bytes,
/// issues the boxes and arrives. One thread.
#[cube]
#[allow(clippy::too_many_arguments)]
fn produce_tile<E: Float>(
    map: &TensorMap<E, Tiled>,
    smem: &mut SharedMemory<E>,
    full0: &Barrier,
    full1: &Barrier,
    empty0: &Barrier,
    empty1: &Barrier,
    kt: u32,
    p0: u32,
    pb: u32,
    head_kv: u32,
    #[comptime] block_n: usize,
    #[comptime] head_dim: usize,
) {
    let tile = comptime!(block_n * head_dim);
    wait_free(empty0, empty1, kt);
    if (kt & 1u32) == 0 {
        issue_tile_boxes(map, smem, full0, 0usize, p0, pb, head_kv, block_n, head_dim, true);
        let _t = full0.arrive_and_expect_tx(1u32, 0u32);
    } else {
        issue_tile_boxes(map, smem, full1, tile, p0, pb, head_kv, block_n, head_dim, true);
        let _t = full1.arrive_and_expect_tx(1u32, 0u32);
    }
}

/// One consumer warpgroup's release of stage `kt & 1` (its MMAs that read it have completed):
/// the warpgroup's first thread arrives on the stage's `empty` barrier.
#[cube]
pub(super) fn release(empty0: &Barrier, empty1: &Barrier, kt: u32, first: bool) {
    if first {
        if (kt & 1u32) == 0 {
            let _t = empty0.arrive_and_expect_tx(1u32, 0u32);
        } else {
            let _t = empty1.arrive_and_expect_tx(1u32, 0u32);
        }
    }
}

/// The warp-specialised Hopper forward (module docs); arguments and comptime choices as
/// `flash_fwd_sm90` without its INT8 / FP8 / V-check variants. `block_n`: keys per tile (a
/// multiple of 64). `head_dim_v`: v's and out's head_dim (a multiple of 64, at most `head_dim`;
/// DeepSeek's MLA: 192 / 128): the V tiles, P V's N, O and the epilogue at v's width, Q and K at
/// `head_dim`.
#[allow(clippy::too_many_arguments, clippy::eq_op, unused_variables)]
#[cube(launch_unchecked)]
pub fn flash_fwd_ws<E: Float>(
    args: &mut FwdCard<E>,
    #[comptime] head_dim: usize,
    #[comptime] head_dim_v: usize,
    #[comptime] block_n: usize,
    #[comptime] sparse: bool,
    #[comptime] paged: bool,
) {
    // v holds a NaN or Inf (`nonfinite::v_nonfinite`): the exact row-wise kernel writes this call.
    // The flag is tested after the work item's and the rows' loads, so its load overlaps theirs
    let flag = args.nonfinite[0];
    let threads = comptime!(WS_THREADS);
    let block_m = comptime!(SM90_BLOCK_M);
    let lane = UNIT_POS_PLANE;
    // warp and warpgroup index broadcast from lane 0: uniform, so descriptors stay in uniform registers
    let warp = plane_broadcast(UNIT_POS / 32u32, 0u32);
    let wg = warp / 4u32;

    let tile_e = comptime!(block_n * head_dim);
    let tile_v = comptime!(block_n * head_dim_v);
    let mut q_smem = SharedMemory::<E>::new_aligned(comptime!(block_m * head_dim), 1024usize);
    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(2 * tile_e), 1024usize);
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(2 * tile_v), 1024usize);
    let mut row_tok = SharedMemory::<u32>::new(block_m);
    let mut row_head = SharedMemory::<u32>::new(block_m);
    let mut row_lo = SharedMemory::<u32>::new(block_m);
    let mut row_hi = SharedMemory::<u32>::new(block_m);
    // Q: the consumers' cp.async copies; K, V: per stage full (producer) and empty (consumers)
    let bar_q = Barrier::shared(comptime!((threads - 128) as u32), UNIT_POS == 0);
    let k_full0 = Barrier::shared(1u32, UNIT_POS == 0);
    let k_full1 = Barrier::shared(1u32, UNIT_POS == 0);
    let v_full0 = Barrier::shared(1u32, UNIT_POS == 0);
    let v_full1 = Barrier::shared(1u32, UNIT_POS == 0);
    let k_empty0 = Barrier::shared(CONSUMERS, UNIT_POS == 0);
    let k_empty1 = Barrier::shared(CONSUMERS, UNIT_POS == 0);
    let v_empty0 = Barrier::shared(CONSUMERS, UNIT_POS == 0);
    let v_empty1 = Barrier::shared(CONSUMERS, UNIT_POS == 0);

    let mut list_smem = SharedMemory::<u32>::new(comptime!(if sparse { LIST_SMEM } else { 1usize }));
    let wi = work_item(&args.work, &args.tile_ref, &args.blocks, &mut list_smem, args.heads_q, args.heads_kv, args.hp,
        args.tiles_per_block, args.kv_outer, threads, block_n, sparse);
    let (y, head_base, head_kv) = (wi.y, wi.head_base, wi.head_kv);
    let (slice_off, n_slices, klo, khi, slot) = (wi.slice_off, wi.n_slices, wi.klo, wi.khi, wi.slot);
    let (n_tiles, list, tpb_magic) = (wi.n_tiles, wi.list, wi.tpb_magic);
    fill_rows(
        &args.slices, &args.segs, slice_off, n_slices, args.hp, head_base, klo, khi, &mut row_tok, &mut row_head, &mut row_lo,
        &mut row_hi, args.win_l, args.win_r, threads, block_m,
    );
    if flag != 0u32 {
        terminate!();
    }
    sync_cube();

    if wg == 0 {
        // ---- producer: one thread issues every K / V tile, two stages ahead at most ----
        setmaxnreg(false, PRODUCER_REGS);
        if UNIT_POS == 0 {
            for kt in 0..n_tiles {
                let (t0, t1) = tile_bounds(kt, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
                    tpb_magic, block_n, sparse);
                let (p0, _p1, pb) = tile_rows(t0, t1, &args.blocks, paged, block_n);
                produce_tile(&args.k_map, &mut k_smem, &k_full0, &k_full1, &k_empty0, &k_empty1, kt, p0, pb, head_kv, block_n, head_dim);
                produce_tile(&args.v_map, &mut v_smem, &v_full0, &v_full1, &v_empty0, &v_empty1, kt, p0, pb, head_kv, block_n, head_dim_v);
            }
        }
        terminate!();
    }

    // ---- consumers: warpgroup cw of rows cw * 64 .. ----
    setmaxnreg(true, CONSUMER_REGS);
    let cw = (wg - 1u32) as usize;
    let ct = cw as u32 * 128u32 + UNIT_POS % 128u32;
    let first = ct % 128u32 == 0u32;
    let prow = cw * 64 + ((warp % 4u32) * 16u32) as usize;
    if n_tiles > 0 {
        // the Q tile (swizzled; rows without a token copy token 0: their key range is empty)
        copy_q_tile::<E>(&args.q_s, &mut q_smem, &row_tok, &row_head, args.heads_q, ct as usize, head_dim, block_m, 256usize);
        commit_copies(&bar_q);
        bar_q.wait_parity(0u32);
        // every consumer's Q copies visible to the async proxy before any warpgroup's MMA reads them
        fence_proxy_async();
        named_barrier(1u32, 256u32);
    }

    let o_n = comptime!(head_dim_v / 2);
    let s_n = comptime!(block_n / 2);
    let mut o_acc = Array::<f32>::new(o_n);
    #[unroll]
    for i in 0..o_n {
        o_acc[i] = 0.0f32;
    }
    let mut s = Array::<f32>::new(s_n);
    let mut s_i = Array::<i32>::new(1usize);
    let mut p = Array::<Vector<E, Const<2>>>::new(comptime!(block_n / 4));
    let neg_inf = -args.inf;
    let mut m_r = Array::<f32>::new(2usize);
    let mut l_r = Array::<f32>::new(2usize);
    let (row_a, row_b, rows_lo, rows_hi) = lane_rows(&mut m_r, &mut l_r, &row_lo, &row_hi, prow, lane, klo, khi);
    let q_wg = cw * comptime!(64 * SW_COLS);
    let mut alpha = Array::<f32>::new(2usize);
    let sl = Array::<f32>::new(2usize);

    if n_tiles > 0 {
        // tile 0: S(0) and its softmax (O is zero: no rescale)
        let (t0, t1) = tile_bounds(0u32, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
            tpb_magic, block_n, sparse);
        wait_stage(&k_full0, &k_full1, 0u32);
        wgmma_fence();
        s_steps::<E>(&mut s, &mut s_i, &q_smem, q_wg, &k_smem, 0usize, block_n, head_dim, false, SM90_BLOCK_M);
        wgmma_commit();
        wgmma_wait(0u32);
        release(&k_empty0, &k_empty1, 0u32, first);
        mask_scores(&mut s, &row_lo, &row_hi, row_a, row_b, t0, t1, rows_lo, rows_hi, lane, neg_inf, block_n);
        let _m = softmax_scores(&mut s, &mut m_r, &mut l_r, &mut alpha, args.scale_log2, &sl, neg_inf, block_n, false, false);
        pack_a_pairs::<E>(&s, &mut p, comptime!(block_n / 4));
    }
    // tile t: S(t) issued, then P(t - 1) V(t - 1); the softmax of S(t) runs while P V does
    for kt in 1..n_tiles {
        let (t0, t1) = tile_bounds(kt, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
            tpb_magic, block_n, sparse);
        let cur = ((kt & 1u32) as usize) * tile_e;
        // V(t - 1)'s stage
        let prev = tile_v - ((kt & 1u32) as usize) * tile_v;
        wait_stage(&k_full0, &k_full1, kt);
        wgmma_fence();
        s_steps::<E>(&mut s, &mut s_i, &q_smem, q_wg, &k_smem, cur, block_n, head_dim, false, SM90_BLOCK_M);
        wgmma_commit();
        wait_stage(&v_full0, &v_full1, kt - 1u32);
        pv_steps::<E>(&mut o_acc, &p, &v_smem, prev, block_n, head_dim_v);
        wgmma_commit();
        wgmma_wait(1u32);
        release(&k_empty0, &k_empty1, kt, first);
        mask_scores(&mut s, &row_lo, &row_hi, row_a, row_b, t0, t1, rows_lo, rows_hi, lane, neg_inf, block_n);
        let moved = softmax_scores(&mut s, &mut m_r, &mut l_r, &mut alpha, args.scale_log2, &sl, neg_inf, block_n, false, false);
        wgmma_wait(0u32);
        release(&v_empty0, &v_empty1, kt - 1u32, first);
        if moved {
            rescale_o(&mut o_acc, &alpha, head_dim_v);
        }
        pack_a_pairs::<E>(&s, &mut p, comptime!(block_n / 4));
    }
    if n_tiles > 0 {
        let last = n_tiles - 1u32;
        wait_stage(&v_full0, &v_full1, last);
        wgmma_fence();
        pv_steps::<E>(&mut o_acc, &p, &v_smem, ((last & 1u32) as usize) * tile_v, block_n, head_dim_v);
        wgmma_commit();
        wgmma_wait(0u32);
    }

    write_out(args, &o_acc, &m_r, &mut l_r, &row_tok, &mut row_head, prow, row_a, row_b, lane, y, slot, 0u32, head_kv, neg_inf,
        &mut q_smem, cw * 64, ct % 128u32, head_dim_v, false, false, true);
}
