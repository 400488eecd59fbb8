"""Loggers of this package live under vLLM's ``vllm`` logger, so ``vllm serve`` shows them with its own format,
level (``VLLM_LOGGING_LEVEL``) and handlers, without this package importing vLLM."""

from __future__ import annotations

import logging


def get_logger(module: str) -> logging.Logger:
    return logging.getLogger("vllm.kvp2p." + module.removeprefix("vllm_kvp2p."))


class WarningPace:
    """At most one WARNING of each kind every ``interval`` seconds, and how many of that kind were not logged since
    (peers can cause some warnings at will: a flood of one cause must not flood the log). Not thread-safe: callers
    hold their own lock (or accept that a race costs a line). The clock is the caller's."""

    def __init__(self, interval: float = 60.0) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}  # kind -> when it was last logged
        self._unlogged: dict[str, int] = {}  # kind -> not logged since

    def allow(self, kind: str, now: float) -> int | None:
        """None: not now (counted); else a line of ``kind`` may be logged, and how many were not logged since the
        last one (0: none)."""
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
            return None
        self._last[kind] = now
        return self._unlogged.pop(kind, 0)
