//! cubeattn's candle ops on candle CUDA tensors (feature `candle-cuda`): out, lse and the
//! gradients of candle's `backward()` against (a) the same call on CPU tensors (cubeattn's CPU
//! backend) and (b) the f64 reference (`cubeattn::reference`), for the batch, varlen and grouped
//! calls in f16, bf16 and f32 at head_dim 64 and 128 (and 48, 80: padded to a kernel head dim; and
//! v with a head_dim of its own: DeepSeek's MLA, q and k 192 with v 128, and v 96 wider than q's 64);
//! strided and misaligned views; errors.
//!
//! Every test needs a CUDA GPU and is `#[ignore]`d with that reason, so a plain `cargo test`
//! lists them as ignored. `scripts/gpu-test.sh test candle` runs them with `--include-ignored`
//! and `CUBEATTN_REQUIRE_GPU=1`; without that variable a machine with no GPU skips each (SKIP).
#![cfg(feature = "candle-cuda")]

#[allow(dead_code)]
mod common;

use candle_core::{DType as CDType, Device, Tensor, Var};
use common::candle::{expect_err, f64s, our_dtype, rand_t};
use cubeattn::reference::{backward_f64, forward_f64};
use cubeattn::{AttnSpec, TensorMeta};
use rand::{rngs::StdRng, SeedableRng};

type R<T> = candle_core::Result<T>;

/// candle's CUDA device 0, or None (printing why) where there is none; a failure instead under
/// CUBEATTN_REQUIRE_GPU=1.
fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            let e = e.to_string();
            let e = e.lines().next().unwrap_or_default();
            assert!(std::env::var_os("CUBEATTN_REQUIRE_GPU").is_none(), "no CUDA device for candle: {e}");
            println!("SKIP: no CUDA device for candle: {e}");
            None
        }
    }
}

/// Relative L2 error bounds (out, gradients), those of the CUDA backend's own GPU tests
/// (tests/gpu): both against the f64 reference and against the CPU backend's result.
fn tol(d: CDType) -> (f64, f64) {
    match d {
        CDType::F32 => (1e-5, 1e-4),
        CDType::F16 => (3e-3, 5e-3),
        _ => (1e-2, 1e-2),
    }
}

/// A call under test: (q, k, v) on one device -> (out, lse as `[heads_q, total_q]`).
type Op<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor) -> R<(Tensor, Tensor)>;

