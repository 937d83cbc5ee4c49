//! Hand-written AVX-512 tiles for the CPU forward (used when the CPU has AVX-512; the gemm-crate
//! path in `forward.rs` is the fallback).
//!
//! K and V are packed once per forward into `G` = 64-wide panels, so every tile streams one
//! contiguous run of memory and no per-call packing is left:
//! - K of (segment, kv head): `[key / G][p][key % G]`, keys zero-padded to a multiple of `G`;
//! - V of (segment, kv head): `[col / G][key][col % G]`, columns zero-padded to a multiple of `G`.
//!
//! Q blocks are packed per task into strips of `MR` rows, `[strip][p][row % MR]` (zero rows pad
//! the last strip), so a tile's broadcasts read consecutive floats.
//!
//! Each tile keeps `MR x NV` 16-float accumulators in registers (`MR * NV + NV <= 32`).
//! The module is x86-64 only (`mod.rs` gates it).
//!
//! The AVX-512 intrinsics are stable since Rust 1.89, the crate's `rust-version` (the `gemm`
//! dependency's `x86-v4` feature needs them too).

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::layout::SharedMut;
use super::pool::Aligned;
use super::simd::Widen;
use crate::dtype::HostView;
use crate::spec::{AttnSpec, MAX_HEAD_DIM};

/// Rows per register tile (and per packed Q strip).
pub(crate) const MR: usize = 6;
/// 16-float vectors per register tile row.
pub(crate) const NV: usize = 4;
/// Lanes per vector.
pub(crate) const L: usize = 16;
/// Panel width of packed K (keys) and V (columns): one tile's width.
pub(crate) const G: usize = NV * L;

/// True when the AVX-512 tiles can run on this CPU.
pub(crate) fn available() -> bool {
    super::simd::simd_level() == 2
}

/// K and V of every (segment, kv head), packed into `G`-wide panels (see the module docs).
pub(crate) struct PackedKv {
    pub k: Aligned,
    pub v: Aligned,
    /// Per segment: offsets of head 0's K and V panels; head h adds h times the per-head size.
    pub k_off: Vec<usize>,
    pub v_off: Vec<usize>,
    /// Head dimension padded to a multiple of 16 (the O scratch's leading dimension).
    pub dp: usize,
    /// Head dimension padded to a multiple of `G` (V's packed width).
    pub dg: usize,
    /// Every packed K and V value is finite (the tiles are only run on finite inputs).
    pub finite: bool,
}

