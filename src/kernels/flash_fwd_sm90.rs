//! Flash-attention forward on Hopper (sm_90a): warpgroup MMAs (`kernels::sm90`) over
//! 128-byte-swizzled shared tiles that tensor-map copies fill.
//!
//! The work list, slices, row bounds, key tiles (dense, paged, block-sparse), the conditional
//! rescale, the LSE and the split-K partials are those of `kernels::flash_fwd` (same host plan,
//! same card: `cards::FwdCard`); only the mainloop differs. One cube = 128 packed rows = two warpgroups
//! of 64 rows (256 threads), two cubes per SM. Per key tile of `block_n` keys (128 at d64, 64 at
//! d128: what lets two cubes share an SM's shared memory and registers), each warpgroup computes
//! S = Q K^T (`head_dim / 16` MMAs m64 x block_n x k16, both operands in shared memory), masks and
//! exponentiates it in registers, and adds P V (`block_n / 16` MMAs m64 x head_dim x k16, P from
//! registers: the f32 S accumulator packed to pairs is the A operand, V the MN-major B operand read
//! in place). K and V are double-buffered: K(t + 1) is issued (tensor-map copies, one thread) at
//! the top of tile t, after the cube's one barrier of the tile, V(t + 1) once V(t) has landed (a
//! thread's arrival for a barrier's next phase must follow its wait for the current one); both
//! land during tile t.
//! The Q tile (rows gathered by token and head) is copied by every thread with `cp.async` into the
//! same swizzled layout.

use cubecl::prelude::*;
use cubecl::prelude::barrier::{copy_async, Barrier};

use super::cards::FwdCard;
use super::fp8_v::vt_col_base;
use super::int8_qk::{dot_biased, MAGIC};
use super::flash_fwd::{fill_rows, rows_key_end, tile_bounds, work_item, LIST_SMEM, M_INIT, NONE, RESCALE_SLACK, SLICE_WORDS};
use super::kv_tiles::{issue_tile_boxes, tile_rows};
use super::math::{fast_exp2, LN2};
use super::sm90::{copy16_out, fence_proxy_async, named_barrier_at, pack_a_pairs, pack_p_e4m3, store_pair, store_pair_shared, swizzle_128b, wgmma_commit, wgmma_fence, wgmma_rs, wgmma_rs_e4m3,
    wgmma_ss, wgmma_ss_s8, wgmma_wait, SW_COLS, SW_ROW};
use super::staging::commit_copies;
use crate::format::KV_PAGE;
use crate::sparse::FP8_P_SCALE;

/// Packed rows per cube: two warpgroups of 64.
pub const SM90_BLOCK_M: usize = 128;
// the host plan's work items are `flash_fwd::BLOCK_M` rows
const _: () = assert!(SM90_BLOCK_M == super::flash_fwd::BLOCK_M);
/// Threads per cube.
pub const SM90_THREADS: usize = 256;

/// Row `(row, col)` inside the m16n8 accumulator block of lane `lane`'s element `e` (0..4).
#[cube]
pub(super) fn acc_row(lane: u32, #[comptime] e: usize) -> u32 {
    lane / 4u32 + comptime!((e / 2) as u32 * 8)
}

#[cube]
pub(super) fn acc_col(lane: u32, #[comptime] e: usize) -> u32 {
    (lane % 4u32) * 2u32 + comptime!((e % 2) as u32)
}

/// `row_a` for accumulator half 0 (elements 0, 1), `row_b` for half 1.
#[cube]
pub(super) fn pick_row(#[comptime] i: usize, row_a: usize, row_b: usize) -> usize {
    let mut r = row_b;
    if i == 0 {
        r = row_a;
    }
    r
}

/// `S = Q K^T` over one key tile, Q (this warpgroup's rows from element `q_wg`) and K (the tile at
/// element `base`) K-major in shared memory: `head_dim / 16` MMAs m64 x block_n x k16 into `s`, or
/// with `int8` (int8 rows in natural channel order, `int8_qk`: `head_dim` bytes a row, `head_dim
/// / 2` elements of `E`) `head_dim / 32` MMAs m64 x block_n x k32 into the exact i32 dot products
/// `s_i`. A k32 step of int8 is 32 bytes = 16 elements of E, as a k16 step of 16-bit operands, so
/// both walk the same offsets. `q_rows`: the rows of the Q tile (its 64-column chunks are
/// `q_rows` rows apart, `sm90::swizzle_128b`). The caller fences before and commits after.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn s_steps<E: Float>(
    s: &mut Array<f32>,
    s_i: &mut Array<i32>,
    q_smem: &SharedMemory<E>,
    q_wg: usize,
    k_smem: &SharedMemory<E>,
    base: usize,
    #[comptime] block_n: usize,
    #[comptime] head_dim: usize,
    #[comptime] int8: bool,
    #[comptime] q_rows: usize,
) {
    #[unroll]
    for kk in 0..comptime!(if int8 { head_dim / 32 } else { head_dim / 16 }) {
        let chunk = comptime!(kk / 4);
        let within = comptime!((kk % 4) * 16);
        let a_off = q_wg + comptime!(chunk * q_rows * SW_COLS + within);
        let b_off = base + comptime!(chunk * block_n * SW_COLS + within);
        if int8 {
            wgmma_ss_s8::<E>(s_i, q_smem, a_off as u32, k_smem, b_off as u32, block_n, comptime!(kk > 0));
        } else {
            wgmma_ss::<E>(s, q_smem, a_off as u32, k_smem, b_off as u32, 0usize, block_n, false, 0u32, false, 0u32, comptime!(kk > 0));
        }
    }
}

