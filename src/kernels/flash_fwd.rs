//! Flash-attention forward (FlashAttention-2 style) on tensor cores through CubeCL's manual
//! `mma.sync` path (m16n8k16, f16/bf16 operands, f32 accumulators).
//!
//! One cube = one (query tile, query head). The query tile comes from a host-built work list of
//! `(segment id, first row of the tile inside the segment)`, so varlen batches and grouped
//! attention (overlapping key windows over one K,V) are the same launch. Eight planes (warps) per
//! cube, 16 query rows each (BLOCK_M = 128); key tiles of BLOCK_N = 64 rows staged in shared memory.
//! Scores, softmax statistics and the output accumulator stay in registers; P is re-used as the A
//! operand of P.V without a trip through shared memory (the accumulator and A-operand register
//! layouts of m16n8k16 line up).
//!
//! Causal masking is bottom-right aligned per segment: segment row `r` sees window keys
//! `j < k_len - q_len + r + 1`. Key tiles past the last row's limit are never visited; only tiles
//! that straddle a limit pay for the mask.

use cubecl::prelude::*;
use cubecl::cmma::{MatrixIdent, MmaDefinition};

/// Query rows per cube.
pub const BLOCK_M: usize = 16 * PLANES;
/// Keys per shared-memory tile.
pub const BLOCK_N: usize = 64;
/// Planes (warps) per cube.
pub const PLANES: usize = 8;
/// Width of the global-memory vector loads (elements): 16 bytes of f16/bf16.
pub const LOAD_VEC: usize = 8;
/// Padding (elements) added to each shared-memory row to spread banks.
pub const SMEM_PAD: usize = 8;

