//! PyO3 bindings: the `cubeattn._core` extension module. Converts, validates once (through the
//! spec), releases the GIL while computing, and maps every error to a Python exception. No panic
//! crosses the boundary: backend calls run under `catch_unwind`.
//!
//! Arrays cross as flat byte arrays plus shape and dtype name; `python/cubeattn` does the numpy
//! and torch viewing, so bfloat16 (ml_dtypes or torch) needs no special support here.

use std::panic::{catch_unwind, AssertUnwindSafe};

use numpy::{PyArray1, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::backend::{backend_for, BackwardInputs, DevicePref, Pass};
use crate::dtype::{DType, HostData, HostView};
use crate::error::{invalid, Error};
use crate::sparse::{Int8Qk, QuantGran, DEFAULT_K_BLOCK, DEFAULT_Q_BLOCK};
use crate::spec::{AttnSpec, TensorMeta};

fn to_py(e: Error) -> PyErr {
    match e {
        Error::InvalidArgument { .. } | Error::Unsupported { .. } => PyValueError::new_err(e.to_string()),
        Error::InvalidDtype { .. } => PyTypeError::new_err(e.to_string()),
        Error::BackendUnavailable { .. } | Error::Device(_) => PyRuntimeError::new_err(e.to_string()),
        Error::OutOfMemory { .. } => PyMemoryError::new_err(e.to_string()),
        Error::NotImplemented { .. } => pyo3::exceptions::PyNotImplementedError::new_err(e.to_string()),
    }
}

/// `e` raised by a call of `spec`: `Unsupported` is NotImplementedError for a block-sparse spec
/// (no CUDA kernel for that call) and ValueError for the others, as each API has always raised.
fn call_err(spec: &AttnSpec, e: Error) -> PyErr {
    match e {
        Error::Unsupported { .. } if spec.block_sparse().is_some() => pyo3::exceptions::PyNotImplementedError::new_err(e.to_string()),
        e => to_py(e),
    }
}

/// Runs `f` without the GIL and turns a panic into RuntimeError.
fn run_detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::Result<T> + Send) -> PyResult<T> {
    run_detached_as(py, f, to_py)
}

/// [`run_detached`] with `err` making the exception of an `Err`.
fn run_detached_as<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::Result<T> + Send, err: impl FnOnce(Error) -> PyErr) -> PyResult<T> {
    let r = py.detach(|| catch_unwind(AssertUnwindSafe(f)));
    match r {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(err(e)),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            if msg.contains("memory") {
                Err(PyMemoryError::new_err(msg))
            } else {
                Err(PyRuntimeError::new_err(format!("internal error in cubeattn: {msg}")))
            }
        }
    }
}

fn parse_dtype(name: &str) -> PyResult<DType> {
    DType::parse(name).ok_or_else(|| PyTypeError::new_err(format!("unsupported dtype {name:?}: expected float32, float16 or bfloat16")))
}

/// A flat little-endian byte buffer from Python, viewed as `dtype` elements.
enum Buf {
    Borrowed(*const u8, usize),
    Owned(HostData),
}
// SAFETY: the pointer refers to a numpy buffer that the caller keeps borrowed (readonly) for the
// whole call, during which nothing else can write it.
unsafe impl Send for Buf {}
unsafe impl Sync for Buf {}

impl Buf {
    fn new(arr: &PyReadonlyArray1<'_, u8>, dtype: DType, arg: &'static str) -> PyResult<Buf> {
        let bytes = arr.as_slice().map_err(|_| PyValueError::new_err(format!("`{arg}` must be contiguous")))?;
        if bytes.len() % dtype.size() != 0 {
            return Err(PyValueError::new_err(format!("`{arg}` byte length is not a multiple of the element size")));
        }
        if (bytes.as_ptr() as usize) % dtype.size() == 0 {
            Ok(Buf::Borrowed(bytes.as_ptr(), bytes.len()))
        } else {
            Ok(Buf::Owned(HostData::from_bytes(dtype, bytes)))
        }
    }
    fn view(&self, dtype: DType) -> HostView<'_> {
        match self {
            Buf::Owned(d) => d.view(),
            Buf::Borrowed(p, n) => {
                // SAFETY: alignment and length were checked in `new`; the buffer outlives `self`.
                let bytes = unsafe { std::slice::from_raw_parts(*p, *n) };
                match dtype {
                    DType::F32 => HostView::F32(bytemuck::cast_slice(bytes)),
                    DType::F16 => HostView::F16(bytemuck::cast_slice(bytes)),
                    DType::BF16 => HostView::BF16(bytemuck::cast_slice(bytes)),
                }
            }
        }
    }
}

