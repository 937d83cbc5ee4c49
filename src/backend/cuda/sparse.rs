//! CUDA block-sparse forward: the dense forward kernel (`flash_fwd_mma2`) with its key-tile
//! iterator reading a block list (`sparse = true`), so unlisted key blocks are skipped, not masked.
//!
//! Plan (built on the host once per (shape, index), cached on the device like the dense plans):
//! - one work item per chunk of `block_m` packed rows inside one query block of one sequence
//!   (`block_m` = 128 when a query block's packed rows are a multiple of 128, else 64: one list
//!   per cube); packed rows are `hp` heads per query (`hp` = the GQA group when the index is per
//!   kv head, else 1), as in the dense plan. A 64-row cube at head_dim 128 runs four planes of
//!   16 rows (`mt` = 1): with two planes of 32 rows, two cubes per SM (their shared memory) leave
//!   4 warps per SM; measured 7-9% faster (docs/sparse.md). Its V tile has one buffer
//!   (`v_single`: V(t) issued at the top of tile t, waited for before P V), 70 KB instead of
//!   87 KB, so three cubes (12 warps) share an SM: 16-22% faster again. At head_dim 64 and in
//!   the int8 kernel the cube keeps two planes of 32 rows (mt = 1 lost 9-17% at d64); the d64
//!   cube has one V buffer too, with launch bounds of five cubes per SM (168 registers, 37 KB:
//!   six fit, 12 warps, where two V buffers and 212 registers allowed four): 6-12% faster;
//! - `tile_ref[(y * n_items + item) * 2 ..]` = (offset into `blocks`, key tiles) of the item's
//!   list for index head `y`; the list is the query block's kept key blocks (ascending), cut,
//!   when causal, after the last block any row of the item can see; each block is
//!   `ceil(k_block / BLOCK_N)` tiles.
//!
//! Memory of the tables: O(items * heads + kept blocks), never O(S^2).
//! Workspace (the caller's, [`forward_workspace`]): the non-finite-v flag; a call whose v
//! holds a NaN or Inf is written by the exact row-wise kernel over the same plan instead
//! ([`super::nonfinite`]), decided on the device.
//! On Hopper (`forward::sm90_forward`) a d128 plan whose cubes are 128 rows and whose `k_block`
//! is a multiple of the Hopper kernel's key tile (64) runs `flash_fwd_sm90` with
//! the same tables (its key tiles are that kernel's `block_n`), INT8 calls too (Q K^T by
//! `wgmma .s32.s8.s8`); the rest runs `flash_fwd_mma2` ([`SparseFrame`]).
//! Speed contract (same results for every block size): `k_block` a multiple of 64 and
//! `q_block * hp` a multiple of 64 run without masked padding.

use std::sync::Arc;

use cudarc::driver::sys;

use super::card::FwdArgs;
use super::launch::launch;
use super::nonfinite::{launch_flag, launch_sparse_exact, SparseExact, FLAG_BYTES};
use super::plans::{table_names, Cached, PlanKey, PlanKind, TableSet};
use super::{CudaBackend, FwdPtrs};
use crate::dtype::DType;
use crate::error::{invalid, Error, Result};
use super::sparse_int8::int8_workspace;
use crate::kernels::flash_fwd::{BLOCK_N, NONE, SLICE_WORDS, WORK_WORDS};
use crate::kernels::math::LOG2E;
use crate::spec::SparseView;

/// Host part of a cached block-sparse plan.
pub(crate) struct SparsePlan {
    hp: u32,
    block_m: usize,
    n_items: usize,
    ys: u32,
    tiles_per_block: u32,
    frame: SparseFrame,
}

/// Which forward kernel runs a block-sparse call, and so the keys per tile its plan counts.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum SparseFrame {
    /// `flash_fwd_mma2` (every GPU; its INT8 Q K^T variant below sm_90 and at d64), `BLOCK_N`-key tiles.
    Mma2,
    /// `flash_fwd_sm90` with its `block_n`-key tiles (exact or INT8 Q K^T).
    Sm90 { block_n: usize },
}

