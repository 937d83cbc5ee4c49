"""cubeattn.sageattn: dense attention with SageAttention-style INT8 Q K^T on the block-sparse path
(every key block listed, 128-blocks). Against the f64 reference of the unquantised attention on
fresh random inputs (the seed is printed): causal and not, Sq == Sk and Sq != Sk (bottom-right),
GQA, lengths that are not multiples of 128, one token; FP8 P.V (pv_precision="fp8");
quant_gran=None against flash_attn_func; the NHD / HND layouts; every bad argument; the index /
spec cache; torch autograd. CPU (the CPU backend emulates the INT8 quantisation and the FP8 P.V);
the CUDA tests (INT8, INT8 + FP8 P.V) are marked gpu."""
import argparse

import numpy as np
import pytest

import cubeattn
from cubeattn import _sage
from conftest import np_dtype, ref_attention


def fresh_rng(name):
    """A generator with a fresh seed (printed: a failure can be replayed with it)."""
    seed = int(np.random.SeedSequence().entropy % 2 ** 32)
    print(f"{name}: seed {seed}")
    return np.random.default_rng(seed)


def inputs(rng, b, sq, sk, hq, hkv, d, dtype):
    q = rng.standard_normal((b, sq, hq, d)).astype(np.float32).astype(np_dtype(dtype))
    k = rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(np_dtype(dtype))
    v = rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(np_dtype(dtype))
    return q, k, v


