//! Tile shapes and work-list formats shared by the kernels and by the host plans that feed them
//! (`backend::cuda`). No kernel code: every kernel file may import it, so the kernel files need not
//! import each other for a constant.

/// Width of the forward's global-memory vector loads (elements): 16 bytes of f16/bf16.
pub const LOAD_VEC: usize = 8;
/// Padding (elements) added to each of the forward's shared-memory rows to spread banks.
pub const SMEM_PAD: usize = 8;

/// Planes (warps) per cube of the dQ pass.
pub const BWD_PLANES: usize = 4;
/// Keys per shared-memory tile of the dQ pass (and of the f32 row-wise backward's key tiles).
pub const BWD_BN: usize = 16 * BWD_PLANES;
/// Query rows per dQ cube (16 per plane) and per query tile of the dK/dV kernels.
pub const BWD_BM: usize = 16 * BWD_PLANES;
/// Keys of the dQ pass computed at once from a shared-memory tile (bounds the registers).
pub const BWD_SUB: usize = 32;
/// Width of the global-memory vector loads (elements): 16 bytes of f16/bf16.
pub const BWD_LOAD_VEC: usize = 8;
/// Padding (elements) added to each shared-memory row (keeps 16-byte alignment, spreads banks).
pub(crate) const PAD: usize = 8;
/// Elements per unit of `flash_bwd::dq_convert` (every dQ length is a multiple: head_dim is 64 or
/// 128).
pub const CONVERT_VEC: usize = 4;
/// Planes per cube of the preprocessing kernel.
pub const DELTA_PLANES: usize = 8;
/// u32 words per block-sparse dQ work item: (sequence, first row, end row of its query block).
pub const SPARSE_QWORK_WORDS: usize = 3;

/// Planes (warps) per cube of the mma.sync dK/dV kernel.
pub const WIDE_PLANES: usize = 8;
/// Keys per dK/dV work item (the key tile of the work list; a cube of either dK/dV kernel).
pub const WIDE_BN: usize = 128;
/// Keys per cube (and per key tile of the work list) of the Hopper dK/dV kernel above head_dim 128
/// (`flash_bwd_sm90_split`: one wgmma row block of 64 keys, dV in one warpgroup, dK in the other).
pub const SPLIT_BN: usize = 64;
/// Keys per cube of the column-split warp-specialised backward at head_dim 192
/// (`flash_bwd_ws_cols`: 32 per consumer warpgroup).
pub const WS_COLS_BN: usize = 96;
/// Bytes of `flash_bwd_ws_cols`'s shared tiles with v at `hv` (16-bit elements: K, V, two stages
/// of Q and dO, P^T, dS^T; with `dq_tile` the fused dQ's 64-row f32 tile).
pub const fn ws_cols_smem(hv: usize, dq_tile: bool) -> usize {
    let (hd, bn) = (192, WS_COLS_BN);
    let tiles = 2 * (bn * hd + bn * hv + 2 * BWD_BM * hd + 2 * BWD_BM * hv + 2 * bn * BWD_BM);
    tiles + if dq_tile { BWD_BM * hd * 4 } else { 0 }
}
/// Whether `flash_bwd_ws_cols`'s fused dQ goes through the f32 tile and bulk reduce-adds (the
/// tiles fit in 224 KiB, leaving room for lse, delta and the barriers of the 227 KiB an SM gives a
/// cube: v at 128, 212 KiB), else by float2 atomics from registers (v at 192: 240 KiB with the tile).
pub const fn ws_cols_dq_tile(hv: usize) -> bool {
    ws_cols_smem(hv, true) <= 224 * 1024
}
/// u32 words per block-sparse dK/dV work item: (sequence, first window key, keys, key block).
pub const SPARSE_KWORK_WORDS: usize = 4;
/// An entry of the transposed block index is `query block | index head << SPARSE_QB_BITS`.
pub const SPARSE_QB_BITS: u32 = 20;
/// The query-block bits of a transposed-index entry.
pub const SPARSE_QB_MASK: u32 = (1 << SPARSE_QB_BITS) - 1;
