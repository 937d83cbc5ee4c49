//! Host side of the non-finite-v route of the f16/bf16 forward (`kernels::nonfinite`,
//! `kernels::rowwise_fwd`'s exact kernels).
//!
//! Per call, on the caller's stream and with no host synchronization: the flag word (the first
//! part of the call's workspace) is zeroed, `v_nonfinite` sets it when v holds a NaN or Inf, the
//! tensor-core kernels (and the split-K combine) return at once when it is set, and the exact
//! row-wise kernel, launched last, returns at once when it is clear. Which path wrote the outputs
//! is thus decided on the device; every row is written by exactly one of them.

use cubecl::cuda::CudaRuntime;
use cudarc::driver::{result as drv, sys};
use half::{bf16, f16};

use super::compile::{codegen, settings, KernelKey, A};
use super::driver::err;
use super::launch::{launch, Args};
use super::CudaBackend;
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::nonfinite::{self, FLAG_UNITS, FLAG_VEC};
use crate::kernels::rowwise_fwd::{self, EXACT_CUBES, ROWS_PER_CUBE};

/// Bytes of the flag part of a forward workspace (one u32; [`super::forward::layout`] aligns
/// every part to 256 bytes).
pub(crate) const FLAG_BYTES: usize = 4;

/// Most cubes of the flag kernel (grid-stride over v): about two waves of 256 units per
/// multiprocessor on an H100/H200, enough to keep its loads at memory bandwidth.
const FLAG_CUBES: usize = 1024;

/// Zeroes the `bytes` at `flag` (the flag, and the decode kernel's split-K counters after it) and,
/// with `scan`, enqueues `v_nonfinite` over the `kv_len` elements of v (f16 or bf16) at `v`
/// (without: the forward kernel sets the flag itself, its `check_v`). `kv_len` is a multiple of 8
/// (head_dim a multiple of 32), so v is whole 16-byte vectors.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_flag(be: &CudaBackend, dt: DType, v: u64, kv_len: usize, flag: u64, bytes: usize, scan: bool, stream: sys::CUstream) -> Result<()> {
    // SAFETY: `flag` is the first part of the caller's workspace (`bytes`, at least FLAG_BYTES),
    // ordered on `stream` before the kernels that read it.
    unsafe { drv::memset_d8_async(flag, 0, bytes, stream) }.map_err(|e| err("cuMemsetD8Async", e))?;
    if !scan {
        return Ok(());
    }
    let words = kv_len / 2;
    debug_assert_eq!(words % FLAG_VEC, 0);
    let n = words / FLAG_VEC;
    if n == 0 {
        return Ok(());
    }
    let bf = dt == DType::BF16;
    let key = KernelKey::new("v_nonfinite", dt, &[bf as u32]);
    let f = be.kernels.get(&key, || {
        codegen(nonfinite::v_nonfinite::VNonfinite::<CudaRuntime>::new(
            settings(FLAG_UNITS as u32),
            be.client().clone(),
            A,
            A,
            (),
            FLAG_VEC,
            bf,
        ))
    })?;
    let mut a = Args::new();
    a.array(v, n).array(flag, 1).u32(n as u32);
    launch(&f, (n.div_ceil(FLAG_UNITS).min(FLAG_CUBES) as u32, 1, 1), &mut a, stream)
}

/// Cubes of an exact kernel's launch over `units` units of work of one plane each (grid-stride:
/// at most EXACT_CUBES, one grid dimension).
fn exact_cubes(units: usize) -> u32 {
    units.div_ceil(ROWS_PER_CUBE).clamp(1, EXACT_CUBES) as u32
}

/// Addresses and scalars of the dense exact kernel.
pub(crate) struct DenseExact {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub out: u64,
    pub lse: u64,
    /// (address, u32 words) of the row-to-segment and segment tables.
    pub row_seg: (u64, usize),
    pub segs: (u64, usize),
    /// The plan's page table (`AttnSpec::kv_pages()`; read only when the spec has one).
    pub pages: (u64, usize),
    pub flag: u64,
}

