"""The proxy's one seam to its HTTP client (aiohttp), and how upstream (P or D) answers and failures become answers
to the proxy's client.

:class:`Upstream` is the only code that touches aiohttp: it sends a request and gives back an :class:`Answer`
(fully read) or an :class:`UpstreamStream` (D's SSE bytes as they come). Everything above it sees
:data:`TRANSPORT_ERRORS` and :func:`went_away`, never aiohttp's classes. Transport failures map to 504 (timed out)
or 502 (anything else), naming the instance; upstream 4xx answers are the client's fault and go back unchanged.

aiohttp rather than httpx: the proxy's own CPU per request is latency on cores the engines keep busy, and httpx
with anyio's per-operation cancel scopes cost 1.1 ms more per request (docs/performance.md section 16).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

logger = logging.getLogger("vllm_kvp2p.proxy")

if sys.version_info >= (3, 11):
    from asyncio import timeout as deadline_after
else:  # aiohttp's own dependency on Python 3.10
    from async_timeout import timeout as deadline_after

# How much of an upstream error body goes into our error message.
ERROR_BODY_SNIPPET = 500

#: Everything a request to an instance can raise besides an HTTP answer: the deadline, or the transport.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (asyncio.TimeoutError, aiohttp.ClientError)


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port`` so paths can be appended verbatim."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("empty instance url")
    if "://" not in url:
        url = "http://" + url
    return url


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI-shaped error (as vLLM sends it), so OpenAI clients surface ``message`` to the user; ``param`` names
    the request field at fault, when one is."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


@dataclass(frozen=True)
class Answer:
    """A whole HTTP answer: an instance's to the proxy, or the proxy's to its client."""

    status: int
    body: bytes
    content_type: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON (raises ``ValueError`` when it is not)."""
        return json.loads(self.body)

    @classmethod
    def of_json(cls, data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Answer:
        return cls(status, json.dumps(data).encode(), "application/json", headers or {})


@dataclass(frozen=True)
class Relay:
    """A streamed answer to the proxy's client: D's head, then ``chunks`` as they come.

    ``close`` releases what the stream holds (the decode slot, D's connection); whoever sends the relay calls it
    exactly once, however the stream ends (it is synchronous, so it runs even in a cancelled task).
    """

    status: int
    content_type: str
    headers: Mapping[str, str]
    chunks: AsyncIterator[bytes]
    close: Callable[[], None]


class ProxyError(Exception):
    """A failure that becomes exactly one HTTP answer to the client."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        #: The request field at fault (OpenAI's ``param``), when one is.
        self.param = param

    def body(self) -> dict[str, Any]:
        """The OpenAI-shaped error body."""
        return error_body(self.message, self.err_type, self.status, self.param)

    def to_answer(self, request_id: str | None = None) -> Answer:
        """The OpenAI-shaped JSON error answer."""
        headers = {"X-Request-Id": request_id} if request_id else None
        return Answer.of_json(self.body(), self.status, headers)


class PrefillLost(ProxyError):
    """P went away before answering (:func:`went_away`): the prefill can be retried."""

    def __init__(self, err: ProxyError, cause: BaseException) -> None:
        super().__init__(err.status, err.message, err.err_type)
        #: The transport error, e.g. ``ClientConnectorError: Cannot connect to host ...``.
        self.cause = describe(cause)


class PassThrough(Exception):
    """An upstream 4xx: the client's fault (e.g. prompt too long), so its answer goes back unchanged."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(f"upstream answered {answer.status}")
        self.answer = answer


#: Client headers worth forwarding upstream (vLLM's --api-key checks Authorization).
FORWARDED_HEADERS: tuple[str, ...] = ("authorization",)


def forwarded_headers(client_headers: Mapping[str, str]) -> dict[str, str]:
    """The client's headers that go upstream as they came (:data:`FORWARDED_HEADERS`)."""
    return {name: v for name in FORWARDED_HEADERS if (v := client_headers.get(name)) is not None}


def describe(exc: BaseException) -> str:
    """``ConnectionRefusedError: [Errno 111] Connect call failed ...``: the class name kept (some messages are
    empty), a failed connect named by its OS error (aiohttp's own text adds nothing but ``ssl:default``)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        exc = exc.os_error
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def went_away(exc: BaseException) -> bool:
    """Did the instance go away before answering (refused, reset, closed without a whole response)?

    Timeouts are not: a slow instance is alive, and a retry elsewhere would give the same work twice.
    """
    if isinstance(exc, asyncio.TimeoutError):
        return False
    return isinstance(exc, (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError))


def upstream_failure(role: str, url: str, exc: BaseException, timeout_s: float) -> ProxyError:
    """Map a transport failure on ``url`` to a 504 (timed out) or 502 (anything else)."""
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's timeouts are too
        return ProxyError(
            504,
            f"{role} instance {url} timed out (limit {timeout_s:g}s): {describe(exc)}",
            "upstream_timeout",
        )
    return ProxyError(502, f"{role} instance {url} unreachable: {describe(exc)}", "upstream_unavailable")


def check_status(role: str, url: str, answer: Answer, extra_headers: Mapping[str, str]) -> None:
    """4xx -> pass through; 5xx and other non-2xx -> 502 naming the instance; 2xx -> nothing."""
    status = answer.status
    if 200 <= status < 300:
        return
    if 400 <= status < 500:
        raise PassThrough(replace(answer, headers=extra_headers))
    snippet = answer.text[:ERROR_BODY_SNIPPET]
    raise ProxyError(502, f"{role} instance {url} failed with HTTP {status}: {snippet}", "upstream_error")


class UpstreamStream:
    """D's streamed answer: status and content type known, the body read as it comes. Close it exactly once."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.content_type: str | None = response.headers.get("Content-Type")

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (raises :data:`TRANSPORT_ERRORS` when the instance fails mid-way)."""
        async for chunk in self._response.content.iter_any():
            yield chunk

    def close(self) -> None:
        """Drop the connection (synchronous in aiohttp: safe in ``finally`` blocks of cancelled tasks)."""
        self._response.close()


class Upstream:
    """The proxy's one pooled HTTP client for its instances (create it inside the running event loop)."""

    def __init__(self, *, read_timeout_s: float, connect_timeout_s: float, max_connections: int | None) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max_connections or 0),
            # sock_read applies per read: it bounds a stalled stream without capping a long healthy one. Each
            # request's own deadline is the caller's (asyncio.timeout).
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s),
            # P/D traffic is cluster-internal: never through an HTTP(S)_PROXY from the environment.
            trust_env=False,
        )

    async def close(self) -> None:
        await self._session.close()

    async def request(
        self, method: str, url: str, timeout_s: float, *, body: Any = None, headers: Mapping[str, str] | None = None
    ) -> Answer:
        """Send ``body`` (as JSON, when given) and read the whole answer within ``timeout_s``."""
        async with deadline_after(timeout_s):
            async with self._session.request(method, url, **_payload(body, headers)) as resp:
                return Answer(resp.status, await resp.read(), resp.headers.get("Content-Type"))

    async def open_stream(
        self, url: str, body: Any, headers: Mapping[str, str], timeout_s: float
    ) -> UpstreamStream | Answer:
        """POST ``body`` and wait (within ``timeout_s``) for the answer's head: a 2xx is returned open, to be read
        as it comes; anything else is read whole and returned as an :class:`Answer`."""
        resp: aiohttp.ClientResponse | None = None
        try:
            async with deadline_after(timeout_s):
                resp = await self._session.post(url, **_payload(body, headers))
                if 200 <= resp.status < 300:
                    return UpstreamStream(resp)
                answer = Answer(resp.status, await resp.read(), resp.headers.get("Content-Type"))
        except BaseException:
            if resp is not None:
                resp.close()
            raise
        resp.release()
        return answer


