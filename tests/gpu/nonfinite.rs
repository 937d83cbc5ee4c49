//! A NaN or Inf in v on the f16/bf16 forward (issue 13): a key a row cannot see contributes
//! exactly nothing to it, also inside a 64-key tensor-core tile (the causal diagonal, a ragged last
//! tile padded with copies of the last key, a window edge, group boundaries, split-K, block-sparse
//! lists). Against the f64 reference: equal where finite (forward tolerance), and the same NaN /
//! +Inf / -Inf pattern element by element. Outputs are poisoned with a finite sentinel first, so an
//! unwritten element fails (a NaN poison would pass where the reference is NaN).

use cubeattn::backend::cuda::{fwd_options, FwdPlan};
use cubeattn::reference::forward_f64;
use cubeattn::{AttnSpec, DType, HostData, Int8Qk, QuantGran, TensorMeta};
use rand::{rngs::StdRng, SeedableRng};

use super::{backend, random};
use crate::common::{grouped_ranges_spec, varlen_spec, varlen_spec_dv};

/// Written into out and lse before the launch: finite, exact in f16 and bf16, far from any output.
const POISON: f32 = 4096.0;

/// One bad element: (key token, kv head, channel, value).
type Bad = (usize, usize, usize, f32);

/// v of `spec` with the bad elements set.
fn poisoned_v(spec: &AttnSpec, v: &HostData, bad: &[Bad]) -> HostData {
    let d = &spec.dims;
    let mut x = v.to_f32_vec();
    for &(t, h, c, val) in bad {
        x[(t * d.heads_kv + h) * d.head_dim_v + c] = val;
    }
    HostData::from_f32(spec.dtype, &x)
}

/// Elements of `got` (rounded to the dtype) that differ from `want` (f64): a different class
/// (finite, NaN, +Inf, -Inf) or, both finite, more than `tol` apart (absolute plus relative).
fn mismatches(got: &[f32], want: &[f64], tol: f64) -> Vec<(usize, f32, f64)> {
    let class = |x: f64| if x.is_nan() { 1 } else if x == f64::INFINITY { 2 } else if x == f64::NEG_INFINITY { 3 } else { 0 };
    got.iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (&g, &w))| {
            let g = g as f64;
            class(g) != class(w) || (class(w) == 0 && (g - w).abs() > tol * (1.0 + w.abs()))
        })
        .map(|(i, (&g, &w))| (i, g, w))
        .collect()
}

fn tol(dt: DType) -> f64 {
    if dt == DType::BF16 { 2e-2 } else { 4e-3 }
}

/// Checks out and lse of one call against the reference; `what` names the case.
fn check(what: &str, dt: DType, out: &HostData, lse: &[f32], ref_out: &[f64], ref_lse: &[f64]) {
    let bad = mismatches(&out.to_f32_vec(), ref_out, tol(dt));
    assert!(bad.is_empty(), "{what}: {} output elements differ from the reference (index, got, want): {:?}", bad.len(), &bad[..bad.len().min(8)]);
    // v never enters the LSE: finite rows must stay finite and close, rows with no key +inf
    let bad = mismatches(lse, ref_lse, 1e-3);
    assert!(bad.is_empty(), "{what}: {} lse values differ (index, got, want): {:?}", bad.len(), &bad[..bad.len().min(8)]);
    // the case must be one where the bad elements reach some rows and not others
    let non_finite = ref_out.iter().filter(|x| !x.is_finite()).count();
    assert!(non_finite > 0 && non_finite < ref_out.len(), "{what}: the case does not exercise masking");
}

fn run_dense(what: &str, spec: &AttnSpec, bad: &[Bad], seed: u64) {
    let Some(b) = backend() else { return };
    let mut rng = StdRng::seed_from_u64(seed);
    let d = &spec.dims;
    let q = random(d.q_len(), spec.dtype, 1.0, &mut rng);
    let k = random(d.kv_len(), spec.dtype, 1.0, &mut rng);
    let v = poisoned_v(spec, &random(d.v_len(), spec.dtype, 1.0, &mut rng), bad);
    let f = |h: &HostData| h.view().to_f64_vec();
    let (ro, rl) = forward_f64(spec, &f(&q), &f(&k), &f(&v));
    let got = b.forward_poisoned(spec, q.view(), k.view(), v.view(), POISON).expect("forward");
    check(what, spec.dtype, &got.out, &got.lse, &ro, &rl);
    // the same inputs with v made finite (the bad elements zeroed) take the tensor-core path and
    // give the finite outputs of the rows that never saw them
    let clean: Vec<Bad> = bad.iter().map(|&(t, h, c, _)| (t, h, c, 0.0)).collect();
    let v0 = poisoned_v(spec, &v, &clean);
    let got0 = b.forward_poisoned(spec, q.view(), k.view(), v0.view(), POISON).expect("forward");
    let (o0, o1) = (got0.out.to_f32_vec(), got.out.to_f32_vec());
    let differ = ro.iter().zip(o0.iter().zip(&o1)).filter(|(r, (a, c))| r.is_finite() && ((**a - **c).abs() as f64) > tol(spec.dtype)).count();
    assert_eq!(differ, 0, "{what}: rows that never see a bad element differ between the two paths beyond tolerance");
}

