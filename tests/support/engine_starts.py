"""Where a pytest run's time goes: per test package, its tests' seconds (set-up, call and tear-down) and the
``vllm serve`` start-ups it paid for (each costs tens of seconds on a 2-core machine before a single assertion).
A pytest plugin, loaded by tests/conftest.py outside the pure run: it wraps
:class:`vllm_kvp2p.testing.server.VllmServer` for the session only, and prints one table at the end (and writes
the start-ups as JSON to ``$KVP2P_ENGINE_REPORT`` when set). Nothing in the package knows about it."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import pytest

from tests.support.ci_budget import budget_of


@dataclass(frozen=True)
class EngineStart:
    test: str  # the test whose set-up (or body) started it
    package: str
    engine_cores: int  # data-parallel ranks: one EngineCore process each
    workers: int  # tensor-parallel ranks x data-parallel ranks
    seconds: float  # start() to the first healthy /health (0 when never ready)


def _package(nodeid: str) -> str:
    """tests/e2e_tp/test_x.py::test_y -> e2e_tp"""
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "-"


def _parallel_size(args: tuple[str, ...], *names: str) -> int:
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return int(args[i + 1])
            if arg.startswith(name + "="):
                return int(arg.split("=", 1)[1])
    return 1


class EngineStartLedger:
    def __init__(self) -> None:
        self.current = "(outside a test)"
        self.starts: list[EngineStart] = []
        self.seconds: dict[str, float] = defaultdict(float)  # package -> its tests' set-up + call + tear-down
        self.tests: dict[str, int] = defaultdict(int)
        self._undo: list[Any] = []

    def install(self) -> None:
        from vllm_kvp2p.testing.server import VllmServer

        ledger = self
        original_start, original_ready = VllmServer.start, VllmServer.wait_ready

        def start(server: VllmServer) -> VllmServer:
            server.__dict__["_kvp2p_started"] = time.monotonic()
            server.__dict__["_kvp2p_counted"] = False
            return original_start(server)

        def wait_ready(server: VllmServer, timeout: float | None = None) -> VllmServer:
            try:
                return original_ready(server, timeout)
            finally:
                if not server.__dict__.get("_kvp2p_counted", True):
                    server.__dict__["_kvp2p_counted"] = True
                    ledger.record(server)

        VllmServer.start, VllmServer.wait_ready = start, wait_ready  # type: ignore[method-assign]
        self._undo.append(lambda: setattr(VllmServer, "start", original_start))
        self._undo.append(lambda: setattr(VllmServer, "wait_ready", original_ready))

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def record(self, server: Any) -> None:
        args = tuple(server.extra_args)
        dp = _parallel_size(args, "--data-parallel-size", "-dp")
        tp = _parallel_size(args, "--tensor-parallel-size", "-tp")
        healthy = server.is_running()
        seconds = time.monotonic() - server.__dict__["_kvp2p_started"] if healthy else 0.0
        package = _package(self.current)
        self.starts.append(EngineStart(self.current, package, dp, dp * tp, round(seconds, 1)))

    # -- pytest hooks -------------------------------------------------------------------------------------------
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Any:
        self.current = item.nodeid
        yield
        self.current = "(outside a test)"

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        package = _package(report.nodeid)
        self.seconds[package] += report.duration
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.tests[package] += 1

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.seconds:
            return
        by_package: dict[str, list[EngineStart]] = defaultdict(list)
        for start in self.starts:
            by_package[start.package].append(start)
        write = terminalreporter.write_line
        terminalreporter.section("where the time goes (tests/support/engine_starts.py)")
        write(f"{'package':<14} {'tests':>5} {'seconds':>7} {'budget':>6} {'servers':>7} {'cores':>5} {'workers':>7} "
              f"{'s to ready':>10}")
        rows = [(p, self.tests[p], self.seconds[p], by_package.get(p, [])) for p in self.seconds]
        rows.append(("total", sum(self.tests.values()), sum(self.seconds.values()), self.starts))
        over = []
        import vllm  # this plugin runs only where vLLM is importable (not in the pure run)

        vllm_version = vllm.__version__
        for package, tests, seconds, starts in sorted(rows[:-1], key=lambda r: -r[2]) + rows[-1:]:
            budget = budget_of(package, vllm_version) if package != "total" else None
            mark = ""
            if budget is not None and seconds > budget:
                mark = "  OVER"
                over.append(package)
            write(f"{package:<14} {tests:>5} {seconds:>7.0f} {budget if budget is not None else '':>6} "
                  f"{len(starts):>7} {sum(s.engine_cores for s in starts):>5} {sum(s.workers for s in starts):>7} "
                  f"{sum(s.seconds for s in starts):>10.0f}{mark}")
        if over:
            write(f"over their CI budget (tests/support/ci_budget.py, docs/testing.md): {', '.join(over)}")
        report = os.environ.get("KVP2P_ENGINE_REPORT")
        if report:
            with open(report, "w") as out:
                json.dump([asdict(s) for s in self.starts], out, indent=1)
