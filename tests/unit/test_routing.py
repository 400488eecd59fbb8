"""The proxy's routing core, pure: health state machine, the routing choice, the cache index and the event decoder.

The events here are built as vLLM's msgspec encoder lays them out (``[ts, [{"type": ..., ...}], dp_rank]``,
checked against vLLM's own structs in test_kv_events_vllm.py).
"""

from __future__ import annotations

import msgspec
import pytest

from vllm_kvp2p.proxy.block_hashes import HashSettingsError, make_hasher
from vllm_kvp2p.proxy.cache_index import Applied, Dropped, InstanceCache, Replay
from vllm_kvp2p.proxy.health import MAX_BACKOFF_S, Health, InstanceHealth
from vllm_kvp2p.proxy.instances import InstancePool, PromptBlocks
from vllm_kvp2p.proxy.kv_events import (
    MAX_EVENTS,
    MAX_HASHES,
    MAX_PAYLOAD_BYTES,
    AllCleared,
    BadEvents,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    block_key,
    decode_batch,
    decode_message,
)
from vllm_kvp2p.proxy.routing import Candidate, Policy, choose

HASHER = make_hasher()
BS = 4


def stored_event(tokens: list[int], parent: bytes | None = None, **extra: object) -> dict[str, object]:
    """A BlockStored event of ``tokens`` (whole blocks), its hashes as vLLM computes them."""
    hashes, p = [], parent
    for b in range(len(tokens) // BS):
        p = HASHER._hash((p or HASHER._none_hash, tuple(tokens[b * BS : (b + 1) * BS]), None))
        hashes.append(p)
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


def payload(*events: dict[str, object], dp: int | None = None) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), dp])


def batch(seq: int, *events: dict[str, object]) -> EventBatch:
    return decode_batch(seq, payload(*events))


def keys(tokens: list[int]) -> tuple[int, ...]:
    return HASHER.keys(tokens, BS)


# -- health --------------------------------------------------------------------------------------------------


def test_health_skips_after_one_failure_then_one_trial_then_up() -> None:
    h = InstanceHealth()
    assert h.usable(0.0)
    h.failed(10.0, "ConnectError: refused")
    assert h.state is Health.SKIPPED and not h.usable(10.5)
    assert h.usable(11.0)  # back-off of 1 s over: one trial
    h.chosen(11.0)
    assert h.state is Health.TRIAL and not h.usable(11.0)  # only one request finds out
    h.failed(11.2, "ConnectError: refused")  # still down: the back-off doubles
    assert not h.usable(13.1) and h.usable(13.2)
    h.chosen(13.2)
    h.succeeded()
    assert h.state is Health.UP and h.failures_in_a_row == 0 and h.failures == 2


def test_health_backoff_is_bounded_and_probes_bring_it_back() -> None:
    h = InstanceHealth()
    for i in range(40):
        h.failed(float(i), "timeout")
    assert h.retry_at - 39.0 == MAX_BACKOFF_S
    h.probed(40.0, ok=False, error="refused")
    assert h.state is Health.SKIPPED and h.retry_at >= 41.0
    h.probed(41.0, ok=True)
    assert h.usable(41.0)
    # A trial abandoned by its client leaves the door open for the next request.
    h.failed(50.0, "reset")
    h.chosen(51.0)
    h.abandoned(51.5)
    assert h.usable(51.5)
    assert h.snapshot(51.5)["state"] == "skipped"


# -- routing ---------------------------------------------------------------------------------------------------


def cand(outstanding: int = 0, pending: int = 0, cached: int = 0, usable: bool = True, retry: float = 0.0) -> Candidate:
    return Candidate(usable=usable, outstanding=outstanding, pending_tokens=pending, cached_tokens=cached,
                     retry_at=retry)


