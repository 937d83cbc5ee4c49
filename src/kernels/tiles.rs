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
/// Keys of S / dP per consumer warpgroup of the column-split warp-specialised backward
/// (`flash_bwd_ws_cols`, head_dim 192 and 256).
pub const WS_COLS_WG_KEYS: usize = 32;
/// Consumer warpgroups of `flash_bwd_ws_cols` at head_dim `hd`: two of 128 columns at 256, three
/// of 64 at 192.
pub const fn ws_cols_consumers(hd: usize) -> usize {
    if hd == 256 {
        2
    } else {
        3
    }
}
/// Keys per cube of `flash_bwd_ws_cols` at head_dim `hd` (32 a consumer warpgroup: 64 at 256, 96
/// at 192).
pub const fn ws_cols_bn(hd: usize) -> usize {
    ws_cols_consumers(hd) * WS_COLS_WG_KEYS
}
/// Threads per cube of `flash_bwd_ws_cols`: a producer warpgroup and the consumers.
pub const fn ws_cols_threads(hd: usize) -> usize {
    128 * (ws_cols_consumers(hd) + 1)
}
/// Bytes of `flash_bwd_ws_cols`'s shared tiles at head_dim `hd`, v `hv` (16-bit elements: K, V,
/// two stages of Q and dO, P^T, dS^T; with `dq_tile` the fused dQ's 64-row f32 tile).
pub const fn ws_cols_smem(hd: usize, hv: usize, dq_tile: bool) -> usize {
    let bn = ws_cols_bn(hd);
    let tiles = 2 * (bn * hd + bn * hv + 2 * BWD_BM * hd + 2 * BWD_BM * hv + 2 * bn * BWD_BM);
    tiles + if dq_tile { BWD_BM * hd * 4 } else { 0 }
}
/// Whether `flash_bwd_ws_cols`'s fused dQ goes through the f32 tile and bulk reduce-adds (the
/// tiles fit in 224 KiB, leaving room for lse, delta and the barriers of the 227 KiB an SM gives a
/// cube: 192 / 128), else by float2 atomics from registers (192 / 192: 240 KiB with the tile,
/// 256 / 256: 272 KiB).
pub const fn ws_cols_dq_tile(hd: usize, hv: usize) -> bool {
    ws_cols_smem(hd, hv, true) <= 224 * 1024
}
/// u32 words per block-sparse dK/dV work item: (sequence, first window key, keys, key block).
pub const SPARSE_KWORK_WORDS: usize = 4;
/// An entry of the transposed block index is `query block | index head << SPARSE_QB_BITS`.
pub const SPARSE_QB_BITS: u32 = 20;
/// The query-block bits of a transposed-index entry.
pub const SPARSE_QB_MASK: u32 = (1 << SPARSE_QB_BITS) - 1;
