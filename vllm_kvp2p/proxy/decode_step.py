"""The proxy's decode step: D's answer whole, or its stream relayed and timed (a part of :class:`~vllm_kvp2p.proxy.
app.PDProxy`, which inherits it; the P step and the flow around both are app.py's)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from vllm_kvp2p.proxy.instances import InstancePool, Lease
from vllm_kvp2p.proxy.placement import Placement, Placer, StreamTimes
from vllm_kvp2p.proxy.upstream import (
    TRANSPORT_ERRORS,
    Answer,
    ProxyError,
    Relay,
    Upstream,
    UpstreamStream,
    check_status,
    relay_events,
    upstream_failure,
)

#: Transport failures that mark an instance unreachable for a while (health.py): not HTTP answers.
UNREACHABLE_ERROR_TYPES = ("upstream_timeout", "upstream_unavailable")


class DecodeStep:
    """D's half of a request, and how an upstream's failure is told to its pool."""

    decode: InstancePool
    timeout_s: float
    placer: Placer

    @property
    def client(self) -> Upstream:
        raise NotImplementedError

    def _remaining(self, deadline: float) -> float:
        return max(0.0, deadline - time.monotonic())

    @staticmethod
    def _outcome(pool: InstancePool, url: str, exc: ProxyError) -> None:
        """A transport failure skips the instance for a while; an HTTP answer shows it alive."""
        if exc.err_type in UNREACHABLE_ERROR_TYPES:
            pool.unreachable(url, getattr(exc, "cause", exc.message))
        else:
            pool.answered(url)

    async def _decode_json(
        self,
        url: str,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        deadline: float,
        info_headers: dict[str, str],
    ) -> Answer:
        """Non-streaming decode: D's JSON (``kv_transfer_params`` and all) with D's status."""
        try:
            resp = await self.client.request("POST", url + path, self._remaining(deadline), body=body, headers=headers)
        except TRANSPORT_ERRORS as exc:
            err = upstream_failure("decode", url, exc, self.timeout_s)
            self._outcome(self.decode, url, err)
            raise err from exc
        self.decode.answered(url)
        check_status("decode", url, resp, info_headers)
        return Answer(resp.status, resp.body, resp.content_type, info_headers)

    async def _decode_stream(
        self,
        lease: Lease,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        deadline: float,
        info_headers: dict[str, str],
        rid: str,
        on_close: Callable[[], None],
        times: tuple[Placement, StreamTimes],
    ) -> Answer | Relay:
        """Streaming decode: wait (bounded) for D's head, then relay its SSE bytes as they come.

        The returned :class:`Relay` owns the decode slot: its ``close`` releases it and calls ``on_close``, however
        the stream ends; ``times`` notes when its events come (the placement's observations).
        """
        url = lease.url
        try:
            opened = await self.client.open_stream(url + path, body, headers, self._remaining(deadline))
        except TRANSPORT_ERRORS as exc:
            err = upstream_failure("decode", url, exc, self.timeout_s)
            self._outcome(self.decode, url, err)
            raise err from exc
        self.decode.answered(url)
        if not isinstance(opened, UpstreamStream):
            check_status("decode", url, opened, info_headers)  # raises: open_stream answers whole only when not 2xx
        stream = opened
        closed = False

        def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                stream.close()
                self.decode.release(lease)
                on_close()

        return Relay(
            stream.status,
            stream.content_type or "text/event-stream",
            {**info_headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            self._timed(relay_events(stream, url, rid, self.timeout_s), *times),
            close,
        )

    async def _timed(self, chunks: AsyncIterator[bytes], placement: Placement, times: StreamTimes
                     ) -> AsyncIterator[bytes]:
        """``chunks`` unchanged, their arrival noted: the first token ends a local prefill (placement.py)."""
        async for chunk in chunks:
            first = times.first_ms is None
            times.saw(chunk, time.monotonic() * 1000.0)
            if first and times.first_ms is not None:
                self.placer.first_token(placement)
            yield chunk
