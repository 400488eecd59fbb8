"""The proxy's instances: one record per instance, and the pool of one role that routes among them.

An :class:`Instance` holds all the proxy knows of one P or D: requests in flight and their uncached prompt tokens,
requests served, its health (:mod:`health`), its prefix cache as its KV events tell it (:mod:`cache_index`) and
whether the proxy's block hashes match its own. :class:`InstancePool` asks :func:`routing.choose` which one gets a
request and keeps the records current; it does no I/O (the app and the event feed deliver what happened).

Every :meth:`InstancePool.acquire` must be paired with exactly one :meth:`InstancePool.release` of the returned
:class:`Lease` (or use :meth:`InstancePool.lease`), otherwise the instance looks busier than it is forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from vllm_kvp2p.contract.pairing_key import PairingKey
from vllm_kvp2p.proxy.block_hashes import PromptHasher
from vllm_kvp2p.proxy.cache_index import DEFAULT_MAX_BLOCKS, InstanceCache
from vllm_kvp2p.proxy.cost_model import InstanceWork
from vllm_kvp2p.proxy.health import InstanceHealth
from vllm_kvp2p.proxy.kv_events import BlockKey, BlocksStored
from vllm_kvp2p.proxy.routing import Candidate, Policy, choose


@dataclass
class Instance:
    """Everything the proxy knows of one instance."""

    url: str
    #: ZMQ endpoints of its KV-event publisher and replay socket (``None``: no events, no cache index).
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    outstanding: int = 0
    pending_tokens: int = 0
    served: int = 0
    #: Requests routed here for a prefix it held, and the prompt tokens those hits covered.
    prefix_hits: int = 0
    hit_tokens: int = 0
    health: InstanceHealth = field(default_factory=InstanceHealth)
    cache: InstanceCache = field(default_factory=InstanceCache)
    #: Do the proxy's block hashes equal this instance's? None until one of its events could tell.
    hashes_match: bool | None = None
    #: The prefill work and decodes the proxy placed here (``--disaggregate auto`` decides from it).
    work: InstanceWork = field(default_factory=InstanceWork)
    #: What decides whether it can exchange KV with another instance, from its ``/metrics`` (None: not known yet,
    #: or it does not say; then D's own check decides, vllm_kvp2p/proxy/pairing.py).
    pairing: PairingKey | None = None

    def cached_tokens(self, prompt: PromptBlocks | None) -> int:
        """Leading prompt tokens this instance holds, as far as the proxy can trust its index."""
        size = self.cache.block_size
        if prompt is None or not self.hashes_match or size is None:
            return 0
        return self.cache.cached_blocks(prompt.keys_for(size)) * size

    def snapshot(self, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "url": self.url,
            "outstanding": self.outstanding,
            "pending_tokens": self.pending_tokens,
            "served": self.served,
            "prefix_hits": self.prefix_hits,
            "hit_tokens": self.hit_tokens,
            **self.work.snapshot(),
            "pairing": None if self.pairing is None else self.pairing.labels(),
            **self.health.snapshot(now),
        }
        if self.events_endpoint is not None:
            out["cache"] = {**self.cache.snapshot(), "hashes_match": self.hashes_match}
        return out


@dataclass
class PromptBlocks:
    """A prompt's token count and its block keys, computed once per block size the instances use."""

    tokens: Sequence[int]
    hasher: PromptHasher
    _keys: dict[int, tuple[BlockKey, ...]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def keys_for(self, block_size: int) -> tuple[BlockKey, ...]:
        keys = self._keys.get(block_size)
        if keys is None:
            keys = self._keys[block_size] = self.hasher.keys(self.tokens, block_size)
        return keys


@dataclass(frozen=True)
class Lease:
    """One request's place on an instance: what :meth:`InstancePool.release` takes back."""

    url: str
    work_tokens: int
    cached_tokens: int


class InstancePool:
    """The instances of one role (all P, or all D) and the routing among them."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        policy: Policy = Policy.LEAST_OUTSTANDING,
        prefix_weight: float = 1.0,
        events: Sequence[tuple[str, str | None] | None] | None = None,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not urls:
            raise ValueError("an instance pool needs at least one instance")
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate instance urls: {list(urls)}")
        if events is not None and len(events) != len(urls):
            raise ValueError(f"{len(events)} KV-event endpoints for {len(urls)} instances: give one per instance")
        self.instances: tuple[Instance, ...] = tuple(
            Instance(
                url,
                events_endpoint=None if events is None or events[i] is None else events[i][0],  # type: ignore[index]
                replay_endpoint=None if events is None or events[i] is None else events[i][1],  # type: ignore[index]
                cache=InstanceCache(max_blocks),
            )
            for i, url in enumerate(urls)
        )
        self._by_url = {inst.url: inst for inst in self.instances}
        self.policy = policy
        self.prefix_weight = prefix_weight
        self._clock = clock
        self._cursor = 0
        self._lock = threading.Lock()

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(inst.url for inst in self.instances)

    def get(self, url: str) -> Instance:
        return self._by_url[url]

    def acquire(self, exclude: str | None = None, prompt: PromptBlocks | None = None,
                among: Collection[str] | None = None) -> Lease:
        """Choose an instance for a request and count it there. ``exclude`` (a url) is avoided unless alone;
        ``among`` (urls, not empty) restricts the choice to those."""
        with self._lock:
            now = self._clock()
            skip = None if exclude is None else self.instances.index(self._by_url[exclude])
            allowed = None if among is None else {i for i, inst in enumerate(self.instances) if inst.url in among}
            cached = [inst.cached_tokens(prompt) for inst in self.instances]
            candidates = [
                Candidate(
                    usable=inst.health.usable(now),
                    outstanding=inst.outstanding,
                    pending_tokens=inst.pending_tokens,
                    cached_tokens=cached[i],
                    retry_at=inst.health.retry_at,
                )
                for i, inst in enumerate(self.instances)
            ]
            i = choose(
                candidates,
                policy=self.policy,
                prompt_tokens=None if prompt is None else prompt.num_tokens,
                prefix_weight=self.prefix_weight,
                cursor=self._cursor,
                exclude=skip,
                among=allowed or None,
            )
            return self._lease(i, cached[i], prompt, now)

    def acquire_at(self, url: str, prompt: PromptBlocks | None = None) -> Lease:
        """Count a request on the instance at ``url``, chosen elsewhere (:mod:`placement`)."""
        with self._lock:
            inst = self._by_url[url]
            return self._lease(self.instances.index(inst), inst.cached_tokens(prompt), prompt, self._clock())

    def _lease(self, i: int, cached: int, prompt: PromptBlocks | None, now: float) -> Lease:
        inst = self.instances[i]
        work = 0 if prompt is None else max(0, prompt.num_tokens - cached)
        inst.outstanding += 1
        inst.pending_tokens += work
        inst.served += 1
        if cached:
            inst.prefix_hits += 1
            inst.hit_tokens += cached
        inst.health.chosen(now)
        self._cursor = (i + 1) % len(self.instances)
        return Lease(inst.url, work, cached)

    def release(self, lease: Lease) -> None:
        """The request left the instance (never below zero, so a double release cannot go negative)."""
        with self._lock:
            inst = self._by_url[lease.url]
            inst.outstanding = max(0, inst.outstanding - 1)
            inst.pending_tokens = max(0, inst.pending_tokens - lease.work_tokens)

    @contextmanager
    def lease(self) -> Iterator[Lease]:
        """``with pool.lease() as lease:`` acquire for the duration of the block, release whatever happens."""
        lease = self.acquire()
        try:
            yield lease
        finally:
            self.release(lease)

    # -- what happened ---------------------------------------------------------------------------------------

    def answered(self, url: str) -> None:
        with self._lock:
            self._by_url[url].health.succeeded()

    def unreachable(self, url: str, error: str) -> None:
        """A transport failure (refused, reset, timed out): skip it, and forget its cache (it may restart empty)."""
        with self._lock:
            inst = self._by_url[url]
            inst.health.failed(self._clock(), error)
            inst.cache.reset()

    def abandoned(self, url: str) -> None:
        with self._lock:
            self._by_url[url].health.abandoned(self._clock())

    def probed(self, url: str, ok: bool, error: str | None = None) -> None:
        with self._lock:
            self._by_url[url].health.probed(self._clock(), ok, error)

    def check_hashes(self, inst: Instance, event: BlocksStored, hasher: PromptHasher) -> bool | None:
        """Compare the proxy's hashes with one of ``inst``'s stored events; a mismatch turns its index off."""
        verdict = hasher.check(event)
        if verdict is not None and inst.hashes_match is not False:
            inst.hashes_match = verdict
        return verdict

    def outstanding(self, url: str) -> int:
        return self._by_url[url].outstanding

    def snapshot(self) -> list[dict[str, Any]]:
        """Per instance: url, outstanding, served, health, and its cache index when it has one."""
        with self._lock:
            now = self._clock()
            return [inst.snapshot(now) for inst in self.instances]
