"""P side at run time: one worker's :class:`ProducerLedger`, its clock and lock, and the side channel D talks to.

The ledger decides; this module only feeds it events (holds from vLLM's scheduler metadata, claims and releases
from the side channel, the passing of time) and logs what it reports. A refusal or bound hit (an event with a
``reason``, which peers can cause at will) is logged as a WARNING at most once a minute per reason, with the count
of those not logged since; the ledger's ``counters`` have them all.

Integrity questions (D's release asks P's sums of the bytes it read, vllm_kvp2p/lifecycle/integrity.py) are
answered only about the asking reader's own hold and within its bytes (``query_problem``), and checked and summed
on a thread of their own, not the side channel's (which only checks the lease and queues the question): the
release is answered once its sums are done (the side channel defers that answer and meanwhile serves every other
claim, renewal and release of this rank). Why a thread and not only
the byte bound: the bound makes a question cost at most a pass over the bytes one honest pull of the hold moved,
and for a large hold that is long. A question names at most 4096 units (a 64 KiB frame); one unit of a dense 8B
model at TP 1 and block size 128 is 512 KiB (8 KV heads x 128 x bf16 x K and V x 128 tokens), so the hold of a
16k-token prompt (4096 block-layers) admits a 2 GiB question: 2.4-3.3 s of one core at the 1.2-1.6 ms/MiB
measured (one torch thread; docs/reliability.md). The thread takes one question at a time; at most
``MAX_PENDING_QUESTIONS`` wait (more are answered at once without sums: D counts those pulls unverified); a
release resent while its sums run (D's client resends after 0.5 s) waits for the same answer, not a second sum;
one resent after it was answered gets the answer the ledger kept (ProducerLedger.answer_release, bounded), or,
once that is forgotten, a reply that says so (``Released.sums_lost``: D counts the pull apart, never verified).
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import msgspec

from vllm_kvp2p import os_threads
from vllm_kvp2p.auth import Authenticator
from vllm_kvp2p.lifecycle.hold import HeldUnits
from vllm_kvp2p.lifecycle.integrity import query_problem
from vllm_kvp2p.lifecycle.producer import (
    CLOCK_SKEW,
    EARLY_RELEASE_TTL,
    MAX_EARLY_RELEASES,
    MAX_HOLDS,
    LedgerEvent,
    ProducerLedger,
)
from vllm_kvp2p.log import get_logger
from vllm_kvp2p.os_threads import run_named
from vllm_kvp2p.protocol import (
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
from vllm_kvp2p.side_channel import SideChannelServer

logger = get_logger(__name__)

WARNING_INTERVAL = 60.0  # seconds between two warnings of one reason
MAX_PENDING_QUESTIONS = 64  # integrity questions waiting for their sums at once (one per reader's release)

_ReleaseKey = tuple[str, str, str]  # (request id, hold id, reader)
_SUMS_ENCODER = msgspec.msgpack.Encoder()  # an answer, as the ledger keeps it
_SUMS_DECODER = msgspec.msgpack.Decoder(list[tuple[int, int]])  # UnitSums is array_like: [total, weighted]


def _fingerprint(release: Release) -> bytes:
    """What identifies a release that asks an integrity question (b"": it asks none): only the same release,
    lease token and question included, gets the answer kept for it."""
    return hashlib.sha256(msgspec.msgpack.encode(release)).digest() if release.verify is not None else b""


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
    ) -> None:
        """``on_release``: called (on the side-channel thread) after each release, which may free a hold.
        ``digester``: this rank's byte sums over a question's units (vllm_kvp2p/transfer/digest.py: sums_of_units
        over its KV memory); None answers no integrity question (D counts its pulls unverified).
        ``clock_skew``: seconds P's and D's wall clocks may disagree (a claim's deadline is D's wall clock)."""
        self.registration = registration
        # Every rank of this engine (set once the ranks gathered it, vllm_kvp2p/worker.py); None: not yet.
        self.rank_table: RankTable | None = None
        self._on_release = on_release
        self._digester = digester
        self.ledger = ProducerLedger(
            hold_timeout, lease_timeout, max_holds=max_holds, max_early_releases=max_early_releases,
            early_release_ttl=early_release_ttl, clock_skew=clock_skew,
        )
        self._clock = clock
        self._warned_at: dict[str, float] = {}  # reason -> when it was last logged
        self._unlogged: dict[str, int] = {}  # reason -> events since then not logged
        self._lock = threading.Lock()
        self._held_over: list[str] = []  # freed ids reported again at the next take_freed (see there)
        self._dropped_reported: Counter[str] = Counter()  # side-channel drops already in the metrics
        self._plane_groups = registration.group_of_planes()
        # Releases whose question is being summed, and the answer each will get; the questions, in order.
        self._pending: dict[_ReleaseKey, tuple[Release, Future[Reply]]] = {}
        self._questions: queue.SimpleQueue[tuple[Release, HeldUnits, Future[Reply]] | None] = queue.SimpleQueue()
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
            return {**self.ledger.table_sizes(), "questions_waiting": len(self._pending)}

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

    def _handle(self, message: Request) -> Reply | Future[Reply]:
        if isinstance(message, Release):
            deferred = self._defer(message)
            if deferred is not None:
                return deferred
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
                if isinstance(message, Release):
                    return self._release(message, now, None)
                if isinstance(message, Abandon):
                    outcome, why = self.ledger.abandon(message.request_id, message.hold_id, message.mac, now)
                    logger.debug("KV hold %s (hold %s): abandoned: %s %s", message.request_id, message.hold_id,
                                 outcome.value, why)
                    if outcome is AbandonOutcome.RELEASED and self._on_release is not None:
                        self._on_release()
                    return Abandoned(outcome, why)
                return ErrorReply(f"unexpected message {type(message).__name__}")
            finally:
                self._log_events()

    def _release(self, message: Release, now: float, sums: list[UnitSums] | None) -> Released:
        """Under the lock. The release is decided after the sums: if the lease lapsed meanwhile (and the blocks may
        have been reused), P does not confirm the read, and D does not count it whatever the sums. The ledger keeps
        the answer for the same release resent (ProducerLedger.answer_release)."""
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
        return Released(answer.lease_held, kept, sums_lost=answer.sums_lost)

    def _defer(self, release: Release) -> Reply | Future[Reply] | None:
        """On the side-channel thread, in O(1): the answer to a release whose question P checks and sums on its own
        thread (a Future), one for a release while this reader's is there, or None: handled at once (no question,
        the reader's lease not live, or too many waiting)."""
        key = (release.request_id, release.hold_id, release.reader)
        with self._lock:
            waiting = self._pending.get(key)
            if waiting is not None:  # the same release resent (D gave up on its first socket): the same answer
                if waiting[0] == release:
                    return waiting[1]
                return ErrorReply("this reader's release is being answered (its integrity sums run): send it later")
            if release.verify is None or self._digester is None:
                return None
            held = self.ledger.verifiable_units(release.request_id, release.hold_id, release.reader, self._clock(),
                                                release.lease_token, self.registration.planes, self._plane_groups)
            if held is None:
                logger.debug("KV hold %s: integrity question of %s not answered: the reader holds no live lease",
                             release.request_id, release.reader)
                return None
            if len(self._pending) >= MAX_PENDING_QUESTIONS:
                self._refused(release, f"{MAX_PENDING_QUESTIONS} questions already wait", "integrity_questions_waiting")
                return None
            future: Future[Reply] = Future()
            self._pending[key] = (release, future)
        self._questions.put((release, held, future))
        return future

    def _sum_questions(self) -> None:
        """The questions' thread: checks and sums one question, then decides its release (under the lock) and sets
        its answer."""
        while (item := self._questions.get()) is not None:
            release, held, future = item
            try:
                assert release.verify is not None
                problem = query_problem(release.verify, self.registration.planes, held)
                sums = None if problem else self._sums(release)
                with self._lock:
                    try:
                        if problem:
                            self._refused(release, problem, "integrity_question_refused")
                        reply: Reply = self._release(release, self._clock(), sums)
                    finally:
                        self._pending.pop((release.request_id, release.hold_id, release.reader), None)
                        self._log_events()
            except Exception as exc:  # noqa: BLE001 - answered as the side channel answers a handler that raised
                future.set_exception(exc)
            else:
                future.set_result(reply)

    def _refused(self, release: Release, problem: str, reason: str) -> None:
        """Under the lock: a question not answered, counted and logged (a WARNING at most once a minute)."""
        self.ledger.counters[reason] += 1
        self.ledger.events.append(LedgerEvent(
            release.request_id, f"integrity question of {release.reader} not answered: {problem}", reason))
        self._log_events()

    def _sums(self, release: Release) -> list[UnitSums] | None:
        digester = self._digester
        if release.verify is None or digester is None:
            return None
        try:
            return [UnitSums(t, w) for t, w in digester(release.verify)]
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
            last = self._warned_at.get(event.reason)
            if last is not None and now - last < WARNING_INTERVAL:
                self._unlogged[event.reason] = self._unlogged.get(event.reason, 0) + 1
                continue
            self._warned_at[event.reason] = now
            unlogged = self._unlogged.pop(event.reason, 0)
            more = f" ({unlogged} more since the last warning)" if unlogged else ""
            logger.warning("KV hold %s: %s [%s: %d so far]%s", event.request_id, event.what, event.reason,
                           self.ledger.counters[event.reason], more)

    def close(self) -> None:
        self._server.close()
        self._questions.put(None)
        self._summer.join(timeout=5)
