//! CPU backward (FlashAttention-2 style, recomputing P from the LSE once), deterministic by
//! construction: dK/dV are owned by tasks over (kv head, chunk of key blocks) that loop over every
//! segment and query head seeing those keys (so overlapping groups and GQA heads accumulate in a
//! fixed order); each chunk adds its dQ into its own buffer, and the buffers are summed in chunk
//! order.

use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::backward_tiles::{self as tiles, KeyPanels, Operand};
#[cfg(target_arch = "x86_64")]
use super::kernel::Prefetch;
use super::forward::{all_finite, pv_rows, row_bounds, BQ};
use super::pool::Aligned;
use super::layout::{from_head_major, matmul, to_f32_cow, to_head_major_into, Mat, SharedMut};
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
    /// S / P and dP / dS of one block pair (64-byte aligned; the tile path's rows are a multiple
    /// of 16 floats apart)
    s: Aligned,
    dp: Aligned,
    pub(crate) lims: Vec<usize>,
    pub(crate) los: Vec<usize>,
    #[cfg(target_arch = "x86_64")]
    panels: KeyPanels,
}

impl Scratch {
    pub(crate) fn new() -> Self {
        Scratch {
            s: Aligned::fresh(0),
            dp: Aligned::fresh(0),
            lims: Vec::with_capacity(BQ),
            los: Vec::with_capacity(BQ),
            #[cfg(target_arch = "x86_64")]
            panels: KeyPanels::new(),
        }
    }

    /// S and dP buffers of at least `len` floats each.
    fn grow(&mut self, len: usize) {
        if self.s.as_slice().len() < len {
            self.s = Aligned::fresh(len);
            self.dp = Aligned::fresh(len);
        }
    }
}

/// How a backward runs its block-pair products.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Products {
    /// AVX-512 register tiles (`backward_tiles`): x86-64 with AVX-512, head dim a multiple of 16,
    /// finite q, k and dO.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Tiles,
    /// the gemm crate
    Gemm,
    /// NaN / Inf in q, k or dO: the products that meet them through zeros of masked pairs run pair
    /// by pair (a masked pair must contribute nothing, not 0 * Inf); V meets only dP, whose masked
    /// entries are overwritten
    Exact,
}

impl Products {
    pub(crate) fn choose(p: &Prepared, d: usize) -> Self {
        if !(all_finite(p.q()) && all_finite(p.k()) && all_finite(p.dout())) {
            return Products::Exact;
        }
        #[cfg(target_arch = "x86_64")]
        if super::forward::use_tiles() && d.is_multiple_of(16) {
            return Products::Tiles;
        }
        let _ = d;
        Products::Gemm
    }
}

/// The backward's inputs in head-major f32 (`[heads, tokens, d]`; q and dO `total_q` tokens of
/// `heads_q` heads, k and v `total_k` of `heads_kv`) in one pooled buffer, with delta and the LSE.
pub(crate) struct Prepared {
    buf: Aligned,
    /// q, k, v, dO lengths (consecutive in `buf`)
    lens: [usize; 4],
    /// rowsum(dO * O), `[heads_q, total_q]`
    pub(crate) delta: Vec<f32>,
    /// LSE in base-2 units, `[heads_q, total_q]`
    pub(crate) lse2: Vec<f32>,
}

impl Prepared {
    fn part(&self, i: usize) -> &[f32] {
        let at: usize = self.lens[..i].iter().sum();
        &self.buf.as_slice()[at..at + self.lens[i]]
    }
    pub(crate) fn q(&self) -> &[f32] {
        self.part(0)
    }
    pub(crate) fn k(&self) -> &[f32] {
        self.part(1)
    }
    pub(crate) fn v(&self) -> &[f32] {
        self.part(2)
    }
    pub(crate) fn dout(&self) -> &[f32] {
        self.part(3)
    }
    /// Returns the buffer to the pool.
    pub(crate) fn release(self) {
        self.buf.give();
    }
}

