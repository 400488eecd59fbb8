"""D side, worker half: one :class:`~vllm_kvp2p.lifecycle.consumer.PullPlan` carried out on one D rank. Pure:
no sockets, threads, clocks or torch.

For every P rank the TP mapping names: ``registration -> claim -> read batches``, where a registration not cached
yet comes with the claim's reply (one round trip for both); then a release to every P rank (read or only
notified), then :class:`Finish`. Every lease held is renewed when its time comes, whichever P rank is being worked
on, until its release. The pull thread performs each returned action and feeds back the result, as an h11-style
state machine. Any failure, and a crash of the pull thread (:meth:`ConsumerPull.on_crash`), skips straight to the
releases, so P is released in every outcome, each lease with its token.

The actions and the result are plain values in :mod:`vllm_kvp2p.lifecycle.pull_actions` (imported from here
too). The completion rule lives in :attr:`PullResult.report_finished`: vLLM parked the request in
``WAITING_FOR_REMOTE_KVS`` only when it asked for external tokens (:attr:`PullPlan.awaiting`), and only then may
the receive be reported (reporting it for a RUNNING request kills vLLM's scheduler).
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_kvp2p.contract.protocol import (
    MAX_ANSWER_WITHIN_MS,
    Claim,
    ClaimReply,
    ClaimStatus,
    RankRegistration,
    Release,
    Renew,
    UnitSums,
)
from vllm_kvp2p.lifecycle.compatibility import registration_problem
from vllm_kvp2p.lifecycle.consumer import Failure, PullPlan
from vllm_kvp2p.lifecycle.integrity import IntegrityMode, Judgement, Verdict, Verification, judge, verification_for
from vllm_kvp2p.lifecycle.pull_actions import (
    Action,
    FetchRegistration,
    Finish,
    LocalKV,
    Outcome,
    PullResult,
    ReadBatch,
    SendClaim,
    SendRelease,
    SendRenew,
    Source,
    Wait,
)
from vllm_kvp2p.lifecycle.read_plan import read_descriptors
from vllm_kvp2p.lifecycle.stages import coverage_problem, layers_read, plane_pairs
from vllm_kvp2p.transfer.descriptors import Descriptors

__all__ = [
    "Action", "ConsumerPull", "FetchRegistration", "Finish", "LocalKV", "Outcome", "PullResult", "ReadBatch",
    "SendClaim", "SendRelease", "SendRenew", "Source", "Wait",
]

# Retry of a claim P has not heard of yet ("unknown"): first after 1 ms, doubling up to 50 ms.
UNKNOWN_RETRY_FIRST = 0.001
UNKNOWN_RETRY_MAX = 0.05
# Characters of a failure reason kept (it ends up in a WARNING and in the request's kv_transfer_params).
MAX_REASON = 1000
# A release P answered with an error (it is up, but did not take it: a P of an older release whose table of
# deferred answers was full said "try again") is sent again after this, within the releases' budget.
RELEASE_RETRY_S = 0.1


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
    unknown_claims: int = 0  # claims P answered "unknown" so far: the retry backoff's exponent
    renew_at: float = 0.0
    lease: float = 0.0
    lease_token: str = ""  # from P's GRANTED claim reply; renewals and the release carry it
    batches: list[Descriptors] = field(default_factory=list)
    released: bool = False
    release_retry_at: float = 0.0  # P answered its release with an error: sent again then
    release_error: str = ""  # what P answered it, the last time
    registration_in_claim: bool = False  # none cached: the claim asks for it
    fetch_registration: bool = False  # P granted without it (an older P): fetch it before reading
    verification: Verification | None = None  # the integrity question for what is read from this rank
    pairs: tuple[tuple[int, int], ...] = ()  # (D plane, P plane) of the layers both hold


class ConsumerPull:
    """One plan's pull on one D rank."""

    def __init__(
        self,
        plan: PullPlan,
        sources: Sequence[Source],
        reader: str,
        local: LocalKV,
        *,
        claim_wait: float,
        max_batch_entries: int,
        now: float,
        timeout: float = float("inf"),
        release_timeout: float = float("inf"),
        claim_id: str = "",
        integrity: IntegrityMode = IntegrityMode.OFF,
        sampled_units: int = 4,
        wall_now_ms: int = 0,
    ) -> None:
        """``timeout``: the whole pull's budget (every round trip and read, from ``now``); past it the pull fails.
        ``release_timeout``: after that, how long the releases may take; past it the remaining ones are not sent
        (P's hold timeout frees the blocks). ``claim_id``: random per pull (the caller draws it), so that a claim
        resent after a lost reply gets the same lease back. ``wall_now_ms``: D's wall clock at ``now`` (ms since
        the epoch; 0: not given): every claim carries the pull's deadline on it (:attr:`wall_deadline_ms`), so
        that P refuses a claim delivered after D gave up and leases no longer than D may read."""
        self.plan = plan
        self.claim_id = claim_id
        self.integrity = integrity
        self.sampled_units = sampled_units
        self._verified_units = 0
        self._unverified = ""  # why a rank read from gave no sums ("": every one did)
        self._sums_lost = False
        self.reader = reader
        self.local = local
        self.claim_wait = claim_wait
        self.max_batch_entries = max_batch_entries
        self._sources = [_SourceState(s, claim_deadline=now + claim_wait) for s in sources]
        self.timeout = timeout
        self._deadline = now + timeout
        finite = wall_now_ms > 0 and timeout < float("inf")
        self.wall_deadline_ms = wall_now_ms + math.ceil(timeout * 1000) if finite else 0
        self._release_timeout = release_timeout
        self._release_deadline = self._deadline + release_timeout
        self._readable = [i for i, st in enumerate(self._sources) if st.source.slices]
        self._cursor = 0  # index into _readable
        self._bytes = 0
        self._descriptors = 0
        self._failure = plan.error
        self._kind: Failure | None = plan.failure if plan.error else None
        nothing = not plan.num_blocks or not plan.awaiting or not self._readable
        self._phase = _Phase.RELEASE if (nothing or self._failure) else _Phase.REGISTRATION
        if not plan.contact_p:  # invalid params: no release either, to an address any client could have named
            for st in self._sources:
                st.released = True
        if plan.awaiting and plan.num_blocks and not self._readable and not self._failure:
            self._failure, self._kind = "the TP mapping gives this D rank nothing to read", Failure.INCOMPATIBLE
        self._result: PullResult | None = None
        self._unreachable_rank: int | None = None

    @property
    def done(self) -> bool:
        return self._phase is _Phase.DONE

    # ------------------------------------------------------------------ driving

    def next_action(self, now: float) -> Action:
        if self._phase is _Phase.DONE:
            assert self._result is not None
            return Finish(self._result)
        if self._phase is not _Phase.RELEASE and now >= self._deadline:
            self._fail(f"the pull took longer than pull_timeout={self.timeout:g}s", Failure.TIMEOUT)
        if self._phase is _Phase.RELEASE:
            if now >= self._release_deadline:
                self._give_up_releases()
            for st in self._sources:
                if not st.released:
                    if now < st.release_retry_at:
                        return Wait(st.release_retry_at)
                    asked = st.verification if self._pulled(st.source) else None
                    return SendRelease(st.source, self._release(st, now, asked), asked)
            self._phase = _Phase.DONE
            self._result = self._make_result()
            return Finish(self._result)
        # Every lease held, not only the one of the rank being read: a slow rank must not let another's lapse.
        due = min((st for st in self._sources if self._holds_lease(st)), key=lambda st: st.renew_at, default=None)
        if due is not None and now >= due.renew_at:
            r = self.plan.remote
            return SendRenew(due.source, Renew(r.remote_request_id, r.remote_hold_id, self.reader, due.lease_token))
        st = self._sources[self._readable[self._cursor]]
        if self._phase is _Phase.REGISTRATION:
            return FetchRegistration(st.source, join_claim=not st.fetch_registration)
        if self._phase is _Phase.CLAIM:
            if now < st.retry_at:
                return Wait(st.retry_at if due is None else min(st.retry_at, due.renew_at))
            return SendClaim(st.source, self._claim(st))
        # READ
        assert st.registration is not None
        return ReadBatch(st.source, st.registration.segment, st.batches[0])

    def on_registration(self, source: Source, registration: RankRegistration | None, error: str = "", *,
                        answered: Failure | None = None) -> bool:
        """True when the registration is accepted (only then may the caller cache it). ``registration`` None: the
        request failed with ``error``; ``answered``: P answered, but the exchange failed for this reason, so P is up,
        not unreachable: UNAUTHENTICATED (P refused D's authentication, or P's reply failed D's) or INCOMPATIBLE (a
        reply D cannot decode: another protocol, or over a bound of its types)."""
        st = self._current(source, _Phase.REGISTRATION)
        if st is None:
            return False
        if registration is None:
            self._unanswered(source, f"no registration from P rank {source.p_rank}", error, answered)
            return False
        if not self._accept(st, registration):
            return False
        if st.lease:  # claimed already (the claim's reply had no registration): read now
            self._phase = _Phase.READ
            if not st.batches:
                self._next_source()
        else:
            self._phase = _Phase.CLAIM
        return True

    def with_claim(self, source: Source) -> None:
        """No registration of P rank ``source`` is cached: claim at once and ask for it in the same exchange (it is
        checked as a fetched one is, before any read; refused, the lease just claimed is released)."""
        st = self._current(source, _Phase.REGISTRATION)
        if st is None:
            return
        st.registration_in_claim = True
        self._phase = _Phase.CLAIM

    def on_claim_reply(self, source: Source, reply: ClaimReply | None, now: float, error: str = "", *,
                       answered: Failure | None = None) -> bool:
        """True when the reply brought a registration that was accepted (only then may the caller cache it).
        ``reply`` None: as for :meth:`on_registration`."""
        st = self._current(source, _Phase.CLAIM)
        if st is None:
            return False
        if reply is None:
            self._unanswered(source, f"claim on P rank {source.p_rank} failed", error, answered)
            return False
        if reply.status is ClaimStatus.GRANTED:  # before the checks: a release after a refused one carries it
            st.lease, st.lease_token = reply.lease, reply.lease_token
        accepted = False
        if st.registration is None and reply.registration is not None:
            if not self._accept(st, reply.registration):
                return False
            accepted = True
        if reply.status is ClaimStatus.GRANTED:
            st.renew_at = now + reply.lease / 3
            if st.registration is None:  # an older P ignored the request for it: fetch it, then read
                st.fetch_registration = True
                self._phase = _Phase.REGISTRATION
                return accepted
            self._phase = _Phase.READ
            if not st.batches:
                self._next_source()
            return accepted
        if reply.status is ClaimStatus.UNKNOWN and now < st.claim_deadline:
            # P learns of a hold at the start of its next engine step, usually within a ms of its answer: retry
            # soon, then back off (1, 2, 4 ... 50 ms) so a P that is slow to step is not flooded.
            backoff = min(UNKNOWN_RETRY_MAX, UNKNOWN_RETRY_FIRST * 2 ** min(st.unknown_claims, 16))
            st.unknown_claims += 1
            st.retry_at = now + min(backoff, max(0.0, st.claim_deadline - now))
            return accepted
        if reply.status is ClaimStatus.REFUSED:
            why = reply.reason
        else:
            why = f"P never learned of the hold in {self.claim_wait:g}s"
        self._fail(f"P rank {source.p_rank} refused the claim: {why}", Failure.REFUSED)
        return accepted

    def on_renewed(self, source: Source, reply: ClaimReply | None, now: float, error: str = "", *,
                   answered: Failure | None = None) -> None:
        """The answer to a renewal of any lease this pull holds. ``reply`` None: as for :meth:`on_registration`."""
        if self._phase in (_Phase.RELEASE, _Phase.DONE):
            return  # a stale result: the pull has moved on to the releases
        st = next((st for st in self._sources if st.source == source and self._holds_lease(st)), None)
        if st is None:
            return
        if reply is None:
            return self._unanswered(source, f"lease renewal on P rank {source.p_rank} failed", error, answered)
        if reply.status is not ClaimStatus.GRANTED:
            return self._fail(f"lease renewal on P rank {source.p_rank} failed: {reply.reason}", Failure.REFUSED)
        st.renew_at = now + reply.lease / 3

    def on_batch_done(self, source: Source, ok: bool, error: str = "") -> None:
        st = self._current(source, _Phase.READ)
        if st is None:
            return
        if not ok:
            segment = st.registration.segment if st.registration else "?"
            return self._fail(f"read from P rank {source.p_rank} ({segment}) failed: {error}", Failure.READ_FAILED)
        batch = st.batches.pop(0)
        self._bytes += batch.total_bytes
        if not st.batches:
            self._next_source()

    def on_release_sent(self, source: Source, lease_held: bool = True, mine: Sequence[tuple[int, int]] = (),
                        theirs: Sequence[UnitSums] | None = None, sums_lost: bool = False, no_sums: str = "") -> None:
        """P answered the release; ``lease_held``: P confirms the lease held from claim to release. A read from
        this rank counts only then: otherwise its blocks may have been freed and reused during the read. With the
        release's integrity question, ``mine`` are D's sums over its copies and ``theirs`` P's answer: a read
        counts only when they are equal (none from P: unverified, counted, not failed, ``no_sums`` saying why, e.g.
        ``busy``; none because P no longer kept its answer to this release, resent, ``sums_lost``: counted apart)."""
        for st in self._sources:
            if st.source == source:
                if self._pulled(st.source) and not lease_held:
                    self._failure = (f"P rank {source.p_rank} did not confirm that the lease held through the read "
                                     "(it lapsed: the blocks may have been freed during the read)")
                    self._kind = Failure.LEASE_LOST
                elif self._pulled(st.source) and st.verification is not None:
                    why = no_sums[:64] or ("no sums and no reason (a P of an older release)" if theirs is None else
                                           "the sums could not be compared (D's failed, or P's do not fit)")
                    self._judge(st, judge(st.verification.query, mine, theirs, sums_lost), why)
                st.released = True

    def on_release_refused(self, source: Source, now: float, error: str) -> None:
        """P answered the release with an error: it is up (not ``unreachable``, not suspect), but did not take the
        release (a P of an older release whose deferred answers were full: "try again"). Sent again after
        ``RELEASE_RETRY_S`` while the releases' budget lasts; past it the read is not confirmed (``timeout``)."""
        for st in self._sources:
            if st.source == source and not st.released:
                st.release_retry_at = now + RELEASE_RETRY_S
                st.release_error = error[:MAX_REASON]

    def _judge(self, st: _SourceState, judgement: Judgement, why: str) -> None:
        if judgement.verdict is Verdict.UNVERIFIED:
            self._unverified = self._unverified or f"P rank {st.source.p_rank}: {why}"
        elif judgement.verdict is Verdict.SUMS_LOST:
            self._sums_lost = True
        elif judgement.verdict is Verdict.MATCHED:
            self._verified_units += judgement.units
        else:
            bad = judgement.first_bad
            assert bad is not None and st.registration is not None
            where = st.registration.plane_name(bad.plane)
            self._failure = (f"the bytes read from P rank {st.source.p_rank} ({st.registration.segment}) differ from "
                             f"P's: {where}, P block {bad.block} (the first of {judgement.units} units compared)")
            self._kind = Failure.CORRUPTED

    def abort(self, reason: str) -> None:
        """Stop reading (the engine is stopping): the pull fails and goes straight to the releases."""
        if self._phase not in (_Phase.RELEASE, _Phase.DONE):
            self._fail(reason, Failure.SHUTDOWN)

    def on_crash(self, reason: str) -> None:
        """The pull thread raised while carrying out this pull. Nothing read counts (a failure already out stays
        the failure); :meth:`next_action` gives the releases still owed, each with the lease token this pull
        holds on that P rank (without it P ignores the release of a live lease and keeps the blocks until the
        lease lapses), a plain notification to a rank never claimed."""
        if self._phase is _Phase.DONE:
            return
        if not self._failure:
            self._fail(reason, Failure.INTERNAL)
        self._phase = _Phase.RELEASE

    def on_release_failed(self, source: Source) -> None:
        """P rank ``source`` did not answer a release: the instance's other ranks are not tried either (each would
        cost another side-channel timeout, up to ``tp_size`` of them); P's hold timeout frees the blocks. A read
        from it cannot be confirmed, so it does not count."""
        if self._pulled(source):
            self._failure = f"P rank {source.p_rank} did not answer the release: the read cannot be confirmed"
            self._kind = Failure.UNREACHABLE
        self._give_up_releases()

    @property
    def failed(self) -> bool:
        return bool(self._failure)

    def result(self) -> PullResult:
        """The result as it stands (final once failed: the releases that follow cannot change a failure)."""
        return self._result if self._result is not None else self._make_result()

    def time_left(self, now: float) -> float:
        """Seconds the next action may take: what is left of the pull's budget, or of the releases' once failed or
        done (a side-channel call is given no more)."""
        end = self._release_deadline if self._phase is _Phase.RELEASE else self._deadline
        return max(0.0, end - now)

    # ------------------------------------------------------------------ internals

    def _current(self, source: Source, phase: _Phase) -> _SourceState | None:
        if self._phase is not phase or self._cursor >= len(self._readable):
            return None
        st = self._sources[self._readable[self._cursor]]
        if st.source != source:
            return None  # a stale result for a step we already left; ignore
        return st

    def _next_source(self) -> None:
        self._cursor += 1
        if self._cursor < len(self._readable):
            self._phase = _Phase.REGISTRATION
            return
        self._phase = _Phase.RELEASE
        if self.plan.remote.pp_size == 1 and self.local.pp_size == 1:
            return  # planes paired by position, the layers checked equal (lifecycle/compatibility.py)
        read = ((self._sources[i].source.p_rank, self._sources[i].pairs) for i in self._readable)
        problem = coverage_problem(self.local, layers_read(self.local, self.plan.remote.tp_size, read))
        if problem:
            self._fail(f"P's layers do not fill D's: {problem}", Failure.INCOMPATIBLE)

    def _holds_lease(self, st: _SourceState) -> bool:
        return bool(st.lease) and not st.released

    def _unanswered(self, source: Source, what: str, error: str, answered: Failure | None) -> None:
        # When P did answer it is not down (nor to be taken for down by the pulls that follow).
        self._fail(f"{what}: {error}", answered or Failure.UNREACHABLE)
        if answered is None:
            self._unreachable_rank = source.p_rank

    def _fail(self, reason: str, kind: Failure) -> None:
        # Reasons quote what P sent (engine ids, segments, error texts): bounded, as they go to logs and to vLLM.
        self._failure = reason if len(reason) <= MAX_REASON else reason[:MAX_REASON] + " [cut]"
        self._kind = kind
        self._phase = _Phase.RELEASE

    def _give_up_releases(self) -> None:
        for st in self._sources:
            if not st.released and self._pulled(st.source):  # a read P never confirmed does not count
                said = f" (it answered: {st.release_error})" if st.release_error else ""
                self._failure = (f"no release answered by P rank {st.source.p_rank} in time{said}: the read is not "
                                 "confirmed")
                self._kind = Failure.TIMEOUT
            st.released = True

    def _accept(self, st: _SourceState, registration: RankRegistration) -> bool:
        """Check a registration (fetched, cached or from a claim's reply) and build the reads from it."""
        source = st.source
        problem = registration_problem(self.plan, self.local, source, registration)
        if problem:
            self._fail(f"P rank {source.p_rank} is incompatible: {problem}", Failure.INCOMPATIBLE)
            return False
        pairs = plane_pairs(self.local, registration)
        assert not isinstance(pairs, str)  # registration_problem said it pairs
        st.pairs = pairs
        try:
            descriptors = read_descriptors(self.plan, self.local, source, registration, pairs)
        except ValueError as exc:
            self._fail(f"cannot address blocks on P rank {source.p_rank}: {exc}", Failure.INCOMPATIBLE)
            return False
        st.registration = registration
        st.batches = descriptors.batches(self.max_batch_entries) if len(descriptors) else []
        seed = int.from_bytes(hashlib.sha256(f"{self.claim_id}/{source.p_rank}".encode()).digest()[:8], "little")
        st.verification = verification_for(descriptors, registration.planes, self.integrity, seed,
                                           self.sampled_units)
        self._descriptors += len(descriptors)
        return True

    def _claim(self, st: _SourceState) -> Claim:
        r = self.plan.remote
        return Claim(r.remote_request_id, r.remote_hold_id, self.reader, st.source.expected_readers, self.claim_id,
                     with_registration=st.registration_in_claim and st.registration is None,
                     deadline_ms=self.wall_deadline_ms)

    def _pulled(self, source: Source) -> bool:
        """Whether this pull read from ``source`` and still counts that read (so P's confirmation matters)."""
        return not self._failure and bool(source.slices) and bool(self.plan.num_blocks) and self.plan.awaiting

    def _release(self, st: _SourceState, now: float, asked: Verification | None = None) -> Release:
        """With a question, how long D waits for its answer (what the side-channel call is given: the releases'
        budget left, at most ``release_timeout``): P answers without sums rather than after that."""
        r, source = self.plan.remote, st.source
        within_ms = 0  # says nothing (no question, or no bound: P assumes 5 s)
        if asked is not None:
            within = min(self._release_timeout, self._release_deadline - now)
            if math.isfinite(within):  # a budget all but spent still says 1 ms: P answers at once
                within_ms = min(MAX_ANSWER_WITHIN_MS, max(1, int(within * 1000)))
        return Release(r.remote_request_id, r.remote_hold_id, self.reader, source.expected_readers,
                       self._pulled(source), st.lease_token, asked.query if asked is not None else None,
                       answer_within_ms=within_ms)

    def _make_result(self) -> PullResult:
        plan = self.plan
        if self._failure:
            outcome = Outcome.FAILED
        elif not plan.num_blocks or not plan.awaiting:
            outcome = Outcome.NOTHING_TO_PULL
        else:
            outcome = Outcome.PULLED
        return PullResult(
            request_id=plan.request_id,
            outcome=outcome,
            awaiting=plan.awaiting,
            local_block_ids=plan.all_local_block_ids,
            num_blocks=plan.num_blocks if outcome is Outcome.PULLED else 0,
            num_bytes=self._bytes,
            num_descriptors=self._descriptors,
            reason=self._failure,
            failure=self._kind if outcome is Outcome.FAILED else None,
            verified_units=self._verified_units if outcome is Outcome.PULLED else 0,
            unverified=bool(self._unverified) and outcome is Outcome.PULLED,
            unverified_reason=self._unverified if outcome is Outcome.PULLED else "",
            sums_lost=self._sums_lost and outcome is Outcome.PULLED,
            unreachable_rank=self._unreachable_rank if self._kind is Failure.UNREACHABLE else None,
        )

