"""Calls near the CUDA kernels' 32-bit indexing bound (`backend::cuda::check_size`: rows x heads x
head_dim below 2^31; the bound was 2^30 before): causal forward and backward, fused and
deterministic dQ, d128 and d64, 1.93e9 elements of q and dq, against SDPA flash on the same
tensors. An index that wrapped would corrupt a whole region of the outputs (relative errors of
order 1, not 1e-3). Marked `gpu` (and `torch`); skipped without 80 GB of free GPU memory."""
import pytest

import cubeattn
from conftest import cuda_available

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch]

HQ, HKV = 32, 8


def _free_gb():
    if not (torch.cuda.is_available() and cuda_available()):
        return 0.0
    return torch.cuda.mem_get_info()[0] / 2**30


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.skipif(_free_gb() < 80, reason="needs a CUDA GPU with 80 GB free (the tensors take ~50 GB)")
@pytest.mark.parametrize("seq,d", [(470_000, 128), (940_000, 64)])
def test_calls_near_the_32_bit_bound_match_sdpa_flash(seq, d):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    assert seq * HQ * d < 2**31 <= 2 * seq * HQ * d  # above the old bound, below the new one
    g = torch.Generator(device="cuda").manual_seed(seq + d)

    def rnd(h):
        return torch.randn((seq, h, d), generator=g, device="cuda", dtype=torch.bfloat16)

    q, k, v, dout = rnd(HQ), rnd(HKV), rnd(HKV), rnd(HQ)
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0).requires_grad_(True) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
    ref.backward(dout.transpose(0, 1).unsqueeze(0))
    ref = ref.detach()[0].transpose(0, 1)
    refs = [x.grad[0].transpose(0, 1) for x in (q4, k4, v4)]
    del q4, k4, v4
    cu = torch.tensor([0, seq], dtype=torch.int32)
    for det in ([False, True] if d == 128 else [False]):
        qa, ka, va = (x.detach().requires_grad_(True) for x in (q, k, v))
        out = cubeattn.flash_attn_varlen_func(qa, ka, va, cu, cu, seq, seq, causal=True, deterministic=det, device="cuda")
        out.backward(dout)
        errs = [_rel(out, ref)] + [_rel(x.grad, r) for x, r in zip((qa, ka, va), refs)]
        assert max(errs) < 1e-2, (det, errs)
        del qa, ka, va, out
        torch.cuda.empty_cache()


@pytest.mark.skipif(_free_gb() < 16, reason="needs a CUDA GPU with 16 GB free")
def test_a_call_at_the_bound_is_refused_by_name():
    seq = 2**31 // (HQ * 128)  # rows x heads x head_dim == 2^31
    q = torch.zeros((seq, HQ, 128), device="cuda", dtype=torch.bfloat16)
    k = torch.zeros((seq, HKV, 128), device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, seq], dtype=torch.int32)
    with pytest.raises(ValueError, match="too large for 32-bit indexing"):
        cubeattn.flash_attn_varlen_func(q, k, k, cu, cu, seq, seq, causal=True, device="cuda")
