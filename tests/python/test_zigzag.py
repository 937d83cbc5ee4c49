"""Zigzag context parallelism: layout helpers, seed 002's extract/scatter components (exact), and
the torch.distributed layer on CPU processes with gloo (W = 1, 2, 3; skipped without torch) and on
GPUs with NCCL under torchrun (marked `gpu`; needs >= 2 GPUs)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import cubeattn
from conftest import np_dtype

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------- straightforward references

def chunks_of(x, lens, w):
    """[[chunk 0, ..., chunk 2W-1] per sequence] of a packed batch, by plain slicing."""
    out, s = [], 0
    for n in lens:
        c = n // (2 * w)
        out.append([x[s + j * c:s + (j + 1) * c] for j in range(2 * w)])
        s += n
    return out


def ref_shard(x, lens, r, w):
    parts = []
    for ch in chunks_of(x, lens, w):
        parts += [ch[r], ch[2 * w - 1 - r]]
    return np.concatenate(parts, 0)


def ref_gathered(x, lens, w):
    """What all_gather_into_tensor of every rank's shard gives: rank 0's shard, rank 1's, ..."""
    return np.concatenate([ref_shard(x, lens, r, w) for r in range(w)], 0)


def ref_prefix(x, lens, w, m):
    """Chunks 0..m of every sequence in original order, sequences concatenated."""
    return np.concatenate([np.concatenate(ch[:m + 1], 0) for ch in chunks_of(x, lens, w)], 0)


