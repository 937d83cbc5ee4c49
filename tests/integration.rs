//! CPU backend vs the f64 reference, spec validation, and (with `--features cuda` on a GPU
//! machine) the GPU suite in tests/gpu.

mod common;

use common::*;
use cubeattn::backend::BackwardInputs;
use cubeattn::reference::{backward_f64, forward_f64};
use cubeattn::backend::cpu::CpuBackend;
use cubeattn::{backend_for, AttnSpec, Backend, DType, DevicePref, Error, HostData, Pass, TensorMeta};

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Per-dtype (atol = rtol, max relative norm error) for outputs and gradients. For f16/bf16 the
/// seed's 1e-3 is widened by the unit roundoff of storing the exact value in that dtype
/// (bf16: 2^-8, which alone exceeds 1e-3 for |out| > 0.25).
fn fwd_tol(dt: DType) -> (f64, f64) {
    match dt {
        DType::F32 => (1e-5, 1e-5),
        DType::F16 => (1e-3 + 2f64.powi(-11), 2e-3),
        DType::BF16 => (1e-3 + 2f64.powi(-8), 8e-3),
    }
}
fn bwd_tol(dt: DType) -> (f64, f64) {
    match dt {
        DType::F32 => (1e-4, 1e-4),
        DType::F16 => (1e-2, 5e-3),
        DType::BF16 => (1e-2, 2e-2),
    }
}

/// Forward on the CPU backend vs f64; returns (out, lse) for further checks.
fn check_forward(spec: &AttnSpec, seed: u64, amp: f32) -> (HostData, Vec<f32>) {
    let mut r = rng(seed);
    let [(q, qf), (k, kf), (v, vf)] = random_qkv(&mut r, spec, amp);
    let cpu = CpuBackend;
    let res = cpu.forward(spec, q.view(), k.view(), v.view()).unwrap();
    let (out_ref, lse_ref) = forward_f64(spec, &qf, &kf, &vf);
    let (tol, rel) = fwd_tol(spec.dtype);
    assert_close("out", &res.out.view().to_f64_vec(), &out_ref, tol, tol, rel);
    assert_lse(&res.lse, &lse_ref, 1e-5);
    (res.out, res.lse)
}

fn check_backward(spec: &AttnSpec, seed: u64) {
    let mut r = rng(seed);
    let [(q, qf), (k, kf), (v, vf)] = random_qkv(&mut r, spec, 1.0);
    let (dout, dof) = random(&mut r, spec.dims.out_len(), spec.dtype, 1.0);
    let cpu = CpuBackend;
    let fwd = cpu.forward(spec, q.view(), k.view(), v.view()).unwrap();
    let g = BackwardInputs { out: fwd.out.view(), lse: &fwd.lse, dout: dout.view(), deterministic: true };
    let grads = cpu.backward(spec, q.view(), k.view(), v.view(), g).unwrap();
    let (dq, dk, dv) = backward_f64(spec, &qf, &kf, &vf, &dof);
    let (tol, rel) = bwd_tol(spec.dtype);
    assert_close("dq", &grads.dq.view().to_f64_vec(), &dq, tol, tol, rel);
    assert_close("dk", &grads.dk.view().to_f64_vec(), &dk, tol, tol, rel);
    assert_close("dv", &grads.dv.view().to_f64_vec(), &dv, tol, tol, rel);
    // determinism: a second run is bitwise identical
    let again = cpu.backward(spec, q.view(), k.view(), v.view(), g).unwrap();
    assert_eq!(again.dq, grads.dq);
    assert_eq!(again.dk, grads.dk);
    assert_eq!(again.dv, grads.dv);
}

#[test]
fn forward_dense_matches_reference_all_dtypes() {
    for (i, &dt) in DTYPES.iter().enumerate() {
        for causal in [false, true] {
            for &(s, d) in &[(1usize, 64usize), (37, 64), (130, 128), (200, 40)] {
                let spec = varlen_spec(&[(s, s)], 4, 2, d, dt, causal);
                check_forward(&spec, 100 + i as u64 * 10 + s as u64, 1.0);
            }
        }
    }
}

#[test]
fn forward_causal_bottom_right_when_lengths_differ() {
    for &(sq, sk) in &[(5usize, 300usize), (129, 77), (1, 1000), (64, 64), (300, 5)] {
        let spec = varlen_spec(&[(sq, sk)], 2, 1, 64, DType::F32, true);
        let (out, lse) = check_forward(&spec, sq as u64 * 7 + sk as u64, 1.0);
        // rows with k_len - q_len + r + 1 <= 0 see nothing: zero output and lse = +inf
        let blind = sq.saturating_sub(sk);
        let o = out.to_f32_vec();
        for r in 0..blind {
            assert!(o[r * 2 * 64..(r + 1) * 2 * 64].iter().all(|&x| x == 0.0));
            assert!(lse[r].is_infinite() && lse[r] > 0.0);
        }
    }
}

