"""Block-sparse forward and backward on CUDA (marked `gpu`; skipped unless the CUDA backend
starts): the four patterns at 10-100% kept, causal and not, f16/bf16, head_dim 64/128, index per
q head and per kv head (two cube shapes), odd lengths and block sizes, varlen with 1-token
sequences, empty rows, Sq != Sk, against the f64 reference with the token mask expanded from the
block mask; the backward bitwise deterministic; torch CUDA tensors stay on the GPU (forward and
autograd's backward) and equal the numpy path."""
import numpy as np
import pytest

import cubeattn
from cubeattn import sparse_patterns as sp
from conftest import BWD_TOL, FWD_TOL, assert_grad_close, int8_accuracy, int8_operands, rand, ref_sparse, rel_err

pytestmark = pytest.mark.gpu

PATTERNS = ["random", "local", "strided", "block_diagonal"]


def pattern(name, B, H, qbn, kbn, kept, seed):
    top_k = sp.top_k_for(kbn, kept)
    if name == "random":
        return sp.random(B, H, qbn, kbn, top_k, seed=seed)
    return sp.PATTERNS[name](B, H, qbn, kbn, top_k, seed=seed)


def check(out, lse, want_out, want_lse, dtype):
    tol, rel = FWD_TOL[dtype]
    o = np.asarray(out, np.float64)
    assert np.all(np.isfinite(o)), "every output element written and finite"
    assert rel_err(o, want_out) <= max(rel, 2e-3)
    np.testing.assert_allclose(o, want_out, atol=max(tol, 1e-2), rtol=max(tol, 1e-2))
    inf = np.isinf(want_lse)
    assert np.array_equal(np.isinf(lse), inf), "rows with no visible key (and only those) have lse +inf"
    np.testing.assert_allclose(np.asarray(lse)[~inf], want_lse[~inf], atol=1e-3, rtol=1e-3)


def run_case(rng, B, sq, sk, hq, hkv, d, dtype, causal, ix, q_block=64, k_block=128):
    """Forward and backward on CUDA (numpy inputs) against the f64 reference; a second backward
    must be bitwise identical. Returns (q, k, v, out, lse, (dq, dk, dv))."""
    q = rand(rng, (B, sq, hq, d), dtype)
    k, v = rand(rng, (B, sk, hkv, d), dtype), rand(rng, (B, sk, hkv, d), dtype)
    dout = rand(rng, q.shape, dtype)
    kw = dict(q_block=q_block, k_block=k_block, causal=causal, device="cuda")
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, return_lse=True, **kw)
    assert cubeattn.last_backend() == "cuda"
    cu_q, cu_k = np.arange(B + 1, dtype=np.int32) * sq, np.arange(B + 1, dtype=np.int32) * sk
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    want_out, want_lse, *want = ref_sparse(flat(q), flat(k), flat(v), ix, cu_q, cu_k, q_block, k_block, causal,
                                           dout=flat(dout))
    check(flat(out), lse.transpose(1, 0, 2).reshape(hq, -1), want_out, want_lse, dtype)
    grads = check_backward(dout, q, k, v, out, lse, ix, want, dtype, flat, **kw)
    return q, k, v, out, lse, grads


def check_backward(dout, q, k, v, out, lse, ix, want, dtype, flat, **kw):
    """The CUDA backward against the f64 gradients `want` on both dQ paths, each twice: bitwise
    equal when deterministic; with the fused atomic dQ (the default) dk and dv still are."""
    tol, rel = BWD_TOL[dtype]
    for det in (True, False):
        grads = cubeattn.block_sparse_attn_backward(dout, q, k, v, out, lse, ix, deterministic=det, **kw)
        assert cubeattn.last_backend() == "cuda"
        for name, g, w, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
            assert g.shape == x.shape and g.dtype == x.dtype, name
            g = np.asarray(flat(g), np.float64)
            assert np.all(np.isfinite(g)), f"{name}: every element written and finite (deterministic={det})"
            assert_grad_close(g, w, tol, rel, tol, f"{name} deterministic={det}")
        again = cubeattn.block_sparse_attn_backward(dout, q, k, v, out, lse, ix, deterministic=det, **kw)
        for name, a, b in list(zip(("dq", "dk", "dv"), grads, again))[(0 if det else 1):]:
            assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)), \
                f"{name} must be bitwise repeatable (deterministic={det})"
    return grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kept", [0.10, 0.25, 0.50, 1.00])
