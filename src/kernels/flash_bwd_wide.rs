//! dK / dV with 128-key cubes of 8 planes (f16 / bf16, mma.sync m16n8k16): the partition of
//! FlashAttention-2's backward. Same inputs, work lists and results as
//! [`super::flash_bwd::flash_bwd_dkdv`] on its deterministic path (no dQ), which gives each plane
//! 16 keys and every query row, so each Q / dO fragment it loads from shared memory feeds one mma.
//!
//! Here, per 64-row query tile:
//! 1. S^T = K Q^T and dP^T = V dO^T: plane (kp, rp) computes 32 keys (`kp * 32`) x 32 rows
//!    (`rp * 32`), so every A and B fragment feeds two or four mma;
//! 2. P^T = exp(scale S^T - lse) and dS^T = P^T (dP^T - delta) go to shared memory as the dtype;
//! 3. after one barrier, plane (kp, rp) accumulates dV += P^T dO and dK += dS^T Q for its 32 keys
//!    and columns `rp * head_dim / 2 ..`, over all 64 rows (each dO / Q fragment feeds 4 mma).
//! The accumulators (dK, dV: 32 keys x head_dim / 2 per plane) stay in registers for the whole
//! cube; K and V stay in shared memory; Q / dO / lse / delta tiles are double-buffered with
//! `cp.async` as in the 64-key kernel.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;

use super::flash_bwd::{fast_exp, frag_a, frag_b_n2, frag_b_t2, issue_q_tile, mma_into, stage_rows, BWD_BM, PAD};

/// Planes (warps) per cube.
pub const WIDE_PLANES: usize = 8;
/// Keys per cube.
pub const WIDE_BN: usize = 128;
/// Keys (and query rows) of one plane's S^T / dP^T block.
const BLK: usize = 32;

