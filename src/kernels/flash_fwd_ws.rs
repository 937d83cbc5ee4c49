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
//! The key sets are those of `flash_fwd_sm90` (same card, plan and tile iterator: dense, varlen,
//! GQA packing, grouped, paged, sliding window, block-sparse, split-K partials, LSE), and its INT8
//! Q K^T / FP8 P.V variants (block-sparse, 64-key tiles: `flash_fwd_sm90`'s docs); the V-checking
//! variant (decode-sized calls) stays on `flash_fwd_sm90`.

use cubecl::prelude::barrier::{copy_async, Barrier};
use cubecl::prelude::*;

use super::cards::FwdCard;
use super::flash_fwd::{fill_rows, tile_bounds, work_item, LIST_SMEM, M_INIT, NONE, SLICE_WORDS};
use super::flash_fwd_sm90::{issue_vt_tile, mask_scores, pick_row, pv_steps, pv_steps_e4m3, rescale_o, s_steps, softmax_scores, write_out,
    SM90_BLOCK_M};
use super::fp8_v::vt_col_base;
use super::int8_qk::dot_to_f32;
use super::kv_tiles::{issue_tile_boxes, tile_rows};
use super::sm90::{fence_proxy_async, named_barrier, pack_a_pairs, pack_p_e4m3, setmaxnreg, swizzle_128b, wgmma_commit, wgmma_fence, wgmma_wait,
    SW_COLS};
use super::staging::commit_copies;

/// Threads per cube: a producer warpgroup and two consumer warpgroups.
pub const WS_THREADS: usize = 384;
/// Registers a thread after the moves: 40 x 128 + 232 x 256 = 64512 of the SM's 65536.
const PRODUCER_REGS: u32 = 40;
const CONSUMER_REGS: u32 = 232;
/// Consumer warpgroups (the arrivals an `empty` barrier takes per phase).
const CONSUMERS: u32 = 2;

/// The producer's copies of one K or V tile into stage `kt & 1` (tiles of `tile` elements): waits
/// until the consumers have released the stage's previous use (tile `kt - 2`), raises the `full`
/// barrier's expected bytes, issues the boxes (`cols` elements a row; `vt`: an FP8 V^T tile from
/// byte `col` of its rows, `flash_fwd_sm90::issue_vt_tile`) and arrives. One thread.
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
    col: u32,
    head_kv: u32,
    #[comptime] tile: usize,
    #[comptime] block_n: usize,
    #[comptime] cols: usize,
    #[comptime] vt: bool,
) {
    // use u = kt / 2 of the stage waits for phase u - 1 of its empty barrier
    let parity = ((kt >> 1u32) + 1u32) & 1u32;
    if (kt & 1u32) == 0 {
        if kt >= 2 {
            empty0.wait_parity(parity);
        }
        if vt {
            issue_vt_tile(map, smem, full0, 0usize, col, head_kv, cols);
        } else {
            issue_tile_boxes(map, smem, full0, 0usize, p0, pb, head_kv, block_n, cols, true);
        }
        let _t = full0.arrive_and_expect_tx(1u32, 0u32);
    } else {
        if kt >= 2 {
            empty1.wait_parity(parity);
        }
        if vt {
            issue_vt_tile(map, smem, full1, tile, col, head_kv, cols);
        } else {
            issue_tile_boxes(map, smem, full1, tile, p0, pb, head_kv, block_n, cols, true);
        }
        let _t = full1.arrive_and_expect_tx(1u32, 0u32);
    }
}

/// Waits until stage `kt & 1`'s tile `kt` has landed (phase `(kt / 2) & 1` of its `full` barrier).
#[cube]
fn wait_full(full0: &Barrier, full1: &Barrier, kt: u32) {
    if (kt & 1u32) == 0 {
        full0.wait_parity((kt >> 1u32) & 1u32);
    } else {
        full1.wait_parity((kt >> 1u32) & 1u32);
    }
}

/// One consumer warpgroup's release of stage `kt & 1` (its MMAs that read it have completed):
/// the warpgroup's first thread arrives on the stage's `empty` barrier.
#[cube]
fn release(empty0: &Barrier, empty1: &Barrier, kt: u32, first: bool) {
    if first {
        if (kt & 1u32) == 0 {
            let _t = empty0.arrive_and_expect_tx(1u32, 0u32);
        } else {
            let _t = empty1.arrive_and_expect_tx(1u32, 0u32);
        }
    }
}

