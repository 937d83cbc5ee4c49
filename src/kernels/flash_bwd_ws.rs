//! The warp-specialised Hopper dK / dV kernel (sm_90a): `flash_bwd_sm90`'s mainloop (S^T / dP^T by
//! wgmma with shared operands, P^T / dS^T in registers, dV / dK with them as the register A
//! operand, the fused dQ = dS K) in FlashAttention-3's producer / consumer frame instead of one where
//! both warpgroups issue the copies and the dQ bulk adds and meet at two cube barriers per tile.
//!
//! One cube = 128 keys, 384 threads. Warpgroup 0 is the producer (`setmaxnreg.dec`): its warp 0
//! issues every query tile (Q, dO by tensor maps; a tile past its segment's end by `cp.async` with
//! rows clamped; lse / delta by `cp.async`) into two stages, each with a `full` mbarrier (the
//! warp's 32 copy arrivals plus the tile's bytes) and an `empty` one (every consumer thread's
//! arrival once its warpgroup's MMAs have read the stage: each thread's own reads of lse / delta
//! come before it; one arrival per warpgroup was a race, compute-sanitizer racecheck); its warp 1
//! (fused dQ) waits for each tile's dQ, adds its live rows to the head-major f32 accumulator by one
//! bulk reduce-add (lane 0) and frees the tile's buffer (two dQ buffers: tile j in buffer j % 2, so
//! the consumers store tile j + 1 while the copy engine reads tile j). Warpgroups 1 and 2 are the consumers
//! (`setmaxnreg.inc`, 64 keys each, dK and dV in registers). Per query tile a consumer: waits for
//! the stage; S^T, dP^T; P^T, dS^T; dV += P^T dO, dK += dS^T Q; (fused dQ) stores dS^T key-major
//! into one of two buffers, meets the other consumer at a named barrier, forms its half of dQ's
//! columns, releases the stage, waits until the dQ buffer is free, stores its half (16-byte chunks
//! swizzled by row, as the accumulator holds them) and arrives on the buffer's `dq_full`. So the only barrier
//! between the consumers is the named one that publishes dS^T, and no consumer waits for a copy it
//! issued itself.
//!
//! The host plan, card (`cards::DkdvCard`), work list, segments and query-tile walk (dense, varlen,
//! GQA, grouped windows, paged K/V, block-sparse through the transposed index) are
//! `flash_bwd_sm90`'s. The default at head_dim 128 and 64 (`backend::cuda::backward::ws_backward`;
//! block-sparse calls with the fused dQ at 64 keep `flash_bwd_sm90`); a variant whose consumers did
//! not meet per tile lost (docs/backward.md).
//!
//! Query tiles are 64 rows, except at head_dim 64 on a dense call: there a tile is [`WIDE_BM`] =
//! 128 rows (`backward::ws_rows`), so each consumer's S^T / dP^T are m64n128 and dV / dK take 8
//! k-steps a tile, for the same per-tile waits, lse / delta reads and masks (without dQ 3-5% less
//! fwd+bwd time, bench/results/h200-2026-11-30-ws-rows128). With the fused dQ each consumer then
//! forms all columns of its 64 rows of dQ (from its chunk of the key-major dS^T, both consumers'
//! keys), and the dQ tile has one buffer (two would pass 227 KiB): a consumer stores tile t once
//! the dQ warp has read tile t - 1 (bench/results/h200-2026-11-30-fused-d64: 0-6% less fwd+bwd
//! time than the ws kernel without dQ plus the dQ pass at 8K / 16K).

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::bulk_reduce::put_dq_pair;
use super::bwd_walk::{first_q_tile, key_item, next_q_tile, seg_walk, KeyItem, SegWalk};
use super::cards::DkdvCard;
// registers a thread after the moves: the forward frame's split (24 x 128 + 240 x 256)
use super::flash_fwd_ws::{release, CONSUMER_REGS, PRODUCER_REGS};
use super::flash_bwd_sm90::{
    ds_transposed, dq_steps, issue_q_tile, key_by_dim_steps, key_by_row_steps, lse_ahead, p_transposed, store_ds_transposed,
};
use super::grid::cube_item_slot;
use super::rows::kv_row;
use super::sm90::{
    bulk_add_f32, copy16_out, fence_proxy_async, named_barrier, named_barrier_at, pack_a_pairs, setmaxnreg, store_pair_shared,
    swizzle_128b, wgmma_commit, wgmma_fence, wgmma_wait, SW_COLS,
};
use super::staging::{stage_rows, wait_free, wait_stage};
use super::tiles::{BWD_BM, WIDE_BN};

