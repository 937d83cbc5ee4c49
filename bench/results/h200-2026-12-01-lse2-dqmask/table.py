import json, sys, collections
rows = [json.loads(l) for f in sys.argv[1:] for l in open(f) if l.startswith("{")]
t = collections.defaultdict(list)
for r in rows:
    t[(r["D"], r["causal"], r["S"], r["impl"], r["tag"])].append(r["ms"])
tags = sorted({r["tag"] for r in rows if r["tag"] != "peer"})
print("| D | causal | S | " + " | ".join(f"kernel {x}" for x in tags) + " | " + " | ".join(f"torch {x}" for x in tags) + " | " + " | ".join(f"det {x}" for x in tags) + " | cuDNN |")
print("|" + " --- |" * (3 + 3 * len(tags) + 1))
for k in sorted({(r["D"], r["causal"], r["S"]) for r in rows}):
    ks = [" / ".join(f"{m:.3f}" for m in t[k + ("cubeattn_kernel", x)]) for x in tags]
    ts = [" / ".join(f"{m:.3f}" for m in t[k + ("cubeattn", x)]) for x in tags]
    ds = [" / ".join(f"{m:.3f}" for m in t[k + ("cubeattn_deterministic", x)]) for x in tags]
    c = " / ".join(f"{m:.3f}" for m in t[k + ("sdpa_cudnn", "peer")])
    print(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(ks) + " | " + " | ".join(ts) + " | " + " | ".join(ds) + f" | {c} |")
