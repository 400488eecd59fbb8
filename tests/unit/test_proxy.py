"""The P/D proxy, run for real (uvicorn on 127.0.0.1) against stub OpenAI-style upstreams.

The stubs record what they receive and can be told to fail in the ways real instances fail (down, 5xx, 4xx,
missing kv_transfer_params, hanging, dying mid-stream), which real vLLM cannot be made to do on demand.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_kvp2p.proxy import PREFILL_KV_TRANSFER_PARAMS, InstancePool, PDProxy, create_app
from vllm_kvp2p.proxy.cli import build_parser, parse_events, resolve_instances
from vllm_kvp2p.proxy.instances import Lease
from vllm_kvp2p.testing.tiny_model import write_tokenizer_files

# Generous per-test caps: the bounds that matter are asserted inside the tests; these only stop a hang.
pytestmark = pytest.mark.timeout(30)

CLIENT_TIMEOUT = httpx.Timeout(10.0)


# --------------------------------------------------------------------------------------------------------------
# Harness: uvicorn servers in threads, on sockets bound before start (no free-port race).
# --------------------------------------------------------------------------------------------------------------


class ServerThread:
    """One uvicorn server for ``app`` on 127.0.0.1 in a daemon thread."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="critical", lifespan="on", timeout_graceful_shutdown=1, loop="asyncio")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 15.0
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5.0)
        self.sock.close()


