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

use rayon::prelude::*;

use super::backward::{block_pair, key_chunks, prepare, run_tasks, BlockPair, Products, NO_NEXT};
use super::forward::{finish_rows, online_softmax_block, row_limits, Scratch, BK, BQ};
use super::layout::{from_f32_vec, matmul, to_f32_cow, to_head_major, transpose_per_head, Mat, SharedMut};
use crate::backend::{BackwardInputs, ForwardOutput, Gradients};
use crate::dtype::{DType, HostView};
use crate::sparse::Int8Qk;
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
    let qz = spec.int8.map(|opt| quantize(spec, opt, q, k));
    let qf = to_f32_cow(q);
    let kt = if qz.is_none() { transpose_per_head(k, tk, hkv, d) } else { Vec::new() };
    let vf = to_f32_cow(v);
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
            spans(spec.index.kept(b, spec.index_head(h), r0 / spec.q_block), spec.k_block, k_hi, BK, &mut ga.spans);
            chunks(&ga.spans, BK, &mut ga.chunks);
            sc.o[..rows * d].fill(0.0);
            sc.m[..rows].fill(f32::NEG_INFINITY);
            sc.l[..rows].fill(0.0);
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
            // SAFETY: tasks own disjoint (row, head) ranges (sequences own disjoint rows).
            let lse_dst = unsafe { lse_w.slice(h * tq + row0, rows) };
            finish_rows(&sc.o, d, &sc.m, &sc.l, rows, d, &out_w, lse_dst, |i| ((row0 + i) * hq + h) * d);
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
}
