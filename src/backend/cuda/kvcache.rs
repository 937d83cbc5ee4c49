//! Host side of `flash_attn_with_kvcache` with its key counts on the device (`kernels::kv_append`):
//! a decode step with a CUDA `cache_seqlens` enqueues three launches and never synchronizes.
//!
//! The spec is the call over full cache rows: segment `b` holds query rows `b sq .. (b + 1) sq`
//! and keys `b width .. (b + 1) width`. Its plan is cached apart from the same spec's ordinary
//! plan, because `kv_append` rewrites the plan's key counts on every call; the plan cache orders
//! a plan's use across streams (a plan taken on another stream waits for the previous one), so
//! two streams never rewrite the counts under each other's kernels, except a captured CUDA graph
//! replayed beside eager calls of the same shapes on another stream.
//! Only calls the forward serves with its few-rows kernels take this path (sm_90, at most
//! `FEW_ROWS` rows a segment, unpaged): those kernels end each cube's key tiles at the last key
//! its rows can see, so a step reads the written keys only, whatever the capacity.

use std::sync::Arc;

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cudarc::driver::sys::CUstream;
use half::{bf16, f16};

use super::compile::{codegen, settings, KernelKey, Source, A};
use super::device_io::check_workspace;
use super::driver::bind;
use super::forward::{flag_part_bytes, fwd_workspace, launch_forward, max_seg_rows, sm90_forward, FwdPtrs, FwdTable, FEW_ROWS};
use super::launch::{launch, Args};
use super::plan::Plan;
use super::plans::Cached;
use super::CudaBackend;
use crate::backend::Pass;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::kv_append::{self, APPEND_UNITS};
use crate::spec::AttnSpec;

/// Marks a plan whose key counts the device writes (`PlanKey::with_extra`'s first word).
const DEVICE_COUNTS: u64 = 0x6b76_636f_756e_7473;

/// The device side of a step: `counts` (int32 `[batch]`, keys in each cache row before the
/// step), the new keys and values (`[batch, n_new, heads_kv, head_dim]`, contiguous, the caches'
/// dtype; unused when `n_new` is 0) and the caches' row width in keys.
#[derive(Clone, Copy, Debug)]
pub struct KvAppend {
    pub counts: u64,
    pub k_new: u64,
    pub v_new: u64,
    pub n_new: usize,
    pub width: usize,
}

fn unsupported(msg: String) -> Error {
    Error::Unsupported { backend: "cuda", msg: format!("device key counts (a CUDA cache_seqlens): {msg}") }
}

/// `Err(Unsupported)` unless `spec` is the call over full cache rows of `width` keys that the
/// sm_90 few-rows kernels serve, unpaged (see the module doc).
fn check_rows(be: &CudaBackend, spec: &AttnSpec, kv: &KvAppend) -> Result<()> {
    check_shape(spec, kv)?;
    check_kernels(be, spec)
}

/// The part of [`check_rows`] that picks the kernels: sm_90, f16 / bf16, unpaged, dense, v at
/// q's head_dim, at most `FEW_ROWS` rows a sequence.
fn check_kernels(be: &CudaBackend, spec: &AttnSpec) -> Result<()> {
    if !spec.dims.is_uniform() {
        return Err(unsupported("served for caches whose v has k's head_dim only".into()));
    }
    // (sm90_forward also excludes f32)
    if spec.kv_pages().is_some() || spec.block_sparse().is_some() || !sm90_forward(be, spec) {
        return Err(unsupported("served by the sm_90 kernels only, f16 / bf16, unpaged".into()));
    }
    if max_seg_rows(spec) > FEW_ROWS {
        return Err(unsupported(format!("served by the few-rows kernels only (at most {FEW_ROWS} rows a sequence)")));
    }
    Ok(())
}

