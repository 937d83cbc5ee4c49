//! Shared helpers for integration tests: random inputs, error metrics, spec builders.
#![allow(dead_code)]

use cubeattn::{AttnSpec, DType, HostData, TensorMeta};
use rand::{rngs::StdRng, Rng, SeedableRng};

#[cfg(feature = "candle")]
pub mod candle;

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// Uniform(-amp, amp) values rounded into `dtype`; returns the data and its exact f64 widening.
pub fn random(rng: &mut StdRng, n: usize, dtype: DType, amp: f32) -> (HostData, Vec<f64>) {
    let xs: Vec<f32> = (0..n).map(|_| rng.random_range(-amp..amp)).collect();
    let data = HostData::from_f32(dtype, &xs);
    let wide = data.view().to_f64_vec();
    (data, wide)
}

/// ||a - b|| / ||b|| (finite entries of b only; NaN in `a` gives infinity).
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    rel_err_of(a, b, b)
}

/// ||a - b|| / ||scale||, or ||a - b|| where `scale` is all zero: two computed results compared
/// relative to the exact one (rows that see one key have dq = 0 exactly, where both computed
/// results hold rounding noise whose ratio means nothing).
pub fn rel_err_of(a: &[f64], b: &[f64], scale: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    assert_eq!(a.len(), scale.len());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for ((x, y), z) in a.iter().zip(b).zip(scale) {
        if !x.is_finite() {
            return f64::INFINITY;
        }
        num += (x - y) * (x - y);
        den += z * z;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

pub fn max_abs(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| if x.is_finite() { (x - y).abs() } else { f64::INFINITY }).fold(0.0, f64::max)
}

/// Asserts `got` matches `want` elementwise within atol + rtol*|want| and in relative norm.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], atol: f64, rtol: f64, max_rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}[{i}] = {g} is not finite");
        assert!((g - w).abs() <= atol + rtol * w.abs(), "{what}[{i}]: got {g}, want {w}");
    }
    let r = rel_err(got, want);
    assert!(r <= max_rel, "{what}: relative error {r:e} > {max_rel:e}");
}

/// LSE comparison: +inf must match exactly (rows that see no key).
pub fn assert_lse(got: &[f32], want: &[f64], tol: f64) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if w.is_infinite() {
            assert_eq!(*g as f64, *w, "lse[{i}]");
        } else {
            assert!((*g as f64 - w).abs() <= tol * (1.0 + w.abs()), "lse[{i}]: got {g}, want {w}");
        }
    }
}

pub fn meta(tokens: usize, heads: usize, d: usize, dtype: DType) -> TensorMeta {
    TensorMeta::new(&[tokens, heads, d], dtype)
}

/// A varlen spec from per-sequence (q_len, k_len).
pub fn varlen_spec(lens: &[(usize, usize)], hq: usize, hkv: usize, d: usize, dtype: DType, causal: bool) -> AttnSpec {
    varlen_spec_dv(lens, hq, hkv, d, d, dtype, causal)
}

/// Cumulative sequence lengths (cu_seqlens_q, cu_seqlens_k) of per-sequence (q_len, k_len).
pub fn cu_seqlens(lens: &[(usize, usize)]) -> (Vec<i32>, Vec<i32>) {
    let (mut cq, mut ck) = (vec![0i32], vec![0i32]);
    for &(a, b) in lens {
        cq.push(cq.last().unwrap() + a as i32);
        ck.push(ck.last().unwrap() + b as i32);
    }
    (cq, ck)
}

/// [`varlen_spec`] with v's own head_dim `dv`.
pub fn varlen_spec_dv(lens: &[(usize, usize)], hq: usize, hkv: usize, d: usize, dv: usize, dtype: DType, causal: bool) -> AttnSpec {
    let (cq, ck) = cu_seqlens(lens);
    let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
    let mq = lens.iter().map(|x| x.0).max().unwrap_or(0);
    let mk = lens.iter().map(|x| x.1).max().unwrap_or(0);
    AttnSpec::varlen(&meta(tq, hq, d, dtype), &meta(tk, hkv, d, dtype), &meta(tk, hkv, dv, dtype), &cq, &ck, mq, mk, None, causal)
        .expect("valid spec")
}