def test_prefix_aware_prefers_the_holder_until_its_queue_outweighs_the_prefix() -> None:
    c = [cand(), cand(cached=480)]
    assert choose(c, policy=Policy.PREFIX_AWARE, prompt_tokens=500) == 1
    # The holder has 400 tokens queued: 400 + 20 < 0 + 500, still the holder.
    assert choose([cand(), cand(pending=400, cached=480)], policy=Policy.PREFIX_AWARE, prompt_tokens=500) == 1
    # 600 queued: 620 > 500, the hot prefix spills to the other instance.
    assert choose([cand(), cand(pending=600, cached=480)], policy=Policy.PREFIX_AWARE, prompt_tokens=500) == 0
    # prefix_weight 0: least pending tokens, the cache ignored.
    assert choose(c[::-1], policy=Policy.PREFIX_AWARE, prompt_tokens=500, prefix_weight=0, cursor=1) == 1
    # Unknown prompt: least outstanding.
    assert choose([cand(outstanding=2, cached=480), cand(outstanding=1)], policy=Policy.PREFIX_AWARE,
                  prompt_tokens=None) == 1
    # least-outstanding ignores the cache.
    assert choose([cand(outstanding=1, cached=480), cand()], policy=Policy.LEAST_OUTSTANDING, prompt_tokens=500) == 1


def test_ties_round_robin_skipped_left_out_and_all_skipped_tries_the_soonest() -> None:
    idle = [cand(), cand(), cand()]
    assert [choose(idle, policy=Policy.PREFIX_AWARE, prompt_tokens=10, cursor=k) for k in range(4)] == [0, 1, 2, 0]
    # The holder is skipped: the next best usable one.
    c = [cand(cached=480, usable=False, retry=5.0), cand(outstanding=3), cand(outstanding=1)]
    assert choose(c, policy=Policy.PREFIX_AWARE, prompt_tokens=500) == 2
    # Everything skipped: the one back soonest, never a refusal.
    down = [cand(usable=False, retry=9.0), cand(usable=False, retry=3.0), cand(usable=False, retry=3.0)]
    assert choose(down, policy=Policy.PREFIX_AWARE, prompt_tokens=500, cursor=2) == 2
    # exclude (the retry after a lost prefill) unless alone.
    assert choose([cand(cached=480), cand()], policy=Policy.PREFIX_AWARE, prompt_tokens=500, exclude=0) == 1
    assert choose([cand()], policy=Policy.PREFIX_AWARE, prompt_tokens=500, exclude=0) == 0
    with pytest.raises(ValueError):
        choose([], policy=Policy.PREFIX_AWARE, prompt_tokens=1)


# -- cache index -----------------------------------------------------------------------------------------------


def test_index_follows_stores_removes_and_clears() -> None:
    cache = InstanceCache()
    prompt = list(range(12))
    assert cache.apply(batch(0, stored_event(prompt))) == Applied(3, 0)
    assert cache.cached_blocks(keys(prompt)) == 3 and cache.block_size == BS
    assert cache.cached_blocks(keys(prompt + [99] * 8)) == 3  # a longer prompt: its prefix
    assert cache.cached_blocks(keys([7] + prompt[1:])) == 0  # the first block differs: no prefix at all
    second = keys(prompt)[1]
    assert cache.apply(batch(1, {"type": "BlockRemoved", "block_hashes": [second], "medium": "GPU"})) == Applied(0, 1)
    assert cache.cached_blocks(keys(prompt)) == 1  # a hole ends the prefix
    assert cache.apply(batch(2, {"type": "AllBlocksCleared"})) == Applied(0, 2)
    assert len(cache) == 0
    # Offloaded tiers do not answer a prompt on the device: ignored.
    cache.apply(batch(3, stored_event(prompt, medium="CPU")))
    assert len(cache) == 0


def test_index_gap_asks_replay_and_replay_fills_it() -> None:
    cache = InstanceCache()
    a, b, c = list(range(4)), list(range(100, 104)), list(range(200, 204))
    cache.apply(batch(0, stored_event(a)))
    live = batch(2, stored_event(c))
    assert cache.apply(live) == Replay(1)
    assert cache.gaps == 1 and cache.last_seq == 0  # nothing applied out of order
    # The replay returns 1 and 2; the live 2 comes again after it: applied once.
    cache.replayed([batch(1, stored_event(b)), batch(2, stored_event(c)), live], 1)
    assert cache.last_seq == 2 and all(cache.cached_blocks(keys(t)) == 1 for t in (a, b, c))
    assert isinstance(cache.apply(batch(2, stored_event(c))), Dropped)  # queued live duplicate
    assert cache.apply(batch(3, stored_event(list(range(300, 304))))) == Applied(1, 0)
    assert cache.resets == 0


