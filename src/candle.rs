//! cubeattn as [candle](https://github.com/huggingface/candle) ops (feature `candle`).
//!
//! Functions take and return `candle_core::Tensor`s, with the names, layouts and argument order of
//! `candle-flash-attn`:
//!
//! * [`flash_attn`]: q `[batch, seqlen_q, heads_q, head_dim]`, k/v `[batch, seqlen_k, heads_kv,
//!   head_dim]`, out like q (with v's head_dim). Every batch entry has the same lengths.
//! * [`flash_attn_varlen`]: q `[total_q, heads_q, head_dim]`, k/v `[total_k, heads_kv, head_dim]`
//!   with cumulative sequence lengths `seqlens_q` / `seqlens_k` (1-D, `batch + 1` entries, u32,
//!   i32 or i64).
//! * v may have a head_dim of its own (DeepSeek's MLA: q, k 192, v 128); out then has v's. The
//!   call runs at the wider head_dim, the narrower tensors copied with zero columns (on the CPU
//!   that copy replaces the zero-copy read described under **Memory**).
//! * [`grouped_flash_attn`]: cubeattn's grouped attention: group g's query rows `q_ranges[g]`
//!   attend keys `kv_ranges[g]` of one shared K,V (ranges may overlap in keys), one call.
//!
//! Each has a `*_with_lse` variant returning `(out, lse)`, lse f32: `[batch, heads_q, seqlen_q]`
//! for [`flash_attn_with_lse`], `[heads_q, total_q]` for the varlen and grouped ones (flash-attn's
//! layouts), on q's device. The lse is a plain (detached) tensor: gradients flow through `out` only.
//!
//! Conventions are cubeattn's (and flash-attn's): f32, f16 and bf16 (math in f32); causal is
//! bottom-right aligned when seqlen_q != seqlen_k; GQA needs heads_q % heads_kv == 0 and query head
//! h reads K,V head `h / (heads_q / heads_kv)`; a row that sees no key gets a zero output and an
//! lse of +inf.
//!
//! **Autograd.** The forward is a candle `CustomOp3` whose `bwd` runs cubeattn's own backward
//! ([`Backend::backward`], from the saved lse) through a second custom op, so `loss.backward()`
//! gives exact flash-attention gradients without materialising the S x S matrix.
//!
//! **Memory.** On the CPU, contiguous candle storage is read in place (zero copy: q, k, v are
//! borrowed as slices of candle's buffers, and the output vector becomes the result tensor's
//! storage without a copy). A non-contiguous input (a transposed or narrowed view, a broadcast
//! gradient) is gathered into one contiguous buffer once per call; call `.contiguous()` yourself
//! to reuse that copy across calls.
//!
//! **Devices.** CPU tensors always. CUDA tensors with the `candle-cuda` feature (candle-core's
//! `cuda` feature plus cubeattn's CUDA backend): the ops then launch cubeattn's CUDA kernels on the
//! tensors' device and on candle's stream, reading candle's buffers in place and writing the
//! outputs (and the lse, kept on the device for the backward) into fresh candle buffers: no host
//! copies, and no device copies of contiguous inputs. CUDA tensors take f16, bf16 (tensor cores)
//! or f32 and every head_dim up to 256 (the kernels' own head dims are 32, 64, 96, 128, 192 and
//! 256; the others run on the next one with zero columns, exactly); the backward above head_dim 128
//! needs f16 / bf16 on a Hopper GPU (elsewhere `backward()` returns the CUDA backend's error). The backward on CUDA
//! is the CUDA backend's default (dQ accumulated with atomics: last-bit differences run to run).
//! candle's CUDA device runs on the per-thread default stream, one handle for every thread, while
//! cubeattn's cached launch plans order work across streams by handle: drive one device's calls
//! from one thread (as candle models do).
//! `candle-cuda` links the CUDA libraries at build time (candle-core turns on cudarc's
//! `dynamic-linking`), so it needs them where it is built: scripts/build-candle-cuda.sh builds it
//! on a machine without the CUDA toolkit. Without the feature, a CUDA tensor (possible when another
//! crate turns on candle-core's `cuda`) and a Metal tensor give an error, never a panic.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};

#[cfg(feature = "candle-cuda")]
mod cuda;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, CustomOp3, Device, Layout, MetalStorage, Shape, Tensor};
use half::{bf16, f16};

