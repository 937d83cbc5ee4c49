//! CUDA backward (dQ, dK, dV) against the f64 reference and the CPU backend, determinism, and
//! timings.
//!
//! Inputs are fresh random normals (rounded to the tested dtype before the references see them);
//! `out` and `lse` come from the CPU backend's forward (independent of the CUDA forward). The
//! gradients are poisoned with NaN before each launch, so unwritten elements fail.
//! Set `CUBEATTN_GPU_BENCH=1` to also time forward+backward for the Llama3-8B shapes.

use cubeattn::backend::cpu::CpuBackend;
use cubeattn::backend::cuda::backward::DqPath;
use cubeattn::backend::cuda::{bench, BenchPart};
use cubeattn::backend::cuda::CudaBackend;
use cubeattn::backend::BackwardInputs;
use cubeattn::reference::backward_f64;
use cubeattn::{AttnSpec, Backend, DType, Error, Gradients, HostData};
use rand::{rngs::StdRng, SeedableRng};
use super::random;
use crate::common::{grouped_ranges_spec, meta, value_dim_specs, varlen_spec};
use super::backend;

#[derive(Clone)]
enum Layout {
    /// Per sequence (q_len, k_len).
    Varlen(Vec<(usize, usize)>),
    /// q_ranges, kv_ranges, total_q, total_k.
    Grouped(Vec<[i32; 2]>, Vec<[i32; 2]>, usize, usize),
}

#[derive(Clone)]
struct Case {
    name: String,
    dtype: DType,
    d: usize,
    hq: usize,
    hkv: usize,
    causal: bool,
    layout: Layout,
    input_scale: f32,
    /// flash-attn's window_size (left, right); (-1, -1) for none.
    window: (i64, i64),
}

fn build_spec(c: &Case) -> AttnSpec {
    let spec = match &c.layout {
        Layout::Varlen(lens) => varlen_spec(lens, c.hq, c.hkv, c.d, c.dtype, c.causal),
        Layout::Grouped(qr, kr, tq, tk) => grouped_ranges_spec(qr, kr, *tq, *tk, c.hq, c.hkv, c.d, c.dtype, c.causal),
    };
    spec.with_window(c.window.0, c.window.1).expect("valid window")
}

struct Inputs {
    q: HostData,
    k: HostData,
    v: HostData,
    dout: HostData,
    out: HostData,
    lse: Vec<f32>,
}

fn make_inputs(spec: &AttnSpec, scale: f32, seed: u64) -> Inputs {
    let mut rng = StdRng::seed_from_u64(seed);
    let dm = spec.dims;
    let q = random(dm.q_len(), spec.dtype, scale, &mut rng);
    let k = random(dm.kv_len(), spec.dtype, scale, &mut rng);
    let v = random(dm.v_len(), spec.dtype, scale, &mut rng);
    let dout = random(dm.out_len(), spec.dtype, 1.0, &mut rng);
    let f = CpuBackend.forward(spec, q.view(), k.view(), v.view()).expect("CPU forward");
    Inputs { q, k, v, dout, out: f.out, lse: f.lse }
}

fn grad_inputs(i: &Inputs, deterministic: bool) -> BackwardInputs<'_> {
    BackwardInputs { out: i.out.view(), lse: &i.lse, dout: i.dout.view(), deterministic }
}

#[derive(Default, Clone, Copy)]
struct Err3 {
    max_abs: f64,
    rel_l2: f64,
    /// elements outside atol + rtol * |ref|
    bad: usize,
    nonfinite: usize,
}

fn compare(got: &HostData, want: &[f64], atol: f64, rtol: f64) -> Err3 {
    let g = got.to_f32_vec();
    assert_eq!(g.len(), want.len());
    let mut r = Err3::default();
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, w) in g.iter().zip(want) {
        if !x.is_finite() {
            r.nonfinite += 1;
            continue;
        }
        let diff = (*x as f64 - w).abs();
        r.max_abs = r.max_abs.max(diff);
        if diff > atol + rtol * w.abs() {
            r.bad += 1;
        }
        num += diff * diff;
        den += w * w;
    }
    r.rel_l2 = if den > 0.0 { (num / den).sqrt() } else { num.sqrt() };
    r
}

