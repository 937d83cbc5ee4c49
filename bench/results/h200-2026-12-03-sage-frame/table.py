"""The A/B table of run1.sh: per shape and frame, the median over its processes of each impl's
median (fp8: every process's in brackets), fp8 against frame 0 of the same shape, our bf16
forward's time over fp8's, cuDNN's over fp8's, and the worst fp8 cosine against the f64 reference.
Usage: table.py ab_*.jsonl"""
import collections, json, sys
rows = [json.loads(l) for f in sys.argv[1:] for l in open(f) if l.startswith("{")]
t, cos = collections.defaultdict(list), {}
for r in rows:
    k = (r["S"], r["causal"], r["frame"], r["impl"])
    t[k].append(r["ms"])
    if "cosine" in r:
        cos[k] = min(cos.get(k, 1.0), r["cosine"])


def med(v):
    return sorted(v)[len(v) // 2] if v else float("nan")


F, BF, CU = "cubeattn_int8_fp8", "cubeattn_bf16", "sdpa_cudnn"
print("| S | causal | frame | fp8 ms | fp8 vs frame 0 | TOPS | bf16 ms | cuDNN ms | bf16 / fp8 | cuDNN / fp8 | cos fp8 |")
print("|" + " --- |" * 11)
for s, c in sorted({(r["S"], r["causal"]) for r in rows}):
    for p in sorted({r["frame"] for r in rows}):
        m = {i: med(t[(s, c, p, i)]) for i in (F, BF, CU)}
        m0 = med(t[(s, c, "0", F)])
        each = ", ".join(f"{x:.3f}" for x in t[(s, c, p, F)])
        tops = 4 * 4 * 32 * s * s * 128 / (2 if c else 1) / m[F] / 1e9
        cs = f"{cos[(s, c, p, F)]:.5f}" if (s, c, p, F) in cos else "-"
        print(f"| {s // 1024}K | {c} | {p} | {m[F]:.3f} [{each}] | {m[F] / m0:.4f} | {tops:.0f} | {m[BF]:.3f} | {m[CU]:.3f} | "
              f"{m[BF] / m[F]:.3f}x | {m[CU] / m[F]:.3f}x | {cs} |")
