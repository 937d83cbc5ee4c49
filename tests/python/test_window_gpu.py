"""Sliding-window attention on CUDA: the tensor-core kernels (f16/bf16) and the row-wise f32 ones
against conftest's f64 reference, forward and backward (both dQ paths), numpy and torch inputs,
varlen (1-token sequences, lengths off the 64-row tiles, Sq != Sk), grouped (overlapping key
ranges), GQA, causal and not, 0-width windows and windows wider than the sequence. Same checks as
the CPU tests in test_window.py (rows whose window holds no key: zeros and lse +inf)."""
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cubeattn
from conftest import (BWD_TOL, DTYPES, assert_grad_close, grouped_segments, rand, ref_attention, ref_backward,
                      varlen_segments)
from test_window import SETTINGS, check, cu_of

pytestmark = pytest.mark.gpu

WINDOWS = [(0, 0), (4, 3), (-1, 0), (5, -1), (64, 0), (100, 100), (127, 64), (1, 300), (200, 1)]
LENS_Q, LENS_K = [1, 63, 130, 257], [1, 80, 130, 300]


def seed(*key):
    return zlib.crc32(repr(key).encode())


def run_varlen(rng, lens_q, lens_k, hq, hkv, d, dtype, causal, window, deterministic=True):
    cu_q, cu_k = cu_of(lens_q), cu_of(lens_k)
    q = rand(rng, (cu_q[-1], hq, d), dtype)
    k, v = rand(rng, (cu_k[-1], hkv, d), dtype), rand(rng, (cu_k[-1], hkv, d), dtype)
    mq, mk = max(lens_q), max(lens_k)
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, window_size=window,
                                               return_lse=True, device="cuda")
    assert cubeattn.last_backend() == "cuda"
    segs = varlen_segments(cu_q, cu_k)
    ref_out, ref_lse = ref_attention(q, k, v, segs, causal, window=window)
    check(out, lse, ref_out, ref_lse, dtype)
    dout = rand(rng, q.shape, dtype)
    grads = cubeattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, causal=causal,
                                                window_size=window, deterministic=deterministic, device="cuda")
    tol, rel = BWD_TOL[dtype]
    # P and dS enter the tensor-core products rounded to the dtype (as in FlashAttention-2): an
    # element summed over many rows with cancellation can sit past a fixed bound (bf16 dv 0.025 off
    # over 127 rows, H200), so both bounds apply beyond 2 unit roundoffs times each element's sum
    # of |terms| (conftest.ref_backward's abs_sums; test_properties_gpu.py's rounding model)
    u = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}.get(dtype, 2.0 ** -21)
    refs = ref_backward(q, k, v, dout, segs, causal, window=window, abs_sums=True)
    for name, g, r, sums in zip(("dq", "dk", "dv"), grads, refs[:3], refs[3:]):
        g = np.asarray(g, np.float64)
        assert np.all(np.isfinite(g)), name
        assert_grad_close(g, r, tol, rel, tol, f"{name} window={window} causal={causal} {dtype} d={d}", slack=u * sums)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_window_d128(dtype, causal, window):
    rng = np.random.default_rng(seed(dtype, causal, window))
    run_varlen(rng, LENS_Q, LENS_K, 4, 2, 128, dtype, causal, window)