/// Moves the data into a numpy array without copying: float32 as float32, 16-bit types as uint16
/// (the Python layer views them as float16 / bfloat16).
fn data_out(py: Python<'_>, data: HostData) -> Bound<'_, PyAny> {
    match data {
        HostData::F32(v) => PyArray1::from_vec(py, v).into_any(),
        HostData::F16(v) => PyArray1::<u16>::from_vec(py, bytemuck::cast_vec(v)).into_any(),
        HostData::BF16(v) => PyArray1::<u16>::from_vec(py, bytemuck::cast_vec(v)).into_any(),
    }
}

/// A validated attention call (shapes, dtype, scale, causal, segments, key set: dense, paged or
/// block-sparse).
#[pyclass(name = "Spec", module = "cubeattn._core", frozen)]
struct PySpec {
    inner: AttnSpec,
}

#[pymethods]
impl PySpec {
    #[getter]
    fn softmax_scale(&self) -> f32 {
        self.inner.scale
    }
    #[getter]
    fn causal(&self) -> bool {
        self.inner.causal
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype.name()
    }
    /// flash-attn's (left, right) after normalisation (-1 = unbounded side).
    #[getter]
    fn window_size(&self) -> (i64, i64) {
        self.inner.window.as_pair()
    }
    /// (total_q, total_k, heads_q, heads_kv, head_dim)
    #[getter]
    fn dims(&self) -> (usize, usize, usize, usize, usize) {
        let d = self.inner.dims;
        (d.total_q, d.total_k, d.heads_q, d.heads_kv, d.head_dim)
    }
    /// v's head_dim (out's, dout's and dv's): `dims`' head_dim but for calls like DeepSeek's MLA.
    #[getter]
    fn head_dim_v(&self) -> usize {
        self.inner.dims.head_dim_v
    }
    /// Matmul FLOPs of the forward pass (over the visible pairs of a block-sparse spec).
    #[getter]
    fn forward_flops(&self) -> f64 {
        self.inner.forward_flops()
    }
    #[getter]
    fn num_segments(&self) -> usize {
        self.inner.segments.len()
    }
    /// (q_start, q_len, k_start, k_len) per sequence or group.
    #[getter]
    fn segments(&self) -> Vec<(usize, usize, usize, usize)> {
        self.inner.segments.iter().map(|s| (s.q_start, s.q_len, s.k_start, s.k_len)).collect()
    }
    /// "dense", "paged" or "block_sparse".
    #[getter]
    fn key_set(&self) -> &'static str {
        self.inner.keys.name()
    }
    /// Query rows per block of a block-sparse spec (None otherwise).
    #[getter]
    fn q_block(&self) -> Option<usize> {
        self.inner.block_sparse().map(|s| s.q_block)
    }
    /// Keys per block of a block-sparse spec (None otherwise).
    #[getter]
    fn k_block(&self) -> Option<usize> {
        self.inner.block_sparse().map(|s| s.k_block)
    }
    /// Kept (query block, key block) pairs over all sequences and index heads (block-sparse).
    #[getter]
    fn kept_blocks(&self) -> Option<usize> {
        self.inner.block_sparse().map(|s| s.index.kept_total())
    }
    /// Visible (query, key) pairs summed over query heads, block mask and causal together
    /// (block-sparse).
    #[getter]
    fn visible_pairs(&self) -> Option<u64> {
        self.inner.block_sparse().map(|s| s.visible_pairs())
    }
    /// "per_block" | "per_warp" | "per_thread" for the INT8 QK^T option of a block-sparse spec,
    /// None for exact QK^T.
    #[getter]
    fn qk_int8(&self) -> Option<&'static str> {
        self.inner.block_sparse().and_then(|s| s.int8).map(|o| o.gran.name())
    }
    /// "fp8" for the FP8 P.V option of a block-sparse INT8 spec, None for P.V in the input's type.
    #[getter]
    fn pv_precision(&self) -> Option<&'static str> {
        self.inner.block_sparse().and_then(|s| s.int8).filter(|o| o.pv_fp8).map(|_| "fp8")
    }
    fn __repr__(&self) -> String {
        let d = self.inner.dims;
        let keys = match self.inner.block_sparse() {
            Some(s) => {
                let ix = &s.index;
                format!(
                    "block_sparse(q_block={}, k_block={}, index=[{}, {}, {}, {}], kept={}, qk_int8={:?}, pv_precision={:?})",
                    s.q_block, s.k_block, ix.batch, ix.heads, ix.q_blocks, ix.top_k, ix.kept_total(), self.qk_int8(), self.pv_precision()
                )
            }
            None => self.inner.keys.name().to_string(),
        };
        format!(
            "Spec({:?}, total_q={}, total_k={}, heads={}/{}, head_dim={}{}, dtype={}, causal={}, scale={}, window_size={:?}, keys={})",
            self.inner.layout, d.total_q, d.total_k, d.heads_q, d.heads_kv, d.head_dim,
            if d.is_uniform() { String::new() } else { format!(", head_dim_v={}", d.head_dim_v) },
            self.inner.dtype.name(), self.inner.causal, self.inner.scale,
            self.inner.window.as_pair(), keys
        )
    }
}

