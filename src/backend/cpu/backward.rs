//! CPU backward (FlashAttention-2 style, recomputing P from the LSE once), deterministic by
//! construction: dK/dV are owned by tasks over (kv head, chunk of key blocks) that loop over every
//! segment and query head seeing those keys (so overlapping groups and GQA heads accumulate in a
//! fixed order); each chunk adds its dQ into its own buffer, and the buffers are summed in chunk
//! order.

use rayon::prelude::*;

use super::forward::{all_finite, pv_rows, row_bounds, BK, BQ};
use super::pool::Aligned;
use super::layout::{from_head_major, matmul, to_f32_cow, to_head_major, Mat, SharedMut};
use super::simd::{dot, exp2_neg, multiversion};
use crate::backend::{BackwardInputs, Gradients};
use crate::dtype::{DType, HostView};
use crate::spec::{AttnSpec, Dims};

/// Keys per dK/dV task.
pub(crate) const BKB: usize = 64;

multiversion! {
    /// `s` (rows x n, raw q.k) -> P = 2^(c*s - lse2) for row i's columns
    /// `[los[i] - kb, his[i] - kb)` (clamped to `[0, n)`), else exactly 0.
    fn probs_rows(s: &mut [f32], n: usize, los: &[usize], his: &[usize], kb: usize, c: f32, lse2: &[f32]) {
        for (i, &hi) in his.iter().enumerate() {
            let row = &mut s[i * n..(i + 1) * n];
            let hi = hi.saturating_sub(kb).min(n);
            let lo = los[i].saturating_sub(kb).min(hi);
            let (head, rest) = row.split_at_mut(lo);
            head.fill(0.0);
            let (live, dead) = rest.split_at_mut(hi - lo);
            dead.fill(0.0);
            let sub = lse2[i];
            for x in live {
                *x = exp2_neg(*x * c - sub);
            }
        }
    }
}

multiversion! {
    /// dS = P * (dP - D) in place in `dp` (rows x n) on row i's columns `[los[i] - kb, his[i] - kb)`
    /// and exactly 0 elsewhere: a key a row cannot see contributes nothing to dQ or dK, even when
    /// its V (hence dP) is not finite.
    #[allow(clippy::too_many_arguments)]
    fn dscores_rows(p: &[f32], dp: &mut [f32], n: usize, los: &[usize], his: &[usize], kb: usize, dvec: &[f32]) {
        for (i, &di) in dvec.iter().enumerate() {
            let hi = his[i].saturating_sub(kb).min(n);
            let lo = los[i].saturating_sub(kb).min(hi);
            let row = &mut dp[i * n..(i + 1) * n];
            row[..lo].fill(0.0);
            row[hi..].fill(0.0);
            for (x, &pi) in row[lo..hi].iter_mut().zip(&p[i * n + lo..i * n + hi]) {
                *x = pi * (*x - di);
            }
        }
    }
}

/// `dst[j] += alpha * sum_i p[i, j] x[i]` over the pairs (i, j) with j in row i's keys
/// `[los[i] - kb, his[i] - kb)` (clamped to `[0, n)`): the exact form of `P^T X` for inputs with
/// NaN / Inf (a masked pair contributes nothing, not 0 * Inf).
#[allow(clippy::too_many_arguments)]
fn pt_rows(dst: &mut [f32], d: usize, p: &[f32], n: usize, x: &[f32], los: &[usize], his: &[usize], kb: usize, alpha: f32) {
    for (i, xi) in x.chunks_exact(d).enumerate().take(his.len()) {
        let hi = his[i].saturating_sub(kb).min(n);
        let lo = los[i].saturating_sub(kb).min(hi);
        for j in lo..hi {
            let w = alpha * p[i * n + j];
            for (o, &y) in dst[j * d..(j + 1) * d].iter_mut().zip(xi) {
                *o = w.mul_add(y, *o);
            }
        }
    }
}

pub(crate) struct Scratch {
    pub(crate) s: Vec<f32>,
    pub(crate) dp: Vec<f32>,
    pub(crate) lims: Vec<usize>,
    pub(crate) los: Vec<usize>,
}

