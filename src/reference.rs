//! Naive f64 attention, forward and backward: the yardstick every backend is tested against.
//! O(rows x keys x head_dim) with no blocking; meant for tests and small checks only.
//! Buffers use the spec's token-major layouts (`[tokens, heads, d]`, v, out, dout and dv at
//! v's head_dim; lse `[heads_q, total_q]`).
//! Every key set is read key by key: paged K,V through `AttnSpec::kv_row`, a block-sparse
//! spec's block mask expanded to a token mask (`SparseView::visible`; no block logic shared with
//! the backends).

use crate::spec::AttnSpec;

/// f64 gradients `(dq, dk, dv)`.
pub type GradsF64 = (Vec<f64>, Vec<f64>, Vec<f64>);

/// Logical keys (absolute) that row `r` of segment `si` sees for query head `h`: the row's key
/// range, thinned to the listed blocks' keys when the spec is block-sparse.
fn row_keys(spec: &AttnSpec, si: usize, r: usize, h: usize) -> Vec<usize> {
    let seg = &spec.segments[si];
    let (lo, hi) = spec.row_key_range(seg, r);
    match spec.block_sparse() {
        Some(s) => (lo..hi).filter(|&j| s.visible(si, h, r, j - seg.k_start)).collect(),
        None => (lo..hi).collect(),
    }
}

/// Offset of logical key `j`, kv head `hk` in k.
fn kv_at(spec: &AttnSpec, j: usize, hk: usize) -> usize {
    (spec.kv_row(j) * spec.dims.heads_kv + hk) * spec.dims.head_dim
}

/// Offset of logical key `j`, kv head `hk` in v (v's own head_dim).
fn v_at(spec: &AttnSpec, j: usize, hk: usize) -> usize {
    (spec.kv_row(j) * spec.dims.heads_kv + hk) * spec.dims.head_dim_v
}

/// Softmax of one (row, head) over `keys`: `(probabilities, lse)`; `None` when the row sees no
/// key.
fn row_probs(spec: &AttnSpec, q: &[f64], k: &[f64], t: usize, h: usize, keys: &[usize]) -> Option<(Vec<f64>, f64)> {
    let dm = spec.dims;
    let d = dm.head_dim;
    if keys.is_empty() {
        return None;
    }
    let hk = h / dm.group_size();
    let qi = &q[(t * dm.heads_q + h) * d..][..d];
    let s: Vec<f64> = keys
        .iter()
        .map(|&j| spec.scale as f64 * qi.iter().zip(&k[kv_at(spec, j, hk)..][..d]).map(|(a, b)| a * b).sum::<f64>())
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let l: f64 = e.iter().sum();
    Some((e.into_iter().map(|x| x / l).collect(), m + l.ln()))
}

/// Calls `f(row, head, keys)` for every query row of every segment and every query head, with
/// the logical keys the row sees for that head.
fn for_each_row(spec: &AttnSpec, mut f: impl FnMut(usize, usize, &[usize])) {
    for (si, seg) in spec.segments.iter().enumerate() {
        for r in 0..seg.q_len {
            for h in 0..spec.dims.heads_q {
                f(seg.q_start + r, h, &row_keys(spec, si, r, h));
            }
        }
    }
}

/// Forward: `(out, lse)`; rows that see no key give out 0 and lse +inf.
pub fn forward_f64(spec: &AttnSpec, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let dm = spec.dims;
    let dv = dm.head_dim_v;
    let mut out = vec![0.0; dm.out_len()];
    let mut lse = vec![f64::INFINITY; dm.lse_len()];
    for_each_row(spec, |t, h, keys| {
        let hk = h / dm.group_size();
        if let Some((p, l)) = row_probs(spec, q, k, t, h, keys) {
            lse[h * dm.total_q + t] = l;
            let o = &mut out[(t * dm.heads_q + h) * dv..][..dv];
            for (&j, pj) in keys.iter().zip(p) {
                for (x, vv) in o.iter_mut().zip(&v[v_at(spec, j, hk)..][..dv]) {
                    *x += pj * vv;
                }
            }
        }
    });
    (out, lse)
}

/// Backward from `dout`: `(dq, dk, dv)` with exact f64 softmax.
pub fn backward_f64(spec: &AttnSpec, q: &[f64], k: &[f64], v: &[f64], dout: &[f64]) -> GradsF64 {
    let dm = spec.dims;
    let (d, dvd) = (dm.head_dim, dm.head_dim_v);
    let (mut dq, mut dk, mut dv) = (vec![0.0; dm.q_len()], vec![0.0; dm.kv_len()], vec![0.0; dm.v_len()]);
    let sc = spec.scale as f64;
    for_each_row(spec, |t, h, keys| {
        let hk = h / dm.group_size();
        let Some((p, _)) = row_probs(spec, q, k, t, h, keys) else { return };
        let qo = (t * dm.heads_q + h) * d;
        let oo = (t * dm.heads_q + h) * dvd;
        let go = &dout[oo..oo + dvd];
        let dp: Vec<f64> = keys.iter().map(|&j| go.iter().zip(&v[v_at(spec, j, hk)..][..dvd]).map(|(a, b)| a * b).sum()).collect();
        let delta: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
        for (idx, &j) in keys.iter().enumerate() {
            let (ko, vo) = (kv_at(spec, j, hk), v_at(spec, j, hk));
            let ds = p[idx] * (dp[idx] - delta);
            for x in 0..dvd {
                dv[vo + x] += p[idx] * go[x];
            }
            for x in 0..d {
                dq[qo + x] += sc * ds * k[ko + x];
                dk[ko + x] += sc * ds * q[qo + x];
            }
        }
    });
    (dq, dk, dv)
}

/// `n` pseudo-random values in [-1, 1) from `seed` (a 64-bit LCG): test inputs that differ per
/// seed and are the same on every run.
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) as f64 / (1u64 << 31) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}
