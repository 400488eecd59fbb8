"""The proxy's ASGI front: the two completion routes on bare ASGI, everything else (``/health``, ``/v1/models``,
the lifespan) handed to FastAPI.

Every client request takes a completion route, and on cores the engines keep busy the proxy's CPU per request is
latency: Starlette's request object and its streaming response (an anyio task group per stream) cost about 1 ms
per request (docs/performance.md section 16), so these routes read the body, hand it to
:meth:`PDProxy.handle <vllm_kvp2p.proxy.app.PDProxy.handle>` and send what it returns straight on ASGI. A stream
is relayed while a second task waits for the client to go away: then the relay stops at once and
:attr:`Relay.close <vllm_kvp2p.proxy.upstream.Relay.close>` drops D's connection (vLLM aborts the request) and
releases the decode slot, as it does however else the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm_kvp2p.proxy.upstream import Answer, ProxyError, Relay

if TYPE_CHECKING:
    from vllm_kvp2p.proxy.app import PDProxy

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

#: The largest request body the proxy reads (a 2,000,000-character prompt is ~2 MB); a larger one gets a 413.
MAX_REQUEST_BYTES = 64 * 1024 * 1024


class ClientGone(Exception):
    """The client disconnected before its request body was read."""


class ProxyASGI:
    """The app uvicorn serves: completion requests to :class:`PDProxy`, the rest to ``fallback`` (FastAPI)."""

    def __init__(self, proxy: PDProxy, fallback: ASGIApp) -> None:
        self.proxy = proxy
        self.fallback = fallback

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in COMPLETION_PATHS:
            if scope["method"] == "POST":
                await self._completion(scope, receive, send)
            else:
                error = ProxyError(405, f"{scope['method']} {scope['path']}: only POST", "invalid_request_error")
                await send_answer(send, replace(error.to_answer(), headers={"Allow": "POST"}))
        else:
            await self.fallback(scope, receive, send)

    async def _completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_body(receive)
        except ClientGone:
            return
        except ProxyError as exc:
            await send_answer(send, exc.to_answer())
            return
        # ASGI header names are lower-case already; the last of repeated ones wins.
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        answer = await self.proxy.handle(body, headers, scope["path"])
        if isinstance(answer, Answer):
            await send_answer(send, answer)
        else:
            await relay(answer, receive, send)


async def read_body(receive: Receive, limit: int = MAX_REQUEST_BYTES) -> bytes:
    """The whole request body; :class:`ClientGone` if the client leaves first, a 413 past ``limit`` bytes."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise ProxyError(413, f"request body over {limit} bytes", "invalid_request_error")
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


def _head(status: int, content_type: str | None, headers: Any, extra: list[tuple[bytes, bytes]]) -> Message:
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    if content_type:
        raw.append((b"content-type", content_type.encode("latin-1")))
    return {"type": "http.response.start", "status": status, "headers": raw + extra}


async def send_answer(send: Send, answer: Answer) -> None:
    """Send a whole answer."""
    length = [(b"content-length", str(len(answer.body)).encode())]
    await send(_head(answer.status, answer.content_type, answer.headers, length))
    await send({"type": "http.response.body", "body": answer.body, "more_body": False})


async def relay(answer: Relay, receive: Receive, send: Send) -> None:
    """Send ``answer``'s head and chunks until they end or the client goes away; then close it, in every case."""

    async def stream() -> None:
        async with contextlib.aclosing(answer.chunks) as chunks:
            await send(_head(answer.status, answer.content_type, answer.headers, []))
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def client_gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    relaying = asyncio.ensure_future(stream())
    watching = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait((relaying, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        try:
            for task in (relaying, watching):
                task.cancel()
            await asyncio.gather(relaying, watching, return_exceptions=True)
        finally:
            answer.close()
    if not relaying.cancelled() and relaying.exception() is not None:
        raise relaying.exception()  # type: ignore[misc]  # a bug of ours: uvicorn logs it
