//! CubeCL kernels (`#[cube]` code only), one file per kernel family. Built with feature `cuda`.

pub mod bulk_reduce;
pub mod bwd_walk;
pub mod card;
pub mod chunk_stats;
pub mod cards;
pub mod flash_fwd;
pub mod flash_fwd_decode;
pub mod flash_fwd_sm90;
pub mod flash_fwd_ws;
pub mod fp8_v;
pub mod math;
pub mod pad_cols;
pub mod nonfinite;
pub mod rows;
pub mod rowwise_bwd;
pub mod rowwise_fwd;
pub mod sm90;
pub mod flash_bwd;
pub mod flash_bwd_dq_sm90;
pub mod flash_bwd_wide;
pub mod flash_bwd_sm90;
pub mod flash_bwd_sm90_split;
pub mod flash_bwd_ws;
pub mod flash_bwd_ws_cols;
pub mod fragments;
pub mod grid;
pub mod int8_qk;
pub mod kv_append;
pub mod kv_tiles;
pub mod staging;
pub mod sparse_index;
pub mod tiles;
pub mod zigzag_copy;

/// The kernel sources, hashed into the compiled-kernel cache key so that an edited kernel is never
/// served from a stale cache entry.
pub const SOURCES: &[&str] = &[
    include_str!("bulk_reduce.rs"),
    include_str!("bwd_walk.rs"),
    include_str!("card.rs"),
    include_str!("cards.rs"),
    include_str!("chunk_stats.rs"),
    include_str!("flash_fwd.rs"),
    include_str!("flash_fwd_decode.rs"),
    include_str!("flash_fwd_sm90.rs"),
    include_str!("flash_fwd_ws.rs"),
    include_str!("fp8_v.rs"),
    include_str!("sm90.rs"),
    include_str!("math.rs"),
    include_str!("pad_cols.rs"),
    include_str!("nonfinite.rs"),
    include_str!("rows.rs"),
    include_str!("rowwise_bwd.rs"),
    include_str!("rowwise_fwd.rs"),
    include_str!("flash_bwd.rs"),
    include_str!("flash_bwd_dq_sm90.rs"),
    include_str!("flash_bwd_wide.rs"),
    include_str!("flash_bwd_sm90.rs"),
    include_str!("flash_bwd_sm90_split.rs"),
    include_str!("flash_bwd_ws.rs"),
    include_str!("flash_bwd_ws_cols.rs"),
    include_str!("fragments.rs"),
    include_str!("grid.rs"),
    include_str!("int8_qk.rs"),
    include_str!("kv_append.rs"),
    include_str!("kv_tiles.rs"),
    include_str!("staging.rs"),
    include_str!("sparse_index.rs"),
    include_str!("tiles.rs"),
    include_str!("zigzag_copy.rs"),
];

#[cfg(test)]
mod tests {
    /// Every kernel file is hashed into the cache key: a file missing from [`super::SOURCES`]
    /// would keep serving cubins compiled before its last edit.
    #[test]
    fn every_kernel_file_is_in_the_cache_key() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels");
        let mut missing = Vec::new();
        for entry in std::fs::read_dir(&dir).expect("src/kernels") {
            let path = entry.expect("a directory entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
            if name == "mod.rs" || !name.ends_with(".rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("a kernel file");
            if !super::SOURCES.contains(&text.as_str()) {
                missing.push(name);
            }
        }
        assert!(missing.is_empty(), "kernel files not in kernels::SOURCES: {missing:?}");
    }
}