/// Tile `kt`'s scores once its S MMAs completed: INT8 dot products to f32 (`int8`), masked and
/// exponentiated in place (`flash_fwd_sm90::softmax_scores`); returns whether O must be rescaled.
#[cube]
#[allow(clippy::too_many_arguments)]
fn finish_scores(
    s: &mut Array<f32>,
    s_i: &Array<i32>,
    m_r: &mut Array<f32>,
    l_r: &mut Array<f32>,
    alpha: &mut Array<f32>,
    sl: &Array<f32>,
    row_lo: &SharedMemory<u32>,
    row_hi: &SharedMemory<u32>,
    row_a: usize,
    row_b: usize,
    t0: u32,
    t1: u32,
    rows_lo: u32,
    rows_hi: u32,
    lane: u32,
    scale_log2: f32,
    neg_inf: f32,
    #[comptime] block_n: usize,
    #[comptime] int8: bool,
    #[comptime] fp8_pv: bool,
) -> bool {
    if int8 {
        #[unroll]
        for i in 0..comptime!(block_n / 2) {
            s[i] = dot_to_f32(s_i[i]);
        }
    }
    mask_scores(s, row_lo, row_hi, row_a, row_b, t0, t1, rows_lo, rows_hi, lane, neg_inf, block_n);
    softmax_scores(s, m_r, l_r, alpha, scale_log2, sl, neg_inf, block_n, int8, fp8_pv)
}

/// INT8: this lane's two factors from tile `[t0, t1)`'s dot products to base-2 scores (its rows' Q
/// scale x `scale_log2` in `q_sl`, times the K scale of the lane's keys: `flash_fwd_sm90`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn int8_factors(k_scales: &Array<f32>, sl: &mut Array<f32>, q_sl: &Array<f32>, t0: u32, t1: u32, lane: u32, heads_kv: u32, head_kv: u32) {
    let key = min(t0 + 2u32 * (lane % 4u32), t1 - 1u32);
    let ks = k_scales[(key * heads_kv + head_kv) as usize];
    #[unroll]
    for i in 0..2usize {
        sl[i] = max(q_sl[i] * ks, 1.175_494_4e-38f32);
    }
}