def closed_port_url() -> str:
    """A 127.0.0.1 url nobody listens on: connecting is refused at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class DroppingServer:
    """A raw TCP "P" that reads each HTTP request in full, then hangs up without answering.

    ``mode="close"`` closes cleanly (the client sees the server disconnect without a response), ``mode="reset"``
    aborts with an RST (connection reset), as a P whose process died would. ``attempts`` counts the requests
    (not the proxy's ``/health`` probes nor its ``/metrics`` reads).
    """

    def __init__(self, mode: str, delay_s: float = 0.0) -> None:
        assert mode in ("close", "reset")
        self.mode = mode
        self.delay_s = delay_s
        self.attempts = 0
        self._lock = threading.Lock()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._drop, args=(conn,), daemon=True).start()

    def _drop(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5.0)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, rest = data.partition(b"\r\n\r\n")
            fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
            length = int({k.strip().lower(): v for k, v in fields.items()}.get(b"content-length", b"0"))
            while len(rest) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                rest += chunk
            with self._lock:
                # The proxy's probes of a skipped instance and its reads of the pairing values are not requests.
                if not head.startswith((b"GET /health", b"GET /metrics")):
                    self.attempts += 1
            time.sleep(self.delay_s)
            if self.mode == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5.0)
        self.sock.close()


@pytest.fixture
def dropping() -> Iterator[Callable[..., DroppingServer]]:
    """``dropping(mode, delay_s=0.0) -> DroppingServer``; stopped after the test."""
    started: list[DroppingServer] = []

    def start(mode: str, delay_s: float = 0.0) -> DroppingServer:
        srv = DroppingServer(mode, delay_s)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


# --------------------------------------------------------------------------------------------------------------
# Stub upstream (plays either P or D).
# --------------------------------------------------------------------------------------------------------------


def sse_events(name: str, n: int = 3) -> list[bytes]:
    """What a stub streams: ``n`` OpenAI-ish SSE events then ``[DONE]``."""
    events = [
        f"data: {json.dumps({'id': 'cmpl-x', 'choices': [{'index': 0, 'text': f'{name}-tok{i} '}]})}\n\n".encode()
        for i in range(n)
    ]
    return [*events, b"data: [DONE]\n\n"]


def stub_json_bytes(name: str, body: dict[str, Any], role: str) -> bytes:
    """What a stub answers without streaming; oddly formatted on purpose so re-serialising would show."""
    if role == "P":
        kv: dict[str, Any] | None = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"engine-{name}",
            "remote_block_ids": [[1, 2, 3]],
            "remote_host": "127.0.0.1",
            "remote_port": 17777,
        }
    else:
        kv = {"kvp2p_stats": {"decoded_by": name, "bytes": 4096}}
    n = body.get("n") if type(body.get("n")) is int else 1
    # Each choice echoes the prompt it answers, so merged batch answers show which part each came from.
    choices = [{"index": k, "text": f"{name} answer", "finish_reason": "length", "echo": body.get("prompt")}
               for k in range(n)]
    max_tokens = body.get("max_tokens")
    payload = {
        "id": "cmpl-stub",
        "object": "text_completion",
        "choices": choices,
        "usage": {"prompt_tokens": 5, "total_tokens": 5 + (max_tokens if type(max_tokens) is int else 0) * n,
                  "completion_tokens": max_tokens, "prompt_tokens_details": {"cached_tokens": 1}},
        "kv_transfer_params": kv,
    }
    return json.dumps(payload, indent=1, sort_keys=False).encode()


async def openai_stream(name: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
    """A stream as vLLM sends one prompt's: two chunks per choice (n of them), each choice's usage with
    continuous_usage_stats, a usage-only chunk when include_usage is asked, then [DONE]."""
    n = body.get("n") or 1
    options = body.get("stream_options") or {}
    prompt = body.get("prompt")
    for step in range(2):
        for k in range(n):
            chunk: dict[str, Any] = {"id": f"cmpl-{name}-{prompt}", "object": "text_completion", "created": 7,
                                     "model": "m", "choices": [{"index": k, "text": f"{prompt}/{k}/{step} "}]}
            if options.get("continuous_usage_stats"):
                chunk["usage"] = {"prompt_tokens": 5, "completion_tokens": step + 1, "total_tokens": 6 + step}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            await asyncio.sleep(0.01)
    if options.get("include_usage"):
        usage = {"prompt_tokens": 5, "total_tokens": 5 + 2 * n, "completion_tokens": 2 * n}
        final = {"id": f"cmpl-{name}-{prompt}", "object": "text_completion", "created": 7, "model": "m",
                 "choices": [], "usage": usage}
        yield f"data: {json.dumps(final)}\n\n".encode()
    yield b"data: [DONE]\n\n"


@dataclass
class Stub:
    """Behaviour knobs and a record of received requests for one upstream."""

    name: str
    role: str  # "P" or "D"
    mode: str = "ok"
    delay_s: float = 0.0
    received: list[dict[str, Any]] = field(default_factory=list)
    server: ServerThread | None = None
    #: Streams that ended before their last event (their reader went away).
    streams_cut: int = 0
    #: Requests whose client (the proxy) went away while the stub was still working on them (delay_s, "hang"), as
    #: vLLM aborts a request whose connection closes.
    cancelled: int = 0
    #: A mode per prompt (a request's ``prompt`` as text), over ``mode``: one part of a batch can fail alone.
    by_prompt: dict[str, str] = field(default_factory=dict)
    #: Whether it serves /tokenize and /detokenize (off: the prefix-routing tests need a P without them).
    serves_tokenize: bool = False

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def reset(self) -> None:
        self.mode = "ok"
        self.delay_s = 0.0
        self.received.clear()
        self.streams_cut = 0
        self.cancelled = 0
        self.by_prompt.clear()
        self.serves_tokenize = False


def make_stub_app(stub: Stub) -> FastAPI:
    """An OpenAI-style server whose answers and failures are driven by ``stub``."""
    app = FastAPI()

    async def working(request: Request, seconds: float) -> bool:
        """Sleep ``seconds`` unless the client goes away first (then count it and say so)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                stub.cancelled += 1
                return False
            await asyncio.sleep(0.02)
        return True

    async def generate(request: Request) -> Response:
        body = await request.json()
        stub.received.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
        mode = stub.by_prompt.get(str(body.get("prompt")), stub.mode)
        if mode == "slow":
            mode = "ok"
            if not await working(request, 4.0):
                return Response(status_code=499)
        if stub.delay_s and not await working(request, stub.delay_s):
            return Response(status_code=499)
        if mode == "500":
            return JSONResponse({"error": {"message": "engine dead", "type": "InternalServerError"}}, 500)
        if mode == "400":
            return JSONResponse(
                {"error": {"message": "prompt too long", "type": "BadRequestError", "param": None, "code": 400}}, 400
            )
        if mode == "hang" and not await working(request, 4.0):
            return Response(status_code=499)
        if mode == "no_kv":
            return JSONResponse({"id": "x", "choices": [{"text": "!"}], "kv_transfer_params": None})
        if body.get("stream"):
            if mode == "die_mid_stream":

                async def dying() -> AsyncIterator[bytes]:
                    for ev in sse_events(stub.name)[:2]:
                        yield ev
                        await asyncio.sleep(0.05)
                    raise RuntimeError("decode engine crashed")

                return StreamingResponse(dying(), media_type="text/event-stream")
            if mode == "stall_mid_stream":

                async def stalling() -> AsyncIterator[bytes]:
                    yield sse_events(stub.name)[0]
                    await asyncio.sleep(4.0)
                    yield sse_events(stub.name)[1]

                return StreamingResponse(stalling(), media_type="text/event-stream")
            if mode == "slow_stream":

                async def slow() -> AsyncIterator[bytes]:
                    finished = False
                    try:
                        for ev in sse_events(stub.name, n=100):
                            yield ev
                            await asyncio.sleep(0.05)
                        finished = True
                    finally:
                        stub.streams_cut += not finished

                return StreamingResponse(slow(), media_type="text/event-stream")

            if mode == "openai_stream":
                return StreamingResponse(openai_stream(stub.name, body), media_type="text/event-stream")

            async def fast() -> AsyncIterator[bytes]:
                for ev in sse_events(stub.name):
                    yield ev
                    await asyncio.sleep(0.01)

            return StreamingResponse(fast(), media_type="text/event-stream")
        return Response(stub_json_bytes(stub.name, body, stub.role), media_type="application/json")

    app.post("/v1/completions")(generate)
    app.post("/v1/chat/completions")(generate)
    app.post("/v1/responses")(generate)  # the same answers: the proxy reads only kv_transfer_params of P's

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    async def tokenize(request: Request) -> Response:
        if not stub.serves_tokenize:
            return JSONResponse({"detail": "Not Found"}, 404)
        body = await request.json()
        stub.received.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
        if request.url.path == "/tokenize":
            return JSONResponse({"tokens": [1, 2, 3], "count": 3, "max_model_len": 64, "by": stub.name})
        return JSONResponse({"prompt": f"text of {body.get('tokens')}", "by": stub.name})

    app.post("/tokenize")(tokenize)
    app.post("/detokenize")(tokenize)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        # As vLLM lists them: its base models (COMPLETION's "m" among them), then each LoRA adapter with its parent.
        return JSONResponse({"object": "list", "data": [
            {"id": f"model-{stub.name}", "object": "model"}, {"id": "m", "object": "model", "parent": None},
            {"id": "m-lora", "object": "model", "parent": "m"}]})

    return app


@pytest.fixture(scope="module")
def stubs() -> Iterator[dict[str, Stub]]:
    """Two prefill and two decode stubs, shared by the module (reset before each test)."""
    all_stubs = {n: Stub(n, n[0]) for n in ("P0", "P1", "D0", "D1")}
    for s in all_stubs.values():
        s.server = ServerThread(make_stub_app(s)).start()
    yield all_stubs
    for s in all_stubs.values():
        assert s.server is not None
        s.server.stop()


@pytest.fixture(autouse=True)
def _reset_stubs(request: pytest.FixtureRequest) -> None:
    if "stubs" in request.fixturenames:
        for s in request.getfixturevalue("stubs").values():
            s.reset()


@pytest.fixture
def make_proxy() -> Iterator[Callable[..., str]]:
    """``make_proxy(prefill_urls, decode_urls, timeout_s=...) -> proxy url``; stopped after the test."""
    started: list[ServerThread] = []

    def start(prefill: list[str], decode: list[str], **kwargs: Any) -> str:
        kwargs.setdefault("timeout_s", 5.0)
        kwargs.setdefault("connect_timeout_s", 2.0)
        srv = ServerThread(create_app(prefill, decode, **kwargs)).start()
        started.append(srv)
        return srv.url

    yield start
    for srv in started:
        srv.stop()


def one_pd(stubs: dict[str, Stub], make_proxy: Callable[..., str], **kwargs: Any) -> str:
    return make_proxy([stubs["P0"].url], [stubs["D0"].url], **kwargs)


COMPLETION = {
    "model": "m",
    "prompt": "hello there",
    "max_tokens": 17,
    "min_tokens": 3,
    "temperature": 0.0,
}


def assert_openai_error(resp: httpx.Response, status: int, *needles: str) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    assert err["code"] == status
    for needle in needles:
        assert needle in err["message"], err["message"]
    return str(err["message"])


# --------------------------------------------------------------------------------------------------------------
# Pure parts.
# --------------------------------------------------------------------------------------------------------------


class LeastOutstanding:
    """The pool under ``least-outstanding`` routing, spoken to in urls (the tests below predate leases)."""

    def __init__(self, urls: list[str]) -> None:
        self.pool = InstancePool(urls)
        self.leases: dict[str, list] = {}

    def acquire(self, exclude: str | None = None) -> str:
        lease = self.pool.acquire(exclude=exclude)
        self.leases.setdefault(lease.url, []).append(lease)
        return lease.url

    def release(self, url: str) -> None:
        self.pool.release(self.leases[url].pop() if self.leases.get(url) else Lease(url, 0, 0))

    def outstanding(self, url: str) -> int:
        return self.pool.outstanding(url)

    def snapshot(self) -> list[dict]:
        return self.pool.snapshot()


def test_balancer_ties_round_robin() -> None:
    b = LeastOutstanding(["a", "b", "c"])
    picks = []
    for _ in range(6):
        u = b.acquire()
        picks.append(u)
        b.release(u)
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_balancer_least_outstanding() -> None:
    b = LeastOutstanding(["a", "b"])
    assert b.acquire() == "a"
    assert b.acquire() == "b"
    assert b.acquire() == "a"  # tie 1/1 -> round robin
    # a=2, b=1; make a idle: least outstanding beats the round-robin cursor.
    b.release("a")
    b.release("a")
    assert b.outstanding("a") == 0
    assert b.acquire() == "a"  # a=0 < b=1 wins although the round-robin cursor points at b
    assert [e["outstanding"] for e in b.snapshot()] == [1, 1]
    assert [e["served"] for e in b.snapshot()] == [3, 1]


def test_balancer_release_paths() -> None:
    b = LeastOutstanding(["a"])
    with pytest.raises(RuntimeError), b.pool.lease() as lease:
        assert b.outstanding(lease.url) == 1
        raise RuntimeError("boom")
    assert b.outstanding("a") == 0
    b.release("a")  # extra release cannot go negative
    assert b.outstanding("a") == 0
    with pytest.raises(ValueError):
        InstancePool([])
    with pytest.raises(ValueError):
        InstancePool(["a", "a"])


def test_balancer_exclude() -> None:
    b = LeastOutstanding(["a", "b", "c"])
    assert b.acquire(exclude="a") == "b"  # a would be next in round robin
    assert b.acquire(exclude="c") == "a"  # least outstanding among a and b (0 vs 1)
    # a=1, b=1, c=0: c is the least loaded, but excluded -> tie a/b broken round robin from the cursor (b).
    assert b.acquire(exclude="c") == "b"
    assert [e["outstanding"] for e in b.snapshot()] == [1, 2, 0]
    assert [e["served"] for e in b.snapshot()] == [1, 2, 0]
    for u in ("a", "b", "b"):
        b.release(u)
    # Idle again: the excluded url is skipped, the rest keeps the plain round-robin order.
    picks = []
    for _ in range(4):
        u = b.acquire(exclude="b")
        picks.append(u)
        b.release(u)
    assert picks == ["c", "a", "c", "a"]
    assert b.acquire() == "b"  # without exclude, b is back in the rotation
    b.release("b")
    # A single instance is returned even when excluded (a retry then goes to the same one).
    single = LeastOutstanding(["only"])
    assert single.acquire(exclude="only") == "only"
    assert single.outstanding("only") == 1
    with pytest.raises(KeyError):
        b.acquire(exclude="nope")
    assert [e["outstanding"] for e in b.snapshot()] == [0, 0, 0]


def test_prefill_body() -> None:
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}, "min_completion_tokens": 2}
    p = PDProxy.prefill_body(body, chat=False)
    assert p["max_tokens"] == 1 and p["stream"] is False
    assert not {"stream_options", "min_tokens", "min_completion_tokens"} & set(p)
    assert "max_completion_tokens" not in p
    assert p["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert body["max_tokens"] == 17 and body["stream"] is True  # original untouched
    chat = PDProxy.prefill_body({"messages": [], "max_completion_tokens": 50}, chat=True)
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1


def test_cli_parsing() -> None:
    parser = build_parser()
    args = parser.parse_args(
        [
            "--prefill",
            "http://p0:1",
            "--prefill",
            "p1:2",
            "--decoder-hosts",
            "d",
            "--decoder-ports",
            "3",
            "4",
            "--timeout",
            "7",
            "--port",
            "9000",
        ]
    )
    prefill, decode = resolve_instances(args, parser)
    assert prefill == ["http://p0:1", "p1:2"]
    assert decode == ["http://d:3", "http://d:4"]
    assert args.timeout == 7.0 and args.port == 9000 and args.host == "127.0.0.1"
    toy = parser.parse_args(
        ["--prefiller-hosts", "a", "b", "--prefiller-ports", "1", "2", "--decoder-host", "::1", "--decoder-port", "5"]
    )
    assert resolve_instances(toy, parser) == (["http://a:1", "http://b:2"], ["http://[::1]:5"])
    for bad in (
        ["--decode", "d:1"],
        ["--prefill", "p:1"],
        ["--prefill", "p:1", "--decoder-hosts", "a", "b", "c", "--decoder-ports", "1", "2"],
    ):
        with pytest.raises(SystemExit):
            resolve_instances(parser.parse_args(bad), parser)


def test_cli_routing_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["--prefill", "p:1", "p:2", "--decode", "d:1",
                              "--prefill-kv-events", "tcp://p:5557,tcp://p:5558", "none",
                              "--decode-kv-events", "tcp://d:5557", "--hash-seed", "0"])
    assert args.routing == "prefix-aware" and args.hash_algo == "sha256" and args.hash_seed == "0"
    assert parse_events(parser, "--prefill-kv-events", args.prefill_kv_events, 2) == [
        ("tcp://p:5557", "tcp://p:5558"), None]
    assert parse_events(parser, "--decode-kv-events", args.decode_kv_events, 1) == [("tcp://d:5557", None)]
    assert parse_events(parser, "--decode-kv-events", [], 1) is None
    for values, count, needle in ((["tcp://p:1"], 2, "1 endpoints for 2 instances"),
                                  (["http://p:1"], 1, "no ZMQ endpoint")):
        with pytest.raises(SystemExit):
            parse_events(parser, "--prefill-kv-events", values, count)
        assert needle in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill", "p:1", "--decode", "d:1", "--routing", "random"])


