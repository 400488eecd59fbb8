"""The sdist carries what its wheel build reads (scripts/build_wheel.sh builds the wheel from it).

A copy of the package's build inputs is turned into an sdist through setuptools' PEP 517 hook (what
``python -m build --sdist`` calls), with ``VLLM_KVP2P_SKIP_EXT=1`` set: setup.py then lists no extension sources,
so csrc/ and CMakeLists.txt get into the sdist only through MANIFEST.in, whatever the environment the sdist is
made in. A module built in place (``pip install -e``) must not go in. The wheel itself (a CMake build, ~40 s) is
not built here: docs/deploy-ascend.md records that run.

The sdist's file name is PEP 625's, ``vllm_kvp2p-0.1.0.tar.gz`` (what scripts/build_wheel.sh, README.md and
docs/deploy-ascend.md name), exactly: setuptools before 69.3 names it ``vllm-kvp2p-0.1.0.tar.gz`` and the yanked
69.3.0 and 69.4.0 ``vllm_kvp2p-0.1.tar.gz``, so pyproject.toml's ``[build-system]`` excludes them, and the setuptools
that makes the sdist here must be one pyproject allows.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from tests.support.ci_mode import lacks

REPO = Path(__file__).resolve().parents[2]
BUILD_INPUTS = ["pyproject.toml", "setup.py", "MANIFEST.in", "CMakeLists.txt", "README.md", "csrc", "vllm_kvp2p"]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def sdist_file_name(pyproject: dict) -> str:
    """PEP 625: the project name normalized (runs of ``-_.`` to ``_``, lower case) and the version, ``.tar.gz``."""
    project = pyproject["project"]
    return f"{re.sub(r'[-_.]+', '_', project['name']).lower()}-{project['version']}.tar.gz"


def setuptools_requirement(pyproject: dict) -> Requirement:
    (found,) = [r for r in map(Requirement, pyproject["build-system"]["requires"]) if r.name == "setuptools"]
    return found


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
    try:
        import setuptools  # noqa: F401 - what builds the sdist
    except ModuleNotFoundError:
        lacks("setuptools is not installed: the sdist cannot be built here")
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
    hook = ("import sys, setuptools; from setuptools import build_meta; "
            "name = build_meta.build_sdist(sys.argv[1]); print(setuptools.__version__, name)")
    proc = subprocess.run(
        [sys.executable, "-c", hook, str(out)], cwd=src, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    version, name = proc.stdout.strip().splitlines()[-1].split()
    wanted, allowed = sdist_file_name(PYPROJECT), setuptools_requirement(PYPROJECT)
    problems = [f"setuptools {version} named the sdist {name}, not {wanted} (scripts/build_wheel.sh and README.md's "
                "dist/ paths find only that name)"] if name != wanted else []
    if not allowed.specifier.contains(version, prereleases=True):
        problems.append(f"this sdist was made by setuptools {version}, which pyproject.toml's [build-system] does not "
                        f"allow ({allowed}): the check above would not be of a build pyproject allows")
    assert not problems, problems
    with tarfile.open(out / name) as tar:
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



@pytest.mark.parametrize(("setuptools", "names_it"), [
    ("64.0.0", "vllm-kvp2p-0.1.0.tar.gz"), ("65.5.0", "vllm-kvp2p-0.1.0.tar.gz"), ("69.2.0", "vllm-kvp2p-0.1.0.tar.gz"),
    ("69.3.0", "vllm_kvp2p-0.1.tar.gz"), ("69.4.0", "vllm_kvp2p-0.1.tar.gz"),
])
def test_pyproject_refuses_each_setuptools_that_misnames_the_sdist(setuptools: str, names_it: str) -> None:
    """What these setuptools named this sdist, measured by building it with each (pyproject.toml's comment; 69.3.1,
    69.4.1 and later name it right): pyproject's [build-system] allows none of them, so a build without isolation
    (scripts/build_wheel.sh's `python -m build --no-isolation` checks the requirement) refuses to make a misnamed one.
    """
    assert names_it != sdist_file_name(PYPROJECT)
    requirement = setuptools_requirement(PYPROJECT)
    assert not requirement.specifier.contains(setuptools), f"{requirement} allows {setuptools}: it names it {names_it}"
