//! CUDA flash-attention forward against the f64 reference, and timings.
//!
//! Inputs are fresh random normals (rounded to the tested dtype before the reference sees them);
//! outputs are poisoned with NaN before each launch so unwritten elements fail the test.
//! Set `CUBEATTN_GPU_BENCH=1` to also time the Llama3-8B shapes (prints a table).

use cubeattn::backend::cuda::{bench::bench_forward, CudaBackend};
use cubeattn::reference::forward_f64;
use cubeattn::{AttnSpec, DType, Error, HostData, TensorMeta};
use rand::{rngs::StdRng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};

fn backend() -> Option<&'static CudaBackend> {
    match CudaBackend::shared() {
        Ok(b) => Some(b),
        Err(e) => {
            println!("SKIP: CUDA backend unavailable: {e}");
            None
        }
    }
}

struct Case {
    name: &'static str,
    dtype: DType,
    d: usize,
    hq: usize,
    hkv: usize,
    causal: bool,
    /// Varlen (cu_q, cu_k) or grouped (q_ranges, kv_ranges, total_q, total_k).
    layout: Layout,
    input_scale: f32,
}

enum Layout {
    Varlen(Vec<i32>, Vec<i32>),
    Grouped(Vec<[i32; 2]>, Vec<[i32; 2]>, usize, usize),
}

fn build_spec(c: &Case) -> AttnSpec {
    match &c.layout {
        Layout::Varlen(cq, ck) => {
            let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
            let mq = cq.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
            let mk = ck.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
            AttnSpec::varlen(
                &TensorMeta::new(&[tq, c.hq, c.d], c.dtype),
                &TensorMeta::new(&[tk, c.hkv, c.d], c.dtype),
                &TensorMeta::new(&[tk, c.hkv, c.d], c.dtype),
                cq,
                ck,
                mq,
                mk,
                None,
                c.causal,
            )
            .unwrap()
        }
        Layout::Grouped(qr, kr, tq, tk) => AttnSpec::grouped(
            &TensorMeta::new(&[*tq, c.hq, c.d], c.dtype),
            &TensorMeta::new(&[*tk, c.hkv, c.d], c.dtype),
            &TensorMeta::new(&[*tk, c.hkv, c.d], c.dtype),
            qr,
            kr,
            None,
            c.causal,
        )
        .unwrap(),
    }
}

fn random(n: usize, dtype: DType, scale: f32, rng: &mut StdRng) -> HostData {
    let x: Vec<f32> = (0..n).map(|_| { let z: f64 = StandardNormal.sample(rng); scale * z as f32 }).collect();
    HostData::from_f32(dtype, &x)
}

struct Report {
    max_abs: f64,
    rel_l2: f64,
    lse_max_abs: f64,
    unwritten: usize,
    lse_inf_mismatch: usize,
}

fn run_case(b: &CudaBackend, c: &Case, seed: u64) -> Report {
    let spec = build_spec(c);
    let mut rng = StdRng::seed_from_u64(seed);
    let q = random(spec.dims.q_len(), c.dtype, c.input_scale, &mut rng);
    let k = random(spec.dims.kv_len(), c.dtype, c.input_scale, &mut rng);
    let v = random(spec.dims.kv_len(), c.dtype, c.input_scale, &mut rng);
    let got = b.forward_poisoned(&spec, q.view(), k.view(), v.view(), f32::NAN).expect("CUDA forward failed");
    let f64v = |h: &HostData| h.view().to_f64_vec();
    let (ro, rl) = forward_f64(&spec, &f64v(&q), &f64v(&k), &f64v(&v));
    let go = got.out.to_f32_vec();
    assert_eq!(go.len(), ro.len());
    assert_eq!(got.lse.len(), rl.len());
    let mut r = Report { max_abs: 0.0, rel_l2: 0.0, lse_max_abs: 0.0, unwritten: 0, lse_inf_mismatch: 0 };
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, e) in go.iter().zip(&ro) {
        if !g.is_finite() {
            r.unwritten += 1;
            continue;
        }
        let diff = (*g as f64 - e).abs();
        r.max_abs = r.max_abs.max(diff);
        num += diff * diff;
        den += e * e;
    }
    r.rel_l2 = if den > 0.0 { (num / den).sqrt() } else { num.sqrt() };
    for (g, e) in got.lse.iter().zip(&rl) {
        if g.is_nan() {
            r.unwritten += 1;
        } else if e.is_infinite() || g.is_infinite() {
            if !(e.is_infinite() && *g == f32::INFINITY) {
                r.lse_inf_mismatch += 1;
            }
        } else {
            r.lse_max_abs = r.lse_max_abs.max((*g as f64 - e).abs());
        }
    }
    r
}

