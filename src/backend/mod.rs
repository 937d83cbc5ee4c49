//! Backends implement one trait over a validated [`AttnSpec`] of any key set (dense, paged,
//! block-sparse), on host buffers and, for the CUDA backend, on device-resident ones;
//! [`backend_for`] is the one place a call's device is chosen.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod status;

use crate::dtype::{HostData, HostView};
#[cfg(not(feature = "cuda"))]
use crate::error::Error;
use crate::error::{invalid, Result};
pub use crate::spec::Pass;
use crate::spec::AttnSpec;
#[cfg(feature = "cuda")]
pub use cuda::{BwdPtrs, FwdPtrs};

/// Which backend ran a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// The caller's choice: `auto` takes CUDA when it can start, else the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevicePref {
    /// CUDA device `n` when the CUDA backend starts there, else the CPU (`"auto"` is `Auto(0)`).
    Auto(usize),
    Cpu,
    /// CUDA device `n` (`"cuda"` is `Cuda(0)`).
    Cuda(usize),
}

/// Most CUDA devices one process addresses (device indices 0..MAX_DEVICES).
pub const MAX_DEVICES: usize = 64;

impl DevicePref {
    /// `"auto"`, `"cpu"`, `"cuda"` (or `"gpu"`), `"cuda:N"`, `"auto:N"` (N: a CUDA device index).
    pub fn parse(s: &str) -> Result<DevicePref> {
        let bad = || invalid("device", format!("must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\", got {s:?}"));
        let (kind, index) = match s.split_once(':') {
            Some((k, n)) => {
                let i: usize = n.parse().map_err(|_| bad())?;
                if i >= MAX_DEVICES {
                    return Err(invalid("device", format!("CUDA device index {i} is out of range (at most {MAX_DEVICES} devices)")));
                }
                (k, Some(i))
            }
            None => (s, None),
        };
        match (kind, index) {
            ("auto", i) => Ok(DevicePref::Auto(i.unwrap_or(0))),
            ("cpu", None) => Ok(DevicePref::Cpu),
            ("cuda" | "gpu", i) => Ok(DevicePref::Cuda(i.unwrap_or(0))),
            _ => Err(bad()),
        }
    }
}

/// Forward result: `out` in the input dtype, `lse` f32 `[heads_q, total_q]`.
#[derive(Debug, Clone)]
pub struct ForwardOutput {
    pub out: HostData,
    pub lse: Vec<f32>,
}

/// Backward result, each in the input dtype and shape.
#[derive(Debug, Clone)]
pub struct Gradients {
    pub dq: HostData,
    pub dk: HostData,
    pub dv: HostData,
}

/// Inputs of a backward call besides q, k, v.
#[derive(Debug, Clone, Copy)]
pub struct BackwardInputs<'a> {
    pub out: HostView<'a>,
    pub lse: &'a [f32],
    pub dout: HostView<'a>,
    /// Bitwise-identical gradients run to run.
    pub deterministic: bool,
}

/// One implementation of attention: every key set, host buffers, and (feature `cuda`) buffers
/// already on the device, enqueued on the caller's stream.
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;

    /// `Err(Unsupported)` saying why this backend has no kernel for `pass` of `spec`.
    fn supports(&self, spec: &AttnSpec, pass: Pass) -> Result<()>;

    /// Forward on host buffers: `out` in the input dtype, `lse` f32 `[heads_q, total_q]`.
    fn forward(&self, spec: &AttnSpec, q: HostView, k: HostView, v: HostView) -> Result<ForwardOutput>;

    /// Backward on host buffers: dq, dk, dv in the input dtype and shape.
    fn backward(&self, spec: &AttnSpec, q: HostView, k: HostView, v: HostView, grad: BackwardInputs) -> Result<Gradients>;

    /// Workspace bytes a device-resident `pass` of `spec` needs (the launch plan is built and
    /// uploaded on `stream` where it is new), or `None` where this backend reads host buffers only
    /// (the caller runs the host path).
    ///
    /// # Safety
    /// `stream` must be a live stream of this backend's device (0: the legacy stream).
    #[cfg(feature = "cuda")]
    unsafe fn device_workspace(&self, spec: &AttnSpec, pass: Pass, stream: u64) -> Result<Option<usize>>;

    /// Enqueues the forward of `spec` on `stream`: reads q, k, v and writes out and lse in place.
    /// `Ok(false)` without touching anything when the call has no query row, key or head (the
    /// caller fills the outputs: zeros and lse +inf).
    ///
    /// # Safety
    /// Every address must point to a live allocation of this backend's device holding (inputs)
    /// or able to hold (outputs) the contiguous tensor of the spec's shape and dtype (lse: f32
    /// `[heads_q, total_q]`), `workspace` at least `workspace_bytes` bytes, at least
    /// [`Backend::device_workspace`]; `stream` a live stream of the device; the buffers stay alive
    /// and untouched by other streams until the enqueued work completes.
    #[cfg(feature = "cuda")]
    unsafe fn forward_device(&self, spec: &AttnSpec, p: FwdPtrs, workspace_bytes: usize, stream: u64) -> Result<bool>;

    /// Enqueues the backward of `spec` on `stream`: reads q, k, v, out, lse, dout and writes dq,
    /// dk, dv in place. `Ok(false)` as for [`Backend::forward_device`] (the gradients are zero).
    ///
    /// # Safety
    /// As for [`Backend::forward_device`], with the backward's buffers and workspace.
    #[cfg(feature = "cuda")]
    unsafe fn backward_device(&self, spec: &AttnSpec, p: BwdPtrs, deterministic: bool, workspace_bytes: usize, stream: u64) -> Result<bool>;
}

