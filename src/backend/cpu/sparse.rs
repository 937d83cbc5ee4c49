//! CPU block-sparse attention: the dense gemm path's online softmax, visiting only the listed key
//! blocks (skipped, not masked). Runs of consecutive listed blocks are multiplied as one span (up
//! to `BK` keys), so 100% kept does the dense path's work; scattered spans are gathered (K and V
//! copied side by side, up to `BK` keys) into one product. f32 accumulation, rayon tasks.
//!
//! - forward: one task per (sequence, query head, query block or run of consecutive query blocks
//!   with equal lists, <= `BQ` rows);
//! - backward: FlashAttention-2's five products per (query rows, key block) pair, as the dense
//!   backward (`backward::block_pair`): tasks per (kv head, chunk of the (sequence, key block)
//!   list) walk the transposed index (query blocks listing the key block), own those keys' dK/dV
//!   and add dQ into the chunk's own buffer; the buffers are summed in chunk order, so the result
//!   is deterministic (fixed order, no atomics) and independent of the thread count;
//! - INT8 QK^T (forward only): symmetric int8 Q and (smoothed) K with per-group f32 scales (see
//!   [`crate::sparse::QuantGran`]): scale = amax / 127, x -> round-half-to-even(x * (127 / amax))
//!   (CUDA's `rint`, the same f32 operations as the CUDA quantisation kernel), exact i32 dot
//!   products, P rounded to the input dtype before P.V. f32 inputs take the same path (emulated:
//!   no CUDA kernel serves f32).
//! - FP8 P.V (`Int8Qk::pv_fp8`, only with INT8 Q K^T, forward only; SageAttention2's P.V), what the
//!   CUDA kernel implements, in f32 unless said otherwise:
//!   - V per (sequence, kv head, channel `c`): `amax[c]` = max over the sequence's keys of `|v|`
//!     (NaN-ignoring, as CUDA's `fmaxf`); `(scale, inv) = (amax / 448, 448 / amax)`, or `(1, 0)`
//!     when `amax == 0` or `448 / amax` overflows to +inf (`amax` below ~1.3e-36); `v_q =
//!     e4m3(v * inv)` (decoded to f32 here).
//!   - `e4m3(x)` ([`crate::fp8::e4m3_round`]) is PTX `cvt.rn.satfinite.e4m3x2.f32`: nearest, ties
//!     to even, subnormals down to 2^-9, magnitudes from 464 up and +-Inf saturate to +-448, NaN
//!     stays NaN, the sign of zero kept.
//!   - keys in tiles of [`TILE_KEYS`] (64) counted from each listed key block's start (the last
//!     tile of a block may be shorter), key blocks ascending, tiles in order (the CPU clips a tile
//!     at the last key a row of its task sees: nothing changes, the keys past it are invisible to
//!     every row). Per tile: the scores `s` (INT8, as above); one online-softmax step in base 2
//!     (`c = softmax_scale * log2(e)`, the running row max `m` moves per tile as in the kernel's
//!     64-key tiles, `alpha = exp2(m_old - m)`); `P = exp2(c * s - m)` (<= 1, 0 for an invisible
//!     key); `acc[c] = acc[c] * alpha + sum_j e4m3(256 * P[j]) * v_q[j, c]` (256 = [`FP8_P_SCALE`];
//!     the products are exact, the sum f32) and `l = l * alpha + 256 * sum_j P[j]` (the unrounded P).
//!   - `out[c] = acc[c] * (1 / l) * scale[c]` (here `1 / (256 * l')` with `l' = sum P`, the same f32
//!     value: scaling by a power of two is exact); LSE = `ln 2 * (m + log2(l / 256))`, the true LSE
//!     (the 256 does not reach it; plus the smoothing correction); rows that see no key: zero
//!     output, LSE +inf.
//!
//!   The exact and INT8-only paths are untouched by this option.
//! - A V holding a NaN or an Inf takes the exact path with either option (CUDA's non-finite-v
//!   route: the unquantised attention, whose NaN / Inf reach only the rows that see them).

use rayon::prelude::*;

use super::backward::{block_pair, key_chunks, prepare, run_tasks, BlockPair, Products, NO_NEXT};
use super::forward::{finish_rows, online_softmax_block, row_limits, Scratch, BK, BQ};
use super::layout::{from_f32_vec, matmul, to_f32_cow, to_head_major, transpose_per_head, Mat, SharedMut};
use crate::backend::{BackwardInputs, ForwardOutput, Gradients};
use crate::dtype::{DType, HostView};
use crate::fp8::e4m3_round;
use crate::fp8::E4M3_MAX;
use crate::sparse::{Int8Qk, FP8_P_SCALE, TILE_KEYS};
use crate::spec::SparseView;

/// Key spans `[lo, hi)` (inside the sequence) of the kept blocks `kept` (ascending), clipped to
/// `hi_limit`, with consecutive blocks merged and every span at most `max_len` long.
fn spans(kept: &[u32], k_block: usize, hi_limit: usize, max_len: usize, out: &mut Vec<(usize, usize)>) {
    out.clear();
    let mut cur: Option<(usize, usize)> = None;
    for &kb in kept {
        let lo = kb as usize * k_block;
        if lo >= hi_limit {
            break;
        }
        let hi = (lo + k_block).min(hi_limit);
        cur = match cur {
            Some((a, b)) if b == lo => Some((a, hi)),
            Some(s) => {
                out.push(s);
                Some((lo, hi))
            }
            None => Some((lo, hi)),
        };
    }
    out.extend(cur);
    // split long spans
    let n = out.len();
    for i in 0..n {
        let (a, b) = out[i];
        if b - a > max_len {
            out[i] = (a, a + max_len);
            let mut x = a + max_len;
            while x < b {
                out.push((x, (x + max_len).min(b)));
                x += max_len;
            }
        }
    }
    out.sort_unstable();
}

