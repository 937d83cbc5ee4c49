//! CPU forward: blocked online softmax (the FlashAttention algorithm) with f32 accumulation.
//! One task per (segment, query block, query head); tasks run longest-first on rayon.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::kernel;
#[cfg(target_arch = "x86_64")]
use super::pool::Aligned;
use super::layout::{from_f32_vec, matmul, to_f32_cow, transpose_per_head, Mat, SharedMut};
use super::simd::{exp2_scaled_sub_sum, exp2_sub_sum, max_of, multiversion, scale_in_place};
use crate::backend::ForwardOutput;
use crate::dtype::HostView;
use crate::spec::{AttnSpec, Segment};

/// Query rows per task.
pub(crate) const BQ: usize = 128;
/// Keys per inner block.
pub(crate) const BK: usize = 512;

multiversion! {
    /// One key block of online softmax for `his.len()` rows. On entry `s` holds raw q.k (rows x
    /// n, leading dimension `lds`); on exit it holds the unnormalised probabilities (exact zeros
    /// outside each row's keys), `m`/`l` are updated (base-2 units) and each row of `o` (leading
    /// dimension `ldo`) is rescaled for the new maximum. Row i sees block columns
    /// `[los[i] - kb, his[i] - kb)` (clamped to `[0, n)`); an empty `los` means 0 for every row.
    #[allow(clippy::too_many_arguments)]
    fn online_softmax_rows(s: &mut [f32], lds: usize, n: usize, los: &[usize], his: &[usize], kb: usize, c: f32, m: &mut [f32], l: &mut [f32], o: &mut [f32], ldo: usize) {
        for (i, &hi) in his.iter().enumerate() {
            let row = &mut s[i * lds..i * lds + n];
            let hi = hi.saturating_sub(kb).min(n);
            let lo = if los.is_empty() { 0 } else { los[i].saturating_sub(kb).min(hi) };
            if lo == hi {
                row.fill(0.0);
                continue;
            }
            let (head, rest) = row.split_at_mut(lo);
            head.fill(0.0);
            let (live, dead) = rest.split_at_mut(hi - lo);
            dead.fill(0.0);
            // the max of c*s is c*max(s) for c >= 0; a negative scale takes the slow path
            // (max_of skips NaN: a NaN score reaches the sum through exp2 instead)
            if c < 0.0 {
                scale_in_place(live, c);
            }
            let cs = if c < 0.0 { 1.0 } else { c };
            let bmax = max_of(live) * cs;
            if bmax == f32::NEG_INFINITY && live.iter().all(|&x| x * cs == f32::NEG_INFINITY) {
                // every score of the block is -inf (e.g. an Inf in k): weight 0; a row whose scores
                // are all -inf keeps l = 0 and ends as a row with no key (zero output, lse +inf:
                // torch's SDPA also gives zeros there)
                live.fill(0.0);
                continue;
            }
            let m_new = bmax.max(m[i]);
            let sum = if c < 0.0 { exp2_sub_sum(live, m_new) } else { exp2_scaled_sub_sum(live, c, m_new) };
            let alpha = super::simd::exp2_neg(m[i] - m_new);
            l[i] = l[i] * alpha + sum;
            m[i] = m_new;
            if alpha != 1.0 {
                scale_in_place(&mut o[i * ldo..i * ldo + ldo], alpha);
            }
        }
    }
}

/// [`online_softmax_rows`] for rows that see block columns `< lims[i] - kb` (no lower bound).
#[allow(clippy::too_many_arguments)]
pub(crate) fn online_softmax_block(s: &mut [f32], lds: usize, n: usize, lims: &[usize], kb: usize, c: f32, m: &mut [f32], l: &mut [f32], o: &mut [f32], ldo: usize) {
    online_softmax_rows(s, lds, n, &[], lims, kb, c, m, l, o, ldo)
}

pub(crate) struct Scratch {
    pub(crate) s: Vec<f32>,
    pub(crate) o: Vec<f32>,
    pub(crate) m: Vec<f32>,
    pub(crate) l: Vec<f32>,
    pub(crate) lims: Vec<usize>,
    pub(crate) los: Vec<usize>,
}

