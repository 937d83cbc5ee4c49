//! The dense dK / dV kernel (and, with the comptime `fuse_dq`, dQ into an f32 accumulator) with
//! 128-key cubes of 8 planes: FlashAttention-2's partition of the backward (its sm80/sm90 d128
//! traits). Work list: the CSR of the segments overlapping each key tile (varlen, grouped, GQA,
//! causal, sliding window). It replaced a 64-key kernel of 4 planes: the backward alone 1.03-1.09x
//! faster on the dQ pass, 1.21-1.27x with fused dQ (H100, docs/backward.md).
//!
//! Block-sparse (comptime `sparse`): a cube's keys are a work item of at most [`WIDE_BN`] keys
//! inside one key block of one sequence, and its query tiles come from the transposed block index
//! (`kernels::sparse_index`): per index head the query blocks listing the key block, ascending,
//! each `q_tiles_per_block` tiles of 64 rows, rows past the query block's end masked. Everything
//! else (the tile steps, masks, fused dQ) is the dense kernel's.
//!
//! Per 64-row query tile (Q, dO, lse, delta double-buffered with `cp.async` as in the 64-key
//! kernel):
//! 1. S = Q K^T and dP = dO V^T on a 2 (rows) x 4 (keys) plane grid, 32 rows x 32 keys per plane
//!    (every A and B fragment feeds 2 or 4 mma: 0.5 `ldmatrix` per mma);
//! 2. P = 2^(S scale log2(e) - lse log2(e)) and dS = P (dP - delta) (lse / delta read once per
//!    lane and row: each lane holds 4 rows), masked only when the plane's 32 x 32 block is not
//!    `full` (a second copy of this step, compiled with the masks: two compares per element of
//!    per-row key bounds), rounded to the dtype and stored row-major ([row][key]) with
//!    `stmatrix` (the m16n8 accumulator layout is `stmatrix`'s register layout: one store per
//!    16 x 16 block and lane);
//! 3. after the tile's barrier (P and dS complete; with two P / dS stages the next query tile's
//!    copies are issued here, into the other stage), dV += P^T dO and dK += dS^T Q on a 4 (keys)
//!    x 2 (head_dim) grid, 32 keys x head_dim / 2 columns per plane over the tile's 64 rows (P^T
//!    / dS^T as A operands through `ldmatrix.trans` of the row-major tiles), and with `fuse_dq`,
//!    dQ[rows] += dS K on a 2 (rows) x 4 (columns) grid, added into the f32 accumulator with
//!    float2 atomics (rows past the segment end add 0.0 to a clamped row: no branch), or with
//!    `dq_bulk` (d128 on sm_90+) stored to a shared tile that the copy engine adds row by row
//!    after the tile's last barrier (`bulk_reduce`; that barrier replaces the one at the top of
//!    the next tile).
//!
//! Without fused dQ at d128, P and dS have two stages too ([`p_stages_for`]), so that one barrier
//! per tile suffices: a stage written by tile t was last read by tile t - 2, and every plane
//! finished that before passing tile t - 1's barrier. Otherwise (one P / dS stage) a second
//! barrier at the top of the tile waits for the previous tile's readers, and the next query tile
//! is issued right after it. The dK / dV accumulators (32 keys x head_dim / 2 per plane) stay in
//! registers for the cube's whole life; K and V stay in shared memory. Shared memory (d128): K, V
//! 68 KB + two stages of Q, dO 68 KB + P, dS 34 KB (two stages: 68 KB) = 171 KB (206 KB): one
//! cube (8 planes) per SM; d64 110 KB, one cube per SM too (248 registers x 256 threads). The
//! bulk dQ tile adds 34 KB at d128 (205 KB).
//!
//! GPUs whose per-block limit is smaller (an A100: 163 KB) get one query-tile stage (comptime
//! `q_stages` 1, host `backward::q_stages`): Q, dO, lse, delta and P / dS once, 137 KB at d128;
//! each tile is issued after the barrier that starts it, so its copies no longer overlap the
//! previous tile's products.
//!
//! Rows are segment-local and keys window-local for the masks, as in the 64-key kernel: segment
//! row `r` sees the window keys in `[r + shift - win_l, r + shift + win_r]` (`rows::row_keys`;
//! causal is `win_r = 0`), `shift = k_len - q_len`.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::cards::DkdvCard;
use super::tiles::{BWD_BM, PAD, WIDE_BN, WIDE_PLANES};
use super::bulk_reduce::{add_dq_pair, dq_row_dst, dq_rows_read, dq_tile_stride, issue_dq_row, put_dq_pair};
use super::fragments::{frag_a, frag_a_t, frag_b_n2, frag_b_t2, mma_into, store_acc_16x16};
use super::grid::cube_item_slot;
use super::math::{fast_exp2, LOG2E};
use super::bwd_walk::{key_item, seg_walk, sparse_q_tile};
use super::rows::kv_row;
use super::staging::{commit_stage, issue_lse_delta, issue_q_tile, stage_rows, wait_stage};