/// Threads per cube: a producer warpgroup and two consumer warpgroups.
pub const BWD_WS_THREADS: usize = 384;
/// Keys per consumer warpgroup.
const WG_KEYS: usize = 64;
const BN: usize = WIDE_BN;
/// Query rows a tile (the block-sparse walk's and head_dim 128's).
const BM: usize = BWD_BM;
const _: () = assert!(BN == 2 * WG_KEYS && BM == 64);
/// Query rows a tile at head_dim 64 on a dense call: twice the products per tile's fixed cost
/// (waits, lse / delta, masks) of 64-row tiles. With the fused dQ each consumer forms dQ for its
/// 64 of the rows and every column (at 64 rows each forms half the columns).
pub const WIDE_BM: usize = 128;

/// dQ tile buffers of a fused kernel with `bm`-row tiles: two (the consumers store tile t + 1 while
/// the copy engine reads tile t), one at [`WIDE_BM`] (two would take the kernel past 227 KiB of
/// shared memory; a consumer then stores tile t once the dQ warp has read tile t - 1).
const fn dq_buffers(bm: usize) -> usize {
    if bm > BM {
        1
    } else {
        2
    }
}
/// The producer's loading warp: its 32 lanes' copy arrivals complete a `full` phase.
const LOADERS: usize = 32;
/// Consumer threads (the `empty` and `dq_full` arrivals, the named barrier's count).
const CONSUMER_THREADS: u32 = 256;
/// The named barrier that publishes both consumers' dS^T halves.
const DS_BARRIER: u32 = 1;

/// Segment `si` of the walk of a cube of `bn` keys for kv head `hk`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn walk<E: Float, NV: Size, NQ: Size>(
    args: &DkdvCard<E, NV, NQ>,
    ki: &KeyItem,
    si: u32,
    hk: u32,
    group: u32,
    #[comptime] sparse: bool,
    #[comptime] bn: usize,
    #[comptime] bm: usize,
) -> SegWalk {
    seg_walk(
        &args.segs, &args.tile_segs, &args.tq_off, ki, si, bn as u32, hk, args.heads_kv, group, args.idx_heads,
        args.k_blocks, args.q_tiles_per_block, args.win_l, args.win_r, sparse, bm,
    )
}

/// The query tiles of this cube's walk (every segment's `n_it`): the dQ warp's loop bound.
#[cube]
pub(super) fn count_tiles<E: Float, NV: Size, NQ: Size>(
    args: &DkdvCard<E, NV, NQ>,
    ki: &KeyItem,
    hk: u32,
    #[comptime] sparse: bool,
    #[comptime] bn: usize,
    #[comptime] bm: usize,
) -> u32 {
    let group = args.heads_q / args.heads_kv;
    let mut n = 0u32;
    for si in ki.s_begin..ki.s_end {
        let sw = walk(args, ki, si, hk, group, sparse, bn, bm);
        n += sw.n_it;
    }
    n
}

