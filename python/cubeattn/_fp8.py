"""FP8 inputs with descale factors (FlashAttention-3's FP8 forward interface).

q, k, v as ``torch.float8_e4m3fn`` with optional float32 descales of shape ``[batch, heads_kv]``
(``q_descale`` applies to the q heads of each kv head's group, as FlashAttention-3's): the attention
of ``q * q_descale``, ``k * k_descale``, ``v * v_descale``, forward only, output in bfloat16. Each
input is dequantised once (its float32 product with the descale, rounded to bfloat16: a relative
error of at most 2^-9 an element, below the bf16 attention's own) and the bfloat16 kernels run on
it, on every device alike; an FP8 kernel (FP8 Q K^T and P.V on Hopper, issue 43) is not built. A
paged k, v (``block_table`` of the varlen call) is gathered into packed rows first
(``_kvcache.gather_paged``), so each sequence's rows take its own descale.
"""

_FP8 = "float8_e4m3fn"


def _is_fp8(x):
    dt = getattr(x, "dtype", None)
    return dt is not None and "float8" in str(dt)


def wanted(q, k, v, q_descale, k_descale, v_descale):
    """Whether this call takes FP8 inputs: any of q, k, v a float8 torch tensor. Descales given
    without FP8 inputs raise (they would be ignored otherwise)."""
    fp8 = any(_is_fp8(x) for x in (q, k, v))
    if not fp8:
        for name, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
            if d is not None:
                raise ValueError(f"invalid argument `{name}`: descales apply to float8 q, k, v only "
                                 f"(q is {getattr(q, 'dtype', type(q).__name__)})")
    return fp8


def _seq_of_rows(torch, cu, n, device, name):
    """Sequence index of each of the n packed rows (cu_seqlens `cu`), made on `device` from the
    sequence lengths (one small copy of them, not of a row index)."""
    cu = torch.as_tensor(cu, device="cpu").to(torch.int64)
    lens = cu[1:] - cu[:-1]
    if cu.ndim != 1 or cu.numel() < 2 or bool((lens < 0).any()) or int(cu[-1]) != n or int(cu[0]) != 0:
        raise ValueError(f"invalid argument `{name}`: must be [0, ..., {n}] non-decreasing for FP8 descales")
    return torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens.to(device), output_size=n)


def dequantize(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q=None, cu_seqlens_k=None):
    """q, k, v in bfloat16 from FP8 inputs and their descales. Batched layout [batch, seqlen, heads,
    d] without cu_seqlens; packed [tokens, heads, d] with them (the descale's batch = sequences)."""
    import torch

    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float8_e4m3fn:
            raise TypeError(f"invalid dtype for `{name}`: "
                            f"{getattr(x, 'dtype', type(x).__name__)}; FP8 inputs need q, k and v all "
                            f"torch.{_FP8}")
        if x.requires_grad:
            raise ValueError(f"invalid argument `{name}`: FP8 inputs are forward only (it requires grad)")
        if x.device != q.device:
            raise ValueError(f"invalid argument `{name}`: on {x.device}, q on {q.device}")
    packed = cu_seqlens_q is not None
    nd = 3 if packed else 4
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != nd:
            raise ValueError(f"invalid argument `{name}`: {x.dim()} dimensions, expected {nd}")
    hq, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or hq % hk:
        raise ValueError(f"invalid argument `k`: {hk} kv heads do not divide q's {hq} heads")
    if packed:
        batch = len(cu_seqlens_q) - 1
        rows_q = _seq_of_rows(torch, cu_seqlens_q, q.shape[0], q.device, "cu_seqlens_q")
        rows_k = _seq_of_rows(torch, cu_seqlens_k, k.shape[0], k.device, "cu_seqlens_k")
    else:
        batch = q.shape[0]
        rows_q = rows_k = None

    def scaled(x, d, name, group, rows):
        if d is None:  # every e4m3 value is a bfloat16 value: exact, no float32 pass
            return x.to(torch.bfloat16)
        if not isinstance(d, torch.Tensor) or d.dtype != torch.float32:
            raise TypeError(f"invalid dtype for `{name}`: {getattr(d, 'dtype', type(d).__name__)}; "
                            "expected a torch.float32 tensor [batch, heads_kv]")
        if tuple(d.shape) != (batch, hk):
            raise ValueError(f"invalid argument `{name}`: shape {tuple(d.shape)}, expected (batch, heads_kv) = "
                             f"({batch}, {hk})")
        if d.device != x.device:
            raise ValueError(f"invalid argument `{name}`: on {d.device}, the inputs on {x.device}")
        xf = x.to(torch.float32)
        per_head = d.repeat_interleave(group, dim=1)  # [batch, heads of x]
        if rows is None:
            return (xf * per_head[:, None, :, None]).to(torch.bfloat16)
        return (xf * per_head[rows][:, :, None]).to(torch.bfloat16)

    return (scaled(q, q_descale, "q_descale", hq // hk, rows_q), scaled(k, k_descale, "k_descale", 1, rows_k),
            scaled(v, v_descale, "v_descale", 1, rows_k))
