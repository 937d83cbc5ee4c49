//! The calls of the CUDA backend: its [`Backend`] implementation, for every key set (dense,
//! paged, block-sparse: the entry points check the call once and dispatch on the key set).
//!
//! Device-resident ([`Backend::forward_device`], [`Backend::backward_device`]): the kernels read
//! the caller's buffers in place and write the outputs in place, enqueued on the caller's stream
//! (torch's current stream), with a caller-provided workspace; the call returns once the
//! kernels are enqueued. No copies, no synchronization. The launch plan comes from the backend's
//! plan caches (uploaded on the caller's stream the first time a shape, or a block index, is
//! seen).
//!
//! Host buffers ([`Backend::forward`] / [`Backend::backward`]): device memory is allocated for the
//! inputs, outputs and workspace, the inputs are copied in, the same device-resident call runs on
//! the backend's own stream, the outputs are copied back and the stream is synchronized.

use super::backward::{bwd_workspace, dq_mode, launch_backward, BwdPlan, BwdPtrs, DqMode, DqPath};
use super::driver::{bind, DevBuf};
use super::forward::{fwd_tables, fwd_workspace, launch_forward, plan_opts, tile_rows, FwdPtrs};
use super::plans::{Cached, PlanKey};
use super::{head_pad, sparse, sparse_bwd, CudaBackend, Plan};
use crate::backend::{Backend, BackendKind, BackwardInputs, ForwardOutput, Gradients, Pass};
use crate::dtype::{HostData, HostView};
use crate::error::{invalid, Error, Result};
use crate::spec::AttnSpec;

use cudarc::driver::sys::CUstream;
use std::sync::Arc;

/// Whether a device call has work: at least one query row, one key and one head.
pub(super) fn has_work(spec: &AttnSpec) -> bool {
    let d = &spec.dims;
    d.total_q > 0 && d.total_k > 0 && d.heads_q > 0
}

/// `Err` naming `workspace` where the caller's (`bytes` at `ptr`) is smaller than `need`.
pub(super) fn check_workspace(need: usize, ptr: u64, bytes: usize) -> Result<()> {
    if bytes < need || (need > 0 && ptr == 0) {
        return Err(invalid("workspace", format!("has {bytes} bytes at {ptr:#x}, the call needs {need}")));
    }
    Ok(())
}

impl CudaBackend {
    fn fwd_plan(&self, spec: &AttnSpec, stream: CUstream) -> Result<Arc<Cached<Plan>>> {
        self.fwd_plan_tagged(spec, 0, stream)
    }

    /// The cached forward plan of `spec` with tiles of `tile_rows` rows, kept apart from plans of
    /// other `tag`s (0: the ordinary one; `kvcache` tags the plan whose key counts the device
    /// rewrites).
    pub(super) fn fwd_plan_tagged(&self, spec: &AttnSpec, tag: u64, stream: CUstream) -> Result<Arc<Cached<Plan>>> {
        let rows = tile_rows(self, spec);
        self.fwd_plans.get(PlanKey::with_extra(spec, plan_opts(), [tag, rows as u64]), stream, || {
            let p = Plan::with_rows(spec, rows);
            let t = fwd_tables(spec, &p);
            (p, t)
        })
    }

    fn bwd_plan(&self, spec: &AttnSpec, stream: CUstream) -> Result<Arc<Cached<BwdPlan>>> {
        self.bwd_plans.get(PlanKey::new(spec, 0), stream, || {
            let p = BwdPlan::new(spec);
            let t = p.tables(spec);
            (p, t)
        })
    }

    /// Workspace bytes a device-resident forward of `spec` needs (0: none). Builds (and uploads
    /// on `stream`) the launch plan of this shape if it is not cached yet.
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's primary context (0: the legacy stream).
    pub unsafe fn forward_workspace(&self, spec: &AttnSpec, stream: u64) -> Result<usize> {
        let padded = self.check_padded(spec, Pass::Forward)?;
        if !has_work(spec) {
            return Ok(0);
        }
        if let Some(ps) = padded {
            let inner = self.forward_workspace(&ps, stream)?;
            return Ok(head_pad::fwd_workspace(spec, &ps, inner));
        }
        bind(self.ctx)?;
        let s = stream as CUstream;
        Ok(match spec.block_sparse() {
            Some(sp) => {
                self.sparse_plan(sp, s)?;
                sparse::forward_workspace(sp)
            }
            None => fwd_workspace(spec, &self.fwd_plan(spec, s)?.host),
        })
    }

