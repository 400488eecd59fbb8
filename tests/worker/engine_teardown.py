"""Mooncake's engine tear-down takes about a second (inside Mooncake, once an engine has talked to a peer), and
the worker tests make two engines per pair, a fresh pair in a score of tests: closed one after another that was
~20 s of each vLLM's run spent waiting. ``close_later`` closes them on a thread of their own once the test is
done with them; tests/worker/conftest.py waits for every one at the package's end, so none outlives the tests."""

from __future__ import annotations

import threading
from typing import Protocol


class _Closable(Protocol):
    def close(self) -> None: ...


_closing: list[threading.Thread] = []


def close_later(*engines: _Closable) -> None:
    def close() -> None:
        for engine in engines:
            engine.close()

    thread = threading.Thread(target=close, name="mooncake-close", daemon=True)
    thread.start()
    _closing.append(thread)


def wait_for_closes(timeout: float = 60.0) -> None:
    while _closing:
        thread = _closing.pop()
        thread.join(timeout)
        assert not thread.is_alive(), "a Mooncake engine did not close within 60 s"
