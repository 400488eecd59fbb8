"""The routes the proxy forwards whole to one decode instance: ``GET /v1/models``, ``POST /tokenize`` and
``POST /detokenize`` (every instance serves the same model and tokenizer, and D is the one the client's tokens
end up on). The request's body and Authorization header go as they are, bounded by the proxy's timeout; the
answer comes back as the instance gave it (a 5xx or a transport failure as the proxy's 502 / 504 naming it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from vllm_kvp2p.proxy.upstream import (
    TRANSPORT_ERRORS,
    Answer,
    PassThrough,
    ProxyError,
    check_status,
    forwarded_headers,
    upstream_failure,
)

if TYPE_CHECKING:
    from vllm_kvp2p.proxy.app import PDProxy

#: Routes forwarded to a decode instance, and their method.
FORWARDED_ROUTES: dict[str, str] = {"/v1/models": "GET", "/tokenize": "POST", "/detokenize": "POST"}


async def forward(proxy: PDProxy, path: str, body: bytes | None, client_headers: Mapping[str, str]) -> Answer:
    """``path`` (one of :data:`FORWARDED_ROUTES`) asked of the least busy decode instance."""
    headers = forwarded_headers(client_headers)
    if (rid := client_headers.get("x-request-id")) is not None:
        headers["X-Request-Id"] = rid
    method = FORWARDED_ROUTES[path]
    with proxy.decode.lease() as lease:
        url = lease.url
        try:
            resp = await proxy.client.request(method, url + path, proxy.timeout_s,
                                              body=body if method == "POST" else None, headers=headers)
        except TRANSPORT_ERRORS as exc:
            return upstream_failure("decode", url, exc, proxy.timeout_s).to_answer()
    try:
        check_status("decode", url, resp, {})
    except ProxyError as exc:
        return exc.to_answer()
    except PassThrough as exc:
        return exc.answer
    return resp