/// Sets the scores of keys outside each row's range `[row_lo, min(row_hi, t1))` to `neg_inf`;
/// only tiles that cross some row's range limits of this warp pay for it (`rows_lo`, `rows_hi`:
/// the tightest bounds of the lane's two rows, `t0` the tile's first key).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn mask_scores(
    s: &mut Array<f32>,
    row_lo: &SharedMemory<u32>,
    row_hi: &SharedMemory<u32>,
    row_a: usize,
    row_b: usize,
    t0: u32,
    t1: u32,
    rows_lo: u32,
    rows_hi: u32,
    lane: u32,
    neg_inf: f32,
    #[comptime] block_n: usize,
) {
    let tn = t0 + block_n as u32;
    if plane_any(t0 < rows_lo || tn > min(rows_hi, t1)) {
        #[unroll]
        for i in 0..2usize {
            let tr = pick_row(i, row_a, row_b);
            let lo = row_lo[tr];
            let hi = min(row_hi[tr], t1);
            #[unroll]
            for nb in 0..comptime!(block_n / 8) {
                #[unroll]
                for e2 in 0..2usize {
                    let e = i * 2 + e2;
                    let key = t0 + nb as u32 * 8 + acc_col(lane, e);
                    if key < lo || key >= hi {
                        s[nb * 4 + e] = neg_inf;
                    }
                }
            }
        }
    }
}

/// Online softmax of one tile's scores (base 2, conditional rescale: `flash_fwd` module docs):
/// the rows' reference maxima `m_r` move only past `RESCALE_SLACK`, `alpha` gets each row's
/// factor for O (1 where it stayed), `s` becomes P, `l_r` the rescaled row sums plus this tile's.
/// Returns whether any row of the warp moved (O must then be rescaled by `alpha`). `int8`: `s`
/// holds the exact dot products biased by `int8_qk::MAGIC` (`int8_qk::dot_biased`) and `sl` this
/// lane's two factors to base-2 scores (Q scale x K scale x `scale_log2`) in place of
/// `scale_log2`: the row maxima are unbiased exactly, and the bias goes into each row's exponent
/// constant (`MAGIC f + m`, rounded once: an error under half a dot unit, far below the
/// quantisation's), so a score costs one integer add more than a 16-bit one. `fp8` (FP8 P.V): no
/// slack (the references follow every rise, so P <= 1) and P, the row sums with it, scaled by 256.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn softmax_scores(
    s: &mut Array<f32>,
    m_r: &mut Array<f32>,
    l_r: &mut Array<f32>,
    alpha: &mut Array<f32>,
    scale_log2: f32,
    sl: &Array<f32>,
    neg_inf: f32,
    #[comptime] block_n: usize,
    #[comptime] int8: bool,
    #[comptime] fp8: bool,
) -> bool {
    let n_blocks = comptime!(block_n / 8);
    let mut moved = false;
    #[unroll]
    for i in 0..2usize {
        let mut mx = neg_inf;
        #[unroll]
        for nb in 0..n_blocks {
            #[unroll]
            for e2 in 0..2usize {
                mx = max(mx, s[nb * 4 + i * 2 + e2]);
            }
        }
        if int8 {
            // biased dot products, and the lanes of a row may hold different K scales
            // (per_thread): this lane's factor to base-2 scores first
            mx = (mx - MAGIC) * sl[i];
        }
        mx = max(mx, plane_shuffle_xor(mx, 1u32));
        mx = max(mx, plane_shuffle_xor(mx, 2u32));
        if !int8 {
            mx *= scale_log2;
        }
        let old = m_r[i];
        let mut new = old;
        // FP8 P.V: every rise moves the reference (P <= 1, so 256 P fits e4m3's 448)
        let slack = comptime!(if fp8 { 0.0f32 } else { RESCALE_SLACK });
        if mx > old + slack {
            new = mx;
            moved = true;
        }
        alpha[i] = fast_exp2(old - new);
        m_r[i] = new;
    }
    #[unroll]
    for i in 0..2usize {
        let mut ref_m = m_r[i];
        if fp8 {
            // P scaled by FP8_P_SCALE (so are the row sums: it cancels in O; the LSE takes it out)
            ref_m -= comptime!(FP8_P_SCALE.log2());
        }
        let mut f = scale_log2;
        if int8 {
            f = sl[i];
            ref_m = MAGIC * f + ref_m;
        }
        let mut sum = 0.0f32;
        #[unroll]
        for nb in 0..n_blocks {
            #[unroll]
            for e2 in 0..2usize {
                let idx = nb * 4 + i * 2 + e2;
                let pv = fast_exp2(s[idx] * f - ref_m);
                s[idx] = pv;
                sum += pv;
            }
        }
        l_r[i] = l_r[i] * alpha[i] + sum;
    }
    plane_any(moved)
}

/// O's two rows of this lane times their `alpha`.
#[cube]
pub(super) fn rescale_o(o_acc: &mut Array<f32>, alpha: &Array<f32>, #[comptime] head_dim: usize) {
    #[unroll]
    for i in 0..2usize {
        #[unroll]
        for ob in 0..comptime!(head_dim / 8) {
            #[unroll]
            for e2 in 0..2usize {
                o_acc[ob * 4 + i * 2 + e2] *= alpha[i];
            }
        }
    }
}

