//! Development aid (tests only): writes the CUDA source CubeCL generates for the tensor-core
//! kernels into `CUBEATTN_DUMP_DIR`, so their SASS can be counted without a GPU run
//! (`scripts/kernel_code.py`). Code generation reads the device properties of a CubeCL CUDA
//! client, so it needs a CUDA driver library; nothing is compiled or launched.

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::backward::{
        dkdv_sm90_source, dkdv_smem, dkdv_split_source, dkdv_wide_source, dkdv_ws_cols_source, dq_sm90_source, dq_source, Sm90Dkdv,
    };
    use super::super::forward::fwd_source;
    use super::super::CudaBackend;
    use crate::dtype::DType;

    /// `CUBEATTN_DUMP_DIR=dir cargo test --release --features cuda --lib dump_tensor_core_kernels
    /// -- --ignored`: bf16 forward, dK/dV (dense and block-sparse) and dQ pass in their main comptime
    /// variants, as built for sm_90+ (tensor-map tile copies), and `*_pre90` as built below sm_90 (or
    /// with `CUBEATTN_CUDA_PORTABLE=1`: no tensor maps or bulk dQ, scalar dQ atomics; compile them
    /// for sm_80, or for sm_90a with `CUBEATTN_PORTABLE` defined).
    #[test]
    #[ignore]
    fn dump_tensor_core_kernels() {
        let dir = crate::config::get().dump_dir.clone().expect("set CUBEATTN_DUMP_DIR");
        std::fs::create_dir_all(&dir).unwrap();
        let c = CudaBackend::shared().expect("a CUDA driver").client();
        let dt = DType::BF16;
        // the Hopper dK/dV kernel's choices every variant below departs from
        let b = Sm90Dkdv { hd: 128, fused: false, qvec: 2, sparse: false, paged: false, ws: false, bm: 64 };
        let sources = [
            ("fwd_d128", fwd_source(c, dt, 128, 2, 64, 128, false, false, false, false, true)),
            ("fwd_d64", fwd_source(c, dt, 64, 2, 128, 128, false, false, false, false, true)),
            // the other head dims: 16-row planes above 128, no tensor maps at 256 (box > 256)
            ("fwd_d32", fwd_source(c, dt, 32, 2, 128, 128, false, false, false, false, true)),
            ("fwd_d96", fwd_source(c, dt, 96, 2, 64, 128, false, false, false, false, true)),
            ("fwd_d192", fwd_source(c, dt, 192, 1, 64, 128, false, false, false, false, true)),
            ("fwd_d256", fwd_source(c, dt, 256, 1, 64, 128, false, false, false, false, false)),
            ("fwd_paged_d96", fwd_source(c, dt, 96, 2, 64, 128, false, false, true, false, true)),
            ("combine_d96", super::super::forward::combine_source(c, dt, 96)),
            ("dq_d96", dq_source(c, dt, 96, false, false, false, true)),
            ("dq_d32", dq_source(c, dt, 32, false, false, false, true)),
            ("dkdv_wide_fused_d96", dkdv_wide_source(c, dt, 96, true, false, 2, false, false, true, 2)),
            ("dkdv_wide_d96", dkdv_wide_source(c, dt, 96, false, false, 2, false, false, true, 2)),
            ("dkdv_wide_fused_d32", dkdv_wide_source(c, dt, 32, true, false, 2, false, false, true, 2)),
            ("fwd_sm90_d128", super::super::forward::fwd_sm90_source(c, dt, 128, 64, false, false, 2, false, false, false)),
            ("fwd_sm90_d64", super::super::forward::fwd_sm90_source(c, dt, 64, 128, false, false, 2, false, false, false)),
            ("fwd_sm90_d192", super::super::forward::fwd_sm90_source(c, dt, 192, 64, false, false, 1, false, false, false)),
            ("fwd_sm90_d256", super::super::forward::fwd_sm90_source(c, dt, 256, 64, false, false, 1, false, false, false)),
            ("fwd_ws_d128", super::super::forward::fwd_ws_source(c, dt, 128, 128, 128, false, false)),
            // the non-causal tile (`FwdOptions::ws_bn`)
            ("fwd_ws_d128_n160", super::super::forward::fwd_ws_source(c, dt, 128, 128, 160, false, false)),
            ("fwd_ws_d64", super::super::forward::fwd_ws_source(c, dt, 64, 64, 128, false, false)),
            ("fwd_ws_d256", super::super::forward::fwd_ws_source(c, dt, 256, 256, 64, false, false)),
            // v with a head_dim of its own (DeepSeek's MLA), 128-key tiles (`FwdOptions::ws_bn_v`)
            ("fwd_ws_d192_v128", super::super::forward::fwd_ws_source(c, dt, 192, 128, 128, false, false)),
            ("fwd_ws_sparse_paged_d128_f16", super::super::forward::fwd_ws_source(c, DType::F16, 128, 128, 128, true, true)),
            ("fwd_sm90_d128_check_v", super::super::forward::fwd_sm90_source(c, dt, 128, 64, false, false, 2, true, false, false)),
            ("fwd_sm90_paged_d128_f16", super::super::forward::fwd_sm90_source(c, DType::F16, 128, 64, false, true, 2, false, false, false)),
            // block-sparse on the Hopper kernel (d128, 128-row cubes, k_block a multiple of 64)
            ("fwd_sm90_sparse_d128", super::super::forward::fwd_sm90_source(c, dt, 128, 64, true, false, 2, false, false, false)),
            // the INT8 Q K^T variant (SageAttention style) of the Hopper sparse forward
            ("fwd_sm90_sparse_int8_d128", super::super::forward::fwd_sm90_source(c, dt, 128, 64, true, false, 2, false, true, false)),
            // with FP8 P.V (SageAttention2)
            ("fwd_sm90_sparse_int8_fp8_d128", super::super::forward::fwd_sm90_source(c, dt, 128, 64, true, false, 2, false, true, true)),
            ("fwd_decode_d128", super::super::forward::fwd_decode_source(c, dt, 128, false, 8)),
            ("fwd_decode_d128_r32", super::super::forward::fwd_decode_source(c, dt, 128, false, 32)),
            ("fwd_decode_d64", super::super::forward::fwd_decode_source(c, dt, 64, false, 8)),
            ("fwd_decode_paged_d128", super::super::forward::fwd_decode_source(c, dt, 128, true, 16)),
            // block-sparse, 64-row cubes (q_block 64, index per q head): four planes of 16 rows at d128
            ("fwd_sparse_d128", fwd_source(c, dt, 128, 1, 64, 64, true, false, false, true, true)),
            // block-sparse, 128-row cubes (q_block 128, or a GQA group packed): two planes of 32 rows
            ("fwd_sparse_bm128_d128", fwd_source(c, dt, 128, 2, 64, 128, true, false, false, false, true)),
            ("fwd_sparse_d64", fwd_source(c, dt, 64, 2, 64, 64, true, false, false, true, true)),
            ("fwd_sparse_int8_d128", fwd_source(c, dt, 128, 2, 64, 64, true, true, false, false, true)),
            ("fwd_sparse_int8_d64", fwd_source(c, dt, 64, 2, 64, 64, true, true, false, false, true)),
            ("combine_d128", super::super::forward::combine_source(c, dt, 128)),
            ("kv_append", super::super::kvcache::append_source(c)),
            ("poison_rows", super::super::kvcache::poison_source(c, dt)),
            ("int8_quantize_k_d128", super::super::sparse_int8::quantize_source(c, dt, 128, true, true, false, [64, 8, 2], 128)),
            // sageattn's Q and K (per_warp, the Hopper kernel's channel order), one scale a block,
            // d64 Q (per_thread, 64-row blocks)
            ("int8_quantize_q_d128", super::super::sparse_int8::quantize_source(c, dt, 128, false, true, true, [32, 32, 32], 128)),
            ("int8_quantize_k_warp_d128", super::super::sparse_int8::quantize_source(c, dt, 128, true, true, true, [64, 64, 64], 128)),
            ("int8_quantize_k_block_d128", super::super::sparse_int8::quantize_source(c, dt, 128, true, true, true, [0, 0, 0], 128)),
            ("int8_quantize_q_d64", super::super::sparse_int8::quantize_source(c, dt, 64, false, true, false, [16, 8, 1], 64)),
            ("chunk_sums_d128", super::super::sparse_int8::chunk_source(c, dt, 128, false)),
            ("chunk_amax_d128", super::super::sparse_int8::chunk_source(c, dt, 128, true)),
            ("fp8_v_quantize_d128", super::super::sparse_int8::vt_source(c, dt, 128)),
            ("dq_d128", dq_source(c, dt, 128, false, false, false, true)),
            ("dq_d64", dq_source(c, dt, 64, false, false, false, true)),
            ("dq_window_d128", dq_source(c, dt, 128, false, true, false, true)),
            ("dq_sparse_d128", dq_source(c, dt, 128, true, false, false, true)),
            ("dq_sm90_d128", dq_sm90_source(c, dt, 128, 128, false, false, false)),
            ("dq_sm90_d64", dq_sm90_source(c, dt, 64, 64, false, false, false)),
            ("dq_sm90_d192", dq_sm90_source(c, dt, 192, 192, false, false, false)),
            ("dq_sm90_d256", dq_sm90_source(c, dt, 256, 256, false, false, false)),
            // v at its own head_dim (DeepSeek's MLA)
            ("dq_sm90_d192_v128", dq_sm90_source(c, dt, 192, 128, false, false, false)),
            ("dq_sm90_window_d128", dq_sm90_source(c, dt, 128, 128, false, true, false)),
            ("dq_sm90_sparse_d128", dq_sm90_source(c, dt, 128, 128, true, false, false)),
            ("dq_sm90_paged_d64", dq_sm90_source(c, dt, 64, 64, false, false, true)),
            // the dK/dV kernel (128 keys): causal / window are runtime bounds
            ("dkdv_wide_d128", dkdv_wide_source(c, dt, 128, false, false, 2, false, false, true, 2)),
            ("dkdv_wide_fused_d128", dkdv_wide_source(c, dt, 128, true, true, 2, false, false, true, 2)),
            ("dkdv_wide_fused_atomic_d128", dkdv_wide_source(c, dt, 128, true, false, 2, false, false, true, 2)),
            ("dkdv_wide_d64", dkdv_wide_source(c, dt, 64, false, false, 2, false, false, true, 2)),
            ("dkdv_wide_fused_d64", dkdv_wide_source(c, dt, 64, true, false, 2, false, false, true, 2)),
            ("dkdv_wide_fused_d128_f16", dkdv_wide_source(c, DType::F16, 128, true, true, 2, false, false, true, 2)),
            ("dkdv_wide_sparse_d128", dkdv_wide_source(c, dt, 128, false, false, 2, true, false, true, 2)),
            ("dkdv_wide_sparse_fused_d128", dkdv_wide_source(c, dt, 128, true, true, 2, true, false, true, 2)),
            // the Hopper dK/dV kernel: fused dQ (bulk), without (deterministic), block-sparse, paged
            ("bwd_sm90_fused_d128", dkdv_sm90_source(c, dt, Sm90Dkdv { fused: true, ..b })),
            ("bwd_sm90_d128", dkdv_sm90_source(c, dt, b)),
            ("bwd_sm90_fused_d64", dkdv_sm90_source(c, dt, Sm90Dkdv { hd: 64, fused: true, ..b })),
            ("bwd_sm90_sparse_fused_d128", dkdv_sm90_source(c, dt, Sm90Dkdv { fused: true, sparse: true, ..b })),
            ("bwd_sm90_paged_fused_d128_f16", dkdv_sm90_source(c, DType::F16, Sm90Dkdv { fused: true, paged: true, ..b })),
            ("bwd_ws_fused_d128", dkdv_sm90_source(c, dt, Sm90Dkdv { fused: true, ws: true, ..b })),
            ("bwd_ws_d128", dkdv_sm90_source(c, dt, Sm90Dkdv { ws: true, ..b })),
            ("bwd_ws_d64", dkdv_sm90_source(c, dt, Sm90Dkdv { hd: 64, ws: true, ..b })),
            ("bwd_ws_d64_bm128", dkdv_sm90_source(c, dt, Sm90Dkdv { hd: 64, ws: true, bm: 128, ..b })),
            ("bwd_ws_fused_d64_bm128", dkdv_sm90_source(c, dt, Sm90Dkdv { hd: 64, fused: true, ws: true, bm: 128, ..b })),
            ("bwd_ws_sparse_fused_d128", dkdv_sm90_source(c, dt, Sm90Dkdv { fused: true, sparse: true, ws: true, ..b })),
            ("bwd_ws_paged_fused_d128_f16", dkdv_sm90_source(c, DType::F16, Sm90Dkdv { fused: true, paged: true, ws: true, ..b })),
            // above head_dim 128: dV and dK in different warpgroups, fused dQ by atomics, or none
            // (deterministic: the dQ pass at 192 / 256)
            ("bwd_split_d256", dkdv_split_source(c, dt, 256, 256, true, 2, false)),
            ("bwd_split_d192", dkdv_split_source(c, dt, 192, 192, true, 2, false)),
            ("bwd_split_paged_d256_f16", dkdv_split_source(c, DType::F16, 256, 256, true, 2, true)),
            ("bwd_split_nodq_d192_v128", dkdv_split_source(c, dt, 192, 128, false, 2, false)),
            ("bwd_split_d192_v128", dkdv_split_source(c, dt, 192, 128, true, 2, false)),
            ("bwd_split_nodq_d256", dkdv_split_source(c, dt, 256, 256, false, 2, false)),
            // the column-split warp-specialised kernel at 192, v at 128 (DeepSeek's MLA; dQ by the
            // tile) or 192 (dQ by atomics): three consumer warpgroups
            ("bwd_ws_cols_d192_fused_v128", dkdv_ws_cols_source(c, dt, 128, true, 2)),
            ("bwd_ws_cols_d192_v128", dkdv_ws_cols_source(c, dt, 128, false, 2)),
            ("bwd_ws_cols_d192_fused_v128_f16", dkdv_ws_cols_source(c, DType::F16, 128, true, 2)),
            ("bwd_ws_cols_d192_fused", dkdv_ws_cols_source(c, dt, 192, true, 2)),
            ("bwd_ws_cols_d192", dkdv_ws_cols_source(c, dt, 192, false, 2)),
            ("dq_d192", dq_source(c, dt, 192, false, false, false, true)),
            ("dq_d256", dq_source(c, dt, 256, false, false, false, true)),
            ("fwd_d128_pre90", fwd_source(c, dt, 128, 2, 64, 128, false, false, false, false, false)),
            ("fwd_d64_pre90", fwd_source(c, dt, 64, 2, 128, 128, false, false, false, false, false)),
            ("dq_d128_pre90", dq_source(c, dt, 128, false, false, false, false)),
            ("dkdv_wide_d128_pre90", dkdv_wide_source(c, dt, 128, false, false, 1, false, false, false, 1)),
            ("dkdv_wide_fused_d128_pre90", dkdv_wide_source(c, dt, 128, true, false, 1, false, false, false, 1)),
            ("dkdv_wide_fused_d64_pre90", dkdv_wide_source(c, dt, 64, true, false, 1, false, false, false, 2)),
            ("dkdv_wide_sparse_fused_d128_pre90", dkdv_wide_source(c, dt, 128, true, false, 1, true, false, false, 1)),
        ];
        // the host's shared-memory estimate of the dK/dV kernel (which picks its query stages) is
        // the generated layout's size, rounded up by at most its 1 KiB allowance
        for (hd, fused, bulk, qs) in [(128, true, true, 2), (128, false, false, 2), (128, true, false, 1), (64, true, false, 2), (64, true, false, 1)] {
            let src = dkdv_wide_source(c, dt, hd, fused, bulk, 2, false, false, true, qs).unwrap();
            let est = dkdv_smem(hd, fused, bulk, qs);
            assert!(est >= src.smem as usize && est - (src.smem as usize) <= 1024, "d{hd} fused {fused} bulk {bulk} qs {qs}: {est} vs {}", src.smem);
        }
        for (name, src) in sources {
            let src = src.unwrap();
            std::fs::write(Path::new(&dir).join(format!("{name}.cu")), format!("// entry {}\n{}", src.entry, src.cuda)).unwrap();
        }
    }
}
