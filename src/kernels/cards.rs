//! The kernel cards (`kernels::card`): each lists a kernel family's runtime arguments once, in
//! declaration order (the forward and dK / dV families, two kernels each, and the dQ pass, one).
//! `fwd_card!(emit)`, `dkdv_card!(emit)` and `dq_card!(emit)` hand the list to the macro `emit`:
//! `card::device_card!` here (the structs the kernels take), `host_card!` in `backend::cuda::card`
//! (the launch arguments). A card's header names the struct, the struct CubeCL's `CubeLaunch`
//! derives for its compilation arguments (`<name>CompilationArg`, which the host builds) and the
//! host's struct, after the `/`.
//!
//! The fields keep the order the kernels declared before the cards: the generated signatures are
//! unchanged.

use cubecl::prelude::*;

use super::card::device_card;

/// The forward card: `flash_fwd::flash_fwd_mma2` and `flash_fwd_sm90::flash_fwd_sm90`.
macro_rules! fwd_card {
    ($emit:ident) => {
        $emit! {
            /// The runtime arguments of the forward kernels (`flash_fwd::flash_fwd_mma2`,
            /// `flash_fwd_sm90::flash_fwd_sm90`): one host plan, one launch for both.
            FwdCard<E: Float>, FwdCardCompilationArg / FwdArgs {
                /// Tensor maps of K and V (`kv_tiles`; not read by the INT8 variant, nor below sm_90).
                map k_map: TensorMap<E, Tiled>,
                map v_map: TensorMap<E, Tiled>,
                /// Q, K, V (INT8 variant: `q_s` and `k_s` hold the int8 rows).
                read q_s: Array<E>,
                read k_s: Array<E>,
                read v_s: Array<E>,
                write out: Array<E>,
                write lse: Array<f32>,
                /// Split-K partial outputs and their LSE (INT8 variant: the K and Q scales).
                write part_o: Array<f32>,
                write part_lse: Array<f32>,
                /// The plan's work list, slices and segments.
                read work: Array<u32>,
                read slices: Array<u32>,
                read segs: Array<u32>,
                /// Block-sparse: the tile references and the listed key blocks; dense, paged:
                /// `blocks` is the page table.
                read tile_ref: Array<u32>,
                read blocks: Array<u32>,
                /// The non-finite-v flag (`nonfinite::v_nonfinite`; the Hopper kernel's `check_v`
                /// variant sets it itself).
                write nonfinite: Array<u32>,
                scalar scale_log2: f32,
                scalar heads_q: u32,
                scalar heads_kv: u32,
                scalar total_q: u32,
                /// Heads packed per row group.
                scalar hp: u32,
                /// Split-K slots per head slot.
                scalar n_slots: u32,
                scalar inf: f32,
                /// Block-sparse: keys per key block and key tiles per block.
                scalar k_block: u32,
                scalar tiles_per_block: u32,
                /// The window's bounds (`rows::row_keys`).
                scalar win_l: u32,
                scalar win_r: u32,
                /// Dense: non-zero launches the cubes kv head outer (`grid::cube_item_slot`;
                /// block-sparse launches go items fastest always).
                scalar kv_outer: u32,
            }
        }
    };
}
pub(crate) use fwd_card;

