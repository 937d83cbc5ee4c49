//! Flash-attention backward (FlashAttention-2 style, P recomputed from the LSE) on tensor cores
//! through CubeCL's manual `mma.sync` path (m16n8k16, f16/bf16 operands, f32 accumulators), and
//! its small preprocessing / fill kernels. Fragment loads and mma wrappers live in `fragments`,
//! the tile staging in `staging`; f32 inputs take `rowwise_bwd`.
//!
//! Dense f16 / bf16 calls take `flash_bwd_wide::flash_bwd_dkdv_wide` (128-key cubes) for dK / dV
//! and, when deterministic, [`flash_bwd_dq`] for dQ. [`flash_bwd_dkdv`] is launched only by
//! block-sparse calls now (`sparse = true`, no fused dQ); its dense and fused-dQ variants are
//! no longer launched and go when the block-sparse dK/dV moves to the 128-key kernel.
//!
//! Two passes, both deterministic (no atomics, fixed summation order):
//! - [`flash_bwd_dkdv`]: one cube per (key tile of [`BWD_BN`] keys of the shared key axis, kv
//!   head). Four planes own 16 keys each. The cube loops over every segment whose key window
//!   overlaps the tile (a host-built CSR list, ascending segment order), over the query heads of
//!   the kv head (GQA) and over the query tiles of the segment that see the tile's keys (causal
//!   tiles above the diagonal are never visited). Per 32-row chunk each plane computes
//!   S^T = K Q^T and dP^T = V dO^T (interleaved), P^T, dV += P^T dO, dS^T = P^T (dP^T - delta),
//!   dK += dS^T Q with everything but K, V, Q and dO in registers (the accumulator layout of
//!   m16n8k16 is re-used as the A operand, as in the forward). Overlapping groups therefore add
//!   into dK, dV inside one cube, in segment order.
//! - [`flash_bwd_dq`]: one cube per (query tile of [`BWD_BM`] rows, query head); each plane owns
//!   16 rows and loops over the key tiles its rows see: S = Q K^T, dP = dO V^T,
//!   dS = P (dP - delta), dQ += dS K.
//!
//! Rows are segment-local and keys window-local for the masks: segment row `r` sees window keys
//! `j <= k_len - q_len + r` when causal (bottom-right alignment).
//!
//! Block-sparse (comptime `sparse`, same kernels): a dQ cube's rows lie in one query block and
//! its key tiles are that block's listed key blocks (the forward's `tile_bounds` over a list);
//! a dK/dV cube's keys lie in one key block and its query tiles come from the transposed index
//! (`kernels::sparse_index`): per index head the query blocks listing the key block, ascending,
//! each `q_tiles_per_block` tiles of `BWD_BM` rows, rows past the query block's end masked.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;
use cubecl::prelude::barrier::Barrier;

use super::flash_fwd::{tile_bounds, LIST_SMEM};
use super::fragments::{frag_a, frag_b_n2, frag_b_t2, mma_acc_b, mma_into, mma_rows_abt_pair};
use super::staging::{commit_copies, commit_stage, issue_kv_tile, issue_q_tile, stage_rows, wait_stage};
use super::math::{fast_exp2, LOG2E};
use super::rows::{key_rows, row_keys};

/// Planes (warps) per cube of the tensor-core kernels.
pub const BWD_PLANES: usize = 4;
/// Keys per dK/dV cube (16 per plane) and keys per shared-memory tile of the dQ kernel.
pub const BWD_BN: usize = 16 * BWD_PLANES;
/// Query rows per dQ cube (16 per plane) and query rows per shared-memory tile of the dK/dV kernel.
pub const BWD_BM: usize = 16 * BWD_PLANES;
/// Rows (dK/dV) or keys (dQ) computed at once from a shared-memory tile (bounds the registers).
pub const BWD_SUB: usize = 32;
/// Width of the global-memory vector loads (elements): 16 bytes of f16/bf16.
pub const BWD_LOAD_VEC: usize = 8;
/// Padding (elements) added to each shared-memory row (keeps 16-byte alignment, spreads banks).
pub(crate) const PAD: usize = 8;
/// Planes per cube of the preprocessing kernel.
pub const DELTA_PLANES: usize = 8;
/// u32 words per block-sparse dQ work item: (sequence, first row, end row of its query block).
pub const SPARSE_QWORK_WORDS: usize = 3;
/// u32 words per block-sparse dK/dV work item: (sequence, first window key, keys, key block).
pub const SPARSE_KWORK_WORDS: usize = 4;
/// An entry of the transposed block index is `query block | index head << SPARSE_QB_BITS`.
pub const SPARSE_QB_BITS: u32 = 20;
/// The query-block bits of a transposed-index entry.
pub const SPARSE_QB_MASK: u32 = (1 << SPARSE_QB_BITS) - 1;


/// Block-sparse dK/dV: (q head, first row, end row of the query block) of query tile `t` of entry
/// `e` of the transposed list at `lo` (entries `query block | index head << SPARSE_QB_BITS`).
/// With an index per q head (`span` > 1) the entry names the head; with one per kv head, the
/// `ri`-th q head of the group (`h_base` = its first).
#[cube]
#[allow(clippy::too_many_arguments)]
fn sparse_q_tile(
    tq_list: &Array<u32>,
    lo: u32,
    e: u32,
    t: u32,
    ri: u32,
    h_base: u32,
    span: u32,
    q_block: u32,
    q_len: u32,
) -> (u32, u32, u32) {
    let entry = tq_list[(lo + e) as usize];
    let qblk = entry & SPARSE_QB_MASK;
    let mut h = h_base + ri;
    if span > 1u32 {
        h = entry >> SPARSE_QB_BITS;
    }
    let b0 = qblk * q_block;
    (h, b0 + t * BWD_BM as u32, min(b0 + q_block, q_len))
}

