"""The error of a reduce-scatter whose partial sums are rounded to bfloat16 after every addition
(NCCL's ring in the tensor's own 16-bit type: W - 1 additions per element) against the float32
path (one rounding of the float32 sum), both against the float64 sum of the same bf16 partials.
Partials: W ranks' contributions to one dK / dV element, randn (independent signs) and, as the
case where they add up instead of cancelling, a shared component plus noise. CPU simulation with
numpy (bfloat16 = float32 rounded to nearest even on its top 16 bits), not an NCCL run."""
import numpy as np

rng = np.random.default_rng(0)
N = 1 << 22


def bf16(x):
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    b = (b + (((b >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def rel_l2(x, ref):
    return float(np.linalg.norm(x.astype(np.float64) - ref) / np.linalg.norm(ref))


print(f"{'W':>2} {'partials':10} {'f32 path':>10} {'bf16 ring':>10} {'ratio':>6}")
for kind in ("randn", "shared"):
    for W in (2, 3, 4, 8):
        if kind == "randn":
            parts = [bf16(rng.standard_normal(N)) for _ in range(W)]
        else:
            base = rng.standard_normal(N)
            parts = [bf16(base + 0.3 * rng.standard_normal(N)) for _ in range(W)]
        exact = sum(p.astype(np.float64) for p in parts)
        f32 = bf16(sum(p.astype(np.float32) for p in parts))
        ring = parts[0]
        for p in parts[1:]:
            ring = bf16(ring + p)
        e32, e16 = rel_l2(f32, exact), rel_l2(ring, exact)
        print(f"{W:>2} {kind:10} {e32:10.2e} {e16:10.2e} {e16 / e32:6.2f}")
