"""The order A/B of run1.sh: per config, S and order, the median over the rounds of each impl's
time (ms) and ours over cuDNN's. Usage: table.py d*_r*.json"""
import collections, json, os, sys
t = collections.defaultdict(list)
for f in sys.argv[1:]:
    order = os.path.basename(f).split("_")[1]
    for r in json.load(open(f))["rows"]:
        if "ms" in r:
            t[(r["D"], r["S"], order, r["impl"])].append(r["ms"])
med = lambda v: sorted(v)[len(v) // 2] if v else float("nan")
print("| D | S | order | cubeattn ms | kernel ms | cuDNN ms | ours / cuDNN | kernel vs heads |")
print("|" + " --- |" * 8)
for d, s in sorted({(k[0], k[1]) for k in t}):
    for o in ("heads", "kv"):
        m = {i: med(t[(d, s, o, i)]) for i in ("cubeattn", "cubeattn_kernel", "sdpa_cudnn")}
        kh = med(t[(d, s, "heads", "cubeattn_kernel")])
        print(f"| {d} | {s // 1024}K | {o} | {m['cubeattn']:.3f} | {m['cubeattn_kernel']:.3f} | {m['sdpa_cudnn']:.3f} | "
              f"{m['cubeattn'] / m['sdpa_cudnn']:.3f} | {m['cubeattn_kernel'] / kh:.4f} |")