fn rel_tol(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1e-2,
        DType::F16 => 5e-3,
        DType::F32 => 1e-4,
    }
}

fn cases() -> Vec<Case> {
    use DType::*;
    let mut v = Vec::new();
    for dtype in [F16, BF16] {
        for d in [64usize, 128] {
            for causal in [false, true] {
                let tag = format!("{} d{} {}", dtype.name(), d, if causal { "causal" } else { "full" });
                v.push(Case {
                    name: format!("{tag} GQA4/2 varlen [1,63,130,17]"),
                    dtype,
                    d,
                    hq: 4,
                    hkv: 2,
                    causal,
                    layout: Layout::Varlen(vec![(1, 1), (63, 63), (130, 130), (17, 17)]),
                    input_scale: 1.0,
                    window: (-1, -1),
                });
                v.push(Case {
                    name: format!("{tag} GQA32/8 varlen [100,1,77]"),
                    dtype,
                    d,
                    hq: 32,
                    hkv: 8,
                    causal,
                    layout: Layout::Varlen(vec![(100, 100), (1, 1), (77, 77)]),
                    input_scale: 1.0,
                    window: (-1, -1),
                });
                v.push(Case {
                    name: format!("{tag} GQA8/2 grouped 4 (1 empty, overlap, uncovered)"),
                    dtype,
                    d,
                    hq: 8,
                    hkv: 2,
                    causal,
                    layout: Layout::Grouped(
                        vec![[0, 100], [100, 170], [170, 170], [180, 300]],
                        vec![[0, 100], [0, 170], [10, 50], [50, 400]],
                        310,
                        400,
                    ),
                    input_scale: 1.0,
                    window: (-1, -1),
                });
            }
        }
    }
    let mk = |name: &str, dtype, d, hq, hkv, causal, layout, input_scale| Case {
        name: name.to_string(),
        dtype,
        d,
        hq,
        hkv,
        causal,
        layout,
        input_scale,
        window: (-1, -1),
    };
    v.push(mk("bf16 d128 causal sq=50 < sk=200", BF16, 128, 8, 2, true, Layout::Varlen(vec![(50, 200)]), 1.0));
    v.push(mk("f16 d64 causal sq=200 > sk=70 (rows see no key)", F16, 64, 4, 1, true, Layout::Varlen(vec![(200, 70)]), 1.0));
    v.push(mk("bf16 d128 causal 2 groups same kv", BF16, 128, 4, 2, true, Layout::Grouped(vec![[0, 90], [90, 200]], vec![[0, 150], [0, 150]], 200, 150), 1.0));
    v.push(mk("f16 d64 full 3 groups nested kv", F16, 64, 4, 4, false, Layout::Grouped(vec![[0, 33], [33, 99], [99, 100]], vec![[0, 257], [64, 128], [100, 101]], 100, 257), 1.0));
    v.push(mk("bf16 d128 causal inputs x4 1x300", BF16, 128, 4, 1, true, Layout::Varlen(vec![(300, 300)]), 4.0));
    v.push(mk("f32 d64 causal GQA4/2 varlen [1,70,33]", F32, 64, 4, 2, true, Layout::Varlen(vec![(1, 1), (70, 70), (33, 33)]), 1.0));
    v.push(mk("f32 d128 grouped causal 3 groups", F32, 128, 4, 1, true, Layout::Grouped(vec![[0, 30], [35, 80], [80, 80]], vec![[0, 60], [20, 120], [0, 5]], 80, 120), 1.0));
    // sliding windows: key tiles seen by a band of rows, rows whose window holds no key
    let w = |c: Case, window| Case { window, ..c };
    v.push(w(mk("bf16 d128 window (70,0) causal GQA8/2 varlen [1,200,300]", BF16, 128, 8, 2, true, Layout::Varlen(vec![(1, 1), (200, 200), (300, 300)]), 1.0), (70, 0)));
    v.push(w(mk("f16 d64 window (5,130) sq=300 > sk=120", F16, 64, 4, 1, false, Layout::Varlen(vec![(300, 120)]), 1.0), (5, 130)));
    v.push(w(mk("bf16 d128 window (0,0) sq=100 < sk=500", BF16, 128, 4, 2, false, Layout::Varlen(vec![(100, 500)]), 1.0), (0, 0)));
    v.push(w(mk("f16 d128 window (40,3) grouped overlapping kv", F16, 128, 8, 2, false, Layout::Grouped(vec![[0, 100], [100, 170], [180, 300]], vec![[0, 100], [0, 170], [50, 400]], 310, 400), 1.0), (40, 3)));
    v.push(w(mk("f32 d64 window (9,2) GQA4/2 varlen [1,70,33]", F32, 64, 4, 2, false, Layout::Varlen(vec![(1, 1), (70, 70), (33, 33)]), 1.0), (9, 2)));
    // the other head dims with a backward kernel (32, 96: the mma.sync kernels; f32 row-wise)
    for (dtype, d) in [(BF16, 96), (F16, 96), (BF16, 32), (F32, 96)] {
        let tag = format!("{} d{d}", dtype.name());
        v.push(mk(&format!("{tag} causal GQA4/2 varlen [1,63,130,17]"), dtype, d, 4, 2, true, Layout::Varlen(vec![(1, 1), (63, 63), (130, 130), (17, 17)]), 1.0));
        v.push(mk(&format!("{tag} full GQA8/2 sq=70 < sk=200"), dtype, d, 8, 2, false, Layout::Varlen(vec![(70, 200)]), 1.0));
        v.push(mk(&format!("{tag} causal grouped overlapping kv"), dtype, d, 8, 2, true, Layout::Grouped(vec![[0, 100], [100, 170], [180, 300]], vec![[0, 100], [0, 170], [50, 400]], 310, 400), 1.0));
    }
    v.push(w(mk("bf16 d96 window (70,0) causal GQA8/2 varlen [1,200,300]", BF16, 96, 8, 2, true, Layout::Varlen(vec![(1, 1), (200, 200), (300, 300)]), 1.0), (70, 0)));
    // above 128 (the Hopper kernel with 64-key cubes; deterministic: its dQ-less variant and the dQ pass)
    for (dtype, d) in [(BF16, 192), (F16, 256), (BF16, 256)] {
        let tag = format!("{} d{d}", dtype.name());
        v.push(mk(&format!("{tag} causal GQA4/2 varlen [1,63,130,17]"), dtype, d, 4, 2, true, Layout::Varlen(vec![(1, 1), (63, 63), (130, 130), (17, 17)]), 1.0));
        v.push(mk(&format!("{tag} full GQA8/2 sq=70 < sk=200"), dtype, d, 8, 2, false, Layout::Varlen(vec![(70, 200)]), 1.0));
        v.push(mk(&format!("{tag} causal grouped 4 (1 empty, overlap, uncovered)"), dtype, d, 8, 2, true, Layout::Grouped(vec![[0, 100], [100, 170], [170, 170], [180, 300]], vec![[0, 100], [0, 170], [10, 50], [50, 400]], 310, 400), 1.0));
    }
    v.push(w(mk("bf16 d256 window (70,0) causal GQA8/2 varlen [1,200,300]", BF16, 256, 8, 2, true, Layout::Varlen(vec![(1, 1), (200, 200), (300, 300)]), 1.0), (70, 0)));
    v.push(w(mk("f16 d192 window (5,130) sq=300 > sk=120", F16, 192, 4, 1, false, Layout::Varlen(vec![(300, 120)]), 1.0), (5, 130)));
    v.push(mk("bf16 d256 causal inputs x4 1x300", BF16, 256, 4, 1, true, Layout::Varlen(vec![(300, 300)]), 4.0));
    // head dims without a kernel of their own: the next kernel head dim with zero columns
    // (`backend::cuda::head_pad`: 33 and 40 -> 64, 80 -> 96, 112 -> 128, 160 -> 192, 224 -> 256)
    for (dtype, d) in [(BF16, 80), (F16, 40), (BF16, 112), (BF16, 160), (F16, 224), (F32, 80), (BF16, 33)] {
        let tag = format!("{} d{d}", dtype.name());
        v.push(mk(&format!("{tag} causal GQA4/2 varlen [1,63,130,17]"), dtype, d, 4, 2, true, Layout::Varlen(vec![(1, 1), (63, 63), (130, 130), (17, 17)]), 1.0));
        v.push(mk(&format!("{tag} full GQA8/2 sq=70 < sk=200"), dtype, d, 8, 2, false, Layout::Varlen(vec![(70, 200)]), 1.0));
    }
    v.push(w(mk("bf16 d80 window (40,3) grouped overlapping kv", BF16, 80, 8, 2, false, Layout::Grouped(vec![[0, 100], [100, 170], [180, 300]], vec![[0, 100], [0, 170], [50, 400]], 310, 400), 1.0), (40, 3)));
    v
}


