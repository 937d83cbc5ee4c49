"""Array plumbing: numpy (float32/float16, bfloat16 via ml_dtypes) and torch tensors to the flat
byte buffers the native core takes, and back. No maths here."""
from __future__ import annotations

import numpy as np

try:  # optional: bfloat16 numpy arrays
    import ml_dtypes as _ml

    BF16 = np.dtype(_ml.bfloat16)
except Exception:  # pragma: no cover - ml_dtypes is optional
    _ml = None
    BF16 = None

_NP_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}
if BF16 is not None:
    _NP_NAMES[BF16] = "bfloat16"


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


class Converted:
    """One input as the core wants it, plus what is needed to give outputs back in kind. For a
    torch CUDA tensor, `device_tensor` is it made contiguous on its GPU, and the host bytes are
    only made (copied to the host) when `bytes` is first read."""

    __slots__ = ("_bytes", "shape", "dtype", "torch_like", "device_tensor")

    def __init__(self, bytes_, shape, dtype, torch_like, device_tensor=None):
        self._bytes, self.shape, self.dtype, self.torch_like = bytes_, shape, dtype, torch_like
        self.device_tensor = device_tensor

    @property
    def bytes(self):
        if self._bytes is None:
            import torch

            # .cpu() waits for the tensor's pending work on its stream
            self._bytes = self.device_tensor.cpu().reshape(-1).view(torch.uint8).numpy()
        return self._bytes


_TORCH_NAMES = None


def _torch_names():
    global _TORCH_NAMES
    if _TORCH_NAMES is None:
        import torch

        _TORCH_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
    return _TORCH_NAMES


def dtype_name(x, name: str) -> str:
    """'float32' | 'float16' | 'bfloat16' for a numpy array or torch tensor, else TypeError."""
    if _is_torch(x):
        dt = _torch_names().get(x.dtype)
    elif isinstance(x, np.ndarray):
        dt = _NP_NAMES.get(x.dtype)
    else:
        raise TypeError(f"`{name}` must be a numpy array or torch tensor, got {type(x).__name__}")
    if dt is None:
        hint = " (install ml_dtypes for bfloat16)" if BF16 is None and not _is_torch(x) else ""
        raise TypeError(f"invalid dtype for `{name}`: {x.dtype}; expected float32, float16 or bfloat16{hint}")
    return dt


def is_dense_cuda(t) -> bool:
    """Whether the kernels can read the CUDA tensor `t` in place: contiguous and 16-byte aligned
    (their copies move 16-byte words; a contiguous view at an odd element offset is not)."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def dense_cuda(t):
    """The CUDA tensor `t` as the kernels read it ([`is_dense_cuda`]): `t` itself when it is, else
    a copy (same values, a fresh allocation)."""
    import torch

    return t if is_dense_cuda(t) else t.clone(memory_format=torch.contiguous_format)


def to_core(x, name: str) -> Converted:
    """numpy array or torch tensor -> contiguous flat uint8 view (no copy when already contiguous)."""
    dt = dtype_name(x, name)
    if _is_torch(x):
        import torch

        t = x.detach()
        if t.is_cuda:
            return Converted(None, tuple(t.shape), dt, x, dense_cuda(t))
        t = t.contiguous()
        flat = t.reshape(-1).view(torch.uint8).numpy()
        return Converted(flat, tuple(t.shape), dt, x)
    a = np.ascontiguousarray(x)
    return Converted(a.reshape(-1).view(np.uint8), tuple(a.shape), dt, None)


def from_core(buf: np.ndarray, shape, dtype: str, like: Converted):
    """Flat float32 or uint16 (16-bit types) array from the core -> array of `shape` in the kind
    (numpy / torch, device) of `like`. No copy on the numpy path."""
    if like.torch_like is not None:
        import torch

        tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        t = torch.from_numpy(buf).view(tdt).reshape(shape)
        return t.to(like.torch_like.device)
    npdt = {"float32": np.float32, "float16": np.float16}.get(dtype, BF16)
    return buf.view(npdt).reshape(shape)


def _asarray(x, name: str) -> np.ndarray:
    if _is_torch(x):
        x = x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as e:  # ragged nested lists and the like
        raise ValueError(f"invalid argument `{name}`: not a rectangular integer array ({e})") from None


def int32_vector(x, name: str) -> np.ndarray:
    a = _asarray(x, name)
    if a.ndim != 1:
        raise ValueError(f"invalid argument `{name}`: expected a 1-D int32 array [batch+1], got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise TypeError(f"invalid dtype for `{name}`: {a.dtype}; expected int32")
    if a.size and (a.max() > np.iinfo(np.int32).max or a.min() < np.iinfo(np.int32).min):
        raise ValueError(f"invalid argument `{name}`: values do not fit in int32")
    return np.ascontiguousarray(a, dtype=np.int32)


def int32_ranges(x, name: str) -> np.ndarray:
    a = _asarray(x, name)
    if a.ndim != 2 or (a.size and a.shape[1] != 2):
        raise ValueError(f"invalid argument `{name}`: expected shape [groups, 2], got {a.shape}")
    if a.size == 0:
        a = a.reshape(0, 2)
    if a.dtype.kind not in "iu":
        raise TypeError(f"invalid dtype for `{name}`: {a.dtype}; expected int32")
    return np.ascontiguousarray(a, dtype=np.int32)