# --------------------------------------------------------------------------------------------------------------
# End to end through uvicorn.
# --------------------------------------------------------------------------------------------------------------


def test_completions_non_stream(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    r = httpx.post(
        url + "/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer k"}, timeout=CLIENT_TIMEOUT
    )
    assert r.status_code == 200, r.text
    (p_req,) = stubs["P0"].received
    (d_req,) = stubs["D0"].received
    pb, db = p_req["body"], d_req["body"]
    # P: one token, not streamed, do_remote_decode, min_tokens dropped.
    assert pb["max_tokens"] == 1 and pb["stream"] is False and "min_tokens" not in pb
    assert pb["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    # D: the original request plus exactly P's returned params.
    p_kv = json.loads(stub_json_bytes("P0", pb, "P"))["kv_transfer_params"]
    assert db == {**COMPLETION, "kv_transfer_params": p_kv}
    # Same request id on both, Authorization forwarded.
    rid = p_req["headers"]["x-request-id"]
    assert rid and d_req["headers"]["x-request-id"] == rid and r.headers["x-request-id"] == rid
    assert p_req["headers"]["authorization"] == d_req["headers"]["authorization"] == "Bearer k"
    # Body byte for byte (D's kv_transfer_params stats kept).
    assert r.content == stub_json_bytes("D0", db, "D")
    assert r.json()["kv_transfer_params"] == {"kvp2p_stats": {"decoded_by": "D0", "bytes": 4096}}
    assert r.headers["x-kvp2p-prefill-instance"] == stubs["P0"].url
    assert r.headers["x-kvp2p-decode-instance"] == stubs["D0"].url
    assert float(r.headers["x-kvp2p-route-ms"]) >= 0  # reading the prompt before routing


def test_completions_stream_passthrough(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT, headers={"X-Request-Id": "client-rid-1"}
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        got = b"".join(r.iter_bytes())
    assert got == b"".join(sse_events("D0"))
    pb = stubs["P0"].received[0]["body"]
    assert pb["stream"] is False and "stream_options" not in pb and pb["max_tokens"] == 1
    d_req = stubs["D0"].received[0]
    assert d_req["body"]["stream"] is True and d_req["body"]["stream_options"] == {"include_usage": True}
    assert d_req["body"]["max_tokens"] == 17
    assert d_req["body"]["kv_transfer_params"]["remote_engine_id"] == "engine-P0"
    assert stubs["P0"].received[0]["headers"]["x-request-id"] == "client-rid-1"
    assert d_req["headers"]["x-request-id"] == "client-rid-1"


def test_chat_completions(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 40, "min_tokens": 2}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    p_req, d_req = stubs["P0"].received[0], stubs["D0"].received[0]
    assert p_req["path"] == d_req["path"] == "/v1/chat/completions"
    assert p_req["body"]["max_completion_tokens"] == 1 and p_req["body"]["max_tokens"] == 1
    assert "min_tokens" not in p_req["body"]
    assert d_req["body"]["max_completion_tokens"] == 40 and d_req["body"]["min_tokens"] == 2
    assert "max_tokens" not in d_req["body"]
    # Streamed chat too.
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=CLIENT_TIMEOUT) as s:
        assert b"".join(s.iter_bytes()) == b"".join(sse_events("D0"))


def test_concurrent_requests_spread_over_instances(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = make_proxy([stubs["P0"].url, stubs["P1"].url], [stubs["D0"].url, stubs["D1"].url])
    for s in stubs.values():
        s.delay_s = 0.3  # keep requests outstanding so concurrent ones see each other's load
    results: list[int] = []

    def one() -> None:
        results.append(httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT).status_code)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert results == [200] * 4
    counts = [len(stubs[n].received) for n in ("P0", "P1", "D0", "D1")]
    assert counts[0] + counts[1] == 4 and counts[2] + counts[3] == 4
    assert all(c >= 1 for c in counts), counts  # exactly 2/2 unless the box is very loaded
    health = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT).json()
    assert [e["outstanding"] for e in health["prefill"] + health["decode"]] == [0, 0, 0, 0]
    assert [e["served"] for e in health["prefill"] + health["decode"]] == counts


