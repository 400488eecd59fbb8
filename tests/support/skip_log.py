"""Every test this run did not really run, written down for scripts/check_skips.py: a pytest plugin that, when
``KVP2P_SKIP_LOG`` names a file, writes one JSON line per skipped test or module (``pytest.skip``, ``skipif``,
``importorskip``, a fixture that skips), per xfailed test and per xpassed one, with pytest's own node id and reason.

Registered by tests/conftest.py (and usable as ``-p tests.support.skip_log``). scripts/test.sh gives each run part
(vLLM 0.32 pure, 0.32 contract, 0.23 older) a file of its own and holds it to tests/expected_skips.toml. The file
opens with a ``start`` line and closes with a ``finish`` line (pytest's exit status), so a run that died part-way, or
a log nobody wrote, is seen as such and never read as "no skips". Pure: imports neither vLLM nor Mooncake.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

import pytest

SKIP_LOG_ENV = "KVP2P_SKIP_LOG"


def _reason(longrepr: Any) -> str:
    """pytest keeps a skip's reason as (path, line, "Skipped: <reason>")."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2])
    else:
        text = str(longrepr)
    return text.removeprefix("Skipped: ")


class SkipLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._out: IO[str] | None = None

    def _write(self, record: dict[str, Any]) -> None:
        if self._out is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._out = self.path.open("w", encoding="utf-8")
        self._out.write(json.dumps(record, sort_keys=True) + "\n")
        self._out.flush()  # a run killed part-way still leaves what it saw

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self._write({"event": "start", "tests": os.environ.get("KVP2P_TESTS", "")})

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:  # a whole module: pytest.skip(allow_module_level=True), importorskip at import
            self._write({"event": "skipped", "test": report.nodeid, "reason": _reason(report.longrepr)})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        xfail = getattr(report, "wasxfail", None)
        if report.skipped and xfail is not None:
            self._write({"event": "xfailed", "test": report.nodeid, "reason": str(xfail)})
        elif report.skipped:
            self._write({"event": "skipped", "test": report.nodeid, "reason": _reason(report.longrepr)})
        elif report.passed and report.when == "call" and xfail is not None:
            self._write({"event": "xpassed", "test": report.nodeid, "reason": str(xfail)})

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self._write({"event": "finish", "exitstatus": int(exitstatus)})
        if self._out is not None:
            self._out.close()


def pytest_configure(config: pytest.Config) -> None:
    # Taken out of the environment: a pytest some test starts in a subprocess must not write over this run's log.
    path = os.environ.pop(SKIP_LOG_ENV, None)
    if path and not config.pluginmanager.has_plugin("kvp2p-skip-log-writer"):
        config.pluginmanager.register(SkipLog(Path(path)), "kvp2p-skip-log-writer")
