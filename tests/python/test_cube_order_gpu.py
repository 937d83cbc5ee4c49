"""The cube order of the Hopper launches (`CUBEATTN_FWD_ORDER`, `CUBEATTN_BWD_ORDER`,
`CUBEATTN_DQ_ORDER`: kv head outer or heads fastest; the defaults pick one per call, docs/forward.md and docs/backward.md) moves only
which cube runs when: out, lse and the deterministic backward's gradients must be the same bits in
either order, and match the f64 reference (marked `gpu`). The switches are read once per process,
so each order runs in a child process."""
import numpy as np
import pytest

from child_case import run_child, varlen_inputs
from conftest import BWD_TOL, FWD_TOL, ref_attention, ref_backward, rel_err, varlen_segments

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    # one kernel cache for the module's children (the order is a launch argument, not a kernel key)
    return str(tmp_path_factory.mktemp("order-cache"))


def _same_bits_in_both_orders(tmp_path, cache_dir, d, causal, window, seed):
    dtype = "bfloat16"
    rng = np.random.default_rng(seed)
    # GQA 8 / 4 (four kv heads, so the orders differ), ragged ends, a one-token sequence, several
    # key tiles per sequence
    lens = [(1, 1), (300, 300), (129, 520), (64, 64)]
    q, k, v, dout, cu_q, cu_k, arrays = varlen_inputs(rng, lens, 8, 4, d, dtype)
    arrays["win"] = np.array(window, dtype=np.int64)
    got = {}
    for order in ("heads", "kv"):
        env = dict(CUBEATTN_FWD_ORDER=order, CUBEATTN_BWD_ORDER=order, CUBEATTN_DQ_ORDER=order,
                   CUBEATTN_CACHE_DIR=cache_dir)
        got[order] = run_child(str(tmp_path / f"io-{order}.npz"), arrays, env, causal, True, dtype)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert got["heads"][name].tobytes() == got["kv"][name].tobytes(), name
    segs = varlen_segments(cu_q, cu_k)
    ref_out, _ = ref_attention(q, k, v, segs, causal, window=window)
    assert rel_err(got["kv"]["out"].astype(np.float64), ref_out) <= max(FWD_TOL[dtype][1], 2e-3)
    tol, rel = BWD_TOL[dtype]
    for name, want in zip(("dq", "dk", "dv"), ref_backward(q, k, v, dout, segs, causal, window=window)):
        g = got["kv"][name].astype(np.float64)
        assert np.all(np.isfinite(g)) and rel_err(g, want) <= rel, (name, rel_err(g, want))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_both_cube_orders_give_the_same_bits(tmp_path, cache_dir, d, causal):
    _same_bits_in_both_orders(tmp_path, cache_dir, d, causal, (-1, -1), 70 + d + causal)


# window calls go kv head outer on the warp-specialised frame (d128) once a launch has enough cubes
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window", [(False, (100, 37)), (True, (170, 0))])
def test_both_cube_orders_give_the_same_bits_with_a_window(tmp_path, cache_dir, d, causal, window):
    _same_bits_in_both_orders(tmp_path, cache_dir, d, causal, window, 90 + d + causal)
