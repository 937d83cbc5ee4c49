"""Zigzag llama3 context parallelism with cubeattn: one packed varlen batch spread over W ranks.

    torchrun --nproc_per_node 2 examples/zigzag_cp.py            # GPUs: NCCL, bfloat16
    torchrun --nproc_per_node 2 examples/zigzag_cp.py --cpu      # CPU processes: gloo, float32

Every rank builds the same full batch (same seed), keeps its zigzag shard, runs attention with
autograd, and checks its output and gradients against attention over the whole batch in one
process (cubeattn's varlen call).
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist

import cubeattn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true", help="CPU tensors and gloo instead of GPUs and NCCL")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32

    # a packed batch of documents of any lengths (a 1-token one among them)
    m = 2 * world * (64 if cuda else 8)
    seqlens = [3 * m + 5, 8 * m - 3, 1, 1 * m]
    cu = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
    heads_q, heads_kv, d = (32, 8, 128) if cuda else (4, 2, 64)
    gen = torch.Generator().manual_seed(0)  # the same full batch on every rank
    q, k, v, dout = (torch.randn(int(cu[-1]), h, d, generator=gen).to(dtype).to(device)
                     for h in (heads_q, heads_kv, heads_kv, heads_q))

    # this rank's shard: chunks rank and 2W-1-rank of every sequence (the first L % 2W chunks of a
    # sequence hold one token more), and its local cu_seqlens; the layer is given the full ones
    local_cu = cubeattn.zigzag_cu_seqlens(cu, world, rank)
    lq, lk, lv = (cubeattn.zigzag_split(x, cu, rank, world).requires_grad_() for x in (q, k, v))
    max_local = int(np.diff(local_cu).max())
    out = cubeattn.zigzag_llama3_flash_attn_varlen_func(lq, lk, lv, local_cu, local_cu, max_local, max_local,
                                                        heads_k_stride=heads_kv // 2, causal=True,
                                                        full_cu_seqlens=cu)
    out.backward(cubeattn.zigzag_split(dout, cu, rank, world))

    # the same attention over the whole batch in this one process
    fq, fk, fv = (x.clone().requires_grad_() for x in (q, k, v))
    full = cubeattn.flash_attn_varlen_func(fq, fk, fv, cu, cu, max(seqlens), max(seqlens), causal=True)
    full.backward(dout)

    def rel(a, b):
        b = cubeattn.zigzag_split(b.detach(), cu, rank, world).float()
        return ((a.detach().float() - b).norm() / b.norm()).item()

    errs = {"out": rel(out, full), "dq": rel(lq.grad, fq.grad), "dk": rel(lk.grad, fk.grad), "dv": rel(lv.grad, fv.grad)}
    # the whole output back in original order, from every rank's shard (the shards differ in length:
    # each is padded at its end to the longest for the all-gather, which zigzag_merge takes)
    block = max(int(cubeattn.zigzag_cu_seqlens(cu, world, r)[-1]) for r in range(world))
    padded = torch.zeros((block,) + tuple(out.shape[1:]), dtype=out.dtype, device=out.device)
    padded[:out.shape[0]] = out.detach()
    shards = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(shards, padded)
    merged = cubeattn.zigzag_merge(torch.cat(shards), cu, world)
    errs["merged_out"] = ((merged.float() - full.detach().float()).norm() / full.detach().float().norm()).item()
    print(f"rank {rank}/{world} ({device}, {dtype}): relative error vs one process " +
          ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
    bound = 1e-2 if cuda else 1e-4
    ok = all(e <= bound for e in errs.values())
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
