"""flash_attn_with_kvcache on CUDA tensors (marked `gpu` and `torch`; skipped without both): a
decode step (B=8, one query, up to 4K keys) appending into contiguous and paged bf16 caches in
place (pages of 64 and 256 keys in place through kv_block_table, 16 through the gather path), on
the CUDA backend, against the f64 reference."""
import numpy as np
import pytest

import cubeattn
from conftest import cuda_available, ref_attention, rel_err

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.torch,
              pytest.mark.skipif(not (torch.cuda.is_available() and cuda_available()), reason="needs a CUDA GPU")]


def rand(gen, shape):
    return (torch.rand(shape, generator=gen) * 2 - 1).to(torch.bfloat16).cuda()


def f64(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def ref_rows(q, rows_k, rows_v, ends, causal=True):
    out = np.zeros(q.shape)
    for r in range(q.shape[0]):
        out[r], _ = ref_attention(q[r], rows_k[r, :ends[r]], rows_v[r, :ends[r]], [(0, q.shape[1], 0, ends[r])], causal)
    return out


@pytest.mark.parametrize("page", [None, 64, 256, 16])
def test_gpu_decode_step_appends_and_attends(page):
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, d, cap = 8, 32, 8, 128, 4096
    seqlens = torch.tensor([4095, 1, 2000, 3000, 17, 1024, 0, 777], dtype=torch.int32, device="cuda")
    q, kn, vn = rand(gen, (b, 1, hq, d)), rand(gen, (b, 1, hkv, d)), rand(gen, (b, 1, hkv, d))
    logical_k, logical_v = rand(gen, (b, cap, hkv, d)), rand(gen, (b, cap, hkv, d))
    if page is None:
        kc, vc, table = logical_k.clone(), logical_v.clone(), None
    else:
        blocks = cap // page
        perm = torch.randperm(b * blocks + 5, generator=gen)[:b * blocks]
        table = perm.reshape(b, blocks).to(torch.int32).cuda()
        kc = torch.zeros(b * blocks + 5, page, hkv, d, dtype=torch.bfloat16, device="cuda")
        vc = torch.zeros_like(kc)
        kc[table.long()] = logical_k.reshape(b, blocks, page, hkv, d)
        vc[table.long()] = logical_v.reshape(b, blocks, page, hkv, d)
    out = cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, block_table=table, causal=True)
    assert out.is_cuda and out.shape == q.shape and cubeattn.last_backend() == "cuda"
    rows = torch.arange(b, device="cuda")
    logical_k[rows, seqlens.long()], logical_v[rows, seqlens.long()] = kn[:, 0], vn[:, 0]
    if table is None:
        got_k, got_v = kc, vc
    else:
        got_k, got_v = (c[table.long()].reshape(b, cap, hkv, d) for c in (kc, vc))
    assert torch.equal(got_k, logical_k) and torch.equal(got_v, logical_v)
    ref = ref_rows(f64(q), f64(logical_k), f64(logical_v), (seqlens + 1).cpu().numpy())
    assert rel_err(f64(out), ref) < 1e-2


