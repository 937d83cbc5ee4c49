"""torch.compile of functions that call cubeattn on torch tensors (marked `torch`; skipped where
torch is not installed): no graph break (`torch._dynamo.explain`), fullgraph compiles with the
eager / aot_eager / inductor backends, outputs and gradients equal to eager's, an f64 reference
for the compiled results, and `torch.library.opcheck` of the custom ops (schema, fake
implementation, autograd registration). CPU tensors; the CUDA twins are in test_compile_gpu.py."""
import numpy as np
import pytest

import cubeattn
from conftest import grouped_segments, ref_attention, ref_backward, rel_err, varlen_segments

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def rand(gen, shape, dtype=torch.float32, device="cpu"):
    x = torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1
    return x.to(dtype).to(device).requires_grad_(True)


def f64(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def run_eager_and_compiled(fn, inputs, backend, dout_seed=1):
    """(eager outputs, eager grads), (compiled outputs, compiled grads) of fn(*inputs), the grads
    of sum(out * dout) for a fixed random dout, each run on fresh leaf copies of the inputs."""
    results = []
    for f in (fn, torch.compile(fn, backend=backend, fullgraph=True)):
        leaves = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
        out = f(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        gen = torch.Generator().manual_seed(dout_seed)
        dout = (torch.rand(outs[0].shape, generator=gen) * 2 - 1).to(outs[0].dtype).to(outs[0].device)
        (outs[0] * dout).sum().backward()
        results.append(([o.detach() for o in outs], [x.grad for x in leaves if x.requires_grad], dout))
    return results


def assert_same(eager, compiled):
    (eo, eg, _), (co, cg, _) = eager, compiled
    assert len(eo) == len(co) and len(eg) == len(cg)
    for a, b in zip(eo + eg, co + cg):
        assert b is not None and a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def dense_fn(q, k, v):
    out = cubeattn.flash_attn_func(q, k, v, causal=True)
    return out * 2.0 + 1.0  # torch work around the call, in the same graph


def assert_no_graph_break(fn, *args):
    ex = torch._dynamo.explain(fn)(*args)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_dense_compiles_without_break_and_equals_eager(backend):
    gen = torch.Generator().manual_seed(0)
    b, sq, hq, hkv, d = 2, 37, 4, 2, 32
    q, k, v = rand(gen, (b, sq, hq, d)), rand(gen, (b, sq, hkv, d)), rand(gen, (b, sq, hkv, d))
    assert_no_graph_break(dense_fn, q, k, v)
    eager, compiled = run_eager_and_compiled(dense_fn, (q, k, v), backend)
    assert_same(eager, compiled)
    # and both against the f64 reference
    cu = np.arange(b + 1, dtype=np.int32) * sq
    flat = [f64(x).reshape(b * sq, x.shape[2], d) for x in (q, k, v)]
    segs = varlen_segments(cu, cu)
    ref, _ = ref_attention(*flat, segs, True)
    got = (f64(compiled[0][0]).reshape(b * sq, hq, d) - 1.0) / 2.0
    assert rel_err(got, ref) < 1e-5
    dout = f64(compiled[2]).reshape(b * sq, hq, d) * 2.0
    for g, want in zip(compiled[1], ref_backward(*flat, dout, segs, True)):
        assert rel_err(f64(g).reshape(want.shape), want) < 1e-4


def test_v_with_a_head_dim_of_its_own_compiles():
    """DeepSeek MLA shapes (q, k 48 here, v 32): the fake implementation gives out v's head_dim,
    so a fullgraph compile runs and equals eager, gradients included."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = rand(gen, (2, 21, 4, 48)), rand(gen, (2, 21, 2, 48)), rand(gen, (2, 21, 2, 32))
    assert_no_graph_break(dense_fn, q, k, v)
    eager, compiled = run_eager_and_compiled(dense_fn, (q, k, v), "aot_eager")
    assert compiled[0][0].shape == (2, 21, 4, 32)
    assert_same(eager, compiled)


def test_dynamic_shapes_compile_once():
    """dynamic=True: one graph serves several batch sizes and sequence lengths (the fake
    implementations give symbolic shapes)."""
    gen = torch.Generator().manual_seed(9)
    f = torch.compile(dense_fn, backend="aot_eager", fullgraph=True, dynamic=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for b, s in ((3, 19), (5, 40), (6, 27)):  # sizes that equal no other size, none 0 or 1
        q, k, v = (rand(gen, (b, s, h, 16)) for h in (4, 2, 2))
        torch.testing.assert_close(f(q, k, v), dense_fn(q, k, v), rtol=0, atol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1


@pytest.mark.parametrize("cu_kind", ["tensor", "numpy", "list"])
def test_varlen_window_and_lse_compile(cu_kind):
    gen = torch.Generator().manual_seed(1)
    lens = [(5, 9), (33, 33), (1, 17)]
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    conv = {"tensor": torch.from_numpy, "numpy": lambda a: a, "list": lambda a: a.tolist()}[cu_kind]
    cq, ck = conv(cu_q), conv(cu_k)
    q = rand(gen, (int(cu_q[-1]), 4, 16))
    k, v = (rand(gen, (int(cu_k[-1]), 1, 16)) for _ in range(2))

    def fn(q, k, v):
        out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cq, ck, 33, 33, causal=True, window_size=(6, 0),
                                                   softmax_scale=0.3, return_lse=True)
        return out, lse

    assert_no_graph_break(fn, q, k, v)
    eager, compiled = run_eager_and_compiled(fn, (q, k, v), "aot_eager")
    assert_same(eager, compiled)
    assert not compiled[0][1].requires_grad
    segs = varlen_segments(cu_q, cu_k)
    ref, ref_lse = ref_attention(f64(q), f64(k), f64(v), segs, True, 0.3, (6, 0))
    assert rel_err(f64(compiled[0][0]), ref) < 1e-5
    np.testing.assert_allclose(f64(compiled[0][1]), ref_lse, rtol=1e-5)


def test_varlen_tensor_max_seqlen_with_captured_scalars():
    """flash-attn users pass max_seqlen = cu_seqlens.diff().max() (a 0-d tensor): with
    capture_scalar_outputs the .item() stays in the graph (as for flash-attn)."""
    gen = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    q, k, v = (rand(gen, (20, 2, 16)) for _ in range(3))

    def fn(q, k, v, cu):
        m = cu.diff().max()
        return cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True)

    want = fn(q, k, v, cu)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, cu)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_grouped_compile_with_gqa_and_overlapping_ranges():
    gen = torch.Generator().manual_seed(3)
    q_ranges = torch.tensor([[0, 20], [20, 36]], dtype=torch.int32)
    kv_ranges = torch.tensor([[0, 70], [30, 70]], dtype=torch.int32)
    q = rand(gen, (40, 4, 32))
    k, v = (rand(gen, (70, 2, 32)) for _ in range(2))

    def fn(q, k, v):
        return cubeattn.grouped_flash_attn_func(q, k, v, q_ranges, kv_ranges, causal=True)

    assert_no_graph_break(fn, q, k, v)
    eager, compiled = run_eager_and_compiled(fn, (q, k, v), "aot_eager")
    assert_same(eager, compiled)
    segs = grouped_segments(q_ranges.numpy(), kv_ranges.numpy())
    ref, _ = ref_attention(f64(q), f64(k), f64(v), segs, True)
    assert rel_err(f64(compiled[0][0]), ref) < 1e-5


def test_paged_grouped_compile():
    """kv_block_table (64-key pages) through the grouped op; dk, dv in the paged layout."""
    gen = torch.Generator().manual_seed(4)
    table = torch.tensor([2, 0, 1], dtype=torch.int32)
    q = rand(gen, (50, 2, 16))
    k, v = (rand(gen, (192, 2, 16)) for _ in range(2))
    qr, kr = [[0, 30], [30, 50]], [[0, 150], [64, 192]]

    def fn(q, k, v):
        return cubeattn.grouped_flash_attn_func(q, k, v, qr, kr, causal=True, kv_block_table=table)

    eager, compiled = run_eager_and_compiled(fn, (q, k, v), "aot_eager")
    assert_same(eager, compiled)


def test_dense_lse_and_non_contiguous_inputs_compile():
    """Inputs as transformers makes them ([B, H, S, D] transposed to [B, S, H, D]) and the lse
    in flash-attn's [B, H, S]."""
    gen = torch.Generator().manual_seed(5)
    qt, kt, vt = rand(gen, (2, 4, 24, 16)), rand(gen, (2, 2, 24, 16)), rand(gen, (2, 2, 24, 16))

    def fn(q, k, v):
        out, lse = cubeattn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                            return_lse=True)
        return out.transpose(1, 2), lse

    eager, compiled = run_eager_and_compiled(fn, (qt, kt, vt), "aot_eager")
    assert_same(eager, compiled)
    assert compiled[0][1].shape == (2, 4, 24)


def test_explicit_backward_calls_compile():
    """flash_attn_varlen_backward / grouped_flash_attn_backward inside a compiled function."""
    gen = torch.Generator().manual_seed(8)
    cu = torch.tensor([0, 11, 30], dtype=torch.int32)
    q, k, v, dout = (rand(gen, (30, 2, 16)).detach() for _ in range(4))
    qr, kr = torch.tensor([[0, 30]], dtype=torch.int32), torch.tensor([[0, 30]], dtype=torch.int32)

    def fn(q, k, v, dout):
        out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, 19, 19, causal=True, return_lse=True)
        g1 = cubeattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, 19, 19, causal=True)
        out2, lse2 = cubeattn.grouped_flash_attn_func(q, k, v, qr, kr, return_lse=True)
        g2 = cubeattn.grouped_flash_attn_backward(dout, q, k, v, out2, lse2, qr, kr)
        return (*g1, *g2)

    assert_no_graph_break(fn, q, k, v, dout)
    want = fn(q, k, v, dout)
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, dout)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_compiled_bad_option_names_the_argument():
    gen = torch.Generator().manual_seed(6)
    q = rand(gen, (1, 8, 2, 16))

    def fn(q):
        return cubeattn.flash_attn_func(q, q, q, dropout_p=0.1)

    with pytest.raises(Exception, match="dropout_p"):
        torch.compile(fn, backend="eager", fullgraph=True)(q)


