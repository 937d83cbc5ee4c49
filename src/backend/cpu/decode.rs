//! CPU forward of decode-sized calls: every segment has at most [`DECODE_ROWS`] query rows x GQA
//! heads (a decode step: one query row per sequence). The forward's other paths run one task
//! per (query block, query head), so each of a kv head's `group` query heads reads that head's
//! K and V again, and the tile path first packs all of K and V. At one row per task, those
//! reads and the packing are the whole cost: B=32 Sk=2K, 32 / 8 heads, d128, f32 took about 4x
//! torch's SDPA time on two cores (bench/results/cpu-2026-11-30-decode).
//!
//! Here one task per (segment, kv head) takes the segment's rows of all `group` query heads
//! together, and reads K and V once:
//! - in place for f32 (token-major, no packing); 16-bit K / V are widened a 512-key block at a
//!   time;
//! - with software prefetches a few key rows ahead (the rows are `heads_kv * d` apart);
//! - four rows' dot products share each key load.
//!
//! It keeps the gemm path's blocked online softmax and NaN / Inf policy: a V block holding a NaN
//! or Inf takes the row-by-row P V over each row's own keys, as the gemm path does for such a V.

use rayon::prelude::*;

use super::forward::{finish_rows, finite, online_softmax_rows, pv_rows, row_bounds, BK};
use super::layout::{from_f32_vec, to_f32_cow, SharedMut};
use super::simd::{dot, hsum, multiversion, Widen, LANES};
use crate::backend::ForwardOutput;
use crate::dtype::HostView;
use crate::spec::AttnSpec;

/// The most query rows x GQA heads a segment may have for this path.
pub(crate) const DECODE_ROWS: usize = 32;

/// Whether every segment of `spec` is decode-sized.
pub(crate) fn is_decode(spec: &AttnSpec) -> bool {
    let g = spec.dims.group_size().max(1);
    !spec.segments.is_empty() && spec.segments.iter().all(|s| s.q_len * g <= DECODE_ROWS)
}

struct DecodeScratch {
    q: Vec<f32>,
    s: Vec<f32>,
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    los: Vec<usize>,
    his: Vec<usize>,
    tok_lo: Vec<usize>,
    tok_hi: Vec<usize>,
    kbuf: Vec<f32>,
    vbuf: Vec<f32>,
}

impl DecodeScratch {
    fn new(d: usize) -> Self {
        let r = DECODE_ROWS;
        DecodeScratch {
            q: vec![0.0; r * d],
            s: vec![0.0; r * BK],
            o: vec![0.0; r * d],
            m: vec![0.0; r],
            l: vec![0.0; r],
            los: Vec::with_capacity(r),
            his: Vec::with_capacity(r),
            tok_lo: Vec::with_capacity(r),
            tok_hi: Vec::with_capacity(r),
            kbuf: Vec::new(),
            vbuf: Vec::new(),
        }
    }
}

/// Keys a chunk of a split (segment, kv head) task takes at least: two blocks of [`BK`].
const CHUNK_MIN: usize = 2 * BK;

/// Chunks each (segment, kv head) task's keys are split into: 1 when the tasks alone give every
/// thread work; else enough for about two per thread, none shorter than [`CHUNK_MIN`] keys (one
/// long sequence with few kv heads would otherwise leave most threads idle).
fn chunks_per_task(spec: &AttnSpec, threads: usize) -> usize {
    let tasks = spec.segments.len() * spec.dims.heads_kv;
    if tasks == 0 || tasks >= threads {
        return 1;
    }
    let longest = spec.segments.iter().map(|s| s.k_len).max().unwrap_or(0);
    (2 * threads).div_ceil(tasks).min(longest.div_ceil(CHUNK_MIN)).max(1)
}

/// The forward of a decode-sized `spec` ([`is_decode`]). Packed row `i` of a (segment, kv head)
/// task is query row `i / group` of the segment with query head `hk * group + i % group`. With
/// fewer tasks than threads, each task's keys are split into chunks ([`chunks_per_task`]) whose
/// partial rows are merged by their maxima and sums, as the GPU's split-K combine does.
pub(crate) fn forward_decode(spec: &AttnSpec, q: HostView, k: HostView, v: HostView) -> ForwardOutput {
    forward_decode_chunks(spec, q, k, v, chunks_per_task(spec, rayon::current_num_threads()))
}

