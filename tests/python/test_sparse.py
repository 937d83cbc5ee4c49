"""Block-sparse attention: patterns x kept fractions x causal against the f64 reference with the
token mask expanded from the block mask (conftest.ref_sparse), GQA, Sq != Sk, partial last
blocks, varlen, empty rows, validation of every bad-index class, gradients, 100% kept == dense,
FlexAttention BlockMask fields, and the INT8 QK^T option's accuracy."""
import types

import numpy as np
import pytest

import cubeattn
from cubeattn import sparse_patterns as sp
from conftest import BWD_TOL, FWD_TOL, int8_accuracy, int8_operands, rand, ref_sparse, rel_err

PATTERNS = ["random", "local", "strided", "block_diagonal"]
KEPT = [0.10, 0.25, 0.50, 0.75, 1.00]


def make_pattern(name, B, H, qbn, kbn, top_k, seed):
    if name == "random":
        return sp.random(B, H, qbn, kbn, top_k, seed=seed)
    return sp.PATTERNS[name](B, H, qbn, kbn, top_k, seed=seed)


def batched_cu(B, sq, sk):
    return np.arange(B + 1, dtype=np.int32) * sq, np.arange(B + 1, dtype=np.int32) * sk


def check_fwd(out, lse, want_out, want_lse, dtype):
    tol, rel = FWD_TOL[dtype]
    out = np.asarray(out, np.float64)
    np.testing.assert_allclose(out, want_out, rtol=tol, atol=tol)
    assert rel_err(out, want_out) <= rel
    inf = np.isinf(want_lse)
    assert np.array_equal(np.isinf(lse), inf), "rows with no visible key must have lse +inf (and only those)"
    np.testing.assert_allclose(np.asarray(lse)[~inf], want_lse[~inf], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- forward vs the reference

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kept", KEPT)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_patterns_match_reference(pattern, kept, causal):
    # Sq != Sk, neither a multiple of its block size (partial last blocks), GQA 4/2, batch 2
    B, sq, sk, hq, hkv, d = 2, 333, 1290, 4, 2, 32
    qbn, kbn = -(-sq // 64), -(-sk // 128)  # 6, 11
    top_k = sp.top_k_for(kbn, kept)
    ix = make_pattern(pattern, B, hq, qbn, kbn, top_k, seed=hash((pattern, kept)) % 1000)
    rng = np.random.default_rng(int(kept * 100) + 7 * causal)
    q, k, v = rand(rng, (B, sq, hq, d), "float32"), rand(rng, (B, sk, hkv, d), "float32"), rand(rng, (B, sk, hkv, d), "float32")
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (B, hq, sq)
    assert cubeattn.last_backend() == "cpu"
    cu_q, cu_k = batched_cu(B, sq, sk)
    want_out, want_lse = ref_sparse(q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), ix, cu_q, cu_k,
                                    64, 128, causal)
    check_fwd(out.reshape(-1, hq, d), lse.transpose(1, 0, 2).reshape(hq, -1), want_out, want_lse, "float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_half_dtypes_match_reference(dtype, causal):
    B, sq, sk, hq, hkv, d = 1, 200, 200, 4, 1, 64
    ix = sp.random(B, hkv, 4, 2, 1, seed=3)  # one of 2 key blocks per query block, shared over the GQA group
    rng = np.random.default_rng(5)
    q, k, v = rand(rng, (B, sq, hq, d), dtype), rand(rng, (B, sk, hkv, d), dtype), rand(rng, (B, sk, hkv, d), dtype)
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, causal=causal, return_lse=True)
    assert out.dtype == q.dtype
    cu_q, cu_k = batched_cu(B, sq, sk)
    want = ref_sparse(q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), ix, cu_q, cu_k, 64, 128, causal)
    check_fwd(out.reshape(-1, hq, d), lse.transpose(1, 0, 2).reshape(hq, -1), *want, dtype)


