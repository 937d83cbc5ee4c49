"""The A/B table of run1.sh: per shape and setting, the median over its processes of each impl's
median (fp8: every process's in brackets), fp8 and int8 against the same shape at poly 0, our
bf16 forward's time over fp8's, and the worst fp8 / int8 cosine against the f64 reference.
Usage: table.py ab_*.jsonl"""
import collections, json, sys
rows = [json.loads(l) for f in sys.argv[1:] for l in open(f) if l.startswith("{")]
t, cos = collections.defaultdict(list), {}
for r in rows:
    k = (r["S"], r["causal"], r["poly"], r["impl"])
    t[k].append(r["ms"])
    if "cosine" in r:
        cos[k] = min(cos.get(k, 1.0), r["cosine"])


def med(v):
    return sorted(v)[len(v) // 2] if v else float("nan")


print("| S | causal | poly | fp8 ms | fp8 vs poly 0 | int8 ms | int8 vs poly 0 | bf16 ms | cuDNN ms | bf16 / fp8 | cos fp8 | cos int8 |")
print("|" + " --- |" * 12)
for s, c in sorted({(r["S"], r["causal"]) for r in rows}):
    for p in sorted({r["poly"] for r in rows}):
        m = {i: med(t[(s, c, p, i)]) for i in ("fp8", "int8", "bf16", "cudnn")}
        m0 = {i: med(t[(s, c, "0", i)]) for i in ("fp8", "int8")}
        each = ", ".join(f"{x:.3f}" for x in t[(s, c, p, "fp8")])
        cs = [f"{cos[(s, c, p, i)]:.5f}" if (s, c, p, i) in cos else "-" for i in ("fp8", "int8")]
        print(f"| {s // 1024}K | {c} | {p} | {m['fp8']:.3f} [{each}] | {m['fp8'] / m0['fp8']:.4f} | {m['int8']:.3f} | "
              f"{m['int8'] / m0['int8']:.4f} | {m['bf16']:.3f} | {m['cudnn']:.3f} | {m['bf16'] / m['fp8']:.3f}x | {cs[0]} | {cs[1]} |")