use crate::backend::{cpu::CpuBackend, Backend, BackwardInputs};
use crate::dtype::{DType, HostData, HostView};
use crate::error::Error;
use crate::spec::{AttnSpec, TensorMeta};

type CResult<T> = candle_core::Result<T>;

/// A cubeattn error as a candle error; the message names the argument (`invalid argument `q`: ...`).
fn to_candle(e: Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

fn invalid(arg: &'static str, msg: impl Into<String>) -> candle_core::Error {
    to_candle(Error::InvalidArgument { arg, msg: msg.into() })
}

/// The spec's argument names for the varlen boundaries are flash-attn's Python ones
/// (`cu_seqlens_*`); the candle functions call them `seqlens_*` (candle-flash-attn's names).
fn rename_varlen(e: Error) -> Error {
    let rename = |arg: &'static str| match arg {
        "cu_seqlens_q" => "seqlens_q",
        "cu_seqlens_k" => "seqlens_k",
        a => a,
    };
    match e {
        Error::InvalidArgument { arg, msg } => Error::InvalidArgument { arg: rename(arg), msg },
        Error::InvalidDtype { arg, msg } => Error::InvalidDtype { arg: rename(arg), msg },
        e => e,
    }
}

fn unsupported_device(dev: &str) -> candle_core::Error {
    let how = match dev {
        "CUDA" => "build cubeattn with its `candle-cuda` feature for CUDA tensors, or move q, k, v to the CPU",
        _ => "move q, k, v to the CPU",
    };
    to_candle(Error::Unsupported { backend: "candle", msg: format!("{dev} tensors are not served by this build: {how}") })
}

fn dtype_of(arg: &'static str, t: &Tensor) -> CResult<DType> {
    match t.dtype() {
        candle_core::DType::F32 => Ok(DType::F32),
        candle_core::DType::F16 => Ok(DType::F16),
        candle_core::DType::BF16 => Ok(DType::BF16),
        other => Err(to_candle(Error::InvalidDtype {
            arg,
            msg: format!("expected f32, f16 or bf16, got {}", other.as_str()),
        })),
    }
}

fn check_device(arg: &'static str, t: &Tensor, q: &Tensor) -> CResult<()> {
    if !t.device().same_device(q.device()) {
        return Err(invalid(arg, format!("is on {:?} but q is on {:?}", t.device().location(), q.device().location())));
    }
    Ok(())
}

/// Metadata of a `[tokens, heads, head_dim]` view of `t` (rank 3 as is; rank 4 with its first two
/// axes merged, which is the same memory for a row-major tensor).
fn meta3(t: &Tensor, dtype: DType) -> TensorMeta {
    let d = t.dims();
    match d.len() {
        4 => TensorMeta::new(&[d[0] * d[1], d[2], d[3]], dtype),
        _ => TensorMeta::new(d, dtype),
    }
}

fn check_rank(arg: &'static str, t: &Tensor, rank: usize, what: &str) -> CResult<()> {
    if t.rank() != rank {
        return Err(invalid(arg, format!("expected rank {rank} {what}, got rank {} (shape {:?})", t.rank(), t.dims())));
    }
    Ok(())
}

/// q, k, v checked for dtype and device (shapes are the spec's business); returns the dtype.
fn check_common(q: &Tensor, k: &Tensor, v: &Tensor) -> CResult<DType> {
    let dt = dtype_of("q", q)?;
    let (dk, dv) = (dtype_of("k", k)?, dtype_of("v", v)?);
    if dk != dt {
        return Err(to_candle(Error::InvalidDtype { arg: "k", msg: format!("{} differs from q's {}", dk.name(), dt.name()) }));
    }
    if dv != dt {
        return Err(to_candle(Error::InvalidDtype { arg: "v", msg: format!("{} differs from q's {}", dv.name(), dt.name()) }));
    }
    check_device("k", k, q)?;
    check_device("v", v, q)?;
    Ok(dt)
}

// ---------------------------------------------------------------------------------------------
// Host views of candle CPU storage.

/// Row-major element offsets of a (possibly strided) layout.
fn strided_offsets(l: &Layout) -> Vec<usize> {
    let (dims, stride) = (l.dims(), l.stride());
    let n: usize = dims.iter().product();
    let mut out = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let mut idx = vec![0usize; dims.len()];
    let mut off = l.start_offset();
    for _ in 0..n {
        out.push(off);
        for ax in (0..dims.len()).rev() {
            idx[ax] += 1;
            off += stride[ax];
            if idx[ax] < dims[ax] {
                break;
            }
            off -= stride[ax] * dims[ax];
            idx[ax] = 0;
        }
    }
    out
}