def test_gqa_index_per_kv_head_equals_repeated_index():
    B, s, hq, hkv, d = 2, 300, 6, 2, 16
    ix_kv = sp.strided(B, hkv, 5, 3, 2, seed=1)
    ix_q = np.repeat(ix_kv, hq // hkv, axis=1)
    rng = np.random.default_rng(8)
    q, k, v = rand(rng, (B, s, hq, d), "float32"), rand(rng, (B, s, hkv, d), "float32"), rand(rng, (B, s, hkv, d), "float32")
    a = cubeattn.block_sparse_attn_func(q, k, v, ix_kv, causal=True)
    b = cubeattn.block_sparse_attn_func(q, k, v, ix_q, causal=True)
    assert np.array_equal(a, b)
    # a per-query-head index that differs inside a group does change the result
    ix_q2 = ix_q.copy()
    ix_q2[:, 1] = sp.local(B, 1, 5, 3, 2)[:, 0]
    c = cubeattn.block_sparse_attn_func(q, k, v, ix_q2, causal=True)
    assert not np.allclose(a[:, :, 1], c[:, :, 1])
    cu_q, cu_k = batched_cu(B, s, s)
    want, _ = ref_sparse(q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), ix_q2, cu_q, cu_k, 64, 128, True)
    np.testing.assert_allclose(c.reshape(-1, hq, d), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_with_odd_lengths_and_custom_block_sizes(causal):
    lens = [(70, 150), (1, 1), (129, 65), (0, 10), (40, 0)]
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    qb, kb = 32, 48
    qbn = -(-max(a for a, _ in lens) // qb)  # 5
    ix = np.full((len(lens), 2, qbn, 3), -1, np.int32)
    rng = np.random.default_rng(1)
    for b, (_, kl) in enumerate(lens):
        kbn = -(-kl // kb)
        for h in range(2):
            for i in range(qbn):
                n = rng.integers(0, min(3, kbn) + 1)
                ix[b, h, i, :n] = rng.permutation(kbn)[:n]
    hq, hkv, d = 2, 2, 40
    q = rand(rng, (cu_q[-1], hq, d), "float32")
    k, v = rand(rng, (cu_k[-1], hkv, d), "float32"), rand(rng, (cu_k[-1], hkv, d), "float32")
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, q_block=qb, k_block=kb, causal=causal, return_lse=True,
                                               cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert out.shape == q.shape and lse.shape == (hq, cu_q[-1])
    check_fwd(out, lse, *ref_sparse(q, k, v, ix, cu_q, cu_k, qb, kb, causal), "float32")


def test_empty_query_blocks_give_zero_output_and_inf_lse():
    B, s, h, d = 1, 256, 2, 32
    ix = sp.local(B, h, 4, 2, 2)
    ix[0, 0, 1] = -1  # query block 1 of head 0: nothing kept
    ix[0, 1, 3] = -1
    rng = np.random.default_rng(2)
    q, k, v = (rand(rng, (B, s, h, d), "float32") for _ in range(3))
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, return_lse=True)
    assert np.all(out[0, 64:128, 0] == 0) and np.all(np.isinf(lse[0, 0, 64:128])) and np.all(lse[0, 0, 64:128] > 0)
    assert np.all(out[0, 192:256, 1] == 0) and np.all(np.isinf(lse[0, 1, 192:256]))
    assert np.all(np.isfinite(out)) and np.isfinite(lse[0, 0, :64]).all() and np.abs(out[0, :64, 0]).sum() > 0
    # causal with Sq > Sk: the first Sq - Sk rows see no key although their block lists blocks
    q2 = rand(rng, (1, 300, h, d), "float32")
    out2, lse2 = cubeattn.block_sparse_attn_func(q2, k, v, sp.local(1, h, 5, 2, 2), causal=True, return_lse=True)
    assert np.all(out2[0, :44] == 0) and np.all(np.isinf(lse2[0, :, :44])) and np.isfinite(lse2[0, :, 44:]).all()


@pytest.mark.parametrize("causal", [False, True])
def test_all_blocks_kept_equals_dense(causal):
    B, sq, sk, hq, hkv, d = 2, 190, 400, 4, 2, 64
    qbn, kbn = 3, 4
    ix = sp.random(B, hq, qbn, kbn, kbn, seed=4)  # every block, in random order
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, (B, sq, hq, d), "float32"), rand(rng, (B, sk, hkv, d), "float32"), rand(rng, (B, sk, hkv, d), "float32")
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, causal=causal, return_lse=True)
    dense, dlse = cubeattn.flash_attn_func(q, k, v, causal=causal, return_lse=True, device="cpu")
    np.testing.assert_allclose(out, dense, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, dlse, rtol=1e-5, atol=1e-5)


def test_unsorted_indices_give_the_same_result():
    B, s, h, d = 1, 512, 2, 32
    ix = sp.strided(B, h, 8, 4, 3)
    shuffled = sp.strided(B, h, 8, 4, 3, seed=9)
    assert not np.array_equal(ix, shuffled) and np.array_equal(np.sort(ix, -1), np.sort(shuffled, -1))
    rng = np.random.default_rng(4)
    q, k, v = (rand(rng, (B, s, h, d), "float32") for _ in range(3))
    assert np.array_equal(cubeattn.block_sparse_attn_func(q, k, v, ix), cubeattn.block_sparse_attn_func(q, k, v, shuffled))


# ---------------------------------------------------------------- gradients

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern", ["random", "local"])
def test_backward_matches_reference(pattern, causal, dtype):
    B, sq, sk, hq, hkv, d = 2, 150, 300, 4, 2, 32
    qbn, kbn = 3, 3
    ix = make_pattern(pattern, B, hkv if pattern == "local" else hq, qbn, kbn, 2, seed=6)
    rng = np.random.default_rng(12 + causal)
    q, k, v = rand(rng, (B, sq, hq, d), dtype), rand(rng, (B, sk, hkv, d), dtype), rand(rng, (B, sk, hkv, d), dtype)
    dout = rand(rng, q.shape, dtype)
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, causal=causal, return_lse=True)
    grads = cubeattn.block_sparse_attn_backward(dout, q, k, v, out, lse, ix, causal=causal)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    cu_q, cu_k = batched_cu(B, sq, sk)
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    _, _, *want = ref_sparse(flat(q), flat(k), flat(v), ix, cu_q, cu_k, 64, 128, causal, dout=flat(dout))
    tol, rel = BWD_TOL[dtype]
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        g = np.asarray(flat(g), np.float64)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=name)
        assert rel_err(g, w) <= rel, name
    again = cubeattn.block_sparse_attn_backward(dout, q, k, v, out, lse, ix, causal=causal)
    for a, b in zip(grads, again):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), "backward must be deterministic"