/// Pass criteria: no unwritten or non-finite element; ||g - ref|| / ||ref|| <= 1e-2 (bf16),
/// 5e-3 (f16), 1e-4 (f32) against the f64 reference; elementwise |g - ref| <= atol + rtol*|ref|
/// (atol = rtol = 1e-2, atol scaled by the input scale for dq and dk; 1e-4 for f32), or, where a
/// bf16 element misses that, a max error no worse than twice the CPU backend's (the exact f32
/// algorithm on the same rounded inputs: its error is the floor set by bf16 `out` and outputs).
/// `path`: the dQ pass or the fused atomic dQ (f16/bf16).
fn check_case(b: &CudaBackend, c: &Case, seed: u64, path: DqPath) -> (bool, String) {
    check_spec(b, &c.name, &build_spec(c), c.input_scale, seed, path)
}

/// [`check_case`] of a spec `name`d, its inputs at `input_scale`.
fn check_spec(b: &CudaBackend, name: &str, spec: &AttnSpec, input_scale: f32, seed: u64, path: DqPath) -> (bool, String) {
    let inp = make_inputs(spec, input_scale, seed);
    let deterministic = path != DqPath::Atomic;
    let got = match b.backward_poisoned_on(spec, inp.q.view(), inp.k.view(), inp.v.view(), grad_inputs(&inp, deterministic), f32::NAN, path) {
        Ok(g) => g,
        Err(e) => return (false, format!("{:<62} ERROR {e}", name)),
    };
    let w = |h: &HostData| h.view().to_f64_vec();
    let (rq, rk, rv) = backward_f64(spec, &w(&inp.q), &w(&inp.k), &w(&inp.v), &w(&inp.dout));
    let cpu = CpuBackend.backward(spec, inp.q.view(), inp.k.view(), inp.v.view(), grad_inputs(&inp, true)).expect("CPU backward");
    let (atol, rtol) = if spec.dtype == DType::F32 { (1e-4, 1e-4) } else { (1e-2, 1e-2) };
    let st = input_scale.max(1.0) as f64;
    let e = [compare(&got.dq, &rq, atol * st, rtol), compare(&got.dk, &rk, atol * st, rtol), compare(&got.dv, &rv, atol, rtol)];
    let ce = [compare(&cpu.dq, &rq, atol * st, rtol), compare(&cpu.dk, &rk, atol * st, rtol), compare(&cpu.dv, &rv, atol, rtol)];
    let cw = |h: &HostData| h.to_f32_vec().iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let vs_cpu = [compare(&got.dq, &cw(&cpu.dq), 0.0, 0.0), compare(&got.dk, &cw(&cpu.dk), 0.0, 0.0), compare(&got.dv, &cw(&cpu.dv), 0.0, 0.0)];
    let tol = rel_tol(spec.dtype);
    let mut ok = true;
    let mut fallback = false;
    for (g, cp) in e.iter().zip(&ce) {
        ok &= g.nonfinite == 0 && g.rel_l2 <= tol;
        if g.bad > 0 {
            fallback = true;
            ok &= spec.dtype == DType::BF16 && g.max_abs <= 2.0 * cp.max_abs;
        }
    }
    let mut line = format!(
        "{} {:<62} dq {:>8.2e} {:>8.2e} | dk {:>8.2e} {:>8.2e} | dv {:>8.2e} {:>8.2e} | vs cpu {:>8.2e}",
        match path {
            DqPath::Atomic => "[atm]",
            _ => "[det]",
        },
        name,
        e[0].rel_l2,
        e[0].max_abs,
        e[1].rel_l2,
        e[1].max_abs,
        e[2].rel_l2,
        e[2].max_abs,
        vs_cpu.iter().map(|x| x.rel_l2).fold(0.0, f64::max)
    );
    line += &format!(" {}", if ok { "ok" } else { "FAIL" });
    let nonfinite: usize = e.iter().map(|x| x.nonfinite).sum();
    if fallback || nonfinite > 0 {
        line += &format!(
            "\n    outside atol/rtol: gpu dq {} dk {} dv {} (cpu backend: {} {} {}); max_abs cpu vs f64: {:.2e} {:.2e} {:.2e}; nonfinite {}",
            e[0].bad, e[1].bad, e[2].bad, ce[0].bad, ce[1].bad, ce[2].bad, ce[0].max_abs, ce[1].max_abs, ce[2].max_abs, nonfinite
        );
    }
    (ok, line)
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn backward_matches_f64_reference_and_cpu() {
    let Some(b) = backend() else { return };
    println!("{:<62} {:>17} | {:>17} | {:>17}", "case (rel_l2, max_abs vs f64)", "dq", "dk", "dv");
    let mut failures = Vec::new();
    for path in [DqPath::Pass, DqPath::Atomic] {
        for (i, c) in cases().iter().enumerate() {
            let (ok, line) = check_case(b, c, 5000 + i as u64, path);
            println!("{line}");
            if !ok {
                failures.push(format!("{} ({path:?})", c.name));
            }
        }
    }
    assert!(failures.is_empty(), "failed cases: {failures:?}");
}

/// v with a head_dim of its own (`value_dim_specs`: DeepSeek's MLA 192 / 128 among them) on both
/// dQ paths against the f64 reference and the CPU backend, gradients poisoned; f32 above head_dim
/// 128 has no CUDA backward and must be refused, not run.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn value_head_dim_of_its_own_backward() {
    let Some(b) = backend() else { return };
    let mut failures = Vec::new();
    for (i, (name, spec)) in value_dim_specs(&[DType::F16, DType::BF16, DType::F32]).iter().enumerate() {
        let wide = spec.dims.head_dim.max(spec.dims.head_dim_v) > 128;
        if spec.dtype == DType::F32 && wide {
            let r = b.supports(spec, cubeattn::Pass::Backward { deterministic: false });
            println!("{name:<62} refused: {r:?}");
            if !matches!(r, Err(Error::Unsupported { .. })) {
                failures.push(name.clone());
            }
            continue;
        }
        for path in [DqPath::Pass, DqPath::Atomic] {
            let (ok, line) = check_spec(b, name, spec, 1.0, 7500 + i as u64, path);
            println!("{line}");
            if !ok {
                failures.push(format!("{name} ({path:?})"));
            }
        }
    }
    assert!(failures.is_empty(), "failed cases: {failures:?}");
}

