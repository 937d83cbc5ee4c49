//! Dispatch of block-sparse calls. The CPU runs them; the CUDA backend has no block-sparse kernel
//! yet, so `cuda` / `cuda:N` is refused with [`Error::Unsupported`] and `auto` runs on the CPU.
//!
//! What a CUDA kernel needs (the dense kernels' key-tile iteration is what changes):
//! - forward (`flash_fwd_mma2`): a work item = one query block (`q_block` rows) of one head (or of
//!   the GQA group's heads packed, when the index is per kv head); instead of
//!   `t0 = klo + kt * BLOCK_N` for `kt in 0..n_tiles`, read the item's key-tile starts from a
//!   host-built CSR (the kept blocks of [`crate::sparse::BlockIndex`], each `k_block` = 128
//!   block = two 64-key tiles, a partial last block's empty tile dropped), also for the cp.async
//!   prefetch of K(t+1); per-row `[lo, hi)` keeps the causal and sequence-end masks; an item with
//!   no tile writes zeros and lse +inf (as `fill_uncovered` does). With BLOCK_M = 128 packed rows
//!   and `q_block` = 64 one head per cube holds two query blocks with different lists: use a
//!   64-row variant (2 planes x 32 rows) or pack two GQA heads sharing the list.
//! - backward dQ (`flash_bwd_dq`, 64-row cubes = `q_block`): the same list replaces its
//!   `0..n_tiles` key-tile loop. dK/dV (`flash_bwd_dkdv`, 64-key cubes, two per `k_block`): the
//!   transposed index ([`crate::sparse::SparseSpec::transposed`], per key block the query blocks
//!   listing it, ascending) replaces the loop over the segment's query tiles; build it on the GPU
//!   with a count / exclusive-scan / ordered-fill pass so the summation order stays fixed.
//! - INT8 QK^T: an m16n8k32 s8 mma with i32 accumulators and the scale groups of
//!   [`crate::sparse::QuantGran`]; P.V stays f16/bf16.

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
