import numpy as np
import pytest

import cubeattn


def qkv(tq=10, tk=10, hq=4, hkv=2, d=64, dtype=np.float32):
    return (np.ones((tq, hq, d), dtype), np.ones((tk, hkv, d), dtype), np.ones((tk, hkv, d), dtype))


CU = np.array([0, 10], np.int32)


@pytest.mark.parametrize("kwargs, exc, arg", [
    (dict(q=np.ones((10, 64), np.float32)), ValueError, "`q`"),
    (dict(k=np.ones((10, 3, 64), np.float32), v=np.ones((10, 3, 64), np.float32)), ValueError, "`k`"),
    (dict(k=np.ones((10, 2, 32), np.float32), v=np.ones((10, 2, 32), np.float32)), ValueError, "`k`"),
    (dict(v=np.ones((9, 2, 64), np.float32)), ValueError, "`v`"),
    (dict(q=np.ones((10, 4, 0), np.float32), k=np.ones((10, 2, 0), np.float32), v=np.ones((10, 2, 0), np.float32)), ValueError, "head_dim"),
    (dict(k=np.ones((10, 2, 64), np.float16)), TypeError, "dtype"),
    (dict(q=np.ones((10, 4, 64), np.int32)), TypeError, "`q`"),
    (dict(q=[[1.0]]), TypeError, "`q`"),
    (dict(cu_seqlens_q=np.array([1, 10], np.int32)), ValueError, "`cu_seqlens_q`"),
    (dict(cu_seqlens_k=np.array([0, 8, 6, 10], np.int32), cu_seqlens_q=np.array([0, 3, 6, 10], np.int32)), ValueError, "`cu_seqlens_k`"),
    (dict(cu_seqlens_k=np.array([0, 9], np.int32)), ValueError, "`cu_seqlens_k`"),
    (dict(cu_seqlens_q=np.array([[0, 10]], np.int32)), ValueError, "`cu_seqlens_q`"),
    (dict(cu_seqlens_q=np.array([0.0, 10.0])), TypeError, "`cu_seqlens_q`"),
    (dict(max_seqlen_q=3), ValueError, "`max_seqlen_q`"),
    (dict(max_seqlen_k=-1), ValueError, "`max_seqlen_k`"),
    (dict(softmax_scale=float("nan")), ValueError, "`softmax_scale`"),
    (dict(softmax_scale=float("inf")), ValueError, "`softmax_scale`"),
    (dict(softmax_scale="big"), TypeError, "`softmax_scale`"),
    (dict(device="tpu"), ValueError, "`device`"),
    (dict(device="cuda:x"), ValueError, "`device`"),
    (dict(device="cpu:0"), ValueError, "`device`"),
    (dict(device="cuda:-1"), ValueError, "`device`"),
    (dict(device="cuda:100000"), ValueError, "`device`"),
    (dict(device=0), TypeError, "`device`"),
])
def test_varlen_bad_inputs_raise_naming_the_argument(kwargs, exc, arg):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=10, max_seqlen_k=10)
    args.update(kwargs)
    with pytest.raises(exc, match=arg):
        cubeattn.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("q_ranges, kv_ranges, arg", [
    (np.zeros((0, 2), np.int32), np.zeros((0, 2), np.int32), "q_ranges"),
    ([[0, 5]], [[0, 5], [0, 6]], "kv_ranges"),
    ([[0, 11]], [[0, 5]], "q_ranges"),
    ([[0, 6], [5, 10]], [[0, 5], [0, 5]], "q_ranges"),
    ([[0, 5]], [[-1, 5]], "kv_ranges"),
    ([[0, 5, 1]], [[0, 5]], "q_ranges"),
])
def test_grouped_bad_ranges(q_ranges, kv_ranges, arg):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=arg):
        cubeattn.grouped_flash_attn_func(q, k, v, q_ranges, kv_ranges)


@pytest.mark.parametrize("table, kv_ranges, window, exc, match", [
    ([1, 0, 2], [[0, 128]], (-1, -1), ValueError, r"`kv_block_table`.*3 entries.*2 blocks"),
    ([0, 0], [[0, 128]], (-1, -1), ValueError, r"`kv_block_table`.*kv_block_table\[1\] = 0 repeats kv_block_table\[0\]"),
    ([0, 2], [[0, 128]], (-1, -1), ValueError, r"`kv_block_table`.*kv_block_table\[1\] = 2 is outside 0\.\.2"),
    ([1, -1], [[0, 128]], (-1, -1), ValueError, r"`kv_block_table`.*= -1"),
    ([1, 0], [[32, 128]], (-1, -1), ValueError, r"`kv_block_table`.*kv_ranges 0 starts at 32"),
    ([1, 0], [[0, 128]], (16, 0), ValueError, r"`window_size`"),
    ([[1, 0]], [[0, 128]], (-1, -1), ValueError, r"`kv_block_table`"),
    ([1.0, 0.0], [[0, 128]], (-1, -1), TypeError, r"`kv_block_table`"),
])
def test_grouped_bad_kv_block_table(table, kv_ranges, window, exc, match):
    q, k, v = qkv(tk=128)
    with pytest.raises(exc, match=match):
        cubeattn.grouped_flash_attn_func(q, k, v, [[0, 10]], kv_ranges, window_size=window,
                                         kv_block_table=np.array(table))
    with pytest.raises(exc, match=match):
        cubeattn.grouped_flash_attn_backward(q, q, k, v, q, np.zeros(40, np.float32), [[0, 10]], kv_ranges,
                                             window_size=window, kv_block_table=np.array(table))


