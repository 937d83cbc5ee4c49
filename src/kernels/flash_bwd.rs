//! Flash-attention backward (FlashAttention-2 style, P recomputed from the LSE) on tensor cores
//! through CubeCL's manual `mma.sync` path (m16n8k16, f16/bf16 operands, f32 accumulators), and
//! its small preprocessing / fill kernels. Fragment loads and mma wrappers live in `fragments`,
//! the tile staging in `staging`; f32 inputs take `rowwise_bwd`.
//!
//! dK / dV of f16 / bf16 calls (dense and block-sparse) come from
//! `flash_bwd_wide::flash_bwd_dkdv_wide` (128-key cubes), with dQ fused into it through f32
//! atomics or, when deterministic, from [`flash_bwd_dq`] here:
//! - [`flash_bwd_dq`]: one cube per (query tile of [`BWD_BM`] rows, query head); each plane owns
//!   16 rows and loops over the key tiles its rows see: S = Q K^T, dP = dO V^T,
//!   dS = P (dP - delta), dQ += dS K. Every output element is written by one cube in a fixed
//!   order (no atomics): bitwise identical run to run.
//!
//! Rows are segment-local and keys window-local for the masks: segment row `r` sees window keys
//! `j <= k_len - q_len + r` when causal (bottom-right alignment).
//!
//! Block-sparse (comptime `sparse`): a dQ cube's rows lie in one query block and its key tiles
//! are that block's listed key blocks (the forward's `tile_bounds` over a list).

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;
use cubecl::prelude::barrier::Barrier;

use super::cards::DqCard;
use super::flash_fwd::{tile_bounds, tile_div_magic, LIST_SMEM};
use super::kv_tiles::{issue_kv_tile, issue_tile_boxes};
use super::fragments::{frag_a, frag_b_t2, mma_acc_b, mma_into};
use super::grid::cube_item_slot;
use super::staging::{commit_copies, commit_stage, stage_rows, wait_stage};
use super::math::{fast_exp2, LOG2E};
use super::rows::{kv_row, row_keys};
use super::tiles::{BWD_BM, BWD_BN, BWD_PLANES, BWD_SUB, CONVERT_VEC, DELTA_PLANES, PAD, SPARSE_QWORK_WORDS};



// ---------------------------------------------------------------------------------------------
// Tensor-core kernels (f16 / bf16)
// ---------------------------------------------------------------------------------------------

/// One dQ cube's rows and key tiles: rows `[tile_start, row_end)` of segment (`q_start`, `q_len`,
/// `k_start`, `k_len`) for q head `head`; `n_tiles` key tiles (see `tile_bounds`): dense, the
/// window keys `[klo, khi)` the rows see in [`BWD_BN`] steps; sparse, the listed key blocks of this
/// (item, index head) from `tile_ref` at `list` (cut after the last block any row sees when
/// causal), the first [`LIST_SMEM`] ids staged in `list_smem` (visible after the caller's next
/// cube barrier).
#[derive(CubeType, Clone, Copy)]
pub struct DqItem {
    pub tile_start: u32,
    pub q_start: u32,
    pub q_len: u32,
    pub k_start: u32,
    pub k_len: u32,
    pub row_end: u32,
    pub n_tiles: u32,
    pub list: u32,
    pub klo: u32,
    pub khi: u32,
    pub tpb_magic: u32,
    pub head: u32,
    pub head_kv: u32,
}

