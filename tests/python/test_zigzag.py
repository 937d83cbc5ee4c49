"""Zigzag context parallelism: layout helpers, seed 002's extract/scatter components (exact), and
the torch.distributed layer on CPU processes with gloo (W = 1, 2, 3; skipped without torch) and on
GPUs with NCCL under torchrun (marked `gpu`; needs >= 2 GPUs)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import cubeattn
from conftest import np_dtype

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------- straightforward references

def chunk_sizes(n, w):
    """The 2W chunk lengths of an n-token sequence: the first n % 2W hold one token more."""
    return [n // (2 * w) + (j < n % (2 * w)) for j in range(2 * w)]


def chunks_of(x, lens, w):
    """[[chunk 0, ..., chunk 2W-1] per sequence] of a packed batch, by plain slicing."""
    out, s = [], 0
    for n in lens:
        ends = np.cumsum([0] + chunk_sizes(n, w))
        out.append([x[s + ends[j]:s + ends[j + 1]] for j in range(2 * w)])
        s += n
    return out


def ref_shard(x, lens, r, w):
    parts = [x[:0]]
    for ch in chunks_of(x, lens, w):
        parts += [ch[r], ch[2 * w - 1 - r]]
    return np.concatenate(parts, 0)


def ref_gathered(x, lens, w, pad=0):
    """What all_gather_into_tensor of every rank's shard gives: rank 0's shard, rank 1's, ..., each
    padded at its end to the longest shard (rows of `pad`)."""
    shards = [ref_shard(x, lens, r, w) for r in range(w)]
    m = max(len(s) for s in shards)
    return np.concatenate([np.concatenate([s, np.full((m - len(s),) + x.shape[1:], pad, x.dtype)]) for s in shards])


def ref_prefix(x, lens, w, m):
    """Chunks 0..m of every sequence in original order, sequences concatenated."""
    return np.concatenate([x[:0]] + [np.concatenate(ch[:m + 1], 0) for ch in chunks_of(x, lens, w)], 0)


def ref_prefix_mask(lens, w, m):
    mask, s = np.zeros(sum(lens), bool), 0
    for n in lens:
        mask[s:s + sum(chunk_sizes(n, w)[:m + 1])] = True
        s += n
    return mask


def cu_of(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def data(lens, dtype, heads=3, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((sum(lens), heads, d)).astype(np.float32).astype(np_dtype(dtype))


def same(a, b):
    """Exact equality, bit for bit (difference 0), shapes and dtypes included."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.tobytes() == b.tobytes()


# ---------------------------------------------------------------- layout helpers