/// Rows and keys of one plane's S / dP block, keys of its dK / dV block.
const BLK: usize = 32;

/// Box (columns, rows) of the tensor-map copies of a query tile (sm_90+): `BWD_BM` rows of
/// `head_dim + PAD` columns, so that the dense box lands in shared memory in the padded row layout
/// of the cp.async path (the `PAD` extra columns are the next head's, or zeros past the row's
/// end, and are never read).
pub const fn q_map_box(head_dim: usize) -> (u32, u32) {
    ((head_dim + PAD) as u32, BWD_BM as u32)
}

/// Stages of the P / dS tiles. Two (a tile needs one barrier) on the d128 dK / dV kernel without
/// fused dQ: 206 KB per cube, one cube per SM either way; measured 0.5-1.5% faster there, 0.5-1.5%
/// slower with fused dQ (docs/backward.md). One at d64, where the second stage's address
/// arithmetic spilled (32 B of stack, 5-7 local loads per tile), and with one query-tile stage
/// (`q_stages`).
pub const fn p_stages_for(head_dim: usize, fuse_dq: bool, q_stages: usize) -> usize {
    if head_dim > 64 && !fuse_dq && q_stages == 2 {
        2
    } else {
        1
    }
}

/// `acc` (accumulator blocks `[mb (2)][nb (4)][ec]`: 32 rows from `a_row0` x 32 rows of `b_smem`
/// from `b_row0`) += A B^T over `head_dim` columns: S = Q K^T, dP = dO V^T.
#[cube]
#[allow(clippy::too_many_arguments)]
fn mma_block_abt<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    a_smem: &SharedMemory<E>,
    a_row0: usize,
    b_smem: &SharedMemory<E>,
    b_row0: usize,
    acc: &mut Array<f32>,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
) {
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let ec = comptime!(vc * sc);
    #[unroll]
    for kk in 0..comptime!(head_dim / 32) {
        let a00 = frag_a::<E, NA>(def, a_smem, a_row0, kk * 32, stride);
        let a01 = frag_a::<E, NA>(def, a_smem, a_row0, kk * 32 + 16, stride);
        let a10 = frag_a::<E, NA>(def, a_smem, a_row0 + 16, kk * 32, stride);
        let a11 = frag_a::<E, NA>(def, a_smem, a_row0 + 16, kk * 32 + 16, stride);
        #[unroll]
        for nb in 0..4usize {
            let m = frag_b_t2::<E, NB>(def, b_smem, b_row0 + nb * 8, kk * 32, stride);
            mma_into::<E, NA, NB, NC>(def, &a00, &m, 0usize, acc, nb * ec);
            mma_into::<E, NA, NB, NC>(def, &a10, &m, 0usize, acc, (4 + nb) * ec);
            mma_into::<E, NA, NB, NC>(def, &a01, &m, 2usize, acc, nb * ec);
            mma_into::<E, NA, NB, NC>(def, &a11, &m, 2usize, acc, (4 + nb) * ec);
        }
    }
}

/// One 16-row step of `acc` (accumulator blocks `[mb (2)][ob][ec]`: 32 keys x `n` columns) +=
/// A^T B: A^T the 32 keys from `key0` of rows `a_row0 + row..+16` of the row-major tile `a_smem`
/// (`ldmatrix.trans`), B rows `b_row0 + row..` columns `col0..col0+n` of `b_smem`: dV += P^T dO,
/// dK += dS^T Q.
#[cube]
#[allow(clippy::too_many_arguments)]
fn mma_block_atb<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    a_smem: &SharedMemory<E>,
    a_row0: usize,
    row: usize,
    key0: usize,
    b_smem: &SharedMemory<E>,
    b_row0: usize,
    col0: usize,
    acc: &mut Array<f32>,
    #[comptime] n: usize,
    #[comptime] stride: usize,
) {
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let ec = comptime!(vc * sc);
    let ob_n = comptime!(n / 8);
    let pstride = comptime!(WIDE_BN + PAD);
    let a0 = frag_a_t::<E, NA>(def, a_smem, a_row0 + row, key0, pstride);
    let a1 = frag_a_t::<E, NA>(def, a_smem, a_row0 + row, key0 + 16, pstride);
    #[unroll]
    for ob2 in 0..comptime!(ob_n / 2) {
        let m = frag_b_n2::<E, NB>(def, b_smem, b_row0 + row, col0 + ob2 * 16, stride);
        mma_into::<E, NA, NB, NC>(def, &a0, &m, 0usize, acc, (2 * ob2) * ec);
        mma_into::<E, NA, NB, NC>(def, &a0, &m, 2usize, acc, (2 * ob2 + 1) * ec);
        mma_into::<E, NA, NB, NC>(def, &a1, &m, 0usize, acc, (ob_n + 2 * ob2) * ec);
        mma_into::<E, NA, NB, NC>(def, &a1, &m, 2usize, acc, (ob_n + 2 * ob2 + 1) * ec);
    }
}

