"""The kernels as built for GPUs below sm_90 (`CUBEATTN_CUDA_PORTABLE=1`: cp.async in place of
tensor maps and bulk copies, scalar dQ atomics, the `test_wait` spin, P / dS stores without
`stmatrix`; with `CUBEATTN_BWD_Q_STAGES=1` also the one-stage dK/dV kernel of GPUs with less shared
memory), run on whatever GPU is present (marked `gpu`). The switch is read once per process, so
each case runs in a child process; its results are checked here against the f64 reference."""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import BWD_TOL, FWD_TOL, rand, ref_attention, ref_backward, rel_err, varlen_segments

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))

# The child: forward + backward of the inputs in `path` on the CUDA backend, results back to `path`.
CHILD = """
import sys, numpy as np, cubeattn
from conftest import np_dtype
path, causal, det = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
a = dict(np.load(path))
for n in ("q", "k", "v", "dout"):
    a[n] = a[n].astype(np_dtype("bfloat16"))
args = (a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], int(a["mq"]), int(a["mk"]))
out, lse = cubeattn.flash_attn_varlen_func(*args, causal=causal, return_lse=True, device="cuda")
assert cubeattn.last_backend() == "cuda", cubeattn.last_backend()
dq, dk, dv = cubeattn.flash_attn_varlen_backward(a["dout"], *args[:3], out, lse, *args[3:], causal=causal,
                                                 deterministic=det, device="cuda")
np.savez(path, **{n: x.astype(np.float32) for n, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))})
"""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    # one kernel cache for the module's children (the portable kernels have their own cache keys)
    return str(tmp_path_factory.mktemp("portable-cache"))


def run_portable(tmp_path, cache, arrays, causal, det, one_stage):
    path = str(tmp_path / "io.npz")
    np.savez(path, **arrays)
    env = dict(os.environ, CUBEATTN_CUDA_PORTABLE="1", CUBEATTN_CACHE_DIR=cache)
    if one_stage:
        env["CUBEATTN_BWD_Q_STAGES"] = "1"
    r = subprocess.run([sys.executable, "-c", CHILD, path, str(int(causal)), str(int(det))], env=env, cwd=HERE,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(np.load(path))


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
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = rand(rng, (cu_q[-1], 4, d), dtype)
    k, v = rand(rng, (cu_k[-1], 2, d), dtype), rand(rng, (cu_k[-1], 2, d), dtype)
    dout = rand(rng, q.shape, dtype)
    # float32 copies of the bf16 values (exact); the child rounds them back to bf16
    arrays = dict(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32),
                  dout=dout.astype(np.float32), cu_q=cu_q, cu_k=cu_k, mq=257, mk=300)
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
