//! Head dims without a kernel of their own (40, 80, 112, 160, ... : every head_dim up to 256 that
//! is not one of [`super::head_dims_of`]): the call runs on the smallest kernel head dim above
//! it, on a Hopper GPU the smallest of the wgmma kernels' (80 runs at 128 there, not on the
//! mma.sync kernels of 96; 96 itself too, but for decode-sized calls: [`padded`]). q, k, v (and
//! out, dout in the backward) are copied into the workspace with zero columns after the caller's
//! (`kernels::pad_cols`), the kernels of the wider head dim run on the copies, and the outputs are
//! copied back without the extra columns. Zero columns add nothing to q.k
//! and give zero columns of out, dq, dk and dv, and the scale is the spec's own (resolved from the
//! caller's head_dim), so the result is the call's, not an approximation. The copies cost two
//! passes over each tensor; FlashAttention-3 pads the same way inside its tiles.
//!
//! Block-sparse calls pad to the block-sparse kernels' head dims; the INT8 QK^T option keeps its
//! own head dims (its quantisation reads the columns), and the kvcache path with device key counts
//! serves the kernels' own head dims only (the caller reads the counts on the host otherwise).

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::{ComputeClient, Int, KernelSettings};
use cudarc::driver::sys::CUstream;

use super::backward::{bwd_workspace, dq_mode, BwdPtrs, DqPath};
use super::compile::{codegen, Source, A};
use super::device_io::{check_workspace, has_work};
use super::forward::{aligned, layout, max_seg_rows, FwdPtrs, FEW_ROWS, SM90_FWD_HEAD_DIMS};
use super::launch::{grid_2d, launch, Args};
use super::word_copy::{copy_width, word_copy_kernel, WordCopy};
use super::{head_dims_of, CudaBackend, SPARSE_HEAD_DIMS};
use crate::backend::{Backend, Pass};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::pad_cols::{copy_cols, PAD_THREADS};
use crate::spec::AttnSpec;

/// The spec the kernels run for `pass` of `spec` when its head_dim has no kernel: the same call at
/// the smallest kernel head dim above it; with `wgmma` (the call runs on the Hopper kernels:
/// [`wgmma_padding`]) the smallest of theirs (`forward::SM90_FWD_HEAD_DIMS`: 64,
/// 128, 192, 256; head_dim 80 on the d128 wgmma kernels took less time than on the d96 mma.sync
/// ones). `None` when the head_dim has its own kernel, when no kernel head dim is wider, and for
/// the INT8 QK^T option. With `wgmma`, head_dim 96 has its own (mma.sync) kernels but runs padded
/// to 128 too, except on decode-sized calls ([`wide_96`]).
pub(crate) fn padded(spec: &AttnSpec, pass: Pass, wgmma: bool) -> Option<AttnSpec> {
    let hd = spec.dims.head_dim;
    let dims: &[usize] = match spec.block_sparse() {
        Some(s) if s.int8.is_some() => return None,
        Some(_) => &SPARSE_HEAD_DIMS,
        None => head_dims_of(pass),
    };
    if dims.contains(&hd) && !(wgmma && wide_96(spec)) {
        return None;
    }
    let fits = |d: &usize| *d > hd && (!wgmma || SM90_FWD_HEAD_DIMS.contains(d));
    let d = dims.iter().copied().filter(fits).min()?;
    let mut s = spec.clone();
    s.dims.head_dim = d;
    Some(s)
}

/// Whether a head_dim 96 call runs on the d128 wgmma kernels (on a GPU with them): dense calls
/// with more than `FEW_ROWS` packed rows in a sequence. There the copies cost little beside the
/// products, and head_dim 80 padded to 128 took 11-19% less forward time and 28-32% less
/// fwd+bwd time than head_dim 96 on its mma.sync kernels (H200, 32 / 8 heads, 8K-16K,
/// bench/results/h200-2026-12-02-head-pad). Decode-sized calls keep the d96 kernels: they read
/// K and V once, and the copies would read and write them again.
fn wide_96(spec: &AttnSpec) -> bool {
    spec.dims.head_dim == 96 && spec.block_sparse().is_none() && max_seg_rows(spec) > FEW_ROWS
}

/// Whether a padded `spec` runs on the Hopper (wgmma) kernels' head dims on `be` (sm_90 with
/// wgmma, f16 / bf16, the Hopper switch `FwdOptions::sm90` on), or without a backend (the VRAM
/// estimate) as on a Hopper GPU.
pub(crate) fn wgmma_padding(be: Option<&CudaBackend>, spec: &AttnSpec) -> bool {
    crate::config::fwd_options().sm90 && spec.dtype != DType::F32 && be.is_none_or(|b| b.target().wgmma)
}

