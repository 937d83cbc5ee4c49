//! Head dims without a kernel of their own (40, 80, 112, 160, ... : every head_dim up to 256 that
//! is not one of [`super::head_dims_of`]): the call runs on the smallest kernel head dim above
//! it, on a Hopper GPU the smallest of the wgmma kernels' (80 runs at 128 there, not on the
//! mma.sync kernels of 96; 96 itself too, and the 32 backward at 64, but for decode-sized calls:
//! [`padded`]). So does a call whose v has a head_dim of its own (`Dims::head_dim_v`, DeepSeek's
//! MLA: 192 / 128), at the wider of the two, except on the Hopper kernels that run v at v's own
//! head_dim (the forward's warp-specialised frame, `forward::value_dim_native`; the backward above
//! head_dim 128, `backward::value_dim_native`), so a 192 / 128 call has no copies, and a 160 / 128
//! one copies q and k (and dq, dk) only. q, k, v (and out, dout in the backward) are copied
//! into the workspace with zero columns after the caller's (`kernels::pad_cols`; a tensor that
//! already has the kernels' head_dim is read or written in place), the kernels of the wider head
//! dim run on the copies, and the outputs are copied back without the extra columns. Zero columns
//! add nothing to q.k
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

use super::backward::{self, bwd_workspace, dq_mode, BwdPtrs, DqPath};
use super::compile::{codegen, Source, A};
use super::device_io::{check_workspace, has_work};
use super::forward::{self, aligned, layout, max_seg_rows, FwdPtrs, FEW_ROWS, SM90_FWD_HEAD_DIMS};
use super::launch::{grid_2d, launch, Args};
use super::word_copy::{copy_width, word_copy_kernel, WordCopy};
use super::{head_dims_of, CudaBackend, SPARSE_HEAD_DIMS};
use crate::backend::{Backend, Pass};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::pad_cols::{copy_cols, PAD_THREADS};
use crate::spec::AttnSpec;

/// The spec the kernels run for `pass` of `spec` when its head_dim has no kernel, or when v's
/// head_dim is not q's and k's: the same call at one head_dim, the wider of the two where it has
/// a kernel, else the smallest kernel head dim above it; with `wgmma` (the call runs on the Hopper
/// kernels: [`wgmma_padding`]) the smallest of theirs (`forward::SM90_FWD_HEAD_DIMS`: 64,
/// 128, 192, 256; head_dim 80 on the d128 wgmma kernels took less time than on the d96 mma.sync
/// ones). `None` when the head_dim has its own kernel and v shares it, when no kernel head dim is
/// wider, and for the INT8 QK^T option. With `wgmma`, head_dim 96 has its own (mma.sync) kernels
/// but runs padded to 128 too, and the head_dim 32 backward padded to 64, except on decode-sized
/// calls ([`to_wgmma`]). On Hopper a call whose v is narrower keeps v's head_dim where
/// `forward::value_dim_native` (the forward) or `backward::value_dim_native` (the backward,
/// above head_dim 128) holds (`None` when q's has a kernel too).
pub(crate) fn padded(spec: &AttnSpec, pass: Pass, wgmma: bool) -> Option<AttnSpec> {
    let hd = spec.dims.head_dim.max(spec.dims.head_dim_v);
    let dims: &[usize] = match spec.block_sparse() {
        Some(s) if s.int8.is_some() => return None,
        Some(_) => &SPARSE_HEAD_DIMS,
        None => head_dims_of(pass),
    };
    let own = dims.contains(&hd) && !(wgmma && to_wgmma(spec, hd, pass));
    if own && spec.dims.is_uniform() {
        return None;
    }
    let fits = |d: &usize| *d > hd && (!wgmma || SM90_FWD_HEAD_DIMS.contains(d));
    let d = if own { hd } else { dims.iter().copied().filter(fits).min()? };
    let mut s = spec.clone();
    if wgmma && value_dim_native(spec, pass, d) {
        if d == spec.dims.head_dim {
            return None;
        }
        s.dims.head_dim = d;
        return Some(s);
    }
    s.dims = s.dims.at_head_dim(d);
    Some(s)
}

/// Whether `pass` of `spec`, q and k at head_dim `hd`, runs v at v's own head_dim on a GPU with
/// wgmma (`forward::value_dim_native`, `backward::value_dim_native`).
pub(crate) fn value_dim_native(spec: &AttnSpec, pass: Pass, hd: usize) -> bool {
    match pass {
        Pass::Forward => forward::value_dim_native(spec, hd),
        Pass::Backward { .. } => backward::value_dim_native(spec, hd),
    }
}

