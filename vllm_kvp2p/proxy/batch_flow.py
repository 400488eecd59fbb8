"""Running a batched ``/v1/completions`` request (the I/O half of :mod:`batch`): one P/D flow per prompt, at most
``max_batch_concurrency`` at once, merged into one answer as vLLM gives it.

One part failing fails the request: the client gets one error saying which prompt failed, and every other part is
cancelled at once. Cancelling a part's task cancels its aiohttp request (or closes its D stream), which drops that
upstream connection; vLLM aborts a request whose connection closes, so P frees its hold and D its slot. The same
happens to every part when the whole request is cancelled (the client went away: :mod:`asgi`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from vllm_kvp2p.proxy.batch import (
    BATCH_HEADERS,
    PartError,
    StreamMerger,
    encode_event,
    merge_answers,
    prefixed_error,
    route_of,
    split_body,
    split_events,
)
from vllm_kvp2p.proxy.upstream import ERROR_BODY_SNIPPET, Answer, PassThrough, ProxyError, Relay
from vllm_kvp2p.proxy.validation import Limits, check_n, lax_bool

logger = logging.getLogger("vllm_kvp2p.proxy")

#: One prompt's P/D flow (``PDProxy.run_one``): (body, headers, path, request id) -> D's answer or stream.
RunOne = Callable[[dict[str, Any], dict[str, str], str, str], Awaitable[Answer | Relay]]

# Events of the parts waiting for the client: a slow reader holds the parts back, as it would one D stream.
_QUEUE_EVENTS = 64


class PartFailed(Exception):
    """Part ``idx`` of a batch failed: ``status`` and the OpenAI ``error`` object it would have answered alone."""

    def __init__(self, idx: int, status: int, error: dict[str, Any]) -> None:
        super().__init__(error.get("message"))
        self.idx = idx
        self.status = status
        self.error = prefixed_error(error, idx, status)

    @classmethod
    def of(cls, idx: int, exc: BaseException) -> PartFailed:
        """From what :meth:`PDProxy.run_one` raised."""
        if isinstance(exc, ProxyError):
            return cls(idx, exc.status, exc.body()["error"])
        if isinstance(exc, PassThrough):  # an upstream 4xx: its own error object when it has one
            answer = exc.answer
            try:
                data = answer.json()
            except ValueError:
                data = None
            if isinstance(data, dict) and isinstance(data.get("error"), dict):
                error = data["error"]
            elif isinstance(data, dict) and "message" in data:  # vLLM before 0.10: the error object itself
                error = data
            else:
                error = {"message": answer.text[:ERROR_BODY_SNIPPET], "type": "upstream_error"}
            return cls(idx, answer.status, error)
        logger.exception("batch part %d: unexpected failure", idx, exc_info=exc)
        return cls(idx, 500, {"message": f"proxy error: {type(exc).__name__}: {exc}", "type": "proxy_error"})

    def answer(self, rid: str) -> Answer:
        return Answer.of_json({"error": self.error}, self.status, {"X-Request-Id": rid})

    def event(self) -> bytes:
        return encode_event({"error": self.error})


async def run_batch(
    run_one: RunOne, limits: Limits, max_concurrency: int,
    body: dict[str, Any], prompts: Sequence[Any], headers: dict[str, str], path: str, rid: str,
) -> Answer | Relay:
    """The batch's one answer (a merged JSON, a merged stream, or the first failing part's error): each prompt's
    flow is ``run_one``'s, at most ``max_concurrency`` at once."""
    parts = split_body(body, prompts)
    n = check_n(body, chat=False, limits=limits)
    limit = asyncio.Semaphore(max_concurrency)
    logger.info("request %s: batch of %d prompts, %d at a time", rid, len(parts), max_concurrency)

    def part_headers(i: int) -> dict[str, str]:
        return {**headers, "X-Request-Id": f"{rid}-{i}"}  # vLLM's own id for prompt i of a batch

    if lax_bool(body.get("stream")):
        return await _stream(run_one, parts, n, limit, part_headers, path, rid)
    return await _json(run_one, parts, n, limit, part_headers, path, rid)


