//! CUDA flash-attention forward against the f64 reference, and timings.
//!
//! Inputs are fresh random normals (rounded to the tested dtype before the reference sees them);
//! outputs are poisoned with NaN before each launch so unwritten elements fail the test.
//! Set `CUBEATTN_GPU_BENCH=1` to also time the Llama3-8B shapes (prints a table).

use cubeattn::backend::cuda::backward::DqPath;
use cubeattn::backend::cuda::{bench, fwd_options, set_fwd_options, BenchPart, CudaBackend, FwdOptions};
use cubeattn::reference::forward_f64;
use cubeattn::{AttnSpec, DType, Error, HostData, TensorMeta};
use rand::{rngs::StdRng, SeedableRng};
use super::random;
use crate::common::{grouped_ranges_spec, value_dim_specs, varlen_spec};
use super::backend;

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
    /// flash-attn's window_size (left, right); (-1, -1) for none.
    window: (i64, i64),
}

enum Layout {
    Varlen(Vec<i32>, Vec<i32>),
    Grouped(Vec<[i32; 2]>, Vec<[i32; 2]>, usize, usize),
}

const NOWIN: (i64, i64) = (-1, -1);

fn build_spec(c: &Case) -> AttnSpec {
    let spec = match &c.layout {
        Layout::Varlen(cq, ck) => {
            let lens: Vec<(usize, usize)> =
                cq.windows(2).zip(ck.windows(2)).map(|(a, b)| ((a[1] - a[0]) as usize, (b[1] - b[0]) as usize)).collect();
            varlen_spec(&lens, c.hq, c.hkv, c.d, c.dtype, c.causal)
        }
        Layout::Grouped(qr, kr, tq, tk) => grouped_ranges_spec(qr, kr, *tq, *tk, c.hq, c.hkv, c.d, c.dtype, c.causal),
    };
    spec.with_window(c.window.0, c.window.1).expect("valid window")
}

struct Report {
    max_abs: f64,
    rel_l2: f64,
    lse_max_abs: f64,
    unwritten: usize,
    lse_inf_mismatch: usize,
}

struct Prepared {
    spec: AttnSpec,
    q: HostData,
    k: HostData,
    v: HostData,
    ref_out: Vec<f64>,
    ref_lse: Vec<f64>,
}

fn prepare(c: &Case, seed: u64) -> Prepared {
    prepare_spec(build_spec(c), c.input_scale, seed)
}

/// Random inputs at `input_scale` and the f64 reference of `spec`.
fn prepare_spec(spec: AttnSpec, input_scale: f32, seed: u64) -> Prepared {
    let mut rng = StdRng::seed_from_u64(seed);
    let (dt, d) = (spec.dtype, spec.dims);
    let q = random(d.q_len(), dt, input_scale, &mut rng);
    let k = random(d.kv_len(), dt, input_scale, &mut rng);
    let v = random(d.v_len(), dt, input_scale, &mut rng);
    let f64v = |h: &HostData| h.view().to_f64_vec();
    let (ref_out, ref_lse) = forward_f64(&spec, &f64v(&q), &f64v(&k), &f64v(&v));
    Prepared { spec, q, k, v, ref_out, ref_lse }
}

