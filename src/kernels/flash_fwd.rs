//! Flash-attention forward (FlashAttention-2 style) on tensor cores through CubeCL's manual
//! `mma.sync` path (m16n8k16, f16/bf16 operands, f32 accumulators).
//!
//! One cube = one work item: a tile of BLOCK_M = 128 *packed rows* and a key range. The rows of a
//! tile come from a host-built list of slices `(segment, first packed row, row count)`; packed row
//! `p` of a segment is query `p / hp`, head `head_base + p % hp`, where `hp` (heads packed per row
//! group) is 1 (one head per cube, head slot y = head) or the GQA group size (the q heads that
//! share one kv head sit in one tile, y = kv head); the grid is work items x y in one dimension,
//! y fastest (block-sparse: items fastest; the split-K combine keeps (split tile, y) as its 2-D grid). Rows of several
//! segments can share a tile; each row keeps its own visible key range `[lo, hi)` (absolute key indices), so a K,V
//! tile is read once for all of them. Varlen batches, grouped attention and decode-style groups are
//! the same launch.
//!
//! A work item covers the absolute keys `[klo, khi)`: the tile's whole union range, or one part of
//! it (split-K, for launches with too few cubes); parts write f32 partial outputs and their LSE,
//! and `combine_parts` merges them.
//!
//! FlashAttention-2's warp shape: 4 planes (warps) x 32 rows (or 8 x 16), key tiles of `block_n`
//! rows staged in shared memory, each K/V fragment shared by two m16 row blocks, Q re-read from its
//! own shared buffer; two 128-thread cubes fit per multiprocessor. Scores, softmax statistics and
//! the output accumulator stay in registers; P is re-used as the A operand of P.V without a trip
//! through shared memory. K and V tiles are copied with `cp.async` (16 B per copy, completion
//! tracked by shared mbarriers) into two buffers each: at the top of tile t the cube waits for
//! K(t) and V(t), passes its one barrier of the tile and issues K(t+1) and V(t+1), which load
//! during the whole of tile t (FlashAttention-2 has one buffer each, waits for V before the
//! softmax and has two barriers per tile). A row's reference maximum moves only when a score
//! exceeds it by more than `RESCALE_SLACK` (FlashAttention-4's conditional rescale); a plane
//! rescales O and its row sums only on tiles where one of its rows moved it.
//!
//! `int8` (block-sparse only, `kernels::int8_qk`): S = Q K^T from int8 operands with
//! `mma.sync.m16n8k32.s8.s8.s32` (exact i32 dot products), scaled per row and key tile by the
//! quantisation scales before the unchanged online softmax; P.V stays in f16/bf16 from the
//! original V. No parameter is added (the f16/bf16 kernels compile to the same code): `q_s` and
//! `k_s` carry the int8 rows (their bytes, typed as `E`), `part_o` the K scales `[key, kv head]`
//! and `part_lse` the Q scales `[head, token]` followed by the LSE corrections (the sparse plan
//! has no split-K partials, so these two arrays are free).
//!
//! Causal masking is bottom-right aligned per segment: segment row `r` sees window keys
//! `j < k_len - q_len + r + 1`. Only tiles that cross a row's range limits pay for the mask.

use cubecl::prelude::*;
use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::barrier::Barrier;

use super::cards::FwdCard;
use super::fragments::{frag_a, frag_b_pair, mma_into};
use super::grid::cube_item_slot;
use super::int8_qk::{scores_int8, stride8};
use super::kv_tiles::{issue_kv_tiles, load_kv_tile, tile_rows};
use super::staging::{commit_copies, copy_token_rows};
use super::tiles::{LOAD_VEC, SMEM_PAD};
use super::math::{fast_exp2, LN2};
use super::rows::{row_keys, WIN_NONE};

/// Packed rows per cube.
pub const BLOCK_M: usize = 16 * PLANES;
/// Keys per shared-memory tile.
pub const BLOCK_N: usize = 64;
/// Planes (warps) per cube.
pub const PLANES: usize = 8;
/// u32 words per slice in the slice table.
pub const SLICE_WORDS: usize = 3;
/// u32 words per work item.
pub const WORK_WORDS: usize = 5;
/// u32 words per combine entry.
pub const COMB_WORDS: usize = 4;
/// Key blocks of a sparse work item's list staged in shared memory (the rest is read from global).
pub const LIST_SMEM: usize = 256;
/// Marks "no row" / "no partial slot".
pub const NONE: u32 = u32::MAX;
/// How far (base 2) a row's scores may exceed the maximum its P and O are referred to before that
/// reference moves and O is rescaled (FlashAttention-4's conditional rescale). The result is the
/// same softmax (O and the row sum share the reference; LSE = reference + log(sum)); P <= 2^8
/// keeps f16 P and the f32 sums far from overflow (sum <= keys * 256).
pub const RESCALE_SLACK: f32 = 8.0;
/// A row's reference maximum before it has seen a finite score: finite (-f32::MAX), so that a
/// tile of only masked scores gives P = 2^(-inf - M_INIT) = 0 without a per-element guard, and
/// the first finite score moves it (alpha = 2^(M_INIT - m) = 0).
pub const M_INIT: f32 = -f32::MAX;