/// The dQ warp's addition of stored tile `j` (buffer `j % 2`): its first `rows` rows (global rows
/// `first_row ..` of q head `h`) added to the head-major f32 accumulator (`[heads_q, total_q,
/// head_dim]`, where they are contiguous) by one bulk reduce-add of lane 0 (64 row adds of the
/// row-major accumulator took 7-9% more fwd+bwd time: docs/backward.md). `rows` 0: nothing to add.
/// Once the copy engine has read the buffer it is free again (`dq_empty` of its parity).
/// `buf_elems`: f32 elements from buffer 0 to buffer 1 (0: one buffer).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn add_tile<NQ: Size>(
    dq_tile: &SharedMemory<Vector<f32, NQ>>,
    acc: &mut Array<Vector<f32, NQ>>,
    dq_empty0: &Barrier,
    dq_empty1: &Barrier,
    j: u32,
    lane: u32,
    first_row: u32,
    rows: u32,
    h: u32,
    total_q: u32,
    #[comptime] head_dim: usize,
    #[comptime] buf_elems: usize,
) {
    if lane == 0u32 && rows > 0u32 {
        let d = comptime!(head_dim as u32);
        let src = (j & 1u32) * comptime!(buf_elems as u32);
        bulk_add_f32::<NQ>(acc, (h * total_q + first_row) * d, dq_tile, src, rows * d * 4u32);
        tma_group_commit();
        tma_group_wait_read(0u32);
    }
    release(dq_empty0, dq_empty1, j, true);
}

/// Stores this thread's dQ fragment (rows `row_a`, `row_a + 8` of the tile, column pairs
/// `dq_col0 + 8 nb + col_a` of the warpgroup's `cols` columns) into the tile buffer that
/// starts at f32 `tile0` as global row
/// `first_row + r` sits in the head-major accumulator: rows of `head_dim` f32, the 16-byte chunk
/// `c / 4` at chunk `(c / 4) ^ (2 (first_row + r) % 8)` (`swz` = `first_row % 8`;
/// `flash_bwd::dq_convert`'s head-major variant undoes it). A float2 store is served a half-warp at
/// a time: 4 consecutive rows x 32 bytes, which the XOR (distinct in bits 1-2 over any 4
/// consecutive rows, bit 0 the lane's column half) spreads over the 32 banks once, so a warp's
/// store takes two wavefronts, the minimum. (`c ^ (r % 8)` put two lanes of a half-warp on each
/// bank: four wavefronts a store, 9% of the d128 kernel's shared-memory wavefronts, ncu.) Written
/// out: the XOR of a row pair is the same for both (`row_a + 8`), and with `dq_col0` a multiple of
/// 32 and `col_a / 4` = 0 / 1 the chunk of block `nb` is `base_chunk + 8 (nb / 4) + ((2 (nb % 4)) ^ z)`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn put_dq_tile<NQ: Size>(
    dq_tile: &mut SharedMemory<Vector<f32, NQ>>,
    tile0: usize,
    dq: &Array<f32>,
    row_a: usize,
    dq_col0: usize,
    col_a: usize,
    swz: usize,
    #[comptime] head_dim: usize,
    #[comptime] qvec: usize,
    #[comptime] cols: usize,
) {
    let z = ((2 * (swz + row_a)) % 8) ^ (col_a / 4);
    let base = tile0 + row_a * head_dim + dq_col0 + col_a % 4;
    #[unroll]
    for nb in 0..comptime!(cols / 8) {
        let chunk = (z ^ comptime!(2 * (nb % 4))) + comptime!(8 * (nb / 4));
        #[unroll]
        for hh in 0..2usize {
            let i = nb * 4 + hh * 2;
            let at = base + comptime!(hh * 8 * head_dim) + chunk * 4;
            put_dq_pair::<NQ>(dq_tile, at / qvec, dq[i], dq[i + 1], qvec);
        }
    }
}

