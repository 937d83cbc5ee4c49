//! Block-sparse forward and backward on CUDA against the CPU block-sparse forward and backward
//! (themselves checked against the f64 reference in tests/python/test_sparse.py), with
//! NaN-poisoned outputs: every element must be written. Random patterns with empty rows, causal
//! and not, per-q-head and per-kv-head indices, odd lengths and block sizes, varlen with 1-token
//! sequences.

use cubeattn::backend::cpu::CpuBackend;
use cubeattn::backend::BackwardInputs;
use cubeattn::{AttnSpec, Backend, DType, Int8Qk, KeySet, QuantGran, TensorMeta};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use super::backend;

use super::random;

#[derive(Clone, Copy)]
struct Case {
    lens: &'static [(usize, usize)],
    hq: usize,
    hkv: usize,
    d: usize,
    per_kv_head: bool,
    q_block: usize,
    k_block: usize,
    dtype: DType,
}

/// A random block index (about half kept, some rows empty, some slots -1, unsorted).
fn index(rng: &mut StdRng, batch: usize, heads: usize, q_blocks: usize, k_blocks: &[usize]) -> (Vec<i32>, Vec<usize>) {
    let top_k = k_blocks.iter().copied().max().unwrap_or(1).max(1);
    let mut ix = vec![-1i32; batch * heads * q_blocks * top_k];
    for b in 0..batch {
        for h in 0..heads {
            for qb in 0..q_blocks {
                if rng.random_bool(0.1) {
                    continue; // empty row
                }
                let base = ((b * heads + h) * q_blocks + qb) * top_k;
                let mut slot = 0;
                for kb in (0..k_blocks[b]).rev() {
                    if rng.random_bool(0.5) {
                        ix[base + slot] = kb as i32;
                        slot += 1;
                    }
                }
            }
        }
    }
    (ix, vec![batch, heads, q_blocks, top_k])
}

/// The spec of case `c` with a fresh random index.
fn case_spec(c: &Case, causal: bool, rng: &mut StdRng) -> AttnSpec {
    case_spec_int8(c, causal, rng, None)
}