/// The elements of `s` under layout `l` in row-major order: a borrowed slice when the layout is
/// contiguous (zero copy), else one gathered copy.
fn elems<'a, T: Copy>(s: &'a [T], l: &Layout) -> Cow<'a, [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Cow::Borrowed(&s[a..b]),
        None => Cow::Owned(strided_offsets(l).into_iter().map(|i| s[i]).collect()),
    }
}

/// Host data of one input: borrowed from candle's storage where possible.
enum HostIn<'a> {
    F32(Cow<'a, [f32]>),
    F16(Cow<'a, [f16]>),
    BF16(Cow<'a, [bf16]>),
}

impl<'a> HostIn<'a> {
    fn new(arg: &'static str, s: &'a CpuStorage, l: &Layout) -> CResult<HostIn<'a>> {
        Ok(match s {
            CpuStorage::F32(v) => HostIn::F32(elems(v, l)),
            CpuStorage::F16(v) => HostIn::F16(elems(v, l)),
            CpuStorage::BF16(v) => HostIn::BF16(elems(v, l)),
            other => {
                return Err(to_candle(Error::InvalidDtype {
                    arg,
                    msg: format!("expected f32, f16 or bf16, got {}", other.dtype().as_str()),
                }))
            }
        })
    }
    fn view(&self) -> HostView<'_> {
        match self {
            HostIn::F32(c) => HostView::F32(c),
            HostIn::F16(c) => HostView::F16(c),
            HostIn::BF16(c) => HostView::BF16(c),
        }
    }
}

/// Moves owned host data into candle storage (no copy).
fn storage_of(d: HostData) -> CpuStorage {
    match d {
        HostData::F32(v) => CpuStorage::F32(v),
        HostData::F16(v) => CpuStorage::F16(v),
        HostData::BF16(v) => CpuStorage::BF16(v),
    }
}

/// Reads a tensor's CPU storage as host data (borrowed when contiguous) and runs `f` on it.
fn with_host<R>(arg: &'static str, t: &Tensor, f: impl FnOnce(HostView<'_>) -> CResult<R>) -> CResult<R> {
    let (guard, layout) = t.storage_and_layout();
    match &*guard {
        candle_core::Storage::Cpu(s) => {
            let h = HostIn::new(arg, s, layout)?;
            f(h.view())
        }
        candle_core::Storage::Cuda(_) => Err(unsupported_device("CUDA")),
        candle_core::Storage::Metal(_) => Err(unsupported_device("Metal")),
    }
}

// ---------------------------------------------------------------------------------------------
// The custom ops.

/// Where the forward leaves its lse: f32 `[heads_q, total_q]` on the inputs' device.
type LseSlot = Arc<Mutex<Option<Tensor>>>;

fn lock(slot: &LseSlot) -> std::sync::MutexGuard<'_, Option<Tensor>> {
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

/// Forward op: (q, k, v) -> out; the lse is kept for the backward (and for `*_with_lse`).
struct AttnFwd {
    spec: AttnSpec,
    lse: LseSlot,
}

impl CustomOp3 for AttnFwd {
    fn name(&self) -> &'static str {
        "cubeattn-flash-attn"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (q, k, v) = (HostIn::new("q", s1, l1)?, HostIn::new("k", s2, l2)?, HostIn::new("v", s3, l3)?);
        let res = CpuBackend.forward(&self.spec, q.view(), k.view(), v.view()).map_err(to_candle)?;
        let d = &self.spec.dims;
        *lock(&self.lse) = Some(Tensor::from_vec(res.lse, (d.heads_q, d.total_q), &Device::Cpu)?);
        Ok((storage_of(res.out), out_shape(l1, d.head_dim_v)))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        let (out, lse) = cuda::forward(&self.spec, (s1, l1), (s2, l2), (s3, l3))?;
        *lock(&self.lse) = Some(lse);
        Ok((out, out_shape(l1, self.spec.dims.head_dim_v)))
    }

    #[cfg(not(feature = "candle-cuda"))]
    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        Err(unsupported_device("CUDA"))
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> CResult<(MetalStorage, Shape)> {
        Err(unsupported_device("Metal"))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = lock(&self.lse)
            .clone()
            .ok_or_else(|| candle_core::Error::msg("cubeattn: backward called before the forward ran"))?;
        let op = AttnBwd { spec: self.spec.clone(), out: out.clone(), dout: dout.clone(), lse };
        // One call to cubeattn's backward; dq, dk, dv come back packed in one 1-D tensor.
        let packed = q.apply_op3_no_bwd(k, v, &op)?;
        let (nq, nk, nv) = (self.spec.dims.q_len(), self.spec.dims.kv_len(), self.spec.dims.v_len());
        let dq = packed.narrow(0, 0, nq)?.reshape(q.shape())?;
        let dk = packed.narrow(0, nq, nk)?.reshape(k.shape())?;
        let dv = packed.narrow(0, nq + nk, nv)?.reshape(v.shape())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// out's shape: q's (`l`) with v's head_dim last.
fn out_shape(l: &Layout, head_dim_v: usize) -> Shape {
    let mut dims = l.shape().dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = head_dim_v;
    }
    Shape::from(dims)
}