/// A consumer's dQ of tile `cur` (rows `r0 ..` of the segment, global row `first_row`, q head `h`)
/// into the tile buffer once the dQ warp has read its previous use (`two_buffers`: tile `cur - 2`,
/// else tile `cur - 1`), then its arrival on the buffer's `dq_full`; `ct` 0 writes the buffer's
/// destination (first row, live rows, head) for the dQ warp. This thread's rows of the tile are
/// `key_a - cw row_step` (+ 8), its columns `cols` from `dq_col0` ([`put_dq_tile`]).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn store_dq<NQ: Size>(
    dq_tile: &mut SharedMemory<Vector<f32, NQ>>,
    dq_info: &mut SharedMemory<u32>,
    dq_empty0: &Barrier,
    dq_empty1: &Barrier,
    dq_full0: &Barrier,
    dq_full1: &Barrier,
    dq: &Array<f32>,
    cur: u32,
    first_row: u32,
    r0: u32,
    row_end: u32,
    h: u32,
    key_a: usize,
    cw: usize,
    col_a: usize,
    ct: u32,
    dq_col0: usize,
    #[comptime] head_dim: usize,
    #[comptime] qvec: usize,
    #[comptime] bm: usize,
    #[comptime] row_step: usize,
    #[comptime] cols: usize,
    #[comptime] two_buffers: bool,
) {
    if comptime!(two_buffers) {
        wait_free(dq_empty0, dq_empty1, cur);
    } else {
        wait_free(dq_empty0, dq_empty1, cur + 1u32);
    }
    let tile0 = ((cur & 1u32) as usize) * comptime!(if two_buffers { bm * head_dim } else { 0usize });
    let row_a = key_a - cw * comptime!(row_step);
    put_dq_tile::<NQ>(dq_tile, tile0, dq, row_a, dq_col0, col_a, (first_row % 8u32) as usize, head_dim, qvec, cols);
    if ct == 0u32 {
        let ib = ((cur & 1u32) * 4u32) as usize;
        dq_info[ib] = first_row;
        dq_info[ib + 1] = select(r0 < row_end, min(row_end - r0, bm as u32), 0u32);
        dq_info[ib + 2] = h;
    }
    // this thread's stores visible to the copy engine, then its arrival
    fence_proxy_async();
    release(dq_full0, dq_full1, cur, true);
}

/// The producer warpgroup's work in a warp-specialised dK / dV kernel of `bn`-key cubes: warp 0
/// issues every query tile of the walk into stage `g % 2` (Q, dO at `head_dim_v`, lse, delta;
/// `rolled`: the partial-tile copies in a loop, `flash_bwd_sm90::issue_q_tile`) once the consumers
/// have released its use `g - 2`; with `fuse_dq`, warp 1 adds each stored dQ tile to the
/// accumulator by the copy engine (`buf_elems`: f32 elements between the two tile buffers, 0 for
/// one). The other warps return at once.
#[cube]
#[allow(clippy::too_many_arguments, unused_variables)]
pub(super) fn produce<E: Float, NV: Size, NQ: Size>(
    args: &mut DkdvCard<E, NV, NQ>,
    ki: &KeyItem,
    hk: u32,
    group: u32,
    q_smem: &mut SharedMemory<E>,
    do_smem: &mut SharedMemory<E>,
    lse_smem: &mut SharedMemory<f32>,
    dl_smem: &mut SharedMemory<f32>,
    full0: &Barrier,
    full1: &Barrier,
    empty0: &Barrier,
    empty1: &Barrier,
    dq_tile: &SharedMemory<Vector<f32, NQ>>,
    dq_info: &SharedMemory<u32>,
    dq_full0: &Barrier,
    dq_full1: &Barrier,
    dq_empty0: &Barrier,
    dq_empty1: &Barrier,
    warp: u32,
    lane: u32,
    #[comptime] head_dim: usize,
    #[comptime] head_dim_v: usize,
    #[comptime] sparse: bool,
    #[comptime] fuse_dq: bool,
    #[comptime] bn: usize,
    #[comptime] bm: usize,
    #[comptime] rolled: bool,
    #[comptime] buf_elems: usize,
) {
    if warp == 0u32 {
        // ---- the loading warp: every query tile of the walk into stage g % 2 ----
        let mut g = 0u32;
        for si in ki.s_begin..ki.s_end {
            let sw = walk(args, ki, si, hk, group, sparse, bn, bm);
            let mut qt = first_q_tile(&args.tq_list, &sw, hk, group, args.q_block, sparse);
            for it in 0..sw.n_it {
                // stage g % 2 waits for the consumers' release of its use g - 2
                wait_free(empty0, empty1, g);
                issue_q_tile::<E>(
                    &args.q_map, &args.do_map, &args.q_s, &args.do_s, &args.lse, &args.delta, q_smem, do_smem,
                    lse_smem, dl_smem, full0, full1, g, qt.h, qt.r0, sw.q_len, sw.q_start, args.heads_q,
                    args.total_q, lane, head_dim, head_dim_v, LOADERS, bm, rolled,
                );
                next_q_tile(&args.tq_list, &sw, &mut qt, hk, group, args.q_tiles_per_block, args.q_block, sparse, bm);
                g += 1u32;
            }
        }
    }
    if fuse_dq {
        if warp == 1u32 {
            // ---- the dQ warp: each tile's rows added to the accumulator by the copy engine ----
            let n = count_tiles(args, ki, hk, sparse, bn, bm);
            for j in 0..n {
                wait_stage(dq_full0, dq_full1, j);
                let ib = ((j & 1u32) * 4u32) as usize;
                add_tile::<NQ>(
                    dq_tile, &mut args.dq_rows, dq_empty0, dq_empty1, j, lane, dq_info[ib], dq_info[ib + 1], dq_info[ib + 2],
                    args.total_q, head_dim, buf_elems,
                );
            }
        }
    }
}