    /// Workspace bytes a device-resident backward of `spec` needs (see [`Self::forward_workspace`]).
    ///
    /// # Safety
    /// As for [`Self::forward_workspace`].
    pub unsafe fn backward_workspace(&self, spec: &AttnSpec, deterministic: bool, stream: u64) -> Result<usize> {
        self.backward_workspace_on(spec, deterministic, DqPath::Auto, stream)
    }

    /// [`Self::backward_workspace`] on dQ path `path`.
    ///
    /// # Safety
    /// As for [`Self::forward_workspace`].
    pub(super) unsafe fn backward_workspace_on(&self, spec: &AttnSpec, deterministic: bool, path: DqPath, stream: u64) -> Result<usize> {
        let padded = self.check_padded(spec, Pass::Backward { deterministic })?;
        if !has_work(spec) {
            return Ok(0);
        }
        if let Some(ps) = padded {
            let inner = self.backward_workspace_on(&ps, deterministic, path, stream)?;
            return Ok(head_pad::bwd_workspace_padded(spec, &ps, inner));
        }
        bind(self.ctx)?;
        let s = stream as CUstream;
        match spec.block_sparse() {
            Some(sp) => self.sparse_bwd_plan(sp, s).map(drop)?,
            None => self.bwd_plan(spec, s).map(drop)?,
        }
        Ok(bwd_workspace(spec, dq_mode(Some(self), spec, deterministic, path)))
    }

    /// [`Self::backward_device`] on an explicit dQ path.
    ///
    /// # Safety
    /// As for [`Self::backward_device`].
    pub(super) unsafe fn backward_device_on(
        &self,
        spec: &AttnSpec,
        p: BwdPtrs,
        path: DqPath,
        deterministic: bool,
        workspace_bytes: usize,
        stream: u64,
    ) -> Result<bool> {
        if let Some(ps) = self.check_padded(spec, Pass::Backward { deterministic })? {
            return self.backward_padded(spec, &ps, p, path, deterministic, workspace_bytes, stream);
        }
        p.check_aligned()?;
        if !has_work(spec) {
            return Ok(false);
        }
        bind(self.ctx)?;
        let s = stream as CUstream;
        let mode = dq_mode(Some(self), spec, deterministic, path);
        check_workspace(bwd_workspace(spec, mode), p.workspace, workspace_bytes)?;
        match spec.block_sparse() {
            Some(sp) => sparse_bwd::launch_sparse_backward(self, sp, &*self.sparse_bwd_plan(sp, s)?, &p, mode == DqMode::Fused, s)?,
            None => launch_backward(self, spec, &*self.bwd_plan(spec, s)?, &p, mode, s)?,
        }
        Ok(true)
    }