def test_index_replay_that_cannot_reach_back_restarts_and_a_restarted_engine_resets() -> None:
    cache = InstanceCache()
    a, b = list(range(4)), list(range(100, 104))
    cache.apply(batch(5, stored_event(a)))
    assert cache.apply(batch(9, stored_event(b))) == Replay(6)
    cache.replayed([batch(8, stored_event(b))], 6)  # the buffer starts at 8: 6 and 7 are lost
    assert cache.resets == 1 and cache.cached_blocks(keys(a)) == 0 and cache.cached_blocks(keys(b)) == 1
    cache.apply(batch(9, stored_event(list(range(50, 54)))))
    cache.apply(batch(10, stored_event(list(range(60, 64)))))
    # The engine restarted: its counter begins again at 0 with an empty cache.
    assert cache.apply(batch(0, stored_event(a))) == Applied(1, 0)
    assert cache.resets == 2 and len(cache) == 1 and cache.cached_blocks(keys(a)) == 1


def test_index_is_bounded_oldest_first() -> None:
    cache = InstanceCache(max_blocks=3)
    prompts = [list(range(i * 10, i * 10 + 4)) for i in range(5)]
    for seq, p in enumerate(prompts):
        cache.apply(batch(seq, stored_event(p)))
    assert len(cache) == 3
    assert [cache.cached_blocks(keys(p)) for p in prompts] == [0, 0, 1, 1, 1]
    with pytest.raises(ValueError):
        InstanceCache(max_blocks=0)


# -- decoding: hostile and broken input ------------------------------------------------------------------------


def test_decode_reads_vllm_layout_and_int_hashes() -> None:
    ev = stored_event(list(range(8)))
    got = decode_message([b"", (7).to_bytes(8, "big"), payload(ev, dp=1)])
    assert got.seq == 7 and got.data_parallel_rank == 1
    (stored,) = got.events
    assert isinstance(stored, BlocksStored) and stored.keys == keys(list(range(8))) and not stored.has_extra_keys
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: 64-bit ints, the same keys.
    as_int = {**ev, "block_hashes": [int.from_bytes(h, "big") & (2**64 - 1) for h in ev["block_hashes"]]}
    assert decode_batch(0, payload(as_int)).events[0].keys == stored.keys
    removed = decode_batch(0, payload({"type": "BlockRemoved", "block_hashes": [b"x" * 32], "medium": None}))
    assert removed.events == (BlocksRemoved((block_key(b"x" * 32),), None, None),)
    assert decode_batch(0, payload({"type": "AllBlocksCleared"})).events == (AllCleared(),)
    # A LoRA / salted / multimodal block says so: its hashes are not the proxy's.
    assert decode_batch(0, payload(stored_event(list(range(4)), lora_name="ad"))).events[0].has_extra_keys
    assert decode_batch(0, payload(stored_event(list(range(4)), extra_keys=[("salt",)]))).events[0].has_extra_keys
    # vLLM 0.23's array layout: ["BlockStored", field, ...] in field order; trailing fields of newer ones ignored.
    array = [["BlockStored", ev["block_hashes"], None, list(range(8)), BS, None, "GPU", None, None, None, "x"],
             ["BlockRemoved", [b"x" * 32], "GPU"], ["AllBlocksCleared"], ["BlockPinned", 1]]
    old = decode_batch(3, msgspec.msgpack.encode([1.0, array]))
    assert old.events == (stored, BlocksRemoved((block_key(b"x" * 32),), "GPU", None), AllCleared())
    assert old.unknown == 1
    # New event types of a newer vLLM are skipped and counted, the rest kept.
    mixed = decode_batch(0, payload({"type": "BlockPinned", "x": 1}, ev))
    assert mixed.unknown == 1 and len(mixed.events) == 1