/// The warp-specialised Hopper dK / dV kernel (module docs); arguments and comptime choices as
/// `flash_bwd_sm90::flash_bwd_sm90`, plus `bm`, the query rows of a tile: [`BWD_BM`], or
/// [`WIDE_BM`] at head_dim 64 on a dense call.
#[allow(clippy::too_many_arguments, unused_variables, unused_assignments)]
#[cube(launch_unchecked)]
pub fn flash_bwd_ws<E: Float, NV: Size, NQ: Size>(
    args: &mut DkdvCard<E, NV, NQ>,
    #[comptime] head_dim: usize,
    #[comptime] fuse_dq: bool,
    #[comptime] qvec: usize,
    #[comptime] sparse: bool,
    #[comptime] paged: bool,
    #[comptime] bm: usize,
) {
    let lane = UNIT_POS_PLANE;
    // warp and warpgroup index broadcast from lane 0: uniform, so descriptors stay in uniform registers
    let warp = plane_broadcast(UNIT_POS / 32u32, 0u32);
    let wg = warp / 4u32;

    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(BN * head_dim), 1024usize);
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(BN * head_dim), 1024usize);
    let mut q_smem = SharedMemory::<E>::new_aligned(comptime!(2 * bm * head_dim), 1024usize);
    let mut do_smem = SharedMemory::<E>::new_aligned(comptime!(2 * bm * head_dim), 1024usize);
    // dS^T, key-major ([key][row]: a 64-column chunk of BN rows per 64 query rows), two buffers:
    // the A operand of dQ = dS K
    let mut ds_smem = SharedMemory::<E>::new_aligned(comptime!(if fuse_dq { 2 * BN * bm } else { SW_COLS * 8 }), 1024usize);
    // `dq_buffers(bm)` dQ tile buffers of bm rows of head_dim f32 each, chunks swizzled by row
    // ([`put_dq_tile`])
    let dq_bufs = comptime!(dq_buffers(bm));
    let mut dq_tile =
        SharedMemory::<Vector<f32, NQ>>::new_aligned(comptime!(if fuse_dq { dq_bufs * bm * head_dim / qvec } else { 1usize }), 128usize);
    // each buffer's destination: first global row (q_start + r0), rows, head
    let mut dq_info = SharedMemory::<u32>::new(8usize);
    let mut lse_smem = SharedMemory::<f32>::new(comptime!(2 * bm));
    let mut dl_smem = SharedMemory::<f32>::new(comptime!(2 * bm));
    let full0 = Barrier::shared(comptime!(LOADERS as u32), UNIT_POS == 0);
    let full1 = Barrier::shared(comptime!(LOADERS as u32), UNIT_POS == 0);
    // every consumer thread arrives: its reads of the stage's lse / delta precede its arrival
    let empty0 = Barrier::shared(CONSUMER_THREADS, UNIT_POS == 0);
    let empty1 = Barrier::shared(CONSUMER_THREADS, UNIT_POS == 0);
    // per dQ buffer: stored (every consumer thread), read by the copy engine (the dQ warp's lanes)
    let dq_full0 = Barrier::shared(CONSUMER_THREADS, UNIT_POS == 0);
    let dq_full1 = Barrier::shared(CONSUMER_THREADS, UNIT_POS == 0);
    let dq_empty0 = Barrier::shared(comptime!(LOADERS as u32), UNIT_POS == 0);
    let dq_empty1 = Barrier::shared(comptime!(LOADERS as u32), UNIT_POS == 0);

    let (item, hk) = cube_item_slot(args.heads_kv, args.kv_outer, sparse);
    let group = args.heads_q / args.heads_kv;
    let ki = key_item(&args.ktiles, &args.tile_off, &args.segs, item, 0u32, args.total_k, sparse, WIDE_BN);
    let (key0, key_lim) = (ki.key0, ki.key_lim);

    // K, V staged once by warpgroups 0 and 1 (swizzled; keys past the item's zero)
    if UNIT_POS < 256u32 {
        stage_rows::<E, NV>(&args.k, &mut k_smem, key0, key_lim, key0, args.heads_kv, hk, &args.tq_list, BN, head_dim, 256usize,
            paged, true);
        stage_rows::<E, NV>(&args.v, &mut v_smem, key0, key_lim, key0, args.heads_kv, hk, &args.tq_list, BN, head_dim, 256usize,
            paged, true);
    }
    // K, V visible to the async proxy (the MMAs), barrier initialisation before any use
    fence_proxy_async();
    sync_cube();

    if wg == 0u32 {
        setmaxnreg(false, PRODUCER_REGS);
        produce::<E, NV, NQ>(
            args, &ki, hk, group, &mut q_smem, &mut do_smem, &mut lse_smem, &mut dl_smem, &full0, &full1, &empty0, &empty1, &dq_tile, &dq_info,
            &dq_full0, &dq_full1, &dq_empty0, &dq_empty1, warp, lane, head_dim, head_dim, sparse, fuse_dq, BN, bm, false,
            comptime!(if dq_buffers(bm) == 2 { bm * head_dim } else { 0usize }),
        );
        terminate!();
    }

    // ---- consumers: warpgroup cw of keys cw * 64 .. ----
    setmaxnreg(true, CONSUMER_REGS);
    let cw = (wg - 1u32) as usize;
    let ct = cw as u32 * 128u32 + UNIT_POS % 128u32;
    // this lane's first accumulator row (a key of the cube; + 8 for the second)
    let key_a = cw * WG_KEYS + ((warp % 4u32) * 16u32 + lane / 4u32) as usize;
    // this lane's first accumulator column pair (a row of the query tile)
    let col_a = ((lane % 4u32) * 2u32) as usize;

    let acc_n = comptime!(head_dim / 2);
    let mut dk_acc = Array::<f32>::new(acc_n);
    let mut dv_acc = Array::<f32>::new(acc_n);
    #[unroll]
    for i in 0..acc_n {
        dk_acc[i] = 0.0f32;
        dv_acc[i] = 0.0f32;
    }
    let mut s = Array::<f32>::new(comptime!(bm / 2));
    let mut dp = Array::<f32>::new(comptime!(bm / 2));
    let mut p_regs = Array::<Vector<E, Const<2>>>::new(comptime!(bm / 4));
    let mut ds_regs = Array::<Vector<E, Const<2>>>::new(comptime!(bm / 4));
    // the fused dQ of 128-row tiles: each consumer forms all columns of its 64 rows (else half the
    // columns of the 64 rows)
    let row_split = comptime!(fuse_dq && bm > BM);
    let dq_cols = comptime!(if row_split { head_dim } else { head_dim / 2 });
    let dq_n = comptime!(if fuse_dq { dq_cols / 2 } else { 1usize });
    let mut dq = Array::<f32>::new(dq_n);
    // dQ columns of this warpgroup: [dq_col0, dq_col0 + dq_cols), as an element offset in K
    let dq_col0 = cw * comptime!(if row_split { 0usize } else { head_dim / 2 });
    let k_dq = (dq_col0 / SW_COLS) * comptime!(BN * SW_COLS) + dq_col0 % SW_COLS;

    let mut g = 0u32;
    for si in ki.s_begin..ki.s_end {
        let sw = walk(args, &ki, si, hk, group, sparse, BN, bm);
        // window-local index of this warpgroup's first key (may be negative)
        let kw0 = (key0 as i32 + (cw * WG_KEYS) as i32) - sw.k_start as i32;
        let mut qt = first_q_tile(&args.tq_list, &sw, hk, group, args.q_block, sparse);
        for it in 0..sw.n_it {
            let cur = g;
            let (h, r0, row_end) = (qt.h, qt.r0, qt.row_end);
            wait_stage(&full0, &full1, cur);
            if r0 + bm as u32 > sw.q_len {
                // a tile past the segment's end came by cp.async (generic proxy)
                fence_proxy_async();
            }
            let qb = ((cur & 1u32) as usize) * comptime!(bm * head_dim);
            let lb = ((cur & 1u32) as usize) * bm;

            // ---- 1. S^T = K Q^T, dP^T = V dO^T (64 keys x bm rows) ----
            wgmma_fence();
            key_by_row_steps::<E>(&mut s, &k_smem, cw * WG_KEYS, BN, &q_smem, qb, head_dim, bm);
            wgmma_commit();
            key_by_row_steps::<E>(&mut dp, &v_smem, cw * WG_KEYS, BN, &do_smem, qb, head_dim, bm);
            wgmma_commit();
            let l2 = lse_ahead(&lse_smem, lb, col_a);
            wgmma_wait(1u32);

            // ---- 2. P^T (while dP^T is formed), then dS^T ----
            let full = p_transposed(
                &mut s, &l2, &lse_smem, lb, col_a, key_a, cw * WG_KEYS, kw0, r0 as i32, row_end, sw.k_hi, sw.shift, args.win_l, args.win_r,
                args.scale_log2, bm,
            );
            wgmma_wait(0u32);
            if full {
                ds_transposed(&mut dp, &s, &dl_smem, lb, col_a, bm, false);
            } else {
                ds_transposed(&mut dp, &s, &dl_smem, lb, col_a, bm, true);
            }
            pack_a_pairs::<E>(&s, &mut p_regs, comptime!(bm / 4));
            pack_a_pairs::<E>(&dp, &mut ds_regs, comptime!(bm / 4));
            let dsb = ((cur & 1u32) as usize) * comptime!(BN * bm);
            if fuse_dq {
                // dS^T key-major for dQ, buffer g % 2
                store_ds_transposed::<E>(&mut ds_smem, dsb, &ds_regs, key_a, col_a, BN, bm);
            }

            if fuse_dq {
                // ---- 3. dV += P^T dO; dQ[:, dq_col0..] = dS K (both consumers' dS^T halves
                // stored); dK += dS^T Q. dQ is stored while dK runs ----
                if comptime!(row_split) {
                    // the accumulator starts from zero, so it is not live across the softmax
                    // (the wgmma operands read it: registers)
                    #[unroll]
                    for i in 0..dq_n {
                        dq[i] = 0.0f32;
                    }
                }
                wgmma_fence();
                key_by_dim_steps::<E>(&mut dv_acc, &p_regs, &do_smem, qb, head_dim, bm);
                wgmma_commit();
                named_barrier(DS_BARRIER, CONSUMER_THREADS);
                wgmma_fence();
                // row split: this warpgroup's 64 rows are chunk cw of the key-major dS^T
                dq_steps::<E>(&mut dq, &ds_smem, dsb + cw * comptime!(if row_split { BN * SW_COLS } else { 0usize }), &k_smem, k_dq, dq_cols);
                wgmma_commit();
                key_by_dim_steps::<E>(&mut dk_acc, &ds_regs, &q_smem, qb, head_dim, bm);
                wgmma_commit();
                // dV, dQ done (dK may run on)
                wgmma_wait(1u32);
                // this thread's rows of the tile: key_a's place among the warpgroup's keys, plus
                // the warpgroup's 64 rows under the row split (key_a itself)
                store_dq(
                    &mut dq_tile, &mut dq_info, &dq_empty0, &dq_empty1, &dq_full0, &dq_full1, &dq, cur, sw.q_start + r0, r0, row_end, h,
                    key_a, cw, col_a, ct, dq_col0, head_dim, qvec, bm, comptime!(if row_split { 0usize } else { WG_KEYS }), dq_cols,
                    comptime!(dq_buffers(bm) == 2),
                );
            } else {
                // ---- 3. dV += P^T dO, dK += dS^T Q ----
                wgmma_fence();
                key_by_dim_steps::<E>(&mut dv_acc, &p_regs, &do_smem, qb, head_dim, bm);
                key_by_dim_steps::<E>(&mut dk_acc, &ds_regs, &q_smem, qb, head_dim, bm);
                wgmma_commit();
            }
            // dV, dK done: the stage is free
            wgmma_wait(0u32);
            release(&empty0, &empty1, cur, true);
            next_q_tile(&args.tq_list, &sw, &mut qt, hk, group, args.q_tiles_per_block, args.q_block, sparse, bm);
            g += 1u32;
        }
    }

    // ---- dK, dV (zero for keys no segment sees; sparse: the item's keys only) ----
    // every consumer's MMAs are done (the fused dQ = dS K reads both warpgroups' K rows)
    named_barrier(DS_BARRIER, CONSUMER_THREADS);
    write_dkdv_staged::<E, NV, NQ>(args, &dk_acc, &dv_acc, &mut k_smem, &mut v_smem, key0, key_lim, key_a, col_a, hk, cw,
        ct % 128u32, head_dim, paged);
}

