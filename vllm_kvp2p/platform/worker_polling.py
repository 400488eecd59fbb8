"""Bound how long vLLM's processes busy-poll their shared-memory queues after each message.

vLLM's ``shm_broadcast.SpinCondition`` makes a reader (each worker waiting for the next step, the engine core
waiting for the workers' output) spin on ``sched_yield`` for ``busy_loop_s`` = 1 s after every message before it
sleeps on a socket. A P/D connector keeps the engine stepping while P holds blocks or D waits for KV (every
``idle_step_sleep``, 5 ms), so those readers never stop spinning: each worker and engine core takes a whole core
for as long as any transfer is pending. On a host with few cores that starves the threads that move the KV
(side channel, Mooncake): measured here with P at TP 2 and D at TP 1 on 2 cores, one side-channel round trip
took up to 64 s and most pulls failed; with the window at 2 ms every pull took ~10 ms.

:func:`limit_busy_poll` bounds the spin of every reader in this process (existing ones included: the check is
made on each wait) to a window counted from when the reader starts waiting, and bounds each sleep after it to
``SLEEP_RECHECK_MS``. Guarded by what it patches: if vLLM's class or method is not there in the expected form, one
warning and nothing changed.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from typing import Any

from vllm_kvp2p.log import get_logger

logger = get_logger(__name__)

_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
# A reader this module sends to sleep wakes on vLLM's notify socket, or re-checks its buffer after the timeout it
# is given: vLLM's is 5 s (SHM_READER_RECHECK_INTERVAL_MS), so a notification it misses would stall the engine for
# 5 s (measured in serving runs here: every in-flight request 5.4-5.8 s late at once). Readers sleep far more
# often with the window bounded, so their sleep is also bounded: an idle reader wakes 20 times a second.
SLEEP_RECHECK_MS = 50
_lock = threading.Lock()
_applied: float | None = None


def limit_busy_poll(window_s: float) -> bool:
    """Make vLLM's shared-memory readers in this process spin at most ``window_s`` after a message. True when
    applied (now or before, with the smallest window asked for winning), False when vLLM's code does not match."""
    global _applied
    with _lock:
        if _applied is not None:
            _applied = min(_applied, window_s)
            return True
        try:
            import importlib

            module = importlib.import_module(_MODULE)
        except ImportError as exc:
            logger.warning("cannot bound vLLM's busy polling: %s not importable (%s)", _MODULE, exc)
            return False
        cls = getattr(module, "SpinCondition", None)
        wait = getattr(cls, "wait", None)
        if wait is None or tuple(inspect.signature(wait).parameters)[:2] != ("self", "timeout_ms"):
            logger.warning("cannot bound vLLM's busy polling: %s.SpinCondition.wait not found in the expected form",
                           _MODULE)
            return False
        _applied = window_s
        cls.wait = _bounded(wait)
    logger.info("vLLM shared-memory readers in this process busy-poll at most %.3f s after a message "
                "(vLLM's default is 1 s; setting worker_busy_poll)", window_s)
    return True


def _bounded(wait: Any) -> Any:
    """vLLM spins while ``now <= last_read + busy_loop_s``. The bound counts from when the reader started waiting
    instead: a step that computes longer than the window must not send the reader to sleep after every step (that
    cost a single instance 26% of its decode rate when the window was counted from the last read)."""

    @functools.wraps(wait)
    def bounded_wait(self: Any, timeout_ms: int | None = None) -> Any:
        window = _applied
        if window is None or not hasattr(self, "last_read"):
            return wait(self, timeout_ms)
        now = time.monotonic()
        state = self.__dict__.setdefault("_kvp2p_wait", [None, now, getattr(self, "busy_loop_s", 0)])
        if state[0] != self.last_read:  # first wait since a message arrived
            state[0], state[1] = self.last_read, now
        # Spin (vLLM's own window) until `window` has passed since the wait began, then sleep on the socket, for
        # at most SLEEP_RECHECK_MS at a time (the caller re-checks its buffer and waits again).
        self.busy_loop_s = state[2] if now - state[1] <= window else 0
        return wait(self, SLEEP_RECHECK_MS if timeout_ms is None else min(timeout_ms, SLEEP_RECHECK_MS))

    return bounded_wait


def apply_setting(setting: float, platform_default: float | None) -> None:
    """The ``worker_busy_poll`` setting: a window in seconds, or < 0 for the platform's default (None: leave
    vLLM alone)."""
    window = setting if setting >= 0 else platform_default
    if window is not None:
        limit_busy_poll(window)
