"""The kernels as built for GPUs below sm_90 (`CUBEATTN_CUDA_PORTABLE=1`: cp.async in place of
tensor maps and bulk copies, scalar dQ atomics, the `test_wait` spin, P / dS stores without
`stmatrix`; with `CUBEATTN_BWD_Q_STAGES=1` also the one-stage dK/dV kernel of GPUs with less shared
memory), run on whatever GPU is present (marked `gpu`). The switch is read once per process, so
each case runs in a child process; its results are checked here against the f64 reference."""
import numpy as np
import pytest

from child_case import run_child, varlen_inputs
from conftest import BWD_TOL, FWD_TOL, ref_attention, ref_backward, rel_err, varlen_segments

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    # one kernel cache for the module's children (the portable kernels have their own cache keys)
    return str(tmp_path_factory.mktemp("portable-cache"))


def run_portable(tmp_path, cache, arrays, causal, det, one_stage):
    env = dict(CUBEATTN_CUDA_PORTABLE="1", CUBEATTN_CACHE_DIR=cache)
    if one_stage:
        env["CUBEATTN_BWD_Q_STAGES"] = "1"
    return run_child(str(tmp_path / "io.npz"), arrays, env, causal, det, "bfloat16")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("det", [False, True])
@pytest.mark.parametrize("one_stage", [False, True])
def test_pre_sm90_kernels_match_the_f64_reference(tmp_path, cache_dir, d, causal, det, one_stage):
    """`one_stage`: the dK/dV kernel with one query-tile stage, what GPUs with less shared memory
    per block get (an A100 at d128)."""
    # full 64-row tiles, ragged ends, a one-token sequence; GQA 4 / 2; more than one 128-key tile
    dtype = "bfloat16"
    rng = np.random.default_rng(40 + d + 2 * causal + det + 4 * one_stage)
    lens = [(1, 1), (130, 300), (64, 64), (257, 190)]
    q, k, v, dout, cu_q, cu_k, arrays = varlen_inputs(rng, lens, 4, 2, d, dtype)
    got = run_portable(tmp_path, cache_dir, arrays, causal, det, one_stage)
    segs = varlen_segments(cu_q, cu_k)
    ref_out, _ = ref_attention(q, k, v, segs, causal)
    assert rel_err(got["out"].astype(np.float64), ref_out) <= max(FWD_TOL[dtype][1], 2e-3)
    tol, rel = BWD_TOL[dtype]
    for name, want in zip(("dq", "dk", "dv"), ref_backward(q, k, v, dout, segs, causal)):
        g = got[name].astype(np.float64)
        assert g.shape == want.shape and np.all(np.isfinite(g)), name
        assert rel_err(g, want) <= rel, (name, rel_err(g, want))
        np.testing.assert_allclose(g, want, atol=tol, rtol=tol, err_msg=name)
