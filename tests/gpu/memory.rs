//! VRAM: `cubeattn::vram::estimate_spec` against the peak of device bytes in use during a call
//! (CubeCL's count of live allocations, sampled inside the launch where every buffer of the call
//! is alive), and no growth over repeated calls. CubeCL's pool also caches pages: that
//! reservation is printed for information (it is what the device's free memory shows), but it
//! is allocator policy, like torch's reserved vs allocated memory.

use cubeattn::backend::cuda::{memory_probe_peak, set_memory_probe, CudaBackend};
use cubeattn::backend::{Backend, BackwardInputs};
use cubeattn::vram::estimate_spec;
use cubeattn::{AttnSpec, DType, HostData, TensorMeta};

fn backend() -> Option<&'static CudaBackend> {
    CudaBackend::shared().map_err(|e| println!("SKIP: CUDA backend unavailable: {e}")).ok()
}

fn usage(b: &CudaBackend) -> (u64, u64) {
    let u = b.client().memory_usage().expect("memory_usage");
    (u.bytes_in_use, u.bytes_reserved)
}

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

fn check(what: &str, est: u64, peak: u64, reserved: u64) {
    let err = (est as f64 - peak as f64).abs() / peak.max(1) as f64;
    println!("{what}: estimate {est} B, measured peak in use {peak} B (error {:.1}%), pool reservation growth {reserved} B", err * 100.0);
    assert!(peak > 0, "{what}: the memory probe recorded nothing");
    assert!(err <= 0.10, "{what}: VRAM estimate off by {:.1}%", err * 100.0);
}

#[test]
fn vram_estimate_within_10_percent_of_measured() {
    let Some(b) = backend() else { return };
    let specs = [varlen(8192, 32, 8, true), varlen(16384, 32, 8, true), varlen(8192, 64, 8, false), zigzag(65536, 8, 0)];
    for sp in &specs {
        let name = format!("{:?} tq={} tk={} heads={}/{} causal={}", sp.layout, sp.dims.total_q, sp.dims.total_k, sp.dims.heads_q, sp.dims.heads_kv, sp.causal);
        let (q, k, v) = (data(sp.dims.q_len(), 1), data(sp.dims.kv_len(), 2), data(sp.dims.kv_len(), 3));
        b.client().memory_cleanup();
        let (_, r0) = usage(b);
        set_memory_probe(true);
        let fwd = b.forward(sp, q.view(), k.view(), v.view()).unwrap();
        let peak = memory_probe_peak();
        let (_, r1) = usage(b);
        check(&format!("forward  {name}"), estimate_spec(sp, false, true).total, peak, r1.saturating_sub(r0));

        let dout = data(sp.dims.q_len(), 4);
        for deterministic in [true, false] {
            let g = BackwardInputs { out: fwd.out.view(), lse: &fwd.lse, dout: dout.view(), deterministic };
            b.client().memory_cleanup();
            let (_, r0) = usage(b);
            set_memory_probe(true);
            b.backward(sp, q.view(), k.view(), v.view(), g).unwrap();
            let peak = memory_probe_peak();
            let (_, r1) = usage(b);
            check(&format!("backward {name} deterministic={deterministic}"), estimate_spec(sp, true, deterministic).total, peak, r1.saturating_sub(r0));
        }
        set_memory_probe(false);
    }
}

#[test]
fn repeated_calls_do_not_grow_device_memory() {
    let Some(b) = backend() else { return };
    let sp = varlen(4096, 32, 8, true);
    let (q, k, v) = (data(sp.dims.q_len(), 5), data(sp.dims.kv_len(), 6), data(sp.dims.kv_len(), 7));
    let first = b.forward(&sp, q.view(), k.view(), v.view()).unwrap();
    let (u1, r1) = usage(b);
    for _ in 0..20 {
        let again = b.forward(&sp, q.view(), k.view(), v.view()).unwrap();
        assert_eq!(again.out, first.out, "repeated forward differs");
    }
    let (u2, r2) = usage(b);
    println!("after 1 call: in use {u1} B, reserved {r1} B; after 21 calls: in use {u2} B, reserved {r2} B");
    assert!(u2 <= u1, "bytes in use grew from {u1} to {u2}");
    assert!(r2 <= r1 + (16 << 20), "reserved bytes grew from {r1} to {r2}");
}
