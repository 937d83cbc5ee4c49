//! Tensor-core fragment helpers of the forward and backward kernels: `ldmatrix` loads of m16n8k16
//! A and B fragments from padded row-major shared-memory tiles, one `mma.sync` into an f32
//! accumulator array, and an accumulator block re-used as an A operand (P^T, dS^T).

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;

/// `ldmatrix` x4 (`.trans` when `trans`) of four 8x8 matrices of a padded row-major tile into `n`
/// registers: lane `l` addresses row `l % 8` of matrix `l / 8`, whose first element is at stored
/// row `row0 + 8 (mi % 2)`, column `col0 + 8 (mi / 2)` for matrix `mi` (`swap`: row `row0 + 8
/// (mi / 2)`, column `col0 + 8 (mi % 2)`); the registers in the order of the `b_layout` (B,
/// else A) operand.
#[cube]
#[allow(clippy::too_many_arguments)]
fn ldsm_x4<E: Float, N: Size>(
    def: &MmaDefinition<E, E, f32>,
    smem: &SharedMemory<E>,
    row0: usize,
    col0: usize,
    #[comptime] stride: usize,
    #[comptime] n: usize,
    #[comptime] b_layout: bool,
    #[comptime] swap: bool,
    #[comptime] trans: bool,
) -> Array<Vector<E, N>> {
    let lane = UNIT_POS_PLANE;
    let mut out = Array::<Vector<E, N>>::new(n);
    let mi = (lane / 8u32) as usize;
    let mr = (lane % 8u32) as usize;
    let start = if swap {
        (row0 + (mi / 2) * 8 + mr) * stride + col0 + (mi % 2) * 8
    } else {
        (row0 + (mi % 2) * 8 + mr) * stride + col0 + (mi / 2) * 8
    };
    let ident = comptime!(if b_layout { MatrixIdent::B } else { MatrixIdent::A });
    let m = def.load_matrix::<E, N>(&smem.slice(start, start + 8), ident, 4usize, trans);
    #[unroll]
    for i in 0..n {
        out[i] = m[i];
    }
    out
}

/// 16x16 A fragment with `A[m][kk] = smem[(row0 + m) * stride + col0 + kk]` (`ldmatrix` x4;
/// matrices 0-3 = rows 0-7 / 8-15 x cols 0-7, then x cols 8-15: the a0..a3 registers of m16n8k16).
#[cube]
pub fn frag_a<E: Float, NA: Size>(
    def: &MmaDefinition<E, E, f32>,
    smem: &SharedMemory<E>,
    row0: usize,
    col0: usize,
    #[comptime] stride: usize,
) -> Array<Vector<E, NA>> {
    let va = def.vectors_per_lane(MatrixIdent::A);
    ldsm_x4::<E, NA>(def, smem, row0, col0, stride, va, false, false, false)
}

/// Two B fragments (k-steps `col0..col0+16` in entries [0, 2) and `col0+16..col0+32` in [2, 4))
/// with `B[kk][n] = smem[(row0 + n) * stride + col0 + kk]`, n in 0..8 (a transposed operand: K^T,
/// Q^T, dO^T or V^T from row-major tiles).
#[cube]
pub fn frag_b_t2<E: Float, NB: Size>(
    def: &MmaDefinition<E, E, f32>,
    smem: &SharedMemory<E>,
    row0: usize,
    col0: usize,
    #[comptime] stride: usize,
) -> Array<Vector<E, NB>> {
    let lane = UNIT_POS_PLANE;
    let vb = def.vectors_per_lane(MatrixIdent::B);
    let mut out = Array::<Vector<E, NB>>::new(comptime!(2 * vb));
    let mi = (lane / 8u32) as usize;
    let mr = (lane % 8u32) as usize;
    let start = (row0 + mr) * stride + col0 + mi * 8;
    let m = def.load_matrix::<E, NB>(&smem.slice(start, start + 8), MatrixIdent::B, 4usize, false);
    #[unroll]
    for i in 0..comptime!(2 * vb) {
        out[i] = m[i];
    }
    out
}