impl SparseFrame {
    fn block_n(self) -> usize {
        match self {
            SparseFrame::Mma2 => BLOCK_N,
            SparseFrame::Sm90 { block_n } => block_n,
        }
    }

    /// The frame of `spec` on `be` (module docs).
    pub(crate) fn of(be: &CudaBackend, spec: SparseView) -> SparseFrame {
        // d64: the Hopper kernel's sparse variant spills at its two-cubes-per-SM register cap (80
        // bytes of stack; ptxas, 128 registers), where the mma.sync kernel runs five cubes per SM
        if spec.attn.dims.head_dim != 128 || !super::forward::sm90_forward(be, spec.attn) || plan_rows(spec).1 != 128 {
            return SparseFrame::Mma2;
        }
        let (block_n, _) = super::forward::sm90_frame(spec.attn.dims.head_dim, spec.attn.dims.head_dim_v, spec.int8.is_some(), false, Some(spec.k_block), false);
        // INT8: one K scale per lane and tile, and FP8 V^T tiles of 64-byte rows, need the
        // 64-key tiles the quantisation groups are cut for (`sparse::TILE_KEYS`)
        if spec.int8.is_some() && block_n != crate::sparse::TILE_KEYS {
            return SparseFrame::Mma2;
        }
        if spec.k_block.is_multiple_of(block_n) { SparseFrame::Sm90 { block_n } } else { SparseFrame::Mma2 }
    }
}

/// Packed rows per query-block row (`hp`, the GQA group when the index is per kv head, else 1)
/// and the cube's rows: 128 when a query block's packed rows are a multiple of 128, else 64.
fn plan_rows(spec: SparseView) -> (usize, usize) {
    let d = &spec.attn.dims;
    let group = d.group_size();
    let hp = if spec.index.heads == d.heads_kv && group > 1 { group } else { 1 };
    (hp, if (spec.q_block * hp).is_multiple_of(128) { 128 } else { 64 })
}

table_names! {
    /// The tables of a block-sparse forward plan.
    pub(crate) enum SparseTable { Segs, Work, Slices, Ref, Blocks }
}

impl PlanKind for SparsePlan {
    type Table = SparseTable;
}

impl SparsePlan {
    fn build(spec: SparseView, frame: SparseFrame) -> (SparsePlan, TableSet<SparseTable>) {
        let d = &spec.attn.dims;
        let (hp, block_m) = plan_rows(spec);
        let ys = (d.heads_q / hp) as u32;
        let tpb = spec.k_block.div_ceil(frame.block_n());
        let mut segs = Vec::new();
        let mut work = Vec::new();
        let mut slices = Vec::new();
        // per item: (sequence, query block, visible keys of its last row)
        let mut items: Vec<(usize, usize, usize)> = Vec::new();
        for (b, sg) in spec.attn.segments.iter().enumerate() {
            segs.extend_from_slice(&[sg.q_start as u32, sg.q_len as u32, sg.k_start as u32, sg.k_len as u32]);
            for qb in 0..sg.q_len.div_ceil(spec.q_block) {
                let (r0, r1) = (qb * spec.q_block, ((qb + 1) * spec.q_block).min(sg.q_len));
                let mut p = r0 * hp;
                while p < r1 * hp {
                    let n = block_m.min(r1 * hp - p);
                    let last_row = (p + n - 1) / hp;
                    let vis = sg.visible_len(last_row, spec.attn.causal);
                    work.extend_from_slice(&[(slices.len() / SLICE_WORDS) as u32, 1, sg.k_start as u32, (sg.k_start + sg.k_len) as u32, NONE]);
                    slices.extend_from_slice(&[b as u32, p as u32, n as u32]);
                    items.push((b, qb, vis));
                    p += n;
                }
            }
        }
        let ix = &spec.index;
        let mut refs = vec![0u32; items.len() * ys as usize * 2];
        for y in 0..ys as usize {
            for (x, &(b, qb, vis)) in items.iter().enumerate() {
                let id = (b * ix.heads + y) * ix.q_blocks + qb;
                let kept = &ix.blocks[ix.offsets[id]..ix.offsets[id + 1]];
                let n = kept.iter().take_while(|&&kb| (kb as usize) * spec.k_block < vis).count();
                refs[(y * items.len() + x) * 2] = ix.offsets[id] as u32;
                refs[(y * items.len() + x) * 2 + 1] = (n * tpb) as u32;
            }
        }
        debug_assert_eq!(work.len(), items.len() * WORK_WORDS);
        let plan = SparsePlan { hp: hp as u32, block_m, n_items: items.len(), ys, tiles_per_block: tpb as u32, frame };
        let tables = TableSet::new()
            .with(SparseTable::Segs, segs)
            .with(SparseTable::Work, work)
            .with(SparseTable::Slices, slices)
            .with(SparseTable::Ref, refs)
            .with(SparseTable::Blocks, ix.blocks.clone());
        (plan, tables)
    }
}