/// P and dS of one plane's 32 x 32 block from S (`s`) and dP (`dp`), stored row-major into
/// `p_smem` / `ds_smem` (rows `row0..`, keys `col0..`). `lse2` / `dl`: the lane's 4 rows
/// (`[mb][half]`: rows `16 mb + 8 half + lane / 4` of the block), lse in base 2. With `masked`,
/// element (row i, key column c) is kept iff `lo[i] <= c' < hi[i]` with `c' = 8 nb + (e % 2)`
/// the compile-time part of the column (the lane's `2 (lane % 4)` is folded into the bounds).
/// dS is masked too, not only P: a masked pair's dP - delta may be non-finite.
#[cube]
#[allow(clippy::too_many_arguments)]
fn probs_store<E: Float, NA: Size>(
    def: &MmaDefinition<E, E, f32>,
    s: &mut Array<f32>,
    dp: &mut Array<f32>,
    lse2: &Array<f32>,
    dl: &Array<f32>,
    lo: &Array<i32>,
    hi: &Array<i32>,
    scale_log2: f32,
    p_smem: &mut SharedMemory<E>,
    ds_smem: &mut SharedMemory<E>,
    row0: usize,
    col0: usize,
    #[comptime] masked: bool,
    #[comptime] pstride: usize,
) {
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let ec = comptime!(vc * sc);
    #[unroll]
    for mb in 0..2usize {
        #[unroll]
        for nb in 0..4usize {
            #[unroll]
            for e in 0..ec {
                let i = (mb * 4 + nb) * ec + e;
                let ri = mb * 2 + e / (ec / 2);
                let mut p = fast_exp2(s[i] * scale_log2 - lse2[ri]);
                let mut ds = p * (dp[i] - dl[ri]);
                if masked {
                    let c = (nb * 8 + e % 2) as i32;
                    let ok = c >= lo[ri] && c < hi[ri];
                    p = select(ok, p, 0.0f32);
                    ds = select(ok, ds, 0.0f32);
                }
                s[i] = p;
                dp[i] = ds;
            }
        }
    }
    #[unroll]
    for mb in 0..2usize {
        #[unroll]
        for h in 0..2usize {
            store_acc_16x16::<E, NA>(def, s, (mb * 4 + 2 * h) * ec, p_smem, row0 + mb * 16, col0 + h * 16, pstride);
            store_acc_16x16::<E, NA>(def, dp, (mb * 4 + 2 * h) * ec, ds_smem, row0 + mb * 16, col0 + h * 16, pstride);
        }
    }
}

/// Issues query tile `cur + 1` into the stage `cur` does not use (with one stage: the stage) and
/// commits it to barrier `(cur + 1) % 2`. The tile is the loop's next (q head, tile) pair: dense, q head `h_base + hq` and rows
/// from `r_min + ti BM`; sparse, entry `ei` / tile `ti` / repeat `hq` of the transposed list.
#[cube]
#[allow(clippy::too_many_arguments)]
fn issue_next_q_tile<E: Float>(
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
    cur: u32,
    tq_list: &Array<u32>,
    t_lo: u32,
    ei: u32,
    ti: u32,
    hq: u32,
    h_base: u32,
    span: u32,
    q_block: u32,
    r_min: u32,
    q_len: u32,
    q_start: u32,
    heads_q: u32,
    total_q: u32,
    #[comptime] head_dim: usize,
    #[comptime] threads: usize,
    #[comptime] sparse: bool,
    #[comptime] tma: bool,
    #[comptime] q_stages: usize,
) {
    let mut h = h_base + hq;
    let mut r0 = r_min + ti * BWD_BM as u32;
    if sparse {
        let (ha, ra, _re) = sparse_q_tile(tq_list, t_lo, ei, ti, hq, h_base, span, q_block, q_len);
        h = ha;
        r0 = ra;
    }
    let mut nb = 0usize;
    if comptime!(q_stages == 2) {
        nb = (((cur + 1u32) & 1u32) * BWD_BM as u32) as usize;
    }
    // (`tma` alone decides at compile time: without it no tensor-map code is generated, which
    // GPUs below sm_90 could not compile)
    let mut by_map = false;
    if comptime!(tma) {
        by_map = r0 + BWD_BM as u32 <= q_len;
    }
    if by_map {
        // every row inside the segment: Q and dO as one tensor-map copy each (`q_map_box`),
        // lse and delta by cp.async as below
        if comptime!(tma) {
            issue_q_tile_maps(q_map, do_map, q_smem, do_smem, bar0, bar1, cur, nb, q_start + r0, h, head_dim);
        }
        issue_lse_delta(lse, delta, lse_smem, dl_smem, nb, r0, q_len, q_start, h, total_q, UNIT_POS, threads, BWD_BM);
    } else {
        issue_q_tile::<E>(
            q_s, do_s, lse, delta, q_smem, do_smem, lse_smem, dl_smem, nb, r0, q_len, q_start, h, heads_q, total_q,
            head_dim, threads,
        );
    }
    commit_stage(bar1, bar0, cur);
}

