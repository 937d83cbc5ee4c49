"""The all-gather + cuDNN baseline's attention (cubeattn._lse_split, `bench zigzag`'s
``allgather_cudnn``): bottom-right causal attention of a query chunk over a longer key prefix from
the causal square and the non-causal prefix merged by log-sum-exp, forward and gradients, against
attention with the bottom-right mask in float64. On the CPU with torch's CPU flash op (the same
contract as the cuDNN op); on CUDA with the cuDNN op itself (marked `gpu`)."""
import pytest

torch = pytest.importorskip("torch")

from cubeattn import _lse_split  # noqa: E402


def reference(q, k, v, scale=None):
    """float64 SDPA with the bottom-right causal mask (GQA by repeating K,V heads)."""
    import torch.nn.functional as F

    c, e = q.shape[2], k.shape[2]
    g = q.shape[1] // k.shape[1]
    i = torch.arange(c)[:, None]
    j = torch.arange(e)[None, :]
    mask = j <= e - c + i
    return F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(g, 1),
                                          v.double().repeat_interleave(g, 1), attn_mask=mask, scale=scale)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(op, device, dtype, c, e, hq, hkv, d, scale=None, bound=(1e-5, 1e-4), seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, c, d, generator=gen)
    k, v = (torch.randn(1, hkv, e, d, generator=gen) for _ in range(2))
    dout = torch.randn(1, hq, c, d, generator=gen)
    xs = [x.to(dtype).to(device).requires_grad_() for x in (q, k, v)]
    out = _lse_split.lower_right_causal(*xs, op, scale=scale)
    out.backward(dout.to(dtype).to(device))
    rs = [x.detach().cpu().double().requires_grad_() for x in xs]
    ref = reference(*rs, scale=scale)
    ref.backward(dout.to(dtype).double())
    errs = {"out": rel(out.detach().cpu(), ref.detach())}
    for name, x, r in zip(("dq", "dk", "dv"), xs, rs):
        errs[name] = rel(x.grad.cpu(), r.grad)
    bad = {n: e for n, e in errs.items() if not e <= (bound[0] if n == "out" else bound[1])}
    assert not bad, (c, e, hq, hkv, d, errs)
    assert out.dtype == dtype and out.shape == (1, hq, c, d)


@pytest.mark.parametrize("c,e", [(37, 37), (37, 38), (16, 100), (1, 50), (64, 64 * 4)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_square_plus_prefix_is_bottom_right_causal_cpu(c, e, hq, hkv):
    check(_lse_split.CpuFlashOp(), "cpu", torch.float32, c, e, hq, hkv, 32)


def test_scale_and_bfloat16_cpu():
    check(_lse_split.CpuFlashOp(), "cpu", torch.float32, 20, 70, 2, 1, 16, scale=0.3)
    check(_lse_split.CpuFlashOp(), "cpu", torch.bfloat16, 48, 200, 4, 2, 64, bound=(1e-2, 2e-2))


def test_lse_merge_of_two_halves_is_attention_over_both():
    """Two disjoint key sets' (out, lse) merged = attention over their union (out and lse)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64) for n in (5, 30, 30))

    def attend(kk, vv):
        s = q @ kk.transpose(-1, -2) / 8 ** 0.5
        return torch.softmax(s, -1) @ vv, torch.logsumexp(s, -1)
    o1, l1 = attend(k[:, :, :11], v[:, :, :11])
    o2, l2 = attend(k[:, :, 11:], v[:, :, 11:])
    o, lse = _lse_split.lse_merge(o1, l1, o2, l2)
    want_o, want_l = attend(k, v)
    assert rel(o, want_o) < 1e-14 and rel(lse, want_l) < 1e-14


def test_more_queries_than_keys_is_refused():
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 4, 4)
    with pytest.raises(ValueError, match="`k`"):
        _lse_split.lower_right_causal(q, k, k, _lse_split.CpuFlashOp())


class FakeCudnn:
    """The cuDNN op's contract on the CPU (torch's CPU flash op inside): a 9-tuple forward with the
    lse as [B, H, S, 1] in a transposed layout, a backward that checks it gets that layout back,
    dout in out's layout and the forward's philox / cum_seq / max values, and (`gqa=False`) refuses
    K,V with fewer heads than q, as a cuDNN build without GQA does."""

    def __init__(self, gqa):
        self.gqa, self.calls = gqa, {"fwd": 0, "bwd": 0}

    def forward(self, q, k, v, bias, lse_wanted, p, causal, debug, scale=None):
        assert bias is None and lse_wanted and p == 0.0 and not debug
        if k.shape[1] != q.shape[1] and not self.gqa:
            raise RuntimeError("GQA is not supported")
        g = q.shape[1] // k.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), 0.0, causal, scale=scale)
        b, h, s = lse.shape
        lse = lse.transpose(1, 2).contiguous().transpose(1, 2).unsqueeze(-1)  # [B, H, S, 1], strides of [B, S, H]
        self.calls["fwd"] += 1
        return (out, lse, torch.tensor(7), torch.tensor(8), s, k.shape[2], torch.tensor(1), torch.tensor(2), None)

    def backward(self, dout, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, p, causal,
                 scale=None):
        assert dout.stride() == out.stride() and lse.shape[-1] == 1 and lse.stride()[1] == 1
        assert (seed.item(), offset.item(), cum_q.item(), cum_k.item()) == (1, 2, 7, 8)
        assert (max_q, max_k, bias, p) == (q.shape[2], k.shape[2], None, 0.0)
        if k.shape[1] != q.shape[1] and not self.gqa:
            raise RuntimeError("GQA is not supported")
        g = q.shape[1] // k.shape[1]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), out, lse.squeeze(-1), 0.0, causal,
            scale=scale)
        b, h, s, d = dk.shape
        self.calls["bwd"] += 1
        return dq, dk.view(b, h // g, g, s, d).sum(2), dv.view(b, h // g, g, s, d).sum(2)


@pytest.mark.parametrize("gqa", [True, False])
def test_cudnn_op_plumbing_cpu(gqa):
    """CudnnOp's calls (argument order, the forward's values handed to the backward, the lse and
    dout layouts, the GQA fallback) with the cuDNN op replaced by FakeCudnn."""
    op = _lse_split.CudnnOp()
    fake = FakeCudnn(gqa)
    op.fwd_op, op.bwd_op = fake.forward, fake.backward
    check(op, "cpu", torch.float32, 24, 90, 4, 2, 16)
    assert op.repeat == (not gqa) and fake.calls["fwd"] >= 2 and fake.calls["bwd"] >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")
@pytest.mark.parametrize("c,e,hq,hkv", [(512, 512, 8, 8), (512, 2048, 32, 8), (1000, 3000, 8, 2), (64, 4096, 4, 1)])
def test_cudnn_square_plus_prefix_is_bottom_right_causal(c, e, hq, hkv):
    """The cuDNN op (bf16, d128) against the float64 reference: the bench's allgather_cudnn
    attention, forward and gradients (skipped where this torch has no cuDNN attention)."""
    from torch.backends import cuda as bc

    if not bc.cudnn_sdp_enabled():
        pytest.skip("cuDNN SDPA is not enabled in this torch")
    check(_lse_split.CudnnOp(), "cuda", torch.bfloat16, c, e, hq, hkv, 128, bound=(1e-2, 2e-2))