#[test]
fn forward_gqa_32_8_and_varlen() {
    let spec = varlen_spec(&[(128, 128), (1, 1), (333, 512), (0, 7), (90, 0), (513, 513)], 32, 8, 64, DType::BF16, true);
    check_forward(&spec, 7, 1.0);
    let spec = varlen_spec(&[(250, 700), (1000, 1000)], 32, 8, 128, DType::F16, false);
    check_forward(&spec, 8, 1.0);
}

#[test]
fn forward_large_inputs_stay_finite() {
    // 10x-scaled inputs: the online softmax must not overflow
    let spec = varlen_spec(&[(300, 300)], 4, 4, 64, DType::F16, true);
    let (out, lse) = check_forward(&spec, 9, 10.0);
    assert!(out.to_f32_vec().iter().all(|x| x.is_finite()));
    assert!(lse.iter().all(|x| x.is_finite()));
}

#[test]
fn backward_matches_reference() {
    for (i, &dt) in DTYPES.iter().enumerate() {
        for causal in [false, true] {
            let spec = varlen_spec(&[(70, 70), (1, 33), (129, 100)], 4, 2, 64, dt, causal);
            check_backward(&spec, 200 + i as u64 + causal as u64);
        }
    }
    check_backward(&varlen_spec(&[(96, 200)], 32, 8, 128, DType::F32, true), 3);
}

#[test]
fn grouped_matches_reference_with_overlap() {
    for g in [2usize, 3, 4] {
        let q_lens: Vec<usize> = (0..g).map(|i| 40 + 37 * i).collect();
        let kv: Vec<(i32, i32)> = (0..g).map(|i| (0, 150 + 100 * i as i32)).collect();
        for causal in [false, true] {
            let spec = grouped_spec(&q_lens, &kv, 500, 8, 2, 64, DType::F16, causal);
            check_forward(&spec, g as u64, 1.0);
            check_backward(&spec, g as u64 + 50);
        }
    }
}

#[test]
fn grouped_edge_cases() {
    // empty groups, single-token groups, offset windows, all groups on the same K,V
    let spec = grouped_spec(&[0, 1, 17, 0, 64], &[(10, 90), (0, 1), (50, 400), (0, 0), (0, 400)], 400, 4, 1, 64, DType::F32, true);
    check_forward(&spec, 11, 1.0);
    check_backward(&spec, 12);
    let spec = grouped_spec(&[33; 8], &[(0, 256); 8], 256, 4, 2, 64, DType::BF16, true);
    check_forward(&spec, 13, 1.0);
    // imbalanced groups
    let spec = grouped_spec(&[10, 990], &[(0, 100), (0, 9900)], 9900, 2, 1, 64, DType::BF16, true);
    check_forward(&spec, 14, 1.0);
}

#[test]
fn single_group_equals_plain_attention() {
    let mut r = rng(21);
    let grouped = grouped_spec(&[200], &[(0, 300)], 300, 8, 2, 64, DType::F16, true);
    let plain = varlen_spec(&[(200, 300)], 8, 2, 64, DType::F16, true);
    let [(q, _), (k, _), (v, _)] = random_qkv(&mut r, &plain, 1.0);
    let cpu = CpuBackend;
    let a = cpu.forward(&grouped, q.view(), k.view(), v.view()).unwrap();
    let b = cpu.forward(&plain, q.view(), k.view(), v.view()).unwrap();
    assert_eq!(a.out, b.out);
    assert_eq!(a.lse, b.lse);
}

#[test]
fn rows_outside_every_group_are_zero() {
    // groups cover rows 0..10 and 20..30 of 30
    let q = TensorMeta::new(&[30, 2, 64], DType::F32);
    let k = TensorMeta::new(&[60, 2, 64], DType::F32);
    let spec2 = AttnSpec::grouped(&q, &k, &k, &[[0, 10], [20, 30]], &[[0, 50], [0, 60]], None, false).unwrap();
    assert_eq!(spec2.uncovered_rows(), 10);
    let (out, lse) = check_forward(&spec2, 31, 1.0);
    let o = out.to_f32_vec();
    assert!(o[10 * 128..20 * 128].iter().all(|&x| x == 0.0));
    assert!(lse[10..20].iter().all(|x| x.is_infinite()));
}

fn err_arg(e: Error) -> &'static str {
    match e {
        Error::InvalidArgument { arg, .. } | Error::InvalidDtype { arg, .. } => arg,
        other => panic!("expected an argument error, got {other:?}"),
    }
}

