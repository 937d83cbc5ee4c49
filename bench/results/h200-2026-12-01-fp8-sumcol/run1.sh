#!/usr/bin/env bash
# Branch exp/fp8-sum-col (build E, .carry/s54s) against main (build M): the FP8 P.V kernel takes
# its row sums from the P V MMA (an n8 block of e4m3 ones after each V^T tile: n136) instead of a
# per-score add. The same checks and A/B as ../h200-2026-12-01-fp8-empty/run1.sh (Rust int8
# suites and pytest sage / sparse_fp8 on E, ab_sage.py in processes M E E M M E, synccheck and
# racecheck on E), with E set here. One nvidia-h200 call.
E=${E:-.carry/s54s} exec bash bench/results/h200-2026-12-01-fp8-empty/run1.sh