/// Elements of the packed [dq | dk | dv] of `spec`.
pub(crate) fn grads_len(spec: &AttnSpec) -> usize {
    spec.dims.q_len() + spec.dims.kv_len() + spec.dims.v_len()
}

/// Backward op: (q, k, v) with out, dout and lse -> [dq | dk | dv] flattened, in the input dtype.
struct AttnBwd {
    spec: AttnSpec,
    out: Tensor,
    dout: Tensor,
    lse: Tensor,
}

fn concat3<T: Copy>(a: Vec<T>, b: &[T], c: &[T]) -> Vec<T> {
    let mut v = a;
    v.reserve_exact(b.len() + c.len());
    v.extend_from_slice(b);
    v.extend_from_slice(c);
    v
}

impl CustomOp3 for AttnBwd {
    fn name(&self) -> &'static str {
        "cubeattn-flash-attn-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (q, k, v) = (HostIn::new("q", s1, l1)?, HostIn::new("k", s2, l2)?, HostIn::new("v", s3, l3)?);
        let g = with_host("out", &self.out, |out| {
            with_host("dout", &self.dout, |dout| {
                with_host("lse", &self.lse, |lse| {
                    let HostView::F32(lse) = lse else {
                        return Err(to_candle(Error::InvalidDtype { arg: "lse", msg: format!("expected f32, got {}", lse.dtype().name()) }));
                    };
                    let inputs = BackwardInputs { out, lse, dout, deterministic: true };
                    CpuBackend.backward(&self.spec, q.view(), k.view(), v.view(), inputs).map_err(to_candle)
                })
            })
        })?;
        let packed = match (g.dq, g.dk, g.dv) {
            (HostData::F32(a), HostData::F32(b), HostData::F32(c)) => CpuStorage::F32(concat3(a, &b, &c)),
            (HostData::F16(a), HostData::F16(b), HostData::F16(c)) => CpuStorage::F16(concat3(a, &b, &c)),
            (HostData::BF16(a), HostData::BF16(b), HostData::BF16(c)) => CpuStorage::BF16(concat3(a, &b, &c)),
            _ => return Err(candle_core::Error::msg("cubeattn: backward returned mixed dtypes")),
        };
        Ok((packed, Shape::from(grads_len(&self.spec))))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        let packed = cuda::backward(&self.spec, (s1, l1), (s2, l2), (s3, l3), &self.out, &self.dout, &self.lse)?;
        Ok((packed, Shape::from(grads_len(&self.spec))))
    }

    #[cfg(not(feature = "candle-cuda"))]
    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        Err(unsupported_device("CUDA"))
    }

    fn metal_fwd(
        &self,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> CResult<(MetalStorage, Shape)> {
        Err(unsupported_device("Metal"))
    }
}

/// Runs the forward op (tracked by candle's autograd) and returns out and the f32
/// `[heads_q, total_q]` lse (a plain tensor on q's device).
fn run(spec: AttnSpec, q: &Tensor, k: &Tensor, v: &Tensor) -> CResult<(Tensor, Tensor)> {
    let slot: LseSlot = Arc::new(Mutex::new(None));
    let op: Arc<Box<dyn CustomOp3 + Send + Sync>> = Arc::new(Box::new(AttnFwd { spec, lse: slot.clone() }));
    let out = q.apply_op3_arc(k, v, op)?;
    let lse = lock(&slot).clone().ok_or_else(|| candle_core::Error::msg("cubeattn: the forward op did not run"))?;
    Ok((out, lse))
}

