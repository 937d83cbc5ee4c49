//! VRAM: `cubeattn::vram::estimate` against what the CUDA backend really takes from the device
//! (growth of the CubeCL pool's reserved bytes over one call, from a cleaned-up pool), and no
//! growth over repeated calls.

use cubeattn::backend::cuda::CudaBackend;
use cubeattn::backend::{Backend, BackwardInputs};
use cubeattn::vram::estimate_spec;
use cubeattn::{AttnSpec, DType, Error, HostData, TensorMeta};

fn backend() -> Option<&'static CudaBackend> {
    CudaBackend::shared().map_err(|e| println!("SKIP: CUDA backend unavailable: {e}")).ok()
}

fn usage(b: &CudaBackend) -> (u64, u64) {
    let u = b.client().memory_usage().expect("memory_usage");
    (u.bytes_in_use, u.bytes_reserved)
}

fn spec(s: usize, hq: usize, hkv: usize, d: usize) -> AttnSpec {
    let q = TensorMeta::new(&[s, hq, d], DType::BF16);
    let k = TensorMeta::new(&[s, hkv, d], DType::BF16);
    let cu = [0, s as i32];
    AttnSpec::varlen(&q, &k, &k, &cu, &cu, s, s, None, true).unwrap()
}

fn data(n: usize, seed: u32) -> HostData {
    let xs: Vec<f32> = (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f32 / 1000.0 - 1.0).collect();
    HostData::from_f32(DType::BF16, &xs)
}

#[test]
fn vram_estimate_within_10_percent_of_measured() {
    let Some(b) = backend() else { return };
    for &(s, hq, hkv) in &[(8192usize, 32usize, 8usize), (16384, 32, 8), (8192, 64, 8)] {
        let sp = spec(s, hq, hkv, 128);
        let (q, k, v) = (data(sp.dims.q_len(), 1), data(sp.dims.kv_len(), 2), data(sp.dims.kv_len(), 3));
        b.client().memory_cleanup();
        let (_, r0) = usage(b);
        let fwd = b.forward(&sp, q.view(), k.view(), v.view()).unwrap();
        let (_, r1) = usage(b);
        let measured = r1.saturating_sub(r0);
        let est = estimate_spec(&sp, false, true).total;
        let err = (est as f64 - measured as f64).abs() / measured.max(1) as f64;
        println!("forward  S={s} heads={hq}/{hkv}: estimate {est} B, measured pool growth {measured} B, error {:.1}%", err * 100.0);
        assert!(err <= 0.10, "forward VRAM estimate off by {:.1}%", err * 100.0);

        let dout = data(sp.dims.q_len(), 4);
        let g = BackwardInputs { out: fwd.out.view(), lse: &fwd.lse, dout: dout.view(), deterministic: true };
        b.client().memory_cleanup();
        let (_, r0) = usage(b);
        match b.backward(&sp, q.view(), k.view(), v.view(), g) {
            Err(Error::Unsupported { msg, .. }) => println!("backward: not measured ({msg})"),
            Err(e) => panic!("backward failed: {e}"),
            Ok(_) => {
                let (_, r1) = usage(b);
                let measured = r1.saturating_sub(r0);
                let est = estimate_spec(&sp, true, true).total;
                let err = (est as f64 - measured as f64).abs() / measured.max(1) as f64;
                println!("backward S={s} heads={hq}/{hkv}: estimate {est} B, measured pool growth {measured} B, error {:.1}%", err * 100.0);
                assert!(err <= 0.10, "backward VRAM estimate off by {:.1}%", err * 100.0);
            }
        }
    }
}

#[test]
fn repeated_calls_do_not_grow_device_memory() {
    let Some(b) = backend() else { return };
    let sp = spec(4096, 32, 8, 128);
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