/// dK (scaled) and dV of this consumer warpgroup's 64 keys out through shared memory, as the
/// forward's `write_out` does O: the rounded accumulator pairs go into the warpgroup's own rows of
/// the K and V tiles (128-byte swizzled, 128 rows a chunk; the caller has made sure no MMA reads
/// them any more), the warpgroup meets at its named barrier (2 + `cw`), then each thread stores
/// 16-byte row chunks of the keys below `key_lim`. The element-wise stores of `write_dkdv` took
/// ~19 K cycles a cube (2-4% of a d128 causal cube at 4K-8K: docs/backward.md).
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_dkdv_staged<E: Float, NV: Size, NQ: Size>(
    args: &mut DkdvCard<E, NV, NQ>,
    dk_acc: &Array<f32>,
    dv_acc: &Array<f32>,
    k_smem: &mut SharedMemory<E>,
    v_smem: &mut SharedMemory<E>,
    key0: u32,
    key_lim: u32,
    key_a: usize,
    col_a: usize,
    hk: u32,
    cw: usize,
    wg_unit: u32,
    #[comptime] head_dim: usize,
    #[comptime] paged: bool,
) {
    #[unroll]
    for nb in 0..comptime!(head_dim / 8) {
        #[unroll]
        for i in 0..2usize {
            let at = swizzle_128b(key_a + i * 8, nb * 8, BN) + col_a;
            store_pair_shared::<E>(k_smem, at, dk_acc[nb * 4 + 2 * i] * args.scale, dk_acc[nb * 4 + 2 * i + 1] * args.scale);
            store_pair_shared::<E>(v_smem, at, dv_acc[nb * 4 + 2 * i], dv_acc[nb * 4 + 2 * i + 1]);
        }
    }
    named_barrier_at(2u32 + cw as u32, 128u32);
    let units = comptime!(head_dim / 8);
    #[unroll]
    for it in 0..comptime!(WG_KEYS * head_dim / 8 / 128) {
        let idx = wg_unit as usize + it * 128;
        let r = cw * WG_KEYS + idx / units;
        let c = (idx % units) * 8;
        let key = key0 + r as u32;
        if key < key_lim {
            let g = (kv_row(key, &args.tq_list, paged) * args.heads_kv + hk) as usize * head_dim + c;
            let at = swizzle_128b(r, c, BN);
            copy16_out::<E>(&mut args.dk, g, k_smem, at);
            copy16_out::<E>(&mut args.dv, g, v_smem, at);
        }
    }
}
