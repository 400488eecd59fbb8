"""P side at run time: one worker's :class:`ProducerLedger`, its clock and lock, and the side channel D talks to.

The ledger decides; this module only feeds it events (holds from vLLM's scheduler metadata, claims and releases
from the side channel, the passing of time) and logs what it reports. A refusal or bound hit (an event with a
``reason``, which peers can cause at will) is logged as a WARNING at most once a minute per reason, with the count
of those not logged since; the ledger's ``counters`` have them all.

Integrity questions (D's release asks P's sums of the bytes it read, vllm_kvp2p/lifecycle/integrity.py) are
answered only about the asking reader's own hold and within its bytes (``query_problem``, checked in O(its units)
against the hold's units, made once per hold), and summed on a thread of their own, not the side channel's (which
only checks the lease and queues the question, in O(its units)): the release is answered once its sums are done (the
side channel defers that answer and meanwhile serves every other claim, renewal and release of this rank). The
queue (vllm_kvp2p/lifecycle/question_queue.py) decides what is summed when, fair to every reader: per hold in turn,
a slice of about 20 ms at a time, bounded in bytes and shared max-min; a question whose sums would end after its
reader's budget (``Release.answer_within_ms``) is answered at once without them, one still waiting at its deadline
then (``Released.no_sums``: ``busy``; D counts the pull unverified, never failed). A release resent while its sums
run (D's client resends after 0.5 s) gets the same answer (one Future: one slot of the side channel's deferred
table, whatever the number of copies), not a second sum; one resent after it was answered gets the answer the
ledger kept (ProducerLedger.answer_release, bounded), or, once that is forgotten, a reply that says so
(``Released.sums_lost``: D counts the pull apart, never verified).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec

from vllm_kvp2p import os_threads
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.protocol import (
    Abandon,
    Abandoned,
    AbandonOutcome,
    Claim,
    ClaimStatus,
    DigestQuery,
    ErrorReply,
    GetRankTable,
    GetRegistration,
    RankRegistration,
    RankTable,
    Registration,
    Release,
    Released,
    Renew,
    Reply,
    Request,
    UnitSums,
)
from vllm_kvp2p.contract.side_channel import MAX_DEFERRED, SideChannelServer, Unsealed
from vllm_kvp2p.lifecycle.hold import HeldUnits
from vllm_kvp2p.lifecycle.integrity import NoSums, query_problem
from vllm_kvp2p.lifecycle.producer import (
    CLOCK_SKEW,
    EARLY_RELEASE_TTL,
    MAX_EARLY_RELEASES,
    MAX_HOLDS,
    LedgerEvent,
    ProducerLedger,
)
from vllm_kvp2p.lifecycle.question_queue import Question, QuestionQueue, Slice, unit_bytes
from vllm_kvp2p.log import WarningPace, get_logger
from vllm_kvp2p.os_threads import run_named

logger = get_logger(__name__)

WARNING_INTERVAL = 60.0  # seconds between two warnings of one reason

_SUMS_ENCODER = msgspec.msgpack.Encoder()  # an answer, as the ledger keeps it
_SUMS_DECODER = msgspec.msgpack.Decoder(list[tuple[int, int]])  # UnitSums is array_like: [total, weighted]


@dataclass(frozen=True)
class _Asked:
    """A release whose question waits for its sums (the question queue's payload): what it will be answered."""

    release: Release
    held: HeldUnits  # what its reader may ask about (checked on the sums thread, before the first slice)
    answer: Future[Reply]


def _what_it_asks(release: Release) -> Release:
    """The release without the budget it states: a copy D sends again later (after an error answer) states less
    time left, and is still the same release."""
    return msgspec.structs.replace(release, answer_within_ms=0) if release.answer_within_ms else release


def _fingerprint(release: Release) -> bytes:
    """What identifies a release that asks an integrity question (b"": it asks none): only the same release,
    lease token and question included (its stated budget not), gets the answer kept for it."""
    if release.verify is None:
        return b""
    return hashlib.sha256(msgspec.msgpack.encode(_what_it_asks(release))).digest()


class HoldService:
    """Keeps P's finished prompts for decoders and answers them on ``host:port``."""

    def __init__(
        self,
        registration: RankRegistration,
        host: str,
        port: int,
        *,
        hold_timeout: float,
        lease_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        max_holds: int = MAX_HOLDS,
        max_early_releases: int = MAX_EARLY_RELEASES,
        early_release_ttl: float = EARLY_RELEASE_TTL,
        clock_skew: float = CLOCK_SKEW,
        auth: Authenticator | None = None,
        on_release: Callable[[], None] | None = None,
        digester: Callable[[DigestQuery], list[tuple[int, int]]] | None = None,
        questions: QuestionQueue[_Asked] | None = None,
    ) -> None:
        """``on_release``: called (on the side-channel thread) after each release, which may free a hold.
        ``digester``: this rank's byte sums over a question's units (vllm_kvp2p/transfer/digest.py: sums_of_units
        over its KV memory); None answers no integrity question (D counts its pulls unverified).
        ``clock_skew``: seconds P's and D's wall clocks may disagree (a claim's deadline is D's wall clock).
        ``questions``: the integrity questions' queue (default: :class:`QuestionQueue` with its bounds)."""
        self.registration = registration
        # Every rank of this engine (set once the ranks gathered it, vllm_kvp2p/connector/worker.py); None: not yet.
        self.rank_table: RankTable | None = None
        self._on_release = on_release
        self._digester = digester
        self.ledger = ProducerLedger(
            hold_timeout, lease_timeout, max_holds=max_holds, max_early_releases=max_early_releases,
            early_release_ttl=early_release_ttl, clock_skew=clock_skew,
        )
        self._clock = clock
        self._pace = WarningPace(WARNING_INTERVAL)  # a WARNING a minute per reason (peers cause them at will)
        self._lock = threading.Lock()
        self._held_over: list[str] = []  # freed ids reported again at the next take_freed (see there)
        self._dropped_reported: Counter[str] = Counter()  # side-channel drops already in the metrics
        self._plane_groups = registration.group_of_planes()
        # The releases whose question waits for its sums (each one deferred answer on the side channel: within its
        # table, so that no release is ever refused there for others' questions).
        self._questions: QuestionQueue[_Asked] = questions if questions is not None else QuestionQueue()
        assert self._questions.max_questions <= MAX_DEFERRED
        self._work = threading.Condition(self._lock)  # a question queued, or closing
        self._closing = False
        self._summer = threading.Thread(target=run_named(os_threads.DIGEST, self._sum_questions),
                                        name=f"kvp2p-digest:{port}", daemon=True)
        self._summer.start()
        self._server = SideChannelServer(
            host, port, self._handle, setting=f"VLLM_KVP2P_SIDE_CHANNEL_PORT base + rank {registration.rank}",
            auth=auth,
        )
        logger.info("KV hold service of rank %d listening on %s (%s)", registration.rank, self._server.address,
                    "authenticated" if auth is not None else "unauthenticated: anyone who reaches it may fetch the "
                    "registration, claim and release; set VLLM_KVP2P_SECRET, docs/security.md")

    def hold(self, request_id: str, hold_id: str, num_blocks: int = 0, blocks: Sequence[Sequence[int]] = (),
             mac: str = "") -> None:
        """``num_blocks``: every block vLLM keeps (the gauge); ``blocks``: those the params offer, per KV-cache group
        (vllm_kvp2p/metadata.HoldOrder.offered), the only ones a reader of the hold is answered about; ``mac``: the
        params' signature ("" unsigned), what an abandon of the hold must carry."""
        logger.debug("KV hold %s (hold %s): %d blocks kept for a decoder", request_id, hold_id, num_blocks)
        offered = tuple(tuple(ids) for ids in blocks)
        with self._lock:
            self.ledger.hold(request_id, hold_id, self._clock(), num_blocks, offered, mac)
            self._log_events()

    def take_freed(self) -> set[str]:
        """Requests whose blocks vLLM may free now (released by every reader, or expired). vLLM takes a set: when
        two holds of one request id end together, the second is reported at the next call (once per hold)."""
        out: set[str] = set()
        with self._lock:
            self.ledger.expire(self._clock())
            freed, self._held_over = self._held_over + self.ledger.take_freed(), []
            for request_id in freed:
                (self._held_over.append if request_id in out else out.add)(request_id)
            self._log_events()
        return out

    @property
    def active(self) -> int:
        with self._lock:
            return self.ledger.active

    def counters(self) -> dict[str, int]:
        """Refusals and bound hits so far, by reason (:class:`ProducerLedger` names them)."""
        with self._lock:
            return dict(self.ledger.counters)

    def table_sizes(self) -> dict[str, int]:
        """The ledger's tables and the integrity questions waiting for their sums (empty when P is idle)."""
        with self._lock:
            return {**self.ledger.table_sizes(), "questions_waiting": len(self._questions)}

    def take_metrics(self) -> tuple[dict[str, int], dict[str, int], int, float]:
        """Since the last call: holds created / released / expired and claims refused, side-channel messages
        dropped by reason; now: blocks held and the oldest hold's age (s)."""
        with self._lock:
            tally, self.ledger.tally = dict(self.ledger.tally), Counter()
            now_dropped = dict(self._server.dropped)  # one C-level copy: the server thread adds to it unlocked
            dropped = {k: v - self._dropped_reported.get(k, 0) for k, v in now_dropped.items()}
            self._dropped_reported = Counter(now_dropped)
            return (tally, {k: v for k, v in dropped.items() if v > 0}, self.ledger.blocks_held,
                    self.ledger.oldest_hold_age(self._clock()))

    def _handle(self, message: Request | Unsealed) -> Reply | Future[Reply]:
        if isinstance(message, Release):
            with self._lock:
                try:
                    return self._take_release(message, self._clock())
                finally:
                    self._log_events()
        with self._lock:
            now = self._clock()
            try:
                if isinstance(message, GetRegistration):
                    if message.tp_rank != self.registration.rank:
                        return ErrorReply(
                            f"this is rank {self.registration.rank}, asked for rank {message.tp_rank}"
                        )
                    return Registration(self.registration)
                if isinstance(message, GetRankTable):
                    if self.rank_table is None:
                        return ErrorReply(f"rank {self.registration.rank}: the rank table is not ready")
                    return self.rank_table
                if isinstance(message, Claim):
                    reply = self.ledger.claim(
                        message.request_id, message.hold_id, message.reader, message.expected_readers, now,
                        message.claim_id, deadline_ms=message.deadline_ms, wall_now_ms=time.time_ns() // 1_000_000,
                    )
                    if reply.status is ClaimStatus.REFUSED:
                        self.ledger.tally["claims_refused"] += 1
                    logger.debug("KV hold %s (hold %s): claim by %s: %s %s", message.request_id, message.hold_id,
                                 message.reader, reply.status.value, reply.reason)
                    if message.with_registration:  # what GetRegistration would answer, in the same round trip
                        reply = msgspec.structs.replace(reply, registration=self.registration)
                    return reply
                if isinstance(message, Renew):
                    return self.ledger.renew(
                        message.request_id, message.hold_id, message.reader, now, message.lease_token
                    )
                if isinstance(message, (Abandon, Unsealed)):
                    # An unsealed one (at a P with a secret) is not remembered before its hold: nothing checks it then.
                    sealed = isinstance(message, Abandon)
                    abandon = message if isinstance(message, Abandon) else message.message
                    outcome, why = self.ledger.abandon(abandon.request_id, abandon.hold_id, abandon.mac, now,
                                                       remember=sealed)
                    logger.debug("KV hold %s (hold %s): abandoned%s: %s %s", abandon.request_id, abandon.hold_id,
                                 "" if sealed else " (unsealed)", outcome.value, why)
                    if outcome is AbandonOutcome.RELEASED and self._on_release is not None:
                        self._on_release()
                    return Abandoned(outcome, why)
                return ErrorReply(f"unexpected message {type(message).__name__}")
            finally:
                self._log_events()

    def _release(self, message: Release, now: float, sums: list[UnitSums] | None,
                 no_sums: NoSums | None = None) -> Released:
        """Under the lock. The release is decided after the sums: if the lease lapsed meanwhile (and the blocks may
        have been reused), P does not confirm the read, and D does not count it whatever the sums. The ledger keeps
        the answer for the same release resent (ProducerLedger.answer_release). ``no_sums``: why a question got none
        (lifecycle/integrity.NoSums)."""
        answer = self.ledger.answer_release(
            message.request_id, message.hold_id, message.reader, message.expected_readers, now,
            message.lease_token, message.pulled, question=_fingerprint(message),
            sums=None if sums is None else _SUMS_ENCODER.encode(sums),
        )
        logger.debug("KV hold %s (hold %s): release by %s (pulled %s): lease held %s%s",
                     message.request_id, message.hold_id, message.reader, message.pulled, answer.lease_held,
                     ", its sums no longer kept" if answer.sums_lost else "")
        if self._on_release is not None:
            self._on_release()
        kept = None if answer.sums is None else [UnitSums(t, w) for t, w in _SUMS_DECODER.decode(answer.sums)]
        asked = message.verify is not None and message.pulled and answer.lease_held and kept is None
        return Released(answer.lease_held, kept, sums_lost=answer.sums_lost,
                        no_sums=no_sums.value if no_sums is not None and asked and not answer.sums_lost else "")

    def _take_release(self, release: Release, now: float) -> Reply | Future[Reply]:
        """Under the lock, in O(the question's units): a release answered at once, or the answer it will get once
        its question's sums are done (a Future: the side channel defers it). A copy of a release whose sums run gets
        the same Future (one slot of the side channel's deferred table, whatever the copies)."""
        key = (release.request_id, release.hold_id, release.reader)
        waiting = self._questions.get(key)
        if waiting is not None:
            if _what_it_asks(waiting.payload.release) == _what_it_asks(release):  # resent (D gave up on a socket)
                return waiting.payload.answer
            # Not the reader's own resend (that is the same release): someone else naming it, the token or a
            # question changed. The reader's release stays as it is.
            return ErrorReply("this reader's release is being answered (its integrity sums run): send it later")
        if release.verify is None or not release.pulled:
            return self._release(release, now, None)
        if self._digester is None:
            return self._release(release, now, None, NoSums.NOT_ANSWERED)
        held = self.ledger.verifiable_units(release.request_id, release.hold_id, release.reader, now,
                                            release.lease_token, self.registration.planes, self._plane_groups)
        if held is None:
            logger.debug("KV hold %s: integrity question of %s not answered: the reader holds no live lease",
                         release.request_id, release.reader)
            return self._release(release, now, None, NoSums.NO_LEASE)
        question = Question(key, unit_bytes([u.ranges for u in release.verify.units]),
                            QuestionQueue.deadline(now, release.answer_within_ms), _Asked(release, held, Future()))
        why, pushed_out = self._questions.admit(question, now)
        for other in pushed_out:
            self._unsummed(other, now, NoSums.BUSY, "pushed out of P's question queue by a hold with a smaller share")
        if why:
            self._refused(release, why, "integrity_questions_busy")
            return self._release(release, now, None, NoSums.BUSY)
        self._work.notify()
        return question.payload.answer

    def _sum_questions(self) -> None:
        """The questions' thread: the queue's next slice, summed off the lock; a question is checked before its
        first slice, and answered (its release decided, under the lock) once summed, refused, or past its
        deadline."""
        while (work := self._next_slice()) is not None:
            try:
                self._sum_slice(work)
            except Exception:  # noqa: BLE001 - a bug on one question must not leave every later one unanswered
                logger.exception("KV hold %s: integrity question failed", work.question.payload.release.request_id)
                with self._lock:
                    if self._questions.drop(work.question):
                        self._answer(work.question, self._clock(), NoSums.FAILED)
                    self._log_events()

    def _sum_slice(self, work: Slice[_Asked]) -> None:
        question, asked = work.question, work.question.payload
        assert asked.release.verify is not None
        if work.start == 0:
            problem = query_problem(asked.release.verify, self.registration.planes, asked.held)
            if problem:
                with self._lock:
                    if self._questions.drop(question):
                        self._refused(asked.release, problem, "integrity_question_refused")
                        self._answer(question, self._clock(), NoSums.REFUSED)
                return
        started = time.perf_counter()
        sums = self._sums(asked.release, DigestQuery(asked.release.verify.units[work.start:work.end]))
        took = time.perf_counter() - started
        with self._lock:
            done = self._questions.slice_done(work, sums, took)
            if done is not None:
                self._answer(done, self._clock(), NoSums.FAILED if done.sums is None else None)
            self._log_events()

    def _next_slice(self) -> Slice[_Asked] | None:
        """The next slice to sum, once there is one (None: closing); answers the questions past their deadline."""
        with self._work:
            while not self._closing:
                now = self._clock()
                expired, work = self._questions.next_slice(now)
                for question in expired:
                    self._unsummed(question, now, NoSums.BUSY, "its reader's budget ended before its sums")
                if work is not None:
                    return work
                self._work.wait()
        return None

    def _unsummed(self, question: Question[_Asked], now: float, no_sums: NoSums, why: str) -> None:
        """Under the lock: a queued question answered without sums, counted and logged."""
        self._refused(question.payload.release, why, "integrity_questions_busy")
        self._answer(question, now, no_sums)

    def _answer(self, question: Question[_Asked], now: float, no_sums: NoSums | None = None) -> None:
        """Under the lock: decide the question's release (after its sums: ``_release``) and set its answer."""
        asked = question.payload
        sums = None if no_sums is not None or question.sums is None else [UnitSums(t, w) for t, w in question.sums]
        try:
            reply: Reply = self._release(asked.release, now, sums, no_sums)
        except Exception as exc:  # noqa: BLE001 - answered as the side channel answers a handler that raised
            asked.answer.set_exception(exc)
        else:
            asked.answer.set_result(reply)
        finally:
            self._log_events()

    def _refused(self, release: Release, problem: str, reason: str) -> None:
        """Under the lock: a question not answered, counted and logged (a WARNING at most once a minute)."""
        self.ledger.counters[reason] += 1
        self.ledger.events.append(LedgerEvent(
            release.request_id, f"integrity question of {release.reader} not answered: {problem}", reason))
        self._log_events()

    def _sums(self, release: Release, query: DigestQuery) -> list[tuple[int, int]] | None:
        """This rank's sums of ``query`` (a slice of the release's question); None when they failed."""
        digester = self._digester
        if digester is None:
            return None
        try:
            return [(int(t), int(w)) for t, w in digester(query)]
        except Exception as exc:  # noqa: BLE001 - the release must still be answered
            logger.warning("KV hold %s: integrity sums failed: %s", release.request_id, exc)
            return None

    def _log_events(self) -> None:
        events = self.ledger.take_events()
        now = self._clock() if any(e.reason for e in events) else 0.0
        for event in events:
            if not event.reason:  # the normal course of a hold: DEBUG, one line per event (never INFO per request)
                logger.debug("KV hold %s: %s", event.request_id, event.what)
                continue
            unlogged = self._pace.allow(event.reason, now)
            if unlogged is None:
                continue
            more = f" ({unlogged} more since the last warning)" if unlogged else ""
            logger.warning("KV hold %s: %s [%s: %d so far]%s", event.request_id, event.what, event.reason,
                           self.ledger.counters[event.reason], more)

    def close(self) -> None:
        self._server.close()
        with self._work:
            self._closing = True  # the sums thread stops after the slice it reads (about 20 ms)
            self._work.notify()
        self._summer.join(timeout=5)