/// `check` of the padded spec `ps`, its refusal saying that `spec`'s head_dim runs as `ps`'s.
pub(crate) fn check_as(spec: &AttnSpec, ps: &AttnSpec, check: impl FnOnce(&AttnSpec) -> Result<()>) -> Result<()> {
    check(ps).map_err(|e| match e {
        Error::Unsupported { backend, msg } => Error::Unsupported {
            backend,
            msg: format!("head_dim {} runs on the head_dim {} kernels with zero columns: {msg}", spec.dims.head_dim, ps.dims.head_dim),
        },
        other => other,
    })
}

/// Bytes of the padded copies: (q-shaped, k-shaped) tensors at `ps`'s head_dim.
fn copy_bytes(ps: &AttnSpec) -> (usize, usize) {
    let es = ps.dtype.size();
    (ps.dims.q_len() * es, ps.dims.kv_len() * es)
}

/// Forward workspace parts: q, k, v, out at the padded head_dim, then the kernels' own `inner`.
fn fwd_parts(ps: &AttnSpec, inner: usize) -> [usize; 5] {
    let (q, kv) = copy_bytes(ps);
    [q, kv, kv, q, inner]
}

/// Backward workspace parts: q, k, v, out, dout, dq, dk, dv at the padded head_dim, then `inner`.
fn bwd_parts(ps: &AttnSpec, inner: usize) -> [usize; 9] {
    let (q, kv) = copy_bytes(ps);
    [q, kv, kv, q, q, q, kv, kv, inner]
}

/// Workspace bytes of a padded forward whose kernels need `inner` bytes.
pub(crate) fn fwd_workspace(ps: &AttnSpec, inner: usize) -> usize {
    layout(&fwd_parts(ps, inner)).1
}

/// Workspace bytes of a padded backward whose kernels need `inner` bytes.
pub(crate) fn bwd_workspace_padded(ps: &AttnSpec, inner: usize) -> usize {
    layout(&bwd_parts(ps, inner)).1
}

/// The kernels' own backward workspace for the padded spec on dQ path `path`.
pub(crate) fn bwd_inner(be: Option<&CudaBackend>, ps: &AttnSpec, deterministic: bool, path: DqPath) -> usize {
    bwd_workspace(ps, dq_mode(be, ps, deterministic, path))
}

/// `kernels::pad_cols::copy_cols` for [`word_copy_kernel`].
struct CopyColsKernel;

impl WordCopy for CopyColsKernel {
    const NAME: &'static str = "pad_cols_copy_cols";
    const THREADS: usize = PAD_THREADS;
    fn source<W: Int>(s: KernelSettings, client: &ComputeClient<CudaRuntime>, n: usize) -> Result<Source> {
        codegen(copy_cols::CopyCols::<W, CudaRuntime>::new(s, client.clone(), A, A, (), (), (), n))
    }
}

/// Enqueues the copy of `rows` rows of `src_cols` elements at `src` into rows of `out_cols`
/// elements at `out` (`es` bytes an element): zero columns after the source's when the output is
/// wider, the source's first `out_cols` when it is narrower.
#[allow(clippy::too_many_arguments)]
unsafe fn copy(be: &CudaBackend, src: u64, src_cols: usize, out: u64, out_cols: usize, rows: usize, es: usize, s: CUstream) -> Result<()> {
    let (sb, ob) = (src_cols * es, out_cols * es);
    if rows == 0 || ob == 0 {
        return Ok(());
    }
    // (powers of two: the narrower of the two widths divides both row lengths)
    let width = copy_width(sb, src, out).min(copy_width(ob, src, out));
    let (sv, ov) = (sb / width, ob / width);
    let n_vecs = rows as u64 * ov as u64;
    let grid = grid_2d((n_vecs as usize).div_ceil(PAD_THREADS));
    // the kernel's unit index is a u32 over the whole (padded) grid
    let units = grid.0 as u64 * grid.1 as u64 * PAD_THREADS as u64;
    if n_vecs > u32::MAX as u64 || rows as u64 * sv as u64 > u32::MAX as u64 || units > 1 << 32 {
        return Err(Error::Unsupported {
            backend: "cuda",
            msg: format!("{rows} rows of head_dim {src_cols} -> {out_cols} are too many for the padding copy's 32-bit indexing"),
        });
    }
    let f = word_copy_kernel::<CopyColsKernel>(be, width)?;
    let mut a = Args::new();
    a.array(src, rows * sv).array(out, n_vecs as usize);
    a.u32(sv as u32).u32(ov as u32).u32(n_vecs as u32);
    launch(&f, grid, &mut a, s)
}