/// Consecutive groups of `spans` (each at most `max_len` long) holding at most `max_len` keys
/// together: `(first span, end span)` index pairs. A group is gathered into one product.
fn chunks(spans: &[(usize, usize)], max_len: usize, out: &mut Vec<(usize, usize)>) {
    out.clear();
    let (mut start, mut total) = (0, 0);
    for (i, &(lo, hi)) in spans.iter().enumerate() {
        if total + (hi - lo) > max_len && i > start {
            out.push((start, i));
            start = i;
            total = 0;
        }
        total += hi - lo;
    }
    if start < spans.len() {
        out.push((start, spans.len()));
    }
}

/// Per row, how many of the gathered keys of `group` (ascending spans) it sees: causal visibility
/// is a prefix in key order, so it stays a prefix of the gathered columns.
fn gathered_limits(lims: &[usize], group: &[(usize, usize)], out: &mut Vec<usize>) {
    out.clear();
    out.extend(lims.iter().map(|&lim| group.iter().map(|&(lo, hi)| lim.clamp(lo, hi) - lo).sum::<usize>()));
}

/// Gather buffers of one task: K (as K^T, `d x n`, or as rows, `n x d`) and V rows (`n x d`).
struct Gather {
    k: Vec<f32>,
    v: Vec<f32>,
    lims: Vec<usize>,
    spans: Vec<(usize, usize)>,
    chunks: Vec<(usize, usize)>,
}

impl Gather {
    fn new(d: usize) -> Self {
        Gather { k: vec![0.0; BK * d], v: vec![0.0; BK * d], lims: Vec::with_capacity(BQ), spans: Vec::new(), chunks: Vec::new() }
    }
}

/// Row tasks (sequence, first row, rows, query head) of the forward and dQ: at most `BQ` rows
/// whose query blocks list the same key blocks (consecutive query blocks with equal lists share a
/// task, so 64-row blocks still make 128-row products where the pattern allows); most work first.
fn row_tasks(spec: SparseView) -> Vec<(usize, usize, usize, usize)> {
    let mut t: Vec<(usize, usize, usize, usize, usize)> = Vec::new();
    let hq = spec.attn.dims.heads_q;
    for (b, seg) in spec.attn.segments.iter().enumerate() {
        let qbn = seg.q_len.div_ceil(spec.q_block);
        for h in 0..hq {
            let hi = spec.index_head(h);
            let mut qb = 0;
            while qb < qbn {
                let kept = spec.index.kept(b, hi, qb);
                // extend over following blocks with the same list while the rows fit one task
                let mut end = qb + 1;
                while end < qbn && (end + 1 - qb) * spec.q_block <= BQ && spec.index.kept(b, hi, end) == kept {
                    end += 1;
                }
                let (r_lo, r_hi) = (qb * spec.q_block, (end * spec.q_block).min(seg.q_len));
                for r0 in (r_lo..r_hi).step_by(BQ) {
                    t.push((b, r0, BQ.min(r_hi - r0), h, kept.len()));
                }
                qb = end;
            }
        }
    }
    t.sort_by_key(|x| std::cmp::Reverse(x.4));
    t.into_iter().map(|(b, r0, rows, h, _)| (b, r0, rows, h)).collect()
}

/// Quantised operands of the INT8 option.
struct Quantized {
    /// Q int8, token-major `[total_q, heads_q, d]`, and its per-(head, row) scale `[heads_q, total_q]`.
    q: Vec<i8>,
    q_scale: Vec<f32>,
    /// smoothed K int8, head-major `[heads_kv, total_k, d]`, and its per-(head, key) scale.
    k: Vec<i8>,
    k_scale: Vec<f32>,
    /// LSE correction `softmax_scale * q . mean(K)` per `[heads_q, total_q]` (0 without smoothing).
    lse_shift: Vec<f32>,
}

fn quantize_groups(x: &[f32], rows: usize, d: usize, group_of: impl Fn(usize) -> usize, q_out: &mut [i8], s_out: &mut [f32]) {
    // rows of one group are not contiguous in general (per_thread): two passes over group ids
    let groups = (0..rows).map(&group_of).max().map_or(0, |g| g + 1);
    let mut amax = vec![0.0f32; groups];
    for r in 0..rows {
        let g = group_of(r);
        amax[g] = x[r * d..(r + 1) * d].iter().fold(amax[g], |m, v| m.max(v.abs()));
    }
    for r in 0..rows {
        let a = amax[group_of(r)];
        let (scale, inv) = if a > 0.0 { (a / 127.0, 127.0 / a) } else { (1.0, 0.0) };
        s_out[r] = scale;
        for (o, &v) in q_out[r * d..(r + 1) * d].iter_mut().zip(&x[r * d..(r + 1) * d]) {
            *o = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
        }
    }
}

fn quantize(spec: SparseView, opt: Int8Qk, q: HostView, k: HostView) -> Quantized {
    let a = &spec.attn;
    let dm = a.dims;
    let (d, tq, tk, hq, hkv) = (dm.head_dim, dm.total_q, dm.total_k, dm.heads_q, dm.heads_kv);
    let qh = to_head_major(q, tq, hq, d);
    let mut kh = to_head_major(k, tk, hkv, d);
    // K smoothing: subtract the per-(sequence, kv head) channel mean
    let mut means = vec![0.0f32; a.segments.len() * hkv * d];
    if opt.smooth_k {
        for (b, seg) in a.segments.iter().enumerate() {
            if seg.k_len == 0 {
                continue;
            }
            for h in 0..hkv {
                let mean = &mut means[(b * hkv + h) * d..][..d];
                let mut acc = vec![0.0f64; d];
                for t in seg.k_start..seg.k_start + seg.k_len {
                    for (s, &x) in acc.iter_mut().zip(&kh[(h * tk + t) * d..][..d]) {
                        *s += x as f64;
                    }
                }
                for (m, s) in mean.iter_mut().zip(&acc) {
                    *m = (*s / seg.k_len as f64) as f32;
                }
                for t in seg.k_start..seg.k_start + seg.k_len {
                    for (x, &m) in kh[(h * tk + t) * d..][..d].iter_mut().zip(mean.iter()) {
                        *x -= m;
                    }
                }
            }
        }
    }
    let mut qi = vec![0i8; qh.len()];
    let mut qs = vec![1.0f32; hq * tq];
    let mut ki = vec![0i8; kh.len()];
    let mut ks = vec![1.0f32; hkv * tk];
    let mut shift = vec![0.0f32; hq * tq];
    let gran = opt.gran;
    for (b, seg) in a.segments.iter().enumerate() {
        for h in 0..hq {
            let o = h * tq + seg.q_start;
            quantize_groups(&qh[o * d..(o + seg.q_len) * d], seg.q_len, d, |r| gran.q_group(r, spec.q_block), &mut qi[o * d..(o + seg.q_len) * d], &mut qs[o..o + seg.q_len]);
            if opt.smooth_k && seg.k_len > 0 {
                let mean = &means[(b * hkv + h / dm.group_size()) * d..][..d];
                for r in 0..seg.q_len {
                    let qr = &qh[(o + r) * d..][..d];
                    shift[o + r] = a.scale * qr.iter().zip(mean).map(|(x, y)| x * y).sum::<f32>();
                }
            }
        }
        for h in 0..hkv {
            let o = h * tk + seg.k_start;
            quantize_groups(&kh[o * d..(o + seg.k_len) * d], seg.k_len, d, |j| gran.k_group(j, spec.k_block), &mut ki[o * d..(o + seg.k_len) * d], &mut ks[o..o + seg.k_len]);
        }
    }
    // back to token-major for Q (the forward reads Q rows per head at stride heads*d)
    let mut qt = vec![0i8; qi.len()];
    for h in 0..hq {
        for t in 0..tq {
            qt[(t * hq + h) * d..][..d].copy_from_slice(&qi[(h * tq + t) * d..][..d]);
        }
    }
    Quantized { q: qt, q_scale: qs, k: ki, k_scale: ks, lse_shift: shift }
}

