"""A side-channel handler may answer later (a Future): the server thread meanwhile answers everything else, and
sends the deferred answer, sealed for its own request, once it is set (vllm_kvp2p/side_channel.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import pytest

from vllm_kvp2p import side_channel
from vllm_kvp2p.auth import Authenticator
from vllm_kvp2p.protocol import ErrorReply, GetRankTable, GetRegistration, Reply, Request
from vllm_kvp2p.side_channel import SideChannelClient, SideChannelError, SideChannelServer
from vllm_kvp2p.testing.server import free_port

SECRET = b"s" * 32


class Handler:
    """GetRegistration(1): answered later, by the test; anything else at once."""

    def __init__(self) -> None:
        self.later: list[Future[Reply]] = []

    def __call__(self, message: Request) -> Reply | Future[Reply]:
        if isinstance(message, GetRegistration) and message.tp_rank == 1:
            future: Future[Reply] = Future()
            self.later.append(future)
            return future
        return ErrorReply(f"at once: {type(message).__name__}")


@pytest.fixture(params=[False, True], ids=["plain", "sealed"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[SideChannelServer, Handler, int, Authenticator | None]]:
    auth = Authenticator(SECRET, 30.0) if request.param else None
    handler, port = Handler(), free_port()
    server = SideChannelServer("127.0.0.1", port, handler, setting="test", auth=auth)
    yield server, handler, port, auth
    server.close()


def ask(port: int, message: Request, auth: Authenticator | None, timeout: float = 5.0) -> tuple[str, float]:
    """What the server answered (an error's text: the client raises it) and how long it took."""
    client = SideChannelClient(timeout, attempts=1, auth=auth)
    start = time.monotonic()
    try:
        client.request("127.0.0.1", port, message)
        return "no error", time.monotonic() - start
    except SideChannelError as exc:
        return str(exc), time.monotonic() - start
    finally:
        client.close()


def test_a_deferred_answer_holds_up_nothing_and_arrives_when_set(served) -> None:
    server, handler, port, auth = served
    answers: list[tuple[str, float]] = []
    waiting = threading.Thread(target=lambda: answers.append(ask(port, GetRegistration(1), auth)))
    waiting.start()
    while not handler.later:
        time.sleep(0.01)
    said, took = ask(port, GetRankTable(), auth)  # while the first waits for its answer
    assert "at once: GetRankTable" in said and took < 0.5, (said, took)
    time.sleep(0.3)
    assert not answers  # still waiting
    handler.later[0].set_result(ErrorReply("later"))
    waiting.join(5)
    assert answers and "answered with an error: later" in answers[0][0] and answers[0][1] >= 0.3, answers


def test_a_deferred_answer_that_fails_is_an_error_reply_and_counted(served) -> None:
    server, handler, port, auth = served
    threading.Timer(0.2, lambda: handler.later[0].set_exception(RuntimeError("boom"))).start()
    said, _ = ask(port, GetRegistration(1), auth)
    assert "RuntimeError: boom" in said and server.dropped["handler_error"] == 1


def test_deferred_answers_waiting_are_bounded(served, monkeypatch: pytest.MonkeyPatch) -> None:
    server, handler, port, auth = served
    monkeypatch.setattr(side_channel, "MAX_DEFERRED", 2)
    threads = [threading.Thread(target=ask, args=(port, GetRegistration(1), auth)) for _ in range(2)]
    for t in threads:
        t.start()
    while len(handler.later) < 2:
        time.sleep(0.01)
    said, took = ask(port, GetRegistration(1), auth)
    assert "2 requests already waiting" in said and took < 0.5 and server.dropped["deferred_full"] == 1
    for future in handler.later[:2]:
        future.set_result(ErrorReply("later"))
    for t in threads:
        t.join(5)