/// Forward kernel. `q`: `[total_q, heads_q, D]` scalars; `k`, `v`: `[total_k, heads_kv, D]` as
/// vectors of `LOAD_VEC`; `out` like q; `lse`: `[heads_q, total_q]`.
/// `work`: two u32 per cube (segment id, tile start row inside the segment);
/// `segs`: four u32 per segment (q_start, q_len, k_start, k_len).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn flash_fwd_mma<E: Float, NV: Size>(
    q: &Array<Vector<E, NV>>,
    k: &Array<Vector<E, NV>>,
    v: &Array<Vector<E, NV>>,
    out: &mut Array<E>,
    lse: &mut Array<f32>,
    work: &Array<u32>,
    segs: &Array<u32>,
    scale: f32,
    heads_q: u32,
    heads_kv: u32,
    total_q: u32,
    inf: f32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[comptime] ldsm: bool,
) {
    // `inf` is passed at launch (f32::INFINITY): this CubeCL version prints infinite literals as
    // `inf`, which NVRTC rejects.
    let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE;
    let plane = UNIT_POS / 32u32;

    let stride = comptime!(head_dim + SMEM_PAD);
    let vecs_per_row = comptime!(head_dim / LOAD_VEC);
    let mut kv_smem = SharedMemory::<E>::new_aligned(comptime!(BLOCK_N * (head_dim + SMEM_PAD)), 16usize);
    let mut v_smem = SharedMemory::<E>::new_aligned(comptime!(BLOCK_N * (head_dim + SMEM_PAD)), 16usize);

    let tile = CUBE_POS_X as usize;
    let head = CUBE_POS_Y;
    let group = heads_q / heads_kv;
    let head_kv = head / group;

    let seg = work[tile * 2] as usize;
    let tile_start = work[tile * 2 + 1];
    let q_start = segs[seg * 4];
    let q_len = segs[seg * 4 + 1];
    let k_start = segs[seg * 4 + 2];
    let k_len = segs[seg * 4 + 3];

    // Rows of this tile that belong to the segment.
    let rows_here = min(q_len - tile_start, BLOCK_M as u32);
    // Keys visible to the last row of the tile: the tile loop stops there.
    let mut max_vis = k_len as i32;
    if causal {
        let lim = k_len as i32 - q_len as i32 + (tile_start + rows_here) as i32;
        max_vis = max(min(lim, k_len as i32), 0i32);
    }
    let n_tiles = (max_vis as u32 + BLOCK_N as u32 - 1) / BLOCK_N as u32;

    // ---- stage the Q tile through shared memory, then into A fragments ----
    let threads = comptime!(PLANES * 32);
    let tile_vecs = comptime!(BLOCK_M * (head_dim / LOAD_VEC));
    let loads_per_thread = comptime!(tile_vecs / (PLANES * 32));
    #[unroll]
    for it in 0..loads_per_thread {
        let idx = UNIT_POS as usize + it * threads;
        let r = idx / vecs_per_row;
        let c = idx % vecs_per_row;
        let row_local = tile_start + r as u32;
        let mut val = Vector::<E, NV>::new(E::from_int(0));
        if row_local < q_len {
            let g = ((q_start + row_local) * heads_q + head) as usize * vecs_per_row + c;
            val = q[g];
        }
        // Rows [0, BLOCK_N) are staged in the K buffer, the rest in the V buffer.
        if r < BLOCK_N {
            let base = r * stride + c * LOAD_VEC;
            #[unroll]
            for e in 0..LOAD_VEC {
                kv_smem[base + e] = val[e];
            }
        } else {
            let base = (r - BLOCK_N) * stride + c * LOAD_VEC;
            #[unroll]
            for e in 0..LOAD_VEC {
                v_smem[base + e] = val[e];
            }
        }
    }
    sync_cube();

    let size!(NA) = def.vector_size(MatrixIdent::A);
    let size!(NB) = def.vector_size(MatrixIdent::B);
    let size!(NC) = def.vector_size(MatrixIdent::Accumulator);
    let va = def.vectors_per_lane(MatrixIdent::A);
    let vb = def.vectors_per_lane(MatrixIdent::B);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sa = def.vector_size(MatrixIdent::A);
    let sb = def.vector_size(MatrixIdent::B);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let ea = comptime!(va * sa);
    let ec = comptime!(vc * sc);

    let k_steps = comptime!(head_dim / 16);
    let mut qf = Array::<Vector<E, NA>>::new(comptime!(k_steps * va));
    #[unroll]
    for ks in 0..k_steps {
        #[unroll]
        for i in 0..va {
            let mut reg = Vector::<E, NA>::empty();
            #[unroll]
            for j in 0..sa {
                let (row, col) = def.position_of_nth(lane, (i * sa + j) as u32, MatrixIdent::A);
                let r = (plane * 16 + row) as usize;
                if r < BLOCK_N {
                    reg[j] = kv_smem[r * stride + ks * 16 + col as usize];
                } else {
                    reg[j] = v_smem[(r - BLOCK_N) * stride + ks * 16 + col as usize];
                }
            }
            qf[ks * va + i] = reg;
        }
    }

    // Rows (inside the 16-row plane tile) of this lane's accumulator elements: elements
    // [0, ec/2) sit on row `row_a`, [ec/2, ec) on `row_b` (m16n8 accumulator layout).
    let (row_a, _ca) = def.position_of_nth(lane, 0u32, MatrixIdent::Accumulator);
    let (row_b, _cb) = def.position_of_nth(lane, (ec - 1) as u32, MatrixIdent::Accumulator);
    let rl_a = tile_start + plane * 16 + row_a;
    let rl_b = tile_start + plane * 16 + row_b;
    // Keys visible to each row (window-local count).
    let mut lim_a = k_len as i32;
    let mut lim_b = k_len as i32;
    if causal {
        lim_a = max(min(k_len as i32 - q_len as i32 + rl_a as i32 + 1, k_len as i32), 0i32);
        lim_b = max(min(k_len as i32 - q_len as i32 + rl_b as i32 + 1, k_len as i32), 0i32);
    }

    let n_blocks = comptime!(BLOCK_N / 8);
    let o_blocks = comptime!(head_dim / 8);
    let mut o_acc = Array::<f32>::new(comptime!(o_blocks * ec));
    #[unroll]
    for i in 0..comptime!(o_blocks * ec) {
        o_acc[i] = 0.0f32;
    }
    let mut s = Array::<f32>::new(comptime!(n_blocks * ec));
    let neg_inf = -inf;
    let mut m_a = neg_inf;
    let mut m_b = neg_inf;
    let mut l_a = 0.0f32;
    let mut l_b = 0.0f32;

    let kv_vecs = comptime!(BLOCK_N * (head_dim / LOAD_VEC));
    let kv_loads = comptime!(kv_vecs / (PLANES * 32));

    for kt in 0..n_tiles {
        sync_cube();
        // ---- load K and V tiles (zero past the window end) ----
        #[unroll]
        for it in 0..kv_loads {
            let idx = UNIT_POS as usize + it * threads;
            let r = idx / vecs_per_row;
            let c = idx % vecs_per_row;
            let key_local = kt * BLOCK_N as u32 + r as u32;
            let mut kval = Vector::<E, NV>::new(E::from_int(0));
            let mut vval = Vector::<E, NV>::new(E::from_int(0));
            if key_local < k_len {
                let g = ((k_start + key_local) * heads_kv + head_kv) as usize * vecs_per_row + c;
                kval = k[g];
                vval = v[g];
            }
            let base = r * stride + c * LOAD_VEC;
            #[unroll]
            for e in 0..LOAD_VEC {
                kv_smem[base + e] = kval[e];
                v_smem[base + e] = vval[e];
            }
        }
        sync_cube();

        // ---- S = Q K^T for this plane's 16 rows x BLOCK_N keys ----
        #[unroll]
        for nb in 0..n_blocks {
            let mut acc = Array::<Vector<f32, NC>>::new(vc);
            #[unroll]
            for i in 0..vc {
                acc[i] = Vector::<f32, NC>::new(0.0f32);
            }
            if ldsm {
                // ldmatrix x4: matrices (keys nb*8.., dims kk*32 + 8i) for i in 0..4; lanes 8i..8i+8
                // give the rows. Registers [0,1] are the B fragment of k-step 2kk, [2,3] of 2kk+1.
                let mi = (lane / 8u32) as usize;
                let mr = (lane % 8u32) as usize;
                #[unroll]
                for kk in 0..comptime!(k_steps / 2) {
                    let start = (nb * 8 + mr) * stride + kk * 32 + mi * 8;
                    let m = def.load_matrix::<E, NB>(&kv_smem.slice(start, start + 8), MatrixIdent::B, 4usize, false);
                    #[unroll]
                    for h in 0..2usize {
                        let ks = 2 * kk + h;
                        let mut a = Array::<Vector<E, NA>>::new(va);
                        #[unroll]
                        for i in 0..va {
                            a[i] = qf[ks * va + i];
                        }
                        let mut b = Array::<Vector<E, NB>>::new(vb);
                        b[0] = m[2 * h];
                        b[1] = m[2 * h + 1];
                        def.execute_inplace(&a, &b, &mut acc);
                    }
                }
            } else {
                #[unroll]
                for ks in 0..k_steps {
                    let mut a = Array::<Vector<E, NA>>::new(va);
                    #[unroll]
                    for i in 0..va {
                        a[i] = qf[ks * va + i];
                    }
                    let mut b = Array::<Vector<E, NB>>::new(vb);
                    #[unroll]
                    for i in 0..vb {
                        let mut reg = Vector::<E, NB>::empty();
                        #[unroll]
                        for j in 0..sb {
                            let (row, col) = def.position_of_nth(lane, (i * sb + j) as u32, MatrixIdent::B);
                            // B[kdim][key] = K[key][kdim]
                            let key = nb * 8 + col as usize;
                            reg[j] = kv_smem[key * stride + ks * 16 + row as usize];
                        }
                        b[i] = reg;
                    }
                    def.execute_inplace(&a, &b, &mut acc);
                }
            }
            #[unroll]
            for i in 0..vc {
                #[unroll]
                for j in 0..sc {
                    s[nb * ec + i * sc + j] = acc[i][j];
                }
            }
        }

        // ---- mask (only tiles that cross a row's limit) ----
        let tile_end = (kt + 1) * BLOCK_N as u32;
        let needs_mask = tile_end as i32 > lim_a || tile_end as i32 > lim_b;
        if needs_mask {
            #[unroll]
            for nb in 0..n_blocks {
                #[unroll]
                for e in 0..ec {
                    let (_row, col) = def.position_of_nth(lane, e as u32, MatrixIdent::Accumulator);
                    let key = (kt * BLOCK_N as u32 + nb as u32 * 8 + col) as i32;
                    let mut lim = lim_b;
                    if e < ec / 2 {
                        lim = lim_a;
                    }
                    if key >= lim {
                        s[nb * ec + e] = neg_inf;
                    }
                }
            }
        }

        // ---- online softmax (scores scaled, natural exp), per row slot ----
        let mut mx_a = neg_inf;
        let mut mx_b = neg_inf;
        #[unroll]
        for nb in 0..n_blocks {
            #[unroll]
            for e in 0..ec {
                if e < ec / 2 {
                    mx_a = max(mx_a, s[nb * ec + e]);
                } else {
                    mx_b = max(mx_b, s[nb * ec + e]);
                }
            }
        }
        mx_a = max(mx_a, plane_shuffle_xor(mx_a, 1u32));
        mx_a = max(mx_a, plane_shuffle_xor(mx_a, 2u32));
        mx_b = max(mx_b, plane_shuffle_xor(mx_b, 1u32));
        mx_b = max(mx_b, plane_shuffle_xor(mx_b, 2u32));

        let new_a = max(m_a, mx_a * scale);
        let new_b = max(m_b, mx_b * scale);
        let mut use_a = new_a;
        let mut use_b = new_b;
        if new_a == neg_inf {
            use_a = 0.0f32;
        }
        if new_b == neg_inf {
            use_b = 0.0f32;
        }
        let alpha_a = f32::exp(m_a - use_a);
        let alpha_b = f32::exp(m_b - use_b);
        m_a = new_a;
        m_b = new_b;

        let mut sum_a = 0.0f32;
        let mut sum_b = 0.0f32;
        #[unroll]
        for nb in 0..n_blocks {
            #[unroll]
            for e in 0..ec {
                let x = s[nb * ec + e];
                if e < ec / 2 {
                    let p = f32::exp(x * scale - use_a);
                    s[nb * ec + e] = p;
                    sum_a += p;
                } else {
                    let p = f32::exp(x * scale - use_b);
                    s[nb * ec + e] = p;
                    sum_b += p;
                }
            }
        }
        l_a = l_a * alpha_a + sum_a;
        l_b = l_b * alpha_b + sum_b;
        #[unroll]
        for ob in 0..o_blocks {
            #[unroll]
            for e in 0..ec {
                if e < ec / 2 {
                    o_acc[ob * ec + e] *= alpha_a;
                } else {
                    o_acc[ob * ec + e] *= alpha_b;
                }
            }
        }

        // ---- O += P V: P (16 x BLOCK_N) from registers as A, V tile as B ----
        let pv_steps = comptime!(BLOCK_N / 16);
        #[unroll]
        for ks in 0..pv_steps {
            // A elements [0, ea/2) come from score block 2*ks, [ea/2, ea) from 2*ks+1.
            let mut a = Array::<Vector<E, NA>>::new(va);
            #[unroll]
            for i in 0..va {
                let mut reg = Vector::<E, NA>::empty();
                #[unroll]
                for j in 0..sa {
                    let e = i * sa + j;
                    let src = (2 * ks + e / ec) * ec + e % ec;
                    reg[j] = E::cast_from(s[src]);
                }
                a[i] = reg;
            }
            if ldsm {
                // ldmatrix.trans x4 over V rows: matrix i covers keys ks*16 + (i%2)*8.., dims
                // (2*ob2 + i/2)*8..; registers [0,1] are the B fragment of dim block 2*ob2, [2,3]
                // of 2*ob2+1.
                let mi = (lane / 8u32) as usize;
                let mr = (lane % 8u32) as usize;
                #[unroll]
                for ob2 in 0..comptime!(o_blocks / 2) {
                    let key = ks * 16 + (mi % 2) * 8 + mr;
                    let start = key * stride + (2 * ob2 + mi / 2) * 8;
                    let m = def.load_matrix::<E, NB>(&v_smem.slice(start, start + 8), MatrixIdent::B, 4usize, true);
                    #[unroll]
                    for h in 0..2usize {
                        let ob = 2 * ob2 + h;
                        let mut b = Array::<Vector<E, NB>>::new(vb);
                        b[0] = m[2 * h];
                        b[1] = m[2 * h + 1];
                        let mut acc = Array::<Vector<f32, NC>>::new(vc);
                        #[unroll]
                        for i in 0..vc {
                            let mut reg = Vector::<f32, NC>::empty();
                            #[unroll]
                            for j in 0..sc {
                                reg[j] = o_acc[ob * ec + i * sc + j];
                            }
                            acc[i] = reg;
                        }
                        def.execute_inplace(&a, &b, &mut acc);
                        #[unroll]
                        for i in 0..vc {
                            #[unroll]
                            for j in 0..sc {
                                o_acc[ob * ec + i * sc + j] = acc[i][j];
                            }
                        }
                    }
                }
            } else {
                #[unroll]
                for ob in 0..o_blocks {
                    let mut b = Array::<Vector<E, NB>>::new(vb);
                    #[unroll]
                    for i in 0..vb {
                        let mut reg = Vector::<E, NB>::empty();
                        #[unroll]
                        for j in 0..sb {
                            let (row, col) = def.position_of_nth(lane, (i * sb + j) as u32, MatrixIdent::B);
                            // B[key][dim] = V[key][dim]
                            let key = ks * 16 + row as usize;
                            reg[j] = v_smem[key * stride + ob * 8 + col as usize];
                        }
                        b[i] = reg;
                    }
                    let mut acc = Array::<Vector<f32, NC>>::new(vc);
                    #[unroll]
                    for i in 0..vc {
                        let mut reg = Vector::<f32, NC>::empty();
                        #[unroll]
                        for j in 0..sc {
                            reg[j] = o_acc[ob * ec + i * sc + j];
                        }
                        acc[i] = reg;
                    }
                    def.execute_inplace(&a, &b, &mut acc);
                    #[unroll]
                    for i in 0..vc {
                        #[unroll]
                        for j in 0..sc {
                            o_acc[ob * ec + i * sc + j] = acc[i][j];
                        }
                    }
                }
            }
        }
    }

    // ---- finish: reduce l over the 4 lanes of a row, normalise, write ----
    l_a += plane_shuffle_xor(l_a, 1u32);
    l_a += plane_shuffle_xor(l_a, 2u32);
    l_b += plane_shuffle_xor(l_b, 1u32);
    l_b += plane_shuffle_xor(l_b, 2u32);
    let mut inv_a = 0.0f32;
    let mut inv_b = 0.0f32;
    if l_a > 0.0f32 {
        inv_a = 1.0f32 / l_a;
    }
    if l_b > 0.0f32 {
        inv_b = 1.0f32 / l_b;
    }

    #[unroll]
    for ob in 0..o_blocks {
        #[unroll]
        for e in 0..ec {
            let (row, col) = def.position_of_nth(lane, e as u32, MatrixIdent::Accumulator);
            let rl = tile_start + plane * 16 + row;
            if rl < q_len {
                let mut inv = inv_b;
                if e < ec / 2 {
                    inv = inv_a;
                }
                let g = ((q_start + rl) * heads_q + head) as usize * head_dim + ob * 8 + col as usize;
                out[g] = E::cast_from(o_acc[ob * ec + e] * inv);
            }
        }
    }
    if lane % 4 == 0 {
        if rl_a < q_len {
            let mut val = inf;
            if l_a > 0.0f32 {
                val = m_a + f32::ln(l_a);
            }
            lse[(head * total_q + q_start + rl_a) as usize] = val;
        }
        if rl_b < q_len {
            let mut val = inf;
            if l_b > 0.0f32 {
                val = m_b + f32::ln(l_b);
            }
            lse[(head * total_q + q_start + rl_b) as usize] = val;
        }
    }
}

/// Fills `out` with zeros and `lse` with +inf (rows no segment covers keep these values).
#[cube(launch)]
pub fn fill_uncovered<E: Float>(out: &mut Array<E>, lse: &mut Array<f32>, inf: f32) {
    let idx = ABSOLUTE_POS;
    if idx < out.len() {
        out[idx] = E::from_int(0);
    }
    if idx < lse.len() {
        lse[idx] = inf;
    }
}
