//! Zigzag extract / scatter on CUDA (`kernels::zigzag_copy`) against the CPU row copies
//! (`cubeattn::zigzag::{extract, scatter}`, themselves checked against plain slicing in
//! tests/python/test_zigzag.py): byte for byte, on random bytes (every bit pattern, NaN payloads
//! included), for W = 1..4, one and several sequences (one of them empty), every chunk prefix, and
//! row lengths that take each copy width (16, 8, 4, 2, 1 bytes). The host path fills the device
//! output with 0xFF bytes first, so a row the kernel does not write is a mismatch.

use cubeattn::backend::cuda::ZigzagCopy;
use cubeattn::zigzag::{extract, gathered_rows, scatter};
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
        let base: [&[usize]; 2] = [&[1536], &[512, 0, 1024, 768]];
        for lens in base {
            let lens: Vec<usize> = lens.iter().map(|n| n - n % (2 * w)).collect();
            let cu = cu_of(&lens);
            let total = cu[cu.len() - 1] as usize;
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
    let e = b.zigzag_copy_host(ZigzagCopy::Extract, &cu_of(&[18]), 2, 3, &[0u8; 18 * 4], 4).unwrap_err();
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
