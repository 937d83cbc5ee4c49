//! VRAM estimation for a call on the CUDA backend: a pure function of the sizes, so it can be
//! checked against the measured peak (tests/gpu) and used before allocating anything.
//!
//! Forward: q, k, v in; out + lse (f32) out; workspace = the per-tile work list and segment
//! table, the row-to-segment table, and for f16/bf16 the non-finite-v flag (one u32, in a 256-byte workspace part). Backward adds out, dout and lse in; dq, dk, dv out; workspace = delta (f32 per row and
//! head) plus the work lists (query tiles, key tiles and the per-key-tile segment lists). The
//! CUDA backward keeps its dq, dk, dv accumulators in registers: no f32 gradient buffers.

use crate::dtype::DType;
use crate::spec::Dims;

/// Bytes per category; `total` is their sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VramEstimate {
    pub inputs: u64,
    pub outputs: u64,
    pub lse: u64,
    pub workspace: u64,
    pub total: u64,
}

/// Query rows per tile of the CUDA work list (the estimate assumes the smallest tile).
pub const MIN_TILE_ROWS: usize = 64;
/// Bytes of one work-list entry and of one segment-table entry.
const ENTRY_BYTES: u64 = 16;
/// Bytes of the f16/bf16 forward's non-finite-v flag as the workspace holds it (256-aligned part).
const FLAG_PART_BYTES: u64 = 256;

/// Estimate for `segments` sequences or groups of the given sizes.
pub fn estimate(dims: &Dims, dtype: DType, segments: usize, backward: bool) -> VramEstimate {
    let e = dtype.size() as u64;
    let q = dims.q_len() as u64 * e;
    let k = dims.kv_len() as u64 * e;
    let v = dims.v_len() as u64 * e;
    let o = dims.out_len() as u64 * e;
    let lse = dims.lse_len() as u64 * 4;
    let tiles = (dims.total_q.div_ceil(MIN_TILE_ROWS) + segments) as u64;
    let meta = (tiles + segments as u64) * ENTRY_BYTES;
    let est = if backward {
        // q, k, v, out, dout in; dq, dk, dv out; lse in; delta + work lists as workspace.
        let key_tiles = (dims.total_k.div_ceil(MIN_TILE_ROWS) + segments) as u64;
        VramEstimate {
            inputs: q + k + v + 2 * o,
            outputs: q + k + v,
            lse,
            workspace: lse + meta + key_tiles * ENTRY_BYTES,
            total: 0,
        }
    } else {
        // the row-to-segment table (one u32 per query row) and, f16/bf16, the flag
        let flag = if dtype == DType::F32 { 0 } else { FLAG_PART_BYTES };
        VramEstimate { inputs: q + k + v, outputs: o, lse, workspace: meta + 4 * dims.total_q as u64 + flag, total: 0 }
    };
    VramEstimate { total: est.inputs + est.outputs + est.lse + est.workspace, ..est }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_counts_each_buffer_once() {
        let dims = Dims { total_q: 1024, total_k: 2048, heads_q: 32, heads_kv: 8, head_dim: 128, head_dim_v: 128 };
        let e = estimate(&dims, DType::BF16, 1, false);
        assert_eq!(e.inputs, (1024 * 32 * 128 + 2 * 2048 * 8 * 128) * 2);
        assert_eq!(e.outputs, 1024 * 32 * 128 * 2);
        assert_eq!(e.lse, 32 * 1024 * 4);
        assert_eq!(e.total, e.inputs + e.outputs + e.lse + e.workspace);
        let b = estimate(&dims, DType::BF16, 1, true);
        // backward: q, k, v, out, dout in, dq, dk, dv out, lse in, delta as workspace
        assert_eq!(b.inputs, 2 * e.inputs + e.outputs - 2 * 2 * 2048 * 8 * 128);
        assert!(b.total > 2 * e.total - 2 * e.workspace);
    }
}

/// Estimate for one call of `spec`. With the `cuda` feature the workspace is computed from the
/// launch plan the CUDA backend builds for this spec (split-K partial buffers, work lists, and
/// for the backward delta plus the f32 dQ accumulator of the atomic path, which
/// `deterministic=false` may choose); without it, the size-only formula of [`estimate`].
pub fn estimate_spec(spec: &crate::spec::AttnSpec, backward: bool, deterministic: bool) -> VramEstimate {
    let base = estimate(&spec.dims, spec.dtype, spec.segments.len(), backward);
    #[cfg(feature = "cuda")]
    {
        let workspace = if backward {
            crate::backend::cuda::backward::backward_workspace_bytes(spec, deterministic)
        } else {
            crate::backend::cuda::forward_workspace_bytes(spec)
        };
        VramEstimate { workspace, total: base.inputs + base.outputs + base.lse + workspace, ..base }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = deterministic;
        base
    }
}
