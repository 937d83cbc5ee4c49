"""torch.compile of cubeattn calls on CUDA tensors (marked `gpu` and `torch`; skipped without
both): fullgraph with aot_eager and inductor equals eager bit for bit, a compiled training step,
and mode="reduce-overhead" (CUDA graphs) replays correct results on new inputs."""
import numpy as np
import pytest

import cubeattn
from conftest import cuda_available, ref_attention, rel_err, varlen_segments

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch,
              pytest.mark.skipif(not (torch.cuda.is_available() and cuda_available()), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def rand(gen, shape, dtype=torch.bfloat16):
    return (torch.rand(shape, generator=gen) * 2 - 1).to(dtype).cuda()


def f64(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def attn(q, k, v):
    return cubeattn.flash_attn_func(q, k, v, causal=True) * 2.0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cuda_dense_compiled_equals_eager_with_grads(backend):
    gen = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d = 2, 300, 8, 2, 128
    base = [rand(gen, (b, s, h, d)) for h in (hq, hkv, hkv)]
    dout = rand(gen, (b, s, hq, d))
    ex = torch._dynamo.explain(attn)(*base)
    assert ex.graph_break_count == 0, ex.break_reasons
    results = []
    for f in (attn, torch.compile(attn, backend=backend, fullgraph=True)):
        leaves = [x.clone().requires_grad_(True) for x in base]
        out = f(*leaves)
        out.backward(dout)
        results.append([out.detach()] + [x.grad for x in leaves])
    for a, c in zip(*results):
        assert c.is_cuda and c.dtype == a.dtype
        torch.testing.assert_close(c, a, rtol=0, atol=0)
    assert cubeattn.last_backend() == "cuda"


def test_cuda_varlen_compiled_with_device_cu_seqlens():
    gen = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 100, 357, 400], dtype=torch.int32, device="cuda")
    q, k, v = (rand(gen, (400, h, 64)) for h in (4, 2, 2))

    def fn(q, k, v):
        return cubeattn.flash_attn_varlen_func(q, k, v, cu, cu, 257, 257, causal=True)

    got = torch.compile(fn, backend="inductor", fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, fn(q, k, v), rtol=0, atol=0)
    ref, _ = ref_attention(f64(q), f64(k), f64(v), varlen_segments(cu.cpu().numpy(), cu.cpu().numpy()), True)
    assert rel_err(f64(got), ref) < 1e-2


def test_cuda_reduce_overhead_replays_on_new_inputs():
    """mode="reduce-overhead" records the compiled call (cubeattn's kernels included) into a CUDA
    graph; replays with new input values give the eager results."""
    gen = torch.Generator().manual_seed(2)
    shapes = [(4, 256, 8, 64), (4, 256, 2, 64), (4, 256, 2, 64)]
    f = torch.compile(attn, mode="reduce-overhead", fullgraph=True)
    for step in range(4):  # warm-up, record, replays
        q, k, v = (rand(gen, sh) for sh in shapes)
        got = f(q, k, v).clone()
        torch.testing.assert_close(got, attn(q, k, v), rtol=0, atol=0, msg=f"step {step}")


def test_cuda_compiled_training_step_matches_eager():
    """A small attention block (projections + cubeattn + output projection) trained two steps
    compiled (inductor) and eager: the same losses within bf16 rounding (inductor fuses the
    surrounding ops differently)."""
    torch.manual_seed(3)

    class Block(torch.nn.Module):
        def __init__(self, dim=256, heads=4):
            super().__init__()
            self.qkv, self.o, self.h = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim), heads

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.h, -1).unbind(2)
            return self.o(cubeattn.flash_attn_func(q, k, v, causal=True).reshape(b, s, -1))

    x = torch.randn(2, 130, 256, device="cuda", dtype=torch.bfloat16)
    eager = Block().cuda().to(torch.bfloat16)
    compiled = Block().cuda().to(torch.bfloat16)
    compiled.load_state_dict(eager.state_dict())
    step = torch.compile(lambda m: m(x).float().square().mean(), fullgraph=True)
    losses = []
    for m, run in ((eager, lambda m: m(x).float().square().mean()), (compiled, step)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        got = []
        for _ in range(2):
            opt.zero_grad()
            loss = run(m)
            loss.backward()
            opt.step()
            got.append(loss.item())
        losses.append(got)
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-2)
