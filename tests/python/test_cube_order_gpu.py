"""The cube order of the Hopper launches (`CUBEATTN_FWD_ORDER`, `CUBEATTN_BWD_ORDER`: kv head outer or
heads fastest; the defaults pick one per call, docs/forward.md and docs/backward.md) moves only
which cube runs when: out, lse and the deterministic backward's gradients must be the same bits in
either order, and match the f64 reference (marked `gpu`). The switches are read once per process,
so each order runs in a child process."""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import BWD_TOL, FWD_TOL, rand, ref_attention, ref_backward, rel_err, varlen_segments

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))

# The child: forward + deterministic backward of the inputs in `path` on the CUDA backend, results
# back to `path` (their bits: float32 of 16-bit values is exact).
CHILD = """
import sys, numpy as np, cubeattn
from conftest import np_dtype
path, causal, dtype = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
a = dict(np.load(path))
for n in ("q", "k", "v", "dout"):
    a[n] = a[n].astype(np_dtype(dtype))
args = (a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], int(a["mq"]), int(a["mk"]))
out, lse = cubeattn.flash_attn_varlen_func(*args, causal=causal, return_lse=True, device="cuda")
assert cubeattn.last_backend() == "cuda", cubeattn.last_backend()
dq, dk, dv = cubeattn.flash_attn_varlen_backward(a["dout"], *args[:3], out, lse, *args[3:], causal=causal,
                                                 deterministic=True, device="cuda")
np.savez(path, lse=lse, **{n: x.astype(np.float32) for n, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))})
"""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    # one kernel cache for the module's children (the order is a launch argument, not a kernel key)
    return str(tmp_path_factory.mktemp("order-cache"))


def run_order(tmp_path, cache, arrays, causal, dtype, order):
    path = str(tmp_path / f"io-{order}.npz")
    np.savez(path, **arrays)
    env = dict(os.environ, CUBEATTN_FWD_ORDER=order, CUBEATTN_BWD_ORDER=order, CUBEATTN_CACHE_DIR=cache)
    r = subprocess.run([sys.executable, "-c", CHILD, path, str(int(causal)), dtype], env=env, cwd=HERE,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(np.load(path))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_both_cube_orders_give_the_same_bits(tmp_path, cache_dir, d, causal):
    dtype = "bfloat16"
    rng = np.random.default_rng(70 + d + causal)
    # GQA 8 / 4 (four kv heads, so the orders differ), ragged ends, a one-token sequence, several
    # key tiles per sequence
    lens = [(1, 1), (300, 300), (129, 520), (64, 64)]
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = rand(rng, (cu_q[-1], 8, d), dtype)
    k, v = rand(rng, (cu_k[-1], 4, d), dtype), rand(rng, (cu_k[-1], 4, d), dtype)
    dout = rand(rng, q.shape, dtype)
    arrays = dict(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32),
                  dout=dout.astype(np.float32), cu_q=cu_q, cu_k=cu_k, mq=300, mk=520)
    heads = run_order(tmp_path, cache_dir, arrays, causal, dtype, "heads")
    kv = run_order(tmp_path, cache_dir, arrays, causal, dtype, "kv")
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert heads[name].tobytes() == kv[name].tobytes(), name
    segs = varlen_segments(cu_q, cu_k)
    ref_out, _ = ref_attention(q, k, v, segs, causal)
    assert rel_err(kv["out"].astype(np.float64), ref_out) <= max(FWD_TOL[dtype][1], 2e-3)
    tol, rel = BWD_TOL[dtype]
    for name, want in zip(("dq", "dk", "dv"), ref_backward(q, k, v, dout, segs, causal)):
        g = kv[name].astype(np.float64)
        assert np.all(np.isfinite(g)) and rel_err(g, want) <= rel, (name, rel_err(g, want))