@pytest.mark.parametrize("window", [(0, 0), (5, -1), (100, 100), (127, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_window_d64_and_the_atomic_dq_path(causal, window):
    rng = np.random.default_rng(seed("d64", causal, window))
    run_varlen(rng, LENS_Q, LENS_K, 8, 2, 64, "bfloat16", causal, window, deterministic=False)


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_window_is_measured_inside_each_group(causal):
    rng = np.random.default_rng(seed("grouped", causal))
    q_ranges = np.array([[0, 100], [100, 101], [101, 300], [300, 300], [300, 420]], np.int32)
    kv_ranges = np.array([[0, 150], [40, 41], [60, 400], [0, 10], [350, 500]], np.int32)
    q, k, v = rand(rng, (420, 4, 128), "float16"), rand(rng, (500, 1, 128), "float16"), rand(rng, (500, 1, 128), "float16")
    window = (37, 5)
    out, lse = cubeattn.grouped_flash_attn_func(q, k, v, q_ranges, kv_ranges, causal=causal, window_size=window,
                                                return_lse=True, device="cuda")
    assert cubeattn.last_backend() == "cuda"
    segs = grouped_segments(q_ranges, kv_ranges)
    ref_out, ref_lse = ref_attention(q, k, v, segs, causal, window=window)
    check(out, lse, ref_out, ref_lse, "float16")
    dout = rand(rng, q.shape, "float16")
    grads = cubeattn.grouped_flash_attn_backward(dout, q, k, v, out, lse, q_ranges, kv_ranges, causal=causal,
                                                 window_size=window, device="cuda")
    tol, rel = BWD_TOL["float16"]
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_backward(q, k, v, dout, segs, causal, window=window)):
        assert_grad_close(np.asarray(g, np.float64), r, tol, rel, tol, name)


@settings(max_examples=40, **SETTINGS)
@given(data=st.data())
def test_random_windows_match_reference(data):
    lens = st.one_of(st.sampled_from([1, 2, 63, 64, 65, 127, 128, 129]), st.integers(1, 300))
    n = data.draw(st.integers(1, 3), label="sequences")
    lens_q = [data.draw(lens, label="lq") for _ in range(n)]
    lens_k = [data.draw(lens, label="lk") for _ in range(n)]
    hkv = data.draw(st.sampled_from([1, 2]), label="heads_kv")
    hq = hkv * data.draw(st.sampled_from([1, 4]), label="gqa_ratio")
    side = st.one_of(st.sampled_from([-1, 0, 1, 63, 64, 65, 1000]), st.integers(0, 200))
    window = (data.draw(side, label="left"), data.draw(side, label="right"))
    dtype = data.draw(st.sampled_from(["float16", "bfloat16"]), label="dtype")
    d = data.draw(st.sampled_from([64, 128]), label="head_dim")
    causal = data.draw(st.booleans(), label="causal")
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    run_varlen(rng, lens_q, lens_k, hq, hkv, d, dtype, causal, window, deterministic=data.draw(st.booleans()))


@pytest.mark.torch
def test_window_through_torch_autograd_on_cuda_tensors():
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.rand(2, 300, h, 128, generator=g, device="cuda", dtype=torch.bfloat16) * 2 - 1 for h in (8, 2, 2))
    for x in (q, k, v):
        x.requires_grad_()
    out = cubeattn.flash_attn_func(q, k, v, causal=True, window_size=(70, 0))
    dout = torch.rand(out.shape, generator=g, device="cuda", dtype=torch.bfloat16) * 2 - 1
    out.backward(dout)
    cu = np.arange(3) * 300
    segs = varlen_segments(cu, cu)
    flat = [x.detach().float().cpu().numpy().reshape(-1, x.shape[2], 128) for x in (q, k, v)]
    ref_out, _ = ref_attention(*flat, segs, True, window=(70, 0))
    np.testing.assert_allclose(out.detach().float().cpu().numpy().reshape(-1, 8, 128), ref_out, rtol=1e-2, atol=1e-2)
    refs = ref_backward(*flat, dout.float().cpu().numpy().reshape(-1, 8, 128), segs, True, window=(70, 0))
    tol, rel = BWD_TOL["bfloat16"]
    for name, x, r in zip(("dq", "dk", "dv"), (q, k, v), refs):
        assert_grad_close(x.grad.float().cpu().numpy().reshape(r.shape).astype(np.float64), r, tol, rel, tol, name)


def test_auto_picks_cuda_for_a_window():
    q = np.random.default_rng(4).uniform(-1, 1, (16, 2, 64)).astype(np.float16)
    cubeattn.flash_attn_varlen_func(q, q, q, [0, 16], [0, 16], 16, 16, window_size=(3, 3), device="auto")
    assert cubeattn.last_backend() == "cuda"
