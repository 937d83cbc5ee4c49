//! CUDA block-sparse backward: the dense backward kernels with their tile iterators reading block
//! lists (`sparse = true`), so unlisted blocks are skipped, not masked. After delta = rowsum(dO O):
//! - dK/dV (`flash_bwd_dkdv_wide`): one cube per (work item, kv head); a work item is up to
//!   `WIDE_BN` (128) keys of one key block of one sequence. Its query tiles come from the transposed index (per
//!   (sequence, key block, index head) the query blocks listing the key block, ascending), built
//!   on the GPU by `kernels::sparse_index` (count, exclusive scan, ordered fill) right after the
//!   plan's tables are uploaded, once per plan. With an index per q head the cube walks the lists
//!   of its group's q heads one after the other (the union); with one per kv head, the one list
//!   once per q head of the group. Causal: query blocks entirely above the diagonal are not in
//!   the lists, the rest is masked per element.
//! - dQ (`flash_bwd_dq`): one cube per (work item, q head); a work item is up to `BWD_BM` rows of
//!   one query block of one sequence. Its key tiles are the query block's kept key blocks, the
//!   forward's lists: `tile_ref` (offset, key tiles) per (index head, item) into the validated
//!   index's block ids, cut, when causal, after the last block any row of the item sees.
//!
//! `deterministic = true`: every output element is written by one cube in a fixed order (no
//! atomics), so the gradients are bitwise identical run to run. `deterministic = false` (the
//! default; the dense calls' dQ rule, `backward::dq_mode`): the dK/dV kernel also forms
//! dQ += dS K per (query tile, key item) into an f32 accumulator with atomics (five products per
//! pair instead of seven) and the dQ pass is not run; dQ's summation order then varies run to run. The plan (tables and transposed index) is
//! cached on the device per (shape, index fingerprint); its memory is O(items x heads + kept
//! blocks + sequences x key blocks x index heads), never O(S^2).

use std::sync::Arc;

use cubecl::cuda::CudaRuntime;
use cudarc::driver::sys;

use super::backward::{
    launch_delta, launch_dkdv_wide, launch_dq, launch_dq_convert, launch_fill_zero, workspace_ptrs, BwdPtrs, DqMode,
    DkdvTables,
};
use super::compile::{codegen, settings, KernelKey, A};
use super::launch::{grid_2d, launch, Args};
use super::plans::{table_names, Cached, PlanKey, PlanKind, TableSet};
use super::CudaBackend;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::tiles::{BWD_BM, BWD_BN, SPARSE_KWORK_WORDS, SPARSE_QB_BITS, SPARSE_QB_MASK, SPARSE_QWORK_WORDS, WIDE_BN};
use crate::kernels::sparse_index::{self, SCAN_THREADS, TRANSPOSE_THREADS};
use crate::spec::SparseView;

/// Host part of a cached block-sparse backward plan.
pub(crate) struct SparseBwdPlan {
    n_q_items: usize,
    n_k_items: usize,
    /// Cells of the transposed index: sequences x key blocks (of the longest sequence) x index heads.
    n_cells: usize,
    k_blocks: usize,
    /// Some key belongs to no sequence (its dK, dV are zero-filled first).
    keys_uncovered: bool,
}

table_names! {
    /// The tables of a block-sparse backward plan.
    pub(crate) enum SparseBwdTable { Segs, QWork, QRef, Blocks, RowOff, KWork, TOff, TList }
}

impl PlanKind for SparseBwdPlan {
    type Table = SparseBwdTable;
}

