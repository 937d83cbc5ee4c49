//! CPU forward: blocked online softmax (the FlashAttention algorithm) with f32 accumulation.
//! One task per (segment, query block, query head); tasks run longest-first on rayon.

use rayon::prelude::*;

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
    /// One key block of online softmax for `rows` rows. On entry `s` holds raw q.k (rows x n);
    /// on exit it holds the unnormalised probabilities, `m`/`l` are updated (base-2 units) and
    /// each row of `o` (rows x d) is rescaled for the new maximum. Row i sees block columns
    /// `< lims[i] - kb`.
    #[allow(clippy::too_many_arguments)]
    fn online_softmax_block(s: &mut [f32], n: usize, lims: &[usize], kb: usize, c: f32, m: &mut [f32], l: &mut [f32], o: &mut [f32], d: usize) {
        for (i, &lim) in lims.iter().enumerate() {
            let row = &mut s[i * n..(i + 1) * n];
            let lim = lim.saturating_sub(kb).min(n);
            if lim == 0 {
                row.fill(0.0);
                continue;
            }
            let (live, dead) = row.split_at_mut(lim);
            dead.fill(0.0);
            // the max of c*s is c*max(s) for c >= 0; a negative scale takes the slow path
            let sum;
            let m_new;
            if c >= 0.0 {
                m_new = (max_of(live) * c).max(m[i]);
                sum = exp2_scaled_sub_sum(live, c, m_new);
            } else {
                scale_in_place(live, c);
                m_new = max_of(live).max(m[i]);
                sum = exp2_sub_sum(live, m_new);
            }
            let alpha = super::simd::exp2_neg(m[i] - m_new);
            l[i] = l[i] * alpha + sum;
            m[i] = m_new;
            if alpha != 1.0 {
                scale_in_place(&mut o[i * d..(i + 1) * d], alpha);
            }
        }
    }
}

struct Scratch {
    s: Vec<f32>,
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    lims: Vec<usize>,
}

impl Scratch {
    fn new(d: usize) -> Self {
        Scratch { s: vec![0.0; BQ * BK], o: vec![0.0; BQ * d], m: vec![0.0; BQ], l: vec![0.0; BQ], lims: vec![0; BQ] }
    }
}

/// Visible-key count (relative to the window start) of rows `r0..r0+rows` of `seg`.
pub(crate) fn row_limits(seg: &Segment, causal: bool, r0: usize, rows: usize, out: &mut Vec<usize>) {
    out.clear();
    out.extend((r0..r0 + rows).map(|r| seg.visible_len(r, causal)));
}

/// Work items (segment index, first row) per head, longest first.
pub(crate) fn query_blocks(spec: &AttnSpec) -> Vec<(usize, usize)> {
    let mut blocks: Vec<(usize, usize, usize)> = Vec::new();
    for (si, seg) in spec.segments.iter().enumerate() {
        for r0 in (0..seg.q_len).step_by(BQ) {
            let last = (r0 + BQ).min(seg.q_len) - 1;
            blocks.push((si, r0, seg.visible_len(last, spec.causal)));
        }
    }
    blocks.sort_by(|a, b| b.2.cmp(&a.2));
    blocks.into_iter().map(|(s, r, _)| (s, r)).collect()
}

pub(crate) fn forward(spec: &AttnSpec, q: HostView, k: HostView, v: HostView) -> ForwardOutput {
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
            row_limits(seg, spec.causal, r0, rows, &mut sc.lims);
            let k_hi = sc.lims.iter().copied().max().unwrap_or(0);
            sc.o[..rows * d].fill(0.0);
            sc.m[..rows].fill(f32::NEG_INFINITY);
            sc.l[..rows].fill(0.0);
            for kb in (0..k_hi).step_by(BK) {
                let n = BK.min(k_hi - kb);
                let key0 = ((seg.k_start + kb) * hkv + hk) * d;
                // K^T block (d x n) of head hk's [d, total_k] slab
                let kt_blk = Mat { ptr: kt[hk * d * tk + seg.k_start + kb..].as_ptr(), rs: tk as isize, cs: 1 };
                let v_blk = Mat { ptr: vf[key0..].as_ptr(), rs: kv_rs, cs: 1 };
                matmul(&mut sc.s, n, rows, n, d, qblk, kt_blk, 1.0, false);
                online_softmax_block(&mut sc.s[..rows * n], n, &sc.lims, kb, c, &mut sc.m[..rows], &mut sc.l[..rows], &mut sc.o[..rows * d], d);
                matmul(&mut sc.o, d, rows, d, n, Mat::rows(&sc.s, n), v_blk, 1.0, true);
            }
            // SAFETY: segments own disjoint query rows, so (row, head) ranges of tasks are disjoint.
            let lse_dst = unsafe { lse_w.slice(h * tq + row0, rows) };
            for i in 0..rows {
                let li = sc.l[i];
                if li > 0.0 {
                    let dst = unsafe { out_w.slice(((row0 + i) * hq + h) * d, d) };
                    let inv = 1.0 / li;
                    for (o, &a) in dst.iter_mut().zip(&sc.o[i * d..(i + 1) * d]) {
                        *o = a * inv;
                    }
                    lse_dst[i] = (sc.m[i] + li.log2()) * std::f32::consts::LN_2;
                }
            }
        },
    );
    ForwardOutput { out: from_f32_vec(out, spec.dtype), lse }
}
