"""A KV-event publisher must not stall the proxy (issue 37, item 2): the real :class:`KVEventFeed` on a real event
loop, flooded over real ZMQ sockets with well-formed batches like a busy engine's (one ``BlockStored`` of a
64k-token prompt each, vLLM 0.32's map form).

Before the fix, ``await sub.recv_multipart()`` never suspended while messages were queued, so the feed decoded the
whole backlog (up to ZMQ's default 1000 messages) in one go: a ticker task on the same loop stood still for
seconds; and a replay kept every decoded batch (each with all its token ids) until its end. No vLLM here: the
publisher is a plain ZMQ PUB / ROUTER speaking vLLM's wire format (tests/unit/test_kv_events_vllm.py and
tests/e2e_routing/test_kv_event_flood.py use vLLM's own publisher).
"""

from __future__ import annotations

import asyncio
import threading
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from vllm_kvp2p.proxy.block_hashes import make_hasher
from vllm_kvp2p.proxy.instances import InstancePool
from vllm_kvp2p.proxy.kv_event_feed import DecodeBudget, KVEventFeed
from vllm_kvp2p.proxy.kv_events import MAX_BATCH_KEYS, BadEvents, BlocksStored, decode_message
from vllm_kvp2p.proxy.routing import Policy
from vllm_kvp2p.testing.server import free_port

BS = 16
PROMPT_TOKENS = 65_536
#: Queued before the feed reads them: the old feed decoded all of them without letting the loop run.
FLOOD = 300
#: The loop may not stand still longer than this while the feed works through the flood (old code: ~2 s per large
#: message; this code: under 0.1 s on an idle machine, 0.2526 s once at a load average of 7 and 0.539 s once with
#: five other test runs on the 2 cores, hence 1.0: still half of what the old code stalled).
MAX_TICK_GAP_S = 1.0


def big_batch(k: int, *, int_hashes: bool = False) -> bytes:
    """What an engine publishes after prefilling one 64k-token prompt: its 4096 block hashes and all its tokens."""
    tokens = [(k * 7919 + i) % 150_000 for i in range(PROMPT_TOKENS)]
    hashes: list[bytes | int] = [
        (k << 32 | b) if int_hashes else (k << 32 | b).to_bytes(32, "big") for b in range(PROMPT_TOKENS // BS)
    ]
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
             "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}
    return msgspec.msgpack.encode([time.time(), [event], None])


def seq(n: int) -> bytes:
    return n.to_bytes(8, "big", signed=True)


class Ticker:
    """A task on the proxy's loop that wants to run every millisecond: its longest wait is the loop's stall."""

    def __init__(self) -> None:
        self.max_gap = 0.0
        self._last = time.monotonic()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.001)
            self._tick()

    def _tick(self) -> None:
        now = time.monotonic()
        self.max_gap = max(self.max_gap, now - self._last)
        self._last = now

    async def stop(self) -> None:
        self._tick()  # a ticker that never got to run stalled from its start until now
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def joined_feed(pub: zmq.Socket, pool: InstancePool, inst: Any
                      ) -> tuple[zmq.asyncio.Context, KVEventFeed, asyncio.Task[None]]:
    """A feed of ``inst``'s events running on this loop, once its subscription to ``pub`` has joined (an empty
    batch, sequence 0, applied): its context, the feed and its task, for the caller to read and stop."""
    actx = zmq.asyncio.Context()
    feed = KVEventFeed(actx, pool, inst, make_hasher("sha256"))
    task = asyncio.create_task(feed.run())
    for _ in range(200):
        pub.send_multipart([b"", seq(0), msgspec.msgpack.encode([0.0, [], None])])
        await asyncio.sleep(0.02)
        if inst.cache.last_seq is not None:
            break
    assert inst.cache.last_seq == 0
    return actx, feed, task


