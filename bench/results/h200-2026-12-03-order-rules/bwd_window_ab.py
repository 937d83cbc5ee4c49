"""Window calls' fwd+bwd kernels alone (`cuda_bench_forward_backward`: device-resident inputs,
CUDA events) in this process's backward cube order (CUBEATTN_BWD_ORDER and CUBEATTN_DQ_ORDER set
alike by run2.sh); window calls keep heads fastest in the backward by default. No peer runs a
sliding window in these shapes' layout (SDPA has none), so the rows compare our two orders only.
Writes {"env", "rows"} JSON to argv[1]."""
import json, os, sys

import cubeattn
from cubeattn import bench

CASES = [("llama3-8b", 16384, True, (2048, 0)), ("llama3-8b", 32768, True, (4096, 0)),
         ("llama3-8b", 16384, False, (2048, 2048)), ("gqa-d64", 32768, True, (4096, 0))]
order = os.environ.get("CUBEATTN_BWD_ORDER", "default")
rows = []
for cfg, S, causal, win in CASES:
    hq, hkv, d = bench.CONFIGS[cfg]
    cu = [0, S]
    spec = cubeattn.varlen_spec((S, hq, d), (S, hkv, d), "bfloat16", cu, cu, S, S, causal=causal, window_size=win)
    ts = sorted(cubeattn._core.cuda_bench_forward_backward(spec, 3, 20))
    rows.append(dict(what="dense_fwdbwd", config=cfg, B=1, S=S, D=d, causal=causal, window=list(win), order=order,
                     impl="cubeattn_kernel", ms=ts[len(ts) // 2], ms_min=ts[0], ms_max=ts[-1]))
    print(cfg, S, causal, win, order, rows[-1]["ms"], flush=True)
json.dump({"env": bench.environment("cuda"), "rows": rows}, open(sys.argv[1], "w"), indent=1)
