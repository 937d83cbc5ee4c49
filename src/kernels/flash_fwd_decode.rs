//! The Hopper forward of decode-sized calls (at most `forward::FEW_ROWS` rows of one sequence in
//! a tile, e.g. one query row x the GQA group) with the keys as the MMA's M (swapped operands):
//! S^T = K Q^T by `wgmma m64 x n x k16` (A the 64-key K tile, B the tile's `n` query rows: the plan
//! packs tiles of the rows rounded up to 8, `forward::tile_rows`), O^T += V^T P^T (A the V tile
//! read MN-major, B P^T staged in shared memory). One warpgroup a cube, `decode_stages` K / V
//! stages with a barrier each, two cubes per SM.
//!
//! A decode step has 4-32 query rows a tile. With them as the M of 64 (the kernel before this,
//! bench/results/h200-2026-11-30-decode-wg1-ncu) a thread's softmax covered 32 scores a tile and a
//! warp ran ~520 instructions a tile on a serial chain; here a thread holds `n / 2` scores and
//! `head_dim / 64 * n / 2` output values (bench/results/h200-2026-11-30-decode-t: 5-12% less time).
//!
//! Per 64-key tile: wait for its stage, S^T by wgmma, the mask (each key against its row's range),
//! the tile's row maxima (shuffles over a warp's 16 keys, then the four warps' maxima through
//! shared memory, whose barrier also frees the previous tile's stage for its refill), P = 2^(s - m)
//! with FlashAttention-4's conditional reference (`RESCALE_SLACK`), P^T stored 128-byte-swizzled,
//! the O^T MMAs. The row sums stay per thread (its keys) and are reduced once at the end. A NaN or
//! Inf in V reaches every column of O^T (P is finite, 0 x Inf is NaN): a cube whose O^T is not
//! finite sets the non-finite flag, and the exact kernel writes the call. Work list, rows, paged K /
//! V and split-K partials (slots of `SM90_BLOCK_M` rows) are the Hopper forward's; the parts of a
//! split tile are merged in this launch by the part that finishes last (a counter per tile),
//! not by `combine_parts`.

use cubecl::prelude::*;
use cubecl::prelude::barrier::Barrier;

use super::cards::FwdCard;
use super::flash_fwd::{fill_rows, merge_row, tile_bounds, work_item, M_INIT, NONE, RESCALE_SLACK};
use super::flash_fwd_sm90::{copy_q_tile, SM90_BLOCK_M};
use super::kv_tiles::{issue_tile_boxes, tile_rows};
use super::math::{fast_exp2, LN2};
use super::sm90::{fence_gpu, fence_proxy_async, swizzle_128b, wgmma_commit, wgmma_fence, wgmma_ss, wgmma_wait, SW_COLS, SW_ROW};
use super::staging::commit_copies;

/// Keys per tile.
pub const DECODE_BN: usize = 64;
/// Threads per cube: one warpgroup.
pub const DECODE_THREADS: usize = 128;
/// K and V stages at `head_dim` for tiles of `rows` query rows: what two cubes per SM hold
/// (115712 bytes a cube) beside the Q and P^T tiles and the small buffers (a 1 KiB slot each).
pub const fn decode_stages(head_dim: usize, rows: usize) -> usize {
    if head_dim <= 64 {
        if rows <= 16 {
            6
        } else {
            5
        }
    } else if rows <= 16 {
        3
    } else {
        2
    }
}

/// Waits for the copies of stage `s` (phase parity `parity`).
#[cube]
fn wait_stage_n(bars: &Sequence<Shared<Barrier>>, parity: u32, #[comptime] s: usize) {
    bars.index(s).wait_parity(parity);
}

