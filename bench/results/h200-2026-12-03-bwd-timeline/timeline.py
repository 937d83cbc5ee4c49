"""Timeline of `flash_bwd_ws` cubes from the clock stamps of branch exp/bwd-timeline: u32 words
CUBE_POS * 16 + k of dk's buffer (that build writes no dK: its numbers are garbage, dV is written,
so the epilogue below is half the real one).

Words: 0 smid, 1 clock at entry, 2 globaltimer at entry, 3 after K / V staging and the cube
barrier, 4 consumer 0: first query tile ready, 5 loop end, 6 after the dV stores, 7 globaltimer.
usage: python3 timeline.py OUT.json"""
import json
import sys

import numpy as np
import torch

import cubeattn

H, HKV, D = 32, 8, 128
PHASES = [("K/V staging + sync", 1, 3), ("first tile ready", 3, 4), ("loop", 4, 5), ("dV stores (half)", 5, 6),
          ("cube", 1, 6)]


def run(s, causal):
    q, k, v = (torch.randn(1, s, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (H, HKV, HKV))
    dout = torch.randn(1, s, H, D, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        q.grad = k.grad = v.grad = None
        out = cubeattn.flash_attn_func(q, k, v, causal=causal)
        out.backward(dout)
    torch.cuda.synchronize()
    raw = k.grad.reshape(-1).contiguous().view(torch.int32).cpu().numpy().astype(np.int64) & 0xFFFFFFFF
    n = (s // 128) * HKV
    st = raw[: n * 16].reshape(n, 16)
    ok = st[:, 0] < 200
    res = {"S": s, "causal": causal, "cubes": n, "cubes_with_stamps": int(ok.sum())}
    st = st[ok]
    clk = lambda a, b: ((st[:, b] - st[:, a]) & 0xFFFFFFFF).astype(np.int64)
    for name, a, b in PHASES:
        x = clk(a, b)
        res[name] = dict(median=float(np.median(x)), mean=float(x.mean()), p10=float(np.percentile(x, 10)),
                         p90=float(np.percentile(x, 90)), total=float(x.sum()))
    gaps = []
    for sm in np.unique(st[:, 0]):
        rows = st[st[:, 0] == sm]
        rows = rows[np.argsort(rows[:, 1])]
        gaps.extend(((rows[1:, 1] - rows[:-1, 6]) & 0xFFFFFFFF).tolist())
    res["gap"] = dict(median=float(np.median(gaps)), mean=float(np.mean(gaps)), total=float(np.sum(gaps)))
    res["span_us"] = float(((st[:, 7].max() - st[:, 2].min()) & 0xFFFFFFFF)) / 1e3
    return res


def main():
    out = []
    for s, c in [(4096, True), (8192, True), (8192, False), (16384, True)]:
        r = run(s, c)
        out.append(r)
        tot = r["cube"]["total"]
        print(f"S={s} causal={c} cubes={r['cubes']} stamped={r['cubes_with_stamps']} span {r['span_us']:.0f} us")
        for name, _, _ in PHASES:
            m = r[name]
            print(f"  {name:20s} median {m['median']:9.0f} mean {m['mean']:9.0f} p10 {m['p10']:9.0f} p90 {m['p90']:9.0f}"
                  f" share {m['total'] / tot:6.3f}")
        print(f"  {'gap':20s} median {r['gap']['median']:9.0f} mean {r['gap']['mean']:9.0f} share {r['gap']['total'] / tot:6.3f}")
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