impl Scratch {
    pub(crate) fn new() -> Self {
        let kmax = BK.max(BKB);
        Scratch {
            s: vec![0.0; BQ * kmax],
            dp: vec![0.0; BQ * kmax],
            lims: Vec::with_capacity(BQ),
            los: Vec::with_capacity(BQ),
        }
    }
}

pub(crate) struct Prepared {
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) dout: Vec<f32>,
    /// rowsum(dO * O), `[heads_q, total_q]`
    pub(crate) delta: Vec<f32>,
    /// LSE in base-2 units, `[heads_q, total_q]`
    pub(crate) lse2: Vec<f32>,
}

pub(crate) fn prepare(spec: &AttnSpec, q: HostView, k: HostView, v: HostView, g: &BackwardInputs) -> Prepared {
    let dm = spec.dims;
    let (d, tq, tk) = (dm.head_dim, dm.total_q, dm.total_k);
    // out is read in place (token-major); only delta needs it
    let o = to_f32_cow(g.out);
    let dout = to_head_major(g.dout, tq, dm.heads_q, d);
    let hq = dm.heads_q;
    let delta: Vec<f32> = (0..dm.lse_len())
        .into_par_iter()
        .map(|i| {
            let (h, t) = (i / tq, i % tq);
            dot(&dout[i * d..(i + 1) * d], &o[(t * hq + h) * d..][..d])
        })
        .collect();
    Prepared {
        q: to_head_major(q, tq, dm.heads_q, d),
        k: to_head_major(k, tk, dm.heads_kv, d),
        v: to_head_major(v, tk, dm.heads_kv, d),
        dout,
        delta,
        lse2: g.lse.iter().map(|&x| x * std::f32::consts::LOG2_E).collect(),
    }
}

/// Key chunks per kv head: the tasks are (kv head, chunk of key blocks), and each chunk's dQ
/// contribution goes to its own f32 buffer, summed in chunk order at the end. A function of the
/// shape only (never of the thread count), so the gradients are the same bits on every machine:
/// at least 32 tasks where the key blocks allow, and at most 256 MiB of dQ buffers.
pub(crate) fn key_chunks(hkv: usize, blocks: usize, q_len: usize) -> usize {
    let cap = ((256usize << 20) / (q_len * 4).max(1)).max(1);
    32usize.div_ceil(hkv.max(1)).min(blocks.max(1)).min(cap)
}

/// One (query rows, key block) pair of the backward, everything else in `sc`: row i of the
/// block sees the key columns `[sc.los[i] - rel, sc.lims[i] - rel)` (clamped to `[0, nb)`).
pub(crate) struct BlockPair<'a> {
    pub(crate) q: &'a [f32],
    pub(crate) dout: &'a [f32],
    pub(crate) k: &'a [f32],
    pub(crate) v: &'a [f32],
    /// LSE (base 2) and delta of the rows
    pub(crate) lse2: &'a [f32],
    pub(crate) delta: &'a [f32],
    pub(crate) rows: usize,
    pub(crate) nb: usize,
    /// sequence-relative index of the block's first key
    pub(crate) rel: usize,
}

/// FlashAttention-2's five products of one block pair: S = Q K^T, P (masked), dV += P^T dO,
/// dP = dO V^T, dS = P (dP - delta) (masked), dK += scale dS^T Q, dQ += scale dS K. `exact`: the
/// products that would meet NaN / Inf of q, k or dO through zeros of masked pairs run pair by
/// pair (a masked pair contributes nothing, not 0 * Inf); V meets only dP, whose masked entries
/// `dscores_rows` overwrites.
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_pair(sc: &mut Scratch, b: &BlockPair, dk: &mut [f32], dv: &mut [f32], dq: &mut [f32], d: usize, c: f32, scale: f32, exact: bool) {
    let (rows, nb, rel) = (b.rows, b.nb, b.rel);
    matmul(&mut sc.s, nb, rows, nb, d, Mat::rows(b.q, d), Mat::rows_t(b.k, d), 1.0, false);
    probs_rows(&mut sc.s[..rows * nb], nb, &sc.los, &sc.lims, rel, c, b.lse2);
    // dV += P^T dO
    if exact {
        pt_rows(dv, d, &sc.s[..rows * nb], nb, b.dout, &sc.los, &sc.lims, rel, 1.0);
    } else {
        matmul(dv, d, nb, d, rows, Mat::rows_t(&sc.s, nb), Mat::rows(b.dout, d), 1.0, true);
    }
    // dP = dO V^T, dS = P (dP - delta)
    matmul(&mut sc.dp, nb, rows, nb, d, Mat::rows(b.dout, d), Mat::rows_t(b.v, d), 1.0, false);
    dscores_rows(&sc.s[..rows * nb], &mut sc.dp[..rows * nb], nb, &sc.los, &sc.lims, rel, b.delta);
    // dK += scale * dS^T Q, dQ += scale * dS K
    if exact {
        pt_rows(dk, d, &sc.dp[..rows * nb], nb, b.q, &sc.los, &sc.lims, rel, scale);
        pv_rows(dq, d, &sc.dp[..rows * nb], nb, &sc.los, &sc.lims, rel, b.k, d, scale);
    } else {
        matmul(dk, d, nb, d, rows, Mat::rows_t(&sc.dp, nb), Mat::rows(b.q, d), scale, true);
        matmul(dq, d, rows, d, nb, Mat::rows(&sc.dp, nb), Mat::rows(b.k, d), scale, true);
    }
}

