//! Naive f64 attention, forward and backward: the yardstick every backend is tested against.
//! O(rows x keys x head_dim) with no blocking; meant for tests and small checks only.
//! Buffers use the spec's token-major layouts (`[tokens, heads, d]`, lse `[heads_q, total_q]`).
//! Paged K,V (`AttnSpec::kv_pages`) are read through `AttnSpec::kv_row`. The `sparse_*` functions take a [`crate::sparse::SparseSpec`] and expand its block mask to a
//! token mask key by key (no block logic shared with the backends).

use crate::spec::AttnSpec;

/// f64 gradients `(dq, dk, dv)`.
pub type GradsF64 = (Vec<f64>, Vec<f64>, Vec<f64>);

/// Softmax probabilities of one (row, head): `(first key, probabilities, lse)`; `None` when the
/// row sees no key.
fn row_probs(spec: &AttnSpec, q: &[f64], k: &[f64], t: usize, h: usize, lo: usize, hi: usize) -> Option<(Vec<f64>, f64)> {
    let dm = spec.dims;
    let d = dm.head_dim;
    if hi <= lo {
        return None;
    }
    let hk = h / dm.group_size();
    let qi = &q[(t * dm.heads_q + h) * d..][..d];
    let s: Vec<f64> = (lo..hi)
        .map(|j| {
            let kj = &k[(spec.kv_row(j) * dm.heads_kv + hk) * d..][..d];
            spec.scale as f64 * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>()
        })
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let l: f64 = e.iter().sum();
    Some((e.into_iter().map(|x| x / l).collect(), m + l.ln()))
}

/// Forward: `(out, lse)`; rows that see no key give out 0 and lse +inf.
pub fn forward_f64(spec: &AttnSpec, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let dm = spec.dims;
    let d = dm.head_dim;
    let mut out = vec![0.0; dm.q_len()];
    let mut lse = vec![f64::INFINITY; dm.lse_len()];
    for seg in &spec.segments {
        for r in 0..seg.q_len {
            let t = seg.q_start + r;
            let (lo, hi) = spec.row_key_range(seg, r);
            for h in 0..dm.heads_q {
                let hk = h / dm.group_size();
                if let Some((p, l)) = row_probs(spec, q, k, t, h, lo, hi) {
                    lse[h * dm.total_q + t] = l;
                    let o = &mut out[(t * dm.heads_q + h) * d..][..d];
                    for (j, pj) in (lo..hi).zip(p) {
                        for (x, vv) in o.iter_mut().zip(&v[(spec.kv_row(j) * dm.heads_kv + hk) * d..][..d]) {
                            *x += pj * vv;
                        }
                    }
                }
            }
        }
    }
    (out, lse)
}

