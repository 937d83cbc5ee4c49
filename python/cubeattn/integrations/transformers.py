"""cubeattn as a Hugging Face transformers attention implementation named "cubeattn".

    import cubeattn.integrations.transformers  # registers "cubeattn"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cubeattn")
    # or model.set_attn_implementation("cubeattn")

Registers `attention_forward` with transformers' `AttentionInterface` and, for masks, the
flash-style padding mask (`[batch, kv_len]` bool, or None where nothing is padded) with
`AttentionMaskInterface`. Like transformers' flash-attention path, one call handles:
- no padding: the batched call (causal or not, GQA, sliding window) on [batch, seqlen, heads, d];
- packed sequences, given as `cu_seq_lens_q / cu_seq_lens_k / max_length_q / max_length_k`
  kwargs (DataCollatorWithFlattening(return_flash_attn_kwargs=True)) or found in `position_ids`
  (a sequence starts at each row's first token and wherever the position id falls back to its
  minimum; as in transformers' flash path, with or without a cache, whereas its sdpa / eager
  masks read position_ids only when no cache is used, e.g. use_cache=False): the varlen call over
  the flattened tokens;
- a padding mask: the valid tokens are gathered, the varlen call runs on them, and padded query
  rows get zero output (left padding for queries shorter than keys, as transformers assumes).
Sliding windows follow transformers' masks: key j is visible to query i when i - j < window
(causal) or |i - j| <= window (bidirectional). Attention sinks, softcap and dropout > 0 raise
NotImplementedError naming the option; a 4-D mask raises ValueError.

Under torch.compile the batched call and given cu_seq_lens stay in the graph; padding masks
(data-dependent gathers) break it, as for flash-attention; position_ids are then always read as
a (possibly) packed batch: the varlen call, whose real implementation reads cu_seqlens on the
host (a device sync per call on CUDA).
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

import cubeattn

NAME = "cubeattn"


def _options(module, dropout, scaling, sliding_window, softcap, is_causal, kwargs):
    """The cubeattn keyword options of one transformers call."""
    for sink in ("s_aux", "sinks"):
        if kwargs.get(sink) is not None:
            raise NotImplementedError(f"`{sink}` (attention sinks) is not implemented by cubeattn")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = (-1, -1)
    if sliding_window is not None:
        w = int(sliding_window)
        window = (w - 1, w - 1) if causal else (w, w)
    return dict(dropout_p=dropout, softmax_scale=scaling, causal=bool(causal), window_size=window,
                softcap=0.0 if softcap is None else softcap)


def _flat(x):
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _packed_cu_seqlens(position_ids, batch, seqlen):
    """cu_seqlens [batch * seqlen + 1] of the sequences in `position_ids` [batch | 1, seqlen]
    flattened: a sequence starts at each row's first token and wherever the position id equals
    the row's minimum. Fixed size (traceable): the entries past the last start repeat the token
    count (empty sequences). Also returns the number of sequences (a 0-d tensor)."""
    pos = position_ids.expand(batch, seqlen)
    starts = (pos == pos.min(dim=-1, keepdim=True).values)
    starts[:, 0] = True
    n = batch * seqlen
    idx = torch.arange(n, device=pos.device, dtype=torch.int32)
    first = torch.where(starts.reshape(-1), idx, n).sort().values
    cu = torch.cat([first, torch.full((1,), n, dtype=torch.int32, device=pos.device)])
    return cu, starts.sum()


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, opts):
    return cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **opts)


def _unpadded(q, k, v, mask, opts):
    """Attention of the valid tokens of a padded batch (mask [batch, kv_len] bool); padded query
    rows get zeros."""
    b, sq, h, d = q.shape
    if k.shape[1] > mask.shape[1]:  # a static cache longer than the mask: its tail is unused
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    mask = mask[:, -k.shape[1]:].bool()
    lens_k = mask.sum(-1, dtype=torch.int32)
    cu_k = torch.nn.functional.pad(lens_k.cumsum(0, dtype=torch.int32), (1, 0))
    rows_k = mask.reshape(-1).nonzero().reshape(-1)
    kf, vf = _flat(k)[rows_k], _flat(v)[rows_k]
    if sq == 1:  # one new token per sequence (decoding)
        rows_q = torch.arange(b, device=q.device)
        cu_q, max_q = torch.arange(b + 1, dtype=torch.int32, device=q.device), 1
    else:  # queries are the last sq tokens of each (left-padded) row
        mask_q = mask[:, -sq:]
        rows_q = mask_q.reshape(-1).nonzero().reshape(-1)
        lens_q = mask_q.sum(-1, dtype=torch.int32)
        cu_q = torch.nn.functional.pad(lens_q.cumsum(0, dtype=torch.int32), (1, 0))
        max_q = int(lens_q.max())
    out = _varlen(_flat(q)[rows_q], kf, vf, cu_q, cu_k, max_q, int(lens_k.max()), opts)
    full = out.new_zeros(b * sq, h, d).index_copy(0, rows_q, out)
    return full.reshape(b, sq, h, d)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, **kwargs):
    """transformers' attention-interface signature: query [batch, heads, seqlen_q, d], key/value
    [batch, heads_kv, seqlen_k, d] -> (out [batch, seqlen_q, heads, d], None)."""
    opts = _options(module, dropout, scaling, sliding_window, softcap, is_causal, kwargs)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    b, sq = q.shape[0], q.shape[1]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is not None and cu_k is not None and max_q is not None and max_k is not None:
        out = _varlen(_flat(q), _flat(k), _flat(v), cu_q, cu_k, max_q, max_k, opts)
        return out.reshape(b, sq, *out.shape[1:]), None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"cubeattn attention takes transformers' flash-style padding mask [batch, kv_len]; got a "
                             f"{attention_mask.dim()}-D mask of shape {tuple(attention_mask.shape)} (custom 4-D masks "
                             f"are not supported)")
        return _unpadded(q, k, v, attention_mask, opts), None
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and position_ids.dim() == 2 and position_ids.shape[-1] == sq > 1 and sq == k.shape[1]:
        cu, count = _packed_cu_seqlens(position_ids, b, sq)
        if torch.compiler.is_compiling():
            out = _varlen(_flat(q), _flat(k), _flat(v), cu, cu, sq, sq, opts)
            return out.reshape(q.shape), None
        count = int(count)
        if count != b:  # packed: more sequences than rows
            cu = cu[:count + 1]
            longest = int(cu.diff().max())
            out = _varlen(_flat(q), _flat(k), _flat(v), cu, cu, longest, longest, opts)
            return out.reshape(q.shape), None
    return cubeattn.flash_attn_func(q, k, v, **opts), None


def register(name: str = NAME) -> str:
    """Registers the attention implementation (and its mask) under `name`; returns it. Importing
    this module registers "cubeattn"."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


register()