def test_backward_varlen_and_finite_differences():
    """Gradients of L = sum(out * G) against central finite differences in f64 of the reference."""
    lens = [(40, 90), (25, 25)]
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    ix = np.array([[[[1, -1]]], [[[0, -1]]]], np.int32)  # [2, 1, 1, 2]: seq 0 keeps key block 1, seq 1 block 0
    rng = np.random.default_rng(21)
    q, k, v = rand(rng, (65, 2, 8), "float32"), rand(rng, (115, 1, 8), "float32"), rand(rng, (115, 1, 8), "float32")
    g = rand(rng, q.shape, "float32")
    kw = dict(q_block=64, k_block=64, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, return_lse=True, **kw)
    dq, dk, dv = cubeattn.block_sparse_attn_backward(g, q, k, v, out, lse, ix, **kw)
    assert np.all(dk[:64] == 0) and np.all(dv[:64] == 0), "keys of an unlisted block get no gradient"
    loss = lambda q_, k_, v_: (ref_sparse(q_, k_, v_, ix, cu_q, cu_k, 64, 64, True)[0] * g).sum()  # noqa: E731
    base = [x.astype(np.float64) for x in (q, k, v)]
    eps = 1e-6
    for which, got in ((0, dq), (1, dk), (2, dv)):
        for flat_i in rng.choice(base[which].size, 12, replace=False):
            plus = [x.copy() for x in base]
            minus = [x.copy() for x in base]
            plus[which].reshape(-1)[flat_i] += eps
            minus[which].reshape(-1)[flat_i] -= eps
            fd = (loss(*plus) - loss(*minus)) / (2 * eps)
            assert abs(got.reshape(-1)[flat_i] - fd) <= 1e-4 + 1e-3 * abs(fd), (which, flat_i, got.reshape(-1)[flat_i], fd)


# ---------------------------------------------------------------- validation

def small(sq=64, sk=8192, hq=2, hkv=1, d=8, B=1):
    rng = np.random.default_rng(0)
    return (rand(rng, (B, sq, hq, d), "float32"), rand(rng, (B, sk, hkv, d), "float32"),
            rand(rng, (B, sk, hkv, d), "float32"))


def test_out_of_range_index_names_the_first_bad_position():
    q, k, v = small()  # 64 key blocks of 128
    ix = np.full((1, 2, 1, 4), -1, np.int32)
    ix[0, 1, 0, :] = [5, 63, 0, 70]
    ix[0, 1, 0, 3] = 70
    with pytest.raises(ValueError, match=r"block_index\[0, 1, 0, 3\] = 70 but there are 64 key blocks"):
        cubeattn.block_sparse_attn_func(q, k, v, ix)


@pytest.mark.parametrize("ix, message", [
    (np.array([[[[0, -2]], [[0, 1]]]], np.int32), r"block_index\[0, 0, 0, 1\] = -2 is negative"),
    (np.array([[[[3, 1]], [[2, 2]]]], np.int32), r"block_index\[0, 1, 0, 1\] = 2 duplicates block_index\[0, 1, 0, 0\]"),
    (np.array([[[[0, 1]], [[2, 64]]]], np.int32), r"block_index\[0, 1, 0, 1\] = 64 but there are 64 key blocks"),
    (np.zeros((1, 2, 4), np.int32), r"block_index.*rank 4"),
    (np.zeros((2, 2, 1, 1), np.int32), r"block_index.*batch 2"),
    (np.zeros((1, 3, 1, 1), np.int32), r"block_index.*3 heads"),
    (np.zeros((1, 2, 2, 1), np.int32), r"block_index.*2 query blocks"),
    (np.array([[[[2 ** 40]], [[0]]]], np.int64), r"block_index\[0, 0, 0, 0\] = 1099511627776 does not fit"),
    ([[[[0, 1, 2]], [[0, 1]]]], r"block_index"),
])
def test_bad_block_index_raises_value_error(ix, message):
    q, k, v = small()
    with pytest.raises(ValueError, match=message):
        cubeattn.block_sparse_attn_func(q, k, v, ix)


