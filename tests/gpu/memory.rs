//! VRAM: `cubeattn::vram::estimate_spec` against what the card loses during a call, as the driver
//! reports it (free memory before the call minus the smallest free memory seen inside it, where
//! every buffer of the call is allocated), and no growth over repeated calls. The kernels of each
//! shape are loaded by a first call; the measured call is the second (module code and the
//! driver's local-memory reservation are per process, not per call: printed for the first).

use cubeattn::backend::cuda::{memory_probe_min_free, set_memory_probe, CudaBackend};
use cubeattn::backend::{Backend, BackwardInputs};
use cubeattn::vram::estimate_spec;
use cubeattn::{AttnSpec, DType, HostData, TensorMeta};
use super::backend;

fn varlen(s: usize, hq: usize, hkv: usize, causal: bool) -> AttnSpec {
    let q = TensorMeta::new(&[s, hq, 128], DType::BF16);
    let k = TensorMeta::new(&[s, hkv, 128], DType::BF16);
    let cu = [0, s as i32];
    AttnSpec::varlen(&q, &k, &k, &cu, &cu, s, s, None, causal).unwrap()
}

fn zigzag(t: usize, w: usize, r: usize) -> AttnSpec {
    let c = t / (2 * w);
    let q = TensorMeta::new(&[2 * c, 32, 128], DType::BF16);
    let k = TensorMeta::new(&[t, 8, 128], DType::BF16);
    let qr = [[0, c as i32], [c as i32, 2 * c as i32]];
    let kr = [[0, ((r + 1) * c) as i32], [0, ((2 * w - r) * c) as i32]];
    AttnSpec::grouped(&q, &k, &k, &qr, &kr, None, true).unwrap()
}

fn data(n: usize, seed: u32) -> HostData {
    let xs: Vec<f32> = (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f32 / 1000.0 - 1.0).collect();
    HostData::from_f32(DType::BF16, &xs)
}

/// Bytes the card lost during `f` (driver-reported free memory).
fn lost(b: &CudaBackend, f: impl FnOnce()) -> u64 {
    let (free0, _) = b.mem_info().expect("cuMemGetInfo");
    set_memory_probe(true);
    f();
    let min_free = memory_probe_min_free();
    set_memory_probe(false);
    assert!(min_free != u64::MAX, "the memory probe recorded nothing");
    free0.saturating_sub(min_free)
}

fn check(what: &str, est: u64, lost: u64) {
    let err = (est as f64 - lost as f64).abs() / lost.max(1) as f64;
    println!("{what}: estimate {est} B, card lost {lost} B (error {:.1}%)", err * 100.0);
    assert!(err <= 0.10, "{what}: VRAM estimate off by {:.1}% of what the card lost", err * 100.0);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn vram_estimate_within_10_percent_of_driver_reported() {
    let Some(b) = backend() else { return };
    let specs = [varlen(8192, 32, 8, true), varlen(16384, 32, 8, true), varlen(8192, 64, 8, false), zigzag(65536, 8, 0)];
    for sp in &specs {
        let name = format!("{:?} tq={} tk={} heads={}/{} causal={}", sp.layout, sp.dims.total_q, sp.dims.total_k, sp.dims.heads_q, sp.dims.heads_kv, sp.causal);
        let (q, k, v) = (data(sp.dims.q_len(), 1), data(sp.dims.kv_len(), 2), data(sp.dims.kv_len(), 3));
        let first = lost(b, || {
            b.forward(sp, q.view(), k.view(), v.view()).unwrap();
        });
        let mut fwd = None;
        let second = lost(b, || fwd = Some(b.forward(sp, q.view(), k.view(), v.view()).unwrap()));
        println!("forward  {name}: first call in the process lost {first} B");
        check(&format!("forward  {name}"), estimate_spec(sp, false, true).total, second);
        let fwd = fwd.unwrap();
        let dout = data(sp.dims.q_len(), 4);
        for deterministic in [true, false] {
            let g = BackwardInputs { out: fwd.out.view(), lse: &fwd.lse, dout: dout.view(), deterministic };
            b.backward(sp, q.view(), k.view(), v.view(), g).unwrap();
            let l = lost(b, || {
                b.backward(sp, q.view(), k.view(), v.view(), g).unwrap();
            });
            check(&format!("backward {name} deterministic={deterministic}"), estimate_spec(sp, true, deterministic).total, l);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-test.sh test runs it (--include-ignored)"]
fn repeated_calls_do_not_grow_device_memory() {
    let Some(b) = backend() else { return };
    let sp = varlen(4096, 32, 8, true);
    let (q, k, v) = (data(sp.dims.q_len(), 5), data(sp.dims.kv_len(), 6), data(sp.dims.kv_len(), 7));
    let first = b.forward(&sp, q.view(), k.view(), v.view()).unwrap();
    let (f1, _) = b.mem_info().unwrap();
    for _ in 0..20 {
        let again = b.forward(&sp, q.view(), k.view(), v.view()).unwrap();
        assert_eq!(again.out, first.out, "repeated forward differs");
    }
    let (f2, _) = b.mem_info().unwrap();
    println!("free after 1 call: {f1} B; after 21 calls: {f2} B");
    assert!(f2 + (4 << 20) >= f1, "free device memory fell from {f1} to {f2}");
}
