"""torch tensors in and out, and autograd (marked `torch`; skipped where torch is not installed).
CPU tensors everywhere; CUDA tensors too when torch and the CUDA backend both see a GPU."""
import numpy as np
import pytest

import cubeattn
from conftest import BWD_TOL, FWD_TOL, cuda_available, grouped_segments, hopper, ref_attention, ref_backward, rel_err, varlen_segments

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

TDT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and cuda_available() else [])


def rand_t(gen, shape, dtype, device):
    x = torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1
    return x.to(TDT[dtype]).to(device).requires_grad_(True)


def f64(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 32, 96])
def test_varlen_autograd_matches_f64_reference(device, dtype, causal, d):
    gen = torch.Generator().manual_seed(7 + causal + d)
    lens = [(1, 1), (37, 70), (64, 64)]
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = rand_t(gen, (int(cu_q[-1]), 4, d), dtype, device)
    k = rand_t(gen, (int(cu_k[-1]), 2, d), dtype, device)
    v = rand_t(gen, (int(cu_k[-1]), 2, d), dtype, device)
    out = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 70, causal=causal, device=device)
    assert isinstance(out, torch.Tensor) and out.grad_fn is not None
    assert out.device.type == device and out.dtype == TDT[dtype] and out.shape == q.shape
    dout = (torch.rand(out.shape, generator=gen) * 2 - 1).to(out.dtype).to(device)
    out.backward(dout)
    segs = varlen_segments(cu_q, cu_k)
    ref_out, _ = ref_attention(f64(q), f64(k), f64(v), segs, causal)
    ref = ref_backward(f64(q), f64(k), f64(v), f64(dout), segs, causal)
    assert rel_err(f64(out), ref_out) <= max(FWD_TOL[dtype][1], 2e-3)
    tol, rel = BWD_TOL[dtype]
    for t, want in zip((q, k, v), ref):
        assert t.grad is not None and t.grad.dtype == t.dtype and t.grad.device == t.device
        assert rel_err(f64(t.grad), want) <= rel, rel_err(f64(t.grad), want)
        np.testing.assert_allclose(f64(t.grad), want, atol=tol * 5, rtol=tol * 5)


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_equals_explicit_backward(device):
    gen = torch.Generator().manual_seed(3)
    n, d = 90, 64
    q, k, v = (rand_t(gen, (n, h, d), "float32", device) for h in (4, 2, 2))
    cu = np.array([0, n], np.int32)
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True, return_lse=True,
                                               device=device, deterministic=True)
    assert lse.grad_fn is None and not lse.requires_grad
    dout = torch.rand(out.shape, generator=gen).to(device)
    out.backward(dout)
    dq, dk, dv = cubeattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, n, n, causal=True,
                                                     deterministic=True, device=device)
    for t, g in zip((q, k, v), (dq, dk, dv)):
        assert torch.equal(t.grad, g)


@pytest.mark.parametrize("device", DEVICES)
def test_batched_autograd_and_non_contiguous_grad(device):
    gen = torch.Generator().manual_seed(5)
    b, s, d = 2, 48, 64
    q = rand_t(gen, (b, s, 4, d), "float32", device)
    k = rand_t(gen, (b, s, 1, d), "float32", device)
    v = rand_t(gen, (b, s, 1, d), "float32", device)
    out = cubeattn.flash_attn_func(q, k, v, causal=True, device=device)
    assert out.shape == q.shape
    # a loss whose gradient reaches `out` non-contiguous (through a transpose)
    w = torch.rand(b, 4, s, d, generator=gen).to(device)
    (out.transpose(1, 2) * w).sum().backward()
    dout = w.transpose(1, 2)
    for i in range(b):
        seg = [(0, s, 0, s)]
        ref = ref_backward(f64(q[i]), f64(k[i]), f64(v[i]), f64(dout[i]), seg, True)
        for t, want in zip((q, k, v), ref):
            assert rel_err(f64(t.grad[i]), want) <= 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_autograd_accumulates_dk_dv(device):
    gen = torch.Generator().manual_seed(11)
    d, tk = 64, 120
    q_ranges = np.array([[0, 30], [30, 31], [31, 80]], np.int32)
    kv_ranges = np.array([[0, 60], [10, 11], [20, 120]], np.int32)
    q = rand_t(gen, (80, 2, d), "float32", device)
    k = rand_t(gen, (tk, 2, d), "float32", device)
    v = rand_t(gen, (tk, 2, d), "float32", device)
    out = cubeattn.grouped_flash_attn_func(q, k, v, q_ranges, kv_ranges, causal=True, device=device)
    dout = torch.rand(out.shape, generator=gen).to(device)
    out.backward(dout)
    segs = grouped_segments(q_ranges, kv_ranges)
    ref = ref_backward(f64(q), f64(k), f64(v), f64(dout), segs, True)
    for t, want in zip((q, k, v), ref):
        assert rel_err(f64(t.grad), want) <= 1e-4


