"""order_ab.py's rows: per shape and order the median over the rounds of our kernel's ms, against
heads fastest, and SDPA cuDNN's torch call where it runs. Usage: table.py FILES."""
import collections, json, sys
t = collections.defaultdict(list)
for f in sys.argv[1:]:
    for r in json.load(open(f))["rows"]:
        if "ms" in r:
            shape = (r["config"], r["B"], r["S"], "causal" if r["causal"] else "full", tuple(r["window"]) if r["window"] else "-")
            t[(shape, r["order"], r["impl"])].append(r["ms"])
med = lambda v: sorted(v)[len(v) // 2] if v else float("nan")
print("| config, B, S, mask, window | heads ms | kv ms | kv / heads | rounds (heads; kv) | sdpa_cudnn call ms |")
print("|" + " --- |" * 6)
for shape in sorted({k[0] for k in t}, key=str):
    h, kv = (t[(shape, o, "cubeattn_kernel")] for o in ("heads", "kv"))
    peer = t[(shape, "heads", "sdpa_cudnn")] + t[(shape, "kv", "sdpa_cudnn")]
    rr = "; ".join(" / ".join(f"{x:.3f}" for x in v) for v in (h, kv))
    print(f"| {', '.join(map(str, shape))} | {med(h):.3f} | {med(kv):.3f} | {med(kv) / med(h):.3f} | {rr} | "
          f"{med(peer):.3f} |" if peer else f"| {', '.join(map(str, shape))} | {med(h):.3f} | {med(kv):.3f} | "
          f"{med(kv) / med(h):.3f} | {rr} | - |")
