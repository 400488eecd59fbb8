"""How many ``vllm serve`` start-ups a pytest run pays for, and where (issue 22: each costs tens of seconds on a
2-core machine before a single assertion). A pytest plugin, loaded by tests/conftest.py outside the pure run: it
wraps :class:`vllm_kvp2p.testing.server.VllmServer` for the session only, and prints one table at the end (and
writes it as JSON to ``$KVP2P_ENGINE_REPORT`` when set). Nothing in the package knows about it."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class EngineStart:
    test: str  # the test whose set-up (or body) started it
    package: str
    engine_cores: int  # data-parallel ranks: one EngineCore process each
    workers: int  # tensor-parallel ranks x data-parallel ranks
    seconds: float  # start() to the first healthy /health (0 when never ready)


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
        package = self.current.split("/")[1] if self.current.startswith("tests/") else "-"
        self.starts.append(EngineStart(self.current, package, dp, dp * tp, round(seconds, 1)))

    # -- pytest hooks -------------------------------------------------------------------------------------------
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Any:
        self.current = item.nodeid
        yield
        self.current = "(outside a test)"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.starts:
            return
        by_package: dict[str, list[EngineStart]] = defaultdict(list)
        for start in self.starts:
            by_package[start.package].append(start)
        write = terminalreporter.write_line
        terminalreporter.section("engine start-ups (vllm serve)")
        write(f"{'package':<14} {'servers':>7} {'cores':>5} {'workers':>7} {'s to ready':>10}")
        for package, starts in sorted(by_package.items(), key=lambda kv: -sum(s.seconds for s in kv[1])):
            write(f"{package:<14} {len(starts):>7} {sum(s.engine_cores for s in starts):>5} "
                  f"{sum(s.workers for s in starts):>7} {sum(s.seconds for s in starts):>10.0f}")
        write(f"{'total':<14} {len(self.starts):>7} {sum(s.engine_cores for s in self.starts):>5} "
              f"{sum(s.workers for s in self.starts):>7} {sum(s.seconds for s in self.starts):>10.0f}")
        report = os.environ.get("KVP2P_ENGINE_REPORT")
        if report:
            with open(report, "w") as out:
                json.dump([asdict(s) for s in self.starts], out, indent=1)