impl SparseBwdPlan {
    fn build(spec: SparseView) -> (SparseBwdPlan, TableSet<SparseBwdTable>) {
        let a = &spec.attn;
        let ix = &spec.index;
        let tpb = spec.k_block.div_ceil(BWD_BN);
        let mut segs = Vec::with_capacity(a.segments.len() * 4);
        // dQ items: (cost, (sequence, first row, end row of the query block), query block, last row)
        let mut q_items: Vec<(usize, [u32; SPARSE_QWORK_WORDS], usize, usize)> = Vec::new();
        // dK/dV items: (first row that sees the first key, work words)
        let mut k_items: Vec<(usize, [u32; SPARSE_KWORK_WORDS])> = Vec::new();
        for (b, sg) in a.segments.iter().enumerate() {
            segs.extend_from_slice(&[sg.q_start as u32, sg.q_len as u32, sg.k_start as u32, sg.k_len as u32]);
            for qb in 0..sg.q_len.div_ceil(spec.q_block) {
                let (r0, r1) = (qb * spec.q_block, ((qb + 1) * spec.q_block).min(sg.q_len));
                for r in (r0..r1).step_by(BWD_BM) {
                    let last = (r + BWD_BM).min(r1) - 1;
                    q_items.push((0, [b as u32, r as u32, r1 as u32], qb, last));
                }
            }
            for kb in 0..sg.k_len.div_ceil(spec.k_block) {
                let (k0, k1) = (kb * spec.k_block, ((kb + 1) * spec.k_block).min(sg.k_len));
                for kw in (k0..k1).step_by(WIDE_BN) {
                    let r_min = if a.causal { (kw + sg.q_len).saturating_sub(sg.k_len) } else { 0 };
                    k_items.push((r_min, [b as u32, kw as u32, (kw + WIDE_BN).min(k1).saturating_sub(kw) as u32, kb as u32]));
                }
            }
        }
        // key tiles of item `x` for index head `y`: the kept blocks any of its rows can see
        let tiles = |y: usize, &(_, w, qb, last): &(usize, [u32; SPARSE_QWORK_WORDS], usize, usize)| {
            let id = (w[0] as usize * ix.heads + y) * ix.q_blocks + qb;
            let vis = a.segments[w[0] as usize].visible_len(last, a.causal);
            let kept = &ix.blocks[ix.offsets[id]..ix.offsets[id + 1]];
            (ix.offsets[id], kept.iter().take_while(|&&kb| (kb as usize) * spec.k_block < vis).count() * tpb)
        };
        for it in q_items.iter_mut() {
            it.0 = (0..ix.heads).map(|y| tiles(y, it).1).sum();
        }
        // most key tiles first (dQ), most query rows first (dK/dV): the long cubes start early
        q_items.sort_by_key(|x| std::cmp::Reverse(x.0));
        k_items.sort_by_key(|x| x.0);
        let mut q_ref = vec![0u32; q_items.len() * ix.heads * 2];
        for y in 0..ix.heads {
            for (x, it) in q_items.iter().enumerate() {
                let (off, n) = tiles(y, it);
                q_ref[(y * q_items.len() + x) * 2] = off as u32;
                q_ref[(y * q_items.len() + x) * 2 + 1] = n as u32;
            }
        }
        let k_blocks = spec.k_blocks();
        let n_cells = ix.batch * k_blocks * ix.heads;
        let covered: usize = a.segments.iter().map(|s| s.k_len).sum();
        let plan = SparseBwdPlan {
            n_q_items: q_items.len(),
            n_k_items: k_items.len(),
            n_cells,
            k_blocks,
            keys_uncovered: covered < a.dims.total_k,
        };
        let tables = TableSet::new()
            .with(SparseBwdTable::Segs, segs)
            .with(SparseBwdTable::QWork, q_items.iter().flat_map(|x| x.1).collect())
            .with(SparseBwdTable::QRef, q_ref)
            .with(SparseBwdTable::Blocks, ix.blocks.clone())
            .with(SparseBwdTable::RowOff, ix.offsets.iter().map(|&o| o as u32).collect())
            .with(SparseBwdTable::KWork, k_items.iter().flat_map(|x| x.1).collect())
            // the transposed index: filled on the device by `build_transposed`
            .with(SparseBwdTable::TOff, vec![0u32; n_cells + 1])
            .with(SparseBwdTable::TList, vec![0u32; ix.kept_total()]);
        (plan, tables)
    }
}

/// Err(Unsupported) for the block-sparse backward calls no CUDA kernel serves (those of the
/// forward, and indices too large for the transposed index's 32-bit entries).
pub(super) fn check_supported(spec: SparseView) -> Result<()> {
    super::sparse::check_supported(spec)?;
    let ix = &spec.index;
    let too_large = |what: String| Error::Unsupported { backend: "cuda", msg: format!("the block-sparse backward on CUDA: {what}; it runs on the CPU") };
    if ix.q_blocks > SPARSE_QB_MASK as usize + 1 {
        return Err(too_large(format!("{} query blocks exceed {}", ix.q_blocks, SPARSE_QB_MASK as usize + 1)));
    }
    if ix.heads >= 1 << (32 - SPARSE_QB_BITS) {
        return Err(too_large(format!("{} index heads exceed {}", ix.heads, (1usize << (32 - SPARSE_QB_BITS)) - 1)));
    }
    let cells = ix.batch as u64 * spec.k_blocks() as u64 * ix.heads as u64;
    if cells.max(ix.kept_total() as u64) >= u32::MAX as u64 / 2 {
        return Err(too_large(format!("{cells} (sequence, key block, head) cells or {} kept blocks exceed 32-bit tables", ix.kept_total())));
    }
    Ok(())
}