def reference(q, k, v, causal, scale=None):
    """f64 attention of the batched inputs (as stored: the 16-bit values, unquantised):
    out [B, Sq, Hq, d], lse [B, Hq, Sq]."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    segs = [(i * sq, sq, i * sk, sk) for i in range(b)]
    out, lse = ref_attention(q.reshape(b * sq, hq, d), k.reshape(b * sk, -1, d), v.reshape(b * sk, -1, d), segs,
                             causal, scale)
    return out.reshape(q.shape), lse.reshape(hq, b, sq).transpose(1, 0, 2)


def accuracy(got, want, v):
    """(cosine similarity, relative L2 error). The L2 denominator is at least 5% of the RMS of v
    per element (attention outputs are convex combinations of v's rows, so that is their scale):
    it cannot be ~0 even where the output nearly cancels."""
    g, w = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
    cos = g @ w / (np.linalg.norm(g) * np.linalg.norm(w))
    v_rms = np.sqrt(np.mean(np.asarray(v, np.float64) ** 2))
    rel = np.linalg.norm(g - w) / max(np.linalg.norm(w), 0.05 * v_rms * np.sqrt(w.size))
    return cos, rel


# (B, Sq, Sk, Hq, Hkv, d): Sq == Sk and not, GQA, lengths that are not multiples of 128, one token
SHAPES = [
    (2, 256, 256, 4, 4, 64),
    (1, 200, 200, 4, 2, 128),   # GQA, partial last block
    (2, 100, 300, 4, 1, 64),    # Sq < Sk (causal: bottom-right), MQA
    (1, 300, 130, 2, 2, 64),    # Sq > Sk (causal: the first 170 rows see no key)
    (2, 1, 300, 4, 2, 128),     # one query token (decode)
    (1, 1, 1, 2, 1, 64),        # one token each
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Sq{}-Sk{}-H{}x{}-d{}".format(*s))
def test_matches_the_f64_reference(shape, causal):
    rng = fresh_rng(f"sage {shape} causal={causal}")
    b, sq, sk, hq, hkv, d = shape
    q, k, v = inputs(rng, b, sq, sk, hq, hkv, d, "bfloat16")
    want, want_lse = reference(q, k, v, causal)
    out, lse = cubeattn.sageattn(q, k, v, is_causal=causal, return_lse=True, device="cpu")
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, hq, sq)
    assert cubeattn.last_backend() == "cpu"
    seen = np.isfinite(want_lse)  # [B, Hq, Sq]
    assert np.array_equal(np.isfinite(lse), seen), "rows with no visible key: lse +inf, and only those"
    none = ~seen.transpose(0, 2, 1)  # [B, Sq, Hq]
    assert np.all(np.asarray(out, np.float32)[none] == 0), "rows with no visible key must be zero"
    cos, rel = accuracy(out, want, v)
    print(f"cosine {cos:.6f}, rel L2 {rel:.5f}, max |lse err| {np.abs(lse[seen] - want_lse[seen]).max():.4f}")
    assert cos >= 0.999
    assert rel <= 0.03
    # one-key rows (causal) carry one score's quantisation error unaveraged: up to ~0.04 seen
    assert np.abs(lse[seen] - want_lse[seen]).max() < 0.1


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("gran", ["per_block", "per_warp", "per_thread"])
def test_every_granularity_and_dtype(gran, dtype):
    rng = fresh_rng(f"sage {gran} {dtype}")
    q, k, v = inputs(rng, 1, 260, 260, 4, 2, 64, dtype)
    # a per-channel offset on every key (what K smoothing removes)
    k = (k.astype(np.float32) + 4.0 * rng.standard_normal(64).astype(np.float32)).astype(k.dtype)
    want, _ = reference(q, k, v, True)
    out = cubeattn.sageattn(q, k, v, is_causal=True, quant_gran=gran, device="cpu")
    cos, rel = accuracy(out, want, v)
    print(f"{gran} {dtype}: cosine {cos:.6f}, rel L2 {rel:.5f}")
    assert out.dtype == q.dtype
    assert cos >= 0.999 and rel <= 0.03
    # the quantisation ran: the exact Q K^T gives another (closer) result
    exact = cubeattn.sageattn(q, k, v, is_causal=True, quant_gran=None, device="cpu")
    assert not np.array_equal(exact, out)


def test_smoothing_matters_under_a_k_channel_outlier():
    rng = fresh_rng("sage outliers")
    q, k, v = inputs(rng, 1, 256, 256, 2, 2, 64, "float32")
    k[..., :4] += 20.0  # a few large channels on every key
    want, _ = reference(q, k, v, False)
    rel = {sm: accuracy(cubeattn.sageattn(q, k, v, quant_gran="per_block", smooth_k=sm, device="cpu"), want, v)[1]
           for sm in (True, False)}
    print("rel L2 with / without smoothing:", rel)
    assert rel[True] < rel[False] and rel[True] <= 0.03


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Sq{}-Sk{}-H{}x{}-d{}".format(*s))
def test_exact_qk_equals_flash_attn_func(shape, causal):
    rng = fresh_rng(f"sage exact {shape}")
    b, sq, sk, hq, hkv, d = shape
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 2 ** -7)):
        q, k, v = inputs(rng, b, sq, sk, hq, hkv, d, dtype)
        out, lse = cubeattn.sageattn(q, k, v, is_causal=causal, quant_gran=None, return_lse=True, device="cpu")
        want, want_lse = cubeattn.flash_attn_func(q, k, v, causal=causal, return_lse=True, device="cpu")
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
        fin = np.isfinite(want_lse)
        assert np.array_equal(fin, np.isfinite(lse))
        np.testing.assert_allclose(lse[fin], want_lse[fin], atol=1e-5, rtol=1e-5)


# (B, Sq, Sk, Hq, Hkv, d) for FP8 P.V: GQA, Sq != Sk, partial blocks, d64 and d128, decode
FP8_SHAPES = [SHAPES[0], SHAPES[1], SHAPES[2], SHAPES[3], SHAPES[4]]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "B{}-Sq{}-Sk{}-H{}x{}-d{}".format(*s))
def test_fp8_pv_matches_the_f64_reference(shape, causal):
    """pv_precision="fp8" (FP8 e4m3 P.V on top of INT8 Q K^T) against the f64 reference of the
    unquantised attention: cosine >= 0.999, relative L2 <= 0.05; the lse is the INT8 call's (the
    true lse: P's scale of 256 does not reach it); rows with no visible key: zero, lse +inf."""
    rng = fresh_rng(f"sage fp8 {shape} causal={causal}")
    b, sq, sk, hq, hkv, d = shape
    q, k, v = inputs(rng, b, sq, sk, hq, hkv, d, "bfloat16")
    want, want_lse = reference(q, k, v, causal)
    out, lse = cubeattn.sageattn(q, k, v, is_causal=causal, return_lse=True, device="cpu", pv_precision="fp8")
    out8, lse8 = cubeattn.sageattn(q, k, v, is_causal=causal, return_lse=True, device="cpu")
    assert out.shape == q.shape and out.dtype == q.dtype and cubeattn.last_backend() == "cpu"
    seen = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse), seen)
    assert np.all(np.asarray(out, np.float32)[~seen.transpose(0, 2, 1)] == 0)
    cos, rel = accuracy(out, want, v)
    rel8 = accuracy(out8, want, v)[1]
    print(f"fp8: cosine {cos:.6f}, rel L2 {rel:.5f} (int8 only: rel L2 {rel8:.5f})")
    assert cos >= 0.999 and rel <= 0.05
    assert rel > rel8 or sk == 1, "FP8 P.V must cost accuracy (or it did not run)"
    np.testing.assert_allclose(lse[seen], lse8[seen], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fp8_pv_dtypes_and_v_outlier_channels(dtype):
    """float32 / float16 inputs, every granularity, V with a few channels 40x larger and one
    offset by 25 (V's scale is per channel, so they cost nothing)."""
    rng = fresh_rng(f"sage fp8 {dtype}")
    q, k, v = inputs(rng, 1, 260, 260, 4, 2, 64, dtype)
    v = v.astype(np.float32)
    v[..., [3, 17]] *= 40.0
    v[..., 9] += 25.0
    v = v.astype(q.dtype)
    want, _ = reference(q, k, v, True)
    for gran in ("per_block", "per_warp", "per_thread"):
        out = cubeattn.sageattn(q, k, v, is_causal=True, quant_gran=gran, pv_precision="fp8", device="cpu")
        assert out.dtype == q.dtype
        cos, rel = accuracy(out, want, v)
        print(f"{gran} {dtype}: cosine {cos:.6f}, rel L2 {rel:.5f}")
        assert cos >= 0.999 and rel <= 0.05


def test_softmax_scale_and_the_hnd_layout():
    rng = fresh_rng("sage layout")
    q, k, v = inputs(rng, 2, 150, 210, 4, 2, 64, "bfloat16")
    want, _ = reference(q, k, v, True, scale=0.2)
    out, lse = cubeattn.sageattn(q, k, v, is_causal=True, softmax_scale=0.2, return_lse=True, device="cpu")
    assert accuracy(out, want, v)[0] >= 0.999
    t = lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2))  # noqa: E731  [B, S, H, d] -> [B, H, S, d]
    out_h, lse_h = cubeattn.sageattn(t(q), t(k), t(v), is_causal=True, softmax_scale=0.2, return_lse=True,
                                     device="cpu", tensor_layout="HND")
    assert out_h.shape == (2, 4, 150, 64) and lse_h.shape == lse.shape
    assert np.array_equal(np.swapaxes(out_h, 1, 2), out) and np.array_equal(lse_h, lse)


