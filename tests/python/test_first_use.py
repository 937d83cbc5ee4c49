"""First use (issue 13): a plain `pip install .` builds the CUDA backend (pyproject's features),
`scripts/gpu-test.sh --help` prints its usage and exits 0, and the Rust GPU tests are listed as
ignored with their reason where no GPU runs them (not as passing)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_pyproject_builds_the_cuda_feature():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        features = tomllib.load(f)["tool"]["maturin"]["features"]
    assert "python" in features and "cuda" in features


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_gpu_test_help_is_clean(flag):
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu-test.sh"), flag], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "COMMAND" in r.stdout and "sanitize" in r.stdout
    # the usage only: no line of the script itself
    assert not re.search(r"^(set |ROOT=|cd |usage\(\))", r.stdout, re.M), r.stdout
    assert r.stderr == ""
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu-test.sh")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "COMMAND" in r.stderr


def test_rust_gpu_tests_are_ignored_with_a_reason():
    """Every #[test] of tests/gpu is #[ignore]d with a reason (run with --include-ignored by
    scripts/gpu-test.sh), so a GPU-less cargo test reports them as ignored."""
    gpu = os.path.join(ROOT, "tests", "gpu")
    n = 0
    for name in sorted(os.listdir(gpu)):
        if not name.endswith(".rs"):
            continue
        lines = open(os.path.join(gpu, name)).read().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == "#[test]":
                n += 1
                assert re.match(r'\s*#\[ignore = "[^"]+"\]', lines[i + 1]), f"{name}:{i + 2}: not ignored with a reason"
    assert n >= 13
    script = open(os.path.join(ROOT, "scripts", "gpu-test.sh")).read()
    assert "--include-ignored" in script and "CUBEATTN_REQUIRE_GPU=1" in script