/// Columns `col0..col0 + n` of `s` (rows x `lds`) = dequantised int8 Q K^T for keys `key0..key0 + n`.
#[allow(clippy::too_many_arguments)]
fn qk_int8(s: &mut [f32], lds: usize, col0: usize, qz: &Quantized, hq: usize, tq: usize, tk: usize, d: usize, h: usize, hk: usize, row0: usize, rows: usize, key0: usize, n: usize) {
    for i in 0..rows {
        let t = row0 + i;
        let qr = &qz.q[(t * hq + h) * d..][..d];
        let sq = qz.q_scale[h * tq + t];
        let srow = &mut s[i * lds + col0..i * lds + col0 + n];
        for (j, o) in srow.iter_mut().enumerate() {
            let kk = hk * tk + key0 + j;
            let kr = &qz.k[kk * d..][..d];
            let dot: i32 = qr.iter().zip(kr).map(|(&x, &y)| (x as i16 * y as i16) as i32).sum();
            *o = dot as f32 * sq * qz.k_scale[kk];
        }
    }
}

/// V of the FP8 P.V option: e4m3 values (decoded to f32, token-major `[total_k, heads_kv, d]` as
/// v) and one f32 scale per (sequence, kv head, channel), `[segments, heads_kv, d]`.
struct Fp8V {
    v: Vec<f32>,
    scale: Vec<f32>,
}

/// `(scale, inv)` of a V channel with maximum magnitude `amax` (module docs).
fn fp8_scale(amax: f32) -> (f32, f32) {
    let inv = E4M3_MAX / amax;
    if amax > 0.0 && inv.is_finite() { (amax / E4M3_MAX, inv) } else { (1.0, 0.0) }
}

fn quantize_v(spec: SparseView, vf: &[f32]) -> Fp8V {
    let a = &spec.attn;
    let row = a.dims.heads_kv * a.dims.head_dim;
    let mut v = vec![0.0f32; vf.len()];
    let mut scale = vec![1.0f32; a.segments.len() * row];
    for (b, seg) in a.segments.iter().enumerate() {
        let (k0, k1) = (seg.k_start * row, (seg.k_start + seg.k_len) * row);
        // per (kv head, channel) the max |v| over the sequence's keys (a key's row is [heads_kv, d]);
        // f32::max ignores NaN (as fmaxf) and is order-free, so the parallel reduction is exact
        let amax = vf[k0..k1]
            .par_chunks(row * 64)
            .map(|c| {
                let mut m = vec![0.0f32; row];
                for r in c.chunks(row) {
                    for (m, x) in m.iter_mut().zip(r) {
                        *m = m.max(x.abs());
                    }
                }
                m
            })
            .reduce(|| vec![0.0f32; row], |x, y| x.iter().zip(&y).map(|(p, q)| p.max(*q)).collect());
        let inv: Vec<f32> = amax.iter().map(|&m| fp8_scale(m).1).collect();
        for (s, &m) in scale[b * row..(b + 1) * row].iter_mut().zip(&amax) {
            *s = fp8_scale(m).0;
        }
        v[k0..k1].par_chunks_mut(row).zip(vf[k0..k1].par_chunks(row)).for_each(|(o, x)| {
            for ((o, &x), &i) in o.iter_mut().zip(x).zip(&inv) {
                *o = e4m3_round(x * i);
            }
        });
    }
    Fp8V { v, scale }
}

/// The key loop of one forward row task with FP8 P.V (module docs): per listed key block, per
/// 64-key tile, INT8 scores, one online-softmax step, `e4m3(256 P)` times the e4m3 V into
/// `sc.o` (f32). `sc.lims`: the rows' visible key counts; `tile_lims`: scratch.
#[allow(clippy::too_many_arguments)]
fn fp8_keys(spec: SparseView, qz: &Quantized, v8: &Fp8V, b: usize, h: usize, r0: usize, rows: usize, c: f32, sc: &mut Scratch, tile_lims: &mut Vec<usize>) {
    let a = &spec.attn;
    let dm = a.dims;
    let (d, tq, tk, hq, hkv) = (dm.head_dim, dm.total_q, dm.total_k, dm.heads_q, dm.heads_kv);
    let seg = &a.segments[b];
    let hk = h / dm.group_size();
    let row0 = seg.q_start + r0;
    let k_hi = sc.lims[..rows].iter().copied().max().unwrap_or(0);
    for &kb in spec.index.kept(b, spec.index_head(h), r0 / spec.q_block) {
        let lo = kb as usize * spec.k_block;
        if lo >= k_hi {
            break;
        }
        let hi = (lo + spec.k_block).min(k_hi);
        for t0 in (lo..hi).step_by(TILE_KEYS) {
            let t1 = (t0 + TILE_KEYS).min(hi);
            let n = t1 - t0;
            qk_int8(&mut sc.s, n, 0, qz, hq, tq, tk, d, h, hk, row0, rows, seg.k_start + t0, n);
            tile_lims.clear();
            tile_lims.extend(sc.lims[..rows].iter().map(|&lim| lim.clamp(t0, t1) - t0));
            online_softmax_block(&mut sc.s[..rows * n], n, n, tile_lims, 0, c, &mut sc.m[..rows], &mut sc.l[..rows], &mut sc.o[..rows * d], d);
            for x in &mut sc.s[..rows * n] {
                *x = e4m3_round(*x * FP8_P_SCALE);
            }
            let v_blk = Mat { ptr: v8.v[((seg.k_start + t0) * hkv + hk) * d..].as_ptr(), rs: (hkv * d) as isize, cs: 1 };
            matmul(&mut sc.o, d, rows, d, n, Mat::rows(&sc.s, n), v_blk, 1.0, true);
        }
    }
}

