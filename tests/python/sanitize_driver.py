"""Small calls of one CUDA kernel family, for compute-sanitizer (scripts/gpu-test.sh sanitize):

    python tests/python/sanitize_driver.py FAMILY

FAMILY: forward (tensor-core forward without split-K, f16/bf16; the f32 row-wise kernels),
splitk (few rows over many keys: split-K partials and the combine kernel, uncovered rows),
backward_pass (the deterministic dQ pass: on sm_90 the wgmma one at head_dim 64 and 128),
backward_atomic (dQ fused with f32 atomics, CUBEATTN_BWD_DQ=atomic), grouped (overlapping groups, an empty group, rows in no group; forward
and backward), sparse (block-sparse forward: 64- and 128-row cubes, empty rows, odd block
sizes), sparse_backward (its dK/dV kernel, both dQ paths, the transposed index), sparse_int8 (INT8
Q K^T: quantisation kernels and the INT8 forward, checked against the exact CPU result), window
(sliding window, forward and both dQ paths), nonfinite (an Inf or NaN in v: the device-side flag
and the exact kernels it selects, forward and backward), decode (decode-sized calls: one to four
query rows a sequence over keys off the tiles, with and without a window), paged (grouped calls over a paged K,V:
kv_block_table, tiles across two pages, both dQ paths): head_dim 64 and 128, causal and not;
head_dims (the other head dims: forward and split-K at 32, 96, 192, 256, both backward paths at
32, 96, 192 and 256 (paged K,V too above 128), bf16, causal and not); padded (head dims without
a kernel of their own, 33, 80 and 160, on the next one with zero columns: forward, both backward
paths, paged K,V, block-sparse at 33 and 80; v with a head_dim of its own, 192 / 128, 160 / 128
and 64 / 128). Each result is checked against the CPU
backend, so a run also fails (exit 1) on a wrong answer. numpy inputs only: no torch kernels run
under the sanitizer. The environment switches each family needs are set here, before cubeattn
loads (the CUDA options are read once)."""
import os
import sys

FAMILIES = {
    "forward": {"CUBEATTN_CUDA_SPLIT": "0"},
    "splitk": {"CUBEATTN_CUDA_SPLIT": "1"},
    "backward_pass": {},
    "backward_atomic": {"CUBEATTN_BWD_DQ": "atomic"},
    "grouped": {},
    "sparse": {},
    "sparse_backward": {},
    "sparse_int8": {},
    "window": {},
    "nonfinite": {},
    "paged": {},
    "head_dims": {},
    "padded": {},
    "decode": {},
}