impl PackedKv {
    pub(crate) fn new(spec: &AttnSpec, k: HostView, v: HostView) -> Self {
        let dm = spec.dims;
        let (d, hkv) = (dm.head_dim, dm.heads_kv);
        let dp = d.div_ceil(L) * L;
        let dg = d.div_ceil(G) * G;
        let (mut k_off, mut v_off) = (Vec::new(), Vec::new());
        let (mut kn, mut vn) = (0usize, 0usize);
        for seg in &spec.segments {
            k_off.push(kn);
            v_off.push(vn);
            kn += seg.k_len.div_ceil(G) * G * d * hkv;
            vn += seg.k_len * dg * hkv;
        }
        let mut pk = Aligned::take(kn);
        let mut pv = Aligned::take(vn);
        /// Returns the largest `bits & 0x7fff_ffff` of the packed values (>= 0x7f80_0000: a
        /// non-finite one).
        #[allow(clippy::too_many_arguments)]
        fn go<T: Widen>(spec: &AttnSpec, k: &[T], v: &[T], pk: &mut [f32], pv: &mut [f32], k_off: &[usize], v_off: &[usize], dg: usize) -> u32 {
            let dm = spec.dims;
            let (d, hkv) = (dm.head_dim, dm.heads_kv);
            let rs = hkv * d;
            let (kw, vw) = (SharedMut::new(pk), SharedMut::new(pv));
            // one job per (segment, G-key panel), all heads: reads G whole token rows (contiguous,
            // so the hardware prefetchers stream them) and writes every head's K panel and G rows
            // of its V panels, padding included
            let jobs: Vec<(usize, usize)> =
                spec.segments.iter().enumerate().flat_map(|(si, s)| (0..s.k_len.div_ceil(G)).map(move |b| (si, b))).collect();
            jobs.par_iter().map(|&(si, b)| {
                let seg = &spec.segments[si];
                let (t0, t1) = (b * G, ((b + 1) * G).min(seg.k_len));
                let mut mag = 0u32;
                // a token row of one head widened at once (head_dim <= MAX_HEAD_DIM), then scattered
                let mut row_f = [0.0f32; MAX_HEAD_DIM];
                for h in 0..hkv {
                    let kpan = k_off[si] + h * seg.k_len.div_ceil(G) * G * d + b * G * d;
                    // SAFETY: (segment, head, panel) ranges are disjoint across jobs.
                    let kdst = unsafe { kw.slice(kpan, G * d) };
                    if t1 - t0 < G {
                        kdst.fill(0.0);
                    }
                    for t in t0..t1 {
                        T::widen(&k[(seg.k_start + t) * rs + h * d..][..d], &mut row_f[..d]);
                        for (p, &f) in row_f[..d].iter().enumerate() {
                            mag = mag.max(f.to_bits() & 0x7fff_ffff);
                            kdst[p * G + (t - t0)] = f;
                        }
                    }
                    let vh = v_off[si] + h * seg.k_len * dg;
                    for cp in 0..dg / G {
                        let c0 = cp * G;
                        let cn = G.min(d - c0);
                        // SAFETY: as above (rows t0..t1 of column panel cp of this head).
                        let vdst = unsafe { vw.slice(vh + cp * seg.k_len * G + t0 * G, (t1 - t0) * G) };
                        for t in t0..t1 {
                            let row = &mut vdst[(t - t0) * G..][..G];
                            T::widen(&v[(seg.k_start + t) * rs + h * d + c0..][..cn], &mut row[..cn]);
                            for o in &row[..cn] {
                                mag = mag.max(o.to_bits() & 0x7fff_ffff);
                            }
                            row[cn..].fill(0.0);
                        }
                    }
                }
                mag
            }).max().unwrap_or(0)
        }
        let (ks, vs) = (pk.as_mut_slice(), pv.as_mut_slice());
        let mag = match (k, v) {
            (HostView::F32(k), HostView::F32(v)) => go(spec, k, v, ks, vs, &k_off, &v_off, dg),
            (HostView::F16(k), HostView::F16(v)) => go(spec, k, v, ks, vs, &k_off, &v_off, dg),
            (HostView::BF16(k), HostView::BF16(v)) => go(spec, k, v, ks, vs, &k_off, &v_off, dg),
            _ => unreachable!("k and v share one dtype (checked by check_buffers)"),
        };
        PackedKv { k: pk, v: pv, k_off, v_off, dp, dg, finite: mag < 0x7f80_0000 }
    }

    /// Returns the buffers to the pool.
    pub(crate) fn release(self) {
        self.k.give();
        self.v.give();
    }
    /// K panels of head `h` of segment `si`, starting at key `kb` (a multiple of `G`).
    pub(crate) fn k_panels(&self, spec: &AttnSpec, si: usize, h: usize, kb: usize) -> *const f32 {
        let seg = &spec.segments[si];
        let d = spec.dims.head_dim;
        debug_assert!(kb.is_multiple_of(G));
        self.k.as_slice()[self.k_off[si] + h * seg.k_len.div_ceil(G) * G * d + kb * d..].as_ptr()
    }

    /// V panels of head `h` of segment `si`, starting at key `kb`; column panels lie
    /// `v_stride` floats apart.
    pub(crate) fn v_panels(&self, spec: &AttnSpec, si: usize, h: usize, kb: usize) -> (*const f32, usize) {
        let seg = &spec.segments[si];
        let off = self.v_off[si] + h * seg.k_len * self.dg + kb * G;
        (self.v.as_slice()[off..].as_ptr(), seg.k_len * G)
    }
}

/// Software prefetch into L2 of up to two address ranges, spread evenly over a kernel's tiles:
/// while one block of keys is multiplied, the next block's operand streams in from L3 (the
/// hardware prefetchers stop at 4 KiB pages and left the tiles waiting on L3 otherwise).
#[derive(Clone, Copy)]
pub(crate) struct Prefetch {
    ranges: [(*const f32, usize); 2],
    /// Cache lines per tile.
    per_tile: usize,
    /// Next line (index over both ranges).
    next: usize,
}

