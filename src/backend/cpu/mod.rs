//! The CPU backend: always built, multi-threaded (rayon), f32 accumulation. The forward runs
//! hand-written AVX-512 register tiles (`kernel.rs`) where the CPU has AVX-512, blocked products
//! through the `gemm` crate elsewhere (and in the backward). Exact to f32 rounding against the
//! f64 reference.

mod backward;
#[cfg(target_arch = "x86_64")]
mod backward_tiles;
mod forward;
#[cfg(target_arch = "x86_64")]
mod kernel;
mod layout;
mod paged;
mod pool;
pub(crate) mod sparse;
pub(crate) mod simd;

use super::{check_backward_buffers, check_buffers, Backend, BackendKind, BackwardInputs, ForwardOutput, Gradients};
use crate::dtype::HostView;
use crate::error::Result;
use crate::spec::AttnSpec;

/// The CPU backend (stateless).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn forward(&self, spec: &AttnSpec, q: HostView, k: HostView, v: HostView) -> Result<ForwardOutput> {
        check_buffers(spec, q, k, v)?;
        if let Some((plain, kl, vl)) = paged::logical(spec, k, v) {
            return Ok(forward::forward(&plain, q, kl.view(), vl.view()));
        }
        Ok(forward::forward(spec, q, k, v))
    }

    fn backward(&self, spec: &AttnSpec, q: HostView, k: HostView, v: HostView, grad: BackwardInputs) -> Result<Gradients> {
        check_buffers(spec, q, k, v)?;
        check_backward_buffers(spec, &grad)?;
        if let Some((plain, kl, vl)) = paged::logical(spec, k, v) {
            let g = backward::backward(&plain, q, kl.view(), vl.view(), grad);
            return Ok(Gradients { dq: g.dq, dk: paged::physical(spec, g.dk), dv: paged::physical(spec, g.dv) });
        }
        Ok(backward::backward(spec, q, k, v, grad))
    }
}