def test_least_outstanding_beats_round_robin(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    """While D0 is busy with a stream, new requests all go to idle D1 (round robin would alternate)."""
    url = make_proxy([stubs["P0"].url], [stubs["D0"].url, stubs["D1"].url])
    stubs["D0"].mode = "slow_stream"
    stream_body = {**COMPLETION, "stream": True}
    with (
        httpx.Client(timeout=CLIENT_TIMEOUT) as client,
        client.stream("POST", url + "/v1/completions", json=stream_body) as r,
    ):
        chunks = r.iter_bytes()  # keep a reference: a collected iterator closes the response
        assert next(chunks).startswith(b"data: ")
        assert r.headers["x-kvp2p-decode-instance"] == stubs["D0"].url
        for _ in range(3):
            resp = client.post(url + "/v1/completions", json=COMPLETION)
            assert resp.headers["x-kvp2p-decode-instance"] == stubs["D1"].url
    assert len(stubs["D0"].received) == 1 and len(stubs["D1"].received) == 3


def test_prefill_down_is_502_fast(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    dead = closed_port_url()
    url = make_proxy([dead], [stubs["D0"].url])
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    assert time.monotonic() - t0 < 3.0
    assert_openai_error(r, 502, "prefill", dead)
    assert stubs["D0"].received == []
    health = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT).json()
    assert health["prefill"][0]["outstanding"] == 0


def test_prefill_500_is_502(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    stubs["P0"].mode = "500"
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 502, "prefill", stubs["P0"].url, "500", "engine dead")
    assert stubs["D0"].received == []


def test_prefill_without_kv_params_is_502(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    stubs["P0"].mode = "no_kv"
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 502, "kv_transfer_params", "kv_producer", stubs["P0"].url)
    assert stubs["D0"].received == []


def test_prefill_400_passes_through(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    stubs["P0"].mode = "400"
    for stream in (False, True):
        r = httpx.post(url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "prompt too long"
    assert stubs["D0"].received == []


def test_decode_errors(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    for stream in (False, True):
        stubs["D0"].mode = "500"
        r = httpx.post(url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=CLIENT_TIMEOUT)
        assert_openai_error(r, 502, "decode", stubs["D0"].url, "500")
        stubs["D0"].mode = "400"
        r = httpx.post(url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["message"] == "prompt too long"
    dead = closed_port_url()
    url2 = make_proxy([stubs["P0"].url], [dead])
    r = httpx.post(url2 + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 502, "decode", dead)
    health = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT).json()
    assert health["decode"][0]["outstanding"] == 0


def test_decode_hang_is_504_within_timeout(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy, timeout_s=0.5)
    stubs["D0"].mode = "hang"
    for stream in (False, True):
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=CLIENT_TIMEOUT)
        elapsed = time.monotonic() - t0
        assert elapsed < 3.0, elapsed
        assert_openai_error(r, 504, "decode", stubs["D0"].url, "timed out")
    # Silence within a stream is bounded too: the stream ends with a timeout error event.
    stubs["D0"].mode = "stall_mid_stream"
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=CLIENT_TIMEOUT)
    assert time.monotonic() - t0 < 3.0
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events[0] == sse_events("D0")[0].rstrip(b"\n") and len(events) == 2
    err = json.loads(events[1][len(b"data: ") :])["error"]
    assert err["code"] == 504 and "timed out" in err["message"]
    health = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT).json()
    assert health["decode"][0]["outstanding"] == 0


def test_decode_dies_mid_stream(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    stubs["D0"].mode = "die_mid_stream"
    with httpx.stream(
        "POST", url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=CLIENT_TIMEOUT
    ) as r:
        assert r.status_code == 200
        got = b"".join(r.iter_bytes())
    events = [e for e in got.split(b"\n\n") if e]
    assert events[:2] == [e.rstrip(b"\n") for e in sse_events("D0")[:2]]
    assert len(events) == 3
    assert events[2].startswith(b"data: ")
    err = json.loads(events[2][len(b"data: ") :])["error"]
    assert "decode" in err["message"] and stubs["D0"].url in err["message"]
    assert err["code"] == 502
    health = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT).json()
    assert health["decode"][0]["outstanding"] == 0


def test_client_disconnect_releases_decode_slot(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    stubs["D0"].mode = "slow_stream"  # ~5 s of events: the client leaves long before the end
    stream_body = {**COMPLETION, "stream": True}
    with (
        httpx.Client(timeout=CLIENT_TIMEOUT) as client,
        client.stream("POST", url + "/v1/completions", json=stream_body) as r,
    ):
        chunks = r.iter_bytes()  # keep a reference: a collected iterator closes the response
        assert next(chunks).startswith(b"data: ")
        health = client.get(url + "/health").json()
        assert health["decode"][0]["outstanding"] == 1, health
    # At once, not when D's ~5 s stream ends: the proxy drops D's connection (vLLM then aborts the request).
    deadline = time.monotonic() + 2.0
    while True:
        health = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT).json()
        if health["decode"][0]["outstanding"] == 0 and stubs["D0"].streams_cut == 1:
            break
        assert time.monotonic() < deadline, (health, stubs["D0"].streams_cut)
        time.sleep(0.05)


def test_health_and_models(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = make_proxy([stubs["P0"].url, stubs["P1"].url], [stubs["D0"].url])
    h = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT)
    assert h.status_code == 200
    body = h.json()
    assert body["status"] == "ok"
    assert [e["url"] for e in body["prefill"]] == [stubs["P0"].url, stubs["P1"].url]
    assert body["decode"] == [{"url": stubs["D0"].url, "outstanding": 0, "pending_tokens": 0, "served": 0,
                               "prefix_hits": 0, "hit_tokens": 0, "queued_prefill_tokens": 0, "queued_prefills": 0,
                               "decodes": 0, "pairing": None, "state": "up", "failures": 0}]
    assert body["routing"] == {"policy": "prefix-aware", "prefix_weight": 1.0, "kv_events": False,
                               "index_blocks": 0, "tokenize_failures": 0, "tokenized_locally": 0,
                               "tokenized_by_p": 0, "tokenizer": None}
    probed = httpx.get(url + "/health", params={"probe": "true"}, timeout=CLIENT_TIMEOUT).json()
    assert all(e["healthy"] for e in probed["prefill"] + probed["decode"])
    m = httpx.get(url + "/v1/models", timeout=CLIENT_TIMEOUT)
    assert m.status_code == 200 and m.json()["data"][0]["id"] == "model-D0"
    # A role with no live instance -> 503 when probing, with the error per instance.
    dead = closed_port_url()
    url2 = make_proxy([dead], [stubs["D0"].url])
    h2 = httpx.get(url2 + "/health", params={"probe": "true"}, timeout=CLIENT_TIMEOUT)
    assert h2.status_code == 503
    assert h2.json()["prefill"][0]["healthy"] is False and "ConnectionRefusedError" in h2.json()["prefill"][0]["error"]
    assert httpx.get(url2 + "/health", timeout=CLIENT_TIMEOUT).status_code == 200  # no probe: just counts


def test_bad_request_body(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    r = httpx.post(url + "/v1/completions", content=b"{not json", timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 400, "not valid JSON")
    r = httpx.post(url + "/v1/completions", json=[1, 2], timeout=CLIENT_TIMEOUT)
    assert_openai_error(r, 400, "JSON object")
    assert stubs["P0"].received == []


@pytest.mark.timeout(45)
def test_console_script_serves_and_imports_light(stubs: dict[str, Stub]) -> None:
    """The ``vllm-kvp2p-proxy`` entry point serves end to end, in a process that never imported vllm or torch."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import sys\n"
        "import vllm_kvp2p.proxy\n"
        "from vllm_kvp2p.proxy.cli import main\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')]\n"
        "if bad: sys.exit(f'heavy imports: {bad}')\n"
        "main(sys.argv[1:])\n"
    )
    p_host, p_port = stubs["P0"].url.removeprefix("http://").split(":")
    cmd = [
        sys.executable,
        "-c",
        code,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--prefiller-hosts",
        p_host,
        "--prefiller-ports",
        p_port,
        "--decode",
        stubs["D1"].url,
        "--timeout",
        "5",
    ]
    repo_root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(cmd, cwd=repo_root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20.0
        while True:
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
            assert time.monotonic() < deadline, "proxy did not come up"
            time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "D1 answer"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


# --------------------------------------------------------------------------------------------------------------
# Prefill retry: once, on another P, only when P went away before answering.
# --------------------------------------------------------------------------------------------------------------


def proxy_health(url: str) -> dict[str, Any]:
    resp = httpx.get(url + "/health", timeout=CLIENT_TIMEOUT)
    assert resp.status_code == 200
    return dict(resp.json())


def retry_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "vllm_kvp2p.proxy" and r.levelno == logging.WARNING and "retrying once" in r.getMessage()
    ]


@pytest.mark.parametrize(
    ("failure", "error_name"),
    [("refused", "ConnectionRefusedError"), ("close", "ServerDisconnectedError"), ("reset", "Connection reset")],
)
def test_prefill_retried_on_other_instance_when_p_gone(
    stubs: dict[str, Stub],
    make_proxy: Callable[..., str],
    dropping: Callable[..., DroppingServer],
    caplog: pytest.LogCaptureFixture,
    failure: str,
    error_name: str,
) -> None:
    dead_srv = None if failure == "refused" else dropping(failure)
    dead = closed_port_url() if dead_srv is None else dead_srv.url
    # The dead P is first: a fresh balancer picks it first, so every request below needs the retry.
    url = make_proxy([dead, stubs["P1"].url], [stubs["D0"].url])
    caplog.set_level(logging.WARNING, logger="vllm_kvp2p.proxy")
    for i, stream in enumerate((False, True)):
        rid = f"retry-{failure}-{i}"
        r = httpx.post(
            url + "/v1/completions",
            json={**COMPLETION, "stream": stream},
            headers={"X-Request-Id": rid},
            timeout=CLIENT_TIMEOUT,
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-kvp2p-prefill-instance"] == stubs["P1"].url
        if stream:
            assert r.content == b"".join(sse_events("D0"))
        else:
            assert r.json()["choices"][0]["text"] == "D0 answer"
        warnings = [w for w in retry_warnings(caplog) if rid in w]
        if i == 0:
            (warning,) = warnings
            assert dead in warning and error_name in warning
            assert warning.endswith(f"retrying once on {stubs['P1'].url}")
        else:
            assert warnings == []  # the dead P is skipped after its one failed request: no retry needed
    assert len(stubs["P1"].received) == 2
    assert [d["body"]["kv_transfer_params"]["remote_engine_id"] for d in stubs["D0"].received] == ["engine-P1"] * 2
    if dead_srv is not None:
        assert dead_srv.attempts == 1  # only the first request tried it
    health = proxy_health(url)
    assert health["prefill_retries"] == 1
    assert [e["outstanding"] for e in health["prefill"] + health["decode"]] == [0, 0, 0]
    assert [e["served"] for e in health["prefill"]] == [1, 2]
    assert health["prefill"][0]["state"] == "skipped" and error_name in health["prefill"][0]["last_error"]
    assert health["prefill"][1]["state"] == "up"


def test_prefill_retry_single_dead_p_is_502(
    stubs: dict[str, Stub],
    make_proxy: Callable[..., str],
    dropping: Callable[..., DroppingServer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = dropping("close")
    url = make_proxy([dead.url], [stubs["D0"].url])
    caplog.set_level(logging.WARNING, logger="vllm_kvp2p.proxy")
    r = httpx.post(url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "lone"}, timeout=CLIENT_TIMEOUT)
    message = assert_openai_error(r, 502, "prefill", dead.url, "ServerDisconnectedError", "after a retry; first:")
    assert message.count(dead.url) == 2  # the retry's failure, then the first one
    assert dead.attempts == 2  # tried exactly twice: once, then the one retry on the same (only) P
    (warning,) = retry_warnings(caplog)
    assert "lone" in warning and warning.endswith(f"retrying once on {dead.url}")
    assert stubs["D0"].received == []
    health = proxy_health(url)
    assert health["prefill_retries"] == 1
    (only,) = health["prefill"]
    assert (only["url"], only["outstanding"], only["served"], only["state"]) == (dead.url, 0, 2, "skipped")


@pytest.mark.parametrize("mode", ["500", "400"])
def test_prefill_http_error_not_retried(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """An HTTP answer comes from a live P: no retry, although a healthy P1 would have answered."""
    url = make_proxy([stubs["P0"].url, stubs["P1"].url], [stubs["D0"].url])
    caplog.set_level(logging.WARNING, logger="vllm_kvp2p.proxy")
    stubs["P0"].mode = mode
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    if mode == "500":
        message = assert_openai_error(r, 502, "prefill", stubs["P0"].url, "500")
        assert "retry" not in message
    else:
        assert r.status_code == 400 and r.json()["error"]["message"] == "prompt too long"
    assert len(stubs["P0"].received) == 1 and stubs["P1"].received == [] and stubs["D0"].received == []
    assert retry_warnings(caplog) == []
    health = proxy_health(url)
    assert health["prefill_retries"] == 0
    assert [e["outstanding"] for e in health["prefill"]] == [0, 0]


def test_prefill_timeout_not_retried(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    """A slow P is not given up on for another: that would double the load exactly when P is overloaded."""
    url = make_proxy([stubs["P0"].url, stubs["P1"].url], [stubs["D0"].url], timeout_s=0.5)
    caplog.set_level(logging.WARNING, logger="vllm_kvp2p.proxy")
    stubs["P0"].mode = "hang"
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    assert time.monotonic() - t0 < 3.0
    message = assert_openai_error(r, 504, "prefill", stubs["P0"].url, "timed out")
    assert "retry" not in message
    assert len(stubs["P0"].received) == 1 and stubs["P1"].received == []
    assert retry_warnings(caplog) == []
    health = proxy_health(url)
    assert health["prefill_retries"] == 0
    assert [e["outstanding"] for e in health["prefill"]] == [0, 0]


def test_prefill_retry_shares_the_deadline(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], dropping: Callable[..., DroppingServer]
) -> None:
    """The retry gets what is left of the request's deadline: P0 uses half of it, P1 needs more than the rest."""
    dead = dropping("close", delay_s=0.5)
    url = make_proxy([dead.url, stubs["P1"].url], [stubs["D0"].url], timeout_s=1.0)
    stubs["P1"].delay_s = 0.8  # within a fresh 1 s deadline, not within the ~0.5 s left of the first one
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    elapsed = time.monotonic() - t0
    assert_openai_error(r, 504, "prefill", stubs["P1"].url, "timed out", "after a retry; first:", dead.url)
    assert elapsed < 1.3 + 0.5, elapsed  # ~1 s, the one deadline (a fresh one would answer 200 after ~1.3 s)
    assert dead.attempts == 1 and len(stubs["P1"].received) == 1 and stubs["D0"].received == []
    health = proxy_health(url)
    assert health["prefill_retries"] == 1
    assert [e["outstanding"] for e in health["prefill"]] == [0, 0]


def test_prefill_retry_skips_failed_p_even_when_least_loaded(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], dropping: Callable[..., DroppingServer]
) -> None:
    """While P1 is busy, the dead P0 is the least loaded: the retry must still go to P1, not back to P0."""
    dead = dropping("close")
    url = make_proxy([dead.url, stubs["P1"].url], [stubs["D0"].url])
    stubs["P1"].delay_s = 1.0
    results: list[httpx.Response] = []
    first = threading.Thread(
        target=lambda: results.append(httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT))
    )
    first.start()
    deadline = time.monotonic() + 5.0
    while not stubs["P1"].received:  # the first request, retried onto P1, is now outstanding there
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert proxy_health(url)["prefill"][1]["outstanding"] == 1
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    first.join(timeout=10.0)
    assert [x.status_code for x in (*results, r)] == [200, 200], r.text
    assert r.headers["x-kvp2p-prefill-instance"] == stubs["P1"].url
    assert dead.attempts == 1 and len(stubs["P1"].received) == 2  # skipped after its one failure
    health = proxy_health(url)
    assert health["prefill_retries"] == 1
    assert [e["outstanding"] for e in health["prefill"] + health["decode"]] == [0, 0, 0]