/// The part of [`check_rows`] that reads the spec alone: one segment per full cache row.
fn check_shape(spec: &AttnSpec, kv: &KvAppend) -> Result<()> {
    let d = &spec.dims;
    let batch = spec.segments.len();
    let sq = d.total_q.checked_div(batch).unwrap_or(0);
    let full_rows = batch > 0
        && sq > 0
        && kv.width > 0
        && kv.n_new <= kv.width
        && d.total_q == batch * sq
        && d.total_k == batch * kv.width
        && spec.segments.iter().enumerate().all(|(b, s)| {
            s.q_start == b * sq && s.q_len == sq && s.k_start == b * kv.width && s.k_len == kv.width
        });
    if !full_rows {
        return Err(unsupported("the spec is not one segment per full cache row".into()));
    }
    Ok(())
}

/// The CUDA source of [`kv_append::kv_append`].
pub(crate) fn append_source(client: &ComputeClient<CudaRuntime>) -> Result<Source> {
    codegen(kv_append::kv_append::KvAppend::<CudaRuntime>::new(settings(APPEND_UNITS as u32), client.clone(), A, A, A, A, A, A, A, (), (), ()))
}

/// The CUDA source of [`kv_append::poison_rows`] for f16 or bf16 outputs.
pub(crate) fn poison_source(client: &ComputeClient<CudaRuntime>, dt: DType) -> Result<Source> {
    let st = settings(APPEND_UNITS as u32);
    if dt == DType::F16 {
        codegen(kv_append::poison_rows::PoisonRows::<f16, CudaRuntime>::new(st, client.clone(), A, A, A, (), (), (), (), (), (), ()))
    } else {
        codegen(kv_append::poison_rows::PoisonRows::<bf16, CudaRuntime>::new(st, client.clone(), A, A, A, (), (), (), (), (), (), ()))
    }
}

impl CudaBackend {
    /// The plan of a device-count call of `spec`: items over whole rows. A left window would
    /// bound them from below by the rows at the capacity's end, where a row with fewer keys sees
    /// none; the decode kernel starts each cube's tiles at its rows' first key (`flash_fwd_decode`)
    /// and applies the window per row, so the plan (keyed without the left bound, under its own
    /// tag: `kv_append` rewrites its key counts) serves every left window.
    fn counts_plan(&self, spec: &AttnSpec, stream: CUstream) -> Result<Arc<Cached<Plan>>> {
        let mut whole = spec.clone();
        whole.window.left = None;
        self.fwd_plan_tagged(&whole, DEVICE_COUNTS, stream)
    }

    /// The workspace bytes [`Self::forward_device_kv`] needs for `spec` (its plan's split-K
    /// partials: not [`crate::backend::Backend::device_workspace`]'s with a left window bound).
    /// `Err(Unsupported)` where that path does not serve the call.
    ///
    /// # Safety
    /// `stream` is a live stream of this backend's device.
    pub unsafe fn forward_kv_workspace(&self, spec: &AttnSpec, stream: u64) -> Result<usize> {
        self.check(spec, Pass::Forward)?;
        check_kernels(self, spec)?;
        bind(self.ctx)?;
        Ok(fwd_workspace(spec, &self.counts_plan(spec, stream as CUstream)?.host))
    }

