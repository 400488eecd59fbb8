"""The sdist carries what its wheel build reads (scripts/build_wheel.sh builds the wheel from it).

A copy of the package's build inputs is turned into an sdist through setuptools' PEP 517 hook (what
``python -m build --sdist`` calls), with ``VLLM_KVP2P_SKIP_EXT=1`` set: setup.py then lists no extension sources,
so csrc/ and CMakeLists.txt get into the sdist only through MANIFEST.in, whatever the environment the sdist is
made in. A module built in place (``pip install -e``) must not go in. The wheel itself (a CMake build, ~40 s) is
not built here: docs/deploy-ascend.md records that run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_INPUTS = ["pyproject.toml", "setup.py", "MANIFEST.in", "CMakeLists.txt", "README.md", "csrc", "vllm_kvp2p"]


def _sources(root: Path) -> set[str]:
    """Files under csrc/ and the package's .py/.pyi, relative to root."""
    found = {p.relative_to(root).as_posix() for p in (root / "csrc").rglob("*") if p.is_file()}
    found |= {
        p.relative_to(root).as_posix()
        for p in (root / "vllm_kvp2p").rglob("*")
        if p.suffix in (".py", ".pyi") and "__pycache__" not in p.parts
    }
    return found


@pytest.fixture(scope="module")
def sdist_names(tmp_path_factory: pytest.TempPathFactory) -> tuple[set[str], set[str]]:
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "*.pyc")
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, src / name)
    # what `pip install -e .` leaves next to the sources
    (src / "vllm_kvp2p" / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF built in place")
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "VLLM_KVP2P_SKIP_EXT": "1"}
    hook = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-c", hook, str(out)], cwd=src, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (sdist,) = out.glob("vllm_kvp2p-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    return names, _sources(src)


def test_the_sdist_carries_the_cmake_build_and_every_source(sdist_names: tuple[set[str], set[str]]) -> None:
    names, sources = sdist_names
    missing = sorted(({"pyproject.toml", "setup.py", "CMakeLists.txt", "MANIFEST.in"} | sources) - names)
    assert not missing, f"not in the sdist: {missing}"
    assert "csrc/npu/npu_arena.cpp" in names  # the Ascend build (CMAKE_ARGS=-DKVP2P_BUILD_NPU=ON) compiles it


def test_the_sdist_carries_no_built_module_or_test(sdist_names: tuple[set[str], set[str]]) -> None:
    names, _ = sdist_names
    junk = sorted(n for n in names if n.endswith((".so", ".pyc")) or n.startswith(("tests/", "build/")))
    assert not junk, junk
