"""``python -m cubeattn.bench figure --from <json files> -o out.png``: recorded rows as a figure.

Reads the JSON the benchmarks write (``{"env": ..., "rows": [...]}``, or a bare list of rows) and
draws one panel per (file, ``what``, time field): for every shape, each implementation's time
relative to cubeattn's in the same file (1.0 = cubeattn's time, lower is faster), with cubeattn's
milliseconds under the shape. Rows of different files are never compared with each other: a peer
counts only beside the run it was measured in. Rows repeated in a file (rounds, runs) are
reduced to their median.

``--select KEY=VALUE`` keeps the rows whose KEY holds VALUE (a substring, for text values) and the
rows that have no such key or hold null there (a peer without that option); ``--what`` keeps only
the named kinds of row. matplotlib is needed for the drawing only and is imported then.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys

# cubeattn's rows, most specific first: the first one present in a shape is "ours" there
# (`cubeattn_grouped`: the grouped rows of records before the zigzag rows were named `zigzag_fwd`,
# and shared_prefix_fwd's; the zigzag rows' `cubeattn` is the torch call path, as dense_fwd's)
OURS = ("cubeattn_prepared", "cubeattn_grouped", "cubeattn_cuda", "cubeattn_cpu", "cubeattn")
PEERS = {
    "sdpa_cudnn": "SDPA cuDNN",
    "sdpa_flash": "SDPA flash (FlashAttention-2)",
    "sdpa_flash_per_group": "SDPA flash, one call per group",
    "sdpa_flash_two_calls": "SDPA flash, one call per group",
    "allgather_sdpa_flash": "all-gather + SDPA flash + reduce-scatter",
    "flex": "FlexAttention",
    "flex_one_call": "FlexAttention",
    "torch_sdpa_cpu": "torch SDPA (CPU)",
}
COLORS = {"cubeattn": "#1f77b4", "SDPA cuDNN": "#d62728", "SDPA flash (FlashAttention-2)": "#ff7f0e",
          "SDPA flash, one call per group": "#ffbb78", "all-gather + SDPA flash + reduce-scatter": "#8c564b",
          "FlexAttention": "#2ca02c", "torch SDPA (CPU)": "#9467bd"}
TIME_FIELDS = {"ms": "", "sustained_ms": "", "fwd_ms": "forward", "fwdbwd_ms": "fwd+bwd"}
SHAPE_KEYS = ("config", "d", "head_dim", "causal", "deterministic", "B", "H", "S", "T", "W", "rank", "P", "G",
              "pattern", "keep", "kept")
TITLES = {
    "dense_fwd": "forward", "fwd_torch": "forward, torch path", "fwdbwd_autograd": "fwd+bwd, torch autograd",
    "dense_causal_fwdbwd": "causal fwd+bwd, kernels", "dense_fwdbwd": "fwd+bwd, kernels",
    "sparse_fwd": "block-sparse forward", "sparse_fwdbwd": "block-sparse fwd+bwd",
    "zigzag_fwd": "zigzag rank: one grouped call", "zigzag_fwdbwd": "zigzag rank fwd+bwd: one grouped call",
    # the same rows in records made before they were renamed
    "sparse": "block-sparse forward",
    "grouped_zigzag_fwd": "zigzag rank: one grouped call", "grouped_zigzag_fwdbwd": "zigzag rank fwd+bwd: one grouped call",
    "shared_prefix_fwd": "shared prefix", "cp_zigzag": "zigzag context parallelism (NCCL)",
    "cp_zigzag_one_rank": "zigzag context parallelism, one rank emulated",
}
RUN_NAME = re.compile(r"^(cpu|h\d+)(x\d+)?-\d{4}-\d\d-\d\d")


def load(path):
    """(env, rows) of one benchmark JSON file."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):
        return {}, [r for r in data if isinstance(r, dict)]
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path}: not a benchmark record (expected {{'env', 'rows'}} or a list of rows)")
    return data.get("env") or {}, [r for r in data["rows"] if isinstance(r, dict)]


def parse_select(items):
    """``KEY=VALUE`` strings -> [(key, value)]."""
    out = []
    for s in items or ():
        key, sep, value = s.partition("=")
        if not sep or not key:
            raise ValueError(f"--select {s!r}: expected KEY=VALUE")
        out.append((key, value))
    return out


def _selected(row, select):
    for key, value in select:
        have = row.get(key)
        if have is None:
            continue
        if isinstance(have, str):
            if value not in have:
                return False
        elif str(have) != value:
            return False
    return True


def _label(key, value):
    if key == "causal":
        return "causal" if value else "non-causal"
    if key == "deterministic":
        return "deterministic" if value else ""
    if key in ("S", "T", "P") and isinstance(value, int) and value >= 1024 and value % 1024 == 0:
        return f"{key}={value // 1024}K" if key != "S" else f"{value // 1024}K"
    if key in ("keep", "kept") and isinstance(value, float):
        return f"{value:.0%} kept"
    if key in ("d", "head_dim"):
        return f"d{value}"
    if key == "config":
        return {"llama3-8b": "d128", "llama3-70b": "70B heads", "gqa-d64": "d64"}.get(value, str(value))
    if key == "rank":
        return f"rank {value}"
    if key == "pattern":
        return str(value)
    return f"{key}={value}"


