import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cubeattn
from conftest import (DTYPES, FWD_TOL, grouped_segments, rand, ref_attention, rel_err, varlen_segments)


def check(out, lse, ref_out, ref_lse, dtype):
    tol, rel = FWD_TOL[dtype]
    o = np.asarray(out, np.float64)
    assert np.all(np.isfinite(o))
    np.testing.assert_allclose(o, ref_out, rtol=tol, atol=tol)
    assert rel_err(o, ref_out) <= rel
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isinf(lse), ~fin)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", [[(1, 1)], [(37, 37)], [(5, 300)], [(129, 77)], [(128, 128), (1, 9), (0, 4), (250, 700)]])
def test_varlen_matches_reference(dtype, causal, lens):
    rng = np.random.default_rng(hash((dtype, causal, str(lens))) % 2**32)
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = rand(rng, (cu_q[-1], 8, 64), dtype)
    k = rand(rng, (cu_k[-1], 2, 64), dtype)
    v = rand(rng, (cu_k[-1], 2, 64), dtype)
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(a for a, _ in lens), max(b for _, b in lens),
                                               causal=causal, return_lse=True, device="cpu")
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (8, cu_q[-1])
    assert cubeattn.last_backend() == "cpu"
    ref_out, ref_lse = ref_attention(q, k, v, varlen_segments(cu_q, cu_k), causal)
    check(out, lse, ref_out, ref_lse, dtype)


def test_gqa_32_8_head_dim_128_and_scale():
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, (200, 32, 128), "float16"), rand(rng, (300, 8, 128), "float16"), rand(rng, (300, 8, 128), "float16")
    cu_q, cu_k = np.array([0, 200], np.int32), np.array([0, 300], np.int32)
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, softmax_scale=0.05, causal=True,
                                               return_lse=True, device="cpu")
    ref_out, ref_lse = ref_attention(q, k, v, [(0, 200, 0, 300)], True, scale=0.05)
    check(out, lse, ref_out, ref_lse, "float16")


def test_flash_attn_func_batched_layout():
    rng = np.random.default_rng(2)
    q, k, v = (rand(rng, (3, 40, 4, 64), "float32") for _ in range(3))
    out, lse = cubeattn.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (3, 4, 40)
    for b in range(3):
        ref_out, ref_lse = ref_attention(q[b], k[b], v[b], [(0, 40, 0, 40)], True)
        np.testing.assert_allclose(out[b], ref_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse[b], ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_overlapping_matches_reference(groups, causal):
    rng = np.random.default_rng(groups * 2 + causal)
    q_lens = rng.integers(1, 90, size=groups)
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    q_ranges = np.stack([starts[:-1], starts[1:]], 1).astype(np.int32)
    total_k = 600
    ends = rng.integers(1, total_k, size=groups)
    begins = np.minimum(rng.integers(0, 100, size=groups), ends)
    kv_ranges = np.stack([begins, ends], 1).astype(np.int32)
    q = rand(rng, (starts[-1], 4, 64), "bfloat16")
    k, v = rand(rng, (total_k, 2, 64), "bfloat16"), rand(rng, (total_k, 2, 64), "bfloat16")
    out, lse = cubeattn.grouped_flash_attn_func(q, k, v, q_ranges, kv_ranges, causal=causal, return_lse=True)
    ref_out, ref_lse = ref_attention(q, k, v, grouped_segments(q_ranges, kv_ranges), causal)
    check(out, lse, ref_out, ref_lse, "bfloat16")


def test_single_group_equals_varlen():
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, (70, 4, 64), "float16"), rand(rng, (90, 4, 64), "float16"), rand(rng, (90, 4, 64), "float16")
    a = cubeattn.grouped_flash_attn_func(q, k, v, [[0, 70]], [[0, 90]], causal=True)
    b = cubeattn.flash_attn_varlen_func(q, k, v, [0, 70], [0, 90], 70, 90, causal=True)
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_zigzag_two_groups_equal_two_separate_calls():
    # rank r of W holds chunks r and 2W-1-r; group 0 sees [0,(r+1)C), group 1 sees [0,(2W-r)C)
    rng = np.random.default_rng(4)
    W, C, r = 4, 32, 1
    T = 2 * W * C
    q = rand(rng, (2 * C, 8, 64), "float16")
    k, v = rand(rng, (T, 2, 64), "float16"), rand(rng, (T, 2, 64), "float16")
    e0, e1 = (r + 1) * C, (2 * W - r) * C
    out = cubeattn.grouped_flash_attn_func(q, k, v, [[0, C], [C, 2 * C]], [[0, e0], [0, e1]], causal=True)
    a = cubeattn.flash_attn_varlen_func(q[:C], k[:e0], v[:e0], [0, C], [0, e0], C, e0, causal=True)
    b = cubeattn.flash_attn_varlen_func(q[C:], k[:e1], v[:e1], [0, C], [0, e1], C, e1, causal=True)
    np.testing.assert_array_equal(out, np.concatenate([a, b]))


def test_large_values_stay_finite():
    rng = np.random.default_rng(5)
    q, k, v = (rand(rng, (256, 4, 64), "float16", amp=10.0) for _ in range(3))
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, [0, 256], [0, 256], 256, 256, causal=True, return_lse=True)
    assert np.all(np.isfinite(out.astype(np.float32))) and np.all(np.isfinite(lse))
    ref_out, _ = ref_attention(q, k, v, [(0, 256, 0, 256)], True)
    assert rel_err(out, ref_out) < 2e-3


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_random_varlen(data):
    batch = data.draw(st.integers(1, 4))
    lens = [(data.draw(st.integers(0, 70)), data.draw(st.integers(0, 70))) for _ in range(batch)]
    hkv = data.draw(st.sampled_from([1, 2]))
    hq = hkv * data.draw(st.sampled_from([1, 3]))
    d = data.draw(st.sampled_from([16, 64, 72]))
    causal = data.draw(st.booleans())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = rand(rng, (cu_q[-1], hq, d), "float32")
    k, v = rand(rng, (cu_k[-1], hkv, d), "float32"), rand(rng, (cu_k[-1], hkv, d), "float32")
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 70, 70, causal=causal, return_lse=True)
    ref_out, ref_lse = ref_attention(q, k, v, varlen_segments(cu_q, cu_k), causal)
    check(out, lse, ref_out, ref_lse, "float32")


def test_repeated_calls_release_the_gil():
    import threading

    rng = np.random.default_rng(6)
    q = rand(rng, (512, 8, 64), "float32")
    results = []
    ts = [threading.Thread(target=lambda: results.append(cubeattn.flash_attn_func(q[None], q[None], q[None])))
          for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(results) == 3 and all(np.array_equal(r, results[0]) for r in results)