fn run_prepared(b: &CudaBackend, p: &Prepared) -> Result<Report, Error> {
    let got = b.forward_poisoned(&p.spec, p.q.view(), p.k.view(), p.v.view(), f32::NAN)?;
    let (ro, rl) = (&p.ref_out, &p.ref_lse);
    let go = got.out.to_f32_vec();
    assert_eq!(go.len(), ro.len());
    assert_eq!(got.lse.len(), rl.len());
    let mut r = Report { max_abs: 0.0, rel_l2: 0.0, lse_max_abs: 0.0, unwritten: 0, lse_inf_mismatch: 0 };
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, e) in go.iter().zip(ro) {
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
    for (g, e) in got.lse.iter().zip(rl) {
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
    Ok(r)
}

fn cases() -> Vec<Case> {
    use DType::*;
    let v = |q: &[i32], k: &[i32]| Layout::Varlen(q.to_vec(), k.to_vec());
    vec![
        Case { name: "f16 d64 1 token", dtype: F16, d: 64, hq: 4, hkv: 4, causal: false, layout: v(&[0, 1], &[0, 1]), input_scale: 1.0, window: NOWIN },
        Case { name: "f16 d128 noncausal 1x200", dtype: F16, d: 128, hq: 4, hkv: 2, causal: false, layout: v(&[0, 200], &[0, 200]), input_scale: 1.0, window: NOWIN },
        // non-causal d128: 160-key tiles (`FwdOptions::ws_bn`), lengths on and off them, sq != sk
        Case { name: "bf16 d128 noncausal GQA8/2 varlen q [1,161,320,530] k [160,161,321,700]", dtype: BF16, d: 128, hq: 8, hkv: 2, causal: false, layout: v(&[0, 1, 162, 482, 1012], &[0, 160, 321, 642, 1342]), input_scale: 1.0, window: NOWIN },
        Case { name: "f16 d128 noncausal 10x inputs q [300,300] k [1000,1500]", dtype: F16, d: 128, hq: 4, hkv: 1, causal: false, layout: v(&[0, 300, 600], &[0, 1000, 2500]), input_scale: 10.0, window: NOWIN },
        Case { name: "bf16 d128 GQA32/8 causal varlen [1,63,130]", dtype: BF16, d: 128, hq: 32, hkv: 8, causal: true, layout: v(&[0, 1, 64, 194], &[0, 1, 64, 194]), input_scale: 1.0, window: NOWIN },
        Case { name: "f16 d64 GQA8/2 causal varlen [65,129,7]", dtype: F16, d: 64, hq: 8, hkv: 2, causal: true, layout: v(&[0, 65, 194, 201], &[0, 65, 194, 201]), input_scale: 1.0, window: NOWIN },
        Case { name: "f16 d128 causal sq=50 < sk=200", dtype: F16, d: 128, hq: 8, hkv: 2, causal: true, layout: v(&[0, 50], &[0, 200]), input_scale: 1.0, window: NOWIN },
        Case { name: "bf16 d64 causal sq=200 > sk=70", dtype: BF16, d: 64, hq: 4, hkv: 1, causal: true, layout: v(&[0, 200], &[0, 70]), input_scale: 1.0, window: NOWIN },
        Case { name: "bf16 d128 causal 10x inputs 1x300", dtype: BF16, d: 128, hq: 4, hkv: 1, causal: true, layout: v(&[0, 300], &[0, 300]), input_scale: 10.0, window: NOWIN },
        Case {
            name: "bf16 d128 grouped 3 groups overlapping kv + uncovered rows",
            dtype: BF16,
            d: 128,
            hq: 8,
            hkv: 2,
            causal: true,
            layout: Layout::Grouped(vec![[0, 100], [100, 170], [180, 300]], vec![[0, 100], [0, 170], [50, 400]], 310, 400),
            input_scale: 1.0,
            window: NOWIN,
        },
        Case { name: "f16 d64 grouped noncausal same kv", dtype: F16, d: 64, hq: 4, hkv: 2, causal: false, layout: Layout::Grouped(vec![[0, 40], [40, 90]], vec![[0, 150], [0, 150]], 90, 150), input_scale: 1.0, window: NOWIN },
        Case {
            name: "bf16 d128 GQA32/8 16 groups: windows, 1-token, empty",
            dtype: BF16,
            d: 128,
            hq: 32,
            hkv: 8,
            causal: false,
            layout: Layout::Grouped(
                vec![[0, 1], [1, 1], [1, 9], [9, 40], [45, 46], [46, 60], [60, 61], [61, 70], [70, 70], [70, 90], [90, 91], [91, 92], [92, 100], [100, 130], [130, 131], [131, 140]],
                vec![[0, 5], [3, 3], [0, 700], [100, 900], [5, 6], [0, 1000], [999, 1000], [0, 0], [10, 20], [200, 260], [0, 1000], [500, 501], [0, 64], [64, 128], [0, 1], [300, 1000]],
                150,
                1000,
            ),
            input_scale: 1.0,
            window: NOWIN,
        },
        Case {
            name: "bf16 d128 GQA32/8 16 groups causal, same windows",
            dtype: BF16,
            d: 128,
            hq: 32,
            hkv: 8,
            causal: true,
            layout: Layout::Grouped(
                vec![[0, 1], [1, 1], [1, 9], [9, 40], [45, 46], [46, 60], [60, 61], [61, 70], [70, 70], [70, 90], [90, 91], [91, 92], [92, 100], [100, 130], [130, 131], [131, 140]],
                vec![[0, 5], [3, 3], [0, 700], [100, 900], [5, 6], [0, 1000], [999, 1000], [0, 0], [10, 20], [200, 260], [0, 1000], [500, 501], [0, 64], [64, 128], [0, 1], [300, 1000]],
                150,
                1000,
            ),
            input_scale: 1.0,
            window: NOWIN,
        },
        Case {
            name: "bf16 d128 GQA32/8 shared prefix 16x8 (split)",
            dtype: BF16,
            d: 128,
            hq: 32,
            hkv: 8,
            causal: false,
            layout: Layout::Grouped(
                (0..16).map(|g| [8 * g, 8 * g + 8]).collect(),
                (0..16).map(|g| [0, 2048 - 64 * g]).collect(),
                128,
                2048,
            ),
            input_scale: 1.0,
            window: NOWIN,
        },
        Case {
            name: "f16 d64 GQA8/2 causal groups 3x5 over 3000 keys (split)",
            dtype: F16,
            d: 64,
            hq: 8,
            hkv: 2,
            causal: true,
            layout: Layout::Grouped(vec![[0, 5], [5, 10], [10, 15]], vec![[0, 3000], [0, 2000], [1000, 3000]], 15, 3000),
            input_scale: 1.0,
            window: NOWIN,
        },
        Case {
            name: "bf16 d128 zigzag-like 2 groups causal 200/400 of 1600 keys",
            dtype: BF16,
            d: 128,
            hq: 32,
            hkv: 8,
            causal: true,
            layout: Layout::Grouped(vec![[0, 200], [200, 600]], vec![[0, 200], [0, 1600]], 600, 1600),
            input_scale: 1.0,
            window: NOWIN,
        },
        Case { name: "f32 d64 causal varlen [1,70]", dtype: F32, d: 64, hq: 4, hkv: 2, causal: true, layout: v(&[0, 1, 71], &[0, 1, 71]), input_scale: 1.0, window: NOWIN },
        Case { name: "f32 d128 grouped causal", dtype: F32, d: 128, hq: 4, hkv: 1, causal: true, layout: Layout::Grouped(vec![[0, 30], [35, 80]], vec![[0, 60], [20, 120]], 80, 120), input_scale: 1.0, window: NOWIN },
        // sliding windows (flash-attn window_size): rows whose window holds no key, windows off the tiles
        Case { name: "bf16 d128 GQA8/2 window (70,0) causal varlen [1,200,700]", dtype: BF16, d: 128, hq: 8, hkv: 2, causal: true, layout: v(&[0, 1, 201, 901], &[0, 1, 201, 901]), input_scale: 1.0, window: (70, 0) },
        Case { name: "f16 d64 window (5,130) sq=300 > sk=120", dtype: F16, d: 64, hq: 4, hkv: 1, causal: false, layout: v(&[0, 300], &[0, 120]), input_scale: 1.0, window: (5, 130) },
        Case { name: "bf16 d128 window (0,0) sq=100 < sk=500", dtype: BF16, d: 128, hq: 4, hkv: 2, causal: false, layout: v(&[0, 100], &[0, 500]), input_scale: 1.0, window: (0, 0) },
        Case { name: "f16 d128 window (300,-1) 1x1000 (split-K)", dtype: F16, d: 128, hq: 4, hkv: 1, causal: false, layout: v(&[0, 1000], &[0, 1000]), input_scale: 1.0, window: (300, -1) },
        Case { name: "bf16 d128 grouped window (40,3) overlapping kv", dtype: BF16, d: 128, hq: 8, hkv: 2, causal: false, layout: Layout::Grouped(vec![[0, 100], [100, 170], [180, 300]], vec![[0, 100], [0, 170], [50, 400]], 310, 400), input_scale: 1.0, window: (40, 3) },
        Case { name: "f32 d64 window (9,2) varlen [1,70]", dtype: F32, d: 64, hq: 4, hkv: 2, causal: false, layout: v(&[0, 1, 71], &[0, 1, 71]), input_scale: 1.0, window: (9, 2) },
        // the other head dims (mma.sync tiles at 32 and 96, 16-row planes at 192 and 256, no tensor
        // maps at 256; f32 row-wise): ragged varlen, GQA, sq != sk, grouped, window, split-K
        Case { name: "bf16 d32 causal GQA8/2 varlen [1,63,130,17]", dtype: BF16, d: 32, hq: 8, hkv: 2, causal: true, layout: v(&[0, 1, 64, 194, 211], &[0, 1, 64, 194, 211]), input_scale: 1.0, window: NOWIN },
        Case { name: "f16 d96 causal GQA8/2 varlen [1,63,130,17]", dtype: F16, d: 96, hq: 8, hkv: 2, causal: true, layout: v(&[0, 1, 64, 194, 211], &[0, 1, 64, 194, 211]), input_scale: 1.0, window: NOWIN },
        Case { name: "bf16 d96 noncausal sq=50 < sk=300", dtype: BF16, d: 96, hq: 4, hkv: 1, causal: false, layout: v(&[0, 50], &[0, 300]), input_scale: 1.0, window: NOWIN },
        Case { name: "bf16 d192 causal GQA8/2 varlen [1,63,130,17]", dtype: BF16, d: 192, hq: 8, hkv: 2, causal: true, layout: v(&[0, 1, 64, 194, 211], &[0, 1, 64, 194, 211]), input_scale: 1.0, window: NOWIN },
        Case { name: "f16 d192 noncausal sq=200 > sk=70", dtype: F16, d: 192, hq: 4, hkv: 2, causal: false, layout: v(&[0, 200], &[0, 70]), input_scale: 1.0, window: NOWIN },
        Case { name: "bf16 d256 causal GQA8/2 varlen [1,63,130,17]", dtype: BF16, d: 256, hq: 8, hkv: 2, causal: true, layout: v(&[0, 1, 64, 194, 211], &[0, 1, 64, 194, 211]), input_scale: 1.0, window: NOWIN },
        Case { name: "f16 d256 noncausal 10x inputs 1x300", dtype: F16, d: 256, hq: 4, hkv: 1, causal: false, layout: v(&[0, 300], &[0, 300]), input_scale: 10.0, window: NOWIN },
        Case { name: "bf16 d256 causal 3 groups split-K (5 rows, 2000-3000 keys)", dtype: BF16, d: 256, hq: 4, hkv: 1, causal: true, layout: Layout::Grouped(vec![[0, 5], [5, 10], [10, 15]], vec![[0, 3000], [0, 2000], [1000, 3000]], 15, 3000), input_scale: 1.0, window: NOWIN },
        Case { name: "bf16 d192 grouped window (40,3) overlapping kv", dtype: BF16, d: 192, hq: 8, hkv: 2, causal: false, layout: Layout::Grouped(vec![[0, 100], [100, 170], [180, 300]], vec![[0, 100], [0, 170], [50, 400]], 310, 400), input_scale: 1.0, window: (40, 3) },
        Case { name: "f32 d96 causal GQA4/2 varlen", dtype: F32, d: 96, hq: 4, hkv: 2, causal: true, layout: v(&[0, 1, 64, 194], &[0, 1, 64, 194]), input_scale: 1.0, window: NOWIN },
        Case { name: "f32 d256 grouped causal", dtype: F32, d: 256, hq: 4, hkv: 1, causal: true, layout: Layout::Grouped(vec![[0, 30], [35, 80]], vec![[0, 60], [20, 120]], 80, 120), input_scale: 1.0, window: NOWIN },
        // head dims without a kernel of their own: the next kernel head dim with zero columns
        // (`backend::cuda::head_pad`; 8 -> 32, 33 and 40 -> 64, 80 -> 96, 112 -> 128, 160 -> 192,
        // 200 and 224 -> 256), odd row widths (33: 66-byte rows) included
        Case { name: "bf16 d8 causal GQA8/2 varlen [1,63,130,17]", dtype: BF16, d: 8, hq: 8, hkv: 2, causal: true, layout: v(&[0, 1, 64, 194, 211], &[0, 1, 64, 194, 211]), input_scale: 1.0, window: NOWIN },
        Case { name: "f16 d33 noncausal sq=50 < sk=300", dtype: F16, d: 33, hq: 4, hkv: 1, causal: false, layout: v(&[0, 50], &[0, 300]), input_scale: 1.0, window: NOWIN },
        Case { name: "bf16 d40 causal sq=200 > sk=70", dtype: BF16, d: 40, hq: 4, hkv: 2, causal: true, layout: v(&[0, 200], &[0, 70]), input_scale: 1.0, window: NOWIN },
        Case { name: "bf16 d80 causal GQA8/2 varlen [1,63,130,17]", dtype: BF16, d: 80, hq: 8, hkv: 2, causal: true, layout: v(&[0, 1, 64, 194, 211], &[0, 1, 64, 194, 211]), input_scale: 1.0, window: NOWIN },
        Case { name: "f16 d80 grouped window (40,3) overlapping kv", dtype: F16, d: 80, hq: 8, hkv: 2, causal: false, layout: Layout::Grouped(vec![[0, 100], [100, 170], [180, 300]], vec![[0, 100], [0, 170], [50, 400]], 310, 400), input_scale: 1.0, window: (40, 3) },
        Case { name: "bf16 d112 causal 10x inputs 1x300", dtype: BF16, d: 112, hq: 4, hkv: 1, causal: true, layout: v(&[0, 300], &[0, 300]), input_scale: 10.0, window: NOWIN },
        Case { name: "bf16 d160 causal GQA8/2 varlen [1,63,130,17]", dtype: BF16, d: 160, hq: 8, hkv: 2, causal: true, layout: v(&[0, 1, 64, 194, 211], &[0, 1, 64, 194, 211]), input_scale: 1.0, window: NOWIN },
        Case { name: "f16 d200 noncausal sq=200 > sk=70", dtype: F16, d: 200, hq: 4, hkv: 2, causal: false, layout: v(&[0, 200], &[0, 70]), input_scale: 1.0, window: NOWIN },
        Case { name: "bf16 d224 causal 3 groups split-K (5 rows, 2000-3000 keys)", dtype: BF16, d: 224, hq: 4, hkv: 1, causal: true, layout: Layout::Grouped(vec![[0, 5], [5, 10], [10, 15]], vec![[0, 3000], [0, 2000], [1000, 3000]], 15, 3000), input_scale: 1.0, window: NOWIN },
        Case { name: "f32 d80 causal GQA4/2 varlen", dtype: F32, d: 80, hq: 4, hkv: 2, causal: true, layout: v(&[0, 1, 64, 194], &[0, 1, 64, 194]), input_scale: 1.0, window: NOWIN },
        Case { name: "f32 d33 grouped causal", dtype: F32, d: 33, hq: 4, hkv: 1, causal: true, layout: Layout::Grouped(vec![[0, 30], [35, 80]], vec![[0, 60], [20, 120]], 80, 120), input_scale: 1.0, window: NOWIN },
    ]
}

/// Every element written, rows without keys at lse +inf, and the errors within `tolerance`.
fn passes(r: &Report, dtype: DType, input_scale: f32) -> bool {
    let tol = tolerance(dtype);
    r.unwritten == 0
        && r.lse_inf_mismatch == 0
        && r.rel_l2 < tol
        && r.max_abs < 30.0 * tol * input_scale.max(1.0) as f64
        && r.lse_max_abs < 1e-2 * input_scale.powi(2).max(1.0) as f64
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1e-2,
        DType::F16 => 3e-3,
        DType::F32 => 1e-5,
    }
}

