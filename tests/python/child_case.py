"""A varlen forward + backward on the CUDA backend in a child process, for switches read once per
process (`CUBEATTN_CUDA_PORTABLE`, the cube-order switches, ...): the inputs go to the child and
the results come back through one .npz file."""
import os
import subprocess
import sys

import numpy as np

from conftest import rand

HERE = os.path.dirname(os.path.abspath(__file__))

# The child: forward + backward of the inputs in `path` (with their sliding window `win` where
# given), results back to `path` (out, dq, dk, dv as float32, exact for 16-bit values; lse as
# returned).
CHILD = """
import sys, numpy as np, cubeattn
from conftest import np_dtype
path, causal, det, dtype = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", sys.argv[4]
a = dict(np.load(path))
for n in ("q", "k", "v", "dout"):
    a[n] = a[n].astype(np_dtype(dtype))
args = (a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], int(a["mq"]), int(a["mk"]))
win = tuple(int(x) for x in a.get("win", (-1, -1)))
out, lse = cubeattn.flash_attn_varlen_func(*args, causal=causal, window_size=win, return_lse=True, device="cuda")
assert cubeattn.last_backend() == "cuda", cubeattn.last_backend()
dq, dk, dv = cubeattn.flash_attn_varlen_backward(a["dout"], *args[:3], out, lse, *args[3:], causal=causal,
                                                 window_size=win, deterministic=det, device="cuda")
np.savez(path, lse=lse, **{n: x.astype(np.float32) for n, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))})
"""


def varlen_inputs(rng, lens, hq, hkv, d, dtype):
    """Random q, k, v, dout of `dtype` for sequences of (q, k) lengths `lens` (hq / hkv heads), their
    cu_q / cu_k, and the arrays a child takes (float32 copies of the values, exact; the longest
    sequences)."""
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = rand(rng, (cu_q[-1], hq, d), dtype)
    k, v = rand(rng, (cu_k[-1], hkv, d), dtype), rand(rng, (cu_k[-1], hkv, d), dtype)
    dout = rand(rng, q.shape, dtype)
    arrays = dict(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32),
                  dout=dout.astype(np.float32), cu_q=cu_q, cu_k=cu_k, mq=max(a for a, _ in lens),
                  mk=max(b for _, b in lens))
    return q, k, v, dout, cu_q, cu_k, arrays


def run_child(path, arrays, env, causal, det, dtype):
    """Runs CHILD on `arrays` (written to `path`) with `env` added to this process's environment;
    returns its results."""
    np.savez(path, **arrays)
    r = subprocess.run([sys.executable, "-c", CHILD, path, str(int(causal)), str(int(det)), dtype],
                       env=dict(os.environ, **env), cwd=HERE, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(np.load(path))