impl Prefetch {

    /// Prefetch `ranges` (pointer, floats) over `tiles` tiles.
    pub(crate) fn new(ranges: [(*const f32, usize); 2], tiles: usize) -> Self {
        let lines: usize = ranges.iter().map(|r| r.1.div_ceil(L)).sum();
        Prefetch { ranges, per_tile: lines.div_ceil(tiles.max(1)), next: 0 }
    }

    #[inline(always)]
    pub(crate) fn step(&mut self) {
        for _ in 0..self.per_tile {
            let mut i = self.next;
            for &(ptr, len) in &self.ranges {
                let n = len.div_ceil(L);
                if i < n {
                    // SAFETY: prefetches never fault; wrapping_add keeps the pointer math defined.
                    unsafe { _mm_prefetch::<_MM_HINT_T1>(ptr.wrapping_add(i * L) as *const i8) };
                    break;
                }
                i -= n;
            }
            self.next += 1;
        }
    }
}

/// Q of every (query block, query head), packed into `MR`-row strips `[strip][p][MR]`; rows past
/// a block's end are zero. Block `bi` of `blocks` (segment, first row, rows), head `h`, starts at
/// `((bi * heads_q) + h) * bq * d`.
pub(crate) struct PackedQ {
    pub q: Aligned,
    pub block_len: usize,
    /// Every packed Q value is finite.
    pub finite: bool,
}

impl PackedQ {
    pub(crate) fn new(spec: &AttnSpec, q: HostView, blocks: &[(usize, usize, usize)], bq: usize) -> Self {
        let dm = spec.dims;
        let (d, hq) = (dm.head_dim, dm.heads_q);
        debug_assert!(bq.is_multiple_of(MR));
        let block_len = hq * bq * d;
        let mut pq = Aligned::take(blocks.len() * block_len);
        fn go<T: Widen>(spec: &AttnSpec, q: &[T], blocks: &[(usize, usize, usize)], bq: usize, dst: &mut [f32]) -> u32 {
            let dm = spec.dims;
            let (d, hq) = (dm.head_dim, dm.heads_q);
            // one job per (block, strip): reads MR whole token rows (contiguous) for every head
            let strips = bq / MR;
            let w = SharedMut::new(dst);
            (0..blocks.len() * strips).into_par_iter().with_min_len(4).map(|j| {
                let (bi, st) = (j / strips, j % strips);
                let mut mag = 0u32;
                // a Q row widened at once (head_dim <= MAX_HEAD_DIM), then scattered
                let mut row_f = [0.0f32; MAX_HEAD_DIM];
                let (si, r0, rows) = blocks[bi];
                let seg = &spec.segments[si];
                for h in 0..hq {
                    // SAFETY: (block, head, strip) ranges are disjoint across jobs.
                    let out = unsafe { w.slice(((bi * hq + h) * bq + st * MR) * d, MR * d) };
                    for i in 0..MR {
                        let r = st * MR + i;
                        if r < rows {
                            T::widen(&q[((seg.q_start + r0 + r) * hq + h) * d..][..d], &mut row_f[..d]);
                            for (p, &f) in row_f[..d].iter().enumerate() {
                                mag = mag.max(f.to_bits() & 0x7fff_ffff);
                                out[p * MR + i] = f;
                            }
                        } else {
                            for p in 0..d {
                                out[p * MR + i] = 0.0;
                            }
                        }
                    }
                }
                mag
            }).max().unwrap_or(0)
        }
        let dst = pq.as_mut_slice();
        let mag = match q {
            HostView::F32(x) => go(spec, x, blocks, bq, dst),
            HostView::F16(x) => go(spec, x, blocks, bq, dst),
            HostView::BF16(x) => go(spec, x, blocks, bq, dst),
        };
        PackedQ { q: pq, block_len, finite: mag < 0x7f80_0000 }
    }