fn cases() -> Vec<Case> {
    use DType::*;
    let v = |q: &[i32], k: &[i32]| Layout::Varlen(q.to_vec(), k.to_vec());
    vec![
        Case { name: "f16 d64 1 token", dtype: F16, d: 64, hq: 4, hkv: 4, causal: false, layout: v(&[0, 1], &[0, 1]), input_scale: 1.0 },
        Case { name: "f16 d128 noncausal 1x200", dtype: F16, d: 128, hq: 4, hkv: 2, causal: false, layout: v(&[0, 200], &[0, 200]), input_scale: 1.0 },
        Case { name: "bf16 d128 GQA32/8 causal varlen [1,63,130]", dtype: BF16, d: 128, hq: 32, hkv: 8, causal: true, layout: v(&[0, 1, 64, 194], &[0, 1, 64, 194]), input_scale: 1.0 },
        Case { name: "f16 d64 GQA8/2 causal varlen [65,129,7]", dtype: F16, d: 64, hq: 8, hkv: 2, causal: true, layout: v(&[0, 65, 194, 201], &[0, 65, 194, 201]), input_scale: 1.0 },
        Case { name: "f16 d128 causal sq=50 < sk=200", dtype: F16, d: 128, hq: 8, hkv: 2, causal: true, layout: v(&[0, 50], &[0, 200]), input_scale: 1.0 },
        Case { name: "bf16 d64 causal sq=200 > sk=70", dtype: BF16, d: 64, hq: 4, hkv: 1, causal: true, layout: v(&[0, 200], &[0, 70]), input_scale: 1.0 },
        Case { name: "bf16 d128 causal 10x inputs 1x300", dtype: BF16, d: 128, hq: 4, hkv: 1, causal: true, layout: v(&[0, 300], &[0, 300]), input_scale: 10.0 },
        Case {
            name: "bf16 d128 grouped 3 groups overlapping kv + uncovered rows",
            dtype: BF16,
            d: 128,
            hq: 8,
            hkv: 2,
            causal: true,
            layout: Layout::Grouped(vec![[0, 100], [100, 170], [180, 300]], vec![[0, 100], [0, 170], [50, 400]], 310, 400),
            input_scale: 1.0,
        },
        Case { name: "f16 d64 grouped noncausal same kv", dtype: F16, d: 64, hq: 4, hkv: 2, causal: false, layout: Layout::Grouped(vec![[0, 40], [40, 90]], vec![[0, 150], [0, 150]], 90, 150), input_scale: 1.0 },
        Case { name: "f32 d64 causal varlen [1,70]", dtype: F32, d: 64, hq: 4, hkv: 2, causal: true, layout: v(&[0, 1, 71], &[0, 1, 71]), input_scale: 1.0 },
        Case { name: "f32 d128 grouped causal", dtype: F32, d: 128, hq: 4, hkv: 1, causal: true, layout: Layout::Grouped(vec![[0, 30], [35, 80]], vec![[0, 60], [20, 120]], 80, 120), input_scale: 1.0 },
    ]
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1e-2,
        DType::F16 => 3e-3,
        DType::F32 => 1e-5,
    }
}

#[test]
fn forward_matches_f64_reference() {
    let Some(b) = backend() else { return };
    println!("{:<58} {:>10} {:>10} {:>10} {:>6}", "case", "max_abs", "rel_l2", "lse_abs", "ok");
    let mut failures = Vec::new();
    for (i, c) in cases().iter().enumerate() {
        let r = run_case(b, c, 1000 + i as u64);
        let tol = tolerance(c.dtype);
        let ok = r.unwritten == 0
            && r.lse_inf_mismatch == 0
            && r.rel_l2 < tol
            && r.max_abs < 30.0 * tol * c.input_scale.max(1.0) as f64
            && r.lse_max_abs < 1e-2 * c.input_scale.powi(2).max(1.0) as f64;
        println!(
            "{:<58} {:>10.2e} {:>10.2e} {:>10.2e} {:>6}{}",
            c.name,
            r.max_abs,
            r.rel_l2,
            r.lse_max_abs,
            if ok { "yes" } else { "NO" },
            if r.unwritten + r.lse_inf_mismatch > 0 { format!(" unwritten={} lse_inf_mismatch={}", r.unwritten, r.lse_inf_mismatch) } else { String::new() }
        );
        if !ok {
            failures.push(c.name);
        }
    }
    assert!(failures.is_empty(), "failed cases: {failures:?}");
}