multiversion! {
    /// `delta[i] = dout[i] . o(i)` for the head-major rows `i0..i0 + delta.len()` (`[heads, tq, d]`)
    /// with `o` token-major (`[tq, heads, d]`).
    #[allow(clippy::too_many_arguments)]
    fn delta_rows(delta: &mut [f32], i0: usize, dout: &[f32], o: &[f32], tq: usize, heads: usize, d: usize) {
        for (j, x) in delta.iter_mut().enumerate() {
            let i = i0 + j;
            let (h, t) = (i / tq, i % tq);
            *x = dot(&dout[i * d..(i + 1) * d], &o[(t * heads + h) * d..][..d]);
        }
    }
}

pub(crate) fn prepare(spec: &AttnSpec, q: HostView, k: HostView, v: HostView, g: &BackwardInputs) -> Prepared {
    let dm = spec.dims;
    let (d, tq, tk) = (dm.head_dim, dm.total_q, dm.total_k);
    let lens = [dm.q_len(), dm.kv_len(), dm.kv_len(), dm.q_len()];
    let mut buf = Aligned::take(lens.iter().sum());
    {
        let (qh, rest) = buf.as_mut_slice().split_at_mut(lens[0]);
        let (kh, rest) = rest.split_at_mut(lens[1]);
        let (vh, doh) = rest.split_at_mut(lens[2]);
        to_head_major_into(q, tq, dm.heads_q, d, qh);
        to_head_major_into(k, tk, dm.heads_kv, d, kh);
        to_head_major_into(v, tk, dm.heads_kv, d, vh);
        to_head_major_into(g.dout, tq, dm.heads_q, d, doh);
    }
    // out is read in place (token-major); only delta needs it
    let o = to_f32_cow(g.out);
    let hq = dm.heads_q;
    let dout = &buf.as_slice()[lens[0] + lens[1] + lens[2]..];
    let mut delta = vec![0.0f32; dm.lse_len()];
    delta.par_chunks_mut(1 << 10).enumerate().for_each(|(c, x)| delta_rows(x, c << 10, dout, &o, tq, hq, d));
    Prepared { buf, lens, delta, lse2: g.lse.iter().map(|&x| x * std::f32::consts::LOG2_E).collect() }
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
    /// What the next block pair reads first (prefetched into L2 while this one runs): its q, dO
    /// and dQ rows, as (pointer, floats); null / 0 where unknown. Only the tiles use it.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) next: [(*const f32, usize); 3],
}

/// No prefetch for the next block pair.
pub(crate) const NO_NEXT: [(*const f32, usize); 3] = [(std::ptr::null(), 0); 3];

/// FlashAttention-2's five products of one block pair: S = Q K^T, P (masked), dV += P^T dO,
/// dP = dO V^T, dS = P (dP - delta) (masked), dK += scale dS^T Q, dQ += scale dS K, run as
/// `how` says (see [`Products`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_pair(sc: &mut Scratch, b: &BlockPair, dk: &mut [f32], dv: &mut [f32], dq: &mut [f32], d: usize, c: f32, scale: f32, how: Products) {
    #[cfg(target_arch = "x86_64")]
    if how == Products::Tiles {
        return block_pair_tiles(sc, b, dk, dv, dq, d, c, scale);
    }
    let exact = how == Products::Exact;
    let (rows, nb, rel) = (b.rows, b.nb, b.rel);
    sc.grow(rows * nb);
    let (s, dp) = (sc.s.as_mut_slice(), sc.dp.as_mut_slice());
    matmul(s, nb, rows, nb, d, Mat::rows(b.q, d), Mat::rows_t(b.k, d), 1.0, false);
    probs_rows(&mut s[..rows * nb], nb, &sc.los, &sc.lims, rel, c, b.lse2);
    // dV += P^T dO
    if exact {
        pt_rows(dv, d, &s[..rows * nb], nb, b.dout, &sc.los, &sc.lims, rel, 1.0);
    } else {
        matmul(dv, d, nb, d, rows, Mat::rows_t(s, nb), Mat::rows(b.dout, d), 1.0, true);
    }
    // dP = dO V^T, dS = P (dP - delta)
    matmul(dp, nb, rows, nb, d, Mat::rows(b.dout, d), Mat::rows_t(b.v, d), 1.0, false);
    dscores_rows(&s[..rows * nb], &mut dp[..rows * nb], nb, &sc.los, &sc.lims, rel, b.delta);
    // dK += scale * dS^T Q, dQ += scale * dS K
    if exact {
        pt_rows(dk, d, &dp[..rows * nb], nb, b.q, &sc.los, &sc.lims, rel, scale);
        pv_rows(dq, d, &dp[..rows * nb], nb, &sc.los, &sc.lims, rel, b.k, d, scale);
    } else {
        matmul(dk, d, nb, d, rows, Mat::rows_t(dp, nb), Mat::rows(b.q, d), scale, true);
        matmul(dq, d, rows, d, nb, Mat::rows(dp, nb), Mat::rows(b.k, d), scale, true);
    }
}