    /// Enqueues a decode step on `stream`: appends the new keys at each row's device count,
    /// then the forward of `spec` (the call over full rows) with those counts, then NaN over
    /// the outputs of rows whose count does not fit. `Err(Unsupported)` (nothing enqueued) for a
    /// call this path does not serve: the caller reads the counts on the host instead.
    ///
    /// # Safety
    /// As for [`crate::backend::Backend::forward_device`]; `kv`'s addresses as its doc says, the
    /// caches being `k` and `v` of `p`.
    pub unsafe fn forward_device_kv(&self, spec: &AttnSpec, p: FwdPtrs, kv: KvAppend, workspace_bytes: usize, stream: u64) -> Result<bool> {
        self.check(spec, Pass::Forward)?;
        check_rows(self, spec, &kv)?;
        p.check_aligned()?;
        bind(self.ctx)?;
        let s = stream as CUstream;
        let plan = self.counts_plan(spec, s)?;
        // (a 16-bit forward's workspace holds at least the non-finite-v flag that kv_append zeroes)
        check_workspace(fwd_workspace(spec, &plan.host), p.workspace, workspace_bytes)?;
        let d = &spec.dims;
        let batch = spec.segments.len();
        // (head_dim is a multiple of 8 on CUDA: a row is whole u32 words)
        let row_words = d.heads_kv * d.head_dim / 2;
        let cache_words = d.total_k * d.head_dim * d.heads_kv / 2;
        let new_words = (batch * kv.n_new * row_words).max(1);
        let segs = plan.tables.get(FwdTable::Segs);
        let client = self.client();
        let f = self.kernels.get(&KernelKey::new("kv_append", spec.dtype, &[]), || append_source(client))?;
        let mut a = Args::new();
        a.array(p.k, cache_words).array(p.v, cache_words);
        a.array(if kv.n_new > 0 { kv.k_new } else { p.k }, new_words).array(if kv.n_new > 0 { kv.v_new } else { p.v }, new_words);
        // (the flag and the decode kernel's split-K counters after it, zeroed by cube (0, 0))
        a.array(kv.counts, batch).array(segs.0, segs.1).array(p.workspace, flag_part_bytes(spec, &plan.host) / 4);
        a.u32(kv.width as u32).u32(kv.n_new as u32).u32(row_words as u32);
        launch(&f, (kv.n_new.max(1) as u32, batch as u32, 1), &mut a, s)?;

        // (the flag was zeroed by kv_append)
        launch_forward(self, spec, &plan, &p, true, s)?;

        let sq = d.total_q / batch;
        let row_elems = d.heads_q * d.head_dim;
        let f = self.kernels.get(&KernelKey::new("poison_rows", spec.dtype, &[]), || poison_source(client, spec.dtype))?;
        let mut a = Args::new();
        a.array(p.out, d.q_len()).array(p.lse, d.lse_len()).array(kv.counts, batch);
        a.u32(kv.width as u32).u32(kv.n_new as u32).u32(sq as u32).u32(d.heads_q as u32).u32(row_elems as u32);
        a.u32(d.total_q as u32).f32(f32::NAN);
        let x = (sq * row_elems).div_ceil(APPEND_UNITS).clamp(1, 8) as u32;
        launch(&f, (x, batch as u32, 1), &mut a, s)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::{check_shape, KvAppend};
    use crate::dtype::DType;
    use crate::spec::{AttnSpec, TensorMeta};

    /// The call over `batch` full cache rows of `width` keys, `sq` query rows each, GQA 8 / 2, d64.
    fn rows_spec(batch: usize, sq: usize, width: usize) -> AttnSpec {
        let cu_q: Vec<i32> = (0..=batch).map(|b| (b * sq) as i32).collect();
        let cu_k: Vec<i32> = (0..=batch).map(|b| (b * width) as i32).collect();
        let q = TensorMeta::new(&[batch * sq, 8, 64], DType::BF16);
        let kv = TensorMeta::new(&[batch * width, 2, 64], DType::BF16);
        AttnSpec::varlen(&q, &kv, &kv, &cu_q, &cu_k, sq, width, None, true).unwrap()
    }

    fn step(n_new: usize, width: usize) -> KvAppend {
        KvAppend { counts: 0, k_new: 0, v_new: 0, n_new, width }
    }

    #[test]
    fn the_device_count_path_takes_full_rows() {
        let spec = rows_spec(3, 2, 700);
        assert!(check_shape(&spec, &step(2, 700)).is_ok());
        assert!(check_shape(&spec.clone().with_window(-1, 0).unwrap(), &step(2, 700)).is_ok());
        assert!(check_shape(&spec.clone().with_window(100, 0).unwrap(), &step(2, 700)).is_ok());
        // not the full rows of the caches
        assert!(check_shape(&spec, &step(2, 699)).is_err());
        assert!(check_shape(&spec, &step(701, 700)).is_err());
        assert!(check_shape(&rows_spec(3, 2, 700), &step(2, 350)).is_err());
    }
}