/// Output rows and LSE of an FP8 P.V row task: `out = acc / (256 l) * scale[c]`, LSE of the
/// unscaled sums (rows with `l == 0` keep their zeros and +inf).
#[allow(clippy::too_many_arguments)]
fn fp8_finish(sc: &Scratch, rows: usize, d: usize, v_scale: &[f32], out_w: &SharedMut<f32>, lse_dst: &mut [f32], out_at: impl Fn(usize) -> usize) {
    for (i, lse) in lse_dst[..rows].iter_mut().enumerate() {
        let li = sc.l[i];
        if li != 0.0 {
            // SAFETY: tasks own disjoint (row, head) ranges.
            let dst = unsafe { out_w.slice(out_at(i), d) };
            let inv = 1.0 / (li * FP8_P_SCALE);
            for ((o, &acc), &s) in dst.iter_mut().zip(&sc.o[i * d..(i + 1) * d]).zip(v_scale) {
                *o = acc * inv * s;
            }
            *lse = (sc.m[i] + li.log2()) * std::f32::consts::LN_2;
        }
    }
}

fn round_to(dtype: DType, x: &mut [f32]) {
    match dtype {
        DType::F32 => {}
        DType::F16 => x.iter_mut().for_each(|v| *v = half::f16::from_f32(*v).to_f32()),
        DType::BF16 => x.iter_mut().for_each(|v| *v = half::bf16::from_f32(*v).to_f32()),
    }
}

pub(super) fn forward(spec: SparseView, q: HostView, k: HostView, v: HostView) -> ForwardOutput {
    let a = &spec.attn;
    let dm = a.dims;
    let (d, tq, tk, hq, hkv) = (dm.head_dim, dm.total_q, dm.total_k, dm.heads_q, dm.heads_kv);
    let vf = to_f32_cow(v);
    // a V with a NaN or Inf: the exact (unquantised) attention, as CUDA's non-finite-v route
    let int8 = spec.int8.filter(|_| vf.iter().all(|x| x.is_finite()));
    let qz = int8.map(|opt| quantize(spec, opt, q, k));
    let qf = to_f32_cow(q);
    let kt = if qz.is_none() { transpose_per_head(k, tk, hkv, d) } else { Vec::new() };
    // FP8 P.V: V quantised once per call
    let v8 = int8.filter(|o| o.pv_fp8).map(|_| quantize_v(spec, &vf));
    let mut out = vec![0.0f32; dm.q_len()];
    let mut lse = vec![f32::INFINITY; dm.lse_len()];
    let out_w = SharedMut::new(&mut out);
    let lse_w = SharedMut::new(&mut lse);
    let c = a.scale * std::f32::consts::LOG2_E;
    let (q_rs, kv_rs) = ((hq * d) as isize, (hkv * d) as isize);
    let tasks = row_tasks(spec);
    tasks.par_iter().for_each_init(
        || (Scratch::new(d), Gather::new(d)),
        |(sc, ga), &(b, r0, rows, h)| {
            let seg = &a.segments[b];
            let hk = h / dm.group_size();
            let row0 = seg.q_start + r0;
            row_limits(seg, a.causal, r0, rows, &mut sc.lims);
            let k_hi = sc.lims.iter().copied().max().unwrap_or(0);
            sc.o[..rows * d].fill(0.0);
            sc.m[..rows].fill(f32::NEG_INFINITY);
            sc.l[..rows].fill(0.0);
            if let (Some(v8), Some(qz)) = (&v8, &qz) {
                fp8_keys(spec, qz, v8, b, h, r0, rows, c, sc, &mut ga.lims);
            } else {
                spans(spec.index.kept(b, spec.index_head(h), r0 / spec.q_block), spec.k_block, k_hi, BK, &mut ga.spans);
                chunks(&ga.spans, BK, &mut ga.chunks);
                let qblk = Mat { ptr: qf[(row0 * hq + h) * d..].as_ptr(), rs: q_rs, cs: 1 };
                for ci in 0..ga.chunks.len() {
                    let (c0, c1) = ga.chunks[ci];
                    let group = &ga.spans[c0..c1];
                    let n: usize = group.iter().map(|&(lo, hi)| hi - lo).sum();
                    // one contiguous span is read in place; several are gathered (K^T columns, V rows)
                    let (kt_blk, v_blk) = if let [(lo, _)] = *group {
                        (
                            Mat { ptr: if kt.is_empty() { std::ptr::null() } else { kt[hk * d * tk + seg.k_start + lo..].as_ptr() }, rs: tk as isize, cs: 1 },
                            Mat { ptr: vf[((seg.k_start + lo) * hkv + hk) * d..].as_ptr(), rs: kv_rs, cs: 1 },
                        )
                    } else {
                        let mut off = 0;
                        for &(lo, hi) in group {
                            let w = hi - lo;
                            if !kt.is_empty() {
                                for p in 0..d {
                                    let src = &kt[hk * d * tk + p * tk + seg.k_start + lo..][..w];
                                    ga.k[p * n + off..p * n + off + w].copy_from_slice(src);
                                }
                            }
                            for t in 0..w {
                                ga.v[(off + t) * d..(off + t + 1) * d].copy_from_slice(&vf[((seg.k_start + lo + t) * hkv + hk) * d..][..d]);
                            }
                            off += w;
                        }
                        (Mat { ptr: ga.k.as_ptr(), rs: n as isize, cs: 1 }, Mat::rows(&ga.v, d))
                    };
                    match &qz {
                        None => matmul(&mut sc.s, n, rows, n, d, qblk, kt_blk, 1.0, false),
                        Some(qz) => {
                            let mut off = 0;
                            for &(lo, hi) in group {
                                qk_int8(&mut sc.s, n, off, qz, hq, tq, tk, d, h, hk, row0, rows, seg.k_start + lo, hi - lo);
                                off += hi - lo;
                            }
                        }
                    }
                    gathered_limits(&sc.lims, group, &mut ga.lims);
                    online_softmax_block(&mut sc.s[..rows * n], n, n, &ga.lims, 0, c, &mut sc.m[..rows], &mut sc.l[..rows], &mut sc.o[..rows * d], d);
                    if qz.is_some() {
                        // P.V in the input dtype (as the GPU's f16/bf16 mma would take P)
                        round_to(a.dtype, &mut sc.s[..rows * n]);
                    }
                    matmul(&mut sc.o, d, rows, d, n, Mat::rows(&sc.s, n), v_blk, 1.0, true);
                }
            }
            // SAFETY: tasks own disjoint (row, head) ranges (sequences own disjoint rows).
            let lse_dst = unsafe { lse_w.slice(h * tq + row0, rows) };
            let out_at = |i| ((row0 + i) * hq + h) * d;
            match &v8 {
                Some(v8) => fp8_finish(sc, rows, d, &v8.scale[(b * hkv + hk) * d..][..d], &out_w, lse_dst, out_at),
                None => finish_rows(&sc.o, d, &sc.m, &sc.l, rows, d, &out_w, lse_dst, out_at),
            }
            if let Some(qz) = &qz {
                for (i, x) in lse_dst.iter_mut().enumerate() {
                    *x += qz.lse_shift[h * tq + row0 + i];
                }
            }
        },
    );
    ForwardOutput { out: from_f32_vec(out, a.dtype), lse }
}