/// [`forward_decode`] with `chunks` key chunks per task (1: no split).
fn forward_decode_chunks(spec: &AttnSpec, q: HostView, k: HostView, v: HostView, chunks: usize) -> ForwardOutput {
    let dm = spec.dims;
    let (d, tq, hq, hkv) = (dm.head_dim, dm.total_q, dm.heads_q, dm.heads_kv);
    let g = dm.group_size().max(1);
    // q is small; 16-bit K / V are widened a block at a time inside each task (`block_rows`), so
    // their bytes are read once
    let qf = to_f32_cow(q);
    let mut out = vec![0.0f32; dm.q_len()];
    let mut lse = vec![f32::INFINITY; dm.lse_len()];
    let out_w = SharedMut::new(&mut out);
    let lse_w = SharedMut::new(&mut lse);
    let c = spec.scale * std::f32::consts::LOG2_E;

    let tasks: Vec<(usize, usize)> = (0..spec.segments.len()).flat_map(|si| (0..hkv).map(move |hk| (si, hk))).collect();
    // rows to their (token, head) places; the lse of packed row i at [h * total_q + token]
    let write = |si: usize, hk: usize, o: &[f32], m: &[f32], l: &[f32]| {
        let seg = &spec.segments[si];
        for i in 0..seg.q_len * g {
            let (tok, h) = (seg.q_start + i / g, hk * g + i % g);
            // SAFETY: a (token, head) belongs to one segment and one kv head: one task writes it.
            let lse_dst = unsafe { lse_w.slice(h * tq + tok, 1) };
            finish_rows(&o[i * d..(i + 1) * d], d, &m[i..i + 1], &l[i..i + 1], 1, d, &out_w, lse_dst, |_| (tok * hq + h) * d);
        }
    };
    if chunks <= 1 {
        tasks.par_iter().for_each_init(
            || DecodeScratch::new(d),
            |sc, &(si, hk)| {
                let (k_lo, k_hi) = task_rows(sc, spec, &qf, si, hk);
                run_keys(sc, spec, k, v, si, hk, k_lo, k_hi, c);
                write(si, hk, &sc.o, &sc.m, &sc.l);
            },
        );
    } else {
        // each chunk's partial rows (o, m, l), then their merge per task
        let part = DECODE_ROWS * (d + 2);
        let mut parts = vec![0.0f32; tasks.len() * chunks * part];
        parts.par_chunks_mut(part).enumerate().for_each_init(
            || DecodeScratch::new(d),
            |sc, (x, pt)| {
                let (si, hk) = tasks[x / chunks];
                let (k_lo, k_hi) = task_rows(sc, spec, &qf, si, hk);
                let per = (k_hi - k_lo).div_ceil(BK).div_ceil(chunks) * BK;
                let a = (k_lo + (x % chunks) * per).min(k_hi);
                run_keys(sc, spec, k, v, si, hk, a, (a + per).min(k_hi), c);
                let rows = spec.segments[si].q_len * g;
                pt[..rows * d].copy_from_slice(&sc.o[..rows * d]);
                pt[DECODE_ROWS * d..DECODE_ROWS * d + rows].copy_from_slice(&sc.m[..rows]);
                pt[DECODE_ROWS * (d + 1)..DECODE_ROWS * (d + 1) + rows].copy_from_slice(&sc.l[..rows]);
            },
        );
        tasks.par_iter().enumerate().for_each_init(
            || DecodeScratch::new(d),
            |sc, (ti, &(si, hk))| {
                let rows = spec.segments[si].q_len * g;
                let own = &parts[ti * chunks * part..(ti + 1) * chunks * part];
                merge_chunks(own, part, rows, d, &mut sc.o, &mut sc.m, &mut sc.l);
                write(si, hk, &sc.o, &sc.m, &sc.l);
            },
        );
    }
    ForwardOutput { out: from_f32_vec(out, spec.dtype), lse }
}