fn metas(q_shape: Vec<usize>, k_shape: Vec<usize>, v_shape: Vec<usize>, dtype: &str) -> PyResult<[TensorMeta; 3]> {
    let dt = parse_dtype(dtype)?;
    Ok([TensorMeta::new(&q_shape, dt), TensorMeta::new(&k_shape, dt), TensorMeta::new(&v_shape, dt)])
}

fn flat_i32<'a>(a: &'a PyReadonlyArray1<'_, i32>, arg: &str) -> PyResult<&'a [i32]> {
    a.as_slice().map_err(|_| PyValueError::new_err(format!("`{arg}` must be contiguous")))
}

/// The varlen layout; with `block_index` (flat int32, shape `index_shape`) block-sparse
/// (`AttnSpec::with_block_index`), `qk_int8` its INT8 QK^T granularity, `pv_fp8` its FP8 P.V
/// (only with `qk_int8`: else `InvalidArgument` naming `pv_precision`, the Python argument).
#[pyfunction]
#[pyo3(signature = (q_shape, k_shape, v_shape, dtype, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size=(-1, -1), block_index=None, index_shape=Vec::new(), q_block=DEFAULT_Q_BLOCK, k_block=DEFAULT_K_BLOCK, qk_int8=None, smooth_k=true, pv_fp8=false))]
#[allow(clippy::too_many_arguments)]
fn varlen_spec(
    q_shape: Vec<usize>,
    k_shape: Vec<usize>,
    v_shape: Vec<usize>,
    dtype: &str,
    cu_seqlens_q: PyReadonlyArray1<'_, i32>,
    cu_seqlens_k: PyReadonlyArray1<'_, i32>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: Option<f64>,
    causal: bool,
    window_size: (i64, i64),
    block_index: Option<PyReadonlyArray1<'_, i32>>,
    index_shape: Vec<usize>,
    q_block: usize,
    k_block: usize,
    qk_int8: Option<&str>,
    smooth_k: bool,
    pv_fp8: bool,
) -> PyResult<PySpec> {
    let [q, k, v] = metas(q_shape, k_shape, v_shape, dtype)?;
    let cq = flat_i32(&cu_seqlens_q, "cu_seqlens_q")?;
    let ck = flat_i32(&cu_seqlens_k, "cu_seqlens_k")?;
    let ix = block_index.as_ref().map(|b| flat_i32(b, "block_index")).transpose()?;
    if pv_fp8 && qk_int8.is_none() {
        return Err(to_py(invalid("pv_precision", "\"fp8\" (FP8 P.V) needs the INT8 Q K^T option (quant_gran=\"per_block\", \"per_warp\" or \"per_thread\")")));
    }
    let int8 = qk_int8.map(|g| QuantGran::parse(g).map(|gran| Int8Qk { gran, smooth_k, pv_fp8 })).transpose().map_err(to_py)?;
    AttnSpec::varlen(&q, &k, &v, cq, ck, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
        .and_then(|s| s.with_window(window_size.0, window_size.1))
        .and_then(|s| match ix {
            Some(ix) => s.with_block_index(ix, &index_shape, q_block, k_block, int8),
            None => Ok(s),
        })
        .map(|inner| PySpec { inner })
        .map_err(to_py)
}

fn ranges(a: &PyReadonlyArray2<'_, i32>, arg: &str) -> PyResult<Vec<[i32; 2]>> {
    let view = a.as_array();
    if view.shape()[1] != 2 {
        return Err(PyValueError::new_err(format!("invalid argument `{arg}`: expected shape [groups, 2], got {:?}", view.shape())));
    }
    Ok(view.rows().into_iter().map(|r| [r[0], r[1]]).collect())
}

#[pyfunction]
#[pyo3(signature = (q_shape, k_shape, v_shape, dtype, q_ranges, kv_ranges, softmax_scale, causal, window_size=(-1, -1), kv_block_table=None))]
#[allow(clippy::too_many_arguments)]
fn grouped_spec(
    q_shape: Vec<usize>,
    k_shape: Vec<usize>,
    v_shape: Vec<usize>,
    dtype: &str,
    q_ranges: PyReadonlyArray2<'_, i32>,
    kv_ranges: PyReadonlyArray2<'_, i32>,
    softmax_scale: Option<f64>,
    causal: bool,
    window_size: (i64, i64),
    kv_block_table: Option<PyReadonlyArray1<'_, i32>>,
) -> PyResult<PySpec> {
    let [q, k, v] = metas(q_shape, k_shape, v_shape, dtype)?;
    let qr = ranges(&q_ranges, "q_ranges")?;
    let kr = ranges(&kv_ranges, "kv_ranges")?;
    let table = kv_block_table.as_ref().map(|t| t.as_array().to_vec());
    AttnSpec::grouped(&q, &k, &v, &qr, &kr, softmax_scale, causal)
        .and_then(|s| s.with_window(window_size.0, window_size.1))
        .and_then(|s| match &table {
            Some(t) => s.with_kv_block_table(t),
            None => Ok(s),
        })
        .map(|inner| PySpec { inner })
        .map_err(to_py)
}

/// Forward on host buffers, on the backend `device` picks: (out as float32 or uint16 bits, lse
/// f32 [heads_q * total_q], backend name).
#[pyfunction]
#[pyo3(signature = (spec, q, k, v, device="auto"))]
fn forward<'py>(
    py: Python<'py>,
    spec: &PySpec,
    q: PyReadonlyArray1<'py, u8>,
    k: PyReadonlyArray1<'py, u8>,
    v: PyReadonlyArray1<'py, u8>,
    device: &str,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyArray1<f32>>, &'static str)> {
    let pref = DevicePref::parse(device).map_err(to_py)?;
    let s = &spec.inner;
    let dt = s.dtype;
    let (qb, kb, vb) = (Buf::new(&q, dt, "q")?, Buf::new(&k, dt, "k")?, Buf::new(&v, dt, "v")?);
    let (res, kind) = run_detached_as(
        py,
        || {
            let be = backend_for(pref, s, Pass::Forward)?;
            Ok((be.forward(s, qb.view(dt), kb.view(dt), vb.view(dt))?, be.kind().name()))
        },
        |e| call_err(s, e),
    )?;
    Ok((data_out(py, res.out), PyArray1::from_vec(py, res.lse), kind))
}