/// Two B fragments of one k-step (n-blocks `row0..row0+8` in entries [0, 2) and
/// `row0+8..row0+16` in [2, 4)) with `B[kk][n] = smem[(row0 + n) * stride + col0 + kk]`, kk in
/// 0..16 (K^T from the row-major K tile): the forward's k-step-outer S = Q K^T, where every
/// accumulator block takes one mma per k-step. (The backward's S and dP keep [`frag_b_t2`]'s
/// k-step-inner order: the same reorder there spilled under NVRTC 13.0 and lost 0.5-2.5%,
/// docs/forward.md.)
#[cube]
pub fn frag_b_pair<E: Float, NB: Size>(
    def: &MmaDefinition<E, E, f32>,
    smem: &SharedMemory<E>,
    row0: usize,
    col0: usize,
    #[comptime] stride: usize,
) -> Array<Vector<E, NB>> {
    let vb = def.vectors_per_lane(MatrixIdent::B);
    ldsm_x4::<E, NB>(def, smem, row0, col0, stride, comptime!(2 * vb), true, true, false)
}

/// Two B fragments (n-blocks `col0..col0+8` in entries [0, 2) and `col0+8..col0+16` in [2, 4))
/// with `B[kk][n] = smem[(row0 + kk) * stride + col0 + n]`, kk in 0..16 (a row-major operand:
/// dO, Q or K as the right factor; `ldmatrix.trans`).
#[cube]
pub fn frag_b_n2<E: Float, NB: Size>(
    def: &MmaDefinition<E, E, f32>,
    smem: &SharedMemory<E>,
    row0: usize,
    col0: usize,
    #[comptime] stride: usize,
) -> Array<Vector<E, NB>> {
    let vb = def.vectors_per_lane(MatrixIdent::B);
    ldsm_x4::<E, NB>(def, smem, row0, col0, stride, comptime!(2 * vb), true, false, true)
}

/// acc[off..off+ec] += A * B where B is entries `[bi, bi + vb)` of `b`.
#[cube]
pub fn mma_into<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    a: &Array<Vector<E, NA>>,
    b: &Array<Vector<E, NB>>,
    bi: usize,
    acc: &mut Array<f32>,
    off: usize,
) {
    let vb = def.vectors_per_lane(MatrixIdent::B);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let mut bb = Array::<Vector<E, NB>>::new(vb);
    #[unroll]
    for i in 0..vb {
        bb[i] = b[bi + i];
    }
    let mut c = Array::<Vector<f32, NC>>::new(vc);
    #[unroll]
    for i in 0..vc {
        let mut reg = Vector::<f32, NC>::empty();
        #[unroll]
        for j in 0..sc {
            reg[j] = acc[off + i * sc + j];
        }
        c[i] = reg;
    }
    def.execute_inplace(a, &bb, &mut c);
    #[unroll]
    for i in 0..vc {
        #[unroll]
        for j in 0..sc {
            acc[off + i * sc + j] = c[i][j];
        }
    }
}

/// The A fragment of k-step `ks` built from accumulator blocks `2ks` and `2ks+1` of `s`
/// (16 x 8 blocks of `ec` floats per lane), rounded to `E`.
#[cube]
pub fn acc_to_a<E: Float, NA: Size>(def: &MmaDefinition<E, E, f32>, s: &Array<f32>, ks: usize) -> Array<Vector<E, NA>> {
    let va = def.vectors_per_lane(MatrixIdent::A);
    let sa = def.vector_size(MatrixIdent::A);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let ec = comptime!(vc * sc);
    let mut a = Array::<Vector<E, NA>>::new(va);
    #[unroll]
    for i in 0..va {
        let mut reg = Vector::<E, NA>::empty();
        #[unroll]
        for j in 0..sa {
            let e = i * sa + j;
            reg[j] = E::cast_from(s[(2 * ks + e / ec) * ec + e % ec]);
        }
        a[i] = reg;
    }
    a
}