// ---------------------------------------------------------------------------------------------
// Public API.

fn batch_spec(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f32, causal: bool) -> CResult<(AttnSpec, [usize; 3])> {
    let dt = check_common(q, k, v)?;
    const WHAT: &str = "[batch, seqlen, heads, head_dim]";
    check_rank("q", q, 4, WHAT)?;
    check_rank("k", k, 4, WHAT)?;
    check_rank("v", v, 4, WHAT)?;
    let (b, sq, hq) = (q.dims()[0], q.dims()[1], q.dims()[2]);
    let sk = k.dims()[1];
    if k.dims()[0] != b {
        return Err(invalid("k", format!("batch {} differs from q's batch {b}", k.dims()[0])));
    }
    if v.dims()[..3] != k.dims()[..3] {
        return Err(invalid("v", format!("shape {:?} must have k's [batch, seqlen, heads] {:?}", v.dims(), &k.dims()[..3])));
    }
    let cu = |s: usize, arg: &'static str| -> CResult<Vec<i32>> {
        (0..=b)
            .map(|i| i32::try_from(i * s).map_err(|_| invalid(arg, format!("batch * seqlen = {} exceeds i32", b * s))))
            .collect()
    };
    let (cq, ck) = (cu(sq, "q")?, cu(sk, "k")?);
    let spec = AttnSpec::varlen(&meta3(q, dt), &meta3(k, dt), &meta3(v, dt), &cq, &ck, sq, sk, Some(softmax_scale as f64), causal)
        .map_err(to_candle)?;
    Ok((spec, [b, hq, sq]))
}

/// Flash attention over a batch of equal-length sequences (candle-flash-attn's `flash_attn`).
///
/// q `[batch, seqlen_q, heads_q, head_dim]`, k and v `[batch, seqlen_k, heads_kv, head_dim]` (v
/// may have its own head_dim); returns `[batch, seqlen_q, heads_q, v's head_dim]`. `softmax_scale` multiplies q.k (usually
/// `1 / sqrt(head_dim)`); `causal` masks bottom-right aligned.
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f32, causal: bool) -> CResult<Tensor> {
    let (spec, _) = batch_spec(q, k, v, softmax_scale, causal)?;
    Ok(run(spec, q, k, v)?.0)
}

/// [`flash_attn`] that also returns the log-sum-exp, f32 `[batch, heads_q, seqlen_q]`.
pub fn flash_attn_with_lse(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f32, causal: bool) -> CResult<(Tensor, Tensor)> {
    let (spec, [b, hq, sq]) = batch_spec(q, k, v, softmax_scale, causal)?;
    let (out, lse) = run(spec, q, k, v)?;
    // cubeattn's lse is [heads_q, batch * seqlen_q]; flash-attn's batch layout is [batch, heads_q, seqlen_q].
    Ok((out, lse.reshape((hq, b, sq))?.transpose(0, 1)?.contiguous()?))
}

fn cu_seqlens(arg: &'static str, t: &Tensor) -> CResult<Vec<i32>> {
    if t.rank() != 1 {
        return Err(invalid(arg, format!("expected rank 1 [batch + 1], got rank {} (shape {:?})", t.rank(), t.dims())));
    }
    let wide: Vec<i64> = match t.dtype() {
        candle_core::DType::U32 => t.to_vec1::<u32>()?.into_iter().map(i64::from).collect(),
        candle_core::DType::I32 => t.to_vec1::<i32>()?.into_iter().map(i64::from).collect(),
        candle_core::DType::I64 => t.to_vec1::<i64>()?,
        other => {
            return Err(to_candle(Error::InvalidDtype {
                arg,
                msg: format!("expected u32, i32 or i64 cumulative lengths, got {}", other.as_str()),
            }))
        }
    };
    wide.iter()
        .map(|&x| i32::try_from(x).map_err(|_| invalid(arg, format!("entry {x} does not fit in i32"))))
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn varlen_spec(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> CResult<AttnSpec> {
    let dt = check_common(q, k, v)?;
    const WHAT: &str = "[total_tokens, heads, head_dim]";
    check_rank("q", q, 3, WHAT)?;
    check_rank("k", k, 3, WHAT)?;
    check_rank("v", v, 3, WHAT)?;
    let (cq, ck) = (cu_seqlens("seqlens_q", seqlens_q)?, cu_seqlens("seqlens_k", seqlens_k)?);
    AttnSpec::varlen(&meta3(q, dt), &meta3(k, dt), &meta3(v, dt), &cq, &ck, max_seqlen_q, max_seqlen_k, Some(softmax_scale as f64), causal)
        .map_err(|e| to_candle(rename_varlen(e)))
}

/// Flash attention over a packed batch of variable-length sequences (candle-flash-attn's
/// `flash_attn_varlen`): sequence b has queries `seqlens_q[b]..seqlens_q[b+1]` of q
/// `[total_q, heads_q, head_dim]` and keys `seqlens_k[b]..seqlens_k[b+1]` of k, v
/// `[total_k, heads_kv, head_dim]`. `seqlens_*` are 1-D tensors (u32, i32 or i64) with
/// `batch + 1` entries starting at 0, read on the host (the call's plan is built there: on a CUDA
/// device that is one small copy each); `max_seqlen_*` must be at least the longest sequence.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> CResult<Tensor> {
    let spec = varlen_spec(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)?;
    Ok(run(spec, q, k, v)?.0)
}

/// [`flash_attn_varlen`] that also returns the log-sum-exp, f32 `[heads_q, total_q]`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_varlen_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> CResult<(Tensor, Tensor)> {
    let spec = varlen_spec(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)?;
    run(spec, q, k, v)
}