def test_no_grad_and_plain_tensors_give_plain_outputs():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.rand(16, 2, 64, generator=gen) for _ in range(3))
    cu = np.array([0, 16], np.int32)
    out = cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, 16, 16, device="cpu")
    assert isinstance(out, torch.Tensor) and out.grad_fn is None
    with torch.no_grad():
        out2 = cubeattn.flash_attn_varlen_func(q.requires_grad_(True), k, v, cu, cu, 16, 16, device="cpu")
    assert out2.grad_fn is None
    assert torch.equal(out, out2)
    ref, _ = ref_attention(f64(q), f64(k), f64(v), [(0, 16, 0, 16)], False)
    assert rel_err(f64(out), ref) <= 1e-5


def test_mixing_numpy_with_grad_tensors_is_a_type_error():
    q = torch.rand(8, 2, 64, requires_grad=True)
    k = np.random.default_rng(0).random((8, 2, 64), dtype=np.float32)
    cu = np.array([0, 8], np.int32)
    with pytest.raises(TypeError, match="`k`"):
        cubeattn.flash_attn_varlen_func(q, k, k, cu, cu, 8, 8, device="cpu")


def test_torch_bad_dtype_names_the_argument():
    q = torch.zeros(8, 2, 64, dtype=torch.float64)
    cu = np.array([0, 8], np.int32)
    with pytest.raises(TypeError, match="`q`"):
        cubeattn.flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, device="cpu")


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and cuda_available()),
                    reason="needs two CUDA GPUs")
def test_torch_tensors_on_the_second_gpu_compute_there():
    """A torchrun rank's tensors live on cuda:N; the kernels must run on that GPU, not on GPU 0."""
    gen = torch.Generator().manual_seed(2)
    dev = torch.device("cuda:1")
    q, k, v = (rand_t(gen, (512, h, 128), "bfloat16", dev) for h in (8, 2, 2))
    torch.cuda.synchronize(0), torch.cuda.synchronize(1)
    free0, free1 = torch.cuda.mem_get_info(0)[0], torch.cuda.mem_get_info(1)[0]
    cu = np.array([0, 512], np.int32)
    out = cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, 512, 512, causal=True)
    assert cubeattn.last_backend() == "cuda" and out.device == dev
    out.float().sum().backward()
    used0 = free0 - torch.cuda.mem_get_info(0)[0]
    used1 = free1 - torch.cuda.mem_get_info(1)[0]
    # CubeCL's memory pool reserves on the device it runs on (torch's own tensors are already there)
    assert used1 > used0, (used0, used1)
    assert q.grad is not None and q.grad.device == dev
    ref = ref_backward(f64(q), f64(k), f64(v), np.ones(q.shape), [(0, 512, 0, 512)], True)
    assert rel_err(f64(q.grad), ref[0]) <= 2e-2


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs torch with CUDA and the CUDA backend")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_tensors_stay_on_the_device_and_match_the_host_path(causal, monkeypatch):
    """CUDA tensors go device-to-device (no host round trip); the results are the host path's,
    bit for bit (same kernels, deterministic backward)."""
    gen = torch.Generator().manual_seed(21)
    cu = np.array([0, 100, 300], np.int32)
    q = rand_t(gen, (300, 8, 128), "bfloat16", "cuda")
    k = rand_t(gen, (300, 2, 128), "bfloat16", "cuda")
    v = rand_t(gen, (300, 2, 128), "bfloat16", "cuda")
    dout = (torch.rand(q.shape, generator=gen) * 2 - 1).to(torch.bfloat16).cuda()

    def run():
        out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, 200, 200, causal=causal, return_lse=True,
                                                   deterministic=True)
        assert cubeattn.last_backend() == "cuda" and out.is_cuda and lse.is_cuda
        grads = torch.autograd.grad(out, (q, k, v), dout)
        return out.detach(), lse, grads

    dev_out, dev_lse, dev_g = run()
    monkeypatch.setenv("CUBEATTN_TORCH_HOST_COPY", "1")
    host_out, host_lse, host_g = run()
    assert torch.equal(dev_out, host_out) and torch.equal(dev_lse, host_lse)
    for a, b in zip(dev_g, host_g):
        assert torch.equal(a, b)
    ref = ref_backward(f64(q), f64(k), f64(v), f64(dout), varlen_segments(cu, cu), causal)
    for g, want in zip(dev_g, ref):
        assert rel_err(f64(g), want) <= BWD_TOL["bfloat16"][1]


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs torch with CUDA and the CUDA backend")
def test_cuda_backward_checks_out_and_dout_shapes():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (rand_t(gen, (64, 2, 64), "float16", "cuda") for _ in range(3))
    cu = np.array([0, 64], np.int32)
    out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, return_lse=True)
    bad = torch.zeros(63, 2, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="`dout`"):
        cubeattn.flash_attn_varlen_backward(bad, q, k, v, out, lse, cu, cu, 64, 64)
    with pytest.raises(TypeError, match="`out`"):
        cubeattn.flash_attn_varlen_backward(out, q, k, v, out.float(), lse, cu, cu, 64, 64)


