"""det_ab.py's rows: per shape and CUBEATTN_DQ_ORDER the median over the rounds of each impl's ms,
deterministic over the default, and deterministic kv over heads. Usage: det_table.py FILES."""
import collections, json, sys
t = collections.defaultdict(list)
for f in sys.argv[1:]:
    for r in json.load(open(f))["rows"]:
        t[((r["config"], r["S"]), r["dq_order"], r["impl"])].append(r["ms"])
med = lambda v: sorted(v)[len(v) // 2] if v else float("nan")
print("| config, S (causal) | dQ order | deterministic ms | default ms | sdpa_cudnn ms | det / default | det kv / heads |")
print("|" + " --- |" * 7)
for shape in sorted({k[0] for k in t}, key=str):
    dh = med(t[(shape, "heads", "cubeattn_deterministic")])
    for o in ("heads", "kv"):
        m = {i: med(t[(shape, o, i)]) for i in ("cubeattn_deterministic", "cubeattn", "sdpa_cudnn")}
        print(f"| {shape[0]}, {shape[1]} | {o} | {m['cubeattn_deterministic']:.3f} | {m['cubeattn']:.3f} | "
              f"{m['sdpa_cudnn']:.3f} | {m['cubeattn_deterministic'] / m['cubeattn']:.3f} | "
              f"{m['cubeattn_deterministic'] / dh:.3f} |")