#[test]
fn invalid_inputs_name_the_argument() {
    let m = |s: &[usize]| TensorMeta::new(s, DType::F16);
    let ok = m(&[10, 4, 64]);
    let kv = m(&[10, 2, 64]);
    let cu = [0, 10];
    let vl = |q: &TensorMeta, k: &TensorMeta, v: &TensorMeta, cq: &[i32], ck: &[i32], mq, mk, sc| {
        AttnSpec::varlen(q, k, v, cq, ck, mq, mk, sc, false).map(|_| ()).map_err(err_arg)
    };
    assert_eq!(vl(&m(&[10, 64]), &kv, &kv, &cu, &cu, 10, 10, None), Err("q"));
    assert_eq!(vl(&ok, &m(&[10, 2, 64, 1]), &kv, &cu, &cu, 10, 10, None), Err("k"));
    assert_eq!(vl(&m(&[10, 4, 0]), &m(&[10, 2, 0]), &m(&[10, 2, 0]), &cu, &cu, 10, 10, None), Err("q"));
    assert_eq!(vl(&m(&[10, 4, 512]), &m(&[10, 2, 512]), &m(&[10, 2, 512]), &cu, &cu, 10, 10, None), Err("q"));
    assert_eq!(vl(&ok, &m(&[10, 3, 64]), &m(&[10, 3, 64]), &cu, &cu, 10, 10, None), Err("k"));
    assert_eq!(vl(&ok, &m(&[10, 2, 32]), &m(&[10, 2, 32]), &cu, &cu, 10, 10, None), Err("k"));
    assert_eq!(vl(&ok, &kv, &m(&[9, 2, 64]), &cu, &cu, 10, 10, None), Err("v"));
    assert_eq!(vl(&ok, &TensorMeta::new(&[10, 2, 64], DType::F32), &kv, &cu, &cu, 10, 10, None), Err("k"));
    assert_eq!(vl(&ok, &kv, &TensorMeta::new(&[10, 2, 64], DType::BF16), &cu, &cu, 10, 10, None), Err("v"));
    assert_eq!(vl(&ok, &kv, &kv, &[1, 10], &cu, 10, 10, None), Err("cu_seqlens_q"));
    assert_eq!(vl(&ok, &kv, &kv, &[0, 6, 4, 10], &[0, 3, 6, 10], 10, 10, None), Err("cu_seqlens_q"));
    assert_eq!(vl(&ok, &kv, &kv, &cu, &[0, 9], 10, 10, None), Err("cu_seqlens_k"));
    assert_eq!(vl(&ok, &kv, &kv, &cu, &[0, 5, 10], 10, 10, None), Err("cu_seqlens_k"));
    assert_eq!(vl(&ok, &kv, &kv, &[], &[], 10, 10, None), Err("cu_seqlens_q"));
    assert_eq!(vl(&ok, &kv, &kv, &cu, &cu, 9, 10, None), Err("max_seqlen_q"));
    assert_eq!(vl(&ok, &kv, &kv, &cu, &cu, 10, 3, None), Err("max_seqlen_k"));
    assert_eq!(vl(&ok, &kv, &kv, &cu, &cu, 10, 10, Some(f64::NAN)), Err("softmax_scale"));
    assert_eq!(vl(&ok, &kv, &kv, &cu, &cu, 10, 10, Some(f64::INFINITY)), Err("softmax_scale"));
    assert!(vl(&ok, &kv, &kv, &cu, &cu, 10, 10, Some(0.5)).is_ok());

    let gr = |qr: &[[i32; 2]], kr: &[[i32; 2]]| AttnSpec::grouped(&ok, &kv, &kv, qr, kr, None, true).map(|_| ()).map_err(err_arg);
    assert_eq!(gr(&[], &[]), Err("q_ranges"));
    assert_eq!(gr(&[[0, 5]], &[[0, 5], [0, 6]]), Err("kv_ranges"));
    assert_eq!(gr(&[[0, 11]], &[[0, 5]]), Err("q_ranges"));
    assert_eq!(gr(&[[3, 2]], &[[0, 5]]), Err("q_ranges"));
    assert_eq!(gr(&[[0, 5]], &[[-1, 5]]), Err("kv_ranges"));
    assert_eq!(gr(&[[0, 6], [5, 10]], &[[0, 5], [0, 10]]), Err("q_ranges"));
    assert!(gr(&[[0, 5], [5, 10], [7, 7]], &[[0, 5], [0, 10], [2, 2]]).is_ok());
}

/// v with a head_dim of its own (DeepSeek's MLA: 192 / 128; v wider than q; both off the kernel
/// head dims): the CPU backend against the f64 reference, forward and backward, every dtype.
#[test]
fn value_head_dim_of_its_own_matches_reference() {
    for (i, (name, spec)) in value_dim_specs(&DTYPES).iter().enumerate() {
        let (out, _) = check_forward(spec, 900 + i as u64, 1.0);
        assert_eq!(out.len(), spec.dims.out_len(), "{name}");
        check_backward(spec, 950 + i as u64);
    }
}