/// dQ = the chunks' buffers (`chunks` consecutive `q_len` parts of `parts`) summed in chunk order,
/// into the first part.
fn sum_chunks(parts: &mut [f32], q_len: usize, chunks: usize) {
    let (dq, rest) = parts.split_at_mut(q_len);
    if chunks > 1 {
        dq.par_chunks_mut(1 << 14).enumerate().for_each(|(i, out)| {
            let (at, n) = (i << 14, out.len());
            for part in rest[..(chunks - 1) * q_len].chunks_exact(q_len) {
                for (o, &x) in out.iter_mut().zip(&part[at..at + n]) {
                    *o += x;
                }
            }
        });
    }
}

/// What a backward task writes: dK, dV (head-major, `[heads_kv, total_k, d]`) and its chunk's dQ
/// buffer (head-major `[heads_q, total_q, d]`).
pub(crate) struct TaskOutputs {
    dk: SharedMut<f32>,
    dv: SharedMut<f32>,
    dq: SharedMut<f32>,
    q_len: usize,
}

impl TaskOutputs {
    /// dK and dV of the head-major range `[start, start + len)`.
    /// # Safety
    /// Tasks take disjoint ranges.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn dk_dv(&self, start: usize, len: usize) -> (&mut [f32], &mut [f32]) {
        (self.dk.slice(start, len), self.dv.slice(start, len))
    }
    /// Chunk `ci`'s dQ buffer over the head-major range `[start, start + len)`.
    /// # Safety
    /// Only the task of chunk `ci` and a kv head takes that kv head's query heads' rows.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn dq(&self, ci: usize, start: usize, len: usize) -> &mut [f32] {
        self.dq.slice(ci * self.q_len + start, len)
    }
}

/// The task frame of both backwards (dense and block-sparse): `task(scratch, kv head, chunk,
/// outputs)` runs for every (kv head, chunk < `chunks`) in parallel over zeroed dK, dV and one
/// zeroed dQ buffer per chunk; the buffers are then summed in chunk order (the same bits for any
/// thread count) and the gradients converted to `dtype` in the token-major layout.
pub(crate) fn run_tasks<F>(dm: &Dims, dtype: DType, chunks: usize, task: F) -> Gradients
where
    F: Fn(&mut Scratch, usize, usize, &TaskOutputs) + Sync,
{
    let (d, tq, tk, hq, hkv) = (dm.head_dim, dm.total_q, dm.total_k, dm.heads_q, dm.heads_kv);
    let ql = dm.q_len();
    let mut dk = vec![0.0f32; dm.kv_len()];
    let mut dv = vec![0.0f32; dm.kv_len()];
    // chunk c's dQ in dq_parts[c * q_len..]; with one chunk it is dQ itself
    let mut dq_buf = Aligned::take(chunks * ql);
    let dq_parts = dq_buf.as_mut_slice();
    dq_parts.par_chunks_mut(1 << 16).for_each(|c| c.fill(0.0));
    let outs = TaskOutputs { dk: SharedMut::new(&mut dk), dv: SharedMut::new(&mut dv), dq: SharedMut::new(dq_parts), q_len: ql };
    let tasks: Vec<(usize, usize)> = (0..hkv).flat_map(|h| (0..chunks).map(move |ci| (h, ci))).collect();
    tasks.par_iter().for_each_init(Scratch::new, |sc, &(hk, ci)| task(sc, hk, ci, &outs));
    sum_chunks(dq_parts, ql, chunks);
    let grads = Gradients {
        dq: from_head_major(&dq_parts[..ql], tq, hq, d, dtype),
        dk: from_head_major(&dk, tk, hkv, d, dtype),
        dv: from_head_major(&dv, tk, hkv, d, dtype),
    };
    dq_buf.give();
    grads
}

