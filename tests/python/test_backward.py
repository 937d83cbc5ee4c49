import numpy as np
import pytest

import cubeattn
from conftest import BWD_TOL, DTYPES, grouped_segments, rand, ref_backward, rel_err, varlen_segments


def check_grads(got, want, dtype):
    tol, rel = BWD_TOL[dtype]
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        g = np.asarray(g, np.float64)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=name)
        assert rel_err(g, w) <= rel, name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_backward(dtype, causal):
    rng = np.random.default_rng(10 + causal)
    lens = [(33, 60), (1, 1), (70, 40)]
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = rand(rng, (cu_q[-1], 4, 64), dtype)
    k, v = rand(rng, (cu_k[-1], 2, 64), dtype), rand(rng, (cu_k[-1], 2, 64), dtype)
    dout = rand(rng, q.shape, dtype)
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 70, 60, causal=causal, return_lse=True)
    grads = cubeattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 70, 60, causal=causal)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    check_grads(grads, ref_backward(q, k, v, dout, varlen_segments(cu_q, cu_k), causal), dtype)


def test_grouped_backward_accumulates_over_overlapping_groups():
    rng = np.random.default_rng(11)
    q_ranges = np.array([[0, 40], [40, 41], [41, 100]], np.int32)
    kv_ranges = np.array([[0, 150], [10, 20], [0, 300]], np.int32)
    q = rand(rng, (100, 8, 64), "float16")
    k, v = rand(rng, (300, 2, 64), "float16"), rand(rng, (300, 2, 64), "float16")
    dout = rand(rng, q.shape, "float16")
    out, lse = cubeattn.grouped_flash_attn_func(q, k, v, q_ranges, kv_ranges, return_lse=True)
    grads = cubeattn.grouped_flash_attn_backward(dout, q, k, v, out, lse, q_ranges, kv_ranges, deterministic=True)
    check_grads(grads, ref_backward(q, k, v, dout, grouped_segments(q_ranges, kv_ranges), True), "float16")
    again = cubeattn.grouped_flash_attn_backward(dout, q, k, v, out, lse, q_ranges, kv_ranges, deterministic=True)
    for a, b in zip(grads, again):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_bench_cli_cpu_fwdbwd_rows(tmp_path, capsys):
    """`python -m cubeattn.bench fwdbwd --device cpu`: our forward + deterministic backward timed,
    torch's SDPA forward + backward as the peer when torch is installed."""
    import json

    from cubeattn import bench

    out = tmp_path / "r.json"
    assert bench.main(["fwdbwd", "--device", "cpu", "--seqlens", "96", "--iterations", "1", "--json", str(out)]) == 0
    capsys.readouterr()
    rows = json.loads(out.read_text())["rows"]
    ours = [r for r in rows if r["impl"] == "cubeattn_cpu"]
    assert len(ours) == 1 and ours[0]["what"] == "dense_causal_fwdbwd" and ours[0]["S"] == 96 and ours[0]["ms"] > 0
    assert not any(r["impl"] == "naive_numpy" for r in rows)
    if bench._has_torch():
        peer = [r for r in rows if r["impl"] == "torch_sdpa_cpu"]
        assert len(peer) == 1 and peer[0]["what"] == "dense_causal_fwdbwd" and "error" not in peer[0], peer