/// v's head_dim is checked once, naming `v`; the key sets that take one head_dim refuse another.
#[test]
fn value_head_dim_is_validated_naming_v() {
    let m = |s: &[usize]| TensorMeta::new(s, DType::BF16);
    let (q, k) = (m(&[256, 2, 192]), m(&[256, 2, 192]));
    let cu = [0, 256];
    let vl = |v: &TensorMeta| AttnSpec::varlen(&q, &k, v, &cu, &cu, 256, 256, None, true);
    for bad in [m(&[256, 2, 0]), m(&[256, 2, 257]), m(&[256, 1, 128]), m(&[255, 2, 128]), m(&[256, 2])] {
        assert_eq!(vl(&bad).map(|_| ()).map_err(err_arg), Err("v"), "{:?}", bad.shape);
    }
    let spec = vl(&m(&[256, 2, 128])).expect("v at its own head_dim");
    // the scale is q's: 1 / sqrt(192)
    assert_eq!(spec.scale, 1.0 / (192f32).sqrt());
    assert_eq!((spec.dims.head_dim, spec.dims.head_dim_v, spec.dims.out_len()), (192, 128, 256 * 2 * 128));
    // 2 * (192 + 128) per pair and head
    assert_eq!(spec.forward_flops(), 2.0 * 320.0 * 2.0 * (256.0 * 257.0 / 2.0));
    assert_eq!(spec.clone().with_kv_block_table(&[1, 0]).map(|_| ()).map_err(err_arg), Err("v"));
    assert_eq!(spec.clone().with_block_index(&[0, 1, 0, 1], &[1, 2, 1, 2], 128, 128, None).map(|_| ()).map_err(err_arg), Err("v"));
    // buffers: v and out at v's head_dim
    let cpu = CpuBackend;
    let (qd, vd) = (HostData::from_f32(DType::BF16, &vec![0.5; 256 * 2 * 192]), HostData::from_f32(DType::BF16, &vec![0.5; 256 * 2 * 128]));
    assert_eq!(err_arg(cpu.forward(&spec, qd.view(), qd.view(), qd.view()).unwrap_err()), "v");
    let g = BackwardInputs { out: qd.view(), lse: &[0.0; 512], dout: vd.view(), deterministic: true };
    assert_eq!(err_arg(cpu.backward(&spec, qd.view(), qd.view(), vd.view(), g).unwrap_err()), "out");
}

#[test]
fn buffers_must_match_the_spec() {
    let spec = varlen_spec(&[(8, 8)], 2, 2, 64, DType::F32, false);
    let cpu = CpuBackend;
    let good = HostData::F32(vec![0.5; 8 * 2 * 64]);
    let short = HostData::F32(vec![0.5; 10]);
    let half = HostData::from_f32(DType::F16, &vec![0.5; 8 * 2 * 64]);
    assert_eq!(err_arg(cpu.forward(&spec, short.view(), good.view(), good.view()).unwrap_err()), "q");
    assert_eq!(err_arg(cpu.forward(&spec, good.view(), good.view(), half.view()).unwrap_err()), "v");
    assert!(matches!(DevicePref::parse("tpu"), Err(Error::InvalidArgument { arg: "device", .. })));
    // an f16 `out` with f32 q: a dtype error naming `out`, not an element-count mismatch
    let half_q = HostData::from_f32(DType::F16, &vec![0.5; 8 * 2 * 64]);
    let g = BackwardInputs { out: half_q.view(), lse: &[0.0; 16], dout: good.view(), deterministic: false };
    match cpu.backward(&spec, good.view(), good.view(), good.view(), g) {
        Err(Error::InvalidDtype { arg: "out", .. }) => {}
        other => panic!("{other:?}"),
    }
    let bf = HostData::from_f32(DType::BF16, &[0.5; 10]);
    assert!(matches!(cpu.forward(&spec, bf.view(), good.view(), good.view()), Err(Error::InvalidDtype { arg: "q", .. })));
}

#[test]
fn device_strings_parse_with_indices() {
    assert_eq!(DevicePref::parse("auto").unwrap(), DevicePref::Auto(0));
    assert_eq!(DevicePref::parse("cpu").unwrap(), DevicePref::Cpu);
    assert_eq!(DevicePref::parse("cuda").unwrap(), DevicePref::Cuda(0));
    assert_eq!(DevicePref::parse("gpu").unwrap(), DevicePref::Cuda(0));
    assert_eq!(DevicePref::parse("cuda:3").unwrap(), DevicePref::Cuda(3));
    assert_eq!(DevicePref::parse("auto:1").unwrap(), DevicePref::Auto(1));
    for bad in ["cuda:", "cuda:-1", "cuda:x", "cpu:0", "cuda:1:2", "cuda:100000", "Cuda"] {
        assert!(matches!(DevicePref::parse(bad), Err(Error::InvalidArgument { arg: "device", .. })), "{bad}");
    }
}

#[test]
fn device_listing_never_panics() {
    let st = cubeattn::device::backend_status();
    assert!(!st.reason.is_empty());
    if !st.cuda_available {
        let m = TensorMeta::new(&[8, 2, 64], DType::F16);
        let spec = AttnSpec::varlen(&m, &m, &m, &[0, 8], &[0, 8], 8, 8, None, false).unwrap();
        let sparse = spec.clone().with_block_index(&[0, 0], &[1, 2, 1, 1], 64, 128, None).unwrap();
        for s in [&spec, &sparse] {
            for pass in [Pass::Forward, Pass::Backward { deterministic: true }] {
                assert!(backend_for(DevicePref::Cuda(0), s, pass).is_err());
                assert!(backend_for(DevicePref::Cuda(5), s, pass).is_err());
                assert_eq!(backend_for(DevicePref::Auto(0), s, pass).unwrap().kind(), cubeattn::BackendKind::Cpu);
                assert_eq!(backend_for(DevicePref::Auto(3), s, pass).unwrap().kind(), cubeattn::BackendKind::Cpu);
            }
        }
    }
}

