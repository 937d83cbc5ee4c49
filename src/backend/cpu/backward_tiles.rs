//! AVX-512 register tiles for the CPU backward's five products (x86-64 only; `backward::block_pair`
//! takes them when the CPU has AVX-512, the head dimension is a multiple of 16 and the inputs are
//! finite, and the gemm crate otherwise).
//!
//! Every product is `C[m x n] (+)= A[m x k] B[k x n]` with `MR x (16 * V)` register tiles: A is
//! broadcast one element at a time from anywhere (`a[i * ars + p * acs]`, so P^T and dS^T are read
//! in place from the row-major scores), B is loaded in 16-float vectors from rows `ldb` apart. So
//! only the key block's K^T and V^T are packed (once per key block, into `G`-key panels,
//! [`KeyPanels`]); Q, dO and K are read in place from their head-major rows, and dK, dV, dQ are
//! accumulated in place.

use std::arch::x86_64::*;

use super::kernel::{exp2_v, Prefetch, G, L, MR, NV};
use super::pool::Aligned;

/// K^T and V^T of one key block in `G`-key panels `[panel][p][G]` (keys zero-padded to a multiple
/// of 16), packed once per key block: the S and dP products stream one contiguous panel per tile.
pub(crate) struct KeyPanels {
    kt: Aligned,
    vt: Aligned,
    /// What the panels hold: (K pointer, V pointer, keys, head dim); a block pair of other keys
    /// repacks.
    held: (usize, usize, usize, usize),
}

impl KeyPanels {
    pub(crate) fn new() -> Self {
        KeyPanels { kt: Aligned::fresh(0), vt: Aligned::fresh(0), held: (0, 0, 0, 0) }
    }

    /// Packs `k` and `v` (`nb` row-major rows of `d`) unless they are already held.
    pub(crate) fn pack(&mut self, k: &[f32], v: &[f32], nb: usize, d: usize) {
        let key = (k.as_ptr() as usize, v.as_ptr() as usize, nb, d);
        if self.held == key {
            return;
        }
        let len = nb.div_ceil(G) * G * d;
        if self.kt.as_slice().len() < len {
            self.kt = Aligned::fresh(len);
            self.vt = Aligned::fresh(len);
        }
        let n16 = nb.div_ceil(L) * L;
        for (src, dst) in [(k, self.kt.as_mut_slice()), (v, self.vt.as_mut_slice())] {
            for j in 0..n16 {
                let panel = &mut dst[j / G * G * d..];
                if j < nb {
                    for (p, &x) in src[j * d..(j + 1) * d].iter().enumerate() {
                        panel[p * G + j % G] = x;
                    }
                } else {
                    for p in 0..d {
                        panel[p * G + j % G] = 0.0;
                    }
                }
            }
        }
        self.held = key;
    }

    /// The packed K^T and V^T panels.
    pub(crate) fn panels(&self) -> (*const f32, *const f32) {
        (self.kt.as_slice().as_ptr(), self.vt.as_slice().as_ptr())
    }
}

/// `C (+)= A B` on `r x (16 * V)` (`r <= MR`): `A(i, p) = a[i * ars + p * acs]` for `p < k`, B row
/// p at `b + p * ldb`, C row i at `c + i * ldc`; C is overwritten unless `accumulate`.
#[target_feature(enable = "avx512f")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const R: usize, const V: usize>(a: *const f32, ars: usize, acs: usize, b: *const f32, ldb: usize, k: usize, c: *mut f32, ldc: usize, accumulate: bool) {
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    if accumulate {
        for (i, row) in acc.iter_mut().enumerate() {
            for (v, x) in row.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(c.add(i * ldc + v * L));
            }
        }
    }
    let mut ap = a;
    let mut bp = b;
    for _ in 0..k {
        let mut bv = [_mm512_setzero_ps(); V];
        for (v, x) in bv.iter_mut().enumerate() {
            *x = _mm512_loadu_ps(bp.add(v * L));
        }
        for (i, row) in acc.iter_mut().enumerate() {
            let av = _mm512_set1_ps(*ap.add(i * ars));
            for v in 0..V {
                row[v] = _mm512_fmadd_ps(av, bv[v], row[v]);
            }
        }
        ap = ap.add(acs);
        bp = bp.add(ldb);
    }
    for (i, row) in acc.iter().enumerate() {
        for (v, x) in row.iter().enumerate() {
            _mm512_storeu_ps(c.add(i * ldc + v * L), *x);
        }
    }
}