def test_block_index_dtype_and_other_arguments():
    q, k, v = small()
    ok = np.zeros((1, 2, 1, 1), np.int32)
    with pytest.raises(TypeError, match="block_index"):
        cubeattn.block_sparse_attn_func(q, k, v, ok.astype(np.float32))
    # int64 (torch.topk's dtype) is accepted
    assert np.array_equal(cubeattn.block_sparse_attn_func(q, k, v, ok.astype(np.int64)), cubeattn.block_sparse_attn_func(q, k, v, ok))
    for kw, exc, arg in [(dict(q_block=0), ValueError, "q_block"), (dict(k_block=-1), ValueError, "k_block"),
                         (dict(q_block=1.5), ValueError, "q_block"),
                         (dict(qk_int8=True, quant_gran="per_row"), ValueError, "quant_gran"),
                         (dict(qk_int8="yes"), TypeError, "qk_int8"),
                         (dict(quant_gran="per_row"), ValueError, "quant_gran"),
                         (dict(quant_gran=2), ValueError, "quant_gran"),
                         (dict(quant_gran="per_warp", qk_int8=False), ValueError, "quant_gran"),
                         (dict(quant_gran="per_warp", smooth_k="no"), TypeError, "smooth_k"),
                         (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
                         (dict(device="tpu"), ValueError, "device"), (dict(device=1), TypeError, "device")]:
        with pytest.raises(exc, match=arg):
            cubeattn.block_sparse_attn_func(q, k, v, ok, **kw)
    with pytest.raises(ValueError, match="block_index"):
        cubeattn.block_sparse_attn_func(q, k, v)
    with pytest.raises(TypeError, match="`k`"):
        cubeattn.block_sparse_attn_func(q, k.astype(np.float16), v, ok)
    with pytest.raises(ValueError, match="`q`"):
        cubeattn.block_sparse_attn_func(q[0], k[0], v[0], ok)
    with pytest.raises(TypeError, match="`q`"):
        cubeattn.block_sparse_attn_func(q.tolist(), k, v, ok)
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, ok, return_lse=True)
    with pytest.raises(ValueError, match="lse"):
        cubeattn.block_sparse_attn_backward(out, q, k, v, out, lse[:, :, :3], ok)
    with pytest.raises(ValueError, match="qk_int8"):
        spec = cubeattn.sparse_spec((64, 2, 8), (8192, 1, 8), "float32", [0, 64], [0, 8192], 64, 8192, ok, qk_int8="per_warp")
        cubeattn._core.backward(spec, *(x.reshape(-1).view(np.uint8) for x in (q, k, v, out)), lse.reshape(-1), out.reshape(-1).view(np.uint8))


def test_cuda_without_a_kernel_for_the_call_is_refused_and_auto_runs_on_the_cpu():
    # float32 has no block-sparse CUDA kernel (head_dim 8 would run padded to 64 in 16-bit):
    # NotImplementedError naming head_dim 8 and the dtype where CUDA runs, the "unavailable"
    # RuntimeError where it does not; never a silent CPU run for device="cuda"
    q, k, v = small()
    ok = np.zeros((1, 2, 1, 1), np.int32)
    cuda = cubeattn.backend_status()["cuda_available"]
    with pytest.raises(NotImplementedError if cuda else RuntimeError, match="head_dim 8|cuda"):
        cubeattn.block_sparse_attn_func(q, k, v, ok, device="cuda")
    cubeattn.block_sparse_attn_func(q, k, v, ok, device="auto")
    assert cubeattn.last_backend() == "cpu"
    out = cubeattn.block_sparse_attn_func(q, k, v, ok)
    with pytest.raises(NotImplementedError if cuda else RuntimeError, match="head_dim 8|cuda"):
        cubeattn.block_sparse_attn_backward(out, q, k, v, out, np.zeros((1, 2, 64), np.float32), ok, device="cuda")
    cubeattn.block_sparse_attn_backward(out, q, k, v, out, np.zeros((1, 2, 64), np.float32), ok, device="auto")
    assert cubeattn.last_backend() == "cpu"


# ---------------------------------------------------------------- FlexAttention BlockMask fields