/// `O += P V` over one key tile: `block_n / 16` MMAs m64 x head_dim x k16, P from the packed A
/// registers `p`, V the MN-major tile at element `base` of `v_smem` (column chunks `block_n` rows
/// apart). The caller fences before and commits after.
#[cube]
pub(super) fn pv_steps<E: Float>(
    o_acc: &mut Array<f32>,
    p: &Array<Vector<E, Const<2>>>,
    v_smem: &SharedMemory<E>,
    base: usize,
    #[comptime] block_n: usize,
    #[comptime] head_dim: usize,
) {
    let v_lbo = comptime!((block_n * SW_ROW) as u32);
    #[unroll]
    for ks in 0..comptime!(block_n / 16) {
        let b_off = base + comptime!(ks * 16 * SW_COLS);
        wgmma_rs::<E>(o_acc, p, v_smem, b_off as u32, 0usize, comptime!(4 * ks), head_dim, true, v_lbo, true);
    }
}

/// `O += P V` over one key tile in FP8: `block_n / 32` MMAs m64 x head_dim x k32, P the e4m3 A words
/// `p8` (`sm90::pack_p_e4m3`), V^T the 64-byte-swizzled tile of `head_dim` rows of `block_n` keys
/// at element `base` of `v_smem` (`fp8_v`). The caller fences before and commits after.
#[cube]
fn pv_steps_e4m3<E: Float>(
    o_acc: &mut Array<f32>,
    p8: &Array<u32>,
    v_smem: &SharedMemory<E>,
    base: usize,
    #[comptime] block_n: usize,
    #[comptime] head_dim: usize,
) {
    #[unroll]
    for ks in 0..comptime!(block_n / 32) {
        // 32 bytes = 16 elements of E per k32 step
        let b_off = base + comptime!(ks * 16);
        wgmma_rs_e4m3::<E>(o_acc, p8, v_smem, b_off as u32, comptime!(4 * ks), head_dim);
    }
}

/// The Q tile of a Hopper forward cube into the 128-byte-swizzled `q_smem`: `block_m` rows of
/// `row_e` elements (int8 rows as pairs of E), 16-byte `cp.async` copies by the `units` units
/// numbered `unit`; rows without a token copy token 0 (their key range is empty). The copies may
/// not fill the units (a decode tile's few rows): only then is each one guarded.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_q_tile<E: Float>(
    q_s: &Array<E>,
    q_smem: &mut SharedMemory<E>,
    row_tok: &SharedMemory<u32>,
    row_head: &SharedMemory<u32>,
    heads_q: u32,
    unit: usize,
    #[comptime] row_e: usize,
    #[comptime] block_m: usize,
    #[comptime] units: usize,
) {
    let copies = comptime!(block_m * (row_e / 8));
    #[unroll]
    for it in 0..comptime!(copies.div_ceil(units)) {
        let idx = unit + it * units;
        if comptime!(copies % units == 0) {
            copy_q_unit(q_s, q_smem, row_tok, row_head, heads_q, idx, row_e, block_m);
        } else if idx < copies {
            copy_q_unit(q_s, q_smem, row_tok, row_head, heads_q, idx, row_e, block_m);
        }
    }
}

/// Copy `idx` of [`copy_q_tile`]: 8 elements of a Q row into their swizzled place.
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_q_unit<E: Float>(
    q_s: &Array<E>,
    q_smem: &mut SharedMemory<E>,
    row_tok: &SharedMemory<u32>,
    row_head: &SharedMemory<u32>,
    heads_q: u32,
    idx: usize,
    #[comptime] row_e: usize,
    #[comptime] block_m: usize,
) {
    let vecs = comptime!(row_e / 8);
    let r = idx / vecs;
    let c = (idx % vecs) * 8;
    let mut tok = row_tok[r];
    if tok == NONE {
        tok = 0u32;
    }
    let g = (tok * heads_q + row_head[r]) as usize * row_e + c;
    let s = swizzle_128b(r, c, block_m);
    copy_async(&q_s.slice(g, g + 8), &mut q_smem.slice_mut(s, s + 8), comptime!(8u32));
}

/// One key tile's scores into P: S = Q K^T by wgmma from the K tile at element `cur_k` of
/// `k_smem` (`int8`: the raw dot products, then this lane's factors from the tile's K scales),
/// the mask of keys `[t0, t1)`, the online softmax (`softmax_scores`), O rescaled where a row's
/// reference moved, and P packed as the P.V operand (`p`, or `p8` in e4m3 with `fp8_pv`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn score_tile<E: Float>(
    args: &FwdCard<E>,
    s: &mut Array<f32>,
    s_i: &mut Array<i32>,
    q_smem: &SharedMemory<E>,
    q_wg: usize,
    k_smem: &SharedMemory<E>,
    cur_k: usize,
    head_kv: u32,
    keys: (u32, u32),
    q_sl: &Array<f32>,
    sl: &mut Array<f32>,
    row_lo: &SharedMemory<u32>,
    row_hi: &SharedMemory<u32>,
    rows: (usize, usize, u32, u32),
    lane: u32,
    neg_inf: f32,
    m_r: &mut Array<f32>,
    l_r: &mut Array<f32>,
    alpha: &mut Array<f32>,
    o_acc: &mut Array<f32>,
    p: &mut Array<Vector<E, Const<2>>>,
    p8: &mut Array<u32>,
    #[comptime] block_n: usize,
    #[comptime] head_dim: usize,
    #[comptime] int8: bool,
    #[comptime] fp8_pv: bool,
    #[comptime] q_rows: usize,
) {
    let (t0, t1) = keys;
    let (row_a, row_b, rows_lo, rows_hi) = rows;
    wgmma_fence();
    s_steps::<E>(s, s_i, q_smem, q_wg, k_smem, cur_k, block_n, head_dim, int8, q_rows);
    wgmma_commit();
    if int8 {
        let key = min(t0 + 2u32 * (lane % 4u32), t1 - 1u32);
        let ks = args.part_o[(key * args.heads_kv + head_kv) as usize];
        #[unroll]
        for i in 0..2usize {
            sl[i] = max(q_sl[i] * ks, 1.175_494_4e-38f32);
        }
    }
    wgmma_wait(0u32);
    if int8 {
        #[unroll]
        for i in 0..comptime!(block_n / 2) {
            s[i] = dot_biased(s_i[i]);
        }
    }
    mask_scores(s, row_lo, row_hi, row_a, row_b, t0, t1, rows_lo, rows_hi, lane, neg_inf, block_n);
    let moved = softmax_scores(s, m_r, l_r, alpha, args.scale_log2, sl, neg_inf, block_n, int8, fp8_pv);
    if moved {
        rescale_o(o_acc, alpha, head_dim);
    }
    if fp8_pv {
        pack_p_e4m3(s, p8, comptime!(block_n / 32));
    } else {
        pack_a_pairs::<E>(s, p, comptime!(block_n / 4));
    }
}

