"""FP8 inputs with descales (FlashAttention-3's FP8 forward interface, python/cubeattn/_fp8.py):
q, k, v torch.float8_e4m3fn with float32 descales [batch, heads_kv], batched and varlen, against
the f64 attention of the dequantised inputs, on the CPU backend; the bad combinations raise naming
the argument. The same cases run on CUDA tensors (marked gpu)."""
import numpy as np
import pytest

import cubeattn
from conftest import ref_attention, rel_err

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

E4M3 = torch.float8_e4m3fn
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def fp8(shape, gen, scale=3.0):
    return (torch.randn(shape, generator=gen) * scale).to(E4M3)


def descale(b, hk, gen):
    return (torch.rand((b, hk), generator=gen) * 0.9 + 0.1).to(torch.float32)


def dequant(x, d, group, rows=None):
    """f64 x * descale, the descale of row r's sequence (packed) or of batch row b (batched)."""
    xf = x.to(torch.float64)
    if d is None:
        return xf
    per_head = d.to(torch.float64).repeat_interleave(group, dim=1)
    return xf * (per_head[:, None, :, None] if rows is None else per_head[rows][:, :, None])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_descale", [True, False])
def test_batched_matches_f64_of_dequantised(causal, with_descale, device):
    gen = torch.Generator().manual_seed(11 + causal + 2 * with_descale)
    b, sq, sk, hq, hk, d = 2, 37, 53, 4, 2, 64
    q, k, v = fp8((b, sq, hq, d), gen), fp8((b, sk, hk, d), gen), fp8((b, sk, hk, d), gen)
    ds = [descale(b, hk, gen) for _ in range(3)] if with_descale else [None] * 3
    on = [None if x is None else x.to(device) for x in (q, k, v, *ds)]
    out = cubeattn.flash_attn_func(*on[:3], causal=causal, q_descale=on[3], k_descale=on[4], v_descale=on[5])
    assert out.dtype == torch.bfloat16 and out.shape == (b, sq, hq, d) and out.device.type == device
    out = out.cpu()
    rq, rk, rv = dequant(q, ds[0], hq // hk), dequant(k, ds[1], 1), dequant(v, ds[2], 1)
    for r in range(b):
        want, _ = ref_attention(rq[r].numpy(), rk[r].numpy(), rv[r].numpy(), [(0, sq, 0, sk)], causal)
        got = out[r].to(torch.float64).numpy()
        assert np.isfinite(got).all()
        assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_descales_per_sequence(device):
    gen = torch.Generator().manual_seed(5)
    lens_q, lens_k = [1, 33, 70], [9, 33, 81]
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    hq, hk, d = 6, 2, 32
    q, k, v = fp8((sum(lens_q), hq, d), gen), fp8((sum(lens_k), hk, d), gen), fp8((sum(lens_k), hk, d), gen)
    ds = [descale(3, hk, gen) for _ in range(3)]
    on = [x.to(device) for x in (q, k, v, cu_q, cu_k, *ds)]
    out, lse = cubeattn.flash_attn_varlen_func(*on[:5], max(lens_q), max(lens_k), causal=True, q_descale=on[5],
                                               k_descale=on[6], v_descale=on[7], return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.device.type == device
    out, lse = out.cpu(), lse.cpu()
    rows_q = torch.repeat_interleave(torch.arange(3), torch.tensor(lens_q))
    rows_k = torch.repeat_interleave(torch.arange(3), torch.tensor(lens_k))
    rq, rk, rv = dequant(q, ds[0], hq // hk, rows_q), dequant(k, ds[1], 1, rows_k), dequant(v, ds[2], 1, rows_k)
    segs = [(int(cu_q[i]), lens_q[i], int(cu_k[i]), lens_k[i]) for i in range(3)]
    want, want_lse = ref_attention(rq.numpy(), rk.numpy(), rv.numpy(), segs, True)
    assert rel_err(out.to(torch.float64).numpy(), want) < 1e-2
    # the dequantised q, k are rounded to bfloat16 (2^-9 an element): the scores move by that much
    assert rel_err(lse.numpy(), want_lse) < 5e-3


@pytest.mark.parametrize("device", DEVICES)
def test_paged_varlen_is_the_call_on_the_gathered_rows(device):
    """A paged FP8 k, v read through block_table (blocks out of order, one shared by two sequences
    with different descales) gives what the unpaged call on the same rows gives, bit for bit, and
    the f64 attention of the dequantised rows."""
    gen = torch.Generator().manual_seed(9)
    lens_q, lens_k = [5, 40, 17], [30, 70, 17]
    page, hq, hk, d, num_blocks = 16, 4, 2, 64, 12
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    q = fp8((sum(lens_q), hq, d), gen)
    kp, vp = fp8((num_blocks, page, hk, d), gen), fp8((num_blocks, page, hk, d), gen)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros((3, 5), dtype=torch.int32)
    table[0, :2] = perm[0:2]
    table[1, :5] = perm[2:7]
    table[2, :2] = torch.stack([perm[0], perm[7]])  # its first block is sequence 0's
    ds = [descale(3, hk, gen) for _ in range(3)]
    rows = torch.tensor([int(table[b, t // page]) * page + t % page for b in range(3) for t in range(lens_k[b])])
    kg, vg = kp.reshape(-1, hk, d)[rows], vp.reshape(-1, hk, d)[rows]
    on = lambda *xs: [x.to(device) for x in xs]  # noqa: E731
    scales = dict(zip(("q_descale", "k_descale", "v_descale"), on(*ds)))
    out = cubeattn.flash_attn_varlen_func(*on(q, kp, vp, cu_q, cu_k), max(lens_q), max(lens_k), causal=True,
                                          block_table=table.to(device), **scales)
    want = cubeattn.flash_attn_varlen_func(*on(q, kg, vg, cu_q, cu_k), max(lens_q), max(lens_k), causal=True, **scales)
    assert out.device.type == device and torch.equal(out, want)
    rows_q = torch.repeat_interleave(torch.arange(3), torch.tensor(lens_q))
    rows_k = torch.repeat_interleave(torch.arange(3), torch.tensor(lens_k))
    rq, rk, rv = dequant(q, ds[0], hq // hk, rows_q), dequant(kg, ds[1], 1, rows_k), dequant(vg, ds[2], 1, rows_k)
    segs = [(int(cu_q[i]), lens_q[i], int(cu_k[i]), lens_k[i]) for i in range(3)]
    ref, _ = ref_attention(rq.numpy(), rk.numpy(), rv.numpy(), segs, True)
    assert rel_err(out.cpu().to(torch.float64).numpy(), ref) < 1e-2


def test_bad_combinations_raise_naming_the_argument():
    gen = torch.Generator().manual_seed(3)
    b, s, hq, hk, d = 1, 16, 2, 1, 32
    q, k, v = fp8((b, s, hq, d), gen), fp8((b, s, hk, d), gen), fp8((b, s, hk, d), gen)
    good = descale(b, hk, gen)
    with pytest.raises(TypeError, match="`k`"):
        cubeattn.flash_attn_func(q, k.to(torch.bfloat16), v, device="cpu")
    with pytest.raises(TypeError, match="`v`"):
        cubeattn.flash_attn_func(q, k, v.to(torch.float8_e5m2), device="cpu")
    with pytest.raises(ValueError, match="`k_descale`"):
        cubeattn.flash_attn_func(q, k, v, k_descale=torch.ones((b, hq)), device="cpu")
    with pytest.raises(TypeError, match="`q_descale`"):
        cubeattn.flash_attn_func(q, k, v, q_descale=good.to(torch.float16), device="cpu")
    with pytest.raises(ValueError, match="`q_descale`"):  # descales without FP8 inputs
        cubeattn.flash_attn_func(*(x.to(torch.bfloat16) for x in (q, k, v)), q_descale=good, device="cpu")
    with pytest.raises(ValueError, match="`q`.*forward only"):
        cubeattn.flash_attn_func(q.clone().requires_grad_(), k, v, device="cpu")
    cu = torch.tensor([0, s], dtype=torch.int32)
    with pytest.raises(ValueError, match="`k`"):  # a block_table needs a paged k [num_blocks, page, heads, d]
        cubeattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, s, s, block_table=torch.zeros((1, 1), dtype=torch.int32),
                                        device="cpu")
    with pytest.raises(ValueError, match="`block_table`"):  # a block outside the cache
        cubeattn.flash_attn_varlen_func(q[0], k, v, cu, cu, s, s, block_table=torch.full((1, 1), 5, dtype=torch.int32),
                                        device="cpu")
    with pytest.raises(ValueError, match="`cu_seqlens_q`"):
        cubeattn.flash_attn_varlen_func(q[0], k[0], v[0], torch.tensor([0, s - 1], dtype=torch.int32), cu, s, s,
                                        q_descale=good, device="cpu")
