"""`python -m cubeattn.bench figure`: which recorded rows it compares, and its error without matplotlib.

The drawing itself needs matplotlib, which the tests do not install; the data it draws comes from
`perf_figure.panels`, checked here on files written for the test."""
import json
import sys

import pytest

from cubeattn import bench, perf_figure


def _write(path, rows, env=None):
    path.write_text(json.dumps({"env": env or {"gpu_name": "GPU X"}, "rows": rows}))
    return str(path)


def test_peers_are_relative_to_ours_in_the_same_file_median_over_rounds(tmp_path):
    rows = [
        {"what": "dense_fwd", "S": 4096, "causal": True, "impl": "cubeattn_cuda", "ms": 2.0},
        {"what": "dense_fwd", "S": 4096, "causal": True, "impl": "cubeattn_cuda", "ms": 4.0},
        {"what": "dense_fwd", "S": 4096, "causal": True, "impl": "cubeattn_cuda", "ms": 3.0},
        {"what": "dense_fwd", "S": 4096, "causal": True, "impl": "sdpa_flash", "ms": 3.3},
        {"what": "dense_fwd", "S": 4096, "causal": True, "impl": "sdpa_cudnn", "ms": 1.5},
        {"what": "dense_fwd", "S": 8192, "causal": True, "impl": "cubeattn_cuda", "ms": 10.0},
        {"what": "dense_fwd", "S": 8192, "causal": True, "impl": "sdpa_flash", "ms": 12.5},
        # no cubeattn row at this shape: nothing to compare, left out
        {"what": "dense_fwd", "S": 16384, "causal": True, "impl": "sdpa_flash", "ms": 40.0},
        # not a peer the figure knows: ignored
        {"what": "dense_fwd", "S": 4096, "causal": True, "impl": "cubeattn_per_group", "ms": 99.0},
    ]
    other = [{"what": "dense_fwd", "S": 4096, "causal": True, "impl": "sdpa_flash", "ms": 0.1}]
    (p,) = perf_figure.panels([_write(tmp_path / "a.json", rows)])
    assert p["title"] == "forward" and "causal" in p["subtitle"] and "GPU X" in p["source"]
    labels = [g[0] for g in p["groups"]]
    assert labels == ["4K", "8K"]
    (_, ours4, rel4), (_, ours8, rel8) = p["groups"]
    assert ours4 == pytest.approx(3.0) and ours8 == pytest.approx(10.0)
    assert rel4 == pytest.approx({"cubeattn": 1.0, "SDPA flash (FlashAttention-2)": 1.1, "SDPA cuDNN": 0.5})
    assert rel8 == pytest.approx({"cubeattn": 1.0, "SDPA flash (FlashAttention-2)": 1.25})
    # a second file is its own panel: its peer is never set beside the first file's rows
    panels = perf_figure.panels([_write(tmp_path / "a.json", rows), _write(tmp_path / "b.json", other)])
    assert len(panels) == 1


def test_select_keeps_one_variant_and_the_peers_without_the_key(tmp_path):
    rows = [
        {"what": "fwd_torch", "d": 128, "S": 8192, "impl": "cubeattn", "variant": "A (241a430)", "ms": 1.5},
        {"what": "fwd_torch", "d": 128, "S": 8192, "impl": "sdpa_flash", "variant": "A (241a430)", "ms": 1.8},
        {"what": "fwd_torch", "d": 128, "S": 8192, "impl": "cubeattn", "variant": "B (1026ade)", "ms": 1.2},
        {"what": "fwd_torch", "d": 128, "S": 8192, "impl": "sdpa_flash", "variant": "B (1026ade)", "ms": 1.8},
        {"what": "cp_zigzag", "W": 2, "impl": "cubeattn", "keep_gathered_kv": True, "fwd_ms": 9.0, "fwdbwd_ms": 40.0},
        {"what": "cp_zigzag", "W": 2, "impl": "cubeattn", "keep_gathered_kv": False, "fwd_ms": 10.0, "fwdbwd_ms": 44.0},
        {"what": "cp_zigzag", "W": 2, "impl": "allgather_sdpa_flash", "keep_gathered_kv": None, "fwd_ms": 12.0,
         "fwdbwd_ms": 55.0},
    ]
    path = _write(tmp_path / "ab.json", rows)
    select = perf_figure.parse_select(["variant=1026ade", "keep_gathered_kv=False"])
    panels = {p["title"]: p for p in perf_figure.panels([path], select)}
    assert set(panels) == {"forward, torch path", "zigzag context parallelism (NCCL), forward",
                           "zigzag context parallelism (NCCL), fwd+bwd"}
    (_, ours, rel), = panels["forward, torch path"]["groups"]
    assert ours == pytest.approx(1.2) and rel["SDPA flash (FlashAttention-2)"] == pytest.approx(1.5)
    (_, ours, rel), = panels["zigzag context parallelism (NCCL), fwd+bwd"]["groups"]
    assert ours == pytest.approx(44.0)
    assert rel["all-gather + SDPA flash + reduce-scatter"] == pytest.approx(1.25)
    only = perf_figure.panels([path], select, whats=["fwd_torch"])
    assert [p["title"] for p in only] == ["forward, torch path"]