def _payload(body: Any, headers: Mapping[str, str] | None) -> dict[str, Any]:
    """``body``: None (no body), bytes (sent as they are: a forwarded request's JSON), or a JSON value."""
    if body is None:
        return {"headers": headers}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return {"data": data, "headers": {**(headers or {}), "Content-Type": "application/json"}}


async def relay_events(stream: UpstreamStream, url: str, rid: str, timeout_s: float) -> AsyncIterator[bytes]:
    """Yield D's SSE bytes unchanged; if D fails mid-stream, end with one ``data: {"error": ...}`` event. (The
    stream is closed by the :class:`Relay`'s ``close``, which its sender calls however the relay ends.)"""
    tail = b""
    try:
        async for chunk in stream.chunks():
            if chunk:
                tail = (tail + chunk)[-2:]
                yield chunk
    except Exception as exc:  # noqa: BLE001 - any failure must still end the stream cleanly
        err = upstream_failure("decode", url, exc, timeout_s)
        message = f"stream interrupted: {err.message}"
        logger.warning("request %s: %s", rid, message)
        # Terminate a half-sent event first so the error event parses on its own.
        sep = b"" if not tail or tail.endswith(b"\n\n") else b"\n\n"
        payload = json.dumps(error_body(message, err.err_type, err.status)["error"])
        yield sep + b'data: {"error": ' + payload.encode() + b"}\n\n"
