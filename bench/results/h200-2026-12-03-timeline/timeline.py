"""Timeline of `flash_fwd_ws` cubes from the clock stamps of branch exp/fwd-timeline (slots
CUBE_POS * 16 + k of the LSE buffer, which that build does not otherwise write).

Slots: 0 smid, 1 clock at entry, 2 globaltimer at entry, 11 after the flag test, 12 after
work_item, 13 after fill_rows, 3 after sync_cube, 14 producer: K(0) and V(0) issued, 4 producer
loop end, 5 consumer 0: Q ready, 6 S(0) waited, 7 loop end, 8 last P V waited, 9 after write_out,
10 globaltimer at the end.
usage: python3 timeline.py OUT.json"""
import json
import sys

import numpy as np
import torch

import cubeattn

H, HKV, D = 32, 8, 128
PHASES = [("flag", 1, 11), ("work_item", 11, 12), ("fill_rows", 12, 13), ("sync", 13, 3), ("K0 issue", 3, 14),
          ("Q ready", 3, 5), ("S0", 5, 6), ("loop", 6, 7), ("last PV", 7, 8), ("write_out", 8, 9), ("cube", 1, 9),
          ("producer", 1, 4)]


def run(s, causal):
    q = torch.randn(1, s, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, s, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, s, HKV, D, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        out, lse = cubeattn.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    raw = lse.permute(1, 0, 2).reshape(-1).contiguous().view(torch.int32).cpu().numpy().astype(np.int64) & 0xFFFFFFFF
    n = H * s // 128
    st = raw[: n * 16].reshape(n, 16)
    assert (st[:, 0] < 200).all(), "smid out of range: stamps missing"
    clk = lambda a, b: ((st[:, b] - st[:, a]) & 0xFFFFFFFF).astype(np.int64)
    res = {"S": s, "causal": causal, "cubes": n}
    for name, a, b in PHASES:
        x = clk(a, b)
        res[name] = dict(median=float(np.median(x)), mean=float(x.mean()), p10=float(np.percentile(x, 10)),
                         p90=float(np.percentile(x, 90)))
    # per SM: gaps between one cube's end (slot 9) and the next cube's entry (slot 1)
    gaps, per_sm = [], []
    for sm in np.unique(st[:, 0]):
        rows = st[st[:, 0] == sm]
        rows = rows[np.argsort(rows[:, 1])]
        g = (rows[1:, 1] - rows[:-1, 9]) & 0xFFFFFFFF
        gaps.extend(g.tolist())
        per_sm.append(len(rows))
    res["gap_end_to_next_entry"] = dict(median=float(np.median(gaps)), mean=float(np.mean(gaps)),
                                       p10=float(np.percentile(gaps, 10)), p90=float(np.percentile(gaps, 90)))
    res["cubes_per_sm"] = [int(min(per_sm)), int(max(per_sm))]
    span_ns = float(((st[:, 10].max() - st[:, 2].min()) & 0xFFFFFFFF))
    res["span_us_globaltimer"] = span_ns / 1e3
    first = st[:, 2] - st[:, 2].min()
    res["first_wave_entry_spread_us"] = float(np.sort(first)[131] / 1e3) if n > 131 else None
    # per-tile cost of the loop: tiles per cube
    bn = 160 if not causal else 128
    tiles = -(-s // bn)
    res["loop_cycles_per_tile_median"] = res["loop"]["median"] / max(tiles - 1, 1) if not causal else None
    # event time of the torch call for reference
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(20):
        cubeattn.flash_attn_func(q, k, v, causal=causal)
    ev[1].record()
    torch.cuda.synchronize()
    res["call_ms"] = ev[0].elapsed_time(ev[1]) / 20
    return res


def main():
    out = []
    for s, c in [(4096, False), (8192, False), (16384, False), (8192, True)]:
        r = run(s, c)
        out.append(r)
        print(f"S={s} causal={c} cubes={r['cubes']} per SM {r['cubes_per_sm']} call {r['call_ms']:.3f} ms "
              f"span {r['span_us_globaltimer']:.0f} us")
        for name, _, _ in PHASES:
            m = r[name]
            print(f"  {name:10s} median {m['median']:8.0f} mean {m['mean']:8.0f} p10 {m['p10']:8.0f} p90 {m['p90']:8.0f}")
        g = r["gap_end_to_next_entry"]
        print(f"  {'gap':10s} median {g['median']:8.0f} mean {g['mean']:8.0f} p10 {g['p10']:8.0f} p90 {g['p90']:8.0f}")
        if r["loop_cycles_per_tile_median"]:
            print(f"  loop cycles per tile (median cube) {r['loop_cycles_per_tile_median']:.0f}")
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
