"""Decode-sized calls of flash_attn_func / flash_attn_varlen_func on CUDA tensors (marked `gpu` and
`torch`; skipped without both): at most 32 query rows x GQA heads a sequence, which the Hopper
decode kernel serves (elsewhere the general kernels), against the f64 reference, out and lse:
every row count the kernel's tiles take (1-32 rows: 8, 16, 24, 32-row tiles), key counts off the
64-key tile (1, 63, 65, ...), long caches (split-K partials), windows, f16 / bf16, d64 / d128,
ragged varlen batches with an empty sequence; the allocator's blocks are filled with NaN before
each call, so an output element the kernels do not write shows."""
import numpy as np
import pytest

import cubeattn
from conftest import cuda_available, ref_attention, rel_err

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch,
              pytest.mark.skipif(not (torch.cuda.is_available() and cuda_available()), reason="needs a CUDA GPU")]


def f64(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def poison(*shapes_dtypes):
    """Leaves NaN in the caching allocator's blocks of these sizes (the outputs' next allocation
    takes them)."""
    for shape, dt in shapes_dtypes:
        torch.full(shape, float("nan"), dtype=dt, device="cuda")


def rand(gen, shape, dtype):
    return (torch.randn(shape, generator=gen) * 1.5).to(dtype).cuda()


# (batch, sq, hq, hkv, d, sk, causal, window): rows a sequence = sq * hq / hkv
CASES = [
    (8, 1, 32, 8, 128, 4096, True, (-1, -1)),     # Llama decode: 4 rows
    (3, 1, 32, 8, 128, 1, True, (-1, -1)),        # one key
    (2, 1, 32, 8, 128, 63, False, (-1, -1)),      # one ragged tile
    (2, 2, 32, 8, 128, 65, True, (-1, -1)),       # 8 rows, a tile and one key
    (1, 1, 32, 8, 128, 33000, True, (-1, -1)),    # split-K over a long cache
    (2, 3, 16, 4, 128, 700, True, (100, 0)),      # 12 rows (16-row tiles), a left window
    (2, 6, 16, 4, 64, 1000, True, (-1, -1)),      # 24 rows
    (2, 8, 16, 4, 128, 517, False, (-1, 20)),     # 32 rows, a right window
    (4, 1, 8, 8, 64, 4100, True, (-1, -1)),       # MHA: 1 row a sequence
    (2, 4, 8, 1, 64, 2048, True, (-1, -1)),       # 32 rows of one kv head (MQA)
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}sq{c[1]}h{c[2]}-{c[3]}d{c[4]}k{c[5]}{'c' if c[6] else 'n'}w{c[7][0]}_{c[7][1]}")
def test_gpu_decode_shapes_match_the_f64_reference(case, dtype):
    b, sq, hq, hkv, d, sk, causal, window = case
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(hash(case) % 2**31)
    q, k, v = rand(gen, (b, sq, hq, d), dt), rand(gen, (b, sk, hkv, d), dt), rand(gen, (b, sk, hkv, d), dt)
    for _ in range(2):  # the validating path, then the repeat of the same shapes
        poison(((b, sq, hq, d), dt), ((b, hq, sq), torch.float32))
        out, lse = cubeattn.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    assert cubeattn.last_backend() == "cuda"
    fq, fk, fv = f64(q), f64(k), f64(v)
    for r in range(b):
        ref, ref_lse = ref_attention(fq[r], fk[r], fv[r], [(0, sq, 0, sk)], causal, window=window)
        assert rel_err(f64(out[r]), ref) < 1e-2, f"sequence {r}"
        want = ref_lse  # [hq, sq]
        got = f64(lse[r])
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(got), finite), f"sequence {r}: lse finite where the reference is not"
        assert np.abs(got[finite] - want[finite]).max(initial=0.0) < 2e-2, f"sequence {r} lse"


def test_gpu_decode_varlen_ragged_with_an_empty_sequence():
    """Ragged key counts in one varlen call (one sequence without keys: zeros and lse +inf), every
    output element written (out poisoned with NaN first)."""
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d = 32, 8, 128
    lens_k = [700, 0, 1, 4097, 64]
    lens_q = [1, 1, 2, 1, 3]
    cq = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32).cuda()
    ck = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32).cuda()
    q = rand(gen, (sum(lens_q), hq, d), torch.bfloat16)
    k, v = rand(gen, (sum(lens_k), hkv, d), torch.bfloat16), rand(gen, (sum(lens_k), hkv, d), torch.bfloat16)
    for _ in range(2):
        poison((q.shape, q.dtype), ((hq, sum(lens_q)), torch.float32))
        out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=False, return_lse=True)
    assert cubeattn.last_backend() == "cuda"
    segs = [(int(cq[i]), lens_q[i], int(ck[i]), lens_k[i]) for i in range(len(lens_q))]
    ref, ref_lse = ref_attention(f64(q), f64(k), f64(v), segs, False)
    assert torch.isfinite(out).all()
    assert rel_err(f64(out), ref) < 1e-2
    got = f64(lse)
    assert np.array_equal(np.isinf(got), np.isinf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.abs(got[fin] - ref_lse[fin]).max() < 2e-2


@pytest.mark.parametrize("b,sk", [(8, 4096), (1, 33000), (2, 16384)])
def test_gpu_decode_split_merge_is_repeatable(b, sk):
    """Split-K decode calls merge their parts in the launch (the part that arrives last on its
    tile's counter): 30 calls enqueued back to back, each output poisoned first, all bit for bit
    the first (a merge that read a part before its stores landed, or a counter left from an earlier
    call, would differ) and that first within the f64 reference's bounds."""
    hq, hkv, d = 32, 8, 128
    gen = torch.Generator().manual_seed(sk + b)
    q, k, v = rand(gen, (b, 1, hq, d), torch.bfloat16), rand(gen, (b, sk, hkv, d), torch.bfloat16), rand(gen, (b, sk, hkv, d), torch.bfloat16)
    outs = []
    for _ in range(30):
        poison(((b, 1, hq, d), torch.bfloat16), ((b, hq, 1), torch.float32))
        outs.append(cubeattn.flash_attn_func(q, k, v, causal=True, return_lse=True))
    assert cubeattn.last_backend() == "cuda"
    for o, lse in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(lse, outs[0][1])
    ref, _ = ref_attention(f64(q[0]), f64(k[0]), f64(v[0]), [(0, 1, 0, sk)], True)
    assert rel_err(f64(outs[0][0][0]), ref) < 1e-2