    /// The packed strips of block `bi`, head `h`.
    pub(crate) fn strips(&self, bi: usize, h: usize, hq: usize) -> &[f32] {
        let per_head = self.block_len / hq;
        &self.q.as_slice()[(bi * hq + h) * per_head..][..per_head]
    }
}

/// `S[strip rows, keys]` = Q K^T for each strip `s`, keys `0..ceil16(lim[s])`.
/// `qp`: packed Q strips (`d * MR` floats each); `kp`: K panels (`G * d` floats each);
/// `s_out`: row-major with leading dimension `lds`.
///
/// # Safety
/// The CPU has AVX-512F; `kp` holds `ceil(max(lim) / G)` panels; `s_out` holds
/// `strips * MR` rows of `lds >= ceil16(max(lim))` floats.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn qk(qp: &[f32], d: usize, kp: *const f32, lims: &[usize], s_out: &mut [f32], lds: usize, pf: [(*const f32, usize); 2]) {
    let strips = lims.len();
    let tiles: usize = lims.iter().map(|&x| x.div_ceil(G)).sum();
    let mut pf = Prefetch::new(pf, tiles);
    debug_assert!(qp.len() >= strips * d * MR);
    debug_assert!(s_out.len() >= strips * MR * lds);
    let kmax = lims.iter().copied().max().unwrap_or(0);
    let so = s_out.as_mut_ptr();
    let qo = qp.as_ptr();
    // panels outer (one K panel, G keys x d, stays in L1), strips inner
    let mut k0 = 0;
    while k0 < kmax {
        for (s, &lim) in lims.iter().enumerate() {
            if lim <= k0 {
                continue;
            }
            let nv = (lim - k0).div_ceil(L).min(NV);
            let q = qo.add(s * d * MR);
            let kpp = kp.add(k0 * d);
            let dst = so.add(s * MR * lds + k0);
            pf.step();
            match nv {
                4 => qk_tile::<4>(q, kpp, d, dst, lds),
                3 => qk_tile::<3>(q, kpp, d, dst, lds),
                2 => qk_tile::<2>(q, kpp, d, dst, lds),
                _ => qk_tile::<1>(q, kpp, d, dst, lds),
            }
        }
        k0 += G;
    }
}

#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn qk_tile<const V: usize>(q: *const f32, kp: *const f32, d: usize, dst: *mut f32, lds: usize) {
    let mut acc = [[_mm512_setzero_ps(); V]; MR];
    for p in 0..d {
        let mut b = [_mm512_setzero_ps(); V];
        for (v, bv) in b.iter_mut().enumerate() {
            *bv = _mm512_load_ps(kp.add(p * G + v * L));
        }
        for (i, row) in acc.iter_mut().enumerate() {
            let a = _mm512_set1_ps(*q.add(p * MR + i));
            for v in 0..V {
                row[v] = _mm512_fmadd_ps(a, b[v], row[v]);
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        for (v, x) in row.iter().enumerate() {
            _mm512_storeu_ps(dst.add(i * lds + v * L), *x);
        }
    }
}

/// Keys per chunk of the P V product (the V chunk, KC x NV*16 floats, stays in L1).
const KC: usize = 128;

/// `O[strip rows, 0..dp] += P[strip rows, 0..lim[s]] V` for each strip `s`.
/// `p`: row-major, leading dimension `ldp`; `vp`: V column panels `v_stride` floats apart, row
/// j of a panel at `j * G`; `o`: row-major, leading dimension `dp`.
///
/// # Safety
/// The CPU has AVX-512F; `p` holds `strips * MR` rows of `ldp` floats, finite up to each strip's
/// limit; `vp` holds `ceil(dp / G)` panels of `max(lim)` rows; `o` holds `strips * MR * dp` floats.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pv(p: &[f32], ldp: usize, vp: *const f32, v_stride: usize, lims: &[usize], o: &mut [f32], dp: usize, pf: [(*const f32, usize); 2]) {
    let strips = lims.len();
    let tiles: usize = dp.div_ceil(G) * lims.iter().map(|&x| x.div_ceil(KC)).sum::<usize>();
    let mut pf = Prefetch::new(pf, tiles);
    debug_assert!(o.len() >= strips * MR * dp);
    let kmax = lims.iter().copied().max().unwrap_or(0);
    let (po, oo) = (p.as_ptr(), o.as_mut_ptr());
    let mut c0 = 0;
    while c0 < dp {
        let nv = (dp - c0).div_ceil(L).min(NV);
        let mut j0 = 0;
        while j0 < kmax {
            for (s, &lim) in lims.iter().enumerate() {
                if lim <= j0 {
                    continue;
                }
                let len = (lim - j0).min(KC);
                let a = po.add(s * MR * ldp + j0);
                let b = vp.add(c0 / G * v_stride + j0 * G);
                let dst = oo.add(s * MR * dp + c0);
                pf.step();
                match nv {
                    4 => pv_tile::<4>(a, ldp, b, len, dst, dp),
                    3 => pv_tile::<3>(a, ldp, b, len, dst, dp),
                    2 => pv_tile::<2>(a, ldp, b, len, dst, dp),
                    _ => pv_tile::<1>(a, ldp, b, len, dst, dp),
                }
            }
            j0 += KC;
        }
        c0 += G;
    }
}

