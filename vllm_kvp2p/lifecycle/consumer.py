"""D side: what happens to one request whose prompt KV lives on P. Pure: no sockets, threads, clocks or torch.

Two halves, one per vLLM process:

* :class:`ConsumerSchedule` (scheduler process) turns vLLM's admission calls into at most one :class:`PullPlan`
  per request. ``matched_tokens`` is pure (vLLM may ask many times); ``on_alloc`` and ``on_finished`` are the only
  places a plan is made, and each request gets exactly one, whatever the order and number of calls.
* :class:`ConsumerPull` (worker process, pull thread) drives one plan through
  ``registration -> claim -> read batches (renewing the lease) -> release -> finish``. The thread that owns it
  performs each returned action and feeds back the result, as an h11-style state machine.

The completion rule lives in one place, :attr:`PullPlan.awaiting`: vLLM parked the request in
``WAITING_FOR_REMOTE_KVS`` only when it asked for external tokens, and only then may the worker report the
receive finished (reporting it for a RUNNING request kills vLLM's scheduler). P is released in every outcome.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from vllm_kvp2p.protocol import Claim, ClaimReply, ClaimStatus, RankRegistration, Release, RemotePrefill, Renew
from vllm_kvp2p.transfer.descriptors import Descriptors, PlaneGeometry, build_descriptors

# --------------------------------------------------------------------------- scheduler half

# Test-only key of kv_transfer_params, see KVP2PConfig.test_hooks.
TEST_CORRUPT_KEY = "kvp2p_test_corrupt"


@dataclass(frozen=True)
class PullPlan:
    """What one D request needs from P; sent from D's scheduler to its workers."""

    request_id: str  # D's own request id
    remote: RemotePrefill
    local_block_ids: tuple[int, ...]  # D blocks to fill, in token order; empty: nothing to pull
    remote_block_ids: tuple[int, ...]  # P blocks holding the same tokens, one to one
    awaiting: bool  # vLLM waits for a finished receive (it asked for > 0 external tokens)
    error: str = ""  # the plan is already known to fail (the worker still releases P)
    test_corrupt: bool = False  # test hook (honoured only with the test_hooks setting): corrupt what was pulled

    @property
    def num_blocks(self) -> int:
        return len(self.local_block_ids)


class ConsumerSchedule:
    """Per-request pull decisions on D's scheduler."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._planned: set[str] = set()
        self._pending: list[PullPlan] = []

    def matched_tokens(
        self, request_id: str, params: dict[str, Any] | None, num_prompt_tokens: int, num_local_computed: int
    ) -> tuple[int, bool]:
        """Tokens D can load from P beyond its local prefix-cache hit. No side effects."""
        if request_id in self._planned or not params or not params.get("do_remote_prefill"):
            return 0, False
        remote = RemotePrefill.from_params(params)
        if remote is None:
            return 0, False
        count = min(remote.remote_num_tokens, num_prompt_tokens) - num_local_computed
        if count <= 0:
            return 0, False
        if num_local_computed > 0 and count < self.block_size:
            # D already caches all full blocks: computing the short tail is cheaper than a round trip to P.
            return 0, False
        return count, True

    def on_alloc(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        num_external_tokens: int,
        unhashed_block_ids: Sequence[int],
        num_local_computed: int,
    ) -> PullPlan | None:
        """vLLM allocated blocks for the request: plan the pull (or the release) exactly once."""
        if request_id in self._planned or not params or not params.get("do_remote_prefill"):
            return None
        remote = RemotePrefill.from_params(params)
        if remote is None:
            return None
        self._planned.add(request_id)
        if num_external_tokens <= 0:
            plan = PullPlan(request_id, remote, (), (), awaiting=False)
        else:
            plan = self._pull_plan(request_id, remote, tuple(unhashed_block_ids), num_local_computed)
            if params.get(TEST_CORRUPT_KEY):
                plan = dataclasses.replace(plan, test_corrupt=True)
        self._pending.append(plan)
        return plan

    def on_finished(self, request_id: str, params: dict[str, Any] | None) -> PullPlan | None:
        """vLLM is done with the request. One that never got blocks (rejected, aborted while waiting for
        admission) still releases P now instead of at P's hold timeout."""
        if request_id in self._planned:
            self._planned.discard(request_id)
            return None
        if not params or not params.get("do_remote_prefill"):
            return None
        remote = RemotePrefill.from_params(params)
        if remote is None:
            return None
        plan = PullPlan(request_id, remote, (), (), awaiting=False)
        self._pending.append(plan)
        return plan

    def is_planned(self, request_id: str) -> bool:
        return request_id in self._planned

    def take_plans(self) -> list[PullPlan]:
        plans, self._pending = self._pending, []
        return plans

    def _pull_plan(
        self, request_id: str, remote: RemotePrefill, local_ids: tuple[int, ...], num_local_computed: int
    ) -> PullPlan:
        if remote.remote_block_size != self.block_size:
            return PullPlan(
                request_id, remote, local_ids, (), awaiting=True,
                error=f"block size mismatch: P uses {remote.remote_block_size}, D uses {self.block_size}",
            )
        first = num_local_computed // self.block_size
        remote_ids = tuple(remote.remote_block_ids[first : first + len(local_ids)])
        if len(remote_ids) != len(local_ids) or not local_ids:
            return PullPlan(
                request_id, remote, local_ids, remote_ids, awaiting=True,
                error=f"P offers {len(remote.remote_block_ids)} blocks from block {first}, "
                f"D needs {len(local_ids)}",
            )
        return PullPlan(request_id, remote, local_ids, remote_ids, awaiting=True)


