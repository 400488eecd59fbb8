"""A side-channel handler may answer later (a Future): the server thread meanwhile answers everything else, and
sends the deferred answer, sealed for its own request, once it is set (vllm_kvp2p/contract/side_channel.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest
import zmq

from vllm_kvp2p.contract import protocol, side_channel
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.protocol import ErrorReply, GetRankTable, GetRegistration, Reply, Request
from vllm_kvp2p.contract.side_channel import SideChannelClient, SideChannelError, SideChannelServer
from vllm_kvp2p.testing.server import free_port

SECRET = b"s" * 32


class Handler:
    """GetRegistration(1): answered later, by the test; GetRegistration(2): every copy answered later with one
    Future (what the hold service does for copies of one release); anything else at once."""

    def __init__(self) -> None:
        self.later: list[Future[Reply]] = []
        self.copies: Future[Reply] = Future()
        self.copies_seen = 0

    def __call__(self, message: Request) -> Reply | Future[Reply]:
        if isinstance(message, GetRegistration) and message.tp_rank == 1:
            future: Future[Reply] = Future()
            self.later.append(future)
            return future
        if isinstance(message, GetRegistration) and message.tp_rank == 2:
            self.copies_seen += 1
            return self.copies
        return ErrorReply(f"at once: {type(message).__name__}")


@pytest.fixture(params=[False, True], ids=["plain", "sealed"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[SideChannelServer, Handler, int, Authenticator | None]]:
    auth = Authenticator(SECRET, 30.0) if request.param else None
    handler, port = Handler(), free_port()
    server = SideChannelServer("127.0.0.1", port, handler, setting="test", auth=auth)
    yield server, handler, port, auth
    server.close()


def wait_until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``check`` (the server thread delivers requests to the handler); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the request never reached the handler"
        time.sleep(0.01)


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
    wait_until(lambda: bool(handler.later))
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


def send_copies(port: int, message: Request, copies: int, auth: Authenticator | None) -> zmq.Socket:
    """``copies`` copies of one request on one DEALER socket, without waiting for answers (what a peer that resends
    one release over and over can do); each sealed afresh with the secret, as D's client seals each resend."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    body = protocol.encode(message)
    for _ in range(copies):
        frame = auth.seal_request(body, int(time.time() * 1000))[0] if auth is not None else body
        sock.send_multipart([b"", frame])
    return sock


@pytest.mark.parametrize("shared", [True, False], ids=["copies-share-a-slot", "a-slot-per-copy"])
def test_copies_of_one_request_take_one_slot_so_another_request_is_still_deferred(
        served, monkeypatch: pytest.MonkeyPatch, shared: bool) -> None:
    """A peer sends one deferred request 50 times with room for 2 answers: the copies take one slot, so another
    reader's request still gets its deferred answer, and the newest MAX_COPIES copies get theirs too. The control
    (each copy a slot of its own, as the server kept them before: here each copy its own Future) fills the table,
    and the other reader's request is answered with an error."""
    server, handler, port, auth = served
    monkeypatch.setattr(side_channel, "MAX_DEFERRED", 2)
    if not shared:
        one: Callable[[Request], Reply | Future[Reply]] = server._handler

        def a_future_per_copy(message: Request) -> Reply | Future[Reply]:
            answer = one(message)
            if answer is not handler.copies:
                return answer
            copy: Future[Reply] = Future()
            handler.copies.add_done_callback(lambda f: copy.set_result(f.result()))
            return copy

        monkeypatch.setattr(server, "_handler", a_future_per_copy)
    flood = send_copies(port, GetRegistration(2), 50, auth)
    try:
        deadline = time.monotonic() + 5
        while handler.copies_seen < 50 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handler.copies_seen == 50
        answers: list[tuple[str, float]] = []
        honest = threading.Thread(target=lambda: answers.append(ask(port, GetRegistration(1), auth)))
        honest.start()
        if not shared:
            honest.join(5)
            assert answers and "2 requests already waiting" in answers[0][0], answers
            assert server.dropped["deferred_full"] >= 1
            return
        wait_until(lambda: bool(handler.later))
        handler.later[0].set_result(ErrorReply("later"))
        honest.join(5)
        assert answers and "answered with an error: later" in answers[0][0], answers
        assert server.dropped["deferred_full"] == 0
        handler.copies.set_result(ErrorReply("copies"))
        got = []
        while len(got) < side_channel.MAX_COPIES and flood.poll(2000):
            got.append(flood.recv_multipart()[-1])
        while flood.poll(100):  # and no more
            got.append(flood.recv_multipart()[-1])
        assert len(got) == side_channel.MAX_COPIES  # the newest copies are answered; the older ones forgotten
        assert server.dropped["resent_copy_dropped"] == 50 - side_channel.MAX_COPIES
    finally:
        flood.close()