/// Packs the rows of task (segment `si`, kv head `hk`) into `sc.q` (token-major, the group's
/// heads fastest) with each row's key bounds (`sc.los`, `sc.his`); returns the keys any row sees.
fn task_rows(sc: &mut DecodeScratch, spec: &AttnSpec, qf: &[f32], si: usize, hk: usize) -> (usize, usize) {
    let (d, hq) = (spec.dims.head_dim, spec.dims.heads_q);
    let g = spec.dims.group_size().max(1);
    let seg = &spec.segments[si];
    let rows = seg.q_len * g;
    for i in 0..rows {
        let src = ((seg.q_start + i / g) * hq + hk * g + i % g) * d;
        sc.q[i * d..(i + 1) * d].copy_from_slice(&qf[src..src + d]);
    }
    let (k_lo, k_hi) = row_bounds(spec, seg, 0, seg.q_len, &mut sc.tok_lo, &mut sc.tok_hi);
    sc.los.clear();
    sc.his.clear();
    for i in 0..rows {
        sc.los.push(sc.tok_lo[i / g]);
        sc.his.push(sc.tok_hi[i / g]);
    }
    (k_lo, k_hi)
}

/// The packed rows of [`task_rows`] over keys `[k_lo, k_hi)` of the segment: the online softmax
/// state `sc.o` (unnormalised), `sc.m` (base-2 maxima) and `sc.l` (sums), from zero.
#[allow(clippy::too_many_arguments)]
fn run_keys(sc: &mut DecodeScratch, spec: &AttnSpec, k: HostView, v: HostView, si: usize, hk: usize, k_lo: usize, k_hi: usize, c: f32) {
    let (d, hkv) = (spec.dims.head_dim, spec.dims.heads_kv);
    let seg = &spec.segments[si];
    let rows = seg.q_len * spec.dims.group_size().max(1);
    let kv_rs = hkv * d;
    sc.o[..rows * d].fill(0.0);
    sc.m[..rows].fill(f32::NEG_INFINITY);
    sc.l[..rows].fill(0.0);
    for kb in (k_lo..k_hi).step_by(BK) {
        let n = BK.min(k_hi - kb);
        let key0 = ((seg.k_start + kb) * hkv + hk) * d;
        // the keys' rows (n x d at stride ks: in place for f32, else widened)
        let (k_blk, ks) = block_rows(k, key0, n, kv_rs, d, &mut sc.kbuf);
        scores_block(&mut sc.s, n, &sc.q, rows, k_blk, ks, n, d);
        online_softmax_rows(&mut sc.s[..rows * n], n, n, &sc.los, &sc.his, kb, c, &mut sc.m[..rows], &mut sc.l[..rows],
            &mut sc.o[..rows * d], d);
        // the block's V rows (n x d at stride kv_rs): with a NaN or Inf, P V row by row over
        // each row's own keys (a masked key's zero times Inf would be NaN)
        let (v_blk, vs) = block_rows(v, key0, n, kv_rs, d, &mut sc.vbuf);
        if (0..n).all(|j| finite(&v_blk[j * vs..j * vs + d])) {
            pv_block(&mut sc.o, d, &sc.s, n, rows, v_blk, vs, n);
        } else {
            pv_rows(&mut sc.o[..rows * d], d, &sc.s[..rows * n], n, &sc.los, &sc.his, kb, v_blk, vs, 1.0);
        }
    }
}

/// Merges a task's chunks (each `part` floats: `DECODE_ROWS` rows of o, then m, then l) into
/// `o`, `m`, `l` for its `rows` rows: each chunk weighted by `2^(m_c - max m)`. A chunk whose row
/// saw no key (m = -inf) adds nothing; a row no chunk saw keeps l = 0 (zero output, lse +inf).
fn merge_chunks(parts: &[f32], part: usize, rows: usize, d: usize, o: &mut [f32], m: &mut [f32], l: &mut [f32]) {
    let chunks = parts.len() / part;
    for i in 0..rows {
        let mc = |c: usize| parts[c * part + DECODE_ROWS * d + i];
        let top = (0..chunks).map(mc).fold(f32::NEG_INFINITY, f32::max);
        let oi = &mut o[i * d..(i + 1) * d];
        oi.fill(0.0);
        let (mut li, mut mi) = (0.0f32, f32::NEG_INFINITY);
        if top > f32::NEG_INFINITY {
            for c in (0..chunks).filter(|&c| mc(c) > f32::NEG_INFINITY) {
                let w = (mc(c) - top).exp2();
                li += w * parts[c * part + DECODE_ROWS * (d + 1) + i];
                for (x, &y) in oi.iter_mut().zip(&parts[c * part + i * d..c * part + (i + 1) * d]) {
                    *x = w.mul_add(y, *x);
                }
            }
            mi = top;
        }
        m[i] = mi;
        l[i] = li;
    }
}

