"""GPU out-of-memory: a call that cannot fit raises MemoryError naming the bytes needed and free,
the process stays usable and the next call that fits succeeds. Marked `gpu` and `torch` (torch
fills the card); skipped without both."""
import numpy as np
import pytest

import cubeattn
from conftest import cuda_available

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch,
              pytest.mark.skipif(not (torch.cuda.is_available() and cuda_available()), reason="needs a CUDA GPU")]


def test_out_of_memory_is_memory_error_and_recoverable():
    rng = np.random.default_rng(0)
    small = [rng.uniform(-1, 1, (256, h, 64)).astype(np.float16) for h in (4, 2, 2)]
    cubeattn.flash_attn_func(*[x[None] for x in small], causal=True, device="cuda")
    # fill the card, leaving ~64 MiB
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = []
    chunk = 1 << 30
    while free > chunk + (64 << 20):
        hog.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        free, _ = torch.cuda.mem_get_info()
    while free > (96 << 20):
        hog.append(torch.empty(16 << 20, dtype=torch.uint8, device="cuda"))
        free, _ = torch.cuda.mem_get_info()
    s = 16384  # q, k, v, out of this shape take ~400 MiB: cannot fit
    big = [rng.uniform(-1, 1, (1, s, h, 128)).astype(np.float16) for h in (32, 8, 8)]
    with pytest.raises(MemoryError, match="bytes"):
        cubeattn.flash_attn_func(*big, causal=True, device="cuda")
    del hog
    torch.cuda.empty_cache()
    out = cubeattn.flash_attn_func(*big, causal=True, device="cuda")
    assert out.shape == big[0].shape and np.isfinite(out.astype(np.float32)).all()
