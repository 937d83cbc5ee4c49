//! The CUDA side of the candle ops (feature `candle-cuda`): `cuda_fwd` of the forward and backward
//! ops runs the CUDA backend's device-resident calls ([`CudaBackend::forward_device`],
//! [`CudaBackend::backward_device`]) on the tensors' device and on candle's stream, with device
//! addresses of candle's own buffers: inputs read in place (a contiguous, 16-byte aligned layout;
//! anything else is copied into one contiguous buffer on the device first), outputs, lse and the
//! workspace allocated as candle buffers on that stream. Nothing is copied to or from the host and
//! nothing synchronizes.
//!
//! The spec was validated when the op was built (`super::*_spec`, the same as for CPU tensors);
//! here only what the CUDA kernels add is checked (`CudaBackend::check`: dtype, size, the GPU).
//!
//! Stream order: every buffer is taken with cudarc's `device_ptr` / `device_ptr_mut`, which make
//! candle's stream wait for the buffer's last writer (and, for an output, its readers) when
//! candle tracks events, and record the call's use when their guards drop, after the launches.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice};
use candle_core::op::BackpropOp;
use candle_core::scalar::Scalar;
use candle_core::{DeviceLocation, Layout, Shape, Storage, Tensor};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use super::{invalid, to_candle, CResult};
use crate::backend::cuda::{BwdPtrs, CudaBackend, FwdPtrs};
use crate::backend::Backend;
use crate::error::Error;
use crate::spec::AttnSpec;

/// The CUDA backend of `dev`'s GPU, once it serves the forward of `spec` (every head_dim up to
/// 256: those without a kernel of their own run padded, `backend::cuda::head_pad`).
fn backend(dev: &CudaDevice, spec: &AttnSpec) -> CResult<&'static CudaBackend> {
    let gpu = match dev.location() {
        DeviceLocation::Cuda { gpu_id } => gpu_id,
        other => return Err(candle_core::Error::msg(format!("cubeattn: a CUDA storage reports device {other:?}"))),
    };
    let be = CudaBackend::on(gpu).map_err(to_candle)?;
    be.check(spec, crate::backend::Pass::Forward).map_err(to_candle)?;
    Ok(be)
}

/// Uninitialized device memory for `n` elements of `dtype` on `dev` (at least one element: the
/// allocator takes no empty request), allocated on candle's stream.
fn alloc(dev: &CudaDevice, n: usize, dtype: candle_core::DType) -> CResult<CudaStorage> {
    // SAFETY: every element is written before it is read: by the kernels, or by `fill` when the
    // call has no work; a workspace is scratch memory the kernels initialize themselves.
    unsafe { dev.alloc_uninit(&Shape::from(n.max(1)), dtype) }
}

/// One input as the kernels read it: candle's buffer in place, or a contiguous copy of it.
enum DevIn<'a> {
    /// The buffer and the element offset of the tensor's first element.
    InPlace(&'a CudaStorage, usize),
    Copied(CudaStorage),
}

impl<'a> DevIn<'a> {
    fn new(s: &'a CudaStorage, l: &Layout) -> CResult<DevIn<'a>> {
        if let Some((start, _)) = l.contiguous_offsets() {
            if (start * s.dtype().size_in_bytes()).is_multiple_of(16) {
                return Ok(DevIn::InPlace(s, start));
            }
        }
        let mut c = alloc(s.device(), l.shape().elem_count(), s.dtype())?;
        s.copy_strided_src(&mut c, 0, l)?;
        Ok(DevIn::Copied(c))
    }

    /// The device address of the first element, read on `stream`; the guard goes into `guards`.
    fn ptr<'g>(&'g self, stream: &'g CudaStream, guards: &mut Vec<SyncOnDrop<'g>>) -> CResult<u64> {
        let (s, start) = match self {
            DevIn::InPlace(s, start) => (*s, *start),
            DevIn::Copied(s) => (s, 0),
        };
        read_ptr(s, stream, guards).map(|p| p + (start * s.dtype().size_in_bytes()) as u64)
    }
}

/// An input that is another candle tensor (out, dout, lse of the backward), held for the call.
fn tensor_storage<'t>(arg: &'static str, t: &'t Tensor, spec: &AttnSpec, n: usize) -> CResult<(candle_core::StorageRef<'t>, &'t Layout)> {
    let want = if arg == "lse" { crate::dtype::DType::F32 } else { spec.dtype };
    if super::dtype_of(arg, t)? != want || t.elem_count() != n {
        return Err(to_candle(Error::InvalidArgument {
            arg,
            msg: format!("expected {n} {} values, got {:?} {}", want.name(), t.dims(), t.dtype().as_str()),
        }));
    }
    Ok(t.storage_and_layout())
}

fn cuda_of<'s>(arg: &'static str, s: &'s Storage) -> CResult<&'s CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => Err(invalid(arg, "is not on the CUDA device of q")),
    }
}

macro_rules! dev_ptr {
    ($slice:expr, $method:ident, $stream:expr, $guards:expr, [$($v:ident),*]) => {
        match $slice {
            $(CudaStorageSlice::$v(x) => {
                let (p, g) = x.$method($stream);
                $guards.push(g);
                Ok(p)
            })*
            _ => Err(candle_core::Error::msg("cubeattn: unexpected dtype of a CUDA buffer")),
        }
    };
}

/// Device address of a buffer the kernels read.
fn read_ptr<'g>(s: &'g CudaStorage, stream: &'g CudaStream, guards: &mut Vec<SyncOnDrop<'g>>) -> CResult<u64> {
    dev_ptr!(&s.slice, device_ptr, stream, guards, [F16, BF16, F32, U8])
}