@pytest.mark.parametrize(
    "frames",
    [
        [b"garbage"],
        [b"", b"\x00" * 7, payload()],
        [b"", (1).to_bytes(8, "big"), b"\xc1\xff not msgpack"],
        [b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode({"ts": 1})],
        [b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, "events", None])],
        [b"", (1).to_bytes(8, "big"), payload({"type": "BlockStored", "block_hashes": "x"})],
        [b"", (1).to_bytes(8, "big"), payload({**stored_event(list(range(4))), "block_hashes": []})],
        [b"", (1).to_bytes(8, "big"), payload({**stored_event(list(range(4))), "block_size": -1})],
        [b"", (1).to_bytes(8, "big"), payload({**stored_event(list(range(4))), "block_size": 2**40})],
        [b"", (1).to_bytes(8, "big"), payload({"no": "type"})],
        [b"", (1).to_bytes(8, "big"), b"\x00" * (MAX_PAYLOAD_BYTES + 1)],
        [b"", (1).to_bytes(8, "big"), payload(*[{"type": "AllBlocksCleared"}] * (MAX_EVENTS + 1))],
        [b"", (1).to_bytes(8, "big"),
         payload({"type": "BlockRemoved", "block_hashes": [1] * (MAX_HASHES + 1), "medium": None})],
        [b"", (1).to_bytes(8, "big"),
         payload({"type": "BlockRemoved", "block_hashes": [-1.5], "medium": None})],
    ],
    ids=["one-frame", "short-seq", "not-msgpack", "map", "events-not-list", "hashes-not-list", "no-hashes",
         "negative-block-size", "huge-block-size", "untagged", "oversized", "too-many-events", "too-many-hashes",
         "float-hash"],
)
def test_decode_refuses_hostile_messages_with_one_error(frames: list[bytes]) -> None:
    with pytest.raises(BadEvents) as err:
        decode_message(frames)
    assert len(str(err.value)) < 500


# -- hashes ----------------------------------------------------------------------------------------------------


def test_hasher_checks_itself_against_engine_events() -> None:
    prompt = list(range(8))
    first = decode_batch(0, payload(stored_event(prompt))).events[0]
    assert HASHER.check(first) is True
    assert make_hasher(seed="42").check(first) is False  # another seed: never routes by it
    assert make_hasher("sha256_cbor").check(first) is False
    # A block with a parent checks nothing about the seed; an extra-keys block nothing at all.
    child = decode_batch(0, payload(stored_event([9, 9, 9, 9], parent=b"p" * 32))).events[0]
    assert HASHER.check(child) is None
    with pytest.raises(HashSettingsError, match="PYTHONHASHSEED"):
        make_hasher("xxhash")
    with pytest.raises(HashSettingsError, match="known are"):
        make_hasher("md5")
    assert HASHER.keys(list(range(7)), BS) == keys(list(range(4)))  # only full blocks


# -- the pool: records, choice, health and the cache together --------------------------------------------------


def test_pool_routes_to_the_verified_holder_and_accounts_work() -> None:
    now = [100.0]
    pool = InstancePool(["a", "b"], policy=Policy.PREFIX_AWARE, events=[("tcp://a", None), ("tcp://b", None)],
                        clock=lambda: now[0])
    prompt = list(range(16))
    event = decode_batch(0, payload(stored_event(prompt))).events[0]
    b = pool.get("b")
    b.cache.apply(EventBatch(0, 1.0, (event,), None))
    blocks = PromptBlocks(prompt + [1, 2], HASHER)
    # Until b's hashes are checked the index is not trusted: plain least pending, round robin.
    assert pool.acquire(prompt=blocks).url == "a"
    pool.release(pool.acquire(prompt=blocks))  # b, by round robin
    pool.check_hashes(b, event, HASHER)
    lease = pool.acquire(prompt=blocks)
    assert (lease.url, lease.cached_tokens, lease.work_tokens) == ("b", 16, 2)
    assert b.pending_tokens == 2 and b.prefix_hits == 1 and b.hit_tokens == 16
    pool.release(lease)
    pool.release(lease)  # a double release cannot go negative
    assert b.outstanding == 0 and b.pending_tokens == 0
    # b unreachable: skipped at once, and its index forgotten (it may come back empty).
    pool.unreachable("b", "ConnectError")
    assert pool.acquire(prompt=blocks).url == "a" and len(b.cache) == 0
    now[0] += 1.0
    pool.probed("b", ok=True)
    assert pool.snapshot()[1]["state"] == "up"
    # A mismatching event turns the index off for good.
    pool.check_hashes(b, decode_batch(0, payload({**stored_event(prompt), "block_hashes": [b"z" * 32] * 4})).events[0],
                      HASHER)
    assert b.hashes_match is False and b.cached_tokens(blocks) == 0
    with pytest.raises(ValueError, match="one per instance"):
        InstancePool(["a", "b"], events=[None])
