//! The CPU backend: always built, multi-threaded (rayon), f32 accumulation. The forward runs
//! hand-written AVX-512 register tiles (`kernel.rs`) where the CPU has AVX-512, blocked products
//! through the `gemm` crate elsewhere (and in the backward). Exact to f32 rounding against the
//! f64 reference.

mod backward;
#[cfg(target_arch = "x86_64")]
mod backward_tiles;
mod decode;
mod forward;
#[cfg(target_arch = "x86_64")]
mod kernel;
mod layout;
mod paged;
mod pool;
mod sparse;
pub(crate) mod simd;
mod value_dim;

use super::{check_backward_buffers, check_buffers, Backend, BackendKind, BackwardInputs, ForwardOutput, Gradients, Pass};
use crate::dtype::HostView;
use crate::error::Result;
use crate::spec::AttnSpec;

/// The CPU backend (stateless): every call of every key set, on host buffers.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn supports(&self, spec: &AttnSpec, pass: Pass) -> Result<()> {
        spec.check_pass(pass)
    }

    fn forward(&self, spec: &AttnSpec, q: HostView, k: HostView, v: HostView) -> Result<ForwardOutput> {
        check_buffers(spec, q, k, v)?;
        if let Some(u) = value_dim::uniform(spec) {
            // (paged and block-sparse specs have one head_dim: their builders check it)
            return Ok(value_dim::forward(spec, &u, q, k, v, |u, q, k, v| forward::forward(u, q, k, v)));
        }
        if let Some(s) = spec.block_sparse() {
            return Ok(sparse::forward(s, q, k, v));
        }
        if let Some((plain, kl, vl)) = paged::logical(spec, k, v) {
            return Ok(forward::forward(&plain, q, kl.view(), vl.view()));
        }
        Ok(forward::forward(spec, q, k, v))
    }

    fn backward(&self, spec: &AttnSpec, q: HostView, k: HostView, v: HostView, grad: BackwardInputs) -> Result<Gradients> {
        spec.check_pass(Pass::Backward { deterministic: grad.deterministic })?;
        check_buffers(spec, q, k, v)?;
        check_backward_buffers(spec, &grad)?;
        if let Some(u) = value_dim::uniform(spec) {
            return Ok(value_dim::backward(spec, &u, q, k, v, grad, |u, q, k, v, g| backward::backward(u, q, k, v, g)));
        }
        if let Some(s) = spec.block_sparse() {
            // deterministic either way (fixed order, no atomics)
            return Ok(sparse::backward(s, q, k, v, grad));
        }
        if let Some((plain, kl, vl)) = paged::logical(spec, k, v) {
            let g = backward::backward(&plain, q, kl.view(), vl.view(), grad);
            return Ok(Gradients { dq: g.dq, dk: paged::physical(spec, g.dk), dv: paged::physical(spec, g.dv) });
        }
        Ok(backward::backward(spec, q, k, v, grad))
    }

    #[cfg(feature = "cuda")]
    unsafe fn device_workspace(&self, _spec: &AttnSpec, _pass: Pass, _stream: u64) -> Result<Option<usize>> {
        Ok(None)
    }

    #[cfg(feature = "cuda")]
    unsafe fn forward_device(&self, _spec: &AttnSpec, _p: super::FwdPtrs, _workspace_bytes: usize, _stream: u64) -> Result<bool> {
        Err(host_only())
    }

    #[cfg(feature = "cuda")]
    unsafe fn backward_device(&self, _spec: &AttnSpec, _p: super::BwdPtrs, _deterministic: bool, _workspace_bytes: usize, _stream: u64) -> Result<bool> {
        Err(host_only())
    }
}

/// The CPU backend asked for a device-resident call.
#[cfg(feature = "cuda")]
fn host_only() -> crate::error::Error {
    crate::error::Error::Unsupported { backend: "cpu", msg: "the CPU backend reads host buffers only (no device_workspace)".into() }
}
