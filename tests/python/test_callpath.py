"""The torch call path on CUDA tensors: calls are enqueued on torch's current stream (ordered with
torch work before and after them, no synchronization), read and write the caller's tensors in
place (peak memory = caller tensors + workspace), and can be captured in a CUDA graph. Marked
`gpu` and `torch`; skipped without both."""
import numpy as np
import pytest

import cubeattn
from conftest import cuda_available, ref_attention, ref_backward, rel_err, varlen_segments

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch,
              pytest.mark.skipif(not (torch.cuda.is_available() and cuda_available()), reason="needs a CUDA GPU")]


def f64(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def rand(gen, shape, dtype=torch.bfloat16):
    return (torch.rand(shape, generator=gen) * 2 - 1).to(dtype).cuda()


def test_ordered_on_a_side_stream_without_synchronize():
    """Inputs written by a torch kernel on a side stream right before the call (after a long GPU
    sleep, so a call on another stream would read the stale NaNs), output consumed right after."""
    gen = torch.Generator().manual_seed(11)
    b, s, hq, hkv, d = 2, 300, 8, 2, 128
    q0, k0, v0 = rand(gen, (b, s, hq, d)), rand(gen, (b, s, hkv, d)), rand(gen, (b, s, hkv, d))
    q, k, v = (torch.full_like(x, float("nan")) for x in (q0, k0, v0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        for dst, src in ((q, q0), (k, k0), (v, v0)):
            dst.copy_(src)
        out = cubeattn.flash_attn_func(q, k, v, causal=True)
        consumed = out.float() * 2.0
    torch.cuda.current_stream().wait_stream(side)
    got = f64(consumed) / 2.0
    cu = np.arange(b + 1, dtype=np.int32) * s
    ref, _ = ref_attention(f64(q0).reshape(b * s, hq, d), f64(k0).reshape(b * s, hkv, d),
                           f64(v0).reshape(b * s, hkv, d), varlen_segments(cu, cu), True)
    assert np.isfinite(got).all()
    assert rel_err(got.reshape(b * s, hq, d), ref) < 1e-2


def test_call_returns_before_the_gpu_finishes():
    """The call only enqueues: behind a long GPU sleep it returns while the stream is still busy."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = rand(gen, (1, 256, 4, 64)), rand(gen, (1, 256, 4, 64)), rand(gen, (1, 256, 4, 64))
    cubeattn.flash_attn_func(q, k, v, causal=True)  # plan and kernels cached
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    out = cubeattn.flash_attn_func(q, k, v, causal=True)
    assert not torch.cuda.current_stream().query(), "the call waited for the GPU"
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()


def test_peak_memory_is_outputs_plus_workspace():
    """No staging copies: torch's peak during a forward = out + lse + the estimate's workspace."""
    gen = torch.Generator().manual_seed(2)
    s, hq, hkv, d = 8192, 32, 8, 128
    q, k, v = rand(gen, (s, hq, d)), rand(gen, (s, hkv, d)), rand(gen, (s, hkv, d))
    cu = torch.tensor([0, s], dtype=torch.int32)
    cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    est = cubeattn.estimate_vram((s, hq, d), (s, hkv, d), "bfloat16", causal=True)
    want = est["outputs"] + est["lse"] + est["workspace"]
    assert out.shape == q.shape
    assert abs(peak - want) <= 0.10 * want, (peak, want, est)


def test_no_copy_kernels_in_a_profile():
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(4)
    q, k, v = (rand(gen, (1, 512, h, 128)).requires_grad_(True) for h in (8, 2, 2))
    cubeattn.flash_attn_func(q, k, v, causal=True).sum().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = cubeattn.flash_attn_func(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("flash_fwd" in n for n in names), names
    assert not [n for n in names if "Memcpy" in n and ("DtoD" in n or "HtoD" in n or "DtoH" in n)], names


def _step(q, k, v, g):
    out = cubeattn.flash_attn_func(q, k, v, causal=True, deterministic=True)
    out.backward(g)
    return out


def test_cuda_graph_captured_training_step_replays_correctly():
    gen = torch.Generator().manual_seed(9)
    b, s, hq, hkv, d = 1, 320, 4, 2, 64
    q, k, v = (rand(gen, (b, s, h, d)).requires_grad_(True) for h in (hq, hkv, hkv))
    g = rand(gen, (b, s, hq, d))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for t in (q, k, v):
                t.grad = None
            _step(q, k, v, g)
    torch.cuda.current_stream().wait_stream(side)
    for t in (q, k, v):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(q, k, v, g)
    for trial in range(2):
        new = [rand(gen, t.shape) for t in (q, k, v, g)]
        with torch.no_grad():
            for dst, src in zip((q, k, v, g), new):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        cu = np.arange(b + 1, dtype=np.int32) * s
        segs = varlen_segments(cu, cu)
        flat = [f64(x).reshape(b * s, x.shape[2], d) for x in new]
        ref_out, _ = ref_attention(*flat[:3], segs, True)
        ref = ref_backward(*flat, segs, True)
        assert rel_err(f64(out).reshape(b * s, hq, d), ref_out) < 1e-2, trial
        for t, want in zip((q, k, v), ref):
            assert rel_err(f64(t.grad).reshape(want.shape), want) < 2e-2, trial


def test_new_shape_during_capture_is_a_clear_error():
    gen = torch.Generator().manual_seed(1)
    q, k, v = rand(gen, (1, 77, 4, 64)), rand(gen, (1, 77, 2, 64)), rand(gen, (1, 77, 2, 64))
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(Exception, match="capture"):
        with torch.cuda.graph(graph):
            cubeattn.flash_attn_func(q, k, v, causal=False)


def test_repeated_batched_call_takes_the_cached_path_and_stays_exact():
    """The second identical batched call skips the validating layers (cached spec); its result
    equals the first call's bit for bit and the reference; any change of shape, option,
    contiguity or autograd goes back through the validating path."""
    gen = torch.Generator().manual_seed(21)
    b, s, hq, hkv, d = 2, 200, 8, 2, 128
    q, k, v = rand(gen, (b, s, hq, d)), rand(gen, (b, s, hkv, d)), rand(gen, (b, s, hkv, d))
    cubeattn._FAST.clear()
    first = cubeattn.flash_attn_func(q, k, v, causal=True)
    assert len(cubeattn._FAST) == 1
    again = cubeattn.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(first, again) and again.shape == q.shape
    cu = np.arange(b + 1) * s
    flat = [f64(x).reshape(b * s, x.shape[2], d) for x in (q, k, v)]
    ref, _ = ref_attention(*flat, varlen_segments(cu, cu), True)
    assert rel_err(f64(again).reshape(ref.shape), ref) < 1e-2
    # other options and shapes: new entries, each correct
    full = cubeattn.flash_attn_func(q, k, v, causal=False)
    ref_full, _ = ref_attention(*flat, varlen_segments(cu, cu), False)
    assert rel_err(f64(full).reshape(ref.shape), ref_full) < 1e-2
    half = cubeattn.flash_attn_func(q[:, :100].contiguous(), k[:, :100].contiguous(), v[:, :100].contiguous(), causal=True)
    assert half.shape == (b, 100, hq, d)
    assert len(cubeattn._FAST) == 3
    # a non-contiguous view of the same shape: the validating path (contiguous copy), same values
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous()
    assert torch.equal(cubeattn.flash_attn_func(qt, k, v, causal=True), first)
    # requires_grad: autograd, not the cached forward
    qg = q.clone().requires_grad_()
    out = cubeattn.flash_attn_func(qg, k, v, causal=True)
    assert out.requires_grad and torch.equal(out.detach(), first)
    out.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


def test_repeated_autograd_call_takes_the_cached_path_with_exact_gradients():
    """A repeated batched call whose inputs require grad: the first goes through the validating
    path and records its spec, the next ones take the cached device path through autograd
    (`_fast_forward`). Deterministic gradients equal the first call's bit for bit, both modes
    match the f64 reference, a non-contiguous dout gives the same gradients, and a bad
    `deterministic` raises on a repeat as on the first call."""
    gen = torch.Generator().manual_seed(23)
    b, s, hq, hkv, d = 2, 333, 8, 2, 128
    base = [rand(gen, (b, s, h, d)) for h in (hq, hkv, hkv)]
    dout = rand(gen, (b, s, hq, d))
    cu = np.arange(b + 1) * s
    flat = [f64(x).reshape(b * s, x.shape[2], d) for x in base]
    ref_out, _ = ref_attention(*flat, varlen_segments(cu, cu), True)
    ref = ref_backward(*flat, f64(dout).reshape(b * s, hq, d), varlen_segments(cu, cu), True)

    def step(det, g=dout):
        q, k, v = (x.clone().requires_grad_() for x in base)
        out = cubeattn.flash_attn_func(q, k, v, causal=True, deterministic=det)
        out.backward(g)
        return out.detach(), q.grad, k.grad, v.grad

    cubeattn._FAST.clear()
    first = step(True)
    assert len(cubeattn._FAST) == 1, "the autograd call did not record its spec"
    calls = []
    real = cubeattn._enqueue_forward
    cubeattn._enqueue_forward = lambda *a: calls.append(1) or real(*a)
    try:
        again = step(True)
        assert calls, "the repeated autograd call did not take the cached path"
        for x, y in zip(first, again):
            assert torch.equal(x, y)
        for det in (True, False):
            out, dq, dk, dv = step(det)
            assert rel_err(f64(out).reshape(ref_out.shape), ref_out) < 1e-2
            for t, want in zip((dq, dk, dv), ref):
                assert rel_err(f64(t).reshape(want.shape), want) < 2e-2, det
        # a non-contiguous dout (same values): copied for the kernels, the same gradients
        strided = dout.transpose(1, 2).contiguous().transpose(1, 2)
        assert not strided.is_contiguous()
        for x, y in zip(step(True, strided), first):
            assert torch.equal(x, y)
    finally:
        cubeattn._enqueue_forward = real
    q, k, v = (x.clone().requires_grad_() for x in base)
    with pytest.raises(TypeError, match="deterministic"):
        cubeattn.flash_attn_func(q, k, v, causal=True, deterministic="yes")
    with torch.no_grad(), pytest.raises(TypeError, match="deterministic"):
        cubeattn.flash_attn_func(*base, causal=True, deterministic="yes")