def test_block_index_lists_exactly_the_blocks_causal_needs():
    """Non-causal: every key block. Causal: a key block is listed for a query block iff some row of
    it sees some key of it (bottom-right), checked by brute force over lengths around the block
    edges, Sq < Sk, Sq == Sk and Sq > Sk."""
    bs = _sage.SAGE_BLOCK
    for sq in (1, 127, 128, 129, 300, 385):
        for sk in (1, 100, 128, 129, 256, 300, 500):
            ix = _sage.dense_block_index(2, 3, sq, sk, False)
            qbn, kbn = -(-sq // bs), -(-sk // bs)
            assert ix.shape == (2, 3, qbn, kbn) and ix.dtype == np.int32
            assert np.array_equal(ix, np.broadcast_to(np.arange(kbn), ix.shape))
            ix = _sage.dense_block_index(2, 3, sq, sk, True)
            visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq
            for qb in range(qbn):
                rows = visible[qb * bs:(qb + 1) * bs]
                need = {kb for kb in range(kbn) if rows[:, kb * bs:(kb + 1) * bs].any()}
                listed = ix[0, 0, qb]
                assert set(listed[listed >= 0].tolist()) == need, (sq, sk, qb)
                assert np.all(ix[:, :, qb] == listed)


def test_the_index_and_spec_are_cached_and_give_the_same_result():
    rng = fresh_rng("sage cache")
    q, k, v = inputs(rng, 2, 140, 140, 4, 2, 64, "float16")
    _sage._SPECS.clear()
    _sage._INDEX.clear()
    first = cubeattn.sageattn(q, k, v, is_causal=True, device="cpu")
    assert len(_sage._SPECS) == 1 and len(_sage._INDEX) == 1
    (spec,) = _sage._SPECS.values()
    assert spec.key_set == "block_sparse" and spec.qk_int8 == "per_warp" and spec.causal
    assert (spec.q_block, spec.k_block) == (128, 128)
    again = cubeattn.sageattn(q.copy(), k.copy(), v.copy(), is_causal=True, device="cpu")
    assert np.array_equal(first, again)
    assert len(_sage._SPECS) == 1 and next(iter(_sage._SPECS.values())) is spec
    # other options: a spec of their own, the same index where only the quantisation differs
    cubeattn.sageattn(q, k, v, is_causal=True, quant_gran="per_thread", device="cpu")
    assert len(_sage._SPECS) == 2 and len(_sage._INDEX) == 1
    cubeattn.sageattn(q, k, v, is_causal=False, device="cpu")
    assert len(_sage._SPECS) == 3 and len(_sage._INDEX) == 2
    fp8 = cubeattn.sageattn(q, k, v, is_causal=True, pv_precision="fp8", device="cpu")
    assert len(_sage._SPECS) == 4 and len(_sage._INDEX) == 2 and not np.array_equal(fp8, first)
    assert sorted(str(s.pv_precision) for s in _sage._SPECS.values()) == ["None", "None", "None", "fp8"]
    assert np.array_equal(cubeattn.sageattn(q, k, v, is_causal=True, pv_precision="fp8", device="cpu"), fp8)
    assert np.array_equal(cubeattn.sageattn(q, k, v, is_causal=True, pv_precision=None, device="cpu"), first)
    for s in range(1, 2 * _sage._CACHE_ENTRIES):  # bounded
        cubeattn.sageattn(q[:, :s], k[:, :s], v[:, :s], device="cpu")
    assert len(_sage._SPECS) == _sage._CACHE_ENTRIES and len(_sage._INDEX) == _sage._CACHE_ENTRIES
    assert np.array_equal(cubeattn.sageattn(q, k, v, is_causal=True, device="cpu"), first)


def _bad_calls():
    rng = np.random.default_rng(0)
    q, k, v = inputs(rng, 1, 64, 64, 4, 2, 64, "float32")
    yield dict(tensor_layout="nhd"), ValueError, "tensor_layout"
    yield dict(tensor_layout="BSHD"), ValueError, "tensor_layout"
    yield dict(tensor_layout=None), TypeError, "tensor_layout"
    yield dict(is_causal="no"), TypeError, "is_causal"
    yield dict(is_causal=1), TypeError, "is_causal"
    yield dict(quant_gran="per_row"), ValueError, "quant_gran"
    yield dict(quant_gran=8), ValueError, "quant_gran"
    yield dict(smooth_k="yes"), TypeError, "smooth_k"
    yield dict(return_lse=1), TypeError, "return_lse"
    yield dict(softmax_scale="0.1"), TypeError, "softmax_scale"
    yield dict(softmax_scale=-0.1), ValueError, "softmax_scale"
    yield dict(softmax_scale=float("inf")), ValueError, "softmax_scale"
    yield dict(device=0), TypeError, "device"
    yield dict(device="tpu"), ValueError, "device"
    yield dict(pv_precision="fp16"), ValueError, "pv_precision"
    yield dict(pv_precision="bf16"), ValueError, "pv_precision"
    yield dict(pv_precision=8), ValueError, "pv_precision"
    yield dict(pv_precision="fp8", quant_gran=None), ValueError, "pv_precision.*INT8"
    yield dict(k=k.astype(np.float16), v=v.astype(np.float16)), TypeError, "`k`"
    yield dict(v=v.astype(np.float16)), TypeError, "`v`"
    yield dict(q=q.astype(np.int32)), TypeError, "`q`"
    yield dict(q=q[0]), ValueError, "`q`.*rank 4"
    yield dict(k=k[None]), ValueError, "`k`.*rank 4"
    yield dict(q=q[..., :32]), ValueError, "`k`.*head_dim"
    yield dict(v=v[..., :32]), ValueError, "`v`"
    yield dict(v=v[:, :32]), ValueError, "`v`"
    yield dict(k=np.repeat(k, 2, 0), v=np.repeat(v, 2, 0)), ValueError, "`k`.*batch"
    yield dict(k=np.repeat(k, 3, 2)[:, :, :3], v=np.repeat(v, 3, 2)[:, :, :3]), ValueError, "`k`.*divide"
    yield dict(v=v.tolist()), TypeError, "`v`"


@pytest.mark.parametrize("case", range(len(list(_bad_calls()))))
def test_bad_arguments_raise_naming_them(case):
    kw, exc, match = list(_bad_calls())[case]
    rng = np.random.default_rng(0)
    args = dict(zip("qkv", inputs(rng, 1, 64, 64, 4, 2, 64, "float32")))
    for name in "qkv":
        if name in kw:
            args[name] = kw.pop(name)
    with pytest.raises(exc, match=match):
        cubeattn.sageattn(args["q"], args["k"], args["v"], device=kw.pop("device", "cpu"), **kw)


def test_exported():
    assert "sageattn" in cubeattn.__all__ and cubeattn.sageattn is _sage.sageattn


# ---------------------------------------------------------------- torch (skipped where torch is absent)

def test_torch_inputs_that_require_grad():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2 ** 31))
    q = torch.randn(2, 130, 4, 64, generator=g, requires_grad=True)
    k = torch.randn(2, 200, 2, 64, generator=g, requires_grad=True)
    v = torch.randn(2, 200, 2, 64, generator=g, requires_grad=True)
    with pytest.raises(ValueError, match="quant_gran.*no backward"):
        cubeattn.sageattn(q, k, v, is_causal=True, device="cpu")
    with pytest.raises(ValueError, match="quant_gran.*no backward"):
        cubeattn.sageattn(q, k, v, is_causal=True, device="cpu", pv_precision="fp8")
    with torch.no_grad():
        out = cubeattn.sageattn(q, k, v, is_causal=True, device="cpu")
    want, _ = reference(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), True)
    assert isinstance(out, torch.Tensor) and accuracy(out.numpy(), want, v.detach().numpy())[0] >= 0.999
    # exact Q K^T: differentiable through the block-sparse backward, equal to flash_attn_func's gradients
    dout = torch.randn(q.shape, generator=g)
    grads = []
    for f in (lambda: cubeattn.sageattn(q, k, v, is_causal=True, quant_gran=None, device="cpu"),
              lambda: cubeattn.flash_attn_func(q, k, v, causal=True, device="cpu")):
        q.grad = k.grad = v.grad = None
        f().backward(dout)
        grads.append([x.grad.clone() for x in (q, k, v)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # HND torch tensors: a transposed view back, equal to the NHD call
    with torch.no_grad():
        o_h = cubeattn.sageattn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                device="cpu", tensor_layout="HND")
    assert o_h.shape == (2, 4, 130, 64) and torch.equal(o_h.transpose(1, 2), out)


def cuda_case(name, b, sq, sk):
    """torch (the test skips without CUDA) and the bf16 inputs of one CUDA case: the numpy arrays
    (for the f64 reference) and their CUDA tensors."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    q, k, v = inputs(fresh_rng(name), b, sq, sk, 8, 2, 128, "bfloat16")
    return torch, (q, k, v), tuple(torch.from_numpy(np.asarray(x, np.float32)).bfloat16().cuda() for x in (q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_against_the_f64_reference(causal):
    _, (q, k, v), (tq, tk, tv) = cuda_case(f"sage cuda causal={causal}", 2, 300, 520)
    want, want_lse = reference(q, k, v, causal)
    for gran in ("per_block", "per_warp", "per_thread"):
        out, lse = cubeattn.sageattn(tq, tk, tv, is_causal=causal, quant_gran=gran, return_lse=True, device="cuda")
        assert cubeattn.last_backend() == "cuda" and out.is_cuda
        cos, rel = accuracy(out.float().cpu().numpy(), want, v)
        print(f"cuda {gran}: cosine {cos:.6f}, rel L2 {rel:.5f}")
        assert cos >= 0.999 and rel <= 0.03
        fin = np.isfinite(want_lse)
        assert np.abs(lse.cpu().numpy()[fin] - want_lse[fin]).max() < 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_fp8_pv_against_the_f64_reference(causal):
    """FP8 P.V on CUDA (the Hopper kernel's INT8 + FP8 variant): the CPU tests' bounds (cosine >=
    0.999, relative L2 <= 0.05), Sq != Sk, two sequences. Skipped where the GPU refuses FP8 P.V
    (below sm_90)."""
    _, (q, k, v), (tq, tk, tv) = cuda_case(f"sage cuda fp8 causal={causal}", 2, 300, 520)
    want, _ = reference(q, k, v, causal)
    for gran in ("per_block", "per_warp", "per_thread"):
        try:
            out = cubeattn.sageattn(tq, tk, tv, is_causal=causal, quant_gran=gran, pv_precision="fp8", device="cuda")
        except NotImplementedError as e:
            pytest.skip(f"FP8 P.V not on this GPU: {e}")
        assert cubeattn.last_backend() == "cuda" and out.is_cuda
        cos, rel = accuracy(out.float().cpu().numpy(), want, v)
        print(f"cuda fp8 {gran}: cosine {cos:.6f}, rel L2 {rel:.5f}")
        assert cos >= 0.999 and rel <= 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("sk", [64, 150, 448, 520, 576, 640])
def test_cuda_fp8_pv_key_blocks_past_the_keys(sk):
    """FP8 P.V where the last listed 128-key block ends past the keys (Sk not a multiple of 128):
    its second 64-key tile holds no key, and the V^T bytes behind a sequence's keys are never
    written (`kernels::fp8_v`). The caching allocator is handed 0xFF bytes (NaN in e4m3) before
    every call, so a kernel that reads those bytes gives NaN (the kernel before the fix failed this
    for every length here but 640); every output must be finite and within the f64 bounds. One and
    two sequences, causal and not."""
    for b in (1, 2):
        torch, (q, k, v), (tq, tk, tv) = cuda_case(f"sage cuda fp8 sk={sk} b={b}", b, 64, sk)
        for causal in (False, True):
            want, _ = reference(q, k, v, causal)
            for gran in ("per_block", "per_warp"):
                junk = torch.full((1 << 24,), 255, dtype=torch.uint8, device="cuda")
                del junk
                try:
                    out = cubeattn.sageattn(tq, tk, tv, is_causal=causal, quant_gran=gran, pv_precision="fp8", device="cuda")
                except NotImplementedError as e:
                    pytest.skip(f"FP8 P.V not on this GPU: {e}")
                got = out.float().cpu().numpy()
                bad = int((~np.isfinite(got)).sum())
                cos, rel = accuracy(got, want, v)
                print(f"B={b} Sk={sk} causal={causal} {gran}: non-finite {bad}, cosine {cos:.6f}, rel L2 {rel:.5f}")
                assert bad == 0 and cos >= 0.999 and rel <= 0.05


# ---------------------------------------------------------------- the benchmark's CPU behaviour

def test_bench_sage_without_cuda_says_so_and_exits_0(capsys, monkeypatch):
    from cubeattn import bench

    monkeypatch.setattr(cubeattn, "backend_status", lambda: {"cuda_compiled": False, "cuda_available": False,
                                                             "reason": "no GPU here", "devices": []})
    assert bench.main(["sage", "--seqlens", "256"]) == 0
    assert "needs CUDA" in capsys.readouterr().out


def test_bench_sage_rows_on_the_cpu(tmp_path, capsys):
    """The sage rows' code path on CPU tensors with small shapes (the SDPA backends that need a GPU
    report an error row): keys, accuracy columns and both input distributions."""
    torch = pytest.importorskip("torch")
    from cubeattn import bench

    args = argparse.Namespace(
        seqlens=[200], batch_size=1, num_heads=4, num_kv_heads=2, head_dim=64, causal=True, quant_gran="per_warp",
        outliers=True, iterations=1, quick=True)
    rows = bench._sage_rows(args, torch, "cpu")
    capsys.readouterr()
    ok = [r for r in rows if "error" not in r]
    impls = {(r["impl"], r["inputs"]) for r in ok}
    assert {("cubeattn_int8", "randn"), ("cubeattn_bf16", "randn"), ("cubeattn_int8", "outliers"),
            ("cubeattn_bf16", "outliers"), ("cubeattn_int8_fp8", "randn"), ("cubeattn_int8_fp8", "outliers")} <= impls
    for r in ok:
        assert r["what"] == "sage_fwd" and r["S"] == 200 and r["H"] == 4 and r["D"] == 64 and r["B"] == 1
        if r["impl"] in ("cubeattn_int8", "cubeattn_bf16"):
            assert r["cosine"] >= 0.999 and 0 < r["rel_l2"] < 0.03, r
        if r["impl"] == "cubeattn_int8_fp8":
            assert r["cosine"] >= 0.999 and 0 < r["rel_l2"] < 0.05 and r["pv_precision"] == "fp8", r
        if r["inputs"] == "randn" and "ms" in r:
            assert r["tflops"] > 0
    assert all(r["impl"].startswith("sdpa") for r in rows if "error" in r)
    acc = {(r["impl"], r["inputs"]): r["rel_l2"] for r in ok}
    assert acc[("cubeattn_int8", "outliers")] < acc[("cubeattn_int8_nosmooth", "outliers")]
    assert acc[("cubeattn_bf16", "randn")] < acc[("cubeattn_int8", "randn")] < acc[("cubeattn_int8_fp8", "randn")]
    bench.print_table(rows)
    assert "0.99" in capsys.readouterr().out  # the cosine column keeps its digits


def test_bench_f64_reference_equals_the_block_sparse_reference():
    """The bench's f64 reference (`bench._attention_f64`, what the sage and sparse INT8 rows'
    accuracy is measured against) equals conftest.ref_sparse on a block pattern, causal, Sq != Sk, GQA."""
    torch = pytest.importorskip("torch")
    from cubeattn import bench, sparse_patterns as sp
    from conftest import ref_sparse

    rng = fresh_rng("bench reference")
    q, k, v = inputs(rng, 1, 300, 400, 4, 2, 32, "float32")
    ix = sp.random(1, 4, 3, 4, 2, seed=int(rng.integers(1 << 30)))
    heads = bench._ref_heads(4, 3)
    for causal in (False, True):
        want, _ = ref_sparse(q[0], k[0], v[0], ix, [0, 300], [0, 400], 128, 128, causal)
        got = bench._attention_f64(torch, *(torch.from_numpy(x) for x in (q, k, v)), heads, causal,
                                   block_keep=bench._block_keep(torch, ix[0, heads], 4, "cpu"), rows=128)
        np.testing.assert_allclose(got.numpy(), want[:, heads], atol=1e-12)
        dense, _ = reference(q, k, v, causal)
        got = bench._attention_f64(torch, *(torch.from_numpy(x) for x in (q, k, v)), heads, causal, rows=100)
        np.testing.assert_allclose(got.numpy(), dense[0][:, heads], atol=1e-12)