// ---------------------------------------------------------------- sliding window (window_size)

fn with_window(spec: AttnSpec, left: i64, right: i64) -> AttnSpec {
    spec.with_window(left, right).expect("valid window")
}

/// Forward and backward with flash-attn's window_size vs the f64 reference (whose key ranges come
/// from `AttnSpec::row_keys`, itself checked key by key against flash-attn's definition in
/// spec.rs): odd lengths, q longer and shorter than k, GQA, causal and not, windows wider than the
/// sequence, 0-width windows, one-sided windows, varlen with empty sequences.
#[test]
fn window_forward_and_backward_match_reference() {
    let shapes: &[&[(usize, usize)]] = &[&[(37, 37)], &[(5, 131)], &[(131, 5)], &[(700, 700)], &[(3, 0), (0, 4), (29, 61), (1, 1)]];
    let windows = [(0, 0), (3, 2), (16, -1), (-1, 7), (0, -1), (1000, 1000), (130, 0), (2, 600)];
    let mut seed = 9000;
    for (si, &lens) in shapes.iter().enumerate() {
        for &(l, r) in &windows {
            for causal in [false, true] {
                let dt = DTYPES[(si + seed as usize) % 3];
                let spec = with_window(varlen_spec(lens, 4, 2, 24, dt, causal), l, r);
                seed += 1;
                check_forward(&spec, seed, 1.0);
                if lens[0].0 < 200 {
                    check_backward(&spec, seed);
                }
            }
        }
    }
}

#[test]
fn window_on_grouped_attention_is_measured_inside_each_group() {
    let base = grouped_spec(&[20, 0, 33, 7], &[(0, 40), (3, 9), (10, 90), (60, 60)], 90, 2, 1, 16, DType::F32, true);
    for (l, r) in [(5, -1), (0, 0), (31, 4)] {
        let spec = with_window(base.clone(), l, r);
        check_forward(&spec, 77 + l as u64, 1.0);
        check_backward(&spec, 78 + l as u64);
        let nc = with_window(AttnSpec { causal: false, ..base.clone() }, l, r);
        check_forward(&nc, 79 + l as u64, 1.0);
        check_backward(&nc, 80 + l as u64);
    }
}

/// A row whose window holds no key (q longer than k with a 0-width window: the first rows'
/// diagonal lies before key 0) gets a zero output and lse +inf, the library's no-key convention.
#[test]
fn rows_with_an_empty_window_give_zero_and_lse_inf() {
    let spec = with_window(varlen_spec(&[(10, 4)], 2, 2, 8, DType::F32, false), 0, 0);
    let (out, lse) = check_forward(&spec, 5, 1.0);
    let out = out.view().to_f64_vec();
    for t in 0..10 {
        let empty = t < 6; // diag = t + 4 - 10 < 0
        for h in 0..2 {
            assert_eq!(lse[h * 10 + t].is_infinite(), empty, "row {t}");
            let o = &out[(t * 2 + h) * 8..][..8];
            assert_eq!(o.iter().all(|&x| x == 0.0), empty, "row {t}");
        }
    }
}

/// Windows wider than every sequence are the plain spec (bitwise the same output).
#[test]
fn windows_wider_than_the_sequence_change_nothing() {
    let plain = varlen_spec(&[(50, 70)], 2, 1, 32, DType::F32, true);
    let wide = with_window(plain.clone(), 69, 49);
    assert_eq!(wide, plain);
    let narrower = with_window(plain.clone(), 68, -1);
    assert_ne!(narrower, plain);
    let (a, _) = check_forward(&plain, 3, 1.0);
    let (b, _) = check_forward(&narrower, 3, 1.0);
    assert_ne!(a, b, "a window one key narrower must change row 49's output");
}