/// [`tile`] for a run-time height `r` (1..=MR) and width `v` (1..=NV vectors).
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_rv(r: usize, v: usize, a: *const f32, ars: usize, acs: usize, b: *const f32, ldb: usize, k: usize, c: *mut f32, ldc: usize, accumulate: bool) {
    macro_rules! arms {
        ($($r:literal),*) => {
            match (r, v) {
                $(
                    ($r, 4) => tile::<$r, 4>(a, ars, acs, b, ldb, k, c, ldc, accumulate),
                    ($r, 3) => tile::<$r, 3>(a, ars, acs, b, ldb, k, c, ldc, accumulate),
                    ($r, 2) => tile::<$r, 2>(a, ars, acs, b, ldb, k, c, ldc, accumulate),
                    ($r, 1) => tile::<$r, 1>(a, ars, acs, b, ldb, k, c, ldc, accumulate),
                )*
                _ => unreachable!("tile {r} x {v}"),
            }
        };
    }
    arms!(6, 5, 4, 3, 2, 1)
}

/// Strides of one product operand.
#[derive(Clone, Copy)]
pub(crate) struct Operand {
    pub ptr: *const f32,
    /// A: element (i, p) at `i * rs + p * cs`; B: row p at `p * rs`, column panel c (G columns)
    /// at `c * cs`.
    pub rs: usize,
    pub cs: usize,
}

/// Register tiles of an `m x n` product.
pub(crate) fn tiles(m: usize, n: usize) -> usize {
    m.div_ceil(MR) * n.div_ceil(G)
}

/// `C[m x n] (+)= A[m x k] B[k x n]` (`n` a multiple of 16), C row i at `c + i * ldc`: G-column
/// panels outer (one B panel stays in L1), MR-row strips inner; `pf` steps once per tile.
///
/// # Safety
/// The CPU has AVX-512F; A, B and C hold the elements the strides address.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn product(m: usize, n: usize, k: usize, a: Operand, b: Operand, c: *mut f32, ldc: usize, accumulate: bool, pf: &mut [Prefetch]) {
    debug_assert!(n.is_multiple_of(L));
    let mut c0 = 0;
    while c0 < n {
        let v = ((n - c0) / L).min(NV);
        let bp = b.ptr.add(c0 / G * b.cs);
        let mut r0 = 0;
        while r0 < m {
            let r = (m - r0).min(MR);
            for p in pf.iter_mut() {
                p.step();
            }
            tile_rv(r, v, a.ptr.add(r0 * a.rs), a.rs, a.cs, bp, b.rs, k, c.add(r0 * ldc + c0), ldc, accumulate);
            r0 += MR;
        }
        c0 += G;
    }
}