multiversion! {
    /// `s[i * lds + j] = q_i . k_j` for rows `i < rows` (`q` row-major, `d` columns) and keys
    /// `j < n` (key j's `d` values at `k[j * ks..]`): each key row is read once for all rows.
    #[allow(clippy::too_many_arguments)]
    fn scores_block(s: &mut [f32], lds: usize, q: &[f32], rows: usize, k: &[f32], ks: usize, n: usize, d: usize) {
        // four rows at a time share each load of a key's values (d a multiple of 16 here)
        let quads = if d.is_multiple_of(LANES) { rows / 4 } else { 0 };
        // two keys at a time share each load of the rows' values (an odd last key is paired with
        // itself and stored once)
        let pairs = if quads > 0 { n.div_ceil(2) } else { 0 };
        for jp in 0..pairs {
            let (j, j1) = (2 * jp, (2 * jp + 1).min(n - 1));
            let (k0, k1) = (&k[j * ks..j * ks + d], &k[j1 * ks..j1 * ks + d]);
            prefetch_row(k, (j + AHEAD) * ks, d);
            prefetch_row(k, (j + 1 + AHEAD) * ks, d);
            for r in 0..quads {
                let i = 4 * r;
                let mut acc = [[[0.0f32; LANES]; 4]; 2];
                for c in (0..d).step_by(LANES) {
                    let (kc0, kc1) = (&k0[c..c + LANES], &k1[c..c + LANES]);
                    for a in 0..4 {
                        let qc = &q[(i + a) * d + c..(i + a) * d + c + LANES];
                        for e in 0..LANES {
                            acc[0][a][e] = qc[e].mul_add(kc0[e], acc[0][a][e]);
                            acc[1][a][e] = qc[e].mul_add(kc1[e], acc[1][a][e]);
                        }
                    }
                }
                for a in 0..4 {
                    s[(i + a) * lds + j] = hsum(&acc[0][a]);
                    if j1 > j {
                        s[(i + a) * lds + j1] = hsum(&acc[1][a]);
                    }
                }
            }
        }
        for j in 0..n {
            let kr = &k[j * ks..j * ks + d];
            if quads == 0 {
                prefetch_row(k, (j + AHEAD) * ks, d);
            }
            for i in 4 * quads..rows {
                s[i * lds + j] = dot(&q[i * d..i * d + d], kr);
            }
        }
    }
}

multiversion! {
    /// `o_i += sum_j p[i * lds + j] v_j` for rows `i < rows` (`o` row-major, `d` columns) and keys
    /// `j < n` (key j's `d` values at `v[j * vs..]`): each value row is read once for all rows.
    #[allow(clippy::too_many_arguments)]
    fn pv_block(o: &mut [f32], d: usize, p: &[f32], lds: usize, rows: usize, v: &[f32], vs: usize, n: usize) {
        // four rows at a time keep a 16-column strip of O in registers over the block's keys (the
        // same fused multiply-adds in the same key order as a key at a time, which loaded and
        // stored each row of O once a key); the first strip's pass asks for the value rows ahead
        let quads = if d.is_multiple_of(LANES) { rows / 4 } else { 0 };
        for r in 0..quads {
            let i = 4 * r;
            for c in (0..d).step_by(LANES) {
                let mut acc = [[0.0f32; LANES]; 4];
                for (a, row) in acc.iter_mut().enumerate() {
                    row.copy_from_slice(&o[(i + a) * d + c..(i + a) * d + c + LANES]);
                }
                for j in 0..n {
                    if r == 0 && c == 0 {
                        prefetch_row(v, (j + AHEAD) * vs, d);
                    }
                    let vc = &v[j * vs + c..j * vs + c + LANES];
                    for (a, row) in acc.iter_mut().enumerate() {
                        let w = p[(i + a) * lds + j];
                        for e in 0..LANES {
                            row[e] = w.mul_add(vc[e], row[e]);
                        }
                    }
                }
                for (a, row) in acc.iter().enumerate() {
                    o[(i + a) * d + c..(i + a) * d + c + LANES].copy_from_slice(row);
                }
            }
        }
        for j in 0..n {
            let vr = &v[j * vs..j * vs + d];
            if quads == 0 {
                prefetch_row(v, (j + AHEAD) * vs, d);
            }
            for i in 4 * quads..rows {
                let w = p[i * lds + j];
                for (x, &y) in o[i * d..i * d + d].iter_mut().zip(vr) {
                    *x = w.mul_add(y, *x);
                }
            }
        }
    }
}