impl Scratch {
    pub(crate) fn new(d: usize) -> Self {
        Scratch { s: vec![0.0; BQ * BK], o: vec![0.0; BQ * d], m: vec![0.0; BQ], l: vec![0.0; BQ], lims: vec![0; BQ], los: vec![0; BQ] }
    }
}

/// Visible-key count (relative to the window start) of rows `r0..r0+rows` of `seg`.
pub(crate) fn row_limits(seg: &Segment, causal: bool, r0: usize, rows: usize, out: &mut Vec<usize>) {
    out.clear();
    out.extend((r0..r0 + rows).map(|r| seg.visible_len(r, causal)));
}

/// Keys `[los[i], his[i])` (relative to the window start, see [`AttnSpec::row_keys`]) of rows
/// `r0..r0+rows` of `seg`; returns the union `[min lo, max hi)` over the rows that see a key
/// (`(0, 0)` when none does).
pub(crate) fn row_bounds(spec: &AttnSpec, seg: &Segment, r0: usize, rows: usize, los: &mut Vec<usize>, his: &mut Vec<usize>) -> (usize, usize) {
    los.clear();
    his.clear();
    let (mut a, mut b) = (usize::MAX, 0);
    for r in r0..r0 + rows {
        let (lo, hi) = spec.row_keys(seg, r);
        los.push(lo);
        his.push(hi);
        if lo < hi {
            a = a.min(lo);
            b = b.max(hi);
        }
    }
    if b == 0 { (0, 0) } else { (a, b) }
}

/// Keys of the first to the last row of a query block: its work estimate.
fn block_span(spec: &AttnSpec, seg: &Segment, r0: usize, last: usize) -> usize {
    spec.row_keys(seg, last).1.saturating_sub(spec.row_keys(seg, r0).0)
}

/// Work items (segment index, first row) per head, longest first.
pub(crate) fn query_blocks(spec: &AttnSpec) -> Vec<(usize, usize)> {
    let mut blocks: Vec<(usize, usize, usize)> = Vec::new();
    for (si, seg) in spec.segments.iter().enumerate() {
        for r0 in (0..seg.q_len).step_by(BQ) {
            let last = (r0 + BQ).min(seg.q_len) - 1;
            blocks.push((si, r0, block_span(spec, seg, r0, last)));
        }
    }
    blocks.sort_by_key(|b| std::cmp::Reverse(b.2));
    blocks.into_iter().map(|(s, r, _)| (s, r)).collect()
}

pub(crate) fn forward(spec: &AttnSpec, q: HostView, k: HostView, v: HostView) -> ForwardOutput {
    // decode-sized calls: one task per (segment, kv head) over K / V in place
    if super::decode::is_decode(spec) {
        return super::decode::forward_decode(spec, q, k, v);
    }
    // the AVX-512 tiles serve the plain causal / full masks; a sliding window takes the gemm path
    #[cfg(target_arch = "x86_64")]
    if use_tiles() && spec.window.is_none() {
        return forward_tiles(spec, q, k, v);
    }
    forward_gemm(spec, q, k, v)
}

#[cfg(target_arch = "x86_64")]
/// The AVX-512 tiles unless the CPU lacks AVX-512 or `CUBEATTN_CPU_KERNEL=gemm` asks for the
/// gemm-crate path (`crate::config`).
pub(crate) fn use_tiles() -> bool {
    static USE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USE.get_or_init(|| kernel::available() && !crate::config::get().cpu_gemm)
}

/// Writes rows `0..rows` of the normalised output (`o` has leading dimension `ldo`) and their
/// LSE; rows that saw no key (`l == 0`) keep out = 0, lse = +inf; a NaN `l` (a NaN or +Inf score,
/// or NaN marked by the caller) gives a NaN row and lse, as torch's softmax does.
#[allow(clippy::too_many_arguments)]
pub(crate) fn finish_rows(o: &[f32], ldo: usize, m: &[f32], l: &[f32], rows: usize, d: usize, out_w: &SharedMut<f32>, lse_dst: &mut [f32], out_at: impl Fn(usize) -> usize) {
    for i in 0..rows {
        let li = l[i];
        if li != 0.0 {
            // SAFETY: callers pass disjoint (row, head) ranges per task.
            let dst = unsafe { out_w.slice(out_at(i), d) };
            let inv = 1.0 / li;
            for (o, &a) in dst.iter_mut().zip(&o[i * ldo..i * ldo + d]) {
                *o = a * inv;
            }
            lse_dst[i] = (m[i] + li.log2()) * std::f32::consts::LN_2;
        }
    }
}

