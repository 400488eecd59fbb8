"""The ZMQ adapter that feeds one instance's KV events into its cache index (an asyncio task per instance).

It subscribes to the engine's publisher, decodes each message (:mod:`kv_events`), hands it to the instance's
:class:`~vllm_kvp2p.proxy.cache_index.InstanceCache` and carries out the verdict: on a gap it asks the engine's
replay socket (a DEALER speaking to vLLM's ROUTER: ``["", start_seq]`` in; ``["", topic, seq, payload]`` out, or
``["", seq, payload]`` from vLLM 0.23, until the ``seq == -1`` marker), bounded in time and bytes, and applies each
replayed batch as it arrives. Without a replay endpoint, or when the replay fails, the index restarts from the live
stream. Every stored event is also a chance to check the proxy's block hashes against the engine's
(:meth:`InstancePool.check_hashes`). ZMQ reconnects by itself when a publisher restarts.

The feed shares the proxy's event loop with every request, so it must never hold it (issue 37, item 2):

* decoding runs on a thread of the feed's own, one message at a time, and all feeds together decode at most
  :data:`MAX_DECODE_SHARE` of the time (:class:`DecodeBudget`). Awaiting it suspends the feed after every message;
  ``await sock.recv_multipart()`` alone does not: while messages are queued it returns without yielding, so a
  flood would starve every other task and no ``asyncio.timeout`` would fire. The decoder's C calls are short
  (token ids are skipped undecoded, an event of a type the proxy does not know is skipped by its tag, lists over
  their bound are refused from their header: :mod:`kv_events`), so the thread hands the GIL back within Python's
  switch interval;
* what runs on the loop per message is applying it to the index: O(its block keys), at most
  :data:`~vllm_kvp2p.proxy.kv_events.MAX_BATCH_KEYS`;
* memory: ZMQ queues at most :data:`RCVHWM` messages of at most ``MAX_PAYLOAD_BYTES`` per socket (past that the
  publisher drops, and the gap is replayed or the index restarts); one message is decoded at a time; a replay
  keeps no batch (each is applied as it arrives) and stops after :data:`MAX_REPLAY_BYTES`;
* the request path reads the index (a dict) and never awaits the feed.

What a broken or hostile publisher can do, then, is spoil this instance's routing (garbage is counted and logged,
never raised; a flood makes the index lag or restart) and take the feeds' budgeted share of the proxy's CPU, plus
the loop's time to apply what was decoded. Its flood does not stall the proxy: with vLLM's own publisher sending
~800 batches of a 64k-token prompt a second, requests stayed within 2x their calm latency and ``/health`` within
0.4 s (docs/reliability.md, "A KV-event flood (the proxy)").
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

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

#: How long the replay socket may stay silent (before its first batch and between two).
REPLAY_TIMEOUT_S = 2.0
#: A whole replay's time: vLLM keeps 10,000 batches, each applied here as it arrives.
MAX_REPLAY_S = 20.0
#: vLLM keeps 10,000 batches for replay by default; a replay longer than this is cut (the index then restarts).
MAX_REPLAY_MESSAGES = 100_000
#: A replay's bytes: past them it is cut (and the index restarts from the live stream): bounds its time, not its
#: memory (each batch is applied as it arrives).
MAX_REPLAY_BYTES = 256 * 1024 * 1024
#: Messages ZMQ may queue per socket (its default is 1000): at most RCVHWM x MAX_PAYLOAD_BYTES (64 MiB) waiting.
RCVHWM = 16
#: The share of the proxy's time all feeds together may spend decoding. A thread does not make decoding free: it
#: holds the GIL, and the event loop waits up to Python's switch interval (5 ms) for it at every wake-up; a request
#: wakes the loop dozens of times. Past this share a flood waits in ZMQ's queue and the publisher's (the index lags).
MAX_DECODE_SHARE = 0.25


class DecodeBudget:
    """Paces the feeds so that decoding takes at most ``share`` of the wall clock (pure: the caller sleeps)."""

    def __init__(self, share: float = MAX_DECODE_SHARE) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share={share}: in (0, 1]")
        self.share = share
        self._free_at = float("-inf")

    def pause(self, spent: float, now: float) -> float:
        """After ``spent`` seconds of decoding ending at ``now``: how long to wait before decoding again."""
        self._free_at = max(self._free_at, now - spent) + spent / self.share
        return max(0.0, self._free_at - now)


class KVEventFeed:
    """Subscribes to one instance's KV events for the life of the proxy."""

    def __init__(self, ctx: zmq.asyncio.Context, pool: InstancePool, inst: Instance, hasher: PromptHasher,
                 budget: DecodeBudget | None = None) -> None:
        assert inst.events_endpoint is not None
        self._budget = budget or DecodeBudget()
        self._ctx = ctx
        self._pool = pool
        self._inst = inst
        self._hasher = hasher
        self._mismatch_logged = False
        self._decoder = ThreadPoolExecutor(1)  # replaced by each run(), which names its thread
        self.messages = 0

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self._inst.events_endpoint)
        logger.info("KV events of %s: subscribed to %s (replay %s)", self._inst.url, self._inst.events_endpoint,
                    self._inst.replay_endpoint or "none")
        # A thread per feed, one budget for all (start_feeds): a flooding publisher makes the other feeds' indexes
        # lag too (their decoding waits for the budget), never the requests.
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix=f"kv-events {self._inst.url}")
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
            self._decoder.shutdown(wait=False, cancel_futures=True)

    async def _decode(self, frames: list[bytes]) -> EventBatch:
        """Decoded on the feed's thread, then paced by the budget; always suspends the feed (see the module's
        docstring)."""
        started = time.monotonic()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._decoder, decode_message, frames)
        finally:
            now = time.monotonic()
            await asyncio.sleep(self._budget.pause(now - started, now))

    async def _on_message(self, frames: list[bytes]) -> None:
        cache = self._inst.cache
        try:
            batch = await self._decode(frames)
        except BadEvents as exc:
            self._bad(exc)
            return
        del frames  # the payload's bytes are not kept past decoding
        self.messages += 1
        verdict = cache.apply(batch)
        if isinstance(verdict, Replay):
            if not await self._replay(verdict.from_seq, batch):
                cache.reset()
                cache.apply(batch)
        self._check_hashes(batch)

    def _bad(self, exc: BadEvents) -> None:
        cache = self._inst.cache
        cache.bad_messages += 1
        if cache.bad_messages <= 3 or cache.bad_messages % 1000 == 0:
            logger.warning("KV events of %s: message ignored (%d so far): %s", self._inst.url, cache.bad_messages,
                           exc)

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

    async def _replay(self, from_seq: int, live: EventBatch) -> bool:
        """Apply the batches from ``from_seq`` on, from the replay socket, as they arrive, then ``live`` (the batch
        that showed the gap). False when there is no replay socket or the replay failed (the caller resets)."""
        if self._inst.replay_endpoint is None:
            return False
        cache = self._inst.cache
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.LINGER, 0)
        expected, messages, size = from_seq, 0, 0
        deadline = time.monotonic() + MAX_REPLAY_S

        def apply(batch: EventBatch) -> None:
            nonlocal expected
            repeat = cache.last_seq is not None and batch.seq <= cache.last_seq
            cache.replayed([batch], expected)  # in order, or the index restarts from it
            if not repeat:
                expected = batch.seq + 1

        try:
            sock.connect(self._inst.replay_endpoint)
            await sock.send_multipart([b"", from_seq.to_bytes(8, "big")])
            while True:
                async with asyncio.timeout(REPLAY_TIMEOUT_S):
                    frames = await sock.recv_multipart()
                # ["", topic, seq, payload] (vLLM 0.32) or ["", seq, payload] (vLLM 0.23).
                if len(frames) not in (3, 4) or frames[0] != b"":
                    raise BadEvents(f"replay answer of {len(frames)} frames")
                message = frames[1:] if len(frames) == 4 else [b"", *frames[1:]]
                if decode_seq(message[1]) == END_OF_REPLAY:
                    apply(live)
                    return True
                messages += 1
                size += sum(len(f) for f in frames)
                if messages > MAX_REPLAY_MESSAGES or size > MAX_REPLAY_BYTES:
                    raise BadEvents(f"replay longer than {MAX_REPLAY_MESSAGES} messages or "
                                    f"{MAX_REPLAY_BYTES >> 20} MiB")
                del frames
                apply(await self._decode(message))  # suspends: the timeout can fire, the loop runs
                if time.monotonic() > deadline:  # however the loop was scheduled
                    raise TimeoutError
        except (TimeoutError, BadEvents, zmq.ZMQError) as exc:
            logger.warning("KV events of %s: replay from seq %d failed (%s): the index restarts from the live "
                           "stream", self._inst.url, from_seq, str(exc) or type(exc).__name__)
            return False
        finally:
            sock.close(linger=0)


def start_feeds(pools: tuple[InstancePool, ...], hasher: PromptHasher) -> list[asyncio.Task[None]]:
    """One feed task per instance of ``pools`` that publishes KV events."""
    ctx = zmq.asyncio.Context.instance()
    budget = DecodeBudget()  # one for all feeds: together they take at most its share
    tasks: list[asyncio.Task[None]] = []
    for pool in pools:
        for inst in pool.instances:
            if inst.events_endpoint is not None:
                feed = KVEventFeed(ctx, pool, inst, hasher, budget)
                tasks.append(asyncio.create_task(feed.run(), name=f"kv-events {inst.url}"))
    return tasks