/// dK, dV. Grid: (entries of `ktiles`, heads_kv); 32 * [`WIDE_PLANES`] units. `ktiles`, `tile_off`,
/// `tile_segs`: the work list and CSR segment lists of [`WIDE_BN`]-key tiles; `segs`: (q_start,
/// q_len, k_start, k_len) per segment; `lse`, `delta`: `[heads_q, total_q]`. `q_s` / `do_s` are
/// q and dout as scalars (the `cp.async` sources).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
pub fn flash_bwd_dkdv_wide<E: Float, NV: Size>(
    k: &Array<Vector<E, NV>>,
    v: &Array<Vector<E, NV>>,
    lse: &Array<f32>,
    delta: &Array<f32>,
    dk: &mut Array<E>,
    dv: &mut Array<E>,
    q_s: &Array<E>,
    do_s: &Array<E>,
    ktiles: &Array<u32>,
    tile_off: &Array<u32>,
    tile_segs: &Array<u32>,
    segs: &Array<u32>,
    scale: f32,
    heads_q: u32,
    heads_kv: u32,
    total_q: u32,
    total_k: u32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
) {
    let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE;
    let plane = UNIT_POS / 32u32;
    // Key block of this plane (S^T rows, dK / dV rows) and its half: query rows of S^T, columns
    // of dK / dV.
    let kw_base = (plane % 4u32) as usize * BLK;
    let half = (plane / 4u32) as usize;
    let rw_base = half * BLK;
    let hn = comptime!(head_dim / 2);
    let cbase = half * hn;
    let stride = comptime!(head_dim + PAD);
    let pstride = comptime!(BWD_BM + PAD);

    let mut k_smem = SharedMemory::<E>::new_aligned(comptime!(WIDE_BN * (head_dim + PAD)), 16usize);
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(WIDE_BN * (head_dim + PAD)), 16usize);
    // Two stages of the query tile (Q, dO, lse, delta): rows [0, BM) and [BM, 2 BM).
    let mut q_smem = SharedMemory::<E>::new_aligned(comptime!(2 * BWD_BM * (head_dim + PAD)), 16usize);
    let mut do_smem = SharedMemory::<E>::new_aligned(comptime!(2 * BWD_BM * (head_dim + PAD)), 16usize);
    let mut lse_smem = SharedMemory::<f32>::new(comptime!(2 * BWD_BM));
    let mut dl_smem = SharedMemory::<f32>::new(comptime!(2 * BWD_BM));
    // P^T and dS^T of the current tile, [key][row].
    let mut pt_smem = SharedMemory::<E>::new_aligned(comptime!(WIDE_BN * (BWD_BM + PAD)), 16usize);
    let mut dst_smem = SharedMemory::<E>::new_aligned(comptime!(WIDE_BN * (BWD_BM + PAD)), 16usize);
    let bar0 = Barrier::shared(comptime!((WIDE_PLANES * 32) as u32), UNIT_POS == 0);
    let bar1 = Barrier::shared(comptime!((WIDE_PLANES * 32) as u32), UNIT_POS == 0);

    let kt = ktiles[CUBE_POS_X as usize];
    let hk = CUBE_POS_Y;
    let group = heads_q / heads_kv;
    let key0 = kt * WIDE_BN as u32;

    stage_rows::<E, NV>(k, &mut k_smem, key0, total_k, key0, heads_kv, hk, WIDE_BN, head_dim, WIDE_PLANES);
    stage_rows::<E, NV>(v, &mut v_smem, key0, total_k, key0, heads_kv, hk, WIDE_BN, head_dim, WIDE_PLANES);
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
    // 8-column blocks of this plane's dK / dV columns.
    let o_blocks = comptime!(hn / 8);
    let k_steps = comptime!(head_dim / 16);

    // [m-block (2)][o-block][ec]
    let mut dk_acc = Array::<f32>::new(comptime!(2 * o_blocks * ec));
    let mut dv_acc = Array::<f32>::new(comptime!(2 * o_blocks * ec));
    #[unroll]
    for i in 0..comptime!(2 * o_blocks * ec) {
        dk_acc[i] = 0.0f32;
        dv_acc[i] = 0.0f32;
    }
    // [m-block (2)][n-block (4)][ec]
    let mut s = Array::<f32>::new(comptime!(2 * 4 * ec));
    let mut dp = Array::<f32>::new(comptime!(2 * 4 * ec));

    let s_begin = tile_off[kt as usize];
    let s_end = tile_off[kt as usize + 1];
    for si in s_begin..s_end {
        let seg = tile_segs[si as usize] as usize;
        let q_start = segs[seg * 4];
        let q_len = segs[seg * 4 + 1];
        let k_start = segs[seg * 4 + 2];
        let k_len = segs[seg * 4 + 3];
        // Causal diagonal: window key j is visible to segment row r iff j <= shift + r.
        let shift = k_len as i32 - q_len as i32;
        let first_key = max(key0, k_start) - k_start;
        let mut r_min = 0i32;
        if causal {
            r_min = max(first_key as i32 - shift, 0i32);
        }
        let mut n_qt = 0u32;
        if r_min < q_len as i32 {
            n_qt = (q_len - r_min as u32 + BWD_BM as u32 - 1) / BWD_BM as u32;
        }
        // Window-local index of this plane's first key (may be negative).
        let kw0 = (key0 as i32 + kw_base as i32) - k_start as i32;
        let n_it = group * n_qt;
        if n_it > 0 {
            // First tile of the segment: its stage was last read two tiles ago, before the
            // barrier at the top of the previous iteration.
            let boff = ((g_tile & 1u32) * BWD_BM as u32) as usize;
            issue_q_tile::<E>(
                q_s, do_s, lse, delta, &mut q_smem, &mut do_smem, &mut lse_smem, &mut dl_smem, boff, r_min as u32,
                q_len, q_start, hk * group, heads_q, total_q, head_dim, WIDE_PLANES,
            );
            if (g_tile & 1u32) == 0 {
                bar0.commit_copy_async();
                let _t = bar0.arrive();
            } else {
                bar1.commit_copy_async();
                let _t = bar1.arrive();
            }
        }
        // (q head, query tile) pairs of this segment, q head outer, as two counters.
        let mut ti = 0u32;
        let mut hi = 0u32;
        for it in 0..n_it {
            let r0 = r_min as u32 + ti * BWD_BM as u32;
            // Every plane has finished the previous tile (its stage, P^T and dS^T are free).
            sync_cube();
            let cur = g_tile;
            let qb = ((cur & 1u32) * BWD_BM as u32) as usize;
            let mut tn = ti + 1u32;
            let mut hn_next = hi;
            if tn == n_qt {
                tn = 0u32;
                hn_next = hi + 1u32;
            }
            if it + 1 < n_it {
                let nb = (((cur + 1u32) & 1u32) * BWD_BM as u32) as usize;
                issue_q_tile::<E>(
                    q_s, do_s, lse, delta, &mut q_smem, &mut do_smem, &mut lse_smem, &mut dl_smem, nb,
                    r_min as u32 + tn * BWD_BM as u32, q_len, q_start, hk * group + hn_next, heads_q, total_q, head_dim,
                    WIDE_PLANES,
                );
                if (cur & 1u32) == 0 {
                    bar1.commit_copy_async();
                    let _t = bar1.arrive();
                } else {
                    bar0.commit_copy_async();
                    let _t = bar0.arrive();
                }
            }
            if (cur & 1u32) == 0 {
                bar0.wait_parity((cur >> 1u32) & 1u32);
            } else {
                bar1.wait_parity((cur >> 1u32) & 1u32);
            }
            g_tile = cur + 1u32;
            ti = tn;
            hi = hn_next;

            let rr0 = (r0 as usize + rw_base) as i32;
            // Every (key, row) pair of this plane's 32 x 32 block valid?
            let mut full = kw0 >= 0i32 && kw0 + BLK as i32 <= k_len as i32 && rr0 + BLK as i32 <= q_len as i32;
            if causal {
                full = full && kw0 + BLK as i32 - 1i32 <= shift + rr0;
            }

            // ---- S^T = K_w Q^T, dP^T = V_w dO^T (32 keys x 32 rows) ----
            #[unroll]
            for i in 0..comptime!(8 * ec) {
                s[i] = 0.0f32;
                dp[i] = 0.0f32;
            }
            #[unroll]
            for kk in 0..comptime!(k_steps / 2) {
                let a00 = frag_a::<E, NA>(&def, &k_smem, kw_base, kk * 32, stride, true);
                let a01 = frag_a::<E, NA>(&def, &k_smem, kw_base, kk * 32 + 16, stride, true);
                let a10 = frag_a::<E, NA>(&def, &k_smem, kw_base + 16, kk * 32, stride, true);
                let a11 = frag_a::<E, NA>(&def, &k_smem, kw_base + 16, kk * 32 + 16, stride, true);
                #[unroll]
                for nb in 0..4usize {
                    let m = frag_b_t2::<E, NB>(&def, &q_smem, qb + rw_base + nb * 8, kk * 32, stride, true);
                    mma_into::<E, NA, NB, NC>(&def, &a00, &m, 0usize, &mut s, nb * ec);
                    mma_into::<E, NA, NB, NC>(&def, &a10, &m, 0usize, &mut s, (4 + nb) * ec);
                    mma_into::<E, NA, NB, NC>(&def, &a01, &m, 2usize, &mut s, nb * ec);
                    mma_into::<E, NA, NB, NC>(&def, &a11, &m, 2usize, &mut s, (4 + nb) * ec);
                }
            }
            #[unroll]
            for kk in 0..comptime!(k_steps / 2) {
                let a00 = frag_a::<E, NA>(&def, &v_smem, kw_base, kk * 32, stride, true);
                let a01 = frag_a::<E, NA>(&def, &v_smem, kw_base, kk * 32 + 16, stride, true);
                let a10 = frag_a::<E, NA>(&def, &v_smem, kw_base + 16, kk * 32, stride, true);
                let a11 = frag_a::<E, NA>(&def, &v_smem, kw_base + 16, kk * 32 + 16, stride, true);
                #[unroll]
                for nb in 0..4usize {
                    let m = frag_b_t2::<E, NB>(&def, &do_smem, qb + rw_base + nb * 8, kk * 32, stride, true);
                    mma_into::<E, NA, NB, NC>(&def, &a00, &m, 0usize, &mut dp, nb * ec);
                    mma_into::<E, NA, NB, NC>(&def, &a10, &m, 0usize, &mut dp, (4 + nb) * ec);
                    mma_into::<E, NA, NB, NC>(&def, &a01, &m, 2usize, &mut dp, nb * ec);
                    mma_into::<E, NA, NB, NC>(&def, &a11, &m, 2usize, &mut dp, (4 + nb) * ec);
                }
            }

            // ---- P^T = exp(scale S^T - lse) masked, dS^T = P^T (dP^T - delta): to shared ----
            #[unroll]
            for mb in 0..2usize {
                #[unroll]
                for nb in 0..4usize {
                    #[unroll]
                    for e in 0..ec {
                        let (row, col) = def.position_of_nth(lane, e as u32, MatrixIdent::Accumulator);
                        let rloc = rw_base + nb * 8 + col as usize;
                        let i = (mb * 4 + nb) * ec + e;
                        let mut p = fast_exp(s[i] * scale - lse_smem[qb + rloc]);
                        if !full {
                            let kwin = kw0 + (mb * 16) as i32 + row as i32;
                            let rr = rr0 + (nb * 8) as i32 + col as i32;
                            let mut ok = kwin >= 0i32 && kwin < k_len as i32 && rr < q_len as i32;
                            if causal {
                                ok = ok && kwin <= shift + rr;
                            }
                            if !ok {
                                p = 0.0f32;
                            }
                        }
                        let at = (kw_base + mb * 16 + row as usize) * pstride + rloc;
                        pt_smem[at] = E::cast_from(p);
                        dst_smem[at] = E::cast_from(p * (dp[i] - dl_smem[qb + rloc]));
                    }
                }
            }
            sync_cube();

            // ---- dV += P^T dO, dK += dS^T Q (32 keys x head_dim / 2 columns, 64 rows) ----
            #[unroll]
            for ks in 0..comptime!(BWD_BM / 16) {
                let p0 = frag_a::<E, NA>(&def, &pt_smem, kw_base, ks * 16, pstride, true);
                let p1 = frag_a::<E, NA>(&def, &pt_smem, kw_base + 16, ks * 16, pstride, true);
                #[unroll]
                for ob2 in 0..comptime!(o_blocks / 2) {
                    let m = frag_b_n2::<E, NB>(&def, &do_smem, qb + ks * 16, cbase + ob2 * 16, stride, true);
                    mma_into::<E, NA, NB, NC>(&def, &p0, &m, 0usize, &mut dv_acc, (2 * ob2) * ec);
                    mma_into::<E, NA, NB, NC>(&def, &p0, &m, 2usize, &mut dv_acc, (2 * ob2 + 1) * ec);
                    mma_into::<E, NA, NB, NC>(&def, &p1, &m, 0usize, &mut dv_acc, (o_blocks + 2 * ob2) * ec);
                    mma_into::<E, NA, NB, NC>(&def, &p1, &m, 2usize, &mut dv_acc, (o_blocks + 2 * ob2 + 1) * ec);
                }
                let d0 = frag_a::<E, NA>(&def, &dst_smem, kw_base, ks * 16, pstride, true);
                let d1 = frag_a::<E, NA>(&def, &dst_smem, kw_base + 16, ks * 16, pstride, true);
                #[unroll]
                for ob2 in 0..comptime!(o_blocks / 2) {
                    let m = frag_b_n2::<E, NB>(&def, &q_smem, qb + ks * 16, cbase + ob2 * 16, stride, true);
                    mma_into::<E, NA, NB, NC>(&def, &d0, &m, 0usize, &mut dk_acc, (2 * ob2) * ec);
                    mma_into::<E, NA, NB, NC>(&def, &d0, &m, 2usize, &mut dk_acc, (2 * ob2 + 1) * ec);
                    mma_into::<E, NA, NB, NC>(&def, &d1, &m, 0usize, &mut dk_acc, (o_blocks + 2 * ob2) * ec);
                    mma_into::<E, NA, NB, NC>(&def, &d1, &m, 2usize, &mut dk_acc, (o_blocks + 2 * ob2 + 1) * ec);
                }
            }
        }
    }

    // ---- write dK, dV (zero for keys no segment sees) ----
    #[unroll]
    for mb in 0..2usize {
        #[unroll]
        for ob in 0..o_blocks {
            #[unroll]
            for e in 0..ec {
                let (row, col) = def.position_of_nth(lane, e as u32, MatrixIdent::Accumulator);
                let key = key0 + (kw_base + mb * 16) as u32 + row;
                if key < total_k {
                    let g = (key * heads_kv + hk) as usize * head_dim + cbase + ob * 8 + col as usize;
                    let i = (mb * o_blocks + ob) * ec + e;
                    dk[g] = E::cast_from(dk_acc[i] * scale);
                    dv[g] = E::cast_from(dv_acc[i]);
                }
            }
        }
    }
}