/// Calls whose v has a head_dim of its own, `(name, spec)`: DeepSeek's MLA (q, k 192, v 128), 192 /
/// 64, v wider than q, both off the kernels' head dims, q off them and v on them (160 / 128); varlen
/// with 1-token and unequal sequences, causal or not, GQA, sequences of several key tiles with
/// ragged ends, and grouped with overlapping key ranges, uncovered rows and a window.
pub fn value_dim_specs(dtypes: &[DType]) -> Vec<(String, AttnSpec)> {
    let mut v = Vec::new();
    for &dt in dtypes {
        let cases = [(192, 128, true), (192, 128, false), (192, 64, true), (64, 128, true), (128, 64, false), (40, 24, true), (160, 128, true), (256, 192, false)];
        for (d, dv, causal) in cases {
            let s = varlen_spec_dv(&[(1, 1), (70, 70), (37, 100), (17, 17)], 4, 2, d, dv, dt, causal);
            v.push((format!("{} d{d} v{dv} {} GQA4/2 varlen", dt.name(), if causal { "causal" } else { "full" }), s));
        }
        for causal in [true, false] {
            let s = varlen_spec_dv(&[(300, 300), (129, 513), (2, 700)], 4, 2, 192, 128, dt, causal);
            v.push((format!("{} d192 v128 {} several key tiles", dt.name(), if causal { "causal" } else { "full" }), s));
        }
        let (qr, kr) = ([[0, 50], [50, 90], [95, 150]], [[0, 60], [0, 90], [30, 160]]);
        let g = AttnSpec::grouped(&meta(155, 4, 192, dt), &meta(160, 2, 192, dt), &meta(160, 2, 128, dt), &qr, &kr, None, true)
            .and_then(|s| s.with_window(24, 0))
            .expect("valid spec");
        v.push((format!("{} d192 v128 grouped window (24, 0)", dt.name()), g));
    }
    v
}

/// A grouped spec over `total_k` shared keys, groups of `q_lens` rows back to back.
pub fn grouped_spec(q_lens: &[usize], kv: &[(i32, i32)], total_k: usize, hq: usize, hkv: usize, d: usize, dtype: DType, causal: bool) -> AttnSpec {
    let mut qr = Vec::new();
    let mut at = 0i32;
    for &n in q_lens {
        qr.push([at, at + n as i32]);
        at += n as i32;
    }
    let kr: Vec<[i32; 2]> = kv.iter().map(|&(a, b)| [a, b]).collect();
    grouped_ranges_spec(&qr, &kr, at as usize, total_k, hq, hkv, d, dtype, causal)
}

/// A grouped spec from explicit q_ranges / kv_ranges over `total_q` rows and `total_k` keys.
#[allow(clippy::too_many_arguments)]
pub fn grouped_ranges_spec(
    qr: &[[i32; 2]],
    kr: &[[i32; 2]],
    total_q: usize,
    total_k: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    dtype: DType,
    causal: bool,
) -> AttnSpec {
    AttnSpec::grouped(&meta(total_q, hq, d, dtype), &meta(total_k, hkv, d, dtype), &meta(total_k, hkv, d, dtype), qr, kr, None, causal)
        .expect("valid spec")
}

/// Random q, k, v for a spec: (data, f64 widening) each.
pub fn random_qkv(rng: &mut StdRng, spec: &AttnSpec, amp: f32) -> [(HostData, Vec<f64>); 3] {
    let d = spec.dims;
    [random(rng, d.q_len(), spec.dtype, amp), random(rng, d.kv_len(), spec.dtype, amp), random(rng, d.v_len(), spec.dtype, amp)]
}

/// Rows of a `[rows, row_elems]` buffer moved by blocks of `KV_PAGE` (a paged K,V's layout):
/// logical block g to physical block `table[g]`.
pub fn paged_layout(x: &HostData, table: &[i32], row_elems: usize) -> HostData {
    let xs = x.to_f32_vec();
    let mut out = vec![0f32; xs.len()];
    let b = cubeattn::spec::KV_PAGE * row_elems;
    for (g, &t) in table.iter().enumerate() {
        out[t as usize * b..][..b].copy_from_slice(&xs[g * b..][..b]);
    }
    HostData::from_f32(x.dtype(), &out)
}
