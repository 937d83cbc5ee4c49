//! Dispatch of block-sparse calls. Forward: the CUDA kernel (`cuda::sparse`: the dense forward
//! kernel iterating a block list) for f16/bf16, head_dim 64/128, exact QK^T; the CPU for the rest
//! (f32, INT8 QK^T, other head dims) when the device is `auto`, an `Unsupported` error when it is
//! `cuda`. Backward: the CPU (`cuda` is refused with `Unsupported`).
//!
//! What the CUDA backward needs (not built yet): the dQ pass (`flash_bwd_dq`, 64-row cubes =
//! `q_block`) with the same block list replacing its key-tile loop; dK/dV (`flash_bwd_dkdv`,
//! 64-key cubes) with the transposed index ([`crate::sparse::SparseSpec::transposed`]: per key
//! block the query blocks listing it, ascending) replacing its loop over query tiles, built on the
//! GPU with a count / exclusive-scan / ordered-fill pass so the summation order stays fixed.

use super::{check_backward_buffers, check_buffers, BackendKind, BackwardInputs, DevicePref, ForwardOutput, Gradients};
use crate::dtype::HostView;
use crate::error::{invalid, Error, Result};
use crate::sparse::SparseSpec;

/// Where a block-sparse forward runs.
enum FwdTarget {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(&'static super::cuda::CudaBackend),
}

fn forward_target(pref: DevicePref, spec: &SparseSpec) -> Result<FwdTarget> {
    #[cfg(feature = "cuda")]
    {
        use super::cuda::{sparse_supported, CudaBackend};
        match pref {
            DevicePref::Cpu => Ok(FwdTarget::Cpu),
            DevicePref::Cuda(i) => {
                let be = CudaBackend::on(i)?;
                sparse_supported(spec)?;
                Ok(FwdTarget::Cuda(be))
            }
            DevicePref::Auto(i) => Ok(match CudaBackend::on(i) {
                Ok(be) if sparse_supported(spec).is_ok() => FwdTarget::Cuda(be),
                _ => FwdTarget::Cpu,
            }),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = spec;
        match pref {
            DevicePref::Cpu | DevicePref::Auto(_) => Ok(FwdTarget::Cpu),
            DevicePref::Cuda(_) => Err(Error::BackendUnavailable { backend: "cuda", reason: "this build of cubeattn has no `cuda` feature".into() }),
        }
    }
}

/// The backend a block-sparse forward of `spec` runs on (errors: `cuda` that cannot serve it).
pub fn sparse_forward_backend(pref: DevicePref, spec: &SparseSpec) -> Result<BackendKind> {
    Ok(match forward_target(pref, spec)? {
        FwdTarget::Cpu => BackendKind::Cpu,
        #[cfg(feature = "cuda")]
        FwdTarget::Cuda(_) => BackendKind::Cuda,
    })
}

/// The backend a block-sparse backward runs on.
pub fn sparse_backward_backend(pref: DevicePref) -> Result<BackendKind> {
    match pref {
        DevicePref::Cpu | DevicePref::Auto(_) => Ok(BackendKind::Cpu),
        DevicePref::Cuda(_) => Err(Error::Unsupported {
            backend: "cuda",
            msg: "the block-sparse backward has no CUDA kernel yet (the forward has one); use device=\"cpu\" or \"auto\" \
                  for the backward"
                .into(),
        }),
    }
}

/// Block-sparse forward on the backend `pref` picks: (out, lse) and which backend ran.
pub fn sparse_forward(pref: DevicePref, spec: &SparseSpec, q: HostView, k: HostView, v: HostView) -> Result<(ForwardOutput, BackendKind)> {
    check_buffers(&spec.attn, q, k, v)?;
    match forward_target(pref, spec)? {
        FwdTarget::Cpu => Ok((super::cpu::sparse::forward(spec, q, k, v), BackendKind::Cpu)),
        #[cfg(feature = "cuda")]
        FwdTarget::Cuda(be) => Ok((be.sparse_forward_host(spec, q, k, v, None)?, BackendKind::Cuda)),
    }
}

/// The CUDA backend that runs a block-sparse forward of `spec` on device-resident buffers, or
/// `None` where `pref` picks the CPU (`auto` with an unsupported spec).
#[cfg(feature = "cuda")]
pub fn sparse_forward_cuda(pref: DevicePref, spec: &SparseSpec) -> Result<Option<&'static super::cuda::CudaBackend>> {
    Ok(match forward_target(pref, spec)? {
        FwdTarget::Cpu => None,
        FwdTarget::Cuda(be) => Some(be),
    })
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
    let kind = sparse_backward_backend(pref)?;
    if spec.int8.is_some() {
        return Err(invalid("qk_int8", "the INT8 QK^T option is forward-only (inference); the backward needs qk_int8=False"));
    }
    check_buffers(&spec.attn, q, k, v)?;
    check_backward_buffers(&spec.attn, &grad)?;
    Ok((super::cpu::sparse::backward(spec, q, k, v, grad), kind))
}