/// Enqueues `rowwise_fwd_exact` (f16/bf16): writes every row of out and lse when the flag is set
/// (v and out at v's head_dim, `Dims::head_dim_v`).
pub(crate) fn launch_dense_exact(
    be: &CudaBackend,
    spec: &crate::spec::AttnSpec,
    p: &DenseExact,
    win: (u32, u32),
    stream: sys::CUstream,
) -> Result<()> {
    let d = &spec.dims;
    let (hd, hv, dt) = (d.head_dim, d.head_dim_v, spec.dtype);
    let paged = spec.kv_pages().is_some();
    let key = KernelKey::new("rowwise_fwd_exact", dt, &[hd as u32, hv as u32, paged as u32]);
    let f = be.kernels.get(&key, || {
        macro_rules! k {
            ($t:ty) => {
                codegen(rowwise_fwd::rowwise_fwd_exact::RowwiseFwdExact::<$t, CudaRuntime>::new(
                    settings(32 * ROWS_PER_CUBE as u32),
                    be.client().clone(),
                    A, A, A, A, A, A, A, A, (), (), (), (), (), (), (), A,
                    hd,
                    hv,
                    paged,
                ))
            };
        }
        if dt == DType::F16 { k!(f16) } else { k!(bf16) }
    })?;
    let mut a = Args::new();
    a.array(p.q, d.q_len()).array(p.k, d.kv_len().max(1)).array(p.v, d.v_len().max(1));
    a.array(p.out, d.out_len()).array(p.lse, d.lse_len());
    a.array(p.row_seg.0, p.row_seg.1).array(p.segs.0, p.segs.1).array(p.flag, 1);
    a.f32(spec.scale).u32(d.heads_q as u32).u32(d.heads_kv as u32).u32(d.total_q as u32).f32(f32::INFINITY);
    a.u32(win.0).u32(win.1).array(p.pages.0, p.pages.1);
    launch(&f, (exact_cubes(d.total_q * d.heads_q), 1, 1), &mut a, stream)
}

/// Addresses (and u32 words) of the block-sparse plan tables the sparse exact kernel reads, and
/// the plan's scalars.
pub(crate) struct SparseExact {
    pub work: (u64, usize),
    pub slices: (u64, usize),
    pub segs: (u64, usize),
    pub tile_ref: (u64, usize),
    pub blocks: (u64, usize),
    pub hp: u32,
    pub n_items: u32,
    pub n_ys: u32,
    pub k_block: u32,
    pub tiles_per_block: u32,
}

/// Enqueues `rowwise_sparse_fwd_exact` (f16/bf16): writes every row of out and lse when the flag
/// is set.
pub(crate) fn launch_sparse_exact(
    be: &CudaBackend,
    spec: &crate::spec::AttnSpec,
    fp: &super::FwdPtrs,
    flag: u64,
    t: &SparseExact,
    win: (u32, u32),
    stream: sys::CUstream,
) -> Result<()> {
    let d = &spec.dims;
    let (hd, dt) = (d.head_dim, spec.dtype);
    let key = KernelKey::new("rowwise_sparse_fwd_exact", dt, &[hd as u32]);
    let f = be.kernels.get(&key, || {
        macro_rules! k {
            ($t:ty) => {
                codegen(rowwise_fwd::rowwise_sparse_fwd_exact::RowwiseSparseFwdExact::<$t, CudaRuntime>::new(
                    settings(32 * ROWS_PER_CUBE as u32),
                    be.client().clone(),
                    A, A, A, A, A, A, A, A, A, A, A, (), (), (), (), (), (), (), (), (), (), (), (),
                    hd,
                ))
            };
        }
        if dt == DType::F16 { k!(f16) } else { k!(bf16) }
    })?;
    let mut a = Args::new();
    a.array(fp.q, d.q_len()).array(fp.k, d.kv_len().max(1)).array(fp.v, d.kv_len().max(1));
    a.array(fp.out, d.q_len()).array(fp.lse, d.lse_len());
    for (ptr, n) in [t.work, t.slices, t.segs, t.tile_ref, t.blocks] {
        a.array(ptr, n);
    }
    a.array(flag, 1);
    a.f32(spec.scale).u32(d.heads_q as u32).u32(d.heads_kv as u32).u32(d.total_q as u32);
    a.u32(t.hp).u32(t.n_items).u32(t.n_ys).f32(f32::INFINITY).u32(t.k_block).u32(t.tiles_per_block);
    a.u32(win.0).u32(win.1);
    let items = t.n_items as usize * t.n_ys as usize;
    launch(&f, (items.clamp(1, EXACT_CUBES) as u32, 1, 1), &mut a, stream)
}
