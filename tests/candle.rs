//! cubeattn's candle ops (feature `candle`) against (a) cubeattn's own API on the same data (bitwise)
//! and (b) a reference written with candle ops in f64 (matmul + masked softmax), forward, lse and
//! gradients through candle's `backward()`; plus argument errors.
#![cfg(feature = "candle")]

#[allow(dead_code)]
mod common;

use candle_core::{DType as CDType, Device, Tensor, Var, D};
use common::candle::{expect_err, f64s, our_dtype, rand_t};
use cubeattn::backend::BackwardInputs;
use cubeattn::backend::cpu::CpuBackend;
use cubeattn::{AttnSpec, Backend, HostData, TensorMeta};
use rand::{rngs::StdRng, SeedableRng};

type R<T> = candle_core::Result<T>;

const DTYPES: [CDType; 3] = [CDType::F32, CDType::F16, CDType::BF16];

/// ||a - b|| / ||b||, with the denominator kept away from 0: below an RMS of 1e-2 (inputs are
/// O(1)) the error is measured against that floor, so an exactly-zero reference (dq of a row with
/// one visible key) is compared in absolute terms. A non-finite `a` gives infinity.
fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths");
    if a.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-4 * b.len() as f64)).sqrt()
}

fn host(t: &Tensor) -> HostData {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        CDType::F32 => HostData::F32(t.to_vec1().unwrap()),
        CDType::F16 => HostData::F16(t.to_vec1().unwrap()),
        CDType::BF16 => HostData::BF16(t.to_vec1().unwrap()),
        d => panic!("test helper: unexpected dtype {d:?}"),
    }
}

/// Tolerances (relative norm error vs the f64 reference) for out and for gradients: about 4x
/// the largest error seen over these tests (f32 2.3e-7 / 9.3e-7, f16 2.2e-4 / 2.5e-4, bf16
/// 1.7e-3 / 1.9e-3; the 16-bit ones are dominated by rounding the result to the dtype).
fn tol(d: CDType) -> (f64, f64) {
    match d {
        CDType::F32 => (1e-6, 4e-6),
        CDType::F16 => (1e-3, 1.2e-3),
        _ => (7e-3, 8e-3),
    }
}

/// Reference attention in candle ops: q `[b, sq, hq, d]`, k/v `[b, sk, hkv, d]` (f64) ->
/// (out `[b, sq, hq, d]`, lse `[b, hq, sq]`). Bottom-right causal; rows that see no key give 0
/// (and lse +inf). Materialises the scores; differentiable in q, k, v.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> R<(Tensor, Tensor)> {
    let (b, sq, hq, d) = q.dims4()?;
    let (_, sk, hkv, _) = k.dims4()?;
    let g = hq / hkv;
    let expand = |t: &Tensor| -> R<Tensor> {
        // [b, sk, hkv, d] -> [b, hkv, sk, d] -> [b, hkv * g, sk, d] (query head h reads kv head h / g)
        t.transpose(1, 2)?.unsqueeze(2)?.broadcast_as((b, hkv, g, sk, d))?.reshape((b, hq, sk, d))
    };
    let qh = q.transpose(1, 2)?.contiguous()?;
    let (kh, vh) = (expand(k)?, expand(v)?);
    let mut s = (qh.matmul(&kh.t()?.contiguous()?)? * scale)?; // [b, hq, sq, sk]
    let mut row_ok = vec![1.0f64; sq];
    if causal {
        let mut mask = vec![0.0f64; sq * sk];
        for i in 0..sq {
            let lim = sk as i64 - sq as i64 + i as i64; // last visible key
            if lim < 0 {
                row_ok[i] = 0.0;
            }
            for j in 0..sk {
                if j as i64 > lim {
                    mask[i * sk + j] = -1e30;
                }
            }
        }
        s = s.broadcast_add(&Tensor::from_vec(mask, (sq, sk), q.device())?)?;
    }
    let m = s.max_keepdim(D::Minus1)?.detach();
    let e = s.broadcast_sub(&m)?.exp()?;
    let l = e.sum_keepdim(D::Minus1)?;
    let p = e.broadcast_div(&l)?;
    let rows = Tensor::from_vec(row_ok.clone(), (sq, 1), q.device())?;
    let o = p.matmul(&vh.contiguous()?)?.broadcast_mul(&rows)?; // [b, hq, sq, d]
    let lse = (l.log()? + m)?.squeeze(D::Minus1)?; // [b, hq, sq]
    let inf = Tensor::from_vec(row_ok.iter().map(|&r| if r > 0.0 { 0.0 } else { f64::INFINITY }).collect::<Vec<_>>(), sq, q.device())?;
    let lse = lse.broadcast_add(&inf)?;
    Ok((o.transpose(1, 2)?.contiguous()?, lse.detach()))
}