/// Backward from `dout`: `(dq, dk, dv)` with exact f64 softmax.
pub fn backward_f64(spec: &AttnSpec, q: &[f64], k: &[f64], v: &[f64], dout: &[f64]) -> GradsF64 {
    let dm = spec.dims;
    let d = dm.head_dim;
    let (mut dq, mut dk, mut dv) = (vec![0.0; dm.q_len()], vec![0.0; dm.kv_len()], vec![0.0; dm.kv_len()]);
    let sc = spec.scale as f64;
    for seg in &spec.segments {
        for r in 0..seg.q_len {
            let t = seg.q_start + r;
            let (lo, hi) = spec.row_key_range(seg, r);
            for h in 0..dm.heads_q {
                let hk = h / dm.group_size();
                let Some((p, _)) = row_probs(spec, q, k, t, h, lo, hi) else { continue };
                let qo = (t * dm.heads_q + h) * d;
                let go = &dout[qo..qo + d];
                let dp: Vec<f64> = (lo..hi)
                    .map(|j| go.iter().zip(&v[(spec.kv_row(j) * dm.heads_kv + hk) * d..][..d]).map(|(a, b)| a * b).sum())
                    .collect();
                let delta: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (idx, j) in (lo..hi).enumerate() {
                    let ko = (spec.kv_row(j) * dm.heads_kv + hk) * d;
                    let ds = p[idx] * (dp[idx] - delta);
                    for x in 0..d {
                        dv[ko + x] += p[idx] * go[x];
                        dq[qo + x] += sc * ds * k[ko + x];
                        dk[ko + x] += sc * ds * q[qo + x];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}

/// Softmax of one (row, head) over an explicit key list: `(probabilities, lse)`; `None` when empty.
fn row_probs_keys(spec: &AttnSpec, q: &[f64], k: &[f64], t: usize, h: usize, keys: &[usize]) -> Option<(Vec<f64>, f64)> {
    let dm = spec.dims;
    let d = dm.head_dim;
    if keys.is_empty() {
        return None;
    }
    let hk = h / dm.group_size();
    let qi = &q[(t * dm.heads_q + h) * d..][..d];
    let s: Vec<f64> = keys
        .iter()
        .map(|&j| spec.scale as f64 * qi.iter().zip(&k[(j * dm.heads_kv + hk) * d..][..d]).map(|(a, b)| a * b).sum::<f64>())
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let l: f64 = e.iter().sum();
    Some((e.into_iter().map(|x| x / l).collect(), m + l.ln()))
}

/// Absolute keys row `r` of sequence `b`, query head `h`, sees under the block mask: the dense
/// token mask expanded from the block index (brute force over every key).
fn sparse_keys(s: &crate::sparse::SparseSpec, b: usize, h: usize, r: usize) -> Vec<usize> {
    let seg = &s.attn.segments[b];
    (0..seg.k_len).filter(|&j| s.visible(b, h, r, j)).map(|j| seg.k_start + j).collect()
}

/// Block-sparse forward: dense f64 attention under the token mask expanded from the block mask.
pub fn sparse_forward_f64(s: &crate::sparse::SparseSpec, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let spec = &s.attn;
    let dm = spec.dims;
    let d = dm.head_dim;
    let mut out = vec![0.0; dm.q_len()];
    let mut lse = vec![f64::INFINITY; dm.lse_len()];
    for (b, seg) in spec.segments.iter().enumerate() {
        for r in 0..seg.q_len {
            let t = seg.q_start + r;
            for h in 0..dm.heads_q {
                let hk = h / dm.group_size();
                let keys = sparse_keys(s, b, h, r);
                if let Some((p, l)) = row_probs_keys(spec, q, k, t, h, &keys) {
                    lse[h * dm.total_q + t] = l;
                    let o = &mut out[(t * dm.heads_q + h) * d..][..d];
                    for (&j, pj) in keys.iter().zip(p) {
                        for (x, vv) in o.iter_mut().zip(&v[(j * dm.heads_kv + hk) * d..][..d]) {
                            *x += pj * vv;
                        }
                    }
                }
            }
        }
    }
    (out, lse)
}

/// Block-sparse backward from `dout` under the expanded token mask: `(dq, dk, dv)` in f64.
pub fn sparse_backward_f64(s: &crate::sparse::SparseSpec, q: &[f64], k: &[f64], v: &[f64], dout: &[f64]) -> GradsF64 {
    let spec = &s.attn;
    let dm = spec.dims;
    let d = dm.head_dim;
    let (mut dq, mut dk, mut dv) = (vec![0.0; dm.q_len()], vec![0.0; dm.kv_len()], vec![0.0; dm.kv_len()]);
    let sc = spec.scale as f64;
    for (b, seg) in spec.segments.iter().enumerate() {
        for r in 0..seg.q_len {
            let t = seg.q_start + r;
            for h in 0..dm.heads_q {
                let hk = h / dm.group_size();
                let keys = sparse_keys(s, b, h, r);
                let Some((p, _)) = row_probs_keys(spec, q, k, t, h, &keys) else { continue };
                let qo = (t * dm.heads_q + h) * d;
                let go = &dout[qo..qo + d];
                let dp: Vec<f64> = keys.iter().map(|&j| go.iter().zip(&v[(j * dm.heads_kv + hk) * d..][..d]).map(|(a, b)| a * b).sum()).collect();
                let delta: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (idx, &j) in keys.iter().enumerate() {
                    let ko = (j * dm.heads_kv + hk) * d;
                    let ds = p[idx] * (dp[idx] - delta);
                    for x in 0..d {
                        dv[ko + x] += p[idx] * go[x];
                        dq[qo + x] += sc * ds * k[ko + x];
                        dk[ko + x] += sc * ds * q[qo + x];
                    }
                }
            }
        }
    }
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
