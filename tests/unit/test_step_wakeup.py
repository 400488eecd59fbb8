"""The idle step's wait ends when a worker of its engine has news, across processes, and only for that engine."""

from __future__ import annotations

import multiprocessing as mp
import uuid

import pytest

from vllm_kvp2p.connector.step_wakeup import StepNotifier, StepWaiter


@pytest.fixture
def engine_id() -> str:
    return "engine-" + uuid.uuid4().hex


def test_news_ends_the_wait_and_is_consumed(engine_id: str) -> None:
    waiter, notifier = StepWaiter(engine_id, 0), StepNotifier(engine_id, 0)
    try:
        assert waiter.listening
        assert not waiter.wait(0.001)  # no news: the plain sleep
        notifier.notify()
        notifier.notify()
        assert waiter.wait(30.0)  # would sleep 30 s without the news
        assert not waiter.wait(0.001)  # both bytes consumed by the one wake-up
    finally:
        waiter.close()
        notifier.close()


def _notify(engine_id: str) -> None:
    notifier = StepNotifier(engine_id, 0)
    notifier.notify()
    notifier.close()


def test_news_from_a_worker_process_wakes_the_scheduler(engine_id: str) -> None:
    waiter = StepWaiter(engine_id, 0)
    try:
        proc = mp.get_context("spawn").Process(target=_notify, args=(engine_id,))
        proc.start()
        assert waiter.wait(60.0)
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        waiter.close()


def test_news_of_another_engine_or_dp_rank_does_not_wake(engine_id: str) -> None:
    waiter = StepWaiter(engine_id, 0)
    try:
        StepNotifier(engine_id, 1).notify()
        StepNotifier("other-" + engine_id, 0).notify()
        assert not waiter.wait(0.01)
    finally:
        waiter.close()


def test_a_second_scheduler_of_the_same_engine_sleeps_plainly(engine_id: str) -> None:
    first, second = StepWaiter(engine_id, 0), StepWaiter(engine_id, 0)
    try:
        assert first.listening and not second.listening
        StepNotifier(engine_id, 0).notify()
        assert not second.wait(0.001)
        assert first.wait(1.0)
    finally:
        first.close()
        second.close()


def test_notify_without_a_scheduler_is_harmless(engine_id: str) -> None:
    notifier = StepNotifier(engine_id, 0)
    for _ in range(10_000):  # nobody bound: every send fails quietly
        notifier.notify()
    notifier.close()


def test_a_flood_of_datagrams_only_shortens_idle_sleeps(engine_id: str) -> None:
    """Anyone in the network namespace can send to the socket: big or many datagrams. Each wait stays bounded (the
    drain reads at most 1024 datagrams, 16 bytes of each), and once the flood stops the waits sleep again."""
    import socket
    import threading
    import time

    from vllm_kvp2p.connector.step_wakeup import address

    waiter = StepWaiter(engine_id, 0)
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        payloads = (b"!", b"\xff" * 60_000)
        deadline = time.monotonic() + 10  # bounded even if the test body fails
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                sock.sendto(payloads[sent[0] % 2], address(engine_id, 0))
                sent[0] += 1
            except BlockingIOError:  # the queue is full: the kernel bounds it
                time.sleep(0.0005)
        sock.close()

    flooder = threading.Thread(target=flood, daemon=True)
    try:
        flooder.start()
        slowest, woken = 0.0, 0
        start = time.monotonic()
        while time.monotonic() - start < 0.5:
            t0 = time.monotonic()
            woken += waiter.wait(5.0)  # would sleep 5 s without news
            slowest = max(slowest, time.monotonic() - t0)
        stop.set()
        flooder.join(10)
        assert not flooder.is_alive()
        assert sent[0] > 1024 and woken > 0
        assert slowest < 2.0, f"one wait under the flood took {slowest:.2f} s"
        # What is queued drains in a few wake-ups (each takes up to 1024), then the plain sleep is back.
        for _ in range(200):
            if not waiter.wait(0.001):
                break
        else:
            pytest.fail("the waiter still wakes 200 waits after the flood stopped")
    finally:
        stop.set()
        waiter.close()