/// Out, lse and gradients (upstream gradient `wgt`) of `op` on `dev`.
fn run(op: Op<'_>, dev: &Device, q: &Tensor, k: &Tensor, v: &Tensor, wgt: &Tensor) -> [Tensor; 5] {
    let var = |t: &Tensor| Var::from_tensor(&t.to_device(dev).unwrap()).unwrap();
    let (q, k, v) = (var(q), var(k), var(v));
    let (out, lse) = op(&q, &k, &v).unwrap();
    assert!(out.device().same_device(dev) && lse.device().same_device(dev), "out and lse stay on the inputs' device");
    assert_eq!(lse.dtype(), CDType::F32);
    let g = (&out * wgt.to_device(dev).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = |x: &Var| g.get(x).expect("every input gets a gradient").clone();
    let (dq, dk, dv) = (grad(&q), grad(&k), grad(&v));
    for (t, x) in [(&dq, &q), (&dk, &k), (&dv, &v)] {
        assert_eq!((t.dims(), t.dtype()), (x.dims(), x.dtype()), "gradient shape and dtype");
        assert!(t.device().same_device(dev), "gradients stay on the device");
    }
    [out, lse, dq, dk, dv]
}

/// Runs `op` on CUDA and on the CPU with fresh random q `q_shape`, k and v `kv_shape` (v with its
/// own head_dim `dv`), and compares the CUDA results with the CPU ones and with the f64 reference
/// of `spec`.
#[allow(clippy::too_many_arguments)]
fn check(what: &str, gpu: &Device, rng: &mut StdRng, q_shape: &[usize], kv_shape: &[usize], dv: usize, dt: CDType, spec: &AttnSpec, op: Op<'_>) {
    let with_dv = |s: &[usize]| {
        let mut s = s.to_vec();
        *s.last_mut().unwrap() = dv;
        s
    };
    let (v_shape, out_shape) = (with_dv(kv_shape), with_dv(q_shape));
    let (q, k, v) = (rand_t(rng, q_shape, dt), rand_t(rng, kv_shape, dt), rand_t(rng, &v_shape, dt));
    let wgt = rand_t(rng, &out_shape, dt);
    let cuda = run(op, gpu, &q, &k, &v, &wgt);
    let cpu = run(op, &Device::Cpu, &q, &k, &v, &wgt);
    assert_eq!(cuda[0].dims(), out_shape.as_slice(), "{what}: out shape (q's with v's head_dim)");
    let (ro, rl) = forward_f64(spec, &f64s(&q), &f64s(&k), &f64s(&v));
    let (rq, rk, rv) = backward_f64(spec, &f64s(&q), &f64s(&k), &f64s(&v), &f64s(&wgt));
    let (tf, tb) = tol(dt);
    // indexes into run()'s [out, lse, dq, dk, dv]
    for (i, name, want, t) in [(0, "out", &ro, tf), (2, "dq", &rq, tb), (3, "dk", &rk, tb), (4, "dv", &rv, tb)] {
        let (g, c) = (f64s(&cuda[i]), f64s(&cpu[i]));
        let (e_ref, e_cpu) = (common::rel_err(&g, want), common::rel_err_of(&g, &c, want));
        eprintln!("{what}: {name} rel err vs f64 {e_ref:.2e}, vs cpu {e_cpu:.2e}");
        assert!(e_ref <= t, "{what}: {name} relative error vs the f64 reference {e_ref:e} > {t:e}");
        assert!(e_cpu <= t, "{what}: {name} relative error vs the CPU backend {e_cpu:e} > {t:e}");
    }
    // lse: +inf exactly where a row sees no key, else within 1e-3 * (1 + |lse|)
    let lse: Vec<f32> = cuda[1].flatten_all().unwrap().to_vec1().unwrap();
    common::assert_lse(&lse, &rl, 1e-3);
    common::assert_lse(&lse, &f64s(&cpu[1]), 1e-3);
}

/// Spec of a packed call with cumulative lengths (the reference's view of every call here); v
/// has head_dim `dv`.
#[allow(clippy::too_many_arguments)]
fn varlen_spec(tq: usize, tk: usize, hq: usize, hkv: usize, d: usize, dv: usize, dt: CDType, cq: &[i32], ck: &[i32], scale: f32, causal: bool) -> AttnSpec {
    let (mq, mk) = (TensorMeta::new(&[tq, hq, d], our_dtype(dt)), TensorMeta::new(&[tk, hkv, d], our_dtype(dt)));
    let mv = TensorMeta::new(&[tk, hkv, dv], our_dtype(dt));
    let longest = |c: &[i32]| c.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
    AttnSpec::varlen(&mq, &mk, &mv, cq, ck, longest(cq), longest(ck), Some(scale as f64), causal).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_attn_matches_cpu_and_reference() {
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(45);
    // (b, sq, sk, hq, hkv, d, dv, causal): dv is v's head_dim
    let cases = [
        (2, 67, 67, 4, 4, 64, 64, false),
        (1, 129, 129, 8, 2, 128, 128, true), // GQA 4:1
        (2, 67, 129, 4, 2, 64, 64, true),    // bottom-right, seqlen_q < seqlen_k
        (1, 129, 67, 4, 1, 128, 128, true),  // seqlen_q > seqlen_k: the first 62 rows see no key
        (2, 1, 129, 8, 2, 128, 128, true),   // decode step
        (3, 1, 1, 2, 2, 64, 64, true),       // single tokens
        (2, 67, 129, 4, 2, 80, 80, true),    // head_dim 80: the d96 kernels with zero columns
        (1, 70, 70, 4, 2, 48, 48, false),    // head_dim 48: the d64 kernels with zero columns
        (2, 67, 129, 4, 2, 192, 128, true),  // DeepSeek MLA: q, k 192, v 128 (out 128)
        (1, 129, 67, 4, 1, 192, 128, true),  // MLA with rows that see no key
        (1, 70, 70, 4, 2, 64, 96, false),    // v wider than q, k
    ];
    for (ci, (b, sq, sk, hq, hkv, d, dv, causal)) in cases.into_iter().enumerate() {
        let dts: &[CDType] = if ci == 0 { &[CDType::F16, CDType::BF16, CDType::F32] } else { &[CDType::F16, CDType::BF16] };
        for &dt in dts {
            let what = format!("flash_attn b={b} sq={sq} sk={sk} hq={hq} hkv={hkv} d={d} dv={dv} causal={causal} {dt:?}");
            let scale = 0.7 / (d as f32).sqrt();
            let cu = |s: usize| (0..=b).map(|i| (i * s) as i32).collect::<Vec<_>>();
            let spec = varlen_spec(b * sq, b * sk, hq, hkv, d, dv, dt, &cu(sq), &cu(sk), scale, causal);
            let op = |q: &Tensor, k: &Tensor, v: &Tensor| -> R<(Tensor, Tensor)> {
                let (o, l) = cubeattn::candle::flash_attn_with_lse(q, k, v, scale, causal)?;
                assert_eq!(l.dims(), &[b, hq, sq]);
                let plain = cubeattn::candle::flash_attn(q, k, v, scale, causal)?;
                assert_eq!(f64s(&plain), f64s(&o), "flash_attn vs flash_attn_with_lse");
                // [b, hq, sq] -> cubeattn's [hq, b * sq]
                Ok((o, l.transpose(0, 1)?.reshape((hq, b * sq))?))
            };
            check(&what, &gpu, &mut rng, &[b, sq, hq, d], &[b, sk, hkv, d], dv, dt, &spec, &op);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn varlen_matches_cpu_and_reference() {
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(4545);
    let lens = [(1usize, 1usize), (67, 129), (129, 67), (5, 1), (33, 33)];
    let (cq, ck) = common::cu_seqlens(&lens);
    let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
    // (hq, hkv, d, dv): dv is v's head_dim (192 / 128: DeepSeek MLA)
    for (hq, hkv, d, dv) in [(4, 2, 64, 64), (2, 2, 128, 128), (4, 2, 192, 128)] {
        for dt in [CDType::F16, CDType::BF16] {
            for causal in [false, true] {
                let what = format!("varlen hq={hq} hkv={hkv} d={d} dv={dv} {dt:?} causal={causal}");
                let scale = 1.3 / (d as f32).sqrt();
                let spec = varlen_spec(tq, tk, hq, hkv, d, dv, dt, &cq, &ck, scale, causal);
                // the boundaries as candle-flash-attn takes them (u32), on the GPU
                let sq = Tensor::new(cq.iter().map(|&x| x as u32).collect::<Vec<_>>(), &gpu).unwrap();
                let sk = Tensor::new(ck.iter().map(|&x| x as u32).collect::<Vec<_>>(), &gpu).unwrap();
                let op = |q: &Tensor, k: &Tensor, v: &Tensor| {
                    cubeattn::candle::flash_attn_varlen_with_lse(q, k, v, &sq, &sk, 129, 129, scale, causal)
                };
                check(&what, &gpu, &mut rng, &[tq, hq, d], &[tk, hkv, d], dv, dt, &spec, &op);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_matches_cpu_and_reference() {
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(454545);
    // zigzag llama3, W = 2, rank 0, chunk 67; a third group whose keys start at 30; 5 query rows
    // outside every group (zeros)
    let c = 67;
    let q_ranges = [[0, c], [c, 2 * c], [2 * c + 5, 2 * c + 14]];
    let kv_ranges = [[0, c], [0, 4 * c], [30, 159]];
    let (tq, tk) = (2 * c + 14, 4 * c);
    let i32s = |r: &[[usize; 2]]| r.iter().map(|&[a, b]| [a as i32, b as i32]).collect::<Vec<_>>();
    for (hq, hkv, d) in [(4, 2, 64), (2, 1, 128)] {
        for dt in [CDType::F16, CDType::BF16] {
            for causal in [true, false] {
                let what = format!("grouped hq={hq} hkv={hkv} d={d} {dt:?} causal={causal}");
                let (mq, mk) = (TensorMeta::new(&[tq, hq, d], our_dtype(dt)), TensorMeta::new(&[tk, hkv, d], our_dtype(dt)));
                let spec = AttnSpec::grouped(&mq, &mk, &mk, &i32s(&q_ranges), &i32s(&kv_ranges), Some(0.1), causal).unwrap();
                let op = |q: &Tensor, k: &Tensor, v: &Tensor| {
                    cubeattn::candle::grouped_flash_attn_with_lse(q, k, v, &q_ranges, &kv_ranges, 0.1, causal)
                };
                check(&what, &gpu, &mut rng, &[tq, hq, d], &[tk, hkv, d], d, dt, &spec, &op);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn strided_and_misaligned_views_equal_contiguous_copies() {
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(7);
    let (b, s, h, d) = (2, 67, 4, 64);
    let dt = CDType::BF16;
    let on = |t: Tensor| t.to_device(&gpu).unwrap();
    // [b, h, s, d] buffers viewed as [b, s, h, d] (the "transpose after projection" case)
    let (q, k, v) = (on(rand_t(&mut rng, &[b, h, s, d], dt)), on(rand_t(&mut rng, &[b, h, s, d], dt)), on(rand_t(&mut rng, &[b, h, s, d], dt)));
    let (qt, kt, vt) = (q.transpose(1, 2).unwrap(), k.transpose(1, 2).unwrap(), v.transpose(1, 2).unwrap());
    assert!(!qt.is_contiguous());
    let a = cubeattn::candle::flash_attn(&qt, &kt, &vt, 0.125, true).unwrap();
    // a fresh contiguous buffer holding the same values
    let c = |t: &Tensor| t.copy().unwrap().contiguous().unwrap();
    let want = cubeattn::candle::flash_attn(&c(&qt), &c(&kt), &c(&vt), 0.125, true).unwrap();
    assert_eq!(f64s(&a), f64s(&want), "transposed views");
    // contiguous views at an element offset that is not 16-byte aligned (1 element in) and one that is
    let big = on(rand_t(&mut rng, &[b * s * h * d + 8], dt));
    for off in [1, 8] {
        let qn = big.narrow(0, off, b * s * h * d).unwrap().reshape((b, s, h, d)).unwrap();
        assert!(qn.is_contiguous());
        let got = cubeattn::candle::flash_attn(&qn, &kt, &vt, 0.125, true).unwrap();
        let want = cubeattn::candle::flash_attn(&c(&qn), &c(&kt), &c(&vt), 0.125, true).unwrap();
        assert_eq!(f64s(&got), f64s(&want), "view at element offset {off}");
    }
    // gradients reach the [b, h, s, d] variable through the transpose; a broadcast (stride 0)
    // upstream gradient from sum_all is read correctly
    let qv = Var::from_tensor(&q).unwrap();
    let out = cubeattn::candle::flash_attn(&qv.transpose(1, 2).unwrap(), &kt, &vt, 0.125, true).unwrap();
    let g = out.sum_all().unwrap().backward().unwrap();
    let dq = g.get(&qv).unwrap();
    assert_eq!(dq.dims(), &[b, h, s, d]);
    let qc = Var::from_tensor(&c(&qt)).unwrap();
    let out = cubeattn::candle::flash_attn(&qc, &c(&kt), &c(&vt), 0.125, true).unwrap();
    let want = out.sum_all().unwrap().backward().unwrap().get(&qc).unwrap().transpose(1, 2).unwrap();
    let e = common::rel_err(&f64s(dq), &f64s(&want));
    assert!(e <= tol(dt).1, "dq through a transposed view: relative error {e:e}");
    assert!(f64s(dq).iter().any(|x| *x != 0.0));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_arguments_give_errors_naming_them() {
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(5);
    let mut t = |s: &[usize], dt: CDType| rand_t(&mut rng, s, dt).to_device(&gpu).unwrap();
    let (q, k, v) = (t(&[2, 8, 4, 64], CDType::F16), t(&[2, 8, 2, 64], CDType::F16), t(&[2, 8, 2, 64], CDType::F16));
    use cubeattn::candle::flash_attn;
    assert!(flash_attn(&q, &k, &v, 0.125, true).is_ok());
    expect_err(flash_attn(&q, &k.to_device(&Device::Cpu).unwrap(), &v, 0.125, true), "k");
    expect_err(flash_attn(&q, &k, &v.to_device(&Device::Cpu).unwrap(), 0.125, true), "v");
    expect_err(flash_attn(&q.to_dtype(CDType::F64).unwrap(), &k, &v, 0.125, true), "q");
    expect_err(flash_attn(&q, &k.to_dtype(CDType::BF16).unwrap(), &v, 0.125, true), "k");
    expect_err(flash_attn(&q, &t(&[2, 8, 3, 64], CDType::F16), &t(&[2, 8, 3, 64], CDType::F16), 0.125, true), "k");
    expect_err(flash_attn(&q, &k, &v, f32::NAN, true), "softmax_scale");
    // v may have its own head_dim, but k's [batch, seqlen, heads]
    expect_err(flash_attn(&q, &k, &t(&[2, 9, 2, 32], CDType::F16), 0.125, true), "v");
    expect_err(flash_attn(&q, &k, &t(&[2, 8, 1, 32], CDType::F16), 0.125, true), "v");
    // the GPU is still usable after the errors
    let out = flash_attn(&q, &k, &v, 0.125, true).unwrap();
    assert!(f64s(&out).iter().all(|x| x.is_finite()));
}
