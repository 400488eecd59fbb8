"""Which vLLM versions the connector starts on (vllm_kvp2p/connector/compat.py), against vLLM's real Scheduler creating
it.

Older than 0.23: refused at start-up with a message naming the supported range and the override setting (and the
override works); a tested release (compat.TESTED_RELEASES, CI's two) and a release-checked one (compat.CHECKED_RELEASES,
passed scripts/check_vllm_releases.sh at a recorded commit) start quietly, the start-up line saying which; anything else
from 0.23 on starts with one warning naming both sets.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest
import vllm

from tests.scheduler.harness import make_scheduler, make_vllm_config
from vllm_kvp2p.connector import compat


@pytest.mark.parametrize(
    ("version", "supported", "tested", "checked"),
    [
        ("0.22.1", False, False, False), ("0.11.0", False, False, False), ("0.23.0", True, True, False),
        ("0.23.1rc1", True, False, False), ("0.32.0", True, True, False), ("0.32.0+cpu", True, True, False),
        ("0.24.0", True, False, True), ("0.31.0", True, False, True), ("0.28.2", True, False, False),
        ("0.33.0", True, False, False), ("1.0.0", True, False, False), ("garbage", False, False, False),
    ],
)
def test_support_verdict(version: str, supported: bool, tested: bool, checked: bool) -> None:
    verdict = compat.support_verdict(version)
    assert (verdict.supported, verdict.tested, verdict.checked) == (supported, tested, checked), verdict
    assert verdict.warns == (supported and not tested and not checked)
    assert ("release-checked" in verdict.label) == checked
    if not supported:
        assert "vLLM >= 0.23" in verdict.message and compat.ALLOW_UNSUPPORTED_SETTING in verdict.message
        assert compat.support_verdict(version, allow_unsupported=True).supported


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "_checked", threading.Event())


def _producer_scheduler():  # vLLM's Scheduler creates the connector (SCHEDULER role) as an engine would
    return make_scheduler(make_vllm_config("kv_producer", engine_id="p-support"))


def test_older_vllm_is_refused_when_the_engine_creates_the_connector(
    monkeypatch: pytest.MonkeyPatch, fresh_warning: None
) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.22.1")
    monkeypatch.delenv(compat.ALLOW_UNSUPPORTED_SETTING, raising=False)
    with pytest.raises(compat.UnsupportedVllmError) as err:
        _producer_scheduler()
    message = str(err.value)
    assert "supports vLLM >= 0.23" in message and "0.22.1 is installed" in message
    assert f"{compat.ALLOW_UNSUPPORTED_SETTING}=1" in message


def test_the_override_starts_an_older_vllm_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, fresh_warning: None, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.22.1")
    monkeypatch.setenv(compat.ALLOW_UNSUPPORTED_SETTING, "1")
    with caplog.at_level(logging.WARNING):
        sched = _producer_scheduler()
    assert sched.connector is not None
    assert any("starting anyway because" in r.getMessage() for r in caplog.records)


def test_untested_newer_vllm_starts_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, fresh_warning: None, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with caplog.at_level(logging.WARNING):
        _producer_scheduler()
        _producer_scheduler()  # a second connector in the same process: no second warning
    untested = [r for r in caplog.records if "untested with MooncakeP2PConnector" in r.getMessage()]
    assert len(untested) == 1, [r.getMessage() for r in caplog.records]


def test_the_running_vllm_warns_exactly_when_untested(fresh_warning: None, caplog: pytest.LogCaptureFixture) -> None:
    """CI's two releases are tested ones and those scripts/check_vllm_releases.sh passed are release-checked ones
    (no warning); a release being checked for the first time is neither yet, and says so once."""
    warns = compat.support_verdict(vllm.__version__).warns
    with caplog.at_level(logging.WARNING):
        _producer_scheduler()
    warnings = [r for r in caplog.records if "untested with MooncakeP2PConnector" in r.getMessage()]
    assert len(warnings) == (1 if warns else 0), [r.getMessage() for r in warnings]


def test_an_old_vllm_gets_the_message_not_an_import_error() -> None:
    """The refusal comes before the connector module imports vLLM's contract, which an old vLLM lacks."""
    code = (
        "import vllm; vllm.__version__ = '0.20.0'\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1 import base\n"
        "del base.KVConnectorBase_V1\n"  # what an old vLLM lacks: importing it would be an ImportError
        "import vllm_kvp2p.connector.facade\n"
    )
    env_blocked = {k: v for k, v in os.environ.items() if k != compat.ALLOW_UNSUPPORTED_SETTING}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env_blocked)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm_kvp2p.connector.compat.UnsupportedVllmError: "), last
    assert "supports vLLM >= 0.23" in last, last


@pytest.mark.parametrize(
    ("vllm_version", "ascend_version", "problem"),
    [
        ("0.23.0", None, None),
        ("0.32.0", None, None),
        ("0.23.0", "0.23.0.post1", None),
        ("0.23.0+empty", "0.23.0", None),
        ("0.32.0", "0.23.0.post1", "built for vLLM 0.23.0 but vLLM 0.32.0 is installed"),
        ("0.23.0", "0.22.1rc1", "not in the tested matrix"),
        ("0.30.0", "0.30.0rc2", None),
        ("0.23.0", "0.30.0rc2", "built for vLLM 0.30.0 but vLLM 0.23.0 is installed"),
    ],
)
def test_vllm_ascend_pairing(vllm_version: str, ascend_version: str | None, problem: str | None) -> None:
    found = compat.ascend_pairing_problem(vllm_version, ascend_version)
    assert (found is None) == (problem is None) and (problem is None or problem in found), found
