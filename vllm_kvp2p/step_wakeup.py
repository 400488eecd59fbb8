"""Ends an idle engine step's sleep as soon as the worker has news for the scheduler.

An engine step that schedules nothing sleeps ``idle_step_sleep`` (scheduler.py) so that the engine, kept stepping
by holds and pending loads, leaves the cores to the threads that move the KV. The news that ends the wait (a pull
finished on D, a release on P) comes from the worker's threads and reaches the scheduler only with the next step's
``get_finished``; sleeping the full interval after it costs up to ``idle_step_sleep`` of TTFT per request.

When vLLM runs the worker inside the engine-core process (TP 1: its ``UniProcExecutor``), the sleep waits on this
process-local event, so the step that carries the news starts at once. Across processes (TP > 1) nothing sets the
scheduler's event and the wait is the plain sleep it was. Keyed by engine id: one process may hold several engines
(tests, or a ``MultiConnector`` of two).
"""

from __future__ import annotations

import threading

_events: dict[str, threading.Event] = {}
_lock = threading.Lock()


def _event(engine_id: str) -> threading.Event:
    with _lock:
        return _events.setdefault(engine_id, threading.Event())


def notify(engine_id: str) -> None:
    """The worker has something the next step's ``get_finished`` will report."""
    _event(engine_id).set()


def idle_wait(engine_id: str, seconds: float) -> bool:
    """Sleep up to ``seconds``; True when news ended it early. News that arrives after the wait ends is still
    collected by the step that follows (the event only shortens the sleep, it never carries the news)."""
    event = _event(engine_id)
    woke = event.wait(seconds)
    event.clear()
    return woke