def _shifted_copy(t, off):
    """A contiguous CUDA tensor with t's values whose address is `off` elements past an
    allocation's start (not 16-byte aligned for an odd `off`)."""
    flat = torch.empty(t.numel() + off, dtype=t.dtype, device=t.device)
    out = flat[off:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs torch with CUDA and the CUDA backend")
@pytest.mark.parametrize("which", ["q", "k", "v", "dout"])
def test_cuda_inputs_off_16_byte_alignment_give_the_aligned_results(which):
    """A contiguous view at an odd element offset (its address off 16 bytes) used to fault inside
    the kernels' 16-byte copies and kill the CUDA context; it must give exactly what the same
    values at an aligned address give: dense (autograd, then a repeat without grad: the cached
    fast path) and block-sparse."""
    gen = torch.Generator().manual_seed(11)
    n, d = 200, 128
    base = {nm: (torch.rand((n, h, d), generator=gen) * 2 - 1).to(torch.bfloat16).cuda() for nm, h in
            (("q", 4), ("k", 2), ("v", 2), ("dout", 4))}
    cu = np.array([0, n], np.int32)

    def dense(x):
        q, k, v = (x[nm].detach().requires_grad_(True) for nm in ("q", "k", "v"))
        out = cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True, deterministic=True)
        out.backward(x["dout"])
        with torch.no_grad():
            again = cubeattn.flash_attn_varlen_func(x["q"], x["k"], x["v"], cu, cu, n, n, causal=True)
        return [out, again, q.grad, k.grad, v.grad]

    def sparse(x):
        q, k, v = (x[nm].detach().requires_grad_(True) for nm in ("q", "k", "v"))
        ix = np.zeros((1, 4, 4, 2), np.int32)  # key block 0 and the diagonal block of each query block
        ix[..., 1] = np.where(np.arange(4) > 0, np.arange(4), -1)[None, None, :]
        out = cubeattn.block_sparse_attn_func(q, k, v, ix, 64, 64, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                              max_seqlen_q=n, max_seqlen_k=n, deterministic=True)
        out.backward(x["dout"])
        return [out, q.grad, k.grad, v.grad]

    for off in (1, 3):
        moved = dict(base)
        moved[which] = _shifted_copy(base[which], off)
        assert moved[which].is_contiguous() and moved[which].data_ptr() % 16 != 0
        for f in (dense, sparse):
            for got, want in zip(f(moved), f(base)):
                assert torch.equal(got, want), (which, off, f.__name__)
    torch.cuda.synchronize()


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs torch with CUDA and the CUDA backend")
def test_cuda_tensors_the_cuda_backend_refuses_run_on_the_cpu_with_a_warning():
    """float32 head_dim 160 runs forward on CUDA (padded to the d192 row-wise kernels) but has no
    CUDA backward on any GPU (above 128 the backward is the Hopper kernel, float16 / bfloat16):
    device="auto" computes the backward on the CPU backend (correct gradients, on the inputs'
    device) and says so with a RuntimeWarning naming the reason; device="cuda" raises instead. A
    call the kernels serve warns nothing."""
    import warnings

    gen = torch.Generator().manual_seed(5)
    n = 70
    q, k, v = (rand_t(gen, (n, h, 160), "float32", "cuda") for h in (4, 2, 2))
    cu = np.array([0, n], np.int32)
    segs = varlen_segments(cu, cu)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True)
    assert cubeattn.last_backend() == "cuda"
    ref, _ = ref_attention(f64(q), f64(k), f64(v), segs, True)
    assert rel_err(f64(out), ref) <= FWD_TOL["float32"][1]
    dout = torch.rand(out.shape, generator=gen).to("cuda") * 2 - 1
    with pytest.warns(RuntimeWarning, match="CPU backend: .*head_dim 160"):
        out.backward(dout)
    assert q.grad is not None and q.grad.device.type == "cuda"
    for t, want in zip((q, k, v), ref_backward(f64(q), f64(k), f64(v), f64(dout), segs, True)):
        assert rel_err(f64(t.grad), want) <= BWD_TOL["float32"][1]
    q1, k1, v1 = (x.detach().requires_grad_() for x in (q, k, v))
    out1 = cubeattn.flash_attn_varlen_func(q1, k1, v1, cu, cu, n, n, causal=True, device="cuda")
    with pytest.raises(ValueError, match="head_dim 160"):
        out1.backward(dout)
    q2, k2, v2 = (rand_t(gen, (n, h, 128), "bfloat16", "cuda") for h in (4, 2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cubeattn.flash_attn_varlen_func(q2, k2, v2, cu, cu, n, n, causal=True).backward(torch.ones(n, 4, 128, device="cuda"))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs torch with CUDA and the CUDA backend")
@pytest.mark.parametrize("d", [40, 80, 112, 160, 192, 224, 256])
def test_head_dims_forward_and_backward(d):
    """Head dims besides 64 / 128: the forward runs on the CUDA kernels (no warning), at 40, 80,
    112, 160 and 224 on the next kernel head dim with zero columns (`backend::cuda::head_pad`);
    above 128 the backward runs on the Hopper kernel (`flash_bwd_sm90_split`; deterministic=True:
    without dQ, then the dQ pass), and where no CUDA kernel serves it (a GPU below sm_90) on the
    CPU backend under device="auto" with a RuntimeWarning naming head_dim, raising under
    device="cuda"; every gradient matches the f64 reference."""
    import warnings

    gen = torch.Generator().manual_seed(d)
    lens = [(1, 1), (37, 70), (130, 130), (64, 300)]
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = rand_t(gen, (int(cu_q[-1]), 4, d), "bfloat16", "cuda")
    k, v = (rand_t(gen, (int(cu_k[-1]), 2, d), "bfloat16", "cuda") for _ in range(2))
    segs = varlen_segments(cu_q, cu_k)
    dout = None
    ref = None
    rel = BWD_TOL["bfloat16"][1]
    for deterministic in (False, True):
        q1, k1, v1 = (x.detach().requires_grad_() for x in (q, k, v))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = cubeattn.flash_attn_varlen_func(q1, k1, v1, cu_q, cu_k, 130, 300, causal=True, deterministic=deterministic)
        assert cubeattn.last_backend() == "cuda"
        if dout is None:
            dout = (torch.rand(out.shape, generator=gen) * 2 - 1).to(out.dtype).to("cuda")
            ref_out, _ = ref_attention(f64(q), f64(k), f64(v), segs, True)
            assert rel_err(f64(out), ref_out) <= 2e-3
            ref = ref_backward(f64(q), f64(k), f64(v), f64(dout), segs, True)
        on_cuda = hopper() or d <= 128
        if on_cuda:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                out.backward(dout)
        else:
            # (autograd runs the backward in its own thread: `last_backend` is this thread's forward)
            with pytest.warns(RuntimeWarning, match=f"head_dim {d}"):
                out.backward(dout)
        for t, want in zip((q1, k1, v1), ref):
            assert t.grad.device.type == "cuda" and rel_err(f64(t.grad), want) <= rel, (deterministic, t.shape)
        if not on_cuda:
            q2, k2, v2 = (x.detach().requires_grad_() for x in (q, k, v))
            out2 = cubeattn.flash_attn_varlen_func(q2, k2, v2, cu_q, cu_k, 130, 300, causal=True,
                                                   deterministic=deterministic, device="cuda")
            with pytest.raises(ValueError, match=f"head_dim {d}"):
                out2.backward(dout)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("d,dv", [(192, 128), (64, 96), (40, 24)])
def test_v_with_a_head_dim_of_its_own(device, dtype, d, dv):
    """v with its own head_dim (DeepSeek's MLA: q, k 192 and v 128; v wider than q; both off the
    kernels' head dims): out has v's head_dim, the scale is q's 1/sqrt(d), and out, lse and every
    gradient (autograd, varlen, GQA, causal; the batched call; the explicit backward) match the
    f64 reference. Where CUDA has no backward for the call (f32 above head_dim 128, or a GPU below
    sm_90 there) it runs on the CPU with a RuntimeWarning."""
    import warnings

    # f32 above head_dim 128 (or a GPU below sm_90 there): no CUDA backward; "auto" runs it on the CPU
    cpu_bwd = device == "cuda" and max(d, dv) > 128 and (dtype == "float32" or not hopper())
    call_dev = "auto" if cpu_bwd else device
    gen = torch.Generator().manual_seed(d + dv)
    lens = [(1, 1), (37, 70), (64, 64)]
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = rand_t(gen, (int(cu_q[-1]), 4, d), dtype, device)
    k = rand_t(gen, (int(cu_k[-1]), 2, d), dtype, device)
    v = rand_t(gen, (int(cu_k[-1]), 2, dv), dtype, device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 70, causal=True, return_lse=True,
                                                   device=call_dev)
    assert cubeattn.last_backend() == device
    assert out.shape == (q.shape[0], 4, dv) and out.dtype == q.dtype and out.device.type == device
    segs = varlen_segments(cu_q, cu_k)
    ref_out, ref_lse = ref_attention(f64(q), f64(k), f64(v), segs, True)
    fwd_rel = max(FWD_TOL[dtype][1], 2e-3)
    assert rel_err(f64(out), ref_out) <= fwd_rel
    np.testing.assert_allclose(f64(lse), ref_lse, rtol=1e-3, atol=1e-3)
    dout = (torch.rand(out.shape, generator=gen) * 2 - 1).to(out.dtype).to(device)
    if cpu_bwd:
        with pytest.warns(RuntimeWarning, match="CPU backend"):
            out.backward(dout)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out.backward(dout)
    ref = ref_backward(f64(q), f64(k), f64(v), f64(dout), segs, True)
    rel = BWD_TOL[dtype][1]
    for t, want in zip((q, k, v), ref):
        assert t.grad.shape == t.shape and t.grad.device == t.device
        assert rel_err(f64(t.grad), want) <= rel, (t.shape, rel_err(f64(t.grad), want))
    # the explicit backward agrees with autograd's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grads = cubeattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 64, 70, causal=True,
                                                    deterministic=True, device=call_dev)
    if cpu_bwd:
        # device="cuda" refuses instead, naming both head dims
        with pytest.raises(ValueError, match=f"head_dim {d} \\(v: {dv}\\)"):
            cubeattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 64, 70, causal=True,
                                                device="cuda")
    for g, want in zip(grads, ref):
        assert rel_err(f64(g), want) <= rel
    # out / dout in q's shape (the old convention) is refused naming the argument
    with pytest.raises(ValueError, match="`dout`.*v's head_dim"):
        cubeattn.flash_attn_varlen_backward(torch.zeros(q.shape, dtype=q.dtype, device=device), q, k, v, out, lse,
                                            cu_q, cu_k, 64, 70, causal=True, device=device)
    # batched layout: [batch, seqlen, heads, dv] out
    qb, kb, vb = (x.detach()[:40].reshape(2, 20, *x.shape[1:]) for x in (q, k, v))
    with torch.no_grad():
        ob = cubeattn.flash_attn_func(qb, kb, vb, causal=True, device=device)
    assert ob.shape == (2, 20, 4, dv)
    flat = [f64(x.reshape(40, *x.shape[2:])) for x in (qb, kb, vb)]
    cu = np.array([0, 20, 40], np.int32)
    want, _ = ref_attention(*flat, varlen_segments(cu, cu), True)
    assert rel_err(f64(ob).reshape(want.shape), want) <= fwd_rel


def test_v_of_another_token_count_or_heads_is_refused_naming_v():
    q = torch.zeros(8, 4, 64)
    cu = np.array([0, 8], np.int32)
    for v in (torch.zeros(8, 3, 32), torch.zeros(7, 2, 32), torch.zeros(8, 2, 257)):
        with pytest.raises(ValueError, match="`v`"):
            cubeattn.flash_attn_varlen_func(q, torch.zeros(8, 2, 64), v, cu, cu, 8, 8, device="cpu")
    # paged K,V take one head_dim
    with pytest.raises(ValueError, match="`v`"):
        cubeattn.grouped_flash_attn_func(torch.rand(64, 4, 64), torch.rand(64, 2, 64), torch.rand(64, 2, 32),
                                         [[0, 64]], [[0, 64]], kv_block_table=[0], device="cpu")
