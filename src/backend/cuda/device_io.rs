//! Device-resident inputs and outputs: caller-owned buffers on the backend's GPU (torch CUDA
//! tensors, given as raw device addresses) are copied device-to-device into CubeCL buffers, the
//! same kernels run, and the results are copied device-to-device into the caller's output
//! buffers. No host round trip. CubeCL, torch and these copies all use the device's primary
//! context, so the addresses are valid in each.
//!
//! Ordering: the caller finishes writing the inputs before the call (torch: synchronize); the
//! copies in are followed by a context synchronize before the kernels start, the kernels by a
//! CubeCL sync before the copies out, and the copies out by a context synchronize before return.

use cubecl::server::Handle;

use super::backward::{fused_dq, plan_and_launch_backward, BwdBuffers, DqPath};
use super::bench::sync;
use super::{check_supported, guarded, plan_and_launch_forward, CudaBackend};
use crate::error::{Error, Result};
use crate::spec::AttnSpec;

/// Device addresses of one forward call's buffers (contiguous, in the spec's dtype; lse f32
/// `[heads_q, total_q]`).
#[derive(Debug, Clone, Copy)]
pub struct DeviceForward {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub out: u64,
    pub lse: u64,
}

/// Device addresses of one backward call's buffers (inputs, then the gradients it writes).
#[derive(Debug, Clone, Copy)]
pub struct DeviceBackward {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub out: u64,
    pub lse: u64,
    pub dout: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
}

fn dev_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Device(format!("{what}: {e:?}"))
}

impl CudaBackend {
    /// Makes the device's primary context current on this thread (the copies need it).
    fn bind(&self) -> Result<()> {
        // SAFETY: `ctx` was returned by cuDevicePrimaryCtxRetain and is never released.
        unsafe { cudarc::driver::result::ctx::set_current(self.ctx as cudarc::driver::sys::CUcontext) }
            .map_err(|e| dev_err("cuCtxSetCurrent", e))
    }

    /// A CubeCL buffer of `bytes` (at least 4) and its device address. The returned resource keeps
    /// the allocation reserved while it is alive.
    fn staged(&self, bytes: usize) -> Result<(Handle, u64, impl Sized + use<>)> {
        let h = self.client.empty(bytes.max(4));
        let r = self.client.get_resource(h.clone()).map_err(|e| dev_err("CubeCL buffer address", e))?;
        let ptr = r.resource().ptr;
        Ok((h, ptr, r))
    }

