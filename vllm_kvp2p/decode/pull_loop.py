"""D side at run time: the background thread that carries out pull plans, off the model's forward path.

For each plan it drives a :class:`~vllm_kvp2p.lifecycle.consumer.ConsumerPull` (which decides everything) by
performing its actions: side-channel requests, Mooncake reads, waits.

Threads ("lanes"): how plans are spread over them, per P instance, is :mod:`vllm_kvp2p.decode.pull_lanes`.

Every table here is bounded (the params a client sends name the P instances, so their number is not ours to
trust): lane assignments, suspects and cached registrations keep the most recent ``MAX_PEERS`` entries;
:meth:`PullLoop.table_sizes` reports them (a soak checks they return to their idle sizes).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.config import READ_RETRY_WITHIN, READ_SLOT_WAIT_S
from vllm_kvp2p.contract.protocol import (
    ANY_PORT,
    MAX_ENGINE_RANKS,
    ClaimReply,
    GetRegistration,
    PortRanges,
    RankRegistration,
    Registration,
    Released,
    RemotePrefill,
    Reply,
    Request,
)
from vllm_kvp2p.contract.side_channel import (
    PROBE_TIMEOUT_S,
    BadReply,
    PeerError,
    SideChannelClient,
    SideChannelError,
    Unauthenticated,
)
from vllm_kvp2p.decode.pull_lanes import Lane, LaneTable
from vllm_kvp2p.decode.pull_log import PullLog
from vllm_kvp2p.decode.pull_suspects import Suspects, put_recent
from vllm_kvp2p.decode.rank_tables import RankTables
from vllm_kvp2p.lifecycle.consumer import Failure, PullPlan
from vllm_kvp2p.lifecycle.integrity import IntegrityMode, Verification, pull_mode
from vllm_kvp2p.lifecycle.pull import (
    ConsumerPull,
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
from vllm_kvp2p.lifecycle.stages import sources_of
from vllm_kvp2p.log import get_logger
from vllm_kvp2p.transfer.engine import MooncakeEngine, TransferEngineError
from vllm_kvp2p.transfer.tp_mapping import Layout, UnsupportedLayout, rank_plan

if TYPE_CHECKING:
    from vllm_kvp2p.transfer.digest import KVMemory

logger = get_logger(__name__)

R = TypeVar("R", bound=Reply)  # one of the reply types
#: A side-channel round trip or Mooncake read slower than this is logged (with the action and P rank).
SLOW_ACTION_S = 1.0


@dataclass(frozen=True)
class TimedResult:
    result: PullResult
    seconds: float  # from the plan reaching the thread to P's release being sent
    claim_seconds: float | None = None  # the round trip of the pull's first claim (whatever P answered)


class PullLoop:
    """Runs pull plans on daemon threads, up to ``LANES_PER_PEER`` lanes per P instance
    (vllm_kvp2p/decode/pull_lanes.py);
    results are collected with :meth:`take_results`."""

    def __init__(
        self,
        engine: MooncakeEngine,
        *,
        reader: str,
        tp_size: int,
        tp_rank: int,
        local: LocalKV,
        side_channel_timeout: float,
        claim_wait: float,
        max_batch_entries: int,
        after_pull: Callable[[PullPlan, PullResult], None] | None = None,
        before_verify: Callable[[PullPlan, Verification], None] | None = None,
        max_threads: int = 4,
        pull_timeout: float = 60.0,
        auth: Authenticator | None = None,
        suspect_time: float = 10.0,
        on_result: Callable[[], None] | None = None,
        integrity: IntegrityMode = IntegrityMode.OFF,
        sampled_units: int = 4,
        sampled_pulls: float = 1.0,
        memory: KVMemory | None = None,
        peer_ports: PortRanges = ANY_PORT,
    ) -> None:
        """``on_result``: called (on a pull thread) after each result is ready for :meth:`take_results`.
        ``integrity``: which units of each pull are verified (vllm_kvp2p/lifecycle/integrity.py), summed in
        ``memory`` (this rank's KV memory; None: nothing verified)."""
        self.engine = engine
        self.integrity = integrity if memory is not None else IntegrityMode.OFF
        self.sampled_units = sampled_units
        self.sampled_pulls = sampled_pulls
        self.memory = memory
        self.reader = reader
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.local = local
        self.side_channel_timeout = side_channel_timeout
        self.claim_wait = claim_wait
        self.max_batch_entries = max_batch_entries
        self.after_pull = after_pull
        self.before_verify = before_verify  # test hook: sees what a pull read before its integrity check
        self.on_result = on_result
        self.pull_timeout = pull_timeout
        self.auth = auth
        # P instances one of whose ranks did not answer lately (vllm_kvp2p/decode/pull_suspects.py).
        self.suspects = Suspects(suspect_time)
        if auth is None:
            logger.warning("rank %d: side channel unauthenticated (no VLLM_KVP2P_SECRET): D trusts any peer the "
                           "params name within peer_ports; docs/security.md", tp_rank)
        # Registration of each P rank's side channel (host, port), fetched once and only stored once a pull
        # accepted it (it matched the params and this D); dropped whenever a pull with it fails. Keyed by
        # endpoint, not by the engine id the params claim, so params naming another host cannot replace it.
        self._registrations: OrderedDict[tuple[str, int], RankRegistration] = OrderedDict()
        self.rank_tables = RankTables(peer_ports)  # where each rank of a P engine listens
        self._results: list[TimedResult] = []
        self._results_lock = threading.Lock()
        self.max_threads = max(1, max_threads)
        self._clients: list[SideChannelClient] = []  # one per lane thread, for table_sizes
        self._clients_lock = threading.Lock()
        self._claim_seconds: dict[str, float] = {}  # request id -> its claim's round trip, until published
        self._stopping = threading.Event()  # close(): pulls stop reading and only release
        self._log = PullLog()  # what finished pulls tell the operator
        self.lanes = LaneTable(self.max_threads, self._run, f"kvp2p-pull:{tp_rank}")

    def submit(self, plan: PullPlan) -> None:
        self.lanes.take((plan.remote.remote_host, plan.remote.remote_port)).plans.put(plan)

    def table_sizes(self) -> dict[str, int]:
        """Entries in each table: when idle, ``queued_plans``, ``results`` and ``suspects`` (those not yet
        expired) are 0 and the others at most one per P instance (or rank) pulled from lately. Approximate while
        pulls run (read without the threads' own locking)."""
        instances, queued = self.lanes.sizes()
        with self._clients_lock:
            clients = list(self._clients)
        return {
            "queued_plans": queued,
            "instances": instances,
            "suspects": len(self.suspects),
            "registrations": len(self._registrations),
            "rank_tables": len(self.rank_tables),
            "sockets": sum(c.open_sockets for c in clients),
            "results": len(self._results),
        }

    def take_results(self) -> list[TimedResult]:
        with self._results_lock:
            results, self._results = self._results, []
        return results

    def close(self, read_timeout: float = 30.0) -> bool:
        """Stop: pulls in progress and queued stop reading and release P (each within its release budget), then
        the threads end. Bounded: a Mooncake read in progress cannot be cancelled, so this waits for one read
        (``read_timeout``, the transfer timeout) and the releases. False if a thread is still running then (its
        memory must stay registered)."""
        lanes = self.lanes.close()
        self._stopping.set()
        for lane in lanes:
            lane.plans.put(None)
        deadline = time.monotonic() + read_timeout + 2 * self.side_channel_timeout + 5
        for lane in lanes:
            lane.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        running = [lane.thread.name for lane in lanes if lane.thread.is_alive()]
        if running:
            logger.error("pull threads %s still running after %.0f s (a Mooncake read in progress)", running,
                         read_timeout + 2 * self.side_channel_timeout + 5)
        return not running

    # ------------------------------------------------------------------ the threads

    def _run(self, lane: Lane) -> None:
        # One per thread: REQ sockets are not shareable.
        client = SideChannelClient(self.side_channel_timeout, auth=self.auth)
        with self._clients_lock:
            self._clients.append(client)
        try:
            while True:
                plan = lane.plans.get()
                if plan is None:
                    return
                t0 = time.perf_counter()
                published: list[PullResult] = []

                def publish(result: PullResult, t0: float = t0, published: list[PullResult] = published) -> None:
                    if not published:  # exactly one result per plan
                        published.append(result)
                        claim = self._claim_seconds.pop(result.request_id, None)
                        with self._results_lock:
                            self._results.append(TimedResult(result, time.perf_counter() - t0, claim))
                        if self.on_result is not None:
                            self.on_result()

                job: ConsumerPull | None = None
                try:
                    plan, sources, job = self._start(plan, client)
                    publish(self._drive(plan, sources, job, client, publish))
                except Exception as exc:  # never lose a plan: vLLM would wait for it forever
                    logger.exception("pull of %s crashed", plan.request_id)
                    publish(_crash_result(plan, exc))
                    self._release_after_crash(plan, job, client, exc)
                finally:
                    self.lanes.done(lane)
        finally:
            with self._clients_lock:
                self._clients.remove(client)
            client.close()

    def _start(self, plan: PullPlan, client: SideChannelClient) -> tuple[PullPlan, tuple[Source, ...], ConsumerPull]:
        """The plan (failed already when the layouts cannot pair, or its P is suspect and silent), the P ranks it
        involves and its pull state machine."""
        try:
            sources = self.sources_for(plan.remote) if plan.contact_p else ()
        except UnsupportedLayout as exc:
            plan = dataclasses.replace(plan, error=f"cannot pair layouts: {exc}", failure=Failure.INCOMPATIBLE)
            sources = (Source(self.tp_rank % max(1, plan.remote.tp_size)),)
        if sources and not plan.error:
            plan = self.suspects.check(plan, (plan.remote.remote_host, plan.remote.remote_port), client)
        if sources and not plan.error:
            plan = self.rank_tables.resolve(plan, client, self.side_channel_timeout)
        return plan, sources, self._new_pull(plan, sources)

    def _new_pull(self, plan: PullPlan, sources: tuple[Source, ...]) -> ConsumerPull:
        return ConsumerPull(
            plan, sources, self.reader, self.local,
            claim_wait=self.claim_wait, max_batch_entries=self.max_batch_entries, now=time.monotonic(),
            timeout=self.pull_timeout, release_timeout=self.side_channel_timeout, claim_id=secrets.token_hex(16),
            wall_now_ms=time.time_ns() // 1_000_000, sampled_units=self.sampled_units,
            integrity=pull_mode(self.integrity, plan.request_id, self.sampled_pulls),  # this pull's share
        )

    def _drive(self, plan: PullPlan, sources: tuple[Source, ...], job: ConsumerPull, client: SideChannelClient,
               publish: Callable[[PullResult], None]) -> PullResult:
        """One plan, start to finish. Whatever happens, P is sent a release and the result says whether vLLM
        must be told (only when it is waiting for the receive). A failure is published at once, before the
        releases (they cannot change it); a success only once P confirmed it at release."""
        host, base_port = plan.remote.remote_host, plan.remote.remote_port
        instance = (host, base_port)
        debug = logger.isEnabledFor(logging.DEBUG)
        failure_out = False  # a failure is published (and its P noted) once, at once, before the releases
        for _ in range(1_000_000):  # bounded: every action makes progress or waits <= 50 ms until the deadline
            if self._stopping.is_set():
                job.abort("the engine is shutting down")
            action = job.next_action(time.monotonic())
            if debug and not isinstance(action, Wait):  # follow a request: P's hold id ties it to P's DEBUG lines
                logger.debug("pull of %s (P's %s, hold %s): %s%s", plan.request_id, plan.remote.remote_request_id,
                             plan.remote.remote_hold_id, type(action).__name__,
                             f" with P rank {action.source.p_rank}" if hasattr(action, "source") else "")
            started = time.monotonic()
            self._perform(plan, job, action, client, host, base_port)
            if isinstance(action, SendClaim) and plan.request_id not in self._claim_seconds:
                self._claim_seconds[plan.request_id] = time.monotonic() - started
            if isinstance(action, Finish):
                if job.failed:
                    self._forget(plan, sources)
                self.suspects.note(plan, instance, action.result)
                return action.result
            if job.failed and not failure_out:
                failure_out = True
                failure = job.result()
                # Before the result is out: a plan for the same P on its other lane must already see it suspect.
                self.suspects.note(plan, instance, failure)
                publish(failure)
            took = time.monotonic() - started
            if took > SLOW_ACTION_S and not isinstance(action, Wait):
                logger.warning("pull of %s: %s with P rank %d took %.1f s (P busy or the network slow; bounded by "
                               "%s)", plan.request_id, type(action).__name__, action.source.p_rank, took,
                               "transfer_timeout" if isinstance(action, ReadBatch) else "side_channel_timeout")
        raise RuntimeError(f"pull of {plan.request_id} did not finish")

    def _perform(self, plan: PullPlan, job: ConsumerPull, action: object, client: SideChannelClient, host: str,
                 base_port: int) -> None:
        """Carry out one action of the pull state machine and feed its outcome back."""
        if isinstance(action, Finish):
            self._finished(plan, action.result)
        elif isinstance(action, Wait):
            time.sleep(max(0.0, min(0.05, action.until - time.monotonic())))
        elif isinstance(action, FetchRegistration):
            endpoint = plan.p_endpoint(action.source.p_rank)
            cached = self._registrations.get(endpoint)
            r = plan.remote
            if cached is not None and (cached.engine_id, cached.incarnation) != (r.remote_engine_id,
                                                                                r.remote_incarnation):
                cached = None  # P restarted at this endpoint (or the params are not from it): fetch and check
            if cached is None:
                self._registrations.pop(endpoint, None)  # P restarted, or these params are not for it
                if action.join_claim:  # a new P: its registration comes with the claim's reply
                    job.with_claim(action.source)
                    return
            reg, err, answered = cached, "", None
            if cached is None:
                fetched, err, answered = self._ask(client, *endpoint, GetRegistration(action.source.p_rank), job,
                                                   Registration)
                reg = fetched.registration if fetched is not None else None
            if job.on_registration(action.source, reg, err, answered=answered) and reg is not None:
                put_recent(self._registrations, endpoint, reg)
            elif cached is not None:  # these params do not fit it: fetch afresh next time
                self._registrations.pop(endpoint, None)
        elif isinstance(action, SendClaim):
            endpoint = plan.p_endpoint(action.source.p_rank)
            reply, err, answered = self._ask(client, *endpoint, action.message, job, ClaimReply)
            if (job.on_claim_reply(action.source, reply, time.monotonic(), err, answered=answered)
                    and reply is not None):
                assert reply.registration is not None
                put_recent(self._registrations, endpoint, reply.registration)
        elif isinstance(action, SendRenew):
            reply, err, answered = self._ask(client, *plan.p_endpoint(action.source.p_rank), action.message, job,
                                             ClaimReply)
            job.on_renewed(action.source, reply, time.monotonic(), err, answered=answered)
        elif isinstance(action, ReadBatch):
            slot = self.lanes.read_slot((host, base_port))
            if not slot.acquire(timeout=min(READ_SLOT_WAIT_S, job.time_left(time.monotonic()))):
                return  # another pull from this P is reading: look at the lease and the deadline, then again
            try:
                started = time.monotonic()
                try:
                    self.engine.read(action.segment, action.descriptors)
                except TransferEngineError as first:
                    # The first read from a new peer opens its segment; under load that can fail at once. A read
                    # that failed only after a while (a timeout) is not repeated: it would double the overrun of
                    # the pull's deadline, which cannot cancel a read in progress.
                    if time.monotonic() - started > READ_RETRY_WITHIN or not job.time_left(time.monotonic()):
                        raise
                    logger.warning("read from %s failed at once (%s); retrying once (each read is bounded by "
                                   "transfer_timeout)", action.segment, first)
                    self.engine.read(action.segment, action.descriptors)
                job.on_batch_done(action.source, True)
            except TransferEngineError as exc:
                job.on_batch_done(action.source, False, str(exc))
            finally:
                slot.release()
        elif isinstance(action, SendRelease):
            mine: list[tuple[int, int]] | None = None

            def local_sums() -> None:  # D's sums while P computes its own (D's copies do not change meanwhile)
                nonlocal mine
                mine = self._local_sums(plan, action.verification)

            budget = job.time_left(time.monotonic())
            if job.failed and job.result().failure is Failure.UNREACHABLE:
                # P just did not answer: one short try, so that the lane is free for the next plan; P's hold
                # timeout frees the blocks if this one is lost too.
                budget = min(budget, PROBE_TIMEOUT_S)
            try:
                answer = client.request(*plan.p_endpoint(action.source.p_rank), action.message, timeout=budget,
                                        meanwhile=local_sums if action.verification is not None else None)
            except PeerError as exc:
                # P answered, with an error: it is up, only did not take the release (an older P whose deferred
                # answers were full said "try again"). Sent again within the budget; never "unreachable".
                logger.info("release of %s to P rank %d answered with an error (%s); sending it again",
                            plan.request_id, action.source.p_rank, exc)
                job.on_release_refused(action.source, time.monotonic(), str(exc))
                return
            except SideChannelError as exc:
                # P is gone or unreachable: its hold timeout frees the blocks; its other ranks are not tried.
                logger.warning("release of %s to P rank %d not delivered (%s); its other ranks are not tried, P's "
                               "hold_timeout frees the blocks", plan.request_id, action.source.p_rank, exc)
                job.on_release_failed(action.source)
                return
            released = answer if isinstance(answer, Released) else None
            theirs = released.sums if released is not None and mine is not None else None
            lost = released is not None and released.sums_lost and action.verification is not None
            if lost:
                logger.warning("pull of %s: P rank %d had answered this release's integrity question, but that answer "
                               "did not reach D and P no longer keeps it (D resent the release: P took longer than "
                               "D's first wait to sum, e.g. integrity=full on large holds); the pull counts as "
                               "sums_lost, not verified", plan.request_id, action.source.p_rank)
            job.on_release_sent(action.source, released is not None and released.lease_held, mine or (), theirs,
                                lost, released.no_sums if released is not None else "")

    def _local_sums(self, plan: PullPlan, verification: Verification | None) -> list[tuple[int, int]] | None:
        """D's sums over its copies of the units the release asks P about; None when none are asked or they
        cannot be computed (the pull then counts as unverified, not as corrupted)."""
        if verification is None or self.memory is None:
            return None
        if self.before_verify is not None:
            self.before_verify(plan, verification)
        try:
            runs = [(r.addr, r.offset, r.length, r.unit) for r in verification.local_runs]
            return self.memory.sums(runs, len(verification.query.units))
        except Exception as exc:  # noqa: BLE001 - a bug here must not fail a good pull
            logger.warning("integrity sums of %s on D failed: %s", plan.request_id, exc)
            return None

    def sources_for(self, remote: RemotePrefill) -> tuple[Source, ...]:
        """The P ranks this rank reads (with head slices) or only releases, for P's layout in the params: the TP
        mapping in every P stage (vllm_kvp2p/lifecycle/stages.py)."""
        local = self.local
        p = Layout(remote.tp_size, local.total_num_kv_heads, local.use_mla)
        d = Layout(self.tp_size, local.total_num_kv_heads, local.use_mla)
        return sources_of(rank_plan(p, d, self.tp_rank), remote.tp_size, remote.pp_size, local.pp_size)

    def _release_after_crash(self, plan: PullPlan, job: ConsumerPull | None, client: SideChannelClient,
                             exc: Exception) -> None:
        """The releases a crashed pull still owes, as its state machine gives them: each lease with its token (P
        ignores a live lease's release without it and keeps the blocks until the lease lapses)."""
        try:
            if job is None:  # it crashed before its pull began: no lease is held, the P ranks are only notified
                job = self._new_pull(plan, self.sources_for(plan.remote) if plan.contact_p else ())
            job.on_crash(f"internal error: {exc}")
            for _ in range(MAX_ENGINE_RANKS + 1):  # a release each at most, then Finish
                action = job.next_action(time.monotonic())
                if not isinstance(action, SendRelease):
                    return
                self._perform(plan, job, action, client, plan.remote.remote_host, plan.remote.remote_port)
        except Exception as again:  # P's lease or hold timeout frees the blocks in the end
            logger.warning("release of %s after a crash not delivered: %s", plan.request_id, again)

    def _forget(self, plan: PullPlan, sources: tuple[Source, ...]) -> None:
        """A failed pull drops the registrations and the rank table it used: the next pull from that P fetches and
        checks afresh."""
        for source in sources:
            self._registrations.pop(plan.p_endpoint(source.p_rank), None)
        self.rank_tables.forget((plan.remote.remote_host, plan.remote.remote_port))

    @staticmethod
    def _ask(
        client: SideChannelClient, host: str, port: int, message: Request, job: ConsumerPull, expected: type[R]
    ) -> tuple[R | None, str, Failure | None]:
        """P's reply, of the ``expected`` type; or None, why not, and, when P answered but the exchange failed
        (P is up then), how: UNAUTHENTICATED, or INCOMPATIBLE for a reply D does not accept."""
        try:
            reply = client.request(host, port, message, timeout=job.time_left(time.monotonic()))
        except Unauthenticated as exc:
            return None, str(exc), Failure.UNAUTHENTICATED
        except BadReply as exc:
            return None, str(exc), Failure.INCOMPATIBLE
        except SideChannelError as exc:
            return None, str(exc), None
        if not isinstance(reply, expected):
            return None, f"unexpected reply {type(reply).__name__}", Failure.INCOMPATIBLE
        return reply, "", None

    def _finished(self, plan: PullPlan, result: PullResult) -> None:
        self._log.finished(result)
        if not result.reason and result.num_blocks and self.after_pull is not None:
            self.after_pull(plan, result)


def _crash_result(plan: PullPlan, exc: Exception) -> PullResult:
    outcome = Outcome.FAILED if plan.awaiting else Outcome.NOTHING_TO_PULL
    return PullResult(
        plan.request_id, outcome, plan.awaiting, plan.all_local_block_ids, reason=f"internal error: {exc}",
        failure=Failure.INTERNAL,
    )
