"""GPU tests through the wheel (marked `gpu`; skipped unless the CUDA backend starts)."""
import numpy as np
import pytest

import cubeattn
from conftest import FWD_TOL, grouped_segments, rand, ref_attention, ref_backward, rel_err, varlen_segments

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 32, 96, 192, 256])
def test_gpu_varlen_forward(dtype, causal, d):
    rng = np.random.default_rng(d + causal)
    lens = [(1, 1), (63, 200), (130, 130), (257, 100)]
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = rand(rng, (cu_q[-1], 32, d), dtype)
    k, v = rand(rng, (cu_k[-1], 8, d), dtype), rand(rng, (cu_k[-1], 8, d), dtype)
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 257, 200, causal=causal, return_lse=True,
                                               device="cuda")
    assert cubeattn.last_backend() == "cuda"
    ref_out, ref_lse = ref_attention(q, k, v, varlen_segments(cu_q, cu_k), causal)
    tol, rel = FWD_TOL[dtype]
    o = out.astype(np.float64)
    assert np.all(np.isfinite(o))
    assert rel_err(o, ref_out) <= max(rel, 2e-3)
    np.testing.assert_allclose(o, ref_out, atol=max(tol, 1e-2), rtol=max(tol, 1e-2))
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isinf(lse), ~fin)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("groups", [2, 4, 16])
def test_gpu_grouped_forward_matches_cpu(groups):
    rng = np.random.default_rng(groups)
    q_lens = rng.integers(0, 100, size=groups)
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    q_ranges = np.stack([starts[:-1], starts[1:]], 1).astype(np.int32)
    ends = rng.integers(1, 2000, size=groups)
    kv_ranges = np.stack([np.zeros(groups, int), ends], 1).astype(np.int32)
    q = rand(rng, (starts[-1], 32, 128), "bfloat16")
    k, v = rand(rng, (2000, 8, 128), "bfloat16"), rand(rng, (2000, 8, 128), "bfloat16")
    gpu = cubeattn.grouped_flash_attn_func(q, k, v, q_ranges, kv_ranges, device="cuda")
    ref_out, _ = ref_attention(q, k, v, grouped_segments(q_ranges, kv_ranges), True)
    assert rel_err(gpu.astype(np.float64), ref_out) < 8e-3
    cpu = cubeattn.grouped_flash_attn_func(q, k, v, q_ranges, kv_ranges, device="cpu")
    np.testing.assert_allclose(gpu.astype(np.float32), cpu.astype(np.float32), atol=2e-2, rtol=2e-2)


def test_gpu_backward_matches_reference():
    rng = np.random.default_rng(7)
    lens = [(65, 130), (1, 7), (100, 100)]
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = rand(rng, (cu_q[-1], 8, 64), "float16")
    k, v = rand(rng, (cu_k[-1], 2, 64), "float16"), rand(rng, (cu_k[-1], 2, 64), "float16")
    dout = rand(rng, q.shape, "float16")
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 100, 130, causal=True, return_lse=True,
                                               device="cuda")
    try:
        grads = cubeattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 100, 130, causal=True,
                                                    deterministic=True, device="cuda")
    except ValueError as e:
        pytest.skip(f"CUDA backward not available in this build: {e}")
    want = ref_backward(q, k, v, dout, varlen_segments(cu_q, cu_k), True)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert rel_err(g.astype(np.float64), w) < 1e-2, name
    again = cubeattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 100, 130, causal=True,
                                                deterministic=True, device="cuda")
    for a, b in zip(grads, again):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_gpu_repeated_calls_do_not_grow_device_memory():
    rng = np.random.default_rng(9)
    q = rand(rng, (1024, 32, 128), "bfloat16")
    k, v = rand(rng, (1024, 8, 128), "bfloat16"), rand(rng, (1024, 8, 128), "bfloat16")
    cu = np.array([0, 1024], np.int32)

    def free():
        return cubeattn.devices()[0]["free_memory"]
    cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, 1024, 1024, causal=True, device="cuda")
    before = free()
    for _ in range(10):
        cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, 1024, 1024, causal=True, device="cuda")
    assert before - free() < 64 << 20, "device memory grew by more than 64 MiB over 10 calls"


def test_auto_falls_back_to_cpu_for_calls_without_a_kernel():
    # every head_dim the API takes (up to 256) has a CUDA kernel now (those without their own run
    # padded); float32 block-sparse attention has none: device="auto" takes the CPU for it,
    # device="cuda" raises NotImplementedError naming the dtype
    rng = np.random.default_rng(10)
    q = rand(rng, (1, 256, 2, 64), "float32")
    ix = np.array([[[[0, -1], [0, 1]]] * 2], np.int32)  # [B, H, q_blocks, top_k], 128-blocks
    out = cubeattn.block_sparse_attn_func(q, q, q, ix, q_block=128, k_block=128, device="auto")
    assert cubeattn.last_backend() == "cpu"
    with pytest.raises(NotImplementedError, match="float32"):
        cubeattn.block_sparse_attn_func(q, q, q, ix, q_block=128, k_block=128, device="cuda")
    want = cubeattn.block_sparse_attn_func(q, q, q, ix, q_block=128, k_block=128, device="cpu")
    assert np.array_equal(out, want)


def test_gpu_device_index():
    q = np.random.default_rng(0).random((16, 2, 64), dtype=np.float32).astype(np.float16)
    cu = np.array([0, 16], np.int32)
    out0 = cubeattn.flash_attn_varlen_func(q, q, q, cu, cu, 16, 16, device="cuda:0")
    assert cubeattn.last_backend() == "cuda"
    assert np.array_equal(out0, cubeattn.flash_attn_varlen_func(q, q, q, cu, cu, 16, 16, device="cuda"))
    n = len(cubeattn.devices())
    with pytest.raises(ValueError, match="`device`"):
        cubeattn.flash_attn_varlen_func(q, q, q, cu, cu, 16, 16, device=f"cuda:{n}")
    out_auto = cubeattn.flash_attn_varlen_func(q, q, q, cu, cu, 16, 16, device=f"auto:{n}")
    assert cubeattn.last_backend() == "cpu"
    assert np.abs(out_auto.astype(np.float32) - out0.astype(np.float32)).max() < 2e-3
