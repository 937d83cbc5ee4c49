//! Dispatch of block-sparse calls. Forward: the CUDA kernel (`cuda::sparse`: the dense forward
//! kernel iterating a block list; INT8 Q K^T through `cuda::sparse_int8`) for f16/bf16, head_dim
//! 64/128; the CPU for the rest (f32, also with INT8 Q K^T, other head dims) when the device is
//! `auto`, an `Unsupported` error when it is `cuda`. Backward: the same rule with the CUDA backward (`cuda::sparse_bwd`: the dense backward
//! kernels with their tile iterators reading the block lists and the transposed index built on
//! the GPU); the INT8 option has no backward anywhere.

use super::{check_backward_buffers, check_buffers, BackendKind, BackwardInputs, DevicePref, ForwardOutput, Gradients};
use crate::dtype::HostView;
use crate::error::{invalid, Result};
use crate::sparse::SparseSpec;

/// Where a block-sparse call runs.
enum Target {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(&'static super::cuda::CudaBackend),
}

/// The target `pref` picks: CUDA where it serves the forward (`backward = false`) or the backward
/// of `spec`.
fn target(pref: DevicePref, spec: &SparseSpec, backward: bool) -> Result<Target> {
    #[cfg(feature = "cuda")]
    {
        use super::cuda::{sparse_bwd_supported, sparse_supported, CudaBackend};
        let supported = if backward { sparse_bwd_supported } else { sparse_supported };
        match pref {
            DevicePref::Cpu => Ok(Target::Cpu),
            DevicePref::Cuda(i) => {
                let be = CudaBackend::on(i)?;
                supported(spec)?;
                Ok(Target::Cuda(be))
            }
            DevicePref::Auto(i) => Ok(match CudaBackend::on(i) {
                Ok(be) if supported(spec).is_ok() => Target::Cuda(be),
                _ => Target::Cpu,
            }),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (spec, backward);
        match pref {
            DevicePref::Cpu | DevicePref::Auto(_) => Ok(Target::Cpu),
            DevicePref::Cuda(_) => Err(crate::error::Error::BackendUnavailable { backend: "cuda", reason: "this build of cubeattn has no `cuda` feature".into() }),
        }
    }
}

fn kind(t: &Target) -> BackendKind {
    match t {
        Target::Cpu => BackendKind::Cpu,
        #[cfg(feature = "cuda")]
        Target::Cuda(_) => BackendKind::Cuda,
    }
}

/// The backend a block-sparse forward of `spec` runs on (errors: `cuda` that cannot serve it).
pub fn sparse_forward_backend(pref: DevicePref, spec: &SparseSpec) -> Result<BackendKind> {
    Ok(kind(&target(pref, spec, false)?))
}

/// The backend a block-sparse backward of `spec` runs on (errors: the INT8 option, `cuda` that
/// cannot serve it).
pub fn sparse_backward_backend(pref: DevicePref, spec: &SparseSpec) -> Result<BackendKind> {
    check_not_int8(spec)?;
    Ok(kind(&target(pref, spec, true)?))
}

fn check_not_int8(spec: &SparseSpec) -> Result<()> {
    if spec.int8.is_some() {
        return Err(invalid("quant_gran", "the INT8 QK^T option (qk_int8) is forward-only (inference); the backward needs quant_gran=None"));
    }
    Ok(())
}

/// Block-sparse forward on the backend `pref` picks: (out, lse) and which backend ran.
pub fn sparse_forward(pref: DevicePref, spec: &SparseSpec, q: HostView, k: HostView, v: HostView) -> Result<(ForwardOutput, BackendKind)> {
    check_buffers(&spec.attn, q, k, v)?;
    match target(pref, spec, false)? {
        Target::Cpu => Ok((super::cpu::sparse::forward(spec, q, k, v), BackendKind::Cpu)),
        #[cfg(feature = "cuda")]
        Target::Cuda(be) => Ok((be.sparse_forward_host(spec, q, k, v, None)?, BackendKind::Cuda)),
    }
}

/// The CUDA backend that runs a block-sparse forward (`backward = false`) or backward of `spec`
/// on device-resident buffers, or `None` where `pref` picks the CPU (`auto` with an unsupported
/// spec).
#[cfg(feature = "cuda")]
pub fn sparse_cuda(pref: DevicePref, spec: &SparseSpec, backward: bool) -> Result<Option<&'static super::cuda::CudaBackend>> {
    if backward {
        check_not_int8(spec)?;
    }
    Ok(match target(pref, spec, backward)? {
        Target::Cpu => None,
        Target::Cuda(be) => Some(be),
    })
}

/// Block-sparse backward (dq, dk, dv) on the backend `pref` picks. Exact QK^T only.
/// Deterministic on every backend (bitwise identical gradients for identical inputs).
pub fn sparse_backward(
    pref: DevicePref,
    spec: &SparseSpec,
    q: HostView,
    k: HostView,
    v: HostView,
    grad: BackwardInputs,
) -> Result<(Gradients, BackendKind)> {
    check_not_int8(spec)?;
    let t = target(pref, spec, true)?;
    check_buffers(&spec.attn, q, k, v)?;
    check_backward_buffers(&spec.attn, &grad)?;
    match t {
        Target::Cpu => Ok((super::cpu::sparse::backward(spec, q, k, v, grad), BackendKind::Cpu)),
        #[cfg(feature = "cuda")]
        Target::Cuda(be) => Ok((be.sparse_backward_host(spec, q, k, v, grad, None)?, BackendKind::Cuda)),
    }
}