def _run_name(path):
    for part in reversed(os.path.normpath(os.path.abspath(path)).split(os.sep)):
        if RUN_NAME.match(part):
            return part
    return os.path.basename(path)


def panels(paths, select=(), whats=None):
    """The figure's data: one dict per (file, what, time field) with ``title`` and ``groups``, a list
    of ``(shape label, ours_ms, {implementation name: time relative to ours})``."""
    out = []
    for path in paths:
        env, rows = load(path)
        device = env.get("gpu_name") or env.get("device") or ""
        rows = [r for r in rows if _selected(r, select) and (not whats or r.get("what") in whats)]
        for what in dict.fromkeys(r.get("what") for r in rows):
            mine = [r for r in rows if r.get("what") == what]
            for field, part in TIME_FIELDS.items():
                timed = [r for r in mine if isinstance(r.get(field), (int, float)) and (r.get("impl") in OURS or r.get("impl") in PEERS)]
                if not timed:
                    continue
                keys = [k for k in SHAPE_KEYS if any(k in r for r in timed)]
                varying = [k for k in keys if len({json.dumps(r.get(k)) for r in timed}) > 1]
                shapes = {}
                for r in timed:
                    shape = tuple(r.get(k) for k in keys)
                    shapes.setdefault(shape, {}).setdefault(r["impl"], []).append(float(r[field]))
                groups = []
                for shape, by_impl in shapes.items():
                    ours = next((i for i in OURS if i in by_impl), None)
                    peers = {PEERS[i]: statistics.median(v) for i, v in by_impl.items() if i in PEERS}
                    if ours is None or not peers:
                        continue
                    ours_ms = statistics.median(by_impl[ours])
                    label = "\n".join(s for k, v in zip(keys, shape) if k in varying and (s := _label(k, v)))
                    groups.append((label or "-", ours_ms, {"cubeattn": 1.0, **{p: ms / ours_ms for p, ms in peers.items()}}))
                if groups:
                    fixed = [_label(k, timed[0].get(k)) for k in keys if k not in varying and timed[0].get(k) is not None]
                    name = TITLES.get(what, str(what)) + (f", {part}" if part else "")
                    out.append({"title": name, "subtitle": " ".join(s for s in fixed if s),
                                "source": f"{_run_name(path)} {device}".strip(), "groups": groups})
    return out


def draw(figure_panels, output):
    """Writes the panels as one PNG (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"python -m cubeattn.bench figure needs matplotlib ({e}); install it with "
                         "`pip install matplotlib`") from None
    n = len(figure_panels)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 4.2 * rows), squeeze=False)
    seen = {}
    for ax, p in zip(axes.flat, figure_panels):
        names = list(dict.fromkeys(name for _, _, rel in p["groups"] for name in rel))
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            xs = [i + (j - (len(names) - 1) / 2) * width for i, (_, _, rel) in enumerate(p["groups"]) if name in rel]
            ys = [rel[name] for _, _, rel in p["groups"] if name in rel]
            seen[name] = ax.bar(xs, ys, width, color=COLORS.get(name), label=name)
        ax.axhline(1.0, color="#1f77b4", lw=0.8, ls="--")
        ax.set_xticks(range(len(p["groups"])))
        ax.set_xticklabels([f"{label}\n{ms:.3g}" for label, ms, _ in p["groups"]], fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(f"{p['title']}\n{p['subtitle']}\n{p['source']}".replace("\n\n", "\n"), fontsize=9)
        ax.set_ylabel("time / cubeattn's time", fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.legend(seen.values(), seen.keys(), loc="lower center", ncol=min(6, len(seen)), fontsize=8, frameon=False)
    fig.suptitle("cubeattn beside the peers measured in the same runs: time relative to cubeattn's (below 1: "
                 "the peer is faster), cubeattn's milliseconds under each shape; bf16, 32 q / 8 kv heads unless stated",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m cubeattn.bench figure", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="paths", nargs="+", required=True, help="benchmark JSON files")
    p.add_argument("-o", "--output", required=True, help="the PNG to write")
    p.add_argument("--select", action="append", default=[], metavar="KEY=VALUE",
                   help="keep rows whose KEY holds VALUE (or that have no KEY); repeatable")
    p.add_argument("--what", nargs="+", default=None, help="only these kinds of row (the rows' `what`)")
    args = p.parse_args(argv)
    try:
        select = parse_select(args.select)
        figure_panels = panels(args.paths, select, args.what)
    except (OSError, ValueError) as e:
        p.error(str(e))
    if not figure_panels:
        p.error("no shape has both a cubeattn row and a peer row in the same file (check --select / --what)")
    draw(figure_panels, args.output)
    print(f"wrote {args.output}: {len(figure_panels)} panels", file=sys.stderr)
    return 0