/// One chunk of [`BWD_SUB`] query rows of a dK/dV plane (16 keys): S^T = K_w Q^T and
/// dP^T = V_w dO^T in one interleaved loop, P^T and dS^T = P^T (dP^T - delta) (both masked),
/// dV += P^T dO, dK += dS^T Q, and with `fuse_dq` dS into `ds_smem`. The per-element masks apply
/// unless `full` (every (key, row) pair of the block visible). (A second copy compiled without
/// masks for `full` chunks halved the common path's instructions but not its time:
/// bench/NOTES.md, "Shared addresses and the dK/dV mask split".)
#[cube]
#[allow(clippy::too_many_arguments)]
fn dkdv_chunk<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    k_smem: &SharedMemory<E>,
    v_smem: &SharedMemory<E>,
    q_smem: &SharedMemory<E>,
    do_smem: &SharedMemory<E>,
    lse_smem: &SharedMemory<f32>,
    dl_smem: &SharedMemory<f32>,
    ds_smem: &mut SharedMemory<E>,
    s: &mut Array<f32>,
    dp: &mut Array<f32>,
    dk_acc: &mut Array<f32>,
    dv_acc: &mut Array<f32>,
    kw_base: usize,
    qb: usize,
    qr0: usize,
    kw0: i32,
    rr0: i32,
    k_hi: u32,
    row_end: u32,
    shift: i32,
    win_l: u32,
    win_r: u32,
    scale_log2: f32,
    full: bool,
    #[comptime] head_dim: usize,
    #[comptime] fuse_dq: bool,
) {
    let lane = UNIT_POS_PLANE;
    let stride = comptime!(head_dim + PAD);
    let dstride = comptime!(BWD_BN + PAD);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let ec = comptime!(vc * sc);
    let sn = comptime!(BWD_SUB / 8);
    // ---- S^T = K_w Q^T and dP^T = V_w dO^T (16 keys x SUB rows each), interleaved ----
    #[unroll]
    for i in 0..comptime!(sn * ec) {
        s[i] = 0.0f32;
        dp[i] = 0.0f32;
    }
    mma_rows_abt_pair::<E, NA, NB, NC>(
        def, k_smem, v_smem, kw_base, q_smem, do_smem, qb + qr0, s, dp, sn, head_dim, stride,
    );

    // ---- masks ----
    // The lane's accumulator rows are two keys (entries e < ec/2: key `lane / 4`, the others key
    // `lane / 4 + 8`). Key `kwin` is seen by the rows rr in [kwin - shift - win_r, kwin - shift +
    // win_l] (the `rows` bounds: causal is win_r = 0, an unbounded side WIN_NONE) below
    // row_end, if it exists (0 <= kwin < k_hi). Bounds relative to this chunk's first row, so an
    // element's test is two compares of its (compile-time) column.
    let (row_a, _ca) = def.position_of_nth(lane, 0u32, MatrixIdent::Accumulator);
    let mut lo_a = 0i32;
    let mut hi_a = 0i32;
    let mut lo_b = 0i32;
    let mut hi_b = 0i32;
    if !full {
        let ka = kw0 + row_a as i32;
        let kb = ka + 8i32;
        let end = row_end as i32 - rr0;
        lo_a = ka - shift - win_r as i32 - rr0;
        lo_b = lo_a + 8i32;
        hi_a = min(end, ka - shift + win_l as i32 + 1i32 - rr0);
        hi_b = min(end, kb - shift + win_l as i32 + 1i32 - rr0);
        if ka < 0i32 || ka >= k_hi as i32 {
            hi_a = -1i32;
        }
        if kb < 0i32 || kb >= k_hi as i32 {
            hi_b = -1i32;
        }
    }
    // ---- P^T = exp(scale S^T - lse) = 2^(scale_log2 S^T - lse log2(e)) into `s`, dS^T = P^T
    // (dP^T - delta[row]) into `dp`, both masked ----
    // dS itself is masked: a masked pair's P is 0 but dP - delta may be non-finite (a non-finite v
    // gives a non-finite dP, a row with a non-finite output a non-finite delta), and 0 * inf
    // would reach dK of a key the row never sees.
    #[unroll]
    for nb in 0..sn {
        #[unroll]
        for e in 0..ec {
            let (_row, col) = def.position_of_nth(lane, e as u32, MatrixIdent::Accumulator);
            let rloc = qr0 + nb * 8 + col as usize;
            let mut p = fast_exp2(s[nb * ec + e] * scale_log2 - lse_smem[qb + rloc]);
            let mut ds = p * (dp[nb * ec + e] - dl_smem[qb + rloc]);
            if !full {
                let c = (nb * 8) as i32 + col as i32;
                let mut ok = c >= lo_b && c < hi_b;
                if e < ec / 2 {
                    ok = c >= lo_a && c < hi_a;
                }
                p = select(ok, p, 0.0f32);
                ds = select(ok, ds, 0.0f32);
            }
            s[nb * ec + e] = p;
            dp[nb * ec + e] = ds;
        }
    }

    // ---- dV += P^T dO ----
    mma_acc_b::<E, NA, NB, NC>(def, s, do_smem, qb + qr0, dv_acc, BWD_SUB, head_dim, stride);

    if fuse_dq {
        // dS (row-major, rows x keys) for the dQ product after the chunk loop.
        #[unroll]
        for nb in 0..sn {
            #[unroll]
            for e in 0..ec {
                let (row, col) = def.position_of_nth(lane, e as u32, MatrixIdent::Accumulator);
                let at = (qr0 + nb * 8 + col as usize) * dstride + kw_base + row as usize;
                ds_smem[at] = E::cast_from(dp[nb * ec + e]);
            }
        }
    }

    // ---- dK += dS^T Q (scaled at the end) ----
    mma_acc_b::<E, NA, NB, NC>(def, dp, q_smem, qb + qr0, dk_acc, BWD_SUB, head_dim, stride);
}