def test_opcheck_custom_ops():
    """torch.library.opcheck: schema, fake vs real (shapes, dtypes, strides), autograd
    registration, AOT dispatch."""
    from cubeattn import _ops

    gen = torch.Generator().manual_seed(7)
    q, k, v = rand(gen, (2, 9, 4, 16)), rand(gen, (2, 11, 2, 16)), rand(gen, (2, 11, 2, 16))
    torch.library.opcheck(_ops.fwd_dense, (q, k, v, None, True, -1, -1, False, "cpu"))
    cu_q, cu_k = torch.tensor([0, 4, 18], dtype=torch.int32), torch.tensor([0, 6, 22], dtype=torch.int32)
    fq, fk, fv = (x.detach().reshape(-1, *x.shape[2:]).requires_grad_(True) for x in (q, k, v))
    torch.library.opcheck(_ops.fwd_varlen, (fq, fk, fv, cu_q, cu_k, 14, 16, 0.5, False, 3, 2, False, "cpu"))
    qr, kr = torch.tensor([[0, 10]], dtype=torch.int32), torch.tensor([[2, 22]], dtype=torch.int32)
    torch.library.opcheck(_ops.fwd_grouped, (fq, fk, fv, qr, kr, None, True, -1, -1, None, True, "cpu"))
    out, lse = _ops.fwd_varlen(fq, fk, fv, cu_q, cu_k, 14, 16, None, True, -1, -1, False, "cpu")
    dout = torch.rand(out.shape, generator=gen)
    torch.library.opcheck(_ops.bwd_varlen, (dout, fq.detach(), fk.detach(), fv.detach(), out.detach(), lse, cu_q,
                                            cu_k, 14, 16, None, True, -1, -1, False, "cpu"))