/// Option sets the correctness test runs every case under (the first is the default).
fn variants() -> Vec<(&'static str, FwdOptions)> {
    let all = FwdOptions::defaults();
    vec![
        ("default", all),
        ("no-pack", FwdOptions { pack_heads: false, ..all }),
        ("no-split", FwdOptions { split: false, ..all }),
        // the mma.sync kernel (the path below sm_90) on a Hopper GPU, and its tile variants
        // `flash_fwd_sm90` where the warp-specialised frame (`kernels::flash_fwd_ws`) is the default
        ("no-ws", FwdOptions { sm90_ws: false, ..all }),
        // the warp-specialised frame's 128-key tile where the default takes the wider one (non-causal d128)
        ("ws-bn128", FwdOptions { ws_bn: 128, ..all }),
        ("mma-sync", FwdOptions { sm90: false, ..all }),
        ("bn32", FwdOptions { block_n: 32, sm90: false, ..all }),
        ("rows16", FwdOptions { plane_rows: 16, sm90: false, ..all }),
    ]
}

/// `variants()`, or only those named in `CUBEATTN_GPU_VARIANTS` (comma-separated).
fn selected_variants() -> Vec<(&'static str, FwdOptions)> {
    match std::env::var("CUBEATTN_GPU_VARIANTS") {
        Ok(list) => {
            let names: Vec<&str> = list.split(',').map(|n| n.trim()).collect();
            variants().into_iter().filter(|(n, _)| names.contains(n)).collect()
        }
        Err(_) => variants(),
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn forward_matches_f64_reference() {
    let Some(b) = backend() else { return };
    let saved = fwd_options();
    println!("{:<60} {:>16} {:>10} {:>10} {:>10} {:>4}", "case", "variant", "max_abs", "rel_l2", "lse_abs", "ok");
    let mut failures = Vec::new();
    for (i, c) in cases().iter().enumerate() {
        let p = prepare(c, 1000 + i as u64);
        let vs = if c.dtype == DType::F32 { vec![variants()[0]] } else { selected_variants() };
        for (vname, o) in vs {
            set_fwd_options(o);
            let r = match run_prepared(b, &p) {
                Ok(r) => r,
                Err(e) => {
                    println!("{:<60} {:>16} ERROR {e}", c.name, vname);
                    failures.push(format!("{} [{}]", c.name, vname));
                    continue;
                }
            };
            let ok = passes(&r, c.dtype, c.input_scale);
            println!(
                "{:<60} {:>16} {:>10.2e} {:>10.2e} {:>10.2e} {:>4}{}",
                c.name,
                vname,
                r.max_abs,
                r.rel_l2,
                r.lse_max_abs,
                if ok { "yes" } else { "NO" },
                if r.unwritten + r.lse_inf_mismatch > 0 { format!(" unwritten={} lse_inf_mismatch={}", r.unwritten, r.lse_inf_mismatch) } else { String::new() }
            );
            if !ok {
                failures.push(format!("{} [{}]", c.name, vname));
            }
        }
    }
    set_fwd_options(saved);
    assert!(failures.is_empty(), "failed cases: {failures:?}");
}

/// v with a head_dim of its own (DeepSeek's MLA: 192 / 128, and the others of
/// `value_dim_specs`) against the f64 reference, outputs poisoned: on the default kernels (on
/// Hopper the warp-specialised frame runs v at 128 columns, `forward::value_dim_native`) with and
/// without split-K, and (f16 / bf16) padded to one head_dim (`head_pad`) on `flash_fwd_sm90` and
/// on the mma.sync kernels.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn value_head_dim_of_its_own_matches_f64_reference() {
    let Some(b) = backend() else { return };
    let saved = fwd_options();
    let mut failures = Vec::new();
    for (i, (name, spec)) in value_dim_specs(&[DType::F16, DType::BF16, DType::F32]).into_iter().enumerate() {
        let p = prepare_spec(spec, 1.0, 7000 + i as u64);
        // on Hopper: the warp-specialised frame with v at its own head_dim (default, no split),
        // and padded to one head_dim (no-ws, mma-sync)
        let sixteen = ["default", "no-split", "no-ws", "mma-sync"];
        let vs: Vec<_> = variants().into_iter().filter(|(n, _)| *n == "default" || (p.spec.dtype != DType::F32 && sixteen.contains(n))).collect();
        for (vname, o) in vs {
            set_fwd_options(o);
            let line = match run_prepared(b, &p) {
                Ok(r) if passes(&r, p.spec.dtype, 1.0) => format!("ok  max_abs {:.2e} rel_l2 {:.2e} lse {:.2e}", r.max_abs, r.rel_l2, r.lse_max_abs),
                Ok(r) => {
                    failures.push(format!("{name} [{vname}]"));
                    format!("NO  max_abs {:.2e} rel_l2 {:.2e} lse {:.2e} unwritten {}", r.max_abs, r.rel_l2, r.lse_max_abs, r.unwritten)
                }
                Err(e) => {
                    failures.push(format!("{name} [{vname}]"));
                    format!("ERROR {e}")
                }
            };
            println!("{name:<44} {vname:>9} {line}");
        }
    }
    set_fwd_options(saved);
    assert!(failures.is_empty(), "failed: {failures:?}");
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
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
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
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

fn dense_spec(n: usize, causal: bool, dtype: DType, d: usize) -> AttnSpec {
    let cu = [0i32, n as i32];
    AttnSpec::varlen(
        &TensorMeta::new(&[n, 32, d], dtype),
        &TensorMeta::new(&[n, 8, d], dtype),
        &TensorMeta::new(&[n, 8, d], dtype),
        &cu,
        &cu,
        n,
        n,
        None,
        causal,
    )
    .unwrap()
}

fn grouped_spec(qr: &[[i32; 2]], kr: &[[i32; 2]], tq: usize, tk: usize, causal: bool) -> AttnSpec {
    let m = |n: usize, h: usize| TensorMeta::new(&[n, h, 128], DType::BF16);
    AttnSpec::grouped(&m(tq, 32), &m(tk, 8), &m(tk, 8), qr, kr, None, causal).unwrap()
}

/// Median milliseconds of one spec under the current options.
fn median_ms(spec: &AttnSpec, iters: usize) -> f64 {
    let mut t = match bench(spec, 3, iters, BenchPart::Forward, DqPath::Auto) {
        Ok(t) => t,
        Err(e) => {
            println!("bench failed: {e}");
            return f64::NAN;
        }
    };
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[t.len() / 2]
}

/// Timings for the Llama3-8B attention shape (32 q heads, 8 kv heads, d=128, bf16): dense causal,
/// the zigzag context-parallel groups (T = 64K, W = 8, ranks 0 and W-1) and the shared-prefix
/// decode groups, each grouped (one launch) and as one call of our kernel per group.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn bench_llama3_8b_shapes() {
    if std::env::var("CUBEATTN_GPU_BENCH").is_err() {
        println!("SKIP: set CUBEATTN_GPU_BENCH=1 to time the kernels");
        return;
    }
    if backend().is_none() {
        return;
    }
    let saved = fwd_options();
    let iters: usize = std::env::var("CUBEATTN_GPU_BENCH_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    let all = FwdOptions::defaults();
    let v5 = all;
    // CUBEATTN_GPU_BENCH=full adds the ablations and the per-group call timings.
    let full = std::env::var("CUBEATTN_GPU_BENCH").map(|v| v == "full").unwrap_or(false);
    let mut rows: Vec<(String, String, f64, f64)> = Vec::new();
    let mut record = |name: String, variant: &str, ms: f64, flops: f64| {
        let tf = flops / (ms * 1e-3) / 1e12;
        println!("{:<44} {:>14} {:>10.3} {:>8.1}", name, variant, ms, tf);
        rows.push((name, variant.to_string(), ms, tf));
    };
    let mut dense_variants = vec![("default", v5), ("bn32", FwdOptions { block_n: 32, ..v5 }), ("rows16", FwdOptions { plane_rows: 16, ..v5 })];
    if full {
        dense_variants.push(("no-pack", FwdOptions { pack_heads: false, ..v5 }));
    }
    for &(vname, o) in &dense_variants {
        set_fwd_options(o);
        for n in [8192usize, 16384, 32768] {
            let spec = dense_spec(n, true, DType::BF16, 128);
            record(format!("bf16 n={n} causal d=128"), vname, median_ms(&spec, iters), spec.forward_flops());
        }
    }
    for &(vname, o) in &[("default", v5)] {
        set_fwd_options(o);
        for &(n, causal, dtype, d) in &[(8192usize, false, DType::BF16, 128usize), (8192, true, DType::F16, 128), (8192, true, DType::BF16, 64)] {
            let spec = dense_spec(n, causal, dtype, d);
            record(format!("{} n={} causal={} d={}", dtype.name(), n, causal, d), vname, median_ms(&spec, iters), spec.forward_flops());
        }
    }

    // Zigzag: T = 65536, W = 8, chunk C = T / 16; rank r holds chunks r and 2W-1-r.
    let c = 4096i32;
    for rank in [0i32, 7] {
        let (a, b) = (rank, 15 - rank);
        let qr = [[0, c], [c, 2 * c]];
        let kr = [[0, (a + 1) * c], [0, (b + 1) * c]];
        let spec = grouped_spec(&qr, &kr, 2 * c as usize, 16 * c as usize, true);
        let name = format!("zigzag T=64K W=8 rank {rank}");
        for &(vname, o) in &[("grouped", v5)] {
            set_fwd_options(o);
            record(name.clone(), vname, median_ms(&spec, iters), spec.forward_flops());
        }
        if full {
            set_fwd_options(all);
            let mut sum = 0.0;
            for g in 0..2 {
                let kl = kr[g][1];
                let sg = grouped_spec(&[[0, c]], &[[0, kl]], c as usize, kl as usize, true);
                sum += median_ms(&sg, iters);
            }
            record(name, "per-group", sum, spec.forward_flops());
        }
    }

    // Shared prefix / decode: 32 groups x 8 queries, group g sees keys [0, 32768 - 256 g).
    let qr: Vec<[i32; 2]> = (0..32).map(|g| [8 * g, 8 * g + 8]).collect();
    let kr: Vec<[i32; 2]> = (0..32).map(|g| [0, 32768 - 256 * g]).collect();
    let spec = grouped_spec(&qr, &kr, 256, 32768, false);
    let name = "shared prefix 32x8 q, 32K kv".to_string();
    for &(vname, o) in &[
        ("grouped", v5),
        ("waves=4", FwdOptions { split_waves: 4, ..v5 }),
        ("waves=8", FwdOptions { split_waves: 8, ..v5 }),
        ("no-split", FwdOptions { split: false, ..v5 }),
    ] {
        set_fwd_options(o);
        record(name.clone(), vname, median_ms(&spec, iters.max(20)), spec.forward_flops());
    }
    if full {
        set_fwd_options(all);
        let mut sum = 0.0;
        for g in 0..32 {
            let kl = kr[g][1];
            let sg = grouped_spec(&[[0, 8]], &[[0, kl]], 8, kl as usize, false);
            sum += median_ms(&sg, iters);
        }
        record(name, "per-group", sum, spec.forward_flops());
    }
    set_fwd_options(saved);

    println!("\n{:<44} {:>16} {:>10} {:>8}", "shape", "variant", "median_ms", "TFLOP/s");
    for (n, v, ms, tf) in &rows {
        println!("{:<44} {:>16} {:>10.3} {:>8.1}", n, v, ms, tf);
    }
    if let Ok(path) = std::env::var("CUBEATTN_GPU_BENCH_JSON") {
        let body: Vec<String> = rows
            .iter()
            .map(|(n, v, ms, tf)| format!("{{\"shape\": \"{n}\", \"variant\": \"{v}\", \"median_ms\": {ms:.4}, \"tflops\": {tf:.2}}}"))
            .collect();
        let _ = std::fs::write(path, format!("[\n{}\n]\n", body.join(",\n")));
    }
}

/// Runs one bf16 d=128 causal case under each kernel configuration (`CUBEATTN_GPU_DUMP=1`):
/// with `CUBEATTN_DUMP_DIR=<dir>` (and `CUBEATTN_CACHE_DIR=off`) each generated CUDA source lands in `dir` (for `nvcc -Xptxas -v`).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn dump_kernel_sources() {
    if std::env::var("CUBEATTN_GPU_DUMP").is_err() {
        return;
    }
    let Some(b) = backend() else { return };
    let saved = fwd_options();
    let c = &cases()[2];
    let p = prepare(c, 5);
    let all = FwdOptions::defaults();
    for o in [all, FwdOptions { block_n: 32, ..all }, FwdOptions { plane_rows: 16, ..all }] {
        set_fwd_options(o);
        let r = run_prepared(b, &p).unwrap();
        println!("dump {o:?}: rel_l2 {:.2e}", r.rel_l2);
    }
    set_fwd_options(saved);
}