@pytest.mark.parametrize("lens", ["int", "tensor", "ragged"])
def test_gpu_decode_loop_fast_path_is_the_validating_path(lens, monkeypatch):
    """Decode steps appending one token (keys growing, one step repeated): after the first step
    the calls take the fast path (`_kvcache._plain_call`: the cached spec, straight to the
    device-resident forward); caches must equal the validating path's exactly, and so must outputs
    and lse with an int cache_seqlens. A CUDA tensor's counts stay on the device (the plan covers
    the whole cache, so its split of the keys differs): outputs within rounding there."""
    from cubeattn import _kvcache

    b, hq, hkv, d, cap = 8, 32, 8, 128, 1024
    calls, real = [], _kvcache._general
    monkeypatch.setattr(_kvcache, "_SEEN", {})
    monkeypatch.setattr(_kvcache, "_DSPEC", {})
    monkeypatch.setattr(_kvcache, "_general", lambda *a: calls.append(1) or real(*a))

    def run():
        gen = torch.Generator().manual_seed(1)
        q = rand(gen, (b, 1, hq, d))
        kc, vc = rand(gen, (b, cap, hkv, d)), rand(gen, (b, cap, hkv, d))
        outs = []
        for base in (100, 101, 101, 400, 1000):
            kn, vn = rand(gen, (b, 1, hkv, d)), rand(gen, (b, 1, hkv, d))
            per_row = [base - 7 * r for r in range(b)] if lens == "ragged" else [base] * b
            seqlens = base if lens == "int" else torch.tensor(per_row, dtype=torch.int32, device="cuda")
            outs.append(cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True,
                                                         return_softmax_lse=True))
            assert cubeattn.last_backend() == "cuda"
        return outs, kc, vc

    fast = run()
    assert len(calls) == 1
    monkeypatch.setattr(_kvcache, "FAST", False)
    slow = run()
    assert len(calls) == 6
    for a, b_ in zip(fast[1:], slow[1:]):
        assert torch.equal(a, b_)
    for (fo, fl), (so, sl) in zip(fast[0], slow[0]):
        assert fo.is_cuda
        if lens == "int":
            assert torch.equal(fo, so) and torch.equal(fl, sl)
        else:
            assert rel_err(f64(fo), f64(so)) < 2e-3 and (fl - sl).abs().max().item() < 1e-3


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_gpu_unused_cache_rows_are_never_read(fill):
    """A cache allocated without zeroing (here: NaN or Inf past each row's keys, what torch.empty
    may hold) gives the attention of the written keys only, finite, as a zeroed cache does."""
    gen = torch.Generator().manual_seed(3)
    b, hq, hkv, d, cap = 4, 16, 4, 128, 1024
    lens = [1000, 63, 64, 511]
    q, kn, vn = rand(gen, (b, 1, hq, d)), rand(gen, (b, 1, hkv, d)), rand(gen, (b, 1, hkv, d))
    logical_k, logical_v = rand(gen, (b, cap, hkv, d)), rand(gen, (b, cap, hkv, d))
    kc = torch.full_like(logical_k, fill)
    vc = torch.full_like(logical_v, fill)
    for r, n in enumerate(lens):
        kc[r, :n], vc[r, :n] = logical_k[r, :n], logical_v[r, :n]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True)
    assert cubeattn.last_backend() == "cuda" and torch.isfinite(out).all()
    rows = torch.arange(b, device="cuda")
    logical_k[rows, seqlens.long()], logical_v[rows, seqlens.long()] = kn[:, 0], vn[:, 0]
    ref = ref_rows(f64(q), f64(logical_k), f64(logical_v), [n + 1 for n in lens])
    assert rel_err(f64(out), ref) < 1e-2


def test_gpu_decode_steps_replay_in_a_cuda_graph():
    """A decode step with an int32 CUDA cache_seqlens captured in a CUDA graph (no host sync in the
    step), replayed with new q / k / v and the counts advanced in place: each replay appends at the
    new counts and attends over them (the f64 reference), rows of different lengths."""
    gen = torch.Generator().manual_seed(5)
    b, hq, hkv, d, cap = 4, 32, 8, 128, 2048
    kc, vc = rand(gen, (b, cap, hkv, d)), rand(gen, (b, cap, hkv, d))
    q, kn, vn = rand(gen, (b, 1, hq, d)), rand(gen, (b, 1, hkv, d)), rand(gen, (b, 1, hkv, d))
    seqlens = torch.tensor([100, 1, 1500, 63], dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # first calls (the validating path, then the device-count path)
        for _ in range(2):
            cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    kc, vc = rand(gen, (b, cap, hkv, d)), rand(gen, (b, cap, hkv, d))  # fresh caches: the graph reads these
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True)
    logical_k, logical_v = kc.clone(), vc.clone()
    rows = torch.arange(b, device="cuda")
    for step in range(3):
        q.copy_(rand(gen, q.shape))
        kn.copy_(rand(gen, kn.shape))
        vn.copy_(rand(gen, vn.shape))
        graph.replay()
        torch.cuda.synchronize()
        logical_k[rows, seqlens.long()], logical_v[rows, seqlens.long()] = kn[:, 0], vn[:, 0]
        assert torch.equal(kc, logical_k) and torch.equal(vc, logical_v), f"step {step}"
        ref = ref_rows(f64(q), f64(logical_k), f64(logical_v), (seqlens + 1).cpu().numpy())
        assert rel_err(f64(out), ref) < 1e-2, f"step {step}"
        seqlens += 1