/// Err(Unsupported) for the block-sparse calls no CUDA kernel serves (besides the conditions of
/// every call, `super::check_supported`).
pub(super) fn check_supported(spec: SparseView) -> Result<()> {
    let hd = spec.attn.dims.head_dim;
    if !super::SPARSE_HEAD_DIMS.contains(&hd) {
        return Err(Error::Unsupported {
            backend: "cuda",
            msg: format!("block-sparse attention on CUDA takes head_dim {:?}, not {hd}; it runs on the CPU", super::SPARSE_HEAD_DIMS),
        });
    }
    if spec.attn.dtype == DType::F32 {
        return Err(Error::Unsupported {
            backend: "cuda",
            msg: "block-sparse attention on CUDA takes float16/bfloat16 (tensor cores); float32 runs on the CPU".into(),
        });
    }
    if spec.attn.uncovered_rows() > 0 {
        return Err(invalid("cu_seqlens_q", "the sequences must cover every query row (cu_seqlens_q[-1] == total_q)"));
    }
    let (tq, tk) = (spec.attn.dims.total_q as u64, spec.attn.dims.total_k as u64);
    if tq.max(tk) + spec.k_block as u64 >= u32::MAX as u64 / 2 {
        return Err(invalid("k_block", "sequence too long for 32-bit key indexing"));
    }
    // key tile kt (< k_blocks * tiles per block) is divided by the tiles per block with one
    // mul_hi (`kernels::flash_fwd::tile_div_magic`): exact while kt * tiles per block < 2^32
    let tpb = spec.k_block.div_ceil(BLOCK_N) as u64;
    if spec.k_blocks() as u64 * tpb * tpb >= 1u64 << 32 {
        return Err(Error::Unsupported {
            backend: "cuda",
            msg: format!(
                "block-sparse attention on CUDA: {} key blocks of k_block = {} exceed the kernels' 32-bit tile arithmetic (key blocks * (k_block / 64)^2 must stay below 2^32); it runs on the CPU",
                spec.k_blocks(),
                spec.k_block
            ),
        });
    }
    Ok(())
}

/// Bytes of the non-finite-v flag part at the start of a block-sparse forward's workspace.
fn flag_part() -> usize {
    super::forward::layout(&[super::nonfinite::FLAG_BYTES]).1
}

/// Device workspace bytes of a block-sparse forward: the non-finite-v flag, then the INT8
/// option's quantised Q, K and scales ([`int8_workspace`], 0 without it).
pub(super) fn forward_workspace(spec: SparseView) -> usize {
    flag_part() + int8_workspace(spec)
}

