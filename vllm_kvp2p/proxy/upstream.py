"""How upstream (P or D) answers and failures become answers to the proxy's client.

Transport failures map to 504 (timed out) or 502 (anything else), naming the instance; upstream 4xx answers are
the client's fault and go back unchanged; streamed answers are relayed by a response that always releases its
decode slot and closes the upstream stream, however the stream ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

# How much of an upstream error body goes into our error message.
ERROR_BODY_SNIPPET = 500


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` -> ``http://host:port`` so paths can be appended verbatim."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("empty instance url")
    if "://" not in url:
        url = "http://" + url
    return url


def error_body(message: str, err_type: str, code: int) -> dict[str, Any]:
    """OpenAI-shaped error (as vLLM sends it), so OpenAI clients surface ``message`` to the user."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": code}}


class ProxyError(Exception):
    """A failure that becomes exactly one HTTP answer to the client."""

    def __init__(self, status: int, message: str, err_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type

    def to_response(self, request_id: str | None = None) -> JSONResponse:
        """The OpenAI-shaped JSON error response."""
        headers = {"X-Request-Id": request_id} if request_id else None
        return JSONResponse(error_body(self.message, self.err_type, self.status), self.status, headers=headers)


class PassThrough(Exception):
    """An upstream 4xx: the client's fault (e.g. prompt too long), so its answer goes back unchanged."""

    def __init__(self, response: Response) -> None:
        super().__init__(f"upstream answered {response.status_code}")
        self.response = response


def passthrough_response(resp: httpx.Response, headers: dict[str, str] | None = None) -> Response:
    """Copy an upstream (fully read) answer: body bytes, status and content type."""
    return Response(
        content=resp.content,
        status_code=resp.status_code,
        media_type=resp.headers.get("content-type"),
        headers=headers,
    )


def describe(exc: BaseException) -> str:
    """``ConnectError: [Errno 111] Connection refused`` - httpx messages can be empty, keep the class name."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def upstream_failure(role: str, url: str, exc: BaseException, timeout_s: float) -> ProxyError:
    """Map a transport failure on ``url`` to a 504 (timed out) or 502 (anything else)."""
    if isinstance(exc, (TimeoutError, httpx.TimeoutException)):
        return ProxyError(
            504,
            f"{role} instance {url} timed out (limit {timeout_s:g}s): {describe(exc)}",
            "upstream_timeout",
        )
    return ProxyError(502, f"{role} instance {url} unreachable: {describe(exc)}", "upstream_unavailable")


def check_status(role: str, url: str, resp: httpx.Response, extra_headers: dict[str, str]) -> None:
    """4xx -> pass through; 5xx and other non-2xx -> 502 naming the instance; 2xx -> nothing."""
    status = resp.status_code
    if 200 <= status < 300:
        return
    if 400 <= status < 500:
        raise PassThrough(passthrough_response(resp, extra_headers))
    snippet = resp.text[:ERROR_BODY_SNIPPET]
    raise ProxyError(502, f"{role} instance {url} failed with HTTP {status}: {snippet}", "upstream_error")


class RelayStreamingResponse(StreamingResponse):
    """StreamingResponse that always runs ``on_close`` and closes the upstream stream when it ends.

    The relay generator's own ``finally`` is not enough: if the client disconnects before the generator starts,
    or while it is suspended at a ``yield``, it is never resumed, so the decode slot would leak.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        upstream: httpx.Response,
        on_close: Callable[[], None],
        status_code: int,
        media_type: str | None,
        headers: dict[str, str],
    ) -> None:
        super().__init__(content, status_code=status_code, media_type=media_type, headers=headers)
        self._upstream = upstream
        self._on_close = on_close
        self._content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._content, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._upstream.aclose()