@pytest.mark.parametrize("w", [1, 2, 3, 4, 8])
def test_split_then_merge_is_the_identity(w):
    lens = [2 * w * n for n in (5, 1, 0, 9)]
    x = data(lens, "float32")
    cu = cu_of(lens)
    shards = [cubeattn.zigzag_split(x, cu, r, w) for r in range(w)]
    for r, s in enumerate(shards):
        same(s, ref_shard(x, lens, r, w))
    same(cubeattn.zigzag_merge(shards, cu, w), x)
    same(cubeattn.zigzag_merge(np.concatenate(shards, 0), cu, w), x)
    local = cubeattn.zigzag_cu_seqlens(cu, w)
    assert local.dtype == np.int32 and local.tolist() == (cu // w).tolist()
    assert [s.shape[0] for s in shards] == [local[-1]] * w
    for r in range(w):
        assert cubeattn.zigzag_cu_seqlens(cu, w, r).tolist() == local.tolist()


@pytest.mark.parametrize("w", [1, 2, 3, 4, 8])
def test_split_then_merge_any_lengths(w):
    """Lengths that are not multiples of 2W (1-token sequences, 7, 13, 1000, fewer tokens than
    chunks): the shards of plain slicing, every token on one rank, merge back from the list, the
    concatenation and the padded all-gather buffer; local cu_seqlens per rank."""
    lens = [1, 7, 13, 0, 1000, 2, 2 * w + 1]
    x = data(lens, "float32", seed=w)
    cu = cu_of(lens)
    shards = [cubeattn.zigzag_split(x, cu, r, w) for r in range(w)]
    for r, s in enumerate(shards):
        same(s, ref_shard(x, lens, r, w))
        local = cubeattn.zigzag_cu_seqlens(cu, w, r)
        want = [sum(chunk_sizes(n, w)[j] for j in (r, 2 * w - 1 - r)) for n in lens]
        assert local.tolist() == cu_of(want).tolist()
        assert local[-1] == len(s)
    assert sum(len(s) for s in shards) == sum(lens)
    # every rank within one token per sequence of the others
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= len(lens)
    same(cubeattn.zigzag_merge(shards, cu, w), x)
    same(cubeattn.zigzag_merge(np.concatenate(shards, 0), cu, w), x)
    same(cubeattn.zigzag_merge(ref_gathered(x, lens, w, pad=np.nan), cu, w), x)
    if w > 1:
        with pytest.raises(ValueError, match="`rank`.*sequence 0 has length 1"):
            cubeattn.zigzag_cu_seqlens(cu, w)
        with pytest.raises(ValueError, match="`shards`: shard 0"):
            cubeattn.zigzag_merge(shards[::-1], cu, w)


@pytest.mark.parametrize("w", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_extract_and_scatter_any_lengths(w, dtype):
    """The gathered buffer of padded shards (NaN in the padding: never read) to the prefixes, and
    the scatter back (padding rows zero), lengths that are not multiples of 2W."""
    lens = [13, 1, 7, 0, 130]
    x = data(lens, dtype, seed=40 + w)
    cu = cu_of(lens)
    g = ref_gathered(x, lens, w, pad=np.nan)
    for m in range(2 * w):
        same(cubeattn.extract_zigzag_kv_slice(g, cu, w, max_chunk_idx=m), ref_prefix(x, lens, w, m))
        full = np.where(ref_prefix_mask(lens, w, m)[:, None, None], x, np.zeros_like(x))
        same(cubeattn.scatter_grad_to_zigzag(ref_prefix(x, lens, w, m), cu, w, max_chunk_idx=m),
             ref_gathered(full, lens, w))
    with pytest.raises(ValueError, match="`kv`"):
        cubeattn.extract_zigzag_kv_slice(x, cu, w)


@pytest.mark.parametrize("w", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_extract_single_sequence_early_chunks(w, dtype):
    lens = [1024]
    x = data(lens, dtype, seed=w)
    g = ref_gathered(x, lens, w)
    for m in range(w):  # chunks 0 .. W-1
        same(cubeattn.extract_zigzag_kv_slice(g, cu_of(lens), w, max_chunk_idx=m), ref_prefix(x, lens, w, m))


@pytest.mark.parametrize("w", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_extract_late_chunks_and_full_sequence(w, dtype):
    lens = [1024]
    x = data(lens, dtype, seed=10 + w)
    g = ref_gathered(x, lens, w)
    for m in range(w, 2 * w):  # chunks W .. 2W-1 (the last one: the whole sequence)
        same(cubeattn.extract_zigzag_kv_slice(g, cu_of(lens), w, max_chunk_idx=m), ref_prefix(x, lens, w, m))
    same(cubeattn.extract_zigzag_kv_slice(g, cu_of(lens), w), x)


@pytest.mark.parametrize("w", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_extract_multiple_sequences(w, dtype):
    lens = [512, 1024, 768]
    x = data(lens, dtype, heads=2, d=64, seed=20 + w)
    g = ref_gathered(x, lens, w)
    for m in (0, w - 1, w, 2 * w - 1):
        same(cubeattn.extract_zigzag_kv_slice(g, cu_of(lens), w, max_chunk_idx=m), ref_prefix(x, lens, w, m))


@pytest.mark.parametrize("lens", [[1024], [512, 1024, 768]], ids=["single", "multiple"])
@pytest.mark.parametrize("w", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_scatter_grad_to_zigzag(lens, w, dtype):
    x = data(lens, dtype, seed=30 + w)
    for m in (0, w - 1, w, 2 * w - 1):
        grad = ref_prefix(x, lens, w, m)
        full = np.where(ref_prefix_mask(lens, w, m)[:, None, None], x, np.zeros_like(x))
        same(cubeattn.scatter_grad_to_zigzag(grad, cu_of(lens), w, max_chunk_idx=m), ref_gathered(full, lens, w))


def test_extract_and_scatter_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    lens, w = [512, 1024, 768], 4
    x = torch.randn(sum(lens), 2, 64).to(torch.bfloat16)
    xn = x.view(torch.int16).numpy()  # compare the bits
    g = torch.from_numpy(ref_gathered(xn, lens, w)).view(torch.bfloat16)
    ex = cubeattn.extract_zigzag_kv_slice(g, cu_of(lens), w, max_chunk_idx=5)
    assert isinstance(ex, torch.Tensor) and ex.dtype == torch.bfloat16
    same(ex.view(torch.int16).numpy(), ref_prefix(xn, lens, w, 5))
    back = cubeattn.scatter_grad_to_zigzag(ex, cu_of(lens), w, max_chunk_idx=5)
    full = np.where(ref_prefix_mask(lens, w, 5)[:, None, None], xn, 0).astype(np.int16)
    same(back.view(torch.int16).numpy(), ref_gathered(full, lens, w))
    # the split helper keeps torch tensors torch
    s = cubeattn.zigzag_split(x, torch.from_numpy(cu_of(lens)), 1, w)
    assert isinstance(s, torch.Tensor) and s.shape[0] == sum(lens) // w


# ---------------------------------------------------------------- errors

def test_local_cu_seqlens_of_uneven_lengths_need_the_rank():
    x = data([16, 18], "float32")
    with pytest.raises(ValueError, match=r"`rank`.*sequence 1 has length 18, not a multiple of 2 \* world_size = 4"):
        cubeattn.zigzag_cu_seqlens(cu_of([16, 18]), 2)
    assert cubeattn.zigzag_cu_seqlens(cu_of([16, 18]), 2, 0).tolist() == [0, 8, 17]  # chunks 5, 5, 4, 4
    assert cubeattn.zigzag_cu_seqlens(cu_of([16, 18]), 2, 1).tolist() == [0, 8, 17]
    with pytest.raises(ValueError, match="`rank`"):
        cubeattn.zigzag_cu_seqlens(cu_of([16, 18]), 2, 2)
    assert cubeattn.zigzag_split(x, cu_of([16, 18]), 0, 2).shape[0] == 17


def test_bad_helper_arguments_raise_naming_the_argument():
    x = data([16], "float32")
    cu = cu_of([16])
    with pytest.raises(ValueError, match="`rank`"):
        cubeattn.zigzag_split(x, cu, 2, 2)
    with pytest.raises(ValueError, match="`world_size`"):
        cubeattn.zigzag_split(x, cu, 0, 0)
    with pytest.raises(TypeError, match="`world_size`"):
        cubeattn.zigzag_split(x, cu, 0, True)
    with pytest.raises(TypeError, match="`rank`"):
        cubeattn.zigzag_split(x, cu, 0.5, 2)
    with pytest.raises(ValueError, match="`x`"):
        cubeattn.zigzag_split(x[:8], cu, 0, 2)
    with pytest.raises(ValueError, match="`cu_seqlens`"):
        cubeattn.zigzag_split(x, np.array([4, 16], np.int32), 0, 2)
    with pytest.raises(ValueError, match="`cu_seqlens`"):
        cubeattn.zigzag_cu_seqlens(np.array([0, 8, 4], np.int32), 1)
    with pytest.raises(ValueError, match="`max_chunk_idx`"):
        cubeattn.extract_zigzag_kv_slice(x, cu, 2, max_chunk_idx=4)
    with pytest.raises(ValueError, match="`kv`"):
        cubeattn.extract_zigzag_kv_slice(x[:12], cu, 2)
    with pytest.raises(ValueError, match="`grad`"):
        cubeattn.scatter_grad_to_zigzag(x[:5], cu, 2, max_chunk_idx=1)
    with pytest.raises(ValueError, match="`shards`"):
        cubeattn.zigzag_merge([x[:8]], cu, 2)
    with pytest.raises(TypeError, match="`kv`"):
        cubeattn.extract_zigzag_kv_slice(x.astype(np.float64), cu, 2)


def test_layer_rejects_bad_input_before_any_collective():
    torch = pytest.importorskip("torch")
    f = cubeattn.zigzag_llama3_flash_attn_varlen_func
    q, k = torch.randn(8, 4, 16), torch.randn(8, 2, 16)
    cu = np.array([0, 8], np.int32)
    with pytest.raises(TypeError, match="`q`"):
        f(q.numpy(), k, k, cu, cu, 8, 8, 1)
    with pytest.raises(ValueError, match="`heads_k_stride`"):
        f(q, k, k, cu, cu, 8, 8, 3)
    with pytest.raises(ValueError, match="`heads_k_stride`"):
        f(q, k, k, cu, cu, 8, 8, 0)
    with pytest.raises(ValueError, match="`window_size`"):
        f(q, k, k, cu, cu, 8, 8, 1, window_size=(-2, 0))
    with pytest.raises(TypeError, match="`window_size`"):
        f(q, k, k, cu, cu, 8, 8, 1, window_size=4)
    with pytest.raises(TypeError, match="`full_cu_seqlens`"):
        f(q, k, k, cu, cu, 8, 8, 1, full_cu_seqlens=np.array([0.0, 16.0]))
    with pytest.raises(ValueError, match="`cu_seqlens_q`"):
        f(q, k, k, np.array([0, 6], np.int32), np.array([0, 6], np.int32), 8, 8, 1)
    with pytest.raises(ValueError, match="`cu_seqlens_k`"):
        f(q, k, k, cu, np.array([0, 4, 8], np.int32), 8, 8, 1)
    with pytest.raises(ValueError, match="`max_seqlen_q`"):
        f(q, k, k, cu, cu, 4, 8, 1)
    with pytest.raises(ValueError, match="`local_k_slice`"):
        f(q, k, k, cu, cu, 8, 8, 1, local_k_slice=slice(0, 4))
    with pytest.raises(TypeError, match="dtype for `k`"):
        f(q, k.double(), k, cu, cu, 8, 8, 1)
    with pytest.raises(ValueError, match="`k`"):
        f(q, torch.randn(8, 3, 16), torch.randn(8, 3, 16), cu, cu, 8, 8, 1)
    with pytest.raises(TypeError, match="`keep_gathered_kv`"):
        f(q, k, k, cu, cu, 8, 8, 1, keep_gathered_kv="yes")
    import torch.distributed as dist

    if not dist.is_initialized():
        with pytest.raises(ValueError, match="`group`.*not initialized"):
            f(q, k, k, cu, cu, 8, 8, 1)


# ---------------------------------------------------------------- the in-place read, every rank emulated

def check_in_place_read(w, lens, dtype, causal, device, stride_heads=(4, 2), d=64, seed=0, fwd_exact=True):
    """Every rank r of a W-rank zigzag layer, emulated in one process: the grouped call over the
    gathered K,V read in place (the layer's kv_block_table) against the same call over K,V in
    sequence order (the ordered copy): out, lse, dq bit for bit (deterministic backward), dk and dv
    bit for bit in the gathered layout (rank-major, what the reduce-scatter takes).
    `fwd_exact=False`: the two forwards may sum their keys in tiles of different widths (out to a
    relative L2 of 2e-3, lse to 1e-4); the backward, fed the same out and lse, stays bit for bit."""
    import torch

    from cubeattn import zigzag as zz

    hq, hk = stride_heads
    cu = cu_of(lens)
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    q, k, v, g = (torch.randn(sum(lens), h, d, generator=gen).to(dt).to(device) for h in (hq, hk, hk, hq))
    kg = torch.cat([cubeattn.zigzag_split(k, cu, j, w) for j in range(w)])
    vg = torch.cat([cubeattn.zigzag_split(v, cu, j, w) for j in range(w)])
    checked = 0
    for r in range(w):
        plan = zz._Plan(cu, w, r, causal)
        assert plan.kv_block_table is not None and len(plan.calls) == 1
        lq, lg = cubeattn.zigzag_split(q, cu, r, w), cubeattn.zigzag_split(g, cu, r, w)
        args = plan.calls[0][:2]
        o1, l1 = cubeattn.grouped_flash_attn_func(lq, k, v, *args, causal=causal, return_lse=True)
        o2, l2 = cubeattn.grouped_flash_attn_func(lq, kg, vg, *args, causal=causal, return_lse=True,
                                                  kv_block_table=plan.kv_block_table)
        if fwd_exact:
            same(o1.cpu().float().numpy(), o2.cpu().float().numpy())
            same(l1.cpu().numpy(), l2.cpu().numpy())
        else:
            a, b = o1.cpu().double().numpy(), o2.cpu().double().numpy()
            assert np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30) < 2e-3
            assert np.abs(l1.cpu().double().numpy() - l2.cpu().double().numpy()).max() < 1e-4
        for det in (True, False):
            g1 = cubeattn.grouped_flash_attn_backward(lg, lq, k, v, o1, l1, *args, causal=causal, deterministic=det)
            g2 = cubeattn.grouped_flash_attn_backward(lg, lq, kg, vg, o1, l1, *args, causal=causal,
                                                      deterministic=det, kv_block_table=plan.kv_block_table)
            for a, b in ((g1[1], g2[1]), (g1[2], g2[2])):
                a = torch.cat([cubeattn.zigzag_split(a, cu, j, w) for j in range(w)])
                same(a.cpu().float().numpy(), b.cpu().float().numpy())
            if det:
                same(g1[0].cpu().float().numpy(), g2[0].cpu().float().numpy())
            else:  # atomics in any order on CUDA
                a, b = g1[0].double(), g2[0].double()
                assert ((a - b).norm() / a.norm().clamp_min(1e-30)).item() < 1e-2
        checked += 1
    assert checked == w


@pytest.mark.torch
@pytest.mark.parametrize("w", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_in_place_read_of_every_rank_equals_the_ordered_call_cpu(w, causal):
    pytest.importorskip("torch")
    m = 2 * w * 64
    check_in_place_read(w, [2 * m, 0, m], "float32", causal, "cpu")


def test_plan_falls_back_to_the_ordered_copy_off_the_block():
    """Chunks that are not a multiple of 64 keys, a window, or CUBEATTN_ZIGZAG_IN_PLACE=0 keep the
    copy."""
    from cubeattn import zigzag as zz

    assert zz._Plan(cu_of([2 * 2 * 96]), 2, 0, True).kv_block_table is None
    assert zz._Plan(cu_of([2 * 2 * 128 + 1]), 2, 0, True).kv_block_table is None
    cu = cu_of([2 * 2 * 128])
    assert zz._Plan(cu, 2, 1, True, in_place=False).kv_block_table is None
    assert zz._Plan(cu, 2, 1, True, (64, 0)).kv_block_table is None
    table = zz._Plan(cu, 2, 1, True).kv_block_table
    # 4 chunks of 128 keys (2 blocks each): rank 0 holds chunks 0, 3, rank 1 chunks 1, 2
    assert table.tolist() == [0, 1, 4, 5, 6, 7, 2, 3]


def emulate_ranks(w, lens, causal, window, hq=4, hk=2, d=16, seed=0):
    """Every rank of a W-rank layer in one process, the collectives by hand: the gathered [W, K then
    V, block] buffer built from the zigzag shards with NaN in its padding rows (never read), each
    rank's `_attend` over the keys its plan selects, its `_attend_backward`, the dK,dV scattered to
    the gathered layout and summed over the ranks (the reduce-scatter). Returns out, dq, dk, dv in
    original order and the reference (float64, every sequence whole) of the same."""
    import torch

    from cubeattn import zigzag as zz

    cu = cu_of(lens)
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g = (torch.randn(sum(lens), h, d, generator=gen, dtype=torch.float64) for h in (hq, hk, hk, hq))
    kv = np.stack([ref_gathered(x.numpy(), lens, w, pad=np.nan).reshape(w, -1, hk, d) for x in (k, v)], 1)
    gathered = torch.from_numpy(kv.reshape(-1, hk, d)).float()
    dkv = torch.zeros(gathered.shape, dtype=torch.float64)
    outs, dqs = [], []
    for r in range(w):
        plan = zz._Plan(cu, w, r, causal, window)
        assert plan.kv_block_table is None or window == (-1, -1)
        if plan.kv_block_table is not None:
            plan = zz._Plan(cu, w, r, causal, window, in_place=False)
        lq, lg = (torch.from_numpy(ref_shard(x.numpy(), lens, r, w)).float() for x in (q, g))
        kr, vr = (torch.from_numpy(x) for x in (plan.k_rows, plan.v_rows))
        kk, vv = gathered[kr], gathered[vr]
        assert torch.isfinite(kk).all() and torch.isfinite(vv).all(), "a padding row was read"
        o, lse = zz._attend(lq, kk, vv, plan, None, causal)
        dq, dk, dv = zz._attend_backward(lg, lq, kk, vv, o, lse, plan, None, causal, True)
        dkv.index_add_(0, kr, dk.double())
        dkv.index_add_(0, vr, dv.double())
        outs.append(o.double().numpy())
        dqs.append(dq.double().numpy())
    # back to original order: the concatenated shards, and the gathered K (V) rows of the dK (dV) sums
    dkv = dkv.view(w, 2, -1, hk, d)
    got = [cubeattn.zigzag_merge(outs, cu, w), cubeattn.zigzag_merge(dqs, cu, w)]
    got += [cubeattn.zigzag_merge(dkv[:, i].reshape(-1, hk, d).numpy(), cu, w) for i in (0, 1)]
    import zigzag_worker

    fq, fk, fv = (x.clone().requires_grad_() for x in (q, k, v))
    ref = zigzag_worker._reference(fq, fk, fv, cu, causal, window, torch.float64)
    ref.backward(g)
    return got, [ref.detach().numpy(), fq.grad.numpy(), fk.grad.numpy(), fv.grad.numpy()]


def rel(a, b):
    """||a - b|| / ||b||, the denominator at least 1e-2 per element's root mean square (a gradient
    that is exactly 0, as dq where a window of 0 leaves one key per row, is not divided by ~0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-2 * np.sqrt(b.size), 1e-300)


@pytest.mark.torch
@pytest.mark.parametrize("w", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (0, -1)), (True, (9, 0)),
                                           (True, (40, -1)), (False, (6, 3)), (False, (0, 0)), (False, (-1, 2)),
                                           (False, (13, -1)), (False, (2, 50))])
def test_every_rank_emulated_any_lengths_and_windows(w, causal, window):
    """The plan of every rank (ranges, windows, calls, the key rows it selects) against attention
    over the whole sequences: lengths that are not multiples of 2W (1, 7, 13, 0, fewer tokens than
    chunks, and 1000 for the long case), sliding windows of both kinds."""
    pytest.importorskip("torch")
    lens = [1, 7, 13, 0, 2 * w - 1, 97, 2]
    if w == 2:
        lens.append(1000)
    got, want = emulate_ranks(w, lens, causal, window)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):  # float32 vs float64: the worker's bounds
        assert rel(a, b) < (1e-5 if name == "out" else 1e-4), (name, rel(a, b))


# ---------------------------------------------------------------- the distributed layer, CPU + gloo

@pytest.mark.torch
@pytest.mark.parametrize("w,dtype", [(1, "float32"), (2, "float32"), (3, "float32"), (4, "float32"), (2, "bfloat16"),
                                     (4, "bfloat16"), (8, "float32")])
def test_zigzag_layer_gloo_matches_whole_sequence_attention(w, dtype, tmp_path):
    pytest.importorskip("torch")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    import zigzag_worker

    results = zigzag_worker.spawn_main(w, dtype, str(tmp_path))
    assert [r["rank"] for r in results] == list(range(w))
    for r in results:
        assert "error" not in r, r.get("error")
        assert len(r["cases"]) == len(zigzag_worker.cpu_cases(w))
        for c in r["cases"]:
            assert set(k for k in c["res"] if k.endswith("_vs_ref")) == {"out_vs_ref", "dq_vs_ref", "dk_vs_ref",
                                                                       "dv_vs_ref"}
            bad = zigzag_worker.failures(c["res"], dtype)
            assert not bad, f"rank {r['rank']} case {c['case']}: {bad}"
        assert r["error_checks"] == [], r["error_checks"]


def test_failures_catches_errors_over_the_bound():
    """The checker itself: a result over its bound, or NaN, is reported."""
    import zigzag_worker

    assert zigzag_worker.failures({"out_vs_ref": 1e-7, "dk_vs_one": 1e-6}, "float32") == []
    assert len(zigzag_worker.failures({"out_vs_ref": 1e-2}, "float32")) == 1
    assert len(zigzag_worker.failures({"dq_vs_one": float("nan")}, "bfloat16")) == 1
    assert len(zigzag_worker.failures({"dv_shape": float("inf")}, "float16")) == 1


# ---------------------------------------------------------------- GPUs + NCCL under torchrun

def _gpus():
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_zigzag_layer_nccl_torchrun(dtype, tmp_path):
    n = _gpus()
    if n < 2:
        pytest.skip(f"needs >= 2 CUDA GPUs visible to torch, found {n}")
    out = tmp_path / "zigzag.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={min(n, 4)}",
           os.path.join(HERE, "zigzag_worker.py"), "--dtype", dtype, "--json", str(out)]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert out.exists() and "0 failed checks" in r.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_zigzag_layer_gloo_cuda_ranks_share_one_gpu(dtype, tmp_path):
    """The whole layer on CUDA tensors (kernels, comm stream, the in-place read) with W = 1..4
    (W = 3 a subgroup) on a single GPU: four torchrun processes, gloo collectives."""
    if _gpus() < 1:
        pytest.skip("needs a CUDA GPU visible to torch")
    out = tmp_path / "zigzag.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           os.path.join(HERE, "zigzag_worker.py"), "--backend", "gloo", "--device", "cuda", "--dtype", dtype,
           "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    import zigzag_worker

    runs = sum(n * len(zigzag_worker.gpu_cases(n)) for n in range(1, 5))  # W = 1..4, every rank of each
    assert out.exists() and f"{runs} (rank, W, case) runs, 0 failed checks" in r.stdout


# ---------------------------------------------------------------- the benchmark's rows (CPU, gloo)

@pytest.mark.torch
def test_bench_zigzag_cpu_rows(tmp_path):
    """`python -m cubeattn.bench zigzag` on two CPU processes (gloo, tiny shapes): a row per impl
    (cubeattn, the all-gather + LSE-split baseline that runs on cuDNN on GPUs, the all-gather +
    SDPA one, cubeattn with a sliding window) with the keys cp.json promises, and the baselines' out
    and gradients equal to cubeattn's."""
    pytest.importorskip("torch")
    out = tmp_path / "cp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "cubeattn.bench",
           "zigzag", "--device", "cpu", "--seqlens", "128", "--iterations", "1", "--window", "20", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [x["impl"] for x in rows] == ["cubeattn", "allgather_lse_split_cpu", "allgather_sdpa_flash", "cubeattn_window"]
    assert rows[-1]["window"] == [20, 0]
    for x in rows:
        assert "error" not in x, x
        assert x["what"] == "cp_zigzag" and x["W"] == 2 and x["T"] == 256
        for key in ("fwd_ms", "fwdbwd_ms", "tflops_per_gpu", "fwd_tflops_per_gpu", "exposed_comm_fwd_ms",
                    "exposed_comm_fwdbwd_ms"):
            assert np.isfinite(x[key]), (key, x)
        assert x["fwd_ms"] > 0 and x["tflops_per_gpu"] > 0
    for x in rows[1:3]:
        assert x["rel_err_vs_cubeattn"] < 1e-4, x