/// [`case_spec`] with the INT8 Q K^T option `int8`.
fn case_spec_int8(c: &Case, causal: bool, rng: &mut StdRng, int8: Option<Int8Qk>) -> AttnSpec {
    let cu_q: Vec<i32> = std::iter::once(0).chain(c.lens.iter().scan(0, |a, &(q, _)| { *a += q as i32; Some(*a) })).collect();
    let cu_k: Vec<i32> = std::iter::once(0).chain(c.lens.iter().scan(0, |a, &(_, k)| { *a += k as i32; Some(*a) })).collect();
    let (tq, tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
    let mq = c.lens.iter().map(|l| l.0).max().unwrap();
    let mk = c.lens.iter().map(|l| l.1).max().unwrap();
    let qm = TensorMeta::new(&[tq, c.hq, c.d], c.dtype);
    let km = TensorMeta::new(&[tk, c.hkv, c.d], c.dtype);
    let attn = AttnSpec::varlen(&qm, &km, &km, &cu_q, &cu_k, mq, mk, None, causal).unwrap();
    let kbs: Vec<usize> = c.lens.iter().map(|l| l.1.div_ceil(c.k_block)).collect();
    let heads = if c.per_kv_head { c.hkv } else { c.hq };
    let (ix, shape) = index(rng, c.lens.len(), heads, mq.div_ceil(c.q_block), &kbs);
    attn.with_block_index(&ix, &shape, c.q_block, c.k_block, int8).unwrap()
}

/// ||a - b|| / ||b|| and the count of NaNs in `a` (unwritten elements).
fn rel_and_nans(a: &[f64], b: &[f64]) -> (f64, usize) {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    ((num / den.max(1e-30)).sqrt(), a.iter().filter(|x| x.is_nan()).count())
}

const CASES: [Case; 8] = [
    Case { lens: &[(333, 1290), (64, 64)], hq: 4, hkv: 2, d: 128, per_kv_head: false, q_block: 64, k_block: 128, dtype: DType::BF16 },
    Case { lens: &[(600, 700)], hq: 8, hkv: 2, d: 64, per_kv_head: true, q_block: 64, k_block: 128, dtype: DType::F16 },
    Case { lens: &[(1, 1), (257, 519), (130, 2)], hq: 2, hkv: 1, d: 64, per_kv_head: false, q_block: 32, k_block: 96, dtype: DType::F16 },
    Case { lens: &[(500, 1000)], hq: 4, hkv: 4, d: 128, per_kv_head: false, q_block: 128, k_block: 64, dtype: DType::BF16 },
    Case { lens: &[(1, 513), (200, 129), (0, 70), (90, 0)], hq: 4, hkv: 1, d: 128, per_kv_head: true, q_block: 100, k_block: 200, dtype: DType::F16 },
    // 256-key blocks: the Hopper frames' 64- and 128-key tiles (2 / 4 tiles a block), ragged ends
    Case { lens: &[(300, 1100), (129, 257)], hq: 8, hkv: 2, d: 128, per_kv_head: false, q_block: 128, k_block: 256, dtype: DType::BF16 },
    // head dims without a block-sparse kernel: 96 runs on the d128 kernels, 40 on the d64 ones,
    // with zero columns (`backend::cuda::head_pad`)
    Case { lens: &[(1, 1), (257, 519), (130, 200)], hq: 4, hkv: 2, d: 96, per_kv_head: false, q_block: 64, k_block: 128, dtype: DType::BF16 },
    Case { lens: &[(300, 700)], hq: 8, hkv: 2, d: 40, per_kv_head: true, q_block: 128, k_block: 64, dtype: DType::F16 },
];

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn sparse_backward_matches_cpu_writes_every_element_and_is_deterministic() {
    let Some(be) = backend() else { return };
    let mut rng = StdRng::seed_from_u64(12);
    let mut failures = Vec::new();
    // deterministic: dq, dk, dv bitwise repeatable; fused dQ (f32 atomics): dk, dv repeatable
    for (ci, c, det) in CASES.iter().enumerate().flat_map(|(i, c)| [(i, c, true), (i, c, false)]) {
        for causal in [false, true] {
            let spec = case_spec(c, causal, &mut rng);
            let (tq, tk) = (spec.dims.total_q, spec.dims.total_k);
            let q = random(tq * c.hq * c.d, c.dtype, 1.0, &mut rng);
            let k = random(tk * c.hkv * c.d, c.dtype, 1.0, &mut rng);
            let v = random(tk * c.hkv * c.d, c.dtype, 1.0, &mut rng);
            let dout = random(tq * c.hq * c.d, c.dtype, 1.0, &mut rng);
            let fwd = CpuBackend.forward(&spec, q.view(), k.view(), v.view()).unwrap();
            let inputs = BackwardInputs { out: fwd.out.view(), lse: &fwd.lse, dout: dout.view(), deterministic: det };
            let got = be.backward_poisoned(&spec, q.view(), k.view(), v.view(), inputs, f32::NAN).unwrap();
            let again = be.backward_poisoned(&spec, q.view(), k.view(), v.view(), inputs, f32::NAN).unwrap();
            let want = CpuBackend.backward(&spec, q.view(), k.view(), v.view(), inputs).unwrap();
            let tol = if c.dtype == DType::BF16 { 2e-2 } else { 1e-2 };
            let mut ok = true;
            let mut line = format!("case {ci} causal={causal} deterministic={det}:");
            for (name, g, w, a) in [("dq", &got.dq, &want.dq, &again.dq), ("dk", &got.dk, &want.dk, &again.dk), ("dv", &got.dv, &want.dv, &again.dv)] {
                let (rel, nans) = rel_and_nans(&g.view().to_f64_vec(), &w.view().to_f64_vec());
                let same = g.view().as_bytes() == a.view().as_bytes();
                ok &= nans == 0 && rel < tol && (same || (!det && name == "dq"));
                line += &format!(" {name} rel_l2 {rel:.2e} unwritten {nans} bitwise-repeatable {same};");
            }
            println!("{line} {}", if ok { "ok" } else { "FAIL" });
            if !ok {
                failures.push((ci, causal, det));
            }
        }
    }
    assert!(failures.is_empty(), "failed: {failures:?}");
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn sparse_forward_matches_cpu_and_writes_every_element() {
    let Some(be) = backend() else { return };
    let mut rng = StdRng::seed_from_u64(11);
    let mut failures = Vec::new();
    for (ci, c) in CASES.iter().enumerate().filter(|(i, _)| *i != 4) {
        for causal in [false, true] {
            let spec = case_spec(c, causal, &mut rng);
            let (tq, tk) = (spec.dims.total_q, spec.dims.total_k);
            let q = random(tq * c.hq * c.d, c.dtype, 1.0, &mut rng);
            let k = random(tk * c.hkv * c.d, c.dtype, 1.0, &mut rng);
            let v = random(tk * c.hkv * c.d, c.dtype, 1.0, &mut rng);
            let got = be.forward_poisoned(&spec, q.view(), k.view(), v.view(), f32::NAN).unwrap();
            let want = CpuBackend.forward(&spec, q.view(), k.view(), v.view()).unwrap();
            let (rel, nans) = rel_and_nans(&got.out.view().to_f64_vec(), &want.out.view().to_f64_vec());
            let unwritten = nans + got.lse.iter().filter(|x| x.is_nan()).count();
            let lse_bad = got.lse.iter().zip(&want.lse).filter(|(a, b)| !(a.is_infinite() && b.is_infinite() || (*a - *b).abs() <= 1e-3 * b.abs().max(1.0))).count();
            let ok = unwritten == 0 && rel < 1e-2 && lse_bad == 0;
            println!("case {ci} causal={causal}: rel_l2 {rel:.2e} unwritten {unwritten} lse mismatches {lse_bad} {}", if ok { "ok" } else { "FAIL" });
            if !ok {
                failures.push((ci, causal));
            }
        }
    }
    assert!(failures.is_empty(), "failed: {failures:?}");
}

/// INT8 Q K^T on CUDA against the CPU's INT8 path (the same quantisation: groups, scale amax / 127,
/// round half to even, exact i32 dot products; the K mean is summed in f32 chunks on the GPU and
/// in f64 on the CPU, so a few int8 values may differ by one step), NaN-poisoned outputs: every
/// element written. Every granularity, with and without K smoothing, K with a channel offset
/// (where smoothing matters); also against the exact CUDA path (cosine >= 0.99).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn sparse_int8_forward_matches_cpu_and_writes_every_element() {
    let Some(be) = backend() else { return };
    let mut rng = StdRng::seed_from_u64(13);
    let mut failures = Vec::new();
    let grans = [QuantGran::PerBlock, QuantGran::PerWarp, QuantGran::PerThread];
    // CASES[3] and the two below run the Hopper kernel's INT8 variant on sm_90 (d128, 128-row
    // cubes, k_block a multiple of 64: a GQA group packed, empty sequences, three tiles a block)
    let hopper = [
        Case { lens: &[(1, 513), (300, 777), (0, 70), (129, 0)], hq: 8, hkv: 2, d: 128, per_kv_head: true, q_block: 64, k_block: 128, dtype: DType::BF16 },
        Case { lens: &[(700, 700), (77, 1)], hq: 2, hkv: 2, d: 128, per_kv_head: false, q_block: 128, k_block: 192, dtype: DType::F16 },
    ];
    // and CASES[5] (256-key blocks, four 64-key tiles a block, ragged ends)
    for (ci, c) in CASES[..4].iter().chain(hopper.iter()).chain([&CASES[5]]).enumerate() {
        for (gi, gran) in grans.iter().enumerate() {
            let smooth_k = gi != 1 || ci % 2 == 0;
            let causal = (ci + gi) % 2 == 0;
            let spec = case_spec_int8(c, causal, &mut rng, Some(Int8Qk { gran: *gran, smooth_k, pv_fp8: false }));
            let mut exact = spec.clone();
            if let KeySet::BlockSparse(s) = &mut exact.keys {
                s.int8 = None;
            }
            let (tq, tk) = (spec.dims.total_q, spec.dims.total_k);
            let q = random(tq * c.hq * c.d, c.dtype, 1.0, &mut rng);
            // K with a per-channel offset of 4 sigma
            let offs: Vec<f32> = (0..c.d).map(|_| rng.random_range(-4.0f32..4.0)).collect();
            let k0 = random(tk * c.hkv * c.d, DType::F32, 1.0, &mut rng).view().to_f64_vec();
            let k: Vec<f32> = k0.iter().enumerate().map(|(i, &x)| x as f32 + offs[i % c.d]).collect();
            let k = cubeattn::HostData::from_f32(c.dtype, &k);
            let v = random(tk * c.hkv * c.d, c.dtype, 1.0, &mut rng);
            let got = be.forward_poisoned(&spec, q.view(), k.view(), v.view(), f32::NAN).unwrap();
            let want = CpuBackend.forward(&spec, q.view(), k.view(), v.view()).unwrap();
            let ex = be.forward(&exact, q.view(), k.view(), v.view()).unwrap();
            let (g, w, e) = (got.out.view().to_f64_vec(), want.out.view().to_f64_vec(), ex.out.view().to_f64_vec());
            let (rel, nans) = rel_and_nans(&g, &w);
            let unwritten = nans + got.lse.iter().filter(|x| x.is_nan()).count();
            let lse_bad = got.lse.iter().zip(&want.lse).filter(|(a, b)| !(a.is_infinite() && b.is_infinite() || (*a - *b).abs() <= 2e-3 * b.abs().max(1.0))).count();
            let dot: f64 = g.iter().zip(&e).map(|(a, b)| a * b).sum();
            let cos = dot / (g.iter().map(|a| a * a).sum::<f64>().sqrt() * e.iter().map(|a| a * a).sum::<f64>().sqrt()).max(1e-300);
            let ok = unwritten == 0 && rel < 1e-2 && lse_bad == 0 && (cos >= 0.99 || e.iter().all(|&x| x == 0.0));
            println!(
                "case {ci} {} smooth_k={smooth_k} causal={causal}: rel_l2 vs cpu int8 {rel:.2e} unwritten {unwritten} lse mismatches {lse_bad} cosine vs exact {cos:.5} {}",
                gran.name(),
                if ok { "ok" } else { "FAIL" }
            );
            if !ok {
                failures.push((ci, gran.name()));
            }
        }
    }
    assert!(failures.is_empty(), "failed: {failures:?}");
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn sparse_int8_fp8_pv_forward_is_close_to_exact_and_writes_every_element() {
    let Some(be) = backend() else { return };
    let mut rng = StdRng::seed_from_u64(14);
    let mut failures = Vec::new();
    // the Hopper kernel's shapes (d128, 128-row cubes, k_block a multiple of 64); below sm_90 FP8
    // P.V is refused with Unsupported
    // (k_block 64 / 256 / 128 / 192: one to four 64-key tiles a block)
    let cases = [
        CASES[3],
        CASES[5],
        Case { lens: &[(1, 513), (300, 777), (0, 70), (129, 0), (64, 1)], hq: 8, hkv: 2, d: 128, per_kv_head: true, q_block: 64, k_block: 128, dtype: DType::BF16 },
        Case { lens: &[(700, 700), (77, 3)], hq: 2, hkv: 2, d: 128, per_kv_head: false, q_block: 128, k_block: 192, dtype: DType::F16 },
    ];
    for (ci, c) in cases.iter().enumerate() {
        for (gi, gran) in [QuantGran::PerBlock, QuantGran::PerWarp, QuantGran::PerThread].iter().enumerate() {
            let causal = (ci + gi) % 2 == 1;
            let spec = case_spec_int8(c, causal, &mut rng, Some(Int8Qk { gran: *gran, smooth_k: gi != 2, pv_fp8: true }));
            let mut exact = spec.clone();
            let mut int8_only = spec.clone();
            if let KeySet::BlockSparse(s) = &mut exact.keys {
                s.int8 = None;
            }
            if let KeySet::BlockSparse(s) = &mut int8_only.keys {
                s.int8 = Some(Int8Qk { gran: *gran, smooth_k: gi != 2, pv_fp8: false });
            }
            let (tq, tk) = (spec.dims.total_q, spec.dims.total_k);
            let q = random(tq * c.hq * c.d, c.dtype, 1.0, &mut rng);
            let k = random(tk * c.hkv * c.d, c.dtype, 1.0, &mut rng);
            // V with channels of very different magnitudes (the per-channel scales' job)
            let mags: Vec<f32> = (0..c.d).map(|i| if i % 17 == 3 { 30.0 } else { rng.random_range(0.05f32..2.0) }).collect();
            let v0 = random(tk * c.hkv * c.d, DType::F32, 1.0, &mut rng).view().to_f64_vec();
            let v: Vec<f32> = v0.iter().enumerate().map(|(i, &x)| x as f32 * mags[i % c.d]).collect();
            let v = cubeattn::HostData::from_f32(c.dtype, &v);
            let got = match be.forward_poisoned(&spec, q.view(), k.view(), v.view(), f32::NAN) {
                Ok(g) => g,
                Err(cubeattn::Error::Unsupported { .. }) if !be.target().wgmma => continue,
                Err(e) => panic!("case {ci}: {e}"),
            };
            let ex = be.forward(&exact, q.view(), k.view(), v.view()).unwrap();
            let i8o = be.forward(&int8_only, q.view(), k.view(), v.view()).unwrap();
            // the CPU's emulation of the same quantisation (P's e4m3 rounding may differ where
            // the GPU's exp2 lands across a rounding midpoint)
            let emu = CpuBackend.forward(&spec, q.view(), k.view(), v.view()).unwrap();
            let (g, e) = (got.out.view().to_f64_vec(), ex.out.view().to_f64_vec());
            let (rel, nans) = rel_and_nans(&g, &e);
            let (rel_emu, _) = rel_and_nans(&g, &emu.out.view().to_f64_vec());
            let unwritten = nans + got.lse.iter().filter(|x| x.is_nan()).count();
            let lse_bad = got.lse.iter().zip(&i8o.lse).filter(|(a, b)| !(a.is_infinite() && b.is_infinite() || (*a - *b).abs() <= 1e-3 * b.abs().max(1.0))).count();
            let dot: f64 = g.iter().zip(&e).map(|(a, b)| a * b).sum();
            let cos = dot / (g.iter().map(|a| a * a).sum::<f64>().sqrt() * e.iter().map(|a| a * a).sum::<f64>().sqrt()).max(1e-300);
            let ok = unwritten == 0 && lse_bad == 0 && rel < 0.05 && cos >= 0.999 && rel_emu < 1e-2;
            println!(
                "case {ci} {} causal={causal}: rel_l2 vs exact {rel:.2e} cosine {cos:.5} vs cpu emulation {rel_emu:.2e} unwritten {unwritten} lse mismatches vs int8 {lse_bad} {}",
                gran.name(),
                if ok { "ok" } else { "FAIL" }
            );
            if !ok {
                failures.push((ci, gran.name()));
            }
        }
    }
    assert!(failures.is_empty(), "failed: {failures:?}");
}