/// Checks that buffers match the spec (lengths and dtype); called once at the API boundary.
pub fn check_buffers(spec: &AttnSpec, q: HostView, k: HostView, v: HostView) -> Result<()> {
    let d = &spec.dims;
    // dtype first: a buffer of another dtype also has another element count, and the dtype is
    // the error to report
    for (name, buf, want) in [("q", q, d.q_len()), ("k", k, d.kv_len()), ("v", v, d.v_len())] {
        if buf.dtype() != spec.dtype {
            return Err(crate::error::bad_dtype(
                name,
                format!("is {}, the spec says {}", buf.dtype().name(), spec.dtype.name()),
            ));
        }
        if buf.len() != want {
            return Err(invalid(name, format!("has {} elements, the spec needs {}", buf.len(), want)));
        }
    }
    Ok(())
}

/// Checks the extra backward buffers against the spec.
pub fn check_backward_buffers(spec: &AttnSpec, g: &BackwardInputs) -> Result<()> {
    let d = &spec.dims;
    for (name, buf) in [("out", g.out), ("dout", g.dout)] {
        if buf.dtype() != spec.dtype {
            return Err(crate::error::bad_dtype(name, format!("is {}, q is {}", buf.dtype().name(), spec.dtype.name())));
        }
        if buf.len() != d.out_len() {
            return Err(invalid(name, format!("has {} elements, the spec's out has {}", buf.len(), d.out_len())));
        }
    }
    if g.lse.len() != d.lse_len() {
        return Err(invalid("lse", format!("has {} elements, expected heads_q*total_q = {}", g.lse.len(), d.lse_len())));
    }
    Ok(())
}

/// The backend that runs `pass` of `spec` for the caller's preference: the one place a call's
/// device is chosen. `cpu`: the CPU. `cuda` / `cuda:N`: CUDA device N, an error where it cannot
/// start or has no kernel for the call (`Unsupported`, saying why). `auto` / `auto:N`: CUDA
/// device N where it starts and serves the call, else the CPU. Options no backend serves (the
/// INT8 QK^T backward) are refused first.
pub fn backend_for(pref: DevicePref, spec: &AttnSpec, pass: Pass) -> Result<&'static dyn Backend> {
    spec.check_pass(pass)?;
    let cpu: &'static dyn Backend = &cpu::CpuBackend;
    match pref {
        DevicePref::Cpu => Ok(cpu),
        DevicePref::Cuda(i) => {
            let be = cuda_backend(i)?;
            be.supports(spec, pass)?;
            Ok(be)
        }
        DevicePref::Auto(i) => Ok(cuda_backend(i).ok().filter(|be| be.supports(spec, pass).is_ok()).unwrap_or(cpu)),
    }
}

#[cfg(feature = "cuda")]
fn cuda_backend(index: usize) -> Result<&'static dyn Backend> {
    cuda::CudaBackend::on(index).map(|b| b as &'static dyn Backend)
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(_index: usize) -> Result<&'static dyn Backend> {
    Err(Error::BackendUnavailable {
        backend: "cuda",
        reason: "this build of cubeattn has no `cuda` feature".into(),
    })
}
