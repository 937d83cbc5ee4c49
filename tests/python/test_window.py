"""Sliding-window attention (flash-attn's window_size) on the CPU against conftest's f64 reference,
whose mask is written from flash-attn's definition (row i sees keys
i + sk - sq - left <= j <= i + sk - sq + right, bottom-right aligned, -1 = unbounded): varlen,
batched and grouped layouts, forward, backward and torch autograd; odd lengths, GQA, causal and not,
0-width windows, windows wider than the sequence; argument checking (CUDA: test_window_gpu.py)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import cubeattn
from conftest import (BWD_TOL, assert_grad_close, DTYPES, FWD_TOL, grouped_segments, rand, ref_attention, ref_backward, rel_err,
                      varlen_segments)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LENS = st.one_of(st.sampled_from([0, 1, 2, 63, 64, 65, 129]), st.integers(0, 45))
SIDE = st.one_of(st.sampled_from([-1, 0, 1, 2, 64, 1000]), st.integers(0, 50))


def cu_of(lens):
    return np.cumsum([0] + list(lens)).astype(np.int32)


def check(out, lse, ref_out, ref_lse, dtype):
    tol, rel = FWD_TOL[dtype]
    o = np.asarray(out, np.float64)
    assert np.all(np.isfinite(o))
    np.testing.assert_allclose(o, ref_out, rtol=tol, atol=tol)
    assert rel_err(o, ref_out) <= rel
    fin = np.isfinite(ref_lse)
    assert np.all(lse[~fin] == np.inf), "rows whose window holds no key must have lse +inf"
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)
    assert np.all(o.transpose(1, 0, 2)[~fin] == 0.0), "rows whose window holds no key must be exactly zero"


@settings(max_examples=200, **SETTINGS)
@given(data=st.data())
def test_varlen_window_forward_and_backward_match_reference(data):
    lens = data.draw(st.lists(st.tuples(LENS, LENS), min_size=1, max_size=3), label="lens")
    hkv = data.draw(st.sampled_from([1, 2]), label="heads_kv")
    hq = hkv * data.draw(st.sampled_from([1, 2, 4]), label="gqa_ratio")
    d = data.draw(st.sampled_from([1, 8, 33, 64]), label="head_dim")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    causal = data.draw(st.booleans(), label="causal")
    window = (data.draw(SIDE, label="left"), data.draw(SIDE, label="right"))
    backward = data.draw(st.booleans(), label="backward")
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    cu_q, cu_k = cu_of(a for a, _ in lens), cu_of(b for _, b in lens)
    q = rand(rng, (cu_q[-1], hq, d), dtype)
    k, v = rand(rng, (cu_k[-1], hkv, d), dtype), rand(rng, (cu_k[-1], hkv, d), dtype)
    mq, mk = max(a for a, _ in lens), max(b for _, b in lens)
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, window_size=window,
                                               return_lse=True, device="cpu")
    segs = varlen_segments(cu_q, cu_k)
    ref_out, ref_lse = ref_attention(q, k, v, segs, causal, window=window)
    check(out, lse, ref_out, ref_lse, dtype)
    if backward:
        dout = rand(rng, q.shape, dtype)
        grads = cubeattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, causal=causal,
                                                    window_size=window, deterministic=True, device="cpu")
        tol, rel = BWD_TOL[dtype]
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref_backward(q, k, v, dout, segs, causal, window=window)):
            assert_grad_close(np.asarray(g, np.float64), r, tol, rel, tol, name)


@settings(max_examples=60, **SETTINGS)
@given(data=st.data())
def test_grouped_window_is_measured_inside_each_group(data):
    n = data.draw(st.integers(1, 5), label="groups")
    total_k = data.draw(st.integers(1, 80), label="total_k")
    q_ranges, pos = [], 0
    for _ in range(n):
        ln = data.draw(st.integers(0, 30), label="q_len")
        q_ranges.append([pos, pos + ln])
        pos += ln + data.draw(st.sampled_from([0, 2]), label="gap")
    kv_ranges = []
    for _ in range(n):
        a = data.draw(st.integers(0, total_k), label="k_start")
        kv_ranges.append([a, data.draw(st.integers(a, total_k), label="k_end")])
    causal = data.draw(st.booleans(), label="causal")
    window = (data.draw(SIDE, label="left"), data.draw(SIDE, label="right"))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    q, k, v = rand(rng, (pos, 4, 16), "float32"), rand(rng, (total_k, 2, 16), "float32"), rand(rng, (total_k, 2, 16), "float32")
    out, lse = cubeattn.grouped_flash_attn_func(q, k, v, q_ranges, kv_ranges, causal=causal, window_size=window,
                                                return_lse=True, device="cpu")
    segs = grouped_segments(q_ranges, kv_ranges)
    ref_out, ref_lse = ref_attention(q, k, v, segs, causal, window=window)
    check(out, lse, ref_out, ref_lse, "float32")
    dout = rand(rng, q.shape, "float32")
    grads = cubeattn.grouped_flash_attn_backward(dout, q, k, v, out, lse, q_ranges, kv_ranges, causal=causal,
                                                 window_size=window, device="cpu")
    for g, r in zip(grads, ref_backward(q, k, v, dout, segs, causal, window=window)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sq, sk", [(33, 33), (7, 40), (40, 7), (1, 1)])
@pytest.mark.parametrize("window", [(0, 0), (4, 3), (-1, 0), (5, -1), (100, 100)])
@pytest.mark.parametrize("causal", [False, True])
def test_batched_window(sq, sk, window, causal):
    rng = np.random.default_rng(sq * 100 + sk)
    q, k, v = rand(rng, (2, sq, 4, 32), "float32"), rand(rng, (2, sk, 2, 32), "float32"), rand(rng, (2, sk, 2, 32), "float32")
    out, lse = cubeattn.flash_attn_func(q, k, v, 0.0, None, causal, window, return_lse=True, device="cpu")
    cu_q, cu_k = np.arange(3) * sq, np.arange(3) * sk
    ref_out, ref_lse = ref_attention(q.reshape(-1, 4, 32), k.reshape(-1, 2, 32), v.reshape(-1, 2, 32),
                                     varlen_segments(cu_q, cu_k), causal, window=window)
    check(out.reshape(-1, 4, 32), lse.transpose(1, 0, 2).reshape(4, -1), ref_out, ref_lse, "float32")


def test_zero_width_window_attends_the_diagonal_key_only():
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, (12, 2, 8), "float32"), rand(rng, (5, 2, 8), "float32"), rand(rng, (5, 2, 8), "float32")
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, [0, 12], [0, 5], 12, 5, window_size=(0, 0),
                                               return_lse=True, device="cpu")
    for i in range(12):
        j = i + 5 - 12
        if j < 0:  # the diagonal lies before key 0: no key, zero output, lse +inf
            assert np.all(out[i] == 0) and np.all(lse[:, i] == np.inf)
        else:  # one key: its value row exactly (probability 1), lse = the score
            np.testing.assert_allclose(out[i], v[j], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(lse[:, i], (q[i] * k[j]).sum(-1) / np.sqrt(8), rtol=1e-5, atol=1e-6)


def test_window_wider_than_the_sequence_is_plain_attention():
    rng = np.random.default_rng(2)
    q, k, v = rand(rng, (30, 2, 16), "float32"), rand(rng, (40, 2, 16), "float32"), rand(rng, (40, 2, 16), "float32")
    for causal in (False, True):
        plain = cubeattn.flash_attn_varlen_func(q, k, v, [0, 30], [0, 40], 30, 40, causal=causal, device="cpu")
        wide = cubeattn.flash_attn_varlen_func(q, k, v, [0, 30], [0, 40], 30, 40, causal=causal,
                                               window_size=(39, 29), device="cpu")
        np.testing.assert_array_equal(plain, wide)
        narrow = cubeattn.flash_attn_varlen_func(q, k, v, [0, 30], [0, 40], 30, 40, causal=causal,
                                                 window_size=(38, 29), device="cpu")
        assert not np.array_equal(plain, narrow)
    spec = cubeattn.varlen_spec((30, 2, 16), (40, 2, 16), "float32", [0, 30], [0, 40], 30, 40, causal=True,
                                window_size=(39, 7))
    assert spec.window_size == (-1, -1)  # both sides normalised away (right: causal)
    spec = cubeattn.varlen_spec((30, 2, 16), (40, 2, 16), "float32", [0, 30], [0, 40], 30, 40, window_size=(3, 7))
    assert spec.window_size == (3, 7)


@pytest.mark.parametrize("window", [(-2, 0), (0, -5), (-3, -3)])
def test_bad_window_values_are_value_errors_naming_window_size(window):
    q = np.zeros((4, 1, 8), np.float32)
    with pytest.raises(ValueError, match="`window_size`"):
        cubeattn.flash_attn_varlen_func(q, q, q, [0, 4], [0, 4], 4, 4, window_size=window)
    with pytest.raises(ValueError, match="`window_size`"):
        cubeattn.grouped_flash_attn_func(q, q, q, [[0, 4]], [[0, 4]], window_size=window)


@pytest.mark.torch
def test_window_through_torch_autograd():
    torch = pytest.importorskip("torch")
    from conftest import ref_backward as rb

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.rand(2, 37, h, 16, generator=g) * 2 - 1 for h in (4, 2, 2))
    for x in (q, k, v):
        x.requires_grad_()
    out = cubeattn.flash_attn_func(q, k, v, causal=True, window_size=(6, 0), deterministic=True, device="cpu")
    dout = torch.rand(out.shape, generator=g) * 2 - 1
    out.backward(dout)
    cu = np.arange(3) * 37
    segs = varlen_segments(cu, cu)
    flat = [x.detach().numpy().reshape(-1, x.shape[2], 16) for x in (q, k, v)]
    ref_out, _ = ref_attention(*flat, segs, True, window=(6, 0))
    np.testing.assert_allclose(out.detach().numpy().reshape(-1, 4, 16), ref_out, rtol=1e-5, atol=1e-5)
    refs = rb(*flat, dout.numpy().reshape(-1, 4, 16), segs, True, window=(6, 0))
    for x, r in zip((q, k, v), refs):
        np.testing.assert_allclose(x.grad.numpy().reshape(r.shape), r, rtol=1e-4, atol=1e-4)