def test_eager_calls_take_the_direct_path(monkeypatch):
    """The custom ops are for tracing only: plain eager tensors never reach them."""
    from cubeattn import _ops

    def boom(*a, **kw):
        raise AssertionError("eager call went through the custom op")

    monkeypatch.setattr(_ops, "call_dense", boom)
    q = torch.rand(1, 8, 2, 16)
    assert cubeattn.flash_attn_func(q, q, q).shape == q.shape


def test_kvcache_call_runs_eagerly_inside_a_compiled_function():
    """flash_attn_with_kvcache writes the cache in place from host-built indices: under
    torch.compile it runs eagerly (one graph break), with the eager results."""
    gen = torch.Generator().manual_seed(10)
    q, kn, vn = (torch.rand(2, 1, h, 16, generator=gen) for h in (4, 2, 2))
    caches = [torch.rand(2, 30, 2, 16, generator=gen) for _ in range(2)]
    copies = [c.clone() for c in caches]

    def fn(q, kc, vc, kn, vn):
        return cubeattn.flash_attn_with_kvcache(q * 1.0, kc, vc, kn, vn, cache_seqlens=7, causal=True) + 1.0

    want = fn(q, *copies, kn, vn)
    got = torch.compile(fn, backend="aot_eager")(q, *caches, kn, vn)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(caches, copies):
        assert torch.equal(a, b)