/// FlashAttention-2's five products per (query block, key block): S = Q K^T, dV += P^T dO,
/// dP = dO V^T, dK += dS^T Q and dQ += dS K (P recomputed once from the LSE). One task per (kv
/// head, chunk of key blocks) owns those keys' dK/dV (every segment and GQA query head that sees
/// them, in a fixed order) and its chunk's dQ buffer.
pub(crate) fn backward(spec: &AttnSpec, q: HostView, k: HostView, v: HostView, g: BackwardInputs) -> Gradients {
    let dm = spec.dims;
    let (d, tq, tk, hkv) = (dm.head_dim, dm.total_q, dm.total_k, dm.heads_kv);
    let p = prepare(spec, q, k, v, &g);
    let c = spec.scale * std::f32::consts::LOG2_E;
    let gs = dm.group_size();
    // NaN / Inf in q, k or dout: the products that meet them through zeros of masked pairs run
    // pair by pair (a masked pair must contribute nothing, not 0 * Inf); V meets only dP, whose
    // masked entries dscores_rows overwrites
    let exact = !(all_finite(&p.q) && all_finite(&p.k) && all_finite(&p.dout));

    let ql = dm.q_len();
    let blocks = tk.div_ceil(BKB);
    let chunks = key_chunks(hkv, blocks, ql);
    run_tasks(&dm, spec.dtype, chunks, |sc, hk, ci, outs| {
        let (b0, b1) = (ci * blocks / chunks, (ci + 1) * blocks / chunks);
        for kb in (b0 * BKB..(b1 * BKB).min(tk)).step_by(BKB) {
            let nk = BKB.min(tk - kb);
            // SAFETY: tasks own disjoint (kv head, key block) ranges.
            let (dk_blk, dv_blk) = unsafe { outs.dk_dv((hk * tk + kb) * d, nk * d) };
            for seg in &spec.segments {
                let a = kb.max(seg.k_start);
                let b = (kb + nk).min(seg.k_start + seg.k_len);
                if a >= b || seg.q_len == 0 {
                    continue;
                }
                let nb = b - a;
                let rel = a - seg.k_start;
                // the rows that see a key of [a, b)
                let (r_min, r_end) = spec.rows_seeing(seg, rel, rel + nb);
                let kblk = &p.k[(hk * tk + a) * d..][..nb * d];
                let vblk = &p.v[(hk * tk + a) * d..][..nb * d];
                let dk_out = &mut dk_blk[(a - kb) * d..][..nb * d];
                let dv_out = &mut dv_blk[(a - kb) * d..][..nb * d];
                for h in hk * gs..(hk + 1) * gs {
                    for r0 in (r_min..r_end).step_by(BQ) {
                        let rows = BQ.min(r_end - r0);
                        let row0 = h * tq + seg.q_start + r0;
                        let qblk = &p.q[row0 * d..][..rows * d];
                        let doblk = &p.dout[row0 * d..][..rows * d];
                        // SAFETY: chunk ci's buffer rows of the query heads of kv head hk: this task's alone.
                        let dq_out = unsafe { outs.dq(ci, row0 * d, rows * d) };
                        row_bounds(spec, seg, r0, rows, &mut sc.los, &mut sc.lims);
                        let pair = BlockPair {
                            q: qblk,
                            dout: doblk,
                            k: kblk,
                            v: vblk,
                            lse2: &p.lse2[row0..row0 + rows],
                            delta: &p.delta[row0..row0 + rows],
                            rows,
                            nb,
                            rel,
                        };
                        block_pair(sc, &pair, dk_out, dv_out, dq_out, d, c, spec.scale, exact);
                    }
                }
            }
        }
    })
}