# --------------------------------------------------------------------------- worker half


@dataclass(frozen=True)
class Source:
    """One P rank a D rank reads from (several under heterogeneous TP)."""

    p_rank: int
    expected_readers: int = 1  # how many D readers this P rank should wait for


@dataclass(frozen=True)
class FetchRegistration:
    source: Source


@dataclass(frozen=True)
class SendClaim:
    source: Source
    message: Claim


@dataclass(frozen=True)
class Wait:
    until: float


@dataclass(frozen=True)
class ReadBatch:
    source: Source
    segment: str
    descriptors: Descriptors


@dataclass(frozen=True)
class SendRenew:
    source: Source
    message: Renew


@dataclass(frozen=True)
class SendRelease:
    source: Source
    message: Release


class Outcome(enum.Enum):
    PULLED = "pulled"
    FAILED = "failed"
    NOTHING_TO_PULL = "nothing_to_pull"


@dataclass(frozen=True)
class PullResult:
    request_id: str
    outcome: Outcome
    awaiting: bool
    local_block_ids: tuple[int, ...]
    num_blocks: int = 0
    num_bytes: int = 0
    num_descriptors: int = 0
    reason: str = ""

    @property
    def report_finished(self) -> bool:
        """Report the receive to vLLM only if vLLM is waiting for it (see the module docstring)."""
        return self.awaiting

    @property
    def report_failed(self) -> bool:
        return self.awaiting and self.outcome is Outcome.FAILED


@dataclass(frozen=True)
class Finish:
    result: PullResult


Action = Union[FetchRegistration, SendClaim, Wait, ReadBatch, SendRenew, SendRelease, Finish]


class _Phase(enum.Enum):
    REGISTRATION = 1
    CLAIM = 2
    READ = 3
    RELEASE = 4
    DONE = 5


@dataclass
class _SourceState:
    source: Source
    registration: RankRegistration | None = None
    claim_deadline: float = 0.0  # give up waiting for P to learn of the hold
    retry_at: float = 0.0
    renew_at: float = 0.0
    lease: float = 0.0
    batches: list[Descriptors] = field(default_factory=list)
    released: bool = False


