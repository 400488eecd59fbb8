"""The proxy's KV-event reader against vLLM's own code: its event structs, its block hashing, its ZMQ publisher.

No engine: vLLM's ``ZmqEventPublisher`` (PUB + ROUTER replay) publishes vLLM's ``KVEventBatch`` structs on
127.0.0.1, and the proxy's :class:`KVEventFeed` follows it into an instance's cache index, through a real gap
filled by a real replay, and past garbage from a hostile publisher. Runs on every vLLM (its structs and hashing
are what differ between releases).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
import zmq.asyncio

# Imported plainly: this module holds vLLM's KV-event and block-hash seams, so a module vLLM moves is an error here,
# never a skip (tests/conftest.py keeps it out of the pure run: NEEDS_VLLM_OR_MOONCAKE).
from vllm.distributed import kv_events
from vllm.utils import hashing
from vllm.v1.core import kv_cache_utils

from vllm_kvp2p.proxy.block_hashes import make_hasher
from vllm_kvp2p.proxy.instances import Instance, InstancePool, PromptBlocks
from vllm_kvp2p.proxy.kv_event_feed import KVEventFeed
from vllm_kvp2p.proxy.kv_events import BlocksStored, decode_message
from vllm_kvp2p.proxy.routing import Policy
from vllm_kvp2p.testing.server import free_port

BS = 16


def vllm_hashes(tokens: list[int], algo: str) -> list[bytes]:
    fn = hashing.get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    parent, out = None, []
    for b in range(len(tokens) // BS):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[b * BS : (b + 1) * BS])
        out.append(parent)
    return out


def stored(tokens: list[int], hashes: list[bytes]) -> object:
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BS,
                                 lora_id=None, medium="GPU", lora_name=None)


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_prompt_hashes_equal_vllms_with_a_seed(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    tokens = list(range(1000, 1000 + 5 * BS + 3))
    theirs = vllm_hashes(tokens, algo)
    assert make_hasher(algo, "1234").block_hashes(tokens, BS) == theirs
    # What an engine publishes for them decodes to the same keys, and checks as matching.
    payload = msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=time.time(), events=[stored(tokens, theirs)]))
    (event,) = decode_message([b"", (0).to_bytes(8, "big"), payload]).events
    assert isinstance(event, BlocksStored) and event.keys == make_hasher(algo, "1234").keys(tokens, BS)
    assert make_hasher(algo, "1234").check(event) is True
    assert make_hasher(algo, "4321").check(event) is False


def test_without_pythonhashseed_the_default_seed_is_this_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32 seeds sha256 with a fixed string; earlier releases draw a random seed per process, which the
    proxy's check catches (its events never verify, so no routing by them)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = list(range(2 * BS))
    theirs = vllm_hashes(tokens, "sha256")
    fixed = hasattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED")
    assert (make_hasher("sha256").block_hashes(tokens, BS) == theirs) is fixed


@pytest.fixture
def publisher() -> Iterator[tuple[object, str, str]]:
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    # A bind endpoint must carry a wildcard for vLLM to bind rather than connect.
    pub = kv_events.ZmqEventPublisher(0, endpoint=pub_ep.replace("127.0.0.1", "*"),
                                      replay_endpoint=replay_ep.replace("127.0.0.1", "*"), buffer_steps=100)
    yield pub, pub_ep, replay_ep
    pub.shutdown()


def publish(pub: object, tokens: list[int]) -> None:
    pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[stored(tokens, vllm_hashes(tokens, "sha256"))]))


async def wait_until(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_feed_follows_vllms_publisher_through_a_gap_and_garbage(
    publisher: tuple[object, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    pub, pub_ep, replay_ep = publisher
    hasher = make_hasher("sha256", os.environ["PYTHONHASHSEED"])
    pool = InstancePool(["http://p"], policy=Policy.PREFIX_AWARE, events=[(pub_ep, replay_ep)])
    inst = pool.instances[0]
    prompts = [list(range(k * 100, k * 100 + 2 * BS)) for k in range(4)]

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        feed = KVEventFeed(ctx, pool, inst, hasher)
        task = asyncio.create_task(feed.run())
        # The first message may be lost while the subscription is joining: publish until one lands.
        for _ in range(100):
            publish(pub, prompts[0])
            await asyncio.sleep(0.05)
            if inst.cache.last_seq is not None:
                break
        await wait_until(lambda: inst.cache.cached_blocks(hasher.keys(prompts[0], BS)) == 2)
        assert inst.hashes_match is True
        # The proxy stops listening; the engine publishes two batches it misses; then one it hears: a gap.
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        publish(pub, prompts[1])
        publish(pub, prompts[2])
        await asyncio.sleep(0.3)
        task = asyncio.create_task(feed.run())
        for _ in range(100):  # again until the resubscribed feed hears one
            publish(pub, prompts[3])
            await asyncio.sleep(0.05)
            if inst.cache.gaps:
                break
        await wait_until(lambda: all(inst.cache.cached_blocks(hasher.keys(p, BS)) == 2 for p in prompts))
        assert inst.cache.gaps == 1 and inst.cache.resets == 0  # filled by the replay, nothing lost
        # A hostile publisher on the same endpoint's subscriber: garbage is counted, the feed goes on.
        rogue_ep = f"tcp://127.0.0.1:{free_port()}"
        rogue = ctx.socket(zmq.PUB)
        rogue.bind(rogue_ep)
        sub_task = task
        # A second subscription feeding the same index, from the rogue's endpoint.
        evil = KVEventFeed(ctx, pool, Instance(inst.url, events_endpoint=rogue_ep, cache=inst.cache), hasher)
        evil_task = asyncio.create_task(evil.run())
        for _ in range(100):
            await rogue.send_multipart([b"", b"\xff" * 8, b"\xc1 not msgpack"])
            await rogue.send_multipart([b"x"])
            await asyncio.sleep(0.02)
            if inst.cache.bad_messages >= 2:
                break
        assert inst.cache.bad_messages >= 2
        publish(pub, list(range(900, 900 + BS)))
        await wait_until(lambda: inst.cache.cached_blocks(hasher.keys(list(range(900, 900 + BS)), BS)) == 1)
        # Routing by it: a prompt with a known prefix is a hit of its two blocks.
        assert inst.cached_tokens(PromptBlocks(prompts[2] + [5, 6, 7], hasher)) == 2 * BS
        for t in (sub_task, evil_task):
            t.cancel()
        await asyncio.gather(sub_task, evil_task, return_exceptions=True)
        rogue.close(linger=0)
        ctx.term()

    asyncio.run(scenario())


def test_engine_warns_when_its_published_hashes_are_seeded_at_random() -> None:
    from types import SimpleNamespace

    from vllm_kvp2p.connector.compat import kv_event_hashes_problem

    def config(enabled: bool, algo: str = "sha256") -> SimpleNamespace:
        return SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=enabled),
                               cache_config=SimpleNamespace(prefix_caching_hash_algo=algo))

    fixed = hasattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED")  # vLLM 0.32: a fixed seed for sha256
    assert kv_event_hashes_problem(config(False), {}) is None
    assert kv_event_hashes_problem(config(True), {"PYTHONHASHSEED": "0"}) is None
    assert (kv_event_hashes_problem(config(True), {}) is None) is fixed
    problem = kv_event_hashes_problem(config(True, "xxhash"), {})
    assert problem is not None and "PYTHONHASHSEED" in problem and "xxhash" in problem
    # The claim behind it, on this vLLM: without the variable two initialisations (two engine processes) seed the
    # first block alike exactly when no problem is reported.
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PYTHONHASHSEED", raising=False)
        seeds = set()
        for _ in range(2):
            kv_cache_utils.init_none_hash(hashing.sha256)
            seeds.add(bytes(kv_cache_utils.NONE_HASH))
    assert (len(seeds) == 1) is fixed


def test_a_future_event_type_is_skipped_by_its_tag_as_vllms_encoder_writes_it() -> None:
    """A newer vLLM's event type, written by this vLLM's own encoder (a subclass of its tagged ``KVCacheEvent``, in its
    ``KVEventBatch``): the proxy reads its type from the tag msgspec writes first (the map form's first key on vLLM
    0.32, the array form's first element on 0.23) and skips its 4 MiB body unread; the known event beside it is
    indexed. Before issue 45, item 4, such an event was decoded whole to learn its type (~2 s, ~300 MiB)."""
    import tracemalloc

    class BlockPinned(kv_events.KVCacheEvent):  # type: ignore[misc, name-defined]  # its tag: "BlockPinned"
        body: list[list[int]]

    tokens = list(range(2 * BS))
    pinned = BlockPinned(body=[[]] * (4 * 2**20 - 512))
    payload = msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(
        ts=time.time(), events=[pinned, stored(tokens, vllm_hashes(tokens, "sha256"))]))
    assert len(payload) <= 4 * 2**20
    tracemalloc.start()
    try:
        batch = decode_message([b"", (0).to_bytes(8, "big"), payload])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert batch.unknown == 1 and len(batch.events) == 1 and isinstance(batch.events[0], BlocksStored)
    assert peak < 2 * 2**20, f"decoding allocated {peak >> 20} MiB"
