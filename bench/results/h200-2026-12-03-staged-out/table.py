"""out_ab.py's rows: per shape the median over rounds of each variant's ms (kernel alone, torch
call) and SDPA cuDNN's torch call. Usage: table.py FILES."""
import collections, json, sys
t = collections.defaultdict(list)
for f in sys.argv[1:]:
    for r in json.load(open(f))["rows"]:
        if "ms" in r:
            shape = (r["config"], r["B"], r["S"], "causal" if r["causal"] else "full")
            t[(shape, r["variant"], r["impl"])].append(r["ms"])
med = lambda v: sorted(v)[len(v) // 2] if v else float("nan")
print("| config, B, S, mask | kernel direct | kernel staged | staged / direct | call direct | call staged | cuDNN call | staged call / cuDNN |")
print("|" + " --- |" * 8)
for shape in sorted({k[0] for k in t}, key=str):
    kd, ks = med(t[(shape, "direct", "cubeattn_kernel")]), med(t[(shape, "staged", "cubeattn_kernel")])
    cd, cs = med(t[(shape, "direct", "cubeattn")]), med(t[(shape, "staged", "cubeattn")])
    peer = med(t[(shape, "direct", "sdpa_cudnn")] + t[(shape, "staged", "sdpa_cudnn")])
    print(f"| {', '.join(map(str, shape))} | {kd:.3f} | {ks:.3f} | {ks / kd:.3f} | {cd:.3f} | {cs:.3f} | {peer:.3f} | {cs / peer:.3f} |")