fn assert_lse(what: &str, got: &Tensor, want: &Tensor) {
    let (g, w) = (f64s(got), f64s(want));
    assert_eq!(g.len(), w.len(), "{what}: lse length");
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        if b.is_infinite() {
            assert_eq!(a, b, "{what}: lse[{i}]");
        } else {
            assert!((a - b).abs() <= 2e-5 * (1.0 + b.abs()), "{what}: lse[{i}] = {a}, want {b}");
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Case {
    b: usize,
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    causal: bool,
}

const fn case(b: usize, sq: usize, sk: usize, hq: usize, hkv: usize, d: usize, causal: bool) -> Case {
    Case { b, sq, sk, hq, hkv, d, causal }
}

const CASES: [Case; 8] = [
    case(2, 67, 67, 4, 4, 64, false),
    case(1, 129, 129, 8, 2, 128, true),   // GQA 4:1, causal
    case(2, 67, 129, 4, 2, 64, true),     // bottom-right, seqlen_q < seqlen_k
    case(1, 129, 67, 4, 1, 33, true),     // seqlen_q > seqlen_k: the first 62 rows see no key; odd head_dim
    case(3, 1, 1, 2, 2, 64, true),        // single tokens
    case(2, 1, 129, 8, 2, 128, true),     // decode step
    case(1, 129, 129, 2, 1, 128, false),  // MQA
    case(1, 67, 67, 3, 3, 97, true),      // odd everything
];

fn scale_of(c: &Case) -> f32 {
    // not the default, so that a backend ignoring softmax_scale fails
    0.7 / (c.d as f32).sqrt()
}

/// The same call through cubeattn's own API: (out, lse `[hq, b*sq]`).
fn own_forward(c: &Case, dt: CDType, q: &Tensor, k: &Tensor, v: &Tensor) -> (AttnSpec, HostData, Vec<f32>) {
    let d = our_dtype(dt);
    let (mq, mk) = (TensorMeta::new(&[c.b * c.sq, c.hq, c.d], d), TensorMeta::new(&[c.b * c.sk, c.hkv, c.d], d));
    let cq: Vec<i32> = (0..=c.b).map(|i| (i * c.sq) as i32).collect();
    let ck: Vec<i32> = (0..=c.b).map(|i| (i * c.sk) as i32).collect();
    let spec = AttnSpec::varlen(&mq, &mk, &mk, &cq, &ck, c.sq, c.sk, Some(scale_of(c) as f64), c.causal).unwrap();
    let (hq, hk, hv) = (host(q), host(k), host(v));
    let r = CpuBackend.forward(&spec, hq.view(), hk.view(), hv.view()).unwrap();
    (spec, r.out, r.lse)
}

#[test]
fn flash_attn_forward_matches_own_api_and_reference() {
    let mut rng = StdRng::seed_from_u64(14);
    for c in CASES {
        for dt in DTYPES {
            let what = format!("{c:?} {dt:?}");
            let q = rand_t(&mut rng, &[c.b, c.sq, c.hq, c.d], dt);
            let k = rand_t(&mut rng, &[c.b, c.sk, c.hkv, c.d], dt);
            let v = rand_t(&mut rng, &[c.b, c.sk, c.hkv, c.d], dt);
            let (out, lse) = cubeattn::candle::flash_attn_with_lse(&q, &k, &v, scale_of(&c), c.causal).unwrap();
            assert_eq!(out.dims(), q.dims(), "{what}: out shape");
            assert_eq!(out.dtype(), dt, "{what}: out dtype");
            assert_eq!(lse.dims(), &[c.b, c.hq, c.sq], "{what}: lse shape");
            let plain = cubeattn::candle::flash_attn(&q, &k, &v, scale_of(&c), c.causal).unwrap();
            assert_eq!(host(&plain), host(&out), "{what}: flash_attn vs flash_attn_with_lse");

            // (a) cubeattn's own API: bitwise equal, lse reordered from [hq, b*sq] to [b, hq, sq]
            let (_, own_out, own_lse) = own_forward(&c, dt, &q, &k, &v);
            assert_eq!(host(&out), own_out, "{what}: candle op vs cubeattn API");
            let own_lse = Tensor::from_vec(own_lse, (c.hq, c.b, c.sq), &Device::Cpu).unwrap().transpose(0, 1).unwrap();
            assert_eq!(lse.flatten_all().unwrap().to_vec1::<f32>().unwrap(), own_lse.flatten_all().unwrap().to_vec1::<f32>().unwrap(), "{what}: lse vs cubeattn API");

            // (b) the candle-written f64 reference on the same (rounded) inputs
            let w = |t: &Tensor| t.to_dtype(CDType::F64).unwrap();
            let (ro, rl) = reference(&w(&q), &w(&k), &w(&v), scale_of(&c) as f64, c.causal).unwrap();
            let e = rel_err(&f64s(&out), &f64s(&ro));
            eprintln!("{what}: out rel err {e:.2e}");
            assert!(e <= tol(dt).0, "{what}: out relative error {e:e} > {:e}", tol(dt).0);
            assert_lse(&what, &lse, &rl);
        }
    }
}

#[test]
fn flash_attn_gradients_match_reference_and_own_backward() {
    let mut rng = StdRng::seed_from_u64(1414);
    for c in CASES {
        for dt in DTYPES {
            let what = format!("{c:?} {dt:?}");
            let q = Var::from_tensor(&rand_t(&mut rng, &[c.b, c.sq, c.hq, c.d], dt)).unwrap();
            let k = Var::from_tensor(&rand_t(&mut rng, &[c.b, c.sk, c.hkv, c.d], dt)).unwrap();
            let v = Var::from_tensor(&rand_t(&mut rng, &[c.b, c.sk, c.hkv, c.d], dt)).unwrap();
            let wgt = rand_t(&mut rng, &[c.b, c.sq, c.hq, c.d], dt); // dL/dout
            let out = cubeattn::candle::flash_attn(&q, &k, &v, scale_of(&c), c.causal).unwrap();
            let grads = (&out * &wgt).unwrap().sum_all().unwrap().backward().unwrap();
            let (gq, gk, gv) = (grads.get(&q).unwrap(), grads.get(&k).unwrap(), grads.get(&v).unwrap());
            assert_eq!((gq.dims(), gk.dims(), gv.dims()), (q.dims(), k.dims(), v.dims()), "{what}: grad shapes");
            assert_eq!((gq.dtype(), gk.dtype(), gv.dtype()), (dt, dt, dt), "{what}: grad dtypes");

            // (a) cubeattn's backward called directly with dout = wgt: bitwise equal
            let (spec, own_out, own_lse) = own_forward(&c, dt, &q, &k, &v);
            let (hq_, hk_, hv_, hw) = (host(&q), host(&k), host(&v), host(&wgt));
            let inputs = BackwardInputs { out: own_out.view(), lse: &own_lse, dout: hw.view(), deterministic: true };
            let own = CpuBackend.backward(&spec, hq_.view(), hk_.view(), hv_.view(), inputs).unwrap();
            assert_eq!(host(gq), own.dq, "{what}: dq vs cubeattn backward");
            assert_eq!(host(gk), own.dk, "{what}: dk vs cubeattn backward");
            assert_eq!(host(gv), own.dv, "{what}: dv vs cubeattn backward");

            // (b) the reference's gradients (candle autograd through matmul + softmax in f64)
            let w = |t: &Tensor| Var::from_tensor(&t.to_dtype(CDType::F64).unwrap()).unwrap();
            let (rq, rk, rv) = (w(&q), w(&k), w(&v));
            let (ro, _) = reference(&rq, &rk, &rv, scale_of(&c) as f64, c.causal).unwrap();
            let rg = (ro * wgt.to_dtype(CDType::F64).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            for (name, got, want) in [("dq", gq, &rq), ("dk", gk, &rk), ("dv", gv, &rv)] {
                let e = rel_err(&f64s(got), &f64s(rg.get(want).unwrap()));
                eprintln!("{what}: {name} rel err {e:.2e}");
                assert!(e <= tol(dt).1, "{what}: {name} relative error {e:e} > {:e}", tol(dt).1);
            }
        }
    }
}

#[test]
fn strided_inputs_equal_contiguous_ones() {
    let mut rng = StdRng::seed_from_u64(7);
    let (b, s, h, hkv, d) = (2, 67, 4, 2, 64);
    // [b, h, s, d] buffers viewed as [b, s, h, d] (the common "transpose after projection" case)
    let q = Var::from_tensor(&rand_t(&mut rng, &[b, h, s, d], CDType::F32)).unwrap();
    let k = rand_t(&mut rng, &[b, hkv, s, d], CDType::F32);
    let v = rand_t(&mut rng, &[b, hkv, s, d], CDType::F32);
    let (qt, kt, vt) = (q.transpose(1, 2).unwrap(), k.transpose(1, 2).unwrap(), v.transpose(1, 2).unwrap());
    assert!(!qt.is_contiguous());
    let a = cubeattn::candle::flash_attn(&qt, &kt, &vt, 0.125, true).unwrap();
    let (qc, kc, vc) = (qt.contiguous().unwrap(), kt.contiguous().unwrap(), vt.contiguous().unwrap());
    let bb = cubeattn::candle::flash_attn(&qc, &kc, &vc, 0.125, true).unwrap();
    assert_eq!(host(&a), host(&bb));
    // the gradient reaches the [b, h, s, d] variable through the transpose, and a broadcast
    // (stride 0) upstream gradient from sum_all is read correctly
    let g1 = a.sum_all().unwrap().backward().unwrap();
    let g2 = bb.sum_all().unwrap().backward().unwrap();
    let dq1 = g1.get(&q).unwrap();
    assert_eq!(dq1.dims(), &[b, h, s, d]);
    assert_eq!(host(dq1), host(&g2.get(&q).unwrap().contiguous().unwrap()));
    assert!(f64s(dq1).iter().any(|x| *x != 0.0));
}

/// Reference for a packed layout: out rows of each (q rows, key window) pair, zeros elsewhere.
fn reference_packed(q: &Tensor, k: &Tensor, v: &Tensor, segs: &[(usize, usize, usize, usize)], scale: f64, causal: bool) -> (Tensor, Tensor) {
    let (tq, hq, d) = q.dims3().unwrap();
    let mut pieces = Vec::new();
    let mut lses = Vec::new();
    let mut segs = segs.to_vec();
    segs.sort();
    let mut at = 0;
    for (qs, ql, ks, kl) in segs {
        if qs > at {
            pieces.push(Tensor::zeros((qs - at, hq, d), CDType::F64, &Device::Cpu).unwrap());
            lses.push(Tensor::full(f64::INFINITY, (hq, qs - at), &Device::Cpu).unwrap());
        }
        let qq = q.narrow(0, qs, ql).unwrap().unsqueeze(0).unwrap();
        let kk = k.narrow(0, ks, kl).unwrap().unsqueeze(0).unwrap();
        let vv = v.narrow(0, ks, kl).unwrap().unsqueeze(0).unwrap();
        let (o, l) = reference(&qq, &kk, &vv, scale, causal).unwrap();
        pieces.push(o.squeeze(0).unwrap());
        lses.push(l.squeeze(0).unwrap());
        at = qs + ql;
    }
    if tq > at {
        pieces.push(Tensor::zeros((tq - at, hq, d), CDType::F64, &Device::Cpu).unwrap());
        lses.push(Tensor::full(f64::INFINITY, (hq, tq - at), &Device::Cpu).unwrap());
    }
    (Tensor::cat(&pieces, 0).unwrap(), Tensor::cat(&lses, 1).unwrap())
}

/// A call under test: (q, k, v) -> (out, lse).
type PackedOp<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor) -> R<(Tensor, Tensor)>;

/// Runs `op` (forward + backward with a random upstream gradient) and the packed reference, and
/// compares out, lse and the gradients.
#[allow(clippy::too_many_arguments)]
fn check_packed(
    what: &str,
    rng: &mut StdRng,
    dims: (usize, usize, usize, usize, usize),
    dt: CDType,
    segs: &[(usize, usize, usize, usize)],
    scale: f32,
    causal: bool,
    op: PackedOp<'_>,
) {
    let (tq, tk, hq, hkv, d) = dims;
    let q = Var::from_tensor(&rand_t(rng, &[tq, hq, d], dt)).unwrap();
    let k = Var::from_tensor(&rand_t(rng, &[tk, hkv, d], dt)).unwrap();
    let v = Var::from_tensor(&rand_t(rng, &[tk, hkv, d], dt)).unwrap();
    let wgt = rand_t(rng, &[tq, hq, d], dt);
    let (out, lse) = op(&q, &k, &v).unwrap();
    assert_eq!(lse.dims(), &[hq, tq], "{what}: lse shape");
    let g = (&out * &wgt).unwrap().sum_all().unwrap().backward().unwrap();

    let w = |t: &Tensor| Var::from_tensor(&t.to_dtype(CDType::F64).unwrap()).unwrap();
    let (rq, rk, rv) = (w(&q), w(&k), w(&v));
    let (ro, rl) = reference_packed(&rq, &rk, &rv, segs, scale as f64, causal);
    let e = rel_err(&f64s(&out), &f64s(&ro));
    eprintln!("{what}: out rel err {e:.2e}");
    assert!(e <= tol(dt).0, "{what}: out relative error {e:e}");
    assert_lse(what, &lse, &rl);
    let rg = (ro * wgt.to_dtype(CDType::F64).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
    for (name, got, want) in [("dq", &q, &rq), ("dk", &k, &rk), ("dv", &v, &rv)] {
        let got = g.get(got).unwrap();
        // keys outside every window get no gradient from either side: compare whole tensors
        let want = rg.get(want).map(f64s).unwrap_or_else(|| vec![0.0; got.elem_count()]);
        let e = rel_err(&f64s(got), &want);
        eprintln!("{what}: {name} rel err {e:.2e}");
        assert!(e <= tol(dt).1, "{what}: {name} relative error {e:e}");
    }
}

#[test]
fn varlen_matches_reference_with_gradients() {
    let mut rng = StdRng::seed_from_u64(21);
    // per sequence (q_len, k_len): single token, bottom-right with q < k and q > k, odd lengths
    let lens = [(1usize, 1usize), (67, 129), (129, 67), (5, 1), (33, 33)];
    let mut cq = vec![0u32];
    let mut ck = vec![0u32];
    let mut segs = Vec::new();
    for &(a, b) in &lens {
        segs.push((*cq.last().unwrap() as usize, a, *ck.last().unwrap() as usize, b));
        cq.push(cq.last().unwrap() + a as u32);
        ck.push(ck.last().unwrap() + b as u32);
    }
    let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
    let (mq, mk) = (129, 129);
    for (hq, hkv, d) in [(4, 2, 64), (2, 2, 128), (3, 1, 41)] {
        for dt in DTYPES {
            for causal in [false, true] {
                let what = format!("varlen hq={hq} hkv={hkv} d={d} {dt:?} causal={causal}");
                // i64 boundaries for one of the runs, u32 (candle-flash-attn's type) otherwise
                let (sq, sk) = if d == 128 {
                    let f = |v: &[u32]| Tensor::new(v.iter().map(|&x| x as i64).collect::<Vec<_>>(), &Device::Cpu).unwrap();
                    (f(&cq), f(&ck))
                } else {
                    (Tensor::new(cq.as_slice(), &Device::Cpu).unwrap(), Tensor::new(ck.as_slice(), &Device::Cpu).unwrap())
                };
                let scale = 1.3 / (d as f32).sqrt();
                let op = |q: &Tensor, k: &Tensor, v: &Tensor| {
                    let (o, l) = cubeattn::candle::flash_attn_varlen_with_lse(q, k, v, &sq, &sk, mq, mk, scale, causal)?;
                    let plain = cubeattn::candle::flash_attn_varlen(q, k, v, &sq, &sk, mq, mk, scale, causal)?;
                    assert_eq!(host(&plain), host(&o), "{what}: plain vs with_lse");
                    Ok((o, l))
                };
                check_packed(&what, &mut rng, (tq, tk, hq, hkv, d), dt, &segs, scale, causal, &op);
            }
        }
    }
}

#[test]
fn grouped_matches_reference_with_gradients() {
    let mut rng = StdRng::seed_from_u64(33);
    // zigzag llama3, W = 2, rank 0, chunk C = 67: group 0 sees [0, C), group 1 sees [0, 4C);
    // plus a third group with a key window that does not start at 0, and 5 uncovered query rows.
    let c = 67;
    let q_ranges = [[0, c], [c, 2 * c], [2 * c + 5, 2 * c + 5 + 9]];
    let kv_ranges = [[0, c], [0, 4 * c], [30, 30 + 129]];
    let tq = 2 * c + 5 + 9;
    let tk = 4 * c;
    let segs: Vec<_> = q_ranges.iter().zip(&kv_ranges).map(|(a, b)| (a[0], a[1] - a[0], b[0], b[1] - b[0])).collect();
    for (hq, hkv, d) in [(4, 2, 64), (2, 1, 128)] {
        for dt in DTYPES {
            for causal in [true, false] {
                let what = format!("grouped hq={hq} hkv={hkv} d={d} {dt:?} causal={causal}");
                let op = |q: &Tensor, k: &Tensor, v: &Tensor| {
                    let (o, l) = cubeattn::candle::grouped_flash_attn_with_lse(q, k, v, &q_ranges, &kv_ranges, 0.1, causal)?;
                    let plain = cubeattn::candle::grouped_flash_attn(q, k, v, &q_ranges, &kv_ranges, 0.1, causal)?;
                    assert_eq!(host(&plain), host(&o), "{what}: plain vs with_lse");
                    Ok((o, l))
                };
                check_packed(&what, &mut rng, (tq, tk, hq, hkv, d), dt, &segs, 0.1, causal, &op);
            }
        }
    }
}

#[test]
fn bad_arguments_give_errors_naming_them() {
    let dev = Device::Cpu;
    let mut rng = StdRng::seed_from_u64(5);
    let t = |rng: &mut StdRng, s: &[usize]| rand_t(rng, s, CDType::F32);
    let q = t(&mut rng, &[2, 8, 4, 64]);
    let k = t(&mut rng, &[2, 8, 2, 64]);
    let v = t(&mut rng, &[2, 8, 2, 64]);
    use cubeattn::candle::{flash_attn, flash_attn_varlen, grouped_flash_attn};
    assert!(flash_attn(&q, &k, &v, 0.125, true).is_ok());
    expect_err(flash_attn(&q.flatten_to(1).unwrap(), &k, &v, 0.125, true), "q"); // rank 3
    expect_err(flash_attn(&q, &t(&mut rng, &[2, 8, 2, 32]), &t(&mut rng, &[2, 8, 2, 32]), 0.125, true), "k"); // head_dim
    expect_err(flash_attn(&q, &t(&mut rng, &[3, 8, 2, 64]), &t(&mut rng, &[3, 8, 2, 64]), 0.125, true), "k"); // batch
    expect_err(flash_attn(&q, &t(&mut rng, &[2, 8, 3, 64]), &t(&mut rng, &[2, 8, 3, 64]), 0.125, true), "k"); // GQA ratio
    expect_err(flash_attn(&q, &k, &t(&mut rng, &[2, 9, 2, 64]), 0.125, true), "v");
    expect_err(flash_attn(&t(&mut rng, &[2, 8, 4, 300]), &t(&mut rng, &[2, 8, 2, 300]), &t(&mut rng, &[2, 8, 2, 300]), 0.1, true), "q");
    expect_err(flash_attn(&q.to_dtype(CDType::F64).unwrap(), &k, &v, 0.125, true), "q");
    expect_err(flash_attn(&q.to_dtype(CDType::U32).unwrap(), &k, &v, 0.125, true), "q");
    expect_err(flash_attn(&q, &k.to_dtype(CDType::F16).unwrap(), &v, 0.125, true), "k");
    expect_err(flash_attn(&q, &k, &v.to_dtype(CDType::BF16).unwrap(), 0.125, true), "v");
    expect_err(flash_attn(&q, &k, &v, f32::NAN, true), "softmax_scale");
    expect_err(flash_attn(&q, &k, &v, f32::INFINITY, false), "softmax_scale");

    // varlen
    let q3 = t(&mut rng, &[10, 4, 64]);
    let k3 = t(&mut rng, &[12, 2, 64]);
    let v3 = t(&mut rng, &[12, 2, 64]);
    let s = |v: &[u32]| Tensor::new(v, &dev).unwrap();
    let (sq, sk) = (s(&[0, 4, 10]), s(&[0, 6, 12]));
    assert!(flash_attn_varlen(&q3, &k3, &v3, &sq, &sk, 6, 6, 0.125, true).is_ok());
    expect_err(flash_attn_varlen(&q, &k3, &v3, &sq, &sk, 6, 6, 0.125, true), "q");
    expect_err(flash_attn_varlen(&q3, &k3, &v3, &s(&[1, 4, 10]), &sk, 6, 6, 0.125, true), "seqlens_q");
    expect_err(flash_attn_varlen(&q3, &k3, &v3, &s(&[0, 4, 11]), &sk, 7, 6, 0.125, true), "seqlens_q");
    expect_err(flash_attn_varlen(&q3, &k3, &v3, &s(&[0, 6, 4, 10]), &s(&[0, 2, 4, 12]), 6, 8, 0.125, true), "seqlens_q");
    expect_err(flash_attn_varlen(&q3, &k3, &v3, &sq, &s(&[0, 12]), 6, 12, 0.125, true), "seqlens_k");
    expect_err(flash_attn_varlen(&q3, &k3, &v3, &sq, &Tensor::new(&[0f32, 6., 12.], &dev).unwrap(), 6, 6, 0.125, true), "seqlens_k");
    expect_err(flash_attn_varlen(&q3, &k3, &v3, &sq.unsqueeze(0).unwrap(), &sk, 6, 6, 0.125, true), "seqlens_q");
    expect_err(flash_attn_varlen(&q3, &k3, &v3, &sq, &sk, 5, 6, 0.125, true), "max_seqlen_q");
    expect_err(flash_attn_varlen(&q3, &k3, &v3, &sq, &sk, 6, 2, 0.125, true), "max_seqlen_k");
    expect_err(
        flash_attn_varlen(&q3, &k3, &v3, &Tensor::new(&[0i64, 4, 1 << 40], &dev).unwrap(), &sk, 6, 6, 0.125, true),
        "seqlens_q",
    );

    // grouped
    assert!(grouped_flash_attn(&q3, &k3, &v3, &[[0, 5], [5, 10]], &[[0, 6], [0, 12]], 0.125, true).is_ok());
    expect_err(grouped_flash_attn(&q3, &k3, &v3, &[[0, 6], [5, 10]], &[[0, 6], [0, 12]], 0.125, true), "q_ranges");
    expect_err(grouped_flash_attn(&q3, &k3, &v3, &[[0, 5], [5, 11]], &[[0, 6], [0, 12]], 0.125, true), "q_ranges");
    expect_err(grouped_flash_attn(&q3, &k3, &v3, &[[0, 5], [5, 10]], &[[0, 6], [0, 13]], 0.125, true), "kv_ranges");
    expect_err(grouped_flash_attn(&q3, &k3, &v3, &[[0, 5], [5, 10]], &[[0, 6]], 0.125, true), "kv_ranges");
    expect_err(grouped_flash_attn(&q3, &k3, &v3, &[], &[], 0.125, true), "q_ranges");
    expect_err(grouped_flash_attn(&q3, &k3, &v3, &[[0, usize::MAX]], &[[0, 6]], 0.125, true), "q_ranges");
}

#[test]
fn errors_are_returned_not_panics_in_backward_paths() {
    // A bf16 forward with an f32 upstream gradient: candle converts, cubeattn's backward still runs.
    let mut rng = StdRng::seed_from_u64(9);
    let q = Var::from_tensor(&rand_t(&mut rng, &[1, 5, 2, 64], CDType::BF16)).unwrap();
    let k = rand_t(&mut rng, &[1, 7, 2, 64], CDType::BF16);
    let out = cubeattn::candle::flash_attn(&q, &k, &k, 0.125, true).unwrap();
    let g = out.to_dtype(CDType::F32).unwrap().sqr().unwrap().sum_all().unwrap().backward().unwrap();
    let dq = g.get(&q).unwrap();
    assert_eq!(dq.dtype(), CDType::BF16);
    assert!(f64s(dq).iter().all(|x| x.is_finite()) && f64s(dq).iter().any(|x| *x != 0.0));
}

/// One call whose v has a head_dim of its own: fresh random q `q_shape`, k `k_shape`, v
/// `v_shape` (Vars) and upstream gradient `wgt` (out's shape: q's with v's head_dim), `op` ->
/// (out, lse `[heads_q, total_q]`), then `loss.backward()`. Checks out's and the gradients' shapes
/// and dtypes, out / lse / dq / dk / dv against `cubeattn::reference` (f64) of `spec`, and against
/// cubeattn's own CPU forward and backward on the same data (bitwise).
#[allow(clippy::too_many_arguments)]
fn check_value_dim(what: &str, rng: &mut StdRng, q_shape: &[usize], k_shape: &[usize], v_shape: &[usize], dt: CDType, spec: &AttnSpec, op: PackedOp<'_>) {
    use cubeattn::reference::{backward_f64, forward_f64};
    let dv = *v_shape.last().unwrap();
    let mut out_shape = q_shape.to_vec();
    *out_shape.last_mut().unwrap() = dv;
    assert_eq!((spec.dims.head_dim, spec.dims.head_dim_v), (*q_shape.last().unwrap(), dv), "{what}: the test's spec");
    let q = Var::from_tensor(&rand_t(rng, q_shape, dt)).unwrap();
    let k = Var::from_tensor(&rand_t(rng, k_shape, dt)).unwrap();
    let v = Var::from_tensor(&rand_t(rng, v_shape, dt)).unwrap();
    let wgt = rand_t(rng, &out_shape, dt); // dL/dout
    let (out, lse) = op(&q, &k, &v).unwrap();
    assert_eq!(out.dims(), out_shape.as_slice(), "{what}: out shape (q's with v's head_dim)");
    assert_eq!(out.dtype(), dt, "{what}: out dtype");
    assert_eq!(lse.dims(), &[spec.dims.heads_q, spec.dims.total_q], "{what}: lse shape");
    let g = (&out * &wgt).unwrap().sum_all().unwrap().backward().unwrap();
    let (gq, gk, gv) = (g.get(&q).unwrap(), g.get(&k).unwrap(), g.get(&v).unwrap());
    assert_eq!((gq.dims(), gk.dims(), gv.dims()), (q_shape, k_shape, v_shape), "{what}: grad shapes (dv like v)");
    assert_eq!((gq.dtype(), gk.dtype(), gv.dtype()), (dt, dt, dt), "{what}: grad dtypes");

    // (a) cubeattn's own forward and backward on the same data: bitwise equal
    let (hq_, hk_, hv_, hw) = (host(&q), host(&k), host(&v), host(&wgt));
    let own = CpuBackend.forward(spec, hq_.view(), hk_.view(), hv_.view()).unwrap();
    assert_eq!(host(&out), own.out, "{what}: out vs cubeattn API");
    assert_eq!(lse.flatten_all().unwrap().to_vec1::<f32>().unwrap(), own.lse, "{what}: lse vs cubeattn API");
    let inputs = BackwardInputs { out: own.out.view(), lse: &own.lse, dout: hw.view(), deterministic: true };
    let own = CpuBackend.backward(spec, hq_.view(), hk_.view(), hv_.view(), inputs).unwrap();
    assert_eq!(host(gq), own.dq, "{what}: dq vs cubeattn backward");
    assert_eq!(host(gk), own.dk, "{what}: dk vs cubeattn backward");
    assert_eq!(host(gv), own.dv, "{what}: dv vs cubeattn backward");

    // (b) the f64 reference on the same (rounded) inputs
    let (fq, fk, fv) = (f64s(&q), f64s(&k), f64s(&v));
    let (ro, rl) = forward_f64(spec, &fq, &fk, &fv);
    let e = rel_err(&f64s(&out), &ro);
    eprintln!("{what}: out rel err {e:.2e}");
    assert!(e <= tol(dt).0, "{what}: out relative error {e:e} > {:e}", tol(dt).0);
    assert_lse(what, &lse, &Tensor::from_vec(rl, spec.dims.lse_len(), &Device::Cpu).unwrap());
    let (rq, rk, rv) = backward_f64(spec, &fq, &fk, &fv, &f64s(&wgt));
    for (name, got, want) in [("dq", gq, &rq), ("dk", gk, &rk), ("dv", gv, &rv)] {
        let e = rel_err(&f64s(got), want);
        eprintln!("{what}: {name} rel err {e:.2e}");
        assert!(e <= tol(dt).1, "{what}: {name} relative error {e:e} > {:e}", tol(dt).1);
    }
}

/// v with a head_dim of its own (dv != head_dim of q and k): DeepSeek's MLA (q, k 192, v 128) and
/// v wider than q (64 / 96), through `flash_attn`, `flash_attn_varlen` and `grouped_flash_attn`
/// (and their `_with_lse` forms): out has q's shape with v's head_dim, dv has v's shape, and out,
/// lse and the gradients match the f64 reference.
#[test]
fn value_head_dim_of_its_own_matches_reference_with_gradients() {
    let mut rng = StdRng::seed_from_u64(192_128);
    let meta = |s: &[usize], dt: CDType| TensorMeta::new(s, our_dtype(dt));
    // varlen per sequence (q_len, k_len): single token, q < k and q > k (rows that see no key), odd
    let lens = [(1usize, 1usize), (67, 129), (129, 67), (5, 1), (33, 33)];
    let (cq, ck) = common::cu_seqlens(&lens);
    let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
    for (d, dv) in [(192, 128), (64, 96)] {
        for dt in DTYPES {
            // flash_attn: (b, sq, sk, hq, hkv, causal)
            for (b, sq, sk, hq, hkv, causal) in [(2, 67, 129, 4, 2, true), (1, 70, 45, 4, 1, true), (2, 33, 50, 2, 2, false)] {
                let what = format!("flash_attn d={d} dv={dv} b={b} sq={sq} sk={sk} hq={hq} hkv={hkv} causal={causal} {dt:?}");
                let scale = 0.7 / (d as f32).sqrt();
                let cu = |s: usize| (0..=b).map(|i| (i * s) as i32).collect::<Vec<_>>();
                let spec = AttnSpec::varlen(
                    &meta(&[b * sq, hq, d], dt),
                    &meta(&[b * sk, hkv, d], dt),
                    &meta(&[b * sk, hkv, dv], dt),
                    &cu(sq),
                    &cu(sk),
                    sq,
                    sk,
                    Some(scale as f64),
                    causal,
                )
                .unwrap();
                let op = |q: &Tensor, k: &Tensor, v: &Tensor| -> R<(Tensor, Tensor)> {
                    let (o, l) = cubeattn::candle::flash_attn_with_lse(q, k, v, scale, causal)?;
                    assert_eq!(l.dims(), &[b, hq, sq], "{what}: lse shape");
                    let plain = cubeattn::candle::flash_attn(q, k, v, scale, causal)?;
                    assert_eq!(host(&plain), host(&o), "{what}: flash_attn vs flash_attn_with_lse");
                    // [b, hq, sq] -> cubeattn's [hq, b * sq]
                    Ok((o, l.transpose(0, 1)?.reshape((hq, b * sq))?))
                };
                check_value_dim(&what, &mut rng, &[b, sq, hq, d], &[b, sk, hkv, d], &[b, sk, hkv, dv], dt, &spec, &op);
            }
            // flash_attn_varlen, GQA 4:2
            let (hq, hkv) = (4, 2);
            for causal in [false, true] {
                let what = format!("varlen d={d} dv={dv} hq={hq} hkv={hkv} causal={causal} {dt:?}");
                let scale = 1.3 / (d as f32).sqrt();
                let spec = AttnSpec::varlen(&meta(&[tq, hq, d], dt), &meta(&[tk, hkv, d], dt), &meta(&[tk, hkv, dv], dt), &cq, &ck, 129, 129, Some(scale as f64), causal)
                    .unwrap();
                let (sq, sk) = (Tensor::new(cq.as_slice(), &Device::Cpu).unwrap(), Tensor::new(ck.as_slice(), &Device::Cpu).unwrap());
                let op = |q: &Tensor, k: &Tensor, v: &Tensor| {
                    let (o, l) = cubeattn::candle::flash_attn_varlen_with_lse(q, k, v, &sq, &sk, 129, 129, scale, causal)?;
                    let plain = cubeattn::candle::flash_attn_varlen(q, k, v, &sq, &sk, 129, 129, scale, causal)?;
                    assert_eq!(host(&plain), host(&o), "{what}: plain vs with_lse");
                    Ok((o, l))
                };
                check_value_dim(&what, &mut rng, &[tq, hq, d], &[tk, hkv, d], &[tk, hkv, dv], dt, &spec, &op);
            }
        }
    }
    // grouped_flash_attn, MLA dims: overlapping key ranges, 5 uncovered query rows
    let (q_ranges, kv_ranges) = ([[0, 67], [67, 134], [139, 148]], [[0, 67], [0, 268], [30, 159]]);
    let i32s = |r: &[[usize; 2]]| r.iter().map(|&[a, b]| [a as i32, b as i32]).collect::<Vec<_>>();
    let (tq, tk, hq, hkv, d, dv) = (148, 268, 4, 2, 192, 128);
    for dt in DTYPES {
        let what = format!("grouped d={d} dv={dv} hq={hq} hkv={hkv} causal {dt:?}");
        let spec = AttnSpec::grouped(&meta(&[tq, hq, d], dt), &meta(&[tk, hkv, d], dt), &meta(&[tk, hkv, dv], dt), &i32s(&q_ranges), &i32s(&kv_ranges), Some(0.1), true)
            .unwrap();
        let op = |q: &Tensor, k: &Tensor, v: &Tensor| cubeattn::candle::grouped_flash_attn_with_lse(q, k, v, &q_ranges, &kv_ranges, 0.1, true);
        check_value_dim(&what, &mut rng, &[tq, hq, d], &[tk, hkv, d], &[tk, hkv, dv], dt, &spec, &op);
    }
}

#[test]
fn value_head_dim_errors_name_v() {
    let dev = Device::Cpu;
    let mut rng = StdRng::seed_from_u64(55);
    let mut t = |s: &[usize]| rand_t(&mut rng, s, CDType::F32);
    use cubeattn::candle::{flash_attn, flash_attn_varlen, grouped_flash_attn};
    // batch: q, k [.., 192], v [.., 128]
    let (q, k) = (t(&[2, 8, 4, 192]), t(&[2, 8, 2, 192]));
    assert_eq!(flash_attn(&q, &k, &t(&[2, 8, 2, 128]), 0.1, true).unwrap().dims(), &[2, 8, 4, 128]);
    expect_err(flash_attn(&q, &k, &t(&[3, 8, 2, 128]), 0.1, true), "v"); // batch
    expect_err(flash_attn(&q, &k, &t(&[2, 9, 2, 128]), 0.1, true), "v"); // seqlen
    expect_err(flash_attn(&q, &k, &t(&[2, 7, 2, 128]), 0.1, true), "v"); // seqlen
    expect_err(flash_attn(&q, &k, &t(&[2, 8, 1, 128]), 0.1, true), "v"); // heads
    expect_err(flash_attn(&q, &k, &t(&[2, 8, 4, 128]), 0.1, true), "v"); // heads (q's)
    expect_err(flash_attn(&q, &k, &t(&[2, 8, 2, 300]), 0.1, true), "v"); // head_dim past the largest
    expect_err(flash_attn(&q, &k, &t(&[2, 8, 2, 0]), 0.1, true), "v"); // head_dim 0
    expect_err(flash_attn(&q, &k, &t(&[2, 8, 2, 128]).flatten_to(1).unwrap(), 0.1, true), "v"); // rank 3
    expect_err(flash_attn(&q, &t(&[2, 8, 2, 128]), &t(&[2, 8, 2, 128]), 0.1, true), "k"); // k must keep q's head_dim

    // varlen: q [10, 4, 192], k [12, 2, 192], v [12, 2, 128]
    let (q3, k3) = (t(&[10, 4, 192]), t(&[12, 2, 192]));
    let s = |v: &[u32]| Tensor::new(v, &dev).unwrap();
    let (sq, sk) = (s(&[0, 4, 10]), s(&[0, 6, 12]));
    assert_eq!(flash_attn_varlen(&q3, &k3, &t(&[12, 2, 128]), &sq, &sk, 6, 6, 0.1, true).unwrap().dims(), &[10, 4, 128]);
    expect_err(flash_attn_varlen(&q3, &k3, &t(&[13, 2, 128]), &sq, &sk, 6, 6, 0.1, true), "v"); // tokens
    expect_err(flash_attn_varlen(&q3, &k3, &t(&[11, 2, 128]), &sq, &sk, 6, 6, 0.1, true), "v"); // tokens
    expect_err(flash_attn_varlen(&q3, &k3, &t(&[12, 1, 128]), &sq, &sk, 6, 6, 0.1, true), "v"); // heads
    expect_err(flash_attn_varlen(&q3, &k3, &t(&[12, 2, 300]), &sq, &sk, 6, 6, 0.1, true), "v"); // head_dim

    // grouped
    let (qr, kr) = ([[0, 5], [5, 10]], [[0, 6], [0, 12]]);
    assert_eq!(grouped_flash_attn(&q3, &k3, &t(&[12, 2, 128]), &qr, &kr, 0.1, true).unwrap().dims(), &[10, 4, 128]);
    expect_err(grouped_flash_attn(&q3, &k3, &t(&[13, 2, 128]), &qr, &kr, 0.1, true), "v");
    expect_err(grouped_flash_attn(&q3, &k3, &t(&[12, 4, 128]), &qr, &kr, 0.1, true), "v");
}