/// Whether a call whose wider head_dim `hd` has mma.sync kernels of its own runs `pass` on the
/// next wgmma kernels instead (on a GPU with them): dense calls with more than `FEW_ROWS` packed
/// rows in a sequence, at head_dim 96 (both passes, on the d128 kernels) and at head_dim 32 (the
/// backward, on the d64 kernels). There the copies cost little beside the products. Head_dim 80
/// padded to 128 took 11-19% less forward time and 28-32% less fwd+bwd time than head_dim 96 on
/// its mma.sync kernels (H200, 32 / 8 heads, 8K-16K, bench/results/h200-2026-12-02-head-pad);
/// head_dim 32 padded to 64 (the copies made by torch) 11-23% less fwd+bwd time than on its own
/// kernels, its forward 0-7% more, so the d32 forward keeps them
/// (bench/results/h200-2026-12-02-mla, d32). Decode-sized calls keep their kernels: they read K
/// and V once, and the copies would read and write them again.
fn to_wgmma(spec: &AttnSpec, hd: usize, pass: Pass) -> bool {
    let wider = match pass {
        Pass::Forward => hd == 96,
        Pass::Backward { .. } => hd == 96 || hd == 32,
    };
    wider && spec.block_sparse().is_none() && max_seg_rows(spec) > FEW_ROWS
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
            msg: format!("head_dim {} runs on the head_dim {} kernels with zero columns: {msg}", head_dims(spec), ps.dims.head_dim),
        },
        other => other,
    })
}

/// `spec`'s head_dim as messages name it: `192 (v: 128)` where v's differs.
fn head_dims(spec: &AttnSpec) -> String {
    let d = &spec.dims;
    if d.is_uniform() {
        d.head_dim.to_string()
    } else {
        format!("{} (v: {})", d.head_dim, d.head_dim_v)
    }
}

/// One of a call's tensors as the copies see it: dq, out's gradient dout, dk and dv are copied
/// like q, out, k and v.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Q,
    K,
    V,
    Out,
}

impl Part {
    /// Rows (one token of one head) and columns of this tensor in `spec` (the caller's, or the
    /// padded spec the kernels run).
    fn shape(self, spec: &AttnSpec) -> (usize, usize) {
        let d = &spec.dims;
        let (q_rows, k_rows) = (d.total_q * d.heads_q, d.total_k * d.heads_kv);
        match self {
            Part::Q => (q_rows, d.head_dim),
            Part::K => (k_rows, d.head_dim),
            Part::V => (k_rows, d.head_dim_v),
            Part::Out => (q_rows, d.head_dim_v),
        }
    }

    /// This tensor's columns in the padded spec `ps` the kernels run.
    fn cols(self, ps: &AttnSpec) -> usize {
        self.shape(ps).1
    }

    /// Whether the kernels of `ps` read or write the caller's tensor in place (it has their
    /// width already: q and k of a 192 / 128 call), so it has no copy.
    fn in_place(self, spec: &AttnSpec, ps: &AttnSpec) -> bool {
        self.shape(spec).1 == self.cols(ps)
    }

    /// Workspace bytes of this tensor's copy at its width in `ps` (0 in place).
    fn copy_bytes(self, spec: &AttnSpec, ps: &AttnSpec) -> usize {
        if self.in_place(spec, ps) {
            return 0;
        }
        self.shape(spec).0 * self.cols(ps) * ps.dtype.size()
    }
}

/// The forward's tensors in workspace order: q, k, v, out.
const FWD_PARTS: [Part; 4] = [Part::Q, Part::K, Part::V, Part::Out];
/// The backward's: q, k, v, out, dout, dq, dk, dv.
const BWD_PARTS: [Part; 8] = [Part::Q, Part::K, Part::V, Part::Out, Part::Out, Part::Q, Part::K, Part::V];

/// Workspace parts of `spec` padded to `ps`: the copies of `parts`, then the kernels' own `inner`.
fn parts_of<const N: usize, const M: usize>(spec: &AttnSpec, ps: &AttnSpec, parts: [Part; N], inner: usize) -> [usize; M] {
    std::array::from_fn(|i| if i < N { parts[i].copy_bytes(spec, ps) } else { inner })
}

/// Forward workspace parts: q, k, v, out at the padded head_dim, then the kernels' own `inner`.
fn fwd_parts(spec: &AttnSpec, ps: &AttnSpec, inner: usize) -> [usize; 5] {
    parts_of(spec, ps, FWD_PARTS, inner)
}

/// Backward workspace parts: q, k, v, out, dout, dq, dk, dv at the padded head_dim, then `inner`.
fn bwd_parts(spec: &AttnSpec, ps: &AttnSpec, inner: usize) -> [usize; 9] {
    parts_of(spec, ps, BWD_PARTS, inner)
}