@pytest.mark.parametrize("name", PATTERNS)
def test_patterns_match_reference_on_cuda(name, kept, causal):
    # Sq != Sk, neither a multiple of its block (partial last blocks), GQA 4/2 with an index per q
    # head (each kv head's dK/dV is the union over its q heads' lists), batch 2
    B, sq, sk, hq, hkv, d = 2, 333, 1290, 4, 2, 128
    ix = pattern(name, B, hq, -(-sq // 64), -(-sk // 128), kept, seed=int(kept * 100))
    run_case(np.random.default_rng(int(kept * 100) + causal), B, sq, sk, hq, hkv, d, "bfloat16", causal, ix)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("per_kv_head", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_dtypes_head_dims_and_index_heads(dtype, d, per_kv_head, causal):
    # per kv head with group 4: 64-row query blocks x 4 heads = 256 packed rows (128-row cubes in
    # the forward), one list walked by the group's 4 q heads in the backward; per q head: one head
    # per 64-row cube, 8 lists
    B, sq, sk, hq, hkv = 1, 600, 700, 8, 2
    ix = pattern("random", B, hkv if per_kv_head else hq, -(-sq // 64), -(-sk // 128), 0.5, seed=d)
    run_case(np.random.default_rng(d), B, sq, sk, hq, hkv, d, dtype, causal, ix)


@pytest.mark.parametrize("q_block, k_block", [(128, 64), (32, 96), (64, 200), (16, 16), (100, 128), (256, 256), (64, 192), (48, 320)])
def test_odd_block_sizes(q_block, k_block):
    B, sq, sk, hq, hkv, d = 2, 257, 519, 2, 1, 64
    ix = pattern("random", B, hq, -(-sq // q_block), -(-sk // k_block), 0.4, seed=q_block + k_block)
    for causal in (False, True):
        run_case(np.random.default_rng(k_block), B, sq, sk, hq, hkv, d, "float16", causal, ix, q_block, k_block)


@pytest.mark.parametrize("d, k_block", [(128, 64), (128, 192), (64, 128), (64, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_128_row_query_blocks(d, k_block, causal):
    # q_block 128 per q head: 128-row cubes, k_block a multiple of the Hopper kernel's key tile
    # (64 at d128, 128 at d64): on sm_90 the wgmma forward runs these; Sq, Sk off the blocks
    B, sq, sk, hq, hkv = 2, 389, 901, 4, 2
    ix = pattern("local" if causal else "random", B, hq, -(-sq // 128), -(-sk // k_block), 0.5, seed=d + k_block)
    run_case(np.random.default_rng(d + k_block), B, sq, sk, hq, hkv, d, "bfloat16", causal, ix, 128, k_block)


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_varlen_and_single_token_sequences(per_kv_head):
    rng = np.random.default_rng(5)
    lens = [(1, 1), (65, 300), (200, 129), (1, 513), (130, 64)]
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    hq, hkv, d = 4, 2, 128
    mq, mk = max(a for a, _ in lens), max(b for _, b in lens)
    ix = pattern("random", len(lens), hkv if per_kv_head else hq, -(-mq // 64), -(-mk // 128), 0.5, seed=3)
    # block lists may only name blocks inside each sequence: drop the others (-1)
    for b, (_, kl) in enumerate(lens):
        ix[b][ix[b] >= -(-kl // 128)] = -1
    q = rand(rng, (cu_q[-1], hq, d), "bfloat16")
    k, v = rand(rng, (cu_k[-1], hkv, d), "bfloat16"), rand(rng, (cu_k[-1], hkv, d), "bfloat16")
    dout = rand(rng, q.shape, "bfloat16")
    for causal in (False, True):
        kw = dict(causal=causal, device="cuda", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, return_lse=True, **kw)
        want_out, want_lse, *want = ref_sparse(q, k, v, ix, cu_q, cu_k, 64, 128, causal, dout=dout)
        check(out, lse, want_out, want_lse, "bfloat16")
        check_backward(dout, q, k, v, out, lse, ix, want, "bfloat16", lambda x: x, **kw)


def test_empty_query_blocks_give_zero_output_inf_lse_and_zero_gradients():
    B, sq, sk, hq, hkv, d = 1, 256, 512, 2, 2, 64
    ix = pattern("random", B, hq, 4, 4, 0.5, seed=1)
    ix[0, 1, 2, :] = -1  # head 1, query block 2: nothing kept
    ix[0, 0, :, :] = -1  # head 0: nothing at all
    ix[0, 1][ix[0, 1] == 3] = -1  # key block 3 listed by no query block of head 1
    q, k, v, out, lse, (dq, dk, dv) = run_case(np.random.default_rng(2), B, sq, sk, hq, hkv, d, "float16", False, ix)
    assert np.all(out[0, :, 0].astype(np.float32) == 0) and np.all(np.isinf(lse[0, 0]))
    assert np.all(out[0, 128:192, 1].astype(np.float32) == 0) and np.all(np.isinf(lse[0, 1, 128:192]))
    assert np.all(dq[0, :, 0].astype(np.float32) == 0) and np.all(dq[0, 128:192, 1].astype(np.float32) == 0)
    assert np.all(dk[0, :, 0].astype(np.float32) == 0) and np.all(dv[0, :, 0].astype(np.float32) == 0)
    assert np.all(dk[0, 384:, 1].astype(np.float32) == 0) and np.all(dv[0, 384:, 1].astype(np.float32) == 0)
    assert np.any(dq[0, :128, 1].astype(np.float32) != 0)


def test_unsupported_calls_on_cuda_name_the_reason():
    rng = np.random.default_rng(0)
    q, k, v = rand(rng, (1, 128, 2, 128), "float32"), rand(rng, (1, 128, 2, 128), "float32"), rand(rng, (1, 128, 2, 128), "float32")
    ix = np.zeros((1, 2, 2, 1), np.int32)
    with pytest.raises(NotImplementedError, match="float32"):
        cubeattn.block_sparse_attn_func(q, k, v, ix, device="cuda")
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, return_lse=True, device="auto")
    assert cubeattn.last_backend() == "cpu"
    with pytest.raises(NotImplementedError, match="float32"):
        cubeattn.block_sparse_attn_backward(out, q, k, v, out, lse, ix, device="cuda")
    cubeattn.block_sparse_attn_backward(out, q, k, v, out, lse, ix, device="auto")
    assert cubeattn.last_backend() == "cpu"
    with pytest.raises(NotImplementedError, match="float32"):
        cubeattn.block_sparse_attn_func(q, k, v, ix, device="cuda", quant_gran="per_warp")
    cubeattn.block_sparse_attn_func(q, k, v, ix, device="auto", quant_gran="per_warp")
    assert cubeattn.last_backend() == "cpu"  # float32 INT8: emulated on the CPU


def test_torch_cuda_tensors_stay_on_the_gpu_and_equal_the_numpy_path():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    B, sq, sk, hq, hkv, d = 2, 320, 640, 8, 2, 128
    ix = pattern("random", B, hkv, 5, 5, 0.4, seed=9)
    rng = np.random.default_rng(9)
    qn, kn, vn = rand(rng, (B, sq, hq, d), "float32"), rand(rng, (B, sk, hkv, d), "float32"), rand(rng, (B, sk, hkv, d), "float32")
    q, k, v = (torch.from_numpy(x).to("cuda", torch.bfloat16) for x in (qn, kn, vn))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # q, k, v were written on the current stream
    with torch.cuda.stream(side):  # on a side stream, no synchronize before reading back
        out, lse = cubeattn.block_sparse_attn_func(q, k, v, torch.from_numpy(ix), causal=True, return_lse=True)
        assert out.is_cuda and lse.is_cuda and cubeattn.last_backend() == "cuda"
        got = out.float().cpu().numpy()
    want, want_lse = cubeattn.block_sparse_attn_func(*(x.float().cpu().numpy().astype(np.float32) for x in (q, k, v)),
                                                     ix, causal=True, return_lse=True, device="cpu")
    assert rel_err(got.astype(np.float64), want.astype(np.float64)) <= 8e-3
    # autograd: forward and backward on the GPU (device path, on the side stream), vs the CPU path's
    # gradients, and bitwise equal to the numpy CUDA path (same kernels, deterministic); the default
    # (fused atomic dQ) path close to it
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    runs = {}
    for det in (False, True):
        qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        # the clones (and dout) are written on the current stream: the side stream waits for them
        # (without it the call below raced the copies and read them half-written under GPU load)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            o = cubeattn.block_sparse_attn_func(qg, kg, vg, ix, causal=True, deterministic=det)
            o.backward(dout)
            assert cubeattn.last_backend() == "cuda"
            runs[det] = [g.cpu() for g in (qg.grad, kg.grad, vg.grad)]
    got = runs[True]
    for a, b in zip(runs[False], got):
        assert rel_err(a.float().numpy().astype(np.float64), b.float().numpy().astype(np.float64)) <= 1e-2
    qc, kc, vc = (x.detach().float().cpu().requires_grad_(True) for x in (q, k, v))
    oc = cubeattn.block_sparse_attn_func(qc, kc, vc, ix, causal=True, device="cpu")
    oc.backward(dout.float().cpu())
    for g, w, x in zip(got, (qc.grad, kc.grad, vc.grad), (qg, kg, vg)):
        assert x.grad.is_cuda and g.dtype == torch.bfloat16
        assert rel_err(g.float().numpy().astype(np.float64), w.numpy().astype(np.float64)) <= 3e-2
    import ml_dtypes

    bf = lambda t: t.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)  # noqa: E731
    on, lsen = cubeattn.block_sparse_attn_func(bf(q), bf(k), bf(v), ix, causal=True, return_lse=True, device="cuda")
    want = cubeattn.block_sparse_attn_backward(bf(dout), bf(q), bf(k), bf(v), on, lsen, ix, causal=True, device="cuda",
                                               deterministic=True)
    for g, w in zip(got, want):
        assert np.array_equal(g.view(torch.int16).numpy(), np.asarray(w).view(np.int16)), "torch path == numpy path, bit for bit"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("gran,smooth,d,q_block,k_block,causal", [
    ("per_block", True, 128, 64, 128, True),
    ("per_warp", True, 64, 128, 64, False),
    ("per_thread", True, 128, 64, 128, False),
    ("per_warp", False, 128, 48, 80, True),
    ("per_thread", False, 64, 100, 200, True),
])
def test_int8_on_cuda_matches_the_quantisation_rule_and_the_cpu(gran, smooth, d, q_block, k_block, causal, dtype):
    """CUDA INT8 Q K^T: against f64 attention over the operands quantised by the documented rule
    (conftest.int8_operands), against the CPU's INT8 path, and against the f64 reference of the
    unquantised attention (cosine >= 0.99); K with a channel offset; GQA with an index per q head
    and per kv head; odd block sizes; varlen."""
    rng = np.random.default_rng(abs(hash((gran, smooth, d, q_block, dtype))) % 2 ** 31)
    lens = [(300, 700), (1, 1), (130, 257)]
    hq, hkv = 4, 2
    cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
    cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
    q = rand(rng, (cu_q[-1], hq, d), dtype)
    k = (rng.standard_normal((cu_k[-1], hkv, d)) + 4.0 * rng.standard_normal(d)).astype(q.dtype)
    v = rand(rng, (cu_k[-1], hkv, d), dtype)
    for heads in (hq, hkv):
        kbn = [-(-b // k_block) for _, b in lens]
        ix = -np.ones((len(lens), heads, -(-300 // q_block), max(kbn)), np.int32)
        for b in range(len(lens)):
            for h in range(heads):
                for qb in range(ix.shape[2]):
                    keep = rng.permutation(kbn[b])[: max(1, kbn[b] // 2)]
                    ix[b, h, qb, : len(keep)] = keep
        kw = dict(q_block=q_block, k_block=k_block, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                  quant_gran=gran, smooth_k=smooth, return_lse=True)
        out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, device="cuda", **kw)
        assert cubeattn.last_backend() == "cuda"
        cpu_out, cpu_lse = cubeattn.block_sparse_attn_func(q, k, v, ix, device="cpu", **kw)
        o = np.asarray(out, np.float64)
        assert np.all(np.isfinite(o))
        qd, kd, shift = int8_operands(q.astype(np.float32), k.astype(np.float32), cu_q, cu_k, gran, q_block, k_block, smooth)
        want, wl = ref_sparse(qd, kd, v, ix, cu_q, cu_k, q_block, k_block, causal)
        wl = wl + shift
        tol, rel = FWD_TOL[dtype]
        assert rel_err(o, want) <= max(rel, 4e-3)
        assert rel_err(o, np.asarray(cpu_out, np.float64)) <= max(rel, 4e-3)
        fin = np.isfinite(wl)
        assert np.array_equal(fin, np.isfinite(lse))
        np.testing.assert_allclose(lse[fin], wl[fin], atol=2e-3, rtol=1e-3)
        exact, _ = ref_sparse(q, k, v, ix, cu_q, cu_k, q_block, k_block, causal)
        cos, l1, rmse = int8_accuracy(o, exact)
        print(f"cuda int8 {gran} smooth={smooth} d={d} heads={heads} {dtype}: cosine {cos:.6f} rel L1 {l1:.5f} RMSE {rmse:.6f}")
        assert cos >= 0.99


def test_int8_torch_cuda_tensors_stay_on_the_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    B, s, hq, hkv, d = 2, 256, 8, 2, 128
    ix = pattern("random", B, hq, 4, 2, 0.5, seed=3)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, s, h, d, generator=g).to("cuda", torch.float16) for h in (hq, hkv, hkv))
    out, lse = cubeattn.block_sparse_attn_func(q, k, v, torch.from_numpy(ix), quant_gran="per_thread", return_lse=True)
    assert out.is_cuda and lse.is_cuda and cubeattn.last_backend() == "cuda"
    want, wl = cubeattn.block_sparse_attn_func(*(x.cpu().numpy() for x in (q, k, v)), ix, quant_gran="per_thread",
                                               return_lse=True, device="cpu")
    assert rel_err(out.float().cpu().numpy().astype(np.float64), want.astype(np.float64)) < 4e-3
    np.testing.assert_allclose(lse.cpu().numpy(), wl, atol=2e-3, rtol=1e-3)
    qg = q.detach().requires_grad_(True)
    with pytest.raises(ValueError, match="quant_gran"):
        cubeattn.block_sparse_attn_func(qg, k, v, torch.from_numpy(ix), quant_gran="per_warp")