/// P and dS of `rows` rows in place: on row i's columns `[lo_i, hi_i)` (`los[i] - rel`, `his[i] -
/// rel`, clamped to `[0, nb)`) `s <- P = 2^(c s - lse2[i])` and `dp <- scale * P (dp - delta[i])`,
/// exactly 0 on the other columns up to `ceil16(nb)`. Rows `lds` floats apart.
///
/// # Safety
/// The CPU has AVX-512F; `s` and `dp` hold `rows` rows of `lds >= ceil16(nb)` floats.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn probs_dscores(s: &mut [f32], dp: &mut [f32], lds: usize, nb: usize, los: &[usize], his: &[usize], rel: usize, c: f32, lse2: &[f32], delta: &[f32], scale: f32) {
    let rows = his.len();
    let n16 = nb.div_ceil(L) * L;
    assert!(los.len() == rows && lse2.len() >= rows && delta.len() >= rows && lds >= n16);
    assert!(rows == 0 || (s.len() >= (rows - 1) * lds + n16 && dp.len() >= (rows - 1) * lds + n16));
    let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let cv = _mm512_set1_ps(c);
    let sv = _mm512_set1_ps(scale);
    for i in 0..rows {
        let hi = his[i].saturating_sub(rel).min(nb);
        let lo = los[i].saturating_sub(rel).min(hi);
        let (srow, drow) = (s.as_mut_ptr().add(i * lds), dp.as_mut_ptr().add(i * lds));
        let (lov, hiv) = (_mm512_set1_epi32(lo as i32), _mm512_set1_epi32(hi as i32));
        let sub = _mm512_set1_ps(-lse2[i]);
        let dv = _mm512_set1_ps(delta[i]);
        let mut j = 0;
        while j < n16 {
            let col = _mm512_add_epi32(iota, _mm512_set1_epi32(j as i32));
            let live = _mm512_cmpge_epi32_mask(col, lov) & _mm512_cmplt_epi32_mask(col, hiv);
            let p = if live == 0 { _mm512_setzero_ps() } else { _mm512_maskz_mov_ps(live, exp2_v(_mm512_fmadd_ps(_mm512_loadu_ps(srow.add(j)), cv, sub))) };
            _mm512_storeu_ps(srow.add(j), p);
            let ds = _mm512_mul_ps(_mm512_mul_ps(p, sv), _mm512_sub_ps(_mm512_loadu_ps(drow.add(j)), dv));
            _mm512_storeu_ps(drow.add(j), _mm512_maskz_mov_ps(live, ds));
            j += L;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Single-thread rate of the five products at one block pair's shapes (operands L2-resident):
    /// `cargo test --release backward_tiles::tests::product_rate -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn product_rate() {
        if !super::super::kernel::available() {
            return;
        }
        let (rows, nb, d) = (128usize, 64usize, 128usize);
        let lds = nb;
        let fill = |n: usize| {
            let mut a = Aligned::fresh(n);
            a.as_mut_slice().iter_mut().enumerate().for_each(|(i, x)| *x = (i % 7) as f32 * 0.01);
            a
        };
        let (q, dout, k, v) = (fill(rows * d), fill(rows * d), fill(nb * d), fill(nb * d));
        let (mut s, mut dp, mut dk, mut dq) = (fill(rows * lds), fill(rows * lds), fill(nb * d), fill(rows * d));
        let mut panels = KeyPanels::new();
        panels.pack(k.as_slice(), v.as_slice(), nb, d);
        let (kt, _) = panels.panels();
        let reps = 2000;
        let rows_of = |x: &Aligned| Operand { ptr: x.as_slice().as_ptr(), rs: d, cs: 1 };
        let cols_of = |x: &Aligned| Operand { ptr: x.as_slice().as_ptr(), rs: d, cs: G };
        for name in ["S = Q K^T", "dK += dS^T Q", "dQ += dS K"] {
            let t = std::time::Instant::now();
            for _ in 0..reps {
                // SAFETY: AVX-512 checked above; every buffer holds the addressed elements.
                unsafe {
                    match name {
                        "S = Q K^T" => product(rows, lds, d, rows_of(&q), Operand { ptr: kt, rs: G, cs: G * d }, s.as_mut_slice().as_mut_ptr(), lds, false, &mut []),
                        "dK += dS^T Q" => product(nb, d, rows, Operand { ptr: dp.as_slice().as_ptr(), rs: 1, cs: lds }, cols_of(&dout), dk.as_mut_slice().as_mut_ptr(), d, true, &mut []),
                        _ => product(rows, d, nb, Operand { ptr: dp.as_slice().as_ptr(), rs: lds, cs: 1 }, cols_of(&k), dq.as_mut_slice().as_mut_ptr(), d, true, &mut []),
                    }
                }
            }
            let dt = t.elapsed().as_secs_f64();
            println!("{name}: {:.1} GFLOP/s", 2.0 * (rows * nb * d * reps) as f64 / dt / 1e9);
        }
        let _ = (&mut dp, &mut s);
    }
}