/// `acc` (16 x `head_dim`, `head_dim / 8` accumulator blocks) += P B, with P the accumulator
/// blocks of `s` (16 x `k`, rounded to `E` as A fragments) and B the `k` rows of `b_smem` from
/// `b_row0`: the dQ pass's dQ += dS K.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn mma_acc_b<E: Float, NA: Size, NB: Size, NC: Size>(
    def: &MmaDefinition<E, E, f32>,
    s: &Array<f32>,
    b_smem: &SharedMemory<E>,
    b_row0: usize,
    acc: &mut Array<f32>,
    #[comptime] k: usize,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
) {
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let ec = comptime!(vc * sc);
    #[unroll]
    for ks in 0..comptime!(k / 16) {
        let a = acc_to_a::<E, NA>(def, s, ks);
        #[unroll]
        for ob2 in 0..comptime!(head_dim / 16) {
            let m = frag_b_n2::<E, NB>(def, b_smem, b_row0 + ks * 16, ob2 * 16, stride);
            mma_into::<E, NA, NB, NC>(def, &a, &m, 0usize, acc, (2 * ob2) * ec);
            mma_into::<E, NA, NB, NC>(def, &a, &m, 2usize, acc, (2 * ob2 + 1) * ec);
        }
    }
}

/// 16x16 A fragment of a transposed operand: `A[m][kk] = smem[(row0 + kk) * stride + col0 + m]`
/// (`ldmatrix.trans` of a row-major tile: P^T and dS^T from the [row][key] P and dS tiles of the
/// 128-key dK/dV kernel).
#[cube]
pub fn frag_a_t<E: Float, NA: Size>(
    def: &MmaDefinition<E, E, f32>,
    smem: &SharedMemory<E>,
    row0: usize,
    col0: usize,
    #[comptime] stride: usize,
) -> Array<Vector<E, NA>> {
    // a0..a3 = A rows 0-7 / 8-15 x k 0-7, then x k 8-15: stored rows (k) +8 for matrices 2, 3,
    // stored columns (m) +8 for matrices 1, 3.
    let va = def.vectors_per_lane(MatrixIdent::A);
    ldsm_x4::<E, NA>(def, smem, row0, col0, stride, va, false, true, true)
}

/// Stores accumulator blocks `off / ec` and `off / ec + 1` of `acc` (a 16 x 16 block: 16 rows,
/// columns 0-7 then 8-15), rounded to `E`, row-major at `smem[(row0 + r) * stride + col0 + c]`
/// with one `stmatrix` x4 per lane: the m16n8 accumulator layout (a lane holds columns
/// `2 (lane % 4), +1` of rows `lane / 4` and `lane / 4 + 8`) is `stmatrix`'s register layout, in
/// the order of an A fragment ([`acc_to_a`]).
#[cube]
pub fn store_acc_16x16<E: Float, NA: Size>(
    def: &MmaDefinition<E, E, f32>,
    acc: &Array<f32>,
    off: usize,
    smem: &mut SharedMemory<E>,
    row0: usize,
    col0: usize,
    #[comptime] stride: usize,
) {
    let lane = UNIT_POS_PLANE;
    let va = def.vectors_per_lane(MatrixIdent::A);
    let sa = def.vector_size(MatrixIdent::A);
    let vc = def.vectors_per_lane(MatrixIdent::Accumulator);
    let sc = def.vector_size(MatrixIdent::Accumulator);
    let ec = comptime!(vc * sc);
    let mut regs = Array::<Vector<E, NA>>::new(va);
    #[unroll]
    for i in 0..va {
        let mut reg = Vector::<E, NA>::empty();
        #[unroll]
        for j in 0..sa {
            let e = i * sa + j;
            reg[j] = E::cast_from(acc[off + (e / ec) * ec + e % ec]);
        }
        regs[i] = reg;
    }
    let mi = (lane / 8u32) as usize;
    let mr = (lane % 8u32) as usize;
    let start = (row0 + (mi % 2) * 8 + mr) * stride + col0 + (mi / 2) * 8;
    def.store_matrix::<E, NA>(&mut smem.slice_mut(start, start + 8), &regs, MatrixIdent::A, 4usize, false);
}