/// The workspace address of each part of a padded call's `parts` (after checking the caller's
/// `workspace_bytes` at `workspace` holds them).
fn part_addrs<const N: usize>(parts: &[usize; N], workspace: u64, workspace_bytes: usize) -> Result<[u64; N]> {
    let (offs, total) = layout(parts);
    check_workspace(total, workspace, workspace_bytes)?;
    Ok(std::array::from_fn(|i| workspace + offs[i] as u64))
}

/// The row copies of one padded call: the caller's head_dim `hd`, the kernels' `hp`.
struct Copies {
    hd: usize,
    hp: usize,
    es: usize,
    /// rows of q-shaped and of k-shaped tensors (one row: one token of one head)
    rows_q: usize,
    rows_k: usize,
    stream: CUstream,
}

impl Copies {
    fn new(spec: &AttnSpec, ps: &AttnSpec, stream: u64) -> Self {
        let d = &spec.dims;
        Copies {
            hd: d.head_dim,
            hp: ps.dims.head_dim,
            es: spec.dtype.size(),
            rows_q: d.total_q * d.heads_q,
            rows_k: d.total_k * d.heads_kv,
            stream: stream as CUstream,
        }
    }

    fn rows(&self, q_rows: bool) -> usize {
        if q_rows {
            self.rows_q
        } else {
            self.rows_k
        }
    }

    /// The caller's tensor at `src` into the wider copy at `out` (q-shaped rows or k-shaped).
    unsafe fn widen(&self, be: &CudaBackend, src: u64, out: u64, q_rows: bool) -> Result<()> {
        copy(be, src, self.hd, out, self.hp, self.rows(q_rows), self.es, self.stream)
    }

    /// The wider result at `src` into the caller's tensor at `out`.
    unsafe fn narrow(&self, be: &CudaBackend, src: u64, out: u64, q_rows: bool) -> Result<()> {
        copy(be, src, self.hp, out, self.hd, self.rows(q_rows), self.es, self.stream)
    }
}

impl CudaBackend {
    /// The forward of `spec` on the kernels of the padded spec `ps` (see the module docs).
    ///
    /// # Safety
    /// As for [`Backend::forward_device`], with `spec`'s shapes.
    pub(crate) unsafe fn forward_padded(&self, spec: &AttnSpec, ps: &AttnSpec, p: FwdPtrs, workspace_bytes: usize, stream: u64) -> Result<bool> {
        aligned(&[("lse", p.lse), ("workspace", p.workspace)])?;
        if !has_work(spec) {
            return Ok(false);
        }
        let parts = fwd_parts(ps, self.forward_workspace(ps, stream)?);
        let at = part_addrs(&parts, p.workspace, workspace_bytes)?;
        let c = Copies::new(spec, ps, stream);
        for (src, i, q_rows) in [(p.q, 0, true), (p.k, 1, false), (p.v, 2, false)] {
            c.widen(self, src, at[i], q_rows)?;
        }
        let inner_p = FwdPtrs { q: at[0], k: at[1], v: at[2], out: at[3], lse: p.lse, workspace: at[4] };
        self.forward_device(ps, inner_p, parts[4], stream)?;
        c.narrow(self, at[3], p.out, true)?;
        Ok(true)
    }