def test_prompts_without_tokens_are_routed_by_load_and_answered(
    stubs: dict[str, Stub], make_proxy: Callable[..., str]
) -> None:
    """Prefix-aware routing with KV events configured: a text prompt whose /tokenize fails (these stubs have none)
    is still answered, routed by load, and counted; a token-id prompt needs no /tokenize at all."""
    nowhere = [("tcp://127.0.0.1:9", None)]  # ZMQ connects lazily: nothing listens, nothing arrives
    url = make_proxy([stubs["P0"].url], [stubs["D0"].url], prefill_events=nowhere, decode_events=nowhere,
                     cache_headers=True)
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200 and r.headers["x-kvp2p-prefill-cached-tokens"] == "0"
    routing = proxy_health(url)["routing"]
    assert routing["kv_events"] is True and routing["tokenize_failures"] == 1
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "prompt": list(range(70))}, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200
    health = proxy_health(url)
    assert health["routing"]["tokenize_failures"] == 1
    assert health["prefill"][0]["pending_tokens"] == 0 and health["prefill"][0]["cache"]["hashes_match"] is None
    # Settings that could never match the engines' hashes refuse to build the proxy.
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        create_app([stubs["P0"].url], [stubs["D0"].url], prefill_events=nowhere, hash_algo="xxhash")