/// This cube's [`DqItem`] (one cube per (work item, q head); block-sparse items fastest), read by
/// `BWD_PLANES * 32` units.
#[cube]
#[allow(unused_assignments)]
pub fn dq_item<E: Float, NV: Size>(args: &DqCard<E, NV>, list_smem: &mut SharedMemory<u32>, #[comptime] sparse: bool) -> DqItem {
    let (tile, head) = cube_item_slot(args.heads_q, args.kv_outer, sparse);
    let tile = tile as usize;
    let group = args.heads_q / args.heads_kv;
    let head_kv = head / group;

    let wstride = comptime!(if sparse { SPARSE_QWORK_WORDS } else { 2usize });
    let seg = args.work[tile * wstride] as usize;
    let tile_start = args.work[tile * wstride + 1];
    let q_start = args.segs[seg * 4];
    let q_len = args.segs[seg * 4 + 1];
    let k_start = args.segs[seg * 4 + 2];
    let k_len = args.segs[seg * 4 + 3];
    // Rows of this cube: [tile_start, row_end) (sparse: cut at the query block's end).
    let mut row_end = q_len;
    if sparse {
        row_end = args.work[tile * wstride + 2];
    }
    let mut n_tiles = 0u32;
    let mut list = 0u32;
    // Dense key range of the tiles, window-relative: [klo, khi) (a sliding window starts at the
    // first key the tile's first row sees).
    let mut klo = 0u32;
    let mut khi = k_len;
    let mut tpb_magic = 0u32;
    if sparse {
        tpb_magic = tile_div_magic(args.tiles_per_block);
        let mut y = head;
        if args.idx_heads != args.heads_q {
            y = head / group;
        }
        let r = ((y * (CUBE_COUNT_X / args.heads_q) + tile as u32) * 2u32) as usize;
        list = args.tile_ref[r];
        n_tiles = args.tile_ref[r + 1];
        let lim = min((n_tiles + args.tiles_per_block - 1) / args.tiles_per_block, LIST_SMEM as u32);
        #[unroll]
        for pass in 0..comptime!(LIST_SMEM.div_ceil(BWD_PLANES * 32)) {
            let i = UNIT_POS + (pass * BWD_PLANES * 32) as u32;
            if i < lim {
                list_smem[i as usize] = args.blocks[(list + i) as usize];
            }
        }
    } else {
        // from the first key the tile's first row sees to the last its last row sees
        let rows_here = min(q_len - tile_start, BWD_BM as u32);
        let (a, _) = row_keys(q_len, k_len, tile_start, args.win_l, args.win_r);
        let (_, b) = row_keys(q_len, k_len, tile_start + rows_here - 1u32, args.win_l, args.win_r);
        klo = a;
        khi = max(a, b);
        n_tiles = (khi - klo + BWD_BN as u32 - 1) / BWD_BN as u32;
    }
    DqItem { tile_start, q_start, q_len, k_start, k_len, row_end, n_tiles, list, klo, khi, tpb_magic, head, head_kv }
}

/// Window keys `[kb, kb_end)` of key tile `kt` of item `it` (`tile_bounds` over its key range,
/// or block-sparse its list, the first ids staged in `list_smem`).
#[cube]
pub fn dq_tile<E: Float, NV: Size>(args: &DqCard<E, NV>, it: &DqItem, list_smem: &SharedMemory<u32>, kt: u32, #[comptime] sparse: bool) -> (u32, u32) {
    tile_bounds(kt, it.klo, it.khi, it.list, &args.blocks, list_smem, args.k_block, args.tiles_per_block, it.tpb_magic, BWD_BN, sparse)
}

/// The first window key of tile `kt + 1` of item `it`, tile `kt` starting at `kb`: dense, the next
/// [`BWD_BN`] keys.
#[cube]
pub fn dq_next_tile<E: Float, NV: Size>(
    args: &DqCard<E, NV>,
    it: &DqItem,
    list_smem: &SharedMemory<u32>,
    kt: u32,
    kb: u32,
    #[comptime] sparse: bool,
) -> u32 {
    let mut next = kb + BWD_BN as u32;
    if sparse {
        let (n0, _n1) = dq_tile(args, it, list_smem, kt + 1u32, sparse);
        next = n0;
    }
    next
}

/// One query row of a dQ cube: the window keys `[lo, lim)` it sees (none at or past the cube's
/// `row_end`: sparse, the query block's end), its lse times log2 e and its delta (0 past the
/// segment).
#[derive(CubeType, Clone, Copy)]
pub struct DqRow {
    pub lo: i32,
    pub lim: i32,
    pub lse2: f32,
    pub dl: f32,
}

/// [`DqRow`] of segment row `rl` of item `it`.
#[cube]
pub fn dq_row<E: Float, NV: Size>(args: &DqCard<E, NV>, it: &DqItem, rl: u32) -> DqRow {
    let (a0, a1) = row_keys(it.q_len, it.k_len, rl, args.win_l, args.win_r);
    let mut lim = a1 as i32;
    let mut lse2 = 0.0f32;
    let mut dl = 0.0f32;
    if rl < it.q_len {
        let i = (it.head * args.total_q + it.q_start + rl) as usize;
        lse2 = args.lse[i] * LOG2E;
        dl = args.delta[i];
    }
    if rl >= it.row_end {
        lim = 0i32;
    }
    DqRow { lo: a0 as i32, lim, lse2, dl }
}