/// The warp-specialised Hopper forward (module docs); arguments and comptime choices as
/// `flash_fwd_sm90` without its V check. `block_n`: keys per tile (a multiple of 64; 64 with
/// `int8`). `int8` / `fp8_pv`: INT8 Q K^T and FP8 P.V as in `flash_fwd_sm90` (the card's arrays
/// used as there).
#[allow(clippy::too_many_arguments, clippy::eq_op, unused_variables)]
#[cube(launch_unchecked)]
pub fn flash_fwd_ws<E: Float>(
    args: &mut FwdCard<E>,
    #[comptime] head_dim: usize,
    #[comptime] block_n: usize,
    #[comptime] sparse: bool,
    #[comptime] paged: bool,
    #[comptime] int8: bool,
    #[comptime] fp8_pv: bool,
) {
    // v holds a NaN or Inf (`nonfinite::v_nonfinite`): the exact row-wise kernel writes this call
    if args.nonfinite[0] != 0u32 {
        terminate!();
    }
    let threads = comptime!(WS_THREADS);
    let block_m = comptime!(SM90_BLOCK_M);
    let lane = UNIT_POS_PLANE;
    // warp and warpgroup index broadcast from lane 0: uniform, so descriptors stay in uniform registers
    let warp = plane_broadcast(UNIT_POS / 32u32, 0u32);
    let wg = warp / 4u32;

    // elements of E per Q / K row (int8 rows: head_dim bytes) and per K / V tile (FP8 V^T:
    // head_dim rows of block_n bytes)
    let qk_e = comptime!(if int8 { head_dim / 2 } else { head_dim });
    let tile_k = comptime!(block_n * qk_e);
    let tile_v = comptime!(if fp8_pv { block_n * head_dim / 2 } else { block_n * head_dim });
    let mut q_smem = SharedMemory::<E>::new_aligned(comptime!(block_m * qk_e), 1024usize);
    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(2 * tile_k), 1024usize);
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
        args.tiles_per_block, threads, block_n, sparse);
    let (y, head_base, head_kv) = (wi.y, wi.head_base, wi.head_kv);
    let (slice_off, n_slices, klo, khi, slot) = (wi.slice_off, wi.n_slices, wi.klo, wi.khi, wi.slot);
    let (n_tiles, list, tpb_magic) = (wi.n_tiles, wi.list, wi.tpb_magic);
    // FP8 V^T: the item's sequence (block-sparse: one) and its first byte in a V^T row, less its
    // first key (`flash_fwd_sm90`)
    let mut seq = 0u32;
    let mut vt_off = 0u32;
    if fp8_pv {
        seq = args.slices[(slice_off * SLICE_WORDS as u32) as usize];
        let k_start = args.segs[(seq * 4u32 + 2u32) as usize];
        vt_off = vt_col_base(k_start, seq) - k_start;
    }
    fill_rows(
        &args.slices, &args.segs, slice_off, n_slices, args.hp, head_base, klo, khi, &mut row_tok, &mut row_head, &mut row_lo,
        &mut row_hi, args.win_l, args.win_r, threads, block_m,
    );
    sync_cube();

    if wg == 0 {
        // ---- producer: one thread issues every K / V tile, two stages ahead at most ----
        setmaxnreg(false, PRODUCER_REGS);
        if UNIT_POS == 0 {
            for kt in 0..n_tiles {
                let (t0, t1) = tile_bounds(kt, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
                    tpb_magic, block_n, sparse);
                let (p0, _p1, pb) = tile_rows(t0, t1, &args.blocks, paged, block_n);
                produce_tile(&args.k_map, &mut k_smem, &k_full0, &k_full1, &k_empty0, &k_empty1, kt, p0, pb, 0u32, head_kv, tile_k,
                    block_n, qk_e, false);
                produce_tile(&args.v_map, &mut v_smem, &v_full0, &v_full1, &v_empty0, &v_empty1, kt, p0, pb, vt_off + t0, head_kv,
                    tile_v, block_n, head_dim, fp8_pv);
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
        let vecs = comptime!(qk_e / 8);
        #[unroll]
        for it in 0..comptime!(block_m * (qk_e / 8) / 256) {
            let idx = ct as usize + it * 256;
            let r = idx / vecs;
            let c = (idx % vecs) * 8;
            let mut tok = row_tok[r];
            if tok == NONE {
                tok = 0u32;
            }
            let g = (tok * args.heads_q + row_head[r]) as usize * qk_e + c;
            let s = swizzle_128b(r, c, block_m);
            copy_async(&args.q_s.slice(g, g + 8), &mut q_smem.slice_mut(s, s + 8), comptime!(8u32));
        }
        commit_copies(&bar_q);
        bar_q.wait_parity(0u32);
        // every consumer's Q copies visible to the async proxy before any warpgroup's MMA reads them
        fence_proxy_async();
        named_barrier(1u32, 256u32);
    }

    let o_n = comptime!(head_dim / 2);
    let s_n = comptime!(block_n / 2);
    let mut o_acc = Array::<f32>::new(o_n);
    #[unroll]
    for i in 0..o_n {
        o_acc[i] = 0.0f32;
    }
    let mut s = Array::<f32>::new(s_n);
    let mut s_i = Array::<i32>::new(comptime!(if int8 { s_n } else { 1usize }));
    let mut p = Array::<Vector<E, Const<2>>>::new(comptime!(if fp8_pv { 1usize } else { block_n / 4 }));
    let mut p8 = Array::<u32>::new(comptime!(if fp8_pv { block_n / 8 } else { 1usize }));
    let neg_inf = -args.inf;
    let mut m_r = Array::<f32>::new(2usize);
    let mut l_r = Array::<f32>::new(2usize);
    #[unroll]
    for i in 0..2usize {
        m_r[i] = M_INIT;
        l_r[i] = 0.0f32;
    }
    let row_a = prow + (lane / 4u32) as usize;
    let row_b = row_a + 8;
    let rows_lo = max(klo, max(row_lo[row_a], row_lo[row_b]));
    let rows_hi = min(khi, min(row_hi[row_a], row_hi[row_b]));
    let q_wg = cw * comptime!(64 * SW_COLS);
    let mut alpha = Array::<f32>::new(2usize);
    // INT8: each row's Q scale times scale_log2, and per tile this lane's factors (`flash_fwd_sm90`)
    let mut q_sl = Array::<f32>::new(2usize);
    let mut sl = Array::<f32>::new(2usize);
    if int8 {
        #[unroll]
        for i in 0..2usize {
            let tr = pick_row(i, row_a, row_b);
            let tok = row_tok[tr];
            let mut qs = 1.0f32;
            if tok != NONE {
                qs = args.part_lse[(row_head[tr] * args.total_q + tok) as usize];
            }
            q_sl[i] = qs * args.scale_log2;
        }
    }

    if n_tiles > 0 {
        // tile 0: S(0) and its softmax (O is zero: no rescale)
        let (t0, t1) = tile_bounds(0u32, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
            tpb_magic, block_n, sparse);
        wait_full(&k_full0, &k_full1, 0u32);
        wgmma_fence();
        s_steps::<E>(&mut s, &mut s_i, &q_smem, q_wg, &k_smem, 0usize, block_n, head_dim, int8);
        wgmma_commit();
        if int8 {
            int8_factors(&args.part_o, &mut sl, &q_sl, t0, t1, lane, args.heads_kv, head_kv);
        }
        wgmma_wait(0u32);
        release(&k_empty0, &k_empty1, 0u32, first);
        let _m = finish_scores(&mut s, &s_i, &mut m_r, &mut l_r, &mut alpha, &sl, &row_lo, &row_hi, row_a, row_b, t0, t1, rows_lo,
            rows_hi, lane, args.scale_log2, neg_inf, block_n, int8, fp8_pv);
        if fp8_pv {
            pack_p_e4m3(&s, &mut p8, comptime!(block_n / 32));
        } else {
            pack_a_pairs::<E>(&s, &mut p, comptime!(block_n / 4));
        }
    }
    // tile t: S(t) issued, then P(t - 1) V(t - 1); the softmax of S(t) runs while P V does
    for kt in 1..n_tiles {
        let (t0, t1) = tile_bounds(kt, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
            tpb_magic, block_n, sparse);
        let odd = (kt & 1u32) as usize;
        wait_full(&k_full0, &k_full1, kt);
        wgmma_fence();
        s_steps::<E>(&mut s, &mut s_i, &q_smem, q_wg, &k_smem, odd * tile_k, block_n, head_dim, int8);
        wgmma_commit();
        wait_full(&v_full0, &v_full1, kt - 1u32);
        if fp8_pv {
            pv_steps_e4m3::<E>(&mut o_acc, &p8, &v_smem, (1 - odd) * tile_v, block_n, head_dim);
        } else {
            pv_steps::<E>(&mut o_acc, &p, &v_smem, (1 - odd) * tile_v, block_n, head_dim);
        }
        wgmma_commit();
        if int8 {
            int8_factors(&args.part_o, &mut sl, &q_sl, t0, t1, lane, args.heads_kv, head_kv);
        }
        wgmma_wait(1u32);
        release(&k_empty0, &k_empty1, kt, first);
        let moved = finish_scores(&mut s, &s_i, &mut m_r, &mut l_r, &mut alpha, &sl, &row_lo, &row_hi, row_a, row_b, t0, t1, rows_lo,
            rows_hi, lane, args.scale_log2, neg_inf, block_n, int8, fp8_pv);
        wgmma_wait(0u32);
        release(&v_empty0, &v_empty1, kt - 1u32, first);
        if moved {
            rescale_o(&mut o_acc, &alpha, head_dim);
        }
        if fp8_pv {
            pack_p_e4m3(&s, &mut p8, comptime!(block_n / 32));
        } else {
            pack_a_pairs::<E>(&s, &mut p, comptime!(block_n / 4));
        }
    }
    if n_tiles > 0 {
        let last = ((n_tiles - 1u32) & 1u32) as usize * tile_v;
        wait_full(&v_full0, &v_full1, n_tiles - 1u32);
        wgmma_fence();
        if fp8_pv {
            pv_steps_e4m3::<E>(&mut o_acc, &p8, &v_smem, last, block_n, head_dim);
        } else {
            pv_steps::<E>(&mut o_acc, &p, &v_smem, last, block_n, head_dim);
        }
        wgmma_commit();
        wgmma_wait(0u32);
    }

    write_out(args, &o_acc, &m_r, &mut l_r, &row_tok, &mut row_head, prow, row_a, row_b, lane, y, slot, seq, head_kv, neg_inf,
        head_dim, int8, fp8_pv);
}
