"""The proxy's ASGI front: its routes on bare ASGI (``/health`` and the lifespan handed to FastAPI), and an
OpenAI-shaped error for any other path (:mod:`routes`).

Every client request takes a completion route, and on cores the engines keep busy the proxy's CPU per request is
latency: Starlette's request object and its streaming response (an anyio task group per stream) cost about 1 ms
per request (docs/performance.md section 16), so these routes read the body, hand it to
:meth:`PDProxy.handle <vllm_kvp2p.proxy.app.PDProxy.handle>` and send what it returns straight on ASGI.

A client that goes away is noticed at once, whatever the request is waiting for: while ``handle`` runs (P, then D's
answer or the head of its stream) a second task waits for ``http.disconnect`` and then cancels it, which cancels
the aiohttp request to P or D and closes its connection (vLLM aborts a request whose connection closes: P frees
the prompt, D its slot), and releases the proxy's own counts. A stream is relayed the same way: when the client
leaves the relay stops and :attr:`Relay.close <vllm_kvp2p.proxy.upstream.Relay.close>` drops D's connection and
releases the decode slot, as it does however else the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm_kvp2p.proxy.endpoints import ENDPOINTS
from vllm_kvp2p.proxy.forward import FORWARDED_ROUTES, forward
from vllm_kvp2p.proxy.routes import allowed, not_served
from vllm_kvp2p.proxy.upstream import Answer, ProxyError, Relay

if TYPE_CHECKING:
    from vllm_kvp2p.proxy.app import PDProxy

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected before its request body was read."""


class ProxyASGI:
    """The app uvicorn serves: the disaggregated routes (completion, chat, responses) to :class:`PDProxy`, the
    forwarded ones to one D, the rest to ``fallback`` (FastAPI)."""

    def __init__(self, proxy: PDProxy, fallback: ASGIApp) -> None:
        self.proxy = proxy
        self.fallback = fallback

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.fallback(scope, receive, send)  # the lifespan
            return
        path, method = scope["path"], scope["method"]
        if method not in allowed(path):
            error = not_served(method, path)
            answer = error.to_answer()
            if error.status == 405:
                answer = replace(answer, headers={"Allow": ", ".join(allowed(path))})
            await send_answer(send, answer)
        elif path in ENDPOINTS:
            await self._completion(scope, receive, send)
        elif path in FORWARDED_ROUTES:
            await self._forward(scope, receive, send)
        else:
            await self.fallback(scope, receive, send)  # /health

    async def _completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._serve(scope, receive, send, self.proxy.handle)

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._serve(scope, receive, send, lambda body, headers, path: forward(self.proxy, path, body, headers))

    async def _serve(self, scope: Scope, receive: Receive, send: Send,
                     handler: Callable[[bytes, dict[str, str], str], Awaitable[Answer | Relay]]) -> None:
        """Read the body (at most ``--max-body-bytes``), run ``handler`` until it answers or the client leaves (then
        it is cancelled and everything it held is released), send the answer (a stream relayed)."""
        try:
            body = await read_body(receive, self.proxy.limits.max_body_bytes, _content_length(scope))
        except ClientGone:
            return
        except ProxyError as exc:
            await send_answer(send, exc.to_answer())
            return
        answer = await until_disconnect(handler(body, _headers(scope), scope["path"]), receive)
        if answer is None:
            return  # the client left: everything the request held is released already
        if isinstance(answer, Answer):
            await send_answer(send, answer)
        else:
            await relay(answer, receive, send)


def _headers(scope: Scope) -> dict[str, str]:
    # ASGI header names are lower-case already; the last of repeated ones wins.
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


async def until_disconnect(work: Awaitable[Answer | Relay], receive: Receive) -> Answer | Relay | None:
    """``work``'s result, or None if the client disconnects first: then ``work`` is cancelled (and awaited), so the
    upstream request it was waiting on is cancelled and its connection closed. Call it once the body is read (the
    only messages left to receive are disconnects)."""
    working = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((working, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (working, watching):
            task.cancel()
        await asyncio.gather(working, watching, return_exceptions=True)
    if working.cancelled():
        return None
    result = working.result()
    if watching.done() and not watching.cancelled() and isinstance(result, Relay):
        result.close()  # finished together with the disconnect: nobody will read the stream
        return None
    return result


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses such a request itself
    return None


def too_large(limit: int) -> ProxyError:
    """The 413 of a body over ``limit`` bytes, naming the setting."""
    return ProxyError(413, f"request body over {limit} bytes, the proxy's limit (--max-body-bytes; a body costs "
                           "the proxy's event loop time in proportion to its size: docs/api.md)",
                      "invalid_request_error")


async def read_body(receive: Receive, limit: int, declared: int | None = None) -> bytes:
    """The whole request body; :class:`ClientGone` if the client leaves first, a 413 past ``limit`` bytes (at once
    when its Content-Length, ``declared``, says so: nothing of it is read)."""
    if declared is not None and declared > limit:
        raise too_large(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise too_large(limit)
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

    relaying = asyncio.ensure_future(stream())
    watching = asyncio.ensure_future(_disconnected(receive))
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
