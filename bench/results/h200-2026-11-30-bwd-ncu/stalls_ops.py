import csv, sys, collections
def load(f):
    rows=list(csv.reader(open(f)))
    h=next(i for i,r in enumerate(rows) if "Source" in r); hdr=rows[h]; data=rows[h+1:]
    return hdr, data
def num(x):
    try: return float(x.replace(",",""))
    except: return 0.0
for impl in sys.argv[1:]:
    hdr,data=load(f"source_{impl}.csv")
    I={c:i for i,c in enumerate(hdr)}
    print("=====", impl)
    # stall totals
    tot=collections.Counter()
    for r in data:
        for c in hdr:
            if c.startswith("stall_") and "Not Issued" not in c: tot[c]+=num(r[I[c]])
    s=sum(tot.values())
    print(" stalls:", ", ".join(f"{k[6:]} {100*v/s:.1f}%" for k,v in tot.most_common(12)))
    # shared stores / loads with excess
    print(" shared accesses with excessive wavefronts:")
    for i,r in enumerate(data):
        ex=num(r[I["L1 Wavefronts Shared Excessive"]])
        if ex>0: print(f"  {i:5d} exec {num(r[I['Instructions Executed']]):>10.0f} wf {num(r[I['L1 Wavefronts Shared']]):>11.0f} ideal {num(r[I['L1 Wavefronts Shared Ideal']]):>11.0f}  {r[I['Source']][:70]}")
    # op histogram weighted by exec
    ops=collections.Counter()
    for r in data:
        op=r[I["Source"]].split()
        if not op: continue
        o=op[1] if op[0].startswith("@") else op[0]
        ops[o.split(".")[0]]+=num(r[I["Instructions Executed"]])
    T=sum(ops.values())
    print(" ops:", ", ".join(f"{k} {v/1e6:.0f}M" for k,v in ops.most_common(25)), f"total {T/1e6:.0f}M")
