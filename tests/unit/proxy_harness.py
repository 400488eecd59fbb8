"""The proxy's test harness: uvicorn servers in threads, stub OpenAI-style upstreams that play P or D, and the
fixtures the proxy's test modules share (tests/unit/test_proxy*.py import them: ``stubs = harness.stubs``).

The stubs record what they receive and can be told to fail in the ways real instances fail (down, 5xx, 4xx,
missing kv_transfer_params, hanging, dying mid-stream), which real vLLM cannot be made to do on demand.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_kvp2p.proxy import create_app

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
