"""The ZMQ adapter that feeds one instance's KV events into its cache index (an asyncio task per instance).

It subscribes to the engine's publisher, decodes each message (:mod:`kv_events`), hands it to the instance's
:class:`~vllm_kvp2p.proxy.cache_index.InstanceCache` and carries out the verdict: on a gap it asks the engine's
replay socket (a DEALER speaking to vLLM's ROUTER: ``["", start_seq]`` in; ``["", topic, seq, payload]`` out, or
``["", seq, payload]`` from vLLM 0.23, until the ``seq == -1`` marker), bounded in time and count. Without a
replay endpoint, or when the replay fails, the index restarts from the live stream. Every stored event is also a
chance to check the proxy's block hashes against the engine's (:meth:`InstancePool.check_hashes`). Garbage is
counted and logged, never raised: a broken or hostile publisher costs routing quality only, and ZMQ reconnects by
itself when a publisher restarts.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from vllm_kvp2p.proxy.block_hashes import PromptHasher
from vllm_kvp2p.proxy.cache_index import Replay
from vllm_kvp2p.proxy.instances import Instance, InstancePool
from vllm_kvp2p.proxy.kv_events import (
    END_OF_REPLAY,
    MAX_PAYLOAD_BYTES,
    BadEvents,
    BlocksStored,
    EventBatch,
    decode_message,
    decode_seq,
)

logger = logging.getLogger("vllm_kvp2p.proxy.kv_events")

REPLAY_TIMEOUT_S = 2.0
#: vLLM keeps 10,000 batches for replay by default; a replay longer than this is cut (the index then restarts).
MAX_REPLAY_MESSAGES = 100_000


class KVEventFeed:
    """Subscribes to one instance's KV events for the life of the proxy."""

    def __init__(self, ctx: zmq.asyncio.Context, pool: InstancePool, inst: Instance, hasher: PromptHasher) -> None:
        assert inst.events_endpoint is not None
        self._ctx = ctx
        self._pool = pool
        self._inst = inst
        self._hasher = hasher
        self._mismatch_logged = False
        self.messages = 0

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self._inst.events_endpoint)
        logger.info("KV events of %s: subscribed to %s (replay %s)", self._inst.url, self._inst.events_endpoint,
                    self._inst.replay_endpoint or "none")
        try:
            while True:
                frames = await sub.recv_multipart()
                try:
                    await self._on_message(frames)
                except Exception:  # noqa: BLE001 - a bug here must cost this instance's index, not the feed
                    logger.exception("KV events of %s: message dropped, index restarted", self._inst.url)
                    self._inst.cache.reset()
        finally:
            sub.close(linger=0)

    async def _on_message(self, frames: list[bytes]) -> None:
        cache = self._inst.cache
        try:
            batch = decode_message(frames)
        except BadEvents as exc:
            cache.bad_messages += 1
            if cache.bad_messages <= 3 or cache.bad_messages % 1000 == 0:
                logger.warning("KV events of %s: message ignored (%d so far): %s", self._inst.url,
                               cache.bad_messages, exc)
            return
        self.messages += 1
        verdict = cache.apply(batch)
        if isinstance(verdict, Replay):
            replayed = await self._replay(verdict.from_seq)
            if replayed is None:
                cache.reset()
                cache.apply(batch)
            else:
                cache.replayed([*replayed, batch], verdict.from_seq)
        self._check_hashes(batch)

    def _check_hashes(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlocksStored) and self._inst.hashes_match is not False:
                if self._pool.check_hashes(self._inst, event, self._hasher) is False and not self._mismatch_logged:
                    self._mismatch_logged = True
                    logger.error(
                        "KV events of %s: its block hashes differ from the proxy's (--hash-algo %s, seed %s): "
                        "its prefix cache is ignored for routing. Give the proxy the engines' "
                        "--prefix-caching-hash-algo and PYTHONHASHSEED (--hash-algo, --hash-seed)",
                        self._inst.url, self._hasher.algorithm,
                        "vLLM's default" if self._hasher.seed == "vllm-none-hash" else "from --hash-seed",
                    )

    async def _replay(self, from_seq: int) -> list[EventBatch] | None:
        """The batches from ``from_seq`` on, from the replay socket; ``None`` when there is none or it failed."""
        if self._inst.replay_endpoint is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[EventBatch] = []
        try:
            sock.connect(self._inst.replay_endpoint)
            await sock.send_multipart([b"", from_seq.to_bytes(8, "big")])
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while len(out) < MAX_REPLAY_MESSAGES:
                    frames = await sock.recv_multipart()
                    # ["", topic, seq, payload] (vLLM 0.32) or ["", seq, payload] (vLLM 0.23).
                    if len(frames) not in (3, 4) or frames[0] != b"":
                        raise BadEvents(f"replay answer of {len(frames)} frames")
                    message = frames[1:] if len(frames) == 4 else [b"", *frames[1:]]
                    if decode_seq(message[1]) == END_OF_REPLAY:
                        return out
                    out.append(decode_message(message))
            raise BadEvents(f"replay longer than {MAX_REPLAY_MESSAGES} messages")
        except (TimeoutError, BadEvents, zmq.ZMQError) as exc:
            logger.warning("KV events of %s: replay from seq %d failed (%s): the index restarts from the live "
                           "stream", self._inst.url, from_seq, exc or type(exc).__name__)
            return None
        finally:
            sock.close(linger=0)


def start_feeds(pools: tuple[InstancePool, ...], hasher: PromptHasher) -> list[asyncio.Task[None]]:
    """One feed task per instance of ``pools`` that publishes KV events."""
    ctx = zmq.asyncio.Context.instance()
    tasks: list[asyncio.Task[None]] = []
    for pool in pools:
        for inst in pool.instances:
            if inst.events_endpoint is not None:
                feed = KVEventFeed(ctx, pool, inst, hasher)
                tasks.append(asyncio.create_task(feed.run(), name=f"kv-events {inst.url}"))
    return tasks