#[cfg(target_arch = "x86_64")]
/// Query rows per task and keys per block of the tile path. 378 x 256 measured ~3% faster than
/// 126 x 512 and 252 x 256 at d = 128 (each K/V byte streamed from L3 serves more rows); its
/// ~1.7 MiB working set at d = 128 is why larger heads fall back to 126 x 512.
fn tile_blocks(d: usize) -> (usize, usize) {
    if d <= 128 { (kernel::MR * 63, 256) } else { (kernel::MR * 21, 512) }
}

#[cfg(target_arch = "x86_64")]
struct TileScratch {
    d: usize,
    bq: usize,
    bk: usize,
    s: Aligned,
    o: Aligned,
    m: Vec<f32>,
    l: Vec<f32>,
    lims: Vec<usize>,
    strip_lims: Vec<usize>,
}

#[cfg(target_arch = "x86_64")]
impl TileScratch {
    fn new(d: usize, dp: usize, bq: usize, lds: usize) -> Self {
        TileScratch {
            d,
            bq,
            bk: lds - kernel::L,
            s: Aligned::take(bq * lds),
            o: Aligned::take(bq * dp),
            m: vec![0.0; bq],
            l: vec![0.0; bq],
            lims: Vec::with_capacity(bq),
            strip_lims: Vec::with_capacity(bq / kernel::MR),
        }
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Per-thread scratch of the tile path, kept between calls (about 0.3 MiB at d = 128).
    static TILE_SCRATCH: std::cell::RefCell<Option<TileScratch>> = const { std::cell::RefCell::new(None) };
}

#[cfg(target_arch = "x86_64")]
fn forward_tiles(spec: &AttnSpec, q: HostView, k: HostView, v: HostView) -> ForwardOutput {
    let dm = spec.dims;
    let (d, tq, hq) = (dm.head_dim, dm.total_q, dm.heads_q);
    let mr = kernel::MR;
    let (bq, bk) = tile_blocks(d);
    let lds = bk + kernel::L;
    // query blocks (segment, first row, rows), longest first
    let mut blocks: Vec<(usize, usize, usize, usize)> = Vec::new();
    for (si, seg) in spec.segments.iter().enumerate() {
        for r0 in (0..seg.q_len).step_by(bq) {
            let rows = bq.min(seg.q_len - r0);
            blocks.push((si, r0, rows, seg.visible_len(r0 + rows - 1, spec.causal)));
        }
    }
    blocks.sort_by_key(|b| std::cmp::Reverse(b.3));
    let blocks: Vec<(usize, usize, usize)> = blocks.into_iter().map(|(s, r, n, _)| (s, r, n)).collect();
    let pq = kernel::PackedQ::new(spec, q, &blocks, bq);
    let pkv = kernel::PackedKv::new(spec, k, v);
    if !(pq.finite && pkv.finite) {
        // NaN / Inf inputs take the gemm path, which follows the NaN/Inf policy exactly (a masked
        // key contributes nothing, not even 0 * Inf); the tiles read whole strips
        pq.q.give();
        pkv.release();
        return forward_gemm(spec, q, k, v);
    }
    let dp = pkv.dp;
    let mut out = vec![0.0f32; dm.q_len()];
    let mut lse = vec![f32::INFINITY; dm.lse_len()];
    let out_w = SharedMut::new(&mut out);
    let lse_w = SharedMut::new(&mut lse);
    let c = spec.scale * std::f32::consts::LOG2_E;

    let tasks: Vec<(usize, usize)> = (0..blocks.len()).flat_map(|bi| (0..hq).map(move |h| (bi, h))).collect();
    tasks.par_iter().for_each(|&(bi, h)| {
        TILE_SCRATCH.with_borrow_mut(|slot| {
            if slot.as_ref().is_none_or(|sc| sc.d != d || sc.bq != bq || sc.bk != bk) {
                if let Some(old) = slot.take() {
                    old.s.give();
                    old.o.give();
                }
                *slot = Some(TileScratch::new(d, dp, bq, lds));
            }
            let sc = slot.as_mut().expect("scratch was just set");
            let (si, r0, rows) = blocks[bi];
            let seg = &spec.segments[si];
            let strips = rows.div_ceil(mr);
            let hk = h / dm.group_size();
            let row0 = seg.q_start + r0;
            let qs = pq.strips(bi, h, hq);
            row_limits(seg, spec.causal, r0, rows, &mut sc.lims);
            let k_hi = sc.lims.iter().copied().max().unwrap_or(0);
            sc.o.as_mut_slice()[..strips * mr * dp].fill(0.0);
            sc.m[..rows].fill(f32::NEG_INFINITY);
            sc.l[..rows].fill(0.0);
            for kb in (0..k_hi).step_by(bk) {
                let n = bk.min(k_hi - kb);
                sc.strip_lims.clear();
                sc.strip_lims.extend(sc.lims.chunks(mr).map(|ch| ch.iter().copied().max().unwrap_or(0).saturating_sub(kb).min(n)));
                let kp = pkv.k_panels(spec, si, hk, kb);
                let (vp, vs) = pkv.v_panels(spec, si, hk, kb);
                // while Q K^T runs, fetch this block's V (up to two column panels); while P V
                // runs, the next block's K
                let kv_used = sc.strip_lims.iter().copied().max().unwrap_or(0);
                let pf_v = [(vp, kv_used * kernel::G), (vp.wrapping_add(vs), if dp > kernel::G { kv_used * kernel::G } else { 0 })];
                let next_n = bk.min(k_hi.saturating_sub(kb + bk));
                let pf_k = if next_n > 0 {
                    [(pkv.k_panels(spec, si, hk, kb + bk), next_n.div_ceil(kernel::G) * kernel::G * d), (std::ptr::null(), 0)]
                } else {
                    [(std::ptr::null(), 0); 2]
                };
                // SAFETY: AVX-512 was detected (use_tiles); the packed K/V hold this segment's
                // k_len >= kb + n keys (K padded to G), scratch sizes cover bq rows.
                unsafe { kernel::qk(qs, d, kp, &sc.strip_lims, sc.s.as_mut_slice(), lds, pf_v) };
                unsafe { kernel::softmax_block(sc.s.as_mut_slice(), lds, n, &sc.lims, &sc.strip_lims, kb, c, &mut sc.m[..rows], &mut sc.l[..rows], sc.o.as_mut_slice(), dp) };
                unsafe { kernel::pv(sc.s.as_slice(), lds, vp, vs, &sc.strip_lims, sc.o.as_mut_slice(), dp, pf_k) };
            }
            // SAFETY: segments own disjoint query rows, so (row, head) ranges of tasks are disjoint.
            let lse_dst = unsafe { lse_w.slice(h * tq + row0, rows) };
            finish_rows(sc.o.as_slice(), dp, &sc.m, &sc.l, rows, d, &out_w, lse_dst, |i| ((row0 + i) * hq + h) * d);
        })
    });
    pq.q.give();
    pkv.release();
    ForwardOutput { out: from_f32_vec(out, spec.dtype), lse }
}

pub(crate) fn forward_gemm(spec: &AttnSpec, q: HostView, k: HostView, v: HostView) -> ForwardOutput {
    let dm = spec.dims;
    let (d, tq, hq, hkv) = (dm.head_dim, dm.total_q, dm.heads_q, dm.heads_kv);
    // Token-major f32 throughout: the gemm reads head h's rows at stride heads*d, so f32 input
    // is used in place and other dtypes are only widened.
    let qf = to_f32_cow(q);
    let kt = transpose_per_head(k, dm.total_k, hkv, d);
    let tk = dm.total_k;
    let vf = to_f32_cow(v);
    let mut out = vec![0.0f32; dm.q_len()];
    let mut lse = vec![f32::INFINITY; dm.lse_len()];
    let out_w = SharedMut::new(&mut out);
    let lse_w = SharedMut::new(&mut lse);
    let c = spec.scale * std::f32::consts::LOG2_E;
    let (q_rs, kv_rs) = ((hq * d) as isize, (hkv * d) as isize);
    // with a NaN / Inf in V, P V runs row by row over each row's own keys only: the product's
    // zeros of masked keys would turn 0 * Inf into NaN
    let exact_pv = !all_finite(&vf);

    let tasks: Vec<(usize, usize, usize)> = query_blocks(spec)
        .into_iter()
        .flat_map(|(s, r0)| (0..hq).map(move |h| (s, r0, h)))
        .collect();
    tasks.par_iter().for_each_init(
        || Scratch::new(d),
        |sc, &(si, r0, h)| {
            let seg = &spec.segments[si];
            let rows = BQ.min(seg.q_len - r0);
            let hk = h / dm.group_size();
            let row0 = seg.q_start + r0;
            let qblk = Mat { ptr: qf[(row0 * hq + h) * d..].as_ptr(), rs: q_rs, cs: 1 };
            let (k_lo, k_hi) = row_bounds(spec, seg, r0, rows, &mut sc.los, &mut sc.lims);
            sc.o[..rows * d].fill(0.0);
            sc.m[..rows].fill(f32::NEG_INFINITY);
            sc.l[..rows].fill(0.0);
            for kb in (k_lo..k_hi).step_by(BK) {
                let n = BK.min(k_hi - kb);
                let key0 = ((seg.k_start + kb) * hkv + hk) * d;
                // K^T block (d x n) of head hk's [d, total_k] slab
                let kt_blk = Mat { ptr: kt[hk * d * tk + seg.k_start + kb..].as_ptr(), rs: tk as isize, cs: 1 };
                let v_blk = Mat { ptr: vf[key0..].as_ptr(), rs: kv_rs, cs: 1 };
                matmul(&mut sc.s, n, rows, n, d, qblk, kt_blk, 1.0, false);
                online_softmax_rows(&mut sc.s[..rows * n], n, n, &sc.los, &sc.lims, kb, c, &mut sc.m[..rows], &mut sc.l[..rows], &mut sc.o[..rows * d], d);
                if exact_pv {
                    pv_rows(&mut sc.o[..rows * d], d, &sc.s[..rows * n], n, &sc.los, &sc.lims, kb, &vf[key0..], hkv * d, 1.0);
                } else {
                    matmul(&mut sc.o, d, rows, d, n, Mat::rows(&sc.s, n), v_blk, 1.0, true);
                }
            }

            // SAFETY: segments own disjoint query rows, so (row, head) ranges of tasks are disjoint.
            let lse_dst = unsafe { lse_w.slice(h * tq + row0, rows) };
            finish_rows(&sc.o, d, &sc.m, &sc.l, rows, d, &out_w, lse_dst, |i| ((row0 + i) * hq + h) * d);
        },
    );
    ForwardOutput { out: from_f32_vec(out, spec.dtype), lse }
}

/// True when no value is NaN or +-Inf.
pub(crate) fn all_finite(x: &[f32]) -> bool {
    x.par_chunks(1 << 15).all(finite)
}

/// True when no value of `x` is NaN or +-Inf (one thread; [`all_finite`] for large slices).
pub(crate) fn finite(x: &[f32]) -> bool {
    x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff)) < 0x7f80_0000
}