impl CudaBackend {
    pub(super) fn sparse_plan(&self, spec: SparseView, stream: sys::CUstream) -> Result<Arc<Cached<SparsePlan>>> {
        // the frame is a function of the spec on this backend; in the key for clarity
        let frame = SparseFrame::of(self, spec);
        let opts = frame.block_n() as u64;
        self.sparse_plans.get(PlanKey::with_extra(spec.attn, opts, spec.fingerprint()), stream, || SparsePlan::build(spec, frame))
    }
}

/// Enqueues the block-sparse forward of `spec` on `stream` (its plan `plan`): reads q, k, v and
/// writes out and lse in place; rows that see no key get zeros and lse +inf. `p.workspace`: at
/// least [`forward_workspace`] bytes.
pub(super) fn launch_sparse_forward(be: &CudaBackend, spec: SparseView, plan: &Cached<SparsePlan>, p: &FwdPtrs, stream: sys::CUstream) -> Result<()> {
    let sp = &plan.host;
    if sp.n_items == 0 {
        return Ok(());
    }
    let d = &spec.attn.dims;
    let (hd, dt) = (d.head_dim, spec.attn.dtype);
    let (ql, kl, ll) = (d.q_len(), d.kv_len().max(1), d.lse_len());
    let t = |i| plan.tables.get(i);
    // the workspace's flag, set when v holds a NaN or Inf (then the exact kernel writes the call)
    let flag = p.workspace;
    launch_flag(be, dt, p.v, d.kv_len(), flag, FLAG_BYTES, !super::sparse_int8::scans_v(spec.int8), stream)?;
    // INT8: Q and K quantised (and with FP8 P.V, V^T) into the workspace first: the kernel's
    // operands and maps point at them
    let z = match spec.int8 {
        None => None,
        Some(opt) => {
            let pq = FwdPtrs { workspace: p.workspace + flag_part() as u64, ..*p };
            let natural = matches!(sp.frame, SparseFrame::Sm90 { .. });
            Some((opt, super::sparse_int8::quantize(be, spec, opt, &pq, t(SparseTable::Segs), natural, flag, stream)?))
        }
    };
    let (f, [k_map, v_map]) = match sp.frame {
        SparseFrame::Sm90 { block_n } => {
            let fp8 = spec.int8.is_some_and(|o| o.pv_fp8);
            let (f, bn, _) = super::forward::flash_fwd_sm90_kernel(be, dt, hd, hd, true, false, false, spec.int8.is_some(), fp8, Some(spec.k_block), false)?;
            debug_assert_eq!(bn, block_n);
            let maps = match &z {
                None => super::forward::kv_maps_sw128(spec.attn, p.k, p.v, block_n)?,
                // K's map over the int8 rows; V's over V^T in e4m3 with FP8 P.V (`kernels::fp8_v`)
                Some((opt, z)) => {
                    let v_map = if opt.pv_fp8 { z.vt_map(d.heads_kv, hd)? } else { super::forward::kv_map_sw128(spec.attn, p.v, hd, block_n)? };
                    [super::forward::k8_map_sw128(spec.attn, z.k8, block_n)?, v_map]
                }
            };
            (f, maps)
        }
        SparseFrame::Mma2 => {
            // 64-row cubes (not int8): one V buffer, so that more cubes share an SM (module
            // docs); at d128 four planes of 16 rows
            let v_single = sp.block_m == 64 && spec.int8.is_none();
            let mt = if v_single && hd == 128 { 1 } else { 2 };
            let f = super::forward::flash_fwd_kernel(be, dt, hd, mt, BLOCK_N, sp.block_m, true, spec.int8.is_some(), false, v_single)?;
            (f, super::forward::kv_maps(be, spec.attn, p.k, p.v, BLOCK_N, spec.int8.is_some())?)
        }
    };
    // q_s, k_s and the split-K partials (`part_o`, `part_lse`)
    let [q_s, k_s, part_o, part_lse] = match &z {
        // no split-K partial outputs: any valid address
        None => [(p.q, ql), (p.k, kl), (p.out, 1), (p.lse, 1)],
        // int8 rows in place of q and k (their bytes, counted in E); the scales in the split-K
        // arrays, which the sparse plan does not use (`kernels::flash_fwd` docs); with FP8 P.V,
        // V's scales follow Q's
        Some((opt, z)) => {
            let nv = if opt.pv_fp8 { spec.attn.segments.len() * d.heads_kv * hd } else { 0 };
            [(z.q8, ql / 2), (z.k8, kl / 2), (z.k_scale, d.total_k * d.heads_kv), (z.q_scale, 2 * ll + 2 * nv)]
        }
    };
    // row bounds: the causal diagonal (a block pattern has no sliding window)
    let (win_l, win_r, _) = super::window_bounds(spec.attn);
    let args = FwdArgs {
        k_map,
        v_map,
        q_s,
        k_s,
        v_s: (p.v, kl),
        out: (p.out, ql),
        lse: (p.lse, ll),
        part_o,
        part_lse,
        work: t(SparseTable::Work),
        slices: t(SparseTable::Slices),
        segs: t(SparseTable::Segs),
        tile_ref: t(SparseTable::Ref),
        blocks: t(SparseTable::Blocks),
        nonfinite: (flag, 1),
        scale_log2: spec.attn.scale * LOG2E,
        heads_q: d.heads_q as u32,
        heads_kv: d.heads_kv as u32,
        total_q: d.total_q as u32,
        hp: sp.hp,
        n_slots: 0,
        inf: f32::INFINITY,
        k_block: spec.k_block as u32,
        tiles_per_block: sp.tiles_per_block,
        win_l,
        win_r,
        kv_outer: 0,
    };
    launch(&f, (sp.n_items as u32 * sp.ys, 1, 1), &mut args.args(), stream)?;
    let exact = SparseExact {
        work: t(SparseTable::Work),
        slices: t(SparseTable::Slices),
        segs: t(SparseTable::Segs),
        tile_ref: t(SparseTable::Ref),
        blocks: t(SparseTable::Blocks),
        hp: sp.hp,
        n_items: sp.n_items as u32,
        n_ys: sp.ys,
        k_block: spec.k_block as u32,
        tiles_per_block: sp.tiles_per_block,
    };
    launch_sparse_exact(be, spec.attn, p, flag, &exact, (win_l, win_r), stream)
}