async def stop_feed(actx: zmq.asyncio.Context, task: asyncio.Task[None]) -> None:
    """Stop a feed :func:`joined_feed` started, and its context."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    actx.destroy(linger=0)


async def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


# -- the pure part: what a batch keeps ------------------------------------------------------------------------


def test_a_64k_token_event_keeps_its_keys_and_only_the_first_blocks_tokens() -> None:
    (event,) = decode_message([b"", seq(0), big_batch(3)]).events
    assert isinstance(event, BlocksStored) and len(event.keys) == PROMPT_TOKENS // BS
    assert event.token_ids == tuple((3 * 7919 + i) % 150_000 for i in range(BS))  # old: all 65,536
    # vLLM 0.23's array form and int hashes alike.
    tokens = [1, 200, 70_000, 5_000_000_000, 3] * 4
    payload = msgspec.msgpack.encode([0.0, [["BlockStored", [9], None, tokens, BS, None, None]], None])
    (event,) = decode_message([b"", seq(0), payload]).events
    assert isinstance(event, BlocksStored) and event.token_ids == tuple(tokens[:BS])
    # A block with a parent is never hash-checked: none of its tokens are kept.
    payload = msgspec.msgpack.encode([0.0, [["BlockStored", [9], 8, tokens, BS, None, None]], None])
    (event,) = decode_message([b"", seq(0), payload]).events
    assert isinstance(event, BlocksStored) and event.token_ids == ()


@pytest.mark.parametrize("tokens", [[1.5] * BS, ["a"] * BS, [1] * 3 + [None], "not a list"])
def test_token_ids_that_are_not_ints_where_they_are_read_are_refused(tokens: object) -> None:
    payload = msgspec.msgpack.encode([0.0, [["BlockStored", [9], None, tokens, BS, None, None]], None])
    with pytest.raises(BadEvents):
        decode_message([b"", seq(0), payload])


def test_a_batch_of_more_keys_than_one_loop_turn_may_apply_is_refused() -> None:
    half = MAX_BATCH_KEYS // 2 + 1
    events = [{"type": "BlockRemoved", "block_hashes": list(range(k * half, (k + 1) * half)), "medium": None}
              for k in range(2)]
    with pytest.raises(BadEvents, match="in one batch"):
        decode_message([b"", seq(0), msgspec.msgpack.encode([0.0, events, None])])


def test_the_decode_budget_keeps_decoding_to_its_share_of_the_clock() -> None:
    """Back-to-back decoding (a flood) is paced to the share; decoding now and then is not delayed at all."""
    budget, now, busy = DecodeBudget(0.25), 0.0, 0.0
    for _ in range(1000):  # 2 ms each, as fast as the budget lets
        now += 0.002
        busy += 0.002
        now += budget.pause(0.002, now)
    assert busy / now == pytest.approx(0.25, rel=0.01)  # without the budget: 1.0
    assert budget.pause(0.002, now + 10.0) == pytest.approx(0.006)  # after a calm: only this message's pacing
    with pytest.raises(ValueError):
        DecodeBudget(0)


# -- the feed on a real loop ----------------------------------------------------------------------------------


def test_a_flood_of_big_batches_does_not_stall_the_event_loop() -> None:
    ctx = zmq.Context()
    pub_ep = f"tcp://127.0.0.1:{free_port()}"
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)  # the publisher never drops: the whole flood reaches the proxy's socket
    pub.bind(pub_ep)
    pool = InstancePool(["http://p"], policy=Policy.PREFIX_AWARE, events=[(pub_ep, None)])
    inst = pool.instances[0]
    payloads = [big_batch(k) for k in range(8)]

    async def scenario() -> float:
        actx, feed, task = await joined_feed(pub, pool, inst)
        # The flood, sent from another thread while the loop runs the feed and the ticker.
        sender = threading.Thread(target=lambda: [pub.send_multipart([b"", seq(n), payloads[n % len(payloads)]])
                                                  for n in range(1, FLOOD + 1)])
        ticker = Ticker()
        started = time.monotonic()
        sender.start()
        await asyncio.to_thread(sender.join)
        # The feed works through what it was given (a low RCVHWM drops some: a gap, the index restarts).
        await wait_until(lambda: inst.cache.last_seq == FLOOD, 120, "the flood's last batch never applied")
        took = time.monotonic() - started
        await ticker.stop()
        await stop_feed(actx, task)
        print(f"flood of {FLOOD} x {len(payloads[0]) >> 10} KiB: {feed.messages} decoded in {took:.2f} s, "
              f"loop's longest stall {ticker.max_gap * 1000:.0f} ms")
        assert feed.messages >= 2
        return ticker.max_gap

    try:
        assert asyncio.run(scenario()) < MAX_TICK_GAP_S
    finally:
        pub.close(linger=0)
        ctx.term()


def test_a_replay_is_applied_as_it_arrives_and_keeps_the_loop_running() -> None:
    """A gap of 150 big batches, replayed by a ROUTER speaking vLLM's replay protocol: the index ends up with all
    of them, the loop never stands still, and the feed's allocations stay a few batches' worth (the old feed kept
    all 150 decoded batches, each with its 65,536 token ids, ~2.5 MiB apiece, before applying any)."""
    gap = 150
    ctx = zmq.Context()
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = ctx.socket(zmq.PUB)
    pub.bind(pub_ep)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # block rather than drop: every replayed batch arrives
    router.bind(replay_ep)
    payloads = [big_batch(k, int_hashes=True) for k in range(4)]

    def serve_replay() -> None:
        ident, _, start = router.recv_multipart()
        for n in range(int.from_bytes(start, "big"), gap + 1):
            router.send_multipart([ident, b"", b"", seq(n), payloads[n % len(payloads)]])
        router.send_multipart([ident, b"", b"", seq(-1), b""])

    pool = InstancePool(["http://p"], policy=Policy.PREFIX_AWARE, events=[(pub_ep, replay_ep)])
    inst = pool.instances[0]

    async def scenario() -> tuple[float, int]:
        actx, feed, task = await joined_feed(pub, pool, inst)
        server = threading.Thread(target=serve_replay)
        server.start()
        ticker = Ticker()
        tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        pub.send_multipart([b"", seq(gap + 1), msgspec.msgpack.encode([0.0, [], None])])  # seqs 1..gap missed
        await wait_until(lambda: inst.cache.last_seq == gap + 1, 120, "the replay never completed")
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        await ticker.stop()
        await asyncio.to_thread(server.join)
        assert inst.cache.gaps == 1 and inst.cache.resets == 0
        assert len(inst.cache) == len(payloads) * PROMPT_TOKENS // BS  # the 4 distinct prompts' blocks
        await stop_feed(actx, task)
        print(f"replay of {gap} x {len(payloads[0]) >> 10} KiB: loop's longest stall {ticker.max_gap * 1000:.0f} "
              f"ms, allocations peaked {peak >> 20} MiB above the start")
        return ticker.max_gap, peak

    try:
        max_gap, peak = asyncio.run(scenario())
        assert max_gap < MAX_TICK_GAP_S
        assert peak < 64 * 2**20  # the index's 16k keys, ZMQ's queue of 16 and one batch in decoding
    finally:
        pub.close(linger=0)
        router.close(linger=0)
        ctx.term()


# -- an event's type is read from its tag, never by decoding its body (issue 45, item 4) ----------------------

#: What decoding one hostile message may allocate: the tag, the batch's list of raw events, one event's fields.
#: Before, an unknown event was decoded whole to learn its type: a 4 MiB body of nested lists allocated ~300 MiB.
MAX_DECODE_ALLOC = 2 * 2**20
#: Just under one message's bound.
BODY_ITEMS = 4 * 2**20 - 256


def unknown_event(form: str) -> object:
    """A future vLLM event type with a large body: ~4M nested empty lists (the costliest msgpack to decode whole:
    ~2 s and ~300 MiB of Python objects in one C call)."""
    body = [[]] * BODY_ITEMS
    return {"type": "BlockPinned", "body": body} if form == "map" else ["BlockPinned", body]


def decode_alloc(payload: bytes) -> tuple[object, int]:
    """``decode_message``'s result (or its BadEvents) and the bytes it allocated at its peak."""
    tracemalloc.start()
    try:
        try:
            result: object = decode_message([b"", seq(1), payload])
        except BadEvents as exc:
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("form", ["map", "array"])
def test_an_unknown_event_type_is_skipped_by_its_tag_without_decoding_its_body(form: str) -> None:
    payload = msgspec.msgpack.encode([0.0, [unknown_event(form), {"type": "AllBlocksCleared"}], None])
    batch, peak = decode_alloc(payload)
    assert not isinstance(batch, BadEvents), batch
    assert batch.unknown == 1 and len(batch.events) == 1  # skipped and counted; the known one kept
    assert peak < MAX_DECODE_ALLOC, f"decoding allocated {peak >> 20} MiB"


