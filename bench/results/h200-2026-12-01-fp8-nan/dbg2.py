"""FP8 P.V NaN frequency by key-tile count (64-key tiles; odd counts suspected), 6 calls each,
one query tile of 64 rows, GQA 8/2, d128, non-causal; then one call for compute-sanitizer
(`one` argument)."""
import sys, torch, cubeattn
torch.manual_seed(1)
if len(sys.argv) > 1 and sys.argv[1] == "one":
    q = torch.randn(1, 64, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 520, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 520, 2, 128, device="cuda", dtype=torch.bfloat16)
    o = cubeattn.sageattn(q, k, v, quant_gran="per_block", pv_precision="fp8")
    torch.cuda.synchronize()
    print("nonfinite", int((~torch.isfinite(o.float())).sum()))
    sys.exit(0)
for sk in (64, 128, 192, 448, 512, 520, 576, 640, 100, 150):
    q = torch.randn(1, 64, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, sk, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, sk, 2, 128, device="cuda", dtype=torch.bfloat16)
    counts = []
    for _ in range(6):
        o = cubeattn.sageattn(q, k, v, quant_gran="per_block", pv_precision="fp8")
        counts.append(int((~torch.isfinite(o.float())).sum()))
    print(f"Sk={sk} tiles={-(-sk // 64)}: nonfinite per call {counts}", flush=True)