// ---------------------------------------------------------------------------------------------
// Tensor-core kernels (f16 / bf16)
// ---------------------------------------------------------------------------------------------

/// dK, dV. Grid: (entries of `ktiles`, heads_kv); 32 * [`BWD_PLANES`] units.
/// `ktiles`: key-tile indices (tile t = keys `[t*BN, t*BN+BN)` of the shared key axis), most
/// expensive first; `tile_off`/`tile_segs`: CSR list of the segments overlapping each tile;
/// `segs`: (q_start, q_len, k_start, k_len) per segment; `lse`, `delta`: `[heads_q, total_q]`.
/// Sparse: `ktiles` holds [`SPARSE_KWORK_WORDS`] words per item, `tq_off` / `tq_list` the
/// transposed index (cell `(sequence * k_blocks + key block) * idx_heads + index head`).
#[allow(clippy::too_many_arguments, unused_assignments)]
#[cube(launch_unchecked)]
pub fn flash_bwd_dkdv<E: Float, NV: Size, NQ: Size>(
    k: &Array<Vector<E, NV>>,
    v: &Array<Vector<E, NV>>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    dk: &mut Array<E>,
    dv: &mut Array<E>,
    dq_acc: &mut Array<Atomic<Vector<f32, NQ>>>,
    q_s: &Array<E>,
    do_s: &Array<E>,
    ktiles: &Array<u32>,
    tile_off: &Array<u32>,
    tile_segs: &Array<u32>,
    segs: &Array<u32>,
    tq_off: &Array<u32>,
    tq_list: &Array<u32>,
    scale: f32,
    scale_log2: f32,
    heads_q: u32,
    heads_kv: u32,
    total_q: u32,
    total_k: u32,
    q_block: u32,
    idx_heads: u32,
    k_blocks: u32,
    q_tiles_per_block: u32,
    win_l: u32,
    win_r: u32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[comptime] fuse_dq: bool,
    #[comptime] qvec: usize,
    #[comptime] sparse: bool,
    #[comptime] window: bool,
) {
    let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE;
    let plane = UNIT_POS / 32u32;
    let stride = comptime!(head_dim + PAD);
    let dstride = comptime!(BWD_BN + PAD);

    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(BWD_BN * (head_dim + PAD)), 16usize);
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(BWD_BN * (head_dim + PAD)), 16usize);
    // dS of the current query tile, row-major [row][key] (fused dQ only).
    let mut ds_smem =
        SharedMemory::<E>::new_aligned(comptime!(if fuse_dq { BWD_BM * (BWD_BN + PAD) } else { 8 }), 16usize);
    // Two stages of the query tile (Q, dO, lse, delta), rows [0, BM) and [BM, 2 BM): the next
    // tile is copied with cp.async while the current one is computed.
    let nbuf = 2usize;
    let mut q_smem = SharedMemory::<E>::new_aligned(comptime!(nbuf * BWD_BM * (head_dim + PAD)), 16usize);
    let mut do_smem = SharedMemory::<E>::new_aligned(comptime!(nbuf * BWD_BM * (head_dim + PAD)), 16usize);
    let mut lse_smem = SharedMemory::<f32>::new(comptime!(nbuf * BWD_BM));
    let mut dl_smem = SharedMemory::<f32>::new(comptime!(nbuf * BWD_BM));
    let bar0 = Barrier::shared(comptime!((BWD_PLANES * 32) as u32), UNIT_POS == 0);
    let bar1 = Barrier::shared(comptime!((BWD_PLANES * 32) as u32), UNIT_POS == 0);

    let hk = CUBE_POS_Y;
    let group = heads_q / heads_kv;
    // Dense: key tile `kt` of the shared key axis, its segments from the CSR list. Sparse: work
    // item (sequence, first window key, keys, key block) inside one key block of one sequence.
    let mut key0 = 0u32;
    let mut key_lim = total_k;
    let mut s_begin = 0u32;
    let mut s_end = 1u32;
    let mut sp_seq = 0u32;
    let mut sp_kblk = 0u32;
    if sparse {
        let w = CUBE_POS_X as usize * SPARSE_KWORK_WORDS;
        sp_seq = ktiles[w];
        sp_kblk = ktiles[w + 3];
        key0 = segs[sp_seq as usize * 4 + 2] + ktiles[w + 1];
        key_lim = key0 + ktiles[w + 2];
    } else {
        let kt = ktiles[CUBE_POS_X as usize];
        key0 = kt * BWD_BN as u32;
        s_begin = tile_off[kt as usize];
        s_end = tile_off[kt as usize + 1];
    }

    stage_rows::<E, NV>(k, &mut k_smem, key0, key_lim, key0, heads_kv, hk, BWD_BN, head_dim, comptime!(BWD_PLANES * 32));
    stage_rows::<E, NV>(v, &mut v_smem, key0, key_lim, key0, heads_kv, hk, BWD_BN, head_dim, comptime!(BWD_PLANES * 32));
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
    let o_blocks = comptime!(head_dim / 8);
    let sn = comptime!(BWD_SUB / 8);

    let mut dk_acc = Array::<f32>::new(comptime!(o_blocks * ec));
    let mut dv_acc = Array::<f32>::new(comptime!(o_blocks * ec));
    #[unroll]
    for i in 0..comptime!(o_blocks * ec) {
        dk_acc[i] = 0.0f32;
        dv_acc[i] = 0.0f32;
    }
    let mut s = Array::<f32>::new(comptime!(sn * ec));
    let mut dp = Array::<f32>::new(comptime!(sn * ec));

    // This plane's keys: tile rows [kw_base, kw_base + 16).
    let kw_base = plane as usize * 16;

    for si in s_begin..s_end {
        let mut seg = sp_seq as usize;
        if !sparse {
            seg = tile_segs[si as usize] as usize;
        }
        let q_start = segs[seg * 4];
        let q_len = segs[seg * 4 + 1];
        let k_start = segs[seg * 4 + 2];
        let k_len = segs[seg * 4 + 3];
        // Causal diagonal: window key j is visible to segment row r iff j <= shift + r.
        let shift = k_len as i32 - q_len as i32;
        // First row that sees the first overlapping key.
        let first_key = max(key0, k_start) - k_start;
        // rows from the first that sees the tile's first key to the last that sees its last
        // (causal and sliding window: both in the bounds, `rows`)
        let last_key = min(key0 + BWD_BN as u32, k_start + k_len) - 1u32 - k_start;
        let (r_min, _) = key_rows(q_len, k_len, first_key as i32, win_l, win_r);
        let (_, r_end) = key_rows(q_len, k_len, last_key as i32, win_l, win_r);
        // Window-local index of this plane's first key (may be negative).
        let kw0 = (key0 as i32 + kw_base as i32) - k_start as i32;
        // Window keys of this cube: [.., k_hi) (dense: the window; sparse: the item's keys).
        let mut k_hi = k_len;
        // (q head, query tile) pairs of this segment. Dense: q head outer, the tiles from the first
        // row that sees the tile. Sparse: the entries of the transposed index (query blocks
        // listing the key block, per index head; with an index per kv head every q head of the
        // group walks the one list) x `q_tiles_per_block` tiles per query block.
        let mut n_qt = 0u32;
        let mut n_it = 0u32;
        let mut t_lo = 0u32;
        let mut t_n = 0u32;
        let span = idx_heads / heads_kv;
        if sparse {
            k_hi = key_lim - k_start;
            let c0 = (sp_seq * k_blocks + sp_kblk) * idx_heads + hk * span;
            t_lo = tq_off[c0 as usize];
            t_n = tq_off[(c0 + span) as usize] - t_lo;
            n_it = (group / span) * t_n * q_tiles_per_block;
        } else {
            if r_min < r_end {
                n_qt = (r_end as u32 - r_min as u32 + BWD_BM as u32 - 1) / BWD_BM as u32;
            }
            n_it = group * n_qt;
        }
        if n_it > 0 {
            // First tile of the segment: its stage was last read two tiles ago, before the
            // barrier at the top of the previous iteration.
            let boff = ((g_tile & 1u32) * BWD_BM as u32) as usize;
            let mut h0 = hk * group;
            let mut r00 = r_min as u32;
            if sparse {
                let (ha, ra, _re) = sparse_q_tile(tq_list, t_lo, 0u32, 0u32, 0u32, hk * group, span, q_block, q_len);
                h0 = ha;
                r00 = ra;
            }
            issue_q_tile::<E>(
                q_s, do_s, lse, delta, &mut q_smem, &mut do_smem, &mut lse_smem, &mut dl_smem, boff, r00,
                q_len, q_start, h0, heads_q, total_q, head_dim, comptime!(BWD_PLANES * 32),
            );
            commit_stage(&bar0, &bar1, g_tile);
        }
        // The (q head, query tile) pair of iteration `it` as counters (no divisions). Dense: head
        // `hi`, tile `ti`. Sparse: repeat `hi` of the list (q head of an index per kv head),
        // entry `ei`, tile `ti` of the entry's query block.
        let mut hi = 0u32;
        let mut ti = 0u32;
        let mut ei = 0u32;
        for it in 0..n_it {
            let mut h = hk * group + hi;
            let mut r0 = r_min as u32 + ti * BWD_BM as u32;
            // Rows of the tile's query block (dense: the segment).
            let mut row_end = q_len;
            if sparse {
                let (ha, ra, re) = sparse_q_tile(tq_list, t_lo, ei, ti, hi, hk * group, span, q_block, q_len);
                h = ha;
                r0 = ra;
                row_end = re;
                ti += 1u32;
                if ti == q_tiles_per_block {
                    ti = 0u32;
                    ei += 1u32;
                    if ei == t_n {
                        ei = 0u32;
                        hi += 1u32;
                    }
                }
            } else {
                ti += 1u32;
                if ti == n_qt {
                    ti = 0u32;
                    hi += 1u32;
                }
            }
            let mut qb = 0usize;
            sync_cube();
            let cur = g_tile;
            qb = ((cur & 1u32) * BWD_BM as u32) as usize;
            if it + 1 < n_it {
                // Every plane has finished tile cur - 1: its stage takes tile cur + 1.
                let mut hn = hk * group + hi;
                let mut rn = r_min as u32 + ti * BWD_BM as u32;
                if sparse {
                    let (ha, ra, _re) = sparse_q_tile(tq_list, t_lo, ei, ti, hi, hk * group, span, q_block, q_len);
                    hn = ha;
                    rn = ra;
                }
                let nb = (((cur + 1u32) & 1u32) * BWD_BM as u32) as usize;
                issue_q_tile::<E>(
                    q_s, do_s, lse, delta, &mut q_smem, &mut do_smem, &mut lse_smem, &mut dl_smem, nb, rn, q_len,
                    q_start, hn, heads_q, total_q, head_dim, comptime!(BWD_PLANES * 32),
                );
                commit_stage(&bar1, &bar0, cur);
            }
            wait_stage(&bar0, &bar1, cur);
            g_tile = cur + 1u32;

                for sub in 0..comptime!(BWD_BM / BWD_SUB) {
                    let qr0 = sub * BWD_SUB;
                    let rr0 = (r0 as usize + qr0) as i32;
                    // Every (key, row) pair of this plane's 16 x SUB block valid?
                    let mut full = kw0 >= 0i32 && kw0 + 16i32 <= k_hi as i32 && rr0 + BWD_SUB as i32 <= row_end as i32;
                    if window {
                        full = full && kw0 + 15i32 <= shift + rr0 + win_r as i32
                            && kw0 >= shift + rr0 + BWD_SUB as i32 - 1i32 - win_l as i32;
                    } else if causal {
                        full = full && kw0 + 15i32 <= shift + rr0;
                    }

                    dkdv_chunk::<E, NA, NB, NC>(
                        &def, &k_smem, &v_smem, &q_smem, &do_smem, &lse_smem, &dl_smem, &mut ds_smem, &mut s, &mut dp,
                        &mut dk_acc, &mut dv_acc, kw_base, qb, qr0, kw0, rr0, k_hi, row_end, shift, win_l, win_r,
                        scale_log2, full, head_dim, fuse_dq,
                    );
                }

                if fuse_dq {
                    // ---- dQ[rows] += dS K (this plane: 16 rows x head_dim, 32 columns at a
                    // time), added into the f32 accumulator with atomics (scaled later) ----
                    sync_cube();
                    let prow = plane as usize * 16;
                    let (row_a, col_a) = def.position_of_nth(lane, 0u32, MatrixIdent::Accumulator);
                    let (row_b, _cb) = def.position_of_nth(lane, (ec - 1) as u32, MatrixIdent::Accumulator);
                    // Rows past the segment's end add 0.0 to a row that exists (the last row of
                    // the tensor at most): no branch around the atomics, and x + 0.0 == x.
                    let ra = r0 + prow as u32 + row_a;
                    let rb = r0 + prow as u32 + row_b;
                    let ok_a = ra < q_len;
                    let ok_b = rb < q_len;
                    let last = total_q - 1u32;
                    let gba = ((min(q_start + ra, last)) * heads_q + h) as usize * head_dim + col_a as usize;
                    let gbb = ((min(q_start + rb, last)) * heads_q + h) as usize * head_dim + col_a as usize;
                    let mut dqc = Array::<f32>::new(comptime!(4 * ec));
                    for c in 0..comptime!(head_dim / 32) {
                        #[unroll]
                        for i in 0..comptime!(4 * ec) {
                            dqc[i] = 0.0f32;
                        }
                        #[unroll]
                        for ks in 0..comptime!(BWD_BN / 16) {
                            let a = frag_a::<E, NA>(&def, &ds_smem, prow, ks * 16, dstride);
                            #[unroll]
                            for ob2 in 0..2usize {
                                let m = frag_b_n2::<E, NB>(&def, &k_smem, ks * 16, c * 32 + ob2 * 16, stride);
                                mma_into::<E, NA, NB, NC>(&def, &a, &m, 0usize, &mut dqc, (2 * ob2) * ec);
                                mma_into::<E, NA, NB, NC>(&def, &a, &m, 2usize, &mut dqc, (2 * ob2 + 1) * ec);
                            }
                        }
                        // Accumulator pairs (e, e + 1) are adjacent columns of one row.
                        #[unroll]
                        for blk in 0..4usize {
                            #[unroll]
                            for e2 in 0..comptime!(ec / 2) {
                                let e = 2 * e2;
                                let mut ok = ok_a;
                                let mut g = gba;
                                if e >= ec / 2 {
                                    ok = ok_b;
                                    g = gbb;
                                }
                                let x0 = select(ok, dqc[blk * ec + e], 0.0f32);
                                let x1 = select(ok, dqc[blk * ec + e + 1], 0.0f32);
                                let gi = g + c * 32 + blk * 8;
                                if qvec == 2 {
                                    let mut val = Vector::<f32, NQ>::empty();
                                    val[0] = x0;
                                    val[1] = x1;
                                    dq_acc[gi / 2].fetch_add(val);
                                } else {
                                    let mut v0 = Vector::<f32, NQ>::empty();
                                    v0[0] = x0;
                                    dq_acc[gi].fetch_add(v0);
                                    let mut v1 = Vector::<f32, NQ>::empty();
                                    v1[0] = x1;
                                    dq_acc[gi + 1].fetch_add(v1);
                                }
                            }
                        }
                    }
                }
        }
    }

    // ---- write dK, dV (zero for keys no segment sees; sparse: the item's keys only) ----
    #[unroll]
    for ob in 0..o_blocks {
        #[unroll]
        for e in 0..ec {
            let (row, col) = def.position_of_nth(lane, e as u32, MatrixIdent::Accumulator);
            let key = key0 + kw_base as u32 + row;
            if key < key_lim {
                let g = (key * heads_kv + hk) as usize * head_dim + ob * 8 + col as usize;
                dk[g] = E::cast_from(dk_acc[ob * ec + e] * scale);
                dv[g] = E::cast_from(dv_acc[ob * ec + e]);
            }
        }
    }
}

