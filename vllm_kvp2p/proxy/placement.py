"""Where each request runs: between the proxy's request flow and :func:`disaggregation.decide`.

The proxy's instances come in one of three shapes: dedicated P and D (``--prefill``/``--decode``), instances that
may be either (``--kv-both``: one pool, each started with ``kv_role`` ``kv_both``), or ordinary instances
(``--instances``: no P step at all). :class:`Placer` turns the ``--disaggregate`` mode into a :class:`Placement`
per request: for ``auto`` by asking :func:`~vllm_kvp2p.proxy.disaggregation.decide` with every instance's load
(:class:`~vllm_kvp2p.proxy.cost_model.InstanceWork`, its cache, its health), for ``always`` and ``never`` by the
pools' own routing as before. It keeps each instance's work current as the flow reports what happened (a prefill
ended, a stream's first and last token) and feeds the same observations to the
:class:`~vllm_kvp2p.proxy.cost_model.Calibration`. It counts every placement by path and reason (``/health``).

Everything here runs on the proxy's event loop; the pools' locks keep each pool's records whole.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_kvp2p.proxy.cost_model import Calibration
from vllm_kvp2p.proxy.disaggregation import DEFAULT_THRESHOLD_TOKENS, Mode, Objectives, decide
from vllm_kvp2p.proxy.instances import Instance, InstancePool, Lease, PromptBlocks
from vllm_kvp2p.proxy.pairing import PairingKey, mismatch

logger = logging.getLogger("vllm_kvp2p.proxy")


@dataclass
class Placement:
    """One request's place: who prefills (``prefill``: P's lease, ``None`` for D itself) and who decodes."""

    path: str  # "pd" or "local"
    reason: str
    prefill: Lease | None
    #: D's lease; ``None`` until D is chosen (``always`` chooses D after P answered, as the proxy always did).
    decode: Lease | None
    placed_ms: float
    #: The prompt tokens the instance that prefills had to compute, and the tokens queued there with them.
    prefill_tokens: int = 0
    tokens_ahead: int = 0
    #: D's counter of prefill tokens assigned, when D was chosen (what D prefilled while this one decoded).
    decode_assigned_at: int = 0
    prefill_open: bool = False
    #: The requests decoding on D when this one's first token came (the batch its decode steps ran at).
    decodes_at_first_token: int = 1
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None


@dataclass
class StreamTimes:
    """When a relayed stream's first and last events came, and how many token events it carried."""

    asked_ms: float
    first_ms: float | None = None
    last_ms: float | None = None
    events: int = 0

    def saw(self, chunk: bytes, now_ms: float) -> None:
        n = chunk.count(b"data: ") - chunk.count(b"data: [DONE]")
        if n <= 0:
            return
        if self.first_ms is None:
            self.first_ms = now_ms
            n -= 1
        self.events += n
        self.last_ms = now_ms