def test_grouped_kv_block_table_total_k_off_the_block():
    q, k, v = qkv(tk=100)
    with pytest.raises(ValueError, match=r"`kv_block_table`.*multiple of 64, got 100"):
        cubeattn.grouped_flash_attn_func(q, k, v, [[0, 10]], [[0, 100]], kv_block_table=[0, 1])


def test_grouped_kv_block_table_reads_the_paged_rows():
    """numpy, CPU: the paged call over blocks swapped equals the plain call, dk/dv swapped back."""
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal(s).astype(np.float32) for s in ((10, 4, 64), (128, 2, 64), (128, 2, 64), (10, 4, 64)))
    swap = lambda x: np.concatenate([x[64:], x[:64]])
    o1, l1 = cubeattn.grouped_flash_attn_func(q, k, v, [[0, 10]], [[0, 128]], return_lse=True)
    o2, l2 = cubeattn.grouped_flash_attn_func(q, swap(k), swap(v), [[0, 10]], [[0, 128]], return_lse=True,
                                              kv_block_table=[1, 0])
    assert np.array_equal(o1, o2) and np.array_equal(l1, l2)
    d1 = cubeattn.grouped_flash_attn_backward(g, q, k, v, o1, l1, [[0, 10]], [[0, 128]])
    d2 = cubeattn.grouped_flash_attn_backward(g, q, swap(k), swap(v), o1, l1, [[0, 10]], [[0, 128]],
                                              kv_block_table=[1, 0])
    assert np.array_equal(d1[0], d2[0])
    assert np.array_equal(swap(d1[1]), d2[1]) and np.array_equal(swap(d1[2]), d2[2])


def test_backward_bad_lse_length():
    q, k, v = qkv()
    out = cubeattn.flash_attn_varlen_func(q, k, v, CU, CU, 10, 10)
    with pytest.raises(ValueError, match="`lse`"):
        cubeattn.flash_attn_varlen_backward(out, q, k, v, out, np.zeros(3, np.float32), CU, CU, 10, 10)


def test_cuda_request_without_cuda_is_a_clear_error():
    if cubeattn.backend_status()["cuda_available"]:
        pytest.skip("CUDA is available here")
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="cuda"):
        cubeattn.flash_attn_varlen_func(q, k, v, CU, CU, 10, 10, device="cuda")


def test_auto_with_a_device_index_falls_back_to_the_cpu_without_cuda():
    if cubeattn.backend_status()["cuda_available"]:
        pytest.skip("CUDA is available here")
    q, k, v = qkv()
    out = cubeattn.flash_attn_varlen_func(q, k, v, CU, CU, 10, 10, device="auto:3")
    assert cubeattn.last_backend() == "cpu"
    assert np.array_equal(out, cubeattn.flash_attn_varlen_func(q, k, v, CU, CU, 10, 10, device="cpu"))


def test_devices_and_status_never_raise():
    st = cubeattn.backend_status()
    assert isinstance(st["reason"], str) and st["reason"]
    assert isinstance(cubeattn.devices(), list)


def test_estimate_vram_breakdown():
    e = cubeattn.estimate_vram((4096, 32, 128), (4096, 8, 128), "bfloat16")
    assert e["inputs"] == (4096 * 32 * 128 + 2 * 4096 * 8 * 128) * 2
    assert e["outputs"] == 4096 * 32 * 128 * 2
    assert e["lse"] == 32 * 4096 * 4
    assert e["total"] == e["inputs"] + e["outputs"] + e["lse"] + e["workspace"]
    b = cubeattn.estimate_vram((4096, 32, 128), (4096, 8, 128), "bfloat16", backward=True)
    assert b["total"] > e["total"]
    with pytest.raises(ValueError, match="`k`"):
        cubeattn.estimate_vram((4096, 32, 128), (4096, 7, 128), "bfloat16")
    # v with a head_dim of its own (DeepSeek's MLA: 192 / 128): v and out at 128
    m = cubeattn.estimate_vram((4096, 16, 192), (4096, 16, 192), "bfloat16", v_shape=(4096, 16, 128))
    assert m["inputs"] == (4096 * 16 * 192 * 2 + 4096 * 16 * 128) * 2
    assert m["outputs"] == 4096 * 16 * 128 * 2
    with pytest.raises(ValueError, match="`v`"):
        cubeattn.estimate_vram((4096, 16, 192), (4096, 16, 192), "bfloat16", v_shape=(4096, 8, 128))


def test_backward_rejects_non_arrays_with_type_error():
    q, k, v = qkv()
    out = cubeattn.flash_attn_varlen_func(q, k, v, CU, CU, 10, 10)
    with pytest.raises(TypeError, match="`q`"):
        cubeattn.flash_attn_varlen_backward(out, q.tolist(), k, v, out, np.zeros((4, 10), np.float32), CU, CU, 10, 10)