/// The dK / dV card: `flash_bwd_wide::flash_bwd_dkdv_wide` and `flash_bwd_sm90::flash_bwd_sm90`.
macro_rules! dkdv_card {
    ($emit:ident) => {
        $emit! {
            /// The runtime arguments of the dK / dV kernels (`flash_bwd_wide::flash_bwd_dkdv_wide`,
            /// `flash_bwd_sm90::flash_bwd_sm90`): one host plan, one launch for both.
            DkdvCard<E: Float, NV: Size, NQ: Size>, DkdvCardCompilationArg / DkdvArgs {
                /// Tensor maps of Q and dO over `[total_q, heads_q * head_dim]` (not read below sm_90).
                map q_map: TensorMap<E, Tiled>,
                map do_map: TensorMap<E, Tiled>,
                /// K and V as vectors.
                read k: Array<Vector<E, NV>>,
                read v: Array<Vector<E, NV>>,
                /// `[heads_q, total_q]`.
                read lse: Array<f32>,
                read delta: Array<f32>,
                write dk: Array<E>,
                write dv: Array<E>,
                /// The fused path's f32 dQ accumulator, as atomics and as the bulk reductions' rows
                /// (any valid address otherwise).
                write dq_acc: Array<Atomic<Vector<f32, NQ>>>,
                write dq_rows: Array<Vector<f32, NQ>>,
                /// Q and dO as scalars (the `cp.async` sources).
                read q_s: Array<E>,
                read do_s: Array<E>,
                /// The key-tile work list; dense: the CSR of the segments overlapping each tile.
                read ktiles: Array<u32>,
                read tile_off: Array<u32>,
                read tile_segs: Array<u32>,
                /// (q_start, q_len, k_start, k_len) per segment.
                read segs: Array<u32>,
                /// Block-sparse: the transposed block index; dense: `tq_list` is the page table.
                read tq_off: Array<u32>,
                read tq_list: Array<u32>,
                scalar scale: f32,
                scalar scale_log2: f32,
                scalar heads_q: u32,
                scalar heads_kv: u32,
                scalar total_q: u32,
                scalar total_k: u32,
                /// Block-sparse: the transposed index's shape.
                scalar q_block: u32,
                scalar idx_heads: u32,
                scalar k_blocks: u32,
                scalar q_tiles_per_block: u32,
                /// The window's bounds (`rows::row_keys`).
                scalar win_l: u32,
                scalar win_r: u32,
                /// Dense: non-zero launches the cubes kv head outer (`grid::cube_item_slot`).
                scalar kv_outer: u32,
            }
        }
    };
}
pub(crate) use dkdv_card;

/// The dQ card: `flash_bwd::flash_bwd_dq` (the deterministic dQ pass).
macro_rules! dq_card {
    ($emit:ident) => {
        $emit! {
            /// The runtime arguments of the dQ pass kernel (`flash_bwd::flash_bwd_dq`).
            DqCard<E: Float, NV: Size>, DqCardCompilationArg / DqArgs {
                /// Tensor maps of K and V (not read below sm_90).
                map k_map: TensorMap<E, Tiled>,
                map v_map: TensorMap<E, Tiled>,
                /// Q and dO as vectors.
                read q: Array<Vector<E, NV>>,
                read dout: Array<Vector<E, NV>>,
                /// `[heads_q, total_q]`.
                read lse: Array<f32>,
                read delta: Array<f32>,
                write dq: Array<E>,
                /// K and V as scalars (the `cp.async` sources).
                read k_s: Array<E>,
                read v_s: Array<E>,
                /// The work list: per item the segment id and the tile's first row (block-sparse:
                /// `SPARSE_QWORK_WORDS` words, the third the row end).
                read work: Array<u32>,
                /// (q_start, q_len, k_start, k_len) per segment.
                read segs: Array<u32>,
                /// Block-sparse: the tile references and the listed key blocks; dense, paged:
                /// `blocks` is the page table.
                read tile_ref: Array<u32>,
                read blocks: Array<u32>,
                scalar scale: f32,
                scalar scale_log2: f32,
                scalar heads_q: u32,
                scalar heads_kv: u32,
                scalar total_q: u32,
                /// Block-sparse: the index heads, keys per key block and key tiles per block.
                scalar idx_heads: u32,
                scalar k_block: u32,
                scalar tiles_per_block: u32,
                /// The window's bounds (`rows::row_keys`).
                scalar win_l: u32,
                scalar win_r: u32,
                /// Dense: non-zero launches the cubes kv head outer (`grid::cube_item_slot`).
                scalar kv_outer: u32,
            }
        }
    };
}
pub(crate) use dq_card;

fwd_card!(device_card);
dkdv_card!(device_card);
dq_card!(device_card);
