"""A built wheel is a complete install: it carries the bundled drafters and the C++ sources, and an
installed copy finds its drafters without a source checkout (setup.py, models.checkpoints_dir)."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_major() -> int:
    try:
        import setuptools
    except ImportError:
        return 0
    return int(setuptools.__version__.split(".")[0])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # the environment's setuptools (torch requires one) where it is new enough for pyproject.toml, else pip fetches one
    isolation = ["--no-build-isolation"] if _setuptools_major() >= 77 else []
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", *isolation,
                        "-q", "-w", str(out)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named pip" in r.stderr:
        pytest.skip("no pip in this environment")
    assert r.returncode == 0, r.stderr[-2000:]
    (path,) = out.glob("dominotree-*.whl")
    return path


def test_the_wheel_carries_the_drafters_byte_for_byte_and_the_native_sources(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        drafters = sorted(p.parent for p in (ROOT / "checkpoints").glob("*/config.json"))
        assert {d.name for d in drafters} >= {"smollm2-135m-dflash", "smollm2-135m-domino"}
        for d in drafters:
            for f in ("config.json", "model.safetensors"):
                assert z.read(f"dominotree/checkpoints/{d.name}/{f}") == (d / f).read_bytes()
    assert {"dominotree/tree_attention.cpp", "dominotree/trees/native/dominotree_builder.cpp",
            "dominotree/trees/native/domino_chain.cpp", "dominotree/trees/native/head_ops.h"} <= names


def test_an_installed_wheel_resolves_its_own_drafters(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    code = ("import dominotree.models as m; import dominotree.drafters as d;"
            "print(m.resolve_drafter('smollm2-135m-domino')); print(d.load_drafter('smollm2-135m-dflash').config.block_size)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("DOMINOTREE_CHECKPOINTS", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    path, block = r.stdout.split()
    assert Path(path) == site / "dominotree" / "checkpoints" / "smollm2-135m-domino"
    assert int(block) == 16