/// The CUDA kernels take sliding windows (tests/gpu and tests/python/test_window_gpu.py check the
/// results on a GPU), and every head_dim up to 256: those without a kernel of their own run on the
/// next kernel head dim with zero columns (`backend::cuda::head_pad`); what cannot be served that
/// way (the INT8 Q K^T option reads the columns it quantises) is refused naming the head_dim.
#[cfg(feature = "cuda")]
#[test]
fn window_and_every_head_dim_are_supported_on_cuda() {
    use cubeattn::backend::cuda::check_supported;
    let spec = with_window(varlen_spec(&[(8, 8)], 2, 2, 64, DType::F16, true), 2, 0);
    check_supported(&spec, Pass::Forward).expect("a sliding window runs on CUDA");
    for d in 1..=cubeattn::spec::MAX_HEAD_DIM {
        for dt in [DType::F16, DType::BF16, DType::F32] {
            let s = with_window(varlen_spec(&[(8, 8)], 2, 2, d, dt, true), 2, 0);
            check_supported(&s, Pass::Forward).unwrap_or_else(|e| panic!("head_dim {d} {dt:?} forward: {e}"));
            for deterministic in [false, true] {
                // above 128 the backward needs Hopper (`CudaBackend::check_target`), not checked here
                check_supported(&s, Pass::Backward { deterministic }).unwrap_or_else(|e| panic!("head_dim {d} {dt:?} backward: {e}"));
            }
        }
    }
    // block-sparse: 96 runs on the d128 kernels; with INT8 Q K^T it is refused naming both
    let sparse = |d, int8| {
        let m = |n| TensorMeta::new(&[n, 2, d], DType::BF16);
        let a = AttnSpec::varlen(&m(128), &m(256), &m(256), &[0, 128], &[0, 256], 128, 256, None, false).unwrap();
        a.with_block_index(&[0, 1, 0, 1], &[1, 2, 1, 2], 128, 128, int8).unwrap()
    };
    check_supported(&sparse(96, None), Pass::Forward).expect("block-sparse head_dim 96 runs padded");
    let int8 = Some(cubeattn::Int8Qk { gran: cubeattn::QuantGran::PerBlock, smooth_k: true, pv_fp8: false });
    match check_supported(&sparse(96, int8), Pass::Forward) {
        Err(Error::Unsupported { backend, msg }) => assert!(backend == "cuda" && msg.contains("not 96"), "{msg}"),
        other => panic!("{other:?}"),
    }
    check_supported(&sparse(128, int8), Pass::Forward).expect("INT8 at head_dim 128");
}

// ---------------------------------------------------------------- NaN / Inf policy

fn run(spec: &AttnSpec, q: &HostData, k: &HostData, v: &HostData, dout: &HostData) -> (Vec<f64>, Vec<f32>, [Vec<f64>; 3]) {
    let cpu = CpuBackend;
    let f = cpu.forward(spec, q.view(), k.view(), v.view()).unwrap();
    let g = BackwardInputs { out: f.out.view(), lse: &f.lse, dout: dout.view(), deterministic: true };
    let gr = cpu.backward(spec, q.view(), k.view(), v.view(), g).unwrap();
    (f.out.view().to_f64_vec(), f.lse, [gr.dq.view().to_f64_vec(), gr.dk.view().to_f64_vec(), gr.dv.view().to_f64_vec()])
}

fn with_value(x: &HostData, at: usize, value: f32) -> HostData {
    let mut xs = x.to_f32_vec();
    xs[at] = value;
    HostData::from_f32(x.dtype(), &xs)
}