/// Merges the partial results of split tiles. One cube per (split tile, CUBE_POS_Y); `comb`:
/// COMB_WORDS u32 per entry (slice offset, slice count, first slot, number of parts). Eight planes,
/// 16 rows each, interleaved (plane `p` takes rows `p, p + 8, ..`: a tile's rows are packed from
/// row 0, so a few-row tile, a decode step's, spreads over the planes); a row's lanes cover its
/// `head_dim` columns.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn combine_parts<E: Float>(
    out: &mut Array<E>,
    lse: &mut Array<f32>,
    part_o: &Array<f32>,
    part_lse: &Array<f32>,
    comb: &Array<u32>,
    slices: &Array<u32>,
    segs: &Array<u32>,
    nonfinite: &Array<u32>,
    heads_q: u32,
    total_q: u32,
    hp: u32,
    n_slots: u32,
    inf: f32,
    #[comptime] head_dim: usize,
) {
    // v holds a NaN or Inf: no partials were written, the exact row-wise kernel writes this call
    if nonfinite[0] != 0u32 {
        terminate!();
    }
    let mut row_tok = SharedMemory::<u32>::new(BLOCK_M);
    let mut row_head = SharedMemory::<u32>::new(BLOCK_M);
    let mut row_lo = SharedMemory::<u32>::new(BLOCK_M);
    let mut row_hi = SharedMemory::<u32>::new(BLOCK_M);
    let e = CUBE_POS_X as usize * COMB_WORDS;
    let head_base = CUBE_POS_Y * hp;
    let first = comb[e + 2];
    let n_parts = comb[e + 3];
    // only the rows' tokens and heads are read here (the key bounds are the forward's)
    fill_rows(
        slices, segs, comb[e], comb[e + 1], hp, head_base, 0u32, NONE, &mut row_tok, &mut row_head, &mut row_lo,
        &mut row_hi, WIN_NONE, WIN_NONE, comptime!(PLANES * 32), BLOCK_M,
    );
    sync_cube();
    let lane = UNIT_POS_PLANE as usize;
    let plane = (UNIT_POS / 32u32) as usize;
    let base = CUBE_POS_Y * n_slots + first;
    for rr in 0..comptime!(BLOCK_M / PLANES) {
        let tr = rr * PLANES + plane;
        let tok = row_tok[tr];
        if tok != NONE {
            merge_row(out, lse, part_o, part_lse, base, n_parts, tr, tok, row_head[tr], heads_q, total_q, inf, lane, head_dim, BLOCK_M);
        }
    }
}

/// Row `tr` of a split tile merged from its `n_parts` partials (slots `base ..`, `block_m` rows a
/// slot): each part weighted by 2^(its LSE - the largest), written to `out` / `lse` at token `tok`,
/// q head `head` (`inf` for a row no part saw). A warp's lanes take columns `lane + 32 i`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn merge_row<E: Float>(
    out: &mut Array<E>,
    lse: &mut Array<f32>,
    part_o: &Array<f32>,
    part_lse: &Array<f32>,
    base: u32,
    n_parts: u32,
    tr: usize,
    tok: u32,
    head: u32,
    heads_q: u32,
    total_q: u32,
    inf: f32,
    lane: usize,
    #[comptime] head_dim: usize,
    #[comptime] block_m: usize,
) {
    let per_lane = comptime!(head_dim / 32);
    let mut mx = -inf;
    for p in 0..n_parts {
        let b = ((base + p) as usize) * block_m + tr;
        mx = max(mx, part_lse[b]);
    }
    let mut acc = Array::<f32>::new(per_lane);
    #[unroll]
    for i in 0..per_lane {
        acc[i] = 0.0f32;
    }
    let mut sum = 0.0f32;
    if mx != -inf {
        for p in 0..n_parts {
            let b = ((base + p) as usize) * block_m + tr;
            let w = f32::exp(part_lse[b] - mx);
            sum += w;
            #[unroll]
            for i in 0..per_lane {
                acc[i] += w * part_o[b * head_dim + i * 32 + lane];
            }
        }
    }
    let mut inv = 0.0f32;
    if sum > 0.0f32 {
        inv = 1.0f32 / sum;
    }
    let g = (tok * heads_q + head) as usize * head_dim;
    #[unroll]
    for i in 0..per_lane {
        out[g + i * 32 + lane] = E::cast_from(acc[i] * inv);
    }
    if lane == 0 {
        let mut val = inf;
        if sum != 0.0f32 {
            val = mx + f32::ln(sum);
        }
        lse[(head * total_q + tok) as usize] = val;
    }
}