@dataclass
class Placer:
    """The ``--disaggregate`` mode carried out over the proxy's pools (module doc)."""

    prefill: InstancePool | None
    decode: InstancePool
    mode: Mode
    objectives: Objectives | None = None
    threshold: int = DEFAULT_THRESHOLD_TOKENS
    calibration: Calibration = field(default_factory=Calibration)
    clock: Callable[[], float] = time.monotonic
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    _cursor: int = 0
    #: The pairs never formed because the two cannot exchange KV (pairing.py), each logged once.
    _unpaired: dict[tuple[str, str], str] = field(default_factory=dict)
    _verdicts: dict[tuple[PairingKey, PairingKey], str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prefill is None and self.mode is not Mode.NEVER:
            raise ValueError(f"--disaggregate {self.mode.value} needs instances that prefill for others "
                             "(--prefill or --kv-both)")

    @property
    def kv_both(self) -> bool:
        return self.prefill is self.decode

    def _now_ms(self) -> float:
        return self.clock() * 1000.0

    def _roles(self) -> list[tuple[InstancePool, Instance, bool, bool]]:
        """Every instance once, with whether it may prefill for others and whether it may decode."""
        if self.prefill is None:
            return [(self.decode, i, False, True) for i in self.decode.instances]
        if self.kv_both:
            return [(self.decode, i, True, True) for i in self.decode.instances]
        return [*((self.prefill, i, True, False) for i in self.prefill.instances),
                *((self.decode, i, False, True) for i in self.decode.instances)]

    # -- pairs -----------------------------------------------------------------------------------------------

    def pairable(self, p: Instance, d: Instance) -> bool:
        """Whether ``p`` may prefill for ``d``: not when their keys say they cannot exchange KV (logged once per
        pair); yes while either key is unknown (D's own check then refuses a bad pair per request)."""
        if p is d or p.pairing is None or d.pairing is None:
            return True
        verdict_key = (p.pairing, d.pairing)
        if verdict_key not in self._verdicts:
            if len(self._verdicts) >= 4096:
                self._verdicts.clear()
            self._verdicts[verdict_key] = mismatch(p.pairing, d.pairing)
        reason = self._verdicts[verdict_key]
        if reason is None:
            return True
        if self._unpaired.get((p.url, d.url)) != reason and len(self._unpaired) < 4096:
            self._unpaired[p.url, d.url] = reason
            logger.warning("never pairing prefill instance %s with decode instance %s: they cannot exchange KV: %s",
                           p.url, d.url, reason)
        return False

    def _pairing_with(self, pool: InstancePool, other: Instance, *, other_prefills: bool) -> list[str] | None:
        """The urls of ``pool`` that pair with ``other`` (None: no restriction, when every one does)."""
        urls = [i.url for i in pool.instances
                if i is not other and (self.pairable(other, i) if other_prefills else self.pairable(i, other))]
        return None if len(urls) == len(pool.instances) else urls

    # -- placing ---------------------------------------------------------------------------------------------

    def place(self, prompt: PromptBlocks | None, objectives: Objectives | None = None) -> Placement:
        """Where the request of ``prompt`` runs; ``objectives`` (the request's own) replace ``--slo`` for it."""
        now = self._now_ms()
        if self.mode is Mode.NEVER:
            d = self.decode.acquire(prompt=prompt)
            return self._placed(Placement("local", "mode_never", None, d, now), prompt)
        if self.mode is Mode.ALWAYS:
            assert self.prefill is not None
            # Only a P that can prefill for some D (when any can: otherwise D's check says why, per request).
            useful = [i.url for i in self.prefill.instances
                      if any(d is not i and self.pairable(i, d) for d in self.decode.instances)]
            if not useful:  # every pair is known not to work: D computes the prompt (an ordinary request)
                d = self.decode.acquire(prompt=prompt)
                return self._placed(Placement("local", "no_prefill_instance", None, d, now), prompt)
            p = self.prefill.acquire(prompt=prompt, among=useful)
            return self._placed(Placement("pd", "mode_always", p, None, now), prompt)
        roles = self._roles()
        cost = self.calibration.model()
        loads = [inst.work.load(cost, now, usable=inst.health.usable(self.clock()), can_prefill_for_others=cp,
                                can_decode=cd, cached_tokens=inst.cached_tokens(prompt), outstanding=inst.outstanding,
                                retry_at=inst.health.retry_at)
                 for _, inst, cp, cd in roles]
        decision = decide(loads, prompt_tokens=None if prompt is None else prompt.num_tokens, cost=cost,
                          objectives=objectives or self.objectives, threshold=self.threshold, cursor=self._cursor,
                          pairs=lambda p, d: self.pairable(roles[p][1], roles[d][1]))
        self._cursor = (decision.decode + 1) % len(roles)
        d_pool, d_inst, _, _ = roles[decision.decode]
        d = d_pool.acquire_at(d_inst.url, prompt)
        p = None
        if decision.prefill is not None:
            p_pool, p_inst, _, _ = roles[decision.prefill]
            p = p_pool.acquire_at(p_inst.url, prompt)
        placement = Placement(decision.path, decision.reason, p, d, now, predicted_ttft_ms=decision.ttft_ms,
                              predicted_tpot_ms=decision.tpot_ms)
        return self._placed(placement, prompt)

    def _placed(self, placement: Placement, prompt: PromptBlocks | None) -> Placement:
        self.counts[placement.path, placement.reason] += 1
        window = self.calibration.share_window_ms
        computes = placement.prefill or placement.decode  # whoever computes the prompt
        if computes is not None:
            work = self._instance(computes).work
            work.prefill_placed(computes.work_tokens, placement.placed_ms, window)
            placement.prefill_tokens, placement.tokens_ahead = computes.work_tokens, work.queued_tokens
            placement.prefill_open = True
        if placement.decode is not None:
            self._decode_chosen(placement, placement.decode)
        return placement

    def _decode_chosen(self, placement: Placement, lease: Lease) -> None:
        work = self._instance(lease).work
        work.decodes += 1
        placement.decode_assigned_at = work.assigned_tokens

    def lease_decode(self, placement: Placement, prompt: PromptBlocks | None) -> Lease:
        """``always``: D chosen after P answered, by the decode pool's routing, among the instances that pair with
        P (never P itself)."""
        if placement.decode is None:
            assert placement.prefill is not None and self.prefill is not None
            p = self._instance(placement.prefill)
            among = self._pairing_with(self.decode, p, other_prefills=True)
            lease = self.decode.acquire(prompt=prompt, exclude=p.url if self.kv_both else None, among=among or None)
            placement.decode = lease
            self._decode_chosen(placement, lease)
        return placement.decode

    def retry_prefill(self, placement: Placement, prompt: PromptBlocks | None) -> Lease:
        """P went away before answering: another P for the one retry, by the prefill pool's routing, never the
        instance that went away nor D (a ``kv_both`` instance does not pull from itself), and one that pairs with D
        when D is chosen already."""
        assert placement.prefill is not None and self.prefill is not None
        gone = placement.prefill.url
        d = None if placement.decode is None else self._instance(placement.decode)
        among = [i.url for i in self.prefill.instances
                 if i.url != gone and (d is None or (i is not d and self.pairable(i, d)))]
        lease = self.prefill.acquire(exclude=gone, prompt=prompt, among=among or None)
        self._prefill_moved(placement, lease)
        return lease

    def _prefill_moved(self, placement: Placement, lease: Lease) -> None:
        """The prefill is retried on ``lease``'s instance."""
        self._end_prefill(placement)
        placement.prefill = lease
        work = self._instance(lease).work
        work.prefill_placed(lease.work_tokens, self._now_ms(), self.calibration.share_window_ms)
        placement.prefill_tokens, placement.tokens_ahead = lease.work_tokens, work.queued_tokens
        placement.prefill_open = True
        placement.placed_ms = self._now_ms()

    # -- what happened ---------------------------------------------------------------------------------------

    def prefill_answered(self, placement: Placement) -> None:
        """P answered: its prefill ended, and took this long."""
        if placement.prefill_open:
            self.calibration.prefill_took(placement.tokens_ahead, self._now_ms() - placement.placed_ms)
        self._end_prefill(placement)

    def stream_ended(self, placement: Placement, times: StreamTimes) -> None:
        """A relayed stream closed: a P/D stream's first token measured the hop; its later tokens measure a decode
        step at the batch D ran when its first token came."""
        if times.first_ms is not None and placement.path == "pd":
            self.calibration.hop_took(times.first_ms - times.asked_ms)
        if times.first_ms is not None and times.last_ms is not None and times.events >= 1 and placement.decode:
            work = self._instance(placement.decode).work
            work.tpot_seen(times.last_ms, (times.last_ms - times.first_ms) / times.events)
            meanwhile = max(0, work.assigned_tokens - placement.decode_assigned_at)
            cost = self.calibration.model()
            self.calibration.decode_took(placement.decodes_at_first_token, times.events,
                                         times.last_ms - times.first_ms, meanwhile * cost.prefill_ms_per_token)

    def first_token(self, placement: Placement) -> None:
        """D's first token: a local request's prompt is computed (and that took this long)."""
        if placement.path == "local" and placement.prefill_open:
            self.calibration.prefill_took(placement.tokens_ahead, self._now_ms() - placement.placed_ms)
        self._end_prefill(placement)
        if placement.decode is not None:
            work = self._instance(placement.decode).work
            placement.decodes_at_first_token = work.decodes
            placement.decode_assigned_at = work.assigned_tokens

    def done(self, placement: Placement) -> None:
        """The request left the proxy, however: nothing it was counted for stays counted."""
        self._end_prefill(placement)
        if placement.decode is not None:
            work = self._instance(placement.decode).work
            work.decodes = max(0, work.decodes - 1)

    def _end_prefill(self, placement: Placement) -> None:
        if placement.prefill_open:
            placement.prefill_open = False
            computes = placement.prefill or placement.decode
            if computes is not None:
                self._instance(computes).work.prefill_ended(placement.prefill_tokens)

    def _instance(self, lease: Lease) -> Instance:
        pool = self.decode if self.prefill is None or lease.url in self.decode.urls else self.prefill
        return pool.get(lease.url)

    def snapshot(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "kv_both": self.kv_both,
            "objectives": None if self.objectives is None else str(self.objectives),
            "threshold_tokens": self.threshold,
            "decisions": {f"{path}/{reason}": n for (path, reason), n in sorted(self.counts.items())},
            "unpaired": [{"prefill": p, "decode": d, "reason": r} for (p, d), r in sorted(self._unpaired.items())],
            "cost_model": self.calibration.snapshot(),
        }