def test_flex_block_mask_fields_convert_to_block_index():
    B, h, s, d = 1, 2, 384, 16
    ix = sp.random(B, h, 3, 3, 2, seed=2)
    num = (ix >= 0).sum(-1).astype(np.int32)
    kv_idx = np.where(ix >= 0, ix, 7).astype(np.int32)  # padding past kv_num_blocks is ignored, whatever it holds
    rng = np.random.default_rng(5)
    q, k, v = (rand(rng, (B, s, h, d), "float32") for _ in range(3))
    want = cubeattn.block_sparse_attn_func(q, k, v, ix, q_block=128, k_block=128)
    got = cubeattn.block_sparse_attn_func(q, k, v, q_block=128, k_block=128, kv_num_blocks=num, kv_indices=kv_idx)
    assert np.array_equal(got, want)
    # a BlockMask-like object: partial + full blocks, BLOCK_SIZE, a broadcast head dimension
    bm = types.SimpleNamespace(kv_num_blocks=num[:, :1], kv_indices=ix[:, :1, :, :1].copy(),
                               full_kv_num_blocks=np.ones((1, 1, 3), np.int32), full_kv_indices=ix[:, :1, :, 1:].copy(),
                               BLOCK_SIZE=(128, 128))
    bm.kv_num_blocks = np.ones((1, 1, 3), np.int32)
    one_head = np.repeat(ix[:, :1], h, axis=1)
    want1 = cubeattn.block_sparse_attn_func(q, k, v, one_head, q_block=128, k_block=128)
    assert np.array_equal(cubeattn.block_sparse_attn_func(q, k, v, bm), want1)
    assert np.array_equal(cubeattn.block_sparse_attn_func(q, k, v, block_mask=bm), want1)
    conv = cubeattn.block_index_from_flex(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    assert conv.shape == (1, 1, 3, 2) and np.array_equal(np.sort(conv, -1), np.sort(ix[:, :1], -1))
    with pytest.raises(ValueError, match=r"kv_num_blocks\[0, 0, 1\] = 5"):
        bad = num.copy()
        bad[0, 0, 1] = 5
        cubeattn.block_sparse_attn_func(q, k, v, q_block=128, k_block=128, kv_num_blocks=bad, kv_indices=kv_idx)
    with pytest.raises(ValueError, match="q_block"):
        cubeattn.block_sparse_attn_func(q, k, v, bm, q_block=32, k_block=32)


# ---------------------------------------------------------------- patterns

@pytest.mark.parametrize("pattern", PATTERNS)
def test_patterns_are_valid_and_keep_about_the_asked_fraction(pattern):
    B, H, qbn, kbn = 2, 3, 16, 8
    for kept in KEPT:
        top_k = sp.top_k_for(kbn, kept)
        ix = make_pattern(pattern, B, H, qbn, kbn, top_k, seed=1)
        assert ix.dtype == np.int32 and ix.shape == (B, H, qbn, top_k)
        assert ix.min() >= -1 and ix.max() < kbn
        for row in ix.reshape(-1, top_k):
            r = row[row >= 0]
            assert len(set(r.tolist())) == len(r), "no duplicates"
        n = (ix >= 0).sum(-1)
        if pattern in ("random", "strided"):
            assert np.all(n == top_k)
        else:
            assert n.mean() >= 0.5 * top_k and n.max() == top_k
    with pytest.raises(ValueError, match="top_k"):
        sp.PATTERNS[pattern](1, 1, 2, 2, -1)


def test_pattern_shapes_of_their_kind():
    assert np.array_equal(sp.local(1, 1, 4, 4, 2, causal=True)[0, 0], [[0, -1], [0, 1], [1, 2], [2, 3]])
    assert np.array_equal(sp.local(1, 1, 4, 4, 3)[0, 0], [[0, 1, 2], [0, 1, 2], [1, 2, 3], [1, 2, 3]])
    assert np.array_equal(sp.block_diagonal(1, 1, 4, 5, 2)[0, 0], [[0, 1], [0, 1], [2, 3], [4, -1]])
    assert np.array_equal(sp.strided(1, 1, 2, 8, 4)[0, 0], [[0, 2, 4, 6], [1, 3, 5, 7]])
    assert np.array_equal(sp.random(1, 1, 2, 3, 5, seed=0)[0, 0, :, 3:], -np.ones((2, 2)))
    assert not np.array_equal(sp.random(1, 2, 8, 16, 4, seed=0), sp.random(1, 2, 8, 16, 4, seed=1))


# ---------------------------------------------------------------- INT8 QK^T (SageAttention-style)

def accuracy(got, want):
    g, w = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
    cos = g @ w / (np.linalg.norm(g) * np.linalg.norm(w))
    l1 = np.abs(g - w).sum() / max(np.abs(w).sum(), 1e-30)
    rmse = np.sqrt(np.mean((g - w) ** 2))
    return cos, l1, rmse


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("gran", ["per_block", "per_warp", "per_thread"])
def test_int8_accuracy_on_normal_inputs(gran, dtype):
    B, s, hq, hkv, d = 1, 512, 4, 2, 64
    ix = sp.random(B, hq, 8, 4, 2, seed=7)
    rng = np.random.default_rng(31)
    q, k, v = (rng.standard_normal((B, s, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    from conftest import np_dtype
    q, k, v = (x.astype(np_dtype(dtype)) for x in (q, k, v))
    exact, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, causal=True, return_lse=True)
    got, lse8 = cubeattn.block_sparse_attn_func(q, k, v, ix, causal=True, return_lse=True, qk_int8=True, quant_gran=gran)
    assert got.dtype == q.dtype
    cos, l1, rmse = accuracy(got, exact)
    print(f"int8 {gran} {dtype}: cosine {cos:.5f}, rel L1 {l1:.4f}, RMSE {rmse:.5f}")
    assert cos >= 0.99 and l1 <= 0.03 and rmse <= 0.01
    fin = np.isfinite(lse)
    assert np.array_equal(fin, np.isfinite(lse8))
    assert np.abs(lse8[fin] - lse[fin]).max() < 0.05


def test_int8_finer_scales_are_more_accurate():
    B, s, h, d = 1, 1024, 2, 128
    ix = sp.strided(B, h, 16, 8, 4)
    rng = np.random.default_rng(33)
    q, k, v = (rng.standard_normal((B, s, h, d)).astype(np.float32) for _ in range(3))
    exact = cubeattn.block_sparse_attn_func(q, k, v, ix)
    l1 = {g: accuracy(cubeattn.block_sparse_attn_func(q, k, v, ix, qk_int8=True, quant_gran=g), exact)[1]
          for g in ("per_block", "per_warp", "per_thread")}
    print("rel L1 by granularity:", l1)
    assert l1["per_thread"] < l1["per_warp"] < l1["per_block"]


def test_int8_k_smoothing_keeps_accuracy_and_lse_under_a_channel_offset():
    """K with a large per-channel offset (SageAttention's observation): smoothing removes it before
    quantising, so accuracy holds, and the LSE comes back exact after the q . mean correction."""
    B, s, h, d = 1, 512, 2, 64
    ix = sp.local(B, h, 8, 4, 2)
    rng = np.random.default_rng(32)
    q, k, v = (rng.standard_normal((B, s, h, d)).astype(np.float32) for _ in range(3))
    k = k + 8.0 * rng.standard_normal(d).astype(np.float32)  # the same offset on every key
    exact, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, return_lse=True)
    res = {}
    for smooth in (True, False):
        got, lse8 = cubeattn.block_sparse_attn_func(q, k, v, ix, return_lse=True, qk_int8=True, quant_gran="per_block",
                                                    smooth_k=smooth)
        res[smooth] = accuracy(got, exact)
        print(f"smooth_k={smooth}: cosine {res[smooth][0]:.5f}, rel L1 {res[smooth][1]:.4f}, RMSE {res[smooth][2]:.5f}, "
              f"max |lse error| {np.abs(lse8 - lse).max():.4f}")
        if smooth:
            assert np.abs(lse8 - lse).max() < 0.1
    assert res[True][0] >= 0.99
    assert res[True][2] < res[False][2], "smoothing must reduce the error when K has a channel offset"


def fresh_rng(name):
    """A generator with a fresh seed (printed: a failure can be replayed with it)."""
    seed = int(np.random.SeedSequence().entropy % 2 ** 32)
    print(f"{name}: seed {seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("smooth", [True, False])
@pytest.mark.parametrize("gran", ["per_block", "per_warp", "per_thread"])
def test_int8_cpu_is_the_documented_quantisation(gran, smooth):
    """float32 inputs (no P rounding): the CPU INT8 path equals f64 attention over the operands
    quantised by the documented rule (conftest.int8_operands: groups on the kernel's tile layout,
    scale amax / 127, round half to even), LSE plus softmax_scale * q . mean(K). Varlen, odd block
    sizes, GQA, causal, fresh inputs."""
    rng = fresh_rng(f"int8 rule {gran} smooth={smooth}")
    lens = [(150, 333), (70, 90)]
    hq, hkv, d, qb, kb = 4, 2, 32, 48, 80
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], hq, d)).astype(np.float32)
    k = (rng.standard_normal((cu_k[-1], hkv, d)) + 3.0 * rng.standard_normal(d)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], hkv, d)).astype(np.float32)
    ix = sp.random(len(lens), hq, -(-150 // qb), -(-333 // kb), 3, seed=int(rng.integers(1 << 30)))
    ix[1][ix[1] >= -(-90 // kb)] = -1  # sequence 1 has 2 key blocks
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, q_block=qb, k_block=kb, causal=True, cu_seqlens_q=cu_q,
                                               cu_seqlens_k=cu_k, quant_gran=gran, smooth_k=smooth, return_lse=True,
                                               device="cpu")
    qd, kd, shift = int8_operands(q, k, cu_q, cu_k, gran, qb, kb, smooth)
    want, wl = ref_sparse(qd, kd, v, ix, cu_q, cu_k, qb, kb, True)
    wl = wl + shift
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=2e-5, rtol=1e-4)
    fin = np.isfinite(wl)
    assert np.array_equal(fin, np.isfinite(lse))
    np.testing.assert_allclose(lse[fin], wl[fin], atol=2e-4, rtol=1e-5)
    # the rule matters: another granularity's operands give measurably different output
    other = {"per_block": "per_thread", "per_warp": "per_block", "per_thread": "per_warp"}[gran]
    qo, ko, _ = int8_operands(q, k, cu_q, cu_k, other, qb, kb, smooth)
    assert np.abs(ref_sparse(qo, ko, v, ix, cu_q, cu_k, qb, kb, True)[0] - want).max() > 1e-3


@pytest.mark.parametrize("offset", [0.0, 8.0])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_int8_accuracy_against_the_f64_reference(dtype, offset):
    """Cosine similarity, relative L1 and RMSE of the INT8 path and of the exact f16/bf16 path,
    both against the f64 reference of the unquantised attention, fresh randn inputs; `offset`: K
    with a large per-channel offset (K smoothing on). Thresholds: cosine >= 0.99."""
    rng = fresh_rng(f"int8 accuracy {dtype} offset={offset}")
    from conftest import np_dtype
    B, s, hq, hkv, d = 1, 512, 4, 2, 64
    ix = sp.random(B, hq, 8, 4, 2, seed=int(rng.integers(1 << 30)))
    q, k, v = (rng.standard_normal((B, s, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    k = k + offset * rng.standard_normal(d).astype(np.float32)
    q, k, v = (x.astype(np_dtype(dtype)) for x in (q, k, v))
    cu = np.array([0, s], np.int32)
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    want, wl = ref_sparse(flat(q), flat(k), flat(v), ix, cu, cu, 64, 128, True)
    res = {}
    for gran in (None, "per_block", "per_warp", "per_thread"):
        out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, causal=True, return_lse=True, quant_gran=gran)
        res[gran] = int8_accuracy(flat(out), want)
        fin = np.isfinite(wl)
        assert np.array_equal(fin, np.isfinite(lse[0]))
        lse_err = np.abs(lse[0][fin] - wl[fin]).max()
        print(f"{dtype} offset {offset} {gran or 'exact'}: cosine {res[gran][0]:.6f}, rel L1 {res[gran][1]:.5f}, "
              f"RMSE {res[gran][2]:.6f}, max |lse err| {lse_err:.4f}")
        assert res[gran][0] >= 0.99
        assert lse_err < 0.05
    assert res["per_block"][1] > res[None][1], "quantisation must cost accuracy (or the INT8 path did not run)"


def test_int8_without_smoothing_loses_accuracy_under_a_channel_offset():
    rng = fresh_rng("int8 smoothing")
    B, s, h, d = 1, 512, 2, 64
    ix = sp.local(B, h, 8, 4, 2)
    q, k, v = (rng.standard_normal((B, s, h, d)).astype(np.float32) for _ in range(3))
    k = k + 8.0 * rng.standard_normal(d).astype(np.float32)
    cu = np.array([0, s], np.int32)
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    want, _ = ref_sparse(flat(q), flat(k), flat(v), ix, cu, cu, 64, 128, False)
    acc = {sm: int8_accuracy(flat(cubeattn.block_sparse_attn_func(q, k, v, ix, quant_gran="per_warp", smooth_k=sm)), want)
           for sm in (True, False)}
    print("smooth_k True / False (cosine, rel L1, RMSE):", acc[True], acc[False])
    assert acc[True][0] >= 0.99 and acc[True][2] < acc[False][2]


def test_quant_gran_spellings_and_float32():
    """quant_gran alone turns INT8 on; qk_int8=True alone is per_warp; float32 is emulated on the
    CPU (no CUDA kernel takes float32)."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 256, 2, 32)).astype(np.float32) for _ in range(3))
    ix = sp.random(1, 2, 4, 2, 1, seed=0)
    exact = cubeattn.block_sparse_attn_func(q, k, v, ix)
    a = cubeattn.block_sparse_attn_func(q, k, v, ix, quant_gran="per_warp")
    b = cubeattn.block_sparse_attn_func(q, k, v, ix, qk_int8=True)
    assert cubeattn.last_backend() == "cpu"
    assert np.array_equal(a, b) and not np.array_equal(a, exact)
    assert np.array_equal(exact, cubeattn.block_sparse_attn_func(q, k, v, ix, quant_gran=None, qk_int8=False))
    spec = cubeattn.sparse_spec((256, 2, 32), (256, 2, 32), "float32", [0, 256], [0, 256], 256, 256, ix,
                                quant_gran="per_thread")
    assert spec.qk_int8 == "per_thread"
    with pytest.raises(ValueError, match="quant_gran"):
        cubeattn.block_sparse_attn_func(q, k, v, spec, quant_gran="per_block")


def test_int8_with_autograd_inputs_is_refused():
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 64, 2, 16, requires_grad=True)
    k, v = torch.randn(1, 128, 2, 16), torch.randn(1, 128, 2, 16)
    with pytest.raises(ValueError, match="qk_int8"):
        cubeattn.block_sparse_attn_func(q, k, v, np.zeros((1, 2, 1, 1), np.int32), qk_int8=True)


# ---------------------------------------------------------------- torch (skipped where torch is absent)

@pytest.mark.parametrize("causal", [False, True])
def test_torch_autograd_matches_the_explicit_backward(causal):
    torch = pytest.importorskip("torch")
    B, sq, sk, hq, hkv, d = 2, 130, 260, 4, 2, 32
    ix = sp.random(B, hq, 3, 3, 2, seed=11)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, sq, hq, d, generator=g, requires_grad=True)
    k = torch.randn(B, sk, hkv, d, generator=g, requires_grad=True)
    v = torch.randn(B, sk, hkv, d, generator=g, requires_grad=True)
    go = torch.randn(B, sq, hq, d, generator=g)
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, torch.from_numpy(ix), causal=causal, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.requires_grad and lse.shape == (B, hq, sq)
    out.backward(go)
    qn, kn, vn, gn = (x.detach().numpy() for x in (q, k, v, go))
    want = cubeattn.block_sparse_attn_backward(gn, qn, kn, vn, out.detach().numpy(), lse.numpy(), ix, causal=causal)
    for name, t, w in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
        np.testing.assert_array_equal(t.numpy(), w, err_msg=name)
    cu_q, cu_k = batched_cu(B, sq, sk)
    _, _, rq, rk, rv = ref_sparse(qn.reshape(-1, hq, d), kn.reshape(-1, hkv, d), vn.reshape(-1, hkv, d), ix, cu_q, cu_k,
                                  64, 128, causal, dout=gn.reshape(-1, hq, d))
    for t, w in zip((q.grad, k.grad, v.grad), (rq, rk, rv)):
        assert rel_err(t.numpy().reshape(w.shape), w) < 1e-5


def test_torch_inputs_without_grad_and_half_precision():
    torch = pytest.importorskip("torch")
    ix = sp.local(1, 2, 2, 1, 1)
    q = torch.randn(1, 100, 2, 64, dtype=torch.bfloat16)
    k, v = torch.randn(1, 100, 2, 64, dtype=torch.bfloat16), torch.randn(1, 100, 2, 64, dtype=torch.bfloat16)
    out = cubeattn.block_sparse_attn_func(q, k, v, ix, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == q.shape
    dense = cubeattn.flash_attn_func(q, k, v, causal=True, device="cpu")
    # one key block of 100 keys covers the whole sequence: the dense result
    torch.testing.assert_close(out.float(), dense.float(), rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------- a prepared SparseSpec as block_index

def test_prepared_spec_equals_the_index_call_and_mismatches_are_refused():
    rng = np.random.default_rng(3)
    B, sq, sk, hq, hkv, d = 2, 200, 300, 4, 2, 16
    ix = sp.random(B, hq, 4, 3, 2, seed=4)
    q, k, v = rand(rng, (B, sq, hq, d), "float32"), rand(rng, (B, sk, hkv, d), "float32"), rand(rng, (B, sk, hkv, d), "float32")
    cu_q, cu_k = batched_cu(B, sq, sk)
    spec = cubeattn.sparse_spec((B * sq, hq, d), (B * sk, hkv, d), "float32", cu_q, cu_k, sq, sk, ix, causal=True)
    want, want_lse = cubeattn.block_sparse_attn_func(q, k, v, ix, causal=True, return_lse=True)
    got, got_lse = cubeattn.block_sparse_attn_func(q, k, v, spec, return_lse=True)
    assert np.array_equal(got, want) and np.array_equal(got_lse, want_lse)
    assert np.array_equal(cubeattn.block_sparse_attn_func(q, k, v, spec, causal=True), want)
    with pytest.raises(ValueError, match="k_block"):
        cubeattn.block_sparse_attn_func(q, k, v, spec, k_block=64)
    with pytest.raises(ValueError, match="softmax_scale"):
        cubeattn.block_sparse_attn_func(q, k, v, spec, softmax_scale=0.5)
    with pytest.raises(ValueError, match="block_index"):
        cubeattn.block_sparse_attn_func(q[:, :100], k, v, spec)
    with pytest.raises(ValueError, match="block_index"):
        cubeattn.block_sparse_attn_func(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), spec)
    with pytest.raises(ValueError, match="cu_seqlens"):
        cu_q2 = np.array([0, 150, 400], np.int32)
        cubeattn.block_sparse_attn_func(q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), spec,
                                        cu_seqlens_q=cu_q2, cu_seqlens_k=cu_k, max_seqlen_q=250, max_seqlen_k=sk)
    with pytest.raises(TypeError, match="`v`"):
        cubeattn.block_sparse_attn_func(q, k, v.astype(np.float16), spec)


def test_a_repeated_index_reuses_its_spec_and_a_changed_one_is_validated_again():
    from cubeattn import _sparse

    rng = np.random.default_rng(5)
    B, s, h, d = 1, 256, 2, 16
    q, k, v = (rand(rng, (B, s, h, d), "float32") for _ in range(3))
    cu = np.array([0, s], np.int32)
    ix = sp.random(B, h, 4, 2, 2, seed=6)
    args = ((s, h, d), (s, h, d), "float32", cu, cu, s, s)
    first = cubeattn.sparse_spec(*args, ix)
    # the same contents in another array (and as int64): the cached spec; other arguments: a new one
    assert cubeattn.sparse_spec(*args, ix.astype(np.int64).copy()) is first
    assert cubeattn.sparse_spec(*args, ix, causal=True) is not first
    assert cubeattn.sparse_spec(*args, ix, softmax_scale=0.5) is not first
    want = cubeattn.block_sparse_attn_func(q, k, v, ix)
    # changed in place: validated again (a duplicate is refused), and a valid change gives its own result
    ix[0, 0, 0, 1] = ix[0, 0, 0, 0]
    with pytest.raises(ValueError, match=r"block_index\[0, 0, 0, 1\] = .* duplicates"):
        cubeattn.block_sparse_attn_func(q, k, v, ix)
    ix[0, 0, 0, 1] = -1
    got = cubeattn.block_sparse_attn_func(q, k, v, ix)
    assert not np.array_equal(got, want)
    want_out, want_lse = ref_sparse(q.reshape(-1, h, d), k.reshape(-1, h, d), v.reshape(-1, h, d), ix, cu, cu, 64, 128,
                                    False)
    got, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, return_lse=True)
    check_fwd(got.reshape(-1, h, d), lse.transpose(1, 0, 2).reshape(h, -1), want_out, want_lse, "float32")
    for i in range(2 * _sparse._SPEC_CACHE_ENTRIES):  # bounded
        cubeattn.sparse_spec(*args, ix, softmax_scale=0.1 + i)
    assert len(_sparse._SPECS) == _sparse._SPEC_CACHE_ENTRIES


def test_bench_cli_seed_004_flags_check_every_pattern(tmp_path, capsys):
    from cubeattn import bench

    out = tmp_path / "r.json"
    assert bench.main(["sparse", "--device", "cpu", "--test_patterns", "--seq_lens", "200", "--head_dim", "16",
                       "--batch_size", "1", "--num_heads", "2", "--top_k_ratios", "0.5", "1.0", "--json", str(out)]) == 0
    capsys.readouterr()
    import json

    rows = json.loads(out.read_text())["rows"]
    assert {r["pattern"] for r in rows} == {"random", "local", "strided", "block_diagonal"}
    assert all(r["ok"] and r["rel_err"] < 1e-5 for r in rows), rows


def test_bench_cli_stress_runs_the_larger_checks_and_fails_loudly(tmp_path, capsys, monkeypatch):
    """--stress widens the checked shapes; a failing check makes the CLI exit 1 (so
    `gpu-test.sh test sparse --stress` cannot pass on wrong results)."""
    from cubeattn import bench

    out = tmp_path / "r.json"
    args = ["sparse", "--device", "cpu", "--test_correctness", "--stress", "--seq_lens", "300", "--head_dim", "16",
            "--batch_size", "3", "--num_heads", "6", "--top_k_ratios", "0.5", "--json", str(out)]
    assert bench.main(args) == 0
    import json

    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["ok"] and r["S"] == 300 for r in rows), rows
    monkeypatch.setattr(bench, "_sparse_ref", lambda q, *a: np.zeros(np.shape(q)) + 1.0)
    assert bench.main(args) == 1
    capsys.readouterr()