/// Backward on host buffers, on the backend `device` picks: (dq, dk, dv as float32 or uint16
/// bits, backend name).
#[pyfunction]
#[pyo3(signature = (spec, q, k, v, out, lse, dout, deterministic=false, device="auto"))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn backward<'py>(
    py: Python<'py>,
    spec: &PySpec,
    q: PyReadonlyArray1<'py, u8>,
    k: PyReadonlyArray1<'py, u8>,
    v: PyReadonlyArray1<'py, u8>,
    out: PyReadonlyArray1<'py, u8>,
    lse: PyReadonlyArray1<'py, f32>,
    dout: PyReadonlyArray1<'py, u8>,
    deterministic: bool,
    device: &str,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>, &'static str)> {
    let pref = DevicePref::parse(device).map_err(to_py)?;
    let s = &spec.inner;
    let dt = s.dtype;
    let (qb, kb, vb) = (Buf::new(&q, dt, "q")?, Buf::new(&k, dt, "k")?, Buf::new(&v, dt, "v")?);
    let (ob, gb) = (Buf::new(&out, dt, "out")?, Buf::new(&dout, dt, "dout")?);
    let lse = lse.as_slice().map_err(|_| PyValueError::new_err("`lse` must be contiguous"))?;
    let (g, kind) = run_detached_as(
        py,
        || {
            let be = backend_for(pref, s, Pass::Backward { deterministic })?;
            let inputs = BackwardInputs { out: ob.view(dt), lse, dout: gb.view(dt), deterministic };
            Ok((be.backward(s, qb.view(dt), kb.view(dt), vb.view(dt), inputs)?, be.kind().name()))
        },
        |e| call_err(s, e),
    )?;
    Ok((data_out(py, g.dq), data_out(py, g.dk), data_out(py, g.dv), kind))
}

fn device_dict<'py>(py: Python<'py>, d: &crate::device::DeviceInfo) -> PyResult<Bound<'py, PyDict>> {
    let x = PyDict::new(py);
    x.set_item("index", d.index)?;
    x.set_item("name", &d.name)?;
    x.set_item("compute_capability", d.compute_capability)?;
    x.set_item("total_memory", d.total_memory)?;
    x.set_item("free_memory", d.free_memory)?;
    x.set_item("sm_count", d.sm_count)?;
    x.set_item("cubecl_ok", d.cubecl_ok)?;
    Ok(x)
}

#[pyfunction]
fn backend_status(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let st = py.detach(|| catch_unwind(crate::device::backend_status))
        .map_err(|_| PyRuntimeError::new_err("device detection failed"))?;
    let x = PyDict::new(py);
    x.set_item("cuda_compiled", st.cuda_compiled)?;
    x.set_item("cuda_available", st.cuda_available)?;
    x.set_item("reason", st.reason)?;
    let devs = st.devices.iter().map(|d| device_dict(py, d)).collect::<PyResult<Vec<_>>>()?;
    x.set_item("devices", devs)?;
    Ok(x)
}

/// VRAM estimate in bytes for a call of this spec on the CUDA backend.
#[pyfunction]
#[pyo3(signature = (spec, backward=false, deterministic=false))]
fn estimate_vram<'py>(py: Python<'py>, spec: &PySpec, backward: bool, deterministic: bool) -> PyResult<Bound<'py, PyDict>> {
    let e = crate::vram::estimate_spec(&spec.inner, backward, deterministic);
    let x = PyDict::new(py);
    x.set_item("inputs", e.inputs)?;
    x.set_item("outputs", e.outputs)?;
    x.set_item("lse", e.lse)?;
    x.set_item("workspace", e.workspace)?;
    x.set_item("total", e.total)?;
    Ok(x)
}