def test_a_local_tokenizer_spares_the_tokenize_round_trip(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], tmp_path: Path
) -> None:
    """With ``tokenizer``, a text completion prompt is tokenized in the proxy (these stubs have no /tokenize, so a
    round trip would count a failure); a chat request still asks a P (the engine's template decides its tokens)."""
    write_tokenizer_files(tmp_path, vocab=512, max_pos=1024)
    nowhere = [("tcp://127.0.0.1:9", None)]
    url = make_proxy([stubs["P0"].url], [stubs["D0"].url], prefill_events=nowhere, decode_events=nowhere,
                     tokenizer=str(tmp_path))
    assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT).status_code == 200
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=CLIENT_TIMEOUT).status_code == 200
    routing = proxy_health(url)["routing"]
    assert routing["tokenizer"] == str(tmp_path)
    assert (routing["tokenized_locally"], routing["tokenized_by_p"], routing["tokenize_failures"]) == (1, 0, 1)
    # Without KV events prompts are not hashed, so the tokenizer is not even loaded.
    plain = make_proxy([stubs["P0"].url], [stubs["D0"].url], tokenizer=str(tmp_path / "missing"))
    assert proxy_health(plain)["routing"]["tokenizer"] is None


@pytest.mark.parametrize(
    ("prompt", "status"),
    [(list(range(300_000)), 200), ([2**62, 0], 200), ("ünïcødé ✓ " * 2000, 200), ({"a": 1}, 200), (7, 200),
     (None, 200), (list(range(-5, 300_000)), 400), ([2**62, -(2**62)], 400), ([1, True, 2], 400), ([1, "2"], 400)],
    ids=["huge", "extreme-ints", "non-ascii", "dict", "int", "none", "negative", "extreme-negative", "bools",
         "mixed"],
)
def test_absurd_prompts_are_answered_and_routing_stays_bounded(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], prompt: object, status: int
) -> None:
    """Whatever a client puts in ``prompt``, prefix-aware routing either hashes a bounded prefix of a plain int list
    (at most MAX_PROMPT_BLOCKS blocks) or routes by load; the request is passed on and answered. Token-id lists
    vLLM would refuse (negative ids) and ones it would read otherwise than JSON says (bools, strings) are the
    proxy's 400 naming ``prompt``, before any P is asked (validation.py)."""
    from vllm_kvp2p.proxy.prompt_tokens import tokenize_request

    kind = tokenize_request("/v1/completions", {"model": "m", "prompt": prompt})
    assert kind is prompt or isinstance(kind, dict) or kind is None
    assert isinstance(kind, list) == (isinstance(prompt, list) and all(type(t) is int for t in prompt))
    nowhere = [("tcp://127.0.0.1:9", None)]
    url = make_proxy([stubs["P0"].url], [stubs["D0"].url], prefill_events=nowhere, decode_events=nowhere)
    r = httpx.post(url + "/v1/completions", json={**COMPLETION, "prompt": prompt}, timeout=CLIENT_TIMEOUT)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "prompt" and stubs["P0"].received == []
    assert proxy_health(url)["prefill"][0]["pending_tokens"] == 0  # released whatever was counted


