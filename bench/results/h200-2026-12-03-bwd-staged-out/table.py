"""run1's `bench fwdbwd` rows: per shape and impl the mean over rounds of each build's ms (the
rounds in brackets), the new build over the old, and cuDNN's mean over both builds' rounds. Usage: table.py FILES (names
<set>_<build>_r<round>.json)."""
import collections, json, os, sys
t = collections.defaultdict(list)
for f in sys.argv[1:]:
    build = os.path.basename(f).split("_")[1]
    for r in json.load(open(f))["rows"]:
        if "ms" in r and r.get("what") == "dense_fwdbwd":
            t[((r["config"], r["S"], "causal" if r["causal"] else "full"), r["impl"], build)].append(r["ms"])
med = lambda v: sum(v) / len(v) if v else float("nan")
rounds = lambda v: " / ".join(f"{x:.3f}" for x in v)
print("| config, S, mask | impl | before (fin) | after (bso) | after / before | cuDNN | after / cuDNN |")
print("|" + " --- |" * 7)
for shape in sorted({k[0] for k in t}, key=str):
    peer = med(t[(shape, "sdpa_cudnn", "fin")] + t[(shape, "sdpa_cudnn", "bso")])
    for impl in ("cubeattn_kernel", "cubeattn", "cubeattn_deterministic"):
        a, b = med(t[(shape, impl, "fin")]), med(t[(shape, impl, "bso")])
        ra, rb = rounds(t[(shape, impl, "fin")]), rounds(t[(shape, impl, "bso")])
        print(f"| {', '.join(map(str, shape))} | {impl} | {a:.3f} ({ra}) | {b:.3f} ({rb}) | {b / a:.3f} | {peer:.3f} | {b / peer:.3f} |")