/// A NaN or Inf element that a row cannot see (causal mask, sliding window, varlen boundary)
/// leaves that row as without it up to rounding (forward and dq); a row that uses a NaN gets a NaN
/// output and lse, as torch's softmax gives.
#[test]
fn non_finite_values_reach_only_the_rows_that_see_them() {
    let (hq, hkv, d) = (2usize, 1usize, 16usize);
    for dt in DTYPES {
        for (window, causal) in [((-1, -1), true), ((2, 1), false), ((3, 0), true)] {
            // two sequences: a bad element of sequence 0 never reaches sequence 1 either
            let spec = with_window(varlen_spec(&[(9, 9), (6, 6)], hq, hkv, d, dt, causal), window.0, window.1);
            let mut r = rng(4);
            let [(q, _), (k, _), (v, _)] = random_qkv(&mut r, &spec, 1.0);
            let (dout, _) = random(&mut r, spec.dims.q_len(), dt, 1.0);
            let clean = run(&spec, &q, &k, &v, &dout);
            let seg = spec.segments[0];
            for (which, value) in [("v", f32::INFINITY), ("v", f32::NAN), ("k", f32::NAN), ("q", f32::NAN), ("dout", f32::NAN)] {
                let (row, chan) = (3usize, 5usize);
                let heads = if which == "q" || which == "dout" { hq } else { hkv };
                let at = (row * heads) * d + chan;
                let (q2, k2, v2, g2) = match which {
                    "q" => (with_value(&q, at, value), k.clone(), v.clone(), dout.clone()),
                    "k" => (q.clone(), with_value(&k, at, value), v.clone(), dout.clone()),
                    "v" => (q.clone(), k.clone(), with_value(&v, at, value), dout.clone()),
                    _ => (q.clone(), k.clone(), v.clone(), with_value(&dout, at, value)),
                };
                let bad = run(&spec, &q2, &k2, &v2, &g2);
                let what = format!("{dt:?} window={window:?} causal={causal} {which}[{row}]={value}");
                for t in 0..spec.dims.total_q {
                    // does row t (head 0) use the bad element in its forward?
                    let uses = match which {
                        "q" => t == row,
                        "dout" => false,
                        _ => t < seg.q_len && { let (lo, hi) = spec.row_keys(&seg, t); (lo..hi).contains(&row) },
                    };
                    let o = |x: &Vec<f64>| x[(t * hq) * d..(t * hq + 1) * d].to_vec();
                    if uses && (value.is_nan() || which == "v") {
                        assert!(o(&bad.0).iter().any(|x| !x.is_finite()), "{what}: row {t} uses it but is finite");
                        if value.is_nan() && which != "v" {
                            assert!(bad.1[t].is_nan(), "{what}: row {t}: lse {} should be NaN", bad.1[t]);
                        }
                    } else if !uses {
                        // the same values (rounding may differ: NaN / Inf inputs take the exact,
                        // pair-by-pair products, and on AVX-512 CPUs finite ones the forward's
                        // register tiles, whose f32 sums run in another order: the lse moves by
                        // an ulp or so)
                        let (ft, bt) = (fwd_tol(dt).0, bwd_tol(dt).0);
                        assert_close(&format!("{what}: row {t}"), &o(&bad.0), &o(&clean.0), ft, ft, f64::INFINITY);
                        let (lb, lc) = (bad.1[t], clean.1[t]);
                        assert!(lb == lc || (lb - lc).abs() <= 1e-6 * (1.0 + lc.abs()), "{what}: lse of row {t}: {lb} vs {lc}");
                        // its dq: the row's own probabilities and keys only (dout: row 3's own dq)
                        if which != "dout" || t != row {
                            assert_close(&format!("{what}: dq of row {t}"), &o(&bad.2[0]), &o(&clean.2[0]), bt, bt, f64::INFINITY);
                        }
                    }
                }
                // keys that no row using the element sees keep their exact gradients
                if which == "k" || which == "v" {
                    for j in 0..spec.dims.total_k {
                        let seen_by_user = j < seg.k_len
                            && (0..seg.q_len).any(|t| {
                                let (lo, hi) = spec.row_keys(&seg, t);
                                (lo..hi).contains(&row) && (lo..hi).contains(&j)
                            });
                        if !seen_by_user && j != row {
                            let kk = |x: &Vec<f64>| x[j * hkv * d..(j + 1) * hkv * d].to_vec();
                            let bt = bwd_tol(dt).0;
                            assert_close(&format!("{what}: dk of key {j}"), &kk(&bad.2[1]), &kk(&clean.2[1]), bt, bt, f64::INFINITY);
                            assert_close(&format!("{what}: dv of key {j}"), &kk(&bad.2[2]), &kk(&clean.2[2]), bt, bt, f64::INFINITY);
                        }
                    }
                }
            }
        }
    }
}

/// A -inf score (an Inf in k, the right sign against q) gives that key weight 0: the row stays
/// finite and equals attention without the key, as in torch; a row whose keys all have -inf
/// scores is a row with no key (zero output, lse +inf; torch's SDPA gives zeros too).
#[test]
fn minus_inf_scores_weigh_nothing() {
    let d = 8usize;
    let spec = varlen_spec(&[(6, 6)], 1, 1, d, DType::F32, true);
    let q = HostData::from_f32(DType::F32, &vec![1.0; 6 * d]);
    let mut kx: Vec<f32> = (0..6 * d).map(|i| ((i * 37) % 11) as f32 / 11.0 - 0.5).collect();
    kx[2 * d] = f32::NEG_INFINITY; // key 2: score -inf for every row (q > 0)
    kx[0] = f32::NEG_INFINITY; // key 0 too: row 0 sees only key 0
    let k = HostData::from_f32(DType::F32, &kx);
    let vx: Vec<f32> = (0..6 * d).map(|i| (i % 7) as f32).collect();
    let v = HostData::from_f32(DType::F32, &vx);
    let mut v_big = vx.clone();
    v_big[2 * d..3 * d].fill(1e30);
    let v2 = HostData::from_f32(DType::F32, &v_big);
    let dout = HostData::from_f32(DType::F32, &vec![1.0; 6 * d]);
    let a = run(&spec, &q, &k, &v, &dout);
    let b = run(&spec, &q, &k, &v2, &dout);
    assert!(a.0[..d].iter().all(|&x| x == 0.0) && a.1[0] == f32::INFINITY, "row 0: all its scores are -inf");
    assert!(a.0[d..].iter().all(|x| x.is_finite()), "rows 1..: finite");
    assert_eq!(a.0[d..], b.0[d..], "key 2 must weigh exactly 0");
}

/// Bitwise the same result as before for finite inputs whatever the scale sign: a negative or
/// zero softmax_scale masks the tails correctly (exercises the AVX-512 tiles where present).
#[test]
fn negative_and_zero_scales_match_reference() {
    for scale in [-0.7f64, 0.0, -3.0] {
        for &(sq, sk) in &[(37usize, 37usize), (5, 70), (130, 130)] {
            let mut c = varlen_spec(&[(sq, sk)], 2, 1, 24, DType::F32, true);
            c.scale = scale as f32;
            check_forward(&c, 3 + sq as u64, 1.0);
            check_backward(&c, 4 + sq as u64);
        }
    }
}

