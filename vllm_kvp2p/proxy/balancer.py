"""Least-outstanding-requests instance picker for the P/D proxy.

Prefill and decode cost grows with the number of requests an instance is already serving, so the proxy sends
each new request to the instance with the fewest requests in flight. Ties (e.g. an idle cluster) are broken
round-robin so that sequential traffic still spreads instead of always hitting the first instance.

The class is pure (no I/O, no event loop) so it can be tested directly; a lock makes it safe to share between
threads too, although the proxy only uses it from one event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


class LeastOutstandingBalancer:
    """Pick the instance with the fewest outstanding requests; ties go round-robin.

    Every :meth:`acquire` must be paired with exactly one :meth:`release` (use :meth:`lease` or try/finally),
    otherwise the instance looks busier than it is forever.
    """

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("LeastOutstandingBalancer needs at least one instance")
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate instance urls: {list(urls)}")
        self._urls: tuple[str, ...] = tuple(urls)
        self._outstanding: list[int] = [0] * len(self._urls)
        self._served: list[int] = [0] * len(self._urls)
        self._index: dict[str, int] = {u: i for i, u in enumerate(self._urls)}
        # Where the round-robin tie-break starts looking next time.
        self._cursor = 0
        self._lock = threading.Lock()

    @property
    def urls(self) -> tuple[str, ...]:
        """The instances, in the order given."""
        return self._urls

    def acquire(self, exclude: str | None = None) -> str:
        """Choose an instance, count one more request on it, and return its url.

        ``exclude`` (one of the instance urls) is skipped unless it is the only instance, so a retry after a
        failure goes to another instance when there is one; the choice among the others is the usual one.
        """
        with self._lock:
            n = len(self._urls)
            skip = -1 if exclude is None else self._index[exclude]  # KeyError for an unknown url, like release()
            if n == 1:
                skip = -1  # nowhere else to go
            least = min(o for i, o in enumerate(self._outstanding) if i != skip)
            for step in range(n):
                i = (self._cursor + step) % n
                if i != skip and self._outstanding[i] == least:
                    break
            else:  # pragma: no cover - min() guarantees a hit
                raise AssertionError("unreachable")
            self._outstanding[i] += 1
            self._served[i] += 1
            self._cursor = (i + 1) % n
            return self._urls[i]

    def release(self, url: str) -> None:
        """Count one request fewer on ``url`` (never below zero, so a double release cannot go negative)."""
        with self._lock:
            i = self._index[url]
            if self._outstanding[i] > 0:
                self._outstanding[i] -= 1

    @contextmanager
    def lease(self) -> Iterator[str]:
        """``with balancer.lease() as url:`` acquire for the duration of the block, release whatever happens."""
        url = self.acquire()
        try:
            yield url
        finally:
            self.release(url)

    def outstanding(self, url: str) -> int:
        """Requests currently in flight on ``url``."""
        with self._lock:
            return self._outstanding[self._index[url]]

    def snapshot(self) -> list[dict[str, Any]]:
        """Per-instance ``url``, ``outstanding`` and ``served`` (total acquired), for /health and logs."""
        with self._lock:
            return [
                {"url": u, "outstanding": o, "served": s}
                for u, o, s in zip(self._urls, self._outstanding, self._served, strict=True)
            ]