/// Fills `out` with zeros and `lse` with +inf (rows no segment covers keep these values).
#[cube(launch_unchecked)]
pub fn fill_uncovered<E: Float>(out: &mut Array<E>, lse: &mut Array<f32>, inf: f32) {
    let idx = ABSOLUTE_POS;
    if idx < out.len() {
        out[idx] = E::from_int(0);
    }
    if idx < lse.len() {
        lse[idx] = inf;
    }
}

/// The forward kernel (arguments: the forward card, `cards::FwdCard`): FlashAttention-2's warp
/// shape. Each plane (warp) owns `mt` m16 row blocks (`mt` = 2: 4 planes x 32 rows = 128 threads),
/// so every K/V B fragment read through `ldmatrix` feeds `mt` mma instructions. The Q tile stays in
/// shared memory (its own buffer, copied with `cp.async` together with the first K tile) and its A
/// fragments are re-read with `ldmatrix` each key tile, which keeps the register count under 255 so
/// two 128-thread cubes share a multiprocessor (one cube's barriers and softmax overlap the other's
/// mma). `block_n` keys per tile; K and V double-buffered (module docs). BLOCK_M = 128 packed rows
/// per cube. `paged` (dense only): `blocks` is the page table of a paged K,V (`rows::kv_row`);
/// masks and tiles stay in logical key positions, only the copies' rows are translated, once per
/// tile and page.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn flash_fwd_mma2<E: Float>(
    args: &mut FwdCard<E>,
    #[comptime] head_dim: usize,
    #[comptime] mt: usize,
    #[comptime] block_n: usize,
    #[comptime] block_m: usize,
    #[comptime] sparse: bool,
    #[comptime] int8: bool,
    #[comptime] paged: bool,
    #[comptime] v_single: bool,
    #[comptime] tma: bool,
) {
    // v holds a NaN or Inf (`nonfinite::v_nonfinite`): the exact row-wise kernel writes this call
    if args.nonfinite[0] != 0u32 {
        terminate!();
    }
    let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE;
    let plane = UNIT_POS / 32u32;
    let threads = comptime!(block_m / mt * 2);
    let plane_rows = comptime!(16 * mt);

    let stride = comptime!(head_dim + SMEM_PAD);
    // int8: Q and K tiles hold int8 rows (`int8_qk`, `stride8`), in the same E-typed buffers
    let qk_row = comptime!(if int8 { stride8(head_dim) } else { head_dim + SMEM_PAD });
    let mut q_smem = SharedMemory::<E>::new_aligned(comptime!(block_m * qk_row), 16usize);
    // K and V double-buffered: tile t in rows [(t % 2) block_n, (t % 2 + 1) block_n)
    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(2 * block_n * qk_row), 128usize);
    // `v_single`: one V buffer (V(t) issued at the top of tile t, once every plane is done with
    // V(t - 1), and waited for right before P V), so that three 64-row cubes fit an SM
    let v_bufs = comptime!(if v_single { 1usize } else { 2usize });
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(v_bufs * block_n * (head_dim + SMEM_PAD)), 128usize);
    let mut row_tok = SharedMemory::<u32>::new(block_m);
    let mut row_head = SharedMemory::<u32>::new(block_m);
    let mut row_lo = SharedMemory::<u32>::new(block_m);
    let mut row_hi = SharedMemory::<u32>::new(block_m);
    let bar_k = Barrier::shared(comptime!(threads as u32), UNIT_POS == 0);
    let bar_v = Barrier::shared(comptime!(threads as u32), UNIT_POS == 0);

    // One cube per (work item, head slot y < heads_q / hp); block-sparse items fastest.
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
    sync_cube();

    let size!(NA) = def.vector_size(MatrixIdent::A);
    let size!(NB) = def.vector_size(MatrixIdent::B);
    let size!(NC) = def.vector_size(MatrixIdent::Accumulator);
    let va = def.vectors_per_lane(MatrixIdent::A);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sa = def.vector_size(MatrixIdent::A);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let ec = comptime!(vc * sc);

    let k_steps = comptime!(head_dim / 16);
    let n_blocks = comptime!(block_n / 8);
    let o_blocks = comptime!(head_dim / 8);
    let slots = comptime!(2 * mt);
    let krow = args.heads_kv as usize * head_dim;
    let mi = (lane / 8u32) as usize;
    let mr = (lane % 8u32) as usize;
    let prow = plane as usize * plane_rows;

    // Q tile and K(0) in one cp.async group on bar_k, V(0) on bar_v. Rows without a token copy
    // token 0 (any valid row): their key range is empty, so every score is masked and nothing
    // is written.
    if n_tiles > 0 {
        let (f0, f1) = tile_bounds(0u32, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
            tpb_magic, block_n, sparse);
        // int8 rows: head_dim bytes = head_dim / 2 elements of E
        copy_token_rows(&args.q_s, &mut q_smem, &row_tok, &row_head, args.heads_q, NONE, threads, block_m,
                        comptime!(if int8 { head_dim / 2 } else { head_dim }), qk_row, LOAD_VEC);
        // paged (dense only: `blocks` holds the page table): a tile spans at most two pages
        let (p0, p1, pb) = tile_rows(f0, f1, &args.blocks, paged, block_n);
        issue_kv_tiles(&args.k_map, &args.v_map, &args.k_s, &args.v_s, &mut k_smem, &mut v_smem, &bar_k, &bar_v, 0usize,
            p0, p1, pb, krow, args.heads_kv, head_kv,
                       threads, block_n, head_dim, int8, true, paged, tma);
    }

    let mut o_acc = Array::<f32>::new(comptime!(mt * o_blocks * ec));
    #[unroll]
    for i in 0..comptime!(mt * o_blocks * ec) {
        o_acc[i] = 0.0f32;
    }
    let mut s = Array::<f32>::new(comptime!(mt * n_blocks * ec));
    let neg_inf = -args.inf;
    // int8: entries [slots, 2 slots) hold the rows' Q scale times scale_log2, [2 slots, 3 slots)
    // the current tile's full score factor (times the K scale)
    let mut m_r = Array::<f32>::new(comptime!(if int8 { 3 * slots } else { slots }));
    let mut l_r = Array::<f32>::new(slots);
    #[unroll]
    for i in 0..slots {
        m_r[i] = M_INIT;
        l_r[i] = 0.0f32;
    }
    // Row (inside the cube tile) of slot `i`: m-tile i / 2, accumulator half i % 2.
    let (row_a, _ca) = def.position_of_nth(lane, 0u32, MatrixIdent::Accumulator);
    let (row_b, _cb) = def.position_of_nth(lane, (ec - 1) as u32, MatrixIdent::Accumulator);
    if int8 {
        // Q scales (`part_lse[head * total_q + token]`), 1 for rows without a token
        #[unroll]
        for i in 0..slots {
            let tr = slot_row(i, prow, row_a, row_b);
            let tok = row_tok[tr];
            let mut qs = 1.0f32;
            if tok != NONE {
                qs = args.part_lse[(row_head[tr] * args.total_q + tok) as usize];
            }
            m_r[slots + i] = qs * args.scale_log2;
        }
    }

    // The tightest key range of this unit's rows: a tile needs the mask iff it starts before the
    // latest first key or ends past the earliest end (an empty row, lo == hi, masks every tile).
    // Read once here instead of from shared memory in every tile; starting from [klo, khi) changes
    // nothing (every tile lies inside it). The branch is taken by the whole plane when any lane
    // needs it (the mask is exact per element), which keeps ptxas from if-converting it.
    let mut rows_lo = klo;
    let mut rows_hi = khi;
    #[unroll]
    for i in 0..slots {
        let tr = slot_row(i, prow, row_a, row_b);
        rows_lo = max(rows_lo, row_lo[tr]);
        rows_hi = min(rows_hi, row_hi[tr]);
    }

    for kt in 0..n_tiles {
        let (t0, t1) = tile_bounds(kt, klo, khi, list, &args.blocks, &list_smem, args.k_block, args.tiles_per_block,
            tpb_magic, block_n, sparse);
        if int8 {
            // this lane's K scale (`part_o[key * heads_kv + head]`): one per tile and lane in every
            // granularity (its columns 2 (lane % 4) + {0, 1} of each n8 block share it)
            let key = min(t0 + 2u32 * (lane % 4u32), t1 - 1u32);
            let ks = args.part_o[(key * args.heads_kv + head_kv) as usize];
            #[unroll]
            for i in 0..slots {
                m_r[2 * slots + i] = max(m_r[slots + i] * ks, 1.175_494_4e-38f32);
            }
        }
        // K(t) and V(t) were issued a whole tile ago; the one barrier of the tile then frees the
        // buffers of tile t - 1 (every plane has finished its S and P.V) for tile t + 1's copies,
        // which overlap all of tile t. No wait or barrier inside the tile: ptxas schedules S, the
        // softmax and P.V as one block (a wait right before P.V cost 5-7%, docs/measured-and-lost.md).
        bar_k.wait_parity(kt & 1u32);
        if !v_single {
            bar_v.wait_parity(kt & 1u32);
        }
        sync_cube();
        let cur = ((kt & 1u32) * block_n as u32) as usize;
        if v_single && kt > 0 {
            // every plane is done with V(t - 1): V(t) into the one buffer
            let (p0, p1, pb) = tile_rows(t0, t1, &args.blocks, paged, block_n);
            load_kv_tile(&args.v_map, &args.v_s, &mut v_smem, &bar_v, 0usize, p0, p1, pb, krow, head_kv, threads, block_n,
                head_dim, paged, tma);
            commit_copies(&bar_v);
        }
        if kt + 1 < n_tiles {
            let nxt = comptime!(block_n) - cur;
            let (n0, n1) = tile_bounds(kt + 1u32, klo, khi, list, &args.blocks, &list_smem, args.k_block,
                args.tiles_per_block, tpb_magic, block_n, sparse);
            let (p0, p1, pb) = tile_rows(n0, n1, &args.blocks, paged, block_n);
            issue_kv_tiles(&args.k_map, &args.v_map, &args.k_s, &args.v_s, &mut k_smem, &mut v_smem, &bar_k, &bar_v, nxt,
                p0, p1, pb, krow, args.heads_kv, head_kv,
                           threads, block_n, head_dim, int8, !v_single, paged, tma);
        }

        // ---- S = Q K^T: mt x 16 rows x block_n keys per plane ----
        #[unroll]
        for i in 0..comptime!(mt * n_blocks * ec) {
            s[i] = 0.0f32;
        }
        if int8 {
            scores_int8(&q_smem, &k_smem, cur, &mut s, prow, mt, block_n, head_dim);
        } else {
            // k-step outer: each of the mt x n_blocks accumulator blocks takes one mma per k-step,
            // so two mma into one block are mt x n_blocks mma apart (k-step inner put dependent
            // pairs two mma apart: the tensor pipe waited on the mma latency, ncu's "wait" stall).
            // Every block still adds its k-steps in order: bit-identical results.
            #[unroll]
            for ks in 0..k_steps {
                let mut af = Array::<Vector<E, NA>>::new(comptime!(mt * va));
                #[unroll]
                for m in 0..mt {
                    let a = frag_a::<E, NA>(&def, &q_smem, prow + m * 16, ks * 16, stride);
                    #[unroll]
                    for i in 0..va {
                        af[m * va + i] = a[i];
                    }
                }
                #[unroll]
                for np in 0..comptime!(n_blocks / 2) {
                    let bm = frag_b_pair::<E, NB>(&def, &k_smem, cur + np * 16, ks * 16, stride);
                    #[unroll]
                    for j in 0..2usize {
                        #[unroll]
                        for m in 0..mt {
                            let mut a = Array::<Vector<E, NA>>::new(va);
                            #[unroll]
                            for i in 0..va {
                                a[i] = af[m * va + i];
                            }
                            mma_into::<E, NA, NB, NC>(&def, &a, &bm, 2 * j, &mut s, (m * n_blocks + 2 * np + j) * ec);
                        }
                    }
                }
            }
        }

        // ---- mask (only tiles that cross a row's key range) ----
        let tn = t0 + block_n as u32;
        if plane_any(t0 < rows_lo || tn > min(rows_hi, t1)) {
            #[unroll]
            for i in 0..slots {
                let tr = slot_row(i, prow, row_a, row_b);
                let lo = row_lo[tr];
                let hi = min(row_hi[tr], t1);
                #[unroll]
                for nb in 0..n_blocks {
                    #[unroll]
                    for e2 in 0..comptime!(ec / 2) {
                        let e = (i % 2) * (ec / 2) + e2;
                        let (_row, col) = def.position_of_nth(lane, e as u32, MatrixIdent::Accumulator);
                        let key = t0 + nb as u32 * 8 + col;
                        if key < lo || key >= hi {
                            s[((i / 2) * n_blocks + nb) * ec + e] = neg_inf;
                        }
                    }
                }
            }
        }

        // ---- online softmax per row slot ----
        // This tile's row maxima (base 2: scaled). A row's reference maximum m_r moves only when
        // one exceeds it by more than RESCALE_SLACK; the plane takes that branch (new references,
        // O and the row sums rescaled) when any of its rows needs it, which after a range's first
        // tiles is rare. Rows that keep theirs get alpha = 2^0 = 1 there: exact.
        let mut top = Array::<f32>::new(slots);
        let mut moved = false;
        #[unroll]
        for i in 0..slots {
            let m = i / 2;
            let e0 = (i % 2) * (ec / 2);
            let mut mx = neg_inf;
            #[unroll]
            for nb in 0..n_blocks {
                #[unroll]
                for e2 in 0..comptime!(ec / 2) {
                    mx = max(mx, s[(m * n_blocks + nb) * ec + e0 + e2]);
                }
            }
            if int8 {
                // s holds raw i32 dot products and the lanes of a row may hold different K
                // scales (per_thread): this lane's factor to base-2 scores first
                mx *= m_r[2 * slots + i];
            }
            mx = max(mx, plane_shuffle_xor(mx, 1u32));
            mx = max(mx, plane_shuffle_xor(mx, 2u32));
            if !int8 {
                mx *= args.scale_log2;
            }
            top[i] = mx;
            moved = moved || mx > m_r[i] + RESCALE_SLACK;
        }
        if plane_any(moved) {
            #[unroll]
            for i in 0..slots {
                let old = m_r[i];
                let mut new = old;
                if top[i] > old + RESCALE_SLACK {
                    new = top[i];
                }
                let alpha = fast_exp2(old - new);
                m_r[i] = new;
                l_r[i] *= alpha;
                let m = i / 2;
                let e0 = (i % 2) * (ec / 2);
                #[unroll]
                for ob in 0..o_blocks {
                    #[unroll]
                    for e2 in 0..comptime!(ec / 2) {
                        o_acc[(m * o_blocks + ob) * ec + e0 + e2] *= alpha;
                    }
                }
            }
        }
        // P = 2^(s - m_r) <= 2^RESCALE_SLACK; a row still at M_INIT has only masked (-inf) scores
        // so far, whose P is 2^-inf = 0
        #[unroll]
        for i in 0..slots {
            let m = i / 2;
            let e0 = (i % 2) * (ec / 2);
            let sl = if int8 { m_r[2 * slots + i] } else { args.scale_log2 };
            let ref_m = m_r[i];
            let mut sum = 0.0f32;
            #[unroll]
            for nb in 0..n_blocks {
                #[unroll]
                for e2 in 0..comptime!(ec / 2) {
                    let idx = (m * n_blocks + nb) * ec + e0 + e2;
                    let p = fast_exp2(s[idx] * sl - ref_m);
                    s[idx] = p;
                    sum += p;
                }
            }
            l_r[i] += sum;
        }

        // ---- O += P V: P from registers as A (per m-tile), V fragments shared by the m-tiles ----
        let mut vcur = cur;
        if v_single {
            bar_v.wait_parity(kt & 1u32);
            vcur = 0usize;
        }
        #[unroll]
        for ks in 0..comptime!(block_n / 16) {
            let mut pf = Array::<Vector<E, NA>>::new(comptime!(mt * va));
            #[unroll]
            for m in 0..mt {
                #[unroll]
                for i in 0..va {
                    let mut reg = Vector::<E, NA>::empty();
                    #[unroll]
                    for j in 0..sa {
                        let e = i * sa + j;
                        let src = (m * n_blocks + 2 * ks + e / ec) * ec + e % ec;
                        reg[j] = E::cast_from(s[src]);
                    }
                    pf[m * va + i] = reg;
                }
            }
            #[unroll]
            for ob2 in 0..comptime!(o_blocks / 2) {
                let key = vcur + ks * 16 + (mi % 2) * 8 + mr;
                let start = key * stride + (2 * ob2 + mi / 2) * 8;
                let bm = def.load_matrix::<E, NB>(&v_smem.slice(start, start + 8), MatrixIdent::B, 4usize, true);
                #[unroll]
                for h in 0..2usize {
                    let ob = 2 * ob2 + h;
                    let mut b = Array::<Vector<E, NB>>::new(2usize);
                    b[0] = bm[2 * h];
                    b[1] = bm[2 * h + 1];
                    #[unroll]
                    for m in 0..mt {
                        let mut a = Array::<Vector<E, NA>>::new(va);
                        #[unroll]
                        for i in 0..va {
                            a[i] = pf[m * va + i];
                        }
                        mma_into::<E, NA, NB, NC>(&def, &a, &b, 0usize, &mut o_acc, (m * o_blocks + ob) * ec);
                    }
                }
            }
        }
    }

    // ---- finish: reduce l over the 4 lanes of a row, normalise, write ----
    let mut inv_r = Array::<f32>::new(slots);
    #[unroll]
    for i in 0..slots {
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
        #[unroll]
        for m in 0..mt {
            #[unroll]
            for ob in 0..o_blocks {
                #[unroll]
                for e in 0..ec {
                    let (row, col) = def.position_of_nth(lane, e as u32, MatrixIdent::Accumulator);
                    let tr = prow + m * 16 + row as usize;
                    let tok = row_tok[tr];
                    if tok != NONE {
                        let inv = inv_r[m * 2 + e / (ec / 2)];
                        let g = (tok * args.heads_q + row_head[tr]) as usize * head_dim + ob * 8 + col as usize;
                        args.out[g] = E::cast_from(o_acc[(m * o_blocks + ob) * ec + e] * inv);
                    }
                }
            }
        }
        if lane % 4 == 0 {
            #[unroll]
            for i in 0..slots {
                let tr = slot_row(i, prow, row_a, row_b);
                let tok = row_tok[tr];
                if tok != NONE {
                    let mut val = args.inf;
                    if l_r[i] != 0.0f32 {
                        val = m_r[i] * LN2 + f32::ln(l_r[i]);
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
        #[unroll]
        for m in 0..mt {
            #[unroll]
            for ob in 0..o_blocks {
                #[unroll]
                for e in 0..ec {
                    let (row, col) = def.position_of_nth(lane, e as u32, MatrixIdent::Accumulator);
                    let tr = prow + m * 16 + row as usize;
                    let inv = inv_r[m * 2 + e / (ec / 2)];
                    args.part_o[(pbase + tr) * head_dim + ob * 8 + col as usize] = o_acc[(m * o_blocks + ob) * ec + e] * inv;
                }
            }
        }
        if lane % 4 == 0 {
            #[unroll]
            for i in 0..slots {
                let tr = slot_row(i, prow, row_a, row_b);
                let mut val = neg_inf;
                if l_r[i] != 0.0f32 {
                    val = m_r[i] * LN2 + f32::ln(l_r[i]);
                }
                args.part_lse[pbase + tr] = val;
            }
        }
    }
}

/// One forward cube's work: its slices `[slice_off, + n_slices)`, absolute key range `[klo, khi)`,
/// split-K slot (`NONE`: none), head slot `y` (q heads `head_base..head_base + hp`, kv head
/// `head_kv`) and key tiles (`n_tiles`; block-sparse: the list at `list` with its tile divisor).
#[derive(CubeType, Clone, Copy)]
pub struct WorkItem {
    pub slice_off: u32,
    pub n_slices: u32,
    pub klo: u32,
    pub khi: u32,
    pub slot: u32,
    pub y: u32,
    pub head_base: u32,
    pub head_kv: u32,
    pub n_tiles: u32,
    pub list: u32,
    pub tpb_magic: u32,
}

/// This cube's [`WorkItem`] (`grid::cube_item_slot`, block-sparse items fastest). Key tiles: dense,
/// `[klo, khi)` in `block_n` steps; sparse, the listed key blocks of this (item, y), each
/// `tiles_per_block` tiles (see `tile_bounds`), whose first LIST_SMEM entries are staged in
/// `list_smem` by the cube's `threads` units, so no tile waits on a global load for its address.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn work_item(
    work: &Array<u32>,
    tile_ref: &Array<u32>,
    blocks: &Array<u32>,
    list_smem: &mut SharedMemory<u32>,
    heads_q: u32,
    heads_kv: u32,
    hp: u32,
    tiles_per_block: u32,
    items_fastest: u32,
    #[comptime] threads: usize,
    #[comptime] block_n: usize,
    #[comptime] sparse: bool,
) -> WorkItem {
    let ys = heads_q / hp;
    let (xi, y) = cube_item_slot(ys, items_fastest, sparse);
    let item = xi as usize * WORK_WORDS;
    let head_base = y * hp;
    let group = heads_q / heads_kv;
    let head_kv = head_base / group;

    let slice_off = work[item];
    let n_slices = work[item + 1];
    let klo = work[item + 2];
    let khi = work[item + 3];
    let slot = work[item + 4];

    let mut n_tiles = 0u32;
    let mut list = 0u32;
    let mut tpb_magic = 0u32;
    if sparse {
        tpb_magic = tile_div_magic(tiles_per_block);
        let r = ((y * (CUBE_COUNT_X / ys) + xi) * 2u32) as usize;
        list = tile_ref[r];
        n_tiles = tile_ref[r + 1];
        let lim = min((n_tiles + tiles_per_block - 1) / tiles_per_block, LIST_SMEM as u32);
        #[unroll]
        for pass in 0..comptime!(LIST_SMEM.div_ceil(threads)) {
            let i = UNIT_POS + (pass * threads) as u32;
            if i < lim {
                list_smem[i as usize] = blocks[(list + i) as usize];
            }
        }
    } else if khi > klo {
        n_tiles = (khi - klo + block_n as u32 - 1) / block_n as u32;
    }
    WorkItem { slice_off, n_slices, klo, khi, slot, y, head_base, head_kv, n_tiles, list, tpb_magic }
}

/// Per-row metadata of one tile of `block_m` rows, written to shared memory by `threads` units
/// (fewer than rows: each unit fills several rows): token (NONE for an empty row), q head, and the
/// visible absolute key range clipped to `[klo, khi)` (`lo == hi` when empty), from
/// `rows::row_keys` with the call's bounds (`win_r` 0 is the causal diagonal), so causal and
/// sliding-window calls share one kernel.
#[allow(clippy::too_many_arguments)]
#[cube]
pub(crate) fn fill_rows(
    slices: &Array<u32>,
    segs: &Array<u32>,
    slice_off: u32,
    n_slices: u32,
    hp: u32,
    head_base: u32,
    klo: u32,
    khi: u32,
    row_tok: &mut SharedMemory<u32>,
    row_head: &mut SharedMemory<u32>,
    row_lo: &mut SharedMemory<u32>,
    row_hi: &mut SharedMemory<u32>,
    win_l: u32,
    win_r: u32,
    #[comptime] threads: usize,
    #[comptime] block_m: usize,
) {
    #[unroll]
    for pass in 0..comptime!(block_m.div_ceil(threads)) {
        let r = UNIT_POS + (pass * threads) as u32;
        if r < block_m as u32 {
            let mut tok = 0xFFFF_FFFFu32;
            let mut head = 0u32;
            let mut lo = 0u32;
            let mut hi = 0u32;
            let mut off = 0u32;
            for i in 0..n_slices {
                let base = ((slice_off + i) * SLICE_WORDS as u32) as usize;
                let n = slices[base + 2];
                if r >= off && r < off + n {
                    let seg = slices[base] as usize;
                    let p = slices[base + 1] + (r - off);
                    let qr = p / hp;
                    let q_start = segs[seg * 4];
                    let q_len = segs[seg * 4 + 1];
                    let k_start = segs[seg * 4 + 2];
                    let k_len = segs[seg * 4 + 3];
                    tok = q_start + qr;
                    head = head_base + p % hp;
                    // causal and sliding window: both in the bounds (`rows`)
                    let (vis_lo, vis) = row_keys(q_len, k_len, qr, win_l, win_r);
                    lo = max(k_start + vis_lo, klo);
                    hi = min(k_start + vis, khi);
                    if hi < lo {
                        hi = lo;
                    }
                }
                off += n;
            }
            row_tok[r as usize] = tok;
            row_head[r as usize] = head;
            row_lo[r as usize] = lo;
            row_hi[r as usize] = hi;
        }
    }
}

/// The end of the keys any of a tile's `block_m` rows sees (the largest `row_hi` that
/// [`fill_rows`] wrote), by the cube's `threads` units (at least `block_m`, whole planes): each of
/// the first `block_m` units takes one row, a plane maximum, then one per plane through `red`
/// (`block_m / 32` words). Ends in a cube barrier. Used where the plan's key range of an item may
/// run past its rows' keys: a decode step whose key counts the device wrote (`kv_append`).
#[cube]
pub(crate) fn rows_key_end(row_hi: &SharedMemory<u32>, red: &mut SharedMemory<u32>, #[comptime] block_m: usize) -> u32 {
    let planes = comptime!(block_m / 32);
    if UNIT_POS < block_m as u32 {
        let m = plane_max(row_hi[UNIT_POS as usize]);
        if UNIT_POS_PLANE == 0u32 {
            red[(UNIT_POS / 32u32) as usize] = m;
        }
    }
    sync_cube();
    let mut end = 0u32;
    #[unroll]
    for i in 0..planes {
        end = max(end, red[i]);
    }
    end
}

/// Multiplier that divides a tile index by `d` (= `tiles_per_block`) with one `mul_hi`:
/// ceil(2^32 / d) (2^32 / d exactly for a power of two); 0 for d = 1, which `tile_bounds` takes
/// apart. `mul_hi(kt, m)` = `kt / d` for every `kt * d < 2^32` (the error `kt * (m d - 2^32) / 2^32`
/// stays below `kt * d / 2^32 < 1` of the `d` that separate quotients); the host refuses larger
/// calls (`cuda::sparse::check_sparse_supported`). The runtime division it replaces was ~12
/// instructions per tile bound, two bounds per key tile.
#[cube]
pub fn tile_div_magic(d: u32) -> u32 {
    let mut m = 0u32;
    if d > 1u32 {
        m = u32::MAX / d + 1u32;
    }
    m
}

/// Row (inside the cube tile) of accumulator slot `i` of a plane whose rows start at `prow`: m-tile
/// `i / 2`, accumulator half `i % 2` (rows `row_a` / `row_b` of the lane's fragment).
#[cube]
fn slot_row(#[comptime] i: usize, prow: usize, row_a: u32, row_b: u32) -> usize {
    let mut r = row_b;
    if i % 2 == 0 {
        r = row_a;
    }
    prow + (i / 2) * 16 + r as usize
}

/// Absolute key range `[t0, t1)` of key tile `kt` of a work item. Dense: tile `kt` of `[klo, khi)`.
/// Sparse: `blocks[list..]` lists the item's key blocks (ascending, window-relative, `k_block`
/// keys each, `klo` = the window start, `khi` its end); tile `kt` is part `kt % tiles_per_block`
/// of block `kt / tiles_per_block` (the quotient by `tpb_magic`, [`tile_div_magic`]), cut at the
/// block's and the window's end.
#[allow(clippy::too_many_arguments)]
#[cube]
pub fn tile_bounds(
    kt: u32,
    klo: u32,
    khi: u32,
    list: u32,
    blocks: &Array<u32>,
    list_smem: &SharedMemory<u32>,
    k_block: u32,
    tiles_per_block: u32,
    tpb_magic: u32,
    #[comptime] block_n: usize,
    #[comptime] sparse: bool,
) -> (u32, u32) {
    let mut t0 = klo + kt * block_n as u32;
    let mut t1 = min(t0 + block_n as u32, khi);
    if sparse {
        let mut bi = kt;
        if tiles_per_block > 1u32 {
            bi = kt.mul_hi(tpb_magic);
        }
        let part = kt - bi * tiles_per_block;
        let kb = if bi < LIST_SMEM as u32 { list_smem[bi as usize] } else { blocks[(list + bi) as usize] };
        let bstart = klo + kb * k_block;
        t0 = bstart + part * block_n as u32;
        t1 = min(min(t0 + block_n as u32, bstart + k_block), khi);
    }
    (t0, t1)
}
