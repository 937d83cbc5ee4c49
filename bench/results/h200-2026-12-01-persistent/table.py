import json, sys, collections
rows = [json.loads(l) for f in sys.argv[1:] for l in open(f) if l.startswith("{")]
t = collections.defaultdict(list)
for r in rows:
    t[(r["B"], r["S"], r["hq"], r["hkv"], r["D"], r["causal"], r["impl"], r["tag"])].append(r["ms"])
tags = sorted({r["tag"] for r in rows if r["tag"] != "peer"})
print("| B | S | heads | D | causal | " + " | ".join(f"kernel {x}" for x in tags) + " | " + " | ".join(f"torch {x}" for x in tags) + " | cuDNN |")
print("|" + " --- |" * (5 + 2 * len(tags) + 1))
for k in sorted({(r["B"], r["S"], r["hq"], r["hkv"], r["D"], r["causal"]) for r in rows}):
    ks = [" / ".join(f"{m:.3f}" for m in t[k + ("cubeattn_kernel", x)]) for x in tags]
    ts = [" / ".join(f"{m:.3f}" for m in t[k + ("cubeattn", x)]) for x in tags]
    c = " / ".join(f"{m:.3f}" for m in t[k + ("sdpa_cudnn", "peer")])
    print(f"| {k[0]} | {k[1]} | {k[2]}/{k[3]} | {k[4]} | {k[5]} | " + " | ".join(ks) + " | " + " | ".join(ts) + f" | {c} |")