/// Times the CUDA forward kernels on device-resident random inputs: per-iteration ms.
#[pyfunction]
#[pyo3(signature = (spec, warmup=3, iters=10))]
fn cuda_bench_forward(py: Python<'_>, spec: &PySpec, warmup: usize, iters: usize) -> PyResult<Vec<f64>> {
    let s = &spec.inner;
    run_detached(py, || cuda_bench(s, warmup, iters, false))
}

/// Times the CUDA forward + backward kernels on device-resident random inputs: per-iteration ms.
#[pyfunction]
#[pyo3(signature = (spec, warmup=3, iters=10))]
fn cuda_bench_forward_backward(py: Python<'_>, spec: &PySpec, warmup: usize, iters: usize) -> PyResult<Vec<f64>> {
    let s = &spec.inner;
    run_detached(py, || cuda_bench(s, warmup, iters, true))
}

#[cfg(feature = "cuda")]
fn cuda_bench(s: &AttnSpec, warmup: usize, iters: usize, backward: bool) -> crate::Result<Vec<f64>> {
    if backward {
        crate::backend::cuda::bench_backward(s, warmup, iters)
    } else {
        crate::backend::cuda::bench(s, warmup, iters, crate::backend::cuda::BenchPart::Forward, crate::backend::cuda::backward::DqPath::Auto)
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_bench(_s: &AttnSpec, _warmup: usize, _iters: usize, _backward: bool) -> crate::Result<Vec<f64>> {
    Err(Error::BackendUnavailable { backend: "cuda", reason: "this build of cubeattn has no `cuda` feature".into() })
}

/// `backward` (with `deterministic`) or the forward.
#[cfg(feature = "cuda")]
fn pass(backward: bool, deterministic: bool) -> Pass {
    if backward {
        Pass::Backward { deterministic }
    } else {
        Pass::Forward
    }
}

#[cfg(feature = "cuda")]
/// Workspace bytes of a device-resident call on `stream` (the launch plan of the call is built
/// and uploaded on `stream` if new), or None when the host path must run (`device` picks the CPU).
#[pyfunction]
#[pyo3(signature = (spec, device, stream, backward=false, deterministic=false))]
fn device_workspace(py: Python<'_>, spec: &PySpec, device: &str, stream: u64, backward: bool, deterministic: bool) -> PyResult<Option<usize>> {
    let pref = DevicePref::parse(device).map_err(to_py)?;
    let s = &spec.inner;
    let pass = pass(backward, deterministic);
    // SAFETY: `stream` is torch's current stream of this device (the Python caller's contract).
    run_detached_as(py, || unsafe { backend_for(pref, s, pass)?.device_workspace(s, pass, stream) }, |e| call_err(s, e))
}

#[cfg(feature = "cuda")]
/// Runs `f` on the CUDA backend of `device` for the device-count path (`forward_device_kv`):
/// None where that path does not serve the call (a CPU device, no CUDA backend there, or
/// `Err(Unsupported)`): the caller reads the key counts on the host instead.
fn on_counts_path<T: Send>(
    py: Python<'_>,
    spec: &AttnSpec,
    device: &str,
    f: impl FnOnce(&crate::backend::cuda::CudaBackend) -> crate::error::Result<T> + Send,
) -> PyResult<Option<T>> {
    let index = match DevicePref::parse(device).map_err(to_py)? {
        DevicePref::Cuda(i) | DevicePref::Auto(i) => i,
        DevicePref::Cpu => return Ok(None),
    };
    run_detached_as(
        py,
        || match crate::backend::cuda::CudaBackend::on(index) {
            Ok(be) => match f(&be) {
                Ok(r) => Ok(Some(r)),
                Err(Error::Unsupported { .. }) => Ok(None),
                Err(e) => Err(e),
            },
            Err(_) => Ok(None),
        },
        |e| call_err(spec, e),
    )
}

#[cfg(feature = "cuda")]
/// Workspace bytes of [`forward_device_kv`] for `spec` on `stream`, or None where that path does
/// not serve the call (then the caller reads the key counts on the host).
#[pyfunction]
fn forward_kv_workspace(py: Python<'_>, spec: &PySpec, device: &str, stream: u64) -> PyResult<Option<usize>> {
    let s = &spec.inner;
    // SAFETY: `stream` is torch's current stream of this device (the Python caller's contract).
    on_counts_path(py, s, device, |be| unsafe { be.forward_kv_workspace(s, stream) })
}

#[cfg(feature = "cuda")]
/// Forward on device-resident buffers (torch CUDA tensors as raw addresses, contiguous), enqueued
/// on `stream`; `workspace` holds at least [`device_workspace`] bytes: writes out and lse in
/// place, returns at once. False when the call has no row or key (nothing was enqueued).
#[pyfunction]
#[pyo3(signature = (spec, q, k, v, out, lse, workspace, workspace_bytes, stream, device))]
#[allow(clippy::too_many_arguments)]
fn forward_device(
    py: Python<'_>,
    spec: &PySpec,
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    lse: u64,
    workspace: u64,
    workspace_bytes: usize,
    stream: u64,
    device: &str,
) -> PyResult<bool> {
    let pref = DevicePref::parse(device).map_err(to_py)?;
    let s = &spec.inner;
    let p = crate::backend::FwdPtrs { q, k, v, out, lse, workspace };
    // SAFETY: the Python caller passes contiguous CUDA tensors of the spec's shapes and dtype on
    // this device and torch's current stream there; torch's caching allocator keeps the tensors
    // alive until the work enqueued on that stream has run.
    run_detached_as(py, || unsafe { backend_for(pref, s, Pass::Forward)?.forward_device(s, p, workspace_bytes, stream) }, |e| call_err(s, e))
}

#[cfg(feature = "cuda")]
/// A decode step of `flash_attn_with_kvcache` with its key counts on the device (int32 `counts`
/// `[batch]`, a CUDA `cache_seqlens`): appends `n_new` keys / values (`k_new`, `v_new`) into the
/// caches `k`, `v` (rows of `width` keys) at each row's count and runs the forward of `spec` (the
/// call over full cache rows) with those counts, all enqueued on `stream` (see
/// `backend::cuda::kvcache`). None (nothing enqueued) where this path does not serve the call: the
/// caller reads the counts on the host instead.
#[pyfunction]
#[pyo3(signature = (spec, q, k, v, out, lse, workspace, workspace_bytes, stream, device, counts, k_new, v_new, n_new, width))]
#[allow(clippy::too_many_arguments)]
fn forward_device_kv(
    py: Python<'_>,
    spec: &PySpec,
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    lse: u64,
    workspace: u64,
    workspace_bytes: usize,
    stream: u64,
    device: &str,
    counts: u64,
    k_new: u64,
    v_new: u64,
    n_new: usize,
    width: usize,
) -> PyResult<Option<bool>> {
    let s = &spec.inner;
    let p = crate::backend::FwdPtrs { q, k, v, out, lse, workspace };
    let kv = crate::backend::cuda::KvAppend { counts, k_new, v_new, n_new, width };
    // SAFETY: as in `forward_device`; `counts`, `k_new`, `v_new` are contiguous CUDA tensors of
    // the documented shapes on the same device and stream.
    on_counts_path(py, s, device, |be| unsafe { be.forward_device_kv(s, p, kv, workspace_bytes, stream) })
}

#[cfg(feature = "cuda")]
/// Backward on device-resident buffers (see [`forward_device`]); writes dq, dk, dv in place.
#[pyfunction]
#[pyo3(signature = (spec, q, k, v, out, lse, dout, dq, dk, dv, workspace, workspace_bytes, stream, deterministic, device))]
#[allow(clippy::too_many_arguments)]
fn backward_device(
    py: Python<'_>,
    spec: &PySpec,
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    lse: u64,
    dout: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    workspace: u64,
    workspace_bytes: usize,
    stream: u64,
    deterministic: bool,
    device: &str,
) -> PyResult<bool> {
    let pref = DevicePref::parse(device).map_err(to_py)?;
    let s = &spec.inner;
    let p = crate::backend::BwdPtrs { q, k, v, out, lse, dout, dq, dk, dv, workspace };
    let pass = Pass::Backward { deterministic };
    // SAFETY: as in `forward_device`.
    run_detached_as(py, || unsafe { backend_for(pref, s, pass)?.backward_device(s, p, deterministic, workspace_bytes, stream) }, |e| call_err(s, e))
}

/// Why the CUDA backend does not serve `spec` (`backward`: its backward, `deterministic` or not)
/// on the GPU `device` names ("auto:N", "cuda:N"; without one, on any GPU), or None when it does.
/// The Python layer names it when `device="auto"` runs CUDA tensors on the CPU backend.
#[pyfunction]
#[pyo3(signature = (spec, backward=false, deterministic=false, device=None))]
fn cuda_refusal(spec: &PySpec, backward: bool, deterministic: bool, device: Option<&str>) -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        let p = pass(backward, deterministic);
        let index = device.and_then(|d| match DevicePref::parse(d) {
            Ok(DevicePref::Auto(i) | DevicePref::Cuda(i)) => Some(i),
            _ => None,
        });
        match index.map(crate::backend::cuda::CudaBackend::on) {
            Some(Ok(be)) => be.check(&spec.inner, p),
            Some(Err(e)) => Err(e),
            None => crate::backend::cuda::check_supported(&spec.inner, p),
        }
        .err()
        .map(|e| e.to_string())
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (spec, backward, deterministic, device);
        Some("this build of cubeattn has no `cuda` feature".into())
    }
}