#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn pv_tile<const V: usize>(a: *const f32, lda: usize, b: *const f32, len: usize, dst: *mut f32, ldd: usize) {
    let mut acc = [[_mm512_setzero_ps(); V]; MR];
    for (i, row) in acc.iter_mut().enumerate() {
        for (v, x) in row.iter_mut().enumerate() {
            *x = _mm512_load_ps(dst.add(i * ldd + v * L));
        }
    }
    for j in 0..len {
        let mut bv = [_mm512_setzero_ps(); V];
        for (v, x) in bv.iter_mut().enumerate() {
            *x = _mm512_load_ps(b.add(j * G + v * L));
        }
        for (i, row) in acc.iter_mut().enumerate() {
            let av = _mm512_set1_ps(*a.add(i * lda + j));
            for v in 0..V {
                row[v] = _mm512_fmadd_ps(av, bv[v], row[v]);
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        for (v, x) in row.iter().enumerate() {
            _mm512_store_ps(dst.add(i * ldd + v * L), *x);
        }
    }
}

/// 2^t for t <= ~0, 16 lanes: t = n + f with n = round(t), |f| <= 1/2; 2^f by a degree-6
/// polynomial (relative error ~1e-7 in f32, under the f32 rounding of the result), then
/// `scalef` applies 2^n (underflowing to 0 for very negative t and -inf, no integer tricks
/// needed); NaN gives NaN.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn exp2_v(t: __m512) -> __m512 {
    const C: [f32; 7] = [1.0, std::f32::consts::LN_2, 0.240_226_48, 0.055_503_324, 0.009_618_437, 0.001_339_888_5, 0.000_153_535_88];
    // -inf (a -inf score, or one that overflowed) -> 2^-150 = 0 instead of inf - inf = NaN; max
    // returns its second operand when one is NaN, so a NaN stays NaN
    let t = _mm512_max_ps(_mm512_set1_ps(-150.0), t);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
    let f = _mm512_sub_ps(t, n);
    let mut p = _mm512_set1_ps(C[6]);
    for &ck in C[..6].iter().rev() {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(ck));
    }
    _mm512_scalef_ps(p, n)
}