/// Unit 0 raises `bar`'s expected bytes by one FP8 V^T tile (`head_dim` rows of 64 keys, one byte
/// each) and issues its tensor-map copy (rows of kv head `head_kv`, from byte `col` of each row:
/// `fp8_v`) into element `base` of `smem`.
#[cube]
fn issue_vt_tile<E: Float>(map: &TensorMap<E, Tiled>, smem: &mut SharedMemory<E>, bar: &Barrier, base: usize, col: u32, head_kv: u32,
    #[comptime] head_dim: usize) {
    if UNIT_POS == 0 {
        bar.expect_tx(comptime!((head_dim * 64) as u32));
        bar.tma_load_2d(map, &mut smem.slice_mut(base, base + comptime!(head_dim * 32)), (head_kv * head_dim as u32) as i32, col as i32);
    }
}

/// The Hopper forward kernel; its arguments are the forward card (`cards::FwdCard`), as those of
/// `flash_fwd::flash_fwd_mma2` (`k_s` / `v_s` are read only through the maps). `int8`
/// (block-sparse, SageAttention style): Q K^T from int8 rows by `wgmma .s32.s8.s8`, the card's
/// arrays used as `flash_fwd_mma2`'s INT8 variant uses them (`q_s` the int8 Q rows, `k_map` a
/// map over the int8 K rows, `part_o` the K scales, `part_lse` the Q scales and LSE corrections;
/// `int8_qk` with its natural channel order), P.V unchanged. `fp8_pv` (with `int8`, 64-key tiles):
/// P.V in FP8 e4m3 (`fp8_v`: `v_map` a byte map over V^T, its per-channel scales in `part_lse`
/// after the Q part, at `2 heads_q total_q`), P scaled by 256 and rounded in registers.
/// `k_map` / `v_map`: 128-byte-swizzled maps with 64-column x `kv_tiles::box_rows` boxes.
#[allow(clippy::too_many_arguments, clippy::eq_op, unused_variables)]
#[cube(launch_unchecked)]
pub fn flash_fwd_sm90<E: Float>(
    args: &mut FwdCard<E>,
    #[comptime] head_dim: usize,
    #[comptime] block_n: usize,
    #[comptime] sparse: bool,
    #[comptime] paged: bool,
    #[comptime] check_v: bool,
    #[comptime] int8: bool,
    #[comptime] fp8_pv: bool,
) {
    // v holds a NaN or Inf (`nonfinite::v_nonfinite`, or with `check_v` a cube that saw one in
    // its V tiles): the exact row-wise kernel writes this call
    if args.nonfinite[0] != 0u32 {
        terminate!();
    }
    let threads = comptime!(SM90_THREADS);
    let block_m = comptime!(SM90_BLOCK_M);
    let lane = UNIT_POS_PLANE;
    // the warp and warpgroup index broadcast from lane 0: values the compiler knows are uniform
    // across the warp, so the MMA descriptors built from them stay in uniform registers
    let warp = plane_broadcast(UNIT_POS / 32u32, 0u32);
    let wg = (warp / 4u32) as usize;
    // first row (inside the cube tile) of this thread's warp
    let prow = wg * 64 + ((warp % 4u32) * 16u32) as usize;

    let tile_e = comptime!(block_n * head_dim);
    // elements of E per Q / K row: int8 rows are head_dim bytes
    let qk_e = comptime!(if int8 { head_dim / 2 } else { head_dim });
    let tile_k = comptime!(block_n * qk_e);
    let mut q_smem = SharedMemory::<E>::new_aligned(comptime!(block_m * qk_e), 1024usize);
    // FP8 P.V: a stage holds two key tiles (`pairs` below), so K and V^T take four tiles each
    let stage_tiles = comptime!(if fp8_pv { 2usize } else { 1usize });
    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(2 * stage_tiles * tile_k), 1024usize);
    // FP8 V^T: head_dim rows of block_n bytes (block_n / 2 elements of E)
    let tile_v = comptime!(if fp8_pv { block_n * head_dim / 2 } else { block_n * head_dim });
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(2 * stage_tiles * tile_v), 1024usize);
    let mut row_tok = SharedMemory::<u32>::new(block_m);
    let mut row_head = SharedMemory::<u32>::new(block_m);
    let mut row_lo = SharedMemory::<u32>::new(block_m);
    let mut row_hi = SharedMemory::<u32>::new(block_m);
    let bar_k = Barrier::shared(comptime!(threads as u32), UNIT_POS == 0);
    let bar_v = Barrier::shared(comptime!(threads as u32), UNIT_POS == 0);

    let mut list_smem = SharedMemory::<u32>::new(comptime!(if sparse { LIST_SMEM } else { 1usize }));
    let wi = work_item(&args.work, &args.tile_ref, &args.blocks, &mut list_smem, args.heads_q, args.heads_kv, args.hp,
        args.tiles_per_block, args.kv_outer, threads, block_n, sparse);
    let (y, head_base, head_kv) = (wi.y, wi.head_base, wi.head_kv);
    let (slice_off, n_slices, klo, slot) = (wi.slice_off, wi.n_slices, wi.klo, wi.slot);
    let (list, tpb_magic) = (wi.list, wi.tpb_magic);
    let mut khi = wi.khi;
    let mut n_tiles = wi.n_tiles;
    // FP8 V^T: the item's sequence (block-sparse: one) and its first byte in a V^T row, less its
    // first key (a tile from key t0 starts at byte vt_off + t0)
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
    // `check_v` (a few rows a tile, dense): the key tiles end at the last key a row sees, which
    // the plan does not know when the device wrote the key counts (`kv_append`: a decode step
    // planned over full cache rows)
    if comptime!(check_v && !sparse) {
        let mut red = SharedMemory::<u32>::new(comptime!(block_m / 32));
        khi = min(khi, rows_key_end(&row_hi, &mut red, block_m));
        n_tiles = 0u32;
        if khi > klo {
            n_tiles = (khi - klo + block_n as u32 - 1) / block_n as u32;
        }
    }

    // FP8 P.V: the key bounds of the current pair's tiles (`a0 .. a1`, `b0 .. b1`)
    let mut a0 = 0u32;
    let mut a1 = 0u32;
    let mut b0 = 0u32;
    let mut b1 = 0u32;
    // Q tile (swizzled, 16-byte cp.async per unit; rows without a token copy token 0: their key
    // range is empty) and K(0) on bar_k, V(0) on bar_v
    if n_tiles > 0 {
        let (f0, f1) = tile_bounds(0u32, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
            tpb_magic, block_n, sparse);
        a0 = f0;
        a1 = f1;
        copy_q_tile::<E>(&args.q_s, &mut q_smem, &row_tok, &row_head, args.heads_q, UNIT_POS as usize, qk_e, block_m, threads);
        let (p0, _p1, pb) = tile_rows(f0, f1, &args.blocks, paged, block_n);
        issue_tile_boxes(&args.k_map, &mut k_smem, &bar_k, 0usize, p0, pb, head_kv, block_n, qk_e, true);
        // FP8 P.V: tile 1 into the first stage's second half
        if fp8_pv {
            if n_tiles > 1u32 {
                let (x0, x1) = tile_bounds(1u32, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
                    tpb_magic, block_n, sparse);
                b0 = x0;
                b1 = x1;
                issue_tile_boxes(&args.k_map, &mut k_smem, &bar_k, tile_k, x0, x0 + KV_PAGE as u32, head_kv, block_n, qk_e, true);
            }
        }
        commit_copies(&bar_k);
        if fp8_pv {
            issue_vt_tile(&args.v_map, &mut v_smem, &bar_v, 0usize, vt_off + f0, head_kv, head_dim);
            if n_tiles > 1u32 {
                issue_vt_tile(&args.v_map, &mut v_smem, &bar_v, tile_v, vt_off + b0, head_kv, head_dim);
            }
        } else {
            issue_tile_boxes(&args.v_map, &mut v_smem, &bar_v, 0usize, p0, pb, head_kv, block_n, head_dim, true);
        }
        commit_copies(&bar_v);
    }

    let o_n = comptime!(head_dim / 2);
    let s_n = comptime!(block_n / 2);
    let o_blocks = comptime!(head_dim / 8);
    let mut o_acc = Array::<f32>::new(o_n);
    #[unroll]
    for i in 0..o_n {
        o_acc[i] = 0.0f32;
    }
    let mut s = Array::<f32>::new(s_n);
    let mut p = Array::<Vector<E, Const<2>>>::new(comptime!(if fp8_pv { 1usize } else { block_n / 4 }));
    let mut p8 = Array::<u32>::new(comptime!(if fp8_pv { block_n / 8 } else { 1usize }));
    let neg_inf = -args.inf;
    let mut m_r = Array::<f32>::new(2usize);
    let mut l_r = Array::<f32>::new(2usize);
    let (row_a, row_b, rows_lo, rows_hi) = lane_rows(&mut m_r, &mut l_r, &row_lo, &row_hi, prow, lane, klo, khi);
    // element offsets of this warpgroup's Q rows in each chunk, and of a tile's chunks
    let q_wg = wg * comptime!(64 * SW_COLS);
    let mut alpha = Array::<f32>::new(2usize);
    // int8: the raw dot products of S, each row's Q scale times scale_log2, and per tile this
    // lane's two factors to base-2 scores (times its K scale: one per tile and lane in every
    // granularity, its columns 2 (lane % 4) + {0, 1} of each n8 block share it, as in
    // `flash_fwd_mma2`)
    let mut s_i = Array::<i32>::new(comptime!(if int8 { s_n } else { 1usize }));
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
    // Tile t: S(t), its softmax, then P(t) V(t), each MMA group waited for at once; two cubes per
    // SM (the host's launch bounds) overlap one's softmax with the other's MMAs. (FlashAttention-3's
    // in-cube overlap of S(t) with P(t - 1) V(t - 1) needs the registers of a second S: one cube
    // per SM, or spills at two; measured slower at both head dims, docs/forward.md.)
    // `check_v` (calls of few rows a tile, memory-bound: a decode step): each thread checks its
    // share of every V tile for a NaN or Inf (x - x is not 0) and the cube sets the flag itself,
    // instead of a pass over all of v before the launch
    let mut v_bad = false;
    if fp8_pv {
        // FP8 P.V: the tiles in pairs, one stage (K and V^T of both) per pair: one wait per
        // barrier, one cube barrier and one copy issue per pair instead of per tile; each tile's
        // scores, softmax and P.V exactly as one tile below (the 64-key running max of the rule)
        for kp in 0..(n_tiles + 1u32) / 2u32 {
            let ka = kp * 2u32;
            bar_k.wait_parity(kp & 1u32);
            if kp == 0 {
                fence_proxy_async();
            }
            // every warpgroup is done with pair p - 1: its stage takes pair p + 1
            sync_cube();
            let cur_k = ((kp & 1u32) as usize) * comptime!(2 * tile_k);
            let cur_v = ((kp & 1u32) as usize) * comptime!(2 * tile_v);
            let nxt_k = comptime!(2 * tile_k) - cur_k;
            let nxt_v = comptime!(2 * tile_v) - cur_v;
            let has_a = ka + 2u32 < n_tiles;
            let has_b = ka + 3u32 < n_tiles;
            let mut na0 = 0u32;
            let mut na1 = 0u32;
            let mut nb0 = 0u32;
            let mut nb1 = 0u32;
            if has_a {
                let (x0, x1) = tile_bounds(ka + 2u32, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
                    tpb_magic, block_n, sparse);
                na0 = x0;
                na1 = x1;
                issue_tile_boxes(&args.k_map, &mut k_smem, &bar_k, nxt_k, x0, x0 + KV_PAGE as u32, head_kv, block_n, qk_e, true);
            }
            if has_b {
                let (x0, x1) = tile_bounds(ka + 3u32, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
                    tpb_magic, block_n, sparse);
                nb0 = x0;
                nb1 = x1;
                issue_tile_boxes(&args.k_map, &mut k_smem, &bar_k, nxt_k + tile_k, x0, x0 + KV_PAGE as u32, head_kv, block_n, qk_e, true);
            }
            if has_a {
                commit_copies(&bar_k);
            }
            let rows = (row_a, row_b, rows_lo, rows_hi);
            // A listed key block that ends past the sequence's keys can hold a 64-key tile wholly
            // past them (t0 >= t1: a 128-key block over the last 8 keys). Its V^T bytes lie past
            // the ones `fp8_v` writes (never written: a NaN byte there times P = 0 is NaN), and
            // every score is masked (P = 0, the reference unmoved), so such a tile is skipped;
            // its copies still land (the barriers count them). Each MMA sequence, issue to wait,
            // stays inside its branch.
            let live_a = a0 < a1;
            let live_b = ka + 1u32 < n_tiles && b0 < b1;
            if live_a {
                score_tile::<E>(args, &mut s, &mut s_i, &q_smem, q_wg, &k_smem, cur_k, head_kv, (a0, a1), &q_sl, &mut sl, &row_lo,
                    &row_hi, rows, lane, neg_inf, &mut m_r, &mut l_r, &mut alpha, &mut o_acc, &mut p, &mut p8, block_n, head_dim, int8,
                    fp8_pv, SM90_BLOCK_M);
            }
            // the next pair's V^T is issued only after this thread saw this pair's land
            bar_v.wait_parity(kp & 1u32);
            if has_a {
                issue_vt_tile(&args.v_map, &mut v_smem, &bar_v, nxt_v, vt_off + na0, head_kv, head_dim);
            }
            if has_b {
                issue_vt_tile(&args.v_map, &mut v_smem, &bar_v, nxt_v + tile_v, vt_off + nb0, head_kv, head_dim);
            }
            if has_a {
                commit_copies(&bar_v);
            }
            if live_a {
                wgmma_fence();
                pv_steps_e4m3::<E>(&mut o_acc, &p8, &v_smem, cur_v, block_n, head_dim);
                wgmma_commit();
                wgmma_wait(0u32);
            }
            if live_b {
                score_tile::<E>(args, &mut s, &mut s_i, &q_smem, q_wg, &k_smem, cur_k + tile_k, head_kv, (b0, b1), &q_sl, &mut sl, &row_lo,
                    &row_hi, rows, lane, neg_inf, &mut m_r, &mut l_r, &mut alpha, &mut o_acc, &mut p, &mut p8, block_n, head_dim, int8,
                    fp8_pv, SM90_BLOCK_M);
                wgmma_fence();
                pv_steps_e4m3::<E>(&mut o_acc, &p8, &v_smem, cur_v + tile_v, block_n, head_dim);
                wgmma_commit();
                wgmma_wait(0u32);
            }
            a0 = na0;
            a1 = na1;
            b0 = nb0;
            b1 = nb1;
        }
    }
    // `check_v` (few rows a tile, a decode step): whether this warpgroup's 64 rows hold a query
    // row (the rows fill the tile from row 0; one warpgroup of a decode step's cube has none)
    let mut live = true;
    if comptime!(check_v) {
        live = row_tok[wg * 64] != NONE;
    }
    if comptime!(!fp8_pv) {
        for kt in 0..n_tiles {
            let (t0, t1) = tile_bounds(kt, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
                tpb_magic, block_n, sparse);
            bar_k.wait_parity(kt & 1u32);
            if kt == 0 {
                fence_proxy_async();
            }
            // every warpgroup is done with tile t - 1: its K buffer takes K(t + 1)
            sync_cube();
            let cur = ((kt & 1u32) as usize) * tile_e;
            let cur_k = ((kt & 1u32) as usize) * tile_k;
            let (n0, n1) = tile_bounds(kt + 1u32, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
                tpb_magic, block_n, sparse);
            let has_next = kt + 1 < n_tiles;
            // the next tile's rows (`tile_rows` of an unpaged tile: n0 and n0 + KV_PAGE); paged, the
            // page table is read only for a tile that is loaded: past the last tile n0 may be the end
            // of the keys, whose page entry does not exist (compute-sanitizer memcheck)
            let mut p0 = n0;
            let mut pb = n0 + KV_PAGE as u32;
            if comptime!(paged) {
                if has_next {
                    let (r0, _r1, rb) = tile_rows(n0, n1, &args.blocks, paged, block_n);
                    p0 = r0;
                    pb = rb;
                }
            }
            if has_next {
                issue_tile_boxes(&args.k_map, &mut k_smem, &bar_k, tile_k - cur_k, p0, pb, head_kv, block_n, qk_e, true);
                commit_copies(&bar_k);
            }
            let rows = (row_a, row_b, rows_lo, rows_hi);
            // `check_v`: a warpgroup without rows skips the tile's MMAs and softmax; each MMA
            // sequence, issue to wait, stays inside its branch (a wgmma whose wait lies past the
            // branch's end would make ptxas serialise every wgmma, C7514)
            if live {
                score_tile::<E>(args, &mut s, &mut s_i, &q_smem, q_wg, &k_smem, cur_k, head_kv, (t0, t1), &q_sl, &mut sl, &row_lo, &row_hi,
                    rows, lane, neg_inf, &mut m_r, &mut l_r, &mut alpha, &mut o_acc, &mut p, &mut p8, block_n, head_dim, int8, fp8_pv, SM90_BLOCK_M);
            }
            // V(t + 1) is issued only after this thread saw V(t) land
            bar_v.wait_parity(kt & 1u32);
            if has_next {
                issue_tile_boxes(&args.v_map, &mut v_smem, &bar_v, tile_e - cur, p0, pb, head_kv, block_n, head_dim, true);
                commit_copies(&bar_v);
            }
            if comptime!(check_v) {
                // every thread checks its share of V(t) (the buffer is reused only after the next
                // tile's cube barrier)
                #[unroll]
                for i in 0..comptime!(block_n * head_dim / SM90_THREADS) {
                    let x = f32::cast_from(v_smem[cur + UNIT_POS as usize + i * SM90_THREADS]);
                    // x - x is NaN exactly for an Inf or NaN
                    v_bad = v_bad || x - x != 0.0f32;
                }
            }
            if live {
                wgmma_fence();
                pv_steps::<E>(&mut o_acc, &p, &v_smem, cur, block_n, head_dim);
                wgmma_commit();
                wgmma_wait(0u32);
            }
        }
    }

    if comptime!(check_v) {
        if v_bad {
            args.nonfinite[0] = 1u32;
        }
    }

    write_out(args, &o_acc, &m_r, &mut l_r, &row_tok, &mut row_head, prow, row_a, row_b, lane, y, slot, seq, head_kv, neg_inf,
        &mut q_smem, 0usize, 0u32, head_dim, int8, fp8_pv, false);
}