/// Rows `at / stride ..` (`n` rows of `d` values, `stride` elements apart, from element `at`) of
/// `x` as f32: the f32 input itself (stride `stride`), or 16-bit values widened into `buf` (stride
/// `d`).
fn block_rows<'a>(x: HostView<'a>, at: usize, n: usize, stride: usize, d: usize, buf: &'a mut Vec<f32>) -> (&'a [f32], usize) {
    fn widen<T: Widen>(x: &[T], at: usize, n: usize, stride: usize, d: usize, buf: &mut Vec<f32>) {
        buf.resize(n * d, 0.0);
        for j in 0..n {
            prefetch_row(x, at + (j + AHEAD) * stride, d);
            T::widen(&x[at + j * stride..at + j * stride + d], &mut buf[j * d..(j + 1) * d]);
        }
    }
    match x {
        HostView::F32(s) => (&s[at..at + (n - 1) * stride + d], stride),
        HostView::F16(s) => {
            widen(s, at, n, stride, d, buf);
            (&buf[..n * d], d)
        }
        HostView::BF16(s) => {
            widen(s, at, n, stride, d, buf);
            (&buf[..n * d], d)
        }
    }
}

/// Key rows ahead of the one in use whose cache lines are requested: the rows are `heads_kv * d`
/// apart (token-major K / V), a stride the hardware prefetchers follow poorly.
const AHEAD: usize = 4;