/// FlexAttention BlockMask fields -> (flat block_index int32, its shape).
#[pyfunction]
#[pyo3(signature = (kv_num_blocks, num_shape, kv_indices, idx_shape, full_kv_num_blocks=None, full_num_shape=None, full_kv_indices=None, full_idx_shape=None))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn flex_block_index<'py>(
    py: Python<'py>,
    kv_num_blocks: PyReadonlyArray1<'py, i32>,
    num_shape: Vec<usize>,
    kv_indices: PyReadonlyArray1<'py, i32>,
    idx_shape: Vec<usize>,
    full_kv_num_blocks: Option<PyReadonlyArray1<'py, i32>>,
    full_num_shape: Option<Vec<usize>>,
    full_kv_indices: Option<PyReadonlyArray1<'py, i32>>,
    full_idx_shape: Option<Vec<usize>>,
) -> PyResult<(Bound<'py, PyArray1<i32>>, Vec<usize>)> {
    let num = flat_i32(&kv_num_blocks, "kv_num_blocks")?;
    let idx = flat_i32(&kv_indices, "kv_indices")?;
    let full = match (&full_kv_num_blocks, &full_num_shape, &full_kv_indices, &full_idx_shape) {
        (Some(a), Some(ash), Some(b), Some(bsh)) => Some((flat_i32(a, "full_kv_num_blocks")?, ash.as_slice(), flat_i32(b, "full_kv_indices")?, bsh.as_slice())),
        (None, None, None, None) => None,
        _ => return Err(PyValueError::new_err("invalid argument `full_kv_indices`: give full_kv_num_blocks and full_kv_indices together")),
    };
    let (out, shape) = crate::sparse::block_index_from_flex(num, &num_shape, idx, &idx_shape, full).map_err(to_py)?;
    Ok((PyArray1::from_vec(py, out), shape))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // keys per block of a paged K,V (`kv_block_table`)
    m.add("KV_PAGE", crate::spec::KV_PAGE)?;
    m.add_class::<PySpec>()?;
    m.add_function(wrap_pyfunction!(varlen_spec, m)?)?;
    m.add_function(wrap_pyfunction!(grouped_spec, m)?)?;
    m.add_function(wrap_pyfunction!(flex_block_index, m)?)?;
    m.add_function(wrap_pyfunction!(forward, m)?)?;
    m.add_function(wrap_pyfunction!(backward, m)?)?;
    #[cfg(feature = "cuda")]
    m.add_function(wrap_pyfunction!(device_workspace, m)?)?;
    #[cfg(feature = "cuda")]
    m.add_function(wrap_pyfunction!(forward_device, m)?)?;
    #[cfg(feature = "cuda")]
    m.add_function(wrap_pyfunction!(forward_device_kv, m)?)?;
    #[cfg(feature = "cuda")]
    m.add_function(wrap_pyfunction!(forward_kv_workspace, m)?)?;
    #[cfg(feature = "cuda")]
    m.add_function(wrap_pyfunction!(backward_device, m)?)?;
    m.add_function(wrap_pyfunction!(backend_status, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_refusal, m)?)?;
    m.add_function(wrap_pyfunction!(estimate_vram, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_bench_forward, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_bench_forward_backward, m)?)?;
    #[cfg(feature = "cuda")]
    m.add("CUDA_COMPILED", cfg!(feature = "cuda"))?;
    add_zigzag(m)?;
    Ok(())
}

