//! Timing the forward kernel on device-resident data (no host copies inside the timed region).

use std::time::Instant;

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;

use super::{guarded, launch_forward, CudaBackend, Plan};
use crate::dtype::{DType, HostData};
use crate::error::{Error, Result};
use crate::spec::AttnSpec;

/// Deterministic pseudo-random values in [-1, 1) (SplitMix64), so benchmarks never run on zeros.
pub(crate) fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Waits for every queued launch of the client.
pub(crate) fn sync(client: &ComputeClient<CudaRuntime>) -> Result<()> {
    cubecl::future::block_on(client.sync()).map_err(|e| Error::Device(format!("{e:?}")))
}

/// Uploads random q, k, v for `spec` once, runs the forward kernel `warmup` times, then times
/// `iters` runs one by one (device sync before and after each, host clock). Returns the
/// milliseconds of each timed run.
pub fn bench_forward(spec: &AttnSpec, warmup: usize, iters: usize) -> Result<Vec<f64>> {
    let backend = CudaBackend::shared()?;
    super::check_supported(spec)?;
    let client = backend.client();
    let d = &spec.dims;
    let r = guarded("CubeCL benchmark", || -> Result<Vec<f64>> {
        let mk = |n: usize, seed: u64| {
            let x = random_f32(n.max(1), seed);
            let h = HostData::from_f32(spec.dtype, &x);
            client.create_from_slice(h.view().as_bytes())
        };
        let q = mk(d.q_len(), 1);
        let k = mk(d.kv_len(), 2);
        let v = mk(d.kv_len(), 3);
        let esize = if spec.dtype == DType::F32 { 4 } else { 2 };
        let out = client.empty(d.q_len().max(1) * esize);
        let lse = client.empty(d.lse_len().max(1) * 4);
        let plan = Plan::new(spec);
        let dev = plan.upload(client);
        for _ in 0..warmup {
            launch_forward(client, spec, &plan, &dev, &q, &k, &v, &out, &lse)?;
        }
        sync(client)?;
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            sync(client)?;
            let t0 = Instant::now();
            launch_forward(client, spec, &plan, &dev, &q, &k, &v, &out, &lse)?;
            sync(client)?;
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        client.read_one(lse).map_err(|e| Error::Device(format!("forward kernel failed: {e:?}")))?;
        drop(out);
        Ok(times)
    });
    match r {
        Ok(r) => r,
        Err(msg) => Err(Error::Device(msg)),
    }
}
