"""The rule of tests/conftest.py that decides which tests each vLLM runs: its check fails a pure module that
imports vLLM, and the two selections split the suite exactly (nothing dropped, nothing run twice on one vLLM)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pytest_run(mode: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVP2P_TESTS": mode}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_pure_module_that_imports_vllm_fails_the_check() -> None:
    module = ROOT / "tests" / "unit" / f"test_selfcheck_{uuid.uuid4().hex[:8]}.py"
    module.write_text("import vllm\n\n\ndef test_uses_vllm():\n    assert vllm\n")
    try:
        run = pytest_run("pure", str(module.relative_to(ROOT)))
    finally:
        module.unlink()
    assert run.returncode != 0 and "belongs in NEEDS_VLLM_OR_MOONCAKE" in run.stdout, run.stdout[-2000:]


def test_the_two_selections_split_the_suite() -> None:
    """Every module of tests/unit runs in exactly one of the two selections; everything outside tests/unit only in
    the contract one (pure collects nothing there, so it imports nothing there)."""
    def modules(mode: str, where: str) -> set[str]:
        run = pytest_run(mode, "--co", where)
        assert run.returncode in (0, 5), run.stdout[-2000:]  # 5: nothing collected
        return {line.split("::")[0] for line in run.stdout.splitlines() if "::" in line}

    pure, contract = modules("pure", "tests"), modules("contract", "tests/unit")
    every = {f"tests/unit/{p.name}" for p in (ROOT / "tests" / "unit").glob("test_*.py")}
    assert pure and contract and not pure & contract and pure | contract == every
    assert not modules("pure", "tests/e2e")
