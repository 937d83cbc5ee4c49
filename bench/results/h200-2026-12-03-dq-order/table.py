"""The A/B of run1.sh: per config, S and build, the median over the rounds of each impl's time
(ms), deterministic over the default, and ours over cuDNN's. Usage: table.py d*_r*.json"""
import collections, json, os, sys
t = collections.defaultdict(list)
for f in sys.argv[1:]:
    build = os.path.basename(f).split("_")[1]
    for r in json.load(open(f))["rows"]:
        if "ms" in r:
            t[(r["D"], r["S"], build, r["impl"])].append(r["ms"])
med = lambda v: sorted(v)[len(v) // 2] if v else float("nan")
print("| D | S | build | cubeattn ms | deterministic ms | cuDNN ms | det / default | ours / cuDNN | det vs A |")
print("|" + " --- |" * 9)
for d, s in sorted({(k[0], k[1]) for k in t}):
    for b in ("A", "B"):
        m = {i: med(t[(d, s, b, i)]) for i in ("cubeattn", "cubeattn_deterministic", "sdpa_cudnn")}
        da = med(t[(d, s, "A", "cubeattn_deterministic")])
        print(f"| {d} | {s // 1024}K | {b} | {m['cubeattn']:.3f} | {m['cubeattn_deterministic']:.3f} | {m['sdpa_cudnn']:.3f} | "
              f"{m['cubeattn_deterministic'] / m['cubeattn']:.3f} | {m['cubeattn'] / m['sdpa_cudnn']:.3f} | {m['cubeattn_deterministic'] / da:.4f} |")
