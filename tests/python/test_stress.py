"""Seed 000's stress list on the CPU backend: long keys, many groups, many sequences, imbalanced
groups, all groups on one K,V, repeated calls without growth, 10x-scaled inputs."""
import numpy as np
import pytest

import cubeattn
from conftest import grouped_segments, rand, ref_attention, rel_err, varlen_segments


def test_long_keys_64k_zigzag_groups():
    rng = np.random.default_rng(20)
    T, C = 65536, 32
    q = rand(rng, (2 * C, 4, 64), "bfloat16")
    k, v = rand(rng, (T, 1, 64), "bfloat16"), rand(rng, (T, 1, 64), "bfloat16")
    q_ranges, kv_ranges = [[0, C], [C, 2 * C]], [[0, T // 8], [0, T]]
    out = cubeattn.grouped_flash_attn_func(q, k, v, q_ranges, kv_ranges, causal=True, device="cpu")
    ref, _ = ref_attention(q, k, v, grouped_segments(q_ranges, kv_ranges), True)
    assert rel_err(out, ref) < 8e-3


def test_many_groups_and_many_sequences():
    rng = np.random.default_rng(21)
    G = 16
    q_lens = rng.integers(1, 40, size=G)
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    q_ranges = np.stack([starts[:-1], starts[1:]], 1)
    kv_ranges = np.stack([rng.integers(0, 50, size=G), rng.integers(60, 1000, size=G)], 1)
    q = rand(rng, (starts[-1], 8, 64), "float16")
    k, v = rand(rng, (1000, 2, 64), "float16"), rand(rng, (1000, 2, 64), "float16")
    out = cubeattn.grouped_flash_attn_func(q, k, v, q_ranges, kv_ranges)
    ref, _ = ref_attention(q, k, v, grouped_segments(q_ranges, kv_ranges), True)
    assert rel_err(out, ref) < 2e-3
    # 32 sequences in one varlen batch
    lens = rng.integers(1, 64, size=32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = rand(rng, (cu[-1], 4, 64), "float16")
    k, v = rand(rng, (cu[-1], 4, 64), "float16"), rand(rng, (cu[-1], 4, 64), "float16")
    out = cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, int(lens.max()), int(lens.max()), causal=True)
    ref, _ = ref_attention(q, k, v, varlen_segments(cu, cu), True)
    assert rel_err(out, ref) < 2e-3


def test_imbalanced_groups_equal_separate_calls():
    # 100 vs 9900 query tokens over one 10000-token K,V (zigzag-like prefixes)
    rng = np.random.default_rng(22)
    q = rand(rng, (10000, 2, 64), "bfloat16")
    k, v = rand(rng, (10000, 1, 64), "bfloat16"), rand(rng, (10000, 1, 64), "bfloat16")
    q_ranges, kv_ranges = [[0, 100], [100, 10000]], [[0, 100], [0, 10000]]
    out = cubeattn.grouped_flash_attn_func(q, k, v, q_ranges, kv_ranges, causal=True)
    for (a, b), (c, d) in zip(q_ranges, kv_ranges):
        sep = cubeattn.flash_attn_varlen_func(q[a:b], k[c:d], v[c:d], [0, b - a], [0, d - c], b - a, d - c, causal=True)
        assert np.array_equal(out[a:b].view(np.uint16), sep.view(np.uint16))


def test_all_groups_on_the_same_kv():
    rng = np.random.default_rng(23)
    q = rand(rng, (8 * 30, 4, 64), "bfloat16")
    k, v = rand(rng, (500, 4, 64), "bfloat16"), rand(rng, (500, 4, 64), "bfloat16")
    q_ranges = [[30 * g, 30 * (g + 1)] for g in range(8)]
    out = cubeattn.grouped_flash_attn_func(q, k, v, q_ranges, [[0, 500]] * 8, causal=False)
    ref, _ = ref_attention(q, k, v, grouped_segments(q_ranges, [[0, 500]] * 8), False)
    assert rel_err(out, ref) < 8e-3


def _rss_bytes():
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc")
def test_repeated_calls_do_not_grow_memory():
    rng = np.random.default_rng(24)
    q = rand(rng, (2048, 8, 64), "float16")
    cu = np.array([0, 2048], np.int32)
    for _ in range(3):
        cubeattn.flash_attn_varlen_func(q, q, q, cu, cu, 2048, 2048, causal=True)
    before = _rss_bytes()
    for _ in range(20):
        out, lse = cubeattn.flash_attn_varlen_func(q, q, q, cu, cu, 2048, 2048, causal=True, return_lse=True)
        cubeattn.flash_attn_varlen_backward(out, q, q, q, out, lse, cu, cu, 2048, 2048, causal=True)
    assert _rss_bytes() - before < 64 << 20


def test_scaled_inputs_backward_finite():
    rng = np.random.default_rng(25)
    q, k, v = (rand(rng, (300, 4, 64), "bfloat16", amp=10.0) for _ in range(3))
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, [0, 300], [0, 300], 300, 300, causal=True, return_lse=True)
    grads = cubeattn.flash_attn_varlen_backward(out, q, k, v, out, lse, [0, 300], [0, 300], 300, 300, causal=True)
    for g in grads:
        assert np.all(np.isfinite(g.astype(np.float32)))