/// Unit 0 raises the expected bytes of query tile `cur + 1`'s barrier and issues its Q and dO rows
/// `row..row + BWD_BM` (head `h`) as one tensor-map copy each into rows `nb..` of the stage.
#[cube]
#[allow(clippy::too_many_arguments)]
fn issue_q_tile_maps<E: Float>(
    q_map: &TensorMap<E, Tiled>,
    do_map: &TensorMap<E, Tiled>,
    q_smem: &mut SharedMemory<E>,
    do_smem: &mut SharedMemory<E>,
    bar0: &Barrier,
    bar1: &Barrier,
    cur: u32,
    nb: usize,
    row: u32,
    h: u32,
    #[comptime] head_dim: usize,
) {
    if UNIT_POS == 0 {
        let y = row as i32;
        let x = (h * head_dim as u32) as i32;
        let tile = comptime!(BWD_BM * (head_dim + PAD));
        let a = nb * comptime!(head_dim + PAD);
        let ts = E::type_size();
        let bytes = comptime!((2 * BWD_BM * (head_dim + PAD) * ts) as u32);
        if (cur & 1u32) == 0 {
            bar1.expect_tx(bytes);
            bar1.tma_load_2d(q_map, &mut q_smem.slice_mut(a, a + tile), y, x);
            bar1.tma_load_2d(do_map, &mut do_smem.slice_mut(a, a + tile), y, x);
        } else {
            bar0.expect_tx(bytes);
            bar0.tma_load_2d(q_map, &mut q_smem.slice_mut(a, a + tile), y, x);
            bar0.tma_load_2d(do_map, &mut do_smem.slice_mut(a, a + tile), y, x);
        }
    }
}

