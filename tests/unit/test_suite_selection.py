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


def test_the_older_vllm_skips_exactly_the_packages_named_newest_only(monkeypatch) -> None:
    """KVP2P_TESTS=older (vLLM 0.23's run) is the contract selection less the packages of NEWEST_VLLM_ONLY, each
    of which exists (a renamed package would otherwise quietly run on both again). The collection hook itself,
    asked about every package directory of tests/ (pytest consults it for what it finds under `tests`, the path
    scripts/test.sh gives)."""
    import tests.conftest as rule

    packages = {d.name for d in (ROOT / "tests").iterdir() if d.is_dir() and any(d.glob("test_*.py"))} - {"unit"}
    modules = {f"{d}/{m.name}" for d in packages for m in (ROOT / "tests" / d).glob("test_*.py")}
    assert rule.NEWEST_VLLM_ONLY and set(rule.NEWEST_VLLM_ONLY) <= packages | modules and "e2e" in packages
    # A module named is one of a package that otherwise runs on 0.23 (else the package is the entry).
    assert all(name.split("/")[0] not in rule.NEWEST_VLLM_ONLY for name in set(rule.NEWEST_VLLM_ONLY) & modules)

    def skipped(mode: str) -> set[str]:
        monkeypatch.setattr(rule, "MODE", mode)
        return {name for name in packages | modules if rule.pytest_ignore_collect(ROOT / "tests" / name)}

    assert skipped("contract") == set()
    assert skipped("older") == set(rule.NEWEST_VLLM_ONLY)  # a module of a skipped package is never reached
    assert set(rule.NEWEST_VLLM_ONLY) & modules, "the module entries (e2e_multinode's) are tried here too"


LEFT_BEHIND = '''
import time
from types import SimpleNamespace

import pytest

from vllm_kvp2p.testing.server import VllmServer


class HeldP(VllmServer):
    """A P whose KV blocks stay in use for 2 s after the test that made them failed (a hold left behind)."""
    freed_at = 0.0

    def is_running(self):
        return True

    @property
    def env(self):
        return {"VLLM_KVP2P_HOLD_TIMEOUT": "2", "VLLM_KVP2P_LEASE_TIMEOUT": "1"}

    def metric(self, name, **labels):
        return 0.0 if time.monotonic() >= HeldP.freed_at else 0.25


P = HeldP("model", port=1, log_path="/dev/null")


@pytest.fixture(scope="module")
def deployment():
    return SimpleNamespace(prefill=P, decode=None)
%s

def test_fails_with_a_hold_made(deployment):
    HeldP.freed_at = time.monotonic() + 2
    assert False, "failed part-way"


def test_next_one_finds_p_idle(deployment):
    assert deployment.prefill.metric("vllm:kv_cache_usage_perc") == 0.0
'''
WITHOUT_THE_WAIT = '''
@pytest.fixture(autouse=True)
def _engines_idle_after_a_failure():  # overrides tests/conftest.py's: no waiting
    yield
'''


def test_a_failed_test_leaves_nothing_for_the_next() -> None:
    """tests/conftest.py waits, after a failed test, until the engines it used report no KV block in use: the next
    test finds P idle. Without that wait (the fixture overridden), the next test fails on the first one's hold."""
    results = {}
    for name, override in (("with", ""), ("without", WITHOUT_THE_WAIT)):
        module = ROOT / "tests" / "unit" / f"test_selfcheck_{uuid.uuid4().hex[:8]}.py"
        module.write_text(LEFT_BEHIND % override)
        try:
            results[name] = pytest_run("", str(module.relative_to(ROOT)))
        finally:
            module.unlink()
    assert "1 failed, 1 passed" in results["with"].stdout, results["with"].stdout[-2000:]
    assert "2 failed" in results["without"].stdout, results["without"].stdout[-2000:]