// ---------------------------------------------------------------- zigzag layout (src/zigzag.rs)

fn usize_rows(rows: &PyReadonlyArray1<'_, i64>) -> PyResult<Vec<usize>> {
    let r = rows.as_slice().map_err(|_| PyValueError::new_err("`rows` must be contiguous"))?;
    r.iter()
        .map(|&x| usize::try_from(x).map_err(|_| PyValueError::new_err(format!("invalid argument `rows`: negative row {x}"))))
        .collect()
}

fn cu_slice<'a>(cu: &'a PyReadonlyArray1<'_, i32>) -> PyResult<&'a [i32]> {
    cu.as_slice().map_err(|_| PyValueError::new_err("`cu_seqlens` must be contiguous"))
}

fn index_out(py: Python<'_>, rows: Vec<usize>) -> Bound<'_, PyArray1<i64>> {
    PyArray1::from_vec(py, rows.into_iter().map(|r| r as i64).collect())
}

/// Local shard cu_seqlens of `rank` (every sequence split 2W ways, two chunks per rank); without
/// a rank every length must be a multiple of 2W (the same local cu_seqlens on every rank).
#[pyfunction]
#[pyo3(signature = (cu_seqlens, world_size, rank=None))]
fn zigzag_local_cu_seqlens<'py>(py: Python<'py>, cu_seqlens: PyReadonlyArray1<'py, i32>, world_size: usize, rank: Option<usize>) -> PyResult<Bound<'py, PyArray1<i32>>> {
    let v = crate::zigzag::local_cu_seqlens(cu_slice(&cu_seqlens)?, world_size, rank).map_err(to_py)?;
    Ok(PyArray1::from_vec(py, v))
}

/// Rows of one rank's block in the gathered zigzag buffer (the longest local shard).
#[pyfunction]
fn zigzag_rank_rows(cu_seqlens: PyReadonlyArray1<'_, i32>, world_size: usize) -> PyResult<usize> {
    crate::zigzag::rank_rows(cu_slice(&cu_seqlens)?, world_size).map_err(to_py)
}

/// Full-batch row of each row of `rank`'s zigzag shard.
#[pyfunction]
fn zigzag_shard_rows<'py>(py: Python<'py>, cu_seqlens: PyReadonlyArray1<'py, i32>, world_size: usize, rank: usize) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let v = crate::zigzag::shard_rows(cu_slice(&cu_seqlens)?, world_size, rank).map_err(to_py)?;
    Ok(index_out(py, v))
}