async def _cancel(tasks: Sequence[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _json(run_one: RunOne, parts: list[dict[str, Any]], n: int, limit: asyncio.Semaphore,
                part_headers: Any, path: str, rid: str) -> Answer:
    async def part(i: int) -> Answer:
        async with limit:
            try:
                answer = await run_one(parts[i], part_headers(i), path, f"{rid}-{i}")
                if not isinstance(answer, Answer):  # a stream although not asked for: close it, refuse it
                    answer.close()
                    raise ProxyError(502, "decode instance streamed a non-streaming request", "upstream_error")
                answer.json()  # D's JSON, or the part fails here
            except ValueError as exc:
                raise PartFailed(i, 502, {"message": f"decode instance returned invalid JSON: {exc}",
                                          "type": "upstream_error"}) from exc
            except (ProxyError, PassThrough) as exc:
                raise PartFailed.of(i, exc) from exc
            return answer

    tasks = [asyncio.create_task(part(i), name=f"kvp2p-batch-{rid}-{i}") for i in range(len(parts))]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t in done and not t.cancelled() and t.exception() is not None]
        if failed:
            first = failed[0].exception()
            await _cancel(tasks)
            failure = first if isinstance(first, PartFailed) else PartFailed.of(-1, first)  # type: ignore[arg-type]
            logger.warning("request %s: %s; the other parts cancelled", rid, failure.error["message"])
            return failure.answer(rid)
        answers = [t.result() for t in tasks]
    finally:
        await _cancel(tasks)  # the client went away (or a bug): no part outlives the request
    # Each prompt's instances and times go in the body: headers of one value per prompt grew with the batch past
    # what clients read (batch.py). The head is the streamed answer's: the id and the part count.
    merged = merge_answers([a.json() for a in answers], n, [route_of(a.headers) for a in answers])
    return Answer.of_json(merged, 200, dict(zip(BATCH_HEADERS, (rid, str(len(parts))), strict=True)))


class _Parts:
    """The parts' streams, read as one: each part's events go through one queue to the client's stream."""

    def __init__(self, run_one: RunOne, parts: list[dict[str, Any]], n: int, limit: asyncio.Semaphore,
                 part_headers: Any, path: str, rid: str) -> None:
        self.run_one, self.parts, self.limit, self.path, self.rid = run_one, parts, limit, path, rid
        self.part_headers = part_headers
        self.merger = StreamMerger(n)
        self.queue: asyncio.Queue[tuple[int, bytes | PartFailed | None]] = asyncio.Queue(_QUEUE_EVENTS)
        self.running = len(parts)
        self.tasks = [asyncio.create_task(self._part(i), name=f"kvp2p-batch-{rid}-{i}") for i in range(len(parts))]

    async def _part(self, i: int) -> None:
        async with self.limit:
            try:
                opened = await self.run_one(self.parts[i], self.part_headers(i), self.path, f"{self.rid}-{i}")
            except Exception as exc:  # noqa: BLE001 - every failure of a part is the batch's one error
                await self.queue.put((i, PartFailed.of(i, exc)))
                return
            if not isinstance(opened, Relay):  # D answered whole although asked to stream: relay its bytes
                await self.queue.put((i, opened.body))
                await self.queue.put((i, None))
                return
            try:
                async with contextlib.aclosing(opened.chunks) as chunks:
                    rest = b""
                    async for chunk in chunks:
                        events, rest = split_events(rest + chunk)
                        for event in events:
                            await self.queue.put((i, event))
                    if rest.strip():
                        await self.queue.put((i, rest))
            finally:
                opened.close()
        await self.queue.put((i, None))

    async def next(self) -> bytes | PartFailed | None:
        """The next bytes for the client, the batch's failure, or None at the end (after :meth:`finish`'s)."""
        while self.running:
            i, item = await self.queue.get()
            if item is None:
                self.running -= 1
                continue
            if isinstance(item, PartFailed):
                return item
            out = self.merger.rewrite(i, item)
            if isinstance(out, PartError):
                return PartFailed(i, int(out.error.get("code") or 502), out.error)
            if out:
                return out
        return None

    def close(self) -> None:
        """Cancel every part (synchronous: a cancelled part drops its upstream connection when it next runs)."""
        for task in self.tasks:
            task.cancel()


async def _stream(run_one: RunOne, parts: list[dict[str, Any]], n: int, limit: asyncio.Semaphore,
                  part_headers: Any, path: str, rid: str) -> Answer | Relay:
    streams = _Parts(run_one, parts, n, limit, part_headers, path, rid)
    handed_off = False
    try:
        first = await streams.next()  # nothing sent yet: a failure now is a normal error answer
        if isinstance(first, PartFailed):
            logger.warning("request %s: %s; the other parts cancelled", rid, first.error["message"])
            return first.answer(rid)
        relay = Relay(
            200,
            "text/event-stream",
            {**dict(zip(BATCH_HEADERS, (rid, str(len(parts))), strict=True)), "Cache-Control": "no-cache",
             "X-Accel-Buffering": "no"},
            _events(streams, first, rid),
            streams.close,
        )
        handed_off = True
        return relay
    finally:
        if not handed_off:
            streams.close()


async def _events(streams: _Parts, first: bytes | None, rid: str) -> AsyncIterator[bytes]:
    item: bytes | PartFailed | None = first
    while item is not None:
        if isinstance(item, PartFailed):
            logger.warning("request %s: %s mid-stream; the other parts cancelled", rid, item.error["message"])
            streams.close()
            yield item.event()  # one error event, then the end
            return
        yield item
        item = await streams.next()
    yield streams.merger.finish()