const F16: DType = DType::F16;
const BF16: DType = DType::BF16;

#[test]
#[ignore = "needs a CUDA GPU"]
fn causal_diagonal_and_ragged_last_tile() {
    for (dt, d) in [(F16, 64), (BF16, 128)] {
        // 100 tokens: tile 1 holds keys 64..99 and is padded with copies of key 99
        let spec = varlen_spec(&[(100, 100)], 4, 2, d, dt, true);
        // key 1 (rows 1.. see it, row 0 does not: same tile), key 70 (rows 0..69 share its tile
        // without seeing it), the last key 99 (only row 99 sees it; the padding repeats it)
        let bad = [(1, 0, 3, f32::INFINITY), (70, 1, 5, f32::NAN), (99, 1, 7, f32::NEG_INFINITY), (99, 0, 2, f32::INFINITY)];
        run_dense(&format!("{dt:?} d{d} causal 100"), &spec, &bad, 1);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn inf_in_the_last_value_of_a_non_causal_ragged_sequence_reads_inf() {
    // test_properties_gpu.py's case: every row sees the last key, whose value is Inf; the
    // padding copies of it enter P.V with weight 0 on the tensor cores
    for (dt, n) in [(F16, 1), (BF16, 65), (F16, 130)] {
        let spec = varlen_spec(&[(3, n), (5, 64)], 2, 1, 64, dt, false);
        run_dense(&format!("{dt:?} 3 queries x {n} keys"), &spec, &[(n - 1, 0, 0, f32::INFINITY)], 2);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sliding_window_edge_and_varlen_boundary() {
    for (dt, d) in [(BF16, 64), (F16, 128)] {
        // window (16, 0): key 20 is seen by rows 20..=36 only; the second sequence shares the
        // key axis' tiles (keys 150.. of the packed batch) and never sees the first's keys
        let spec = varlen_spec(&[(150, 150), (40, 60)], 4, 4, d, dt, true).with_window(16, 0).expect("window");
        let bad = [(20, 0, 0, f32::NAN), (149, 2, 9, f32::INFINITY), (160, 3, 1, f32::NEG_INFINITY)];
        run_dense(&format!("{dt:?} d{d} window (16,0)"), &spec, &bad, 3);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn value_head_dim_of_its_own_takes_the_exact_path() {
    // DeepSeek's MLA (q, k 192, v 128): on Hopper the warp-specialised frame and the exact kernel
    // both run v and out at 128 columns; elsewhere the call runs padded to 192
    for (dt, causal) in [(BF16, true), (F16, false)] {
        let spec = varlen_spec_dv(&[(150, 150), (40, 60)], 4, 2, 192, 128, dt, causal);
        let bad = [(20, 0, 0, f32::NAN), (149, 1, 127, f32::INFINITY), (160, 1, 1, f32::NEG_INFINITY)];
        run_dense(&format!("{dt:?} d192 v128 {}", if causal { "causal" } else { "full" }), &spec, &bad, 5);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_split_k_combine_takes_the_exact_path() {
    // 16 groups of 8 rows over prefixes [0, 2048 - 64 g) of one key axis: the plan splits the
    // long tiles (split-K + combine); key 2000 is seen by group 0 only, key 10 by every group
    let spec = grouped_ranges_spec(
        &(0..16).map(|g| [8 * g, 8 * g + 8]).collect::<Vec<_>>(),
        &(0..16).map(|g| [0, 2048 - 64 * g]).collect::<Vec<_>>(),
        128,
        2048,
        32,
        8,
        128,
        BF16,
        false,
    );
    let plan = FwdPlan::new(&spec, &fwd_options());
    assert!(plan.n_comb() > 0, "the case must split tiles");
    run_dense("bf16 grouped split-K", &spec, &[(2000, 3, 4, f32::INFINITY), (10, 5, 6, f32::NAN)], 4);
    // causal groups with uncovered rows (fill kernel) and overlapping key windows
    let spec = grouped_ranges_spec(&[[0, 100], [100, 170], [180, 300]], &[[0, 100], [0, 170], [50, 400]], 310, 400, 8, 2, 64, F16, true);
    run_dense("f16 grouped causal", &spec, &[(99, 1, 0, f32::INFINITY), (60, 0, 3, f32::NAN), (390, 1, 63, f32::NEG_INFINITY)], 5);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn block_sparse_lists_and_causal_diagonal() {
    for (dt, d, per_kv) in [(F16, 64, false), (BF16, 128, true)] {
        run_sparse(dt, d, per_kv, None);
    }
}

/// INT8 Q K^T with FP8 P.V (the Hopper kernel at d128): the V maxima pass sets the flag instead of
/// `v_nonfinite`'s scan, so the exact kernel still writes the call; also with the only bad element
/// in the last key of the second sequence (its ragged last chunk).
#[test]
#[ignore = "needs a CUDA GPU"]
fn block_sparse_int8_fp8_sets_the_flag_in_its_v_pass() {
    for smooth_k in [true, false] {
        run_sparse(BF16, 128, true, Some(Int8Qk { gran: QuantGran::PerWarp, smooth_k, pv_fp8: true }));
    }
}

/// The block-sparse case of [`block_sparse_lists_and_causal_diagonal`] with the INT8 option `int8`.
fn run_sparse(dt: DType, d: usize, per_kv: bool, int8: Option<Int8Qk>) {
    let Some(b) = backend() else { return };
    let (hq, hkv, lens) = (4usize, 2usize, [(200usize, 200usize), (70, 90)]);
    let (tq, tk) = (270usize, 290usize);
    let qm = TensorMeta::new(&[tq, hq, d], dt);
    let km = TensorMeta::new(&[tk, hkv, d], dt);
    let attn = AttnSpec::varlen(&qm, &km, &km, &[0, 200, 270], &[0, 200, 290], 200, 200, None, true).expect("spec");
    // q_block 64, k_block 64; per index head: query block qb keeps key blocks 0 and qb
    // (the diagonal block is where causal masks keys inside a tile)
    let heads = if per_kv { hkv } else { hq };
    let q_blocks = 4;
    let mut ix = vec![-1i32; lens.len() * heads * q_blocks * 2];
    for s in 0..lens.len() {
        for h in 0..heads {
            for qb in 0..q_blocks {
                let base = ((s * heads + h) * q_blocks + qb) * 2;
                ix[base] = 0;
                if qb > 0 && qb * 64 < lens[s].1 {
                    ix[base + 1] = qb as i32;
                }
            }
        }
    }
    let spec = attn.with_block_index(&ix, &[lens.len(), heads, q_blocks, 2], 64, 64, int8).expect("sparse spec");
    let a = &spec;
    let mut rng = StdRng::seed_from_u64(6);
    let q = random(a.dims.q_len(), dt, 1.0, &mut rng);
    let k = random(a.dims.kv_len(), dt, 1.0, &mut rng);
    // key 1 (block 0, listed everywhere: every row of sequence 0 but row 0 sees it), key 130
    // (block 2, listed for query block 2 only: rows 130..191 see it, rows 128..129 share its
    // tile), key 100 (block 1, query block 1 only: rows 100..127), the last key 289 (sequence
    // 1's key 89 in its ragged block 1: row 69 alone sees it)
    let bad = [(1, 0, 1, f32::INFINITY), (130, 1, 2, f32::NAN), (289, 1, 3, f32::INFINITY), (100, 0, 4, f32::NAN)];
    let v = poisoned_v(a, &random(a.dims.kv_len(), dt, 1.0, &mut rng), &bad);
    let f = |h: &HostData| h.view().to_f64_vec();
    let (ro, rl) = forward_f64(&spec, &f(&q), &f(&k), &f(&v));
    let got = b.forward_poisoned(&spec, q.view(), k.view(), v.view(), POISON).expect("sparse forward");
    check(&format!("{dt:?} d{d} block-sparse int8 {int8:?}"), dt, &got.out, &got.lse, &ro, &rl);
    if int8.is_some() {
        // the last key alone: only row 69 of sequence 1 sees it
        let v = poisoned_v(a, &random(a.dims.kv_len(), dt, 1.0, &mut rng), &bad[2..3]);
        let (ro, rl) = forward_f64(&spec, &f(&q), &f(&k), &f(&v));
        let got = b.forward_poisoned(&spec, q.view(), k.view(), v.view(), POISON).expect("sparse forward");
        check(&format!("{dt:?} d{d} block-sparse int8 last key {int8:?}"), dt, &got.out, &got.lse, &ro, &rl);
    }
}