    /// The backward of `spec` on the kernels of the padded spec `ps`, dQ path `path`.
    ///
    /// # Safety
    /// As for [`Backend::backward_device`], with `spec`'s shapes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn backward_padded(
        &self,
        spec: &AttnSpec,
        ps: &AttnSpec,
        p: BwdPtrs,
        path: DqPath,
        deterministic: bool,
        workspace_bytes: usize,
        stream: u64,
    ) -> Result<bool> {
        aligned(&[("lse", p.lse), ("workspace", p.workspace)])?;
        if !has_work(spec) {
            return Ok(false);
        }
        let parts = bwd_parts(ps, bwd_inner(Some(self), ps, deterministic, path));
        let at = part_addrs(&parts, p.workspace, workspace_bytes)?;
        let c = Copies::new(spec, ps, stream);
        for (src, i, q_rows) in [(p.q, 0, true), (p.k, 1, false), (p.v, 2, false), (p.out, 3, true), (p.dout, 4, true)] {
            c.widen(self, src, at[i], q_rows)?;
        }
        let [q, k, v, out, dout, dq, dk, dv, workspace] = at;
        let inner_p = BwdPtrs { q, k, v, out, lse: p.lse, dout, dq, dk, dv, workspace };
        self.backward_device_on(ps, inner_p, path, deterministic, parts[8], stream)?;
        for (i, out, q_rows) in [(5, p.dq, true), (6, p.dk, false), (7, p.dv, false)] {
            c.narrow(self, at[i], out, q_rows)?;
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::SUPPORTED_HEAD_DIMS;
    use crate::spec::TensorMeta;

    fn spec(d: usize) -> AttnSpec {
        let m = |n| TensorMeta::new(&[n, 2, d], DType::BF16);
        AttnSpec::varlen(&m(128), &m(256), &m(256), &[0, 128], &[0, 256], 128, 256, None, true).unwrap()
    }

    fn to(d: usize, pass: Pass, wgmma: bool) -> Option<usize> {
        let s = spec(d);
        let p = padded(&s, pass, wgmma);
        if let Some(p) = &p {
            // only the head_dim moves: the scale stays the caller's
            assert_eq!((p.scale, p.dims.total_q, p.dims.heads_q), (s.scale, s.dims.total_q, s.dims.heads_q));
        }
        p.map(|p| p.dims.head_dim)
    }

    #[test]
    fn padding_picks_the_next_kernel_head_dim() {
        let bwd = Pass::Backward { deterministic: false };
        for pass in [Pass::Forward, bwd] {
            for (d, any, hopper) in [(1, 32, 64), (8, 32, 64), (33, 64, 64), (40, 64, 64), (80, 96, 128), (112, 128, 128), (160, 192, 192), (200, 256, 256), (255, 256, 256)] {
                assert_eq!(to(d, pass, false), Some(any), "head_dim {d} {pass:?}");
                assert_eq!(to(d, pass, true), Some(hopper), "head_dim {d} {pass:?} wgmma");
            }
            for d in SUPPORTED_HEAD_DIMS {
                assert_eq!(to(d, pass, false), None, "head_dim {d} has its own kernel");
                // 96 on Hopper: the d128 wgmma kernels, but for decode-sized calls
                assert_eq!(to(d, pass, true), (d == 96).then_some(128), "head_dim {d} wgmma");
            }
            let m = |n, d| TensorMeta::new(&[n, 2, d], DType::BF16);
            let decode = AttnSpec::varlen(&m(2, 96), &m(512, 96), &m(512, 96), &[0, 1, 2], &[0, 256, 512], 1, 256, None, true).unwrap();
            assert!(padded(&decode, pass, true).is_none(), "decode-sized head_dim 96 keeps its kernels");
        }
        // block-sparse: 64 / 128; the INT8 option is never padded
        let sparse = |d, int8| spec(d).with_block_index(&[0, 1, 0, 1], &[1, 2, 1, 2], 128, 128, int8).unwrap();
        assert_eq!(padded(&sparse(96, None), Pass::Forward, false).map(|p| p.dims.head_dim), Some(128));
        assert_eq!(padded(&sparse(96, None), Pass::Forward, true).map(|p| p.dims.head_dim), Some(128));
        assert_eq!(padded(&sparse(33, None), bwd, true).map(|p| p.dims.head_dim), Some(64));
        assert!(padded(&sparse(160, None), Pass::Forward, false).is_none());
        let int8 = Some(crate::sparse::Int8Qk { gran: crate::sparse::QuantGran::PerWarp, smooth_k: false, pv_fp8: false });
        assert!(padded(&sparse(96, int8), Pass::Forward, false).is_none());
    }

    #[test]
    fn workspace_holds_the_padded_copies() {
        let s = spec(80);
        let ps = padded(&s, Pass::Forward, true).unwrap();
        // q, k, v, out at head_dim 128 in bf16 before the kernels' own bytes
        let copies = (128 * 2 * 128 + 2 * 256 * 2 * 128 + 128 * 2 * 128) * 2;
        assert!(fwd_workspace(&ps, 0) >= copies && fwd_workspace(&ps, 1000) >= copies + 1000);
        assert!(bwd_workspace_padded(&ps, 0) >= copies + (2 * 128 * 2 * 128 + 2 * 256 * 2 * 128) * 2);
    }
}
