//! Dispatch of block-sparse calls. The CPU runs them; the CUDA backend has no block-sparse kernel
//! yet, so `cuda` / `cuda:N` is refused with [`Error::Unsupported`] and `auto` runs on the CPU.

use super::{check_backward_buffers, check_buffers, BackendKind, BackwardInputs, DevicePref, ForwardOutput, Gradients};
use crate::dtype::HostView;
use crate::error::{invalid, Error, Result};
use crate::sparse::SparseSpec;

/// The backend a block-sparse call runs on.
pub fn sparse_backend(pref: DevicePref) -> Result<BackendKind> {
    match pref {
        DevicePref::Cpu | DevicePref::Auto(_) => Ok(BackendKind::Cpu),
        DevicePref::Cuda(_) => Err(Error::Unsupported {
            backend: "cuda",
            msg: "block-sparse attention has no CUDA kernel yet (the block-sparse key-tile iterator of the \
                  forward/backward kernels is not built); use device=\"cpu\" or \"auto\""
                .into(),
        }),
    }
}

/// Block-sparse forward on the backend `pref` picks: (out, lse) and which backend ran.
pub fn sparse_forward(pref: DevicePref, spec: &SparseSpec, q: HostView, k: HostView, v: HostView) -> Result<(ForwardOutput, BackendKind)> {
    let kind = sparse_backend(pref)?;
    check_buffers(&spec.attn, q, k, v)?;
    Ok((super::cpu::sparse::forward(spec, q, k, v), kind))
}

/// Block-sparse backward (dq, dk, dv) on the backend `pref` picks. Exact QK^T only.
pub fn sparse_backward(
    pref: DevicePref,
    spec: &SparseSpec,
    q: HostView,
    k: HostView,
    v: HostView,
    grad: BackwardInputs,
) -> Result<(Gradients, BackendKind)> {
    let kind = sparse_backend(pref)?;
    if spec.int8.is_some() {
        return Err(invalid("qk_int8", "the INT8 QK^T option is forward-only (inference); the backward needs qk_int8=False"));
    }
    check_buffers(&spec.attn, q, k, v)?;
    check_backward_buffers(&spec.attn, &grad)?;
    Ok((super::cpu::sparse::backward(spec, q, k, v, grad), kind))
}
