"""The idle step's wait ends when the worker has news, and only for its own engine."""

from __future__ import annotations

import threading

from vllm_kvp2p import step_wakeup


def test_news_ends_the_wait_and_is_consumed() -> None:
    step_wakeup.notify("engine-a")
    assert step_wakeup.idle_wait("engine-a", 5.0)  # would sleep 5 s without the news
    assert not step_wakeup.idle_wait("engine-a", 0.001)  # consumed: the next idle step sleeps again


def test_news_from_another_thread_wakes_a_waiting_step() -> None:
    timer = threading.Timer(0.01, step_wakeup.notify, args=("engine-b",))
    timer.start()
    try:
        assert step_wakeup.idle_wait("engine-b", 30.0)
    finally:
        timer.cancel()


def test_news_of_another_engine_does_not_wake() -> None:
    step_wakeup.notify("engine-c")
    assert not step_wakeup.idle_wait("engine-d", 0.001)
    assert step_wakeup.idle_wait("engine-c", 0.001)