/// A zigzag-like page table over `n` blocks: logical block g at physical (g * 5 + 3) % n when
/// that is a permutation (gcd(5, n) = 1), else reversed.
fn scrambled_table(n: usize) -> Vec<i32> {
    if n % 5 != 0 {
        (0..n).map(|g| ((g * 5 + 3) % n) as i32).collect()
    } else {
        (0..n).rev().map(|g| g as i32).collect()
    }
}

#[test]
fn paged_kv_matches_reference_and_the_ordered_call() {
    // zigzag-like groups: two query chunks over causal prefixes of one sequence of 8 blocks, and a
    // second sequence; GQA, every dtype, causal and not
    for (i, &dt) in DTYPES.iter().enumerate() {
        for causal in [false, true] {
            let (c, tk) = (128i32, 768usize);
            let qr = [[0, 64], [64, 128], [128, 192], [192, 192]];
            let kr = [[0, 2 * c], [0, 4 * c], [4 * c, 6 * c], [0, 64]];
            let plain = grouped_ranges_spec(&qr, &kr, 192, tk, 4, 2, 64, dt, causal);
            let table = scrambled_table(tk / 64);
            let paged = plain.clone().with_kv_block_table(&table).expect("valid table");
            check_forward(&paged, 300 + i as u64, 1.0);
            check_backward(&paged, 310 + i as u64);
            // bitwise: the paged call on the physical layout is the plain call on the logical one
            let mut r = rng(320 + i as u64);
            let [(q, _), (k, _), (v, _)] = random_qkv(&mut r, &plain, 1.0);
            let (dout, _) = random(&mut r, plain.dims.q_len(), dt, 1.0);
            let row = 2 * 64;
            let (kp, vp) = (paged_layout(&k, &table, row), paged_layout(&v, &table, row));
            let cpu = CpuBackend;
            let a = cpu.forward(&plain, q.view(), k.view(), v.view()).unwrap();
            let b = cpu.forward(&paged, q.view(), kp.view(), vp.view()).unwrap();
            assert_eq!(a.out, b.out);
            assert_eq!(a.lse, b.lse);
            let g = BackwardInputs { out: a.out.view(), lse: &a.lse, dout: dout.view(), deterministic: true };
            let ga = cpu.backward(&plain, q.view(), k.view(), v.view(), g).unwrap();
            let gb = cpu.backward(&paged, q.view(), kp.view(), vp.view(), g).unwrap();
            assert_eq!(ga.dq, gb.dq);
            assert_eq!(paged_layout(&ga.dk, &table, row), gb.dk);
            assert_eq!(paged_layout(&ga.dv, &table, row), gb.dv);
        }
    }
}

#[test]
fn kv_block_table_is_validated() {
    let spec = |tk: usize, kr: [i32; 2]| grouped_ranges_spec(&[[0, 8]], &[kr], 8, tk, 2, 1, 64, DType::F16, true);
    let msg = |r: Result<AttnSpec, Error>| match r {
        Err(Error::InvalidArgument { arg, msg }) => format!("{arg}: {msg}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    assert!(msg(spec(100, [0, 100]).with_kv_block_table(&[0, 1])).contains("multiple of 64, got 100"));
    assert!(msg(spec(128, [0, 128]).with_kv_block_table(&[0])).contains("has 1 entries; k's 128 rows are 2 blocks"));
    assert!(msg(spec(128, [0, 128]).with_kv_block_table(&[0, 2])).contains("kv_block_table[1] = 2 is outside 0..2"));
    assert!(msg(spec(128, [0, 128]).with_kv_block_table(&[0, -1])).contains("kv_block_table[1] = -1"));
    assert!(msg(spec(128, [0, 128]).with_kv_block_table(&[1, 1])).contains("kv_block_table[1] = 1 repeats kv_block_table[0]"));
    assert!(msg(spec(128, [32, 128]).with_kv_block_table(&[1, 0])).contains("kv_ranges 0 starts at 32"));
    let windowed = spec(128, [0, 128]).with_window(16, 0).unwrap();
    assert!(msg(windowed.with_kv_block_table(&[1, 0])).starts_with("window_size"));
    let paged = spec(128, [0, 128]).with_kv_block_table(&[1, 0]).unwrap();
    assert!(msg(paged.clone().with_window(16, 0)).starts_with("window_size"));
    // block-sparse calls read K,V by logical key: a paged spec is refused, not read unpaged
    let m = meta(128, 1, 64, DType::F16);
    let varlen = AttnSpec::varlen(&meta(64, 2, 64, DType::F16), &m, &m, &[0, 64], &[0, 128], 64, 128, None, false)
        .unwrap()
        .with_kv_block_table(&[1, 0])
        .unwrap();
    assert!(msg(varlen.clone().with_block_index(&[0, 1, 0, 1], &[1, 2, 1, 2], 64, 64, None)).starts_with("kv_block_table: block-sparse"));
    assert_eq!(paged.kv_row(0), 64);
    assert_eq!(paged.kv_row(127), 63);
}