/// Device address of a buffer the kernels write.
fn write_ptr<'g>(s: &'g mut CudaStorage, stream: &'g CudaStream, guards: &mut Vec<SyncOnDrop<'g>>) -> CResult<u64> {
    dev_ptr!(&mut s.slice, device_ptr_mut, stream, guards, [F16, BF16, F32, U8])
}

/// Fills the first `n` elements of `s` with `x` (the outputs of a call with no query row or key).
fn fill(s: &mut CudaStorage, n: usize, x: Scalar) -> CResult<()> {
    if n > 0 {
        s.const_set(x, &Layout::contiguous(n))?;
    }
    Ok(())
}

/// The forward of `spec` on q, k, v: (out, in q's dtype, contiguous; lse f32 `[heads_q, total_q]`).
pub(super) fn forward(
    spec: &AttnSpec,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> CResult<(CudaStorage, Tensor)> {
    let dev = q.0.device();
    let be = backend(dev, spec)?;
    let stream = dev.cuda_stream();
    let s = stream.cu_stream() as u64;
    let (qi, ki, vi) = (DevIn::new(q.0, q.1)?, DevIn::new(k.0, k.1)?, DevIn::new(v.0, v.1)?);
    let d = &spec.dims;
    let mut out = alloc(dev, d.out_len(), q.0.dtype())?;
    let mut lse = alloc(dev, d.lse_len(), candle_core::DType::F32)?;
    // SAFETY: `s` is candle's stream of this device (same primary context as the backend).
    let ws_bytes = unsafe { be.forward_workspace(spec, s) }.map_err(to_candle)?;
    let mut ws = alloc(dev, ws_bytes, candle_core::DType::U8)?;
    let ran = {
        let mut g = Vec::with_capacity(6);
        let p = FwdPtrs {
            q: qi.ptr(&stream, &mut g)?,
            k: ki.ptr(&stream, &mut g)?,
            v: vi.ptr(&stream, &mut g)?,
            out: write_ptr(&mut out, &stream, &mut g)?,
            lse: write_ptr(&mut lse, &stream, &mut g)?,
            workspace: write_ptr(&mut ws, &stream, &mut g)?,
        };
        // SAFETY: q, k, v hold the spec's contiguous tensors (the spec was built from their
        // shapes and dtype), out and lse room for the outputs, ws `ws_bytes` bytes; all are
        // buffers of this device, kept alive (and their uses recorded by the guards) until the
        // enqueued work has run: candle frees them stream-ordered on this same stream.
        unsafe { be.forward_device(spec, p, ws_bytes, s) }.map_err(to_candle)?
    };
    if !ran {
        fill(&mut out, d.out_len(), Scalar::zero(q.0.dtype()))?;
        fill(&mut lse, d.lse_len(), Scalar::F32(f32::INFINITY))?;
    }
    let lse = Tensor::from_storage(Storage::Cuda(lse), (d.heads_q, d.total_q), BackpropOp::none(), false);
    Ok((out, lse))
}

/// The backward of `spec`: [dq | dk | dv] in one contiguous buffer of q's dtype.
pub(super) fn backward(
    spec: &AttnSpec,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    out: &Tensor,
    dout: &Tensor,
    lse: &Tensor,
) -> CResult<CudaStorage> {
    let dev = q.0.device();
    let be = backend(dev, spec)?;
    let stream = dev.cuda_stream();
    let s = stream.cu_stream() as u64;
    let d = &spec.dims;
    let (so, sg, sl) = (
        tensor_storage("out", out, spec, d.out_len())?,
        tensor_storage("dout", dout, spec, d.out_len())?,
        tensor_storage("lse", lse, spec, d.lse_len())?,
    );
    let (qi, ki, vi) = (DevIn::new(q.0, q.1)?, DevIn::new(k.0, k.1)?, DevIn::new(v.0, v.1)?);
    let oi = DevIn::new(cuda_of("out", &so.0)?, so.1)?;
    let gi = DevIn::new(cuda_of("dout", &sg.0)?, sg.1)?;
    let li = DevIn::new(cuda_of("lse", &sl.0)?, sl.1)?;
    let n = super::grads_len(spec);
    let mut grads = alloc(dev, n, q.0.dtype())?;
    // the fused dQ path (the backend's default; deterministic = false)
    let det = false;
    // SAFETY: as in `forward`.
    let ws_bytes = unsafe { be.backward_workspace(spec, det, s) }.map_err(to_candle)?;
    let mut ws = alloc(dev, ws_bytes, candle_core::DType::U8)?;
    let es = q.0.dtype().size_in_bytes() as u64;
    let ran = {
        let mut g = Vec::with_capacity(9);
        let base = write_ptr(&mut grads, &stream, &mut g)?;
        let p = BwdPtrs {
            q: qi.ptr(&stream, &mut g)?,
            k: ki.ptr(&stream, &mut g)?,
            v: vi.ptr(&stream, &mut g)?,
            out: oi.ptr(&stream, &mut g)?,
            lse: li.ptr(&stream, &mut g)?,
            dout: gi.ptr(&stream, &mut g)?,
            dq: base,
            dk: base + d.q_len() as u64 * es,
            dv: base + (d.q_len() + d.kv_len()) as u64 * es,
            workspace: write_ptr(&mut ws, &stream, &mut g)?,
        };
        // SAFETY: as in `forward`; dq, dk, dv are disjoint parts of `grads` (each offset a
        // multiple of 16 bytes at the kernels' head dims, whose rows are; the padded path of the
        // other head dims copies at any alignment).
        unsafe { be.backward_device(spec, p, det, ws_bytes, s) }.map_err(to_candle)?
    };
    if !ran {
        fill(&mut grads, n, Scalar::zero(q.0.dtype()))?;
    }
    Ok(grads)
}