/// `o[i] += alpha * sum_j p[i, j] v[j]` over row i's keys `[los[i] - kb, his[i] - kb)` only
/// (clamped to `[0, n)`); `v` row j at `j * v_rs`. The exact (slow) product for inputs with NaN /
/// Inf, where a dense product's zeros of masked keys would turn 0 * Inf into NaN.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pv_rows(o: &mut [f32], d: usize, p: &[f32], n: usize, los: &[usize], his: &[usize], kb: usize, v: &[f32], v_rs: usize, alpha: f32) {
    for (i, orow) in o.chunks_exact_mut(d).enumerate() {
        let hi = his[i].saturating_sub(kb).min(n);
        let lo = los[i].saturating_sub(kb).min(hi);
        for j in lo..hi {
            let pij = alpha * p[i * n + j];
            for (x, &y) in orow.iter_mut().zip(&v[j * v_rs..j * v_rs + d]) {
                *x = pij.mul_add(y, *x);
            }
        }
    }
}

/// A varlen spec over segments `(q_len, k_len)` (tests of the CPU forward paths).
#[cfg(test)]
pub(crate) fn varlen_test_spec(segs: &[(usize, usize)], hq: usize, hkv: usize, d: usize, dt: crate::dtype::DType, causal: bool) -> AttnSpec {
    let (tq, tk): (usize, usize) = (segs.iter().map(|s| s.0).sum(), segs.iter().map(|s| s.1).sum());
    let mut cq = vec![0i32];
    let mut ck = vec![0i32];
    for s in segs {
        cq.push(cq.last().unwrap() + s.0 as i32);
        ck.push(ck.last().unwrap() + s.1 as i32);
    }
    let (mq, mk) = (segs.iter().map(|s| s.0).max().unwrap(), segs.iter().map(|s| s.1).max().unwrap());
    let qm = crate::spec::TensorMeta::new(&[tq, hq, d], dt);
    let km = crate::spec::TensorMeta::new(&[tk, hkv, d], dt);
    AttnSpec::varlen(&qm, &km, &km, &cq, &ck, mq, mk, None, causal).unwrap()
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::dtype::{DType, HostData};

    /// The AVX-512 tile path agrees with the gemm-crate path (both f32-accumulated) on shapes
    /// that exercise every tail: head dims off the 16/64 grid, lengths off the block grids,
    /// several key blocks, GQA, varlen with empty segments, both maskings, every dtype, and a
    /// second run on recycled (stale) buffers.
    #[test]
    fn tile_path_matches_gemm_path() {
        if !kernel::available() {
            return;
        }
        // (segments as (q_len, k_len), heads_q, heads_kv, head_dim)
        type Case<'a> = (&'a [(usize, usize)], usize, usize, usize);
        let cases: &[Case] = &[
            (&[(1100, 1100)], 2, 1, 128),
            (&[(300, 1300), (1, 1), (0, 5), (77, 0), (129, 200)], 4, 2, 80),
            (&[(200, 200)], 2, 2, 200),
            (&[(64, 64), (513, 700)], 3, 3, 40),
            (&[(5, 5)], 1, 1, 1),
        ];
        for (ci, &(segs, hq, hkv, d)) in cases.iter().enumerate() {
            for dt in [DType::F32, DType::F16, DType::BF16] {
                for causal in [true, false] {
                    let spec = varlen_test_spec(segs, hq, hkv, d, dt, causal);
                    let (tq, tk) = (spec.dims.total_q, spec.dims.total_k);
                    let gen = |n: usize, seed: usize| -> HostData {
                        let x: Vec<f32> = (0..n).map(|i| (((i + seed) * 2654435761usize) % 2001) as f32 / 1000.0 - 1.0).collect();
                        HostData::from_f32(dt, &x)
                    };
                    let (q, k, v) = (gen(tq * hq * d, 1 + ci), gen(tk * hkv * d, 7), gen(tk * hkv * d, 13));
                    let want = forward_gemm(&spec, q.view(), k.view(), v.view());
                    for _ in 0..2 {
                        let got = forward_tiles(&spec, q.view(), k.view(), v.view());
                        let (a, b) = (got.out.to_f32_vec(), want.out.to_f32_vec());
                        let tol = if dt == DType::F32 { 2e-5 } else { 1e-2 };
                        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "case {ci} {dt:?} causal={causal}: out[{i}] {x} vs {y}");
                        }
                        for (i, (x, y)) in got.lse.iter().zip(&want.lse).enumerate() {
                            assert!(x == y || (x - y).abs() <= 1e-5 * (1.0 + y.abs()), "case {ci} {dt:?} causal={causal}: lse[{i}] {x} vs {y}");
                        }
                    }
                }
            }
        }
    }
}