/// dK, dV (and with `fuse_dq` the dQ atomics); arguments: the dK / dV card (`cards::DkdvCard`).
/// Grid: entries of `ktiles` x heads_kv in one dimension, heads fastest (block-sparse: items
/// fastest); 32 * [`WIDE_PLANES`] units. `ktiles`: key-tile indices (tile t = keys `[t*WIDE_BN,
/// t*WIDE_BN+WIDE_BN)` of the shared key axis), most expensive first; `tile_off` / `tile_segs`: CSR
/// list of the segments overlapping each tile; `segs`: (q_start, q_len, k_start, k_len) per
/// segment; `lse`, `delta`: `[heads_q, total_q]`; `q_s` / `do_s`: q and dout as scalars (the
/// `cp.async` sources); `dq_acc`: the f32 dQ accumulator (fused path; any valid address otherwise).
/// With `tma` (sm_90+) a query tile whose rows all lie inside the segment is copied by one
/// tensor-map copy of Q (`q_map`) and one of dO (`do_map`, both [`q_map_box`] boxes over `[total_q,
/// heads_q * head_dim]`) issued by one thread, instead of 8 `cp.async` per thread; a tile past the
/// segment's end keeps the `cp.async` path (its rows clamped to the segment). Without `tma` the
/// maps are not read. Block-sparse (`sparse`): `ktiles` holds [`SPARSE_KWORK_WORDS`] words per work
/// item (sequence, first window key, keys, key block), `tile_off` / `tile_segs` are not read;
/// `tq_off` / `tq_list`: the transposed index (cells (sequence, key block, index head)); `q_block`,
/// `idx_heads`, `k_blocks` (per sequence slot), `q_tiles_per_block` describe it. Dense calls pass
/// any valid address and value for those.
#[allow(clippy::too_many_arguments, unused_assignments)]
#[cube(launch_unchecked)]
pub fn flash_bwd_dkdv_wide<E: Float, NV: Size, NQ: Size>(
    args: &mut DkdvCard<E, NV, NQ>,
    #[comptime] head_dim: usize,
    #[comptime] fuse_dq: bool,
    #[comptime] dq_bulk: bool,
    #[comptime] qvec: usize,
    #[comptime] sparse: bool,
    #[comptime] paged: bool,
    #[comptime] tma: bool,
    #[comptime] q_stages: usize,
) {
    let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE;
    let plane = UNIT_POS / 32u32;
    let threads = comptime!(WIDE_PLANES * 32);
    let stride = comptime!(head_dim + PAD);
    let pstride = comptime!(WIDE_BN + PAD);
    // Step 1 (S, dP) and the dQ product: rows `rw..rw+32` of the tile; step 1: keys `kw_s..+32`;
    // step 3: keys `kw_s..+32` (dK / dV rows) and head columns `cb..cb+hn`; dQ: columns
    // `cq..cq+dqn`.
    let kq = (plane % 4u32) as usize;
    let half = (plane / 4u32) as usize;
    let rw = half * BLK;
    let kw_s = kq * BLK;
    let hn = comptime!(head_dim / 2);
    let cb = half * hn;
    let dqn = comptime!(head_dim / 4);
    let cq = kq * dqn;

    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(WIDE_BN * (head_dim + PAD)), 16usize);
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(WIDE_BN * (head_dim + PAD)), 16usize);
    // `q_stages` (2, or 1 on GPUs with less shared memory) stages of the query tile (Q, dO, lse,
    // delta): rows [0, BM) and [BM, 2 BM).
    let mut q_smem = SharedMemory::<E>::new_aligned(comptime!(q_stages * BWD_BM * (head_dim + PAD)), 128usize);
    let mut do_smem = SharedMemory::<E>::new_aligned(comptime!(q_stages * BWD_BM * (head_dim + PAD)), 128usize);
    let mut lse_smem = SharedMemory::<f32>::new(comptime!(q_stages * BWD_BM));
    let mut dl_smem = SharedMemory::<f32>::new(comptime!(q_stages * BWD_BM));
    // P and dS, row-major [row][key]: tile g in rows [(g % p_stages) BM, ..+BM).
    let p_stages = comptime!(p_stages_for(head_dim, fuse_dq, q_stages));
    let mut p_smem = SharedMemory::<E>::new_aligned(comptime!(p_stages * BWD_BM * (WIDE_BN + PAD)), 16usize);
    let mut ds_smem = SharedMemory::<E>::new_aligned(comptime!(p_stages * BWD_BM * (WIDE_BN + PAD)), 16usize);
    let bar0 = Barrier::shared(comptime!(threads as u32), UNIT_POS == 0);
    let bar1 = Barrier::shared(comptime!(threads as u32), UNIT_POS == 0);
    // Fused dQ by bulk reductions (`bulk_reduce`): the tile's dQ, row-major (one unused vector
    // in the other variants: CubeCL declares the buffer either way).
    let bulk = comptime!(fuse_dq && dq_bulk);
    let dts = comptime!(dq_tile_stride(head_dim));
    let mut dq_tile =
        SharedMemory::<Vector<f32, NQ>>::new_aligned(comptime!(if bulk { BWD_BM * dts / qvec } else { 1usize }), 16usize);

    // One cube per (work item, kv head); block-sparse items fastest.
    let (item, hk) = cube_item_slot(args.heads_kv, args.kv_outer, sparse);
    let group = args.heads_q / args.heads_kv;
    // Dense: key tile `kt` of the shared key axis, its segments from the CSR list. Sparse: work
    // item (sequence, first window key, keys, key block) inside one key block of one sequence.
    let ki = key_item(&args.ktiles, &args.tile_off, &args.segs, item, 0u32, args.total_k, sparse, WIDE_BN);
    let (key0, key_lim) = (ki.key0, ki.key_lim);

    // paged (dense only: `tq_list` holds the page table): K, V read and dK, dV written at the
    // rows of a paged K,V (`rows::kv_row`)
    stage_rows::<E, NV>(&args.k, &mut k_smem, key0, key_lim, key0, args.heads_kv, hk, &args.tq_list, WIDE_BN, head_dim,
        threads, paged, false);
    stage_rows::<E, NV>(&args.v, &mut v_smem, key0, key_lim, key0, args.heads_kv, hk, &args.tq_list, WIDE_BN, head_dim,
        threads, paged, false);
    // Barrier initialisation visible before the first cp.async commit.
    sync_cube();
    // Query tiles issued so far: tile g uses stage g % 2 and barrier phase (g / 2) % 2.
    let mut g_tile = 0u32;

    let size!(NA) = def.vector_size(MatrixIdent::A);
    let size!(NB) = def.vector_size(MatrixIdent::B);
    let size!(NC) = def.vector_size(MatrixIdent::Accumulator);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let ec = comptime!(vc * sc);
    // 8-column blocks of this plane's dK / dV columns, of its dQ columns.
    let ob_n = comptime!(hn / 8);
    let oq_n = comptime!(dqn / 8);

    // [mb (2)][ob][ec]: keys kw_s + 16 mb + .., columns cb + 8 ob + ..
    let mut dk_acc = Array::<f32>::new(comptime!(2 * ob_n * ec));
    let mut dv_acc = Array::<f32>::new(comptime!(2 * ob_n * ec));
    #[unroll]
    for i in 0..comptime!(2 * ob_n * ec) {
        dk_acc[i] = 0.0f32;
        dv_acc[i] = 0.0f32;
    }
    // [mb (2)][nb (4)][ec]: rows rw + 16 mb + .., keys kw_s + 8 nb + ..
    let mut s = Array::<f32>::new(comptime!(8 * ec));
    let mut dp = Array::<f32>::new(comptime!(8 * ec));
    let mut lse2 = Array::<f32>::new(4usize);
    let mut dl = Array::<f32>::new(4usize);
    let mut lo = Array::<i32>::new(4usize);
    let mut hi = Array::<i32>::new(4usize);
    let mut dqc = Array::<f32>::new(comptime!(if fuse_dq { 2 * oq_n * ec } else { 1usize }));

    // The lane's accumulator rows: `g` and `g + 8` of each 16-row block; its columns `2 t, 2 t + 1`
    // of each 8-column block.
    let (g, t2) = def.position_of_nth(lane, 0u32, MatrixIdent::Accumulator);

    for si in ki.s_begin..ki.s_end {
        let sw = seg_walk(
            &args.segs, &args.tile_segs, &args.tq_off, &ki, si, WIDE_BN as u32, hk, args.heads_kv, group, args.idx_heads,
            args.k_blocks, args.q_tiles_per_block, args.win_l, args.win_r, sparse, BWD_BM,
        );
        let (q_start, q_len, k_start, shift, r_min) = (sw.q_start, sw.q_len, sw.k_start, sw.shift, sw.r_min);
        let (k_hi, n_qt, n_it, t_lo, t_n, span) = (sw.k_hi, sw.n_qt, sw.n_it, sw.t_lo, sw.t_n, sw.span);
        // Window-local index of this plane's first step-1 key (may be negative).
        let kw0 = (key0 as i32 + kw_s as i32) - k_start as i32;
        // Does this plane's 32-key block hold a key of the segment? (Not at a segment's edges:
        // then S, dP and the dK / dV products are skipped, P and dS stored as zeros.)
        let live = kw0 + BLK as i32 > 0i32 && kw0 < sw.k_len as i32;
        // (with one stage each tile is issued in the loop, after the barrier that frees the stage)
        if comptime!(q_stages == 2) {
            if n_it > 0 {
                // First tile of the segment, into stage g_tile (issued as the "next" tile of stage
                // g_tile - 1, wrapping at 0): its buffer was last read two tiles ago, by every plane
                // before the P / dS barrier of the previous tile.
                issue_next_q_tile::<E>(
                    &args.q_map, &args.do_map, &args.q_s, &args.do_s, &args.lse, &args.delta, &mut q_smem, &mut do_smem,
                    &mut lse_smem, &mut dl_smem, &bar0, &bar1, g_tile - 1u32, &args.tq_list, t_lo, 0u32, 0u32, 0u32, hk * group,
                    span, args.q_block, r_min as u32, q_len, q_start, args.heads_q, args.total_q, head_dim, threads, sparse, tma,
                    q_stages,
                );
            }
        }
        // The (q head, query tile) pair of iteration `it` as counters (no divisions). Dense: head
        // `hq`, tile `ti`. Sparse: repeat `hq` of the list (q head of an index per kv head),
        // entry `ei`, tile `ti` of the entry's query block.
        let mut hq = 0u32;
        let mut ti = 0u32;
        let mut ei = 0u32;
        for it in 0..n_it {
            // this tile's counters (the one-stage pipeline issues the tile itself, below)
            let hq_now = hq;
            let ti_now = ti;
            let ei_now = ei;
            let mut h = hk * group + hq;
            let mut r0 = r_min as u32 + ti * BWD_BM as u32;
            // Rows of the tile's query block (dense: the segment).
            let mut row_end = q_len;
            if sparse {
                let (ha, ra, re) = sparse_q_tile(&args.tq_list, t_lo, ei, ti, hq, hk * group, span, args.q_block, q_len);
                h = ha;
                r0 = ra;
                row_end = re;
                ti += 1u32;
                if ti == args.q_tiles_per_block {
                    ti = 0u32;
                    ei += 1u32;
                    if ei == t_n {
                        ei = 0u32;
                        hq += 1u32;
                    }
                }
            } else {
                ti += 1u32;
                if ti == n_qt {
                    ti = 0u32;
                    hq += 1u32;
                }
            }
            let cur = g_tile;
            let mut qb = 0usize;
            if comptime!(q_stages == 2) {
                qb = ((cur & 1u32) * BWD_BM as u32) as usize;
            }
            // P / dS rows of this tile. With two stages they were last read two tiles ago, by
            // every plane before the previous tile's P / dS barrier: no barrier here. With one,
            // every plane must have finished the previous tile's dK / dV and dQ products, and the
            // next query tile is issued right after that barrier (after the P / dS barrier
            // instead, it measured slower with fused dQ and its address arithmetic spills at d64).
            let mut pb = 0usize;
            if comptime!(p_stages == 2) {
                pb = qb;
            } else {
                // (the bulk dQ path has this barrier at the end of the previous tile instead)
                if !bulk {
                    sync_cube();
                }
                if comptime!(q_stages == 1) {
                    // one stage: every plane is done with the previous tile, so this tile goes
                    // into it now (no copy overlaps the products)
                    issue_next_q_tile::<E>(
                        &args.q_map, &args.do_map, &args.q_s, &args.do_s, &args.lse, &args.delta, &mut q_smem, &mut do_smem,
                        &mut lse_smem, &mut dl_smem, &bar0, &bar1, cur - 1u32, &args.tq_list, t_lo, ei_now, ti_now, hq_now,
                        hk * group, span, args.q_block, r_min as u32, q_len, q_start, args.heads_q, args.total_q, head_dim,
                        threads, sparse, tma, q_stages,
                    );
                } else if it + 1 < n_it {
                    issue_next_q_tile::<E>(
                        &args.q_map, &args.do_map, &args.q_s, &args.do_s, &args.lse, &args.delta, &mut q_smem, &mut do_smem,
                        &mut lse_smem, &mut dl_smem, &bar0, &bar1, cur, &args.tq_list, t_lo, ei, ti, hq, hk * group, span,
                        args.q_block, r_min as u32, q_len, q_start, args.heads_q, args.total_q, head_dim, threads, sparse, tma,
                        q_stages,
                    );
                }
            }
            wait_stage(&bar0, &bar1, cur);
            g_tile = cur + 1u32;

            // ---- 1. S = Q K^T, dP = dO V^T (32 rows x 32 keys) ----
            #[unroll]
            for i in 0..comptime!(8 * ec) {
                s[i] = 0.0f32;
                dp[i] = 0.0f32;
            }
            if live {
                mma_block_abt::<E, NA, NB, NC>(&def, &q_smem, qb + rw, &k_smem, kw_s, &mut s, head_dim, stride);
                mma_block_abt::<E, NA, NB, NC>(&def, &do_smem, qb + rw, &v_smem, kw_s, &mut dp, head_dim, stride);
            }

            // ---- 2. P, dS (masked unless full) into shared memory ----
            let rr0 = (r0 as usize + rw) as i32;
            #[unroll]
            for ri in 0..4usize {
                let rl = qb + rw + (ri / 2) * 16 + (ri % 2) * 8 + g as usize;
                lse2[ri] = lse_smem[rl] * LOG2E;
                dl[ri] = dl_smem[rl];
            }
            // Every (row, key) pair of this plane's 32 x 32 block visible?
            let full = kw0 >= 0i32
                && kw0 + BLK as i32 <= k_hi as i32
                && rr0 + BLK as i32 <= row_end as i32
                && kw0 + (BLK as i32 - 1i32) <= shift + rr0 + args.win_r as i32
                && kw0 >= shift + rr0 + (BLK as i32 - 1i32) - args.win_l as i32;
            if full {
                probs_store::<E, NA>(
                    &def, &mut s, &mut dp, &lse2, &dl, &lo, &hi, args.scale_log2, &mut p_smem, &mut ds_smem, pb + rw, kw_s, false,
                    pstride,
                );
            } else {
                // Row r (segment-local) sees window keys [max(r + shift - win_l, 0),
                // min(r + shift + win_r + 1, k_hi)), none past the segment's (the query
                // block's) end; relative to the lane's first column kw0 + 2 t.
                let base = kw0 + t2 as i32;
                #[unroll]
                for ri in 0..4usize {
                    let r = rr0 + ((ri / 2) * 16 + (ri % 2) * 8) as i32 + g as i32;
                    let d = r + shift;
                    lo[ri] = max(d - args.win_l as i32, 0i32) - base;
                    let mut h_ = min(d + args.win_r as i32 + 1i32, k_hi as i32) - base;
                    if r >= row_end as i32 {
                        h_ = -1i32;
                    }
                    hi[ri] = h_;
                }
                probs_store::<E, NA>(
                    &def, &mut s, &mut dp, &lse2, &dl, &lo, &hi, args.scale_log2, &mut p_smem, &mut ds_smem, pb + rw, kw_s, true,
                    pstride,
                );
            }
            // P and dS complete; every plane has also finished the previous tile, so the stage it
            // read is free: with two P / dS stages the next query tile is issued here and loads
            // during the products below. Bulk dQ: the rows the previous tile issued have been read
            // before this tile's dQ is stored.
            if bulk {
                dq_rows_read(BWD_BM);
            }
            sync_cube();
            if comptime!(p_stages == 2) {
                if it + 1 < n_it {
                    issue_next_q_tile::<E>(
                        &args.q_map, &args.do_map, &args.q_s, &args.do_s, &args.lse, &args.delta, &mut q_smem, &mut do_smem,
                        &mut lse_smem, &mut dl_smem, &bar0, &bar1, cur, &args.tq_list, t_lo, ei, ti, hq, hk * group, span,
                        args.q_block, r_min as u32, q_len, q_start, args.heads_q, args.total_q, head_dim, threads, sparse, tma,
                        q_stages,
                    );
                }
            }

            // ---- 3. dV += P^T dO, dK += dS^T Q (32 keys x head_dim / 2, the tile's 64 rows) ----
            if live {
                #[unroll]
                for ks in 0..comptime!(BWD_BM / 16) {
                    mma_block_atb::<E, NA, NB, NC>(&def, &p_smem, pb, ks * 16, kw_s, &do_smem, qb, cb, &mut dv_acc, hn, stride);
                    mma_block_atb::<E, NA, NB, NC>(&def, &ds_smem, pb, ks * 16, kw_s, &q_smem, qb, cb, &mut dk_acc, hn, stride);
                }
            }

            if fuse_dq {
                // ---- dQ[rows rw..rw+32, columns cq..cq+dqn] += dS K, f32 atomics (scaled later) ----
                #[unroll]
                for i in 0..comptime!(2 * oq_n * ec) {
                    dqc[i] = 0.0f32;
                }
                #[unroll]
                for ks in 0..comptime!(WIDE_BN / 16) {
                    let a0 = frag_a::<E, NA>(&def, &ds_smem, pb + rw, ks * 16, pstride);
                    let a1 = frag_a::<E, NA>(&def, &ds_smem, pb + rw + 16, ks * 16, pstride);
                    #[unroll]
                    for ob2 in 0..comptime!(oq_n / 2) {
                        let m = frag_b_n2::<E, NB>(&def, &k_smem, ks * 16, cq + ob2 * 16, stride);
                        mma_into::<E, NA, NB, NC>(&def, &a0, &m, 0usize, &mut dqc, (2 * ob2) * ec);
                        mma_into::<E, NA, NB, NC>(&def, &a0, &m, 2usize, &mut dqc, (2 * ob2 + 1) * ec);
                        mma_into::<E, NA, NB, NC>(&def, &a1, &m, 0usize, &mut dqc, (oq_n + 2 * ob2) * ec);
                        mma_into::<E, NA, NB, NC>(&def, &a1, &m, 2usize, &mut dqc, (oq_n + 2 * ob2 + 1) * ec);
                    }
                    if comptime!(oq_n % 2 == 1) {
                        // the plane's last 8 columns (head_dim / 4 an odd number of 8-column
                        // blocks: d32, d96); the fragment's second half reads the next 8 columns
                        // (the next plane's, or the row's padding) and is not used
                        let m = frag_b_n2::<E, NB>(&def, &k_smem, ks * 16, cq + comptime!((oq_n - 1) * 8), stride);
                        mma_into::<E, NA, NB, NC>(&def, &a0, &m, 0usize, &mut dqc, comptime!((oq_n - 1) * ec));
                        mma_into::<E, NA, NB, NC>(&def, &a1, &m, 0usize, &mut dqc, comptime!((2 * oq_n - 1) * ec));
                    }
                }
                if bulk {
                    // into the shared tile (in vectors: the lane's first element, then constant
                    // offsets), added from the end of the tile on, rows before row_end only
                    let sv = ((rw + g as usize) * dts + cq + t2 as usize) / qvec;
                    #[unroll]
                    for ri in 0..4usize {
                        #[unroll]
                        for ob in 0..oq_n {
                            let e = (ri % 2) * (ec / 2);
                            let i = ((ri / 2) * oq_n + ob) * ec + e;
                            let si = sv + comptime!((((ri / 2) * 16 + (ri % 2) * 8) * dts + ob * 8) / qvec);
                            put_dq_pair::<NQ>(&mut dq_tile, si, dqc[i], dqc[i + 1], qvec);
                        }
                    }
                    sync_async_proxy_shared();
                    let n_rows = select(r0 < row_end, min(row_end - r0, BWD_BM as u32), 0u32);
                    let dst = dq_row_dst(q_start + r0, n_rows, h, args.heads_q, head_dim, qvec);
                    // the tile complete (and every plane done with this tile's shared memory: the
                    // barrier the next tile would start with), then one row per thread
                    sync_cube();
                    issue_dq_row::<NQ>(&dq_tile, &mut args.dq_rows, dst, head_dim, qvec);
                } else {
                    // Rows past the segment's end add 0.0 to a row that exists (the last row of the
                    // tensor at most): no branch around the atomics, and x + 0.0 == x.
                    let last = args.total_q - 1u32;
                    #[unroll]
                    for ri in 0..4usize {
                        let rl = r0 + (rw + (ri / 2) * 16 + (ri % 2) * 8) as u32 + g;
                        let ok = rl < row_end;
                        // in units of qvec floats (a multiple of qvec: t2, cq and head_dim are even), so
                        // the 8-column steps below are constant offsets of one address per row
                        let gv = (((min(q_start + rl, last)) * args.heads_q + h) as usize * head_dim + cq + t2 as usize) / qvec;
                        #[unroll]
                        for ob in 0..oq_n {
                            // accumulator pair (e, e + 1) of row half ri % 2: adjacent columns
                            let e = (ri % 2) * (ec / 2);
                            let i = ((ri / 2) * oq_n + ob) * ec + e;
                            let x0 = select(ok, dqc[i], 0.0f32);
                            let x1 = select(ok, dqc[i + 1], 0.0f32);
                            add_dq_pair::<NQ>(&args.dq_acc, gv + ob * comptime!(8 / qvec), x0, x1, qvec);
                        }
                    }
                }
            }
        }
    }

    if bulk {
        // the last tile's rows are read before the shared memory is released
        dq_rows_read(BWD_BM);
    }

    // ---- write dK, dV (zero for keys no segment sees; sparse: the item's keys only) ----
    #[unroll]
    for mb in 0..2usize {
        #[unroll]
        for ob in 0..ob_n {
            #[unroll]
            for e in 0..ec {
                let (row, col) = def.position_of_nth(lane, e as u32, MatrixIdent::Accumulator);
                let key = key0 + (kw_s + mb * 16) as u32 + row;
                if key < key_lim {
                    let gi = (kv_row(key, &args.tq_list,
                        paged) * args.heads_kv + hk) as usize * head_dim + cb + ob * 8 + col as usize;
                    let i = (mb * ob_n + ob) * ec + e;
                    args.dk[gi] = E::cast_from(dk_acc[i] * args.scale);
                    args.dv[gi] = E::cast_from(dv_acc[i]);
                }
            }
        }
    }
}