#[cfg(test)]
mod tests {
    use crate::backend::Pass;
    use crate::dtype::DType;
    use crate::error::Error;
    use crate::spec::{AttnSpec, TensorMeta};

    /// One sequence of 64 queries and `sk` keys, one head, one listed key block.
    fn one_block(sk: usize, k_block: usize) -> AttnSpec {
        let q = TensorMeta::new(&[64, 1, 64], DType::BF16);
        let k = TensorMeta::new(&[sk, 1, 64], DType::BF16);
        let a = AttnSpec::varlen(&q, &k, &k, &[0, 64], &[0, sk as i32], 64, sk, None, false).unwrap();
        a.with_block_index(&[0], &[1, 1, 1, 1], 64, k_block, None).unwrap()
    }

    #[test]
    fn tile_index_range_is_checked_before_launch() {
        let check = |s: &AttnSpec| super::super::check_supported(s, Pass::Forward);
        // the kernels divide tile indices with one mul_hi: exact while key blocks * (k_block/64)^2 < 2^32
        assert!(check(&one_block(1 << 20, 1 << 16)).is_ok()); // 16 * 1024^2 = 2^24
        match check(&one_block(1 << 22, 1 << 22)) {
            // one key block of 65536 tiles: 65536^2 = 2^32
            Err(Error::Unsupported { backend: "cuda", msg }) => {
                assert!(msg.contains("1 key blocks of k_block = 4194304"), "{msg}");
                assert!(msg.contains("runs on the CPU"), "{msg}");
            }
            other => panic!("expected Unsupported, got {other:?}"),
        }
    }
}