/// Issues K and V of the tile whose rows start at `p0` (`pb`: its second box's first row) into
/// stage `s` on that stage's barrier, and commits this thread's copies to it.
#[cube]
#[allow(clippy::too_many_arguments)]
fn issue_stage<E: Float>(
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

/// Row (N index) `i` of this thread's `n / 4`: column `2 (lane % 4) + i % 2` of n8 block `i / 2`
/// (the accumulator's columns; lanes 0-3 hold every row of their warp).
#[cube]
fn thread_row(lane: u32, #[comptime] i: usize) -> usize {
    comptime!((i / 2) * 8 + i % 2) + (lane % 4u32) as usize * 2
}

/// The four warps' values of row `c` in `red` (row-major by warp, `rows_n` a warp) folded by max
/// (`sum` false) or sum, in warp order.
#[cube]
fn over_warps(red: &SharedMemory<f32>, c: usize, #[comptime] rows_n: usize, #[comptime] sum: bool) -> f32 {
    let mut v = red[c];
    #[unroll]
    for w in 1..4usize {
        let x = red[comptime!(w * rows_n) + c];
        if comptime!(sum) {
            v += x;
        } else {
            v = max(v, x);
        }
    }
    v
}

/// The decode forward (module doc); arguments as `flash_fwd_sm90`'s `check_v` variant, and for
/// split tiles `arrivals` (one zeroed counter per partial slot `y * n_slots + s`; a tile counts on
/// its first slot's) and `slot_parts` (per slot: the tile's first slot and its parts); `rows_n`:
/// the plan's rows a tile (a multiple of 8, at most 32).
#[allow(clippy::too_many_arguments, clippy::eq_op, unused_variables)]
#[cube(launch_unchecked)]
pub fn flash_fwd_decode<E: Float>(
    args: &mut FwdCard<E>,
    arrivals: &mut Array<Atomic<u32>>,
    slot_parts: &Array<u32>,
    #[comptime] head_dim: usize,
    #[comptime] paged: bool,
    #[comptime] rows_n: usize,
) {
    if args.nonfinite[0] != 0u32 {
        terminate!();
    }
    let threads = comptime!(DECODE_THREADS);
    let stages = comptime!(decode_stages(head_dim, rows_n));
    let block_n = comptime!(DECODE_BN);
    let lane = UNIT_POS_PLANE;
    let warp = plane_broadcast(UNIT_POS / 32u32, 0u32);
    let tile_e = comptime!(block_n * head_dim);
    // the rows a thread holds: 2 per n8 block (columns 2 (lane % 4) + {0, 1} of block j)
    let cols = comptime!(rows_n / 4);
    let acc_n = comptime!(rows_n / 2);
    let m_blocks = comptime!(head_dim / 64);

    let mut q_smem = SharedMemory::<E>::new_aligned(comptime!(rows_n * head_dim), 1024usize);
    let mut p_smem = SharedMemory::<E>::new_aligned(comptime!(rows_n * block_n), 1024usize);
    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(stages * tile_e), 1024usize);
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(stages * tile_e), 1024usize);
    let mut row_tok = SharedMemory::<u32>::new(rows_n);
    let mut row_head = SharedMemory::<u32>::new(rows_n);
    let mut row_lo = SharedMemory::<u32>::new(rows_n);
    let mut row_hi = SharedMemory::<u32>::new(rows_n);
    // the four warps' row maxima of a tile (read before the tile's P^T barrier, so the next
    // tile's writes cannot overtake them) and, at the end, their row sums
    let mut red = SharedMemory::<f32>::new(comptime!(4 * rows_n));
    let mut span = SharedMemory::<u32>::new(2usize);
    let mut bars = Sequence::<Shared<Barrier>>::new();
    #[unroll]
    for _s in 0..stages {
        bars.push(Barrier::shared(comptime!(threads as u32), UNIT_POS == 0));
    }

    let mut list_smem = SharedMemory::<u32>::new(1usize);
    let wi = work_item(&args.work, &args.tile_ref, &args.blocks, &mut list_smem, args.heads_q, args.heads_kv, args.hp,
        args.tiles_per_block, args.kv_outer, threads, block_n, false);
    let (y, head_base, head_kv) = (wi.y, wi.head_base, wi.head_kv);
    let (slice_off, n_slices, klo, slot) = (wi.slice_off, wi.n_slices, wi.klo, wi.slot);
    let (list, tpb_magic) = (wi.list, wi.tpb_magic);

    fill_rows(
        &args.slices, &args.segs, slice_off, n_slices, args.hp, head_base, klo, wi.khi, &mut row_tok, &mut row_head, &mut row_lo,
        &mut row_hi, args.win_l, args.win_r, threads, rows_n,
    );
    sync_cube();
    // the keys the rows see: from the first row's first (the plan of a call whose key counts the
    // device writes covers whole cache rows, `kv_append`; paged tiles keep the plan's start, a
    // page's first key) to the last row's last. All rows sit in warp 0.
    if UNIT_POS < 32u32 {
        let mut first = 0xFFFF_FFFFu32;
        let mut end = 0u32;
        if UNIT_POS < rows_n as u32 {
            let (lo, hi) = (row_lo[UNIT_POS as usize], row_hi[UNIT_POS as usize]);
            if lo < hi {
                first = lo;
            }
            end = hi;
        }
        first = plane_min(first);
        end = plane_max(end);
        if UNIT_POS == 0u32 {
            span[0] = first;
            span[1] = end;
        }
    }
    sync_cube();
    let khi = min(wi.khi, span[1]);
    let mut klo = klo;
    if comptime!(!paged) {
        klo = max(klo, span[0]);
    }
    let mut n_tiles = 0u32;
    if khi > klo {
        n_tiles = (khi - klo + block_n as u32 - 1) / block_n as u32;
    }

    // the Q tile (`rows_n` rows, 128-byte-swizzled, the B operand of S^T; rows without a token
    // copy token 0, their keys are masked), committed with stage 0, then tiles 0 .. stages - 1
    if n_tiles > 0u32 {
        copy_q_tile(&args.q_s, &mut q_smem, &row_tok, &row_head, args.heads_q, UNIT_POS as usize, head_dim, rows_n, threads);
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

    // this thread's rows: index i = 2 j + e2 is column 8 j + 2 (lane % 4) + e2
    let mut rlo = Array::<u32>::new(cols);
    let mut rhi = Array::<u32>::new(cols);
    let mut m_r = Array::<f32>::new(cols);
    let mut l_r = Array::<f32>::new(cols);
    let mut mx = Array::<f32>::new(cols);
    let mut alpha = Array::<f32>::new(cols);
    #[unroll]
    for i in 0..cols {
        let c = thread_row(lane, i);
        rlo[i] = row_lo[c];
        rhi[i] = row_hi[c];
        m_r[i] = M_INIT;
        l_r[i] = 0.0f32;
    }
    let mut o_acc = Array::<f32>::new(comptime!(m_blocks * acc_n));
    #[unroll]
    for i in 0..comptime!(m_blocks * acc_n) {
        o_acc[i] = 0.0f32;
    }
    let mut s_acc = Array::<f32>::new(acc_n);
    let neg_inf = -args.inf;
    // this thread's first key of a tile (keys 16 warp + lane / 4, and 8 more)
    let key_off = warp * 16u32 + lane / 4u32;
    let v_lbo = comptime!((block_n * SW_ROW) as u32);

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
                // S^T = K Q^T
                wgmma_fence();
                #[unroll]
                for kk in 0..comptime!(head_dim / 16) {
                    let chunk = comptime!(kk / 4);
                    let within = comptime!((kk % 4) * 16);
                    let a_off = cur + comptime!(chunk * block_n * SW_COLS + within);
                    let b_off = comptime!(chunk * rows_n * SW_COLS + within);
                    wgmma_ss::<E>(&mut s_acc, &k_smem, a_off as u32, &q_smem, b_off as u32, 0usize, rows_n, false, 0u32, false, 0u32,
                        comptime!(kk > 0));
                }
                wgmma_commit();
                wgmma_wait(0u32);
                // the mask (each key against its row's range; keys past the tile's end are past
                // every row's) and this thread's maxima in base-2 units
                let key0 = t0 + key_off;
                #[unroll]
                for i in 0..cols {
                    mx[i] = neg_inf;
                }
                #[unroll]
                for e in 0..acc_n {
                    let i = comptime!((e / 4) * 2 + e % 2);
                    let key = key0 + comptime!(((e % 4) / 2) as u32 * 8);
                    let mut x = s_acc[e] * args.scale_log2;
                    if key < rlo[i] || key >= rhi[i] {
                        x = neg_inf;
                    }
                    s_acc[e] = x;
                    mx[i] = max(mx[i], x);
                }
                // over the warp's 16 keys, then the four warps' (lanes 0-3 hold all its rows)
                #[unroll]
                for i in 0..cols {
                    let mut v = mx[i];
                    v = max(v, plane_shuffle_xor(v, 4u32));
                    v = max(v, plane_shuffle_xor(v, 8u32));
                    v = max(v, plane_shuffle_xor(v, 16u32));
                    if lane < 4u32 {
                        let c = thread_row(lane, i);
                        red[warp as usize * rows_n + c] = v;
                    }
                }
                sync_cube();
                // every thread has waited for tile t - 1's MMAs before this barrier: its stage takes
                // tile t - 1 + stages (a barrier of its own at each tile's end: 0-3% slower)
                let pt = kt + comptime!(stages as u32 - 1);
                if kt > 0u32 && pt < n_tiles {
                    let (n0, n1) = tile_bounds(pt, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
                        tpb_magic, block_n, false);
                    let (p0, _p1, pb) = tile_rows(n0, n1, &args.blocks, paged, block_n);
                    issue_stage(args, &mut k_smem, &mut v_smem, &bars, p0, pb, head_kv, comptime!((s + stages - 1) % stages), head_dim);
                }
                #[unroll]
                for i in 0..cols {
                    let v = over_warps(&red, thread_row(lane, i), rows_n, false);
                    let old = m_r[i];
                    let mut new = old;
                    if v > old + RESCALE_SLACK {
                        new = v;
                    }
                    alpha[i] = fast_exp2(old - new);
                    m_r[i] = new;
                    l_r[i] *= alpha[i];
                }
                // P = 2^(s - m), its sums, P^T into shared memory (row c, key k: the B operand)
                #[unroll]
                for e in 0..acc_n {
                    let i = comptime!((e / 4) * 2 + e % 2);
                    let pv = fast_exp2(s_acc[e] - m_r[i]);
                    l_r[i] += pv;
                    let c = thread_row(lane, i);
                    let k = key_off as usize + comptime!(((e % 4) / 2) * 8);
                    // (`swizzle_128b` places a 16-byte unit: the key's place inside it added)
                    p_smem[swizzle_128b(c, k, rows_n) + k % 8] = E::cast_from(pv);
                }
                #[unroll]
                for mb in 0..m_blocks {
                    #[unroll]
                    for e in 0..acc_n {
                        o_acc[mb * acc_n + e] *= alpha[comptime!((e / 4) * 2 + e % 2)];
                    }
                }
                fence_proxy_async();
                sync_cube();
                // O^T += V^T P^T
                wgmma_fence();
                #[unroll]
                for mb in 0..m_blocks {
                    #[unroll]
                    for ks in 0..comptime!(block_n / 16) {
                        let a_off = cur + comptime!(mb * block_n * SW_COLS + ks * 16 * SW_COLS);
                        wgmma_ss::<E>(&mut o_acc, &v_smem, a_off as u32, &p_smem, comptime!((ks * 16) as u32), comptime!(mb * acc_n), rows_n,
                            true, v_lbo, false, 0u32, true);
                    }
                }
                wgmma_commit();
                wgmma_wait(0u32);
            }
        }
    }

    // V held a NaN or Inf where O^T is not finite (x - x is not 0; an element-wise check of the V
    // tiles was ~100 instructions a tile)
    let mut bad = false;
    #[unroll]
    for i in 0..comptime!(m_blocks * acc_n) {
        let o = o_acc[i];
        bad = bad || o - o != 0.0f32;
    }
    if bad {
        args.nonfinite[0] = 1u32;
    }

    // the row sums: over the warp's keys, then the four warps' in order (every reader of the last
    // tile's maxima in `red` read them before that tile's P^T barrier)
    #[unroll]
    for i in 0..cols {
        let mut l = l_r[i];
        l += plane_shuffle_xor(l, 4u32);
        l += plane_shuffle_xor(l, 8u32);
        l += plane_shuffle_xor(l, 16u32);
        if lane < 4u32 {
            let c = thread_row(lane, i);
            red[warp as usize * rows_n + c] = l;
        }
    }
    sync_cube();
    let mut inv = Array::<f32>::new(cols);
    #[unroll]
    for i in 0..cols {
        let l = over_warps(&red, thread_row(lane, i), rows_n, true);
        l_r[i] = l;
        let mut f = 0.0f32;
        if l > 0.0f32 {
            f = 1.0f32 / l;
        }
        inv[i] = f;
    }

    // O^T element e of m-block mb: channel 64 mb + 16 warp + lane / 4 (+ 8), row c
    let ch0 = (warp * 16u32 + lane / 4u32) as usize;
    if slot == NONE {
        #[unroll]
        for mb in 0..m_blocks {
            #[unroll]
            for e in 0..acc_n {
                let i = comptime!((e / 4) * 2 + e % 2);
                let c = thread_row(lane, i);
                let tok = row_tok[c];
                if tok != NONE {
                    let ch = ch0 + comptime!(mb * 64 + ((e % 4) / 2) * 8);
                    args.out[(tok * args.heads_q + row_head[c]) as usize * head_dim + ch] = E::cast_from(o_acc[mb * acc_n + e] * inv[i]);
                }
            }
        }
        if UNIT_POS < 4u32 {
            #[unroll]
            for i in 0..cols {
                let c = thread_row(lane, i);
                let tok = row_tok[c];
                if tok != NONE {
                    let mut val = args.inf;
                    if l_r[i] != 0.0f32 {
                        val = m_r[i] * LN2 + f32::ln(l_r[i]);
                    }
                    args.lse[(row_head[c] * args.total_q + tok) as usize] = val;
                }
            }
        }
    } else {
        // split-K partials: slots of `SM90_BLOCK_M` rows (the merge reads the rows with a token)
        let pbase = ((y * args.n_slots + slot) as usize) * comptime!(SM90_BLOCK_M);
        #[unroll]
        for mb in 0..m_blocks {
            #[unroll]
            for e in 0..acc_n {
                let i = comptime!((e / 4) * 2 + e % 2);
                let c = thread_row(lane, i);
                if row_tok[c] != NONE {
                    let ch = ch0 + comptime!(mb * 64 + ((e % 4) / 2) * 8);
                    args.part_o[(pbase + c) * head_dim + ch] = o_acc[mb * acc_n + e] * inv[i];
                }
            }
        }
        if UNIT_POS < 4u32 {
            #[unroll]
            for i in 0..cols {
                let c = thread_row(lane, i);
                let mut val = neg_inf;
                if l_r[i] != 0.0f32 {
                    val = m_r[i] * LN2 + f32::ln(l_r[i]);
                }
                args.part_lse[pbase + c] = val;
            }
        }
        // the split-K combine in this launch: the tile's part that arrives last on its counter
        // merges the parts (its stores, and every other part's, ordered before the arrivals)
        let first = slot_parts[(slot * 2u32) as usize];
        let n_parts = slot_parts[(slot * 2u32 + 1u32) as usize];
        let base = y * args.n_slots + first;
        fence_gpu();
        sync_cube();
        if UNIT_POS == 0u32 {
            span[0] = arrivals[base as usize].fetch_add(1u32);
        }
        sync_cube();
        if span[0] + 1u32 == n_parts {
            fence_gpu();
            #[unroll]
            for rr in 0..comptime!(rows_n / 4) {
                let c = rr * 4 + warp as usize;
                let tok = row_tok[c];
                if tok != NONE {
                    merge_row(&mut args.out, &mut args.lse, &args.part_o, &args.part_lse, base, n_parts, c, tok, row_head[c],
                        args.heads_q, args.total_q, args.inf, lane as usize, head_dim, SM90_BLOCK_M);
                }
            }
        }
    }
}