/// dQ. Grid: work items x heads_q in one dimension, heads fastest (block-sparse: items fastest); 32 * [`BWD_PLANES`] units.
/// `work`: two u32 per cube (segment id, first row of the tile inside the segment); rows no
/// segment covers are not written here (the host zero-fills them first). Sparse: [`SPARSE_QWORK_WORDS`] words per item and
/// `tile_ref[(index head * items + item) * 2..]` = (offset into `blocks`, key tiles), as in the
/// forward. Arguments: the dQ card (`cards::DqCard`).
#[allow(clippy::too_many_arguments, unused_assignments)]
#[cube(launch_unchecked)]
pub fn flash_bwd_dq<E: Float, NV: Size>(
    args: &mut DqCard<E, NV>,
    #[comptime] head_dim: usize,
    #[comptime] sparse: bool,
    #[comptime] window: bool,
    #[comptime] paged: bool,
    #[comptime] tma: bool,
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

    let mut list_smem = SharedMemory::<u32>::new(comptime!(if sparse { LIST_SMEM } else { 1usize }));
    let it = dq_item(args, &mut list_smem, sparse);
    let (tile_start, q_start, q_len, k_start, k_len, row_end) = (it.tile_start, it.q_start, it.q_len, it.k_start, it.k_len, it.row_end);
    let (n_tiles, head, head_kv) = (it.n_tiles, it.head, it.head_kv);

    // Barrier initialisation (and the staged list) visible, then key tile 0 into stage 1
    // while Q / dO are staged.
    sync_cube();
    if n_tiles > 0 {
        let (f0, _f1) = dq_tile(args, &it, &list_smem, 0u32, sparse);
        load_kv_stage::<E>(
            &args.k_map, &args.v_map, &args.k_s, &args.v_s, &mut k_smem, &mut v_smem, &bar0, &bar1, 1u32, BWD_BN, f0, k_len,
            k_start, head_kv, args.heads_kv, &args.blocks, head_dim, paged, tma,
        );
        commit_copies(&bar1);
    }
    // ---- Q and dO tiles through shared memory into A fragments (BM == BN) ----
    stage_rows::<E, NV>(&args.q, &mut k_smem, tile_start, q_len, q_start + tile_start, args.heads_q, head, &args.segs, BWD_BM, head_dim, comptime!(BWD_PLANES * 32), false, false);
    stage_rows::<E, NV>(&args.dout, &mut v_smem, tile_start, q_len, q_start + tile_start, args.heads_q, head, &args.segs, BWD_BM, head_dim, comptime!(BWD_PLANES * 32), false, false);
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
    let ra = dq_row(args, &it, rl_a);
    let rb = dq_row(args, &it, rl_b);
    let (lo_a, lim_a, lse_a, dl_a) = (ra.lo, ra.lim, ra.lse2, ra.dl);
    let (lo_b, lim_b, lse_b, dl_b) = (rb.lo, rb.lim, rb.lse2, rb.dl);

    let mut dq_acc = Array::<f32>::new(comptime!(o_blocks * ec));
    #[unroll]
    for i in 0..comptime!(o_blocks * ec) {
        dq_acc[i] = 0.0f32;
    }
    let mut s = Array::<f32>::new(comptime!(sn * ec));
    let mut dp = Array::<f32>::new(comptime!(sn * ec));

    for kt in 0..n_tiles {
        // Window keys [kb, kb_end) of tile kt (dense: kb_end is not needed, `lim_*` cut).
        let (kb, kb_end) = dq_tile(args, &it, &list_smem, kt, sparse);
        let mut kb_off = 0usize;
        sync_cube();
        kb_off = (((kt + 1u32) & 1u32) * BWD_BN as u32) as usize;
        if kt + 1 < n_tiles {
            // Every plane has finished tile kt - 1 (or the Q / dO fragments): its stage
            // takes tile kt + 1.
            let nb = ((kt & 1u32) * BWD_BN as u32) as usize;
            let next = dq_next_tile(args, &it, &list_smem, kt, kb, sparse);
            load_kv_stage::<E>(
                &args.k_map, &args.v_map, &args.k_s, &args.v_s, &mut k_smem, &mut v_smem, &bar0, &bar1, kt, nb, next, k_len,
                k_start, head_kv, args.heads_kv, &args.blocks, head_dim, paged, tma,
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
                    let p = fast_exp2(s[nb * ec + e] * args.scale_log2 - l);
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
                let g = ((q_start + rl) * args.heads_q + head) as usize * head_dim + ob * 8 + col as usize;
                args.dq[g] = E::cast_from(dq_acc[ob * ec + e] * args.scale);
            }
        }
    }
}

