"""run1.sh's A/B: per shape and order, the median over the rounds of each impl's ms, ours over the
cuDNN peer, and our time against heads fastest. Usage: table.py FILES (logs/run1_d*_r*.json or
logs/run1_zz_*.json; a file's order is the word heads or kv in its name)."""
import collections, json, os, sys
t = collections.defaultdict(list)
for f in sys.argv[1:]:
    order = next(w for w in os.path.basename(f).split("_") if w in ("heads", "kv"))
    for r in json.load(open(f))["rows"]:
        if "ms" in r:
            shape = (r["D"], r["S"]) if r["what"] == "dense_fwd" else (r["T"], r["W"], r["rank"])
            t[(shape, order, r["impl"])].append(r["ms"])
med = lambda v: sorted(v)[len(v) // 2] if v else float("nan")
zz = any(k[2] == "cudnn_split_merge" for k in t)
ours, peer = ("cubeattn_kernel", "cudnn_split_merge") if zz else ("cubeattn", "sdpa_cudnn")
print(f"| shape | order | {ours} ms | kernel ms | {peer} ms | ours / peer | kernel vs heads |")
print("|" + " --- |" * 7)
for shape in sorted({k[0] for k in t}):
    kh = med(t[(shape, "heads", "cubeattn_kernel")])
    for o in ("heads", "kv"):
        m = {i: med(t[(shape, o, i)]) for i in (ours, "cubeattn_kernel", peer)}
        print(f"| {shape} | {o} | {m[ours]:.3f} | {m['cubeattn_kernel']:.3f} | {m[peer]:.3f} | {m[ours] / m[peer]:.3f} | "
              f"{m['cubeattn_kernel'] / kh:.4f} |")