/// A lane's two rows of a warp whose rows start at `prow` (`row_a`, `row_b` = `row_a + 8`), the
/// tightest key bounds over both (`rows_lo`, `rows_hi`, clipped to the item's `[klo, khi)`), and
/// their online-softmax state initialised (`m_r` = `M_INIT`, `l_r` = 0).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn lane_rows(
    m_r: &mut Array<f32>,
    l_r: &mut Array<f32>,
    row_lo: &SharedMemory<u32>,
    row_hi: &SharedMemory<u32>,
    prow: usize,
    lane: u32,
    klo: u32,
    khi: u32,
) -> (usize, usize, u32, u32) {
    #[unroll]
    for i in 0..2usize {
        m_r[i] = M_INIT;
        l_r[i] = 0.0f32;
    }
    let row_a = prow + (lane / 4u32) as usize;
    let row_b = row_a + 8;
    let rows_lo = max(klo, max(row_lo[row_a], row_lo[row_b]));
    let rows_hi = min(khi, min(row_hi[row_a], row_hi[row_b]));
    (row_a, row_b, rows_lo, rows_hi)
}

/// The epilogue of the Hopper forward frames: `l` reduced over the 4 lanes of a row, O normalised
/// and written (with the LSE) to the output, or to the split-K partials of slot `slot`. `int8` /
/// `fp8_pv`: the LSE corrections and V scales of those variants (`flash_fwd_sm90`).
///
/// `staged` (`flash_fwd_ws`, neither variant): O goes to the output through shared memory. The
/// warpgroup's threads put their rounded pairs into `stage` (its 64 rows from `wg_row0` of the Q
/// tile, 128-byte swizzled as Q, which none of its MMAs reads any more), meet at the warpgroup's
/// named barrier (`2 + wg_row0 / 64`), then store 16-byte row chunks: a warp writes two whole rows
/// a store where the pairs wrote 4 bytes to each of 8 rows (the epilogue took ~4.2 K cycles a
/// cube, 4.5% of a 4K non-causal d128 cube: docs/forward.md).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn write_out<E: Float>(
    args: &mut FwdCard<E>,
    o_acc: &Array<f32>,
    m_r: &Array<f32>,
    l_r: &mut Array<f32>,
    row_tok: &SharedMemory<u32>,
    row_head: &mut SharedMemory<u32>,
    prow: usize,
    row_a: usize,
    row_b: usize,
    lane: u32,
    y: u32,
    slot: u32,
    seq: u32,
    head_kv: u32,
    neg_inf: f32,
    stage: &mut SharedMemory<E>,
    wg_row0: usize,
    wg_unit: u32,
    #[comptime] head_dim: usize,
    #[comptime] int8: bool,
    #[comptime] fp8_pv: bool,
    #[comptime] staged: bool,
) {
    let block_m = comptime!(SM90_BLOCK_M);
    let o_blocks = comptime!(head_dim / 8);
    let mut inv_r = Array::<f32>::new(2usize);
    #[unroll]
    for i in 0..2usize {
        let mut l = l_r[i];
        l += plane_shuffle_xor(l, 1u32);
        l += plane_shuffle_xor(l, 2u32);
        l_r[i] = l;
        let mut inv = 0.0f32;
        if l > 0.0f32 {
            inv = 1.0f32 / l;
        }
        inv_r[i] = inv;
    }

    if slot == NONE {
        if comptime!(staged) {
            #[unroll]
            for ob in 0..o_blocks {
                #[unroll]
                for i in 0..2usize {
                    let tr = pick_row(i, row_a, row_b);
                    let at = swizzle_128b(tr, ob * 8, block_m) + acc_col(lane, 0usize) as usize;
                    store_pair_shared::<E>(stage, at, o_acc[ob * 4 + 2 * i] * inv_r[i], o_acc[ob * 4 + 2 * i + 1] * inv_r[i]);
                }
            }
            named_barrier_at(2u32 + wg_row0 as u32 / 64u32, 128u32);
            let units = comptime!(head_dim / 8);
            #[unroll]
            for it in 0..comptime!(64 * head_dim / 8 / 128) {
                let idx = wg_unit as usize + it * 128;
                let r = wg_row0 + idx / units;
                let c = (idx % units) * 8;
                let tok = row_tok[r];
                if tok != NONE {
                    let g = (tok * args.heads_q + row_head[r]) as usize * head_dim + c;
                    copy16_out::<E>(&mut args.out, g, stage, swizzle_128b(r, c, block_m));
                }
            }
        } else {
            #[unroll]
            for ob in 0..o_blocks {
                // the lane's two adjacent columns of a row as one 4-byte store
                #[unroll]
                for i in 0..2usize {
                    let tr = pick_row(i, row_a, row_b);
                    let tok = row_tok[tr];
                    if tok != NONE {
                        let col = ob * 8 + acc_col(lane, 0usize) as usize;
                        let g = (tok * args.heads_q + row_head[tr]) as usize * head_dim + col;
                        let mut o0 = o_acc[ob * 4 + 2 * i] * inv_r[i];
                        let mut o1 = o_acc[ob * 4 + 2 * i + 1] * inv_r[i];
                        if fp8_pv {
                            // V's per-channel scales (`fp8_v_scales`), after the Q scales and LSE corrections
                            let sc = (2u32 * args.heads_q * args.total_q) as usize + (seq * args.heads_kv + head_kv) as usize * head_dim + col;
                            o0 *= args.part_lse[sc];
                            o1 *= args.part_lse[sc + 1];
                        }
                        store_pair::<E>(&mut args.out, g, o0, o1);
                    }
                }
            }
        }
        if lane % 4 == 0 {
            #[unroll]
            for i in 0..2usize {
                let tr = pick_row(i, row_a, row_b);
                let tok = row_tok[tr];
                if tok != NONE {
                    let mut val = args.inf;
                    if l_r[i] != 0.0f32 {
                        val = m_r[i] * LN2 + f32::ln(l_r[i]);
                        if fp8_pv {
                            // the row sums carry P's factor FP8_P_SCALE
                            val -= comptime!(FP8_P_SCALE.log2()) * LN2;
                        }
                        if int8 {
                            // K smoothing: the LSE correction softmax_scale * q . mean
                            val += args.part_lse[(args.heads_q * args.total_q + row_head[tr] * args.total_q + tok) as usize];
                        }
                    }
                    args.lse[(row_head[tr] * args.total_q + tok) as usize] = val;
                }
            }
        }
    } else {
        let pbase = ((y * args.n_slots + slot) as usize) * block_m;
        // the rows with a token are a prefix of the tile: a warp whose first row has none has
        // none, and its partials are never read (`combine_parts` reads rows with a token only).
        // A decode step's cube has 4-32 such rows of 128: most warps skip their stores
        if row_tok[prow] != NONE {
            #[unroll]
            for ob in 0..o_blocks {
                #[unroll]
                for e in 0..4usize {
                    let tr = prow + acc_row(lane, e) as usize;
                    args.part_o[(pbase + tr) * head_dim + ob * 8 + acc_col(lane, e) as usize] = o_acc[ob * 4 + e] * inv_r[e / 2];
                }
            }
        }
        if lane % 4 == 0 {
            #[unroll]
            for i in 0..2usize {
                let tr = pick_row(i, row_a, row_b);
                let mut val = neg_inf;
                if l_r[i] != 0.0f32 {
                    val = m_r[i] * LN2 + f32::ln(l_r[i]);
                }
                args.part_lse[pbase + tr] = val;
            }
        }
    }
}