/// Gathered-buffer row of each row of the extracted causal prefixes (chunks 0..=max_chunk).
#[pyfunction]
fn zigzag_gathered_rows<'py>(py: Python<'py>, cu_seqlens: PyReadonlyArray1<'py, i32>, world_size: usize, max_chunk: usize) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let v = crate::zigzag::gathered_rows(cu_slice(&cu_seqlens)?, world_size, max_chunk).map_err(to_py)?;
    Ok(index_out(py, v))
}

/// out[i] = src[rows[i]] (rows of `row_bytes` bytes): exact for any dtype.
#[pyfunction]
fn zigzag_extract<'py>(py: Python<'py>, src: PyReadonlyArray1<'py, u8>, row_bytes: usize, rows: PyReadonlyArray1<'py, i64>) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let rows = usize_rows(&rows)?;
    let s = src.as_slice().map_err(|_| PyValueError::new_err("`kv` must be contiguous"))?;
    let out = run_detached(py, || crate::zigzag::extract(s, row_bytes, &rows))?;
    Ok(PyArray1::from_vec(py, out))
}

/// out[rows[i]] = src[i], other rows zero, `total_rows` rows.
#[pyfunction]
fn zigzag_scatter<'py>(py: Python<'py>, src: PyReadonlyArray1<'py, u8>, row_bytes: usize, rows: PyReadonlyArray1<'py, i64>, total_rows: usize) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let rows = usize_rows(&rows)?;
    let s = src.as_slice().map_err(|_| PyValueError::new_err("`grad` must be contiguous"))?;
    let out = run_detached(py, || crate::zigzag::scatter(s, row_bytes, &rows, total_rows))?;
    Ok(PyArray1::from_vec(py, out))
}

#[cfg(feature = "cuda")]
/// Zigzag extract (`scatter=false`: `src` is the gathered buffer, `out` gets the prefixes) or
/// scatter (`src` holds the prefixes, `out` gets every gathered row, zero outside them) on
/// device-resident buffers (torch CUDA tensors as raw addresses, contiguous rows of `row_bytes`
/// bytes; `out` has room for `out_rows` of them) of CUDA device `device`, enqueued on `stream`:
/// returns True at once, or False when no CUDA backend starts on that device (the caller copies
/// another way).
#[pyfunction]
#[pyo3(signature = (cu_seqlens, world_size, max_chunk, src, src_rows, out, out_rows, row_bytes, scatter, stream, device))]
#[allow(clippy::too_many_arguments)]
fn zigzag_copy_device(
    py: Python<'_>,
    cu_seqlens: PyReadonlyArray1<'_, i32>,
    world_size: usize,
    max_chunk: usize,
    src: u64,
    src_rows: usize,
    out: u64,
    out_rows: usize,
    row_bytes: usize,
    scatter: bool,
    stream: u64,
    device: usize,
) -> PyResult<bool> {
    use crate::backend::cuda::{CudaBackend, ZigzagCopy};
    let cu = cu_slice(&cu_seqlens)?;
    let op = if scatter { ZigzagCopy::Scatter } else { ZigzagCopy::Extract };
    run_detached(py, || match CudaBackend::on(device) {
        // SAFETY: the Python caller passes contiguous CUDA tensors of this device holding
        // `src_rows` rows (src) and room for `out_rows` rows (out), and torch's current
        // stream there; torch's caching allocator keeps them alive until the work enqueued on
        // that stream has run.
        Ok(be) => unsafe { be.zigzag_copy_device(op, cu, world_size, max_chunk, src, src_rows, out, out_rows, row_bytes, stream) }
            .map(|()| true),
        Err(Error::BackendUnavailable { .. }) => Ok(false),
        Err(e) => Err(e),
    })
}

fn add_zigzag(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(zigzag_local_cu_seqlens, m)?)?;
    m.add_function(wrap_pyfunction!(zigzag_shard_rows, m)?)?;
    m.add_function(wrap_pyfunction!(zigzag_gathered_rows, m)?)?;
    m.add_function(wrap_pyfunction!(zigzag_rank_rows, m)?)?;
    m.add_function(wrap_pyfunction!(zigzag_extract, m)?)?;
    m.add_function(wrap_pyfunction!(zigzag_scatter, m)?)?;
    #[cfg(feature = "cuda")]
    m.add_function(wrap_pyfunction!(zigzag_copy_device, m)?)?;
    Ok(())
}