    /// Forward on host buffers: uploads q, k, v on the backend's stream, fills out/lse with
    /// `poison` (tests pass NaN to prove that every element is written; zeros / lse +inf when
    /// there is no key), runs the device-resident forward, downloads out and lse, synchronizes.
    pub(crate) fn forward_host(&self, spec: &AttnSpec, q: HostView, k: HostView, v: HostView, poison: Option<f32>) -> Result<ForwardOutput> {
        crate::backend::check_buffers(spec, q, k, v)?;
        self.check(spec, Pass::Forward)?;
        let d = &spec.dims;
        if d.total_q == 0 || d.heads_q == 0 {
            return Ok(ForwardOutput { out: HostData::from_f32(spec.dtype, &[]), lse: Vec::new() });
        }
        let _g = self.host_lock.lock().unwrap_or_else(|e| e.into_inner());
        bind(self.ctx)?;
        let s = self.stream.0;
        let es = spec.dtype.size();
        let up = |h: HostView| -> Result<DevBuf> {
            let b = DevBuf::alloc(h.as_bytes().len())?;
            b.upload(h.as_bytes(), s)?;
            Ok(b)
        };
        let (qb, kb, vb) = (up(q)?, up(k)?, up(v)?);
        let ob = DevBuf::alloc(d.out_len() * es)?;
        let lb = DevBuf::alloc(d.lse_len() * 4)?;
        // no key: nothing is launched and the outputs are zeros and lse +inf; else `poison` first
        let (o0, l0) = if has_work(spec) { (poison.unwrap_or(0.0), poison.unwrap_or(0.0)) } else { (0.0, f32::INFINITY) };
        let out0 = HostData::from_f32(spec.dtype, &vec![o0; d.out_len()]);
        let lse0 = vec![l0; d.lse_len()];
        if poison.is_some() || !has_work(spec) {
            ob.upload(out0.view().as_bytes(), s)?;
            lb.upload(bytemuck::cast_slice(&lse0), s)?;
        }
        // SAFETY: the buffers hold the spec's tensors and the workspace the bytes asked for; the
        // stream is synchronized below, before they are freed.
        let ws = DevBuf::alloc(unsafe { self.forward_workspace(spec, s as u64) }?)?;
        let ptrs = FwdPtrs { q: qb.ptr, k: kb.ptr, v: vb.ptr, out: ob.ptr, lse: lb.ptr, workspace: ws.ptr };
        unsafe { self.forward_device(spec, ptrs, ws.bytes, s as u64) }?;
        memory_probe();
        let mut out = vec![0u8; d.out_len() * es];
        let mut lse = vec![0f32; d.lse_len()];
        ob.download(&mut out, s)?;
        lb.download(bytemuck::cast_slice_mut(&mut lse), s)?;
        self.stream.sync().map_err(|e| Error::Device(format!("forward kernels failed: {e}")))?;
        Ok(ForwardOutput { out: HostData::from_bytes(spec.dtype, &out), lse })
    }

