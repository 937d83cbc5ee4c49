//! Zigzag extract / scatter on CUDA (`kernels::zigzag_copy`) against the CPU row copies
//! (`cubeattn::zigzag::{extract, scatter}`, themselves checked against plain slicing in
//! tests/python/test_zigzag.py): byte for byte, on random bytes (every bit pattern, NaN payloads
//! included), for W = 1..4, one and several sequences (one of them empty; lengths that are not
//! multiples of 2W: uneven chunks, padded shards), every chunk prefix, and
//! row lengths that take each copy width (16, 8, 4, 2, 1 bytes). The host path fills the device
//! output with 0xFF bytes first, so a row the kernel does not write is a mismatch.

use cubeattn::backend::cuda::ZigzagCopy;
use cubeattn::zigzag::{extract, gathered_len, gathered_rows, scatter};
use cubeattn::Error;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::backend;

fn cu_of(lens: &[usize]) -> Vec<i32> {
    let mut cu = vec![0i32];
    for &n in lens {
        cu.push(cu[cu.len() - 1] + n as i32);
    }
    cu
}

fn bytes(rng: &mut StdRng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.random::<u8>()).collect()
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn zigzag_extract_and_scatter_match_the_cpu_copies_bit_for_bit() {
    let Some(b) = backend() else { return };
    let mut rng = StdRng::seed_from_u64(11);
    // row bytes: 3 heads x 64 x 2 (16-byte vectors), 8 heads x 128 x 2, 5 x 128 x 4, then rows
    // that only 8, 4, 2 or 1 bytes divide
    let row_sizes = [384usize, 2048, 2560, 24, 12, 6, 3];
    // every case runs and the mismatches are listed at the end (a dry run against the stub driver,
    // scripts/dry-run.sh, so generates and launches the kernel of every copy width)
    let mut cases = 0;
    let mut bad = Vec::new();
    for w in 1..=4usize {
        // multiples of 2W, and lengths of any size (the gathered buffer pads the shorter shards)
        let base: [&[usize]; 3] = [&[1536], &[512, 0, 1024, 768], &[13, 1, 7, 0, 1000]];
        for (i, lens) in base.into_iter().enumerate() {
            let lens: Vec<usize> = lens.iter().map(|n| if i < 2 { n - n % (2 * w) } else { *n }).collect();
            let cu = cu_of(&lens);
            let total = gathered_len(&cu, w).unwrap();
            for &rb in &row_sizes {
                let g = bytes(&mut rng, total * rb);
                let mut chunks = vec![0, w - 1, w, 2 * w - 1];
                chunks.dedup(); // W = 1: 0, 0, 1, 1
                for m in chunks {
                    let rows = gathered_rows(&cu, w, m).unwrap();
                    let want = extract(&g, rb, &rows).unwrap();
                    let got = b.zigzag_copy_host(ZigzagCopy::Extract, &cu, w, m, &g, rb).unwrap();
                    if got != want {
                        bad.push(format!("extract W={w} lens={lens:?} row_bytes={rb} max_chunk={m}"));
                    }
                    let grad = bytes(&mut rng, rows.len() * rb);
                    let want = scatter(&grad, rb, &rows, total).unwrap();
                    let got = b.zigzag_copy_host(ZigzagCopy::Scatter, &cu, w, m, &grad, rb).unwrap();
                    if got != want {
                        bad.push(format!("scatter W={w} lens={lens:?} row_bytes={rb} max_chunk={m}"));
                    }
                    cases += 2;
                }
            }
        }
    }
    assert!(bad.is_empty(), "{} of {cases} zigzag copies differ from the CPU ones: {:#?}", bad.len(), &bad[..bad.len().min(10)]);
    println!("{cases} zigzag copies identical to the CPU ones");
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn zigzag_copies_of_empty_sequences_write_nothing() {
    let Some(b) = backend() else { return };
    let cu = cu_of(&[0, 0]);
    for m in [0, 3] {
        assert!(b.zigzag_copy_host(ZigzagCopy::Extract, &cu, 2, m, &[], 384).unwrap().is_empty());
        assert!(b.zigzag_copy_host(ZigzagCopy::Scatter, &cu, 2, m, &[], 384).unwrap().is_empty());
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn zigzag_copy_errors_name_the_argument() {
    let Some(b) = backend() else { return };
    let cu = cu_of(&[16]);
    let name = |e: Error| match e {
        Error::InvalidArgument { arg, .. } => arg,
        other => panic!("expected InvalidArgument, got {other}"),
    };
    let e = b.zigzag_copy_host(ZigzagCopy::Extract, &cu, 2, 3, &[0u8; 12 * 4], 4).unwrap_err();
    assert_eq!(name(e), "kv");
    let e = b.zigzag_copy_host(ZigzagCopy::Scatter, &cu, 2, 1, &[0u8; 5 * 4], 4).unwrap_err();
    assert_eq!(name(e), "grad");
    let e = b.zigzag_copy_host(ZigzagCopy::Extract, &[0, 8, 4], 2, 3, &[0u8; 8 * 4], 4).unwrap_err();
    assert_eq!(name(e), "cu_seqlens");
    let e = b.zigzag_copy_host(ZigzagCopy::Extract, &cu, 2, 4, &[0u8; 16 * 4], 4).unwrap_err();
    assert_eq!(name(e), "max_chunk_idx");
    let e = b.zigzag_copy_host(ZigzagCopy::Extract, &cu, 0, 0, &[0u8; 16 * 4], 4).unwrap_err();
    assert_eq!(name(e), "world_size");
    // a wrong output size is refused before any kernel is launched
    // SAFETY: the call fails on the row counts before a launch (the null addresses are never
    // read); only the row maps are uploaded, on the legacy stream.
    let e = unsafe { b.zigzag_copy_device(ZigzagCopy::Extract, &cu, 2, 1, 0, 16, 0, 7, 4, 0) }.unwrap_err();
    assert_eq!(name(e), "out");
}

/// The zigzag layer's in-place read: a grouped call over a paged K,V (`kv_block_table`, the
/// gathered buffer's block order) gives bit for bit the outputs, LSE and gradients of the same call
/// over K,V in logical order (dK, dV in the paged layout), with NaN-poisoned outputs (every element
/// written): W = 2 and 3 zigzag groups of two sequences, f16 / bf16 / f32, d64 / d128, causal and
/// not, both dQ paths (the fused path's dQ is summed by atomics in any order: compared to the
/// pass's within 1e-2 relative), and a v with an Inf (the exact forward kernel).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn paged_kv_is_bitwise_the_ordered_call() {
    use cubeattn::backend::cuda::backward::DqPath;
    use cubeattn::backend::BackwardInputs;
    use cubeattn::{AttnSpec, DType, TensorMeta};
    let Some(b) = backend() else { return };
    let mut rng = StdRng::seed_from_u64(12);
    let mut bad = Vec::new();
    let mut cases = 0;
    for (w, lens) in [(2usize, [512usize, 256]), (3, [768, 384])] {
        // rank 1's groups: chunks 1 and 2W-2 of each sequence over their causal prefixes
        let (mut qr, mut kr, mut gathered) = (Vec::new(), Vec::new(), Vec::new());
        let (mut q0, mut k0) = (0i32, 0i32);
        for &n in &lens {
            let c = (n / (2 * w)) as i32;
            qr.push([q0, q0 + c]);
            kr.push([k0, k0 + 2 * c]);
            qr.push([q0 + c, q0 + 2 * c]);
            kr.push([k0, k0 + (2 * w as i32 - 1) * c]);
            q0 += 2 * c;
            k0 += n as i32;
        }
        let tk = k0 as usize;
        for r in 0..w {
            for (s, &n) in lens.iter().enumerate() {
                let c = n / (2 * w);
                let start: usize = lens[..s].iter().sum();
                for chunk in [r, 2 * w - 1 - r] {
                    gathered.extend((0..c / 64).map(|i| ((start + chunk * c) / 64 + i) as i32));
                }
            }
        }
        // gathered[p] = logical block at physical block p; the table is its inverse
        let mut table = vec![0i32; gathered.len()];
        for (p, &g) in gathered.iter().enumerate() {
            table[g as usize] = p as i32;
        }
        for dt in [DType::BF16, DType::F16, DType::F32] {
            for d in [64usize, 128] {
                for causal in [true, false] {
                    let (hq, hk) = (4, 2);
                    let tq = q0 as usize;
                    let m = |t: usize, h: usize| TensorMeta::new(&[t, h, d], dt);
                    let plain = AttnSpec::grouped(&m(tq, hq), &m(tk, hk), &m(tk, hk), &qr, &kr, None, causal).unwrap();
                    let paged = plain.clone().with_kv_block_table(&table).unwrap();
                    let q = super::random(tq * hq * d, dt, 1.0, &mut rng);
                    let k = super::random(tk * hk * d, dt, 1.0, &mut rng);
                    let mut v = super::random(tk * hk * d, dt, 1.0, &mut rng);
                    let dout = super::random(tq * hq * d, dt, 1.0, &mut rng);
                    for inf in [false, true] {
                        if inf {
                            // one Inf in v (logical key 70): the exact forward kernel writes the call
                            let mut xs = v.to_f32_vec();
                            xs[(70 * hk + 1) * d + 3] = f32::INFINITY;
                            v = cubeattn::HostData::from_f32(dt, &xs);
                        }
                        let row = hk * d;
                        let (kp, vp) = (crate::common::paged_layout(&k, &table, row), crate::common::paged_layout(&v, &table, row));
                        let tag = format!("W={w} {dt:?} d={d} causal={causal} inf={inf}");
                        cases += 1;
                        let a = b.forward_poisoned(&plain, q.view(), k.view(), v.view(), f32::NAN).unwrap();
                        let p = b.forward_poisoned(&paged, q.view(), kp.view(), vp.view(), f32::NAN).unwrap();
                        if a.out != p.out || a.lse.iter().map(|x| x.to_bits()).ne(p.lse.iter().map(|x| x.to_bits())) {
                            bad.push(format!("forward {tag}"));
                        }
                        if inf {
                            continue;
                        }
                        let mut dq_pass = None;
                        for path in [DqPath::Pass, DqPath::Atomic] {
                            if dt == DType::F32 && path == DqPath::Atomic {
                                continue;
                            }
                            let gi = BackwardInputs { out: a.out.view(), lse: &a.lse, dout: dout.view(), deterministic: path == DqPath::Pass };
                            let ga = b.backward_poisoned_on(&plain, q.view(), k.view(), v.view(), gi, f32::NAN, path).unwrap();
                            let gp = b.backward_poisoned_on(&paged, q.view(), kp.view(), vp.view(), gi, f32::NAN, path).unwrap();
                            if crate::common::paged_layout(&ga.dk, &table, row) != gp.dk || crate::common::paged_layout(&ga.dv, &table, row) != gp.dv {
                                bad.push(format!("dk/dv {tag} {path:?}"));
                            }
                            match path {
                                DqPath::Pass => {
                                    if ga.dq != gp.dq {
                                        bad.push(format!("dq {tag} pass"));
                                    }
                                    dq_pass = Some(ga.dq.to_f32_vec());
                                }
                                _ => {
                                    let want = dq_pass.as_ref().unwrap();
                                    let got = gp.dq.to_f32_vec();
                                    let num: f64 = got.iter().zip(want).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
                                    let den: f64 = want.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().max(1e-30);
                                    if !got.iter().all(|x| x.is_finite()) || (num / den).sqrt() > 1e-2 {
                                        bad.push(format!("dq {tag} fused: rel {:e}", (num / den).sqrt()));
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(bad.is_empty(), "{} of {cases} paged calls differ from the ordered ones: {bad:#?}", bad.len());
    println!("{cases} paged calls bitwise equal to the ordered ones");
}