/// Window keys `kb..kb + BWD_BN` of K and V into rows `boff..` of their stage buffers, for the
/// barrier [`commit_stage`] picks for `stage` (`even` / `odd`): with `tma` (sm_90+) and every key
/// inside the segment, one [`kv_map_box`](super::kv_tiles::kv_map_box) tensor-map copy of K and
/// one of V issued by unit 0 (the barrier's expected bytes raised first); else `cp.async` by every
/// unit ([`issue_kv_tile`], rows clamped to the segment). The caller commits.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_kv_stage<E: Float>(
    k_map: &TensorMap<E, Tiled>,
    v_map: &TensorMap<E, Tiled>,
    k_s: &Array<E>,
    v_s: &Array<E>,
    k_smem: &mut SharedMemory<E>,
    v_smem: &mut SharedMemory<E>,
    even: &Barrier,
    odd: &Barrier,
    stage: u32,
    boff: usize,
    kb: u32,
    k_len: u32,
    k_start: u32,
    head_kv: u32,
    heads_kv: u32,
    pages: &Array<u32>,
    #[comptime] head_dim: usize,
    #[comptime] paged: bool,
    #[comptime] tma: bool,
) {
    // (`tma` alone decides at compile time: without it no tensor-map code is generated, which
    // GPUs below sm_90 could not compile)
    let mut by_map = false;
    if comptime!(tma) {
        by_map = kb + BWD_BN as u32 <= k_len;
    }
    if by_map {
        if comptime!(tma) {
            // the tile's first row in the buffer (paged: a tile lies in one page, as `issue_kv_tile`)
            let y = kv_row(k_start + kb, pages, paged);
            if (stage & 1u32) == 0 {
                issue_tile_boxes(k_map, k_smem, even, boff * comptime!(head_dim + PAD), y, y, head_kv, BWD_BN, head_dim, false);
                issue_tile_boxes(v_map, v_smem, even, boff * comptime!(head_dim + PAD), y, y, head_kv, BWD_BN, head_dim, false);
            } else {
                issue_tile_boxes(k_map, k_smem, odd, boff * comptime!(head_dim + PAD), y, y, head_kv, BWD_BN, head_dim, false);
                issue_tile_boxes(v_map, v_smem, odd, boff * comptime!(head_dim + PAD), y, y, head_kv, BWD_BN, head_dim, false);
            }
        }
    } else {
        issue_kv_tile::<E>(k_s, v_s, k_smem, v_smem, boff, kb, k_len, k_start, head_kv, heads_kv, pages, head_dim, paged);
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

/// dq = scale * acc (the f32 dQ accumulator of the fused path) rounded to `E`, [`CONVERT_VEC`]
/// elements per unit (16-byte loads) (2-D grid, x fastest, 256 units per cube). `head_dim` 0: the
/// accumulator is laid out as dQ (`[total_q, heads_q, head_dim]`); else head-major (`[heads_q,
/// total_q, head_dim]`, the 16-byte chunk `c` of row r at `c ^ (2 r % 8)`: `flash_bwd_ws`'s tiles).
#[cube(launch_unchecked)]
pub fn dq_convert<E: Float, N: Size>(
    acc: &Array<Vector<f32, N>>,
    dq: &mut Array<Vector<E, N>>,
    scale: f32,
    heads_q: u32,
    total_q: u32,
    #[comptime] head_dim: usize,
) {
    let idx = ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * 256u32 + UNIT_POS) as usize;
    if idx < dq.len() {
        let mut src = idx;
        if comptime!(head_dim > 0) {
            // one unit = one 16-byte chunk of a (row, head)
            let chunks = comptime!((head_dim / CONVERT_VEC) as u32);
            let i = idx as u32;
            let (c, rh) = (i % chunks, i / chunks);
            let (row, h) = (rh / heads_q, rh % heads_q);
            src = ((h * total_q + row) * chunks + (c ^ ((2u32 * row) % 8u32))) as usize;
        }
        let a = acc[src];
        let mut o = Vector::<E, N>::empty();
        #[unroll]
        for e in 0..CONVERT_VEC {
            o[e] = E::cast_from(a[e] * scale);
        }
        dq[idx] = o;
    }
}