def ref_prefix_mask(lens, w, m):
    mask, s = np.zeros(sum(lens), bool), 0
    for n in lens:
        mask[s:s + (m + 1) * (n // (2 * w))] = True
        s += n
    return mask


def cu_of(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def data(lens, dtype, heads=3, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((sum(lens), heads, d)).astype(np.float32).astype(np_dtype(dtype))


def same(a, b):
    """Exact equality, bit for bit (difference 0), shapes and dtypes included."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.tobytes() == b.tobytes()


# ---------------------------------------------------------------- layout helpers

@pytest.mark.parametrize("w", [1, 2, 3, 4, 8])
def test_split_then_merge_is_the_identity(w):
    lens = [2 * w * n for n in (5, 1, 0, 9)]
    x = data(lens, "float32")
    cu = cu_of(lens)
    shards = [cubeattn.zigzag_split(x, cu, r, w) for r in range(w)]
    for r, s in enumerate(shards):
        same(s, ref_shard(x, lens, r, w))
    same(cubeattn.zigzag_merge(shards, cu, w), x)
    same(cubeattn.zigzag_merge(np.concatenate(shards, 0), cu, w), x)
    local = cubeattn.zigzag_cu_seqlens(cu, w)
    assert local.dtype == np.int32 and local.tolist() == (cu // w).tolist()
    assert [s.shape[0] for s in shards] == [local[-1]] * w


@pytest.mark.parametrize("w", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_extract_single_sequence_early_chunks(w, dtype):
    lens = [1024]
    x = data(lens, dtype, seed=w)
    g = ref_gathered(x, lens, w)
    for m in range(w):  # chunks 0 .. W-1
        same(cubeattn.extract_zigzag_kv_slice(g, cu_of(lens), w, max_chunk_idx=m), ref_prefix(x, lens, w, m))


@pytest.mark.parametrize("w", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_extract_late_chunks_and_full_sequence(w, dtype):
    lens = [1024]
    x = data(lens, dtype, seed=10 + w)
    g = ref_gathered(x, lens, w)
    for m in range(w, 2 * w):  # chunks W .. 2W-1 (the last one: the whole sequence)
        same(cubeattn.extract_zigzag_kv_slice(g, cu_of(lens), w, max_chunk_idx=m), ref_prefix(x, lens, w, m))
    same(cubeattn.extract_zigzag_kv_slice(g, cu_of(lens), w), x)


@pytest.mark.parametrize("w", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_extract_multiple_sequences(w, dtype):
    lens = [512, 1024, 768]
    x = data(lens, dtype, heads=2, d=64, seed=20 + w)
    g = ref_gathered(x, lens, w)
    for m in (0, w - 1, w, 2 * w - 1):
        same(cubeattn.extract_zigzag_kv_slice(g, cu_of(lens), w, max_chunk_idx=m), ref_prefix(x, lens, w, m))


@pytest.mark.parametrize("lens", [[1024], [512, 1024, 768]], ids=["single", "multiple"])
@pytest.mark.parametrize("w", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_scatter_grad_to_zigzag(lens, w, dtype):
    x = data(lens, dtype, seed=30 + w)
    for m in (0, w - 1, w, 2 * w - 1):
        grad = ref_prefix(x, lens, w, m)
        full = np.where(ref_prefix_mask(lens, w, m)[:, None, None], x, np.zeros_like(x))
        same(cubeattn.scatter_grad_to_zigzag(grad, cu_of(lens), w, max_chunk_idx=m), ref_gathered(full, lens, w))


def test_extract_and_scatter_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    lens, w = [512, 1024, 768], 4
    x = torch.randn(sum(lens), 2, 64).to(torch.bfloat16)
    xn = x.view(torch.int16).numpy()  # compare the bits
    g = torch.from_numpy(ref_gathered(xn, lens, w)).view(torch.bfloat16)
    ex = cubeattn.extract_zigzag_kv_slice(g, cu_of(lens), w, max_chunk_idx=5)
    assert isinstance(ex, torch.Tensor) and ex.dtype == torch.bfloat16
    same(ex.view(torch.int16).numpy(), ref_prefix(xn, lens, w, 5))
    back = cubeattn.scatter_grad_to_zigzag(ex, cu_of(lens), w, max_chunk_idx=5)
    full = np.where(ref_prefix_mask(lens, w, 5)[:, None, None], xn, 0).astype(np.int16)
    same(back.view(torch.int16).numpy(), ref_gathered(full, lens, w))
    # the split helper keeps torch tensors torch
    s = cubeattn.zigzag_split(x, torch.from_numpy(cu_of(lens)), 1, w)
    assert isinstance(s, torch.Tensor) and s.shape[0] == sum(lens) // w


# ---------------------------------------------------------------- errors

def test_sequence_not_divisible_by_2w_names_sequence_and_multiple():
    x = data([16, 18], "float32")
    with pytest.raises(ValueError, match=r"sequence 1 has length 18, not a multiple of 2 \* world_size = 4"):
        cubeattn.zigzag_split(x, cu_of([16, 18]), 0, 2)
    with pytest.raises(ValueError, match="sequence 1"):
        cubeattn.zigzag_cu_seqlens(cu_of([16, 18]), 2)
    with pytest.raises(ValueError, match=r"sequence 0 .* multiple of 2 \* world_size = 6"):
        cubeattn.extract_zigzag_kv_slice(data([16], "float32"), cu_of([16]), 3)


def test_bad_helper_arguments_raise_naming_the_argument():
    x = data([16], "float32")
    cu = cu_of([16])
    with pytest.raises(ValueError, match="`rank`"):
        cubeattn.zigzag_split(x, cu, 2, 2)
    with pytest.raises(ValueError, match="`world_size`"):
        cubeattn.zigzag_split(x, cu, 0, 0)
    with pytest.raises(TypeError, match="`world_size`"):
        cubeattn.zigzag_split(x, cu, 0, True)
    with pytest.raises(TypeError, match="`rank`"):
        cubeattn.zigzag_split(x, cu, 0.5, 2)
    with pytest.raises(ValueError, match="`x`"):
        cubeattn.zigzag_split(x[:8], cu, 0, 2)
    with pytest.raises(ValueError, match="`cu_seqlens`"):
        cubeattn.zigzag_split(x, np.array([4, 16], np.int32), 0, 2)
    with pytest.raises(ValueError, match="`cu_seqlens`"):
        cubeattn.zigzag_cu_seqlens(np.array([0, 8, 4], np.int32), 1)
    with pytest.raises(ValueError, match="`max_chunk_idx`"):
        cubeattn.extract_zigzag_kv_slice(x, cu, 2, max_chunk_idx=4)
    with pytest.raises(ValueError, match="`kv`"):
        cubeattn.extract_zigzag_kv_slice(x[:12], cu, 2)
    with pytest.raises(ValueError, match="`grad`"):
        cubeattn.scatter_grad_to_zigzag(x[:5], cu, 2, max_chunk_idx=1)
    with pytest.raises(ValueError, match="`shards`"):
        cubeattn.zigzag_merge([x[:8]], cu, 2)
    with pytest.raises(TypeError, match="`kv`"):
        cubeattn.extract_zigzag_kv_slice(x.astype(np.float64), cu, 2)


def test_layer_rejects_bad_input_before_any_collective():
    torch = pytest.importorskip("torch")
    f = cubeattn.zigzag_llama3_flash_attn_varlen_func
    q, k = torch.randn(8, 4, 16), torch.randn(8, 2, 16)
    cu = np.array([0, 8], np.int32)
    with pytest.raises(TypeError, match="`q`"):
        f(q.numpy(), k, k, cu, cu, 8, 8, 1)
    with pytest.raises(ValueError, match="`heads_k_stride`"):
        f(q, k, k, cu, cu, 8, 8, 3)
    with pytest.raises(ValueError, match="`heads_k_stride`"):
        f(q, k, k, cu, cu, 8, 8, 0)
    with pytest.raises(ValueError, match="`cu_seqlens_q`.*local sequence 1 has 3 tokens"):
        f(q, k, k, np.array([0, 2, 5, 8], np.int32), np.array([0, 2, 5, 8], np.int32), 8, 8, 1)
    with pytest.raises(ValueError, match="`cu_seqlens_q`"):
        f(q, k, k, np.array([0, 6], np.int32), np.array([0, 6], np.int32), 8, 8, 1)
    with pytest.raises(ValueError, match="`cu_seqlens_k`"):
        f(q, k, k, cu, np.array([0, 4, 8], np.int32), 8, 8, 1)
    with pytest.raises(ValueError, match="`max_seqlen_q`"):
        f(q, k, k, cu, cu, 4, 8, 1)
    with pytest.raises(ValueError, match="`local_k_slice`"):
        f(q, k, k, cu, cu, 8, 8, 1, local_k_slice=slice(0, 4))
    with pytest.raises(TypeError, match="dtype for `k`"):
        f(q, k.double(), k, cu, cu, 8, 8, 1)
    with pytest.raises(ValueError, match="`k`"):
        f(q, torch.randn(8, 3, 16), torch.randn(8, 3, 16), cu, cu, 8, 8, 1)
    with pytest.raises(TypeError, match="`keep_gathered_kv`"):
        f(q, k, k, cu, cu, 8, 8, 1, keep_gathered_kv="yes")
    import torch.distributed as dist

    if not dist.is_initialized():
        with pytest.raises(ValueError, match="`group`.*not initialized"):
            f(q, k, k, cu, cu, 8, 8, 1)


# ---------------------------------------------------------------- the in-place read, every rank emulated

def check_in_place_read(w, lens, dtype, causal, device, stride_heads=(4, 2), d=64, seed=0):
    """Every rank r of a W-rank zigzag layer, emulated in one process: the grouped call over the
    gathered K,V read in place (the layer's kv_block_table) against the same call over K,V in
    sequence order (the ordered copy): out, lse, dq bit for bit (deterministic backward), dk and dv
    bit for bit in the gathered layout (rank-major, what the reduce-scatter takes)."""
    import torch

    from cubeattn import zigzag as zz

    hq, hk = stride_heads
    cu = cu_of(lens)
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    q, k, v, g = (torch.randn(sum(lens), h, d, generator=gen).to(dt).to(device) for h in (hq, hk, hk, hq))
    local_cu = cubeattn.zigzag_cu_seqlens(cu, w)
    kg = torch.cat([cubeattn.zigzag_split(k, cu, j, w) for j in range(w)])
    vg = torch.cat([cubeattn.zigzag_split(v, cu, j, w) for j in range(w)])
    checked = 0
    for r in range(w):
        plan = zz._Plan(local_cu, w, r, int(local_cu[-1]), causal)
        assert plan.kv_block_table is not None
        lq, lg = cubeattn.zigzag_split(q, cu, r, w), cubeattn.zigzag_split(g, cu, r, w)
        args = (plan.q_ranges, plan.kv_ranges)
        o1, l1 = cubeattn.grouped_flash_attn_func(lq, k, v, *args, causal=causal, return_lse=True)
        o2, l2 = cubeattn.grouped_flash_attn_func(lq, kg, vg, *args, causal=causal, return_lse=True,
                                                  kv_block_table=plan.kv_block_table)
        same(o1.cpu().float().numpy(), o2.cpu().float().numpy())
        same(l1.cpu().numpy(), l2.cpu().numpy())
        for det in (True, False):
            g1 = cubeattn.grouped_flash_attn_backward(lg, lq, k, v, o1, l1, *args, causal=causal, deterministic=det)
            g2 = cubeattn.grouped_flash_attn_backward(lg, lq, kg, vg, o1, l1, *args, causal=causal,
                                                      deterministic=det, kv_block_table=plan.kv_block_table)
            for a, b in ((g1[1], g2[1]), (g1[2], g2[2])):
                a = torch.cat([cubeattn.zigzag_split(a, cu, j, w) for j in range(w)])
                same(a.cpu().float().numpy(), b.cpu().float().numpy())
            if det:
                same(g1[0].cpu().float().numpy(), g2[0].cpu().float().numpy())
            else:  # atomics in any order on CUDA
                a, b = g1[0].double(), g2[0].double()
                assert ((a - b).norm() / a.norm().clamp_min(1e-30)).item() < 1e-2
        checked += 1
    assert checked == w


@pytest.mark.torch
@pytest.mark.parametrize("w", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_in_place_read_of_every_rank_equals_the_ordered_call_cpu(w, causal):
    pytest.importorskip("torch")
    m = 2 * w * 64
    check_in_place_read(w, [2 * m, 0, m], "float32", causal, "cpu")


def test_plan_falls_back_to_the_ordered_copy_off_the_block():
    """Chunks that are not a multiple of 64 keys (or CUBEATTN_ZIGZAG_IN_PLACE=0) keep the copy."""
    from cubeattn import zigzag as zz

    local = cubeattn.zigzag_cu_seqlens(cu_of([2 * 2 * 96]), 2)
    assert zz._Plan(local, 2, 0, int(local[-1]), True).kv_block_table is None
    local = cubeattn.zigzag_cu_seqlens(cu_of([2 * 2 * 128]), 2)
    assert zz._Plan(local, 2, 1, int(local[-1]), True, in_place=False).kv_block_table is None
    table = zz._Plan(local, 2, 1, int(local[-1]), True).kv_block_table
    # 4 chunks of 128 keys (2 blocks each): rank 0 holds chunks 0, 3, rank 1 chunks 1, 2
    assert table.tolist() == [0, 1, 4, 5, 6, 7, 2, 3]


# ---------------------------------------------------------------- the distributed layer, CPU + gloo

@pytest.mark.torch
@pytest.mark.parametrize("w,dtype", [(1, "float32"), (2, "float32"), (3, "float32"), (2, "bfloat16"), (8, "float32")])
def test_zigzag_layer_gloo_matches_whole_sequence_attention(w, dtype, tmp_path):
    pytest.importorskip("torch")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    import zigzag_worker

    results = zigzag_worker.spawn_main(w, dtype, str(tmp_path))
    assert [r["rank"] for r in results] == list(range(w))
    for r in results:
        assert "error" not in r, r.get("error")
        assert len(r["cases"]) == len(zigzag_worker.cpu_cases(w))
        for c in r["cases"]:
            assert set(k for k in c["res"] if k.endswith("_vs_ref")) == {"out_vs_ref", "dq_vs_ref", "dk_vs_ref",
                                                                       "dv_vs_ref"}
            bad = zigzag_worker.failures(c["res"], dtype)
            assert not bad, f"rank {r['rank']} case {c['case']}: {bad}"


def test_failures_catches_errors_over_the_bound():
    """The checker itself: a result over its bound, or NaN, is reported."""
    import zigzag_worker

    assert zigzag_worker.failures({"out_vs_ref": 1e-7, "dk_vs_one": 1e-6}, "float32") == []
    assert len(zigzag_worker.failures({"out_vs_ref": 1e-2}, "float32")) == 1
    assert len(zigzag_worker.failures({"dq_vs_one": float("nan")}, "bfloat16")) == 1
    assert len(zigzag_worker.failures({"dv_shape": float("inf")}, "float16")) == 1


# ---------------------------------------------------------------- GPUs + NCCL under torchrun

def _gpus():
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_zigzag_layer_nccl_torchrun(dtype, tmp_path):
    n = _gpus()
    if n < 2:
        pytest.skip(f"needs >= 2 CUDA GPUs visible to torch, found {n}")
    out = tmp_path / "zigzag.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={min(n, 4)}",
           os.path.join(HERE, "zigzag_worker.py"), "--dtype", dtype, "--json", str(out)]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert out.exists() and "0 failed checks" in r.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_zigzag_layer_gloo_cuda_ranks_share_one_gpu(dtype, tmp_path):
    """The whole layer on CUDA tensors (kernels, comm stream, the in-place read) with W = 1..4
    (W = 3 a subgroup) on a single GPU: four torchrun processes, gloo collectives."""
    if _gpus() < 1:
        pytest.skip("needs a CUDA GPU visible to torch")
    out = tmp_path / "zigzag.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           os.path.join(HERE, "zigzag_worker.py"), "--backend", "gloo", "--device", "cuda", "--dtype", dtype,
           "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert out.exists() and "40 (rank, W, case) runs, 0 failed checks" in r.stdout