def test_gpu_device_counts_that_do_not_fit_give_nan_rows():
    """Counts read on the device cannot raise: a row whose count does not fit the cache (negative,
    or no room for the new key) is not appended to and its out and lse are NaN; the other rows are
    appended and attended as usual."""
    gen = torch.Generator().manual_seed(6)
    b, hq, hkv, d, cap = 4, 16, 4, 64, 256
    kc, vc = rand(gen, (b, cap, hkv, d)), rand(gen, (b, cap, hkv, d))
    q, kn, vn = rand(gen, (b, 1, hq, d)), rand(gen, (b, 1, hkv, d)), rand(gen, (b, 1, hkv, d))
    good = torch.tensor([10, 20, 30, 40], dtype=torch.int32, device="cuda")
    cubeattn.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=good,
                                     return_softmax_lse=True)  # the validating path (the same call key)
    seqlens = torch.tensor([10, -1, 256, 40], dtype=torch.int32, device="cuda")
    k0, v0 = kc.clone(), vc.clone()
    out, lse = cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, return_softmax_lse=True)
    torch.cuda.synchronize()
    for r in (1, 2):
        assert torch.isnan(out[r]).all() and torch.isnan(lse[r]).all()
        assert torch.equal(kc[r], k0[r]) and torch.equal(vc[r], v0[r])
    for r, n in ((0, 10), (3, 40)):
        assert torch.equal(kc[r, n], kn[r, 0]) and torch.equal(vc[r, n], vn[r, 0])
        ref, _ = ref_attention(f64(q[r]), f64(kc[r, :n + 1]), f64(vc[r, :n + 1]), [(0, 1, 0, n + 1)], False)
        assert torch.isfinite(out[r]).all() and rel_err(f64(out[r]), ref) < 1e-2


@pytest.mark.parametrize("window", [(-1, -1), (100, 0)])
def test_gpu_device_counts_several_new_tokens(window):
    """Three new tokens a row (speculative decoding's shape), causal, with and without a window,
    ragged counts (one row empty before the step): the device-count path (second call of the
    shapes; with a left window its plan covers whole rows and the kernel starts each cube at its
    rows' first key: a plan bounded by the capacity's last rows once gave the empty row no key)
    against the f64 reference over each row's keys after the append."""
    from cubeattn import _kvcache
    gen = torch.Generator().manual_seed(7)
    b, sq, hq, hkv, d, cap = 3, 3, 16, 4, 128, 700
    kc, vc = rand(gen, (b, cap, hkv, d)), rand(gen, (b, cap, hkv, d))
    q, kn, vn = rand(gen, (b, sq, hq, d)), rand(gen, (b, sq, hkv, d)), rand(gen, (b, sq, hkv, d))
    lens = [0, 250, 697]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cubeattn.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=seqlens, causal=True,
                                     window_size=window)  # the validating path
    logical_k, logical_v = kc.clone(), vc.clone()
    declined = len(_kvcache._NO_DEVICE)
    out = cubeattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True, window_size=window)
    assert cubeattn.last_backend() == "cuda"
    assert len(_kvcache._NO_DEVICE) == declined, "the device-count path declined the call"
    for r, n in enumerate(lens):
        logical_k[r, n:n + sq], logical_v[r, n:n + sq] = kn[r], vn[r]
    assert torch.equal(kc, logical_k) and torch.equal(vc, logical_v)
    fq, fk, fv = f64(q), f64(logical_k), f64(logical_v)
    for r, n in enumerate(lens):
        ref, _ = ref_attention(fq[r], fk[r, :n + sq], fv[r, :n + sq], [(0, sq, 0, n + sq)], True, window=window)
        assert rel_err(f64(out[r]), ref) < 1e-2, f"row {r}"