#[test]
fn repeated_calls_are_deterministic() {
    let Some(b) = backend() else { return };
    let c = &cases()[2];
    let spec = build_spec(c);
    let mut rng = StdRng::seed_from_u64(7);
    let q = random(spec.dims.q_len(), c.dtype, 1.0, &mut rng);
    let k = random(spec.dims.kv_len(), c.dtype, 1.0, &mut rng);
    let v = random(spec.dims.kv_len(), c.dtype, 1.0, &mut rng);
    let a = b.forward_poisoned(&spec, q.view(), k.view(), v.view(), f32::NAN).unwrap();
    for _ in 0..3 {
        let r = b.forward_poisoned(&spec, q.view(), k.view(), v.view(), f32::NAN).unwrap();
        assert_eq!(r.out, a.out);
        assert_eq!(r.lse, a.lse);
    }
}

#[test]
fn unsupported_head_dim_is_an_error() {
    let Some(b) = backend() else { return };
    let c = Case { name: "d96", dtype: DType::F16, d: 96, hq: 2, hkv: 2, causal: false, layout: Layout::Varlen(vec![0, 8], vec![0, 8]), input_scale: 1.0 };
    let spec = build_spec(&c);
    let mut rng = StdRng::seed_from_u64(3);
    let x = random(spec.dims.q_len(), c.dtype, 1.0, &mut rng);
    use cubeattn::Backend;
    match b.forward(&spec, x.view(), x.view(), x.view()) {
        Err(Error::Unsupported { backend, msg }) => {
            assert_eq!(backend, "cuda");
            assert!(msg.contains("head_dim 96"), "{msg}");
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

#[test]
fn status_lists_the_device() {
    let s = cubeattn::backend::cuda::status();
    println!("status: {s:?}");
    if CudaBackend::shared().is_err() {
        assert!(!s.cuda_available);
        return;
    }
    assert!(s.cuda_available);
    assert!(!s.devices.is_empty());
    assert!(s.devices[0].compute_capability.0 >= 7);
}

/// Timings for the Llama3-8B attention shape (32 q heads, 8 kv heads, d=128, bf16).
#[test]
fn bench_llama3_8b_shapes() {
    if std::env::var("CUBEATTN_GPU_BENCH").is_err() {
        println!("SKIP: set CUBEATTN_GPU_BENCH=1 to time the kernels");
        return;
    }
    if backend().is_none() {
        return;
    }
    println!("{:<40} {:>10} {:>10} {:>10}", "shape", "median_ms", "min_ms", "TFLOP/s");
    let iters: usize = std::env::var("CUBEATTN_GPU_BENCH_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    for &(n, causal, dtype, d) in &[
        (8192usize, true, DType::BF16, 128usize),
        (16384, true, DType::BF16, 128),
        (32768, true, DType::BF16, 128),
        (8192, false, DType::BF16, 128),
        (8192, true, DType::F16, 128),
        (8192, true, DType::BF16, 64),
    ] {
        let hq = 32;
        let hkv = 8;
        let cu = [0i32, n as i32];
        let spec = AttnSpec::varlen(
            &TensorMeta::new(&[n, hq, d], dtype),
            &TensorMeta::new(&[n, hkv, d], dtype),
            &TensorMeta::new(&[n, hkv, d], dtype),
            &cu,
            &cu,
            n,
            n,
            None,
            causal,
        )
        .unwrap();
        let mut t = bench_forward(&spec, 3, iters).expect("bench failed");
        t.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let med = t[t.len() / 2];
        let tflops = spec.forward_flops() / (med * 1e-3) / 1e12;
        let name = format!("{} n={} causal={} d={}", dtype.name(), n, causal, d);
        println!("{:<40} {:>10.3} {:>10.3} {:>10.1}", name, med, t[0], tflops);
    }
}