def main(family):
    os.environ.update(FAMILIES[family])
    import numpy as np

    import cubeattn

    st = cubeattn.backend_status()
    if not st["cuda_available"]:
        print(f"no usable CUDA backend: {st['reason']}", file=sys.stderr)
        return 2
    try:
        import ml_dtypes

        dtypes = [np.float16, ml_dtypes.bfloat16]
    except ImportError:
        dtypes = [np.float16]
    rng = np.random.default_rng(0)
    failures = []

    def rand(shape, dt):
        return rng.uniform(-1, 1, shape).astype(np.float32).astype(dt)

    def check(name, got, want, tol):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        fin = np.isfinite(want)
        err = np.abs(got[fin] - want[fin]).max() if fin.any() else 0.0
        scale = max(1.0, np.abs(want[fin]).max()) if fin.any() else 1.0
        ok = np.array_equal(np.isfinite(got), fin) and err <= tol * scale
        print(f"{family:16s} {name:48s} max_err={err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
        if not ok:
            failures.append(name)

    def varlen(d, dt, causal, backward, deterministic=True, lens=((100, 100), (37, 150), (1, 1), (129, 64)),
               window=(-1, -1), bad=None, dv=None):
        cu_q = np.cumsum([0] + [a for a, _ in lens]).astype(np.int32)
        cu_k = np.cumsum([0] + [b for _, b in lens]).astype(np.int32)
        mq, mk = max(a for a, _ in lens), max(b for _, b in lens)
        dv = d if dv is None else dv
        q, k, v = rand((cu_q[-1], 4, d), dt), rand((cu_k[-1], 2, d), dt), rand((cu_k[-1], 2, dv), dt)
        # dout: q itself where out has q's shape
        dout = q if dv == d else rand((cu_q[-1], 4, dv), dt)
        tag = f"varlen d={d}{'' if dv == d else f' dv={dv}'} {np.dtype(dt).name} causal={causal}"
        if window != (-1, -1):
            tag += f" window={window}"
        if bad is not None:
            # one non-finite element of v (key 120 = sequence 1's key 20, kv head 1)
            v[120, 1, 3] = bad
            tag += f" v[120,1,3]={bad}"
        res = {}
        for dev in ("cuda", "cpu"):
            out, lse = cubeattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, window_size=window,
                                                       return_lse=True, device=dev)
            res[dev] = [out, lse]
            if backward:
                res[dev] += cubeattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk,
                                                                causal=causal, window_size=window,
                                                                deterministic=deterministic, device=dev)
        tol = 3e-2
        for i, name in enumerate(["out", "lse", "dq", "dk", "dv"][:len(res["cpu"])]):
            check(f"{tag} {name}", res["cuda"][i], res["cpu"][i], tol)

    def grouped(d, dt, causal, backward, q_len=40, qr=((0, 20), (20, 36)), kr=((0, 640), (64, 600))):
        tk = max(e for _, e in kr)
        q, k, v = rand((q_len, 2, d), dt), rand((tk, 1, d), dt), rand((tk, 1, d), dt)
        tag = f"grouped d={d} {np.dtype(dt).name} causal={causal} groups={len(qr)}"
        res = {}
        for dev in ("cuda", "cpu"):
            out, lse = cubeattn.grouped_flash_attn_func(q, k, v, [list(x) for x in qr], [list(x) for x in kr],
                                                        causal=causal, return_lse=True, device=dev)
            res[dev] = [out, lse]
            if backward:
                res[dev] += cubeattn.grouped_flash_attn_backward(q, q, k, v, out, lse, [list(x) for x in qr],
                                                                 [list(x) for x in kr], causal=causal,
                                                                 deterministic=True, device=dev)
        for i, name in enumerate(["out", "lse", "dq", "dk", "dv"][:len(res["cpu"])]):
            check(f"{tag} {name}", res["cuda"][i], res["cpu"][i], 3e-2)

    def paged(d, dt, causal, deterministic):
        # a permuted page table over 10 pages; key ranges of 10, 3 (a 128-key tile and a 64-key
        # one) and 8.4 pages, and a group whose causal rows end inside a page
        tk, q_len = 640, 90
        qr, kr = ((0, 30), (30, 45), (45, 90)), ((0, 640), (128, 320), (64, 600))
        table = rng.permutation(tk // 64).astype(np.int32)
        q, k, v = rand((q_len, 2, d), dt), rand((tk, 1, d), dt), rand((tk, 1, d), dt)
        tag = f"paged d={d} {np.dtype(dt).name} causal={causal} det={deterministic}"
        res = {}
        for dev in ("cuda", "cpu"):
            out, lse = cubeattn.grouped_flash_attn_func(q, k, v, [list(x) for x in qr], [list(x) for x in kr],
                                                        causal=causal, return_lse=True, kv_block_table=table,
                                                        device=dev)
            res[dev] = [out, lse] + list(cubeattn.grouped_flash_attn_backward(
                q, q, k, v, out, lse, [list(x) for x in qr], [list(x) for x in kr], causal=causal,
                deterministic=deterministic, kv_block_table=table, device=dev))
        for i, name in enumerate(["out", "lse", "dq", "dk", "dv"]):
            check(f"{tag} {name}", res["cuda"][i], res["cpu"][i], 3e-2)

    def sparse(d, dt, causal, per_kv_head, q_block, k_block, backward=False, quant_gran=None, deterministic=True, pv=None):
        B, sq, sk, hq, hkv = 2, 130, 300, 4, 2
        nq, nk = -(-sq // q_block), -(-sk // k_block)
        ix = np.full((B, hkv if per_kv_head else hq, nq, nk), -1, np.int32)
        for b in range(B):
            for h in range(ix.shape[1]):
                for i in range(nq):
                    if (b + h + i) % 5:  # some rows keep nothing
                        keep = rng.permutation(nk)[: max(1, nk // 2)]
                        ix[b, h, i, : len(keep)] = keep
        q, k, v = rand((B, sq, hq, d), dt), rand((B, sk, hkv, d), dt), rand((B, sk, hkv, d), dt)
        res = {}
        for dev in ("cuda", "cpu"):
            # the CPU reference is the exact path, or with FP8 P.V the CPU's emulation of it
            qg = quant_gran if dev == "cuda" or pv else None
            out, lse = cubeattn.block_sparse_attn_func(q, k, v, ix, q_block=q_block, k_block=k_block, causal=causal,
                                                       return_lse=True, device=dev, quant_gran=qg, pv_precision=pv)
            res[dev] = [out, lse]
            if backward:
                res[dev] += cubeattn.block_sparse_attn_backward(q, q, k, v, out, lse, ix, q_block=q_block,
                                                                k_block=k_block, causal=causal, device=dev,
                                                                deterministic=deterministic)
        tag = f"sparse d={d} {np.dtype(dt).name} causal={causal} kvhead={per_kv_head} blocks={q_block}/{k_block}"
        if quant_gran:
            tag += f" int8={quant_gran}" + (f" pv={pv}" if pv else "")
        for i, name in enumerate(["out", "lse", "dq", "dk", "dv"][:len(res["cpu"])]):
            check(f"{tag} {name}", res["cuda"][i], res["cpu"][i], 5e-2 if quant_gran else 3e-2)

    for d in {"head_dims": (32, 96, 192, 256), "padded": (33, 80, 160)}.get(family, (64, 128)):
        for causal in (False, True):
            if family == "padded":
                # the zero-column copies around the next kernel head dim's kernels (head_pad.rs)
                varlen(d, dtypes[-1], causal, backward=False)
                for det in (True, False):
                    varlen(d, dtypes[-1], causal, backward=True, deterministic=det)
                paged(d, dtypes[0], causal, False)
                if d <= 128:
                    sparse(d, dtypes[-1], causal, False, 64, 128, backward=True)
                # v with a head_dim of its own: DeepSeek's MLA (on Hopper no copies: v, out, dout,
                # dv at 128 in the kernels), 160 / 128 (q, k, dq, dk copied to 192) and v wider
                # than q (padded to 128: v, out, dout, dv in place)
                for dq_, dv_ in ((192, 128), (160, 128), (64, 128)) if d == 160 else ():
                    for det in (True, False):
                        varlen(dq_, dtypes[-1], causal, backward=True, deterministic=det, dv=dv_)
                continue
            if family == "head_dims":
                varlen(d, dtypes[-1], causal, backward=False)
                grouped(d, dtypes[-1], causal, backward=False)
                if d <= 128:
                    for det in (True, False):
                        varlen(d, dtypes[-1], causal, backward=True, deterministic=det)
                else:
                    # the Hopper kernel above 128 (fused dQ; deterministic: the dQ pass), dense and paged K,V
                    for det in (True, False):
                        varlen(d, dtypes[-1], causal, backward=True, deterministic=det)
                    paged(d, dtypes[0], causal, False)
                continue
            if family == "sparse":
                for dt in dtypes:
                    sparse(d, dt, causal, False, 64, 128)
                    sparse(d, dt, causal, True, 64, 96)
                continue
            if family == "sparse_backward":
                for dt in dtypes:
                    sparse(d, dt, causal, False, 64, 128, backward=True)
                    sparse(d, dt, causal, True, 128, 64, backward=True, deterministic=False)
                continue
            if family == "sparse_int8":
                for gran in ("per_block", "per_warp", "per_thread"):
                    sparse(d, dtypes[0], causal, False, 64, 128, quant_gran=gran)
                    # 128-row query blocks: the Hopper kernel's INT8 variant at d128 on sm_90
                    sparse(d, dtypes[-1], causal, False, 128, 128, quant_gran=gran)
                    if d == 128:
                        # FP8 P.V (the Hopper kernel's only)
                        sparse(d, dtypes[-1], causal, True, 64, 128, quant_gran=gran, pv="fp8")
                continue
            if family == "window":
                for dt in dtypes:
                    for det in (True, False):
                        varlen(d, dt, causal, backward=True, deterministic=det, window=(40, 0 if causal else 17))
                continue
            if family == "decode":
                # decode-sized calls (at most 32 rows x heads a sequence: the few-rows kernels),
                # key counts off the tiles, an empty sequence's neighbour of one key, a window
                for dt in dtypes:
                    lens = ((1, 1000), (1, 63), (4, 64), (1, 1), (2, 511))
                    varlen(d, dt, causal, backward=False, lens=lens)
                    varlen(d, dt, causal, backward=False, lens=lens, window=(100, 0 if causal else 5))
                continue
            if family == "paged":
                for dt in dtypes:
                    for det in (True, False):
                        paged(d, dt, causal, det)
                continue
            if family == "nonfinite":
                for dt in dtypes:
                    for bad in (np.inf, np.nan):
                        varlen(d, dt, causal, backward=True, bad=bad)
                continue
            if family == "forward":
                for dt in dtypes + [np.float32]:
                    varlen(d, dt, causal, backward=False)
            elif family == "splitk":
                for dt in dtypes:
                    # 40 rows (4 in no group) over 640 keys: the plan splits the key range
                    grouped(d, dt, causal, backward=False)
            elif family == "backward_pass":
                for dt in dtypes + [np.float32]:
                    varlen(d, dt, causal, backward=True, deterministic=True)
            elif family == "backward_atomic":
                for dt in dtypes:
                    varlen(d, dt, causal, backward=True, deterministic=False)
            elif family == "grouped":
                for dt in dtypes:
                    grouped(d, dt, causal, backward=True, q_len=90, qr=((0, 30), (30, 30), (35, 80)),
                            kr=((0, 200), (10, 20), (50, 260)))
    print(f"{family}: {len(failures)} failed checks", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in FAMILIES:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