/// [`block_pair`] on the AVX-512 tiles: K^T and V^T packed once per key block (`sc.panels`), S and
/// dP in rows of `ceil16(nb)` floats, P and dS (scale folded in) in one pass, then dV, dK and dQ
/// accumulated in place.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn block_pair_tiles(sc: &mut Scratch, b: &BlockPair, dk: &mut [f32], dv: &mut [f32], dq: &mut [f32], d: usize, c: f32, scale: f32) {
    use super::kernel::G;
    let (rows, nb, rel) = (b.rows, b.nb, b.rel);
    let lds = nb.div_ceil(16) * 16;
    assert!(d.is_multiple_of(16) && b.q.len() >= rows * d && b.dout.len() >= rows * d && b.k.len() >= nb * d && b.v.len() >= nb * d);
    assert!(dk.len() >= nb * d && dv.len() >= nb * d && dq.len() >= rows * d && b.lse2.len() >= rows && b.delta.len() >= rows);
    sc.grow(rows * lds);
    sc.panels.pack(b.k, b.v, nb, d);
    let (kt, vt) = sc.panels.panels();
    let (s, dp) = (sc.s.as_mut_slice(), sc.dp.as_mut_slice());
    // the next pair's q, dO and dQ rows stream into L2 over this pair's tiles
    let n_tiles = 3 * tiles::tiles(rows, lds) + 2 * tiles::tiles(nb, d) + tiles::tiles(rows, d);
    let mut pf = [Prefetch::new([b.next[0], b.next[1]], n_tiles), Prefetch::new([b.next[2], (std::ptr::null(), 0)], n_tiles)];
    let pf = &mut pf[..];
    let rows_of = |x: &[f32]| Operand { ptr: x.as_ptr(), rs: d, cs: 1 };
    let panels = |x: *const f32| Operand { ptr: x, rs: G, cs: G * d };
    // SAFETY: AVX-512 was detected (Products::Tiles); the operands hold rows x d (q, dO), nb x d
    // (k, v), the packed panels ceil16(nb) keys, s / dp rows x lds floats (asserted / grown above).
    unsafe {
        tiles::product(rows, lds, d, rows_of(b.q), panels(kt), s.as_mut_ptr(), lds, false, pf);
        tiles::product(rows, lds, d, rows_of(b.dout), panels(vt), dp.as_mut_ptr(), lds, false, pf);
        tiles::probs_dscores(s, dp, lds, nb, &sc.los, &sc.lims, rel, c, b.lse2, b.delta, scale);
        // dV += P^T dO and dK += dS^T Q: A is read transposed in place (key i, row p)
        let col_panels = |x: &[f32]| Operand { ptr: x.as_ptr(), rs: d, cs: G };
        tiles::product(nb, d, rows, Operand { ptr: s.as_ptr(), rs: 1, cs: lds }, col_panels(b.dout), dv.as_mut_ptr(), d, true, pf);
        tiles::product(nb, d, rows, Operand { ptr: dp.as_ptr(), rs: 1, cs: lds }, col_panels(b.q), dk.as_mut_ptr(), d, true, pf);
        // dQ += dS K
        tiles::product(rows, d, nb, Operand { ptr: dp.as_ptr(), rs: lds, cs: 1 }, col_panels(b.k), dq.as_mut_ptr(), d, true, pf);
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
    /// Where chunk `ci`'s dQ row at head-major offset `start` lies (for prefetches only).
    pub(crate) fn dq_at(&self, ci: usize, start: usize) -> *const f32 {
        self.dq.ptr_at(ci * self.q_len + start)
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
/// thread count) and the gradients converted to `dtype` in the token-major layout. Tasks start
/// in decreasing order of `cost(chunk)` (an estimate of a chunk's work), each taken by the next
/// free thread: causal chunks differ in work several-fold, and the largest ones started last
/// left one core idle at the end (2 threads: 0-15% of the task time). Who runs a task does not
/// change its bits.
pub(crate) fn run_tasks<F, C>(dm: &Dims, dtype: DType, chunks: usize, cost: C, task: F) -> Gradients
where
    F: Fn(&mut Scratch, usize, usize, &TaskOutputs) + Sync,
    C: Fn(usize) -> usize,
{
    let (d, tq, tk, hq, hkv) = (dm.head_dim, dm.total_q, dm.total_k, dm.heads_q, dm.heads_kv);
    let (ql, kl) = (dm.q_len(), dm.kv_len());
    // dK, dV, then chunk c's dQ at 2 * kl + c * ql (with one chunk it is dQ itself), pooled:
    // fresh pages would cost a fault each
    let mut buf = Aligned::take(2 * kl + chunks * ql);
    buf.as_mut_slice().par_chunks_mut(1 << 16).for_each(|c| c.fill(0.0));
    let (dk, rest) = buf.as_mut_slice().split_at_mut(kl);
    let (dv, dq_parts) = rest.split_at_mut(kl);
    let outs = TaskOutputs { dk: SharedMut::new(dk), dv: SharedMut::new(dv), dq: SharedMut::new(dq_parts), q_len: ql };
    let costs: Vec<usize> = (0..chunks).map(cost).collect();
    let mut tasks: Vec<(usize, usize)> = (0..hkv).flat_map(|h| (0..chunks).map(move |ci| (h, ci))).collect();
    tasks.sort_by_key(|&(h, ci)| (std::cmp::Reverse(costs[ci]), h, ci));
    let next = AtomicUsize::new(0);
    (0..rayon::current_num_threads().min(tasks.len())).into_par_iter().for_each(|_| {
        let mut sc = Scratch::new();
        while let Some(&(hk, ci)) = tasks.get(next.fetch_add(1, Ordering::Relaxed)) {
            task(&mut sc, hk, ci, &outs);
        }
    });
    sum_chunks(dq_parts, ql, chunks);
    let grads = Gradients {
        dq: from_head_major(&dq_parts[..ql], tq, hq, d, dtype),
        dk: from_head_major(dk, tk, hkv, d, dtype),
        dv: from_head_major(dv, tk, hkv, d, dtype),
    };
    buf.give();
    grads
}

/// FlashAttention-2's five products per (query block, key block): S = Q K^T, dV += P^T dO,
/// dP = dO V^T, dK += dS^T Q and dQ += dS K (P recomputed once from the LSE). One task per (kv
/// head, chunk of key blocks) owns those keys' dK/dV (every segment and GQA query head that sees
/// them, in a fixed order) and its chunk's dQ buffer.
pub(crate) fn backward(spec: &AttnSpec, q: HostView, k: HostView, v: HostView, g: BackwardInputs) -> Gradients {
    backward_as(spec, q, k, v, g, None)
}

/// [`backward`] with the products of `force` (tests compare the paths) unless the inputs need
/// [`Products::Exact`].
fn backward_as(spec: &AttnSpec, q: HostView, k: HostView, v: HostView, g: BackwardInputs, force: Option<Products>) -> Gradients {
    let dm = spec.dims;
    let (d, tq, tk, hkv) = (dm.head_dim, dm.total_q, dm.total_k, dm.heads_kv);
    let p = prepare(spec, q, k, v, &g);
    let c = spec.scale * std::f32::consts::LOG2_E;
    let gs = dm.group_size();
    let how = match (Products::choose(&p, d), force) {
        (Products::Exact, _) | (_, None) => Products::choose(&p, d),
        (_, Some(f)) => f,
    };
    // query rows per block pair, keys per dK/dV block
    let (bq, bkb) = (BQ, BKB);

    let ql = dm.q_len();
    let blocks = tk.div_ceil(bkb);
    let chunks = key_chunks(hkv, blocks, ql);
    // a chunk's work: the (row, key block) pairs it visits
    let cost = |ci: usize| {
        let (b0, b1) = (ci * blocks / chunks, (ci + 1) * blocks / chunks);
        let mut pairs = 0;
        for kb in (b0 * bkb..(b1 * bkb).min(tk)).step_by(bkb) {
            for seg in &spec.segments {
                let a = kb.max(seg.k_start);
                let b = (kb + bkb.min(tk - kb)).min(seg.k_start + seg.k_len);
                if a < b {
                    let (r0, r1) = spec.rows_seeing(seg, a - seg.k_start, b - seg.k_start);
                    pairs += r1 - r0;
                }
            }
        }
        pairs
    };
    let grads = run_tasks(&dm, spec.dtype, chunks, cost, |sc, hk, ci, outs| {
        let (b0, b1) = (ci * blocks / chunks, (ci + 1) * blocks / chunks);
        for kb in (b0 * bkb..(b1 * bkb).min(tk)).step_by(bkb) {
            let nk = bkb.min(tk - kb);
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
                let kblk = &p.k()[(hk * tk + a) * d..][..nb * d];
                let vblk = &p.v()[(hk * tk + a) * d..][..nb * d];
                let dk_out = &mut dk_blk[(a - kb) * d..][..nb * d];
                let dv_out = &mut dv_blk[(a - kb) * d..][..nb * d];
                for h in hk * gs..(hk + 1) * gs {
                    for r0 in (r_min..r_end).step_by(bq) {
                        let rows = bq.min(r_end - r0);
                        let row0 = h * tq + seg.q_start + r0;
                        let qblk = &p.q()[row0 * d..][..rows * d];
                        let doblk = &p.dout()[row0 * d..][..rows * d];
                        // SAFETY: chunk ci's buffer rows of the query heads of kv head hk: this task's alone.
                        let dq_out = unsafe { outs.dq(ci, row0 * d, rows * d) };
                        row_bounds(spec, seg, r0, rows, &mut sc.los, &mut sc.lims);
                        // the next row block of this head (none after the last)
                        let next_rows = bq.min(r_end.saturating_sub(r0 + bq));
                        let nrow0 = row0 + rows;
                        let next = if next_rows == 0 {
                            NO_NEXT
                        } else {
                            let n = next_rows * d;
                            [(p.q()[nrow0 * d..].as_ptr(), n), (p.dout()[nrow0 * d..].as_ptr(), n), (outs.dq_at(ci, nrow0 * d), n)]
                        };
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
                            next,
                        };
                        block_pair(sc, &pair, dk_out, dv_out, dq_out, d, c, spec.scale, how);
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
    use crate::reference::{backward_f64, test_values};
    use crate::spec::TensorMeta;

    /// Every product path this CPU can run (the AVX-512 tiles where available, the gemm crate)
    /// against the f64 reference on random inputs: one token, lengths off the block sizes, varlen
    /// with bottom-right causal alignment, GQA, d 16 / 64 / 80 / 128 (and 24, which only the gemm
    /// path takes), a sliding window; and the same bits for 1, 2 and 3 threads.
    #[test]
    fn paths_match_f64_reference_and_thread_counts() {
        // (segments (q_len, k_len), heads_q, heads_kv, head_dim, causal, window)
        type Case<'a> = (&'a [(usize, usize)], usize, usize, usize, bool, Option<(i64, i64)>);
        let cases: &[Case] = &[
            (&[(1, 1)], 1, 1, 16, true, None),
            (&[(63, 63), (65, 130), (1, 7)], 4, 2, 64, true, None),
            (&[(200, 200)], 2, 1, 128, false, None),
            (&[(129, 77), (5, 300)], 3, 3, 80, true, None),
            (&[(150, 150)], 2, 2, 64, true, Some((20, 5))),
            (&[(70, 90)], 2, 1, 24, false, None),
        ];
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut paths = vec![Products::Gemm];
        #[cfg(target_arch = "x86_64")]
        if super::super::forward::use_tiles() {
            paths.push(Products::Tiles);
        }
        for (ci, &(segs, hq, hkv, d, causal, window)) in cases.iter().enumerate() {
            let (tq, tk): (usize, usize) = (segs.iter().map(|s| s.0).sum(), segs.iter().map(|s| s.1).sum());
            let (mut cq, mut ck) = (vec![0i32], vec![0i32]);
            for s in segs {
                cq.push(cq.last().unwrap() + s.0 as i32);
                ck.push(ck.last().unwrap() + s.1 as i32);
            }
            let (mq, mk) = (segs.iter().map(|s| s.0).max().unwrap(), segs.iter().map(|s| s.1).max().unwrap());
            let qm = TensorMeta::new(&[tq, hq, d], DType::F32);
            let km = TensorMeta::new(&[tk, hkv, d], DType::F32);
            let mut spec = AttnSpec::varlen(&qm, &km, &km, &cq, &ck, mq, mk, None, causal).unwrap();
            if let Some((l, r)) = window {
                spec = spec.with_window(l, r).unwrap();
            }
            let seed = ci as u64 * 10;
            let (q, k, v, go) = (test_values(tq * hq * d, seed + 1), test_values(tk * hkv * d, seed + 2), test_values(tk * hkv * d, seed + 3), test_values(tq * hq * d, seed + 4));
            let f64v = |x: &[f32]| x.iter().map(|&y| y as f64).collect::<Vec<f64>>();
            let want = backward_f64(&spec, &f64v(&q), &f64v(&k), &f64v(&v), &f64v(&go));
            let (qd, kd, vd, gd) = (HostData::F32(q), HostData::F32(k), HostData::F32(v), HostData::F32(go));
            let f = super::super::forward::forward(&spec, qd.view(), kd.view(), vd.view());
            let gin = BackwardInputs { out: f.out.view(), lse: &f.lse, dout: gd.view(), deterministic: true };
            for &how in &paths {
                if how != Products::Gemm && !d.is_multiple_of(16) {
                    continue;
                }
                let run = |threads: usize| {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    pool.install(|| backward_as(&spec, qd.view(), kd.view(), vd.view(), gin, Some(how)))
                };
                let got = run(2);
                for (name, g, w) in [("dq", &got.dq, &want.0), ("dk", &got.dk, &want.1), ("dv", &got.dv, &want.2)] {
                    for (i, (x, y)) in g.to_f32_vec().iter().zip(w).enumerate() {
                        assert!((*x as f64 - y).abs() <= 1e-4 * (1.0 + y.abs()), "case {ci} {how:?}: {name}[{i}] {x} vs {y}");
                    }
                }
                for threads in [1, 3] {
                    let again = run(threads);
                    assert!(again.dq == got.dq && again.dk == got.dk && again.dv == got.dv, "case {ci} {how:?}: {threads} threads changed the bits");
                }
            }
        }
    }
}