/// Asks for the cache lines of `x[at..at + len]` (nothing past the slice's end).
#[inline(always)]
fn prefetch_row<T>(x: &[T], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let end = (at + len).min(x.len());
        let step = (64 / std::mem::size_of::<T>()).max(1);
        let mut i = at;
        while i < end {
            // SAFETY: `i < x.len()`; a prefetch reads nothing architecturally.
            unsafe { std::arch::x86_64::_mm_prefetch(x.as_ptr().add(i) as *const i8, std::arch::x86_64::_MM_HINT_T0) };
            i += step;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (x, at, len);
}


#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{DType, HostData};
    use crate::spec::Window;

    /// `pv_block` (O strips in registers for four rows at a time) gives bit for bit what one key
    /// at a time does (the same fused multiply-adds in key order), for every row count, head dims
    /// with and without whole 16-column strips, and strided value rows.
    #[test]
    fn pv_block_is_a_key_at_a_time_bit_for_bit() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        for (rows, d, n, vs_extra) in [(1, 128, 37, 0), (4, 128, 512, 0), (6, 64, 100, 64), (9, 48, 19, 16), (8, 40, 33, 8), (3, 16, 1, 0)] {
            let (lds, vs) = (n + 3, d + vs_extra);
            let p: Vec<f32> = (0..rows * lds).map(|_| next()).collect();
            let v: Vec<f32> = (0..n * vs).map(|_| next()).collect();
            let o0: Vec<f32> = (0..rows * d).map(|_| next()).collect();
            let mut want = o0.clone();
            for j in 0..n {
                for i in 0..rows {
                    let w = p[i * lds + j];
                    for c in 0..d {
                        want[i * d + c] = w.mul_add(v[j * vs + c], want[i * d + c]);
                    }
                }
            }
            let mut got = o0.clone();
            pv_block(&mut got, d, &p, lds, rows, &v, vs, n);
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "rows {rows} d {d} n {n}");
        }
    }

    /// The decode path against the f64 reference and the gemm path, on fresh non-zero inputs: one
    /// and two query rows per sequence, GQA 8 / 2 and MHA, varlen keys (0, 1, lengths off the
    /// 512-key block, several blocks), causal or not, a sliding window, every dtype, and an Inf / NaN
    /// in V (the row-by-row P V: only the rows that see it turn NaN, as on the gemm path).
    #[test]
    fn decode_path_matches_the_reference_and_the_gemm_path() {
        type Case<'a> = (&'a [(usize, usize)], usize, usize, usize);
        let cases: &[Case] = &[
            (&[(1, 700), (1, 1), (1, 0), (1, 1300)], 8, 2, 64),
            (&[(2, 530), (2, 2), (1, 40)], 8, 2, 40),
            (&[(1, 1025), (1, 3)], 4, 4, 128),
            (&[(3, 600)], 8, 1, 16),
            // odd key counts in a block (517 = 512 + 5; 3): the scores' key pairs and their last key
            (&[(1, 517), (2, 3)], 16, 4, 32),
        ];
        for (ci, &(segs, hq, hkv, d)) in cases.iter().enumerate() {
            for dt in [DType::F32, DType::BF16, DType::F16] {
                let window_100_0 = Window { left: Some(100), right: Some(0) };
                for (causal, window) in [(false, Window::NONE), (true, Window::NONE), (false, window_100_0)] {
                    for bad in [None, Some(f32::INFINITY), Some(f32::NAN)] {
                        let mut spec = super::super::forward::varlen_test_spec(segs, hq, hkv, d, dt, causal);
                        spec.window = window;
                        let (tq, tk) = (spec.dims.total_q, spec.dims.total_k);
                        assert!(is_decode(&spec), "case {ci}");
                        let gen = |n: usize, seed: usize| -> Vec<f32> {
                            (0..n).map(|i| (((i * 7 + seed) * 2654435761usize) % 2001) as f32 / 1000.0 - 1.0).collect()
                        };
                        let (qx, kx, mut vx) = (gen(tq * hq * d, 3 + ci), gen(tk * hkv * d, 11), gen(tk * hkv * d, 17));
                        if let Some(b) = bad {
                            // key 5 of the first segment, kv head 0, channel 1
                            if segs[0].1 > 5 {
                                vx[5 * hkv * d + 1] = b;
                            }
                        }
                        let (q, k, v) = (HostData::from_f32(dt, &qx), HostData::from_f32(dt, &kx), HostData::from_f32(dt, &vx));
                        let gemm = super::super::forward::forward_gemm(&spec, q.view(), k.view(), v.view());
                        // unsplit, and each task's keys in three chunks merged (an empty chunk at 700 keys)
                        for chunks in [1, 3] {
                            let got = forward_decode_chunks(&spec, q.view(), k.view(), v.view(), chunks);
                            let f64s = |h: &HostData| -> Vec<f64> { h.view().to_f32_vec().iter().map(|&x| x as f64).collect() };
                            let (want, want_lse) = crate::reference::forward_f64(&spec, &f64s(&q), &f64s(&k), &f64s(&v));
                            let (a, b) = (got.out.to_f32_vec(), gemm.out.to_f32_vec());
                            let tol = if dt == DType::F32 { 2e-5 } else { 1e-2 };
                            for i in 0..a.len() {
                                let (x, y, r) = (a[i], b[i], want[i]);
                                let what = format!("case {ci} {dt:?} causal={causal} window={window:?} bad={bad:?} chunks={chunks} out[{i}]");
                                assert_eq!(x.is_nan(), y.is_nan(), "{what}: {x} vs gemm {y}");
                                assert_eq!(x.is_nan(), r.is_nan(), "{what}: {x} vs f64 {r}");
                                if x.is_infinite() || y.is_infinite() || r.is_infinite() {
                                    assert!(x == y && x as f64 == r, "{what}: {x} vs gemm {y}, f64 {r}");
                                } else if !x.is_nan() {
                                    assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{what}: {x} vs gemm {y}");
                                    assert!((x as f64 - r).abs() <= tol as f64 * (1.0 + r.abs()), "{what}: {x} vs f64 {r}");
                                }
                            }
                            for (i, (x, y)) in got.lse.iter().zip(&want_lse).enumerate() {
                                let (x, y) = (*x as f64, *y);
                                let ok = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= 1e-4 * (1.0 + y.abs());
                                assert!(ok, "case {ci} {dt:?} causal={causal} window={window:?} bad={bad:?} chunks={chunks}: lse[{i}] {x} vs {y}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Chunks per task: none while the tasks alone fill the threads; else about two a thread,
    /// none under CHUNK_MIN keys.
    #[test]
    fn decode_tasks_split_only_where_threads_would_idle() {
        let spec = |segs: &[(usize, usize)], hkv: usize| super::super::forward::varlen_test_spec(segs, 8, hkv, 64, DType::F32, false);
        assert_eq!(chunks_per_task(&spec(&[(1, 32768)], 8), 2), 1);
        assert_eq!(chunks_per_task(&spec(&[(1, 32768)], 8), 16), 4);
        assert_eq!(chunks_per_task(&spec(&[(1, 32768)], 1), 2), 4);
        assert_eq!(chunks_per_task(&spec(&[(1, 700)], 1), 16), 1);
        assert_eq!(chunks_per_task(&spec(&[(1, 3000), (1, 10)], 1), 16), 3);
    }
}