pub(super) fn backward(spec: SparseView, q: HostView, k: HostView, v: HostView, g: BackwardInputs) -> Gradients {
    let a = &spec.attn;
    let dm = a.dims;
    let (d, tq, tk, hkv) = (dm.head_dim, dm.total_q, dm.total_k, dm.heads_kv);
    let p = prepare(a, q, k, v, &g);
    let tr = spec.transposed();
    let c = a.scale * std::f32::consts::LOG2_E;
    let gs = dm.group_size();
    let how = Products::choose(&p, d);

    // key blocks (sequence, block) in storage order; a task owns (kv head, chunk of them)
    let items: Vec<(usize, usize)> = a
        .segments
        .iter()
        .enumerate()
        .flat_map(|(b, seg)| (0..seg.k_len.div_ceil(spec.k_block)).map(move |kb| (b, kb)))
        .collect();
    let ql = dm.q_len();
    let chunks = key_chunks(hkv, items.len(), ql);
    // a chunk's work: its items' listed query blocks (over the index heads)
    let cost = |ci: usize| {
        let n_items = items.len();
        items[ci * n_items / chunks..(ci + 1) * n_items / chunks]
            .iter()
            .map(|&(b, kb)| (0..tr.heads).map(|ih| tr.listing(b, ih, kb).len()).sum::<usize>())
            .sum()
    };
    let grads = run_tasks(&dm, a.dtype, chunks, cost, |sc, hk, ci, outs| {
        let n_items = items.len();
        for &(b, kb) in &items[ci * n_items / chunks..(ci + 1) * n_items / chunks] {
            let seg = &a.segments[b];
            let k_lo = kb * spec.k_block;
            let k_end = ((kb + 1) * spec.k_block).min(seg.k_len);
            // SAFETY: tasks own disjoint (kv head, key range) slices.
            let (dk_blk, dv_blk) = unsafe { outs.dk_dv((hk * tk + seg.k_start + k_lo) * d, (k_end - k_lo) * d) };
            for h in hk * gs..(hk + 1) * gs {
                for &qb in tr.listing(b, spec.index_head(h), kb) {
                    let qb = qb as usize;
                    let (r_lo, r_hi) = (qb * spec.q_block, ((qb + 1) * spec.q_block).min(seg.q_len));
                    for r0 in (r_lo..r_hi).step_by(BQ) {
                        let rows = BQ.min(r_hi - r0);
                        row_limits(seg, a.causal, r0, rows, &mut sc.lims);
                        sc.los.clear();
                        sc.los.resize(rows, 0);
                        let lim_max = sc.lims.iter().copied().max().unwrap_or(0);
                        let row0 = h * tq + seg.q_start + r0;
                        // SAFETY: chunk ci's buffer rows of the query heads of kv head hk: this task's alone.
                        let dq_out = unsafe { outs.dq(ci, row0 * d, rows * d) };
                        for rel in (k_lo..k_end.min(lim_max)).step_by(BK) {
                            let nb = BK.min(k_end.min(lim_max) - rel);
                            let kabs = hk * tk + seg.k_start + rel;
                            let pair = BlockPair {
                                q: &p.q()[row0 * d..][..rows * d],
                                dout: &p.dout()[row0 * d..][..rows * d],
                                k: &p.k()[kabs * d..][..nb * d],
                                v: &p.v()[kabs * d..][..nb * d],
                                lse2: &p.lse2[row0..row0 + rows],
                                delta: &p.delta[row0..row0 + rows],
                                rows,
                                nb,
                                rel,
                                next: NO_NEXT,
                            };
                            let dk_out = &mut dk_blk[(rel - k_lo) * d..][..nb * d];
                            let dv_out = &mut dv_blk[(rel - k_lo) * d..][..nb * d];
                            block_pair(sc, &pair, dk_out, dv_out, dq_out, d, c, a.scale, how);
                        }
                    }
                }
            }
        }
    });
    p.release();
    grads
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::HostData;
    use crate::reference::{backward_f64, forward_f64, test_values};
    use crate::spec::{AttnSpec, TensorMeta};
    use crate::sparse::QuantGran;
    use crate::spec::KeySet;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use rand_distr::StandardNormal;

    #[test]
    fn spans_merge_clip_and_split() {
        let mut out = Vec::new();
        spans(&[0, 1, 3, 4, 5, 9], 128, 1200, 512, &mut out);
        assert_eq!(out, vec![(0, 256), (384, 768), (1152, 1200)]);
        spans(&[0, 1, 2, 3, 4], 128, 10_000, 256, &mut out);
        assert_eq!(out, vec![(0, 256), (256, 512), (512, 640)]);
        spans(&[2, 3], 128, 256, 512, &mut out);
        assert!(out.is_empty());
        let mut ch = Vec::new();
        chunks(&[(0, 128), (256, 384), (512, 900), (1024, 1100)], 512, &mut ch);
        assert_eq!(ch, vec![(0, 2), (2, 4)]);
        let mut lv = Vec::new();
        gathered_limits(&[0, 200, 300, 2000], &[(0, 128), (256, 384)], &mut lv);
        assert_eq!(lv, vec![0, 128, 172, 256]);
    }

    /// Forward and backward against the f64 reference on varlen sequences with partial last
    /// blocks, GQA with a per-kv-head index, causal and not, an empty query block, and blocks of
    /// sizes that are not multiples of each other; head dim 24 (the backward's gemm path) and 32
    /// (its AVX-512 tiles where the CPU has them).
    #[test]
    fn matches_the_f64_reference() {
        check_against_f64_reference(24);
        check_against_f64_reference(32);
    }

    fn check_against_f64_reference(d: usize) {
        let lens = [(150usize, 200usize), (37, 300), (1, 1)];
        let (hq, hkv) = (4usize, 2usize);
        let (qbs, kbs) = (48usize, 40usize);
        let (tq, tk): (usize, usize) = (lens.iter().map(|l| l.0).sum(), lens.iter().map(|l| l.1).sum());
        let mut cq = vec![0i32];
        let mut ck = vec![0i32];
        for l in lens {
            cq.push(cq.last().unwrap() + l.0 as i32);
            ck.push(ck.last().unwrap() + l.1 as i32);
        }
        let qbn = 150usize.div_ceil(qbs);
        let top_k = 4;
        for (causal, uniform) in [(false, false), (true, false), (true, true)] {
            for index_heads in [hq, hkv] {
                let qm = TensorMeta::new(&[tq, hq, d], DType::F32);
                let km = TensorMeta::new(&[tk, hkv, d], DType::F32);
                let attn = AttnSpec::varlen(&qm, &km, &km, &cq, &ck, 150, 300, None, causal).unwrap();
                let mut ix = vec![-1i32; lens.len() * index_heads * qbn * top_k];
                let mut x = 7usize;
                for b in 0..lens.len() {
                    let kbn = lens[b].1.div_ceil(kbs);
                    for h in 0..index_heads {
                        for qb in 0..qbn {
                            if (b, h, qb) == (0, 0, 1) {
                                continue; // an empty query block
                            }
                            let row = &mut ix[((b * index_heads + h) * qbn + qb) * top_k..][..top_k];
                            for slot in 0..top_k.min(kbn) {
                                x = x.wrapping_mul(1103515245).wrapping_add(12345);
                                let cand = (x >> 8) % kbn;
                                if !row.contains(&(cand as i32)) {
                                    row[(slot + qb) % top_k] = cand as i32;
                                }
                            }
                        }
                    }
                }
                if uniform {
                    // equal lists in consecutive query blocks: row tasks merge them (up to BQ rows)
                    for row in 0..lens.len() * index_heads {
                        let first: Vec<i32> = ix[row * qbn * top_k..][..top_k].to_vec();
                        for qb in 2..qbn {
                            ix[(row * qbn + qb) * top_k..][..top_k].copy_from_slice(&first);
                        }
                    }
                }
                let spec = attn.with_block_index(&ix, &[lens.len(), index_heads, qbn, top_k], qbs, kbs, None).unwrap();
                let s = spec.block_sparse().unwrap();
                if uniform {
                    assert!(row_tasks(s).iter().any(|t| t.2 > qbs), "some task spans two query blocks");
                }
                let (q, k, v, go) = (test_values(tq * hq * d, 1), test_values(tk * hkv * d, 2), test_values(tk * hkv * d, 3), test_values(tq * hq * d, 4));
                let f64v = |x: &[f32]| x.iter().map(|&y| y as f64).collect::<Vec<f64>>();
                let (ro, rl) = forward_f64(&spec, &f64v(&q), &f64v(&k), &f64v(&v));
                let (qd, kd, vd) = (HostData::F32(q.clone()), HostData::F32(k.clone()), HostData::F32(v.clone()));
                let f = forward(s, qd.view(), kd.view(), vd.view());
                let o = f.out.to_f32_vec();
                for (i, (x, y)) in o.iter().zip(&ro).enumerate() {
                    assert!((*x as f64 - y).abs() < 1e-5, "causal={causal} uniform={uniform} ih={index_heads} out[{i}] {x} vs {y}");
                }
                for (i, (x, y)) in f.lse.iter().zip(&rl).enumerate() {
                    assert!((x.is_infinite() && y.is_infinite()) || (*x as f64 - y).abs() < 1e-5, "lse[{i}] {x} vs {y}");
                }
                // the empty query block (sequence 0, head 0 (or its kv group), rows 48..96)
                assert!(f.lse[48].is_infinite() && o[48 * hq * d..48 * hq * d + d].iter().all(|&x| x == 0.0));
                let gd = HostData::F32(go.clone());
                let gin = BackwardInputs { out: f.out.view(), lse: &f.lse, dout: gd.view(), deterministic: true };
                let gr = backward(s, qd.view(), kd.view(), vd.view(), gin);
                let (rq, rk, rv) = backward_f64(&spec, &f64v(&q), &f64v(&k), &f64v(&v), &f64v(&go));
                for (name, got, want) in [("dq", gr.dq, rq), ("dk", gr.dk, rk), ("dv", gr.dv, rv)] {
                    for (i, (x, y)) in got.to_f32_vec().iter().zip(&want).enumerate() {
                        assert!((*x as f64 - y).abs() < 1e-4 * (1.0 + y.abs()), "causal={causal} ih={index_heads} {name}[{i}] {x} vs {y}");
                    }
                }
            }
        }
    }

    /// A block-sparse FP8 P.V case: sequences (query, key lengths), heads, head_dim, block sizes.
    struct Fp8Case {
        lens: &'static [(usize, usize)],
        hq: usize,
        hkv: usize,
        d: usize,
        q_block: usize,
        k_block: usize,
        causal: bool,
        /// one index per kv head (else per q head)
        per_kv_head: bool,
        /// V channels with large magnitudes: a few scaled by 40, one offset by +25
        outliers: bool,
        dtype: DType,
        gran: QuantGran,
    }

    const FP8_CASES: [Fp8Case; 4] = [
        // varlen with empty sequences (no keys; no queries; neither), GQA, causal, d64
        Fp8Case { lens: &[(150, 200), (5, 0), (0, 60), (0, 0), (70, 333)], hq: 4, hkv: 2, d: 64, q_block: 64, k_block: 128, causal: true, per_kv_head: false, outliers: false, dtype: DType::F16, gran: QuantGran::PerWarp },
        // d128, blocks that are no multiple of 64 (tiles of 64 + 16 keys), an index per kv head, MQA
        Fp8Case { lens: &[(300, 333)], hq: 2, hkv: 1, d: 128, q_block: 48, k_block: 80, causal: false, per_kv_head: true, outliers: false, dtype: DType::BF16, gran: QuantGran::PerThread },
        // outlier channels in V, a key count off the block size, f32
        Fp8Case { lens: &[(200, 517)], hq: 4, hkv: 4, d: 64, q_block: 64, k_block: 128, causal: true, per_kv_head: false, outliers: true, dtype: DType::F32, gran: QuantGran::PerBlock },
        // outliers at d128, GQA 8 / 2, causal with Sq < Sk, 128-blocks (sageattn's)
        Fp8Case { lens: &[(129, 1000), (260, 260)], hq: 8, hkv: 2, d: 128, q_block: 128, k_block: 128, causal: true, per_kv_head: true, outliers: true, dtype: DType::BF16, gran: QuantGran::PerWarp },
    ];

    fn randn(n: usize, rng: &mut StdRng) -> Vec<f32> {
        (0..n).map(|_| rng.sample::<f32, _>(StandardNormal)).collect()
    }

    /// The spec of `c` with a random index (about 60% of the key blocks kept per query block) and
    /// the INT8 option `int8`.
    fn fp8_spec(c: &Fp8Case, int8: Option<Int8Qk>, rng: &mut StdRng) -> AttnSpec {
        let (tq, tk): (usize, usize) = (c.lens.iter().map(|l| l.0).sum(), c.lens.iter().map(|l| l.1).sum());
        let (mut cq, mut ck) = (vec![0i32], vec![0i32]);
        for l in c.lens {
            cq.push(cq.last().unwrap() + l.0 as i32);
            ck.push(ck.last().unwrap() + l.1 as i32);
        }
        let (mq, mk) = (c.lens.iter().map(|l| l.0).max().unwrap(), c.lens.iter().map(|l| l.1).max().unwrap());
        let qm = TensorMeta::new(&[tq, c.hq, c.d], c.dtype);
        let km = TensorMeta::new(&[tk, c.hkv, c.d], c.dtype);
        let attn = AttnSpec::varlen(&qm, &km, &km, &cq, &ck, mq, mk, None, c.causal).unwrap();
        let heads = if c.per_kv_head { c.hkv } else { c.hq };
        let qbn = mq.div_ceil(c.q_block);
        let top_k = mk.div_ceil(c.k_block).max(1);
        let mut ix = vec![-1i32; c.lens.len() * heads * qbn * top_k];
        for (b, l) in c.lens.iter().enumerate() {
            for row in ix[b * heads * qbn * top_k..(b + 1) * heads * qbn * top_k].chunks_mut(top_k) {
                for (slot, kb) in row.iter_mut().zip(0..l.1.div_ceil(c.k_block)) {
                    if rng.random::<f32>() < 0.6 {
                        *slot = kb as i32;
                    }
                }
                row.reverse(); // any order
            }
        }
        attn.with_block_index(&ix, &[c.lens.len(), heads, qbn, top_k], c.q_block, c.k_block, int8).unwrap()
    }

    /// (cosine similarity, relative L2 error) of `got` against `want`.
    fn accuracy(got: &[f32], want: &[f64]) -> (f64, f64) {
        let dot: f64 = got.iter().zip(want).map(|(&a, b)| a as f64 * b).sum();
        let (ng, nw) = (got.iter().map(|&a| (a as f64).powi(2)).sum::<f64>().sqrt(), want.iter().map(|a| a * a).sum::<f64>().sqrt());
        let diff = got.iter().zip(want).map(|(&a, b)| (a as f64 - b).powi(2)).sum::<f64>().sqrt();
        (dot / (ng * nw).max(1e-300), diff / nw.max(1e-300))
    }

    /// FP8 P.V (with INT8 Q K^T) against the f64 reference of the unquantised attention on randn
    /// inputs: cosine >= 0.999, relative L2 <= 0.05; the LSE is the true one (the P scale of 256
    /// does not reach it); rows that see no key: zero output, LSE +inf; the option ran (its output
    /// differs from the INT8-only path's and is further from the reference).
    #[test]
    fn fp8_pv_matches_the_f64_reference() {
        let mut rng = StdRng::seed_from_u64(43);
        for (ci, c) in FP8_CASES.iter().enumerate() {
            let opt = Int8Qk { gran: c.gran, smooth_k: ci % 2 == 0, pv_fp8: true };
            let spec = fp8_spec(c, Some(opt), &mut rng);
            let mut int8_only = spec.clone();
            let mut exact = spec.clone();
            if let (crate::spec::KeySet::BlockSparse(a), crate::spec::KeySet::BlockSparse(e)) = (&mut int8_only.keys, &mut exact.keys) {
                a.int8 = Some(Int8Qk { pv_fp8: false, ..opt });
                e.int8 = None;
            }
            let dm = spec.dims;
            let q = randn(dm.q_len(), &mut rng);
            let k = randn(dm.kv_len(), &mut rng);
            let mut v = randn(dm.kv_len(), &mut rng);
            if c.outliers {
                for (i, x) in v.iter_mut().enumerate() {
                    match i % c.d {
                        3 | 17 | 40 => *x *= 40.0,
                        9 => *x += 25.0,
                        _ => {}
                    }
                }
            }
            // the inputs as stored (rounded to the dtype), for the reference too
            let (qd, kd, vd) = (HostData::from_f32(c.dtype, &q), HostData::from_f32(c.dtype, &k), HostData::from_f32(c.dtype, &v));
            let (want, want_lse) = forward_f64(&spec, &qd.view().to_f64_vec(), &kd.view().to_f64_vec(), &vd.view().to_f64_vec());
            let run = |s: &AttnSpec| forward(s.block_sparse().unwrap(), qd.view(), kd.view(), vd.view());
            let (f8, i8, ex) = (run(&spec), run(&int8_only), run(&exact));
            let o = f8.out.to_f32_vec();
            let (cos, rel) = accuracy(&o, &want);
            let (cos8, rel8) = accuracy(&i8.out.to_f32_vec(), &want);
            let (_, rel_ex) = accuracy(&ex.out.to_f32_vec(), &want);
            let mut lse_err = 0.0f64;
            for (i, (&x, &y)) in f8.lse.iter().zip(&want_lse).enumerate() {
                if y.is_infinite() {
                    assert!(x == f32::INFINITY, "case {ci}: lse[{i}] {x}, the row sees no key");
                    let (h, t) = (i / dm.total_q, i % dm.total_q);
                    assert!(o[(t * dm.heads_q + h) * dm.head_dim..][..dm.head_dim].iter().all(|&z| z == 0.0));
                } else {
                    lse_err = lse_err.max((x as f64 - y).abs());
                    // the INT8-only path has the same scores: the LSE differs by summation order only
                    assert!((x - i8.lse[i]).abs() <= 1e-4 * x.abs().max(1.0), "case {ci}: lse[{i}] {x} vs int8-only {}", i8.lse[i]);
                }
            }
            println!("case {ci}: fp8 cosine {cos:.6} rel L2 {rel:.4} | int8-only cosine {cos8:.6} rel L2 {rel8:.4} | exact rel L2 {rel_ex:.2e} | max |lse err| {lse_err:.4}");
            assert!(cos >= 0.999 && rel <= 0.05, "case {ci}: cosine {cos}, rel L2 {rel}");
            assert!(lse_err < 0.1, "case {ci}: lse error {lse_err}");
            assert!(rel > rel8 && rel8 > rel_ex, "case {ci}: the FP8 P.V must cost accuracy over INT8 alone ({rel} vs {rel8})");
        }
    }

    /// V's scale is per (sequence, kv head, channel): scaling one channel of V by a power of two
    /// scales that channel of the output by it exactly and leaves every other channel bitwise
    /// unchanged; a zero channel gives zeros; a NaN in V sends the call to the exact path.
    #[test]
    fn fp8_v_scales_are_per_channel() {
        let mut rng = StdRng::seed_from_u64(7);
        let c = Fp8Case { dtype: DType::F32, ..FP8_CASES[0] };
        let spec = fp8_spec(&c, Some(Int8Qk { gran: QuantGran::PerWarp, smooth_k: true, pv_fp8: true }), &mut rng);
        let dm = spec.dims;
        let (d, hkv) = (dm.head_dim, dm.heads_kv);
        let q = HostData::F32(randn(dm.q_len(), &mut rng));
        let k = HostData::F32(randn(dm.kv_len(), &mut rng));
        let v0 = randn(dm.kv_len(), &mut rng);
        let run = |v: &[f32]| {
            let vd = HostData::F32(v.to_vec());
            let f = forward(spec.block_sparse().unwrap(), q.view(), k.view(), vd.view());
            (f.out.to_f32_vec(), f.lse)
        };
        let (base, base_lse) = run(&v0);
        // channel 5 of kv head 1 times 2^10, channel 6 of kv head 1 zeroed
        let mut v1 = v0.clone();
        for t in 0..dm.total_k {
            v1[(t * hkv + 1) * d + 5] *= 1024.0;
            v1[(t * hkv + 1) * d + 6] = 0.0;
        }
        let (got, got_lse) = run(&v1);
        assert_eq!(base_lse, got_lse);
        let group = dm.group_size();
        for (i, (&x, &y)) in got.iter().zip(&base).enumerate() {
            let (h, ch) = (i / d % dm.heads_q, i % d);
            if h / group == 1 && ch == 5 {
                assert_eq!(x, y * 1024.0, "out[{i}]");
            } else if h / group == 1 && ch == 6 {
                assert_eq!(x, 0.0, "out[{i}]");
            } else {
                assert_eq!(x.to_bits(), y.to_bits(), "out[{i}]");
            }
        }
        // a NaN in V: the call is the exact one (the unquantised attention, bitwise)
        let mut v2 = v0.clone();
        let t_nan = 10; // a key of sequence 0 (150 x 200)
        v2[(t_nan * hkv) * d + 2] = f32::NAN;
        let (got, got_lse) = run(&v2);
        let vd = HostData::F32(v2);
        let mut exact = spec.clone();
        if let KeySet::BlockSparse(s) = &mut exact.keys {
            s.int8 = None;
        }
        let ex = forward(exact.block_sparse().unwrap(), q.view(), k.view(), vd.view());
        let ex_out = ex.out.to_f32_vec();
        assert!(got.iter().zip(&ex_out).all(|(x, y)| x.to_bits() == y.to_bits()), "a non-finite V must take the exact path");
        assert_eq!(got_lse, ex.lse);
        assert!(got.iter().any(|x| x.is_nan()) && got.iter().any(|x| x.is_finite()));
    }
}
