"""Top SASS lines of an ncu source page (`--page source --csv --print-source sass`) by warp stall
samples, each with its address, executions and its three largest stall reasons; then the samples
summed by instruction kind. Usage: python3 stall_lines.py source.csv [N]"""
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
n = int(sys.argv[2]) if len(sys.argv) > 2 else 45
h = next(i for i, r in enumerate(rows) if "Source" in r)
hdr, data = rows[h], rows[h + 1:]
I = {c: i for i, c in enumerate(hdr)}
num = lambda x: float(x.replace(",", "")) if x.replace(",", "").replace(".", "", 1).isdigit() else 0.0
stall_cols = [c for c in hdr if c.startswith("stall_") and "Not Issued" not in c]
addr = I.get("Address", 0)
tot = []
for r in data:
    per = {c[6:]: num(r[I[c]]) for c in stall_cols}
    tot.append((sum(per.values()), r, per))
S = sum(t for t, _, _ in tot) or 1.0
print(f"samples {S:.0f}")
for t, r, per in sorted(tot, key=lambda x: -x[0])[:n]:
    top = ", ".join(f"{k} {v / t * 100:.0f}%" for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:3] if v > 0)
    print(f"{100 * t / S:5.2f}%  {r[addr]:>8}  exec {num(r[I['Instructions Executed']]):>10.0f}  {r[I['Source']][:60]:60s} | {top}")
kinds = collections.Counter()
for t, r, _ in tot:
    op = r[I["Source"]].split()
    if op:
        o = op[1] if op[0].startswith("@") else op[0]
        kinds[o.split(".")[0]] += t
print("by kind:", ", ".join(f"{k} {100 * v / S:.1f}%" for k, v in kinds.most_common(16)))