class ConsumerPull:
    """One plan's pull on one D rank."""

    def __init__(
        self,
        plan: PullPlan,
        sources: Sequence[Source],
        reader: str,
        local_planes: Sequence[PlaneGeometry],
        local_block_size: int,
        *,
        claim_wait: float,
        max_batch_entries: int,
        now: float,
    ) -> None:
        self.plan = plan
        self.reader = reader
        self.local_planes = list(local_planes)
        self.local_block_size = local_block_size
        self.claim_wait = claim_wait
        self.max_batch_entries = max_batch_entries
        self._sources = [_SourceState(s, claim_deadline=now + claim_wait) for s in sources]
        self._index = 0
        self._bytes = 0
        self._descriptors = 0
        self._failure = plan.error
        nothing = not plan.local_block_ids or not plan.awaiting
        self._phase = _Phase.RELEASE if (nothing or self._failure) else _Phase.REGISTRATION
        self._result: PullResult | None = None

    @property
    def done(self) -> bool:
        return self._phase is _Phase.DONE

    # ------------------------------------------------------------------ driving

    def next_action(self, now: float) -> Action:
        if self._phase is _Phase.DONE:
            assert self._result is not None
            return Finish(self._result)
        if self._phase is _Phase.RELEASE:
            for st in self._sources:
                if not st.released:
                    return SendRelease(st.source, self._release(st.source))
            self._phase = _Phase.DONE
            self._result = self._make_result()
            return Finish(self._result)
        st = self._sources[self._index]
        if self._phase is _Phase.REGISTRATION:
            return FetchRegistration(st.source)
        if self._phase is _Phase.CLAIM:
            if now < st.retry_at:
                return Wait(st.retry_at)
            return SendClaim(st.source, self._claim(st.source))
        # READ
        if st.lease and now >= st.renew_at:
            return SendRenew(st.source, Renew(self.plan.remote.remote_request_id, self.plan.remote.remote_hold_id,
                                              self.reader))
        assert st.registration is not None
        return ReadBatch(st.source, st.registration.segment, st.batches[0])

    def on_registration(self, source: Source, registration: RankRegistration | None, error: str = "") -> None:
        st = self._current(source, _Phase.REGISTRATION)
        if st is None:
            return
        if registration is None:
            return self._fail(f"no registration from P rank {source.p_rank}: {error}")
        problem = self._incompatible(registration)
        if problem:
            return self._fail(problem)
        try:
            descriptors = build_descriptors(
                self.local_planes, registration.planes, self.plan.local_block_ids, self.plan.remote_block_ids
            )
        except ValueError as exc:
            return self._fail(f"cannot address blocks on P rank {source.p_rank}: {exc}")
        st.registration = registration
        st.batches = descriptors.batches(self.max_batch_entries) if len(descriptors) else []
        self._descriptors += len(descriptors)
        self._phase = _Phase.CLAIM

    def on_claim_reply(self, source: Source, reply: ClaimReply | None, now: float, error: str = "") -> None:
        st = self._current(source, _Phase.CLAIM)
        if st is None:
            return
        if reply is None:
            return self._fail(f"claim on P rank {source.p_rank} failed: {error}")
        if reply.status is ClaimStatus.GRANTED:
            st.lease = reply.lease
            st.renew_at = now + reply.lease / 3
            self._phase = _Phase.READ
            if not st.batches:
                self._next_source()
            return
        if reply.status is ClaimStatus.UNKNOWN and now < st.claim_deadline:
            st.retry_at = now + min(0.05, max(0.0, st.claim_deadline - now))
            return
        if reply.status is ClaimStatus.REFUSED:
            why = reply.reason
        else:
            why = f"P never learned of the hold in {self.claim_wait:g}s"
        self._fail(f"P rank {source.p_rank} refused the claim: {why}")

    def on_renewed(self, source: Source, reply: ClaimReply | None, now: float, error: str = "") -> None:
        st = self._current(source, _Phase.READ)
        if st is None:
            return
        if reply is None or reply.status is not ClaimStatus.GRANTED:
            reason = error if reply is None else reply.reason
            return self._fail(f"lease renewal on P rank {source.p_rank} failed: {reason}")
        st.renew_at = now + reply.lease / 3

    def on_batch_done(self, source: Source, ok: bool, error: str = "") -> None:
        st = self._current(source, _Phase.READ)
        if st is None:
            return
        if not ok:
            segment = st.registration.segment if st.registration else "?"
            return self._fail(f"read from P rank {source.p_rank} ({segment}) failed: {error}")
        batch = st.batches.pop(0)
        self._bytes += batch.total_bytes
        if not st.batches:
            self._next_source()

    def on_release_sent(self, source: Source) -> None:
        for st in self._sources:
            if st.source == source:
                st.released = True

    # ------------------------------------------------------------------ internals

    def _current(self, source: Source, phase: _Phase) -> _SourceState | None:
        if self._phase is not phase or self._sources[self._index].source != source:
            return None  # a stale result for a step we already left; ignore
        return self._sources[self._index]

    def _next_source(self) -> None:
        self._index += 1
        if self._index >= len(self._sources):
            self._phase = _Phase.RELEASE
        else:
            self._phase = _Phase.REGISTRATION

    def _fail(self, reason: str) -> None:
        self._failure = reason
        self._phase = _Phase.RELEASE

    def _claim(self, source: Source) -> Claim:
        r = self.plan.remote
        return Claim(r.remote_request_id, r.remote_hold_id, self.reader, source.expected_readers)

    def _release(self, source: Source) -> Release:
        r = self.plan.remote
        pulled = not self._failure and bool(self.plan.local_block_ids) and self.plan.awaiting
        return Release(r.remote_request_id, r.remote_hold_id, self.reader, source.expected_readers, pulled)

    def _incompatible(self, reg: RankRegistration) -> str:
        r = self.plan.remote
        if reg.engine_id != r.remote_engine_id:
            return f"P side channel answers for engine {reg.engine_id}, params name engine {r.remote_engine_id}"
        if reg.block_size != self.local_block_size:
            return f"block size mismatch: P uses {reg.block_size}, D uses {self.local_block_size}"
        if len(reg.planes) != len(self.local_planes):
            return f"layer layout mismatch: P has {len(reg.planes)} KV planes, D has {len(self.local_planes)}"
        return ""

    def _make_result(self) -> PullResult:
        plan = self.plan
        if self._failure:
            outcome = Outcome.FAILED
        elif not plan.local_block_ids or not plan.awaiting:
            outcome = Outcome.NOTHING_TO_PULL
        else:
            outcome = Outcome.PULLED
        return PullResult(
            request_id=plan.request_id,
            outcome=outcome,
            awaiting=plan.awaiting,
            local_block_ids=plan.local_block_ids,
            num_blocks=plan.num_blocks if outcome is Outcome.PULLED else 0,
            num_bytes=self._bytes,
            num_descriptors=self._descriptors,
            reason=self._failure,
        )
