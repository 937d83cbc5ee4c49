//! Layout constants that the host (`spec`, the CPU backend, the CUDA plans) and the device kernels
//! (`kernels`) must agree on. It imports nothing, so the kernels can use it without depending on
//! the host modules.

/// Rows per block of a paged K,V layout (`AttnSpec::with_kv_block_table`): the forward's key
/// tile, so no tile straddles two blocks.
pub const KV_PAGE: usize = 64;