    /// Backward on host buffers, on dQ path `path`: uploads q, k, v, out, lse, dout on the
    /// backend's stream, fills dq/dk/dv with `poison` (zeros without work), runs the
    /// device-resident backward, downloads the gradients, synchronizes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward_host(
        &self,
        spec: &AttnSpec,
        q: HostView,
        k: HostView,
        v: HostView,
        g: BackwardInputs,
        poison: Option<f32>,
        path: DqPath,
    ) -> Result<Gradients> {
        let det = g.deterministic;
        crate::backend::check_buffers(spec, q, k, v)?;
        crate::backend::check_backward_buffers(spec, &g)?;
        self.check(spec, Pass::Backward { deterministic: det })?;
        let d = &spec.dims;
        if !has_work(spec) {
            let z = |n: usize| HostData::from_f32(spec.dtype, &vec![0.0; n]);
            return Ok(Gradients { dq: z(d.q_len()), dk: z(d.kv_len()), dv: z(d.v_len()) });
        }
        let _g = self.host_lock.lock().unwrap_or_else(|e| e.into_inner());
        bind(self.ctx)?;
        let s = self.stream.0;
        let es = spec.dtype.size();
        let up = |b: &[u8]| -> Result<DevBuf> {
            let x = DevBuf::alloc(b.len())?;
            x.upload(b, s)?;
            Ok(x)
        };
        let (qb, kb, vb) = (up(q.as_bytes())?, up(k.as_bytes())?, up(v.as_bytes())?);
        let (ob, gb, lb) = (up(g.out.as_bytes())?, up(g.dout.as_bytes())?, up(bytemuck::cast_slice(g.lse))?);
        let fill = HostData::from_f32(spec.dtype, &vec![poison.unwrap_or(0.0); d.q_len().max(d.kv_len()).max(d.v_len())]);
        let grad = |n: usize| -> Result<DevBuf> {
            let x = DevBuf::alloc(n * es)?;
            if poison.is_some() {
                x.upload(&fill.view().as_bytes()[..n * es], s)?;
            }
            Ok(x)
        };
        let (dqb, dkb, dvb) = (grad(d.q_len())?, grad(d.kv_len())?, grad(d.v_len())?);
        // SAFETY: as in `forward_host`
        let need = unsafe { self.backward_workspace_on(spec, det, path, s as u64) }?;
        let ws = DevBuf::alloc(need)?;
        let ptrs = BwdPtrs {
            q: qb.ptr,
            k: kb.ptr,
            v: vb.ptr,
            out: ob.ptr,
            lse: lb.ptr,
            dout: gb.ptr,
            dq: dqb.ptr,
            dk: dkb.ptr,
            dv: dvb.ptr,
            workspace: ws.ptr,
        };
        unsafe { self.backward_device_on(spec, ptrs, path, det, ws.bytes, s as u64) }?;
        memory_probe();
        let read = |b: &DevBuf, n: usize| -> Result<Vec<u8>> {
            let mut v = vec![0u8; n * es];
            b.download(&mut v, s)?;
            Ok(v)
        };
        let (dq, dk, dv) = (read(&dqb, d.q_len())?, read(&dkb, d.kv_len())?, read(&dvb, d.v_len())?);
        self.stream.sync().map_err(|e| Error::Device(format!("backward kernels failed: {e}")))?;
        let h = |b: &[u8]| HostData::from_bytes(spec.dtype, b);
        Ok(Gradients { dq: h(&dq), dk: h(&dk), dv: h(&dv) })
    }
}

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn supports(&self, spec: &AttnSpec, pass: Pass) -> Result<()> {
        self.check(spec, pass)
    }

    fn forward(&self, spec: &AttnSpec, q: HostView, k: HostView, v: HostView) -> Result<ForwardOutput> {
        self.forward_host(spec, q, k, v, None)
    }

    fn backward(&self, spec: &AttnSpec, q: HostView, k: HostView, v: HostView, grad: BackwardInputs) -> Result<Gradients> {
        self.backward_host(spec, q, k, v, grad, None, DqPath::Auto)
    }

    unsafe fn device_workspace(&self, spec: &AttnSpec, pass: Pass, stream: u64) -> Result<Option<usize>> {
        match pass {
            Pass::Forward => self.forward_workspace(spec, stream),
            Pass::Backward { deterministic } => self.backward_workspace(spec, deterministic, stream),
        }
        .map(Some)
    }

    unsafe fn forward_device(&self, spec: &AttnSpec, p: FwdPtrs, workspace_bytes: usize, stream: u64) -> Result<bool> {
        if let Some(ps) = self.check_padded(spec, Pass::Forward)? {
            return self.forward_padded(spec, &ps, p, workspace_bytes, stream);
        }
        p.check_aligned()?;
        if !has_work(spec) {
            return Ok(false);
        }
        bind(self.ctx)?;
        let s = stream as CUstream;
        match spec.block_sparse() {
            Some(sp) => {
                check_workspace(sparse::forward_workspace(sp), p.workspace, workspace_bytes)?;
                sparse::launch_sparse_forward(self, sp, &*self.sparse_plan(sp, s)?, &p, s)?;
            }
            None => {
                let plan = self.fwd_plan(spec, s)?;
                check_workspace(fwd_workspace(spec, &plan.host), p.workspace, workspace_bytes)?;
                launch_forward(self, spec, &plan, &p, false, s)?;
            }
        }
        Ok(true)
    }

    unsafe fn backward_device(&self, spec: &AttnSpec, p: BwdPtrs, deterministic: bool, workspace_bytes: usize, stream: u64) -> Result<bool> {
        self.backward_device_on(spec, p, DqPath::Auto, deterministic, workspace_bytes, stream)
    }
}

static PROBE_ON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static PROBE_MIN_FREE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(u64::MAX);

/// Test instrumentation: while on, the host-buffer calls record the smallest free device memory
/// (as the driver reports it) at the point where every buffer of the call is allocated.
pub fn set_memory_probe(on: bool) {
    PROBE_MIN_FREE.store(u64::MAX, std::sync::atomic::Ordering::SeqCst);
    PROBE_ON.store(on, std::sync::atomic::Ordering::SeqCst);
}

/// The smallest free device memory recorded since [`set_memory_probe`] switched the probe on.
pub fn memory_probe_min_free() -> u64 {
    PROBE_MIN_FREE.load(std::sync::atomic::Ordering::SeqCst)
}

fn memory_probe() {
    if PROBE_ON.load(std::sync::atomic::Ordering::Relaxed) {
        if let Ok((free, _)) = super::driver::mem_info() {
            PROBE_MIN_FREE.fetch_min(free, std::sync::atomic::Ordering::SeqCst);
        }
    }
}
