//! Paged K,V on the CPU ([`AttnSpec::with_kv_block_table`]): the blocks are put in logical order
//! once (one row copy of K and V), the unpaged kernels run, and dK,dV go back to the physical
//! blocks. The copies are O(total_k) against the O(total_q x total_k) attention.

use crate::dtype::{HostData, HostView};
use crate::spec::{AttnSpec, KeySet, KV_PAGE};

/// Block-row permutation of `x` (`[total_k, heads_kv, head_dim]`): with `to_logical`, logical
/// block g <- physical block table[g]; else physical block table[g] <- logical block g.
fn permute(spec: &AttnSpec, table: &[u32], x: HostView, to_logical: bool) -> HostData {
    let bytes = x.as_bytes();
    let block = KV_PAGE * spec.dims.heads_kv * spec.dims.head_dim * x.dtype().size();
    let mut out = vec![0u8; bytes.len()];
    for (g, &t) in table.iter().enumerate() {
        let (l, p) = (g * block, t as usize * block);
        let (dst, src) = if to_logical { (l, p) } else { (p, l) };
        out[dst..dst + block].copy_from_slice(&bytes[src..src + block]);
    }
    HostData::from_bytes(x.dtype(), &out)
}

/// (the spec without its table, K and V in logical order) for a paged spec; None otherwise.
pub(super) fn logical(spec: &AttnSpec, k: HostView, v: HostView) -> Option<(AttnSpec, HostData, HostData)> {
    let table = spec.kv_pages()?;
    let plain = AttnSpec { keys: KeySet::Dense, ..spec.clone() };
    Some((plain, permute(spec, table, k, true), permute(spec, table, v, true)))
}

/// dK or dV of the logical order back to the physical blocks of `spec`'s table.
pub(super) fn physical(spec: &AttnSpec, x: HostData) -> HostData {
    match spec.kv_pages() {
        Some(table) => permute(spec, table, x.view(), false),
        None => x,
    }
}