def test_a_known_event_with_a_large_extra_keys_body_is_not_decoded_whole() -> None:
    """vLLM's ``extra_keys`` (one entry per block: a LoRA name, multimodal ids, a cache salt) is all the proxy needs
    to know is non-empty; a hostile 4 MiB of nested entries must not be built as Python objects."""
    event = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1] * BS,
             "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": [[[]]] * (BODY_ITEMS // 2)}
    batch, peak = decode_alloc(msgspec.msgpack.encode([0.0, [event], None]))
    assert not isinstance(batch, BadEvents), batch
    (stored,) = batch.events
    assert isinstance(stored, BlocksStored) and stored.has_extra_keys
    assert peak < MAX_DECODE_ALLOC, f"decoding allocated {peak >> 20} MiB"
    # Entries that are all None or empty are no extra keys (vLLM writes None per block without any).
    plain = {**event, "extra_keys": [None, []] * 8}
    (stored,) = decode_message([b"", seq(1), msgspec.msgpack.encode([0.0, [plain], None])]).events
    assert isinstance(stored, BlocksStored) and not stored.has_extra_keys


@pytest.mark.parametrize("what", ["events", "block_hashes"])
def test_lists_over_their_bound_are_refused_before_they_are_decoded(what: str) -> None:
    event = {"type": "BlockRemoved", "block_hashes": [[]] * BODY_ITEMS if what == "block_hashes" else [1],
             "medium": None}
    events = [[]] * BODY_ITEMS if what == "events" else [event]
    batch, peak = decode_alloc(msgspec.msgpack.encode([0.0, events, None]))
    assert isinstance(batch, BadEvents) and len(str(batch)) < 500
    assert peak < MAX_DECODE_ALLOC, f"decoding allocated {peak >> 20} MiB"


@pytest.mark.parametrize("event", [
    {"body": [1], "type": "BlockPinned"},  # msgspec (vLLM's encoder) writes a tagged struct's tag first
    {},
    [],
    [7, "BlockStored"],
    {"type": 3},
], ids=["tag-not-first", "empty-map", "empty-array", "tag-not-a-string", "type-not-a-string"])
def test_an_event_without_its_type_tag_first_is_refused(event: object) -> None:
    with pytest.raises(BadEvents, match="type"):
        decode_message([b"", seq(1), msgspec.msgpack.encode([0.0, [event], None])])


def test_large_unknown_events_do_not_stall_the_event_loop() -> None:
    """The finding: three 4 MiB messages of an unknown event type stalled the proxy's loop ~2 s each (the decoding
    thread held the GIL in one C call). Now their type is read from the tag and the body skipped unread."""
    messages = 3
    ctx = zmq.Context()
    pub_ep = f"tcp://127.0.0.1:{free_port()}"
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100)
    pub.bind(pub_ep)
    pool = InstancePool(["http://p"], policy=Policy.PREFIX_AWARE, events=[(pub_ep, None)])
    inst = pool.instances[0]
    payload = msgspec.msgpack.encode([0.0, [unknown_event("array")], None])
    assert len(payload) <= 4 * 2**20

    async def scenario() -> float:
        actx, feed, task = await joined_feed(pub, pool, inst)
        ticker = Ticker()
        for n in range(1, messages + 1):
            pub.send_multipart([b"", seq(n), payload])
        await wait_until(lambda: inst.cache.last_seq == messages, 60, "the big messages were never applied")
        await ticker.stop()
        await stop_feed(actx, task)
        print(f"{messages} unknown events of {len(payload) >> 10} KiB: loop's longest stall "
              f"{ticker.max_gap * 1000:.0f} ms")
        assert inst.cache.bad_messages == 0
        return ticker.max_gap

    try:
        assert asyncio.run(scenario()) < MAX_TICK_GAP_S
    finally:
        pub.close(linger=0)
        ctx.term()