def test_bad_arguments_name_the_problem(tmp_path, capsys):
    with pytest.raises(ValueError, match="KEY=VALUE"):
        perf_figure.parse_select(["variant"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": 3}))
    with pytest.raises(SystemExit):
        bench.main(["figure", "--from", str(bad), "-o", str(tmp_path / "x.png")])
    assert "not a benchmark record" in capsys.readouterr().err
    lonely = _write(tmp_path / "lonely.json", [{"what": "dense_fwd", "S": 1, "impl": "sdpa_flash", "ms": 1.0}])
    with pytest.raises(SystemExit):
        bench.main(["figure", "--from", lonely, "-o", str(tmp_path / "x.png")])
    assert "no shape has both a cubeattn row and a peer row" in capsys.readouterr().err


def test_without_matplotlib_the_figure_command_says_so(tmp_path, monkeypatch):
    rows = [{"what": "dense_fwd", "S": 4096, "impl": "cubeattn_cuda", "ms": 1.0},
            {"what": "dense_fwd", "S": 4096, "impl": "sdpa_flash", "ms": 1.2}]
    path = _write(tmp_path / "a.json", rows)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    out = tmp_path / "perf.png"
    with pytest.raises(SystemExit, match="needs matplotlib"):
        bench.main(["figure", "--from", path, "-o", str(out)])
    assert not out.exists()


def test_zigzag_rows_new_and_recorded_names(tmp_path):
    """`bench grouped` / `fwdbwd` rows `zigzag_fwd` / `zigzag_fwdbwd`: ours is `cubeattn` (the torch
    call path; `cubeattn_kernel` and `cubeattn_kernel_two_calls` are not compared), the SDPA peer
    `sdpa_flash_two_calls`; records made before the rename (`grouped_zigzag_fwd`, ours
    `cubeattn_grouped`, peer `sdpa_flash_per_group`) draw the same panel."""
    key = {"config": "llama3-8b", "T": 16384, "W": 2, "rank": 0}
    new = [dict(key, what="zigzag_fwd", impl="cubeattn", ms=2.0),
           dict(key, what="zigzag_fwd", impl="cubeattn_kernel", ms=1.0),
           dict(key, what="zigzag_fwd", impl="cubeattn_kernel_two_calls", ms=1.1),
           dict(key, what="zigzag_fwd", impl="sdpa_flash_two_calls", ms=3.0),
           dict(key, what="zigzag_fwd", impl="flex_one_call", ms=2.5)]
    old = [dict(key, what="grouped_zigzag_fwd", impl="cubeattn_grouped", ms=1.0),
           dict(key, what="grouped_zigzag_fwd", impl="cubeattn_per_group", ms=1.1),
           dict(key, what="grouped_zigzag_fwd", impl="sdpa_flash_per_group", ms=3.0),
           dict(key, what="grouped_zigzag_fwd", impl="flex_one_call", ms=2.5)]
    (p,) = perf_figure.panels([_write(tmp_path / "new.json", new)])
    (q,) = perf_figure.panels([_write(tmp_path / "old.json", old)])
    assert p["title"] == q["title"] == "zigzag rank: one grouped call"
    (_, ours, rel), = p["groups"]
    assert ours == pytest.approx(2.0)
    assert rel == pytest.approx({"cubeattn": 1.0, "SDPA flash, one call per group": 1.5, "FlexAttention": 1.25})
    (_, ours, rel), = q["groups"]
    assert ours == pytest.approx(1.0)
    assert set(rel) == {"cubeattn", "SDPA flash, one call per group", "FlexAttention"}