/// One key block of online softmax (base-2 units) for rows `0..lims.len()`: on entry `s` holds
/// raw q.k (leading dimension `lds`), on exit the unnormalised probabilities; row i sees block
/// columns `< lims[i] - kb` (clamped to `n`) and gets zeros from there up to its strip's limit
/// `strip_lims[i / MR]` (the columns P V reads). `m`/`l` are updated and each row of `o`
/// (leading dimension `ldo`, `ldo` a multiple of 16) is rescaled for the new maximum.
///
/// # Safety
/// The CPU has AVX-512F; `s` holds `lims.len()` rows of `lds >= n` floats, `o` as many of `ldo`.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn softmax_block(
    s: &mut [f32],
    lds: usize,
    n: usize,
    lims: &[usize],
    strip_lims: &[usize],
    kb: usize,
    c: f32,
    m: &mut [f32],
    l: &mut [f32],
    o: &mut [f32],
    ldo: usize,
) {
    let rows = lims.len();
    assert!(m.len() >= rows && l.len() >= rows && strip_lims.len() * MR >= rows);
    assert!(rows == 0 || (s.len() >= (rows - 1) * lds + n && o.len() >= rows * ldo && ldo.is_multiple_of(L)));
    let cv = _mm512_set1_ps(c);
    for i in 0..rows {
        let row = s.as_mut_ptr().add(i * lds);
        let lim = lims[i].saturating_sub(kb).min(n);
        let zero_to = strip_lims[i / MR].min(n).max(lim);
        let mut j = lim;
        while j < zero_to {
            _mm512_mask_storeu_ps(row.add(j), tail_mask(zero_to - j), _mm512_setzero_ps());
            j += L;
        }
        if lim == 0 {
            continue;
        }
        // max of c*x over the live columns (c*x, not x: the scale may be negative)
        let full = lim / L * L;
        let mut mx = [_mm512_set1_ps(f32::NEG_INFINITY); 2];
        let mut j = 0;
        while j < full {
            let x = _mm512_mul_ps(_mm512_loadu_ps(row.add(j)), cv);
            mx[(j / L) & 1] = _mm512_max_ps(mx[(j / L) & 1], x);
            j += L;
        }
        if full < lim {
            // scale first, then -inf in the dead lanes: -inf * c would be +inf (c < 0) or NaN (c = 0)
            let k = tail_mask(lim - full);
            let x = _mm512_mask_mov_ps(_mm512_set1_ps(f32::NEG_INFINITY), k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, row.add(full)), cv));
            mx[0] = _mm512_max_ps(mx[0], x);
        }
        let m_new = _mm512_reduce_max_ps(_mm512_max_ps(mx[0], mx[1])).max(m[i]);
        let mneg = _mm512_set1_ps(-m_new);
        let mut sum = [_mm512_setzero_ps(); 2];
        let mut j = 0;
        while j < full {
            let e = exp2_v(_mm512_fmadd_ps(_mm512_loadu_ps(row.add(j)), cv, mneg));
            _mm512_storeu_ps(row.add(j), e);
            sum[(j / L) & 1] = _mm512_add_ps(sum[(j / L) & 1], e);
            j += L;
        }
        if full < lim {
            let k = tail_mask(lim - full);
            let e = exp2_v(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, row.add(full)), cv, mneg));
            let e = _mm512_maskz_mov_ps(k, e);
            _mm512_mask_storeu_ps(row.add(full), k, e);
            sum[0] = _mm512_add_ps(sum[0], e);
        }
        let total = _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1]));
        let alpha = super::simd::exp2_neg(m[i] - m_new);
        l[i] = l[i] * alpha + total;
        m[i] = m_new;
        if alpha != 1.0 {
            let av = _mm512_set1_ps(alpha);
            let orow = o.as_mut_ptr().add(i * ldo);
            let mut j = 0;
            while j < ldo {
                _mm512_storeu_ps(orow.add(j), _mm512_mul_ps(_mm512_loadu_ps(orow.add(j)), av));
                j += L;
            }
        }
    }
}