/// dQ. Grid: work items x heads_q in one dimension, heads fastest; 32 * [`BWD_PLANES`] units.
/// `work`: two u32 per cube (segment id, first row of the tile inside the segment); rows no
/// segment covers are not written here (see [`fill_zero`]). Sparse: [`SPARSE_QWORK_WORDS`] words per item and
/// `tile_ref[(index head * items + item) * 2..]` = (offset into `blocks`, key tiles), as in the
/// forward.
#[allow(clippy::too_many_arguments, unused_assignments)]
#[cube(launch_unchecked)]
pub fn flash_bwd_dq<E: Float, NV: Size>(
    q: &Array<Vector<E, NV>>,
    dout: &Array<Vector<E, NV>>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    dq: &mut Array<E>,
    k_s: &Array<E>,
    v_s: &Array<E>,
    work: &Array<u32>,
    segs: &Array<u32>,
    tile_ref: &Array<u32>,
    blocks: &Array<u32>,
    scale: f32,
    scale_log2: f32,
    heads_q: u32,
    heads_kv: u32,
    total_q: u32,
    idx_heads: u32,
    k_block: u32,
    tiles_per_block: u32,
    win_l: u32,
    win_r: u32,
    #[comptime] head_dim: usize,
    #[comptime] sparse: bool,
    #[comptime] window: bool,
) {
    let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE;
    let plane = UNIT_POS / 32u32;
    let stride = comptime!(head_dim + PAD);

    // Two stages of K/V rows, [0, BN) and [BN, 2 BN). Key tile kt uses stage (kt + 1) % 2 and
    // barrier phase (kt / 2) % 2; stage 0 first holds the Q / dO staging.
    let nbuf = 2usize;
    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(nbuf * BWD_BN * (head_dim + PAD)), 16usize);
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(nbuf * BWD_BN * (head_dim + PAD)), 16usize);
    let bar0 = Barrier::shared(comptime!((BWD_PLANES * 32) as u32), UNIT_POS == 0);
    let bar1 = Barrier::shared(comptime!((BWD_PLANES * 32) as u32), UNIT_POS == 0);

    // One cube per (work item, q head), heads fastest: the cubes start in the work list's order
    // (most keys first) over all heads, so the longest ones do not start last.
    let tile = (CUBE_POS_X / heads_q) as usize;
    let head = CUBE_POS_X % heads_q;
    let group = heads_q / heads_kv;
    let head_kv = head / group;

    let wstride = comptime!(if sparse { SPARSE_QWORK_WORDS } else { 2usize });
    let seg = work[tile * wstride] as usize;
    let tile_start = work[tile * wstride + 1];
    let q_start = segs[seg * 4];
    let q_len = segs[seg * 4 + 1];
    let k_start = segs[seg * 4 + 2];
    let k_len = segs[seg * 4 + 3];
    // Rows of this cube: [tile_start, row_end) (sparse: cut at the query block's end).
    let mut row_end = q_len;
    if sparse {
        row_end = work[tile * wstride + 2];
    }

    // Key tiles (see `tile_bounds`): dense, the window keys the rows see in BN steps; sparse, the
    // listed key blocks of this (item, index head) from `tile_ref` (cut after the last block any
    // row sees when causal), the first LIST_SMEM ids staged in shared memory.
    let mut n_tiles = 0u32;
    let mut list = 0u32;
    // Dense key range of the tiles, window-relative: [klo, khi) (a sliding window starts at the
    // first key the tile's first row sees).
    let mut klo = 0u32;
    let mut khi = k_len;
    let mut list_smem = SharedMemory::<u32>::new(comptime!(if sparse { LIST_SMEM } else { 1usize }));
    if sparse {
        let mut y = head;
        if idx_heads != heads_q {
            y = head / group;
        }
        let r = ((y * (CUBE_COUNT_X / heads_q) + tile as u32) * 2u32) as usize;
        list = tile_ref[r];
        n_tiles = tile_ref[r + 1];
        let lim = min((n_tiles + tiles_per_block - 1) / tiles_per_block, LIST_SMEM as u32);
        #[unroll]
        for pass in 0..comptime!(LIST_SMEM.div_ceil(BWD_PLANES * 32)) {
            let i = UNIT_POS + (pass * BWD_PLANES * 32) as u32;
            if i < lim {
                list_smem[i as usize] = blocks[(list + i) as usize];
            }
        }
    } else {
        // from the first key the tile's first row sees to the last its last row sees
        let rows_here = min(q_len - tile_start, BWD_BM as u32);
        let (a, _) = row_keys(q_len, k_len, tile_start, win_l, win_r);
        let (_, b) = row_keys(q_len, k_len, tile_start + rows_here - 1u32, win_l, win_r);
        klo = a;
        khi = max(a, b);
        n_tiles = (khi - klo + BWD_BN as u32 - 1) / BWD_BN as u32;
    }

    // Barrier initialisation (and the staged list) visible, then key tile 0 into stage 1
    // while Q / dO are staged.
    sync_cube();
    if n_tiles > 0 {
        let (f0, _f1) = tile_bounds(0u32, klo, khi, list, blocks, &list_smem, k_block, tiles_per_block, BWD_BN, sparse);
        issue_kv_tile::<E>(
            k_s, v_s, &mut k_smem, &mut v_smem, BWD_BN, f0, k_len, k_start, head_kv, heads_kv, head_dim,
        );
        commit_copies(&bar1);
    }
    // ---- Q and dO tiles through shared memory into A fragments (BM == BN) ----
    stage_rows::<E, NV>(q, &mut k_smem, tile_start, q_len, q_start + tile_start, heads_q, head, BWD_BM, head_dim, comptime!(BWD_PLANES * 32));
    stage_rows::<E, NV>(dout, &mut v_smem, tile_start, q_len, q_start + tile_start, heads_q, head, BWD_BM, head_dim, comptime!(BWD_PLANES * 32));
    sync_cube();

    let size!(NA) = def.vector_size(MatrixIdent::A);
    let size!(NB) = def.vector_size(MatrixIdent::B);
    let size!(NC) = def.vector_size(MatrixIdent::Accumulator);
    let va = def.vectors_per_lane(MatrixIdent::A);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let ec = comptime!(vc * sc);
    let o_blocks = comptime!(head_dim / 8);
    let sn = comptime!(BWD_SUB / 8);
    let k_steps = comptime!(head_dim / 16);

    let mut qf = Array::<Vector<E, NA>>::new(comptime!(k_steps * va));
    let mut df = Array::<Vector<E, NA>>::new(comptime!(k_steps * va));
    #[unroll]
    for ks in 0..k_steps {
        let a = frag_a::<E, NA>(&def, &k_smem, plane as usize * 16, ks * 16, stride);
        let b = frag_a::<E, NA>(&def, &v_smem, plane as usize * 16, ks * 16, stride);
        #[unroll]
        for i in 0..va {
            qf[ks * va + i] = a[i];
            df[ks * va + i] = b[i];
        }
    }

    // Accumulator elements [0, ec/2) sit on row `row_a`, [ec/2, ec) on `row_b`.
    let (row_a, _ca) = def.position_of_nth(lane, 0u32, MatrixIdent::Accumulator);
    let (row_b, _cb) = def.position_of_nth(lane, (ec - 1) as u32, MatrixIdent::Accumulator);
    let rl_a = tile_start + plane * 16 + row_a;
    let rl_b = tile_start + plane * 16 + row_b;
    // each row's keys [lo, lim) (causal and sliding window: both in the bounds, `rows`)
    let (a0, a1) = row_keys(q_len, k_len, rl_a, win_l, win_r);
    let (b0, b1) = row_keys(q_len, k_len, rl_b, win_l, win_r);
    let lo_a = a0 as i32;
    let mut lim_a = a1 as i32;
    let lo_b = b0 as i32;
    let mut lim_b = b1 as i32;
    let mut lse_a = 0.0f32;
    let mut lse_b = 0.0f32;
    let mut dl_a = 0.0f32;
    let mut dl_b = 0.0f32;
    if rl_a < q_len {
        let i = (head * total_q + q_start + rl_a) as usize;
        lse_a = lse[i] * LOG2E;
        dl_a = delta[i];
    }
    if rl_b < q_len {
        let i = (head * total_q + q_start + rl_b) as usize;
        lse_b = lse[i] * LOG2E;
        dl_b = delta[i];
    }
    // Rows past the segment end (sparse: the query block's end): force every key masked.
    if rl_a >= row_end {
        lim_a = 0i32;
    }
    if rl_b >= row_end {
        lim_b = 0i32;
    }

    let mut dq_acc = Array::<f32>::new(comptime!(o_blocks * ec));
    #[unroll]
    for i in 0..comptime!(o_blocks * ec) {
        dq_acc[i] = 0.0f32;
    }
    let mut s = Array::<f32>::new(comptime!(sn * ec));
    let mut dp = Array::<f32>::new(comptime!(sn * ec));

    for kt in 0..n_tiles {
        // Window keys [kb, kb_end) of tile kt (dense: kb_end is not needed, `lim_*` cut).
        let (kb, kb_end) = tile_bounds(kt, klo, khi, list, blocks, &list_smem, k_block, tiles_per_block, BWD_BN, sparse);
        let mut kb_off = 0usize;
        sync_cube();
        kb_off = (((kt + 1u32) & 1u32) * BWD_BN as u32) as usize;
        if kt + 1 < n_tiles {
            // Every plane has finished tile kt - 1 (or the Q / dO fragments): its stage
            // takes tile kt + 1.
            let nb = ((kt & 1u32) * BWD_BN as u32) as usize;
            let mut next = kb + BWD_BN as u32;
            if sparse {
                let (n0, _n1) = tile_bounds(kt + 1u32, klo, khi, list, blocks, &list_smem, k_block, tiles_per_block, BWD_BN, sparse);
                next = n0;
            }
            issue_kv_tile::<E>(
                k_s, v_s, &mut k_smem, &mut v_smem, nb, next, k_len, k_start, head_kv, heads_kv, head_dim,
            );
            commit_stage(&bar0, &bar1, kt);
        }
        wait_stage(&bar1, &bar0, kt);

        for sub in 0..comptime!(BWD_BN / BWD_SUB) {
            let kc0 = sub * BWD_SUB;
            #[unroll]
            for i in 0..comptime!(sn * ec) {
                s[i] = 0.0f32;
                dp[i] = 0.0f32;
            }
            // ---- S = Q K^T, dP = dO V^T (16 rows x SUB keys) ----
            #[unroll]
            for nb in 0..sn {
                #[unroll]
                for kk in 0..comptime!(k_steps / 2) {
                    let mk = frag_b_t2::<E, NB>(&def, &k_smem, kb_off + kc0 + nb * 8, kk * 32, stride);
                    let mv = frag_b_t2::<E, NB>(&def, &v_smem, kb_off + kc0 + nb * 8, kk * 32, stride);
                    #[unroll]
                    for h in 0..2usize {
                        let ks = 2 * kk + h;
                        let mut aq = Array::<Vector<E, NA>>::new(va);
                        let mut ad = Array::<Vector<E, NA>>::new(va);
                        #[unroll]
                        for i in 0..va {
                            aq[i] = qf[ks * va + i];
                            ad[i] = df[ks * va + i];
                        }
                        mma_into::<E, NA, NB, NC>(&def, &aq, &mk, 2 * h, &mut s, nb * ec);
                        mma_into::<E, NA, NB, NC>(&def, &ad, &mv, 2 * h, &mut dp, nb * ec);
                    }
                }
            }
            // ---- dS = P (dP - delta), P = exp(scale S - lse) masked ----
            let chunk_end = (kb + kc0 as u32 + BWD_SUB as u32) as i32;
            // Sparse: a tile cut at its key block's end masks the keys past it too.
            let mut la = lim_a;
            let mut lb = lim_b;
            if sparse {
                la = min(lim_a, kb_end as i32);
                lb = min(lim_b, kb_end as i32);
            }
            let mut needs_mask = chunk_end > la || chunk_end > lb;
            if window {
                let chunk0 = (kb + kc0 as u32) as i32;
                needs_mask = needs_mask || chunk0 < lo_a || chunk0 < lo_b;
            }
            #[unroll]
            for nb in 0..sn {
                #[unroll]
                for e in 0..ec {
                    let mut l = lse_b;
                    let mut dd = dl_b;
                    let mut lim = lb;
                    let mut lo = lo_b;
                    if e < ec / 2 {
                        l = lse_a;
                        dd = dl_a;
                        lim = la;
                        lo = lo_a;
                    }
                    let p = fast_exp2(s[nb * ec + e] * scale_log2 - l);
                    let mut ds = p * (dp[nb * ec + e] - dd);
                    if needs_mask {
                        let (_row, col) = def.position_of_nth(lane, e as u32, MatrixIdent::Accumulator);
                        let key = (kb + (kc0 + nb * 8) as u32 + col) as i32;
                        // dS itself, not P: dP of a masked key may be non-finite (a non-finite v)
                        if key >= lim || (window && key < lo) {
                            ds = 0.0f32;
                        }
                    }
                    s[nb * ec + e] = ds;
                }
            }
            // ---- dQ += dS K ----
            mma_acc_b::<E, NA, NB, NC>(&def, &s, &k_smem, kb_off + kc0, &mut dq_acc, BWD_SUB, head_dim, stride);
        }
    }

    #[unroll]
    for ob in 0..o_blocks {
        #[unroll]
        for e in 0..ec {
            let (row, col) = def.position_of_nth(lane, e as u32, MatrixIdent::Accumulator);
            let rl = tile_start + plane * 16 + row;
            if rl < row_end {
                let g = ((q_start + rl) * heads_q + head) as usize * head_dim + ob * 8 + col as usize;
                dq[g] = E::cast_from(dq_acc[ob * ec + e] * scale);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Preprocessing and fills (any float type)
// ---------------------------------------------------------------------------------------------

/// delta[h, t] = sum_d dO[t, h, d] * O[t, h, d] in f32. One plane per (t, h) pair, pairs in
/// storage order; a 2-D grid (x fastest) of cubes of [`DELTA_PLANES`] planes.
#[cube(launch_unchecked)]
pub fn bwd_delta<E: Float>(
    out: &Array<E>,
    dout: &Array<E>,
    delta: &mut Array<f32>,
    heads_q: u32,
    total_q: u32,
    #[comptime] head_dim: usize,
) {
    let per_lane = comptime!(head_dim / 32);
    let lane = UNIT_POS_PLANE as usize;
    let cube = CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X;
    let idx = cube * DELTA_PLANES as u32 + UNIT_POS / 32u32;
    if idx < total_q * heads_q {
        let base = idx as usize * head_dim;
        let mut acc = 0.0f32;
        #[unroll]
        for i in 0..per_lane {
            let j = base + i * 32 + lane;
            acc += f32::cast_from(out[j]) * f32::cast_from(dout[j]);
        }
        let tot = plane_sum(acc);
        if lane == 0 {
            let t = idx / heads_q;
            let h = idx % heads_q;
            delta[(h * total_q + t) as usize] = tot;
        }
    }
}

/// dq = scale * acc (the f32 dQ accumulator of the fused path) rounded to `E`
/// (2-D grid, x fastest, 256 units per cube).
#[cube(launch_unchecked)]
pub fn dq_convert<E: Float>(acc: &Array<f32>, dq: &mut Array<E>, scale: f32) {
    let idx = ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * 256u32 + UNIT_POS) as usize;
    if idx < dq.len() {
        dq[idx] = E::cast_from(acc[idx] * scale);
    }
}

/// Zeroes `x` (2-D grid, x fastest, 256 units per cube).
#[cube(launch_unchecked)]
pub fn fill_zero<E: Float>(x: &mut Array<E>) {
    let idx = ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * 256u32 + UNIT_POS) as usize;
    if idx < x.len() {
        x[idx] = E::from_int(0);
    }
}