    /// `bytes` from `src` to `dst` (device addresses of this GPU).
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are live device allocations of at least `bytes` on this device
        // (CubeCL's buffers by construction, the caller's by the contract of the public methods).
        unsafe { cudarc::driver::result::memcpy_dtod_sync(dst, src, bytes) }.map_err(|e| dev_err("cuMemcpyDtoD", e))
    }

    fn ctx_sync(&self) -> Result<()> {
        cudarc::driver::result::ctx::synchronize().map_err(|e| dev_err("cuCtxSynchronize", e))
    }

    /// Forward on device buffers. Returns `Ok(false)` without touching anything when the call has
    /// no query row or no key (the host path handles those).
    ///
    /// # Safety
    /// Every address must point to a live allocation on this backend's device holding (inputs)
    /// or able to hold (outputs) the contiguous tensor of the spec's shape and dtype, and nothing
    /// else may write the inputs or touch the outputs during the call.
    pub unsafe fn forward_device(&self, spec: &AttnSpec, p: DeviceForward) -> Result<bool> {
        check_supported(spec)?;
        let d = &spec.dims;
        if d.total_q == 0 || d.total_k == 0 || d.heads_q == 0 {
            return Ok(false);
        }
        let es = spec.dtype.size();
        let run = guarded("CubeCL launch", || -> Result<()> {
            let mut tr = Trace::new("forward");
            let (qh, qp, _qr) = self.staged(d.q_len() * es)?;
            let (kh, kp, _kr) = self.staged(d.kv_len() * es)?;
            let (vh, vp, _vr) = self.staged(d.kv_len() * es)?;
            let (oh, op, _or) = self.staged(d.q_len() * es)?;
            let (lh, lp, _lr) = self.staged(d.lse_len() * 4)?;
            tr.mark("buffers");
            self.bind()?;
            self.copy(qp, p.q, d.q_len() * es)?;
            self.copy(kp, p.k, d.kv_len() * es)?;
            self.copy(vp, p.v, d.kv_len() * es)?;
            self.ctx_sync()?;
            tr.mark("copy in");
            plan_and_launch_forward(&self.client, spec, [&qh, &kh, &vh], &oh, &lh)?;
            tr.mark("plan + launch");
            sync(&self.client)?;
            tr.mark("kernels");
            self.bind()?;
            self.copy(p.out, op, d.q_len() * es)?;
            self.copy(p.lse, lp, d.lse_len() * 4)?;
            self.ctx_sync()?;
            tr.mark("copy out");
            Ok(())
        });
        run.map_err(Error::Device)??;
        Ok(true)
    }

    /// Backward on device buffers (see [`CudaBackend::forward_device`] for the contract and the
    /// `Ok(false)` case).
    ///
    /// # Safety
    /// As for [`CudaBackend::forward_device`].
    pub unsafe fn backward_device(&self, spec: &AttnSpec, p: DeviceBackward, deterministic: bool) -> Result<bool> {
        check_supported(spec)?;
        let d = &spec.dims;
        if d.total_q == 0 || d.total_k == 0 || d.heads_q == 0 {
            return Ok(false);
        }
        let es = spec.dtype.size();
        let fused = fused_dq(spec, deterministic, DqPath::Auto);
        let run = guarded("CubeCL launch", || -> Result<()> {
            let mut tr = Trace::new("backward");
            let (q, qp, _a) = self.staged(d.q_len() * es)?;
            let (k, kp, _b) = self.staged(d.kv_len() * es)?;
            let (v, vp, _c) = self.staged(d.kv_len() * es)?;
            let (out, op, _d) = self.staged(d.q_len() * es)?;
            let (dout, gp, _e) = self.staged(d.q_len() * es)?;
            let (lse, lp, _f) = self.staged(d.lse_len() * 4)?;
            let (dq, dqp, _g) = self.staged(d.q_len() * es)?;
            let (dk, dkp, _h) = self.staged(d.kv_len() * es)?;
            let (dv, dvp, _i) = self.staged(d.kv_len() * es)?;
            tr.mark("buffers");
            self.bind()?;
            for (dst, src, n) in [
                (qp, p.q, d.q_len() * es),
                (kp, p.k, d.kv_len() * es),
                (vp, p.v, d.kv_len() * es),
                (op, p.out, d.q_len() * es),
                (gp, p.dout, d.q_len() * es),
                (lp, p.lse, d.lse_len() * 4),
            ] {
                self.copy(dst, src, n)?;
            }
            self.ctx_sync()?;
            tr.mark("copy in");
            let bufs = BwdBuffers {
                q,
                k,
                v,
                out,
                dout,
                lse,
                delta: self.client.empty(d.lse_len() * 4),
                dq,
                dk,
                dv,
                dq_acc: fused.then(|| self.client.empty(d.q_len() * 4)),
            };
            plan_and_launch_backward(&self.client, spec, &bufs)?;
            tr.mark("plan + launch");
            sync(&self.client)?;
            tr.mark("kernels");
            self.bind()?;
            self.copy(p.dq, dqp, d.q_len() * es)?;
            self.copy(p.dk, dkp, d.kv_len() * es)?;
            self.copy(p.dv, dvp, d.kv_len() * es)?;
            self.ctx_sync()?;
            tr.mark("copy out");
            Ok(())
        });
        run.map_err(Error::Device)??;
        Ok(true)
    }
}

/// Phase timings of a device call on stderr when `CUBEATTN_TRACE=1` (host clock, microseconds).
struct Trace {
    on: bool,
    what: &'static str,
    last: std::time::Instant,
    parts: Vec<(&'static str, u128)>,
}

impl Trace {
    fn new(what: &'static str) -> Trace {
        let on = std::env::var("CUBEATTN_TRACE").is_ok_and(|v| v == "1");
        Trace { on, what, last: std::time::Instant::now(), parts: Vec::new() }
    }

    fn mark(&mut self, phase: &'static str) {
        if self.on {
            let now = std::time::Instant::now();
            self.parts.push((phase, (now - self.last).as_micros()));
            self.last = now;
        }
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        if self.on {
            let parts: Vec<String> = self.parts.iter().map(|(p, us)| format!("{p} {us}")).collect();
            eprintln!("cubeattn {} us: {}", self.what, parts.join(", "));
        }
    }
}
