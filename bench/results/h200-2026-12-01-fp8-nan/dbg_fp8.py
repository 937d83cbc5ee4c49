"""Where FP8 P.V sageattn calls give NaN: batch / length combinations around the failing pytest
case (B=2, Sq=300, Sk=520, GQA 8/2, d128), causal and not, each granularity; INT8 alone as the
control. Prints the NaN count and, where there are NaN, the batches, rows and heads that hold them."""
import torch, cubeattn
torch.manual_seed(0)
for (b, sq, sk) in ((2, 300, 520), (1, 300, 520), (2, 520, 520), (2, 300, 300), (1, 520, 520), (2, 512, 512),
                    (2, 300, 512), (2, 320, 520), (1, 64, 520), (2, 64, 64), (2, 1, 520)):
    q = torch.randn(b, sq, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, 2, 128, device="cuda", dtype=torch.bfloat16)
    for causal in (False, True):
        for gran in ("per_block", "per_warp", "per_thread"):
            line = f"B={b} Sq={sq} Sk={sk} causal={causal} {gran}:"
            for pv in ("fp8", None):
                o = cubeattn.sageattn(q, k, v, is_causal=causal, quant_gran=gran, pv_precision=pv)
                bad = ~torch.isfinite(o.float())
                n = int(bad.sum())
                line += f" {pv or 'int8'} nonfinite {n}"
                if n:
                    idx = bad.nonzero()
                    line += (f" (batches {sorted(set(idx[:, 0].tolist()))}, rows {int(idx[:, 1].min())}-{int(idx[:, 1].max())}"
                             f" of {len(set(idx[:, 1].tolist()))}, heads {sorted(set(idx[:, 2].tolist()))},"
                             f" channels {len(set(idx[:, 3].tolist()))})")
            print(line, flush=True)