/// Enqueues the GPU build of the transposed index into the plan's `TOff` / `TList` tables
/// (count, exclusive scan, ordered fill; see `kernels::sparse_index`).
fn build_transposed(be: &CudaBackend, spec: SparseView, plan: &Cached<SparseBwdPlan>, stream: sys::CUstream) -> Result<()> {
    let sp = &plan.host;
    let t = |i| plan.tables.get(i);
    let n = sp.n_cells;
    for fill in [false, true] {
        let key = KernelKey::new("sparse_transpose", DType::F32, &[spec.attn.causal as u32, fill as u32]);
        let f = be.kernels.get(&key, || {
            codegen(sparse_index::sparse_transpose::SparseTranspose::<CudaRuntime>::new(
                settings(TRANSPOSE_THREADS as u32), be.client().clone(), A, A, A, A, A, (), (), (), (), (), (),
                spec.attn.causal, fill))
        })?;
        let mut a = Args::new();
        for i in [SparseBwdTable::RowOff, SparseBwdTable::Blocks, SparseBwdTable::Segs, SparseBwdTable::TOff, SparseBwdTable::TList] {
            a.array(t(i).0, t(i).1);
        }
        let ix = &spec.index;
        a.u32(ix.heads as u32).u32(ix.q_blocks as u32).u32(sp.k_blocks as u32).u32(spec.q_block as u32).u32(spec.k_block as u32).u32(n as u32);
        launch(&f, grid_2d(n.div_ceil(TRANSPOSE_THREADS)), &mut a, stream)?;
        if !fill {
            let f = be.kernels.get(&KernelKey::new("exclusive_scan", DType::F32, &[]), || {
                codegen(sparse_index::exclusive_scan::ExclusiveScan::<CudaRuntime>::new(
                    settings(SCAN_THREADS as u32), be.client().clone(), A, ()))
            })?;
            let mut a = Args::new();
            a.array(t(SparseBwdTable::TOff).0, t(SparseBwdTable::TOff).1).u32(n as u32);
            launch(&f, (1, 1, 1), &mut a, stream)?;
        }
    }
    Ok(())
}

/// Enqueues the block-sparse backward of `spec` on `stream` (its plan `plan`): reads q, k, v,
/// out, lse, dout and writes dq, dk, dv in place (rows and keys that see nothing get zeros);
/// `fused`: dQ through the f32 accumulator (`deterministic = false`), else the dQ pass.
pub(super) fn launch_sparse_backward(
    be: &CudaBackend,
    spec: SparseView,
    plan: &Cached<SparseBwdPlan>,
    p: &BwdPtrs,
    fused: bool,
    stream: sys::CUstream,
) -> Result<()> {
    let a = &spec.attn;
    let sp = &plan.host;
    let t = |i| plan.tables.get(i);
    let mode = if fused { DqMode::Fused } else { DqMode::Pass };
    let (delta, acc) = workspace_ptrs(a, mode, p.workspace);
    launch_delta(be, a, p, delta, stream)?;
    if fused {
        launch_fill_zero(DType::F32, acc, a.dims.q_len(), stream)?;
    }
    if sp.keys_uncovered {
        launch_fill_zero(a.dtype, p.dk, a.dims.kv_len(), stream)?;
        launch_fill_zero(a.dtype, p.dv, a.dims.kv_len(), stream)?;
    }
    let ix = &spec.index;
    // the accumulator's layout (all zeros, either way, without a dK/dV launch)
    let mut head_major = false;
    if sp.n_k_items > 0 {
        // the dense tile lists are not read by the sparse variant: any valid address
        let none = (t(SparseBwdTable::Segs).0, 1);
        let tables = DkdvTables { work: t(SparseBwdTable::KWork), tile_off: none, tile_segs: none, segs: t(SparseBwdTable::Segs), tq_off: t(SparseBwdTable::TOff), tq_list: t(SparseBwdTable::TList) };
        let q_tiles = spec.q_block.div_ceil(BWD_BM) as u32;
        let scalars = [spec.q_block as u32, ix.heads as u32, sp.k_blocks as u32, q_tiles];
        head_major = launch_dkdv_wide(be, a, p, delta, fused.then_some(acc), &tables, Some(scalars), sp.n_k_items, stream)?;
    }
    if fused {
        launch_dq_convert(be, a, p, acc, head_major, stream)?;
    } else if sp.n_q_items > 0 {
        let tables = [t(SparseBwdTable::QWork), t(SparseBwdTable::Segs), t(SparseBwdTable::QRef), t(SparseBwdTable::Blocks)];
        let scalars = [ix.heads as u32, spec.k_block as u32, spec.k_block.div_ceil(BWD_BN) as u32];
        launch_dq(be, a, p, delta, tables, Some(scalars), sp.n_q_items, stream)?;
    }
    Ok(())
}

impl CudaBackend {
    /// The cached backward plan of `spec`, its transposed index built on the GPU (on `stream`)
    /// when new.
    pub(super) fn sparse_bwd_plan(&self, spec: SparseView, stream: sys::CUstream) -> Result<Arc<Cached<SparseBwdPlan>>> {
        self.sparse_bwd_plans.get_init(
            PlanKey::with_extra(spec.attn, 0, spec.fingerprint()),
            stream,
            || SparseBwdPlan::build(spec),
            |plan| build_transposed(self, spec, plan, stream),
        )
    }
}