/// Workspace bytes of `spec`'s forward padded to `ps`, whose kernels need `inner` bytes.
pub(crate) fn fwd_workspace(spec: &AttnSpec, ps: &AttnSpec, inner: usize) -> usize {
    layout(&fwd_parts(spec, ps, inner)).1
}

/// Workspace bytes of `spec`'s backward padded to `ps`, whose kernels need `inner` bytes.
pub(crate) fn bwd_workspace_padded(spec: &AttnSpec, ps: &AttnSpec, inner: usize) -> usize {
    layout(&bwd_parts(spec, ps, inner)).1
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

/// The row copies of one padded call: the caller's `spec`, the padded spec `ps` the kernels run.
struct Copies<'a> {
    spec: &'a AttnSpec,
    ps: &'a AttnSpec,
    stream: CUstream,
}

impl Copies<'_> {
    /// Enqueues the copy of `part`'s rows from `src_cols` columns at `src` to `out_cols` at `out`.
    unsafe fn rows(&self, be: &CudaBackend, part: Part, src: u64, src_cols: usize, out: u64, out_cols: usize) -> Result<()> {
        copy(be, src, src_cols, out, out_cols, part.shape(self.spec).0, self.spec.dtype.size(), self.stream)
    }

    /// Where the kernels read input `part`: the caller's tensor at `src` in place, or its copy
    /// at `at` with zero columns after the caller's (enqueued here).
    unsafe fn input(&self, be: &CudaBackend, part: Part, src: u64, at: u64) -> Result<u64> {
        if part.in_place(self.spec, self.ps) {
            return Ok(src);
        }
        self.rows(be, part, src, part.shape(self.spec).1, at, part.cols(self.ps))?;
        Ok(at)
    }

    /// Where the kernels write output `part`: the caller's tensor at `dst` in place, or the
    /// workspace at `at` ([`Self::narrow`] copies it back).
    fn output(&self, part: Part, dst: u64, at: u64) -> u64 {
        if part.in_place(self.spec, self.ps) {
            dst
        } else {
            at
        }
    }

    /// The kernels' output `part` at `at` into the caller's tensor at `dst`, without the extra
    /// columns (nothing where the kernels wrote `dst` in place).
    unsafe fn narrow(&self, be: &CudaBackend, part: Part, at: u64, dst: u64) -> Result<()> {
        if part.in_place(self.spec, self.ps) {
            return Ok(());
        }
        self.rows(be, part, at, part.cols(self.ps), dst, part.shape(self.spec).1)
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
        let parts = fwd_parts(spec, ps, self.forward_workspace(ps, stream)?);
        let at = part_addrs(&parts, p.workspace, workspace_bytes)?;
        let c = Copies { spec, ps, stream: stream as CUstream };
        let q = c.input(self, Part::Q, p.q, at[0])?;
        let k = c.input(self, Part::K, p.k, at[1])?;
        let v = c.input(self, Part::V, p.v, at[2])?;
        let out = c.output(Part::Out, p.out, at[3]);
        let inner_p = FwdPtrs { q, k, v, out, lse: p.lse, workspace: at[4] };
        self.forward_device(ps, inner_p, parts[4], stream)?;
        c.narrow(self, Part::Out, at[3], p.out)?;
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
        let parts = bwd_parts(spec, ps, bwd_inner(Some(self), ps, deterministic, path));
        let at = part_addrs(&parts, p.workspace, workspace_bytes)?;
        let c = Copies { spec, ps, stream: stream as CUstream };
        let inner_p = BwdPtrs {
            q: c.input(self, Part::Q, p.q, at[0])?,
            k: c.input(self, Part::K, p.k, at[1])?,
            v: c.input(self, Part::V, p.v, at[2])?,
            out: c.input(self, Part::Out, p.out, at[3])?,
            lse: p.lse,
            dout: c.input(self, Part::Out, p.dout, at[4])?,
            dq: c.output(Part::Q, p.dq, at[5]),
            dk: c.output(Part::K, p.dk, at[6]),
            dv: c.output(Part::V, p.dv, at[7]),
            workspace: at[8],
        };
        self.backward_device_on(ps, inner_p, path, deterministic, parts[8], stream)?;
        for (part, i, dst) in [(Part::Q, 5, p.dq), (Part::K, 6, p.dk), (Part::V, 7, p.dv)] {
            c.narrow(self, part, at[i], dst)?;
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
                // on Hopper: 96 on the d128 wgmma kernels, the 32 backward on the d64 ones, but
                // for decode-sized calls
                let want = match d {
                    96 => Some(128),
                    32 if pass != Pass::Forward => Some(64),
                    _ => None,
                };
                assert_eq!(to(d, pass, true), want, "head_dim {d} wgmma {pass:?}");
            }
            let m = |n, d| TensorMeta::new(&[n, 2, d], DType::BF16);
            for d in [32, 96] {
                let decode = AttnSpec::varlen(&m(2, d), &m(512, d), &m(512, d), &[0, 1, 2], &[0, 256, 512], 1, 256, None, true).unwrap();
                assert!(padded(&decode, pass, true).is_none(), "decode-sized head_dim {d} keeps its kernels");
            }
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
    fn v_of_another_head_dim_runs_at_the_wider_one() {
        let m = |d| TensorMeta::new(&[128, 2, d], DType::BF16);
        let mixed = |d, dv| AttnSpec::varlen(&m(d), &m(d), &m(dv), &[0, 128], &[0, 128], 128, 128, None, true).unwrap();
        let bwd = Pass::Backward { deterministic: true };
        // (d, dv, any GPU, Hopper backward, Hopper forward as (q's, v's) head_dim; None: as it is)
        let cases = [
            (192, 128, 192, None, None),
            (128, 192, 192, Some((192, 192)), Some((192, 192))),
            (64, 128, 128, Some((128, 128)), Some((128, 128))),
            (128, 64, 128, Some((128, 128)), None),
            (40, 24, 64, Some((64, 64)), Some((64, 64))),
            (96, 64, 96, Some((128, 128)), Some((128, 64))),
            (80, 8, 96, Some((128, 128)), Some((128, 128))),
            (160, 128, 192, Some((192, 128)), Some((192, 128))),
            (256, 192, 256, None, None),
        ];
        for (d, dv, any, hopper_bwd, hopper_fwd) in cases {
            let s = mixed(d, dv);
            for (pass, wgmma, want) in [(Pass::Forward, false, Some((any, any))), (bwd, false, Some((any, any))), (bwd, true, hopper_bwd), (Pass::Forward, true, hopper_fwd)] {
                let p = padded(&s, pass, wgmma);
                assert_eq!(p.as_ref().map(|p| (p.dims.head_dim, p.dims.head_dim_v)), want, "{d}/{dv} {pass:?} wgmma {wgmma}");
                // the scale stays q's
                assert!(p.is_none_or(|p| p.scale == s.scale));
            }
        }
        // q and k of a padded 192 / 128 backward are read in place: only v, out (and dout, dv) are copied
        let (s, ps) = (mixed(192, 128), padded(&mixed(192, 128), bwd, false).unwrap());
        assert!(Part::Q.in_place(&s, &ps) && Part::K.in_place(&s, &ps) && !Part::V.in_place(&s, &ps) && !Part::Out.in_place(&s, &ps));
        assert_eq!(fwd_parts(&s, &ps, 0)[..4], [0, 0, 128 * 2 * 192 * 2, 128 * 2 * 192 * 2]);
        // a 160 / 128 call on Hopper copies q and k (and dq, dk) to 192 columns; v, out (and dout,
        // dv) stay in place
        let (s, ps) = (mixed(160, 128), padded(&mixed(160, 128), Pass::Forward, true).unwrap());
        assert!(!Part::Q.in_place(&s, &ps) && !Part::K.in_place(&s, &ps) && Part::V.in_place(&s, &ps) && Part::Out.in_place(&s, &ps));
        assert_eq!(fwd_parts(&s, &ps, 0)[..4], [128 * 2 * 192 * 2, 128 * 2 * 192 * 2, 0, 0]);
        let ps = padded(&s, bwd, true).unwrap();
        let qk = 128 * 2 * 192 * 2;
        assert_eq!(bwd_parts(&s, &ps, 0)[..8], [qk, qk, 0, 0, 0, qk, qk, 0]);
        // decode-sized calls (at most FEW_ROWS packed rows a sequence) keep one head_dim
        let m1 = |n, d| TensorMeta::new(&[n, 2, d], DType::BF16);
        let decode = AttnSpec::varlen(&m1(2, 192), &m1(512, 192), &m1(512, 128), &[0, 1, 2], &[0, 256, 512], 1, 256, None, true).unwrap();
        assert_eq!(padded(&decode, Pass::Forward, true).map(|p| (p.dims.head_dim, p.dims.head_dim_v)), Some((192, 192)));
    }

    #[test]
    fn workspace_holds_the_padded_copies() {
        let s = spec(80);
        let ps = padded(&s, Pass::Forward, true).unwrap();
        // q, k, v, out at head_dim 128 in bf16 before the kernels' own bytes
        let copies = (128 * 2 * 128 + 2 * 256 * 2 * 128 + 128 * 2 * 128) * 2;
        assert!(fwd_workspace(&s, &ps, 0) >= copies && fwd_workspace(&s, &ps, 1000) >= copies + 1000);
        assert!(bwd_workspace_padded(&s, &ps, 0) >= copies + (2 * 128 * 2 * 128 + 2 * 256 * 2 * 128) * 2);
    }
}
