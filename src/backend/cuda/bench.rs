//! Benchmarks of the CUDA backend (not a call path): GPU time of the kernels of one spec on
//! device-resident random inputs, on the backend's own stream, through the same device calls as
//! torch's ([`Backend::forward_device`], [`CudaBackend::backward_device_on`]). The Python
//! bindings `cuda_bench_forward` / `cuda_bench_forward_backward` and the GPU tests' timings use it.

use half::{bf16, f16};

use super::backward::{bwd_workspace, dq_mode, BwdPtrs, DqPath};
use super::device_io::has_work;
use super::driver::{bind, DevBuf, Timer};
use super::forward::FwdPtrs;
use super::{check_supported, CudaBackend};
use crate::backend::{Backend, Pass};
use crate::dtype::{DType, HostData};
use crate::error::{invalid, Result};
use crate::spec::AttnSpec;

/// Deterministic pseudo-random values in [-1, 1) (SplitMix64), so benchmarks never run on zeros.
fn random_f32(n: usize, seed: u64) -> Vec<f32> {
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

/// What a benchmark times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchPart {
    /// The forward kernels.
    Forward,
    /// Forward then backward (the forward's out and lse feed the backward), like torch's fwd+bwd.
    ForwardBackward,
    /// The backward kernels alone.
    Backward,
}

/// GPU time of the kernels of `spec` on device-resident random inputs (never zeros): `warmup`
/// untimed iterations, then `iters` iterations each timed with CUDA events around the kernels
/// (the kernels' own GPU time). Milliseconds per iteration. Backward parts take `path`
/// (`DqPath::Auto` as a `deterministic = false` call). FLOPs to quote for fwd+bwd: 3.5 x
/// `spec.forward_flops()`.
pub fn bench(spec: &AttnSpec, warmup: usize, iters: usize, part: BenchPart, path: DqPath) -> Result<Vec<f64>> {
    let be = CudaBackend::shared()?;
    check_supported(spec, Pass::Forward)?;
    if super::head_pad::padded(spec, Pass::Forward, super::head_pad::wgmma_padding(Some(be), spec)).is_some() {
        let d = &spec.dims;
        let v = if d.is_uniform() { String::new() } else { format!(" (v: {})", d.head_dim_v) };
        return Err(invalid("spec", format!("the kernel benchmark runs the kernels' own head dims, not head_dim {}{v}", d.head_dim)));
    }
    if !has_work(spec) {
        return Err(invalid("spec", "benchmark needs at least one query, key and head"));
    }
    let d = &spec.dims;
    let _g = be.host_lock.lock().unwrap_or_else(|e| e.into_inner());
    bind(be.ctx)?;
    let s = be.stream.0;
    let es = spec.dtype.size();
    let rnd = |n: usize, seed: u64| -> Result<DevBuf> {
        let h = match spec.dtype {
            DType::F32 => HostData::F32(random_f32(n, seed)),
            DType::F16 => HostData::F16(random_f32(n, seed).into_iter().map(f16::from_f32).collect()),
            DType::BF16 => HostData::BF16(random_f32(n, seed).into_iter().map(bf16::from_f32).collect()),
        };
        let b = DevBuf::alloc(n * es)?;
        b.upload(h.view().as_bytes(), s)?;
        be.stream.sync()?;
        Ok(b)
    };
    let (q, k, v, dout) = (rnd(d.q_len(), 11)?, rnd(d.kv_len(), 12)?, rnd(d.kv_len(), 13)?, rnd(d.q_len(), 14)?);
    let out = DevBuf::alloc(d.q_len() * es)?;
    let lse = DevBuf::alloc(d.lse_len() * 4)?;
    let (dq, dk, dv) = (DevBuf::alloc(d.q_len() * es)?, DevBuf::alloc(d.kv_len() * es)?, DevBuf::alloc(d.kv_len() * es)?);
    // SAFETY: every buffer above holds its tensor of the spec; the stream is synchronized (timer
    // reads and the final sync) before they are freed.
    unsafe {
        let fws = DevBuf::alloc(be.forward_workspace(spec, s as u64)?)?;
        // a forward-only timing needs no backward workspace (nor a head_dim the backward serves)
        let bws_n = if part == BenchPart::Forward {
            0
        } else {
            be.backward_workspace(spec, false, s as u64)?.max(bwd_workspace(spec, dq_mode(Some(be), spec, false, path)))
        };
        let bws = DevBuf::alloc(bws_n)?;
        let fp = FwdPtrs { q: q.ptr, k: k.ptr, v: v.ptr, out: out.ptr, lse: lse.ptr, workspace: fws.ptr };
        let bp = BwdPtrs {
            q: q.ptr,
            k: k.ptr,
            v: v.ptr,
            out: out.ptr,
            lse: lse.ptr,
            dout: dout.ptr,
            dq: dq.ptr,
            dk: dk.ptr,
            dv: dv.ptr,
            workspace: bws.ptr,
        };
        let fwd = || be.forward_device(spec, fp, fws.bytes, s as u64).map(|_| ());
        let bwd = || be.backward_device_on(spec, bp, path, false, bws.bytes, s as u64).map(|_| ());
        let step = || -> Result<()> {
            match part {
                BenchPart::Forward => fwd(),
                BenchPart::ForwardBackward => {
                    fwd()?;
                    bwd()
                }
                BenchPart::Backward => bwd(),
            }
        };
        fwd()?;
        for _ in 0..warmup {
            step()?;
        }
        let timer = Timer::new()?;
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            timer.start(s)?;
            step()?;
            timer.stop(s)?;
            times.push(timer.ms()?);
        }
        be.stream.sync()?;
        Ok(times)
    }
}

/// GPU time (ms per iteration, CUDA events) of forward + backward on device-resident random
/// inputs, default path (`deterministic = false`). FLOPs to quote: 3.5 x `spec.forward_flops()`.
pub fn bench_backward(spec: &AttnSpec, warmup: usize, iters: usize) -> Result<Vec<f64>> {
    bench(spec, warmup, iters, BenchPart::ForwardBackward, DqPath::Auto)
}