def test_oversized_body_is_413_and_never_reaches_p(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    """A body over the proxy's cap (--max-body-bytes, 8 MiB) gets a clear 413 without being read whole or sent
    anywhere (tests/unit/test_proxy_large_bodies.py: the bound's reasons)."""
    from vllm_kvp2p.proxy.validation import DEFAULT_MAX_BODY_BYTES

    url = one_pd(stubs, make_proxy)
    r = httpx.post(url + "/v1/completions", content=b"x" * (DEFAULT_MAX_BODY_BYTES + 1), timeout=CLIENT_TIMEOUT)
    assert r.status_code == 413 and "request body over" in r.json()["error"]["message"]
    assert stubs["P0"].received == [] and stubs["D0"].received == []
    assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=CLIENT_TIMEOUT).status_code == 200


def test_completion_routes_take_only_post(stubs: dict[str, Stub], make_proxy: Callable[..., str]) -> None:
    url = one_pd(stubs, make_proxy)
    r = httpx.get(url + "/v1/completions", timeout=CLIENT_TIMEOUT)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "only POST" in r.json()["error"]["message"]
    assert httpx.get(url + "/v1/nothing", timeout=CLIENT_TIMEOUT).status_code == 404  # the rest: FastAPI's
    assert stubs["P0"].received == []


@pytest.mark.parametrize(
    "value", [b"\xc3\xbcnic\xc3\xb8de-\xff", b"x" * 8000, b"-1", b""], ids=["non-ascii", "huge", "negative", "empty"])
def test_hostile_request_id_and_authorization_headers(
    stubs: dict[str, Stub], make_proxy: Callable[..., str], value: bytes
) -> None:
    """Whatever bytes a client puts in X-Request-Id or Authorization, the request is answered (streamed too)."""
    url = one_pd(stubs, make_proxy)
    headers = {"X-Request-Id": value, "Authorization": value}
    r = httpx.post(url + "/v1/completions", json=COMPLETION, headers=headers, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    with httpx.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True}, headers=headers,
                      timeout=CLIENT_TIMEOUT) as s:
        assert s.status_code == 200 and b"[DONE]" in s.read()
    assert proxy_health(url)["decode"][0]["outstanding"] == 0
