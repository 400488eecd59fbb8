"""P side: the life of a finished prompt's blocks on one P worker. Pure: no sockets, threads, clocks or torch.

    hold ──▶ HELD ──claim──▶ CLAIMED ──all readers released──▶ RELEASED
               │ │              │                                  ▲
               │ └─hold timeout─▶ EXPIRED ◀─lease timeout (not renewed)─┘
               └────────abandon (no reader has touched it)─────────┘

* A hold is created when vLLM finishes a prefill whose KV a decoder will pull (``request_finished`` returned
  delay-free). Its blocks stay allocated until it is RELEASED or EXPIRED; then the request id is reported to vLLM
  as ``finished_sending`` exactly once (:meth:`ProducerLedger.take_freed`).
* A claim is a lease: while any reader holds one, the blocks are not freed even after the hold timeout, until the
  lease itself runs out without renewal. A claim is granted only for the exact hold it names (``hold_id``), so a
  replayed or late ``kv_transfer_params`` can never read blocks that were freed and reused: P refuses, D recomputes.
* Requests are freed once every reader it was told to expect has released. A release that arrives before P has
  heard of the hold (D had nothing to pull and was quick) is remembered and applied when the hold arrives.
* An abandon (``protocol.Abandon``) comes from whoever holds the hold's params and will deliver them to no
  decoder (the proxy, when D refused the request before its engine, could not be reached, or the client left):
  it frees a hold no reader has claimed or released, so such a hold lasts seconds, not ``hold_timeout``. A hold a
  reader touched is D's engine at work and ends with that reader's release; an abandon then changes nothing. It
  must name the hold id and carry the mac P signed the params with (the params are the authority), and one that
  arrives before the hold is remembered like an early release.
* Nothing here raises on a protocol violation from a peer; it answers with a refusal or ignores, and says why.
* A hold is known by its request id **and** its hold id (random per hold): a request id that comes back (reused by
  a client, or a collision of vLLM's random suffix) gets a hold of its own, and every delayed free is reported
  exactly once, whatever the ids.
* Time costs what expires, not what is held: :meth:`ProducerLedger.expire` looks only at holds whose next deadline
  (their first lease to lapse; without leases, their hold deadline) has come (lifecycle/deadline_heap.py).

Bounds (the side channel is not authenticated, so every peer is a possible attacker; docs/security.md):

* No hold pins its blocks past ``created + hold_timeout + lease_timeout`` (its ``pin_deadline``), whatever its
  claims name and however often they are renewed: leases are granted only up to it, :meth:`ProducerLedger.expire`
  frees the hold once it has passed.
* The heap of deadlines holds at most ``2 x live holds + STALE_SLACK`` entries, whatever peers send
  (lifecycle/deadline_heap.py says how).
* A claim may carry D's deadline (``deadline_ms``, D's wall clock): one that arrives ``clock_skew`` or more
  after it is refused, and no lease runs past it + ``clock_skew`` (a claim delivered late, held in a kernel
  buffer while D's link was down, pins the blocks only until D has given up, not for a whole ``lease_timeout``).
* A granted claim carries a lease token; renewing, and releasing while the lease is live, need it. So a peer
  that only knows the request, hold and reader names cannot drop a live lease (P would free blocks a reader is
  still reading). A second claim by a reader whose lease is live is refused: re-issuing the token would hand it
  to whoever asked.
* Early releases and abandons live in a small table for ``early_release_ttl``, and ended holds in a bounded one
  (lifecycle/hold_memory.py); a hold beyond ``max_holds`` is still kept (vLLM
  already delayed its free) but reported; a hold has at most ``MAX_TP_SIZE`` distinct readers; peer ids longer
  than ``MAX_ID_LENGTH`` (readers: a little more) are refused. Every refusal is counted in
  :attr:`ProducerLedger.counters` and reported as a :class:`LedgerEvent` whose ``reason`` names the counter.
* The answers kept for resent releases (:meth:`ProducerLedger.answer_release`) are the latest
  ``max_kept_answers``, at most ``max_kept_answer_bytes`` in all; older ones are forgotten first
  (:mod:`vllm_kvp2p.lifecycle.release_answers`).
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_kvp2p.contract.protocol import MAX_ID_LENGTH, MAX_TP_SIZE, AbandonOutcome, ClaimReply, ClaimStatus
from vllm_kvp2p.lifecycle import release_answers as answers
from vllm_kvp2p.lifecycle.deadline_heap import STALE_SLACK as STALE_SLACK  # re-exported (its bound, tests)
from vllm_kvp2p.lifecycle.deadline_heap import DeadlineHeap
from vllm_kvp2p.lifecycle.hold import Blocks, HeldUnits, Hold, HoldState, Lease
from vllm_kvp2p.lifecycle.hold_memory import EarlyReleases, Tombstones
from vllm_kvp2p.lifecycle.live_holds import LiveHolds
from vllm_kvp2p.lifecycle.release_answers import ReleaseAnswer
from vllm_kvp2p.transfer.descriptors import PlaneGeometry

MAX_HOLDS = 65536
MAX_EARLY_RELEASES = 4096
EARLY_RELEASE_TTL = 10.0  # seconds; D releases a hold it had nothing to read from within one P engine step
MAX_READER_LENGTH = MAX_ID_LENGTH + 8  # "<D engine id>:<D tp rank>"
CLOCK_SKEW = 30.0  # seconds P's and D's wall clocks may disagree (the clock_skew setting)


@dataclass(frozen=True)
class LedgerEvent:
    """Something worth one log line (the adapter logs it; tests assert on it)."""

    request_id: str
    what: str
    reason: str = ""  # the counter a refusal or a bound hit was counted under ("": an ordinary event)


class ProducerLedger:
    """Holds, claims and releases of one P worker."""

    def __init__(
        self,
        hold_timeout: float,
        lease_timeout: float,
        tombstones: int = 65536,
        *,
        max_holds: int = MAX_HOLDS,
        max_early_releases: int = MAX_EARLY_RELEASES,
        early_release_ttl: float = EARLY_RELEASE_TTL,
        clock_skew: float = CLOCK_SKEW,
        max_kept_answers: int = answers.MAX_KEPT_ANSWERS,
        max_kept_answer_bytes: int = answers.MAX_KEPT_ANSWER_BYTES,
        token_factory: Callable[[], str] = lambda: secrets.token_hex(16),
    ) -> None:
        self.hold_timeout = hold_timeout
        self.lease_timeout = lease_timeout
        self.clock_skew = clock_skew
        self.max_holds = max_holds
        self._token_factory = token_factory
        self._holds = LiveHolds()
        self._deadlines = DeadlineHeap(self._holds)  # when to look at each live hold next
        # Releases and abandons of holds P has not heard of yet; how recent holds ended.
        self._early = EarlyReleases(max_early_releases, min(early_release_ttl, hold_timeout))
        self._tombstones = Tombstones(tombstones)
        # The answer each reader's first release got, for that release resent (answer_release).
        self.kept_answers = answers.KeptAnswers(max_kept_answers, max_kept_answer_bytes)
        self._freed: list[str] = []
        self.events: list[LedgerEvent] = []
        self.counters: Counter[str] = Counter()
        # Holds created, released and expired, claims refused: for the metrics (taken and reset by the caller).
        self.tally: Counter[str] = Counter()

    # ------------------------------------------------------------------ queries

    def state(self, request_id: str, hold_id: str | None = None) -> HoldState | None:
        """The state of the hold (its newest, when ``hold_id`` is not given; for tests and logs)."""
        if hold_id is None:
            live = self._holds.hold_ids_of(request_id)
            if live:
                return self._holds[(request_id, next(iter(live)))].state
            return next((stone.state for stone in self._tombstones.newest_of(request_id)), None)
        hold = self._holds.get((request_id, hold_id))
        if hold is not None:
            return hold.state
        stone = self._tombstones.get((request_id, hold_id))
        return stone.state if stone is not None else None

    @property
    def early_release_ttl(self) -> float:
        """Seconds a release or abandon that came before its hold is kept (never more than ``hold_timeout``)."""
        return self._early.ttl

    @property
    def blocks_held(self) -> int:
        """Of the live holds, as vLLM counted them when it kept the blocks."""
        return self._holds.blocks

    @property
    def active(self) -> int:
        return len(self._holds)

    def oldest_hold_age(self, now: float) -> float:
        """Seconds since the oldest live hold was created (holds are kept in creation order), 0 without any."""
        oldest = self._holds.oldest()
        return max(0.0, now - oldest.created) if oldest is not None else 0.0

    def table_sizes(self) -> dict[str, int]:
        """Entries in each table (for tests and metrics); ``readers_per_hold`` is the largest."""
        return {
            "holds": len(self._holds),
            "early_releases": len(self._early),
            "tombstones": len(self._tombstones),
            "freed": len(self._freed),
            "deadlines": len(self._deadlines),
            "readers_per_hold": self._holds.readers_per_hold,
            "kept_answers": len(self.kept_answers),
        }

    # ------------------------------------------------------------------ events from vLLM

    def hold(self, request_id: str, hold_id: str, now: float, num_blocks: int = 0, blocks: Blocks = (),
             mac: str = "") -> None:
        """vLLM kept ``request_id``'s ``num_blocks`` blocks for a decoder, offering ``blocks`` (per group) in params
        signed with ``mac`` ("" unsigned)."""
        key = (request_id, hold_id)
        if key in self._holds or key in self._tombstones:
            self._event(request_id, "duplicate hold ignored (the same hold announced twice)")
            return
        if self._holds.hold_ids_of(request_id):
            self._event(request_id, "a second live hold for this request id (kept apart by its hold id)")
        if len(self._holds) >= self.max_holds:
            # vLLM already kept the blocks: dropping the hold would leak them. Keep it, say so.
            self._refuse(request_id, "holds_over_limit", f"{len(self._holds) + 1} holds, more than max_holds="
                         f"{self.max_holds} (kept: vLLM already delayed the free)")
        hold = Hold(request_id, hold_id, now + self.hold_timeout, now + self.hold_timeout + self.lease_timeout,
                     created=now, num_blocks=max(0, num_blocks), blocks=blocks, mac=mac)
        self._holds.add(hold)
        self.tally["created"] += 1
        self._deadlines.due_by(hold, hold.hold_deadline)
        early = self._early.pop(key)
        if early is not None and early.readers:
            hold.expected_readers = early.expected_readers
            self._holds.recount(hold, lambda: hold.released_by.update(early.readers))
            self._maybe_release(hold, "released before the hold arrived")
        elif early is not None and early.abandon_mac is not None:
            self._apply_abandon(hold, early.abandon_mac, "before the hold arrived")

    # ------------------------------------------------------------------ events from decoders

    def claim(
        self, request_id: str, hold_id: str, reader: str, expected_readers: int, now: float, claim_id: str = "",
        *, deadline_ms: int = 0, wall_now_ms: int = 0,
    ) -> ClaimReply:
        """``deadline_ms``: D's wall clock (ms since the epoch) after which it no longer reads for this pull, 0 if
        not given (an older D); ``wall_now_ms``: P's wall clock now. A claim that arrives ``clock_skew`` or more
        after its deadline is refused, and its lease never runs past deadline + ``clock_skew``."""
        bad = self._bad_ids(request_id, hold_id, reader)
        if bad:
            return ClaimReply(ClaimStatus.REFUSED, reason=bad)
        late_ms = wall_now_ms - deadline_ms
        if deadline_ms > 0 and late_ms >= self.clock_skew * 1000:  # at clock_skew exactly: no time left to lease
            self._refuse(request_id, "claim_after_deadline", f"claim by {reader} refused: it arrived "
                         f"{late_ms / 1000:.1f} s after D's deadline (clock_skew {self.clock_skew:g} s; D had "
                         "given up on the pull: delivered late, or the clocks disagree)")
            return ClaimReply(ClaimStatus.REFUSED, reason="the claim arrived after D's deadline")
        hold = self._holds.get((request_id, hold_id))
        if hold is None:
            final = self._tombstones.get((request_id, hold_id))
            if final is not None:
                self._event(request_id, f"claim by {reader} refused: hold already {final.state.value}")
                return ClaimReply(ClaimStatus.REFUSED, reason=f"blocks already {final.state.value}")
            if self._holds.hold_ids_of(request_id):
                self._event(request_id, f"claim by {reader} refused: stale hold id")
                return ClaimReply(ClaimStatus.REFUSED, reason="hold id does not match (stale transfer params)")
            return ClaimReply(ClaimStatus.UNKNOWN, reason="no such hold (yet)")
        if reader in hold.released_by:
            return ClaimReply(ClaimStatus.REFUSED, reason="reader already released this hold")
        lease = hold.leases.get(reader)
        if lease is not None and claim_id and secrets.compare_digest(claim_id.encode(), lease.claim_id.encode()):
            # The same claim resent (its reply was lost): the same lease, refreshed up to its cap (the first
            # claim's deadline: a resend cannot move it). Only later, so the hold's heap entry stays.
            lease = lease.extended(now, self.lease_timeout)
            if lease.until <= now:
                self._refuse(request_id, "claim_past_deadline", f"resent claim by {reader} refused: its lease "
                             "ran to its cap")
                return ClaimReply(ClaimStatus.REFUSED, reason="blocks pinned as long as allowed")
            hold.grant(reader, lease)
            return ClaimReply(ClaimStatus.GRANTED, lease=lease.until - now, lease_token=lease.token)
        if lease is not None:
            # Someone else naming this reader (another claim id): the token stays secret.
            self._refuse(request_id, "claim_refused_live_lease", f"second claim by {reader} refused: its lease "
                         "is live")
            return ClaimReply(ClaimStatus.REFUSED, reason="reader already holds a lease on this hold")
        if hold.num_readers >= MAX_TP_SIZE:
            self._refuse(request_id, "readers_per_hold_full", f"claim by {reader} refused: {MAX_TP_SIZE} readers")
            return ClaimReply(ClaimStatus.REFUSED, reason=f"hold already has {MAX_TP_SIZE} readers")
        cap = hold.pin_deadline
        if deadline_ms > 0:  # D's deadline on P's clock, as of now: after it no D reads for this claim
            cap = min(cap, now - late_ms / 1000 + self.clock_skew)
        until = min(now + self.lease_timeout, cap)
        if until <= now:
            self._refuse(request_id, "claim_past_deadline", f"claim by {reader} refused: past the hold's hard "
                         "deadline")
            return ClaimReply(ClaimStatus.REFUSED, reason="blocks pinned as long as allowed")
        hold.expected_readers = max(hold.expected_readers, self._readers(request_id, expected_readers))
        lease = Lease(until, cap, self._token_factory(), claim_id[:MAX_ID_LENGTH])
        self._holds.recount(hold, lambda: hold.grant(reader, lease))
        self._deadlines.due_by(hold, until)
        return ClaimReply(ClaimStatus.GRANTED, lease=until - now, lease_token=lease.token)

    def renew(self, request_id: str, hold_id: str, reader: str, now: float, lease_token: str = "") -> ClaimReply:
        bad = self._bad_ids(request_id, hold_id, reader)
        if bad:
            return ClaimReply(ClaimStatus.REFUSED, reason=bad)
        hold = self._holds.get((request_id, hold_id))
        lease = hold.leases.get(reader) if hold is not None else None
        if hold is None or lease is None:
            return ClaimReply(ClaimStatus.REFUSED, reason="no live claim to renew")
        if not secrets.compare_digest(lease_token.encode(), lease.token.encode()):
            self._refuse(request_id, "renew_refused", f"renewal for {reader} refused: wrong lease token")
            return ClaimReply(ClaimStatus.REFUSED, reason="lease token does not match the claim")
        renewed = lease.extended(now, self.lease_timeout)
        if lease.until >= lease.cap or renewed.until <= now:
            # Nothing left to extend: the reader stops now, before P frees the blocks at the deadline.
            bound = (f"hold_timeout + lease_timeout = {self.hold_timeout + self.lease_timeout:g}s"
                     if lease.cap >= hold.pin_deadline else f"the claim's deadline + clock_skew {self.clock_skew:g}s")
            self._refuse(request_id, "renew_past_deadline", f"renewal for {reader} refused: blocks pinned for "
                         f"{bound}")
            return ClaimReply(ClaimStatus.REFUSED, reason="blocks pinned as long as allowed")
        if renewed.until == lease.cap:
            self.counters["lease_cut_to_deadline"] += 1
        hold.grant(reader, renewed)  # later only: the hold's heap entry stays (expire() files it again)
        return ClaimReply(ClaimStatus.GRANTED, lease=renewed.until - now, lease_token=lease_token)

    def abandon(self, request_id: str, hold_id: str, mac: str, now: float, *, remember: bool = True
                ) -> tuple[AbandonOutcome, str]:
        """The holder of the hold's params will deliver them to no decoder (vllm_kvp2p/protocol.Abandon): free the
        hold now if no reader has touched it. ``mac``: the params' (what P issued with the hold; "" unsigned). A
        hold P has not heard of yet is remembered like an early release and freed when it arrives, unless
        ``remember`` is false (an unsealed abandon at a P with a secret: its mac cannot be checked before the hold
        arrives, so it must not take room an authenticated early release needs; the sender asks again). Returns
        the outcome and why."""
        bad = self._bad_ids(request_id, hold_id, "")
        if bad:
            return AbandonOutcome.REFUSED, bad
        key = (request_id, hold_id)
        hold = self._holds.get(key)
        if hold is not None:
            return self._apply_abandon(hold, mac, "")
        final = self._tombstones.get(key)
        if final is not None:
            return AbandonOutcome.ENDED, f"hold already {final.state.value}"
        if self._holds.hold_ids_of(request_id):
            self._refuse(request_id, "abandon_refused", "abandon refused: stale hold id")
            return AbandonOutcome.REFUSED, "hold id does not match (stale transfer params)"
        prev = self._early.get(key)
        if prev is not None and prev.readers:
            return AbandonOutcome.IN_USE, "a reader released it before P heard of it"
        if not remember:
            return AbandonOutcome.UNKNOWN, "P has not heard of the hold yet: send the abandon again"
        if prev is None and not self._early_room(request_id, "abandon", now):
            return AbandonOutcome.REFUSED, "too many early releases waiting"
        self._early.put(key, frozenset(), 1, now, abandon_mac=mac)
        return AbandonOutcome.REMEMBERED, "P has not heard of the hold yet: freed when it arrives"

    def _apply_abandon(self, hold: Hold, mac: str, when: str) -> tuple[AbandonOutcome, str]:
        if not secrets.compare_digest(mac.encode(), hold.mac.encode()):
            self._refuse(hold.request_id, "abandon_refused", f"abandon refused{' ' + when if when else ''}: its mac "
                         "is not the one P signed the hold's params with")
            return AbandonOutcome.REFUSED, "the mac does not match the hold's params"
        if not hold.untouched:
            self._event(hold.request_id, "abandon ignored: a reader claimed or released the hold (its release ends it)")
            return AbandonOutcome.IN_USE, "a reader claimed or released the hold"
        self.tally["abandoned"] += 1
        self._finish(hold, HoldState.RELEASED, "abandoned by the holder of its params" + (f" ({when})" if when else "")
                     + ": no decoder will claim it")
        return AbandonOutcome.RELEASED, ""

    def verifiable_units(self, request_id: str, hold_id: str, reader: str, now: float, lease_token: str,
                         planes: Sequence[PlaneGeometry], plane_groups: Sequence[int]) -> HeldUnits | None:
        """What an integrity question from ``reader`` may name (vllm_kvp2p/lifecycle/integrity.py): the hold's offered
        blocks in the ``planes`` of their group, while that reader's lease is live and the release carries its token;
        else None (P answers nothing: its blocks may not be the ones the reader read)."""
        hold = self._holds.get((request_id, hold_id))
        lease = hold.leases.get(reader) if hold is not None else None
        if hold is None or lease is None or lease.until <= now:
            return None
        if not secrets.compare_digest(lease_token.encode(), lease.token.encode()):
            return None
        return hold.held_units(plane_groups, planes)  # made once per hold

    def answer_release(
        self, request_id: str, hold_id: str, reader: str, expected_readers: int, now: float, lease_token: str = "",
        pulled: bool = False, *, question: bytes = b"", sums: bytes | None = None,
    ) -> ReleaseAnswer:
        """:meth:`release`, and the answer to the release's integrity question
        (:meth:`~vllm_kvp2p.lifecycle.release_answers.KeptAnswers.answer`). ``question``: what identifies the release
        that asks one (the adapter's fingerprint of the whole release, its lease token included; b"": none asked);
        ``sums``: the adapter's answer, computed while the reader's lease was live (None: not answered)."""
        hold = self._holds.get((request_id, hold_id))
        ends_lease = hold is not None and reader in hold.leases
        held = self.release(request_id, hold_id, reader, expected_readers, now, lease_token, pulled)
        # A reader that did not pull asked nothing P can answer.
        return self.kept_answers.answer((request_id, hold_id, reader), held, ends_lease, question if pulled else b"",
                                        sums)

    def release(
        self, request_id: str, hold_id: str, reader: str, expected_readers: int, now: float, lease_token: str = "",
        pulled: bool = False,
    ) -> bool:
        """The reader is done. Returns whether P confirms what a reader that ``pulled`` needs to count its read
        as good: its lease held, unbroken, from its claim to this release (the blocks were neither freed nor
        reused). A reader that did not pull gets True (there is nothing to confirm)."""
        bad = self._bad_ids(request_id, hold_id, reader)
        if bad:
            return False
        expected_readers = self._readers(request_id, expected_readers)
        key = (request_id, hold_id)
        hold = self._holds.get(key)
        if hold is None:
            final = self._tombstones.get(key)
            if final is not None:
                confirmed = reader in final.confirmed  # the same release again (its reply was lost)
                self._event(request_id, f"release by {reader} ignored: hold already {final.state.value}")
                return confirmed or not pulled
            if self._holds.hold_ids_of(request_id):
                self._event(request_id, f"release by {reader} ignored: stale hold id")
                return not pulled
            self._remember_early(request_id, hold_id, reader, expected_readers, now)
            return not pulled  # P never held it for this reader: nothing it read can be confirmed
        lease = hold.leases.get(reader)
        if lease is not None and not secrets.compare_digest(lease_token.encode(), lease.token.encode()):
            self._refuse(request_id, "release_without_token", f"release by {reader} ignored: its lease is live "
                         "and the release does not carry its token")
            return False
        if not hold.knows(reader) and hold.num_readers >= MAX_TP_SIZE:
            self._refuse(request_id, "readers_per_hold_full", f"release by {reader} ignored: {MAX_TP_SIZE} readers")
            return False
        hold.expected_readers = max(hold.expected_readers, expected_readers)
        held = self._holds.recount(hold, lambda: hold.release_reader(reader, now, pulled))
        self._maybe_release(hold, "released by all readers")
        if not hold.state.final and not hold.leases:
            self._deadlines.due_by(hold, hold.hold_deadline)  # its hold deadline may have passed under a lease
        if pulled and not held:
            self._event(request_id, f"release by {reader}: its lease had lapsed, the read is not confirmed")
        return held

    # ------------------------------------------------------------------ time

    def expire(self, now: float) -> None:
        """Free holds nobody claimed in time, claims nobody renewed in time, and holds at their hard deadline. Costs
        what is due: holds whose deadlines have not come are not looked at."""
        for hold in self._deadlines.pop_due(now):
            if hold.next_deadline() <= now:  # else renewed since it was filed: filed again below
                self._expire_one(hold, now)
            if not hold.state.final:
                self._deadlines.due_by(hold, hold.next_deadline())
        self._early.drop_expired(now)

    def _expire_one(self, hold: Hold, now: float) -> None:
        # Leases are granted only up to the hard deadline, so at it all lapse; say why.
        capped = hold.pin_deadline <= now and any(lease.until >= hold.pin_deadline for lease in hold.leases.values())
        lapsed = self._holds.recount(hold, lambda: hold.lapse(now))
        if capped:
            self.counters["hold_capped"] += 1
            self._finish(hold, HoldState.EXPIRED, "pinned for hold_timeout + lease_timeout = "
                         f"{self.hold_timeout + self.lease_timeout:g}s, the most a hold may be", "hold_capped")
            return
        if lapsed and not hold.leases:
            # The reader vanished mid-transfer (no release, no renewal): nobody can be reading any more.
            at_d_deadline = any(lease.until >= lease.cap for lease in lapsed.values())
            why = (f"lease of {', '.join(lapsed)} lapsed " + ("at its claim's deadline + clock_skew (D had given up "
                   "on the pull)" if at_d_deadline else f"after {self.lease_timeout:g}s (the decoder neither renewed "
                   "nor released it: it died or was cut off mid-pull; lease_timeout, VLLM_KVP2P_LEASE_TIMEOUT)"))
            self.counters["lease_lapsed"] += 1
            self._finish(hold, HoldState.EXPIRED, why, "lease_lapsed")
            return
        if hold.leases or hold.hold_deadline > now:
            return
        self.counters["hold_expired"] += 1
        self._finish(hold, HoldState.EXPIRED, f"not released within hold_timeout={self.hold_timeout:g}s (no decoder "
                     "claimed it in time: D down, queued longer, or the client never sent D the params; raise "
                     "VLLM_KVP2P_HOLD_TIMEOUT if D queues longer)", "hold_expired")

    def take_freed(self) -> list[str]:
        """Request ids whose blocks vLLM may free now; each id is returned exactly once."""
        freed, self._freed = self._freed, []
        return freed

    def take_events(self) -> list[LedgerEvent]:
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------------ internals

    def _remember_early(self, request_id: str, hold_id: str, reader: str, expected_readers: int, now: float) -> None:
        key = (request_id, hold_id)
        prev = self._early.pop(key)
        if prev is None and not self._early_room(request_id, f"release by {reader}", now):
            return
        readers = (prev.readers if prev else frozenset()) | {reader}
        if len(readers) > MAX_TP_SIZE and prev is not None:
            self._refuse(request_id, "readers_per_hold_full", f"release by {reader} ignored: {MAX_TP_SIZE} readers")
            readers = prev.readers
        self._early.put(key, readers, expected_readers, now)

    def _early_room(self, request_id: str, what: str, now: float) -> bool:
        """Whether one more early entry fits (expired ones dropped first); if not, counted and said."""
        if self._early.has_room(now):
            return True
        self._refuse(request_id, "early_release_table_full", f"{what} before the hold not kept: "
                     f"{self._early.max_entries} early releases already waiting (the hold then waits for "
                     "hold_timeout)")
        return False

    def _readers(self, request_id: str, expected_readers: int) -> int:
        if expected_readers > MAX_TP_SIZE:
            self._refuse(request_id, "expected_readers_capped", f"expected_readers={expected_readers} capped at "
                         f"{MAX_TP_SIZE}")
            return MAX_TP_SIZE
        return max(1, expected_readers)

    def _bad_ids(self, request_id: str, hold_id: str, reader: str) -> str:
        if len(request_id) > MAX_ID_LENGTH or len(hold_id) > MAX_ID_LENGTH or len(reader) > MAX_READER_LENGTH:
            self._refuse(request_id[:MAX_ID_LENGTH], "id_too_long", f"message with an id of more than "
                         f"{MAX_ID_LENGTH} characters ignored")
            return f"ids have at most {MAX_ID_LENGTH} characters"
        return ""

    def _maybe_release(self, hold: Hold, why: str) -> None:
        if hold.all_released:
            self._finish(hold, HoldState.RELEASED, why)

    def _finish(self, hold: Hold, state: HoldState, why: str, reason: str = "") -> None:
        self._holds.remove(hold)
        self._deadlines.forget(hold)
        hold.state = state
        self.tally[state.value] += 1
        self._tombstones.add(hold.key, state, frozenset(hold.confirmed))
        self._freed.append(hold.request_id)
        self._event(hold.request_id, f"{state.value}: {why}", reason)

    def _refuse(self, request_id: str, reason: str, what: str) -> None:
        self.counters[reason] += 1
        self._event(request_id, what, reason)

    def _event(self, request_id: str, what: str, reason: str = "") -> None:
        self.events.append(LedgerEvent(request_id, what, reason))
