//! Backends implement one trait over a validated [`AttnSpec`]; dispatch picks one and says which.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod sparse;

use crate::dtype::{HostData, HostView};
use crate::error::{invalid, Result};
#[cfg(not(feature = "cuda"))]
use crate::error::Error;
use crate::spec::AttnSpec;

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

/// One implementation of attention over host buffers.
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;
    fn forward(&self, spec: &AttnSpec, q: HostView, k: HostView, v: HostView) -> Result<ForwardOutput>;
    fn backward(
        &self,
        spec: &AttnSpec,
        q: HostView,
        k: HostView,
        v: HostView,
        grad: BackwardInputs,
    ) -> Result<Gradients>;
}

/// Checks that buffers match the spec (lengths and dtype); called once at the API boundary.
pub fn check_buffers(spec: &AttnSpec, q: HostView, k: HostView, v: HostView) -> Result<()> {
    let d = &spec.dims;
    // dtype first: a buffer of another dtype also has another element count, and the dtype is
    // the error to report
    for (name, buf, want) in [("q", q, d.q_len()), ("k", k, d.kv_len()), ("v", v, d.kv_len())] {
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
        if buf.len() != d.q_len() {
            return Err(invalid(name, format!("has {} elements, q has {}", buf.len(), d.q_len())));
        }
    }
    if g.lse.len() != d.lse_len() {
        return Err(invalid("lse", format!("has {} elements, expected heads_q*total_q = {}", g.lse.len(), d.lse_len())));
    }
    Ok(())
}

/// The backend for a preference: CPU always works; CUDA needs the `cuda` feature and a GPU.
pub fn backend_for(pref: DevicePref) -> Result<&'static dyn Backend> {
    match pref {
        DevicePref::Cpu => Ok(&cpu::CpuBackend),
        DevicePref::Cuda(i) => cuda_backend(i),
        DevicePref::Auto(i) => Ok(cuda_backend(i).unwrap_or(&cpu::CpuBackend)),
    }
}

/// The backend for a preference and a call: like [`backend_for`], but `auto` also falls back to
/// the CPU when the CUDA backend cannot serve this spec (e.g. a head_dim without a kernel).
pub fn backend_for_spec(pref: DevicePref, spec: &AttnSpec) -> Result<&'static dyn Backend> {
    #[cfg(feature = "cuda")]
    {
        Ok(match cuda_for_spec(pref, spec)? {
            Some(be) => be,
            None => &cpu::CpuBackend,
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = spec;
        backend_for(pref)
    }
}

/// The CUDA backend a preference picks for this call, `None` where the CPU runs it: `cpu`, or
/// `auto` when CUDA cannot start or serve the spec. `cuda` / `cuda:N` that cannot start is an error.
#[cfg(feature = "cuda")]
pub fn cuda_for_spec(pref: DevicePref, spec: &AttnSpec) -> Result<Option<&'static cuda::CudaBackend>> {
    match pref {
        DevicePref::Cpu => Ok(None),
        DevicePref::Cuda(i) => cuda::CudaBackend::on(i).map(Some),
        DevicePref::Auto(i) => Ok(cuda::CudaBackend::on(i).ok().filter(|_| cuda::check_supported(spec).is_ok())),
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