/// 32K keys: a few query rows (GQA 8/2) attending a 32768-key window, causal bottom-right, plus
/// a second segment reusing the tail of the same keys (grouped).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn backward_32k_keys_stress() {
    let Some(b) = backend() else { return };
    let c = Case {
        name: "bf16 d128 GQA8/2 causal grouped, 32768 keys".into(),
        dtype: DType::BF16,
        d: 128,
        hq: 8,
        hkv: 2,
        causal: true,
        layout: Layout::Grouped(vec![[0, 100], [100, 160]], vec![[0, 32768], [30000, 32768]], 160, 32768),
        input_scale: 1.0,
        window: (-1, -1),
    };
    for path in [DqPath::Pass, DqPath::Atomic] {
        let (ok, line) = check_case(b, &c, 77, path);
        println!("{line}");
        assert!(ok, "{line}");
    }
}

fn same(a: &Gradients, b: &Gradients) -> bool {
    a.dq.view().as_bytes() == b.dq.view().as_bytes()
        && a.dk.view().as_bytes() == b.dk.view().as_bytes()
        && a.dv.view().as_bytes() == b.dv.view().as_bytes()
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn backward_is_deterministic() {
    let Some(b) = backend() else { return };
    let mut cs: Vec<Case> = cases().into_iter().filter(|c| matches!(c.layout, Layout::Grouped(..))).take(2).collect();
    let big = |name: &str, d, causal, n, window| Case {
        name: name.into(),
        dtype: DType::BF16,
        d,
        hq: 32,
        hkv: 8,
        causal,
        layout: Layout::Varlen(vec![(n, n)]),
        input_scale: 1.0,
        window,
    };
    cs.push(big("bf16 d128 GQA32/8 causal 1x1500", 128, true, 1500, (-1, -1)));
    // many key tiles adding to every query tile: where an unordered sum would differ run to run
    cs.push(big("bf16 d128 GQA32/8 full 1x4000", 128, false, 4000, (-1, -1)));
    cs.push(big("bf16 d64 GQA32/8 full 1x3000", 64, false, 3000, (-1, -1)));
    cs.push(big("bf16 d128 GQA32/8 window (700,300) 1x3000", 128, false, 3000, (700, 300)));
    for c in &cs {
        let spec = build_spec(c);
        let inp = make_inputs(&spec, 1.0, 99);
        // deterministic calls: the default path (the pass) and the pass asked for
        for path in [DqPath::Auto, DqPath::Pass] {
            let run = || b.backward_on(&spec, inp.q.view(), inp.k.view(), inp.v.view(), grad_inputs(&inp, true), path).expect("backward");
            let first = run();
            let mut all = true;
            for _ in 0..4 {
                all &= same(&first, &run());
            }
            println!("{:<62} deterministic {path:?}: bitwise identical over 5 runs: {all}", c.name);
            assert!(all, "{} {path:?}", c.name);
        }
        // The atomic path: dK, dV stay bitwise identical; dQ may differ in the last bits.
        let arun = || {
            b.backward_on(&spec, inp.q.view(), inp.k.view(), inp.v.view(), grad_inputs(&inp, false), DqPath::Atomic)
                .expect("backward")
        };
        let (a0, a1) = (arun(), arun());
        let dkdv_same = a0.dk.view().as_bytes() == a1.dk.view().as_bytes() && a0.dv.view().as_bytes() == a1.dv.view().as_bytes();
        let want: Vec<f64> = a0.dq.to_f32_vec().iter().map(|&x| x as f64).collect();
        let dqd = compare(&a1.dq, &want, 0.0, 0.0);
        println!("{:<62} atomic path, 2 runs: dk/dv identical {dkdv_same}, dq rel_l2 diff {:.2e}", c.name, dqd.rel_l2);
        assert!(dkdv_same && dqd.rel_l2 < 1e-3, "{}", c.name);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn backward_unsupported_head_dim_is_an_error() {
    let Some(b) = backend() else { return };
    let c = Case {
        name: "d192".into(),
        dtype: DType::F16,
        d: 192,
        hq: 2,
        hkv: 2,
        causal: false,
        layout: Layout::Varlen(vec![(8, 8)]),
        input_scale: 1.0,
        window: (-1, -1),
    };
    let spec = build_spec(&c);
    let inp = make_inputs(&spec, 1.0, 3);
    // both dQ paths: the Hopper kernel, or refused below sm_90
    for det in [false, true] {
        match b.backward(&spec, inp.q.view(), inp.k.view(), inp.v.view(), grad_inputs(&inp, det)) {
            Ok(_) if b.target().wgmma => {}
            Err(Error::Unsupported { backend, msg }) if !b.target().wgmma => {
                assert_eq!(backend, "cuda");
                assert!(msg.contains("head_dim 192") && msg.contains("Hopper"), "{msg}");
            }
            other => panic!("wgmma {}: unexpected {:?}", b.target().wgmma, other.map(|_| ())),
        }
    }
    // float32 head_dim 160: padded to 192, whose backward takes f16 / bf16 only (every GPU)
    let odd = build_spec(&Case { d: 160, dtype: DType::F32, ..c.clone() });
    let oi = make_inputs(&odd, 1.0, 4);
    match b.backward(&odd, oi.q.view(), oi.k.view(), oi.v.view(), grad_inputs(&oi, false)) {
        Err(Error::Unsupported { backend, msg }) => {
            assert!(backend == "cuda" && msg.contains("head_dim 160 runs on the head_dim 192 kernels") && msg.contains("Hopper"), "{msg}")
        }
        other => panic!("expected Unsupported, got {:?}", other.map(|_| ())),
    }
}

/// Forward+backward and backward-alone timings, Llama3-8B heads (32 q / 8 kv, d=128, bf16).
/// TFLOP/s counts fwd+bwd as 3.5x and bwd as 2.5x the forward matmul FLOPs.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn bench_backward_llama3_8b() {
    if std::env::var("CUBEATTN_GPU_BENCH").is_err() {
        println!("SKIP: set CUBEATTN_GPU_BENCH=1 to time the kernels");
        return;
    }
    if backend().is_none() {
        return;
    }
    let iters: usize = std::env::var("CUBEATTN_GPU_BENCH_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
    println!("{:<52} {:>10} {:>10} {:>10}", "shape", "median_ms", "min_ms", "TFLOP/s");
    let mut table = Vec::new();
    for &(n, causal, d) in &[(8192usize, true, 128usize), (16384, true, 128), (8192, false, 128), (8192, true, 64)] {
        let cu = [0i32, n as i32];
        let spec = AttnSpec::varlen(
            &meta(n, 32, d, DType::BF16),
            &meta(n, 8, d, DType::BF16),
            &meta(n, 8, d, DType::BF16),
            &cu,
            &cu,
            n,
            n,
            None,
            causal,
        )
        .unwrap();
        for (path, tag) in [(DqPath::Atomic, "atomic"), (DqPath::Pass, "pass")] {
            for (part, mult, label) in [(BenchPart::ForwardBackward, 3.5, "fwd+bwd"), (BenchPart::Backward, 2.5, "bwd")] {
                let mut t = bench(&spec, 2, iters, part, path).expect("bench failed");
                t.sort_by(|a, b| a.partial_cmp(b).unwrap());
                let med = t[t.len() / 2];
                let tflops = mult * spec.forward_flops() / (med * 1e-3) / 1e12;
                let name = format!("{label} {tag} n={n} causal={causal} d={d}");
                let line = format!("{:<52} {:>10.3} {:>10.3} {:>10.1}", name, med, t[0], tflops);
                println!("{line}");
                table.push(line);
            }
        }
    }
    println!("---- summary ----");
    for l in &table {
        println!("{l}");
    }
}