/// The low `min(n, 16)` lanes.
#[inline(always)]
fn tail_mask(n: usize) -> __mmask16 {
    if n >= L {
        0xffff
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp2_v_is_accurate() {
        if !available() {
            return;
        }
        let mut worst = 0.0f64;
        let mut x = -140.0f32;
        while x <= 0.5 {
            let mut out = [0.0f32; 16];
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), exp2_v(_mm512_set1_ps(x))) };
            let want = (x as f64).exp2();
            if want > 1e-37 {
                worst = worst.max(((out[0] as f64 - want) / want).abs());
            } else {
                assert!((out[0] as f64) < 2e-37, "2^{x}: {}", out[0]);
            }
            x += 0.00731;
        }
        assert!(worst < 2.5e-7, "worst relative error {worst}");
        let at = |x: f32| {
            let mut out = [0.0f32; 16];
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), exp2_v(_mm512_set1_ps(x))) };
            out[0]
        };
        assert_eq!(at(f32::NEG_INFINITY), 0.0);
        assert_eq!(at(-1e30), 0.0);
        assert!(at(f32::NAN).is_nan());
    }

    /// Packing time at S = 2048, H = 8, d = 128 (both threads):
    /// `cargo test --release kernel::tests::pack_rate -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn pack_rate() {
        use crate::dtype::{DType, HostData};
        use crate::spec::TensorMeta;
        let (sl, h, d) = (2048usize, 8usize, 128usize);
        let m = TensorMeta::new(&[sl, h, d], DType::F32);
        let cu = [0, sl as i32];
        let spec = AttnSpec::varlen(&m, &m, &m, &cu, &cu, sl, sl, None, true).unwrap();
        let x = HostData::F32((0..sl * h * d).map(|i| (i % 13) as f32).collect());
        let blocks: Vec<(usize, usize, usize)> = (0..sl).step_by(126).map(|r| (0, r, 126.min(sl - r))).collect();
        for _ in 0..3 {
            let t = std::time::Instant::now();
            let pkv = PackedKv::new(&spec, x.view(), x.view());
            let t1 = t.elapsed().as_secs_f64() * 1e3;
            let t = std::time::Instant::now();
            let pq = PackedQ::new(&spec, x.view(), &blocks, 126);
            let t2 = t.elapsed().as_secs_f64() * 1e3;
            let mut dst = vec![0.0f32; 2 * sl * h * d];
            let src = x.to_f32_vec();
            let t = std::time::Instant::now();
            dst.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
                let n = c.len().min(src.len() - ((i << 16) % src.len()));
                c[..n].copy_from_slice(&src[(i << 16) % src.len()..][..n]);
            });
            let t3 = t.elapsed().as_secs_f64() * 1e3;
            println!("pack K,V {t1:.2} ms, Q {t2:.2} ms; plain copy of K,V's size {t3:.2} ms");
            pkv.release();
            pq.q.give();
        }
    }

    /// Single-thread tile throughput: `cargo test --release kernel::tests::tile_rate -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn tile_rate() {
        if !available() {
            return;
        }
        let (d, bq, bk) = (128usize, MR * (128 / MR), 512usize);
        let strips = bq / MR;
        let lds = bk + L;
        let mut q = Aligned::take(strips * MR * d);
        q.as_mut_slice().fill(0.0);
        let k = {
            let mut a = Aligned::take(bk * d);
            a.as_mut_slice().iter_mut().enumerate().for_each(|(i, x)| *x = (i % 7) as f32 * 0.01);
            a
        };
        let mut s = Aligned::take(strips * MR * lds);
        let mut o = Aligned::take(strips * MR * d);
        o.as_mut_slice().fill(0.0);
        s.as_mut_slice().fill(0.0);
        let lims = vec![bk; strips];
        let reps = 400;
        const PF: [(*const f32, usize); 2] = [(std::ptr::null(), 0); 2];
        // K/V either one L2-resident block or blocks walked through a 32 MiB buffer (as in a real
        // forward, where every block comes from L3)
        let big = {
            let mut a = Aligned::take(64 * bk * d);
            a.as_mut_slice().iter_mut().enumerate().for_each(|(i, x)| *x = (i % 7) as f32 * 0.01);
            a
        };
        for cold in [false, true] {
            for (name, f) in [("qk", 0), ("pv", 1)] {
                let t = std::time::Instant::now();
                for r in 0..reps {
                    let kp = if cold { big.as_slice()[(r % 64) * bk * d..].as_ptr() } else { k.as_slice().as_ptr() };
                    // cold runs prefetch the next block, as the forward does
                    let pf = if cold { [(big.as_slice()[((r + 1) % 64) * bk * d..].as_ptr(), bk * d), (std::ptr::null(), 0)] } else { PF };
                    unsafe {
                        if f == 0 {
                            qk(q.as_slice(), d, kp, &lims, s.as_mut_slice(), lds, pf);
                        } else {
                            pv(s.as_slice(), lds, kp, bk * G, &lims, o.as_mut_slice(), d, pf);
                        }
                    }
                }
                let dt = t.elapsed().as_secs_f64();
                let flops = 2.0 * (strips * MR * bk * d * reps) as f64;
                println!("{name} (cold={cold}): {:.1} GFLOP/s (MR={MR} NV={NV})", flops / dt / 1e9);
            }
        }
    }
}