fn ranges_i32(arg: &'static str, r: &[[usize; 2]]) -> CResult<Vec<[i32; 2]>> {
    r.iter()
        .enumerate()
        .map(|(g, &[a, b])| match (i32::try_from(a), i32::try_from(b)) {
            (Ok(a), Ok(b)) => Ok([a, b]),
            _ => Err(invalid(arg, format!("group {g} range [{a}, {b}) does not fit in i32"))),
        })
        .collect()
}

fn grouped_spec(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_ranges: &[[usize; 2]],
    kv_ranges: &[[usize; 2]],
    softmax_scale: f32,
    causal: bool,
) -> CResult<AttnSpec> {
    let dt = check_common(q, k, v)?;
    const WHAT: &str = "[total_tokens, heads, head_dim]";
    check_rank("q", q, 3, WHAT)?;
    check_rank("k", k, 3, WHAT)?;
    check_rank("v", v, 3, WHAT)?;
    let (qr, kr) = (ranges_i32("q_ranges", q_ranges)?, ranges_i32("kv_ranges", kv_ranges)?);
    AttnSpec::grouped(&meta3(q, dt), &meta3(k, dt), &meta3(v, dt), &qr, &kr, Some(softmax_scale as f64), causal).map_err(to_candle)
}

/// Grouped attention in one call: group g's query rows `q_ranges[g] = [start, end)` of q
/// `[total_q, heads_q, head_dim]` attend the keys `kv_ranges[g]` of the shared k, v
/// `[total_k, heads_kv, head_dim]`. Query ranges must not overlap; key ranges may (the zigzag
/// context-parallel case). Causal is measured from each group's own end; rows outside every group
/// get zeros.
pub fn grouped_flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_ranges: &[[usize; 2]],
    kv_ranges: &[[usize; 2]],
    softmax_scale: f32,
    causal: bool,
) -> CResult<Tensor> {
    let spec = grouped_spec(q, k, v, q_ranges, kv_ranges, softmax_scale, causal)?;
    Ok(run(spec, q, k, v)?.0)
}

/// [`grouped_flash_attn`] that also returns the log-sum-exp, f32 `[heads_q, total_q]`.
pub fn grouped_flash_attn_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_ranges: &[[usize; 2]],
    kv_ranges: &[[usize; 2]],
    softmax_scale: f32,
    causal: bool,
) -> CResult<(Tensor, Tensor)> {
    let spec = grouped_spec(q, k, v, q_ranges, kv_ranges, softmax_scale, causal)?;
    run(spec, q, k, v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_offsets_follow_the_layout() {
        // [2, 3] transposed view of a [3, 2] buffer starting at offset 1.
        let l = Layout::new(Shape::from((2, 3)), vec![1, 2], 1);
        assert_eq!(strided_offsets(&l), vec![1, 3, 5, 2, 4, 6]);
        // broadcast (stride 0) axis
        let l = Layout::new(Shape::from((2, 2)), vec![0, 1], 0);
        assert_eq!(strided_offsets(&l), vec![0, 1, 0, 1]);
        let l = Layout::new(Shape::from((0, 2)), vec![2, 1], 0);
        assert!(strided_offsets(&l).is_empty());
    }
}
